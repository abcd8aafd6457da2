//! The Llama-family forward pass on the GPU: the same computation as the CPU backend (backend/cpu/model.rs),
//! one kernel launch per step of it, for a batch of sequences with optional tree masks.

use std::borrow::Cow;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::{cuda_err, CudaKvCache, Gpu};
use crate::error::{Error, Result};
use crate::model::config::{Config, RopeStyle};
use crate::model::dtype::GgmlType;
use crate::model::forward::{
    check_batch, ForwardOptions, ForwardOutput, KernelCheck, LogitsFor, Model, RowMatrix,
    SequenceCache, SequenceInput,
};
use crate::model::tensors::{LayerTensor, RawTensor, TensorNames, WeightSource};
use crate::profile::Profiler;

/// A bf16 matrix on the device: `rows` outputs of `cols` inputs.
struct Matrix {
    data: CudaSlice<u16>,
    rows: usize,
    cols: usize,
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    bq: Option<CudaSlice<f32>>,
    bk: Option<CudaSlice<f32>>,
    bv: Option<CudaSlice<f32>>,
    wo: Matrix,
    ffn_norm: CudaSlice<f32>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
}

pub struct CudaModel {
    pub config: Config,
    gpu: Arc<Gpu>,
    embed: Matrix,
    layers: Vec<Layer>,
    final_norm: CudaSlice<f32>,
    /// None when the LM head is tied to the embedding.
    lm_head: Option<Matrix>,
    rope_inv_freqs: CudaSlice<f32>,
    /// The checkpoint's storage types, e.g. "Q4_K x 169 (as bf16)".
    source_types: String,
}

/// The device address of a buffer (event tracking is off: nothing to synchronize).
fn ptr<T>(s: &CudaSlice<T>, gpu: &Gpu) -> u64 {
    let (p, _sync) = s.device_ptr(&gpu.stream);
    p
}

/// Launches kernel `$kernel` with `$grid` blocks of `$block` threads; every argument is a value (device pointers
/// as u64), kept alive until the launch is queued.
macro_rules! launch {
    ($gpu:expr, $kernel:ident, $grid:expr, $block:expr, $($arg:expr),* $(,)?) => {{
        let gpu: &Gpu = &$gpu;
        let mut builder = gpu.stream.launch_builder(&gpu.kernels.$kernel);
        $( let value = $arg; builder.arg(&value); )*
        let grid: (u32, u32, u32) = $grid;
        // SAFETY: the arguments match the kernel's signature in kernels.cu, and every pointer is a live
        // allocation of the size the kernel indexes (checked by the callers' shapes).
        unsafe {
            builder.launch(LaunchConfig {
                grid_dim: grid,
                block_dim: ($block, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(|e| cuda_err(stringify!($kernel), e))?;
    }};
}

/// A tensor's values as bf16 (the GGUF quant types are dequantized on the host first).
fn to_bf16(t: &RawTensor<'_>) -> Result<Vec<u16>> {
    use half::{bf16, f16};
    Ok(match t.dtype {
        GgmlType::BF16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect(),
        GgmlType::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|b| bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_bits())
            .collect(),
        GgmlType::F16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| bf16::from_f32(f16::from_le_bytes([b[0], b[1]]).to_f32()).to_bits())
            .collect(),
        _ => crate::backend::cpu::weights::Weight::from_raw(t.dtype, t.bytes, t.rows, t.cols)
            .map_err(|reason| Error::BadTensor {
                path: t.file.to_path_buf(),
                tensor: format!("{:?}", t.dtype),
                reason,
            })?
            .to_f32()
            .into_iter()
            .map(|v| bf16::from_f32(v).to_bits())
            .collect(),
    })
}

/// Vectors (norms, biases) as f32: exact for F32 checkpoints.
fn to_f32(t: &RawTensor<'_>) -> Result<Vec<f32>> {
    Ok(match t.dtype {
        GgmlType::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        _ => crate::backend::cpu::weights::Weight::from_raw(t.dtype, t.bytes, t.rows, t.cols)
            .map_err(|reason| Error::BadTensor {
                path: t.file.to_path_buf(),
                tensor: format!("a {} vector", t.dtype.name()),
                reason,
            })?
            .to_f32(),
    })
}

/// What the kernels assume of a shape: head dimension up to 256 (attention keeps 8 values a lane), and rows of a
/// multiple of 8 values (16-byte weight loads).
fn check_shape(c: &Config) -> Result<()> {
    if c.head_dim > 256 {
        return Err(Error::Cuda(format!(
            "head dimension {} is above the 256 the GPU attention kernel supports",
            c.head_dim
        )));
    }
    for (what, n) in [
        ("hidden size", c.hidden_size),
        ("attention width", c.q_dim()),
        ("intermediate size", c.intermediate_size),
    ] {
        if !n.is_multiple_of(8) {
            return Err(Error::Cuda(format!(
                "{what} {n} is not a multiple of 8, which the GPU matmul kernel needs"
            )));
        }
    }
    Ok(())
}

impl CudaModel {
    /// Loads the weights named by `names` from `src` onto the GPU.
    pub fn load(
        gpu: Arc<Gpu>,
        config: Config,
        src: &dyn WeightSource,
        names: &TensorNames,
    ) -> Result<Self> {
        config.validate()?;
        check_shape(&config)?;
        let c = config.clone();
        let (h, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        // Weights become bf16 here: check they fit before uploading anything.
        let matrix_elems = c.vocab_size * h * if c.tie_word_embeddings { 1 } else { 2 }
            + c.num_layers * (q_dim * h * 2 + kv_dim * h * 2 + ff * h * 3);
        let (free, _) = gpu.memory()?;
        if matrix_elems * 2 > free {
            return Err(Error::Cuda(format!(
                "the model needs {:.2} GB of GPU memory for its weights as bf16, but {} has {:.2} GB free",
                matrix_elems as f64 * 2e-9,
                gpu.name,
                free as f64 * 1e-9
            )));
        }
        let mut types: Vec<(GgmlType, usize)> = Vec::new();
        let mut matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix> {
            let t = src.tensor(name, rows, cols)?;
            match types.iter_mut().find(|(ty, _)| *ty == t.dtype) {
                Some(e) => e.1 += 1,
                None => types.push((t.dtype, 1)),
            }
            if !cols.is_multiple_of(8) {
                return Err(Error::Cuda(format!(
                    "tensor {name}: rows of {cols} values; the GPU kernels need a multiple of 8"
                )));
            }
            let data = gpu
                .stream
                .clone_htod(&to_bf16(&t)?)
                .map_err(|e| cuda_err(&format!("uploading {name}"), e))?;
            Ok(Matrix { data, rows, cols })
        };
        let vector = |name: &str, len: usize| -> Result<CudaSlice<f32>> {
            let t = src.tensor(name, 1, len)?;
            gpu.stream
                .clone_htod(&to_f32(&t)?)
                .map_err(|e| cuda_err(&format!("uploading {name}"), e))
        };
        let embed = matrix(names.embed, c.vocab_size, h)?;
        let lm_head = if src.has(names.lm_head) {
            Some(matrix(names.lm_head, c.vocab_size, h)?)
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
            let bias = |t, len| -> Result<Option<CudaSlice<f32>>> {
                let name = n(t);
                if src.has(&name) {
                    Ok(Some(vector(&name, len)?))
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: vector(&n(LayerTensor::AttnNorm), h)?,
                wq: matrix(&n(LayerTensor::Q), q_dim, h)?,
                wk: matrix(&n(LayerTensor::K), kv_dim, h)?,
                wv: matrix(&n(LayerTensor::V), kv_dim, h)?,
                bq: bias(LayerTensor::QBias, q_dim)?,
                bk: bias(LayerTensor::KBias, kv_dim)?,
                bv: bias(LayerTensor::VBias, kv_dim)?,
                wo: matrix(&n(LayerTensor::O), h, q_dim)?,
                ffn_norm: vector(&n(LayerTensor::FfnNorm), h)?,
                w_gate: matrix(&n(LayerTensor::Gate), ff, h)?,
                w_up: matrix(&n(LayerTensor::Up), ff, h)?,
                w_down: matrix(&n(LayerTensor::Down), h, ff)?,
            });
        }
        let freq_factors = match names.rope_freqs {
            Some(name) if src.has(name) => Some(to_f32(&src.tensor(name, 1, c.head_dim / 2)?)?),
            _ => None,
        };
        let inv = c.rope_inv_freqs(freq_factors.as_deref());
        let rope_inv_freqs = gpu
            .stream
            .clone_htod(&inv)
            .map_err(|e| cuda_err("uploading RoPE frequencies", e))?;
        let final_norm = vector(names.final_norm, h)?;
        let source_types = types
            .iter()
            .map(|(t, n)| format!("{} x {n}", t.name()))
            .collect::<Vec<_>>()
            .join(", ");
        Ok(CudaModel {
            config,
            gpu,
            embed,
            layers,
            final_norm,
            lm_head,
            rope_inv_freqs,
            source_types: format!("{source_types}, as bf16"),
        })
    }

    /// A model of `config`'s shape with seeded random bf16 weights made on the device (speed work on real
    /// shapes whose weights cannot reach the machine): matrices uniform in +-1/sqrt(inputs), norms 1, no biases.
    pub fn random(gpu: Arc<Gpu>, config: Config, seed: u64) -> Result<Self> {
        config.validate()?;
        check_shape(&config)?;
        let c = config.clone();
        let (h, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let matrix_elems = c.vocab_size * h * if c.tie_word_embeddings { 1 } else { 2 }
            + c.num_layers * (q_dim * h * 2 + kv_dim * h * 2 + ff * h * 3);
        let (free, _) = gpu.memory()?;
        if matrix_elems * 2 > free {
            return Err(Error::Cuda(format!(
                "random weights of this shape need {:.2} GB of GPU memory, but {} has {:.2} GB free",
                matrix_elems as f64 * 2e-9,
                gpu.name,
                free as f64 * 1e-9
            )));
        }
        let mut next_seed = seed;
        let mut matrix = |rows: usize, cols: usize| -> Result<Matrix> {
            let n = rows * cols;
            // SAFETY: filled by the kernel below before any read.
            let data = unsafe { gpu.stream.alloc::<u16>(n) }
                .map_err(|e| cuda_err("allocating weights", e))?;
            next_seed = next_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let scale = 1.0f32 / (cols as f32).sqrt();
            let blocks = n.div_ceil(256).min(65_535 * 8) as u32;
            launch!(
                gpu,
                fill_random_bf16,
                (blocks, 1, 1),
                256,
                ptr(&data, &gpu),
                n,
                next_seed,
                scale
            );
            Ok(Matrix { data, rows, cols })
        };
        let ones = |n: usize| -> Result<CudaSlice<f32>> {
            gpu.stream
                .clone_htod(&vec![1f32; n])
                .map_err(|e| cuda_err("uploading norms", e))
        };
        let embed = matrix(c.vocab_size, h)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(matrix(c.vocab_size, h)?)
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            layers.push(Layer {
                attn_norm: ones(h)?,
                wq: matrix(q_dim, h)?,
                wk: matrix(kv_dim, h)?,
                wv: matrix(kv_dim, h)?,
                bq: None,
                bk: None,
                bv: None,
                wo: matrix(h, q_dim)?,
                ffn_norm: ones(h)?,
                w_gate: matrix(ff, h)?,
                w_up: matrix(ff, h)?,
                w_down: matrix(h, ff)?,
            });
        }
        let rope_inv_freqs = gpu
            .stream
            .clone_htod(&c.rope_inv_freqs(None))
            .map_err(|e| cuda_err("uploading RoPE frequencies", e))?;
        let final_norm = ones(h)?;
        gpu.stream
            .synchronize()
            .map_err(|e| cuda_err("making random weights", e))?;
        Ok(CudaModel {
            config,
            gpu,
            embed,
            layers,
            final_norm,
            lm_head,
            rope_inv_freqs,
            source_types: format!("random bf16 (seed {seed})"),
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// `y[m x w.rows] (+)= x[m x w.cols] . w^T` for the first `n` rows of `w`.
    fn gemv(&self, w: &Matrix, n: usize, x: u64, y: u64, m: usize, accumulate: bool) -> Result<()> {
        let grid = (n.div_ceil(4) as u32, m.div_ceil(8) as u32, 1);
        launch!(
            self.gpu,
            gemv_bf16,
            grid,
            128,
            ptr(&w.data, &self.gpu),
            x,
            y,
            n as i32,
            w.cols as i32,
            m as i32,
            accumulate as i32
        );
        Ok(())
    }

    fn alloc(&self, n: usize, what: &str) -> Result<CudaSlice<f32>> {
        // SAFETY: every buffer is fully written by a kernel before it is read.
        unsafe { self.gpu.stream.alloc::<f32>(n.max(1)) }
            .map_err(|e| cuda_err(&format!("allocating {what}"), e))
    }

    fn forward_batch(
        &self,
        batch: &mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<Vec<ForwardOutput>> {
        check_batch(&self.config, batch, opts)?;
        let c = &self.config;
        let gpu = &self.gpu;
        let (h, q_dim, kv_dim, hd, ff) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim,
            c.intermediate_size,
        );
        let (heads, kv_heads) = (c.num_heads, c.num_kv_heads);

        // The step's tables: tokens, positions and row infos (kernels.cu RowInfo: 6 u32 words), and one
        // SeqCache per sequence (4 words).
        let (mut tokens, mut positions, mut row_words, mut seq_words) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut lens = Vec::with_capacity(batch.len());
        for (s, seq) in batch.iter_mut().enumerate() {
            let n = seq.tokens.len();
            let cache = seq
                .cache
                .as_any_mut()
                .downcast_mut::<CudaKvCache>()
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "sequence {s}'s KV cache does not belong to the GPU"
                    ))
                })?;
            if !Arc::ptr_eq(&cache.gpu, gpu)
                || cache.num_layers != c.num_layers
                || cache.kv_heads != kv_heads
            {
                return Err(Error::InvalidArgument(format!(
                    "sequence {s}'s KV cache was made for another model or GPU"
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
            if seq.tree.is_some() && n > 64 {
                return Err(Error::InvalidArgument(format!(
                    "sequence {s}: a tree of {n} rows; the GPU attention takes trees of up to 64"
                )));
            }
            for (i, &t) in seq.tokens.iter().enumerate() {
                tokens.push(t);
                let (position, mask) = match seq.tree {
                    Some(tree) => {
                        let mask = (0..n)
                            .filter(|&j| tree.sees(i, j))
                            .fold(0u64, |m, j| m | (1 << j));
                        (start + tree.depth(i), mask)
                    }
                    None => (start + i, u64::MAX),
                };
                positions.push(position as u32);
                row_words.extend_from_slice(&[
                    s as u32,
                    (start + i) as u32,
                    start as u32,
                    seq.tree.is_some() as u32,
                    mask as u32,
                    (mask >> 32) as u32,
                ]);
            }
            let base = cache.device_ptr();
            seq_words.extend_from_slice(&[
                base as u32,
                (base >> 32) as u32,
                cache.capacity() as u32,
                0,
            ]);
            lens.push(start + n);
        }
        let rows = tokens.len();
        let up = |v: &[u32], what: &str| {
            gpu.stream
                .clone_htod(v)
                .map_err(|e| cuda_err(&format!("uploading {what}"), e))
        };
        let (d_tokens, d_positions, d_rows, d_seqs) = (
            up(&tokens, "tokens")?,
            up(&positions, "positions")?,
            up(&row_words, "row table")?,
            up(&seq_words, "cache table")?,
        );
        let x = self.alloc(rows * h, "activations")?;
        let normed = self.alloc(rows * h, "activations")?;
        let q = self.alloc(rows * q_dim, "queries")?;
        let k = self.alloc(rows * kv_dim, "keys")?;
        let v = self.alloc(rows * kv_dim, "values")?;
        let attn = self.alloc(rows * q_dim, "attention output")?;
        let gate = self.alloc(rows * ff, "MLP activations")?;
        let upb = self.alloc(rows * ff, "MLP activations")?;
        let half = hd / 2;
        let angles = self.alloc(rows * half * 2, "rotary angles")?;
        let p = |s: &CudaSlice<f32>| ptr(s, gpu);
        let (px, pn, pq, pk, pv, pa, pg, pu) = (
            p(&x),
            p(&normed),
            p(&q),
            p(&k),
            p(&v),
            p(&attn),
            p(&gate),
            p(&upb),
        );
        let (p_rows, p_seqs) = (ptr(&d_rows, gpu), ptr(&d_seqs, gpu));
        let eps = c.rms_norm_eps as f32;
        let r32 = rows as u32;

        launch!(
            gpu,
            embed_rows,
            (r32, 1, 1),
            256,
            ptr(&self.embed.data, gpu),
            ptr(&d_tokens, gpu),
            px,
            h as i32
        );
        launch!(
            gpu,
            rope_angles,
            (r32, 1, 1),
            64,
            ptr(&d_positions, gpu),
            ptr(&self.rope_inv_freqs, gpu),
            p(&angles),
            half as i32
        );
        let halves = (c.rope_style == RopeStyle::Halves) as i32;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut captured: Vec<(usize, CudaSlice<f32>)> = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            launch!(
                gpu,
                rms_norm,
                (r32, 1, 1),
                256,
                px,
                p(&layer.attn_norm),
                pn,
                h as i32,
                eps
            );
            self.gemv(&layer.wq, q_dim, pn, pq, rows, false)?;
            self.gemv(&layer.wk, kv_dim, pn, pk, rows, false)?;
            self.gemv(&layer.wv, kv_dim, pn, pv, rows, false)?;
            for (buf, bias, dim) in [
                (pq, &layer.bq, q_dim),
                (pk, &layer.bk, kv_dim),
                (pv, &layer.bv, kv_dim),
            ] {
                if let Some(b) = bias {
                    launch!(gpu, add_bias, (r32, 1, 1), 256, buf, p(b), dim as i32);
                }
            }
            launch!(
                gpu,
                rope_apply,
                (r32, heads as u32, 1),
                64,
                pq,
                p(&angles),
                heads as i32,
                hd as i32,
                halves
            );
            launch!(
                gpu,
                rope_apply,
                (r32, kv_heads as u32, 1),
                64,
                pk,
                p(&angles),
                kv_heads as i32,
                hd as i32,
                halves
            );
            launch!(
                gpu,
                kv_write,
                (r32, 1, 1),
                128,
                pk,
                pv,
                p_rows,
                p_seqs,
                li as i32,
                kv_heads as i32,
                hd as i32
            );
            launch!(
                gpu,
                attention,
                (r32, heads as u32, 1),
                128,
                pq,
                pa,
                p_rows,
                p_seqs,
                li as i32,
                heads as i32,
                kv_heads as i32,
                hd as i32,
                scale
            );
            // x += attn . wo^T, accumulated in place.
            self.gemv(&layer.wo, h, pa, px, rows, true)?;
            launch!(
                gpu,
                rms_norm,
                (r32, 1, 1),
                256,
                px,
                p(&layer.ffn_norm),
                pn,
                h as i32,
                eps
            );
            self.gemv(&layer.w_gate, ff, pn, pg, rows, false)?;
            self.gemv(&layer.w_up, ff, pn, pu, rows, false)?;
            let total = rows * ff;
            let blocks = total.div_ceil(256).min(65535) as u32;
            launch!(gpu, silu_mul, (blocks, 1, 1), 256, pg, pu, total);
            self.gemv(&layer.w_down, h, pg, px, rows, true)?;
            if opts.capture_layers.contains(&li) {
                let copy = gpu
                    .stream
                    .clone_dtod(&x)
                    .map_err(|e| cuda_err("capturing hidden states", e))?;
                captured.push((li, copy));
            }
        }
        captured.sort_by_key(|(l, _)| opts.capture_layers.iter().position(|c| c == l));
        for (seq, len) in batch.iter_mut().zip(&lens) {
            if let Some(cache) = seq.cache.as_any_mut().downcast_mut::<CudaKvCache>() {
                cache.len = *len;
            }
        }

        // The LM head over every wanted row of every sequence at once.
        let mut wanted: Vec<u32> = Vec::new();
        let mut first_row = Vec::with_capacity(batch.len());
        let mut row0 = 0usize;
        for seq in batch.iter() {
            let n = seq.tokens.len();
            first_row.push(wanted.len());
            match seq.logits {
                LogitsFor::All => wanted.extend((row0..row0 + n).map(|r| r as u32)),
                LogitsFor::Last => wanted.push((row0 + n - 1) as u32),
                LogitsFor::None => {}
            }
            row0 += n;
        }
        let vocab = opts.vocab_limit.unwrap_or(c.vocab_size);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let logits = if wanted.is_empty() {
            None
        } else {
            let nw = wanted.len();
            let d_wanted = up(&wanted, "wanted rows")?;
            let picked = self.alloc(nw * h, "final rows")?;
            let picked_normed = self.alloc(nw * h, "final rows")?;
            launch!(
                gpu,
                gather_rows,
                (nw as u32, 1, 1),
                256,
                px,
                ptr(&d_wanted, gpu),
                p(&picked),
                h as i32
            );
            launch!(
                gpu,
                rms_norm,
                (nw as u32, 1, 1),
                256,
                p(&picked),
                p(&self.final_norm),
                p(&picked_normed),
                h as i32,
                eps
            );
            let out = self.alloc(nw * vocab, "logits")?;
            self.gemv(head, vocab, p(&picked_normed), p(&out), nw, false)?;
            Some(out)
        };

        let mut outputs = Vec::with_capacity(batch.len());
        let mut row0 = 0usize;
        for (s, seq) in batch.iter().enumerate() {
            let n = seq.tokens.len();
            let rows_wanted = match seq.logits {
                LogitsFor::All => n,
                LogitsFor::Last => 1,
                LogitsFor::None => 0,
            };
            let logits_rows = self.slice_rows(logits.as_ref(), first_row[s], rows_wanted, vocab)?;
            let mut hidden = Vec::new();
            for (layer, all) in &captured {
                hidden.push((
                    *layer,
                    Box::new(self.slice_rows(Some(all), row0, n, h)?) as Box<dyn RowMatrix>,
                ));
            }
            outputs.push(ForwardOutput {
                logits: Box::new(logits_rows),
                hidden,
            });
            row0 += n;
        }
        Ok(outputs)
    }

    /// Rows `from..from + rows` of a `? x cols` device matrix, as its own matrix.
    fn slice_rows(
        &self,
        all: Option<&CudaSlice<f32>>,
        from: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceRows> {
        let mut data = self.alloc(rows * cols, "output rows")?;
        if let (Some(all), true) = (all, rows > 0) {
            let src = all.slice(from * cols..(from + rows) * cols);
            self.gpu
                .stream
                .memcpy_dtod(&src, &mut data)
                .map_err(|e| cuda_err("copying output rows", e))?;
        }
        Ok(DeviceRows {
            gpu: self.gpu.clone(),
            data,
            rows,
            cols,
        })
    }
}

/// A `rows x cols` f32 matrix in device memory.
pub struct DeviceRows {
    gpu: Arc<Gpu>,
    data: CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

impl RowMatrix for DeviceRows {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn argmax_rows(&self) -> Result<Vec<u32>> {
        if self.rows == 0 {
            return Ok(Vec::new());
        }
        let gpu = &self.gpu;
        // SAFETY: written by the kernel below before it is read.
        let best = unsafe { gpu.stream.alloc::<u32>(self.rows) }
            .map_err(|e| cuda_err("allocating argmax", e))?;
        launch!(
            gpu,
            argmax_rows,
            (self.rows as u32, 1, 1),
            256,
            ptr(&self.data, gpu),
            ptr(&best, gpu),
            self.cols as i32
        );
        gpu.stream
            .clone_dtoh(&best)
            .map_err(|e| cuda_err("reading argmax", e))
    }

    fn row(&self, i: usize) -> Result<Cow<'_, [f32]>> {
        if i >= self.rows {
            return Err(Error::InvalidArgument(format!(
                "row {i} of a {}-row matrix",
                self.rows
            )));
        }
        let view = self.data.slice(i * self.cols..(i + 1) * self.cols);
        let host = self
            .gpu
            .stream
            .clone_dtoh(&view)
            .map_err(|e| cuda_err("reading a row", e))?;
        Ok(Cow::Owned(host))
    }

    fn to_host(&self) -> Result<Cow<'_, [f32]>> {
        let host = self
            .gpu
            .stream
            .clone_dtoh(&self.data)
            .map_err(|e| cuda_err("reading a matrix", e))?;
        Ok(Cow::Owned(host))
    }
}

impl Model for CudaModel {
    fn config(&self) -> &Config {
        &self.config
    }

    fn device(&self) -> String {
        self.gpu.name.clone()
    }

    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>> {
        Ok(Box::new(CudaKvCache::new(
            self.gpu.clone(),
            &self.config,
            capacity.min(self.config.context_length),
        )?))
    }

    fn forward(
        &self,
        batch: &mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
        _prof: &Profiler,
    ) -> Result<Vec<ForwardOutput>> {
        self.forward_batch(batch, opts)
    }

    fn weight_bytes(&self) -> usize {
        let m = |w: &Matrix| w.rows * w.cols * 2;
        self.layers
            .iter()
            .map(|l| {
                m(&l.wq) + m(&l.wk) + m(&l.wv) + m(&l.wo) + m(&l.w_gate) + m(&l.w_up) + m(&l.w_down)
            })
            .sum::<usize>()
            + m(self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    fn weight_types(&self) -> String {
        self.source_types.clone()
    }

    fn check_kernels(&self, _tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        // The GPU is checked against the CPU backend as a whole (`specula selftest --device cuda`).
        Ok(Vec::new())
    }
}
