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

    let mut child = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(["serve", "-m", m, "--port", "0", "--draft", "ngram"])
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
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args([
            "bench-serve",
            "--url",
            &format!("http://{addr}"),
            "--prompts",
            prompts.to_str().unwrap(),
            "--concurrency",
            "1,2",
            "-n",
            "6",
            "--json",
            json.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    child.kill().unwrap();
    let _ = child.wait();
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
    assert_eq!(v["model"], m);
}
