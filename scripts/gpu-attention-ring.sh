#!/usr/bin/env bash
# The opt-in attention variant (SPECULA_CUDA_ATTENTION_RING=1, docs/gpu.md) checked and timed in one device call:
#   scripts/gpu-attention-ring.sh BINARY DIR
# DIR holds kernels-old.cu (the kernels.cu to compare against: `git show REV:crates/specula/src/backend/cuda/kernels.cu`),
# tiny1024-f32.gguf and tiny1024-q4k.gguf (`cargo run --release -p specula --example write_tiny_model -- FILE 1024
# f32|q4_k`), long959.txt (959 ASCII bytes) and long.txt (about 4000). Tiny models against the CPU with the variant
# off and on, decode tok/s old / default / ring at 256 tokens, the variant on 959-token prompts (default, 1 and 3
# forced splits) and on the random shapes with a long prompt, then the A/B at 1024 tokens.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
bin=$(realpath "$1")
fuzz=$(realpath "$(dirname "$0")/../fuzz/seeds/gguf")
cd "$2"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
for ring in 0 1; do
  export SPECULA_CUDA_ATTENTION_RING=$ring
  for m in tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm; do
    echo "== ring=$ring selftest $m: $(timeout 60 $bin selftest -m $fuzz/$m.gguf --device cuda 2>&1 | grep -E 'verdict|FAILED' | tr '\n' ' ')"
  done
done
gen() { # kernels shape tokens
    local src=$1 s=$2 n=$3
    export SPECULA_CUDA_ATTENTION_RING=0
    if [ "$src" = old ]; then export SPECULA_CUDA_KERNELS_SOURCE=kernels-old.cu; else unset SPECULA_CUDA_KERNELS_SOURCE; fi
    [ "$src" = ring ] && export SPECULA_CUDA_ATTENTION_RING=1
    timeout 100 $bin generate --random-weights $s --device cuda -p "hello world, this is a test" -n $n \
        --ignore-eos --raw --quiet --profile off 2>&1 | grep -E "^prompt" | grep -oE "[0-9.]+ tok/s" | tail -1
    unset SPECULA_CUDA_KERNELS_SOURCE
}
ab() {
  for s in qwen2.5-1.5b llama-3.1-8b; do
    for r in 1 2; do
      echo "$s n=$1 round $r: old $(gen old $s $1) | default $(gen new $s $1) | ring $(gen ring $s $1)"
    done
  done
}
ab 256
echo "ab 256 done at $(( $(date +%s) - t0 )) s"
export SPECULA_CUDA_ATTENTION_RING=1
for m in tiny1024-f32 tiny1024-q4k; do
  for sp in default 1 3; do
    if [ $sp = default ]; then unset SPECULA_CUDA_ATTENTION_SPLITS; else export SPECULA_CUDA_ATTENTION_SPLITS=$sp; fi
    echo "== ring selftest $m 959-token prompt splits=$sp: $(timeout 90 $bin selftest -m $m.gguf --device cuda -p "$(cat long959.txt)" 2>&1 | grep -E 'verdict|FAILED' | tr '\n' ' ')"
  done
done
unset SPECULA_CUDA_ATTENTION_SPLITS
echo "checks took $(( $(date +%s) - t0 )) s"
for s in qwen2.5-1.5b llama-3.1-8b; do
    echo "== ring selftest random $s long prompt"
    timeout 150 $bin selftest --random-weights $s --device cuda -p "$(cat long.txt)" 2>&1 | grep -E 'verdict|FAILED|forward of n rows|^ +[0-9]+ +[0-9.]+ ms' | head -20
done
echo "checks+random took $(( $(date +%s) - t0 )) s"
ab 1024
echo "total $(( $(date +%s) - t0 )) s"
