//! `specula serve`: an OpenAI-compatible HTTP server (axum) over the specula engine ([`engine`]).
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming over SSE or not), `GET
//! /v1/models`, `GET /health`. Errors come in OpenAI's JSON shape (`{"error": {"message", "type", "param",
//! "code"}}`) with the matching status: 400 for malformed or out-of-range requests, 401 for a missing or wrong API
//! key, 404 for an unknown model, 429 (with Retry-After) when the queue is full. Binds to 127.0.0.1 by default.

pub mod engine;
pub mod metrics;

use std::convert::Infallible;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use specula::chat::ChatMessage;
use specula::decode::LogprobsRequest;
use specula::sampling::{LogitAdjustments, SamplingParams, TokenLogprob};
use specula::tokenizer::Tokenizer;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use engine::{tokenize_input, Engine, Event, Failure, Finished, Input, Job, SubmitError};

/// Limits on what a request may ask for (checked before it is queued).
#[derive(Debug, Clone)]
pub struct Limits {
    /// The most new tokens a request may ask for (also capped by the context).
    pub max_tokens: usize,
    pub max_stop_sequences: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_tokens: 8192,
            max_stop_sequences: 8,
        }
    }
}

pub struct AppState {
    pub engine: Engine,
    pub metrics: Arc<metrics::Metrics>,
    /// Where `/stop_profile` writes its trace and report (the server's choice, never the client's).
    pub profile_dir: std::path::PathBuf,
    pub api_key: Option<String>,
    pub limits: Limits,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics_text))
        .route("/tokenize", post(tokenize))
        .route("/start_profile", post(start_profile))
        .route("/stop_profile", post(stop_profile))
        .route("/detokenize", post(detokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(state)
}

/// Serves on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>) -> std::io::Result<()> {
    axum::serve(listener, router(state)).await
}

/// An error in OpenAI's shape.
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        let mut resp = (self.status, Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut()
                .insert("retry-after", HeaderValue::from_static("1"));
        }
        resp
    }
}

fn check_key(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        Err(ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: if given.is_none() {
                "missing API key: send Authorization: Bearer KEY".into()
            } else {
                "wrong API key".into()
            },
            kind: "authentication_error",
            param: None,
        })
    }
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// The error answer for a request the engine did not finish.
fn failed(failure: Failure) -> ApiError {
    match failure {
        Failure::BadRequest(m) => ApiError::bad(m, None),
        Failure::Timeout(m) => ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            message: m,
            kind: "timeout_error",
            param: None,
        },
        Failure::Internal(m) => server_error(m),
    }
}

fn server_error(message: String) -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message,
        kind: "server_error",
        param: None,
    }
}

/// Starts recording every request's phases and trace (SGLang's endpoint name).
async fn start_profile(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    check_key(&state, &headers)?;
    let mut guard = state
        .engine
        .profiling
        .lock()
        .map_err(|_| server_error("the profiling state is poisoned".into()))?;
    if guard.is_some() {
        return Err(ApiError::bad(
            "profiling is already on; POST /stop_profile first",
            None,
        ));
    }
    *guard = Some(engine::ProfileSession::new());
    Ok(Json(json!({"status": "profiling"})))
}

/// Stops recording and writes the Chrome trace (the engine's steps and phases with the batch size as a counter,
/// and one lane per request from queueing to its end, on one time axis) and the JSON report (every request's
/// usage and timing) into the server's profile directory.
async fn stop_profile(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    check_key(&state, &headers)?;
    let session = state
        .engine
        .profiling
        .lock()
        .map_err(|_| server_error("the profiling state is poisoned".into()))?
        .take()
        .ok_or_else(|| ApiError::bad("profiling is not on; POST /start_profile first", None))?;
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "engine steps"}}),
        json!({"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "requests"}}),
        json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "step"}}),
    ];
    for p in specula::profile::Phase::ALL {
        events.push(json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 10 + p as u32, "args": {"name": p.name()}}));
    }
    events.extend(session.events);
    let mut report = Vec::with_capacity(session.requests.len());
    for (i, r) in session.requests.into_iter().enumerate() {
        let tid = i + 1;
        let us = |key: &str| r[key].as_f64().unwrap_or(0.0) * 1e6;
        events.push(json!({"name": "thread_name", "ph": "M", "pid": 2, "tid": tid, "args": {"name": format!("request {tid}")}}));
        events.push(
            json!({"name": "queued", "ph": "X", "pid": 2, "tid": tid, "ts": us("queued_s"),
                           "dur": us("admitted_s") - us("queued_s")}),
        );
        events.push(json!({"name": "running", "ph": "X", "pid": 2, "tid": tid, "ts": us("admitted_s"),
                           "dur": us("finished_s") - us("admitted_s"),
                           "args": {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
                                    "accepted": r["accepted"], "drafted": r["drafted"]}}));
        let host = &r["engine_host"];
        let host_us = |key: &str| host[key].as_f64().unwrap_or(0.0) * 1e6;
        events.push(json!({"name": "admit", "ph": "X", "pid": 2, "tid": tid, "ts": host_us("admit_started_s"),
                           "dur": host_us("admit_s"),
                           "args": {"prepare_us": host_us("prepare_s"), "drafter_us": host_us("drafter_s"),
                                    "generation_us": host_us("generation_s"), "prefix_us": host_us("prefix_s")}}));
        events.push(json!({"name": "leave", "ph": "X", "pid": 2, "tid": tid, "ts": host_us("leave_started_s"),
                           "dur": host_us("leave_s")}));
        let mut r = r;
        r["request"] = json!(tid);
        report.push(r);
    }
    std::fs::create_dir_all(&state.profile_dir)
        .map_err(|e| server_error(format!("creating {}: {e}", state.profile_dir.display())))?;
    let stamp = now();
    let trace_path = state
        .profile_dir
        .join(format!("specula-trace-{stamp}.json"));
    let report_path = state
        .profile_dir
        .join(format!("specula-profile-{stamp}.json"));
    let write = |path: &std::path::Path, v: &Value| {
        std::fs::write(path, v.to_string())
            .map_err(|e| server_error(format!("writing {}: {e}", path.display())))
    };
    write(
        &trace_path,
        &json!({"traceEvents": events, "displayTimeUnit": "ms"}),
    )?;
    let requests = report.len();
    write(
        &report_path,
        &json!({"model": state.engine.model_name, "steps": session.steps,
                "dropped_trace_events": session.dropped_events, "requests": report}),
    )?;
    Ok(Json(json!({
        "status": "stopped",
        "steps": session.steps,
        "requests": requests,
        "trace": trace_path.display().to_string(),
        "report": report_path.display().to_string(),
    })))
}

/// `{"prompt": TEXT}` or `{"messages": [...]}` (formatted by the chat template, ready for the assistant's turn,
/// as a chat request would be) -> `{"tokens": [...], "count": N, "max_model_len": CONTEXT}` (vLLM's shape).
async fn tokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    check_key(&state, &headers)?;
    let o = parse_body(&body)?;
    let (text, param) = if o.contains_key("messages") {
        let messages = parse_messages(&o)?;
        // With `tools`, rendered as a chat request with those tools would be (its prompt's length counted).
        let tools = tools_asked(&state, &o)?;
        let text = specula::model::format_chat_with_tools(
            state.engine.chat_template.as_ref(),
            &state.engine.tokenizer,
            &messages,
            tools.as_ref().map(|t| &t.definitions),
        )
        .map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?;
        (text, "messages")
    } else {
        let prompt = o.get("prompt").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad(
                "prompt (a string) or messages (a list) is required",
                Some("prompt"),
            )
        })?;
        (prompt.to_string(), "prompt")
    };
    let tokens = state
        .engine
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::bad(e.to_string(), Some(param)))?;
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.engine.context_length,
        "tokens": tokens,
    })))
}

/// `{"tokens": [...]}` -> `{"prompt": TEXT}`.
async fn detokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    check_key(&state, &headers)?;
    let o = parse_body(&body)?;
    let bad = || ApiError::bad("tokens must be a list of token ids", Some("tokens"));
    let tokens: Vec<u32> = o
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|v| {
            v.as_u64()
                .filter(|&t| t <= u32::MAX as u64)
                .map(|t| t as u32)
                .ok_or_else(bad)
        })
        .collect::<Result<_, _>>()?;
    if let Some(&t) = tokens
        .iter()
        .find(|&&t| t as usize >= state.engine.vocab_size)
    {
        return Err(ApiError::bad(
            format!(
                "token {t} is outside the vocabulary of {}",
                state.engine.vocab_size
            ),
            Some("tokens"),
        ));
    }
    let prompt = state
        .engine
        .tokenizer
        .decode(&tokens)
        .map_err(|e| ApiError::bad(e.to_string(), Some("tokens")))?;
    Ok(Json(json!({ "prompt": prompt })))
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    check_key(&state, &headers)?;
    Ok(Json(json!({
        "object": "list",
        // vLLM's `max_model_len` too: clients size their requests by it.
        "data": std::iter::once(&state.engine.model_name)
            .chain(&state.engine.model_aliases)
            .map(|name| json!({"id": name, "object": "model", "owned_by": "specula",
                               "max_model_len": state.engine.context_length}))
            .collect::<Vec<_>>(),
    })))
}

/// The request fields both endpoints share, checked.
struct Common {
    max_tokens: usize,
    sampling: SamplingParams,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// vLLM's extension: keep generating past end-of-turn tokens (benchmarks of fixed length).
    ignore_eos: bool,
    /// vLLM's `stop_token_ids`: generation ends at any of them (kept in the output).
    stop_token_ids: Vec<u32>,
    /// Completions' `echo`: each prompt's text, sent before its completions.
    echo: bool,
    /// Choices to generate (`n`): each its own engine request, with seed `seed + index`.
    n: usize,
    /// Log-probabilities to return (completions' `logprobs: N`, chat's `logprobs: true` and `top_logprobs`).
    logprobs: Option<LogprobsRequest>,
    /// Penalties and logit bias (None when all are neutral).
    logit_adjustments: Option<LogitAdjustments>,
    /// Chat with tools (`tool_choice` auto): the tools' names; the answer's calls become `tool_calls`.
    tool_names: Option<Arc<Vec<String>>>,
}

/// A seed no earlier request got: std's per-process random hash keys over a counter and the clock (not for
/// secrets; enough that unseeded requests sample independently).
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Most choices one request may ask for (each is an engine request of its own).
const MAX_CHOICES: usize = 16;

fn parse_body(body: &Bytes) -> Result<serde_json::Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}"), None))?;
    match value {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::bad("the body must be a JSON object", None)),
    }
}

fn number(o: &serde_json::Map<String, Value>, key: &'static str) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(other) => Err(ApiError::bad(
            format!("{key} must be a number, got {other}"),
            Some(key),
        )),
    }
}

fn integer(o: &serde_json::Map<String, Value>, key: &'static str) -> Result<Option<u64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad(
                format!("{key} must be a non-negative integer, got {n}"),
                Some(key),
            )
        }),
        Some(other) => Err(ApiError::bad(
            format!("{key} must be an integer, got {other}"),
            Some(key),
        )),
    }
}

fn common(
    state: &AppState,
    o: &serde_json::Map<String, Value>,
    default_max: usize,
) -> Result<Common, ApiError> {
    if let Some(model) = o.get("model") {
        let name = model
            .as_str()
            .ok_or_else(|| ApiError::bad("model must be a string", Some("model")))?;
        if name != state.engine.model_name && !state.engine.model_aliases.iter().any(|a| a == name)
        {
            let served: Vec<&String> = std::iter::once(&state.engine.model_name)
                .chain(&state.engine.model_aliases)
                .collect();
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model {name:?} does not exist; this server serves {}",
                    served
                        .iter()
                        .map(|n| format!("{n:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                kind: "invalid_request_error",
                param: Some("model"),
            });
        }
    }
    let max_tokens = integer(o, "max_tokens")?
        .or(integer(o, "max_completion_tokens")?)
        .unwrap_or(default_max as u64);
    let ctx = state.engine.context_length as u64;
    if max_tokens == 0 || max_tokens > state.limits.max_tokens as u64 || max_tokens >= ctx {
        return Err(ApiError::bad(
            format!(
                "max_tokens is {max_tokens}; it must be between 1 and {} (the server's limit and the model's context of {ctx})",
                (state.limits.max_tokens as u64).min(ctx - 1)
            ),
            Some("max_tokens"),
        ));
    }
    let temperature = number(o, "temperature")?.unwrap_or(1.0);
    let top_p = number(o, "top_p")?.unwrap_or(1.0);
    let min_p = number(o, "min_p")?.unwrap_or(0.0);
    let top_k = match o.get("top_k") {
        Some(Value::Number(n)) if n.as_i64() == Some(-1) => 0,
        _ => integer(o, "top_k")?.unwrap_or(0),
    };
    // Without a seed each request samples afresh (OpenAI's and vLLM's behaviour): a fixed default made every
    // unseeded sampled request with the same prompt return the same text.
    let seed = integer(o, "seed")?.unwrap_or_else(fresh_seed);
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        min_p: min_p as f32,
        top_k: top_k as usize,
        seed,
    };
    sampling.validate().map_err(|e| {
        let message = e.to_string();
        let param = ["temperature", "top-p", "min-p"]
            .into_iter()
            .find(|p| message.contains(p))
            .map(|p| match p {
                "top-p" => "top_p",
                "min-p" => "min_p",
                _ => "temperature",
            });
        ApiError::bad(message, param)
    })?;
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(String::from).ok_or_else(|| {
                    ApiError::bad("stop must be a string or a list of strings", Some("stop"))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::bad(
                "stop must be a string or a list of strings",
                Some("stop"),
            ))
        }
    };
    if stop.len() > state.limits.max_stop_sequences
        || stop.iter().any(|s| s.is_empty() || s.len() > 256)
    {
        return Err(ApiError::bad(
            format!(
                "stop takes at most {} non-empty sequences of up to 256 bytes",
                state.limits.max_stop_sequences
            ),
            Some("stop"),
        ));
    }
    let stream = match o.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("stream must be a boolean", Some("stream"))),
    };
    let include_usage = o
        .get("stream_options")
        .and_then(|s| s.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let ignore_eos = match o.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::bad(
                "ignore_eos must be a boolean",
                Some("ignore_eos"),
            ))
        }
    };
    let stop_token_ids = match o.get("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ids)) => ids
            .iter()
            .map(|id| match id.as_u64() {
                Some(t) if t < state.engine.vocab_size as u64 => Ok(t as u32),
                _ => Err(ApiError::bad(
                    format!(
                        "stop_token_ids holds {id}; each must be a token id below the vocabulary size {}",
                        state.engine.vocab_size
                    ),
                    Some("stop_token_ids"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::bad(
                "stop_token_ids must be a list of token ids",
                Some("stop_token_ids"),
            ))
        }
    };
    let mut logit_adjustments = adjustments(state, o)?;
    // vLLM's `min_tokens`: the end-of-turn tokens and the stop ids are held back until that many tokens.
    let min_tokens = integer(o, "min_tokens")?.unwrap_or(0);
    if min_tokens > 0 {
        let a = logit_adjustments.get_or_insert_with(Default::default);
        a.min_tokens = min_tokens.min(max_tokens) as usize;
        a.stop_tokens = state.engine.tokenizer.stop_tokens().to_vec();
        a.stop_tokens.extend(&stop_token_ids);
        a.validate(state.engine.vocab_size)
            .map_err(|e| ApiError::bad(e.to_string(), Some("min_tokens")))?;
    }
    Ok(Common {
        stop_token_ids,
        max_tokens: max_tokens as usize,
        sampling,
        stop,
        stream,
        include_usage,
        ignore_eos,
        echo: false,
        n: choices(state, o)?,
        logprobs: None,
        logit_adjustments,
        tool_names: None,
    })
}

/// A chat request's tools: the definitions for the chat template, and the names whose calls are parsed from the
/// answer (None: `tool_choice` none), and where a call is forced, the schema the answer must match.
struct Tools {
    definitions: Value,
    parse_calls: Option<Arc<Vec<String>>>,
    forced: Option<Value>,
}

/// `tools` (OpenAI's list of `{"type": "function", "function": {"name": ..., "parameters": {...}}}`) and
/// `tool_choice`. The model's chat template renders the definitions; the answer's calls are parsed in the form
/// its template asks for (`ToolCallForm`): Hermes blocks (`<tool_call>{"name": ..., "arguments": {...}}
/// </tool_call>`: Qwen2 / Qwen2.5, Hermes) or Llama 3.1's JSON calls (the answer is `{"name": ...,
/// "parameters": {...}}`). `auto` (default) parses whatever calls the model makes, `none` parses none;
/// `required` and a named function force a call: the answer is constrained (json_mode) to one bare call object,
/// `{"name": <one of the tools>, KEY: {...}}` (`required`: any object as arguments) or `{"name": <that
/// function>, KEY: <its parameters schema>}` (named), KEY being the form's (`arguments` or `parameters`). A
/// template that renders tools in no known form is refused by name rather than answered as if there were none.
fn tools_asked(
    state: &AppState,
    o: &serde_json::Map<String, Value>,
) -> Result<Option<Tools>, ApiError> {
    let Some(list) = o.get("tools").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |m: String| ApiError::bad(m, Some("tools"));
    let list = list
        .as_array()
        .ok_or_else(|| bad("tools must be a list of function tools".into()))?;
    if list.is_empty() {
        return Ok(None);
    }
    let mut names = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let name = tool
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        match name {
            Some(name) if tool.get("type").and_then(Value::as_str) == Some("function") => {
                names.push(name.to_string())
            }
            _ => {
                return Err(bad(format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}"
                )))
            }
        }
    }
    // The form is checked after `tool_choice` (whose errors name the request's own mistake first).
    let form = state
        .engine
        .chat_template
        .as_ref()
        .and_then(|t| t.tool_call_form());
    let call_of = |name: Value, arguments: Value| forced_call_schema(form, name, arguments);
    let bad_choice = |m: String| ApiError::bad(m, Some("tool_choice"));
    let (parse, forced) = match o.get("tool_choice") {
        None | Some(Value::Null) => (true, None),
        Some(Value::String(c)) if c == "auto" => (true, None),
        Some(Value::String(c)) if c == "none" => (false, None),
        Some(Value::String(c)) if c == "required" => (
            true,
            Some(call_of(json!({"enum": names}), json!({"type": "object"}))),
        ),
        Some(choice @ Value::Object(_)) => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| choice.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad_choice(
                        "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \
                         \"function\": {\"name\": ...}}"
                            .into(),
                    )
                })?;
            let i = names.iter().position(|n| n == name).ok_or_else(|| {
                bad_choice(format!(
                    "tool_choice names {name:?}, which is not among the tools ({})",
                    names.join(", ")
                ))
            })?;
            let parameters = list[i]["function"]
                .get("parameters")
                .filter(|p| !p.is_null())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            (true, Some(call_of(json!({"const": name}), parameters)))
        }
        Some(other) => {
            return Err(bad_choice(format!(
                "tool_choice {other} is not known: \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \
                 \"function\": {{\"name\": ...}}}}"
            )))
        }
    };
    if form.is_none() {
        return Err(bad(format!(
            "this model's chat template does not render tools in a form this server parses (Hermes \
             <tool_call> blocks: Qwen2 / Qwen2.5 templates; JSON calls: Llama 3.1-3.3 templates); {} was not \
             given its tools",
            state.engine.model_name
        )));
    }
    let parse_calls = parse.then(|| Arc::new(names));
    Ok(Some(Tools {
        definitions: Value::Array(list.clone()),
        parse_calls,
        forced,
    }))
}

/// The schema a forced tool call's answer must match: one call object in the template's form, `{"name": NAME,
/// KEY: ARGUMENTS}` (KEY `arguments`, or `parameters` for Llama 3.1's JSON calls).
fn forced_call_schema(
    form: Option<specula::chat::ToolCallForm>,
    name: Value,
    arguments: Value,
) -> Value {
    let key = form.map_or("arguments", |f| f.arguments_key());
    json!({"type": "object", "properties": {"name": name, key: arguments},
           "required": ["name", key], "additionalProperties": false})
}

/// An answer's tool calls, in the Hermes form (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
/// Qwen2.5's template asks): the text outside the blocks (None when blank) and the calls in OpenAI's shape,
/// arguments as a JSON string. Small models often drop the tags: an answer that is nothing but one such object
/// naming one of `names` is a call too. None where the answer holds no call, or a block is not one (then it is all
/// content, as vLLM's Hermes parser leaves it).
fn parse_tool_calls(
    text: &str,
    names: &[String],
    id_seed: u64,
) -> Option<(Option<String>, Vec<Value>)> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let call_of = |json: &str, index: usize| -> Option<Value> {
        let call: Value = serde_json::from_str(json.trim()).ok()?;
        let name = call.get("name")?.as_str()?;
        let arguments = match call.get("arguments").or(call.get("parameters")) {
            None | Some(Value::Null) => "{}".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v @ Value::Object(_)) => v.to_string(),
            Some(_) => return None,
        };
        Some(json!({
            "id": format!("call_{:016x}", id_seed.wrapping_add(index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }))
    };
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        content.push_str(&rest[..start]);
        let after = &rest[start + OPEN.len()..];
        let end = after.find(CLOSE)?;
        calls.push(call_of(&after[..end], calls.len())?);
        rest = &after[end + CLOSE.len()..];
    }
    if calls.is_empty() {
        // Bare calls: the whole answer one call object naming a tool (Llama 3.1's form, and small models that
        // drop Hermes tags), or several separated by `;`, optionally after Llama's `<|python_tag|>`.
        let body = text.trim();
        let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
        let mut calls = Vec::new();
        let mut rest = body.trim();
        while !rest.is_empty() {
            let mut objects = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
            objects.next()?.ok()?;
            let end = objects.byte_offset();
            let call = call_of(&rest[..end], calls.len())?;
            if !names.iter().any(|n| call["function"]["name"] == n.as_str()) {
                return None;
            }
            calls.push(call);
            rest = rest[end..].trim_start();
            if let Some(after) = rest.strip_prefix(';') {
                rest = after.trim_start();
            } else if !rest.is_empty() {
                return None;
            }
        }
        return (!calls.is_empty()).then_some((None, calls));
    }
    content.push_str(rest);
    let content = content.trim();
    Some(((!content.is_empty()).then(|| content.to_string()), calls))
}

/// A streamed chat answer with tools: its text, how much of it went out as content, and the log-probabilities of
/// tokens not sent yet.
#[derive(Clone, Default)]
struct ToolStream {
    text: String,
    sent: usize,
    /// A call may have begun: the rest is held to the end.
    holding: bool,
    tokens: Vec<engine::ScoredToken>,
}

impl ToolStream {
    /// The content that can go out now, with its tokens' log-probabilities: the text up to a `<tool_call>` (or a
    /// tail that may begin one). An answer that begins with `{` may be a bare call and is held whole.
    fn stream_content(&mut self) -> Option<(String, Vec<engine::ScoredToken>)> {
        const OPEN: &str = "<tool_call>";
        if self.holding {
            return None;
        }
        if self.sent == 0 {
            match self.text.trim_start().chars().next() {
                None => return None,
                Some('{') => {
                    self.holding = true;
                    return None;
                }
                Some(_) => {}
            }
        }
        let pending = &self.text[self.sent..];
        let cut = match pending.find(OPEN) {
            Some(i) => {
                self.holding = true;
                i
            }
            // Hold a tail that could still grow into the tag.
            None => (1..OPEN.len())
                .rev()
                .find(|&k| pending.ends_with(&OPEN[..k]))
                .map_or(pending.len(), |k| pending.len() - k),
        };
        if cut == 0 {
            return None;
        }
        let content = pending[..cut].to_string();
        self.sent += cut;
        let n = self.tokens.partition_point(|t| t.offset < self.sent);
        Some((content, self.tokens.drain(..n).collect()))
    }
}

/// A chat choice's message and finish reason: with tools, the calls parsed out of the text (finish reason
/// `tool_calls` where the model stopped by itself after them).
fn chat_message(
    text: String,
    finish_reason: &str,
    tools: Option<&[String]>,
    id_seed: u64,
) -> (Value, String) {
    if let Some(names) = tools {
        if let Some((content, calls)) = parse_tool_calls(&text, names, id_seed) {
            let finish = if finish_reason == "stop" {
                "tool_calls"
            } else {
                finish_reason
            };
            return (
                json!({"role": "assistant", "content": content, "tool_calls": calls}),
                finish.to_string(),
            );
        }
    }
    (
        json!({"role": "assistant", "content": text}),
        finish_reason.to_string(),
    )
}

/// `presence_penalty`, `frequency_penalty`, vLLM's `repetition_penalty` and `logit_bias` (token ids as strings,
/// OpenAI's form, to biases), checked; None when all are neutral.
fn adjustments(
    state: &AppState,
    o: &serde_json::Map<String, Value>,
) -> Result<Option<LogitAdjustments>, ApiError> {
    let mut a = LogitAdjustments::default();
    if let Some(v) = number(o, "presence_penalty")? {
        a.presence_penalty = v as f32;
    }
    if let Some(v) = number(o, "frequency_penalty")? {
        a.frequency_penalty = v as f32;
    }
    if let Some(v) = number(o, "repetition_penalty")? {
        a.repetition_penalty = v as f32;
    }
    let bad_bias = || {
        ApiError::bad(
            "logit_bias must map token ids (as strings) to numbers",
            Some("logit_bias"),
        )
    };
    match o.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                let token: u32 = k.trim().parse().map_err(|_| bad_bias())?;
                let bias = v.as_f64().ok_or_else(bad_bias)?;
                a.logit_bias.push((token, bias as f32));
            }
        }
        Some(_) => return Err(bad_bias()),
    }
    a.json = output_constraint(state, o)?;
    a.validate(state.engine.vocab_size).map_err(|e| {
        let message = e.to_string();
        let param = [
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
        ]
        .into_iter()
        .find(|p| message.contains(p));
        ApiError::bad(message, param)
    })?;
    Ok((!a.is_neutral()).then_some(a))
}

/// What a request's `response_format` asks for.
enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema(Value),
}

/// `response_format`: `{"type": "text"}` (or none) leaves the output free, `{"type": "json_object"}` constrains
/// it to one JSON object, `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` to one object
/// matching the schema (specula::json_mode; a schema it cannot enforce is refused by name, never answered
/// unconstrained).
fn response_format(o: &serde_json::Map<String, Value>) -> Result<ResponseFormat, ApiError> {
    let Some(v) = o.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(ResponseFormat::Text);
    };
    let bad = |message: String| Err(ApiError::bad(message, Some("response_format")));
    let Some(kind) = v.as_object().and_then(|f| f.get("type")) else {
        return bad(
            "response_format must be an object with a type: \"text\", \"json_object\" or \"json_schema\"".into(),
        );
    };
    match kind.as_str() {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let Some(spec) = v.get("json_schema").and_then(Value::as_object) else {
                return bad(
                    "response_format json_schema needs a json_schema object: {\"name\": ..., \"schema\": {...}}"
                        .into(),
                );
            };
            match spec.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(ResponseFormat::JsonSchema(schema.clone()))
                }
                Some(other) => bad(format!(
                    "response_format json_schema.schema must be a JSON Schema object, got {other}"
                )),
                None => bad("response_format json_schema has no schema".into()),
            }
        }
        _ => bad(format!(
            "response_format type {kind} is not known; use \"text\", \"json_object\" or \"json_schema\""
        )),
    }
}

/// What a request constrains its output to, and the field that asked.
enum OutputShape {
    JsonObject,
    JsonSchema(Value),
    Regex(String),
    Choices(Vec<String>),
}

/// The output constraint a request asks for, under any of the names clients use: OpenAI's `response_format`;
/// vLLM's `guided_json` / `guided_regex` / `guided_choice` and `structured_outputs` {`json`, `regex`, `choice`,
/// `json_object`}; SGLang's `regex` and `json_schema`; llama.cpp's `json_schema`. At most one may be given.
/// Grammars (`guided_grammar`, `structured_outputs.grammar`, SGLang's `ebnf`, llama.cpp's GBNF `grammar`) are
/// refused by name: answering without them would be a silently different answer.
fn output_constraint(
    state: &AppState,
    o: &serde_json::Map<String, Value>,
) -> Result<Option<Arc<specula::json_mode::JsonConstraint>>, ApiError> {
    let mut asked: Vec<(&'static str, OutputShape)> = Vec::new();
    match response_format(o)? {
        ResponseFormat::Text => {}
        ResponseFormat::JsonObject => asked.push(("response_format", OutputShape::JsonObject)),
        ResponseFormat::JsonSchema(schema) => {
            asked.push(("response_format", OutputShape::JsonSchema(schema)))
        }
    }
    let present = |key: &str| o.get(key).filter(|v| !v.is_null());
    for key in ["guided_grammar", "ebnf", "grammar"] {
        if present(key).is_some_and(|v| v.as_str() != Some("")) {
            return Err(ApiError::bad(
                format!(
                    "{key} is not supported by this server: grammars are not enforced; constrain the output with \
                     response_format (JSON Schema), guided_regex / regex, or guided_choice"
                ),
                Some(key),
            ));
        }
    }
    for (key, field) in [
        ("guided_json", "guided_json"),
        ("json_schema", "json_schema"),
    ] {
        if let Some(v) = present(key) {
            asked.push((field, OutputShape::JsonSchema(schema_value(v, field)?)));
        }
    }
    for (key, field) in [("guided_regex", "guided_regex"), ("regex", "regex")] {
        if let Some(v) = present(key) {
            asked.push((field, OutputShape::Regex(regex_value(v, field)?)));
        }
    }
    if let Some(v) = present("guided_choice") {
        asked.push((
            "guided_choice",
            OutputShape::Choices(choices_value(v, "guided_choice")?),
        ));
    }
    if let Some(v) = present("structured_outputs") {
        let Some(so) = v.as_object() else {
            return Err(ApiError::bad(
                "structured_outputs must be an object with one of json, regex, choice or json_object",
                Some("structured_outputs"),
            ));
        };
        for (key, value) in so.iter().filter(|(_, v)| !v.is_null()) {
            let field = "structured_outputs";
            let shape = match key.as_str() {
                "json" => OutputShape::JsonSchema(schema_value(value, "structured_outputs.json")?),
                "regex" => OutputShape::Regex(regex_value(value, "structured_outputs.regex")?),
                "choice" => OutputShape::Choices(choices_value(value, "structured_outputs.choice")?),
                "json_object" if value.as_bool() == Some(true) => OutputShape::JsonObject,
                "json_object" if value.as_bool() == Some(false) => continue,
                "grammar" | "structural_tag" => {
                    return Err(ApiError::bad(
                        format!("structured_outputs.{key} is not supported by this server: use json, regex or choice"),
                        Some(field),
                    ))
                }
                // Options of how a constraint is enforced, not what it is.
                "backend" | "disable_fallback" | "disable_any_whitespace" | "disable_additional_properties"
                | "whitespace_pattern" => continue,
                other => {
                    return Err(ApiError::bad(
                        format!("structured_outputs.{other} is not known; use json, regex, choice or json_object"),
                        Some(field),
                    ))
                }
            };
            asked.push((field, shape));
        }
    }
    if let [(first, _), (second, _), ..] = asked.as_slice() {
        return Err(ApiError::bad(
            format!("{first} and {second} both constrain the output; give one"),
            Some(second),
        ));
    }
    let Some((field, shape)) = asked.pop() else {
        return Ok(None);
    };
    let engine = &state.engine;
    let built = match &shape {
        OutputShape::JsonObject => engine.json_constraint(None),
        OutputShape::JsonSchema(schema) => engine.json_constraint(Some(schema)),
        OutputShape::Regex(regex) => engine.regex_constraint(regex),
        OutputShape::Choices(choices) => engine.choice_constraint(choices),
    };
    built.map(Some).map_err(|e| {
        // response_format's errors read as before (their text names json_schema).
        let message = match field {
            "response_format" => e.to_string(),
            _ => format!("{field}: {e}"),
        };
        ApiError::bad(message, Some(field))
    })
}

/// A JSON Schema given as an object (or `true` / `false`), or as a string holding one (vLLM and SGLang accept both).
fn schema_value(v: &Value, field: &'static str) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(text) => match serde_json::from_str::<Value>(text) {
            Ok(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(schema),
            Ok(_) => Err(ApiError::bad(
                format!("{field} must hold a JSON Schema object"),
                Some(field),
            )),
            Err(e) => Err(ApiError::bad(
                format!("{field} is a string that is not JSON: {e}"),
                Some(field),
            )),
        },
        other => Err(ApiError::bad(
            format!("{field} must be a JSON Schema object, got {other}"),
            Some(field),
        )),
    }
}

fn regex_value(v: &Value, field: &'static str) -> Result<String, ApiError> {
    match v.as_str() {
        Some(regex) if regex.len() <= MAX_REGEX_BYTES => Ok(regex.to_string()),
        Some(regex) => Err(ApiError::bad(
            format!(
                "{field} is {} bytes long; at most {MAX_REGEX_BYTES} are taken",
                regex.len()
            ),
            Some(field),
        )),
        None => Err(ApiError::bad(
            format!("{field} must be a string (a regex)"),
            Some(field),
        )),
    }
}

fn choices_value(v: &Value, field: &'static str) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::bad(format!("{field} must be a list of strings"), Some(field));
    let list = v.as_array().ok_or_else(bad)?;
    let choices: Vec<String> = list
        .iter()
        .map(|c| c.as_str().map(str::to_string).ok_or_else(bad))
        .collect::<Result<_, _>>()?;
    let bytes: usize = choices.iter().map(String::len).sum();
    if bytes > MAX_REGEX_BYTES {
        return Err(ApiError::bad(
            format!("{field} holds {bytes} bytes of text; at most {MAX_REGEX_BYTES} are taken"),
            Some(field),
        ));
    }
    Ok(choices)
}

/// Bytes a regex (or a list of choices) may hold: its automaton is built before the request is queued.
const MAX_REGEX_BYTES: usize = 16 << 10;

/// The log-probabilities a request asks for: completions' `logprobs` is the number of alternatives (0: the
/// chosen token's only); chat's is a boolean, with `top_logprobs` alternatives.
fn logprobs_asked(
    o: &serde_json::Map<String, Value>,
    kind: Kind,
) -> Result<Option<LogprobsRequest>, ApiError> {
    let most = specula::sampling::MAX_TOP_LOGPROBS as u64;
    let top = |key: &'static str| -> Result<Option<usize>, ApiError> {
        match integer(o, key)? {
            Some(n) if n > most => Err(ApiError::bad(
                format!("{key} is {n}; at most {most} alternatives a position are returned"),
                Some(key),
            )),
            n => Ok(n.map(|n| n as usize)),
        }
    };
    let top = match kind {
        Kind::Completion => {
            match o.get("logprobs") {
                Some(Value::Bool(false)) => return Ok(None),
                Some(Value::Bool(true)) => {
                    return Err(ApiError::bad(
                    "logprobs of a completion is the number of alternatives to return (0 to 20), not a boolean",
                    Some("logprobs"),
                ))
                }
                _ => top("logprobs")?,
            }
        }
        Kind::Chat => {
            let asked = match o.get("logprobs") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::bad(
                        "logprobs of a chat completion must be a boolean (top_logprobs gives the number of alternatives)",
                        Some("logprobs"),
                    ))
                }
            };
            let n = top("top_logprobs")?;
            if n.is_some() && !asked {
                return Err(ApiError::bad(
                    "top_logprobs needs logprobs: true",
                    Some("top_logprobs"),
                ));
            }
            asked.then_some(n.unwrap_or(0))
        }
    };
    Ok(top.map(|top| LogprobsRequest { top, prompt: false }))
}

/// A log-probability as JSON: OpenAI's -9999 stands for an impossible token (JSON has no infinity).
fn logprob_json(v: f32) -> Value {
    json!(if v.is_finite() { f64::from(v) } else { -9999.0 })
}

/// A token's text and exact bytes. A token holding part of a UTF-8 character is written `bytes:\xNN...` (OpenAI's
/// convention), so tokens of different bytes never share a name (completions key alternatives by name).
fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id);
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t.to_string(),
        Err(_) => {
            let escaped: String = bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
            format!("bytes:{escaped}")
        }
    };
    (text, bytes)
}

/// Completions' `logprobs` object (the legacy shape) for tokens given as (id, its log-probabilities (None for a
/// prompt's first token, which has none), where its text starts in the choice's text).
fn completion_logprobs(
    tokenizer: &Tokenizer,
    items: &[(u32, Option<&TokenLogprob>, usize)],
) -> Value {
    let mut tokens = Vec::with_capacity(items.len());
    let mut token_logprobs = Vec::with_capacity(items.len());
    let mut top_logprobs = Vec::with_capacity(items.len());
    let mut text_offset = Vec::with_capacity(items.len());
    for &(id, lp, offset) in items {
        tokens.push(json!(token_text(tokenizer, id).0));
        text_offset.push(json!(offset));
        match lp {
            None => {
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
            }
            Some(lp) => {
                token_logprobs.push(logprob_json(lp.logprob));
                // The alternatives and the chosen token (OpenAI: up to logprobs + 1 entries).
                let mut top = serde_json::Map::new();
                for &(t, l) in &lp.top {
                    top.insert(token_text(tokenizer, t).0, logprob_json(l));
                }
                top.entry(token_text(tokenizer, lp.token).0)
                    .or_insert_with(|| logprob_json(lp.logprob));
                top_logprobs.push(Value::Object(top));
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
           "text_offset": text_offset})
}

/// Chat's `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`.
fn chat_logprobs<'a>(
    tokenizer: &Tokenizer,
    items: impl IntoIterator<Item = &'a TokenLogprob>,
) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(tokenizer, id);
        json!({"token": token, "logprob": logprob_json(logprob), "bytes": bytes})
    };
    let content: Vec<Value> = items
        .into_iter()
        .map(|lp| {
            let mut e = entry(lp.token, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The text offset where each prompt token starts in the prompt's decoded text (the first at 0).
fn prompt_offsets(tokenizer: &Tokenizer, tokens: &[u32]) -> Vec<usize> {
    let mut decoder = specula::tokenizer::StreamDecoder::new();
    let mut len = 0;
    tokens
        .iter()
        .map(|&t| {
            let start = len;
            len += decoder
                .push(tokenizer, t)
                .ok()
                .flatten()
                .map_or(0, |piece| piece.len());
            start
        })
        .collect()
}

/// Completions' items for the echoed prompt: its first token without log-probabilities, then the rest's.
fn prompt_items<'a>(
    tokenizer: &Tokenizer,
    tokens: &[u32],
    logprobs: &'a [TokenLogprob],
) -> Vec<(u32, Option<&'a TokenLogprob>, usize)> {
    let offsets = prompt_offsets(tokenizer, tokens);
    tokens
        .iter()
        .zip(offsets)
        .enumerate()
        .map(|(i, (&t, at))| (t, i.checked_sub(1).and_then(|j| logprobs.get(j)), at))
        .collect()
}

/// `n` (default 1), and `best_of`, which may only repeat it: there is no ranking of choices here.
fn choices(state: &AppState, o: &serde_json::Map<String, Value>) -> Result<usize, ApiError> {
    let n = integer(o, "n")?.unwrap_or(1);
    let most = MAX_CHOICES.min(state.engine.max_queue()) as u64;
    if n == 0 || n > most {
        return Err(ApiError::bad(
            format!(
                "n is {n}; it must be between 1 and {most} (choices a request may ask for here)"
            ),
            Some("n"),
        ));
    }
    if let Some(best_of) = integer(o, "best_of")? {
        if best_of != n {
            return Err(ApiError::bad(
                format!(
                    "best_of is {best_of}; this server does not rank choices, so it must equal n ({n}) or be left out"
                ),
                Some("best_of"),
            ));
        }
    }
    Ok(n as usize)
}

/// Refuses request fields that would change the answer in ways this server does not do, unless they hold their
/// neutral value: answering without them would be a silently different answer than the client asked for.
/// Fields that change nothing here (`user`, `metadata`, `store`, `tool_choice` without tools, ...) pass.
fn refuse_unsupported(o: &serde_json::Map<String, Value>, kind: Kind) -> Result<(), ApiError> {
    let refuse = |key: &'static str, why: &str| {
        Err(ApiError::bad(
            format!("{key} is not supported by this server: {why}"),
            Some(key),
        ))
    };
    let present = |key: &str| o.get(key).filter(|v| !v.is_null());
    let listed =
        |key: &str| present(key).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()));
    if listed("functions") {
        return refuse(
            "functions",
            "the legacy functions field is not parsed; give them as tools (type function)",
        );
    }
    if kind == Kind::Completion && listed("tools") {
        return refuse(
            "tools",
            "tools are taken by /v1/chat/completions, whose chat template renders them",
        );
    }
    // Other engines' samplers (vLLM, llama.cpp, SGLang extras), refused unless neutral.
    for (key, neutral) in [
        ("typical_p", 1.0),
        ("tfs_z", 1.0),
        ("mirostat", 0.0),
        ("mirostat_mode", 0.0),
        ("dry_multiplier", 0.0),
        ("xtc_probability", 0.0),
        ("top_a", 0.0),
    ] {
        if present(key).is_some_and(|v| v.as_f64() != Some(neutral)) {
            return refuse(
                key,
                "this sampler setting is not implemented here (samplers: temperature, top_p, top_k, min_p, \
                 penalties, logit_bias)",
            );
        }
    }
    if present("use_beam_search").is_some_and(|v| v.as_bool() != Some(false)) {
        return refuse("use_beam_search", "beam search is not implemented");
    }
    if kind == Kind::Completion && present("suffix").is_some_and(|v| v.as_str() != Some("")) {
        return refuse(
            "suffix",
            "fill-in-the-middle is not supported; put the text in the prompt",
        );
    }
    Ok(())
}

/// The usage of a request's choices together (`n` a prompt, prompt by prompt): each prompt counted once (OpenAI's
/// convention), the completions and speculative stats summed, each phase's time the longest choice's.
fn usage_of(choices: &[Finished], n: usize) -> Value {
    let Some(first) = choices.first() else {
        return Value::Null;
    };
    let mut f = first.clone();
    for (i, c) in choices.iter().enumerate().skip(1) {
        if i % n.max(1) == 0 {
            f.prompt_tokens += c.prompt_tokens;
            f.cached_prompt_tokens += c.cached_prompt_tokens;
        }
        f.completion_tokens += c.completion_tokens;
        f.drafted += c.drafted;
        f.accepted += c.accepted;
        f.cycles += c.cycles;
        f.queue_s = f.queue_s.max(c.queue_s);
        f.prefill_s = f.prefill_s.max(c.prefill_s);
        f.decode_s = f.decode_s.max(c.decode_s);
    }
    usage(&f)
}

fn usage(f: &Finished) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        // OpenAI's field: prompt tokens served from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": f.cached_prompt_tokens},
        "speculation": {
            "drafted": f.drafted,
            "accepted": f.accepted,
            "cycles": f.cycles,
            "mean_accepted_length": if f.cycles > 0 { 1.0 + f.accepted as f64 / f.cycles as f64 } else { 1.0 },
        },
        "timing": {"queue_s": f.queue_s, "prefill_s": f.prefill_s, "decode_s": f.decode_s},
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// Counts a handler's answer by status.
fn counted(state: &AppState, r: Result<Response, ApiError>) -> Result<Response, ApiError> {
    let status = match &r {
        Ok(resp) => resp.status(),
        Err(e) => e.status,
    };
    state
        .metrics
        .requests
        .with_label_values(&[status.as_str()])
        .inc();
    r
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let r = completions_inner(state.clone(), headers, body).await;
    counted(&state, r)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let r = chat_completions_inner(state.clone(), headers, body).await;
    counted(&state, r)
}

async fn completions_inner(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    check_key(&state, &headers)?;
    let o = parse_body(&body)?;
    refuse_unsupported(&o, Kind::Completion)?;
    let inputs = parse_prompt(&state, &o)?;
    let mut c = common(&state, &o, 16)?;
    let most = MAX_CHOICES.min(state.engine.max_queue());
    if inputs.len() * c.n > most {
        return Err(ApiError::bad(
            format!(
                "{} prompts with n = {} ask for {} choices; at most {most} are answered in one request",
                inputs.len(),
                c.n,
                inputs.len() * c.n
            ),
            Some("prompt"),
        ));
    }
    c.logprobs = logprobs_asked(&o, Kind::Completion)?;
    c.echo = match o.get("echo") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => return Err(ApiError::bad("echo must be a boolean", Some("echo"))),
    };
    if c.echo {
        // With the prompt echoed, its tokens' log-probabilities come too (what scoring harnesses read).
        if let Some(lp) = c.logprobs.as_mut() {
            lp.prompt = true;
        }
    }
    run(state, inputs, c, Kind::Completion).await
}

/// A completion's `prompt`: a string, a list of token ids, or a list of either (OpenAI's forms: several prompts
/// in one request, each answered by `n` choices of its own, indexed prompt by prompt).
fn parse_prompt(
    state: &AppState,
    o: &serde_json::Map<String, Value>,
) -> Result<Vec<Input>, ApiError> {
    let bad = |m: String| ApiError::bad(m, Some("prompt"));
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|v| {
                let id = v
                    .as_u64()
                    .filter(|&t| t <= u32::MAX as u64)
                    .ok_or_else(|| {
                        bad(format!("a token-id prompt holds only token ids, got {v}"))
                    })?;
                if id as usize >= state.engine.vocab_size {
                    return Err(bad(format!(
                        "token {id} is outside the vocabulary of {}",
                        state.engine.vocab_size
                    )));
                }
                Ok(id as u32)
            })
            .collect()
    };
    let one = |v: &Value| -> Result<Input, ApiError> {
        match v {
            Value::String(s) => Ok(Input::Prompt(s.clone())),
            Value::Array(t) => Ok(Input::Tokens(ids(t)?)),
            _ => Err(bad(
                "each prompt must be a string or a list of token ids".into()
            )),
        }
    };
    let inputs = match o.get("prompt") {
        None | Some(Value::Null) => return Err(bad("prompt is required".into())),
        Some(Value::String(s)) => vec![Input::Prompt(s.clone())],
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => vec![Input::Tokens(ids(a)?)],
        Some(Value::Array(a)) => a.iter().map(one).collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(bad("prompt must be a string or a list of token ids".into())),
    };
    for (i, input) in inputs.iter().enumerate() {
        let empty = match input {
            Input::Prompt(p) => p.is_empty(),
            Input::Tokens(t) => t.is_empty(),
            Input::Chat(..) => false,
        };
        if empty {
            return Err(bad(if inputs.len() == 1 {
                "prompt is empty".into()
            } else {
                format!("prompt {i} is empty")
            }));
        }
    }
    Ok(inputs)
}

/// The roles a message may take: OpenAI's, and Llama 3.1's `ipython` (its templates' tool-output turn).
const CHAT_ROLES: [&str; 7] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
    "ipython",
];

/// The request's `messages`: a non-empty list of {role, content} strings. A `developer` message (OpenAI's newer
/// name for instructions) is rendered as `system`, the role chat templates and the models trained on them know;
/// a role outside CHAT_ROLES is refused by name rather than passed to a template that would render it as text.
fn parse_messages(o: &serde_json::Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    match o.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = m.get("role").and_then(Value::as_str);
                if let Some(r) = role.filter(|r| !CHAT_ROLES.contains(r)) {
                    return Err(ApiError::bad(
                        format!(
                            "messages[{i}].role must be one of {}; got {r:?}",
                            CHAT_ROLES.join(", ")
                        ),
                        Some("messages"),
                    ));
                }
                let role = role.map(|r| if r == "developer" { "system" } else { r });
                let tool_calls = template_tool_calls(m)?;
                let content = match m.get("content") {
                    Some(Value::String(c)) => Some(c.clone()),
                    Some(Value::Array(parts)) => Some(text_parts(parts)?),
                    // An assistant turn that only called tools has no content.
                    None | Some(Value::Null) if tool_calls.is_some() => Some(String::new()),
                    _ => None,
                };
                match (role, content) {
                    (Some(r), Some(c)) => Ok(ChatMessage {
                        role: r.to_string(),
                        content: c,
                        tool_calls,
                    }),
                    _ => Err(ApiError::bad(
                        "each message needs a string role and a string content (or a list of text parts)",
                        Some("messages"),
                    )),
                }
            })
            .collect(),
        Some(Value::Array(_)) => Err(ApiError::bad("messages is empty", Some("messages"))),
        None => Err(ApiError::bad("messages is required", Some("messages"))),
        Some(_) => Err(ApiError::bad("messages must be a list", Some("messages"))),
    }
}

/// An assistant message's `tool_calls` (OpenAI's shape, arguments as a JSON string) as chat templates read them:
/// arguments as an object (Qwen2.5's template writes `arguments | tojson`).
fn template_tool_calls(m: &Value) -> Result<Option<Value>, ApiError> {
    let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = || {
        ApiError::bad(
            "tool_calls must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": \"{...}\"}}",
            Some("messages"),
        )
    };
    let calls = calls.as_array().ok_or_else(bad)?;
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let f = call.get("function").ok_or_else(bad)?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(bad)?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                ApiError::bad(
                    format!("the arguments of tool call {name:?} are not JSON: {e}"),
                    Some("messages"),
                )
            })?,
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => return Err(bad()),
        };
        out.push(json!({"type": "function", "function": {"name": name, "arguments": arguments}}));
    }
    Ok(Some(Value::Array(out)))
}

/// A message's content given as parts (OpenAI's newer form): the text parts joined; other kinds (images,
/// audio, files) are refused by name, since a text model would answer without them.
fn text_parts(parts: &[Value]) -> Result<String, ApiError> {
    let mut text = String::new();
    for part in parts {
        match (
            part.get("type").and_then(Value::as_str),
            part.get("text").and_then(Value::as_str),
        ) {
            (Some("text"), Some(t)) => text.push_str(t),
            (Some("text"), None) => {
                return Err(ApiError::bad(
                    "a text content part needs a string text",
                    Some("messages"),
                ))
            }
            (Some(other), _) => {
                return Err(ApiError::bad(
                    format!(
                    "content parts of type {other:?} are not supported: this model reads text only"
                ),
                    Some("messages"),
                ))
            }
            (None, _) => {
                return Err(ApiError::bad(
                    "each content part needs a type",
                    Some("messages"),
                ))
            }
        }
    }
    Ok(text)
}

async fn chat_completions_inner(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    check_key(&state, &headers)?;
    let o = parse_body(&body)?;
    refuse_unsupported(&o, Kind::Chat)?;
    let messages = parse_messages(&o)?;
    let tools = tools_asked(&state, &o)?;
    let mut c = common(&state, &o, 256)?;
    c.logprobs = logprobs_asked(&o, Kind::Chat)?;
    c.tool_names = tools.as_ref().and_then(|t| t.parse_calls.clone());
    if let Some(schema) = tools.as_ref().and_then(|t| t.forced.as_ref()) {
        // A forced call: the answer is constrained to the call object (a parameters schema the grammar cannot
        // enforce is refused by name, as a response_format's would be).
        let constraint = state.engine.json_constraint(Some(schema)).map_err(|e| {
            ApiError::bad(format!("the forced tool call: {e}"), Some("tool_choice"))
        })?;
        let a = c.logit_adjustments.get_or_insert_with(Default::default);
        if a.json.is_some() {
            return Err(ApiError::bad(
                "an output constraint (response_format, guided_json, guided_regex, guided_choice, regex, \
                 structured_outputs) and a tool_choice that forces a call cannot both constrain the answer",
                Some("tool_choice"),
            ));
        }
        a.json = Some(constraint);
    }
    run(
        state,
        vec![Input::Chat(messages, tools.map(|t| t.definitions))],
        c,
        Kind::Chat,
    )
    .await
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A prompt ready for the engine: its tokens, and its text when echoed.
struct Prompt {
    tokens: Vec<u32>,
    echo: Option<String>,
}

async fn run(
    state: Arc<AppState>,
    inputs: Vec<Input>,
    c: Common,
    kind: Kind,
) -> Result<Response, ApiError> {
    let queued_at = std::time::Instant::now();
    // Tokenized here, on a blocking-task thread, not on the engine thread the device waits on between steps.
    let tokenizing = state.clone();
    let echo = c.echo;
    let prompts = tokio::task::spawn_blocking(move || -> Result<Vec<Prompt>, ApiError> {
        let tokenizer = &tokenizing.engine.tokenizer;
        inputs
            .into_iter()
            .map(|input| {
                let tokens =
                    tokenize_input(tokenizer, tokenizing.engine.chat_template.as_ref(), &input)
                        .map_err(|e| ApiError::bad(e, None))?;
                if tokens.is_empty() {
                    return Err(ApiError::bad("the prompt is empty", None));
                }
                let echo = match (echo, input) {
                    (false, _) | (_, Input::Chat(..)) => None,
                    (true, Input::Prompt(p)) => Some(p),
                    (true, Input::Tokens(t)) => Some(
                        tokenizer
                            .decode(&t)
                            .map_err(|e| ApiError::bad(e.to_string(), Some("prompt")))?,
                    ),
                };
                Ok(Prompt { tokens, echo })
            })
            .collect()
    })
    .await
    .map_err(|e| server_error(format!("tokenizing the prompt failed: {e}")))??;
    submit_and_answer(state, prompts, c, kind, queued_at).await
}

async fn submit_and_answer(
    state: Arc<AppState>,
    prompts: Vec<Prompt>,
    c: Common,
    kind: Kind,
    queued_at: std::time::Instant,
) -> Result<Response, ApiError> {
    // One engine request per choice (n a prompt, choice p * n + i being prompt p's i-th), each with its own seed
    // (the request's seed + i), queued together; a client that leaves cancels them all.
    let cancel = Arc::new(AtomicBool::new(false));
    let total = prompts.len() * c.n;
    let mut receivers = Vec::with_capacity(total);
    let mut jobs = Vec::with_capacity(total);
    for index in 0..total {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut sampling = c.sampling;
        sampling.seed = sampling.seed.wrapping_add((index % c.n) as u64);
        jobs.push(Job {
            input: Input::Tokens(prompts[index / c.n].tokens.clone()),
            max_tokens: c.max_tokens,
            sampling,
            stop: c.stop.clone(),
            ignore_eos: c.ignore_eos,
            stop_token_ids: c.stop_token_ids.clone(),
            logprobs: c.logprobs,
            logit_adjustments: c.logit_adjustments.clone(),
            events: tx,
            cancel: cancel.clone(),
            queued_at,
        });
        receivers.push(rx);
    }
    state.engine.submit_all(jobs).map_err(|e| match e {
        SubmitError::QueueFull => ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: "the server's queue is full; retry later".into(),
            kind: "rate_limit_error",
            param: None,
        },
        SubmitError::Stopped => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the engine has stopped".into(),
            kind: "server_error",
            param: None,
        },
    })?;
    // Each choice's first event says whether it can run (the prompt fits); one that cannot fails the request.
    for rx in receivers.iter_mut() {
        let refused = match rx.recv().await {
            Some(Event::Started { .. }) => None,
            Some(Event::Done(Err(failure))) => Some(failed(failure)),
            _ => Some(server_error(
                "the engine ended the request without an answer".into(),
            )),
        };
        if let Some(e) = refused {
            cancel.store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(e);
        }
    }
    let id = format!(
        "{}-{:x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        now() ^ (Arc::as_ptr(&cancel) as u64)
    );
    let created = now();
    let model = state.engine.model_name.clone();
    let id_seed = now() ^ (Arc::as_ptr(&cancel) as u64).rotate_left(17);
    if !c.stream {
        let mut choices = Vec::with_capacity(total);
        let mut finished_all = Vec::with_capacity(total);
        let tokenizer = &state.engine.tokenizer;
        for (index, rx) in receivers.iter_mut().enumerate() {
            let prompt = &prompts[index / c.n];
            let echo_len = prompt.echo.as_ref().map_or(0, String::len);
            let mut text = prompt.echo.clone().unwrap_or_default();
            let mut prompt_logprobs = Vec::new();
            let mut scored: Vec<engine::ScoredToken> = Vec::new();
            let finished = loop {
                match rx.recv().await {
                    Some(Event::Text(t, tokens)) => {
                        text.push_str(&t);
                        scored.extend(tokens);
                    }
                    Some(Event::PromptLogprobs(p)) => prompt_logprobs = p,
                    Some(Event::Done(Ok(f))) => break f,
                    Some(Event::Done(Err(failure))) => {
                        cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                        return Err(failed(failure));
                    }
                    Some(Event::Started { .. }) | None => {
                        cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                        return Err(server_error(
                            "the engine ended the request without an answer".into(),
                        ));
                    }
                }
            };
            let logprobs = match (c.logprobs, kind) {
                (None, _) => Value::Null,
                (Some(_), Kind::Completion) => {
                    let scored_prompt: &[u32] = if prompt_logprobs.is_empty() {
                        &[]
                    } else {
                        &prompt.tokens
                    };
                    let mut items = prompt_items(tokenizer, scored_prompt, &prompt_logprobs);
                    items.extend(
                        scored
                            .iter()
                            .map(|s| (s.logprob.token, Some(&s.logprob), echo_len + s.offset)),
                    );
                    completion_logprobs(tokenizer, &items)
                }
                (Some(_), Kind::Chat) => {
                    chat_logprobs(tokenizer, scored.iter().map(|s| &s.logprob))
                }
            };
            choices.push(match kind {
                Kind::Completion => {
                    json!({"index": index, "text": text, "finish_reason": finished.finish_reason, "logprobs": logprobs})
                }
                Kind::Chat => {
                    let (message, finish_reason) = chat_message(
                        text,
                        finished.finish_reason,
                        c.tool_names.as_deref().map(Vec::as_slice),
                        id_seed ^ index as u64,
                    );
                    json!({"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs})
                }
            });
            finished_all.push(finished);
        }
        let body = json!({
            "id": id,
            "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage_of(&finished_all, c.n),
        });
        return Ok(Json(body).into_response());
    }
    // Streaming: one SSE event per text piece (tagged with its choice's index), each choice's finish reason, then
    // the usage when asked, and [DONE]. A client that disconnects drops the stream, which cancels the request at
    // the engine's next step.
    let (sse_tx, sse_rx) = tokio::sync::mpsc::unbounded_channel::<SseEvent>();
    let object = if kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    // The choices' events, merged in the order they come.
    let (merged_tx, mut merged) = tokio::sync::mpsc::unbounded_channel::<(usize, Event)>();
    for (index, mut rx) in receivers.into_iter().enumerate() {
        let merged_tx = merged_tx.clone();
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                if merged_tx.send((index, event)).is_err() {
                    return;
                }
            }
        });
    }
    drop(merged_tx);
    let n = c.n;
    let tokenizer = state.engine.tokenizer.clone();
    tokio::spawn(async move {
        let chunk = |choice: Value, usage: Option<Value>| {
            let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            if let Some(u) = usage {
                v["usage"] = u;
                v["choices"] = json!([]);
            }
            SseEvent::default().data(v.to_string())
        };
        let leave = || cancel.store(true, std::sync::atomic::Ordering::Relaxed);
        // An echo with log-probabilities waits for the prompt's (they come before any text).
        let echo_scored = c.logprobs.is_some_and(|l| l.prompt);
        let echo_len = |index: usize| prompts[index / n].echo.as_ref().map_or(0, String::len);
        for index in 0..total {
            let opening = match (kind, &prompts[index / n].echo) {
                (Kind::Chat, _) => Some(
                    json!({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}),
                ),
                (Kind::Completion, Some(echo)) if !echo_scored => {
                    Some(json!({"index": index, "text": echo, "finish_reason": null}))
                }
                (Kind::Completion, _) => None,
            };
            if opening.is_some_and(|o| sse_tx.send(chunk(o, None)).is_err()) {
                leave();
                return;
            }
        }
        let mut finished_all: Vec<Option<Finished>> = vec![None; total];
        // With tools, text streams as content until it could be a call; from there it is held to the end, where
        // the calls are parsed out of it.
        let mut held: Vec<ToolStream> = vec![ToolStream::default(); total];
        while let Some((index, event)) = merged.recv().await {
            let out = match event {
                Event::Text(t, tokens) if c.tool_names.is_some() => {
                    let h = &mut held[index];
                    h.text.push_str(&t);
                    h.tokens.extend(tokens);
                    let Some((content, tokens)) = h.stream_content() else {
                        continue;
                    };
                    let mut choice = json!({"index": index, "delta": {"content": content}, "finish_reason": null});
                    if c.logprobs.is_some() {
                        choice["logprobs"] =
                            chat_logprobs(&tokenizer, tokens.iter().map(|s| &s.logprob));
                    }
                    chunk(choice, None)
                }
                Event::Text(t, tokens) => {
                    let mut choice = match kind {
                        Kind::Completion => {
                            json!({"index": index, "text": t, "finish_reason": null})
                        }
                        Kind::Chat => {
                            json!({"index": index, "delta": {"content": t}, "finish_reason": null})
                        }
                    };
                    if c.logprobs.is_some() {
                        choice["logprobs"] = match kind {
                            Kind::Completion => {
                                let items: Vec<_> = tokens
                                    .iter()
                                    .map(|s| {
                                        (
                                            s.logprob.token,
                                            Some(&s.logprob),
                                            echo_len(index) + s.offset,
                                        )
                                    })
                                    .collect();
                                completion_logprobs(&tokenizer, &items)
                            }
                            Kind::Chat => {
                                chat_logprobs(&tokenizer, tokens.iter().map(|s| &s.logprob))
                            }
                        };
                    }
                    chunk(choice, None)
                }
                Event::PromptLogprobs(p) => {
                    let prompt = &prompts[index / n];
                    let Some(echo) = prompt.echo.as_ref().filter(|_| echo_scored) else {
                        continue;
                    };
                    let items = prompt_items(&tokenizer, &prompt.tokens, &p);
                    chunk(
                        json!({"index": index, "text": echo, "finish_reason": null,
                               "logprobs": completion_logprobs(&tokenizer, &items)}),
                        None,
                    )
                }
                Event::Done(Ok(f)) => {
                    let mut finish_reason = f.finish_reason.to_string();
                    if let Some(names) = &c.tool_names {
                        let h = std::mem::take(&mut held[index]);
                        let tokens = h.tokens;
                        let (message, reason) = chat_message(
                            h.text[h.sent..].to_string(),
                            f.finish_reason,
                            Some(names.as_slice()),
                            id_seed ^ index as u64,
                        );
                        finish_reason = reason;
                        let mut delta = json!({});
                        if let Some(content) = message
                            .get("content")
                            .filter(|v| v.as_str().is_some_and(|s| !s.is_empty()))
                        {
                            delta["content"] = content.clone();
                        }
                        if let Some(Value::Array(calls)) = message.get("tool_calls") {
                            // Streamed calls carry their position in the list.
                            delta["tool_calls"] = calls
                                .iter()
                                .enumerate()
                                .map(|(i, call)| {
                                    let mut call = call.clone();
                                    call["index"] = json!(i);
                                    call
                                })
                                .collect();
                        }
                        if delta.as_object().is_some_and(|d| !d.is_empty()) || !tokens.is_empty() {
                            let mut choice =
                                json!({"index": index, "delta": delta, "finish_reason": null});
                            if c.logprobs.is_some() {
                                choice["logprobs"] =
                                    chat_logprobs(&tokenizer, tokens.iter().map(|s| &s.logprob));
                            }
                            if sse_tx.send(chunk(choice, None)).is_err() {
                                leave();
                                return;
                            }
                        }
                    }
                    let last = match kind {
                        Kind::Completion => {
                            json!({"index": index, "text": "", "finish_reason": finish_reason})
                        }
                        Kind::Chat => {
                            json!({"index": index, "delta": {}, "finish_reason": finish_reason})
                        }
                    };
                    finished_all[index] = Some(f);
                    if sse_tx.send(chunk(last, None)).is_err() {
                        leave();
                        return;
                    }
                    if finished_all.iter().all(Option::is_some) {
                        if c.include_usage {
                            let all: Vec<Finished> = finished_all.into_iter().flatten().collect();
                            let _ = sse_tx.send(chunk(json!({}), Some(usage_of(&all, n))));
                        }
                        let _ = sse_tx.send(SseEvent::default().data("[DONE]"));
                        return;
                    }
                    continue;
                }
                Event::Done(Err(failure)) => {
                    let e = failed(failure);
                    let _ = sse_tx.send(
                        SseEvent::default().data(
                            json!({"error": {"message": e.message, "type": e.kind, "param": null,
                                         "code": e.status.as_u16()}})
                            .to_string(),
                        ),
                    );
                    leave();
                    return;
                }
                Event::Started { .. } => continue,
            };
            if sse_tx.send(out).is_err() {
                leave();
                return;
            }
        }
    });
    let stream = UnboundedReceiverStream::new(sse_rx).map(Ok::<_, Infallible>);
    Ok(Sse::new(stream).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_are_parsed_from_hermes_blocks_and_bare_calls() {
        let names = vec!["get_weather".to_string(), "add".to_string()];
        // Blocks, with text around them and arguments as an object or a string.
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
        let (content, calls) = parse_tool_calls(text, &names, 7).unwrap();
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(calls[1]["function"]["arguments"], "{\"a\": 1}");
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        // A bare object naming a tool is a call; one naming no tool, or any other text, is content.
        let (content, calls) = parse_tool_calls(
            " {\"name\": \"add\", \"arguments\": {\"a\": 2}} ",
            &names,
            1,
        )
        .unwrap();
        assert!(content.is_none());
        assert_eq!(calls[0]["function"]["name"], "add");
        assert!(parse_tool_calls("{\"name\": \"other\", \"arguments\": {}}", &names, 1).is_none());
        assert!(parse_tool_calls("{\"city\": \"Paris\"}", &names, 1).is_none());
        assert!(parse_tool_calls("It is sunny.", &names, 1).is_none());
        // A block that is not a call, or not closed, leaves everything as content.
        assert!(parse_tool_calls("<tool_call>{\"name\": 3}</tool_call>", &names, 1).is_none());
        assert!(parse_tool_calls("<tool_call>{\"name\": \"add\"", &names, 1).is_none());
        // Llama 3.1's JSON calls: "parameters", several separated by `;`, after `<|python_tag|>`.
        let (content, calls) = parse_tool_calls(
            "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
            &names,
            3,
        )
        .unwrap();
        assert!(content.is_none());
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["arguments"], "{\"a\":1}");
        assert_eq!(calls[1]["function"]["name"], "get_weather");
        // One call among them naming no tool, or text after them, leaves it all content.
        assert!(parse_tool_calls(
            "{\"name\": \"add\", \"parameters\": {}}; {\"name\": \"x\", \"parameters\": {}}",
            &names,
            1
        )
        .is_none());
        assert!(parse_tool_calls(
            "{\"name\": \"add\", \"parameters\": {}} and more",
            &names,
            1
        )
        .is_none());
        // Finish reasons: tool_calls only when the model stopped by itself.
        let call = "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>";
        let (m, finish) = chat_message(call.into(), "stop", Some(&names), 0);
        assert_eq!(finish, "tool_calls");
        assert!(m["content"].is_null());
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{}");
        let (_, finish) = chat_message(call.into(), "length", Some(&names), 0);
        assert_eq!(finish, "length");
        let (m, finish) = chat_message(call.into(), "stop", None, 0);
        assert_eq!(
            (m["content"].as_str(), finish.as_str()),
            (Some(call), "stop")
        );
    }

    /// Streamed with tools, text goes out as content up to where a call may begin; an answer that begins with `{`
    /// (a bare call?) is held whole; each delta takes the log-probabilities of its tokens.
    #[test]
    fn forced_calls_take_the_templates_arguments_key() {
        use specula::chat::ToolCallForm;
        let grammar = |form| {
            specula::json_mode::JsonGrammar::from_schema(&forced_call_schema(
                Some(form),
                json!({"const": "f"}),
                json!({"type": "object"}),
            ))
            .unwrap()
        };
        let whole = |g: &specula::json_mode::JsonGrammar, text: &str| {
            g.after(specula::json_mode::JsonState::default(), text.as_bytes())
                .is_some_and(|s| s.is_done())
        };
        let llama = grammar(ToolCallForm::LlamaJson);
        assert!(whole(&llama, r#"{"name": "f", "parameters": {}}"#));
        assert!(!whole(&llama, r#"{"name": "f", "arguments": {}}"#));
        let hermes = grammar(ToolCallForm::Hermes);
        assert!(whole(&hermes, r#"{"name": "f", "arguments": {}}"#));
        assert!(!whole(&hermes, r#"{"name": "f", "parameters": {}}"#));
    }

    #[test]
    fn tool_streams_send_content_until_a_call_may_begin() {
        let token = |offset| engine::ScoredToken {
            offset,
            logprob: TokenLogprob {
                token: 0,
                logprob: 0.0,
                top: Vec::new(),
            },
        };
        let push = |h: &mut ToolStream, text: &str| {
            let offset = h.text.len();
            h.text.push_str(text);
            h.tokens.push(token(offset));
            h.stream_content().map(|(c, t)| (c, t.len()))
        };
        let mut h = ToolStream::default();
        assert_eq!(push(&mut h, "  "), None); // undecided: only whitespace
        assert_eq!(push(&mut h, "Sure"), Some(("  Sure".into(), 2)));
        assert_eq!(
            push(&mut h, ", calling <tool"),
            Some((", calling ".into(), 1))
        );
        assert_eq!(push(&mut h, "_call>{\"name\""), None);
        assert!(h.holding);
        assert_eq!(h.text[h.sent..], *"<tool_call>{\"name\"");
        // A tail that turns out not to be the tag goes out once it cannot be.
        let mut h = ToolStream::default();
        assert_eq!(push(&mut h, "a <to"), Some(("a ".into(), 1)));
        assert_eq!(push(&mut h, "p"), Some(("<top".into(), 1)));
        let mut h = ToolStream::default();
        assert_eq!(push(&mut h, " {\"name\": "), None);
        assert_eq!(push(&mut h, "\"f\"}"), None);
        assert!(h.holding && h.sent == 0);
    }
}
