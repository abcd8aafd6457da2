//! How the target's forward cost grows with the number of tokens verified at once: verify(n) for n = 1..=N.
//!
//! This is the term that decides whether speculation can win: if verify(k+1) is close to (k+1) x verify(1),
//! as with one-row-at-a-time quantized kernels, no drafter can pay for itself.

use std::time::Instant;

use crate::error::Result;
use crate::model::{ForwardOptions, LogitsFor, Model};
use crate::profile::Profiler;

/// Forward-pass time over n tokens with logits for all of them (a verify pass), n = 1..=max_rows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct VerifyCost {
    /// `ms[n-1]`: median milliseconds of a forward over n tokens.
    pub ms: Vec<f64>,
    /// Repetitions per n.
    pub repeats: usize,
    /// Context length the passes ran at.
    pub context: usize,
}

impl VerifyCost {
    pub fn verify_ms(&self, n: usize) -> f64 {
        self.ms[n - 1]
    }

    /// verify(n) / verify(1).
    pub fn ratio(&self, n: usize) -> f64 {
        self.ms[n - 1] / self.ms[0]
    }
}

/// Measures verify(n) after prefilling `context_tokens`. Sizes are interleaved within each repetition so that
/// machine drift affects all of them alike; the cache is truncated back after every pass.
pub fn measure_verify_cost(
    model: &dyn Model,
    context_tokens: &[u32],
    max_rows: usize,
    repeats: usize,
) -> Result<VerifyCost> {
    let sizes: Vec<usize> = (1..=max_rows).collect();
    let ms = measure_forward_ms(model, context_tokens, &sizes, repeats)?;
    Ok(VerifyCost {
        ms,
        repeats,
        context: context_tokens.len(),
    })
}

/// Median milliseconds of a verify-shaped forward (logits for every row, then the rows' argmax) over each of
/// `sizes` tokens after prefilling `context_tokens`, in the order given. Sizes are interleaved within each
/// repetition (the order rotated each time) so that machine drift affects all of them alike; the cache is truncated
/// back after every pass. Timing a few chosen sizes keeps a kernel profiler's run short.
pub fn measure_forward_ms(
    model: &dyn Model,
    context_tokens: &[u32],
    sizes: &[usize],
    repeats: usize,
) -> Result<Vec<f64>> {
    let max_rows = sizes.iter().copied().max().unwrap_or(0);
    if sizes.contains(&0) || context_tokens.is_empty() {
        return Err(crate::error::Error::InvalidArgument(
            "verify timings need at least one context token and sizes of at least one row".into(),
        ));
    }
    let prof = Profiler::disabled();
    let mut cache = model.new_cache_for(context_tokens.len(), max_rows, 0)?;
    let opts = ForwardOptions::default();
    model.forward_one(
        context_tokens,
        cache.as_mut(),
        &opts,
        LogitsFor::None,
        &prof,
    )?;
    let base = cache.len();
    // Arbitrary but valid token ids: the cost does not depend on them.
    let tokens: Vec<u32> = context_tokens
        .iter()
        .copied()
        .cycle()
        .take(max_rows)
        .collect();
    // A verify pass as the decode loop runs it: the forward, then the rows' argmax (which also waits for a
    // device that computes asynchronously).
    let verify = |n: usize, cache: &mut dyn crate::model::SequenceCache| -> Result<()> {
        let out = model.forward_one(&tokens[..n], cache, &opts, LogitsFor::All, &prof)?;
        out.logits.argmax_rows()?;
        cache.truncate(base);
        Ok(())
    };
    // One untimed pass per size warms caches and the allocator.
    for &n in sizes {
        verify(n, cache.as_mut())?;
    }
    let mut samples = vec![Vec::with_capacity(repeats); sizes.len()];
    for rep in 0..repeats {
        for i in 0..sizes.len() {
            // Rotate the order each repetition so no size always runs first.
            let at = (i + rep) % sizes.len();
            let start = Instant::now();
            verify(sizes[at], cache.as_mut())?;
            samples[at].push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(samples.into_iter().map(median).collect())
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{write_tiny_gguf, TinySpec};

    /// Chosen sizes are timed in the order given (the selftest's `--time-rows`), the full curve covers 1..=N, and
    /// sizes the cache cannot hold or of zero rows are errors, not panics.
    #[test]
    fn forward_times_follow_the_sizes_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &TinySpec::default()).unwrap();
        let loaded = crate::model::load_gguf(&path, "tiny").unwrap();
        let model = loaded.model.as_ref();
        let context = [1u32, 2, 3, 4, 5];
        let ms = measure_forward_ms(model, &context, &[5, 1, 3], 2).unwrap();
        assert_eq!(ms.len(), 3);
        assert!(ms.iter().all(|t| t.is_finite() && *t > 0.0), "{ms:?}");
        let curve = measure_verify_cost(model, &context, 4, 1).unwrap();
        assert_eq!(curve.ms.len(), 4);
        assert_eq!(curve.context, context.len());
        assert!(measure_forward_ms(model, &context, &[0, 2], 1).is_err());
        assert!(measure_forward_ms(model, &[], &[2], 1).is_err());
        assert!(measure_forward_ms(model, &context, &[10_000], 1).is_err());
    }
}
