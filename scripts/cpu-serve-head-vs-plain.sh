#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b (TARGET / HEAD name another registry pair, e.g. smollm2-135m and smollm2-135m-eagle3): a plain server and the EAGLE-3 head's server (adaptive budget) up at once,
# alternating level by level (plain, head, plain, head, ...), after one warm-up level each; then each server's
# speculative counters. With AB_ENV="VAR=VALUE ..." a third server, the head's with that environment (a rule
# turned off, say), runs after the head at each level.
#   [TARGET=...] [HEAD=...] [LEVELS="16 8"] [REPS=2] [REQUESTS=16] [TOKENS=64] [AB_ENV=...] [SPECULA_BIN=target/release/specula] scripts/cpu-serve-head-vs-plain.sh
set -uo pipefail
cd "$(dirname "$0")/.."
P=${PROMPTS:-../shared/prompts/code.jsonl}; B=${SPECULA_BIN:-target/release/specula}
T=${TARGET:-qwen2.5-coder-1.5b}; H=${HEAD:-qwen2.5-coder-1.5b-eagle3}
$B serve -m $T -t 2 --port 8921 > /tmp/hvp-plain.log 2>&1 & p1=$!
$B serve -m $T -t 2 --port 8922 --draft eagle3 --draft-model $H \
    > /tmp/hvp-head.log 2>&1 & p2=$!
ports="8921 8922"; p3=""
if [ -n "${AB_ENV:-}" ]; then
    # shellcheck disable=SC2086
    env $AB_ENV $B serve -m $T -t 2 --port 8923 --draft eagle3 \
        --draft-model $H > /tmp/hvp-head-b.log 2>&1 & p3=$!
    ports="$ports 8923"
fi
for port in $ports; do for _ in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done; done
bench() {
    $B bench-serve --url http://127.0.0.1:$1 --prompts "$P" --requests "${REQUESTS:-16}" --concurrency $2 \
        -n "${TOKENS:-64}" --ignore-eos --quiet 2>&1 | grep -E '^ +[0-9]'
}
for port in $ports; do bench $port 8 > /dev/null; done
for level in ${LEVELS:-16 8}; do for rep in $(seq "${REPS:-2}"); do
    echo "plain $level $rep $(bench 8921 $level)"; echo "head  $level $rep $(bench 8922 $level)"
    [ -n "$p3" ] && echo "headB $level $rep $(bench 8923 $level)"
done; done
for port in $ports; do
    echo "$port $(curl -s localhost:$port/metrics | grep -E '^specula:spec_decode_num_(draft|accepted)_tokens ' | tr '\n' ' ')"
done
kill $p1 $p2 $p3; wait
