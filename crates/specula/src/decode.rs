//! The decode loop, readable as a story. Each step is a profiler step made of phases:
//!
//! ```text
//! prefill step:  prefill (forward over the prompt) -> sample -> commit -> emit
//! decode step:   verify (forward over the pending token) -> sample -> commit -> emit
//! ```
//!
//! Plain decoding is the speculative cycle with no drafter: `verify` runs the target over one pending token.

pub mod generation;
pub mod prefix;
pub mod stop_text;

pub use generation::{step, step_with, CachedPrefix, Generation, StepLimits, StepReport};
pub use prefix::PrefixCache;

use crate::draft::Drafter;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::profile::Profiler;
use crate::sampling::{LogitAdjustments, SamplingParams, TokenLogprob};
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    /// At least 1.
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at the model's end-of-turn tokens (on by default; off to force a fixed length in benchmarks).
    pub stop_at_eos: bool,
    /// Set by someone else to stop generation at the next step boundary (a server's client went away, or its
    /// stop sequence appeared); None: never cancelled.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Log-probabilities to report (OpenAI's `logprobs`); None: none (no cost).
    pub logprobs: Option<LogprobsRequest>,
    /// Penalties and logit bias applied to the target's logits before each token is chosen; None (or neutral
    /// values): the model's own distribution, and no cost.
    pub logit_adjustments: Option<LogitAdjustments>,
    /// Tokens that end the generation once generated (vLLM's `stop_token_ids`), kept in the output, besides the
    /// end-of-turn tokens `stop_at_eos` stops at.
    pub stop_token_ids: Vec<u32>,
}

/// Which log-probabilities a generation reports, all from the target's logits at temperature 1 (vLLM's default
/// "raw" log-probabilities: they describe the model, whatever the sampling settings). With speculation each
/// token's comes from the verify pass's row that decided it, which is bitwise the row a plain step computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobsRequest {
    /// Alternatives listed at each position besides the chosen token (at most
    /// [`crate::sampling::MAX_TOP_LOGPROBS`]).
    pub top: usize,
    /// Also the prompt's tokens (each but the first, from the row before it): the prompt is then prefilled in
    /// chunks of at most [`PROMPT_LOGPROBS_CHUNK`] rows with logits for every row, and no prefix cache is used.
    pub prompt: bool,
}

/// The largest prompt chunk of a generation that reports the prompt's log-probabilities: every row of a chunk
/// then computes logits (a vocabulary of floats each), so chunks stay small.
pub const PROMPT_LOGPROBS_CHUNK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An end-of-turn token was sampled (it is not part of the output).
    EndOfText,
    /// A token of `GenerateRequest::stop_token_ids` was generated (it is the output's last token).
    StopToken,
    MaxTokens,
    /// The model's context is full.
    ContextFull,
    /// `GenerateRequest::cancel` was set.
    Cancelled,
    /// A stop sequence appeared in the text ([`stop_text`]; set by the caller that watched for it, which also
    /// cancelled the generation): the answer is the text before it.
    StopSequence,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Timing {
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Tokens produced by decode steps (the first token comes from the prefill step).
    pub decode_tokens: usize,
}

impl Timing {
    pub fn decode_tok_s(&self) -> f64 {
        if self.decode_s > 0.0 {
            self.decode_tokens as f64 / self.decode_s
        } else {
            0.0
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub prompt_tokens: usize,
    /// Of those, the tokens whose keys and values came from a prefix cache (not computed again).
    pub cached_prompt_tokens: usize,
    /// Generated tokens, without the stop token.
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
    pub timing: Timing,
    /// Acceptance statistics when a drafter was used.
    pub speculation: Option<SpeculationStats>,
    /// One per generated token when the request asked for log-probabilities.
    pub logprobs: Vec<TokenLogprob>,
    /// One per prompt token after the first when the request asked for the prompt's.
    pub prompt_logprobs: Vec<TokenLogprob>,
}

/// The most new tokens a prompt of `prompt_tokens` leaves room for: every position up to the context length,
/// plus the last token, which is generated from the last position but never needs a cache slot itself.
/// Generation stops there with [`StopReason::ContextFull`], whatever `max_new_tokens` asks.
pub fn context_room(model: &dyn Model, prompt_tokens: usize) -> usize {
    context_room_for(model.config().context_length, prompt_tokens)
}

/// [`context_room`] for a cache of `capacity` positions.
pub(crate) fn context_room_for(capacity: usize, prompt_tokens: usize) -> usize {
    if prompt_tokens < capacity {
        capacity - prompt_tokens + 1
    } else {
        0
    }
}

/// Checks a request against the model before any work is done.
pub fn validate_request(model: &dyn Model, req: &GenerateRequest) -> Result<()> {
    req.sampling.validate()?;
    if req.max_new_tokens == 0 {
        return Err(Error::InvalidArgument(
            "--max-tokens must be at least 1".into(),
        ));
    }
    if let Some(lp) = &req.logprobs {
        if lp.top > crate::sampling::MAX_TOP_LOGPROBS {
            return Err(Error::InvalidArgument(format!(
                "{} alternative log-probabilities a position were asked for; at most {} are listed",
                lp.top,
                crate::sampling::MAX_TOP_LOGPROBS
            )));
        }
    }
    if let Some(a) = &req.logit_adjustments {
        a.validate(model.config().vocab_size)?;
    }
    if req.prompt_tokens.is_empty() {
        return Err(Error::InvalidArgument(
            "the prompt is empty (0 tokens)".into(),
        ));
    }
    let ctx = model.config().context_length;
    if req.prompt_tokens.len() >= ctx {
        return Err(Error::ContextOverflow {
            prompt_tokens: req.prompt_tokens.len(),
            max_new_tokens: req.max_new_tokens,
            context_length: ctx,
        });
    }
    Ok(())
}

/// Speculation settings for [`generate`]: the drafter and how many tokens it proposes per cycle.
pub struct Speculation<'d> {
    pub drafter: &'d mut dyn Drafter,
    pub draft_tokens: usize,
    /// Speed work only: accept each draft token with this probability instead of verifying it
    /// ([`verify::SimulatedAcceptance`]); the output is then not the model's.
    pub simulate_acceptance: Option<f64>,
}

/// Generates up to `max_new_tokens` tokens, streaming text to `on_text` as it is produced. With a drafter, each
/// decode step is one speculative cycle; without, it is a plain decoding step. Both run the same loop: a
/// [`Generation`] stepped alone (the server steps several together).
pub fn generate(
    model: &dyn Model,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    speculation: Option<Speculation<'_>>,
    prof: &Profiler,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    let mut generation = match speculation {
        Some(s) => {
            let g =
                Generation::with_drafter(model, req.clone(), Box::new(s.drafter), s.draft_tokens)?;
            match s.simulate_acceptance {
                Some(p) => g.simulate_acceptance(p)?,
                None => g,
            }
        }
        None => Generation::new(model, req.clone())?,
    };
    while !generation.is_done() {
        let (mut results, _) = generation::step(
            model,
            tokenizer,
            &mut [&mut generation],
            StepLimits::default(),
            prof,
            &mut |_, text| on_text(text),
        );
        results.pop().unwrap_or(Ok(()))?;
    }
    generation.finish(tokenizer, on_text)
}

/// The most tokens a drafter may propose per cycle.
pub const MAX_DRAFT_TOKENS: usize = 64;

/// Checks a draft length (`--draft-tokens`).
pub fn check_draft_tokens(k: usize) -> Result<()> {
    if k == 0 || k > MAX_DRAFT_TOKENS {
        return Err(Error::InvalidArgument(format!(
            "--draft-tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {k}"
        )));
    }
    Ok(())
}

/// Acceptance statistics of a speculative run (vLLM's definitions).
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpeculationStats {
    pub method: &'static str,
    /// k: tokens requested from the drafter per cycle.
    pub draft_tokens: usize,
    /// Verify passes (decode steps).
    pub cycles: u64,
    /// Cycles where the drafter proposed nothing (n-gram without a match).
    pub empty_drafts: u64,
    /// Cycles that accepted part of their draft: some tokens, not all (the rollback path).
    pub partially_accepted: u64,
    /// Cycles whose draft was rejected from its first token.
    pub fully_rejected: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Forward passes the drafter ran ([`crate::draft::Draft::passes`]).
    pub draft_passes: u64,
    /// Cycles the drafter spent only catching up ([`crate::draft::Draft::catching_up`]; also counted in
    /// `empty_drafts`).
    pub catch_up_cycles: u64,
    /// Per draft position 1..=k: how many cycles drafted / accepted a token there.
    pub drafted_per_position: Vec<u64>,
    pub accepted_per_position: Vec<u64>,
    /// Index n: cycles that accepted exactly n draft tokens.
    pub accept_len_histogram: Vec<u64>,
}

impl SpeculationStats {
    pub fn new(method: &'static str, k: usize) -> Self {
        SpeculationStats {
            method,
            draft_tokens: k,
            cycles: 0,
            empty_drafts: 0,
            partially_accepted: 0,
            fully_rejected: 0,
            drafted: 0,
            accepted: 0,
            draft_passes: 0,
            catch_up_cycles: 0,
            drafted_per_position: vec![0; k],
            accepted_per_position: vec![0; k],
            accept_len_histogram: vec![0; k + 1],
        }
    }

    /// A tree draft of `nodes` tokens, `depth` deep, of which a path of `accepted` was kept: positions are
    /// depths (position i counts cycles whose tree reached depth i).
    pub fn record_tree(&mut self, nodes: usize, depth: usize, accepted: usize) {
        self.cycles += 1;
        self.empty_drafts += u64::from(nodes == 0);
        self.partially_accepted += u64::from(accepted > 0 && accepted < depth);
        self.fully_rejected += u64::from(nodes > 0 && accepted == 0);
        self.drafted += nodes as u64;
        self.accepted += accepted as u64;
        for i in 0..depth.min(self.drafted_per_position.len()) {
            self.drafted_per_position[i] += 1;
        }
        for i in 0..accepted.min(self.accepted_per_position.len()) {
            self.accepted_per_position[i] += 1;
        }
        let last = self.accept_len_histogram.len() - 1;
        self.accept_len_histogram[accepted.min(last)] += 1;
    }

    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.cycles += 1;
        self.empty_drafts += u64::from(drafted == 0);
        self.partially_accepted += u64::from(accepted > 0 && accepted < drafted);
        self.fully_rejected += u64::from(drafted > 0 && accepted == 0);
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        for i in 0..drafted {
            self.drafted_per_position[i] += 1;
        }
        for i in 0..accepted {
            self.accepted_per_position[i] += 1;
        }
        self.accept_len_histogram[accepted] += 1;
    }

    /// Adds another run's counts (same method and k) to these.
    pub fn merge(&mut self, other: &SpeculationStats) {
        debug_assert_eq!(self.draft_tokens, other.draft_tokens);
        self.cycles += other.cycles;
        self.empty_drafts += other.empty_drafts;
        self.partially_accepted += other.partially_accepted;
        self.fully_rejected += other.fully_rejected;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.draft_passes += other.draft_passes;
        self.catch_up_cycles += other.catch_up_cycles;
        for (a, b) in self
            .drafted_per_position
            .iter_mut()
            .zip(&other.drafted_per_position)
        {
            *a += b;
        }
        for (a, b) in self
            .accepted_per_position
            .iter_mut()
            .zip(&other.accepted_per_position)
        {
            *a += b;
        }
        for (a, b) in self
            .accept_len_histogram
            .iter_mut()
            .zip(&other.accept_len_histogram)
        {
            *a += b;
        }
    }

    /// accepted / drafted.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// 1 + accepted / cycles: tokens produced per verify pass.
    pub fn mean_accept_len(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            1.0 + self.accepted as f64 / self.cycles as f64
        }
    }

    /// Acceptance rate at draft positions 1..=k (accepted there / drafted there).
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        self.drafted_per_position
            .iter()
            .zip(&self.accepted_per_position)
            .map(|(&d, &a)| if d == 0 { 0.0 } else { a as f64 / d as f64 })
            .collect()
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "method": self.method,
            "draft_tokens": self.draft_tokens,
            "cycles": self.cycles,
            "empty_drafts": self.empty_drafts,
            "partially_accepted": self.partially_accepted,
            "fully_rejected": self.fully_rejected,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate(),
            "mean_accept_len": self.mean_accept_len(),
            "per_position_acceptance": self.per_position_acceptance(),
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_position": self.accepted_per_position,
            "accept_len_histogram": self.accept_len_histogram,
        })
    }

    /// Lines for the end-of-run summary.
    pub fn table(&self) -> String {
        let per_pos: Vec<String> = self
            .per_position_acceptance()
            .iter()
            .map(|r| format!("{:.0}%", r * 100.0))
            .collect();
        format!(
            "speculation ({}, k={}): {} cycles, drafted {}, accepted {} ({:.1}%), mean accepted length {:.2}\n  \
             drafts cut short: {} partly accepted, {} rejected at once; {} cycles without a draft\n  \
             per position: {}\n  accepted-length histogram (0..={}): {:?}\n",
            self.method,
            self.draft_tokens,
            self.cycles,
            self.drafted,
            self.accepted,
            self.acceptance_rate() * 100.0,
            self.mean_accept_len(),
            self.partially_accepted,
            self.fully_rejected,
            self.empty_drafts,
            per_pos.join(" "),
            self.draft_tokens,
            self.accept_len_histogram
        )
    }
}

#[cfg(test)]
mod tests;
