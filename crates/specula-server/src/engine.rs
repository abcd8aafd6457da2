//! The engine loop: one thread owns the model and runs every request; HTTP handlers talk to it through a bounded
//! queue and a channel per request. The engine knows nothing of HTTP.
//!
//! Continuous batching: each engine step advances every running request by one decode step (a speculative cycle
//! or a plain step) or one chunk of its prompt, all in one forward pass of the target
//! ([`specula::decode::step`]). Requests join at step boundaries while there is a free slot (`max_batch`) and KV
//! memory for their whole generation (`kv_memory`), and leave as soon as they finish, fail, time out or their
//! client goes away. The CPU backend computes each row as it would alone, so a greedy request's output does not
//! depend on what else runs with it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use specula::chat::ChatMessage;
use specula::decode::{
    self, stop_text, GenerateRequest, Generation, LogprobsRequest, PrefixCache, StepLimits,
    StopReason,
};
use specula::draft::budget::{DraftBudget, DraftCandidate};
use specula::draft::eagle3::compute::HeadCompute;
use specula::draft::model::{DraftModelRounds, ModelDrafter};
use specula::draft::ngram::NgramDrafter;
use specula::draft::Drafter;
use specula::model::LoadedModel;
use specula::profile::{Phase, Profiler};
use specula::sampling::{LogitAdjustments, SamplingParams, TokenLogprob};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// Everything recorded between `/start_profile` and `/stop_profile`: every engine step (the profiler's trace
/// events, on one time axis from the session's start) and every request that finished.
pub struct ProfileSession {
    pub started: Instant,
    /// Chrome trace events of the engine's steps (without the metadata events).
    pub events: Vec<serde_json::Value>,
    pub steps: usize,
    /// One record per finished request: its usage and when it ran.
    pub requests: Vec<serde_json::Value>,
    /// Events dropped past [`ProfileSession::MAX_EVENTS`].
    pub dropped_events: usize,
}

impl ProfileSession {
    /// Bounds the memory of a session nobody stops.
    pub const MAX_EVENTS: usize = 2_000_000;

    pub fn new() -> Self {
        ProfileSession {
            started: Instant::now(),
            events: Vec::new(),
            steps: 0,
            requests: Vec::new(),
            dropped_events: 0,
        }
    }
}

impl Default for ProfileSession {
    fn default() -> Self {
        Self::new()
    }
}

/// The profiling switch the HTTP side flips and the engine reads at every step.
pub type Profiling = Arc<Mutex<Option<ProfileSession>>>;

/// How the engine batches and bounds its work.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Draft tokens per cycle when speculating.
    pub draft_tokens: usize,
    /// Requests that may wait for a slot; past it, submissions are refused (429).
    pub max_queue: usize,
    /// Requests running at once (one forward pass serves them all).
    pub max_batch: usize,
    /// Bytes of KV cache the running requests may reserve together (each reserves its prompt plus max_tokens).
    pub kv_memory: usize,
    /// Prompt tokens prefilled per step over all requests (chunked prefill keeps running streams flowing).
    pub prefill_chunk: usize,
    /// A request still unfinished this long after it was queued ends with a timeout error.
    pub request_timeout: Option<Duration>,
    /// Choose each request's draft length every step from the measured step costs and its acceptance
    /// ([`specula::draft::budget::DraftBudget`]); false: always `draft_tokens`.
    pub adaptive_drafts: bool,
    /// Keep finished requests' KV caches in the KV memory running requests leave free, so that later prompts
    /// starting the same way skip that part of their prefill ([`specula::decode::PrefixCache`]).
    pub prefix_cache: bool,
    /// Do a step's bookkeeping and the next step's plan while its forward pass runs ([`overlap_enabled`]); None:
    /// on a GPU (`SPECULA_SERVE_OVERLAP` overrides), not on the CPU.
    pub overlap: Option<bool>,
    /// No request drafts in a step where this many or more are decoding, and a request admitted into a batch of
    /// this many or more (itself included) gets no drafter at all (vLLM's `disable_by_batch_size`). Running requests' drafters keep following
    /// theirs, so they resume drafting when the batch shrinks. None: the draft policy alone decides.
    pub spec_disable_batch_size: Option<usize>,
    /// With adaptive drafts: a request admitted beside others where drafting has lately made no more tokens a
    /// second than not drafting, at that many requests, gets no drafter ([`DraftPayoff`]).
    pub spec_disable_auto: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            draft_tokens: 3,
            max_queue: 64,
            max_batch: 16,
            kv_memory: 4 << 30,
            prefill_chunk: 256,
            request_timeout: None,
            adaptive_drafts: true,
            prefix_cache: true,
            overlap: None,
            spec_disable_batch_size: None,
            spec_disable_auto: true,
        }
    }
}

/// Whether requests drafting with one EAGLE-3 head (or one draft model) share its passes (default;
/// `SPECULA_SHARED_HEAD=0` turns it off).
fn shared_head_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_SHARED_HEAD").map_or(true, |v| v != "0"))
}

/// Prompt lookup's settings (`--ngram-min`, `--ngram-max`, `--ngram-confidence`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NgramSettings {
    pub min_n: usize,
    pub max_n: usize,
    /// The stopping bar; None: cost-aware stopping, with the target device's verify-cost prior.
    pub min_confidence: Option<f64>,
}

impl Default for NgramSettings {
    fn default() -> Self {
        NgramSettings {
            min_n: 1,
            max_n: 4,
            min_confidence: Some(specula::draft::ngram::DEFAULT_MIN_CONFIDENCE),
        }
    }
}

/// What the server speculates with.
pub enum DraftSetup {
    None,
    /// Prompt lookup.
    Ngram(NgramSettings),
    /// A draft model sharing the target's tokenizer, drafting from the first token ids only when limited
    /// (`--draft-vocab`), with its confidence bar (`--draft-confidence`).
    Model(Box<LoadedModel>, Option<usize>, f64),
    /// An EAGLE-3 head fed by the target's hidden states (chains, or trees of a shape), and the chains'
    /// confidence bar (`--draft-confidence`; trees ignore it).
    Eagle3(
        Box<specula::draft::eagle3::Eagle3Head>,
        Option<specula::draft::eagle3::TreeShape>,
        f64,
    ),
}

/// A request's input: a raw prompt (`/v1/completions`) or a conversation (`/v1/chat/completions`), or either
/// already tokenized ([`tokenize_input`]: the HTTP side does it on its own threads, so the engine thread, which the
/// device waits on between steps, does not spend ~0.3-1.8 ms a request on the chat template and the tokenizer).
#[derive(Clone)]
pub enum Input {
    Prompt(String),
    /// The messages, and the tool definitions the chat template renders (OpenAI's `tools`).
    Chat(Vec<ChatMessage>, Option<serde_json::Value>),
    Tokens(Vec<u32>),
}

/// A prompt's or a conversation's tokens, as the engine would make them (chat template, then the tokenizer).
pub fn tokenize_input(
    tokenizer: &specula::tokenizer::Tokenizer,
    chat_template: Option<&specula::chat::ChatTemplate>,
    input: &Input,
) -> Result<Vec<u32>, String> {
    let text = match input {
        Input::Prompt(p) => std::borrow::Cow::Borrowed(p.as_str()),
        Input::Chat(messages, tools) => std::borrow::Cow::Owned(
            specula::model::format_chat_with_tools(
                chat_template,
                tokenizer,
                messages,
                tools.as_ref(),
            )
            .map_err(|e| e.to_string())?,
        ),
        Input::Tokens(t) => return Ok(t.clone()),
    };
    tokenizer.encode(&text).map_err(|e| e.to_string())
}

pub struct Job {
    pub input: Input,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Generate past end-of-turn tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Token ids that end the generation (vLLM's `stop_token_ids`), kept in the output.
    pub stop_token_ids: Vec<u32>,
    /// Log-probabilities to send with the text (OpenAI's `logprobs`); None: none.
    pub logprobs: Option<LogprobsRequest>,
    /// Penalties and logit bias; None: the model's own distribution.
    pub logit_adjustments: Option<LogitAdjustments>,
    pub events: UnboundedSender<Event>,
    /// Set when the client goes away: the engine drops the request at its next step.
    pub cancel: Arc<AtomicBool>,
    /// When the request was queued (latency metrics, timeouts).
    pub queued_at: Instant,
}

/// What the engine tells a request's handler, in order: `Started` (or a failure), the prompt's log-probabilities
/// when asked for, text pieces, `Done`.
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
    },
    /// Each prompt token's log-probability but the first's, once the prompt is prefilled (before any text).
    PromptLogprobs(Vec<TokenLogprob>),
    /// A piece of the answer, with the log-probabilities of the tokens whose text it completes (when asked for).
    Text(String, Vec<ScoredToken>),
    Done(Result<Finished, Failure>),
}

/// A generated token's log-probabilities and where its text starts in the answer (in bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredToken {
    pub offset: usize,
    pub logprob: TokenLogprob,
}

/// Why a request did not finish.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// The request cannot run (its prompt, its size): the client's to fix.
    BadRequest(String),
    /// It ran past the server's request timeout.
    Timeout(String),
    /// Something failed inside the engine.
    Internal(String),
}

impl Failure {
    pub fn message(&self) -> &str {
        match self {
            Failure::BadRequest(m) | Failure::Timeout(m) | Failure::Internal(m) => m,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Finished {
    pub prompt_tokens: usize,
    /// Of those, the tokens taken from the prefix cache.
    pub cached_prompt_tokens: usize,
    pub completion_tokens: usize,
    /// OpenAI's finish_reason: "stop" (end of turn or a stop sequence) or "length".
    pub finish_reason: &'static str,
    /// Speculative stats of the request (zero without a drafter).
    pub drafted: u64,
    pub accepted: u64,
    pub cycles: u64,
    /// Seconds from queueing to the engine taking the request.
    pub queue_s: f64,
    /// Seconds from the request's first step to its first token (its prompt's chunks, alongside other requests).
    pub prefill_s: f64,
    /// Seconds from the first token to the last.
    pub decode_s: f64,
}

/// The queue between the HTTP side and the engine: bounded, and the engine drops requests whose client left or
/// whose time ran out while they waited.
struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

struct QueueState {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The handle the HTTP side holds; dropping it stops the engine once its running requests are done.
pub struct Engine {
    queue: Arc<Queue>,
    max_queue: usize,
    metrics: Arc<Metrics>,
    /// The name responses carry and `/v1/models` lists first (the model's spec, or the server's first
    /// `--served-model-name`).
    pub model_name: String,
    /// Other names a request may give in `model` (the further `--served-model-name`s).
    pub model_aliases: Vec<String>,
    pub context_length: usize,
    /// The model's tokenizer, shared with the engine (`/tokenize`, `/detokenize` need no engine turn).
    pub tokenizer: Arc<specula::tokenizer::Tokenizer>,
    /// The model's chat template (`/tokenize` of chat messages formats them as a chat request would).
    pub chat_template: Option<specula::chat::ChatTemplate>,
    pub vocab_size: usize,
    pub profiling: Profiling,
    pub options: EngineOptions,
    /// The tokenizer's tokens as bytes for constrained JSON, built by the first request that asks for it.
    json_vocabulary: std::sync::OnceLock<Arc<specula::json_mode::JsonVocabulary>>,
    /// `json_object`'s constraint: one for every request, so masks computed for one state serve all.
    json_object: std::sync::OnceLock<Arc<specula::json_mode::JsonConstraint>>,
    /// Recent schemas' constraints by the schema's text (an application sends the same schema again and again;
    /// each new state's mask is a pass over the vocabulary).
    json_schemas: std::sync::Mutex<HashMap<String, Arc<specula::json_mode::JsonConstraint>>>,
}

/// Schemas whose constraints (and masks) a server keeps.
const JSON_SCHEMAS_KEPT: usize = 32;

/// Prepares the target's steps before the server takes requests ([`specula::model::Model::prepare_steps`]: on a
/// GPU, its step buffers at their final size and a CUDA graph for every decoding and verifying row count), so a
/// load level's first steps do not pay for it. A failure only costs that: the steps prepare themselves on demand.
fn prepare_steps(
    model: &LoadedModel,
    draft: &DraftSetup,
    options: &EngineOptions,
) -> Vec<(usize, f64)> {
    let config = model.model.config();
    let mut capture = match draft {
        DraftSetup::Eagle3(head, _, _) => head
            .config
            .target_layers(config.num_layers)
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    capture.sort_unstable();
    capture.dedup();
    let speculating = !matches!(draft, DraftSetup::None);
    let rows_per_request = 1 + if speculating { options.draft_tokens } else { 0 };
    let batch = options.max_batch.max(1);
    let shapes = specula::model::StepShapes {
        max_rows: options.prefill_chunk + batch * rows_per_request,
        max_sequences: batch,
        max_logit_rows: batch * rows_per_request,
        capture_layers: &capture,
        vocab_limit: None,
        last_row_logits_only: false,
    };
    let prepared = prepare(model, &shapes, "the target");
    // With SPECULA_TIME_STEPS=1 (to compare; not yet measured on a device), a device whose steps were prepared
    // also times its decoding and verifying steps at 1, 2, 4, ... requests, undrafted and drafting the most, so
    // the draft budget prices a load's first wide drafted steps from a measurement instead of extrapolating
    // from narrow ones (session 57, H100, 16 streams: 96-row verifies took 6 ms against 1.9 for 16 rows, and
    // the first wave's drafted steps ran ~1 ms over their price).
    let seeds = if prepared > 0 && speculating && time_steps_enabled() {
        time_steps(model, &capture, batch, rows_per_request)
    } else {
        Vec::new()
    };
    // Requests admitted past --spec-disable-batch-size (or the automatic cap) have no drafter: batches of only them
    // capture nothing.
    let capped = options.spec_disable_batch_size.is_some()
        || (options.spec_disable_auto && options.adaptive_drafts);
    if capped && !capture.is_empty() {
        let plain = specula::model::StepShapes {
            capture_layers: &[],
            ..shapes
        };
        prepare(model, &plain, "the target (requests without a drafter)");
    }
    // An EAGLE-3 head's passes: every padded shape of a shared round, captured now rather than mid-load (session
    // 59, H100, 16 streams: 17 of 24 drafted steps captured a pass, each 0.3-0.7 ms of host time).
    if let DraftSetup::Eagle3(head, _, _) = draft {
        let started = Instant::now();
        match head.compute().prepare_passes() {
            Ok(0) => {}
            Ok(n) => eprintln!(
                "prepared {n} pass shapes of the EAGLE-3 head on {} in {:.2} s",
                head.compute().device(),
                started.elapsed().as_secs_f64()
            ),
            Err(e) => eprintln!(
                "warning: preparing the EAGLE-3 head's passes failed ({e}); they are captured on demand"
            ),
        }
    }
    // A draft model's passes too: one a drafted token, and a catch-up (a new request's prompt) of any length.
    // Unprepared, each new catch-up length captures a graph mid-request (milliseconds on a GPU), time the draft
    // budget counts into what a catch-up costs.
    if let DraftSetup::Model(d, vocab_limit, _) = draft {
        let shapes = specula::model::StepShapes {
            max_rows: options.prefill_chunk.max(1),
            max_sequences: 1,
            max_logit_rows: 1,
            capture_layers: &[],
            vocab_limit: *vocab_limit,
            last_row_logits_only: true,
        };
        prepare(d, &shapes, "the draft model");
    }
    seeds
}

/// Whether the engine times its step shapes before serving (`SPECULA_TIME_STEPS=1`; off by default).
fn time_steps_enabled() -> bool {
    std::env::var("SPECULA_TIME_STEPS").is_ok_and(|v| v == "1")
}

/// The target's steps of 1, 2, 4, ... up to `batch` requests, each at every draft length from none to
/// `rows_per_request - 1` tokens, timed ([`specula::model::time_step_shapes`]): (rows, seconds) for the draft budget. A failure is only
/// a warning (the budget then learns the prices from the server's own steps).
fn time_steps(
    model: &LoadedModel,
    capture: &[usize],
    batch: usize,
    rows_per_request: usize,
) -> Vec<(usize, f64)> {
    let mut requests: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2))
        .take_while(|&n| n < batch)
        .collect();
    requests.push(batch);
    let mut shapes: Vec<(usize, usize)> = Vec::new();
    // Every draft length, not only the ends: the GEMV's token tiles make T(rows) a staircase (16 rows 1.80 ms,
    // 17 rows 2.12, 32 rows 2.45, 33 rows 3.39 at the qwen2.5-1.5b shape on an H100, session 56), which a line
    // between 16 and 96 rows misprices by up to ~0.5 ms.
    for &n in &requests {
        for rows in 1..=rows_per_request {
            if !shapes.contains(&(n, rows)) {
                shapes.push((n, rows));
            }
        }
    }
    let started = Instant::now();
    match specula::model::time_step_shapes(model.model.as_ref(), &shapes, capture, 3) {
        Ok(timed) => {
            let list: Vec<String> = timed
                .iter()
                .map(|(rows, s)| format!("{rows}:{:.2}", s * 1e3))
                .collect();
            eprintln!(
                "timed {} step shapes of the target in {:.2} s (rows:ms {})",
                timed.len(),
                started.elapsed().as_secs_f64(),
                list.join(" ")
            );
            timed
        }
        Err(e) => {
            eprintln!("warning: timing the target's steps failed ({e}); the budget learns them from serving");
            Vec::new()
        }
    }
}

/// Prepares `model`'s `shapes`, saying what it did; a failure is only a warning. Returns the shapes prepared.
fn prepare(model: &LoadedModel, shapes: &specula::model::StepShapes<'_>, what: &str) -> usize {
    let started = Instant::now();
    match model.model.prepare_steps(shapes) {
        Ok(0) => 0,
        Ok(n) => {
            eprintln!(
                "prepared {n} step shapes of {what} on {} in {:.2} s",
                model.model.device(),
                started.elapsed().as_secs_f64()
            );
            n
        }
        Err(e) => {
            eprintln!("warning: preparing {what}'s steps failed ({e}); they prepare on demand");
            0
        }
    }
}

/// Why a job was not queued.
pub enum SubmitError {
    QueueFull,
    Stopped,
}

impl Engine {
    /// Starts the engine thread over `model`.
    pub fn start(
        model: LoadedModel,
        draft: DraftSetup,
        options: EngineOptions,
        metrics: Arc<Metrics>,
    ) -> Self {
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState {
                jobs: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        });
        let model_name = model.spec.clone();
        let context_length = model.model.config().context_length;
        let tokenizer = model.tokenizer.clone();
        let chat_template = model.chat_template.clone();
        let vocab_size = model.model.config().vocab_size;
        let step_seeds = prepare_steps(&model, &draft, &options);
        let engine_metrics = metrics.clone();
        let profiling: Profiling = Arc::default();
        let engine_profiling = profiling.clone();
        let engine_queue = queue.clone();
        let engine_options = options.clone();
        std::thread::Builder::new()
            .name("specula-engine".into())
            .spawn(move || {
                let overlap = overlap_enabled(&model, &engine_options);
                EngineLoop {
                    model: &model,
                    draft: &draft,
                    options: engine_options,
                    queue: &engine_queue,
                    metrics: &engine_metrics,
                    profiling: &engine_profiling,
                    next_id: std::cell::Cell::new(0),
                    budget: std::cell::RefCell::new({
                        let mut budget = DraftBudget::new();
                        for (rows, seconds) in step_seeds {
                            budget.seed_forward(rows, seconds);
                        }
                        budget
                    }),
                    prefixes: std::cell::RefCell::new(PrefixCache::new()),
                    overlap,
                    carry: std::cell::RefCell::default(),
                    payoff: std::cell::RefCell::default(),
                }
                .run()
            })
            .expect("spawn the engine thread");
        Engine {
            queue,
            max_queue: options.max_queue.max(1),
            metrics,
            model_name,
            model_aliases: Vec::new(),
            context_length,
            tokenizer,
            chat_template,
            vocab_size,
            profiling,
            options,
            json_vocabulary: std::sync::OnceLock::new(),
            json_object: std::sync::OnceLock::new(),
            json_schemas: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn json_vocabulary(&self) -> Arc<specula::json_mode::JsonVocabulary> {
        self.json_vocabulary
            .get_or_init(|| specula::json_mode::JsonVocabulary::new(&self.tokenizer))
            .clone()
    }

    /// The constraint for `response_format` `json_object` (None) or `json_schema` (the schema): shared with every
    /// request that asks for the same, so each state's mask is computed once. Errors name what in the schema is
    /// not supported.
    pub fn json_constraint(
        &self,
        schema: Option<&serde_json::Value>,
    ) -> specula::Result<Arc<specula::json_mode::JsonConstraint>> {
        use specula::json_mode::{JsonConstraint, JsonGrammar};
        let Some(schema) = schema else {
            return Ok(self
                .json_object
                .get_or_init(|| {
                    JsonConstraint::new(JsonGrammar::any_object(), self.json_vocabulary())
                })
                .clone());
        };
        self.kept_constraint(schema.to_string(), || JsonGrammar::from_schema(schema))
    }

    /// The constraint for output that matches `regex` whole, shared like a schema's.
    pub fn regex_constraint(
        &self,
        regex: &str,
    ) -> specula::Result<Arc<specula::json_mode::JsonConstraint>> {
        self.kept_constraint(format!("regex:{regex}"), || {
            specula::json_mode::JsonGrammar::from_regex(regex)
        })
    }

    /// The constraint for output that is exactly one of `choices`, shared like a schema's.
    pub fn choice_constraint(
        &self,
        choices: &[String],
    ) -> specula::Result<Arc<specula::json_mode::JsonConstraint>> {
        let key = format!("choice:{}", serde_json::Value::from(choices.to_vec()));
        self.kept_constraint(key, || {
            specula::json_mode::JsonGrammar::from_choices(choices)
        })
    }

    /// A constraint kept by `key` (at most `JSON_SCHEMAS_KEPT`), built on first use.
    fn kept_constraint(
        &self,
        key: String,
        build: impl FnOnce() -> specula::Result<specula::json_mode::JsonGrammar>,
    ) -> specula::Result<Arc<specula::json_mode::JsonConstraint>> {
        if let Some(c) = self
            .json_schemas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(c.clone());
        }
        let constraint = specula::json_mode::JsonConstraint::new(build()?, self.json_vocabulary());
        let mut kept = self.json_schemas.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() >= JSON_SCHEMAS_KEPT {
            kept.clear();
        }
        Ok(kept.entry(key).or_insert(constraint).clone())
    }

    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.submit_all(vec![job])
    }

    /// Queues every job or none (the choices of one request: `n` in the OpenAI API).
    pub fn submit_all(&self, jobs: Vec<Job>) -> Result<(), SubmitError> {
        let mut q = self.queue.state.lock().map_err(|_| SubmitError::Stopped)?;
        if q.closed {
            return Err(SubmitError::Stopped);
        }
        if q.jobs.len() + jobs.len() > self.max_queue {
            return Err(SubmitError::QueueFull);
        }
        q.jobs.extend(jobs);
        self.metrics.queue.set(q.jobs.len() as i64);
        drop(q);
        self.queue.ready.notify_all();
        Ok(())
    }

    /// Jobs the queue holds at most.
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Ok(mut q) = self.queue.state.lock() {
            q.closed = true;
        }
        self.queue.ready.notify_all();
    }
}

/// A request the engine is running.
/// A request's speculation counters, read before and after a step.
#[derive(Debug, Clone, Copy, Default)]
struct SpecCounts {
    drafted: u64,
    accepted: u64,
    draft_passes: u64,
    catch_up_cycles: u64,
}

impl SpecCounts {
    fn of(generation: &Generation<'_>) -> Option<Self> {
        generation.speculation().map(|s| SpecCounts {
            drafted: s.drafted,
            accepted: s.accepted,
            draft_passes: s.draft_passes,
            catch_up_cycles: s.catch_up_cycles,
        })
    }

    /// What changed since `before`.
    fn since(self, before: &SpecCounts) -> SpecCounts {
        SpecCounts {
            drafted: self.drafted - before.drafted,
            accepted: self.accepted - before.accepted,
            draft_passes: self.draft_passes - before.draft_passes,
            catch_up_cycles: self.catch_up_cycles - before.catch_up_cycles,
        }
    }
}

/// Each request's draft limit for a step, what the budget expected of the step (seconds, tokens) and where its
/// cost rule stopped.
struct LimitChoice {
    limits: Vec<Option<usize>>,
    expected: Option<(f64, f64)>,
    refused: Option<specula::draft::budget::Refusal>,
    /// The budget ran this step undrafted to measure it again.
    baseline_probe: bool,
}

/// What the engine decided for a step, and what the draft budget expected of it, for the profile.
struct StepDecision {
    drafts_allowed: usize,
    /// (seconds, tokens) the budget expected; None without adaptive drafts or before it has measurements.
    expected: Option<(f64, f64)>,
    /// Tokens the step committed across requests.
    committed: usize,
    /// Where the budget's cost rule stopped adding drafts, and the prices it used (drafter time per pass and
    /// per catch-up token, the rest of a step), for the profile.
    refused: Option<specula::draft::budget::Refusal>,
    baseline_probe: bool,
    prices: (Option<f64>, Option<f64>, Option<f64>, Option<f64>),
    /// Host wall time of the draft budget's plan and of the decode step proper (its forward passes, drafting and
    /// acceptance); the rest of `wall_ms` is the engine's bookkeeping around them.
    host_plan_s: f64,
    host_decode_s: f64,
    /// Host time of the work done while the step's forward pass ran (the last step's bookkeeping, the next
    /// step's plan); inside `host_decode_s`.
    host_overlapped_s: f64,
}

/// The draft budget's plan's view of the running requests ([`EngineLoop::plan_input`]).
#[derive(Default)]
struct PlanInput {
    /// Drafting requests, as the budget knows them.
    candidates: Vec<DraftCandidate>,
    base_rows: usize,
    decoding: usize,
}

/// A plan's draft lengths by request id, with what the budget expected of the step.
struct PlannedLimits {
    ids: Vec<u64>,
    limits: Vec<usize>,
    expected: Option<(f64, f64)>,
    refused: Option<specula::draft::budget::Refusal>,
    baseline_probe: bool,
}

/// One drafting request's cycle in a step, for the draft budget ([`cycle_evidence`]).
struct RequestCycle {
    id: u64,
    limit: usize,
    counts: SpecCounts,
    lag_before: usize,
    lag_after: usize,
    draft_room: usize,
}

/// A step's bookkeeping that waits for the next step's forward pass (metrics, the budget's observations, the
/// profile): on a GPU the device then runs while the host does it, where it used to wait for it (at 32 streams on
/// an H200 the head server spent ~80-190 us a step of host time between forward passes: docs/benchmarks.md).
struct Aftermath {
    prof: Profiler,
    step_start: Instant,
    /// The step's host wall time, plan to commit.
    wall_s: f64,
    report: decode::StepReport,
    phases: Vec<specula::profile::StepPhases>,
    costs: Option<StepCosts>,
    cycles: Vec<RequestCycle>,
    decision: StepDecision,
    /// The drafter captured a CUDA graph during the step (a new pass shape): its time is no price of drafting.
    captured: bool,
}

/// What one step leaves to the next ([`Aftermath`], requests that left since, the plan made during its pass).
#[derive(Default)]
struct Carry {
    aftermath: Option<Aftermath>,
    left: Vec<u64>,
    plan: Option<PlannedLimits>,
}

/// Whether the engine does a step's bookkeeping and the next plan while the forward pass runs: on a device that
/// runs the pass asynchronously (a GPU; `SPECULA_SERVE_OVERLAP=0` does them between steps, as before, to compare,
/// and `=1` forces it on the CPU, for tests). On the CPU the pass is done when it returns: nothing would overlap,
/// and the plan would only be a step older.
fn overlap_enabled(model: &LoadedModel, options: &EngineOptions) -> bool {
    if let Some(on) = options.overlap {
        return on;
    }
    match std::env::var("SPECULA_SERVE_OVERLAP").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => model.model.device() != "cpu",
    }
}

/// A step's time as the draft budget prices it: the forward pass, the drafters, and the rest.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepCosts {
    forward: f64,
    draft: f64,
    other: f64,
}

/// Splits a step's time for the draft budget. The forward pass is priced by the model's clock (device time on a
/// GPU: what its rows cost). With a device clock the drafters and the rest are priced by the host's clock
/// (`host`): a head's passes wait on the device for their tokens and a request's host work lengthens the step,
/// yet no device clock sees either (on an H200 at 32 streams the speculative server's steps took less device time
/// than plain decoding's and longer on the wall). On the CPU both clocks are one.
fn step_costs(
    device: &specula::profile::StepPhases,
    host: Option<&specula::profile::StepPhases>,
) -> StepCosts {
    let phase = |s: &specula::profile::StepPhases, p: Phase| {
        s.phases
            .iter()
            .filter(|(q, _)| *q == p)
            .map(|(_, t)| t)
            .sum::<f64>()
    };
    let forward = phase(device, Phase::Verify) + phase(device, Phase::Prefill);
    let timed = host.unwrap_or(device);
    let draft = phase(timed, Phase::Draft);
    StepCosts {
        forward,
        draft,
        other: (timed.seconds - forward - draft).max(0.0),
    }
}

/// What one request's step tells the draft budget: the catch-up rows its drafter fed (priced apart from
/// drafting), and its cycle (allowed, drafted, accepted) for the acceptance counts, None when the cycle only fed
/// part of a long catch-up (beside other requests): counted, such cycles read as allowed-and-undrafted positions
/// and the budget stopped drafting in servers started under load.
fn cycle_evidence(
    limit: usize,
    step: &SpecCounts,
    lag_before: usize,
    lag_after: usize,
    draft_room: usize,
) -> (usize, Option<(usize, usize, usize)>) {
    if step.catch_up_cycles > 0 {
        return (lag_before.saturating_sub(lag_after), None);
    }
    // A draft first feeds what it lagged by beyond the draft's own tokens (as DraftBudget::choose counts it),
    // whether or not its confidence bar then let it propose anything: priced as a draft pass, a stopped draft's
    // pass over a lag of several rows (undrafted steps' tokens) once set a CPU server's pass price at twice its
    // cost, and the server never drafted again.
    let fed = if step.draft_passes > 0 {
        lag_before.saturating_sub(limit.max(draft_room) + 1)
    } else {
        0
    };
    (
        fed,
        Some((limit, step.drafted as usize, step.accepted as usize)),
    )
}

struct Running<'a> {
    /// Unique while the engine runs (the draft budget's key).
    id: u64,
    generation: Generation<'a>,
    out: Output,
    /// KV cache bytes reserved for it (target and draft model).
    kv_bytes: usize,
    admitted: Instant,
    admission: AdmissionCost,
    deadline: Option<Instant>,
    timed_out: bool,
    /// When its last token came (TTFT, then inter-token latency).
    last_token_at: Option<Instant>,
    /// Seconds of each phase ([`Phase::ALL`] order) of the engine steps it took part in: where its time went,
    /// shared with the requests batched with it.
    phase_seconds: [f64; Phase::ALL.len()],
    steps: usize,
    /// Decoding steps in a row, beside other decoding requests, in which its drafter was allowed no draft
    /// ([`EngineLoop::release_idle_drafters`]).
    idle_steps: u32,
}

impl Running<'_> {
    /// Decoding with a drafter: the draft budget chooses its draft length each step.
    fn is_drafting(&self) -> bool {
        !self.generation.is_done()
            && !self.generation.is_prefilling()
            && self.generation.has_drafter()
    }
}

/// Where a running request's text goes: its job's channel, through the stop sequences.
struct Output {
    job: Job,
    /// Generated text so far (cut at a stop sequence once one appears) and how much of it was sent.
    produced: String,
    sent: usize,
    stopped_by_sequence: bool,
    /// Log-probabilities of tokens not sent yet, with where each token's text ends in `produced`: a token goes
    /// out with the piece that completes its text.
    scored: VecDeque<(usize, ScoredToken)>,
    /// Whether the prompt's log-probabilities went out (or were not asked for).
    prompt_scored: bool,
}

impl Output {
    /// Takes a piece of generated text (with its token's log-probabilities when asked for): stop sequences are
    /// looked for, and text is held back while it could still begin one; once one appears, the text before it
    /// is the answer and generation stops.
    fn take_text(&mut self, piece: &str, logprob: Option<TokenLogprob>) {
        if self.stopped_by_sequence {
            return;
        }
        let offset = self.produced.len();
        self.produced.push_str(piece);
        if let Some(logprob) = logprob {
            self.scored
                .push_back((self.produced.len(), ScoredToken { offset, logprob }));
        }
        if let Some(at) = stop_text::find_stop(&self.produced, self.sent, &self.job.stop) {
            self.produced.truncate(at);
            // Tokens whose text begins before the stop sequence stay (the last one's text cut there).
            self.scored.retain(|(_, t)| t.offset < at);
            for (end, _) in self.scored.iter_mut() {
                *end = (*end).min(at);
            }
            self.stopped_by_sequence = true;
            self.job.cancel.store(true, Ordering::Relaxed);
        }
        let upto = if self.stopped_by_sequence {
            self.produced.len()
        } else {
            stop_text::releasable(&self.produced, &self.job.stop)
        };
        self.send_upto(upto);
    }

    /// Sends everything not yet sent (the request is over, so nothing more can complete a stop sequence).
    fn flush(&mut self) {
        self.send_upto(self.produced.len());
    }

    fn send_upto(&mut self, upto: usize) {
        let scored = self
            .scored
            .iter()
            .take_while(|(end, _)| *end <= upto)
            .count();
        if upto > self.sent || scored > 0 {
            let tokens = self.scored.drain(..scored).map(|(_, t)| t).collect();
            if self
                .job
                .events
                .send(Event::Text(
                    self.produced[self.sent..upto.max(self.sent)].to_string(),
                    tokens,
                ))
                .is_err()
            {
                // The client went away: the request leaves at the next step.
                self.job.cancel.store(true, Ordering::Relaxed);
            }
            self.sent = self.sent.max(upto);
        }
    }

    /// Sends the prompt's log-probabilities once they are all there (the prompt is prefilled).
    fn send_prompt_logprobs(&mut self, generation: &Generation<'_>) {
        if self.prompt_scored || generation.is_prefilling() {
            return;
        }
        self.prompt_scored = true;
        let logprobs = generation.prompt_logprobs().to_vec();
        if self
            .job
            .events
            .send(Event::PromptLogprobs(logprobs))
            .is_err()
        {
            self.job.cancel.store(true, Ordering::Relaxed);
        }
    }
}

struct EngineLoop<'a> {
    model: &'a LoadedModel,
    draft: &'a DraftSetup,
    options: EngineOptions,
    queue: &'a Queue,
    metrics: &'a Metrics,
    profiling: &'a Profiling,
    next_id: std::cell::Cell<u64>,
    budget: std::cell::RefCell<DraftBudget>,
    /// Finished requests' caches (empty unless `options.prefix_cache`), within the KV memory the running
    /// requests leave.
    prefixes: std::cell::RefCell<PrefixCache>,
    /// See [`overlap_enabled`].
    overlap: bool,
    carry: std::cell::RefCell<Carry>,
    payoff: std::cell::RefCell<DraftPayoff>,
}

/// A request taken from the queue, tokenized and checked, waiting for KV memory.
struct Admission {
    job: Job,
    request: GenerateRequest,
    kv_bytes: usize,
    cost: AdmissionCost,
}

/// The engine thread's time to admit a request and to let it go (between steps, where the device waits on it),
/// kept for the profile's request records.
#[derive(Debug, Clone, Copy)]
struct AdmissionCost {
    /// When the engine took it from the queue.
    began: Instant,
    /// Chat template and tokenizer.
    prepare_s: f64,
    /// Its drafter (an EAGLE-3 head's cache, a draft model's state).
    drafter_s: f64,
    /// Its generation (the target's KV cache).
    generation_s: f64,
    /// Taking a cached prefix (copies of keys and values, the drafter's state).
    prefix_s: f64,
}

impl AdmissionCost {
    fn total_s(&self) -> f64 {
        self.prepare_s + self.drafter_s + self.generation_s + self.prefix_s
    }
}

impl<'a> EngineLoop<'a> {
    fn run(self) {
        let mut running: Vec<Running<'a>> = Vec::new();
        // A request that fits the server but not the memory left now: it goes first when memory frees.
        let mut held: Option<Admission> = None;
        let mut kv_reserved = 0usize;
        loop {
            if !self.take_requests(&mut running, &mut held, &mut kv_reserved) {
                return;
            }
            self.metrics.running.set(running.len() as i64);
            self.metrics
                .kv_usage
                .set(kv_reserved as f64 / self.options.kv_memory.max(1) as f64);
            if running.is_empty() {
                continue;
            }
            let now = Instant::now();
            for r in running.iter_mut() {
                if r.deadline.is_some_and(|d| now >= d) && !r.generation.is_done() {
                    r.timed_out = true;
                    r.out.job.cancel.store(true, Ordering::Relaxed);
                }
            }
            let prefilling: Vec<bool> = running
                .iter()
                .map(|r| r.generation.is_prefilling())
                .collect();
            // A panic inside a step (a bug, never a client's input) must not take the engine down: the requests
            // of that step end with an error, the others in the queue go on.
            let outcomes =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step(&mut running)))
                    .unwrap_or_else(|_| {
                        running
                            .iter()
                            .map(|_| {
                                Err(specula::error::Error::InvalidArgument(
                            "internal error: the engine step panicked; its requests were ended"
                                .into(),
                        ))
                            })
                            .collect()
                    });
            self.keep_new_prompts(&running, &prefilling, kv_reserved);
            if running
                .iter()
                .zip(&outcomes)
                .all(|(r, outcome)| outcome.is_err() || r.generation.is_done())
            {
                // Every request leaves: no next step hides this one's bookkeeping, so it is done now, before
                // their answers go out (a client reading /metrics after its answer sees its last step), and no
                // plan is kept for requests not seen yet.
                self.settle_carried();
                self.carry.borrow_mut().plan = None;
            }
            // Requests that are done, failed, timed out or cancelled leave now, freeing their slot and memory.
            let mut still = Vec::with_capacity(running.len());
            for (r, outcome) in running.drain(..).zip(outcomes) {
                if outcome.is_ok() && !r.generation.is_done() {
                    still.push(r);
                    continue;
                }
                kv_reserved -= r.kv_bytes;
                self.forget_request(r.id);
                // Gauges first: a client that reads /metrics after its answer sees itself gone.
                self.metrics.running.dec();
                self.metrics
                    .kv_usage
                    .set(kv_reserved as f64 / self.options.kv_memory.max(1) as f64);
                // Its cache may join the prefix cache, in the memory it had reserved (trimmed below).
                self.finish(r, outcome);
            }
            running = still;
            // The prefix cache keeps to the memory running requests leave (finished requests' caches and new
            // prompts joined it this step).
            let mut prefixes = self.prefixes.borrow_mut();
            prefixes.shrink_to(self.options.kv_memory.saturating_sub(kv_reserved));
            self.metrics
                .prefix_cache_usage
                .set(prefixes.bytes() as f64 / self.options.kv_memory.max(1) as f64);
            self.metrics.prefix_cache_entries.set(prefixes.len() as i64);
        }
    }

    /// Requests whose prompt entered the cache this step leave a copy of it in the prefix cache (unless one is
    /// there already), so that requests with the same start arriving while they run reuse it too, not only
    /// those arriving after they finish.
    /// A copy is made only where it fits in the KV memory running requests leave (`kv_reserved` is theirs), less
    /// room the cache gives up for it (least recently used first).
    fn keep_new_prompts(
        &self,
        running: &[Running<'a>],
        was_prefilling: &[bool],
        kv_reserved: usize,
    ) {
        if !self.options.prefix_cache {
            return;
        }
        let free = self.options.kv_memory.saturating_sub(kv_reserved);
        let model = self.model.model.as_ref();
        let mut prefixes = self.prefixes.borrow_mut();
        for (r, _) in running
            .iter()
            .zip(was_prefilling)
            .filter(|(r, &was)| was && !r.generation.is_prefilling())
        {
            let prompt = &r.generation.request().prompt_tokens;
            let bytes = prompt.len() * model.kv_bytes_per_position();
            if prompt.len() < PrefixCache::MIN_POSITIONS
                || bytes > free
                || prefixes.covers(prompt, r.generation.has_drafter())
            {
                continue;
            }
            prefixes.shrink_to(free - bytes);
            if let Some(p) = r.generation.prompt_prefix(model) {
                let held = p.drafter_held_bytes();
                prefixes.insert(p, bytes + held);
            }
        }
    }

    /// Moves queued requests into the batch while there are slots and memory; blocks while there is nothing to
    /// do. Returns false when the server is shutting down and nothing is left.
    fn take_requests(
        &self,
        running: &mut Vec<Running<'a>>,
        held: &mut Option<Admission>,
        kv_reserved: &mut usize,
    ) -> bool {
        loop {
            let job = {
                let Ok(mut q) = self.queue.state.lock() else {
                    return false;
                };
                // Queued requests whose client left, or whose time ran out, go now: no engine time, and the
                // queue gauge falls at once.
                let now = Instant::now();
                let timeout = self.options.request_timeout;
                q.jobs.retain(|j| {
                    if j.cancel.load(Ordering::Relaxed) {
                        return false;
                    }
                    if let Some(t) = timeout.filter(|&t| now.duration_since(j.queued_at) >= t) {
                        let _ = j.events.send(Event::Done(Err(Failure::Timeout(format!(
                            "the request waited {:.1} s in the queue, past the server's request timeout of {:.1} s",
                            now.duration_since(j.queued_at).as_secs_f64(),
                            t.as_secs_f64()
                        )))));
                        return false;
                    }
                    true
                });
                if held
                    .as_ref()
                    .is_some_and(|a| a.job.cancel.load(Ordering::Relaxed))
                {
                    *held = None;
                }
                while running.is_empty() && held.is_none() && q.jobs.is_empty() {
                    if q.closed {
                        return false;
                    }
                    q = match self.queue.ready.wait(q) {
                        Ok(q) => q,
                        Err(_) => return false,
                    };
                }
                self.metrics
                    .queue
                    .set((q.jobs.len() + usize::from(held.is_some())) as i64);
                if running.len() >= self.options.max_batch.max(1) {
                    return true;
                }
                match held.take() {
                    Some(a) => Ok(a),
                    None => match q.jobs.pop_front() {
                        Some(job) => Err(job),
                        None => return true,
                    },
                }
            };
            let admission = match job {
                Ok(a) => a,
                Err(job) => {
                    let began = Instant::now();
                    match self.prepare(job) {
                        Some(mut a) => {
                            a.cost.began = began;
                            a.cost.prepare_s = began.elapsed().as_secs_f64();
                            a
                        }
                        None => continue,
                    }
                }
            };
            // Cached prefixes give way to requests (least recently used first).
            self.prefixes.borrow_mut().shrink_to(
                self.options
                    .kv_memory
                    .saturating_sub(*kv_reserved + admission.kv_bytes),
            );
            if *kv_reserved + admission.kv_bytes > self.options.kv_memory && !running.is_empty() {
                // Waits for running requests to leave; nothing behind it overtakes it (first come, first served).
                *held = Some(admission);
                if let Ok(q) = self.queue.state.lock() {
                    self.metrics.queue.set(q.jobs.len() as i64 + 1);
                }
                return true;
            }
            if let Some(r) = self.start(admission, running.len()) {
                *kv_reserved += r.kv_bytes;
                running.push(r);
            }
        }
    }

    /// Tokenizes and checks a queued request; a request that cannot run is answered now (None).
    fn prepare(&self, mut job: Job) -> Option<Admission> {
        let refuse = |job: &Job, message: String| {
            let _ = job
                .events
                .send(Event::Done(Err(Failure::BadRequest(message))));
        };
        let tokens = match std::mem::replace(&mut job.input, Input::Tokens(Vec::new())) {
            Input::Tokens(t) => Ok(t),
            input => tokenize_input(
                &self.model.tokenizer,
                self.model.chat_template.as_ref(),
                &input,
            ),
        };
        let prompt_tokens = match tokens {
            Ok(t) if t.is_empty() => {
                refuse(&job, "the prompt is empty".into());
                return None;
            }
            Ok(t) => t,
            Err(e) => {
                refuse(&job, e);
                return None;
            }
        };
        let ctx = self.model.model.config().context_length;
        if prompt_tokens.len() + job.max_tokens > ctx {
            refuse(
                &job,
                format!(
                    "the prompt ({} tokens) plus max_tokens ({}) exceeds the model's context of {ctx} tokens",
                    prompt_tokens.len(),
                    job.max_tokens
                ),
            );
            return None;
        }
        // The cache a generation allocates: prompt, new tokens and a verify pass's drafts (decode::Generation).
        let positions = (prompt_tokens.len() + job.max_tokens + self.draft_room() + 1).min(ctx);
        let kv_bytes = positions * self.kv_bytes_per_position();
        if kv_bytes > self.options.kv_memory {
            refuse(
                &job,
                format!(
                    "the request needs {:.1} MiB of KV cache ({positions} positions: {} prompt tokens + max_tokens {}), \
                     more than the server's KV memory of {:.1} MiB (--kv-memory)",
                    kv_bytes as f64 / 1048576.0,
                    prompt_tokens.len(),
                    job.max_tokens,
                    self.options.kv_memory as f64 / 1048576.0
                ),
            );
            return None;
        }
        let request = GenerateRequest {
            prompt_tokens,
            max_new_tokens: job.max_tokens,
            sampling: job.sampling,
            stop_at_eos: !job.ignore_eos,
            cancel: Some(job.cancel.clone()),
            logprobs: job.logprobs,
            logit_adjustments: job.logit_adjustments.clone(),
            stop_token_ids: job.stop_token_ids.clone(),
        };
        Some(Admission {
            job,
            request,
            kv_bytes,
            cost: AdmissionCost {
                began: Instant::now(),
                prepare_s: 0.0,
                drafter_s: 0.0,
                generation_s: 0.0,
                prefix_s: 0.0,
            },
        })
    }

    /// Whether requests' EAGLE-3 chains share the head's passes, or their draft models the draft model's (one
    /// batched pass a round).
    fn passes_are_shared(&self) -> bool {
        matches!(
            self.draft,
            DraftSetup::Eagle3(_, None, _) | DraftSetup::Model(..)
        ) && shared_head_enabled()
    }

    fn draft_room(&self) -> usize {
        match self.draft {
            DraftSetup::None => 0,
            _ => self.options.draft_tokens,
        }
    }

    /// KV bytes a position of a request costs: the target's cache, and a draft model's own.
    fn kv_bytes_per_position(&self) -> usize {
        self.model.model.kv_bytes_per_position()
            + match self.draft {
                DraftSetup::Model(d, _, _) => d.model.kv_bytes_per_position(),
                _ => 0,
            }
    }

    /// A new request's drafter (`positions`: the most positions the request can reach, prompt and answer).
    fn drafter(
        &self,
        seed: u64,
        positions: usize,
    ) -> specula::error::Result<Option<Box<dyn Drafter + 'a>>> {
        let draft: &'a DraftSetup = self.draft;
        Ok(match draft {
            DraftSetup::None => None,
            DraftSetup::Ngram(n) => Some(Box::new(NgramDrafter::for_device(
                n.min_n,
                n.max_n,
                n.min_confidence,
                &self.model.model.device(),
            )?)),
            DraftSetup::Eagle3(head, tree, min_confidence) => {
                use specula::draft::eagle3::Eagle3Drafter;
                let d = Eagle3Drafter::with_capacity(
                    head,
                    self.model.model.as_ref(),
                    seed,
                    Eagle3Drafter::cache_rows_for(positions, *tree),
                )?;
                let d = d.with_min_confidence(*min_confidence)?;
                Some(Box::new(match tree {
                    Some(shape) => d.with_tree(*shape),
                    None => d,
                }))
            }
            DraftSetup::Model(d, vocab_limit, min_confidence) => Some(Box::new(
                ModelDrafter::new(d.model.as_ref(), seed)?
                    .with_min_confidence(*min_confidence)?
                    .with_vocab_limit(*vocab_limit)?
                    .with_catch_up_piece(draft_catch_up_piece(&d.model.device()))?,
            )),
        })
    }

    /// Starts a request: its generation (KV cache, drafter, sampler) joins the batch at the next step. Joining a
    /// batch that then holds `--spec-disable-batch-size` requests or more (itself included, as the step rule counts
    /// it), it gets no drafter: it never drafts, and its target forwards capture nothing for a head, so a batch of
    /// such requests steps at plain decoding's cost. (Counting only the others, every request of a level of
    /// exactly N streams joined beside N - 1 and got a drafter that could never draft in a full batch, while its
    /// forwards captured hidden states for it: 0.94-0.97x plain at 8 streams with a cap of 8 on the H200.)
    fn start(&self, a: Admission, running: usize) -> Option<Running<'a>> {
        let model = self.model.model.as_ref();
        let mut cost = a.cost;
        let positions = a
            .request
            .prompt_tokens
            .len()
            .saturating_add(a.request.max_new_tokens);
        let drafter_start = Instant::now();
        let capped = self
            .options
            .spec_disable_batch_size
            .is_some_and(|n| running + 1 >= n)
            || (self.options.spec_disable_auto
                && self.options.adaptive_drafts
                && !matches!(self.draft, DraftSetup::None)
                && !self.payoff.borrow_mut().admits_drafter(running));
        let drafter = if capped {
            self.metrics.admitted_without_drafter.inc();
            Ok(None)
        } else {
            self.drafter(a.request.sampling.seed, positions)
        };
        let generation_start = Instant::now();
        cost.drafter_s = generation_start.duration_since(drafter_start).as_secs_f64();
        let generation = drafter.and_then(|d| match d {
            Some(d) => Generation::with_drafter(model, a.request, d, self.options.draft_tokens),
            None => Generation::new(model, a.request),
        });
        cost.generation_s = generation_start.elapsed().as_secs_f64();
        self.next_id.set(self.next_id.get() + 1);
        let mut generation = match generation {
            Ok(g) => g,
            Err(e) => {
                let _ = a
                    .job
                    .events
                    .send(Event::Done(Err(Failure::BadRequest(e.to_string()))));
                return None;
            }
        };
        let prefix_start = Instant::now();
        if self.options.prefix_cache {
            // Beside other requests, a drafter that would keep the request from reusing a cached prompt (its
            // state not kept there: the request that left it had no drafter, or a head that never drafted) goes:
            // a prompt's prefill stalls every running stream (a 256-row chunk of the 1.5B ~19 ms on an H100
            // against a 2.7 ms decoding step at 16 streams), and under load a drafter drafts little (session 41:
            // long prompts at 16 streams, the head server prefilled 4% more of them than plain and ran at 0.95-0.97x).
            if running > 0 && generation.has_drafter() && prefix_over_drafter() {
                let (with, without) = self.prefixes.borrow().reaches(&generation);
                if without >= with + PREFIX_OVER_DRAFTER && generation.release_drafter() {
                    self.metrics.prefix_over_drafter.inc();
                }
            }
            // A failed copy leaves the generation as it was: it prefills its whole prompt.
            let reused = self
                .prefixes
                .borrow_mut()
                .adopt_into(&mut generation)
                .unwrap_or(0);
            self.metrics
                .prefix_cache_queries
                .inc_by(generation.request().prompt_tokens.len() as u64);
            self.metrics.prefix_cache_hits.inc_by(reused as u64);
        }
        cost.prefix_s = prefix_start.elapsed().as_secs_f64();
        let prompt_scored = !generation.request().logprobs.is_some_and(|l| l.prompt);
        let _ = a.job.events.send(Event::Started {
            prompt_tokens: generation.request().prompt_tokens.len(),
        });
        Some(Running {
            id: self.next_id.get(),
            deadline: self.options.request_timeout.map(|t| a.job.queued_at + t),
            generation,
            out: Output {
                job: a.job,
                produced: String::new(),
                sent: 0,
                stopped_by_sequence: false,
                scored: VecDeque::new(),
                prompt_scored,
            },
            kv_bytes: a.kv_bytes,
            admitted: Instant::now(),
            admission: cost,
            timed_out: false,
            last_token_at: None,
            phase_seconds: [0.0; Phase::ALL.len()],
            steps: 0,
            idle_steps: 0,
        })
    }

    /// One engine step over every running request; returns each one's outcome.
    fn step(&self, running: &mut [Running<'a>]) -> Vec<specula::error::Result<()>> {
        // A profiler per step (phases, by the model's clock: device time on a GPU) feeds the step histograms;
        // during a profiling session its trace is kept too. Nothing accumulates between steps.
        let prof = Profiler::with_clock(
            specula::profile::Detail::Phases,
            self.model.model.clock(false),
        );
        let step_start = Instant::now();
        let before: Vec<usize> = running
            .iter()
            .map(|r| r.generation.generated().len())
            .collect();
        let took_part: Vec<bool> = running.iter().map(|r| !r.generation.is_done()).collect();
        // Tokens each drafter must catch up on before drafting (a draft model cut in earlier steps).
        let lags: Vec<usize> = running.iter().map(|r| r.generation.draft_lag()).collect();
        let prices = self.budget.borrow().costs();
        let plan_start = Instant::now();
        let planned = self.carry.borrow_mut().plan.take();
        let LimitChoice {
            limits,
            expected,
            refused,
            baseline_probe,
        } = match planned {
            Some(p) => self.apply_planned(running, p),
            None => self.choose_draft_limits(running, &lags),
        };
        let plan_s = plan_start.elapsed().as_secs_f64();
        self.release_idle_drafters(running, &limits, baseline_probe);
        let spec_before: Vec<SpecCounts> = running
            .iter()
            .map(|r| SpecCounts::of(&r.generation).unwrap_or_default())
            .collect();
        // The next step's plan is made while this step's forward pass runs, from the requests as they are now
        // (one step old when it applies; what changed is settled when it applies: see `apply_planned`).
        let next_input = (self.overlap && self.options.adaptive_drafts)
            .then(|| self.plan_input(running, &lags))
            .filter(|input| !input.candidates.is_empty());
        let mut hook_s = 0.0;
        let mut texts: Vec<(usize, String)> = Vec::new();
        let captures_before = self.head_graphs_captured();
        let decode_start = Instant::now();
        let (results, report) = {
            let mut batch: Vec<&mut Generation<'a>> =
                running.iter_mut().map(|r| &mut r.generation).collect();
            // Host work that needs no generation: the last step's bookkeeping and the next step's plan, while
            // the device runs this step's forward pass.
            let mut during_forward = || {
                if !self.overlap {
                    return;
                }
                let start = Instant::now();
                self.settle_carried();
                let plan = next_input.as_ref().map(|input| self.plan(input));
                self.carry.borrow_mut().plan = plan;
                hook_s = start.elapsed().as_secs_f64();
            };
            let model_rounds = match self.draft {
                DraftSetup::Model(d, vocab_limit, _) => Some(DraftModelRounds {
                    model: d.model.as_ref(),
                    vocab_limit: *vocab_limit,
                }),
                _ => None,
            };
            decode::step_with(
                self.model.model.as_ref(),
                &self.model.tokenizer,
                &mut batch,
                StepLimits {
                    prefill_tokens: self.options.prefill_chunk,
                    // EAGLE-3 chains share the head, and draft models their model: one batched pass per round
                    // for every request (`SPECULA_SHARED_HEAD=0` drafts one request after the other, to
                    // compare).
                    shared_head: match (self.draft, &model_rounds) {
                        (DraftSetup::Eagle3(head, None, _), _) if self.passes_are_shared() => {
                            Some(head.compute())
                        }
                        (_, Some(rounds)) if self.passes_are_shared() => {
                            Some(rounds as &dyn HeadCompute)
                        }
                        _ => None,
                    },
                },
                &prof,
                &mut |i, t| texts.push((i, t.to_string())),
                &mut during_forward,
            )
        };
        let now = Instant::now();
        let decode_s = now.duration_since(decode_start).as_secs_f64();
        for r in running.iter_mut() {
            r.out.send_prompt_logprobs(&r.generation);
        }
        // One text per committed token, in order: the k-th of a request's this step is token before + k.
        let mut seen = vec![0usize; running.len()];
        for (i, t) in texts {
            let r = &mut running[i];
            let logprob = r
                .generation
                .token_logprobs()
                .get(before[i] + seen[i])
                .cloned();
            seen[i] += 1;
            r.out.take_text(&t, logprob);
        }
        // Latency per token: a step that commits n tokens of a request (speculation) is n inter-token gaps.
        for (r, &b) in running.iter_mut().zip(&before) {
            let n = r.generation.generated().len() - b;
            if n == 0 {
                continue;
            }
            match r.last_token_at {
                None => {
                    self.metrics
                        .ttft
                        .observe(now.duration_since(r.out.job.queued_at).as_secs_f64());
                    let gap = now.duration_since(step_start).as_secs_f64() / n as f64;
                    for _ in 1..n {
                        self.metrics.itl.observe(gap);
                    }
                }
                Some(t) => {
                    let gap = now.duration_since(t).as_secs_f64() / n as f64;
                    for _ in 0..n {
                        self.metrics.itl.observe(gap);
                    }
                }
            }
            r.last_token_at = Some(now);
        }
        let phases = prof.step_phases();
        let host_phases = prof.step_phases_host();
        // The hook's host time is not the step's: on a GPU it ran beside the forward pass.
        let costs = phases.first().map(|s| {
            let mut c = step_costs(s, host_phases.as_ref().and_then(|h| h.first()));
            c.other = (c.other - hook_s).max(0.0);
            c
        });
        for (r, _) in running.iter_mut().zip(&took_part).filter(|(_, &t)| t) {
            r.steps += 1;
            for step in &phases {
                for &(phase, secs) in &step.phases {
                    r.phase_seconds[phase as usize] += secs;
                }
            }
        }
        // What each drafting request's cycle did, for the budget.
        let cycles: Vec<RequestCycle> = running
            .iter()
            .zip(&limits)
            .zip(&spec_before)
            .zip(&lags)
            .filter_map(|(((r, limit), before), &lag)| {
                let (Some(limit), Some(now)) = (limit, SpecCounts::of(&r.generation)) else {
                    return None;
                };
                Some(RequestCycle {
                    id: r.id,
                    limit: *limit,
                    counts: now.since(before),
                    lag_before: lag,
                    lag_after: r.generation.draft_lag(),
                    draft_room: r.generation.draft_room(),
                })
            })
            .collect();
        let drafts_allowed: usize = limits.iter().flatten().sum();
        let committed: usize = running
            .iter()
            .zip(&before)
            .map(|(r, &b)| r.generation.generated().len() - b)
            .sum();
        let aftermath = Aftermath {
            prof,
            step_start,
            wall_s: step_start.elapsed().as_secs_f64(),
            report,
            phases,
            costs,
            cycles,
            captured: self.head_graphs_captured() != captures_before,
            decision: StepDecision {
                drafts_allowed,
                expected,
                committed,
                refused,
                baseline_probe,
                prices,
                host_plan_s: plan_s,
                host_decode_s: decode_s,
                host_overlapped_s: hook_s,
            },
        };
        let mut carry = self.carry.borrow_mut();
        carry.aftermath = Some(aftermath);
        if !self.overlap {
            drop(carry);
            self.settle_carried();
        }
        results
    }

    /// Takes their drafters from requests that were allowed no draft in [`RELEASE_IDLE_DRAFTER_AFTER`] decoding
    /// steps in a row beside other requests, at a count of requests where drafters were mostly idle lately
    /// ([`DraftPayoff::mostly_idle`]), and where an idle drafter costs every step (an EAGLE-3 head: each
    /// target pass captures hidden states for it and feeds them): a batch whose drafters are all gone steps at
    /// plain decoding's cost. On an H200 at 8-16 streams the budget allowed no draft in 92% of such requests'
    /// steps, yet every step captured and fed (session 36: 0.93-0.96x plain). Steps that prefill a prompt and
    /// the budget's baseline probes (undrafted on purpose) neither count nor reset a request's run. The step's
    /// share of drafting requests allowed a draft is also what the automatic cap admits by
    /// ([`DraftPayoff::observe_allowance`]).
    fn release_idle_drafters(
        &self,
        running: &mut [Running<'a>],
        limits: &[Option<usize>],
        baseline_probe: bool,
    ) {
        let decoding = running
            .iter()
            .filter(|r| !r.generation.is_done() && !r.generation.is_prefilling())
            .count();
        let prefilling = running
            .iter()
            .any(|r| !r.generation.is_done() && r.generation.is_prefilling());
        let candidates = limits.iter().flatten().count();
        if baseline_probe || prefilling || decoding < 2 || candidates == 0 {
            return;
        }
        let release_after = {
            let payoff = self.payoff.borrow();
            if !payoff.idle_rule {
                return;
            }
            payoff.release_after
        };
        let allowed = limits.iter().flatten().filter(|&&k| k > 0).count();
        let mostly_idle = {
            let mut payoff = self.payoff.borrow_mut();
            payoff.observe_allowance(decoding, allowed as f64 / candidates as f64);
            payoff.mostly_idle(decoding) == Some(true)
        };
        for (r, limit) in running.iter_mut().zip(limits) {
            match limit {
                Some(0) => r.idle_steps += 1,
                Some(_) => r.idle_steps = 0,
                None => continue,
            }
            // Only where the budget has mostly refused drafts at this count lately: where it drafts in a good
            // share of steps (2-4 streams on 2 CPU cores), a run of refusals ends and the drafter drafts again
            // (released on their runs alone, a head server there ran 3-7% under one keeping its drafters).
            if mostly_idle
                && r.idle_steps >= release_after
                && r.generation.drafter_costs_idle_steps()
                && r.generation.release_drafter()
            {
                // The budget forgets it when it leaves, as every request.
                self.metrics.released_drafters.inc();
            }
        }
    }

    /// Graphs the EAGLE-3 head has captured so far (0 without a head, or on the CPU).
    fn head_graphs_captured(&self) -> u64 {
        match self.draft {
            DraftSetup::Eagle3(head, _, _) => head.compute().graphs_captured(),
            _ => 0,
        }
    }

    /// The last step's bookkeeping, if not done yet (metrics, the draft budget's observations, the profile), and
    /// the budget forgets requests that left since.
    fn settle_carried(&self) {
        let (aftermath, left) = {
            let mut carry = self.carry.borrow_mut();
            (carry.aftermath.take(), std::mem::take(&mut carry.left))
        };
        if let Some(a) = aftermath {
            self.settle_step(a);
        }
        let mut budget = self.budget.borrow_mut();
        for id in left {
            budget.remove(id);
        }
    }

    /// A request left: the budget forgets it once the bookkeeping that still names it is done.
    fn forget_request(&self, id: u64) {
        let mut carry = self.carry.borrow_mut();
        if carry.aftermath.is_some() {
            carry.left.push(id);
        } else {
            drop(carry);
            self.budget.borrow_mut().remove(id);
        }
    }

    fn settle_step(&self, a: Aftermath) {
        let Aftermath {
            prof,
            step_start,
            wall_s,
            report,
            phases,
            costs,
            cycles,
            decision,
            captured,
        } = a;
        self.metrics.observe_steps(&phases);
        if captured {
            self.metrics
                .head_graph_captures
                .set(self.head_graphs_captured() as i64);
        }
        // A step whose head captured a graph (a pass shape seen for the first time: a capture costs several
        // passes) prices no drafting: such steps priced a head's catch-up at ~0.02 ms a row on an H200 where the
        // pass itself adds a few microseconds, and a head cut once beside other requests never resumed.
        let costs = costs.map(|c| {
            if captured {
                StepCosts {
                    draft: f64::NAN,
                    ..c
                }
            } else {
                c
            }
        });
        self.observe_for_budget(&cycles, costs, report);
        // What drafting paid at this many requests (decoding steps only; a graph capture is not a step's cost).
        if report.prefill_rows == 0 && !captured {
            self.payoff.borrow_mut().observe(
                report.sequences,
                decision.drafts_allowed > 0,
                decision.committed,
                wall_s,
            );
        }
        if report.sequences > 0 {
            self.metrics.batch_size.observe(report.sequences as f64);
            self.metrics.step_rows.observe(report.rows as f64);
        }
        // How the step turned out against the budget's expectation (decoding steps only: a prompt chunk's first
        // token and its rows are priced roughly), so the budget can tell whether its drafted steps keep their
        // time as well as its undrafted ones.
        // A drafter that fed only a piece of its catch-up ran a different step from the plan's, which held the
        // catch-up whole.
        let fed_a_piece = cycles.iter().any(|c| c.counts.catch_up_cycles > 0);
        if let (Some((expected_s, _)), 0, false) = (
            decision.expected,
            report.prefill_rows,
            fed_a_piece || captured,
        ) {
            self.budget.borrow_mut().observe_outcome(
                decision.drafts_allowed > 0,
                expected_s,
                wall_s,
            );
            self.metrics
                .outcome_calibration
                .set(self.budget.borrow().outcome_calibration());
        }
        self.record_step(&prof, step_start, wall_s, report, decision, captured);
    }

    /// What the draft budget's plan reads of the running requests: each decoding request with a drafter, and
    /// the rows the step has without drafts.
    fn plan_input(&self, running: &[Running<'a>], lags: &[usize]) -> PlanInput {
        let decoding = running
            .iter()
            .filter(|r| !r.generation.is_done() && !r.generation.is_prefilling())
            .count();
        let prompt_left: usize = running
            .iter()
            .filter(|r| r.generation.is_prefilling() && !r.generation.is_done())
            .map(|r| r.generation.prompt_left())
            .sum();
        let mut input = PlanInput {
            candidates: Vec::new(),
            base_rows: decoding + prompt_left.min(self.options.prefill_chunk),
            decoding,
        };
        let alone = decoding == 1 && prompt_left == 0;
        for (i, r) in running.iter().enumerate().filter(|(_, r)| r.is_drafting()) {
            let drafted_yet = r.generation.speculation().is_some_and(|s| s.drafted > 0);
            input.candidates.push(DraftCandidate {
                id: r.id,
                max_tokens: r.generation.draft_room(),
                lag: lags[i],
                shared_by: catch_up_shared_by(drafted_yet, r.generation.tokens_left(), alone),
                cheap_catch_up: r.generation.draft_catch_up_is_cheap(),
                catch_up_reach: r.generation.draft_catch_up_reach(),
            });
        }
        input
    }

    /// The draft budget's plan for `input`'s candidates (their configured length without adaptive drafts).
    fn plan(&self, input: &PlanInput) -> PlannedLimits {
        let mut planned = PlannedLimits {
            ids: input.candidates.iter().map(|c| c.id).collect(),
            limits: Vec::new(),
            expected: None,
            refused: None,
            baseline_probe: false,
        };
        if self
            .options
            .spec_disable_batch_size
            .is_some_and(|n| input.decoding >= n)
        {
            planned.limits = vec![0; input.candidates.len()];
        } else if self.options.adaptive_drafts {
            let plan =
                self.budget
                    .borrow()
                    .plan(&input.candidates, input.base_rows, input.decoding);
            planned.expected = plan.expected_s.map(|s| (s, plan.expected_tokens));
            planned.refused = plan.refused;
            planned.baseline_probe = plan.baseline_probe;
            planned.limits = plan.limits;
            // Where drafted steps measured no gain at this many requests, nobody drafts (the budget prices a
            // draft's rows, not all it costs a step), but for a probe now and then that keeps the verdict fresh.
            if !plan.baseline_probe
                && planned.limits.iter().any(|&k| k > 0)
                && self.payoff.borrow_mut().refuses_drafts(input.decoding)
            {
                planned.limits = vec![0; input.candidates.len()];
                planned.expected = None;
                planned.refused = None;
                self.metrics.payoff_refused_steps.inc();
            }
        } else {
            planned.limits = input.candidates.iter().map(|c| c.max_tokens).collect();
        }
        planned
    }

    /// Each decoding request's draft length for the next step (None where it is not drafting: prefilling, done,
    /// no drafter). With adaptive drafts, from the draft budget; else the configured length.
    /// Also returns the budget's expectation of the step (seconds, tokens), when it has one, and where its cost
    /// rule stopped.
    fn choose_draft_limits(&self, running: &mut [Running<'a>], lags: &[usize]) -> LimitChoice {
        let input = self.plan_input(running, lags);
        if input.candidates.is_empty() {
            return LimitChoice {
                limits: vec![None; running.len()],
                expected: None,
                refused: None,
                baseline_probe: false,
            };
        }
        let planned = self.plan(&input);
        self.apply_planned(running, planned)
    }

    /// Sets the limits of a plan made from the requests as they were then (this step's, or during the last
    /// step's forward pass). A request drafting now that the plan did not see (its prompt finished since)
    /// drafts nothing this step; requests that left are gone; lengths stay within each request's room (the
    /// generation caps them). The expectation holds only when the plan saw exactly the drafting requests.
    fn apply_planned(&self, running: &mut [Running<'a>], planned: PlannedLimits) -> LimitChoice {
        let mut limits: Vec<Option<usize>> = vec![None; running.len()];
        let mut seen = 0;
        let mut cut_to_room = false;
        for (i, r) in running.iter_mut().enumerate() {
            if !r.is_drafting() {
                continue;
            }
            let k = match planned.ids.iter().position(|&id| id == r.id) {
                Some(at) => {
                    seen += 1;
                    let room = r.generation.draft_room();
                    cut_to_room |= planned.limits[at] > room;
                    planned.limits[at].min(room)
                }
                None => 0,
            };
            r.generation.set_draft_limit(k);
            self.metrics.draft_limit.observe(k as f64);
            limits[i] = Some(k);
        }
        if self.options.adaptive_drafts {
            let mut budget = self.budget.borrow_mut();
            for (r, k) in running.iter().zip(&limits) {
                if let Some(k) = k {
                    budget.note_allowed(r.id, *k);
                }
            }
        }
        // The plan's expected time is this step's only if it runs as planned: a limit cut to the room a request
        // has left (its last tokens) runs a different step. Kept, a drafted plan cut to zero at every request's
        // end was counted as an undrafted step expected to take a drafted one's time, which pulled the outcome
        // calibration to 0.88 and cut drafting at one stream (the budget's replay of the real pair on the H200's
        // costs: 969 -> 979 tok/s on coding requests, 897 -> 913 on chat, where the best fixed lengths give
        // 1005 and 918).
        let exact =
            seen == planned.ids.len() && seen == limits.iter().flatten().count() && !cut_to_room;
        LimitChoice {
            limits,
            expected: planned.expected.filter(|_| exact),
            refused: planned.refused,
            baseline_probe: planned.baseline_probe,
        }
    }

    /// Feeds the draft budget what a step measured: the forward pass's time for its rows, the drafters' time,
    /// and each drafting request's cycle.
    fn observe_for_budget(
        &self,
        cycles: &[RequestCycle],
        costs: Option<StepCosts>,
        report: decode::StepReport,
    ) {
        let Some(StepCosts {
            forward,
            draft,
            other,
        }) = costs
        else {
            let mut budget = self.budget.borrow_mut();
            for c in cycles {
                budget.skip_cycle(c.id);
            }
            return;
        };
        let mut budget = self.budget.borrow_mut();
        // Drafted tokens (each draft first feeds the last step's tokens: part of the per-token cost) and the
        // tokens a drafter fed beyond those (the prompt, or what it missed while cut, as DraftBudget::choose
        // counts them): the budget prices the two apart.
        let mut drafted_total = 0;
        let mut passes = 0;
        let mut longest = 0;
        let mut catch_up = 0;
        for c in cycles {
            let d = &c.counts;
            drafted_total += d.drafted as usize;
            passes += d.draft_passes as usize;
            longest = longest.max(d.draft_passes as usize);
            let (fed, cycle) = cycle_evidence(c.limit, d, c.lag_before, c.lag_after, c.draft_room);
            catch_up += fed;
            match cycle {
                Some((limit, drafted, accepted)) => {
                    budget.observe_cycle(c.id, limit, drafted, accepted)
                }
                None => budget.skip_cycle(c.id),
            }
        }
        if report.rows > 0 && catch_up == 0 && passes > 0 {
            // Chains sharing the head run in rounds (one batched pass each, as many as the longest chain has
            // passes); other drafters run one pass at a time.
            let rounds = if self.passes_are_shared() {
                longest
            } else {
                passes
            };
            budget.observe_rounds(rounds, passes, draft);
        }
        if report.rows > 0 {
            budget.observe_step(
                report.rows,
                forward,
                drafted_total,
                passes,
                catch_up,
                draft,
                other,
            );
            let (draft_token, draft_pass, catch_up_token, overhead) = budget.costs();
            for (name, value) in [
                ("draft_token", draft_token),
                ("draft_pass", draft_pass),
                ("catch_up_token", catch_up_token),
                ("step_overhead", overhead),
            ] {
                if let Some(v) = value {
                    self.metrics.draft_costs.with_label_values(&[name]).set(v);
                }
            }
        }
    }

    /// During a profiling session, keeps the step's trace events (on the session's time axis) and a counter of
    /// the batch's size.
    fn record_step(
        &self,
        prof: &Profiler,
        step_start: Instant,
        wall_s: f64,
        report: decode::StepReport,
        decision: StepDecision,
        captured: bool,
    ) {
        let Ok(mut guard) = self.profiling.lock() else {
            return;
        };
        let Some(session) = guard.as_mut() else {
            return;
        };
        let offset_us = step_start
            .saturating_duration_since(session.started)
            .as_secs_f64()
            * 1e6;
        let trace = prof.chrome_trace();
        let step_index = session.steps;
        session.steps += 1;
        let mut events: Vec<serde_json::Value> = trace["traceEvents"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["ph"] != "M")
            .cloned()
            .map(|mut e| {
                if let Some(ts) = e["ts"].as_f64() {
                    e["ts"] = serde_json::json!(ts + offset_us);
                }
                if e["args"]["step"].is_number() {
                    e["args"]["step"] = serde_json::json!(step_index);
                }
                e
            })
            .collect();
        // The draft phase by the host's clock beside its device time (the spans above): on a GPU, a draft phase
        // much longer on the device than its kernels is host-bound (the device waits on launches and reads).
        let draft_host_ms = prof
            .step_phases_host()
            .and_then(|steps| steps.into_iter().next())
            .map(|step| {
                step.phases
                    .iter()
                    .filter(|(p, _)| *p == specula::profile::Phase::Draft)
                    .map(|(_, s)| s * 1e3)
                    .sum::<f64>()
            });
        events.push(serde_json::json!({
            "name": "batch", "ph": "C", "pid": 1, "ts": offset_us,
            "args": {"requests": report.sequences, "rows": report.rows, "prefill_rows": report.prefill_rows,
                     "drafts_allowed": decision.drafts_allowed, "draft_rounds": report.draft_rounds,
                     "draft_rows": report.draft_rows, "head_captures": captured as u8,
                     "draft_host_ms": draft_host_ms},
        }));
        // What the draft budget expected of the step beside what it did (its wall time, by the host's clock,
        // and the tokens it committed), so a profile shows where the cost model is wrong.
        let mut args = serde_json::json!({
            "wall_ms": wall_s * 1e3,
            "plan_ms": decision.host_plan_s * 1e3,
            "decode_ms": decision.host_decode_s * 1e3,
            "overlapped_ms": decision.host_overlapped_s * 1e3,
            "tokens": decision.committed,
        });
        if let Some((s, tokens)) = decision.expected {
            args["expected_ms"] = serde_json::json!(s * 1e3);
            args["expected_tokens"] = serde_json::json!(tokens);
        }
        if decision.baseline_probe {
            args["baseline_probe"] = serde_json::json!(true);
        }
        events.push(serde_json::json!({
            "name": "draft budget", "ph": "C", "pid": 1, "ts": offset_us, "args": args,
        }));
        // Why the budget stopped adding drafts this step, with the prices it used (ms).
        if let Some(r) = decision.refused {
            let ms = |v: Option<f64>| v.map(|s| s * 1e3);
            let (per_token, per_pass, per_catch_up, overhead) = decision.prices;
            events.push(serde_json::json!({
                "name": "draft refused", "ph": "i", "s": "g", "pid": 1, "ts": offset_us,
                "args": {
                    "position": r.position, "gain": r.gain, "rows": r.rows, "cost_ms": r.cost_s * 1e3,
                    "tokens_per_s": r.tokens_per_s, "tokens_per_s_with": r.tokens_per_s_with,
                    "draft_token_ms": ms(per_token), "draft_pass_ms": ms(per_pass),
                    "catch_up_token_ms": ms(per_catch_up), "step_overhead_ms": ms(overhead),
                    "catch_up_tokens": r.catch_up_tokens, "shared_by": r.shared_by,
                    "calibration": r.calibration,
                },
            }));
        }
        if session.events.len() + events.len() > ProfileSession::MAX_EVENTS {
            session.dropped_events += events.len();
        } else {
            session.events.extend(events);
        }
    }

    /// A request leaves the batch: the rest of its text, then its usage (or why it failed), and the metrics.
    fn finish(&self, r: Running<'a>, outcome: specula::error::Result<()>) {
        let Running {
            generation,
            mut out,
            admitted,
            timed_out,
            phase_seconds,
            steps,
            kv_bytes,
            admission,
            ..
        } = r;
        let leave_start = Instant::now();
        let failure = match outcome {
            Err(e) => Some(Failure::Internal(e.to_string())),
            Ok(()) if timed_out => Some(Failure::Timeout(format!(
                "the request ran past the server's request timeout of {:.1} s",
                self.options
                    .request_timeout
                    .unwrap_or_default()
                    .as_secs_f64()
            ))),
            Ok(()) => None,
        };
        if let Some(f) = failure {
            let _ = out.job.events.send(Event::Done(Err(f)));
            return;
        }
        let result = generation
            .finish_keeping_prefix(&self.model.tokenizer, &mut |t| out.take_text(t, None));
        let done = match result {
            Err(e) => Err(Failure::Internal(e.to_string())),
            Ok((g, prefix)) => {
                if let Some(p) = prefix.filter(|_| self.options.prefix_cache) {
                    let bytes = kv_bytes + p.drafter_held_bytes();
                    self.prefixes.borrow_mut().insert(p, bytes);
                }
                let leave_s = leave_start.elapsed().as_secs_f64();
                out.flush();
                let finish_reason = match g.stop_reason {
                    StopReason::MaxTokens | StopReason::ContextFull => "length",
                    StopReason::EndOfText
                    | StopReason::StopToken
                    | StopReason::Cancelled
                    | StopReason::StopSequence => "stop",
                };
                // A cancelled generation that no stop sequence ended was left by its client.
                let aborted = g.stop_reason == StopReason::Cancelled && !out.stopped_by_sequence;
                self.metrics
                    .finished
                    .with_label_values(&[if aborted { "abort" } else { finish_reason }])
                    .inc();
                let queued_at = out.job.queued_at;
                let spec = g.speculation.as_ref();
                self.metrics.e2e.observe(queued_at.elapsed().as_secs_f64());
                self.metrics.prompt_tokens.inc_by(g.prompt_tokens as u64);
                self.metrics.generation_tokens.inc_by(g.tokens.len() as u64);
                if let Some(st) = spec {
                    self.metrics.num_drafts.inc_by(st.cycles - st.empty_drafts);
                    self.metrics.num_draft_tokens.inc_by(st.drafted);
                    self.metrics.num_accepted_tokens.inc_by(st.accepted);
                    for (i, &a) in st.accepted_per_position.iter().enumerate() {
                        self.metrics
                            .accepted_per_pos
                            .with_label_values(&[&(i + 1).to_string()])
                            .inc_by(a);
                    }
                }
                let finished = Finished {
                    prompt_tokens: g.prompt_tokens,
                    cached_prompt_tokens: g.cached_prompt_tokens,
                    completion_tokens: g.tokens.len(),
                    finish_reason,
                    drafted: spec.map_or(0, |s| s.drafted),
                    accepted: spec.map_or(0, |s| s.accepted),
                    cycles: spec.map_or(0, |s| s.cycles),
                    queue_s: admitted.saturating_duration_since(queued_at).as_secs_f64(),
                    prefill_s: g.timing.prefill_s,
                    decode_s: g.timing.decode_s,
                };
                self.record_request(
                    &finished,
                    RequestTimes {
                        queued_at,
                        admitted,
                        admission,
                        leave_start,
                        leave_s,
                    },
                    spec,
                    &phase_seconds,
                    steps,
                );
                Ok(finished)
            }
        };
        let _ = out.job.events.send(Event::Done(done));
    }

    /// During a profiling session, keeps a finished request's record: its usage and when it ran.
    fn record_request(
        &self,
        f: &Finished,
        times: RequestTimes,
        spec: Option<&specula::decode::SpeculationStats>,
        phase_seconds: &[f64; Phase::ALL.len()],
        steps: usize,
    ) {
        let Ok(mut guard) = self.profiling.lock() else {
            return;
        };
        let Some(session) = guard.as_mut() else {
            return;
        };
        let since = |t: Instant| t.saturating_duration_since(session.started).as_secs_f64();
        let mut record = serde_json::to_value(f).unwrap_or_default();
        let RequestTimes {
            queued_at,
            admitted,
            admission: a,
            leave_start,
            leave_s,
        } = times;
        record["queued_s"] = serde_json::json!(since(queued_at));
        record["admitted_s"] = serde_json::json!(since(admitted));
        record["finished_s"] = serde_json::json!(since(Instant::now()));
        // The engine thread's own time on it between steps: admitting it, and letting it go (its text, its
        // prefix kept for later prompts).
        record["engine_host"] = serde_json::json!({
            "admit_started_s": since(a.began),
            "admit_s": a.total_s(),
            "prepare_s": a.prepare_s,
            "drafter_s": a.drafter_s,
            "generation_s": a.generation_s,
            "prefix_s": a.prefix_s,
            "leave_started_s": since(leave_start),
            "leave_s": leave_s,
        });
        record["speculation"] = spec.map_or(serde_json::Value::Null, |s| s.to_json());
        record["steps"] = serde_json::json!(steps);
        record["phases"] = Phase::ALL
            .iter()
            .map(|p| {
                (
                    p.name().to_string(),
                    serde_json::json!(phase_seconds[*p as usize]),
                )
            })
            .collect::<serde_json::Map<_, _>>()
            .into();
        session.requests.push(record);
    }
}

/// What drafting has paid lately at each count of requests in a step: tokens and seconds of recent decoding steps
/// that drafted and of those that did not, decaying. The automatic cap reads it at admission: where drafted steps
/// made no more tokens a second than undrafted ones, a new request would only cost each step its captured
/// features and its drafter's bookkeeping (~2% of a 16-request step on an H200 with the 1.5B's head, session 33),
/// so it gets no drafter; every [`Self::PROBE_EVERY`]-th still does, and one kind's evidence fades while only the
/// other is seen, so a capped load is measured again now and then.
pub struct DraftPayoff {
    /// Index: requests in the step; [undrafted, drafted]: decayed (tokens, seconds, steps).
    by_requests: Vec<[(f64, f64, f64); 2]>,
    /// Index: decoding requests in the step; decayed (share of its drafting requests allowed a draft, steps).
    allowed_by_requests: Vec<(f64, f64)>,
    capped_admissions: u64,
    /// Whether a count short of evidence is judged from its neighbours ([`Self::judged`]);
    /// `SPECULA_AUTO_CAP_NEIGHBOURS=0` judges each count on its own evidence only (session 33's rule), to compare.
    from_neighbours: bool,
    /// Whether idle drafters are released and mostly idle counts capped (`SPECULA_IDLE_DRAFTERS=keep` keeps
    /// them, as until session 37, to compare).
    pub idle_rule: bool,
    /// [`RELEASE_IDLE_DRAFTER_AFTER`], or `SPECULA_RELEASE_IDLE_AFTER=N` to compare others.
    pub release_after: u32,
    /// Whether a count judged not to pay drafts nothing ([`Self::refuses_drafts`]; `SPECULA_PAYOFF_STOPS_DRAFTS=0`
    /// lets the budget draft there anyway, as until session 51, to compare).
    stops_drafts: bool,
    refused_steps: u64,
}

impl Default for DraftPayoff {
    fn default() -> Self {
        DraftPayoff {
            by_requests: Vec::new(),
            allowed_by_requests: Vec::new(),
            capped_admissions: 0,
            from_neighbours: std::env::var("SPECULA_AUTO_CAP_NEIGHBOURS")
                .map_or(true, |v| v != "0"),
            idle_rule: std::env::var("SPECULA_IDLE_DRAFTERS").map_or(true, |v| v != "keep"),
            release_after: std::env::var("SPECULA_RELEASE_IDLE_AFTER")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&n| n > 0)
                .unwrap_or(RELEASE_IDLE_DRAFTER_AFTER),
            stops_drafts: std::env::var("SPECULA_PAYOFF_STOPS_DRAFTS").map_or(true, |v| v != "0"),
            refused_steps: 0,
        }
    }
}

impl DraftPayoff {
    /// Weight a step of the same kind keeps per new one (~50 steps of each kind remembered).
    const KEPT: f64 = 0.98;
    /// Weight the other kind keeps per new step: after ~600 steps of one kind the other no longer counts.
    const OTHER_KEPT: f64 = 0.998;
    /// Remembered steps of each kind before it judges.
    const MIN_STEPS: f64 = 16.0;
    /// Remembered steps of each kind before a count's gain counts toward a neighbour's judgment.
    const NEIGHBOUR_MIN_STEPS: f64 = 2.0;
    /// Drafted steps must beat undrafted ones by this much: a request with a drafter costs steps that do not
    /// draft too.
    const MARGIN: f64 = 0.02;
    pub const PROBE_EVERY: u64 = 8;
    /// Steps at a count judged not to pay that still draft ([`Self::refuses_drafts`]): one in this many, few
    /// enough to cost under half a percent where drafting loses a tenth, and far enough apart that idle drafters
    /// are released in between ([`RELEASE_IDLE_DRAFTER_AFTER`]). The drafted evidence they add ages between them,
    /// so a verdict lapses now and then and the count is judged afresh from new drafted steps.
    pub const PROBE_STEPS_EVERY: u64 = 32;
    /// Below this share of their steps allowed a draft, drafters at a count are judged mostly idle: what the
    /// few drafted steps gain (a third more tokens for a step that costs a little more, at best, under load) no
    /// longer covers what an idle head costs each step (a few percent: its captures and feeds).
    const IDLE_SHARE: f64 = 0.25;

    pub fn observe(&mut self, requests: usize, drafted: bool, tokens: usize, seconds: f64) {
        if requests == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        if self.by_requests.len() <= requests {
            self.by_requests.resize(requests + 1, Default::default());
        }
        let kinds = &mut self.by_requests[requests];
        let other = &mut kinds[usize::from(!drafted)];
        other.0 *= Self::OTHER_KEPT;
        other.1 *= Self::OTHER_KEPT;
        other.2 *= Self::OTHER_KEPT;
        let e = &mut kinds[usize::from(drafted)];
        e.0 = e.0 * Self::KEPT + tokens as f64;
        e.1 = e.1 * Self::KEPT + seconds;
        e.2 = e.2 * Self::KEPT + 1.0;
    }

    /// A decoding step of `requests` requests (beside each other, none prefilling) in which `share` of the
    /// requests with drafters were allowed a draft by the budget.
    pub fn observe_allowance(&mut self, requests: usize, share: f64) {
        if requests == 0 || !share.is_finite() {
            return;
        }
        if self.allowed_by_requests.len() <= requests {
            self.allowed_by_requests
                .resize(requests + 1, Default::default());
        }
        let e = &mut self.allowed_by_requests[requests];
        e.0 = e.0 * Self::KEPT + share.clamp(0.0, 1.0);
        e.1 = e.1 * Self::KEPT + 1.0;
    }

    /// Whether drafters were mostly idle at `requests` (allowed a draft in under [`Self::IDLE_SHARE`] of their
    /// steps), from the counts within a quarter of it (their shares pooled, weighted by steps; at least
    /// MIN_STEPS), else from the nearest smaller count judged idle (a drafted row costs more of a pass the
    /// more requests share it, so the budget allows fewer). None without evidence.
    pub fn mostly_idle(&self, requests: usize) -> Option<bool> {
        if !self.idle_rule {
            return None;
        }
        let near = |n: usize| {
            let spread = n / 4;
            let (mut share, mut steps) = (0.0, 0.0);
            for m in n.saturating_sub(spread).max(1)..=n + spread {
                if let Some(&(s, w)) = self.allowed_by_requests.get(m) {
                    share += s;
                    steps += w;
                }
            }
            (steps >= Self::MIN_STEPS).then(|| share / steps < Self::IDLE_SHARE)
        };
        if let Some(idle) = near(requests) {
            return Some(idle);
        }
        (1..requests).rev().find_map(near).filter(|&idle| idle)
    }

    /// Drafted steps' tokens a second over undrafted ones' at `requests`, and the steps behind it (the fewer of
    /// the two kinds), once both kinds have at least `min_steps`.
    fn gain(&self, requests: usize, min_steps: f64) -> Option<(f64, f64)> {
        let [undrafted, drafted] = self.by_requests.get(requests)?;
        let steps = undrafted.2.min(drafted.2);
        if steps < min_steps || undrafted.0 <= 0.0 {
            return None;
        }
        let rate = |e: &(f64, f64, f64)| e.0 / e.1;
        Some((rate(drafted) / rate(undrafted), steps))
    }

    /// Whether drafting pays in steps of `requests` requests, on that count's own evidence (None until both
    /// kinds have been seen enough).
    pub fn pays(&self, requests: usize) -> Option<bool> {
        self.gain(requests, Self::MIN_STEPS)
            .map(|(gain, _)| gain > 1.0 + Self::MARGIN)
    }

    /// [`Self::pays`], else the gains of the counts within a quarter of it pooled (each weighted by its steps;
    /// together at least MIN_STEPS): a load that moves between 14 and 16 requests spreads its steps over three
    /// counts, and judged one count at a time it took most of a 256-request run to judge (session 33: the cap
    /// acted on 33-42 requests).
    fn pays_near(&self, requests: usize) -> Option<bool> {
        if let Some(own) = self.pays(requests) {
            return Some(own);
        }
        let spread = requests / 4;
        let (mut weighted, mut steps) = (0.0, 0.0);
        for n in requests.saturating_sub(spread).max(1)..=requests + spread {
            if let Some((gain, w)) = self.gain(n, Self::NEIGHBOUR_MIN_STEPS) {
                weighted += gain * w;
                steps += w;
            }
        }
        (steps >= Self::MIN_STEPS).then(|| weighted / steps > 1.0 + Self::MARGIN)
    }

    /// What the cap goes by at `requests`: [`Self::pays_near`], else the nearest smaller count judged. A drafted
    /// row costs more of a pass the more requests share it, so where drafting paid nothing at fewer requests it
    /// pays nothing at more; a smaller count where it paid says nothing about this one.
    pub fn judged(&self, requests: usize) -> Option<bool> {
        if !self.from_neighbours {
            return self.pays(requests);
        }
        if let Some(near) = self.pays_near(requests) {
            return Some(near);
        }
        (1..requests)
            .rev()
            .find_map(|n| self.pays_near(n))
            .filter(|&pays| !pays)
    }

    /// Whether a step of `requests` decoding requests drafts nothing although the budget would: drafting measured
    /// no gain at that count ([`Self::judged`]), and this is not one of the steps in [`Self::PROBE_STEPS_EVERY`]
    /// that still draft so the verdict keeps tracking the load. The budget prices a draft's own rows against
    /// the step; what else a drafting batch costs (the head's batched passes, longer host work, rows that turn
    /// a GEMV into a GEMM) shows only in whole steps. On an H100 at 16 streams a head server whose admissions
    /// this cap had already limited kept drafting in the requests that had drafters (74% accepted) and ran
    /// 0.89x plain (docs/benchmarks.md, session 51). Never alone: one request's drafts are judged by the budget.
    pub fn refuses_drafts(&mut self, requests: usize) -> bool {
        if !self.stops_drafts || requests < 2 || self.judged(requests) != Some(false) {
            return false;
        }
        self.refused_steps += 1;
        !self.refused_steps.is_multiple_of(Self::PROBE_STEPS_EVERY)
    }

    /// Whether a request admitted beside `running` others gets a drafter: alone always; beside others unless
    /// drafting measured no gain at that many requests ([`Self::judged`]) or drafters there were mostly idle
    /// ([`Self::mostly_idle`]); then every `PROBE_EVERY`-th still does.
    pub fn admits_drafter(&mut self, running: usize) -> bool {
        let n = running + 1;
        if running == 0 || (self.judged(n) != Some(false) && self.mostly_idle(n) != Some(true)) {
            return true;
        }
        self.capped_admissions += 1;
        self.capped_admissions.is_multiple_of(Self::PROBE_EVERY)
    }
}

/// Decoding steps in a row beside other requests with no draft allowed before a drafter that costs idle steps is
/// released: long enough that one step's refusal (a burst of prompts, a baseline probe) keeps it, short against a
/// request's life (a 128-token answer at one token a step carries it for an eighth of its steps).
const RELEASE_IDLE_DRAFTER_AFTER: u32 = 16;

/// When a finished request was queued, admitted and let go, and the engine thread's time on those.
struct RequestTimes {
    queued_at: Instant,
    admitted: Instant,
    admission: AdmissionCost,
    leave_start: Instant,
    leave_s: f64,
}

/// Whether [`PREFIX_OVER_DRAFTER`]'s rule applies (`SPECULA_PREFIX_OVER_DRAFTER=0` keeps every drafter, as until
/// session 41, to compare).
fn prefix_over_drafter() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_PREFIX_OVER_DRAFTER").map_or(true, |v| v != "0"))
}

/// Cached prompt positions a request must gain by going without its drafter for it to go without
/// ([`Engine::start`]): a quarter of a prefill chunk.
const PREFIX_OVER_DRAFTER: usize = 64;

/// The most tokens of a catch-up a draft model on `device` feeds a step (`ModelDrafter::with_catch_up_piece`).
/// On a CPU a catch-up costs about a draft pass a few tokens (a 0.5B draft model fed a 60-token prompt in ~280 ms
/// on 2 cores, a 1.5B step being ~55 ms): whole, a request's first draft stalled its stream for that long; in
/// pieces of 16 no step takes much more than twice a plain one. On a GPU a catch-up pass is latency-bound (~0.3
/// ms for a 60-token prompt beside 0.75 ms draft passes on an H200): fed whole. `SPECULA_DRAFT_CATCH_UP_PIECE=N`
/// (0: whole) overrides it.
fn draft_catch_up_piece(device: &str) -> Option<usize> {
    let piece = std::env::var("SPECULA_DRAFT_CATCH_UP_PIECE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(if device.starts_with("cpu") { 16 } else { 0 });
    (piece > 0).then_some(piece)
}

/// Steps a draft model's catch-up is spread over in the draft budget ([`DraftCandidate::shared_by`]). The prompt
/// (nothing drafted yet) is fed once for the whole request: shared by its steps left (about two tokens a step).
/// What it missed while cut is paid whole beside other requests (shared, a request would resume and be cut again
/// as the batch changes, paying a catch-up each time), but alone it is shared too: charged whole, each step it
/// stayed cut raised the price of resuming, and it never resumed (one stream on an H200: a 0.5B draft model cut
/// once by a 2% margin, 95 tokens behind later, its catch-up priced at 3.4 ms against a 1.3 ms step, drafted
/// nothing for the rest of every request). An EAGLE-3 head's cheap catch-up is charged the same way: spread beside
/// others too, cut heads on this CPU resumed and drafted 11x more at 2-4 streams with natural answer lengths, and
/// ran 0.95-0.97x as fast (session 45).
fn catch_up_shared_by(drafted_yet: bool, tokens_left: usize, alone: bool) -> usize {
    if drafted_yet && !alone {
        1
    } else {
        tokens_left.div_ceil(2).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::{catch_up_shared_by, cycle_evidence, step_costs, SpecCounts, StepCosts};
    use specula::profile::{Phase, StepKind, StepPhases};

    #[test]
    fn a_device_clock_prices_drafting_and_the_rest_by_the_host() {
        let step = |seconds: f64, phases: Vec<(Phase, f64)>| StepPhases {
            kind: StepKind::Decode,
            seconds,
            phases,
        };
        // Device: verify 4 ms, draft 0.3 ms in a 5 ms step. Host: verify 0.1 ms (launches), draft 1.2 ms (the
        // head's passes wait for their tokens), accept 4.5 ms (waits for the verify), feed 0.2 ms (the head reads
        // the hidden states: every step, drafting or not, so part of the rest), 6.5 ms in all.
        let device = step(5e-3, vec![(Phase::Verify, 4e-3), (Phase::Draft, 0.3e-3)]);
        let host = step(
            6.5e-3,
            vec![
                (Phase::Verify, 0.1e-3),
                (Phase::Draft, 1.2e-3),
                (Phase::Accept, 4.5e-3),
                (Phase::Feed, 0.2e-3),
            ],
        );
        let c = step_costs(&device, Some(&host));
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(
            close(c.forward, 4e-3) && close(c.draft, 1.2e-3) && close(c.other, 1.3e-3),
            "{c:?}"
        );
        // One clock (the CPU): everything by it.
        let c = step_costs(&device, None);
        assert_eq!(
            c,
            StepCosts {
                forward: 4e-3,
                draft: 0.3e-3,
                other: 5e-3 - 4e-3 - 0.3e-3
            }
        );
    }

    #[test]
    fn feeding_only_cycles_price_their_rows_and_leave_acceptance_alone() {
        // Fed 8 of 30 lagging rows, drafted nothing by design: rows priced, no cycle recorded.
        let feeding = SpecCounts {
            draft_passes: 1,
            catch_up_cycles: 1,
            ..Default::default()
        };
        assert_eq!(cycle_evidence(4, &feeding, 30, 22, 4), (8, None));
        // A draft after a catch-up: the rows beyond the draft's own are priced, the cycle recorded.
        let drafted = SpecCounts {
            drafted: 4,
            accepted: 2,
            draft_passes: 4,
            ..Default::default()
        };
        assert_eq!(cycle_evidence(4, &drafted, 12, 0, 4), (7, Some((4, 4, 2))));
        // A draft the confidence bar stopped before its first token is a decision: recorded as undrafted.
        let stopped = SpecCounts {
            draft_passes: 1,
            ..Default::default()
        };
        assert_eq!(cycle_evidence(4, &stopped, 1, 0, 4), (0, Some((4, 0, 0))));
        // ... and when it stopped after feeding a lag, the lag beyond a draft's own rows is still a catch-up.
        assert_eq!(cycle_evidence(1, &stopped, 9, 0, 3), (5, Some((1, 0, 0))));
    }

    #[test]
    fn a_catch_up_is_charged_whole_only_beside_other_requests() {
        // A new request's prompt: spread over its steps left, alone or not.
        assert_eq!(catch_up_shared_by(false, 128, false), 64);
        assert_eq!(catch_up_shared_by(false, 128, true), 64);
        // Fell behind while cut: whole beside others, spread alone.
        assert_eq!(catch_up_shared_by(true, 100, false), 1);
        assert_eq!(catch_up_shared_by(true, 100, true), 50);
        // Never zero steps.
        assert_eq!(catch_up_shared_by(true, 0, true), 1);
    }

    #[test]
    fn the_automatic_cap_admits_without_a_drafter_only_where_drafting_measured_no_gain() {
        use super::DraftPayoff;
        let mut p = DraftPayoff::default();
        // Nothing measured: everyone gets a drafter.
        assert_eq!(p.pays(16), None);
        assert!((0..20).all(|_| p.admits_drafter(15)));
        // 16 requests: undrafted steps 16 tokens in 2.0 ms; drafted ones 26 tokens in 3.35 ms (a wash).
        for _ in 0..30 {
            p.observe(16, false, 16, 2.0e-3);
            p.observe(16, true, 26, 3.35e-3);
        }
        assert_eq!(p.pays(16), Some(false));
        // Beside 15 others a request gets no drafter, but every PROBE_EVERY-th does; alone it always does.
        let given: Vec<bool> = (0..2 * DraftPayoff::PROBE_EVERY)
            .map(|_| p.admits_drafter(15))
            .collect();
        assert_eq!(given.iter().filter(|&&g| g).count() as u64, 2, "{given:?}");
        assert!(p.admits_drafter(0));
        // Another request count is judged on its own: at 4 requests drafting pays (7 tokens in 1.5 ms against 4
        // in 1.3 ms).
        for _ in 0..30 {
            p.observe(4, false, 4, 1.3e-3);
            p.observe(4, true, 7, 1.5e-3);
        }
        assert_eq!(p.pays(4), Some(true));
        assert!((0..20).all(|_| p.admits_drafter(3)));
        // A gain under the 2% margin is no gain (1% here).
        let mut q = DraftPayoff::default();
        for _ in 0..30 {
            q.observe(8, false, 800, 1.0);
            q.observe(8, true, 808, 1.0);
        }
        assert_eq!(q.pays(8), Some(false));
        // Long stretches of undrafted steps fade the drafted evidence: the load is judged afresh.
        for _ in 0..1000 {
            p.observe(16, false, 16, 2.0e-3);
        }
        assert_eq!(p.pays(16), None);
        assert!(p.admits_drafter(15));
        // Where drafting measured no gain, steps draft nothing but one in PROBE_STEPS_EVERY; never alone, never
        // where it pays, never with the rule off.
        let refused = (0..2 * DraftPayoff::PROBE_STEPS_EVERY)
            .filter(|_| q.refuses_drafts(8))
            .count() as u64;
        assert_eq!(refused, 2 * (DraftPayoff::PROBE_STEPS_EVERY - 1));
        assert!(!p.refuses_drafts(4));
        let mut alone = DraftPayoff::default();
        for _ in 0..30 {
            alone.observe(1, false, 1, 1.0e-3);
            alone.observe(1, true, 1, 1.5e-3);
        }
        assert_eq!(alone.pays(1), Some(false));
        assert!(!alone.refuses_drafts(1));
        q.stops_drafts = false;
        assert!(!q.refuses_drafts(8));
        // Steps of no time or of no requests are not evidence.
        let mut r = DraftPayoff::default();
        for _ in 0..30 {
            r.observe(0, true, 5, 1.0);
            r.observe(2, true, 5, 0.0);
            r.observe(2, false, 5, f64::NAN);
        }
        assert_eq!((r.pays(0), r.pays(2)), (None, None));
    }

    #[test]
    fn a_count_short_of_evidence_is_judged_from_its_neighbours() {
        use super::DraftPayoff;
        // A 16-stream load moving between 14 and 16 requests: 8 steps of each kind at each count, drafting a
        // wash (drafted 1.3x the tokens in 1.3x the time). No count has MIN_STEPS of its own.
        let mut p = DraftPayoff::default();
        for n in 14..=16 {
            for _ in 0..8 {
                p.observe(n, false, n, 2.0e-3);
                p.observe(n, true, n * 13 / 10, 2.6e-3);
            }
        }
        assert_eq!((p.pays(14), p.pays(15), p.pays(16)), (None, None, None));
        // Pooled, they are judged: no gain.
        assert_eq!(p.judged(15), Some(false));
        assert_eq!(p.judged(16), Some(false));
        assert!(!p.admits_drafter(15));
        // Counts above, with no evidence at all, take the nearest smaller count's "no gain"...
        assert_eq!(p.judged(24), Some(false));
        // ...but not below it: fewer requests may still gain.
        assert_eq!(p.judged(8), None);
        assert!(p.admits_drafter(7));
        // Where drafting paid at a count in between, larger counts are not judged from below it.
        for _ in 0..20 {
            p.observe(20, false, 20, 2.5e-3);
            p.observe(20, true, 40, 3.0e-3);
        }
        assert_eq!(p.pays(20), Some(true));
        assert_eq!(p.judged(30), None);
        // A count's own evidence wins over its neighbours': 15 measured a clear gain of its own.
        for _ in 0..40 {
            p.observe(15, false, 15, 2.0e-3);
            p.observe(15, true, 30, 2.4e-3);
        }
        assert_eq!(p.judged(15), Some(true));
        // Neighbours with a single step of a kind are not evidence.
        let mut q = DraftPayoff::default();
        for n in 10..=13 {
            for _ in 0..30 {
                q.observe(n, false, n, 2.0e-3);
            }
            q.observe(n, true, n, 4.0e-3);
        }
        assert_eq!(q.judged(12), None);
    }

    #[test]
    fn the_automatic_cap_admits_without_a_drafter_where_drafters_were_mostly_idle() {
        use super::DraftPayoff;
        let mut p = DraftPayoff::default();
        assert_eq!(p.mostly_idle(8), None);
        // 8 requests: the budget allowed a draft to one drafter in ten (as on the H200 at 8-16 streams).
        for _ in 0..20 {
            p.observe_allowance(8, 0.1);
        }
        assert_eq!(p.mostly_idle(8), Some(true));
        // No drafted-against-undrafted evidence at all, yet a newcomer beside 7 others gets no drafter (but
        // every PROBE_EVERY-th does).
        assert_eq!(p.judged(8), None);
        let given = (0..DraftPayoff::PROBE_EVERY)
            .filter(|_| p.admits_drafter(7))
            .count();
        assert_eq!(given, 1);
        // Larger counts with no evidence of their own take it from below; smaller ones are not judged.
        assert_eq!(p.mostly_idle(16), Some(true));
        assert_eq!(p.mostly_idle(4), None);
        assert!(p.admits_drafter(3));
        // Where drafters were allowed drafts in most steps, they are not idle, whatever the larger counts say.
        for _ in 0..20 {
            p.observe_allowance(4, 0.9);
        }
        assert_eq!(p.mostly_idle(4), Some(false));
        assert!((0..20).all(|_| p.admits_drafter(3)));
        // The share is pooled with the counts within a quarter: 7 and 9 steps at 0.5 move 8 above the bar.
        for n in [7, 9] {
            for _ in 0..60 {
                p.observe_allowance(n, 0.5);
            }
        }
        assert_eq!(p.mostly_idle(8), Some(false));
        // Bad evidence is ignored.
        let mut q = DraftPayoff::default();
        for _ in 0..30 {
            q.observe_allowance(0, 0.0);
            q.observe_allowance(3, f64::NAN);
        }
        assert_eq!((q.mostly_idle(1), q.mostly_idle(3)), (None, None));
    }
}
