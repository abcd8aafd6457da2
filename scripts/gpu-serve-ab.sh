#!/usr/bin/env bash
# Two builds' servers side by side on the real Qwen2.5-Coder-1.5B, in one device call: the new build's tiny-model
# checks, greedy output old against new (plain and with the head), then plain (new) and the EAGLE-3 head server
# (old, new, alternating) at each level, and a profile of plain and of the new head server at PROFILE_LEVEL.
#   scripts/gpu-serve-ab.sh OLD NEW OUTDIR MODELDIR PROMPTS.jsonl HEAD_DIR
# Summary last (OUTDIR/summary.txt); traces in OUTDIR/trace-plain.json and trace-head.json.
set -uo pipefail
old="$1"; new="$2"; out="$3"; models="$4"; prompts="$5"; head="$6"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
summary="$out/summary.txt"
work=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
for m in tiny-qwen2-f32 tiny-qwen2-q4_k tiny-llama-q4_0; do
    timeout 120 "$new" selftest -m "fuzz/seeds/gguf/$m.gguf" --device cuda > "$work/selftest-$m.log" 2>&1
    verdict=$(grep -E "verdict" "$work/selftest-$m.log" || tail -2 "$work/selftest-$m.log" | tr '\n' ' ')
    echo "selftest $m: $(grep -c FAILED "$work/selftest-$m.log") failed, $verdict" >> "$summary"
done
prompts_text=("def quicksort(items):" "Write a function that checks whether a string is a palindrome.")
for cfg in plain head; do
    flags=()
    [ "$cfg" = head ] && flags=(--draft eagle3 --draft-model "$head" --draft-tokens 3)
    same=0; total=0
    for p in "${prompts_text[@]}"; do
        a=$(timeout 120 "$old" generate -m qwen2.5-coder-1.5b --device cuda -p "$p" -n 96 "${flags[@]}" 2>/dev/null)
        b=$(timeout 120 "$new" generate -m qwen2.5-coder-1.5b --device cuda -p "$p" -n 96 "${flags[@]}" 2>/dev/null)
        total=$((total + 1))
        [ -n "$a" ] && [ "$a" = "$b" ] && same=$((same + 1))
    done
    echo "greedy $cfg, old = new: $same of $total prompts" >> "$summary"
done
e3=(--draft eagle3 --draft-model "$head" --draft-tokens 3 --draft-confidence 0)
port=8800
serve() { # name binary profile(0/1) flags...
    local name=$1 bin=$2 prof=$3; shift 3
    port=$((port + 1))
    local pdir="$work/prof-$name"; mkdir -p "$pdir"
    "$bin" serve -m qwen2.5-coder-1.5b --device cuda --port "$port" --max-batch 32 --profile-dir "$pdir" "$@" \
        > "$work/serve-$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    timeout 240 "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$prompts" --ignore-eos -n 128 \
        --requests 32 --concurrency "${LEVELS:-1,4,8,16,32}" --quiet > "$work/bench-$name.txt" 2>&1
    echo "== $name" >> "$summary"
    grep -E "^ +[0-9]+ " "$work/bench-$name.txt" >> "$summary"
    # A server that answered nothing: say why (its log's errors), not just zeros.
    if ! grep -qE "^ +[0-9]+ +[0-9.]+ +[1-9]" "$work/bench-$name.txt"; then
        echo "  no tokens from $name; its log ends:" >> "$summary"
        grep -iE "error|panic" "$work/serve-$name.log" | tail -3 | cut -c1-300 >> "$summary"
        tail -3 "$work/bench-$name.txt" | cut -c1-300 >> "$summary"
    fi
    if [ "$prof" = 1 ]; then
        curl -s -X POST "localhost:$port/start_profile" > /dev/null
        timeout 120 "$bin" bench-serve --url "http://127.0.0.1:$port" --prompts "$prompts" --ignore-eos -n 128 \
            --requests 32 --concurrency "${PROFILE_LEVEL:-16}" --quiet > /dev/null 2>&1
        curl -s -X POST "localhost:$port/stop_profile" > /dev/null
        mv "$pdir"/specula-trace-*.json "$out/trace-$name.json" 2>/dev/null
    fi
    kill "$pid"; wait "$pid" 2>/dev/null
}
serve plain "$new" 1
serve head-old "$old" 0 "${e3[@]}"
serve head "$new" 1 "${e3[@]}"
serve head-old-2 "$old" 0 "${e3[@]}"
serve plain-2 "$new" 0
cat "$summary"
