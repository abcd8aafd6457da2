//! `specula bench` and `specula tune`.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use specula::bench::{self, BadLines, BenchReport, BenchSpec, DraftMethod, TuneInput};

use crate::generate::{load, write_json, DraftChoice, DrafterArgs, ModelArgs, SamplingArgs};

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompts file: JSON Lines, one {"prompt": "...", "id": "..."} per line (shared/prompts/*.jsonl).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Use only the first N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Skip malformed prompt lines (each is reported with its line number) instead of stopping.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Feed prompts as-is instead of applying the chat template.
    #[arg(long)]
    pub raw: bool,
    /// New tokens per run.
    #[arg(
        long,
        short = 'n',
        default_value_t = 128,
        allow_negative_numbers = true
    )]
    pub max_tokens: usize,
    /// The drafter of the speculative configurations; without one, only plain decoding runs.
    #[command(flatten)]
    pub drafter: DrafterArgs,
    /// Draft lengths to compare, comma separated [default: 1,2,3,4; with --speculate, 1 up to the length it
    /// picks when that is longer (5 for the registry head on a GPU); with EAGLE-3 tree flags none: given
    /// there, chains at these lengths run beside the trees].
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    pub draft_tokens: Vec<i64>,
    /// Passes over all prompts (more rounds average out noise).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub rounds: usize,
    /// Sampling (temperature 0 = greedy; greedy runs also check that speculation reproduces plain decoding).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Generate exactly --max-tokens per run (ignore end-of-turn tokens).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Repetitions per size of the verify(n) measurement (0 skips it).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true)]
    pub verify_repeats: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(clap::Args)]
pub struct TuneArgs {
    #[command(flatten)]
    pub bench: BenchArgs,
    /// Tune from a saved `specula bench --json` file instead of running the benchmark.
    #[arg(long)]
    pub from_bench: Option<PathBuf>,
    /// Write the plot (measured and predicted tok/s against k) here, as SVG.
    #[arg(long, default_value = "specula-tune.svg")]
    pub plot: PathBuf,
    /// Write the fitted model and predictions as JSON here.
    #[arg(long)]
    pub tune_json: Option<PathBuf>,
}

/// The drafter variants to compare: one per `--draft-vocab` and `--draft-confidence` pair (draft model) or
/// `--ngram-confidence` value (prompt lookup).
fn methods(args: &BenchArgs) -> anyhow::Result<Vec<DraftMethod>> {
    let d = &args.drafter;
    Ok(match d.choice()? {
        DraftChoice::None => Vec::new(),
        DraftChoice::Model(_) => {
            let confidences = d.draft_confidences()?;
            let mut out = Vec::new();
            for vocab_limit in d.draft_vocabs()? {
                for c in &confidences {
                    out.push(DraftMethod::Model {
                        vocab_limit,
                        min_confidence: c.unwrap_or(specula::draft::model::DEFAULT_MIN_CONFIDENCE),
                    });
                }
            }
            out
        }
        DraftChoice::Eagle3(dirs) => {
            let trees = d.eagle_trees()?.shapes;
            let mut out = Vec::new();
            for head in 0..eagle3_heads(&dirs)?.len() {
                if runs_chains(args) {
                    for min_confidence in d.eagle3_confidences(false)? {
                        out.push(DraftMethod::Eagle3 {
                            tree: None,
                            min_confidence,
                            head,
                        });
                    }
                }
                for &tree in &trees {
                    for min_confidence in d.eagle3_confidences(true)? {
                        out.push(DraftMethod::Eagle3 {
                            tree: Some(tree),
                            min_confidence,
                            head,
                        });
                    }
                }
            }
            out
        }
        DraftChoice::Ngram { min_n, max_n, .. } => d
            .ngram_confidences()?
            .into_iter()
            .map(|min_confidence| DraftMethod::Ngram {
                min_n,
                max_n,
                min_confidence,
            })
            .collect(),
    })
}

/// Whether the bench runs chains: always without tree flags; with them only where `--draft-tokens` is given
/// too (chains at those lengths beside the trees, in one table).
fn runs_chains(args: &BenchArgs) -> bool {
    !args.drafter.has_tree_flags() || !args.draft_tokens.is_empty()
}

/// The heads of `--draft eagle3 --draft-model A,B,...`: bench compares several side by side, each at every
/// setting (generate and serve take one).
fn eagle3_heads(draft_model: &str) -> anyhow::Result<Vec<&str>> {
    let heads: Vec<&str> = draft_model.split(',').map(str::trim).collect();
    if heads.iter().any(|h| h.is_empty()) {
        anyhow::bail!("--draft-model {draft_model:?} names an empty head");
    }
    Ok(heads)
}

fn draft_tokens(args: &BenchArgs) -> anyhow::Result<Vec<usize>> {
    let max = specula::decode::MAX_DRAFT_TOKENS as i64;
    let mut out = Vec::new();
    let given = if args.draft_tokens.is_empty() {
        default_draft_tokens(None)
    } else {
        args.draft_tokens.clone()
    };
    for &k in &given {
        if k < 1 || k > max {
            anyhow::bail!("--draft-tokens values must be between 1 and {max}, got {k}");
        }
        if !out.contains(&(k as usize)) {
            out.push(k as usize);
        }
    }
    out.sort_unstable();
    Ok(out)
}

pub fn run_bench(args: &BenchArgs) -> anyhow::Result<BenchReport> {
    let prompts_path = args
        .prompts
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("give a prompts file with --prompts FILE.jsonl"))?;
    let methods = methods(args)?;
    // Chain lengths; a tree's size is its node count (one configuration each).
    let ks = if runs_chains(args) {
        draft_tokens(args)?
    } else {
        Vec::new()
    };
    for skipped in args.drafter.eagle_trees()?.skipped {
        eprintln!("note: left out: {skipped}");
    }
    let sampling = args.sampling.params()?;
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    bench::check_repetitions(args.rounds, args.verify_repeats)?;
    let bad_lines = if args.skip_bad_lines {
        BadLines::Skip
    } else {
        BadLines::Stop
    };
    let (mut prompts, warnings) = bench::read_prompts(prompts_path, bad_lines)?;
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    if let Some(limit) = args.limit {
        if limit == 0 {
            anyhow::bail!("--limit must be at least 1");
        }
        prompts.truncate(limit);
    }
    let (target, threads, _) = load(&args.model)?;
    let uses_model = methods
        .iter()
        .any(|m| matches!(m, DraftMethod::Model { .. }));
    let draft = match (uses_model, &args.drafter.draft_model) {
        (true, Some(spec)) => {
            let d = specula::load_model_on(spec, args.model.device()?, true, &mut |line| {
                eprintln!("{line}")
            })
            .with_context(|| format!("loading draft model {spec}"))?;
            specula::draft::model::check_compatible(&target, &d)?;
            Some(d)
        }
        _ => None,
    };
    let eagle3 = match args.drafter.choice()? {
        DraftChoice::Eagle3(dirs) => eagle3_heads(&dirs)?
            .into_iter()
            .map(|dir| {
                // Tables name a head by its directory's last part (a registry name stays whole).
                let name = std::path::Path::new(dir)
                    .file_name()
                    .map_or(dir.to_string(), |n| n.to_string_lossy().into_owned());
                Ok((
                    name,
                    dir.to_string(),
                    crate::generate::load_eagle3(dir, &target)?,
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?,
        _ => Vec::new(),
    };
    let mut with_ids = Vec::new();
    for p in prompts {
        let text = target.format_prompt(&p.prompt, args.raw, None)?;
        let ids = target.tokenizer.encode(&text)?;
        with_ids.push((p, ids));
    }
    if let Some(longest) = with_ids.iter().map(|(_, ids)| ids.len()).max() {
        crate::generate::note_context_cap(target.model.as_ref(), longest, args.max_tokens);
    }
    let spec = BenchSpec {
        target: target.model.as_ref(),
        tokenizer: &target.tokenizer,
        draft: draft.as_ref().map(|d| d.model.as_ref()),
        eagle3: eagle3
            .iter()
            .map(|(name, source, head)| specula::bench::BenchHead {
                name: name.clone(),
                source: source.clone(),
                head,
            })
            .collect(),
        draft_tokens: if methods.iter().any(DraftMethod::is_chain) {
            ks
        } else {
            Vec::new()
        },
        methods,
        prompts: with_ids,
        max_new_tokens: args.max_tokens,
        rounds: args.rounds,
        sampling,
        stop_at_eos: !args.ignore_eos,
        verify_cost_repeats: args.verify_repeats,
        simulate_acceptance: args.drafter.simulate_acceptance,
    };
    eprintln!(
        "bench: target {} on {}{}, {} prompts x {} rounds x {} configs, {} new tokens, {} threads",
        target.spec,
        target.model.device(),
        draft
            .as_ref()
            .map(|d| format!(", draft {}", d.spec))
            .unwrap_or_default(),
        spec.prompts.len(),
        spec.rounds,
        bench::run::configs(&spec).len(),
        spec.max_new_tokens,
        threads
    );
    let show = !args.quiet && std::io::stderr().is_terminal();
    let start = Instant::now();
    let report = bench::run_bench(&spec, &mut |p| {
        if show {
            draw_progress(&p, start);
        }
    })?;
    if show {
        eprint!("\r{:100}\r", "");
    }
    eprintln!("bench finished in {:.1}s", start.elapsed().as_secs_f64());
    // Each configuration's head against what its training recorded (configs come in the report's order).
    for (c, config) in report.configs.iter().zip(bench::run::configs(&spec)) {
        let Some(DraftMethod::Eagle3 { head, .. }) = config.drafter else {
            continue;
        };
        if let Some(w) = eagle3.get(head).and_then(|(_, _, h)| {
            c.speculation
                .as_ref()
                .and_then(|s| specula::draft::eagle3::check::acceptance_warning(h, s))
        }) {
            eprintln!("warning ({}): {w}", c.label);
        }
    }
    Ok(report)
}

fn draw_progress(p: &bench::Progress<'_>, start: Instant) {
    let width = 30;
    let filled = (p.done * width).checked_div(p.total).unwrap_or(width);
    let elapsed = start.elapsed().as_secs_f64();
    let eta = if p.done > 0 {
        format!(
            "eta {:.0}s",
            elapsed / p.done as f64 * (p.total - p.done) as f64
        )
    } else {
        String::new()
    };
    let mut err = std::io::stderr().lock();
    let _ = write!(
        err,
        "\r[{}{}] {}/{} {} {} {:.0}s {}      ",
        "#".repeat(filled),
        "-".repeat(width - filled),
        p.done,
        p.total,
        p.config,
        p.prompt_id,
        elapsed,
        eta
    );
    let _ = err.flush();
}

/// The lengths bench compares where `--draft-tokens` is not given: 1-4, and up to the drafter's default length
/// (what `--speculate` picked) when that is longer, so the sweep holds what a user of that default gets.
fn default_draft_tokens(picked: Option<usize>) -> Vec<i64> {
    (1..=picked.unwrap_or(0).max(DEFAULT_MAX_DRAFT_TOKENS) as i64).collect()
}

const DEFAULT_MAX_DRAFT_TOKENS: usize = 4;

/// Fills in the draft lengths bench compares where `--draft-tokens` is not given (trees alone run no chains).
fn resolve_draft_tokens(args: &mut BenchArgs, picked: Option<usize>) {
    if args.draft_tokens.is_empty() && !args.drafter.has_tree_flags() {
        args.draft_tokens = default_draft_tokens(picked);
    }
}

pub fn bench(mut args: BenchArgs) -> anyhow::Result<()> {
    let picked = args.drafter.resolve_defaults(&args.model)?;
    resolve_draft_tokens(&mut args, picked);
    let report = run_bench(&args)?;
    print!("{}", report.table());
    if let Some(path) = &args.json {
        write_json(path, &report.to_json())?;
        eprintln!("results: {}", path.display());
    }
    Ok(())
}

pub fn tune(mut args: TuneArgs) -> anyhow::Result<()> {
    let picked = args.bench.drafter.resolve_defaults(&args.bench.model)?;
    resolve_draft_tokens(&mut args.bench, picked);
    let report_json = match &args.from_bench {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading bench results {}", path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not a bench JSON file", path.display()))?
        }
        None => {
            if args.bench.drafter.draft.is_none() && args.bench.drafter.draft_model.is_none() {
                anyhow::bail!(
                    "tune needs a drafter to tune: --draft-model PATH|NAME or --draft ngram (or --from-bench FILE)"
                );
            }
            let report = run_bench(&args.bench)?;
            print!("{}", report.table());
            let json = report.to_json();
            if let Some(path) = &args.bench.json {
                write_json(path, &json)?;
                eprintln!("bench results: {}", path.display());
            }
            json
        }
    };
    let input = TuneInput::from_bench_json(&report_json)?;
    let result = bench::tune(&input);
    println!();
    print!("{}", result.table());
    std::fs::write(&args.plot, result.plot_svg())
        .with_context(|| format!("writing plot {}", args.plot.display()))?;
    eprintln!("plot: {}", args.plot.display());
    if let Some(path) = &args.tune_json {
        write_json(path, &serde_json::to_value(&result)?)?;
        eprintln!("tune results: {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::default_draft_tokens;

    #[test]
    fn the_default_sweep_reaches_the_picked_length() {
        assert_eq!(default_draft_tokens(None), vec![1, 2, 3, 4]);
        assert_eq!(default_draft_tokens(Some(3)), vec![1, 2, 3, 4]);
        // The registry head on a GPU picks 5: the sweep holds what a user of `--speculate` gets.
        assert_eq!(default_draft_tokens(Some(5)), vec![1, 2, 3, 4, 5]);
    }
}
