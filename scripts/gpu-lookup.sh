#!/usr/bin/env bash
# Prompt lookup on the GPU against plain decoding, on the real Qwen2.5-Coder-1.5B, over stopping bars and draft
# lengths (docs/benchmarks.md, session 43): each `specula bench` run measures plain and the drafter side by side.
#   [BARS="0.5 0.2 0 auto"] [KS=3,5,8] scripts/gpu-lookup.sh BIN OUT MODELS PROMPTS.jsonl
set -uo pipefail
bin="$1"; out="$2"; models="$3"; prompts="$4"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
for bar in ${BARS:-0.5 0.2 0 auto}; do
    echo "== --ngram-confidence $bar"
    timeout 200 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" -n 128 --draft ngram \
        --ngram-confidence "$bar" --draft-tokens "${KS:-3,5,8}" --quiet --json "$out/lookup-$bar.json" \
        2>&1 | tail -8
done
