#!/usr/bin/env bash
# EAGLE-3 drafting with a GPU target: the head (on the CPU) reads the GPU's embedding rows and hidden states;
# greedy output must equal plain GPU decoding. Then selftest's embedding-rows check on every tiny model.
#   scripts/gpu-eagle3.sh BINARY OUTDIR [HEAD_DIR]
# HEAD_DIR (default dist/tinyhead, carried with dist): a head for tiny-qwen2-f32 trained on its own answers, e.g.
#   specula train-eagle3 -m fuzz/seeds/gguf/tiny-qwen2-f32.gguf --out dist/tinyhead --prompts SHORT_PROMPTS.jsonl \
#     --answer-tokens 32 --seq-len 64 --draft-vocab 64 --ttt-steps 2 --aux-layers 0,0,0 --epochs 4 --lr 3e-3 \
#     --batch 2 --intermediate-size 64
# (twenty prompts of a few words each: the 64-token context leaves no room for longer ones).
set -uo pipefail
bin=$1; out=$2; head=${3:-dist/tinyhead}
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
m=fuzz/seeds/gguf/tiny-qwen2-f32.gguf
for d in cuda cpu; do
  "$bin" generate -m $m --device $d -p "Write a function" -n 48 --ignore-eos --quiet --report-json $out/plain-$d.json 2>&1 | grep -E "^prompt"
  "$bin" generate -m $m --device $d -p "Write a function" -n 48 --ignore-eos --quiet --draft eagle3 --draft-model "$head" --draft-tokens 2 --report-json $out/eagle-$d.json 2>&1 | grep -E "^prompt|speculation \(|error"
  "$bin" generate -m $m --device $d -p "Write a function" -n 48 --ignore-eos --quiet --draft eagle3 --draft-model "$head" --eagle-topk 2 --num-steps 3 --num-draft-tokens 5 --report-json $out/tree-$d.json 2>&1 | grep -E "speculation \(|error"
done
python3 - "$out" <<'PY'
import json, sys
o = sys.argv[1]
t = {k: json.load(open(f"{o}/{k}.json"))["token_ids"] for k in ["plain-cuda", "eagle-cuda", "tree-cuda", "plain-cpu", "eagle-cpu", "tree-cpu"]}
print("GPU: eagle3 == plain:", t["eagle-cuda"] == t["plain-cuda"], "tree == plain:", t["tree-cuda"] == t["plain-cuda"],
      "| CPU: eagle3 == plain:", t["eagle-cpu"] == t["plain-cpu"], "tree == plain:", t["tree-cpu"] == t["plain-cpu"])
PY
for m in tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm; do
  "$bin" selftest -m fuzz/seeds/gguf/$m.gguf --device cuda 2>&1 | grep -E "embedding rows|verdict"
done
