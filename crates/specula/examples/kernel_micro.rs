//! Pure compute cost of the multi-row kernels: a few weight rows that stay in L1/L2, dotted with 1..8
//! activation rows many times on one thread (fastest of 7 repetitions), one-row and pair kernels.
//! `cargo run --release --example kernel_micro`; `STREAM=1` streams 256 MB of weights from DRAM instead
//! (`SPECULA_PREFETCH` / `SPECULA_K_PREFETCH` set the small-block / K-quant prefetch distances).
use candle_core::quantized::k_quants::GgmlType;
use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8_0};
use specula::backend::cpu::kernels::FastRowsDot;
use specula::backend::cpu::repack::{
    BlockQ4KInterleaved, BlockQ4_1Interleaved, BlockQ5_0Interleaved, BlockQ6KInterleaved,
    BlockQ8_0Interleaved,
};
use specula::testing::pseudo_random as pseudo;
use std::time::Instant;

fn run<T: FastRowsDot>(name: &str, k: usize, rows_w: usize) {
    let kernel = T::fast_kernel().expect("fast kernel");
    let nb = k / T::BLCK_SIZE;
    let mut w: Vec<T> = (0..rows_w * nb).map(|_| T::zeros()).collect();
    T::from_float(&pseudo(rows_w * k, 3), &mut w);
    let mut line = format!("{name} k={k}:");
    for m in [1usize, 2, 3, 4, 5, 6, 7, 8] {
        let xf = pseudo(m * k, 5);
        let mut x: Vec<T::VecDotType> = (0..m * k / T::VecDotType::BLCK_SIZE)
            .map(|_| T::VecDotType::zeros())
            .collect();
        T::VecDotType::from_float(&xf, &mut x);
        let mut side = Vec::new();
        (kernel.prepare)(&mut x, k / T::VecDotType::BLCK_SIZE, &mut side);
        let mut out = vec![0f32; m];
        // The fastest of several repetitions: this VM's noise only ever adds time.
        let iters = 20000;
        let mut ns = f64::INFINITY;
        for _ in 0..7 {
            let start = Instant::now();
            for it in 0..iters {
                let r = it % rows_w;
                (kernel.rows_dot)(&w[r * nb..(r + 1) * nb], &x, &side, &mut out);
                std::hint::black_box(&mut out);
            }
            ns = ns.min(start.elapsed().as_secs_f64() * 1e9 / (iters * nb) as f64);
        }
        line += &format!("  m{m}={ns:.2}");
        if let Some(pair) = kernel.pair_dot {
            // The pair kernel reads its rows pair-interleaved; rows_w is even here.
            let wp = paired(&w, rows_w, nb);
            let mut out1 = vec![0f32; m];
            let mut ns = f64::INFINITY;
            for _ in 0..7 {
                let start = Instant::now();
                for it in 0..iters / 2 {
                    let p = it % (rows_w / 2);
                    pair(
                        &wp[2 * p * nb..(2 * p + 2) * nb],
                        &x,
                        &side,
                        &mut out,
                        &mut out1,
                    );
                    std::hint::black_box((&mut out, &mut out1));
                }
                ns = ns.min(start.elapsed().as_secs_f64() * 1e9 / (iters / 2 * 2 * nb) as f64);
            }
            line += &format!(" (pair {ns:.2})");
        }
    }
    println!("{line} ns/block");
}

/// Rows 2p and 2p + 1 interleaved block by block (the storage layout of `FastRowsDot::PAIRED_ROWS` types).
fn paired<T: Clone>(w: &[T], rows: usize, nb: usize) -> Vec<T> {
    (0..rows / 2)
        .flat_map(|p| {
            let (a, b) = (
                &w[2 * p * nb..(2 * p + 1) * nb],
                &w[(2 * p + 1) * nb..(2 * p + 2) * nb],
            );
            a.iter()
                .zip(b)
                .flat_map(|(u, v)| [u.clone(), v.clone()])
                .collect::<Vec<_>>()
        })
        .collect()
}

/// One thread streaming a weight matrix much larger than the caches, row after row (or pair after pair) like
/// a real matmul, at 1..8 activation rows: ns per block with the weights coming from DRAM.
fn stream<T: FastRowsDot + Clone>(name: &str, k: usize, total_mb: usize) {
    let kernel = T::fast_kernel().expect("fast kernel");
    let nb = k / T::BLCK_SIZE;
    let mut seed: Vec<T> = (0..64 * nb).map(|_| T::zeros()).collect();
    T::from_float(&pseudo(64 * k, 3), &mut seed);
    let rows = (total_mb << 20) / (nb * std::mem::size_of::<T>()) / 2 * 2;
    let w: Vec<T> = (0..rows)
        .flat_map(|r| seed[(r % 64) * nb..(r % 64 + 1) * nb].to_vec())
        .collect();
    let wp = paired(&w, rows, nb);
    let mut line = format!("{name} k={k} stream {total_mb} MB:");
    for m in [1usize, 2, 3, 5, 8] {
        let xf = pseudo(m * k, 5);
        let mut x: Vec<T::VecDotType> = (0..m * k / T::VecDotType::BLCK_SIZE)
            .map(|_| T::VecDotType::zeros())
            .collect();
        T::VecDotType::from_float(&xf, &mut x);
        let mut side = Vec::new();
        (kernel.prepare)(&mut x, k / T::VecDotType::BLCK_SIZE, &mut side);
        let (mut out, mut out1) = (vec![0f32; m], vec![0f32; m]);
        let mut one = f64::INFINITY;
        let mut two = f64::INFINITY;
        for _ in 0..3 {
            let start = Instant::now();
            for r in 0..rows {
                (kernel.rows_dot)(&w[r * nb..(r + 1) * nb], &x, &side, &mut out);
                std::hint::black_box(&mut out);
            }
            one = one.min(start.elapsed().as_secs_f64() * 1e9 / (rows * nb) as f64);
            if let Some(pair) = kernel.pair_dot {
                let start = Instant::now();
                for p in 0..rows / 2 {
                    pair(
                        &wp[2 * p * nb..(2 * p + 2) * nb],
                        &x,
                        &side,
                        &mut out,
                        &mut out1,
                    );
                    std::hint::black_box((&mut out, &mut out1));
                }
                two = two.min(start.elapsed().as_secs_f64() * 1e9 / (rows * nb) as f64);
            }
        }
        line += &format!("  m{m}={one:.2}");
        if kernel.pair_dot.is_some() {
            line += &format!(" (pair {two:.2})");
        }
    }
    println!("{line} ns/block");
}

fn main() {
    if let Some(d) = std::env::var("SPECULA_PREFETCH")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        specula::backend::cpu::kernels::PREFETCH_DISTANCE
            .store(d, std::sync::atomic::Ordering::Relaxed);
    }
    if let Some(d) = std::env::var("SPECULA_K_PREFETCH")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        specula::backend::cpu::kernels::K_QUANT_PREFETCH_DISTANCE
            .store(d, std::sync::atomic::Ordering::Relaxed);
    }
    if std::env::var_os("STREAM").is_some() {
        // Weights from DRAM (256 MB, or MB=...), one thread; run two at once to share the memory bus.
        let mb = std::env::var("MB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256);
        stream::<BlockQ4KInterleaved>("Q4_K", 1536, mb);
        stream::<BlockQ6KInterleaved>("Q6_K", 1536, mb);
        stream::<BlockQ5_0Interleaved>("Q5_0", 896, mb);
        stream::<BlockQ8_0>("Q8_0 GGML order", 896, mb);
        stream::<BlockQ8_0Interleaved>("Q8_0 interleaved", 896, mb);
        stream::<BlockQ4_1>("Q4_1 GGML order", 576, mb);
        stream::<BlockQ4_1Interleaved>("Q4_1 interleaved", 576, mb);
        return;
    }
    // Everything in L1: two weight rows, activations of at most 8 x 8 blocks.
    run::<BlockQ4KInterleaved>("Q4_K L1", 2048, 2);
    run::<BlockQ6KInterleaved>("Q6_K L1", 2048, 2);
    run::<BlockQ5_0Interleaved>("Q5_0 L1", 1024, 2);
    run::<BlockQ5_0Interleaved>("Q5_0 L1", 4096, 2);
    run::<BlockQ8_0>("Q8_0 GGML order L1", 1024, 2);
    run::<BlockQ8_0Interleaved>("Q8_0 interleaved L1", 1024, 2);
    run::<BlockQ8_0>("Q8_0 GGML order", 576, 32);
    run::<BlockQ8_0Interleaved>("Q8_0 interleaved", 576, 32);
    run::<BlockQ4_1>("Q4_1 GGML order L1", 1024, 2);
    run::<BlockQ4_1Interleaved>("Q4_1 interleaved L1", 1024, 2);
    run::<BlockQ4_1>("Q4_1 GGML order", 576, 32);
    run::<BlockQ4_1Interleaved>("Q4_1 interleaved", 576, 32);
    run::<BlockQ4KInterleaved>("Q4_K", 1536, 32);
    run::<BlockQ6KInterleaved>("Q6_K", 1536, 32);
    run::<BlockQ6KInterleaved>("Q6_K", 8960, 8);
    run::<BlockQ4KInterleaved>("Q4_K", 8960, 8);
}
