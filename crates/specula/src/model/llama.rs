//! The Llama-family transformer (Llama 2/3, Qwen2/2.5, SmolLM2): RMSNorm, GQA attention with RoPE (optional QKV
//! bias), SwiGLU MLP, tied or separate LM head.
//!
//! The forward pass returns logits for every input position (or only the last), appends to a truncatable KV
//! cache, and can capture the hidden states of chosen layers: the pieces speculative decoding is built from.

use crate::error::{Error, Result};
use crate::model::config::{Config, RopeStyle};
use crate::model::kv_cache::KvCache;
use crate::model::ops;
use crate::model::weights::Weight;
use crate::parallel;
use crate::profile::{FineKind, Profiler};

/// Where the loader finds tensors; names are the checkpoint's own.
pub trait WeightSource {
    fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<Weight>;
    fn has(&self, name: &str) -> bool;
}

/// Tensor names of one checkpoint format.
pub struct TensorNames {
    pub embed: &'static str,
    pub final_norm: &'static str,
    pub lm_head: &'static str,
    pub rope_freqs: Option<&'static str>,
    pub layer: fn(usize, LayerTensor) -> String,
}

#[derive(Debug, Clone, Copy)]
pub enum LayerTensor {
    AttnNorm,
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    O,
    FfnNorm,
    Gate,
    Up,
    Down,
}

pub const GGUF_NAMES: TensorNames = TensorNames {
    embed: "token_embd.weight",
    final_norm: "output_norm.weight",
    lm_head: "output.weight",
    rope_freqs: Some("rope_freqs.weight"),
    layer: |i, t| {
        let suffix = match t {
            LayerTensor::AttnNorm => "attn_norm.weight",
            LayerTensor::Q => "attn_q.weight",
            LayerTensor::K => "attn_k.weight",
            LayerTensor::V => "attn_v.weight",
            LayerTensor::QBias => "attn_q.bias",
            LayerTensor::KBias => "attn_k.bias",
            LayerTensor::VBias => "attn_v.bias",
            LayerTensor::O => "attn_output.weight",
            LayerTensor::FfnNorm => "ffn_norm.weight",
            LayerTensor::Gate => "ffn_gate.weight",
            LayerTensor::Up => "ffn_up.weight",
            LayerTensor::Down => "ffn_down.weight",
        };
        format!("blk.{i}.{suffix}")
    },
};

pub const HF_NAMES: TensorNames = TensorNames {
    embed: "model.embed_tokens.weight",
    final_norm: "model.norm.weight",
    lm_head: "lm_head.weight",
    rope_freqs: None,
    layer: |i, t| {
        let suffix = match t {
            LayerTensor::AttnNorm => "input_layernorm.weight",
            LayerTensor::Q => "self_attn.q_proj.weight",
            LayerTensor::K => "self_attn.k_proj.weight",
            LayerTensor::V => "self_attn.v_proj.weight",
            LayerTensor::QBias => "self_attn.q_proj.bias",
            LayerTensor::KBias => "self_attn.k_proj.bias",
            LayerTensor::VBias => "self_attn.v_proj.bias",
            LayerTensor::O => "self_attn.o_proj.weight",
            LayerTensor::FfnNorm => "post_attention_layernorm.weight",
            LayerTensor::Gate => "mlp.gate_proj.weight",
            LayerTensor::Up => "mlp.up_proj.weight",
            LayerTensor::Down => "mlp.down_proj.weight",
        };
        format!("model.layers.{i}.{suffix}")
    },
};

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

pub struct LlamaModel {
    pub config: Config,
    embed: Weight,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// None when the LM head is tied to the embedding.
    lm_head: Option<Weight>,
    rope_inv_freqs: Vec<f32>,
}

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every input position (verification of drafts).
    All,
    /// Only the last position (prefill, plain decoding).
    Last,
    /// None (warming a cache).
    None,
}

#[derive(Debug, Clone)]
pub struct ForwardOptions<'a> {
    pub logits: LogitsFor,
    /// Layers whose output hidden states (residual stream after the block) to return, 0-based.
    pub capture_layers: &'a [usize],
    /// Compute logits only for token ids `0..limit` (the first rows of the LM head), e.g. a draft model's reduced
    /// vocabulary; `ForwardOutput::vocab` is then `limit`. None: the whole vocabulary.
    pub vocab_limit: Option<usize>,
}

impl Default for ForwardOptions<'_> {
    fn default() -> Self {
        ForwardOptions {
            logits: LogitsFor::All,
            capture_layers: &[],
            vocab_limit: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// `rows x vocab`, row-major; rows is 1 for `LogitsFor::Last`, the input length for `All`.
    pub logits: Vec<f32>,
    pub rows: usize,
    pub vocab: usize,
    /// `(layer, rows x hidden)` for each requested layer, in request order.
    pub hidden: Vec<(usize, Vec<f32>)>,
}

impl ForwardOutput {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }
    pub fn last(&self) -> &[f32] {
        self.row(self.rows - 1)
    }
}

fn vector(src: &dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>> {
    Ok(src.weight(name, 1, len)?.to_f32())
}

impl LlamaModel {
    pub fn load(config: Config, src: &dyn WeightSource, names: &TensorNames) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let (h, q_dim, kv_dim) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let embed = src.weight(names.embed, c.vocab_size, h)?;
        // Some tied checkpoints also store the head explicitly; use it when present.
        let lm_head = if src.has(names.lm_head) {
            Some(src.weight(names.lm_head, c.vocab_size, h)?)
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
                wq: src.weight(&n(LayerTensor::Q), q_dim, h)?,
                wk: src.weight(&n(LayerTensor::K), kv_dim, h)?,
                wv: src.weight(&n(LayerTensor::V), kv_dim, h)?,
                bq: bias(LayerTensor::QBias, q_dim)?,
                bk: bias(LayerTensor::KBias, kv_dim)?,
                bv: bias(LayerTensor::VBias, kv_dim)?,
                wo: src.weight(&n(LayerTensor::O), h, q_dim)?,
                ffn_norm: vector(src, &n(LayerTensor::FfnNorm), h)?,
                w_gate: src.weight(&n(LayerTensor::Gate), c.intermediate_size, h)?,
                w_up: src.weight(&n(LayerTensor::Up), c.intermediate_size, h)?,
                w_down: src.weight(&n(LayerTensor::Down), h, c.intermediate_size)?,
            });
        }
        let freq_factors = match names.rope_freqs {
            Some(name) if src.has(name) => Some(vector(src, name, c.head_dim / 2)?),
            _ => None,
        };
        let rope_inv_freqs = c.rope_inv_freqs(freq_factors.as_deref());
        Ok(LlamaModel {
            final_norm: vector(src, names.final_norm, h)?,
            embed,
            layers,
            lm_head,
            rope_inv_freqs,
            config,
        })
    }

    /// Bytes of weights read by one decode step (what bounds decode speed on a memory-bound machine).
    pub fn weight_bytes(&self) -> usize {
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

    /// A short description of the storage types, e.g. "Q4_K x 169, Q6_K x 29".
    pub fn weight_types(&self) -> String {
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

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.config)
    }

    /// Runs `tokens` at positions `cache.len()..`, appending them to the cache.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        opts: &ForwardOptions<'_>,
        prof: &Profiler,
    ) -> Result<ForwardOutput> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(Error::InvalidArgument(
                "forward pass over zero tokens".into(),
            ));
        }
        let start = cache.len();
        if start + n > c.context_length {
            return Err(Error::ContextOverflow {
                prompt_tokens: start + n,
                max_new_tokens: 0,
                context_length: c.context_length,
            });
        }
        if let Some(limit) = opts.vocab_limit {
            if limit == 0 || limit > c.vocab_size {
                return Err(Error::InvalidArgument(format!(
                    "vocabulary limit {limit} is outside 1..={} (the model's vocabulary)",
                    c.vocab_size
                )));
            }
        }
        for &layer in opts.capture_layers {
            if layer >= c.num_layers {
                return Err(Error::InvalidArgument(format!(
                    "cannot capture hidden states of layer {layer}: the model has {} layers (0..{})",
                    c.num_layers,
                    c.num_layers - 1
                )));
            }
        }
        let (h, q_dim, kv_dim, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let eps = c.rms_norm_eps as f32;
        let halves = c.rope_style == RopeStyle::Halves;

        let mut x = vec![0f32; n * h];
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= c.vocab_size {
                return Err(Error::InvalidArgument(format!(
                    "token id {t} is outside the vocabulary (size {})",
                    c.vocab_size
                )));
            }
            self.embed
                .row_to_f32(t as usize, &mut x[i * h..(i + 1) * h]);
        }
        cache.reserve(start + n);

        let mut normed = vec![0f32; n * h];
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * q_dim];
        let mut proj = vec![0f32; n * h];
        let mut gate = vec![0f32; n * c.intermediate_size];
        let mut up = vec![0f32; n * c.intermediate_size];
        let mut hidden = Vec::new();
        // One set of rotary angles per position, shared by every head and layer.
        let half = (hd / 2).min(self.rope_inv_freqs.len());
        let mut angles = Vec::with_capacity(n * half);
        for i in 0..n {
            ops::rope_angles(start + i, &self.rope_inv_freqs[..half], &mut angles);
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
                for i in 0..n {
                    let pos = start + i;
                    let row_angles = &angles[i * half..(i + 1) * half];
                    for head in q[i * q_dim..(i + 1) * q_dim].chunks_exact_mut(hd) {
                        ops::rope_apply(head, row_angles, halves);
                    }
                    for head in k[i * kv_dim..(i + 1) * kv_dim].chunks_exact_mut(hd) {
                        ops::rope_apply(head, row_angles, halves);
                    }
                    cache.write(
                        li,
                        pos,
                        &k[i * kv_dim..(i + 1) * kv_dim],
                        &v[i * kv_dim..(i + 1) * kv_dim],
                    );
                }
                self.attention(li, cache, start, n, &q, &mut attn);
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
                hidden.push((li, x.clone()));
            }
        }
        cache.set_len(start + n);
        // Keep captured layers in the order they were asked for.
        hidden.sort_by_key(|(l, _)| opts.capture_layers.iter().position(|c| c == l));

        let _span = prof.fine(FineKind::LmHead, c.num_layers);
        let rows_wanted = match opts.logits {
            LogitsFor::All => 0..n,
            LogitsFor::Last => n - 1..n,
            LogitsFor::None => n..n,
        };
        let rows = rows_wanted.len();
        let vocab = opts.vocab_limit.unwrap_or(c.vocab_size);
        let mut logits = vec![0f32; rows * vocab];
        if rows > 0 {
            let mut final_normed = vec![0f32; rows * h];
            ops::rms_norm(
                &x[rows_wanted.start * h..rows_wanted.end * h],
                &self.final_norm,
                eps,
                &mut final_normed,
            );
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            head.matmul_first_rows(vocab, &final_normed, rows, &mut logits);
        }
        Ok(ForwardOutput {
            logits,
            rows,
            vocab,
            hidden,
        })
    }

    /// Causal attention of `n` new query rows (positions `start..start+n`) over the cache, GQA-aware.
    fn attention(
        &self,
        layer: usize,
        cache: &KvCache,
        start: usize,
        n: usize,
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.config;
        let (hd, heads, group) = (c.head_dim, c.num_heads, c.num_heads / c.num_kv_heads);
        let q_dim = c.q_dim();
        let scale = 1.0 / (hd as f32).sqrt();
        let out_ptr = OutPtr(out.as_mut_ptr());
        parallel::run_chunked(n * heads, |items| {
            let out_ptr = &out_ptr;
            let mut scores = Vec::new();
            let mut acc = vec![0f32; hd];
            for item in items {
                let (row, head) = (item / heads, item % heads);
                let kv_len = start + row + 1;
                let (keys, values) = cache.head(layer, head / group, kv_len);
                let qh = &q[row * q_dim + head * hd..row * q_dim + (head + 1) * hd];
                scores.clear();
                scores.extend(keys.chunks_exact(hd).map(|key| ops::dot(qh, key) * scale));
                ops::softmax(&mut scores);
                acc.fill(0.0);
                for (&p, value) in scores.iter().zip(values.chunks_exact(hd)) {
                    ops::axpy(&mut acc, p, value);
                }
                // SAFETY: each (row, head) slice of `out` is written by exactly one work item.
                unsafe {
                    let dst = out_ptr.0.add(row * q_dim + head * hd);
                    std::ptr::copy_nonoverlapping(acc.as_ptr(), dst, hd);
                }
            }
        });
    }
}

/// One weight matrix's fast matmul against the reference kernel ([`LlamaModel::check_kernels_against_reference`]).
#[derive(Debug, Clone)]
pub struct KernelCheck {
    pub name: String,
    pub dtype: &'static str,
    /// max |fast - reference| / max |reference| over the outputs.
    pub max_relative_error: f64,
    pub tolerance: f64,
}

impl LlamaModel {
    /// Runs the first matrix of every (storage type, shape) in the model, and the LM head, through the fast
    /// kernels and the reference kernel on the same activations (the tokens' embeddings where the shape
    /// allows, deterministic values with outliers elsewhere): both see the same quantized activations, so only
    /// float summation order may differ.
    pub fn check_kernels_against_reference(&self, tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        use crate::model::weights::MatmulKernel;
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

/// Elements of SwiGLU per parallel work item: one item (no pool wake-up) for a single token's 8960.
const SWIGLU_CHUNK: usize = 12 * 1024;

struct OutPtr(*mut f32);
// SAFETY: used only for disjoint writes from pool workers within one call.
unsafe impl Sync for OutPtr {}
unsafe impl Send for OutPtr {}
