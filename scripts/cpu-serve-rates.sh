#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b: plain and EAGLE-3 head servers up at once under Poisson arrivals (open loop,
# `bench-serve --request-rate`), each rate run plain, head, head, plain (ABBA) so the machine's drift hits both
# alike; the same seeded arrival schedule for both.
#   [RATES="0.25 0.6 1.2"] [REQUESTS=24] [OUT=/tmp] scripts/cpu-serve-rates.sh
cd "$(dirname "$0")/.."
O=${OUT:-/tmp}
P=${PROMPTS:-../shared/prompts/code.jsonl}; B=${SPECULA_BIN:-target/release/specula}
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8911 > "$O/rates-plain.log" 2>&1 & p1=$!
$B serve -m qwen2.5-coder-1.5b -t 2 --port 8912 --draft eagle3 --draft-model qwen2.5-coder-1.5b-eagle3 > "$O/rates-head.log" 2>&1 & p2=$!
for port in 8911 8912; do for _ in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done; done
run() { $B bench-serve --url http://127.0.0.1:$1 --prompts $P --limit 8 --requests ${REQUESTS:-24} --request-rate $2 -n 128 --ignore-eos --quiet 2>&1 | grep -E '^ *[0-9.]+(/s)? ' ; }
# warm both prefix caches
run 8911 inf > /dev/null; run 8912 inf > /dev/null
echo "   rate    req/s  out tok/s  ttft p50  ttft p99   itl p50   itl p99   e2e p50   e2e p99  errors  cached steady tok/s"
for rate in ${RATES:-0.25 0.6 1.2}; do
  echo "plain $(run 8911 $rate)"; echo "head  $(run 8912 $rate)"
  echo "head  $(run 8912 $rate)"; echo "plain $(run 8911 $rate)"
done
curl -s localhost:8912/metrics | grep -E "^specula:spec_decode_(num_draft_tokens|num_accepted_tokens|admitted_without_drafter|released_drafters) "
kill $p1 $p2; wait
