//! Aggregation of profiler records: per-phase totals, the summary table, and the phase part of the JSON report.

use std::fmt::Write as _;

use serde::Serialize;

use super::{Phase, SpanKind, SpanRecord, StepKind, StepRecord};

#[derive(Debug, Clone, Serialize)]
pub struct PhaseSummary {
    pub name: &'static str,
    pub total_s: f64,
    pub count: u64,
    pub mean_ms: f64,
    /// Fraction of decode time (sum of decode steps). Prefill is outside decode, so its share is 0.
    pub share_of_decode: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct FineSummary {
    pub name: &'static str,
    pub total_s: f64,
    pub count: u64,
    pub mean_ms: f64,
    pub share_of_decode: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ProfileSummary {
    pub phases: Vec<PhaseSummary>,
    /// Decode step time not covered by any phase.
    pub other_s: f64,
    pub decode_s: f64,
    pub decode_steps: u64,
    /// Wall time of the prefill step (forward over the prompt, first sample and emit).
    pub prefill_s: f64,
    /// Per-layer spans summed over layers, decode steps only (fine mode).
    pub fine: Vec<FineSummary>,
    /// With a device clock: the same records timed by the host (what launching and waiting cost there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<Box<ProfileSummary>>,
}

impl ProfileSummary {
    pub(crate) fn from_records(steps: &[StepRecord], spans: &[SpanRecord]) -> Self {
        let ns = |a: u64, b: u64| b.saturating_sub(a) as f64 * 1e-9;
        let mut decode_s = 0.0;
        let mut prefill_s = 0.0;
        let mut decode_steps = 0u64;
        for s in steps {
            match s.kind {
                StepKind::Decode => {
                    decode_s += ns(s.start, s.end);
                    decode_steps += 1;
                }
                StepKind::Prefill => prefill_s += ns(s.start, s.end),
            }
        }
        let is_decode = |step: u32| {
            steps
                .get(step as usize)
                .is_some_and(|s| s.kind == StepKind::Decode)
        };
        let mut totals = [0f64; Phase::ALL.len()];
        let mut counts = [0u64; Phase::ALL.len()];
        let mut fine: Vec<FineSummary> = Vec::new();
        let mut covered = 0.0;
        for sp in spans {
            let d = ns(sp.start, sp.end);
            match sp.kind {
                SpanKind::Phase(p) => {
                    // The prefill phase is reported over its own steps; every other phase over decode steps.
                    if p == Phase::Prefill || is_decode(sp.step) {
                        totals[p.index()] += d;
                        counts[p.index()] += 1;
                    }
                    if is_decode(sp.step) {
                        covered += d;
                    }
                }
                SpanKind::Fine { kind, .. } if is_decode(sp.step) => {
                    match fine.iter_mut().find(|f| f.name == kind.name()) {
                        Some(f) => {
                            f.total_s += d;
                            f.count += 1;
                        }
                        None => fine.push(FineSummary {
                            name: kind.name(),
                            total_s: d,
                            count: 1,
                            mean_ms: 0.0,
                            share_of_decode: 0.0,
                        }),
                    }
                }
                SpanKind::Fine { .. } => {}
            }
        }
        let share = |t: f64| if decode_s > 0.0 { t / decode_s } else { 0.0 };
        let phases = Phase::ALL
            .iter()
            .map(|&p| {
                let total_s = totals[p.index()];
                let count = counts[p.index()];
                PhaseSummary {
                    name: p.name(),
                    total_s,
                    count,
                    mean_ms: if count > 0 {
                        total_s * 1e3 / count as f64
                    } else {
                        0.0
                    },
                    share_of_decode: if p == Phase::Prefill {
                        0.0
                    } else {
                        share(total_s)
                    },
                }
            })
            .collect();
        for f in &mut fine {
            f.mean_ms = f.total_s * 1e3 / f.count.max(1) as f64;
            f.share_of_decode = share(f.total_s);
        }
        ProfileSummary {
            phases,
            other_s: (decode_s - covered).max(0.0),
            decode_s,
            decode_steps,
            prefill_s,
            fine,
            host: None,
        }
    }

    pub fn phase(&self, name: &str) -> Option<&PhaseSummary> {
        self.phases.iter().find(|p| p.name == name)
    }

    /// The phases object of the JSON report: every phase that ran, plus `other`.
    pub fn phases_json(&self) -> serde_json::Value {
        let mut map = serde_json::Map::new();
        for p in self.phases.iter().filter(|p| p.count > 0) {
            map.insert(
                p.name.to_string(),
                serde_json::json!({
                    "total_s": p.total_s, "count": p.count, "mean_ms": p.mean_ms,
                    "share_of_decode": p.share_of_decode,
                }),
            );
        }
        let steps = self.decode_steps.max(1) as f64;
        map.insert(
            "other".into(),
            serde_json::json!({
                "total_s": self.other_s, "count": self.decode_steps,
                "mean_ms": self.other_s * 1e3 / steps,
                "share_of_decode": if self.decode_s > 0.0 { self.other_s / self.decode_s } else { 0.0 },
            }),
        );
        serde_json::Value::Object(map)
    }

    /// The end-of-run table: one row per phase (total ms, ms per step, share of decode), `other`, then fine spans.
    /// With a device clock, a last column gives the host's ms per step of the same phase.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let steps = self.decode_steps.max(1) as f64;
        let host_steps = self
            .host
            .as_ref()
            .map(|h| h.decode_steps.max(1) as f64)
            .unwrap_or(1.0);
        let host_col = |name: &str| -> String {
            let Some(h) = &self.host else {
                return String::new();
            };
            let total = match name {
                "other" => h.other_s,
                "decode" => h.decode_s,
                _ => h.phase(name).map_or(0.0, |p| p.total_s),
            };
            format!(" {:>12.3}", total * 1e3 / host_steps)
        };
        let _ = writeln!(
            out,
            "{:<10} {:>11} {:>8} {:>11} {:>9}{}",
            "phase",
            "total ms",
            "count",
            "ms/step",
            "share",
            if self.host.is_some() {
                "  host ms/step"
            } else {
                ""
            }
        );
        let _ = writeln!(
            out,
            "{}",
            "-".repeat(if self.host.is_some() { 67 } else { 53 })
        );
        for p in self.phases.iter().filter(|p| p.count > 0) {
            if p.name == "prefill" {
                let _ = writeln!(
                    out,
                    "{:<10} {:>11.2} {:>8} {:>11} {:>9}",
                    p.name,
                    p.total_s * 1e3,
                    p.count,
                    "-",
                    "(prefill)"
                );
                continue;
            }
            let _ = writeln!(
                out,
                "{:<10} {:>11.2} {:>8} {:>11.3} {:>8.1}%{}",
                p.name,
                p.total_s * 1e3,
                p.count,
                p.total_s * 1e3 / steps,
                p.share_of_decode * 100.0,
                host_col(p.name)
            );
        }
        let other_share = if self.decode_s > 0.0 {
            self.other_s / self.decode_s
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "{:<10} {:>11.2} {:>8} {:>11.3} {:>8.1}%{}",
            "other",
            self.other_s * 1e3,
            self.decode_steps,
            self.other_s * 1e3 / steps,
            other_share * 100.0,
            host_col("other")
        );
        let _ = writeln!(
            out,
            "{:<10} {:>11.2} {:>8} {:>11.3} {:>8.1}%{}",
            "decode",
            self.decode_s * 1e3,
            self.decode_steps,
            self.decode_s * 1e3 / steps,
            100.0,
            host_col("decode")
        );
        if !self.fine.is_empty() {
            let _ = writeln!(out, "per-layer spans (all layers, decode steps):");
            for f in &self.fine {
                let _ = writeln!(
                    out,
                    "  {:<8} {:>11.2} {:>8} {:>11.3} {:>8.1}%",
                    f.name,
                    f.total_s * 1e3,
                    f.count,
                    f.total_s * 1e3 / steps,
                    f.share_of_decode * 100.0
                );
            }
        }
        out
    }
}
