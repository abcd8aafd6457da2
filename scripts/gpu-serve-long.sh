#!/usr/bin/env bash
# Long mixed prompts at 16 streams on the GPU (docs/benchmarks.md, session 41): plain against the head server and
# variants, one server after the other, each warmed up on short prompts, then profiled over LONG (made by
# scripts/mixed-long-prompts.py); prints each trace's time by kind of step (scripts/serve-time-by-kind.py).
#   [CONFIGS="plain head-old head plain head-old head plain"] \
#     scripts/gpu-serve-long.sh BIN OUT MODELS HEAD LONG.jsonl SHORT.jsonl
# head-old: the head with session 41's prefill and prefix rules off; head-cap1: no drafter beside others;
# head-reach64: a head catch-up reach of 64; head-margin10: a 10% step margin. A call returns at most 8 files, so
# everything but the bench JSONs goes into OUT/all.tgz (at most 7 configs).
set -uo pipefail
bin="$1"; out="$2"; models="$3"; head="$4"; long="$5"; short="$6"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
e3="--draft eagle3 --draft-model $head --draft-tokens 3 --draft-confidence 0"
declare -A flags_of=([plain]="" [head]="$e3" [head-cap8]="$e3 --spec-disable-batch-size 8" [head-reach64]="$e3"
                     [head-cap1]="$e3 --spec-disable-batch-size 1" [head-margin10]="$e3" [ngram]="--draft ngram" [head-old]="$e3")
port=8800; run=0
for name in ${CONFIGS:-plain head head-cap1 head-reach64 head-margin10 plain head}; do
    run=$((run + 1)); port=$((port + 1))
    flags=${flags_of[$name]}
    reach=""; [ "$name" = head-reach64 ] && reach=64
    margin=0.02; [ "$name" = head-margin10 ] && margin=0.10
    old_prefill=""; old_prefix=1; [ "$name" = head-old ] && old_prefill=step && old_prefix=0
    tag="$run-$name"
    prof=$(mktemp -d)
    # shellcheck disable=SC2086
    SPECULA_BUDGET_PREFILL=$old_prefill SPECULA_PREFIX_OVER_DRAFTER=$old_prefix SPECULA_STEP_MARGIN=$margin SPECULA_HEAD_CATCH_UP_REACH=$reach "$bin" serve -m qwen2.5-coder-1.5b --device cuda --port "$port" --max-batch 32 \
        --profile-dir "$prof" $flags > "$out/serve-$tag.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    # Warm-up (graphs of every batch shape): short prompts at 16 and 32 streams.
    "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$short" --ignore-eos -n 64 \
        --requests 48 --concurrency 16,32 --quiet > /dev/null 2>&1
    curl -s -X POST "localhost:$port/start_profile" > /dev/null
    echo "== $tag ($flags)"
    timeout 200 "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$long" --ignore-eos -n 128 \
        --requests 64 --concurrency 16 --quiet --json "$out/bench-$tag.json" 2>&1 | tail -3
    curl -s -X POST "localhost:$port/stop_profile" > /dev/null
    sleep 1
    mv "$prof"/specula-trace-*.json "$out/trace-$tag.json" 2>/dev/null
    mv "$prof"/*report*.json "$out/report-$tag.json" 2>/dev/null
    curl -s "localhost:$port/metrics" > "$out/metrics-$tag.txt"
    grep -E "^specula:spec_decode_num_(draft|accepted)_tokens |^specula:spec_decode_(admitted_without_drafter|released_drafters|prefix_over_drafter) |^specula:prefix_cache_hits " "$out/metrics-$tag.txt" | tr '\n' ' '; echo
    kill "$pid"; wait "$pid" 2>/dev/null
    rm -rf "$prof"
done
for t in "$out"/trace-*.json; do
    python3 scripts/serve-time-by-kind.py "$t"
done
for t in "$out"/trace-*head*.json; do
    echo "=== $t"
    python3 scripts/serve-profile-summary.py "$t" 2>&1 | grep -E "^ +D |refusals"
    python3 scripts/serve-phase-table.py "$t" 2>&1 | awk 'NR <= 2 || $1 >= 15'
done
gzip "$out"/trace-*.json
tar -C "$out" -czf "$out/all.tgz" --remove-files $(cd "$out" && ls | grep -v -E "^bench-|^all.tgz")
ls "$out"
