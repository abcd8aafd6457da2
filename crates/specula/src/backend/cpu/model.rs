//! The Llama-family transformer on the CPU (Llama 2/3, Qwen2/2.5, SmolLM2): RMSNorm, GQA attention with RoPE
//! (optional QKV bias), SwiGLU MLP, tied or separate LM head.
//!
//! One forward pass serves a batch of sequences: their new rows are concatenated into each matmul (the matmul is
//! row-independent, so every row is bitwise what it would be alone) and attention runs per (sequence, row, head)
//! against that sequence's cache, following its tree mask if it has one. It returns logits for the rows asked
//! for and the hidden states of chosen layers: the pieces speculative decoding is built from.

use crate::backend::cpu::kv_cache::KvCache;
use crate::backend::cpu::ops;
use crate::backend::cpu::weights::{MatmulKernel, Weight};
use crate::error::{Error, Result};
use crate::model::config::{Config, RopeStyle};
use crate::model::forward::{
    check_batch, ForwardOptions, ForwardOutput, HostRows, KernelCheck, LogitsFor, Model, RowMatrix,
    SequenceCache, SequenceInput, TreeMask,
};
use crate::model::tensors::{LayerTensor, TensorNames, WeightSource};
use crate::parallel;
use crate::profile::{FineKind, Profiler};

struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    wo: Weight,
    ffn_norm: Vec<f32>,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
}

pub struct CpuModel {
    pub config: Config,
    embed: Weight,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// None when the LM head is tied to the embedding.
    lm_head: Option<Weight>,
    rope_inv_freqs: Vec<f32>,
}

/// A checked tensor of the checkpoint, in CPU storage.
fn weight(src: &dyn WeightSource, name: &str, rows: usize, cols: usize) -> Result<Weight> {
    let t = src.tensor(name, rows, cols)?;
    Weight::from_raw(t.dtype, t.bytes, rows, cols).map_err(|reason| Error::BadTensor {
        path: t.file.to_path_buf(),
        tensor: name.to_string(),
        reason,
    })
}

fn vector(src: &dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>> {
    Ok(weight(src, name, 1, len)?.to_f32())
}

impl CpuModel {
    /// Loads the weights named by `names` from `src` into CPU storage.
    pub fn load(config: Config, src: &dyn WeightSource, names: &TensorNames) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let (h, q_dim, kv_dim) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let embed = weight(src, names.embed, c.vocab_size, h)?;
        // Some tied checkpoints also store the head explicitly; use it when present.
        let lm_head = if src.has(names.lm_head) {
            Some(weight(src, names.lm_head, c.vocab_size, h)?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(Error::MissingTensor {
                name: names.lm_head.to_string(),
                hint: " (the config says the LM head is not tied to the embedding)".into(),
            });
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |t| (names.layer)(i, t);
            let bias = |t, len| -> Result<Option<Vec<f32>>> {
                let name = n(t);
                if src.has(&name) {
                    Ok(Some(vector(src, &name, len)?))
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: vector(src, &n(LayerTensor::AttnNorm), h)?,
                wq: weight(src, &n(LayerTensor::Q), q_dim, h)?,
                wk: weight(src, &n(LayerTensor::K), kv_dim, h)?,
                wv: weight(src, &n(LayerTensor::V), kv_dim, h)?,
                bq: bias(LayerTensor::QBias, q_dim)?,
                bk: bias(LayerTensor::KBias, kv_dim)?,
                bv: bias(LayerTensor::VBias, kv_dim)?,
                wo: weight(src, &n(LayerTensor::O), h, q_dim)?,
                ffn_norm: vector(src, &n(LayerTensor::FfnNorm), h)?,
                w_gate: weight(src, &n(LayerTensor::Gate), c.intermediate_size, h)?,
                w_up: weight(src, &n(LayerTensor::Up), c.intermediate_size, h)?,
                w_down: weight(src, &n(LayerTensor::Down), h, c.intermediate_size)?,
            });
        }
        let freq_factors = match names.rope_freqs {
            Some(name) if src.has(name) => Some(vector(src, name, c.head_dim / 2)?),
            _ => None,
        };
        let rope_inv_freqs = c.rope_inv_freqs(freq_factors.as_deref());
        Ok(CpuModel {
            final_norm: vector(src, names.final_norm, h)?,
            embed,
            layers,
            lm_head,
            rope_inv_freqs,
            config,
        })
    }

    fn weight_bytes_read(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|w| w.size_in_bytes())
                    .sum::<usize>()
            })
            .sum();
        per_layer + self.lm_head.as_ref().unwrap_or(&self.embed).size_in_bytes()
    }

    fn storage_types(&self) -> String {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        let mut add = |w: &Weight| {
            let name = w.dtype().name();
            match counts.iter_mut().find(|(n, _)| *n == name) {
                Some(c) => c.1 += 1,
                None => counts.push((name, 1)),
            }
        };
        add(&self.embed);
        for l in &self.layers {
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                add(w);
            }
        }
        if let Some(w) = &self.lm_head {
            add(w);
        }
        counts
            .iter()
            .map(|(n, c)| format!("{n} x {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Where each row of a batched forward pass comes from.
struct RowPlace {
    /// Index of its sequence in the batch.
    seq: usize,
    /// Its index among that sequence's new rows.
    new_row: usize,
    /// Its cache slot (where its key and value go): the cache length plus `new_row`.
    slot: usize,
    /// Its position (RoPE): the slot for a chain, the cache length plus its depth in a tree.
    position: usize,
}

impl CpuModel {
    /// Checks a batch against the model and returns each sequence's cache, downcast to the CPU's.
    fn caches<'b>(
        &self,
        batch: &'b mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<Vec<&'b mut KvCache>> {
        let c = &self.config;
        check_batch(c, batch, opts)?;
        let mut caches = Vec::with_capacity(batch.len());
        for (s, seq) in batch.iter_mut().enumerate() {
            let n = seq.tokens.len();
            let cache = seq
                .cache
                .as_any_mut()
                .downcast_mut::<KvCache>()
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "sequence {s}'s KV cache belongs to another backend than the CPU"
                    ))
                })?;
            if cache.num_layers() != c.num_layers || cache.kv_dim() != c.kv_dim() {
                return Err(Error::InvalidArgument(format!(
                    "sequence {s}'s KV cache was made for another model"
                )));
            }
            let start = cache.len();
            if start + n > cache.capacity() {
                return Err(Error::InvalidArgument(format!(
                    "sequence {s}: {} positions do not fit its KV cache of {}",
                    start + n,
                    cache.capacity()
                )));
            }
            caches.push(cache);
        }
        Ok(caches)
    }

    fn forward_batch(
        &self,
        batch: &mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
        prof: &Profiler,
    ) -> Result<Vec<ForwardOutput>> {
        let trees: Vec<Option<TreeMask>> = batch.iter().map(|s| s.tree.cloned()).collect();
        let tokens: Vec<&[u32]> = batch.iter().map(|s| s.tokens).collect();
        let logits_for: Vec<LogitsFor> = batch.iter().map(|s| s.logits).collect();
        let mut caches = self.caches(batch, opts)?;
        let c = &self.config;
        let (h, q_dim, kv_dim, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let eps = c.rms_norm_eps as f32;
        let halves = c.rope_style == RopeStyle::Halves;

        let mut places = Vec::new();
        for (s, seq_tokens) in tokens.iter().enumerate() {
            let start = caches[s].len();
            for i in 0..seq_tokens.len() {
                let depth = trees[s].as_ref().map_or(i, |t| t.depth(i));
                places.push(RowPlace {
                    seq: s,
                    new_row: i,
                    slot: start + i,
                    position: start + depth,
                });
            }
        }
        let n = places.len();
        let mut x = vec![0f32; n * h];
        for (r, &t) in tokens.iter().flat_map(|t| t.iter()).enumerate() {
            self.embed
                .row_to_f32(t as usize, &mut x[r * h..(r + 1) * h]);
        }
        for (cache, seq_tokens) in caches.iter_mut().zip(&tokens) {
            cache.reserve(cache.len() + seq_tokens.len());
        }

        let mut normed = vec![0f32; n * h];
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * q_dim];
        let mut proj = vec![0f32; n * h];
        let mut gate = vec![0f32; n * c.intermediate_size];
        let mut up = vec![0f32; n * c.intermediate_size];
        let mut captured: Vec<(usize, Vec<f32>)> = Vec::new();
        // One set of rotary angles per row, shared by every head and layer.
        let half = (hd / 2).min(self.rope_inv_freqs.len());
        let mut angles = Vec::with_capacity(n * half);
        for p in &places {
            ops::rope_angles(p.position, &self.rope_inv_freqs[..half], &mut angles);
        }

        for (li, layer) in self.layers.iter().enumerate() {
            {
                let _span = prof.fine(FineKind::Attention, li);
                ops::rms_norm(&x, &layer.attn_norm, eps, &mut normed);
                Weight::matmul_many(
                    &[&layer.wq, &layer.wk, &layer.wv],
                    &normed,
                    n,
                    &mut [&mut q, &mut k, &mut v],
                );
                for (buf, bias, dim) in [
                    (&mut q, &layer.bq, q_dim),
                    (&mut k, &layer.bk, kv_dim),
                    (&mut v, &layer.bv, kv_dim),
                ] {
                    if let Some(b) = bias {
                        for row in buf.chunks_exact_mut(dim) {
                            for (o, &bb) in row.iter_mut().zip(b) {
                                *o += bb;
                            }
                        }
                    }
                }
                for (r, p) in places.iter().enumerate() {
                    let row_angles = &angles[r * half..(r + 1) * half];
                    for head in q[r * q_dim..(r + 1) * q_dim].chunks_exact_mut(hd) {
                        ops::rope_apply(head, row_angles, halves);
                    }
                    for head in k[r * kv_dim..(r + 1) * kv_dim].chunks_exact_mut(hd) {
                        ops::rope_apply(head, row_angles, halves);
                    }
                    caches[p.seq].write(
                        li,
                        p.slot,
                        &k[r * kv_dim..(r + 1) * kv_dim],
                        &v[r * kv_dim..(r + 1) * kv_dim],
                    );
                }
                let views: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
                self.attention(li, &views, &places, &trees, &q, &mut attn);
                layer.wo.matmul(&attn, n, &mut proj);
                for (xo, &p) in x.iter_mut().zip(&proj) {
                    *xo += p;
                }
            }
            {
                let _span = prof.fine(FineKind::Mlp, li);
                ops::rms_norm(&x, &layer.ffn_norm, eps, &mut normed);
                Weight::matmul_many(
                    &[&layer.w_gate, &layer.w_up],
                    &normed,
                    n,
                    &mut [&mut gate, &mut up],
                );
                // Element-wise, so split across the pool when there is enough of it (verify passes).
                parallel::for_each_chunk_mut(&mut gate, SWIGLU_CHUNK, |start, g| {
                    ops::swiglu_in_place(g, &up[start..start + g.len()])
                });
                layer.w_down.matmul(&gate, n, &mut proj);
                for (xo, &p) in x.iter_mut().zip(&proj) {
                    *xo += p;
                }
            }
            if opts.capture_layers.contains(&li) {
                captured.push((li, x.clone()));
            }
        }
        for (cache, seq_tokens) in caches.iter_mut().zip(&tokens) {
            let len = cache.len() + seq_tokens.len();
            cache.set_len(len);
        }
        // Keep captured layers in the order they were asked for.
        captured.sort_by_key(|(l, _)| opts.capture_layers.iter().position(|c| c == l));

        // The LM head over every wanted row of every sequence at once.
        let _span = prof.fine(FineKind::LmHead, c.num_layers);
        let mut first_row = Vec::with_capacity(tokens.len());
        let mut wanted: Vec<usize> = Vec::new();
        let mut row0 = 0;
        for (s, seq_tokens) in tokens.iter().enumerate() {
            let len = seq_tokens.len();
            first_row.push(wanted.len());
            match logits_for[s] {
                LogitsFor::All => wanted.extend(row0..row0 + len),
                LogitsFor::Last => wanted.push(row0 + len - 1),
                LogitsFor::None => {}
            }
            row0 += len;
        }
        let vocab = opts.vocab_limit.unwrap_or(c.vocab_size);
        let mut logits = vec![0f32; wanted.len() * vocab];
        if !wanted.is_empty() {
            let mut final_in = Vec::with_capacity(wanted.len() * h);
            for &r in &wanted {
                final_in.extend_from_slice(&x[r * h..(r + 1) * h]);
            }
            let mut final_normed = vec![0f32; wanted.len() * h];
            ops::rms_norm(&final_in, &self.final_norm, eps, &mut final_normed);
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            head.matmul_first_rows(vocab, &final_normed, wanted.len(), &mut logits);
        }

        let mut outputs = Vec::with_capacity(tokens.len());
        let mut row0 = 0;
        for (s, seq_tokens) in tokens.iter().enumerate() {
            let len = seq_tokens.len();
            let rows = match logits_for[s] {
                LogitsFor::All => len,
                LogitsFor::Last => 1,
                LogitsFor::None => 0,
            };
            let from = first_row[s];
            let hidden = captured
                .iter()
                .map(|(layer, all)| {
                    (
                        *layer,
                        Box::new(HostRows {
                            rows: len,
                            cols: h,
                            data: all[row0 * h..(row0 + len) * h].to_vec(),
                        }) as Box<dyn RowMatrix>,
                    )
                })
                .collect();
            outputs.push(ForwardOutput {
                logits: Box::new(HostRows {
                    rows,
                    cols: vocab,
                    data: logits[from * vocab..(from + rows) * vocab].to_vec(),
                }),
                hidden,
            });
            row0 += len;
        }
        Ok(outputs)
    }

    /// Attention of every row over its sequence's cache, GQA-aware: a row sees the cached context, and among
    /// its sequence's new rows the earlier ones (a chain) or its ancestors (a tree), always in slot order, so a
    /// row's result does not depend on how many rows the pass has.
    /// Value rows attention adds up at a time for all of a KV head's query heads (16 rows of 128 floats: 8 KB).
    const VALUE_BLOCK: usize = 16;

    fn attention(
        &self,
        layer: usize,
        caches: &[&KvCache],
        places: &[RowPlace],
        trees: &[Option<TreeMask>],
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.config;
        let (hd, heads, group) = (c.head_dim, c.num_heads, c.num_heads / c.num_kv_heads);
        let q_dim = c.q_dim();
        let scale = 1.0 / (hd as f32).sqrt();
        let out_ptr = OutPtr(out.as_mut_ptr());
        // A work item is one row's query heads that share a KV head (each key and value then read once for all of
        // them), or a single head where that would leave the pool's threads unevenly loaded (a decode step of a
        // model with 3 KV heads on 2 threads). Each head's arithmetic is the same either way (`ops::scores` is
        // `ops::dot` per query), so no bit depends on it.
        let kv_items = places.len() * c.num_kv_heads;
        let threads = parallel::threads();
        let per_item = if kv_items >= 4 * threads || kv_items.is_multiple_of(threads) {
            group
        } else {
            1
        };
        let items_per_row = heads / per_item;
        parallel::run_chunked(places.len() * items_per_row, |items| {
            let out_ptr = &out_ptr;
            let mut scores = Vec::new();
            let mut acc = vec![0f32; per_item * hd];
            let mut slots = Vec::new();
            for item in items {
                let (row, first_head) = (item / items_per_row, item % items_per_row * per_item);
                let p = &places[row];
                let base = p.slot - p.new_row;
                let (keys, values) = caches[p.seq].head(layer, first_head / group, p.slot + 1);
                let qs =
                    &q[row * q_dim + first_head * hd..row * q_dim + (first_head + per_item) * hd];
                // A chain sees every slot up to its own; a tree row the cached context and its ancestors, in the
                // same slot order.
                slots.clear();
                match trees[p.seq].as_ref() {
                    None => slots.extend(0..=p.slot),
                    Some(tree) => slots.extend(
                        (0..=p.slot)
                            .filter(|&slot| slot < base || tree.sees(p.new_row, slot - base)),
                    ),
                }
                let n = slots.len();
                // Scores head by head: head i's at i * n.
                scores.clear();
                scores.resize(per_item * n, 0.0);
                ops::scores(
                    qs,
                    hd,
                    n,
                    |j| &keys[slots[j] * hd..(slots[j] + 1) * hd],
                    scale,
                    &mut scores,
                    n,
                );
                for head_scores in scores.chunks_exact_mut(n) {
                    ops::softmax(head_scores);
                }
                // Values in blocks of slots (in cache for every head), each head's sum over a block held in
                // registers; every element still sums its slots in order.
                acc.fill(0.0);
                for block in (0..n).step_by(Self::VALUE_BLOCK) {
                    let end = (block + Self::VALUE_BLOCK).min(n);
                    for (i, head_acc) in acc.chunks_exact_mut(hd).enumerate() {
                        ops::axpy_rows(head_acc, &scores[i * n + block..i * n + end], |j| {
                            let s = slots[block + j];
                            &values[s * hd..(s + 1) * hd]
                        });
                    }
                }
                // SAFETY: each (row, head) slice of `out` is written by exactly one work item.
                unsafe {
                    let dst = out_ptr.0.add(row * q_dim + first_head * hd);
                    std::ptr::copy_nonoverlapping(acc.as_ptr(), dst, per_item * hd);
                }
            }
        });
    }

    /// The first matrix of every (storage type, shape), and the LM head, through the fast kernels and the
    /// reference kernel on the same activations (the tokens' embeddings where the shape allows, deterministic
    /// values with outliers elsewhere): both see the same quantized activations, so only float summation order
    /// may differ.
    fn check_kernels_on(&self, tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        let h = self.config.hidden_size;
        let m = tokens.len().clamp(1, 9);
        let mut embedded = vec![0f32; m * h];
        for (i, &t) in tokens.iter().take(m).enumerate() {
            if t as usize >= self.config.vocab_size {
                return Err(Error::InvalidArgument(format!(
                    "token id {t} is outside the vocabulary"
                )));
            }
            self.embed
                .row_to_f32(t as usize, &mut embedded[i * h..(i + 1) * h]);
        }
        let mut matrices: Vec<(String, &Weight)> = Vec::new();
        for (li, l) in self.layers.iter().enumerate() {
            for (name, w) in [
                ("attn_q", &l.wq),
                ("attn_k", &l.wk),
                ("attn_v", &l.wv),
                ("attn_output", &l.wo),
                ("ffn_gate", &l.w_gate),
                ("ffn_up", &l.w_up),
                ("ffn_down", &l.w_down),
            ] {
                let seen = matrices
                    .iter()
                    .any(|(_, o)| o.dtype() == w.dtype() && o.rows == w.rows && o.cols == w.cols);
                if !seen {
                    matrices.push((format!("blk.{li}.{name}"), w));
                }
            }
        }
        matrices.push((
            "lm_head".into(),
            self.lm_head.as_ref().unwrap_or(&self.embed),
        ));
        let mut checks = Vec::new();
        for (name, w) in matrices {
            let x: Vec<f32> = if w.cols == h {
                embedded.clone()
            } else {
                let mut v = crate::testing::pseudo_random(m * w.cols, w.rows as u64);
                for (i, e) in v.iter_mut().enumerate() {
                    if i % 97 == 0 {
                        *e *= 30.0;
                    }
                }
                v
            };
            let (mut fast, mut reference) = (vec![0f32; m * w.rows], vec![0f32; m * w.rows]);
            w.matmul_with(MatmulKernel::Fast, &x, m, &mut fast);
            w.matmul_with(MatmulKernel::Reference, &x, m, &mut reference);
            let scale = reference
                .iter()
                .fold(0f32, |a, v| a.max(v.abs()))
                .max(1e-30) as f64;
            let worst = fast
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs() as f64)
                .fold(0f64, f64::max);
            checks.push(KernelCheck {
                name,
                dtype: w.dtype().name(),
                max_relative_error: worst / scale,
                tolerance: 1e-4,
            });
        }
        Ok(checks)
    }
}

impl Model for CpuModel {
    fn embed_tokens(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.config.hidden_size;
        let mut out = vec![0f32; tokens.len() * h];
        for (row, &t) in out.chunks_exact_mut(h).zip(tokens) {
            if t as usize >= self.config.vocab_size {
                return Err(Error::InvalidArgument(format!(
                    "token {t} is outside the vocabulary of {}",
                    self.config.vocab_size
                )));
            }
            self.embed.row_to_f32(t as usize, row);
        }
        Ok(out)
    }

    fn config(&self) -> &Config {
        &self.config
    }

    fn device(&self) -> String {
        "cpu".into()
    }

    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>> {
        Ok(Box::new(KvCache::new(
            &self.config,
            capacity.min(self.config.context_length),
        )))
    }

    fn forward(
        &self,
        batch: &mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
        prof: &Profiler,
    ) -> Result<Vec<ForwardOutput>> {
        self.forward_batch(batch, opts, prof)
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes_read()
    }

    fn weight_types(&self) -> String {
        self.storage_types()
    }

    fn check_kernels(&self, tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        self.check_kernels_on(tokens)
    }
}

/// Elements of SwiGLU per parallel work item: one item (no pool wake-up) for a single token's 8960.
const SWIGLU_CHUNK: usize = 12 * 1024;

struct OutPtr(*mut f32);
// SAFETY: used only for disjoint writes from pool workers within one call.
unsafe impl Sync for OutPtr {}
unsafe impl Send for OutPtr {}
