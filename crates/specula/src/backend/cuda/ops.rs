//! What every CUDA forward pass shares: kernel launches, the tiled bf16 matrix and its GEMV.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::layout;
use super::{cuda_err, Gpu};
use crate::error::Result;
use crate::model::dtype::GgmlType;

/// The device address of a buffer (event tracking is off: nothing to synchronize).
pub(crate) fn ptr<T>(s: &CudaSlice<T>, gpu: &Gpu) -> u64 {
    let (p, _sync) = s.device_ptr(&gpu.stream);
    p
}

/// Launches kernel `$kernel` with `$grid` blocks of `$block` threads; every argument is a value (device pointers
/// as u64), kept alive until the launch is queued.
macro_rules! launch {
    ($gpu:expr, $kernel:ident, $grid:expr, $block:expr, $($arg:expr),* $(,)?) => {{
        let gpu: &Gpu = &$gpu;
        launch_fn!(gpu, &gpu.kernels.$kernel, stringify!($kernel), $grid, $block, $($arg),*)
    }};
}

/// Launches a kernel function with its arguments (each boxed, so the parameter pointers stay valid).
macro_rules! launch_fn {
    ($gpu:expr, $func:expr, $name:expr, $grid:expr, $block:expr, $($arg:expr),* $(,)?) => {{
        let gpu: &Gpu = $gpu;
        let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
        let mut params: Vec<*mut std::ffi::c_void> = Vec::new();
        $(
            let mut value = Box::new($arg);
            params.push(&mut *value as *mut _ as *mut std::ffi::c_void);
            keep.push(value);
        )*
        let grid: (u32, u32, u32) = $grid;
        // SAFETY: the arguments match the kernel's signature in kernels.cu, and every pointer is a live
        // allocation of the size the kernel indexes (checked by the callers' shapes).
        unsafe { gpu.launch($func, $name, grid, $block, &mut params) }?;
        drop(keep);
    }};
}

/// How a matrix's tiles hold its values (kernels.cu `Bf16Weights`, `Q4kWeights`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightFormat {
    /// bf16 tiles of 1 KiB (layout.rs `tile_matrix`): any source type, converted or dequantized at load.
    Bf16,
    /// Nibble tiles of 384 bytes with a (d1, m1) pair a row (layout.rs `tile_q4k`, `tile_q4_1`): native GGUF
    /// Q4_K and Q4_1, dequantized in registers to the same bf16.
    Q4k,
    /// GGUF Q6_K, Q8_0, Q5_0 and Q4_0, native: 640-byte tiles of signed bytes and a factor per 16 inputs
    /// (layout.rs `tile_q6k`, `tile_q8_0`, `tile_q5_0`, `tile_q4_0`), likewise.
    ScaledI8,
    /// Parts of different formats stacked by rows (`Matrix::parts`): Q, K and V of mixed GGUF types.
    Mixed,
}

impl WeightFormat {
    pub(crate) fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Q4k => "nibble",
            WeightFormat::ScaledI8 => "scaled int8",
            WeightFormat::Mixed => "mixed",
        }
    }
}

/// A matrix on the device, `rows` outputs of `cols` inputs, in the tensor-core GEMV's tiled layout (layout.rs;
/// `chunks` 32-input chunks per 16-row block), bf16 or a native GGUF format.
pub(crate) struct Matrix {
    pub(crate) data: CudaSlice<u16>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) chunks: usize,
    pub(crate) format: WeightFormat,
    /// Where each part lives, for `WeightFormat::Mixed`.
    pub(crate) parts: Option<layout::MixedParts>,
}

impl Matrix {
    /// Uploads a row-major `rows x cols` bf16 matrix in the GEMV's tiled layout.
    pub(crate) fn upload(
        gpu: &Gpu,
        data: &[u16],
        rows: usize,
        cols: usize,
        what: &str,
    ) -> Result<Self> {
        let tiled = layout::tile_matrix(data, rows, cols);
        Self::from_tiles(gpu, &tiled, rows, cols, WeightFormat::Bf16, what)
    }

    /// A `rows x cols` matrix already tiled in `format`, uploaded.
    fn from_tiles(
        gpu: &Gpu,
        tiled: &[u16],
        rows: usize,
        cols: usize,
        format: WeightFormat,
        what: &str,
    ) -> Result<Self> {
        let data = gpu
            .stream
            .clone_htod(tiled)
            .map_err(|e| cuda_err(&format!("uploading {what}"), e))?;
        Ok(Matrix {
            data,
            rows,
            cols,
            chunks: layout::tiles(rows, cols).1,
            format,
            parts: None,
        })
    }

    /// Parts (each `(format, tiles, rows)`, `cols` wide, every part but the last whole row blocks) stacked by
    /// rows as one matrix. Neighbours of one tile format become one part (Q5_0 beside Q8_0 are both scaled int8);
    /// one part left is a plain matrix of its format, several are multiplied by the mixed GEMV.
    pub(crate) fn upload_mixed(
        gpu: &Gpu,
        parts: Vec<(layout::TileFormat, Vec<u16>, usize)>,
        cols: usize,
        what: &str,
    ) -> Result<Self> {
        let rows = parts.iter().map(|p| p.2).sum();
        let mut merged: Vec<(layout::TileFormat, Vec<u16>, usize)> = Vec::new();
        for (format, tiles, r) in parts {
            match merged.last_mut() {
                Some(last) if last.0 == format && last.2 % layout::ROW_BLOCK == 0 => {
                    last.1.extend_from_slice(&tiles);
                    last.2 += r;
                }
                _ => merged.push((format, tiles, r)),
            }
        }
        if let [(format, tiles, _)] = merged.as_slice() {
            let format = match format {
                layout::TileFormat::Bf16 => WeightFormat::Bf16,
                layout::TileFormat::Nibble => WeightFormat::Q4k,
                layout::TileFormat::ScaledI8 => WeightFormat::ScaledI8,
            };
            return Self::from_tiles(gpu, tiles, rows, cols, format, what);
        }
        let views: Vec<(layout::TileFormat, &[u16], usize)> = merged
            .iter()
            .map(|(f, t, r)| (*f, t.as_slice(), *r))
            .collect();
        let (tiled, layout_parts) = layout::stack_tiled_parts(&views, cols)
            .map_err(|e| crate::error::Error::Cuda(format!("{what}: {e}")))?;
        let mut m = Self::from_tiles(gpu, &tiled, rows, cols, WeightFormat::Mixed, what)?;
        m.parts = Some(layout_parts);
        Ok(m)
    }

    /// Uploads a GGUF matrix of a type with a native format (`rows x cols`, row-major bytes) as tiles of it.
    pub(crate) fn upload_native(
        gpu: &Gpu,
        ty: GgmlType,
        raw: &[u8],
        rows: usize,
        cols: usize,
        what: &str,
    ) -> Result<Self> {
        let (tiled, format) = tile_native(ty, raw, rows, cols, what)?;
        let format = match format {
            layout::TileFormat::Bf16 => WeightFormat::Bf16,
            layout::TileFormat::Nibble => WeightFormat::Q4k,
            layout::TileFormat::ScaledI8 => WeightFormat::ScaledI8,
        };
        Self::from_tiles(gpu, &tiled, rows, cols, format, what)
    }
}

/// A GGUF matrix of a type with a native format (`rows x cols`, row-major bytes) as tiles of that format.
pub(crate) fn tile_native(
    ty: GgmlType,
    raw: &[u8],
    rows: usize,
    cols: usize,
    what: &str,
) -> Result<(Vec<u16>, layout::TileFormat)> {
    use layout::TileFormat;
    let (tiled, format) = match ty {
        GgmlType::Q4K => (layout::tile_q4k(raw, rows, cols), TileFormat::Nibble),
        GgmlType::Q6K => (layout::tile_q6k(raw, rows, cols), TileFormat::ScaledI8),
        GgmlType::Q8_0 => (layout::tile_q8_0(raw, rows, cols), TileFormat::ScaledI8),
        GgmlType::Q5_0 => (layout::tile_q5_0(raw, rows, cols), TileFormat::ScaledI8),
        GgmlType::Q4_1 => (layout::tile_q4_1(raw, rows, cols), TileFormat::Nibble),
        GgmlType::Q4_0 => (layout::tile_q4_0(raw, rows, cols), TileFormat::ScaledI8),
        other => (
            Err(format!("{} has no native GPU format", other.name())),
            TileFormat::Bf16,
        ),
    };
    let tiled = tiled.map_err(|e| crate::error::Error::Cuda(format!("{what}: {e}")))?;
    Ok((tiled, format))
}

/// Which kernel computes a GEMV: both give the same bits for every row (kernels.cu), so the choice is speed only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemvPath {
    /// By the number of tokens: the GEMV up to `gemm_min_rows() - 1` tokens, the GEMM tile from there (the
    /// staged one where `gemm_staged_enabled`).
    Auto,
    Gemv,
    /// `gemm_mma`.
    Gemm,
    /// `gemm_staged`.
    GemmStaged,
}

/// Tokens from which a GEMV runs as the GEMM tile (`SPECULA_CUDA_GEMM_ROWS`; 0, the default, never). Measured on
/// an H200 (docs/benchmarks.md, sessions 16 and 18): while every warp split its own activations, the tile (which
/// split them once into shared memory) won from 64 tokens; with activations split once by the kernel that makes
/// them, the GEMV is faster at every size (qwen2.5-1.5b shape, 128 tokens: 6.9 ms against 12.3).
pub(crate) fn gemm_min_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("SPECULA_CUDA_GEMM_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_GEMM_MIN_ROWS)
    })
}

const DEFAULT_GEMM_MIN_ROWS: usize = 0;

/// Whether the GEMM path runs the staged tile (kernels.cu `gemm_staged`: operands copied into shared memory ahead
/// of use) instead of `gemm_mma` (`SPECULA_CUDA_GEMM=staged`; both give the GEMV's bits). Off by default until a
/// device has checked and timed it.
pub(crate) fn gemm_staged_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_GEMM").as_deref() == Ok("staged"))
}

/// The kernel a GEMV call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MatmulKernel {
    Gemv,
    GemmMma,
    /// `gemm_staged` over bf16 (0), nibble (1) or scaled-int8 (2) tiles: its index in `Kernels::gemm_staged`.
    GemmStaged(usize),
}

/// Which kernel multiplies `m` tokens by a matrix in `format` along `path`, with the GEMM from `min_rows` tokens
/// (`gemm_min_rows`; 0 never) and the staged tile in place of `gemm_mma` where `staged_on`
/// (`gemm_staged_enabled`). `gemm_mma` reads bf16 tiles only, the staged tile native ones too; a mixed matrix
/// always takes the GEMV.
fn matmul_kernel(
    format: WeightFormat,
    path: GemvPath,
    m: usize,
    min_rows: usize,
    staged_on: bool,
) -> MatmulKernel {
    let wants_gemm = match path {
        GemvPath::Auto => min_rows > 0 && m >= min_rows,
        GemvPath::Gemv => false,
        GemvPath::Gemm | GemvPath::GemmStaged => true,
    };
    let staged = match path {
        GemvPath::Auto => staged_on,
        GemvPath::GemmStaged => true,
        GemvPath::Gemv | GemvPath::Gemm => false,
    };
    match (wants_gemm, staged, format) {
        (false, _, _) | (true, _, WeightFormat::Mixed) => MatmulKernel::Gemv,
        (true, true, WeightFormat::Bf16) => MatmulKernel::GemmStaged(0),
        (true, true, WeightFormat::Q4k) => MatmulKernel::GemmStaged(1),
        (true, true, WeightFormat::ScaledI8) => MatmulKernel::GemmStaged(2),
        (true, false, WeightFormat::Bf16) => MatmulKernel::GemmMma,
        (true, false, _) => MatmulKernel::Gemv,
    }
}

/// A staged GEMM's kernel (its index in `Kernels::gemm_staged`) and tokens a block, for tiles of `format` (its
/// `MatmulKernel::GemmStaged` index) and `m` tokens: 32 tokens a block up to 32, else 64 (kernels.cu TILES x 8).
fn gemm_staged_variant(format: usize, m: usize) -> (usize, usize) {
    if m <= 32 {
        (2 * format, 32)
    } else {
        (2 * format + 1, 64)
    }
}

/// Tokens a GEMM block takes (kernels.cu: GEMM_TOKEN_GROUPS x NT x 8) for `m` tokens, and its kernel's index.
pub(crate) fn gemm_variant(m: usize) -> (usize, usize) {
    if m <= 32 {
        (0, 32)
    } else {
        (1, 64)
    }
}

/// Row blocks (16 outputs each) a GEMM block owns (kernels.cu GEMM_ROW_BLOCKS).
const GEMM_ROW_BLOCKS: usize = 4;
/// Threads of a GEMM block (kernels.cu GEMM_WARPS x 32).
const GEMM_THREADS: u32 = 8 * 32;

/// A split activation buffer for `rows` tokens of `k` inputs (layout::split_len words), zeroed: inputs past `k`
/// must stay zero, and nothing writes them.
pub(crate) fn alloc_split(gpu: &Gpu, rows: usize, k: usize, what: &str) -> Result<CudaSlice<u32>> {
    gpu.stream
        .alloc_zeros::<u32>(layout::split_len(rows, k).max(1))
        .map_err(|e| cuda_err(&format!("allocating {what}"), e))
}

/// Threads of an rms_norm block for rows of `h` floats (kernels.cu): one a 16-byte piece, at most 1024 (then up
/// to 4 pieces each). A function of `h` alone, so a row's sum has one order whatever the launch.
pub(crate) fn norm_threads(h: usize) -> u32 {
    (h / 4).div_ceil(32).clamp(1, 32) as u32 * 32
}

/// kernels.cu ATT_PARTIAL_HEADER: floats ahead of a split partial's values.
const ATTENTION_PARTIAL_HEADER: usize = 4;
/// The most blocks a row and head may split its keys over (kernels.cu ATT_MAX_SPLITS: the merging warp reads a
/// split a lane).
const MAX_ATTENTION_SPLITS: usize = 32;

/// The attention kernel's split-over-keys state for up to `rows` rows (kernels.cu attention_rows): each split's
/// partial (max, sum, values), and a counter a row and head that tells the last block to merge them.
pub(crate) struct AttentionSplits {
    partials: CudaSlice<f32>,
    /// Zeroed once; the merging block puts its counter back to zero.
    counters: CudaSlice<u32>,
    rows: usize,
    /// Blocks a row and head: the grid's third dimension.
    splits: usize,
}

impl AttentionSplits {
    /// How many blocks a row and head may take: enough that one row's heads cover the multiprocessors
    /// (`SPECULA_CUDA_ATTENTION_SPLITS=N` sets it; 1 keeps each row and head in one block). It depends on the
    /// model and the GPU, never on a step's rows, so a row's result is the same in any launch.
    pub(crate) fn splits_for(gpu: &Gpu, heads: usize) -> Result<usize> {
        match std::env::var("SPECULA_CUDA_ATTENTION_SPLITS") {
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_ATTENTION_SPLITS).contains(&n) => Ok(n),
                _ => Err(crate::error::Error::InvalidArgument(format!(
                    "SPECULA_CUDA_ATTENTION_SPLITS={v:?}: want a number of blocks from 1 to {MAX_ATTENTION_SPLITS}"
                ))),
            },
            Err(_) => Ok((gpu.sm_count / heads.max(1)).clamp(1, 16)),
        }
    }

    pub(crate) fn new(
        gpu: &Gpu,
        rows: usize,
        heads: usize,
        head_dim: usize,
        what: &str,
    ) -> Result<Self> {
        let splits = Self::splits_for(gpu, heads)?;
        // One split never touches the partials or counters.
        let (partial_rows, counter_rows) = if splits > 1 { (rows, rows) } else { (0, 0) };
        let n = partial_rows * heads * splits * (head_dim + ATTENTION_PARTIAL_HEADER);
        // SAFETY: a split's partial is written before the merging block reads it.
        let partials = unsafe { gpu.stream.alloc::<f32>(n.max(1)) }
            .map_err(|e| cuda_err(&format!("allocating {what} attention partials"), e))?;
        let counters = gpu
            .stream
            .alloc_zeros::<u32>((counter_rows * heads).max(1))
            .map_err(|e| cuda_err(&format!("allocating {what} attention counters"), e))?;
        Ok(Self {
            partials,
            counters,
            rows,
            splits,
        })
    }
}

/// Attention of `rows` rows (queries at `q`, row and cache tables at `row_table`, `seq_table`) over layer
/// `layer` of their caches, written split to `out` for the output projection.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    gpu: &Gpu,
    splits: &AttentionSplits,
    rows: usize,
    q: u64,
    out: u64,
    row_table: u64,
    seq_table: u64,
    layer: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    debug_assert!(rows <= splits.rows);
    let q_dim = heads * head_dim;
    let (variant, group) = attention_variant(heads, kv_heads, head_dim, rows);
    let blocks_a_row = heads / group;
    if rows <= ATTENTION_LIST_MAX_ROWS && attention_as_list(rows) {
        // The same items and arithmetic as below, without the grid's empty blocks (kernels.cu attention_list).
        let blocks = (rows * blocks_a_row * splits.splits)
            .min(gpu.kernels.attention_list_blocks[variant] as usize);
        launch_fn!(
            gpu,
            &gpu.kernels.attention_list[variant],
            "attention",
            (blocks as u32, 1, 1),
            gpu.kernels.attention_threads[variant],
            q,
            out,
            q_dim.div_ceil(layout::CHUNK) as i32,
            row_table,
            rows as i32,
            seq_table,
            layer as i32,
            heads as i32,
            kv_heads as i32,
            head_dim as i32,
            1.0f32 / (head_dim as f32).sqrt(),
            splits.splits as i32,
            ptr(&splits.partials, gpu),
            ptr(&splits.counters, gpu)
        );
        return Ok(());
    }
    launch_fn!(
        gpu,
        &gpu.kernels.attention[variant],
        "attention",
        (rows as u32, blocks_a_row as u32, splits.splits as u32),
        gpu.kernels.attention_threads[variant],
        q,
        out,
        q_dim.div_ceil(layout::CHUNK) as i32,
        row_table,
        seq_table,
        layer as i32,
        heads as i32,
        kv_heads as i32,
        head_dim as i32,
        1.0f32 / (head_dim as f32).sqrt(),
        ptr(&splits.partials, gpu),
        ptr(&splits.counters, gpu)
    );
    Ok(())
}

/// The attention kernel for a launch of `rows` rows of a model's heads (an index into `Kernels::attention`) and
/// how many heads it takes a block: from 2 rows, heads that share a KV head go 4, 3 or 2 to a block where their
/// number allows (head dimension <= 128), each block reading the keys and values once for all of them. Every
/// head's arithmetic is the same in all variants, so the choice changes no bit (the selftest compares them).
/// Measured on the H200 (`forward_shapes`, ms a pass, grouped / one head a block; docs/benchmarks.md session 32):
/// qwen2.5-1.5b at 64 cached keys 1 row 1.30 / 1.27, 4 rows 1.34 / 1.40, 8 rows 1.36 / 1.52, 16 rows 1.85 /
/// 1.93; at 600 keys 1 row 1.40 / 1.34, 2 rows 1.41 / 1.48, 8 rows 1.79 / 2.24; llama-3.1-8b at 256 keys 1 row
/// 4.39 / 4.26, 6 rows 4.74 / 5.13, 8 rows 4.82 / 5.49. So one row (decoding one sequence) keeps a block a head:
/// its few blocks then each take three or four heads' work in turn. `SPECULA_CUDA_ATTENTION_GROUP=0` takes one
/// head a block at any rows; `SPECULA_CUDA_ATTENTION_GROUP_MIN_ROWS=N` groups from N rows.
pub(crate) fn attention_variant(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rows: usize,
) -> (usize, usize) {
    if head_dim > 128 {
        return (1, 1);
    }
    let per_kv = heads / kv_heads.max(1);
    if !attention_grouped(rows) || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return (0, 1);
    }
    // Kernels::attention holds the G-head variants at index G.
    [4usize, 3, 2]
        .into_iter()
        .find(|&g| per_kv.is_multiple_of(g))
        .map_or((0, 1), |g| (g, g))
}

/// Rows from which attention groups heads by default (`attention_variant`).
const DEFAULT_ATTENTION_GROUP_MIN_ROWS: usize = 2;

/// Whether a launch of `rows` rows takes several heads a block where the model's heads allow (part of a captured
/// step's shape with its rows: the selftest switches it).
pub(crate) fn attention_grouped(rows: usize) -> bool {
    match ATTENTION_GROUP_OVERRIDE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            static MIN_ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
            let min_rows = *MIN_ROWS.get_or_init(|| {
                if std::env::var("SPECULA_CUDA_ATTENTION_GROUP").is_ok_and(|v| v == "0") {
                    return usize::MAX;
                }
                std::env::var("SPECULA_CUDA_ATTENTION_GROUP_MIN_ROWS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(DEFAULT_ATTENTION_GROUP_MIN_ROWS)
            });
            rows >= min_rows
        }
    }
}

/// 0: as the environment says; 1: grouped at any rows where the heads allow; 2: one head a block (the selftest
/// compares them).
static ATTENTION_GROUP_OVERRIDE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Forces heads grouped a block at any rows (Some(true)) or one a block (Some(false)) for the steps that follow;
/// None: the default.
pub(crate) fn set_attention_group(group: Option<bool>) {
    ATTENTION_GROUP_OVERRIDE.store(override_code(group), std::sync::atomic::Ordering::Relaxed);
}

/// An override's stored value: 0 for none, 1 to force on, 2 to force off.
fn override_code(force: Option<bool>) -> u8 {
    match force {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    }
}

/// The most rows an attention launch takes as a list of items (kernels.cu ATT_LIST_MAX_ROWS): decode and verify
/// steps; prompt chunks keep the grid of rows x heads x splits.
pub(crate) const ATTENTION_LIST_MAX_ROWS: usize = 64;

/// Whether launches of 12 to 64 rows take attention as a list (`SPECULA_CUDA_ATTENTION_LIST=1`; off by default: the
/// same bits either way). Session 31 made the list the default when one head took a block (16 rows 1.97 -> 1.92 ms,
/// 32 rows 3.04 -> 2.69); since heads of a KV head share a block (session 32) the grid holds a third as many blocks,
/// and on an H200 in session 40 the grid was faster at every row count measured: the real Q4_K_M 1.5B's 12-32-row
/// passes 5-7% at 14 cached tokens and 11-15% at 428, its server +15-20% at 16 streams and +10-14% at 32 (plain),
/// equal at 2-8 (docs/benchmarks.md).
fn attention_list_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_ATTENTION_LIST").is_ok_and(|v| v == "1"))
}

/// Rows from which attention runs as a list where the list is on. Measured on the H200 (qwen2.5-1.5b shape, 64-token
/// contexts, ms a pass, grid / list, one head a block, session 31): 1 row 1.26 / 1.35, 4 rows 1.39 / 1.38, 8 rows
/// 1.51 / 1.57, 16 rows 1.97 / 1.92, 32 rows 3.04 / 2.69.
const DEFAULT_ATTENTION_LIST_MIN_ROWS: usize = 12;

/// Whether a launch of `rows` rows takes attention as a list: with the list on (`SPECULA_CUDA_ATTENTION_LIST=1`),
/// from `SPECULA_CUDA_ATTENTION_LIST_MIN_ROWS` rows (default 12), unless the selftest forces it either way.
pub(crate) fn attention_as_list(rows: usize) -> bool {
    static MIN_ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    match ATTENTION_LIST_OVERRIDE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            attention_list_enabled()
                && rows
                    >= *MIN_ROWS.get_or_init(|| {
                        std::env::var("SPECULA_CUDA_ATTENTION_LIST_MIN_ROWS")
                            .ok()
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(DEFAULT_ATTENTION_LIST_MIN_ROWS)
                    })
        }
    }
}

/// 0: as the environment says; 1: list; 2: grid (the selftest compares them).
static ATTENTION_LIST_OVERRIDE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Forces attention's list (Some(true)) or grid (Some(false)) for the steps that follow; None: the default.
pub(crate) fn set_attention_list(list: Option<bool>) {
    ATTENTION_LIST_OVERRIDE.store(override_code(list), std::sync::atomic::Ordering::Relaxed);
}

/// `xs` = `x` (`m x k` f32, k even) split for a GEMV, where no producing kernel writes it so.
pub(crate) fn split_rows(gpu: &Gpu, x: u64, xs: u64, m: usize, k: usize) -> Result<()> {
    launch!(
        gpu,
        split_rows,
        (m as u32, 1, 1),
        256,
        x,
        xs,
        k as i32,
        k.div_ceil(layout::CHUNK) as i32
    );
    Ok(())
}

/// `y[m x n] (+)= x[m x w.cols] . w^T` for the first `n` rows of `w` (split-K through `scratch` when the
/// shape asks for it), `x` split (kernels.cu `store_split_pair`: an `alloc_split` buffer written by rms_norm,
/// attention, a SiLU GEMV or `split_rows`); with `silu_pairs`, `y` = SiLU(gate) * up of the interleaved rows,
/// `m x n/2` written split for the next GEMV.
/// With `defer`, split-K partial sums are left in `scratch` for the next kernel to add up (qkv_post, rms_norm)
/// and their count is returned (0 when `y` already holds the result): that saves a reduction launch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemv(
    gpu: &Gpu,
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
    gemv_with(
        gpu,
        w,
        n,
        x,
        y,
        m,
        accumulate,
        silu_pairs,
        scratch,
        defer,
        GemvPath::Auto,
    )
}

/// `gemv` through a chosen kernel (selftest compares them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemv_with(
    gpu: &Gpu,
    w: &Matrix,
    n: usize,
    x: u64,
    y: u64,
    m: usize,
    accumulate: bool,
    silu_pairs: bool,
    scratch: u64,
    defer: bool,
    path: GemvPath,
) -> Result<usize> {
    let splits = if silu_pairs {
        1
    } else {
        layout::splits_for(n, w.cols, gpu.sm_count)
    };
    let blocks = n.div_ceil(layout::ROW_BLOCK);
    // Both GEMM tiles take the GEMV's arguments, a block for 4 row blocks and `tokens` tokens.
    let gemm = match matmul_kernel(w.format, path, m, gemm_min_rows(), gemm_staged_enabled()) {
        MatmulKernel::GemmStaged(format) => {
            let (variant, tokens) = gemm_staged_variant(format, m);
            Some((&gpu.kernels.gemm_staged[variant], "gemm_staged", tokens))
        }
        MatmulKernel::GemmMma => {
            let (variant, tokens) = gemm_variant(m);
            Some((&gpu.kernels.gemm_mma[variant], "gemm_mma", tokens))
        }
        MatmulKernel::Gemv => None,
    };
    if let Some((function, name, tokens)) = gemm {
        // Token groups vary fastest, so the blocks that share a row block's weights run together (L2 reuse).
        launch_fn!(
            gpu,
            function,
            name,
            (
                m.div_ceil(tokens) as u32,
                blocks.div_ceil(GEMM_ROW_BLOCKS) as u32,
                splits as u32
            ),
            GEMM_THREADS,
            ptr(&w.data, gpu),
            x,
            y,
            n as i32,
            w.cols as i32,
            w.chunks as i32,
            m as i32,
            accumulate as i32,
            splits as i32,
            scratch,
            silu_pairs as i32
        );
    } else {
        launch_gemv_tile(
            gpu, w, n, x, y, m, accumulate, silu_pairs, scratch, splits, blocks,
        )?;
    }
    if splits > 1 && defer {
        return Ok(splits);
    }
    if splits > 1 {
        let total = m * n;
        let blocks = total.div_ceil(256).min(65_535) as u32;
        launch!(
            gpu,
            splitk_reduce,
            (blocks, 1, 1),
            256,
            scratch,
            y,
            n as i32,
            m as i32,
            splits as i32,
            accumulate as i32
        );
    }
    Ok(0)
}

/// Whether 17-24 tokens run as the 24-token tile (default) rather than the 32-token one (`SPECULA_CUDA_GEMV_24=0`).
/// The same bits either way (a tile's width never changes a sum). On an H200 the 24-token tile made 17-24-row passes
/// of the real Q4_K_M 1.5B 10-11% faster, the bf16 1.5B shape's 3-4% and the 8b's 2% (docs/benchmarks.md, session 40).
fn gemv_24_tokens() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_GEMV_24").map_or(true, |v| v != "0"))
}

/// The GEMV kernel variant (its index in `Kernels::gemv_mma` and the other format tables) and tokens a block for
/// `m` tokens: 8 tokens a block for decode and verify (4 chunks in flight a warp for unsplit matrices and split
/// ones of few chunks a warp: `deep_split`; 2 for the other split ones), 16 up to 16 rows (long verifies, trees),
/// 24 up to 24 where `tile_24` (else 32), 32 past that (batches, prefill). The same arithmetic per output whichever
/// runs.
fn gemv_tile(m: usize, split: bool, deep_split: bool, tile_24: bool) -> (usize, usize) {
    match m.div_ceil(layout::TOKENS) {
        0 | 1 if split && !deep_split => (1, layout::TOKENS),
        0 | 1 => (0, layout::TOKENS),
        2 => (2, 2 * layout::TOKENS),
        3 if tile_24 => (4, 3 * layout::TOKENS),
        _ => (3, 4 * layout::TOKENS),
    }
}

/// Split matrices at 8 tokens whose warps take at most this many chunks a split keep 4 chunks in flight a warp,
/// the others 2 (`SPECULA_CUDA_SPLIT_DEPTH4_MAX` overrides it, for kernel work on the device). With few chunks a
/// warp, 4 in flight save round trips (qwen2.5-1.5b, whose split QKV, output and down projections take 4, 4 and
/// 12 chunks a warp: 750 -> 762-786 tok/s); with many, 2 keep more blocks resident (llama-3.1-8b's down
/// projection, 37 chunks a warp: 4 in flight lost 2%). Measured on an H200, docs/benchmarks.md, session 30.
fn split_depth4_max() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("SPECULA_CUDA_SPLIT_DEPTH4_MAX")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(12)
    })
}

/// The GEMV's own launch: a block per row block and 8, 16 or 32 tokens.
#[allow(clippy::too_many_arguments)]
fn launch_gemv_tile(
    gpu: &Gpu,
    w: &Matrix,
    n: usize,
    x: u64,
    y: u64,
    m: usize,
    accumulate: bool,
    silu_pairs: bool,
    scratch: u64,
    splits: usize,
    blocks: usize,
) -> Result<()> {
    let deep_split = w.chunks.div_ceil(splits).div_ceil(layout::WARPS) <= split_depth4_max();
    let (variant, tokens) = gemv_tile(m, splits > 1, deep_split, gemv_24_tokens());
    let (kernels, name) = match w.format {
        WeightFormat::Bf16 => (&gpu.kernels.gemv_mma, "gemv_mma"),
        WeightFormat::Q4k => (&gpu.kernels.gemv_q4k, "gemv_q4k"),
        WeightFormat::ScaledI8 => (&gpu.kernels.gemv_i8, "gemv_i8"),
        WeightFormat::Mixed => {
            let parts = w.parts.as_ref().ok_or_else(|| {
                crate::error::Error::Cuda("a mixed matrix without its parts".into())
            })?;
            launch_fn!(
                gpu,
                &gpu.kernels.gemv_mixed[variant],
                "gemv_mixed",
                (blocks as u32, m.div_ceil(tokens) as u32, splits as u32),
                (layout::WARPS * 32) as u32,
                ptr(&w.data, gpu),
                x,
                y,
                n as i32,
                w.cols as i32,
                w.chunks as i32,
                m as i32,
                accumulate as i32,
                splits as i32,
                scratch,
                silu_pairs as i32,
                parts.first[0] as i32,
                parts.first[1] as i32,
                parts.offsets[1] as u64,
                parts.offsets[2] as u64,
                parts.packed_formats()
            );
            return Ok(());
        }
    };
    launch_fn!(
        gpu,
        &kernels[variant],
        name,
        (blocks as u32, m.div_ceil(tokens) as u32, splits as u32),
        (layout::WARPS * 32) as u32,
        ptr(&w.data, gpu),
        x,
        y,
        n as i32,
        w.cols as i32,
        w.chunks as i32,
        m as i32,
        accumulate as i32,
        splits as i32,
        scratch,
        silu_pairs as i32
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn matmul_kernels_follow_the_path_the_threshold_and_the_format() {
        use super::{matmul_kernel as pick, GemvPath as P, MatmulKernel as K, WeightFormat as F};
        let formats = [F::Bf16, F::Q4k, F::ScaledI8, F::Mixed];
        for f in formats {
            // The GEMV path, and Auto below the threshold or with the GEMM off, never take a GEMM tile.
            for staged in [false, true] {
                assert_eq!(pick(f, P::Gemv, 500, 17, staged), K::Gemv);
                assert_eq!(pick(f, P::Auto, 16, 17, staged), K::Gemv);
                assert_eq!(pick(f, P::Auto, 500, 0, staged), K::Gemv);
            }
        }
        // gemm_mma reads bf16 tiles only.
        assert_eq!(pick(F::Bf16, P::Auto, 17, 17, false), K::GemmMma);
        assert_eq!(pick(F::Bf16, P::Gemm, 1, 0, true), K::GemmMma);
        for f in [F::Q4k, F::ScaledI8, F::Mixed] {
            assert_eq!(pick(f, P::Auto, 64, 17, false), K::Gemv);
            assert_eq!(pick(f, P::Gemm, 64, 0, false), K::Gemv);
        }
        // The staged tile reads every format but mixed ones, each through its kernel.
        for (f, kernel) in [(F::Bf16, 0), (F::Q4k, 1), (F::ScaledI8, 2)] {
            assert_eq!(pick(f, P::Auto, 33, 33, true), K::GemmStaged(kernel));
            assert_eq!(pick(f, P::GemmStaged, 1, 0, false), K::GemmStaged(kernel));
        }
        assert_eq!(pick(F::Mixed, P::GemmStaged, 64, 0, true), K::Gemv);
        assert_eq!(pick(F::Mixed, P::Auto, 64, 33, true), K::Gemv);
        // Each format's 32- and 64-token kernels, in the order context.rs loads them.
        let names = [
            "gemm_staged_32",
            "gemm_staged",
            "gemm_staged_q4k_32",
            "gemm_staged_q4k",
            "gemm_staged_i8_32",
            "gemm_staged_i8",
        ];
        for (format, tiles) in [
            (0, "gemm_staged"),
            (1, "gemm_staged_q4k"),
            (2, "gemm_staged_i8"),
        ] {
            for (m, tokens, suffix) in
                [(1, 32, "_32"), (32, 32, "_32"), (33, 64, ""), (500, 64, "")]
            {
                let (variant, t) = super::gemm_staged_variant(format, m);
                assert_eq!(
                    (names[variant], t),
                    (format!("{tiles}{suffix}").as_str(), tokens)
                );
            }
        }
    }

    use super::*;

    /// Each row count gets the narrowest tile that holds it, and each variant index names the kernel of that width
    /// in the kernel tables (context.rs KERNEL_NAMES lists them in table order after the 8-token pair).
    #[test]
    fn gemv_tiles_fit_the_rows_and_index_their_kernels() {
        let names: Vec<&str> = crate::backend::cuda::context::KERNEL_NAMES
            .iter()
            .copied()
            .filter(|n| n.starts_with("gemv_mma_"))
            .collect();
        let suffix = |variant: usize| names[variant].trim_start_matches("gemv_mma_");
        for tile_24 in [false, true] {
            for m in 1..=40 {
                for (split, deep) in [(false, false), (true, false), (true, true)] {
                    let (variant, tokens) = gemv_tile(m, split, deep, tile_24);
                    assert!(tokens >= m.min(32), "{m} rows in a {tokens}-token tile");
                    let narrowest = [8, 16, 24, 32]
                        .into_iter()
                        .find(|&t| t >= m && (tile_24 || t != 24))
                        .unwrap_or(32);
                    assert_eq!(tokens, narrowest, "{m} rows, 24-token tile {tile_24}");
                    let expected = match tokens {
                        8 if split && !deep => "8_d2".to_string(),
                        8 => "8_d4".to_string(),
                        t => t.to_string(),
                    };
                    assert_eq!(suffix(variant), expected, "{m} rows");
                }
            }
        }
    }

    /// The value of `#define NAME VALUE` in kernels.cu.
    fn kernel_define(name: &str) -> usize {
        let prefix = format!("#define {name} ");
        let line = crate::backend::cuda::KERNELS_SOURCE
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("kernels.cu has no #define {name}"));
        line[prefix.len()..]
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("#define {name}: {e}"))
    }

    /// Heads sharing a KV head go 4, 3 or 2 a block from 2 rows, where their number allows, and each grouped
    /// variant sits at its group's index in the kernel table (kernels.cu attention_128_gG).
    #[test]
    fn attention_groups_the_heads_of_a_kv_head_from_two_rows() {
        // qwen2.5-1.5b: 12 heads over 2 KV heads.
        assert_eq!(attention_variant(12, 2, 128, 1), (0, 1));
        assert_eq!(attention_variant(12, 2, 128, 2), (3, 3));
        assert_eq!(attention_variant(12, 2, 128, 64), (3, 3));
        // llama-3.1-8b: 32 over 8.
        assert_eq!(attention_variant(32, 8, 128, 8), (4, 4));
        // qwen2.5-0.5b: 14 over 2 (7 a KV head: no group divides it).
        assert_eq!(attention_variant(14, 2, 64, 8), (0, 1));
        // Two a KV head; plain multi-head attention; head dimension 256 (one head a block, its own kernel).
        assert_eq!(attention_variant(8, 4, 64, 8), (2, 2));
        assert_eq!(attention_variant(16, 16, 64, 8), (0, 1));
        assert_eq!(attention_variant(8, 2, 256, 8), (1, 1));
        let names = crate::backend::cuda::context::KERNEL_NAMES;
        for g in 2..=4 {
            assert!(names.contains(&format!("attention_128_g{g}").as_str()));
            assert!(names.contains(&format!("attention_list_128_g{g}").as_str()));
        }
    }

    #[test]
    fn kernel_constants_match_the_host_side() {
        assert_eq!(
            kernel_define("ATT_PARTIAL_HEADER"),
            ATTENTION_PARTIAL_HEADER
        );
        // The merge reads a split a lane.
        assert_eq!(kernel_define("ATT_MAX_SPLITS"), MAX_ATTENTION_SPLITS);
        assert!(kernel_define("ATT_MAX_SPLITS") <= 32);
        assert_eq!(
            kernel_define("SPLITK_MAX"),
            super::super::layout::MAX_SPLITS
        );
    }

    #[test]
    fn norm_threads_cover_every_row_width_the_kernel_takes() {
        let pieces_a_thread = kernel_define("NORM_PIECES");
        for h in [4, 64, 576, 896, 1536, 2048, 3584, 4096, 5120, 8192, 16384] {
            let threads = norm_threads(h) as usize;
            assert_eq!(threads % 32, 0, "h {h}: whole warps");
            assert!(threads <= 1024, "h {h}: {threads} threads");
            assert!(
                threads * pieces_a_thread * 4 >= h,
                "h {h}: {threads} threads of {pieces_a_thread} pieces miss some of the row"
            );
        }
    }
}
