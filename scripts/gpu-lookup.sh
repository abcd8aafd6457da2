#!/usr/bin/env bash
# Prompt lookup on the GPU against plain decoding, on the real Qwen2.5-Coder-1.5B, over stopping bars and draft
# lengths (docs/benchmarks.md, sessions 43-44): each `specula bench` run measures plain and the drafter side by side.
#   [BARS="default 0 0.5 auto"] [KS=3,4,8] [ROUNDS=1] scripts/gpu-lookup.sh BIN OUT MODELS PROMPTS.jsonl
# "default" gives no --ngram-confidence (on a GPU: the cost-aware rule with the GPU's verify-cost prior).
set -uo pipefail
bin="$1"; out="$2"; models="$3"; prompts="$4"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
for round in $(seq "${ROUNDS:-1}"); do
    for bar in ${BARS:-default 0 0.5 auto}; do
        echo "== round $round: --ngram-confidence $bar"
        flags=(--ngram-confidence "$bar")
        [ "$bar" = default ] && flags=()
        timeout 200 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" -n 128 --draft ngram \
            "${flags[@]}" --draft-tokens "${KS:-3,4,8}" --quiet --json "$out/lookup-$round-$bar.json" \
            2>&1 | tail -8
    done
done
