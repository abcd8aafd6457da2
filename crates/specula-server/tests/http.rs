//! The server end to end over raw HTTP/1.1 on a tiny model the test writes: answers equal the library's own
//! generation, streaming equals non-streaming, stop sequences cut, and every bad request gets OpenAI's error shape
//! with the right status.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};
use specula::decode::{generate, GenerateRequest, LogprobsRequest};
use specula::model::{load_gguf, LoadedModel};
use specula::profile::Profiler;
use specula::sampling::SamplingParams;
use specula::testing::{write_tiny_gguf, TinySpec};
use specula_server::engine::{DraftSetup, Engine, EngineOptions, NgramSettings};
use specula_server::{AppState, Limits};

fn tiny(dir: &Path) -> LoadedModel {
    let p = dir.join("tiny.gguf");
    write_tiny_gguf(
        &p,
        &TinySpec {
            untied_head: true,
            ..Default::default()
        },
    )
    .unwrap();
    load_gguf(&p, "tiny").unwrap()
}

/// Engine options for tests: 4 draft tokens, a queue of `max_queue`.
fn queue(max_queue: usize) -> EngineOptions {
    EngineOptions {
        draft_tokens: 4,
        max_queue,
        ..Default::default()
    }
}

/// Starts a server on a free port in a background runtime.
fn start(
    model: LoadedModel,
    draft: DraftSetup,
    api_key: Option<&str>,
    options: EngineOptions,
) -> SocketAddr {
    let metrics = Arc::new(specula_server::metrics::Metrics::new());
    let engine = Engine::start(model, draft, options, metrics.clone());
    let state = Arc::new(AppState {
        engine,
        metrics,
        profile_dir: std::env::temp_dir()
            .join(format!("specula-server-test-{}", std::process::id())),
        api_key: api_key.map(String::from),
        limits: Limits::default(),
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            specula_server::serve(listener, state).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

/// One request; returns (status, headers, body).
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.unwrap_or("");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, head.to_string(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, _, body) = http(addr, "POST", path, Some(&body.to_string()), &[]);
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// The library's own greedy answer.
/// A 400 whose error names `param` and whose message holds `needle`.
fn refused((s, v): (u16, Value), param: &str, needle: &str) {
    assert_eq!(s, 400, "{param}: {v}");
    assert_eq!(v["error"]["param"], param, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
}

fn expected(model: &LoadedModel, text: &str, n: usize) -> String {
    expected_until(model, text, n, true)
}

/// The library's own greedy answer, to `n` tokens whatever comes (`ignore_eos`) unless `stop_at_eos`.
fn expected_until(model: &LoadedModel, text: &str, n: usize, stop_at_eos: bool) -> String {
    let req = GenerateRequest {
        prompt_tokens: model.tokenizer.encode(text).unwrap(),
        max_new_tokens: n,
        sampling: SamplingParams::default(),
        stop_at_eos,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    generate(
        model.model.as_ref(),
        &model.tokenizer,
        &req,
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap()
    .text
}

/// The text of an SSE stream's chunks (choice 0), whether it ended with [DONE], and the chunks.
fn sse_text(body: &str, chat: bool) -> (String, bool, Vec<Value>) {
    let (texts, _, done, chunks) = sse_choices(body, chat);
    (texts.into_iter().next().unwrap_or_default(), done, chunks)
}

/// Each choice's text of an SSE stream (by its index), how many chunks carried a finish reason, whether the
/// stream ended with [DONE], and the chunks.
fn sse_choices(body: &str, chat: bool) -> (Vec<String>, usize, bool, Vec<Value>) {
    let mut texts: Vec<String> = Vec::new();
    let mut finishes = 0;
    let mut done = false;
    let mut chunks = Vec::new();
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        for c in v["choices"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap_or(0) as usize;
            if texts.len() <= i {
                texts.resize(i + 1, String::new());
            }
            let piece = if chat {
                &c["delta"]["content"]
            } else {
                &c["text"]
            };
            texts[i].push_str(piece.as_str().unwrap_or(""));
            finishes += usize::from(c["finish_reason"].is_string());
        }
        chunks.push(v);
    }
    (texts, finishes, done, chunks)
}

#[test]
fn completions_and_chat_answer_what_the_library_generates() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let (status, _, body) = http(addr, "GET", "/health", None, &[]);
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = http(addr, "GET", "/v1/models", None, &[]);
    assert_eq!(status, 200);
    let listed = serde_json::from_str::<Value>(&body).unwrap();
    assert_eq!(listed["data"][0]["id"], "tiny");
    assert_eq!(listed["data"][0]["max_model_len"], 256);

    let want = expected(&reference, "hello world", 20);
    let (status, v) = post(
        addr,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "hello world", "max_tokens": 20, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        v["usage"]["prompt_tokens"],
        reference.tokenizer.encode("hello world").unwrap().len()
    );
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=20).contains(&completion), "{v}");
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        completion + v["usage"]["prompt_tokens"].as_u64().unwrap()
    );

    // Chat: the template applied as the library applies it.
    let messages = [specula::chat::ChatMessage::user("hi there")];
    let chat_want = expected(&reference, &reference.format_chat(&messages).unwrap(), 16);
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], chat_want);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");

    // Streaming gives the same text, chunk by chunk, with usage when asked and [DONE] last.
    let (status, head, body) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "hello world", "max_tokens": 20, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}).to_string()),
        &[],
    );
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase().contains("text/event-stream"),
        "{head}"
    );
    let (text, done, chunks) = sse_text(&body, false);
    assert_eq!(text, want);
    assert!(done, "{body}");
    assert_eq!(
        chunks.last().unwrap()["usage"]["prompt_tokens"],
        v_usage_prompt(&reference, "hello world")
    );
    let (status, _, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 16, "temperature": 0, "stream": true}).to_string()),
        &[],
    );
    assert_eq!(status, 200);
    let (text, done, _) = sse_text(&body, true);
    assert_eq!(text, chat_want);
    assert!(done);

    // A stop sequence cuts the answer before it (streaming or not) and finishes with "stop".
    let chars: Vec<char> = want.chars().collect();
    assert!(
        chars.len() > 6,
        "the tiny model writes enough text: {want:?}"
    );
    let stop: String = chars[3..5].iter().collect();
    let cut = &want[..want.find(&stop).unwrap()];
    let (status, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello world", "max_tokens": 20, "temperature": 0, "stop": [stop]}),
    );
    assert_eq!(status, 200);
    assert_eq!(v["choices"][0]["text"], cut);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (_, _, body) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "hello world", "max_tokens": 20, "temperature": 0, "stop": stop, "stream": true}).to_string()),
        &[],
    );
    assert_eq!(sse_text(&body, false).0, cut);
}

#[test]
fn prompts_as_token_ids_content_parts_and_echo_answer_like_the_plain_forms() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let want = expected(&reference, "hello world", 12);
    let ids = reference.tokenizer.encode("hello world").unwrap();
    // A prompt of token ids, bare or as a one-element batch, answers as its text does.
    for prompt in [json!(ids), json!([ids]), json!(["hello world"])] {
        let (s, v) = post(
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(s, 200, "{prompt}: {v}");
        assert_eq!(v["choices"][0]["text"], want, "{prompt}");
    }
    // Several prompts in one request (OpenAI's batch form), n choices each: choice p * n + i is prompt p's i-th,
    // each the prompt's own answer; usage counts each prompt once. Streamed, the same choices by index.
    let other = "the cat";
    let want_other = expected(&reference, other, 12);
    let batch =
        json!({"prompt": [ids, other], "max_tokens": 12, "temperature": 0, "n": 2, "echo": true});
    let (s, v) = post(addr, "/v1/completions", batch.clone());
    assert_eq!(s, 200, "{v}");
    let texts: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    let first = format!("{}{want}", reference.tokenizer.decode(&ids).unwrap());
    let second = format!("{other}{want_other}");
    assert_eq!(texts, [&first, &first, &second, &second]);
    let indices: Vec<u64> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2, 3]);
    let other_ids = reference.tokenizer.encode(other).unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"],
        (ids.len() + other_ids.len()) as u64,
        "{}",
        v["usage"]
    );
    let mut streamed = batch.clone();
    streamed["stream"] = json!(true);
    let (_, _, body) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&streamed.to_string()),
        &[],
    );
    let (stream_texts, finishes, done, _) = sse_choices(&body, false);
    assert!(done && finishes == 4, "{body}");
    assert_eq!(stream_texts, texts);
    // echo: the prompt's text first, streamed or not.
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello world", "max_tokens": 12, "temperature": 0, "echo": true}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], format!("hello world{want}"));
    let (_, _, body) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": ids, "max_tokens": 12, "temperature": 0, "echo": true, "stream": true}).to_string()),
        &[],
    );
    let (text, done, _) = sse_text(&body, false);
    assert!(done, "{body}");
    assert_eq!(
        text,
        format!("{}{want}", reference.tokenizer.decode(&ids).unwrap())
    );
    // A message's content as text parts is the parts joined; neutral values of unsupported fields pass.
    let messages = [specula::chat::ChatMessage::user("hi there")];
    let chat_want = expected(&reference, &reference.format_chat(&messages).unwrap(), 10);
    let (s, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "},
                                                          {"type": "text", "text": "there"}]}],
               "max_tokens": 10, "temperature": 0, "n": 1, "logprobs": false, "presence_penalty": 0,
               "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "response_format": {"type": "text"},
               "user": "someone"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], chat_want);
}

#[test]
fn n_choices_are_requests_of_their_own_with_consecutive_seeds() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    // Greedy: every choice is the library's answer.
    let want = expected(&reference, "hello world", 12);
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello world", "max_tokens": 12, "temperature": 0, "n": 3}),
    );
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], want);
    }
    // The prompt counts once, the completions add up.
    let prompt_tokens = reference.tokenizer.encode("hello world").unwrap().len() as u64;
    let (_, one) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello world", "max_tokens": 12, "temperature": 0}),
    );
    let completion = one["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_tokens);
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        3 * completion
    );
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        prompt_tokens + 3 * completion
    );
    // Sampled: choice i is what a single request with seed + i answers, streamed or not.
    let single = |seed: u64| {
        let (s, v) = post(
            addr,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 1.0,
                   "seed": seed}),
        );
        assert_eq!(s, 200, "{v}");
        (
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        )
    };
    let singles: Vec<(String, u64)> = (40..43).map(single).collect();
    assert!(
        singles.iter().any(|s| s.0 != singles[0].0),
        "three seeds sampled the same text: {singles:?}"
    );
    let (s, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 1.0,
               "seed": 40, "n": 3}),
    );
    assert_eq!(s, 200, "{v}");
    for (i, (text, _)) in singles.iter().enumerate() {
        assert_eq!(v["choices"][i]["message"]["content"], text.as_str(), "{v}");
    }
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        singles.iter().map(|s| s.1).sum::<u64>()
    );
    let (s, _, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 1.0,
                     "seed": 40, "n": 3, "stream": true, "stream_options": {"include_usage": true}}).to_string()),
        &[],
    );
    assert_eq!(s, 200);
    let (texts, finishes, done, chunks) = sse_choices(&body, true);
    let usage = &chunks.last().unwrap()["usage"];
    assert!(done, "{body}");
    assert_eq!(finishes, 3, "{body}");
    for (i, (text, _)) in singles.iter().enumerate() {
        assert_eq!(&texts[i], text, "choice {i}");
    }
    assert_eq!(
        usage["completion_tokens"].as_u64().unwrap(),
        singles.iter().map(|s| s.1).sum::<u64>()
    );
}

#[test]
fn unseeded_sampled_requests_sample_afresh_and_seeded_ones_repeat() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let answer = |body: Value| {
        let (s, v) = post(addr, "/v1/completions", body);
        assert_eq!(s, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    // The default temperature is 1 (OpenAI's): without a seed, repeated requests differ.
    let unseeded: Vec<String> = (0..4)
        .map(|_| answer(json!({"prompt": "hello", "max_tokens": 24, "ignore_eos": true})))
        .collect();
    assert!(
        unseeded.iter().any(|t| t != &unseeded[0]),
        "four unseeded requests sampled the same text: {unseeded:?}"
    );
    // With a seed they repeat exactly.
    let seeded = json!({"prompt": "hello", "max_tokens": 24, "ignore_eos": true, "seed": 11});
    assert_eq!(answer(seeded.clone()), answer(seeded));
}

#[test]
fn fields_that_would_change_the_answer_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(addr, "/v1/chat/completions", body)
    };
    let completion = |extra: Value| {
        let mut body = json!({"prompt": "hi", "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(addr, "/v1/completions", body)
    };
    refused(chat(json!({"n": 0})), "n", "between 1 and 8");
    refused(chat(json!({"n": 9})), "n", "between 1 and 8");
    refused(
        completion(json!({"best_of": 3})),
        "best_of",
        "must equal n (1)",
    );
    refused(
        completion(json!({"n": 2, "best_of": 3})),
        "best_of",
        "must equal n (2)",
    );
    // Log-probabilities are returned, in each endpoint's own form; out-of-form or out-of-range asks are refused.
    refused(
        chat(json!({"top_logprobs": 5})),
        "top_logprobs",
        "needs logprobs: true",
    );
    refused(
        chat(json!({"logprobs": true, "top_logprobs": 21})),
        "top_logprobs",
        "at most 20",
    );
    refused(
        chat(json!({"logprobs": 2})),
        "logprobs",
        "must be a boolean",
    );
    refused(
        completion(json!({"logprobs": 21})),
        "logprobs",
        "at most 20",
    );
    refused(
        completion(json!({"logprobs": true})),
        "logprobs",
        "not a boolean",
    );
    refused(
        completion(json!({"logprobs": -1})),
        "logprobs",
        "non-negative",
    );
    // Penalties and the bias are honoured; values out of range are refused by name.
    refused(
        chat(json!({"presence_penalty": 2.5})),
        "presence_penalty",
        "between -2 and 2",
    );
    refused(
        completion(json!({"frequency_penalty": "1"})),
        "frequency_penalty",
        "must be a number",
    );
    refused(
        chat(json!({"repetition_penalty": 0})),
        "repetition_penalty",
        "above 0",
    );
    refused(
        chat(json!({"logit_bias": {"5000": 10}})),
        "logit_bias",
        "outside the vocabulary",
    );
    refused(
        chat(json!({"logit_bias": {"five": 10}})),
        "logit_bias",
        "token ids (as strings)",
    );
    refused(
        completion(json!({"logit_bias": {"5": 300}})),
        "logit_bias",
        "between -100 and 100",
    );
    // A schema the grammar cannot enforce, or that is not a schema, is refused by name.
    refused(
        chat(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "color"}}}}}}),
        ),
        "response_format",
        "format \"color\" is not supported",
    );
    refused(
        chat(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}}),
        ),
        "response_format",
        "look-around",
    );
    refused(
        chat(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}}),
        ),
        "response_format",
        "root must be an object",
    );
    refused(
        chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
        "response_format",
        "has no schema",
    );
    refused(
        chat(json!({"response_format": {"type": "json_schema"}})),
        "response_format",
        "needs a json_schema object",
    );
    refused(
        chat(json!({"response_format": {"type": "yaml"}})),
        "response_format",
        "not known",
    );
    refused(
        completion(json!({"response_format": "json"})),
        "response_format",
        "must be an object",
    );
    // JSON mode is taken, on both endpoints, and its answers stay inside one JSON object.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        ("/v1/completions", json!({"prompt": "hi"})),
    ] {
        let mut body = body;
        body["max_tokens"] = json!(16);
        body["temperature"] = json!(0);
        body["response_format"] = json!({"type": "json_object"});
        let (s, v) = post(addr, path, body);
        assert_eq!(s, 200, "{v}");
        let choice = &v["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .or(choice["text"].as_str())
            .unwrap();
        let state = specula::json_mode::JsonGrammar::any_object()
            .after(specula::json_mode::JsonState::default(), text.as_bytes());
        assert!(state.is_some(), "{path}: {text:?} left the JSON language");
        if choice["finish_reason"] == "stop" {
            serde_json::from_str::<Value>(text).expect("a whole JSON object");
        }
    }
    // A JSON schema: keys in its order, values of its types, on both endpoints; the same request twice (the
    // second served from the server's kept constraint) answers the same.
    let schema = json!({
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 12, "pattern": "^[a-z ]*$"},
            "confidence": {"enum": ["low", "high"]},
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
            "when": {"type": "string", "format": "date"}
        },
        "required": ["answer", "confidence"]
    });
    let grammar = specula::json_mode::JsonGrammar::from_schema(&schema).unwrap();
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        ("/v1/completions", json!({"prompt": "hi"})),
    ] {
        let mut body = body;
        body["max_tokens"] = json!(40);
        body["temperature"] = json!(0);
        body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": true}});
        let mut texts = Vec::new();
        for _ in 0..2 {
            let (s, v) = post(addr, path, body.clone());
            assert_eq!(s, 200, "{v}");
            let choice = &v["choices"][0];
            let text = choice["message"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .unwrap()
                .to_string();
            let state = grammar.after(specula::json_mode::JsonState::default(), text.as_bytes());
            assert!(
                state.is_some(),
                "{path}: {text:?} left the schema's language"
            );
            if choice["finish_reason"] == "stop" {
                let v: Value = serde_json::from_str(&text).expect("a whole JSON object");
                assert!(
                    v["answer"].is_string() && v["confidence"].is_string(),
                    "{v}"
                );
            }
            texts.push(text);
        }
        assert_eq!(texts[0], texts[1], "{path}");
    }
    // Tools: this tiny model's template does not render them, so they are refused by name rather than dropped;
    // so are forced calls, malformed tools, tools on completions and the legacy functions field.
    refused(
        chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
        "tools",
        "does not render tools",
    );
    refused(
        chat(
            json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}),
        ),
        "tool_choice",
        "is not known",
    );
    refused(
        chat(
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "g"}}}),
        ),
        "tool_choice",
        "not among the tools (f)",
    );
    refused(
        chat(json!({"tools": [{"type": "function", "function": {}}]})),
        "tools",
        "tools[0] must be",
    );
    refused(
        completion(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
        "tools",
        "/v1/chat/completions",
    );
    refused(
        chat(json!({"functions": [{"name": "f"}]})),
        "functions",
        "give them as tools",
    );
    refused(
        chat(
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}),
        ),
        "messages",
        "not JSON",
    );
    refused(
        completion(json!({"suffix": "end"})),
        "suffix",
        "fill-in-the-middle",
    );
    refused(completion(json!({"echo": "yes"})), "echo", "boolean");
    // Prompts: more choices than one request may hold, ids outside the vocabulary, mixed lists, empty lists.
    refused(
        completion(json!({"prompt": ["a", "b", "c"], "n": 3})),
        "prompt",
        "3 prompts with n = 3 ask for 9 choices; at most 8",
    );
    refused(
        completion(json!({"prompt": [[1, 2], []]})),
        "prompt",
        "prompt 1 is empty",
    );
    refused(
        completion(json!({"prompt": ["a", 5]})),
        "prompt",
        "each prompt must be a string or a list of token ids",
    );
    refused(
        completion(json!({"prompt": [1, 99999]})),
        "prompt",
        "token 99999 is outside",
    );
    refused(
        completion(json!({"prompt": [1, "a"]})),
        "prompt",
        "a string or a list of token ids",
    );
    refused(
        completion(json!({"prompt": [[1, -2]]})),
        "prompt",
        "only token ids",
    );
    refused(
        completion(json!({"prompt": []})),
        "prompt",
        "prompt is empty",
    );
    refused(
        completion(json!({"prompt": 7})),
        "prompt",
        "a string or a list of token ids",
    );
    // Content parts other than text are named.
    let (s, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    );
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"image_url\""),
        "{v}"
    );
    // The engine still serves.
    assert_eq!(chat(json!({})).0, 200);
}

/// `min_p` is a sampler here (at 1 only the most likely token survives, so a sampled answer is the greedy one);
/// other engines' samplers and stop ids are refused unless they hold their neutral value.
#[test]
fn min_p_samples_and_other_engines_samplers_are_refused_unless_neutral() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let ask = |extra: Value| {
        let mut body = json!({"prompt": "hi", "max_tokens": 12, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(addr, "/v1/completions", body)
    };
    let text = |(s, v): (u16, Value)| {
        assert_eq!(s, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let greedy = text(ask(json!({"temperature": 0})));
    let sampled = |min_p: f64, seed: u64| {
        text(ask(
            json!({"temperature": 1.0, "min_p": min_p, "seed": seed}),
        ))
    };
    for seed in 1..4 {
        assert_eq!(sampled(1.0, seed), greedy, "seed {seed}");
    }
    // Without the cut the same seeds sample something else at least once.
    assert!((1..4).any(|seed| sampled(0.0, seed) != greedy));
    refused(ask(json!({"min_p": 1.5})), "min_p", "[0, 1]");
    refused(
        ask(json!({"typical_p": 0.5})),
        "typical_p",
        "not implemented",
    );
    refused(ask(json!({"mirostat": 2})), "mirostat", "not implemented");
    refused(
        ask(json!({"use_beam_search": true})),
        "use_beam_search",
        "beam search",
    );
    refused(
        ask(json!({"stop_token_ids": [1_000_000]})),
        "stop_token_ids",
        "below the vocabulary size",
    );
    refused(
        ask(json!({"stop_token_ids": "5"})),
        "stop_token_ids",
        "list of token ids",
    );
    refused(
        ask(json!({"min_tokens": 3, "guided_regex": "a+"})),
        "min_tokens",
        "cannot be combined with an output constraint",
    );
    // stop_token_ids: the greedy answer ends at the first of them it generates, which it keeps.
    let (s, t) = post(addr, "/tokenize", json!({"prompt": greedy.clone()}));
    assert_eq!(s, 200, "{t}");
    let ids: Vec<u64> = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let (s, v) = ask(json!({"temperature": 0, "stop_token_ids": [ids[1]]}));
    assert_eq!(s, 200, "{v}");
    let cut = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(
        greedy.starts_with(cut) && cut.len() < greedy.len(),
        "{cut:?} of {greedy:?}"
    );
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 2,
        "{v}"
    );
    // min_tokens holds that stop id back until the answer has 6 tokens: the answer runs past it.
    let (s, v) = ask(json!({"temperature": 0, "stop_token_ids": [ids[1]], "min_tokens": 6}));
    assert_eq!(s, 200, "{v}");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() >= 6,
        "{v}"
    );
    // Neutral values pass.
    for neutral in [
        json!({"typical_p": 1.0}),
        json!({"mirostat": 0}),
        json!({"min_tokens": 0}),
        json!({"min_tokens": 4}),
        json!({"use_beam_search": false}),
        json!({"stop_token_ids": []}),
        json!({"min_p": 0.0}),
    ] {
        let (s, v) = ask(neutral.clone());
        assert_eq!(s, 200, "{neutral}: {v}");
    }
}

/// Regexes and choices constrain the output under every name clients send them by (vLLM's `guided_regex`,
/// `guided_choice`, `guided_json` and `structured_outputs`; SGLang's `regex`; llama.cpp's `json_schema`), on both
/// endpoints: a finished answer matches whole, a cut one is a prefix of a match. Grammars, two constraints at
/// once and malformed values are refused by name.
#[test]
fn regexes_and_choices_constrain_the_output_under_every_name() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let ask = |path: &str, extra: Value| {
        let mut body = if path == "/v1/completions" {
            json!({"prompt": "hi"})
        } else {
            json!({"messages": [{"role": "user", "content": "hi"}]})
        };
        body["max_tokens"] = json!(12);
        body["temperature"] = json!(0);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(addr, path, body)
    };
    let answer = |v: &Value| -> (String, String) {
        let choice = &v["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .or(choice["text"].as_str())
            .unwrap()
            .to_string();
        (text, choice["finish_reason"].as_str().unwrap().to_string())
    };
    use specula::json_mode::{JsonGrammar, JsonState};
    let regex = "[a-c]{2,4}( [0-9]+)?";
    let choices = ["alpha", "beta gamma", "a.b"];
    let choice_list: Vec<String> = choices.iter().map(|c| c.to_string()).collect();
    let regex_grammar = JsonGrammar::from_regex(regex).unwrap();
    let choice_grammar = JsonGrammar::from_choices(&choice_list).unwrap();
    let schema =
        json!({"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]});
    let schema_grammar = JsonGrammar::from_schema(&schema).unwrap();
    for path in ["/v1/chat/completions", "/v1/completions"] {
        for (extra, grammar) in [
            (json!({"guided_regex": regex}), &regex_grammar),
            (json!({"regex": regex}), &regex_grammar),
            (
                json!({"structured_outputs": {"regex": regex}}),
                &regex_grammar,
            ),
            (json!({"guided_choice": choices}), &choice_grammar),
            (
                json!({"structured_outputs": {"choice": choices}}),
                &choice_grammar,
            ),
            (json!({"guided_json": schema.to_string()}), &schema_grammar),
            (json!({"json_schema": schema}), &schema_grammar),
            (
                json!({"structured_outputs": {"json": schema}}),
                &schema_grammar,
            ),
        ] {
            let (s, v) = ask(path, extra.clone());
            assert_eq!(s, 200, "{path} {extra}: {v}");
            let (text, finish) = answer(&v);
            let state = grammar.after(JsonState::default(), text.as_bytes());
            assert!(
                state.is_some(),
                "{path} {extra}: {text:?} left the constraint"
            );
            if finish == "stop" {
                assert!(
                    grammar.may_end(state.unwrap()),
                    "{path} {extra}: {text:?} is not whole"
                );
            }
        }
        // A choice that fits in max_tokens is written whole.
        let (_, v) = ask(path, json!({"guided_choice": choices, "max_tokens": 40}));
        let (text, finish) = answer(&v);
        assert_eq!(finish, "stop", "{v}");
        assert!(
            choices.contains(&text.as_str()),
            "{text:?} is not one of {choices:?}"
        );
    }
    let chat = |extra: Value| ask("/v1/chat/completions", extra);
    refused(
        chat(json!({"guided_grammar": "root ::= \"a\""})),
        "guided_grammar",
        "grammars are not enforced",
    );
    refused(
        chat(json!({"ebnf": "root ::= \"a\""})),
        "ebnf",
        "grammars are not enforced",
    );
    refused(
        chat(json!({"grammar": "root ::= \"a\""})),
        "grammar",
        "grammars are not enforced",
    );
    refused(
        chat(json!({"structured_outputs": {"grammar": "root ::= \"a\""}})),
        "structured_outputs",
        "structured_outputs.grammar is not supported",
    );
    refused(
        chat(json!({"structured_outputs": {"regexp": "a"}})),
        "structured_outputs",
        "structured_outputs.regexp is not known",
    );
    refused(
        chat(json!({"response_format": {"type": "json_object"}, "guided_regex": "a+"})),
        "guided_regex",
        "response_format and guided_regex both constrain the output",
    );
    refused(
        chat(json!({"guided_regex": "(?=a)b"})),
        "guided_regex",
        "look-around",
    );
    refused(chat(json!({"regex": 5})), "regex", "must be a string");
    refused(chat(json!({"guided_choice": []})), "guided_choice", "empty");
    refused(
        chat(json!({"guided_choice": "yes"})),
        "guided_choice",
        "list of strings",
    );
    refused(
        chat(json!({"guided_choice": ["a", 1]})),
        "guided_choice",
        "list of strings",
    );
    refused(
        chat(json!({"guided_json": "{not json"})),
        "guided_json",
        "not JSON",
    );
    refused(
        chat(json!({"json_schema": [1]})),
        "json_schema",
        "must be a JSON Schema object",
    );
    refused(
        chat(json!({"guided_regex": "a".repeat(20_000)})),
        "guided_regex",
        "at most 16384",
    );
}

fn v_usage_prompt(model: &LoadedModel, text: &str) -> Value {
    json!(model.tokenizer.encode(text).unwrap().len())
}

#[test]
fn bad_requests_get_openai_errors_with_the_right_status() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let check = |status: u16, body: &str, want_status: u16, needle: &str| {
        assert_eq!(status, want_status, "{body}");
        let v: Value = serde_json::from_str(body).unwrap();
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{needle:?} not in {body}");
        assert!(v["error"]["type"].is_string());
    };
    let (s, _, b) = http(addr, "POST", "/v1/completions", Some("{not json"), &[]);
    check(s, &b, 400, "not valid JSON");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": ""}"#),
        &[],
    );
    check(s, &b, 400, "prompt is empty");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(r#"{"max_tokens": 4}"#),
        &[],
    );
    check(s, &b, 400, "prompt is required");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "hi", "model": "gpt-4"}"#),
        &[],
    );
    check(s, &b, 404, "\"gpt-4\" does not exist");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "hi", "max_tokens": 99999999999}"#),
        &[],
    );
    check(s, &b, 400, "max_tokens is 99999999999");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "hi", "max_tokens": "ten"}"#),
        &[],
    );
    check(s, &b, 400, "max_tokens must be an integer");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "hi", "temperature": -1}"#),
        &[],
    );
    check(s, &b, 400, "temperature");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(r#"{"messages": []}"#),
        &[],
    );
    check(s, &b, 400, "messages is empty");
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(r#"{"messages": [{"role": "user"}]}"#),
        &[],
    );
    check(s, &b, 400, "string content");
    // A role no template knows is refused by name; `developer` is rendered as `system`.
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#),
        &[],
    );
    check(
        s,
        &b,
        400,
        "messages[0].role must be one of system, developer",
    );
    let as_role = |role: &str| {
        let msgs =
            json!([{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]);
        let (s, v) = post(addr, "/tokenize", json!({ "messages": msgs }));
        assert_eq!(s, 200, "{v}");
        v["tokens"].clone()
    };
    assert_eq!(as_role("developer"), as_role("system"));
    assert_ne!(as_role("user"), as_role("system"));
    // A prompt longer than the context names both numbers.
    let long = "a ".repeat(300);
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": long, "max_tokens": 10}).to_string()),
        &[],
    );
    check(s, &b, 400, "exceeds the model's context of 256 tokens");
    // /tokenize and /detokenize round-trip; bad ids are named.
    let (s, v) = post(addr, "/tokenize", json!({"prompt": "hello world"}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["count"].as_u64().unwrap() as usize,
        v["tokens"].as_array().unwrap().len()
    );
    assert_eq!(v["max_model_len"], 256);
    let (s, d) = post(addr, "/detokenize", json!({"tokens": v["tokens"]}));
    assert_eq!(s, 200);
    assert_eq!(d["prompt"], "hello world");
    // Chat messages are tokenized as a chat request formats them (template, generation prompt).
    let reference = tiny(dir.path());
    let messages = [specula::chat::ChatMessage::user("hello world")];
    let want = reference
        .tokenizer
        .encode(&reference.format_chat(&messages).unwrap())
        .unwrap();
    let (s, v) = post(
        addr,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "hello world"}]}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["tokens"], json!(want));
    assert!(
        want.len() > 2,
        "the template adds tokens around the message"
    );
    let (s, v) = post(addr, "/tokenize", json!({"messages": []}));
    assert_eq!(s, 400, "{v}");
    let (s, v) = post(addr, "/tokenize", json!({}));
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("messages"),
        "{v}"
    );
    let (s, _, b) = http(
        addr,
        "POST",
        "/detokenize",
        Some(r#"{"tokens": [99999]}"#),
        &[],
    );
    check(s, &b, 400, "token 99999 is outside the vocabulary");
    let (s, _, b) = http(
        addr,
        "POST",
        "/detokenize",
        Some(r#"{"tokens": ["a"]}"#),
        &[],
    );
    check(s, &b, 400, "list of token ids");
    // The engine still serves after all of that.
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 3}),
    );
    assert_eq!(s, 200, "{v}");
}

/// A model whose chat template asks for Llama 3.1's JSON tool calls: the tools reach the prompt, and a forced
/// call is constrained to `{"name": ..., "parameters": <the function's schema>}` and comes back as `tool_calls`.
#[test]
fn a_llama_json_template_gets_its_tools_and_forced_calls_in_its_form() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny-1k.gguf");
    let spec = TinySpec {
        untied_head: true,
        context: 1024,
        ..Default::default()
    };
    write_tiny_gguf(&p, &spec).unwrap();
    let mut model = load_gguf(&p, "tiny").unwrap();
    model.chat_template = Some(specula::chat::ChatTemplate::new(
        "{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond \
         with a JSON for a function call with its proper arguments.\nRespond in the format {\"name\": function \
         name, \"parameters\": dictionary of argument name and its value}.\n\n{%- for t in tools %}{{ t | \
         tojson }}\n\n{% endfor %}{%- endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
         assistant:",
    ));
    let addr = start(model, DraftSetup::None, None, queue(8));
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}]);
    // The tools are in the prompt the template renders.
    let (s, v) = post(
        addr,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools}),
    );
    assert_eq!(s, 200, "{v}");
    let (_, plain) = post(
        addr,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}]}),
    );
    assert!(
        v["count"].as_u64().unwrap() > plain["count"].as_u64().unwrap() + 100,
        "{v} {plain}"
    );
    let (s, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools, "max_tokens": 500,
               "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
               // This random model would pad the call with whitespace to the grammar's limit at every turn.
               "logit_bias": {"9": -100, "10": -100, "13": -100, "32": -100}}),
    );
    assert_eq!(s, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{v}");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(
        arguments["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 6),
        "{v}"
    );
    assert!(choice["message"]["content"].is_null(), "{v}");
}

#[test]
fn an_api_key_is_required_when_set() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(tiny(dir.path()), DraftSetup::None, Some("sekret"), queue(8));
    let body = r#"{"prompt": "hi", "max_tokens": 2}"#;
    let (s, _, b) = http(addr, "POST", "/v1/completions", Some(body), &[]);
    assert_eq!(s, 401, "{b}");
    assert!(b.contains("missing API key"));
    let (s, _, _) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(body),
        &[("Authorization", "Bearer wrong")],
    );
    assert_eq!(s, 401);
    let (s, _, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(body),
        &[("Authorization", "Bearer sekret")],
    );
    assert_eq!(s, 200, "{b}");
    // Health needs no key (load balancers probe it).
    assert_eq!(http(addr, "GET", "/health", None, &[]).0, 200);
}

#[test]
fn prompt_lookup_keeps_the_settings_it_is_given() {
    // `serve --ngram-confidence` used to be dropped for the default bar: a bar of 1 must draft nothing (no
    // estimate reaches certainty), a bar of 0 every candidate, and both answer as plain decoding does.
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let prompt = "the tea the tea the tea the";
    let want = expected(&reference, prompt, 24);
    let drafted = |min_confidence: Option<f64>| {
        let settings = NgramSettings {
            min_n: 1,
            max_n: 3,
            min_confidence,
        };
        let addr = start(
            tiny(dir.path()),
            DraftSetup::Ngram(settings),
            None,
            queue(8),
        );
        let (s, v) = post(
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want);
        v["usage"]["speculation"]["drafted"].as_u64().unwrap()
    };
    assert_eq!(drafted(Some(1.0)), 0);
    assert!(drafted(Some(0.0)) > 0);
    // Cost-aware stopping on the CPU drafts too (the repeated phrase is a confident match).
    assert!(drafted(None) > 0);
}

#[test]
fn speculative_requests_report_their_stats_and_stay_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let addr = start(
        tiny(dir.path()),
        DraftSetup::Ngram(Default::default()),
        None,
        queue(8),
    );
    let prompt = "the tea the tea the tea the";
    let want = expected(&reference, prompt, 24);
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want);
    let spec = &v["usage"]["speculation"];
    assert!(spec["cycles"].as_u64().unwrap() > 0, "{v}");
    assert!(spec["drafted"].is_u64() && spec["mean_accepted_length"].as_f64().unwrap() >= 1.0);

    // /metrics (Prometheus text) counts what happened: the request, its tokens, its drafts.
    let (s, head, text) = http(addr, "GET", "/metrics", None, &[]);
    assert_eq!(s, 200);
    assert!(head.to_ascii_lowercase().contains("text/plain"), "{head}");
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
    };
    assert_eq!(value("specula:request_total{status=\"200\"}"), 1.0);
    assert_eq!(
        value("specula:generation_tokens_total"),
        v["usage"]["completion_tokens"].as_f64().unwrap()
    );
    assert_eq!(
        value("specula:spec_decode_num_draft_tokens"),
        spec["drafted"].as_f64().unwrap()
    );
    assert_eq!(
        value("specula:spec_decode_num_accepted_tokens"),
        spec["accepted"].as_f64().unwrap()
    );
    assert_eq!(value("specula:time_to_first_token_seconds_count"), 1.0);
    assert_eq!(value("specula:e2e_request_latency_seconds_count"), 1.0);
    assert_eq!(value("specula:num_requests_waiting"), 0.0);
    assert_eq!(value("specula:num_requests_running"), 0.0);
    // Every engine step is in the step histograms: one prefill, one decode step per verify cycle, and a verify
    // phase in each of those.
    assert_eq!(value("specula:step_seconds_count{kind=\"prefill\"}"), 1.0);
    assert_eq!(
        value("specula:step_seconds_count{kind=\"decode\"}"),
        spec["cycles"].as_f64().unwrap()
    );
    assert_eq!(
        value("specula:step_phase_seconds_count{phase=\"verify\"}"),
        spec["cycles"].as_f64().unwrap()
    );
    assert!(value("specula:step_phase_seconds_sum{phase=\"verify\"}") > 0.0);
    if spec["accepted"].as_u64().unwrap() > 0 {
        assert!(value("specula:spec_decode_num_accepted_tokens_per_pos{position=\"1\"}") > 0.0);
    }
    // Adaptive speculation's prices as measured so far: a step's overhead always, the drafter's time per drafted
    // token once a draft ran (prompt lookup never lags, so no catch-up price).
    assert!(value("specula:spec_decode_cost_seconds{cost=\"step_overhead\"}") >= 0.0);
    if spec["drafted"].as_u64().unwrap() > 0 {
        assert!(value("specula:spec_decode_cost_seconds{cost=\"draft_token\"}") > 0.0);
    }
    assert!(!text.contains("cost=\"catch_up_token\""), "{text}");
    // On-demand profiling: every request between start and stop lands in one trace and one report.
    let (s, v) = post(addr, "/stop_profile", json!({}));
    assert_eq!(s, 400, "stop without start: {v}");
    assert_eq!(post(addr, "/start_profile", json!({})).0, 200);
    assert_eq!(post(addr, "/start_profile", json!({})).0, 400, "already on");
    let (s, _) = post(
        addr,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(s, 200);
    let (s, v) = post(addr, "/stop_profile", json!({}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["requests"], 1);
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(v["trace"].as_str().unwrap()).unwrap())
            .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["name"] == "verify" && e["pid"] == 1),
        "{trace}"
    );
    // Each step's batch counter: prompt lookup drafts without shared head rounds, so none are counted.
    let batches: Vec<&Value> = events.iter().filter(|e| e["name"] == "batch").collect();
    assert!(!batches.is_empty(), "{trace}");
    for e in &batches {
        assert_eq!(
            (
                &e["args"]["draft_rounds"],
                &e["args"]["draft_rows"],
                &e["args"]["head_captures"]
            ),
            (&json!(0), &json!(0), &json!(0)),
            "{e}"
        );
    }
    // Each step's draft-budget counter: its wall time and committed tokens (which add up to the completion), and
    // what the budget expected of it where it had measurements.
    let budget: Vec<&Value> = events
        .iter()
        .filter(|e| e["name"] == "draft budget")
        .collect();
    assert!(
        budget.iter().any(|e| e["args"]["expected_ms"].is_number()),
        "the first request's steps measured two row counts: {trace}"
    );
    let committed: u64 = budget
        .iter()
        .map(|e| e["args"]["tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(committed, 12, "{trace}");
    for e in &budget {
        assert!(e["args"]["wall_ms"].as_f64().unwrap() > 0.0, "{e}");
        if let Some(ms) = e["args"]["expected_ms"].as_f64() {
            assert!(
                // Expected tokens are a sum of gains: at least the step's one token, up to rounding.
                ms > 0.0 && e["args"]["expected_tokens"].as_f64().unwrap() >= 1.0 - 1e-9,
                "{e}"
            );
        }
    }
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(v["report"].as_str().unwrap()).unwrap())
            .unwrap();
    let r = &report["requests"][0];
    assert_eq!(r["request"], 1);
    assert!(r["phases"].to_string().contains("verify"), "{report}");
    assert!(r["speculation"]["drafted"].is_u64(), "{report}");
    // The engine thread's time on the request between steps: admitting it (its parts add up) and letting it go,
    // in the report and as events on the request's track, inside its queued-to-finished span.
    let host = &r["engine_host"];
    let part = |k: &str| host[k].as_f64().unwrap();
    assert!(
        (part("prepare_s") + part("drafter_s") + part("generation_s") + part("prefix_s")
            - part("admit_s"))
        .abs()
            < 1e-9,
        "{report}"
    );
    assert!(part("admit_s") > 0.0 && part("leave_s") > 0.0, "{report}");
    assert!(
        part("admit_started_s") >= r["queued_s"].as_f64().unwrap()
            && part("leave_started_s") <= r["finished_s"].as_f64().unwrap(),
        "{report}"
    );
    for name in ["admit", "leave"] {
        assert!(
            events.iter().any(|e| e["name"] == name && e["pid"] == 2),
            "no {name} event: {trace}"
        );
    }

    // An error is counted under its status.
    post(addr, "/v1/completions", json!({"prompt": ""}));
    let (_, _, text2) = http(addr, "GET", "/metrics", None, &[]);
    assert!(
        text2.contains("specula:request_total{status=\"400\"} 1"),
        "{text2}"
    );
}

#[test]
fn eagle3_heads_serve_losslessly_as_chains_and_trees() {
    use specula::draft::eagle3::{Eagle3Head, TreeShape};
    use specula::testing::{write_tiny_eagle3_head, TinyHeadSpec};
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        layers: 3,
        untied_head: true,
        ..Default::default()
    };
    let p = dir.path().join("t.gguf");
    write_tiny_gguf(&p, &spec).unwrap();
    let reference = load_gguf(&p, "t").unwrap();
    let head_dir = dir.path().join("head");
    write_tiny_eagle3_head(
        &head_dir,
        reference.model.config(),
        &TinyHeadSpec::default(),
    )
    .unwrap();
    let want = expected(&reference, "hello world", 20);
    // Chain and tree, and the chain with the bookkeeping overlapped (a GPU's default, forced here); then a lone
    // request under --spec-disable-batch-size 2 (drafts: one decoding is under the cap) and 1 (never drafts).
    for (tree, overlap, disable_at) in [
        (None, None, None),
        (Some(TreeShape::new(2, 3, 5).unwrap()), None, None),
        (None, Some(true), None),
        (None, None, Some(2)),
        (None, None, Some(1)),
    ] {
        let head = Eagle3Head::load(&head_dir).unwrap();
        let addr = start(
            load_gguf(&p, "t").unwrap(),
            DraftSetup::Eagle3(
                Box::new(head),
                tree,
                specula::draft::eagle3::DEFAULT_MIN_CONFIDENCE,
            ),
            None,
            EngineOptions {
                overlap,
                spec_disable_batch_size: disable_at,
                ..queue(8)
            },
        );
        let (s, v) = post(
            addr,
            "/v1/completions",
            json!({"prompt": "hello world", "max_tokens": 20, "temperature": 0}),
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want, "tree {tree:?}");
        let drafted = v["usage"]["speculation"]["drafted"].as_u64().unwrap();
        if disable_at == Some(1) {
            assert_eq!(drafted, 0, "drafted at the disabling batch size: {v}");
        } else {
            assert!(drafted > 0, "{v}");
        }
    }
}

/// `--spec-disable-batch-size 2`: a request admitted while another runs joins a batch of 2, so it gets no drafter
/// (no cycles at all) and answers as plain decoding; the one admitted alone keeps its head until it has been
/// allowed no draft for 16 decoding steps beside the other, and then loses it (an idle head costs every step),
/// answering as plain decoding all the same (drafters at 2 requests having been allowed no draft in 20 steps,
/// they count as mostly idle there). With a cap of 1 even a lone request joins a batch at the cap: no
/// drafter.
#[test]
fn requests_admitted_past_the_disabling_batch_size_get_no_drafter() {
    use specula::draft::eagle3::Eagle3Head;
    use specula::testing::{write_tiny_eagle3_head, TinyHeadSpec};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("slow.gguf");
    write_tiny_gguf(
        &p,
        &TinySpec {
            untied_head: true,
            hidden: 256,
            intermediate: 512,
            layers: 4,
            context: 4096,
            ..Default::default()
        },
    )
    .unwrap();
    let reference = load_gguf(&p, "t").unwrap();
    let head_dir = dir.path().join("head");
    write_tiny_eagle3_head(
        &head_dir,
        reference.model.config(),
        &TinyHeadSpec::default(),
    )
    .unwrap();
    let want_a = expected_until(&reference, "a long one", 1500, false);
    let want_b = expected_until(&reference, "the second one", 40, false);
    let addr = start(
        load_gguf(&p, "t").unwrap(),
        DraftSetup::Eagle3(
            Box::new(Eagle3Head::load(&head_dir).unwrap()),
            None,
            specula::draft::eagle3::DEFAULT_MIN_CONFIDENCE,
        ),
        None,
        EngineOptions {
            spec_disable_batch_size: Some(2),
            ..queue(8)
        },
    );
    let a = std::thread::spawn(move || {
        post(
            addr,
            "/v1/completions",
            json!({"prompt": "a long one", "max_tokens": 1500, "temperature": 0, "ignore_eos": true}),
        )
    });
    wait_for_metric(addr, "specula:num_requests_running", 1.0);
    let (s, b) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "the second one", "max_tokens": 40, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["text"], want_b);
    assert_eq!(b["usage"]["speculation"]["cycles"], 0, "{b}");
    let (s, a) = a.join().unwrap();
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["choices"][0]["text"], want_a);
    let spec = &a["usage"]["speculation"];
    // It had its drafter (whether the budget lets a random head draft depends on timing), and lost it beside b.
    assert!(spec["cycles"].as_u64().unwrap() > 0, "{a}");
    let (_, _, text) = http(addr, "GET", "/metrics", None, &[]);
    assert_eq!(metric(&text, "specula:spec_decode_released_drafters"), 1.0);
    assert_eq!(
        metric(&text, "specula:spec_decode_admitted_without_drafter"),
        1.0
    );
    // The batch-size cap decided, not the measured payoff.
    assert_eq!(
        metric(&text, "specula:spec_decode_payoff_refused_steps"),
        0.0
    );
}

/// Reads one sample of the Prometheus text exposition (a parser, not a substring match).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            (key == name).then(|| value.parse().ok()).flatten()
        })
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
}

/// Continuous batching: clients sending at once are decoded together (the step batch-size histogram shows more
/// than one request per step), and each gets exactly the answer it gets alone, with and without speculation,
/// streamed or not; the metrics add up to the sum of the responses' usage.
#[test]
fn concurrent_requests_are_batched_and_each_gets_its_answer_alone() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let prompts: Vec<(String, usize)> = (0..8)
        .map(|i| {
            (
                format!("request {i}: the tea {} and {}", "x".repeat(i), i * 7),
                12 + 5 * i,
            )
        })
        .collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|(p, n)| expected(&reference, p, *n))
        .collect();
    // The last run forces the overlapped bookkeeping (a GPU's default) on the CPU: the plans a step old, the
    // metrics a step late, the answers the same.
    for (draft, overlap) in [
        (DraftSetup::None, None),
        (DraftSetup::Ngram(Default::default()), None),
        (DraftSetup::Ngram(Default::default()), Some(true)),
    ] {
        let speculating = !matches!(draft, DraftSetup::None);
        let addr = start(
            tiny(dir.path()),
            draft,
            None,
            EngineOptions {
                // Small chunks, so prompts enter over several steps beside running requests.
                prefill_chunk: 7,
                overlap,
                ..queue(16)
            },
        );
        let answers: Vec<(String, Value)> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, (p, n))| {
                    s.spawn(move || {
                        let stream = i % 2 == 1;
                        let body = json!({"prompt": p, "max_tokens": n, "temperature": 0,
                                          "stream": stream, "stream_options": {"include_usage": true}});
                        let (status, _, text) =
                            http(addr, "POST", "/v1/completions", Some(&body.to_string()), &[]);
                        assert_eq!(status, 200, "{text}");
                        if stream {
                            let (t, done, chunks) = sse_text(&text, false);
                            assert!(done);
                            (t, chunks.last().unwrap()["usage"].clone())
                        } else {
                            let v: Value = serde_json::from_str(&text).unwrap();
                            (
                                v["choices"][0]["text"].as_str().unwrap().to_string(),
                                v["usage"].clone(),
                            )
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, ((text, _), want)) in answers.iter().zip(&want).enumerate() {
            assert_eq!(text, want, "request {i}, speculating {speculating}");
        }
        let (_, _, m) = http(addr, "GET", "/metrics", None, &[]);
        let steps = metric(&m, "specula:step_batch_size_count");
        let batched = metric(&m, "specula:step_batch_size_sum");
        assert!(
            batched > steps,
            "never more than one request per step ({batched} over {steps} steps)"
        );
        let total =
            |key: &str| -> f64 { answers.iter().map(|(_, u)| u[key].as_f64().unwrap()).sum() };
        assert_eq!(
            metric(&m, "specula:generation_tokens_total"),
            total("completion_tokens")
        );
        assert_eq!(
            metric(&m, "specula:prompt_tokens_total"),
            total("prompt_tokens")
        );
        let spec_total = |key: &str| -> f64 {
            answers
                .iter()
                .map(|(_, u)| u["speculation"][key].as_f64().unwrap())
                .sum()
        };
        assert_eq!(
            metric(&m, "specula:spec_decode_num_draft_tokens"),
            spec_total("drafted")
        );
        assert_eq!(
            metric(&m, "specula:spec_decode_num_accepted_tokens"),
            spec_total("accepted")
        );
        if speculating {
            assert!(spec_total("drafted") > 0.0);
        }
        assert_eq!(metric(&m, "specula:num_requests_running"), 0.0);
        assert_eq!(metric(&m, "specula:num_requests_waiting"), 0.0);
        assert_eq!(metric(&m, "specula:kv_cache_usage_perc"), 0.0);
        assert_eq!(metric(&m, "specula:e2e_request_latency_seconds_count"), 8.0);
    }
}

/// The KV memory budget: a request that could never fit is refused naming both sizes; requests that fit one at a
/// time wait for each other instead of failing.
#[test]
fn the_kv_memory_budget_admits_what_fits_and_refuses_what_never_can() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let per_position = reference.model.kv_bytes_per_position();
    let addr = start(
        tiny(dir.path()),
        DraftSetup::None,
        None,
        EngineOptions {
            // Room for one request of up to ~60 positions at a time.
            kv_memory: 60 * per_position,
            ..queue(8)
        },
    );
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello", "max_tokens": 100, "temperature": 0}),
    );
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("KV") && msg.contains("--kv-memory"), "{msg}");
    let want = expected(&reference, "hello there", 30);
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    post(
                        addr,
                        "/v1/completions",
                        json!({"prompt": "hello there", "max_tokens": 30, "temperature": 0}),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (s, v) in &answers {
        assert_eq!(*s, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want);
    }
    let (_, _, m) = http(addr, "GET", "/metrics", None, &[]);
    assert_eq!(
        metric(&m, "specula:step_batch_size_sum"),
        metric(&m, "specula:step_batch_size_count"),
        "two requests ran together past the KV budget"
    );
}

/// A request past the server's timeout ends with 504 (non-streamed) or an error event (streamed).
#[test]
fn requests_past_the_timeout_end_with_a_timeout_error() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(
        tiny(dir.path()),
        DraftSetup::None,
        None,
        EngineOptions {
            request_timeout: Some(std::time::Duration::from_millis(1)),
            ..queue(8)
        },
    );
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello", "max_tokens": 200, "temperature": 0}),
    );
    assert_eq!(s, 504, "{v}");
    assert_eq!(v["error"]["type"], "timeout_error", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("timeout"),
        "{v}"
    );
    let body = json!({"prompt": "hello", "max_tokens": 200, "temperature": 0, "stream": true});
    let (status, _, text) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        &[],
    );
    // Either refused before it started (504) or ended mid-stream by an error event; never a normal end.
    if status == 200 {
        assert!(text.contains("timeout_error"), "{text}");
        assert!(!text.contains("\"finish_reason\":\"length\""), "{text}");
    } else {
        assert_eq!(status, 504, "{text}");
    }
}

/// vLLM's `ignore_eos`: a boolean, and with it every request runs to max_tokens.
#[test]
fn ignore_eos_runs_to_max_tokens_and_must_be_a_boolean() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello", "max_tokens": 5, "ignore_eos": "yes"}),
    );
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["param"], "ignore_eos", "{v}");
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello", "max_tokens": 60, "temperature": 1.5, "seed": 3, "ignore_eos": true}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 60, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
}

/// A draft model (with a reduced draft vocabulary, as `--draft-vocab` gives) serves losslessly, batched.
#[test]
fn a_draft_model_with_a_reduced_vocabulary_serves_losslessly() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let want = expected(&reference, "the tea the tea", 30);
    let addr = start(
        tiny(dir.path()),
        DraftSetup::Model(
            Box::new(tiny(dir.path())),
            Some(200),
            specula::draft::model::DEFAULT_MIN_CONFIDENCE,
        ),
        None,
        EngineOptions {
            adaptive_drafts: false,
            ..queue(8)
        },
    );
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    post(
                        addr,
                        "/v1/completions",
                        json!({"prompt": "the tea the tea", "max_tokens": 30, "temperature": 0}),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (s, v) in &answers {
        assert_eq!(*s, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want, "{v}");
        assert!(
            v["usage"]["speculation"]["drafted"].as_u64().unwrap() > 0,
            "{v}"
        );
    }
}

/// Polls /metrics until `name` reads `want` (the engine updates gauges between steps), or panics after 30 s.
fn wait_for_metric(addr: SocketAddr, name: &str, want: f64) -> String {
    let start = std::time::Instant::now();
    loop {
        let (_, _, m) = http(addr, "GET", "/metrics", None, &[]);
        if m.lines().any(|l| {
            l.rsplit_once(' ')
                .is_some_and(|(k, v)| k == name && v.parse() == Ok(want))
        }) {
            return m;
        }
        assert!(
            start.elapsed().as_secs() < 30,
            "{name} never read {want}:\n{m}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Overload and disconnects under load: with one slot and a queue of one, a third request is refused with 429
/// and Retry-After; a streaming client that leaves mid-answer frees its slot long before its max_tokens (the
/// queued request then runs and gets its own answer), and the metrics count it as aborted, with nothing left
/// running or reserved.
#[test]
fn a_full_queue_answers_429_and_a_client_that_leaves_frees_its_slot() {
    let dir = tempfile::tempdir().unwrap();
    // Big enough that 4000 tokens take seconds, so a client leaving is seen long before the end.
    let path = dir.path().join("slow.gguf");
    write_tiny_gguf(
        &path,
        &TinySpec {
            untied_head: true,
            hidden: 256,
            intermediate: 512,
            layers: 4,
            context: 4096,
            ..Default::default()
        },
    )
    .unwrap();
    let reference = load_gguf(&path, "tiny").unwrap();
    let want_b = expected(&reference, "the queued one", 8);
    let addr = start(
        load_gguf(&path, "tiny").unwrap(),
        DraftSetup::None,
        None,
        EngineOptions {
            max_batch: 1,
            ..queue(1)
        },
    );
    // A: a long streamed answer; read until its first token arrives.
    let body = json!({"prompt": "a long one", "max_tokens": 4000, "temperature": 0,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let mut a = TcpStream::connect(addr).unwrap();
    write!(
        a,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = a.read(&mut buf).unwrap();
        assert!(n > 0, "A's stream closed before its first token");
        seen.extend_from_slice(&buf[..n]);
    }
    // B waits in the queue behind A.
    let b = std::thread::spawn(move || {
        post(
            addr,
            "/v1/completions",
            json!({"prompt": "the queued one", "max_tokens": 8, "temperature": 0}),
        )
    });
    wait_for_metric(addr, "specula:num_requests_waiting", 1.0);
    // C finds the queue full.
    let (status, head, text) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "one too many", "max_tokens": 4}).to_string()),
        &[],
    );
    assert_eq!(status, 429, "{text}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after:"),
        "no Retry-After in {head}"
    );
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("queue"),
        "{v}"
    );
    // A's client leaves: its slot goes to B, which gets exactly its answer alone.
    drop(a);
    let (status, v) = b.join().unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want_b.as_str());
    let m = wait_for_metric(
        addr,
        "specula:request_success_total{finished_reason=\"abort\"}",
        1.0,
    );
    let generated = metric(&m, "specula:generation_tokens_total");
    let a_tokens = generated - v["usage"]["completion_tokens"].as_f64().unwrap();
    assert!(
        (1.0..4000.0).contains(&a_tokens),
        "the abandoned request generated {a_tokens} of its 4000 tokens"
    );
    assert_eq!(metric(&m, "specula:num_requests_running"), 0.0);
    assert_eq!(metric(&m, "specula:num_requests_waiting"), 0.0);
    assert_eq!(metric(&m, "specula:kv_cache_usage_perc"), 0.0);
}

/// A prompt seen before starts from the keys and values its earlier request left (the prefix cache): the same
/// answer, the reused tokens in `usage.prompt_tokens_details.cached_tokens` and in the metrics; a conversation's
/// next turn reuses the whole first turn; `prefix_cache: false` reuses nothing.
#[test]
fn repeated_prompts_reuse_their_prefix_and_answer_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let prompt = "the tea and the cake, the tea and the cake, then the tea";
    let want = expected(&reference, prompt, 12);
    let prompt_tokens = reference.tokenizer.encode(prompt).unwrap().len() as u64;
    let ask = |addr: SocketAddr, prompt: &str| {
        let (status, v) = post(
            addr,
            "/v1/completions",
            json!({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            cached,
        )
    };
    for (draft, on) in [
        (DraftSetup::None, true),
        (DraftSetup::Ngram(Default::default()), true),
        (DraftSetup::None, false),
    ] {
        let addr = start(
            tiny(dir.path()),
            draft,
            None,
            EngineOptions {
                prefix_cache: on,
                ..queue(8)
            },
        );
        let mut cached = Vec::new();
        for _ in 0..3 {
            let (text, c) = ask(addr, prompt);
            assert_eq!(text, want);
            cached.push(c);
        }
        let reused = if on { prompt_tokens - 1 } else { 0 };
        assert_eq!(cached, [0, reused, reused]);
        // The next turn holds the first prompt and its answer: everything cached is reused.
        let next = format!("{prompt}{want} and more tea");
        let next_tokens = reference.tokenizer.encode(&next).unwrap().len() as u64;
        let (text, c) = ask(addr, &next);
        assert_eq!(text, expected(&reference, &next, 12));
        if on {
            assert!(c > prompt_tokens, "{c} of {next_tokens} reused");
        } else {
            assert_eq!(c, 0);
        }
        let (_, _, m) = http(addr, "GET", "/metrics", None, &[]);
        let queries = if on {
            3 * prompt_tokens + next_tokens
        } else {
            0
        };
        assert_eq!(metric(&m, "specula:prefix_cache_queries"), queries as f64);
        assert_eq!(
            metric(&m, "specula:prefix_cache_hits"),
            (cached.iter().sum::<u64>() + c) as f64
        );
        // The cache holds what the requests left (each prompt within its answer's longer cache), within budget.
        let entries = metric(&m, "specula:prefix_cache_entries");
        let usage = metric(&m, "specula:prefix_cache_usage_perc");
        if on {
            assert!(
                entries >= 1.0 && usage > 0.0 && usage <= 1.0,
                "{entries} {usage}"
            );
        } else {
            assert_eq!((entries, usage), (0.0, 0.0));
        }
    }
}

/// Log-probabilities in OpenAI's two shapes equal the library's for the same request: completions' legacy object
/// (with the echoed prompt's, the first token's null), chat's content entries with exact bytes; streamed chunks
/// carry the same entries as the whole answer; a stop sequence keeps the tokens whose text starts before it.
#[test]
fn logprobs_come_back_in_openais_shapes_and_equal_the_librarys() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let addr = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let prompt = "hello world";
    let ids = reference.tokenizer.encode(prompt).unwrap();
    let lib = generate(
        reference.model.as_ref(),
        &reference.tokenizer,
        &GenerateRequest {
            prompt_tokens: ids.clone(),
            max_new_tokens: 12,
            sampling: SamplingParams::default(),
            stop_at_eos: true,
            cancel: None,
            logprobs: Some(LogprobsRequest {
                top: 3,
                prompt: true,
            }),
            logit_adjustments: None,
            stop_token_ids: Vec::new(),
        },
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap();
    assert!(!lib.tokens.is_empty());

    // Completions with the prompt echoed: every prompt token, then every generated one.
    let body =
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3, "echo": true});
    let (s, v) = post(addr, "/v1/completions", body.clone());
    assert_eq!(s, 200, "{v}");
    let choice = &v["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert_eq!(text, format!("{prompt}{}", lib.text));
    let lp = &choice["logprobs"];
    let n = ids.len() + lib.tokens.len();
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), n, "{key}: {lp}");
    }
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    let want: Vec<&specula::sampling::TokenLogprob> =
        lib.prompt_logprobs.iter().chain(&lib.logprobs).collect();
    for (i, w) in want.iter().enumerate() {
        let got = lp["token_logprobs"][i + 1].as_f64().unwrap();
        assert!(
            (got - f64::from(w.logprob)).abs() < 1e-6,
            "token {i}: {got} vs {w:?}"
        );
        let top = lp["top_logprobs"][i + 1].as_object().unwrap();
        // The 3 alternatives and the chosen token (one of them when greedy output picks the most likely).
        assert!((3..=4).contains(&top.len()), "{top:?}");
        let bytes = reference.tokenizer.token_bytes(w.token);
        let chosen = match std::str::from_utf8(&bytes) {
            Ok(t) => t.to_string(),
            Err(_) => format!(
                "bytes:{}",
                bytes
                    .iter()
                    .map(|b| format!("\\x{b:02x}"))
                    .collect::<String>()
            ),
        };
        assert_eq!(lp["tokens"][i + 1], chosen.as_str());
        assert!(top.contains_key(&chosen));
    }
    let offsets: Vec<usize> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    assert_eq!(
        offsets[ids.len()],
        prompt.len(),
        "the answer starts after the echo"
    );
    assert!(offsets.iter().all(|&o| o <= text.len()));

    // Streamed: the echo chunk carries the prompt's entries, the rest come with their text; together they equal
    // the whole answer's.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (s, _, raw) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&streamed.to_string()),
        &[],
    );
    assert_eq!(s, 200);
    let (stream_text, done, chunks) = sse_text(&raw, false);
    assert!(done);
    assert_eq!(stream_text, text);
    let mut joined =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in &chunks {
        let l = &c["choices"][0]["logprobs"];
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            for item in l[key].as_array().into_iter().flatten() {
                joined[key].as_array_mut().unwrap().push(item.clone());
            }
        }
    }
    assert_eq!(&joined, lp);
    assert_eq!(chunks[0]["choices"][0]["text"], prompt);

    // lm-evaluation-harness's loglikelihood request: a token-id prompt (in a list of one), echo, max_tokens 1,
    // logprobs 1; it sums token_logprobs past the context and checks each token against its top alternative.
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": [ids.clone()], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true}),
    );
    assert_eq!(s, 200, "{v}");
    let harness = &v["choices"][0]["logprobs"];
    assert_eq!(harness["tokens"].as_array().unwrap().len(), ids.len() + 1);
    for (i, w) in lib.prompt_logprobs.iter().enumerate() {
        let got = harness["token_logprobs"][i + 1].as_f64().unwrap();
        assert!((got - f64::from(w.logprob)).abs() < 1e-6);
    }

    // Without the echo, only the generated tokens; a stop sequence keeps the tokens whose text starts before it.
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0}),
    );
    assert_eq!(s, 200, "{v}");
    let whole = v["choices"][0]["logprobs"].clone();
    assert_eq!(whole["tokens"].as_array().unwrap().len(), lib.tokens.len());
    assert!(whole["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.as_object().unwrap().len() == 1));
    let answer = v["choices"][0]["text"].as_str().unwrap().to_string();
    let cut = (1..answer.len())
        .find(|&i| {
            answer.is_char_boundary(i)
                && answer.is_char_boundary(i + 1)
                && !answer[..i].contains(&answer[i..i + 1])
        })
        .expect("a character that first appears after the start");
    let stop = answer[cut..cut + 1].to_string();
    let (s, v) = post(
        addr,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0, "stop": stop}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], &answer[..cut]);
    let kept = whole["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .take_while(|o| (o.as_u64().unwrap() as usize) < cut)
        .count();
    let stopped = &v["choices"][0]["logprobs"];
    assert_eq!(
        stopped["tokens"].as_array().unwrap().len(),
        kept,
        "{stopped}"
    );
    assert_eq!(
        stopped["token_logprobs"].as_array().unwrap()[..],
        whole["token_logprobs"].as_array().unwrap()[..kept]
    );

    // Chat: content entries with bytes, the alternatives most likely first; streamed entries equal these.
    let chat = json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10, "temperature": 0,
                      "logprobs": true, "top_logprobs": 2});
    let (s, v) = post(addr, "/v1/chat/completions", chat.clone());
    assert_eq!(s, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let mut bytes = Vec::new();
    for e in &content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        // Greedy: the chosen token is the most likely.
        assert_eq!(top[0]["token"], e["token"]);
        assert_eq!(top[0]["logprob"], e["logprob"]);
        bytes.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let (_, _, raw) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&streamed.to_string()),
        &[],
    );
    let (_, _, chunks) = sse_text(&raw, true);
    let joined: Vec<Value> = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(joined, content);
    // Not asked: null.
    let (_, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    );
    assert!(v["choices"][0]["logprobs"].is_null());
}

/// Penalties and a logit bias answer what the library generates with the same adjustments, with and without
/// speculation (greedy), and change the answer.
#[test]
fn penalties_and_logit_bias_answer_like_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tiny(dir.path());
    let plain = start(tiny(dir.path()), DraftSetup::None, None, queue(8));
    let ngram = start(
        tiny(dir.path()),
        DraftSetup::Ngram(Default::default()),
        None,
        queue(8),
    );
    // The target as its own draft model: it drafts the unadjusted argmax, which the penalties often overturn.
    let model = start(
        tiny(dir.path()),
        DraftSetup::Model(Box::new(tiny(dir.path())), None, 0.0),
        None,
        queue(8),
    );
    let prompt = "hello world hello world";
    let ids = reference.tokenizer.encode(prompt).unwrap();
    let library = |rules: Option<specula::sampling::LogitAdjustments>| {
        generate(
            reference.model.as_ref(),
            &reference.tokenizer,
            &GenerateRequest {
                prompt_tokens: ids.clone(),
                max_new_tokens: 24,
                sampling: SamplingParams::default(),
                stop_at_eos: true,
                cancel: None,
                logprobs: None,
                logit_adjustments: rules,
                stop_token_ids: Vec::new(),
            },
            None,
            &Profiler::disabled(),
            &mut |_| {},
        )
        .unwrap()
    };
    let unadjusted = library(None);
    let first = unadjusted.tokens[0];
    let rules = specula::sampling::LogitAdjustments {
        presence_penalty: 0.8,
        frequency_penalty: 0.5,
        repetition_penalty: 1.3,
        logit_bias: vec![(first, -100.0), (104, 3.0)],
        ..Default::default()
    };
    let want = library(Some(rules));
    assert_ne!(want.tokens, unadjusted.tokens);
    for addr in [plain, ngram, model] {
        let (s, v) = post(
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "presence_penalty": 0.8,
                   "frequency_penalty": 0.5, "repetition_penalty": 1.3,
                   "logit_bias": {first.to_string(): -100, "104": 3.0}}),
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want.text.as_str());
        // Neutral values answer as without them.
        let (_, v) = post(
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "presence_penalty": 0,
                   "repetition_penalty": 1, "logit_bias": {}}),
        );
        assert_eq!(v["choices"][0]["text"], unadjusted.text.as_str());
    }
}

/// A small deterministic generator for the mutated requests below.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as usize % n
    }
}

/// One edit of a request: a value replaced (by a boundary number, a string, null, a container, another field's
/// kind of value), deleted, or a known field added with such a value.
fn mutate(request: &mut Value, rng: &mut Rng) {
    const FIELDS: &[&str] = &[
        "max_tokens",
        "n",
        "logprobs",
        "top_logprobs",
        "stop",
        "seed",
        "temperature",
        "top_p",
        "top_k",
        "response_format",
        "guided_regex",
        "guided_choice",
        "guided_json",
        "tools",
        "tool_choice",
        "stream",
        "stream_options",
        "min_tokens",
        "stop_token_ids",
        "logit_bias",
        "best_of",
        "echo",
        "suffix",
        "prompt",
        "messages",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "structured_outputs",
        "max_completion_tokens",
        "model",
        "user",
    ];
    let replacement = |rng: &mut Rng| -> Value {
        match rng.below(16) {
            0 => json!(0),
            1 => json!(-1),
            2 => json!(1e20),
            3 => json!(u64::MAX),
            4 => json!(0.5),
            5 => json!(""),
            6 => json!("x".repeat(rng.below(300))),
            7 => Value::Null,
            8 => json!(true),
            9 => json!([]),
            10 => json!({}),
            11 => json!([[[["deep"]]]]),
            12 => {
                json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a|b)*c"}}}}})
            }
            13 => json!("[a-z]{2,4}"),
            14 => json!(["yes", "no"]),
            _ => json!(3),
        }
    };
    let paths = specula::testing::json_pointers(request);
    let path = paths[rng.below(paths.len())].clone();
    match rng.below(4) {
        0 => specula::testing::remove_json_pointer(request, &path),
        1 => {
            if let Some(map) = request.as_object_mut() {
                let field = FIELDS[rng.below(FIELDS.len())];
                map.insert(field.to_string(), replacement(rng));
            }
        }
        _ => {
            let new = replacement(rng);
            if let Some(slot) = request.pointer_mut(&path) {
                *slot = new;
            }
        }
    }
}

/// A request sent raw, with a read timeout: (status, body), or None where the connection broke or stalled.
fn send_raw(addr: SocketAddr, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .ok()?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Some((status, body))
}

#[test]
fn mutated_requests_get_answers_or_openai_errors_and_leave_the_server_well() {
    // Valid requests over most of what the server reads, each edited a few times at random: every answer must be
    // a 200 or a 4xx in OpenAI's error shape (never a 5xx, a dropped connection or a stall), and afterwards the
    // server must answer a fixed request as before, with nothing left running or queued.
    let dir = tempfile::tempdir().unwrap();
    let addr = start(
        tiny(dir.path()),
        DraftSetup::Ngram(Default::default()),
        None,
        queue(8),
    );
    let probe = json!({"prompt": "the tea the tea the", "max_tokens": 10, "temperature": 0});
    let (s, before) = post(addr, "/v1/completions", probe.clone());
    assert_eq!(s, 200, "{before}");
    let seeds: Vec<(&str, Value)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "the tea the tea", "max_tokens": 8, "temperature": 0, "stop": ["x"], "logprobs": 2, "seed": 3, "echo": false}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "be short"}, {"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "stream": true, "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a json"}], "max_tokens": 12, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]}}}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "abc", "max_tokens": 6, "guided_regex": "[a-c]{2,5}", "temperature": 0}),
        ),
        (
            "/v1/completions",
            json!({"prompt": ["one", "two"], "max_tokens": 4, "guided_choice": ["yes", "no"], "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "call f"}]}], "max_completion_tokens": 8, "tool_choice": "none", "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "the the the", "max_tokens": 6, "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"5": -100}, "min_p": 0.1, "stop_token_ids": [3], "min_tokens": 2, "seed": 7, "temperature": 0.8}),
        ),
        ("/tokenize", json!({"prompt": "the tea"})),
    ];
    for (path, seed) in &seeds {
        let body = seed.to_string();
        let answer = send_raw(addr, path, &body);
        assert_eq!(
            answer.as_ref().map(|a| a.0),
            Some(200),
            "POST {path} {body}: {answer:?}"
        );
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut statuses = std::collections::BTreeMap::new();
    for case in 0..400 {
        let (path, seed) = &seeds[case % seeds.len()];
        let mut request = seed.clone();
        for _ in 0..1 + rng.below(2) {
            mutate(&mut request, &mut rng);
        }
        // Now and then the other kind of endpoint.
        let path = match rng.below(10) {
            0 => "/v1/completions",
            1 => "/v1/chat/completions",
            _ => path,
        };
        let body = request.to_string();
        let Some((status, answer)) = send_raw(addr, path, &body) else {
            panic!("POST {path} {body}: the connection broke or stalled");
        };
        *statuses.entry(status).or_insert(0u32) += 1;
        assert!(
            status == 200 || (400..500).contains(&status),
            "POST {path} {body}: {status} {answer}"
        );
        if status != 200 {
            let v: Value = serde_json::from_str(&answer)
                .unwrap_or_else(|e| panic!("POST {path} {body}: {status} {answer:?}: {e}"));
            assert!(v["error"]["message"].is_string(), "POST {path} {body}: {v}");
        } else if answer.starts_with("data:") {
            assert!(
                answer.contains("data: [DONE]"),
                "POST {path} {body}: {answer}"
            );
        } else {
            let v: Value = serde_json::from_str(&answer)
                .unwrap_or_else(|e| panic!("POST {path} {body}: {answer:?}: {e}"));
            assert!(v.is_object(), "POST {path} {body}: {v}");
        }
    }
    eprintln!("mutated requests, answers by status: {statuses:?}");
    // Both kinds of answer were seen (the edits neither all break nor all keep the requests).
    assert!(
        statuses.get(&200).copied().unwrap_or(0) >= 40,
        "{statuses:?}"
    );
    assert!(
        statuses.get(&400).copied().unwrap_or(0) >= 40,
        "{statuses:?}"
    );
    // Found by the output-constraint fuzz target: a multipleOf of 1e300 panicked while the schema compiled, so
    // the client saw its connection drop; now a 400 names it.
    let (s, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "n"}], "max_tokens": 4,
               "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema":
                   {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 1e300}}}}}}),
    );
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("multipleOf"),
        "{v}"
    );
    let (s, after) = post(addr, "/v1/completions", probe);
    assert_eq!(s, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let (_, _, metrics) = http(addr, "GET", "/metrics", None, &[]);
    for gauge in [
        "specula:num_requests_running ",
        "specula:num_requests_waiting ",
    ] {
        let line = metrics.lines().find(|l| l.starts_with(gauge)).unwrap();
        assert!(line.ends_with(" 0"), "{line}");
    }
}
