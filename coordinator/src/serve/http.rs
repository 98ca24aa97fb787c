//! The HTTP API (axum): OpenAI-compatible completions and chat (JSON and SSE), models,
//! tokenize / detokenize, health, readiness and metrics.
//!
//! Handlers never compute: they validate, tokenize (bounded by the body limit), take a stream
//! permit (429 at once when none is left), hand the request to the compute thread and relay
//! its events. A dropped response (client gone) drops the request's channel, which the compute
//! thread notices at the next step and frees the sequence.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use ternfleet_shared::error::ErrorClass;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::chat::ChatTemplate;
use super::driver::{Cmd, Event};
use super::metrics::Metrics;
use super::openai::{self, ApiError, ChatRequest, CompletionRequest, Limits, Prompt, Valid};
use super::scheduler::{Reject, Submit, TokenLogprob, Usage};
use crate::model::Model;

/// What exists once the model is loaded.
pub struct Engine {
    pub model: Arc<Model>,
    pub chat: ChatTemplate,
    pub tx: std::sync::mpsc::SyncSender<Cmd>,
}

/// Shared by every handler.
pub struct AppState {
    pub engine: OnceLock<Engine>,
    pub ready: Arc<AtomicBool>,
    /// Why the model cannot serve everything right now (a cluster's experts with no live
    /// node); `None` when it can. `/ready` answers 503 with it; requests are still tried.
    pub degraded: Arc<std::sync::Mutex<Option<String>>>,
    pub draining: AtomicBool,
    pub limits: Limits,
    pub metrics: Arc<Metrics>,
    /// One permit per request admitted (running or waiting).
    pub permits: Arc<Semaphore>,
    /// How many permits there are in all.
    pub slots: usize,
    pub api_keys: Vec<String>,
    pub model_name: String,
    pub next_id: AtomicU64,
    pub created: u64,
    /// Default `max_tokens` when a request gives none (up to the context).
    pub default_max_tokens: Option<usize>,
    /// Per-request deadline.
    pub timeout: Duration,
}

/// The router over `state`, with the body limit applied before parsing.
pub fn router(state: Arc<AppState>, max_body: usize) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route("/", get(super::console::page))
        .route("/admin/v1/cluster", get(super::console::cluster))
        .route("/admin/v1/routing", get(super::console::routing))
        .route("/admin/v1/stats", get(super::console::stats))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn(move |req, next| {
            refuse_oversized(max_body, req, next)
        }))
        .with_state(state)
}

/// How much of an oversized body is read (and dropped) before answering, and for how long.
const DRAIN_BYTES: u64 = 64 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(5);

/// A body whose `Content-Length` is over the limit gets the 400 at once, but only after the
/// server has read what the client sends (up to [`DRAIN_BYTES`] / [`DRAIN_TIME`]): closing a
/// socket with unread data resets the connection, and a client still writing its body would
/// see "broken pipe" instead of the answer. A client that sent `Expect: 100-continue` has sent
/// no body yet and gets the 400 at once. The connection is closed afterwards.
async fn refuse_oversized(
    max: usize,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use futures_util::StreamExt;
    let len = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let Some(n) = len.filter(|n| *n > max as u64) else {
        return next.run(req).await;
    };
    // A client that waits for `100 Continue` has sent nothing yet: answer at once, unread.
    let waits = req
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let mut body = req.into_body().into_data_stream();
    let deadline = tokio::time::Instant::now() + DRAIN_TIME;
    let mut read = 0u64;
    while !waits && read < n.min(DRAIN_BYTES) {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(Some(Ok(chunk))) => read += chunk.len() as u64,
            _ => break,
        }
    }
    let mut r = ApiError::new(
        ErrorClass::BadRequest,
        format!("request body of {n} bytes is over the limit of {max} bytes (set by --max-body)"),
    )
    .into_response();
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.class.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, Json(self.body())).into_response();
        if self.class == ErrorClass::Unavailable || self.class == ErrorClass::Overloaded {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn not_found() -> ApiError {
    ApiError::new(ErrorClass::NotFound, "no such endpoint")
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// The server's state as `/ready` and the console say it: `ready`, `loading`, `draining`, or
/// `degraded` with the reason.
pub(crate) fn status(s: &AppState) -> (&'static str, Option<String>) {
    if s.draining.load(Ordering::SeqCst) {
        ("draining", None)
    } else if let Some(why) = s.degraded.lock().ok().and_then(|d| d.clone()) {
        ("degraded", Some(why))
    } else if s.ready.load(Ordering::SeqCst) {
        ("ready", None)
    } else {
        ("loading", None)
    }
}

async fn ready(State(s): State<Arc<AppState>>) -> Response {
    match status(&s) {
        ("ready", _) => Json(json!({"status": "ready"})).into_response(),
        (st, reason) => {
            let mut body = json!({ "status": st });
            if let Some(r) = reason {
                body["reason"] = Value::String(r);
            }
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

/// Bearer key check (constant time per key); `Ok` when no keys are configured.
pub(crate) fn authorize(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    authorize_value(
        s,
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    )
}

/// Bearer key check of an `authorization` value (HTTP header or gRPC metadata).
pub(crate) fn authorize_value(s: &AppState, value: Option<&str>) -> Result<(), ApiError> {
    if s.api_keys.is_empty() {
        return Ok(());
    }
    let given = value.and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
    let ok = s.api_keys.iter().fold(false, |acc, k| {
        acc | bool::from(k.as_bytes().ct_eq(given.as_bytes()))
    });
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorClass::Unauthenticated,
            "missing or invalid API key: send `Authorization: Bearer <key>`",
        ))
    }
}

/// The engine, or 503 while loading / draining.
pub(crate) fn engine(s: &AppState) -> Result<&Engine, ApiError> {
    if s.draining.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            ErrorClass::Unavailable,
            "the server is shutting down; retry on another instance",
        ));
    }
    match s.engine.get() {
        Some(e) if s.ready.load(Ordering::SeqCst) => Ok(e),
        _ => Err(ApiError::new(
            ErrorClass::Unavailable,
            "the model is still loading; retry shortly (GET /ready answers 200 when it is loaded)",
        )),
    }
}

fn body_json<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(|e| {
        ApiError::new(
            ErrorClass::BadRequest,
            format!("reading the request body: {e} (the limit is set by --max-body)"),
        )
    })?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(ErrorClass::BadRequest, format!("invalid JSON body: {e}")))
}

async fn models(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let meta = s.engine.get().map(|e| {
        json!({
            "arch": e.model.cfg.arch.name(),
            "n_vocab": e.model.cfg.n_vocab,
            "n_ctx": s.limits.ctx,
            "chat_template": e.chat.name,
        })
    });
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "ternfleet",
            "meta": meta,
        }]
    })))
}

#[derive(serde::Deserialize)]
struct TokenizeReq {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

/// Runs request preparation (JSON parsing, template rendering, tokenization) on tokio's
/// blocking pool: a 1 MiB prompt takes tens of milliseconds to tokenize, which on a runtime
/// thread would stall every connection that thread serves.
pub(crate) async fn off_runtime<R: Send + 'static>(
    f: impl FnOnce() -> Result<R, ApiError> + Send + 'static,
) -> Result<R, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            ErrorClass::Internal,
            format!("preparing the request failed: {e}"),
        ))
    })
}

/// A small JSON endpoint: auth, the loaded engine, the parsed body, then `f` (off the runtime);
/// the answered status is counted under `name`.
async fn json_endpoint<T, F>(
    s: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    name: &'static str,
    f: F,
) -> Result<Json<Value>, ApiError>
where
    T: serde::de::DeserializeOwned,
    F: FnOnce(&Engine, T) -> Result<Value, ApiError> + Send + 'static,
{
    let st = s.clone();
    let r = off_runtime(move || {
        authorize(&st, &headers)
            .and_then(|()| engine(&st))
            .and_then(|e| f(e, body_json(body)?))
    })
    .await
    .map(Json);
    s.metrics.request(name, status_of(&r));
    r
}

async fn tokenize(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    json_endpoint(s, headers, body, "tokenize", |e, r: TokenizeReq| {
        let tok = &e.model.tokenizer;
        let ids = tok.encode(&r.content, r.add_special, true);
        if !r.with_pieces {
            return Ok(json!({ "tokens": ids }));
        }
        let pieces: Vec<Value> = ids
            .iter()
            .map(
                |&id| match String::from_utf8(tok.token_to_piece(id, true)) {
                    Ok(t) => json!({"id": id, "piece": t}),
                    Err(e) => json!({"id": id, "piece": e.into_bytes()}),
                },
            )
            .collect();
        Ok(json!({ "tokens": pieces }))
    })
    .await
}

#[derive(serde::Deserialize)]
struct DetokenizeReq {
    tokens: Vec<u32>,
}

async fn detokenize(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    json_endpoint(s, headers, body, "detokenize", |e, r: DetokenizeReq| {
        check_ids(e.model.tokenizer.n_vocab(), &r.tokens, "tokens")?;
        let text = e.model.tokenizer.detokenize(&r.tokens, false, true);
        Ok(json!({ "content": String::from_utf8_lossy(&text) }))
    })
    .await
}

/// llama-server's `POST /apply-template`: the prompt a chat request's messages render to.
async fn apply_template(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let limits = s.limits.clone();
    json_endpoint(
        s,
        headers,
        body,
        "apply-template",
        move |e, r: ChatRequest| {
            let msgs = openai::chat_messages(&r, &limits)?;
            let prompt = e
                .chat
                .render(&msgs)
                .map_err(|err| ApiError::bad("messages", err.to_string()))?;
            Ok(json!({ "prompt": prompt }))
        },
    )
    .await
}

fn status_of<T>(r: &Result<T, ApiError>) -> u16 {
    match r {
        Ok(_) => 200,
        Err(e) => e.class.http_status(),
    }
}

/// Which API a generation answers in.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn endpoint(self) -> &'static str {
        match self {
            Kind::Completion => "completions",
            Kind::Chat => "chat",
        }
    }
}

/// A validated generation ready to submit.
pub(crate) struct Prepared {
    kind: Kind,
    prompt: Vec<u32>,
    valid: Valid,
    max_tokens: usize,
}

fn prepare(
    s: &AppState,
    kind: Kind,
    body: Result<Bytes, BytesRejection>,
) -> Result<Prepared, ApiError> {
    let e = engine(s)?;
    let tok = &e.model.tokenizer;
    let (prompt, valid) = match kind {
        Kind::Completion => {
            let r: CompletionRequest = body_json(body)?;
            if r.echo {
                return Err(ApiError::bad("echo", "echo is not supported"));
            }
            let valid = openai::validate_common(&r.common, r.logprobs, &s.limits)?;
            let prompt = match r.prompt {
                Prompt::Text(t) => tok.encode(&t, true, true),
                Prompt::Texts(v) if v.len() == 1 => tok.encode(&v[0], true, true),
                Prompt::Texts(v) => {
                    return Err(ApiError::bad(
                        "prompt",
                        format!(
                            "{} prompts in one request: send one prompt per request",
                            v.len()
                        ),
                    ))
                }
                Prompt::Tokens(ids) => {
                    check_ids(tok.n_vocab(), &ids, "prompt")?;
                    ids
                }
            };
            (prompt, valid)
        }
        Kind::Chat => {
            let r: ChatRequest = body_json(body)?;
            let lp = if r.logprobs {
                Some(r.top_logprobs.unwrap_or(0))
            } else if r.top_logprobs.is_some() {
                return Err(ApiError::bad(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ));
            } else {
                None
            };
            let valid = openai::validate_common(&r.common, lp, &s.limits)?;
            let msgs = openai::chat_messages(&r, &s.limits)?;
            (chat_ids(e, &msgs)?, valid)
        }
    };
    prepare_prompt(s, kind, prompt, valid)
}

/// Token ids below the vocabulary size, or a 400 naming `field`.
pub(crate) fn check_ids(n_vocab: usize, ids: &[u32], field: &'static str) -> Result<(), ApiError> {
    match ids.iter().find(|&&t| t as usize >= n_vocab) {
        Some(bad) => Err(ApiError::bad(
            field,
            format!("token id {bad} is out of range: the vocabulary has {n_vocab} tokens"),
        )),
        None => Ok(()),
    }
}

/// The prompt of a chat: the template rendered, tokenized (one BOS when both the template
/// and the tokenizer add one).
pub(crate) fn chat_ids(e: &Engine, msgs: &[super::chat::Message]) -> Result<Vec<u32>, ApiError> {
    let tok = &e.model.tokenizer;
    let text = e
        .chat
        .render(msgs)
        .map_err(|err| ApiError::bad("messages", err.to_string()))?;
    let mut ids = tok.encode(&text, true, true);
    if let Some(b) = tok.bos() {
        if tok.add_bos() && ids.len() >= 2 && ids[0] == b && ids[1] == b {
            ids.remove(0);
        }
    }
    Ok(ids)
}

/// The checks every prompt passes, whatever API it came through: not empty, within the
/// prompt limit, room for `max_tokens` in the context.
pub(crate) fn prepare_prompt(
    s: &AppState,
    kind: Kind,
    prompt: Vec<u32>,
    valid: Valid,
) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty"));
    }
    if prompt.len() > s.limits.max_prompt_tokens {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "the prompt is {} tokens: the limit is {} (--max-prompt-tokens)",
                prompt.len(),
                s.limits.max_prompt_tokens
            ),
        ));
    }
    let room = s.limits.ctx.saturating_sub(prompt.len());
    let max_tokens = match valid.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "prompt ({} tokens) + max_tokens ({m}) = {} is over the context size {}",
                    prompt.len(),
                    prompt.len() + m,
                    s.limits.ctx
                ),
            ))
        }
        Some(m) => m,
        None => s.default_max_tokens.unwrap_or(room).min(room),
    };
    if max_tokens == 0 {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "the prompt ({} tokens) fills the context size {}",
                prompt.len(),
                s.limits.ctx
            ),
        ));
    }
    Ok(Prepared {
        kind,
        prompt,
        valid,
        max_tokens,
    })
}

/// A submitted request: its events, its permit, when it arrived.
pub(crate) struct Flight {
    pub(crate) rx: mpsc::Receiver<Event>,
    _permit: OwnedSemaphorePermit,
    id: String,
    pub(crate) arrived: Instant,
    last: Option<Instant>,
    kind: Kind,
    pub(crate) metrics: Arc<Metrics>,
    model: String,
    created: u64,
    tok: Arc<Model>,
}

/// A request slot, or 429 at once: taken before any parsing or tokenization, so an overloaded
/// server spends nothing on the requests it refuses and preparation work is bounded by the slots.
pub(crate) fn take_permit(s: &AppState) -> Result<OwnedSemaphorePermit, ApiError> {
    s.permits.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            ErrorClass::Overloaded,
            format!(
                "server overloaded: all {} request slots (--parallel + --max-queue) are taken; retry later",
                s.slots
            ),
        )
    })
}

pub(crate) fn submit(
    s: &AppState,
    p: &Prepared,
    arrived: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Flight, ApiError> {
    let e = engine(s)?;
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel(p.max_tokens + 2);
    let req = Submit {
        id: n,
        prompt: p.prompt.clone(),
        max_tokens: p.max_tokens,
        sampling: p.valid.sampling.clone(),
        stop: p.valid.stop.clone(),
        ignore_eos: p.valid.ignore_eos,
        logprobs: p.valid.logprobs,
        deadline: Some(arrived + s.timeout),
    };
    let span = tracing::debug_span!(
        "request",
        id = n,
        prompt_tokens = p.prompt.len(),
        max_tokens = p.max_tokens
    );
    e.tx.try_send(Cmd::Submit(Box::new(req), tx, span))
        .map_err(|err| match err {
            std::sync::mpsc::TrySendError::Full(_) => ApiError::new(
                ErrorClass::Overloaded,
                "server overloaded: the command queue is full; retry later",
            ),
            std::sync::mpsc::TrySendError::Disconnected(_) => {
                ApiError::new(ErrorClass::Unavailable, "the engine has stopped")
            }
        })?;
    let prefix = if p.kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    Ok(Flight {
        rx,
        _permit: permit,
        id: format!("{prefix}-{n}"),
        arrived,
        last: None,
        kind: p.kind,
        metrics: s.metrics.clone(),
        model: s.model_name.clone(),
        created: unix_now(),
        tok: e.model.clone(),
    })
}

pub(crate) fn reject_error(r: Reject) -> ApiError {
    match r {
        Reject::QueueFull { .. } => ApiError::new(ErrorClass::Overloaded, r.to_string()),
        _ => ApiError::new(ErrorClass::BadRequest, r.to_string()),
    }
}

impl Flight {
    pub(crate) fn observe_token(&mut self) {
        let now = Instant::now();
        let mut recent = self
            .metrics
            .recent
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        recent.token(now);
        match self.last {
            None => {
                let ttft = (now - self.arrived).as_secs_f64();
                self.metrics.ttft.observe(ttft);
                recent.ttft(ttft);
            }
            Some(t) => self.metrics.itl.observe((now - t).as_secs_f64()),
        }
        self.last = Some(now);
    }

    fn piece_text(&self, t: u32) -> String {
        String::from_utf8_lossy(&self.tok.tokenizer.token_to_piece(t, false)).into_owned()
    }

    /// OpenAI's logprobs entry for one token (chat: `content[]` items).
    fn chat_logprob(&self, lp: &TokenLogprob) -> Value {
        json!({
            "token": String::from_utf8_lossy(&lp.bytes),
            "logprob": lp.logprob,
            "bytes": lp.bytes,
            "top_logprobs": lp.top.iter().map(|(_, l, b)| json!({
                "token": String::from_utf8_lossy(b), "logprob": l, "bytes": b
            })).collect::<Vec<_>>(),
        })
    }

    fn choice(
        &self,
        text: &str,
        lps: &[TokenLogprob],
        finish: Option<&str>,
        delta: bool,
        first: bool,
    ) -> Value {
        let logprobs = if lps.is_empty() {
            Value::Null
        } else if self.kind == Kind::Chat {
            json!({ "content": lps.iter().map(|l| self.chat_logprob(l)).collect::<Vec<_>>() })
        } else {
            json!({
                "tokens": lps.iter().map(|l| self.piece_text(l.token)).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|l| {
                    l.top.iter().map(|(t, p, _)| (self.piece_text(*t), json!(p))).collect::<serde_json::Map<_, _>>()
                }).collect::<Vec<_>>(),
            })
        };
        match (self.kind, delta) {
            (Kind::Completion, _) => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish
            }),
            (Kind::Chat, false) => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            (Kind::Chat, true) => {
                let d = if first {
                    json!({"role": "assistant", "content": text})
                } else if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, stream: bool, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, headers, body, Kind::Completion).await
}

async fn chat(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, headers, body, Kind::Chat).await
}

async fn generate(
    s: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Response {
    let arrived = Instant::now();
    let prepared = match authorize(&s, &headers).and_then(|()| take_permit(&s)) {
        Ok(permit) => {
            let st = s.clone();
            off_runtime(move || prepare(&st, kind, body))
                .await
                .map(|p| (p, permit))
        }
        Err(e) => Err(e),
    };
    let started = prepared.and_then(|(p, permit)| submit(&s, &p, arrived, permit).map(|f| (p, f)));
    let (p, mut f) = match started {
        Ok(x) => x,
        Err(e) => {
            s.metrics.request(kind.endpoint(), e.class.http_status());
            return e.into_response();
        }
    };
    // The first event tells whether the engine took the request.
    let first = f.rx.recv().await;
    let first = match first {
        Some(Event::Rejected(r)) => {
            let e = reject_error(r);
            s.metrics.request(kind.endpoint(), e.class.http_status());
            return e.into_response();
        }
        Some(ev) => ev,
        None => {
            let e = ApiError::new(ErrorClass::Unavailable, "the engine stopped");
            s.metrics.request(kind.endpoint(), e.class.http_status());
            return e.into_response();
        }
    };
    if p.valid.stream {
        s.metrics.request(kind.endpoint(), 200);
        stream_response(f, first, p.valid.include_usage).into_response()
    } else {
        let r = collect(&mut f, first).await;
        s.metrics.request(kind.endpoint(), status_of(&r));
        match r {
            Ok(v) => Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

/// Non-streaming: every event, then one response object.
async fn collect(f: &mut Flight, first: Event) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut ev = Some(first);
    loop {
        match ev {
            Some(Event::Token {
                text: t, logprob, ..
            }) => {
                f.observe_token();
                text.push_str(&t);
                lps.extend(logprob);
            }
            Some(Event::Done {
                reason,
                text: t,
                usage,
            }) => {
                f.metrics.e2e.observe(f.arrived.elapsed().as_secs_f64());
                let Some(fr) = openai::finish_reason(&reason) else {
                    return Err(openai::finish_error(&reason));
                };
                text.push_str(&t);
                let choice = f.choice(&text, &lps, Some(fr), false, false);
                return Ok(f.envelope(false, vec![choice], Some(openai::usage_json(&usage))));
            }
            Some(Event::Rejected(r)) => return Err(reject_error(r)),
            None => {
                return Err(ApiError::new(
                    ErrorClass::Internal,
                    "the engine dropped the request",
                ))
            }
        }
        ev = f.rx.recv().await;
    }
}

/// Where an SSE response is.
enum Sse0 {
    Events { first_chunk: bool },
    Usage(Usage),
    Done,
    End,
}

struct SseState {
    f: Flight,
    pending: Option<Event>,
    state: Sse0,
    include_usage: bool,
}

/// Streaming: OpenAI's chunks, an error as a `data:` event if the request fails midway, then
/// `[DONE]`.
fn stream_response(
    f: Flight,
    first: Event,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    let st = SseState {
        f,
        pending: Some(first),
        state: Sse0::Events { first_chunk: true },
        include_usage,
    };
    let s = stream::unfold(st, |mut st| async move {
        let ev = match std::mem::replace(&mut st.state, Sse0::End) {
            Sse0::End => return None,
            Sse0::Done => {
                st.state = Sse0::End;
                return Some((Ok(SseEvent::default().data("[DONE]")), st));
            }
            Sse0::Usage(u) => {
                st.state = Sse0::Done;
                let v = st.f.envelope(true, vec![], Some(openai::usage_json(&u)));
                return Some((Ok(SseEvent::default().data(v.to_string())), st));
            }
            Sse0::Events { first_chunk } => {
                let ev = match st.pending.take() {
                    Some(e) => e,
                    None => match st.f.rx.recv().await {
                        Some(e) => e,
                        None => {
                            let e = ApiError::new(
                                ErrorClass::Internal,
                                "the engine dropped the request",
                            );
                            st.state = Sse0::Done;
                            return Some((Ok(SseEvent::default().data(e.body().to_string())), st));
                        }
                    },
                };
                (ev, first_chunk)
            }
        };
        let (ev, first_chunk) = ev;
        let usage_null = if st.include_usage {
            Some(Value::Null)
        } else {
            None
        };
        match ev {
            Event::Token { text, logprob, .. } => {
                st.f.observe_token();
                st.state = Sse0::Events { first_chunk: false };
                let lps: Vec<TokenLogprob> = logprob.into_iter().collect();
                let c = st.f.choice(&text, &lps, None, true, first_chunk);
                let v = st.f.envelope(true, vec![c], usage_null);
                Some((Ok(SseEvent::default().data(v.to_string())), st))
            }
            Event::Done {
                reason,
                text,
                usage,
            } => {
                st.f.metrics
                    .e2e
                    .observe(st.f.arrived.elapsed().as_secs_f64());
                match openai::finish_reason(&reason) {
                    Some(fr) => {
                        let c = st.f.choice(&text, &[], Some(fr), true, first_chunk);
                        let v = st.f.envelope(true, vec![c], usage_null);
                        st.state = if st.include_usage {
                            Sse0::Usage(usage)
                        } else {
                            Sse0::Done
                        };
                        Some((Ok(SseEvent::default().data(v.to_string())), st))
                    }
                    None => {
                        st.state = Sse0::Done;
                        let e = openai::finish_error(&reason);
                        Some((Ok(SseEvent::default().data(e.body().to_string())), st))
                    }
                }
            }
            Event::Rejected(r) => {
                st.state = Sse0::Done;
                Some((
                    Ok(SseEvent::default().data(reject_error(r).body().to_string())),
                    st,
                ))
            }
        }
    });
    Sse::new(s)
}
