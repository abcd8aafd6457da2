//! One generation as a state machine, and a step that advances several of them with one forward pass of the
//! target. [`super::generate`] is this with a batch of one; the server's engine runs many at once (continuous
//! batching: generations join and leave between steps).
//!
//! A step of a batch, in phases:
//!
//! ```text
//! plan     each generation's rows: a chunk of its prompt while prefilling, else the pending token and a draft
//! forward  one target pass over every generation's rows (each against its own KV cache)
//! finish   per generation: sample or accept, feed the drafter, commit, emit text
//! ```
//!
//! The CPU backend computes every row bitwise as it would alone, so a greedy generation's tokens do not depend on
//! what else is in its batch (tested).

use std::time::Instant;

use crate::draft::eagle3::{HeadCompute, HeadInput, HeadPass};
use crate::draft::{BatchedPass, BatchedStart, Draft, Drafter, DrafterPrefix};
use crate::error::{Error, Result};
use crate::json_mode::JsonState;
use crate::model::forward::check_batch;
use crate::model::forward::HostRows;
use crate::model::RowMatrix;
use crate::model::{
    ForwardOptions, ForwardOutput, LogitsFor, Model, SequenceCache, SequenceInput, TreeMask,
};
use crate::profile::{Phase, Profiler, StepKind};
use crate::sampling::{token_logprob, LogitAdjustments, Sampler, TokenLogprob};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::verify::{self, Acceptance, SimulatedAcceptance};

use super::{
    check_draft_tokens, validate_request, GenerateOutput, GenerateRequest, SpeculationStats,
    StopReason, Timing, PROMPT_LOGPROBS_CHUNK,
};

/// A generation in progress: its request, its KV cache, its drafter and sampler, and what it has produced.
pub struct Generation<'d> {
    req: GenerateRequest,
    sampler: Sampler,
    /// The request's penalties and logit bias, when it has any that are not neutral.
    adjust: Option<Adjuster>,
    drafter: Option<Box<dyn Drafter + 'd>>,
    draft_tokens: usize,
    /// This step's cap on the draft length, set by a scheduler (None: `draft_tokens`).
    draft_limit: Option<usize>,
    simulated: Option<SimulatedAcceptance>,
    cache: Box<dyn SequenceCache>,
    stream: StreamDecoder,
    /// Generated tokens, without the stop token.
    tokens: Vec<u32>,
    /// Their log-probabilities, one each, when the request asks for them.
    logprobs: Vec<TokenLogprob>,
    /// The prompt's (each token but the first) when the request asks for them.
    prompt_logprobs: Vec<TokenLogprob>,
    /// Prompt and committed tokens; once prefilled, the last one is pending (not yet in the target's cache).
    context: Vec<u32>,
    /// Target layers the drafter reads (EAGLE-3), captured in every target forward.
    capture: Vec<usize>,
    stats: Option<SpeculationStats>,
    timing: Timing,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    /// Of those, the tokens taken from a prefix cache ([`Self::adopt_prefix`]).
    cached_prompt_tokens: usize,
    stop: Option<StopReason>,
    started: Option<Instant>,
    decode_started: Option<Instant>,
    /// The rows of the step in flight (between planning and finishing).
    planned: Option<Planned>,
    /// This step's draft when it was drafted in a batch with other generations' (taken by `plan`).
    prepared_draft: Option<Draft>,
}

/// A request's logit adjustments with what they read: the prompt's distinct tokens, the output's counts and, in
/// JSON mode, how far the output has come through its object.
struct Adjuster {
    rules: LogitAdjustments,
    /// Sorted, each once.
    prompt_tokens: Vec<u32>,
    output_counts: std::collections::HashMap<u32, u32>,
    /// Output tokens so far (`min_tokens` holds the stop tokens back until there are enough).
    output_len: usize,
    json_state: JsonState,
}

impl Adjuster {
    fn new(rules: LogitAdjustments, prompt: &[u32]) -> Self {
        let mut prompt_tokens = prompt.to_vec();
        prompt_tokens.sort_unstable();
        prompt_tokens.dedup();
        Adjuster {
            rules,
            prompt_tokens,
            output_counts: Default::default(),
            output_len: 0,
            json_state: JsonState::default(),
        }
    }

    /// Counts an output token (the JSON state ignores one that leaves the language: the mask never lets one
    /// through, so only a caller outside the masked path could commit it).
    fn commit(&mut self, token: u32) {
        *self.output_counts.entry(token).or_default() += 1;
        self.output_len += 1;
        if let Some(json) = &self.rules.json {
            if let Some(next) = json.advance(self.json_state, token) {
                self.json_state = next;
            }
        }
    }

    /// The given rows of `logits`, adjusted, in host memory: each with the output so far plus the draft tokens
    /// the row follows (the tokens it comes after on its path).
    fn adjusted(&self, logits: &dyn RowMatrix, rows: &[(usize, Vec<u32>)]) -> Result<HostRows> {
        let cols = logits.cols();
        let mut data = Vec::with_capacity(rows.len() * cols);
        for (row, drafted) in rows {
            let start = data.len();
            data.extend_from_slice(&logits.row(*row)?);
            // Only the penalties read the counts: JSON mode alone does not copy them for every drafted row.
            let counts = if drafted.is_empty() || !self.rules.reads_output_counts() {
                std::borrow::Cow::Borrowed(&self.output_counts)
            } else {
                let mut c = self.output_counts.clone();
                for &t in drafted {
                    *c.entry(t).or_default() += 1;
                }
                std::borrow::Cow::Owned(c)
            };
            self.rules
                .apply(&mut data[start..], &self.prompt_tokens, &counts);
            self.rules
                .hold_stops(self.output_len + drafted.len(), &mut data[start..]);
            if let Some(json) = &self.rules.json {
                // A row after a draft token that leaves the JSON is never read: that token's own row masks it
                // out, so acceptance stops there.
                let state = drafted
                    .iter()
                    .try_fold(self.json_state, |state, &t| json.advance(state, t));
                if let Some(state) = state {
                    json.apply(state, &mut data[start..])?;
                }
            }
        }
        Ok(HostRows {
            rows: rows.len(),
            cols,
            data,
        })
    }
}

/// The draft tokens from the first to draft token `i`, along the tree's path when `parents` is given.
fn draft_path(tokens: &[u32], parents: Option<&[Option<usize>]>, i: usize) -> Vec<u32> {
    match parents {
        None => tokens[..=i].to_vec(),
        Some(parents) => {
            let mut path = vec![tokens[i]];
            let mut at = parents[i];
            while let Some(p) = at {
                path.push(tokens[p]);
                at = parents[p];
            }
            path.reverse();
            path
        }
    }
}

/// A generation's step output after its first finishing stage (sampling or acceptance), for the later ones.
enum Settled {
    /// Prompt rows `start..start + rows`; after the last chunk, the first token.
    Prefill {
        start: usize,
        rows: usize,
        first: Option<u32>,
        /// The chunk's prompt tokens' log-probabilities, then the first token's (when asked for).
        logprobs: Vec<TokenLogprob>,
    },
    /// A verify pass at cache position `base`: the draft, the accepted path (draft indices) and the next token.
    Cycle {
        draft: Draft,
        tree: Option<TreeMask>,
        base: usize,
        acceptance: Acceptance,
        path: Vec<usize>,
        /// The new tokens' log-probabilities (when asked for): the accepted path's, then the next token's.
        logprobs: Vec<TokenLogprob>,
    },
}

struct Planned {
    input: Vec<u32>,
    logits: LogitsFor,
    work: Work,
}

enum Work {
    /// Prompt tokens `start..start + input.len()`; the last chunk samples the first token.
    Prefill { start: usize, last: bool },
    /// The pending token and a draft, at cache positions `base..`.
    Cycle {
        draft: Draft,
        tree: Option<TreeMask>,
        base: usize,
    },
}

impl<'d> Generation<'d> {
    /// A generation of `req` on `model`, checked before any work is done; its KV cache is allocated now.
    pub fn new(model: &dyn Model, req: GenerateRequest) -> Result<Self> {
        validate_request(model, &req)?;
        let sampler = Sampler::new(req.sampling)?;
        let cache = model.new_cache_for(req.prompt_tokens.len(), req.max_new_tokens, 0)?;
        Ok(Self::with_cache(req, sampler, cache))
    }

    fn with_cache(req: GenerateRequest, sampler: Sampler, cache: Box<dyn SequenceCache>) -> Self {
        let room = super::context_room_for(cache.capacity(), req.prompt_tokens.len());
        Generation {
            tokens: Vec::with_capacity(req.max_new_tokens.min(room)),
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            context: req.prompt_tokens.clone(),
            adjust: req
                .logit_adjustments
                .clone()
                .filter(|a| !a.is_neutral())
                .map(|a| Adjuster::new(a, &req.prompt_tokens)),
            req,
            sampler,
            drafter: None,
            draft_tokens: 0,
            draft_limit: None,
            simulated: None,
            cache,
            stream: StreamDecoder::new(),
            capture: Vec::new(),
            stats: None,
            timing: Timing::default(),
            prefilled: 0,
            cached_prompt_tokens: 0,
            stop: None,
            started: None,
            decode_started: None,
            planned: None,
            prepared_draft: None,
        }
    }

    /// A generation that speculates with `drafter`, up to `draft_tokens` tokens a cycle (its cache gets room for
    /// a verify pass past the last token).
    pub fn with_drafter(
        model: &dyn Model,
        req: GenerateRequest,
        drafter: Box<dyn Drafter + 'd>,
        draft_tokens: usize,
    ) -> Result<Self> {
        validate_request(model, &req)?;
        check_draft_tokens(draft_tokens)?;
        let sampler = Sampler::new(req.sampling)?;
        let cache =
            model.new_cache_for(req.prompt_tokens.len(), req.max_new_tokens, draft_tokens)?;
        let mut g = Self::with_cache(req, sampler, cache);
        g.capture = drafter.target_layers().to_vec();
        g.stats = Some(SpeculationStats::new(drafter.method(), draft_tokens));
        g.drafter = Some(drafter);
        g.draft_tokens = draft_tokens;
        Ok(g)
    }

    /// Speed work only: draft tokens are accepted with probability `p` instead of verified (the output is then
    /// not the model's; [`verify::SimulatedAcceptance`]).
    pub fn simulate_acceptance(mut self, p: f64) -> Result<Self> {
        self.simulated = Some(SimulatedAcceptance::new(p, self.req.sampling.seed)?);
        Ok(self)
    }

    /// Caps the next steps' draft length at `limit` (0: plain steps; the drafter still sees every target pass),
    /// never above the configured draft length. A serving engine sets it per step from the load.
    pub fn set_draft_limit(&mut self, limit: usize) {
        self.draft_limit = Some(limit);
    }

    /// The most tokens the next step could draft before a scheduler's cap: the configured draft length within
    /// the token budget (a request one token from its end drafts nothing). 0 without a drafter.
    pub fn draft_room(&self) -> usize {
        if self.drafter.is_none() || self.stop.is_some() {
            return 0;
        }
        self.draft_tokens.min(self.tokens_left().saturating_sub(1))
    }

    /// Tokens the request may still generate (its max_new_tokens less what it generated).
    pub fn tokens_left(&self) -> usize {
        self.req.max_new_tokens.saturating_sub(self.tokens.len())
    }

    /// Whether its drafter's catch-up is a small pass that may run beside other requests
    /// ([`Drafter::cheap_catch_up`]).
    pub fn draft_catch_up_is_cheap(&self) -> bool {
        self.drafter.as_ref().is_some_and(|d| d.cheap_catch_up())
    }

    /// The longest catch-up its drafter resumes with beside other requests ([`Drafter::catch_up_reach`]).
    pub fn draft_catch_up_reach(&self) -> usize {
        self.drafter.as_ref().map_or(0, |d| d.catch_up_reach())
    }

    /// Tokens the drafter must process before its next draft ([`Drafter::lag`]); 0 without a drafter.
    pub fn draft_lag(&self) -> usize {
        self.drafter.as_ref().map_or(0, |d| d.lag(&self.context))
    }

    /// Whether generation has stopped (then [`Self::finish`] gives the output).
    pub fn is_done(&self) -> bool {
        self.stop.is_some()
    }

    /// Whether the prompt is still (partly) outside the cache.
    pub fn is_prefilling(&self) -> bool {
        self.prefilled < self.req.prompt_tokens.len()
    }

    /// Prompt tokens not yet in the cache.
    pub fn prompt_left(&self) -> usize {
        self.req.prompt_tokens.len() - self.prefilled
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens
    }

    /// The generated tokens' log-probabilities so far (empty unless the request asks for them).
    pub fn token_logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs
    }

    /// The prompt's log-probabilities (each token's but the first) once it is prefilled (empty unless the
    /// request asks for them).
    pub fn prompt_logprobs(&self) -> &[TokenLogprob] {
        &self.prompt_logprobs
    }

    pub fn request(&self) -> &GenerateRequest {
        &self.req
    }

    /// Positions the KV cache was sized for.
    pub fn cache_capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Acceptance statistics so far, when speculating (kept after [`Self::release_drafter`]).
    pub fn speculation(&self) -> Option<&SpeculationStats> {
        self.stats.as_ref()
    }

    /// Whether it still has a drafter (it may draft in later steps).
    pub fn has_drafter(&self) -> bool {
        self.drafter.is_some()
    }

    /// Whether its drafter costs steps it does not draft in: an EAGLE-3 head makes every target pass capture
    /// hidden states for it and then feeds them to the head. A draft model or prompt lookup that is not asked
    /// to draft only falls behind.
    pub fn drafter_costs_idle_steps(&self) -> bool {
        self.drafter.is_some() && !self.capture.is_empty()
    }

    /// Drops its drafter (and the layers captured for it): every later step is plain decoding, with the same
    /// output a drafted one would give. Its speculation statistics so far stay. A scheduler does this to a
    /// request whose drafter it has stopped letting draft. Returns false, changing nothing, while a step is
    /// in flight or when it has no drafter.
    pub fn release_drafter(&mut self) -> bool {
        if self.planned.is_some() || self.drafter.is_none() {
            return false;
        }
        self.drafter = None;
        self.prepared_draft = None;
        self.capture.clear();
        self.draft_limit = None;
        true
    }

    fn cancelled(&self) -> bool {
        self.req
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Plans this generation's rows of the next step: while prefilling, up to `prefill_budget` prompt tokens (the
    /// budget shrinks by what is taken; none left: the generation sits this step out); else the pending token and
    /// a draft (the drafter runs now). Returns whether the generation takes part in the step.
    fn plan(&mut self, prefill_budget: &mut usize, prof: &Profiler) -> Result<bool> {
        self.planned = None;
        if self.stop.is_some() {
            return Ok(false);
        }
        self.started.get_or_insert_with(Instant::now);
        if self.is_prefilling() {
            let left = self.req.prompt_tokens.len() - self.prefilled;
            let scored = self.req.logprobs.is_some_and(|l| l.prompt);
            let n =
                left.min(*prefill_budget)
                    .min(if scored { PROMPT_LOGPROBS_CHUNK } else { left });
            if n == 0 {
                return Ok(false);
            }
            *prefill_budget -= n;
            let start = self.prefilled;
            let last = n == left;
            self.planned = Some(Planned {
                input: self.req.prompt_tokens[start..start + n].to_vec(),
                logits: if scored {
                    LogitsFor::All
                } else if last {
                    LogitsFor::Last
                } else {
                    LogitsFor::None
                },
                work: Work::Prefill { start, last },
            });
            return Ok(true);
        }
        let pending = *self.context.last().unwrap_or(&0);
        let base = self.cache.len();
        let k = self.draft_k();
        let prepared = self.prepared_draft.take();
        let draft = match self.drafter.as_mut() {
            // A cycle the scheduler gave no drafts does no drafting work: no span (on a GPU every span's edges
            // are events).
            Some(_) if k == 0 => Draft::default(),
            Some(drafter) => {
                let _s = prof.span(Phase::Draft);
                let mut d = match prepared {
                    Some(d) => d,
                    None => drafter.propose(&self.context, k, &self.req.sampling)?,
                };
                d.tokens.truncate(k);
                // A tree's nodes come after their parents, so its first k nodes are a tree.
                if let Some(parents) = d.parents.as_mut() {
                    parents.truncate(k);
                }
                d
            }
            None => Draft::default(),
        };
        // A tree draft is verified with a tree mask: row 0 is the pending token, row i + 1 draft token i, each
        // attending to its ancestors.
        let tree = match &draft.parents {
            Some(parents) => {
                if self.simulated.is_some() {
                    return Err(Error::InvalidArgument(
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
        let mut input = Vec::with_capacity(1 + draft.tokens.len());
        input.push(pending);
        input.extend_from_slice(&draft.tokens);
        let logits = if draft.tokens.is_empty() {
            LogitsFor::Last
        } else {
            LogitsFor::All
        };
        self.planned = Some(Planned {
            input,
            logits,
            work: Work::Cycle { draft, tree, base },
        });
        Ok(true)
    }

    /// Tokens this generation's next cycle may draft: never past the token budget or the context (every
    /// accepted token must fit), nor past the scheduler's limit.
    fn draft_k(&self) -> usize {
        let remaining = self.req.max_new_tokens - self.tokens.len();
        self.draft_tokens
            .min(self.draft_limit.unwrap_or(usize::MAX))
            .min(remaining.saturating_sub(1))
            .min(self.cache.capacity().saturating_sub(self.cache.len() + 1))
    }

    /// The planned rows as one sequence of a forward pass.
    fn input(&mut self) -> Option<SequenceInput<'_>> {
        let planned = self.planned.as_ref()?;
        Some(SequenceInput {
            tokens: &planned.input,
            cache: self.cache.as_mut(),
            logits: planned.logits,
            tree: match &planned.work {
                Work::Cycle { tree, .. } => tree.as_ref(),
                Work::Prefill { .. } => None,
            },
        })
    }

    /// The phase in which this generation settles its planned rows' output: sampling the first token after the
    /// last prompt chunk or in a plain step, accepting drafts in a speculative cycle; None for a prompt chunk
    /// that is not the last (nothing to settle).
    fn settle_phase(&self) -> Option<Phase> {
        match &self.planned.as_ref()?.work {
            Work::Prefill { last: false, .. } => None,
            Work::Prefill { last: true, .. } => Some(Phase::Sample),
            Work::Cycle { draft, .. } => Some(
                if draft.parents.is_some() || self.simulated.is_some() || self.drafter.is_some() {
                    Phase::Accept
                } else {
                    Phase::Sample
                },
            ),
        }
    }

    /// First stage of finishing a step: samples the first token (last prompt chunk) or accepts drafts (a cycle)
    /// from the forward pass's output. None when no step was planned.
    fn settle(&mut self, out: &ForwardOutput) -> Result<Option<Settled>> {
        let Some(planned) = self.planned.take() else {
            return Ok(None);
        };
        let n = planned.input.len();
        let top = self.req.logprobs.map(|l| l.top);
        Ok(Some(match planned.work {
            Work::Prefill { start, last } => {
                // Every row's logits when the prompt is scored, else only the last row's.
                let last_row = out.logits.rows().saturating_sub(1);
                let mut logprobs = Vec::new();
                if let (Some(top), LogitsFor::All) = (top, planned.logits) {
                    // Row r of the chunk predicts prompt token start + r + 1.
                    let prompt = &self.req.prompt_tokens;
                    for r in 0..n.min(prompt.len() - start - 1) {
                        logprobs.push(token_logprob(&out.row(r)?, prompt[start + r + 1], top));
                    }
                }
                let first = if last {
                    let first = match &self.adjust {
                        Some(a) => {
                            let rows =
                                a.adjusted(out.logits.as_ref(), &[(last_row, Vec::new())])?;
                            self.sampler.sample_row(&rows, 0)?
                        }
                        None => self.sampler.sample_row(out.logits.as_ref(), last_row)?,
                    };
                    if let Some(top) = top {
                        logprobs.push(token_logprob(&out.row(last_row)?, first, top));
                    }
                    Some(first)
                } else {
                    None
                };
                Settled::Prefill {
                    start,
                    rows: n,
                    first,
                    logprobs,
                }
            }
            Work::Cycle { draft, tree, base } => {
                // With penalties or a bias, acceptance reads the adjusted rows: row r > 0 follows draft token
                // r - 1 and the draft tokens on its path, which count as output for it.
                let adjusted = match &self.adjust {
                    None => None,
                    Some(a) => {
                        let rows: Vec<(usize, Vec<u32>)> = (0..out.logits.rows())
                            .map(|r| {
                                let drafted = match r {
                                    0 => Vec::new(),
                                    r => draft_path(&draft.tokens, draft.parents.as_deref(), r - 1),
                                };
                                (r, drafted)
                            })
                            .collect();
                        Some(a.adjusted(out.logits.as_ref(), &rows)?)
                    }
                };
                let logits: &dyn RowMatrix = match &adjusted {
                    Some(rows) => rows,
                    None => out.logits.as_ref(),
                };
                // The draft tokens kept, in order (a prefix for a chain, the accepted path for a tree).
                let (acceptance, path) = if let Some(parents) = &draft.parents {
                    if self.sampler.params().is_greedy() {
                        verify::accept_tree(&draft.tokens, parents, logits)?
                    } else {
                        verify::accept_tree_sampled(
                            &draft.tokens,
                            parents,
                            logits,
                            &mut self.sampler,
                        )?
                    }
                } else {
                    let acceptance = if let Some(sim) = self.simulated.as_mut() {
                        sim.accept(&draft, logits)?
                    } else if self.drafter.is_some() {
                        verify::accept(&draft, logits, &mut self.sampler)?
                    } else {
                        Acceptance {
                            accepted: 0,
                            next: self.sampler.sample_row(logits, 0)?,
                        }
                    };
                    let path: Vec<usize> = (0..acceptance.accepted).collect();
                    (acceptance, path)
                };
                // The row deciding each new token: the pending token's for the first, then each accepted draft
                // token's row (row i + 1 holds draft token i) for the token after it.
                let logprobs = match top {
                    None => Vec::new(),
                    Some(top) => {
                        let rows = std::iter::once(0).chain(path.iter().map(|&i| i + 1));
                        let tokens = path
                            .iter()
                            .map(|&i| draft.tokens[i])
                            .chain(std::iter::once(acceptance.next));
                        rows.zip(tokens)
                            .map(|(row, token)| Ok(token_logprob(&out.row(row)?, token, top)))
                            .collect::<Result<Vec<_>>>()?
                    }
                };
                Settled::Cycle {
                    draft,
                    tree,
                    base,
                    acceptance,
                    path,
                    logprobs,
                }
            }
        }))
    }

    /// Second stage: the drafter reads the target's hidden states of the rows that stay (EAGLE-3's next input).
    /// Returns whether there was anything to feed.
    fn feed_drafter(&mut self, settled: &Settled, out: &ForwardOutput) -> Result<bool> {
        let (Some(d), false) = (self.drafter.as_mut(), self.capture.is_empty()) else {
            return Ok(false);
        };
        match settled {
            Settled::Prefill { start, rows, .. } => {
                d.observe_target(*start, &out.hidden, &(0..*rows).collect::<Vec<_>>())?
            }
            Settled::Cycle { base, path, .. } => {
                // The rows of the verify pass that stay: the pending token's and the accepted drafts'.
                let kept: Vec<usize> = std::iter::once(0)
                    .chain(path.iter().map(|&i| i + 1))
                    .collect();
                d.observe_target(*base, &out.hidden, &kept)?
            }
        }
        Ok(true)
    }

    /// Third stage: the cache keeps the rows that stay and the new tokens join the output (until one stops it).
    /// Returns how many tokens were committed, and whether the step was a verify cycle.
    fn commit_settled(&mut self, settled: Settled, tokenizer: &Tokenizer) -> Result<(usize, bool)> {
        match settled {
            Settled::Prefill {
                start,
                rows,
                first,
                mut logprobs,
            } => {
                self.prefilled = start + rows;
                // The first token's log-probability came last.
                let first_logprob = if first.is_some() && self.req.logprobs.is_some() {
                    logprobs.pop()
                } else {
                    None
                };
                self.prompt_logprobs.append(&mut logprobs);
                let Some(first) = first else {
                    return Ok((0, false));
                };
                let committed = self.commit(
                    tokenizer,
                    &[first],
                    self.cache.len(),
                    first_logprob.into_iter().collect(),
                );
                let now = Instant::now();
                self.timing.prefill_s = self
                    .started
                    .map_or(0.0, |s| now.duration_since(s).as_secs_f64());
                self.decode_started = Some(now);
                Ok((committed, false))
            }
            Settled::Cycle {
                draft,
                tree,
                base,
                acceptance,
                path,
                logprobs,
            } => {
                if let Some(st) = self.stats.as_mut() {
                    st.draft_passes += draft.passes as u64;
                    st.catch_up_cycles += u64::from(draft.catching_up);
                    match &tree {
                        Some(t) => st.record_tree(
                            draft.tokens.len(),
                            (1..t.len()).map(|r| t.depth(r)).max().unwrap_or(0),
                            acceptance.accepted,
                        ),
                        None => st.record(draft.tokens.len(), acceptance.accepted),
                    }
                }
                let mut new_tokens: Vec<u32> = path.iter().map(|&i| draft.tokens[i]).collect();
                new_tokens.push(acceptance.next);
                if tree.is_some() {
                    // The accepted path's keys and values move next to the pending token's; the other branches
                    // go.
                    let kept_rows: Vec<usize> = std::iter::once(0)
                        .chain(path.iter().map(|&i| i + 1))
                        .collect();
                    self.cache.keep_new_rows(base, &kept_rows)?;
                }
                let kept = base + 1 + acceptance.accepted;
                self.cache.truncate(kept);
                let committed = self.commit(tokenizer, &new_tokens, kept, logprobs);
                self.timing.decode_tokens +=
                    committed + usize::from(self.stop == Some(StopReason::EndOfText));
                Ok((committed, true))
            }
        }
    }

    /// Appends new tokens to the output until one of them stops generation; returns how many were appended.
    /// `cached` is the target cache length, which the last new token would extend; `logprobs` are the new
    /// tokens' (empty when not asked for).
    fn commit(
        &mut self,
        tokenizer: &Tokenizer,
        new_tokens: &[u32],
        cached: usize,
        logprobs: Vec<TokenLogprob>,
    ) -> usize {
        let mut appended = 0;
        let mut logprobs = logprobs.into_iter();
        for &token in new_tokens {
            if self.req.stop_at_eos && tokenizer.is_stop(token) {
                self.stop = Some(StopReason::EndOfText);
                return appended;
            }
            self.tokens.push(token);
            self.context.push(token);
            self.logprobs.extend(logprobs.next());
            if let Some(a) = self.adjust.as_mut() {
                a.commit(token);
            }
            appended += 1;
            if self.req.stop_token_ids.contains(&token) {
                self.stop = Some(StopReason::StopToken);
                return appended;
            }
            if self.tokens.len() >= self.req.max_new_tokens {
                self.stop = Some(StopReason::MaxTokens);
                return appended;
            }
        }
        // The pending token will occupy position `cached`.
        if cached >= self.cache.capacity() {
            self.stop = Some(StopReason::ContextFull);
        }
        appended
    }

    /// Last stage: the text of the `committed` newest tokens goes to `on_text`, one call per token in order, with
    /// the text that token completes (empty while a character it begins is not whole yet), so a caller can tell
    /// which token each piece of text came with.
    fn emit(
        &mut self,
        tokenizer: &Tokenizer,
        committed: usize,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<()> {
        for &token in &self.tokens[self.tokens.len() - committed..] {
            let text = self.stream.push(tokenizer, token)?;
            on_text(text.as_deref().unwrap_or(""));
        }
        Ok(())
    }

    /// The output of a generation that is done (or abandoned): the rest of its text goes to `on_text` first.
    pub fn finish(
        self,
        tokenizer: &Tokenizer,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        self.finish_keeping_prefix(tokenizer, on_text)
            .map(|(output, _)| output)
    }

    /// [`Self::finish`], also handing over its KV cache and its drafter's state for later requests whose
    /// prompts start the same way (None while a step is in flight: its cache holds rows no context owns).
    pub fn finish_keeping_prefix(
        mut self,
        tokenizer: &Tokenizer,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<(GenerateOutput, Option<CachedPrefix>)> {
        if let Some(at) = self.decode_started {
            self.timing.decode_s = at.elapsed().as_secs_f64();
        }
        if let Some(rest) = self.stream.flush(tokenizer)? {
            on_text(&rest);
        }
        let text = tokenizer.decode(&self.tokens)?;
        let prefix = (self.planned.is_none() && !self.cache.is_empty()).then(|| {
            let positions = self.cache.len();
            CachedPrefix {
                tokens: self.context[..positions.min(self.context.len())].to_vec(),
                drafter: self.drafter.as_ref().and_then(|d| d.prefix_state()),
                target: self.cache,
            }
        });
        Ok((
            GenerateOutput {
                prompt_tokens: self.req.prompt_tokens.len(),
                cached_prompt_tokens: self.cached_prompt_tokens,
                tokens: self.tokens,
                text,
                stop_reason: self.stop.unwrap_or(StopReason::Cancelled),
                timing: self.timing,
                speculation: self.stats,
                logprobs: self.logprobs,
                prompt_logprobs: self.prompt_logprobs,
            },
            prefix,
        ))
    }

    /// A copy of its prompt's keys and values and its drafter's state, for a prefix cache to serve requests that
    /// arrive while this one still runs: only right after the step that prefilled the prompt's last chunk (the
    /// cache then holds exactly the prompt); None at any other time.
    pub fn prompt_prefix(&self, model: &dyn Model) -> Option<CachedPrefix> {
        let n = self.req.prompt_tokens.len();
        if self.prefilled != n || self.cache.len() != n || self.planned.is_some() {
            return None;
        }
        let mut target = model.new_cache(n).ok()?;
        target.copy_prefix_from(&*self.cache, n).ok()?;
        Some(CachedPrefix {
            tokens: self.req.prompt_tokens.clone(),
            target,
            drafter: self.drafter.as_ref().and_then(|d| d.prefix_state()),
        })
    }

    /// How many positions of `prefix` this generation could start from: as far as its prompt agrees with
    /// `prefix.tokens`, short of the prompt's last token (its pass gives the first token's logits), and, for a
    /// drafter that reads the target's features of every position (EAGLE-3), as far as the drafter's state
    /// reaches. 0 once the generation has started.
    pub fn prefix_reach(&self, prefix: &CachedPrefix) -> usize {
        let Some((n, common)) = self.target_reach(prefix) else {
            return 0;
        };
        if self.capture.is_empty() {
            return n;
        }
        match (self.drafter.as_ref(), prefix.drafter.as_ref()) {
            (Some(d), Some(p)) => n.min(d.prefix_reach(p, common)),
            _ => 0,
        }
    }

    /// [`Self::prefix_reach`] as it would be without the drafter: the target's keys and values alone (a prefix
    /// kept by a request without a drafter has no drafter state, and an EAGLE-3 head that never drafted keeps
    /// little, so a drafting request may reuse much less of it than a plain one).
    pub fn prefix_reach_without_drafter(&self, prefix: &CachedPrefix) -> usize {
        self.target_reach(prefix).map_or(0, |(n, _)| n)
    }

    /// The positions of `prefix` the target's cache could start from, and the tokens the prompt shares with it;
    /// None once the generation has started or where its prompt must be scored.
    fn target_reach(&self, prefix: &CachedPrefix) -> Option<(usize, usize)> {
        // A scored prompt needs every position's logits, which a cached prefix does not keep.
        let scored = self.req.logprobs.is_some_and(|l| l.prompt);
        if scored || self.prefilled > 0 || !self.cache.is_empty() || self.planned.is_some() {
            return None;
        }
        let prompt = &self.req.prompt_tokens;
        let common = prompt
            .iter()
            .zip(&prefix.tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prefix.target.len());
        let n = common
            .min(prompt.len().saturating_sub(1))
            .min(self.cache.capacity());
        Some((n, common))
    }

    /// Starts from the first `n` positions of `prefix` (at most [`Self::prefix_reach`]): the KV cache takes
    /// their keys and values, the drafter its state, and prefill begins at position `n`. The output is the same
    /// as without it (the rows are the ones this prompt would compute). On an error nothing changed.
    pub fn adopt_prefix(&mut self, prefix: &CachedPrefix, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let reach = self.prefix_reach(prefix);
        if n > reach {
            return Err(Error::InvalidArgument(format!(
                "cannot start from {n} cached positions: this generation can reuse {reach}"
            )));
        }
        let drafter = match (
            self.capture.is_empty(),
            self.drafter.as_mut(),
            &prefix.drafter,
        ) {
            (true, _, _) => None,
            (false, Some(d), Some(p)) => {
                d.adopt_prefix(p, n)?;
                Some((d, p))
            }
            _ => {
                return Err(Error::InvalidArgument(
                    "the drafter needs the target's features of the cached positions".into(),
                ))
            }
        };
        if let Err(e) = self.cache.copy_prefix_from(&*prefix.target, n) {
            if let Some((d, p)) = drafter {
                let _ = d.adopt_prefix(p, 0);
            }
            self.cache.truncate(0);
            return Err(e);
        }
        self.prefilled = n;
        self.cached_prompt_tokens = n;
        Ok(())
    }
}

/// A finished generation's KV cache, the tokens at its positions, and its drafter's state: what a prefix cache
/// keeps so that later requests whose prompts start the same way skip that part of their prefill.
pub struct CachedPrefix {
    /// The token at each cached position (prompt and generated tokens, without the last, pending one).
    pub tokens: Vec<u32>,
    pub target: Box<dyn SequenceCache>,
    pub drafter: Option<DrafterPrefix>,
}

impl CachedPrefix {
    /// Device memory it holds beyond its KV cache: the target outputs its drafter's waiting features live in.
    pub fn drafter_held_bytes(&self) -> usize {
        self.drafter.as_ref().map_or(0, |d| d.held_bytes())
    }
}

/// Limits of one step.
#[derive(Clone, Copy)]
pub struct StepLimits<'h> {
    /// Prompt tokens prefilled in one step, over all generations (chunked prefill keeps running streams flowing
    /// while a long prompt enters); `usize::MAX`: whole prompts.
    pub prefill_tokens: usize,
    /// The EAGLE-3 head every generation's drafter shares, when they share one: their chain passes then run as
    /// one batched head pass per round ([`HeadCompute::run_many`]) instead of one request after the other.
    pub shared_head: Option<&'h dyn HeadCompute>,
}

impl std::fmt::Debug for StepLimits<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLimits")
            .field("prefill_tokens", &self.prefill_tokens)
            .field("shared_head", &self.shared_head.map(|h| h.device()))
            .finish()
    }
}

impl Default for StepLimits<'_> {
    fn default() -> Self {
        StepLimits {
            prefill_tokens: usize::MAX,
            shared_head: None,
        }
    }
}

/// Drafts for the decoding generations of `live` whose drafters draft in batches, all rounds of their passes
/// run by `head` as one batched pass each; the drafts wait in `prepared_draft` for `plan`. A generation whose
/// drafter fails gets the error in `results`; a failed batched pass fails every generation in it.
fn draft_in_batches(
    model: &dyn Model,
    head: &dyn HeadCompute,
    batch: &mut [&mut Generation<'_>],
    live: &[usize],
    results: &mut [Result<()>],
) -> (usize, usize) {
    let (mut rounds, mut rows) = (0, 0);
    // Each generation's pass of this round, by index in `batch`.
    let mut pending: Vec<(usize, BatchedPass)> = Vec::new();
    let decoding = live
        .iter()
        .filter(|&&i| !batch[i].is_prefilling() && batch[i].stop.is_none())
        .count();
    for &i in live {
        let g = &mut *batch[i];
        if g.is_prefilling() || g.stop.is_some() || g.simulated.is_some() {
            continue;
        }
        let k = g.draft_k();
        let Some(drafter) = g.drafter.as_mut() else {
            continue;
        };
        if k == 0 {
            continue;
        }
        match drafter.batched_begin(&g.context, k, &g.req.sampling, decoding > 1) {
            Ok(BatchedStart::Alone) => {}
            Ok(BatchedStart::Nothing) => g.prepared_draft = Some(Draft::default()),
            Ok(BatchedStart::Pass(p)) => pending.push((i, p)),
            Err(e) => results[i] = Err(e),
        }
    }
    // A request drafting alone in this step has no pass to share a round with: its drafter may draft whole (an
    // EAGLE-3 greedy chain on the head's device, as outside a server), the same draft as the rounds below.
    if let [_] = pending.as_slice() {
        if let Some((i, pass)) = pending.pop() {
            let g = &mut *batch[i];
            let sampling = g.req.sampling;
            if let Some(drafter) = g.drafter.as_mut() {
                match drafter.batched_alone(&pass, &sampling) {
                    Ok(Some(draft)) => {
                        // Drafted whole (a device chain): its first pass's rows, one round.
                        rounds += 1;
                        rows += pass.tokens.len();
                        g.prepared_draft = Some(draft);
                    }
                    Ok(None) => pending.push((i, pass)),
                    Err(e) => {
                        let _ = drafter.batched_finish();
                        results[i] = Err(e);
                    }
                }
            }
        }
    }
    // Requests drafting greedy chains: the head may run all their rounds at once on its device, nothing coming
    // back to the host between them (each keeps what its own chain reaches); the others go in rounds below.
    let (chained, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(i, _)| {
        batch[*i]
            .drafter
            .as_ref()
            .and_then(|d| d.batched_chain_more())
            .is_some()
    });
    pending = rest;
    let back = if chained.len() >= 2 {
        match chains_together(model, head, batch, chained, results) {
            Ok((r, n)) => {
                rounds += r;
                rows += n;
                Vec::new()
            }
            Err(back) => back,
        }
    } else {
        chained
    };
    if !back.is_empty() {
        pending.extend(back);
        pending.sort_by_key(|(i, _)| *i);
    }
    while !pending.is_empty() {
        rounds += 1;
        rows += pending.iter().map(|(_, p)| p.tokens.len()).sum::<usize>();
        let outputs = on_passes(batch, &pending, |passes| head.run_many(model, passes));
        let outputs = match outputs {
            Ok(o) if o.len() == pending.len() => o,
            failed => {
                let message = match failed {
                    Err(e) => e.to_string(),
                    Ok(o) => format!("{} outputs for {} passes", o.len(), pending.len()),
                };
                for (i, _) in pending.drain(..) {
                    if let Some(d) = batch[i].drafter.as_mut() {
                        let _ = d.batched_finish();
                    }
                    results[i] = Err(Error::InvalidArgument(format!(
                        "the batched draft pass failed: {message}"
                    )));
                }
                return (rounds, rows);
            }
        };
        let mut next = Vec::with_capacity(pending.len());
        for ((i, _), output) in pending.drain(..).zip(outputs) {
            let g = &mut *batch[i];
            let sampling = g.req.sampling;
            let drafter = g
                .drafter
                .as_mut()
                .expect("batched generations have drafters");
            match drafter.batched_after(output, &sampling) {
                Ok(Some(p)) => next.push((i, p)),
                Ok(None) => match drafter.batched_finish() {
                    Ok(d) => g.prepared_draft = Some(d),
                    Err(e) => results[i] = Err(e),
                },
                Err(e) => {
                    let _ = drafter.batched_finish();
                    results[i] = Err(e);
                }
            }
        }
        pending = next;
    }
    (rounds, rows)
}

/// The greedy chains of `chained` (two or more generations whose drafters answered
/// [`crate::draft::Drafter::batched_chain_more`]) run together by the head: each generation's draft prepared (or
/// its error recorded); returns the rounds and head rows that ran, or the generations back, untouched, when the
/// head runs no chains together (they then go in rounds).
fn chains_together(
    model: &dyn Model,
    head: &dyn HeadCompute,
    batch: &mut [&mut Generation<'_>],
    chained: Vec<(usize, BatchedPass)>,
    results: &mut [Result<()>],
) -> std::result::Result<(usize, usize), Vec<(usize, BatchedPass)>> {
    let more = chained
        .iter()
        .filter_map(|(i, _)| {
            batch[*i]
                .drafter
                .as_ref()
                .and_then(|d| d.batched_chain_more())
        })
        .max()
        .unwrap_or(0);
    let fed: Vec<usize> = chained
        .iter()
        .map(|(i, p)| {
            batch[*i]
                .drafter
                .as_mut()
                .and_then(|d| d.batched_cache())
                .map_or(0, |c| c.len())
                + p.tokens.len()
        })
        .collect();
    let first_rows: usize = chained.iter().map(|(_, p)| p.tokens.len()).sum();
    let ran = on_passes(batch, &chained, |passes| {
        head.run_greedy_chains(model, passes, more)
    });
    let failure = match ran {
        Ok(None) => return Err(chained),
        Ok(Some(tops)) if tops.len() == chained.len() => {
            let n = chained.len();
            for (((i, _), tops), fed) in chained.into_iter().zip(tops).zip(fed) {
                let g = &mut *batch[i];
                let sampling = g.req.sampling;
                let drafter = g
                    .drafter
                    .as_mut()
                    .expect("batched generations have drafters");
                match drafter.batched_chain_finish(fed, &tops, &sampling) {
                    Ok(d) => g.prepared_draft = Some(d),
                    Err(e) => results[i] = Err(e),
                }
            }
            return Ok((1 + more, first_rows + more * n));
        }
        Ok(Some(tops)) => format!("{} chains for {} requests", tops.len(), chained.len()),
        Err(e) => e.to_string(),
    };
    for (i, _) in chained {
        if let Some(d) = batch[i].drafter.as_mut() {
            let _ = d.batched_finish();
        }
        results[i] = Err(Error::InvalidArgument(format!(
            "the batched draft chain failed: {failure}"
        )));
    }
    Ok((0, 0))
}

/// Runs `run` on the pending generations' passes, in `pending` order (increasing indices into `batch`), each on
/// its drafter's head cache.
fn on_passes<'a, T>(
    batch: &'a mut [&mut Generation<'_>],
    pending: &'a [(usize, BatchedPass)],
    run: impl FnOnce(&mut [HeadPass<'_>]) -> Result<T>,
) -> Result<T> {
    let mut passes = Vec::with_capacity(pending.len());
    let mut rest: &mut [&mut Generation<'_>] = batch;
    let mut offset = 0;
    for (i, p) in pending {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - offset);
        let (g, tail) = tail.split_first_mut().expect("pending index in range");
        rest = tail;
        offset = i + 1;
        let Some(cache) = g.drafter.as_mut().and_then(|d| d.batched_cache()) else {
            return Err(Error::InvalidArgument(format!(
                "generation {i}'s drafter drafts in batches but has no cache"
            )));
        };
        passes.push(HeadPass {
            tokens: &p.tokens,
            input: match (&p.features, &p.device_features) {
                (Some(f), _) => HeadInput::Features(f),
                (None, Some(d)) => HeadInput::DeviceFeatures(d),
                (None, None) => HeadInput::Last,
            },
            cache,
            want: p.want,
        });
    }
    run(&mut passes)
}

/// What one step did, for metrics and traces.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Generations that took part (had rows in the forward pass).
    pub sequences: usize,
    /// Rows of the forward pass (prompt chunks, pending tokens and drafts).
    pub rows: usize,
    /// Of those, prompt rows.
    pub prefill_rows: usize,
    /// Rounds of batched draft passes before the forward ([`StepLimits::shared_head`]; 0 without one).
    pub draft_rounds: usize,
    /// Head rows those rounds fed, all sequences together (catch-up rows and drafted tokens).
    pub draft_rows: usize,
}

/// Advances every generation of `batch` by one step with one forward pass of `model`: generations still
/// prefilling get a prompt chunk (within `limits`), the others a speculative cycle (or a plain step). Decoding
/// generations are planned first, so running streams never wait behind a long prompt. A generation that is done
/// or cancelled takes no part. Text goes to `on_text` with the generation's index in `batch`.
///
/// Errors are per generation (`results[i]`): one generation's bad input or failing drafter does not stop the
/// others. A failure of the forward pass itself fails every generation in it.
pub fn step(
    model: &dyn Model,
    tokenizer: &Tokenizer,
    batch: &mut [&mut Generation<'_>],
    limits: StepLimits<'_>,
    prof: &Profiler,
    on_text: &mut dyn FnMut(usize, &str),
) -> (Vec<Result<()>>, StepReport) {
    step_with(model, tokenizer, batch, limits, prof, on_text, &mut || {})
}

/// Runs `f` once: when [`HookOnce::fire`] is called, or else when dropped (every return path of a step).
struct HookOnce<'f>(Option<&'f mut dyn FnMut()>);

impl HookOnce<'_> {
    fn fire(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

impl Drop for HookOnce<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.fire();
        }
    }
}

/// [`step`], calling `during_forward` exactly once: right after the step's forward pass is launched (on a GPU
/// the pass then runs while the caller's host work does: its bookkeeping of the previous step, its plan for the
/// next), or at the end of a step that ran no forward pass. It must not touch the generations of `batch`.
pub fn step_with(
    model: &dyn Model,
    tokenizer: &Tokenizer,
    batch: &mut [&mut Generation<'_>],
    limits: StepLimits<'_>,
    prof: &Profiler,
    on_text: &mut dyn FnMut(usize, &str),
    during_forward: &mut dyn FnMut(),
) -> (Vec<Result<()>>, StepReport) {
    let mut during_forward = HookOnce(Some(during_forward));
    let mut results: Vec<Result<()>> = batch.iter().map(|_| Ok(())).collect();
    let mut report = StepReport::default();
    for g in batch.iter_mut() {
        if g.stop.is_none() && g.cancelled() {
            g.stop = Some(StopReason::Cancelled);
        }
    }
    let live: Vec<usize> = (0..batch.len()).filter(|&i| !batch[i].is_done()).collect();
    if live.is_empty() {
        return (results, report);
    }
    let all_prefill = live.iter().all(|&i| batch[i].is_prefilling());
    prof.begin_step(if all_prefill {
        StepKind::Prefill
    } else {
        StepKind::Decode
    });

    // Drafters sharing one head draft together: each round of passes is one batched head pass.
    let drafting = |g: &Generation<'_>| {
        !g.is_prefilling() && g.stop.is_none() && g.drafter.is_some() && g.draft_k() > 0
    };
    if let Some(head) = limits
        .shared_head
        .filter(|_| live.iter().any(|&i| drafting(batch[i])))
    {
        let _s = prof.span(Phase::Draft);
        (report.draft_rounds, report.draft_rows) =
            draft_in_batches(model, head, batch, &live, &mut results);
    }

    // Plan: decoding generations first, then prompt chunks within the budget.
    let mut budget = limits.prefill_tokens.max(1);
    let mut order: Vec<usize> = live.clone();
    order.retain(|&i| results[i].is_ok());
    order.sort_by_key(|&i| batch[i].is_prefilling());
    let mut members = Vec::with_capacity(order.len());
    for &i in &order {
        match batch[i].plan(&mut budget, prof) {
            Ok(true) => members.push(i),
            Ok(false) => {}
            Err(e) => results[i] = Err(e),
        }
    }
    members.sort_unstable();
    // Capture the union of what the drafters read; each takes its own layers by id.
    let mut capture: Vec<usize> = members
        .iter()
        .flat_map(|&i| batch[i].capture.iter().copied())
        .collect();
    capture.sort_unstable();
    capture.dedup();
    let opts = ForwardOptions {
        capture_layers: &capture,
        vocab_limit: None,
    };
    // Each sequence's input is checked alone first, so one bad sequence is refused without failing the others.
    members.retain(|&i| {
        let Some(input) = batch[i].input() else {
            return false;
        };
        match check_batch(model.config(), &[input], &opts) {
            Ok(()) => true,
            Err(e) => {
                batch[i].planned = None;
                results[i] = Err(e);
                false
            }
        }
    });
    if members.is_empty() {
        prof.end_step();
        return (results, report);
    }
    report.sequences = members.len();
    for &i in &members {
        let p = batch[i].planned.as_ref().expect("planned above");
        report.rows += p.input.len();
        if matches!(p.work, Work::Prefill { .. }) {
            report.prefill_rows += p.input.len();
        }
    }

    // Forward: one pass over every member's rows.
    let phase = if members.iter().all(|&i| batch[i].is_prefilling()) {
        Phase::Prefill
    } else {
        Phase::Verify
    };
    let forward_start = Instant::now();
    let outputs = {
        let _s = prof.span(phase);
        let mut inputs: Vec<SequenceInput<'_>> = Vec::with_capacity(members.len());
        let mut rest: &mut [&mut Generation<'_>] = batch;
        let mut offset = 0;
        for &i in &members {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - offset);
            let (g, tail) = tail.split_first_mut().expect("member index in range");
            inputs.push(g.input().expect("planned above"));
            rest = tail;
            offset = i + 1;
        }
        model.forward(&mut inputs, &opts, prof)
    };
    during_forward.fire();
    // Host time of the pass: right on the CPU, only the launches on a GPU.
    let forward_host_s = forward_start.elapsed().as_secs_f64();
    let outputs = match outputs {
        Ok(o) if o.len() == members.len() => o,
        failed => {
            let message = match failed {
                Err(e) if members.len() == 1 => {
                    batch[members[0]].planned = None;
                    results[members[0]] = Err(e);
                    prof.end_step();
                    return (results, report);
                }
                Err(e) => e.to_string(),
                Ok(o) => format!(
                    "the backend returned {} outputs for {} sequences",
                    o.len(),
                    members.len()
                ),
            };
            for &i in &members {
                batch[i].planned = None;
                results[i] = Err(Error::InvalidArgument(format!(
                    "the batched forward pass failed: {message}"
                )));
            }
            prof.end_step();
            return (results, report);
        }
    };

    // Finish, phase by phase over the generations (in batch order within each): one span per phase, not one per
    // generation (on a GPU every span edge is an event, ~7 us of host time).
    let mut settled: Vec<(usize, ForwardOutput, Settled)> = Vec::with_capacity(members.len());
    let mut open: Option<(Phase, crate::profile::Span<'_>)> = None;
    for (&i, out) in members.iter().zip(outputs) {
        let phase = batch[i].settle_phase();
        if let Some(phase) = phase.filter(|&p| open.as_ref().is_none_or(|(q, _)| *q != p)) {
            // The previous phase's span ends before this one starts (they share that edge).
            drop(open.take());
            open = Some((phase, prof.span(phase)));
        }
        match batch[i].settle(&out) {
            Ok(Some(st)) => settled.push((i, out, st)),
            Ok(None) => {}
            Err(e) => results[i] = Err(e),
        }
    }
    drop(open);
    if settled
        .iter()
        .any(|(i, _, _)| !batch[*i].capture.is_empty())
    {
        let _s = prof.span(Phase::Feed);
        settled.retain(|(i, out, st)| match batch[*i].feed_drafter(st, out) {
            Ok(_) => true,
            Err(e) => {
                results[*i] = Err(e);
                false
            }
        });
    }
    let mut verified = Vec::with_capacity(settled.len());
    let mut committed = Vec::with_capacity(settled.len());
    {
        let _s = prof.span(Phase::Commit);
        for (i, _, st) in settled {
            match batch[i].commit_settled(st, tokenizer) {
                Ok((n, cycle)) => {
                    committed.push((i, n));
                    if cycle {
                        verified.push(i);
                    }
                }
                Err(e) => results[i] = Err(e),
            }
        }
    }
    {
        let _s = prof.span(Phase::Emit);
        for (i, n) in committed {
            if let Err(e) = batch[i].emit(tokenizer, n, &mut |t| on_text(i, t)) {
                results[i] = Err(e);
            }
        }
    }
    // Drafters learn what the pass cost for all its rows (one more drafted row is weighed against that), by the
    // profiler's clock: on a GPU a host timer sees only the launches, and the pass is over now that acceptance
    // has read its results.
    if phase == Phase::Verify {
        let seconds = prof.last_span_seconds(phase).unwrap_or(forward_host_s);
        for &i in &verified {
            if let Some(d) = batch[i].drafter.as_mut() {
                d.observe_verify(report.rows, seconds);
            }
        }
    }
    prof.end_step();
    (results, report)
}
