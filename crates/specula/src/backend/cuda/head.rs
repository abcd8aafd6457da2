//! An EAGLE-3 head on the GPU, next to its target (draft/eagle3/head.rs has the formula and the CPU version).
//!
//! The head's decoder layer runs on the target's kernels: its Q/K/V projections read 2h inputs
//! ([input_layernorm(embed), hidden_norm(x)]), which here are two GEMVs into the same output (the embedding half,
//! then the hidden half added), so no kernel needs a concatenated row; the residual stream starts at x instead of
//! the embedding. The head embeds tokens from the target's embedding on the device and keeps its last output there
//! (`HeadInput::Last`), so a chain step uploads one token id and reads back only the draft-vocabulary logits.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

use super::layout::{self, MAX_SPLITS};
use super::model::{native_block, native_quant, HostMatrix};
use super::ops::{self, alloc_split, gemv, ptr, split_rows, AttentionSplits, Matrix};
use super::padding::{all_padded_shapes, padded_shape, wanted_rows};
use super::{cuda_err, CudaKvCache, Gpu};
use crate::backend::cpu::weights::Weight;
use crate::draft::eagle3::compute::{
    check_pass, pass_groups, run_one_by_one, top_log_probs, Chains,
};
use crate::draft::eagle3::{
    Eagle3Head, HeadCompute, HeadInput, HeadOutput, HeadPass, HeadRows, HeadWant,
};
use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::forward::SequenceCache;
use crate::model::Model;

/// Rows a head pass runs at once (longer feeds, e.g. a prompt's features, go in pieces): bounds the workspace.
const CHUNK_ROWS: usize = 64;

/// Passes of at most this many rows run as CUDA graphs: every pass (chain steps, fed rows after a verify, tree
/// levels, a catch-up, a prompt's features in pieces). Up to session 30 only passes of 8 rows or fewer did, so a
/// server's batched round of more than 8 rows and every catch-up launched kernel by kernel (the real head server
/// on an H200 at 4 streams: 2565 / 2772 tok/s before, 2765 / 2811 with every pass graphed; plain 2785 / 2796).
const MAX_GRAPH_ROWS: usize = CHUNK_ROWS;

/// Captured passes kept at most (shapes: padded rows, wanted rows, inputs, results; a server prepares 140 and
/// meets trees' top-k ones on demand), cleared whole when full; `SPECULA_CUDA_HEAD_GRAPHS_MAX=N` sets it (a server whose `specula:eagle3_head_graph_captures` keeps rising
/// under a steady load is capturing evicted shapes again).
fn max_pass_graphs() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("SPECULA_CUDA_HEAD_GRAPHS_MAX")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or(512)
    })
}

/// The most best tokens a row's top-k is taken on the device for (kernels.cu top_k_log_probs; trees expand a
/// node by its top-k); larger k reads the row's logits back and ranks them on the host.
const MAX_DEVICE_TOP_K: usize = 16;

/// Where each table lives in the pass's one upload of u32 words (kernels.cu layouts).
mod words {
    use super::CHUNK_ROWS as R;
    pub const TOKENS: usize = 0;
    pub const POSITIONS: usize = R;
    /// RowInfo, 6 words a row (8-byte aligned: its mask is a u64).
    pub const ROWS: usize = 2 * R;
    pub const WANTED: usize = 8 * R;
    /// SeqCache of each sequence's head cache, 4 words each (a batched pass has up to R sequences).
    pub const SEQ: usize = 9 * R;
    /// Device features: each row's captured layers' addresses (u64 as two words, low first; 0: the row came from
    /// the host), MAX_FEATURE_LAYERS a row (kernels.cu gather_feature_rows).
    pub const FEATURE_SRC: usize = 13 * R;
    /// A batched pass's per-sequence row copies (kernels.cu copy_rows_by_address: source and destination
    /// addresses, u64s as two words each): each sequence's last output into its row, then its last row kept.
    pub const COPY_IN: usize = FEATURE_SRC + 2 * super::MAX_FEATURE_LAYERS * R;
    pub const COPY_OUT: usize = COPY_IN + 4 * R;
    pub const TOTAL: usize = COPY_OUT + 4 * R;
}

// kernels.cu chain_next writes the fed token at word 0.
const _: () = assert!(words::TOKENS == 0);

/// Captured layers a device feature row may come from (an EAGLE-3 head reads 3).
const MAX_FEATURE_LAYERS: usize = 4;

/// The most passes after the first a greedy chain runs on the device in one go (`run_greedy_chain`; longer
/// chains go pass by pass).
const MAX_CHAIN_MORE: usize = 31;

/// What a captured pass depends on besides the uploaded values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PassShape {
    rows: usize,
    features: bool,
    /// Some feature rows are gathered from the target's outputs on the device (the others uploaded).
    gather: bool,
    wanted: usize,
    top_only: bool,
    /// Each wanted row's best `top_k` with log-probabilities on the device (0: none).
    top_k: usize,
    /// The pass wants every one of its real rows (chain steps, trees, a round of one-row passes): the final norm
    /// then completes the rows (`record_pass`'s `defer_down`). A padded pass may gather all its rows without.
    all_wanted: bool,
}

/// A captured pass; used only under the workspace lock.
struct PassGraph(cudarc::driver::CudaGraph);
// SAFETY: only used under the workspace lock.
unsafe impl Send for PassGraph {}

pub struct CudaHead {
    gpu: Arc<Gpu>,
    layer: Config,
    target_hidden: usize,
    draft_vocab: usize,
    /// The target's embedding (shared with it), or the head's own.
    embed: Arc<Matrix>,
    fc: Matrix,
    input_norm: CudaSlice<f32>,
    hidden_norm: CudaSlice<f32>,
    post_attention_norm: CudaSlice<f32>,
    final_norm: CudaSlice<f32>,
    /// Q, K and V stacked, the columns that read the normed embedding.
    wqkv_embed: Matrix,
    /// The same rows, the columns that read the normed hidden input.
    wqkv_hidden: Matrix,
    /// Both halves as one matrix of 2h columns, for one QKV GEMV a pass ([`one_qkv_enabled`]).
    wqkv: Option<Matrix>,
    wo: Matrix,
    /// Gate and up stacked for the GEMV that ends in SiLU(gate) * up (layout::stack_gate_up).
    w_gate_up: Matrix,
    w_down: Matrix,
    lm_head: Matrix,
    /// Each draft id's target id (the head's d2t applied), for chains that feed their top tokens on the device.
    draft_to_target: CudaSlice<u32>,
    rope_inv_freqs: CudaSlice<f32>,
    workspace: Mutex<Buffers>,
    /// Passes captured as CUDA graphs so far (`HeadCompute::graphs_captured`).
    captured: std::sync::atomic::AtomicU64,
}

/// Device buffers every pass reuses (fixed addresses, so captured passes stay valid), sized for CHUNK_ROWS rows.
struct Buffers {
    graphs: std::collections::HashMap<PassShape, PassGraph>,
    /// Captured greedy chains by their passes after the first (`run_greedy_chain`).
    chains: std::collections::HashMap<usize, PassGraph>,
    /// A device chain's top (token bits, probability) of each pass (kernels.cu chain_next).
    chain_tops: CudaSlice<f32>,
    /// Several sequences' device chains: step t's top of sequence s at 2 (t n + s) (kernels.cu chain_next_rows).
    round_tops: CudaSlice<f32>,
    features: CudaSlice<f32>,
    /// GEMV inputs, split (ops::alloc_split): the features for fc, the two normed inputs of the layer, attention's
    /// output, the normed residual, SiLU(gate) * up, the normed rows for the LM head.
    features_split: CudaSlice<u32>,
    x: CudaSlice<f32>,
    embeds: CudaSlice<f32>,
    normed_embeds: CudaSlice<u32>,
    normed_x: CudaSlice<u32>,
    /// Both normed inputs as one split row of 2h ([`one_qkv_enabled`]).
    normed_inputs: CudaSlice<u32>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    attn: CudaSlice<u32>,
    normed: CudaSlice<u32>,
    act: CudaSlice<u32>,
    scratch: CudaSlice<f32>,
    angles: CudaSlice<f32>,
    picked: CudaSlice<f32>,
    picked_normed: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    attention: AttentionSplits,
    /// Each wanted row's top draft token and probability (kernels.cu top_token), or its best draft tokens and
    /// log-probabilities (top_k_log_probs).
    top: CudaSlice<f32>,
    /// The pass's tables (`words`).
    ints: CudaSlice<u32>,
    /// Keys and values of a pass's padding rows (`padding`): a scratch sequence of a chunk's slots, so padding
    /// never touches a real sequence's cache.
    pad_kv: CudaKvCache,
}

/// The head's cache on the GPU: its one layer's keys and values, and its last output row.
pub struct CudaHeadCache {
    kv: CudaKvCache,
    last: CudaSlice<f32>,
    has_last: bool,
}

impl SequenceCache for CudaHeadCache {
    fn len(&self) -> usize {
        self.kv.len()
    }

    fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    fn truncate(&mut self, len: usize) {
        self.kv.truncate(len);
    }

    fn keep_new_rows(&mut self, base: usize, rows: &[usize]) -> Result<()> {
        self.kv.keep_new_rows(base, rows)
    }

    fn copy_prefix_from(&mut self, src: &dyn SequenceCache, n: usize) -> Result<()> {
        let src = src
            .as_any()
            .downcast_ref::<CudaHeadCache>()
            .ok_or_else(|| {
                Error::InvalidArgument(
                    "a GPU head cache can take positions only from another GPU head cache".into(),
                )
            })?;
        self.kv.copy_prefix_from(&src.kv, n)?;
        // The next pass feeds target features (no chain continues from an earlier output).
        self.has_last = false;
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

fn bf16(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// Columns `from..from + width` of a row-major `rows x cols` matrix.
/// A head matrix as the GEMV will read it: GGUF bytes when the head holds it in a type with a native GPU format
/// (and native GEMVs are on), else bf16 values.
fn host_matrix(w: &Weight) -> HostMatrix {
    let ty = w.dtype();
    if native_quant() && native_block(ty).is_some_and(|b| w.cols.is_multiple_of(b)) {
        HostMatrix::Native(ty, w.raw_bytes())
    } else {
        HostMatrix::Bf16(bf16(&w.to_f32()))
    }
}

/// Parts (each `(matrix, rows)`, `cols` wide) stacked by rows: native when all are of one native type, else bf16.
fn stack_rows(parts: Vec<(HostMatrix, usize)>, cols: usize) -> Result<HostMatrix> {
    let first_type = match parts.first() {
        Some((HostMatrix::Native(ty, _), _)) => Some(*ty),
        _ => None,
    };
    let one_type = first_type.filter(|ty| {
        parts
            .iter()
            .all(|(p, _)| matches!(p, HostMatrix::Native(t, _) if t == ty))
    });
    let mut out = Vec::new();
    if let Some(ty) = one_type {
        for (p, _) in parts {
            if let HostMatrix::Native(_, b) = p {
                out.extend_from_slice(&b);
            }
        }
        return Ok(HostMatrix::Native(ty, out));
    }
    let mut values = Vec::new();
    for (p, rows) in parts {
        values.extend(p.into_bf16(rows, cols)?);
    }
    Ok(HostMatrix::Bf16(values))
}

/// Columns `0..at` and `at..cols` of a `rows x cols` matrix as two matrices. A native one splits its rows' bytes
/// where `at` falls between blocks; elsewhere both halves are bf16.
fn split_columns(
    m: &HostMatrix,
    rows: usize,
    cols: usize,
    at: usize,
) -> Result<(HostMatrix, HostMatrix)> {
    if let HostMatrix::Native(ty, bytes) = m {
        if let (Some(left), Some(row)) = (ty.bytes_for(at), ty.bytes_for(cols)) {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for r in bytes.chunks_exact(row) {
                a.extend_from_slice(&r[..left]);
                b.extend_from_slice(&r[left..]);
            }
            return Ok((HostMatrix::Native(*ty, a), HostMatrix::Native(*ty, b)));
        }
    }
    let values = m.clone().into_bf16(rows, cols)?;
    let half = |from: usize, width: usize| -> Vec<u16> {
        values
            .chunks_exact(cols)
            .flat_map(|row| row[from..from + width].iter().copied())
            .collect()
    };
    Ok((
        HostMatrix::Bf16(half(0, at)),
        HostMatrix::Bf16(half(at, cols - at)),
    ))
}

impl CudaHead {
    /// Uploads `head` to `gpu`, reading tokens' embeddings from `target_embed` (the target's table) unless the head
    /// has its own. The head must already be checked against its target (`Eagle3Head::check_target`).
    pub(crate) fn new(gpu: Arc<Gpu>, target_embed: Arc<Matrix>, head: &Eagle3Head) -> Result<Self> {
        let hc = &head.config;
        let c = hc.layer.clone();
        super::model::check_shape(&c)?;
        let (h, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        if !(3 * hc.target_hidden).is_multiple_of(8) {
            return Err(Error::Cuda(format!(
                "the EAGLE-3 head's fc reads {} inputs, not a multiple of 8, which the GPU matmul kernel needs",
                3 * hc.target_hidden
            )));
        }
        // Matrices the head holds quantized (SPECULA_EAGLE3_WEIGHTS) in a type the GEMV reads natively stay
        // quantized: fewer bytes a draft step; the others go up as bf16.
        let m = head.matrices();
        let qkv_rows = q_dim + 2 * kv_dim;
        let qkv = stack_rows(
            vec![
                (host_matrix(m.wq), q_dim),
                (host_matrix(m.wk), kv_dim),
                (host_matrix(m.wv), kv_dim),
            ],
            2 * h,
        )?;
        let (qkv_embed, qkv_hidden) = split_columns(&qkv, qkv_rows, 2 * h, h)?;
        let gate_up = HostMatrix::gate_up(host_matrix(m.w_gate), host_matrix(m.w_up), ff, h)?;
        let (fc, wo, w_down, lm_head) = (
            host_matrix(m.fc),
            host_matrix(m.wo),
            host_matrix(m.w_down),
            host_matrix(m.lm_head),
        );
        let needed = fc.device_bytes(h, 3 * hc.target_hidden)
            + qkv_embed.device_bytes(qkv_rows, h)
            + qkv_hidden.device_bytes(qkv_rows, h)
            + if one_qkv_enabled() {
                qkv.device_bytes(qkv_rows, 2 * h)
            } else {
                0
            }
            + wo.device_bytes(h, q_dim)
            + gate_up.device_bytes(2 * ff, h)
            + w_down.device_bytes(h, ff)
            + lm_head.device_bytes(hc.draft_vocab, h);
        let (free, _) = gpu.memory()?;
        if needed > free {
            return Err(Error::Cuda(format!(
                "the EAGLE-3 head needs {:.2} GB of GPU memory, but {} has {:.2} GB free",
                needed as f64 * 1e-9,
                gpu.name,
                free as f64 * 1e-9
            )));
        }
        let w = head.host_weights();
        let upload = |data: &[f32], rows: usize, cols: usize, what: &str| {
            Matrix::upload(&gpu, &bf16(data), rows, cols, what)
        };
        let vector = |data: &[f32], what: &str| {
            gpu.stream
                .clone_htod(data)
                .map_err(|e| cuda_err(&format!("uploading the head's {what}"), e))
        };
        let embed = match &w.embed {
            Some(e) => Arc::new(upload(e, c.vocab_size, h, "the head's embedding")?),
            None => target_embed,
        };
        let rope_inv_freqs = vector(&c.rope_inv_freqs(None), "RoPE frequencies")?;
        let draft_to_target = gpu
            .stream
            .clone_htod(head.draft_to_target())
            .map_err(|e| cuda_err("uploading the head's draft-to-target map", e))?;
        let head = CudaHead {
            draft_to_target,
            embed,
            fc: fc.upload(&gpu, h, 3 * hc.target_hidden, "the head's fc")?,
            input_norm: vector(&w.input_norm, "input norm")?,
            hidden_norm: vector(&w.hidden_norm, "hidden norm")?,
            post_attention_norm: vector(&w.post_attention_norm, "post-attention norm")?,
            final_norm: vector(&w.final_norm, "final norm")?,
            wqkv_embed: qkv_embed.upload(&gpu, qkv_rows, h, "the head's QKV")?,
            wqkv_hidden: qkv_hidden.upload(&gpu, qkv_rows, h, "the head's QKV")?,
            wqkv: if one_qkv_enabled() {
                Some(qkv.upload(&gpu, qkv_rows, 2 * h, "the head's QKV")?)
            } else {
                None
            },
            wo: wo.upload(&gpu, h, q_dim, "the head's output projection")?,
            w_gate_up: gate_up.upload(&gpu, 2 * ff, h, "the head's gate/up")?,
            w_down: w_down.upload(&gpu, h, ff, "the head's down projection")?,
            lm_head: lm_head.upload(&gpu, hc.draft_vocab, h, "the head's LM head")?,
            rope_inv_freqs,
            workspace: Mutex::new(Self::buffers(&gpu, &c, hc.target_hidden, hc.draft_vocab)?),
            captured: Default::default(),
            target_hidden: hc.target_hidden,
            draft_vocab: hc.draft_vocab,
            layer: c,
            gpu,
        };
        head.gpu
            .stream
            .synchronize()
            .map_err(|e| cuda_err("uploading the EAGLE-3 head", e))?;
        Ok(head)
    }

    fn buffers(gpu: &Arc<Gpu>, c: &Config, target_hidden: usize, dv: usize) -> Result<Buffers> {
        let r = CHUNK_ROWS;
        let (h, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        // Split-K partial sums of the widest GEMV that splits (the split count depends on the shape only).
        let splits = |n: usize, k: usize| layout::splits_for(n, k, gpu.sm_count);
        let scratch = [
            (h, 3 * target_hidden),
            (q_dim + 2 * kv_dim, h),
            (q_dim + 2 * kv_dim, 2 * h),
            (h, q_dim),
            (h, ff),
            (dv, h),
        ]
        .iter()
        .map(|&(n, k)| {
            if splits(n, k) > 1 {
                splits(n, k) * n
            } else {
                0
            }
        })
        .max()
        .unwrap_or(0)
        .max(1)
            * r;
        debug_assert!(scratch <= MAX_SPLITS * r * (q_dim + 2 * kv_dim).max(h).max(dv));
        let f = |n: usize, what: &str| {
            // SAFETY: every buffer is written by a kernel or a copy before it is read.
            unsafe { gpu.stream.alloc::<f32>(n.max(1)) }
                .map_err(|e| cuda_err(&format!("allocating the head's {what}"), e))
        };
        let z = |n: usize, what: &str| {
            gpu.stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(|e| cuda_err(&format!("allocating the head's {what}"), e))
        };
        let u = |n: usize, what: &str| {
            gpu.stream
                .alloc_zeros::<u32>(n.max(1))
                .map_err(|e| cuda_err(&format!("allocating the head's {what}"), e))
        };
        let split = |k: usize, what: &str| alloc_split(gpu, r, k, &format!("the head's {what}"));
        Ok(Buffers {
            graphs: Default::default(),
            chains: Default::default(),
            chain_tops: f(2 * (MAX_CHAIN_MORE + 1), "chain's top tokens")?,
            round_tops: f(2 * r * (MAX_CHAIN_MORE + 1), "chains' top tokens")?,
            // Zeroed: a padding row may read rows no pass wrote (its results are never read).
            features: z(r * 3 * target_hidden, "features")?,
            features_split: split(3 * target_hidden, "features")?,
            x: z(r * h, "activations")?,
            embeds: f(r * h, "embeddings")?,
            normed_embeds: split(h, "activations")?,
            normed_x: split(h, "activations")?,
            normed_inputs: split(2 * h, "activations")?,
            qkv: f(r * (q_dim + 2 * kv_dim), "QKV")?,
            q: f(r * q_dim, "queries")?,
            attn: split(q_dim, "attention output")?,
            normed: split(h, "activations")?,
            act: split(ff, "MLP activations")?,
            scratch: f(scratch, "split-K scratch")?,
            angles: f(r * c.head_dim, "rotary angles")?,
            picked: f(r * h, "final rows")?,
            picked_normed: split(h, "final rows")?,
            logits: f(r * dv, "logits")?,
            attention: AttentionSplits::new(gpu, r, c.num_heads, c.head_dim, "the head's")?,
            top: f(2 * r * MAX_DEVICE_TOP_K, "top tokens")?,
            ints: u(words::TOTAL, "tables")?,
            pad_kv: CudaKvCache::new(gpu.clone(), c, r)?,
        })
    }

    fn upload_f32(&self, host: &[f32], dev: &mut CudaSlice<f32>, what: &str) -> Result<()> {
        let mut view = dev.slice_mut(0..host.len());
        self.gpu
            .stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| cuda_err(&format!("uploading the head's {what}"), e))
    }

    /// The decoder layer over the `m` rows whose tables and x are in the workspace; leaves the outputs in `x`,
    /// or with `defer_down` the down projection's split-K sums in the scratch for the final norm to add
    /// (`gather_rms_norm`). Returns that count (0: x holds the outputs). `fc_splits`: x is still fc's split-K
    /// sums in the scratch, which head_inputs adds up (and writes to x) first.
    fn record_layer(
        &self,
        ws: &Buffers,
        m: usize,
        defer_down: bool,
        fc_splits: usize,
    ) -> Result<usize> {
        let c = &self.layer;
        let gpu = &*self.gpu;
        let (h, q_dim, kv_dim, hd, ff) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim,
            c.intermediate_size,
        );
        let (heads, kv_heads) = (c.num_heads, c.num_kv_heads);
        let p = |s: &CudaSlice<f32>| ptr(s, gpu);
        let eps = c.rms_norm_eps as f32;
        let (px, pscratch) = (p(&ws.x), p(&ws.scratch));
        let ints = ptr(&ws.ints, gpu);
        let r32 = m as u32;
        let hc = h.div_ceil(layout::CHUNK) as i32;
        // One QKV GEMV over both normed inputs, written side by side as one row of 2h.
        let one_qkv = self.wqkv.as_ref().filter(|_| fused_inputs_enabled());
        if fused_inputs_enabled() {
            let (out_embed, out_x, out_chunks, x_col) = match one_qkv {
                Some(_) => (
                    ptr(&ws.normed_inputs, gpu),
                    ptr(&ws.normed_inputs, gpu),
                    (2 * h).div_ceil(layout::CHUNK) as i32,
                    h as i32,
                ),
                None => (ptr(&ws.normed_embeds, gpu), ptr(&ws.normed_x, gpu), hc, 0),
            };
            launch!(
                gpu,
                head_inputs,
                (r32, 3, 1),
                ops::norm_threads(h),
                ptr(&self.embed.data, gpu),
                self.embed.chunks as i32,
                ints + 4 * words::TOKENS as u64,
                px,
                p(&self.input_norm),
                p(&self.hidden_norm),
                out_embed,
                out_x,
                h as i32,
                eps,
                out_chunks,
                ints + 4 * words::POSITIONS as u64,
                p(&self.rope_inv_freqs),
                p(&ws.angles),
                (hd / 2) as i32,
                x_col,
                pscratch,
                fc_splits as i32,
                (m * h) as u64
            );
        } else {
            if fc_splits > 0 {
                return Err(Error::Cuda(
                    "the head's fc left its sums for the fused input kernel, which is off".into(),
                ));
            }
            launch!(
                gpu,
                embed_rows,
                (r32, 1, 1),
                256,
                ptr(&self.embed.data, gpu),
                ints + 4 * words::TOKENS as u64,
                p(&ws.embeds),
                h as i32,
                self.embed.chunks as i32
            );
            launch!(
                gpu,
                rope_angles,
                (r32, 1, 1),
                64,
                ints + 4 * words::POSITIONS as u64,
                p(&self.rope_inv_freqs),
                p(&ws.angles),
                (hd / 2) as i32
            );
            for (input, weight, out) in [
                (&ws.embeds, &self.input_norm, &ws.normed_embeds),
                (&ws.x, &self.hidden_norm, &ws.normed_x),
            ] {
                launch!(
                    gpu,
                    rms_norm,
                    (r32, 1, 1),
                    ops::norm_threads(h),
                    p(input),
                    p(weight),
                    ptr(out, gpu),
                    h as i32,
                    eps,
                    0u64,
                    0i32,
                    0u64,
                    hc,
                    0u64
                );
            }
        }
        let qkv_width = q_dim + 2 * kv_dim;
        let pqkv = p(&ws.qkv);
        // With one GEMV, its split-K sums are left for qkv_post to add (as the target's QKV does).
        let qkv_splits = match one_qkv {
            Some(wqkv) => gemv(
                gpu,
                wqkv,
                qkv_width,
                ptr(&ws.normed_inputs, gpu),
                pqkv,
                m,
                false,
                false,
                pscratch,
                true,
            )?,
            None => {
                gemv(
                    gpu,
                    &self.wqkv_embed,
                    qkv_width,
                    ptr(&ws.normed_embeds, gpu),
                    pqkv,
                    m,
                    false,
                    false,
                    pscratch,
                    false,
                )?;
                gemv(
                    gpu,
                    &self.wqkv_hidden,
                    qkv_width,
                    ptr(&ws.normed_x, gpu),
                    pqkv,
                    m,
                    true,
                    false,
                    pscratch,
                    false,
                )?;
                0
            }
        };
        let (p_rows, p_seqs) = (ints + 4 * words::ROWS as u64, ints + 4 * words::SEQ as u64);
        launch!(
            gpu,
            qkv_post,
            (r32, (heads + 2 * kv_heads) as u32, 1),
            64,
            if qkv_splits > 0 { pscratch } else { pqkv },
            qkv_splits as i32,
            (m * qkv_width) as u64,
            0u64,
            0i32,
            p(&ws.angles),
            p_rows,
            p_seqs,
            0i32,
            heads as i32,
            kv_heads as i32,
            hd as i32,
            1i32,
            p(&ws.q)
        );
        ops::attention(
            gpu,
            &ws.attention,
            m,
            p(&ws.q),
            ptr(&ws.attn, gpu),
            p_rows,
            p_seqs,
            0,
            heads,
            kv_heads,
            hd,
        )?;
        // r1 = x + o_proj(attention); the post-attention norm adds the projection's split-K sums into x.
        let o_splits = gemv(
            gpu,
            &self.wo,
            h,
            ptr(&ws.attn, gpu),
            px,
            m,
            true,
            false,
            pscratch,
            true,
        )?;
        launch!(
            gpu,
            rms_norm,
            (r32, 1, 1),
            ops::norm_threads(h),
            px,
            p(&self.post_attention_norm),
            ptr(&ws.normed, gpu),
            h as i32,
            eps,
            pscratch,
            o_splits as i32,
            (m * h) as u64,
            hc,
            0u64
        );
        gemv(
            gpu,
            &self.w_gate_up,
            2 * ff,
            ptr(&ws.normed, gpu),
            ptr(&ws.act, gpu),
            m,
            false,
            true,
            pscratch,
            false,
        )?;
        gemv(
            gpu,
            &self.w_down,
            h,
            ptr(&ws.act, gpu),
            px,
            m,
            true,
            false,
            pscratch,
            defer_down,
        )
    }

    /// Draft-vocabulary logits of the workspace rows listed in the tables' `wanted` (and, with `top_only`, each
    /// row's top token and probability).
    /// `down_splits`: the down projection's split-K sums the final norm adds first (`record_layer`'s
    /// `defer_down`; every row of the pass wanted). `chain_step`: a device chain's step whose bookkeeping
    /// top_token does too ([`fold_enabled`]).
    fn record_logits(
        &self,
        ws: &Buffers,
        wanted: usize,
        top_only: bool,
        top_k: usize,
        down_splits: usize,
        chain_step: Option<usize>,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let c = &self.layer;
        let p = |s: &CudaSlice<f32>| ptr(s, gpu);
        if fused_inputs_enabled() {
            launch!(
                gpu,
                gather_rms_norm,
                (wanted as u32, 1, 1),
                ops::norm_threads(c.hidden_size),
                p(&ws.x),
                ptr(&ws.ints, gpu) + 4 * words::WANTED as u64,
                p(&self.final_norm),
                ptr(&ws.picked_normed, gpu),
                c.hidden_size as i32,
                c.rms_norm_eps as f32,
                c.hidden_size.div_ceil(layout::CHUNK) as i32,
                p(&ws.scratch),
                down_splits as i32,
                (wanted * c.hidden_size) as u64
            );
        } else {
            if down_splits > 0 {
                return Err(Error::Cuda(
                    "the head's down projection left its sums for a fused final norm, which is off"
                        .into(),
                ));
            }
            launch!(
                gpu,
                gather_rows,
                (wanted as u32, 1, 1),
                256,
                p(&ws.x),
                ptr(&ws.ints, gpu) + 4 * words::WANTED as u64,
                p(&ws.picked),
                c.hidden_size as i32
            );
            launch!(
                gpu,
                rms_norm,
                (wanted as u32, 1, 1),
                ops::norm_threads(c.hidden_size),
                p(&ws.picked),
                p(&self.final_norm),
                ptr(&ws.picked_normed, gpu),
                c.hidden_size as i32,
                c.rms_norm_eps as f32,
                0u64,
                0i32,
                0u64,
                c.hidden_size.div_ceil(layout::CHUNK) as i32,
                0u64
            );
        }
        // A pass that wants only top tokens leaves the LM head's split-K sums for top_token to add.
        let defer_logits = top_only && fold_enabled();
        let logit_splits = gemv(
            gpu,
            &self.lm_head,
            self.draft_vocab,
            ptr(&ws.picked_normed, gpu),
            p(&ws.logits),
            wanted,
            false,
            false,
            p(&ws.scratch),
            defer_logits,
        )?;
        if top_only {
            launch!(
                gpu,
                top_token,
                (wanted as u32, 1, 1),
                super::model::TOP_TOKEN_THREADS,
                if logit_splits > 0 {
                    p(&ws.scratch)
                } else {
                    p(&ws.logits)
                },
                p(&ws.top),
                self.draft_vocab as i32,
                logit_splits as i32,
                (wanted * self.draft_vocab) as u64,
                chain_step.map_or(0, |_| p(&ws.chain_tops)),
                ptr(&self.draft_to_target, gpu),
                self.draft_vocab as u32,
                ptr(&ws.ints, gpu),
                chain_step.unwrap_or(0) as i32,
                words::POSITIONS as i32,
                words::ROWS as i32
            );
        } else if top_k > 0 {
            launch!(
                gpu,
                top_k_log_probs,
                (wanted as u32, 1, 1),
                256,
                p(&ws.logits),
                p(&ws.top),
                self.draft_vocab as i32,
                top_k as i32
            );
        }
        Ok(())
    }

    /// What a pass's wanted rows return, read back once the pass ran: top tokens, ranked tokens or logits.
    fn read_wanted(&self, ws: &Buffers, wanted: usize, want: HeadWant) -> Result<HeadOutput> {
        let stream = &self.gpu.stream;
        let mut out = HeadOutput::default();
        if want.top_only {
            let top = stream
                .clone_dtoh(&ws.top.slice(0..2 * wanted))
                .map_err(|e| cuda_err("reading the head's top tokens", e))?;
            out.top = top
                .chunks_exact(2)
                .map(|t| (t[0].to_bits(), t[1]))
                .collect();
        } else if device_top_k(want) > 0 {
            let k = want.top_k;
            let ranked = stream
                .clone_dtoh(&ws.top.slice(0..2 * wanted * k))
                .map_err(|e| cuda_err("reading the head's ranked tokens", e))?;
            out.ranked = ranked
                .chunks_exact(2 * k)
                .map(|row| {
                    row.chunks_exact(2)
                        .filter(|t| t[0].to_bits() != u32::MAX)
                        .map(|t| (t[1], t[0].to_bits() as usize))
                        .collect()
                })
                .collect();
        } else {
            let logits = stream
                .clone_dtoh(&ws.logits.slice(0..wanted * self.draft_vocab))
                .map_err(|e| cuda_err("reading the head's logits", e))?;
            if want.top_k > 0 {
                out.ranked = logits
                    .chunks_exact(self.draft_vocab)
                    .map(|row| top_log_probs(row, want.top_k))
                    .collect();
            } else {
                out.logits = logits;
            }
        }
        Ok(out)
    }

    /// A whole pass over the tables and inputs already in the workspace: fc (when fed features), the layer, the
    /// logits.
    /// `chain_step`: the pass is a device chain's step (`record_chain`) whose bookkeeping its top_token does.
    fn record_pass(&self, ws: &Buffers, shape: PassShape, chain_step: Option<usize>) -> Result<()> {
        let fold = fold_enabled();
        let mut fc_splits = 0;
        if shape.features {
            let gpu = &*self.gpu;
            if shape.gather {
                launch!(
                    gpu,
                    gather_feature_rows,
                    (shape.rows as u32, MAX_FEATURE_LAYERS as u32, 1),
                    256,
                    ptr(&ws.ints, gpu) + 4 * words::FEATURE_SRC as u64,
                    ptr(&ws.features, gpu),
                    MAX_FEATURE_LAYERS as i32,
                    self.target_hidden as i32,
                    (3 * self.target_hidden) as i32
                );
            }
            split_rows(
                gpu,
                ptr(&ws.features, gpu),
                ptr(&ws.features_split, gpu),
                shape.rows,
                self.fc.cols,
            )?;
            // Folded, fc's split-K sums are added up by head_inputs, which reads x first.
            fc_splits = gemv(
                gpu,
                &self.fc,
                self.layer.hidden_size,
                ptr(&ws.features_split, gpu),
                ptr(&ws.x, gpu),
                shape.rows,
                false,
                false,
                ptr(&ws.scratch, gpu),
                fold,
            )?;
        }
        // A pass that wants every row's logits (each row once: a chain step, a batch of one-row passes, a tree)
        // leaves the down projection's sums to the final norm, which writes the completed rows back.
        let defer_down = fold && shape.all_wanted;
        let down_splits = self.record_layer(ws, shape.rows, defer_down, fc_splits)?;
        if shape.wanted > 0 {
            self.record_logits(
                ws,
                shape.wanted,
                shape.top_only,
                shape.top_k,
                down_splits,
                chain_step,
            )?;
        }
        Ok(())
    }

    /// A greedy chain's passes after the first (`run_greedy_chain`): before each, chain_next keeps the previous
    /// pass's top token and feeds it to the next row; after the last, it keeps that pass's.
    fn record_chain(&self, ws: &Buffers, more: usize) -> Result<()> {
        let gpu = &*self.gpu;
        let shape = PassShape {
            rows: 1,
            features: false,
            gather: false,
            wanted: 1,
            top_only: true,
            top_k: 0,
            all_wanted: true,
        };
        // Folded, each pass's top_token keeps its top as the next step: chain_next runs only for the first pass's.
        let fold = fold_enabled();
        for step in 0..=more {
            if fold && step > 0 {
                if step < more {
                    self.record_pass(ws, shape, Some(step + 1))?;
                }
                continue;
            }
            launch!(
                gpu,
                chain_next,
                (1, 1, 1),
                32,
                ptr(&ws.top, gpu),
                ptr(&self.draft_to_target, gpu),
                self.draft_vocab as u32,
                ptr(&ws.ints, gpu),
                ptr(&ws.chain_tops, gpu),
                step as i32,
                words::POSITIONS as i32,
                words::ROWS as i32
            );
            if step < more {
                self.record_pass(ws, shape, fold.then_some(step + 1))?;
            }
        }
        Ok(())
    }

    /// Runs a chain's passes after the first, as one captured graph (captured the first time its length is seen).
    fn launch_chain(&self, ws: &mut Buffers, more: usize) -> Result<()> {
        if !super::model::graphs_enabled() {
            return self.record_chain(ws, more);
        }
        if !ws.chains.contains_key(&more) {
            let stream = &self.gpu.stream;
            stream
                .begin_capture(
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
                .map_err(|e| cuda_err("starting the head's chain capture", e))?;
            let recorded = self.record_chain(ws, more);
            let captured = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            recorded?;
            let graph = captured
                .map_err(|e| cuda_err("capturing the head's chain", e))?
                .ok_or_else(|| {
                    Error::Cuda("capturing the head's chain: nothing was captured".into())
                })?;
            ws.chains.insert(more, PassGraph(graph));
            self.captured
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ws.chains[&more]
            .0
            .launch()
            .map_err(|e| cuda_err("launching the head's chain", e))
    }

    /// Runs a pass, as a captured graph when it is short (captured the first time its shape is seen).
    fn launch_pass(&self, ws: &mut Buffers, shape: PassShape) -> Result<()> {
        if shape.rows > MAX_GRAPH_ROWS || !super::model::graphs_enabled() {
            return self.record_pass(ws, shape, None);
        }
        if !ws.graphs.contains_key(&shape) {
            if ws.graphs.len() >= max_pass_graphs() {
                ws.graphs.clear();
            }
            self.capture_pass(ws, shape)?;
            // Counted while serving only (prepared passes are not: `prepare_passes`).
            self.captured
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ws.graphs[&shape]
            .0
            .launch()
            .map_err(|e| cuda_err("launching the head's CUDA graph", e))
    }

    /// Captures a pass of `shape` as a CUDA graph (nothing runs: the graph reads its tables when launched).
    fn capture_pass(&self, ws: &mut Buffers, shape: PassShape) -> Result<()> {
        let stream = &self.gpu.stream;
        stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(|e| cuda_err("starting the head's CUDA graph capture", e))?;
        let recorded = self.record_pass(ws, shape, None);
        let captured = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        recorded?;
        let graph = captured
            .map_err(|e| cuda_err("capturing the head's CUDA graph", e))?
            .ok_or_else(|| Error::Cuda("capturing the head's pass: nothing was captured".into()))?;
        ws.graphs.insert(shape, PassGraph(graph));
        Ok(())
    }
}

/// Whether the head reads target features where they lie on the device (default; `SPECULA_CUDA_HEAD_DEVICE_FEATURES=0`
/// reads them to the host and uploads them, as before, to compare).
fn device_features_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("SPECULA_CUDA_HEAD_DEVICE_FEATURES").map_or(true, |v| v != "0")
    })
}

/// Whether a greedy chain runs all its passes on the device without reading each top token back (default;
/// `SPECULA_CUDA_HEAD_CHAIN=0` reads each pass's token back, to compare). Checked on an H100 in session 50: the
/// selftest's "a greedy chain of 6 passes on the device = pass by pass" holds (0 of 8204 values differ), the same
/// tokens a cycle, and 2.03x -> 2.08-2.09x plain at k = 4 with the stage-5 head. (Session 49's first version fed
/// its first chain pass the wrong row; that selftest check caught it.)
pub fn device_chain_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_HEAD_CHAIN").map_or(true, |v| v != "0"))
}

/// Whether a head pass takes its inputs (embedding, both input norms, rotary angles) in one launch and its final
/// norm with the row gather in another (kernels.cu `head_inputs`, `gather_rms_norm`): 4 launches fewer a pass of
/// ~19 (default; `SPECULA_CUDA_HEAD_FUSED=0` launches them separately, to compare). The same arithmetic as the
/// separate kernels: on an H100 in session 51 every selftest check of the stage-6 head gave the same values
/// either way (device chain = pass by pass, 0 of 8204 differ), a chain step 84.9 -> 77.7 us, and k = 5
/// 2.38-2.40x -> 2.44x plain.
pub fn fused_inputs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_HEAD_FUSED").map_or(true, |v| v != "0"))
}

/// Whether a head pass folds small launches into their neighbours (`SPECULA_CUDA_HEAD_FOLD=1`): the LM head's
/// split-K sums into top_token in passes that want top tokens only, the down projection's into the final norm
/// (`gather_rms_norm`, which writes the rows back) in passes that want every row, fc's into head_inputs (which
/// writes x) in passes fed features, and a device chain's `chain_next` into the top_token before it. The same
/// sums in the same order as `splitk_reduce`, the same chain bookkeeping, so the same values; 3 launches fewer a
/// chain step of 16, 1-2 fewer a fed pass. Needs the fused kernels. Checked on an H100 in session 52 (selftest
/// PASS) but off: it saved nothing measurable (a chain step 76.8 us either way, a chain of 4 tokens 381.9 -> 376.6
/// us, bench at simulated acceptance 2.28 -> 2.28-2.29x; on top of the one QKV GEMV nothing): the folded
/// kernels' extra reads cost what the launches saved.
pub fn fold_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        fused_inputs_enabled() && std::env::var("SPECULA_CUDA_HEAD_FOLD").is_ok_and(|v| v == "1")
    })
}

/// Whether a head pass computes Q, K and V in one GEMV over both normed inputs side by side (2h columns, its
/// split-K sums added by qkv_post) instead of a GEMV for each half and two reductions
/// (default; `SPECULA_CUDA_HEAD_ONE_QKV=0` launches the halves separately): 3 launches fewer a pass. Other sums
/// than two GEMVs' (the split over 2h columns), so values move within rounding. Needs the fused kernels
/// (head_inputs writes the joined row). Measured on an H100 in session 52 (random qwen2.5-1.5b and a random
/// head of the registry head's shape): selftest PASS against the CPU head, a chain of 4 tokens 381.9 -> 358.5
/// us, bench at simulated acceptance 0.75, k = 5, two rounds: 2.28x -> 2.30x plain.
pub fn one_qkv_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        fused_inputs_enabled()
            && std::env::var("SPECULA_CUDA_HEAD_ONE_QKV").map_or(true, |v| v != "0")
    })
}

/// Sequence `s`'s entries in a pass's row-copy tables (kernels.cu copy_rows_by_address): its last output
/// (`last_output`) into x row `fed_row` before the pass (COPY_IN), and x row `kept_row` into its last output
/// after (COPY_OUT). Addresses as two words each, low first.
fn copy_entries(ints: &mut [u32], s: usize, fed_row: u64, kept_row: u64, last_output: u64) {
    for (at, pair) in [
        (words::COPY_IN, [last_output, fed_row]),
        (words::COPY_OUT, [kept_row, last_output]),
    ] {
        for (j, address) in pair.into_iter().enumerate() {
            ints[at + 4 * s + 2 * j] = address as u32;
            ints[at + 4 * s + 2 * j + 1] = (address >> 32) as u32;
        }
    }
}

/// What `CudaHead::run_batched_then_chain` returns: the pass's outputs, or each sequence's chain of tops.
enum Batched {
    Outputs(Vec<HeadOutput>),
    Chains(Chains),
}

/// Whether `run_many` runs several sequences' passes as one (default; `SPECULA_CUDA_HEAD_BATCH=0` runs them one
/// after the other, to compare). Checked on an H200: batched passes equal each alone bitwise (selftest, tiny and
/// real heads).
pub fn batched_passes_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_HEAD_BATCH").map_or(true, |v| v != "0"))
}

impl CudaHead {
    /// Passes of two or more sequences, of one input kind (features or last outputs) and at most a chunk of rows
    /// in all, as one pass.
    fn run_batched(&self, passes: &mut [HeadPass<'_>]) -> Result<Vec<HeadOutput>> {
        match self.run_batched_then_chain(passes, 0)? {
            Batched::Outputs(outs) => Ok(outs),
            Batched::Chains(_) => Err(Error::Cuda(
                "a batched head pass returned chains it was not asked for".into(),
            )),
        }
    }

    /// `run_batched`, then with `chain` > 0 that many rounds of one-row passes, each sequence fed its previous
    /// top token and output on the device (greedy chains, [`HeadCompute::run_greedy_chains`]): then each
    /// sequence's tops come back, `chain + 1` of them, instead of the first pass's outputs. The caller checked
    /// that every cache has room for the chain's rows.
    fn run_batched_then_chain(&self, passes: &mut [HeadPass<'_>], chain: usize) -> Result<Batched> {
        let rows: usize = passes.iter().map(|p| p.tokens.len()).sum();
        let c = &self.layer;
        let h = c.hidden_size;
        let first_want = passes[0].want;
        let count = passes.len();
        let meta: Vec<(usize, HeadWant)> =
            passes.iter().map(|p| (p.tokens.len(), p.want)).collect();
        let mut ints = vec![0u32; words::TOTAL];
        let mut caches: Vec<&mut CudaHeadCache> = Vec::with_capacity(passes.len());
        let mut features = Vec::new();
        let (mut gathered, mut uploaded) = (false, false);
        let width = 3 * self.target_hidden;
        let mut row = 0;
        let mut real_wanted = Vec::with_capacity(count);
        for (s, p) in passes.iter_mut().enumerate() {
            if (p.want.top_only, p.want.top_k) != (first_want.top_only, first_want.top_k) {
                return Err(Error::InvalidArgument(
                    "a batched EAGLE-3 head pass mixes passes that want different results (top token, top-k, \
                     logits)"
                        .into(),
                ));
            }
            let cache = self.checked_pass(p.tokens, p.input, HeadRows::Chain, &mut *p.cache)?;
            let (start, n) = (cache.kv.len(), p.tokens.len());
            let base = cache.kv.device_ptr();
            ints[words::SEQ + 4 * s..words::SEQ + 4 * s + 4].copy_from_slice(&[
                base as u32,
                (base >> 32) as u32,
                cache.kv.capacity() as u32,
                0,
            ]);
            for i in 0..n {
                let slot = (start + i) as u32;
                ints[words::TOKENS + row] = p.tokens[i];
                ints[words::POSITIONS + row] = slot;
                ints[words::ROWS + 6 * row..words::ROWS + 6 * row + 6].copy_from_slice(&[
                    s as u32,
                    slot,
                    start as u32,
                    0,
                    u32::MAX,
                    u32::MAX,
                ]);
                row += 1;
            }
            real_wanted.push(row - 1);
            match p.input {
                HeadInput::Features(f) => {
                    // Zeros stand for device rows before this one (the pass gathers those over them).
                    features.resize((row - n) * width, 0.0);
                    features.extend_from_slice(f);
                    uploaded = true;
                }
                HeadInput::DeviceFeatures(d) => {
                    feature_sources(&mut ints, row - n, &d.rows, self.target_hidden)?;
                    gathered = true;
                }
                _ => {}
            }
            caches.push(cache);
        }
        let mut guard = self
            .workspace
            .lock()
            .map_err(|_| Error::Cuda("the EAGLE-3 head's workspace lock is poisoned".into()))?;
        let ws = &mut *guard;
        // The scratch sequence follows the real ones (a padded pass has fewer than a chunk of them).
        let (padded_rows, padded_wanted) =
            pad_tables(&mut ints, rows, &real_wanted, count, &ws.pad_kv);
        let fed_features = uploaded || gathered;
        // Each sequence's last output fed into its row (one row a sequence when not fed features), and each
        // sequence's last row kept as its last output after the pass: two launches over address tables.
        let gpu = &*self.gpu;
        let x = ptr(&ws.x, gpu);
        let row_bytes = (h * std::mem::size_of::<f32>()) as u64;
        for (s, (cache, &last)) in caches.iter().zip(&real_wanted).enumerate() {
            let last_output = ptr(&cache.last, gpu);
            copy_entries(
                &mut ints,
                s,
                x + s as u64 * row_bytes,
                x + last as u64 * row_bytes,
                last_output,
            );
        }
        let stream = &self.gpu.stream;
        stream
            .memcpy_htod(&ints, &mut ws.ints)
            .map_err(|e| cuda_err("uploading the head's tables", e))?;
        let tables = ptr(&ws.ints, gpu);
        let copy_rows = |at: usize| self.copy_rows(tables, at, count);
        if fed_features {
            // Host rows are uploaded (up to the last of them); device rows are gathered by the pass itself.
            if uploaded {
                self.upload_f32(&features, &mut ws.features, "features")?;
            }
        } else {
            copy_rows(words::COPY_IN)?;
        }
        self.launch_pass(
            ws,
            PassShape {
                rows: padded_rows,
                features: fed_features,
                gather: gathered,
                wanted: padded_wanted,
                top_only: first_want.top_only,
                top_k: device_top_k(first_want),
                all_wanted: count == rows,
            },
        )?;
        if chain > 0 {
            copy_rows(words::COPY_OUT)?;
            return self
                .chain_rounds(ws, &mut caches, &meta, chain)
                .map(Batched::Chains);
        }
        let all_outputs = if meta.iter().any(|m| m.1.outputs) {
            stream
                .clone_dtoh(&ws.x.slice(0..rows * h))
                .map_err(|e| cuda_err("reading the head's outputs", e))?
        } else {
            Vec::new()
        };
        let mut wanted = self.read_wanted(ws, count, first_want)?;
        let mut outs = Vec::with_capacity(count);
        copy_rows(words::COPY_OUT)?;
        let mut row0 = 0;
        for (s, (cache, &(n, want))) in caches.iter_mut().zip(&meta).enumerate() {
            cache.has_last = true;
            cache.kv.len += n;
            let mut out = HeadOutput::default();
            if want.outputs {
                out.outputs = all_outputs[row0 * h..(row0 + n) * h].to_vec();
            }
            if first_want.top_only {
                out.top = vec![wanted.top[s]];
            } else if first_want.top_k > 0 {
                out.ranked = vec![std::mem::take(&mut wanted.ranked[s])];
            } else {
                out.logits =
                    wanted.logits[s * self.draft_vocab..(s + 1) * self.draft_vocab].to_vec();
            }
            outs.push(out);
            row0 += n;
        }
        Ok(Batched::Outputs(outs))
    }

    /// The first `rows` entries of the row-copy table at word `at` of the uploaded tables (`tables`: their device
    /// address) copied, in one launch.
    fn copy_rows(&self, tables: u64, at: usize, rows: usize) -> Result<()> {
        let gpu = &*self.gpu;
        launch!(
            gpu,
            copy_rows_by_address,
            (rows as u32, 1, 1),
            256,
            tables + 4 * at as u64,
            self.layer.hidden_size as i32
        );
        Ok(())
    }

    /// The rounds of `run_batched_then_chain` after its first pass (whose tops are in `ws.top`, one a sequence,
    /// and whose last rows each cache's `last` now holds): row s of every round is sequence s's, chain_next_rows
    /// feeds it its previous top and moves it a slot on, and the rows' outputs stay in place for the next
    /// round. Returns each sequence's tops.
    fn chain_rounds(
        &self,
        ws: &mut Buffers,
        caches: &mut [&mut CudaHeadCache],
        meta: &[(usize, HeadWant)],
        more: usize,
    ) -> Result<Chains> {
        let gpu = &*self.gpu;
        let n = caches.len();
        let h = self.layer.hidden_size;
        let mut ints = vec![0u32; words::TOTAL];
        let x = ptr(&ws.x, gpu);
        let row_bytes = (h * std::mem::size_of::<f32>()) as u64;
        let mut last_fed = Vec::with_capacity(n);
        for (s, (cache, &(fed, _))) in caches.iter().zip(meta).enumerate() {
            let base = cache.kv.device_ptr();
            ints[words::SEQ + 4 * s..words::SEQ + 4 * s + 4].copy_from_slice(&[
                base as u32,
                (base >> 32) as u32,
                cache.kv.capacity() as u32,
                0,
            ]);
            // The slot of the first pass's last row: chain_next_rows moves the row to the next slot before each
            // round.
            let last = (cache.kv.len() + fed - 1) as u32;
            last_fed.push(last as usize);
            ints[words::POSITIONS + s] = last;
            ints[words::ROWS + 6 * s..words::ROWS + 6 * s + 6].copy_from_slice(&[
                s as u32,
                last,
                last,
                0,
                u32::MAX,
                u32::MAX,
            ]);
            let last_output = ptr(&cache.last, gpu);
            let row = x + s as u64 * row_bytes;
            copy_entries(&mut ints, s, row, row, last_output);
        }
        let every_row: Vec<usize> = (0..n).collect();
        let (padded_rows, padded_wanted) = pad_tables(&mut ints, n, &every_row, n, &ws.pad_kv);
        let stream = &self.gpu.stream;
        // Stream-ordered after the first pass, which read the tables this replaces.
        stream
            .memcpy_htod(&ints, &mut ws.ints)
            .map_err(|e| cuda_err("uploading the head's chain tables", e))?;
        let tables = ptr(&ws.ints, gpu);
        let copy_rows = |at: usize| self.copy_rows(tables, at, n);
        let (top, round_tops) = (ptr(&ws.top, gpu), ptr(&ws.round_tops, gpu));
        let next_rows = |step: usize| -> Result<()> {
            launch!(
                gpu,
                chain_next_rows,
                (1, 1, 1),
                CHUNK_ROWS as u32,
                top,
                ptr(&self.draft_to_target, gpu),
                self.draft_vocab as u32,
                tables,
                round_tops,
                step as i32,
                n as i32,
                words::POSITIONS as i32,
                words::ROWS as i32
            );
            Ok(())
        };
        copy_rows(words::COPY_IN)?;
        let shape = PassShape {
            rows: padded_rows,
            features: false,
            gather: false,
            wanted: padded_wanted,
            top_only: true,
            top_k: 0,
            all_wanted: true,
        };
        for step in 0..more {
            next_rows(step)?;
            self.launch_pass(ws, shape)?;
        }
        next_rows(more)?;
        copy_rows(words::COPY_OUT)?;
        for (cache, last) in caches.iter_mut().zip(last_fed) {
            cache.kv.len = last + 1 + more;
            cache.has_last = true;
        }
        let tops = stream
            .clone_dtoh(&ws.round_tops.slice(0..2 * n * (more + 1)))
            .map_err(|e| cuda_err("reading the head's chain tokens", e))?;
        let mut chains = vec![Vec::with_capacity(more + 1); n];
        for (i, t) in tops.chunks_exact(2).enumerate() {
            chains[i % n].push((t[0].to_bits(), t[1]));
        }
        Ok(chains)
    }

    /// A pass's inputs checked against each other, the head and its cache (on this GPU, with room, with a last
    /// output when fed from it); the cache as the GPU head's.
    fn checked_pass<'c>(
        &self,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &'c mut dyn SequenceCache,
    ) -> Result<&'c mut CudaHeadCache> {
        let c = &self.layer;
        check_pass(tokens, input, rows, self.target_hidden, c.hidden_size)?;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::InvalidArgument(format!(
                "token {bad} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let cache = cache
            .as_any_mut()
            .downcast_mut::<CudaHeadCache>()
            .ok_or_else(|| {
                Error::InvalidArgument("the EAGLE-3 head's cache belongs to another device".into())
            })?;
        if !Arc::ptr_eq(&cache.kv.gpu, &self.gpu) {
            return Err(Error::InvalidArgument(
                "the EAGLE-3 head's cache was made on another GPU".into(),
            ));
        }
        if matches!(input, HeadInput::Last) && !cache.has_last {
            return Err(Error::InvalidArgument(
                "EAGLE-3 head pass fed from the last output before any pass".into(),
            ));
        }
        let needed = cache.kv.len() + tokens.len();
        if needed > cache.kv.capacity() {
            return Err(Error::InvalidArgument(format!(
                "the EAGLE-3 head's KV cache holds {} positions; {needed} needed",
                cache.kv.capacity()
            )));
        }
        Ok(cache)
    }
}

impl HeadCompute for CudaHead {
    fn held_as(&self) -> Option<String> {
        let mut formats: Vec<&str> = Vec::new();
        for m in [
            &self.fc,
            &self.wqkv_embed,
            &self.wqkv_hidden,
            &self.wo,
            &self.w_gate_up,
            &self.w_down,
            &self.lm_head,
        ] {
            if !formats.contains(&m.format.name()) {
                formats.push(m.format.name());
            }
        }
        Some(formats.join("/"))
    }

    fn catch_up_piece(&self) -> usize {
        // A pass of up to a chunk's rows costs about a one-row pass (all graphed): a 60-token prompt fed 8 rows a
        // step held its request undrafted for 8 steps, each running a head pass anyway.
        CHUNK_ROWS
    }

    fn catch_up_reach(&self) -> usize {
        // Prompts of up to 2048 tokens, fed a chunk a step beside other requests: at the old reach (64) a request
        // with a longer prompt never drafted beside others (the chat template alone is ~30 tokens).
        crate::draft::eagle3::compute::reach_override().unwrap_or(32 * CHUNK_ROWS)
    }

    fn graphs_captured(&self) -> u64 {
        self.captured.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn prepare_passes(&self) -> Result<usize> {
        if !super::model::graphs_enabled() || !padding_enabled() {
            return Ok(0);
        }
        let mut guard = self
            .workspace
            .lock()
            .map_err(|_| Error::Cuda("the EAGLE-3 head's workspace lock is poisoned".into()))?;
        let ws = &mut *guard;
        let mut captured = 0;
        // Passes fed the target's rows where they lie (a verify's accepted rows, a catch-up), or one row a
        // sequence from its last output (chain steps of a shared round: every row wanted); wanting top tokens
        // (greedy) or logits (sampled requests: the OpenAI API's default temperature is 1).
        let fed = [(true, true), (false, false)];
        let mut shapes = Vec::new();
        for top_only in [true, false] {
            for (rows, wanted, all_wanted) in all_padded_shapes() {
                for &(features, gather) in &fed[..if all_wanted { 2 } else { 1 }] {
                    shapes.push(PassShape {
                        rows,
                        features,
                        gather,
                        wanted,
                        top_only,
                        top_k: 0,
                        all_wanted,
                    });
                }
            }
        }
        for shape in shapes {
            if ws.graphs.len() >= max_pass_graphs() {
                return Ok(captured);
            }
            if !ws.graphs.contains_key(&shape) {
                self.capture_pass(ws, shape)?;
                captured += 1;
            }
        }
        Ok(captured)
    }

    fn time_kernels(
        &self,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Vec<crate::profile::KernelTime>>> {
        self.gpu.time_kernels(work).map(Some)
    }

    fn reads_device_features(&self) -> bool {
        // Target features still in the target's step outputs on this GPU (the server's one device).
        device_features_enabled()
    }

    fn device(&self) -> String {
        self.gpu.name.clone()
    }

    /// Consecutive sequences' rows in one pass each (rows name their sequence's cache in the row table) where
    /// they feed the same kind of input and fit one chunk together ([`pass_groups`]); a pass alone or fed
    /// hidden rows runs by itself. Until session 58 a round over a chunk went pass by pass: on an H100 a
    /// 16-stream server's catch-up rounds (16 requests, 2-7 rows each) took 0.6-2.2 ms of draft a step that way.
    fn run_many(&self, target: &dyn Model, passes: &mut [HeadPass<'_>]) -> Result<Vec<HeadOutput>> {
        if !batched_passes_enabled() || passes.len() < 2 {
            return run_one_by_one(self, target, passes);
        }
        let rows: Vec<usize> = passes.iter().map(|p| p.tokens.len()).collect();
        let kinds: Vec<u8> = passes
            .iter()
            .map(|p| match p.input {
                HeadInput::Features(_) | HeadInput::DeviceFeatures(_) => 0,
                HeadInput::Hidden(_) => 1,
                HeadInput::Last => 2,
            })
            .collect();
        let mut outs = Vec::with_capacity(passes.len());
        for group in pass_groups(&rows, &kinds, CHUNK_ROWS) {
            let group = &mut passes[group];
            if group.len() == 1 || matches!(group[0].input, HeadInput::Hidden(_)) {
                outs.extend(run_one_by_one(self, target, group)?);
            } else {
                outs.extend(self.run_batched(group)?);
            }
        }
        Ok(outs)
    }

    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>> {
        let last = self
            .gpu
            .stream
            .alloc_zeros::<f32>(self.layer.hidden_size)
            .map_err(|e| cuda_err("allocating the head's last output", e))?;
        Ok(Box::new(CudaHeadCache {
            kv: CudaKvCache::new(self.gpu.clone(), &self.layer, capacity)?,
            last,
            has_last: false,
        }))
    }

    fn run(
        &self,
        _target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &mut dyn SequenceCache,
        want: HeadWant,
    ) -> Result<HeadOutput> {
        let cache = self.checked_pass(tokens, input, rows, cache)?;
        let mut guard = self
            .workspace
            .lock()
            .map_err(|_| Error::Cuda("the EAGLE-3 head's workspace lock is poisoned".into()))?;
        self.run_locked(&mut guard, tokens, input, rows, cache, want, true)
    }

    fn run_greedy_chains(
        &self,
        _target: &dyn Model,
        passes: &mut [HeadPass<'_>],
        more: usize,
    ) -> Result<Option<Chains>> {
        let rows: usize = passes.iter().map(|p| p.tokens.len()).sum();
        let kind = |p: &HeadPass<'_>| match p.input {
            HeadInput::Features(_) | HeadInput::DeviceFeatures(_) => Some(0),
            HeadInput::Last => Some(1),
            HeadInput::Hidden(_) => None,
        };
        let first_kind = passes.first().and_then(kind);
        // One batched first pass of one input kind, greedy, within a chunk; then rounds with room in every cache.
        if more == 0
            || more > MAX_CHAIN_MORE
            || passes.len() < 2
            || rows > CHUNK_ROWS
            || first_kind.is_none()
            || !device_chain_enabled()
            || !batched_passes_enabled()
            || !super::model::graphs_enabled()
            || passes
                .iter()
                .any(|p| kind(p) != first_kind || !p.want.top_only || p.tokens.is_empty())
        {
            return Ok(None);
        }
        for p in passes.iter_mut() {
            let Some(cache) = p.cache.as_any_mut().downcast_mut::<CudaHeadCache>() else {
                return Ok(None);
            };
            if cache.kv.len() + p.tokens.len() + more > cache.kv.capacity() {
                return Ok(None);
            }
        }
        match self.run_batched_then_chain(passes, more)? {
            Batched::Chains(tops) => Ok(Some(tops)),
            Batched::Outputs(_) => Err(Error::Cuda(
                "a batched head chain returned a pass's outputs".into(),
            )),
        }
    }

    fn run_greedy_chain(
        &self,
        _target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        cache: &mut dyn SequenceCache,
        more: usize,
    ) -> Result<Option<Vec<(u32, f32)>>> {
        if more == 0 || more > MAX_CHAIN_MORE || !device_chain_enabled() {
            return Ok(None);
        }
        let cache = self.checked_pass(tokens, input, HeadRows::Chain, cache)?;
        // The slot of the first pass's last row: the chain's passes write the slots after it.
        let last_fed = cache.kv.len() + tokens.len() - 1;
        if last_fed + 1 + more > cache.kv.capacity() {
            return Err(Error::InvalidArgument(format!(
                "the EAGLE-3 head's KV cache holds {} positions; a chain needs {}",
                cache.kv.capacity(),
                last_fed + 1 + more
            )));
        }
        let mut guard = self
            .workspace
            .lock()
            .map_err(|_| Error::Cuda("the EAGLE-3 head's workspace lock is poisoned".into()))?;
        let ws = &mut *guard;
        let want = HeadWant {
            outputs: false,
            top_only: true,
            top_k: 0,
        };
        // The first pass leaves its top token on the device for the chain's first pass to read.
        self.run_locked(ws, tokens, input, HeadRows::Chain, cache, want, false)?;
        // One-row chain tables pointing at that last fed row: chain_next moves them one slot on before each pass
        // and writes the token it feeds.
        let base = cache.kv.device_ptr();
        let last = last_fed as u32;
        let mut ints = vec![0u32; words::TOTAL];
        ints[words::SEQ..words::SEQ + 4].copy_from_slice(&[
            base as u32,
            (base >> 32) as u32,
            cache.kv.capacity() as u32,
            0,
        ]);
        ints[words::POSITIONS] = last;
        ints[words::ROWS..words::ROWS + 6].copy_from_slice(&[0, last, last, 0, u32::MAX, u32::MAX]);
        ints[words::WANTED] = 0;
        let stream = &self.gpu.stream;
        stream
            .memcpy_htod(&ints, &mut ws.ints)
            .map_err(|e| cuda_err("uploading the head's chain tables", e))?;
        // The chain's passes read and write row 0 of x; the first pass's last output is its row m - 1 (session 49
        // ran the chain from row 0, the first fed row's output: every draft after the first went wrong, caught by
        // selftest's chain check).
        {
            let mut dst = ws.x.slice_mut(0..self.layer.hidden_size);
            stream
                .memcpy_dtod(&cache.last, &mut dst)
                .map_err(|e| cuda_err("feeding the head's chain its last output", e))?;
        }
        self.launch_chain(ws, more)?;
        cache.kv.len = last_fed + 1 + more;
        {
            let src = ws.x.slice(0..self.layer.hidden_size);
            stream
                .memcpy_dtod(&src, &mut cache.last)
                .map_err(|e| cuda_err("keeping the head's last output", e))?;
        }
        cache.has_last = true;
        let tops = stream
            .clone_dtoh(&ws.chain_tops.slice(0..2 * (more + 1)))
            .map_err(|e| cuda_err("reading the head's chain tokens", e))?;
        Ok(Some(
            tops.chunks_exact(2)
                .map(|t| (t[0].to_bits(), t[1]))
                .collect(),
        ))
    }
}

impl CudaHead {
    /// `run` over a checked cache, holding the workspace; with `read` false the wanted rows' results stay on the
    /// device (a chain's first pass: the chain reads its top token there).
    #[allow(clippy::too_many_arguments)]
    fn run_locked(
        &self,
        ws: &mut Buffers,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &mut CudaHeadCache,
        want: HeadWant,
        read: bool,
    ) -> Result<HeadOutput> {
        let h = self.layer.hidden_size;
        let n = tokens.len();
        let start = cache.kv.len();
        // kernels.cu RowInfo per row: sequence, slot, first slot of the visible new rows, tree flag, mask.
        let mut positions = Vec::with_capacity(n);
        let mut table = Vec::with_capacity(n * 6);
        match rows {
            HeadRows::Chain => {
                for i in 0..n {
                    let slot = (start + i) as u32;
                    positions.push(slot);
                    table.extend_from_slice(&[0, slot, start as u32, 0, u32::MAX, u32::MAX]);
                }
            }
            HeadRows::Tree(tree) => {
                if n > CHUNK_ROWS {
                    return Err(Error::InvalidArgument(format!(
                        "an EAGLE-3 tree pass of {n} rows; the GPU head takes up to {CHUNK_ROWS}"
                    )));
                }
                for (i, r) in tree.iter().enumerate() {
                    let slot = start + i;
                    let mut mask = 0u64;
                    for &s in r.ancestors.iter().chain(std::iter::once(&slot)) {
                        if r.prefix > start || s < r.prefix || s > slot || s - r.prefix >= 64 {
                            return Err(Error::InvalidArgument(format!(
                                "EAGLE-3 tree row {i} (slot {slot}) sees slot {s} past its prefix of {}: the GPU \
                                 attention masks up to 64 slots after the prefix",
                                r.prefix
                            )));
                        }
                        mask |= 1 << (s - r.prefix);
                    }
                    positions.push(r.position as u32);
                    table.extend_from_slice(&[
                        0,
                        slot as u32,
                        r.prefix as u32,
                        1,
                        mask as u32,
                        (mask >> 32) as u32,
                    ]);
                }
            }
        }
        let base = cache.kv.device_ptr();
        let mut ints = vec![0u32; words::TOTAL];
        ints[words::SEQ..words::SEQ + 4].copy_from_slice(&[
            base as u32,
            (base >> 32) as u32,
            cache.kv.capacity() as u32,
            0,
        ]);
        let stream = &self.gpu.stream;
        let mut out = HeadOutput::default();
        let mut r0 = 0;
        while r0 < n {
            let m = (n - r0).min(CHUNK_ROWS);
            let r1 = r0 + m;
            let last_chunk = r1 == n;
            let wanted = match (last_chunk, rows) {
                (false, _) => 0,
                (true, HeadRows::Chain) => 1,
                (true, HeadRows::Tree(_)) => m,
            };
            // One upload of every table.
            if let HeadInput::DeviceFeatures(d) = input {
                feature_sources(&mut ints, 0, &d.rows[r0..r1], self.target_hidden)?;
            }
            ints[words::TOKENS..words::TOKENS + m].copy_from_slice(&tokens[r0..r1]);
            ints[words::POSITIONS..words::POSITIONS + m].copy_from_slice(&positions[r0..r1]);
            ints[words::ROWS..words::ROWS + 6 * m].copy_from_slice(&table[r0 * 6..r1 * 6]);
            let real_wanted: Vec<usize> = (m - wanted..m).collect();
            // The scratch sequence is the second (the pass's own is the first).
            let (padded_rows, padded_wanted) =
                pad_tables(&mut ints, m, &real_wanted, 1, &ws.pad_kv);
            stream
                .memcpy_htod(&ints, &mut ws.ints)
                .map_err(|e| cuda_err("uploading the head's tables", e))?;
            match input {
                HeadInput::Features(f) => {
                    let w = 3 * self.target_hidden;
                    self.upload_f32(&f[r0 * w..r1 * w], &mut ws.features, "features")?;
                }
                // Gathered by the pass from the addresses in the tables (uploaded above).
                HeadInput::DeviceFeatures(_) => {}
                HeadInput::Hidden(x) => self.upload_f32(&x[r0 * h..r1 * h], &mut ws.x, "inputs")?,
                HeadInput::Last => {
                    let mut dst = ws.x.slice_mut(0..h);
                    stream
                        .memcpy_dtod(&cache.last, &mut dst)
                        .map_err(|e| cuda_err("feeding the head's last output", e))?;
                }
            }
            let shape = PassShape {
                rows: padded_rows,
                features: matches!(input, HeadInput::Features(_) | HeadInput::DeviceFeatures(_)),
                gather: matches!(input, HeadInput::DeviceFeatures(_)),
                wanted: padded_wanted,
                top_only: want.top_only,
                top_k: device_top_k(want),
                all_wanted: wanted == m,
            };
            self.launch_pass(ws, shape)?;
            cache.kv.len = start + r1;
            if want.outputs {
                out.outputs.extend(
                    stream
                        .clone_dtoh(&ws.x.slice(0..m * h))
                        .map_err(|e| cuda_err("reading the head's outputs", e))?,
                );
            }
            if last_chunk {
                {
                    let src = ws.x.slice((m - 1) * h..m * h);
                    stream
                        .memcpy_dtod(&src, &mut cache.last)
                        .map_err(|e| cuda_err("keeping the head's last output", e))?;
                }
                cache.has_last = true;
                if read {
                    let got = self.read_wanted(ws, wanted, want)?;
                    (out.top, out.ranked, out.logits) = (got.top, got.ranked, got.logits);
                }
            }
            r0 = r1;
        }
        Ok(out)
    }
}

/// Whether captured passes are padded to a few row counts (default; `SPECULA_CUDA_HEAD_PAD=0` captures every
/// shape as it comes, to compare). See `padding`.
fn padding_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_HEAD_PAD").map_or(true, |v| v != "0"))
}

/// Writes the wanted list of a pass of `rows` real rows into `ints`, padded (`padding`) when the pass will be a
/// captured graph: padding rows `rows..` feed token 0 into slots 0.. of the scratch sequence `pad_seq` (the
/// workspace's `pad_kv`, whose table entry this writes), gather no features, and are never read back. Returns the
/// (rows, wanted rows) the pass runs.
fn pad_tables(
    ints: &mut [u32],
    rows: usize,
    real_wanted: &[usize],
    pad_seq: usize,
    pad_kv: &CudaKvCache,
) -> (usize, usize) {
    let graphed = rows <= MAX_GRAPH_ROWS && super::model::graphs_enabled() && padding_enabled();
    let (padded_rows, padded_wanted) = if graphed {
        padded_shape(rows, real_wanted.len())
    } else {
        (rows, real_wanted.len())
    };
    if padded_rows > rows {
        let base = pad_kv.device_ptr();
        ints[words::SEQ + 4 * pad_seq..words::SEQ + 4 * pad_seq + 4].copy_from_slice(&[
            base as u32,
            (base >> 32) as u32,
            pad_kv.capacity() as u32,
            0,
        ]);
        for (j, row) in (rows..padded_rows).enumerate() {
            ints[words::TOKENS + row] = 0;
            ints[words::POSITIONS + row] = j as u32;
            ints[words::ROWS + 6 * row..words::ROWS + 6 * row + 6].copy_from_slice(&[
                pad_seq as u32,
                j as u32,
                0,
                0,
                u32::MAX,
                u32::MAX,
            ]);
            let src = words::FEATURE_SRC + 2 * row * MAX_FEATURE_LAYERS;
            ints[src..src + 2 * MAX_FEATURE_LAYERS].fill(0);
        }
    }
    for (j, &r) in wanted_rows(real_wanted, rows, padded_rows, padded_wanted)
        .iter()
        .enumerate()
    {
        ints[words::WANTED + j] = r as u32;
    }
    (padded_rows, padded_wanted)
}

/// Writes the addresses of device feature rows (the pass's rows `first..`) into the tables' FEATURE_SRC, each
/// layer's columns one after the other; every layer must be the target's hidden size wide.
fn feature_sources(
    ints: &mut [u32],
    first: usize,
    rows: &[Vec<(u64, usize)>],
    target_hidden: usize,
) -> Result<()> {
    for (i, parts) in rows.iter().enumerate() {
        if parts.len() > MAX_FEATURE_LAYERS || first + i >= CHUNK_ROWS {
            return Err(Error::InvalidArgument(format!(
                "a device feature row of {} layers at row {} (the GPU head gathers up to {MAX_FEATURE_LAYERS}                  layers a row, {CHUNK_ROWS} rows a pass)",
                parts.len(),
                first + i
            )));
        }
        if parts.iter().any(|&(_, cols)| cols != target_hidden) {
            return Err(Error::InvalidArgument(format!(
                "a device feature row's layers are {:?} wide; the GPU head gathers layers of {target_hidden}",
                parts.iter().map(|p| p.1).collect::<Vec<_>>()
            )));
        }
        for (l, &(address, _)) in parts.iter().enumerate() {
            let at = words::FEATURE_SRC + 2 * ((first + i) * MAX_FEATURE_LAYERS + l);
            ints[at] = address as u32;
            ints[at + 1] = (address >> 32) as u32;
        }
    }
    Ok(())
}

/// The top-k a pass takes on the device (0: none, or too many for the device's buffer: ranked on the host).
fn device_top_k(want: HeadWant) -> usize {
    if want.top_only || want.top_k > MAX_DEVICE_TOP_K {
        0
    } else {
        want.top_k
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::weights::GgmlType;

    fn values(rows: usize, cols: usize, seed: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| (((i + seed) * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    fn columns_of(v: &[f32], cols: usize, from: usize, width: usize) -> Vec<f32> {
        v.chunks_exact(cols)
            .flat_map(|row| row[from..from + width].iter().copied())
            .collect()
    }

    fn bf16_values(m: &HostMatrix, rows: usize, cols: usize) -> Vec<u16> {
        m.clone().into_bf16(rows, cols).unwrap()
    }

    /// A quantized head matrix goes up in its own GGUF bytes; a stored one as bf16 of its values.
    #[test]
    fn quantized_head_matrices_stay_native_and_stored_ones_go_bf16() {
        let (rows, cols) = (16, 512);
        let v = values(rows, cols, 1);
        let q = Weight::quantize(&v, rows, cols, GgmlType::Q4K).unwrap();
        match host_matrix(&q) {
            HostMatrix::Native(GgmlType::Q4K, bytes) => assert_eq!(bytes, q.raw_bytes()),
            _ => panic!("a Q4_K head matrix must stay Q4_K"),
        }
        let b = Weight::quantize(&v, rows, cols, GgmlType::BF16).unwrap();
        match host_matrix(&b) {
            HostMatrix::Bf16(values) => assert_eq!(values, bf16(&b.to_f32())),
            _ => panic!("a bf16 head matrix goes up as bf16"),
        }
    }

    /// Splitting a native matrix's columns between blocks gives the bytes of each half quantized alone (Q4_K and
    /// Q8_0 blocks never straddle the cut); off a block boundary both halves are bf16 of the same values.
    #[test]
    fn columns_split_between_blocks_stay_native_and_equal_each_half_quantized() {
        let (rows, cols) = (24, 1024);
        let v = values(rows, cols, 7);
        for ty in [GgmlType::Q4K, GgmlType::Q8_0, GgmlType::Q6K] {
            let whole = HostMatrix::Native(
                ty,
                Weight::quantize(&v, rows, cols, ty).unwrap().raw_bytes(),
            );
            let (a, b) = split_columns(&whole, rows, cols, 512).unwrap();
            for (half, from) in [(&a, 0), (&b, 512)] {
                let alone = Weight::quantize(&columns_of(&v, cols, from, 512), rows, 512, ty)
                    .unwrap()
                    .raw_bytes();
                match half {
                    HostMatrix::Native(t, bytes) => {
                        assert_eq!(*t, ty);
                        assert_eq!(*bytes, alone, "{} half at {from}", ty.name());
                    }
                    _ => panic!("{} halves split between blocks stay native", ty.name()),
                }
            }
            // 384 is not a multiple of Q4_K's or Q6_K's 256: bf16 halves of the dequantized values.
            let (a, b) = split_columns(&whole, rows, cols, 384).unwrap();
            let all = bf16_values(&whole, rows, cols);
            let cut = |from: usize, width: usize| -> Vec<u16> {
                all.chunks_exact(cols)
                    .flat_map(|row| row[from..from + width].iter().copied())
                    .collect()
            };
            assert_eq!(bf16_values(&a, rows, 384), cut(0, 384));
            assert_eq!(bf16_values(&b, rows, cols - 384), cut(384, cols - 384));
            if ty != GgmlType::Q8_0 {
                assert!(
                    matches!(a, HostMatrix::Bf16(_)),
                    "{} off a block edge",
                    ty.name()
                );
            }
        }
    }

    /// Q, K and V of one native type stack as that type's bytes; of different types as bf16 of their values.
    #[test]
    fn rows_stack_natively_only_when_every_part_shares_a_type() {
        let cols = 256;
        let parts = [(32, 1), (16, 2), (16, 3)];
        let of = |ty: GgmlType, rows: usize, seed: usize| {
            let w = Weight::quantize(&values(rows, cols, seed), rows, cols, ty).unwrap();
            host_matrix(&w)
        };
        let same = stack_rows(
            parts
                .iter()
                .map(|&(r, s)| (of(GgmlType::Q4K, r, s), r))
                .collect(),
            cols,
        )
        .unwrap();
        let mut expected = Vec::new();
        for &(r, s) in &parts {
            if let HostMatrix::Native(_, b) = of(GgmlType::Q4K, r, s) {
                expected.extend(b);
            }
        }
        match &same {
            HostMatrix::Native(GgmlType::Q4K, bytes) => assert_eq!(*bytes, expected),
            _ => panic!("three Q4_K parts stack as Q4_K"),
        }
        let types = [GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q6K];
        let mixed = stack_rows(
            parts
                .iter()
                .zip(types)
                .map(|(&(r, s), ty)| (of(ty, r, s), r))
                .collect(),
            cols,
        )
        .unwrap();
        let mut values_expected = Vec::new();
        for (&(r, s), ty) in parts.iter().zip(types) {
            values_expected.extend(bf16_values(&of(ty, r, s), r, cols));
        }
        match &mixed {
            HostMatrix::Bf16(v) => assert_eq!(*v, values_expected),
            _ => panic!("parts of different types stack as bf16"),
        }
    }
}
