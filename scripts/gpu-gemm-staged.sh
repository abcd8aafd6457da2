#!/usr/bin/env bash
# The staged GEMM tile (kernels.cu gemm_staged: each chunk's operands copied into shared memory ahead of use)
# against the GEMV and the older tile (gemm_mma), in one device call:
#   scripts/gpu-gemm-staged.sh BINARY OUTDIR
# Checks: `selftest --device cuda` compares both tiles with the GEMV bit for bit on every bf16 matrix kind at 17, 40, 64
# and 100 rows, and the staged tile over native Q4_K / scaled-int8 tiles with the bf16 GEMV at 40 and 100 rows (tiny
# models of each weight type, the random qwen2.5-1.5b shape). Timings, alternating: the forward of 1..128 rows
# after a short context with the GEMV only (SPECULA_CUDA_GEMM_ROWS=0, the default), the staged tile from 17 rows
# (SPECULA_CUDA_GEMM=staged SPECULA_CUDA_GEMM_ROWS=17), then a 1200-token prompt's prefill each way, two rounds.
set -uo pipefail
bin="$1"
out="$2"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/summary.txt"
for m in tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm; do
    timeout 120 "$bin" selftest -m "fuzz/seeds/gguf/$m.gguf" --device cuda > "$out/st-$m.log" 2>&1
    echo "== selftest $m rc=$? $(grep verdict "$out/st-$m.log") staged: $(grep -c 'staged GEMM tile.*ok' "$out/st-$m.log") ok, $(grep 'staged GEMM tile' "$out/st-$m.log" | grep -vc ' ok') not" |
        tee -a "$out/summary.txt"
done
s=qwen2.5-1.5b
for mode in gemv staged; do
    env_args=(SPECULA_CUDA_GEMM_ROWS=0)
    [ "$mode" = staged ] && env_args=(SPECULA_CUDA_GEMM=staged SPECULA_CUDA_GEMM_ROWS=17)
    env "${env_args[@]}" timeout 300 "$bin" selftest --random-weights "$s" --device cuda --verify-rows 128 \
        > "$out/st-$s-$mode.log" 2>&1
    echo "== selftest random $s, $mode: rc=$? $(grep verdict "$out/st-$s-$mode.log")" | tee -a "$out/summary.txt"
    grep -E "FAILED|staged GEMM tile.*(LM head|down).*100 rows|forward of n rows" "$out/st-$s-$mode.log" | cut -c1-1500 |
        tee -a "$out/summary.txt"
done
long_prompt=$(python3 -c 'print(" ".join(f"word{i % 97} and" for i in range(600)))')
for rep in 1 2; do
    for mode in gemv staged; do
        env_args=(SPECULA_CUDA_GEMM_ROWS=0)
        [ "$mode" = staged ] && env_args=(SPECULA_CUDA_GEMM=staged SPECULA_CUDA_GEMM_ROWS=17)
        echo "== prefill $s, $mode, round $rep: $(env "${env_args[@]}" timeout 120 "$bin" generate --random-weights "$s" \
            --device cuda --raw -p "$long_prompt" -n 16 --ignore-eos --quiet 2>&1 | grep -E "^prompt")" |
            tee -a "$out/summary.txt"
    done
done
# The real model where one is placed (MODELS=DIR holding qwen2.5-coder-1.5b.gguf, its Q4_K / Q6_K tiles native):
# the same greedy text either way, and the prefill's speed.
if [ -n "${MODELS:-}" ] && [ -f "$MODELS/qwen2.5-coder-1.5b.gguf" ]; then
    for rep in 1 2; do
        for mode in gemv staged; do
            env_args=(SPECULA_CUDA_GEMM_ROWS=0)
            [ "$mode" = staged ] && env_args=(SPECULA_CUDA_GEMM=staged SPECULA_CUDA_GEMM_ROWS=17)
            env "${env_args[@]}" SPECULA_CACHE="$MODELS" timeout 120 "$bin" generate -m qwen2.5-coder-1.5b --device cuda \
                --raw -p "$long_prompt" -n 32 > "$out/real-$mode.txt" 2> "$out/real-$mode.err"
            echo "== real prefill, $mode, round $rep: $(grep -hE '^prompt' "$out/real-$mode.err" | head -1)" |
                tee -a "$out/summary.txt"
        done
        if cmp -s "$out/real-gemv.txt" "$out/real-staged.txt"; then same=same; else same=DIFFERS; fi
        echo "== real greedy text, round $rep: $same" | tee -a "$out/summary.txt"
    done
fi
