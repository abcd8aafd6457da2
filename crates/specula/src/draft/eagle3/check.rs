//! The wiring check: which target layers an EAGLE-3 head was trained on, measured instead of assumed.
//!
//! Engines disagree on what "layer id i" means (the input of layer i or its output; SGLang adds one to explicit
//! ids, vLLM does not), and a head wired one layer off still drafts, only badly: acceptance fell from ~47% to ~19%
//! in the case behind this project, and nothing said why. The check runs the same greedy generations with the
//! configured wiring and its neighbours (every id one lower and one higher, the two conventions, and each single
//! id moved by one) and ranks them by how often the target accepts the first draft token.

use crate::decode::{generate, GenerateRequest, Speculation, SpeculationStats};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::profile::Profiler;
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;

use super::{Eagle3Drafter, Eagle3Head};

/// One wiring tried: the target layers (outputs of layers, low to high) and how it relates to the configured one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wiring {
    pub layers: Vec<usize>,
    pub label: String,
}

/// The configured wiring and its neighbours in an `n`-layer target, without duplicates or ids outside it.
pub fn candidates(configured: &[usize], n: usize) -> Vec<Wiring> {
    let mut out: Vec<Wiring> = Vec::new();
    let mut push = |layers: Vec<usize>, label: String| {
        if layers.iter().all(|&l| l < n) && !out.iter().any(|w| w.layers == layers) {
            out.push(Wiring { layers, label });
        }
    };
    push(configured.to_vec(), "configured".into());
    if configured.iter().all(|&l| l >= 1) {
        push(
            configured.iter().map(|&l| l - 1).collect(),
            "every id - 1 (ids meant as layer inputs)".into(),
        );
    }
    push(
        configured.iter().map(|&l| l + 1).collect(),
        "every id + 1 (SGLang's reading of explicit ids)".into(),
    );
    for i in 0..configured.len() {
        for (delta, sign) in [(-1i64, "-"), (1, "+")] {
            let moved = configured[i] as i64 + delta;
            if moved < 0 {
                continue;
            }
            let mut layers = configured.to_vec();
            layers[i] = moved as usize;
            push(layers, format!("id {} {sign} 1", i + 1));
        }
    }
    out
}

/// A wiring's speculation over every prompt.
#[derive(Debug, Clone)]
pub struct WiringResult {
    pub wiring: Wiring,
    pub stats: SpeculationStats,
}

impl WiringResult {
    /// How often the target accepted the first draft token.
    pub fn first_token_acceptance(&self) -> f64 {
        self.stats
            .per_position_acceptance()
            .first()
            .copied()
            .unwrap_or(0.0)
    }
}

/// Greedy speculation with `head` on `target` over `prompts` (token ids), `k` draft tokens a cycle, once per
/// candidate wiring around the configured one.
pub fn check_wiring(
    target: &dyn Model,
    tokenizer: &Tokenizer,
    head: &Eagle3Head,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    k: usize,
    on_progress: &mut dyn FnMut(usize, usize, &Wiring),
) -> Result<Vec<WiringResult>> {
    if prompts.is_empty() {
        return Err(Error::InvalidArgument(
            "the wiring check needs at least one prompt".into(),
        ));
    }
    let n = target.config().num_layers;
    let configured = head.config.target_layers(n)?;
    let wirings = candidates(&configured, n);
    let total = wirings.len();
    let mut results = Vec::with_capacity(total);
    for (i, wiring) in wirings.into_iter().enumerate() {
        on_progress(i, total, &wiring);
        let mut total = SpeculationStats::new("eagle3", k);
        for ids in prompts {
            let mut drafter =
                Eagle3Drafter::new(head, target, 0)?.with_layers(wiring.layers.clone())?;
            let req = GenerateRequest {
                prompt_tokens: ids.clone(),
                max_new_tokens,
                sampling: SamplingParams::default(),
                stop_at_eos: true,
                cancel: None,
                logprobs: None,
                logit_adjustments: None,
                stop_token_ids: Vec::new(),
            };
            let out = generate(
                target,
                tokenizer,
                &req,
                Some(Speculation {
                    drafter: &mut drafter,
                    draft_tokens: k,
                    simulate_acceptance: None,
                }),
                &Profiler::disabled(),
                &mut |_| {},
            )?;
            if let Some(st) = out.speculation {
                total.merge(&st);
            }
        }
        results.push(WiringResult {
            wiring,
            stats: total,
        });
    }
    Ok(results)
}

/// How many standard errors a wiring's first-token acceptance must lead the configured one's by before the
/// check says the head was trained on it. Neighbouring wirings of a trained head differ by a few points, which a
/// few hundred drafts cannot resolve (measured on an H200: 2.2 points apart at ~220 drafts each, 0.5 standard
/// errors); a real miswiring costs tens of points. Three standard errors keeps the chance that noise alone names
/// one of the eight alternatives near 1%.
pub const WIRING_Z: f64 = 3.0;

/// The standard error of a wiring's first-token acceptance (a proportion over its first-position drafts); 0
/// without drafts.
fn standard_error(r: &WiringResult) -> f64 {
    let n = r.stats.drafted_per_position.first().copied().unwrap_or(0) as f64;
    if n == 0.0 {
        return 0.0;
    }
    let p = r.first_token_acceptance();
    (p * (1.0 - p) / n).sqrt()
}

/// By how many standard errors `a`'s first-token acceptance exceeds `b`'s (two independent proportions); None
/// when either has no drafts or both rates are 0 or 1 (no spread to measure).
fn separation(a: &WiringResult, b: &WiringResult) -> Option<f64> {
    let drafts = |r: &WiringResult| r.stats.drafted_per_position.first().copied().unwrap_or(0);
    if drafts(a) == 0 || drafts(b) == 0 {
        return None;
    }
    let (pa, pb) = (a.first_token_acceptance(), b.first_token_acceptance());
    let se = standard_error(a).hypot(standard_error(b));
    if se == 0.0 {
        return (pa != pb).then_some(f64::INFINITY);
    }
    Some((pa - pb) / se)
}

/// The table and verdict `specula eagle3 check` prints.
pub fn report(results: &[WiringResult]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<16} {:>12} {:>6} {:>10} {:>9}  wiring",
        "target layers", "first token", "+-", "accepted", "mean_len"
    );
    let mut order: Vec<usize> = (0..results.len()).collect();
    order.sort_by(|&a, &b| {
        let (ra, rb) = (&results[a], &results[b]);
        rb.first_token_acceptance()
            .total_cmp(&ra.first_token_acceptance())
            .then(
                rb.stats
                    .mean_accept_len()
                    .total_cmp(&ra.stats.mean_accept_len()),
            )
    });
    for &i in &order {
        let r = &results[i];
        let _ = writeln!(
            s,
            "{:<16} {:>11.1}% {:>6.1} {:>9.1}% {:>9.2}  {}",
            format!("{:?}", r.wiring.layers),
            r.first_token_acceptance() * 100.0,
            standard_error(r) * 100.0,
            r.stats.acceptance_rate() * 100.0,
            r.stats.mean_accept_len(),
            r.wiring.label
        );
    }
    let (Some(&best), Some(configured)) = (order.first(), results.first()) else {
        return s;
    };
    let b = &results[best];
    let (fb, fc) = (
        b.first_token_acceptance(),
        configured.first_token_acceptance(),
    );
    let gap = separation(b, configured);
    if best == 0 || gap.is_none_or(|z| z < WIRING_Z) {
        let _ = write!(
            s,
            "verdict: the configured wiring {:?} drafts best of the {} tried ({:.1}% of first draft tokens accepted)",
            configured.wiring.layers,
            results.len(),
            fc * 100.0
        );
        if best != 0 {
            // Another wiring measured higher, but not by more than this sample can tell apart.
            let _ = write!(
                s,
                " within measurement noise: {:?} ({}) measured {:.1}%, {:.1} points higher, {:.1} standard errors \
                 (a different wiring is named from {WIRING_Z} on; more prompts or tokens tell closer wirings apart)",
                b.wiring.layers,
                b.wiring.label,
                fb * 100.0,
                (fb - fc) * 100.0,
                gap.unwrap_or(0.0)
            );
        }
        let _ = writeln!(s);
    } else {
        let _ = writeln!(
            s,
            "verdict: the head was trained on target layers {:?} ({}): {:.1}% of first draft tokens accepted, \
             against {:.1}% wired as configured {:?}. The configured wiring costs {:.1} points of first-token \
             acceptance (mean accepted length {:.2} vs {:.2}); set eagle_aux_hidden_state_layer_ids to {:?} \
             (outputs of layers, 0-based).",
            b.wiring.layers,
            b.wiring.label,
            fb * 100.0,
            fc * 100.0,
            configured.wiring.layers,
            (fb - fc) * 100.0,
            b.stats.mean_accept_len(),
            configured.stats.mean_accept_len(),
            b.wiring.layers
        );
    }
    s
}

/// Fewest first-position drafts before a measured acceptance is compared with the training record.
pub const MIN_DRAFTS_TO_FLAG: u64 = 32;

/// A warning when the head accepts its first draft token far less often (under half as often) than its training
/// measured on held-out data: the usual causes are a wrong wiring or a chat template the head was not trained
/// with. None when the head has no training record or too few drafts were measured.
pub fn acceptance_warning(head: &Eagle3Head, stats: &SpeculationStats) -> Option<String> {
    let trained = *head.config.trained_accuracy.as_ref()?.first()?;
    let drafted = *stats.drafted_per_position.first()?;
    if drafted < MIN_DRAFTS_TO_FLAG {
        return None;
    }
    let measured = stats.accepted_per_position[0] as f64 / drafted as f64;
    (measured < 0.5 * trained).then(|| {
        format!(
            "EAGLE-3 head {}: its first draft token was accepted {:.1}% of the time ({} of {drafted}), but its \
             training measured {:.1}% on held-out data; check the wiring (`specula eagle3 check`) and that prompts \
             use the chat template the head was trained with",
            head.path.display(),
            measured * 100.0,
            stats.accepted_per_position[0],
            trained * 100.0
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::load_gguf;
    use crate::testing::{write_tiny_eagle3_head, write_tiny_gguf, TinyHeadSpec, TinySpec};

    #[test]
    fn candidates_cover_both_conventions_and_single_moves() {
        let c = candidates(&[2, 16, 29], 32);
        let layers: Vec<Vec<usize>> = c.iter().map(|w| w.layers.clone()).collect();
        assert_eq!(layers[0], vec![2, 16, 29]);
        assert!(layers.contains(&vec![1, 15, 28]));
        assert!(layers.contains(&vec![3, 17, 30]));
        assert!(layers.contains(&vec![2, 16, 28]));
        assert!(layers.contains(&vec![2, 17, 29]));
        assert_eq!(c.len(), 9);
        // Ids past the target or below 0 are never tried.
        let edge = candidates(&[0, 1, 3], 4);
        assert!(edge.iter().all(|w| w.layers.iter().all(|&l| l < 4)));
        assert!(!edge.iter().any(|w| w.layers == vec![1, 2, 4]));
    }

    fn result(
        layers: Vec<usize>,
        label: &str,
        first: (u64, u64),
        total: (u64, u64),
    ) -> WiringResult {
        let mut stats = SpeculationStats::new("eagle3", 2);
        stats.cycles = first.0;
        stats.drafted_per_position = vec![first.0, 0];
        stats.accepted_per_position = vec![first.1, 0];
        stats.drafted = total.0;
        stats.accepted = total.1;
        WiringResult {
            wiring: Wiring {
                layers,
                label: label.into(),
            },
            stats,
        }
    }

    #[test]
    fn the_report_names_the_best_wiring_and_what_the_configured_one_costs() {
        // The mission's case: trained on one wiring, served one layer off.
        let results = vec![
            result(vec![3, 31, 59], "configured", (100, 19), (200, 30)),
            result(vec![2, 30, 58], "every id - 1", (100, 47), (200, 70)),
            result(vec![4, 32, 60], "every id + 1", (100, 8), (200, 10)),
        ];
        let text = report(&results);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].starts_with("[2, 30, 58]"), "best first: {text}");
        assert!(lines[3].starts_with("[4, 32, 60]"), "worst last: {text}");
        assert!(
            text.contains("trained on target layers [2, 30, 58] (every id - 1): 47.0%")
                && text.contains("against 19.0% wired as configured [3, 31, 59]")
                && text.contains("costs 28.0 points"),
            "{text}"
        );
        // When the configured wiring is best (or within noise), the verdict says so.
        let fine = vec![
            result(vec![1, 15, 28], "configured", (100, 47), (200, 70)),
            result(vec![2, 16, 29], "every id + 1", (100, 46), (200, 69)),
        ];
        assert!(report(&fine).contains("verdict: the configured wiring [1, 15, 28] drafts best"));
    }

    #[test]
    fn a_small_lead_is_named_only_when_the_sample_can_resolve_it() {
        // The H200 measurement of a trained head: a neighbour 2.2 points ahead on ~220 drafts is noise.
        let noisy = vec![
            result(vec![1, 13, 24], "configured", (220, 144), (600, 277)),
            result(vec![0, 13, 24], "id 1 - 1", (220, 149), (600, 278)),
        ];
        let text = report(&noisy);
        assert!(
            text.contains("verdict: the configured wiring [1, 13, 24] drafts best of the 2 tried")
                && text.contains("within measurement noise: [0, 13, 24] (id 1 - 1) measured 67.7%"),
            "{text}"
        );
        // The same 3-point lead over 20000 drafts each is real (about 6 standard errors).
        let resolved = vec![
            result(
                vec![1, 13, 24],
                "configured",
                (20000, 13000),
                (60000, 27000),
            ),
            result(vec![0, 13, 24], "id 1 - 1", (20000, 13600), (60000, 27500)),
        ];
        let text = report(&resolved);
        assert!(
            text.contains("trained on target layers [0, 13, 24] (id 1 - 1): 68.0%")
                && text.contains("costs 3.0 points"),
            "{text}"
        );
        // No drafts measured: nothing can be named.
        let empty = vec![
            result(vec![1, 13, 24], "configured", (0, 0), (0, 0)),
            result(vec![0, 13, 24], "id 1 - 1", (0, 0), (0, 0)),
        ];
        assert!(report(&empty).contains("verdict: the configured wiring [1, 13, 24]"));
    }

    /// End to end on a tiny target and a random head: every candidate runs, and each result is the
    /// speculation of its own wiring (a random head accepts little, so only the mechanics are checked here;
    /// telling wirings apart needs a trained head, which issue 13's training step will provide).
    #[test]
    fn the_check_runs_every_candidate_wiring() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        write_tiny_gguf(
            &p,
            &TinySpec {
                layers: 4,
                seed: 3,
                ..Default::default()
            },
        )
        .unwrap();
        let t = load_gguf(&p, "t").unwrap();
        let hd = dir.path().join("head");
        write_tiny_eagle3_head(&hd, t.model.config(), &TinyHeadSpec::default()).unwrap();
        let head = Eagle3Head::load(&hd).unwrap();
        let prompts = vec![vec![72, 101, 108, 108, 111], vec![116, 104, 101, 32, 116]];
        let mut seen = Vec::new();
        let results = check_wiring(
            t.model.as_ref(),
            &t.tokenizer,
            &head,
            &prompts,
            12,
            2,
            &mut |i, n, w| seen.push((i, n, w.layers.clone())),
        )
        .unwrap();
        assert_eq!(results.len(), candidates(&[0, 1, 2], 4).len());
        assert_eq!(seen.len(), results.len());
        for r in &results {
            assert!(r.stats.cycles > 0 && r.stats.drafted > 0, "{:?}", r.wiring);
        }
        assert!(report(&results).contains("verdict:"));
    }
}
