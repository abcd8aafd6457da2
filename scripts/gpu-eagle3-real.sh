#!/usr/bin/env bash
# The qwen2.5-coder-1.5b EAGLE-3 head on the GPU beside its target, in one device call:
#   scripts/gpu-eagle3-real.sh BINARY OUTDIR MODELDIR PROMPTS HEAD_DIR
# MODELDIR holds qwen2.5-coder-1.5b.gguf (reassembled from chunks: docs/gpu.md), HEAD_DIR the head (config.json +
# model.safetensors, sent in pieces). Checks the GPU head against the same head on the CPU (selftest), then
# benchmarks plain decoding against EAGLE-3 chains with the head on the GPU, a tree, the head on the CPU beside
# the GPU target, and prompt lookup.
set -uo pipefail
bin="$1"; out="$2"; models="$3"; prompts="$4"; head="$5"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["prompt"], end="")' "$prompts" > "$out/p.txt"
echo "== selftest with the head"
timeout 200 "$bin" selftest -m qwen2.5-coder-1.5b --device cuda --eagle3-head "$head" --json "$out/selftest.json" 2>&1 |
    tee "$out/selftest.log" | grep -E "eagle3|verdict|FAILED"
b() { timeout "$1" "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" -n 128 --quiet "${@:2}" 2>&1; }
echo "== bench: plain vs EAGLE-3 chains, head on the GPU"
b 300 --draft eagle3 --draft-model "$head" --draft-tokens 2,3,4,6 --draft-confidence 0,0.4 --json "$out/bench-eagle3.json" |
    tee "$out/bench-eagle3.txt"
[ "${QUICK:-0}" = 1 ] && exit 0
echo "== bench: EAGLE-3 chains, head passes without CUDA graphs"
SPECULA_CUDA_GRAPHS=0 b 150 --draft eagle3 --draft-model "$head" --draft-tokens 2,3 --draft-confidence 0 \
    --json "$out/bench-eagle3-nographs.json" | tee "$out/bench-eagle3-nographs.txt"
echo "== bench: EAGLE-3 trees, head on the GPU"
b 200 --draft eagle3 --draft-model "$head" --eagle-topk 2 --num-steps 4 --num-draft-tokens 6 --json "$out/bench-tree.json" |
    tee "$out/bench-tree.txt"
b 200 --draft eagle3 --draft-model "$head" --eagle-topk 4 --num-steps 3 --num-draft-tokens 8 --json "$out/bench-tree8.json" |
    tee "$out/bench-tree8.txt"
echo "== bench: EAGLE-3 chains, head on the CPU beside the GPU target"
SPECULA_EAGLE3_DEVICE=cpu b 200 --draft eagle3 --draft-model "$head" --draft-tokens 3 --draft-confidence 0.4 \
    --json "$out/bench-eagle3-cpu-head.json" | tee "$out/bench-eagle3-cpu-head.txt"
echo "== generate --speculate (picks the head on the GPU)"
timeout 100 "$bin" generate -m qwen2.5-coder-1.5b --device cuda --speculate --prompt-file "$out/p.txt" -n 128 2>&1 |
    grep -E "speculate|eagle3 head|speculation|decode" | head -6
