//! Forward-pass properties on tiny random models written through the real loaders.

use super::*;
use crate::model::weights::GgmlType;
use crate::profile::Profiler;
use crate::testing::{write_tiny_gguf, write_tiny_hf_dir, TinySpec};

fn load_tiny(spec: &TinySpec) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, spec).unwrap();
    let m = load_gguf(&path, "tiny").unwrap();
    (dir, m)
}

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 32, 256, 257, 33];

fn all_logits(model: &LlamaModel, tokens: &[u32], cache: &mut KvCache) -> ForwardOutput {
    model
        .forward(
            tokens,
            cache,
            &ForwardOptions::default(),
            &Profiler::disabled(),
        )
        .unwrap()
}

#[test]
fn sequence_forward_equals_token_by_token_with_cache() {
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1] {
        let (_d, m) = load_tiny(&TinySpec {
            weight_type: ty,
            ..Default::default()
        });
        let model = &m.model;
        let mut cache = model.new_cache();
        let batch = all_logits(model, &TOKENS, &mut cache);
        assert_eq!(batch.rows, TOKENS.len());
        let mut cache = model.new_cache();
        for (i, &t) in TOKENS.iter().enumerate() {
            let one = all_logits(model, &[t], &mut cache);
            // Batch invariance: bitwise equal, not just close.
            assert_eq!(one.row(0), batch.row(i), "{} position {i}", ty.name());
        }
        assert_eq!(cache.len(), TOKENS.len());
    }
}

#[test]
fn k_quant_model_is_batch_invariant() {
    let (_d, m) = load_tiny(&TinySpec {
        hidden: 256,
        intermediate: 512,
        heads: 4,
        kv_heads: 2,
        weight_type: GgmlType::Q4K,
        ..Default::default()
    });
    let mut cache = m.model.new_cache();
    let batch = all_logits(&m.model, &TOKENS, &mut cache);
    let mut cache = m.model.new_cache();
    all_logits(&m.model, &TOKENS[..4], &mut cache);
    let rest = all_logits(&m.model, &TOKENS[4..], &mut cache);
    for i in 0..rest.rows {
        assert_eq!(rest.row(i), batch.row(4 + i));
    }
}

#[test]
fn truncating_the_cache_and_refeeding_reproduces_logits() {
    let (_d, m) = load_tiny(&TinySpec::default());
    let model = &m.model;
    let mut cache = model.new_cache();
    let reference = all_logits(model, &TOKENS, &mut cache);
    // Go past L = 5 with different tokens, then roll back and feed the original continuation.
    let mut cache = model.new_cache();
    all_logits(model, &TOKENS[..5], &mut cache);
    all_logits(model, &[1, 2, 3], &mut cache);
    assert_eq!(cache.len(), 8);
    cache.truncate(5);
    assert_eq!(cache.len(), 5);
    let refed = all_logits(model, &TOKENS[5..], &mut cache);
    for i in 0..refed.rows {
        assert_eq!(refed.row(i), reference.row(5 + i), "position {}", 5 + i);
    }
}

#[test]
fn cache_growth_keeps_earlier_positions() {
    // More than the initial capacity (64) forces a re-layout of the head-major cache.
    let (_d, m) = load_tiny(&TinySpec::default());
    let tokens: Vec<u32> = (0..100).map(|i| (i * 7 % 250) as u32).collect();
    let mut cache = m.model.new_cache();
    let batch = all_logits(&m.model, &tokens, &mut cache);
    let mut cache = m.model.new_cache();
    for chunk in tokens.chunks(30) {
        let start = cache.len();
        let out = all_logits(&m.model, chunk, &mut cache);
        for i in 0..out.rows {
            assert_eq!(out.row(i), batch.row(start + i));
        }
    }
}

#[test]
fn hidden_state_capture_returns_requested_layers() {
    let spec = TinySpec {
        layers: 3,
        ..Default::default()
    };
    let (_d, m) = load_tiny(&spec);
    let mut cache = m.model.new_cache();
    let opts = ForwardOptions {
        logits: LogitsFor::Last,
        capture_layers: &[2, 0],
        vocab_limit: None,
    };
    let out = m
        .model
        .forward(&TOKENS[..4], &mut cache, &opts, &Profiler::disabled())
        .unwrap();
    assert_eq!(out.rows, 1);
    let layers: Vec<usize> = out.hidden.iter().map(|(l, _)| *l).collect();
    assert_eq!(layers, vec![2, 0]);
    for (_, h) in &out.hidden {
        assert_eq!(h.len(), 4 * spec.hidden);
    }
    assert_ne!(out.hidden[0].1, out.hidden[1].1);
    // The last layer's output, normed and projected by the (tied) head, is exactly the logits.
    let last = &out.hidden[0].1[3 * spec.hidden..];
    let cfg = &m.model.config;
    let mut normed = vec![0f32; spec.hidden];
    let norm_w = vec_from_gguf(&m, "output_norm.weight", spec.hidden);
    ops::rms_norm(last, &norm_w, cfg.rms_norm_eps as f32, &mut normed);
    let embed = gguf::GgufFile::open(&m.path)
        .unwrap()
        .weight("token_embd.weight", cfg.vocab_size, spec.hidden)
        .unwrap();
    let mut logits = vec![0f32; cfg.vocab_size];
    embed.matmul(&normed, 1, &mut logits);
    assert_eq!(logits, out.last());

    let bad = ForwardOptions {
        logits: LogitsFor::Last,
        capture_layers: &[3],
        vocab_limit: None,
    };
    let err = m
        .model
        .forward(&[1], &mut m.model.new_cache(), &bad, &Profiler::disabled());
    assert!(err.unwrap_err().to_string().contains("has 3 layers"));
}

fn vec_from_gguf(m: &LoadedModel, name: &str, n: usize) -> Vec<f32> {
    gguf::GgufFile::open(&m.path)
        .unwrap()
        .weight(name, 1, n)
        .unwrap()
        .to_f32()
}

#[test]
fn gguf_and_safetensors_checkpoints_give_the_same_logits() {
    // qwen2 uses the same RoPE pairing in both formats, so f32 weights must agree exactly.
    let spec = TinySpec::default();
    let (_d, g) = load_tiny(&spec);
    let dir = tempfile::tempdir().unwrap();
    write_tiny_hf_dir(dir.path(), &spec).unwrap();
    let hf = load_path(dir.path(), "tiny-hf").unwrap();
    assert_eq!(hf.format, Format::Safetensors);
    assert_eq!(hf.model.config.vocab_size, g.model.config.vocab_size);
    let a = all_logits(&g.model, &TOKENS, &mut g.model.new_cache());
    let b = all_logits(&hf.model, &TOKENS, &mut hf.model.new_cache());
    assert_eq!(a.logits, b.logits);
    // Both tokenizers split ChatML text the same way.
    let text = hf.format_prompt("the cat", false, None).unwrap();
    assert_eq!(
        hf.tokenizer.encode(&text).unwrap(),
        g.tokenizer.encode(&text).unwrap()
    );
}

#[test]
fn tiny_tokenizer_round_trips_and_matches_special_tokens() {
    let (_d, m) = load_tiny(&TinySpec::default());
    let text = "<|im_start|>user\nthe tea\n<|im_end|>";
    let ids = m.tokenizer.encode(text).unwrap();
    assert_eq!(ids[0], 258, "<|im_start|> is one token");
    assert_eq!(*ids.last().unwrap(), 259);
    assert!(ids.contains(&256), "merged ' t'");
    assert!(ids.contains(&257), "merged 'he'");
    assert_eq!(m.tokenizer.decode(&ids).unwrap(), text);
    assert!(m.tokenizer.is_stop(259));
}

/// A vocabulary-limited forward (a draft model's reduced LM head) gives exactly the first `limit` logits of the
/// full forward, for quantized heads too; limits outside 1..=vocab are refused.
#[test]
fn vocab_limited_logits_are_a_prefix_of_the_full_logits() {
    for weight_type in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1] {
        let spec = TinySpec {
            weight_type,
            ..Default::default()
        };
        let (_d, m) = load_tiny(&spec);
        let vocab = m.model.config.vocab_size;
        let run = |limit: Option<usize>| {
            let opts = ForwardOptions {
                logits: LogitsFor::All,
                capture_layers: &[],
                vocab_limit: limit,
            };
            m.model.forward(
                &TOKENS[..3],
                &mut m.model.new_cache(),
                &opts,
                &Profiler::disabled(),
            )
        };
        let full = run(None).unwrap();
        let limited = run(Some(100)).unwrap();
        assert_eq!(limited.vocab, 100);
        for i in 0..3 {
            assert_eq!(
                limited.row(i),
                &full.row(i)[..100],
                "{weight_type:?} row {i}"
            );
        }
        assert_eq!(run(Some(vocab)).unwrap().logits, full.logits);
        for bad in [0, vocab + 1] {
            let err = run(Some(bad)).unwrap_err().to_string();
            assert!(err.contains("vocabulary limit"), "{err}");
        }
    }
}
