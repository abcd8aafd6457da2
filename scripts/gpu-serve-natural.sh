#!/usr/bin/env bash
# Plain against the EAGLE-3 head server without lock step (docs/benchmarks.md, session 45): closed loop with
# natural answer lengths (-n 512, no --ignore-eos) at 1-16 streams, and open loop (Poisson arrivals at request
# rates, 128-token answers). Servers in the order of CONFIGS, each warmed up first.
#   [CONFIGS="plain head head plain"] [RATES=30,60,90] scripts/gpu-serve-natural.sh BIN OUT MODELS HEAD PROMPTS.jsonl
set -uo pipefail
bin="$1"; out="$2"; models="$3"; head="$4"; prompts="$5"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
e3="--draft eagle3 --draft-model $head --draft-tokens 3 --draft-confidence 0"
port=9100
for name in ${CONFIGS:-plain head head plain}; do
    port=$((port + 1)); tag=$port-$name
    case "$name" in
        plain) flags="" ;;
        head) flags="$e3" ;;
        *) echo "unknown config $name" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    "$bin" serve -m qwen2.5-coder-1.5b --device cuda --port "$port" --max-batch 32 $flags > "$out/serve-$tag.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 0.5; done
    url="http://127.0.0.1:$port"
    "$bin" bench-serve --url "$url" --prompts "$prompts" --ignore-eos -n 32 --requests 16 --concurrency 1,2,4,8,16 \
        --quiet > /dev/null 2>&1
    echo "== $tag: natural lengths (-n 512, no --ignore-eos)"
    timeout 120 "$bin" bench-serve --url "$url" --prompts "$prompts" -n 512 --requests 16 --concurrency 1,2 --quiet \
        --json "$out/natural12-$tag.json" 2>&1 | grep -E "^ *(conc|[0-9]+)"
    timeout 120 "$bin" bench-serve --url "$url" --prompts "$prompts" -n 512 --requests 32 --concurrency 4 --quiet \
        --json "$out/natural4-$tag.json" 2>&1 | grep -E "^ *[0-9]+"
    timeout 120 "$bin" bench-serve --url "$url" --prompts "$prompts" -n 512 --requests 96 --concurrency 8,16 --quiet \
        --json "$out/natural816-$tag.json" 2>&1 | grep -E "^ *[0-9]+"
    echo "== $tag: Poisson arrivals (-n 128 --ignore-eos, 192 requests a rate)"
    timeout 120 "$bin" bench-serve --url "$url" --prompts "$prompts" --ignore-eos -n 128 --requests 192 \
        --request-rate "${RATES:-30,60,90}" --quiet --json "$out/rate-$tag.json" 2>&1 | grep -E "^ *(rate|[0-9]+)"
    curl -s "localhost:$port/metrics" | grep -E "^specula:spec_decode_num_(draft|accepted)_tokens |^specula:spec_decode_(admitted_without_drafter|released_drafters) " | tr '\n' ' '
    echo
    kill "$pid"; wait "$pid" 2>/dev/null
done
