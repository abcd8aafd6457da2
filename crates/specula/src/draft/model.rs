//! A separate small draft model sharing the target's tokenizer (e.g. Qwen2.5-Coder 0.5B drafting for 1.5B).

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use crate::draft::{Draft, Drafter};
use crate::error::{Error, Result};
use crate::model::{ForwardOptions, ForwardOutput, LoadedModel, LogitsFor, Model, SequenceCache};
use crate::profile::Profiler;
use crate::sampling::{self, SamplingParams};

pub struct ModelDrafter<'a> {
    model: &'a dyn Model,
    cache: Box<dyn SequenceCache>,
    /// The tokens whose keys/values are in `cache`, in order.
    cached: Vec<u32>,
    rng: ChaCha20Rng,
    quiet: Profiler,
    /// Draft only among token ids `0..limit` (see `with_vocab_limit`).
    vocab_limit: Option<usize>,
    /// Stop drafting once the draft's own chance that the whole draft is accepted falls below this (see
    /// `with_min_confidence`); 0 drafts k tokens.
    min_confidence: f64,
}

impl<'a> ModelDrafter<'a> {
    /// `seed` drives the draft's own sampling (independent of the target's RNG).
    pub fn new(model: &'a dyn Model, seed: u64) -> Result<Self> {
        Ok(ModelDrafter {
            cache: model.new_cache(model.config().context_length)?,
            model,
            cached: Vec::new(),
            rng: ChaCha20Rng::seed_from_u64(seed ^ 0x5eed_d4af),
            quiet: Profiler::disabled(),
            vocab_limit: None,
            min_confidence: 0.0,
        })
    }

    /// Drafts while the product of the draft's top-token probabilities over the drafted positions (greedy: the
    /// softmax at temperature 1; sampling: the sampling distribution's largest probability, decided before the
    /// draw so that the proposal stays distributed as the draft distribution) stays at least `c`: the draft
    /// model's estimate that the target accepts the whole draft. A drafted token the target rejects costs a draft
    /// step and a verify slot, so stopping at an uncertain position saves both; the verification (and so the
    /// output) is unchanged, whatever `c`.
    pub fn with_min_confidence(mut self, c: f64) -> Result<Self> {
        check_min_confidence(c)?;
        self.min_confidence = c;
        Ok(self)
    }

    /// Restricts drafting to token ids `0..limit`: the draft's LM head then reads only its first `limit` rows.
    /// BPE vocabularies number tokens roughly by merge frequency, so a prefix keeps most tokens a model
    /// actually emits, and on a small draft model with a large vocabulary the head is a big share of each draft
    /// step (Qwen2.5 0.5B: 136M of its 494M weights). Lossless either way: the target verifies every token, and
    /// with sampling the draft distribution is simply zero outside the prefix (speculative sampling is exact
    /// for any draft distribution).
    pub fn with_vocab_limit(mut self, limit: Option<usize>) -> Result<Self> {
        check_vocab_limit(self.model, limit)?;
        self.vocab_limit = limit;
        Ok(self)
    }

    /// Feeds `tokens` after the cached prefix and returns the logits of the last one (where the model keeps
    /// them: a GPU draft model's stay there unless sampling needs the whole row).
    fn feed(&mut self, tokens: &[u32]) -> Result<ForwardOutput> {
        let opts = ForwardOptions {
            capture_layers: &[],
            vocab_limit: self.vocab_limit,
        };
        let out = self.model.forward_one(
            tokens,
            self.cache.as_mut(),
            &opts,
            LogitsFor::Last,
            &self.quiet,
        )?;
        self.cached.extend_from_slice(tokens);
        Ok(out)
    }
}

impl ModelDrafter<'_> {
    /// How much of `context` the cache already holds, keeping at least one token to feed (its logits are
    /// drawn from).
    fn common_prefix(&self, context: &[u32]) -> usize {
        self.cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len().saturating_sub(1))
    }
}

impl Drafter for ModelDrafter<'_> {
    fn method(&self) -> &'static str {
        "model"
    }

    fn lag(&self, context: &[u32]) -> usize {
        context.len() - self.common_prefix(context)
    }

    fn propose(&mut self, context: &[u32], k: usize, sampling: &SamplingParams) -> Result<Draft> {
        if k == 0 || context.is_empty() {
            return Ok(Draft::default());
        }
        // Roll the cache back to the longest prefix it shares with the context (rejected drafts drop out here),
        // keeping at least one token to feed so there are logits to draw from.
        let common = self.common_prefix(context);
        self.cache.truncate(common);
        self.cached.truncate(common);
        let room = self
            .model
            .config()
            .context_length
            .saturating_sub(context.len());
        let k = k.min(room);
        if k == 0 {
            return Ok(Draft::default());
        }
        let mut logits = self.feed(&context[common..])?;
        let mut passes = 1;
        let mut tokens = Vec::with_capacity(k);
        let mut distributions = Vec::with_capacity(k);
        let mut all_accepted = 1.0f64;
        for i in 0..k {
            let token = if sampling.is_greedy() {
                // Only the top token (and its probability for the bar) comes back, not the row.
                let (token, p) = if self.min_confidence > 0.0 {
                    last_row(logits.logits.top_tokens()?)?
                } else {
                    (last_row(logits.logits.argmax_rows()?)?, 1.0)
                };
                all_accepted *= p as f64;
                if all_accepted < self.min_confidence {
                    break;
                }
                token
            } else {
                let dist = sampling::distribution(&logits.last()?, sampling);
                // Decided before the draw: a proposal kept only for some draws would no longer be distributed
                // as `dist`, and verifying it against `dist` would bias the output.
                all_accepted *= dist.probs.iter().copied().fold(0.0f32, f32::max) as f64;
                if all_accepted < self.min_confidence {
                    break;
                }
                let token = sampling::draw(&dist, &mut self.rng);
                distributions.push(dist);
                token
            };
            tokens.push(token);
            if i + 1 < k {
                logits = self.feed(&[token])?;
                passes += 1;
            }
        }
        Ok(Draft {
            tokens,
            distributions: (!sampling.is_greedy()).then_some(distributions),
            parents: None,
            passes,
            catching_up: false,
        })
    }
}

/// The last of a pass's per-row results (the drafter asks for the last row's logits only).
fn last_row<T>(rows: Vec<T>) -> Result<T> {
    rows.into_iter()
        .last()
        .ok_or_else(|| Error::InvalidArgument("the draft model returned no logits".into()))
}

/// A draft model must speak the target's vocabulary. Embedding tables may differ only in padding rows past the
/// tokenizer's last token (as llama.cpp allows).
/// Checks a `--draft-vocab` value against the draft model.
pub fn check_vocab_limit(draft: &dyn Model, limit: Option<usize>) -> Result<()> {
    if let Some(n) = limit {
        let vocab = draft.config().vocab_size;
        if n == 0 || n > vocab {
            return Err(Error::InvalidArgument(format!(
                "--draft-vocab must be between 1 and the draft model's vocabulary size {vocab}, got {n}"
            )));
        }
    }
    Ok(())
}

/// The CLI's default `--draft-confidence`: on code.jsonl (Qwen 1.5B target, 0.5B draft, two interleaved bench
/// runs, docs/benchmarks.md) 0.6 was best or tied at k = 3 (+2-3 points over always drafting k) and kept larger k
/// from losing (k = 5/6: +9-17 points); 0.4-0.7 were within 2 points of each other. [`ModelDrafter::new`] itself
/// always drafts k.
pub const DEFAULT_MIN_CONFIDENCE: f64 = 0.6;

/// Checks a `--draft-confidence` value.
pub fn check_min_confidence(c: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&c) {
        return Err(Error::InvalidArgument(format!(
            "--draft-confidence must be between 0 and 1 (got {c})"
        )));
    }
    Ok(())
}

pub fn check_compatible(target: &LoadedModel, draft: &LoadedModel) -> Result<()> {
    let (tv, dv) = (target.tokenizer.vocab_size(), draft.tokenizer.vocab_size());
    let mismatch = |what: String| {
        Err(Error::InvalidArgument(format!(
            "draft model {} cannot draft for target {}: {what}",
            draft.spec, target.spec
        )))
    };
    if tv != dv {
        return mismatch(format!(
            "the target's tokenizer has {tv} tokens and the draft's has {dv}"
        ));
    }
    if tv == 0 {
        return mismatch("both tokenizers have an empty vocabulary".into());
    }
    for id in (0..tv as u32)
        .step_by((tv / 512).max(1))
        .chain([tv as u32 - 1])
    {
        if target.tokenizer.token_text(id) != draft.tokenizer.token_text(id) {
            return mismatch(format!(
                "token {id} is {:?} in the target and {:?} in the draft",
                target.tokenizer.token_text(id),
                draft.tokenizer.token_text(id)
            ));
        }
    }
    let (te, de) = (
        target.model.config().vocab_size,
        draft.model.config().vocab_size,
    );
    if te.min(de) < tv {
        return mismatch(format!(
            "embedding rows {te} (target) and {de} (draft) do not cover {tv} tokens"
        ));
    }
    Ok(())
}
