#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b: plain and two EAGLE-3 head servers up at once, the head's catch-up reach at its
# default (64 tokens on a CPU) and at REACH (SPECULA_HEAD_CATCH_UP_REACH), on long prompts (scripts/long-prompts.py
# over shared/prompts/code.jsonl, ~480 tokens), alternating, REPS rounds; then each head server's counters.
#   [REACH=512] [LEVEL=2] [REQUESTS=8] [TOKENS=64] [REPS=2] [SPECULA_BIN=target/release/specula] scripts/cpu-serve-head-reach.sh
set -uo pipefail
cd "$(dirname "$0")/.."
B=${SPECULA_BIN:-target/release/specula}; P=$(mktemp --suffix .jsonl)
python3 scripts/long-prompts.py ../shared/prompts/code.jsonl "$P" 8
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8931 > /tmp/reach-plain.log 2>&1 & p1=$!
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8932 --draft eagle3 --draft-model qwen2.5-coder-1.5b-eagle3 \
    > /tmp/reach-default.log 2>&1 & p2=$!
SPECULA_HEAD_CATCH_UP_REACH=${REACH:-512} $B serve -m qwen2.5-coder-1.5b -t 2 --port 8933 --draft eagle3 \
    --draft-model qwen2.5-coder-1.5b-eagle3 > /tmp/reach-long.log 2>&1 & p3=$!
for port in 8931 8932 8933; do for _ in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done; done
bench() {
    $B bench-serve --url http://127.0.0.1:$1 --prompts "$P" --requests "${REQUESTS:-8}" --concurrency "${LEVEL:-2}" \
        -n "${TOKENS:-64}" --ignore-eos --quiet 2>&1 | grep -E '^ +[0-9]'
}
for rep in $(seq "${REPS:-2}"); do
    echo "plain         $rep $(bench 8931)"; echo "head, 64      $rep $(bench 8932)"; echo "head, ${REACH:-512} $rep $(bench 8933)"
done
for port in 8932 8933; do
    echo "$port $(curl -s localhost:$port/metrics | grep -E '^specula:spec_decode_num_(draft|accepted)_tokens ' | tr '\n' ' ')"
done
kill $p1 $p2 $p3; wait; rm -f "$P"
