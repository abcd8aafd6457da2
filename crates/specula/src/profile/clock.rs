//! Clocks behind the profiler.
//!
//! A clock hands out *marks* at phase edges and turns them into nanoseconds later, in one batch. On the CPU a mark
//! is simply the monotonic time. A GPU clock records an event on the stream and returns its handle, so profiling
//! adds no synchronization; `resolve` reads the events once the work is done.

use std::time::Instant;

pub trait Clock {
    /// Takes a mark at the current point of the work stream.
    fn mark(&self) -> u64;
    /// Converts marks to nanoseconds since the clock's origin.
    fn resolve(&self, marks: &[u64]) -> Vec<u64>;
    /// Shown in reports so readers know what the numbers measure.
    fn name(&self) -> &'static str;
    /// The host's time of the same marks, for a clock whose marks are device times (None: they are the same).
    /// Beside device time it shows what the host spent (launching work, waiting), so a launch-bound step shows
    /// as one.
    fn resolve_host(&self, _marks: &[u64]) -> Option<Vec<u64>> {
        None
    }
}

/// Monotonic wall time (`std::time::Instant`); a mark costs about 20 ns.
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        MonotonicClock {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn mark(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    fn resolve(&self, marks: &[u64]) -> Vec<u64> {
        marks.to_vec()
    }

    fn name(&self) -> &'static str {
        "cpu-monotonic"
    }
}
