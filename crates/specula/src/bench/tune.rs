//! `specula tune`: fit the speculative decoding cost model to a bench run and say which draft length wins.
//!
//! The model (the standard one from the speculative decoding literature, with each term measured here):
//!
//! ```text
//! tokens per cycle   E(k) = 1 + sum_{i=1..k} d_i * a_i
//! time per cycle     T(k) = draft(k) + verify(1 + sum_{i<=k} d_i) + overhead(k)
//! tok/s              E(k) / T(k)         plain decoding: 1 / (verify(1) + overhead_plain)
//! ```
//!
//! - `a_i`: the measured rate at which draft position i is accepted (all of 1..i accepted), pooled over every
//!   configuration that drafted position i; `d_i`: how often position i was drafted at all (1 for a draft
//!   model; below 1 for n-gram lookup, which finds no match for some cycles).
//! - `draft(k)`: a least-squares line through the measured draft ms per cycle against draft steps per cycle,
//!   `1 + sum_{i=1..k-1} d_i` (a step proposes position 1, and one more follows each drafted position before the
//!   k-th; `k` for a drafter that always drafts k, fewer for one that stops where it is unsure).
//! - `overhead(k)`: a least-squares line through the measured per-cycle overhead (accept + sample + commit +
//!   emit + other) against k.
//! - `verify(n)`: a least-squares line through the runs' own verify ms per cycle against tokens verified per
//!   cycle (plain decoding: 1; a config: 1 + its mean drafted tokens), i.e. measured at the contexts and in the
//!   minutes of the tok/s being predicted. With plain decoding alone, the separately measured verify(n) curve,
//!   shifted so that verify(1) equals plain decoding's per-step verify time, is used instead.
//!
//! A bench of several chain variants (confidence bars, draft vocabularies, heads) is modelled variant by
//! variant: each its own acceptance, draft and overhead lines, all on the one verify line (the same machine in
//! the same minutes); the winner is the variant whose best k is predicted fastest, recommended with its flags.
//!
//! EAGLE-3 trees (bench's tree shapes) are modelled with the same terms: a tree of `n` nodes verifies `1 + n`
//! rows every cycle, so its verify time is the fitted line at `1 + n`; its tokens per cycle and its draft and
//! overhead time are its own measurements (a tree's acceptance is not a chain's: every level offers several
//! candidates). Chains and trees are then ranked on one scale, and tune says which shape wins and what the
//! winner buys over the best of the other kind.
//!
//! Speculation beats plain decoding exactly when the extra tokens per cycle exceed the extra time per cycle
//! in units of a plain step: `E(k) - 1 > draft/T1 + (verify(1+d) - verify(1))/T1 + (overhead - overhead_plain)/T1`.
//! When it loses, the largest of the three cost terms is the reason, unless acceptance is so low that no cost
//! could be paid for.

use serde_json::Value;

use crate::error::{Error, Result};

/// Smallest predicted speedup over plain decoding that tune recommends speculation for, and the width of a tie
/// between draft lengths. The model matches interleaved measurements to about 1-4% on this machine
/// (docs/benchmarks.md), so a smaller predicted difference is not a reliable one.
pub const MIN_GAIN: f64 = 0.02;

/// One speculative configuration's measurements, read from a bench report.
#[derive(Debug, Clone)]
pub struct MeasuredConfig {
    pub label: String,
    /// Which chain variant (index into `TuneInput::variants`) it ran.
    pub variant: usize,
    pub k: usize,
    pub tok_s: f64,
    pub cycles: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub overhead_ms: f64,
    pub drafted_per_position: Vec<f64>,
    pub accepted_per_position: Vec<f64>,
}

/// One EAGLE-3 tree configuration's measurements, read from a bench report.
#[derive(Debug, Clone)]
pub struct MeasuredTree {
    pub label: String,
    /// SGLang's knobs: branches a node, levels, and nodes verified a cycle with the pending token.
    pub topk: usize,
    pub steps: usize,
    pub num_draft_tokens: usize,
    /// The least path probability a node kept (0: a fixed-size tree).
    pub draft_confidence: f64,
    pub tok_s: f64,
    pub cycles: f64,
    /// Tokens a cycle (the accepted path and the token after it).
    pub tokens_per_cycle: f64,
    /// Rows verified a cycle: the pending token and the drafted nodes (fewer than `num_draft_tokens` where a
    /// confidence bar pruned the tree, or a cycle drafted nothing).
    pub rows_per_cycle: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub overhead_ms: f64,
}

#[derive(Debug, Clone)]
pub struct TuneInput {
    pub method: String,
    pub plain_tok_s: f64,
    pub plain_verify_ms: f64,
    pub plain_overhead_ms: f64,
    /// Chain configurations (each drafter variant at several draft lengths); may be empty when trees ran.
    pub configs: Vec<MeasuredConfig>,
    /// The chain variants the configs ran (a bench's `--draft-confidence`, `--draft-vocab`,
    /// `--ngram-confidence` or head lists), each modelled on its own.
    pub variants: Vec<ChainVariant>,
    /// EAGLE-3 tree configurations, each its own shape.
    pub trees: Vec<MeasuredTree>,
    /// verify(n) in ms, n = 1..
    pub verify_curve_ms: Vec<f64>,
}

/// A chain drafter's settings: what tables call it, and the flags beside `--draft-tokens` that run it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ChainVariant {
    pub label: String,
    pub flags: String,
}

/// The flags that select each chain variant: a setting that differs between them, or a confidence bar that is
/// set (what was measured is what the recommendation runs).
fn variant_flags(drafters: &[&Value]) -> Vec<String> {
    const FLAGS: [(&str, &str); 6] = [
        ("draft_model", "--draft-model"),
        ("draft_vocab", "--draft-vocab"),
        ("draft_confidence", "--draft-confidence"),
        ("ngram_confidence", "--ngram-confidence"),
        ("ngram_min", "--ngram-min"),
        ("ngram_max", "--ngram-max"),
    ];
    // A head runs again by what `--draft-model` named it as (its source: a registry name or a path); reports
    // before that key was written have only the name tables show.
    let value = |d: &Value, key: &str| match (key, d.get("draft_model_source")) {
        ("draft_model", Some(source)) if !source.is_null() => source.clone(),
        _ => d.get(key).cloned().unwrap_or(Value::Null),
    };
    drafters
        .iter()
        .map(|d| {
            let mut flags = Vec::new();
            for (key, flag) in FLAGS {
                let v = value(d, key);
                let differs = drafters.iter().any(|o| value(o, key) != v);
                let bar_set = key.ends_with("confidence") && v.as_f64().is_some_and(|c| c > 0.0);
                if !(differs || bar_set) {
                    continue;
                }
                let shown = match (&v, key) {
                    (Value::Null, "draft_vocab") => "full".to_string(),
                    (Value::Null, "ngram_confidence") => "auto".to_string(),
                    (Value::Null, _) => continue,
                    (Value::String(s), _) => s.clone(),
                    (other, _) => other.to_string(),
                };
                flags.push(format!("{flag} {shown}"));
            }
            flags.join(" ")
        })
        .collect()
}

/// The columns of a chain's or a tree's predictions, after a first column `width` wide.
fn model_header(s: &mut String, first: &str, width: usize) {
    use std::fmt::Write as _;
    let _ = writeln!(
        s,
        "{first:>width$} {:>10} {:>9} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "tokens/cyc", "draft_ms", "verify_ms", "cycle_ms", "predicted", "measured", "pred/plain"
    );
}

/// One prediction row: tokens a cycle, draft / verify / cycle ms and predicted tok/s, the measurement if any, and
/// the ratio to plain decoding.
fn model_row(
    s: &mut String,
    first: &str,
    width: usize,
    [tokens, draft, verify, cycle, predicted]: [f64; 5],
    measured: Option<f64>,
    ratio: f64,
) {
    use std::fmt::Write as _;
    let measured = measured.map_or_else(|| "-".into(), |m| format!("{m:.2}"));
    let _ = writeln!(
        s,
        "{first:>width$} {tokens:>10.2} {draft:>9.1} {verify:>10.1} {cycle:>10.1} {predicted:>10.2} {measured:>12} \
         {ratio:>11.2}x"
    );
}

/// Text safe inside an SVG element.
fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A config's label without its draft length: "eagle3 chain conf>=0.3 k=5" -> "eagle3 chain conf>=0.3".
fn variant_label(label: &str) -> String {
    match label.rsplit_once(" k=") {
        Some((head, k)) if k.chars().all(|c| c.is_ascii_digit()) => head.to_string(),
        _ => label.to_string(),
    }
}

/// A finite, non-negative number (every measured quantity in a bench report is one).
fn num(v: &Value, key: &str) -> Result<f64> {
    let x = v
        .get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| Error::InvalidArgument(format!("bench report: missing number {key:?}")))?;
    if !(x.is_finite() && x >= 0.0) {
        return Err(Error::InvalidArgument(format!(
            "bench report: {key:?} is {x}; expected a finite number >= 0"
        )));
    }
    Ok(x)
}

/// A list of finite, non-negative numbers, at most `max_len` long (missing: empty).
fn num_list(v: Option<&Value>, key: &str, max_len: usize) -> Result<Vec<f64>> {
    let Some(items) = v.and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    if items.len() > max_len {
        return Err(Error::InvalidArgument(format!(
            "bench report: {key:?} has {} entries; at most {max_len} expected",
            items.len()
        )));
    }
    items
        .iter()
        .map(|item| match item.as_f64() {
            Some(x) if x.is_finite() && x >= 0.0 => Ok(x),
            _ => Err(Error::InvalidArgument(format!(
                "bench report: {key:?} holds {item}; expected finite numbers >= 0"
            ))),
        })
        .collect()
}

/// A draft length read from a report: 1..=MAX_DRAFT_TOKENS, as bench itself allows (tune sizes its per-position
/// tables by it).
fn draft_length(c: &Value) -> Result<usize> {
    let max = crate::decode::MAX_DRAFT_TOKENS;
    match c.get("k").and_then(Value::as_u64) {
        Some(k) if k >= 1 && k <= max as u64 => Ok(k as usize),
        _ => Err(Error::InvalidArgument(format!(
            "bench report: a speculative config has k = {}; expected a draft length between 1 and {max}",
            c.get("k").unwrap_or(&Value::Null)
        ))),
    }
}

impl TuneInput {
    /// Reads the JSON that `specula bench --json` writes (or `BenchReport::to_json`).
    pub fn from_bench_json(report: &Value) -> Result<Self> {
        let configs = report
            .get("configs")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::InvalidArgument("bench report: no \"configs\" list".into()))?;
        let plain = configs
            .iter()
            .find(|c| c.get("k").and_then(Value::as_u64) == Some(0))
            .ok_or_else(|| {
                Error::InvalidArgument(
                    "bench report: no plain decoding configuration (k = 0)".into(),
                )
            })?;
        let is_tree = |c: &&Value| {
            c.get("drafter")
                .and_then(|d| d.get("tree"))
                .is_some_and(Value::is_object)
        };
        let speculative = || {
            configs
                .iter()
                .filter(|c| c.get("k").and_then(Value::as_u64) != Some(0))
        };
        let mut trees = Vec::new();
        for c in speculative().filter(is_tree) {
            trees.push(measured_tree(c)?);
        }
        let mut variants: Vec<&Value> = Vec::new();
        for c in speculative().filter(|c| !is_tree(c)) {
            let d = c.get("drafter").unwrap_or(&Value::Null);
            if !variants.contains(&d) {
                variants.push(d);
            }
        }
        let max_k = crate::decode::MAX_DRAFT_TOKENS;
        let mut measured = Vec::new();
        let mut method = String::new();
        if !trees.is_empty() {
            method = "eagle3".into();
        }
        for c in speculative().filter(|c| !is_tree(c)) {
            let spec = c.get("speculation").ok_or_else(|| {
                Error::InvalidArgument(
                    "bench report: a speculative config has no \"speculation\"".into(),
                )
            })?;
            method = c
                .get("method")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
            let drafter = c.get("drafter").unwrap_or(&Value::Null);
            measured.push(MeasuredConfig {
                label: c
                    .get("label")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_string(),
                // Every chain's drafter was collected as a variant above; a report this reader cannot pair
                // up is an input error, not a panic.
                variant: variants.iter().position(|&d| d == drafter).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "bench report: a chain config's drafter {drafter} matches no variant"
                    ))
                })?,
                k: draft_length(c)?,
                tok_s: num(c, "decode_tok_s")?,
                cycles: num(c, "cycles")?,
                draft_ms: num(c, "draft_ms_per_cycle")?,
                verify_ms: num(c, "verify_ms_per_cycle")?,
                overhead_ms: num(c, "overhead_ms_per_cycle")?,
                drafted_per_position: num_list(
                    spec.get("drafted_per_position"),
                    "drafted_per_position",
                    max_k,
                )?,
                accepted_per_position: num_list(
                    spec.get("accepted_per_position"),
                    "accepted_per_position",
                    max_k,
                )?,
            });
        }
        if measured.is_empty() && trees.is_empty() {
            return Err(Error::InvalidArgument(
                "bench report has no speculative configurations to tune (run bench with a drafter)"
                    .into(),
            ));
        }
        let chain_variants: Vec<ChainVariant> = variant_flags(&variants)
            .into_iter()
            .enumerate()
            .map(|(v, flags)| ChainVariant {
                label: measured
                    .iter()
                    .find(|c| c.variant == v)
                    .map_or_else(|| method.clone(), |c| variant_label(&c.label)),
                flags,
            })
            .collect();
        measured.sort_by_key(|c| c.k);
        let verify_curve_ms = num_list(
            report.get("verify_cost").and_then(|v| v.get("ms")),
            "verify_cost.ms",
            max_k + 1,
        )?;
        if verify_curve_ms.len() < 2 {
            return Err(Error::InvalidArgument(
                "bench report has no verify-cost curve (rerun bench without --verify-repeats 0)"
                    .into(),
            ));
        }
        Ok(TuneInput {
            method,
            plain_tok_s: num(plain, "decode_tok_s")?,
            plain_verify_ms: num(plain, "verify_ms_per_cycle")?,
            plain_overhead_ms: num(plain, "overhead_ms_per_cycle")?,
            configs: measured,
            variants: chain_variants,
            trees,
            verify_curve_ms,
        })
    }
}

/// A tree configuration of a bench report: its shape (bench's `drafter.tree`), which must agree with its k.
fn measured_tree(c: &Value) -> Result<MeasuredTree> {
    let k = draft_length(c)?;
    let tree = &c["drafter"]["tree"];
    let knob = |key: &str| -> Result<usize> {
        match tree.get(key).and_then(Value::as_u64) {
            Some(v) if (1..=64).contains(&v) => Ok(v as usize),
            _ => Err(Error::InvalidArgument(format!(
                "bench report: a tree config's {key:?} is {}; expected 1..=64",
                tree.get(key).unwrap_or(&Value::Null)
            ))),
        }
    };
    let num_draft_tokens = knob("num_draft_tokens")?;
    if num_draft_tokens != k + 1 {
        return Err(Error::InvalidArgument(format!(
            "bench report: a tree of num_draft_tokens {num_draft_tokens} has k = {k}; expected k = {}",
            num_draft_tokens.saturating_sub(1)
        )));
    }
    let cycles = num(c, "cycles")?;
    let tokens = num(c, "decode_tokens")?;
    // Rows verified a cycle from the nodes drafted (a report without them: every node, every cycle).
    let rows_per_cycle = match c.get("speculation").and_then(|s| s.get("drafted")) {
        Some(_) if cycles > 0.0 => {
            (1.0 + num(&c["speculation"], "drafted")? / cycles).min(num_draft_tokens as f64)
        }
        _ => num_draft_tokens as f64,
    };
    Ok(MeasuredTree {
        label: c
            .get("label")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string(),
        topk: knob("eagle_topk")?,
        steps: knob("num_steps")?,
        num_draft_tokens,
        draft_confidence: match c["drafter"].get("draft_confidence") {
            None | Some(Value::Null) => 0.0,
            Some(_) => {
                let bar = num(&c["drafter"], "draft_confidence")?;
                if bar > 1.0 {
                    return Err(Error::InvalidArgument(format!(
                        "bench report: a tree config's draft_confidence is {bar}; expected 0..=1"
                    )));
                }
                bar
            }
        },
        tok_s: num(c, "decode_tok_s")?,
        cycles,
        tokens_per_cycle: if cycles > 0.0 { tokens / cycles } else { 0.0 },
        rows_per_cycle,
        draft_ms: num(c, "draft_ms_per_cycle")?,
        verify_ms: num(c, "verify_ms_per_cycle")?,
        overhead_ms: num(c, "overhead_ms_per_cycle")?,
    })
}

/// A fitted line y = intercept + slope * x.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Line {
    pub intercept: f64,
    pub slope: f64,
}

impl Line {
    pub fn at(&self, x: f64) -> f64 {
        self.intercept + self.slope * x
    }

    /// Least squares; through the origin's direction (slope only) for a single point.
    fn fit(points: &[(f64, f64)]) -> Line {
        match points.len() {
            0 => Line {
                intercept: 0.0,
                slope: 0.0,
            },
            1 => Line {
                intercept: 0.0,
                slope: if points[0].0 != 0.0 {
                    points[0].1 / points[0].0
                } else {
                    0.0
                },
            },
            n => {
                let n = n as f64;
                let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
                let my = points.iter().map(|p| p.1).sum::<f64>() / n;
                let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
                let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
                let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
                Line {
                    intercept: my - slope * mx,
                    slope,
                }
            }
        }
    }
}

/// Predicted behaviour at one draft length.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Prediction {
    pub k: usize,
    pub tokens_per_cycle: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub overhead_ms: f64,
    pub cycle_ms: f64,
    pub tok_s: f64,
    /// Measured decode tok/s when this k was benchmarked.
    pub measured_tok_s: Option<f64>,
    /// Cost terms in units of one plain decoding step, and the gain they must be paid from.
    pub gain: f64,
    pub draft_term: f64,
    pub verify_growth_term: f64,
    pub overhead_term: f64,
}

/// Predicted behaviour of one measured tree shape: its own tokens a cycle, draft and overhead time, and the
/// fitted verify line at its rows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TreePrediction {
    pub label: String,
    pub eagle_topk: usize,
    pub num_steps: usize,
    pub num_draft_tokens: usize,
    pub draft_confidence: f64,
    pub tokens_per_cycle: f64,
    pub rows_per_cycle: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub overhead_ms: f64,
    pub cycle_ms: f64,
    pub tok_s: f64,
    pub measured_tok_s: f64,
    pub gain: f64,
    pub draft_term: f64,
    pub verify_growth_term: f64,
    pub overhead_term: f64,
}

impl TreePrediction {
    /// The flags that run this shape.
    pub fn flags(&self) -> String {
        let shape = format!(
            "--eagle-topk {} --num-steps {} --num-draft-tokens {}",
            self.eagle_topk, self.num_steps, self.num_draft_tokens
        );
        if self.draft_confidence > 0.0 {
            format!("{shape} --draft-confidence {}", self.draft_confidence)
        } else {
            shape
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TuneResult {
    pub method: String,
    pub plain_measured_tok_s: f64,
    pub plain_predicted_tok_s: f64,
    /// Rate at which draft position i (1-based index i-1) is accepted, pooled over configs (the fields from
    /// here to `predictions` are the winning chain variant's; `chains` holds every variant's).
    pub acceptance_by_position: Vec<f64>,
    /// How often position i is drafted at all.
    pub drafted_by_position: Vec<f64>,
    pub draft_ms: Line,
    pub overhead_ms: Line,
    /// Verify ms per cycle against tokens verified per cycle, fitted to the runs (None: the verify(n) curve
    /// was used).
    pub verify_ms: Option<Line>,
    /// Chains at k = 1 up to the longest measured (empty when only trees ran).
    pub predictions: Vec<Prediction>,
    /// The winning chain variant's label and flags beside `--draft-tokens`.
    pub chain_label: String,
    pub chain_flags: String,
    /// Every chain variant's model (one for a bench of one variant).
    pub chains: Vec<ChainFit>,
    /// Each measured tree shape.
    pub trees: Vec<TreePrediction>,
    /// The chain length to use, or None when plain decoding is predicted to beat every chain (or no chain ran).
    pub recommended_k: Option<usize>,
    /// The k with the highest predicted tok/s (the recommendation is the smallest k within 2% of it; 0 when
    /// no chain ran).
    pub best_predicted_k: usize,
    /// The tree shape (index into `trees`) predicted to beat plain decoding and every chain by more than the
    /// model resolves; None when a chain or plain decoding is the pick.
    pub recommended_tree: Option<usize>,
    /// What to run, as flags ("--draft-tokens 4", a tree's three flags, or "plain decoding").
    pub recommendation: String,
    /// The benchmarked configuration with the highest measured tok/s (k = 0 for plain; a tree's k is its
    /// nodes less the pending token) and its label.
    pub best_measured_k: usize,
    pub best_measured_label: String,
    pub best_measured_tok_s: f64,
    pub diagnosis: String,
}

/// verify(n) for fractional n: linear interpolation on the curve, linear extrapolation past its end.
fn verify_at(curve: &[f64], n: f64) -> f64 {
    if curve.len() < 2 {
        return curve.first().copied().unwrap_or(0.0);
    }
    let last = curve.len() - 1;
    let x = (n - 1.0).max(0.0);
    let i = (x.floor() as usize).min(last - 1);
    let t = x - i as f64;
    curve[i] + (curve[i + 1] - curve[i]) * t
}

/// One chain variant's fitted model: its acceptance, draft and overhead lines, and predictions at each k.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChainFit {
    pub label: String,
    /// The flags beside `--draft-tokens` that run it (empty: the bench's defaults).
    pub flags: String,
    pub acceptance_by_position: Vec<f64>,
    pub drafted_by_position: Vec<f64>,
    pub draft_ms: Line,
    pub overhead_ms: Line,
    pub predictions: Vec<Prediction>,
    /// The k with the highest predicted tok/s (0 when nothing was predicted).
    pub best_predicted_k: usize,
    /// The smallest k within MIN_GAIN of the best, where the best beats plain decoding by more than MIN_GAIN.
    pub recommended_k: Option<usize>,
}

impl ChainFit {
    fn best(&self) -> Option<&Prediction> {
        self.predictions
            .iter()
            .max_by(|a, b| a.tok_s.total_cmp(&b.tok_s))
    }

    /// `--draft-tokens k` and the variant's own flags.
    fn flags_at(&self, k: usize) -> String {
        if self.flags.is_empty() {
            format!("--draft-tokens {k}")
        } else {
            format!("--draft-tokens {k} {}", self.flags)
        }
    }
}

/// The model's terms shared by every chain variant and tree: verify cost (fitted to all runs, or the curve)
/// and plain decoding's step.
struct Shared<'a> {
    input: &'a TuneInput,
    verify_line: Option<Line>,
    curve: Vec<f64>,
    plain_step: f64,
}

impl Shared<'_> {
    fn verify(&self, rows: f64) -> f64 {
        match &self.verify_line {
            Some(line) => line.at(rows),
            None => verify_at(&self.curve, rows),
        }
    }
}

/// Fits one chain variant from its configs (`max_k` at least 1).
fn fit_chain(
    shared: &Shared,
    variant: &ChainVariant,
    configs: &[&MeasuredConfig],
    max_k: usize,
) -> ChainFit {
    let input = shared.input;
    // Pooled per-position rates over every config that reached the position.
    let mut drafted = vec![0f64; max_k];
    let mut accepted = vec![0f64; max_k];
    let mut cycles_reaching = vec![0f64; max_k];
    for c in configs {
        for i in 0..c.k.min(max_k) {
            drafted[i] += c.drafted_per_position.get(i).copied().unwrap_or(0.0);
            accepted[i] += c.accepted_per_position.get(i).copied().unwrap_or(0.0);
            cycles_reaching[i] += c.cycles;
        }
    }
    let acceptance: Vec<f64> = (0..max_k)
        .map(|i| {
            if drafted[i] > 0.0 {
                accepted[i] / drafted[i]
            } else {
                0.0
            }
        })
        .collect();
    let drafted_rate: Vec<f64> = (0..max_k)
        .map(|i| {
            if cycles_reaching[i] > 0.0 {
                (drafted[i] / cycles_reaching[i]).min(1.0)
            } else {
                0.0
            }
        })
        .collect();
    // Draft cost against draft steps per cycle: one step to propose position 1, and one more after each drafted
    // position before the k-th (a drafter that stops early skips the rest). Equal to k for a drafter that
    // always drafts k; with early stopping the cost grows slower than k, and a line in k overestimated small k.
    let draft_steps = |k: usize, drafted: &dyn Fn(usize) -> f64| {
        1.0 + (0..k.saturating_sub(1)).map(drafted).sum::<f64>()
    };
    let draft_line = Line::fit(
        &configs
            .iter()
            .filter(|c| c.cycles > 0.0)
            .map(|c| {
                let steps = draft_steps(c.k, &|i| {
                    c.drafted_per_position.get(i).copied().unwrap_or(0.0) / c.cycles
                });
                (steps, c.draft_ms)
            })
            .collect::<Vec<_>>(),
    );
    let overhead_line = Line::fit(
        &configs
            .iter()
            .map(|c| (c.k as f64, c.overhead_ms))
            .collect::<Vec<_>>(),
    );
    let plain_step = shared.plain_step;
    let predictions: Vec<Prediction> = (1..=max_k)
        .map(|k| {
            let tokens = 1.0 + (0..k).map(|i| drafted_rate[i] * acceptance[i]).sum::<f64>();
            let rows = 1.0 + drafted_rate[..k].iter().sum::<f64>();
            let draft_ms = draft_line.at(draft_steps(k, &|i| drafted_rate[i])).max(0.0);
            let verify_ms = shared.verify(rows);
            let overhead_ms = overhead_line.at(k as f64).max(0.0);
            let cycle_ms = draft_ms + verify_ms + overhead_ms;
            Prediction {
                k,
                tokens_per_cycle: tokens,
                draft_ms,
                verify_ms,
                overhead_ms,
                cycle_ms,
                tok_s: tokens * 1e3 / cycle_ms,
                measured_tok_s: configs.iter().find(|c| c.k == k).map(|c| c.tok_s),
                gain: tokens - 1.0,
                draft_term: draft_ms / plain_step,
                verify_growth_term: (verify_ms - input.plain_verify_ms) / plain_step,
                overhead_term: (overhead_ms - input.plain_overhead_ms) / plain_step,
            }
        })
        .collect();
    let plain_predicted = 1e3 / plain_step;
    let best = predictions
        .iter()
        .max_by(|a, b| a.tok_s.total_cmp(&b.tok_s));
    // Predictions within MIN_GAIN of the best are ties at the model's resolution (it is within 2-4% of measured
    // tok/s); among them the smallest k wastes the least drafting and verification when acceptance is lower
    // than measured.
    let recommended_k = best
        .filter(|best| best.tok_s > plain_predicted * (1.0 + MIN_GAIN))
        .map(|best| {
            predictions
                .iter()
                .filter(|p| p.tok_s >= best.tok_s * (1.0 - MIN_GAIN))
                .map(|p| p.k)
                .min()
                .unwrap_or(best.k)
        });
    ChainFit {
        label: variant.label.clone(),
        flags: variant.flags.clone(),
        best_predicted_k: best.map_or(0, |b| b.k),
        acceptance_by_position: acceptance,
        drafted_by_position: drafted_rate,
        draft_ms: draft_line,
        overhead_ms: overhead_line,
        predictions,
        recommended_k,
    }
}

pub fn tune(input: &TuneInput) -> TuneResult {
    // Verify cost against tokens verified per cycle, fitted to the runs themselves (plain decoding is 1 token;
    // a config verifies 1 + its mean drafted tokens): measured at the contexts and in the same minutes as the
    // tok/s it predicts. The separately measured verify(n) curve, shifted to plain decoding's step, is the
    // fallback when there is only one point. (A noisy moment during the curve's measurement once made
    // predictions 13-16% pessimistic.) Every chain variant and tree rides this one line: they ran on one
    // machine in the same minutes.
    let mut verify_points = vec![(1.0, input.plain_verify_ms)];
    for c in &input.configs {
        if c.cycles > 0.0 {
            let rows = 1.0 + c.drafted_per_position.iter().sum::<f64>() / c.cycles;
            verify_points.push((rows, c.verify_ms));
        }
    }
    // A tree verifies its drafted nodes in one pass with a tree mask (every node of a fixed tree; fewer where a
    // bar pruned it).
    for t in input.trees.iter().filter(|t| t.cycles > 0.0) {
        verify_points.push((t.rows_per_cycle, t.verify_ms));
    }
    let distinct_rows = verify_points
        .iter()
        .any(|p| (p.0 - verify_points[0].0).abs() > 1e-9);
    let shift = input.plain_verify_ms - input.verify_curve_ms[0];
    let shared = Shared {
        input,
        verify_line: distinct_rows.then(|| Line::fit(&verify_points)),
        curve: input.verify_curve_ms.iter().map(|v| v + shift).collect(),
        plain_step: input.plain_verify_ms + input.plain_overhead_ms,
    };
    let plain_step = shared.plain_step;
    // Each chain variant on its own (a confidence bar or a vocabulary changes acceptance, drafting and cost).
    // At least one k to predict, even for a hand-built input with no speculative configs, unless trees alone
    // ran (their acceptance says nothing about chains).
    let default_variant = ChainVariant {
        label: input.method.clone(),
        flags: String::new(),
    };
    let mut chains: Vec<ChainFit> = Vec::new();
    for v in 0..input.variants.len().max(1) {
        let variant = input.variants.get(v).unwrap_or(&default_variant);
        let configs: Vec<&MeasuredConfig> =
            input.configs.iter().filter(|c| c.variant == v).collect();
        let max_k = match configs.iter().map(|c| c.k).max() {
            Some(k) => k,
            None if !input.trees.is_empty() || !input.configs.is_empty() => continue,
            None => 1,
        };
        chains.push(fit_chain(&shared, variant, &configs, max_k));
    }
    let trees: Vec<TreePrediction> = input
        .trees
        .iter()
        .map(|t| {
            let rows = t.rows_per_cycle;
            let verify_ms = shared.verify(rows);
            let cycle_ms = t.draft_ms + verify_ms + t.overhead_ms;
            TreePrediction {
                label: t.label.clone(),
                eagle_topk: t.topk,
                num_steps: t.steps,
                num_draft_tokens: t.num_draft_tokens,
                draft_confidence: t.draft_confidence,
                tokens_per_cycle: t.tokens_per_cycle,
                rows_per_cycle: t.rows_per_cycle,
                draft_ms: t.draft_ms,
                verify_ms,
                overhead_ms: t.overhead_ms,
                cycle_ms,
                tok_s: if cycle_ms > 0.0 {
                    t.tokens_per_cycle * 1e3 / cycle_ms
                } else {
                    0.0
                },
                measured_tok_s: t.tok_s,
                gain: t.tokens_per_cycle - 1.0,
                draft_term: t.draft_ms / plain_step,
                verify_growth_term: (verify_ms - input.plain_verify_ms) / plain_step,
                overhead_term: (t.overhead_ms - input.plain_overhead_ms) / plain_step,
            }
        })
        .collect();
    let plain_predicted = 1e3 / plain_step;
    // The variant whose best k is predicted fastest.
    let best_chain = (0..chains.len()).max_by(|&a, &b| {
        let at = |i: usize| chains[i].best().map_or(0.0, |p| p.tok_s);
        at(a).total_cmp(&at(b))
    });
    let chain = best_chain.map(|i| &chains[i]);
    let best = chain.and_then(ChainFit::best);
    let recommended_k = chain.and_then(|c| c.recommended_k);
    // A tree is recommended only where it beats plain decoding and the best chain by more than the model
    // resolves (a tree verifies more rows for its tokens: at a tie the chain is the safer pick).
    let best_tree = (0..trees.len()).max_by(|&a, &b| trees[a].tok_s.total_cmp(&trees[b].tok_s));
    let recommended_tree = best_tree.filter(|&i| {
        let rival = best.map_or(plain_predicted, |b| b.tok_s.max(plain_predicted));
        trees[i].tok_s > rival * (1.0 + MIN_GAIN)
    });
    let recommendation = match (recommended_tree, chain, recommended_k) {
        (Some(i), _, _) => trees[i].flags(),
        (None, Some(c), Some(k)) => c.flags_at(k),
        _ => "plain decoding".to_string(),
    };
    let (best_measured_k, best_measured_label, best_measured_tok_s) = input
        .configs
        .iter()
        .map(|c| (c.k, c.label.clone(), c.tok_s))
        .chain(
            input
                .trees
                .iter()
                .map(|t| (t.num_draft_tokens - 1, t.label.clone(), t.tok_s)),
        )
        .chain(std::iter::once((0, "plain".to_string(), input.plain_tok_s)))
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .expect("plain is always there");
    let mut diagnosis = match (chain, best) {
        (Some(c), Some(best)) => diagnose(best, plain_predicted, &c.acceptance_by_position),
        _ => String::new(),
    };
    if let (Some(winner), true) = (chain, chains.len() > 1) {
        diagnosis.push('\n');
        diagnosis.push_str(&diagnose_variants(&chains, winner, plain_predicted));
    }
    if let Some(i) = best_tree {
        if !diagnosis.is_empty() {
            diagnosis.push('\n');
        }
        diagnosis.push_str(&diagnose_tree(&trees[i], best, plain_predicted));
    }
    let winner = chain.cloned().unwrap_or_else(|| ChainFit {
        label: input.method.clone(),
        flags: String::new(),
        acceptance_by_position: Vec::new(),
        drafted_by_position: Vec::new(),
        draft_ms: Line::fit(&[]),
        overhead_ms: Line::fit(&[]),
        predictions: Vec::new(),
        best_predicted_k: 0,
        recommended_k: None,
    });
    TuneResult {
        method: input.method.clone(),
        plain_measured_tok_s: input.plain_tok_s,
        plain_predicted_tok_s: plain_predicted,
        acceptance_by_position: winner.acceptance_by_position,
        drafted_by_position: winner.drafted_by_position,
        draft_ms: winner.draft_ms,
        overhead_ms: winner.overhead_ms,
        verify_ms: shared.verify_line,
        predictions: winner.predictions,
        chain_label: winner.label,
        chain_flags: winner.flags,
        chains,
        trees,
        recommended_k,
        best_predicted_k: winner.best_predicted_k,
        recommended_tree,
        recommendation,
        best_measured_k,
        best_measured_label,
        best_measured_tok_s,
        diagnosis,
    }
}

/// Each chain variant at its best k beside the winner's, and what the winner buys over the runner-up.
fn diagnose_variants(chains: &[ChainFit], winner: &ChainFit, plain_tok_s: f64) -> String {
    let mut at_best: Vec<(&ChainFit, &Prediction)> = chains
        .iter()
        .filter_map(|c| c.best().map(|p| (c, p)))
        .collect();
    at_best.sort_by(|a, b| b.1.tok_s.total_cmp(&a.1.tok_s));
    let list: Vec<String> = at_best
        .iter()
        .map(|(c, p)| {
            format!(
                "{} k={} {:.2}x ({:.2} tokens a cycle for {:.2} plain steps)",
                c.label,
                p.k,
                p.tok_s / plain_tok_s,
                p.tokens_per_cycle,
                p.cycle_ms * plain_tok_s / 1e3
            )
        })
        .collect();
    let mut s = format!("chain variants at their best k: {}", list.join("; "));
    if let [(first, top), (_, second), ..] = at_best.as_slice() {
        let ratio = top.tok_s / second.tok_s;
        let verdict = if ratio > 1.0 + MIN_GAIN {
            format!("{} wins by {ratio:.2}x", first.label)
        } else {
            format!(
                "{} leads by {ratio:.3}x, a tie at the model's resolution",
                winner.label
            )
        };
        s.push_str(&format!("; {verdict}"));
    }
    s
}

/// The best tree against plain decoding and the best chain: what it gains a cycle, and what it pays for that
/// in drafting and in verifying its extra rows, each in plain steps.
fn diagnose_tree(tree: &TreePrediction, chain: Option<&Prediction>, plain_tok_s: f64) -> String {
    let cost = tree.draft_term + tree.verify_growth_term + tree.overhead_term;
    let mut s = format!(
        "best tree ({}): predicted at {:.2}x plain; {:.2} rows verified a cycle give {:.2} extra tokens for {:.2} \
         plain steps extra (draft {:.2}, verify growth {:.2}, overhead {:.2})",
        tree.flags(),
        tree.tok_s / plain_tok_s,
        tree.rows_per_cycle,
        tree.gain,
        cost,
        tree.draft_term,
        tree.verify_growth_term,
        tree.overhead_term
    );
    if let Some(c) = chain {
        let ratio = tree.tok_s / c.tok_s;
        let verdict = if ratio > 1.0 + MIN_GAIN {
            "the tree wins"
        } else if ratio < 1.0 - MIN_GAIN {
            "the chain wins"
        } else {
            "a tie at the model's resolution (the chain stays the pick)"
        };
        s.push_str(&format!(
            "; against the best chain (k={}: {:.2} extra tokens, draft {:.2}, verify growth {:.2}) it is {:.2}x: \
             {verdict}",
            c.k, c.gain, c.draft_term, c.verify_growth_term, ratio
        ));
    }
    s
}

fn diagnose(best: &Prediction, plain_tok_s: f64, acceptance: &[f64]) -> String {
    let cost = best.draft_term + best.verify_growth_term + best.overhead_term;
    let terms = [
        ("draft cost", best.draft_term),
        (
            "verify growth (verifying k+1 tokens costs more than one step)",
            best.verify_growth_term,
        ),
        ("bookkeeping overhead", best.overhead_term),
    ];
    let (largest, largest_value) = terms
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("three terms");
    let speedup = best.tok_s / plain_tok_s;
    if best.tok_s > plain_tok_s && speedup < 1.0 + MIN_GAIN {
        format!(
            "speculation breaks even: k={} is predicted at {:.3}x plain, within the {:.0}% the model can resolve, so \
             plain decoding is recommended. Each cycle gains {:.2} extra tokens and costs {:.2} plain steps extra \
             (draft {:.2}, verify growth {:.2}, overhead {:.2}).",
            best.k,
            speedup,
            MIN_GAIN * 100.0,
            best.gain,
            cost,
            best.draft_term,
            best.verify_growth_term,
            best.overhead_term
        )
    } else if best.tok_s > plain_tok_s {
        format!(
            "speculation wins: k={} is predicted at {:.2}x plain; each cycle gains {:.2} extra tokens and costs \
             {:.2} plain steps extra (draft {:.2}, verify growth {:.2}, overhead {:.2})",
            best.k, speedup, best.gain, cost, best.draft_term, best.verify_growth_term, best.overhead_term
        )
    } else {
        let first_rate = acceptance.first().copied().unwrap_or(0.0);
        let reason = if best.gain < 0.5 * cost && first_rate < 0.5 {
            format!(
                "low acceptance: position 1 is accepted {:.0}% of the time, so a cycle gains only {:.2} tokens",
                first_rate * 100.0,
                best.gain
            )
        } else {
            format!("{largest} ({largest_value:.2} plain steps per cycle)")
        };
        format!(
            "speculation loses: the best draft length k={} is predicted at {:.2}x plain. It gains {:.2} extra \
             tokens per cycle but costs {:.2} plain steps extra (draft {:.2}, verify growth {:.2}, overhead {:.2}). \
             Losing term: {reason}.",
            best.k, speedup, best.gain, cost, best.draft_term, best.verify_growth_term, best.overhead_term
        )
    }
}

impl TuneResult {
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "method {}: plain decoding measured {:.2} tok/s, model {:.2} tok/s",
            self.method, self.plain_measured_tok_s, self.plain_predicted_tok_s
        );
        match &self.verify_ms {
            Some(v) => {
                let _ = writeln!(
                    s,
                    "verify ms/cycle = {:.2} + {:.2} x tokens verified (fitted to the runs)",
                    v.intercept, v.slope
                );
            }
            None => {
                let _ = writeln!(s, "verify ms/cycle: from the verify(n) curve");
            }
        }
        for chain in &self.chains {
            if self.chains.len() > 1 {
                let _ = writeln!(
                    s,
                    "chain variant {}{}:",
                    chain.label,
                    if chain.flags.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", chain.flags)
                    }
                );
            }
            self.chain_table(&mut s, chain);
        }
        if !self.trees.is_empty() {
            let width = self
                .trees
                .iter()
                .map(|t| t.label.len())
                .max()
                .unwrap_or(0)
                .max(4);
            // Tree labels read from the left.
            model_header(&mut s, &format!("{:<width$}", "tree"), width);
            for t in &self.trees {
                model_row(
                    &mut s,
                    &format!("{:<width$}", t.label),
                    width,
                    [
                        t.tokens_per_cycle,
                        t.draft_ms,
                        t.verify_ms,
                        t.cycle_ms,
                        t.tok_s,
                    ],
                    Some(t.measured_tok_s),
                    t.tok_s / self.plain_predicted_tok_s,
                );
            }
        }
        match (self.recommended_tree, self.recommended_k) {
            (Some(i), _) => {
                let t = &self.trees[i];
                let _ = writeln!(
                    s,
                    "recommended: {} (a tree: predicted {:.2}x plain{})",
                    t.flags(),
                    t.tok_s / self.plain_predicted_tok_s,
                    match self
                        .predictions
                        .iter()
                        .find(|p| p.k == self.best_predicted_k)
                    {
                        Some(p) => format!(", {:.2}x the best chain, k={}", t.tok_s / p.tok_s, p.k),
                        None => String::new(),
                    }
                );
            }
            (None, Some(k)) if k == self.best_predicted_k => {
                let _ = writeln!(s, "recommended: {}", self.recommendation);
            }
            (None, Some(_)) => {
                let _ = writeln!(
                    s,
                    "recommended: {} (the smallest k predicted within {:.0}% of the best, k={})",
                    self.recommendation,
                    MIN_GAIN * 100.0,
                    self.best_predicted_k
                );
            }
            (None, None) => {
                let _ = writeln!(s, "recommended: plain decoding (no speculation)");
            }
        }
        let _ = writeln!(
            s,
            "best measured: {} at {:.2} tok/s",
            self.best_measured_label, self.best_measured_tok_s
        );
        let _ = writeln!(s, "{}", self.diagnosis);
        s
    }

    /// One chain variant's acceptance, cost lines and predictions at each k.
    fn chain_table(&self, s: &mut String, chain: &ChainFit) {
        use std::fmt::Write as _;
        let rates: Vec<String> = chain
            .acceptance_by_position
            .iter()
            .zip(&chain.drafted_by_position)
            .enumerate()
            .map(|(i, (a, d))| {
                if *d < 0.999 {
                    format!("{}:{:.0}%(drafted {:.0}%)", i + 1, a * 100.0, d * 100.0)
                } else {
                    format!("{}:{:.0}%", i + 1, a * 100.0)
                }
            })
            .collect();
        let _ = writeln!(s, "acceptance by draft position: {}", rates.join(" "));
        let _ = writeln!(
            s,
            "draft ms/cycle = {:.2} + {:.2} x draft steps;  overhead ms/cycle = {:.2} + {:.2} k",
            chain.draft_ms.intercept,
            chain.draft_ms.slope,
            chain.overhead_ms.intercept,
            chain.overhead_ms.slope
        );
        model_header(s, "k", 3);
        for p in &chain.predictions {
            model_row(
                s,
                &p.k.to_string(),
                3,
                [
                    p.tokens_per_cycle,
                    p.draft_ms,
                    p.verify_ms,
                    p.cycle_ms,
                    p.tok_s,
                ],
                p.measured_tok_s,
                p.tok_s / self.plain_predicted_tok_s,
            );
        }
    }

    /// Measured and predicted tok/s against k, with plain decoding as a dashed line, as an SVG document.
    pub fn plot_svg(&self) -> String {
        use std::fmt::Write as _;
        let (w, h) = (640.0, 400.0);
        let (left, right, top, bottom) = (60.0, 20.0, 30.0, 50.0);
        let max_k = self
            .trees
            .iter()
            .map(|t| t.num_draft_tokens - 1)
            .chain(self.chains.iter().map(|c| c.predictions.len()))
            .chain([1])
            .max()
            .unwrap_or(1) as f64;
        let values = self
            .chains
            .iter()
            .flat_map(|c| &c.predictions)
            .flat_map(|p| [Some(p.tok_s), p.measured_tok_s])
            .flatten()
            .chain(self.trees.iter().flat_map(|t| [t.tok_s, t.measured_tok_s]))
            .chain([self.plain_measured_tok_s, self.plain_predicted_tok_s]);
        let y_max = values.fold(1.0f64, f64::max) * 1.15;
        let x = |k: f64| left + (w - left - right) * k / max_k;
        let y = |v: f64| h - bottom - (h - top - bottom) * v / y_max;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="18" text-anchor="middle" font-size="14">specula tune ({}): decode tok/s vs draft length k</text>"#,
            w / 2.0,
            self.method
        );
        // Axes with ticks.
        let _ = writeln!(
            s,
            r#"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>"#,
            h - bottom,
            w - right,
            h - bottom,
            h - bottom
        );
        for k in 0..=max_k as usize {
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{k}</text>"#,
                x(k as f64),
                h - bottom + 16.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">k (draft tokens per cycle; 0 = plain)</text>"#,
            (left + w - right) / 2.0,
            h - 12.0
        );
        for i in 0..=5 {
            let v = y_max * i as f64 / 5.0;
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" text-anchor="end">{v:.1}</text><line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#ddd"/>"##,
                left - 6.0,
                y(v) + 4.0,
                y(v),
                w - right,
                y(v)
            );
        }
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#888" stroke-dasharray="6,4"/><text x="{}" y="{}" fill="#555">plain {:.2}</text>"##,
            y(self.plain_measured_tok_s),
            w - right,
            y(self.plain_measured_tok_s),
            w - right - 80.0,
            y(self.plain_measured_tok_s) - 6.0,
            self.plain_measured_tok_s
        );
        // One line per chain variant (the single variant keeps the classic colours), its measured points in
        // its colour.
        const COLOURS: [(&str, &str); 4] = [
            ("#1f77b4", "#d62728"),
            ("#ff7f0e", "#ff7f0e"),
            ("#9467bd", "#9467bd"),
            ("#8c564b", "#8c564b"),
        ];
        for (i, chain) in self.chains.iter().enumerate() {
            let (line, dot) = COLOURS[i % COLOURS.len()];
            let points: Vec<String> = std::iter::once((0.0, self.plain_predicted_tok_s))
                .chain(chain.predictions.iter().map(|p| (p.k as f64, p.tok_s)))
                .map(|(k, v)| format!("{:.1},{:.1}", x(k), y(v)))
                .collect();
            let _ = writeln!(
                s,
                r##"<polyline points="{}" fill="none" stroke="{line}" stroke-width="2"/>"##,
                points.join(" ")
            );
            let measured = chain
                .predictions
                .iter()
                .filter_map(|p| p.measured_tok_s.map(|m| (p.k as f64, m)));
            for (k, v) in measured {
                let _ = writeln!(
                    s,
                    r##"<circle cx="{:.1}" cy="{:.1}" r="5" fill="{dot}"/>"##,
                    x(k),
                    y(v)
                );
            }
            if self.chains.len() > 1 {
                let ly = 98.0 + 16.0 * i as f64;
                let _ = writeln!(
                    s,
                    r##"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{line}" stroke-width="2"/><text x="{}" y="{}">{}</text>"##,
                    left + 10.0,
                    left + 40.0,
                    left + 46.0,
                    ly + 4.0,
                    xml_escape(&chain.label)
                );
            }
        }
        let _ = writeln!(
            s,
            r##"<circle cx="{:.1}" cy="{:.1}" r="5" fill="#d62728"/>"##,
            x(0.0),
            y(self.plain_measured_tok_s)
        );
        // Trees at their drafted nodes: measured as squares, labelled with their shape.
        for (i, t) in self.trees.iter().enumerate() {
            let (cx, cy) = (x((t.num_draft_tokens - 1) as f64), y(t.measured_tok_s));
            // Trees of one size stand at one x: their labels step down so they do not overlap.
            let same_x_before = self.trees[..i]
                .iter()
                .filter(|u| u.num_draft_tokens == t.num_draft_tokens)
                .count() as f64;
            let _ = writeln!(
                s,
                r##"<rect x="{:.1}" y="{:.1}" width="9" height="9" fill="#2ca02c"/><text x="{:.1}" y="{:.1}" font-size="10" fill="#2ca02c">{}x{}x{}</text>"##,
                cx - 4.5,
                cy - 4.5,
                cx + 7.0,
                cy - 6.0 + 12.0 * same_x_before,
                t.eagle_topk,
                t.num_steps,
                t.num_draft_tokens
            );
        }
        if !self.trees.is_empty() {
            let _ = writeln!(
                s,
                r##"<rect x="{}" y="71" width="9" height="9" fill="#2ca02c"/><text x="{}" y="80">tree (topk x steps x nodes), measured</text>"##,
                left + 20.5,
                left + 46.0
            );
        }
        let _ = writeln!(
            s,
            r##"<line x1="{}" y1="40" x2="{}" y2="40" stroke="#1f77b4" stroke-width="2"/><text x="{}" y="44">predicted</text><circle cx="{}" cy="58" r="5" fill="#d62728"/><text x="{}" y="62">measured</text>"##,
            left + 10.0,
            left + 40.0,
            left + 46.0,
            left + 25.0,
            left + 46.0
        );
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(draft_per_token: f64, acceptance: f64) -> TuneInput {
        // A synthetic machine: plain step 10 ms verify + 0.5 ms overhead; verify(n) = 10 + 2 (n - 1).
        let configs = (1..=4)
            .map(|k| {
                let cycles = 100.0;
                let accepted: Vec<f64> = (1..=k)
                    .map(|i| cycles * acceptance.powi(i as i32))
                    .collect();
                let tokens = 1.0 + accepted.iter().sum::<f64>() / cycles;
                let cycle_ms = draft_per_token * k as f64 + 10.0 + 2.0 * k as f64 + 0.5;
                MeasuredConfig {
                    label: format!("model k={k}"),
                    variant: 0,
                    k,
                    tok_s: tokens * 1e3 / cycle_ms,
                    cycles,
                    draft_ms: draft_per_token * k as f64,
                    verify_ms: 10.0 + 2.0 * k as f64,
                    overhead_ms: 0.5,
                    drafted_per_position: vec![cycles; k],
                    accepted_per_position: accepted,
                }
            })
            .collect();
        synthetic_input(configs)
    }

    /// The synthetic machine around `configs`: plain step 10 ms verify + 0.5 ms overhead, verify(n) = 10 + 2 (n - 1).
    fn synthetic_input(configs: Vec<MeasuredConfig>) -> TuneInput {
        TuneInput {
            method: "model".into(),
            plain_tok_s: 1e3 / 10.5,
            plain_verify_ms: 10.0,
            plain_overhead_ms: 0.5,
            configs,
            variants: Vec::new(),
            trees: Vec::new(),
            verify_curve_ms: (0..7).map(|i| 10.0 + 2.0 * i as f64).collect(),
        }
    }

    /// A tree of `nodes` (pending token included) on the synthetic machine: verify 10 + 2 (nodes - 1) ms,
    /// drafting `draft_ms`, `tokens` a cycle.
    fn tree(topk: usize, steps: usize, nodes: usize, draft_ms: f64, tokens: f64) -> MeasuredTree {
        barred_tree(topk, steps, nodes, nodes as f64, draft_ms, tokens)
    }

    /// A tree whose bar left `rows` rows verified a cycle on average (nodes + 1 without one).
    fn barred_tree(
        topk: usize,
        steps: usize,
        nodes: usize,
        rows: f64,
        draft_ms: f64,
        tokens: f64,
    ) -> MeasuredTree {
        let verify_ms = 10.0 + 2.0 * (rows - 1.0);
        let cycle_ms = draft_ms + verify_ms + 0.5;
        MeasuredTree {
            label: format!("tree {topk}x{steps}x{nodes}"),
            topk,
            steps,
            num_draft_tokens: nodes,
            draft_confidence: if rows < nodes as f64 { 0.3 } else { 0.0 },
            tok_s: tokens * 1e3 / cycle_ms,
            cycles: 100.0,
            tokens_per_cycle: tokens,
            rows_per_cycle: rows,
            draft_ms,
            verify_ms,
            overhead_ms: 0.5,
        }
    }

    /// A barred tree verifies fewer rows than its nodes: the model prices the rows it verified, so its own
    /// prediction and the chains' stay exact (pricing 12 rows at 3.5 rows' cost bent the verify line once and
    /// made every chain prediction 17% optimistic).
    #[test]
    fn a_barred_tree_is_priced_at_the_rows_it_verified() {
        let mut inp = input(1.0, 0.8);
        inp.trees = vec![barred_tree(4, 5, 12, 3.5, 3.0, 2.9)];
        let r = tune(&inp);
        assert_reproduces_measurements(&r);
        let t = &r.trees[0];
        assert!(
            (t.tok_s - t.measured_tok_s).abs() < 1e-9 * t.measured_tok_s,
            "{t:?}"
        );
        assert!((t.verify_ms - 15.0).abs() < 1e-9, "{t:?}");
        assert!(
            t.flags().ends_with("--draft-confidence 0.3"),
            "{}",
            t.flags()
        );
    }

    /// Trees ride the same verify line as chains: on exact data each tree's prediction is its measurement, and
    /// the tree is recommended only when it beats the best chain by more than the model resolves.
    #[test]
    fn trees_are_ranked_with_chains_on_one_scale() {
        let chains = input(1.0, 0.8);
        let best_chain = tune(&chains)
            .predictions
            .iter()
            .map(|p| p.tok_s)
            .fold(0.0, f64::max);
        // A tree that gets many more tokens a cycle for its rows wins; one that matches the best chain's speed
        // (within 1%) does not.
        let mut inp = chains.clone();
        inp.trees = vec![
            tree(2, 3, 5, 3.0, 4.5),
            tree(
                1,
                2,
                3,
                2.0,
                best_chain * 0.99 * (2.0 + 10.0 + 4.0 + 0.5) / 1e3,
            ),
        ];
        let r = tune(&inp);
        for t in &r.trees {
            assert!(
                (t.tok_s - t.measured_tok_s).abs() < 1e-9 * t.measured_tok_s,
                "{t:?}"
            );
        }
        assert!(r.trees[0].tok_s > best_chain * (1.0 + MIN_GAIN));
        assert_eq!(r.recommended_tree, Some(0));
        assert_eq!(
            r.recommendation,
            "--eagle-topk 2 --num-steps 3 --num-draft-tokens 5"
        );
        assert_eq!(r.best_measured_label, "tree 2x3x5");
        assert!(
            r.table()
                .contains("recommended: --eagle-topk 2 --num-steps 3"),
            "{}",
            r.table()
        );
        assert!(r.diagnosis.contains("the tree wins"), "{}", r.diagnosis);
        // Only the tie: the chain stays the pick, and the diagnosis says why.
        inp.trees.remove(0);
        let r = tune(&inp);
        assert_eq!(r.recommended_tree, None);
        assert_eq!(
            r.recommendation,
            format!("--draft-tokens {}", r.recommended_k.unwrap())
        );
        assert!(r.diagnosis.contains("a tie"), "{}", r.diagnosis);
        // Trees alone: no chain predictions, the tree judged against plain decoding.
        let mut only_trees = chains.clone();
        only_trees.configs.clear();
        only_trees.trees = vec![tree(2, 3, 5, 3.0, 4.5), tree(4, 2, 3, 1.0, 1.1)];
        let r = tune(&only_trees);
        assert!(r.predictions.is_empty());
        assert_eq!(r.recommended_k, None);
        assert_eq!(r.recommended_tree, Some(0));
        let svg = r.plot_svg();
        assert_eq!(svg.matches("2x3x5").count(), 1, "{svg}");
        // Trees that lose to plain decoding are not recommended.
        only_trees.trees = vec![tree(4, 2, 3, 1.0, 1.1)];
        let r = tune(&only_trees);
        assert_eq!(r.recommendation, "plain decoding");
    }

    /// A config of a drafter that stops early on the synthetic machine: position i drafted in `d(i)` of cycles and
    /// accepted in `d(i) * accept^(i+1)`, drafting `draft_ms.0 + draft_ms.1 x steps`, verify 10 + 2 (rows - 1) ms.
    fn early_stopping_config(
        label: &str,
        variant: usize,
        k: usize,
        d: &dyn Fn(usize) -> f64,
        accept: f64,
        draft_ms: (f64, f64),
    ) -> MeasuredConfig {
        let cycles = 100.0;
        let drafted: Vec<f64> = (0..k).map(|i| cycles * d(i)).collect();
        let accepted: Vec<f64> = (0..k)
            .map(|i| cycles * d(i) * accept.powi(i as i32 + 1))
            .collect();
        let tokens = 1.0 + accepted.iter().sum::<f64>() / cycles;
        let rows = 1.0 + drafted.iter().sum::<f64>() / cycles;
        let steps = 1.0 + (0..k - 1).map(d).sum::<f64>();
        let (draft_ms, verify_ms) = (draft_ms.0 + draft_ms.1 * steps, 10.0 + 2.0 * (rows - 1.0));
        MeasuredConfig {
            label: format!("{label} k={k}"),
            variant,
            k,
            tok_s: tokens * 1e3 / (draft_ms + verify_ms + 0.5),
            cycles,
            draft_ms,
            verify_ms,
            overhead_ms: 0.5,
            drafted_per_position: drafted,
            accepted_per_position: accepted,
        }
    }

    /// Two chain variants in one report (a drafter without a bar, and one whose bar stops it early at half the
    /// draft cost a step): each is fitted on its own configs, both reproduce their measurements exactly on the
    /// shared verify line, and the faster one is recommended with the flags that run it.
    #[test]
    fn chain_variants_are_fitted_apart_and_the_winner_recommended_with_its_flags() {
        let mut inp = input(1.0, 0.8);
        // The barred variant drafts position i in 0.8^i of cycles and accepts 0.9 of what it drafts there.
        let d = |i: usize| 0.8f64.powi(i as i32);
        for k in 1..=4 {
            inp.configs.push(early_stopping_config(
                "model conf>=0.5",
                1,
                k,
                &d,
                0.9,
                (0.0, 0.5),
            ));
        }
        inp.variants = vec![
            ChainVariant {
                label: "model".into(),
                flags: "--draft-confidence 0.0".into(),
            },
            ChainVariant {
                label: "model conf>=0.5".into(),
                flags: "--draft-confidence 0.5".into(),
            },
        ];
        let r = tune(&inp);
        assert_eq!(r.chains.len(), 2);
        for chain in &r.chains {
            for p in &chain.predictions {
                let m = p.measured_tok_s.unwrap();
                assert!(
                    (p.tok_s - m).abs() < 1e-9 * m,
                    "{}: k={} {} vs {m}",
                    chain.label,
                    p.k,
                    p.tok_s
                );
            }
        }
        assert!((r.chains[1].draft_ms.slope - 0.5).abs() < 1e-9);
        assert!((r.chains[1].acceptance_by_position[0] - 0.9).abs() < 1e-12);
        assert!((r.chains[0].acceptance_by_position[0] - 0.8).abs() < 1e-12);
        // The barred variant is cheaper to draft and more often right: it wins, and its k comes with its bar.
        let best = |c: &ChainFit| c.predictions.iter().map(|p| p.tok_s).fold(0.0, f64::max);
        assert!(best(&r.chains[1]) > best(&r.chains[0]) * (1.0 + MIN_GAIN));
        assert_eq!(r.chain_label, "model conf>=0.5");
        assert_eq!(r.predictions.len(), 4);
        assert_eq!(
            r.recommendation,
            format!(
                "--draft-tokens {} --draft-confidence 0.5",
                r.recommended_k.unwrap()
            )
        );
        let table = r.table();
        assert!(
            table.contains("chain variant model (--draft-confidence 0.0):"),
            "{table}"
        );
        assert!(
            table.contains(&format!("recommended: {}", r.recommendation)),
            "{table}"
        );
        assert!(
            r.diagnosis.contains("model conf>=0.5 wins by"),
            "{}",
            r.diagnosis
        );
        // One measured circle per config, plain's, and the legend's; a legend line per variant.
        let svg = r.plot_svg();
        assert_eq!(svg.matches("<circle").count(), 8 + 1 + 1, "{svg}");
        assert!(svg.contains("model conf&gt;=0.5"), "{svg}");
    }

    /// Flags name the settings that tell variants apart, and a bar that is set; labels drop the draft length.
    #[test]
    fn variant_flags_name_what_differs() {
        let a = serde_json::json!({"method": "ngram", "ngram_min": 1, "ngram_max": 4, "ngram_confidence": null});
        let b = serde_json::json!({"method": "ngram", "ngram_min": 1, "ngram_max": 4, "ngram_confidence": 0.25});
        assert_eq!(
            variant_flags(&[&a, &b]),
            vec!["--ngram-confidence auto", "--ngram-confidence 0.25"]
        );
        // Alone, a set bar is still named (the recommendation must run what was measured); an unset one is not.
        assert_eq!(variant_flags(&[&b]), vec!["--ngram-confidence 0.25"]);
        assert_eq!(variant_flags(&[&a]), vec![""]);
        let h1 = serde_json::json!({"method": "eagle3", "tree": null, "draft_confidence": 0.0, "draft_model": "h1"});
        let h2 = serde_json::json!({"method": "eagle3", "tree": null, "draft_confidence": 0.0, "draft_model": "h2"});
        assert_eq!(
            variant_flags(&[&h1, &h2]),
            vec!["--draft-model h1", "--draft-model h2"]
        );
        assert_eq!(
            variant_label("eagle3 chain conf>=0.3 k=5"),
            "eagle3 chain conf>=0.3"
        );
        assert_eq!(variant_label("model"), "model");
    }

    /// Every prediction equals the measurement at its k (the synthetic data follow the model exactly).
    fn assert_reproduces_measurements(r: &TuneResult) {
        for p in &r.predictions {
            let m = p.measured_tok_s.unwrap();
            assert!(
                (p.tok_s - m).abs() < 1e-9 * m,
                "k={}: {} vs {m}",
                p.k,
                p.tok_s
            );
        }
    }

    /// A drafter that stops early (position i drafted in 0.9 x 0.8^i of cycles) and pays per draft step: the
    /// model, fitting draft cost against draft steps, reproduces every measurement exactly.
    #[test]
    fn model_reproduces_a_drafter_that_stops_early() {
        let d = |i: usize| 0.9 * 0.8f64.powi(i as i32);
        let configs = (1..=5)
            .map(|k| early_stopping_config("model", 0, k, &d, 0.7, (2.0, 5.0)))
            .collect();
        let r = tune(&synthetic_input(configs));
        assert!((r.draft_ms.slope - 5.0).abs() < 1e-9 && (r.draft_ms.intercept - 2.0).abs() < 1e-9);
        assert_reproduces_measurements(&r);
    }

    #[test]
    fn model_reproduces_exact_synthetic_measurements_and_picks_the_best_k() {
        let r = tune(&input(1.0, 0.8));
        assert_reproduces_measurements(&r);
        let best = r
            .predictions
            .iter()
            .max_by(|a, b| a.tok_s.total_cmp(&b.tok_s))
            .unwrap();
        assert_eq!(r.best_predicted_k, best.k);
        let smallest_tie = r
            .predictions
            .iter()
            .filter(|p| p.tok_s >= best.tok_s * (1.0 - MIN_GAIN))
            .map(|p| p.k)
            .min();
        assert_eq!(r.recommended_k, smallest_tie);
        assert!(r.recommended_k.unwrap() <= best.k);
        assert!(
            r.diagnosis.starts_with("speculation wins"),
            "{}",
            r.diagnosis
        );
        assert!((r.acceptance_by_position[0] - 0.8).abs() < 1e-12);
    }

    /// The verify cost comes from the runs themselves: a verify(n) curve measured in a noisy moment (here 1.5x
    /// too high past one token) does not move the predictions, which stay exact on exact data.
    #[test]
    fn predictions_use_the_runs_verify_cost_not_a_noisy_curve() {
        let mut inp = input(1.0, 0.8);
        for (n, v) in inp.verify_curve_ms.iter_mut().enumerate() {
            if n > 0 {
                *v *= 1.5;
            }
        }
        let r = tune(&inp);
        assert!(r.verify_ms.is_some());
        for p in &r.predictions {
            let m = p.measured_tok_s.unwrap();
            assert!(
                (p.tok_s - m).abs() < 1e-9 * m,
                "k={}: {} vs {m}",
                p.k,
                p.tok_s
            );
        }
        // With plain decoding only there is one point, and the curve is the fallback.
        let mut plain_only = input(1.0, 0.8);
        plain_only.configs.clear();
        let r = tune(&plain_only);
        assert!(r.verify_ms.is_none());
        assert_eq!(r.predictions.len(), 1);
    }

    #[test]
    fn losing_speculation_names_the_term_that_loses() {
        // A draft as expensive as the target: draft cost is what loses.
        let r = tune(&input(10.0, 0.9));
        assert_eq!(r.recommended_k, None);
        assert!(
            r.diagnosis.contains("Losing term: draft cost"),
            "{}",
            r.diagnosis
        );
        // A free draft that is almost never right: low acceptance.
        let r = tune(&input(0.0, 0.05));
        assert_eq!(r.recommended_k, None);
        assert!(r.diagnosis.contains("low acceptance"), "{}", r.diagnosis);
        // A gain smaller than the model can resolve is not recommended.
        let r = tune(&input(0.0, 0.2));
        let best = r.predictions.iter().map(|p| p.tok_s).fold(0.0, f64::max);
        assert!(
            best > r.plain_predicted_tok_s && best < r.plain_predicted_tok_s * (1.0 + MIN_GAIN)
        );
        assert_eq!(r.recommended_k, None);
        assert!(
            r.diagnosis.starts_with("speculation breaks even"),
            "{}",
            r.diagnosis
        );
        let svg = r.plot_svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(
            svg.matches("<circle").count(),
            4 + 1 + 1,
            "measured points + plain + legend"
        );
    }

    #[test]
    fn rejects_reports_without_what_the_model_needs() {
        let no_spec = serde_json::json!({"configs": [{"k": 0, "decode_tok_s": 1.0}]});
        let err = TuneInput::from_bench_json(&no_spec).unwrap_err();
        assert!(
            err.to_string().contains("no speculative configurations")
                || err.to_string().contains("missing"),
            "{err}"
        );
        let err = TuneInput::from_bench_json(&serde_json::json!({})).unwrap_err();
        assert!(err.to_string().contains("configs"), "{err}");
    }
}
