//! Writes the fuzzing seed corpora to `fuzz/seeds/<target>/` (committed; rerun after changing a format):
//!
//! ```sh
//! cargo run --release --example fuzz_seeds      # needs the registry models: specula fetch all
//! ```
//!
//! - gguf: the real headers of the registry models (metadata, chat template, tokenizer and the whole tensor
//!   directory, without tensor data), with the vocabulary cut to its first tokens and the merges among them so a
//!   seed parses in milliseconds; and tiny complete models in several storage types and both tokenizer kinds
//!   (byte-level BPE and SentencePiece).
//! - tokenizer_json: those vocabularies as tokenizer.json, and the tiny one.
//! - chat_template: the registry models' templates and ChatML.
//! - hf_checkpoint: a tiny config.json + safetensors shard.
//! - prompts_jsonl: the shared prompt files' first lines.
//! - bench_json: a bench report of a tiny model with prompt lookup.

use std::path::{Path, PathBuf};

use specula::model::dtype::GgmlType;
use specula::model::gguf::{header_bytes, GgufFile, Value};
use specula::testing::{write_tiny_gguf, write_tiny_hf_dir, TinySpec};

/// Tokens kept of a real vocabulary (ids beyond it lose their entries, as a small model's vocabulary would).
const KEPT_TOKENS: usize = 1200;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds");
    let dir = |target: &str| -> std::io::Result<PathBuf> {
        let d = root.join(target);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    };
    let (gguf_dir, tok_dir, chat_dir) =
        (dir("gguf")?, dir("tokenizer_json")?, dir("chat_template")?);

    for model in specula::registry::MODELS {
        let path = model.cached().ok_or_else(|| {
            format!(
                "{} is not cached: run `specula fetch {}`",
                model.name, model.name
            )
        })?;
        let real = GgufFile::open(&path)?;
        let header = shrunk_header(&real);
        std::fs::write(
            gguf_dir.join(format!("{}-header.gguf", model.name)),
            &header,
        )?;
        let parsed = GgufFile::parse_header(header, Path::new("seed"))?;
        let tokenizer = specula::tokenizer::Tokenizer::from_gguf(&parsed)?;
        std::fs::write(
            tok_dir.join(format!("{}.json", model.name)),
            tokenizer.to_hf_json()?,
        )?;
        if let Some(t) = real.get_str("tokenizer.chat_template") {
            std::fs::write(chat_dir.join(format!("{}.jinja", model.name)), t)?;
        }
        println!(
            "{}: header seed {} bytes",
            model.name,
            parsed_len(&gguf_dir, model.name)
        );
    }
    std::fs::write(
        chat_dir.join("chatml.jinja"),
        specula::chat::CHATML_TEMPLATE,
    )?;

    // Tiny complete models: small enough that a fuzzer runs thousands a second, in the storage types and
    // architectures the loader distinguishes.
    let tmp = tempfile::tempdir()?;
    for (name, architecture, weight_type) in [
        ("tiny-qwen2-f32", "qwen2", GgmlType::F32),
        ("tiny-qwen2-q8_0", "qwen2", GgmlType::Q8_0),
        ("tiny-llama-q4_0", "llama", GgmlType::Q4_0),
        ("tiny-qwen2-q4_k", "qwen2", GgmlType::Q4K),
    ] {
        let k_quant = weight_type == GgmlType::Q4K;
        let spec = TinySpec {
            architecture,
            hidden: if k_quant { 256 } else { 32 },
            intermediate: if k_quant { 256 } else { 32 },
            layers: 1,
            heads: 2,
            kv_heads: 1,
            context: 64,
            weight_type,
            ..Default::default()
        };
        let p = tmp.path().join(name);
        write_tiny_gguf(&p, &spec)?;
        std::fs::copy(&p, gguf_dir.join(format!("{name}.gguf")))?;
    }
    // The SentencePiece tokenizer path (GGUF `llama` tokenizers): the tiny llama model with its vocabulary
    // replaced by a SentencePiece one of the same size.
    let spm = tmp.path().join("spm.gguf");
    let spec = TinySpec {
        architecture: "llama",
        hidden: 32,
        intermediate: 32,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        context: 64,
        weight_type: GgmlType::Q8_0,
        ..Default::default()
    };
    write_tiny_gguf(&spm, &spec)?;
    let mut parts = specula::testing::read_gguf_parts(&spm)?;
    let vocab_len = specula::testing::tiny_vocab().0.len();
    let mut pieces: Vec<(String, f32, i32)> = vec![
        ("<unk>".into(), 0.0, 2),
        ("<s>".into(), 0.0, 3),
        ("</s>".into(), 0.0, 3),
    ];
    for (i, piece) in [
        "\u{2581}",
        "t",
        "h",
        "e",
        "a",
        "c",
        "s",
        "o",
        "w",
        "th",
        "he",
        "\u{2581}the",
        "\u{2581}th",
        "the",
        "\u{2581}c",
        "at",
        "\u{2581}cat",
        "ca",
        "cat",
        "\u{2581}a",
    ]
    .iter()
    .enumerate()
    {
        pieces.push((piece.to_string(), -(i as f32), 1));
    }
    let mut byte = 0u32;
    while pieces.len() < vocab_len {
        pieces.push((format!("<0x{byte:02X}>"), 0.0, 6));
        byte += 1;
    }
    use specula::testing::set_metadata;
    let array =
        |f: &dyn Fn(&(String, f32, i32)) -> Value| Value::Array(pieces.iter().map(f).collect());
    set_metadata(
        &mut parts,
        "tokenizer.ggml.model",
        Value::String("llama".into()),
    );
    set_metadata(
        &mut parts,
        "tokenizer.ggml.tokens",
        array(&|p| Value::String(p.0.clone())),
    );
    set_metadata(
        &mut parts,
        "tokenizer.ggml.scores",
        array(&|p| Value::F32(p.1)),
    );
    set_metadata(
        &mut parts,
        "tokenizer.ggml.token_type",
        array(&|p| Value::I32(p.2)),
    );
    set_metadata(&mut parts, "tokenizer.ggml.bos_token_id", Value::U32(1));
    set_metadata(&mut parts, "tokenizer.ggml.eos_token_id", Value::U32(2));
    set_metadata(
        &mut parts,
        "tokenizer.ggml.add_bos_token",
        Value::Bool(true),
    );
    parts
        .0
        .retain(|(k, _)| k != "tokenizer.ggml.merges" && k != "tokenizer.ggml.pre");
    specula::testing::write_gguf_parts(&gguf_dir.join("tiny-llama-spm.gguf"), &parts)?;

    let null = serde_json::Value::Null;
    let tiny_json = specula::testing::tiny_tokenizer_json().to_string();
    specula::tokenizer::Tokenizer::from_hf_json(tiny_json.as_bytes(), &null, &null)?;
    std::fs::write(tok_dir.join("tiny.json"), tiny_json)?;

    let hf = tmp.path().join("hf");
    let spec = TinySpec {
        hidden: 32,
        intermediate: 32,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        context: 64,
        ..Default::default()
    };
    write_tiny_hf_dir(&hf, &spec)?;
    let framed = specula::fuzz::frame_hf_checkpoint(
        &std::fs::read(hf.join("config.json"))?,
        &std::fs::read(hf.join("model.safetensors"))?,
    )
    .ok_or("config.json too long to frame")?;
    std::fs::write(dir("hf_checkpoint")?.join("tiny.bin"), framed)?;

    let prompts_dir = dir("prompts_jsonl")?;
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/prompts");
    for (name, path) in [
        ("code.jsonl", shared.join("code.jsonl")),
        ("chat.jsonl", shared.join("chat.jsonl")),
        (
            "edit.jsonl",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/edit.jsonl"),
        ),
    ] {
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let head: Vec<&str> = text.lines().take(3).collect();
        std::fs::write(prompts_dir.join(name), head.join("\n") + "\n")?;
    }

    std::fs::write(
        dir("bench_json")?.join("tiny-ngram.json"),
        tiny_bench_json(&tmp)?,
    )?;
    println!("seeds written under {}", root.display());
    Ok(())
}

fn parsed_len(dir: &Path, name: &str) -> u64 {
    std::fs::metadata(dir.join(format!("{name}-header.gguf")))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// The real header with the token arrays cut to their first [`KEPT_TOKENS`] entries and the merges to those
/// among kept tokens; the tensor directory is unchanged (its data is not included).
fn shrunk_header(real: &GgufFile) -> Vec<u8> {
    let kept: std::collections::HashSet<&str> = real
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .unwrap_or(&[])
        .iter()
        .take(KEPT_TOKENS)
        .filter_map(Value::as_str)
        .collect();
    let mut metadata: Vec<(String, Value)> = real
        .metadata
        .iter()
        .map(|(k, v)| {
            let v = match (k.as_str(), v) {
                ("tokenizer.ggml.merges", Value::Array(merges)) => Value::Array(
                    merges
                        .iter()
                        .filter(|m| {
                            m.as_str()
                                .and_then(|m| m.split_once(' '))
                                .is_some_and(|(a, b)| {
                                    kept.contains(a)
                                        && kept.contains(b)
                                        && kept.contains(format!("{a}{b}").as_str())
                                })
                        })
                        .cloned()
                        .collect(),
                ),
                (
                    "tokenizer.ggml.tokens" | "tokenizer.ggml.token_type" | "tokenizer.ggml.scores",
                    Value::Array(items),
                ) => Value::Array(items.iter().take(KEPT_TOKENS).cloned().collect()),
                _ => v.clone(),
            };
            (k.clone(), v)
        })
        .collect();
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    let md: Vec<(&str, Value)> = metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    header_bytes(&md, &real.tensors)
}

/// A real bench report: a tiny model, prompt lookup at k = 1 and 2.
fn tiny_bench_json(tmp: &tempfile::TempDir) -> Result<String, Box<dyn std::error::Error>> {
    let p = tmp.path().join("bench-model.gguf");
    write_tiny_gguf(&p, &TinySpec::default())?;
    let m = specula::model::load_gguf(&p, "tiny")?;
    let prompt = specula::bench::BenchPrompt {
        id: "p".into(),
        prompt: "the tea the tea the".into(),
    };
    let ids = m.tokenizer.encode(&prompt.prompt)?;
    let spec = specula::bench::BenchSpec {
        target: m.model.as_ref(),
        tokenizer: &m.tokenizer,
        draft: None,
        eagle3: Vec::new(),
        methods: vec![specula::bench::DraftMethod::Ngram {
            min_n: 1,
            max_n: 3,
            min_confidence: Some(0.0),
        }],
        draft_tokens: vec![1, 2],
        prompts: vec![(prompt, ids)],
        max_new_tokens: 16,
        rounds: 1,
        sampling: Default::default(),
        stop_at_eos: false,
        verify_cost_repeats: 1,
        simulate_acceptance: None,
    };
    let report = specula::bench::run_bench(&spec, &mut |_| {})?;
    Ok(serde_json::to_string_pretty(&report.to_json())?)
}
