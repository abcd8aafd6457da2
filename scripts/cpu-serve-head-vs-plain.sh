#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b: a plain server and the EAGLE-3 head's server (adaptive budget) up at once,
# alternating level by level (plain, head, plain, head, ...), after one warm-up level each; then each server's
# speculative counters.
#   [LEVELS="16 8"] [REPS=2] [REQUESTS=16] [TOKENS=64] [SPECULA_BIN=target/release/specula] scripts/cpu-serve-head-vs-plain.sh
set -uo pipefail
cd "$(dirname "$0")/.."
P=${PROMPTS:-../shared/prompts/code.jsonl}; B=${SPECULA_BIN:-target/release/specula}
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8921 > /tmp/hvp-plain.log 2>&1 & p1=$!
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8922 --draft eagle3 --draft-model qwen2.5-coder-1.5b-eagle3 \
    > /tmp/hvp-head.log 2>&1 & p2=$!
for port in 8921 8922; do for _ in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done; done
bench() {
    $B bench-serve --url http://127.0.0.1:$1 --prompts "$P" --requests "${REQUESTS:-16}" --concurrency $2 \
        -n "${TOKENS:-64}" --ignore-eos --quiet 2>&1 | grep -E '^ +[0-9]'
}
bench 8921 8 > /dev/null; bench 8922 8 > /dev/null
for level in ${LEVELS:-16 8}; do for rep in $(seq "${REPS:-2}"); do
    echo "plain $level $rep $(bench 8921 $level)"; echo "head  $level $rep $(bench 8922 $level)"
done; done
for port in 8921 8922; do
    echo "$port $(curl -s localhost:$port/metrics | grep -E '^specula:spec_decode_num_(draft|accepted)_tokens ' | tr '\n' ' ')"
done
kill $p1 $p2; wait
