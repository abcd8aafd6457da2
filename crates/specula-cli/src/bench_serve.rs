//! `specula bench-serve`: a load generator for OpenAI-compatible servers (specula's own, or llama.cpp's
//! llama-server, vLLM, SGLang by URL), like vLLM's benchmark_serving: the same prompts at several concurrency
//! levels (closed loop: N clients, each sending its next request when one returns) or request rates (open loop:
//! requests arrive at random, Poisson by default, whatever the server has done with the earlier ones),
//! streaming, with throughput and TTFT / inter-token / end-to-end latency percentiles per level.
//!
//! Why both: in a closed loop with fixed-length requests (`--ignore-eos`) a server's requests run in lock step,
//! all finishing and being replaced at once, a pattern real traffic never has and a speculative server (whose
//! requests finish at different steps) cannot keep. Arrivals at a rate are what a public endpoint sees.
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
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};
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
    /// Request rates to run instead of concurrency levels, comma separated, in requests a second (`inf`: all at
    /// once): each level's requests arrive at random times at that mean rate (open loop, vLLM's
    /// `--request-rate`), however many are still running.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate, conflicts_with = "concurrency")]
    pub request_rate: Vec<f64>,
    /// With --request-rate: how bursty arrivals are (vLLM's `--burstiness`): the gaps between them follow a
    /// gamma distribution of this shape and the rate's mean; 1 is a Poisson process, below 1 burstier, above 1
    /// more even.
    #[arg(long, default_value_t = 1.0, requires = "request_rate")]
    pub burstiness: f64,
    /// With --request-rate: at most this many requests in flight; later arrivals wait for a slot (vLLM's
    /// `--max-concurrency`). Default: no limit but 1024.
    #[arg(long, requires = "request_rate")]
    pub max_concurrency: Option<usize>,
    /// Seed of the arrival times (the same seed, rate and burstiness give the same schedule).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
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

/// Requests in flight at most at a request rate (one thread each).
const MAX_IN_FLIGHT: usize = 1024;

/// A `--request-rate` value: requests a second, or `inf`.
fn parse_rate(text: &str) -> Result<f64, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("inf") {
        return Ok(f64::INFINITY);
    }
    match t.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        Ok(_) => Err(format!(
            "{t:?}: a request rate is a positive number of requests a second, or inf"
        )),
        Err(_) => Err(format!(
            "{t:?} is not a request rate (requests a second, or inf)"
        )),
    }
}

/// One level of load: clients sending back to back, or arrivals at a rate.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Load {
    Clients(usize),
    Rate(f64),
}

impl Load {
    fn label(self) -> String {
        match self {
            Load::Clients(c) => c.to_string(),
            Load::Rate(r) if r.is_infinite() => "inf/s".into(),
            Load::Rate(r) => format!("{r}/s"),
        }
    }
}

/// When each of `n` requests arrives at `rate` a second, in seconds from the level's start: the first at once,
/// then gaps drawn from a gamma distribution of shape `burstiness` and mean 1 / `rate` (exponential gaps, a
/// Poisson process, at 1), from `seed`; all at once at an infinite rate.
fn arrival_times(n: usize, rate: f64, burstiness: f64, seed: u64) -> Vec<f64> {
    if rate.is_infinite() {
        return vec![0.0; n];
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let scale = 1.0 / (rate * burstiness);
    let mut at = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                at += gamma(&mut rng, burstiness) * scale;
            }
            at
        })
        .collect()
}

/// [`arrival_times`], refused when its last arrival is not a time a level can wait for (a rate of 1e-300, or a
/// burstiness that makes the gaps overflow).
fn schedule(n: usize, rate: f64, burstiness: f64, seed: u64) -> anyhow::Result<Vec<f64>> {
    let arrivals = arrival_times(n, rate, burstiness, seed);
    let last = arrivals.last().copied().unwrap_or(0.0);
    if Duration::try_from_secs_f64(last).is_err() {
        anyhow::bail!(
            "--request-rate {rate:e} with --burstiness {burstiness}: {n} requests would arrive over {last:.3e} s; \
             ask for a higher rate"
        );
    }
    Ok(arrivals)
}

/// A draw from the gamma distribution of shape `shape` (> 0) and scale 1 (Marsaglia and Tsang's method; below
/// shape 1, a draw of shape + 1 times U^(1/shape)).
fn gamma(rng: &mut impl Rng, shape: f64) -> f64 {
    if shape < 1.0 {
        let u: f64 = rng.random();
        return gamma(rng, shape + 1.0) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        // A standard normal draw (Box-Muller; 1 - U keeps the logarithm finite).
        let (u1, u2): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random());
        let x = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let v = 1.0 + c * x;
        if v <= 0.0 {
            continue;
        }
        let v = v * v * v;
        let u: f64 = rng.random();
        if u < 1.0 - 0.0331 * x.powi(4) || u.ln() < 0.5 * x * x + d * (1.0 - v + v.ln()) {
            return d * v;
        }
    }
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
    if args
        .concurrency
        .iter()
        .any(|&c| c == 0 || c > MAX_IN_FLIGHT)
    {
        anyhow::bail!("--concurrency levels must be between 1 and {MAX_IN_FLIGHT}");
    }
    if !(args.burstiness.is_finite() && args.burstiness > 0.0) {
        anyhow::bail!(
            "--burstiness must be a positive number (1: Poisson arrivals), not {}",
            args.burstiness
        );
    }
    if let Some(m) = args.max_concurrency {
        if m == 0 || m > MAX_IN_FLIGHT {
            anyhow::bail!("--max-concurrency must be between 1 and {MAX_IN_FLIGHT}, not {m}");
        }
    }
    let loads: Vec<Load> = if args.request_rate.is_empty() {
        args.concurrency.iter().map(|&c| Load::Clients(c)).collect()
    } else {
        args.request_rate.iter().map(|&r| Load::Rate(r)).collect()
    };
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
    let n = args.requests.unwrap_or(prompts.len()).max(1);
    // Each rate's arrival schedule, checked before anything is sent.
    let schedules: Vec<Option<Vec<f64>>> = loads
        .iter()
        .map(|&l| match l {
            Load::Rate(rate) => schedule(n, rate, args.burstiness, args.seed).map(Some),
            Load::Clients(_) => Ok(None),
        })
        .collect::<anyhow::Result<_>>()?;
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
    let show = !args.quiet && std::io::stderr().is_terminal();
    let labels: Vec<String> = loads.iter().map(|l| l.label()).collect();
    eprintln!(
        "bench-serve: {} ({model}), {n} requests per level, max_tokens {}, levels {}{}",
        args.url,
        args.max_tokens,
        labels.join(", "),
        match (&loads[0], args.max_concurrency) {
            (Load::Rate(_), Some(m)) =>
                format!(" (burstiness {}, at most {m} in flight)", args.burstiness),
            (Load::Rate(_), None) => format!(" (burstiness {})", args.burstiness),
            _ => String::new(),
        }
    );
    println!(
        "{:>7} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>12}",
        if matches!(loads[0], Load::Rate(_)) {
            "rate"
        } else {
            "conc"
        },
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
    for (&load, arrivals) in loads.iter().zip(&schedules) {
        let label = load.label();
        let samples = Arc::new(Mutex::new(Vec::with_capacity(n)));
        let start = Instant::now();
        let keep = |s: Sample| {
            let mut all = samples.lock().expect("samples");
            all.push(s);
            if show {
                eprint!("\r{label}: {}/{n} requests", all.len());
                let _ = std::io::stderr().flush();
            }
        };
        match load {
            Load::Clients(c) => {
                let next = AtomicUsize::new(0);
                std::thread::scope(|scope| {
                    for _ in 0..c {
                        let (next, prompts, model, args, keep) =
                            (&next, &prompts, &model, &args, &keep);
                        scope.spawn(move || loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= n {
                                break;
                            }
                            keep(request(
                                args,
                                model,
                                &prompts[i % prompts.len()].prompt,
                                start,
                            ));
                        });
                    }
                });
            }
            Load::Rate(_) => {
                let arrivals = arrivals.as_deref().unwrap_or_default();
                let cap = args.max_concurrency.unwrap_or(MAX_IN_FLIGHT);
                let in_flight = (Mutex::new(0usize), std::sync::Condvar::new());
                std::thread::scope(|scope| {
                    for (i, &at) in arrivals.iter().enumerate() {
                        let due = start + Duration::from_secs_f64(at);
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                        // Past the cap an arrival waits for a slot (and is sent late, as in vLLM).
                        {
                            let mut running = in_flight.0.lock().expect("in flight");
                            while *running >= cap {
                                running = in_flight.1.wait(running).expect("in flight");
                            }
                            *running += 1;
                        }
                        let (in_flight, prompts, model, args, keep) =
                            (&in_flight, &prompts, &model, &args, &keep);
                        scope.spawn(move || {
                            keep(request(
                                args,
                                model,
                                &prompts[i % prompts.len()].prompt,
                                start,
                            ));
                            *in_flight.0.lock().expect("in flight") -= 1;
                            in_flight.1.notify_one();
                        });
                    }
                });
            }
        }
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
        let mut level = json!({
            "requests": samples.len(),
            "completed": ok.len(),
            "errors": errors.len(),
            "first_error": errors.first(),
            "wall_s": wall,
            "requests_per_s": ok.len() as f64 / wall,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens as f64 / wall,
            // At a rate: while requests were still arriving (from the first send to the last).
            "steady_output_tok_s": steady_tokens_per_s(&ok, match load {
                Load::Clients(c) => c,
                Load::Rate(_) => 1,
            }),
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": cached,
            "ttft_s": {"p50": percentile(&ttft, 0.5), "p90": percentile(&ttft, 0.9), "p99": percentile(&ttft, 0.99)},
            "itl_s": {"p50": percentile(&itl, 0.5), "p90": percentile(&itl, 0.9), "p99": percentile(&itl, 0.99)},
            "e2e_s": {"p50": percentile(&e2e, 0.5), "p90": percentile(&e2e, 0.9), "p99": percentile(&e2e, 0.99)},
        });
        match load {
            Load::Clients(c) => level["concurrency"] = json!(c),
            Load::Rate(r) => {
                level["request_rate"] = if r.is_infinite() {
                    json!("inf")
                } else {
                    json!(r)
                };
                level["burstiness"] = json!(args.burstiness);
                level["max_concurrency"] = json!(args.max_concurrency);
                level["seed"] = json!(args.seed);
            }
        }
        let ms = |v: &Value| v.as_f64().unwrap_or(0.0) * 1e3;
        println!(
            "{:>7} {:>8.2} {:>10.1} {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.0}ms {:>7.0}ms {:>7} {:>7} {:>12}",
            label,
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
            eprintln!("{label}: {} requests failed; the first: {e}", errors.len());
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
    fn arrivals_come_at_the_rate_asked_as_bursty_as_asked() {
        // Mean and squared coefficient of variation of the gaps (1 / shape for gamma gaps).
        let stats = |rate: f64, burstiness: f64, seed: u64| {
            let t = arrival_times(20_001, rate, burstiness, seed);
            assert_eq!(t[0], 0.0);
            assert!(t.windows(2).all(|w| w[1] >= w[0]));
            let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
            (mean, var / (mean * mean))
        };
        for (rate, burstiness) in [(4.0, 1.0), (50.0, 1.0), (4.0, 0.25), (4.0, 4.0), (0.5, 2.0)] {
            let (mean, cv2) = stats(rate, burstiness, 7);
            assert!(
                (mean * rate - 1.0).abs() < 0.05,
                "rate {rate} b {burstiness}: mean gap {mean}"
            );
            assert!(
                (cv2 * burstiness - 1.0).abs() < 0.1,
                "rate {rate} b {burstiness}: cv^2 {cv2}"
            );
        }
        // The same seed gives the same schedule, another seed another; an infinite rate sends all at once.
        assert_eq!(
            arrival_times(50, 3.0, 1.0, 1),
            arrival_times(50, 3.0, 1.0, 1)
        );
        assert_ne!(
            arrival_times(50, 3.0, 1.0, 1),
            arrival_times(50, 3.0, 1.0, 2)
        );
        assert_eq!(arrival_times(3, f64::INFINITY, 1.0, 0), vec![0.0; 3]);
    }

    #[test]
    fn request_rates_parse_or_say_what_is_wrong() {
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        assert_eq!(parse_rate(" INF "), Ok(f64::INFINITY));
        for bad in ["0", "-1", "nan", "1e999", "fast", ""] {
            let e = parse_rate(bad).unwrap_err();
            assert!(e.contains("request rate"), "{bad}: {e}");
        }
        assert_eq!(Load::Rate(2.5).label(), "2.5/s");
        assert_eq!(Load::Rate(f64::INFINITY).label(), "inf/s");
        assert_eq!(Load::Clients(8).label(), "8");
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
