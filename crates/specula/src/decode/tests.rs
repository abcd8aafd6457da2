//! The decode loop with and without drafters, on tiny random models: greedy speculation is token-for-token plain
//! decoding; sampled speculation has exactly the target's distribution (chi-square test).

use super::*;
use crate::draft::model::ModelDrafter;
use crate::draft::ngram::NgramDrafter;
use crate::draft::Draft;
use crate::model::dtype::GgmlType;
use crate::model::{load_gguf, LoadedModel};
use crate::model::{ForwardOptions, LogitsFor};
use crate::testing::{run_alone_to_end, step_alone, write_tiny_gguf, TinySpec};
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

fn tiny(dir: &std::path::Path, name: &str, spec: TinySpec) -> LoadedModel {
    let p = dir.join(name);
    write_tiny_gguf(&p, &spec).unwrap();
    load_gguf(&p, name).unwrap()
}

fn request(prompt: &[u32], n: usize, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        max_new_tokens: n,
        sampling,
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    }
}

fn run(
    target: &LoadedModel,
    req: &GenerateRequest,
    spec: Option<Speculation<'_>>,
) -> GenerateOutput {
    generate(
        target.model.as_ref(),
        &target.tokenizer,
        req,
        spec,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap()
}

const PROMPT: [u32; 12] = [72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32];

#[test]
fn greedy_speculation_equals_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 3,
            ..Default::default()
        },
    );
    // The same weights in 4 bits: agrees with the target often but not always, so cycles see partial acceptance.
    let close = tiny(
        dir.path(),
        "c.gguf",
        TinySpec {
            seed: 3,
            weight_type: GgmlType::Q4_0,
            ..Default::default()
        },
    );
    let far = tiny(
        dir.path(),
        "f.gguf",
        TinySpec {
            seed: 9,
            ..Default::default()
        },
    );
    let req = request(&PROMPT, 40, SamplingParams::default());
    let plain = run(&target, &req, None);
    assert_eq!(plain.tokens.len(), 40);
    let mut saw_partial = false;
    for k in [1, 2, 3, 5, 8] {
        for draft in [&close, &far] {
            let mut drafter = ModelDrafter::new(draft.model.as_ref(), 0).unwrap();
            let out = run(
                &target,
                &req,
                Some(Speculation {
                    drafter: &mut drafter,
                    draft_tokens: k,
                    simulate_acceptance: None,
                }),
            );
            assert_eq!(
                out.tokens, plain.tokens,
                "model drafter {} k={k}",
                draft.spec
            );
            let st = out.speculation.unwrap();
            assert!(st.accepted <= st.drafted);
            assert_eq!(st.accept_len_histogram.iter().sum::<u64>(), st.cycles);
            saw_partial |= st.accept_len_histogram[1..k].iter().any(|&c| c > 0);
        }
        // Confidence 0 drafts at every match, so the check covers many rejected drafts too.
        for min_confidence in [
            Some(0.0),
            Some(crate::draft::ngram::DEFAULT_MIN_CONFIDENCE),
            None,
        ] {
            let mut ngram = NgramDrafter::with_stopping(1, 3, min_confidence).unwrap();
            let out = run(
                &target,
                &req,
                Some(Speculation {
                    drafter: &mut ngram,
                    draft_tokens: k,
                    simulate_acceptance: None,
                }),
            );
            assert_eq!(out.tokens, plain.tokens, "ngram k={k}");
            let st = out.speculation.unwrap();
            if min_confidence == Some(0.0) {
                assert!(st.drafted > 0, "ngram k={k} drafted nothing");
            }
        }
    }
    assert!(
        saw_partial,
        "no cycle accepted part of its draft; the test would not exercise rollback"
    );
}

/// A draft model that stops at its own uncertain positions (`--draft-confidence`) drafts exactly the tokens whose
/// running product of top-token probabilities (recomputed here with full forward passes) stays above the bar,
/// and decoding with it gives plain decoding's tokens.
#[test]
fn confidence_stopped_draft_model_is_lossless_and_drafts_where_confident() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 3,
            ..Default::default()
        },
    );
    let close = tiny(
        dir.path(),
        "c.gguf",
        TinySpec {
            seed: 3,
            weight_type: GgmlType::Q4_0,
            // Flatter distributions, so the draft's confidence spans a range worth thresholding.
            logit_scale: 0.3,
            ..Default::default()
        },
    );
    let req = request(&PROMPT, 40, SamplingParams::default());
    let plain = run(&target, &req, None);

    // Reference: the draft's greedy chain of 5 after a context, with the running products of its top-token
    // probabilities.
    let last = LogitsFor::Last;
    let mut scratch = Vec::new();
    let mut chain = |ctx: &[u32]| {
        let (mut seq, mut prod, mut out) = (ctx.to_vec(), 1.0f64, Vec::new());
        for _ in 0..5 {
            let mut cache = crate::testing::full_cache(close.model.as_ref());
            let o = crate::testing::forward_host(close.model.as_ref(), &seq, cache.as_mut(), last);
            let (t, p) = crate::sampling::top_probability(o.last(), &mut scratch);
            prod *= p as f64;
            out.push((t, prod));
            seq.push(t);
        }
        out
    };
    let contexts: Vec<Vec<u32>> = (0..24)
        .step_by(3)
        .map(|i| [&PROMPT[..], &plain.tokens[..i]].concat())
        .collect();
    let chains: Vec<_> = contexts.iter().map(|c| chain(c)).collect();
    let mut uncertain: Vec<f64> = chains
        .iter()
        .flatten()
        .map(|&(_, p)| p)
        .filter(|&p| p < 0.99)
        .collect();
    assert!(
        uncertain.len() >= 4,
        "the draft is too sure of itself for this test"
    );
    uncertain.sort_by(f64::total_cmp);
    let bar = uncertain[uncertain.len() / 2];
    let mut checked = 0;
    for (ctx, chain) in contexts.iter().zip(&chains) {
        if chain.iter().any(|&(_, p)| (p - bar).abs() < 1e-3) {
            continue; // too close to call between incremental and full forward passes
        }
        let expected: Vec<u32> = chain
            .iter()
            .take_while(|&&(_, p)| p >= bar)
            .map(|&(t, _)| t)
            .collect();
        let mut drafter = ModelDrafter::new(close.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(bar)
            .unwrap();
        let draft = drafter.propose(ctx, 5, &SamplingParams::default()).unwrap();
        assert_eq!(draft.tokens, expected, "confidence {bar}");
        // The feed, then one pass after each kept token but the fifth: a stop still paid its pass.
        assert_eq!(draft.passes, 1 + expected.len().min(4), "confidence {bar}");
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} contexts checked");

    let mut drafted = Vec::new();
    for c in [0.0, bar, 1.0] {
        let mut drafter = ModelDrafter::new(close.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(c)
            .unwrap();
        let out = run(
            &target,
            &req,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: 5,
                simulate_acceptance: None,
            }),
        );
        assert_eq!(out.tokens, plain.tokens, "confidence {c}");
        let st = out.speculation.unwrap();
        assert_eq!(st.accept_len_histogram.iter().sum::<u64>(), st.cycles);
        drafted.push(st.drafted);
    }
    assert!(
        drafted[0] > drafted[1] && drafted[1] > drafted[2],
        "drafted tokens by confidence: {drafted:?}"
    );
    for bad in [-0.1, 1.5, f64::NAN] {
        let err = ModelDrafter::new(close.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(bad)
            .err()
            .expect("out-of-range confidence accepted");
        assert!(err.to_string().contains("--draft-confidence"), "{err}");
    }
}

/// A draft model restricted to a prefix of the vocabulary (`--draft-vocab`) stays lossless. The target drafts for
/// itself: with the limit just above its greedy tokens every draft can be right, with the limit at the largest
/// greedy token the drafts that need it are necessarily wrong.
#[test]
fn vocab_limited_draft_model_is_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path(), "t.gguf", TinySpec::default());
    let req = request(&PROMPT, 30, SamplingParams::default());
    let plain = run(&target, &req, None);
    let top = *plain.tokens.iter().max().unwrap() as usize;
    for (limit, all_reachable) in [(top + 1, true), (top, false)] {
        for k in [1, 3] {
            let mut limited = ModelDrafter::new(target.model.as_ref(), 0)
                .unwrap()
                .with_vocab_limit(Some(limit))
                .unwrap();
            let out = run(
                &target,
                &req,
                Some(Speculation {
                    drafter: &mut limited,
                    draft_tokens: k,
                    simulate_acceptance: None,
                }),
            );
            assert_eq!(out.tokens, plain.tokens, "limit {limit} k={k}");
            let st = out.speculation.unwrap();
            if all_reachable {
                assert_eq!(
                    st.accepted, st.drafted,
                    "self-drafting within reach is always right"
                );
            } else {
                assert!(
                    st.accepted < st.drafted,
                    "token {top} cannot be drafted below {limit}"
                );
            }
        }
    }
    let vocab = target.model.config().vocab_size;
    for bad in [0, vocab + 1] {
        let err = ModelDrafter::new(target.model.as_ref(), 0)
            .unwrap()
            .with_vocab_limit(Some(bad))
            .err()
            .expect("refused");
        assert!(err.to_string().contains("--draft-vocab"), "{err}");
    }
}

#[test]
fn a_draft_model_feeds_a_long_catch_up_in_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path(), "t.gguf", TinySpec::default());
    let greedy = SamplingParams::default();
    let mut whole = ModelDrafter::new(target.model.as_ref(), 0).unwrap();
    let expected = whole.propose(&PROMPT, 2, &greedy).unwrap();
    assert_eq!(expected.tokens.len(), 2);
    let mut pieces = ModelDrafter::new(target.model.as_ref(), 0)
        .unwrap()
        .with_catch_up_piece(Some(4))
        .unwrap();
    // 12 prompt tokens: two cycles feed 4 each and draft nothing, the third feeds the last 4 and drafts.
    for lag_after in [8, 4] {
        let d = pieces.propose(&PROMPT, 2, &greedy).unwrap();
        assert!(d.catching_up && d.tokens.is_empty(), "{d:?}");
        assert_eq!(pieces.lag(&PROMPT), lag_after);
    }
    let d = pieces.propose(&PROMPT, 2, &greedy).unwrap();
    assert!(!d.catching_up);
    assert_eq!(d.tokens, expected.tokens);

    // Decoding with it is lossless, and the pieces are counted as catch-up cycles.
    let req = request(&PROMPT, 24, greedy);
    let plain = run(&target, &req, None);
    let mut drafter = ModelDrafter::new(target.model.as_ref(), 0)
        .unwrap()
        .with_catch_up_piece(Some(4))
        .unwrap();
    let out = run(
        &target,
        &req,
        Some(Speculation {
            drafter: &mut drafter,
            draft_tokens: 2,
            simulate_acceptance: None,
        }),
    );
    assert_eq!(out.tokens, plain.tokens);
    assert!(out.speculation.unwrap().catch_up_cycles >= 2);
    assert!(ModelDrafter::new(target.model.as_ref(), 0)
        .unwrap()
        .with_catch_up_piece(Some(0))
        .is_err());
}

#[test]
fn rollback_after_partial_acceptance_leaves_the_cache_where_plain_decoding_is() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path(), "t.gguf", TinySpec::default());
    let all = LogitsFor::All;
    // Plain: prompt, then tokens a, b one at a time, then the logits after c.
    let mut plain = crate::testing::full_cache(m.model.as_ref());
    crate::testing::forward_host(m.model.as_ref(), &PROMPT, plain.as_mut(), all);
    crate::testing::forward_host(m.model.as_ref(), &[5], plain.as_mut(), all);
    crate::testing::forward_host(m.model.as_ref(), &[6], plain.as_mut(), all);
    let expected = crate::testing::forward_host(m.model.as_ref(), &[7], plain.as_mut(), all);
    // Speculative: pending 5 with drafts [6, 99, 98]; only 6 accepted -> keep prompt + 5 + 6.
    let mut spec = crate::testing::full_cache(m.model.as_ref());
    crate::testing::forward_host(m.model.as_ref(), &PROMPT, spec.as_mut(), all);
    let base = spec.len();
    crate::testing::forward_host(m.model.as_ref(), &[5, 6, 99, 98], spec.as_mut(), all);
    spec.truncate(base + 2);
    let got = crate::testing::forward_host(m.model.as_ref(), &[7], spec.as_mut(), all);
    assert_eq!(got.logits, expected.logits);
}

/// Regularized upper chi-square quantile via Wilson-Hilferty (accurate to a few percent for df >= 3).
fn chi2_critical(df: usize, z: f64) -> f64 {
    let d = df as f64;
    let t = 1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt();
    d * t * t * t
}

#[test]
fn sampled_speculation_has_the_targets_distribution() {
    check_sampled_distribution(SampledCase::top_k3(SampledDrafter::FixedQ {
        stop_after: None,
    }));
}

/// The same when the draft length depends on the tokens drafted so far (as with `--draft-confidence`): the
/// drafter ends its draft after proposing token 200.
#[test]
fn sampled_speculation_with_draft_dependent_lengths_has_the_targets_distribution() {
    check_sampled_distribution(SampledCase::top_k3(SampledDrafter::FixedQ {
        stop_after: Some(200),
    }));
}

/// And with a draft model that stops at its own uncertain positions (`--draft-confidence`).
#[test]
fn sampled_speculation_with_a_confidence_stopped_draft_model_has_the_targets_distribution() {
    check_sampled_distribution(SampledCase::top_k3(SampledDrafter::Model {
        min_confidence: 0.3,
    }));
}

/// The default sampling settings: the whole vocabulary (no top-k, no top-p), at temperature 1, with a draft
/// model whose q also spans the whole vocabulary.
#[test]
fn sampled_speculation_over_the_full_vocabulary_has_the_targets_distribution() {
    check_sampled_distribution(SampledCase::full_vocabulary(SampledDrafter::Model {
        min_confidence: 0.0,
    }));
    check_sampled_distribution(SampledCase::full_vocabulary(SampledDrafter::FixedQ {
        stop_after: None,
    }));
}

/// Nucleus sampling (top-p 0.8): the target's distribution is truncated and renormalized before verification.
#[test]
fn sampled_speculation_with_top_p_has_the_targets_distribution() {
    let mut case = SampledCase::full_vocabulary(SampledDrafter::FixedQ { stop_after: None });
    case.params.top_p = 0.8;
    check_sampled_distribution(case);
}

/// min-p (0.05): the target's distribution loses its tail below 5% of its top token before verification.
#[test]
fn sampled_speculation_with_min_p_has_the_targets_distribution() {
    let mut case = SampledCase::full_vocabulary(SampledDrafter::FixedQ { stop_after: None });
    case.params.min_p = 0.05;
    check_sampled_distribution(case);
}

/// Prompt lookup under sampling: q is a point mass on the looked-up token, so a draft is accepted with
/// probability p(x) and a rejection draws from p without x.
#[test]
fn sampled_prompt_lookup_has_the_targets_distribution() {
    check_sampled_distribution(SampledCase::full_vocabulary(SampledDrafter::PromptLookup));
}

/// Penalties and a logit bias under sampling: verification reads the adjusted rows (each row's draft prefix
/// counted as output), so the output has the adjusted distribution, as a chain and as a tree.
#[test]
fn sampled_speculation_with_penalties_has_the_adjusted_distribution() {
    let adjust = crate::sampling::LogitAdjustments {
        presence_penalty: 0.6,
        frequency_penalty: 0.4,
        repetition_penalty: 1.4,
        logit_bias: vec![(PROMPT[0], 1.5)],
        ..Default::default()
    };
    for drafter in [
        SampledDrafter::FixedQ { stop_after: None },
        SampledDrafter::Tree,
    ] {
        let mut case = SampledCase::top_k3(drafter);
        case.adjust = Some(adjust.clone());
        check_sampled_distribution(case);
    }
}

/// Tree drafts under sampling (`verify::accept_tree_sampled`): a fixed tree of three first tokens (two likely,
/// one the target never proposes first) with two children under the first.
#[test]
fn sampled_tree_speculation_has_the_targets_distribution() {
    check_sampled_distribution(SampledCase::top_k3(SampledDrafter::Tree));
    check_sampled_distribution(SampledCase::full_vocabulary(SampledDrafter::Tree));
}

enum SampledDrafter {
    /// A fixed tree over the target's likeliest first tokens (deterministic, like EAGLE's top-k tree).
    Tree,
    /// Draws from a fixed uniform q over the target's likeliest first tokens and two tokens outside them.
    FixedQ {
        stop_after: Option<u32>,
    },
    Model {
        min_confidence: f64,
    },
    /// The n-gram drafter (deterministic: q is a point mass).
    PromptLookup,
}

struct SampledCase {
    drafter: SampledDrafter,
    params: SamplingParams,
    /// Penalties and bias on the target's logits (the distribution to match is then the adjusted one).
    adjust: Option<crate::sampling::LogitAdjustments>,
    /// Multiplies the target's final norm: below 1 flattens its distributions (the tail matters).
    target_logit_scale: f32,
}

impl SampledCase {
    fn top_k3(drafter: SampledDrafter) -> Self {
        SampledCase {
            drafter,
            params: SamplingParams {
                temperature: 5.0,
                top_k: 3,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
            },
            adjust: None,
            target_logit_scale: 1.0,
        }
    }

    fn full_vocabulary(drafter: SampledDrafter) -> Self {
        SampledCase {
            drafter,
            params: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
            },
            adjust: None,
            target_logit_scale: 0.15,
        }
    }
}

/// Cells of the exact joint distribution of the first three generated tokens: a full three-token sequence, or a
/// shorter prefix standing for all its continuations when its probability is too small to expand (the cells
/// partition the sequence space, so an observed sequence falls in exactly one).
fn joint_cells(
    dist_after: &mut dyn FnMut(&[u32]) -> crate::sampling::Distribution,
    prompt: &[u32],
    min_expected: f64,
) -> Vec<(Vec<u32>, f64)> {
    let mut cells = Vec::new();
    let mut stack: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 1.0)];
    while let Some((prefix, p)) = stack.pop() {
        if prefix.len() == 3 || (!prefix.is_empty() && p < min_expected) {
            cells.push((prefix, p));
            continue;
        }
        let d = dist_after(&[prompt, &prefix[..]].concat());
        for (&t, &pt) in d.ids.iter().zip(&d.probs) {
            stack.push(([&prefix[..], &[t]].concat(), p * pt as f64));
        }
    }
    cells
}

/// Runs 6000 seeded speculative generations and compares the first three tokens with the target's exact joint
/// distribution (chi-square, significance 0.001).
///
/// Checked to fail (2026-12-01): drawing a rejection's replacement from p instead of normalize(max(0, p - q))
/// fails all six tests (chi-square 217-1202 against critical 33-195); accepting with probability p(x) instead of
/// p(x)/q(x) fails the four with a spread-out q (prompt lookup's point mass makes them the same rule); verifying
/// against the untruncated p when sampling with top-p fails the top-p test.
fn check_sampled_distribution(case: SampledCase) {
    let dir = tempfile::tempdir().unwrap();
    let draft = tiny(
        dir.path(),
        "d.gguf",
        TinySpec {
            seed: 11,
            logit_scale: 0.3,
            ..Default::default()
        },
    );
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 5,
            logit_scale: case.target_logit_scale,
            ..Default::default()
        },
    );
    let params = case.params;
    let last = LogitsFor::Last;
    let base = &PROMPT[..6];
    assert!(
        case.adjust.is_none() || !matches!(case.drafter, SampledDrafter::PromptLookup),
        "adjusted cases take the base prompt"
    );
    let adjust = case.adjust.clone();
    // Whether min-p (where set) left out any token of a distribution checked here, so the case tests a cut.
    let min_p_cut = std::cell::Cell::new(false);
    let mut dist_after = |ctx: &[u32]| {
        let mut cache = crate::testing::full_cache(target.model.as_ref());
        let out = crate::testing::forward_host(target.model.as_ref(), ctx, cache.as_mut(), last);
        let mut row = out.last().to_vec();
        if let Some(a) = &adjust {
            // The prompt is the base; what follows it is output.
            let mut prompt = base.to_vec();
            prompt.sort_unstable();
            prompt.dedup();
            let mut counts = std::collections::HashMap::new();
            for &t in &ctx[base.len()..] {
                *counts.entry(t).or_insert(0u32) += 1;
            }
            a.apply(&mut row, &prompt, &counts);
        }
        let d = crate::sampling::distribution(&row, &params);
        let uncut = SamplingParams {
            min_p: 0.0,
            ..params
        };
        if d.ids.len() < crate::sampling::distribution(&row, &uncut).ids.len() {
            min_p_cut.set(true);
        }
        d
    };
    // Prompt lookup needs the context to repeat: the base prompt, the target's likeliest continuation, and the
    // base again, so the lookup proposes that continuation (which the target often, not always, accepts).
    let prompt: Vec<u32> = match case.drafter {
        SampledDrafter::PromptLookup => {
            let mut ctx = base.to_vec();
            for _ in 0..4 {
                let d = dist_after(&ctx);
                let best = d
                    .ids
                    .iter()
                    .zip(&d.probs)
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(&t, _)| t)
                    .unwrap();
                ctx.push(best);
            }
            [&ctx[..], base].concat()
        }
        _ => base.to_vec(),
    };
    let runs = 6000;
    // Exact joint distribution of the first three tokens; a prefix expected fewer than 5 times is not expanded
    // (its continuations would all be pooled below anyway).
    let exact = joint_cells(&mut dist_after, &prompt, 5.0 / runs as f64);
    let total: f64 = exact.iter().map(|c| c.1).sum();
    assert!((total - 1.0).abs() < 1e-3, "cells hold mass {total}");
    // q for the fixed-q drafter: uniform over the target's four likeliest first tokens and two it never
    // proposes first, so drafts are often rejected and the residual distribution is exercised.
    let d1 = dist_after(&prompt);
    let mut by_prob: Vec<(u32, f32)> = d1
        .ids
        .iter()
        .copied()
        .zip(d1.probs.iter().copied())
        .collect();
    by_prob.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut q_support: Vec<u32> = by_prob.iter().take(4).map(|&(t, _)| t).collect();
    let vocab = target.model.config().vocab_size as u32;
    let outside: Vec<u32> = (0..vocab)
        .rev()
        .filter(|t| !q_support.contains(t) && d1.prob_of(*t) < 1e-4)
        .take(2)
        .collect();
    q_support.extend(outside);
    let cell_index: std::collections::HashMap<&[u32], usize> = exact
        .iter()
        .enumerate()
        .map(|(i, (cell, _))| (cell.as_slice(), i))
        .collect();
    let mut counts = vec![0usize; exact.len()];
    let (mut rejections, mut accepted_total, mut drafted_total, mut cycles_total) = (0, 0, 0, 0);
    for seed in 0..runs {
        let mut req = request(&prompt, 5, SamplingParams { seed, ..params });
        req.logit_adjustments = case.adjust.clone();
        let mut drafter: Box<dyn Drafter> = match case.drafter {
            SampledDrafter::FixedQ { stop_after } => Box::new(FixedQDrafter {
                support: q_support.clone(),
                rng: ChaCha20Rng::seed_from_u64(seed + 77),
                stop_after,
            }),
            SampledDrafter::Model { min_confidence } => Box::new(
                ModelDrafter::new(draft.model.as_ref(), seed)
                    .unwrap()
                    .with_min_confidence(min_confidence)
                    .unwrap(),
            ),
            SampledDrafter::PromptLookup => {
                Box::new(NgramDrafter::with_stopping(1, 4, Some(0.0)).unwrap())
            }
            SampledDrafter::Tree => Box::new(TreeDrafter {
                // q_support ends with tokens the target never proposes first.
                tokens: vec![
                    q_support[0],
                    q_support[q_support.len() - 1],
                    q_support[1],
                    q_support[1],
                    q_support[0],
                ],
                parents: vec![None, None, None, Some(0), Some(0)],
            }),
        };
        let draft_tokens = match case.drafter {
            SampledDrafter::Tree => 5,
            _ => 2,
        };
        let out = run(
            &target,
            &req,
            Some(Speculation {
                drafter: drafter.as_mut(),
                draft_tokens,
                simulate_acceptance: None,
            }),
        );
        let st = out.speculation.unwrap();
        rejections += st.drafted - st.accepted;
        accepted_total += st.accepted;
        drafted_total += st.drafted;
        cycles_total += st.cycles;
        let idx = (1..=3)
            .find_map(|n| cell_index.get(&out.tokens[..n]).copied())
            .expect("sequence outside the target's support");
        counts[idx] += 1;
    }
    if let SampledDrafter::Model { min_confidence } = case.drafter {
        if min_confidence > 0.0 {
            // Some drafts stopped early and some did not: the draft length really varied.
            assert!(
                drafted_total < 2 * cycles_total && drafted_total > cycles_total,
                "drafted {drafted_total} tokens in {cycles_total} cycles of k = 2"
            );
        }
    }
    // Both branches of the acceptance test ran many times: a draft kept, and a rejection that draws from the
    // residual.
    assert!(
        rejections > runs / 4,
        "too few rejections ({rejections}) to test the residual path"
    );
    assert!(
        accepted_total > runs / 10,
        "too few acceptances ({accepted_total} of {drafted_total} drafted) to test the accept path"
    );
    // Chi-square over cells, pooling cells with small expected counts.
    let (mut chi2, mut df, mut pool_obs, mut pool_exp) = (0.0, 0usize, 0.0, 0.0);
    for ((_, p), &c) in exact.iter().zip(&counts) {
        let e = p * runs as f64;
        if e < 5.0 {
            pool_obs += c as f64;
            pool_exp += e;
        } else {
            chi2 += (c as f64 - e).powi(2) / e;
            df += 1;
        }
    }
    if pool_exp > 0.0 {
        chi2 += (pool_obs - pool_exp).powi(2) / pool_exp;
        df += 1;
    }
    assert!(df >= 8, "only {df} cells: the test could not see a bias");
    eprintln!(
        "chi-square {chi2:.1} over {df} cells ({} exact cells); {accepted_total} of {drafted_total} drafts accepted",
        exact.len()
    );
    assert!(
        params.min_p == 0.0 || min_p_cut.get(),
        "min_p {} left out no token: the case does not test it",
        params.min_p
    );
    let df = df - 1;
    // z = 3.09: significance 0.001, so an exact sampler fails one run in a thousand.
    let critical = chi2_critical(df, 3.09);
    assert!(
        chi2 < critical,
        "chi-square {chi2:.1} >= {critical:.1} (df {df}): speculative sampling is biased \
         ({accepted_total} of {drafted_total} drafts accepted)"
    );
}

/// Proposes tokens drawn from a fixed uniform q, whatever the context; ends the draft after proposing
/// `stop_after`. (Stopping *at* a draw, discarding it, would make the proposals follow q conditioned on not being
/// that token, and verifying them against q would be biased.)
struct FixedQDrafter {
    support: Vec<u32>,
    rng: ChaCha20Rng,
    stop_after: Option<u32>,
}

impl Drafter for FixedQDrafter {
    fn method(&self) -> &'static str {
        "fixed-q"
    }
    fn propose(&mut self, _context: &[u32], k: usize, _s: &SamplingParams) -> Result<Draft> {
        let q = crate::sampling::Distribution {
            ids: self.support.clone(),
            probs: vec![1.0 / self.support.len() as f32; self.support.len()],
        };
        let mut tokens = Vec::new();
        for _ in 0..k {
            let t = crate::sampling::draw(&q, &mut self.rng);
            tokens.push(t);
            if Some(t) == self.stop_after {
                break;
            }
        }
        let n = tokens.len();
        Ok(Draft {
            tokens,
            distributions: Some(vec![q; n]),
            parents: None,
            passes: 0,
            catching_up: false,
        })
    }
}

/// Proposes the same tree whatever the context (the decode loop truncates it to k nodes).
struct TreeDrafter {
    tokens: Vec<u32>,
    parents: Vec<Option<usize>>,
}

impl Drafter for TreeDrafter {
    fn method(&self) -> &'static str {
        "fixed-tree"
    }
    fn propose(&mut self, _context: &[u32], _k: usize, _s: &SamplingParams) -> Result<Draft> {
        Ok(Draft {
            tokens: self.tokens.clone(),
            distributions: None,
            parents: Some(self.parents.clone()),
            passes: 0,
            catching_up: false,
        })
    }
}

#[test]
fn bad_draft_lengths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path(), "t.gguf", TinySpec::default());
    let req = request(&PROMPT, 4, SamplingParams::default());
    for k in [0, MAX_DRAFT_TOKENS + 1] {
        let mut ngram = NgramDrafter::new(1, 3).unwrap();
        let err = generate(
            target.model.as_ref(),
            &target.tokenizer,
            &req,
            Some(Speculation {
                drafter: &mut ngram,
                draft_tokens: k,
                simulate_acceptance: None,
            }),
            &Profiler::disabled(),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("--draft-tokens"), "{err}");
    }
}

/// `simulate_acceptance` replaces verification in the loop: with p = 1 every drafted token is kept (a far draft
/// model's tokens included) and each cycle commits k + 1 tokens; with p = 0 none is, and the output is plain
/// decoding's.
#[test]
fn simulated_acceptance_replaces_verification() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 3,
            ..Default::default()
        },
    );
    let far = tiny(
        dir.path(),
        "f.gguf",
        TinySpec {
            seed: 9,
            ..Default::default()
        },
    );
    let req = request(&PROMPT, 30, SamplingParams::default());
    let plain = run(&target, &req, None);
    for (p, k) in [(1.0, 4), (0.0, 4)] {
        let mut drafter = ModelDrafter::new(far.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(0.0)
            .unwrap();
        let out = run(
            &target,
            &req,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: k,
                simulate_acceptance: Some(p),
            }),
        );
        let st = out.speculation.unwrap();
        assert!(st.drafted > 0);
        if p == 1.0 {
            assert_eq!(st.accepted, st.drafted, "p = 1 keeps every draft token");
            // k + 1 tokens a cycle: 29 decode tokens in at most 6 cycles (plain decoding needs 29 steps).
            assert!(st.cycles <= 6, "{} cycles", st.cycles);
        } else {
            assert_eq!(st.accepted, 0);
            assert_eq!(out.tokens, plain.tokens, "p = 0 is plain decoding");
        }
    }
}

/// Knows plain decoding's continuation and drafts a tree in which it is never the first branch: a wrong token,
/// then the right one with a wrong and a right child, and so on. The accepted path is never a prefix of the
/// draft, so verification must walk the tree and the cache must keep the path's rows, moved into place.
struct OracleTreeDrafter {
    /// Prompt and plain decoding's tokens.
    plain: Vec<u32>,
    vocab: u32,
}

impl Drafter for OracleTreeDrafter {
    fn method(&self) -> &'static str {
        "oracle-tree"
    }

    fn propose(&mut self, context: &[u32], k: usize, _: &SamplingParams) -> Result<Draft> {
        let future = &self.plain[context.len().min(self.plain.len())..];
        let depth = future.len().min(k / 2).min(3);
        let mut tokens = Vec::new();
        let mut parents = Vec::new();
        let mut parent = None;
        for &right in &future[..depth] {
            tokens.push((right + 1) % self.vocab);
            parents.push(parent);
            tokens.push(right);
            parents.push(parent);
            parent = Some(tokens.len() - 1);
        }
        Ok(Draft {
            tokens,
            distributions: None,
            parents: Some(parents),
            passes: 0,
            catching_up: false,
        })
    }
}

#[test]
fn tree_verification_keeps_a_path_that_is_not_a_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 3,
            untied_head: true,
            ..Default::default()
        },
    );
    let req = request(&PROMPT, 30, SamplingParams::default());
    let plain = run(&target, &req, None);
    let distinct: std::collections::BTreeSet<u32> = plain.tokens.iter().copied().collect();
    assert!(
        distinct.len() > 5,
        "the target writes varied text: {:?}",
        plain.tokens
    );
    let mut seq = PROMPT.to_vec();
    seq.extend(&plain.tokens);
    let mut drafter = OracleTreeDrafter {
        plain: seq,
        vocab: target.model.config().vocab_size as u32,
    };
    let out = run(
        &target,
        &req,
        Some(Speculation {
            drafter: &mut drafter,
            draft_tokens: 6,
            simulate_acceptance: None,
        }),
    );
    assert_eq!(out.tokens, plain.tokens);
    let st = out.speculation.unwrap();
    // Every right token is accepted and no wrong one: half of each tree, through its second branches.
    assert_eq!(st.accepted * 2, st.drafted, "{st:?}");
    assert!(st.accept_len_histogram[3] >= 6, "{st:?}");
    assert!(st.cycles <= 9, "{} cycles for 29 tokens", st.cycles);
}

#[test]
fn tree_acceptance_walks_the_argmax_path() {
    use crate::model::forward::HostRows;
    // Rows: 0 = pending, then drafts 0..4 with parents [None, None, Some(1), Some(1), Some(3)].
    let argmax = [11u32, 5, 12, 7, 13, 9];
    let mut data = vec![0f32; 6 * 16];
    for (r, &a) in argmax.iter().enumerate() {
        data[r * 16 + a as usize] = 1.0;
    }
    let logits = HostRows {
        rows: 6,
        cols: 16,
        data,
    };
    let tokens = [10, 11, 3, 12, 13];
    let parents = [None, None, Some(1), Some(1), Some(3)];
    let (a, path) = crate::verify::accept_tree(&tokens, &parents, &logits).unwrap();
    // pending -> 11 (draft 1, row 2) -> 12 (draft 3, row 4) -> 13 (draft 4, row 5) -> next = argmax of row 5.
    assert_eq!(path, vec![1, 3, 4]);
    assert_eq!(a.accepted, 3);
    assert_eq!(a.next, 9);
    // A mismatch at the root accepts nothing and takes the target's token.
    let (a, path) = crate::verify::accept_tree(&[1, 2], &[None, None], &logits).unwrap();
    assert!(path.is_empty());
    assert_eq!(a.next, 11);
}

/// How a batching test case drafts.
#[derive(Clone, Copy, Debug)]
enum CaseDrafter {
    Plain,
    Ngram(usize),
    Model(usize),
    Tree,
}

fn case_drafter<'a>(
    kind: CaseDrafter,
    draft: &'a LoadedModel,
    seed: u64,
) -> Option<(Box<dyn Drafter + 'a>, usize)> {
    match kind {
        CaseDrafter::Plain => None,
        CaseDrafter::Ngram(k) => Some((
            Box::new(NgramDrafter::with_stopping(1, 3, Some(0.0)).unwrap()),
            k,
        )),
        CaseDrafter::Model(k) => Some((
            Box::new(ModelDrafter::new(draft.model.as_ref(), seed).unwrap()),
            k,
        )),
        CaseDrafter::Tree => Some((
            Box::new(TreeDrafter {
                tokens: vec![108, 111, 32, 72, 101],
                parents: vec![None, Some(0), None, Some(1), Some(2)],
            }),
            5,
        )),
    }
}

/// Steps `cases` as a continuously batched engine would: case i joins at step `2 * i`, every live generation
/// advances one step per forward pass (prompts in chunks of `prefill_tokens`), and each leaves when done. Returns
/// each case's output and the text it streamed.
fn run_batched<'a>(
    target: &LoadedModel,
    draft: &'a LoadedModel,
    cases: &[(GenerateRequest, CaseDrafter)],
    prefill_tokens: usize,
) -> Vec<(GenerateOutput, String)> {
    let mut results: Vec<Option<(GenerateOutput, String)>> = cases.iter().map(|_| None).collect();
    let mut active: Vec<(usize, Generation<'a>, String)> = Vec::new();
    let mut next = 0;
    let mut step_no = 0;
    let prof = Profiler::new(crate::profile::Detail::Phases);
    while next < cases.len() || !active.is_empty() {
        while next < cases.len() && next * 2 <= step_no {
            let (req, kind) = &cases[next];
            let g = match case_drafter(*kind, draft, req.sampling.seed) {
                Some((d, k)) => {
                    Generation::with_drafter(target.model.as_ref(), req.clone(), d, k).unwrap()
                }
                None => Generation::new(target.model.as_ref(), req.clone()).unwrap(),
            };
            active.push((next, g, String::new()));
            next += 1;
        }
        let mut texts: Vec<(usize, String)> = Vec::new();
        {
            let mut refs: Vec<&mut Generation<'a>> = active.iter_mut().map(|(_, g, _)| g).collect();
            let (res, report) = step(
                target.model.as_ref(),
                &target.tokenizer,
                &mut refs,
                StepLimits {
                    prefill_tokens,
                    ..Default::default()
                },
                &prof,
                &mut |i, t| texts.push((i, t.to_string())),
            );
            for r in res {
                r.unwrap();
            }
            assert!(report.rows >= report.prefill_rows);
            assert!(
                report.prefill_rows <= prefill_tokens,
                "{} prompt rows in one step, budget {prefill_tokens}",
                report.prefill_rows
            );
        }
        for (i, t) in texts {
            active[i].2.push_str(&t);
        }
        let mut still = Vec::new();
        for (id, g, mut text) in active.drain(..) {
            if g.is_done() {
                let out = g
                    .finish(&target.tokenizer, &mut |t| text.push_str(t))
                    .unwrap();
                results[id] = Some((out, text));
            } else {
                still.push((id, g, text));
            }
        }
        active = still;
        step_no += 1;
        assert!(step_no < 10_000, "batched generation does not end");
    }
    results.into_iter().map(|r| r.unwrap()).collect()
}

/// Continuous batching is invisible in the output: generations with different prompts, lengths, sampling and
/// drafters (none, prompt lookup, a draft model, a tree), joining at different steps and prefilled in chunks
/// alongside running ones, produce exactly the tokens and text each produces alone.
#[test]
fn batched_generations_equal_each_alone() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 3,
            untied_head: true,
            ..Default::default()
        },
    );
    let close = tiny(
        dir.path(),
        "c.gguf",
        TinySpec {
            seed: 3,
            untied_head: true,
            // The same model with flatter distributions: greedy drafts are all accepted, sampled ones partly.
            logit_scale: 0.7,
            ..Default::default()
        },
    );
    let long: Vec<u32> = (0..37).map(|i| 65 + (i * 7 % 50) as u32).collect();
    let sampled = |seed| SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.0,
        seed,
    };
    let cases = vec![
        (
            request(&PROMPT, 30, SamplingParams::default()),
            CaseDrafter::Plain,
        ),
        (
            request(&long, 25, SamplingParams::default()),
            CaseDrafter::Model(3),
        ),
        (request(&PROMPT[..5], 20, sampled(7)), CaseDrafter::Plain),
        (
            request(&PROMPT, 33, SamplingParams::default()),
            CaseDrafter::Ngram(4),
        ),
        (request(&long[..20], 18, sampled(11)), CaseDrafter::Model(2)),
        (
            request(&PROMPT, 15, SamplingParams::default()),
            CaseDrafter::Tree,
        ),
        (request(&[72], 12, sampled(5)), CaseDrafter::Ngram(2)),
    ];
    let alone: Vec<GenerateOutput> = cases
        .iter()
        .map(
            |(req, kind)| match case_drafter(*kind, &close, req.sampling.seed) {
                Some((mut d, k)) => run(
                    &target,
                    req,
                    Some(Speculation {
                        drafter: d.as_mut(),
                        draft_tokens: k,
                        simulate_acceptance: None,
                    }),
                ),
                None => run(&target, req, None),
            },
        )
        .collect();
    for prefill_tokens in [usize::MAX, 16, 5] {
        let batched = run_batched(&target, &close, &cases, prefill_tokens);
        for (i, ((out, streamed), want)) in batched.iter().zip(&alone).enumerate() {
            let what = format!(
                "case {i} ({:?}), prefill chunk {prefill_tokens}",
                cases[i].1
            );
            assert_eq!(out.tokens, want.tokens, "{what}");
            assert_eq!(out.text, want.text, "{what}");
            assert_eq!(streamed, &want.text, "{what}: streamed text");
            assert_eq!(out.stop_reason, want.stop_reason, "{what}");
            assert_eq!(
                out.speculation.as_ref().map(|s| (s.drafted, s.accepted)),
                want.speculation.as_ref().map(|s| (s.drafted, s.accepted)),
                "{what}: speculation"
            );
        }
    }
}

/// Proposes a token outside the vocabulary after `after` proposals (a broken drafter).
struct BrokenDrafter {
    after: usize,
    calls: usize,
}

impl Drafter for BrokenDrafter {
    fn method(&self) -> &'static str {
        "broken"
    }
    fn propose(&mut self, _context: &[u32], _k: usize, _s: &SamplingParams) -> Result<Draft> {
        self.calls += 1;
        if self.calls > self.after {
            return Ok(Draft {
                tokens: vec![u32::MAX],
                distributions: None,
                parents: None,
                passes: 0,
                catching_up: false,
            });
        }
        Ok(Draft::default())
    }
}

/// One generation's failure (a drafter proposing a token outside the vocabulary) or cancellation fails or stops
/// only that generation; the others in its batch go on and produce what they produce alone.
#[test]
fn one_failing_or_cancelled_generation_leaves_its_batch_alone() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            untied_head: true,
            ..Default::default()
        },
    );
    let plain = request(&PROMPT, 24, SamplingParams::default());
    let want = run(&target, &plain, None);
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut cancelled_req = request(&PROMPT[..4], 24, SamplingParams::default());
    cancelled_req.cancel = Some(cancel.clone());
    let model = target.model.as_ref();
    let mut good = Generation::new(model, plain.clone()).unwrap();
    let mut broken = Generation::with_drafter(
        model,
        plain.clone(),
        Box::new(BrokenDrafter { after: 3, calls: 0 }),
        2,
    )
    .unwrap();
    let mut stopped = Generation::new(model, cancelled_req).unwrap();
    let prof = Profiler::disabled();
    let mut broken_error = None;
    let mut steps = 0;
    while !good.is_done() {
        steps += 1;
        if steps == 6 {
            cancel.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let mut batch: Vec<&mut Generation<'_>> = vec![&mut good, &mut stopped];
        if broken_error.is_none() {
            batch.push(&mut broken);
        }
        let (res, _) = step(
            model,
            &target.tokenizer,
            &mut batch,
            StepLimits::default(),
            &prof,
            &mut |_, _| {},
        );
        let mut res = res.into_iter();
        res.next().unwrap().unwrap();
        res.next().unwrap().unwrap();
        if let Some(Err(e)) = res.next() {
            broken_error = Some(e.to_string());
        }
    }
    let err = broken_error.expect("the broken drafter's generation failed");
    assert!(err.contains("outside the vocabulary"), "{err}");
    assert!(stopped.is_done());
    let stopped = stopped.finish(&target.tokenizer, &mut |_| {}).unwrap();
    assert_eq!(stopped.stop_reason, StopReason::Cancelled);
    assert_eq!(stopped.tokens.len(), 5, "cancelled before its 6th step");
    let good = good.finish(&target.tokenizer, &mut |_| {}).unwrap();
    assert_eq!(good.tokens, want.tokens);
}

#[test]
fn a_prefix_cache_hit_skips_the_cached_prefill_and_changes_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 3,
            ..Default::default()
        },
    );
    let model = target.model.as_ref();
    let prompt: Vec<u32> = PROMPT.iter().chain(&PROMPT).copied().collect();
    let first = Generation::new(model, request(&prompt, 20, SamplingParams::default())).unwrap();
    let (out, prefix) = run_alone_to_end(&target, first);
    let prefix = prefix.expect("a finished generation leaves its cache");
    // Every position but the last token's, which was generated and never fed back.
    assert_eq!(prefix.tokens.len(), prompt.len() + 19);
    assert_eq!(prefix.tokens[..prompt.len()], prompt[..]);
    let mut cache = PrefixCache::new();
    cache.insert(prefix, 1000);
    assert_eq!((cache.len(), cache.bytes()), (1, 1000));

    // The conversation's next turn: its prompt holds the first turn whole, then more.
    let mut next: Vec<u32> = prompt.iter().chain(&out.tokens).copied().collect();
    next.extend_from_slice(&[32, 72, 101, 108]);
    // The same prompt again: all but its last token (whose pass gives the first token's logits).
    for (p, reused) in [(&next, prompt.len() + 19), (&prompt, prompt.len() - 1)] {
        let fresh = run(&target, &request(p, 16, SamplingParams::default()), None);
        let mut g = Generation::new(model, request(p, 16, SamplingParams::default())).unwrap();
        assert_eq!(cache.adopt_into(&mut g).unwrap(), reused);
        assert_eq!(g.prompt_left(), p.len() - reused);
        let (out, _) = run_alone_to_end(&target, g);
        assert_eq!(out.tokens, fresh.tokens);
        assert_eq!(
            (out.cached_prompt_tokens, fresh.cached_prompt_tokens),
            (reused, 0)
        );
    }

    // A prompt that shares too little is not helped, and a started generation takes nothing.
    let other: Vec<u32> = prompt.iter().rev().copied().collect();
    let mut g = Generation::new(model, request(&other, 4, SamplingParams::default())).unwrap();
    assert_eq!(cache.adopt_into(&mut g).unwrap(), 0);
    let mut g = Generation::new(model, request(&prompt, 4, SamplingParams::default())).unwrap();
    step_alone(&target, &mut g);
    assert_eq!(cache.adopt_into(&mut g).unwrap(), 0);
}

#[test]
fn the_prefix_cache_keeps_the_longest_conversation_and_evicts_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path(), "t.gguf", TinySpec::default());
    let model = target.model.as_ref();
    let entry = |tokens: Vec<u32>| {
        let mut cache = model.new_cache(64).unwrap();
        let mut g = Generation::new(model, request(&tokens, 1, SamplingParams::default())).unwrap();
        // Fill a cache with the prompt's rows through a generation of one token.
        step_alone(&target, &mut g);
        let (_, p) = g
            .finish_keeping_prefix(&target.tokenizer, &mut |_| {})
            .unwrap();
        let p = p.unwrap();
        cache.copy_prefix_from(&*p.target, p.tokens.len()).unwrap();
        CachedPrefix {
            tokens: p.tokens,
            target: cache,
            drafter: None,
        }
    };
    let a: Vec<u32> = (0..20).map(|i| 40 + i).collect();
    let a_longer: Vec<u32> = (0..30).map(|i| 40 + i).collect();
    let b: Vec<u32> = (0..20).map(|i| 90 + i).collect();
    let c: Vec<u32> = (0..20).map(|i| 60 + i).collect();
    let mut cache = PrefixCache::new();
    cache.insert(entry(a.clone()), 100);
    // Too short to be worth keeping.
    cache.insert(entry(a[..8].to_vec()), 100);
    assert_eq!((cache.len(), cache.bytes()), (1, 100));
    // The same conversation, longer: the shorter entry goes.
    cache.insert(entry(a_longer.clone()), 150);
    assert_eq!((cache.len(), cache.bytes()), (1, 150));
    // Already covered: nothing new.
    cache.insert(entry(a.clone()), 100);
    assert_eq!((cache.len(), cache.bytes()), (1, 150));
    cache.insert(entry(b.clone()), 100);
    cache.insert(entry(c.clone()), 100);
    assert_eq!((cache.len(), cache.bytes()), (3, 350));
    // A hit makes the longer conversation the most recently used; b is the least.
    let mut g = Generation::new(model, request(&a_longer, 2, SamplingParams::default())).unwrap();
    assert_eq!(cache.adopt_into(&mut g).unwrap(), 29);
    assert_eq!(cache.shrink_to(260), 100);
    let mut g = Generation::new(model, request(&b, 2, SamplingParams::default())).unwrap();
    assert_eq!(cache.adopt_into(&mut g).unwrap(), 0, "b was evicted");
    let mut g = Generation::new(model, request(&c, 2, SamplingParams::default())).unwrap();
    assert_eq!(cache.adopt_into(&mut g).unwrap(), 19);
    assert_eq!(cache.shrink_to(0), 250);
    assert!(cache.is_empty());
}

#[test]
fn a_running_requests_prompt_serves_a_request_arriving_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 5,
            ..Default::default()
        },
    );
    let model = target.model.as_ref();
    let prompt: Vec<u32> = PROMPT.iter().chain(&PROMPT).copied().collect();
    let mut first =
        Generation::new(model, request(&prompt, 12, SamplingParams::default())).unwrap();
    assert!(
        first.prompt_prefix(model).is_none(),
        "nothing prefilled yet"
    );
    step_alone(&target, &mut first);
    let copy = first.prompt_prefix(model).expect("right after its prefill");
    assert_eq!(copy.tokens, prompt);
    let mut cache = PrefixCache::new();
    assert!(!cache.covers(&prompt, false));
    cache.insert(copy, 1);
    assert!(cache.covers(&prompt, false) && cache.covers(&prompt[..20], false));
    step_alone(&target, &mut first);
    assert!(
        first.prompt_prefix(model).is_none(),
        "its cache holds more than the prompt now"
    );
    // A request with the same prompt, while the first still runs.
    let fresh = run(
        &target,
        &request(&prompt, 12, SamplingParams::default()),
        None,
    );
    let mut second =
        Generation::new(model, request(&prompt, 12, SamplingParams::default())).unwrap();
    assert_eq!(cache.adopt_into(&mut second).unwrap(), prompt.len() - 1);
    let (out, _) = run_alone_to_end(&target, second);
    assert_eq!(out.tokens, fresh.tokens);
    let (out, _) = run_alone_to_end(&target, first);
    assert_eq!(out.tokens, fresh.tokens);
}

/// A batched step times each finishing phase once over all its generations (on a GPU every span edge is an event
/// of ~7 us): four generations take as many spans a step as one.
#[test]
fn a_batched_step_takes_one_span_per_phase() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path(), "t.gguf", TinySpec::default());
    let model = target.model.as_ref();
    let spans_of = |n: usize| {
        let mut gens: Vec<Generation<'_>> = (0..n)
            .map(|i| {
                let prompt: Vec<u32> = PROMPT.iter().map(|&t| t + i as u32).collect();
                Generation::new(model, request(&prompt, 4, SamplingParams::default())).unwrap()
            })
            .collect();
        let prof = Profiler::new(crate::profile::Detail::Phases);
        for _ in 0..2 {
            let mut refs: Vec<&mut Generation<'_>> = gens.iter_mut().collect();
            let (results, _) = step(
                model,
                &target.tokenizer,
                &mut refs,
                StepLimits::default(),
                &prof,
                &mut |_, _| {},
            );
            results.into_iter().for_each(|r| r.unwrap());
        }
        let summary = prof.summary();
        ["prefill", "verify", "sample", "commit", "emit"]
            .map(|p| summary.phase(p).map_or(0, |s| s.count))
    };
    // A prefill step and a decode step: one forward span each; the decode step's sample, commit and emit once (the
    // summary counts a decode step's phases).
    assert_eq!(spans_of(1), [1, 1, 1, 1, 1]);
    assert_eq!(spans_of(4), spans_of(1));
}

/// Several generations whose draft models run their passes in shared rounds (one batched forward of the draft
/// model a round, what a server does: `DraftModelRounds`) draft exactly what each drafts alone: the same
/// outputs, drafted and accepted counts and passes, greedy and sampled, with and without a confidence bar; greedy
/// output equals plain decoding.
#[test]
fn draft_model_rounds_draft_what_each_request_drafts_alone() {
    use crate::draft::eagle3::compute::{
        HeadCompute, HeadInput, HeadOutput, HeadPass, HeadRows, HeadWant,
    };
    use crate::draft::model::DraftModelRounds;
    use crate::model::SequenceCache;
    /// Draft-model rounds that remember the most passes one round held, and the rounds and rows they ran.
    struct CountedRounds<'m> {
        inner: DraftModelRounds<'m>,
        widest: std::sync::atomic::AtomicUsize,
        rounds: std::sync::atomic::AtomicUsize,
        rows: std::sync::atomic::AtomicUsize,
    }
    impl HeadCompute for CountedRounds<'_> {
        fn device(&self) -> String {
            self.inner.device()
        }
        fn new_cache(&self, capacity: usize) -> crate::Result<Box<dyn SequenceCache>> {
            self.inner.new_cache(capacity)
        }
        fn run(
            &self,
            target: &dyn crate::model::Model,
            tokens: &[u32],
            input: HeadInput<'_>,
            rows: HeadRows<'_>,
            cache: &mut dyn SequenceCache,
            want: HeadWant,
        ) -> crate::Result<HeadOutput> {
            self.inner.run(target, tokens, input, rows, cache, want)
        }
        fn run_many(
            &self,
            target: &dyn crate::model::Model,
            passes: &mut [HeadPass<'_>],
        ) -> crate::Result<Vec<HeadOutput>> {
            self.widest
                .fetch_max(passes.len(), std::sync::atomic::Ordering::Relaxed);
            self.rounds
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let rows: usize = passes.iter().map(|p| p.tokens.len()).sum();
            self.rows
                .fetch_add(rows, std::sync::atomic::Ordering::Relaxed);
            self.inner.run_many(target, passes)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            seed: 3,
            ..Default::default()
        },
    );
    let close = tiny(
        dir.path(),
        "c.gguf",
        TinySpec {
            seed: 3,
            weight_type: GgmlType::Q4_0,
            logit_scale: 0.3,
            ..Default::default()
        },
    );
    let prompts: [&[u32]; 3] = [&PROMPT[2..], &PROMPT[..], &[72, 101, 108, 32, 111, 114]];
    for (temperature, bar, vocab) in [(0.0, 0.0, None), (0.0, 0.3, Some(200)), (0.8, 0.0, None)] {
        let run_all = |shared: bool| {
            let mut gens: Vec<Generation<'_>> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let sampling = SamplingParams {
                        temperature,
                        seed: 11 + i as u64,
                        ..Default::default()
                    };
                    let d = ModelDrafter::new(close.model.as_ref(), 7 + i as u64)
                        .unwrap()
                        .with_min_confidence(bar)
                        .unwrap()
                        .with_vocab_limit(vocab)
                        .unwrap();
                    let req = request(p, 24 + 3 * i, sampling);
                    Generation::with_drafter(target.model.as_ref(), req, Box::new(d), 3).unwrap()
                })
                .collect();
            let rounds = CountedRounds {
                inner: DraftModelRounds {
                    model: close.model.as_ref(),
                    vocab_limit: vocab,
                },
                widest: Default::default(),
                rounds: Default::default(),
                rows: Default::default(),
            };
            let limits = StepLimits {
                shared_head: shared.then_some(&rounds as &dyn HeadCompute),
                ..Default::default()
            };
            let (mut reported_rounds, mut reported_rows) = (0, 0);
            for _ in 0..200 {
                let report = crate::testing::step_together(&target, &mut gens, limits);
                reported_rounds += report.draft_rounds;
                reported_rows += report.draft_rows;
                if gens.iter().all(|g| g.is_done()) {
                    break;
                }
            }
            // The shared rounds ran, several requests in one pass.
            let widest = rounds.widest.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(widest > 1, shared, "widest round {widest}");
            // Each step reports the rounds and rows its shared passes ran (none without them).
            let ran = (
                rounds.rounds.load(std::sync::atomic::Ordering::Relaxed),
                rounds.rows.load(std::sync::atomic::Ordering::Relaxed),
            );
            assert_eq!((reported_rounds, reported_rows), ran);
            assert_eq!(ran.0 > 0, shared, "rounds {ran:?}");
            gens.into_iter()
                .map(|g| {
                    let out = g.finish(&target.tokenizer, &mut |_| {}).unwrap();
                    let st = out.speculation.clone().unwrap();
                    (out.tokens, st.drafted, st.accepted, st.draft_passes)
                })
                .collect::<Vec<_>>()
        };
        let alone = run_all(false);
        let batched = run_all(true);
        let case = format!("temperature {temperature}, bar {bar}, vocab {vocab:?}");
        assert_eq!(batched, alone, "{case}");
        assert!(
            alone.iter().all(|a| a.1 > 0),
            "every generation drafted: {case}"
        );
        if temperature == 0.0 {
            for (i, p) in prompts.iter().enumerate() {
                let plain = run(
                    &target,
                    &request(p, 24 + 3 * i, SamplingParams::default()),
                    None,
                );
                assert_eq!(batched[i].0, plain.tokens, "prompt {i}: {case}");
            }
        }
    }
}

/// A tiny target with an untied LM head, and the same weights in 4 bits as its draft model (agreeing often, not
/// always).
/// `req` run with a draft model (`close`), prompt lookup and a tree drafter that knows `plain` (plain decoding's
/// tokens for it), each drafting 4 tokens: (name, output).
fn run_with_each_drafter(
    target: &LoadedModel,
    close: &LoadedModel,
    req: &GenerateRequest,
    plain: &[u32],
) -> Vec<(&'static str, GenerateOutput)> {
    let mut all = req.prompt_tokens.clone();
    all.extend(plain);
    let mut drafter = ModelDrafter::new(close.model.as_ref(), 0).unwrap();
    let mut ngram = NgramDrafter::with_stopping(1, 3, Some(0.0)).unwrap();
    let mut oracle = OracleTreeDrafter {
        plain: all,
        vocab: target.model.config().vocab_size as u32,
    };
    let drafters: Vec<(&'static str, &mut dyn Drafter)> = vec![
        ("draft model", &mut drafter),
        ("ngram", &mut ngram),
        ("tree", &mut oracle),
    ];
    drafters
        .into_iter()
        .map(|(name, d)| {
            let spec = Speculation {
                drafter: d,
                draft_tokens: 4,
                simulate_acceptance: None,
            };
            (name, run(target, req, Some(spec)))
        })
        .collect()
}

fn target_and_close_draft(dir: &std::path::Path) -> (LoadedModel, LoadedModel) {
    let spec = TinySpec {
        seed: 3,
        untied_head: true,
        ..Default::default()
    };
    let target = tiny(dir, "t.gguf", spec.clone());
    let close = tiny(
        dir,
        "c.gguf",
        TinySpec {
            weight_type: GgmlType::Q4_0,
            ..spec
        },
    );
    (target, close)
}

/// Log-probabilities are the target's log-softmax at each position: the generated tokens' and the prompt's match
/// one reference pass over the whole sequence, and speculation (a draft model, prompt lookup, a tree) reports
/// bitwise what plain decoding does, greedy or sampled, since every row is computed as it would be alone.
#[test]
fn logprobs_are_the_targets_and_speculation_does_not_change_them() {
    let dir = tempfile::tempdir().unwrap();
    let (target, close) = target_and_close_draft(dir.path());
    // A prompt longer than one scored chunk, so the prompt's rows come from several passes.
    let prompt: Vec<u32> = (0..super::PROMPT_LOGPROBS_CHUNK + 9)
        .map(|i| PROMPT[i % PROMPT.len()] + (i / PROMPT.len()) as u32)
        .collect();
    let top = 4;
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.9,
            seed: 11,
            ..Default::default()
        },
    ] {
        let mut req = request(&prompt, 24, sampling);
        req.logprobs = Some(LogprobsRequest { top, prompt: true });
        let plain = run(&target, &req, None);
        assert_eq!(plain.logprobs.len(), plain.tokens.len());
        assert_eq!(plain.prompt_logprobs.len(), prompt.len() - 1);

        // The reference: one pass over prompt and output, every row's logits.
        let mut all = prompt.clone();
        all.extend(&plain.tokens);
        let mut cache = target.model.new_cache(all.len()).unwrap();
        let reference = target
            .model
            .forward_one(
                &all,
                cache.as_mut(),
                &ForwardOptions::default(),
                LogitsFor::All,
                &Profiler::disabled(),
            )
            .unwrap();
        let reported: Vec<&crate::sampling::TokenLogprob> = plain
            .prompt_logprobs
            .iter()
            .chain(&plain.logprobs)
            .collect();
        for (i, lp) in reported.iter().enumerate() {
            // Entry i is token i + 1 of the sequence, from row i.
            assert_eq!(lp.token, all[i + 1]);
            let want = crate::sampling::token_logprob(&reference.row(i).unwrap(), all[i + 1], top);
            assert!(
                (lp.logprob - want.logprob).abs() < 1e-4,
                "position {i}: {} vs {}",
                lp.logprob,
                want.logprob
            );
            assert_eq!(
                lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                want.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                "position {i}"
            );
            assert!(lp.logprob <= 0.0 && lp.top.len() == top);
        }
        if sampling.is_greedy() {
            assert!(plain.logprobs.iter().all(|lp| lp.top[0].0 == lp.token));
        }

        let mut drafter = ModelDrafter::new(close.model.as_ref(), 0).unwrap();
        let mut ngram = NgramDrafter::with_stopping(1, 3, Some(0.0)).unwrap();
        let mut oracle = OracleTreeDrafter {
            plain: all.clone(),
            vocab: target.model.config().vocab_size as u32,
        };
        let mut drafters: Vec<(&str, &mut dyn Drafter)> =
            vec![("draft model", &mut drafter), ("ngram", &mut ngram)];
        if sampling.is_greedy() {
            drafters.push(("tree", &mut oracle));
        }
        for (name, d) in drafters {
            let out = run(
                &target,
                &req,
                Some(Speculation {
                    drafter: d,
                    draft_tokens: 3,
                    simulate_acceptance: None,
                }),
            );
            let st = out.speculation.as_ref().unwrap();
            assert!(st.drafted > 0, "{name}");
            assert!(name == "ngram" || st.accepted > 0, "{name}: {st:?}");
            if sampling.is_greedy() {
                assert_eq!(out.tokens, plain.tokens, "{name}");
                assert_eq!(out.logprobs, plain.logprobs, "{name}");
            } else {
                // Sampled speculation draws differently from plain sampling; each token's log-probability is
                // still its row's: check against a reference pass over this output.
                let mut seq = prompt.clone();
                seq.extend(&out.tokens);
                let mut cache = target.model.new_cache(seq.len()).unwrap();
                let r = target
                    .model
                    .forward_one(
                        &seq,
                        cache.as_mut(),
                        &ForwardOptions::default(),
                        LogitsFor::All,
                        &Profiler::disabled(),
                    )
                    .unwrap();
                for (j, lp) in out.logprobs.iter().enumerate() {
                    let row = prompt.len() - 1 + j;
                    let want =
                        crate::sampling::token_logprob(&r.row(row).unwrap(), seq[row + 1], 0);
                    assert_eq!(lp.token, seq[row + 1]);
                    assert!((lp.logprob - want.logprob).abs() < 1e-4, "{name} token {j}");
                }
            }
            assert_eq!(out.prompt_logprobs, plain.prompt_logprobs, "{name}");
        }
    }
    // Without asking, nothing is computed.
    let out = run(
        &target,
        &request(&PROMPT, 5, SamplingParams::default()),
        None,
    );
    assert!(out.logprobs.is_empty() && out.prompt_logprobs.is_empty());
    // Too many alternatives are refused by name.
    let mut req = request(&PROMPT, 5, SamplingParams::default());
    req.logprobs = Some(LogprobsRequest {
        top: crate::sampling::MAX_TOP_LOGPROBS + 1,
        prompt: false,
    });
    let err = generate(
        target.model.as_ref(),
        &target.tokenizer,
        &req,
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("alternative log-probabilities"), "{err}");
}

/// Greedy decoding with penalties and a bias follows the reference loop, differs from the unadjusted output (the
/// rules did something), and every drafter (a draft model, prompt lookup, a tree) keeps it token for token.
#[test]
fn penalties_and_bias_shape_greedy_output_and_speculation_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (target, close) = target_and_close_draft(dir.path());
    let n = 40;
    let unadjusted = run(
        &target,
        &request(&PROMPT, n, SamplingParams::default()),
        None,
    )
    .tokens;
    let mut ngram_drafted = 0;
    for rules in [
        crate::sampling::LogitAdjustments {
            repetition_penalty: 1.5,
            ..Default::default()
        },
        crate::sampling::LogitAdjustments {
            presence_penalty: 1.0,
            frequency_penalty: 0.7,
            ..Default::default()
        },
        crate::sampling::LogitAdjustments {
            presence_penalty: -0.5,
            frequency_penalty: 0.3,
            repetition_penalty: 1.2,
            logit_bias: vec![(unadjusted[0], -100.0), (101, 2.5)],
            ..Default::default()
        },
    ] {
        let mut req = request(&PROMPT, n, SamplingParams::default());
        req.logit_adjustments = Some(rules.clone());
        let plain = run(&target, &req, None);
        assert_eq!(
            plain.tokens,
            crate::testing::adjusted_greedy_reference(target.model.as_ref(), &PROMPT, n, &rules)
                .unwrap(),
            "{rules:?}"
        );
        assert_ne!(plain.tokens, unadjusted, "{rules:?} changed nothing");
        for (name, out) in run_with_each_drafter(&target, &close, &req, &plain.tokens) {
            assert_eq!(out.tokens, plain.tokens, "{name} {rules:?}");
            let drafted = out.speculation.unwrap().drafted;
            // Penalized output rarely repeats, so prompt lookup may find nothing to propose under one rule.
            if name == "ngram" {
                ngram_drafted += drafted;
            } else {
                assert!(drafted > 0, "{name}");
            }
        }
    }
    assert!(ngram_drafted > 0, "prompt lookup never drafted");
    // A bias of +100 forces its token; a bad value is refused by name.
    let mut req = request(&PROMPT, 6, SamplingParams::default());
    req.logit_adjustments = Some(crate::sampling::LogitAdjustments {
        logit_bias: vec![(77, 100.0)],
        ..Default::default()
    });
    assert_eq!(run(&target, &req, None).tokens, vec![77; 6]);
    req.logit_adjustments = Some(crate::sampling::LogitAdjustments {
        frequency_penalty: -3.0,
        ..Default::default()
    });
    let err = generate(
        target.model.as_ref(),
        &target.tokenizer,
        &req,
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("frequency_penalty"), "{err}");
}

/// JSON mode: greedy output is the reference loop's (one forward a token, every token that would leave the JSON
/// masked out), its bytes are a prefix of one JSON object (the whole object once a stop token ends it), and every
/// drafter keeps it token for token; sampled output stays inside the language too.
#[test]
fn json_mode_constrains_output_and_speculation_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (target, close) = target_and_close_draft(dir.path());
    // A weak pull towards `}` walks through nested keys and values until the tokens run out; a strong one
    // closes the object at once, so a stop token ends it.
    let stops: Vec<StopReason> = [6.0, 13.0]
        .iter()
        .map(|&close_bias| {
            json_mode_case(
                &target,
                &close,
                close_bias,
                crate::json_mode::JsonGrammar::any_object(),
            )
        })
        .collect();
    assert_eq!(stops, [StopReason::MaxTokens, StopReason::EndOfText]);
}

/// The same with a JSON schema (`response_format` `json_schema`): keys in the schema's order, typed values.
#[test]
fn json_schema_constrains_output_and_speculation_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (target, close) = target_and_close_draft(dir.path());
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "id": {"enum": [7, 42]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            "ok": {"type": "boolean"}
        },
        "required": ["id", "ok"]
    });
    let grammar = crate::json_mode::JsonGrammar::from_schema(&schema).unwrap();
    let stop = json_mode_case(&target, &close, 13.0, grammar);
    assert_eq!(stop, StopReason::EndOfText);
}

/// The same with a union of two objects that begin alike (pydantic's `Union[A, B]`): the constraint follows
/// both until a key tells them apart, and speculation still keeps the reference's tokens.
#[test]
fn json_schema_union_of_objects_constrains_output_and_speculation_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (target, close) = target_and_close_draft(dir.path());
    let schema = serde_json::json!({
        "anyOf": [
            {"type": "object", "properties": {"id": {"enum": [7, 42]}, "ok": {"type": "boolean"}}, "required": ["id"]},
            {"type": "object", "properties": {"id": {"const": 7}, "tags": {"type": "array", "items": {"const": 7}, "maxItems": 2}}, "required": ["id", "tags"]}
        ]
    });
    let grammar = crate::json_mode::JsonGrammar::from_schema(&schema).unwrap();
    let stop = json_mode_case(&target, &close, 13.0, grammar);
    assert_eq!(stop, StopReason::EndOfText);
}

fn json_mode_case(
    target: &LoadedModel,
    close: &LoadedModel,
    close_bias: f32,
    grammar: crate::json_mode::JsonGrammar,
) -> StopReason {
    use crate::json_mode::{JsonConstraint, JsonState, JsonVocabulary};
    let json = JsonConstraint::new(grammar, JsonVocabulary::new(&target.tokenizer));
    let g = json.grammar();
    // Random weights favour whitespace, which JSON allows almost anywhere: a bias against it (applied before
    // the mask, as the rules say) makes the output walk through keys, values and brackets.
    let whitespace: Vec<(u32, f32)> = (0..target.tokenizer.vocab_size() as u32)
        .filter(|&t| {
            let b = target.tokenizer.token_bytes(t);
            !b.is_empty() && b.iter().all(|c| c.is_ascii_whitespace())
        })
        .map(|t| (t, -100.0))
        .chain(
            // Structure a little more likely, so the object closes within the test's tokens.
            [
                (&b"\""[..], 12.0),
                (b":", 5.0),
                (b",", 5.0),
                (b"}", close_bias),
                (b"7", 5.0),
                (b"[", 5.0),
            ]
            .iter()
            .filter_map(|&(text, bias)| {
                (0..target.tokenizer.vocab_size() as u32)
                    .find(|&t| target.tokenizer.token_bytes(t) == text)
                    .map(|t| (t, bias))
            }),
        )
        .collect();
    let rules = crate::sampling::LogitAdjustments {
        json: Some(json.clone()),
        logit_bias: whitespace.clone(),
        ..Default::default()
    };
    let stop = target.tokenizer.stop_tokens().to_vec();
    assert!(!stop.is_empty());
    let n = 48;
    // The reference: the mask computed token by token from the decoded bytes.
    let reference = {
        let model = target.model.as_ref();
        let mut cache = model.new_cache(PROMPT.len() + n + 1).unwrap();
        let mut state = JsonState::default();
        let mut out = Vec::new();
        let mut feed = PROMPT.to_vec();
        for _ in 0..n {
            let h = model
                .forward_one(
                    &feed,
                    cache.as_mut(),
                    &ForwardOptions::default(),
                    LogitsFor::Last,
                    &Profiler::disabled(),
                )
                .unwrap()
                .to_host()
                .unwrap();
            let mut row = h.last().to_vec();
            for &(t, b) in &whitespace {
                row[t as usize] += b;
            }
            let special = target.tokenizer.special_tokens();
            let best = (0..row.len() as u32)
                .filter(|&t| {
                    if stop.contains(&t) {
                        state.is_done()
                    } else {
                        let bytes = target.tokenizer.token_bytes(t);
                        !bytes.is_empty()
                            && special.binary_search(&t).is_err()
                            && g.after(state, &bytes).is_some()
                    }
                })
                .max_by(|&a, &b| row[a as usize].total_cmp(&row[b as usize]).then(b.cmp(&a)))
                .unwrap();
            if stop.contains(&best) {
                break;
            }
            state = g.after(state, &target.tokenizer.token_bytes(best)).unwrap();
            out.push(best);
            feed = vec![best];
        }
        out
    };
    let mut req = request(&PROMPT, n, SamplingParams::default());
    req.stop_at_eos = true;
    req.logit_adjustments = Some(rules.clone());
    let plain = run(target, &req, None);
    assert_eq!(plain.tokens, reference);
    let unconstrained = run(
        target,
        &request(&PROMPT, n, SamplingParams::default()),
        None,
    );
    assert_ne!(
        plain.tokens, unconstrained.tokens,
        "the mask changed nothing"
    );
    let bytes: Vec<u8> = plain
        .tokens
        .iter()
        .flat_map(|&t| target.tokenizer.token_bytes(t))
        .collect();
    let state = g
        .after(JsonState::default(), &bytes)
        .expect("output left the JSON language");
    if plain.stop_reason == StopReason::EndOfText {
        assert!(state.is_done());
        serde_json::from_slice::<serde_json::Value>(&bytes).expect("a whole JSON object");
    }
    for (name, out) in run_with_each_drafter(target, close, &req, &plain.tokens) {
        assert_eq!(out.tokens, plain.tokens, "{name}");
    }
    // Sampled, with a draft model: whatever is drawn stays a JSON prefix.
    for seed in 0..4 {
        let mut req = request(
            &PROMPT,
            n,
            SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            },
        );
        req.stop_at_eos = true;
        req.logit_adjustments = Some(rules.clone());
        let mut drafter = ModelDrafter::new(close.model.as_ref(), 0).unwrap();
        let out = run(
            target,
            &req,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: 3,
                simulate_acceptance: None,
            }),
        );
        let bytes: Vec<u8> = out
            .tokens
            .iter()
            .flat_map(|&t| target.tokenizer.token_bytes(t))
            .collect();
        let state = g.after(JsonState::default(), &bytes);
        assert!(
            state.is_some(),
            "seed {seed}: {}",
            String::from_utf8_lossy(&bytes)
        );
        if out.stop_reason == StopReason::EndOfText {
            assert!(state.unwrap().is_done());
        }
    }
    plain.stop_reason
}
