#!/usr/bin/env bash
# Builds dist/specula-train-cuda: specula with the CUDA backend AND candle's CUDA backend, so `specula
# train-eagle3 --device cuda` runs the target and trains the head on the GPU. Needs no GPU and no system CUDA here.
#
# Why it differs from the plain `--features cuda` build (which needs nothing at build time):
#  - candle compiles its kernels with nvcc at build time: we take nvcc 13.0 from the PyPI wheels into a venv
#    (13.0 because the device's driver is CUDA 13.0 and refuses PTX from a newer nvcc);
#  - candle-core asks cudarc for `dynamic-linking` (libcuda.so at link time; there is none here): we build against
#    a copy of candle-core generated into target/ with `dynamic-loading` instead (dlopen on the device);
#  - candle-kernels links `-lcudart`: we point the linker at the wheel's static cudart.
# Cold build on 2 cores: ~15-20 minutes (candle's quantized kernels); later builds: the specula crates only.
# Output: dist/specula-train-cuda (stripped). Kernels are built for CUDA_COMPUTE_CAP (default 90: H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."

ENV_DIR="${SPECULA_CUDA_ENV:-$HOME/.cache/specula/cuda-13.0-venv}"
if [ ! -x "$ENV_DIR/bin/python" ]; then
  python3 -m venv "$ENV_DIR"
  "$ENV_DIR/bin/pip" install -q \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88
fi
CU=$("$ENV_DIR/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
chmod +x "$CU"/bin/* "$CU"/nvvm/bin/* 2>/dev/null || true
export PATH="$CU/bin:$PATH" CUDA_HOME="$CU" CUDA_PATH="$CU" CUDA_ROOT="$CU"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
nvcc --version | tail -1

cargo fetch -q
META=$(cargo metadata --format-version 1 | python3 -c '
import json, sys
pk = [p for p in json.load(sys.stdin)["packages"] if p["name"] == "candle-core"]
assert pk, "candle-core is not a dependency of this workspace"
print(pk[0]["version"] + " " + pk[0]["manifest_path"])')
VER=${META%% *}
SRC=$(dirname "${META#* }")
PATCHED="$PWD/target/cuda-patch/candle-core-$VER"
if [ ! -f "$PATCHED/Cargo.toml" ]; then
  mkdir -p "$(dirname "$PATCHED")"
  rm -rf "$PATCHED"
  cp -r "$SRC" "$PATCHED"
  grep -q '"dynamic-linking"' "$PATCHED/Cargo.toml" \
    || { echo "candle-core $VER: no dynamic-linking feature to switch" >&2; exit 1; }
  sed -i 's/"dynamic-linking"/"dynamic-loading"/' "$PATCHED/Cargo.toml"
fi
LINKDIR="$PWD/target/cuda-patch/cudart-static"
mkdir -p "$LINKDIR"
ln -sf "$CU/lib/libcudart_static.a" "$LINKDIR/libcudart.a"

# The patched build rewrites Cargo.lock (candle-core from a path); keep the committed one.
cp Cargo.lock target/cuda-patch/Cargo.lock.saved
trap 'cp target/cuda-patch/Cargo.lock.saved Cargo.lock' EXIT
CARGO_TARGET_DIR="$PWD/target/train-cuda" RUSTFLAGS="${RUSTFLAGS:-} -L native=$LINKDIR" \
  cargo build --release -p specula-cli --features train-cuda \
  --config "patch.crates-io.candle-core.path=\"$PATCHED\""
mkdir -p dist
cp target/train-cuda/release/specula dist/specula-train-cuda
strip dist/specula-train-cuda
ls -l dist/specula-train-cuda
