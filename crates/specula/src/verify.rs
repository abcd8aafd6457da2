//! Verification of drafts against the target's logits: greedy match, or lossless speculative sampling
//! (accept draft token x with probability min(1, p(x)/q(x)), otherwise draw from normalize(max(0, p - q))), so
//! the output has exactly the distribution plain decoding would have.

use crate::draft::Draft;
use crate::error::Result;
use crate::model::RowMatrix;
use crate::sampling::{self, Sampler};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acceptance {
    /// Draft tokens kept (a prefix of the draft).
    pub accepted: usize,
    /// The target's own token after the accepted prefix (a correction, or a bonus when all were accepted).
    pub next: u32,
}

/// `logits` has one row per verified position: row 0 follows the pending token, row i follows draft token i-1.
/// Greedy verification reads only each row's argmax (computed where the logits live); sampling reads the rows
/// it reaches.
pub fn accept(draft: &Draft, logits: &dyn RowMatrix, sampler: &mut Sampler) -> Result<Acceptance> {
    let params = *sampler.params();
    if params.is_greedy() {
        let best = logits.argmax_rows()?;
        let accepted = draft
            .tokens
            .iter()
            .zip(&best)
            .take_while(|(drafted, best)| drafted == best)
            .count();
        return Ok(Acceptance {
            accepted,
            next: best[accepted],
        });
    }
    for (i, &token) in draft.tokens.iter().enumerate() {
        let row = logits.row(i)?;
        let p = sampling::distribution(&row, &params);
        let (p_x, q_x) = (p.prob_of(token), draft.q(i));
        let u = sampler.uniform();
        // u < p/q  <=>  u * q < p, without dividing by a tiny q.
        if u * q_x < p_x {
            continue;
        }
        let next = sampler.draw(&sampling::residual(&p, &draft.distribution(i)));
        return Ok(Acceptance { accepted: i, next });
    }
    let last = logits.row(draft.tokens.len())?;
    Ok(Acceptance {
        accepted: draft.tokens.len(),
        next: sampler.sample(&last),
    })
}
