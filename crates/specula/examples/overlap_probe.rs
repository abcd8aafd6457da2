//! Whether a draft model's steps and its target's verify pass overlap on one GPU when each runs on its own stream
//! (every CUDA model opens its own): the question a pipelined drafter (drafting the next window while the target
//! verifies this one) stands or falls on. Times, for each draft length k: the target's verify of k + 1 rows
//! alone, the drafter's k one-token steps alone, both in lock step from two threads (each round starts together
//! and ends when both are done), and both free-running (each thread's own rate while the other runs).
//! `cargo run --release -p specula --features cuda --example overlap_probe -- TARGET DRAFT K[,K..] ITERS [DEVICE]`
//! e.g. `overlap_probe random:qwen2.5-1.5b random:qwen2.5-0.5b 1,2,3,4 200 cuda`.

use std::sync::Barrier;
use std::time::Instant;

use specula::model::{ForwardOptions, LogitsFor, Model, SequenceCache};
use specula::profile::Profiler;

/// One round of verify: k + 1 rows, each row's argmax read back (what acceptance reads), then the rows dropped.
fn verify_round(
    model: &dyn Model,
    cache: &mut dyn SequenceCache,
    tokens: &[u32],
) -> specula::Result<u32> {
    let base = cache.len();
    let out = model.forward_one(
        tokens,
        cache,
        &ForwardOptions::default(),
        LogitsFor::All,
        &Profiler::disabled(),
    )?;
    let top = out.logits.argmax_rows()?;
    cache.truncate(base);
    Ok(top.first().copied().unwrap_or(0))
}

/// One round of drafting: k one-token steps, each reading its top token back to feed the next.
fn draft_round(
    model: &dyn Model,
    cache: &mut dyn SequenceCache,
    first: u32,
    k: usize,
) -> specula::Result<u32> {
    let base = cache.len();
    let mut token = first;
    for _ in 0..k {
        let out = model.forward_one(
            &[token],
            cache,
            &ForwardOptions::default(),
            LogitsFor::Last,
            &Profiler::disabled(),
        )?;
        token = out.logits.argmax_rows()?.first().copied().unwrap_or(0);
    }
    cache.truncate(base);
    Ok(token)
}

fn ms_per(start: Instant, iters: usize) -> f64 {
    start.elapsed().as_secs_f64() * 1e3 / iters as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: overlap_probe TARGET DRAFT K[,K..] ITERS [DEVICE]";
    let args: Vec<String> = std::env::args().collect();
    let target_spec = args.get(1).ok_or(usage)?;
    let draft_spec = args.get(2).ok_or(usage)?;
    let ks: Vec<usize> = args
        .get(3)
        .ok_or(usage)?
        .split(',')
        .map(|s| s.parse::<usize>().map_err(|_| format!("K {s:?}: {usage}")))
        .collect::<Result<_, _>>()?;
    if ks.contains(&0) {
        return Err(format!("every K must be at least 1; {usage}").into());
    }
    let iters: usize = args.get(4).ok_or(usage)?.parse().map_err(|_| usage)?;
    if iters == 0 {
        return Err(format!("ITERS must be at least 1; {usage}").into());
    }
    let device: specula::backend::Device =
        args.get(5).map(String::as_str).unwrap_or("cuda").parse()?;
    let mut log = |l: &str| eprintln!("{l}");
    let target = specula::load_model_on(target_spec, device, false, &mut log)?;
    let draft = specula::load_model_on(draft_spec, device, false, &mut log)?;
    println!("target {} on {}", target_spec, target.model.device());
    println!("draft  {} on {}", draft_spec, draft.model.device());
    let (t, d) = (target.model.as_ref(), draft.model.as_ref());
    // A 64-token context in both caches (the same ids: both shapes share Qwen's vocabulary; only costs matter).
    let context: Vec<u32> = (0..64u32).map(|i| 100 + i * 7).collect();
    let kmax = *ks.iter().max().unwrap_or(&1);
    let mut tcache = t.new_cache(context.len() + kmax + 2)?;
    let mut dcache = d.new_cache(context.len() + kmax + 2)?;
    let prof = Profiler::disabled();
    let opts = ForwardOptions::default();
    t.forward_one(&context, tcache.as_mut(), &opts, LogitsFor::None, &prof)?;
    d.forward_one(&context, dcache.as_mut(), &opts, LogitsFor::None, &prof)?;
    println!(
        "k | verify(k+1) alone | k draft steps alone | sum | lock step | lock / sum | lock / max | free-running verify, draft"
    );
    for &k in &ks {
        let rows: Vec<u32> = context.iter().copied().take(k + 1).collect();
        for _ in 0..5 {
            verify_round(t, tcache.as_mut(), &rows)?;
            draft_round(d, dcache.as_mut(), rows[0], k)?;
        }
        let start = Instant::now();
        for _ in 0..iters {
            verify_round(t, tcache.as_mut(), &rows)?;
        }
        let verify_ms = ms_per(start, iters);
        let start = Instant::now();
        for _ in 0..iters {
            draft_round(d, dcache.as_mut(), rows[0], k)?;
        }
        let draft_ms = ms_per(start, iters);
        // Lock step: both start each round together; a round lasts as long as the slower side.
        let barrier = Barrier::new(2);
        let (tc, dc) = (&mut tcache, &mut dcache);
        // A failing side still takes part in every barrier, so the other never waits for ever.
        let (lock_ms, verified, drafted) = std::thread::scope(|s| {
            let verifier = s.spawn(|| {
                let mut result = Ok(0);
                for _ in 0..iters {
                    barrier.wait();
                    if result.is_ok() {
                        result = verify_round(t, tc.as_mut(), &rows);
                    }
                    barrier.wait();
                }
                result
            });
            let start = Instant::now();
            let mut result = Ok(0);
            for _ in 0..iters {
                barrier.wait();
                if result.is_ok() {
                    result = draft_round(d, dc.as_mut(), rows[0], k);
                }
                barrier.wait();
            }
            let ms = ms_per(start, iters);
            (ms, verifier.join(), result)
        });
        verified.map_err(|_| "the verifying thread panicked")??;
        drafted?;
        // Free-running: each side's own rate while the other runs beside it.
        let (tc, dc) = (&mut tcache, &mut dcache);
        let (free_verify, free_draft) = std::thread::scope(|s| {
            let verifier = s.spawn(|| -> specula::Result<f64> {
                let start = Instant::now();
                for _ in 0..iters {
                    verify_round(t, tc.as_mut(), &rows)?;
                }
                Ok(ms_per(start, iters))
            });
            let start = Instant::now();
            let drafted =
                (0..iters).try_for_each(|_| draft_round(d, dc.as_mut(), rows[0], k).map(|_| ()));
            let draft = ms_per(start, iters);
            (verifier.join(), drafted.map(|_| draft))
        });
        let free_verify = free_verify.map_err(|_| "the verifying thread panicked")??;
        let free_draft = free_draft?;
        let sum = verify_ms + draft_ms;
        println!(
            "{k} | {verify_ms:.3} | {draft_ms:.3} | {sum:.3} | {lock_ms:.3} | {:.2} | {:.2} | {free_verify:.3}, {free_draft:.3}",
            lock_ms / sum,
            lock_ms / verify_ms.max(draft_ms)
        );
    }
    Ok(())
}
