#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b: a plain server, the 0.5B draft model's server (adaptive draft budget), then plain
# again, one after the other, each driven through the same levels. Prints bench-serve's table per server and the
# draft server's speculative counters.
#   [LEVELS=1,2,4,8] [REQUESTS=8] [TOKENS=64] [SPECULA_BIN=target/release/specula] scripts/cpu-serve-draft-model.sh
set -uo pipefail
cd "$(dirname "$0")/.."
B=${SPECULA_BIN:-target/release/specula}; P=${PROMPTS:-../shared/prompts/code.jsonl}
port=8700
run() { # name flags...
  local name=$1; shift; port=$((port + 1))
  $B serve -m qwen2.5-coder-1.5b --port $port "$@" > "/tmp/cpu-serve-$name.log" 2>&1 & local pid=$!
  for _ in $(seq 300); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.5; done
  echo "== $name"
  $B bench-serve --url http://127.0.0.1:$port --prompts "$P" -n "${TOKENS:-64}" --ignore-eos \
    --requests "${REQUESTS:-8}" --concurrency "${LEVELS:-1,2,4,8}" --quiet 2>&1 | grep -E "^ +[0-9]+ |conc"
  curl -s localhost:$port/metrics | grep -E "^specula:spec_decode_(num_accepted_tokens|num_draft_tokens|num_drafts) "
  kill $pid; wait $pid 2>/dev/null
}
run plain
run adaptive --draft-model qwen2.5-coder-0.5b --draft-tokens 3 --draft-confidence 0
run plain-2
