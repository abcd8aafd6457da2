//! Prompt lookup (n-gram) drafting: no model, microseconds per proposal; strong on code and on answers that
//! quote the prompt.
//!
//! The drafter indexes every n-gram (n = 1..=max_n) of the context with the tokens that followed it and how
//! often. It drafts one token at a time: the longest suffix of context + draft-so-far (at least min_n tokens)
//! that occurred before names the candidate, the token that most often followed it (ties: the most recent).
//! Each proposed token costs a verify slot whether or not it is accepted, so the drafter only continues while
//! the estimated chance that the whole draft so far is accepted stays above `--ngram-confidence` (default
//! [`DEFAULT_MIN_CONFIDENCE`]), or, with `auto`, above what one more verified token has cost on this hardware
//! (learned from the generation's own verify passes). The per-token estimate comes from the length of the copy
//! being continued and how consistently the n-gram was followed by the candidate.

use std::collections::HashMap;

use crate::draft::{Draft, Drafter, VerifyCostTracker};
use crate::error::{Error, Result};
use crate::sampling::SamplingParams;

/// A candidate next token from the index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub token: u32,
    /// Length of the matched suffix.
    pub n: usize,
    /// How many tokens the match extends backwards from the candidate's latest occurrence (at least n, at
    /// most [`MAX_RUN`]): the length of the copy the draft is continuing.
    pub run: usize,
    /// Times the matched n-gram was followed by `token`, and followed by anything.
    pub count: u32,
    pub total: u32,
}

#[derive(Debug, Default)]
struct Followers {
    /// Start of the most recent occurrence (to tell hash collisions from matches).
    last_start: usize,
    /// (token, count, position of its most recent occurrence)
    next: Vec<(u32, u32, usize)>,
}

/// When to stop drafting.
#[derive(Debug, Clone)]
enum Stopping {
    /// While the estimated chance that the whole draft is accepted is at least this.
    Fixed(f64),
    /// While that chance is at least [`COST_MARGIN`] times what verifying one more token costs (in plain
    /// decoding steps), as measured on the generation's verify passes; `prior` until a draft length has been
    /// measured.
    CostAware { cost: VerifyCostTracker, prior: f64 },
}

/// The chance a draft must have, as a multiple of the next token's verify cost in plain steps. Above 1 because
/// the confidence estimates are optimistic at the margin; of 1, 1.5 and 2, 1.5 was best on all four recorded
/// prompt sets (code, held-out code, edits, chat) replayed with exact verify costs in `examples/draft_replay.rs`.
pub const COST_MARGIN: f64 = 1.5;

/// Default stopping threshold: on recorded greedy outputs of four prompt sets replayed with this CPU's verify
/// costs, 0.5 was best or within 0.5% of best at every k from 2 to 8, and made k = 8 as good as any k
/// (`examples/draft_replay.rs`, docs/benchmarks.md). The cost-aware rule did better only where it had long
/// generations to learn the verify costs.
pub const DEFAULT_MIN_CONFIDENCE: f64 = 0.5;

/// Verify cost of a drafted token assumed until the generation has measured it (about this repo's 2-core CPU;
/// measurements replace it once each draft length has been verified a few times).
pub const PRIOR_MARGINAL: f64 = 0.2;

/// The same on a GPU, where a verify pass of a few rows costs about one step: on an H100, verify(2..8) of the real
/// Qwen2.5-Coder-1.5B cost 1.05-1.09 plain steps (docs/benchmarks.md, session 44), 0.01-0.05 a drafted token.
/// With the CPU's prior the rule stopped where the chance fell below 0.3 until it had measured each draft length,
/// which a short generation that rarely drafts deep never does (1.07x there, against 1.11x for no bar).
pub const GPU_PRIOR_MARGINAL: f64 = 0.03;

/// The prior for a target on `device` (a model's [`crate::model::Model::device`]: "cpu", or a GPU's name).
pub fn prior_marginal(device: &str) -> f64 {
    if device == "cpu" {
        PRIOR_MARGINAL
    } else {
        GPU_PRIOR_MARGINAL
    }
}

pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
    stopping: Stopping,
    /// One map per n (index n - 1): hash of the n tokens -> what followed them.
    tables: Vec<HashMap<u64, Followers>>,
    /// The tokens indexed so far: a prefix of every context since the last reset.
    indexed: Vec<u32>,
}

fn hash_tokens(tokens: &[u32]) -> u64 {
    // FNV-1a over the token ids: the index is rebuilt per request, so no need for DoS resistance.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        for b in t.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl NgramDrafter {
    /// Stops at [`DEFAULT_MIN_CONFIDENCE`].
    pub fn new(min_n: usize, max_n: usize) -> Result<Self> {
        Self::with_confidence(min_n, max_n, DEFAULT_MIN_CONFIDENCE)
    }

    /// Cost-aware stopping (`--ngram-confidence auto`), assuming the CPU's verify costs until measured (see
    /// [`Self::with_verify_prior`]).
    pub fn cost_aware(min_n: usize, max_n: usize) -> Result<Self> {
        Self::build(
            min_n,
            max_n,
            Stopping::CostAware {
                cost: VerifyCostTracker::default(),
                prior: PRIOR_MARGINAL,
            },
        )
    }

    /// With cost-aware stopping, assumes a drafted token costs `prior` plain steps to verify until measured
    /// ([`prior_marginal`] of the target's device); no effect on a fixed bar.
    pub fn with_verify_prior(mut self, prior: f64) -> Result<Self> {
        if !(prior.is_finite() && prior > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "prompt lookup's assumed verify cost must be positive (got {prior})"
            )));
        }
        if let Stopping::CostAware { prior: p, .. } = &mut self.stopping {
            *p = prior;
        }
        Ok(self)
    }

    /// [`Self::with_stopping`] for a target on `device`: its verify-cost prior when cost-aware.
    pub fn for_device(
        min_n: usize,
        max_n: usize,
        min_confidence: Option<f64>,
        device: &str,
    ) -> Result<Self> {
        Self::with_stopping(min_n, max_n, min_confidence)?.with_verify_prior(prior_marginal(device))
    }

    /// Stops where the estimated chance that the draft is accepted falls below `min_confidence` (0 drafts
    /// every candidate up to k).
    pub fn with_confidence(min_n: usize, max_n: usize, min_confidence: f64) -> Result<Self> {
        if !(0.0..=1.0).contains(&min_confidence) {
            return Err(Error::InvalidArgument(format!(
                "--ngram-confidence must be between 0 and 1 (got {min_confidence})"
            )));
        }
        Self::build(min_n, max_n, Stopping::Fixed(min_confidence))
    }

    /// [`Self::with_confidence`], or [`Self::cost_aware`] for `None`.
    pub fn with_stopping(min_n: usize, max_n: usize, min_confidence: Option<f64>) -> Result<Self> {
        match min_confidence {
            Some(c) => Self::with_confidence(min_n, max_n, c),
            None => Self::cost_aware(min_n, max_n),
        }
    }

    fn build(min_n: usize, max_n: usize, stopping: Stopping) -> Result<Self> {
        if min_n == 0 || max_n < min_n {
            return Err(Error::InvalidArgument(format!(
                "n-gram lengths must satisfy 1 <= --ngram-min <= --ngram-max (got {min_n} and {max_n})"
            )));
        }
        if max_n > MAX_NGRAM {
            return Err(Error::InvalidArgument(format!(
                "--ngram-max must be at most {MAX_NGRAM} (got {max_n})"
            )));
        }
        Ok(NgramDrafter {
            min_n,
            max_n,
            stopping,
            tables: (0..max_n).map(|_| HashMap::new()).collect(),
            indexed: Vec::new(),
        })
    }

    /// Brings the index up to `context`: appends new positions, or rebuilds when the context is not an
    /// extension of what was indexed (a new request).
    fn sync(&mut self, context: &[u32]) {
        let extends = context.len() >= self.indexed.len()
            && context[..self.indexed.len()] == self.indexed[..];
        if !extends {
            self.tables.iter_mut().for_each(HashMap::clear);
            self.indexed.clear();
        }
        // Position i is indexed once token i + 1 (its follower) is known.
        let from = self.indexed.len().saturating_sub(1);
        self.indexed
            .extend_from_slice(&context[self.indexed.len()..]);
        for end in from..self.indexed.len().saturating_sub(1) {
            let follower = self.indexed[end + 1];
            for n in 1..=self.max_n.min(end + 1) {
                let start = end + 1 - n;
                let key = hash_tokens(&self.indexed[start..=end]);
                let entry = self.tables[n - 1].entry(key).or_default();
                entry.last_start = start;
                match entry.next.iter_mut().find(|(t, _, _)| *t == follower) {
                    Some(slot) => {
                        slot.1 += 1;
                        slot.2 = end + 1;
                    }
                    None => entry.next.push((follower, 1, end + 1)),
                }
            }
        }
    }

    /// What followed the last `n` tokens of `seq` in the index, if they occurred before.
    fn followers(&self, seq: &[u32], n: usize) -> Option<&Followers> {
        let pattern = &seq[seq.len() - n..];
        let f = self.tables[n - 1].get(&hash_tokens(pattern))?;
        // A hash collision is not a match.
        (self.indexed[f.last_start..f.last_start + n] == *pattern).then_some(f)
    }

    /// [`Candidate::run`]: how far `seq` matches backwards from the occurrence whose follower is at `follow`.
    fn copy_run(&self, seq: &[u32], follow: usize) -> usize {
        seq.iter()
            .rev()
            .zip(self.indexed[..follow].iter().rev())
            .take(MAX_RUN)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// The candidate after `seq` (the context plus the draft so far): longest match first.
    fn candidate(&self, seq: &[u32]) -> Option<Candidate> {
        (self.min_n..=self.max_n.min(seq.len()))
            .rev()
            .find_map(|n| {
                let f = self.followers(seq, n)?;
                let &(token, count, follow) =
                    f.next.iter().max_by_key(|(_, c, last)| (*c, *last))?;
                Some(Candidate {
                    token,
                    n,
                    run: self.copy_run(seq, follow),
                    count,
                    total: f.next.iter().map(|(_, c, _)| c).sum(),
                })
            })
    }

    /// Estimated probability that the target agrees with `c`, from two things that predict it on recorded
    /// greedy outputs (`examples/draft_replay.rs`; table in docs/benchmarks.md): how long the copy being
    /// continued already is (`run`: one matching token is right about a quarter of the time, a 16-token copy
    /// nine times in ten) and whether the n-gram was always followed by the candidate (an n-gram seen with
    /// different followers marks a branch point, where the match is rarely right).
    pub fn confidence(c: &Candidate) -> f64 {
        let single_occurrence = 1.0 - 0.75 * (c.run.max(1) as f64).powf(-0.6);
        // (count + 1) / (total + 2) is 2/3 for a single occurrence: log-odds relative to that.
        let consistency = (c.count as f64 + 1.0) / (c.total as f64 + 2.0);
        let evidence = (consistency / (1.0 - consistency) / 2.0).ln();
        let log_odds = (single_occurrence / (1.0 - single_occurrence)).ln() + 3.0 * evidence;
        1.0 / (1.0 + (-log_odds).exp())
    }

    /// Distinct candidates for the next token after `context`, most likely first: the followers of the
    /// longest matching n-gram by count, then those of shorter matches. Exposed for calibration.
    pub fn alternatives(&mut self, context: &[u32], max: usize) -> Vec<Candidate> {
        self.sync(context);
        let mut out: Vec<Candidate> = Vec::new();
        for n in (self.min_n..=self.max_n.min(context.len())).rev() {
            let Some(f) = self.followers(context, n) else {
                continue;
            };
            let total = f.next.iter().map(|(_, c, _)| c).sum();
            let mut next = f.next.clone();
            next.sort_by_key(|&(_, c, last)| std::cmp::Reverse((c, last)));
            for (token, count, follow) in next {
                if out.len() >= max || out.iter().any(|c| c.token == token) {
                    continue;
                }
                out.push(Candidate {
                    token,
                    n,
                    run: self.copy_run(context, follow),
                    count,
                    total,
                });
            }
        }
        out
    }

    /// Candidates for successive draft positions, each with its confidence, stopping at `k` or when no
    /// n-gram matches. Exposed for calibration.
    pub fn candidates(&mut self, context: &[u32], k: usize) -> Vec<Candidate> {
        self.sync(context);
        let mut seq: Vec<u32> = context.to_vec();
        let mut out = Vec::new();
        while out.len() < k {
            let Some(c) = self.candidate(&seq) else {
                break;
            };
            seq.push(c.token);
            out.push(c);
        }
        out
    }
}

/// Longest backwards match [`Candidate::run`] measures.
pub const MAX_RUN: usize = 32;

/// Longest n-gram the index keeps.
pub const MAX_NGRAM: usize = 8;

impl Drafter for NgramDrafter {
    fn method(&self) -> &'static str {
        "ngram"
    }

    fn propose(&mut self, context: &[u32], k: usize, _sampling: &SamplingParams) -> Result<Draft> {
        let mut tokens = Vec::new();
        let mut all_accepted = 1.0;
        for c in self.candidates(context, k) {
            all_accepted *= Self::confidence(&c);
            let needed = match &self.stopping {
                Stopping::Fixed(min) => *min,
                Stopping::CostAware { cost, prior } => {
                    COST_MARGIN * cost.marginal(tokens.len() + 1, *prior)
                }
            };
            if all_accepted < needed {
                break;
            }
            tokens.push(c.token);
        }
        Ok(Draft {
            tokens,
            distributions: None,
            parents: None,
            passes: 0,
            catching_up: false,
        })
    }

    fn observe_verify(&mut self, tokens: usize, seconds: f64) {
        if let Stopping::CostAware { cost, .. } = &mut self.stopping {
            cost.observe(tokens, seconds);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_the_continuation_of_the_latest_match() {
        let mut d = NgramDrafter::with_confidence(1, 3, 0.0).unwrap();
        let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        // [1,2,3] was followed by 4 and by 5 once each: the most recent (5) wins the tie; then [2,3,5] -> 6,
        // [3,5,6] -> 1.
        let draft = d.propose(&ctx, 3, &SamplingParams::default()).unwrap();
        assert_eq!(draft.tokens, vec![5, 6, 1]);
        assert_eq!(
            d.propose(&[7, 8, 9], 3, &SamplingParams::default())
                .unwrap()
                .tokens,
            Vec::<u32>::new()
        );
        assert!(NgramDrafter::new(0, 2).is_err());
        assert!(NgramDrafter::new(3, 2).is_err());
        assert!(NgramDrafter::new(1, MAX_NGRAM + 1).is_err());
        assert!(NgramDrafter::with_confidence(1, 3, 1.5).is_err());
    }

    #[test]
    fn alternatives_rank_longest_match_first_then_shorter_ones() {
        let mut d = NgramDrafter::with_confidence(1, 3, 0.0).unwrap();
        // [1, 2, 3] never occurred before; [2, 3] was followed by 4 twice and by 5 once; [3] alone also by 8
        // (after [7, 3]).
        let ctx = [2, 3, 4, 2, 3, 5, 7, 3, 8, 2, 3, 4, 1, 2, 3];
        let alts = d.alternatives(&ctx, 3);
        let tokens: Vec<u32> = alts.iter().map(|c| c.token).collect();
        assert_eq!(tokens, vec![4, 5, 8]);
        assert_eq!((alts[0].n, alts[0].count, alts[0].total), (2, 2, 3));
        assert_eq!((alts[1].n, alts[1].count, alts[1].total), (2, 1, 3));
        assert_eq!(alts[2].n, 1);
        // The first alternative is the drafter's own first candidate.
        assert_eq!(d.candidates(&ctx, 1)[0].token, alts[0].token);
        assert_eq!(d.alternatives(&ctx, 1).len(), 1);
        assert!(d.alternatives(&[42], 3).is_empty());
    }

    #[test]
    fn cost_aware_stopping_drafts_more_when_verification_is_cheap() {
        // A context that repeats a 12-token phrase: the lookup is confident about long continuations.
        let phrase: Vec<u32> = (100..112).collect();
        let mut ctx = phrase.clone();
        ctx.extend_from_slice(&phrase[..6]);
        let drafted = |step_costs: &[f64]| {
            let mut d = NgramDrafter::cost_aware(1, 4).unwrap();
            for _ in 0..VerifyCostTracker::MIN_SAMPLES {
                for (n, &c) in step_costs.iter().enumerate() {
                    d.observe_verify(n + 1, c);
                }
            }
            d.propose(&ctx, 6, &SamplingParams::default())
                .unwrap()
                .tokens
        };
        let cheap = drafted(&[1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06]);
        let dear = drafted(&[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]);
        assert_eq!(cheap, phrase[6..12].to_vec());
        assert!(dear.len() < cheap.len(), "{dear:?}");
        assert_eq!(dear[..], phrase[6..6 + dear.len()]);
    }

    #[test]
    fn a_gpu_prior_drafts_deeper_before_anything_is_measured() {
        // Nothing measured yet: the CPU's prior (0.2 a token) stops where the chance falls below 0.3, a GPU's
        // (0.03) only below 0.045, so the same lookup drafts the whole continuation there.
        let phrase: Vec<u32> = (100..112).collect();
        let mut ctx = phrase.clone();
        ctx.extend_from_slice(&phrase[..6]);
        let drafted = |device: &str| {
            NgramDrafter::for_device(1, 4, None, device)
                .unwrap()
                .propose(&ctx, 6, &SamplingParams::default())
                .unwrap()
                .tokens
        };
        let cpu = drafted("cpu");
        let gpu = drafted("NVIDIA H100 80GB HBM3");
        assert_eq!(gpu, phrase[6..12].to_vec());
        assert!(!cpu.is_empty() && cpu.len() < gpu.len(), "{cpu:?}");
        assert_eq!(cpu[..], phrase[6..6 + cpu.len()]);
        // A fixed bar ignores the prior.
        let fixed = NgramDrafter::for_device(1, 4, Some(0.5), "NVIDIA H100 80GB HBM3")
            .unwrap()
            .propose(&ctx, 6, &SamplingParams::default())
            .unwrap()
            .tokens;
        assert!(fixed.len() < gpu.len(), "{fixed:?}");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(NgramDrafter::cost_aware(1, 4)
                .unwrap()
                .with_verify_prior(bad)
                .is_err());
        }
    }

    #[test]
    fn the_most_frequent_follower_wins() {
        let mut d = NgramDrafter::with_confidence(1, 2, 0.0).unwrap();
        // After 7: 1 twice, then 2 once (most recent); the count wins.
        let ctx = [7, 1, 7, 1, 7, 2, 7];
        let c = d.candidates(&ctx, 1);
        assert_eq!(c[0].token, 1);
        assert_eq!((c[0].n, c[0].count, c[0].total), (1, 2, 3));
    }

    #[test]
    fn index_follows_growing_and_new_contexts() {
        let mut d = NgramDrafter::with_confidence(2, 3, 0.0).unwrap();
        let mut ctx = vec![1, 2, 3, 4, 1, 2];
        assert_eq!(
            d.propose(&ctx, 1, &SamplingParams::default())
                .unwrap()
                .tokens,
            vec![3]
        );
        // Extending the context indexes the new positions ([1,2] now also followed by 8).
        ctx.extend([8, 5, 1, 2]);
        let c = d.candidates(&ctx, 1);
        assert_eq!((c[0].token, c[0].count, c[0].total), (8, 1, 2));
        // An unrelated context (a new request) starts a fresh index.
        let fresh = [9, 9, 5, 1, 2];
        assert!(d.candidates(&fresh, 1).is_empty());
        // Agrees with a brute-force scan on a pseudo-random context.
        let ctx: Vec<u32> = crate::testing::pseudo_random(400, 3)
            .into_iter()
            .map(|x| (x.abs() * 6.0) as u32)
            .collect();
        let mut d = NgramDrafter::with_confidence(2, 2, 0.0).unwrap();
        let c = d.candidates(&ctx, 1);
        let pattern = &ctx[ctx.len() - 2..];
        let followers: Vec<u32> = (0..ctx.len() - 2)
            .filter(|&s| &ctx[s..s + 2] == pattern)
            .map(|s| ctx[s + 2])
            .collect();
        assert_eq!(c.is_empty(), followers.is_empty());
        if let Some(c) = c.first() {
            let count = followers.iter().filter(|&&t| t == c.token).count() as u32;
            assert_eq!((c.count, c.total), (count, followers.len() as u32));
            assert!(followers
                .iter()
                .all(|t| followers.iter().filter(|&u| u == t).count() as u32 <= count));
        }
    }
}
