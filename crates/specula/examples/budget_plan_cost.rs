//! What the draft budget's per-step work costs on the host: the engine calls `DraftBudget::plan` before every
//! step and feeds it the step's measurements after (`observe_step`, `observe_cycle`, `observe_outcome`). On a GPU a
//! 32-request step of the 1.5B takes ~2.8 ms, so every 0.1 ms of host work between steps is 3.5% of throughput.
//!
//!     cargo run --release -p specula --example budget_plan_cost [REQUESTS] [DRAFT_TOKENS] [STEPS]
//!
//! Drives a budget the way a server with REQUESTS decoding requests of DRAFT_TOKENS-token drafts does, with GPU-like
//! step prices (a flat forward curve over every row count a server prepares), and prints the median host time of
//! plan() and of the observations a step, over STEPS steps.
use std::time::Instant;

use specula::draft::budget::{DraftBudget, DraftCandidate};

fn main() {
    let args: Vec<usize> = match std::env::args().skip(1).map(|a| a.parse()).collect() {
        Ok(args) => args,
        Err(_) => {
            eprintln!("usage: budget_plan_cost [REQUESTS] [DRAFT_TOKENS] [STEPS] (whole numbers)");
            std::process::exit(2);
        }
    };
    let requests = args.first().copied().unwrap_or(32);
    let k = args.get(1).copied().unwrap_or(3);
    let steps = args.get(2).copied().unwrap_or(2000);
    let mut budget = DraftBudget::new();
    // A deterministic generator for acceptance and timing noise.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    // Warm-up: every row count 1..=128 measured a few times, as a server that prepared its steps sees them.
    for _ in 0..4 {
        for rows in 1..=128usize {
            let t = 0.0014 + 0.00001 * rows as f64 * (1.0 + 0.05 * next());
            budget.observe_step(rows, t, 0, 0, 0, 0.0, 0.00007);
        }
    }
    let mut plan_s = Vec::with_capacity(steps);
    let mut observe_s = Vec::with_capacity(steps);
    let mut drafted_steps = 0usize;
    for step in 0..steps {
        let candidates: Vec<DraftCandidate> = (0..requests)
            .map(|i| DraftCandidate {
                id: i as u64,
                max_tokens: k,
                lag: 1,
                shared_by: 1,
                cheap_catch_up: true,
                catch_up_reach: DraftBudget::MAX_CHEAP_CATCH_UP_BESIDE_OTHERS,
            })
            .collect();
        let t0 = Instant::now();
        let plan = budget.plan(&candidates, requests, requests);
        plan_s.push(t0.elapsed().as_secs_f64());
        let drafted: usize = plan.limits.iter().sum();
        drafted_steps += usize::from(drafted > 0);
        let t1 = Instant::now();
        let rows = requests + drafted;
        let forward = 0.0014 + 0.00001 * rows as f64 * (1.0 + 0.05 * next());
        budget.observe_step(
            rows,
            forward,
            drafted,
            drafted,
            0,
            0.0001 * drafted as f64,
            0.00007,
        );
        for (i, &limit) in plan.limits.iter().enumerate() {
            if limit > 0 {
                let accepted = (0..limit).take_while(|_| next() < 0.6).count();
                budget.observe_cycle(i as u64, limit, limit, accepted);
            }
        }
        if let Some(s) = plan.expected_s {
            budget.observe_outcome(drafted > 0, s, forward);
        }
        observe_s.push(t1.elapsed().as_secs_f64());
        // Requests come and go: one replaced every 64 steps.
        if step % 64 == 63 {
            budget.remove((step / 64 % requests) as u64);
        }
    }
    let median_us = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] * 1e6
    };
    let p90_us = |v: &Vec<f64>| v[v.len() * 9 / 10] * 1e6;
    let (plan_med, observe_med) = (median_us(&mut plan_s), median_us(&mut observe_s));
    println!(
        "{requests} requests, k = {k}, {steps} steps ({drafted_steps} drafted): plan {plan_med:.1} us (p90 {:.1}), \
         observations {observe_med:.1} us (p90 {:.1}) a step",
        p90_us(&plan_s),
        p90_us(&observe_s)
    );
}
