#!/usr/bin/env bash
# What each kind of kernel costs inside a captured decode step, by difference: the step of a random-weight shape
# with one kind left out (SPECULA_CUDA_SKIP_KERNELS; outputs meaningless then) against the whole step, in one call.
#   scripts/gpu-step-breakdown.sh BINARY [SHAPES]      (default: qwen2.5-1.5b llama-3.1-8b)
set -uo pipefail
bin="$1"; shift
shapes=("${@:-qwen2.5-1.5b llama-3.1-8b}")
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for s in ${shapes[@]}; do
  layers=$( [ "$s" = llama-3.1-8b ] && echo 32 || echo 28 )
  ms() {  # decode ms a token, 256 tokens, profiling off
    SPECULA_CUDA_SKIP_KERNELS="$1" timeout 120 "$bin" generate --random-weights "$s" --device cuda \
      -p "hello world, this is a test" -n 256 --ignore-eos --raw --quiet --profile off 2>&1 |
      grep -E '^prompt' | sed -E 's/.*\(([0-9.]+) tok\/s\).*/\1/' | awk '{ printf "%.4f", 1000 / $1 }'
  }
  base1=$(ms ""); base2=$(ms "")
  echo "$s: whole step $base1 / $base2 ms"
  base=$(echo "$base1 $base2" | awk '{ print ($1 + $2) / 2 }')
  for kinds in norm qkv qkv_post attention out gate_up down "norm,qkv_post,attention" "qkv,out,gate_up,down"; do
    t=$(ms "$kinds")
    echo "$s: without $kinds: $t ms a step, so $(echo "$base $t $layers" | awk '{ printf "%.1f us a step, %.2f us a layer", ($1 - $2) * 1000, ($1 - $2) * 1000 / $3 }')"
  done
done
