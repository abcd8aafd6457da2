#!/usr/bin/env bash
# Attention merged through a thread-block cluster (scripts/gpu-variants/attention-cluster.patch: the one-row,
# one-head attention kernel with __cluster_dims__(1, 1, S); each split's partial stays in its block's shared memory
# and block 0 of the cluster merges them through distributed shared memory, in split order with the global merge's
# arithmetic: no partials in global memory, no fence, no atomic ticket). Runs on the device in one call, with the
# variants compiled by NVRTC through SPECULA_CUDA_KERNELS_SOURCE (no rebuild) at S = 8 and S = 4 splits
# (SPECULA_CUDA_ATTENTION_SPLITS must equal S: the grid's third dimension is the cluster):
#   [LENGTHS="256 1024"] scripts/gpu-attention-cluster.sh BINARY WORKDIR     (WORKDIR: tiny1024-{f32,q4k}.gguf, long959.txt, long.txt)
# Checks: selftest --device cuda (tiny models against the CPU, 959-token prompts so rows take several splits,
# random qwen2.5-1.5b after a long prompt; "3 heads a block = one a block bitwise" compares the cluster merge with
# the grouped kernel's global one). Then decode tok/s of the random shapes, current kernels against the variants.
set -uo pipefail
bin=$(realpath "$1"); work=$(realpath "$2")
repo=$(cd "$(dirname "$0")/.." && pwd)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cd "$work"
cp "$repo/crates/specula/src/backend/cuda/kernels.cu" current.cu
# (WORKDIR's own cluster8.cu / cluster4.cu are used when present, e.g. on a machine without `patch`.)
python3 - "$repo/scripts/gpu-variants/attention-cluster.patch" <<'PY' || exit 1
import os, subprocess, sys
for n in (8, 4):
    if os.path.exists(f"cluster{n}.cu"):
        continue
    subprocess.run(["patch", "-s", "-o", f"cluster{n}.cu", "current.cu", sys.argv[1]], check=True)
    s = open(f"cluster{n}.cu").read().replace("#define ATT_CLUSTER_SPLITS 8", f"#define ATT_CLUSTER_SPLITS {n}")
    open(f"cluster{n}.cu", "w").write(s)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
use() { # kernels splits
  export SPECULA_CUDA_KERNELS_SOURCE=$1.cu
  if [ "$2" = default ]; then unset SPECULA_CUDA_ATTENTION_SPLITS; else export SPECULA_CUDA_ATTENTION_SPLITS=$2; fi
}
verdict() { grep -E 'verdict|FAILED|rror' | head -5 | tr '\n' ' '; }
for v in "cluster8 8" "cluster4 4"; do
  use $v
  tinies="tiny-qwen2-q4_k"
  [ "$v" = "cluster8 8" ] && tinies="tiny-qwen2-f32 tiny-qwen2-q8_0 tiny-llama-q4_0 tiny-qwen2-q4_k tiny-llama-spm"
  for m in $tinies; do
    echo "== $v selftest $m: $(timeout 40 "$bin" selftest -m "$repo/fuzz/seeds/gguf/$m.gguf" --device cuda 2>&1 | verdict)"
  done
  for m in tiny1024-f32 tiny1024-q4k; do
    echo "== $v selftest $m, 959-token prompt: $(timeout 90 "$bin" selftest -m $m.gguf --device cuda -p "$(cat long959.txt)" 2>&1 | verdict)"
  done
done
use cluster8 8
echo "== cluster8 selftest random qwen2.5-1.5b, long prompt: $(timeout 120 "$bin" selftest --random-weights qwen2.5-1.5b --device cuda -p "$(cat long.txt)" 2>&1 | verdict)"
echo "checks took $(( $(date +%s) - t0 )) s"
gen() { # kernels splits shape tokens
  use "$1" "$2"
  timeout 60 "$bin" generate --random-weights "$3" --device cuda -p "hello world, this is a test" -n "$4" \
      --ignore-eos --raw --quiet --profile off 2>&1 | grep -E "^prompt|rror" | grep -oE "[0-9.]+ tok/s|.*rror.*" | tail -1
}
for n in ${LENGTHS:-256 1024}; do
  for r in $( [ "$n" = 256 ] && echo 1 2 || echo 1 ); do
    echo "qwen2.5-1.5b n=$n round $r: current/default $(gen current default qwen2.5-1.5b $n) | current/8 $(gen current 8 qwen2.5-1.5b $n) | cluster8 $(gen cluster8 8 qwen2.5-1.5b $n) | cluster4 $(gen cluster4 4 qwen2.5-1.5b $n)"
    echo "llama-3.1-8b n=$n round $r: current/default $(gen current default llama-3.1-8b $n) | cluster4 $(gen cluster4 4 llama-3.1-8b $n)"
  done
  echo "n=$n done at $(( $(date +%s) - t0 )) s"
done
