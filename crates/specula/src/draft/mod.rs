//! Drafters: cheap proposers of the next few tokens, verified by the target in one forward pass.
//!
//! Every drafter implements one small trait. The decode loop hands it the whole context (prompt, generated
//! tokens, and the pending token the target has not seen yet); the drafter keeps whatever state it needs (a
//! draft model's KV cache, an n-gram index) and syncs it to the context itself, so rollback after a partial
//! acceptance needs no special call.

pub mod auto;
pub mod budget;
#[cfg(test)]
mod budget_traces;
pub mod eagle3;
pub mod model;
pub mod ngram;

use crate::error::Result;
use crate::sampling::{Distribution, SamplingParams};

/// Proposed tokens and, when sampling, the distribution each was drawn from (speculative sampling needs q).
#[derive(Debug, Clone, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// One per token when the drafter sampled; `None` means each token was proposed deterministically
    /// (q is a point mass on it).
    pub distributions: Option<Vec<Distribution>>,
    /// A tree draft (greedy only): each token's parent among the draft tokens (None: it follows the pending
    /// token). `None`: the tokens are a chain.
    pub parents: Option<Vec<Option<usize>>>,
    /// Forward passes the drafter ran for it (a draft model or EAGLE head: one that feeds the context, then one
    /// after each kept token but the last; 0 for drafters without a model). A draft the confidence bar stops
    /// early still paid for its passes: the server's draft budget prices drafts by passes.
    pub passes: usize,
    /// The drafter spent the cycle feeding rows it had not seen (a long catch-up fed in pieces beside other
    /// requests) and drafted nothing by design: not a drafting decision, so acceptance estimates leave it out.
    pub catching_up: bool,
}

impl Draft {
    /// q(token) of draft position `i`.
    pub fn q(&self, i: usize) -> f32 {
        match &self.distributions {
            Some(d) => d[i].prob_of(self.tokens[i]),
            None => 1.0,
        }
    }

    /// The full q distribution of position `i` (a point mass for deterministic drafters).
    pub fn distribution(&self, i: usize) -> Distribution {
        match &self.distributions {
            Some(d) => d[i].clone(),
            None => Distribution {
                ids: vec![self.tokens[i]],
                probs: vec![1.0],
            },
        }
    }
}

/// A head pass a drafter asks for when it drafts together with others of its kind (EAGLE-3 chains sharing one
/// head: [`crate::decode::step`] runs every request's pass of a round as one batched head pass).
#[derive(Debug, Clone)]
pub struct BatchedPass {
    pub tokens: Vec<u32>,
    /// Target features of the rows the pass feeds (3H a row); None: one row fed from the last output (or, with
    /// `device_features`, the rows where they lie on the head's device).
    pub features: Option<Vec<f32>>,
    pub device_features: Option<eagle3::waiting::DeviceFeatureRows>,
    pub want: eagle3::HeadWant,
}

/// How a drafter starts a batched draft.
#[derive(Debug)]
pub enum BatchedStart {
    /// It drafts alone ([`Drafter::propose`]).
    Alone,
    /// No draft this cycle.
    Nothing,
    /// Its first pass.
    Pass(BatchedPass),
}

pub trait Drafter {
    /// Short name for reports ("model", "ngram").
    fn method(&self) -> &'static str;

    /// Proposes up to `k` tokens continuing `context`. May return fewer (even none: the cycle then verifies the
    /// pending token alone, which is a plain decoding step).
    fn propose(&mut self, context: &[u32], k: usize, sampling: &SamplingParams) -> Result<Draft>;

    /// Tokens of `context` this drafter must still process before it can draft (a draft model's cache lags
    /// the context while a scheduler gives it no drafts; the next draft feeds them all first). A scheduler
    /// weighs this catch-up as part of what resuming costs. 0 by default (stateless drafters).
    fn lag(&self, _context: &[u32]) -> usize {
        0
    }

    /// Whether what it lags ([`Self::lag`]) is fed by a small pass of its own that can run beside other
    /// requests (an EAGLE-3 head), rather than a model's steps that would stall a batch (a draft model, the
    /// default): a scheduler may then resume it beside others.
    fn cheap_catch_up(&self) -> bool {
        false
    }

    /// With a cheap catch-up, the longest one (tokens) it resumes with beside other requests (fed in pieces);
    /// longer ones only alone. 0 by default.
    fn catch_up_reach(&self) -> usize {
        0
    }

    /// Layers of the target whose hidden states this drafter needs (EAGLE-3); none by default.
    fn target_layers(&self) -> &[usize] {
        &[]
    }

    /// Told after each target forward (the prefill, every verify pass) that asked for [`Self::target_layers`]:
    /// `hidden` holds those layers' outputs for the pass's rows; the rows `kept` (in order) stay in the context at
    /// positions `first_position..` (the prompt, or the pending token and the accepted drafts: a prefix for a
    /// chain, the accepted path for a tree), the rest were rejected. Ignored by default.
    fn observe_target(
        &mut self,
        _first_position: usize,
        _hidden: &[(usize, Box<dyn crate::model::RowMatrix>)],
        _kept: &[usize],
    ) -> Result<()> {
        Ok(())
    }

    /// Told after each verify pass how long the target took over `tokens` tokens (the pending token plus the
    /// drafts), so a drafter can weigh what one more drafted token costs on this hardware. Ignored by default.
    fn observe_verify(&mut self, _tokens: usize, _seconds: f64) {}

    /// Batched drafting, the alternative to [`Self::propose`] for drafters whose passes can run together with
    /// other requests' (EAGLE-3 chains): the caller runs each pass asked for (with [`Self::batched_cache`]),
    /// hands its output to [`Self::batched_after`] until that asks for no more, then takes the draft from
    /// [`Self::batched_finish`]. The draft equals what `propose` would return. Drafters that cannot answer
    /// `Alone` (the default).
    /// `beside_others`: other requests draft in the same step (a drafter may then spread a long catch-up over
    /// several cycles rather than stall them all).
    fn batched_begin(
        &mut self,
        _context: &[u32],
        _k: usize,
        _sampling: &SamplingParams,
        _beside_others: bool,
    ) -> Result<BatchedStart> {
        Ok(BatchedStart::Alone)
    }

    /// The cache the batched passes run on.
    fn batched_cache(&mut self) -> Option<&mut dyn crate::model::forward::SequenceCache> {
        None
    }

    /// The output of the last pass asked for; returns the next pass, or None when the draft is complete.
    fn batched_after(
        &mut self,
        _output: eagle3::HeadOutput,
        _sampling: &SamplingParams,
    ) -> Result<Option<BatchedPass>> {
        Err(crate::error::Error::InvalidArgument(format!(
            "drafter {} does not draft in batches",
            self.method()
        )))
    }

    /// The completed draft (and the drafter back in its state between drafts).
    fn batched_finish(&mut self) -> Result<Draft> {
        Err(crate::error::Error::InvalidArgument(format!(
            "drafter {} does not draft in batches",
            self.method()
        )))
    }

    /// A batched draft whose first pass (`pass`, from [`Self::batched_begin`]) has no other request's pass to
    /// share a round with: the whole draft in one go if this drafter can do better alone (an EAGLE-3 greedy chain
    /// run whole on the head's device, no host round trip between passes), the same draft the rounds would give;
    /// None (the default) to go on pass by pass.
    fn batched_alone(
        &mut self,
        _pass: &BatchedPass,
        _sampling: &SamplingParams,
    ) -> Result<Option<Draft>> {
        Ok(None)
    }

    /// For batched drafting on a head that runs several greedy chains at once
    /// ([`eagle3::HeadCompute::run_greedy_chains`]): after [`Self::batched_begin`], how many passes after the first
    /// its draft would run when it is such a chain; None (the default) to go round by round.
    fn batched_chain_more(&self) -> Option<usize> {
        None
    }

    /// Its draft from a batched chain's tops (the first pass's, then each later pass's: at least
    /// [`Self::batched_chain_more`] + 1 of them; it keeps what its own chain reaches), `fed` being its cache's
    /// length after the first pass's rows: the draft the rounds would give.
    fn batched_chain_finish(
        &mut self,
        _fed: usize,
        _tops: &[(u32, f32)],
        _sampling: &SamplingParams,
    ) -> Result<Draft> {
        Err(crate::error::Error::InvalidArgument(format!(
            "drafter {} does not draft chains in batches",
            self.method()
        )))
    }

    /// A copy of what a later request whose context starts the same way could reuse. None by default: drafters
    /// that rebuild their state from the context (prompt lookup, a draft model's cache, fed lazily) need nothing.
    fn prefix_state(&self) -> Option<DrafterPrefix> {
        None
    }

    /// How many positions of a new context it could start from `prefix` with, when the new context shares its
    /// first `common` tokens with the one `prefix` came from. 0 by default.
    fn prefix_reach(&self, prefix: &DrafterPrefix, common: usize) -> usize {
        let _ = (prefix, common);
        0
    }

    /// Starts a new generation from the first `n` positions of `prefix` (`n` at most [`Self::prefix_reach`]):
    /// afterwards it expects the target's features from position `n` on. On an error it is left empty.
    fn adopt_prefix(&mut self, prefix: &DrafterPrefix, n: usize) -> Result<()> {
        let _ = (prefix, n);
        Err(crate::error::Error::InvalidArgument(format!(
            "drafter {} cannot start from another request's state",
            self.method()
        )))
    }
}

/// A finished drafter's state that a later request may start from (a prefix cache keeps it beside the target's
/// KV cache): an EAGLE-3 head's cache and the target features it had not fed yet.
pub struct DrafterPrefix {
    /// The drafter's cache, one row per target position `0..cache.len()`. An EAGLE-3 row reads its position's
    /// target features and the next token, so row `i` holds for contexts agreeing on tokens `0..=i + 1`.
    pub cache: Box<dyn crate::model::forward::SequenceCache>,
    /// Target features of positions `cache.len()..`, `width` values each: on the host, or still in the target
    /// outputs of a device (shared, not read).
    pub features: crate::draft::eagle3::waiting::WaitingFeatures,
    pub width: usize,
}

impl DrafterPrefix {
    /// Positions it covers: cache rows and waiting features.
    pub fn positions(&self) -> usize {
        self.cache.len() + self.features.rows()
    }

    /// Device memory its waiting features hold (the target outputs they live in), for a prefix cache's budget.
    pub fn held_bytes(&self) -> usize {
        self.features.held_bytes()
    }
}

/// A borrowed drafter drafts as itself (a [`crate::decode::Generation`] owns its drafter; a caller that keeps
/// one lends it this way).
impl<D: Drafter + ?Sized> Drafter for &mut D {
    fn method(&self) -> &'static str {
        (**self).method()
    }

    fn propose(&mut self, context: &[u32], k: usize, sampling: &SamplingParams) -> Result<Draft> {
        (**self).propose(context, k, sampling)
    }

    fn lag(&self, context: &[u32]) -> usize {
        (**self).lag(context)
    }

    fn cheap_catch_up(&self) -> bool {
        (**self).cheap_catch_up()
    }

    fn catch_up_reach(&self) -> usize {
        (**self).catch_up_reach()
    }

    fn target_layers(&self) -> &[usize] {
        (**self).target_layers()
    }

    fn observe_target(
        &mut self,
        first_position: usize,
        hidden: &[(usize, Box<dyn crate::model::RowMatrix>)],
        kept: &[usize],
    ) -> Result<()> {
        (**self).observe_target(first_position, hidden, kept)
    }

    fn batched_begin(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
        beside_others: bool,
    ) -> Result<BatchedStart> {
        (**self).batched_begin(context, k, sampling, beside_others)
    }

    fn batched_cache(&mut self) -> Option<&mut dyn crate::model::forward::SequenceCache> {
        (**self).batched_cache()
    }

    fn batched_after(
        &mut self,
        output: eagle3::HeadOutput,
        sampling: &SamplingParams,
    ) -> Result<Option<BatchedPass>> {
        (**self).batched_after(output, sampling)
    }

    fn batched_finish(&mut self) -> Result<Draft> {
        (**self).batched_finish()
    }

    fn batched_alone(
        &mut self,
        pass: &BatchedPass,
        sampling: &SamplingParams,
    ) -> Result<Option<Draft>> {
        (**self).batched_alone(pass, sampling)
    }

    fn observe_verify(&mut self, tokens: usize, seconds: f64) {
        (**self).observe_verify(tokens, seconds)
    }

    fn prefix_state(&self) -> Option<DrafterPrefix> {
        (**self).prefix_state()
    }

    fn prefix_reach(&self, prefix: &DrafterPrefix, common: usize) -> usize {
        (**self).prefix_reach(prefix, common)
    }

    fn adopt_prefix(&mut self, prefix: &DrafterPrefix, n: usize) -> Result<()> {
        (**self).adopt_prefix(prefix, n)
    }
}

/// What verifying one more token costs, learned from the verify passes of the running generation: the median
/// time of the last [`VerifyCostTracker::WINDOW`] passes of each size.
#[derive(Debug, Clone, Default)]
pub struct VerifyCostTracker {
    /// samples[n - 1]: recent verify times over n tokens, oldest first.
    samples: Vec<Vec<f64>>,
    /// marginal[j - 1]: verify(j + 1) - verify(j), over verify(1), for the sizes measured well enough.
    marginal: Vec<Option<f64>>,
}

impl VerifyCostTracker {
    pub const WINDOW: usize = 31;
    /// Passes of a size before its median is trusted.
    pub const MIN_SAMPLES: usize = 4;

    pub fn observe(&mut self, tokens: usize, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        if self.samples.len() < tokens {
            self.samples.resize(tokens, Vec::new());
        }
        let s = &mut self.samples[tokens - 1];
        if s.len() == Self::WINDOW {
            s.remove(0);
        }
        s.push(seconds);
        let medians: Vec<Option<f64>> = self
            .samples
            .iter()
            .map(|s| {
                (s.len() >= Self::MIN_SAMPLES).then(|| {
                    let mut v = s.clone();
                    v.sort_by(f64::total_cmp);
                    v[v.len() / 2]
                })
            })
            .collect();
        self.marginal = match medians.first().copied().flatten() {
            Some(one) => medians
                .windows(2)
                .map(|w| match (w[0], w[1]) {
                    (Some(a), Some(b)) => Some((b - a) / one),
                    _ => None,
                })
                .collect(),
            None => Vec::new(),
        };
    }

    /// What the `j`-th drafted token (1-based) costs in verify time, in units of one plain decoding step:
    /// measured when both sizes have been seen often enough; else `prior`, or the nearest measured smaller
    /// draft's cost when that is higher (an unmeasured deeper token is not assumed cheaper than either). Never
    /// below 1% (noise must not make drafting look free).
    pub fn marginal(&self, j: usize, prior: f64) -> f64 {
        if let Some(Some(m)) = self.marginal.get(j - 1) {
            return m.max(0.01);
        }
        let smaller = self.marginal[..self.marginal.len().min(j)]
            .iter()
            .rev()
            .find_map(|m| *m);
        smaller.map_or(prior, |m| m.max(prior)).max(0.01)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_cost_tracker_learns_marginal_costs() {
        let mut t = VerifyCostTracker::default();
        // Nothing measured: the prior.
        assert_eq!(t.marginal(1, 0.2), 0.2);
        for i in 0..VerifyCostTracker::MIN_SAMPLES {
            t.observe(1, 0.030);
            // One wild outlier among the two-token passes must not move the median.
            t.observe(2, if i == 0 { 1.0 } else { 0.033 });
        }
        assert!((t.marginal(1, 0.2) - 0.1).abs() < 1e-9);
        // Three-token passes not seen yet: the prior, or the nearest smaller draft's cost when higher.
        assert!((t.marginal(2, 0.2) - 0.2).abs() < 1e-9);
        assert!((t.marginal(2, 0.05) - 0.1).abs() < 1e-9);
        for _ in 0..VerifyCostTracker::MIN_SAMPLES {
            t.observe(3, 0.042);
        }
        assert!((t.marginal(2, 0.2) - 0.3).abs() < 1e-9);
        // Invalid samples are ignored; a cheaper-than-before size is floored, not negative.
        t.observe(0, 1.0);
        t.observe(4, f64::NAN);
        t.observe(4, -1.0);
        for _ in 0..VerifyCostTracker::MIN_SAMPLES {
            t.observe(4, 0.040);
        }
        assert_eq!(t.marginal(3, 0.2), 0.01);
        // Old samples leave the window.
        for _ in 0..VerifyCostTracker::WINDOW {
            t.observe(2, 0.036);
        }
        assert!((t.marginal(1, 0.2) - 0.2).abs() < 1e-9);
    }
}
