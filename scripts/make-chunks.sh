#!/usr/bin/env bash
# Splits a model file into 55 MiB chunks under the ignored .chunks/NN/ (one chunk a device call; docs/gpu.md,
# "Real models"): after `specula fetch qwen2.5-coder-1.5b`,
#   scripts/make-chunks.sh ~/.cache/specula/models/qwen2.5-coder-1.5b.gguf q15
# gives .chunks/00 .. .chunks/19, each holding one q15.NN. On the device: `cp .chunks/NN/* /tmp/models/parts/` per
# call, then `cat /tmp/models/parts/q15.* > /tmp/models/qwen2.5-coder-1.5b.gguf` and check its sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
file=${1:?usage: scripts/make-chunks.sh MODEL_FILE PREFIX}
prefix=${2:?usage: scripts/make-chunks.sh MODEL_FILE PREFIX}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
split -b 55M -d -a 2 "$file" "$tmp/$prefix."
for part in "$tmp/$prefix".*; do
  n=${part##*.}
  rm -rf ".chunks/$n"
  mkdir -p ".chunks/$n"
  mv "$part" ".chunks/$n/"
done
ls .chunks | wc -l | xargs echo "chunks:"
sha256sum "$file"
