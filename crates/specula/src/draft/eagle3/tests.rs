//! EAGLE-3 on tiny random models: the head's layout and forward pass against a plain reference written from the
//! published formula, greedy speculation equal to plain decoding, and bad heads refused with the problem named.

use super::*;
use crate::decode::{generate, GenerateRequest, Speculation};
use crate::model::safetensors::SafetensorsFiles;
use crate::model::tensors::WeightSource;
use crate::model::{load_gguf, LoadedModel};
use crate::profile::Profiler;
use crate::testing::{write_tiny_eagle3_head, write_tiny_gguf, TinyHeadSpec, TinySpec};

fn target(dir: &std::path::Path) -> LoadedModel {
    target_of_width(dir, TinySpec::default().hidden)
}

/// The tests' target, `hidden` wide (its MLP twice that).
fn target_of_width(dir: &std::path::Path, hidden: usize) -> LoadedModel {
    let p = dir.join(format!("t{hidden}.gguf"));
    write_tiny_gguf(
        &p,
        &TinySpec {
            hidden,
            intermediate: 2 * hidden,
            layers: 3,
            seed: 3,
            logit_scale: 0.3,
            // Varied text (a tied tiny model mostly repeats itself), so a wrong cache or alignment shows.
            untied_head: true,
            ..Default::default()
        },
    )
    .unwrap();
    load_gguf(&p, "t").unwrap()
}

fn head(dir: &std::path::Path, t: &LoadedModel, spec: &TinyHeadSpec) -> (Eagle3Head, Vec<u32>) {
    let hd = dir.join("head");
    let used = write_tiny_eagle3_head(&hd, t.model.config(), spec).unwrap();
    (Eagle3Head::load(&hd).unwrap(), used)
}

const PROMPT: [u32; 10] = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108];

/// PROMPT, `n` new tokens at `temperature` (seed 5), no stop at EOS.
fn prompt_request(n: usize, temperature: f32) -> GenerateRequest {
    request_for(&PROMPT, n, temperature, 5)
}

/// `prompt`, `n` new tokens at `temperature` with `seed`, no stop at EOS.
fn request_for(prompt: &[u32], n: usize, temperature: f32, seed: u64) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams {
            temperature,
            seed,
            ..Default::default()
        },
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    }
}

fn run(
    t: &LoadedModel,
    n: usize,
    temperature: f32,
    spec: Option<Speculation<'_>>,
) -> crate::decode::GenerateOutput {
    let req = prompt_request(n, temperature);
    generate(
        t.model.as_ref(),
        &t.tokenizer,
        &req,
        spec,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap()
}

#[test]
fn greedy_eagle3_speculation_equals_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, used) = head(dir.path(), &t, &TinyHeadSpec::default());
    let plain = run(&t, 40, 0.0, None);
    for k in [1, 2, 3, 5] {
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
        assert_eq!(drafter.target_layers(), &[0, 1, 2]);
        let out = run(
            &t,
            40,
            0.0,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: k,
                simulate_acceptance: None,
            }),
        );
        assert_eq!(out.tokens, plain.tokens, "k = {k}");
        let st = out.speculation.unwrap();
        // Every cycle drafts but the last (whose token budget leaves no room for a draft).
        assert!(
            st.drafted + 1 >= st.cycles,
            "k = {k}: {} drafted in {} cycles",
            st.drafted,
            st.cycles
        );
    }
    // Every drafted token is a target id from the draft vocabulary (d2t offsets applied).
    let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    let ctx: Vec<u32> = PROMPT.to_vec();
    let hidden = capture(&t, &ctx[..ctx.len() - 1], drafter.target_layers());
    drafter
        .observe_target(0, &hidden, &(0..ctx.len() - 1).collect::<Vec<_>>())
        .unwrap();
    let draft = drafter
        .propose(&ctx, 6, &SamplingParams::default())
        .unwrap();
    assert_eq!(draft.tokens.len(), 6);
    assert!(
        draft.tokens.iter().all(|t| used.contains(t)),
        "{:?}",
        draft.tokens
    );
}

#[test]
fn sampled_eagle3_drafts_carry_distributions_over_target_ids() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, used) = head(dir.path(), &t, &TinyHeadSpec::default());
    let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    let out = run(
        &t,
        30,
        0.8,
        Some(Speculation {
            drafter: &mut drafter,
            draft_tokens: 3,
            simulate_acceptance: None,
        }),
    );
    assert_eq!(out.tokens.len(), 30);
    let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 1).unwrap();
    let hidden = capture(&t, &PROMPT[..9], drafter.target_layers());
    drafter
        .observe_target(0, &hidden, &(0..9).collect::<Vec<_>>())
        .unwrap();
    let params = SamplingParams {
        temperature: 0.8,
        ..Default::default()
    };
    let draft = drafter.propose(&PROMPT, 3, &params).unwrap();
    let dists = draft.distributions.as_ref().unwrap();
    assert_eq!(dists.len(), 3);
    for (i, d) in dists.iter().enumerate() {
        assert!(d.ids.iter().all(|id| used.contains(id)));
        assert!((d.probs.iter().sum::<f32>() - 1.0).abs() < 1e-4);
        assert!(draft.q(i) > 0.0, "the drawn token has probability under q");
    }
}

/// The target's hidden states of `layers` over `tokens` (a fresh cache).
fn capture(t: &LoadedModel, tokens: &[u32], layers: &[usize]) -> Vec<(usize, Box<dyn RowMatrix>)> {
    let mut cache = t.model.new_cache(64).unwrap();
    let out = t
        .model
        .forward_one(
            tokens,
            cache.as_mut(),
            &crate::model::ForwardOptions {
                capture_layers: layers,
                vocab_limit: None,
            },
            crate::model::LogitsFor::Last,
            &Profiler::disabled(),
        )
        .unwrap();
    out.hidden
}

/// The head's forward written out with plain loops from the published formula (module docs of `head`), reading
/// the checkpoint's tensors directly.
fn reference_forward(
    dir: &std::path::Path,
    c: &crate::model::Config,
    embeds: &[f32],
    features: &[f32],
    n: usize,
    draft_vocab: usize,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let src = SafetensorsFiles::open_dir(dir).unwrap();
    let (h, heads, kv_heads, hd) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
    let ff = 2 * h;
    let t = |name: &str, r: usize, cols: usize| -> Vec<f32> {
        src.tensor(name, r, cols)
            .unwrap()
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let matvec = |w: &[f32], x: &[f32], rows: usize| -> Vec<f32> {
        (0..rows)
            .map(|i| {
                let row = &w[i * x.len()..(i + 1) * x.len()];
                row.iter()
                    .zip(x)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>() as f32
            })
            .collect()
    };
    let rms = |x: &[f32], w: &[f32]| -> Vec<f32> {
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + 1e-6).sqrt();
        x.iter()
            .zip(w)
            .map(|(v, g)| (*v as f64 * s) as f32 * g)
            .collect()
    };
    let rope = |v: &mut [f32], pos: usize| {
        let half = hd / 2;
        for i in 0..half {
            let angle = pos as f64 * 10000f64.powf(-2.0 * i as f64 / hd as f64);
            let (s, co) = angle.sin_cos();
            let (x0, x1) = (v[i] as f64, v[i + half] as f64);
            v[i] = (x0 * co - x1 * s) as f32;
            v[i + half] = (x0 * s + x1 * co) as f32;
        }
    };
    let fc = t("fc.weight", h, 3 * h);
    let (wq, wk, wv, wo) = (
        t("midlayer.self_attn.q_proj.weight", heads * hd, 2 * h),
        t("midlayer.self_attn.k_proj.weight", kv_heads * hd, 2 * h),
        t("midlayer.self_attn.v_proj.weight", kv_heads * hd, 2 * h),
        t("midlayer.self_attn.o_proj.weight", h, heads * hd),
    );
    let (gate, up, down) = (
        t("midlayer.mlp.gate_proj.weight", ff, h),
        t("midlayer.mlp.up_proj.weight", ff, h),
        t("midlayer.mlp.down_proj.weight", h, ff),
    );
    let (hn, inn, pan, fnorm) = (
        t("midlayer.hidden_norm.weight", 1, h),
        t("midlayer.input_layernorm.weight", 1, h),
        t("midlayer.post_attention_layernorm.weight", 1, h),
        t("norm.weight", 1, h),
    );
    let lm = t("lm_head.weight", draft_vocab, h);
    let mut keys: Vec<Vec<f32>> = Vec::new();
    let mut values: Vec<Vec<f32>> = Vec::new();
    let mut outs = Vec::new();
    for r in 0..n {
        let x = matvec(&fc, &features[r * 3 * h..(r + 1) * 3 * h], h);
        let mut a = rms(&embeds[r * h..(r + 1) * h], &inn);
        a.extend(rms(&x, &hn));
        let mut q = matvec(&wq, &a, heads * hd);
        let mut k = matvec(&wk, &a, kv_heads * hd);
        let v = matvec(&wv, &a, kv_heads * hd);
        for head in q.chunks_exact_mut(hd) {
            rope(head, r);
        }
        for head in k.chunks_exact_mut(hd) {
            rope(head, r);
        }
        keys.push(k);
        values.push(v);
        let mut attn = vec![0f32; heads * hd];
        for head in 0..heads {
            let kvh = head / (heads / kv_heads);
            let qh = &q[head * hd..(head + 1) * hd];
            let scores: Vec<f64> = keys
                .iter()
                .map(|k| {
                    qh.iter()
                        .zip(&k[kvh * hd..(kvh + 1) * hd])
                        .map(|(a, b)| (*a as f64) * (*b as f64))
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (w, v) in e.iter().zip(&values) {
                for d in 0..hd {
                    attn[head * hd + d] += (w / sum * v[kvh * hd + d] as f64) as f32;
                }
            }
        }
        let o = matvec(&wo, &attn, h);
        let r1: Vec<f32> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        let m = rms(&r1, &pan);
        let g = matvec(&gate, &m, ff);
        let u = matvec(&up, &m, ff);
        let act: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let dn = matvec(&down, &act, h);
        outs.push(r1.iter().zip(&dn).map(|(a, b)| a + b).collect::<Vec<f32>>());
    }
    let last = rms(outs.last().unwrap(), &fnorm);
    let logits = matvec(&lm, &last, draft_vocab);
    (outs, logits)
}

/// The head's inputs for the prompt's first `n` positions: the target's features of layers 0-2 (3H a row) and the
/// embeddings of the tokens they pair with (one position later).
fn head_inputs(t: &LoadedModel, n: usize) -> (Vec<f32>, Vec<f32>) {
    let hidden = capture(t, &PROMPT[..n], &[0, 1, 2]);
    let mut features = Vec::new();
    for r in 0..n {
        for (_, m) in &hidden {
            features.extend_from_slice(&m.row(r).unwrap());
        }
    }
    (features, t.model.embed_tokens(&PROMPT[1..=n]).unwrap())
}

#[test]
fn head_forward_matches_the_published_formula() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let c = t.model.config().clone();
    let n = 5;
    let (features, embeds) = head_inputs(&t, n);
    let (want_out, want_logits) =
        reference_forward(&dir.path().join("head"), &c, &embeds, &features, n, 100);
    // All rows in one pass.
    let mut cache = h.new_cache(64);
    let x = h.fc(&features, n);
    let (out, logits) = h.forward(&embeds, &x, n, &mut cache).unwrap();
    let close = |a: &[f32], b: &[f32], what: &str| {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    };
    for r in 0..n {
        close(
            &out[r * c.hidden_size..(r + 1) * c.hidden_size],
            &want_out[r],
            "row output",
        );
    }
    close(&logits, &want_logits, "logits");
    // One row at a time through the cache: the same outputs.
    let mut cache = h.new_cache(64);
    for r in 0..n {
        let hs = c.hidden_size;
        let (o, l) = h
            .forward(
                &embeds[r * hs..(r + 1) * hs],
                &x[r * hs..(r + 1) * hs],
                1,
                &mut cache,
            )
            .unwrap();
        close(&o, &want_out[r], "incremental row output");
        if r == n - 1 {
            close(&l, &want_logits, "incremental logits");
        }
    }
}

fn load_error(t: &LoadedModel, spec: TinyHeadSpec) -> String {
    let dir = tempfile::tempdir().unwrap();
    let hd = dir.path().join("head");
    write_tiny_eagle3_head(&hd, t.model.config(), &spec).unwrap();
    match Eagle3Head::load(&hd) {
        Err(e) => e.to_string(),
        Ok(h) => match Eagle3Drafter::new(&h, t.model.as_ref(), 0) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("the head was accepted"),
        },
    }
}

#[test]
fn heads_that_do_not_fit_the_target_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let e = load_error(
        &t,
        TinyHeadSpec {
            aux_layers: Some(vec![0, 1, 7]),
            ..Default::default()
        },
    );
    assert!(
        e.contains("target layer 7") && e.contains("3 layers"),
        "{e}"
    );
    // No ids and a target too small for the default wiring.
    let e = load_error(
        &t,
        TinyHeadSpec {
            aux_layers: None,
            ..Default::default()
        },
    );
    assert!(e.contains("too few for the default"), "{e}");
    let e = load_error(
        &t,
        TinyHeadSpec {
            target_hidden: Some(128),
            ..Default::default()
        },
    );
    assert!(
        e.contains("width 128") && e.contains("hidden size is 64"),
        "{e}"
    );
    let e = load_error(
        &t,
        TinyHeadSpec {
            config_overrides: serde_json::json!({"architectures": ["LlamaForCausalLM"]}),
            ..Default::default()
        },
    );
    assert!(e.contains("not an EAGLE-3 head"), "{e}");
    let e = load_error(
        &t,
        TinyHeadSpec {
            first: 250,
            ..Default::default()
        },
    );
    assert!(
        e.contains("d2t[") && e.contains("outside the vocabulary"),
        "{e}"
    );
    let e = load_error(
        &t,
        TinyHeadSpec {
            aux_layers: Some(vec![0, 1]),
            ..Default::default()
        },
    );
    assert!(e.contains("has 2 ids"), "{e}");
}

#[test]
fn a_head_for_another_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let hd = dir.path().join("head");
    let mut other = t.model.config().clone();
    other.vocab_size += 10;
    write_tiny_eagle3_head(&hd, &other, &TinyHeadSpec::default()).unwrap();
    let h = Eagle3Head::load(&hd).unwrap();
    let e = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("vocabulary of") && e.contains("target has"),
        "{e}"
    );
}

#[test]
fn default_wiring_is_the_engines_default() {
    let c = HeadConfig::from_json(
        r#"{"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "draft_vocab_size": 100}"#,
        std::path::Path::new("config.json"),
    )
    .unwrap();
    // Outputs of layers 1, 15, 28 = inputs of layers 2, 16, 29 (SGLang's and vLLM's [2, N/2, N-3]) at N = 32.
    assert_eq!(c.target_layers(32).unwrap(), vec![1, 15, 28]);
    assert_eq!(c.layer.rope_theta, 10_000.0);
    assert_eq!(c.draft_vocab, 100);
    let e = HeadConfig::from_json(
        r#"{"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "vocab_size": 300, "draft_vocab_size": 400}"#,
        std::path::Path::new("config.json"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("draft_vocab_size 400"), "{e}");
}

/// The drafter's alignment, pinned (vLLM `v1/spec_decode/eagle.py`, SGLang's prefill): row p pairs the target's
/// features at p with the embedding of token p + 1; the first draft token comes from the last row; each further
/// one feeds the previous output back with the new token's embedding at the next position. Compared through the
/// sampled drafts' distributions (continuous, so any misalignment shows).
#[test]
fn drafter_pairs_features_at_p_with_token_p_plus_1() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let base = PROMPT.len() - 1;
    let hidden = capture(&t, &PROMPT[..base], &[0, 1, 2]);
    let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    drafter
        .observe_target(0, &hidden, &(0..base).collect::<Vec<_>>())
        .unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let draft = drafter.propose(&PROMPT, 2, &params).unwrap();
    let dists = draft.distributions.as_ref().unwrap();

    let mut features = Vec::new();
    for r in 0..base {
        for (_, m) in &hidden {
            features.extend_from_slice(&m.row(r).unwrap());
        }
    }
    let hs = t.model.config().hidden_size;
    let mut cache = h.new_cache(64);
    let embeds = t.model.embed_tokens(&PROMPT[1..=base]).unwrap();
    let (out, logits) = h
        .forward(&embeds, &h.fc(&features, base), base, &mut cache)
        .unwrap();
    let e = t.model.embed_tokens(&draft.tokens[..1]).unwrap();
    let (_, logits2) = h
        .forward(&e, &out[out.len() - hs..], 1, &mut cache)
        .unwrap();
    for (step, l) in [logits, logits2].iter().enumerate() {
        let want = sampling::distribution(l, &params);
        for (&id, &p) in want.ids.iter().zip(&want.probs) {
            let got = dists[step].prob_of(h.target_id(id as usize));
            assert!(
                (got - p).abs() < 1e-6,
                "step {step}, draft id {id}: q {got} vs {p}"
            );
        }
    }
}

/// A head cache sized to the request (a server's: `cache_rows_for`) holds every draft to the request's last token,
/// chains at the longest draft length and trees alike: the same tokens as plain decoding, no error.
#[test]
fn a_head_cache_sized_to_its_request_drafts_to_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let n = 40;
    let plain = run(&t, n, 0.0, None);
    let positions = PROMPT.len() + n;
    let shapes: [(Option<TreeShape>, usize); 3] = [
        (None, crate::decode::MAX_DRAFT_TOKENS),
        (None, 3),
        (Some(TreeShape::new(4, 4, 12).unwrap()), 12),
    ];
    for (tree, k) in shapes {
        let rows = Eagle3Drafter::cache_rows_for(positions, tree);
        assert!(
            rows < t.model.config().context_length,
            "{rows} rows: the test would not shrink the cache"
        );
        let drafter = Eagle3Drafter::with_capacity(&h, t.model.as_ref(), 0, rows).unwrap();
        let mut drafter = match tree {
            Some(shape) => drafter.with_tree(shape),
            None => drafter,
        };
        let out = run(
            &t,
            n,
            0.0,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: k,
                simulate_acceptance: None,
            }),
        );
        assert_eq!(out.tokens, plain.tokens, "tree {tree:?}, k = {k}");
        assert!(
            out.speculation.unwrap().drafted > 0,
            "tree {tree:?}, k = {k}"
        );
    }
}

#[test]
fn greedy_eagle3_tree_speculation_equals_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, used) = head(dir.path(), &t, &TinyHeadSpec::default());
    let plain = run(&t, 40, 0.0, None);
    for (topk, steps, nodes) in [(2, 3, 5), (3, 2, 6), (1, 3, 3), (4, 4, 12)] {
        let shape = TreeShape::new(topk, steps, nodes).unwrap();
        // The tree itself: `nodes` tokens from the draft vocabulary, parents before children, depth <= steps.
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
            .unwrap()
            .with_tree(shape);
        let hidden = capture(&t, &PROMPT[..9], drafter.target_layers());
        drafter
            .observe_target(0, &hidden, &(0..9).collect::<Vec<_>>())
            .unwrap();
        let draft = drafter
            .propose(&PROMPT, nodes, &SamplingParams::default())
            .unwrap();
        let parents = draft.parents.clone().unwrap();
        assert_eq!(draft.tokens.len(), nodes);
        assert!(draft.tokens.iter().all(|t| used.contains(t)));
        let mut depth = vec![0usize; nodes];
        for (i, p) in parents.iter().enumerate() {
            depth[i] = match p {
                None => 1,
                Some(p) => {
                    assert!(*p < i, "parent {p} of node {i} comes first");
                    depth[*p] + 1
                }
            };
            assert!(depth[i] <= steps);
        }
        assert_eq!(
            parents.iter().filter(|p| p.is_none()).count().min(topk),
            parents.iter().filter(|p| p.is_none()).count()
        );
        // Decoding with it: plain decoding's tokens.
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
            .unwrap()
            .with_tree(shape);
        let out = run(
            &t,
            40,
            0.0,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: nodes,
                simulate_acceptance: None,
            }),
        );
        assert_eq!(out.tokens, plain.tokens, "tree {topk}/{steps}/{nodes}");
        assert!(out.speculation.unwrap().drafted > 0);
    }
    // Sampled decoding drafts trees too (verified by lossless tree sampling).
    let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
        .unwrap()
        .with_tree(TreeShape::new(2, 3, 5).unwrap());
    let hidden = capture(&t, &PROMPT[..9], drafter.target_layers());
    drafter
        .observe_target(0, &hidden, &(0..9).collect::<Vec<_>>())
        .unwrap();
    let params = SamplingParams {
        temperature: 0.7,
        ..Default::default()
    };
    let d = drafter.propose(&PROMPT, 5, &params).unwrap();
    assert_eq!(d.tokens.len(), 5);
    assert_eq!(d.parents.as_ref().map(|p| p.len()), Some(5));
}

/// A confidence bar on a tree keeps the nodes whose path probability reaches it: the unpruned tree's first nodes
/// (same tokens, same parents), none at a bar nothing reaches, and decoding with it is still plain decoding.
#[test]
fn a_barred_tree_is_the_unbarred_trees_first_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let shape = TreeShape::new(3, 3, 8).unwrap();
    let propose = |bar: f64| {
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(bar)
            .unwrap()
            .with_tree(shape);
        let hidden = capture(&t, &PROMPT[..9], drafter.target_layers());
        drafter
            .observe_target(0, &hidden, &(0..9).collect::<Vec<_>>())
            .unwrap();
        drafter
            .propose(&PROMPT, 8, &SamplingParams::default())
            .unwrap()
    };
    let full = propose(0.0);
    assert_eq!(full.tokens.len(), 8);
    let full_parents = full.parents.clone().unwrap();
    let mut sizes = Vec::new();
    for bar in [0.0005, 0.002, 0.01, 0.03, 0.1, 0.3] {
        let d = propose(bar);
        let m = d.tokens.len();
        sizes.push(m);
        assert_eq!(d.tokens, full.tokens[..m], "bar {bar}");
        match d.parents {
            Some(p) => assert_eq!(p, full_parents[..m], "bar {bar}"),
            None => assert_eq!(m, 0, "an empty draft is a chain of nothing"),
        }
        assert!(d.passes >= 1 && d.passes <= shape.steps);
    }
    assert!(
        sizes.windows(2).all(|w| w[0] >= w[1]),
        "a higher bar keeps no more nodes: {sizes:?}"
    );
    assert!(
        sizes.iter().any(|&m| m > 0 && m < 8),
        "some bar prunes part of the tree: {sizes:?}"
    );
    let none = propose(1.0);
    assert!(none.tokens.is_empty() && none.parents.is_none());
    // Decoding with a barred tree is plain decoding, with fewer nodes verified.
    let plain = run(&t, 40, 0.0, None);
    let mut drafted = Vec::new();
    for bar in [0.0, 0.03] {
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(bar)
            .unwrap()
            .with_tree(shape);
        let out = run(
            &t,
            40,
            0.0,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: 8,
                simulate_acceptance: None,
            }),
        );
        assert_eq!(out.tokens, plain.tokens, "bar {bar}");
        drafted.push(out.speculation.unwrap().drafted);
    }
    assert!(drafted[1] < drafted[0], "{drafted:?}");
}

#[test]
fn tree_shapes_are_checked() {
    assert!(TreeShape::new(0, 3, 4).is_err());
    assert!(TreeShape::new(2, 0, 4).is_err());
    let e = TreeShape::new(8, 8, 80).unwrap_err().to_string();
    assert!(e.contains("more than 64 rows"), "{e}");
    let e = TreeShape::new(1, 3, 5).unwrap_err().to_string();
    assert!(e.contains("more than 3 steps of top-1"), "{e}");
}

#[test]
fn top_log_probs_are_normalized_and_ordered() {
    let t = top_log_probs(&[0.0, 2.0, 1.0, 2.0], 3);
    assert_eq!(t.iter().map(|x| x.1).collect::<Vec<_>>(), vec![1, 3, 2]);
    let z: f32 = [0.0f32, 2.0, 1.0, 2.0].iter().map(|l| l.exp()).sum();
    assert!((t[0].0 - (2.0 - z.ln())).abs() < 1e-6);
}

#[test]
fn top_log_probs_equal_a_full_sort_with_ties() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for round in 0..50 {
        // Few distinct values, so ties are common.
        let logits: Vec<f32> = (0..200 + round)
            .map(|_| rng.random_range(0..12) as f32 * 0.5)
            .collect();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        for k in [1, 2, 4, 7] {
            let got: Vec<usize> = top_log_probs(&logits, k).iter().map(|x| x.1).collect();
            assert_eq!(got, order[..k].to_vec(), "round {round}, k {k}");
        }
    }
}

#[test]
fn acceptance_far_below_the_training_record_is_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (trained, _) = head(
        dir.path(),
        &t,
        &TinyHeadSpec {
            config_overrides: serde_json::json!({
                "specula_training": {"eval_accuracy_per_step": [0.6, 0.4]}
            }),
            ..Default::default()
        },
    );
    assert_eq!(trained.config.trained_accuracy, Some(vec![0.6, 0.4]));
    let stats = |cycles: usize, accepted_first: usize| {
        let mut s = crate::decode::SpeculationStats::new("eagle3", 3);
        for i in 0..cycles {
            s.record(3, usize::from(i < accepted_first));
        }
        s
    };
    // 10 of 40 = 25% against 60% recorded: flagged, with both numbers.
    let w = check::acceptance_warning(&trained, &stats(40, 10)).expect("a warning");
    assert!(w.contains("25.0%") && w.contains("60.0%"), "{w}");
    // 35% is more than half of 60%: no warning; nor with too few drafts to judge.
    assert!(check::acceptance_warning(&trained, &stats(40, 14)).is_none());
    assert!(check::acceptance_warning(&trained, &stats(20, 0)).is_none());
    // A head without a training record (another exporter's) is never flagged.
    let other = dir.path().join("other");
    write_tiny_eagle3_head(&other, t.model.config(), &TinyHeadSpec::default()).unwrap();
    let other = Eagle3Head::load(&other).unwrap();
    assert!(other.config.trained_accuracy.is_none());
    assert!(check::acceptance_warning(&other, &stats(40, 0)).is_none());
}

#[test]
fn confidence_bar_shortens_chains_and_keeps_greedy_output() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let plain = run(&t, 40, 0.0, None);
    // The draft the head proposes from the prompt, with its per-token confidences measured from its logits.
    let propose = |c: f64| {
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(c)
            .unwrap();
        let hidden = capture(&t, &PROMPT[..9], drafter.target_layers());
        drafter
            .observe_target(0, &hidden, &(0..9).collect::<Vec<_>>())
            .unwrap();
        drafter
            .propose(&PROMPT, 6, &SamplingParams::default())
            .unwrap()
    };
    let full = propose(0.0);
    assert_eq!(full.tokens.len(), 6);
    // A random tiny head is unsure of everything: a bar of 1 stops before the first token, a bar at 0 never.
    let none = propose(1.0);
    assert!(none.tokens.is_empty(), "{:?}", none.tokens);
    assert_eq!(none.passes, 1, "the feed pass ran; no draft step did");
    // Any bar keeps a prefix of the unstopped draft (stopping never changes which tokens are drafted).
    for c in [1e-6, 1e-3, 0.05] {
        let d = propose(c);
        assert_eq!(d.tokens[..], full.tokens[..d.tokens.len()], "c = {c}");
    }
    // And speculation stays lossless.
    for c in [0.01, 0.3] {
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
            .unwrap()
            .with_min_confidence(c)
            .unwrap();
        let out = run(
            &t,
            40,
            0.0,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: 4,
                simulate_acceptance: None,
            }),
        );
        assert_eq!(out.tokens, plain.tokens, "c = {c}");
    }
    assert!(Eagle3Drafter::new(&h, t.model.as_ref(), 0)
        .unwrap()
        .with_min_confidence(1.5)
        .is_err());
}

/// A CPU head that runs greedy chains whole (as a device head does), here by the pass-by-pass reference; counts
/// the chains it ran.
struct ChainAtOnceHead<'a> {
    inner: &'a dyn HeadCompute,
    draft_to_target: Vec<u32>,
    chains: std::sync::atomic::AtomicUsize,
    /// Several sequences' chains run at once (`run_greedy_chains`).
    batched_chains: std::sync::atomic::AtomicUsize,
}

impl HeadCompute for ChainAtOnceHead<'_> {
    fn device(&self) -> String {
        "test device".into()
    }
    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>> {
        self.inner.new_cache(capacity)
    }
    fn run(
        &self,
        target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &mut dyn SequenceCache,
        want: HeadWant,
    ) -> Result<HeadOutput> {
        self.inner.run(target, tokens, input, rows, cache, want)
    }
    fn run_greedy_chain(
        &self,
        target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        cache: &mut dyn SequenceCache,
        more: usize,
    ) -> Result<Option<Vec<(u32, f32)>>> {
        self.chains
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        super::greedy_chain_by_passes(
            self.inner,
            target,
            &self.draft_to_target,
            tokens,
            input,
            cache,
            more,
        )
        .map(Some)
    }
    fn run_many(&self, target: &dyn Model, passes: &mut [HeadPass<'_>]) -> Result<Vec<HeadOutput>> {
        self.inner.run_many(target, passes)
    }
    fn run_greedy_chains(
        &self,
        target: &dyn Model,
        passes: &mut [HeadPass<'_>],
        more: usize,
    ) -> Result<Option<super::compute::Chains>> {
        self.batched_chains
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        super::compute::greedy_chains_by_rounds(
            self.inner,
            target,
            &self.draft_to_target,
            passes,
            more,
        )
        .map(Some)
    }
}

/// A head that drafts greedy chains whole (a GPU head: no host round trip between passes) drafts what pass-by-pass
/// drafting drafts, with and without a confidence bar (applied to the chain afterwards): the same output, drafts
/// and acceptance; sampled chains still go pass by pass.
#[test]
fn chains_drafted_whole_draft_what_chains_drafted_pass_by_pass_draft() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let plain = run(&t, 40, 0.0, None);
    let whole = ChainAtOnceHead {
        inner: h.compute(),
        draft_to_target: h.draft_to_target().to_vec(),
        chains: Default::default(),
        batched_chains: Default::default(),
    };
    for bar in [0.0, 1e-3, 0.05, 0.3] {
        for k in [1, 2, 4, 6] {
            for temperature in [0.0, 0.8] {
                let mut stats = Vec::new();
                let mut outputs = Vec::new();
                for at_once in [false, true] {
                    let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
                        .unwrap()
                        .with_min_confidence(bar)
                        .unwrap();
                    if at_once {
                        drafter.compute = &whole;
                    }
                    let out = run(
                        &t,
                        40,
                        temperature,
                        Some(Speculation {
                            drafter: &mut drafter,
                            draft_tokens: k,
                            simulate_acceptance: None,
                        }),
                    );
                    let st = out.speculation.unwrap();
                    stats.push((
                        st.cycles,
                        st.drafted,
                        st.accepted,
                        st.drafted_per_position,
                        st.accepted_per_position,
                    ));
                    outputs.push(out.tokens);
                }
                let case = format!("bar {bar}, k = {k}, temperature {temperature}");
                assert_eq!(outputs[0], outputs[1], "{case}");
                assert_eq!(stats[0], stats[1], "{case}");
                if temperature == 0.0 {
                    assert_eq!(outputs[0], plain.tokens, "{case}");
                }
            }
        }
    }
    // Only greedy chains of 2 or more tokens go whole: 4 bars x 3 such k, a chain each drafting cycle.
    let chains = whole.chains.load(std::sync::atomic::Ordering::Relaxed);
    assert!(chains >= 4 * 3, "{chains} chains ran whole");
}

/// A request drafting alone in a server's step (a shared head, no other pass to batch with) drafts its greedy chain
/// whole on a head that can (a GPU head), the same draft as pass-by-pass rounds: the same output, drafts and
/// acceptance, greedy output equal to plain decoding; sampled requests still go round by round.
#[test]
fn a_request_drafting_alone_in_a_batch_drafts_its_chain_whole() {
    use crate::decode::{Generation, StepLimits};
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let whole = ChainAtOnceHead {
        inner: h.compute(),
        draft_to_target: h.draft_to_target().to_vec(),
        chains: Default::default(),
        batched_chains: Default::default(),
    };
    let plain = run(&t, 40, 0.0, None);
    for (temperature, bar) in [(0.0, 0.0), (0.0, 0.3), (0.8, 0.0)] {
        let run_one = |shared: &dyn HeadCompute| {
            let req = prompt_request(40, temperature);
            let mut d = Eagle3Drafter::new(&h, t.model.as_ref(), 0)
                .unwrap()
                .with_min_confidence(bar)
                .unwrap();
            // As in a server: the drafter's head is the shared one.
            d.compute = shared;
            let mut gens =
                vec![Generation::with_drafter(t.model.as_ref(), req, Box::new(d), 4).unwrap()];
            let limits = StepLimits {
                shared_head: Some(shared),
                ..Default::default()
            };
            for _ in 0..200 {
                crate::testing::step_together(&t, &mut gens, limits);
                if gens[0].is_done() {
                    break;
                }
            }
            let g = gens.pop().unwrap();
            let out = g.finish(&t.tokenizer, &mut |_| {}).unwrap();
            let st = out.speculation.clone().unwrap();
            (out.tokens, st.drafted, st.accepted)
        };
        let before = whole.chains.load(std::sync::atomic::Ordering::Relaxed);
        let by_rounds = run_one(h.compute());
        let at_once = run_one(&whole);
        let chains = whole.chains.load(std::sync::atomic::Ordering::Relaxed) - before;
        let case = format!("temperature {temperature}, bar {bar}");
        assert_eq!(at_once, by_rounds, "{case}");
        assert!(by_rounds.1 > 0, "it drafted: {case}");
        if temperature == 0.0 {
            assert_eq!(at_once.0, plain.tokens, "{case}");
            assert!(chains > 0, "no chain ran whole: {case}");
        } else {
            assert_eq!(chains, 0, "a sampled draft ran as a greedy chain: {case}");
        }
    }
}

/// Several generations whose greedy chains a head runs at once (a GPU head: every round on the device, nothing
/// back to the host between them) draft what each drafts alone: the same outputs, drafted and accepted counts,
/// with and without a confidence bar (applied to each chain afterwards; a shorter chain keeps its own length of
/// a longer one's rounds); greedy output equals plain decoding; sampled drafts go round by round, beside the
/// greedy ones' chains too.
#[test]
fn greedy_chains_run_together_draft_what_each_request_drafts_alone() {
    use crate::decode::{Generation, StepLimits};
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let together = ChainAtOnceHead {
        inner: h.compute(),
        draft_to_target: h.draft_to_target().to_vec(),
        chains: Default::default(),
        batched_chains: Default::default(),
    };
    let prompts: [&[u32]; 3] = [&PROMPT[2..], &PROMPT[3..], &[72, 101, 108, 32, 111, 114]];
    let plain: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let req = request_for(p, 24 + 3 * i, 0.0, 0);
            generate(
                t.model.as_ref(),
                &t.tokenizer,
                &req,
                None,
                &Profiler::disabled(),
                &mut |_| {},
            )
            .unwrap()
            .tokens
        })
        .collect();
    // Per request: all greedy, greedy with a bar, all sampled, and greedy beside a sampled one.
    for (temperatures, bar) in [
        ([0.0, 0.0, 0.0], 0.0),
        ([0.0, 0.0, 0.0], 0.3),
        ([0.8, 0.8, 0.8], 0.0),
        ([0.0, 0.8, 0.0], 0.0),
    ] {
        let run_all = |shared: Option<&dyn HeadCompute>| {
            let mut gens: Vec<Generation<'_>> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let req = request_for(p, 24 + 3 * i, temperatures[i], 11 + i as u64);
                    let d = Eagle3Drafter::new(&h, t.model.as_ref(), 7 + i as u64)
                        .unwrap()
                        .with_min_confidence(bar)
                        .unwrap();
                    // Different draft lengths: the chains run together to the longest.
                    Generation::with_drafter(t.model.as_ref(), req, Box::new(d), 2 + i).unwrap()
                })
                .collect();
            let limits = StepLimits {
                shared_head: shared,
                ..Default::default()
            };
            for _ in 0..200 {
                crate::testing::step_together(&t, &mut gens, limits);
                if gens.iter().all(|g| g.is_done()) {
                    break;
                }
            }
            gens.into_iter()
                .map(|g| {
                    let out = g.finish(&t.tokenizer, &mut |_| {}).unwrap();
                    let st = out.speculation.clone().unwrap();
                    (out.tokens, st.drafted, st.accepted)
                })
                .collect::<Vec<_>>()
        };
        let before = together
            .batched_chains
            .load(std::sync::atomic::Ordering::Relaxed);
        let alone = run_all(None);
        let at_once = run_all(Some(&together));
        let ran = together
            .batched_chains
            .load(std::sync::atomic::Ordering::Relaxed)
            - before;
        let case = format!("temperatures {temperatures:?}, bar {bar}");
        assert_eq!(at_once, alone, "{case}");
        assert!(
            alone.iter().all(|a| a.1 > 0),
            "every generation drafted: {case}"
        );
        // Two or more greedy requests chain together (a sampled one beside them goes in rounds).
        let greedy = temperatures.iter().filter(|&&t| t == 0.0).count();
        assert_eq!(ran > 0, greedy >= 2, "{ran} chain runs: {case}");
        for ((out, plain), &t) in at_once.iter().zip(&plain).zip(&temperatures) {
            if t == 0.0 {
                assert_eq!(&out.0, plain, "{case}");
            }
        }
    }
}

/// Several generations drafting with one head in batched passes (what a server does) draft exactly what each
/// drafts alone: the same outputs, the same drafted and accepted counts, greedy and sampled, with and without a
/// confidence bar; greedy output equals plain decoding.
#[test]
fn batched_head_passes_draft_what_each_request_drafts_alone() {
    use crate::decode::{step, Generation, StepLimits};
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    // Prompts of at most MAX_FEED_ROWS_IN_BATCH tokens: longer ones are fed in pieces in a batch (below).
    let prompts: [&[u32]; 3] = [&PROMPT[2..], &PROMPT[3..], &[72, 101, 108, 32, 111, 114]];
    for (temperature, bar) in [(0.0, 0.0), (0.0, 0.3), (0.8, 0.0)] {
        let run_all = |shared: bool| {
            let mut gens: Vec<Generation<'_>> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let req = request_for(p, 24 + 3 * i, temperature, 11 + i as u64);
                    let d = Eagle3Drafter::new(&h, t.model.as_ref(), 7 + i as u64)
                        .unwrap()
                        .with_min_confidence(bar)
                        .unwrap();
                    Generation::with_drafter(t.model.as_ref(), req, Box::new(d), 3).unwrap()
                })
                .collect();
            let limits = StepLimits {
                shared_head: shared.then_some(h.compute()),
                ..Default::default()
            };
            for _ in 0..200 {
                crate::testing::step_together(&t, &mut gens, limits);
                if gens.iter().all(|g| g.is_done()) {
                    break;
                }
            }
            gens.into_iter()
                .map(|g| {
                    let out = g.finish(&t.tokenizer, &mut |_| {}).unwrap();
                    let st = out.speculation.clone().unwrap();
                    (out.tokens, st.drafted, st.accepted, st.draft_passes)
                })
                .collect::<Vec<_>>()
        };
        let alone = run_all(false);
        let batched = run_all(true);
        assert_eq!(batched, alone, "temperature {temperature}, bar {bar}");
        assert!(alone.iter().all(|a| a.1 > 0), "every generation drafted");
        if temperature == 0.0 {
            for (i, p) in prompts.iter().enumerate() {
                let req = request_for(p, 24 + 3 * i, 0.0, 0);
                let plain = generate(
                    t.model.as_ref(),
                    &t.tokenizer,
                    &req,
                    None,
                    &Profiler::disabled(),
                    &mut |_| {},
                )
                .unwrap();
                assert_eq!(batched[i].0, plain.tokens, "prompt {i}");
            }
        }
    }
    // A long prompt beside another request is fed to the head in pieces of MAX_FEED_ROWS_IN_BATCH rows, with no
    // draft until it is in; greedy output still equals plain decoding.
    let long: Vec<u32> = PROMPT
        .iter()
        .chain(&PROMPT)
        .chain(&PROMPT)
        .copied()
        .collect();
    let req = |p: &[u32]| GenerateRequest {
        prompt_tokens: p.to_vec(),
        max_new_tokens: 30,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    let mut gens: Vec<Generation<'_>> = [&long[..], &PROMPT[2..]]
        .iter()
        .map(|p| {
            let d = Eagle3Drafter::new(&h, t.model.as_ref(), 3).unwrap();
            Generation::with_drafter(t.model.as_ref(), req(p), Box::new(d), 3).unwrap()
        })
        .collect();
    let limits = StepLimits {
        shared_head: Some(h.compute()),
        ..Default::default()
    };
    let mut first_draft_cycle = None;
    let mut catch_up_before_first_draft = 0;
    for step_no in 0..200 {
        let mut refs: Vec<&mut Generation<'_>> = gens.iter_mut().collect();
        for r in step(
            t.model.as_ref(),
            &t.tokenizer,
            &mut refs,
            limits,
            &Profiler::disabled(),
            &mut |_, _| {},
        )
        .0
        {
            r.unwrap();
        }
        if first_draft_cycle.is_none() && gens[0].speculation().is_some_and(|s| s.drafted > 0) {
            first_draft_cycle = Some(step_no);
            catch_up_before_first_draft = gens[0].speculation().unwrap().catch_up_cycles;
        }
        if gens.iter().all(|g| g.is_done()) {
            break;
        }
    }
    // 30 rows of features (and one more a cycle): four feeding-only cycles of 8 after the prefill, then drafts.
    assert!(
        first_draft_cycle.is_some_and(|c| c >= 4),
        "{first_draft_cycle:?}"
    );
    // Those cycles say they only caught up (the server's budget leaves them out of its acceptance counts), and
    // none after the feed was in.
    let stats = gens[0].speculation().unwrap().clone();
    assert!(
        catch_up_before_first_draft >= 3,
        "{catch_up_before_first_draft}"
    );
    assert_eq!(stats.catch_up_cycles, catch_up_before_first_draft);
    assert_eq!(gens[1].speculation().unwrap().catch_up_cycles, 0);
    let out = gens.remove(0).finish(&t.tokenizer, &mut |_| {}).unwrap();
    let plain = generate(
        t.model.as_ref(),
        &t.tokenizer,
        &req(&long),
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(out.tokens, plain.tokens);
}

/// A scheduler may take a head drafter away between steps (the server does, from requests it stopped letting
/// draft): the request goes on as plain decoding with the same greedy tokens, keeps the statistics it had, and
/// the batch stops capturing hidden states once no member has a head drafter left.
#[test]
fn a_released_head_drafter_leaves_plain_decoding_behind() {
    use crate::decode::{Generation, StepLimits};
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let prompts: [&[u32]; 2] = [&PROMPT[1..], &PROMPT[3..]];
    let req = |p: &[u32]| GenerateRequest {
        prompt_tokens: p.to_vec(),
        max_new_tokens: 30,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    let mut gens: Vec<Generation<'_>> = prompts
        .iter()
        .map(|p| {
            let d = Eagle3Drafter::new(&h, t.model.as_ref(), 3).unwrap();
            Generation::with_drafter(t.model.as_ref(), req(p), Box::new(d), 3).unwrap()
        })
        .collect();
    assert!(gens.iter().all(|g| g.drafter_costs_idle_steps()));
    let limits = StepLimits {
        shared_head: Some(h.compute()),
        ..Default::default()
    };
    let mut drafted_at_release = [None, None];
    for step_no in 0..200 {
        // The first leaves its drafter after 4 steps, the second after 7.
        for (i, at) in [(0, 4), (1, 7)] {
            if step_no == at {
                assert!(gens[i].release_drafter());
                assert!(!gens[i].release_drafter(), "released twice");
                assert!(!gens[i].has_drafter() && !gens[i].drafter_costs_idle_steps());
                drafted_at_release[i] = Some(gens[i].speculation().unwrap().drafted);
            }
        }
        crate::testing::step_together(&t, &mut gens, limits);
        if gens.iter().all(|g| g.is_done()) {
            break;
        }
    }
    for (i, g) in gens.into_iter().enumerate() {
        let out = g.finish(&t.tokenizer, &mut |_| {}).unwrap();
        let plain = generate(
            t.model.as_ref(),
            &t.tokenizer,
            &req(prompts[i]),
            None,
            &Profiler::disabled(),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(out.tokens, plain.tokens, "prompt {i}");
        let st = out.speculation.expect("statistics kept");
        assert!(st.drafted > 0, "prompt {i} drafted before its release");
        assert_eq!(Some(st.drafted), drafted_at_release[i], "prompt {i}");
    }
}

/// A prompt kept by a request without a drafter holds no head state: a request with a head drafter reaches none
/// of it, the same request without its drafter all of it (what the server compares before admitting it beside
/// others), and after the drafter goes it reuses the prompt and answers as plain decoding does.
#[test]
fn a_prefix_without_head_state_is_reached_only_without_the_drafter() {
    use crate::decode::{Generation, PrefixCache};
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let model = t.model.as_ref();
    let prompt: Vec<u32> = PROMPT.iter().chain(&PROMPT).copied().collect();
    let req = |p: &[u32]| GenerateRequest {
        prompt_tokens: p.to_vec(),
        max_new_tokens: 12,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    let plain = Generation::new(model, req(&prompt)).unwrap();
    let (_, prefix) = crate::testing::run_alone_to_end(&t, plain);
    let prefix = prefix.expect("a finished generation leaves its cache");
    assert!(prefix.drafter.is_none());
    let mut cache = PrefixCache::new();
    cache.insert(prefix, 1000);
    let mut next = prompt.clone();
    next.extend_from_slice(&[32, 72, 101]);
    let d = Eagle3Drafter::new(&h, model, 0).unwrap();
    let mut g = Generation::with_drafter(model, req(&next), Box::new(d), 3).unwrap();
    let (with, without) = cache.reaches(&g);
    assert_eq!(with, 0);
    assert_eq!(without, prompt.len());
    assert!(g.release_drafter());
    assert_eq!(cache.adopt_into(&mut g).unwrap(), prompt.len());
    let (out, _) = crate::testing::run_alone_to_end(&t, g);
    let fresh = run_plain(&t, &next, 12);
    assert_eq!(out.tokens, fresh);
    assert_eq!(out.cached_prompt_tokens, prompt.len());
}

fn run_plain(t: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let req = GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    generate(
        t.model.as_ref(),
        &t.tokenizer,
        &req,
        None,
        &Profiler::disabled(),
        &mut |_| {},
    )
    .unwrap()
    .tokens
}

#[test]
fn a_prefix_cache_hit_hands_the_head_its_rows_and_changes_no_draft() {
    use crate::decode::{Generation, PrefixCache};
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let model = t.model.as_ref();
    let generation = |prompt: &[u32], n: usize, seed: u64| {
        let req = GenerateRequest {
            prompt_tokens: prompt.to_vec(),
            max_new_tokens: n,
            sampling: SamplingParams::default(),
            stop_at_eos: false,
            cancel: None,
            logprobs: None,
            logit_adjustments: None,
            stop_token_ids: Vec::new(),
        };
        let d = Eagle3Drafter::new(&h, model, seed).unwrap();
        Generation::with_drafter(model, req, Box::new(d), 3).unwrap()
    };
    let run_to_end = |g| crate::testing::run_alone_to_end(&t, g);
    let prompt: Vec<u32> = PROMPT.iter().chain(&PROMPT).copied().collect();
    let (first, prefix) = run_to_end(generation(&prompt, 24, 1));
    let prefix = prefix.unwrap();
    let kept = prefix.drafter.as_ref().expect("the head's rows are kept");
    assert_eq!(kept.positions(), prefix.tokens.len());
    let mut cache = PrefixCache::new();
    cache.insert(prefix, 1);

    let mut next: Vec<u32> = prompt.iter().chain(&first.tokens).copied().collect();
    next.extend_from_slice(&[32, 119, 111]);
    // The next turn reuses every cached position; the same prompt again its first rows (the head's last prompt
    // row read the first generated token, which a new request need not share).
    for p in [&next, &prompt] {
        let (fresh, _) = run_to_end(generation(p, 20, 2));
        let mut g = generation(p, 20, 2);
        let reused = cache.adopt_into(&mut g).unwrap();
        assert!(reused >= PrefixCache::MIN_POSITIONS && reused < p.len());
        let (out, _) = run_to_end(g);
        assert_eq!(out.cached_prompt_tokens, reused);
        assert_eq!(out.tokens, fresh.tokens, "greedy output");
        let stats = |o: &crate::decode::GenerateOutput| {
            let s = o.speculation.as_ref().unwrap();
            (s.drafted, s.accepted, s.accepted_per_position.clone())
        };
        assert_eq!(stats(&out), stats(&fresh), "the head drafted the same");
        assert!(stats(&out).0 > 0);
    }
    // A prompt copied right after its prefill (the request still running): the head has fed nothing yet, so the
    // copy carries the prompt's target features, and a request with that prompt drafts as it would alone.
    let mut running = generation(&prompt, 20, 3);
    crate::testing::step_alone(&t, &mut running);
    let copy = running.prompt_prefix(model).unwrap();
    assert_eq!(copy.drafter.as_ref().unwrap().positions(), prompt.len());
    let mut cache = PrefixCache::new();
    cache.insert(copy, 1);
    let (fresh, _) = run_to_end(generation(&prompt, 20, 2));
    let mut g = generation(&prompt, 20, 2);
    assert_eq!(cache.adopt_into(&mut g).unwrap(), prompt.len() - 1);
    let (out, _) = run_to_end(g);
    assert_eq!(out.tokens, fresh.tokens);
    let s =
        |o: &crate::decode::GenerateOutput| o.speculation.as_ref().map(|s| (s.drafted, s.accepted));
    assert_eq!(s(&out), s(&fresh));
    // A request with the same prompt that let its drafter go leaves a longer prefix without the head's state: it
    // does not replace the one with it, so head requests still start from the cached prompt. The other way
    // round, a prefix with the head's state replaces one without.
    let mut released = generation(&prompt, 20, 4);
    crate::testing::step_alone(&t, &mut released);
    crate::testing::step_alone(&t, &mut released);
    assert!(released.release_drafter());
    let (_, longer) = run_to_end(released);
    let longer = longer.unwrap();
    assert!(longer.drafter.is_none() && longer.tokens.len() > prompt.len());
    let longer_tokens = longer.tokens.clone();
    cache.insert(longer, 1);
    assert_eq!(cache.len(), 2);
    assert!(cache.covers(&prompt, true) && cache.covers(&longer_tokens, false));
    assert!(!cache.covers(&longer_tokens, true));
    let mut g = generation(&prompt, 20, 2);
    assert_eq!(cache.adopt_into(&mut g).unwrap(), prompt.len() - 1);
    let mut without = PrefixCache::new();
    let mut released = generation(&prompt, 20, 4);
    crate::testing::step_alone(&t, &mut released);
    assert!(released.release_drafter());
    without.insert(run_to_end(released).1.unwrap(), 1);
    let mut running = generation(&prompt, 20, 3);
    crate::testing::step_alone(&t, &mut running);
    without.insert(running.prompt_prefix(model).unwrap(), 1);
    assert_eq!(
        without.len(),
        2,
        "the shorter prefix with the head's state is kept beside"
    );
    let (_, full) = run_to_end(generation(&prompt, 20, 5));
    without.insert(full.unwrap(), 1);
    assert_eq!(
        without.len(),
        1,
        "one prefix with the head's state answers for both"
    );
}

/// Features kept by reference (as a device's step outputs are) and read only when the head runs give the drafts
/// that features read at once give, through a prompt fed in pieces and a verify-like forward.
#[test]
fn features_read_late_draft_what_features_read_at_once_draft() {
    use crate::draft::eagle3::waiting::SharedRows;
    use crate::model::forward::HostRows;
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let layers = [0, 1, 2];
    let hidden = capture(&t, &PROMPT, &layers);
    type Captured = Vec<(usize, Box<dyn RowMatrix>)>;
    let as_shared = |rows: std::ops::Range<usize>| -> (Captured, Vec<SharedRows>) {
        let mut out: Vec<(usize, Box<dyn RowMatrix>)> = Vec::new();
        let mut handles = Vec::new();
        for (l, m) in &hidden {
            let cols = m.cols();
            let data = m.to_host().unwrap()[rows.start * cols..rows.end * cols].to_vec();
            let s = SharedRows::new(HostRows {
                rows: rows.len(),
                cols,
                data,
            });
            out.push((*l, s.share().unwrap()));
            handles.push(s);
        }
        (out, handles)
    };
    let params = SamplingParams {
        temperature: 1.0,
        seed: 9,
        ..Default::default()
    };
    let base = PROMPT.len() - 1;
    let mut eager = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    eager
        .observe_target(0, &hidden, &(0..base).collect::<Vec<_>>())
        .unwrap();
    let want = eager.propose(&PROMPT, 3, &params).unwrap();

    let mut lazy = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    // The prompt in two forwards, the second's rows handed over in two parts (as verify cycles hand theirs).
    let (first, first_handles) = as_shared(0..5);
    lazy.observe_target(0, &first, &[0, 1, 2, 3, 4]).unwrap();
    let (second, second_handles) = as_shared(5..base);
    lazy.observe_target(5, &second, &[0, 1]).unwrap();
    lazy.observe_target(7, &second, &[2, 3]).unwrap();
    let untouched = |hs: &[SharedRows]| hs.iter().all(|s| s.reads() == 0);
    assert!(untouched(&first_handles) && untouched(&second_handles));
    assert_eq!(lazy.lag(&PROMPT), base);
    let got = lazy.propose(&PROMPT, 3, &params).unwrap();
    assert!(
        !untouched(&first_handles),
        "the head read the features it ran over"
    );
    assert_eq!(got.tokens, want.tokens);
    let (gd, wd) = (
        got.distributions.as_ref().unwrap(),
        want.distributions.as_ref().unwrap(),
    );
    assert_eq!(gd.len(), wd.len());
    for (g, w) in gd.iter().zip(wd) {
        assert_eq!(g.ids, w.ids);
        assert_eq!(
            g.probs, w.probs,
            "the same features give the same distribution, bit for bit"
        );
    }
}

/// A prefix-cache state taken while many forwards' features wait unread reads only the oldest few of them: it
/// covers fewer positions, and a drafter started from it drafts exactly what one fed everything drafts.
#[test]
fn a_prefix_state_reads_only_a_few_unread_forwards_and_drafts_the_same() {
    use crate::draft::eagle3::waiting::SharedRows;
    use crate::model::forward::HostRows;
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let hidden = capture(&t, &PROMPT, &[0, 1, 2]);
    let base = PROMPT.len() - 1;
    // Row r of every captured layer as its own one-row forward, kept by reference.
    let forward = |r: usize| -> Vec<(usize, Box<dyn RowMatrix>)> {
        hidden
            .iter()
            .map(|(l, m)| {
                let s = SharedRows::new(HostRows {
                    rows: 1,
                    cols: m.cols(),
                    data: m.row(r).unwrap().to_vec(),
                });
                (*l, s.share().unwrap())
            })
            .collect()
    };
    let params = SamplingParams {
        temperature: 1.0,
        seed: 4,
        ..Default::default()
    };
    // Drafts compared by their distributions (continuous: any difference in the features shows).
    let dists = |d: &Draft| -> Vec<Vec<f32>> {
        d.distributions
            .as_ref()
            .unwrap()
            .iter()
            .map(|x| x.probs.clone())
            .collect()
    };
    let mut eager = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    eager
        .observe_target(0, &hidden, &(0..base).collect::<Vec<_>>())
        .unwrap();
    let want = eager.propose(&PROMPT, 3, &params).unwrap();

    let mut lazy = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    for r in 0..base {
        lazy.observe_target(r, &forward(r), &[0]).unwrap();
    }
    let state = lazy.prefix_state().unwrap();
    assert_eq!(state.positions(), PREFIX_UNREAD_FORWARDS.min(base));
    assert_eq!(lazy.lag(&PROMPT), base, "taking the state consumed nothing");
    let n = state.positions();
    let mut adopted = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    adopted.adopt_prefix(&state, n).unwrap();
    assert_eq!(
        (state.features.host_rows(), adopted.features.host_rows()),
        (0, 0),
        "shared rows stay unread through the state and its adoption"
    );
    for r in n..base {
        adopted.observe_target(r, &forward(r), &[0]).unwrap();
    }
    let from_state = adopted.propose(&PROMPT, 3, &params).unwrap();
    let fed_all = lazy.propose(&PROMPT, 3, &params).unwrap();
    for got in [&from_state, &fed_all] {
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(dists(got), dists(&want));
    }
}

/// A CPU head that says it reads device rows (so a drafter takes them by address); it runs host rows only.
struct DeviceReadingHead<'a>(&'a dyn HeadCompute);

impl HeadCompute for DeviceReadingHead<'_> {
    fn device(&self) -> String {
        "test device".into()
    }
    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>> {
        self.0.new_cache(capacity)
    }
    fn run(
        &self,
        target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &mut dyn SequenceCache,
        want: HeadWant,
    ) -> Result<HeadOutput> {
        self.0.run(target, tokens, input, rows, cache, want)
    }
    fn reads_device_features(&self) -> bool {
        true
    }
}

/// Beside other requests, a device head's drafter with rows on the host (an adopted prefix's) and rows still on
/// the device feeds the host rows by themselves, reading no device forward back, then the device rows by address.
#[test]
fn a_device_head_feeds_host_rows_apart_from_device_rows_beside_others() {
    use crate::draft::eagle3::waiting::SharedRows;
    use crate::model::forward::HostRows;
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let (h, _) = head(dir.path(), &t, &TinyHeadSpec::default());
    let hidden = capture(&t, &PROMPT, &[0, 1, 2]);
    let base = PROMPT.len() - 1;
    let on_host = 3;
    let width: usize = hidden.iter().map(|(_, m)| m.cols()).sum();
    let mut host_rows = Vec::new();
    for r in 0..on_host {
        for (_, m) in &hidden {
            host_rows.extend_from_slice(&m.row(r).unwrap());
        }
    }
    let compute = DeviceReadingHead(h.compute());
    let mut d = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    d.compute = &compute;
    d.features.extend_host(&host_rows).unwrap();
    assert_eq!(d.features.host_rows(), on_host);
    let mut handles = Vec::new();
    for r in on_host..base {
        let forward: Vec<(usize, Box<dyn RowMatrix>)> = hidden
            .iter()
            .map(|(l, m)| {
                let s = SharedRows::on_device(
                    HostRows {
                        rows: 1,
                        cols: m.cols(),
                        data: m.row(r).unwrap().to_vec(),
                    },
                    0x1000 * (r as u64 + 1) + *l as u64,
                );
                let view = s.share().unwrap();
                handles.push(s);
                (*l, view)
            })
            .collect();
        d.observe_target(r, &forward, &[0]).unwrap();
    }
    let greedy = SamplingParams::default();
    let BatchedStart::Pass(first) = d.batched_begin(&PROMPT, 3, &greedy, true).unwrap() else {
        panic!("nothing to feed");
    };
    assert_eq!(first.tokens, PROMPT[1..=on_host].to_vec());
    assert_eq!(first.features.as_deref(), Some(&host_rows[..]));
    assert!(first.device_features.is_none());
    assert!(
        handles.iter().all(|s| s.reads() == 0),
        "a device forward was read back"
    );
    assert_eq!(d.features.rows(), base - on_host);
    assert_eq!(width * on_host, host_rows.len());
    // The pass ran (here on the host rows); the next feeds the device rows where they lie.
    let out = d
        .compute
        .run(
            d.target,
            &first.tokens,
            HeadInput::Features(first.features.as_ref().unwrap()),
            HeadRows::Chain,
            &mut *d.cache,
            first.want,
        )
        .unwrap();
    assert!(d.batched_after(out, &greedy).unwrap().is_none());
    d.batched_finish().unwrap();
    let BatchedStart::Pass(second) = d.batched_begin(&PROMPT, 3, &greedy, true).unwrap() else {
        panic!("nothing to feed");
    };
    let rows = second
        .device_features
        .as_ref()
        .expect("device rows by address");
    assert_eq!(rows.rows.len(), base - on_host);
    assert!(second.features.is_none());
    assert!(handles.iter().all(|s| s.reads() == 0));
    // Alone, it drafts at once instead: everything waiting in one pass (the device rows read to the host).
    let mut alone = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
    alone.compute = &compute;
    alone.features.extend_host(&host_rows).unwrap();
    for r in on_host..base {
        let forward: Vec<(usize, Box<dyn RowMatrix>)> = hidden
            .iter()
            .map(|(l, m)| {
                let s = SharedRows::new(HostRows {
                    rows: 1,
                    cols: m.cols(),
                    data: m.row(r).unwrap().to_vec(),
                });
                (*l, s.share().unwrap())
            })
            .collect();
        alone.observe_target(r, &forward, &[0]).unwrap();
    }
    let BatchedStart::Pass(whole) = alone.batched_begin(&PROMPT, 3, &greedy, false).unwrap() else {
        panic!("nothing to feed");
    };
    assert_eq!(whole.tokens.len(), base);
}

/// A head requantized at load for the CPU (Q8_0, Q6_K, Q4_K: cheaper draft steps) holds each matrix in that type
/// where the width fits the type's blocks and in Q8_0 where it does not; its forward pass stays within the
/// quantization's error of the stored head's, and greedy speculation with it still equals plain decoding.
#[test]
fn requantized_heads_stay_close_to_the_stored_head_and_keep_speculation_lossless() {
    use crate::model::dtype::GgmlType;
    let dir = tempfile::tempdir().unwrap();
    // 256 wide, so every matrix fits the K-quants' 256-wide blocks.
    let t = target_of_width(dir.path(), 256);
    let hd = dir.path().join("head");
    write_tiny_eagle3_head(&hd, t.model.config(), &TinyHeadSpec::default()).unwrap();
    let stored = Eagle3Head::load_as(&hd, HeadPrecision::Stored).unwrap();
    assert_eq!(stored.weight_types(), vec![GgmlType::F32]);
    let n = 5;
    let (features, embeds) = head_inputs(&t, n);
    let pass = |h: &Eagle3Head| {
        let mut cache = h.new_cache(64);
        let x = h.fc(&features, n);
        h.forward(&embeds, &x, n, &mut cache).unwrap()
    };
    let (want_out, want_logits) = pass(&stored);
    let relative_error = |a: &[f32], b: &[f32]| {
        let diff: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let norm: f32 = b.iter().map(|y| y * y).sum();
        (diff / norm).sqrt()
    };
    let plain = run(&t, 40, 0.0, None);
    for (precision, ty, bound) in [
        (HeadPrecision::Q8_0, GgmlType::Q8_0, 0.02),
        (HeadPrecision::Q6K, GgmlType::Q6K, 0.05),
        (HeadPrecision::Q4K, GgmlType::Q4K, 0.15),
    ] {
        let h = Eagle3Head::load_as(&hd, precision).unwrap();
        assert_eq!(h.weight_types(), vec![ty], "{precision:?}");
        let (out, logits) = pass(&h);
        let (e_out, e_logits) = (
            relative_error(&out, &want_out),
            relative_error(&logits, &want_logits),
        );
        assert!(
            e_out > 0.0 && e_out < bound && e_logits < bound,
            "{precision:?}: relative error of the outputs {e_out}, of the logits {e_logits}"
        );
        let mut drafter = Eagle3Drafter::new(&h, t.model.as_ref(), 0).unwrap();
        let out = run(
            &t,
            40,
            0.0,
            Some(Speculation {
                drafter: &mut drafter,
                draft_tokens: 3,
                simulate_acceptance: None,
            }),
        );
        assert_eq!(out.tokens, plain.tokens, "{precision:?}");
        assert!(out.speculation.unwrap().drafted > 0);
    }
    // 64 wide (the usual tiny target): its rows do not fit 256-wide blocks, so every matrix goes to Q8_0.
    let small = target(dir.path());
    let hd = dir.path().join("small-head");
    write_tiny_eagle3_head(&hd, small.model.config(), &TinyHeadSpec::default()).unwrap();
    for precision in [HeadPrecision::Q6K, HeadPrecision::Q4K] {
        let h = Eagle3Head::load_as(&hd, precision).unwrap();
        assert_eq!(h.weight_types(), vec![GgmlType::Q8_0], "{precision:?}");
    }
    assert_eq!(HeadPrecision::Q4K.storage_for(33), None);
    assert_eq!(HeadPrecision::Stored.storage_for(256), None);
}
