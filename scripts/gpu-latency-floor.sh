#!/usr/bin/env bash
# Builds and runs scripts/gpu-latency-floor.cu on the device (nvcc there): the step of a qwen2.5-1.5b-shape
# model's byte sizes streamed as one kernel a phase (PDL, CUDA graph) against one persistent kernel with grid
# barriers, and the bare cost of a kernel boundary and of a barrier. Usage: scripts/gpu-latency-floor.sh [LAYERS [8b]]
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
"$NVCC" -O3 -arch=sm_90 -o /tmp/gpu-latency-floor scripts/gpu-latency-floor.cu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
/tmp/gpu-latency-floor "${1:-28}" ${2:-}
