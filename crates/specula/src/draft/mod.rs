//! Drafters: cheap proposers of the next few tokens, verified by the target in one forward pass.
//!
//! Every drafter implements one small trait. The decode loop hands it the whole context (prompt, generated
//! tokens, and the pending token the target has not seen yet); the drafter keeps whatever state it needs (a
//! draft model's KV cache, an n-gram index) and syncs it to the context itself, so rollback after a partial
//! acceptance needs no special call.

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

pub trait Drafter {
    /// Short name for reports ("model", "ngram").
    fn method(&self) -> &'static str;

    /// Proposes up to `k` tokens continuing `context`. May return fewer (even none: the cycle then verifies the
    /// pending token alone, which is a plain decoding step).
    fn propose(&mut self, context: &[u32], k: usize, sampling: &SamplingParams) -> Result<Draft>;

    /// Layers of the target whose hidden states this drafter needs (EAGLE-3); none by default.
    fn target_layers(&self) -> &[usize] {
        &[]
    }
}
