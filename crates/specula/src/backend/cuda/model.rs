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
    workspace: std::sync::Mutex<Workspace>,
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
            workspace: Default::default(),
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
            workspace: Default::default(),
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// `y[m x w.rows] (+)= x[m x w.cols] . w^T` for the first `n` rows of `w`.
    fn gemv(&self, w: &Matrix, n: usize, x: u64, y: u64, m: usize, accumulate: bool) -> Result<()> {
        let grid = (n.div_ceil(16) as u32, m.div_ceil(8) as u32, 1);
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
        let tables = self.step_tables(batch)?;
        let vocab = opts.vocab_limit.unwrap_or(c.vocab_size);
        let shape = Shape {
            seqs: batch
                .iter()
                .map(|s| (s.tokens.len(), s.logits as u8))
                .collect(),
            vocab,
            capture: opts.capture_layers.to_vec(),
        };
        let mut ws = self
            .workspace
            .lock()
            .map_err(|_| Error::Cuda("the GPU workspace lock is poisoned".into()))?;
        ws.fit(self, &tables, &shape)?;
        // The step's tables go to fixed device buffers, so a captured graph replays with this step's values.
        let upload = |host: &[u32], dev: &mut CudaSlice<u32>, what: &str| -> Result<()> {
            if host.is_empty() {
                return Ok(());
            }
            let mut view = dev.slice_mut(0..host.len());
            gpu.stream
                .memcpy_htod(host, &mut view)
                .map_err(|e| cuda_err(&format!("uploading {what}"), e))
        };
        upload(&tables.tokens, &mut ws.tokens, "tokens")?;
        upload(&tables.positions, &mut ws.positions, "positions")?;
        upload(&tables.rows, &mut ws.row_table, "row table")?;
        upload(&tables.seqs, &mut ws.seq_table, "cache table")?;
        upload(&tables.wanted, &mut ws.wanted, "wanted rows")?;
        if graphs_enabled() {
            if !ws.graphs.contains_key(&shape) {
                gpu.stream
                    .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(|e| cuda_err("starting a CUDA graph capture", e))?;
                let recorded = self.record_step(&ws, &tables, &shape);
                let captured = gpu
                    .stream
                    .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
                recorded?;
                let graph = captured
                    .map_err(|e| cuda_err("capturing a CUDA graph", e))?
                    .ok_or_else(|| {
                        Error::Cuda("capturing a CUDA graph: nothing was captured".into())
                    })?;
                ws.graphs.insert(shape.clone(), StepGraph(graph));
            }
            ws.graphs[&shape]
                .0
                .launch()
                .map_err(|e| cuda_err("launching a step's CUDA graph", e))?;
        } else {
            self.record_step(&ws, &tables, &shape)?;
        }
        for (seq, len) in batch.iter_mut().zip(&tables.lens) {
            if let Some(cache) = seq.cache.as_any_mut().downcast_mut::<CudaKvCache>() {
                cache.len = *len;
            }
        }
        // Each sequence's rows, copied out of the workspace (the next step overwrites it).
        let h = c.hidden_size;
        let mut outputs = Vec::with_capacity(batch.len());
        let mut row0 = 0usize;
        for (s, seq) in batch.iter().enumerate() {
            let n = seq.tokens.len();
            let rows_wanted = match seq.logits {
                LogitsFor::All => n,
                LogitsFor::Last => 1,
                LogitsFor::None => 0,
            };
            let logits = self.slice_rows(&ws.logits, tables.first_wanted[s], rows_wanted, vocab)?;
            let mut hidden = Vec::new();
            for (i, &layer) in shape.capture.iter().enumerate() {
                let rows = self.slice_rows(&ws.captured[i], row0, n, h)?;
                hidden.push((layer, Box::new(rows) as Box<dyn RowMatrix>));
            }
            outputs.push(ForwardOutput {
                logits: Box::new(logits),
                hidden,
            });
            row0 += n;
        }
        Ok(outputs)
    }

    /// The host-side tables of a step (kernels.cu's RowInfo and SeqCache layouts as u32 words).
    fn step_tables(&self, batch: &mut [SequenceInput<'_>]) -> Result<StepTables> {
        let c = &self.config;
        let mut t = StepTables::default();
        let mut row0 = 0usize;
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
            if !Arc::ptr_eq(&cache.gpu, &self.gpu)
                || cache.num_layers != c.num_layers
                || cache.kv_heads != c.num_kv_heads
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
            for (i, &token) in seq.tokens.iter().enumerate() {
                t.tokens.push(token);
                let (position, mask) = match seq.tree {
                    Some(tree) => {
                        let mask = (0..n)
                            .filter(|&j| tree.sees(i, j))
                            .fold(0u64, |m, j| m | (1 << j));
                        (start + tree.depth(i), mask)
                    }
                    None => (start + i, u64::MAX),
                };
                t.positions.push(position as u32);
                t.rows.extend_from_slice(&[
                    s as u32,
                    (start + i) as u32,
                    start as u32,
                    seq.tree.is_some() as u32,
                    mask as u32,
                    (mask >> 32) as u32,
                ]);
            }
            let base = cache.device_ptr();
            t.seqs.extend_from_slice(&[
                base as u32,
                (base >> 32) as u32,
                cache.capacity() as u32,
                0,
            ]);
            t.lens.push(start + n);
            t.first_wanted.push(t.wanted.len());
            match seq.logits {
                LogitsFor::All => t.wanted.extend((row0..row0 + n).map(|r| r as u32)),
                LogitsFor::Last => t.wanted.push((row0 + n - 1) as u32),
                LogitsFor::None => {}
            }
            row0 += n;
        }
        Ok(t)
    }

    /// Queues a whole step on the stream, reading its inputs from the workspace's tables: the same launches run
    /// directly or are captured into a CUDA graph and replayed.
    fn record_step(&self, ws: &Workspace, tables: &StepTables, shape: &Shape) -> Result<()> {
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
        let rows = tables.tokens.len();
        let half = hd / 2;
        let p = |s: &CudaSlice<f32>| ptr(s, gpu);
        let (px, pn, pq, pk, pv, pa, pg, pu) = (
            p(&ws.x),
            p(&ws.normed),
            p(&ws.q),
            p(&ws.k),
            p(&ws.v),
            p(&ws.attn),
            p(&ws.gate),
            p(&ws.up),
        );
        let (p_rows, p_seqs) = (ptr(&ws.row_table, gpu), ptr(&ws.seq_table, gpu));
        let eps = c.rms_norm_eps as f32;
        let r32 = rows as u32;
        launch!(
            gpu,
            embed_rows,
            (r32, 1, 1),
            256,
            ptr(&self.embed.data, gpu),
            ptr(&ws.tokens, gpu),
            px,
            h as i32
        );
        launch!(
            gpu,
            rope_angles,
            (r32, 1, 1),
            64,
            ptr(&ws.positions, gpu),
            ptr(&self.rope_inv_freqs, gpu),
            p(&ws.angles),
            half as i32
        );
        let halves = (c.rope_style == RopeStyle::Halves) as i32;
        let scale = 1.0 / (hd as f32).sqrt();
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
                p(&ws.angles),
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
                p(&ws.angles),
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
            if let Some(i) = shape.capture.iter().position(|&l| l == li) {
                // SAFETY: both buffers hold at least rows * h floats (Workspace::fit), on this stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        p(&ws.captured[i]),
                        px,
                        rows * h * 4,
                        gpu.stream.cu_stream(),
                    )
                }
                .map_err(|e| cuda_err("capturing hidden states", e))?;
            }
        }
        let nw = tables.wanted.len();
        if nw > 0 {
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            launch!(
                gpu,
                gather_rows,
                (nw as u32, 1, 1),
                256,
                px,
                ptr(&ws.wanted, gpu),
                p(&ws.picked),
                h as i32
            );
            launch!(
                gpu,
                rms_norm,
                (nw as u32, 1, 1),
                256,
                p(&ws.picked),
                p(&self.final_norm),
                p(&ws.picked_normed),
                h as i32,
                eps
            );
            self.gemv(
                head,
                shape.vocab,
                p(&ws.picked_normed),
                p(&ws.logits),
                nw,
                false,
            )?;
        }
        Ok(())
    }

    /// Rows `from..from + rows` of a `? x cols` device matrix, as its own matrix.
    fn slice_rows(
        &self,
        all: &CudaSlice<f32>,
        from: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceRows> {
        let mut data = self.alloc(rows * cols, "output rows")?;
        if rows > 0 {
            let src = all.slice(from * cols..(from + rows) * cols);
            let mut dst = data.slice_mut(0..rows * cols);
            self.gpu
                .stream
                .memcpy_dtod(&src, &mut dst)
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

/// Whether steps run as CUDA graphs (default; `SPECULA_CUDA_GRAPHS=0` launches each kernel directly, to compare).
fn graphs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_GRAPHS").map_or(true, |v| v != "0"))
}

/// What a captured step depends on besides the tables' values: the sequences' row counts and logits choices,
/// the logits width, the captured layers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Shape {
    seqs: Vec<(usize, u8)>,
    vocab: usize,
    capture: Vec<usize>,
}

#[derive(Default)]
struct StepTables {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    /// kernels.cu RowInfo, 6 words a row.
    rows: Vec<u32>,
    /// kernels.cu SeqCache, 4 words a sequence.
    seqs: Vec<u32>,
    /// Rows that need logits, in output order.
    wanted: Vec<u32>,
    /// Each sequence's first row in `wanted`.
    first_wanted: Vec<usize>,
    /// Each sequence's cache length after the step.
    lens: Vec<usize>,
}

/// A captured step. CUDA graphs are not thread-safe; the workspace mutex serializes every use.
struct StepGraph(cudarc::driver::CudaGraph);
// SAFETY: only used under the workspace lock.
unsafe impl Send for StepGraph {}

/// Device buffers every step reuses (fixed addresses, so captured graphs stay valid), sized for the largest
/// step so far; growing them drops the captured graphs.
#[derive(Default)]
struct Workspace {
    rows: usize,
    wanted_rows: usize,
    vocab: usize,
    seqs: usize,
    captures: usize,
    buffers: Option<Buffers>,
    graphs: std::collections::HashMap<Shape, StepGraph>,
}

struct Buffers {
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    angles: CudaSlice<f32>,
    picked: CudaSlice<f32>,
    picked_normed: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    captured: Vec<CudaSlice<f32>>,
    tokens: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    row_table: CudaSlice<u32>,
    seq_table: CudaSlice<u32>,
    wanted: CudaSlice<u32>,
}

impl std::ops::Deref for Workspace {
    type Target = Buffers;
    fn deref(&self) -> &Buffers {
        self.buffers
            .as_ref()
            .expect("fit() allocates the buffers first")
    }
}

impl std::ops::DerefMut for Workspace {
    fn deref_mut(&mut self) -> &mut Buffers {
        self.buffers
            .as_mut()
            .expect("fit() allocates the buffers first")
    }
}

impl Workspace {
    /// Makes room for this step (at least 16 rows, growing by doubling).
    fn fit(&mut self, model: &CudaModel, t: &StepTables, shape: &Shape) -> Result<()> {
        let rows = t.tokens.len();
        let fits = self.buffers.is_some()
            && rows <= self.rows
            && t.wanted.len() <= self.wanted_rows
            && shape.vocab <= self.vocab
            && t.lens.len() <= self.seqs
            && shape.capture.len() <= self.captures;
        if fits {
            return Ok(());
        }
        self.graphs.clear();
        self.buffers = None;
        let grow = |want: usize, have: usize| want.max(have).max(16).next_power_of_two();
        self.rows = grow(rows, self.rows);
        self.wanted_rows = grow(t.wanted.len(), self.wanted_rows);
        self.vocab = self.vocab.max(shape.vocab);
        self.seqs = grow(t.lens.len(), self.seqs);
        self.captures = self.captures.max(shape.capture.len());
        let c = &model.config;
        let (r, w) = (self.rows, self.wanted_rows);
        let f = |n: usize, what: &str| model.alloc(n, what);
        let u = |n: usize, what: &str| {
            model
                .gpu
                .stream
                .alloc_zeros::<u32>(n.max(1))
                .map_err(|e| cuda_err(&format!("allocating {what}"), e))
        };
        self.buffers = Some(Buffers {
            x: f(r * c.hidden_size, "activations")?,
            normed: f(r * c.hidden_size, "activations")?,
            q: f(r * c.q_dim(), "queries")?,
            k: f(r * c.kv_dim(), "keys")?,
            v: f(r * c.kv_dim(), "values")?,
            attn: f(r * c.q_dim(), "attention output")?,
            gate: f(r * c.intermediate_size, "MLP activations")?,
            up: f(r * c.intermediate_size, "MLP activations")?,
            angles: f(r * c.head_dim, "rotary angles")?,
            picked: f(w * c.hidden_size, "final rows")?,
            picked_normed: f(w * c.hidden_size, "final rows")?,
            logits: f(w * self.vocab, "logits")?,
            captured: (0..self.captures)
                .map(|_| f(r * c.hidden_size, "captured hidden states"))
                .collect::<Result<_>>()?,
            tokens: u(r, "tokens")?,
            positions: u(r, "positions")?,
            row_table: u(r * 6, "row table")?,
            seq_table: u(self.seqs * 4, "cache table")?,
            wanted: u(w, "wanted rows")?,
        });
        Ok(())
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

    fn clock(&self, exact: bool) -> Box<dyn crate::profile::Clock> {
        Box::new(super::clock::EventClock::new(self.gpu.clone(), exact))
    }

    fn check_kernels(&self, _tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        // The GPU is checked against the CPU backend as a whole (`specula selftest --device cuda`).
        Ok(Vec::new())
    }
}
