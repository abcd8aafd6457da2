#!/usr/bin/env bash
# Native quantized GEMVs (Q4_K, Q6_K, Q8_0, Q5_0, Q4_1, Q4_0; on by default; SPECULA_CUDA_NATIVE_QUANT=0 turns them off) against the bf16 path,
# one device call: the selftests of three tiny quantized models and of the real Qwen2.5-Coder-1.5B with native
# weights (every native matrix of layer 0 and the LM head against its bf16 copy, bitwise, at 1-40 rows; the f32
# reference; verify = steps), greedy output native = bf16 (plain and with the head), then decode speed both ways
# alternating, and the head's chain with native weights. Summary last (OUTDIR/native.txt).
#   scripts/gpu-native-quant.sh BINARY OUTDIR MODELDIR PROMPTS.jsonl [HEAD_DIR]
# Without HEAD_DIR the head's parts are left out. TOGGLE=SPECULA_CUDA_NATIVE_MIXED compares Q/K/V of mixed types
# as mixed parts (the default) against the same stacked as bf16, instead of native against bf16.
set -uo pipefail
toggle="${TOGGLE:-SPECULA_CUDA_NATIVE_QUANT}"
bin="$1"; out="$2"; models="$3"; prompts="$4"; head="${5:-}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPECULA_CACHE="$models"
summary="$out/native.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
# The tiny models first (Q4_K nibble tiles, Q8_0 and Q4_0 scaled-int8 tiles; no upload needed).
for m in tiny-qwen2-q4_k tiny-qwen2-q8_0 tiny-llama-q4_0; do
  SPECULA_CUDA_NATIVE_QUANT=1 timeout 120 "$bin" selftest -m "fuzz/seeds/gguf/$m.gguf" --device cuda > "$out/selftest-$m.log" 2>&1
  echo "$m native: $(grep -Ec 'native .* = bf16 bitwise' "$out/selftest-$m.log") checks, $(grep -E 'native .* = bf16 bitwise' "$out/selftest-$m.log" | grep -vc ' ok '), failed; $(grep -E '^model|verdict' "$out/selftest-$m.log" | tr '\n' ' ')" >> "$summary"
done
SPECULA_CUDA_NATIVE_QUANT=1 timeout 240 "$bin" selftest -m qwen2.5-coder-1.5b --device cuda > "$out/selftest-native.log" 2>&1
{
  grep -E "^model" "$out/selftest-native.log"
  echo "native checks: $(grep -Ec 'native .* = bf16 bitwise' "$out/selftest-native.log"), failed: $(grep -E 'native .* = bf16 bitwise' "$out/selftest-native.log" | grep -vc ' ok ')"
  grep -E "FAIL|verdict" "$out/selftest-native.log" | head -5
} >> "$summary"
texts=("def quicksort(items):" "Write a function that checks whether a string is a palindrome.")
configs=(plain)
[ -n "$head" ] && configs+=(head)
for cfg in "${configs[@]}"; do
  flags=()
  [ "$cfg" = head ] && flags=(--draft eagle3 --draft-model "$head" --draft-tokens 3)
  same=0
  for p in "${texts[@]}"; do
    a=$(env "$toggle=0" timeout 120 "$bin" generate -m qwen2.5-coder-1.5b --device cuda -p "$p" -n 96 "${flags[@]}" 2>/dev/null)
    b=$(env "$toggle=1" timeout 120 "$bin" generate -m qwen2.5-coder-1.5b --device cuda -p "$p" -n 96 "${flags[@]}" 2>/dev/null)
    [ -n "$a" ] && [ "$a" = "$b" ] && same=$((same + 1))
  done
  echo "greedy $cfg, $toggle 0 = 1: $same of ${#texts[@]} prompts" >> "$summary"
done
for round in 1 2; do
  for native in 0 1; do
    env "$toggle=$native" timeout 120 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" \
      -n 128 --quiet --json "$out/plain-$native-$round.json" > "$out/plain-$native-$round.txt" 2>&1
    echo "round $round $toggle=$native: $(grep -E '^plain' "$out/plain-$native-$round.txt")" >> "$summary"
  done
done
[ -n "$head" ] && SPECULA_CUDA_NATIVE_QUANT=1 timeout 150 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" -n 128 \
  --quiet --draft eagle3 --draft-model "$head" --draft-tokens 3,4 --draft-confidence 0 > "$out/head-native.txt" 2>&1
[ -n "$head" ] && grep -E "^(plain|eagle3)" "$out/head-native.txt" | sed 's/^/head bench, native: /' >> "$summary"
cat "$summary"
