#!/usr/bin/env bash
# Trains the qwen2.5-coder-1.5b EAGLE-3 head on the H200 device machine, in device calls of at most 10 minutes
# (docs/eagle3.md, "Heads"). BIN is dist/specula-train-cuda (scripts/build-train-cuda.sh), MODELS a directory
# holding qwen2.5-coder-1.5b.gguf (reassembled from chunks: docs/gpu.md), OUT the call's $OUT.
#   scripts/gpu-train-head.sh data  BIN MODELS OUT [PROBE_MINUTES]  # prompts, answers, corpus -> data.jsonl; then
#                                                                  # a short training probe in a scratch directory
#   scripts/gpu-train-head.sh train BIN MODELS OUT [train-eagle3 args]   # the head; its first 4 pieces of 15 MiB
#   scripts/gpu-train-head.sh rest  BIN MODELS OUT                       # the pieces after those
#   scripts/gpu-train-head.sh stash BIN MODELS OUT    # keeps a call's carried .headparts/NN (make-head-parts.sh)
#   scripts/gpu-train-head.sh place BIN MODELS OUT    # stage STAGE-1's head (+ stage STAGE's data) from them
#   scripts/gpu-train-head.sh probe BIN MODELS OUT MINUTES [train-eagle3 args]   # after `data`: the real run's
#                                     settings (BATCH sequences a step, default 4) plus ARGS for MINUTES in a scratch
#                                     directory; prints its last progress line
#                                     (an A/B of training settings, e.g. --micro-batch 1 against the default)
# A call returns at most 64 MiB (8 files of 16 MiB at most), so a 94.5 MB head comes back in two calls: make the
# `rest` call at once, since an idle machine is given back after 30 s and the head with it (session 28 lost one).
# Reassemble the pieces with `cat model.safetensors.part* > model.safetensors` (sha256 in head.sha256 of the
# head-meta.tar).
# STAGE=k names the stage (1: from random weights; k > 1: from stage k-1's head, which must be in
# MODELS/heads/NAME.stage<k-1>).
set -uo pipefail
mode=$1; bin=$2; models=$3; out=$4; shift 4
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models" SPECULA_BIN="$bin"
# NAME=smollm2-135m-eagle3 trains that head's GPU recipe instead (DEVICE=cuda in scripts/train-head.sh; MODELS
# then holds smollm2-135m.gguf); its 20 MB comes back whole from the train call.
name=${NAME:-qwen2.5-coder-1.5b-eagle3}
case "$name" in
  smollm2-135m-eagle3) target=smollm2-135m; export DEVICE=cuda ;;
  *) target=qwen2.5-coder-1.5b ;;
esac
: "${STAGE:?set STAGE=k, the stage to build (scripts/train-head.sh): one device call holds the data or the training of one stage}"
export STAGE
head="$models/heads/$name.stage$STAGE"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
case "$mode" in
  data)
    probe=${1:-0}
    scripts/train-head.sh "$name" --data-only > "$out/data.log" 2> "$out/data.err"
    tail -c 3000 "$out/data.err" | tr '\r' '\n' | tail -8
    echo "data: ${SECONDS} s"
    wc -l "$head/data.jsonl"
    if [ "$probe" != 0 ]; then
      rm -rf /tmp/probe && mkdir -p /tmp/probe && cp "$head/data.jsonl" /tmp/probe/
      # The same settings as the real run (scripts/train-head.sh), stopped after PROBE_MINUTES.
      "$bin" train-eagle3 -m "$target" --out /tmp/probe --resume --prompts "$head/prompts.jsonl" \
        --device cuda --seq-len 384 --draft-vocab 8192 --intermediate-size 4096 --ttt-steps 4 --epochs 4 \
        --batch 4 --lr 5e-4 --cache-gb 40 --max-minutes "$probe" --json "$out/probe.json" \
        > "$out/probe.log" 2> "$out/probe.err"
      tail -c 3000 "$out/probe.err" | tr '\r' '\n' | tail -4
      cat "$out/probe.log"
    fi
    ;;
  train)
    # A device call returns at most 8 files: the head's 15 MiB pieces, and everything else in one tarball.
    logs=/tmp/train-logs; mkdir -p "$logs"
    scripts/train-head.sh "$name" "$@" > "$logs/train.log" 2> "$logs/train.err"
    tr '\r' '\n' < "$logs/train.err" | grep -E "^\[" | awk 'NR % 20 == 0' > "$logs/progress.txt"
    tail -c 3000 "$logs/train.err" | tr '\r' '\n' | tail -6
    echo "train: ${SECONDS} s"
    cat "$logs/train.log"
    if [ -s "$head/model.safetensors" ]; then
      (cd "$head" && sha256sum model.safetensors) | tee "$logs/head.sha256"
      split -b 15M -d "$head/model.safetensors" "$head/model.safetensors.part"
      cp "$head"/model.safetensors.part0[0-3] "$out/"
      cp "$head/config.json" "$logs/"
      cp "$head/training-report.json" "$logs/" 2>/dev/null
    fi
    tar -C "$logs" -cf "$out/head-meta.tar" .
    ;;
  probe)
    minutes=${1:?probe needs MINUTES}; shift
    rm -rf /tmp/probe && mkdir -p /tmp/probe && cp "$head/data.jsonl" /tmp/probe/
    "$bin" train-eagle3 -m "$target" --out /tmp/probe --resume --prompts "$head/prompts.jsonl" \
      --device cuda --seq-len 384 --draft-vocab 8192 --intermediate-size 4096 --ttt-steps 4 --epochs 1 \
      --batch "${BATCH:-4}" --lr 5e-4 --cache-gb 40 --max-minutes "$minutes" "$@" > /tmp/probe.log 2> /tmp/probe.err
    echo "probe batch ${BATCH:-4} $*: $(tr '\r' '\n' < /tmp/probe.err | grep -E '^\[' | tail -1)"
    ;;
  rest)
    ls "$head"/model.safetensors.part* > /dev/null || { echo "no head pieces in $head: run train first" >&2; exit 1; }
    for f in "$head"/model.safetensors.part*; do
      case "$f" in *part0[0-3]) ;; *) cp "$f" "$out/" ;; esac
    done
    ls -l "$out"
    ;;
  stash)
    # A call carrying one .headparts/NN (scripts/make-head-parts.sh): its pieces kept on the device until `place`.
    mkdir -p /tmp/headparts && cp .headparts/*/* /tmp/headparts/ && ls /tmp/headparts
    ;;
  place)
    # Stage STAGE-1's head (and stage STAGE's data, when it was sent) from the stashed pieces.
    prev="$models/heads/$name.stage$((STAGE - 1))"
    mkdir -p "$prev" "$head"
    cat /tmp/headparts/head.[0-9]* > "$prev/model.safetensors"
    tar -C "$prev" -xf /tmp/headparts/head-meta.tar
    (cd "$prev" && sha256sum -c head.sha256) || exit 1
    if [ -e /tmp/headparts/data.tar.xz ]; then
      tar -C "$head" -xJf /tmp/headparts/data.tar.xz && wc -l "$head/data.jsonl"
    fi
    rm -rf /tmp/headparts
    ;;
  *)
    echo "mode must be data, train, rest, probe, stash or place" >&2; exit 2 ;;
esac
