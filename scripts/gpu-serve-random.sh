#!/usr/bin/env bash
# The head server's host cost per step, on random weights (no real model has to reach the device), one device call:
#   scripts/gpu-serve-random.sh BINARY WRITE_RANDOM_HEAD OUTDIR [SHAPE]
# WRITE_RANDOM_HEAD is the `write_random_head` example's binary; it writes a random head for SHAPE (default
# qwen2.5-1.5b), which accepts next to nothing, so the head server drafts little, as the real head server does
# from 8 streams on (docs/benchmarks.md, session 22), and what separates it from plain is its bookkeeping: captured
# hidden states copied out every step, the draft budget, the head's state per request. Servers in the order
# plain, head with SPECULA_CUDA_OUTPUT_POOL=0, head, plain, head (pool off), head; each through LEVELS (default
# 8,16,32) with REQUESTS (default 128) requests a level of 128 tokens. Summary last.
set -uo pipefail
bin="$1"; writer="$2"; out="$3"; shape="${4:-qwen2.5-1.5b}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
work=$(mktemp -d)
summary="$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
"$writer" "$work/head" "$shape" || { echo "writing the random head failed" >> "$summary"; cat "$summary"; exit 1; }
for i in $(seq 0 15); do
    echo "{\"id\": \"r$i\", \"prompt\": \"request $i: write a function that sorts a list of $((i + 3)) numbers\"}"
done > "$work/prompts.jsonl"
port=8900
serve() { # name pool(0/1) flags...
    local name=$1 pool=$2; shift 2
    port=$((port + 1))
    SPECULA_CUDA_OUTPUT_POOL=$pool "$bin" serve -m "random:$shape" --device cuda --port "$port" --max-batch 32 "$@" \
        > "$work/serve-$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    timeout 240 "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$work/prompts.jsonl" --ignore-eos --raw -n 128 \
        --requests "${REQUESTS:-128}" --concurrency "${LEVELS:-8,16,32}" --quiet > "$work/bench-$name.txt" 2>&1
    echo "== $name" >> "$summary"
    grep -E "^ +[0-9]+ " "$work/bench-$name.txt" >> "$summary"
    if ! grep -qE "^ +[0-9]+ +[0-9.]+ +[1-9]" "$work/bench-$name.txt"; then
        echo "  no tokens from $name; its log ends:" >> "$summary"
        tail -3 "$work/serve-$name.log" | cut -c1-300 >> "$summary"
        tail -3 "$work/bench-$name.txt" | cut -c1-300 >> "$summary"
    fi
    curl -s "localhost:$port/metrics" | grep -E "^specula:spec_decode_num_(draft|accepted)_tokens " >> "$summary"
    kill "$pid"; wait "$pid" 2>/dev/null
}
e3=(--draft eagle3 --draft-model "$work/head" --draft-tokens 3 --draft-confidence 0)
serve plain 1
serve head-nopool 0 "${e3[@]}"
serve head-pool 1 "${e3[@]}"
serve plain-2 1
serve head-nopool-2 0 "${e3[@]}"
serve head-pool-2 1 "${e3[@]}"
cat "$summary"
