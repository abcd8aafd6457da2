#!/usr/bin/env bash
# Sends a trained head stage back to a fresh device machine (docs/eagle3.md, "Heads"): splits
# heads/NAME.stage<STAGE-1> (the head stage STAGE starts from) into 50 MiB pieces under the ignored .headparts/NN/,
# one piece a device call, with its config and training report, and stage STAGE's data when it was made already
# (heads/NAME.stage<STAGE>/data.jsonl and prompts.jsonl, ~1 MB compressed) beside the last piece.
#   scripts/make-head-parts.sh qwen2.5-coder-1.5b-eagle3 3
# On the device, each call carrying .headparts/NN runs `STAGE=3 scripts/gpu-train-head.sh stash ...`; after the
# last, `STAGE=3 scripts/gpu-train-head.sh place BIN MODELS OUT` puts them in place and checks the sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/make-head-parts.sh NAME STAGE}
stage=${2:?usage: scripts/make-head-parts.sh NAME STAGE}
heads=${SPECULA_CACHE:-$HOME/.cache/specula/models}/heads
prev=$heads/$name.stage$((stage - 1))
[ -s "$prev/model.safetensors" ] || { echo "no head in $prev" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
split -b 50M -d -a 2 "$prev/model.safetensors" "$tmp/head."
rm -rf .headparts
for piece in "$tmp"/head.*; do
  n=${piece##*.}
  mkdir -p ".headparts/$n"
  mv "$piece" ".headparts/$n/"
done
last=.headparts/$(ls .headparts | tail -1)
(cd "$prev" && sha256sum model.safetensors > "$tmp/head.sha256")
tar -C "$prev" -cf "$last/head-meta.tar" config.json training-report.json -C "$tmp" head.sha256
if [ -s "$heads/$name.stage$stage/data.jsonl" ]; then
  tar -C "$heads/$name.stage$stage" -cJf "$last/data.tar.xz" data.jsonl prompts.jsonl
fi
ls -l .headparts/*
