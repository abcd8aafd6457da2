#!/usr/bin/env bash
# The GEMM tile (kernels.cu gemm_mma) against the GEMV it replaces past 16 rows, in one device call:
#   scripts/gpu-gemm.sh BINARY OUTDIR
# Checks: every tiny model's selftest (GEMM tile = GEMV bitwise on its matrices, a 40-row pass = five 8-row
# passes) and the random real shapes'. Timings, GEMM on (SPECULA_CUDA_GEMM_ROWS=17: the tile from 17 rows; the
# default is 64 since this measurement) and off (SPECULA_CUDA_GEMM_ROWS=0), alternating:
# the forward of 1..128 rows (1..64 at the 8b shape) after a short context, and a long prompt's prefill.
set -uo pipefail
bin="$1"
out="$2"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for m in tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm; do
    echo "== selftest $m"
    timeout 120 "$bin" selftest -m "fuzz/seeds/gguf/$m.gguf" --device cuda --json "$out/$m.json" 2>&1 |
        tee -a "$out/selftest.log" | grep -E "verdict|FAILED|40-row"
done
long_prompt=$(python3 -c 'print(" ".join(f"word{i % 97} and" for i in range(300)))')
for s in qwen2.5-1.5b llama-3.1-8b; do
    vrows=128
    [ "$s" = llama-3.1-8b ] && vrows=64
    for gemm in on off; do
        rows=17
        [ "$gemm" = off ] && rows=0
        echo "== selftest random $s, GEMM $gemm"
        SPECULA_CUDA_GEMM_ROWS=$rows timeout 300 "$bin" selftest --random-weights "$s" --device cuda \
            --verify-rows "$vrows" --json "$out/random-$s-$gemm.json" 2>&1 |
            tee -a "$out/selftest-$s-$gemm.log" | grep -E "verdict|FAILED|forward of n rows|GEMM tile.*LM head.*100"
    done
    for rep in 1 2; do
        for gemm in on off; do
            rows=17
            [ "$gemm" = off ] && rows=0
            echo "== prefill $s, GEMM $gemm, round $rep: $(SPECULA_CUDA_GEMM_ROWS=$rows timeout 120 "$bin" generate \
                --random-weights "$s" --device cuda --raw -p "$long_prompt" -n 16 --ignore-eos --quiet 2>&1 |
                grep -E "^prompt")"
        done
    done
done
