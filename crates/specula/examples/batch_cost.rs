//! What a forward pass costs for n rows as one sequence (a verify pass) against n sequences of one row each (a
//! continuously batched decode step), each sequence with its own cache of the same context, interleaved over
//! rounds in one process. `cargo run --release --example batch_cost -- MODEL [THREADS] [ROUNDS]`

use specula::model::{ForwardOptions, LogitsFor, SequenceInput};
use specula::profile::Profiler;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args
        .get(1)
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-1.5b");
    let threads: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let rounds: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(5);
    specula::parallel::set_threads(threads)?;
    let loaded = specula::load_model(spec, false, &mut |l| eprintln!("{l}"))?;
    let model = loaded.model.as_ref();
    let context: Vec<u32> = loaded
        .tokenizer
        .encode(&"def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n".repeat(6))?;
    let quiet = Profiler::disabled();
    let opts = ForwardOptions::default();
    let sizes = [1usize, 2, 4, 8, 16];
    let max = *sizes.iter().max().unwrap_or(&1);
    let mut caches = Vec::new();
    for _ in 0..max {
        let mut c = model.new_cache(context.len() + 32)?;
        model.forward_one(&context, c.as_mut(), &opts, LogitsFor::None, &quiet)?;
        caches.push(c);
    }
    let tokens: Vec<u32> = context[..max].to_vec();
    let mut one_seq = vec![Vec::new(); sizes.len()];
    let mut many_seq = vec![Vec::new(); sizes.len()];
    for _ in 0..rounds {
        for (s, &n) in sizes.iter().enumerate() {
            let t = std::time::Instant::now();
            model.forward_one(
                &tokens[..n],
                caches[0].as_mut(),
                &opts,
                LogitsFor::All,
                &quiet,
            )?;
            one_seq[s].push(t.elapsed().as_secs_f64() * 1e3);
            caches[0].truncate(context.len());
            let t = std::time::Instant::now();
            {
                let mut batch: Vec<SequenceInput<'_>> = caches[..n]
                    .iter_mut()
                    .zip(&tokens)
                    .map(|(c, t)| SequenceInput {
                        tokens: std::slice::from_ref(t),
                        cache: c.as_mut(),
                        logits: LogitsFor::Last,
                        tree: None,
                    })
                    .collect();
                model.forward(&mut batch, &opts, &quiet)?;
            }
            many_seq[s].push(t.elapsed().as_secs_f64() * 1e3);
            for c in &mut caches[..n] {
                c.truncate(context.len());
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "{spec}, {threads} threads, context {} tokens, median of {rounds} rounds",
        context.len()
    );
    println!("rows | one sequence ms | n sequences ms | n sequences / one row");
    let base = median(&mut many_seq[0].clone());
    for (s, &n) in sizes.iter().enumerate() {
        let (a, b) = (median(&mut one_seq[s]), median(&mut many_seq[s]));
        println!("{n:4} | {a:15.1} | {b:14.1} | {:.2}x", b / base);
    }
    Ok(())
}
