#![no_main]
// specula::fuzz::chat_template: see crates/specula/src/fuzz.rs and fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    specula::fuzz::chat_template(data);
});
