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

fn check_tree(tokens: &[u32], parents: &[Option<usize>]) -> Result<()> {
    if parents.len() != tokens.len() {
        return Err(crate::error::Error::InvalidArgument(format!(
            "tree draft: {} tokens but {} parents",
            tokens.len(),
            parents.len()
        )));
    }
    Ok(())
}

/// Greedy acceptance of a tree draft: `logits` row 0 follows the pending token and row i + 1 follows draft token i,
/// whose parent among the drafts is `parents[i]` (None: the pending token). From the root, each step keeps the child
/// whose token is the target's argmax at its parent; the walk ends where no child matches. Returns the acceptance
/// and the accepted path (draft indices, root to leaf). Only each row's argmax is read.
pub fn accept_tree(
    tokens: &[u32],
    parents: &[Option<usize>],
    logits: &dyn RowMatrix,
) -> Result<(Acceptance, Vec<usize>)> {
    check_tree(tokens, parents)?;
    let best = logits.argmax_rows()?;
    let mut path = Vec::new();
    // Row of the node the walk stands on (0: the pending token).
    let mut row: usize = 0;
    loop {
        let parent = row.checked_sub(1);
        let child = (0..tokens.len()).find(|&i| parents[i] == parent && tokens[i] == best[row]);
        match child {
            Some(i) => {
                path.push(i);
                row = i + 1;
            }
            None => break,
        }
    }
    Ok((
        Acceptance {
            accepted: path.len(),
            next: best[row],
        },
        path,
    ))
}

/// Sampled acceptance of a tree draft, lossless (the output has exactly the target's distribution). The tree's
/// tokens are chosen deterministically from the context (EAGLE's top-k), so each child is a point-mass proposal:
/// at a node whose target distribution is p, its children are tried in order, each accepted with probability
/// p(child); a rejected child's token leaves p (p becomes normalize(max(0, p - point mass)), i.e. p without it),
/// and when every child is rejected the next token is drawn from what is left. The first child is thus chosen
/// with probability p(c1), the second with (1 - p(c1)) p(c2) / (1 - p(c1)) = p(c2), any other token x with p(x):
/// exactly p. An accepted child repeats this at its own row, with the target's distribution after it.
pub fn accept_tree_sampled(
    tokens: &[u32],
    parents: &[Option<usize>],
    logits: &dyn RowMatrix,
    sampler: &mut Sampler,
) -> Result<(Acceptance, Vec<usize>)> {
    check_tree(tokens, parents)?;
    let params = *sampler.params();
    let mut path = Vec::new();
    let mut row: usize = 0;
    loop {
        let parent = row.checked_sub(1);
        let mut p = sampling::distribution(&logits.row(row)?, &params);
        let mut chosen = None;
        for i in (0..tokens.len()).filter(|&i| parents[i] == parent) {
            if sampler.uniform() < p.prob_of(tokens[i]) {
                chosen = Some(i);
                break;
            }
            let point = sampling::Distribution {
                ids: vec![tokens[i]],
                probs: vec![1.0],
            };
            p = sampling::residual(&p, &point);
        }
        match chosen {
            Some(i) => {
                path.push(i);
                row = i + 1;
            }
            None => {
                let next = sampler.draw(&p);
                return Ok((
                    Acceptance {
                        accepted: path.len(),
                        next,
                    },
                    path,
                ));
            }
        }
    }
}

/// Simulated acceptance for speed work (SGLang's SGLANG_SIMULATE_ACC_LEN): each draft token is accepted with
/// probability `p`, independently, up to the first rejection, instead of being checked. The verify pass still
/// runs on every drafted row and its argmax is still read (the same device work and copies as greedy
/// verification); the token after the accepted prefix is the target's argmax there. The output is not what the
/// model would write: it is for measuring speedup against acceptance, e.g. on random-weight models.
pub struct SimulatedAcceptance {
    p: f64,
    state: u64,
}

impl SimulatedAcceptance {
    pub fn new(p: f64, seed: u64) -> Result<Self> {
        check_simulated_acceptance(p)?;
        Ok(Self {
            p,
            state: seed ^ 0x5DEE_CE66_D1CE_4E5B,
        })
    }

    /// A uniform draw in [0, 1) (splitmix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn accept(&mut self, draft: &Draft, logits: &dyn RowMatrix) -> Result<Acceptance> {
        let best = logits.argmax_rows()?;
        let mut accepted = 0;
        while accepted < draft.tokens.len() && self.uniform() < self.p {
            accepted += 1;
        }
        Ok(Acceptance {
            accepted,
            next: best[accepted],
        })
    }
}

/// Checks `--simulate-acceptance`.
pub fn check_simulated_acceptance(p: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&p) {
        return Err(crate::error::Error::InvalidArgument(format!(
            "--simulate-acceptance must be a probability between 0 and 1, got {p}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::forward::HostRows;

    /// Five rows of four logits whose argmaxes are 3, 2, 1, 0, 3.
    fn rows() -> HostRows {
        let best = [3usize, 2, 1, 0, 3];
        let mut data = vec![0f32; 5 * 4];
        for (r, &b) in best.iter().enumerate() {
            data[r * 4 + b] = 1.0;
        }
        HostRows {
            rows: 5,
            cols: 4,
            data,
        }
    }

    fn draft() -> Draft {
        Draft {
            tokens: vec![0, 0, 0, 0],
            distributions: None,
            parents: None,
            passes: 0,
            catching_up: false,
        }
    }

    #[test]
    fn simulated_acceptance_follows_its_probability() {
        let logits = rows();
        // p = 1 accepts every draft token, then takes the target's argmax after them.
        let mut all = SimulatedAcceptance::new(1.0, 7).unwrap();
        assert_eq!(
            all.accept(&draft(), &logits).unwrap(),
            Acceptance {
                accepted: 4,
                next: 3
            }
        );
        // p = 0 accepts none: the target's own first token, as plain decoding.
        let mut none = SimulatedAcceptance::new(0.0, 7).unwrap();
        assert_eq!(
            none.accept(&draft(), &logits).unwrap(),
            Acceptance {
                accepted: 0,
                next: 3
            }
        );
        // p = 0.6: accepted lengths are a truncated geometric; mean sum_{i=1..4} 0.6^i = 1.3056, and each
        // prefix length i is reached with probability 0.6^i.
        let mut sim = SimulatedAcceptance::new(0.6, 11).unwrap();
        let n = 20_000;
        let mut reached = [0usize; 5];
        let mut total = 0;
        for _ in 0..n {
            let a = sim.accept(&draft(), &logits).unwrap();
            assert_eq!(a.next, [3, 2, 1, 0, 3][a.accepted]);
            total += a.accepted;
            for r in reached.iter_mut().take(a.accepted + 1) {
                *r += 1;
            }
        }
        let mean = total as f64 / n as f64;
        assert!((mean - 1.3056).abs() < 0.03, "mean accepted {mean}");
        for (i, &r) in reached.iter().enumerate() {
            let want = 0.6f64.powi(i as i32);
            let got = r as f64 / n as f64;
            assert!(
                (got - want).abs() < 0.015,
                "P(accepted >= {i}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn simulated_acceptance_refuses_non_probabilities() {
        for p in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let err = SimulatedAcceptance::new(p, 0).err().expect("refused");
            assert!(err.to_string().contains("--simulate-acceptance"), "{err}");
        }
    }
}
