//! What the server adds at concurrency 1: the same requests through `specula serve`'s HTTP API (an in-process
//! server on a free port, the engine with its per-step profiler) and through the library's `generate()` alone,
//! interleaved A-B-B-A in one process so the machine's drift cancels; prints each round's ratio and the median.
//!
//! `cargo run --release -p specula-server --example server_overhead -- MODEL.gguf PROMPTS.jsonl [ROUNDS] [TOKENS]
//! [THREADS]` (raw prompts, greedy, every request runs to TOKENS new tokens).
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use specula::decode::{generate, GenerateRequest};
use specula::model::{load_gguf, LoadedModel};
use specula::profile::Profiler;
use specula::sampling::SamplingParams;
use specula_server::engine::{DraftSetup, Engine, EngineOptions};
use specula_server::{AppState, Limits};

fn start(model: LoadedModel) -> SocketAddr {
    let metrics = Arc::new(specula_server::metrics::Metrics::new());
    let engine = Engine::start(
        model,
        DraftSetup::None,
        EngineOptions::default(),
        metrics.clone(),
    );
    let state = Arc::new(AppState {
        engine,
        metrics,
        profile_dir: std::env::temp_dir().join("specula-server-overhead"),
        api_key: None,
        limits: Limits::default(),
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
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

/// One non-streamed completion; returns (seconds, completion tokens).
fn via_server(addr: SocketAddr, prompt: &str, tokens: usize) -> (f64, usize) {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": true})
        .to_string();
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let secs = start.elapsed().as_secs_f64();
    let json = raw.split_once("\r\n\r\n").expect("an HTTP response").1;
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|_| panic!("{raw}"));
    (
        secs,
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
    )
}

fn via_library(model: &LoadedModel, prompt: &str, tokens: usize) -> (f64, usize) {
    let start = Instant::now();
    let req = GenerateRequest {
        prompt_tokens: model.tokenizer.encode(prompt).unwrap(),
        max_new_tokens: tokens,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    let out = generate(
        model.model.as_ref(),
        &model.tokenizer,
        &req,
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap();
    (start.elapsed().as_secs_f64(), out.tokens.len())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        bail!("usage: server_overhead MODEL.gguf PROMPTS.jsonl [ROUNDS] [TOKENS] [THREADS]");
    }
    let number = |i: usize, default: usize, name: &str| -> Result<usize> {
        match args.get(i) {
            None => Ok(default),
            Some(s) => match s.parse() {
                Ok(n) if n > 0 => Ok(n),
                _ => bail!("{name} must be a positive integer, got {s:?}"),
            },
        }
    };
    let rounds = number(3, 6, "ROUNDS")?;
    let tokens = number(4, 64, "TOKENS")?;
    let threads = number(5, 2, "THREADS")?;
    specula::parallel::set_threads(threads).map_err(anyhow::Error::msg)?;
    let text = std::fs::read_to_string(&args[2]).with_context(|| format!("reading {}", args[2]))?;
    let mut prompts = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not JSON", args[2], i + 1))?;
        let Some(p) = v["prompt"].as_str() else {
            bail!("{} line {}: no \"prompt\" string", args[2], i + 1);
        };
        prompts.push(p.to_string());
    }
    if prompts.is_empty() {
        bail!("{} has no prompts", args[2]);
    }
    let path = Path::new(&args[1]);
    let library = load_gguf(path, "library").with_context(|| format!("loading {}", args[1]))?;
    let addr = start(load_gguf(path, "server")?);
    // Warm both paths once.
    via_library(&library, &prompts[0], 8);
    via_server(addr, &prompts[0], 8);
    let mut ratios = Vec::new();
    println!(
        "round  library s  server s  server/library  (all {} prompts, {tokens} tokens each)",
        prompts.len()
    );
    for round in 0..rounds {
        let (mut lib, mut srv) = (0.0, 0.0);
        // A-B-B-A over the prompts: each prompt both ways, the order alternating.
        for (i, p) in prompts.iter().enumerate() {
            let lib_first = (round + i) % 2 == 0;
            let mut run = |server: bool| {
                let (s, n) = if server {
                    via_server(addr, p, tokens)
                } else {
                    via_library(&library, p, tokens)
                };
                assert_eq!(n, tokens, "a request stopped early");
                if server {
                    srv += s;
                } else {
                    lib += s;
                }
            };
            run(!lib_first);
            run(lib_first);
        }
        ratios.push(srv / lib);
        println!("{round:>5}  {lib:>9.3}  {srv:>8.3}  {:>14.4}", srv / lib);
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    println!(
        "median server/library {median:.4} ({:+.1}%), range {:.4}-{:.4} over {rounds} rounds",
        (median - 1.0) * 100.0,
        ratios[0],
        ratios[ratios.len() - 1]
    );
    Ok(())
}
