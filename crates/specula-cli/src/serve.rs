//! `specula serve`: the OpenAI-compatible server (crates/specula-server).

use std::sync::Arc;

use anyhow::Context;
use specula_server::engine::{DraftSetup, Engine, EngineOptions};
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
    /// The model's name in the API (vLLM's flag): responses carry the first, `/v1/models` lists them all, and a
    /// request's `model` may be any of them (repeat the flag). Default: the `--model` argument.
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// Requests that may wait for the engine; past it, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Where POST /stop_profile writes its Chrome trace and JSON report.
    #[arg(long, default_value = "specula-profiles")]
    pub profile_dir: std::path::PathBuf,
    /// The most new tokens one request may ask for.
    #[arg(long, default_value_t = 8192)]
    pub max_tokens_limit: usize,
    /// Requests decoded together (continuous batching: one forward pass serves them all).
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// KV cache memory the running requests may reserve together, e.g. 4GiB, 512MiB (each reserves room for
    /// its prompt plus max_tokens; a request that does not fit waits, one that never fits is refused).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub kv_memory: usize,
    /// Prompt tokens prefilled per engine step over all requests (long prompts enter in chunks, so running
    /// streams keep flowing).
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// How draft lengths are chosen when speculating: `adaptive` (each step, per request, from the measured cost
    /// of the batch's forward pass and the request's acceptance: fewer drafts as the batch grows, none where they
    /// do not pay) or `fixed` (always --draft-tokens).
    #[arg(long, default_value = "adaptive", value_parser = ["adaptive", "fixed"])]
    pub draft_policy: String,
    /// Seconds a request may take from queueing to its last token; past it, it ends with a timeout error (504).
    #[arg(long)]
    pub request_timeout: Option<f64>,
    /// Do not keep finished requests' KV caches for later prompts that start the same way (by default they stay
    /// in the KV memory running requests leave free, least recently used first out; `usage.prompt_tokens_details
    /// .cached_tokens` says how many prompt tokens a request reused).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// `N`: no request drafts while N or more are decoding, and a request admitted into a batch of N or more
    /// (itself included) never drafts (vLLM's `disable_by_batch_size`). `auto` (with the adaptive policy): a request admitted beside others gets
    /// no drafter where drafted steps have lately made no more tokens a second than undrafted ones at that many
    /// requests (every 8th still does, to keep measuring). `off`: the draft policy alone decides. Requests without
    /// a drafter capture no target features for an EAGLE-3 head, so steps made only of them cost what plain
    /// decoding's do.
    #[arg(long, default_value = "auto", value_parser = parse_disable_batch_size)]
    pub spec_disable_batch_size: DisableBatchSize,
}

/// `--spec-disable-batch-size`: a fixed cap, the measured one, or none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DisableBatchSize {
    At(usize),
    Auto,
    Off,
}

pub fn parse_disable_batch_size(text: &str) -> Result<DisableBatchSize, String> {
    match text.trim() {
        "auto" => Ok(DisableBatchSize::Auto),
        "off" => Ok(DisableBatchSize::Off),
        t => match t.parse::<usize>() {
            Ok(0) => Err(
                "must be at least 1 (1: never draft while anything decodes), auto or off".into(),
            ),
            Ok(n) => Ok(DisableBatchSize::At(n)),
            Err(_) => Err(format!("{t:?} is not a request count, auto or off")),
        },
    }
}

/// A size in bytes: a number with an optional unit (B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB as powers of 1000).
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4GiB, 512MiB, 1000000)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1048576.0,
        "gib" | "g" => 1073741824.0,
        "tib" | "t" => 1099511627776.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
            "unknown size unit {other:?} in {text:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
        ))
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 / 2.0 {
        return Err(format!("{text:?} is not a usable size"));
    }
    Ok(bytes as usize)
}

pub fn run(mut args: ServeArgs) -> anyhow::Result<()> {
    args.model.device()?;
    if let Some(k) = args.drafter.resolve_defaults(&args.model)? {
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
    for (i, n) in args.served_model_name.iter().enumerate() {
        if n.trim().is_empty() {
            anyhow::bail!("--served-model-name must not be empty");
        }
        if args.served_model_name[..i].contains(n) {
            anyhow::bail!("--served-model-name {n:?} is given twice");
        }
    }
    if args.max_queue == 0 || args.max_queue > 100_000 {
        anyhow::bail!(
            "--max-queue must be between 1 and 100000, got {}",
            args.max_queue
        );
    }
    if args.max_batch == 0 || args.max_batch > 1024 {
        anyhow::bail!(
            "--max-batch must be between 1 and 1024, got {}",
            args.max_batch
        );
    }
    if matches!(args.spec_disable_batch_size, DisableBatchSize::At(_))
        && matches!(choice, DraftChoice::None)
    {
        anyhow::bail!(
            "--spec-disable-batch-size needs a drafter (--draft-model, --draft ngram or --speculate)"
        );
    }
    if args.prefill_chunk == 0 {
        anyhow::bail!("--prefill-chunk must be at least 1 token");
    }
    let request_timeout = match args.request_timeout {
        None => None,
        Some(t) if t.is_finite() && t > 0.0 && t <= 1e7 => {
            Some(std::time::Duration::from_secs_f64(t))
        }
        Some(t) => anyhow::bail!("--request-timeout must be a positive number of seconds, got {t}"),
    };
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
        DraftChoice::Ngram {
            min_n,
            max_n,
            min_confidence,
        } => DraftSetup::Ngram(specula_server::engine::NgramSettings {
            min_n: *min_n,
            max_n: *max_n,
            min_confidence: *min_confidence,
        }),
        DraftChoice::Model(spec) => {
            let d =
                specula::load_model_on(spec, args.model.device()?, true, &mut |l| eprintln!("{l}"))
                    .with_context(|| format!("loading draft model {spec}"))?;
            specula::draft::model::check_compatible(&target, &d)?;
            let vocab_limit = args.drafter.draft_vocabs()?.first().copied().flatten();
            specula::draft::model::check_vocab_limit(d.model.as_ref(), vocab_limit)?;
            let bar = args
                .drafter
                .draft_confidences()?
                .first()
                .copied()
                .flatten()
                .unwrap_or(specula::draft::model::DEFAULT_MIN_CONFIDENCE);
            DraftSetup::Model(Box::new(d), vocab_limit, bar)
        }
        DraftChoice::Eagle3(dir) => {
            let bar = args
                .drafter
                .eagle3_confidences(tree.is_some())?
                .first()
                .copied()
                .unwrap_or(specula::draft::eagle3::DEFAULT_MIN_CONFIDENCE);
            DraftSetup::Eagle3(
                Box::new(crate::generate::load_eagle3(dir, &target)?),
                tree,
                bar,
            )
        }
    };
    let name = args
        .served_model_name
        .first()
        .cloned()
        .unwrap_or_else(|| target.spec.clone());
    let metrics = Arc::new(specula_server::metrics::Metrics::new());
    let options = EngineOptions {
        draft_tokens,
        max_queue: args.max_queue,
        max_batch: args.max_batch,
        kv_memory: args.kv_memory,
        prefill_chunk: args.prefill_chunk,
        request_timeout,
        adaptive_drafts: args.draft_policy == "adaptive",
        prefix_cache: !args.no_prefix_cache,
        overlap: None,
        spec_disable_batch_size: match args.spec_disable_batch_size {
            DisableBatchSize::At(n) => Some(n),
            _ => None,
        },
        spec_disable_auto: args.spec_disable_batch_size == DisableBatchSize::Auto,
    };
    let mut engine = Engine::start(target, draft, options, metrics.clone());
    if let Some((first, rest)) = args.served_model_name.split_first() {
        engine.model_name = first.clone();
        engine.model_aliases = rest.to_vec();
    }
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

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_disable_batch_size, DisableBatchSize};

    #[test]
    fn the_disabling_batch_size_is_a_count_auto_or_off() {
        assert_eq!(parse_disable_batch_size("8"), Ok(DisableBatchSize::At(8)));
        assert_eq!(parse_disable_batch_size("auto"), Ok(DisableBatchSize::Auto));
        assert_eq!(parse_disable_batch_size("off"), Ok(DisableBatchSize::Off));
        assert!(parse_disable_batch_size("0")
            .unwrap_err()
            .contains("at least 1"));
        assert!(parse_disable_batch_size("many")
            .unwrap_err()
            .contains("not a request count"));
    }

    #[test]
    fn sizes_parse_with_units_and_bad_ones_are_named() {
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5 GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert!(parse_bytes("4 parsecs")
            .unwrap_err()
            .contains("unknown size unit"));
        assert!(parse_bytes("lots").unwrap_err().contains("not a size"));
        assert!(parse_bytes("0").unwrap_err().contains("not a usable size"));
    }
}
