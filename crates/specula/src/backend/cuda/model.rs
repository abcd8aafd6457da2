//! The Llama-family forward pass on the GPU: the same computation as the CPU backend (backend/cpu/model.rs),
//! one kernel launch per step of it, for a batch of sequences with optional tree masks.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

use super::layout::{self, MAX_SPLITS};
use super::ops::{self, alloc_split, gemv, ptr, AttentionSplits, Matrix, WeightFormat};
use super::{cuda_err, CudaKvCache, Gpu};
use crate::error::{Error, Result};
use crate::model::config::{Config, RopeStyle};
use crate::model::dtype::GgmlType;
use crate::model::forward::{
    check_batch, run_step_shapes, ForwardOptions, ForwardOutput, KernelCheck, LogitsFor, Model,
    RowMatrix, SequenceCache, SequenceInput, StepShapes,
};
use crate::model::tensors::{LayerTensor, RawTensor, TensorNames, WeightSource};
use crate::profile::Profiler;

/// One layer, with its matrices fused so that a step launches few, large kernels: Q, K and V stacked into one
/// matrix (and their biases into one vector), gate and up stacked 8 rows of each per 16-row block
/// (layout::stack_gate_up) so one GEMV ends with SiLU(gate) * up.
struct Layer {
    attn_norm: CudaSlice<f32>,
    wqkv: Matrix,
    bqkv: Option<CudaSlice<f32>>,
    wo: Matrix,
    ffn_norm: CudaSlice<f32>,
    w_gate_up: Matrix,
    w_down: Matrix,
}

/// Blocks per row of the argmax's first pass (kernels.cu ARGMAX_PARTS).
const ARGMAX_PARTS: usize = 64;
/// Threads of a top_token block (kernels.cu TOP_TOKEN_THREADS).
pub(super) const TOP_TOKEN_THREADS: u32 = 1024;

pub struct CudaModel {
    pub config: Config,
    gpu: Arc<Gpu>,
    /// Shared with EAGLE-3 heads placed on this GPU (they read the target's embedding).
    embed: Arc<Matrix>,
    layers: Vec<Layer>,
    final_norm: CudaSlice<f32>,
    /// None when the LM head is tied to the embedding.
    lm_head: Option<Matrix>,
    rope_inv_freqs: CudaSlice<f32>,
    /// The checkpoint's storage types, e.g. "Q4_K x 169 (as bf16)".
    source_types: String,
    /// bf16 copies of layer 0's (and an untied LM head's) native matrices (by the check's names), which `check_kernels` compares the
    /// native GEMV against bit for bit.
    layer0_bf16: Vec<(&'static str, Matrix)>,
    workspace: std::sync::Mutex<Workspace>,
    /// Device blocks of dropped step outputs, reused by later steps (an allocation and a free a step cost host
    /// time a server pays on every step).
    output_pool: Arc<OutputPool>,
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

/// Whether GGUF Q4_K, Q6_K, Q8_0, Q5_0, Q4_1 and Q4_0 matrices stay quantized on the device (the default;
/// `SPECULA_CUDA_NATIVE_QUANT=0` dequantizes them to bf16 at load): 2.7x (Q4_K, Q4_1) and 1.6x (the others)
/// fewer bytes a step than bf16, the same outputs bit for bit (`check_kernels`). Measured on an H200 with the
/// real Qwen2.5-Coder-1.5B Q4_K_M: 700-703 tok/s against 643-662 as bf16 (docs/benchmarks.md, session 20).
pub(super) fn native_quant() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("SPECULA_CUDA_NATIVE_QUANT").as_deref(),
            Ok("0")
        )
    })
}

/// Whether matrices stacked from parts of different native types (Q, K and V of a Q4_K_M model) stay native as
/// mixed parts (the default; `SPECULA_CUDA_NATIVE_MIXED=0` stacks them as bf16, as before the mixed GEMV).
fn native_mixed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("SPECULA_CUDA_NATIVE_MIXED").as_deref(),
            Ok("0")
        )
    })
}

/// Kernel kinds a step leaves out (`SPECULA_CUDA_SKIP_KERNELS=norm,qkv,qkv_post,attention,out,gate_up,down`),
/// to measure what each kind costs inside a captured step by difference (scripts/gpu-step-breakdown.sh). The
/// step's outputs are meaningless while it is set; it is never set in use.
fn skipped(kind: &str) -> bool {
    static SKIP: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    SKIP.get_or_init(|| {
        std::env::var("SPECULA_CUDA_SKIP_KERNELS")
            .map(|v| v.split(',').map(|k| k.trim().to_string()).collect())
            .unwrap_or_default()
    })
    .iter()
    .any(|k| k == kind)
}

/// Weights a block of a GGUF type with a native GPU format holds (its rows must be whole blocks); None for the
/// others (uploaded as bf16).
pub(super) fn native_block(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => Some(256),
        GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q4_1 | GgmlType::Q4_0 => Some(32),
        _ => None,
    }
}

/// A matrix on the host before upload: bf16 values, or a quantized tensor's GGUF bytes kept for a native GEMV,
/// or parts of both kinds stacked by rows (each `(part, rows)`; the mixed GEMV).
#[derive(Clone)]
pub(super) enum HostMatrix {
    Bf16(Vec<u16>),
    Native(GgmlType, Vec<u8>),
    Parts(Vec<(HostMatrix, usize)>),
}

impl HostMatrix {
    /// Its values as bf16 (dequantized as `to_bf16` does).
    pub(super) fn into_bf16(self, rows: usize, cols: usize) -> Result<Vec<u16>> {
        match self {
            HostMatrix::Bf16(v) => Ok(v),
            HostMatrix::Native(ty, bytes) => Ok(crate::backend::cpu::weights::Weight::from_raw(
                ty, &bytes, rows, cols,
            )
            .map_err(Error::Cuda)?
            .to_f32()
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_bits())
            .collect()),
            HostMatrix::Parts(parts) => {
                let mut values = Vec::with_capacity(rows * cols);
                for (p, r) in parts {
                    values.extend(p.into_bf16(r, cols)?);
                }
                Ok(values)
            }
        }
    }

    fn native_type(&self) -> Option<GgmlType> {
        match self {
            HostMatrix::Native(ty, _) => Some(*ty),
            HostMatrix::Bf16(_) | HostMatrix::Parts(_) => None,
        }
    }

    /// Gate and up (`ff x cols` each) stacked 8 rows of each per row block (layout::stack_gate_up), for the GEMV
    /// that ends in SiLU(gate) * up: GGUF rows when both are of one native type, else bf16 values.
    pub(super) fn gate_up(gate: Self, up: Self, ff: usize, cols: usize) -> Result<Self> {
        Ok(match (gate, up) {
            (HostMatrix::Native(tg, g), HostMatrix::Native(tu, u)) if tg == tu => {
                let row_bytes = g.len() / ff;
                HostMatrix::Native(tg, layout::stack_gate_up(&g, &u, ff, row_bytes))
            }
            (g, u) => HostMatrix::Bf16(layout::stack_gate_up(
                &g.into_bf16(ff, cols)?,
                &u.into_bf16(ff, cols)?,
                ff,
                cols,
            )),
        })
    }

    /// Uploads it as a `rows x cols` matrix in its format: bf16 tiles, tiles of its native type, or mixed parts.
    pub(super) fn upload(self, gpu: &Gpu, rows: usize, cols: usize, what: &str) -> Result<Matrix> {
        match self {
            HostMatrix::Bf16(v) => Matrix::upload(gpu, &v, rows, cols, what),
            HostMatrix::Native(ty, bytes) => {
                Matrix::upload_native(gpu, ty, &bytes, rows, cols, what)
            }
            HostMatrix::Parts(parts) => {
                let mut tiled = Vec::with_capacity(parts.len());
                for (p, r) in parts {
                    tiled.push(match p {
                        HostMatrix::Native(ty, b) => {
                            let (t, f) = super::ops::tile_native(ty, &b, r, cols, what)?;
                            (f, t, r)
                        }
                        HostMatrix::Bf16(v) => (
                            layout::TileFormat::Bf16,
                            layout::tile_matrix(&v, r, cols),
                            r,
                        ),
                        HostMatrix::Parts(_) => {
                            return Err(Error::Cuda(format!("{what}: nested mixed parts")))
                        }
                    });
                }
                Matrix::upload_mixed(gpu, tiled, cols, what)
            }
        }
    }

    /// Bytes its tiles take on the device (`rows x cols` values): 2 a value as bf16, 384 per 512 in nibble tiles
    /// (Q4_K, Q4_1), 640 per 512 in scaled int8 tiles (the other native types).
    pub(super) fn device_bytes(&self, rows: usize, cols: usize) -> usize {
        let n = rows * cols;
        match self {
            HostMatrix::Bf16(_) => 2 * n,
            HostMatrix::Native(GgmlType::Q4K | GgmlType::Q4_1, _) => n * 384 / 512,
            HostMatrix::Native(..) => n * 640 / 512,
            HostMatrix::Parts(parts) => parts.iter().map(|(p, r)| p.device_bytes(*r, cols)).sum(),
        }
    }
}

/// Row-stacked parts (each `(matrix, rows)`, `cols` wide) as one matrix: native when every part is of the same
/// native type; mixed parts (the mixed GEMV) when some are native and every part but the last is whole row blocks
/// (neighbours of one native type merged, at most three parts); else bf16.
fn stack_parts(parts: Vec<(HostMatrix, usize)>, cols: usize) -> Result<HostMatrix> {
    let mut merged: Vec<(HostMatrix, usize)> = Vec::new();
    for (p, rows) in parts {
        if let (Some((HostMatrix::Native(prev_ty, prev), prev_rows)), HostMatrix::Native(ty, b)) =
            (merged.last_mut(), &p)
        {
            if prev_ty == ty {
                prev.extend_from_slice(b);
                *prev_rows += rows;
                continue;
            }
        }
        merged.push((p, rows));
    }
    if merged.len() == 1 {
        return Ok(merged
            .pop()
            .map(|(p, _)| p)
            .unwrap_or(HostMatrix::Bf16(Vec::new())));
    }
    let any_native = merged.iter().any(|(p, _)| p.native_type().is_some());
    let whole_blocks = merged[..merged.len() - 1]
        .iter()
        .all(|(_, rows)| rows % layout::ROW_BLOCK == 0);
    if any_native && whole_blocks && merged.len() <= 3 && native_mixed() {
        return Ok(HostMatrix::Parts(merged));
    }
    let mut values = Vec::new();
    for (p, rows) in merged {
        values.extend(p.into_bf16(rows, cols)?);
    }
    Ok(HostMatrix::Bf16(values))
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
pub(crate) fn check_shape(c: &Config) -> Result<()> {
    if c.hidden_size > 16384 {
        return Err(Error::Cuda(format!(
            "hidden size {} is above the 16384 the GPU RMSNorm kernel holds in registers",
            c.hidden_size
        )));
    }
    if c.head_dim > 256 || !c.head_dim.is_multiple_of(4) {
        return Err(Error::Cuda(format!(
            "head dimension {} is not a multiple of 4 up to 256, which the GPU attention kernel needs",
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

/// Refuses, naming the sizes, a model whose bf16 weights do not fit in the GPU's free memory.
fn check_weights_fit(gpu: &Gpu, c: &Config, what: &str) -> Result<()> {
    let (h, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let elements = c.vocab_size * h * if c.tie_word_embeddings { 1 } else { 2 }
        + c.num_layers * (q_dim * h * 2 + kv_dim * h * 2 + ff * h * 3);
    let (free, _) = gpu.memory()?;
    if elements * 2 > free {
        return Err(Error::Cuda(format!(
            "{what} need {:.2} GB of GPU memory, but {} has {:.2} GB free",
            elements as f64 * 2e-9,
            gpu.name,
            free as f64 * 1e-9
        )));
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
        check_weights_fit(&gpu, &c, "the model's weights as bf16")?;
        let mut types: Vec<(GgmlType, usize)> = Vec::new();
        let native = native_quant();
        // A matrix on the host (counted by storage type for the report): a Q4_K or Q6_K tensor's GGUF bytes when
        // `keep` and native quantized GEMVs are on, else bf16 values.
        let mut fetch = |name: &str, rows: usize, cols: usize, keep: bool| -> Result<HostMatrix> {
            let t = src.tensor(name, rows, cols)?;
            match types.iter_mut().find(|(ty, _)| *ty == t.dtype) {
                Some(e) => e.1 += 1,
                None => types.push((t.dtype, 1)),
            }
            if keep && native && native_block(t.dtype).is_some_and(|b| cols.is_multiple_of(b)) {
                return Ok(HostMatrix::Native(t.dtype, t.bytes.to_vec()));
            }
            Ok(HostMatrix::Bf16(to_bf16(&t)?))
        };
        let upload = |data: &[u16], rows: usize, cols: usize, what: &str| -> Result<Matrix> {
            Matrix::upload(&gpu, data, rows, cols, what)
        };
        let mut natives = 0usize;
        let mut layer0_bf16: Vec<(&'static str, Matrix)> = Vec::new();
        // Uploads a layer matrix in its format; layer 0's native ones also as bf16, for check_kernels.
        let mut upload_layer = |m: HostMatrix,
                                rows: usize,
                                cols: usize,
                                what: &'static str,
                                layer: usize|
         -> Result<Matrix> {
            if matches!(m, HostMatrix::Bf16(_)) {
                return m.upload(&gpu, rows, cols, what);
            }
            natives += 1;
            if layer == 0 {
                let values = m.clone().into_bf16(rows, cols)?;
                layer0_bf16.push((what, upload(&values, rows, cols, what)?));
            }
            m.upload(&gpu, rows, cols, what)
        };
        let vector_host =
            |name: &str, len: usize| -> Result<Vec<f32>> { to_f32(&src.tensor(name, 1, len)?) };
        let vector = |name: &str, len: usize| -> Result<CudaSlice<f32>> {
            gpu.stream
                .clone_htod(&vector_host(name, len)?)
                .map_err(|e| cuda_err(&format!("uploading {name}"), e))
        };
        let has_lm_head = src.has(names.lm_head);
        let mut tied_head_native = false;
        // The embedding lookup reads bf16 tiles; a tied LM head may still multiply natively (a second copy).
        let embed_host = fetch(
            names.embed,
            c.vocab_size,
            h,
            !has_lm_head && c.tie_word_embeddings,
        )?;
        let tied_native = embed_host.native_type();
        let embed_bytes = match &embed_host {
            HostMatrix::Native(_, b) => Some(b.clone()),
            HostMatrix::Bf16(_) | HostMatrix::Parts(_) => None,
        };
        let embed = upload(
            &embed_host.into_bf16(c.vocab_size, h)?,
            c.vocab_size,
            h,
            names.embed,
        )?;
        let lm_head = if has_lm_head {
            match fetch(names.lm_head, c.vocab_size, h, true)? {
                HostMatrix::Bf16(v) => Some(upload(&v, c.vocab_size, h, names.lm_head)?),
                native => Some(upload_layer(native, c.vocab_size, h, "LM head", 0)?),
            }
        } else if c.tie_word_embeddings {
            match (tied_native, embed_bytes) {
                (Some(ty), Some(bytes)) => {
                    tied_head_native = true;
                    Some(Matrix::upload_native(
                        &gpu,
                        ty,
                        &bytes,
                        c.vocab_size,
                        h,
                        "LM head (tied)",
                    )?)
                }
                _ => None,
            }
        } else {
            return Err(Error::MissingTensor {
                name: names.lm_head.to_string(),
                hint: " (the config says the LM head is not tied to the embedding)".into(),
            });
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |t| (names.layer)(i, t);
            let qkv = stack_parts(
                vec![
                    (fetch(&n(LayerTensor::Q), q_dim, h, true)?, q_dim),
                    (fetch(&n(LayerTensor::K), kv_dim, h, true)?, kv_dim),
                    (fetch(&n(LayerTensor::V), kv_dim, h, true)?, kv_dim),
                ],
                h,
            )?;
            let biases = [
                (LayerTensor::QBias, q_dim),
                (LayerTensor::KBias, kv_dim),
                (LayerTensor::VBias, kv_dim),
            ];
            let bqkv = if biases.iter().any(|&(t, _)| src.has(&n(t))) {
                let mut b = Vec::with_capacity(q_dim + 2 * kv_dim);
                for (t, len) in biases {
                    let name = n(t);
                    if src.has(&name) {
                        b.extend(vector_host(&name, len)?);
                    } else {
                        b.extend(std::iter::repeat_n(0f32, len));
                    }
                }
                Some(
                    gpu.stream
                        .clone_htod(&b)
                        .map_err(|e| cuda_err("uploading QKV biases", e))?,
                )
            } else {
                None
            };
            // Gate and up stacked 8 rows of each per row block, as GGUF rows (Q4_K) or bf16 values.
            let gate = fetch(&n(LayerTensor::Gate), ff, h, true)?;
            let up = fetch(&n(LayerTensor::Up), ff, h, true)?;
            let gate_up = HostMatrix::gate_up(gate, up, ff, h)?;
            let wo = fetch(&n(LayerTensor::O), h, q_dim, true)?;
            let down = fetch(&n(LayerTensor::Down), h, ff, true)?;
            layers.push(Layer {
                attn_norm: vector(&n(LayerTensor::AttnNorm), h)?,
                wqkv: upload_layer(qkv, q_dim + 2 * kv_dim, h, "QKV", i)?,
                bqkv,
                wo: upload_layer(wo, h, q_dim, "attention output", i)?,
                ffn_norm: vector(&n(LayerTensor::FfnNorm), h)?,
                w_gate_up: upload_layer(gate_up, 2 * ff, h, "gate/up", i)?,
                w_down: upload_layer(down, h, ff, "down", i)?,
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
            embed: Arc::new(embed),
            layers,
            final_norm,
            lm_head,
            rope_inv_freqs,
            source_types: if natives + usize::from(tied_head_native) > 0 {
                let natives = natives + usize::from(tied_head_native);
                format!("{source_types}; {natives} matrices native (Q4_K, Q6_K, Q8_0, Q5_0, Q4_1, Q4_0), the rest as bf16")
            } else {
                format!("{source_types}, as bf16")
            },
            layer0_bf16,
            workspace: Default::default(),
            output_pool: Default::default(),
        })
    }

    /// A model of `config`'s shape with seeded random bf16 weights made on the device (speed work on real
    /// shapes whose weights cannot reach the machine): matrices uniform in +-1/sqrt(inputs), norms 1, no biases.
    pub fn random(gpu: Arc<Gpu>, config: Config, seed: u64) -> Result<Self> {
        config.validate()?;
        check_shape(&config)?;
        let c = config.clone();
        let (h, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        check_weights_fit(&gpu, &c, "random weights of this shape")?;
        let mut next_seed = seed;
        let mut matrix = |rows: usize, cols: usize| -> Result<Matrix> {
            // Random values fill the padding too: padded inputs meet zero activations, padded outputs are not
            // written.
            let (blocks, chunks) = layout::tiles(rows, cols);
            let n = blocks * chunks * layout::TILE;
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
            Ok(Matrix {
                data,
                rows,
                cols,
                chunks,
                format: super::ops::WeightFormat::Bf16,
                parts: None,
            })
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
                wqkv: matrix(q_dim + 2 * kv_dim, h)?,
                bqkv: None,
                wo: matrix(h, q_dim)?,
                ffn_norm: ones(h)?,
                w_gate_up: matrix(2 * ff, h)?,
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
            embed: Arc::new(embed),
            layers,
            final_norm,
            lm_head,
            rope_inv_freqs,
            source_types: format!("random bf16 (seed {seed})"),
            layer0_bf16: Vec::new(),
            workspace: Default::default(),
            output_pool: Default::default(),
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        w: &Matrix,
        n: usize,
        x: u64,
        y: u64,
        m: usize,
        accumulate: bool,
        silu_pairs: bool,
        scratch: u64,
        defer: bool,
    ) -> Result<usize> {
        gemv(
            &self.gpu, w, n, x, y, m, accumulate, silu_pairs, scratch, defer,
        )
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
            rows: tables.tokens.len(),
            wanted: tables.wanted.len(),
            vocab,
            capture: opts.capture_layers.to_vec(),
            attention_list: ops::attention_as_list(tables.tokens.len()),
            attention_grouped: ops::attention_grouped(tables.tokens.len()),
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
        if graphs_enabled() && shape.worth_a_graph() {
            if !ws.graphs.contains_key(&shape) {
                // A server sees many shapes (batch sizes, draft lengths); the cache stays bounded.
                if ws.graphs.len() >= MAX_GRAPHS {
                    ws.graphs.clear();
                }
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
        // The step's logits and captured rows, copied out of the workspace once (the next step overwrites it);
        // each sequence gets views of its rows. Views share one argmax over all rows and one host copy, so a
        // batch of 32 requests costs one readback, not one each (32 argmax syncs cost 0.85 ms a step).
        let h = c.hidden_size;
        let logits_all = self
            .step_matrices(&ws.logits, 1, tables.wanted.len(), vocab)?
            .pop()
            .ok_or_else(|| Error::Cuda("no logits matrix".into()))?;
        // The captured layers share one block: one copy, one allocation and one readback for all of them.
        let hidden_all = self.step_matrices(&ws.captured, shape.capture.len(), shape.rows, h)?;
        let mut outputs = Vec::with_capacity(batch.len());
        let mut row0 = 0usize;
        for (s, seq) in batch.iter().enumerate() {
            let n = seq.tokens.len();
            let rows_wanted = match seq.logits {
                LogitsFor::All => n,
                LogitsFor::Last => 1,
                LogitsFor::None => 0,
            };
            let logits = DeviceRows::view(&logits_all, tables.first_wanted[s], rows_wanted);
            let mut hidden = Vec::new();
            for (all, &layer) in hidden_all.iter().zip(&shape.capture) {
                let rows = DeviceRows::view(all, row0, n);
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
        let (px, pqkv, pq, pscratch) = (p(&ws.x), p(&ws.qkv), p(&ws.q), p(&ws.scratch));
        let (pn, pa, pact) = (ptr(&ws.normed, gpu), ptr(&ws.attn, gpu), ptr(&ws.act, gpu));
        let chunks = |k: usize| k.div_ceil(layout::CHUNK) as i32;
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
            h as i32,
            self.embed.chunks as i32
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
        let segments = (heads + 2 * kv_heads) as u32;
        let norm_threads = ops::norm_threads(h);
        // Split-K partial sums of the last residual update (down projection) not yet added into x: the next
        // RMSNorm adds them (0: none pending).
        let mut pending = 0usize;
        // Where the next attention norm writes the residual stream it completes (the previous layer's output,
        // when that layer is captured): 0 for none.
        let mut capture_into = 0u64;
        let last = self.layers.len() - 1;
        for (li, layer) in self.layers.iter().enumerate() {
            // Attention: norm (adding the last layer's deferred down projection), one QKV GEMV, its partial sums +
            // biases + RoPE + cache write in one kernel, attention, and the output projection, whose partial sums
            // the MLP's norm adds into the residual stream.
            if !skipped("norm") {
                launch!(
                    gpu,
                    rms_norm,
                    (r32, 1, 1),
                    norm_threads,
                    px,
                    p(&layer.attn_norm),
                    pn,
                    h as i32,
                    eps,
                    pscratch,
                    pending as i32,
                    (rows * h) as u64,
                    chunks(h),
                    capture_into
                );
            }
            capture_into = 0;
            let qkv_width = q_dim + 2 * kv_dim;
            let qkv_splits = if skipped("qkv") {
                0
            } else {
                self.gemv(
                    &layer.wqkv,
                    qkv_width,
                    pn,
                    pqkv,
                    rows,
                    false,
                    false,
                    pscratch,
                    true,
                )?
            };
            let (bias, has_bias) = layer.bqkv.as_ref().map_or((0u64, 0i32), |b| (p(b), 1));
            if !skipped("qkv_post") {
                launch!(
                    gpu,
                    qkv_post,
                    (r32, segments, 1),
                    64,
                    if qkv_splits > 0 { pscratch } else { pqkv },
                    qkv_splits as i32,
                    (rows * qkv_width) as u64,
                    bias,
                    has_bias,
                    p(&ws.angles),
                    p_rows,
                    p_seqs,
                    li as i32,
                    heads as i32,
                    kv_heads as i32,
                    hd as i32,
                    halves,
                    pq
                );
            }
            if !skipped("attention") {
                ops::attention(
                    gpu,
                    &ws.attention,
                    rows,
                    pq,
                    pa,
                    p_rows,
                    p_seqs,
                    li,
                    heads,
                    kv_heads,
                    hd,
                )?;
            }
            let o_splits = if skipped("out") {
                0
            } else {
                self.gemv(&layer.wo, h, pa, px, rows, true, false, pscratch, true)?
            };
            // MLP: norm (adding the output projection), one gate/up GEMV ending in SiLU(gate) * up, and the down
            // projection, added in by the next layer's norm (or here, when this layer's output is read next).
            if !skipped("norm") {
                launch!(
                    gpu,
                    rms_norm,
                    (r32, 1, 1),
                    norm_threads,
                    px,
                    p(&layer.ffn_norm),
                    pn,
                    h as i32,
                    eps,
                    pscratch,
                    o_splits as i32,
                    (rows * h) as u64,
                    chunks(h),
                    0u64
                );
            }
            if !skipped("gate_up") {
                self.gemv(
                    &layer.w_gate_up,
                    2 * ff,
                    pn,
                    pact,
                    rows,
                    false,
                    true,
                    pscratch,
                    false,
                )?;
            }
            let captured = shape.capture.iter().position(|&l| l == li);
            // A captured layer's output is written by the next layer's attention norm, which completes it (the
            // last layer's is copied here: the final norm reads only the rows that want logits).
            let defer_down = li != last && (captured.is_none() || !skipped("norm"));
            pending = if skipped("down") {
                0
            } else {
                self.gemv(
                    &layer.w_down,
                    h,
                    pact,
                    px,
                    rows,
                    true,
                    false,
                    pscratch,
                    defer_down,
                )?
            };
            match captured {
                Some(i) if li != last && !skipped("norm") => {
                    capture_into = ws.captured_at(gpu, i, rows, h)
                }
                Some(i) => {
                    // SAFETY: both buffers hold at least rows * h floats (Workspace::fit), on this stream.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            ws.captured_at(gpu, i, rows, h),
                            px,
                            rows * h * 4,
                            gpu.stream.cu_stream(),
                        )
                    }
                    .map_err(|e| cuda_err("capturing hidden states", e))?;
                }
                None => {}
            }
        }
        let nw = tables.wanted.len();
        if nw > 0 {
            let head = self.lm_head.as_ref().unwrap_or(&*self.embed);
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
                norm_threads,
                p(&ws.picked),
                p(&self.final_norm),
                ptr(&ws.picked_normed, gpu),
                h as i32,
                eps,
                0u64,
                0i32,
                0u64,
                chunks(h),
                0u64
            );
            self.gemv(
                head,
                shape.vocab,
                ptr(&ws.picked_normed, gpu),
                p(&ws.logits),
                nw,
                false,
                false,
                pscratch,
                false,
            )?;
        }
        Ok(())
    }

    /// `count` matrices of `rows x cols` lying one after another at the start of workspace buffer `src`, copied
    /// out in one copy into one device block (the next step overwrites the workspace); they share the block's
    /// host copy.
    fn step_matrices(
        &self,
        src: &CudaSlice<f32>,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Arc<StepMatrix>>> {
        let size = rows * cols;
        if count == 0 {
            return Ok(Vec::new());
        }
        let len = size * count;
        let mut data = match self.output_pool.take(len) {
            Some(d) => d,
            None => self.alloc(len.max(1), "output rows")?,
        };
        if len > 0 {
            let mut dst = data.slice_mut(0..len);
            self.gpu
                .stream
                .memcpy_dtod(&src.slice(0..len), &mut dst)
                .map_err(|e| cuda_err("copying output rows", e))?;
        }
        let block = Arc::new(OutputBlock {
            data: Some(data),
            len,
            host: Mutex::new(None),
            pool: self.output_pool.clone(),
        });
        Ok((0..count)
            .map(|i| {
                Arc::new(StepMatrix {
                    gpu: self.gpu.clone(),
                    block: block.clone(),
                    offset: i * size,
                    rows,
                    cols,
                    argmax: Mutex::new(None),
                    top: Mutex::new(None),
                })
            })
            .collect())
    }
}

/// Whether steps run as CUDA graphs (default; `SPECULA_CUDA_GRAPHS=0` launches each kernel directly, to compare).
pub(crate) fn graphs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !GRAPHS_SUSPENDED.load(std::sync::atomic::Ordering::Relaxed)
        && *ON.get_or_init(|| std::env::var("SPECULA_CUDA_GRAPHS").map_or(true, |v| v != "0"))
}

/// Set while [`super::Gpu::time_kernels`] runs: kernels launched one by one, so each can be timed.
static GRAPHS_SUSPENDED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) fn suspend_graphs(suspended: bool) {
    GRAPHS_SUSPENDED.store(suspended, std::sync::atomic::Ordering::Relaxed);
}

/// Captured step graphs kept at most (each holds its kernels' parameters; a long-running server would otherwise
/// keep one per batch shape it ever saw).
const MAX_GRAPHS: usize = 256;

/// Steps of more rows than this run without a graph: they are prefill chunks, long enough that launches are a
/// small part of them, and their shapes rarely repeat.
const MAX_GRAPH_ROWS: usize = 64;

impl Shape {
    fn worth_a_graph(&self) -> bool {
        self.rows <= MAX_GRAPH_ROWS
    }
}

/// What a captured step depends on besides the tables' values: its total rows, how many of them need logits,
/// the logits width and the captured layers. Which sequence a row belongs to, its position and whether it
/// needs logits all come from the uploaded tables, so a batch of 16 sequences with drafts of varying lengths
/// replays the graph of any other batch with as many rows (keying on each sequence's row count made a
/// speculative server capture a new graph almost every step: 0.78x of plain decoding at 16 streams).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Shape {
    rows: usize,
    wanted: usize,
    vocab: usize,
    capture: Vec<usize>,
    /// Attention as a list of items or as a grid (`ops::attention_as_list`; the selftest runs both).
    attention_list: bool,
    /// Heads sharing a KV head taken several a block (`ops::attention_variant`; the selftest runs both ways).
    attention_grouped: bool,
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
    /// GEMV inputs, split (ops::alloc_split): the normed residual stream, attention's output, SiLU(gate) * up.
    normed: CudaSlice<u32>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    attn: CudaSlice<u32>,
    act: CudaSlice<u32>,
    /// Split-K partial sums: MAX_SPLITS x rows x the widest split output.
    scratch: CudaSlice<f32>,
    angles: CudaSlice<f32>,
    picked: CudaSlice<f32>,
    picked_normed: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    attention: AttentionSplits,
    /// The captured layers' rows, layer after layer, each `rows x hidden` for the step's own rows (compact, so
    /// one copy takes them all out): see `captured_at`.
    captured: CudaSlice<f32>,
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

impl Buffers {
    /// Where captured layer `i` (of the step's captured layers) of a `rows`-row step starts.
    fn captured_at(&self, gpu: &Gpu, i: usize, rows: usize, hidden: usize) -> u64 {
        ptr(&self.captured, gpu) + (4 * i * rows * hidden) as u64
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
            normed: alloc_split(&model.gpu, r, c.hidden_size, "activations")?,
            qkv: f(r * (c.q_dim() + 2 * c.kv_dim()), "QKV")?,
            q: f(r * c.q_dim(), "queries")?,
            attn: alloc_split(&model.gpu, r, c.q_dim(), "attention output")?,
            act: alloc_split(&model.gpu, r, c.intermediate_size, "MLP activations")?,
            scratch: f(
                MAX_SPLITS
                    * r.max(w)
                    * (c.q_dim() + 2 * c.kv_dim())
                        .max(c.hidden_size)
                        .max(self.vocab),
                "split-K scratch",
            )?,
            angles: f(r * c.head_dim, "rotary angles")?,
            picked: f(w * c.hidden_size, "final rows")?,
            picked_normed: alloc_split(&model.gpu, w, c.hidden_size, "final rows")?,
            logits: f(w * self.vocab, "logits")?,
            attention: AttentionSplits::new(&model.gpu, r, c.num_heads, c.head_dim, "the step's")?,
            captured: f(self.captures * r * c.hidden_size, "captured hidden states")?,
            tokens: u(r, "tokens")?,
            positions: u(r, "positions")?,
            row_table: u(r * 6, "row table")?,
            seq_table: u(self.seqs * 4, "cache table")?,
            wanted: u(w, "wanted rows")?,
        });
        Ok(())
    }
}

/// A step's `rows x cols` output matrix in device memory (logits, or one captured layer), shared by the views
/// each sequence gets; its row argmax and (for narrow matrices) its host copy are read back once, on first use.
pub struct StepMatrix {
    gpu: Arc<Gpu>,
    block: Arc<OutputBlock>,
    /// Where the matrix starts in the block (elements).
    offset: usize,
    rows: usize,
    cols: usize,
    argmax: Mutex<Option<Vec<u32>>>,
    /// Each row's top token and its probability, computed for every row on the first ask (a round of a draft
    /// model's passes asks once for each request).
    top: Mutex<Option<Vec<(u32, f32)>>>,
}

/// Device memory holding one or more step matrices copied out together (a step's captured layers), and its host
/// copy, read back whole on the first read of any of them. Dropped, its memory goes back to the model's pool.
struct OutputBlock {
    /// Always Some until the drop hands it to the pool.
    data: Option<CudaSlice<f32>>,
    len: usize,
    host: Mutex<Option<Vec<f32>>>,
    pool: Arc<OutputPool>,
}

impl OutputBlock {
    fn data(&self) -> &CudaSlice<f32> {
        self.data
            .as_ref()
            .expect("an output block's memory leaves only when it drops")
    }
}

impl Drop for OutputBlock {
    fn drop(&mut self) {
        if let Some(data) = self.data.take() {
            self.pool.give(data);
        }
    }
}

/// Free output blocks. Everything on the model's stream runs in order, so a block handed back after its last
/// read (the views read synchronously) can take the next step's copy at once.
#[derive(Default)]
struct OutputPool(Mutex<Vec<CudaSlice<f32>>>);

/// Whether dropped output blocks are kept for reuse (default; `SPECULA_CUDA_OUTPUT_POOL=0` allocates and frees
/// a block every step, as before the pool, to compare).
fn output_pool_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_OUTPUT_POOL").map_or(true, |v| v != "0"))
}

/// Blocks the pool keeps (a step's logits and captured rows, a few steps' worth in flight).
const OUTPUT_POOL_BLOCKS: usize = 16;

impl OutputPool {
    /// A free block of at least `len` elements and at most twice that (so small steps do not pin big blocks).
    fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        if !output_pool_enabled() {
            return None;
        }
        let mut free = self.0.lock().ok()?;
        let want = len.max(1);
        let i = free
            .iter()
            .position(|d| d.len() >= want && d.len() <= 2 * want)?;
        Some(free.swap_remove(i))
    }

    fn give(&self, data: CudaSlice<f32>) {
        if !output_pool_enabled() {
            return;
        }
        if let Ok(mut free) = self.0.lock() {
            if free.len() >= OUTPUT_POOL_BLOCKS {
                free.remove(0);
            }
            free.push(data);
        }
    }
}

/// Matrices at most this wide come back to the host whole on the first read of any view (hidden states: 6 KB a
/// row); wider ones (logits: 600 KB a row) row by row.
const HOST_COPY_MAX_COLS: usize = 16384;

/// The value in `cell`, computed by `compute` on the first ask (every row of a step's matrix at once: each
/// sequence's view asks for its own rows).
fn computed_once<T: Clone>(
    cell: &Mutex<Option<T>>,
    compute: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let mut cached = cell
        .lock()
        .map_err(|_| Error::Cuda("a step output's lock is poisoned".into()))?;
    if cached.is_none() {
        *cached = Some(compute()?);
    }
    cached
        .clone()
        .ok_or_else(|| Error::Cuda("a step output's value went missing".into()))
}

impl StepMatrix {
    fn argmax(&self) -> Result<Vec<u32>> {
        computed_once(&self.argmax, || {
            device_argmax(&self.gpu, self.device_ptr(), self.rows, self.cols)
        })
    }

    fn top_tokens(&self) -> Result<Vec<(u32, f32)>> {
        computed_once(&self.top, || {
            device_top_tokens(&self.gpu, self.device_ptr(), self.rows, self.cols)
        })
    }

    /// Runs `f` on the whole matrix on the host (its block read back on first use).
    fn with_host<T>(&self, f: impl FnOnce(&[f32]) -> T) -> Result<T> {
        let block = &*self.block;
        let mut cached = block
            .host
            .lock()
            .map_err(|_| Error::Cuda("a step output's lock is poisoned".into()))?;
        if cached.is_none() {
            *cached = Some(
                self.gpu
                    .stream
                    .clone_dtoh(&block.data().slice(0..block.len))
                    .map_err(|e| cuda_err("reading a step's outputs", e))?,
            );
        }
        let host = cached.as_deref().unwrap_or_default();
        Ok(f(host
            .get(self.offset..self.offset + self.rows * self.cols)
            .unwrap_or_default()))
    }

    /// The device address of the matrix's first element.
    fn device_ptr(&self) -> u64 {
        ptr(self.block.data(), &self.gpu) + (4 * self.offset) as u64
    }

    /// Elements `range` of the matrix, as a slice of its block.
    fn slice(&self, range: std::ops::Range<usize>) -> cudarc::driver::CudaView<'_, f32> {
        self.block
            .data()
            .slice(self.offset + range.start..self.offset + range.end)
    }
}

/// Rows `from..from + rows` of a step's output matrix.
pub struct DeviceRows {
    all: Arc<StepMatrix>,
    from: usize,
    rows: usize,
}

impl DeviceRows {
    fn view(all: &Arc<StepMatrix>, from: usize, rows: usize) -> Self {
        DeviceRows {
            all: all.clone(),
            from,
            rows,
        }
    }

    fn range(&self) -> std::ops::Range<usize> {
        let cols = self.all.cols;
        self.from * cols..(self.from + self.rows) * cols
    }
}

/// Each row's largest element (the first on ties) of a `rows x cols` device matrix.
fn device_argmax(gpu: &Arc<Gpu>, data: u64, rows: usize, cols: usize) -> Result<Vec<u32>> {
    if rows == 0 {
        return Ok(Vec::new());
    }
    let gpu = &**gpu;
    let parts = ARGMAX_PARTS;
    // SAFETY: written by the kernels below before they are read.
    let (part_val, part_idx, best) = unsafe {
        (
            gpu.stream.alloc::<f32>(rows * parts),
            gpu.stream.alloc::<u32>(rows * parts),
            gpu.stream.alloc::<u32>(rows),
        )
    };
    let map = |e| cuda_err("allocating argmax", e);
    let (part_val, part_idx, best) = (
        part_val.map_err(map)?,
        part_idx.map_err(map)?,
        best.map_err(map)?,
    );
    launch!(
        gpu,
        argmax_partial,
        (rows as u32, parts as u32, 1),
        256,
        data,
        ptr(&part_val, gpu),
        ptr(&part_idx, gpu),
        cols as i32
    );
    launch!(
        gpu,
        argmax_final,
        (rows as u32, 1, 1),
        parts as u32,
        ptr(&part_val, gpu),
        ptr(&part_idx, gpu),
        ptr(&best, gpu)
    );
    gpu.stream
        .clone_dtoh(&best)
        .map_err(|e| cuda_err("reading argmax", e))
}

/// Each row's top token and its softmax probability (kernels.cu top_token), computed on the device: 8 bytes a
/// row come back.
fn device_top_tokens(
    gpu: &Arc<Gpu>,
    data: u64,
    rows: usize,
    cols: usize,
) -> Result<Vec<(u32, f32)>> {
    if rows == 0 {
        return Ok(Vec::new());
    }
    let gpu = &**gpu;
    // SAFETY: written by the kernel below before it is read.
    let out = unsafe { gpu.stream.alloc::<f32>(2 * rows) }
        .map_err(|e| cuda_err("allocating top tokens", e))?;
    launch!(
        gpu,
        top_token,
        (rows as u32, 1, 1),
        TOP_TOKEN_THREADS,
        data,
        ptr(&out, gpu),
        cols as i32,
        0i32,
        0u64,
        0u64,
        0u64,
        0u32,
        0u64,
        0i32,
        0i32,
        0i32
    );
    let host = gpu
        .stream
        .clone_dtoh(&out)
        .map_err(|e| cuda_err("reading top tokens", e))?;
    Ok(host
        .chunks_exact(2)
        .map(|pair| (pair[0].to_bits(), pair[1]))
        .collect())
}

impl RowMatrix for DeviceRows {
    fn rows(&self) -> usize {
        self.rows
    }

    fn top_tokens(&self) -> Result<Vec<(u32, f32)>> {
        if self.rows == 0 {
            return Ok(Vec::new());
        }
        Ok(self.all.top_tokens()?[self.from..self.from + self.rows].to_vec())
    }

    fn cols(&self) -> usize {
        self.all.cols
    }

    fn argmax_rows(&self) -> Result<Vec<u32>> {
        if self.rows == 0 {
            return Ok(Vec::new());
        }
        Ok(self.all.argmax()?[self.from..self.from + self.rows].to_vec())
    }

    fn row(&self, i: usize) -> Result<Cow<'_, [f32]>> {
        if i >= self.rows {
            return Err(Error::InvalidArgument(format!(
                "row {i} of a {}-row matrix",
                self.rows
            )));
        }
        let cols = self.all.cols;
        let r = self.from + i;
        if cols <= HOST_COPY_MAX_COLS {
            return Ok(Cow::Owned(
                self.all
                    .with_host(|m| m[r * cols..(r + 1) * cols].to_vec())?,
            ));
        }
        let view = self.all.slice(r * cols..(r + 1) * cols);
        let host = self
            .all
            .gpu
            .stream
            .clone_dtoh(&view)
            .map_err(|e| cuda_err("reading a row", e))?;
        Ok(Cow::Owned(host))
    }

    fn to_host(&self) -> Result<Cow<'_, [f32]>> {
        if self.all.cols <= HOST_COPY_MAX_COLS {
            let range = self.range();
            return Ok(Cow::Owned(self.all.with_host(|m| m[range].to_vec())?));
        }
        let host = self
            .all
            .gpu
            .stream
            .clone_dtoh(&self.all.slice(self.range()))
            .map_err(|e| cuda_err("reading a matrix", e))?;
        Ok(Cow::Owned(host))
    }

    fn share(&self) -> Option<Box<dyn RowMatrix>> {
        Some(Box::new(DeviceRows::view(&self.all, self.from, self.rows)))
    }

    fn device_address(&self) -> Option<u64> {
        Some(self.all.device_ptr() + (4 * self.from * self.all.cols) as u64)
    }

    fn gather_columns(&self, cols: &[u32]) -> Result<Vec<f32>> {
        crate::model::forward::check_columns(self.all.cols, cols)?;
        if self.rows == 0 || cols.is_empty() {
            return Ok(Vec::new());
        }
        let gpu = &self.all.gpu;
        let index = gpu
            .stream
            .clone_htod(cols)
            .map_err(|e| cuda_err("uploading column indices", e))?;
        // SAFETY: every element is written by gather_columns below before it is read.
        let out = unsafe { gpu.stream.alloc::<f32>(self.rows * cols.len()) }
            .map_err(|e| cuda_err("allocating gathered columns", e))?;
        let blocks = cols.len().div_ceil(256).min(1024) as u32;
        launch!(
            gpu,
            gather_columns,
            (blocks, self.rows as u32, 1),
            256,
            self.all.device_ptr() + (4 * self.from * self.all.cols) as u64,
            ptr(&index, gpu),
            ptr(&out, gpu),
            cols.len() as i32,
            self.all.cols as i32
        );
        gpu.stream
            .clone_dtoh(&out)
            .map_err(|e| cuda_err("reading gathered columns", e))
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

    /// The workspace at the server's largest step, and a captured graph for every row count up to the graphs'
    /// limit (a verify of that many rows, or a plain step of that many sequences: one shape).
    fn time_kernels(
        &self,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Vec<crate::profile::KernelTime>>> {
        self.gpu.time_kernels(work).map(Some)
    }

    fn prepare_steps(&self, shapes: &StepShapes<'_>) -> Result<usize> {
        if !graphs_enabled() {
            return Ok(0);
        }
        // The workspace is sized for the largest step the flags allow, which a full batch would ask for anyway;
        // but its split-K scratch grows with rows x the vocabulary (2.5 GB at the default 512 rows of a
        // 152k-vocabulary model), and `--max-batch 1024` with long drafts would ask for tens of GB at start.
        // Beyond 8 GiB of scratch the workspace grows on demand, as before.
        let c = &self.config;
        let width = (c.q_dim() + 2 * c.kv_dim())
            .max(c.hidden_size)
            .max(c.vocab_size);
        let cap = ((8usize << 30) / (MAX_SPLITS * width * std::mem::size_of::<f32>()))
            .max(MAX_GRAPH_ROWS);
        let shapes = StepShapes {
            max_rows: shapes.max_rows.min(cap),
            max_logit_rows: shapes.max_logit_rows.min(cap),
            ..*shapes
        };
        run_step_shapes(self, &shapes, MAX_GRAPH_ROWS)
    }

    fn forward(
        &self,
        batch: &mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
        _prof: &Profiler,
    ) -> Result<Vec<ForwardOutput>> {
        self.forward_batch(batch, opts)
    }

    /// The embedding rows through the forward pass's own kernel (`embed_rows`), copied to the host: an EAGLE-3
    /// head on the CPU reads them for a GPU target.
    fn embed_tokens(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let c = &self.config;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::InvalidArgument(format!(
                "token {bad} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let gpu = &self.gpu;
        let h = c.hidden_size;
        let ids = gpu
            .stream
            .clone_htod(tokens)
            .map_err(|e| cuda_err("uploading token ids", e))?;
        let out = self.alloc(tokens.len() * h, "embedding rows")?;
        launch!(
            gpu,
            embed_rows,
            (tokens.len() as u32, 1, 1),
            256,
            ptr(&self.embed.data, gpu),
            ptr(&ids, gpu),
            ptr(&out, gpu),
            h as i32,
            self.embed.chunks as i32
        );
        gpu.stream
            .clone_dtoh(&out)
            .map_err(|e| cuda_err("reading embedding rows", e))
    }

    fn weight_bytes(&self) -> usize {
        // Bytes a step streams: the tiles as stored (bf16, or a native format's smaller tiles).
        let m = |w: &Matrix| w.data.len() * 2;
        self.layers
            .iter()
            .map(|l| m(&l.wqkv) + m(&l.wo) + m(&l.w_gate_up) + m(&l.w_down))
            .sum::<usize>()
            + m(self.lm_head.as_ref().unwrap_or(&*self.embed))
    }

    fn weight_types(&self) -> String {
        self.source_types.clone()
    }

    fn place_eagle3_head(
        &self,
        head: &crate::draft::eagle3::Eagle3Head,
    ) -> Result<Option<Box<dyn crate::draft::eagle3::HeadCompute>>> {
        Ok(Some(Box::new(super::CudaHead::new(
            self.gpu.clone(),
            self.embed.clone(),
            head,
        )?)))
    }

    fn clock(&self, exact: bool) -> Box<dyn crate::profile::Clock> {
        Box::new(super::clock::EventClock::new(self.gpu.clone(), exact))
    }

    fn check_kernels(&self, _tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        // The forward pass is checked against the CPU backend as a whole (`specula selftest --device cuda`); here
        // the GEMM tile against the GEMV on this model's own matrices, and native (Q4_K, Q6_K) matrices against their
        // bf16 copies: the same bits for every row, or batch invariance (and greedy losslessness) would depend on
        // how many rows a pass has, or outputs on the weight format.
        let mut checks = self.check_gemm_tile()?;
        checks.extend(self.check_native_q4k()?);
        checks.extend(self.check_attention_list(_tokens)?);
        checks.extend(self.check_attention_group(_tokens)?);
        Ok(checks)
    }
}

impl CudaModel {
    /// `m` rows of check activations (a wide spread of magnitudes: the hi/lo split matters for them) through
    /// each `(matrix, path)` GEMV of `n` outputs, from the same starting outputs; each result as f32 (SiLU
    /// outputs come split, the down projection's input: compared as words).
    #[allow(clippy::too_many_arguments)]
    fn check_gemv_outputs(
        &self,
        runs: &[(&Matrix, super::ops::GemvPath)],
        n: usize,
        m: usize,
        accumulate: bool,
        silu: bool,
    ) -> Result<Vec<Vec<f32>>> {
        use super::ops::{gemv_with, split_rows};
        let gpu = &self.gpu;
        let k = runs[0].0.cols;
        let out_n = if silu { n / 2 } else { n };
        let x: Vec<f32> = (0..m * k)
            .map(|i| {
                let h = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                ((h as f32 / (1u64 << 24) as f32) - 0.5) * (1.0 + (i % 7) as f32)
            })
            .collect();
        let start: Vec<f32> = (0..m * out_n).map(|i| (i % 13) as f32 * 0.25).collect();
        let xd = gpu
            .stream
            .clone_htod(&x)
            .map_err(|e| cuda_err("uploading check activations", e))?;
        let xs = alloc_split(gpu, m, k, "check activations")?;
        split_rows(gpu, ptr(&xd, gpu), ptr(&xs, gpu), m, k)?;
        let scratch = self.alloc(MAX_SPLITS * m * n, "check scratch")?;
        let mut results = Vec::new();
        for &(w, path) in runs {
            let y = if silu {
                alloc_split(gpu, m, out_n, "check outputs")?
            } else {
                let bits: Vec<u32> = start.iter().map(|v| v.to_bits()).collect();
                gpu.stream
                    .clone_htod(&bits)
                    .map_err(|e| cuda_err("uploading check outputs", e))?
            };
            gemv_with(
                gpu,
                w,
                n,
                ptr(&xs, gpu),
                ptr(&y, gpu),
                m,
                accumulate,
                silu,
                ptr(&scratch, gpu),
                false,
                path,
            )?;
            let words = gpu
                .stream
                .clone_dtoh(&y)
                .map_err(|e| cuda_err("reading check outputs", e))?;
            results.push(words.into_iter().map(f32::from_bits).collect::<Vec<_>>());
        }
        Ok(results)
    }

    /// Logits of the attention checks' steps (below) with `switch(false)`, then `switch(true)`, in force; None
    /// where the tokens or the context leave no room.
    fn attention_both_ways(
        &self,
        tokens: &[u32],
        switch: &dyn Fn(bool),
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        if tokens.is_empty() {
            return Ok(None);
        }
        let vocab = self.config.vocab_size as u32;
        // 200 tokens where the context allows (and room for the steps after).
        let long_len = 200.min(self.config.context_length.saturating_sub(8));
        let long: Vec<u32> = tokens.iter().copied().cycle().take(long_len).collect();
        let short = &tokens[..tokens.len().min(12).min(long_len)];
        if long.is_empty() || short.is_empty() {
            return Ok(None);
        }
        let next: Vec<u32> = (0..5u32).map(|i| (i * 7919 + 3) % vocab).collect();
        let opts = ForwardOptions::default();
        let run = |on: bool| -> Result<Vec<f32>> {
            switch(on);
            let capacity = long.len() + next.len() + 1;
            let (mut a, mut b) = (self.new_cache(capacity)?, self.new_cache(capacity)?);
            let mut values = Vec::new();
            let steps: [(&[u32], &[u32]); 3] = [
                (&long, short),
                (&next, &next[..3]),
                (&next[..1], &next[..1]),
            ];
            for (i, (ta, tb)) in steps.into_iter().enumerate() {
                // The first step's rows are a prompt (more than the list takes: the grid in both runs at 200
                // tokens); then verify-shaped steps.
                let logits = if i == 0 {
                    LogitsFor::Last
                } else {
                    LogitsFor::All
                };
                let mut batch = [
                    SequenceInput {
                        tokens: ta,
                        cache: a.as_mut(),
                        logits,
                        tree: None,
                    },
                    SequenceInput {
                        tokens: tb,
                        cache: b.as_mut(),
                        logits,
                        tree: None,
                    },
                ];
                for out in self.forward_batch(&mut batch, &opts)? {
                    for r in 0..out.logits.rows() {
                        values.extend_from_slice(&out.logits.row(r)?);
                    }
                }
            }
            Ok(values)
        };
        let off = run(false);
        let on = run(true);
        Ok(Some((off?, on?)))
    }

    /// Attention taken as a list of items (decode and verify steps, kernels.cu attention_list) against the grid
    /// of rows x heads x splits: two sequences, one after a 200-token prompt (several splits a row; shorter in a
    /// short context), one after a short one, then verify-shaped steps of 5 and 3 rows; every logit the same
    /// bits.
    fn check_attention_list(&self, tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        let runs = self.attention_both_ways(tokens, &|list| ops::set_attention_list(Some(list)));
        ops::set_attention_list(None);
        let Some((grid, list)) = runs? else {
            return Ok(Vec::new());
        };
        Ok(vec![Self::bitwise_check(
            format!(
                "attention as a list = as a grid bitwise, 2 sequences, {} logits",
                list.len()
            ),
            "f32",
            &grid,
            &list,
        )])
    }

    /// Heads that share a KV head taken several a block (kernels.cu attention_item's G) against one a block, the
    /// same steps, as a grid and as a list: every logit the same bits. Nothing to compare where the model's
    /// heads do not group (ops::attention_variant).
    fn check_attention_group(&self, tokens: &[u32]) -> Result<Vec<KernelCheck>> {
        let c = &self.config;
        ops::set_attention_group(Some(true));
        let (_, group) = ops::attention_variant(c.num_heads, c.num_kv_heads, c.head_dim, 1);
        ops::set_attention_group(None);
        if group == 1 {
            return Ok(Vec::new());
        }
        let mut checks = Vec::new();
        for list in [false, true] {
            ops::set_attention_list(Some(list));
            let runs = self.attention_both_ways(tokens, &|g| ops::set_attention_group(Some(g)));
            ops::set_attention_group(None);
            ops::set_attention_list(None);
            let Some((one, grouped)) = runs? else {
                return Ok(Vec::new());
            };
            checks.push(Self::bitwise_check(
                format!(
                    "attention {group} heads a block = one a block bitwise ({}), 2 sequences, {} logits",
                    if list { "list" } else { "grid" },
                    grouped.len()
                ),
                "f32",
                &one,
                &grouped,
            ));
        }
        Ok(checks)
    }

    /// A bitwise comparison of two results as a check (any differing value fails, however small).
    fn bitwise_check(name: String, dtype: &'static str, a: &[f32], b: &[f32]) -> KernelCheck {
        let largest = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let differ = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let error = if differ == 0 && a.len() == b.len() {
            0.0
        } else {
            f64::from(worst / largest).max(f64::MIN_POSITIVE)
        };
        KernelCheck {
            name: format!("{name} ({differ} values differ)"),
            dtype,
            max_relative_error: error,
            tolerance: 0.0,
        }
    }

    /// The matrices of layer 0 (and the LM head) the forward pass multiplies, with the mode each runs in:
    /// (check name, matrix, outputs, accumulate, silu_pairs).
    fn check_cases(&self) -> Vec<(&'static str, &Matrix, usize, bool, bool)> {
        let layer = &self.layers[0];
        let lm_head = self.lm_head.as_ref().unwrap_or(&*self.embed);
        vec![
            ("QKV", &layer.wqkv, layer.wqkv.rows, false, false),
            ("attention output", &layer.wo, layer.wo.rows, true, false),
            (
                "gate/up",
                &layer.w_gate_up,
                layer.w_gate_up.rows,
                false,
                true,
            ),
            ("down", &layer.w_down, layer.w_down.rows, false, false),
            ("LM head", lm_head, self.config.vocab_size, false, false),
        ]
    }

    fn check_gemm_tile(&self) -> Result<Vec<KernelCheck>> {
        use super::ops::GemvPath;
        let mut checks = Vec::new();
        for m in [17usize, 40, 64, 100] {
            for (name, w, n, accumulate, silu) in self.check_cases() {
                // The GEMM tile reads bf16 tiles only (native matrices are checked against their bf16 copies).
                if w.format != WeightFormat::Bf16 {
                    continue;
                }
                let r = self.check_gemv_outputs(
                    &[
                        (w, GemvPath::Gemv),
                        (w, GemvPath::Gemm),
                        (w, GemvPath::GemmStaged),
                    ],
                    n,
                    m,
                    accumulate,
                    silu,
                )?;
                let out_n = if silu { n / 2 } else { n };
                for (tile, out) in [("GEMM tile", &r[1]), ("staged GEMM tile", &r[2])] {
                    checks.push(Self::bitwise_check(
                        format!("{tile} = GEMV bitwise, {name} {out_n}x{}, {m} rows", w.cols),
                        "bf16",
                        &r[0],
                        out,
                    ));
                }
            }
        }
        Ok(checks)
    }

    /// Native (Q4_K, Q6_K) matrices of layer 0 and the LM head against the same weights as bf16, through every
    /// GEMV variant (1-8, 16 and 32+ tokens): the same bits.
    fn check_native_q4k(&self) -> Result<Vec<KernelCheck>> {
        use super::ops::GemvPath;
        let mut checks = Vec::new();
        for (name, w, n, accumulate, silu) in self.check_cases() {
            if w.format == WeightFormat::Bf16 {
                continue;
            }
            // A tied LM head's bf16 copy is the embedding.
            let tied =
                (name == "LM head" && self.config.tie_word_embeddings).then_some(&*self.embed);
            let Some(bf16) = self
                .layer0_bf16
                .iter()
                .find(|(what, _)| *what == name)
                .map(|(_, m)| m)
                .or(tied)
            else {
                return Err(Error::Cuda(format!(
                    "no bf16 copy of layer 0's native {name} matrix to check it against"
                )));
            };
            // The GEMV's variants, then the staged GEMM tile, which expands the same tiles from shared memory
            // (mixed matrices stay on the GEMV).
            let staged = matches!(w.format, WeightFormat::Q4k | WeightFormat::ScaledI8);
            let runs: [(GemvPath, &str, &[usize]); 2] = [
                (GemvPath::Gemv, "", &[1, 5, 13, 40]),
                (
                    GemvPath::GemmStaged,
                    "staged GEMM tile, ",
                    if staged { &[17, 40, 100] } else { &[] },
                ),
            ];
            for (path, kernel, rows) in runs {
                for &m in rows {
                    let r = self.check_gemv_outputs(
                        &[(w, path), (bf16, GemvPath::Gemv)],
                        n,
                        m,
                        accumulate,
                        silu,
                    )?;
                    let out_n = if silu { n / 2 } else { n };
                    checks.push(Self::bitwise_check(
                        format!(
                            "{kernel}native {} = bf16 bitwise, {name} {out_n}x{}, {m} rows",
                            w.format.name(),
                            w.cols
                        ),
                        w.format.name(),
                        &r[0],
                        &r[1],
                    ));
                }
            }
        }
        Ok(checks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::weights::Weight;

    fn quantized(rows: usize, cols: usize, ty: GgmlType, seed: usize) -> Vec<u8> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (((i + seed) * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        Weight::quantize(&v, rows, cols, ty).unwrap().raw_bytes()
    }

    /// Q, K and V of one native type stack natively; of mixed types as parts (neighbours of one type merged)
    /// when the inner parts are whole row blocks; otherwise as bf16, each part dequantized as the bf16 path does.
    #[test]
    fn mixed_types_stack_as_parts_when_row_blocks_allow() {
        let cols = 256;
        let q = quantized(32, cols, GgmlType::Q4K, 1);
        let k = quantized(16, cols, GgmlType::Q4K, 2);
        let v = quantized(16, cols, GgmlType::Q6K, 3);
        let native = |ty, b: &Vec<u8>| HostMatrix::Native(ty, b.clone());
        let stacked = stack_parts(
            vec![
                (native(GgmlType::Q4K, &q), 32),
                (native(GgmlType::Q4K, &k), 16),
                (native(GgmlType::Q6K, &v), 16),
            ],
            cols,
        )
        .unwrap();
        let HostMatrix::Parts(parts) = &stacked else {
            panic!("Q4_K, Q4_K, Q6_K stack as parts");
        };
        assert_eq!(parts.len(), 2, "Q and K merge into one Q4_K part");
        match &parts[0] {
            (HostMatrix::Native(GgmlType::Q4K, b), 48) => assert_eq!(*b, [q.clone(), k].concat()),
            _ => panic!("the first part is Q and K as one Q4_K part of 48 rows"),
        }
        assert!(matches!(
            parts[1],
            (HostMatrix::Native(GgmlType::Q6K, _), 16)
        ));
        // Its bf16 values are each part's, in order.
        let mut want = native(GgmlType::Q4K, &q).into_bf16(32, cols).unwrap();
        want.extend(
            native(GgmlType::Q4K, &quantized(16, cols, GgmlType::Q4K, 2))
                .into_bf16(16, cols)
                .unwrap(),
        );
        want.extend(native(GgmlType::Q6K, &v).into_bf16(16, cols).unwrap());
        assert_eq!(stacked.into_bf16(64, cols).unwrap(), want);
        // A bf16 part with no native neighbour stays a part of its own; four parts are too many.
        let four = stack_parts(
            vec![
                (native(GgmlType::Q4K, &q), 32),
                (HostMatrix::Bf16(vec![0x3f80; 16 * cols]), 16),
                (native(GgmlType::Q6K, &v), 16),
                (native(GgmlType::Q4K, &q), 32),
            ],
            cols,
        )
        .unwrap();
        assert!(
            matches!(four, HostMatrix::Bf16(_)),
            "four parts fall back to bf16"
        );
    }

    /// Parts whose inner row counts are not whole row blocks stack as bf16, each part dequantized as the bf16
    /// path does.
    #[test]
    fn stacked_parts_stay_native_only_when_they_share_a_type() {
        let (cols, rows) = (256, 4);
        let q = quantized(rows, cols, GgmlType::Q4K, 1);
        let k = quantized(rows, cols, GgmlType::Q4K, 2);
        let v6 = quantized(rows, cols, GgmlType::Q6K, 3);
        let native = |ty, b: &Vec<u8>| HostMatrix::Native(ty, b.clone());
        match stack_parts(
            vec![
                (native(GgmlType::Q4K, &q), rows),
                (native(GgmlType::Q4K, &k), rows),
            ],
            cols,
        )
        .unwrap()
        {
            HostMatrix::Native(GgmlType::Q4K, bytes) => {
                assert_eq!(bytes, [q.clone(), k.clone()].concat())
            }
            _ => panic!("two Q4_K parts stack as Q4_K"),
        }
        let mixed = stack_parts(
            vec![
                (native(GgmlType::Q4K, &q), rows),
                (native(GgmlType::Q6K, &v6), rows),
                (HostMatrix::Bf16(vec![0x3f80; rows * cols]), rows),
            ],
            cols,
        )
        .unwrap();
        let HostMatrix::Bf16(values) = mixed else {
            panic!("mixed parts stack as bf16");
        };
        let mut want = native(GgmlType::Q4K, &q).into_bf16(rows, cols).unwrap();
        want.extend(native(GgmlType::Q6K, &v6).into_bf16(rows, cols).unwrap());
        want.extend(vec![0x3f80; rows * cols]);
        assert_eq!(values, want);
        // The dequantized values are the host path's (what `to_bf16` uploads).
        let host: Vec<u16> = Weight::from_raw(GgmlType::Q6K, &v6, rows, cols)
            .unwrap()
            .to_f32()
            .into_iter()
            .map(|x| half::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(values[rows * cols..2 * rows * cols], host[..]);
        assert_eq!(native_block(GgmlType::Q5_1), None);
    }
}
