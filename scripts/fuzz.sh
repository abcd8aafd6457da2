#!/usr/bin/env bash
# Long fuzzing runs with cargo-fuzz (libFuzzer + AddressSanitizer), one target after another:
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]      (default 300 s, all targets)
# Needs the nightly toolchain (`rustup toolchain install nightly`) and `cargo install cargo-fuzz`.
# Corpora grow under fuzz/corpus/<target> (seeded from fuzz/seeds/<target>); crashes land in fuzz/artifacts/.
# The test suite runs the same entry points in a bounded campaign (crates/specula/tests/fuzz_bounded.rs).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-300}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(gguf hf_checkpoint tokenizer_json chat_template prompts_jsonl bench_json output_constraint client_text)
fi
# The same CPU features as the main build, so the AVX2 kernels are fuzzed too.
export RUSTFLAGS="-C target-feature=+avx2,+fma,+f16c,+bmi2"
cargo +nightly fuzz build -O
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    echo "== $t: ${seconds}s"
    # -rss_limit_mb: an input that makes the engine allocate more than this is a finding (a size not bounded).
    cargo +nightly fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 2>&1 |
        grep -E "^(#[0-9]+ +DONE|stat::|==[0-9]+==|SUMMARY|Test unit written|ERROR|INFO: Done)" || true
done
