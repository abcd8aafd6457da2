#!/usr/bin/env bash
# Two builds side by side in one device call (machines differ between calls by a few percent, so a change is
# measured against the build before it on the same card):
#   [TOKENS=256] scripts/gpu-ab.sh BASE_BINARY NEW_BINARY [ROUNDS]
# For each random real shape: decode tok/s (batch 1, greedy, TOKENS tokens after a 7-token prompt, profiling off)
# alternating base and new, ROUNDS times (default 3).
set -uo pipefail
base="$1"
new="$2"
rounds="${3:-3}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gen() {
    timeout 120 "$1" generate --random-weights "$2" --device cuda -p "hello world, this is a test" -n "${TOKENS:-256}" \
        --ignore-eos --raw --quiet --profile off 2>&1 | grep -E "^prompt" | grep -oE "[0-9.]+ tok/s" | tail -1
}
for s in qwen2.5-1.5b llama-3.1-8b; do
    for r in $(seq "$rounds"); do
        echo "$s round $r: base $(gen "$base" "$s"), new $(gen "$new" "$s")"
    done
done
