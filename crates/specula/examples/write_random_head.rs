//! Writes a random EAGLE-3 head for a `--random-weights` shape (its width, heads and vocabulary; MLP 2x the width,
//! f32 safetensors). It accepts next to nothing, which is the point: a head server over a random-weights target
//! then pays the head's per-step bookkeeping (captured hidden states, the draft budget) while drafting little, the
//! regime where session 22 measured it 2-5% under plain on the H200 (scripts/gpu-serve-random.sh).
//! SHAPE may also be a GGUF file, for a head over that model (a tiny one: the server's host costs on the CPU).
//! INTERMEDIATE sets the MLP's width (the registry 1.5B head's is 4096: its passes' real cost on a GPU).
//! `cargo run --release -p specula --example write_random_head -- OUT_DIR SHAPE|MODEL.gguf [DRAFT_VOCAB [INTERMEDIATE]]`

use specula::model::config::Config;
use specula::testing::{write_tiny_eagle3_head, TinyHeadSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: write_random_head OUT_DIR SHAPE [DRAFT_VOCAB [INTERMEDIATE]] (SHAPE: llama-3.1-8b, qwen2.5-1.5b, qwen2.5-0.5b, or a .gguf model)";
    let args: Vec<String> = std::env::args().collect();
    let out = args.get(1).ok_or(usage)?;
    let shape = args.get(2).ok_or(usage)?;
    let target = if shape.ends_with(".gguf") {
        Config::from_gguf(&specula::model::gguf::GgufFile::open(
            std::path::Path::new(shape),
        )?)?
    } else {
        Config::shape(shape)?
    };
    let draft_vocab: usize = match args.get(3) {
        Some(s) => s
            .parse()
            .map_err(|_| format!("DRAFT_VOCAB {s:?} is not a number; {usage}"))?,
        None => 32000.min(target.vocab_size),
    };
    if draft_vocab == 0 || draft_vocab > target.vocab_size {
        return Err(format!(
            "DRAFT_VOCAB {draft_vocab} must be between 1 and the shape's vocabulary ({})",
            target.vocab_size
        )
        .into());
    }
    let intermediate = match args.get(4) {
        Some(s) => match s.parse::<usize>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                return Err(format!("INTERMEDIATE {s:?} is not a positive number; {usage}").into())
            }
        },
        None => None,
    };
    let spec = TinyHeadSpec {
        intermediate,
        draft_vocab,
        first: 0,
        stride: 1,
        // No layer ids in config.json for a real shape: the loader's default wiring applies. A small model may
        // have too few layers for that default: low, middle and high of its own.
        aux_layers: (target.num_layers < 8).then(|| {
            let n = target.num_layers;
            vec![0, n / 2, n - 1]
        }),
        ..Default::default()
    };
    write_tiny_eagle3_head(std::path::Path::new(out), &target, &spec)?;
    Ok(())
}
