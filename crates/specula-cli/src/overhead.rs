//! `specula profile-overhead`: the profiler's cost, measured as the same greedy generation with profiling off,
//! on (phases) and fine, run in one process and interleaved round by round so machine drift hits all three.

use specula::decode::{self, GenerateRequest};
use specula::profile::{Detail, Profiler};
use specula::sampling::SamplingParams;

use crate::generate::ModelArgs;

#[derive(clap::Args)]
pub struct OverheadArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(
        long,
        short = 'p',
        default_value = "Write a short story about a robot who learns to paint."
    )]
    pub prompt: String,
    /// New tokens per run (generation ignores end-of-turn tokens so every run has the same length).
    #[arg(long, short = 'n', default_value_t = 64)]
    pub max_tokens: usize,
    /// Rounds; each round runs off, phases and fine once, in rotating order.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

pub fn run(args: OverheadArgs) -> anyhow::Result<()> {
    if args.max_tokens < 2 {
        anyhow::bail!("--max-tokens must be at least 2");
    }
    specula::bench::check_repetitions(args.rounds, 0)?;
    let (loaded, threads, _) = crate::generate::load(&args.model)?;
    let text = loaded.format_prompt(&args.prompt, false, None)?;
    let prompt_tokens = loaded.tokenizer.encode(&text)?;
    crate::generate::note_context_cap(loaded.model.as_ref(), prompt_tokens.len(), args.max_tokens);
    let req = GenerateRequest {
        prompt_tokens,
        max_new_tokens: args.max_tokens,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    let modes = [
        ("off", Detail::Off),
        ("phases", Detail::Phases),
        ("fine", Detail::Fine),
    ];
    let mut decode_s: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut outputs: Vec<Option<Vec<u32>>> = vec![None; modes.len()];
    // Warm-up run so page faults and allocator growth are not charged to the first mode.
    decode::generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &req,
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )?;
    for round in 0..args.rounds {
        for k in 0..modes.len() {
            let m = (round + k) % modes.len();
            let prof = Profiler::new(modes[m].1);
            let out = decode::generate(
                loaded.model.as_ref(),
                &loaded.tokenizer,
                &req,
                None,
                &prof,
                &mut |_| {},
            )?;
            decode_s[m].push(out.timing.decode_s / out.timing.decode_tokens as f64);
            match &outputs[m] {
                None => outputs[m] = Some(out.tokens),
                Some(prev) if *prev != out.tokens => {
                    anyhow::bail!("mode {} changed its own output between runs", modes[m].0)
                }
                Some(_) => {}
            }
        }
    }
    let same = outputs.windows(2).all(|w| w[0] == w[1]);
    let median = |v: &Vec<f64>| {
        let mut s = v.clone();
        s.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        s[s.len() / 2]
    };
    let base = median(&decode_s[0]);
    println!(
        "model {}, {threads} threads, {} tokens x {} rounds (median ms per decode step)",
        loaded.spec, args.max_tokens, args.rounds
    );
    println!(
        "{:<8} {:>12} {:>12} {:>10}",
        "profile", "ms/step", "tok/s", "overhead"
    );
    let mut rows = Vec::new();
    for (m, (name, _)) in modes.iter().enumerate() {
        let med = median(&decode_s[m]);
        let overhead = (med - base) / base;
        println!(
            "{:<8} {:>12.3} {:>12.2} {:>9.2}%",
            name,
            med * 1e3,
            1.0 / med,
            overhead * 100.0
        );
        rows.push(serde_json::json!({"profile": name, "ms_per_step": med * 1e3, "tok_s": 1.0 / med,
            "overhead_vs_off": overhead, "samples_ms": decode_s[m].iter().map(|s| s * 1e3).collect::<Vec<_>>()}));
    }
    println!(
        "outputs identical across modes: {}",
        if same { "yes" } else { "NO" }
    );
    // The timed difference above is within run-to-run noise, so also derive the cost from first principles:
    // what one span costs, times the spans a step records.
    let span_ns = span_cost_ns();
    let per_step = |detail: Detail| {
        let prof = Profiler::new(detail);
        let short = GenerateRequest {
            max_new_tokens: 4,
            ..req.clone()
        };
        decode::generate(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &short,
            None,
            &prof,
            &mut |_| {},
        )
        .map(|_| {
            let summary = prof.summary();
            let spans: u64 = summary
                .phases
                .iter()
                .filter(|p| p.name != "prefill")
                .map(|p| p.count)
                .sum::<u64>()
                + summary.fine.iter().map(|f| f.count).sum::<u64>();
            // Each step also takes two marks of its own (begin and end): count them as one span.
            (spans + summary.decode_steps) as f64 / summary.decode_steps.max(1) as f64
        })
    };
    let (phase_spans, fine_spans) = (per_step(Detail::Phases)?, per_step(Detail::Fine)?);
    let est = |spans: f64| spans * span_ns * 1e-9 / base * 100.0;
    println!(
        "one span costs {span_ns:.0} ns; a step records {phase_spans:.0} spans (phases) / {fine_spans:.0} (fine): \
         estimated overhead {:.3}% / {:.3}% of a {:.1} ms step",
        est(phase_spans), est(fine_spans), base * 1e3
    );
    if let Some(path) = &args.json {
        let v = serde_json::json!({"model": loaded.spec, "threads": threads, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "modes": rows, "outputs_identical": same,
            "span_cost_ns": span_ns, "spans_per_step": {"phases": phase_spans, "fine": fine_spans},
            "estimated_overhead_pct": {"phases": est(phase_spans), "fine": est(fine_spans)}});
        crate::generate::write_json(path, &v)?;
    }
    if !same {
        anyhow::bail!("profiling changed the generated tokens");
    }
    Ok(())
}

/// Mean cost of opening and closing one span (two clock marks and a record), measured over many spans.
fn span_cost_ns() -> f64 {
    let prof = Profiler::new(Detail::Phases);
    let n = 200_000;
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        drop(std::hint::black_box(
            prof.span(specula::profile::Phase::Sample),
        ));
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}
