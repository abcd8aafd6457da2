#!/usr/bin/env bash
# One device call's worth of GPU checks and timings (docs/benchmarks.md records its output):
#   scripts/gpu-check.sh BINARY OUTDIR
# correctness on tiny models of every storage type (GPU against CPU, bitwise batch invariance), then the random
# real shapes: selftest (verify(n) curve), and generate with the device clock, the exact clock, without CUDA
# graphs, and with profiling off.
set -uo pipefail
bin="$1"
out="$2"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for m in tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm; do
    echo "== selftest $m"
    timeout 120 "$bin" selftest -m "fuzz/seeds/gguf/$m.gguf" --device cuda --json "$out/$m.json" 2>&1 |
        tee -a "$out/selftest.log" | grep -E "verdict|FAILED|agree"
done
gen() {
    timeout 120 "$bin" generate --random-weights "$1" --device cuda -p "hello world, this is a test" -n 256 \
        --ignore-eos --raw --quiet "${@:2}" 2>&1
}
for s in qwen2.5-1.5b llama-3.1-8b; do
    echo "== selftest random $s"
    timeout 200 "$bin" selftest --random-weights "$s" --device cuda --json "$out/random-$s.json" 2>&1 |
        tee -a "$out/selftest.log" | grep -E "verdict|FAILED|forward of n rows"
    echo "== generate $s (device clock)"
    gen "$s" | tee -a "$out/generate.log" | grep -E "decode|verify|sample|other|emit|commit|phase|----"
    echo "== generate $s (exact clock)"
    gen "$s" --exact-timing | tee -a "$out/generate.log" | grep -E "decode|verify|sample|other|phase"
    echo "== generate $s (no CUDA graphs)"
    SPECULA_CUDA_GRAPHS=0 gen "$s" | tee -a "$out/generate.log" | grep -E "^prompt|verify|sample"
    for rep in 1 2; do
        echo "== generate $s (profile off, then phases) round $rep"
        gen "$s" --profile off | grep -E "^prompt"
        gen "$s" | grep -E "^prompt"
    done
done
