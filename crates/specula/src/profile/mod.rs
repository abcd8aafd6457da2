//! The built-in profiler: every decode step is split into named phases, timed at their edges, so the time of a
//! step is accounted for without anyone patching timers into the engine.
//!
//! Usage: `let _s = prof.span(Phase::Verify);` times a phase until the guard drops. Steps bracket phases
//! (`begin_step` / `end_step`); time in a step not covered by a phase is reported as `other`, so phases add up to
//! the step time by construction. In fine mode the model adds nested per-layer spans (attention, MLP).
//!
//! The profiler is passed down explicitly (never a global) and is single-threaded: the decode loop owns it.

pub mod clock;
pub mod report;
pub mod trace;

use std::cell::RefCell;

pub use clock::{Clock, MonotonicClock};

/// One kernel launch timed alone on a device (`Model::time_kernels`, `HeadCompute::time_kernels`).
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub us: f64,
}

/// The phases of a decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Target forward over the prompt.
    Prefill,
    /// Drafter proposes tokens.
    Draft,
    /// Target forward over the pending token(s): for plain decoding, the one-token step.
    Verify,
    /// Greedy match or rejection sampling of drafts.
    Accept,
    /// Turning logits into a token (temperature, top-k, top-p).
    Sample,
    /// Cache bookkeeping: appending accepted tokens, truncating rejected ones.
    Commit,
    /// Detokenizing and writing the new text.
    Emit,
    /// The drafter reads the target's hidden states of the rows that stay (EAGLE-3): paid every step whether or
    /// not the next one drafts, so it is not the drafting's price.
    Feed,
}

impl Phase {
    pub const ALL: [Phase; 8] = [
        Phase::Prefill,
        Phase::Draft,
        Phase::Verify,
        Phase::Accept,
        Phase::Sample,
        Phase::Commit,
        Phase::Emit,
        Phase::Feed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Draft => "draft",
            Phase::Verify => "verify",
            Phase::Accept => "accept",
            Phase::Sample => "sample",
            Phase::Commit => "commit",
            Phase::Emit => "emit",
            Phase::Feed => "feed",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// A target forward pass (prefill or verify): on a GPU, work on the device rather than the host.
    pub fn is_forward(self) -> bool {
        matches!(self, Phase::Prefill | Phase::Verify)
    }
}

/// Per-layer spans inside a forward pass (fine mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FineKind {
    Attention,
    Mlp,
    LmHead,
}

impl FineKind {
    pub fn name(self) -> &'static str {
        match self {
            FineKind::Attention => "attention",
            FineKind::Mlp => "mlp",
            FineKind::LmHead => "lm_head",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Detail {
    /// No timing at all: spans cost a branch.
    Off,
    /// Phases of every step.
    Phases,
    /// Phases plus per-layer spans of the model's forward pass.
    Fine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Prefill,
    Decode,
}

/// One step's time and its phases' times ([`Profiler::step_phases`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepPhases {
    pub kind: StepKind,
    pub seconds: f64,
    pub phases: Vec<(Phase, f64)>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum SpanKind {
    Phase(Phase),
    Fine {
        kind: FineKind,
        layer: u32,
        parent: Option<Phase>,
    },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct SpanRecord {
    pub kind: SpanKind,
    pub step: u32,
    pub start: u64,
    pub end: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct StepRecord {
    pub kind: StepKind,
    pub start: u64,
    pub end: u64,
}

#[derive(Default)]
struct State {
    steps: Vec<StepRecord>,
    spans: Vec<SpanRecord>,
    open_step: Option<(StepKind, u64)>,
    open_phase: Option<Phase>,
    /// The end mark of the last phase span, while it is the clock's latest mark: the next host-side phase
    /// starts there (see [`Profiler::span`]).
    shared_edge: Option<u64>,
}

pub struct Profiler {
    clock: Box<dyn Clock>,
    detail: Detail,
    state: RefCell<State>,
}

/// Times a span until dropped.
#[must_use = "a span measures until it is dropped"]
pub struct Span<'a> {
    prof: Option<&'a Profiler>,
    kind: SpanKind,
    start: u64,
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        if let Some(prof) = self.prof {
            let end = prof.clock.mark();
            let mut st = prof.state.borrow_mut();
            let step = st.steps.len() as u32;
            st.shared_edge = None;
            if let SpanKind::Phase(_) = self.kind {
                st.open_phase = None;
                st.shared_edge = Some(end);
            }
            st.spans.push(SpanRecord {
                kind: self.kind,
                step,
                start: self.start,
                end,
            });
        }
    }
}

impl Profiler {
    pub fn new(detail: Detail) -> Self {
        Self::with_clock(detail, Box::new(MonotonicClock::new()))
    }

    pub fn disabled() -> Self {
        Self::new(Detail::Off)
    }

    pub fn with_clock(detail: Detail, clock: Box<dyn Clock>) -> Self {
        Profiler {
            clock,
            detail,
            state: RefCell::new(State::default()),
        }
    }

    pub fn detail(&self) -> Detail {
        self.detail
    }

    pub fn enabled(&self) -> bool {
        self.detail != Detail::Off
    }

    pub fn clock_name(&self) -> &'static str {
        self.clock.name()
    }

    /// Times `phase` until the returned guard drops.
    #[inline]
    pub fn span(&self, phase: Phase) -> Span<'_> {
        if self.detail == Detail::Off {
            return Span {
                prof: None,
                kind: SpanKind::Phase(phase),
                start: 0,
            };
        }
        let shared = {
            let mut st = self.state.borrow_mut();
            st.open_phase = Some(phase);
            st.shared_edge.take()
        };
        // A host-side phase that follows another phase starts at its end: one mark for both (the host code
        // between them counts in the new one). On a GPU every mark records an event, and a batched step runs a
        // few such phases per request. Forward passes start at marks of their own, so their time stays the
        // pass's.
        let start = match shared {
            Some(edge) if !phase.is_forward() => edge,
            _ => self.clock.mark(),
        };
        Span {
            prof: Some(self),
            kind: SpanKind::Phase(phase),
            start,
        }
    }

    /// A per-layer span; recorded only in fine mode.
    #[inline]
    pub fn fine(&self, kind: FineKind, layer: usize) -> Span<'_> {
        if self.detail != Detail::Fine {
            return Span {
                prof: None,
                kind: SpanKind::Fine {
                    kind,
                    layer: layer as u32,
                    parent: None,
                },
                start: 0,
            };
        }
        let parent = {
            let mut st = self.state.borrow_mut();
            st.shared_edge = None;
            st.open_phase
        };
        Span {
            prof: Some(self),
            kind: SpanKind::Fine {
                kind,
                layer: layer as u32,
                parent,
            },
            start: self.clock.mark(),
        }
    }

    pub fn begin_step(&self, kind: StepKind) {
        if self.detail == Detail::Off {
            return;
        }
        let start = self.clock.mark();
        let mut st = self.state.borrow_mut();
        st.open_step = Some((kind, start));
        st.shared_edge = None;
    }

    pub fn end_step(&self) {
        if self.detail == Detail::Off {
            return;
        }
        let end = self.clock.mark();
        let mut st = self.state.borrow_mut();
        st.shared_edge = None;
        if let Some((kind, start)) = st.open_step.take() {
            st.steps.push(StepRecord { kind, start, end });
        }
    }

    /// Resolves all marks into nanoseconds and returns the records (steps, spans) for reporting.
    pub(crate) fn resolved(&self) -> (Vec<StepRecord>, Vec<SpanRecord>) {
        self.resolved_by(|marks| self.clock.resolve(marks))
    }

    /// The records with their marks turned into nanoseconds by `resolve`.
    fn resolved_by(
        &self,
        resolve: impl FnOnce(&[u64]) -> Vec<u64>,
    ) -> (Vec<StepRecord>, Vec<SpanRecord>) {
        let st = self.state.borrow();
        let mut marks = Vec::with_capacity(2 * (st.steps.len() + st.spans.len()));
        for s in &st.steps {
            marks.push(s.start);
            marks.push(s.end);
        }
        for s in &st.spans {
            marks.push(s.start);
            marks.push(s.end);
        }
        let ns = resolve(&marks);
        let mut it = ns.into_iter();
        let mut next = || it.next().unwrap_or(0);
        let steps = st
            .steps
            .iter()
            .map(|s| StepRecord {
                kind: s.kind,
                start: next(),
                end: next(),
            })
            .collect();
        let spans = st
            .spans
            .iter()
            .map(|s| SpanRecord {
                kind: s.kind,
                step: s.step,
                start: next(),
                end: next(),
            })
            .collect();
        (steps, spans)
    }

    /// Aggregates the recorded steps into per-phase totals (with the host's view beside a device clock's).
    pub fn summary(&self) -> report::ProfileSummary {
        let (steps, spans) = self.resolved();
        let mut summary = report::ProfileSummary::from_records(&steps, &spans);
        if self.clock.resolve_host(&[]).is_some() {
            let (steps, spans) =
                self.resolved_by(|marks| self.clock.resolve_host(marks).unwrap_or_default());
            summary.host = Some(Box::new(report::ProfileSummary::from_records(
                &steps, &spans,
            )));
        }
        summary
    }

    /// Every recorded step: its kind, its time and the time of each phase inside it (by this profiler's clock;
    /// a phase that ran several times in a step is summed). Empty when profiling is off.
    pub fn step_phases(&self) -> Vec<StepPhases> {
        let (steps, spans) = self.resolved();
        Self::phases_of(&steps, &spans)
    }

    /// [`Self::step_phases`] by the host's clock, when this profiler's clock is a device's (None otherwise: the
    /// host's view is the same). A phase's host time is what it held the host: launches, and waits on the device
    /// where the phase reads results back.
    pub fn step_phases_host(&self) -> Option<Vec<StepPhases>> {
        self.clock.resolve_host(&[])?;
        let (steps, spans) =
            self.resolved_by(|marks| self.clock.resolve_host(marks).unwrap_or_default());
        Some(Self::phases_of(&steps, &spans))
    }

    fn phases_of(steps: &[StepRecord], spans: &[SpanRecord]) -> Vec<StepPhases> {
        let mut out: Vec<StepPhases> = steps
            .iter()
            .map(|s| StepPhases {
                kind: s.kind,
                seconds: s.end.saturating_sub(s.start) as f64 * 1e-9,
                phases: Vec::new(),
            })
            .collect();
        for span in spans {
            let (SpanKind::Phase(phase), Some(step)) = (span.kind, out.get_mut(span.step as usize))
            else {
                continue;
            };
            let secs = span.end.saturating_sub(span.start) as f64 * 1e-9;
            match step.phases.iter_mut().find(|(p, _)| *p == phase) {
                Some((_, total)) => *total += secs,
                None => step.phases.push((phase, secs)),
            }
        }
        out
    }

    /// Seconds the last recorded span of `phase` took by this profiler's clock (None when profiling is off or it
    /// has not run). The decode loop tells drafters the verify time this way: on a GPU a host timer would
    /// measure only the launches.
    pub fn last_span_seconds(&self, phase: Phase) -> Option<f64> {
        let (start, end) = {
            let st = self.state.borrow();
            let span = st
                .spans
                .iter()
                .rev()
                .find(|s| matches!(s.kind, SpanKind::Phase(p) if p == phase))?;
            (span.start, span.end)
        };
        let ns = self.clock.resolve(&[start, end]);
        Some(ns.get(1)?.saturating_sub(*ns.first()?) as f64 * 1e-9)
    }

    /// Chrome trace-event JSON of everything recorded.
    pub fn chrome_trace(&self) -> serde_json::Value {
        let (steps, spans) = self.resolved();
        trace::chrome_trace(&steps, &spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A clock that advances by a fixed step at each mark, so tests can check arithmetic exactly.
    struct TickClock(Cell<u64>);
    impl Clock for TickClock {
        fn mark(&self) -> u64 {
            let v = self.0.get();
            self.0.set(v + 1000);
            v
        }
        fn resolve(&self, marks: &[u64]) -> Vec<u64> {
            marks.to_vec()
        }
        fn name(&self) -> &'static str {
            "tick"
        }
    }

    #[test]
    fn step_phases_give_each_steps_phase_times() {
        let prof = Profiler::with_clock(Detail::Phases, Box::new(TickClock(Cell::new(0))));
        prof.begin_step(StepKind::Prefill); // 0
        {
            let _p = prof.span(Phase::Prefill); // 1000 .. 2000
        }
        prof.end_step(); // 3000
        prof.begin_step(StepKind::Decode); // 4000
        for _ in 0..2 {
            // Host-side phases back to back share an edge: 5000 .. 6000, then 6000 .. 7000.
            let _d = prof.span(Phase::Draft);
        }
        {
            // A forward pass takes marks of its own.
            let _v = prof.span(Phase::Verify); // 8000 .. 9000
        }
        {
            // It ends at an edge the next host-side phase shares.
            let _a = prof.span(Phase::Accept); // 9000 .. 10000
        }
        prof.end_step(); // 11000
        let steps = prof.step_phases();
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].kind, StepKind::Prefill);
        assert!((steps[0].seconds - 3000e-9).abs() < 1e-15);
        let close = |got: &[(Phase, f64)], want: &[(Phase, f64)]| {
            got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() < 1e-15)
        };
        assert!(
            close(&steps[0].phases, &[(Phase::Prefill, 1000e-9)]),
            "{steps:?}"
        );
        assert_eq!(steps[1].kind, StepKind::Decode);
        assert!((steps[1].seconds - 7000e-9).abs() < 1e-15);
        // Two draft spans in one step are summed.
        assert!(
            close(
                &steps[1].phases,
                &[
                    (Phase::Draft, 2000e-9),
                    (Phase::Verify, 1000e-9),
                    (Phase::Accept, 1000e-9)
                ]
            ),
            "{steps:?}"
        );
        assert!(Profiler::disabled().step_phases().is_empty());
    }

    #[test]
    fn phases_and_other_add_up_to_step_time() {
        let prof = Profiler::with_clock(Detail::Fine, Box::new(TickClock(Cell::new(0))));
        for _ in 0..3 {
            prof.begin_step(StepKind::Decode); // t0
            {
                let _v = prof.span(Phase::Verify); // +1000
                let _a = prof.fine(FineKind::Attention, 0); // +1000 .. end +1000
            } // verify end
            {
                // Starts at verify's end (a shared edge).
                let _s = prof.span(Phase::Sample);
            }
            prof.end_step();
        }
        let summary = prof.summary();
        let total: f64 = summary.phases.iter().map(|p| p.total_s).sum::<f64>() + summary.other_s;
        assert!((total - summary.decode_s).abs() < 1e-12);
        let verify = summary.phases.iter().find(|p| p.name == "verify").unwrap();
        assert_eq!(verify.count, 3);
        // verify: start at mark 1, fine start 2, fine end 3, verify end 4 -> 3 ticks of 1000 ns.
        assert!((verify.total_s - 3.0 * 3000e-9).abs() < 1e-15);
        // step: marks 0..=6 -> 6000 ns; phases cover 3000 + 1000; other = 2000 per step.
        assert!((summary.other_s - 3.0 * 2000e-9).abs() < 1e-15);
        assert_eq!(summary.fine.len(), 1);
        assert_eq!(summary.fine[0].count, 3);
    }

    /// A device-style clock: marks resolve to "device" times (each mark 1000 ns after the last), and the host
    /// times differ (the host saw a long wait at the third mark, the way reading a result waits for a GPU).
    struct FakeDeviceClock(Cell<u64>);
    impl Clock for FakeDeviceClock {
        fn mark(&self) -> u64 {
            let v = self.0.get();
            self.0.set(v + 1);
            v
        }
        fn resolve(&self, marks: &[u64]) -> Vec<u64> {
            marks.iter().map(|m| m * 1000).collect()
        }
        fn name(&self) -> &'static str {
            "fake-device"
        }
        fn resolve_host(&self, marks: &[u64]) -> Option<Vec<u64>> {
            Some(
                marks
                    .iter()
                    .map(|&m| if m >= 3 { m * 10 + 5000 } else { m * 10 })
                    .collect(),
            )
        }
    }

    #[test]
    fn device_clock_times_phases_and_keeps_the_hosts_view_beside() {
        let prof = Profiler::with_clock(Detail::Phases, Box::new(FakeDeviceClock(Cell::new(0))));
        prof.begin_step(StepKind::Decode); // mark 0
        {
            let _v = prof.span(Phase::Verify); // marks 1, 2
        }
        {
            let _s = prof.span(Phase::Sample); // marks 2 (verify's end), 3
        }
        prof.end_step(); // mark 4
                         // The decode loop reads the last verify span's time (by the device clock) for the drafter.
        let verify_s = prof.last_span_seconds(Phase::Verify).unwrap();
        assert!((verify_s - 1000e-9).abs() < 1e-15, "{verify_s}");
        assert_eq!(prof.last_span_seconds(Phase::Draft), None);
        let summary = prof.summary();
        let verify = summary.phase("verify").unwrap();
        assert!((verify.total_s - 1000e-9).abs() < 1e-15);
        let host = summary
            .host
            .as_ref()
            .expect("a device clock reports the host's view");
        // Host: verify marks 1 -> 2 = 10 ns; sample marks 2 -> 3 = 5010 ns (its wait for the device); step marks
        // 0 -> 4 = 5040 ns.
        assert!((host.phase("verify").unwrap().total_s - 10e-9).abs() < 1e-15);
        assert!((host.decode_s - 5040e-9).abs() < 1e-15);
        let table = summary.table();
        assert!(table.contains("host ms/step"), "{table}");
        // The same step's phases by each clock, as the server's draft budget reads them.
        let device = &prof.step_phases()[0];
        let host = &prof
            .step_phases_host()
            .expect("a device clock has a host view")[0];
        assert!((device.seconds - 4000e-9).abs() < 1e-15 && (host.seconds - 5040e-9).abs() < 1e-15);
        let sample = |s: &StepPhases| {
            s.phases
                .iter()
                .find(|(p, _)| *p == Phase::Sample)
                .unwrap()
                .1
        };
        assert!((sample(device) - 1000e-9).abs() < 1e-15 && (sample(host) - 5010e-9).abs() < 1e-15);
        // The monotonic clock has no separate host view.
        let plain = Profiler::new(Detail::Phases);
        plain.begin_step(StepKind::Decode);
        plain.end_step();
        assert!(plain.summary().host.is_none());
        assert!(plain.step_phases_host().is_none());
    }

    #[test]
    fn disabled_profiler_records_nothing() {
        let prof = Profiler::disabled();
        prof.begin_step(StepKind::Decode);
        drop(prof.span(Phase::Verify));
        prof.end_step();
        let s = prof.summary();
        assert_eq!(s.decode_steps, 0);
        assert!(s.phases.iter().all(|p| p.count == 0));
    }
}
