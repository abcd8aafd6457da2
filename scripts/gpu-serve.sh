#!/usr/bin/env bash
# Continuous batching on the GPU, in one device call (docs/benchmarks.md records its output):
#   scripts/gpu-serve.sh BINARY OUTDIR PROMPTS.jsonl
# correctness first (the tiny models' GPU-against-CPU selftest, which covers batched sequences and prefill), then
# for each random real shape: `specula generate` alone (the batch-1 reference), and `specula serve` driven by
# `specula bench-serve` at several concurrency levels (raw completions, ignore_eos, 128 tokens each).
set -uo pipefail
bin="$1"
out="$2"
prompts="$3"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for m in tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm; do
    echo "== selftest $m"
    timeout 120 "$bin" selftest -m "fuzz/seeds/gguf/$m.gguf" --device cuda 2>&1 | grep -E "verdict|FAILED"
done
port=8500
for s in qwen2.5-1.5b llama-3.1-8b; do
    echo "== generate $s alone"
    timeout 120 "$bin" generate --random-weights "$s" --device cuda -p "hello world, this is a test" -n 128 \
        --ignore-eos --raw --quiet --profile off 2>&1 | grep -E "^prompt"
    port=$((port + 1))
    "$bin" serve --random-weights "$s" --device cuda --port "$port" --max-batch 32 > "$out/serve-$s.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    echo "== serve $s"
    timeout 300 "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$prompts" --raw --ignore-eos -n 128 \
        --requests 32 --concurrency 1,2,4,8,16,32 --quiet --json "$out/bench-serve-$s.json" 2>&1
    curl -s "localhost:$port/metrics" > "$out/metrics-$s.txt"
    grep -E "^specula:step_(batch_size|rows)_(sum|count)|^specula:step_phase_seconds_(sum|count)\{phase=\"verify\"" \
        "$out/metrics-$s.txt"
    kill "$pid"; wait "$pid" 2>/dev/null
done
