//! `specula serve`: the OpenAI-compatible server (crates/specula-server).

use std::sync::Arc;

use anyhow::Context;
use specula_server::engine::{DraftSetup, Engine};
use specula_server::{AppState, Limits};

use crate::generate::{load, DraftChoice, DrafterArgs, ModelArgs};

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub drafter: DrafterArgs,
    /// Draft tokens per cycle (default 3 for a draft model or an EAGLE-3 chain, 8 for prompt lookup).
    #[arg(long)]
    pub draft_tokens: Option<usize>,
    /// Address to bind (127.0.0.1: this machine only).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every API request.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait for the engine; past it, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Where POST /stop_profile writes its Chrome trace and JSON report.
    #[arg(long, default_value = "specula-profiles")]
    pub profile_dir: std::path::PathBuf,
    /// The most new tokens one request may ask for.
    #[arg(long, default_value_t = 8192)]
    pub max_tokens_limit: usize,
}

pub fn run(mut args: ServeArgs) -> anyhow::Result<()> {
    args.model.device()?;
    if let Some(k) = args.drafter.resolve_speculate(&args.model)? {
        args.draft_tokens.get_or_insert(k);
    }
    let choice = args.drafter.single_choice()?;
    if args.drafter.simulate_acceptance.is_some() {
        anyhow::bail!("--simulate-acceptance is for generate and bench, not serve");
    }
    let tree = args.drafter.eagle_tree()?;
    if tree.is_some() && args.draft_tokens.is_some() {
        anyhow::bail!(
            "--draft-tokens and the tree flags both size the draft: give --num-draft-tokens for a tree"
        );
    }
    if args.max_queue == 0 || args.max_queue > 100_000 {
        anyhow::bail!(
            "--max-queue must be between 1 and 100000, got {}",
            args.max_queue
        );
    }
    let draft_tokens = match tree {
        Some(shape) => shape.draft_tokens,
        None => args.draft_tokens.unwrap_or(match choice {
            DraftChoice::Ngram { .. } => 8,
            _ => 3,
        }),
    };
    specula::decode::check_draft_tokens(draft_tokens)?;
    let (target, _, _) = load(&args.model)?;
    let draft = match &choice {
        DraftChoice::None => DraftSetup::None,
        DraftChoice::Ngram { .. } => DraftSetup::Ngram,
        DraftChoice::Model(spec) => {
            let d =
                specula::load_model_on(spec, args.model.device()?, true, &mut |l| eprintln!("{l}"))
                    .with_context(|| format!("loading draft model {spec}"))?;
            specula::draft::model::check_compatible(&target, &d)?;
            DraftSetup::Model(Box::new(d))
        }
        DraftChoice::Eagle3(dir) => {
            DraftSetup::Eagle3(Box::new(crate::generate::load_eagle3(dir, &target)?), tree)
        }
    };
    let name = target.spec.clone();
    let metrics = Arc::new(specula_server::metrics::Metrics::new());
    let engine = Engine::start(target, draft, draft_tokens, args.max_queue, metrics.clone());
    let state = Arc::new(AppState {
        engine,
        metrics,
        profile_dir: args.profile_dir.clone(),
        api_key: args.api_key.clone(),
        limits: Limits {
            max_tokens: args.max_tokens_limit,
            ..Limits::default()
        },
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        eprintln!(
            "serving {name} on http://{} (OpenAI API under /v1)",
            listener.local_addr()?
        );
        specula_server::serve(listener, state).await?;
        Ok(())
    })
}
