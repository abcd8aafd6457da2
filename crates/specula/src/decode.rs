//! The decode loop, readable as a story. Each step is a profiler step made of phases:
//!
//! ```text
//! prefill step:  prefill (forward over the prompt) -> sample -> commit -> emit
//! decode step:   verify (forward over the pending token) -> sample -> commit -> emit
//! ```
//!
//! Plain decoding is the speculative cycle with no drafter: `verify` runs the target over one pending token.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::model::{ForwardOptions, LlamaModel, LogitsFor};
use crate::profile::{Phase, Profiler, StepKind};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    /// At least 1.
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at the model's end-of-turn tokens (on by default; off to force a fixed length in benchmarks).
    pub stop_at_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An end-of-turn token was sampled (it is not part of the output).
    EndOfText,
    MaxTokens,
    /// The model's context is full.
    ContextFull,
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
}

/// Checks a request against the model before any work is done.
pub fn validate_request(model: &LlamaModel, req: &GenerateRequest) -> Result<()> {
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
    let ctx = model.config.context_length;
    if req.prompt_tokens.len() >= ctx {
        return Err(Error::ContextOverflow {
            prompt_tokens: req.prompt_tokens.len(),
            max_new_tokens: req.max_new_tokens,
            context_length: ctx,
        });
    }
    Ok(())
}

/// Generates up to `max_new_tokens` tokens, streaming text to `on_text` as it is produced.
pub fn generate(
    model: &LlamaModel,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    prof: &Profiler,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    validate_request(model, req)?;
    let mut sampler = Sampler::new(req.sampling)?;
    let mut cache = model.new_cache();
    let mut stream = StreamDecoder::new();
    let mut tokens: Vec<u32> = Vec::with_capacity(req.max_new_tokens);
    let mut timing = Timing::default();
    let ctx = model.config.context_length;
    let last_only = ForwardOptions {
        logits: LogitsFor::Last,
        capture_layers: &[],
    };

    // Prefill step: the prompt in one forward pass, then the first token.
    let prefill_start = Instant::now();
    prof.begin_step(StepKind::Prefill);
    let logits = {
        let _s = prof.span(Phase::Prefill);
        model.forward(&req.prompt_tokens, &mut cache, &last_only, prof)?
    };
    let mut next = {
        let _s = prof.span(Phase::Sample);
        sampler.sample(logits.last())
    };
    let mut stop = commit_token(tokenizer, req, next, &mut tokens, cache.len(), ctx, prof);
    if stop != Some(StopReason::EndOfText) {
        emit_token(tokenizer, &mut stream, next, prof, on_text)?;
    }
    prof.end_step();
    timing.prefill_s = prefill_start.elapsed().as_secs_f64();

    // Decode steps: one target forward over the pending token each.
    let decode_start = Instant::now();
    while stop.is_none() {
        prof.begin_step(StepKind::Decode);
        let logits = {
            let _s = prof.span(Phase::Verify);
            model.forward(&[next], &mut cache, &last_only, prof)?
        };
        next = {
            let _s = prof.span(Phase::Sample);
            sampler.sample(logits.last())
        };
        stop = commit_token(tokenizer, req, next, &mut tokens, cache.len(), ctx, prof);
        if stop != Some(StopReason::EndOfText) {
            emit_token(tokenizer, &mut stream, next, prof, on_text)?;
        }
        timing.decode_tokens += 1;
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
    })
}

/// Appends the sampled token to the output, or says why generation stops. `cached` is the number of positions
/// in the cache, which the pending token would extend.
fn commit_token(
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    token: u32,
    tokens: &mut Vec<u32>,
    cached: usize,
    context_length: usize,
    prof: &Profiler,
) -> Option<StopReason> {
    let _s = prof.span(Phase::Commit);
    if req.stop_at_eos && tokenizer.is_stop(token) {
        return Some(StopReason::EndOfText);
    }
    tokens.push(token);
    if tokens.len() >= req.max_new_tokens {
        Some(StopReason::MaxTokens)
    } else if cached + 1 >= context_length {
        Some(StopReason::ContextFull)
    } else {
        None
    }
}

fn emit_token(
    tokenizer: &Tokenizer,
    stream: &mut StreamDecoder,
    token: u32,
    prof: &Profiler,
    on_text: &mut dyn FnMut(&str),
) -> Result<()> {
    let _s = prof.span(Phase::Emit);
    if let Some(text) = stream.push(tokenizer, token)? {
        on_text(&text);
    }
    Ok(())
}
