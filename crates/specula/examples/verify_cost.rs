//! verify(n) for n = 1..=9 with the fast and the reference matmul kernels, side by side in one process.
//! (For Q4_K, Q6_K and Q5_0 weights the reference first converts each row back from the interleaved order, so
//! its times are an upper bound on candle's kernels, not a measurement of them.)
//! `cargo run --release --example verify_cost -- MODEL [THREADS] [REPEATS]`

use specula::backend::cpu::weights::{set_matmul_kernel, MatmulKernel};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args
        .get(1)
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-1.5b");
    let threads: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let repeats: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(5);
    specula::parallel::set_threads(threads)?;
    let loaded = specula::load_model(spec, false, &mut |l| eprintln!("{l}"))?;
    let context = loaded
        .tokenizer
        .encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n")?;
    for kernel in [
        MatmulKernel::Fast,
        MatmulKernel::Reference,
        MatmulKernel::Fast,
    ] {
        set_matmul_kernel(kernel);
        let cost =
            specula::bench::measure_verify_cost(loaded.model.as_ref(), &context, 9, repeats)?;
        let row: Vec<String> = (1..=9)
            .map(|n| format!("{:.1}ms({:.2}x)", cost.verify_ms(n), cost.ratio(n)))
            .collect();
        println!("{kernel:?}: {}", row.join(" "));
    }
    Ok(())
}
