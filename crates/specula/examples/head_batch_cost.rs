//! What an EAGLE-3 head's chain steps cost for n requests, one request after the other against one batched pass
//! (`HeadCompute::run_many`, what a server's step does), interleaved over rounds in one process.
//! `cargo run --release --example head_batch_cost -- TARGET HEAD [THREADS] [ROUNDS]`

use specula::draft::eagle3::{Eagle3Head, HeadCompute, HeadInput, HeadPass, HeadRows, HeadWant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let target_spec = args
        .get(1)
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-1.5b");
    let head_spec = args
        .get(2)
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-1.5b-eagle3");
    let threads: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let rounds: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(5);
    specula::parallel::set_threads(threads)?;
    let loaded = specula::load_model(target_spec, false, &mut |l| eprintln!("{l}"))?;
    let target = loaded.model.as_ref();
    let head = Eagle3Head::load_as(
        &specula::registry::locate_head(head_spec)?,
        specula::draft::eagle3::HeadPrecision::Q8_0,
    )?;
    head.check_target(target.config())?;
    let width = 3 * head.config.target_hidden;
    // Fed rows of 16 positions per request (the values only need to be finite), then chain steps.
    let fed = 16usize;
    let features: Vec<f32> = (0..fed * width)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let tokens: Vec<u32> = (0..fed as u32).map(|t| 100 + t).collect();
    let want = HeadWant {
        top_only: true,
        ..Default::default()
    };
    let sizes = [1usize, 2, 4, 8];
    let mut alone = vec![Vec::new(); sizes.len()];
    let mut together = vec![Vec::new(); sizes.len()];
    for _ in 0..rounds {
        for (s, &n) in sizes.iter().enumerate() {
            for batched in [false, true] {
                let mut caches = (0..n)
                    .map(|_| HeadCompute::new_cache(&head, 256))
                    .collect::<Result<Vec<_>, _>>()?;
                for c in caches.iter_mut() {
                    head.run(
                        target,
                        &tokens,
                        HeadInput::Features(&features),
                        HeadRows::Chain,
                        c.as_mut(),
                        want,
                    )?;
                }
                // Three chain steps of every request.
                let t = std::time::Instant::now();
                for step in 0..3u32 {
                    let token = [200 + step];
                    if batched {
                        let mut passes: Vec<HeadPass<'_>> = caches
                            .iter_mut()
                            .map(|c| HeadPass {
                                tokens: &token,
                                input: HeadInput::Last,
                                cache: c.as_mut(),
                                want,
                            })
                            .collect();
                        head.run_many(target, &mut passes)?;
                    } else {
                        for c in caches.iter_mut() {
                            head.run(
                                target,
                                &token,
                                HeadInput::Last,
                                HeadRows::Chain,
                                c.as_mut(),
                                want,
                            )?;
                        }
                    }
                }
                let ms = t.elapsed().as_secs_f64() * 1e3 / 3.0;
                if batched {
                    together[s].push(ms);
                } else {
                    alone[s].push(ms);
                }
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("requests  one after the other (ms a chain step)  batched (ms)  ratio");
    for (s, &n) in sizes.iter().enumerate() {
        let (a, b) = (median(&mut alone[s]), median(&mut together[s]));
        println!("{n:>8}  {a:>38.2}  {b:>12.2}  {:>5.2}x", a / b);
    }
    Ok(())
}
