#!/usr/bin/env bash
# Two builds side by side after a kernel change, in one device call: the new build's checks, its greedy output
# against the old build's on the real model (and with an EAGLE-3 head), forward-pass times over 1..128 rows and
# decode speed, old and new in the same call.
#   scripts/gpu-ab-kernels.sh OLD NEW OUTDIR MODELDIR [HEAD_DIR]
# MODELDIR holds qwen2.5-coder-1.5b.gguf (docs/gpu.md, "Real models"); the summary is printed last.
set -uo pipefail
old="$1"; new="$2"; out="$3"; models="$4"; head="${5:-}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
summary="$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$summary"
for m in tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm; do
    timeout 120 "$new" selftest -m "fuzz/seeds/gguf/$m.gguf" --device cuda > "$out/selftest-$m.log" 2>&1
    verdict=$(grep -E "verdict" "$out/selftest-$m.log" || tail -2 "$out/selftest-$m.log" | tr '\n' ' ')
    echo "selftest $m: $(grep -c FAILED "$out/selftest-$m.log") failed, $verdict" >> "$summary"
done
timeout 300 "$new" selftest -m qwen2.5-coder-1.5b --device cuda > "$out/selftest-real.log" 2>&1
echo "selftest qwen2.5-coder-1.5b: $(grep -E "f32 reference" "$out/selftest-real.log" | head -1 | cut -c1-150)" >> "$summary"
echo "  $(grep -c FAILED "$out/selftest-real.log") failed, $(grep -E "verdict" "$out/selftest-real.log")" >> "$summary"
# Greedy output, old against new (plain and with the head).
prompts=("def quicksort(items):" "Write a function that checks whether a string is a palindrome." "SELECT name FROM users WHERE")
for cfg in plain head; do
    [ "$cfg" = head ] && [ -z "$head" ] && continue
    flags=()
    [ "$cfg" = head ] && flags=(--draft eagle3 --draft-model "$head" --draft-tokens 3)
    same=0; total=0
    for p in "${prompts[@]}"; do
        a=$(timeout 120 "$old" generate -m qwen2.5-coder-1.5b --device cuda -p "$p" -n 96 "${flags[@]}" 2>/dev/null)
        b=$(timeout 120 "$new" generate -m qwen2.5-coder-1.5b --device cuda -p "$p" -n 96 "${flags[@]}" 2>/dev/null)
        total=$((total + 1))
        [ -n "$a" ] && [ "$a" = "$b" ] && same=$((same + 1))
        printf '%s\n--- old\n%s\n--- new\n%s\n\n' "$p" "$a" "$b" >> "$out/greedy-$cfg.txt"
    done
    echo "greedy $cfg, old = new: $same of $total prompts" >> "$summary"
done
# Forward pass over n rows (median ms): the old build, and the new one with and without the GEMM tile (env: from
# how many rows the tile runs; 0, the default, never).
configs=("old" "new" "new SPECULA_CUDA_GEMM_ROWS=64")
for s in qwen2.5-1.5b llama-3.1-8b; do
    rows=128
    [ "$s" = llama-3.1-8b ] && rows=64
    for cfg in "${configs[@]}"; do
        read -r b envs <<< "$cfg"
        bin=$old; [ "$b" = new ] && bin=$new
        log="$out/forward-$s-$(echo "$cfg" | tr ' =' '__').log"
        env $envs timeout 300 "$bin" selftest --random-weights "$s" --device cuda --verify-rows "$rows" > "$log" 2>&1
        python3 - "$log" "$s $cfg" >> "$summary" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"forward of n rows after \d+ tokens \(median ms\): (.*)", text)
if not m:
    print(f"forward {sys.argv[2]}: no timings"); sys.exit()
t = dict(kv.split(":") for kv in m.group(1).split())
keep = [n for n in ["1", "4", "8", "16", "17", "24", "32", "33", "48", "64", "65", "96", "128"] if n in t]
print(f"forward {sys.argv[2]:52} " + " ".join(f"{n}:{float(t[n]):.2f}" for n in keep)
      + f"  ({text.count('FAILED')} checks failed)")
EOF
    done
done
long_prompt=$(python3 -c 'print(" ".join(f"word{i % 97} and" for i in range(300)))')
for s in qwen2.5-1.5b llama-3.1-8b; do
    for cfg in "${configs[@]}"; do
        read -r b envs <<< "$cfg"
        bin=$old; [ "$b" = new ] && bin=$new
        echo "prefill $s $cfg: $(env $envs timeout 120 "$bin" generate --random-weights "$s" --device cuda --raw \
            -p "$long_prompt" -n 16 --ignore-eos --quiet 2>&1 | grep -E "^prompt" | grep -oE "prefill [^)]*\)")" >> "$summary"
    done
done
gen() {
    timeout 120 "$1" generate --random-weights "$2" --device cuda -p "hello world, this is a test" -n 256 \
        --ignore-eos --raw --quiet --profile off 2>&1 | grep -E "^prompt" | grep -oE "[0-9.]+ tok/s" | tail -1
}
for s in qwen2.5-1.5b llama-3.1-8b; do
    for r in 1 2; do
        echo "decode $s round $r: old $(gen "$old" "$s"), new $(gen "$new" "$s")" >> "$summary"
    done
done
cat "$summary"
