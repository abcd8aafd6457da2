//! Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing): one track per phase, a `step` track,
//! and in fine mode the per-layer spans nested on the track of the phase that ran them.

use serde_json::{json, Value};

use super::{Phase, SpanKind, SpanRecord, StepKind, StepRecord};

const PID: u32 = 1;
const STEP_TID: u32 = 1;

fn phase_tid(p: Phase) -> u32 {
    10 + p as u32
}

pub(crate) fn chrome_trace(steps: &[StepRecord], spans: &[SpanRecord]) -> Value {
    let us = |ns: u64| ns as f64 / 1000.0;
    let mut events = Vec::with_capacity(steps.len() + spans.len() + 16);
    events
        .push(json!({"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "specula"}}));
    events.push(json!({"name": "thread_name", "ph": "M", "pid": PID, "tid": STEP_TID, "args": {"name": "step"}}));
    for p in Phase::ALL {
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": PID, "tid": phase_tid(p),
                           "args": {"name": p.name()}}),
        );
        events.push(
            json!({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": phase_tid(p),
                           "args": {"sort_index": phase_tid(p)}}),
        );
    }
    for (i, s) in steps.iter().enumerate() {
        let name = match s.kind {
            StepKind::Prefill => "prefill step",
            StepKind::Decode => "decode step",
        };
        events.push(json!({"name": name, "cat": "step", "ph": "X", "pid": PID, "tid": STEP_TID,
                           "ts": us(s.start), "dur": us(s.end.saturating_sub(s.start)), "args": {"step": i}}));
    }
    for sp in spans {
        let (name, tid, cat, args) = match sp.kind {
            SpanKind::Phase(p) => (
                p.name().to_string(),
                phase_tid(p),
                "phase",
                json!({"step": sp.step}),
            ),
            SpanKind::Fine {
                kind,
                layer,
                parent,
            } => (
                format!("{} L{layer}", kind.name()),
                phase_tid(parent.unwrap_or(Phase::Verify)),
                "layer",
                json!({"step": sp.step, "layer": layer}),
            ),
        };
        events.push(json!({"name": name, "cat": cat, "ph": "X", "pid": PID, "tid": tid,
                           "ts": us(sp.start), "dur": us(sp.end.saturating_sub(sp.start)), "args": args}));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}
