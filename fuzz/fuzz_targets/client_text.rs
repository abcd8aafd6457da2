#![no_main]
// specula::fuzz::client_text over the seed corpus's tokenizers and chat templates: see crates/specula/src/fuzz.rs
// and fuzz/README.md.
use std::sync::OnceLock;

use specula::chat::ChatTemplate;
use specula::tokenizer::Tokenizer;

fn tools() -> &'static (Vec<Tokenizer>, Vec<ChatTemplate>) {
    static TOOLS: OnceLock<(Vec<Tokenizer>, Vec<ChatTemplate>)> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
        let files = |dir: &str| -> Vec<Vec<u8>> {
            let mut paths: Vec<_> = std::fs::read_dir(seeds.join(dir))
                .expect("the seed corpus")
                .map(|e| e.expect("a seed").path())
                .collect();
            paths.sort();
            paths.iter().map(|p| std::fs::read(p).expect("a seed")).collect()
        };
        let null = serde_json::Value::Null;
        let tokenizers = files("tokenizer_json")
            .iter()
            .map(|b| Tokenizer::from_hf_json(b, &null, &null).expect("a seed tokenizer"))
            .collect();
        let templates = files("chat_template")
            .iter()
            .map(|b| ChatTemplate::new(String::from_utf8_lossy(b).into_owned()))
            .collect();
        (tokenizers, templates)
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let (tokenizers, templates) = tools();
    specula::fuzz::client_text(tokenizers, templates, data);
});
