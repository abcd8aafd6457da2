#!/usr/bin/env bash
# EAGLE-3 trees against chains on the GPU, in one device call: the same bench (shared/prompts-style JSONL, 128
# tokens, greedy) for chains of 3 and 4 tokens and trees of 8 to 32 nodes, each beside its own plain run.
#   scripts/gpu-eagle3-trees.sh BINARY OUTDIR MODELDIR PROMPTS.jsonl HEAD_DIR
# Since activations come split (session 18) a verify over 16 rows costs 1.18x a step on an H200 and 32 rows
# 1.62x (1.50x and 2.84x before), so wider trees may now pay. Summary (one line a configuration) printed last.
# MODEL, DEVICE, TOKENS and BENCH_FLAGS override the defaults (a dry run on this CPU: MODEL=fuzz/seeds/gguf/
# tiny-qwen2-f32.gguf DEVICE=cpu TOKENS=16 BENCH_FLAGS=--raw ... dist/tiny-prompts.jsonl dist/tinyhead).
set -uo pipefail
bin="$1"; out="$2"; models="$3"; prompts="$4"; head="$5"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
summary="$out/trees.txt"
: > "$summary"
run() { # label, bench flags...
    local label=$1; shift
    local json="$out/bench-$label.json"
    timeout 200 "$bin" bench -m "${MODEL:-qwen2.5-coder-1.5b}" --device "${DEVICE:-cuda}" --prompts "$prompts" \
        -n "${TOKENS:-128}" --quiet ${BENCH_FLAGS:-} \
        --draft eagle3 --draft-model "$head" "$@" --json "$json" > "$out/bench-$label.txt" 2>&1
    python3 - "$json" "$label" >> "$summary" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"{sys.argv[2]:16} no report ({e})"); sys.exit()
for c in r["configs"]:
    print(f"{sys.argv[2]:16} {c['label']:14} {c['decode_tok_s']:8.1f} tok/s {c.get('speedup_vs_plain') or 1.0:5.2f}x  "
          f"accepted/cycle {c.get('mean_accept_len') or 1.0:.2f}  draft {c.get('draft_ms_per_cycle') or 0:.2f} ms  "
          f"verify {c.get('verify_ms_per_cycle') or 0:.2f} ms")
EOF
}
run chain --draft-tokens 3,4 --draft-confidence 0
for shape in "2 4 8" "4 4 12" "4 5 16" "8 5 24" "8 6 32"; do
    read -r topk steps nodes <<< "$shape"
    run "tree-$topk-$steps-$nodes" --eagle-topk "$topk" --num-steps "$steps" --num-draft-tokens "$nodes"
done
cat "$summary"
