//! Prometheus metrics (`GET /metrics`, text format), named like vLLM's where the meaning is the same
//! (`specula:` instead of `vllm:`): request counts and errors, queue and running gauges, TTFT, inter-token and
//! end-to-end latency histograms, prompt and generated tokens, and speculative decoding with vLLM's definitions
//! (`spec_decode_num_drafts`: verify cycles that had a draft; `..._num_draft_tokens`; `..._num_accepted_tokens`;
//! `..._num_accepted_tokens_per_pos{position}`: accepted tokens at each draft position, 1-based), and the
//! profiler's view of every engine step: `specula:step_seconds{kind}` (prefill / decode) and
//! `specula:step_phase_seconds{phase}` (draft, verify, accept, sample, ... inside a step), by the model's clock
//! (device time on a GPU).

use prometheus::{
    exponential_buckets, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec,
    IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    /// Requests the engine finished, by why (vLLM's `request_success_total`): stop, length, or abort (the client
    /// went away mid-request).
    pub finished: IntCounterVec,
    pub queue: IntGauge,
    pub running: IntGauge,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    /// Prompt tokens looked up in the prefix cache, and those found there (vLLM's `prefix_cache_queries` and
    /// `prefix_cache_hits`, in tokens).
    pub prefix_cache_queries: IntCounter,
    pub prefix_cache_hits: IntCounter,
    pub num_drafts: IntCounter,
    /// Requests admitted without a drafter (`--spec-disable-batch-size`, or the automatic cap).
    pub admitted_without_drafter: IntCounter,
    /// Drafters taken from running requests that had been allowed no draft for a while under load.
    pub released_drafters: IntCounter,
    /// Steps in which the budget would have drafted but drafting had measured no gain at that many requests.
    pub payoff_refused_steps: IntCounter,
    /// Requests admitted beside others that went without their drafter to reuse a cached prompt it could not.
    pub prefix_over_drafter: IntCounter,
    pub num_draft_tokens: IntCounter,
    pub num_accepted_tokens: IntCounter,
    pub accepted_per_pos: IntCounterVec,
    pub step_seconds: HistogramVec,
    pub step_phase_seconds: HistogramVec,
    /// Requests in each engine step's forward pass.
    pub batch_size: Histogram,
    /// Rows (prompt chunks, pending tokens, drafts) in each engine step's forward pass.
    pub step_rows: Histogram,
    /// Draft length the engine allowed each drafting request per step (adaptive speculation's decisions).
    pub draft_limit: Histogram,
    /// Share of the KV memory budget the running requests reserve (0..1).
    pub kv_usage: Gauge,
    /// Share of the KV memory budget the prefix cache holds (0..1), and its entries.
    pub prefix_cache_usage: Gauge,
    pub prefix_cache_entries: IntGauge,
    /// What adaptive speculation currently prices (DraftBudget's measurements), by cost: draft_token,
    /// draft_pass, catch_up_token, step_overhead.
    pub draft_costs: GaugeVec,
    /// How drafted steps turn out against the draft budget's expectations relative to undrafted ones (its
    /// final comparison multiplies the drafted rate by this; 1 until measured).
    pub outcome_calibration: Gauge,
    /// Passes an EAGLE-3 head on a GPU has captured as CUDA graphs (one a new pass shape; each costs several
    /// passes, and the steps that capture one price nothing of drafting).
    pub head_graph_captures: IntGauge,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let latency = |name: &str, help: &str, start: f64| {
            let h = Histogram::with_opts(
                HistogramOpts::new(name, help)
                    .buckets(exponential_buckets(start, 2.0, 16).expect("valid buckets")),
            )
            .expect("valid histogram");
            registry.register(Box::new(h.clone())).expect("unique name");
            h
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid counter");
            registry.register(Box::new(c.clone())).expect("unique name");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid gauge");
            registry.register(Box::new(g.clone())).expect("unique name");
            g
        };
        let counter_vec = |name: &str, help: &str, label: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid counter");
            registry.register(Box::new(c.clone())).expect("unique name");
            c
        };
        let latency_vec = |name: &str, help: &str, label: &str| {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help)
                    .buckets(exponential_buckets(0.0001, 2.0, 18).expect("valid buckets")),
                &[label],
            )
            .expect("valid histogram");
            registry.register(Box::new(h.clone())).expect("unique name");
            h
        };
        let counts = |name: &str, help: &str| {
            let h = Histogram::with_opts(
                HistogramOpts::new(name, help)
                    .buckets(exponential_buckets(1.0, 2.0, 12).expect("valid buckets")),
            )
            .expect("valid histogram");
            registry.register(Box::new(h.clone())).expect("unique name");
            h
        };
        let kv_usage = Gauge::new(
            "specula:kv_cache_usage_perc",
            "Share of the KV memory budget (--kv-memory) reserved by running requests, 0 to 1.",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(kv_usage.clone()))
            .expect("unique name");
        let prefix_cache_usage = Gauge::new(
            "specula:prefix_cache_usage_perc",
            "Share of the KV memory budget (--kv-memory) the prefix cache holds (finished requests' caches and \
             prompts), 0 to 1; it gives way to requests.",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(prefix_cache_usage.clone()))
            .expect("unique name");
        let prefix_cache_entries = IntGauge::new(
            "specula:prefix_cache_entries",
            "Entries (token sequences with their KV caches) in the prefix cache.",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(prefix_cache_entries.clone()))
            .expect("unique name");
        let draft_costs = GaugeVec::new(
            Opts::new(
                "specula:spec_decode_cost_seconds",
                "Costs adaptive speculation prices drafts with, as measured so far: draft_token (drafter time \
                 per drafted token), draft_pass (per forward pass of a drafter with a model), catch_up_token (per token a draft model feeds to catch up: its prompt, or \
                 what it missed while cut), step_overhead (a step's time outside the forward pass and drafters).",
            ),
            &["cost"],
        )
        .expect("valid gauge");
        registry
            .register(Box::new(draft_costs.clone()))
            .expect("unique name");
        let outcome_calibration = Gauge::new(
            "specula:spec_decode_outcome_calibration",
            "Adaptive speculation's check on itself: (measured / expected time of undrafted steps) / (measured / \
             expected time of drafted steps) over recent steps, within 0.8-1.25; the drafted steps' expected rate \
             is multiplied by it before it is compared with not drafting. 1 until both kinds of step have been \
             seen.",
        )
        .expect("valid gauge");
        outcome_calibration.set(1.0);
        registry
            .register(Box::new(outcome_calibration.clone()))
            .expect("unique name");
        let head_graph_captures = IntGauge::new(
            "specula:eagle3_head_graph_captures",
            "CUDA graphs an EAGLE-3 head on a GPU has captured while serving, one a new pass shape (padded rows, \
             wanted rows, inputs, results; the greedy and sampled shapes are captured at start and not counted): each costs \
             several passes' time, and the draft budget leaves the steps that captured one out of its prices. A \
             count that keeps rising under a steady load means shapes are being evicted and captured again.",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(head_graph_captures.clone()))
            .expect("unique name");
        Metrics {
            draft_costs,
            outcome_calibration,
            head_graph_captures,
            batch_size: counts(
                "specula:step_batch_size",
                "Requests in each engine step's forward pass (continuous batching).",
            ),
            step_rows: counts(
                "specula:step_rows",
                "Rows in each engine step's forward pass: prompt chunks, pending tokens and drafts.",
            ),
            kv_usage,
            prefix_cache_usage,
            prefix_cache_entries,
            draft_limit: {
                let h = Histogram::with_opts(
                    HistogramOpts::new(
                        "specula:spec_decode_draft_limit",
                        "Draft tokens the engine allowed a drafting request in a step (0: a plain step), chosen \
                         from the measured step costs and the request's acceptance.",
                    )
                    .buckets(vec![0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0]),
                )
                .expect("valid histogram");
                registry.register(Box::new(h.clone())).expect("unique name");
                h
            },
            step_seconds: latency_vec(
                "specula:step_seconds",
                "Engine steps (prefill, or one decode / speculative cycle), by the model's clock.",
                "kind",
            ),
            step_phase_seconds: latency_vec(
                "specula:step_phase_seconds",
                "Time of each phase inside an engine step (draft, verify, accept, ...), by the model's clock.",
                "phase",
            ),
            requests: counter_vec(
                "specula:request_total",
                "Requests answered, by HTTP status code.",
                "status",
            ),
            finished: counter_vec(
                "specula:request_success_total",
                "Requests the engine finished, by finish reason: stop (end of text or a stop sequence), length \
                 (max_tokens or the context), abort (the client disconnected).",
                "finished_reason",
            ),
            queue: gauge(
                "specula:num_requests_waiting",
                "Requests queued for the engine.",
            ),
            running: gauge(
                "specula:num_requests_running",
                "Requests the engine is running.",
            ),
            ttft: latency(
                "specula:time_to_first_token_seconds",
                "From queueing to the first generated text.",
                0.001,
            ),
            itl: latency(
                "specula:inter_token_latency_seconds",
                "Between consecutive pieces of generated text.",
                0.0005,
            ),
            e2e: latency(
                "specula:e2e_request_latency_seconds",
                "From queueing to the last token.",
                0.005,
            ),
            prompt_tokens: counter("specula:prompt_tokens_total", "Prompt tokens processed."),
            generation_tokens: counter("specula:generation_tokens_total", "Tokens generated."),
            prefix_cache_queries: counter(
                "specula:prefix_cache_queries",
                "Prompt tokens of admitted requests, looked up in the prefix cache.",
            ),
            prefix_cache_hits: counter(
                "specula:prefix_cache_hits",
                "Prompt tokens whose keys and values came from the prefix cache.",
            ),
            num_drafts: counter(
                "specula:spec_decode_num_drafts",
                "Verify cycles that verified a draft.",
            ),
            admitted_without_drafter: counter(
                "specula:spec_decode_admitted_without_drafter",
                "Requests admitted without a drafter: past --spec-disable-batch-size, or where drafting measured no gain or drafters were mostly idle at that many requests.",
            ),
            prefix_over_drafter: counter(
                "specula:spec_decode_prefix_over_drafter",
                "Requests admitted beside others without their drafter because without it they reused at least 64 more cached prompt tokens (the cached prompt kept no drafter state).",
            ),
            released_drafters: counter(
                "specula:spec_decode_released_drafters",
                "Drafters taken from running requests allowed no draft in 16 decoding steps in a row beside other requests, where an idle drafter costs each step (an EAGLE-3 head's captured hidden states).",
            ),
            payoff_refused_steps: counter(
                "specula:spec_decode_payoff_refused_steps",
                "Decoding steps that drafted nothing although the draft budget allowed drafts, because drafted steps had measured no gain over undrafted ones at that many requests (one such step in 32 drafts anyway, to keep measuring).",
            ),
            num_draft_tokens: counter(
                "specula:spec_decode_num_draft_tokens",
                "Draft tokens proposed.",
            ),
            num_accepted_tokens: counter(
                "specula:spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
            ),
            accepted_per_pos: counter_vec(
                "specula:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position (1-based).",
                "position",
            ),
            registry,
        }
    }

    /// Records a request's steps, as its profiler saw them.
    pub fn observe_steps(&self, steps: &[specula::profile::StepPhases]) {
        for step in steps {
            let kind = match step.kind {
                specula::profile::StepKind::Prefill => "prefill",
                specula::profile::StepKind::Decode => "decode",
            };
            self.step_seconds
                .with_label_values(&[kind])
                .observe(step.seconds);
            for (phase, secs) in &step.phases {
                self.step_phase_seconds
                    .with_label_values(&[phase.name()])
                    .observe(*secs);
            }
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding of gathered metrics");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
