#!/usr/bin/env bash
# The speculative server's draft budget on the device, profiled level by level (one device call):
#   HEAD=DIR [LEVELS=1,4] [K=3] [REQUESTS=32] scripts/gpu-serve-profile.sh BINARY OUTDIR MODELDIR PROMPTS.jsonl
# `specula serve --device cuda` with the EAGLE-3 head in HEAD (adaptive drafts, up to K tokens, no bar), and for
# each level a profile (POST /start_profile, bench-serve with REQUESTS requests of 128 tokens, POST /stop_profile) whose
# trace is summarized by scripts/serve-profile-summary.py: which steps drafted, expected against measured, and the
# budget's refusals with the prices it used. Traces land in OUTDIR as trace-LEVEL.json.
set -uo pipefail
bin="$1"; out="$2"; models="$3"; prompts="$4"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
head=${HEAD:?set HEAD to the EAGLE-3 head directory}
prof=$(mktemp -d)
"$bin" serve -m qwen2.5-coder-1.5b --device cuda --port 8700 --max-batch 32 --draft eagle3 --draft-model "$head" \
    --draft-tokens "${K:-3}" --draft-confidence 0 --profile-dir "$prof" > "$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 120); do curl -sf localhost:8700/health > /dev/null && break; sleep 1; done
levels=${LEVELS:-1,4}
for level in ${levels//,/ }; do
    curl -s -X POST localhost:8700/start_profile > /dev/null
    echo "== $level streams"
    timeout 200 "$bin" bench-serve --url http://127.0.0.1:8700 --prompts "$prompts" --ignore-eos -n 128 \
        --requests "${REQUESTS:-32}" --concurrency "$level" --quiet 2>&1 | tail -2
    curl -s -X POST localhost:8700/stop_profile > /dev/null
    mv "$prof"/specula-trace-*.json "$out/trace-$level.json"
    rm -f "$prof"/*
    python3 scripts/serve-profile-summary.py "$out/trace-$level.json"
done
kill "$pid"; wait "$pid" 2>/dev/null
