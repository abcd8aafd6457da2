//! Where a draft model agrees with its target's greedy output, token by token: the target decodes each prompt
//! greedily, then the draft model reads prompt and output in one pass, and position t of the output is marked
//! when the draft's own greedy token there (from the true prefix) equals the target's.
//!
//! `cargo run --release --example draft_agreement -- TARGET DRAFT PROMPTS.jsonl MAX_TOKENS [VOCAB_LIMIT]`
//!
//! Prints one JSON line a prompt: `{"id": ..., "agree": "1101..."}`. With greedy drafting this string is all
//! a chain of any length needs: a draft started at position t is accepted for as many tokens as the run of 1s
//! starting at t (a right draft token continues from the true prefix, a wrong one ends the draft), so the draft
//! budget's simulations replay real acceptance from it (draft/budget_traces.rs).

use specula::bench::{read_prompts, BadLines};
use specula::decode::{generate, GenerateRequest};
use specula::model::{ForwardOptions, LogitsFor};
use specula::profile::Profiler;
use specula::sampling::SamplingParams;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        return Err(
            "usage: draft_agreement TARGET DRAFT PROMPTS.jsonl MAX_TOKENS [VOCAB_LIMIT]".into(),
        );
    }
    let max_tokens: usize = args[3].parse()?;
    let vocab_limit: Option<usize> = args.get(4).map(|v| v.parse()).transpose()?;
    let target = specula::load_model(&args[0], false, &mut |l| eprintln!("{l}"))?;
    let draft = specula::load_model(&args[1], false, &mut |l| eprintln!("{l}"))?;
    let (prompts, _) = read_prompts(std::path::Path::new(&args[2]), BadLines::Stop)?;
    for p in prompts {
        let text = target.format_prompt(&p.prompt, false, None)?;
        let prompt = target.tokenizer.encode(&text)?;
        let req = GenerateRequest {
            prompt_tokens: prompt.clone(),
            max_new_tokens: max_tokens,
            sampling: SamplingParams::default(),
            // As the server benchmarks run (`--ignore-eos`): every answer MAX_TOKENS long.
            stop_at_eos: false,
            cancel: None,
            logprobs: None,
            logit_adjustments: None,
            stop_token_ids: Vec::new(),
        };
        let out = generate(
            target.model.as_ref(),
            &target.tokenizer,
            &req,
            None,
            &Profiler::disabled(),
            &mut |_| {},
        )?;
        let output = out.tokens;
        if output.is_empty() {
            continue;
        }
        // The draft's prediction of output[t] is its argmax after prompt ++ output[..t].
        let mut fed = prompt.clone();
        fed.extend_from_slice(&output[..output.len() - 1]);
        let m = draft.model.as_ref();
        let mut cache = m.new_cache(fed.len() + 1)?;
        let opts = ForwardOptions {
            capture_layers: &[],
            vocab_limit,
        };
        let logits = m
            .forward_one(
                &fed,
                cache.as_mut(),
                &opts,
                LogitsFor::All,
                &Profiler::disabled(),
            )?
            .logits;
        let predicted = logits.argmax_rows()?;
        let agree: String = output
            .iter()
            .enumerate()
            .map(|(t, &y)| {
                if predicted[prompt.len() - 1 + t] == y {
                    '1'
                } else {
                    '0'
                }
            })
            .collect();
        eprintln!(
            "{}: {} tokens, draft agrees at {:.1}%",
            p.id,
            output.len(),
            100.0 * agree.matches('1').count() as f64 / output.len() as f64
        );
        println!(
            "{}",
            serde_json::json!({"id": p.id, "agree": agree, "target": args[0], "draft": args[1]})
        );
    }
    Ok(())
}
