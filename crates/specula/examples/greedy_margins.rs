//! The smallest top-1/top-2 logit margin along each prompt's greedy path: prompts whose greedy continuation has
//! no near-tie make robust exact-token tests. `cargo run --release --example greedy_margins -- MODEL N PROMPT...`

use specula::model::LogitsFor;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args.get(1).map(String::as_str).unwrap_or("smollm2-135m");
    let n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let loaded = specula::load_model(spec, false, &mut |l| eprintln!("{l}"))?;
    for prompt in &args[3..] {
        let model = loaded.model.as_ref();
        let mut cache = specula::testing::full_cache(model);
        let mut input = loaded.tokenizer.encode(prompt)?;
        let mut generated = Vec::new();
        let mut min_margin = (f32::INFINITY, 0);
        for step in 0..n {
            let out =
                specula::testing::forward_host(model, &input, cache.as_mut(), LogitsFor::Last);
            let logits = out.last();
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            let margin = logits[idx[0]] - logits[idx[1]];
            if margin < min_margin.0 {
                min_margin = (margin, step);
            }
            let next = idx[0] as u32;
            if loaded.tokenizer.is_stop(next) {
                break;
            }
            generated.push(next);
            input = vec![next];
        }
        println!(
            "{prompt:?}: min margin {:.3} at token {}; {:?} {:?}",
            min_margin.0,
            min_margin.1,
            loaded.tokenizer.decode(&generated)?,
            generated
        );
    }
    Ok(())
}
