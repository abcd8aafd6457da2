//! Q4_K and Q6_K blocks with their quantized weights reordered at load time for the multi-row kernels.
//!
//! GGML stores a K-quant block's weights so that one 32-byte unpack gives 32 consecutive weights, i.e. one or two
//! scale groups. A dot-product instruction (`vpdpbusd`) sums groups of four products into each 32-bit lane, so
//! with that order every lane mixes weights of the same group and each group needs its own accumulator and a
//! horizontal step before its scale can be applied: that per-row work was most of a verify pass.
//!
//! Here the 256 weights of a block are reordered so that unpacked register `t` (t = 0..8) holds, in 32-bit lane
//! `i`, weights `32i + 4t .. 32i + 4t + 4`. Eight dot-product instructions then leave in lane `i` the whole dot
//! product of the 32 weights `32i..32i + 32` (Q4_K's sub-block i; Q6_K's groups 2i and 2i+1 split over
//! registers 0-3 and 4-7), and the scales are applied to all lanes with one multiply. The activations of a
//! matmul call are reordered the same way once per call ([`interleave_activations`]).
//!
//! The blocks keep GGML's size, scales and field layout: only the order of the packed weights changes, so load
//! costs one pass over the bytes and memory traffic is unchanged. Dequantization and the reference dot product
//! restore GGML's order first.

use candle_core::quantized::k_quants::{
    BlockQ4K, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, GgmlType,
};
use candle_core::quantized::GgmlDType;
use std::borrow::Cow;

/// Whether this build reorders weights at all: only builds with the multi-row kernels (x86-64 with AVX2 and
/// FMA) read the interleaved order. Elsewhere the blocks keep GGML's layout and candle's kernels (NEON, ...)
/// read them in place, with no conversion per call.
pub const INTERLEAVED: bool = cfg!(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
));

/// Byte views of candle's block structs (their fields are private): `#[repr(C)]` with GGML's field order.
#[repr(C)]
struct Q4KBytes {
    d: [u8; 2],
    dmin: [u8; 2],
    scales: [u8; 12],
    qs: [u8; 128],
}

#[repr(C)]
struct Q6KBytes {
    ql: [u8; 128],
    qh: [u8; 64],
    scales: [u8; 16],
    d: [u8; 2],
}

#[repr(C)]
struct Q8KBytes {
    d: f32,
    qs: [i8; 256],
    bsums: [i16; 16],
}

const _: () = assert!(std::mem::size_of::<Q4KBytes>() == std::mem::size_of::<BlockQ4K>());
const _: () = assert!(std::mem::size_of::<Q6KBytes>() == std::mem::size_of::<BlockQ6K>());
const _: () = assert!(std::mem::size_of::<Q8KBytes>() == std::mem::size_of::<BlockQ8K>());
const _: () = assert!(std::mem::align_of::<Q8KBytes>() <= std::mem::align_of::<BlockQ8K>());

fn q4k_bytes_mut(b: &mut BlockQ4K) -> &mut Q4KBytes {
    // SAFETY: same size, Q4KBytes has alignment 1, and BlockQ4K is #[repr(C)] plain data in this field order.
    unsafe { &mut *(b as *mut BlockQ4K as *mut Q4KBytes) }
}

fn q6k_bytes_mut(b: &mut BlockQ6K) -> &mut Q6KBytes {
    // SAFETY: as above.
    unsafe { &mut *(b as *mut BlockQ6K as *mut Q6KBytes) }
}

// Decoding to 256 values in element order and encoding back, one function per layout. Plain loops over
// fixed-size arrays: the compiler vectorizes them, so repacking a 1.5B model at load stays well under a second.

fn q4k_decode_ggml(qs: &[u8; 128]) -> [u8; 256] {
    let mut v = [0u8; 256];
    for c in 0..4 {
        for u in 0..32 {
            v[64 * c + u] = qs[32 * c + u] & 0x0F;
            v[64 * c + 32 + u] = qs[32 * c + u] >> 4;
        }
    }
    v
}

fn q4k_encode_ggml(v: &[u8; 256]) -> [u8; 128] {
    let mut qs = [0u8; 128];
    for c in 0..4 {
        for u in 0..32 {
            qs[32 * c + u] = v[64 * c + u] | (v[64 * c + 32 + u] << 4);
        }
    }
    qs
}

/// Values in interleaved order: `out[32 t + 4 i + b] = v[32 i + 4 t + b]` (and the inverse, which is the same
/// transpose of an 8 x 8 grid of 4-byte groups).
fn transpose_groups(v: &[u8; 256]) -> [u8; 256] {
    let mut out = [0u8; 256];
    for i in 0..8 {
        for t in 0..8 {
            out[32 * t + 4 * i..32 * t + 4 * i + 4]
                .copy_from_slice(&v[32 * i + 4 * t..32 * i + 4 * t + 4]);
        }
    }
    out
}

// Interleaved Q4_K: register t = chunk t / 2 of `qs`, low nibbles for even t. In transposed order, register t is
// the 32 values at 32 t, so the layout is GGML's nibble packing applied to the transposed values.
// GGML packs values 64c..64c+32 in the low and 64c+32..64c+64 in the high nibbles of chunk c, i.e. register 2c
// low and 2c+1 high. The transpose is its own inverse, so this one function converts both ways.
fn q4k_reorder(qs: &[u8; 128]) -> [u8; 128] {
    q4k_encode_ggml(&transpose_groups(&q4k_decode_ggml(qs)))
}

fn q6k_decode_ggml(ql: &[u8; 128], qh: &[u8; 64]) -> [u8; 256] {
    let mut v = [0u8; 256];
    for n in 0..2 {
        for l in 0..32 {
            let (a, b, h) = (ql[64 * n + l], ql[64 * n + 32 + l], qh[32 * n + l]);
            v[128 * n + l] = (a & 0x0F) | ((h & 3) << 4);
            v[128 * n + 32 + l] = (b & 0x0F) | (((h >> 2) & 3) << 4);
            v[128 * n + 64 + l] = (a >> 4) | (((h >> 4) & 3) << 4);
            v[128 * n + 96 + l] = (b >> 4) | (((h >> 6) & 3) << 4);
        }
    }
    v
}

fn q6k_encode_ggml(v: &[u8; 256]) -> ([u8; 128], [u8; 64]) {
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for n in 0..2 {
        for l in 0..32 {
            let q = [
                v[128 * n + l],
                v[128 * n + 32 + l],
                v[128 * n + 64 + l],
                v[128 * n + 96 + l],
            ];
            ql[64 * n + l] = (q[0] & 0x0F) | ((q[2] & 0x0F) << 4);
            ql[64 * n + 32 + l] = (q[1] & 0x0F) | ((q[3] & 0x0F) << 4);
            qh[32 * n + l] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
    (ql, qh)
}

fn q6k_decode_interleaved(ql: &[u8; 128], qh: &[u8; 64]) -> [u8; 256] {
    // Register t: low 4 bits from chunk t / 2 of `ql` (low nibble for even t), high 2 bits from chunk t / 4 of
    // `qh` at bit 2 (t % 4).
    let mut v = [0u8; 256];
    for t in 0..8 {
        for p in 0..32 {
            let low = (ql[32 * (t / 2) + p] >> (4 * (t % 2))) & 0x0F;
            let high = (qh[32 * (t / 4) + p] >> (2 * (t % 4))) & 3;
            v[32 * t + p] = low | (high << 4);
        }
    }
    transpose_groups(&v)
}

fn q6k_encode_interleaved(v: &[u8; 256]) -> ([u8; 128], [u8; 64]) {
    let v = transpose_groups(v);
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for t in 0..8 {
        for p in 0..32 {
            let q = v[32 * t + p];
            ql[32 * (t / 2) + p] |= (q & 0x0F) << (4 * (t % 2));
            qh[32 * (t / 4) + p] |= (q >> 4) << (2 * (t % 4));
        }
    }
    (ql, qh)
}

fn reorder_q4k(b: &BlockQ4K) -> BlockQ4K {
    let mut out = b.clone();
    let dst = q4k_bytes_mut(&mut out);
    dst.qs = q4k_reorder(&dst.qs);
    out
}

fn q6k_to_interleaved(b: &BlockQ6K) -> BlockQ6K {
    let mut out = b.clone();
    let dst = q6k_bytes_mut(&mut out);
    (dst.ql, dst.qh) = q6k_encode_interleaved(&q6k_decode_ggml(&dst.ql, &dst.qh));
    out
}

fn q6k_to_ggml(b: &BlockQ6K) -> BlockQ6K {
    let mut out = b.clone();
    let dst = q6k_bytes_mut(&mut out);
    (dst.ql, dst.qh) = q6k_encode_ggml(&q6k_decode_interleaved(&dst.ql, &dst.qh));
    out
}

/// A Q4_K block whose 4-bit weights are in the interleaved order (module docs).
#[derive(Clone)]
#[repr(transparent)]
pub struct BlockQ4KInterleaved(BlockQ4K);

/// A Q6_K block whose 6-bit weights are in the interleaved order (module docs).
#[derive(Clone)]
#[repr(transparent)]
pub struct BlockQ6KInterleaved(BlockQ6K);

impl BlockQ4KInterleaved {
    pub fn from_ggml(b: &BlockQ4K) -> Self {
        Self(if INTERLEAVED {
            reorder_q4k(b)
        } else {
            b.clone()
        })
    }

    pub fn to_ggml(&self) -> BlockQ4K {
        if INTERLEAVED {
            reorder_q4k(&self.0)
        } else {
            self.0.clone()
        }
    }
}

impl BlockQ6KInterleaved {
    pub fn from_ggml(b: &BlockQ6K) -> Self {
        Self(if INTERLEAVED {
            q6k_to_interleaved(b)
        } else {
            b.clone()
        })
    }

    pub fn to_ggml(&self) -> BlockQ6K {
        if INTERLEAVED {
            q6k_to_ggml(&self.0)
        } else {
            self.0.clone()
        }
    }
}

/// GGML-order copies of a row of interleaved blocks (for the reference kernel and dequantization).
pub trait Interleaved: Sized {
    type Ggml: GgmlType<VecDotType = BlockQ8K>;
    fn to_ggml(&self) -> Self::Ggml;
    fn from_ggml(b: &Self::Ggml) -> Self;

    /// The row in GGML's layout: borrowed as is where this build does not interleave.
    fn ggml_row(row: &[Self]) -> Cow<'_, [Self::Ggml]> {
        if INTERLEAVED {
            Cow::Owned(row.iter().map(Self::to_ggml).collect())
        } else {
            // SAFETY: the interleaved types are #[repr(transparent)] over their GGML block, and without
            // interleaving their bytes are GGML's.
            Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(row.as_ptr() as *const Self::Ggml, row.len())
            })
        }
    }
}

impl Interleaved for BlockQ4KInterleaved {
    type Ggml = BlockQ4K;
    fn to_ggml(&self) -> BlockQ4K {
        BlockQ4KInterleaved::to_ggml(self)
    }
    fn from_ggml(b: &BlockQ4K) -> Self {
        BlockQ4KInterleaved::from_ggml(b)
    }
}

impl Interleaved for BlockQ6KInterleaved {
    type Ggml = BlockQ6K;
    fn to_ggml(&self) -> BlockQ6K {
        BlockQ6KInterleaved::to_ggml(self)
    }
    fn from_ggml(b: &BlockQ6K) -> Self {
        BlockQ6KInterleaved::from_ggml(b)
    }
}

macro_rules! interleaved_ggml_type {
    ($t:ty, $ggml:ty, $dtype:expr) => {
        impl GgmlType for $t {
            const DTYPE: GgmlDType = $dtype;
            const BLCK_SIZE: usize = 256;
            type VecDotType = BlockQ8K;

            fn to_float(xs: &[Self], ys: &mut [f32]) {
                <$ggml>::to_float(&Self::ggml_row(xs), ys);
            }

            fn from_float(xs: &[f32], ys: &mut [Self]) {
                let mut ggml: Vec<$ggml> = (0..ys.len()).map(|_| <$ggml>::zeros()).collect();
                <$ggml>::from_float(xs, &mut ggml);
                for (y, g) in ys.iter_mut().zip(&ggml) {
                    *y = Self::from_ggml(g);
                }
            }

            fn vec_dot(n: usize, xs: &[Self], ys: &[BlockQ8K]) -> f32 {
                <$ggml>::vec_dot(n, &Self::ggml_row(xs), ys)
            }

            fn vec_dot_unopt(n: usize, xs: &[Self], ys: &[BlockQ8K]) -> f32 {
                <$ggml>::vec_dot_unopt(n, &Self::ggml_row(xs), ys)
            }
        }
    };
}

interleaved_ggml_type!(BlockQ4KInterleaved, BlockQ4K, GgmlDType::Q4K);
interleaved_ggml_type!(BlockQ6KInterleaved, BlockQ6K, GgmlDType::Q6K);

/// Reorders each Q8_K activation block's 256 values into the interleaved order (the transpose of an 8 x 8 grid
/// of 4-byte groups: group `(i, t)` moves to `(t, i)`). The block sums are left as they are.
pub fn interleave_activations(x: &mut [BlockQ8K]) {
    for b in x {
        // SAFETY: same size and compatible alignment (checked above); BlockQ8K is #[repr(C)] in this order.
        let b = unsafe { &mut *(b as *mut BlockQ8K as *mut Q8KBytes) };
        let src = b.qs;
        for i in 0..8 {
            for t in 0..8 {
                b.qs[32 * t + 4 * i..32 * t + 4 * i + 4]
                    .copy_from_slice(&src[32 * i + 4 * t..32 * i + 4 * t + 4]);
            }
        }
    }
}

// Q5_0 rows are interleaved in groups of 8 blocks (the 32-weight analogue of the K-quant order): register t of a
// group holds, in lane j, weights 4t .. 4t + 4 of block j, so eight dot-product instructions per row leave one
// block's dot product per lane and the eight block scales apply with one multiply. A group keeps the 8 x 22
// bytes of its blocks, laid out as:
//   bytes   0..16   the eight block scales d_j (f16), in block order
//   bytes  16..48   eight u32 fifth-bit masks, one per register t: bit 4j + b = fifth bit of block j, weight 4t + b
//   bytes  48..176  four 32-byte chunks c: byte 4j + b holds register 2c's value in its low nibble and register
//                   2c + 1's in its high nibble
// Blocks past the last whole group of a row (a row of 28 blocks has 4) stay in GGML's layout.

/// Q5_0 blocks per interleaved group, and the group's bytes.
pub const Q5_0_GROUP: usize = 8;
const Q5_0_GROUP_BYTES: usize = 8 * 22;

#[repr(C)]
struct Q5_0Bytes {
    d: [u8; 2],
    qh: [u8; 4],
    qs: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<Q5_0Bytes>() == std::mem::size_of::<BlockQ5_0>());

/// The 5-bit codes (0..32, GGML's value + 16) of a GGML-order Q5_0 block.
fn q5_0_codes(b: &Q5_0Bytes) -> [u8; 32] {
    let qh = u32::from_le_bytes(b.qh);
    std::array::from_fn(|e| {
        let nibble = if e < 16 {
            b.qs[e] & 0x0F
        } else {
            b.qs[e - 16] >> 4
        };
        nibble | ((((qh >> e) & 1) as u8) << 4)
    })
}

fn q5_0_block_from_codes(d: [u8; 2], codes: &[u8; 32]) -> Q5_0Bytes {
    let mut qh = 0u32;
    let mut qs = [0u8; 16];
    for (e, &c) in codes.iter().enumerate() {
        qh |= ((c >> 4) as u32 & 1) << e;
        if e < 16 {
            qs[e] |= c & 0x0F;
        } else {
            qs[e - 16] |= (c & 0x0F) << 4;
        }
    }
    Q5_0Bytes {
        d,
        qh: qh.to_le_bytes(),
        qs,
    }
}

fn q5_0_bytes(blocks: &[BlockQ5_0]) -> &[Q5_0Bytes] {
    // SAFETY: same size, alignment 1, BlockQ5_0 is #[repr(C)] plain data in this field order.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const Q5_0Bytes, blocks.len()) }
}

fn q5_0_bytes_mut(blocks: &mut [BlockQ5_0]) -> &mut [u8] {
    // SAFETY: plain-old-data blocks viewed as bytes.
    unsafe {
        std::slice::from_raw_parts_mut(
            blocks.as_mut_ptr() as *mut u8,
            std::mem::size_of_val(blocks),
        )
    }
}

/// One group of 8 GGML blocks in the interleaved layout.
fn q5_0_interleave_group(blocks: &[BlockQ5_0], out: &mut [u8]) {
    let src = q5_0_bytes(blocks);
    let codes: Vec<[u8; 32]> = src.iter().map(q5_0_codes).collect();
    out.fill(0);
    for (j, b) in src.iter().enumerate() {
        out[2 * j..2 * j + 2].copy_from_slice(&b.d);
    }
    for t in 0..8 {
        let mut mask = 0u32;
        for (j, c) in codes.iter().enumerate() {
            for b in 0..4 {
                let code = c[4 * t + b];
                mask |= ((code >> 4) as u32 & 1) << (4 * j + b);
                out[48 + 32 * (t / 2) + 4 * j + b] |= (code & 0x0F) << (4 * (t % 2));
            }
        }
        out[16 + 4 * t..20 + 4 * t].copy_from_slice(&mask.to_le_bytes());
    }
}

/// The inverse of `q5_0_interleave_group`.
fn q5_0_group_to_ggml(group: &[u8]) -> Vec<Q5_0Bytes> {
    (0..8)
        .map(|j| {
            let codes: [u8; 32] = std::array::from_fn(|e| {
                let (t, b) = (e / 4, e % 4);
                let mask = u32::from_le_bytes(group[16 + 4 * t..20 + 4 * t].try_into().unwrap());
                let nibble = (group[48 + 32 * (t / 2) + 4 * j + b] >> (4 * (t % 2))) & 0x0F;
                nibble | ((((mask >> (4 * j + b)) & 1) as u8) << 4)
            });
            q5_0_block_from_codes([group[2 * j], group[2 * j + 1]], &codes)
        })
        .collect()
}

/// Q5_0 blocks of one weight row, whole groups of 8 interleaved (see above). Slices given to its `GgmlType`
/// methods must be whole rows.
#[derive(Clone)]
#[repr(transparent)]
pub struct BlockQ5_0Interleaved(BlockQ5_0);

impl BlockQ5_0Interleaved {
    /// One row of GGML blocks in this build's layout (interleaved where `INTERLEAVED`).
    pub fn row_from_ggml(row: &[BlockQ5_0]) -> Vec<Self> {
        if INTERLEAVED {
            q5_0_interleave_row(row).into_iter().map(Self).collect()
        } else {
            row.iter().cloned().map(Self).collect()
        }
    }

    /// One row back in GGML's layout: borrowed as is where this build does not interleave.
    pub fn row_to_ggml(row: &[Self]) -> Cow<'_, [BlockQ5_0]> {
        if INTERLEAVED {
            Cow::Owned(q5_0_row_from_interleaved(row))
        } else {
            // SAFETY: #[repr(transparent)] over BlockQ5_0, and without interleaving the bytes are GGML's.
            Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(row.as_ptr() as *const BlockQ5_0, row.len())
            })
        }
    }
}

/// One row of GGML Q5_0 blocks with every whole group of 8 interleaved.
fn q5_0_interleave_row(row: &[BlockQ5_0]) -> Vec<BlockQ5_0> {
    {
        let mut out: Vec<BlockQ5_0> = row.to_vec();
        let whole = row.len() / Q5_0_GROUP * Q5_0_GROUP;
        for g in (0..whole).step_by(Q5_0_GROUP) {
            let bytes = &mut q5_0_bytes_mut(&mut out[g..g + Q5_0_GROUP])[..Q5_0_GROUP_BYTES];
            q5_0_interleave_group(&row[g..g + Q5_0_GROUP], bytes);
        }
        out
    }
}

/// The inverse of `q5_0_interleave_row`.
fn q5_0_row_from_interleaved(row: &[BlockQ5_0Interleaved]) -> Vec<BlockQ5_0> {
    {
        let mut out: Vec<BlockQ5_0> = row.iter().map(|b| b.0.clone()).collect();
        let whole = row.len() / Q5_0_GROUP * Q5_0_GROUP;
        for g in (0..whole).step_by(Q5_0_GROUP) {
            let group = q5_0_bytes_mut(&mut out[g..g + Q5_0_GROUP]).to_vec();
            let blocks = q5_0_group_to_ggml(&group);
            let dst = q5_0_bytes_mut(&mut out[g..g + Q5_0_GROUP]);
            for (j, b) in blocks.iter().enumerate() {
                dst[22 * j..22 * j + 2].copy_from_slice(&b.d);
                dst[22 * j + 2..22 * j + 6].copy_from_slice(&b.qh);
                dst[22 * j + 6..22 * j + 22].copy_from_slice(&b.qs);
            }
        }
        out
    }
}

/// `GgmlType` for a row type interleaved in groups of 8 blocks: every method converts the whole row to or from
/// GGML's order (`row_to_ggml`, `row_from_ggml`) and runs candle's own code on it.
macro_rules! interleaved_row_ggml_type {
    ($($t:ty: $dtype:ident, $ggml:ty, $vec_dot:ty);* $(;)?) => {$(
        impl GgmlType for $t {
            const DTYPE: GgmlDType = GgmlDType::$dtype;
            const BLCK_SIZE: usize = 32;
            type VecDotType = $vec_dot;

            fn to_float(xs: &[Self], ys: &mut [f32]) {
                <$ggml>::to_float(&Self::row_to_ggml(xs), ys);
            }

            fn from_float(xs: &[f32], ys: &mut [Self]) {
                let mut ggml: Vec<$ggml> = (0..ys.len()).map(|_| <$ggml>::zeros()).collect();
                <$ggml>::from_float(xs, &mut ggml);
                for (y, b) in ys.iter_mut().zip(Self::row_from_ggml(&ggml)) {
                    *y = b;
                }
            }

            fn vec_dot(n: usize, xs: &[Self], ys: &[$vec_dot]) -> f32 {
                <$ggml>::vec_dot(n, &Self::row_to_ggml(xs), ys)
            }

            fn vec_dot_unopt(n: usize, xs: &[Self], ys: &[$vec_dot]) -> f32 {
                <$ggml>::vec_dot_unopt(n, &Self::row_to_ggml(xs), ys)
            }
        }
    )*};
}

interleaved_row_ggml_type!(
    BlockQ5_0Interleaved: Q5_0, BlockQ5_0, BlockQ8_0;
    BlockQ4_1Interleaved: Q4_1, BlockQ4_1, BlockQ8_1;
    BlockQ8_0Interleaved: Q8_0, BlockQ8_0, BlockQ8_0;
);

/// Q8_0 activations for the interleaved Q5_0 kernel, one row of `blocks` in place: within each whole group of 8
/// blocks, block t's 32 values become register t (lane j = block j's values 4t .. 4t + 4); the tail stays.
pub fn interleave_q8_0_row(blocks: &mut [BlockQ8_0]) {
    #[repr(C)]
    struct Q8_0Bytes {
        d: [u8; 2],
        qs: [u8; 32],
    }
    // SAFETY: same size (34 bytes), alignment 1, BlockQ8_0 is #[repr(C)] plain data in this field order.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(blocks.as_mut_ptr() as *mut Q8_0Bytes, blocks.len())
    };
    let whole = bytes.len() / Q5_0_GROUP * Q5_0_GROUP;
    for group in bytes[..whole].chunks_exact_mut(Q5_0_GROUP) {
        let src: Vec<[u8; 32]> = group.iter().map(|b| b.qs).collect();
        for (t, dst) in group.iter_mut().enumerate() {
            for (j, s) in src.iter().enumerate() {
                dst.qs[4 * j..4 * j + 4].copy_from_slice(&s[4 * t..4 * t + 4]);
            }
        }
    }
}

// Q4_1 rows are interleaved like Q5_0's, in groups of 8 blocks: register t of a group holds, in lane j, the
// 4-bit codes 4t .. 4t + 4 of block j, so eight dot products per row leave block j's integer sum in lane j. A
// group keeps the 8 x 20 bytes of its blocks, laid out as:
//   bytes   0..16   the eight block scales d_j (f16), in block order
//   bytes  16..32   the eight block minimums m_j (f16), in block order
//   bytes  32..160  four 32-byte chunks c: byte 4j + b holds register 2c's value in its low nibble and register
//                   2c + 1's in its high nibble
// Blocks past the last whole group of a row stay in GGML's layout.

/// Q4_1 blocks per interleaved group, and the group's bytes.
pub const Q4_1_GROUP: usize = 8;
const Q4_1_GROUP_BYTES: usize = 8 * 20;

#[repr(C)]
struct Q4_1Bytes {
    d: [u8; 2],
    m: [u8; 2],
    qs: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<Q4_1Bytes>() == std::mem::size_of::<BlockQ4_1>());

fn q4_1_bytes_mut(blocks: &mut [BlockQ4_1]) -> &mut [u8] {
    // SAFETY: BlockQ4_1 is #[repr(C)] plain data (f16, f16, [u8; 16]), 20 bytes, alignment 2.
    unsafe {
        std::slice::from_raw_parts_mut(
            blocks.as_mut_ptr() as *mut u8,
            std::mem::size_of_val(blocks),
        )
    }
}

/// One group of 8 GGML blocks (as bytes) in the interleaved layout. GGML's block holds code i in the low nibble
/// of byte i and code i + 16 in the high nibble.
fn q4_1_interleave_group(src: &[u8], out: &mut [u8]) {
    let block = |j: usize| -> &[u8] { &src[20 * j..20 * j + 20] };
    let code = |j: usize, i: usize| -> u8 {
        let qs = &block(j)[4..];
        if i < 16 {
            qs[i] & 0x0F
        } else {
            qs[i - 16] >> 4
        }
    };
    out.fill(0);
    for j in 0..Q4_1_GROUP {
        out[2 * j..2 * j + 2].copy_from_slice(&block(j)[0..2]);
        out[16 + 2 * j..18 + 2 * j].copy_from_slice(&block(j)[2..4]);
        for t in 0..8 {
            for b in 0..4 {
                out[32 + 32 * (t / 2) + 4 * j + b] |= code(j, 4 * t + b) << (4 * (t % 2));
            }
        }
    }
}

/// The inverse of `q4_1_interleave_group`.
fn q4_1_group_to_ggml(group: &[u8], out: &mut [u8]) {
    out.fill(0);
    for j in 0..Q4_1_GROUP {
        let dst = &mut out[20 * j..20 * j + 20];
        dst[0..2].copy_from_slice(&group[2 * j..2 * j + 2]);
        dst[2..4].copy_from_slice(&group[16 + 2 * j..18 + 2 * j]);
        for t in 0..8 {
            for b in 0..4 {
                let code = (group[32 + 32 * (t / 2) + 4 * j + b] >> (4 * (t % 2))) & 0x0F;
                let i = 4 * t + b;
                if i < 16 {
                    dst[4 + i] |= code;
                } else {
                    dst[4 + i - 16] |= code << 4;
                }
            }
        }
    }
}

/// Q4_1 blocks of one weight row, whole groups of 8 interleaved (see above). Slices given to its `GgmlType`
/// methods must be whole rows.
#[derive(Clone)]
#[repr(transparent)]
pub struct BlockQ4_1Interleaved(BlockQ4_1);

impl BlockQ4_1Interleaved {
    /// One row of GGML blocks in this build's layout (interleaved where `INTERLEAVED`).
    pub fn row_from_ggml(row: &[BlockQ4_1]) -> Vec<Self> {
        let mut out = row.to_vec();
        if INTERLEAVED {
            let whole = row.len() / Q4_1_GROUP * Q4_1_GROUP;
            for g in (0..whole).step_by(Q4_1_GROUP) {
                let src = q4_1_bytes_mut(&mut out[g..g + Q4_1_GROUP]).to_vec();
                q4_1_interleave_group(&src, q4_1_bytes_mut(&mut out[g..g + Q4_1_GROUP]));
            }
        }
        out.into_iter().map(Self).collect()
    }

    /// One row back in GGML's layout: borrowed as is where this build does not interleave.
    pub fn row_to_ggml(row: &[Self]) -> Cow<'_, [BlockQ4_1]> {
        // SAFETY: #[repr(transparent)] over BlockQ4_1.
        let blocks =
            unsafe { std::slice::from_raw_parts(row.as_ptr() as *const BlockQ4_1, row.len()) };
        if !INTERLEAVED {
            return Cow::Borrowed(blocks);
        }
        let mut out = blocks.to_vec();
        let whole = row.len() / Q4_1_GROUP * Q4_1_GROUP;
        for g in (0..whole).step_by(Q4_1_GROUP) {
            let group = q4_1_bytes_mut(&mut out[g..g + Q4_1_GROUP]).to_vec();
            debug_assert_eq!(group.len(), Q4_1_GROUP_BYTES);
            q4_1_group_to_ggml(&group, q4_1_bytes_mut(&mut out[g..g + Q4_1_GROUP]));
        }
        Cow::Owned(out)
    }
}

// Q8_0 rows are interleaved the same way, in groups of 8 blocks: bytes 0..16 the eight block scales d_j (f16),
// then eight 32-byte registers t whose byte 4j + b is value 4t + b of block j. Blocks past the last whole group of a
// row stay in GGML's layout.

/// Q8_0 blocks of one weight row, whole groups of 8 interleaved (see above). Slices given to its `GgmlType`
/// methods must be whole rows.
#[derive(Clone)]
#[repr(transparent)]
pub struct BlockQ8_0Interleaved(BlockQ8_0);

fn q8_0_bytes_mut(blocks: &mut [BlockQ8_0]) -> &mut [u8] {
    // SAFETY: BlockQ8_0 is #[repr(C)] plain data (f16, [i8; 32]), 34 bytes, alignment 2.
    unsafe {
        std::slice::from_raw_parts_mut(
            blocks.as_mut_ptr() as *mut u8,
            std::mem::size_of_val(blocks),
        )
    }
}

/// One group of 8 GGML Q8_0 blocks (as bytes) in the interleaved layout, or back (`to_ggml`).
fn q8_0_reorder_group(src: &[u8], out: &mut [u8], to_ggml: bool) {
    for j in 0..8 {
        for t in 0..8 {
            for b in 0..4 {
                let (ggml, interleaved) = (34 * j + 2 + 4 * t + b, 16 + 32 * t + 4 * j + b);
                if to_ggml {
                    out[ggml] = src[interleaved];
                } else {
                    out[interleaved] = src[ggml];
                }
            }
        }
        let (ggml, interleaved) = (34 * j, 2 * j);
        if to_ggml {
            out[ggml..ggml + 2].copy_from_slice(&src[interleaved..interleaved + 2]);
        } else {
            out[interleaved..interleaved + 2].copy_from_slice(&src[ggml..ggml + 2]);
        }
    }
}

impl BlockQ8_0Interleaved {
    /// One row of GGML blocks in this build's layout (interleaved where `INTERLEAVED`).
    pub fn row_from_ggml(row: &[BlockQ8_0]) -> Vec<Self> {
        let mut out = row.to_vec();
        if INTERLEAVED {
            let whole = row.len() / 8 * 8;
            for g in (0..whole).step_by(8) {
                let src = q8_0_bytes_mut(&mut out[g..g + 8]).to_vec();
                q8_0_reorder_group(&src, q8_0_bytes_mut(&mut out[g..g + 8]), false);
            }
        }
        out.into_iter().map(Self).collect()
    }

    /// One row back in GGML's layout: borrowed as is where this build does not interleave.
    pub fn row_to_ggml(row: &[Self]) -> Cow<'_, [BlockQ8_0]> {
        // SAFETY: #[repr(transparent)] over BlockQ8_0.
        let blocks =
            unsafe { std::slice::from_raw_parts(row.as_ptr() as *const BlockQ8_0, row.len()) };
        if !INTERLEAVED {
            return Cow::Borrowed(blocks);
        }
        let mut out = blocks.to_vec();
        let whole = row.len() / 8 * 8;
        for g in (0..whole).step_by(8) {
            let src = q8_0_bytes_mut(&mut out[g..g + 8]).to_vec();
            q8_0_reorder_group(&src, q8_0_bytes_mut(&mut out[g..g + 8]), true);
        }
        Cow::Owned(out)
    }
}

/// Q8_1 activations for the interleaved Q4_1 kernel, one row of `blocks` in place: within each whole group of 8
/// blocks, block t's 32 values become register t (lane j = block j's values 4t .. 4t + 4); the tail stays.
pub fn interleave_q8_1_row(blocks: &mut [BlockQ8_1]) {
    #[repr(C)]
    struct Q8_1Bytes {
        d: [u8; 2],
        s: [u8; 2],
        qs: [u8; 32],
    }
    // SAFETY: same size (36 bytes), alignment 1, BlockQ8_1 is #[repr(C)] plain data in this field order.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(blocks.as_mut_ptr() as *mut Q8_1Bytes, blocks.len())
    };
    let whole = bytes.len() / Q4_1_GROUP * Q4_1_GROUP;
    for group in bytes[..whole].chunks_exact_mut(Q4_1_GROUP) {
        let src: Vec<[u8; 32]> = group.iter().map(|b| b.qs).collect();
        for (t, dst) in group.iter_mut().enumerate() {
            for (j, s) in src.iter().enumerate() {
                dst.qs[4 * j..4 * j + 4].copy_from_slice(&s[4 * t..4 * t + 4]);
            }
        }
    }
}

/// A Q8_K block's scale and its sixteen 16-element sums.
pub fn q8k_scale_and_sums(b: &BlockQ8K) -> (f32, [i16; 16]) {
    // SAFETY: as in `interleave_activations`.
    let b = unsafe { &*(b as *const BlockQ8K as *const Q8KBytes) };
    (b.d, b.bsums)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pseudo_random;

    // The layouts spelled out element by element (independently of the vectorizable code above).
    /// Where element `e` (0..256) sits in the reordered layout: 32-byte chunk `t` (the unpacked register) and
    /// byte `4i + b` within it.
    #[inline]
    fn interleaved_pos(e: usize) -> (usize, usize) {
        let (i, u) = (e / 32, e % 32);
        (u / 4, 4 * (i % 8) + u % 4)
    }

    // GGML layout, `Q4_K`: element e of sub-block s = e / 32 is byte `32 (s / 2) + e % 32` of `qs`, low nibble for
    // even s. Reordered: chunk t of element e is stored in byte `32 (t / 2) + pos` of `qs`, low nibble for even t.
    fn q4k_get(qs: &[u8; 128], byte: usize, high: bool) -> u8 {
        if high {
            qs[byte] >> 4
        } else {
            qs[byte] & 0x0F
        }
    }

    #[allow(dead_code)]
    fn q4k_set(qs: &mut [u8; 128], byte: usize, high: bool, v: u8) {
        if high {
            qs[byte] = (qs[byte] & 0x0F) | (v << 4);
        } else {
            qs[byte] = (qs[byte] & 0xF0) | v;
        }
    }

    fn q4k_ggml_slot(e: usize) -> (usize, bool) {
        let s = e / 32;
        (32 * (s / 2) + e % 32, s % 2 == 1)
    }

    fn q4k_interleaved_slot(e: usize) -> (usize, bool) {
        let (t, pos) = interleaved_pos(e);
        (32 * (t / 2) + pos, t % 2 == 1)
    }

    // GGML layout, `Q6_K`: element e = 128 n + 32 c + l has its low 4 bits in `ql[64 n + 32 (c % 2) + l]` (low nibble
    // for c < 2) and its high 2 bits in `qh[32 n + l]` at bit 2c. Reordered: low 4 bits in `ql[32 (t / 2) + pos]`
    // (low nibble for even t), high 2 bits in `qh[32 (t / 4) + pos]` at bit `2 (t % 4)`.
    fn q6k_ggml_slots(e: usize) -> (usize, bool, usize, u32) {
        let (n, c, l) = (e / 128, (e % 128) / 32, e % 32);
        (64 * n + 32 * (c % 2) + l, c >= 2, 32 * n + l, 2 * c as u32)
    }

    fn q6k_interleaved_slots(e: usize) -> (usize, bool, usize, u32) {
        let (t, pos) = interleaved_pos(e);
        (
            32 * (t / 2) + pos,
            t % 2 == 1,
            32 * (t / 4) + pos,
            2 * (t % 4) as u32,
        )
    }

    fn bytes<T>(v: &T) -> Vec<u8> {
        // SAFETY: plain-old-data blocks.
        unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
            .to_vec()
    }

    #[test]
    fn slots_are_permutations() {
        let mut seen4 = [[false; 2]; 128];
        let mut seen6 = std::collections::HashSet::new();
        for e in 0..256 {
            let (b, h) = q4k_interleaved_slot(e);
            assert!(!seen4[b][h as usize], "q4k slot used twice");
            seen4[b][h as usize] = true;
            let (lb, lh, hb, hs) = q6k_interleaved_slots(e);
            assert!(seen6.insert((0, lb, lh as u32)), "q6k low slot used twice");
            assert!(seen6.insert((1, hb, hs)), "q6k high slot used twice");
        }
    }

    #[test]
    fn interleaving_round_trips_and_dequantizes_identically() {
        let data = pseudo_random(4 * 256, 11);
        let mut q4: Vec<BlockQ4K> = (0..4).map(|_| BlockQ4K::zeros()).collect();
        BlockQ4K::from_float(&data, &mut q4);
        let mut q6: Vec<BlockQ6K> = (0..4).map(|_| BlockQ6K::zeros()).collect();
        BlockQ6K::from_float(&data, &mut q6);
        for (a, b) in q4.iter().zip(&q6) {
            // The reorderings themselves (whatever this build stores).
            let ra = reorder_q4k(a);
            assert_ne!(bytes(&ra), bytes(a), "the order must actually change");
            assert_eq!(bytes(&reorder_q4k(&ra)), bytes(a));
            let rb = q6k_to_interleaved(b);
            assert_ne!(bytes(&rb), bytes(b));
            assert_eq!(bytes(&q6k_to_ggml(&rb)), bytes(b));
            // The stored blocks: interleaved exactly when this build interleaves.
            let ia = BlockQ4KInterleaved::from_ggml(a);
            assert_eq!(bytes(&ia.to_ggml()), bytes(a));
            assert_eq!(bytes(&ia) == bytes(a), !INTERLEAVED);
            let ib = BlockQ6KInterleaved::from_ggml(b);
            assert_eq!(bytes(&ib.to_ggml()), bytes(b));
            assert_eq!(bytes(&ib) == bytes(b), !INTERLEAVED);
        }
        let (mut direct, mut via) = (vec![0f32; 1024], vec![0f32; 1024]);
        BlockQ4K::to_float(&q4, &mut direct);
        let i4: Vec<_> = q4.iter().map(BlockQ4KInterleaved::from_ggml).collect();
        BlockQ4KInterleaved::to_float(&i4, &mut via);
        assert_eq!(direct, via);
        BlockQ6K::to_float(&q6, &mut direct);
        let i6: Vec<_> = q6.iter().map(BlockQ6KInterleaved::from_ggml).collect();
        BlockQ6KInterleaved::to_float(&i6, &mut via);
        assert_eq!(direct, via);
    }

    #[test]
    fn q8_0_rows_round_trip_with_a_tail() {
        // 19 blocks: two interleaved groups and a GGML-order tail of 3.
        let data = pseudo_random(19 * 32, 6);
        let mut row: Vec<BlockQ8_0> = (0..19).map(|_| BlockQ8_0::zeros()).collect();
        BlockQ8_0::from_float(&data, &mut row);
        let all = |v: &[BlockQ8_0]| v.iter().flat_map(bytes).collect::<Vec<u8>>();
        let stored = BlockQ8_0Interleaved::row_from_ggml(&row);
        assert_eq!(all(&BlockQ8_0Interleaved::row_to_ggml(&stored)), all(&row));
        if !INTERLEAVED {
            return;
        }
        let (ggml, inter) = (
            all(&row),
            stored.iter().flat_map(bytes).collect::<Vec<u8>>(),
        );
        assert_eq!(
            inter[272 * 2..],
            ggml[272 * 2..],
            "the tail keeps GGML order"
        );
        for g in 0..2 {
            let (src, dst) = (
                &ggml[272 * g..272 * (g + 1)],
                &inter[272 * g..272 * (g + 1)],
            );
            for j in 0..8 {
                assert_eq!(
                    dst[2 * j..2 * j + 2],
                    src[34 * j..34 * j + 2],
                    "scale of block {j}"
                );
                for i in 0..32 {
                    assert_eq!(dst[16 + 32 * (i / 4) + 4 * j + i % 4], src[34 * j + 2 + i]);
                }
            }
        }
    }

    #[test]
    fn q4_1_rows_round_trip_with_a_tail() {
        // 22 blocks: two interleaved groups and a GGML-order tail of 6.
        let data = pseudo_random(22 * 32, 5);
        let mut row: Vec<BlockQ4_1> = (0..22).map(|_| BlockQ4_1::zeros()).collect();
        BlockQ4_1::from_float(&data, &mut row);
        let all = |v: &[BlockQ4_1]| v.iter().flat_map(bytes).collect::<Vec<u8>>();
        let stored = BlockQ4_1Interleaved::row_from_ggml(&row);
        assert_eq!(all(&BlockQ4_1Interleaved::row_to_ggml(&stored)), all(&row));
        if !INTERLEAVED {
            return;
        }
        let inter: Vec<u8> = stored.iter().flat_map(bytes).collect();
        assert_eq!(
            inter[160 * 2..],
            all(&row)[160 * 2..],
            "the tail keeps GGML order"
        );
        // Spelled out: block j of a group keeps d at bytes 2j, m at 16 + 2j; code i of block j (GGML: low
        // nibble of qs[i] for i < 16, high nibble of qs[i - 16] otherwise) sits in register t = i / 4, lane j.
        let ggml = all(&row);
        for g in 0..2 {
            let (src, dst) = (
                &ggml[160 * g..160 * (g + 1)],
                &inter[160 * g..160 * (g + 1)],
            );
            for j in 0..8 {
                let block = &src[20 * j..20 * j + 20];
                assert_eq!(dst[2 * j..2 * j + 2], block[0..2]);
                assert_eq!(dst[16 + 2 * j..18 + 2 * j], block[2..4]);
                for i in 0..32 {
                    let code = if i < 16 {
                        block[4 + i] & 0x0F
                    } else {
                        block[4 + i - 16] >> 4
                    };
                    let (t, b) = (i / 4, i % 4);
                    let nibble = (dst[32 + 32 * (t / 2) + 4 * j + b] >> (4 * (t % 2))) & 0x0F;
                    assert_eq!(nibble, code, "group {g} block {j} code {i}");
                }
            }
        }
    }

    #[test]
    fn q5_0_rows_round_trip_with_a_tail() {
        // 22 blocks: two interleaved groups and a GGML-order tail of 6.
        let data = pseudo_random(22 * 32, 3);
        let mut row: Vec<BlockQ5_0> = (0..22).map(|_| BlockQ5_0::zeros()).collect();
        BlockQ5_0::from_float(&data, &mut row);
        let all = |v: &[BlockQ5_0]| v.iter().flat_map(bytes).collect::<Vec<u8>>();
        let stored = BlockQ5_0Interleaved::row_from_ggml(&row);
        assert_eq!(all(&BlockQ5_0Interleaved::row_to_ggml(&stored)), all(&row));
        let inter: Vec<BlockQ5_0Interleaved> = q5_0_interleave_row(&row)
            .into_iter()
            .map(BlockQ5_0Interleaved)
            .collect();
        assert_eq!(all(&q5_0_row_from_interleaved(&inter)), all(&row));
        let inter_bytes: Vec<u8> = inter.iter().flat_map(bytes).collect();
        assert_ne!(
            inter_bytes[..176],
            all(&row)[..176],
            "whole groups change order"
        );
        assert_eq!(
            inter_bytes[16 * 22..],
            all(&row)[16 * 22..],
            "the tail keeps GGML order"
        );
        // Register t, lane j of the first group is block j's codes 4t .. 4t + 4.
        let codes: Vec<[u8; 32]> = q5_0_bytes(&row).iter().map(q5_0_codes).collect();
        for t in 0..8 {
            let mask = u32::from_le_bytes(inter_bytes[16 + 4 * t..20 + 4 * t].try_into().unwrap());
            for j in 0..8 {
                for b in 0..4 {
                    let nibble =
                        (inter_bytes[48 + 32 * (t / 2) + 4 * j + b] >> (4 * (t % 2))) & 0x0F;
                    let code = nibble | ((((mask >> (4 * j + b)) & 1) as u8) << 4);
                    assert_eq!(code, codes[j][4 * t + b], "t={t} j={j} b={b}");
                }
            }
        }
    }

    /// The layout the kernels rely on: chunk t, lane i of the interleaved weights and activations holds
    /// elements 32i + 4t .. 32i + 4t + 4.
    #[test]
    fn interleaved_chunks_hold_the_documented_elements() {
        let mut x: Vec<BlockQ8K> = vec![BlockQ8K::zeros()];
        // Values that identify their element (wrapping to i8 is fine: all distinct mod 256).
        let data: Vec<f32> = (0..256).map(|e| (e as f32) - 127.5).collect();
        BlockQ8K::from_float(&data, &mut x);
        let before = unsafe { &*(x.as_ptr() as *const Q8KBytes) }.qs;
        interleave_activations(&mut x);
        let after = unsafe { &*(x.as_ptr() as *const Q8KBytes) }.qs;
        for t in 0..8 {
            for i in 0..8 {
                for b in 0..4 {
                    assert_eq!(after[32 * t + 4 * i + b], before[32 * i + 4 * t + b]);
                }
            }
        }
        // Weights: unpack register t the way the kernels do and compare with GGML-order values.
        let w = pseudo_random(256, 5);
        let mut q4 = [BlockQ4K::zeros()];
        BlockQ4K::from_float(&w, &mut q4);
        let mut plain = q4[0].clone();
        let ggml_qs = q4k_bytes_mut(&mut plain).qs;
        let mut inter = reorder_q4k(&q4[0]);
        let qs = q4k_bytes_mut(&mut inter).qs;
        for t in 0..8 {
            for i in 0..8 {
                for b in 0..4 {
                    let byte = qs[32 * (t / 2) + 4 * i + b];
                    let v = if t % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    let (gb, gh) = q4k_ggml_slot(32 * i + 4 * t + b);
                    assert_eq!(v, q4k_get(&ggml_qs, gb, gh));
                }
            }
        }
        // Q6_K: every element's 6-bit value sits where the documented slots say, in both layouts.
        let mut q6 = [BlockQ6K::zeros()];
        BlockQ6K::from_float(&w, &mut q6);
        let mut plain = q6[0].clone();
        let g = q6k_bytes_mut(&mut plain);
        let mut inter = q6k_to_interleaved(&q6[0]);
        let n = q6k_bytes_mut(&mut inter);
        let value = |ql: &[u8; 128], qh: &[u8; 64], (lb, lh, hb, hs): (usize, bool, usize, u32)| {
            let low = if lh { ql[lb] >> 4 } else { ql[lb] & 0x0F };
            low | (((qh[hb] >> hs) & 3) << 4)
        };
        let mut distinct = std::collections::HashSet::new();
        for e in 0..256 {
            let expected = value(&g.ql, &g.qh, q6k_ggml_slots(e));
            distinct.insert(expected);
            assert_eq!(
                value(&n.ql, &n.qh, q6k_interleaved_slots(e)),
                expected,
                "element {e}"
            );
        }
        assert!(
            distinct.len() > 16,
            "test data should use many 6-bit values"
        );
    }
}
