//! Largest logit difference between the fast and the reference matmul kernels over a prompt's positions.
//! `cargo run --release --example kernel_logit_diff -- MODEL PROMPT`

use specula::backend::cpu::weights::{set_matmul_kernel, MatmulKernel};
use specula::model::{ForwardOptions, LogitsFor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args.get(1).map(String::as_str).unwrap_or("smollm2-135m");
    let prompt = args
        .get(2)
        .map(String::as_str)
        .unwrap_or("The capital of France is");
    let loaded = specula::load_model(spec, false, &mut |l| eprintln!("{l}"))?;
    let ids = loaded.tokenizer.encode(prompt)?;
    let prof = specula::profile::Profiler::disabled();
    let layers: Vec<usize> = (0..loaded.model.config().num_layers).collect();
    let run = |kernel| -> Result<specula::model::forward::HostOutput, specula::Error> {
        set_matmul_kernel(kernel);
        let model = loaded.model.as_ref();
        let mut cache = specula::testing::full_cache(model);
        let opts = ForwardOptions {
            capture_layers: &layers,
            vocab_limit: None,
        };
        model
            .forward_one(&ids, cache.as_mut(), &opts, LogitsFor::All, &prof)?
            .to_host()
    };
    let fast_out = run(MatmulKernel::Fast)?;
    let reference_out = run(MatmulKernel::Reference)?;
    for ((l, a), (_, b)) in fast_out.hidden.iter().zip(&reference_out.hidden) {
        let (a, b) = (&a.data, &b.data);
        let d = a
            .iter()
            .zip(b)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        let mx = b.iter().map(|v| v.abs()).fold(0f32, f32::max);
        println!("layer {l}: max |diff| {d:.6} of max |h| {mx:.2}");
    }
    let (fast, reference) = (fast_out.logits.data, reference_out.logits.data);
    let max_diff = fast
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let max_abs = reference.iter().map(|v| v.abs()).fold(0f32, f32::max);
    let vocab = fast.len() / ids.len();
    for (name, logits) in [("fast", &fast), ("reference", &reference)] {
        let last = &logits[logits.len() - vocab..];
        let mut idx: Vec<usize> = (0..vocab).collect();
        idx.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
        let top: Vec<String> = idx[..4]
            .iter()
            .map(|&i| {
                format!(
                    "{:?}={:.3}",
                    loaded.tokenizer.decode(&[i as u32]).unwrap_or_default(),
                    last[i]
                )
            })
            .collect();
        println!("{name} top at last position: {}", top.join(" "));
    }
    println!(
        "{spec}: {} positions, max |logit| {max_abs:.3}, max |fast - reference| {max_diff:.5}",
        ids.len()
    );
    Ok(())
}
