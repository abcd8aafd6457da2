//! Weight matrices in their checkpoint's storage type (GGUF quantized blocks, f32/f16/bf16) and the matrix
//! multiply that reads them.
//!
//! The matmul is **batch invariant**: output element (row, col) is always computed by the same dot-product kernel
//! over the same quantized activation row, whatever the number of rows in the call. That is what makes a verify
//! pass over k+1 tokens give bitwise the logits of k+1 single-token steps, so greedy speculation is lossless.
//! It also reads each weight row once for all activation rows (the row loop is innermost), so verifying a few
//! tokens costs little more weight traffic than one.

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0, GgmlType as BlockType,
};
use half::{bf16, f16};

use super::kernels::{FastRowsDot, RowsKernel};
use super::repack::{
    BlockQ4KInterleaved, BlockQ4_1Interleaved, BlockQ5_0Interleaved, BlockQ6KInterleaved,
    BlockQ8_0Interleaved, Interleaved,
};
pub use crate::model::dtype::GgmlType;

/// Blocks of one storage type, in row-major order (each row holds `cols / block_size` blocks).
enum Storage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    Q4_0(Vec<BlockQ4_0>),
    /// Q4_1 and Q5_0 rows are interleaved in groups of 8 blocks (see `repack`).
    Q4_1(Vec<BlockQ4_1Interleaved>),
    Q5_0(Vec<BlockQ5_0Interleaved>),
    Q5_1(Vec<BlockQ5_1>),
    /// Interleaved in groups of 8 blocks too (see `repack`).
    Q8_0(Vec<BlockQ8_0Interleaved>),
    Q2K(Vec<BlockQ2K>),
    Q3K(Vec<BlockQ3K>),
    /// Q4_K and Q6_K weights are kept in the interleaved order of the multi-row kernels (see `repack`).
    Q4K(Vec<BlockQ4KInterleaved>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6KInterleaved>),
}

/// Runs `$body` with `$blocks` bound to the typed block vector of a `Storage`.
macro_rules! with_blocks {
    ($storage:expr, $blocks:ident => $body:expr) => {
        match $storage {
            Storage::F32($blocks) => $body,
            Storage::F16($blocks) => $body,
            Storage::BF16($blocks) => $body,
            Storage::Q4_0($blocks) => $body,
            Storage::Q4_1($blocks) => $body,
            Storage::Q5_0($blocks) => $body,
            Storage::Q5_1($blocks) => $body,
            Storage::Q8_0($blocks) => $body,
            Storage::Q2K($blocks) => $body,
            Storage::Q3K($blocks) => $body,
            Storage::Q4K($blocks) => $body,
            Storage::Q5K($blocks) => $body,
            Storage::Q6K($blocks) => $body,
        }
    };
}

/// Typed access to a `Storage`'s blocks (for code generic over the block type).
trait FromStorage: Sized {
    fn blocks(storage: &Storage) -> Option<&[Self]>;
}

macro_rules! from_storage {
    ($($variant:ident => $t:ty),*) => {$(
        impl FromStorage for $t {
            fn blocks(storage: &Storage) -> Option<&[Self]> {
                match storage {
                    Storage::$variant(b) => Some(b),
                    _ => None,
                }
            }
        }
    )*};
}

from_storage!(
    F32 => f32, F16 => f16, BF16 => bf16, Q4_0 => BlockQ4_0, Q4_1 => BlockQ4_1Interleaved, Q5_0 => BlockQ5_0Interleaved,
    Q5_1 => BlockQ5_1, Q8_0 => BlockQ8_0Interleaved, Q2K => BlockQ2K, Q3K => BlockQ3K,
    Q4K => BlockQ4KInterleaved, Q5K => BlockQ5K, Q6K => BlockQ6KInterleaved
);

/// A `rows x cols` matrix (or a vector when rows == 1) stored as the checkpoint stores it.
pub struct Weight {
    storage: Storage,
    pub rows: usize,
    pub cols: usize,
}

fn blocks_from_bytes<T: BlockType>(bytes: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let n = bytes.len() / size;
    let mut out: Vec<T> = (0..n).map(|_| T::zeros()).collect();
    // SAFETY: every block type here is a #[repr(C)] plain-old-data struct whose size matches the GGML block
    // size (candle asserts that at compile time), and `out` has room for exactly `n * size` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr() as *mut u8, n * size);
    }
    out
}

/// Index of block `b` of `row` in a matrix of `rows` rows of `per_row` blocks stored in `T`'s layout:
/// row-major, or pair-interleaved when `T::PAIRED_ROWS` (rows 2p and 2p + 1 alternate block by block; a last
/// odd row is stored alone).
fn block_index<T: FastRowsDot>(row: usize, b: usize, rows: usize, per_row: usize) -> usize {
    if T::PAIRED_ROWS && (row % 2 == 1 || row + 1 < rows) {
        (row / 2) * 2 * per_row + 2 * b + row % 2
    } else {
        row * per_row + b
    }
}

/// Row-major blocks rearranged into `T`'s storage layout (see `block_index`).
fn arrange<T: FastRowsDot + Clone>(row_major: Vec<T>, rows: usize, per_row: usize) -> Vec<T> {
    if !T::PAIRED_ROWS || rows < 2 {
        return row_major;
    }
    let mut order: Vec<usize> = vec![0; row_major.len()];
    for row in 0..rows {
        for b in 0..per_row {
            order[block_index::<T>(row, b, rows, per_row)] = row * per_row + b;
        }
    }
    order.into_iter().map(|i| row_major[i].clone()).collect()
}

/// One row's blocks, contiguous (borrowed when the layout already stores the row alone).
fn row_blocks<T: FastRowsDot + Clone>(
    blocks: &[T],
    row: usize,
    rows: usize,
    per_row: usize,
) -> std::borrow::Cow<'_, [T]> {
    let first = block_index::<T>(row, 0, rows, per_row);
    if per_row < 2 || block_index::<T>(row, 1, rows, per_row) == first + 1 {
        std::borrow::Cow::Borrowed(&blocks[first..first + per_row])
    } else {
        std::borrow::Cow::Owned(
            (0..per_row)
                .map(|b| blocks[block_index::<T>(row, b, rows, per_row)].clone())
                .collect(),
        )
    }
}

impl Weight {
    /// Builds a weight from raw little-endian GGML bytes.
    pub fn from_raw(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        let elements = rows
            .checked_mul(cols)
            .ok_or_else(|| format!("{rows} x {cols} elements overflow"))?;
        let expected = ty.bytes_for(elements).ok_or_else(|| {
            format!(
                "{elements} elements do not fill whole {} blocks (or their size overflows)",
                ty.name()
            )
        })?;
        if bytes.len() != expected {
            return Err(format!("has {} bytes, expected {expected}", bytes.len()));
        }
        if !cols.is_multiple_of(ty.block_size()) {
            return Err(format!(
                "row length {cols} is not a multiple of {}'s block size",
                ty.name()
            ));
        }
        let storage = match ty {
            GgmlType::F32 => Storage::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            GgmlType::F16 => Storage::F16(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            ),
            GgmlType::BF16 => Storage::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            ),
            GgmlType::Q4_0 => Storage::Q4_0(blocks_from_bytes(bytes)),
            GgmlType::Q4_1 => Storage::Q4_1(
                blocks_from_bytes::<BlockQ4_1>(bytes)
                    .chunks(cols / 32)
                    .flat_map(BlockQ4_1Interleaved::row_from_ggml)
                    .collect(),
            ),
            GgmlType::Q5_0 => Storage::Q5_0(
                blocks_from_bytes::<BlockQ5_0>(bytes)
                    .chunks(cols / 32)
                    .flat_map(BlockQ5_0Interleaved::row_from_ggml)
                    .collect(),
            ),
            GgmlType::Q5_1 => Storage::Q5_1(blocks_from_bytes(bytes)),
            GgmlType::Q8_0 => Storage::Q8_0(
                blocks_from_bytes::<BlockQ8_0>(bytes)
                    .chunks(cols / 32)
                    .flat_map(BlockQ8_0Interleaved::row_from_ggml)
                    .collect(),
            ),
            GgmlType::Q2K => Storage::Q2K(blocks_from_bytes(bytes)),
            GgmlType::Q3K => Storage::Q3K(blocks_from_bytes(bytes)),
            GgmlType::Q4K => Storage::Q4K(arrange(
                blocks_from_bytes::<BlockQ4K>(bytes)
                    .iter()
                    .map(BlockQ4KInterleaved::from_ggml)
                    .collect(),
                rows,
                cols / 256,
            )),
            GgmlType::Q5K => Storage::Q5K(blocks_from_bytes(bytes)),
            GgmlType::Q6K => Storage::Q6K(arrange(
                blocks_from_bytes::<BlockQ6K>(bytes)
                    .iter()
                    .map(BlockQ6KInterleaved::from_ggml)
                    .collect(),
                rows,
                cols / 256,
            )),
        };
        Ok(Weight {
            storage,
            rows,
            cols,
        })
    }

    pub fn from_f32(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "from_f32: data length does not match shape"
        );
        Weight {
            storage: Storage::F32(data),
            rows,
            cols,
        }
    }

    pub fn from_f16(data: Vec<f16>, rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "from_f16: data length does not match shape"
        );
        Weight {
            storage: Storage::F16(data),
            rows,
            cols,
        }
    }

    pub fn from_bf16(data: Vec<bf16>, rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "from_bf16: data length does not match shape"
        );
        Weight {
            storage: Storage::BF16(data),
            rows,
            cols,
        }
    }

    /// Quantizes f32 data into `ty` blocks (tests use this to build quantized tiny models).
    pub fn quantize(data: &[f32], rows: usize, cols: usize, ty: GgmlType) -> Result<Self, String> {
        if data.len() != rows * cols || !cols.is_multiple_of(ty.block_size()) {
            return Err(format!(
                "cannot quantize {} values as {rows}x{cols} {}",
                data.len(),
                ty.name()
            ));
        }
        // Row by row: some storage types arrange blocks per row (interleaved Q5_0).
        fn q<T: BlockType + FastRowsDot + Clone>(data: &[f32], cols: usize) -> Vec<T> {
            let per_row = cols / T::BLCK_SIZE;
            let mut out: Vec<T> = (0..data.len() / T::BLCK_SIZE).map(|_| T::zeros()).collect();
            for (x, y) in data.chunks(cols).zip(out.chunks_mut(per_row)) {
                T::from_float(x, y);
            }
            arrange(out, data.len() / cols.max(1), per_row)
        }
        let bs = cols;
        let storage = match ty {
            GgmlType::F32 => Storage::F32(data.to_vec()),
            GgmlType::F16 => Storage::F16(data.iter().map(|&x| f16::from_f32(x)).collect()),
            GgmlType::BF16 => Storage::BF16(data.iter().map(|&x| bf16::from_f32(x)).collect()),
            GgmlType::Q4_0 => Storage::Q4_0(q(data, bs)),
            GgmlType::Q4_1 => Storage::Q4_1(q(data, bs)),
            GgmlType::Q5_0 => Storage::Q5_0(q(data, bs)),
            GgmlType::Q5_1 => Storage::Q5_1(q(data, bs)),
            GgmlType::Q8_0 => Storage::Q8_0(q(data, bs)),
            GgmlType::Q2K => Storage::Q2K(q(data, bs)),
            GgmlType::Q3K => Storage::Q3K(q(data, bs)),
            GgmlType::Q4K => Storage::Q4K(q(data, bs)),
            GgmlType::Q5K => Storage::Q5K(q(data, bs)),
            GgmlType::Q6K => Storage::Q6K(q(data, bs)),
        };
        Ok(Weight {
            storage,
            rows,
            cols,
        })
    }

    pub fn dtype(&self) -> GgmlType {
        match &self.storage {
            Storage::F32(_) => GgmlType::F32,
            Storage::F16(_) => GgmlType::F16,
            Storage::BF16(_) => GgmlType::BF16,
            Storage::Q4_0(_) => GgmlType::Q4_0,
            Storage::Q4_1(_) => GgmlType::Q4_1,
            Storage::Q5_0(_) => GgmlType::Q5_0,
            Storage::Q5_1(_) => GgmlType::Q5_1,
            Storage::Q8_0(_) => GgmlType::Q8_0,
            Storage::Q2K(_) => GgmlType::Q2K,
            Storage::Q3K(_) => GgmlType::Q3K,
            Storage::Q4K(_) => GgmlType::Q4K,
            Storage::Q5K(_) => GgmlType::Q5K,
            Storage::Q6K(_) => GgmlType::Q6K,
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        self.dtype().bytes_for(self.rows * self.cols).unwrap_or(0)
    }

    /// The storage as GGML little-endian bytes (what a GGUF file holds for this tensor).
    pub fn raw_bytes(&self) -> Vec<u8> {
        fn bytes_of<T>(v: &[T]) -> Vec<u8> {
            // SAFETY: the storage types are plain-old-data (f32, f16, bf16, #[repr(C)] GGML blocks).
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
                .to_vec()
        }
        // Interleaved K-quants: each row gathered from the storage layout and converted back to GGML order.
        fn k_quant_rows<T: Interleaved + FastRowsDot + Clone>(
            b: &[T],
            rows: usize,
            per_row: usize,
        ) -> Vec<u8> {
            bytes_of(
                &(0..rows)
                    .flat_map(|r| T::ggml_row(&row_blocks(b, r, rows, per_row)).into_owned())
                    .collect::<Vec<_>>(),
            )
        }
        let per_row = self.cols / self.dtype().block_size();
        match &self.storage {
            Storage::Q4K(b) => k_quant_rows(b, self.rows, per_row),
            Storage::Q6K(b) => k_quant_rows(b, self.rows, per_row),
            Storage::Q5_0(b) => bytes_of(
                &b.chunks(self.cols / 32)
                    .flat_map(|row| BlockQ5_0Interleaved::row_to_ggml(row).into_owned())
                    .collect::<Vec<_>>(),
            ),
            Storage::Q4_1(b) => bytes_of(
                &b.chunks(self.cols / 32)
                    .flat_map(|row| BlockQ4_1Interleaved::row_to_ggml(row).into_owned())
                    .collect::<Vec<_>>(),
            ),
            Storage::Q8_0(b) => bytes_of(
                &b.chunks(self.cols / 32)
                    .flat_map(|row| BlockQ8_0Interleaved::row_to_ggml(row).into_owned())
                    .collect::<Vec<_>>(),
            ),
            storage => with_blocks!(storage, blocks => bytes_of(blocks)),
        }
    }

    /// Dequantizes one row into `out` (embedding lookup).
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        debug_assert!(row < self.rows && out.len() == self.cols);
        with_blocks!(&self.storage, blocks => {
            let per_row = blocks.len() / self.rows;
            BlockType::to_float(&row_blocks(blocks, row, self.rows, per_row), out);
        })
    }

    /// The whole matrix as f32, row-major (norm vectors and tests).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, chunk) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row_to_f32(r, chunk);
        }
        out
    }

    /// `out[m x rows] = x[m x cols] @ self^T`. Batch invariant (see module docs). Uses the process-wide
    /// kernel choice ([`set_matmul_kernel`]; fast by default).
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        self.matmul_with(matmul_kernel(), x, m, out)
    }

    /// `matmul` with an explicit kernel choice (tests and benchmarks compare the two).
    pub fn matmul_with(&self, kernel: MatmulKernel, x: &[f32], m: usize, out: &mut [f32]) {
        self.first_rows_with(kernel, self.rows, x, m, out)
    }

    /// `matmul` against the first `rows` rows only: `out[m x rows]` (an LM head restricted to the first token
    /// ids). Each element equals the full matmul's (same kernel, same quantized input).
    pub fn matmul_first_rows(&self, rows: usize, x: &[f32], m: usize, out: &mut [f32]) {
        self.first_rows_with(matmul_kernel(), rows, x, m, out)
    }

    fn first_rows_with(
        &self,
        kernel: MatmulKernel,
        rows: usize,
        x: &[f32],
        m: usize,
        out: &mut [f32],
    ) {
        assert!(
            rows <= self.rows,
            "matmul: {rows} rows of a {}-row weight",
            self.rows
        );
        assert_eq!(x.len(), m * self.cols, "matmul: input is not m x cols");
        assert_eq!(out.len(), m * rows, "matmul: output is not m x rows");
        with_blocks!(&self.storage, blocks => {
            matmul_blocks(blocks, self.rows, rows, self.cols, x, m, out, kernel_of(blocks, kernel))
        })
    }

    /// Several matmuls of the same input, e.g. the Q, K and V projections: `outs[i][m x rows_i] = x @ ws[i]^T`.
    /// When the weights share a storage type and row length, the input is quantized once and all outputs are
    /// computed in one parallel pass (fewer pool wake-ups, better balance for small matrices); the results are
    /// bitwise those of separate `matmul` calls (same kernel, same quantized input).
    pub fn matmul_many(ws: &[&Weight], x: &[f32], m: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), outs.len(), "matmul_many: one output per weight");
        let Some(first) = ws.first() else { return };
        let same = ws
            .iter()
            .all(|w| w.dtype() == first.dtype() && w.cols == first.cols);
        if !same || ws.len() == 1 {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                w.matmul(x, m, out);
            }
            return;
        }
        let kernel = matmul_kernel();
        with_blocks!(&first.storage, blocks => matmul_many_typed(blocks, ws, x, m, outs, kernel))
    }

    /// Whether `matmul` has a multi-row kernel for this storage type in this build.
    pub fn has_fast_kernel(&self) -> bool {
        with_blocks!(&self.storage, blocks => has_fast_kernel(blocks))
    }
}

/// Which dot-product kernel a matmul uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// Multi-row kernels (each weight block unpacked once per tile of activation rows) where this build has
    /// one for the storage type; the reference otherwise.
    Fast,
    /// candle's single-row `vec_dot`, once per activation row: the simple reference.
    Reference,
}

static USE_REFERENCE_KERNEL: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Chooses the kernel every `Weight::matmul` in this process uses (benchmarks compare the two side by side).
pub fn set_matmul_kernel(kernel: MatmulKernel) {
    USE_REFERENCE_KERNEL.store(
        kernel == MatmulKernel::Reference,
        std::sync::atomic::Ordering::Relaxed,
    );
}

pub fn matmul_kernel() -> MatmulKernel {
    if USE_REFERENCE_KERNEL.load(std::sync::atomic::Ordering::Relaxed) {
        MatmulKernel::Reference
    } else {
        MatmulKernel::Fast
    }
}

fn has_fast_kernel<T: FastRowsDot>(_blocks: &[T]) -> bool {
    T::fast_kernel().is_some()
}

/// The kernel a matmul over `T` blocks runs: the multi-row one when asked for and built, else the reference.
fn kernel_of<T: FastRowsDot>(_blocks: &[T], kernel: MatmulKernel) -> RowsKernel<T> {
    match kernel {
        MatmulKernel::Fast => T::fast_kernel(),
        MatmulKernel::Reference => None,
    }
    .unwrap_or_else(T::reference_kernel)
}

/// Rows of weight columns handled per work item: small enough to balance two threads, large enough to amortize.
const COLS_PER_ITEM: usize = 16;

/// Passes of more activation rows than this (prompts) go through a work item's weight rows in chunks of rows.
const CHUNKED_PASS_ROWS: usize = 32;
/// Activation rows in such a chunk, at most: one tile of the Q4_K pair kernel (`kernels::pair_rows!`). On a
/// 552-token prompt of qwen2.5-coder-1.5b on 2 Zen 4 cores, chunks of 8 rows prefilled at 120-124 tok/s, 16 at
/// 115-119, 32 at 118, 4 at 110-112, unchunked at 97-102 (docs/benchmarks.md, session 42).
const ROW_CHUNK: usize = 8;

/// Activation rows a work item dots with its weight rows at a time: all of a short pass (decode, verify, a
/// batch of streams: the kernels balance their own tiles), balanced chunks of at most `ROW_CHUNK` of a long one.
fn row_chunk(m: usize) -> usize {
    if m <= CHUNKED_PASS_ROWS {
        return m.max(1);
    }
    m.div_ceil(m.div_ceil(ROW_CHUNK))
}

/// `out[m x n]`: the first `n` rows of a weight of `stored_rows` rows (its storage layout depends on that).
#[allow(clippy::too_many_arguments)]
fn matmul_blocks<T: BlockType + FastRowsDot + Clone>(
    weight: &[T],
    stored_rows: usize,
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    kernel: RowsKernel<T>,
) {
    let (x_q, x_side) = quantize_activations(&kernel, x, m, k);
    let part = Part {
        weight,
        rows: n,
        stored_rows,
        out: SendPtr(out.as_mut_ptr()),
    };
    run_parts(std::slice::from_ref(&part), k, &x_q, &x_side, m, &kernel);
}

/// Activations quantized once per call to the kernel's partner type (Q8_0/Q8_1/Q8_K, or f32/f16) and prepared
/// for the kernel (reordered, per-block side data; see `kernels::PrepareActivations`).
fn quantize_activations<T: BlockType>(
    kernel: &RowsKernel<T>,
    x: &[f32],
    m: usize,
    k: usize,
) -> (Vec<T::VecDotType>, Vec<f32>) {
    let vd_per_row = k / T::VecDotType::BLCK_SIZE;
    let mut x_q: Vec<T::VecDotType> = (0..m * vd_per_row)
        .map(|_| T::VecDotType::zeros())
        .collect();
    for r in 0..m {
        (kernel.quantize)(
            &x[r * k..(r + 1) * k],
            &mut x_q[r * vd_per_row..(r + 1) * vd_per_row],
        );
    }
    let mut side = Vec::new();
    (kernel.prepare)(&mut x_q, vd_per_row, &mut side);
    (x_q, side)
}

/// One weight matrix of a (possibly grouped) matmul and where its `m x rows` output goes: its first `rows`
/// rows of `stored_rows` (the storage layout depends on the latter, see `block_index`).
struct Part<'a, T> {
    weight: &'a [T],
    rows: usize,
    stored_rows: usize,
    out: SendPtr,
}

/// Computes every part's output in one parallel pass over work items of COLS_PER_ITEM weight rows. Rows stored
/// as pairs go through the kernel's pair version when it has one (else each row is gathered and dotted alone).
fn run_parts<T: BlockType + FastRowsDot + Clone>(
    parts: &[Part<'_, T>],
    k: usize,
    x_q: &[T::VecDotType],
    x_side: &[f32],
    m: usize,
    kernel: &RowsKernel<T>,
) {
    let blocks_per_row = k / T::BLCK_SIZE;
    // First work item of each part, and the total.
    let mut first_item = Vec::with_capacity(parts.len() + 1);
    let mut total = 0;
    for p in parts {
        first_item.push(total);
        total += p.rows.div_ceil(COLS_PER_ITEM);
    }
    first_item.push(total);
    let (rows_dot, pair_dot) = (kernel.rows_dot, kernel.pair_dot);
    // Activation blocks and side values per row (the kernel's own layout, row after row).
    let x_per_row = x_q.len() / m.max(1);
    let side_per_row = x_side.len() / m.max(1);
    let chunk_rows = row_chunk(m);
    let work = |items: std::ops::Range<usize>| {
        let mut col_out = vec![0f32; m.min(chunk_rows)];
        let mut pair_out = vec![0f32; m.min(chunk_rows)];
        let mut pi = 0;
        for item in items {
            while item >= first_item[pi + 1] {
                pi += 1;
            }
            let part = &parts[pi];
            let col_start = (item - first_item[pi]) * COLS_PER_ITEM;
            let col_end = (col_start + COLS_PER_ITEM).min(part.rows);
            // A long pass (a prompt) goes through the item's weight rows once per chunk of activation rows, so
            // that the chunk stays in cache for all of them instead of streaming every row again for each
            // weight row. A row's result does not depend on the rows dotted beside it (the kernels' batch
            // invariance), so chunking changes no bit.
            for r0 in (0..m).step_by(chunk_rows) {
                let r1 = (r0 + chunk_rows).min(m);
                let xs = &x_q[r0 * x_per_row..r1 * x_per_row];
                let ss = &x_side[r0 * side_per_row..r1 * side_per_row];
                let (col_out, pair_out) = (&mut col_out[..r1 - r0], &mut pair_out[..r1 - r0]);
                // SAFETY: each (part, r, col) is written by exactly one work item; each part's output has
                // m * rows elements.
                let write = |col: usize, values: &[f32]| {
                    for (r, &v) in values.iter().enumerate() {
                        unsafe { *part.out.0.add((r0 + r) * part.rows + col) = v };
                    }
                };
                let mut col = col_start;
                while col < col_end {
                    let paired = T::PAIRED_ROWS && col + 1 < part.stored_rows;
                    match pair_dot {
                        Some(pair_dot) if paired => {
                            // COLS_PER_ITEM is even, so `col` is the first row of its pair.
                            let pair =
                                &part.weight[col * blocks_per_row..(col + 2) * blocks_per_row];
                            pair_dot(pair, xs, ss, col_out, pair_out);
                            write(col, col_out);
                            if col + 1 < col_end {
                                write(col + 1, pair_out);
                            }
                            col += 2;
                        }
                        _ => {
                            let w_row =
                                row_blocks(part.weight, col, part.stored_rows, blocks_per_row);
                            rows_dot(&w_row, xs, ss, col_out);
                            write(col, col_out);
                            col += 1;
                        }
                    }
                }
            }
        }
    };
    crate::parallel::run_chunked(total, work);
}

fn matmul_many_typed<T: BlockType + FastRowsDot + FromStorage + Clone>(
    _first: &[T],
    ws: &[&Weight],
    x: &[f32],
    m: usize,
    outs: &mut [&mut [f32]],
    kernel: MatmulKernel,
) {
    let k = ws[0].cols;
    assert_eq!(x.len(), m * k, "matmul_many: input is not m x cols");
    let parts: Vec<Part<'_, T>> = ws
        .iter()
        .zip(outs.iter_mut())
        .map(|(w, out)| {
            assert_eq!(out.len(), m * w.rows, "matmul_many: output is not m x rows");
            Part {
                weight: T::blocks(&w.storage).expect("same storage type checked by the caller"),
                rows: w.rows,
                stored_rows: w.rows,
                out: SendPtr(out.as_mut_ptr()),
            }
        })
        .collect();
    let kernel = kernel_of::<T>(&[], kernel);
    let (x_q, x_side) = quantize_activations(&kernel, x, m, k);
    run_parts(&parts, k, &x_q, &x_side, m, &kernel);
}

struct SendPtr(*mut f32);
// SAFETY: the pointer is only used to write disjoint elements from the pool's workers during one call.
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The activations as the kernels see them: rounded to the weight type's partner (f16, bf16, or 8-bit
    /// blocks: Q8_0, Q8_1, Q8_K) and read back.
    fn activations_as_seen(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        fn round_trip<T: BlockType>(x: &[f32]) -> Vec<f32> {
            let mut blocks: Vec<T> = (0..x.len() / T::BLCK_SIZE).map(|_| T::zeros()).collect();
            T::from_float(x, &mut blocks);
            let mut out = vec![0f32; x.len()];
            T::to_float(&blocks, &mut out);
            out
        }
        use candle_core::quantized::k_quants::{BlockQ8K, BlockQ8_1};
        match ty {
            GgmlType::F32 => x.to_vec(),
            GgmlType::F16 => round_trip::<f16>(x),
            GgmlType::BF16 => round_trip::<bf16>(x),
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => round_trip::<BlockQ8_0>(x),
            GgmlType::Q4_1 | GgmlType::Q5_1 => round_trip::<BlockQ8_1>(x),
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
                round_trip::<BlockQ8K>(x)
            }
        }
    }

    /// Every storage type's matmul (and its weights loaded from GGML bytes) against a plain f64 sum over the
    /// dequantized weights and the activations rounded as the kernel rounds them: only float summation order
    /// may differ, so the tolerance is one part per million of the sum of absolute products (measured: at most
    /// 6e-8). Q4_1/Q5_1 allow 5e-4 (measured 8.5e-5): their min term uses the activation block sum stored as
    /// f16. Checked to fail (2026-12-01): with the Q2_K blocks reversed at load, or BF16 bytes read big-endian,
    /// the error is far above the tolerance. (It replaces a test with a 2%-of-max tolerance.)
    #[test]
    fn matmul_matches_a_plain_sum_for_every_storage_type() {
        let (n, k, m) = (37, 512, 5);
        let w = pseudo_random(n * k, 1);
        let mut x = pseudo_random(m * k, 2);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 61 == 0 {
                *v *= 20.0; // outliers, as real activations have
            }
        }
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q3K,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ] {
            let quantized = Weight::quantize(&w, n, k, ty).unwrap();
            let loaded = Weight::from_raw(ty, &quantized.raw_bytes(), n, k).unwrap();
            let deq = loaded.to_f32();
            let xs = activations_as_seen(ty, &x);
            let tolerance = match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 => 5e-4,
                _ => 1e-6,
            };
            for (name, weight) in [("quantized", &quantized), ("from GGML bytes", &loaded)] {
                let mut out = vec![0f32; m * n];
                weight.matmul(&x, m, &mut out);
                let mut worst = 0f64;
                for r in 0..m {
                    for c in 0..n {
                        let (mut sum, mut abs) = (0f64, 0f64);
                        for i in 0..k {
                            let p = xs[r * k + i] as f64 * deq[c * k + i] as f64;
                            sum += p;
                            abs += p.abs();
                        }
                        let err = (out[r * n + c] as f64 - sum).abs() / abs.max(1e-30);
                        worst = worst.max(err);
                    }
                }
                assert!(
                    worst <= tolerance,
                    "{} ({name}): error {worst:.2e} of the absolute sum (tolerance {tolerance:.0e})",
                    ty.name()
                );
            }
        }
    }

    #[test]
    fn grouped_matmul_equals_separate_matmuls_bitwise() {
        let (k, m) = (512, 3);
        let x = pseudo_random(m * k, 9);
        for ty in [
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::F32,
        ] {
            let ws: Vec<Weight> = [40, 7, 23]
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    Weight::quantize(&pseudo_random(n * k, 20 + i as u64), n, k, ty).unwrap()
                })
                .collect();
            let mut separate: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.rows]).collect();
            for (w, out) in ws.iter().zip(separate.iter_mut()) {
                w.matmul(&x, m, out);
            }
            let mut grouped: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.rows]).collect();
            let refs: Vec<&Weight> = ws.iter().collect();
            let mut outs: Vec<&mut [f32]> = grouped.iter_mut().map(|v| v.as_mut_slice()).collect();
            Weight::matmul_many(&refs, &x, m, &mut outs);
            assert_eq!(grouped, separate, "{}", ty.name());
        }
        // Mixed types fall back to separate matmuls.
        let a = Weight::quantize(&pseudo_random(32 * k, 1), 32, k, GgmlType::Q4K).unwrap();
        let b = Weight::quantize(&pseudo_random(16 * k, 2), 16, k, GgmlType::Q6K).unwrap();
        let (mut oa, mut ob) = (vec![0f32; m * 32], vec![0f32; m * 16]);
        Weight::matmul_many(&[&a, &b], &x, m, &mut [&mut oa, &mut ob]);
        let (mut ea, mut eb) = (vec![0f32; m * 32], vec![0f32; m * 16]);
        a.matmul(&x, m, &mut ea);
        b.matmul(&x, m, &mut eb);
        assert_eq!((oa, ob), (ea, eb));
    }

    /// Types stored pair-interleaved (Q4_K, Q6_K) read back exactly what was stored: rows, GGML bytes, and every
    /// matmul output bitwise equal to that row's matmul as a one-row weight (stored alone), for odd and even
    /// row counts, the first-rows matmul with an odd count, and the reference kernel on the same storage.
    #[test]
    fn paired_storage_reads_back_row_by_row() {
        let (k, m) = (512, 5);
        let x = pseudo_random(m * k, 31);
        for (n, ty) in [1usize, 2, 7, 40]
            .into_iter()
            .flat_map(|n| [(n, GgmlType::Q4K), (n, GgmlType::Q6K)])
        {
            let data = pseudo_random(n * k, 30 + n as u64);
            let weight = Weight::quantize(&data, n, k, ty).unwrap();
            let rows: Vec<Weight> = (0..n)
                .map(|c| Weight::quantize(&data[c * k..(c + 1) * k], 1, k, ty).unwrap())
                .collect();
            // Rows and GGML bytes.
            let mut raw = Vec::new();
            for (c, row) in rows.iter().enumerate() {
                let mut got = vec![0f32; k];
                weight.row_to_f32(c, &mut got);
                assert_eq!(got, row.to_f32(), "n={n} row {c}");
                raw.extend(row.raw_bytes());
            }
            assert_eq!(weight.raw_bytes(), raw, "n={n}: GGML bytes");
            let reloaded = Weight::from_raw(ty, &raw, n, k).unwrap();
            assert_eq!(reloaded.to_f32(), weight.to_f32(), "n={n}: from_raw");
            // Matmul outputs, column by column.
            let mut all = vec![0f32; m * n];
            weight.matmul(&x, m, &mut all);
            for (c, row) in rows.iter().enumerate() {
                let mut one = vec![0f32; m];
                row.matmul(&x, m, &mut one);
                for r in 0..m {
                    assert_eq!(
                        all[r * n + c].to_bits(),
                        one[r].to_bits(),
                        "n={n} ({r}, {c})"
                    );
                }
            }
            // An odd number of first rows (its last row's partner is stored but not computed).
            let first = n.div_ceil(2) | 1;
            if first < n {
                let mut part = vec![0f32; m * first];
                weight.matmul_first_rows(first, &x, m, &mut part);
                for r in 0..m {
                    assert_eq!(
                        &part[r * first..(r + 1) * first],
                        &all[r * n..r * n + first]
                    );
                }
            }
            // The reference kernel gathers rows from the same storage.
            let mut reference = vec![0f32; m * n];
            weight.matmul_with(MatmulKernel::Reference, &x, m, &mut reference);
            let scale = reference.iter().map(|v| v.abs()).fold(1f32, f32::max);
            for (a, b) in all.iter().zip(&reference) {
                assert!(
                    (a - b).abs() <= 1e-4 * scale,
                    "n={n}: fast {a} vs reference {b}"
                );
            }
        }
    }

    #[test]
    fn matmul_rows_are_batch_invariant() {
        // 5 rows: one pass of the kernels' tiles; 45: a prompt-sized pass, dotted in chunks of rows
        // (`row_chunk`), for the weights alone and grouped with others as attention's q/k/v are.
        for (n, k, m) in [(37, 256, 5), (37, 512, 45)] {
            let w = pseudo_random(n * k, 3);
            let x = pseudo_random(m * k, 4);
            for ty in [
                GgmlType::Q4K,
                GgmlType::Q6K,
                GgmlType::Q5_0,
                GgmlType::Q8_0,
                GgmlType::Q4_1,
                GgmlType::F32,
            ] {
                let weight = Weight::quantize(&w, n, k, ty).unwrap();
                let mut all = vec![0f32; m * n];
                weight.matmul(&x, m, &mut all);
                let other = Weight::quantize(&w[..(n - 3) * k], n - 3, k, ty).unwrap();
                let (mut first, mut second) = (vec![0f32; m * n], vec![0f32; m * (n - 3)]);
                Weight::matmul_many(&[&weight, &other], &x, m, &mut [&mut first, &mut second]);
                assert_eq!(all, first, "{} grouped, {m} rows", ty.name());
                for r in 0..m {
                    let mut one = vec![0f32; n];
                    weight.matmul(&x[r * k..(r + 1) * k], 1, &mut one);
                    assert_eq!(
                        &all[r * n..(r + 1) * n],
                        &one[..],
                        "{} row {r} of {m}",
                        ty.name()
                    );
                    let mut one = vec![0f32; n - 3];
                    other.matmul(&x[r * k..(r + 1) * k], 1, &mut one);
                    let row = &second[r * (n - 3)..(r + 1) * (n - 3)];
                    assert_eq!(row, &one[..], "{} grouped row {r} of {m}", ty.name());
                }
            }
        }
    }

    #[test]
    fn long_passes_go_in_balanced_chunks_of_rows() {
        assert_eq!(row_chunk(0), 1);
        assert_eq!(row_chunk(5), 5);
        assert_eq!(row_chunk(CHUNKED_PASS_ROWS), CHUNKED_PASS_ROWS);
        // 33 rows: five chunks of 7, 7, 7, 7 and 5; 552: 69 of 8.
        assert_eq!(row_chunk(33), 7);
        assert_eq!(row_chunk(552), 8);
        for m in CHUNKED_PASS_ROWS + 1..600 {
            let c = row_chunk(m);
            assert!(
                c <= ROW_CHUNK && m.div_ceil(c) == m.div_ceil(ROW_CHUNK),
                "{m} rows: chunks of {c}"
            );
        }
    }
}
