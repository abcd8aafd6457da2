//! What sampling a position costs on this CPU, for a row of a real vocabulary's size: the distribution (softmax,
//! truncation), a draw, a token's probability in it, and the greedy argmax; medians of many runs.
//!
//!     cargo run --release -p specula --example sampling_cost -- [VOCAB] [RUNS]
use specula::sampling::{argmax, distribution, draw, SamplingParams};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let vocab: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(151_936);
    let runs: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(200);
    // Logits shaped like a language model's: most tokens far below a few likely ones.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32
    };
    let row: Vec<f32> = (0..vocab)
        .map(|i| {
            if i % 997 == 0 {
                15.0 + next() * 5.0
            } else {
                next() * 10.0 - 5.0
            }
        })
        .collect();
    let median = |f: &mut dyn FnMut()| {
        let mut us: Vec<f64> = (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        us.sort_by(f64::total_cmp);
        us[runs / 2]
    };
    let mut rng = <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(1);
    let mut sink = 0u64;
    for (name, params) in [
        (
            "temperature 0.7",
            SamplingParams {
                temperature: 0.7,
                ..Default::default()
            },
        ),
        (
            "temperature 0.7, top-p 0.9",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                ..Default::default()
            },
        ),
    ] {
        let dist_us = median(&mut || sink += distribution(&row, &params).ids.len() as u64);
        let dist = distribution(&row, &params);
        let draw_us = median(&mut || sink += u64::from(draw(&dist, &mut rng)));
        let last = *dist.ids.last().unwrap_or(&0);
        let prob_us = median(&mut || sink += dist.prob_of(last).to_bits() as u64);
        println!(
            "{name}: distribution {dist_us:.1} us ({} tokens kept), draw {draw_us:.1} us, prob_of {prob_us:.1} us",
            dist.ids.len()
        );
    }
    let argmax_us = median(&mut || sink += u64::from(argmax(&row)));
    println!("argmax {argmax_us:.1} us (vocabulary {vocab}, medians of {runs}; {sink})");
}
