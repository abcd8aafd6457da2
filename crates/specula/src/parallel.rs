//! The worker pool every CPU kernel shares: candle's persistent spin-barrier pool (cheap to wake, which matters
//! when a decode step issues a few hundred small parallel regions).

use std::sync::OnceLock;

/// Most compute threads specula starts (far above any CPU's cores; a larger number is a typo, and each thread
/// is a real OS thread with its own stack).
pub const MAX_THREADS: usize = 1024;

static CONFIGURED_THREADS: OnceLock<usize> = OnceLock::new();

/// Sets the number of compute threads. Must be called before the first forward pass; later calls with a
/// different number are refused because the pool is already running.
pub fn set_threads(threads: usize) -> Result<(), String> {
    if threads == 0 || threads > MAX_THREADS {
        return Err(format!(
            "--threads must be between 1 and {MAX_THREADS}, got {threads}"
        ));
    }
    let actual = *CONFIGURED_THREADS.get_or_init(|| {
        // candle reads these once, when its pool starts.
        std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        threads
    });
    if actual != threads {
        return Err(format!(
            "the thread pool already runs {actual} threads; cannot switch to {threads} in this process"
        ));
    }
    Ok(())
}

/// Threads the pool runs (the configured number, or candle's default: the physical cores).
pub fn threads() -> usize {
    *CONFIGURED_THREADS.get_or_init(candle_core::utils::get_num_threads)
}

/// Runs `work` over `0..n_items`, split into ranges across the pool's threads (the caller takes part).
pub fn run_chunked<F: Fn(std::ops::Range<usize>) + Sync>(n_items: usize, work: F) {
    if n_items <= 1 {
        work(0..n_items);
        return;
    }
    candle_core::utils::barrier_pool().execute_chunked(n_items, work);
}

/// Runs `f` on consecutive chunks of `data` (at most `chunk` elements each, with the index of the chunk's first
/// element) across the pool. For element-wise work, whose results cannot depend on the split.
pub fn for_each_chunk_mut<T: Send, F: Fn(usize, &mut [T]) + Sync>(
    data: &mut [T],
    chunk: usize,
    f: F,
) {
    let chunk = chunk.max(1);
    let n_chunks = data.len().div_ceil(chunk);
    if n_chunks <= 1 {
        f(0, data);
        return;
    }
    struct Base<T>(*mut T);
    // SAFETY: the pointer is only used to hand out disjoint chunks to the pool's workers during this call.
    unsafe impl<T> Sync for Base<T> {}
    let (base, len) = (Base(data.as_mut_ptr()), data.len());
    run_chunked(n_chunks, |chunks| {
        let base = &base;
        for c in chunks {
            let start = c * chunk;
            let end = (start + chunk).min(len);
            // SAFETY: chunk c covers start..end of `data`, and each chunk index is visited exactly once.
            let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
            f(start, part);
        }
    });
}
