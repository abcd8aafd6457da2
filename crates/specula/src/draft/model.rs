//! A separate small draft model sharing the target's tokenizer (e.g. Qwen2.5-Coder 0.5B drafting for 1.5B).

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use crate::draft::eagle3::compute::{
    HeadCompute, HeadInput, HeadOutput, HeadPass, HeadRows, HeadWant,
};
use crate::draft::{BatchedPass, BatchedStart, Draft, Drafter};
use crate::error::{Error, Result};
use crate::model::{
    ForwardOptions, ForwardOutput, LoadedModel, LogitsFor, Model, SequenceCache, SequenceInput,
};
use crate::profile::Profiler;
use crate::sampling::{self, Distribution, SamplingParams};

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
    /// The draft a batched round is building ([`Drafter::batched_begin`] .. [`Drafter::batched_finish`]).
    batched: Option<DraftInProgress>,
    /// The most tokens of a catch-up one cycle feeds (see `with_catch_up_piece`); None feeds it whole.
    catch_up_piece: Option<usize>,
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
            batched: None,
            catch_up_piece: None,
        })
    }

    /// Feeds a long catch-up (a new request's prompt, or what the drafter missed while cut) `n` tokens a cycle,
    /// drafting nothing until it is fed, instead of whole in one cycle: on a CPU a 0.5B draft model feeds a
    /// 60-token prompt in ~280 ms, one stall of that size in a served stream (its inter-token p99 341 ms against
    /// plain decoding's 58-61 at one stream on 2 cores), where pieces spread it over a few steps. A feed of up to
    /// the draft length plus one (the last cycle's tokens) is never cut. None (the default) feeds it whole.
    pub fn with_catch_up_piece(mut self, n: Option<usize>) -> Result<Self> {
        if n == Some(0) {
            return Err(Error::InvalidArgument(
                "a draft model's catch-up piece must be at least one token".into(),
            ));
        }
        self.catch_up_piece = n;
        Ok(self)
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

    /// Runs one draft pass feeding `tokens` after the cached prefix (`begin` and `advance` note them as cached);
    /// the logits of its last row stay where the model keeps them (a GPU draft model's stay there unless sampling
    /// needs the whole row).
    fn run_pass(&mut self, tokens: &[u32]) -> Result<ForwardOutput> {
        let opts = ForwardOptions {
            capture_layers: &[],
            vocab_limit: self.vocab_limit,
        };
        self.model.forward_one(
            tokens,
            self.cache.as_mut(),
            &opts,
            LogitsFor::Last,
            &self.quiet,
        )
    }

    /// Rolls the cache back to the longest prefix it shares with `context` (rejected drafts drop out here) and
    /// starts a draft of up to `k` tokens: the tokens its first pass feeds (at least one, so there are logits to
    /// draw from), or None when there is nothing to draft or no room.
    fn begin(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
    ) -> Option<(DraftInProgress, Vec<u32>)> {
        if k == 0 || context.is_empty() {
            return None;
        }
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
            return None;
        }
        let mut feed = context[common..].to_vec();
        // A catch-up longer than a piece is fed a piece this cycle, with nothing drafted.
        let piece = self.catch_up_piece.map(|n| n.max(k + 2));
        let catching_up = piece.is_some_and(|n| feed.len() > n);
        if let (true, Some(n)) = (catching_up, piece) {
            feed.truncate(n);
        }
        self.cached.extend_from_slice(&feed);
        let draft = DraftInProgress {
            k: if catching_up { 0 } else { k },
            greedy: sampling.is_greedy(),
            tokens: Vec::with_capacity(k),
            distributions: Vec::new(),
            all_accepted: 1.0,
            passes: 1,
            catching_up,
        };
        Some((draft, feed))
    }

    /// Takes a pass's last row: the token the next pass feeds while the draft goes on, None once it is complete
    /// (k tokens, or the confidence bar reached).
    fn advance(
        &mut self,
        d: &mut DraftInProgress,
        row: RowResult<'_>,
        sampling: &SamplingParams,
    ) -> Option<u32> {
        if d.catching_up {
            // A pass that only fed part of a catch-up: no draft this cycle.
            return None;
        }
        let token = match row {
            RowResult::Top(token, p) => {
                d.all_accepted *= p as f64;
                if d.all_accepted < self.min_confidence {
                    return None;
                }
                token
            }
            RowResult::Logits(logits) => {
                let dist = sampling::distribution(logits, sampling);
                // Decided before the draw: a proposal kept only for some draws would no longer be distributed
                // as `dist`, and verifying it against `dist` would bias the output.
                d.all_accepted *= dist.probs.iter().copied().fold(0.0f32, f32::max) as f64;
                if d.all_accepted < self.min_confidence {
                    return None;
                }
                let token = sampling::draw(&dist, &mut self.rng);
                d.distributions.push(dist);
                token
            }
        };
        d.tokens.push(token);
        if d.tokens.len() == d.k {
            return None;
        }
        self.cached.push(token);
        d.passes += 1;
        Some(token)
    }

    /// What a batched pass should return for draft `d`: the top token and its probability when greedy, else the
    /// row.
    fn want(d: &DraftInProgress) -> HeadWant {
        HeadWant {
            top_only: d.greedy,
            ..Default::default()
        }
    }
}

/// A draft being built pass by pass: [`ModelDrafter::propose`] runs the passes one after the other; a server's
/// requests run theirs in shared rounds ([`DraftModelRounds`]).
#[derive(Debug)]
struct DraftInProgress {
    k: usize,
    greedy: bool,
    tokens: Vec<u32>,
    distributions: Vec<Distribution>,
    all_accepted: f64,
    passes: usize,
    /// The cycle only feeds part of a catch-up ([`Draft::catching_up`]).
    catching_up: bool,
}

impl DraftInProgress {
    fn into_draft(self) -> Draft {
        Draft {
            tokens: self.tokens,
            distributions: (!self.greedy).then_some(self.distributions),
            parents: None,
            passes: self.passes,
            catching_up: self.catching_up,
        }
    }
}

/// What a draft pass's last row gives the drafter.
enum RowResult<'r> {
    /// Its top token and that token's probability (greedy; 1 when no bar needs it).
    Top(u32, f32),
    /// The whole row (sampling).
    Logits(&'r [f32]),
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
        let Some((mut d, feed)) = self.begin(context, k, sampling) else {
            return Ok(Draft::default());
        };
        let mut out = self.run_pass(&feed)?;
        if d.catching_up {
            return Ok(d.into_draft());
        }
        loop {
            let next = if d.greedy {
                // Only the top token (and its probability for the bar) comes back, not the row.
                let (token, p) = if self.min_confidence > 0.0 {
                    last_row(out.logits.top_tokens()?)?
                } else {
                    (last_row(out.logits.argmax_rows()?)?, 1.0)
                };
                self.advance(&mut d, RowResult::Top(token, p), sampling)
            } else {
                let row = out.last()?;
                self.advance(&mut d, RowResult::Logits(&row), sampling)
            };
            match next {
                Some(token) => out = self.run_pass(&[token])?,
                None => break,
            }
        }
        Ok(d.into_draft())
    }

    fn batched_begin(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
        _beside_others: bool,
    ) -> Result<BatchedStart> {
        Ok(match self.begin(context, k, sampling) {
            None => BatchedStart::Nothing,
            Some((d, feed)) => {
                let want = Self::want(&d);
                self.batched = Some(d);
                BatchedStart::Pass(BatchedPass {
                    tokens: feed,
                    features: None,
                    device_features: None,
                    want,
                })
            }
        })
    }

    fn batched_cache(&mut self) -> Option<&mut dyn SequenceCache> {
        Some(self.cache.as_mut())
    }

    fn batched_after(
        &mut self,
        output: HeadOutput,
        sampling: &SamplingParams,
    ) -> Result<Option<BatchedPass>> {
        let mut d = self.batched.take().ok_or_else(|| {
            Error::InvalidArgument(
                "a draft model's batched pass came back with no draft begun".into(),
            )
        })?;
        let row = if d.greedy {
            let (token, p) = last_row(output.top)?;
            RowResult::Top(token, p)
        } else {
            RowResult::Logits(&output.logits)
        };
        let next = self.advance(&mut d, row, sampling);
        let want = Self::want(&d);
        self.batched = Some(d);
        Ok(next.map(|token| BatchedPass {
            tokens: vec![token],
            features: None,
            device_features: None,
            want,
        }))
    }

    fn batched_finish(&mut self) -> Result<Draft> {
        Ok(self
            .batched
            .take()
            .map(DraftInProgress::into_draft)
            .unwrap_or_default())
    }
}

/// A draft model's passes for several requests at once: one forward pass of the draft model a round, each
/// request's rows on its own cache, through the interface a shared EAGLE-3 head's rounds use
/// ([`crate::decode::StepLimits::shared_head`]). Each request's result is what its pass alone gives (the
/// backends' kernels are row-independent). On a GPU a round costs about one pass whatever the requests (a pass
/// is latency-bound there); on a CPU the draft's weights are read once a round instead of once a request.
pub struct DraftModelRounds<'m> {
    pub model: &'m dyn Model,
    /// `--draft-vocab`: logits of the first ids only.
    pub vocab_limit: Option<usize>,
}

impl HeadCompute for DraftModelRounds<'_> {
    fn device(&self) -> String {
        self.model.device()
    }

    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>> {
        self.model.new_cache(capacity)
    }

    fn run(
        &self,
        target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &mut dyn SequenceCache,
        want: HeadWant,
    ) -> Result<HeadOutput> {
        if !matches!(rows, HeadRows::Chain) {
            return Err(Error::InvalidArgument(
                "a draft model drafts chains, not trees".into(),
            ));
        }
        let mut passes = [HeadPass {
            tokens,
            input,
            cache,
            want,
        }];
        last_row(self.run_many(target, &mut passes)?)
    }

    fn run_many(
        &self,
        _target: &dyn Model,
        passes: &mut [HeadPass<'_>],
    ) -> Result<Vec<HeadOutput>> {
        if let Some(p) = passes.iter().find(|p| p.want.outputs || p.want.top_k > 0) {
            return Err(Error::InvalidArgument(format!(
                "a draft model's pass returns a top token or a row, not {:?}",
                p.want
            )));
        }
        if passes.iter().any(|p| !matches!(p.input, HeadInput::Last)) {
            return Err(Error::InvalidArgument(
                "a draft model's pass reads token ids only, not hidden states".into(),
            ));
        }
        let mut batch: Vec<SequenceInput<'_>> = passes
            .iter_mut()
            .map(|p| SequenceInput {
                tokens: p.tokens,
                cache: &mut *p.cache,
                logits: LogitsFor::Last,
                tree: None,
            })
            .collect();
        let opts = ForwardOptions {
            capture_layers: &[],
            vocab_limit: self.vocab_limit,
        };
        let outputs = self
            .model
            .forward(&mut batch, &opts, &Profiler::disabled())?;
        if outputs.len() != passes.len() {
            return Err(Error::InvalidArgument(format!(
                "the draft model returned {} outputs for {} passes",
                outputs.len(),
                passes.len()
            )));
        }
        outputs
            .iter()
            .zip(passes.iter())
            .map(|(out, p)| {
                Ok(if p.want.top_only {
                    HeadOutput {
                        top: out.logits.top_tokens()?,
                        ..Default::default()
                    }
                } else {
                    HeadOutput {
                        logits: out.last()?.into_owned(),
                        ..Default::default()
                    }
                })
            })
            .collect()
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
