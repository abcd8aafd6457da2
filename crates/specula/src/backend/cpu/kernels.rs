//! Multi-row quantized dot products: one weight row against every activation row of a matmul call.
//!
//! A verify pass multiplies each weight row with k+1 activation rows. Dotting them one at a time (candle's
//! `vec_dot`) unpacks the 4/5/6-bit weight block again for every row, so verifying 5 tokens costs about 4x one
//! step. These kernels unpack each weight block once into registers and reuse it for all rows of a tile.
//!
//! Batch invariance is kept by construction: a row's integer partial sums are exact, and its float
//! accumulation (fused multiply-adds into its own accumulator, per block or per group of 8 blocks, then a fixed
//! horizontal sum) is the same sequence of operations whatever the tile size or the row's place in it.
//!
//! The kernels exist only on x86-64 builds with AVX2+FMA enabled at compile time (.cargo/config.toml); other
//! builds fall back to candle's per-row `vec_dot`, which is also batch invariant. Where the CPU has AVX-512
//! VNNI (Q4_K, Q6_K, Q4_1; Q5_0 also needs AVX-512 BW), detected at run time, a second instantiation computes the same
//! exact integer sums with fewer instructions, so results are bitwise identical either way (tested).
//!
//! Q4_K, Q6_K, Q5_0, Q4_1 and Q8_0 weights are stored in an interleaved order (`repack`) that lets eight dot-product
//! instructions per row produce one sum per scale group (or block), and every kernel prefetches the weight stream
//! ahead (`PREFETCH_DISTANCE`, `K_QUANT_PREFETCH_DISTANCE`), so memory keeps streaming while a multi-row tile
//! computes (measured with `examples/prefetch_sweep.rs`: verify(5) of the Qwen 1.5B 74 -> 64 ms in session 3;
//! K-quants into L2 further ahead, verify(2) -14% in session 6).
//!
//! Q4_K and Q6_K also have pair kernels ([`PairDot`]) over two weight rows stored pair-interleaved: every
//! activation load feeds both rows, and the rows stream from memory as one sequence (verify(5) of the Qwen 1.5B
//! -13%, one row -3%; `examples/kernel_micro.rs`, docs/benchmarks.md).

use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8K, BlockQ8_0, BlockQ8_1, GgmlType};

use super::repack::{
    BlockQ4KInterleaved, BlockQ4_1Interleaved, BlockQ5_0Interleaved, BlockQ6KInterleaved,
    BlockQ8_0Interleaved, Interleaved,
};

/// `out[r] = dot(weight_row, x[r])` for the `out.len()` activation rows stored back to back in `x`
/// (each `weight_row.len()` blocks long). `side` holds per-block data of the activations that the kernel's
/// [`PrepareActivations`] computed once per matmul call (f32 scales, block sums), row after row.
pub type RowsDot<W, X> = fn(weight_row: &[W], x: &[X], side: &[f32], out: &mut [f32]);

/// `out0[r] = dot(row0, x[r])` and `out1[r] = dot(row1, x[r])` for two weight rows stored pair-interleaved
/// (`pair` = row 0 block 0, row 1 block 0, row 0 block 1, ...; see [`FastRowsDot::PAIRED_ROWS`]): one pass that
/// feeds every activation load to both rows and reads the weights as one sequential stream. Each result is
/// bitwise what [`RowsDot`] gives for that row alone.
pub type PairDot<W, X> = fn(pair: &[W], x: &[X], side: &[f32], out0: &mut [f32], out1: &mut [f32]);

/// Readies a matmul call's quantized activations (`blocks_per_row` blocks per row) for a kernel: may reorder
/// their values and append per-block side data to `side`, row after row.
pub type PrepareActivations<X> = fn(x: &mut [X], blocks_per_row: usize, side: &mut Vec<f32>);

/// Quantizes one row of f32 activations into blocks of the kernel's activation type.
pub type QuantizeActivations<X> = fn(x: &[f32], out: &mut [X]);

/// A row-dot kernel, how it quantizes activations (bitwise as candle's `from_float`, possibly faster), and the
/// activation preparation it expects.
pub struct RowsKernel<W: GgmlType> {
    pub rows_dot: RowsDot<W, W::VecDotType>,
    /// Two weight rows at a time, where a kernel for that exists.
    pub pair_dot: Option<PairDot<W, W::VecDotType>>,
    pub quantize: QuantizeActivations<W::VecDotType>,
    pub prepare: PrepareActivations<W::VecDotType>,
}

fn no_preparation<X>(_x: &mut [X], _blocks_per_row: usize, _side: &mut Vec<f32>) {}

/// The kernels for a weight storage type: the multi-row kernel if this build has one, and the reference.
pub trait FastRowsDot: GgmlType + Sized {
    /// Whether `Weight` stores this type's matrices pair-interleaved: rows 2p and 2p + 1 block by block (row
    /// 2p block 0, row 2p + 1 block 0, row 2p block 1, ...), a last odd row alone. A layout fixed per type
    /// (not per CPU) so every build reads the same storage; it exists for [`PairDot`] kernels.
    const PAIRED_ROWS: bool = false;

    fn fast_kernel() -> Option<RowsKernel<Self>>;

    /// candle's single-row `vec_dot`, once per activation row.
    fn reference_kernel() -> RowsKernel<Self> {
        RowsKernel {
            rows_dot: reference_rows_dot::<Self>,
            pair_dot: None,
            quantize: <Self::VecDotType as GgmlType>::from_float,
            prepare: no_preparation,
        }
    }
}

macro_rules! no_fast_kernel {
    ($($t:ty),*) => {$(
        impl FastRowsDot for $t {
            fn fast_kernel() -> Option<RowsKernel<Self>> {
                None
            }
        }
    )*};
}

no_fast_kernel!(
    f32,
    half::f16,
    half::bf16,
    candle_core::quantized::k_quants::BlockQ4_0,
    candle_core::quantized::k_quants::BlockQ5_1,
    candle_core::quantized::k_quants::BlockQ2K,
    candle_core::quantized::k_quants::BlockQ3K,
    candle_core::quantized::k_quants::BlockQ4K,
    candle_core::quantized::k_quants::BlockQ5_0,
    candle_core::quantized::k_quants::BlockQ5K,
    candle_core::quantized::k_quants::BlockQ6K
);

macro_rules! fast_kernel {
    ($t:ty, $kernel:ident, $prepare:ident) => {
        fast_kernel!($t, $kernel, $prepare, {});
    };
    ($t:ty, $kernel:ident, $prepare:ident, {$($extra:item)*}) => {
        fast_kernel!(
            $t,
            $kernel,
            None,
            $prepare,
            <<$t as GgmlType>::VecDotType as GgmlType>::from_float,
            {$($extra)*}
        );
    };
    ($t:ty, $kernel:ident, $pair:expr, $prepare:ident, $quantize:expr, {$($extra:item)*}) => {
        impl FastRowsDot for $t {
            fn fast_kernel() -> Option<RowsKernel<Self>> {
                #[cfg(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma"
                ))]
                {
                    Some(RowsKernel {
                        rows_dot: avx2::$kernel,
                        pair_dot: $pair,
                        quantize: $quantize,
                        prepare: avx2::$prepare,
                    })
                }
                #[cfg(not(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma"
                )))]
                {
                    None
                }
            }
            $($extra)*
        }
    };
}

/// The reference for interleaved K-quant rows: each row back in GGML order, then candle's `vec_dot`.
fn interleaved_k_quant_reference<T>() -> RowsKernel<T>
where
    T: Interleaved + GgmlType<VecDotType = BlockQ8K>,
{
    RowsKernel {
        rows_dot: reference_rows_dot_interleaved::<T>,
        pair_dot: None,
        quantize: BlockQ8K::from_float,
        prepare: no_preparation,
    }
}

fast_kernel!(
    BlockQ4KInterleaved,
    q4k_q8k,
    Some(avx2::q4k_q8k_pair),
    prepare_q4k,
    quantize_q8k,
    {
        const PAIRED_ROWS: bool = true;
        fn reference_kernel() -> RowsKernel<Self> {
            interleaved_k_quant_reference()
        }
    }
);
fast_kernel!(
    BlockQ6KInterleaved,
    q6k_q8k,
    Some(avx2::q6k_q8k_pair),
    prepare_q6k,
    quantize_q8k,
    {
        const PAIRED_ROWS: bool = true;
        fn reference_kernel() -> RowsKernel<Self> {
            interleaved_k_quant_reference()
        }
    }
);
// GGML-order Q8_0 and Q4_1: weights are stored interleaved since session 52, so these kernels serve as the bitwise
// references of the interleaved ones (tests, examples/kernel_micro); their group code also runs the rows' tails.
fast_kernel!(BlockQ8_0, q8_0_q8_0, prepare_q8_0);
fast_kernel!(
    BlockQ8_0Interleaved,
    q8_0_interleaved_q8_0,
    prepare_q8_0_interleaved,
    {
        fn reference_kernel() -> RowsKernel<Self> {
            RowsKernel {
                rows_dot: reference_rows_dot_q8_0,
                pair_dot: None,
                quantize: BlockQ8_0::from_float,
                prepare: no_preparation,
            }
        }
    }
);
fast_kernel!(BlockQ5_0Interleaved, q5_0_q8_0, prepare_q5_0, {
    fn reference_kernel() -> RowsKernel<Self> {
        RowsKernel {
            rows_dot: reference_rows_dot_q5_0,
            pair_dot: None,
            quantize: BlockQ8_0::from_float,
            prepare: no_preparation,
        }
    }
});
fast_kernel!(BlockQ4_1, q4_1_q8_1, prepare_q8_1);
fast_kernel!(BlockQ4_1Interleaved, q4_1_interleaved_q8_1, prepare_q4_1, {
    fn reference_kernel() -> RowsKernel<Self> {
        RowsKernel {
            rows_dot: reference_rows_dot_q4_1,
            pair_dot: None,
            quantize: BlockQ8_1::from_float,
            prepare: no_preparation,
        }
    }
});

/// Bytes ahead of the current weight block that the small-block kernels (Q5_0, Q8_0, Q4_1) prefetch into L1
/// (0: none). A process-wide knob for benchmarks (`examples/prefetch_sweep.rs`); 1536 measured best or tied on
/// the Qwen 1.5B and 0.5B.
#[doc(hidden)]
pub static PREFETCH_DISTANCE: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(1536);

/// The Q4_K/Q6_K kernels' prefetch distance (0: none); they prefetch into L2 rather than L1. Measured on the
/// Qwen 1.5B with two threads (`examples/prefetch_sweep.rs`, docs/benchmarks.md): 6144 bytes into L2 against
/// 1536 into L1, verify(2) 38.4 -> 33.9 ms, verify(5) -4%, one row -3%; 4096-16384 all within noise of 6144,
/// while 1536 into L2 was the slowest setting. An L1 prefetch holds one of the core's few L1 miss buffers until
/// its line arrives, which caps how far ahead it can usefully run; an L2 prefetch does not. The small-block
/// kernels (Q5_0, Q8_0, Q4_1) keep [`PREFETCH_DISTANCE`] into L1: on the Qwen 0.5B, whose matrices are mostly
/// those, L2 at 6144 was 30% slower.
#[doc(hidden)]
pub static K_QUANT_PREFETCH_DISTANCE: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(6144);

/// Benchmark knob: the K-quant kernels prefetch like the small-block ones (into L1, [`PREFETCH_DISTANCE`]
/// ahead), to compare against.
#[doc(hidden)]
pub static K_QUANT_PREFETCH_L1: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The simple reference: candle's single-row `vec_dot`, once per activation row.
pub fn reference_rows_dot<T: GgmlType>(
    weight_row: &[T],
    x: &[T::VecDotType],
    _side: &[f32],
    out: &mut [f32],
) {
    let blocks = weight_row.len();
    let k = blocks * T::BLCK_SIZE;
    let x_blocks = k / T::VecDotType::BLCK_SIZE;
    for (r, o) in out.iter_mut().enumerate() {
        *o = T::vec_dot(k, weight_row, &x[r * x_blocks..(r + 1) * x_blocks]);
    }
}

/// Q8_K quantization of one activation row, bitwise equal to candle's `BlockQ8K::from_float` (tested) and
/// vectorized where this build has AVX2: a verify pass quantizes every input row of every matmul on the
/// critical path, and the scalar version cost ~5% of a 5-token pass on Qwen 1.5B.
pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        avx2::quantize_q8k(x, out)
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        BlockQ8K::from_float(x, out)
    }
}

/// The reference for interleaved Q8_0 rows: back to GGML order once per weight row, then candle's `vec_dot`.
fn reference_rows_dot_q8_0(
    weight_row: &[BlockQ8_0Interleaved],
    x: &[BlockQ8_0],
    side: &[f32],
    out: &mut [f32],
) {
    reference_rows_dot(&BlockQ8_0Interleaved::row_to_ggml(weight_row), x, side, out)
}

/// The reference for interleaved Q5_0 rows: back to GGML order once per weight row, then candle's `vec_dot`.
fn reference_rows_dot_q5_0(
    weight_row: &[BlockQ5_0Interleaved],
    x: &[BlockQ8_0],
    side: &[f32],
    out: &mut [f32],
) {
    reference_rows_dot(&BlockQ5_0Interleaved::row_to_ggml(weight_row), x, side, out)
}

/// The reference for interleaved Q4_1 rows: back to GGML order once per weight row, then candle's `vec_dot`.
fn reference_rows_dot_q4_1(
    weight_row: &[BlockQ4_1Interleaved],
    x: &[BlockQ8_1],
    side: &[f32],
    out: &mut [f32],
) {
    reference_rows_dot(&BlockQ4_1Interleaved::row_to_ggml(weight_row), x, side, out)
}

/// The reference for interleaved K-quant rows: back to GGML order once per weight row, then candle's `vec_dot`.
fn reference_rows_dot_interleaved<T: Interleaved>(
    weight_row: &[T],
    x: &[candle_core::quantized::k_quants::BlockQ8K],
    side: &[f32],
    out: &mut [f32],
) {
    reference_rows_dot(&T::ggml_row(weight_row), x, side, out)
}

// Layout mirrors of candle's block structs (whose fields are private to candle). Both are #[repr(C)] with the
// GGML field order; the size and alignment checks below make the reinterpretation sound.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod layout {
    use half::f16;

    #[repr(C)]
    pub struct Q4K {
        pub d: f16,
        pub dmin: f16,
        pub scales: [u8; 12],
        pub qs: [u8; 128],
    }
    #[repr(C)]
    pub struct Q6K {
        pub ql: [u8; 128],
        pub qh: [u8; 64],
        pub scales: [i8; 16],
        pub d: f16,
    }
    #[repr(C)]
    pub struct Q8K {
        pub d: f32,
        pub qs: [i8; 256],
        pub bsums: [i16; 16],
    }
    #[repr(C)]
    pub struct Q8_0 {
        pub d: f16,
        pub qs: [i8; 32],
    }
    #[repr(C)]
    pub struct Q5_0 {
        pub d: f16,
        pub qh: [u8; 4],
        pub qs: [u8; 16],
    }
    #[repr(C)]
    pub struct Q4_1 {
        pub d: f16,
        pub m: f16,
        pub qs: [u8; 16],
    }
    #[repr(C)]
    pub struct Q8_1 {
        pub d: f16,
        pub s: f16,
        pub qs: [i8; 32],
    }

    /// Reinterprets a slice of candle blocks as the mirror type.
    ///
    /// # Safety
    /// `A` and `B` must be the same GGML block layout (checked for size and alignment by `same_layout`).
    pub unsafe fn cast<A, B>(a: &[A]) -> &[B] {
        debug_assert!(same_layout::<A, B>());
        std::slice::from_raw_parts(a.as_ptr() as *const B, a.len())
    }

    pub const fn same_layout<A, B>() -> bool {
        std::mem::size_of::<A>() == std::mem::size_of::<B>()
            && std::mem::align_of::<B>() <= std::mem::align_of::<A>()
    }

    use candle_core::quantized::k_quants as k;
    const _: () = assert!(same_layout::<k::BlockQ4K, Q4K>());
    const _: () = assert!(same_layout::<k::BlockQ6K, Q6K>());
    use crate::backend::cpu::repack::{
        BlockQ4KInterleaved, BlockQ4_1Interleaved, BlockQ5_0Interleaved, BlockQ6KInterleaved,
    };
    const _: () = assert!(same_layout::<BlockQ5_0Interleaved, Q5_0>());
    const _: () = assert!(same_layout::<BlockQ4_1Interleaved, Q4_1>());
    const _: () = assert!(same_layout::<
        crate::backend::cpu::repack::BlockQ8_0Interleaved,
        Q8_0,
    >());
    const _: () = assert!(same_layout::<BlockQ4KInterleaved, Q4K>());
    const _: () = assert!(same_layout::<BlockQ6KInterleaved, Q6K>());
    const _: () = assert!(same_layout::<k::BlockQ8K, Q8K>());
    const _: () = assert!(same_layout::<k::BlockQ8_0, Q8_0>());
    const _: () = assert!(same_layout::<k::BlockQ5_0, Q5_0>());
    const _: () = assert!(same_layout::<k::BlockQ4_1, Q4_1>());
    const _: () = assert!(same_layout::<k::BlockQ8_1, Q8_1>());
}

/// The instruction sets the quantized kernels run with in this process: `avx2` (the build's baseline), plus
/// `avx512-vnni` (Q4_K, Q6_K, Q8_0, Q4_1) and `avx512-bw` (Q5_0) where the CPU has them and they are not turned off
/// (`SPECULA_NO_VNNI=1`, `SPECULA_NO_AVX512=1` force the AVX2 kernels; every path gives bitwise the same
/// results). Builds without AVX2/FMA run candle's one-row kernels.
pub fn active_kernel_paths() -> Vec<&'static str> {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        let mut paths = vec!["avx2"];
        if avx2::has_vnni() {
            paths.push("avx512-vnni");
        }
        if avx2::has_avx512bw() {
            paths.push("avx512-bw");
        }
        paths
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        vec!["candle-vec-dot"]
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx2 {
    use super::layout::{cast, Q4K, Q4_1, Q5_0, Q6K, Q8K, Q8_0, Q8_1};
    use crate::backend::cpu::repack::{
        interleave_activations, interleave_q8_0_row, interleave_q8_1_row, q8k_scale_and_sums,
        BlockQ4KInterleaved, BlockQ4_1Interleaved, BlockQ5_0Interleaved, BlockQ6KInterleaved,
        BlockQ8_0Interleaved,
    };
    use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8K, BlockQ8_0, BlockQ8_1};
    use std::arch::x86_64::*;

    /// Most activation rows handled per pass over a weight row. Verify passes are k+1 <= 9 rows for the draft
    /// lengths that pay off; more rows (prefill) take several passes.
    const MAX_TILE: usize = 8;

    /// Whether the CPU has 256-bit VNNI (AVX-512 VNNI + VL), checked once. The VNNI kernels compute the same
    /// exact integer sums with fewer instructions and then run the same float steps, so both paths give
    /// bitwise identical results (tested), and a CI machine without VNNI reproduces this one's tokens.
    pub(super) fn has_vnni() -> bool {
        #[cfg(test)]
        if FORCE_AVX2.with(|c| c.get()) {
            return false;
        }
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| {
            std::env::var_os("SPECULA_NO_VNNI").is_none()
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
        })
    }

    /// Whether the CPU has AVX-512 BW + VL (byte masks on 256-bit vectors), checked once. Kernels using them
    /// compute the same bytes as their AVX2 versions (tested).
    pub(super) fn has_avx512bw() -> bool {
        #[cfg(test)]
        if FORCE_AVX2.with(|c| c.get()) {
            return false;
        }
        static AVX512BW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX512BW.get_or_init(|| {
            std::env::var_os("SPECULA_NO_AVX512").is_none()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
        })
    }

    /// Splits the rows into tiles of at most MAX_TILE and runs the const-generic tile kernel on each.
    macro_rules! by_tiles {
        ($tile:ident, $w:expr, $x:expr, $scales:expr, $scale_stride:expr, $out:expr) => {{
            let (w, x, scales, out) = ($w, $x, $scales, $out);
            let nb = w.len();
            let m = out.len();
            debug_assert_eq!(x.len(), m * nb);
            let mut r0 = 0;
            while r0 < m {
                let t = (m - r0).min(MAX_TILE);
                let xs = &x[r0 * nb..(r0 + t) * nb];
                let stride: usize = $scale_stride;
                let ss: &[f32] = if stride == 0 {
                    &[]
                } else {
                    &scales[r0 * stride * nb..(r0 + t) * stride * nb]
                };
                let o = &mut out[r0..r0 + t];
                // SAFETY: AVX2 and FMA are enabled for this build (module cfg); the tile kernels index only
                // within `w`, `xs` (t rows of nb blocks) and `o`.
                unsafe {
                    match t {
                        1 => $tile::<1>(w, xs, ss, o),
                        2 => $tile::<2>(w, xs, ss, o),
                        3 => $tile::<3>(w, xs, ss, o),
                        4 => $tile::<4>(w, xs, ss, o),
                        5 => $tile::<5>(w, xs, ss, o),
                        6 => $tile::<6>(w, xs, ss, o),
                        7 => $tile::<7>(w, xs, ss, o),
                        _ => $tile::<8>(w, xs, ss, o),
                    }
                }
                r0 += t;
            }
        }};
    }

    /// Integer building blocks in two instruction sets with identical (exact) results.
    mod int {
        use std::arch::x86_64::*;

        /// u8 x i8 products summed in groups of four into i32 lanes, added to `acc`. Exact (equal to
        /// `vpdpbusd`) when pairs of products fit in i16, i.e. for weights up to 6 bits.
        #[inline]
        #[target_feature(enable = "avx2")]
        pub fn dot_u8i8_avx2(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            let pairs = _mm256_maddubs_epi16(a, b);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }

        #[inline]
        #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
        pub fn dot_u8i8_vnni(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(acc, a, b)
        }

        /// Lane i of the result: the dot product of the weights in lane i of the 8 registers `q` (u8, at most
        /// 4 bits) with the activations at `x + 32 t` (i8). A pair of u8 x i8 products is at most 2 * 15 * 128 =
        /// 3840 in magnitude, so eight `vpmaddubsw` outputs add up in i16 (<= 30720) and widen once: 8
        /// multiplies, 7 adds and 1 widening instead of 8 x (multiply, widen, add). Exact, so the same
        /// integers as VNNI's `vpdpbusd` chains.
        ///
        /// # Safety
        /// `x` must be readable for 256 bytes.
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn dot8_u4i8_avx2(q: &[__m256i; 8], x: *const u8) -> __m256i {
            let p = |t: usize| _mm256_maddubs_epi16(q[t], load(x.add(32 * t)));
            let s = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3))),
                _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7))),
            );
            _mm256_madd_epi16(s, _mm256_set1_epi16(1))
        }

        /// The same sums as [`dot8_u4i8_avx2`] by VNNI, in two chains (halving the dependency on
        /// `vpdpbusd`'s latency).
        ///
        /// # Safety
        /// `x` must be readable for 256 bytes.
        #[inline]
        #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
        pub unsafe fn dot8_u4i8_vnni(q: &[__m256i; 8], x: *const u8) -> __m256i {
            let zero = _mm256_setzero_si256();
            let mut s0 = _mm256_dpbusd_epi32(zero, q[0], load(x));
            let mut s1 = _mm256_dpbusd_epi32(zero, q[1], load(x.add(32)));
            s0 = _mm256_dpbusd_epi32(s0, q[2], load(x.add(64)));
            s1 = _mm256_dpbusd_epi32(s1, q[3], load(x.add(96)));
            s0 = _mm256_dpbusd_epi32(s0, q[4], load(x.add(128)));
            s1 = _mm256_dpbusd_epi32(s1, q[5], load(x.add(160)));
            s0 = _mm256_dpbusd_epi32(s0, q[6], load(x.add(192)));
            s1 = _mm256_dpbusd_epi32(s1, q[7], load(x.add(224)));
            _mm256_add_epi32(s0, s1)
        }

        /// `acc` plus the dot products of the weights in `q0` and `q1` (u8, at most 6 bits) with the
        /// activations at `x0` and `x1`: a pair of products is at most 2 * 63 * 128 = 16128, so two
        /// `vpmaddubsw` outputs add up in i16 (<= 32256) and widen once. Exact.
        ///
        /// # Safety
        /// `x0` and `x1` must be readable for 32 bytes.
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn dot2_u6i8_avx2(
            acc: __m256i,
            q0: __m256i,
            x0: *const u8,
            q1: __m256i,
            x1: *const u8,
        ) -> __m256i {
            let s = _mm256_add_epi16(
                _mm256_maddubs_epi16(q0, load(x0)),
                _mm256_maddubs_epi16(q1, load(x1)),
            );
            _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)))
        }

        /// [`dot2_u6i8_avx2`] by VNNI.
        ///
        /// # Safety
        /// `x0` and `x1` must be readable for 32 bytes.
        #[inline]
        #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
        pub unsafe fn dot2_u6i8_vnni(
            acc: __m256i,
            q0: __m256i,
            x0: *const u8,
            q1: __m256i,
            x1: *const u8,
        ) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, q0, load(x0)), q1, load(x1))
        }

        use super::load;

        #[cfg(test)]
        mod tests {
            use super::*;

            /// Lane i of a dot over `t` registers: the sum of w[32 t + 4 i + j] * x[32 t + 4 i + j].
            fn scalar_lanes(w: &[u8], x: &[i8]) -> [i32; 8] {
                let mut lanes = [0i32; 8];
                for (n, (&a, &b)) in w.iter().zip(x).enumerate() {
                    lanes[(n % 32) / 4] += a as i32 * b as i32;
                }
                lanes
            }

            fn lanes(v: __m256i) -> [i32; 8] {
                // SAFETY: __m256i and [i32; 8] have the same size; any bits are valid i32s.
                unsafe { std::mem::transmute(v) }
            }

            /// The i16 sums stay exact at the extremes of their bounds (4-bit weights of 15 against
            /// activations of -128 or 127, 6-bit ones of 63) and on pseudo-random bytes.
            #[test]
            fn dot_sums_in_i16_are_exact_at_the_bounds() {
                if !is_x86_feature_detected!("avx2") {
                    return;
                }
                let mut next = crate::testing::xorshift64(0x9e37_79b9_7f4a_7c15);
                let mut cases: Vec<(Vec<u8>, Vec<i8>)> = Vec::new();
                for (w, x) in [(15u8, -128i8), (15, 127), (0, -128), (15, 0)] {
                    cases.push((vec![w; 256], vec![x; 256]));
                }
                for _ in 0..64 {
                    cases.push((
                        (0..256).map(|_| (next() & 15) as u8).collect(),
                        (0..256).map(|_| next() as u8 as i8).collect(),
                    ));
                }
                for (w, x) in &cases {
                    let q: [__m256i; 8] =
                        std::array::from_fn(|t| unsafe { load(w.as_ptr().add(32 * t)) });
                    let got = lanes(unsafe { dot8_u4i8_avx2(&q, x.as_ptr() as *const u8) });
                    assert_eq!(got, scalar_lanes(w, x), "4-bit weights");
                    if is_x86_feature_detected!("avx512vnni")
                        && is_x86_feature_detected!("avx512vl")
                    {
                        let vnni = lanes(unsafe { dot8_u4i8_vnni(&q, x.as_ptr() as *const u8) });
                        assert_eq!(vnni, got, "VNNI and AVX2 sums differ");
                    }
                    // 6-bit weights: the same bytes times 4, plus 3 (0-63), two registers at a time.
                    let w6: Vec<u8> = w.iter().map(|&v| v * 4 + 3).collect();
                    let init = unsafe { _mm256_set1_epi32(-7) };
                    let q6: [__m256i; 2] =
                        std::array::from_fn(|t| unsafe { load(w6.as_ptr().add(32 * t)) });
                    let xp = x.as_ptr() as *const u8;
                    let got6 = lanes(unsafe { dot2_u6i8_avx2(init, q6[0], xp, q6[1], xp.add(32)) });
                    let want6 = scalar_lanes(&w6[..64], &x[..64]).map(|v| v - 7);
                    assert_eq!(got6, want6, "6-bit weights");
                }
                let w = vec![63u8; 64];
                for xv in [-128i8, 127] {
                    let x = vec![xv; 64];
                    let q6: [__m256i; 2] =
                        std::array::from_fn(|t| unsafe { load(w.as_ptr().add(32 * t)) });
                    let xp = x.as_ptr() as *const u8;
                    let zero = unsafe { _mm256_setzero_si256() };
                    let got = lanes(unsafe { dot2_u6i8_avx2(zero, q6[0], xp, q6[1], xp.add(32)) });
                    assert_eq!(
                        got,
                        scalar_lanes(&w, &x),
                        "6-bit weights of 63, activations {xv}"
                    );
                }
            }
        }
    }

    /// Asks for the weight bytes PREFETCH_DISTANCE ahead of a block (the next rows of the matrix are contiguous,
    /// and a prefetch past the end of the matrix is harmless), so memory streams while the rows compute.
    #[inline(always)]
    unsafe fn prefetch_ahead(block: *const u8, block_bytes: usize) {
        let distance = super::PREFETCH_DISTANCE.load(std::sync::atomic::Ordering::Relaxed);
        if distance == 0 {
            return;
        }
        prefetch_lines::<_MM_HINT_T0>(block.wrapping_add(distance), block_bytes);
    }

    /// Prefetches every 64-byte line of `bytes` bytes from `p` with `HINT`.
    #[inline(always)]
    unsafe fn prefetch_lines<const HINT: i32>(p: *const u8, bytes: usize) {
        let mut off = 0;
        while off < bytes {
            _mm_prefetch::<HINT>(p.wrapping_add(off) as *const i8);
            off += 64;
        }
    }

    /// The Q4_K/Q6_K kernels' prefetch: into L2, `K_QUANT_PREFETCH_DISTANCE` ahead.
    #[inline(always)]
    unsafe fn prefetch_k_quant(block: *const u8, block_bytes: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        if super::K_QUANT_PREFETCH_L1.load(Relaxed) {
            return prefetch_ahead(block, block_bytes);
        }
        let distance = super::K_QUANT_PREFETCH_DISTANCE.load(Relaxed);
        if distance == 0 {
            return;
        }
        prefetch_lines::<_MM_HINT_T1>(block.wrapping_add(distance), block_bytes);
    }

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// Horizontal sum in a fixed order (part of every row's fixed operation sequence).
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// A Q4_K block's eight sub-block scales times `d` and eight mins times `dmin`, as f32 lanes. One 16-byte load
    /// of the block's head (d, dmin, the 12 packed bytes) and a few byte shuffles unpack GGML's 6-bit packing
    /// (scales 0-3 and mins 0-3 in the low 6 bits of bytes 0-7; 4-7 split over bytes 8-11 and the top bits of
    /// bytes 0-7); the scalar unpacking it replaced (`q4k_scales_mins`, kept as the tests' reference) was over a
    /// third of the one-row kernel's instructions on an Intel core. Same integers, same f32 products.
    #[inline(always)]
    unsafe fn q4k_block_factors(b: &Q4K) -> (__m256, __m256) {
        // Bytes 0-1 d, 2-3 dmin, 4-15 the packed scales and mins (s0..s11).
        let head = _mm_loadu_si128(b as *const Q4K as *const __m128i);
        const Z: i8 = -128; // pshufb: zero the byte
                            // p: s0-3 | s8-11 | s4-7 | s8-11; q: 0 | s0-3 | 0 | s4-7.
        let p = _mm_shuffle_epi8(
            head,
            _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let q = _mm_shuffle_epi8(
            head,
            _mm_setr_epi8(Z, Z, Z, Z, 4, 5, 6, 7, Z, Z, Z, Z, 8, 9, 10, 11),
        );
        // Bytes 0-7 scales 0-7, 8-15 mins 0-7: low 6 bits of s0-7; the low (scales) or high (mins) nibble of
        // s8-11 with bits 6-7 of s0-3 (scales) or s4-7 (mins) above it.
        let low = _mm_and_si128(
            p,
            _mm_setr_epi8(
                0x3F, 0x3F, 0x3F, 0x3F, 0x0F, 0x0F, 0x0F, 0x0F, 0x3F, 0x3F, 0x3F, 0x3F, 0, 0, 0, 0,
            ),
        );
        let high_nibble = _mm_and_si128(
            _mm_srli_epi16(p, 4),
            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0F, 0x0F, 0x0F, 0x0F),
        );
        let top_bits = _mm_and_si128(_mm_srli_epi16(q, 2), _mm_set1_epi8(0x30));
        let packed = _mm_or_si128(_mm_or_si128(low, high_nibble), top_bits);
        // d and dmin: the same f16 -> f32 conversion as `f16::to_f32` with F16C.
        let dd = _mm_cvtph_ps(head);
        let d = _mm256_broadcastss_ps(dd);
        let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
        let scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed));
        let mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(packed, packed)));
        (_mm256_mul_ps(scales, d), _mm256_mul_ps(mins, dmin))
    }

    /// The eight 6-bit sub-block scales and the eight mins of a Q4_K block, one byte each, as two u64 (GGML's
    /// packing, as above): the scalar reference for [`q4k_block_factors`].
    #[cfg(test)]
    fn q4k_scales_mins(s: &[u8; 12]) -> (u64, u64) {
        let a = u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]);
        let c = u32::from_le_bytes([s[8], s[9], s[10], s[11]]) as u64;
        let sc = (a & 0x3F3F_3F3F) | (((c & 0x0F0F_0F0F) | ((a >> 2) & 0x3030_3030)) << 32);
        let mn = ((a >> 32) & 0x3F3F_3F3F)
            | ((((c >> 4) & 0x0F0F_0F0F) | ((a >> 34) & 0x3030_3030)) << 32);
        (sc, mn)
    }

    /// Eight unsigned bytes (packed in a u64) as f32 lanes.
    #[cfg(test)]
    unsafe fn u8x8_to_f32(v: u64) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
    }

    /// Q4_K activations: interleaved values (see `repack`), and per block `d * (sum of sub-block i)` for the
    /// eight sub-blocks (the mins term).
    pub fn prepare_q4k(x: &mut [BlockQ8K], _blocks_per_row: usize, side: &mut Vec<f32>) {
        interleave_activations(x);
        side.reserve(8 * x.len());
        for b in x.iter() {
            let (d, bsums) = q8k_scale_and_sums(b);
            side.extend((0..8).map(|i| d * (bsums[2 * i] as i32 + bsums[2 * i + 1] as i32) as f32));
        }
    }

    /// Q6_K activations: interleaved values, and per block `-32 * (sum of group g)` as i32 bits, even groups
    /// then odd groups (the initial values of the integer accumulators, which apply Q6_K's -32 offset exactly).
    pub fn prepare_q6k(x: &mut [BlockQ8K], _blocks_per_row: usize, side: &mut Vec<f32>) {
        interleave_activations(x);
        side.reserve(16 * x.len());
        for b in x.iter() {
            let (_, bsums) = q8k_scale_and_sums(b);
            for parity in 0..2 {
                side.extend(
                    (0..8).map(|i| f32::from_bits((-32 * bsums[2 * i + parity] as i32) as u32)),
                );
            }
        }
    }

    /// `BlockQ8K::from_float` step by step: the first value of largest magnitude sets the scale
    /// (`iscale = -127 / max`), values are `round(iscale * x)` with halves away from zero, clamped to i8, and
    /// `d = 1 / iscale`. The rounding is rebuilt exactly from truncation: `x - trunc(x)` is exact.
    pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
        assert_eq!(
            x.len(),
            out.len() * 256,
            "quantize_q8k: x is not whole blocks"
        );
        // SAFETY: layouts checked in `layout`; AVX2 is enabled for this module.
        let out =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut Q8K, out.len()) };
        for (xs, y) in x.chunks_exact(256).zip(out.iter_mut()) {
            unsafe { quantize_q8k_block(xs, y) }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_q8k_block(xs: &[f32], y: &mut Q8K) {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let mut amax_v = _mm256_setzero_ps();
        for c in xs.chunks_exact(8) {
            amax_v = _mm256_max_ps(amax_v, _mm256_and_ps(_mm256_loadu_ps(c.as_ptr()), abs_mask));
        }
        let amax = hmax(amax_v);
        if amax == 0.0 {
            y.d = 0.0;
            y.qs = [0; 256];
            y.bsums = [0; 16];
            return;
        }
        // The first value whose magnitude is the maximum (candle keeps the first on ties).
        let max = *xs.iter().find(|v| v.abs() == amax).unwrap_or(&amax);
        let iscale = -127f32 / max;
        let sc = _mm256_set1_ps(iscale);
        let half = _mm256_set1_ps(0.5);
        let sign_bit = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let one = _mm256_set1_ps(1.0);
        for (j, c) in xs.chunks_exact(32).enumerate() {
            let mut q = [_mm256_setzero_si256(); 4];
            for (i, qi) in q.iter_mut().enumerate() {
                let v = _mm256_mul_ps(sc, _mm256_loadu_ps(c.as_ptr().add(8 * i)));
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
                let frac = _mm256_and_ps(_mm256_sub_ps(v, t), abs_mask);
                let away = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), one);
                let r = _mm256_add_ps(t, _mm256_or_ps(away, _mm256_and_ps(v, sign_bit)));
                let r = _mm256_min_ps(
                    _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
                    _mm256_set1_ps(127.0),
                );
                *qi = _mm256_cvtps_epi32(r);
            }
            // i32 -> i8 with the element order restored after the lane-wise packs.
            let w01 = _mm256_packs_epi32(q[0], q[1]);
            let w23 = _mm256_packs_epi32(q[2], q[3]);
            let b = _mm256_packs_epi16(w01, w23);
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(y.qs.as_mut_ptr().add(32 * j) as *mut __m256i, b);
            // The sums of values 0-15 and 16-31 (exact: the packs did not saturate, values are in -128..=127).
            let halves =
                _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let sums = _mm256_hadd_epi32(halves, halves);
            let sums = _mm_add_epi32(
                _mm256_castsi256_si128(sums),
                _mm256_extracti128_si256::<1>(sums),
            );
            y.bsums[2 * j] = _mm_cvtsi128_si32(sums) as i16;
            y.bsums[2 * j + 1] = _mm_extract_epi32::<1>(sums) as i16;
        }
        y.d = 1.0 / iscale;
    }

    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        _mm_cvtss_f32(m)
    }

    pub fn q4k_q8k(w: &[BlockQ4KInterleaved], x: &[BlockQ8K], side: &[f32], out: &mut [f32]) {
        // SAFETY: layouts checked in `layout`.
        let (w, x) = unsafe { (cast::<_, Q4K>(w), cast::<_, Q8K>(x)) };
        q4k_rows(w.as_ptr(), 1, w.len(), x, side, out);
    }

    /// Defines `$name(w, step, nb, x, side, out)`: one weight row whose block b is at `w + b * step`, against
    /// `out.len()` activation rows (`$side` side values per activation block), in tiles of at most MAX_TILE
    /// rows, on the VNNI tile kernel where the CPU has it.
    macro_rules! strided_rows {
        ($name:ident, $block:ty, $vnni:ident, $avx2:ident, $side:expr) => {
            fn $name(
                w: *const $block,
                step: usize,
                nb: usize,
                x: &[Q8K],
                side: &[f32],
                out: &mut [f32],
            ) {
                let m = out.len();
                assert_eq!(
                    x.len(),
                    m * nb,
                    "activations are not m rows of the weight length"
                );
                assert_eq!(
                    side.len(),
                    $side * m * nb,
                    "activation side data has the wrong length"
                );
                let vnni = has_vnni();
                let mut r0 = 0;
                while r0 < m {
                    let t = (m - r0).min(MAX_TILE);
                    let xs = &x[r0 * nb..(r0 + t) * nb];
                    let ss = &side[r0 * $side * nb..(r0 + t) * $side * nb];
                    let o = &mut out[r0..r0 + t];
                    macro_rules! tile {
                        ($n:literal) => {
                            if vnni {
                                $vnni::<$n>(w, step, nb, xs, ss, o)
                            } else {
                                $avx2::<$n>(w, step, nb, xs, ss, o)
                            }
                        };
                    }
                    // SAFETY: AVX2+FMA are enabled for this build and VNNI was checked; the caller
                    // guarantees nb blocks at `w + b * step`; the tile indexes only within xs, ss and o.
                    unsafe {
                        match t {
                            1 => tile!(1),
                            2 => tile!(2),
                            3 => tile!(3),
                            4 => tile!(4),
                            5 => tile!(5),
                            6 => tile!(6),
                            7 => tile!(7),
                            _ => tile!(8),
                        }
                    }
                    r0 += t;
                }
            }
        };
    }
    strided_rows!(q4k_rows, Q4K, q4k_tile_vnni, q4k_tile_avx2, 8);
    strided_rows!(q6k_rows, Q6K, q6k_tile_vnni, q6k_tile_avx2, 16);

    /// Defines the pair entry point `$name(pair, x, side, out0, out1)` over a `$tile` two-row VNNI kernel,
    /// falling back to the one-row kernel on each row without VNNI.
    macro_rules! pair_rows {
        ($name:ident, $public:ty, $block:ty, $rows:ident, $tile:ident, $side:expr, $max_tile:expr) => {
            pub fn $name(
                pair: &[$public],
                x: &[BlockQ8K],
                side: &[f32],
                out0: &mut [f32],
                out1: &mut [f32],
            ) {
                assert!(
                    pair.len().is_multiple_of(2),
                    "pair kernel: odd number of blocks for two rows"
                );
                // SAFETY: layouts checked in `layout`.
                let (w, x) = unsafe { (cast::<_, $block>(pair), cast::<_, Q8K>(x)) };
                let nb = w.len() / 2;
                if nb == 0 {
                    out0.fill(0.0);
                    out1.fill(0.0);
                    return;
                }
                let (p0, p1) = (w.as_ptr(), w[1..].as_ptr());
                if !has_vnni() {
                    $rows(p0, 2, nb, x, side, out0);
                    $rows(p1, 2, nb, x, side, out1);
                    return;
                }
                assert_eq!(
                    out0.len(),
                    out1.len(),
                    "pair kernel: outputs of different lengths"
                );
                let m = out0.len();
                assert_eq!(
                    x.len(),
                    m * nb,
                    "pair kernel: activations are not m rows of the weight length"
                );
                assert_eq!(
                    side.len(),
                    $side * m * nb,
                    "pair kernel: side data has the wrong length"
                );
                let mut r0 = 0;
                while r0 < m {
                    // Balanced tiles of at most $max_tile rows (9 rows as 5 + 4, not 8 + 1).
                    let left = m - r0;
                    let t = left.div_ceil(left.div_ceil($max_tile));
                    let xs = &x[r0 * nb..(r0 + t) * nb];
                    let ss = &side[r0 * $side * nb..(r0 + t) * $side * nb];
                    let (o0, o1) = (&mut out0[r0..r0 + t], &mut out1[r0..r0 + t]);
                    // SAFETY: VNNI checked above; block b of the rows is at p0/p1 + 2b, within `pair`; the
                    // tile indexes only within xs, ss and the outputs.
                    unsafe {
                        match t {
                            1 => $tile::<1>(p0, p1, 2, nb, xs, ss, o0, o1),
                            2 => $tile::<2>(p0, p1, 2, nb, xs, ss, o0, o1),
                            3 => $tile::<3>(p0, p1, 2, nb, xs, ss, o0, o1),
                            4 => $tile::<4>(p0, p1, 2, nb, xs, ss, o0, o1),
                            5 => $tile::<5>(p0, p1, 2, nb, xs, ss, o0, o1),
                            6 => $tile::<6>(p0, p1, 2, nb, xs, ss, o0, o1),
                            7 => $tile::<7>(p0, p1, 2, nb, xs, ss, o0, o1),
                            _ => $tile::<8>(p0, p1, 2, nb, xs, ss, o0, o1),
                        }
                    }
                    r0 += t;
                }
            }
        };
    }
    // Most activation rows per pass, from `examples/kernel_micro.rs`: the Q4_K pair kernel gets cheaper per row up
    // to 8; the Q6_K one runs out of registers past 5 (per-row cost 2.3 ns/block up to 4 rows, 3.6 at the 6th).
    pair_rows!(
        q4k_q8k_pair,
        BlockQ4KInterleaved,
        Q4K,
        q4k_rows,
        q4k_pair_tile_vnni,
        8,
        8
    );
    pair_rows!(
        q6k_q8k_pair,
        BlockQ6KInterleaved,
        Q6K,
        q6k_rows,
        q6k_pair_tile_vnni,
        16,
        5
    );

    // Interleaved K-quant kernels (see `repack`): unpacked weight register t holds in lane i the weights
    // 32i + 4t .. 32i + 4t + 4, and the activations are interleaved the same way, so eight dot-product
    // instructions per row leave one 32-weight dot product per lane and the scales apply with one multiply.
    macro_rules! q4k_tile {
        ($name:ident, $features:literal, $dot8:path) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(
                w: *const Q4K,
                step: usize,
                nb: usize,
                x: &[Q8K],
                side: &[f32],
                out: &mut [f32],
            ) {
                let m4 = _mm256_set1_epi8(0x0F);
                let zero = _mm256_setzero_si256();
                let mut acc = [_mm256_setzero_ps(); R];
                for b in 0..nb {
                    let wb = &*w.add(b * step);
                    prefetch_k_quant(wb as *const Q4K as *const u8, 144);
                    let (scales, mins) = q4k_block_factors(wb);
                    let mut q = [zero; 8];
                    for j in 0..4 {
                        let v = load(wb.qs.as_ptr().add(32 * j));
                        q[2 * j] = _mm256_and_si256(v, m4);
                        q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xb = x.get_unchecked(r * nb + b);
                        let sums = _mm256_cvtepi32_ps($dot8(&q, xb.qs.as_ptr() as *const u8));
                        let block_sums = _mm256_loadu_ps(side.as_ptr().add(8 * (r * nb + b)));
                        *a = _mm256_fmadd_ps(sums, _mm256_mul_ps(scales, _mm256_set1_ps(xb.d)), *a);
                        *a = _mm256_fnmadd_ps(mins, block_sums, *a);
                    }
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = hsum(a);
                }
            }
        };
    }
    // Two-row kernels: rows stored pair-interleaved (row 0 block 0, row 1 block 0, row 0 block 1, ...: one
    // sequential stream). With VNNI (32 vector registers) both rows' unpacked weights stay in registers and each
    // activation load feeds two `vpdpbusd`; without it, the one-row kernel runs on each row. The integer sums
    // are exact and the float steps per (row, block) are the one-row kernel's, so each output is bitwise its.

    /// Block b of the two weight rows is at `w0 + b * step` and `w1 + b * step` (`nb` blocks per row).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn q4k_pair_tile_vnni<const R: usize>(
        w0: *const Q4K,
        w1: *const Q4K,
        step: usize,
        nb: usize,
        x: &[Q8K],
        side: &[f32],
        out0: &mut [f32],
        out1: &mut [f32],
    ) {
        let m4 = _mm256_set1_epi8(0x0F);
        let zero = _mm256_setzero_si256();
        let mut acc0 = [_mm256_setzero_ps(); R];
        let mut acc1 = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let (wa, wb) = (&*w0.add(b * step), &*w1.add(b * step));
            prefetch_k_quant(wa as *const Q4K as *const u8, 144);
            prefetch_k_quant(wb as *const Q4K as *const u8, 144);
            let mut s0 = [zero; R];
            let mut s1 = [zero; R];
            for j in 0..4 {
                let va = load(wa.qs.as_ptr().add(32 * j));
                let vb = load(wb.qs.as_ptr().add(32 * j));
                let (a_lo, a_hi) = (
                    _mm256_and_si256(va, m4),
                    _mm256_and_si256(_mm256_srli_epi16(va, 4), m4),
                );
                let (b_lo, b_hi) = (
                    _mm256_and_si256(vb, m4),
                    _mm256_and_si256(_mm256_srli_epi16(vb, 4), m4),
                );
                for r in 0..R {
                    let xq = x.get_unchecked(r * nb + b).qs.as_ptr() as *const u8;
                    let x_lo = load(xq.add(64 * j));
                    let x_hi = load(xq.add(64 * j + 32));
                    s0[r] = _mm256_dpbusd_epi32(s0[r], a_lo, x_lo);
                    s1[r] = _mm256_dpbusd_epi32(s1[r], b_lo, x_lo);
                    s0[r] = _mm256_dpbusd_epi32(s0[r], a_hi, x_hi);
                    s1[r] = _mm256_dpbusd_epi32(s1[r], b_hi, x_hi);
                }
            }
            let (scales0, mins0) = q4k_block_factors(wa);
            let (scales1, mins1) = q4k_block_factors(wb);
            for r in 0..R {
                let xb = x.get_unchecked(r * nb + b);
                let dx = _mm256_set1_ps(xb.d);
                let block_sums = _mm256_loadu_ps(side.as_ptr().add(8 * (r * nb + b)));
                let a = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(s0[r]),
                    _mm256_mul_ps(scales0, dx),
                    acc0[r],
                );
                acc0[r] = _mm256_fnmadd_ps(mins0, block_sums, a);
                let a = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(s1[r]),
                    _mm256_mul_ps(scales1, dx),
                    acc1[r],
                );
                acc1[r] = _mm256_fnmadd_ps(mins1, block_sums, a);
            }
        }
        for r in 0..R {
            out0[r] = hsum(acc0[r]);
            out1[r] = hsum(acc1[r]);
        }
    }

    q4k_tile!(q4k_tile_avx2, "avx2,fma", int::dot8_u4i8_avx2);
    q4k_tile!(
        q4k_tile_vnni,
        "avx2,fma,avx512vnni,avx512vl",
        int::dot8_u4i8_vnni
    );

    pub fn q6k_q8k(w: &[BlockQ6KInterleaved], x: &[BlockQ8K], side: &[f32], out: &mut [f32]) {
        // SAFETY: layouts checked in `layout`.
        let (w, x) = unsafe { (cast::<_, Q6K>(w), cast::<_, Q8K>(x)) };
        q6k_rows(w.as_ptr(), 1, w.len(), x, side, out);
    }

    macro_rules! q6k_tile {
        ($name:ident, $features:literal, $dot2:path) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(
                w: *const Q6K,
                step: usize,
                nb: usize,
                x: &[Q8K],
                side: &[f32],
                out: &mut [f32],
            ) {
                let m4 = _mm256_set1_epi8(0x0F);
                let m_high = _mm256_set1_epi8(0x30);
                // Even-numbered scales to bytes 0-7, odd ones to bytes 8-15.
                let deinterleave =
                    _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
                let mut acc = [_mm256_setzero_ps(); R];
                for b in 0..nb {
                    let wb = &*w.add(b * step);
                    prefetch_k_quant(wb as *const Q6K as *const u8, 210);
                    let d = _mm256_set1_ps(wb.d.to_f32());
                    let sc = _mm_shuffle_epi8(
                        _mm_loadu_si128(wb.scales.as_ptr() as *const __m128i),
                        deinterleave,
                    );
                    // Lane i of the even (odd) accumulator is group 2i (2i + 1).
                    let scales_even =
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
                    let scales_odd = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))),
                        d,
                    );
                    let mut q = [_mm256_setzero_si256(); 8];
                    for j in 0..4 {
                        let v = load(wb.ql.as_ptr().add(32 * j));
                        q[2 * j] = _mm256_and_si256(v, m4);
                        q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                    for h in 0..2 {
                        let v = load(wb.qh.as_ptr().add(32 * h));
                        let high = [
                            _mm256_slli_epi16(v, 4),
                            _mm256_slli_epi16(v, 2),
                            v,
                            _mm256_srli_epi16(v, 2),
                        ];
                        for (c, bits) in high.into_iter().enumerate() {
                            let t = 4 * h + c;
                            q[t] = _mm256_or_si256(q[t], _mm256_and_si256(bits, m_high));
                        }
                    }
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xb = x.get_unchecked(r * nb + b);
                        let xq = xb.qs.as_ptr() as *const u8;
                        let init = side.as_ptr().add(16 * (r * nb + b)) as *const __m256i;
                        let even = $dot2(_mm256_loadu_si256(init), q[0], xq, q[1], xq.add(32));
                        let odd = $dot2(
                            _mm256_loadu_si256(init.add(1)),
                            q[4],
                            xq.add(128),
                            q[5],
                            xq.add(160),
                        );
                        let even = $dot2(even, q[2], xq.add(64), q[3], xq.add(96));
                        let odd = $dot2(odd, q[6], xq.add(192), q[7], xq.add(224));
                        let dx = _mm256_set1_ps(xb.d);
                        *a = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(even),
                            _mm256_mul_ps(scales_even, dx),
                            *a,
                        );
                        *a = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(odd),
                            _mm256_mul_ps(scales_odd, dx),
                            *a,
                        );
                    }
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = hsum(a);
                }
            }
        };
    }
    /// Two Q6_K rows (see the two-row kernels above). Per block, the even groups' sums for all activation rows,
    /// then the odd groups', so only one phase's partial sums are live at a time.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn q6k_pair_tile_vnni<const R: usize>(
        w0: *const Q6K,
        w1: *const Q6K,
        step: usize,
        nb: usize,
        x: &[Q8K],
        side: &[f32],
        out0: &mut [f32],
        out1: &mut [f32],
    ) {
        let m4 = _mm256_set1_epi8(0x0F);
        let m_high = _mm256_set1_epi8(0x30);
        let deinterleave = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        // Lane i of the even (odd) phase's scales is group 2i (2i + 1), times the block scale.
        let scales = |wb: &Q6K| {
            let d = _mm256_set1_ps(wb.d.to_f32());
            let sc = _mm_shuffle_epi8(
                _mm_loadu_si128(wb.scales.as_ptr() as *const __m128i),
                deinterleave,
            );
            [
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),
                _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))),
                    d,
                ),
            ]
        };
        // Unpacked weight register t (0..8) of a block: low nibbles from ql, two high bits from qh.
        let weights = |wb: &Q6K, t: usize| {
            let v = load(wb.ql.as_ptr().add(32 * (t / 2)));
            let low = if t.is_multiple_of(2) {
                v
            } else {
                _mm256_srli_epi16(v, 4)
            };
            let h = load(wb.qh.as_ptr().add(32 * (t / 4)));
            let high = match t % 4 {
                0 => _mm256_slli_epi16(h, 4),
                1 => _mm256_slli_epi16(h, 2),
                2 => h,
                _ => _mm256_srli_epi16(h, 2),
            };
            _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_and_si256(high, m_high))
        };
        let mut acc0 = [_mm256_setzero_ps(); R];
        let mut acc1 = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let (wa, wb) = (&*w0.add(b * step), &*w1.add(b * step));
            prefetch_k_quant(wa as *const Q6K as *const u8, 210);
            prefetch_k_quant(wb as *const Q6K as *const u8, 210);
            // Kept in memory (four loads per activation row) rather than four registers: with five rows the
            // registers are all taken by partial sums and accumulators.
            let scale_table: [[__m256; 2]; 2] = [scales(wa), scales(wb)];
            let scale_ptr = scale_table.as_ptr() as *const f32;
            for phase in 0..2 {
                let mut s0 = [_mm256_setzero_si256(); R];
                let mut s1 = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let init = side.as_ptr().add(16 * (r * nb + b) + 8 * phase) as *const __m256i;
                    s0[r] = _mm256_loadu_si256(init);
                    s1[r] = s0[r];
                }
                for c in 0..4 {
                    let t = 4 * phase + c;
                    let (qa, qb) = (weights(wa, t), weights(wb, t));
                    for r in 0..R {
                        let xq = x.get_unchecked(r * nb + b).qs.as_ptr() as *const u8;
                        let xt = load(xq.add(32 * t));
                        s0[r] = _mm256_dpbusd_epi32(s0[r], qa, xt);
                        s1[r] = _mm256_dpbusd_epi32(s1[r], qb, xt);
                    }
                }
                for r in 0..R {
                    let dx = _mm256_set1_ps(x.get_unchecked(r * nb + b).d);
                    acc0[r] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(s0[r]),
                        _mm256_mul_ps(_mm256_loadu_ps(scale_ptr.add(8 * phase)), dx),
                        acc0[r],
                    );
                    acc1[r] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(s1[r]),
                        _mm256_mul_ps(_mm256_loadu_ps(scale_ptr.add(16 + 8 * phase)), dx),
                        acc1[r],
                    );
                }
            }
        }
        for r in 0..R {
            out0[r] = hsum(acc0[r]);
            out1[r] = hsum(acc1[r]);
        }
    }

    q6k_tile!(q6k_tile_avx2, "avx2,fma", int::dot2_u6i8_avx2);
    q6k_tile!(
        q6k_tile_vnni,
        "avx2,fma,avx512vnni,avx512vl",
        int::dot2_u6i8_vnni
    );

    /// Q8_0 activations: each block's scale as f32.
    /// Q8_0 activations: per row, each block's scale as f32, then `128 * (sum of the block's values)` as i32
    /// bits (the VNNI kernel's correction for reading weights as unsigned bytes).
    pub fn prepare_q8_0(x: &mut [BlockQ8_0], blocks_per_row: usize, side: &mut Vec<f32>) {
        // SAFETY: layouts checked in `layout`.
        let x = unsafe { cast::<_, Q8_0>(x) };
        for row in x.chunks(blocks_per_row.max(1)) {
            side.extend(row.iter().map(|b| b.d.to_f32()));
            side.extend(row.iter().map(|b| {
                let sum: i32 = b.qs.iter().map(|&v| v as i32).sum();
                f32::from_bits((128 * sum) as u32)
            }));
        }
    }

    /// Q8_1 activations: per row, each block's scale, then each block's sum, as f32.
    pub fn prepare_q8_1(x: &mut [BlockQ8_1], blocks_per_row: usize, side: &mut Vec<f32>) {
        // SAFETY: layouts checked in `layout`.
        let x = unsafe { cast::<_, Q8_1>(x) };
        for row in x.chunks(blocks_per_row.max(1)) {
            side.extend(row.iter().map(|b| b.d.to_f32()));
            side.extend(row.iter().map(|b| b.s.to_f32()));
        }
    }

    pub fn q8_0_q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0], side: &[f32], out: &mut [f32]) {
        // SAFETY: layouts checked in `layout`.
        let (w, x) = unsafe { (cast::<_, Q8_0>(w), cast::<_, Q8_0>(x)) };
        if has_vnni() {
            by_tiles!(q8_0_tile_vnni, w, x, side, 2, out)
        } else {
            by_tiles!(q8_0_tile_avx2, w, x, side, 2, out)
        }
    }

    pub fn q8_0_interleaved_q8_0(
        w: &[BlockQ8_0Interleaved],
        x: &[BlockQ8_0],
        side: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: layouts checked in `layout` (the interleaved blocks are 34-byte Q8_0 units).
        let (w, x) = unsafe { (cast::<_, Q8_0>(w), cast::<_, Q8_0>(x)) };
        if has_vnni() {
            by_tiles!(q8_0_interleaved_tile_vnni, w, x, side, 2, out)
        } else {
            by_tiles!(q8_0_interleaved_tile_avx2, w, x, side, 2, out)
        }
    }

    /// Q8_0 activations for interleaved Q8_0 weights: the side data of [`prepare_q8_0`], then each row's values
    /// interleaved like the weights (`repack::interleave_q8_0_row`).
    pub fn prepare_q8_0_interleaved(
        x: &mut [BlockQ8_0],
        blocks_per_row: usize,
        side: &mut Vec<f32>,
    ) {
        prepare_q8_0(x, blocks_per_row, side);
        for row in x.chunks_mut(blocks_per_row.max(1)) {
            interleave_q8_0_row(row);
        }
    }

    pub fn q5_0_q8_0(w: &[BlockQ5_0Interleaved], x: &[BlockQ8_0], side: &[f32], out: &mut [f32]) {
        // SAFETY: layouts checked in `layout` (the interleaved blocks are 22-byte Q5_0 units).
        let (w, x) = unsafe { (cast::<_, Q5_0>(w), cast::<_, Q8_0>(x)) };
        if has_vnni() && has_avx512bw() {
            by_tiles!(q5_0_tile_avx512, w, x, side, 2, out)
        } else {
            by_tiles!(q5_0_tile_avx2, w, x, side, 2, out)
        }
    }

    /// Q8_0 activations for interleaved Q5_0 weights: per row, for each whole group of 8 blocks the 8 scales
    /// and the 8 values `-16 * sum(x)` as i32 bits (the initial accumulators, which turn the weights' unsigned
    /// 5-bit codes back into GGML's signed values exactly), then the same for the tail blocks; the values are
    /// interleaved like the weights (`repack::interleave_q8_0_row`).
    pub fn prepare_q5_0(x: &mut [BlockQ8_0], blocks_per_row: usize, side: &mut Vec<f32>) {
        side.reserve(2 * x.len());
        for row in x.chunks_mut(blocks_per_row.max(1)) {
            {
                // SAFETY: layouts checked in `layout`.
                let blocks = unsafe { cast::<_, Q8_0>(row) };
                for chunk in blocks.chunks(GROUP) {
                    side.extend(chunk.iter().map(|b| b.d.to_f32()));
                    side.extend(chunk.iter().map(|b| {
                        let sum: i32 = b.qs.iter().map(|&v| v as i32).sum();
                        f32::from_bits((-16 * sum) as u32)
                    }));
                }
            }
            interleave_q8_0_row(row);
        }
    }

    pub fn q4_1_interleaved_q8_1(
        w: &[BlockQ4_1Interleaved],
        x: &[BlockQ8_1],
        x_scales: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: layouts checked in `layout` (the interleaved blocks are 20-byte Q4_1 units).
        let (w, x) = unsafe { (cast::<_, Q4_1>(w), cast::<_, Q8_1>(x)) };
        if has_vnni() {
            by_tiles!(q4_1_interleaved_tile_vnni, w, x, x_scales, 2, out)
        } else {
            by_tiles!(q4_1_interleaved_tile_avx2, w, x, x_scales, 2, out)
        }
    }

    /// Q8_1 activations for interleaved Q4_1 weights: the side data of [`prepare_q8_1`] (per row its blocks'
    /// scales, then their sums), then each row's values interleaved like the weights
    /// (`repack::interleave_q8_1_row`).
    pub fn prepare_q4_1(x: &mut [BlockQ8_1], blocks_per_row: usize, side: &mut Vec<f32>) {
        prepare_q8_1(x, blocks_per_row, side);
        for row in x.chunks_mut(blocks_per_row.max(1)) {
            interleave_q8_1_row(row);
        }
    }

    pub fn q4_1_q8_1(w: &[BlockQ4_1], x: &[BlockQ8_1], x_scales: &[f32], out: &mut [f32]) {
        // SAFETY: layouts checked in `layout`.
        let (w, x) = unsafe { (cast::<_, Q4_1>(w), cast::<_, Q8_1>(x)) };
        by_tiles!(q4_1_tile, w, x, x_scales, 2, out)
    }

    // The 32-element block types (Q8_0, Q5_0, Q4_1) carry one f16 scale per 32 weights, so per-block float work
    // (convert the scales, multiply, convert the integer sum, accumulate) costs as much as the integer dot
    // product. These kernels take blocks in groups of 8: each block's eight i32 partial sums are reduced into
    // one lane of a single vector, and the group is scaled and accumulated with one convert and one FMA. A
    // short last group is padded with zero sums and zero scales, which add exactly nothing. (VNNI dot products
    // measured no faster for these types: the integer part is not their bottleneck. Interleaved Q5_0 and Q4_1
    // skip the reduction altogether (and interleaved Q8_0): one block's sum per lane.)
    const GROUP: usize = 8;

    /// Lane j of the result = the sum of the eight lanes of `p[j]` (exact integer arithmetic).
    #[inline(always)]
    unsafe fn reduce8(p: &[__m256i; GROUP]) -> __m256i {
        let h01 = _mm256_hadd_epi32(p[0], p[1]);
        let h23 = _mm256_hadd_epi32(p[2], p[3]);
        let h45 = _mm256_hadd_epi32(p[4], p[5]);
        let h67 = _mm256_hadd_epi32(p[6], p[7]);
        // q: [p0..p3 low-half sums | p0..p3 high-half sums]; r likewise for p4..p7.
        let q = _mm256_hadd_epi32(h01, h23);
        let r = _mm256_hadd_epi32(h45, h67);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(q, r, 0x20),
            _mm256_permute2x128_si256(q, r, 0x31),
        )
    }

    /// Eight f16 values (zero past `n`) as f32 lanes. The halves are packed into two u64 with scalar shifts (the
    /// integer pipes are idle here), then moved over: eight `pinsrw` form a serial chain on one vector register
    /// that cost Q8_0 0.6 ns per block at one row (`examples/kernel_micro.rs`), and a store of eight u16 followed
    /// by a vector load would stall on store forwarding.
    #[inline(always)]
    unsafe fn f16x8(n: usize, get: impl Fn(usize) -> half::f16) -> __m256 {
        let v = |j: usize| if j < n { get(j).to_bits() as u64 } else { 0 };
        let lo = v(0) | (v(1) << 16) | (v(2) << 32) | (v(3) << 48);
        let hi = v(4) | (v(5) << 16) | (v(6) << 32) | (v(7) << 48);
        _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
    }

    /// Eight f32 values from `p` (zero past `n`, without reading past it).
    #[inline(always)]
    unsafe fn f32x8(n: usize, p: *const f32) -> __m256 {
        if n == GROUP {
            _mm256_loadu_ps(p)
        } else {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes);
            _mm256_maskload_ps(p, mask)
        }
    }

    /// Signed-by-signed byte dot products via the unsigned-by-signed instruction: |w| * (x * sign(w)).
    #[inline(always)]
    unsafe fn dot_signed(abs_w: __m256i, w: __m256i, x: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// Q8_0 weights against Q8_0 activations, one group of `$n` <= 8 blocks starting at `$g0`, for every row of
    /// the tile (a macro, not a function, so that it is expanded inside the tile function with its target
    /// features, and so that a constant `$n` lets the compiler unroll the group). `$side` holds per row the
    /// blocks' scales, then `128 * (block sum)` as i32 bits. With VNNI the weights are read as unsigned bytes
    /// (w + 128: one `vpdpbusd` per block, minus 128 x the activation sum per block, applied after the
    /// reduction); without it, |w| * (x * sign(w)). Both give the exact integer sums, so the same floats.
    macro_rules! q8_0_group {
        ($vnni:expr, $n:expr, $g0:expr, $w:ident, $x:ident, $side:ident, $acc:ident) => {{
            let n: usize = $n;
            let g0: usize = $g0;
            let nb = $w.len();
            prefetch_ahead(
                $w.as_ptr().add(g0) as *const u8,
                n * std::mem::size_of::<Q8_0>(),
            );
            let dw = f16x8(n, |j| $w.get_unchecked(g0 + j).d);
            let mut wq = [_mm256_setzero_si256(); GROUP];
            for (j, q) in wq.iter_mut().enumerate().take(n) {
                let v = load($w.get_unchecked(g0 + j).qs.as_ptr() as *const u8);
                *q = if $vnni {
                    _mm256_xor_si256(v, _mm256_set1_epi8(-128))
                } else {
                    v
                };
            }
            for (r, a) in $acc.iter_mut().enumerate() {
                let xr = $x.as_ptr().add(r * nb + g0);
                let row_side = $side.as_ptr().add(2 * r * nb);
                let mut p = [_mm256_setzero_si256(); GROUP];
                for j in 0..n {
                    let xq = load((*xr.add(j)).qs.as_ptr() as *const u8);
                    p[j] = if $vnni {
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq[j], xq)
                    } else {
                        dot_signed(_mm256_sign_epi8(wq[j], wq[j]), wq[j], xq)
                    };
                }
                let mut sums = reduce8(&p);
                if $vnni {
                    let offsets = _mm256_castps_si256(f32x8(n, row_side.add(nb + g0)));
                    sums = _mm256_sub_epi32(sums, offsets);
                }
                let dx = f32x8(n, row_side.add(g0));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, dx), *a);
            }
        }};
    }

    macro_rules! q8_0_tile {
        ($name:ident, $features:literal, $vnni:expr) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(w: &[Q8_0], x: &[Q8_0], side: &[f32], out: &mut [f32]) {
                let nb = w.len();
                let mut acc = [_mm256_setzero_ps(); R];
                let full = nb / GROUP * GROUP;
                let mut g0 = 0;
                while g0 < full {
                    q8_0_group!($vnni, GROUP, g0, w, x, side, acc);
                    g0 += GROUP;
                }
                if full < nb {
                    q8_0_group!($vnni, nb - full, full, w, x, side, acc);
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = hsum(a);
                }
            }
        };
    }
    q8_0_tile!(q8_0_tile_avx2, "avx2,fma", false);
    q8_0_tile!(q8_0_tile_vnni, "avx2,fma,avx512vnni,avx512vl", true);

    // Interleaved Q8_0 (see `repack`): register t of a group holds in lane j values 4t .. 4t + 4 of block j, so
    // eight dot products a row leave block j's integer sum in lane j: the lanes `q8_0_group!` gets by reducing,
    // with the same offset correction (VNNI) and the same float operations, so bitwise its results. The tail (a
    // row's last nb % 8 blocks, in GGML order) goes through `q8_0_group!` itself.
    macro_rules! q8_0_interleaved_tile {
        ($name:ident, $features:literal, $vnni:expr) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(w: &[Q8_0], x: &[Q8_0], side: &[f32], out: &mut [f32]) {
                let nb = w.len();
                let groups = nb / GROUP;
                let zero = _mm256_setzero_si256();
                let mut acc = [_mm256_setzero_ps(); R];
                let base = w.as_ptr() as *const u8;
                for g in 0..groups {
                    let gp = base.add(g * GROUP * 34);
                    prefetch_ahead(gp, GROUP * 34);
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(gp as *const __m128i));
                    let mut wq = [zero; GROUP];
                    let mut wabs = [zero; GROUP];
                    for t in 0..GROUP {
                        let v = load(gp.add(16 + 32 * t));
                        if $vnni {
                            wq[t] = _mm256_xor_si256(v, _mm256_set1_epi8(-128));
                        } else {
                            wq[t] = v;
                            wabs[t] = _mm256_sign_epi8(v, v);
                        }
                    }
                    for r in 0..R {
                        let xg = x.as_ptr().add(r * nb + g * GROUP);
                        let xq = |t: usize| load((*xg.add(t)).qs.as_ptr() as *const u8);
                        let dot = |t: usize, a: __m256i| {
                            if $vnni {
                                _mm256_dpbusd_epi32(a, wq[t], xq(t))
                            } else {
                                _mm256_add_epi32(a, dot_signed(wabs[t], wq[t], xq(t)))
                            }
                        };
                        let (mut s0, mut s1) = (dot(0, zero), dot(1, zero));
                        s0 = dot(2, s0);
                        s1 = dot(3, s1);
                        s0 = dot(4, s0);
                        s1 = dot(5, s1);
                        s0 = dot(6, s0);
                        s1 = dot(7, s1);
                        let mut sums = _mm256_add_epi32(s0, s1);
                        let row_side = side.as_ptr().add(2 * r * nb);
                        if $vnni {
                            let offsets =
                                _mm256_loadu_si256(row_side.add(nb + g * GROUP) as *const __m256i);
                            sums = _mm256_sub_epi32(sums, offsets);
                        }
                        let dx = _mm256_loadu_ps(row_side.add(g * GROUP));
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(sums),
                            _mm256_mul_ps(dw, dx),
                            acc[r],
                        );
                    }
                }
                let full = groups * GROUP;
                if full < nb {
                    q8_0_group!($vnni, nb - full, full, w, x, side, acc);
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = hsum(a);
                }
            }
        };
    }
    q8_0_interleaved_tile!(q8_0_interleaved_tile_avx2, "avx2,fma", false);
    q8_0_interleaved_tile!(
        q8_0_interleaved_tile_vnni,
        "avx2,fma,avx512vnni,avx512vl",
        true
    );

    /// 32 nibbles from 16 bytes: low nibbles are elements 0-15, high nibbles elements 16-31 (GGML order).
    #[inline(always)]
    unsafe fn nibbles(qs: *const u8) -> __m256i {
        let v = _mm_loadu_si128(qs as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// Sets bit 4 of byte i of `v` where bit i of `mask` is set (a Q5_0 fifth bit): AVX2 expands the mask
    /// with a shuffle and compare, AVX-512 BW uses it directly as a byte mask. The same bytes either way.
    #[inline(always)]
    unsafe fn fifth_bits_avx2(v: __m256i, mask: u32) -> __m256i {
        // Byte i of the expanded bits looks at byte i / 8 of the mask and keeps only bit i % 8 clear.
        let byte_of_bit = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let other_bits = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfeu64 as i64);
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(mask as i32), byte_of_bit);
        let bit_set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, other_bits), _mm256_set1_epi8(-1));
        _mm256_or_si256(v, _mm256_and_si256(bit_set, _mm256_set1_epi8(0x10)))
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn fifth_bits_avx512(v: __m256i, mask: u32) -> __m256i {
        // Bit 4 of every byte is clear (nibbles), so adding 16 sets it.
        _mm256_mask_add_epi8(v, mask, v, _mm256_set1_epi8(0x10))
    }

    // Interleaved Q5_0 (see `repack`): per group of 8 blocks, register t holds in lane j the unsigned 5-bit codes
    // 4t .. 4t + 4 of block j, so eight dot products per row give the 8 blocks' sums in the 8 lanes, and the
    // 8 scales apply with one multiply. Tail blocks (a row's last nb % 8) take the GGML-order path.
    macro_rules! q5_0_tile {
        ($name:ident, $features:literal, $dot:path, $fifth:path) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(w: &[Q5_0], x: &[Q8_0], side: &[f32], out: &mut [f32]) {
                let nb = w.len();
                let groups = nb / GROUP;
                let m4 = _mm256_set1_epi8(0x0F);
                let zero = _mm256_setzero_si256();
                let mut acc = [_mm256_setzero_ps(); R];
                let base = w.as_ptr() as *const u8;
                for g in 0..groups {
                    let gp = base.add(g * GROUP * 22);
                    prefetch_ahead(gp, GROUP * 22);
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(gp as *const __m128i));
                    let mut q = [zero; GROUP];
                    for c in 0..4 {
                        let v = load(gp.add(48 + 32 * c));
                        q[2 * c] = _mm256_and_si256(v, m4);
                        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                    for (t, qt) in q.iter_mut().enumerate() {
                        let mask = (gp.add(16 + 4 * t) as *const u32).read_unaligned();
                        *qt = $fifth(*qt, mask);
                    }
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xg = x.as_ptr().add(r * nb + g * GROUP);
                        let xq = |t: usize| load((*xg.add(t)).qs.as_ptr() as *const u8);
                        let sd = side.as_ptr().add(2 * nb * r + 2 * GROUP * g);
                        let init = _mm256_loadu_si256(sd.add(GROUP) as *const __m256i);
                        let mut s0 = $dot(init, q[0], xq(0));
                        let mut s1 = $dot(zero, q[1], xq(1));
                        s0 = $dot(s0, q[2], xq(2));
                        s1 = $dot(s1, q[3], xq(3));
                        s0 = $dot(s0, q[4], xq(4));
                        s1 = $dot(s1, q[5], xq(5));
                        s0 = $dot(s0, q[6], xq(6));
                        s1 = $dot(s1, q[7], xq(7));
                        let sums = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
                        *a = _mm256_fmadd_ps(sums, _mm256_mul_ps(dw, _mm256_loadu_ps(sd)), *a);
                    }
                }
                let n = nb - groups * GROUP;
                if n > 0 {
                    let t0 = groups * GROUP;
                    let mut q = [zero; GROUP];
                    for (j, qj) in q.iter_mut().enumerate().take(n) {
                        let b = w.get_unchecked(t0 + j);
                        *qj = $fifth(nibbles(b.qs.as_ptr()), u32::from_le_bytes(b.qh));
                    }
                    let dw = f16x8(n, |j| w.get_unchecked(t0 + j).d);
                    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes);
                    for (r, a) in acc.iter_mut().enumerate() {
                        let mut p = [zero; GROUP];
                        for (j, pj) in p.iter_mut().enumerate().take(n) {
                            let xb = x.get_unchecked(r * nb + t0 + j);
                            *pj = $dot(zero, q[j], load(xb.qs.as_ptr() as *const u8));
                        }
                        let sd = side.as_ptr().add(2 * nb * r + 2 * t0);
                        let init = _mm256_maskload_epi32(sd.add(n) as *const i32, live);
                        let sums = _mm256_cvtepi32_ps(_mm256_add_epi32(reduce8(&p), init));
                        *a = _mm256_fmadd_ps(sums, _mm256_mul_ps(dw, f32x8(n, sd)), *a);
                    }
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = hsum(a);
                }
            }
        };
    }
    q5_0_tile!(
        q5_0_tile_avx2,
        "avx2,fma,f16c",
        int::dot_u8i8_avx2,
        fifth_bits_avx2
    );
    q5_0_tile!(
        q5_0_tile_avx512,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        int::dot_u8i8_vnni,
        fifth_bits_avx512
    );

    /// Q4_1 (unsigned nibbles with a per-block scale and offset) against Q8_1 activations:
    /// sum_b d_w d_x sum(q x) + m_w s_x, where s_x = d_x sum(x). One group of `n` <= 8 blocks.
    #[inline(always)]
    unsafe fn q4_1_group<const R: usize>(
        n: usize,
        g0: usize,
        w: &[Q4_1],
        x: &[Q8_1],
        scales: &[f32],
        acc: &mut [__m256; R],
        acc_offset: &mut [__m256; R],
    ) {
        let nb = w.len();
        prefetch_ahead(
            w.as_ptr().add(g0) as *const u8,
            n * std::mem::size_of::<Q4_1>(),
        );
        let ones = _mm256_set1_epi16(1);
        let mut q = [_mm256_setzero_si256(); GROUP];
        for (j, qj) in q.iter_mut().enumerate().take(n) {
            *qj = nibbles(w.get_unchecked(g0 + j).qs.as_ptr());
        }
        let dw = f16x8(n, |j| w.get_unchecked(g0 + j).d);
        let mw = f16x8(n, |j| w.get_unchecked(g0 + j).m);
        for r in 0..R {
            let xr = x.as_ptr().add(r * nb + g0);
            let mut p = [_mm256_setzero_si256(); GROUP];
            for j in 0..n {
                let xq = load((*xr.add(j)).qs.as_ptr() as *const u8);
                p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], xq), ones);
            }
            // Row r's scales: nb values of d, then nb values of s.
            let dx = f32x8(n, scales.as_ptr().add(2 * r * nb + g0));
            let sx = f32x8(n, scales.as_ptr().add(2 * r * nb + nb + g0));
            acc[r] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(reduce8(&p)),
                _mm256_mul_ps(dw, dx),
                acc[r],
            );
            acc_offset[r] = _mm256_fmadd_ps(mw, sx, acc_offset[r]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_tile<const R: usize>(w: &[Q4_1], x: &[Q8_1], scales: &[f32], out: &mut [f32]) {
        let nb = w.len();
        let mut acc = [_mm256_setzero_ps(); R];
        let mut acc_offset = [_mm256_setzero_ps(); R];
        let full = nb / GROUP * GROUP;
        let mut g0 = 0;
        while g0 < full {
            q4_1_group::<R>(GROUP, g0, w, x, scales, &mut acc, &mut acc_offset);
            g0 += GROUP;
        }
        if full < nb {
            q4_1_group::<R>(nb - full, full, w, x, scales, &mut acc, &mut acc_offset);
        }
        for r in 0..R {
            out[r] = hsum(acc[r]) + hsum(acc_offset[r]);
        }
    }

    // Interleaved Q4_1 (see `repack`): per group of 8 blocks, register t holds in lane j the codes 4t .. 4t + 4
    // of block j, so eight dot products per row leave block j's integer sum in lane j: exactly the lanes that
    // `q4_1_group` gets by reducing per-block vectors, scaled and accumulated by the same float operations, so
    // the results are bitwise those of `q4_1_tile` on the same blocks in GGML order. The tail (a row's last
    // nb % 8 blocks, in GGML order) goes through `q4_1_group` itself.
    macro_rules! q4_1_interleaved_tile {
        ($name:ident, $features:literal, $dot:path) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(
                w: &[Q4_1],
                x: &[Q8_1],
                scales: &[f32],
                out: &mut [f32],
            ) {
                let nb = w.len();
                let groups = nb / GROUP;
                let m4 = _mm256_set1_epi8(0x0F);
                let zero = _mm256_setzero_si256();
                let mut acc = [_mm256_setzero_ps(); R];
                let mut acc_offset = [_mm256_setzero_ps(); R];
                let base = w.as_ptr() as *const u8;
                for g in 0..groups {
                    let gp = base.add(g * GROUP * 20);
                    prefetch_ahead(gp, GROUP * 20);
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(gp as *const __m128i));
                    let mw = _mm256_cvtph_ps(_mm_loadu_si128(gp.add(16) as *const __m128i));
                    let mut q = [zero; GROUP];
                    for c in 0..4 {
                        let v = load(gp.add(32 + 32 * c));
                        q[2 * c] = _mm256_and_si256(v, m4);
                        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                    for r in 0..R {
                        let xg = x.as_ptr().add(r * nb + g * GROUP);
                        let xq = |t: usize| load((*xg.add(t)).qs.as_ptr() as *const u8);
                        let mut s0 = $dot(zero, q[0], xq(0));
                        let mut s1 = $dot(zero, q[1], xq(1));
                        s0 = $dot(s0, q[2], xq(2));
                        s1 = $dot(s1, q[3], xq(3));
                        s0 = $dot(s0, q[4], xq(4));
                        s1 = $dot(s1, q[5], xq(5));
                        s0 = $dot(s0, q[6], xq(6));
                        s1 = $dot(s1, q[7], xq(7));
                        let sums = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
                        // Row r's side data: nb scales d, then nb sums s.
                        let sd = scales.as_ptr().add(2 * r * nb + g * GROUP);
                        let dx = _mm256_loadu_ps(sd);
                        let sx = _mm256_loadu_ps(sd.add(nb));
                        acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dw, dx), acc[r]);
                        acc_offset[r] = _mm256_fmadd_ps(mw, sx, acc_offset[r]);
                    }
                }
                let full = groups * GROUP;
                if full < nb {
                    q4_1_group::<R>(nb - full, full, w, x, scales, &mut acc, &mut acc_offset);
                }
                for r in 0..R {
                    out[r] = hsum(acc[r]) + hsum(acc_offset[r]);
                }
            }
        };
    }
    q4_1_interleaved_tile!(
        q4_1_interleaved_tile_avx2,
        "avx2,fma,f16c",
        int::dot_u8i8_avx2
    );
    q4_1_interleaved_tile!(
        q4_1_interleaved_tile_vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        int::dot_u8i8_vnni
    );

    /// Runs `f` with the AVX2 kernels even on a VNNI machine (tests compare the two paths bitwise).
    #[cfg(test)]
    pub fn with_avx2_only<T>(f: impl FnOnce() -> T) -> T {
        FORCE_AVX2.with(|c| c.set(true));
        let out = f();
        FORCE_AVX2.with(|c| c.set(false));
        out
    }

    #[cfg(test)]
    thread_local! {
        static FORCE_AVX2: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    #[cfg(test)]
    mod factor_tests {
        use super::*;
        use half::f16;

        /// The shuffled unpacking of a Q4_K block's scales and mins gives the scalar reference's f32 products bit
        /// for bit, over every value of each packed byte position and random d / dmin (subnormal, negative and
        /// large f16 included).
        #[test]
        fn q4k_block_factors_match_the_scalar_unpacking() {
            let mut next = crate::testing::xorshift64(0x2545_F491_4F6C_DD1Du64);
            let specials = [0x0001u16, 0x8001, 0x3C00, 0xBC00, 0x7BFF, 0x0400, 0x0000];
            for case in 0..4096usize {
                let mut b = Q4K {
                    d: f16::from_bits(next() as u16),
                    dmin: f16::from_bits(next() as u16),
                    scales: [0; 12],
                    qs: [0; 128],
                };
                for (i, s) in b.scales.iter_mut().enumerate() {
                    // Byte i takes every value 0-255 across the cases, the others random.
                    *s = if case / 256 == i % 16 {
                        case as u8
                    } else {
                        next() as u8
                    };
                }
                if case < specials.len() {
                    b.d = f16::from_bits(specials[case]);
                    b.dmin = f16::from_bits(specials[specials.len() - 1 - case]);
                }
                if b.d.is_nan() || b.dmin.is_nan() {
                    continue; // NaN payloads aside, a NaN factor compares unequal to itself
                }
                let (sc, mn) = q4k_scales_mins(&b.scales);
                let (want_s, want_m) = unsafe {
                    (
                        _mm256_mul_ps(u8x8_to_f32(sc), _mm256_set1_ps(b.d.to_f32())),
                        _mm256_mul_ps(u8x8_to_f32(mn), _mm256_set1_ps(b.dmin.to_f32())),
                    )
                };
                let (got_s, got_m) = unsafe { q4k_block_factors(&b) };
                let bits = |v: __m256| -> [u32; 8] { unsafe { std::mem::transmute(v) } };
                assert_eq!(
                    bits(got_s),
                    bits(want_s),
                    "scales, case {case}: {:?}",
                    b.scales
                );
                assert_eq!(
                    bits(got_m),
                    bits(want_m),
                    "mins, case {case}: {:?}",
                    b.scales
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pseudo_random;

    fn quantize<T: GgmlType>(data: &[f32]) -> Vec<T> {
        let mut out: Vec<T> = (0..data.len() / T::BLCK_SIZE).map(|_| T::zeros()).collect();
        T::from_float(data, &mut out);
        out
    }

    /// The fast kernel agrees with the per-row reference for every row count up to two full tiles plus one
    /// (so several tile sizes and multi-pass splits are exercised), within float reassociation error, and
    /// each row's result does not depend on the row count (bitwise).
    /// Rows r0..r1 of per-row activation scales computed for `rows` rows.
    fn row_scales(sc: &[f32], rows: usize, r0: usize, r1: usize) -> &[f32] {
        let stride = sc.len() / rows;
        &sc[r0 * stride..r1 * stride]
    }

    /// Quantized activations prepared for `kernel`, with their side data.
    fn prepared<T: FastRowsDot>(
        kernel: &RowsKernel<T>,
        x: &[T::VecDotType],
        k: usize,
    ) -> (Vec<T::VecDotType>, Vec<f32>) {
        let mut x = x.to_vec();
        let mut side = Vec::new();
        (kernel.prepare)(&mut x, k / T::VecDotType::BLCK_SIZE, &mut side);
        (x, side)
    }

    /// Whether this build must have the multi-row kernels: every x86-64 build does (.cargo/config.toml turns
    /// on AVX2/FMA), unless `SPECULA_ALLOW_NO_AVX2=1` says it was built without them on purpose (README,
    /// "Building for other CPUs"). Then the kernel tests say loudly that they did not run.
    fn fast_kernels_expected() -> bool {
        let allowed_without = std::env::var_os("SPECULA_ALLOW_NO_AVX2").is_some();
        if !cfg!(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        )) {
            eprintln!(
                "WARNING: this build has no AVX2/FMA kernels; the multi-row kernel tests did not run{}",
                if allowed_without { " (SPECULA_ALLOW_NO_AVX2 is set)" } else { "" }
            );
        }
        cfg!(target_arch = "x86_64") && !allowed_without
    }

    fn check<T: FastRowsDot>(k: usize, seed: u64) {
        let Some(fast_kernel) = T::fast_kernel() else {
            assert!(
                !fast_kernels_expected(),
                "{} has no multi-row kernel in this x86-64 build: .cargo/config.toml's AVX2/FMA flags were lost",
                std::any::type_name::<T>()
            );
            return;
        };
        let fast = fast_kernel.rows_dot;
        let max_rows = 17;
        let w: Vec<T> = quantize(&pseudo_random(k, seed));
        // Activations with outliers, as real hidden states have.
        let mut xf = pseudo_random(max_rows * k, seed + 1);
        for (i, v) in xf.iter_mut().enumerate() {
            if i % 97 == 0 {
                *v *= 30.0;
            }
        }
        let x_plain: Vec<T::VecDotType> = quantize(&xf);
        let mut reference = vec![0f32; max_rows];
        let reference_kernel = T::reference_kernel();
        let (x_ref, side_ref) = prepared(&reference_kernel, &x_plain, k);
        (reference_kernel.rows_dot)(&w, &x_ref, &side_ref, &mut reference);
        let (x, sc) = prepared(&fast_kernel, &x_plain, k);
        let magnitude: f32 = reference.iter().map(|v| v.abs()).fold(1.0, f32::max);
        let mut single = vec![0f32; max_rows];
        for (r, s) in single.iter_mut().enumerate() {
            let xb = x.len() / max_rows;
            fast(
                &w,
                &x[r * xb..(r + 1) * xb],
                row_scales(&sc, max_rows, r, r + 1),
                std::slice::from_mut(s),
            );
        }
        for m in 1..=max_rows {
            let mut out = vec![0f32; m];
            fast(
                &w,
                &x[..m * (x.len() / max_rows)],
                row_scales(&sc, max_rows, 0, m),
                &mut out,
            );
            for r in 0..m {
                assert!(
                    (out[r] - reference[r]).abs() <= 1e-5 * magnitude,
                    "{} m={m} row {r}: fast {} vs reference {}",
                    std::any::type_name::<T>(),
                    out[r],
                    reference[r]
                );
                assert_eq!(
                    out[r].to_bits(),
                    single[r].to_bits(),
                    "{} m={m} row {r}: not batch invariant",
                    std::any::type_name::<T>()
                );
            }
        }
    }

    #[test]
    fn fast_kernels_match_reference_and_are_batch_invariant() {
        for seed in [1, 2, 3] {
            check::<BlockQ4KInterleaved>(1024, seed);
            check::<BlockQ6KInterleaved>(1024, seed);
            check::<BlockQ8_0>(512, seed);
            check::<BlockQ5_0Interleaved>(512, seed);
            check::<BlockQ5_0Interleaved>(704, seed);
            check::<BlockQ5_0Interleaved>(96, seed);
            check::<BlockQ4_1>(512, seed);
            // 16 blocks (two whole groups), 18 (SmolLM2's width: two groups and a tail of 2), 3 (a tail only).
            check::<BlockQ4_1Interleaved>(512, seed);
            check::<BlockQ4_1Interleaved>(576, seed);
            check::<BlockQ4_1Interleaved>(96, seed);
            check::<BlockQ8_0Interleaved>(512, seed);
            check::<BlockQ8_0Interleaved>(576, seed);
            check::<BlockQ8_0Interleaved>(96, seed);
        }
    }

    /// Rows in an interleaved layout (`I`) give bitwise what the GGML-order kernel gives on the same blocks
    /// (`G`) and activations: the same integer block sums in the same lanes, the same float operations. At
    /// every tile size (1-17 rows), on the default path and on the AVX2 one, for rows of whole groups, with a
    /// tail, and of a tail alone.
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    fn assert_interleaved_equals_ggml_order<G, I>(row_from_ggml: fn(&[G]) -> Vec<I>)
    where
        G: FastRowsDot + Clone,
        I: FastRowsDot<VecDotType = G::VecDotType>,
        G::VecDotType: Clone,
    {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        fn run<W: FastRowsDot>(w: &[W], x: &[W::VecDotType], m: usize, avx2_only: bool) -> Vec<f32>
        where
            W::VecDotType: Clone,
        {
            let kernel = W::fast_kernel().expect("an AVX2 build has this kernel");
            let nb = w.len();
            let (mut x, mut side, mut out) = (x.to_vec(), Vec::new(), vec![0f32; m]);
            (kernel.prepare)(&mut x, nb, &mut side);
            let mut f = || (kernel.rows_dot)(w, &x, &side, &mut out);
            if avx2_only {
                avx2::with_avx2_only(f)
            } else {
                f()
            }
            out
        }
        for (k, seed) in [(576, 1), (896, 2), (96, 3), (512, 4), (1536, 5)] {
            let nb = k / 32;
            let mut ggml: Vec<G> = (0..nb).map(|_| G::zeros()).collect();
            G::from_float(&pseudo_random(k, seed), &mut ggml);
            let interleaved = row_from_ggml(&ggml);
            for m in 1..=17 {
                let mut x: Vec<G::VecDotType> =
                    (0..m * nb).map(|_| G::VecDotType::zeros()).collect();
                G::VecDotType::from_float(&pseudo_random(m * k, seed + 11), &mut x);
                for avx2_only in [false, true] {
                    assert_eq!(
                        bits(&run(&ggml, &x, m, avx2_only)),
                        bits(&run(&interleaved, &x, m, avx2_only)),
                        "{} k={k} m={m} avx2_only={avx2_only}",
                        std::any::type_name::<I>()
                    );
                }
            }
        }
    }

    #[test]
    fn interleaved_q8_0_and_q4_1_equal_their_ggml_order_kernels_bitwise() {
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        {
            assert_interleaved_equals_ggml_order(BlockQ8_0Interleaved::row_from_ggml);
            assert_interleaved_equals_ggml_order(BlockQ4_1Interleaved::row_from_ggml);
        }
    }

    /// The pair kernel gives, for each of its two rows, bitwise the one-row kernel's result, at every row
    /// count up to two tiles plus one, on the VNNI path and on the AVX2 fallback.
    #[test]
    fn pair_kernels_equal_one_row_kernels_bitwise() {
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        warn_if_vnni_untested("pair_kernels_equal_one_row_kernels_bitwise");
        fn check_pair<T: FastRowsDot + Clone>(k: usize, seed: u64) {
            let name = std::any::type_name::<T>();
            let Some(kernel) = T::fast_kernel() else {
                assert!(
                    !fast_kernels_expected(),
                    "{name}: no multi-row kernel in an x86-64 build"
                );
                return;
            };
            let pair_dot = kernel
                .pair_dot
                .unwrap_or_else(|| panic!("{name} is stored in pairs but has no pair kernel"));
            let w0: Vec<T> = quantize(&pseudo_random(k, seed));
            let w1: Vec<T> = quantize(&pseudo_random(k, seed + 50));
            let pair: Vec<T> = w0
                .iter()
                .zip(&w1)
                .flat_map(|(a, b)| [a.clone(), b.clone()])
                .collect();
            let max_rows = 17;
            let x: Vec<T::VecDotType> = quantize(&pseudo_random(max_rows * k, seed + 1));
            let (x, side) = prepared(&kernel, &x, k);
            let xb = x.len() / max_rows;
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for m in 1..=max_rows {
                let (xs, ss) = (&x[..m * xb], row_scales(&side, max_rows, 0, m));
                let (mut e0, mut e1) = (vec![0f32; m], vec![0f32; m]);
                (kernel.rows_dot)(&w0, xs, ss, &mut e0);
                (kernel.rows_dot)(&w1, xs, ss, &mut e1);
                let (mut o0, mut o1) = (vec![0f32; m], vec![0f32; m]);
                pair_dot(&pair, xs, ss, &mut o0, &mut o1);
                assert_eq!(
                    (bits(&o0), bits(&o1)),
                    (bits(&e0), bits(&e1)),
                    "{name} m={m}"
                );
                #[cfg(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma"
                ))]
                {
                    let (mut a0, mut a1) = (vec![0f32; m], vec![0f32; m]);
                    avx2::with_avx2_only(|| pair_dot(&pair, xs, ss, &mut a0, &mut a1));
                    assert_eq!(
                        (bits(&a0), bits(&a1)),
                        (bits(&e0), bits(&e1)),
                        "{name} m={m} AVX2"
                    );
                }
            }
        }
        for seed in [1, 2] {
            check_pair::<BlockQ4KInterleaved>(1024, seed);
            check_pair::<BlockQ4KInterleaved>(256, seed);
            check_pair::<BlockQ6KInterleaved>(1024, seed);
        }
    }

    /// The VNNI and AVX2 instantiations give bitwise identical results (exact integer sums, same float steps),
    /// so machines without VNNI reproduce the same tokens.
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    #[test]
    fn vnni_and_avx2_kernels_agree_bitwise() {
        warn_if_vnni_untested("vnni_and_avx2_kernels_agree_bitwise");
        fn both<T: FastRowsDot>(k: usize, seed: u64) {
            let kernel = T::fast_kernel().unwrap();
            let fast = kernel.rows_dot;
            let w: Vec<T> = quantize(&pseudo_random(k, seed));
            let m = 6;
            let x: Vec<T::VecDotType> = quantize(&pseudo_random(m * k, seed + 7));
            let (x, sc) = prepared(&kernel, &x, k);
            let mut default_path = vec![0f32; m];
            fast(&w, &x, &sc, &mut default_path);
            let mut avx2_path = vec![0f32; m];
            avx2::with_avx2_only(|| fast(&w, &x, &sc, &mut avx2_path));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&default_path),
                bits(&avx2_path),
                "{}",
                std::any::type_name::<T>()
            );
        }
        for seed in [5, 6] {
            both::<BlockQ4KInterleaved>(2048, seed);
            both::<BlockQ6KInterleaved>(2048, seed);
            both::<BlockQ8_0>(1024, seed);
            both::<BlockQ5_0Interleaved>(1024, seed);
            both::<BlockQ5_0Interleaved>(704, seed);
            both::<BlockQ4_1>(1024, seed);
            both::<BlockQ4_1Interleaved>(1024, seed);
            both::<BlockQ4_1Interleaved>(576, seed);
            both::<BlockQ8_0Interleaved>(1024, seed);
            both::<BlockQ8_0Interleaved>(576, seed);
        }
    }

    /// Says loudly when this CPU cannot run the AVX-512 paths, so a pass does not hide that the VNNI side of a
    /// comparison was AVX2 again; `SPECULA_REQUIRE_VNNI=1` turns that into a failure (for a machine that must
    /// test both).
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    fn warn_if_vnni_untested(test: &str) {
        let missing: Vec<&str> = [
            ("AVX-512 VNNI", avx2::has_vnni()),
            ("AVX-512 BW", avx2::has_avx512bw()),
        ]
        .into_iter()
        .filter(|(_, present)| !present)
        .map(|(name, _)| name)
        .collect();
        if !missing.is_empty() {
            eprintln!(
                "WARNING {test}: this CPU lacks {} (or it is turned off): those kernels were NOT tested, only \
                 AVX2 against itself",
                missing.join(" and ")
            );
            assert!(
                std::env::var_os("SPECULA_REQUIRE_VNNI").is_none(),
                "SPECULA_REQUIRE_VNNI is set but {} cannot be tested here",
                missing.join(" and ")
            );
        }
    }

    /// The vectorized Q8_K quantizer is bitwise candle's: random rows with outliers, a zero block, exact
    /// halves (max 127 makes the scale -1, so x.5 values test rounding away from zero), ties for the maximum.
    #[test]
    fn q8k_quantizer_matches_candle_bitwise() {
        let mut x = pseudo_random(8 * 256, 4);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 61 == 0 {
                *v *= 40.0;
            }
        }
        x[256..512].fill(0.0);
        for (i, v) in x[512..768].iter_mut().enumerate() {
            *v = (i as f32 - 128.0) / 2.0 + 0.0;
        }
        x[512] = 127.0;
        x[1024] = -9.0;
        x[1030] = 9.0;
        x[1100] = -9.0;
        let n = x.len() / 256;
        let mut fast: Vec<BlockQ8K> = (0..n).map(|_| BlockQ8K::zeros()).collect();
        let mut slow = fast.clone();
        quantize_q8k(&x, &mut fast);
        BlockQ8K::from_float(&x, &mut slow);
        let bytes = |v: &[BlockQ8K]| {
            // SAFETY: plain-old-data blocks.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
                .to_vec()
        };
        assert_eq!(bytes(&fast), bytes(&slow));
    }

    #[test]
    fn fast_kernels_exist_on_avx2_builds() {
        let built = cfg!(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ));
        assert!(
            built || !fast_kernels_expected(),
            "an x86-64 build without AVX2/FMA: .cargo/config.toml's target features were not applied"
        );
        assert_eq!(BlockQ4KInterleaved::fast_kernel().is_some(), built);
        assert_eq!(BlockQ6KInterleaved::fast_kernel().is_some(), built);
        assert_eq!(BlockQ8_0::fast_kernel().is_some(), built);
        assert_eq!(BlockQ5_0Interleaved::fast_kernel().is_some(), built);
        assert_eq!(BlockQ4_1::fast_kernel().is_some(), built);
        assert_eq!(BlockQ4_1Interleaved::fast_kernel().is_some(), built);
        assert_eq!(BlockQ8_0Interleaved::fast_kernel().is_some(), built);
    }
}
