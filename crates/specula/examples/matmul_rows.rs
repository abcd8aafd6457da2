//! Matmul time per activation-row count for the weight shapes and types of Qwen2.5-1.5B, fast vs reference
//! kernels, on the current thread pool. `cargo run --release --example matmul_rows -- [THREADS]`

use specula::model::weights::{GgmlType, MatmulKernel, Weight};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1);
    specula::parallel::set_threads(threads).unwrap();
    let shapes = [
        (8960, 1536, GgmlType::Q4K),
        (1536, 8960, GgmlType::Q6K),
        (4864, 896, GgmlType::Q5_0),
        (151936 / 4, 896, GgmlType::Q8_0),
        (1536 * 4, 576, GgmlType::Q4_1),
    ];
    for (n, k, ty) in shapes {
        let data: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let w = Weight::quantize(&data, n, k, ty).unwrap();
        let x: Vec<f32> = (0..9 * k)
            .map(|i| ((i * 104729 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let mut line = format!("{} {n}x{k}:", ty.name());
        for kernel in [MatmulKernel::Fast, MatmulKernel::Reference] {
            line += &format!("\n  {kernel:?}:");
            for m in [1, 2, 3, 4, 5, 8, 9] {
                let mut out = vec![0f32; m * n];
                w.matmul_with(kernel, &x[..m * k], m, &mut out);
                let reps = 20;
                let start = Instant::now();
                for _ in 0..reps {
                    w.matmul_with(kernel, &x[..m * k], m, &mut out);
                }
                let ms = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
                line += &format!(" m{m}={ms:.2}ms");
            }
        }
        println!("{line}");
    }
}
