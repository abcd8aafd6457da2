//! Row-wise CPU kernels of the forward pass. Each row is computed in a fixed order that does not depend on how
//! many rows are in the batch, which keeps verify passes bitwise equal to single-token steps.

/// Dot product with eight fixed lanes (vectorizes; the summation order is fixed, so results are reproducible).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Attention scores: `out[i * stride + j] = dot(query i, key(j)) * scale` for the queries stored back to back in
/// `queries` (each `len` long) and keys `0..n_keys`, every dot bitwise what [`dot`] gives (the same eight lanes,
/// the same order). Where the build has AVX2 and `len` is a multiple of 8, dots go eight at a time (two queries
/// by four keys, or one query by eight), their eight-lane sums folded together by one transposing reduction
/// instead of one horizontal sum each.
#[inline]
pub fn scores<'a>(
    queries: &[f32],
    len: usize,
    n_keys: usize,
    key: impl Fn(usize) -> &'a [f32],
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let nq = queries.len() / len.max(1);
    if nq == 0 || n_keys == 0 {
        return;
    }
    debug_assert!((nq - 1) * stride + n_keys <= out.len());
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if len.is_multiple_of(8) {
        // Keys outer (a tile of keys stays in L1 for every query), queries in pairs, a last odd one alone.
        let pairs = nq / 2;
        let mut j = 0;
        while j < n_keys {
            let left = n_keys - j;
            let keys_now = if pairs > 0 { left.min(4) } else { 0 };
            for p in 0..pairs {
                let (q, o) = (&queries[2 * p * len..], &mut out[2 * p * stride..]);
                match keys_now {
                    1 => tile::<2, 1>(q, len, &key, j, scale, o, stride),
                    2 => tile::<2, 2>(q, len, &key, j, scale, o, stride),
                    3 => tile::<2, 3>(q, len, &key, j, scale, o, stride),
                    _ => tile::<2, 4>(q, len, &key, j, scale, o, stride),
                }
            }
            let step = if nq % 2 == 1 {
                let (q, o) = (&queries[(nq - 1) * len..], &mut out[(nq - 1) * stride..]);
                // The odd query takes as many keys as the pairs did, or eight when it is alone.
                let take = if pairs > 0 { keys_now } else { left.min(8) };
                match take {
                    1 => tile::<1, 1>(q, len, &key, j, scale, o, stride),
                    2 => tile::<1, 2>(q, len, &key, j, scale, o, stride),
                    3 => tile::<1, 3>(q, len, &key, j, scale, o, stride),
                    4 => tile::<1, 4>(q, len, &key, j, scale, o, stride),
                    5 => tile::<1, 5>(q, len, &key, j, scale, o, stride),
                    6 => tile::<1, 6>(q, len, &key, j, scale, o, stride),
                    7 => tile::<1, 7>(q, len, &key, j, scale, o, stride),
                    _ => tile::<1, 8>(q, len, &key, j, scale, o, stride),
                }
                take
            } else {
                keys_now
            };
            j += step;
        }
        return;
    }
    for i in 0..nq {
        let q = &queries[i * len..(i + 1) * len];
        for j in 0..n_keys {
            out[i * stride + j] = dot(q, key(j)) * scale;
        }
    }
}

/// Dots of queries `0..Q` (back to back in `queries`, each `len` long, a multiple of 8) with keys `from..from + K`,
/// times `scale`, into `out[i * stride + from + k]`; each dot bitwise [`dot`]'s. Q * K <= 8.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
fn tile<'a, const Q: usize, const K: usize>(
    queries: &[f32],
    len: usize,
    key: &impl Fn(usize) -> &'a [f32],
    from: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!(Q * K <= 8 && queries.len() >= Q * len);
    let keys: [&[f32]; K] = std::array::from_fn(|k| {
        let row = key(from + k);
        assert_eq!(row.len(), len, "a key's length differs from the queries'");
        row
    });
    // SAFETY: AVX2 is on at build time; every load lies within `queries` (Q * len floats, checked above) or a key
    // (len floats, checked), len a multiple of 8.
    let sums: [f32; 8] = unsafe {
        let mut acc = [[_mm256_setzero_ps(); K]; Q];
        for c in 0..len / 8 {
            let qv: [__m256; Q] =
                std::array::from_fn(|i| _mm256_loadu_ps(queries.as_ptr().add(i * len + c * 8)));
            for k in 0..K {
                let kv = _mm256_loadu_ps(keys[k].as_ptr().add(c * 8));
                for i in 0..Q {
                    // A multiply then an add (no fused form), as `dot` rounds them.
                    acc[i][k] = _mm256_add_ps(acc[i][k], _mm256_mul_ps(qv[i], kv));
                }
            }
        }
        let mut all = [_mm256_setzero_ps(); 8];
        for i in 0..Q {
            for k in 0..K {
                all[i * K + k] = acc[i][k];
            }
        }
        std::mem::transmute::<__m256, [f32; 8]>(lane_sums(all))
    };
    for i in 0..Q {
        for k in 0..K {
            out[i * stride + from + k] = sums[i * K + k] * scale;
        }
    }
}

/// Lane v of the result is `((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + 0.0` of vector
/// v's lanes: [`dot`]'s closing sum of eight vectors at once (the halves added, then two rounds of pairwise adds;
/// float addition is commutative, so each lane's sum is bitwise `dot`'s).
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
unsafe fn lane_sums(a: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX operations; AVX2 is on at build time.
    unsafe {
        // [lo(x) + hi(x) | lo(y) + hi(y)]: lanes (0+4, 1+5, 2+6, 3+7) of x, then of y.
        let halves = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(x, y),
                _mm256_permute2f128_ps::<0x31>(x, y),
            )
        };
        let (h04, h15, h26, h37) = (
            halves(a[0], a[4]),
            halves(a[1], a[5]),
            halves(a[2], a[6]),
            halves(a[3], a[7]),
        );
        let pairs_0145 = _mm256_hadd_ps(h04, h15);
        let pairs_2367 = _mm256_hadd_ps(h26, h37);
        _mm256_add_ps(_mm256_hadd_ps(pairs_0145, pairs_2367), _mm256_setzero_ps())
    }
}

/// `out += weights[j] * rows(j)` for j in order: bitwise [`axpy`] called row after row, with `out` held in
/// registers across the rows (64 floats at a time) instead of loaded and stored for each.
#[inline]
pub fn axpy_rows<'a>(out: &mut [f32], weights: &[f32], rows: impl Fn(usize) -> &'a [f32]) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    {
        use std::arch::x86_64::*;
        let whole = out.len() / 8 * 8;
        let mut start = 0;
        while start < whole {
            let lanes = ((whole - start) / 8).min(8);
            // SAFETY: AVX2 is on at build time; lanes * 8 floats from `start` lie within `out` and each row
            // (debug-checked: rows are `out.len()` long).
            unsafe {
                let mut acc = [_mm256_setzero_ps(); 8];
                for (k, a) in acc.iter_mut().enumerate().take(lanes) {
                    *a = _mm256_loadu_ps(out.as_ptr().add(start + 8 * k));
                }
                for (j, &w) in weights.iter().enumerate() {
                    let row = rows(j);
                    debug_assert_eq!(row.len(), out.len());
                    let w = _mm256_set1_ps(w);
                    for (k, a) in acc.iter_mut().enumerate().take(lanes) {
                        let v = _mm256_loadu_ps(row.as_ptr().add(start + 8 * k));
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(w, v));
                    }
                }
                for (k, a) in acc.iter().enumerate().take(lanes) {
                    _mm256_storeu_ps(out.as_mut_ptr().add(start + 8 * k), *a);
                }
            }
            start += lanes * 8;
        }
        if whole < out.len() {
            for (j, &w) in weights.iter().enumerate() {
                axpy(&mut out[whole..], w, &rows(j)[whole..]);
            }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    for (j, &w) in weights.iter().enumerate() {
        axpy(out, w, rows(j));
    }
}

/// `out += w * x`.
#[inline]
pub fn axpy(out: &mut [f32], w: f32, x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += w * v;
    }
}

/// RMSNorm of each `dim`-long row of `x` into `out`, scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = dot(row, row) / dim as f32;
        let scale = 1.0 / (mean_sq + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// Rotary embedding of one head vector at position `pos`.
/// `halves`: pairs (i, i + d/2) as in HF checkpoints; otherwise adjacent pairs (2i, 2i + 1).
#[inline]
pub fn rope(head: &mut [f32], pos: usize, inv_freqs: &[f32], halves: bool) {
    let mut angles = Vec::with_capacity(head.len() / 2);
    rope_angles(
        pos,
        &inv_freqs[..(head.len() / 2).min(inv_freqs.len())],
        &mut angles,
    );
    rope_apply(head, &angles, halves);
}

/// (sin, cos) of each rotary pair's angle at `pos`, appended to `out`. A forward pass computes them once per
/// position and applies them to every head of every layer (`rope_apply`): recomputing them per head and layer
/// cost ~125k `sin_cos` per 5-token pass on Qwen 1.5B, all on the critical path.
pub fn rope_angles(pos: usize, inv_freqs: &[f32], out: &mut Vec<(f32, f32)>) {
    out.extend(inv_freqs.iter().map(|&freq| {
        // f64 angle: large positions times small frequencies lose precision in f32.
        let (sin, cos) = (pos as f64 * freq as f64).sin_cos();
        (sin as f32, cos as f32)
    }));
}

/// Rotates `head` by precomputed `(sin, cos)` pairs (`rope_angles`); bitwise what `rope` computes.
pub fn rope_apply(head: &mut [f32], angles: &[(f32, f32)], halves: bool) {
    let half = head.len() / 2;
    for (i, &(sin, cos)) in angles.iter().enumerate().take(half) {
        let (a, b) = if halves {
            (i, i + half)
        } else {
            (2 * i, 2 * i + 1)
        };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * cos - x1 * sin;
        head[b] = x0 * sin + x1 * cos;
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU), with libm's exp: faster exps (a vectorized f32 one, and an f64 one
/// rounded once that agrees with libm on all but ~1 in 1000 inputs) each moved one near-tie greedy case of
/// tests/real_models.rs away from llama.cpp, so SiLU keeps the numerics that test was calibrated on.
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up differ in length");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// Softmax of `scores` in place (max-subtracted, summed in order).
pub fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for s in scores.iter_mut() {
        *s -= max;
    }
    exp_in_place(scores);
    let sum: f32 = scores.iter().sum();
    let inv = 1.0 / sum;
    for s in scores.iter_mut() {
        *s *= inv;
    }
}

// exp(x) in f32 by range reduction to r = x - n ln2 and a degree-7 polynomial (Cephes' coefficients), within a
// couple of ulp of libm. Eight lanes at a time where the build has AVX2; the scalar path runs the same fused
// operations, so an element's result does not depend on its position in a slice (batch invariance). Inputs below
// -87.34 give 0 (libm would return denormals), above 88.3 give +inf (libm overflows at 88.72): the callers
// (softmax, sampling) exponentiate x - max <= 0, where neither end matters. SiLU keeps libm's exp: with this one
// the greedy tokens matched llama.cpp in 6 of 12 test cases, below the test's 7 (all divergences near ties).
const EXP_LO: f32 = -87.336_54;
const EXP_HI: f32 = 88.3;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_2e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// exp(x), the scalar form of `exp_in_place`.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x < EXP_LO {
        return 0.0;
    }
    if x > EXP_HI {
        return f32::INFINITY;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let z = r * r;
    let mut y = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        y = y.mul_add(r, c);
    }
    let y = y.mul_add(z, r) + 1.0;
    y * f32::from_bits((((n as i32) + 127) as u32) << 23)
}

/// `exp` of every element, in place.
pub fn exp_in_place(v: &mut [f32]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    let done = {
        // SAFETY: AVX2 and FMA are enabled for this build.
        unsafe { exp8_avx2(v) }
    };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    let done = 0;
    for x in &mut v[done..] {
        *x = exp(*x);
    }
}

/// The vector form of `exp` over whole groups of 8; returns how many elements it did.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8_avx2(v: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let whole = v.len() / 8 * 8;
    for chunk in v[..whole].chunks_exact_mut(8) {
        let x0 = _mm256_loadu_ps(chunk.as_ptr());
        let x = _mm256_min_ps(x0, _mm256_set1_ps(EXP_HI));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let z = _mm256_mul_ps(r, r);
        let mut y = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0));
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        let e = _mm256_mul_ps(y, pow2);
        // Out of range as the scalar form: 0 below, +inf above.
        let in_range = _mm256_cmp_ps::<_CMP_GE_OQ>(x0, _mm256_set1_ps(EXP_LO));
        let above = _mm256_cmp_ps::<_CMP_GT_OQ>(x0, _mm256_set1_ps(EXP_HI));
        let e = _mm256_blendv_ps(
            _mm256_and_ps(e, in_range),
            _mm256_set1_ps(f32::INFINITY),
            above,
        );
        _mm256_storeu_ps(chunk.as_mut_ptr(), e);
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized exp is within a few ulp of libm across the range, gives 0 below it, and every element's
    /// result is the same whether it is computed in a vector or in the scalar tail.
    #[test]
    fn exp_is_close_to_libm_and_position_independent() {
        let xs: Vec<f32> = (0..20001).map(|i| -90.0 + i as f32 * 0.00895).collect();
        let mut v = xs.clone();
        exp_in_place(&mut v);
        for (&x, &e) in xs.iter().zip(&v) {
            assert_eq!(
                e.to_bits(),
                exp(x).to_bits(),
                "x={x}: vector and scalar differ"
            );
            if x < EXP_LO {
                assert_eq!(e, 0.0);
            } else if x > EXP_HI {
                assert_eq!(e, f32::INFINITY);
            } else {
                let want = (x as f64).exp();
                let rel = ((e as f64 - want) / want).abs();
                assert!(rel < 4e-7, "x={x}: {e} vs {want} (rel {rel})");
            }
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
        // Odd lengths exercise the scalar tail.
        let mut odd = xs[..13].to_vec();
        exp_in_place(&mut odd);
        assert_eq!(odd, v[..13]);
    }

    #[test]
    fn dot_matches_naive_sum() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32).sin()).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }

    /// Attention scores, dots taken eight at a time, are bitwise `dot` times the scale for every count of
    /// queries and keys (whole tiles and every remainder), lengths with and without a tail, zero queries (a -0.0
    /// sum must come out +0.0, as `dot`'s does) and all-negative keys; cells outside the queries' rows untouched.
    #[test]
    fn scores_are_dot_times_scale_bit_for_bit() {
        use crate::testing::pseudo_random;
        for len in [128, 64, 8, 12] {
            for nq in 0..=7 {
                for n_keys in [0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 19] {
                    let seed = (len * 1000 + nq * 50 + n_keys) as u64;
                    let mut queries = pseudo_random(nq * len, seed);
                    queries[..len.min(nq * len)].fill(0.0);
                    let mut keys = pseudo_random(n_keys * len, seed + 1);
                    for v in &mut keys[len.min((n_keys * len).saturating_sub(len))..] {
                        *v = -v.abs() - 0.5;
                    }
                    let stride = n_keys + 3;
                    let mut out = vec![f32::NAN; nq * stride];
                    scores(
                        &queries,
                        len,
                        n_keys,
                        |j| &keys[j * len..(j + 1) * len],
                        0.125,
                        &mut out,
                        stride,
                    );
                    for i in 0..nq {
                        for j in 0..n_keys {
                            let want = dot(
                                &queries[i * len..(i + 1) * len],
                                &keys[j * len..(j + 1) * len],
                            ) * 0.125;
                            assert_eq!(
                                out[i * stride + j].to_bits(),
                                want.to_bits(),
                                "len {len}, {nq} queries, {n_keys} keys: query {i} key {j}"
                            );
                        }
                        assert!(out[i * stride + n_keys..(i + 1) * stride]
                            .iter()
                            .all(|v| v.is_nan()));
                    }
                }
            }
        }
    }

    /// A block of weighted rows added with `out` kept in registers gives bitwise what `axpy` row after row gives,
    /// for lengths of whole 64-float groups, part groups and a scalar tail.
    #[test]
    fn axpy_rows_is_axpy_row_after_row_bit_for_bit() {
        use crate::testing::pseudo_random;
        for len in [128, 64, 96, 8, 13, 3] {
            for count in [1, 2, 7, 16] {
                let seed = (len * 32 + count) as u64;
                let rows: Vec<Vec<f32>> = (0..count)
                    .map(|j| pseudo_random(len, seed + 1000 * j as u64))
                    .collect();
                let weights = pseudo_random(count, seed + 7);
                let start = pseudo_random(len, seed + 13);
                let mut expected = start.clone();
                for (w, r) in weights.iter().zip(&rows) {
                    axpy(&mut expected, *w, r);
                }
                let mut got = start.clone();
                axpy_rows(&mut got, &weights, |j| &rows[j]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&expected), "len {len}, {count} rows");
            }
        }
    }

    /// RoPE against its definition, computed here in f64: pair (a, b) of a head rotates by the angle
    /// pos * theta^(-2i/d), with pairs (i, i + d/2) in the halves layout and (2i, 2i + 1) interleaved. Checked to
    /// fail with a RoPE that does nothing (the test this replaces passed then: it checked only the norm and
    /// position 0).
    #[test]
    fn rope_matches_the_formula() {
        let d = 16;
        let theta = 10_000f64;
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| theta.powf(-2.0 * i as f64 / d as f64) as f32)
            .collect();
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() + 0.1).collect();
        for halves in [true, false] {
            for pos in [0usize, 1, 7, 300, 100_000] {
                let mut got = x.clone();
                rope(&mut got, pos, &inv, halves);
                let mut expected = vec![0f64; d];
                for (i, &freq) in inv.iter().enumerate() {
                    let (a, b) = if halves {
                        (i, i + d / 2)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let angle = pos as f64 * freq as f64;
                    let (x0, x1) = (x[a] as f64, x[b] as f64);
                    expected[a] = x0 * angle.cos() - x1 * angle.sin();
                    expected[b] = x0 * angle.sin() + x1 * angle.cos();
                }
                for j in 0..d {
                    assert!(
                        (got[j] as f64 - expected[j]).abs() < 1e-5,
                        "halves={halves} pos={pos} element {j}: {} vs {}",
                        got[j],
                        expected[j]
                    );
                }
                // The precomputed-angle path used by the forward pass is bitwise the same.
                let mut angles = Vec::new();
                rope_angles(pos, &inv, &mut angles);
                let mut applied = x.clone();
                rope_apply(&mut applied, &angles, halves);
                assert_eq!(applied, got);
            }
        }
        // The defining property: a query-key dot product depends only on the distance between positions.
        let (q, k) = (x.clone(), x.iter().rev().copied().collect::<Vec<f32>>());
        let dot_at = |pq: usize, pk: usize| {
            let (mut q, mut k) = (q.clone(), k.clone());
            rope(&mut q, pq, &inv, true);
            rope(&mut k, pk, &inv, true);
            dot(&q, &k)
        };
        assert!((dot_at(10, 3) - dot_at(107, 100)).abs() < 1e-4);
        assert!((dot_at(10, 3) - dot_at(10, 4)).abs() > 1e-3);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut s = vec![1.0, 2.0, 3.0, -1e9];
        softmax(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[3] == 0.0 && s[2] > s[1]);
    }
}
