//! The engine loop: one thread owns the model and runs requests; HTTP handlers talk to it through channels. The
//! engine knows nothing of HTTP.
//!
//! This first increment runs one request at a time in arrival order (a bounded queue in front); continuous
//! batching of several requests per step comes next (issue 14).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use specula::chat::ChatMessage;
use specula::decode::{self, GenerateRequest, Speculation, StopReason};
use specula::draft::model::ModelDrafter;
use specula::draft::ngram::NgramDrafter;
use specula::draft::Drafter;
use specula::model::LoadedModel;
use specula::profile::Profiler;
use specula::sampling::SamplingParams;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// Requests recorded between `/start_profile` and `/stop_profile`: each one's phase summary and Chrome trace.
pub struct ProfileSession {
    pub started: std::time::Instant,
    pub requests: Vec<ProfiledRequest>,
}

pub struct ProfiledRequest {
    /// Seconds from the session's start to the request's start.
    pub offset_s: f64,
    pub summary: serde_json::Value,
    pub trace: serde_json::Value,
}

/// The profiling switch the HTTP side flips and the engine reads at each request's start.
pub type Profiling = Arc<std::sync::Mutex<Option<ProfileSession>>>;

/// What the server speculates with.
pub enum DraftSetup {
    None,
    /// Prompt lookup (default settings).
    Ngram,
    /// A draft model sharing the target's tokenizer.
    Model(Box<LoadedModel>),
    /// An EAGLE-3 head fed by the target's hidden states (chains, or trees of a shape).
    Eagle3(
        Box<specula::draft::eagle3::Eagle3Head>,
        Option<specula::draft::eagle3::TreeShape>,
    ),
}

/// A request's input: a raw prompt (`/v1/completions`) or a conversation (`/v1/chat/completions`).
pub enum Input {
    Prompt(String),
    Chat(Vec<ChatMessage>),
}

pub struct Job {
    pub input: Input,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub events: UnboundedSender<Event>,
    /// Set when the client goes away: the engine stops at the next step.
    pub cancel: Arc<AtomicBool>,
    /// When the request was queued (latency metrics).
    pub queued_at: std::time::Instant,
}

/// What the engine tells a request's handler, in order: `Started` (or an error), text pieces, `Done`.
#[derive(Debug)]
pub enum Event {
    Started { prompt_tokens: usize },
    Text(String),
    Done(Result<Finished, String>),
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Finished {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// OpenAI's finish_reason: "stop" (end of turn or a stop sequence) or "length".
    pub finish_reason: &'static str,
    /// Speculative stats of the request (zero without a drafter).
    pub drafted: u64,
    pub accepted: u64,
    pub cycles: u64,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// The handle the HTTP side holds.
pub struct Engine {
    jobs: SyncSender<Job>,
    metrics: Arc<Metrics>,
    pub model_name: String,
    pub context_length: usize,
    /// The model's tokenizer, shared with the engine (`/tokenize`, `/detokenize` need no engine turn).
    pub tokenizer: Arc<specula::tokenizer::Tokenizer>,
    /// The model's chat template (`/tokenize` of chat messages formats them as a chat request would).
    pub chat_template: Option<specula::chat::ChatTemplate>,
    pub vocab_size: usize,
    pub profiling: Profiling,
}

/// Why a job was not queued.
pub enum SubmitError {
    QueueFull,
    Stopped,
}

impl Engine {
    /// Starts the engine thread over `model`, with room for `max_queue` waiting requests.
    pub fn start(
        model: LoadedModel,
        draft: DraftSetup,
        draft_tokens: usize,
        max_queue: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (jobs, rx) = sync_channel(max_queue.max(1));
        let model_name = model.spec.clone();
        let context_length = model.model.config().context_length;
        let tokenizer = model.tokenizer.clone();
        let chat_template = model.chat_template.clone();
        let vocab_size = model.model.config().vocab_size;
        let engine_metrics = metrics.clone();
        let profiling: Profiling = Arc::default();
        let engine_profiling = profiling.clone();
        std::thread::Builder::new()
            .name("specula-engine".into())
            .spawn(move || {
                engine_loop(
                    model,
                    draft,
                    draft_tokens,
                    rx,
                    &engine_metrics,
                    &engine_profiling,
                )
            })
            .expect("spawn the engine thread");
        Engine {
            jobs,
            metrics,
            model_name,
            context_length,
            tokenizer,
            chat_template,
            vocab_size,
            profiling,
        }
    }

    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        // Counted before the send: the engine may pick the job up (and count it down) at once.
        self.metrics.queue.inc();
        self.jobs.try_send(job).map_err(|e| {
            self.metrics.queue.dec();
            match e {
                TrySendError::Full(_) => SubmitError::QueueFull,
                TrySendError::Disconnected(_) => SubmitError::Stopped,
            }
        })
    }
}

fn engine_loop(
    model: LoadedModel,
    draft: DraftSetup,
    draft_tokens: usize,
    jobs: Receiver<Job>,
    metrics: &Metrics,
    profiling: &Profiling,
) {
    for job in jobs {
        metrics.queue.dec();
        if job.cancel.load(Ordering::Relaxed) {
            continue;
        }
        let events = job.events.clone();
        metrics.running.inc();
        // A panic in one request must not take the engine (and every other request) down.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_job(&model, &draft, draft_tokens, job, metrics, profiling)
        }));
        metrics.running.dec();
        let result = match outcome {
            Ok(r) => r,
            Err(_) => Err("internal error: the request panicked in the engine".to_string()),
        };
        let _ = events.send(Event::Done(result));
    }
}

/// Text that cannot yet be sent because it may be the start of a stop sequence.
fn holdback(text: &str, stop: &[String]) -> usize {
    let longest = stop.iter().map(|s| s.len()).max().unwrap_or(0);
    if longest == 0 {
        return text.len();
    }
    let mut cut = text.len().saturating_sub(longest - 1);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

fn run_job(
    model: &LoadedModel,
    draft: &DraftSetup,
    draft_tokens: usize,
    job: Job,
    metrics: &Metrics,
    profiling: &Profiling,
) -> Result<Finished, String> {
    let text = match &job.input {
        Input::Prompt(p) => p.clone(),
        Input::Chat(messages) => model.format_chat(messages).map_err(|e| e.to_string())?,
    };
    let prompt_tokens = model.tokenizer.encode(&text).map_err(|e| e.to_string())?;
    if prompt_tokens.is_empty() {
        return Err("the prompt is empty".into());
    }
    let ctx = model.model.config().context_length;
    if prompt_tokens.len() + job.max_tokens > ctx {
        return Err(format!(
            "the prompt ({} tokens) plus max_tokens ({}) exceeds the model's context of {ctx} tokens",
            prompt_tokens.len(),
            job.max_tokens
        ));
    }
    let _ = job.events.send(Event::Started {
        prompt_tokens: prompt_tokens.len(),
    });
    let req = GenerateRequest {
        prompt_tokens,
        max_new_tokens: job.max_tokens,
        sampling: job.sampling,
        stop_at_eos: true,
        cancel: Some(job.cancel.clone()),
    };
    let mut drafter: Option<Box<dyn Drafter + '_>> = match draft {
        DraftSetup::None => None,
        DraftSetup::Ngram => Some(Box::new(
            NgramDrafter::with_stopping(1, 4, Some(specula::draft::ngram::DEFAULT_MIN_CONFIDENCE))
                .map_err(|e| e.to_string())?,
        )),
        DraftSetup::Eagle3(head, tree) => {
            let d = specula::draft::eagle3::Eagle3Drafter::new(
                head,
                model.model.as_ref(),
                job.sampling.seed,
            )
            .map_err(|e| e.to_string())?;
            Some(Box::new(match tree {
                Some(shape) => d.with_tree(*shape),
                None => d,
            }))
        }
        DraftSetup::Model(d) => Some(Box::new(
            ModelDrafter::new(d.model.as_ref(), job.sampling.seed)
                .and_then(|m| m.with_min_confidence(specula::draft::model::DEFAULT_MIN_CONFIDENCE))
                .map_err(|e| e.to_string())?,
        )),
    };
    let speculation = drafter.as_mut().map(|d| Speculation {
        drafter: d.as_mut(),
        draft_tokens,
        simulate_acceptance: None,
    });
    // Stop sequences: text is held back while it could still begin one; once one appears, the text before it
    // is the answer and generation stops.
    let mut produced = String::new();
    let mut sent = 0;
    let mut stopped_by_sequence = false;
    let mut last_text: Option<std::time::Instant> = None;
    // Between /start_profile and /stop_profile every request runs with the profiler on (phases, device clock).
    let session_start = profiling
        .lock()
        .map_err(|_| "the profiling state is poisoned".to_string())?
        .as_ref()
        .map(|s| s.started);
    // Every request runs with the phase profiler on (its cost is within noise: docs/benchmarks.md, "Profiler
    // overhead"), which feeds the step histograms of /metrics; between /start_profile and /stop_profile its
    // records are also kept for the trace.
    let prof = Profiler::with_clock(specula::profile::Detail::Phases, model.model.clock(false));
    let request_start = std::time::Instant::now();
    let out = decode::generate(
        model.model.as_ref(),
        &model.tokenizer,
        &req,
        speculation,
        &prof,
        &mut |piece| {
            if stopped_by_sequence {
                return;
            }
            produced.push_str(piece);
            if let Some(at) = job
                .stop
                .iter()
                .filter_map(|s| {
                    produced[sent.min(produced.len())..]
                        .find(s.as_str())
                        .map(|i| i + sent)
                })
                .min()
            {
                produced.truncate(at);
                stopped_by_sequence = true;
                job.cancel.store(true, Ordering::Relaxed);
            }
            let upto = if stopped_by_sequence {
                produced.len()
            } else {
                holdback(&produced, &job.stop)
            };
            if upto > sent {
                let now = std::time::Instant::now();
                match last_text {
                    None => metrics.ttft.observe((now - job.queued_at).as_secs_f64()),
                    Some(t) => metrics.itl.observe((now - t).as_secs_f64()),
                }
                last_text = Some(now);
                if job
                    .events
                    .send(Event::Text(produced[sent..upto].to_string()))
                    .is_err()
                {
                    // The client went away: stop at the next step.
                    job.cancel.store(true, Ordering::Relaxed);
                }
                sent = upto;
            }
        },
    )
    .map_err(|e| e.to_string())?;
    if !stopped_by_sequence && produced.len() > sent {
        let _ = job.events.send(Event::Text(produced[sent..].to_string()));
    }
    let finish_reason = match out.stop_reason {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        StopReason::EndOfText | StopReason::Cancelled => "stop",
    };
    metrics.observe_steps(&prof.step_phases());
    if let Some(started) = session_start {
        let summary = prof.summary();
        let record = ProfiledRequest {
            offset_s: request_start
                .saturating_duration_since(started)
                .as_secs_f64(),
            summary: serde_json::json!({
                "prompt_tokens": out.prompt_tokens,
                "generated_tokens": out.tokens.len(),
                "decode_tok_s": out.timing.decode_tok_s(),
                "phases": summary.phases_json(),
                "speculation": out.speculation.as_ref().map(|s| s.to_json()),
            }),
            trace: prof.chrome_trace(),
        };
        if let Ok(mut guard) = profiling.lock() {
            // Only if the same session is still on (it may have stopped mid-request).
            if let Some(session) = guard.as_mut().filter(|s| s.started == started) {
                session.requests.push(record);
            }
        }
    }
    let spec = out.speculation.as_ref();
    metrics.e2e.observe(job.queued_at.elapsed().as_secs_f64());
    metrics.prompt_tokens.inc_by(out.prompt_tokens as u64);
    metrics.generation_tokens.inc_by(out.tokens.len() as u64);
    if let Some(st) = spec {
        metrics.num_drafts.inc_by(st.cycles - st.empty_drafts);
        metrics.num_draft_tokens.inc_by(st.drafted);
        metrics.num_accepted_tokens.inc_by(st.accepted);
        for (i, &a) in st.accepted_per_position.iter().enumerate() {
            metrics
                .accepted_per_pos
                .with_label_values(&[&(i + 1).to_string()])
                .inc_by(a);
        }
    }
    Ok(Finished {
        prompt_tokens: out.prompt_tokens,
        completion_tokens: out.tokens.len(),
        finish_reason,
        drafted: spec.map_or(0, |s| s.drafted),
        accepted: spec.map_or(0, |s| s.accepted),
        cycles: spec.map_or(0, |s| s.cycles),
        prefill_s: out.timing.prefill_s,
        decode_s: out.timing.decode_s,
    })
}

#[cfg(test)]
mod tests {
    use super::holdback;

    #[test]
    fn holdback_keeps_what_could_start_a_stop_sequence() {
        assert_eq!(holdback("hello wor", &[]), 9);
        assert_eq!(holdback("hello wor", &["world".into()]), 5);
        // Never splits a character.
        assert_eq!(holdback("aé", &["xy".into()]), 1);
    }
}
