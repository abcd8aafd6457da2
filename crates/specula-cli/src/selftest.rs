//! `specula selftest`: checks this machine's compute paths on a model and prints what ran and a verdict, so two
//! configurations (another CPU, `SPECULA_NO_VNNI=1`, a GPU) can be compared.
//!
//! On the CPU it runs the model over a prompt with logits for every position, prints the kernel paths in use and
//! a SHA-256 of all the logits (bitwise identical runs print the same digest, whatever the machine), and compares
//! every weight matrix's fast kernel with the reference kernel. With `--device cuda` it checks the GPU against
//! the CPU on the same weights (logits within bf16 tolerance, greedy tokens), and the GPU's own batch
//! invariance: a verify pass equal to single steps, a tree equal to its branches, a batch of sequences equal to
//! each alone, all bitwise. It also times forward passes of 1..=9 rows (verify(n)).

use sha2::{Digest, Sha256};
use specula::decode::{generate, GenerateRequest};
use specula::model::forward::HostOutput;
use specula::model::{
    ForwardOptions, LoadedModel, LogitsFor, Model, SequenceCache, SequenceInput, TreeMask,
};
use specula::profile::Profiler;
use specula::sampling::SamplingParams;

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

/// One check's outcome.
struct Check {
    name: String,
    passed: bool,
    detail: String,
}

pub fn run(args: SelftestArgs) -> anyhow::Result<()> {
    let (loaded, threads, load_s) = crate::generate::load(&args.model)?;
    let mut tokens = loaded.tokenizer.encode(&args.prompt)?;
    tokens.retain(|&t| (t as usize) < loaded.model.config().vocab_size);
    if tokens.len() < 4 {
        anyhow::bail!("the prompt must be at least 4 tokens");
    }
    let model = loaded.model.as_ref();
    println!(
        "model {} ({}) on {}, {threads} threads, loaded in {load_s:.1}s",
        loaded.spec,
        model.weight_types(),
        model.device(),
    );
    let out = forward(model, &tokens, None, LogitsFor::All)?;
    let mut hasher = Sha256::new();
    for v in &out.logits.data {
        hasher.update(v.to_le_bytes());
    }
    let digest = format!("{:x}", hasher.finalize());
    println!(
        "forward over {} tokens: logits sha256 {digest}",
        tokens.len()
    );
    let mut checks = Vec::new();
    let kernel_checks = model.check_kernels(&tokens)?;
    for c in &kernel_checks {
        checks.push(Check {
            name: format!("kernel {} ({})", c.name, c.dtype),
            passed: c.max_relative_error <= c.tolerance,
            detail: format!(
                "max error {:.2e} of the reference's largest output (tolerance {:.0e})",
                c.max_relative_error, c.tolerance
            ),
        });
    }
    checks.extend(batch_invariance_checks(model, &tokens)?);
    let on_gpu = model.device() != "cpu";
    let mut cpu_tokens = None;
    if on_gpu && loaded.format != specula::model::Format::Random {
        let cpu = specula::model::load_path(&loaded.path, &loaded.spec)?;
        let (c, agreement) = against_cpu(&loaded, &cpu, &tokens)?;
        checks.extend(c);
        cpu_tokens = Some(agreement);
    }
    let timings = verify_timings(model, &tokens)?;
    let paths = specula::backend::cpu::kernels::active_kernel_paths();
    if !on_gpu {
        println!("kernel paths {}", paths.join("+"));
    }
    println!("{:<48} {:>6}  detail", "check", "result");
    for c in &checks {
        println!(
            "{:<48} {:>6}  {}",
            c.name,
            if c.passed { "ok" } else { "FAILED" },
            c.detail
        );
    }
    println!(
        "forward of n rows after {} tokens (median ms): {}",
        tokens.len(),
        timings
            .iter()
            .enumerate()
            .map(|(i, ms)| format!("{}:{ms:.3}", i + 1))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name.as_str())
        .collect();
    println!(
        "verdict: {}",
        if failed.is_empty() {
            "PASS".to_string()
        } else {
            format!("FAIL ({})", failed.join(", "))
        }
    );
    if let Some(path) = &args.json {
        let v = serde_json::json!({
            "model": loaded.spec,
            "device": model.device(),
            "threads": threads,
            "kernel_paths": paths,
            "prompt_tokens": tokens,
            "logits_sha256": digest,
            "greedy_next_tokens": out.logits.argmax(),
            "checks": checks.iter().map(|c| serde_json::json!({
                "check": c.name, "passed": c.passed, "detail": c.detail})).collect::<Vec<_>>(),
            "kernel_checks": kernel_checks.iter().map(|c| serde_json::json!({
                "matrix": c.name, "type": c.dtype, "max_relative_error": c.max_relative_error,
                "tolerance": c.tolerance})).collect::<Vec<_>>(),
            "greedy_tokens_vs_cpu": cpu_tokens,
            "forward_ms_by_rows": timings,
            "passed": failed.is_empty(),
        });
        crate::generate::write_json(path, &v)?;
    }
    if !failed.is_empty() {
        anyhow::bail!("self-test failed: {}", failed.join(", "));
    }
    Ok(())
}

trait Argmax {
    fn argmax(&self) -> Vec<u32>;
}

impl Argmax for specula::model::forward::HostRows {
    fn argmax(&self) -> Vec<u32> {
        (0..self.rows)
            .map(|r| specula::sampling::argmax(self.row(r)))
            .collect()
    }
}

fn forward(
    model: &dyn Model,
    tokens: &[u32],
    cache: Option<&mut dyn SequenceCache>,
    logits: LogitsFor,
) -> anyhow::Result<HostOutput> {
    let mut own;
    let cache = match cache {
        Some(c) => c,
        None => {
            own = model.new_cache(tokens.len() + 64)?;
            own.as_mut()
        }
    };
    Ok(model
        .forward_one(
            tokens,
            cache,
            &ForwardOptions::default(),
            logits,
            &Profiler::disabled(),
        )?
        .to_host()?)
}

fn bitwise(name: &str, a: &[f32], b: &[f32]) -> Check {
    let differ = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    Check {
        name: name.to_string(),
        passed: a.len() == b.len() && differ == 0,
        detail: if a.len() != b.len() {
            format!("{} values against {}", a.len(), b.len())
        } else {
            format!("{differ} of {} values differ", a.len())
        },
    }
}

/// A verify pass equals single steps; a tree equals its branches; a batch equals each sequence alone; columns
/// gathered where the logits live (EAGLE-3 training) equal the same columns copied whole.
fn batch_invariance_checks(model: &dyn Model, tokens: &[u32]) -> anyhow::Result<Vec<Check>> {
    let split = tokens.len() - 3;
    let (prefix, rest) = tokens.split_at(split);
    let mut checks = Vec::new();
    let mut cache = model.new_cache(tokens.len() + 8)?;
    let out = model.forward_one(
        tokens,
        cache.as_mut(),
        &ForwardOptions::default(),
        LogitsFor::All,
        &Profiler::disabled(),
    )?;
    let width = out.logits.cols();
    // Scattered, descending, repeated and last columns.
    let mut cols: Vec<u32> = (0..width as u32).rev().step_by(7).collect();
    cols.extend([0, 0, width as u32 - 1]);
    let gathered = out.logits.gather_columns(&cols)?;
    let whole = out.logits.to_host()?;
    let expected: Vec<f32> = (0..out.logits.rows())
        .flat_map(|r| cols.iter().map(move |&c| (r, c as usize)))
        .map(|(r, c)| whole[r * width + c])
        .collect();
    checks.push(bitwise(
        "logit columns gathered on the device = copied whole",
        &gathered,
        &expected,
    ));
    // Verify pass of 3 rows vs 3 single steps.
    let mut a = model.new_cache(tokens.len() + 8)?;
    forward(model, prefix, Some(a.as_mut()), LogitsFor::None)?;
    let verify = forward(model, rest, Some(a.as_mut()), LogitsFor::All)?;
    let mut b = model.new_cache(tokens.len() + 8)?;
    forward(model, prefix, Some(b.as_mut()), LogitsFor::None)?;
    let mut singles = Vec::new();
    for &t in rest {
        singles.extend(
            forward(model, &[t], Some(b.as_mut()), LogitsFor::All)?
                .logits
                .data,
        );
    }
    checks.push(bitwise(
        "verify of 3 rows = 3 single steps",
        &verify.logits.data,
        &singles,
    ));
    // A tree: root, two children, a grandchild under the first; each row equals its branch as a chain.
    let tree_tokens = [rest[0], rest[1], rest[2], rest[1]];
    let tree = TreeMask::new(vec![None, Some(0), Some(0), Some(1)])?;
    let mut c = model.new_cache(tokens.len() + 8)?;
    forward(model, prefix, Some(c.as_mut()), LogitsFor::None)?;
    let tree_out = {
        let mut batch = [SequenceInput {
            tokens: &tree_tokens,
            cache: c.as_mut(),
            logits: LogitsFor::All,
            tree: Some(&tree),
        }];
        model.forward(
            &mut batch,
            &ForwardOptions::default(),
            &Profiler::disabled(),
        )?[0]
            .to_host()?
    };
    let mut branch_rows = Vec::new();
    let mut tree_rows = Vec::new();
    for branch in [&[0usize, 1, 3][..], &[0, 2]] {
        let mut d = model.new_cache(tokens.len() + 8)?;
        forward(model, prefix, Some(d.as_mut()), LogitsFor::None)?;
        let chain: Vec<u32> = branch.iter().map(|&r| tree_tokens[r]).collect();
        let out = forward(model, &chain, Some(d.as_mut()), LogitsFor::All)?;
        for (i, &r) in branch.iter().enumerate() {
            branch_rows.extend_from_slice(out.logits.row(i));
            tree_rows.extend_from_slice(tree_out.logits.row(r));
        }
    }
    checks.push(bitwise(
        "tree verify = its branches as chains",
        &tree_rows,
        &branch_rows,
    ));
    // Two sequences in one pass vs each alone.
    let (s1, s2) = (&tokens[..split], &tokens[1..]);
    let alone: Vec<f32> = [s1, s2]
        .iter()
        .flat_map(|s| forward(model, s, None, LogitsFor::All).map(|o| o.logits.data))
        .flatten()
        .collect();
    let mut caches = [
        model.new_cache(tokens.len() + 8)?,
        model.new_cache(tokens.len() + 8)?,
    ];
    let [c1, c2] = &mut caches;
    let mut batch = [
        SequenceInput {
            tokens: s1,
            cache: c1.as_mut(),
            logits: LogitsFor::All,
            tree: None,
        },
        SequenceInput {
            tokens: s2,
            cache: c2.as_mut(),
            logits: LogitsFor::All,
            tree: None,
        },
    ];
    let together: Vec<f32> = model
        .forward(
            &mut batch,
            &ForwardOptions::default(),
            &Profiler::disabled(),
        )?
        .iter()
        .map(|o| o.to_host().map(|h| h.logits.data))
        .collect::<Result<Vec<_>, _>>()?
        .concat();
    checks.push(bitwise(
        "two sequences batched = each alone",
        &together,
        &alone,
    ));
    Ok(checks)
}

/// The GPU against the CPU on the same weights: logits within the GPU's bf16 tolerance, and greedy tokens.
/// Returns the checks and (agreeing tokens, tokens compared) of a 32-token greedy generation.
fn against_cpu(
    gpu: &LoadedModel,
    cpu: &LoadedModel,
    tokens: &[u32],
) -> anyhow::Result<(Vec<Check>, (usize, usize))> {
    let g = forward(gpu.model.as_ref(), tokens, None, LogitsFor::All)?;
    let c = forward(cpu.model.as_ref(), tokens, None, LogitsFor::All)?;
    let scale = c
        .logits
        .data
        .iter()
        .fold(0f32, |a, v| a.max(v.abs()))
        .max(1e-30);
    let worst = g
        .logits
        .data
        .iter()
        .zip(&c.logits.data)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let (norm_diff, norm) = g
        .logits
        .data
        .iter()
        .zip(&c.logits.data)
        .fold((0f64, 0f64), |(d, n), (a, b)| {
            (d + ((a - b) as f64).powi(2), n + (*b as f64).powi(2))
        });
    let relative = (norm_diff / norm.max(1e-30)).sqrt();
    // bf16 weights against the CPU's own storage: relative L2 error of a few 1e-3 is bf16 rounding.
    let tolerance = 2e-2;
    let mut checks = vec![Check {
        name: "logits vs CPU (relative L2 error)".into(),
        passed: relative <= tolerance,
        detail: format!(
            "{relative:.2e} (tolerance {tolerance:.0e}); max |diff| {worst:.3} of max |logit| {scale:.2}"
        ),
    }];
    // Embedding rows as an EAGLE-3 head reads them (the GPU's come from its bf16 table).
    let (ge, ce) = (
        gpu.model.embed_tokens(tokens)?,
        cpu.model.embed_tokens(tokens)?,
    );
    let embed_worst = ge
        .iter()
        .zip(&ce)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
        .fold(0f32, f32::max);
    checks.push(Check {
        name: "embedding rows vs CPU (EAGLE-3 heads read them)".into(),
        // bf16 keeps 8 significant bits: a relative error up to 2^-8 is rounding.
        passed: ge.len() == ce.len() && embed_worst <= 1.0 / 128.0,
        detail: format!(
            "{} values, worst relative error {embed_worst:.1e} (bf16 rounding: <= 7.8e-3)",
            ge.len()
        ),
    });
    let (ga, ca) = (g.logits.argmax(), c.logits.argmax());
    let same = ga.iter().zip(&ca).filter(|(a, b)| a == b).count();
    checks.push(Check {
        name: "argmax of every prompt row vs CPU".into(),
        passed: same + same / 10 + 1 >= ga.len(),
        detail: format!("{same} of {} rows agree", ga.len()),
    });
    let req = GenerateRequest {
        prompt_tokens: tokens.to_vec(),
        max_new_tokens: 32,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
    };
    let run = |m: &LoadedModel| {
        generate(
            m.model.as_ref(),
            &m.tokenizer,
            &req,
            None,
            &Profiler::disabled(),
            &mut |_| {},
        )
    };
    let (gt, ct) = (run(gpu)?.tokens, run(cpu)?.tokens);
    let agree = gt.iter().zip(&ct).take_while(|(a, b)| a == b).count();
    println!(
        "greedy generation: GPU and CPU agree on the first {agree} of {} tokens (bf16 weights on the GPU: a \
         near-tie may part them)",
        gt.len().max(ct.len())
    );
    Ok((checks, (agree, gt.len())))
}

/// Median forward time over 1..=9 rows after the prompt (a verify pass of k = 0..8), as bench measures it.
fn verify_timings(model: &dyn Model, tokens: &[u32]) -> anyhow::Result<Vec<f64>> {
    Ok(specula::bench::measure_verify_cost(model, tokens, 9, 5)?.ms)
}
