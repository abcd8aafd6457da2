//! Replays prompt-lookup drafters against recorded greedy outputs, without running the target: which share of
//! the output each variant would have drafted and accepted, and the speedup that implies for a given
//! verify(n)/verify(1) cost curve. Recording runs the target once (plain greedy) and caches the token ids.
//!
//! `cargo run --release --example draft_replay -- MODEL PROMPTS.jsonl MAX_TOKENS CACHE.json [r2 r3 r4 r5 ...]`
//!
//! r2.. are verify(n)/verify(1) for n = 2, 3, ...: `specula bench` prints them (defaults: session-3 figures).
//! `draft_replay confidence MODEL PROMPTS MAX_TOKENS CACHE` calibrates against the target's probabilities,
//! `draft_replay siblings ...` measures how often the second and third candidates are right when the first is
//! wrong (the case for token trees), and `draft_replay misses ...` prints confident candidates with their context.

use specula::bench::{read_prompts, BadLines};
use specula::decode::{generate, GenerateRequest};
use specula::draft::ngram::NgramDrafter;
use specula::draft::Drafter;
use specula::profile::Profiler;
use specula::sampling::SamplingParams;

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
                            parents: None,
                            passes: 0,
                            catching_up: false,
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
            cancel: None,
            logprobs: None,
            logit_adjustments: None,
            stop_token_ids: Vec::new(),
        };
        let o = generate(
            loaded.model.as_ref(),
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

/// Totals of one replay.
#[derive(Default)]
struct Totals {
    cycles: usize,
    drafted: usize,
    accepted: usize,
    tokens: usize,
    /// Verify time in verify(1) units.
    cost: f64,
}

impl Totals {
    fn print(&self, variant: &str, k: usize) {
        println!(
            "{variant:24} {k:2}  {:6} {:7} {:8}  {:8.3} {:12.3}  {:7.3}",
            self.cycles,
            self.drafted,
            self.accepted,
            self.accepted as f64 / self.drafted.max(1) as f64,
            self.tokens as f64 / self.cycles as f64,
            self.tokens as f64 / self.cost
        );
    }
}

/// Replays a drafter over every recording (a fresh one per recording, as each generation gets): the drafter
/// sees each cycle's verify time as `ratio(n)` times a pseudo-random factor in 1 +- `noise`, like measured times.
fn replay(
    recs: &[Recorded],
    make: &dyn Fn() -> Box<dyn Drafter>,
    k: usize,
    ratio: &dyn Fn(usize) -> f64,
    noise: f64,
) -> Totals {
    let mut t = Totals::default();
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    for r in recs {
        let mut drafter = make();
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
            t.cycles += 1;
            t.drafted += n;
            t.accepted += acc;
            t.tokens += produced;
            t.cost += ratio(n + 1);
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let jitter = 1.0 + noise * ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0);
            drafter.observe_verify(n + 1, ratio(n + 1) * jitter);
            pos += produced;
        }
    }
    t
}

/// Acceptance of each candidate whose predecessors were all accepted, by the length of the copy it continues
/// and by how consistently its n-gram was followed by it (10 x (count + 1) / (total + 2)).
fn calibration(recs: &[Recorded]) -> Result<(), Box<dyn std::error::Error>> {
    let mut buckets: std::collections::BTreeMap<(usize, u32), (usize, usize)> = Default::default();
    for r in recs {
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
            "{n:3}  {cons:16}  {seen:10}  {acc:8}  {:.2}",
            *acc as f64 / *seen as f64
        );
    }
    Ok(())
}

/// A greedy output with the target's probability of each output token: `(prompt, output, probs)`.
type WithConfidence = (Vec<u32>, Vec<u32>, Vec<f32>);

/// Greedy outputs with the target's probability of each output token (for calibrating on target
/// confidence).
fn record_confidence(
    model: &str,
    prompts: &str,
    max_tokens: usize,
    cache: &str,
) -> Result<Vec<WithConfidence>, Box<dyn std::error::Error>> {
    if let Ok(text) = std::fs::read_to_string(cache) {
        return Ok(serde_json::from_str(&text)?);
    }
    let loaded = specula::load_model(model, false, &mut |l| eprintln!("{l}"))?;
    let (prompts, _) = read_prompts(std::path::Path::new(prompts), BadLines::Stop)?;
    let last = specula::model::LogitsFor::Last;
    let mut out = Vec::new();
    for p in prompts {
        let text = loaded.format_prompt(&p.prompt, false, None)?;
        let prompt = loaded.tokenizer.encode(&text)?;
        let model = loaded.model.as_ref();
        let mut cache = specula::testing::full_cache(model);
        let mut logits = specula::testing::forward_host(model, &prompt, cache.as_mut(), last);
        let (mut output, mut probs) = (Vec::new(), Vec::new());
        while output.len() < max_tokens {
            let mut row = logits.last().to_vec();
            let (best, _) = row
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |a, (i, &v)| if v > a.1 { (i, v) } else { a },
                );
            specula::backend::cpu::ops::softmax(&mut row);
            output.push(best as u32);
            probs.push(row[best]);
            logits = specula::testing::forward_host(model, &[best as u32], cache.as_mut(), last);
        }
        eprintln!("{}: {} tokens", p.id, output.len());
        out.push((prompt, output, probs));
    }
    std::fs::write(cache, serde_json::to_string(&out)?)?;
    Ok(out)
}

/// Acceptance of candidates (predecessors accepted) by copy length and by the target's probability of the pending
/// token (the last one it produced).
fn calibration_by_confidence(recs: &[WithConfidence]) -> Result<(), Box<dyn std::error::Error>> {
    let mut buckets: std::collections::BTreeMap<(usize, u32), (usize, usize)> = Default::default();
    for (prompt, output, probs) in recs {
        let mut d = NgramDrafter::with_confidence(1, 4, 0.0)?;
        for pos in 1..output.len() {
            let mut context = prompt.clone();
            context.extend_from_slice(&output[..pos]);
            let p_bucket = (probs[pos - 1] * 10.0).min(9.0) as u32;
            for (i, c) in d.candidates(&context, 6).iter().enumerate() {
                let Some(&truth) = output.get(pos + i) else {
                    break;
                };
                let run = match c.run {
                    0..=2 => c.run,
                    3..=7 => 3,
                    _ => 8,
                };
                let b = buckets.entry((run, p_bucket)).or_default();
                b.0 += 1;
                b.1 += usize::from(c.token == truth);
                if c.token != truth {
                    break;
                }
            }
        }
    }
    println!("run  p(pending)x10  candidates  accepted  rate");
    for ((n, p), (seen, acc)) in &buckets {
        println!(
            "{n:3}  {p:13}  {seen:10}  {acc:8}  {:.2}",
            *acc as f64 / *seen as f64
        );
    }
    Ok(())
}

/// How often the second and third most likely candidates are right when the first is wrong, by the first's
/// confidence: the case for verifying sibling candidates (a token tree) instead of one chain.
fn siblings(recs: &[Recorded]) -> Result<(), Box<dyn std::error::Error>> {
    let mut buckets = [[0usize; 5]; 10];
    for r in recs {
        let mut d = NgramDrafter::with_confidence(1, 4, 0.0)?;
        for pos in 1..r.output.len() {
            let mut context = r.prompt.clone();
            context.extend_from_slice(&r.output[..pos]);
            let alts = d.alternatives(&context, 3);
            let Some(first) = alts.first() else { continue };
            let truth = r.output[pos];
            let b = &mut buckets[((NgramDrafter::confidence(first) * 10.0) as usize).min(9)];
            b[0] += 1;
            b[1] += usize::from(first.token == truth);
            b[2] += usize::from(alts.get(1).is_some_and(|c| c.token == truth));
            b[3] += usize::from(alts.get(2).is_some_and(|c| c.token == truth));
            b[4] += usize::from(alts.len() > 1);
        }
    }
    println!("conf(first)  positions  first  second  third  with a second");
    for (i, b) in buckets.iter().enumerate() {
        let f = |v: usize| v as f64 / b[0].max(1) as f64;
        println!(
            "0.{i}          {:9}  {:5.2}  {:6.2}  {:5.2}  {:5.2}",
            b[0],
            f(b[1]),
            f(b[2]),
            f(b[3]),
            f(b[4])
        );
    }
    Ok(())
}

/// Prints drafted candidates (first draft position, confidence >= 0.5) with their context, to see what the
/// rejected ones have in common.
fn misses(model: &str, recs: &[Recorded]) -> Result<(), Box<dyn std::error::Error>> {
    let loaded = specula::load_model(model, false, &mut |_| {})?;
    let tk = &loaded.tokenizer;
    let show = |ids: &[u32]| format!("{:?}", tk.decode(ids).unwrap_or_default());
    for r in recs {
        let mut d = NgramDrafter::with_confidence(1, 4, 0.0)?;
        for pos in 1..r.output.len() {
            let mut context = r.prompt.clone();
            context.extend_from_slice(&r.output[..pos]);
            let Some(c) = d.candidates(&context, 1).first().copied() else {
                continue;
            };
            let conf = NgramDrafter::confidence(&c);
            if conf < 0.5 {
                continue;
            }
            let ok = c.token == r.output[pos];
            println!(
                "{} conf {conf:.2} run {:2} {}/{}  ...{} -> {} (truth {})",
                if ok { "ACC" } else { "REJ" },
                c.run,
                c.count,
                c.total,
                show(&context[context.len().saturating_sub(6)..]),
                show(&[c.token]),
                show(&[r.output[pos]])
            );
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("misses") {
        let recs = record(&args[2], &args[3], args[4].parse()?, &args[5])?;
        return misses(&args[2], &recs);
    }
    if args.get(1).map(String::as_str) == Some("siblings") {
        let recs = record(&args[2], &args[3], args[4].parse()?, &args[5])?;
        return siblings(&recs);
    }
    if args.get(1).map(String::as_str) == Some("confidence") {
        let recs = record_confidence(&args[2], &args[3], args[4].parse()?, &args[5])?;
        return calibration_by_confidence(&recs);
    }
    if args.len() < 5 {
        return Err(
            "usage: draft_replay MODEL PROMPTS.jsonl MAX_TOKENS CACHE.json [r2 r3 ...]".into(),
        );
    }
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
    let noise: f64 = std::env::var("NOISE").map_or(Ok(0.1), |v| v.parse())?;
    calibration(&recs)?;
    println!(
        "variant                   k  cycles drafted accepted  acc.rate tokens/cycle  speedup"
    );
    let ks = [1, 2, 4, 8];
    for k in ks {
        replay(
            &recs,
            &|| Box::new(LatestMatch { min_n: 2, max_n: 3 }),
            k,
            &ratio,
            noise,
        )
        .print("latest match 2-3", k);
    }
    // Ceiling for any stopping rule over these candidates: an oracle that drafts exactly the candidates the
    // target will accept (and nothing when the first is wrong).
    for k in ks {
        let mut t = Totals::default();
        for r in &recs {
            let mut d = NgramDrafter::with_confidence(1, 4, 0.0)?;
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
                t.cycles += 1;
                t.drafted += acc;
                t.accepted += acc;
                t.tokens += produced;
                t.cost += ratio(acc + 1);
                pos += produced;
            }
        }
        t.print("oracle stopping 1-4", k);
    }
    for k in ks {
        replay(
            &recs,
            &|| Box::new(NgramDrafter::cost_aware(1, 4).unwrap()),
            k,
            &ratio,
            noise,
        )
        .print("cost-aware 1-4", k);
    }
    let confidences: Vec<f64> = std::env::var("CONF")
        .unwrap_or("0,0.3,0.4,0.5".into())
        .split(',')
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    for c in confidences {
        for k in ks {
            replay(
                &recs,
                &|| Box::new(NgramDrafter::with_confidence(1, 4, c).unwrap()),
                k,
                &ratio,
                noise,
            )
            .print(&format!("confidence {c} 1-4"), k);
        }
    }
    Ok(())
}
