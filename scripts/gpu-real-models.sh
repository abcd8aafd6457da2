#!/usr/bin/env bash
# The real Qwen2.5-Coder pair on the GPU, in one device call (docs/gpu.md, "Real models"):
#   scripts/gpu-real-models.sh BINARY OUTDIR MODELDIR PROMPTS
# MODELDIR holds qwen2.5-coder-{0.5b,1.5b}.gguf (reassembled from chunks: docs/gpu.md), PROMPTS the code prompts.
# Checks the GPU's greedy tokens against the CPU backend's (run on the same machine's CPU), then benchmarks plain
# decoding against the 0.5B draft model and prompt lookup.
set -uo pipefail
bin="$1"; out="$2"; models="$3"; prompts="$4"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
n=$(wc -l < "$prompts")
for i in $(seq 1 "$n"); do
    line=$(sed -n "${i}p" "$prompts")
    id=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["id"])' "$line")
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])["prompt"], end="")' "$line" > "$out/prompt-$id.txt"
    for dev in cuda cpu; do
        timeout 120 "$bin" generate -m qwen2.5-coder-1.5b --device $dev --prompt-file "$out/prompt-$id.txt" -n 64 \
            --ignore-eos --quiet --report-json "$out/$dev-$id.json" > /dev/null 2>> "$out/generate.log"
    done
done
python3 - "$out" "$prompts" <<'PY' | tee "$out/greedy-vs-cpu.txt"
import json, sys
out, prompts = sys.argv[1], sys.argv[2]
same = total = 0
for line in open(prompts):
    pid = json.loads(line)["id"]
    try:
        a = json.load(open(f"{out}/cpu-{pid}.json"))["token_ids"]
        b = json.load(open(f"{out}/cuda-{pid}.json"))["token_ids"]
    except Exception as e:
        print(f"{pid}: missing output ({e})"); continue
    ref = {"id": pid, "token_ids": a}
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    same += first; total += len(a)
    print(f"{ref['id']}: GPU greedy equals the CPU's for the first {first} of {len(a)} tokens")
print(f"all: {same} of {total} tokens before the first divergence")
PY
echo "== bench: plain vs the 0.5B draft model"
timeout 300 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" --draft-model qwen2.5-coder-0.5b \
    --draft-tokens 1,2,3,4,6 -n 128 --quiet --json "$out/bench-pair.json" 2>&1 | tee "$out/bench-pair.txt"
echo "== bench: plain vs prompt lookup"
timeout 200 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" --draft ngram \
    --draft-tokens 4,8 -n 128 --quiet --json "$out/bench-ngram.json" 2>&1 | tee "$out/bench-ngram.txt"
