//! What one forward pass costs for S sequences of R rows each (S x R: the server's decode steps, 8x1, and its
//! drafted steps, 8x2 for eight requests verifying one drafted token), each sequence with its own cache of the
//! same context, shapes interleaved over rounds in one process; median ms per pass including the upload of its
//! tables and the read-back of every row's argmax (what a server step waits for).
//! `cargo run --release -p specula --example forward_shapes -- MODEL DEVICE SHAPES [ROUNDS] [CONTEXT]`
//! e.g. `forward_shapes random:qwen2.5-1.5b cuda 1x1,8x1,4x2,8x2,1x16,16x1 20 64`

use specula::model::{ForwardOptions, LogitsFor, SequenceInput};
use specula::profile::Profiler;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage =
        "usage: forward_shapes MODEL DEVICE SHAPES [ROUNDS] [CONTEXT] (SHAPES: SxR,SxR,...)";
    let args: Vec<String> = std::env::args().collect();
    let spec = args.get(1).ok_or(usage)?;
    let device: specula::backend::Device = args.get(2).ok_or(usage)?.parse()?;
    let shapes: Vec<(usize, usize)> = args
        .get(3)
        .ok_or(usage)?
        .split(',')
        .map(|s| {
            let (a, b) = s.split_once('x').ok_or(format!("shape {s:?} is not SxR"))?;
            Ok::<_, String>((
                a.parse().map_err(|_| format!("{a:?} in {s:?}"))?,
                b.parse().map_err(|_| format!("{b:?} in {s:?}"))?,
            ))
        })
        .collect::<Result<_, _>>()?;
    if shapes.iter().any(|&(s, r)| s == 0 || r == 0) {
        return Err(format!("every shape needs at least one sequence and row; {usage}").into());
    }
    let rounds: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let context_len: usize = args.get(5).map(|s| s.parse()).transpose()?.unwrap_or(64);
    let loaded = specula::load_model_on(spec, device, false, &mut |l| eprintln!("{l}"))?;
    let model = loaded.model.as_ref();
    let vocab = model.config().vocab_size as u32;
    let context: Vec<u32> = (0..context_len as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let quiet = Profiler::disabled();
    let opts = ForwardOptions::default();
    let most_sequences = shapes.iter().map(|&(s, _)| s).max().unwrap_or(1);
    let most_rows = shapes.iter().map(|&(_, r)| r).max().unwrap_or(1);
    // One prefill, copied into every cache (a profiler then sees one prefill pass, not one a sequence).
    let mut first = model.new_cache(context.len() + most_rows + 1)?;
    model.forward_one(&context, first.as_mut(), &opts, LogitsFor::None, &quiet)?;
    let mut caches = Vec::with_capacity(most_sequences);
    for _ in 1..most_sequences {
        let mut c = model.new_cache(context.len() + most_rows + 1)?;
        c.copy_prefix_from(first.as_ref(), context.len())?;
        caches.push(c);
    }
    caches.insert(0, first);
    let rows: Vec<Vec<u32>> = (0..most_sequences)
        .map(|s| {
            (0..most_rows as u32)
                .map(|j| (s as u32 * 31 + j * 17 + 5) % vocab)
                .collect()
        })
        .collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); shapes.len()];
    // Two rounds unrecorded: a shape's first pass captures its graph.
    for round in 0..rounds + 2 {
        for (i, &(s, r)) in shapes.iter().enumerate() {
            let start = Instant::now();
            let outputs = {
                let mut batch: Vec<SequenceInput<'_>> = caches[..s]
                    .iter_mut()
                    .zip(&rows)
                    .map(|(cache, tokens)| SequenceInput {
                        tokens: &tokens[..r],
                        cache: cache.as_mut(),
                        logits: LogitsFor::All,
                        tree: None,
                    })
                    .collect();
                model.forward(&mut batch, &opts, &quiet)?
            };
            for out in &outputs {
                out.logits.argmax_rows()?;
            }
            let ms = start.elapsed().as_secs_f64() * 1e3;
            if round >= 2 {
                times[i].push(ms);
            }
            for c in &mut caches[..s] {
                c.truncate(context.len());
            }
        }
    }
    println!(
        "{} on {}, context {} tokens, {rounds} rounds: median ms a pass",
        loaded.spec,
        model.device(),
        context.len()
    );
    for (&(s, r), t) in shapes.iter().zip(&mut times) {
        t.sort_by(f64::total_cmp);
        let median = t[t.len() / 2];
        println!("{s:>3} x {r:<3} {:>4} rows {median:8.3}", s * r);
    }
    Ok(())
}
