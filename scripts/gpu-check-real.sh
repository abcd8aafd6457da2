#!/usr/bin/env bash
# GPU correctness and EAGLE-3 chains against trees, in one device call (docs/benchmarks.md, session 15):
#   scripts/gpu-check-real.sh BINARY OUTDIR MODELDIR HEAD_DIR
# Tiny models first (batched head passes, the device top-k, EAGLE-3 chains and trees equal to plain decoding),
# then the real qwen2.5-coder-1.5b in MODELDIR (its chunks q15.* under MODELDIR/parts are joined if needed; HEAD_DIR's
# headpart.* too): the GPU against the f32 reference, the head against the CPU's, then chains and three tree shapes.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
b=$1; OUT=$2; M=$3; H=$4
export SPECULA_CACHE=$M
echo "== tiny models: batched head passes, top-k, greedy EAGLE-3 = plain"
timeout 60 $b selftest -m fuzz/seeds/gguf/tiny-qwen2-f32.gguf --device cuda --eagle3-head dist/tinyhead 2>&1 | grep -E "eagle3|verdict|FAILED|rror"
timeout 90 scripts/gpu-eagle3.sh $b $OUT dist/tinyhead 2>&1 | grep -E "==|verdict|rror"
echo "== assemble"
[ -s $M/qwen2.5-coder-1.5b.gguf ] || cat $M/parts/q15.* > $M/qwen2.5-coder-1.5b.gguf
sha256sum $M/qwen2.5-coder-1.5b.gguf | cut -c1-16
if [ ! -s $H/model.safetensors ]; then cat $H/headpart.* > $H/model.safetensors && rm $H/headpart.*; fi
sha256sum $H/model.safetensors | cut -c1-16
echo "== real selftest (f32 reference)"
timeout 150 $b selftest -m qwen2.5-coder-1.5b --device cuda --json $OUT/selftest-real.json > $OUT/selftest-real.log 2>&1
grep -E "f32|reference|verdict|FAILED" $OUT/selftest-real.log | head -20
echo "== real head selftest, batched"
timeout 100 $b selftest -m qwen2.5-coder-1.5b --device cuda --eagle3-head $H 2>&1 | grep -E "eagle3|verdict"
bb() { timeout $1 $b bench -m qwen2.5-coder-1.5b --device cuda --prompts dist/code.jsonl -n 128 --quiet "${@:2}" 2>&1 | grep -v '^\s*$'; }
echo "== bench chains and trees (head v2)"
bb 120 --draft eagle3 --draft-model $H --draft-tokens 2,3,4 --draft-confidence 0 --json $OUT/b-chain.json
bb 120 --draft eagle3 --draft-model $H --eagle-topk 2 --num-steps 4 --num-draft-tokens 6 --json $OUT/b-tree6.json
bb 120 --draft eagle3 --draft-model $H --eagle-topk 4 --num-steps 4 --num-draft-tokens 12 --json $OUT/b-tree12.json
bb 120 --draft eagle3 --draft-model $H --eagle-topk 8 --num-steps 5 --num-draft-tokens 24 --json $OUT/b-tree24.json
echo "device s: $SECONDS"
