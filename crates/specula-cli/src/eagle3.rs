//! `specula eagle3 check`: which target layers an EAGLE-3 head drafts best from.

use std::path::PathBuf;

use anyhow::Context;
use specula::draft::eagle3::check;

use crate::generate::{load, load_eagle3, write_json, ModelArgs};

#[derive(clap::Subcommand)]
pub enum Eagle3Command {
    /// Measure acceptance with the head's configured target layers and with neighbouring wirings (every id one
    /// lower and one higher, and each id moved by one), and say which wiring the head was trained for and what
    /// the configured one costs.
    Check(CheckArgs),
}

#[derive(clap::Args)]
pub struct CheckArgs {
    /// The target model (-m/--model or --target).
    #[command(flatten)]
    pub model: ModelArgs,
    /// The EAGLE-3 head directory (config.json + *.safetensors).
    #[arg(long)]
    pub head: String,
    /// Prompts file: JSON Lines, one {"prompt": "..."} per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Use only the first N prompts.
    #[arg(long, default_value_t = 8)]
    pub limit: usize,
    /// New tokens per prompt.
    #[arg(long, short = 'n', default_value_t = 64)]
    pub max_tokens: usize,
    /// Draft tokens per cycle.
    #[arg(long, default_value_t = 3)]
    pub draft_tokens: usize,
    /// Feed prompts as-is instead of applying the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(command: Eagle3Command) -> anyhow::Result<()> {
    match command {
        Eagle3Command::Check(args) => run_check(args),
    }
}

fn run_check(args: CheckArgs) -> anyhow::Result<()> {
    if args.limit == 0 || args.max_tokens == 0 {
        anyhow::bail!("--limit and --max-tokens must be at least 1");
    }
    specula::decode::check_draft_tokens(args.draft_tokens)?;
    let (prompts, warnings) =
        specula::bench::read_prompts(&args.prompts, specula::bench::BadLines::Stop)?;
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    let (target, _, _) = load(&args.model)?;
    let head = load_eagle3(&args.head, &target)?;
    let mut ids = Vec::new();
    for p in prompts.iter().take(args.limit) {
        let text = target.format_prompt(&p.prompt, args.raw, None)?;
        ids.push(target.tokenizer.encode(&text)?);
    }
    let results = check::check_wiring(
        target.model.as_ref(),
        &target.tokenizer,
        &head,
        &ids,
        args.max_tokens,
        args.draft_tokens,
        &mut |i, n, w| {
            eprintln!(
                "wiring {}/{n}: target layers {:?} ({})",
                i + 1,
                w.layers,
                w.label
            )
        },
    )
    .with_context(|| format!("checking the wiring of {}", args.head))?;
    print!("{}", check::report(&results));
    if let Some(path) = &args.json {
        let json: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "target_layers": r.wiring.layers,
                    "wiring": r.wiring.label,
                    "first_token_acceptance": r.first_token_acceptance(),
                    "acceptance_rate": r.stats.acceptance_rate(),
                    "mean_accept_len": r.stats.mean_accept_len(),
                    "speculation": r.stats.to_json(),
                })
            })
            .collect();
        write_json(
            path,
            &serde_json::json!({ "head": args.head, "wirings": json }),
        )?;
        eprintln!("results: {}", path.display());
    }
    Ok(())
}
