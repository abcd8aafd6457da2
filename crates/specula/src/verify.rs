//! Verification of drafts against the target's logits: greedy match, or lossless speculative sampling
//! (accept draft token x with probability min(1, p(x)/q(x)), otherwise draw from normalize(max(0, p - q))), so
//! the output has exactly the distribution plain decoding would have.

use crate::draft::Draft;
use crate::model::ForwardOutput;
use crate::sampling::{self, Sampler};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acceptance {
    /// Draft tokens kept (a prefix of the draft).
    pub accepted: usize,
    /// The target's own token after the accepted prefix (a correction, or a bonus when all were accepted).
    pub next: u32,
}

/// `logits` has one row per verified position: row 0 follows the pending token, row i follows draft token i-1.
pub fn accept(draft: &Draft, logits: &ForwardOutput, sampler: &mut Sampler) -> Acceptance {
    let params = *sampler.params();
    for (i, &token) in draft.tokens.iter().enumerate() {
        let row = logits.row(i);
        if params.is_greedy() {
            let best = sampling::argmax(row);
            if best != token {
                return Acceptance {
                    accepted: i,
                    next: best,
                };
            }
            continue;
        }
        let p = sampling::distribution(row, &params);
        let (p_x, q_x) = (p.prob_of(token), draft.q(i));
        let u = sampler.uniform();
        // u < p/q  <=>  u * q < p, without dividing by a tiny q.
        if u * q_x < p_x {
            continue;
        }
        let next = sampler.draw(&sampling::residual(&p, &draft.distribution(i)));
        return Acceptance { accepted: i, next };
    }
    let last = logits.row(draft.tokens.len());
    Acceptance {
        accepted: draft.tokens.len(),
        next: sampler.sample(last),
    }
}
