//! `specula bench-serve`: a load generator for OpenAI-compatible servers (specula's own, or llama.cpp's
//! llama-server, vLLM, SGLang by URL), like vLLM's benchmark_serving: the same prompts at several concurrency
//! levels, streaming, with throughput and TTFT / inter-token / end-to-end latency percentiles per level.
//!
//! Besides the level's throughput (its tokens over its wall time), the throughput while every client had a
//! request in flight: a level of N requests ends with a drain, its last requests running beside fewer and fewer
//! others, and a server whose requests finish at different times (speculation) spends longer there than one
//! whose requests run in lock step. With few requests a level the drain can be a sixth of it (an H200, 32
//! requests at 8 streams: 166 of 974 ms), so the level's throughput says more about the benchmark than the
//! server; the steady figure is what a server under constant load delivers.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct BenchServeArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Prompts file: JSON Lines, one {"prompt": "..."} per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Use only the first N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Concurrency levels to run, comma separated (requests in flight at once).
    #[arg(long, default_value = "1,4", value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Requests per level (default: one per prompt).
    #[arg(long)]
    pub requests: Option<usize>,
    /// max_tokens of every request.
    #[arg(long, short = 'n', default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature sent with every request.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Ask the server to generate past end-of-turn tokens (vLLM's `ignore_eos`, which specula serve and
    /// llama-server accept): every request then produces max_tokens tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Send prompts to /v1/completions as they are instead of /v1/chat/completions as user messages.
    #[arg(long)]
    pub raw: bool,
    /// The model name to send (default: the first of the server's /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long)]
    pub api_key: Option<String>,
    /// Write every level's results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// No progress line.
    #[arg(long)]
    pub quiet: bool,
}

/// What one streamed request measured.
#[derive(Debug, Clone, Default)]
struct Sample {
    ttft_s: f64,
    e2e_s: f64,
    /// Gaps between consecutive text chunks.
    itl_s: Vec<f64>,
    output_tokens: usize,
    /// When it was sent and when each text chunk arrived (seconds since the level began), and each chunk's
    /// length in characters (a chunk may carry several tokens: its share of the request's tokens is estimated
    /// by its share of the text).
    sent_s: f64,
    chunk_s: Vec<f64>,
    chunk_chars: Vec<usize>,
    /// From the final usage chunk, when the server sends one: prompt tokens, and those it took from a prefix
    /// cache (OpenAI's `prompt_tokens_details.cached_tokens`).
    prompt_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    error: Option<String>,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Output tokens per second while all `clients` had a request in flight: from the moment the last of the first
/// `clients` requests was sent to the moment the level's last request was sent (each client sends its next
/// request as soon as one returns, so every client is busy in between). None when that window is empty (no
/// more requests than clients) or holds no text.
fn steady_tokens_per_s(samples: &[&Sample], clients: usize) -> Option<f64> {
    let mut sent: Vec<f64> = samples.iter().map(|s| s.sent_s).collect();
    sent.sort_by(f64::total_cmp);
    if sent.len() <= clients || clients == 0 {
        return None;
    }
    let (from, to) = (sent[clients - 1], sent[sent.len() - 1]);
    if to <= from {
        return None;
    }
    let mut tokens = 0.0;
    for s in samples {
        let chars: usize = s.chunk_chars.iter().sum();
        if chars == 0 {
            continue;
        }
        let per_char = s.output_tokens as f64 / chars as f64;
        for (&at, &n) in s.chunk_s.iter().zip(&s.chunk_chars) {
            if at >= from && at < to {
                tokens += n as f64 * per_char;
            }
        }
    }
    (tokens > 0.0).then(|| tokens / (to - from))
}

fn request(args: &BenchServeArgs, model: &str, prompt: &str, level_start: Instant) -> Sample {
    let (path, mut body) = if args.raw {
        (
            "/v1/completions",
            json!({"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                   "temperature": args.temperature, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
    } else {
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
    };
    if args.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    let start = Instant::now();
    let sent_s = (start - level_start).as_secs_f64();
    let mut req = ureq::post(&format!("{}{path}", args.url.trim_end_matches('/')))
        .set("Content-Type", "application/json");
    if let Some(k) = &args.api_key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    let resp = match req.send_string(&body.to_string()) {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            return Sample {
                error: Some(format!(
                    "HTTP {code}: {}",
                    r.into_string().unwrap_or_default()
                )),
                ..Default::default()
            }
        }
        Err(e) => {
            return Sample {
                error: Some(e.to_string()),
                ..Default::default()
            }
        }
    };
    let mut sample = Sample {
        sent_s,
        ..Default::default()
    };
    let mut last: Option<Instant> = None;
    let mut chunks = 0;
    let mut usage_tokens = None;
    for line in BufReader::new(resp.into_reader()).lines() {
        let Ok(line) = line else { break };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data.trim() == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            usage_tokens = Some(n as usize);
        }
        if let Some(n) = v["usage"]["prompt_tokens"].as_u64() {
            sample.prompt_tokens = Some(n as usize);
        }
        if let Some(n) = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
            sample.cached_tokens = Some(n as usize);
        }
        let c = &v["choices"][0];
        let text = if args.raw {
            &c["text"]
        } else {
            &c["delta"]["content"]
        };
        if let Some(t) = text.as_str().filter(|t| !t.is_empty()) {
            let now = Instant::now();
            sample.chunk_s.push((now - level_start).as_secs_f64());
            sample.chunk_chars.push(t.chars().count());
            match last {
                None => sample.ttft_s = (now - start).as_secs_f64(),
                Some(t) => sample.itl_s.push((now - t).as_secs_f64()),
            }
            last = Some(now);
            chunks += 1;
        }
    }
    sample.e2e_s = start.elapsed().as_secs_f64();
    sample.output_tokens = usage_tokens.unwrap_or(chunks);
    sample
}

pub fn run(args: BenchServeArgs) -> anyhow::Result<()> {
    if args.concurrency.iter().any(|&c| c == 0 || c > 1024) {
        anyhow::bail!("--concurrency levels must be between 1 and 1024");
    }
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    let (mut prompts, warnings) =
        specula::bench::read_prompts(&args.prompts, specula::bench::BadLines::Stop)?;
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    if let Some(l) = args.limit {
        prompts.truncate(l.max(1));
    }
    if prompts.is_empty() {
        anyhow::bail!("{} holds no prompts", args.prompts.display());
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let mut req = ureq::get(&format!("{}/v1/models", args.url.trim_end_matches('/')));
            if let Some(k) = &args.api_key {
                req = req.set("Authorization", &format!("Bearer {k}"));
            }
            let v: Value = req
                .call()
                .with_context(|| format!("asking {} for its models", args.url))?
                .into_json()?;
            v["data"][0]["id"]
                .as_str()
                .map(String::from)
                .ok_or_else(|| anyhow::anyhow!("{}/v1/models lists no model", args.url))?
        }
    };
    let n = args.requests.unwrap_or(prompts.len()).max(1);
    let show = !args.quiet && std::io::stderr().is_terminal();
    eprintln!(
        "bench-serve: {} ({model}), {n} requests per level, max_tokens {}, levels {:?}",
        args.url, args.max_tokens, args.concurrency
    );
    println!(
        "{:>5} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>12}",
        "conc",
        "req/s",
        "out tok/s",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99",
        "e2e p50",
        "e2e p99",
        "errors",
        "cached",
        "steady tok/s"
    );
    let prompts = Arc::new(prompts);
    let mut levels = Vec::new();
    for &c in &args.concurrency {
        let next = Arc::new(AtomicUsize::new(0));
        let samples = Arc::new(Mutex::new(Vec::with_capacity(n)));
        let start = Instant::now();
        std::thread::scope(|scope| {
            for _ in 0..c {
                let (next, samples, prompts, model, args) =
                    (&next, &samples, &prompts, &model, &args);
                scope.spawn(move || loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let s = request(args, model, &prompts[i % prompts.len()].prompt, start);
                    let mut all = samples.lock().expect("samples");
                    all.push(s);
                    if show {
                        eprint!("\rconcurrency {c}: {}/{n} requests", all.len());
                        let _ = std::io::stderr().flush();
                    }
                });
            }
        });
        let wall = start.elapsed().as_secs_f64();
        if show {
            eprint!("\r{:60}\r", "");
        }
        let samples = std::mem::take(&mut *samples.lock().expect("samples"));
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
        let errors: Vec<&String> = samples.iter().filter_map(|s| s.error.as_ref()).collect();
        let sorted = |f: &dyn Fn(&Sample) -> Vec<f64>| {
            let mut v: Vec<f64> = ok.iter().flat_map(|s| f(s)).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let ttft = sorted(&|s| vec![s.ttft_s]);
        let itl = sorted(&|s| s.itl_s.clone());
        let e2e = sorted(&|s| vec![s.e2e_s]);
        let out_tokens: usize = ok.iter().map(|s| s.output_tokens).sum();
        // Prompt tokens the server reported taking from its prefix cache (None: it reports no such thing).
        let prompt_tokens: usize = ok.iter().filter_map(|s| s.prompt_tokens).sum();
        let cached: Option<usize> = ok
            .iter()
            .any(|s| s.cached_tokens.is_some())
            .then(|| ok.iter().filter_map(|s| s.cached_tokens).sum());
        let level = json!({
            "concurrency": c,
            "requests": samples.len(),
            "completed": ok.len(),
            "errors": errors.len(),
            "first_error": errors.first(),
            "wall_s": wall,
            "requests_per_s": ok.len() as f64 / wall,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens as f64 / wall,
            "steady_output_tok_s": steady_tokens_per_s(&ok, c),
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": cached,
            "ttft_s": {"p50": percentile(&ttft, 0.5), "p90": percentile(&ttft, 0.9), "p99": percentile(&ttft, 0.99)},
            "itl_s": {"p50": percentile(&itl, 0.5), "p90": percentile(&itl, 0.9), "p99": percentile(&itl, 0.99)},
            "e2e_s": {"p50": percentile(&e2e, 0.5), "p90": percentile(&e2e, 0.9), "p99": percentile(&e2e, 0.99)},
        });
        let ms = |v: &Value| v.as_f64().unwrap_or(0.0) * 1e3;
        println!(
            "{:>5} {:>8.2} {:>10.1} {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.0}ms {:>7.0}ms {:>7} {:>7} {:>12}",
            c,
            level["requests_per_s"].as_f64().unwrap_or(0.0),
            level["output_tok_s"].as_f64().unwrap_or(0.0),
            ms(&level["ttft_s"]["p50"]),
            ms(&level["ttft_s"]["p99"]),
            ms(&level["itl_s"]["p50"]),
            ms(&level["itl_s"]["p99"]),
            ms(&level["e2e_s"]["p50"]),
            ms(&level["e2e_s"]["p99"]),
            errors.len(),
            match cached {
                Some(c) if prompt_tokens > 0 => format!("{:.0}%", 100.0 * c as f64 / prompt_tokens as f64),
                _ => "-".into(),
            },
            level["steady_output_tok_s"]
                .as_f64()
                .map_or("-".into(), |v| format!("{v:.1}"))
        );
        if let Some(e) = errors.first() {
            eprintln!(
                "concurrency {c}: {} requests failed; the first: {e}",
                errors.len()
            );
        }
        levels.push(level);
    }
    if let Some(path) = &args.json {
        crate::generate::write_json(
            path,
            &json!({"url": args.url, "model": model, "max_tokens": args.max_tokens, "levels": levels}),
        )?;
        eprintln!("results: {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(sent_s: f64, tokens: usize, chunks: &[(f64, usize)]) -> Sample {
        Sample {
            sent_s,
            output_tokens: tokens,
            chunk_s: chunks.iter().map(|c| c.0).collect(),
            chunk_chars: chunks.iter().map(|c| c.1).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn steady_throughput_counts_only_while_every_client_is_busy() {
        // Two clients, three requests: both busy from 0.0 (the second request's send) until 1.0 (the third's).
        let a = sample(0.0, 10, &[(0.2, 5), (0.6, 5)]); // 10 tokens inside the window
        let b = sample(0.0, 20, &[(0.5, 10), (1.5, 10)]); // 10 of its 20 inside
        let c = sample(1.0, 8, &[(1.2, 2), (1.4, 2)]); // after the last send: the drain
        let v = steady_tokens_per_s(&[&a, &b, &c], 2).unwrap();
        assert!((v - 20.0).abs() < 1e-9, "{v}");
        // A chunk of several tokens counts by its share of the request's text.
        let d = sample(0.0, 9, &[(0.5, 2), (2.0, 1)]); // 6 tokens in the window, 3 after
        let v = steady_tokens_per_s(&[&a, &d, &c], 2).unwrap();
        assert!((v - 16.0).abs() < 1e-9, "{v}");
        // No more requests than clients: no window where all were busy before the last was sent.
        assert_eq!(steady_tokens_per_s(&[&a, &b], 2), None);
        assert_eq!(steady_tokens_per_s(&[&a, &b, &c], 0), None);
    }
}
