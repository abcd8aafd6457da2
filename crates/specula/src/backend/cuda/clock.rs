//! The profiler's clock on a GPU: each mark records a CUDA event on the step's stream (and the host's time), so
//! phase times are the GPU's and profiling adds no synchronization; marks are resolved after the work is done.
//! The `exact` variant synchronizes the stream at every mark instead, the way a host timer would have to: it
//! cross-checks the events and shows what naive timing costs.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use super::Gpu;
use crate::profile::Clock;

pub struct EventClock {
    gpu: Arc<Gpu>,
    exact: bool,
    host_origin: Instant,
    state: RefCell<State>,
}

#[derive(Default)]
struct State {
    /// One event and host time (ns) per mark; None where recording failed.
    marks: Vec<(Option<CudaEvent>, u64)>,
    /// Device ns since the first mark, for the marks resolved so far (consecutive differences, summed in f64:
    /// one long f32 interval would lose precision).
    resolved: Vec<u64>,
}

impl EventClock {
    pub fn new(gpu: Arc<Gpu>, exact: bool) -> Self {
        EventClock {
            gpu,
            exact,
            host_origin: Instant::now(),
            state: RefCell::new(State::default()),
        }
    }
}

/// Events kept for reuse at most (a step's marks, a few times over).
const POOLED_EVENTS: usize = 4096;

impl Drop for EventClock {
    fn drop(&mut self) {
        // The events go back to the GPU's pool: recording one again replaces its earlier record, which nobody
        // reads once this clock is gone.
        let marks = std::mem::take(&mut self.state.get_mut().marks);
        if let Ok(mut pool) = self.gpu.events.lock() {
            let room = POOLED_EVENTS.saturating_sub(pool.len());
            pool.extend(marks.into_iter().filter_map(|(e, _)| e).take(room));
        }
    }
}

impl Clock for EventClock {
    fn mark(&self) -> u64 {
        if self.exact {
            let _ = self.gpu.stream.synchronize();
        }
        let pooled = self.gpu.events.lock().ok().and_then(|mut p| p.pop());
        let event = pooled
            .or_else(|| {
                self.gpu
                    .ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .ok()
            })
            .filter(|e| e.record(&self.gpu.stream).is_ok());
        let host = self.host_origin.elapsed().as_nanos() as u64;
        let mut st = self.state.borrow_mut();
        st.marks.push((event, host));
        (st.marks.len() - 1) as u64
    }

    fn resolve(&self, marks: &[u64]) -> Vec<u64> {
        let mut st = self.state.borrow_mut();
        let wanted = marks.iter().copied().max().map_or(0, |m| m as usize + 1);
        while st.resolved.len() < wanted.min(st.marks.len()) {
            let i = st.resolved.len();
            let value = if i == 0 {
                0
            } else {
                let step = match (&st.marks[i - 1].0, &st.marks[i].0) {
                    (Some(a), Some(b)) => a.elapsed_ms(b).map(|ms| (ms as f64 * 1e6) as u64).ok(),
                    _ => None,
                };
                // An unrecorded event falls back to the host's interval.
                st.resolved[i - 1]
                    + step.unwrap_or_else(|| st.marks[i].1.saturating_sub(st.marks[i - 1].1))
            };
            st.resolved.push(value);
        }
        marks
            .iter()
            .map(|&m| st.resolved.get(m as usize).copied().unwrap_or(0))
            .collect()
    }

    fn name(&self) -> &'static str {
        if self.exact {
            "cuda-events-exact (synchronizes at every phase edge)"
        } else {
            "cuda-events"
        }
    }

    fn resolve_host(&self, marks: &[u64]) -> Option<Vec<u64>> {
        let st = self.state.borrow();
        Some(
            marks
                .iter()
                .map(|&m| st.marks.get(m as usize).map_or(0, |(_, h)| *h))
                .collect(),
        )
    }
}
