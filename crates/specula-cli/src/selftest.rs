//! `specula selftest`: checks this machine's compute paths on a real model and prints what ran, so two
//! configurations (another CPU, `SPECULA_NO_VNNI=1`, later another device) can be compared bitwise.
//!
//! It runs the model over a prompt with logits for every position, and
//! - prints the kernel paths in use and a SHA-256 of all the logits (bitwise identical runs print the same
//!   digest, whatever the machine),
//! - compares every weight matrix's matmul on those activations against the reference kernel (candle's
//!   one-row `vec_dot`), within float reassociation error, and fails if one is off.

use sha2::{Digest, Sha256};
use specula::model::{ForwardOptions, LogitsFor};
use specula::profile::Profiler;

use crate::generate::ModelArgs;

#[derive(clap::Args)]
pub struct SelftestArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text the forward pass runs over (fed raw).
    #[arg(
        long,
        short = 'p',
        default_value = "def quicksort(arr):\n    if len(arr) <= 1:"
    )]
    pub prompt: String,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

pub fn run(args: SelftestArgs) -> anyhow::Result<()> {
    let (loaded, threads, _) = crate::generate::load(&args.model)?;
    let tokens = loaded.tokenizer.encode(&args.prompt)?;
    if tokens.is_empty() {
        anyhow::bail!("the prompt is empty (0 tokens)");
    }
    let model = loaded.model.as_ref();
    let mut cache = model.new_cache(tokens.len())?;
    let out = model.forward_one(
        &tokens,
        cache.as_mut(),
        &ForwardOptions::default(),
        LogitsFor::All,
        &Profiler::disabled(),
    )?;
    let logits = out.logits.to_host()?;
    let mut hasher = Sha256::new();
    for v in logits.iter() {
        hasher.update(v.to_le_bytes());
    }
    let digest = format!("{:x}", hasher.finalize());
    let greedy = out.logits.argmax_rows()?;
    let checks = model.check_kernels(&tokens)?;
    let paths = specula::backend::cpu::kernels::active_kernel_paths();
    println!(
        "model {} ({}) on {}, {threads} threads, kernel paths {}",
        loaded.spec,
        model.weight_types(),
        model.device(),
        paths.join("+")
    );
    println!(
        "forward over {} tokens: logits sha256 {digest}",
        tokens.len()
    );
    println!(
        "{:<24} {:>8} {:>14} {:>10}",
        "matrix", "type", "max rel err", "result"
    );
    let mut failed = Vec::new();
    for c in &checks {
        let ok = c.max_relative_error <= c.tolerance;
        if !ok {
            failed.push(c.name.clone());
        }
        println!(
            "{:<24} {:>8} {:>14.2e} {:>10}",
            c.name,
            c.dtype,
            c.max_relative_error,
            if ok { "ok" } else { "FAILED" }
        );
    }
    if let Some(path) = &args.json {
        let v = serde_json::json!({
            "model": loaded.spec,
            "device": model.device(),
            "threads": threads,
            "kernel_paths": paths,
            "prompt_tokens": tokens,
            "logits_sha256": digest,
            "greedy_next_tokens": greedy,
            "kernel_checks": checks.iter().map(|c| serde_json::json!({
                "matrix": c.name, "type": c.dtype, "max_relative_error": c.max_relative_error,
                "tolerance": c.tolerance})).collect::<Vec<_>>(),
        });
        crate::generate::write_json(path, &v)?;
    }
    if !failed.is_empty() {
        anyhow::bail!(
            "kernels disagree with the reference on: {}",
            failed.join(", ")
        );
    }
    Ok(())
}
