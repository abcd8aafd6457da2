//! The profiler's outputs on a real model (smollm2-135m, fetched by .ci/run): phase coverage, JSON report, trace.

use std::process::Command;

fn generate(extra: &[&str]) -> (serde_json::Value, String) {
    generate_with("The capital of France is", "24", extra)
}

fn generate_with(prompt: &str, max_tokens: &str, extra: &[&str]) -> (serde_json::Value, String) {
    let mut quiet = vec!["--quiet"];
    quiet.extend_from_slice(extra);
    let (report, _, stderr) = generate_printing(prompt, max_tokens, &quiet);
    (report, stderr)
}

/// Runs `specula generate` on smollm2 (raw prompt, fixed length, 2 threads); returns the JSON report, the
/// printed text and stderr.
fn generate_printing(
    prompt: &str,
    max_tokens: &str,
    extra: &[&str],
) -> (serde_json::Value, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut args = vec![
        "generate",
        "-m",
        "smollm2-135m",
        "--raw",
        "-p",
        prompt,
        "-n",
        max_tokens,
        "--ignore-eos",
        "-t",
        "2",
        "--report-json",
        report.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(&args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "specula failed (run `specula fetch smollm2-135m` first?): {stderr}"
    );
    let r = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    (r, String::from_utf8_lossy(&out.stdout).to_string(), stderr)
}

#[test]
fn named_phases_cover_at_least_95_percent_of_decode_time() {
    let (r, stderr) = generate(&[]);
    let phases = r["phases"].as_object().unwrap();
    for name in ["prefill", "verify", "sample", "commit", "emit", "other"] {
        assert!(
            phases.contains_key(name),
            "phase {name} missing: {phases:?}"
        );
    }
    let named: f64 = phases
        .iter()
        .filter(|(k, _)| *k != "other" && *k != "prefill")
        .map(|(_, v)| v["share_of_decode"].as_f64().unwrap())
        .sum();
    let other = phases["other"]["share_of_decode"].as_f64().unwrap();
    assert!(
        named >= 0.95,
        "named phases cover only {:.1}% of decode",
        named * 100.0
    );
    assert!(
        (named + other - 1.0).abs() < 1e-6,
        "phases + other = {}",
        named + other
    );
    let decode_s = r["timing"]["decode_s"].as_f64().unwrap();
    let verify = phases["verify"]["total_s"].as_f64().unwrap();
    assert!(
        verify > 0.5 * decode_s && verify < decode_s,
        "verify {verify} of decode {decode_s}"
    );
    assert_eq!(phases["verify"]["count"], 23);
    assert_eq!(r["generated_tokens"], 24);
    assert!(
        stderr.contains("verify") && stderr.contains("share"),
        "summary table on stderr: {stderr}"
    );
}

#[test]
fn trace_is_chrome_json_with_phase_tracks_and_nested_layer_spans() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    generate(&["--profile", "fine", "--trace", trace.to_str().unwrap()]);
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let track_names: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    for name in ["step", "prefill", "verify", "sample", "commit", "emit"] {
        assert!(track_names.contains(&name), "no {name} track");
    }
    let slices = |name: &str| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["name"] == name)
            .count()
    };
    assert_eq!(slices("verify"), 23);
    assert_eq!(slices("prefill"), 1);
    assert_eq!(slices("decode step"), 23);
    // Every per-layer span sits inside a verify or prefill slice on the same track.
    let layer_spans: Vec<&serde_json::Value> =
        events.iter().filter(|e| e["cat"] == "layer").collect();
    assert_eq!(
        layer_spans.len(),
        24 * (30 * 2 + 1),
        "30 layers x (attention, mlp) + lm_head per forward"
    );
    let parents: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["ph"] == "X" && (e["name"] == "verify" || e["name"] == "prefill"))
        .collect();
    for span in &layer_spans {
        let (ts, dur) = (span["ts"].as_f64().unwrap(), span["dur"].as_f64().unwrap());
        assert!(
            parents.iter().any(|p| p["tid"] == span["tid"]
                && p["ts"].as_f64().unwrap() <= ts
                && ts + dur <= p["ts"].as_f64().unwrap() + p["dur"].as_f64().unwrap() + 1e-3),
            "span {span} is not nested in a forward phase"
        );
    }
}

#[test]
fn profiling_off_gives_the_same_tokens() {
    let (on, _) = generate(&[]);
    let (off, _) = generate(&["--profile", "off"]);
    assert_eq!(on["token_ids"], off["token_ids"]);
    assert_eq!(off["phases"]["other"]["count"], 0);
}

#[test]
fn ngram_speculation_on_smollm2_is_lossless_and_reported() {
    // Repetitive code, so prompt lookup finds matches; confidence 0 drafts at every match, so many drafts are
    // cut short by the target.
    let prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n\
                  def mul(a, b):\n    return a * b\n\ndef div(a, b):\n";
    let (plain, _) = generate_with(prompt, "64", &[]);
    let (spec, stderr) = generate_with(
        prompt,
        "64",
        &[
            "--draft",
            "ngram",
            "--draft-tokens",
            "4",
            "--ngram-confidence",
            "0",
        ],
    );
    assert_eq!(plain["token_ids"], spec["token_ids"]);
    assert!(plain["config"]["draft"].is_null());
    let d = &spec["config"]["draft"];
    assert_eq!(d["method"], "ngram");
    assert_eq!(d["draft_tokens"], 4);
    assert_eq!(d["ngram_min"], 1);
    assert_eq!(d["ngram_max"], 4);
    assert_eq!(d["ngram_confidence"], 0.0);
    let s = &spec["speculation"];
    assert_eq!(s["method"], "ngram");
    assert_eq!(s["draft_tokens"], 4);
    let (drafted, accepted, cycles) = (
        s["drafted"].as_u64().unwrap(),
        s["accepted"].as_u64().unwrap(),
        s["cycles"].as_u64().unwrap(),
    );
    assert!(accepted <= drafted && cycles > 0);
    // Speculation really happened and was really checked: tokens were drafted, and some cycles kept only part
    // of their draft (otherwise this would compare plain decoding with itself, or never roll back). Checked to
    // fail: with the earlier prompt ("The capital of France is", 24 tokens) prompt lookup never drafted at all.
    assert!(drafted > 0, "prompt lookup drafted nothing: {s}");
    assert!(
        s["partially_accepted"].as_u64().unwrap() > 0,
        "no cycle accepted part of a draft: {s}"
    );
    let hist: u64 = s["accept_len_histogram"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(hist, cycles);
    assert!(
        (s["mean_accept_len"].as_f64().unwrap() - (1.0 + accepted as f64 / cycles as f64)).abs()
            < 1e-9
    );
    // One draft span a cycle, except a last cycle with one token left to generate: it has no room to draft and
    // opens no draft span.
    let draft_spans = spec["phases"]["draft"]["count"].as_u64().unwrap();
    assert!(
        draft_spans == cycles || draft_spans + 1 == cycles,
        "{draft_spans} draft spans, {cycles} cycles"
    );
    assert_eq!(spec["phases"]["accept"]["count"].as_u64().unwrap(), cycles);
    assert!(stderr.contains("speculation (ngram, k=4)"), "{stderr}");
}

#[test]
fn draft_with_another_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.gguf");
    specula::testing::write_tiny_gguf(&tiny, &Default::default()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args([
            "generate",
            "-m",
            "smollm2-135m",
            "-p",
            "hi",
            "--draft-model",
            tiny.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && !stderr.contains("panicked"),
        "{stderr}"
    );
    assert!(
        stderr.contains("49152 tokens") && stderr.contains("260"),
        "{stderr}"
    );
}

/// `--json-object` and `--json-schema` on a real model: the answer is one JSON object (of the schema's shape; cut
/// by -n, a prefix of one), and prompt lookup keeps it token for token. A schema the grammar cannot enforce is an
/// error naming the keyword. `--regex` and `--choice` the same way.
#[test]
fn json_modes_answer_json_and_speculation_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let schema_path = dir.path().join("cat.json");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "toys": {"type": "array", "items": {"type": "string"}, "maxItems": 2}
        },
        "required": ["name", "age"]
    });
    std::fs::write(&schema_path, schema.to_string()).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "-m",
            "smollm2-135m",
            "-p",
            "Give the name and age of a cat called Tom, aged 3, as JSON.",
            "-n",
            "64",
            "--temperature",
            "0",
            "-t",
            "2",
        ];
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_specula"))
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let schema_arg = schema_path.to_str().unwrap();
    for (mode, grammar) in [
        (
            vec!["--json-object"],
            specula::json_mode::JsonGrammar::any_object(),
        ),
        (
            vec!["--json-schema", schema_arg],
            specula::json_mode::JsonGrammar::from_schema(&schema).unwrap(),
        ),
    ] {
        let (ok, plain, stderr) = run(&mode);
        assert!(ok, "{stderr}");
        let text = plain.trim_end_matches('\n');
        let state = grammar.after(specula::json_mode::JsonState::default(), text.as_bytes());
        assert!(state.is_some(), "{mode:?}: not in the language: {text:?}");
        if state.unwrap().is_done() {
            let v: serde_json::Value = serde_json::from_str(text).unwrap();
            assert!(v.is_object(), "{v}");
        }
        assert!(text.trim_start().starts_with('{'), "{text:?}");
        let mut drafted = mode.clone();
        drafted.extend(["--draft", "ngram"]);
        assert_eq!(run(&drafted).1, plain, "{mode:?}");
    }
    std::fs::write(
        &schema_path,
        r#"{"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}"#,
    )
    .unwrap();
    let (ok, _, stderr) = run(&["--json-schema", schema_arg]);
    assert!(
        !ok && stderr.contains("\"dependentRequired\"") && stderr.contains("cat.json"),
        "{stderr}"
    );
    // `--regex` and `--choice`: the answer matches whole (or, cut by -n, begins a match), prompt lookup keeps it.
    let choices = ["Tom is a cat", "Tom is a dog", "no idea"];
    for (mode, grammar) in [
        (
            vec!["--regex", "Tom(, aged [0-9]+)?( is a (cat|dog))?"],
            specula::json_mode::JsonGrammar::from_regex("Tom(, aged [0-9]+)?( is a (cat|dog))?")
                .unwrap(),
        ),
        (
            choices.iter().flat_map(|c| ["--choice", c]).collect(),
            specula::json_mode::JsonGrammar::from_choices(&choices.map(String::from)).unwrap(),
        ),
    ] {
        let (ok, plain, stderr) = run(&mode);
        assert!(ok, "{stderr}");
        let text = plain.trim_end_matches('\n');
        let state = grammar.after(specula::json_mode::JsonState::default(), text.as_bytes());
        assert!(
            state.is_some_and(|s| grammar.may_end(s)),
            "{mode:?}: {text:?} is not a whole match"
        );
        let mut drafted = mode.clone();
        drafted.extend(["--draft", "ngram"]);
        assert_eq!(run(&drafted).1, plain, "{mode:?}");
    }
    let (ok, _, stderr) = run(&["--regex", "(?<=a)b"]);
    assert!(!ok && stderr.contains("look-around"), "{stderr}");
}

/// `--stop TEXT`: the printed answer and the report's text end right before the first stop sequence, with and
/// without speculation (a draft may run past it; the text still ends there), and the reason says so.
#[test]
fn a_stop_sequence_ends_the_answer_before_it() {
    let prompt = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fact(n):";
    let (full, _) = generate_with(prompt, "48", &[]);
    let text = full["text"].as_str().unwrap().to_string();
    // A stop taken from the middle of the plain answer (past its first 8 characters, so something comes first).
    let start = text
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i >= 8 && text.is_char_boundary(i + 3))
        .expect("a long enough answer");
    let stop = &text[start..start + 3];
    let expected = &text[..text.find(stop).unwrap()];
    for drafter in [
        &[][..],
        &["--draft", "ngram", "--ngram-confidence", "0"][..],
    ] {
        let mut extra = vec!["--stop", "no such text anywhere", "--stop", stop];
        extra.extend_from_slice(drafter);
        let (r, printed, stderr) = generate_printing(prompt, "48", &extra);
        // The answer, then the newline generate ends its output with.
        assert_eq!(
            printed,
            format!("{expected}\n"),
            "stop {stop:?} {drafter:?}"
        );
        assert_eq!(r["text"], expected, "{drafter:?}");
        assert_eq!(r["stop_reason"], "stop_sequence", "{drafter:?}");
        assert!(stderr.contains("(StopSequence)"), "{drafter:?}: {stderr}");
    }
}

/// `--prompt-file -` reads the prompt from standard input: the same answer as the prompt given with `-p`.
#[test]
fn a_prompt_from_standard_input_is_the_same_prompt() {
    let prompt = "The capital of France is";
    let (given, _) = generate_with(prompt, "8", &[]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args([
            "generate",
            "-m",
            "smollm2-135m",
            "--raw",
            "--prompt-file",
            "-",
            "-n",
            "8",
            "--ignore-eos",
            "-t",
            "2",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(prompt.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{}\n", given["text"].as_str().unwrap())
    );
}

/// `--chat-template FILE` replaces the model's template: the prompt is the file's rendering of the conversation
/// (the same token ids as that text given raw); a template that does not render is refused before the model
/// loads, naming the file.
#[test]
fn a_chat_template_file_replaces_the_models_own() {
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("t.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}[assistant] {% endif %}",
    )
    .unwrap();
    let prompt_ids = |args: &[&str]| {
        let report = dir.path().join("r.json");
        let out = Command::new(env!("CARGO_BIN_EXE_specula"))
            .args([
                "generate",
                "-m",
                "smollm2-135m",
                "-n",
                "1",
                "-t",
                "2",
                "--quiet",
            ])
            .args(args)
            .arg("--report-json")
            .arg(&report)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        r["prompt_token_ids"].clone()
    };
    let t = template.to_str().unwrap();
    let templated = prompt_ids(&["--chat-template", t, "--system", "Be brief.", "-p", "hi"]);
    let raw = prompt_ids(&["--raw", "-p", "[system] Be brief.\n[user] hi\n[assistant] "]);
    assert_eq!(templated, raw);
    assert_ne!(
        templated,
        prompt_ids(&["--system", "Be brief.", "-p", "hi"])
    );
    std::fs::write(&template, "{% for m in messages %}{{ m.content }").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args([
            "generate",
            "-m",
            "/nonexistent.gguf",
            "-p",
            "hi",
            "--chat-template",
            t,
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("the chat template in")
            && stderr.contains("t.jinja"),
        "{stderr}"
    );
}
