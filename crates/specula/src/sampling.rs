//! Turning logits into tokens: greedy (temperature 0) or sampling with temperature, top-k and top-p from a
//! seeded ChaCha RNG, so a run is reproducible for a given seed.
//!
//! Order (as in Hugging Face transformers): temperature, then top-k, then top-p over what remains.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// Tokens less likely than `min_p` times the most likely one (after temperature) are left out; 0 disables it.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::InvalidArgument(format!(
                "--temperature must be a finite number >= 0 (0 = greedy), got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "--top-p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::InvalidArgument(format!(
                "--min-p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Index of the largest logit (the first one on ties, so greedy decoding is deterministic; NaN never wins; 0 when
/// nothing exceeds -inf).
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes the compiler vectorizes (the largest value, then the first block holding it) instead of one
    // loop carrying an index through a compare per element: a 152k-entry row took ~0.13 ms, a tenth of which
    // this keeps (each speculative cycle on the CPU reads up to k + 1 such rows).
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        return 0;
    }
    const BLOCK: usize = 64;
    for (b, block) in logits.chunks(BLOCK).enumerate() {
        if block.iter().fold(false, |hit, &v| hit | (v == max)) {
            let i = block.iter().position(|&v| v == max).unwrap_or(0);
            return (b * BLOCK + i) as u32;
        }
    }
    0
}

/// [`argmax`] as one loop, element by element: the reference the fast one must equal.
#[cfg(test)]
fn argmax_reference(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// The largest logit's token (as [`argmax`]) and its softmax probability at temperature 1; `scratch` is reused
/// between calls.
pub fn top_probability(logits: &[f32], scratch: &mut Vec<f32>) -> (u32, f32) {
    let best = argmax(logits);
    let Some(&max) = logits.get(best as usize) else {
        return (0, 0.0);
    };
    scratch.clear();
    scratch.extend(logits.iter().map(|&l| l - max));
    crate::backend::cpu::ops::exp_in_place(scratch);
    // Summed in f64: one f32 accumulator over a 152k-token vocabulary drops the many tiny terms below half its
    // unit in the last place (the real 0.5B's top probabilities came out 7e-4 high against the GPU's tree sum).
    // Four accumulators, added in a fixed order: independent adds rather than one chain of 152k dependent ones.
    let mut lanes = [0f64; 4];
    let mut quads = scratch.chunks_exact(4);
    for q in &mut quads {
        for (lane, &v) in lanes.iter_mut().zip(q) {
            *lane += f64::from(v);
        }
    }
    let rest: f64 = quads.remainder().iter().map(|&v| f64::from(v)).sum();
    let sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + rest;
    (best, (1.0 / sum) as f32)
}

/// The most tokens a request's `logit_bias` may name.
pub const MAX_LOGIT_BIAS_TOKENS: usize = 1024;

/// Adjustments of the target's logits before a token is chosen (OpenAI's penalties and `logit_bias`, vLLM's
/// `repetition_penalty`), applied in vLLM's order: the bias is added, then the repetition penalty (a token already
/// in the prompt or the output has its logit divided by it when positive, multiplied when negative: Hugging
/// Face's rule), then the frequency and presence penalties (subtracted once per occurrence in the output, and
/// once for occurring at all). Speculation verifies against the adjusted logits, so it stays lossless with
/// respect to plain decoding with the same adjustments.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitAdjustments {
    /// 0 is neutral; -2 to 2.
    pub presence_penalty: f32,
    /// 0 is neutral; -2 to 2.
    pub frequency_penalty: f32,
    /// 1 is neutral; above 0.
    pub repetition_penalty: f32,
    /// (token, bias) pairs, each bias -100 to 100.
    pub logit_bias: Vec<(u32, f32)>,
    /// Constrained JSON output (OpenAI's `response_format` `json_object` or `json_schema`): every token that would
    /// leave the grammar masked out after the adjustments above (crate::json_mode).
    pub json: Option<std::sync::Arc<crate::json_mode::JsonConstraint>>,
    /// vLLM's `min_tokens`: the `stop_tokens` are masked out until the output holds this many tokens (0: never).
    pub min_tokens: usize,
    /// The tokens `min_tokens` holds back: the end-of-turn tokens and any stop ids.
    pub stop_tokens: Vec<u32>,
}

impl Default for LogitAdjustments {
    fn default() -> Self {
        LogitAdjustments {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            json: None,
            min_tokens: 0,
            stop_tokens: Vec::new(),
        }
    }
}

impl LogitAdjustments {
    pub fn is_neutral(&self) -> bool {
        self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.iter().all(|&(_, b)| b == 0.0)
            && self.json.is_none()
            && (self.min_tokens == 0 || self.stop_tokens.is_empty())
    }

    /// Masks out the stop tokens of a row that would be output token `position` (0-based) while `min_tokens`
    /// holds them back.
    pub fn hold_stops(&self, position: usize, row: &mut [f32]) {
        if position < self.min_tokens {
            for &t in &self.stop_tokens {
                if let Some(l) = row.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Whether `apply` reads the output's token counts (the repetition, frequency and presence penalties).
    pub fn reads_output_counts(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Checks the values against their ranges and the bias's tokens against a vocabulary of `vocab`.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::InvalidArgument(format!(
                    "{name} must be between -2 and 2, got {v}"
                )));
            }
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0 && r <= 10.0) {
            return Err(Error::InvalidArgument(format!(
                "repetition_penalty must be above 0 and at most 10 (1 = none), got {r}"
            )));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS_TOKENS {
            return Err(Error::InvalidArgument(format!(
                "logit_bias names {} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are taken",
                self.logit_bias.len()
            )));
        }
        if self.min_tokens > 0 && self.json.is_some() {
            // A finished JSON value (or a whole regex match with nothing to follow) allows only stop tokens,
            // which min_tokens would mask too: no token would be left.
            return Err(Error::InvalidArgument(
                "min_tokens cannot be combined with an output constraint (response_format, a regex or choices)"
                    .into(),
            ));
        }
        if let Some(json) = &self.json {
            if json.len() > vocab {
                return Err(Error::InvalidArgument(format!(
                    "JSON mode was set up for a tokenizer of {} tokens; the model has {vocab}",
                    json.len()
                )));
            }
        }
        for &(token, bias) in &self.logit_bias {
            if token as usize >= vocab {
                return Err(Error::InvalidArgument(format!(
                    "logit_bias names token {token}, outside the vocabulary of {vocab}"
                )));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(Error::InvalidArgument(format!(
                    "logit_bias of token {token} must be between -100 and 100, got {bias}"
                )));
            }
        }
        Ok(())
    }

    /// Adjusts one row of logits by the penalties and the bias (the JSON mask needs the output's JSON state:
    /// the generation applies it). `prompt_tokens` are the prompt's distinct tokens, sorted; `output_counts` how
    /// often each token occurs in the output so far (the row's own draft prefix included).
    pub fn apply(
        &self,
        logits: &mut [f32],
        prompt_tokens: &[u32],
        output_counts: &std::collections::HashMap<u32, u32>,
    ) {
        for &(token, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        let r = self.repetition_penalty;
        if r != 1.0 {
            let penalize = |l: &mut f32| *l = if *l > 0.0 { *l / r } else { *l * r };
            // A token of both the prompt and the output is penalized once.
            let seen = prompt_tokens.iter().chain(
                output_counts
                    .keys()
                    .filter(|t| prompt_tokens.binary_search(t).is_err()),
            );
            for &t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    penalize(l);
                }
            }
        }
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            for (&t, &count) in output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.frequency_penalty * count as f32 + self.presence_penalty;
                }
            }
        }
    }
}

/// The most alternatives a position's log-probabilities may list (vLLM's default `max_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated (or prompt) token's log-probability under the model and the most likely tokens at its position:
/// what OpenAI's `logprobs` report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    /// ln p(token) under softmax(logits), at temperature 1.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability under softmax(`logits`) and the `top` most likely tokens' (vLLM's default "raw"
/// log-probabilities: the model's distribution, whatever temperature, top-k or top-p the sampler used). The
/// normalizer is summed in f64, so the many tiny terms of a large vocabulary are not lost.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_norm = f64::from(max) + sum.ln();
    let logprob_of = |l: f32| (f64::from(l) - log_norm) as f32;
    // The best `top` by one pass, kept sorted (top is small: at most MAX_TOP_LOGPROBS).
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && l <= best[top - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    TokenLogprob {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| logprob_of(l)),
        top: best.into_iter().map(|(i, l)| (i, logprob_of(l))).collect(),
    }
}

/// A sparse probability distribution: candidate token ids with probabilities summing to 1.
#[derive(Debug, Clone, Default)]
pub struct Distribution {
    pub ids: Vec<u32>,
    pub probs: Vec<f32>,
}

impl Distribution {
    pub fn prob_of(&self, id: u32) -> f32 {
        // A whole vocabulary in id order holds token i at index i: no search (ids are distinct).
        if self.ids.get(id as usize) == Some(&id) {
            return self.probs[id as usize];
        }
        self.ids
            .iter()
            .position(|&i| i == id)
            .map(|p| self.probs[p])
            .unwrap_or(0.0)
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler {
            params,
            rng: ChaCha20Rng::seed_from_u64(params.seed),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// One token from the logits of one position.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        self.draw(&dist)
    }

    /// One token from row `row` of a logits matrix: greedy reads only the argmax, computed where the logits
    /// live; sampling reads the row.
    pub fn sample_row(&mut self, logits: &dyn crate::model::RowMatrix, row: usize) -> Result<u32> {
        if self.params.is_greedy() {
            let best = logits.argmax_rows()?;
            return best.get(row).copied().ok_or_else(|| {
                Error::InvalidArgument(format!("row {row} of {} logits rows", best.len()))
            });
        }
        let values = logits.row(row)?;
        Ok(self.sample(&values))
    }

    /// The distribution the sampler draws from (after temperature, top-k, top-p).
    pub fn distribution(&self, logits: &[f32]) -> Distribution {
        distribution(logits, &self.params)
    }

    /// A draw from `dist` with this sampler's RNG.
    pub fn draw(&mut self, dist: &Distribution) -> u32 {
        draw(dist, &mut self.rng)
    }

    /// A uniform number in [0, 1) (speculative sampling's acceptance test).
    pub fn uniform(&mut self) -> f32 {
        self.rng.random()
    }
}

/// Inverse-CDF draw from a distribution.
pub fn draw(dist: &Distribution, rng: &mut impl Rng) -> u32 {
    let u: f32 = rng.random();
    let mut acc = 0f32;
    for (&id, &p) in dist.ids.iter().zip(&dist.probs) {
        acc += p;
        if u < acc {
            return id;
        }
    }
    *dist.ids.last().unwrap_or(&0)
}

/// normalize(max(0, p - q)): where speculative sampling draws from after rejecting a draft token.
/// Linear in the two supports (with full-vocabulary distributions a per-token search of q was quadratic:
/// seconds per rejection on a 152k vocabulary).
pub fn residual(p: &Distribution, q: &Distribution) -> Distribution {
    let q_len = q.ids.iter().map(|&i| i as usize + 1).max().unwrap_or(0);
    let mut q_dense = vec![0f32; q_len];
    for (&id, &qq) in q.ids.iter().zip(&q.probs) {
        q_dense[id as usize] = qq;
    }
    let mut ids = Vec::new();
    let mut probs = Vec::new();
    for (&id, &pp) in p.ids.iter().zip(&p.probs) {
        let r = pp - q_dense.get(id as usize).copied().unwrap_or(0.0);
        if r > 0.0 {
            ids.push(id);
            probs.push(r);
        }
    }
    let total: f32 = probs.iter().sum();
    if total <= 0.0 {
        // p == q exactly (rejection then has probability 0); fall back to p.
        return p.clone();
    }
    for v in &mut probs {
        *v /= total;
    }
    Distribution { ids, probs }
}

/// Softmax(logits / T), restricted to top-k, then to the smallest top-p nucleus, then to the tokens at least
/// min-p times as likely as the most likely one (vLLM's order; min-p's cut is the same before or after the others,
/// which keep the most likely token and only rescale). When top-k or top-p truncate, ids are sorted by
/// probability (ties by id); otherwise every token kept stays in id order (sorting a 152k vocabulary per position
/// would cost more than the draw).
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Distribution {
    let mut dist = truncated(logits, params);
    if params.min_p > 0.0 {
        let top = dist.probs.iter().copied().fold(0f32, f32::max);
        let floor = params.min_p * top;
        let (mut ids, mut probs) = (Vec::new(), Vec::new());
        for (&id, &p) in dist.ids.iter().zip(&dist.probs) {
            if p >= floor {
                ids.push(id);
                probs.push(p);
            }
        }
        let total: f32 = probs.iter().sum();
        for p in &mut probs {
            *p /= total;
        }
        dist = Distribution { ids, probs };
    }
    dist
}

/// The sum of `values` in eight interleaved f32 lanes added pairwise at the end, in a fixed order: the compiler
/// vectorizes it (one dependent chain of f32 adds over a 152k row took ~0.2 ms), and it rounds no worse.
fn sum_in_lanes(values: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut blocks = values.chunks_exact(8);
    for block in &mut blocks {
        for (lane, &v) in lanes.iter_mut().zip(block) {
            *lane += v;
        }
    }
    let rest: f32 = blocks.remainder().iter().sum();
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
        + rest
}

/// [`distribution`] before min-p.
fn truncated(logits: &[f32], params: &SamplingParams) -> Distribution {
    let t = params.temperature.max(1e-6);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits.iter().map(|&l| (l - max) / t).collect();
    crate::backend::cpu::ops::exp_in_place(&mut probs);
    let sum = sum_in_lanes(&probs);
    for p in &mut probs {
        *p /= sum;
    }
    let n = probs.len();
    let k = if params.top_k == 0 {
        n
    } else {
        params.top_k.min(n)
    };
    if k == n && params.top_p >= 1.0 {
        // Usually every token keeps some probability: the row as it is, ids in order (built without a branch a
        // token: this path ran ~1.1 ms a 152k row, most of a sampled speculative cycle's acceptance).
        if probs.iter().all(|&p| p > 0.0) {
            return Distribution {
                ids: (0..n as u32).collect(),
                probs,
            };
        }
        let ids: Vec<u32> = (0..n as u32).filter(|&i| probs[i as usize] > 0.0).collect();
        let kept = ids.iter().map(|&i| probs[i as usize]).collect();
        return Distribution { ids, probs: kept };
    }
    let by_prob_desc = |a: &u32, b: &u32| {
        probs[*b as usize]
            .partial_cmp(&probs[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    // Candidates without sorting the vocabulary: every token at or above a threshold, lowered until the set
    // holds k tokens or the top-p mass. The set holds all tokens >= the threshold, so the top-k / nucleus
    // (a prefix of the sorted order) lies inside it once it is large enough; then only the set is sorted.
    let top = probs.iter().copied().fold(0f32, f32::max);
    let mut threshold = top / 256.0;
    let head = loop {
        let cand: Vec<u32> = (0..n as u32)
            .filter(|&i| probs[i as usize] >= threshold)
            .collect();
        let mass: f32 = cand.iter().map(|&i| probs[i as usize]).sum();
        if cand.len() >= k || (params.top_p < 1.0 && mass >= params.top_p) || threshold == 0.0 {
            break cand;
        }
        threshold = if threshold < f32::MIN_POSITIVE {
            0.0
        } else {
            threshold / 256.0
        };
    };
    let mut head = head;
    head.sort_by(by_prob_desc);
    head.truncate(k);
    let mut kept = Vec::new();
    let mut acc = 0f32;
    for &i in &head {
        kept.push(i);
        acc += probs[i as usize];
        if params.top_p < 1.0 && acc >= params.top_p {
            break;
        }
    }
    let total: f32 = kept.iter().map(|&i| probs[i as usize]).sum();
    let kept_probs = kept.iter().map(|&i| probs[i as usize] / total).collect();
    Distribution {
        ids: kept,
        probs: kept_probs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The adjustments against a plain per-token reading of their definitions: bias added, then each token seen
    /// in prompt or output divided (positive) or multiplied (negative) by the repetition penalty once, then
    /// frequency x count + presence subtracted for output tokens.
    #[test]
    fn logit_adjustments_follow_their_definitions() {
        let vocab = 40;
        let base: Vec<f32> = (0..vocab).map(|i| ((i * 7 % 13) as f32) - 6.0).collect();
        let prompt = [3u32, 5, 5, 9, 30];
        let output = [5u32, 7, 7, 7, 11, 39];
        let rules = LogitAdjustments {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 1.3,
            logit_bias: vec![(7, 2.0), (20, -100.0), (3, 1.5)],
            ..Default::default()
        };
        let mut want = base.clone();
        for (t, w) in want.iter_mut().enumerate() {
            let t = t as u32;
            if let Some(&(_, b)) = rules.logit_bias.iter().find(|(i, _)| *i == t) {
                *w += b;
            }
            let count = output.iter().filter(|&&o| o == t).count();
            if prompt.contains(&t) || count > 0 {
                *w = if *w > 0.0 { *w / 1.3 } else { *w * 1.3 };
            }
            if count > 0 {
                *w -= 0.25 * count as f32 + 0.5;
            }
        }
        let mut sorted_prompt = prompt.to_vec();
        sorted_prompt.sort_unstable();
        sorted_prompt.dedup();
        let mut counts = std::collections::HashMap::new();
        for &o in &output {
            *counts.entry(o).or_insert(0u32) += 1;
        }
        let mut got = base.clone();
        rules.apply(&mut got, &sorted_prompt, &counts);
        assert_eq!(got, want);
        assert!(!rules.is_neutral() && LogitAdjustments::default().is_neutral());
        // Neutral values change nothing.
        let mut same = base.clone();
        LogitAdjustments::default().apply(&mut same, &sorted_prompt, &counts);
        assert_eq!(same, base);
        // Out of range, named.
        for (bad, needle) in [
            (
                LogitAdjustments {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                LogitAdjustments {
                    frequency_penalty: f32::NAN,
                    ..Default::default()
                },
                "frequency_penalty",
            ),
            (
                LogitAdjustments {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                LogitAdjustments {
                    logit_bias: vec![(40, 1.0)],
                    ..Default::default()
                },
                "outside the vocabulary of 40",
            ),
            (
                LogitAdjustments {
                    logit_bias: vec![(1, 101.0)],
                    ..Default::default()
                },
                "between -100 and 100",
            ),
        ] {
            let e = bad.validate(vocab).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        rules.validate(vocab).unwrap();
    }

    #[test]
    fn token_logprob_is_the_log_softmax_with_the_most_likely_tokens_in_order() {
        let logits: Vec<f32> = (0..3000).map(|i| ((i * 53 % 211) as f32) * 0.05).collect();
        let sum: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let exact = |i: usize| (logits[i] as f64) - sum.ln();
        let lp = token_logprob(&logits, 17, 5);
        assert_eq!(lp.token, 17);
        assert!((lp.logprob as f64 - exact(17)).abs() < 1e-5);
        // The reference top 5: a full sort, ties by lower id.
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
        let ids: Vec<u32> = lp.top.iter().map(|&(i, _)| i).collect();
        assert_eq!(
            ids,
            order[..5].iter().map(|&i| i as u32).collect::<Vec<_>>()
        );
        for &(i, l) in &lp.top {
            assert!((l as f64 - exact(i as usize)).abs() < 1e-5);
        }
        assert!(token_logprob(&logits, 17, 0).top.is_empty());
        // More alternatives than tokens: every token, once.
        assert_eq!(token_logprob(&[0.5, 2.0], 0, 20).top.len(), 2);
        // Probabilities sum to 1.
        let total: f64 = (0..logits.len())
            .map(|i| (token_logprob(&logits, i as u32, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
        assert_eq!(token_logprob(&logits, 99_999, 0).logprob, f32::NEG_INFINITY);
    }

    #[test]
    fn top_probability_is_the_softmax_of_the_argmax() {
        let mut scratch = Vec::new();
        for logits in [
            vec![1.0f32, 3.0, 2.0, -1.0],
            vec![0.0; 7],
            (0..5000).map(|i| ((i * 37 % 101) as f32) * 0.07).collect(),
            // A vocabulary's worth of terms each below half an f32 accumulator's last place (e^-20 beside 1):
            // together 3e-4 of the sum, all of it lost by one f32 accumulator.
            (0..152_000)
                .map(|i| if i == 7 { 20.0 } else { 0.0 })
                .collect(),
        ] {
            let (token, p) = top_probability(&logits, &mut scratch);
            assert_eq!(token, argmax(&logits));
            let sum: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
            let exact = (logits[token as usize] as f64).exp() / sum;
            assert!(
                (p as f64 - exact).abs() < 1e-5 * exact.max(1e-3),
                "{p} vs {exact}"
            );
        }
        assert_eq!(top_probability(&[], &mut scratch), (0, 0.0));
    }

    /// The fast candidate search gives what a full sort gives: the same kept ids (in probability order when
    /// truncated, id order otherwise) and probabilities, over peaked and flat logits and every kind of truncation.
    #[test]
    fn distribution_matches_a_full_sort_reference() {
        fn reference(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
            let t = p.temperature.max(1e-6);
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // The same exp as `distribution`: this test is about the candidate search.
            let e: Vec<f32> = logits
                .iter()
                .map(|&l| crate::backend::cpu::ops::exp((l - max) / t))
                .collect();
            let sum: f32 = e.iter().sum();
            let probs: Vec<f32> = e.iter().map(|v| v / sum).collect();
            let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
            ids.sort_by(|a, b| {
                probs[*b as usize]
                    .total_cmp(&probs[*a as usize])
                    .then(a.cmp(b))
            });
            let k = if p.top_k == 0 {
                ids.len()
            } else {
                p.top_k.min(ids.len())
            };
            let mut kept = Vec::new();
            let mut acc = 0f32;
            for &i in &ids[..k] {
                if probs[i as usize] == 0.0 {
                    break;
                }
                kept.push(i);
                acc += probs[i as usize];
                if p.top_p < 1.0 && acc >= p.top_p {
                    break;
                }
            }
            // min-p: against the most likely token, which every truncation keeps.
            let floor = p.min_p * probs[ids[0] as usize];
            kept.retain(|&i| probs[i as usize] >= floor);
            let total: f32 = kept.iter().map(|&i| probs[i as usize]).sum();
            kept.iter()
                .map(|&i| (i, probs[i as usize] / total))
                .collect()
        }
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        for spread in [1.0f32, 8.0, 40.0] {
            let logits: Vec<f32> = (0..5000).map(|_| rng.random::<f32>() * spread).collect();
            for temperature in [0.3, 1.0] {
                for top_k in [0, 1, 40, 5000] {
                    for (top_p, min_p) in
                        [(1.0, 0.0), (0.9, 0.0), (0.5, 0.0), (1.0, 0.05), (0.9, 0.3)]
                    {
                        let p = SamplingParams {
                            temperature,
                            top_k,
                            top_p,
                            min_p,
                            seed: 0,
                        };
                        let got = distribution(&logits, &p);
                        let mut want = reference(&logits, &p);
                        let truncated = top_k != 0 && top_k < 5000 || top_p < 1.0;
                        if !truncated {
                            want.sort_by_key(|&(i, _)| i);
                        }
                        assert_eq!(
                            got.ids.len(),
                            want.len(),
                            "{spread} {temperature} {top_k} {top_p} {min_p}"
                        );

                        for ((&i, &pr), &(wi, wp)) in got.ids.iter().zip(&got.probs).zip(&want) {
                            assert_eq!(i, wi);
                            // Sums run in a different order (f32 over up to 5000 terms).
                            assert!((pr - wp).abs() <= 2e-5 * wp.max(1e-6), "{pr} vs {wp}");
                        }
                    }
                }
            }
        }
    }

    /// min-p keeps the tokens at least min_p times as likely as the top one (after temperature), renormalized.
    #[test]
    fn min_p_cuts_below_its_share_of_the_top_probability() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
        let logits = [2f32.ln() * 2.0, 2f32.ln(), 0.0, 0.0];
        let at = |min_p: f32, temperature: f32| {
            distribution(
                &logits,
                &SamplingParams {
                    temperature,
                    min_p,
                    ..Default::default()
                },
            )
        };
        assert_eq!(at(0.0, 1.0).ids, [0, 1, 2, 3]);
        assert_eq!(at(0.25, 1.0).ids, [0, 1, 2, 3]);
        let cut = at(0.3, 1.0);
        assert_eq!(cut.ids, [0, 1]);
        assert!((cut.probs[0] - 2.0 / 3.0).abs() < 1e-6 && (cut.probs[1] - 1.0 / 3.0).abs() < 1e-6);
        assert_eq!(at(1.0, 1.0).ids, [0]);
        // At temperature 2 the shares are sqrt'd (0.5 -> ~0.707 of the top for token 1, 0.5 for 2 and 3).
        assert_eq!(at(0.6, 2.0).ids, [0, 1]);
        assert!(SamplingParams {
            min_p: 1.5,
            ..Default::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn residual_is_normalized_positive_part_of_p_minus_q() {
        let p = Distribution {
            ids: vec![0, 1, 2],
            probs: vec![0.5, 0.3, 0.2],
        };
        let q = Distribution {
            ids: vec![1, 0, 7],
            probs: vec![0.6, 0.2, 0.2],
        };
        let r = residual(&p, &q);
        // p - q: 0.3, -0.3, 0.2 -> {0: 0.6, 2: 0.4}
        assert_eq!(r.ids, vec![0, 2]);
        assert!((r.probs[0] - 0.6).abs() < 1e-6 && (r.probs[1] - 0.4).abs() < 1e-6);
    }

    #[test]
    fn a_distributions_probabilities_are_found_whatever_its_order() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32) / 10.0).collect();
        for params in [
            SamplingParams {
                temperature: 0.8,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.8,
                top_p: 0.5,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.8,
                top_k: 7,
                ..Default::default()
            },
        ] {
            let dist = distribution(&logits, &params);
            let total: f32 = dist.probs.iter().sum();
            assert!((total - 1.0).abs() < 1e-4, "{total}");
            for (&id, &p) in dist.ids.iter().zip(&dist.probs) {
                assert_eq!(dist.prob_of(id), p);
            }
            // A token the distribution left out has probability 0.
            if let Some(out) = (0..1000u32).find(|t| !dist.ids.contains(t)) {
                assert_eq!(dist.prob_of(out), 0.0);
            }
        }
        // The lanes' sum against an f64 sum: no further off than one f32 chain (what it replaced).
        let values: Vec<f32> = (0..152_003)
            .map(|i| ((i % 97) as f32 + 0.5) * 1e-3)
            .collect();
        let exact: f64 = values.iter().map(|&v| f64::from(v)).sum();
        let chain: f32 = values.iter().sum();
        let lanes_err = (f64::from(sum_in_lanes(&values)) - exact).abs();
        assert!(lanes_err <= (f64::from(chain) - exact).abs(), "{lanes_err}");
        assert!(lanes_err < 1e-4 * exact, "{lanes_err}");
    }

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, 1.0]), 1);
        // The vectorized argmax against the element-by-element loop: random rows of several lengths, ties across
        // and within blocks, NaN, infinities, signed zeros, rows of -inf only.
        let mut next = crate::testing::xorshift64(0x9e37_79b9_7f4a_7c15u64);
        for len in [1usize, 2, 63, 64, 65, 127, 1000, 152_064] {
            for case in 0..8 {
                let mut row: Vec<f32> = (0..len)
                    .map(|_| ((next() % 2001) as f32 - 1000.0) / 100.0)
                    .collect();
                match case {
                    1 => row.iter_mut().for_each(|v| *v = v.round()),
                    2 => row[next() as usize % len] = f32::NAN,
                    3 => row[next() as usize % len] = f32::INFINITY,
                    4 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                    5 => row
                        .iter_mut()
                        .for_each(|v| *v = if next().is_multiple_of(2) { 0.0 } else { -0.0 }),
                    6 => row.iter_mut().for_each(|v| *v = f32::NAN),
                    7 => {
                        row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
                        row[len - 1] = f32::NAN;
                    }
                    _ => {}
                }
                assert_eq!(
                    argmax(&row),
                    argmax_reference(&row),
                    "length {len}, case {case}"
                );
            }
        }
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.0, 1.0, 5.0]), 2);
    }

    #[test]
    fn top_k_and_top_p_restrict_candidates() {
        let logits = [3.0, 2.0, 1.0, 0.0, -1.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        };
        let d = distribution(&logits, &p);
        assert_eq!(d.ids, vec![0, 1]);
        assert!((d.probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        assert_eq!(distribution(&logits, &p).ids, vec![0]);
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        assert_eq!(distribution(&logits, &p).ids.len(), 5);
    }

    #[test]
    fn sampling_is_deterministic_per_seed_and_follows_probabilities() {
        let logits = [1.0f32, 0.0, -1.0];
        let params = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params }).unwrap();
            (0..3000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let draws = run(7);
        let freq0 = draws.iter().filter(|&&t| t == 0).count() as f32 / draws.len() as f32;
        let p0 = 1.0 / (1.0 + (-1f32).exp() + (-2f32).exp());
        assert!((freq0 - p0).abs() < 0.03, "{freq0} vs {p0}");
    }

    #[test]
    fn bad_parameters_are_rejected() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(p).is_err());
        }
    }
}
