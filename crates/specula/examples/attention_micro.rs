//! One CPU attention work item (a row's query heads of one KV head over `n` cached keys) timed alone, one thread:
//! the kernels `CpuModel::attention` runs (`ops::scores`, `ops::softmax`, `ops::axpy_rows`), ns per (head, key).
//!   cargo run --release -p specula --example attention_micro -- [KEYS] [GROUP] [ROUNDS]
use specula::backend::cpu::ops;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("KEYS, GROUP and ROUNDS are whole numbers"))
        .collect();
    let n = args.first().copied().unwrap_or(2048);
    let group = args.get(1).copied().unwrap_or(6);
    let rounds = args.get(2).copied().unwrap_or(200);
    let hd = 128;
    let keys = specula::testing::pseudo_random(n * hd, 1);
    let values = specula::testing::pseudo_random(n * hd, 2);
    let queries = specula::testing::pseudo_random(group * hd, 3);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = vec![0f32; group * n];
    let mut acc = vec![0f32; group * hd];
    let mut check = 0f32;
    let (mut t_dot, mut t_soft, mut t_val) = (0f64, 0f64, 0f64);
    for _ in 0..rounds {
        let t0 = Instant::now();
        ops::scores(
            &queries,
            hd,
            n,
            |j| &keys[j * hd..(j + 1) * hd],
            scale,
            &mut scores,
            n,
        );
        let t1 = Instant::now();
        for s in scores.chunks_exact_mut(n) {
            ops::softmax(s);
        }
        let t2 = Instant::now();
        acc.fill(0.0);
        for block in (0..n).step_by(16) {
            let end = (block + 16).min(n);
            for (i, a) in acc.chunks_exact_mut(hd).enumerate() {
                ops::axpy_rows(a, &scores[i * n + block..i * n + end], |j| {
                    &values[(block + j) * hd..(block + j + 1) * hd]
                });
            }
        }
        let t3 = Instant::now();
        check += acc[0];
        t_dot += (t1 - t0).as_secs_f64();
        t_soft += (t2 - t1).as_secs_f64();
        t_val += (t3 - t2).as_secs_f64();
    }
    let per = |t: f64| t * 1e9 / (rounds * n * group) as f64;
    println!(
        "{n} keys, {group} heads: ns per (head, key): dot {:.2}, softmax {:.2}, values {:.2}, total {:.2} (check {check})",
        per(t_dot),
        per(t_soft),
        per(t_val),
        per(t_dot + t_soft + t_val)
    );
}
