#!/usr/bin/env bash
# Profiles of the plain and the head server at LEVEL streams on this CPU (after a warm-up level); traces in
# OUT (default /tmp) as cpu-trace-{plain,head}-LEVEL.json, for scripts/serve-profile-summary.py. TARGET and HEAD
# name another registry pair (default qwen2.5-coder-1.5b and its head).
cd "$(dirname "$0")/.."
B=${SPECULA_BIN:-target/release/specula}; P=${PROMPTS:-../shared/prompts/code.jsonl}
L=${LEVEL:-8}; T=${TARGET:-qwen2.5-coder-1.5b}; H=${HEAD:-qwen2.5-coder-1.5b-eagle3}
for cfg in plain head; do
  prof=$(mktemp -d); port=$((8930 + RANDOM % 50))
  flags=""; [ $cfg = head ] && flags="--draft eagle3 --draft-model $H"
  $B serve -m $T -t 2 --port $port $flags --profile-dir $prof > "${OUT:-/tmp}/prof-$cfg.log" 2>&1 & pid=$!
  for _ in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
  $B bench-serve --url http://127.0.0.1:$port --prompts $P --limit 8 --requests 16 --concurrency $L -n 64 --ignore-eos --quiet > /dev/null 2>&1
  curl -s -X POST localhost:$port/start_profile > /dev/null
  echo "$cfg $($B bench-serve --url http://127.0.0.1:$port --prompts $P --limit 8 --requests 16 --concurrency $L -n 128 --ignore-eos --quiet 2>&1 | grep -E '^ +[0-9]')"
  curl -s -X POST localhost:$port/stop_profile > /dev/null
  mv $prof/specula-trace-*.json "${OUT:-/tmp}/cpu-trace-$cfg-$L.json"
  kill $pid; wait $pid 2>/dev/null
done
