#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b: plain and EAGLE-3 head servers up at once; each level alternates them in ABBA
# order (plain, head, head, plain, ...), so the machine's drift hits both alike.
#   [LEVELS="4 8 16 1 2"] [REPS=2] [REQUESTS=16] [OUT=/tmp] [PROFILE_LEVEL=8] scripts/cpu-serve-abab.sh
# SPEC_FLAGS replaces the speculative server's flags (default: the registry EAGLE-3 head), e.g.
# SPEC_FLAGS="--draft-model qwen2.5-coder-0.5b" for the draft model's server.
# NATURAL=1: answers end where the model ends them (-n 512, no --ignore-eos), and each level sends
# max(REQUESTS, 2 x level) requests: without lock step (docs/benchmarks.md session 45).
# With PROFILE_LEVEL, each run at that level is profiled on its server: OUT/abab-trace-{plain,head}-LEVEL-REP.json
# (scripts/serve-profile-summary.py), so both servers' step times come from the same minutes.
cd "$(dirname "$0")/.."
O=${OUT:-/tmp}; D=$(mktemp -d); mkdir -p $D/plain $D/head
P=${PROMPTS:-../shared/prompts/code.jsonl}; B=${SPECULA_BIN:-target/release/specula}
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8901 --profile-dir $D/plain > "$O/abab-plain.log" 2>&1 & p1=$!
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8902 --profile-dir $D/head ${SPEC_FLAGS:---draft eagle3 --draft-model qwen2.5-coder-1.5b-eagle3} > "$O/abab-head.log" 2>&1 & p2=$!
for port in 8901 8902; do for _ in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done; done
run() {
  local n=${REQUESTS:-16} length="-n 128 --ignore-eos"
  if [ "${NATURAL:-0}" = 1 ]; then length="-n 512"; [ $((2 * $2)) -gt "$n" ] && n=$((2 * $2)); fi
  # shellcheck disable=SC2086
  $B bench-serve --url http://127.0.0.1:$1 --prompts $P --limit 8 --requests $n --concurrency $2 $length --quiet 2>&1 | grep -E '^ +[0-9]'
}
# bench PORT LEVEL [NAME REP]: profiled when LEVEL is PROFILE_LEVEL
bench() {
  if [ -n "$3" ] && [ "$2" = "${PROFILE_LEVEL:-}" ]; then
    curl -s -X POST localhost:$1/start_profile > /dev/null; run $1 $2; curl -s -X POST localhost:$1/stop_profile > /dev/null
    mv $D/$3/specula-trace-*.json "$O/abab-trace-$3-$2-$4.json"
  else run $1 $2; fi
}
# warm both prefix caches
bench 8901 8 > /dev/null; bench 8902 8 > /dev/null
for level in ${LEVELS:-4 8 16 1 2}; do
  for rep in $(seq ${REPS:-2}); do
    if [ $((rep % 2)) = 1 ]; then
      echo "plain $level $rep $(bench 8901 $level plain $rep)"; echo "head  $level $rep $(bench 8902 $level head $rep)"
    else
      echo "head  $level $rep $(bench 8902 $level head $rep)"; echo "plain $level $rep $(bench 8901 $level plain $rep)"
    fi
  done
done
curl -s localhost:8902/metrics | grep -E "^specula:spec_decode_(num_draft_tokens|num_accepted_tokens|admitted_without_drafter|released_drafters) "
kill $p1 $p2; wait
