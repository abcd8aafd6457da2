//! verify(n) for several weight prefetch settings, interleaved in one process, to choose them.
//! `cargo run --release --example prefetch_sweep -- MODEL ROUNDS SETTING...`, where a setting is `l1:D` (every
//! kernel prefetches D bytes ahead into L1, the session-3 scheme; D = 0: no prefetch) or `l2:D` (the Q4_K/Q6_K
//! kernels prefetch D bytes ahead into L2, the others 1536 into L1: the default with D = 6144).
use std::sync::atomic::Ordering;

use specula::backend::cpu::kernels::{
    K_QUANT_PREFETCH_DISTANCE, K_QUANT_PREFETCH_L1, PREFETCH_DISTANCE,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args
        .get(1)
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-1.5b");
    let rounds: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(5);
    let settings: Vec<(bool, usize)> = args[3.min(args.len())..]
        .iter()
        .map(|s| match s.split_once(':') {
            Some(("l1", d)) => Ok((true, d.parse()?)),
            Some(("l2", d)) => Ok((false, d.parse()?)),
            _ => Err(format!("setting {s:?}: expected l1:BYTES or l2:BYTES").into()),
        })
        .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    specula::parallel::set_threads(2)?;
    let loaded = specula::load_model(spec, false, &mut |_| {})?;
    let context = loaded
        .tokenizer
        .encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n")?;
    let mut sums = vec![vec![0f64; 5]; settings.len()];
    for _ in 0..rounds {
        for (sum, &(l1, d)) in sums.iter_mut().zip(&settings) {
            K_QUANT_PREFETCH_L1.store(l1, Ordering::Relaxed);
            if l1 {
                PREFETCH_DISTANCE.store(d, Ordering::Relaxed);
            } else {
                PREFETCH_DISTANCE.store(1536, Ordering::Relaxed);
                K_QUANT_PREFETCH_DISTANCE.store(d, Ordering::Relaxed);
            }
            let cost = specula::bench::measure_verify_cost(loaded.model.as_ref(), &context, 5, 3)?;
            for (s, ms) in sum.iter_mut().zip(&cost.ms) {
                *s += ms;
            }
        }
    }
    for (sum, (l1, d)) in sums.iter().zip(&settings) {
        let row: Vec<String> = sum
            .iter()
            .map(|v| format!("{:.1}", v / rounds as f64))
            .collect();
        let ratio = sum[4] / sum[0];
        let level = if *l1 { "L1" } else { "L2" };
        println!(
            "{level} {d:5}: verify(1..5) ms = {}  verify(5)/verify(1) = {ratio:.2}",
            row.join(" ")
        );
    }
    Ok(())
}
