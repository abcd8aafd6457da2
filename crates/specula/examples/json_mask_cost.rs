//! What constrained JSON costs a token: building the vocabulary's bytes, computing one state's mask (a pass over
//! the tokens whose first byte the state takes, once per state), and applying a cached mask to a row of logits, for
//! `json_object` (any object), for a JSON schema, for one whose values a pattern, formats and bounds shape, and for
//! a union of two objects that begin alike (states of two paths while the keys have not told them apart).
//! `cargo run --release --example json_mask_cost -- [MODEL]`

use std::time::Instant;

use specula::json_mode::{JsonConstraint, JsonGrammar, JsonState, JsonVocabulary};

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
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "toys": {"type": "array", "items": {"type": "string"}},
            "a": {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "number"}}}}
        },
        "required": ["name"]
    });
    let shaped = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
            "seen": {"type": "string", "format": "date-time"},
            "mail": {"type": "string", "format": "email"},
            "age": {"type": "integer", "minimum": 0, "maximum": 130}
        }
    });
    let start = Instant::now();
    let shaped = JsonGrammar::from_schema(&shaped)?;
    println!(
        "schema with a pattern, date-time, email and bounds compiled in {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let pets = serde_json::json!({
        "$defs": {
            "Cat": {"type": "object", "properties": {"name": {"type": "string"}, "meows": {"type": "integer"}}, "required": ["name", "meows"]},
            "Dog": {"type": "object", "properties": {"name": {"type": "string"}, "barks": {"type": "boolean"}}, "required": ["name"]}
        },
        "type": "object",
        "properties": {"pet": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}, {"type": "null"}]}}
    });
    let structural: &[&str] = &[
        "",
        "{",
        "{\n  \"name",
        "{\n  \"name\":",
        "{\n  \"name\": \"Tom\",\n  \"age\": 3",
        "{\n  \"name\": \"Tom\",\n  \"toys\": [\n    \"ball\",",
        "{\"name\": \"x\", \"a\": {\"b\": [1, 2.5e",
    ];
    let cases = [
        ("json_object", JsonGrammar::any_object(), structural),
        ("schema", JsonGrammar::from_schema(&schema)?, structural),
        (
            "shaped schema",
            shaped,
            &[
                "{\"name\": \"",
                "{\"name\": \"To",
                "{\"name\": \"Tom\", \"seen\": \"2024-0",
                "{\"name\": \"Tom\", \"mail\": \"tom@exa",
                "{\"name\": \"Tom\", \"age\": 1",
            ][..],
        ),
        (
            "union of objects",
            JsonGrammar::from_schema(&pets)?,
            &[
                "{\"pet\": ",
                "{\"pet\": {",
                "{\"pet\": {\"name\": \"To",
                "{\"pet\": {\"name\": \"Tom\", \"",
                "{\"pet\": {\"name\": \"Tom\", \"meows\": 3",
            ][..],
        ),
    ];
    let mut logits = vec![0.5f32; loaded.model.config().vocab_size];
    for (name, grammar, prefixes) in cases {
        let constraint = JsonConstraint::new(grammar, vocab.clone());
        for prefix in prefixes {
            let state = constraint
                .grammar()
                .after(JsonState::default(), prefix.as_bytes())
                .ok_or("a prefix the automaton refuses")?;
            let start = Instant::now();
            let mask = constraint.mask(state);
            let compute = start.elapsed();
            let allowed: u32 = mask.iter().map(|w| w.count_ones()).sum();
            let start = Instant::now();
            const APPLIES: u32 = 100;
            for _ in 0..APPLIES {
                constraint.apply(state, &mut logits)?;
            }
            let apply = start.elapsed() / APPLIES;
            println!(
                "{name}, after {prefix:?}: mask {:.2} ms, {allowed} tokens allowed; a cached mask applied to a row {:.1} us",
                compute.as_secs_f64() * 1e3,
                apply.as_secs_f64() * 1e6
            );
        }
    }
    Ok(())
}
