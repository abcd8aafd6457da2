//! Writes a tiny random model (GGUF, byte-level tokenizer, untied LM head so it writes varied text) with a chosen
//! context length: device checks that need prompts longer than the fuzz seeds' 64-token context use it.
//! `cargo run --release -p specula --example write_tiny_model -- OUT.gguf [CONTEXT] [f32|q4_k]`

use specula::model::dtype::GgmlType;
use specula::testing::{write_tiny_gguf, TinySpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .get(1)
        .ok_or("usage: write_tiny_model OUT.gguf [CONTEXT] [f32|q4_k]")?;
    let context: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(512);
    let weight_type = match args.get(3).map(String::as_str).unwrap_or("f32") {
        "f32" => GgmlType::F32,
        "q4_k" => GgmlType::Q4K,
        other => return Err(format!("unknown weight type {other:?} (f32 or q4_k)").into()),
    };
    let spec = TinySpec {
        context,
        weight_type,
        untied_head: true,
        // Q4_K blocks hold 256 values: the rows must be that long.
        hidden: if weight_type == GgmlType::Q4K {
            256
        } else {
            64
        },
        intermediate: if weight_type == GgmlType::Q4K {
            512
        } else {
            128
        },
        ..Default::default()
    };
    write_tiny_gguf(std::path::Path::new(out), &spec)?;
    Ok(())
}
