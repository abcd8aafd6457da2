//! Forward-pass properties on tiny random models written through the real loaders, through the backend
//! interface (`dyn Model`).

use crate::backend::cpu::{ops, weights::Weight};
use crate::model::dtype::GgmlType;
use crate::model::forward::{HostOutput, SequenceCache};
use crate::model::{
    gguf, load_gguf, load_path, Format, ForwardOptions, LoadedModel, LogitsFor, Model,
    SequenceInput, TreeMask,
};
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

fn cache(model: &dyn Model) -> Box<dyn SequenceCache> {
    model.new_cache(model.config().context_length).unwrap()
}

fn forward(
    model: &dyn Model,
    tokens: &[u32],
    cache: &mut dyn SequenceCache,
    logits: LogitsFor,
    opts: &ForwardOptions<'_>,
) -> crate::Result<HostOutput> {
    model
        .forward_one(tokens, cache, opts, logits, &Profiler::disabled())?
        .to_host()
}

fn all_logits(model: &dyn Model, tokens: &[u32], cache: &mut dyn SequenceCache) -> HostOutput {
    forward(
        model,
        tokens,
        cache,
        LogitsFor::All,
        &ForwardOptions::default(),
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
        let model = m.model.as_ref();
        let batch = all_logits(model, &TOKENS, cache(model).as_mut());
        assert_eq!(batch.logits.rows, TOKENS.len());
        let mut c = cache(model);
        for (i, &t) in TOKENS.iter().enumerate() {
            let one = all_logits(model, &[t], c.as_mut());
            // Batch invariance: bitwise equal, not just close.
            assert_eq!(one.row(0), batch.row(i), "{} position {i}", ty.name());
        }
        assert_eq!(c.len(), TOKENS.len());
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
    let model = m.model.as_ref();
    let batch = all_logits(model, &TOKENS, cache(model).as_mut());
    let mut c = cache(model);
    all_logits(model, &TOKENS[..4], c.as_mut());
    let rest = all_logits(model, &TOKENS[4..], c.as_mut());
    for i in 0..rest.logits.rows {
        assert_eq!(rest.row(i), batch.row(4 + i));
    }
}

/// Several sequences in one forward pass (continuous batching): each sequence's logits are bitwise what it gets
/// alone, whatever else is in the batch and whatever each asks for; hidden states are split per sequence.
#[test]
fn batched_sequences_equal_separate_forwards() {
    let (_d, m) = load_tiny(&TinySpec {
        weight_type: GgmlType::Q8_0,
        ..Default::default()
    });
    let model = m.model.as_ref();
    let prompts: [&[u32]; 3] = [&TOKENS[..5], &TOKENS[2..9], &TOKENS[..1]];
    let opts = ForwardOptions {
        capture_layers: &[1],
        vocab_limit: None,
    };
    // Each sequence alone: a prefix already cached, then new rows.
    let alone: Vec<HostOutput> = prompts
        .iter()
        .map(|p| {
            let mut c = cache(model);
            all_logits(model, &[7, 8], c.as_mut());
            forward(model, p, c.as_mut(), LogitsFor::All, &opts).unwrap()
        })
        .collect();
    let mut caches: Vec<Box<dyn SequenceCache>> = (0..3).map(|_| cache(model)).collect();
    for c in &mut caches {
        all_logits(model, &[7, 8], c.as_mut());
    }
    let logits_for = [LogitsFor::All, LogitsFor::Last, LogitsFor::None];
    let mut batch: Vec<SequenceInput<'_>> = caches
        .iter_mut()
        .zip(prompts)
        .zip(logits_for)
        .map(|((c, tokens), logits)| SequenceInput {
            tokens,
            cache: c.as_mut(),
            logits,
            tree: None,
        })
        .collect();
    let out = model
        .forward(&mut batch, &opts, &Profiler::disabled())
        .unwrap();
    drop(batch);
    let out: Vec<HostOutput> = out.iter().map(|o| o.to_host().unwrap()).collect();
    assert_eq!(out[0].logits, alone[0].logits);
    assert_eq!(out[1].logits.rows, 1);
    assert_eq!(out[1].row(0), alone[1].last());
    assert_eq!(out[2].logits.rows, 0);
    for s in 0..3 {
        assert_eq!(out[s].hidden, alone[s].hidden, "sequence {s} hidden states");
        assert_eq!(caches[s].len(), 2 + prompts[s].len());
    }
}

/// A tree of new rows (EAGLE-3 tree verify): each row's logits are bitwise those of the chain from the root to
/// it, a chain-shaped tree is the plain forward, and keeping one branch's rows leaves the cache as if only that
/// branch had been fed.
#[test]
fn tree_verify_equals_its_branches_and_keeps_the_chosen_one() {
    let (_d, m) = load_tiny(&TinySpec {
        weight_type: GgmlType::Q4_1,
        ..Default::default()
    });
    let model = m.model.as_ref();
    let prefix = &TOKENS[..4];
    // Rows: 0 = pending token; 1, 2 children of 0; 3 child of 1; 4 child of 2; 5 child of 3.
    let tokens = [40u32, 41, 42, 43, 44, 45];
    let tree = TreeMask::new(vec![None, Some(0), Some(0), Some(1), Some(2), Some(3)]).unwrap();
    let run_tree = |c: &mut dyn SequenceCache, tree: &TreeMask, tokens: &[u32]| -> HostOutput {
        let mut batch = [SequenceInput {
            tokens,
            cache: c,
            logits: LogitsFor::All,
            tree: Some(tree),
        }];
        let out = model
            .forward(
                &mut batch,
                &ForwardOptions::default(),
                &Profiler::disabled(),
            )
            .unwrap();
        out[0].to_host().unwrap()
    };
    let mut c = cache(model);
    all_logits(model, prefix, c.as_mut());
    let got = run_tree(c.as_mut(), &tree, &tokens);
    let branches: [&[usize]; 2] = [&[0, 1, 3, 5], &[0, 2, 4]];
    for rows in branches {
        let mut chain_cache = cache(model);
        all_logits(model, prefix, chain_cache.as_mut());
        let chain_tokens: Vec<u32> = rows.iter().map(|&r| tokens[r]).collect();
        let chain = all_logits(model, &chain_tokens, chain_cache.as_mut());
        for (i, &r) in rows.iter().enumerate() {
            assert_eq!(got.row(r), chain.row(i), "tree row {r}");
        }
    }
    // A chain-shaped tree is the default causal forward.
    let mut a = cache(model);
    all_logits(model, prefix, a.as_mut());
    let as_tree = run_tree(a.as_mut(), &TreeMask::chain(4), &TOKENS[4..8]);
    let mut b = cache(model);
    all_logits(model, prefix, b.as_mut());
    assert_eq!(
        as_tree.logits,
        all_logits(model, &TOKENS[4..8], b.as_mut()).logits
    );
    // Keep branch 0 -> 2 -> 4, then continue: the same as having fed only that branch.
    c.keep_new_rows(prefix.len(), &[0, 2, 4]).unwrap();
    assert_eq!(c.len(), prefix.len() + 3);
    let next = all_logits(model, &[50], c.as_mut());
    let mut d = cache(model);
    all_logits(model, prefix, d.as_mut());
    all_logits(model, &[40, 42, 44], d.as_mut());
    assert_eq!(next.logits, all_logits(model, &[50], d.as_mut()).logits);
    assert!(c.keep_new_rows(prefix.len(), &[2, 1]).is_err());
    assert!(TreeMask::new(vec![None, Some(3)]).is_err());
}

#[test]
fn truncating_the_cache_and_refeeding_reproduces_logits() {
    let (_d, m) = load_tiny(&TinySpec::default());
    let model = m.model.as_ref();
    let reference = all_logits(model, &TOKENS, cache(model).as_mut());
    // Go past L = 5 with different tokens, then roll back and feed the original continuation.
    let mut c = cache(model);
    all_logits(model, &TOKENS[..5], c.as_mut());
    all_logits(model, &[1, 2, 3], c.as_mut());
    assert_eq!(c.len(), 8);
    c.truncate(5);
    assert_eq!(c.len(), 5);
    let refed = all_logits(model, &TOKENS[5..], c.as_mut());
    for i in 0..refed.logits.rows {
        assert_eq!(refed.row(i), reference.row(5 + i), "position {}", 5 + i);
    }
}

#[test]
fn cache_growth_keeps_earlier_positions() {
    // More than the initial capacity (64) forces a re-layout of the head-major cache.
    let (_d, m) = load_tiny(&TinySpec::default());
    let model = m.model.as_ref();
    let tokens: Vec<u32> = (0..100).map(|i| (i * 7 % 250) as u32).collect();
    let batch = all_logits(model, &tokens, cache(model).as_mut());
    let mut c = cache(model);
    for chunk in tokens.chunks(30) {
        let start = c.len();
        let out = all_logits(model, chunk, c.as_mut());
        for i in 0..out.logits.rows {
            assert_eq!(out.row(i), batch.row(start + i));
        }
    }
    // A cache made smaller than the context refuses what does not fit, naming it.
    let mut small = model.new_cache(8).unwrap();
    let err = forward(
        model,
        &TOKENS,
        small.as_mut(),
        LogitsFor::Last,
        &ForwardOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("do not fit its KV cache of 8"), "{err}");
}

#[test]
fn hidden_state_capture_returns_requested_layers() {
    let spec = TinySpec {
        layers: 3,
        ..Default::default()
    };
    let (_d, m) = load_tiny(&spec);
    let model = m.model.as_ref();
    let opts = ForwardOptions {
        capture_layers: &[2, 0],
        vocab_limit: None,
    };
    let out = forward(
        model,
        &TOKENS[..4],
        cache(model).as_mut(),
        LogitsFor::Last,
        &opts,
    )
    .unwrap();
    assert_eq!(out.logits.rows, 1);
    let layers: Vec<usize> = out.hidden.iter().map(|(l, _)| *l).collect();
    assert_eq!(layers, vec![2, 0]);
    for (_, h) in &out.hidden {
        assert_eq!((h.rows, h.cols), (4, spec.hidden));
    }
    assert_ne!(out.hidden[0].1, out.hidden[1].1);
    // The last layer's output, normed and projected by the (tied) head, is exactly the logits.
    let last = out.hidden[0].1.row(3);
    let cfg = model.config();
    let mut normed = vec![0f32; spec.hidden];
    let norm_w = tensor_from_gguf(&m, "output_norm.weight", 1, spec.hidden).to_f32();
    ops::rms_norm(last, &norm_w, cfg.rms_norm_eps as f32, &mut normed);
    let embed = tensor_from_gguf(&m, "token_embd.weight", cfg.vocab_size, spec.hidden);
    let mut logits = vec![0f32; cfg.vocab_size];
    embed.matmul(&normed, 1, &mut logits);
    assert_eq!(logits, out.last());

    let bad = ForwardOptions {
        capture_layers: &[3],
        vocab_limit: None,
    };
    let err = forward(model, &[1], cache(model).as_mut(), LogitsFor::Last, &bad);
    assert!(err.unwrap_err().to_string().contains("has 3 layers"));
}

fn tensor_from_gguf(m: &LoadedModel, name: &str, rows: usize, cols: usize) -> Weight {
    let file = gguf::GgufFile::open(&m.path).unwrap();
    let t = file.tensor(name, rows, cols).unwrap();
    Weight::from_raw(t.dtype, t.bytes, rows, cols).unwrap()
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
    assert_eq!(hf.model.config().vocab_size, g.model.config().vocab_size);
    let a = all_logits(g.model.as_ref(), &TOKENS, cache(g.model.as_ref()).as_mut());
    let b = all_logits(
        hf.model.as_ref(),
        &TOKENS,
        cache(hf.model.as_ref()).as_mut(),
    );
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
        let model = m.model.as_ref();
        let vocab = model.config().vocab_size;
        let run = |limit: Option<usize>| {
            let opts = ForwardOptions {
                capture_layers: &[],
                vocab_limit: limit,
            };
            forward(
                model,
                &TOKENS[..3],
                cache(model).as_mut(),
                LogitsFor::All,
                &opts,
            )
        };
        let full = run(None).unwrap();
        let limited = run(Some(100)).unwrap();
        assert_eq!(limited.logits.cols, 100);
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

/// One forward pass as [`Recording`] saw it: each sequence's new rows and logits choice, and the captured layers.
type RecordedPass = (Vec<(usize, LogitsFor)>, Vec<usize>);

/// A model that records the batches it is asked to run.
struct Recording<'a> {
    inner: &'a dyn Model,
    passes: std::sync::Mutex<Vec<RecordedPass>>,
}

impl Model for Recording<'_> {
    fn config(&self) -> &crate::model::Config {
        self.inner.config()
    }
    fn device(&self) -> String {
        self.inner.device()
    }
    fn new_cache(&self, capacity: usize) -> crate::Result<Box<dyn SequenceCache>> {
        self.inner.new_cache(capacity)
    }
    fn forward(
        &self,
        batch: &mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
        prof: &Profiler,
    ) -> crate::Result<Vec<crate::model::ForwardOutput>> {
        let seqs = batch.iter().map(|s| (s.tokens.len(), s.logits)).collect();
        self.passes
            .lock()
            .unwrap()
            .push((seqs, opts.capture_layers.to_vec()));
        self.inner.forward(batch, opts, prof)
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn weight_types(&self) -> String {
        self.inner.weight_types()
    }
    fn check_kernels(
        &self,
        tokens: &[u32],
    ) -> crate::Result<Vec<crate::model::forward::KernelCheck>> {
        self.inner.check_kernels(tokens)
    }
}

#[test]
fn preparing_steps_runs_the_largest_step_first_then_every_row_count() {
    let (_dir, m) = load_tiny(&TinySpec::default());
    let rec = Recording {
        inner: m.model.as_ref(),
        passes: Default::default(),
    };
    let capture = [0usize, 1];
    let shapes = crate::model::StepShapes {
        max_rows: 40,
        max_sequences: 4,
        max_logit_rows: 16,
        capture_layers: &capture,
        vocab_limit: None,
        last_row_logits_only: false,
    };
    // The CPU has nothing to prepare.
    assert_eq!(m.model.prepare_steps(&shapes).unwrap(), 0);
    // What a GPU runs: rows up to 10 get a pass each (its graphs' limit), each with logits for every row.
    assert_eq!(
        crate::model::run_step_shapes(&rec, &shapes, 10).unwrap(),
        10
    );
    let passes = rec.passes.into_inner().unwrap();
    assert_eq!(passes.len(), 12);
    assert!(passes.iter().all(|(_, c)| c == &capture));
    assert_eq!(passes[0].0, vec![(40, LogitsFor::Last)]);
    assert_eq!(passes[1].0, vec![(4, LogitsFor::All); 4]);
    for (rows, (seqs, _)) in (1..=10).zip(&passes[2..]) {
        assert_eq!(seqs, &vec![(rows, LogitsFor::All)]);
    }
    // Without a graph limit below it, every logit row count up to 16; a context shorter than a step is kept to.
    let rec = Recording {
        inner: m.model.as_ref(),
        passes: Default::default(),
    };
    let n = crate::model::run_step_shapes(&rec, &shapes, usize::MAX).unwrap();
    assert_eq!(n, 16);
    let context = m.model.config().context_length;
    let huge = crate::model::StepShapes {
        max_rows: context * 4,
        max_logit_rows: 3,
        ..shapes
    };
    let rec = Recording {
        inner: m.model.as_ref(),
        passes: Default::default(),
    };
    crate::model::run_step_shapes(&rec, &huge, 64).unwrap();
    assert_eq!(
        rec.passes.lock().unwrap()[0].0,
        vec![(context, LogitsFor::Last)]
    );
    // A draft model's steps: one sequence, every row count up to the graphs' limit with its last row's logits
    // (a catch-up of any length short of it replays a graph instead of capturing one mid-request).
    let draft = crate::model::StepShapes {
        max_rows: 24,
        max_sequences: 1,
        max_logit_rows: 1,
        capture_layers: &[],
        vocab_limit: Some(100),
        last_row_logits_only: true,
    };
    let rec = Recording {
        inner: m.model.as_ref(),
        passes: Default::default(),
    };
    assert_eq!(crate::model::run_step_shapes(&rec, &draft, 10).unwrap(), 10);
    let passes = rec.passes.into_inner().unwrap();
    assert_eq!(passes.len(), 12);
    for (rows, (seqs, _)) in (1..=10).zip(&passes[2..]) {
        assert_eq!(seqs, &vec![(rows, LogitsFor::Last)]);
    }
}
