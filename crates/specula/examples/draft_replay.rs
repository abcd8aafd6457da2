//! Replays prompt-lookup drafters against recorded greedy outputs, without running the target: which share of
//! the output each variant would have drafted and accepted, and the speedup that implies for a given
//! verify(n)/verify(1) cost curve. Recording runs the target once (plain greedy) and caches the token ids.
//!
//! `cargo run --release --example draft_replay -- MODEL PROMPTS.jsonl MAX_TOKENS CACHE.json [r2 r3 r4 r5 ...]`
//!
//! r2.. are verify(n)/verify(1) for n = 2, 3, ...: `specula bench` prints them (defaults: session-3 figures).

use specula::bench::{read_prompts, BadLines};
use specula::decode::{generate, GenerateRequest};
use specula::draft::ngram::NgramDrafter;
use specula::draft::Drafter;
use specula::profile::Profiler;
use specula::sampling::SamplingParams;

/// Prompt lookup that stops where the next token's expected gain (the chance the whole draft so far is
/// accepted) falls below what verifying one more token costs, from the verify(n) curve.
struct CostAware {
    inner: NgramDrafter,
    /// marginal[j]: verify(j + 2) - verify(j + 1), in verify(1) units.
    marginal: Vec<f64>,
    scale: f64,
}

impl Drafter for CostAware {
    fn method(&self) -> &'static str {
        "cost-aware"
    }

    fn propose(
        &mut self,
        context: &[u32],
        k: usize,
        _: &SamplingParams,
    ) -> specula::Result<specula::draft::Draft> {
        let mut tokens = Vec::new();
        let mut p = 1.0;
        for (j, c) in self.inner.candidates(context, k).iter().enumerate() {
            p *= NgramDrafter::confidence(c);
            if p < self.scale * self.marginal[j.min(self.marginal.len() - 1)] {
                break;
            }
            tokens.push(c.token);
        }
        Ok(specula::draft::Draft {
            tokens,
            distributions: None,
        })
    }
}

/// The drafter before session 4: the most recent match of the longest suffix, its continuation copied.
struct LatestMatch {
    min_n: usize,
    max_n: usize,
}

impl Drafter for LatestMatch {
    fn method(&self) -> &'static str {
        "latest-match"
    }

    fn propose(
        &mut self,
        context: &[u32],
        k: usize,
        _: &SamplingParams,
    ) -> specula::Result<specula::draft::Draft> {
        let len = context.len();
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let pattern = &context[len - n..];
            for start in (0..len - n).rev() {
                if &context[start..start + n] == pattern {
                    let follow = start + n;
                    let end = (follow + k).min(len);
                    if follow < end {
                        return Ok(specula::draft::Draft {
                            tokens: context[follow..end].to_vec(),
                            distributions: None,
                        });
                    }
                }
            }
        }
        Ok(Default::default())
    }
}

struct Recorded {
    prompt: Vec<u32>,
    output: Vec<u32>,
}

fn record(
    model: &str,
    prompts: &str,
    max_tokens: usize,
    cache: &str,
) -> Result<Vec<Recorded>, Box<dyn std::error::Error>> {
    if let Ok(text) = std::fs::read_to_string(cache) {
        let v: Vec<(Vec<u32>, Vec<u32>)> = serde_json::from_str(&text)?;
        return Ok(v
            .into_iter()
            .map(|(prompt, output)| Recorded { prompt, output })
            .collect());
    }
    let loaded = specula::load_model(model, false, &mut |l| eprintln!("{l}"))?;
    let (prompts, _) = read_prompts(std::path::Path::new(prompts), BadLines::Stop)?;
    let mut out = Vec::new();
    for p in prompts {
        let text = loaded.format_prompt(&p.prompt, false, None)?;
        let prompt = loaded.tokenizer.encode(&text)?;
        let req = GenerateRequest {
            prompt_tokens: prompt.clone(),
            max_new_tokens: max_tokens,
            sampling: SamplingParams::default(),
            stop_at_eos: false,
        };
        let o = generate(
            &loaded.model,
            &loaded.tokenizer,
            &req,
            None,
            &Profiler::disabled(),
            &mut |_| {},
        )?;
        eprintln!("{}: {} tokens", p.id, o.tokens.len());
        out.push(Recorded {
            prompt,
            output: o.tokens,
        });
    }
    let v: Vec<(&Vec<u32>, &Vec<u32>)> = out.iter().map(|r| (&r.prompt, &r.output)).collect();
    std::fs::write(cache, serde_json::to_string(&v)?)?;
    Ok(out)
}

/// Replays one drafter over every recording: cycles, drafted, accepted, and cost in verify(1) units.
fn replay(
    recs: &[Recorded],
    drafter: &mut dyn Drafter,
    k: usize,
    ratio: &dyn Fn(usize) -> f64,
) -> (usize, usize, usize, usize, f64) {
    let (mut cycles, mut drafted, mut accepted, mut tokens, mut cost) = (0, 0, 0, 0, 0.0);
    for r in recs {
        // The first output token comes from prefill; decode cycles start with it pending.
        let mut pos = 1;
        while pos < r.output.len() {
            let mut context = r.prompt.clone();
            context.extend_from_slice(&r.output[..pos]);
            let draft = drafter
                .propose(&context, k, &SamplingParams::default())
                .unwrap();
            let n = draft.tokens.len().min(k);
            let acc = draft.tokens[..n]
                .iter()
                .zip(&r.output[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            let produced = (acc + 1).min(r.output.len() - pos);
            cycles += 1;
            drafted += n;
            accepted += acc;
            tokens += produced;
            cost += ratio(n + 1);
            // The replay's verify costs stand in for measured times (only ratios matter).
            drafter.observe_verify(n + 1, ratio(n + 1));
            pos += produced;
        }
    }
    (cycles, drafted, accepted, tokens, cost)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let recs = record(&args[1], &args[2], args[3].parse()?, &args[4])?;
    let mut ratios: Vec<f64> = args[5..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    if ratios.is_empty() {
        ratios = vec![1.21, 1.47, 1.70, 1.87, 2.05, 2.25, 2.45, 2.65];
    }
    let ratio = move |n: usize| {
        if n <= 1 {
            1.0
        } else {
            ratios[(n - 2).min(ratios.len() - 1)]
        }
    };
    // Calibration: acceptance of each candidate whose predecessors were all accepted, by match length and
    // by how consistently the n-gram was followed by the candidate.
    let mut buckets: std::collections::BTreeMap<(usize, u32), (usize, usize)> = Default::default();
    for r in &recs {
        let mut d = NgramDrafter::with_confidence(1, 4, 0.0)?;
        for pos in 1..r.output.len() {
            let mut context = r.prompt.clone();
            context.extend_from_slice(&r.output[..pos]);
            for (i, c) in d.candidates(&context, 6).iter().enumerate() {
                let Some(&truth) = r.output.get(pos + i) else {
                    break;
                };
                let consistency = (10.0 * (c.count as f64 + 1.0) / (c.total as f64 + 2.0)) as u32;
                let run = match c.run {
                    0..=4 => c.run,
                    5..=7 => 5,
                    8..=15 => 8,
                    _ => 16,
                };
                let b = buckets.entry((run, consistency)).or_default();
                b.0 += 1;
                b.1 += usize::from(c.token == truth);
                if c.token != truth {
                    break;
                }
            }
        }
    }
    println!("run  consistency(x10)  candidates  accepted  rate");
    for ((n, cons), (seen, acc)) in &buckets {
        println!(
            "{n}  {cons:16}  {seen:10}  {acc:8}  {:.2}",
            *acc as f64 / *seen as f64
        );
    }
    println!("variant              k  cycles drafted accepted  acc.rate tokens/cycle  speedup");
    let conf: Vec<f64> = std::env::var("CONF")
        .unwrap_or("0.0,0.2,0.3,0.4,0.5".into())
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    for k in [1, 2, 3, 4, 6, 8, 12] {
        let mut d = LatestMatch { min_n: 2, max_n: 3 };
        let (cycles, drafted, accepted, tokens, cost) = replay(&recs, &mut d, k, &ratio);
        println!(
            "latest 2-3 conf -     {k}  {cycles:6} {drafted:7} {accepted:8}  {:8.3} {:12.3}  {:7.3}",
            accepted as f64 / drafted.max(1) as f64,
            tokens as f64 / cycles as f64,
            tokens as f64 / cost
        );
    }
    // Ceiling for any stopping rule over these candidates: an oracle that drafts exactly the candidates the
    // target will accept (and nothing when the first is wrong).
    for k in [1, 2, 4, 8] {
        let mut d = NgramDrafter::with_confidence(1, 4, 0.0)?;
        let (mut cycles, mut accepted, mut tokens, mut cost) = (0, 0, 0, 0.0);
        for r in &recs {
            let mut pos = 1;
            while pos < r.output.len() {
                let mut context = r.prompt.clone();
                context.extend_from_slice(&r.output[..pos]);
                let acc = d
                    .candidates(&context, k)
                    .iter()
                    .zip(&r.output[pos..])
                    .take_while(|(c, t)| c.token == **t)
                    .count();
                let produced = (acc + 1).min(r.output.len() - pos);
                cycles += 1;
                accepted += acc;
                tokens += produced;
                cost += ratio(acc + 1);
                pos += produced;
            }
        }
        println!(
            "oracle 1-4 conf -     {k}  {cycles:6} {accepted:7} {accepted:8}  {:8.3} {:12.3}  {:7.3}",
            1.0,
            tokens as f64 / cycles as f64,
            tokens as f64 / cost
        );
    }
    let marginal: Vec<f64> = match std::env::var("MARGINAL") {
        Ok(v) => vec![v.parse()?; 11],
        Err(_) => (1..12).map(|n| ratio(n + 1) - ratio(n)).collect(),
    };
    for k in [2, 4, 8] {
        let mut d = NgramDrafter::new(1, 4)?;
        let (cycles, drafted, accepted, tokens, cost) = replay(&recs, &mut d, k, &ratio);
        println!(
            "default 1-4 conf -    {k}  {cycles:6} {drafted:7} {accepted:8}  {:8.3} {:12.3}  {:7.3}",
            accepted as f64 / drafted.max(1) as f64,
            tokens as f64 / cycles as f64,
            tokens as f64 / cost
        );
    }
    for scale in [1.0, 1.5, 2.0] {
        for k in [2, 4, 8] {
            let mut d = CostAware {
                inner: NgramDrafter::with_confidence(1, 4, 0.0)?,
                marginal: marginal.clone(),
                scale,
            };
            let (cycles, drafted, accepted, tokens, cost) = replay(&recs, &mut d, k, &ratio);
            println!(
                "costaw 1-4 conf {scale:.2}  {k}  {cycles:6} {drafted:7} {accepted:8}  {:8.3} {:12.3}  {:7.3}",
                accepted as f64 / drafted.max(1) as f64,
                tokens as f64 / cycles as f64,
                tokens as f64 / cost
            );
        }
    }
    for (min_n, max_n) in [(1, 4), (2, 4)] {
        for &mc in &conf {
            for k in [1, 2, 3, 4, 6, 8, 12] {
                let mut d = NgramDrafter::with_confidence(min_n, max_n, mc)?;
                let (cycles, drafted, accepted, tokens, cost) = replay(&recs, &mut d, k, &ratio);
                println!(
                    "ngram {min_n}-{max_n} conf {mc:.2}  {k}  {cycles:6} {drafted:7} {accepted:8}  {:8.3} {:12.3}  {:7.3}",
                    accepted as f64 / drafted.max(1) as f64,
                    tokens as f64 / cycles as f64,
                    tokens as f64 / cost
                );
            }
        }
    }
    Ok(())
}
