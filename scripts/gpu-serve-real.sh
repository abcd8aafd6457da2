#!/usr/bin/env bash
# Serving the real Qwen2.5-Coder-1.5B on the GPU, in one device call (after the models reached MODELDIR, see
# docs/gpu.md "Real models"):
#   scripts/gpu-serve-real.sh BINARY OUTDIR MODELDIR PROMPTS.jsonl
# `specula serve` plain, with prompt lookup, the 0.5B draft model or the EAGLE-3 head (adaptive draft lengths), each driven by
# `specula bench-serve` (chat completions, ignore_eos, 128 tokens, REQUESTS (default 32) requests per level, 1-32
# streams; its steady tok/s column is the throughput while every client is busy, without the level's drain).
set -uo pipefail
bin="$1"; out="$2"; models="$3"; prompts="$4"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
port=8600
# CONFIGS picks the servers (default: plain ngram model); eagle3 serves with the head in HEAD (default: the
# registry's, under MODELDIR/heads), head passes shared across requests; eagle3-alone drafts each request's
# passes one after the other (SPECULA_SHARED_HEAD=0); eagle3-cap8 adds `--spec-disable-batch-size 8`, and
# eagle3-count-cap judges the automatic cap count by count (SPECULA_AUTO_CAP_NEIGHBOURS=0, session 33's rule) where
# eagle3 uses the neighbour rule of session 34; eagle3-keep keeps idle drafters (SPECULA_IDLE_DRAFTERS=keep: no
# release, no cap for mostly idle counts, as until session 37); eagle3-margin5 and ngram-margin5 draft a step only
# where the budget expects 5% over not drafting (SPECULA_STEP_MARGIN=0.05; default 2%). For the cap's A/B: CONFIGS="plain eagle3 eagle3-count-cap
# eagle3-cap8 plain eagle3" LEVELS=1,2,4,8,16 REQUESTS=128 (about 6 minutes).
head=${HEAD:-qwen2.5-coder-1.5b-eagle3}
e3="--draft eagle3 --draft-model $head --draft-tokens 3 --draft-confidence 0"
declare -A flags_of=([plain]="" [ngram]="--draft ngram" [model]="--draft-model qwen2.5-coder-0.5b"
                     [eagle3]="$e3" [eagle3-alone]="$e3" [eagle3-cap8]="$e3 --spec-disable-batch-size 8"
                     [eagle3-count-cap]="$e3" [eagle3-keep]="$e3" [eagle3-idle8]="$e3" [eagle3-idle4]="$e3"
                     [eagle3-margin5]="$e3" [ngram-margin5]="--draft ngram")
run=0
for name in ${CONFIGS:-plain ngram model}; do
    run=$((run + 1))
    cfg="$name:${flags_of[$name]}"
    name=${cfg%%:*}; flags=${cfg#*:}
    port=$((port + 1))
    # shellcheck disable=SC2086
    shared=1; [ "$name" = eagle3-alone ] && shared=0
    neighbours=1; [ "$name" = eagle3-count-cap ] && neighbours=0
    idle=release; [ "$name" = eagle3-keep ] && idle=keep
    # eagle3-idle8 / -idle4 release idle drafters after 8 / 4 undrafted steps (default 16).
    after=16; case "$name" in eagle3-idle8) after=8 ;; eagle3-idle4) after=4 ;; esac
    # *-margin5: the draft budget takes a drafted step only where it expects it to beat the undrafted one by 5%
    # (SPECULA_STEP_MARGIN; default 2%).
    margin=0.02; case "$name" in *-margin5*) margin=0.05 ;; esac
    # A config named twice (an ABA order) keeps each run's files apart.
    [ -e "$out/serve-$name.log" ] && name="$name.$run"
    SPECULA_STEP_MARGIN=$margin SPECULA_RELEASE_IDLE_AFTER=$after SPECULA_IDLE_DRAFTERS=$idle SPECULA_AUTO_CAP_NEIGHBOURS=$neighbours SPECULA_SHARED_HEAD=$shared "$bin" serve -m qwen2.5-coder-1.5b --device cuda --port "$port" --max-batch 32 $flags \
        > "$out/serve-$name.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    echo "== serve $name ($flags)"
    grep -i -E "speculat|draft" "$out/serve-$name.log" | head -3
    timeout 240 "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$prompts" --ignore-eos -n 128 \
        --requests "${REQUESTS:-32}" --concurrency "${LEVELS:-1,2,4,8,16,32}" --quiet --json "$out/bench-serve-$name.json" 2>&1
    curl -s "localhost:$port/metrics" > "$out/metrics-$name.txt"
    grep -E "^specula:spec_decode_num_(draft|accepted)_tokens |^specula:step_batch_size_(sum|count)|^specula:spec_decode_(admitted_without_drafter|released_drafters) " "$out/metrics-$name.txt"
    kill "$pid"; wait "$pid" 2>/dev/null
done
