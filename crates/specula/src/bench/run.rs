//! `specula bench`: plain decoding and each speculative configuration on the same prompts, in one process,
//! interleaved (every prompt runs every configuration before the next prompt starts, in a rotating order), so
//! machine drift hits all configurations alike.

use std::collections::BTreeMap;

use crate::bench::prompts::BenchPrompt;
use crate::bench::verify_cost::{measure_verify_cost, VerifyCost};
use crate::decode::{self, GenerateRequest, Speculation, SpeculationStats};
use crate::draft::model::ModelDrafter;
use crate::draft::ngram::NgramDrafter;
use crate::draft::Drafter;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::profile::{Detail, Profiler};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;

/// The drafting method of the speculative configurations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DraftMethod {
    /// A separate draft model, optionally drafting only among token ids `0..vocab_limit`, and stopping early
    /// where its confidence falls below `min_confidence` (see [`ModelDrafter::with_min_confidence`]; 0: always
    /// k tokens).
    Model {
        vocab_limit: Option<usize>,
        min_confidence: f64,
    },
    /// Prompt lookup (see [`NgramDrafter`]).
    Ngram {
        min_n: usize,
        max_n: usize,
        /// None: cost-aware stopping (see [`NgramDrafter::new`]).
        min_confidence: Option<f64>,
    },
    /// An EAGLE-3 head ([`crate::draft::eagle3::Eagle3Drafter`]) fed by the target's hidden states, drafting
    /// chains (stopping where the head's confidence falls below `min_confidence`; 0: always k) or trees of a
    /// shape. `head` indexes [`BenchSpec::eagle3`] (several heads compare side by side in one run).
    Eagle3 {
        tree: Option<crate::draft::eagle3::TreeShape>,
        min_confidence: f64,
        head: usize,
    },
}

impl DraftMethod {
    /// Whether it drafts chains sized by the bench's draft lengths (everything but an EAGLE-3 tree, whose shape
    /// sizes it).
    pub fn is_chain(&self) -> bool {
        !matches!(self, DraftMethod::Eagle3 { tree: Some(_), .. })
    }

    /// The draft lengths it runs at: the bench's for a chain, the tree's node count for a tree.
    pub fn draft_lengths(&self, chain_lengths: &[usize]) -> Vec<usize> {
        match self {
            DraftMethod::Eagle3 {
                tree: Some(shape), ..
            } => vec![shape.draft_tokens],
            _ => chain_lengths.to_vec(),
        }
    }

    /// "model" or "ngram".
    pub fn name(&self) -> &'static str {
        match self {
            DraftMethod::Model { .. } => "model",
            DraftMethod::Ngram { .. } => "ngram",
            DraftMethod::Eagle3 { .. } => "eagle3",
        }
    }

    /// The setting that tells variants of one method apart in a table.
    pub fn variant(&self) -> String {
        match self {
            DraftMethod::Model {
                vocab_limit,
                min_confidence,
            } => {
                let vocab = match vocab_limit {
                    Some(n) => format!("vocab<{n}"),
                    None => "full vocab".into(),
                };
                if *min_confidence > 0.0 {
                    format!("{vocab} conf>={min_confidence}")
                } else {
                    vocab
                }
            }
            DraftMethod::Ngram {
                min_confidence: Some(c),
                ..
            } => format!("conf>={c}"),
            DraftMethod::Ngram {
                min_confidence: None,
                ..
            } => "cost-aware".into(),
            DraftMethod::Eagle3 {
                tree: None,
                min_confidence,
                ..
            } => {
                if *min_confidence > 0.0 {
                    format!("chain conf>={min_confidence}")
                } else {
                    "chain".into()
                }
            }
            DraftMethod::Eagle3 {
                tree: Some(t),
                min_confidence,
                ..
            } => {
                let shape = format!(
                    "tree topk {} steps {} nodes {}",
                    t.topk,
                    t.steps,
                    t.draft_tokens + 1
                );
                if *min_confidence > 0.0 {
                    format!("{shape} conf>={min_confidence}")
                } else {
                    shape
                }
            }
        }
    }

    /// The settings as JSON (bench reports).
    pub fn settings_json(&self) -> serde_json::Value {
        match *self {
            DraftMethod::Model {
                vocab_limit,
                min_confidence,
            } => serde_json::json!({
                "method": "model",
                "draft_vocab": vocab_limit,
                "draft_confidence": min_confidence,
            }),
            DraftMethod::Ngram {
                min_n,
                max_n,
                min_confidence,
            } => serde_json::json!({
                "method": "ngram",
                "ngram_min": min_n,
                "ngram_max": max_n,
                "ngram_confidence": min_confidence,
            }),
            DraftMethod::Eagle3 {
                tree: None,
                min_confidence,
                ..
            } => {
                serde_json::json!({"method": "eagle3", "tree": null, "draft_confidence": min_confidence})
            }
            DraftMethod::Eagle3 {
                tree: Some(t),
                min_confidence,
                ..
            } => serde_json::json!({
                "method": "eagle3",
                "tree": {"eagle_topk": t.topk, "num_steps": t.steps, "num_draft_tokens": t.draft_tokens + 1},
                "draft_confidence": min_confidence,
            }),
        }
    }
}

/// One configuration: plain decoding (`k == 0`) or a drafter proposing `k` tokens per cycle.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    pub label: String,
    /// "plain", "model" or "ngram".
    pub method: &'static str,
    /// The drafter (None for plain decoding).
    pub drafter: Option<DraftMethod>,
    pub k: usize,
}

/// An EAGLE-3 head a bench runs: the name tables show it by, and what `--draft-model` named it as (a registry
/// name or a path: what reports and tune's recommendations give back to run it again).
pub struct BenchHead<'a> {
    pub name: String,
    pub source: String,
    pub head: &'a crate::draft::eagle3::Eagle3Head,
}

pub struct BenchSpec<'a> {
    pub target: &'a dyn Model,
    pub tokenizer: &'a Tokenizer,
    /// The draft model, for `DraftMethod::Model`.
    pub draft: Option<&'a dyn Model>,
    /// The EAGLE-3 heads `DraftMethod::Eagle3` indexes.
    pub eagle3: Vec<BenchHead<'a>>,
    /// Drafter variants to compare (each chain at every draft length, each tree once); empty runs plain decoding
    /// only.
    pub methods: Vec<DraftMethod>,
    /// Draft lengths the chain drafters run at (a tree runs at its node count); plain decoding always runs too.
    pub draft_tokens: Vec<usize>,
    /// Prompts with their token ids (chat template already applied).
    pub prompts: Vec<(BenchPrompt, Vec<u32>)>,
    pub max_new_tokens: usize,
    /// Passes over all prompts.
    pub rounds: usize,
    pub sampling: SamplingParams,
    pub stop_at_eos: bool,
    /// Repetitions per size of the verify-cost measurement (0 skips it).
    pub verify_cost_repeats: usize,
    /// Speed work: accept each draft token with this probability instead of verifying it
    /// ([`crate::verify::SimulatedAcceptance`]); the greedy-equality check is then skipped.
    pub simulate_acceptance: Option<f64>,
}

/// Totals of one configuration over every run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConfigResult {
    pub label: String,
    pub method: &'static str,
    /// The drafter's settings (null for plain decoding).
    pub drafter: Option<serde_json::Value>,
    pub k: usize,
    pub runs: usize,
    /// Tokens produced by decode steps (the prefill's token excluded) and their time.
    pub decode_tokens: u64,
    pub decode_s: f64,
    /// Decode steps (= speculative cycles).
    pub cycles: u64,
    /// Decode-step seconds per phase (draft, verify, accept, sample, commit, emit, other).
    pub phase_s: BTreeMap<String, f64>,
    /// Acceptance statistics summed over runs (speculative configurations).
    pub speculation: Option<SpeculationStats>,
    /// Runs whose tokens differed from plain decoding of the same prompt (greedy only; must be 0).
    pub greedy_mismatches: usize,
    /// Decode tokens and seconds of each round (pass over the prompts), to show how much a ratio moved while
    /// the run went on.
    pub rounds: Vec<(u64, f64)>,
}

impl ConfigResult {
    pub fn decode_tok_s(&self) -> f64 {
        ratio(self.decode_tokens as f64, self.decode_s)
    }
    pub fn phase_ms_per_cycle(&self, phase: &str) -> f64 {
        ratio(
            self.phase_s.get(phase).copied().unwrap_or(0.0) * 1e3,
            self.cycles as f64,
        )
    }
    /// Verify time over decode time.
    pub fn verify_share(&self) -> f64 {
        ratio(
            self.phase_s.get("verify").copied().unwrap_or(0.0),
            self.decode_s,
        )
    }
    /// Decode time per cycle not spent drafting or verifying (accept, sample, commit, emit, feed, other).
    pub fn overhead_ms_per_cycle(&self) -> f64 {
        let rest: f64 = self
            .phase_s
            .iter()
            .filter(|(name, _)| name.as_str() != "draft" && name.as_str() != "verify")
            .map(|(_, s)| s)
            .sum();
        ratio(rest * 1e3, self.cycles as f64)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub configs: Vec<ConfigResult>,
    pub verify_cost: Option<VerifyCost>,
    pub prompts: usize,
    pub rounds: usize,
    pub max_new_tokens: usize,
    pub greedy: bool,
    /// The draft model's vocabulary limit (`--draft-vocab`) when the bench ran one drafter variant (each
    /// config's `drafter` has its own settings).
    pub draft_vocab: Option<usize>,
    /// `--simulate-acceptance`: acceptance was drawn, not verified (speed work; the outputs are synthetic).
    pub simulated_acceptance: Option<f64>,
    /// Where the target ran ("cpu", "cuda:0 (NVIDIA H200)").
    pub device: String,
}

impl BenchReport {
    pub fn plain(&self) -> Option<&ConfigResult> {
        self.configs.iter().find(|c| c.k == 0)
    }

    /// Decode tok/s of `c` over plain decoding's.
    pub fn speedup(&self, c: &ConfigResult) -> f64 {
        self.plain()
            .map(|p| ratio(c.decode_tok_s(), p.decode_tok_s()))
            .unwrap_or(0.0)
    }

    /// Decode tok/s of `c` over plain decoding's in each round: every prompt runs every configuration back to
    /// back, so a round's ratio is measured side by side, and their spread shows what the machine's drift left.
    pub fn speedup_by_round(&self, c: &ConfigResult) -> Vec<f64> {
        let Some(plain) = self.plain() else {
            return Vec::new();
        };
        c.rounds
            .iter()
            .zip(&plain.rounds)
            .map(|(&(tokens, s), &(plain_tokens, plain_s))| {
                ratio(ratio(tokens as f64, s), ratio(plain_tokens as f64, plain_s))
            })
            .collect()
    }

    /// The fastest speculative configuration (None without one), among those that reproduced plain decoding.
    pub fn best(&self, filter: impl Fn(&ConfigResult) -> bool) -> Option<&ConfigResult> {
        self.configs
            .iter()
            .filter(|c| c.k > 0 && c.greedy_mismatches == 0 && filter(c))
            .max_by(|a, b| a.decode_tok_s().total_cmp(&b.decode_tok_s()))
    }

    /// Which configuration won and by how much: against plain decoding, and where chains and trees ran side by
    /// side, the best of each against the other.
    pub fn best_line(&self) -> Option<String> {
        let best = self.best(|_| true)?;
        let mut line = format!(
            "best: {} at {:.2} tok/s, {:.2}x plain",
            best.label,
            best.decode_tok_s(),
            self.speedup(best)
        );
        let is_tree = |c: &ConfigResult| {
            c.drafter
                .as_ref()
                .is_some_and(|d| d.get("tree").is_some_and(|t| !t.is_null()))
        };
        let best_chain = self.best(|c| !is_tree(c));
        let best_tree = self.best(is_tree);
        if let (Some(chain), Some(tree)) = (best_chain, best_tree) {
            let (winner, other) = if is_tree(best) {
                (tree, chain)
            } else {
                (chain, tree)
            };
            let _ = std::fmt::Write::write_fmt(
                &mut line,
                format_args!(
                    "; the best {} is {:.2}x the best {} ({})",
                    if is_tree(best) { "tree" } else { "chain" },
                    ratio(winner.decode_tok_s(), other.decode_tok_s()),
                    if is_tree(best) { "chain" } else { "tree" },
                    other.label
                ),
            );
        }
        Some(line)
    }

    /// The table `specula bench` prints.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let width = self
            .configs
            .iter()
            .map(|c| c.label.len())
            .max()
            .unwrap_or(0)
            .max(10);
        let _ = writeln!(
            s,
            "{:<width$} {:>8} {:>8} {:>7} {:>9} {:>10} {:>10} {:>10} {:>8}",
            "config",
            "tok/s",
            "speedup",
            "accept",
            "mean_len",
            "draft_ms",
            "verify_ms",
            "other_ms",
            "verify%"
        );
        for c in &self.configs {
            let (accept, mean_len) = match &c.speculation {
                Some(st) => (
                    format!("{:.1}%", st.acceptance_rate() * 100.0),
                    format!("{:.2}", st.mean_accept_len()),
                ),
                None => ("-".into(), "1.00".into()),
            };
            let _ = writeln!(
                s,
                "{:<width$} {:>8.2} {:>7.2}x {:>7} {:>9} {:>10.1} {:>10.1} {:>10.2} {:>7.1}%{}",
                c.label,
                c.decode_tok_s(),
                self.speedup(c),
                accept,
                mean_len,
                c.phase_ms_per_cycle("draft"),
                c.phase_ms_per_cycle("verify"),
                c.overhead_ms_per_cycle(),
                c.verify_share() * 100.0,
                if c.greedy_mismatches > 0 {
                    format!("  LOSSY: {} runs differ from plain", c.greedy_mismatches)
                } else {
                    String::new()
                }
            );
        }
        if let Some(line) = self.best_line() {
            let _ = writeln!(s, "{line}");
        }
        if self.rounds > 1 {
            let rows: Vec<String> = self
                .configs
                .iter()
                .filter(|c| c.k > 0)
                .map(|c| {
                    let each: Vec<String> = self
                        .speedup_by_round(c)
                        .iter()
                        .map(|x| format!("{x:.2}"))
                        .collect();
                    format!("{} {}", c.label, each.join(" / "))
                })
                .collect();
            if !rows.is_empty() {
                let _ = writeln!(s, "speedup by round: {}", rows.join("; "));
            }
        }
        if let Some(p) = self.simulated_acceptance {
            let _ = writeln!(
                s,
                "simulated acceptance: each draft token accepted with probability {p} (not verified; speed only)"
            );
        }
        if let Some(v) = &self.verify_cost {
            let cells: Vec<String> = (1..=v.ms.len())
                .map(|n| format!("{n}:{:.1}ms({:.2}x)", v.verify_ms(n), v.ratio(n)))
                .collect();
            let _ = writeln!(
                s,
                "verify(n) of the target, n tokens per forward (median of {}): {}",
                v.repeats,
                cells.join(" ")
            );
        }
        s
    }

    pub fn to_json(&self) -> serde_json::Value {
        let configs: Vec<serde_json::Value> = self
            .configs
            .iter()
            .map(|c| {
                serde_json::json!({
                    "label": c.label,
                    "method": c.method,
                    "drafter": c.drafter,
                    "k": c.k,
                    "runs": c.runs,
                    "decode_tokens": c.decode_tokens,
                    "decode_s": c.decode_s,
                    "decode_tok_s": c.decode_tok_s(),
                    "speedup_vs_plain": self.speedup(c),
                    "speedup_by_round": self.speedup_by_round(c),
                    "cycles": c.cycles,
                    "draft_ms_per_cycle": c.phase_ms_per_cycle("draft"),
                    "verify_ms_per_cycle": c.phase_ms_per_cycle("verify"),
                    "overhead_ms_per_cycle": c.overhead_ms_per_cycle(),
                    "verify_share_of_cycle": c.verify_share(),
                    "phase_s": c.phase_s,
                    "acceptance_rate": c.speculation.as_ref().map(|s| s.acceptance_rate()),
                    "mean_accept_len": c.speculation.as_ref().map(|s| s.mean_accept_len()).unwrap_or(1.0),
                    "speculation": c.speculation.as_ref().map(|s| s.to_json()),
                    "greedy_mismatches": c.greedy_mismatches,
                })
            })
            .collect();
        serde_json::json!({
            "prompts": self.prompts,
            "rounds": self.rounds,
            "max_new_tokens": self.max_new_tokens,
            "greedy": self.greedy,
            "draft_vocab": self.draft_vocab,
            "simulated_acceptance": self.simulated_acceptance,
            "device": self.device,
            "configs": configs,
            "best": self.best(|_| true).map(|c| c.label.clone()),
            "verify_cost": self.verify_cost,
        })
    }
}

/// Progress of a bench run, for a progress bar.
pub struct Progress<'a> {
    pub done: usize,
    pub total: usize,
    pub config: &'a str,
    pub prompt_id: &'a str,
}

/// The configurations a spec asks for: plain first, then each drafter variant at each k.
pub fn configs(spec: &BenchSpec<'_>) -> Vec<BenchConfig> {
    let mut out = vec![BenchConfig {
        label: "plain".into(),
        method: "plain",
        drafter: None,
        k: 0,
    }];
    for method in &spec.methods {
        let mut name = if spec.methods.len() > 1 {
            format!("{} {}", method.name(), method.variant())
        } else {
            method.name().to_string()
        };
        // Several heads: each configuration says whose it is.
        if let (DraftMethod::Eagle3 { head, .. }, true) = (method, spec.eagle3.len() > 1) {
            if let Some(h) = spec.eagle3.get(*head) {
                name = format!("{name} [{}]", h.name);
            }
        }
        for k in method.draft_lengths(&spec.draft_tokens) {
            let label = match method {
                // A tree's shape says its size (k is its node count less the pending token).
                DraftMethod::Eagle3 { tree: Some(_), .. } if spec.methods.len() > 1 => name.clone(),
                DraftMethod::Eagle3 { tree: Some(_), .. } => format!("{name} {}", method.variant()),
                _ => format!("{name} k={k}"),
            };
            out.push(BenchConfig {
                label,
                method: method.name(),
                drafter: Some(*method),
                k,
            });
        }
    }
    out
}

/// Most passes over the prompts a bench runs (more only multiplies the run time; noise is averaged by then).
pub const MAX_ROUNDS: usize = 1000;
/// Most repetitions per size of the verify-cost measurement.
pub const MAX_VERIFY_REPEATS: usize = 1000;

/// Checks `--rounds` and `--verify-repeats` (callers check them before loading any model).
pub fn check_repetitions(rounds: usize, verify_repeats: usize) -> Result<()> {
    if rounds == 0 || rounds > MAX_ROUNDS {
        return Err(Error::InvalidArgument(format!(
            "--rounds must be between 1 and {MAX_ROUNDS}, got {rounds}"
        )));
    }
    if verify_repeats > MAX_VERIFY_REPEATS {
        return Err(Error::InvalidArgument(format!(
            "--verify-repeats must be between 0 and {MAX_VERIFY_REPEATS}, got {verify_repeats}"
        )));
    }
    Ok(())
}

pub fn validate(spec: &BenchSpec<'_>) -> Result<()> {
    if spec.prompts.is_empty() {
        return Err(Error::InvalidArgument("no prompts to benchmark".into()));
    }
    check_repetitions(spec.rounds, spec.verify_cost_repeats)?;
    if spec.max_new_tokens == 0 {
        return Err(Error::InvalidArgument(
            "--max-tokens must be at least 1".into(),
        ));
    }
    if spec.methods.iter().any(DraftMethod::is_chain) && spec.draft_tokens.is_empty() {
        return Err(Error::InvalidArgument(
            "--draft-tokens lists no draft lengths".into(),
        ));
    }
    for method in &spec.methods {
        for k in method.draft_lengths(&spec.draft_tokens) {
            decode::check_draft_tokens(k)?;
        }
    }
    let uses_model = spec
        .methods
        .iter()
        .any(|m| matches!(m, DraftMethod::Model { .. }));
    if uses_model && spec.draft.is_none() {
        return Err(Error::InvalidArgument(
            "the model drafting method needs a draft model".into(),
        ));
    }
    for method in &spec.methods {
        if let DraftMethod::Eagle3 { head, .. } = *method {
            let head = spec.eagle3.get(head).map(|h| h.head).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "the eagle3 drafting method needs EAGLE-3 head {head} of {} given",
                    spec.eagle3.len()
                ))
            })?;
            head.check_target(spec.target.config())?;
        }
    }
    for method in &spec.methods {
        match *method {
            DraftMethod::Ngram {
                min_n,
                max_n,
                min_confidence,
            } => {
                NgramDrafter::with_stopping(min_n, max_n, min_confidence)?;
            }
            DraftMethod::Eagle3 { .. } => {}
            DraftMethod::Model {
                vocab_limit,
                min_confidence,
            } => {
                if let Some(draft) = spec.draft {
                    crate::draft::model::check_vocab_limit(draft, vocab_limit)?;
                }
                crate::draft::model::check_min_confidence(min_confidence)?;
            }
        }
    }
    Ok(())
}

/// Runs the benchmark. `on_progress` is called before each run.
pub fn run_bench(
    spec: &BenchSpec<'_>,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<BenchReport> {
    validate(spec)?;
    let configs = configs(spec);
    let mut results: Vec<ConfigResult> = configs
        .iter()
        .map(|c| ConfigResult {
            label: c.label.clone(),
            method: c.method,
            drafter: c.drafter.map(|d| {
                let mut json = d.settings_json();
                if let DraftMethod::Eagle3 { head, .. } = d {
                    if let Some(h) = spec.eagle3.get(head) {
                        json["draft_model"] = h.name.clone().into();
                        json["draft_model_source"] = h.source.clone().into();
                    }
                }
                json
            }),
            k: c.k,
            runs: 0,
            decode_tokens: 0,
            decode_s: 0.0,
            cycles: 0,
            phase_s: BTreeMap::new(),
            speculation: None,
            greedy_mismatches: 0,
            rounds: vec![(0, 0.0); spec.rounds],
        })
        .collect();
    let greedy = spec.sampling.temperature == 0.0;
    let total = spec.rounds * spec.prompts.len() * configs.len();
    let mut done = 0;
    for round in 0..spec.rounds {
        for (p_index, (prompt, ids)) in spec.prompts.iter().enumerate() {
            let req = GenerateRequest {
                prompt_tokens: ids.clone(),
                max_new_tokens: spec.max_new_tokens,
                sampling: spec.sampling,
                stop_at_eos: spec.stop_at_eos,
                cancel: None,
                logprobs: None,
                logit_adjustments: None,
                stop_token_ids: Vec::new(),
            };
            decode::validate_request(spec.target, &req)
                .map_err(|e| Error::InvalidArgument(format!("prompt {}: {e}", prompt.id)))?;
            let mut plain_tokens: Option<Vec<u32>> = None;
            // Rotate which configuration goes first so none always runs on a cold machine.
            let shift = (round * spec.prompts.len() + p_index) % configs.len();
            let order: Vec<usize> = (0..configs.len())
                .map(|i| (i + shift) % configs.len())
                .collect();
            let mut outputs: Vec<Option<Vec<u32>>> = vec![None; configs.len()];
            for &ci in &order {
                let config = &configs[ci];
                on_progress(Progress {
                    done,
                    total,
                    config: &config.label,
                    prompt_id: &prompt.id,
                });
                let prof = Profiler::with_clock(Detail::Phases, spec.target.clock(false));
                let mut drafter: Option<Box<dyn Drafter + '_>> = match (config.k, config.drafter) {
                    (0, _) | (_, None) => None,
                    (
                        _,
                        Some(DraftMethod::Model {
                            vocab_limit,
                            min_confidence,
                        }),
                    ) => Some(Box::new(
                        ModelDrafter::new(spec.draft.expect("validated"), spec.sampling.seed)?
                            .with_vocab_limit(vocab_limit)?
                            .with_min_confidence(min_confidence)?,
                    )),
                    (
                        _,
                        Some(DraftMethod::Ngram {
                            min_n,
                            max_n,
                            min_confidence,
                        }),
                    ) => Some(Box::new(NgramDrafter::for_device(
                        min_n,
                        max_n,
                        min_confidence,
                        &spec.target.device(),
                    )?)),
                    (
                        _,
                        Some(DraftMethod::Eagle3 {
                            tree,
                            min_confidence,
                            head,
                        }),
                    ) => {
                        let head = spec.eagle3.get(head).map(|h| h.head).ok_or_else(|| {
                            Error::InvalidArgument(format!("no EAGLE-3 head {head}"))
                        })?;
                        let d = crate::draft::eagle3::Eagle3Drafter::new(
                            head,
                            spec.target,
                            spec.sampling.seed,
                        )?
                        .with_min_confidence(min_confidence)?;
                        Some(Box::new(match tree {
                            Some(shape) => d.with_tree(shape),
                            None => d,
                        }))
                    }
                };
                let speculation = drafter.as_mut().map(|d| Speculation {
                    drafter: d.as_mut(),
                    draft_tokens: config.k,
                    simulate_acceptance: spec.simulate_acceptance,
                });
                let out = decode::generate(
                    spec.target,
                    spec.tokenizer,
                    &req,
                    speculation,
                    &prof,
                    &mut |_| {},
                )?;
                let summary = prof.summary();
                let r = &mut results[ci];
                r.runs += 1;
                r.decode_tokens += out.timing.decode_tokens as u64;
                r.decode_s += out.timing.decode_s;
                r.rounds[round].0 += out.timing.decode_tokens as u64;
                r.rounds[round].1 += out.timing.decode_s;
                r.cycles += summary.decode_steps;
                for p in summary.phases.iter().filter(|p| p.name != "prefill") {
                    *r.phase_s.entry(p.name.to_string()).or_default() += p.total_s;
                }
                *r.phase_s.entry("other".to_string()).or_default() += summary.other_s;
                if let Some(st) = out.speculation {
                    match &mut r.speculation {
                        Some(total) => total.merge(&st),
                        None => r.speculation = Some(st),
                    }
                }
                if config.k == 0 {
                    plain_tokens = Some(out.tokens.clone());
                }
                outputs[ci] = Some(out.tokens);
                done += 1;
            }
            // Greedy speculation must reproduce plain decoding exactly (simulated acceptance does not verify).
            if greedy && spec.simulate_acceptance.is_none() {
                if let Some(plain) = &plain_tokens {
                    for (ci, tokens) in outputs.iter().enumerate() {
                        if tokens.as_ref().is_some_and(|t| t != plain) {
                            results[ci].greedy_mismatches += 1;
                        }
                    }
                }
            }
        }
    }
    on_progress(Progress {
        done,
        total,
        config: "verify cost",
        prompt_id: "",
    });
    let verify_cost = if spec.verify_cost_repeats > 0 {
        let max_rows = configs.iter().map(|c| c.k).max().unwrap_or(1) + 1;
        Some(measure_verify_cost(
            spec.target,
            &spec.prompts[0].1,
            max_rows.max(2),
            spec.verify_cost_repeats,
        )?)
    } else {
        None
    };
    Ok(BenchReport {
        configs: results,
        verify_cost,
        prompts: spec.prompts.len(),
        rounds: spec.rounds,
        max_new_tokens: spec.max_new_tokens,
        greedy,
        draft_vocab: match spec.methods[..] {
            [DraftMethod::Model { vocab_limit, .. }] => vocab_limit,
            _ => None,
        },
        simulated_acceptance: spec.simulate_acceptance,
        device: spec.target.device(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(label: &str, k: usize, rounds: &[(u64, f64)]) -> ConfigResult {
        ConfigResult {
            label: label.into(),
            method: if k == 0 { "plain" } else { "ngram" },
            drafter: None,
            k,
            runs: rounds.len(),
            decode_tokens: rounds.iter().map(|r| r.0).sum(),
            decode_s: rounds.iter().map(|r| r.1).sum(),
            cycles: 1,
            phase_s: BTreeMap::new(),
            speculation: None,
            greedy_mismatches: 0,
            rounds: rounds.to_vec(),
        }
    }

    #[test]
    fn each_rounds_speedup_is_against_plain_in_the_same_round() {
        // Plain slows down in round 2 (the machine drifted); the drafter's rate relative to it does not.
        let plain = config("plain", 0, &[(100, 1.0), (100, 2.0)]);
        let fast = config("ngram k=2", 2, &[(150, 1.0), (100, 1.0)]);
        let report = BenchReport {
            configs: vec![plain, fast],
            verify_cost: None,
            prompts: 1,
            rounds: 2,
            max_new_tokens: 8,
            greedy: true,
            draft_vocab: None,
            simulated_acceptance: None,
            device: "cpu".into(),
        };
        assert_eq!(report.speedup_by_round(&report.configs[0]), vec![1.0, 1.0]);
        assert_eq!(report.speedup_by_round(&report.configs[1]), vec![1.5, 2.0]);
        // The whole run's ratio mixes both rounds: 250 tokens in 2 s against 200 in 3 s.
        assert!((report.speedup(&report.configs[1]) - 1.875).abs() < 1e-12);
        let table = report.table();
        assert!(
            table.contains("speedup by round: ngram k=2 1.50 / 2.00"),
            "{table}"
        );
    }
}
