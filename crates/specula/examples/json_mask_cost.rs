//! What JSON mode costs a token: building the vocabulary's bytes, computing one state's mask (a pass over the
//! vocabulary, once per state), and applying a cached mask to a row of logits.
//! `cargo run --release --example json_mask_cost -- [MODEL]`

use std::time::Instant;

use specula::json_mode::{JsonState, JsonVocabulary};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let spec = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "qwen2.5-coder-0.5b".into());
    let loaded = specula::load_model(&spec, false, &mut |l| eprintln!("{l}"))?;
    let start = Instant::now();
    let vocab = JsonVocabulary::new(&loaded.tokenizer);
    println!(
        "vocabulary of {} tokens as bytes: {:.1} ms",
        vocab.len(),
        start.elapsed().as_secs_f64() * 1e3
    );
    let prefixes = [
        "",
        "{",
        "{\n  \"name",
        "{\n  \"name\":",
        "{\n  \"age\": 3",
        "{\n  \"toys\": [\n    \"ball\",",
        "{\"a\": {\"b\": [1, 2.5e",
    ];
    let mut logits = vec![0.5f32; loaded.model.config().vocab_size];
    for prefix in prefixes {
        let state = JsonState::default()
            .after(prefix.as_bytes())
            .ok_or("a prefix the automaton refuses")?;
        let start = Instant::now();
        let mask = vocab.mask(state);
        let compute = start.elapsed();
        let allowed: u32 = mask.iter().map(|w| w.count_ones()).sum();
        let start = Instant::now();
        const APPLIES: u32 = 100;
        for _ in 0..APPLIES {
            vocab.apply(state, &mut logits)?;
        }
        let apply = start.elapsed() / APPLIES;
        println!(
            "after {prefix:?}: mask {:.2} ms, {allowed} tokens allowed; a cached mask applied to a row {:.1} us",
            compute.as_secs_f64() * 1e3,
            apply.as_secs_f64() * 1e6
        );
    }
    Ok(())
}
