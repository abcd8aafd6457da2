//! The decode loop, readable as a story. Each step is a profiler step made of phases:
//!
//! ```text
//! prefill step:  prefill (forward over the prompt) -> sample -> commit -> emit
//! decode step:   verify (forward over the pending token) -> sample -> commit -> emit
//! ```
//!
//! Plain decoding is the speculative cycle with no drafter: `verify` runs the target over one pending token.

use std::time::Instant;

use crate::draft::{Draft, Drafter};
use crate::error::{Error, Result};
use crate::model::{ForwardOptions, LogitsFor, Model, SequenceInput, TreeMask};
use crate::profile::{Phase, Profiler, StepKind};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::verify::{self, Acceptance};

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An end-of-turn token was sampled (it is not part of the output).
    EndOfText,
    MaxTokens,
    /// The model's context is full.
    ContextFull,
    /// `GenerateRequest::cancel` was set.
    Cancelled,
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
    /// Generated tokens, without the stop token.
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
    pub timing: Timing,
    /// Acceptance statistics when a drafter was used.
    pub speculation: Option<SpeculationStats>,
}

/// The most new tokens a prompt of `prompt_tokens` leaves room for: every position up to the context length,
/// plus the last token, which is generated from the last position but never needs a cache slot itself.
/// Generation stops there with [`StopReason::ContextFull`], whatever `max_new_tokens` asks.
pub fn context_room(model: &dyn Model, prompt_tokens: usize) -> usize {
    let ctx = model.config().context_length;
    if prompt_tokens < ctx {
        ctx - prompt_tokens + 1
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
/// decode step is one speculative cycle; without, it is a plain decoding step. Both run the same loop.
pub fn generate(
    model: &dyn Model,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    mut speculation: Option<Speculation<'_>>,
    prof: &Profiler,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    validate_request(model, req)?;
    if let Some(s) = &speculation {
        check_draft_tokens(s.draft_tokens)?;
    }
    let mut simulated = speculation
        .as_ref()
        .and_then(|s| s.simulate_acceptance)
        .map(|p| verify::SimulatedAcceptance::new(p, req.sampling.seed))
        .transpose()?;
    let mut sampler = Sampler::new(req.sampling)?;
    let draft_room = speculation.as_ref().map_or(0, |s| s.draft_tokens);
    let mut cache = model.new_cache_for(req.prompt_tokens.len(), req.max_new_tokens, draft_room)?;
    let mut stream = StreamDecoder::new();
    // Never sized by max_new_tokens alone (a caller may ask for more than the context can hold).
    let room = context_room(model, req.prompt_tokens.len());
    let mut tokens: Vec<u32> = Vec::with_capacity(req.max_new_tokens.min(room));
    // Prompt and committed tokens; the last one is pending (not yet in the target's cache).
    let mut context: Vec<u32> = req.prompt_tokens.clone();
    let mut timing = Timing::default();
    let mut stats = speculation
        .as_ref()
        .map(|s| SpeculationStats::new(s.drafter.method(), s.draft_tokens));
    // Generation stops where the cache is full: the model's context, or less if the cache was sized smaller.
    let ctx = cache.capacity();

    // Target layers the drafter reads (EAGLE-3), captured in every target forward.
    let capture: Vec<usize> = speculation
        .as_ref()
        .map(|s| s.drafter.target_layers().to_vec())
        .unwrap_or_default();
    let target_opts = ForwardOptions {
        capture_layers: &capture,
        vocab_limit: None,
    };

    // Prefill step: the prompt in one forward pass, then the first token.
    let prefill_start = Instant::now();
    prof.begin_step(StepKind::Prefill);
    let logits = {
        let _s = prof.span(Phase::Prefill);
        model.forward_one(
            &req.prompt_tokens,
            cache.as_mut(),
            &target_opts,
            LogitsFor::Last,
            prof,
        )?
    };
    if let (Some(s), false) = (speculation.as_mut(), capture.is_empty()) {
        let _s = prof.span(Phase::Draft);
        s.drafter.observe_target(
            0,
            &logits.hidden,
            &(0..req.prompt_tokens.len()).collect::<Vec<_>>(),
        )?;
    }
    let first = {
        let _s = prof.span(Phase::Sample);
        sampler.sample_row(logits.logits.as_ref(), 0)?
    };
    let (mut committed, mut stop) = commit_tokens(
        tokenizer,
        req,
        &[first],
        &mut tokens,
        &mut context,
        cache.len(),
        ctx,
        prof,
    );
    emit_tokens(
        tokenizer,
        &mut stream,
        &tokens[tokens.len() - committed..],
        prof,
        on_text,
    )?;
    prof.end_step();
    timing.prefill_s = prefill_start.elapsed().as_secs_f64();

    // Decode steps: draft -> verify -> accept -> commit -> emit.
    let decode_start = Instant::now();
    while stop.is_none() {
        if req
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        {
            stop = Some(StopReason::Cancelled);
            break;
        }
        prof.begin_step(StepKind::Decode);
        let pending = *context.last().unwrap_or(&0);
        let base = cache.len();
        let remaining = req.max_new_tokens - tokens.len();
        let draft = match speculation.as_mut() {
            Some(s) => {
                let _s = prof.span(Phase::Draft);
                // Never draft past the token budget or the context: every accepted token must fit.
                let k = s
                    .draft_tokens
                    .min(remaining - 1)
                    .min(ctx.saturating_sub(base + 1));
                if k == 0 {
                    Draft::default()
                } else {
                    let mut d = s.drafter.propose(&context, k, &req.sampling)?;
                    d.tokens.truncate(k);
                    // A tree's nodes come after their parents, so its first k nodes are a tree.
                    if let Some(parents) = d.parents.as_mut() {
                        parents.truncate(k);
                    }
                    d
                }
            }
            None => Draft::default(),
        };
        // A tree draft is verified with a tree mask: row 0 is the pending token, row i + 1 draft token i, each
        // attending to its ancestors.
        let tree = match &draft.parents {
            Some(parents) => {
                if simulated.is_some() {
                    return Err(crate::error::Error::InvalidArgument(
                        "tree drafts cannot be verified by simulated acceptance (it takes chains)"
                            .into(),
                    ));
                }
                let mut rows = vec![None];
                rows.extend(parents.iter().map(|p| Some(p.map_or(0, |p| p + 1))));
                Some(TreeMask::new(rows)?)
            }
            None => None,
        };
        let verify_start = Instant::now();
        let logits = {
            let _s = prof.span(Phase::Verify);
            let mut input = Vec::with_capacity(1 + draft.tokens.len());
            input.push(pending);
            input.extend_from_slice(&draft.tokens);
            let which = if draft.tokens.is_empty() {
                LogitsFor::Last
            } else {
                LogitsFor::All
            };
            let mut batch = [SequenceInput {
                tokens: &input,
                cache: cache.as_mut(),
                logits: which,
                tree: tree.as_ref(),
            }];
            model
                .forward(&mut batch, &target_opts, prof)?
                .pop()
                .ok_or_else(|| {
                    crate::error::Error::InvalidArgument("the backend returned no output".into())
                })?
        };
        // Host time of the verify call: right on the CPU, only the launches on a GPU (see below).
        let verify_host_s = verify_start.elapsed().as_secs_f64();
        // The draft tokens kept, in order (a prefix for a chain, the accepted path for a tree).
        let (acceptance, path) = if let Some(parents) = &draft.parents {
            let _s = prof.span(Phase::Accept);
            if sampler.params().is_greedy() {
                verify::accept_tree(&draft.tokens, parents, logits.logits.as_ref())?
            } else {
                verify::accept_tree_sampled(
                    &draft.tokens,
                    parents,
                    logits.logits.as_ref(),
                    &mut sampler,
                )?
            }
        } else {
            let acceptance = if let Some(sim) = simulated.as_mut() {
                let _s = prof.span(Phase::Accept);
                sim.accept(&draft, logits.logits.as_ref())?
            } else if speculation.is_some() {
                let _s = prof.span(Phase::Accept);
                verify::accept(&draft, logits.logits.as_ref(), &mut sampler)?
            } else {
                let _s = prof.span(Phase::Sample);
                Acceptance {
                    accepted: 0,
                    next: sampler.sample_row(logits.logits.as_ref(), 0)?,
                }
            };
            let path: Vec<usize> = (0..acceptance.accepted).collect();
            (acceptance, path)
        };
        if let Some(st) = stats.as_mut() {
            match &tree {
                Some(t) => st.record_tree(
                    draft.tokens.len(),
                    (1..t.len()).map(|r| t.depth(r)).max().unwrap_or(0),
                    acceptance.accepted,
                ),
                None => st.record(draft.tokens.len(), acceptance.accepted),
            }
        }
        if let Some(s) = speculation.as_mut() {
            // The verify pass's time by the profiler's clock (device time on a GPU, where a host timer would
            // see only the launches); read after acceptance, which waited for the pass.
            let seconds = prof
                .last_span_seconds(Phase::Verify)
                .unwrap_or(verify_host_s);
            s.drafter.observe_verify(1 + draft.tokens.len(), seconds);
        }
        // Rows of the verify pass that stay: the pending token's and the accepted drafts'.
        let kept_rows: Vec<usize> = std::iter::once(0)
            .chain(path.iter().map(|&i| i + 1))
            .collect();
        if let (Some(s), false) = (speculation.as_mut(), capture.is_empty()) {
            // Their hidden states are the drafter's next input.
            let _s = prof.span(Phase::Draft);
            s.drafter.observe_target(base, &logits.hidden, &kept_rows)?;
        }
        let mut new_tokens: Vec<u32> = path.iter().map(|&i| draft.tokens[i]).collect();
        new_tokens.push(acceptance.next);
        if tree.is_some() {
            // The accepted path's keys and values move next to the pending token's; the other branches go.
            cache.keep_new_rows(base, &kept_rows)?;
        }
        let kept = base + 1 + acceptance.accepted;
        (committed, stop) = {
            cache.truncate(kept);
            commit_tokens(
                tokenizer,
                req,
                &new_tokens,
                &mut tokens,
                &mut context,
                kept,
                ctx,
                prof,
            )
        };
        emit_tokens(
            tokenizer,
            &mut stream,
            &tokens[tokens.len() - committed..],
            prof,
            on_text,
        )?;
        timing.decode_tokens += committed + usize::from(stop == Some(StopReason::EndOfText));
        prof.end_step();
    }
    timing.decode_s = decode_start.elapsed().as_secs_f64();
    if let Some(rest) = stream.flush(tokenizer)? {
        on_text(&rest);
    }
    let text = tokenizer.decode(&tokens)?;
    Ok(GenerateOutput {
        prompt_tokens: req.prompt_tokens.len(),
        tokens,
        text,
        stop_reason: stop.unwrap_or(StopReason::MaxTokens),
        timing,
        speculation: stats,
    })
}

/// Appends new tokens to the output until one of them stops generation; returns how many were appended and
/// why generation stops, if it does. `cached` is the target cache length, which the last new token would extend.
#[allow(clippy::too_many_arguments)]
fn commit_tokens(
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    new_tokens: &[u32],
    tokens: &mut Vec<u32>,
    context: &mut Vec<u32>,
    cached: usize,
    context_length: usize,
    prof: &Profiler,
) -> (usize, Option<StopReason>) {
    let _s = prof.span(Phase::Commit);
    let mut appended = 0;
    for &token in new_tokens {
        if req.stop_at_eos && tokenizer.is_stop(token) {
            return (appended, Some(StopReason::EndOfText));
        }
        tokens.push(token);
        context.push(token);
        appended += 1;
        if tokens.len() >= req.max_new_tokens {
            return (appended, Some(StopReason::MaxTokens));
        }
    }
    // The pending token will occupy position `cached`.
    let stop = (cached >= context_length).then_some(StopReason::ContextFull);
    (appended, stop)
}

fn emit_tokens(
    tokenizer: &Tokenizer,
    stream: &mut StreamDecoder,
    new_tokens: &[u32],
    prof: &Profiler,
    on_text: &mut dyn FnMut(&str),
) -> Result<()> {
    let _s = prof.span(Phase::Emit);
    for &token in new_tokens {
        if let Some(text) = stream.push(tokenizer, token)? {
            on_text(&text);
        }
    }
    Ok(())
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
