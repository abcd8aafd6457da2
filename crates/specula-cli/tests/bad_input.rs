//! Bad input gets a clear error naming the problem, a non-zero exit, and never a panic.
//! These use tiny models written by the test itself, so they need no downloads.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use specula::model::gguf::{write_gguf, Value};
use specula::testing::{write_tiny_gguf, write_tiny_hf_dir, TinySpec};

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
    fails_with(
        &["generate", "-m", "/nonexistent/model.gguf", "-p", "hi"],
        &["/nonexistent/model.gguf", "no such file"],
    );
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
    let g = specula::model::gguf::GgufFile::open(&p).unwrap();
    let md: Vec<(String, Value)> = g
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut tensors = Vec::new();
    for t in &g.tensors {
        let w = g
            .weight(&t.name, t.dims.get(1).copied().unwrap_or(1), t.dims[0])
            .unwrap();
        if t.name == "blk.0.attn_q.weight" {
            tensors.push((
                t.name.clone(),
                t.dims.clone(),
                16u32,
                vec![0u8; t.n_elements() / 256 * 66],
            ));
        } else {
            tensors.push((
                t.name.clone(),
                t.dims.clone(),
                w.dtype().id(),
                w.raw_bytes(),
            ));
        }
    }
    let bad = dir.path().join("iq2.gguf");
    let md_ref: Vec<(&str, Value)> = md.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let t_ref: Vec<(&str, Vec<usize>, u32, Vec<u8>)> = tensors
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.clone(), *t, b.clone()))
        .collect();
    write_gguf(&bad, &md_ref, &t_ref).unwrap();
    fails_with(
        &["generate", "-m", bad.to_str().unwrap(), "-p", "hi"],
        &["blk.0.attn_q.weight", "IQ2_XXS", "does not support"],
    );
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
