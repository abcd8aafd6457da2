//! How the GPU GEMV (kernels.cu `gemv_mma`) wants its weights laid out, and how it splits its work: plain Rust,
//! compiled and tested without a GPU.
//!
//! The GEMV runs on the tensor cores (`mma.sync.m16n8k16`, bf16 in, f32 accumulate): a block of WARPS warps owns
//! 16 output rows (a "row block") and up to 8 activation rows (tokens); its warps take turns over the inputs 32 at
//! a time (a "chunk", two k16 steps) and their sums are added in warp order. Each lane needs, per chunk, the 8 bf16 weights of its A fragment for each of the two steps: 32 bytes.
//! So the matrix is stored as tiles of 16 rows x 32 columns, each tile 1 KiB in the order lanes read it: step 0's
//! fragments (lane 0's 16 bytes, lane 1's, ...), then step 1's. A warp reads a tile with two fully coalesced
//! 512-byte loads, and a row block's tiles follow each other in memory (one sequential stream per warp).
//!
//! Fragment layout (PTX ISA, `mma.m16n8k16` with .bf16): lane = 4 g + t holds, for A (16 x 16, row-major),
//! registers a0 = A[g][2t..2t+2], a1 = A[g+8][2t..2t+2], a2 = A[g][2t+8..2t+10], a3 = A[g+8][2t+8..2t+10] (lower
//! column in the lower half); for B (16 x 8), b0 = B[2t..2t+2][g], b1 = B[2t+8..2t+10][g]; for the f32 result,
//! d0 = D[g][2t], d1 = D[g][2t+1], d2 = D[g+8][2t], d3 = D[g+8][2t+1].

/// Output rows a warp owns (the mma's M).
pub const ROW_BLOCK: usize = 16;
/// Inputs a warp takes per iteration (two mma k-steps).
pub const CHUNK: usize = 32;
/// bf16 values in one tile.
pub const TILE: usize = ROW_BLOCK * CHUNK;
/// Activation rows (tokens) a warp computes at once (the mma's N).
pub const TOKENS: usize = 8;
/// Warps per GEMV block, all on one row block (kernels.cu MMA_WARPS).
pub const WARPS: usize = 4;
/// The most split-K partitions a GEMV uses (sizes the partial-sum scratch).
pub const MAX_SPLITS: usize = 8;

/// Row blocks and chunks of an `n x k` matrix (padded up to whole tiles with zeros).
pub fn tiles(n: usize, k: usize) -> (usize, usize) {
    (n.div_ceil(ROW_BLOCK), k.div_ceil(CHUNK))
}

/// Where element (row, col) of a matrix with `chunks` chunks per row block lives in the tiled layout.
pub fn tiled_index(row: usize, col: usize, chunks: usize) -> usize {
    let (block, i) = (row / ROW_BLOCK, row % ROW_BLOCK);
    let (chunk, c) = (col / CHUNK, col % CHUNK);
    let (step, kk) = (c / 16, c % 16);
    let register = i / 8 + 2 * (kk / 8);
    let lane = (i % 8) * 4 + (kk % 8) / 2;
    (block * chunks + chunk) * TILE + step * 256 + lane * 8 + register * 2 + kk % 2
}

/// A row-major `n x k` matrix in the tiled layout (zeros where the tiles overhang it).
pub fn tile_matrix(row_major: &[u16], n: usize, k: usize) -> Vec<u16> {
    assert_eq!(row_major.len(), n * k, "tile_matrix: {n} x {k} matrix");
    let (blocks, chunks) = tiles(n, k);
    let mut out = vec![0u16; blocks * chunks * TILE];
    for (row, values) in row_major.chunks_exact(k.max(1)).enumerate() {
        for (col, &v) in values.iter().enumerate() {
            out[tiled_index(row, col, chunks)] = v;
        }
    }
    out
}

/// Gate and up projections (`ff x k` each, row-major) stacked for the fused gate/up GEMV: row block b holds gate
/// rows 8b..8b+8 then up rows 8b..8b+8, so the lane holding D[g] (gate of feature 8b + g) also holds D[g + 8]
/// (its up) and ends with SiLU(gate) * up. `ff` must be a multiple of 8.
pub fn stack_gate_up<T: Copy>(gate: &[T], up: &[T], ff: usize, k: usize) -> Vec<T> {
    assert!(ff.is_multiple_of(8), "stack_gate_up: {ff} features");
    let mut out = Vec::with_capacity(2 * ff * k);
    for b in 0..ff / 8 {
        out.extend_from_slice(&gate[b * 8 * k..(b + 1) * 8 * k]);
        out.extend_from_slice(&up[b * 8 * k..(b + 1) * 8 * k]);
    }
    out
}

/// Bytes of one Q4_K tile (kernels.cu `Q4kWeights`): the 16 rows x 32 inputs of a bf16 tile as 4-bit values, the
/// 16 nibbles each lane turns into its two A fragments (8 bytes a lane, in the order of the bf16 tile's values),
/// then each row's (d * scale, dmin * min) of its 32-input sub-block as two f32 (128 bytes). 384 bytes against a
/// bf16 tile's 1024.
pub const Q4K_TILE_BYTES: usize = 384;
/// Bytes of a GGUF Q4_K block (256 weights): d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of nibbles;
/// of a Q4_1 block (32 weights): d, m (f16) and 16 bytes of nibbles.
const Q4K_BLOCK_BYTES: usize = 144;
const Q4_1_BLOCK_BYTES: usize = 20;

/// Sub-block `j`'s 6-bit scale and min from a Q4_K block's 12 scale bytes (GGML's packing).
fn q4k_scale_min(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// Row `row`, sub-block `j` (inputs 32j..32j+32 of its block `b`) of a Q4_K matrix `raw` (`n x k`, GGUF bytes,
/// row-major): the f32 factors the host's dequantization uses (d * scale, dmin * min) and the 32 4-bit values.
fn q4k_sub_block(raw: &[u8], k: usize, row: usize, chunk: usize) -> (f32, f32, [u8; 32]) {
    let (b, j) = (chunk / 8, chunk % 8);
    let block = &raw[(row * (k / 256) + b) * Q4K_BLOCK_BYTES..][..Q4K_BLOCK_BYTES];
    let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
    let dmin = half::f16::from_le_bytes([block[2], block[3]]).to_f32();
    let (sc, m) = q4k_scale_min(j, &block[4..16]);
    let qs = &block[16 + 32 * (j / 2)..][..32];
    let mut q = [0u8; 32];
    for (l, v) in q.iter_mut().enumerate() {
        *v = (qs[l] >> (4 * (j % 2))) & 0xF;
    }
    (d * f32::from(sc), dmin * f32::from(m), q)
}

/// Nibble tiles (the Q4_K tile format) of an `n x k` matrix whose (row, chunk) holds the 32 4-bit values and the
/// factors (d1, m1) `at` gives: a value is d1 * q - m1. Padding rows are all zeros (they dequantize to +0, as a
/// bf16 tile's padding is). Returned as u16 words (little-endian pairs) for the device upload.
fn tile_nibbles(n: usize, k: usize, at: impl Fn(usize, usize) -> ([u8; 32], f32, f32)) -> Vec<u16> {
    let (blocks, chunks) = tiles(n, k);
    let mut out = vec![0u8; blocks * chunks * Q4K_TILE_BYTES];
    for row in 0..n {
        let (block, i) = (row / ROW_BLOCK, row % ROW_BLOCK);
        for chunk in 0..chunks {
            let (q, d1, m1) = at(row, chunk);
            let tile = &mut out[(block * chunks + chunk) * Q4K_TILE_BYTES..][..Q4K_TILE_BYTES];
            for (c, &v) in q.iter().enumerate() {
                // The bf16 tile's position of (i, c), as lane and value index; a lane's 16 values are its
                // 16 nibbles, low nibble first.
                let at = tiled_index(i, c, 1);
                let (lane, value) = ((at % 256) / 8, (at / 256) * 8 + at % 8);
                tile[lane * 8 + value / 2] |= v << (4 * (value % 2));
            }
            tile[256 + i * 8..][..4].copy_from_slice(&d1.to_le_bytes());
            tile[256 + i * 8 + 4..][..4].copy_from_slice(&m1.to_le_bytes());
        }
    }
    out.chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// A GGUF Q4_K matrix (`n x k`, k a multiple of 256, row-major bytes) as nibble tiles: d1 = d * scale, m1 = dmin
/// * min of each 32-input sub-block (the host's dequantization computes them so).
pub fn tile_q4k(raw: &[u8], n: usize, k: usize) -> Result<Vec<u16>, String> {
    check_blocks("Q4_K", raw, n, k, 256, Q4K_BLOCK_BYTES)?;
    Ok(tile_nibbles(n, k, |row, chunk| {
        let (d1, m1, q) = q4k_sub_block(raw, k, row, chunk);
        (q, d1, m1)
    }))
}

/// A GGUF Q4_1 matrix as nibble tiles: each chunk one block, d1 = d and m1 = -m (the host computes q * d + m;
/// subtracting -m is the same IEEE operation as adding m).
pub fn tile_q4_1(raw: &[u8], n: usize, k: usize) -> Result<Vec<u16>, String> {
    check_blocks("Q4_1", raw, n, k, 32, Q4_1_BLOCK_BYTES)?;
    Ok(tile_nibbles(n, k, |row, chunk| {
        let block = &raw[(row * (k / 32) + chunk) * Q4_1_BLOCK_BYTES..][..Q4_1_BLOCK_BYTES];
        let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        let m = half::f16::from_le_bytes([block[2], block[3]]).to_f32();
        let q = std::array::from_fn(|c| {
            if c < 16 {
                block[4 + c] & 0xF
            } else {
                block[4 + c - 16] >> 4
            }
        });
        (q, d, -m)
    }))
}

/// The bf16 value of (row i, input c) of a Q4_K tile, computed as the native GEMV computes it (kernels.cu
/// `Q4kWeights::expand`): d1 * q - m1 in f32, each step rounded (no fused multiply-add), then bf16 round to
/// nearest even; the same as the host's dequantization followed by its bf16 conversion.
pub fn q4k_tile_value(tile: &[u16], i: usize, c: usize) -> u16 {
    let byte = |b: usize| (tile[b / 2] >> (8 * (b % 2))) as u8;
    let word = |b: usize| u32::from_le_bytes([byte(b), byte(b + 1), byte(b + 2), byte(b + 3)]);
    let at = tiled_index(i, c, 1);
    let (lane, value) = ((at % 256) / 8, (at / 256) * 8 + at % 8);
    let q = (byte(lane * 8 + value / 2) >> (4 * (value % 2))) & 0xF;
    let d1 = f32::from_bits(word(256 + i * 8));
    let m1 = f32::from_bits(word(256 + i * 8 + 4));
    half::bf16::from_f32(d1 * f32::from(q) - m1).to_bits()
}

/// Bytes of one scaled-int8 tile (kernels.cu `ScaledI8Weights`), the native format of GGUF Q6_K, Q8_0 and Q5_0:
/// each lane's 16 values as signed bytes in the bf16 tile's order (16 bytes a lane), then each row's two factors,
/// for inputs 0-15 and 16-31 of the chunk: 512 + 128 bytes, against a bf16 tile's 1024. A value is factor * byte.
pub const I8_TILE_BYTES: usize = 640;
/// Bytes of a GGUF Q6_K block (256 weights): 128 of low nibbles, 64 of high bit pairs, 16 signed scales, d (f16).
const Q6K_BLOCK_BYTES: usize = 210;
/// Bytes of GGUF Q8_0 and Q5_0 blocks (32 weights): d (f16) and 32 signed bytes; d, 4 bytes of fifth bits and 16
/// of nibbles.
const Q8_0_BLOCK_BYTES: usize = 34;
const Q5_0_BLOCK_BYTES: usize = 22;
/// Bytes of a GGUF Q4_0 block (32 weights): d (f16) and 16 bytes of nibbles.
const Q4_0_BLOCK_BYTES: usize = 18;

/// Weight `pos` (0..256) of a GGUF Q6_K block, q - 32.
fn q6k_value(block: &[u8], pos: usize) -> i8 {
    let (half, j, l) = (pos / 128, (pos % 128) / 32, pos % 32);
    let ql = block[64 * half + l + 32 * (j & 1)];
    let low = if j < 2 { ql & 0xF } else { ql >> 4 };
    let high = (block[128 + 32 * half + l] >> (2 * j)) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Scaled-int8 tiles of an `n x k` matrix whose (row, chunk) holds the 32 values and the two factors `at` gives.
fn tile_scaled_i8(
    n: usize,
    k: usize,
    at: impl Fn(usize, usize) -> ([i8; 32], [f32; 2]),
) -> Vec<u16> {
    let (blocks, chunks) = tiles(n, k);
    let mut out = vec![0u8; blocks * chunks * I8_TILE_BYTES];
    for row in 0..n {
        let (rb, i) = (row / ROW_BLOCK, row % ROW_BLOCK);
        for chunk in 0..chunks {
            let (values, factors) = at(row, chunk);
            let tile = &mut out[(rb * chunks + chunk) * I8_TILE_BYTES..][..I8_TILE_BYTES];
            for (c, &v) in values.iter().enumerate() {
                let at = tiled_index(i, c, 1);
                let (lane, value) = ((at % 256) / 8, (at / 256) * 8 + at % 8);
                tile[lane * 16 + value] = v as u8;
            }
            for (h, f) in factors.iter().enumerate() {
                tile[512 + i * 8 + 4 * h..][..4].copy_from_slice(&f.to_le_bytes());
            }
        }
    }
    out.chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

fn check_blocks(
    what: &str,
    raw: &[u8],
    n: usize,
    k: usize,
    block: usize,
    bytes: usize,
) -> Result<(), String> {
    if !k.is_multiple_of(block) || raw.len() != n * (k / block) * bytes {
        return Err(format!(
            "a {what} matrix of {n} x {k} needs k a multiple of {block} and {} bytes, not {}",
            n * (k / block) * bytes,
            raw.len()
        ));
    }
    Ok(())
}

/// A GGUF Q6_K matrix (`n x k`, row-major bytes) as scaled-int8 tiles: values q - 32, factors d * scale (the
/// host's order: the product first, then times the value); padding rows are zeros (+0).
pub fn tile_q6k(raw: &[u8], n: usize, k: usize) -> Result<Vec<u16>, String> {
    check_blocks("Q6_K", raw, n, k, 256, Q6K_BLOCK_BYTES)?;
    Ok(tile_scaled_i8(n, k, |row, chunk| {
        let (b, first) = (chunk / 8, (chunk % 8) * 32);
        let block = &raw[(row * (k / 256) + b) * Q6K_BLOCK_BYTES..][..Q6K_BLOCK_BYTES];
        let d = half::f16::from_le_bytes([block[208], block[209]]).to_f32();
        let values = std::array::from_fn(|c| q6k_value(block, first + c));
        let factors =
            std::array::from_fn(|h| d * f32::from(block[192 + (first + 16 * h) / 16] as i8));
        (values, factors)
    }))
}

/// A GGUF Q8_0 matrix as scaled-int8 tiles: each 32-input chunk is one block (values q, factor d).
pub fn tile_q8_0(raw: &[u8], n: usize, k: usize) -> Result<Vec<u16>, String> {
    check_blocks("Q8_0", raw, n, k, 32, Q8_0_BLOCK_BYTES)?;
    Ok(tile_scaled_i8(n, k, |row, chunk| {
        let block = &raw[(row * (k / 32) + chunk) * Q8_0_BLOCK_BYTES..][..Q8_0_BLOCK_BYTES];
        let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        (std::array::from_fn(|c| block[2 + c] as i8), [d, d])
    }))
}

/// A GGUF Q5_0 matrix as scaled-int8 tiles: each chunk one block (values q - 16 from a nibble and a fifth bit,
/// factor d).
pub fn tile_q5_0(raw: &[u8], n: usize, k: usize) -> Result<Vec<u16>, String> {
    check_blocks("Q5_0", raw, n, k, 32, Q5_0_BLOCK_BYTES)?;
    Ok(tile_scaled_i8(n, k, |row, chunk| {
        let block = &raw[(row * (k / 32) + chunk) * Q5_0_BLOCK_BYTES..][..Q5_0_BLOCK_BYTES];
        let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let values = std::array::from_fn(|c| {
            let (j, high) = (c % 16, c >= 16);
            let nibble = if high {
                block[6 + j] >> 4
            } else {
                block[6 + j] & 0xF
            };
            let fifth = ((qh >> (j + if high { 16 } else { 0 })) & 1) as u8;
            (nibble | (fifth << 4)) as i8 - 16
        });
        (values, [d, d])
    }))
}

/// A GGUF Q4_0 matrix as scaled-int8 tiles: each chunk one block (values q - 8, factor d).
pub fn tile_q4_0(raw: &[u8], n: usize, k: usize) -> Result<Vec<u16>, String> {
    check_blocks("Q4_0", raw, n, k, 32, Q4_0_BLOCK_BYTES)?;
    Ok(tile_scaled_i8(n, k, |row, chunk| {
        let block = &raw[(row * (k / 32) + chunk) * Q4_0_BLOCK_BYTES..][..Q4_0_BLOCK_BYTES];
        let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        let values = std::array::from_fn(|c| {
            let nibble = if c < 16 {
                block[2 + c] & 0xF
            } else {
                block[2 + c - 16] >> 4
            };
            nibble as i8 - 8
        });
        (values, [d, d])
    }))
}

/// The bf16 value of (row i, input c) of a scaled-int8 tile as the native GEMV computes it (kernels.cu
/// `ScaledI8Weights::expand`): factor * value in f32, then bf16 round to nearest even.
pub fn scaled_i8_tile_value(tile: &[u16], i: usize, c: usize) -> u16 {
    let byte = |b: usize| (tile[b / 2] >> (8 * (b % 2))) as u8;
    let at = tiled_index(i, c, 1);
    let (lane, value) = ((at % 256) / 8, (at / 256) * 8 + at % 8);
    let q = byte(lane * 16 + value) as i8;
    let o = 512 + i * 8 + 4 * (c / 16);
    let f = f32::from_bits(u32::from_le_bytes([
        byte(o),
        byte(o + 1),
        byte(o + 2),
        byte(o + 3),
    ]));
    half::bf16::from_f32(f * f32::from(q)).to_bits()
}

/// The tile formats the GEMV reads, numbered as the mixed GEMV (kernels.cu `gemv_mixed_tile`) numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileFormat {
    Bf16 = 0,
    /// Q4_K and Q4_1 (`tile_q4k`, `tile_q4_1`).
    Nibble = 1,
    /// Q6_K, Q8_0, Q5_0 and Q4_0 (`tile_q6k` ...).
    ScaledI8 = 2,
}

impl TileFormat {
    pub fn tile_bytes(self) -> usize {
        match self {
            TileFormat::Bf16 => 2 * TILE,
            TileFormat::Nibble => Q4K_TILE_BYTES,
            TileFormat::ScaledI8 => I8_TILE_BYTES,
        }
    }

    /// The bf16 value of (row i, input c) of one tile, as the GEMV computes it.
    pub fn tile_value(self, tile: &[u16], i: usize, c: usize) -> u16 {
        match self {
            TileFormat::Bf16 => tile[tiled_index(i, c, 1)],
            TileFormat::Nibble => q4k_tile_value(tile, i, c),
            TileFormat::ScaledI8 => scaled_i8_tile_value(tile, i, c),
        }
    }
}

/// Up to three parts of different tile formats stacked by rows (Q, K and V of mixed GGUF types): row blocks
/// `[0, first[0])` are part 0, `[first[0], first[1])` part 1, the rest part 2; part p's tiles start at
/// `offsets[p]` 16-byte units into the buffer (kernels.cu `gemv_mixed_tile` takes exactly these).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MixedParts {
    pub formats: [TileFormat; 3],
    pub first: [usize; 2],
    pub offsets: [usize; 3],
}

impl MixedParts {
    /// The formats packed two bits a part, as the kernel's `formats` argument.
    pub fn packed_formats(&self) -> i32 {
        self.formats
            .iter()
            .enumerate()
            .map(|(p, &f)| (f as i32) << (2 * p))
            .sum()
    }

    /// The part row block `block` belongs to, and that part's first row block.
    fn part_of(&self, block: usize) -> (usize, usize) {
        if block >= self.first[1] {
            (2, self.first[1])
        } else if block >= self.first[0] {
            (1, self.first[0])
        } else {
            (0, 0)
        }
    }

    /// The bf16 value of (row, col) of the stacked matrix (`chunks` chunks a row block) as the mixed GEMV reads
    /// it from `data` (u16 words).
    pub fn value(&self, data: &[u16], chunks: usize, row: usize, col: usize) -> u16 {
        let block = row / ROW_BLOCK;
        let (part, first) = self.part_of(block);
        let format = self.formats[part];
        let words = format.tile_bytes() / 2;
        let start = self.offsets[part] * 8 + ((block - first) * chunks + col / CHUNK) * words;
        format.tile_value(&data[start..start + words], row % ROW_BLOCK, col % CHUNK)
    }
}

/// Tiled parts (format, tiles as u16 words, rows) of a `k`-input matrix stacked into one buffer for the mixed
/// GEMV. At most three parts; every part but the last must be whole row blocks (its rows a multiple of 16), and
/// each part's tiles must be its whole tiled size.
pub fn stack_tiled_parts(
    parts: &[(TileFormat, &[u16], usize)],
    k: usize,
) -> Result<(Vec<u16>, MixedParts), String> {
    if parts.is_empty() || parts.len() > 3 {
        return Err(format!(
            "a mixed matrix takes 1 to 3 parts, got {}",
            parts.len()
        ));
    }
    let chunks = k.div_ceil(CHUNK);
    let mut data = Vec::new();
    let mut formats = [parts[parts.len() - 1].0; 3];
    let mut offsets = [0usize; 3];
    let mut first = [usize::MAX; 2];
    let mut block = 0usize;
    for (p, &(format, tiles, rows)) in parts.iter().enumerate() {
        if p + 1 < parts.len() && rows % ROW_BLOCK != 0 {
            return Err(format!(
                "part {p} of a mixed matrix has {rows} rows, not a multiple of {ROW_BLOCK}"
            ));
        }
        let want = rows.div_ceil(ROW_BLOCK) * chunks * format.tile_bytes() / 2;
        if tiles.len() != want {
            return Err(format!(
                "part {p} of a mixed matrix ({rows} x {k}, {format:?}) has {} tile words, expected {want}",
                tiles.len()
            ));
        }
        if p > 0 {
            first[p - 1] = block;
        }
        formats[p] = format;
        offsets[p] = data.len() / 8;
        data.extend_from_slice(tiles);
        block += rows.div_ceil(ROW_BLOCK);
    }
    // Parts not present start past the last row block, so no block takes them.
    for f in first.iter_mut() {
        *f = (*f).min(block);
    }
    Ok((
        data,
        MixedParts {
            formats,
            first,
            offsets,
        },
    ))
}

/// u32 words of a split activation buffer for `rows` tokens of `k` inputs (kernels.cu `store_split_pair`):
/// each input is a bf16 hi + lo pair (4 bytes), tokens padded to whole 8-token tiles and inputs to whole chunks.
pub fn split_len(rows: usize, k: usize) -> usize {
    rows.div_ceil(TOKENS) * TOKENS * k.div_ceil(CHUNK) * CHUNK
}

/// Where the hi half of token `token`'s input `col` lives in a split activation buffer of `chunks` chunks a
/// token (the lo half is 2 words further): the u32 word of the bf16 pair (col & !1, col | 1), in the order the
/// GEMV's lanes read their B fragments, two 16-byte pieces per lane and chunk (PTX: b0 = B[2t..2t+2][g], b1 =
/// B[2t+8..2t+10][g]; the token is the mma's column g): piece h of chunk c holds (hi of q = 2h, hi of q = 2h + 1,
/// lo of q = 2h, lo of q = 2h + 1) where col % 32 = 2t + 8q.
pub fn split_index(token: usize, col: usize, chunks: usize) -> usize {
    let (chunk, c) = (col / CHUNK, col % CHUNK);
    let (t, q) = ((c % 8) / 2, c / 8);
    let lane = (token % TOKENS) * 4 + t;
    ((((token / TOKENS) * chunks + chunk) * 2 + q / 2) * 32 + lane) * 4 + q % 2
}

/// Split-K partitions for a GEMV of `n` outputs over `k` inputs on a GPU of `sm_count` multiprocessors: enough
/// warps (WARPS a row block) to keep about 16 a multiprocessor streaming weights, at most MAX_SPLITS, and no more
/// than it takes for each warp to get about 4 chunks a split (rounded up: a matrix of 28 chunks a row, the
/// qwen2.5-0.5b shape's QKV and output projections, splits in two; rounded down it did not split, and its 56-72
/// row blocks left most of an H200 idle: the 0.5B's decode step 1330 -> 1410-1435 tok/s, docs/benchmarks.md,
/// session 30). A function of the matrix's shape only, never of the number of tokens, so a row's result never
/// depends on what else is in the batch.
pub fn splits_for(n: usize, k: usize, sm_count: usize) -> usize {
    let (blocks, chunks) = tiles(n, k);
    let want = (16 * sm_count).div_ceil(blocks.max(1) * WARPS);
    want.clamp(1, MAX_SPLITS)
        .min(chunks.div_ceil(4 * WARPS).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::weights::{GgmlType, Weight};

    fn bf16_to_f32(v: u16) -> f32 {
        f32::from_bits(u32::from(v) << 16)
    }

    fn random_bf16(len: usize, seed: u64) -> Vec<u16> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                (u.to_bits() >> 16) as u16
            })
            .collect()
    }

    type Tiler = fn(&[u8], usize, usize) -> Result<Vec<u16>, String>;
    type TileValue = fn(&[u16], usize, usize) -> u16;

    /// Every value of `ty`'s native tiles (a 20 x 512 matrix: the second row block half padding), read as the
    /// GEMV reads it, equals the bf16 of the host's dequantization (what the bf16 path uploads); padding is +0.
    fn assert_tiles_match_host(ty: GgmlType, tile_fn: Tiler, tile_bytes: usize, value: TileValue) {
        let (n, k) = (20, 512);
        let values: Vec<f32> = (0..n * k)
            .map(|i| {
                let h = (i as u64 + 3).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                ((h as f32 / (1u64 << 24) as f32) - 0.45) * (1.0 + (i / k) as f32 * 0.3)
            })
            .collect();
        let raw = Weight::quantize(&values, n, k, ty).unwrap().raw_bytes();
        let host: Vec<u16> = Weight::from_raw(ty, &raw, n, k)
            .unwrap()
            .to_f32()
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_bits())
            .collect();
        let tiled = tile_fn(&raw, n, k).unwrap();
        let (blocks, chunks) = tiles(n, k);
        let words = tile_bytes / 2;
        assert_eq!(tiled.len(), blocks * chunks * words);
        let mut nonzero = 0;
        for row in 0..blocks * ROW_BLOCK {
            for col in 0..k {
                let tile = &tiled[((row / ROW_BLOCK) * chunks + col / CHUNK) * words..][..words];
                let got = value(tile, row % ROW_BLOCK, col % CHUNK);
                let want = if row < n { host[row * k + col] } else { 0 };
                assert_eq!(got, want, "{ty:?} ({row}, {col})");
                nonzero += usize::from(got != 0);
            }
        }
        assert!(
            nonzero > n * k / 2,
            "{ty:?}: the matrix is not mostly zeros"
        );
        let e = tile_fn(&raw[1..], n, k).unwrap_err();
        assert!(e.contains("20 x 512"), "{e}");
    }

    /// Nibble tiles (Q4_K, Q4_1): the same values as the bf16 path, so a GEMV over them computes its bits.
    #[test]
    fn nibble_tiles_dequantize_to_the_bf16_path_bit_for_bit() {
        assert_tiles_match_host(GgmlType::Q4K, tile_q4k, Q4K_TILE_BYTES, q4k_tile_value);
        assert_tiles_match_host(GgmlType::Q4_1, tile_q4_1, Q4K_TILE_BYTES, q4k_tile_value);
    }

    /// Scaled-int8 tiles (Q6_K, Q8_0, Q5_0, Q4_0), likewise.
    #[test]
    fn scaled_i8_tiles_dequantize_to_the_bf16_path_bit_for_bit() {
        for (ty, tile_fn) in [
            (GgmlType::Q6K, tile_q6k as Tiler),
            (GgmlType::Q8_0, tile_q8_0),
            (GgmlType::Q5_0, tile_q5_0),
            (GgmlType::Q4_0, tile_q4_0),
        ] {
            assert_tiles_match_host(ty, tile_fn, I8_TILE_BYTES, scaled_i8_tile_value);
        }
    }

    /// Gate and up stacked as GGUF Q4_K rows (what the native load does) tile to the same values as the bf16
    /// stacking of their dequantized rows.
    #[test]
    fn q4k_gate_up_stacks_by_rows_like_bf16() {
        let (ff, k) = (16, 256);
        let make = |seed: usize| {
            let v: Vec<f32> = (0..ff * k)
                .map(|i| (((i + seed) * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let raw = Weight::quantize(&v, ff, k, GgmlType::Q4K)
                .unwrap()
                .raw_bytes();
            let bf16: Vec<u16> = Weight::from_raw(GgmlType::Q4K, &raw, ff, k)
                .unwrap()
                .to_f32()
                .into_iter()
                .map(|x| half::bf16::from_f32(x).to_bits())
                .collect();
            (raw, bf16)
        };
        let ((g_raw, g), (u_raw, u)) = (make(1), make(7));
        let stacked_raw = stack_gate_up(&g_raw, &u_raw, ff, g_raw.len() / ff);
        let stacked = stack_gate_up(&g, &u, ff, k);
        let tiled = tile_q4k(&stacked_raw, 2 * ff, k).unwrap();
        let (_, chunks) = tiles(2 * ff, k);
        let words = Q4K_TILE_BYTES / 2;
        for row in 0..2 * ff {
            for col in 0..k {
                let tile = &tiled[((row / ROW_BLOCK) * chunks + col / CHUNK) * words..][..words];
                assert_eq!(
                    q4k_tile_value(tile, row % ROW_BLOCK, col % CHUNK),
                    stacked[row * k + col],
                    "({row}, {col})"
                );
            }
        }
    }

    /// Q (Q4_K), K (Q4_K) and V (Q6_K) of different types stacked for the mixed GEMV: every value read through
    /// the stacked layout equals the host's bf16 of that part's dequantization; a ragged inner part is refused.
    #[test]
    fn mixed_parts_read_each_part_as_its_own_format() {
        let k = 256;
        let make = |rows: usize, ty: GgmlType, seed: u64| {
            let values: Vec<f32> = (0..rows * k)
                .map(|i| {
                    let h = (i as u64 + seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                    (h as f32 / (1u64 << 24) as f32) - 0.5
                })
                .collect();
            let raw = Weight::quantize(&values, rows, k, ty).unwrap().raw_bytes();
            let host: Vec<u16> = Weight::from_raw(ty, &raw, rows, k)
                .unwrap()
                .to_f32()
                .into_iter()
                .map(|v| half::bf16::from_f32(v).to_bits())
                .collect();
            (raw, host)
        };
        let (q_raw, q_host) = make(32, GgmlType::Q4K, 1);
        let (k_raw, k_host) = make(16, GgmlType::Q4K, 2);
        let (v_raw, v_host) = make(16, GgmlType::Q6K, 3);
        // Q and K share a format: two parts, Q4_K (48 rows) then Q6_K.
        let qk_raw = [q_raw.clone(), k_raw].concat();
        let qk = tile_q4k(&qk_raw, 48, k).unwrap();
        let v = tile_q6k(&v_raw, 16, k).unwrap();
        let (data, parts) = stack_tiled_parts(
            &[
                (TileFormat::Nibble, &qk, 48),
                (TileFormat::ScaledI8, &v, 16),
            ],
            k,
        )
        .unwrap();
        assert_eq!(parts.first, [3, 4]);
        assert_eq!(parts.packed_formats(), 1 | (2 << 2) | (2 << 4));
        let host = [q_host.clone(), k_host, v_host].concat();
        let chunks = k / CHUNK;
        for row in 0..64 {
            for col in 0..k {
                assert_eq!(
                    parts.value(&data, chunks, row, col),
                    host[row * k + col],
                    "({row}, {col})"
                );
            }
        }
        // A bf16 part beside a native one: three parts, the middle one bf16.
        let mid = random_bf16(16 * k, 9);
        let mid_tiled = tile_matrix(&mid, 16, k);
        let q_tiled = tile_q4k(&q_raw, 32, k).unwrap();
        let (data, parts) = stack_tiled_parts(
            &[
                (TileFormat::Nibble, &q_tiled, 32),
                (TileFormat::Bf16, &mid_tiled, 16),
                (TileFormat::ScaledI8, &v, 16),
            ],
            k,
        )
        .unwrap();
        assert_eq!(parts.first, [2, 3]);
        for col in 0..k {
            assert_eq!(parts.value(&data, chunks, 5, col), q_host[5 * k + col]);
            assert_eq!(parts.value(&data, chunks, 32 + 7, col), mid[7 * k + col]);
        }
        let ragged = tile_matrix(&random_bf16(8 * k, 4), 8, k);
        let e = stack_tiled_parts(
            &[
                (TileFormat::Bf16, &ragged, 8),
                (TileFormat::ScaledI8, &v, 16),
            ],
            k,
        )
        .unwrap_err();
        assert!(e.contains("8 rows"), "{e}");
        let e = stack_tiled_parts(&[(TileFormat::ScaledI8, &v[1..], 16)], k).unwrap_err();
        assert!(e.contains("tile words"), "{e}");
    }

    #[test]
    fn tiled_index_is_a_bijection_onto_each_tile() {
        let chunks = 3;
        let mut seen = vec![false; 2 * chunks * TILE];
        for row in 0..2 * ROW_BLOCK {
            for col in 0..chunks * CHUNK {
                let i = tiled_index(row, col, chunks);
                assert!(!seen[i], "({row}, {col}) lands on a used slot {i}");
                seen[i] = true;
                // Each tile holds exactly its own rows and columns.
                assert_eq!(i / TILE, (row / ROW_BLOCK) * chunks + col / CHUNK);
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    /// What one warp of gemv_mma computes, lane by lane, read through the fragment layout of the module docs:
    /// for each chunk the lane's two 16-byte loads are its A fragments, its B fragments are its token's inputs;
    /// the per-element products are summed in f64 here (the order inside an mma is the hardware's). A wrong
    /// tiled_index (a swapped register or lane) fails this against the plain product.
    fn emulate_warp(
        tiled: &[u16],
        chunks: usize,
        block: usize,
        x: &[Vec<f32>],
        k: usize,
    ) -> [[f64; 8]; 16] {
        let mut d = [[0f64; 8]; 16];
        for chunk in 0..chunks {
            let tile = &tiled[(block * chunks + chunk) * TILE..][..TILE];
            for step in 0..2 {
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    let frag = &tile[step * 256 + lane * 8..][..8];
                    // a_r holds (row, k-step column) pairs per the PTX layout.
                    let a_at = |r: usize, e: usize| -> (usize, usize) {
                        (g + 8 * (r % 2), 2 * t + e + 8 * (r / 2))
                    };
                    for r in 0..4 {
                        for e in 0..2 {
                            let (row, kk) = a_at(r, e);
                            let col = chunk * CHUNK + step * 16 + kk;
                            let w = f64::from(bf16_to_f32(frag[r * 2 + e]));
                            for (tok, xr) in x.iter().enumerate() {
                                let xv = if col < k { f64::from(xr[col]) } else { 0.0 };
                                d[row][tok] += w * xv;
                            }
                        }
                    }
                }
            }
        }
        d
    }

    #[test]
    fn tiled_fragments_reproduce_the_matrix_product() {
        // Overhanging shapes: 20 rows (two row blocks, the second partly padding), 40 inputs (two chunks).
        let (n, k) = (20, 40);
        let w = random_bf16(n * k, 7);
        let tiled = tile_matrix(&w, n, k);
        let (blocks, chunks) = tiles(n, k);
        let x: Vec<Vec<f32>> = (0..3)
            .map(|t| {
                (0..k)
                    .map(|i| ((t * 31 + i * 7) % 13) as f32 * 0.25 - 1.5)
                    .collect()
            })
            .collect();
        for block in 0..blocks {
            let d = emulate_warp(&tiled, chunks, block, &x, k);
            for (i, got) in d.iter().enumerate() {
                let row = block * ROW_BLOCK + i;
                for (tok, xr) in x.iter().enumerate() {
                    let want: f64 = if row < n {
                        (0..k)
                            .map(|c| f64::from(bf16_to_f32(w[row * k + c])) * f64::from(xr[c]))
                            .sum()
                    } else {
                        0.0
                    };
                    assert!(
                        (got[tok] - want).abs() < 1e-9,
                        "row {row} token {tok}: {} vs {want}",
                        got[tok]
                    );
                }
            }
        }
    }

    #[test]
    fn split_index_is_a_bijection_onto_the_buffer() {
        // 11 tokens (two tiles, the second partly padding), 40 inputs (two chunks, the second partly padding).
        let (m, k): (usize, usize) = (11, 40);
        let chunks = k.div_ceil(CHUNK);
        let len = split_len(m, k);
        let mut seen = vec![false; len];
        for token in 0..16 {
            for col in (0..chunks * CHUNK).step_by(2) {
                let hi = split_index(token, col, chunks);
                assert_eq!(
                    split_index(token, col + 1, chunks),
                    hi,
                    "a pair shares its word"
                );
                for w in [hi, hi + 2] {
                    assert!(w < len, "token {token} col {col}: word {w} of {len}");
                    assert!(!seen[w], "token {token} col {col}: word {w} used twice");
                    seen[w] = true;
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    /// Each lane's B fragments read out of a split buffer are its token's inputs, per the PTX layout: for chunk c
    /// and k-step s, b0 = B[2t..2t+2][g] and b1 = B[2t+8..2t+10][g] (B[kk][g] = input c * 32 + 16 s + kk of token
    /// g), hi in the piece's first two words and lo in the last two.
    #[test]
    fn split_fragments_hold_each_lanes_inputs() {
        let (m, k): (usize, usize) = (8, 64);
        let chunks = k.div_ceil(CHUNK);
        // A distinct 16-bit pattern per (token, input) stands for its hi half.
        let x = |token: usize, col: usize| (token * k + col) as u32;
        let mut buf = vec![0u32; split_len(m, k)];
        for token in 0..m {
            for col in (0..k).step_by(2) {
                // The lower input in the lower half (cvt.rn.bf16x2's order in pack_bf16x2).
                buf[split_index(token, col, chunks)] = x(token, col) | x(token, col + 1) << 16;
            }
        }
        for chunk in 0..chunks {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for step in 0..2 {
                    let piece = &buf[((chunk * 2 + step) * 32 + lane) * 4..][..4];
                    for (reg, kk0) in [(0, 2 * t), (1, 2 * t + 8)] {
                        let word = piece[reg];
                        for e in 0..2 {
                            let half = (word >> (16 * e)) & 0xffff;
                            let col = chunk * CHUNK + 16 * step + kk0 + e;
                            assert_eq!(half, x(g, col), "lane {lane} step {step} reg {reg}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gate_up_stacking_pairs_each_feature_in_one_lane() {
        let (ff, k) = (16, 32);
        let gate: Vec<u16> = (0..ff * k).map(|i| (i / k) as u16).collect();
        let up: Vec<u16> = (0..ff * k).map(|i| 1000 + (i / k) as u16).collect();
        let stacked = stack_gate_up(&gate, &up, ff, k);
        for f in 0..ff {
            let (block, g) = (f / 8, f % 8);
            // The lane holding D[g] of row block `block` holds D[g + 8] too (d0/d2).
            assert_eq!(
                stacked[(block * 16 + g) * k],
                f as u16,
                "gate of feature {f}"
            );
            assert_eq!(
                stacked[(block * 16 + g + 8) * k],
                1000 + f as u16,
                "up of feature {f}"
            );
        }
    }

    #[test]
    fn splits_depend_on_shape_only_and_stay_in_bounds() {
        // llama-3.1-8b on 132 multiprocessors: the small matrices split, the large ones do not.
        assert_eq!(splits_for(4096, 14336, 132), 3);
        assert_eq!(splits_for(6144, 4096, 132), 2);
        assert_eq!(splits_for(28672, 4096, 132), 1);
        assert_eq!(splits_for(128_256, 4096, 132), 1);
        // qwen2.5-1.5b: QKV and the output projection have few row blocks and 48 chunks.
        assert_eq!(splits_for(2048, 1536, 132), 3);
        // qwen2.5-0.5b: QKV and the output projection's 28 chunks split in two (about 4 chunks a warp, rounded up).
        assert_eq!(splits_for(1152, 896, 132), 2);
        assert_eq!(splits_for(896, 896, 132), 2);
        // Tiny inputs never split: 16 chunks or fewer are one round of 4 chunks a warp.
        assert_eq!(splits_for(16, 64, 132), 1);
        assert_eq!(splits_for(16, 512, 132), 1);
        for n in [16, 100, 1536, 4096, 151_936] {
            for k in [32, 96, 1536, 8960] {
                let s = splits_for(n, k, 132);
                assert!((1..=MAX_SPLITS).contains(&s));
                // Every split keeps at least 2 chunks a warp.
                assert!(s == 1 || k.div_ceil(CHUNK).div_ceil(s) >= 2 * WARPS);
            }
        }
    }
}
