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
use specula::profile::{KernelTime, Profiler};
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
    /// On the CPU: also compare a quantized GGUF model's logits with an f32 reference of the same weights (4
    /// bytes a parameter of memory). With --device cuda the GPU is always checked against it.
    #[arg(long)]
    pub f32_reference: bool,
    /// Also check this EAGLE-3 head (a directory or registry name) placed on the model's device against the
    /// same head on the CPU: logits of fed rows, chain steps and tree rows within bf16 tolerance.
    #[arg(long)]
    pub eagle3_head: Option<String>,
    /// Time forward passes of 1 to this many rows (the verify(n) curve printed at the end).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u64).range(1..=512))]
    pub verify_rows: u64,
    /// Time forward passes of exactly these row counts instead of 1..=--verify-rows (e.g. `16,17`, to compare
    /// two shapes under a kernel profiler).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=512))]
    pub time_rows: Vec<u64>,
    /// Only time the forward passes: no checks and no verdict (for kernel profiling on a device).
    #[arg(long)]
    pub timings_only: bool,
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
    let sizes: Vec<usize> = if args.time_rows.is_empty() {
        (1..=args.verify_rows as usize).collect()
    } else {
        args.time_rows.iter().map(|&n| n as usize).collect()
    };
    if args.timings_only {
        let ms = specula::bench::measure_forward_ms(model, &tokens, &sizes, 5)?;
        print_timings(tokens.len(), &sizes, &ms);
        println!("verdict: not checked (--timings-only)");
        return Ok(());
    }
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
    checks.extend(request_options_checks(model, &loaded.tokenizer, &tokens)?);
    let on_gpu = model.device() != "cpu";
    let mut cpu_tokens = None;
    // Quantized checkpoints: the CPU's quantized kernels round activations to 8 bits, so they are not a
    // reference for the GPU's bf16 path; an f32 CPU model of the same weights is (4 bytes a parameter).
    // weight_types reads "Q4_K x 169, Q6_K x 29" (and ", as bf16" on the GPU): the storage types are the
    // "TYPE x COUNT" parts.
    let quantized = !model
        .weight_types()
        .split(", ")
        .filter(|t| t.contains(" x "))
        .all(|t| ["F32 ", "F16 ", "BF16 "].iter().any(|f| t.starts_with(f)));
    if on_gpu && loaded.format != specula::model::Format::Random {
        let cpu = specula::model::load_path(&loaded.path, &loaded.spec)?;
        let (c, agreement) = against_cpu(&loaded, &cpu, &tokens, !quantized)?;
        checks.extend(c);
        cpu_tokens = Some(agreement);
    }
    if (on_gpu || args.f32_reference) && quantized && loaded.format == specula::model::Format::Gguf
    {
        let reference = specula::model::load_gguf_reference(&loaded.path, &loaded.spec)?;
        let r = forward(reference.model.as_ref(), &tokens, None, LogitsFor::All)?;
        let m = forward(model, &tokens, None, LogitsFor::All)?;
        let (relative, worst, scale) = logits_distance(&m.logits.data, &r.logits.data);
        let same = m
            .logits
            .argmax()
            .iter()
            .zip(&r.logits.argmax())
            .filter(|(a, b)| a == b)
            .count();
        // Per row: where the distance sits (a prompt's first positions carry the largest activations).
        let vocab = model.config().vocab_size;
        let mut rows: Vec<(f64, usize)> = m
            .logits
            .data
            .chunks_exact(vocab)
            .zip(r.logits.data.chunks_exact(vocab))
            .enumerate()
            .map(|(i, (a, b))| (logits_distance(a, b).0, i))
            .collect();
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (median, (row_worst, row)) = (rows[rows.len() / 2].0, rows[rows.len() - 1]);
        let detail = format!(
            "{relative:.2e} (rows: median {median:.1e}, worst {row_worst:.1e} at position {row}); max |diff| \
             {worst:.3} of max |logit| {scale:.2}; argmax agrees on {same} of {} rows",
            tokens.len()
        );
        if on_gpu {
            checks.push(Check {
                name: "logits vs f32 reference (relative L2 error)".into(),
                passed: relative <= 2e-2,
                detail: format!("{detail} (tolerance 2e-2)"),
            });
        } else {
            // The CPU's quantized kernels against the same weights in f32: what 8-bit activations cost.
            println!("CPU quantized kernels vs the f32 reference (relative L2 error): {detail}");
        }
    }
    let mut head_timings = Vec::new();
    if let Some(dir) = &args.eagle3_head {
        let (c, t) = eagle3_head_checks(model, dir, &tokens)?;
        checks.extend(c);
        head_timings = t;
    }
    let timings = specula::bench::measure_forward_ms(model, &tokens, &sizes, 5)?;
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
    print_timings(tokens.len(), &sizes, &timings);
    for line in &head_timings {
        println!("{line}");
    }
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
            "forward_rows": sizes,
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

/// The largest absolute difference relative to the reference's largest magnitude, and whether the argmaxes agree.
fn relative_error(reference: &[f32], other: &[f32]) -> (f32, bool) {
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let worst = reference
        .iter()
        .zip(other)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    (
        worst / scale,
        specula::sampling::argmax(reference) == specula::sampling::argmax(other),
    )
}

/// The head placed on the model's device against the same head on the CPU, pass by pass: rows fed from the
/// target's features, a chain step from the last output, a two-row tree. Also what the placed head's passes cost
/// (lines to print).
fn eagle3_head_checks(
    model: &dyn Model,
    dir: &str,
    tokens: &[u32],
) -> anyhow::Result<(Vec<Check>, Vec<String>)> {
    use specula::draft::eagle3::{
        top_log_probs, Eagle3Head, HeadCompute, HeadInput, HeadPass, HeadPrecision, HeadRows,
        HeadWant, TreeRow,
    };
    let path = specula::registry::locate_head(dir)?;
    // A device twin as generate would place it (SPECULA_EAGLE3_WEIGHTS; as stored on the CPU), against the CPU
    // head holding the same values as f32 (a quantized head's dequantized ones).
    let precision = if model.device() == "cpu" {
        HeadPrecision::Stored
    } else {
        crate::generate::eagle3_precision()?
    };
    let cpu = Eagle3Head::load_as(&path, precision)?.dequantized();
    cpu.check_target(model.config())?;
    let mut placed = Eagle3Head::load_as(&path, precision)?;
    let device = placed.place_on(model)?;
    let layers = cpu.config.target_layers(model.config().num_layers)?;
    let (_, mats) = forward_captured(model, tokens, &layers, LogitsFor::Last)?;
    let h = model.config().hidden_size;
    let n = tokens.len() - 1;
    let mut features = Vec::new();
    for r in 0..n {
        for m in &mats {
            features.extend_from_slice(&m[r * h..(r + 1) * h]);
        }
    }
    let hh = cpu.config.layer.hidden_size;
    // The same passes on both; each returns its logits per pass, and a greedy chain step's top token.
    let full = HeadWant::default();
    // Each pass's values, the top-only step's (token, probability), and the tree rows' logits and top-k (as a
    // tree expands its nodes).
    type Passes = (Vec<Vec<f32>>, (u32, f32), Vec<Vec<(f32, usize)>>);
    let passes = |compute: &dyn HeadCompute| -> anyhow::Result<Passes> {
        let mut c = compute.new_cache(n + 16)?;
        let fed = compute.run(
            model,
            &tokens[1..],
            HeadInput::Features(&features),
            HeadRows::Chain,
            c.as_mut(),
            HeadWant {
                outputs: true,
                ..Default::default()
            },
        )?;
        let step = compute.run(
            model,
            &tokens[..1],
            HeadInput::Last,
            HeadRows::Chain,
            c.as_mut(),
            full,
        )?;
        // Fed from the step's output, at the same position again: its top token alone.
        c.truncate(n);
        let top = compute.run(
            model,
            &tokens[..1],
            HeadInput::Last,
            HeadRows::Chain,
            c.as_mut(),
            HeadWant {
                top_only: true,
                ..Default::default()
            },
        )?;
        c.truncate(n);
        let x = &fed.outputs[(n - 2) * hh..n * hh];
        let tree = [
            TreeRow {
                position: n,
                prefix: n,
                ancestors: vec![],
            },
            TreeRow {
                position: n + 1,
                prefix: n,
                ancestors: vec![n],
            },
        ];
        let t = compute.run(
            model,
            &tokens[..2],
            HeadInput::Hidden(x),
            HeadRows::Tree(&tree),
            c.as_mut(),
            full,
        )?;
        c.truncate(n);
        let ranked = compute.run(
            model,
            &tokens[..2],
            HeadInput::Hidden(x),
            HeadRows::Tree(&tree),
            c.as_mut(),
            HeadWant {
                top_k: TREE_TOP_K,
                ..Default::default()
            },
        )?;
        let top = top.top.first().copied().unwrap_or((u32::MAX, 0.0));
        Ok((
            vec![fed.outputs, fed.logits, step.logits, t.logits],
            top,
            ranked.ranked,
        ))
    };
    const TREE_TOP_K: usize = 4;
    let (reference, top_ref, _) = passes(&cpu)?;
    // A device head's padded pass shapes captured up front (as a server does): the passes below then replay them.
    let prepared = placed.compute().prepare_passes();
    let (other, top_other, ranked_other) = passes(placed.compute())?;
    // Sequences' passes at once (a server's requests drafting together) against each alone: fed rows of
    // different lengths, then one chain step each; more rows in all than a device head's batched pass takes (64),
    // so a round splits into several batched passes.
    let mut lens = vec![n, n - 1, 1];
    while lens.iter().sum::<usize>() <= 80 {
        lens.push(lens.len() % n + 1);
    }
    let width = 3 * cpu.config.target_hidden;
    let batched = |compute: &dyn HeadCompute| -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
        let want = HeadWant::default();
        let mut alone = Vec::new();
        for &len in &lens {
            let mut c = compute.new_cache(n + 16)?;
            let f = &features[..len * width];
            let fed = compute.run(
                model,
                &tokens[1..=len],
                HeadInput::Features(f),
                HeadRows::Chain,
                c.as_mut(),
                want,
            )?;
            let step = compute.run(
                model,
                &tokens[..1],
                HeadInput::Last,
                HeadRows::Chain,
                c.as_mut(),
                want,
            )?;
            alone.extend(fed.logits);
            alone.extend(step.logits);
        }
        let mut caches = lens
            .iter()
            .map(|_| compute.new_cache(n + 16))
            .collect::<specula::error::Result<Vec<_>>>()?;
        let mut fed_passes: Vec<HeadPass<'_>> = caches
            .iter_mut()
            .zip(&lens)
            .map(|(c, &len)| HeadPass {
                tokens: &tokens[1..=len],
                input: HeadInput::Features(&features[..len * width]),
                cache: c.as_mut(),
                want,
            })
            .collect();
        let fed = compute.run_many(model, &mut fed_passes)?;
        drop(fed_passes);
        let mut step_passes: Vec<HeadPass<'_>> = caches
            .iter_mut()
            .map(|c| HeadPass {
                tokens: &tokens[..1],
                input: HeadInput::Last,
                cache: c.as_mut(),
                want,
            })
            .collect();
        let steps = compute.run_many(model, &mut step_passes)?;
        let together = fed
            .into_iter()
            .zip(steps)
            .flat_map(|(a, b)| a.logits.into_iter().chain(b.logits))
            .collect();
        Ok((alone, together))
    };
    // With SPECULA_CUDA_HEAD_BATCH=0 a GPU's run_many is the loop: nothing to check.
    let batching =
        device == "cpu" || std::env::var("SPECULA_CUDA_HEAD_BATCH").map_or(true, |v| v != "0");
    let batched_check = if batching {
        let (alone, together) = batched(placed.compute())?;
        Some(bitwise(
            &format!(
                "eagle3 head on {device}: {} sequences' passes ({} fed rows) batched = each alone",
                lens.len(),
                lens.iter().sum::<usize>()
            ),
            &together,
            &alone,
        ))
    } else {
        None
    };
    // A device head reads the target's captured rows where they lie (the server's default): against the same
    // rows read to the host and uploaded, alone and batched beside a host-fed pass.
    let device_check = if placed.compute().reads_device_features() {
        Some(device_features_check(
            model,
            placed.compute(),
            tokens,
            &layers,
            &features,
            &device,
        )?)
    } else {
        None
    };
    let chain_check =
        device_chain_check(model, placed.compute(), &cpu, tokens, &features, &device)?;
    let chains_check =
        batched_chains_check(model, placed.compute(), &cpu, tokens, &features, &device)?;
    let timings = head_pass_timings(model, placed.compute(), &cpu, tokens, &features, &device)?;
    let names = [
        "outputs of fed rows",
        "logits of fed rows",
        "logits of a chain step",
        "logits of tree rows",
    ];
    let mut checks: Vec<Check> = batched_check
        .into_iter()
        .chain(device_check)
        .chain(chain_check)
        .chain(chains_check)
        .collect();
    checks.push(Check {
        name: format!("eagle3 head on {device}: pass shapes prepared before serving"),
        passed: prepared.is_ok(),
        detail: match &prepared {
            Ok(n) => format!("{n} captured"),
            Err(e) => e.to_string(),
        },
    });
    checks.push(Check {
        name: format!("eagle3 head on {device}: top token of a chain step"),
        passed: top_ref.0 == top_other.0 && (top_ref.1 - top_other.1).abs() <= 2e-2,
        detail: format!(
            "CPU token {} p {:.4}, {device} token {} p {:.4}",
            top_ref.0, top_ref.1, top_other.0, top_other.1
        ),
    });
    // The device's top-k of tree rows against the host's ranking of the same device logits.
    let dv = cpu.draft_vocab();
    let host_ranked: Vec<Vec<(f32, usize)>> = other[3]
        .chunks_exact(dv)
        .map(|row| top_log_probs(row, TREE_TOP_K))
        .collect();
    let same_ids = ranked_other.len() == host_ranked.len()
        && ranked_other
            .iter()
            .zip(&host_ranked)
            .all(|(a, b)| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.1 == y.1));
    let lp_err = ranked_other
        .iter()
        .flatten()
        .zip(host_ranked.iter().flatten())
        .map(|(a, b)| (a.0 - b.0).abs())
        .fold(0.0f32, f32::max);
    checks.push(Check {
        name: format!("eagle3 head on {device}: top-{TREE_TOP_K} of tree rows"),
        passed: same_ids && lp_err <= 1e-3,
        detail: format!(
            "ids {} the host's ranking of the same logits, log-probabilities within {lp_err:.1e} (tolerance 1e-3)",
            if same_ids { "equal" } else { "differ from" }
        ),
    });
    for ((name, a), b) in names.iter().zip(&reference).zip(&other) {
        let (err, same_top) = relative_error(a, b);
        checks.push(Check {
            name: format!("eagle3 head on {device}: {name}"),
            passed: a.len() == b.len()
                && err <= 2e-2
                && (same_top || *name == "outputs of fed rows"),
            detail: format!(
                "max error {err:.2e} of the CPU's largest value (tolerance 2e-2), argmax {}",
                if same_top { "agrees" } else { "differs" }
            ),
        });
    }
    Ok((checks, timings))
}

/// What the head's passes cost where it is placed, each the median of 51 runs by the host's clock (every run ends
/// reading its result back, so this is the latency a drafter sees): a chain step (one row from the last output,
/// its top token read back), a pass feeding the prompt's rows from features, and a chain of 4 draft tokens (the
/// fed pass and 3 steps) pass by pass and, where the head can, whole on the device.
fn head_pass_timings(
    model: &dyn Model,
    compute: &dyn specula::draft::eagle3::HeadCompute,
    head: &specula::draft::eagle3::Eagle3Head,
    tokens: &[u32],
    features: &[f32],
    device: &str,
) -> anyhow::Result<Vec<String>> {
    use specula::draft::eagle3::{greedy_chain_by_passes, HeadInput, HeadRows, HeadWant};
    let n = tokens.len() - 1;
    let top_only = HeadWant {
        top_only: true,
        ..Default::default()
    };
    let d2t = head.draft_to_target();
    let mut cache = compute.new_cache(n + 16)?;
    // Median microseconds of `run` (5 warm-up runs first: graph captures); None when it says it cannot run.
    let mut median_us = |run: &dyn Fn(&mut dyn SequenceCache) -> specula::error::Result<bool>| -> anyhow::Result<Option<f64>> {
        let mut us = Vec::with_capacity(51);
        for i in 0..56 {
            let t = std::time::Instant::now();
            if !run(cache.as_mut())? {
                return Ok(None);
            }
            if i >= 5 {
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        us.sort_by(f64::total_cmp);
        Ok(Some(us[us.len() / 2]))
    };
    let fed_us = median_us(&|c| {
        c.truncate(0);
        compute
            .run(
                model,
                &tokens[1..],
                HeadInput::Features(features),
                HeadRows::Chain,
                c,
                top_only,
            )
            .map(|_| true)
    })?;
    let step_us = median_us(&|c| {
        c.truncate(n);
        compute
            .run(
                model,
                &tokens[..1],
                HeadInput::Last,
                HeadRows::Chain,
                c,
                top_only,
            )
            .map(|_| true)
    })?;
    let by_passes_us = median_us(&|c| {
        c.truncate(0);
        greedy_chain_by_passes(
            compute,
            model,
            d2t,
            &tokens[1..],
            HeadInput::Features(features),
            c,
            3,
        )
        .map(|_| true)
    })?;
    let whole_us = median_us(&|c| {
        c.truncate(0);
        compute
            .run_greedy_chain(model, &tokens[1..], HeadInput::Features(features), c, 3)
            .map(|t| t.is_some())
    })?;
    // Where a chain step's and the target's decode and verify passes spend their time, kernel by kernel.
    let mut kernel_lines = Vec::new();
    let step = &mut || {
        cache.truncate(n);
        compute
            .run(
                model,
                &tokens[..1],
                HeadInput::Last,
                HeadRows::Chain,
                cache.as_mut(),
                top_only,
            )
            .map(|_| ())
    };
    if let Some(runs) = repeat_timed(KERNEL_RUNS, |w| compute.time_kernels(w), step)? {
        kernel_lines.push(kernel_line(
            &format!("eagle3 head on {device}: a chain step"),
            &runs,
            false,
        ));
    }
    let mut target_cache = model.new_cache(n + 16)?;
    forward(
        model,
        &tokens[..n],
        Some(target_cache.as_mut()),
        LogitsFor::None,
    )?;
    for rows in [1, 6] {
        let verify = &mut || {
            target_cache.truncate(n);
            model
                .forward_one(
                    &tokens[..rows],
                    target_cache.as_mut(),
                    &ForwardOptions::default(),
                    LogitsFor::All,
                    &Profiler::disabled(),
                )
                .map(|_| ())
        };
        if let Some(runs) = repeat_timed(KERNEL_RUNS, |w| model.time_kernels(w), verify)? {
            kernel_lines.push(kernel_line(
                &format!(
                    "target on {device}: a forward of {rows} row{}",
                    if rows == 1 { "" } else { "s" }
                ),
                &runs,
                true,
            ));
        }
    }
    let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1} us"));
    Ok(vec![
        format!(
            "eagle3 head on {device}, medians of 51 by the host's clock: a chain step {}, a pass feeding {n} rows {}{}",
            us(step_us),
            us(fed_us),
            if device == "cpu" {
                " (the checkpoint's precision; drafting on the CPU requantizes)"
            } else if std::env::var("SPECULA_CUDA_HEAD_FUSED").is_ok_and(|v| v == "0") {
                " (SPECULA_CUDA_HEAD_FUSED=0: a pass's inputs and final norm in 6 launches instead of 2)"
            } else if std::env::var("SPECULA_CUDA_HEAD_FOLD").is_ok_and(|v| v == "1") {
                " (SPECULA_CUDA_HEAD_FOLD=1: 1-3 launches fewer a pass)"
            } else if std::env::var("SPECULA_CUDA_HEAD_ONE_QKV").is_ok_and(|v| v == "0") {
                " (SPECULA_CUDA_HEAD_ONE_QKV=0: Q, K and V of each input half by their own GEMVs, 3 launches more)"
            } else {
                ""
            }
        ),
        format!(
            "eagle3 head on {device}: a chain of 4 draft tokens (that pass and 3 steps) pass by pass {}, whole on the \
             device {}",
            us(by_passes_us),
            match whole_us {
                Some(_) => us(whole_us),
                None if device == "cpu" => "- (a CPU head drafts pass by pass)".to_string(),
                None => "- (off: SPECULA_CUDA_HEAD_CHAIN=0)".to_string(),
            }
        ),
    ]
    .into_iter()
    .chain(kernel_lines)
    .collect())
}

/// Runs of `work` whose kernels [`kernel_line`] takes the medians of (after one untimed run).
const KERNEL_RUNS: usize = 21;

/// `work` run `runs` times under `timer` (a device's `time_kernels`), after one untimed run; None where the
/// device has no kernels to time.
fn repeat_timed(
    runs: usize,
    timer: impl Fn(
        &mut dyn FnMut() -> specula::error::Result<()>,
    ) -> specula::error::Result<Option<Vec<KernelTime>>>,
    work: &mut dyn FnMut() -> specula::error::Result<()>,
) -> anyhow::Result<Option<Vec<Vec<KernelTime>>>> {
    work()?;
    let mut all = Vec::with_capacity(runs);
    for _ in 0..runs {
        match timer(&mut *work)? {
            Some(times) => all.push(times),
            None => return Ok(None),
        }
    }
    Ok(Some(all))
}

/// "LABEL kernel by kernel (...): k1 [grid] 3.1 us, ... = total": each launch's median over the runs (launch by
/// launch where every run launched the same kernels, as a pass does), or with `by_kernel` each kernel's launches
/// summed (a target pass launches a few hundred) and listed dearest first.
fn kernel_line(label: &str, runs: &[Vec<KernelTime>], by_kernel: bool) -> String {
    let first = &runs[0];
    let same = runs
        .iter()
        .all(|r| r.len() == first.len() && r.iter().zip(first).all(|(a, b)| a.kernel == b.kernel));
    let medians: Vec<(String, f64)> = (0..first.len())
        .map(|i| {
            let name = format!(
                "{} [{}x{}x{}]",
                first[i].kernel, first[i].grid.0, first[i].grid.1, first[i].grid.2
            );
            let mut us: Vec<f64> = if same {
                runs.iter().map(|r| r[i].us).collect()
            } else {
                vec![first[i].us]
            };
            us.sort_by(f64::total_cmp);
            (name, us[us.len() / 2])
        })
        .collect();
    let total: f64 = medians.iter().map(|(_, us)| us).sum();
    let parts: Vec<String> = if by_kernel {
        let mut sums: Vec<(String, usize, f64)> = Vec::new();
        for ((_, us), launch) in medians.iter().zip(first) {
            match sums.iter_mut().find(|(k, _, _)| *k == launch.kernel) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 += us;
                }
                None => sums.push((launch.kernel.clone(), 1, *us)),
            }
        }
        sums.sort_by(|a, b| b.2.total_cmp(&a.2));
        sums.iter()
            .map(|(k, count, us)| format!("{k} x{count} {us:.1} us"))
            .collect()
    } else {
        medians
            .iter()
            .map(|(k, us)| format!("{k} {us:.1} us"))
            .collect()
    };
    format!(
        "{label} kernel by kernel (CUDA events around each launch, no graph: each alone, so more than the graphed \
         pass; medians of {}{}): {} = {total:.1} us",
        runs.len(),
        if same { "" } else { ", runs launched different kernels: the first run's" },
        parts.join(", ")
    )
}

/// A greedy chain run whole on the device (`run_greedy_chain`, no host round trip between passes) against the same
/// chain pass by pass: the same top tokens and probabilities, bit for bit, and a cache that drafts on the same
/// (the next pass's logits). None on a head that drafts pass by pass (the CPU's).
fn device_chain_check(
    model: &dyn Model,
    compute: &dyn specula::draft::eagle3::HeadCompute,
    head: &specula::draft::eagle3::Eagle3Head,
    tokens: &[u32],
    features: &[f32],
    device: &str,
) -> anyhow::Result<Option<Check>> {
    use specula::draft::eagle3::{greedy_chain_by_passes, HeadInput, HeadRows, HeadWant};
    const MORE: usize = 5;
    let n = tokens.len() - 1;
    let d2t = head.draft_to_target();
    // Each way's tops, then one more pass from its last output (its logits say the caches agree).
    let mut at_once = compute.new_cache(n + 16)?;
    let Some(tops) = compute.run_greedy_chain(
        model,
        &tokens[1..],
        HeadInput::Features(features),
        at_once.as_mut(),
        MORE,
    )?
    else {
        return Ok(None);
    };
    let mut by_passes = compute.new_cache(n + 16)?;
    let reference = greedy_chain_by_passes(
        compute,
        model,
        d2t,
        &tokens[1..],
        HeadInput::Features(features),
        by_passes.as_mut(),
        MORE,
    )?;
    let next = |c: &mut dyn specula::model::forward::SequenceCache| {
        compute.run(
            model,
            &tokens[..1],
            HeadInput::Last,
            HeadRows::Chain,
            c,
            HeadWant::default(),
        )
    };
    let after = next(at_once.as_mut())?.logits;
    let after_ref = next(by_passes.as_mut())?.logits;
    let flat = |t: &[(u32, f32)]| -> Vec<f32> {
        t.iter()
            .flat_map(|&(id, p)| [f32::from_bits(id), p])
            .collect()
    };
    let mut check = bitwise(
        &format!(
            "eagle3 head on {device}: a greedy chain of {} passes on the device = pass by pass",
            MORE + 1
        ),
        &[flat(&tops), after].concat(),
        &[flat(&reference), after_ref].concat(),
    );
    check.detail = format!(
        "{}; tokens {:?} against {:?}, caches of {} and {} rows",
        check.detail,
        tops.iter().map(|t| t.0).collect::<Vec<_>>(),
        reference.iter().map(|t| t.0).collect::<Vec<_>>(),
        at_once.len(),
        by_passes.len()
    );
    check.passed &= at_once.len() == by_passes.len();
    Ok(Some(check))
}

/// Several sequences' greedy chains run at once on the head's device (a server's drafting requests) against each
/// pass by pass: every top bitwise, and one more pass from each cache (its logits say the caches agree). None
/// where the head runs no batched chains (the CPU).
fn batched_chains_check(
    model: &dyn Model,
    compute: &dyn specula::draft::eagle3::HeadCompute,
    head: &specula::draft::eagle3::Eagle3Head,
    tokens: &[u32],
    features: &[f32],
    device: &str,
) -> anyhow::Result<Option<Check>> {
    use specula::draft::eagle3::{greedy_chain_by_passes, HeadInput, HeadPass, HeadRows, HeadWant};
    const MORE: usize = 4;
    let n = tokens.len() - 1;
    let width = features.len() / n;
    // Fed rows of different lengths, within one batched pass (64 rows).
    let first = n.min(20);
    let lens = [first, first.saturating_sub(1).max(1), 2.min(n)];
    let d2t = head.draft_to_target();
    let want = HeadWant {
        outputs: false,
        top_only: true,
        top_k: 0,
    };
    let mut caches = lens
        .iter()
        .map(|_| compute.new_cache(n + 16))
        .collect::<specula::error::Result<Vec<_>>>()?;
    let mut passes: Vec<HeadPass<'_>> = caches
        .iter_mut()
        .zip(&lens)
        .map(|(c, &len)| HeadPass {
            tokens: &tokens[1..=len],
            input: HeadInput::Features(&features[..len * width]),
            cache: c.as_mut(),
            want,
        })
        .collect();
    let Some(chains) = compute.run_greedy_chains(model, &mut passes, MORE)? else {
        return Ok(None);
    };
    drop(passes);
    let next = |c: &mut dyn SequenceCache| {
        compute.run(
            model,
            &tokens[..1],
            HeadInput::Last,
            HeadRows::Chain,
            c,
            HeadWant::default(),
        )
    };
    let flat = |t: &[(u32, f32)]| -> Vec<f32> {
        t.iter()
            .flat_map(|&(id, p)| [f32::from_bits(id), p])
            .collect()
    };
    let (mut got, mut want_values) = (Vec::new(), Vec::new());
    let mut same_lengths = chains.len() == lens.len();
    for ((cache, &len), tops) in caches.iter_mut().zip(&lens).zip(&chains) {
        let mut alone = compute.new_cache(n + 16)?;
        let reference = greedy_chain_by_passes(
            compute,
            model,
            d2t,
            &tokens[1..=len],
            HeadInput::Features(&features[..len * width]),
            alone.as_mut(),
            MORE,
        )?;
        same_lengths &= cache.len() == alone.len();
        got.extend(flat(tops));
        got.extend(next(cache.as_mut())?.logits);
        want_values.extend(flat(&reference));
        want_values.extend(next(alone.as_mut())?.logits);
    }
    let mut check = bitwise(
        &format!(
            "eagle3 head on {device}: {} sequences' greedy chains of {} passes at once = each pass by pass",
            lens.len(),
            MORE + 1
        ),
        &got,
        &want_values,
    );
    check.passed &= same_lengths;
    if !same_lengths {
        check.detail = format!("{}; cache lengths differ", check.detail);
    }
    Ok(Some(check))
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

/// The server's request options on this device: log-probabilities equal those of one pass over prompt and output,
/// penalties and logit bias equal a token-at-a-time reference applying the rules by hand, and speculation (the
/// model drafting for itself, which drafts the unadjusted tokens) changes neither the tokens nor the
/// log-probabilities, bit for bit.
fn request_options_checks(
    model: &dyn Model,
    tokenizer: &specula::tokenizer::Tokenizer,
    tokens: &[u32],
) -> anyhow::Result<Vec<Check>> {
    use specula::decode::LogprobsRequest;
    use specula::sampling::{token_logprob, LogitAdjustments};
    let n = 16;
    let top = 4;
    let request = |logprobs, rules| GenerateRequest {
        prompt_tokens: tokens.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs,
        logit_adjustments: rules,
        stop_token_ids: Vec::new(),
    };
    let run = |req: &GenerateRequest, self_draft: bool| -> anyhow::Result<_> {
        let mut drafter = specula::draft::model::ModelDrafter::new(model, 0)?;
        let speculation = self_draft.then_some(specula::decode::Speculation {
            drafter: &mut drafter,
            draft_tokens: 3,
            simulate_acceptance: None,
        });
        Ok(generate(
            model,
            tokenizer,
            req,
            speculation,
            &Profiler::disabled(),
            &mut |_| {},
        )?)
    };
    let mut checks = Vec::new();

    let req = request(Some(LogprobsRequest { top, prompt: true }), None);
    let plain = run(&req, false)?;
    let mut all = tokens.to_vec();
    all.extend(&plain.tokens);
    let reference = forward(model, &all, None, LogitsFor::All)?;
    let reported: Vec<_> = plain
        .prompt_logprobs
        .iter()
        .chain(&plain.logprobs)
        .collect();
    let mut worst = 0f32;
    let mut wrong = Vec::new();
    for (i, lp) in reported.iter().enumerate() {
        // Entry i is token i + 1 of the sequence, scored by row i.
        let want = token_logprob(reference.logits.row(i), all[i + 1], top);
        worst = worst.max((lp.logprob - want.logprob).abs());
        let same_top = lp.top.iter().map(|t| t.0).eq(want.top.iter().map(|t| t.0));
        if lp.token != all[i + 1] || !same_top {
            wrong.push(i);
        }
    }
    checks.push(Check {
        name: "log-probabilities = one pass's log-softmax".into(),
        passed: reported.len() == all.len() - 1 && wrong.is_empty() && worst <= 1e-3,
        detail: format!(
            "{} positions (prompt and output), largest difference {worst:.1e} (tolerance 1e-3), token or top-{top} \
             differ at {wrong:?}",
            reported.len()
        ),
    });
    let drafted = run(&req, true)?;
    let lp_bits = |o: &specula::decode::GenerateOutput| -> Vec<u32> {
        o.prompt_logprobs
            .iter()
            .chain(&o.logprobs)
            .flat_map(|lp| {
                std::iter::once(lp.logprob.to_bits()).chain(lp.top.iter().map(|t| t.1.to_bits()))
            })
            .collect()
    };
    let accepted = drafted.speculation.as_ref().map_or(0, |s| s.accepted);
    checks.push(Check {
        name: "log-probabilities with speculation = plain".into(),
        passed: drafted.tokens == plain.tokens && lp_bits(&drafted) == lp_bits(&plain) && accepted > 0,
        detail: format!(
            "self-drafted, {accepted} draft tokens accepted; tokens {}, log-probabilities bitwise {}",
            if drafted.tokens == plain.tokens { "equal" } else { "DIFFER" },
            if lp_bits(&drafted) == lp_bits(&plain) { "equal" } else { "DIFFER" },
        ),
    });

    // The rules by hand, one forward pass a token.
    let rules = LogitAdjustments {
        presence_penalty: 0.5,
        frequency_penalty: 0.4,
        repetition_penalty: 1.3,
        logit_bias: vec![(plain.tokens[0], -100.0)],
        ..Default::default()
    };
    let expected = specula::testing::adjusted_greedy_reference(model, tokens, n, &rules)?;
    let req = request(None, Some(rules));
    let (adjusted, adjusted_drafted) = (run(&req, false)?, run(&req, true)?);
    let agree = adjusted
        .tokens
        .iter()
        .zip(&expected)
        .take_while(|(a, b)| a == b)
        .count();
    checks.push(Check {
        name: "penalties and logit bias = a reference by hand".into(),
        // Where a random model's logits are spread wider than the largest bias (100), the rules may leave the
        // output as it was: then the reference agreeing says less, and the detail says so.
        passed: adjusted.tokens == expected,
        detail: format!(
            "first {agree} of {n} greedy tokens agree; {}",
            if expected != plain.tokens {
                "the rules change the output"
            } else {
                "the rules leave this model's output unchanged (its logits span more than the bias)"
            }
        ),
    });
    checks.push(Check {
        name: "penalties with speculation = plain".into(),
        passed: adjusted_drafted.tokens == adjusted.tokens,
        detail: format!(
            "self-drafted ({} of {} draft tokens accepted)",
            adjusted_drafted
                .speculation
                .as_ref()
                .map_or(0, |s| s.accepted),
            adjusted_drafted
                .speculation
                .as_ref()
                .map_or(0, |s| s.drafted),
        ),
    });
    Ok(checks)
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
    // A prompt's positions copied into a cache of another capacity (the server's prefix cache) = computed there.
    let mut copied = model.new_cache(tokens.len() + 24)?;
    copied.copy_prefix_from(a.as_ref(), split)?;
    let mut fresh = model.new_cache(tokens.len() + 8)?;
    forward(model, prefix, Some(fresh.as_mut()), LogitsFor::None)?;
    let after_copy = forward(model, rest, Some(copied.as_mut()), LogitsFor::All)?;
    let after_fresh = forward(model, rest, Some(fresh.as_mut()), LogitsFor::All)?;
    checks.push(bitwise(
        "positions copied between caches of other capacities = computed",
        &after_copy.logits.data,
        &after_fresh.logits.data,
    ));
    // A long pass (the GPU's GEMM tile, past 16 rows) against the same rows in 8-row passes (its GEMV).
    let long: Vec<u32> = tokens.iter().copied().cycle().take(40).collect();
    let whole_pass = forward(model, &long, None, LogitsFor::All)?;
    let mut e = model.new_cache(long.len() + 8)?;
    let mut pieces = Vec::new();
    for piece in long.chunks(8) {
        pieces.extend(
            forward(model, piece, Some(e.as_mut()), LogitsFor::All)?
                .logits
                .data,
        );
    }
    checks.push(bitwise(
        "a 40-row pass = five 8-row passes",
        &whole_pass.logits.data,
        &pieces,
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
/// (relative L2 error, largest absolute difference, largest reference magnitude) of `values` against
/// `reference`.
fn logits_distance(values: &[f32], reference: &[f32]) -> (f64, f32, f32) {
    let scale = reference
        .iter()
        .fold(0f32, |a, v| a.max(v.abs()))
        .max(1e-30);
    let worst = values
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let (norm_diff, norm) = values
        .iter()
        .zip(reference)
        .fold((0f64, 0f64), |(d, n), (a, b)| {
            (d + ((a - b) as f64).powi(2), n + (*b as f64).powi(2))
        });
    ((norm_diff / norm.max(1e-30)).sqrt(), worst, scale)
}

fn against_cpu(
    gpu: &LoadedModel,
    cpu: &LoadedModel,
    tokens: &[u32],
    cpu_is_exact: bool,
) -> anyhow::Result<(Vec<Check>, (usize, usize))> {
    let g = forward(gpu.model.as_ref(), tokens, None, LogitsFor::All)?;
    let c = forward(cpu.model.as_ref(), tokens, None, LogitsFor::All)?;
    let (relative, worst, scale) = logits_distance(&g.logits.data, &c.logits.data);
    let detail = format!("{relative:.2e}; max |diff| {worst:.3} of max |logit| {scale:.2}");
    let mut checks = Vec::new();
    if cpu_is_exact {
        // bf16 weights against the CPU's f32 path: relative L2 error of a few 1e-3 is bf16 rounding.
        let tolerance = 2e-2;
        checks.push(Check {
            name: "logits vs CPU (relative L2 error)".into(),
            passed: relative <= tolerance,
            detail: format!("{detail} (tolerance {tolerance:.0e})"),
        });
    } else {
        // The CPU's quantized kernels round activations to 8 bits: a distance, not a check (the f32 reference
        // check below is the check).
        println!("logits vs the CPU's quantized kernels (relative L2 error): {detail}");
    }
    checks.extend(captured_layer_checks(
        gpu,
        cpu,
        tokens,
        &g.logits.data,
        cpu_is_exact,
    )?);
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
    checks.push(device_top_token_check(gpu.model.as_ref(), tokens)?);
    let req = GenerateRequest {
        prompt_tokens: tokens.to_vec(),
        max_new_tokens: 32,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
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

/// A draft model on the GPU reads each row's top token and its probability from the device (`top_tokens`, a
/// kernel) instead of the row: the same token as the host's argmax of the same logits, and the same probability up
/// to the order of the sum.
fn device_top_token_check(model: &dyn Model, tokens: &[u32]) -> anyhow::Result<Check> {
    let mut cache = model.new_cache(tokens.len() + 8)?;
    let out = model.forward_one(
        tokens,
        cache.as_mut(),
        &ForwardOptions::default(),
        LogitsFor::All,
        &Profiler::disabled(),
    )?;
    let device = out.logits.top_tokens()?;
    let mut scratch = Vec::new();
    let mut same_token = 0;
    let mut worst = 0f32;
    for (i, &(token, p)) in device.iter().enumerate() {
        let (host_token, host_p) = specula::sampling::top_probability(&out.row(i)?, &mut scratch);
        same_token += usize::from(token == host_token);
        worst = worst.max((p - host_p).abs() / host_p.max(f32::MIN_POSITIVE));
    }
    Ok(Check {
        name: "top tokens on the device vs the host's (draft models read them)".into(),
        passed: device.len() == out.rows() && same_token == device.len() && worst <= 1e-4,
        detail: format!(
            "{same_token} of {} rows name the same token, probabilities within {worst:.1e} (tolerance 1e-4)",
            out.rows()
        ),
    })
}

/// One forward pass over `tokens` (a fresh cache) capturing `layers`: its logits and each layer's rows, on the
/// host.
/// A head pass fed the target's captured rows where they lie on the device (`WaitingFeatures::take_device_rows`)
/// against the same rows from the host (`features`: tokens.len() - 1 rows), alone and batched beside a host-fed
/// pass of one row fewer: the same bits.
fn device_features_check(
    model: &dyn Model,
    compute: &dyn specula::draft::eagle3::HeadCompute,
    tokens: &[u32],
    layers: &[usize],
    features: &[f32],
    device: &str,
) -> anyhow::Result<Check> {
    use specula::draft::eagle3::waiting::WaitingFeatures;
    use specula::draft::eagle3::{HeadInput, HeadPass, HeadRows, HeadWant};
    let n = tokens.len() - 1;
    let width = features.len() / n.max(1);
    let out = forward_capturing(model, tokens, layers, LogitsFor::Last)?;
    let mats = layers
        .iter()
        .map(|&l| {
            out.hidden
                .iter()
                .find(|(x, _)| *x == l)
                .map(|(_, m)| m.as_ref())
                .ok_or_else(|| anyhow::anyhow!("layer {l} was not captured"))
        })
        .collect::<anyhow::Result<Vec<&dyn specula::model::RowMatrix>>>()?;
    let mut waiting = WaitingFeatures::new(width);
    waiting.push(&mats, &(0..n).collect::<Vec<_>>())?;
    let rows = waiting.take_device_rows(n)?.ok_or_else(|| {
        anyhow::anyhow!("the target's captured rows are not in the device's memory")
    })?;
    let want = HeadWant {
        outputs: true,
        ..Default::default()
    };
    let run = |input: HeadInput<'_>, len: usize| -> anyhow::Result<Vec<f32>> {
        let mut c = compute.new_cache(n + 16)?;
        let o = compute.run(
            model,
            &tokens[1..=len],
            input,
            HeadRows::Chain,
            c.as_mut(),
            want,
        )?;
        Ok(o.outputs.into_iter().chain(o.logits).collect())
    };
    // Alone: the device-fed pass against the host-fed one. Batched: a device-fed pass beside a host-fed one of
    // a row fewer, against each alone from the host.
    let host_n = run(HeadInput::Features(features), n)?;
    let mut dev = run(HeadInput::DeviceFeatures(&rows), n)?;
    let mut host = host_n.clone();
    if n > 1 {
        let m = n - 1;
        let mut caches = [compute.new_cache(n + 16)?, compute.new_cache(n + 16)?];
        let [a, b] = &mut caches;
        let mut passes = [
            HeadPass {
                tokens: &tokens[1..=n],
                input: HeadInput::DeviceFeatures(&rows),
                cache: a.as_mut(),
                want,
            },
            HeadPass {
                tokens: &tokens[1..=m],
                input: HeadInput::Features(&features[..m * width]),
                cache: b.as_mut(),
                want,
            },
        ];
        for o in compute.run_many(model, &mut passes)? {
            dev.extend(o.outputs.into_iter().chain(o.logits));
        }
        host.extend(host_n);
        host.extend(run(HeadInput::Features(&features[..m * width]), m)?);
    }
    Ok(bitwise(
        &format!("eagle3 head on {device}: fed rows read where they lie on the device = uploaded from the host"),
        &dev,
        &host,
    ))
}

/// One forward pass over `tokens` in a fresh cache, capturing `layers` (where the model computed them).
fn forward_capturing(
    model: &dyn Model,
    tokens: &[u32],
    layers: &[usize],
    logits: LogitsFor,
) -> anyhow::Result<specula::model::ForwardOutput> {
    let mut cache = model.new_cache(tokens.len() + 8)?;
    Ok(model.forward_one(
        tokens,
        cache.as_mut(),
        &ForwardOptions {
            capture_layers: layers,
            ..Default::default()
        },
        logits,
        &Profiler::disabled(),
    )?)
}

/// [`forward_capturing`], its logits and each captured layer read to the host.
fn forward_captured(
    model: &dyn Model,
    tokens: &[u32],
    layers: &[usize],
    logits: LogitsFor,
) -> anyhow::Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let out = forward_capturing(model, tokens, layers, logits)?;
    let mut hidden = Vec::new();
    for &l in layers {
        let (_, rows) = out
            .hidden
            .iter()
            .find(|(x, _)| *x == l)
            .ok_or_else(|| anyhow::anyhow!("layer {l} was not captured"))?;
        hidden.push(rows.to_host()?.into_owned());
    }
    Ok((out.logits.to_host()?.into_owned(), hidden))
}

/// Hidden states captured for an EAGLE-3 head (a low, a middle and the last layer: the GPU writes the last
/// one apart) against the CPU's, and capturing leaves the logits bit for bit as they are without it (greedy
/// speculation with a head verifies with captures; plain decoding runs without).
fn captured_layer_checks(
    gpu: &LoadedModel,
    cpu: &LoadedModel,
    tokens: &[u32],
    uncaptured_logits: &[f32],
    cpu_is_exact: bool,
) -> anyhow::Result<Vec<Check>> {
    let n = gpu.model.config().num_layers;
    let mut layers = vec![0, n / 2, n - 1];
    layers.dedup();
    let (g_logits, g_hidden) =
        forward_captured(gpu.model.as_ref(), tokens, &layers, LogitsFor::All)?;
    let (_, c_hidden) = forward_captured(cpu.model.as_ref(), tokens, &layers, LogitsFor::All)?;
    let mut checks = vec![bitwise(
        "logits with captured layers = without",
        &g_logits,
        uncaptured_logits,
    )];
    let mut details = Vec::new();
    let mut passed = true;
    for ((l, g), c) in layers.iter().zip(&g_hidden).zip(&c_hidden) {
        let (relative, _, _) = logits_distance(g, c);
        passed &= g.len() == c.len() && relative <= 2e-2;
        details.push(format!("layer {l}: {relative:.2e}"));
    }
    if cpu_is_exact {
        checks.push(Check {
            name: "captured hidden states vs CPU (relative L2 error)".into(),
            passed,
            detail: format!("{} (tolerance 2e-2)", details.join(", ")),
        });
    } else {
        // As for the logits: the CPU's quantized kernels are a distance, not a reference.
        println!(
            "captured hidden states vs the CPU's quantized kernels (relative L2 error): {}",
            details.join(", ")
        );
    }
    Ok(checks)
}

/// Median forward time over 1..=9 rows after the prompt (a verify pass of k = 0..8), as bench measures it.
/// The verify(n) curve's line: "n:ms" for each timed size.
fn print_timings(context: usize, sizes: &[usize], ms: &[f64]) {
    println!(
        "forward of n rows after {context} tokens (median ms): {}",
        sizes
            .iter()
            .zip(ms)
            .map(|(n, ms)| format!("{n}:{ms:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(kernel: &str, grid: u32, us: f64) -> KernelTime {
        KernelTime {
            kernel: kernel.into(),
            grid: (grid, 1, 1),
            us,
        }
    }

    #[test]
    fn kernel_lines_take_each_launchs_median_and_sum_kernels() {
        let runs: Vec<Vec<KernelTime>> = [(1.0, 10.0), (3.0, 30.0), (2.0, 20.0)]
            .iter()
            .map(|&(a, b)| {
                vec![
                    launch("norm", 1, a),
                    launch("gemv", 96, b),
                    launch("norm", 1, a),
                ]
            })
            .collect();
        let line = kernel_line("pass", &runs, false);
        assert!(
            line.contains(
                "norm [1x1x1] 2.0 us, gemv [96x1x1] 20.0 us, norm [1x1x1] 2.0 us = 24.0 us"
            ),
            "{line}"
        );
        assert!(line.contains("medians of 3)"), "{line}");
        let summed = kernel_line("pass", &runs, true);
        assert!(
            summed.ends_with("gemv x1 20.0 us, norm x2 4.0 us = 24.0 us"),
            "{summed}"
        );
        // Runs that launched different kernels: the first run's times, and the line says so.
        let mut odd = runs.clone();
        odd[1].pop();
        let line = kernel_line("pass", &odd, false);
        assert!(line.contains("the first run's"), "{line}");
        assert!(line.ends_with("= 12.0 us"), "{line}");
    }
}
