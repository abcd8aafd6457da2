//! `specula train-eagle3`: trains an EAGLE-3 head for a target and writes it in the published layout.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use specula::draft::eagle3::train::{self, data, TrainOptions, TrainingText};

use crate::generate::{load, write_json, ModelArgs};

#[derive(clap::Args)]
pub struct TrainEagle3Args {
    /// The target model the head drafts for (-m/--model or --target).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Output directory: the head (config.json, model.safetensors), its checkpoint and training data.
    #[arg(long)]
    pub out: PathBuf,
    /// Instruction prompts (JSON Lines, {"prompt": ...}) the target answers itself (self-distillation: the
    /// best data for a small budget). Repeatable.
    #[arg(long)]
    pub prompts: Vec<PathBuf>,
    /// Text files or directories (source code, prose) to train on as-is. Repeatable.
    #[arg(long)]
    pub corpus: Vec<PathBuf>,
    /// Most tokens taken from the corpus.
    #[arg(long, default_value_t = 200_000)]
    pub corpus_tokens: usize,
    /// Most tokens of each self-distilled answer.
    #[arg(long, default_value_t = 256)]
    pub answer_tokens: usize,
    /// Tokens per training sequence (corpus chunks; prompt + answer at most this).
    #[arg(long, default_value_t = 384)]
    pub seq_len: usize,
    /// Tokens the head can propose (most frequent in the data; d2t maps them to target ids). With --init-head a
    /// larger value grows that head's vocabulary by the data's most frequent tokens it lacks (its rows kept, the
    /// new ones starting from the target's embedding when tied); a smaller one keeps the head's.
    #[arg(long, default_value_t = 8192)]
    pub draft_vocab: usize,
    /// Unrolled training-time-test steps (SpecForge uses 7).
    #[arg(long, default_value_t = 4)]
    pub ttt_steps: usize,
    #[arg(long, default_value_t = 2)]
    pub epochs: usize,
    /// Sequences per optimizer step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Sequences per forward/backward graph (default: the whole batch on a GPU, where one sequence's graph is
    /// launch-bound; one on the CPU); smaller needs less memory and gives the same gradients.
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Draft tokens of the target's distribution kept per position (the soft targets; renormalized).
    #[arg(long, default_value_t = 32)]
    pub top_k: usize,
    /// Memory (GB) for the target's outputs kept between epochs; beyond it they are recomputed each epoch.
    #[arg(long, default_value_t = 4.0)]
    pub cache_gb: f64,
    /// Training sequences whose target passes run ahead on a second thread while the head trains (default: 4
    /// when the target runs on a GPU, 0 on the CPU, where both would share the same cores).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Peak learning rate (AdamW; warmup, then cosine decay).
    #[arg(long, default_value_t = 5e-4)]
    pub lr: f64,
    /// Target layers the head reads, e.g. 1,14,26 ("output of layer" ids); default [1, n/2 - 1, n - 4].
    #[arg(long, value_delimiter = ',')]
    pub aux_layers: Option<Vec<usize>>,
    /// The head's MLP width (default: the target's).
    #[arg(long)]
    pub intermediate_size: Option<usize>,
    /// Stop after this many minutes (a checkpoint and a usable head are written).
    #[arg(long, allow_negative_numbers = true)]
    pub max_minutes: Option<f64>,
    /// Continue the checkpoint and data in --out.
    #[arg(long)]
    pub resume: bool,
    /// Start from this head's weights and draft vocabulary (a head specula trained, e.g. on other data; the
    /// same target layers and MLP width) instead of random ones: more data for a head without starting over
    /// (--draft-vocab may grow its vocabulary).
    #[arg(long)]
    pub init_head: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Only gather the training data (self-distilled answers, corpus chunks) into --out/data.jsonl and stop;
    /// a later run with --resume trains on it.
    #[arg(long)]
    pub data_only: bool,
    /// Where the head trains: cpu, cuda or cuda:N (default: where the target runs, --device). The GPU needs a
    /// build with the train-cuda feature (scripts/build-train-cuda.sh).
    #[arg(long)]
    pub train_device: Option<String>,
    /// Prompts the target answers at once during self-distillation (one batched forward pass a token).
    #[arg(long, default_value_t = 16)]
    pub answer_batch: usize,
    /// Write the training report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(args: TrainEagle3Args) -> anyhow::Result<()> {
    if args.seq_len < 8 || args.seq_len > 8192 {
        anyhow::bail!("--seq-len must be between 8 and 8192, got {}", args.seq_len);
    }
    if args.answer_tokens == 0 {
        anyhow::bail!("--answer-tokens must be at least 1");
    }
    if let Some(m) = args.max_minutes {
        if !(m > 0.0 && m.is_finite()) {
            anyhow::bail!("--max-minutes must be a positive number of minutes, got {m}");
        }
    }
    if args.answer_batch == 0 || args.answer_batch > 1024 {
        anyhow::bail!(
            "--answer-batch must be between 1 and 1024, got {}",
            args.answer_batch
        );
    }
    let train_device: specula::backend::Device = match &args.train_device {
        Some(d) => d.parse()?,
        None => args.model.device()?,
    };
    let device = train::training_device(train_device)?;
    let opts = TrainOptions {
        out: args.out.clone(),
        draft_vocab: args.draft_vocab,
        ttt_steps: args.ttt_steps,
        epochs: args.epochs,
        batch: args.batch,
        micro_batch: args.micro_batch,
        lr: args.lr,
        seed: args.seed,
        aux_layers: args.aux_layers.clone(),
        intermediate_size: args.intermediate_size,
        max_time: args.max_minutes.map(|m| Duration::from_secs_f64(m * 60.0)),
        resume: args.resume,
        init_head: args.init_head.clone(),
        top_k: args.top_k,
        cache_bytes: (args.cache_gb.clamp(0.0, 1e6) * 1e9) as usize,
        prefetch: args.prefetch.unwrap_or(match args.model.device()? {
            specula::backend::Device::Cpu => 0,
            _ => 4,
        }),
        device,
        ..Default::default()
    };
    opts.validate()?;
    let data_path = args.out.join("data.jsonl");
    if !args.resume && args.out.join("checkpoint").join("state.json").exists() {
        anyhow::bail!(
            "{} holds a checkpoint: pass --resume to continue it, or choose another --out",
            args.out.display()
        );
    }
    let mut prompts = Vec::new();
    for p in &args.prompts {
        let (list, warnings) = specula::bench::read_prompts(p, specula::bench::BadLines::Stop)?;
        for w in warnings {
            eprintln!("warning: {w}");
        }
        prompts.extend(list.into_iter().map(|b| (b.id, b.prompt)));
    }
    let files = data::corpus_files(&args.corpus)?;
    if !(args.resume && data_path.exists()) && prompts.is_empty() && files.is_empty() {
        anyhow::bail!("no training data: give instruction prompts (--prompts FILE) or a corpus (--corpus PATH)");
    }
    let (target, _, _) = load(&args.model)?;
    // Checked before any data is gathered (self-distillation takes minutes).
    let layers = train::target_layers(target.model.config(), args.aux_layers.as_deref())?;
    eprintln!(
        "target {} on {}: the head reads layers {layers:?} and trains on {train_device}",
        target.spec,
        target.model.device()
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let texts: Vec<TrainingText> = if args.resume && data_path.exists() {
        let texts = data::read_texts(&data_path)?;
        eprintln!(
            "data: {} sequences from {}",
            texts.len(),
            data_path.display()
        );
        texts
    } else {
        let mut texts = data::self_distilled_texts(
            &target,
            &prompts,
            args.answer_tokens,
            args.seq_len,
            args.answer_batch,
            &mut |i, n, id| {
                eprint!("\rself-distillation: {i}/{n} answers {id:<24}");
                let _ = std::io::stderr().flush();
            },
        )?;
        if !prompts.is_empty() {
            eprintln!();
        }
        let answers = texts.len();
        texts.extend(data::corpus_texts(
            &target,
            &files,
            args.seq_len,
            args.corpus_tokens,
        )?);
        let tokens: usize = texts.iter().map(|t| t.tokens.len()).sum();
        eprintln!(
            "data: {answers} self-distilled answers and {} corpus chunks, {tokens} tokens ({})",
            texts.len() - answers,
            data_path.display()
        );
        data::write_texts(&data_path, &texts)?;
        texts
    };
    if args.data_only {
        return Ok(());
    }
    let started = std::time::Instant::now();
    let report = train::train(&target, &texts, &opts, &mut |p| {
        let acc: Vec<String> = p
            .step_accuracy
            .iter()
            .map(|a| format!("{:.0}", a * 100.0))
            .collect();
        let done = p.step as f64 / p.total_steps.max(1) as f64;
        let width = 24;
        let filled = (done * width as f64).round() as usize;
        eprint!(
            "\r[{}{}] step {}/{} epoch {} loss {:.3} acc/step % [{}] {:.0} tok/s lr {:.1e} {:.0}s \
             (target {:.0}s fwd {:.0}s bwd {:.0}s opt {:.0}s) ",
            "#".repeat(filled.min(width)),
            "-".repeat(width - filled.min(width)),
            p.step,
            p.total_steps,
            p.epoch + 1,
            p.loss,
            acc.join(" "),
            p.tokens_per_s,
            p.lr,
            started.elapsed().as_secs_f64(),
            p.phase_s[0],
            p.phase_s[1],
            p.phase_s[2],
            p.phase_s[3],
        );
        let _ = std::io::stderr().flush();
    })?;
    eprintln!();
    let pct = |v: &[f64]| {
        v.iter()
            .map(|a| format!("{:.1}%", a * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "head: {} ({} parameters, {:.1} MB bf16, sha256 {})",
        report.out.display(),
        report.parameters,
        report.head_bytes as f64 / 1e6,
        report.head_sha256
    );
    println!(
        "trained {} of {} steps{} on {} sequences ({} tokens seen) in {:.0} s; target layers {:?}; draft vocabulary \
         {} ({:.1}% of answer tokens)",
        report.steps,
        report.total_steps,
        if report.stopped_early {
            " (stopped at --max-minutes)"
        } else {
            ""
        },
        report.train_sequences,
        report.tokens_trained,
        report.wall_s,
        report.target_layers,
        report.draft_vocab,
        report.coverage * 100.0
    );
    if let Some(note) = vocab_note(
        args.draft_vocab,
        report.draft_vocab,
        args.init_head.is_some(),
    ) {
        println!("{note}");
    }
    println!(
        "held-out accuracy per unrolled step ({} sequences): {} (untrained: {})",
        report.eval_sequences,
        pct(&report.eval_accuracy),
        pct(&report.initial_eval_accuracy)
    );
    let tp = &report.target_passes;
    println!(
        "target passes: {} in {:.1} s (forward and feature readback {:.1} s, logits {:.1} s, host {:.1} s), \
         training tensors {:.1} s",
        tp.passes,
        tp.forward_s + tp.logits_s + tp.host_s,
        tp.forward_s,
        tp.logits_s,
        tp.host_s,
        tp.tensors_s
    );
    if let Some(path) = &args.json {
        write_json(path, &serde_json::to_value(&report)?)?;
        eprintln!("report: {}", path.display());
    }
    Ok(())
}

/// Why the trained head's draft vocabulary differs from `--draft-vocab`, if it does: a run must not quietly give a
/// size other than the one asked for.
fn vocab_note(asked: usize, got: usize, init_head: bool) -> Option<String> {
    if asked == got {
        return None;
    }
    let why = if init_head && got > asked {
        "--init-head's vocabulary is larger, and a head's vocabulary only grows"
    } else if got < asked {
        "the data hold fewer distinct tokens, or the resumed checkpoint has fewer"
    } else {
        "the resumed checkpoint was trained with it"
    };
    Some(format!(
        "note: the head's draft vocabulary is {got} tokens, not --draft-vocab {asked}: {why}"
    ))
}

#[cfg(test)]
mod vocab_note_tests {
    use super::vocab_note;

    #[test]
    fn a_vocabulary_other_than_the_one_asked_for_is_explained() {
        assert_eq!(vocab_note(8192, 8192, true), None);
        let grown_head = vocab_note(8192, 16384, true).expect("a note");
        assert!(
            grown_head.contains("16384 tokens, not --draft-vocab 8192"),
            "{grown_head}"
        );
        assert!(grown_head.contains("only grows"), "{grown_head}");
        assert!(vocab_note(4096, 900, false)
            .expect("a note")
            .contains("fewer distinct tokens"));
        assert!(vocab_note(1024, 2048, false)
            .expect("a note")
            .contains("resumed checkpoint"));
    }
}
