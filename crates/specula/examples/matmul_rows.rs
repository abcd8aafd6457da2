//! Matmul time per activation-row count for the weight shapes and types of Qwen2.5-1.5B, fast vs reference
//! kernels, on the current thread pool. With `cached`, the matrices are cut to 256 rows so they stay in L2:
//! that shows the kernels' compute cost without the memory stream.
//! `cargo run --release --example matmul_rows -- [THREADS] [cached] [fast]`

use specula::backend::cpu::weights::{GgmlType, MatmulKernel, Weight};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(1);
    let cached = args.iter().any(|a| a == "cached");
    let fast_only = args.iter().any(|a| a == "fast");
    specula::parallel::set_threads(threads).unwrap();
    let shapes = [
        (8960, 1536, GgmlType::Q4K),
        (1536, 8960, GgmlType::Q6K),
        (4864, 896, GgmlType::Q5_0),
        (151936 / 4, 896, GgmlType::Q8_0),
        (1536 * 4, 576, GgmlType::Q4_1),
    ];
    for (n, k, ty) in shapes {
        let n = if cached { 256 } else { n };
        let data: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let w = Weight::quantize(&data, n, k, ty).unwrap();
        let x: Vec<f32> = (0..9 * k)
            .map(|i| ((i * 104729 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let blocks = (n * k / ty.block_size()) as f64;
        let mut line = format!("{} {n}x{k}:", ty.name());
        let kernels: &[MatmulKernel] = if fast_only {
            &[MatmulKernel::Fast]
        } else {
            &[MatmulKernel::Fast, MatmulKernel::Reference]
        };
        for &kernel in kernels {
            line += &format!("\n  {kernel:?}:");
            let mut m1 = 0.0;
            for m in [1, 2, 3, 4, 5, 8, 9] {
                let mut out = vec![0f32; m * n];
                w.matmul_with(kernel, &x[..m * k], m, &mut out);
                let reps = if cached { 400 } else { 20 };
                let start = Instant::now();
                for _ in 0..reps {
                    w.matmul_with(kernel, &x[..m * k], m, &mut out);
                }
                let ms = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
                if m == 1 {
                    m1 = ms;
                    line += &format!(" m1={ms:.3}ms ({:.1} ns/block)", ms * 1e6 / blocks);
                } else {
                    line += &format!(" m{m}={ms:.3}ms");
                }
                if m == 5 {
                    line += &format!(" (+{:.2} ns/block/row)", (ms - m1) * 1e6 / blocks / 4.0);
                }
            }
        }
        println!("{line}");
    }
}
