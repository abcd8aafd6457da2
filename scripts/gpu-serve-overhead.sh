#!/usr/bin/env bash
# A server's per-step overhead on the GPU, two binaries side by side, on tiny models where per-request work is the
# whole step (docs/benchmarks.md, session 15: one readback a step instead of one a request):
#   scripts/gpu-serve-overhead.sh OLD_BINARY NEW_BINARY OUTDIR
# Checks the new binary first (selftest, the head selftest, EAGLE-3 = plain), then serves plain (tiny512-f32 in
# dist/) and EAGLE-3 (tiny-qwen2-f32 with dist/tinyhead) from each binary at 1, 8 and 32 streams, two rounds.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
old=$1; new=$2; OUT=$3
echo "== checks (new binary)"
for m in tiny-qwen2-f32 tiny-qwen2-q4_k tiny-llama-q4_0; do
  timeout 60 $new selftest -m fuzz/seeds/gguf/$m.gguf --device cuda 2>&1 | grep -E "FAILED|verdict|batched"
done
timeout 60 $new selftest -m fuzz/seeds/gguf/tiny-qwen2-f32.gguf --device cuda --eagle3-head dist/tinyhead 2>&1 | grep -E "FAILED|verdict"
timeout 90 scripts/gpu-eagle3.sh $new $OUT dist/tinyhead 2>&1 | grep -E "==|rror" | head -3
port=8800
srv() { # bin model n label extra...
  local bin=$1 model=$2 n=$3 label=$4; shift 4
  port=$((port + 1))
  $bin serve -m $model --device cuda --port $port --max-batch 32 "$@" > $OUT/serve-$label.log 2>&1 &
  local pid=$!
  for _ in $(seq 60); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.5; done
  echo "-- $label"
  timeout 100 $bin bench-serve --url http://127.0.0.1:$port --prompts dist/tiny-prompts.jsonl --raw --ignore-eos -n $n \
    --requests 64 --concurrency 1,8,32 --quiet 2>&1 | grep -E '^ +[0-9]|conc'
  curl -s localhost:$port/metrics | grep -E '^specula:step_seconds_(sum|count)\{kind="decode"|^specula:spec_decode_num_(draft|accepted)_tokens '
  kill $pid; wait $pid 2>/dev/null
}
for round in 1 2; do
  srv $old dist/tiny512-f32.gguf 128 plain-old-$round
  srv $new dist/tiny512-f32.gguf 128 plain-new-$round
  srv $old fuzz/seeds/gguf/tiny-qwen2-f32.gguf 40 eagle-old-$round --draft eagle3 --draft-model dist/tinyhead --draft-tokens 2
  srv $new fuzz/seeds/gguf/tiny-qwen2-f32.gguf 40 eagle-new-$round --draft eagle3 --draft-model dist/tinyhead --draft-tokens 2
done
echo "device s: $SECONDS"
