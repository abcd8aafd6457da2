//! Bad input gets a clear error naming the problem, a non-zero exit, and never a panic.
//! These use tiny models written by the test itself, so they need no downloads.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use specula::model::gguf::Value;
use specula::testing::{
    read_gguf_parts, set_metadata, write_gguf_parts, write_tiny_gguf, write_tiny_hf_dir, TinySpec,
};

fn specula(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(args)
        .env(
            "SPECULA_CACHE",
            std::env::temp_dir().join("specula-bad-input-cache"),
        )
        .output()
        .expect("run specula")
}

/// Runs `specula generate` on `model` and returns stderr, asserting a clean failure.
fn fails_with(args: &[&str], expected: &[&str]) -> String {
    let out = specula(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "expected failure for {args:?}; stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panic for {args:?}: {stderr}");
    for e in expected {
        assert!(
            stderr.contains(e),
            "stderr for {args:?} lacks {e:?}: {stderr}"
        );
    }
    stderr
}

fn tiny_gguf(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_tiny_gguf(&p, &TinySpec::default()).unwrap();
    p
}

#[test]
fn missing_model_path() {
    let stderr = fails_with(
        &["generate", "-m", "/nonexistent/model.gguf", "-p", "hi"],
        &["/nonexistent/model.gguf", "no such file"],
    );
    // The cause is said once (the error chain printed whole used to repeat it).
    assert_eq!(stderr.matches("no such file").count(), 1, "{stderr}");
    // A path that exists but is neither a file nor a directory is not "missing".
    if Path::new("/dev/null").exists() {
        let stderr = fails_with(
            &["generate", "-m", "/dev/null", "-p", "hi"],
            &["/dev/null is neither a file nor a directory"],
        );
        assert!(!stderr.contains("no such file"), "{stderr}");
    }
}

#[test]
fn unknown_short_name_lists_known_ones() {
    fails_with(
        &["generate", "-m", "llama-99b", "-p", "hi"],
        &[
            "unknown model \"llama-99b\"",
            "smollm2-135m",
            "qwen2.5-coder-1.5b",
        ],
    );
    fails_with(&["fetch", "llama-99b"], &["unknown model", "smollm2-135m"]);
}

#[test]
fn truncated_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_gguf(dir.path());
    let bytes = std::fs::read(&p).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    fails_with(
        &["generate", "-m", cut.to_str().unwrap(), "-p", "hi"],
        &["truncated", "cut.gguf"],
    );
    // Cut inside the header too.
    std::fs::write(&cut, &bytes[..100]).unwrap();
    fails_with(
        &["generate", "-m", cut.to_str().unwrap(), "-p", "hi"],
        &["truncated"],
    );
}

#[test]
fn corrupt_gguf_magic() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("not.gguf");
    std::fs::write(&p, b"this is not a model file at all, just text").unwrap();
    fails_with(
        &["generate", "-m", p.to_str().unwrap(), "-p", "hi"],
        &["not a valid GGUF", "magic"],
    );
}

#[test]
fn unsupported_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mamba.gguf");
    write_tiny_gguf(
        &p,
        &TinySpec {
            architecture: "mamba",
            ..Default::default()
        },
    )
    .unwrap();
    fails_with(
        &["generate", "-m", p.to_str().unwrap(), "-p", "hi"],
        &["unsupported model architecture", "mamba"],
    );
}

#[test]
fn unsupported_quantization_type_is_named() {
    // Rewrite the tiny model with one matrix stored as IQ2_XXS (GGML type 16): 66 bytes per 256 values.
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_gguf(dir.path());
    let mut parts = read_gguf_parts(&p).unwrap();
    for t in &mut parts.1 {
        if t.0 == "blk.0.attn_q.weight" {
            let elements: usize = t.1.iter().product();
            t.2 = 16;
            t.3 = vec![0u8; elements / 256 * 66];
        }
    }
    let bad = dir.path().join("iq2.gguf");
    write_gguf_parts(&bad, &parts).unwrap();
    fails_with(
        &["generate", "-m", bad.to_str().unwrap(), "-p", "hi"],
        &["blk.0.attn_q.weight", "IQ2_XXS", "does not support"],
    );
}

/// The tiny model with one metadata entry changed.
fn tiny_with(dir: &Path, key: &str, value: Value) -> PathBuf {
    let mut parts = read_gguf_parts(&tiny_gguf(dir)).unwrap();
    set_metadata(&mut parts, key, value);
    let p = dir.join(format!("{key}.gguf"));
    write_gguf_parts(&p, &parts).unwrap();
    p
}

/// Sizes a file controls are bounded before anything is allocated by them, and the error names the field, the
/// value and the limit.
#[test]
fn huge_or_empty_sizes_in_gguf_metadata_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (key, value, expected) in [
        (
            "qwen2.block_count",
            Value::U64(1 << 40),
            "GGUF metadata qwen2.block_count is 1099511627776; it must be between 1 and 1024",
        ),
        (
            "qwen2.attention.head_count",
            Value::U64(u64::MAX),
            "qwen2.attention.head_count is 18446744073709551615",
        ),
        (
            "qwen2.embedding_length",
            Value::U32(0),
            "qwen2.embedding_length is 0",
        ),
        (
            "qwen2.context_length",
            Value::U64(1 << 50),
            "qwen2.context_length is 1125899906842624; it must be between 1 and 16777216",
        ),
        (
            "qwen2.attention.layer_norm_rms_epsilon",
            Value::F32(f32::NAN),
            "RMSNorm epsilon is NaN",
        ),
        (
            "tokenizer.ggml.tokens",
            Value::Array(vec![]),
            "tokenizer.ggml.tokens is empty",
        ),
    ] {
        let p = tiny_with(dir.path(), key, value);
        fails_with(
            &["generate", "-m", p.to_str().unwrap(), "-p", "hi"],
            &[expected],
        );
    }
}

/// Four dimensions of 2^40 each pass a per-dimension check; their product overflows 64 bits and, wrapped in a
/// release build, would have passed the check that the tensor lies inside the file.
#[test]
fn tensor_dimensions_whose_product_overflows_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut parts = read_gguf_parts(&tiny_gguf(dir.path())).unwrap();
    parts.1[0].1 = vec![1 << 40, 1 << 40, 1 << 40, 1 << 40];
    let name = parts.1[0].0.clone();
    let p = dir.path().join("dims.gguf");
    write_gguf_parts(&p, &parts).unwrap();
    fails_with(
        &["generate", "-m", p.to_str().unwrap(), "-p", "hi"],
        &[&name, "product overflows"],
    );
}

#[test]
fn huge_sizes_in_config_json_are_refused() {
    for (key, value, expected) in [
        (
            "num_hidden_layers",
            serde_json::json!(99_999_999_999u64),
            "config.json num_hidden_layers is 99999999999; it must be between 1 and 1024",
        ),
        (
            "vocab_size",
            serde_json::json!(1u64 << 40),
            "config.json vocab_size is 1099511627776",
        ),
        (
            "num_key_value_heads",
            serde_json::json!(0),
            "config.json num_key_value_heads is 0",
        ),
        (
            "num_hidden_layers",
            serde_json::json!(-3),
            "num_hidden_layers",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_hf_dir(dir.path(), &TinySpec::default()).unwrap();
        let path = dir.path().join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config[key] = value;
        std::fs::write(&path, config.to_string()).unwrap();
        fails_with(
            &["generate", "-m", dir.path().to_str().unwrap(), "-p", "hi"],
            &[expected],
        );
    }
}

/// `--max-tokens` beyond the context is capped with a note (generation ends when the context is full), never
/// sized into an allocation.
#[test]
fn max_tokens_beyond_the_context_is_capped_with_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_gguf(dir.path()); // context 256
    let report = dir.path().join("r.json");
    for n in ["99999999999", "18446744073709551615"] {
        let out = specula(&[
            "generate",
            "-m",
            p.to_str().unwrap(),
            "--raw",
            "-p",
            "the tea",
            "-n",
            n,
            "--ignore-eos",
            "--quiet",
            "--report-json",
            report.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "note: --max-tokens {n} is more than the context leaves"
            )),
            "{stderr}"
        );
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        assert_eq!(r["stop_reason"], "context_full", "{r}");
        let total = r["prompt_tokens"].as_u64().unwrap() + r["generated_tokens"].as_u64().unwrap();
        // Every cache position holds a token; the last token is generated from the last position.
        assert_eq!(total, 257);
    }
}

/// Counts that size loops or buffers are bounded, and checked before the model loads (the model path here
/// does not exist, so a check that ran after loading would report the path instead).
#[test]
fn huge_counts_in_flags_are_refused_before_loading() {
    let m = "/nonexistent/model.gguf";
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--draft-tokens",
            "99999999999",
        ],
        &["--draft-tokens must be between 1 and 64, got 99999999999"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--threads", "99999999"],
        &["--threads must be between 1 and 1024, got 99999999"],
    );
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"hi\"}\n").unwrap();
    let pr = prompts.to_str().unwrap();
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            pr,
            "--rounds",
            "99999999999999",
        ],
        &["--rounds must be between 1 and 1000, got 99999999999999"],
    );
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            pr,
            "--verify-repeats",
            "99999999999999",
        ],
        &["--verify-repeats must be between 0 and 1000, got 99999999999999"],
    );
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            pr,
            "--draft",
            "ngram",
            "--draft-tokens",
            "2,99999999999",
        ],
        &["--draft-tokens values must be between 1 and 64, got 99999999999"],
    );
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            pr,
            "--draft",
            "ngram",
            "--draft-tokens",
            "99999999999999999999999",
        ],
        &["--draft-tokens"],
    );
    fails_with(
        &["profile-overhead", "-m", m, "--rounds", "99999999999999"],
        &["--rounds must be between 1 and 1000"],
    );
}

/// A bench JSON file is untrusted input too: `tune --from-bench` bounds the draft length it sizes tables by and
/// refuses numbers that are not measurements.
#[test]
fn tune_from_bench_refuses_huge_or_non_numeric_fields() {
    let dir = tempfile::tempdir().unwrap();
    let config = |k: serde_json::Value, tok_s: serde_json::Value| {
        serde_json::json!({"k": k, "decode_tok_s": tok_s, "cycles": 10, "draft_ms_per_cycle": 1.0,
            "verify_ms_per_cycle": 2.0, "overhead_ms_per_cycle": 0.1, "label": "x", "method": "ngram",
            "speculation": {"drafted_per_position": [5], "accepted_per_position": [3]}})
    };
    let plain = config(serde_json::json!(0), serde_json::json!(50.0));
    for (spec_config, expected) in [
        (
            config(serde_json::json!(1u64 << 60), serde_json::json!(60.0)),
            "k = 1152921504606846976; expected a draft length between 1 and 64",
        ),
        (
            config(serde_json::json!(2), serde_json::json!(-1.0)),
            "\"decode_tok_s\" is -1",
        ),
        (
            config(serde_json::json!(2), serde_json::json!("fast")),
            "missing number \"decode_tok_s\"",
        ),
    ] {
        let report = serde_json::json!({"configs": [plain, spec_config],
            "verify_cost": {"ms": [2.0, 2.5, 3.0]}});
        let path = dir.path().join("bench.json");
        std::fs::write(&path, report.to_string()).unwrap();
        fails_with(
            &[
                "tune",
                "--from-bench",
                path.to_str().unwrap(),
                "--plot",
                dir.path().join("t.svg").to_str().unwrap(),
            ],
            &[expected],
        );
    }
}

#[test]
fn truncated_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_hf_dir(dir.path(), &TinySpec::default()).unwrap();
    let st = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 1000]).unwrap();
    fails_with(
        &["generate", "-m", dir.path().to_str().unwrap(), "-p", "hi"],
        &["model.safetensors", "truncated"],
    );
}

#[test]
fn prompt_longer_than_context() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_gguf(dir.path()); // context 256
    let long = "word ".repeat(400);
    fails_with(
        &["generate", "-m", p.to_str().unwrap(), "--raw", "-p", &long],
        &["context is 256 tokens"],
    );
}

#[test]
fn bad_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_gguf(dir.path());
    let m = p.to_str().unwrap();
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--max-tokens", "0"],
        &["--max-tokens must be at least 1"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--max-tokens", "-5"],
        &["--max-tokens"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--temperature", "-1"],
        &["--temperature"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--top-p", "2"],
        &["--top-p"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--threads", "0"],
        &["--threads"],
    );
    fails_with(&["generate", "-m", m], &["--prompt"]);
}

#[test]
fn tiny_model_generates_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_gguf(dir.path());
    let report = dir.path().join("r.json");
    let out = specula(&[
        "generate",
        "-m",
        p.to_str().unwrap(),
        "-p",
        "the tea",
        "-n",
        "12",
        "--ignore-eos",
        "--report-json",
        report.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["generated_tokens"], 12);
    assert_eq!(r["token_ids"].as_array().unwrap().len(), 12);
    assert_eq!(r["config"]["device"], "cpu");
    assert_eq!(r["config"]["model_sha256"].as_str().unwrap().len(), 64);
    assert!(r["speculation"].is_null());
    for key in ["load_s", "prefill_s", "decode_s", "decode_tok_s", "wall_s"] {
        assert!(r["timing"][key].as_f64().is_some(), "timing.{key}");
    }
    assert_eq!(r["phases"]["verify"]["count"], 11);
}

#[test]
fn conflicting_or_bad_draft_flags() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_gguf(dir.path());
    let m = p.to_str().unwrap();
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--draft-model",
            m,
        ],
        &["--draft ngram needs no model"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--draft", "model"],
        &["--draft-model"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--draft", "eagle9"],
        &["unknown --draft method"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--draft-tokens",
            "0",
        ],
        &["--draft-tokens must be between 1"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--draft-tokens",
            "1000",
        ],
        &["--draft-tokens must be between 1"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--ngram-min",
            "3",
            "--ngram-max",
            "2",
        ],
        &["--ngram-min"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--ngram-max",
            "9",
        ],
        &["--ngram-max must be at most 8"],
    );
    for bad in ["1.5", "-0.1", "NaN"] {
        fails_with(
            &[
                "generate",
                "-m",
                m,
                "-p",
                "hi",
                "--draft",
                "ngram",
                "--ngram-confidence",
                bad,
            ],
            &["--ngram-confidence must be between 0 and 1"],
        );
    }
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--draft-tokens", "4"],
        &["--draft-tokens needs a drafter"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--ngram-confidence",
            "high",
        ],
        &["--ngram-confidence takes numbers between 0 and 1 or `auto`"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--ngram-confidence",
            "0.2,0.4",
        ],
        &["--ngram-confidence takes one value here"],
    );
    fails_with(
        &["generate", "-m", m, "-p", "hi", "--ngram-confidence", "0.2"],
        &["--ngram-confidence applies to prompt lookup"],
    );
    for bad in ["1.5", "-0.1", "NaN"] {
        fails_with(
            &[
                "generate",
                "-m",
                m,
                "-p",
                "hi",
                "--draft-model",
                m,
                "--draft-confidence",
                bad,
            ],
            &["--draft-confidence must be between 0 and 1"],
        );
    }
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--draft-confidence",
            "0.5",
        ],
        &["--draft-confidence applies to a draft model"],
    );
    // A tree's bar (the least path probability a node keeps) is a probability too.
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "eagle3",
            "--draft-model",
            "/nonexistent-head",
            "--eagle-topk",
            "2",
            "--draft-confidence",
            "1.5",
        ],
        &["--draft-confidence must be between 0 and 1 (got 1.5)"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft-model",
            m,
            "--draft-confidence",
            "0.2,0.4",
        ],
        &["--draft-confidence takes one value here"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft-model",
            m,
            "--draft-vocab",
            "100,200",
        ],
        &["--draft-vocab takes one value here"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--draft-vocab",
            "100",
        ],
        &["--draft-vocab applies to a draft model"],
    );
    for bad in ["0", "1000000"] {
        fails_with(
            &[
                "generate",
                "-m",
                m,
                "-p",
                "hi",
                "--draft-model",
                m,
                "--draft-vocab",
                bad,
            ],
            &["--draft-vocab must be between 1 and"],
        );
    }
}

#[test]
fn simulated_acceptance_is_checked_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_gguf(dir.path());
    let m = model.to_str().unwrap();
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--simulate-acceptance",
            "0.8",
        ],
        &["--simulate-acceptance needs a drafter"],
    );
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft",
            "ngram",
            "--simulate-acceptance",
            "1.5",
        ],
        &["--simulate-acceptance must be a probability between 0 and 1, got 1.5"],
    );
    // A random-weights draft names the device it needs on a CPU run.
    fails_with(
        &[
            "generate",
            "-m",
            m,
            "-p",
            "hi",
            "--draft-model",
            "random:llama-3.2-1b",
        ],
        &["--device cuda"],
    );
}
