//! `specula serve` as a process: it binds where told, answers the OpenAI API, and refuses bad flags by name.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use specula::testing::{write_tiny_gguf, TinySpec};

#[test]
fn serve_answers_over_http_and_checks_its_flags() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    write_tiny_gguf(&model, &TinySpec::default()).unwrap();
    let m = model.to_str().unwrap();

    let out = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(["serve", "-m", m, "--max-queue", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--max-queue must be between 1 and 100000"),
        "{stderr}"
    );

    let (mut child, addr) = spawn_server(m, &["--draft", "ngram"]);
    assert!(
        addr.starts_with("127.0.0.1:"),
        "binds to 127.0.0.1 by default: {addr}"
    );
    let mut s = TcpStream::connect(&addr).unwrap();
    let body = r#"{"prompt": "hello", "max_tokens": 5, "temperature": 0}"#;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(
        resp.contains("\"text_completion\"") && resp.contains("\"speculation\""),
        "{resp}"
    );

    // bench-serve against it: every request of every level completes, with latencies and throughput.
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\": \"a\", \"prompt\": \"hello\"}\n{\"id\": \"b\", \"prompt\": \"the tea\"}\n{\"id\": \"c\", \"prompt\": \"one two\"}\n",
    )
    .unwrap();
    let bench_serve = |json: &std::path::Path, load: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_specula"))
            .args([
                "bench-serve",
                "--url",
                &format!("http://{addr}"),
                "--prompts",
            ])
            .arg(&prompts)
            .args(load)
            .arg("--json")
            .arg(json)
            .output()
            .unwrap()
    };
    let json = dir.path().join("bench.json");
    let out = bench_serve(&json, &["--concurrency", "1,2", "-n", "6"]);
    // Arrivals at a rate (open loop), capped in flight, and all at once.
    let rate_json = dir.path().join("rate.json");
    let rate_out = bench_serve(
        &rate_json,
        &[
            "--request-rate",
            "20,inf",
            "--max-concurrency",
            "2",
            "--requests",
            "5",
            "-n",
            "4",
        ],
    );
    child.kill().unwrap();
    let _ = child.wait();
    assert!(
        rate_out.status.success(),
        "{}",
        String::from_utf8_lossy(&rate_out.stderr)
    );
    let rate_stdout = String::from_utf8_lossy(&rate_out.stdout);
    assert!(
        rate_stdout.contains("rate")
            && rate_stdout.contains("20/s")
            && rate_stdout.contains("inf/s"),
        "{rate_stdout}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rate_json).unwrap()).unwrap();
    let rate_levels = r["levels"].as_array().unwrap();
    assert_eq!(rate_levels.len(), 2);
    assert_eq!(rate_levels[0]["request_rate"], 20.0);
    assert_eq!(rate_levels[1]["request_rate"], "inf");
    for l in rate_levels {
        assert_eq!(
            (l["completed"].as_u64(), l["errors"].as_u64()),
            (Some(5), Some(0)),
            "{l}"
        );
        assert_eq!(l["max_concurrency"], 2, "{l}");
    }
    // Bad load flags are refused by name, before any request.
    for (flags, says) in [
        (&["--request-rate", "0"][..], "request rate"),
        (
            &["--request-rate", "2", "--concurrency", "4"][..],
            "--concurrency",
        ),
        (
            &["--request-rate", "2", "--burstiness", "0"][..],
            "--burstiness",
        ),
        (
            &["--request-rate", "2", "--max-concurrency", "0"][..],
            "--max-concurrency",
        ),
        (&["--max-concurrency", "2"][..], "--request-rate"),
        // A schedule no level could wait for (its gaps overflow a duration).
        (&["--request-rate", "1e-300"][..], "ask for a higher rate"),
    ] {
        let bad = Command::new(env!("CARGO_BIN_EXE_specula"))
            .args(["bench-serve", "--url", "http://127.0.0.1:9", "--prompts"])
            .arg(&prompts)
            .args(flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert!(
            !bad.status.success() && stderr.contains(says),
            "{flags:?}: {stderr}"
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ttft p50"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let levels = v["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for l in levels {
        assert_eq!(l["completed"], 3, "{l}");
        assert_eq!(l["errors"], 0, "{l}");
        assert!(l["output_tokens"].as_u64().unwrap() >= 3, "{l}");
        assert!(l["ttft_s"]["p50"].as_f64().unwrap() > 0.0, "{l}");
        assert!(
            l["e2e_s"]["p50"].as_f64().unwrap() >= l["ttft_s"]["p50"].as_f64().unwrap(),
            "{l}"
        );
    }
    // One client, three requests: it is busy from the first send to the third, so there is a steady window.
    let steady = levels[0]["steady_output_tok_s"].as_f64();
    assert!(steady.is_some_and(|v| v > 0.0), "{}", levels[0]);
    assert!(stdout.contains("steady tok/s"), "{stdout}");
    assert_eq!(v["model"], m);
    // The second level sends the prompts the first did: their chat template's start, at least, comes from the
    // server's prefix cache, and bench-serve reports it.
    let cached = |l: &serde_json::Value| l["cached_prompt_tokens"].as_u64().unwrap();
    assert!(cached(&levels[1]) > 0, "{}", levels[1]);
    assert!(cached(&levels[1]) < levels[1]["prompt_tokens"].as_u64().unwrap());
    assert!(stdout.contains("cached"), "{stdout}");
}

/// `--draft-confidence` reaches a draft model's drafter (the server once drafted with the default bar whatever
/// was asked): at 0 every cycle drafts its tokens; at 1 (the draft's own chance of being accepted whole must be
/// certain) a tiny random model drafts nothing.
#[test]
fn serve_gives_a_draft_model_its_confidence_bar() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    write_tiny_gguf(&model, &TinySpec::default()).unwrap();
    let m = model.to_str().unwrap();
    let body = r#"{"prompt": "the tea the tea", "max_tokens": 12, "temperature": 0}"#;
    let mut drafted = Vec::new();
    for bar in ["0", "1"] {
        let flags = [
            "--draft-model",
            m,
            "--draft-confidence",
            bar,
            "--draft-policy",
            "fixed",
            "--draft-tokens",
            "3",
        ];
        let (mut child, addr) = spawn_server(m, &flags);
        let (status, resp) = send(&addr, "POST", "/v1/completions", body, false);
        child.kill().unwrap();
        let _ = child.wait();
        assert_eq!(status, 200, "{resp}");
        let json = &resp[resp.find('{').unwrap()..];
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        drafted.push(v["usage"]["speculation"]["drafted"].as_u64().unwrap());
    }
    assert!(drafted[0] > 0, "bar 0 drafted nothing: {drafted:?}");
    assert_eq!(drafted[1], 0, "bar 1 drafted: {drafted:?}");
}

/// Starts `specula serve` on a free port with `flags`; returns the child and its address.
fn spawn_server(model: &str, flags: &[&str]) -> (std::process::Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(["serve", "-m", model, "--port", "0"])
        .args(flags)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("serve printed its address").unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

/// Sends one request; returns its status and the raw response (headers and body). With `leave_early`, reads only
/// until the first streamed event and then drops the connection.
fn send(addr: &str, method: &str, path: &str, body: &str, leave_early: bool) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    if leave_early {
        let mut buf = [0u8; 2048];
        loop {
            let n = s.read(&mut buf).unwrap_or(0);
            raw.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&raw);
            if n == 0
                || text.contains("data: ")
                || (text.contains("\r\n\r\n") && !text.contains(" 200 "))
            {
                break;
            }
        }
    } else {
        s.read_to_end(&mut raw).unwrap();
    }
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    (status, text)
}

fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            (key == name).then(|| value.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// A soak test from a second process: many clients at once, mixing good requests (streamed or not, chat, sampled
/// with stop sequences) with malformed ones, impossible sizes and clients that leave mid-stream, against a
/// server with a small batch and queue. Every answer is a well-formed success or a 4xx naming the problem; the
/// server answers the same request identically before and after; nothing stays running, queued or reserved; and
/// its request counters equal what the clients saw, status by status.
#[test]
fn serve_survives_a_mixed_load_from_many_clients() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    write_tiny_gguf(
        &model,
        &TinySpec {
            untied_head: true,
            ..Default::default()
        },
    )
    .unwrap();
    let (mut child, addr) = spawn_server(
        model.to_str().unwrap(),
        &[
            "--draft",
            "ngram",
            "--max-batch",
            "4",
            "--max-queue",
            "4",
            "-t",
            "1",
        ],
    );
    let probe = r#"{"prompt": "the same question", "max_tokens": 12, "temperature": 0}"#;
    let (status, before) = send(&addr, "POST", "/v1/completions", probe, false);
    assert_eq!(status, 200, "{before}");
    let answer = |raw: &str| -> String {
        let body = raw.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };

    let seen: Vec<(usize, u16)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..12)
            .map(|t| {
                let addr = addr.clone();
                s.spawn(move || {
                    let mut seen = Vec::new();
                    for i in 0..15 {
                        let kind = (t + i) % 8;
                        let (path, body, leave) = match kind {
                            0 => ("/v1/completions", format!(r#"{{"prompt": "hello {t} {i}", "max_tokens": 8, "temperature": 0}}"#), false),
                            1 => ("/v1/chat/completions", format!(r#"{{"messages": [{{"role": "user", "content": "hi {i}"}}], "max_tokens": 8, "stream": true}}"#), false),
                            2 => ("/v1/completions", r#"{"prompt": "#.to_string(), false),
                            3 => ("/v1/completions", r#"{"prompt": "x", "max_tokens": "ten"}"#.to_string(), false),
                            4 => ("/v1/completions", r#"{"prompt": "leaving", "max_tokens": 200, "ignore_eos": true, "stream": true}"#.to_string(), true),
                            5 => ("/v1/completions", r#"{"prompt": "x", "max_tokens": 99999999999}"#.to_string(), false),
                            6 => ("/v1/completions", format!(r#"{{"prompt": "sampled {t}", "max_tokens": 10, "temperature": 0.9, "top_p": 0.8, "seed": {i}, "stop": ["e"]}}"#), false),
                            _ => ("/v1/completions", r#"{"prompt": "", "max_tokens": 4}"#.to_string(), false),
                        };
                        let (status, raw) = send(&addr, "POST", path, &body, leave);
                        let ok = match kind {
                            0 | 1 | 4 | 6 => status == 200 || status == 429,
                            _ => status == 400,
                        };
                        assert!(ok, "kind {kind}: status {status}: {raw}");
                        if status == 200 && kind == 1 {
                            assert!(raw.contains("data: [DONE]"), "{raw}");
                        }
                        if status == 200 && (kind == 0 || kind == 6) {
                            assert!(raw.contains("\"finish_reason\""), "{raw}");
                        }
                        if status >= 400 {
                            assert!(raw.contains("\"error\"") && raw.contains("\"message\""), "{raw}");
                        }
                        seen.push((kind, status));
                    }
                    seen
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });

    eprintln!(
        "statuses: {:?}",
        seen.iter()
            .fold(std::collections::BTreeMap::new(), |mut m, s| {
                *m.entry(*s).or_insert(0) += 1;
                m
            })
    );
    let (status, after) = send(&addr, "POST", "/v1/completions", probe, false);
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        answer(&after),
        answer(&before),
        "the same request answered differently after the load"
    );
    // Clients that left are dropped at the engine's next step; wait for the gauges to settle.
    let start = std::time::Instant::now();
    let metrics = loop {
        let (_, m) = send(&addr, "GET", "/metrics", "", false);
        let idle = [
            "specula:num_requests_running",
            "specula:num_requests_waiting",
            "specula:kv_cache_usage_perc",
        ]
        .iter()
        .all(|g| metric_value(&m, g) == 0.0);
        if idle {
            break m;
        }
        assert!(
            start.elapsed().as_secs() < 30,
            "the server never went idle:\n{m}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let (status, _) = send(&addr, "GET", "/health", "", false);
    child.kill().unwrap();
    let _ = child.wait();
    assert_eq!(status, 200);
    for code in [200u16, 400, 429] {
        // The two probes are 200s too.
        let clients =
            seen.iter().filter(|(_, s)| *s == code).count() + if code == 200 { 2 } else { 0 };
        let counted = metric_value(
            &metrics,
            &format!("specula:request_total{{status=\"{code}\"}}"),
        );
        assert_eq!(counted, clients as f64, "status {code}");
    }
    let aborted = metric_value(
        &metrics,
        "specula:request_success_total{finished_reason=\"abort\"}",
    );
    let left = seen.iter().filter(|&&(k, s)| k == 4 && s == 200).count() as f64;
    assert!(
        aborted <= left,
        "{aborted} aborts counted, {left} clients left"
    );
}

/// Tools on a real model whose chat template renders them (qwen2.5-coder-0.5b, greedy): the weather question is
/// answered with a call of the given function, arguments as a JSON string, finish reason `tool_calls`; streamed,
/// the same call arrives as one delta. A conversation holding the call and its result renders and answers.
#[test]
fn serve_answers_with_tool_calls_on_a_qwen_model() {
    let (mut child, addr) = spawn_server("qwen2.5-coder-0.5b", &[]);
    let tools = serde_json::json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let ask = |extra: serde_json::Value| {
        let mut body = serde_json::json!({
            "temperature": 0, "max_tokens": 48, "tools": tools,
            "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        send(
            &addr,
            "POST",
            "/v1/chat/completions",
            &body.to_string(),
            false,
        )
    };
    let (status, resp) = ask(serde_json::json!({}));
    assert_eq!(status, 200, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp[resp.find('{').unwrap()..]).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather", "{v}");
    let args: serde_json::Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["city"], "Paris", "{v}");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    // Streamed: the call in one delta, then the finish reason.
    let (status, resp) = ask(serde_json::json!({"stream": true}));
    assert_eq!(status, 200, "{resp}");
    let events: Vec<serde_json::Value> = resp
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: Vec<&serde_json::Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(streamed.len(), 1, "{resp}");
    assert_eq!(streamed[0]["function"], call["function"]);
    assert_eq!(streamed[0]["index"], 0);
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    // An answer that calls nothing streams as content, token by token, as it would without tools.
    let haiku = serde_json::json!({"max_tokens": 24,
        "messages": [{"role": "user", "content": "Write a haiku about the sea."}]});
    let (_, resp) = ask(haiku.clone());
    let whole: serde_json::Value = serde_json::from_str(&resp[resp.find('{').unwrap()..]).unwrap();
    let mut streamed_body = haiku;
    streamed_body["stream"] = serde_json::json!(true);
    let (status, resp) = ask(streamed_body);
    assert_eq!(status, 200, "{resp}");
    let deltas: Vec<String> = resp
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            let e: serde_json::Value = serde_json::from_str(d).unwrap();
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .filter(|c| !c.is_empty())
        .collect();
    assert!(
        whole["choices"][0]["message"]["tool_calls"].is_null(),
        "{whole}"
    );
    assert!(deltas.len() > 3, "{resp}");
    assert_eq!(
        deltas.concat(),
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // tool_choice none: the tools are shown but nothing is parsed.
    let (status, resp) = ask(serde_json::json!({"tool_choice": "none"}));
    assert_eq!(status, 200, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp[resp.find('{').unwrap()..]).unwrap();
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    // A forced call (a named function, or any with "required"), even where the question asks for none: the
    // answer is constrained to the call object, arguments to the function's parameters.
    for choice in [
        serde_json::json!({"type": "function", "function": {"name": "get_weather"}}),
        serde_json::json!("required"),
    ] {
        let (status, resp) = ask(serde_json::json!({"tool_choice": choice,
            "messages": [{"role": "user", "content": "Tell me a joke about London."}]}));
        assert_eq!(status, 200, "{resp}");
        let v: serde_json::Value = serde_json::from_str(&resp[resp.find('{').unwrap()..]).unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        let call = &choice["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather", "{v}");
        let args: serde_json::Value =
            serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string(), "{v}");
    }
    // A forced call's parameters are enforced, patterns included; one the grammar cannot enforce is refused by
    // name.
    let (status, resp) = ask(serde_json::json!({
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"}}, "required": ["city"]}}}]}));
    assert_eq!(status, 200, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp[resp.find('{').unwrap()..]).unwrap();
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    let args: serde_json::Value =
        serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    let city = args["city"].as_str().unwrap_or_default();
    assert!(
        city.len() > 1
            && city.starts_with(|c: char| c.is_ascii_uppercase())
            && city[1..].chars().all(|c| c.is_ascii_lowercase()),
        "{resp}"
    );
    let (status, resp) = ask(serde_json::json!({
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {}}, "dependentRequired": {"city": ["country"]}}}}]}));
    assert_eq!(status, 400, "{resp}");
    assert!(
        resp.contains("\\\"dependentRequired\\\"") && resp.contains("tool_choice"),
        "{resp}"
    );
    // The call and its result in the history.
    let (status, resp) = ask(serde_json::json!({"messages": [
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18}"}]}));
    assert_eq!(status, 200, "{resp}");
    child.kill().unwrap();
    let _ = child.wait();
}

/// `--served-model-name` (vLLM's flag): the API's names for the model. Responses carry the first, `/v1/models`
/// lists all, a request may name any of them, and another name (the model's own path included) is a 404 naming
/// them; an empty or repeated name is refused at start.
#[test]
fn serve_answers_to_its_served_model_names() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    write_tiny_gguf(&model, &TinySpec::default()).unwrap();
    let m = model.to_str().unwrap();
    for (flags, expected) in [
        (&["--served-model-name", " "][..], "must not be empty"),
        (
            &["--served-model-name", "a", "--served-model-name", "a"][..],
            "\"a\" is given twice",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_specula"))
            .args(["serve", "-m", m])
            .args(flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(expected),
            "{stderr}"
        );
    }
    let (mut child, addr) = spawn_server(
        m,
        &[
            "--served-model-name",
            "tiny-chat",
            "--served-model-name",
            "gpt-4o-mini",
        ],
    );
    let (status, models) = send(&addr, "GET", "/v1/models", "", false);
    assert_eq!(status, 200, "{models}");
    let list = models.split("\r\n\r\n").nth(1).unwrap();
    let v: serde_json::Value = serde_json::from_str(list).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny-chat", "gpt-4o-mini"]);
    let ask = |name: &str| {
        send(
            &addr,
            "POST",
            "/v1/completions",
            &format!(r#"{{"model": "{name}", "prompt": "hello", "max_tokens": 2}}"#),
            false,
        )
    };
    for name in ["tiny-chat", "gpt-4o-mini"] {
        let (status, resp) = ask(name);
        assert_eq!(status, 200, "{resp}");
        assert!(resp.contains(r#""model":"tiny-chat""#), "{resp}");
    }
    let (status, resp) = ask(m);
    assert_eq!(status, 404, "{resp}");
    assert!(
        resp.contains(r#"this server serves \"tiny-chat\", \"gpt-4o-mini\""#),
        "{resp}"
    );
    child.kill().unwrap();
    let _ = child.wait();
}
