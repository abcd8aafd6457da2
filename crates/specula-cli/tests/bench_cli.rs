//! `specula bench` and `specula tune` end to end on a tiny model the test writes itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use specula::testing::{write_tiny_gguf, TinySpec};

fn specula(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(args)
        .env(
            "SPECULA_CACHE",
            std::env::temp_dir().join("specula-bench-cli-cache"),
        )
        .output()
        .expect("run specula")
}

fn ok(args: &[&str]) -> (String, String) {
    let out = specula(args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{args:?} failed: {stderr}");
    (stdout, stderr)
}

fn fails_with(args: &[&str], expected: &[&str]) {
    let out = specula(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected failure for {args:?}");
    assert!(!stderr.contains("panicked"), "panic for {args:?}: {stderr}");
    for e in expected {
        assert!(
            stderr.contains(e),
            "stderr for {args:?} lacks {e:?}: {stderr}"
        );
    }
}

fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("tiny.gguf");
    write_tiny_gguf(&model, &TinySpec::default()).unwrap();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\": \"a\", \"prompt\": \"the tea the tea the\"}\n\n{\"id\": \"b\", \"prompt\": \"hello there\"}\n",
    )
    .unwrap();
    (model, prompts)
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Checks the invariants every speculative config of a bench report must satisfy.
fn check_consistent(report: &serde_json::Value, expected_configs: usize) {
    let configs = report["configs"].as_array().unwrap();
    assert_eq!(configs.len(), expected_configs);
    assert_eq!(configs[0]["label"], "plain");
    assert_eq!(configs[0]["speedup_vs_plain"], 1.0);
    for c in configs {
        assert_eq!(
            c["greedy_mismatches"], 0,
            "greedy speculation must equal plain: {c}"
        );
        assert!(c["decode_tok_s"].as_f64().unwrap() > 0.0);
        // One ratio per round, each this round's tok/s over plain's in the same round.
        let by_round = c["speedup_by_round"].as_array().unwrap();
        assert_eq!(
            by_round.len() as u64,
            report["rounds"].as_u64().unwrap(),
            "{c}"
        );
        assert!(by_round.iter().all(|x| x.as_f64().unwrap() > 0.0), "{c}");
        if c["k"] == 0 {
            assert!(by_round.iter().all(|x| x.as_f64() == Some(1.0)), "{c}");
            continue;
        }
        let s = &c["speculation"];
        let (drafted, accepted) = (
            s["drafted"].as_u64().unwrap(),
            s["accepted"].as_u64().unwrap(),
        );
        assert!(accepted <= drafted, "{s}");
        let hist: u64 = s["accept_len_histogram"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(hist, s["cycles"].as_u64().unwrap(), "{s}");
        assert_eq!(s["cycles"], c["cycles"]);
    }
}

#[test]
fn bench_and_tune_with_ngram_and_model_drafters() {
    let dir = tempfile::tempdir().unwrap();
    let (model, prompts) = setup(dir.path());
    let (m, p) = (model.to_str().unwrap(), prompts.to_str().unwrap());
    let out_json = dir.path().join("ngram.json");
    let (table, _) = ok(&[
        "bench",
        "-m",
        m,
        "--prompts",
        p,
        "--raw",
        "-n",
        "10",
        "--ignore-eos",
        "--draft",
        "ngram",
        "--draft-tokens",
        "2,1",
        "--rounds",
        "2",
        "--json",
        out_json.to_str().unwrap(),
    ]);
    assert!(
        table.contains("config") && table.contains("ngram k=1") && table.contains("ngram k=2"),
        "{table}"
    );
    assert!(table.contains("verify(n)"), "{table}");
    assert!(table.contains("speedup by round: ngram"), "{table}");
    let report = json(&out_json);
    check_consistent(&report, 3);
    assert_eq!(report["prompts"], 2);
    assert_eq!(report["rounds"], 2);
    assert_eq!(report["verify_cost"]["ms"].as_array().unwrap().len(), 3);

    // The target drafting for itself: every greedy draft is accepted.
    let self_json = dir.path().join("self.json");
    ok(&[
        "bench",
        "-m",
        m,
        "--prompts",
        p,
        "--raw",
        "-n",
        "10",
        "--ignore-eos",
        "--draft-model",
        m,
        "--draft-tokens",
        "1,3",
        "--json",
        self_json.to_str().unwrap(),
    ]);
    let report = json(&self_json);
    check_consistent(&report, 3);
    for c in &report["configs"].as_array().unwrap()[1..] {
        assert_eq!(c["acceptance_rate"], 1.0, "{c}");
    }

    // Tune from the saved bench.
    let plot = dir.path().join("tune.svg");
    let tune_json = dir.path().join("tune.json");
    let (out, _) = ok(&[
        "tune",
        "--from-bench",
        self_json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
        "--tune-json",
        tune_json.to_str().unwrap(),
    ]);
    assert!(out.contains("recommended:"), "{out}");
    assert!(
        out.contains("acceptance by draft position: 1:100%"),
        "{out}"
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{svg}");
    let t = json(&tune_json);
    assert_eq!(t["predictions"].as_array().unwrap().len(), 3);
    assert_eq!(
        t["acceptance_by_position"],
        serde_json::json!([1.0, 1.0, 1.0])
    );
}

/// Several drafter variants in one bench: every variant at every k, interleaved, each config carrying its
/// settings; tune models each variant on its own and recommends the winner with the flags that run it.
#[test]
fn bench_compares_drafter_variants() {
    let dir = tempfile::tempdir().unwrap();
    let (model, prompts) = setup(dir.path());
    let (m, p) = (model.to_str().unwrap(), prompts.to_str().unwrap());
    let ngram_json = dir.path().join("variants.json");
    let (table, _) = ok(&[
        "bench",
        "-m",
        m,
        "--prompts",
        p,
        "--raw",
        "-n",
        "8",
        "--ignore-eos",
        "--draft",
        "ngram",
        "--ngram-confidence",
        "auto,0",
        "--draft-tokens",
        "1,2",
        "--verify-repeats",
        "1",
        "--json",
        ngram_json.to_str().unwrap(),
    ]);
    for label in [
        "ngram cost-aware k=1",
        "ngram cost-aware k=2",
        "ngram conf>=0 k=1",
        "ngram conf>=0 k=2",
    ] {
        assert!(table.contains(label), "{label} missing: {table}");
    }
    let report = json(&ngram_json);
    check_consistent(&report, 5);
    let configs = report["configs"].as_array().unwrap();
    assert!(configs[0]["drafter"].is_null());
    assert!(configs[1]["drafter"]["ngram_confidence"].is_null());
    assert_eq!(configs[3]["drafter"]["ngram_confidence"], 0.0);
    assert_eq!(configs[3]["drafter"]["ngram_max"], 4);
    let tune_json = dir.path().join("tune.json");
    let plot = dir.path().join("tune.svg");
    let (tuned, _) = ok(&[
        "tune",
        "--from-bench",
        ngram_json.to_str().unwrap(),
        "--tune-json",
        tune_json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    for section in [
        "chain variant ngram cost-aware (--ngram-confidence auto):",
        "chain variant ngram conf>=0 (--ngram-confidence 0.0):",
    ] {
        assert!(tuned.contains(section), "{section} missing: {tuned}");
    }
    let t = json(&tune_json);
    let chains = t["chains"].as_array().unwrap();
    assert_eq!(chains.len(), 2);
    for c in chains {
        // Each variant predicts k = 1 and 2 and carries its own measurements.
        let predictions = c["predictions"].as_array().unwrap();
        assert_eq!(predictions.len(), 2, "{c}");
        assert!(predictions.iter().all(|p| p["measured_tok_s"].is_number()));
    }
    // The recommendation runs the winning variant, or plain decoding.
    let recommendation = t["recommendation"].as_str().unwrap();
    let winner_flags = t["chain_flags"].as_str().unwrap();
    assert!(
        recommendation == "plain decoding"
            || (recommendation.starts_with("--draft-tokens ")
                && recommendation.ends_with(winner_flags)
                && !winner_flags.is_empty()),
        "{recommendation} / {winner_flags}"
    );
    assert!(
        tuned.contains(&format!("recommended: {recommendation}")),
        "{tuned}"
    );
    assert!(tuned.contains("chain variants at their best k:"), "{tuned}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.contains("ngram conf&gt;=0"), "{svg}");

    let vocab_json = dir.path().join("vocab.json");
    let (table, _) = ok(&[
        "bench",
        "-m",
        m,
        "--prompts",
        p,
        "--raw",
        "-n",
        "8",
        "--ignore-eos",
        "--draft-model",
        m,
        "--draft-vocab",
        "full,40",
        "--draft-confidence",
        "0,0.5",
        "--draft-tokens",
        "2",
        "--verify-repeats",
        "1",
        "--json",
        vocab_json.to_str().unwrap(),
    ]);
    for label in [
        "model full vocab k=2",
        "model full vocab conf>=0.5 k=2",
        "model vocab<40 k=2",
        "model vocab<40 conf>=0.5 k=2",
    ] {
        assert!(table.contains(label), "{label} missing: {table}");
    }
    let report = json(&vocab_json);
    check_consistent(&report, 5);
    let configs = report["configs"].as_array().unwrap();
    assert!(configs[1]["drafter"]["draft_vocab"].is_null());
    assert_eq!(configs[1]["drafter"]["draft_confidence"], 0.0);
    assert_eq!(configs[2]["drafter"]["draft_confidence"], 0.5);
    assert_eq!(configs[3]["drafter"]["draft_vocab"], 40);
    let (tuned, _) = ok(&[
        "tune",
        "--from-bench",
        vocab_json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    for section in [
        "chain variant model full vocab (--draft-vocab full --draft-confidence 0.0):",
        "chain variant model full vocab conf>=0.5 (--draft-vocab full --draft-confidence 0.5):",
        "chain variant model vocab<40 (--draft-vocab 40 --draft-confidence 0.0):",
        "chain variant model vocab<40 conf>=0.5 (--draft-vocab 40 --draft-confidence 0.5):",
    ] {
        assert!(tuned.contains(section), "{section} missing: {tuned}");
    }
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            p,
            "--draft-model",
            m,
            "--draft-vocab",
            "full,many",
        ],
        &["--draft-vocab takes token counts or `full`", "\"many\""],
    );
}

#[test]
fn bench_bad_input_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (model, prompts) = setup(dir.path());
    let (m, p) = (model.to_str().unwrap(), prompts.to_str().unwrap());
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"prompt\": \"fine\"}\n{\"prompt\": \"broken\"\n{\"text\": \"x\"}\n",
    )
    .unwrap();
    let b = bad.to_str().unwrap();
    fails_with(
        &["bench", "-m", m, "--prompts", b, "--raw"],
        &["bad.jsonl:2:", "not valid JSON", "--skip-bad-lines"],
    );
    let (_, stderr) = ok(&[
        "bench",
        "-m",
        m,
        "--prompts",
        b,
        "--raw",
        "-n",
        "4",
        "--skip-bad-lines",
        "--verify-repeats",
        "0",
    ]);
    assert!(
        stderr.contains("bad.jsonl:2:") && stderr.contains("bad.jsonl:3: no \"prompt\" key"),
        "{stderr}"
    );
    fails_with(
        &["bench", "-m", m, "--prompts", "/nonexistent.jsonl"],
        &["/nonexistent.jsonl"],
    );
    fails_with(&["bench", "-m", m], &["--prompts"]);
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            p,
            "--draft",
            "ngram",
            "--draft-tokens",
            "0",
        ],
        &["--draft-tokens values must be between 1"],
    );
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            p,
            "--draft",
            "ngram",
            "--draft-tokens",
            "2,x",
        ],
        &["--draft-tokens"],
    );
    fails_with(
        &[
            "bench",
            "-m",
            m,
            "--prompts",
            p,
            "--draft",
            "ngram",
            "--draft-model",
            m,
        ],
        &["--draft ngram needs no model"],
    );
    fails_with(
        &["bench", "-m", m, "--prompts", p, "--rounds", "0"],
        &["--rounds"],
    );
    fails_with(
        &["tune", "-m", m, "--prompts", p],
        &["tune needs a drafter"],
    );
    fails_with(
        &["tune", "--from-bench", "/nonexistent.json"],
        &["/nonexistent.json"],
    );
    let plain_only = dir.path().join("plain.json");
    ok(&[
        "bench",
        "-m",
        m,
        "--prompts",
        p,
        "--raw",
        "-n",
        "4",
        "--json",
        plain_only.to_str().unwrap(),
    ]);
    fails_with(
        &["tune", "--from-bench", plain_only.to_str().unwrap()],
        &["no speculative configurations"],
    );
}
