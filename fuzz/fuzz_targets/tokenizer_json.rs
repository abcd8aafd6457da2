#![no_main]
// specula::fuzz::tokenizer_json: see crates/specula/src/fuzz.rs and fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specula::fuzz::tokenizer_json(data);
});
