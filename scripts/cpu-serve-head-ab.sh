#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b with its EAGLE-3 head: the head servers of two builds up at once, alternating level
# by level (old, new, old, new, ...).
#   OLD=path/to/old/specula [LEVELS="4 8"] [REPS=3] [NATURAL=1] scripts/cpu-serve-head-ab.sh
# NATURAL=1: answers of natural length (-n 512, no --ignore-eos), max(8, 2 x level) requests a level.
cd "$(dirname "$0")/.."
P=${PROMPTS:-../shared/prompts/code.jsonl}
"${OLD:?set OLD to the other build}" serve -m qwen2.5-coder-1.5b -t 2 --port 8911 --draft eagle3 --draft-model qwen2.5-coder-1.5b-eagle3 > /tmp/hab-old.log 2>&1 & p1=$!
target/release/specula serve -m qwen2.5-coder-1.5b -t 2 --port 8912 --draft eagle3 --draft-model qwen2.5-coder-1.5b-eagle3 > /tmp/hab-new.log 2>&1 & p2=$!
for port in 8911 8912; do for _ in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done; done
bench() {
  local n=16 length="-n 128 --ignore-eos"
  if [ "${NATURAL:-0}" = 1 ]; then length="-n 512"; n=$((2 * $2 > 8 ? 2 * $2 : 8)); fi
  # shellcheck disable=SC2086
  target/release/specula bench-serve --url http://127.0.0.1:$1 --prompts $P --limit 8 --requests $n --concurrency $2 $length --quiet 2>&1 | grep -E '^ +[0-9]'
}
bench 8911 8 > /dev/null; bench 8912 8 > /dev/null
for level in ${LEVELS:-4 8}; do for rep in $(seq ${REPS:-3}); do
  echo "old $level $rep $(bench 8911 $level)"; echo "new $level $rep $(bench 8912 $level)"
done; done
for port in 8911 8912; do echo "$port $(curl -s localhost:$port/metrics | grep -E '^specula:spec_decode_num_(draft|accepted)_tokens ' | tr '\n' ' ')"; done
kill $p1 $p2; wait
