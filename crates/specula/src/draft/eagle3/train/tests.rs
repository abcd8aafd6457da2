//! Training on tiny random models: the unrolled training graph computes what the inference head computes for the
//! same rows (step 0 from the target's features, later steps as draft rows), training lowers the loss, and
//! checkpoints resume where they stopped.

use super::*;
use crate::draft::eagle3::{Eagle3Head, TreeRow};
use crate::model::load_gguf;
use crate::testing::{write_tiny_gguf, TinySpec};

fn target(dir: &Path) -> LoadedModel {
    let p = dir.join("t.gguf");
    write_tiny_gguf(
        &p,
        &TinySpec {
            layers: 3,
            seed: 11,
            logit_scale: 0.3,
            untied_head: true,
            ..Default::default()
        },
    )
    .unwrap();
    load_gguf(&p, "t").unwrap()
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    crate::testing::pseudo_random(n, seed)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn unrolled_steps_compute_what_the_inference_head_computes() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let tc = t.model.config().clone();
    let (h, len, steps) = (tc.hidden_size, 12usize, 3usize);
    let layers = [0usize, 1, 2];
    let draft_ids: Vec<u32> = (0..40u32).map(|i| 5 + 3 * i).collect();
    let vocab = DraftVocab::from_ids(draft_ids, tc.vocab_size).unwrap();
    let json = head_config_json(&tc, &layers, vocab.len(), 96);
    let hc = HeadConfig::from_json(&json.to_string(), Path::new("config.json")).unwrap();
    let shape = HeadShape::new(&hc.layer, h, vocab.len());
    // Norm weights away from one, so a misplaced norm shows.
    let params = HeadParams::init(shape, 3, None, &Device::Cpu).unwrap();
    for (i, (name, var)) in params.vars.iter().enumerate() {
        if var.as_tensor().dims().len() == 1 {
            let n = var.elem_count();
            let w: Vec<f32> = random(n, i as u64).iter().map(|v| 1.0 + 0.3 * v).collect();
            var.set(&Tensor::from_vec(w, n, &Device::Cpu).unwrap())
                .unwrap();
        } else if *name != "lm_head.weight" {
            // Larger weights than Llama's init: the attention and MLP paths must matter in the comparison.
            let dims = var.as_tensor().dims().to_vec();
            let n = var.elem_count();
            let w: Vec<f32> = random(n, 100 + i as u64).iter().map(|v| 0.3 * v).collect();
            var.set(&Tensor::from_vec(w, dims, &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    let features = random(len * 3 * h, 1);
    let mut embeds = random((len + steps) * h, 2);
    embeds[len * h..].iter_mut().for_each(|v| *v = 0.0);
    let seq = TrainingSequence {
        len,
        features: Tensor::from_vec(features.clone(), (len, 3 * h), &Device::Cpu).unwrap(),
        embeds: Tensor::from_vec(embeds.clone(), (len + steps, h), &Device::Cpu).unwrap(),
        target_probs: Tensor::zeros((len, vocab.len()), DType::F32, &Device::Cpu).unwrap(),
        target_ids: vec![None; len],
    };
    let unrolled = params.unroll(&seq, steps).unwrap();
    let rows = |t: &Tensor| t.to_vec2::<f32>().unwrap();

    let out_dir = dir.path().join("head");
    export_head(&out_dir, &params, &vocab, &json, DType::F32).unwrap();
    let head = Eagle3Head::load(&out_dir).unwrap();
    head.check_target(&tc).unwrap();
    // Step 0: the target-fed rows, a chain over positions 0..len.
    let mut cache = head.new_cache(64);
    let x = head.fc(&features, len);
    let (out0, last_logits) = head
        .forward(&embeds[..len * h], &x, len, &mut cache)
        .unwrap();
    let trained0 = rows(&unrolled[0].0);
    for r in 0..len {
        let d = max_diff(&out0[r * h..(r + 1) * h], &trained0[r]);
        assert!(d < 1e-3, "step 0 row {r}: outputs differ by {d}");
    }
    // The last row has no target in training, so compare logits on the row before through the tree path below.
    assert_eq!(last_logits.len(), vocab.len());
    // Steps 1 and 2 at every row t: draft rows at positions t + 1, t + 2 that see the target rows 0..=t and
    // their own ancestors.
    for t_row in 0..len - steps {
        cache.truncate(len);
        let mut x = out0[t_row * h..(t_row + 1) * h].to_vec();
        let mut ancestors = Vec::new();
        for step in 1..steps {
            let e = &embeds[(t_row + step) * h..(t_row + step + 1) * h];
            let row = TreeRow {
                position: t_row + step,
                prefix: t_row + 1,
                ancestors: ancestors.clone(),
            };
            let (out, logits) = head.forward_tree(e, &x, &[row], &mut cache).unwrap();
            let trained = rows(&unrolled[step].0);
            let d = max_diff(&out, &trained[t_row]);
            assert!(d < 1e-3, "step {step} row {t_row}: outputs differ by {d}");
            let trained_logits = rows(&unrolled[step].1);
            let d = max_diff(&logits[0], &trained_logits[t_row]);
            assert!(d < 1e-3, "step {step} row {t_row}: logits differ by {d}");
            ancestors.push(len + step - 1);
            x = out;
        }
    }
}

/// A training sequence of random features, embeddings and soft targets; every third row has no target.
fn random_sequence(
    len: usize,
    steps: usize,
    h: usize,
    vocab: usize,
    seed: u64,
) -> TrainingSequence {
    let mut embeds = random((len + steps) * h, seed + 1);
    embeds[len * h..].iter_mut().for_each(|v| *v = 0.0);
    let mut probs: Vec<f32> = random(len * vocab, seed + 2)
        .iter()
        .map(|v| (3.0 * v).exp())
        .collect();
    for row in probs.chunks_mut(vocab) {
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|p| *p /= sum);
    }
    TrainingSequence {
        len,
        features: Tensor::from_vec(random(len * 3 * h, seed), (len, 3 * h), &Device::Cpu).unwrap(),
        embeds: Tensor::from_vec(embeds, (len + steps, h), &Device::Cpu).unwrap(),
        target_probs: Tensor::from_vec(probs, (len, vocab), &Device::Cpu).unwrap(),
        target_ids: (0..len)
            .map(|r| (r % 3 != 0).then_some(((r as u64 * 7 + seed) % vocab as u64) as u32))
            .collect(),
    }
}

#[test]
fn a_batch_in_one_graph_computes_what_its_sequences_compute_alone() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let tc = t.model.config().clone();
    let (h, steps) = (tc.hidden_size, 3usize);
    let vocab =
        DraftVocab::from_ids((0..40u32).map(|i| 5 + 3 * i).collect(), tc.vocab_size).unwrap();
    let json = head_config_json(&tc, &[0, 1, 2], vocab.len(), 96);
    let hc = HeadConfig::from_json(&json.to_string(), Path::new("config.json")).unwrap();
    let params = HeadParams::init(
        HeadShape::new(&hc.layer, h, vocab.len()),
        5,
        None,
        &Device::Cpu,
    )
    .unwrap();
    for (i, (_, var)) in params.vars.iter().enumerate() {
        // Weights large enough that attention and the MLP matter, so padding leaking into a row would show.
        let dims = var.as_tensor().dims().to_vec();
        let n = var.elem_count();
        let w: Vec<f32> = random(n, 200 + i as u64)
            .iter()
            .map(|v| {
                if dims.len() == 1 {
                    1.0 + 0.3 * v
                } else {
                    0.3 * v
                }
            })
            .collect();
        var.set(&Tensor::from_vec(w, dims, &Device::Cpu).unwrap())
            .unwrap();
    }
    // Lengths out of order, one shorter than the unrolled steps need.
    let seqs: Vec<TrainingSequence> = [(9usize, 1u64), (14, 11), (3, 21)]
        .iter()
        .map(|&(len, seed)| random_sequence(len, steps, h, vocab.len(), seed))
        .collect();
    let refs: Vec<&TrainingSequence> = seqs.iter().collect();

    let batch = params.forward_ttt_batch(&refs, steps).unwrap();
    let batch_loss = batch.loss.to_scalar::<f32>().unwrap();
    let batch_grads = batch.loss.backward().unwrap();
    let (mut loss, mut correct, mut counted, mut ce) =
        (0f32, vec![0; steps], vec![0; steps], vec![0f64; steps]);
    let mut grads: Vec<Vec<f32>> = params
        .vars
        .iter()
        .map(|(_, v)| vec![0.0; v.elem_count()])
        .collect();
    for seq in &seqs {
        let alone = params.forward_ttt(seq, steps).unwrap();
        loss += alone.loss.to_scalar::<f32>().unwrap();
        for j in 0..alone.counted.len() {
            correct[j] += alone.correct[j];
            counted[j] += alone.counted[j];
            ce[j] += alone.step_loss[j] as f64 * alone.counted[j] as f64;
        }
        let store = alone.loss.backward().unwrap();
        for (acc, (_, var)) in grads.iter_mut().zip(&params.vars) {
            let g = store.get(var.as_tensor()).unwrap().flatten_all().unwrap();
            for (a, v) in acc.iter_mut().zip(g.to_vec1::<f32>().unwrap()) {
                *a += v;
            }
        }
    }
    assert!(
        loss > 1.0,
        "the loss must be a real number to compare: {loss}"
    );
    assert!(
        (batch_loss - loss).abs() <= 1e-5 * loss.abs(),
        "batched loss {batch_loss} against the sum of the sequences' own {loss}"
    );
    assert_eq!(batch.counted, counted);
    assert_eq!(batch.correct, correct);
    assert!(
        counted.iter().sum::<usize>() > 20,
        "rows with targets: {counted:?}"
    );
    for (j, (&step_loss, &n)) in batch.step_loss.iter().zip(&batch.counted).enumerate() {
        let batched = step_loss as f64 * n as f64;
        assert!(
            (batched - ce[j]).abs() <= 1e-4 * ce[j].abs(),
            "step {j}: {batched} against {}",
            ce[j]
        );
    }
    for (alone, (name, var)) in grads.iter().zip(&params.vars) {
        let g = batch_grads.get(var.as_tensor()).unwrap();
        let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = alone.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{name} has no gradient");
        let d = max_diff(&g, alone);
        assert!(
            d <= 1e-4 * scale,
            "{name}: gradients differ by {d} (largest {scale})"
        );
    }
    // The outputs of each sequence's real rows equal its outputs alone.
    let unrolled = params.unroll_batch(&refs, steps).unwrap();
    for (b, seq) in seqs.iter().enumerate() {
        for (step, (y, _)) in params.unroll(seq, steps).unwrap().iter().enumerate() {
            let alone = y.to_vec2::<f32>().unwrap();
            let batched = unrolled[step].0.get(b).unwrap().to_vec2::<f32>().unwrap();
            for r in 0..seq.len {
                let d = max_diff(&alone[r], &batched[r]);
                assert!(
                    d < 1e-4,
                    "sequence {b} step {step} row {r}: outputs differ by {d}"
                );
            }
        }
    }
}

fn texts(t: &LoadedModel, n: usize, len: usize) -> Vec<TrainingText> {
    let v = t.model.config().vocab_size as u32;
    (0..n)
        .map(|i| TrainingText {
            tokens: (0..len as u32)
                .map(|j| (j * 7 + i as u32 * 13 + (j * j) % 5) % v)
                .collect(),
            loss_from: 1,
            source: format!("test:{i}"),
        })
        .collect()
}

#[test]
fn training_lowers_the_loss_and_checkpoints_resume() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let data = texts(&t, 9, 24);
    let opts = TrainOptions {
        out: dir.path().join("head"),
        draft_vocab: 64,
        ttt_steps: 2,
        epochs: 6,
        batch: 2,
        lr: 3e-3,
        aux_layers: Some(vec![0, 1, 2]),
        intermediate_size: Some(96),
        eval_every: 3,
        checkpoint_every: 2,
        ..Default::default()
    };
    let layers = [0usize, 1, 2];
    // KL divergence from the target on the training sequences (cross-entropy minus the target's entropy: the
    // part training can remove), step 0.
    let train_loss = |dir: &Path| -> f32 {
        let (params, _, vocab, _) = load_checkpoint(
            dir,
            t.model.config(),
            &|s| {
                let json = head_config_json(
                    t.model.config(),
                    &s.target_layers,
                    s.draft_vocab,
                    s.intermediate,
                );
                let hc = HeadConfig::from_json(&json.to_string(), Path::new("c")).unwrap();
                Ok(HeadShape::new(
                    &hc.layer,
                    t.model.config().hidden_size,
                    s.draft_vocab,
                ))
            },
            &Device::Cpu,
        )
        .unwrap();
        let mut total = 0.0;
        for (i, text) in data.iter().enumerate() {
            if i % 3 == 0 {
                continue;
            }
            let seq = data::prepare(t.model.as_ref(), &layers, &vocab, text, 2, 64).unwrap();
            let probs = seq.target_probs.to_vec2::<f32>().unwrap();
            let rows: Vec<usize> = (1..seq.len)
                .filter(|&r| seq.target_ids[r].is_some())
                .collect();
            let entropy: f32 = rows
                .iter()
                .map(|&r| {
                    -probs[r]
                        .iter()
                        .map(|&p| if p > 0.0 { p * p.ln() } else { 0.0 })
                        .sum::<f32>()
                })
                .sum::<f32>()
                / rows.len().max(1) as f32;
            total += params.forward_ttt(&seq, 2).unwrap().step_loss[0] - entropy;
        }
        total
    };
    // One epoch first, then resume for the rest: the step count continues and the loss keeps falling.
    let mut seen = Vec::new();
    let first = train(
        &t,
        &data,
        &TrainOptions {
            epochs: 1,
            ..opts.clone()
        },
        &mut |p| seen.push(p.step),
    )
    .unwrap();
    assert_eq!(first.steps, 3, "6 training sequences in batches of 2");
    assert_eq!(seen, vec![1, 2, 3]);
    let after_one = train_loss(&opts.out);
    // Without --resume an existing checkpoint is refused, by name.
    let err = train(&t, &data, &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("--resume"), "{err}");
    let resumed = train(
        &t,
        &data,
        &TrainOptions {
            resume: true,
            ..opts.clone()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(resumed.steps, 18);
    let after_all = train_loss(&opts.out);
    assert!(
        after_all < 0.85 * after_one,
        "KL from the target {after_one} after one epoch, {after_all} after six"
    );
    // The export loads as a head for the target, records its training, and its d2t maps into the vocabulary.
    let head = Eagle3Head::load(&opts.out).unwrap();
    head.check_target(t.model.config()).unwrap();
    assert_eq!(head.config.aux_layers, Some(vec![0, 1, 2]));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(opts.out.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["specula_training"]["steps"], 18);
    assert_eq!(resumed.eval_accuracy.len(), 2);
    // A run started from that head (--init-head) begins where it ended (the exported weights, its draft
    // vocabulary), not where a random head begins: stopped before its first step, its checkpoint's loss on the
    // training sequences is the trained head's, well below a fresh run's.
    let start_of = |name: &str, init_head: Option<PathBuf>| -> f32 {
        let out = dir.path().join(name);
        train(
            &t,
            &data,
            &TrainOptions {
                out: out.clone(),
                init_head,
                max_time: Some(std::time::Duration::ZERO),
                ..opts.clone()
            },
            &mut |_| {},
        )
        .unwrap();
        train_loss(&out)
    };
    let warm = start_of("warm", Some(opts.out.clone()));
    let fresh = start_of("fresh", None);
    assert!(
        (warm - after_all).abs() <= 0.05 * after_all.abs(),
        "warm start {warm}, the trained head {after_all}"
    );
    assert!(warm < 0.9 * fresh, "warm start {warm}, fresh {fresh}");
    let warm_head = Eagle3Head::load(&dir.path().join("warm")).unwrap();
    assert_eq!(warm_head.config.draft_vocab, head.config.draft_vocab);
    // A larger --draft-vocab grows the head's vocabulary: every token it had keeps its LM head row (moved to its
    // new draft id), and the new tokens are the data's most frequent ones it lacked.
    let grown_dir = dir.path().join("grown");
    train(
        &t,
        &data,
        &TrainOptions {
            out: grown_dir.clone(),
            init_head: Some(opts.out.clone()),
            draft_vocab: 80,
            max_time: Some(std::time::Duration::ZERO),
            ..opts.clone()
        },
        &mut |_| {},
    )
    .unwrap();
    let stored =
        |d: &Path| Eagle3Head::load_as(d, crate::draft::eagle3::HeadPrecision::Stored).unwrap();
    let (before, after) = (stored(&opts.out), stored(&grown_dir));
    assert_eq!(after.config.draft_vocab, 80);
    let ids = |h: &Eagle3Head| {
        (0..h.draft_vocab())
            .map(|d| h.target_id(d))
            .collect::<Vec<u32>>()
    };
    let (old_ids, new_ids) = (ids(&before), ids(&after));
    assert!(new_ids.windows(2).all(|w| w[0] < w[1]), "{new_ids:?}");
    let h = before.config.layer.hidden_size;
    let (old_lm, new_lm) = (before.host_weights().lm_head, after.host_weights().lm_head);
    for (d, t) in old_ids.iter().enumerate() {
        let g = new_ids
            .iter()
            .position(|x| x == t)
            .expect("a token the head had was dropped");
        assert_eq!(
            old_lm[d * h..(d + 1) * h],
            new_lm[g * h..(g + 1) * h],
            "token {t}'s row moved from draft id {d} to {g} changed"
        );
    }
    let grown = DraftVocab::from_ids(old_ids.clone(), t.model.config().vocab_size)
        .unwrap()
        .grown(&data, 80)
        .unwrap();
    assert_eq!(grown.ids, new_ids);
    // A smaller --draft-vocab keeps the head's vocabulary.
    let same = DraftVocab::from_ids(old_ids.clone(), t.model.config().vocab_size)
        .unwrap()
        .grown(&data, 10)
        .unwrap();
    assert_eq!(same.ids, old_ids);
    // A head of another shape is refused, naming both.
    let err = train(
        &t,
        &data,
        &TrainOptions {
            out: dir.path().join("other"),
            intermediate_size: Some(64),
            init_head: Some(opts.out.clone()),
            ..opts.clone()
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("96") && err.contains("64"), "{err}");
}

#[test]
fn draft_vocabulary_takes_the_most_frequent_answer_tokens() {
    let texts = vec![
        TrainingText {
            tokens: vec![9, 9, 9, 9, 4, 4, 7],
            loss_from: 1,
            source: "a".into(),
        },
        TrainingText {
            // Prompt tokens (before loss_from) do not count.
            tokens: vec![1, 1, 1, 1, 7],
            loss_from: 4,
            source: "b".into(),
        },
    ];
    let v = DraftVocab::by_frequency(&texts, 12, 3).unwrap();
    assert_eq!(v.ids, vec![4, 7, 9]);
    assert_eq!(v.d2t(), vec![4, 6, 7]);
    assert_eq!(v.draft_of[7], Some(1));
    assert_eq!(v.draft_of[1], None);
    // Every answer token is covered.
    assert!((v.coverage(&texts) - 1.0).abs() < 1e-12);
    // Grown: the most frequent answer tokens it lacked first (4 and 7 twice each: the smaller id first), then the
    // smallest unused ids.
    let one = DraftVocab::from_ids(vec![9], 12).unwrap();
    assert_eq!(one.grown(&texts, 2).unwrap().ids, vec![4, 9]);
    assert_eq!(one.grown(&texts, 5).unwrap().ids, vec![0, 1, 4, 7, 9]);
    assert_eq!(one.grown(&texts, 1).unwrap(), one);
    let small = DraftVocab::by_frequency(&texts, 12, 1).unwrap();
    assert_eq!(small.ids, vec![9]);
    assert!((small.coverage(&texts) - 3.0 / 7.0).abs() < 1e-12);
    assert!(DraftVocab::from_ids(vec![3, 40], 12).is_err());
}

#[test]
fn bad_options_are_refused_by_name() {
    for (opts, needle) in [
        (
            TrainOptions {
                ttt_steps: 0,
                ..Default::default()
            },
            "--ttt-steps",
        ),
        (
            TrainOptions {
                lr: 0.0,
                ..Default::default()
            },
            "--lr",
        ),
        (
            TrainOptions {
                batch: 0,
                ..Default::default()
            },
            "--batch",
        ),
        (
            TrainOptions {
                draft_vocab: 0,
                ..Default::default()
            },
            "--draft-vocab",
        ),
    ] {
        let err = opts.validate().unwrap_err().to_string();
        assert!(err.contains(needle), "{err}");
    }
}

#[test]
fn training_sequences_fit_the_targets_context() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let ctx = t.model.config().context_length;
    let prompts = vec![(
        "p".to_string(),
        "write a function that adds two numbers".to_string(),
    )];
    // Longer answers and sequences than the context holds: capped, not an error.
    let answers =
        data::self_distilled_texts(&t, &prompts, 10 * ctx, 10 * ctx, 4, &mut |_, _, _| {}).unwrap();
    assert_eq!(answers.len(), 1);
    assert!(
        answers[0].tokens.len() <= ctx,
        "{} > {ctx}",
        answers[0].tokens.len()
    );
    assert!(answers[0].loss_from > 0 && answers[0].tokens.len() > answers[0].loss_from);
    let corpus = dir.path().join("c.txt");
    std::fs::write(&corpus, "x = 1\n".repeat(2000)).unwrap();
    let chunks = data::corpus_texts(&t, &[corpus], 10 * ctx, 100_000).unwrap();
    assert!(chunks.len() > 1 && chunks.iter().all(|c| c.tokens.len() <= ctx));
}

#[test]
fn batched_self_distillation_equals_one_prompt_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let prompts: Vec<(String, String)> = [
        "write a function that adds two numbers",
        "sort a list",
        "explain recursion with an example in python please",
        "hi",
        "reverse a string without using slicing, and test it",
    ]
    .iter()
    .enumerate()
    .map(|(i, p)| (format!("p{i}"), p.to_string()))
    .collect();
    // Batches of 3 over 5 prompts: slots free and refill while others decode.
    let batched = data::self_distilled_texts(&t, &prompts, 12, 96, 3, &mut |_, _, _| {}).unwrap();
    let mut alone = Vec::new();
    for (id, prompt) in &prompts {
        let text = t.format_prompt(prompt, false, None).unwrap();
        let prompt_tokens = t.tokenizer.encode(&text).unwrap();
        let req = crate::decode::GenerateRequest {
            prompt_tokens: prompt_tokens.clone(),
            max_new_tokens: 12,
            sampling: crate::sampling::SamplingParams::default(),
            stop_at_eos: true,
            cancel: None,
            logprobs: None,
            logit_adjustments: None,
            stop_token_ids: Vec::new(),
        };
        let answer = crate::decode::generate(
            t.model.as_ref(),
            &t.tokenizer,
            &req,
            None,
            &crate::profile::Profiler::disabled(),
            &mut |_| {},
        )
        .unwrap();
        let mut tokens = prompt_tokens.clone();
        tokens.extend(&answer.tokens);
        alone.push(TrainingText {
            tokens,
            loss_from: prompt_tokens.len(),
            source: format!("answer:{id}"),
        });
    }
    assert_eq!(batched.len(), prompts.len());
    assert_eq!(batched, alone);
}

#[test]
fn training_tensors_hold_the_targets_outputs_exactly() {
    // The dense targets are scattered and the features widened where training runs; the values must be the
    // top-k probabilities at their draft ids (zeros elsewhere) and the f16 features as f32, bit for bit.
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let data = texts(&t, 4, 20);
    let vocab = DraftVocab::by_frequency(&data, t.model.config().vocab_size, 48).unwrap();
    let layers = [0usize, 1, 2];
    for text in &data {
        let out = data::target_outputs(t.model.as_ref(), &layers, &vocab, text, 5).unwrap();
        let seq = out
            .sequence(t.model.as_ref(), text, 2, vocab.len(), &Device::Cpu)
            .unwrap();
        let probs = seq.target_probs.to_vec2::<f32>().unwrap();
        assert_eq!(probs.len(), out.len);
        for (r, row) in probs.iter().enumerate() {
            let mut want = vec![0f32; vocab.len()];
            for &(d, p) in &out.top[r * out.top_k..(r + 1) * out.top_k] {
                want[d as usize] = p;
            }
            assert!(
                row.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {r} of {}",
                text.source
            );
        }
        let features: Vec<f32> = seq.features.flatten_all().unwrap().to_vec1().unwrap();
        let want: Vec<f32> = out.features.iter().map(|v| v.to_f32()).collect();
        assert!(features
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(features.len(), want.len());
    }
}

#[test]
fn target_passes_run_ahead_without_changing_what_is_trained() {
    // Prefetching runs the same passes on another thread and hands them over in order: the head must come out
    // bit for bit the same, whether outputs are kept between epochs or recomputed.
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let data = texts(&t, 9, 20);
    let run = |name: &str, prefetch: usize, cache_bytes: usize| {
        let opts = TrainOptions {
            out: dir.path().join(name),
            draft_vocab: 48,
            ttt_steps: 2,
            epochs: 3,
            batch: 2,
            lr: 3e-3,
            aux_layers: Some(vec![0, 1, 2]),
            intermediate_size: Some(64),
            eval_every: 3,
            prefetch,
            cache_bytes,
            ..Default::default()
        };
        let mut losses = Vec::new();
        let report = train(&t, &data, &opts, &mut |p| losses.push(p.loss)).unwrap();
        (report, losses)
    };
    let (plain, plain_losses) = run("plain", 0, 4 << 30);
    assert_eq!(plain.target_passes.passes, 9, "each text once: kept after");
    for (name, prefetch, cache) in [("ahead", 3, 4 << 30), ("ahead-nocache", 2, 0)] {
        let (ahead, losses) = run(name, prefetch, cache);
        assert_eq!(losses, plain_losses, "{name}");
        assert_eq!(ahead.head_sha256, plain.head_sha256, "{name}");
        assert_eq!(ahead.eval_accuracy, plain.eval_accuracy, "{name}");
    }
    let (nocache, _) = run("plain-nocache", 0, 0);
    assert_eq!(
        nocache.target_passes.passes,
        3 * 6 + 2 * 3,
        "recomputed every epoch: 6 training texts x 3 epochs, 3 held out x 2 evaluations"
    );
}

#[test]
fn a_batch_trains_the_same_in_one_graph_or_one_sequence_at_a_time() {
    // The GPU default (the whole batch in one graph) and the CPU default (one sequence a graph) differ only in
    // the order of floating-point sums: the per-step losses agree closely over a short run.
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    let data = texts(&t, 9, 20);
    let run = |name: &str, micro_batch: Option<usize>| {
        let opts = TrainOptions {
            out: dir.path().join(name),
            draft_vocab: 48,
            ttt_steps: 2,
            epochs: 2,
            batch: 3,
            micro_batch,
            lr: 3e-3,
            aux_layers: Some(vec![0, 1, 2]),
            intermediate_size: Some(64),
            eval_every: 3,
            ..Default::default()
        };
        assert_eq!(
            opts.graph_sequences(),
            micro_batch.unwrap_or(1),
            "the CPU default"
        );
        let mut losses = Vec::new();
        let report = train(&t, &data, &opts, &mut |p| losses.push(p.loss)).unwrap();
        (report, losses)
    };
    let (alone, alone_losses) = run("alone", None);
    let (together, losses) = run("together", Some(3));
    assert_eq!(
        losses.len(),
        4,
        "6 training texts in batches of 3, two epochs"
    );
    assert!(
        alone_losses[3] < alone_losses[0],
        "training lowers the loss: {alone_losses:?}"
    );
    for (a, b) in alone_losses.iter().zip(&losses) {
        assert!(
            (a - b).abs() <= 1e-3 * a.abs(),
            "losses {alone_losses:?} against {losses:?}"
        );
    }
    for (a, b) in alone.eval_loss.iter().zip(&together.eval_loss) {
        assert!(
            (a - b).abs() <= 1e-3 * a.abs(),
            "held-out losses {a} against {b}"
        );
    }
    let bad = TrainOptions {
        micro_batch: Some(0),
        ..Default::default()
    };
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("--micro-batch"), "{err}");
}
