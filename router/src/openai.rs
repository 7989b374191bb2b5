//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (SSE streaming and
//! not), `/v1/models`, `/health`, `/ready`.
//!
//! Field names, response shapes and error bodies follow OpenAI's API, plus the extensions vLLM
//! users rely on (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
//! `skip_special_tokens`). Bodies are parsed here rather than by an extractor so that malformed
//! JSON gets an OpenAI-style 400 like every other refusal. A client that disconnects drops the
//! response stream, which drops the [`Generation`] and cancels the request on its worker.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{FromRequest, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Extension, Json};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use tandem_model::ChatMessage;

use crate::dispatch::{
    Chunk, Dispatcher, FinishKind, GenParams, Generation, MaxTokensDefault, Prepared, PromptInput,
    TokenOut, Usage,
};
use crate::error::ApiError;
use crate::front::{require_key, FrontDoor};
use crate::metrics::RouterMetrics;

/// The front door's body limits, as a request extension for [`RequestBody`].
#[derive(Clone)]
struct BodyLimits {
    max: usize,
    stall: Duration,
    metrics: Arc<RouterMetrics>,
}

/// Reads and drops up to `budget` more bytes of a refused body, so that a client still sending
/// a body somewhat over the limit reads its 413 rather than a reset connection. A larger body is
/// cut off.
async fn drain(body: &mut axum::body::BodyDataStream, budget: usize, stall: Duration) {
    let mut left = budget;
    while left > 0 {
        match tokio::time::timeout(stall, body.next()).await {
            Ok(Some(Ok(chunk))) => left = left.saturating_sub(chunk.len()),
            _ => return,
        }
    }
}

pub fn routes(d: Arc<Dispatcher>, door: &FrontDoor) -> axum::Router {
    let keyed = |keys: &Arc<crate::front::ApiKeys>| {
        middleware::from_fn_with_state((keys.clone(), d.metrics.clone()), require_key)
    };
    let api = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route_layer(keyed(&door.api_keys));
    let metrics = axum::Router::new()
        .route("/metrics", get(metrics))
        .route_layer(keyed(&door.metrics_keys));
    axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .merge(api)
        .merge(metrics)
        .fallback(not_found)
        .layer(Extension(BodyLimits {
            max: door.limits.max_body,
            stall: door.limits.body_stall,
            metrics: d.metrics.clone(),
        }))
        .with_state(d)
}

/// A request's whole body, read under the front door's limits: over the size limit is 413 (at
/// once when `Content-Length` says so), a pause longer than the stall timeout is 408. Nothing
/// of the router is held while it arrives.
struct RequestBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for RequestBody {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, _: &S) -> Result<Self, Response> {
        let Some(limits) = req.extensions().get::<BodyLimits>().cloned() else {
            return Err(ApiError::Internal("body limits not set".into()).into_response());
        };
        let refuse = |e: ApiError, reason| {
            limits.metrics.refused(reason);
            e.into_response()
        };
        let declared = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let mut body = req.into_body().into_data_stream();
        if let Some(n) = declared.filter(|&n| n > limits.max as u64) {
            if n <= 2 * limits.max as u64 {
                drain(&mut body, n as usize, limits.stall).await;
            }
            return Err(refuse(ApiError::BodyTooLarge(limits.max), "body_too_large"));
        }
        let mut buf = Vec::with_capacity(declared.unwrap_or(0) as usize);
        loop {
            match tokio::time::timeout(limits.stall, body.next()).await {
                Err(_) => return Err(refuse(ApiError::BodyTimeout(limits.stall), "body_timeout")),
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(ApiError::InvalidRequest {
                        message: format!("could not read the request body: {e}"),
                        param: None,
                    }
                    .into_response())
                }
                Ok(Some(Ok(chunk))) => {
                    if buf.len() + chunk.len() > limits.max {
                        drain(&mut body, limits.max, limits.stall).await;
                        return Err(refuse(ApiError::BodyTooLarge(limits.max), "body_too_large"));
                    }
                    buf.extend_from_slice(&chunk);
                }
            }
        }
        Ok(Self(Bytes::from(buf)))
    }
}

async fn not_found() -> Response {
    let body = json!({"error": {"message": "no such route: the API is under /v1 (completions, chat/completions, models)", "type": "invalid_request_error", "param": null, "code": "not_found"}});
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

/// 200 when at least one decode worker is ready, else 503; the body lists what the router knows
/// about each worker (readiness, its requests in flight, the cached blocks its index holds).
async fn metrics(State(d): State<Arc<Dispatcher>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        d.metrics.render(),
    )
        .into_response()
}

async fn ready(State(d): State<Arc<Dispatcher>>) -> Response {
    let describe = |pool: &crate::workers::WorkerPool| -> Vec<Value> {
        pool.all()
            .iter()
            .map(|w| {
                json!({
                    "addr": w.addr,
                    "ready": w.is_ready(),
                    "in_flight": w.in_flight(),
                    "cached_blocks": w.indexed_blocks(),
                })
            })
            .collect()
    };
    let workers = describe(&d.pool);
    let prefill = d.prefill_pool.as_deref().map(describe).unwrap_or_default();
    let ready = workers.iter().filter(|w| w["ready"] == true).count();
    let body = json!({"model": d.model.name, "ready_workers": ready, "workers": workers,
                      "prefill_workers": prefill});
    if ready > 0 {
        (StatusCode::OK, Json(body)).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    }
}

async fn models(State(d): State<Arc<Dispatcher>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": d.model.name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "max_model_len": d.model.max_context(),
        }]
    }))
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::InvalidRequest {
        message: format!("request body is not valid JSON for this endpoint: {e}"),
        param: None,
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The sampling fields both endpoints share.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Sampling {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopField>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    skip_special_tokens: Option<bool>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
}

impl Sampling {
    fn params(&self, max_tokens: Option<u64>) -> Result<GenParams, ApiError> {
        if self.n.unwrap_or(1) != 1 {
            return Err(ApiError::invalid("only n = 1 is supported", "n"));
        }
        Ok(GenParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            max_tokens,
            stop: match &self.stop {
                None => vec![],
                Some(StopField::One(s)) => vec![s.clone()],
                Some(StopField::Many(v)) => v.clone(),
            },
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            logprobs: false,
            top_logprobs: 0,
        })
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: String,
    prompt: PromptField,
    #[serde(default)]
    max_tokens: Option<u64>,
    /// Number of alternatives to report per token (OpenAI: an integer, not a bool).
    #[serde(default)]
    logprobs: Option<u32>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(flatten)]
    sampling: Sampling,
}

fn chat_messages(msgs: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    msgs.into_iter()
        .map(|m| {
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        if p.kind != "text" {
                            return Err(ApiError::invalid(
                                format!("content parts of type {:?} are not supported: this model reads text", p.kind),
                                "messages",
                            ));
                        }
                        s.push_str(p.text.as_deref().unwrap_or(""));
                    }
                    s
                }
            };
            if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool" | "developer") {
                return Err(ApiError::invalid(
                    format!("unknown message role {:?}", m.role),
                    "messages",
                ));
            }
            Ok(ChatMessage {
                role: m.role,
                content,
            })
        })
        .collect()
}

/// Per-token log-probability entries, with each token's text.
struct TokenTexts<'a> {
    d: &'a Dispatcher,
}

impl TokenTexts<'_> {
    fn text(&self, id: u32) -> String {
        self.d
            .model
            .text
            .tokenizer
            .decode(&[id], false)
            .unwrap_or_default()
    }

    fn chat_entry(&self, t: &TokenOut) -> Value {
        let tok = self.text(t.id);
        json!({
            "token": tok,
            "logprob": t.logprob,
            "bytes": tok.as_bytes(),
            "top_logprobs": t.top.iter().map(|&(id, lp)| {
                let s = self.text(id);
                json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
            }).collect::<Vec<_>>(),
        })
    }

    /// OpenAI's legacy completions shape: parallel arrays.
    fn completion_logprobs(&self, tokens: &[TokenOut], text_offset: usize) -> Value {
        let mut offset = text_offset;
        let mut offsets = Vec::new();
        let mut toks = Vec::new();
        for t in tokens {
            let s = self.text(t.id);
            offsets.push(offset);
            offset += s.len();
            toks.push(s);
        }
        json!({
            "tokens": toks,
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": tokens.iter().map(|t| {
                t.top.iter().map(|&(id, lp)| (self.text(id), json!(lp))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completion,
    Chat,
}

impl Api {
    /// OpenAI's `object` for a whole response or a streamed chunk.
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Api::Completion, _) => "text_completion",
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
        }
    }
}

/// What a response needs to know besides the chunks.
struct Shape {
    api: Api,
    id: String,
    model: String,
    created: u64,
    logprobs: bool,
    include_usage: bool,
    /// The prompt text, for `echo`.
    echo: Option<String>,
}

async fn completions(State(d): State<Arc<Dispatcher>>, RequestBody(body): RequestBody) -> Response {
    match completion_request(&d, &body) {
        Ok((prep, shape, stream)) => serve(d, prep, shape, stream).await,
        Err(e) => invalid(&d, e),
    }
}

/// A request refused before it reached the dispatcher (malformed, out of range): counted as
/// `invalid` and answered.
fn invalid(d: &Dispatcher, e: ApiError) -> Response {
    d.metrics.request("invalid");
    e.into_response()
}

/// Generates `prep` and answers in `shape`.
async fn serve(d: Arc<Dispatcher>, prep: Prepared, shape: Shape, stream: bool) -> Response {
    let generation = match d.generate(prep).await {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    respond(d, generation, shape, stream)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn completion_request(d: &Dispatcher, body: &[u8]) -> Result<(Prepared, Shape, bool), ApiError> {
    let r: CompletionRequest = parse(body)?;
    let input = match r.prompt {
        PromptField::Text(t) => PromptInput::Text(t),
        PromptField::Ids(ids) => PromptInput::Ids(ids),
        PromptField::Texts(mut v) if v.len() == 1 => PromptInput::Text(v.remove(0)),
        PromptField::IdLists(mut v) if v.len() == 1 => PromptInput::Ids(v.remove(0)),
        _ => {
            return Err(ApiError::invalid(
                "send one prompt per request (batched prompts are not supported)",
                "prompt",
            ))
        }
    };
    let echo_text = match (&input, r.echo.unwrap_or(false)) {
        (PromptInput::Text(t), true) => Some(t.clone()),
        (PromptInput::Ids(ids), true) => Some(
            d.model
                .text
                .tokenizer
                .decode(ids, false)
                .map_err(|e| ApiError::invalid(e.to_string(), "prompt"))?,
        ),
        _ => None,
    };
    let mut params = r.sampling.params(r.max_tokens)?;
    if let Some(n) = r.logprobs {
        params.logprobs = true;
        params.top_logprobs = n;
    }
    let prep = d.prepare(&r.model, input, params, MaxTokensDefault::Fixed(16))?;
    let shape = Shape {
        api: Api::Completion,
        id: format!("cmpl-{}", prep.request_id),
        model: d.model.name.clone(),
        created: now(),
        logprobs: prep.params.logprobs,
        include_usage: r.sampling.include_usage(),
        echo: echo_text,
    };
    Ok((prep, shape, r.sampling.stream.unwrap_or(false)))
}

async fn chat_completions(
    State(d): State<Arc<Dispatcher>>,
    RequestBody(body): RequestBody,
) -> Response {
    match chat_request(&d, &body) {
        Ok((prep, shape, stream)) => serve(d, prep, shape, stream).await,
        Err(e) => invalid(&d, e),
    }
}

fn chat_request(d: &Dispatcher, body: &[u8]) -> Result<(Prepared, Shape, bool), ApiError> {
    let r: ChatRequest = parse(body)?;
    let messages = chat_messages(r.messages)?;
    let mut params = r
        .sampling
        .params(r.max_completion_tokens.or(r.max_tokens))?;
    params.logprobs = r.logprobs.unwrap_or(false);
    params.top_logprobs = r.top_logprobs.unwrap_or(0);
    if params.top_logprobs > 0 && !params.logprobs {
        return Err(ApiError::invalid(
            "top_logprobs needs logprobs: true",
            "top_logprobs",
        ));
    }
    let prep = d.prepare(
        &r.model,
        PromptInput::Chat(messages),
        params,
        MaxTokensDefault::RestOfContext,
    )?;
    let shape = Shape {
        api: Api::Chat,
        id: format!("chatcmpl-{}", prep.request_id),
        model: d.model.name.clone(),
        created: now(),
        logprobs: prep.params.logprobs,
        include_usage: r.sampling.include_usage(),
        echo: None,
    };
    Ok((prep, shape, r.sampling.stream.unwrap_or(false)))
}

async fn respond(
    d: Arc<Dispatcher>,
    mut g: Generation,
    shape: Shape,
    stream: bool,
) -> Result<Response, ApiError> {
    if stream {
        return Ok(Sse::new(sse_stream(d, g, shape))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let mut text = shape.echo.clone().unwrap_or_default();
    let prompt_len = text.len();
    let mut tokens = Vec::new();
    let (finish, usage) = loop {
        match g.next().await {
            Some(Ok(c)) => {
                text.push_str(&c.text);
                tokens.extend(c.tokens);
                if let Some(f) = c.finish {
                    break f;
                }
            }
            Some(Err(e)) => return Err(e),
            None => return Err(ApiError::Internal("stream ended without a finish".into())),
        }
    };
    let tt = TokenTexts { d: &d };
    let choice = match shape.api {
        Api::Completion => json!({
            "index": 0,
            "text": text,
            "logprobs": if shape.logprobs { tt.completion_logprobs(&tokens, prompt_len) } else { Value::Null },
            "finish_reason": finish.as_openai(),
        }),
        Api::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": if shape.logprobs {
                json!({"content": tokens.iter().map(|t| tt.chat_entry(t)).collect::<Vec<_>>()})
            } else { Value::Null },
            "finish_reason": finish.as_openai(),
        }),
    };
    Ok(Json(json!({
        "id": shape.id,
        "object": shape.api.object(false),
        "created": shape.created,
        "model": shape.model,
        "choices": [choice],
        "usage": usage_json(&usage),
    }))
    .into_response())
}

struct SseState {
    d: Arc<Dispatcher>,
    g: Generation,
    shape: Shape,
    /// Bytes of text sent so far (for completion logprobs' text offsets).
    sent: usize,
    started: bool,
    /// Events ready to go out before reading the next chunk.
    queue: std::collections::VecDeque<Event>,
    finished: bool,
}

impl SseState {
    /// One SSE event; with `include_usage` every chunk carries `usage` (null but on the last).
    fn chunk_json(&self, choices: Vec<Value>, usage: Option<&Usage>) -> Event {
        let mut v = json!({
            "id": self.shape.id,
            "object": self.shape.api.object(true),
            "created": self.shape.created,
            "model": self.shape.model,
            "choices": choices,
        });
        if self.shape.include_usage {
            v["usage"] = match usage {
                Some(u) => usage_json(u),
                None => Value::Null,
            };
        }
        Event::default().data(v.to_string())
    }

    fn choice(&mut self, c: &Chunk, finish: Option<FinishKind>) -> Value {
        let tt = TokenTexts { d: &self.d };
        let reason = finish.map(|f| f.as_openai());
        let v = match self.shape.api {
            Api::Completion => json!({
                "index": 0,
                "text": c.text,
                "logprobs": if self.shape.logprobs { tt.completion_logprobs(&c.tokens, self.sent) } else { Value::Null },
                "finish_reason": reason,
            }),
            Api::Chat => {
                let delta = if c.text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({"content": c.text})
                };
                json!({
                    "index": 0,
                    "delta": delta,
                    "logprobs": if self.shape.logprobs {
                        json!({"content": c.tokens.iter().map(|t| tt.chat_entry(t)).collect::<Vec<_>>()})
                    } else { Value::Null },
                    "finish_reason": reason,
                })
            }
        };
        self.sent += c.text.len();
        v
    }

    fn start(&mut self) {
        self.started = true;
        match self.shape.api {
            Api::Chat => {
                let ev = self.chunk_json(
                    vec![json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})],
                    None,
                );
                self.queue.push_back(ev);
            }
            Api::Completion => {
                if let Some(echo) = self.shape.echo.clone() {
                    let ev = self.chunk_json(
                        vec![json!({"index": 0, "text": echo, "logprobs": null, "finish_reason": null})],
                        None,
                    );
                    self.sent += echo.len();
                    self.queue.push_back(ev);
                }
            }
        }
    }

    fn absorb(&mut self, c: Chunk) {
        let finish = c.finish;
        let has_content = !c.text.is_empty() || !c.tokens.is_empty();
        if has_content || finish.is_some() {
            let choice = self.choice(&c, finish.map(|f| f.0));
            let ev = self.chunk_json(vec![choice], None);
            self.queue.push_back(ev);
        }
        if let Some((_, usage)) = finish {
            if self.shape.include_usage {
                let ev = self.chunk_json(vec![], Some(&usage));
                self.queue.push_back(ev);
            }
            self.queue.push_back(Event::default().data("[DONE]"));
            self.finished = true;
        }
    }
}

fn sse_stream(
    d: Arc<Dispatcher>,
    g: Generation,
    shape: Shape,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let st = SseState {
        d,
        g,
        shape,
        sent: 0,
        started: false,
        queue: Default::default(),
        finished: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(ev) = st.queue.pop_front() {
                return Some((Ok(ev), st));
            }
            if st.finished {
                return None;
            }
            if !st.started {
                st.start();
                continue;
            }
            match st.g.next().await {
                Some(Ok(c)) => st.absorb(c),
                Some(Err(e)) => {
                    // Headers are gone: the error travels as an event, then the stream ends.
                    tracing::warn!(error = %e, "stream failed");
                    st.queue
                        .push_back(Event::default().data(e.body().to_string()));
                    st.queue.push_back(Event::default().data("[DONE]"));
                    st.finished = true;
                }
                None => {
                    st.finished = true;
                }
            }
        }
    })
}
