//! Repeats one forward pass over n tokens (after a short prefill), for `perf record`.
//! `cargo run --release --example forward_loop -- MODEL N ITERS [THREADS]`

use specula::model::{ForwardOptions, LogitsFor};
use specula::profile::Profiler;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args
        .get(1)
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-1.5b");
    let n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(5);
    let iters: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(50);
    let threads: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(2);
    specula::parallel::set_threads(threads)?;
    let loaded = specula::load_model(spec, false, &mut |l| eprintln!("{l}"))?;
    let model = loaded.model.as_ref();
    let context = loaded
        .tokenizer
        .encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n")?;
    let prof = Profiler::disabled();
    let mut cache = model.new_cache(context.len() + n)?;
    let opts = ForwardOptions::default();
    model.forward_one(&context, cache.as_mut(), &opts, LogitsFor::None, &prof)?;
    let base = cache.len();
    let tokens: Vec<u32> = context.iter().copied().cycle().take(n).collect();
    let start = std::time::Instant::now();
    for _ in 0..iters {
        model.forward_one(&tokens, cache.as_mut(), &opts, LogitsFor::All, &prof)?;
        cache.truncate(base);
    }
    println!(
        "{:.2} ms per forward over {n} tokens",
        start.elapsed().as_secs_f64() * 1e3 / iters as f64
    );
    Ok(())
}
