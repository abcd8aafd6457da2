#![no_main]
// specula::fuzz::output_constraint: see crates/specula/src/fuzz.rs and fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specula::fuzz::output_constraint(data);
});
