#!/usr/bin/env bash
# Servers of the real Qwen2.5-Coder-1.5B one after the other at several stream counts, each config's numbers per
# level (bench-serve's table), for A/Bs of host rules under light load (docs/benchmarks.md, session 43).
#   [CONFIGS="plain head-old head head-old head plain"] [LEVELS=1,2,4,8] [REQUESTS=16] [TOKENS=128] [WARMUP=1] \
#     scripts/gpu-serve-levels.sh BIN OUT MODELS HEAD PROMPTS.jsonl
# head-old: the head with session 41's rules off (SPECULA_BUDGET_PREFILL=step SPECULA_PREFIX_OVER_DRAFTER=0).
# head-kN: the head drafting at most N tokens (head and head-old: 3), e.g. CONFIGS="plain head-k4 head-k5 plain".
# Suffixes, any order: +staged runs wide passes through the staged GEMM tile (SPECULA_CUDA_GEMM=staged
# SPECULA_CUDA_GEMM_ROWS=17), +norule drafts where the payoff rule judged no gain (SPECULA_PAYOFF_STOPS_DRAFTS=0),
# +timed times the step shapes at startup and seeds the draft budget's prices with them (SPECULA_TIME_STEPS=1),
# e.g. CONFIGS="plain head-k5 head-k5+norule plain+staged head-k5+staged".
# WARMUP=1 sends a short burst at every level first (CUDA graphs of each batch shape); WARMUP=0 measures cold.
set -uo pipefail
bin="$1"; out="$2"; models="$3"; head="$4"; prompts="$5"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
levels="${LEVELS:-1,2,4,8}"
e3="--draft eagle3 --draft-model $head --draft-tokens 3 --draft-confidence 0"
port=8900; run=0
for name in ${CONFIGS:-plain head-old head head-old head plain}; do
    run=$((run + 1)); port=$((port + 1))
    flags=""; old_prefill=""; old_prefix=1; gemm=""; gemm_rows=""; stops=""; timed=""
    base="${name%%+*}"
    case "$name" in *+staged*) gemm=staged; gemm_rows=17 ;; esac
    case "$name" in *+norule*) stops=0 ;; esac
    case "$name" in *+timed*) timed=1 ;; esac
    case "$base" in
        plain) ;;
        head) flags="$e3" ;;
        head-k[0-9]*) flags="${e3/--draft-tokens 3/--draft-tokens ${base#head-k}}" ;;
        head-old) flags="$e3"; old_prefill=step; old_prefix=0 ;;
        *) echo "unknown config $name" >&2; exit 2 ;;
    esac
    tag="$run-$name"
    # shellcheck disable=SC2086
    SPECULA_CUDA_GEMM=$gemm SPECULA_CUDA_GEMM_ROWS=$gemm_rows SPECULA_PAYOFF_STOPS_DRAFTS=$stops SPECULA_TIME_STEPS=$timed \
    SPECULA_BUDGET_PREFILL=$old_prefill SPECULA_PREFIX_OVER_DRAFTER=$old_prefix "$bin" serve -m qwen2.5-coder-1.5b \
        --device cuda --port "$port" --max-batch 32 $flags > "$out/serve-$tag.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    if [ "${WARMUP:-1}" = 1 ]; then
        "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$prompts" --ignore-eos -n 32 \
            --requests 16 --concurrency "$levels" --quiet > /dev/null 2>&1
    fi
    echo "== $tag"
    timeout 240 "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$prompts" --ignore-eos \
        -n "${TOKENS:-128}" --requests "${REQUESTS:-16}" --concurrency "$levels" --quiet \
        --json "$out/bench-$tag.json" 2>&1 | grep -E "^ *(conc|[0-9]+ )" | head -12
    curl -s "localhost:$port/metrics" | grep -E "^specula:spec_decode_num_(draft|accepted)_tokens |^specula:spec_decode_(admitted_without_drafter|released_drafters|prefix_over_drafter|payoff_refused_steps) |^specula:eagle3_head_graph_captures " | tr '\n' ' '
    echo
    kill "$pid"; wait "$pid" 2>/dev/null
done
