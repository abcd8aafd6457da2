#![no_main]
// specula::fuzz::hf_checkpoint: see crates/specula/src/fuzz.rs and fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specula::fuzz::hf_checkpoint(data);
});
