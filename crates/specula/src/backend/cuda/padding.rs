//! Head passes padded to a few row counts, so a server captures a handful of CUDA graphs instead of one for
//! every (rows, wanted rows) pair its batched rounds happen to form.
//!
//! Session 59 (H100, stage-7 head, 16 streams): 17 of 24 drafted steps captured a new pass graph, and each capture
//! cost 0.3-0.7 ms of host time, so a step's draft phase took 0.41 ms (host clock 0.41: host-bound) where the same
//! rounds without a capture took 0.09-0.17; the draft budget priced passes from those steps and refused most drafts.
//! Padding rows are given inputs and a cache of their own (a scratch sequence), so the real rows' results are
//! unchanged: every head kernel works row by row.
//!
//! Plain Rust, compiled and tested without the `cuda` feature.

/// Row counts a captured pass is padded to: every count up to a chunk of 64 rows. The GEMV tiles take 8, 16, 24
/// and 32 rows a block, so padding within a step of this list adds little work to a latency-bound pass.
pub const PASS_ROW_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 24, 32, 48, 64];

/// The smallest bucket holding `rows` rows; `rows` itself past the last bucket (such passes run uncaptured).
pub fn bucket(rows: usize) -> usize {
    PASS_ROW_BUCKETS
        .iter()
        .copied()
        .find(|&b| b >= rows)
        .unwrap_or(rows)
}

/// The padded shape of a pass of `rows` rows of which `wanted` want results: (rows, wanted rows) as captured, each
/// a bucket (or 0 wanted). Whether the pass wants every real row is part of its shape beside this (it decides
/// whether the final norm completes the rows), since a padded pass may want all its rows while the real pass did
/// not.
pub fn padded_shape(rows: usize, wanted: usize) -> (usize, usize) {
    let padded_rows = bucket(rows);
    let padded_wanted = match wanted {
        0 => 0,
        w if w >= rows => padded_rows,
        w => bucket(w),
    };
    (padded_rows, padded_wanted)
}

/// The rows a padded pass gathers for its results, `padded_wanted` distinct rows of `0..padded_rows`: the real
/// wanted rows first, in order (their results are read back by position), then padding rows, then real rows
/// nobody asked for. Distinct, so a final norm that writes completed rows back writes each once.
pub fn wanted_rows(
    real_wanted: &[usize],
    rows: usize,
    padded_rows: usize,
    padded_wanted: usize,
) -> Vec<usize> {
    let mut list: Vec<usize> = real_wanted.to_vec();
    let extra = (rows..padded_rows).chain((0..rows).filter(|r| !real_wanted.contains(r)));
    list.extend(extra.take(padded_wanted.saturating_sub(real_wanted.len())));
    list.truncate(padded_wanted);
    list
}

/// Every padded shape a pass of up to a chunk of rows may take: (rows, wanted rows, whether every real row is
/// wanted), the graphs a server captures before it serves.
pub fn all_padded_shapes() -> Vec<(usize, usize, bool)> {
    let mut shapes = Vec::new();
    for rows in 1..=PASS_ROW_BUCKETS[PASS_ROW_BUCKETS.len() - 1] {
        for wanted in 0..=rows {
            let (r, w) = padded_shape(rows, wanted);
            let shape = (r, w, wanted == rows);
            if !shapes.contains(&shape) {
                shapes.push(shape);
            }
        }
    }
    shapes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_their_rows_and_stop_at_a_chunk() {
        for rows in 1..=64 {
            let b = bucket(rows);
            assert!(b >= rows && PASS_ROW_BUCKETS.contains(&b), "{rows} -> {b}");
            // The next smaller bucket would not hold it.
            let i = PASS_ROW_BUCKETS.iter().position(|&x| x == b).unwrap();
            assert!(i == 0 || PASS_ROW_BUCKETS[i - 1] < rows, "{rows} -> {b}");
        }
        assert_eq!(bucket(65), 65);
        assert_eq!(bucket(5), 8);
        assert_eq!(bucket(17), 24);
    }

    #[test]
    fn padded_shapes_are_buckets_holding_the_pass() {
        let mut shapes = std::collections::HashSet::new();
        for rows in 1..=64 {
            for wanted in 0..=rows {
                let (r, w) = padded_shape(rows, wanted);
                assert_eq!(r, bucket(rows));
                assert!(w >= wanted && w <= r, "{rows}/{wanted} -> {r}/{w}");
                assert!(
                    w == 0 || PASS_ROW_BUCKETS.contains(&w),
                    "{rows}/{wanted} -> {w}"
                );
                if wanted == rows {
                    assert_eq!(w, r);
                }
                assert_eq!(wanted == 0, w == 0);
                shapes.insert((r, w, wanted == rows));
            }
        }
        // What a server may capture of one kind of pass: a few dozen graphs, not a few thousand.
        assert!(shapes.len() <= 64, "{}", shapes.len());
        let mut all = all_padded_shapes();
        assert_eq!(all.len(), shapes.len());
        all.retain(|s| !shapes.contains(s));
        assert!(all.is_empty(), "{all:?}");
        assert_eq!(padded_shape(5, 5), (8, 8));
        assert_eq!(padded_shape(9, 6), (16, 8));
        assert_eq!(padded_shape(8, 5), (8, 8));
        assert_eq!(padded_shape(3, 1), (4, 1));
    }

    #[test]
    fn wanted_rows_are_distinct_with_the_real_ones_first() {
        for rows in 1..=64 {
            for wanted in 0..=rows {
                // Real wanted rows: the last row of each of `wanted` sequences, spread over the pass.
                let real: Vec<usize> = (0..wanted).map(|s| rows - 1 - (wanted - 1 - s)).collect();
                let (r, w) = padded_shape(rows, wanted);
                let list = wanted_rows(&real, rows, r, w);
                assert!(w <= r);
                assert_eq!(list.len(), w, "{rows}/{wanted}");
                assert_eq!(&list[..wanted], &real[..]);
                let mut sorted = list.clone();
                sorted.sort_unstable();
                sorted.dedup();
                assert_eq!(sorted.len(), list.len(), "{rows}/{wanted}: {list:?}");
                assert!(list.iter().all(|&x| x < r));
                if w == r {
                    assert_eq!(sorted, (0..r).collect::<Vec<_>>());
                }
            }
        }
        assert_eq!(wanted_rows(&[2, 6], 7, 8, 4), vec![2, 6, 7, 0]);
    }
}
