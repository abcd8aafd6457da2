//! verify(n) for several weight prefetch distances, interleaved in one process, to choose the distance.
//! `cargo run --release --example prefetch_sweep -- MODEL ROUNDS DISTANCE...` (0 = no prefetch)
use std::sync::atomic::Ordering;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args
        .get(1)
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-1.5b");
    let rounds: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(5);
    let distances: Vec<usize> = args[3.min(args.len())..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    specula::parallel::set_threads(2)?;
    let loaded = specula::load_model(spec, false, &mut |_| {})?;
    let context = loaded
        .tokenizer
        .encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n")?;
    let mut sums = vec![vec![0f64; 5]; distances.len()];
    for _ in 0..rounds {
        for (sum, &d) in sums.iter_mut().zip(&distances) {
            specula::model::kernels::PREFETCH_DISTANCE.store(d, Ordering::Relaxed);
            let cost = specula::bench::measure_verify_cost(&loaded.model, &context, 5, 3)?;
            for (s, ms) in sum.iter_mut().zip(&cost.ms) {
                *s += ms;
            }
        }
    }
    for (sum, d) in sums.iter().zip(&distances) {
        let row: Vec<String> = sum
            .iter()
            .map(|v| format!("{:.1}", v / rounds as f64))
            .collect();
        println!("prefetch {d:5}: verify(1..5) ms = {}", row.join(" "));
    }
    Ok(())
}
