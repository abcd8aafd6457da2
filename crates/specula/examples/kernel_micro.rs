//! Pure compute cost of the multi-row kernels: a few weight rows that stay in L1/L2, dotted with 1..8
//! activation rows many times on one thread. `cargo run --release --example kernel_micro`
use candle_core::quantized::k_quants::GgmlType;
use specula::model::kernels::FastRowsDot;
use specula::model::repack::{BlockQ4KInterleaved, BlockQ6KInterleaved};
use specula::testing::pseudo_random as pseudo;
use std::time::Instant;

fn run<T: FastRowsDot>(name: &str, k: usize, rows_w: usize) {
    let kernel = T::fast_kernel().expect("fast kernel");
    let nb = k / T::BLCK_SIZE;
    let mut w: Vec<T> = (0..rows_w * nb).map(|_| T::zeros()).collect();
    T::from_float(&pseudo(rows_w * k, 3), &mut w);
    let mut line = format!("{name} k={k}:");
    for m in [1usize, 2, 4, 5, 8] {
        let xf = pseudo(m * k, 5);
        let mut x: Vec<T::VecDotType> = (0..m * k / T::VecDotType::BLCK_SIZE)
            .map(|_| T::VecDotType::zeros())
            .collect();
        T::VecDotType::from_float(&xf, &mut x);
        let mut side = Vec::new();
        (kernel.prepare)(&mut x, k / T::VecDotType::BLCK_SIZE, &mut side);
        let mut out = vec![0f32; m];
        let iters = 20000;
        let start = Instant::now();
        for it in 0..iters {
            let r = it % rows_w;
            (kernel.rows_dot)(&w[r * nb..(r + 1) * nb], &x, &side, &mut out);
            std::hint::black_box(&mut out);
        }
        let ns = start.elapsed().as_secs_f64() * 1e9 / (iters * nb) as f64;
        line += &format!("  m{m}={ns:.2}ns/block ({:.1} cyc@3.3)", ns * 3.3);
    }
    println!("{line}");
}

fn main() {
    if let Some(d) = std::env::var("SPECULA_PREFETCH")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        specula::model::kernels::PREFETCH_DISTANCE.store(d, std::sync::atomic::Ordering::Relaxed);
    }
    run::<BlockQ4KInterleaved>("Q4_K", 1536, 32);
    run::<BlockQ6KInterleaved>("Q6_K", 1536, 32);
    run::<BlockQ6KInterleaved>("Q6_K", 8960, 8);
    run::<BlockQ4KInterleaved>("Q4_K", 8960, 8);
}
