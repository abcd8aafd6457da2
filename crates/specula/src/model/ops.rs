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

/// Softmax of `scores` in place (max-subtracted, summed in order).
pub fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    for s in scores.iter_mut() {
        *s *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_sum() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32).sin()).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }

    #[test]
    fn rope_preserves_norm_and_rotates_pairs() {
        let inv: Vec<f32> = (0..4)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 8.0))
            .collect();
        for halves in [true, false] {
            let mut h = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
            let before = dot(&h, &h);
            rope(&mut h, 7, &inv, halves);
            assert!((dot(&h, &h) - before).abs() < 1e-3);
            let mut z = h.clone();
            rope(&mut z, 0, &inv, halves);
            assert_eq!(z, h, "position 0 is the identity");
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut s = vec![1.0, 2.0, 3.0, -1e9];
        softmax(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[3] == 0.0 && s[2] > s[1]);
    }
}
