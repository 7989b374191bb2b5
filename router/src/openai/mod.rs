//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (SSE streaming and
//! not), the Responses API (`/v1/responses`), Anthropic's Messages API (`/v1/messages`),
//! `/v1/models`, vLLM's `/tokenize` and `/detokenize`, `/health`, `/ready`.
//!
//! Field names, response shapes and error bodies follow OpenAI's API, plus the extensions vLLM
//! users rely on (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
//! `skip_special_tokens`, guided decoding), batched prompts in `/v1/completions`, `logit_bias`,
//! structured outputs (`response_format`) and tools. Fields it does not serve yet (`best_of`
//! above `n`, the legacy `functions` and `function_call`, `suffix`) are refused with a 400 naming
//! them, never ignored. Bodies are parsed here rather than by an extractor so that malformed
//! JSON gets an OpenAI-style 400 like every other refusal. A client that disconnects drops the
//! response stream, which drops the [`Generation`] and cancels the request on its worker.
//!
//! Files: this one holds the routes and handlers; `body` reads a request body under the front
//! door's limits, `request` the request shapes and their checks, `response` the answers, whole or
//! as server-sent events; `messages` and `responses` translate Anthropic's Messages API and
//! OpenAI's Responses API to chat requests and answer in their shapes, `store` keeps stored
//! responses, `tools` reads tool calls out of the output, `reasoning` splits a thinking model's
//! thought from its answer.

mod body;
mod messages;
mod reasoning;
mod request;
mod response;
mod responses;
mod store;
mod tools;

pub use responses::Responses;
pub(crate) use store::ResponseStore;
pub use store::{StoreConfig, StoreSpec};

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Extension, Json};
use serde_json::{json, Value};

use crate::dispatch::{
    Dispatcher, Generation, MaxTokensDefault, Prepared, PromptInput, RequestedGrammar,
};
use crate::error::ApiError;
use crate::flow::Caller;
use crate::front::{require_key, FrontDoor};
use crate::trace;
use body::{BodyLimits, RequestBody};
use request::{
    chat_messages, parse, ChatRequest, CompletionRequest, DetokenizeRequest, PromptField,
    TokenizeRequest,
};
use response::{respond, Api, Shape};
use tandem_model::ChatMessage;
use tools::Tools;

/// The HTTP app over `d`: the `/v1` API and `/metrics` behind the door's keys, `/health` and
/// `/ready` open, bodies read under the door's limits.
pub fn routes(d: Arc<Dispatcher>, door: &FrontDoor, responses: Arc<Responses>) -> axum::Router {
    let keyed = |keys: &Arc<crate::front::ApiKeys>| {
        middleware::from_fn_with_state((keys.clone(), d.metrics.clone()), require_key)
    };
    let api = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items_list),
        )
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(keyed(&door.api_keys));
    let metrics = axum::Router::new()
        .route("/metrics", get(metrics))
        .route_layer(keyed(&door.metrics_keys));
    axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/ready",
            get({
                let keys = door.api_keys.clone();
                move |state, headers| ready(state, headers, keys)
            }),
        )
        .merge(api)
        .merge(metrics)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(catch_panic))
        .layer(Extension(BodyLimits::new(&door.limits, d.metrics.clone())))
        .layer(Extension(responses))
        .layer(middleware::from_fn(request_id))
        .with_state(d)
}

/// Longest `x-request-id` a client may set that is given back as it came.
const MAX_REQUEST_ID: usize = 128;

/// Every response carries an `x-request-id`, as OpenAI's and Anthropic's do: the client's own
/// (a proxy's) where it sent a printable one of at most [`MAX_REQUEST_ID`] bytes, else a new
/// `req_` and 32 random hex digits.
async fn request_id(req: axum::extract::Request, next: middleware::Next) -> Response {
    use axum::http::HeaderValue;
    let given = req
        .headers()
        .get("x-request-id")
        .filter(|v| {
            let b = v.as_bytes();
            !b.is_empty() && b.len() <= MAX_REQUEST_ID && b.iter().all(|c| c.is_ascii_graphic())
        })
        .cloned();
    let id = given.unwrap_or_else(|| {
        let n: u128 = rand::random();
        HeaderValue::from_str(&format!("req_{n:032x}")).expect("hex is a header value")
    });
    let mut resp = next.run(req).await;
    resp.headers_mut().insert("x-request-id", id);
    resp
}

/// A panic while serving one request is that request's 500 (an OpenAI error body), counted and
/// logged; the connection and every other request go on.
async fn catch_panic(req: axum::extract::Request, next: middleware::Next) -> Response {
    use futures::FutureExt;
    match std::panic::AssertUnwindSafe(next.run(req))
        .catch_unwind()
        .await
    {
        Ok(r) => r,
        Err(p) => {
            let what = tandem_types::panic_message(p.as_ref());
            tracing::error!(panic = %what, "a request handler panicked");
            ApiError::Internal(format!("the router failed this request: {what}")).into_response()
        }
    }
}

/// A route asked with a method it does not serve: 405 with an OpenAI error body.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let body = json!({"error": {"message": format!("{method} is not allowed on {}", uri.path()),
        "type": "invalid_request_error", "param": null, "code": "method_not_allowed"}});
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

async fn not_found() -> Response {
    let body = json!({"error": {"message": "no such route: the API is under /v1 (completions, chat/completions, responses, messages, models), plus /tokenize and /detokenize", "type": "invalid_request_error", "param": null, "code": "not_found"}});
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

/// The router's Prometheus metrics.
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

/// 200 when at least one decode worker is ready, else 503; the body names the model and lists
/// what the router knows about each worker (readiness, its requests in flight, the cached blocks
/// its index holds).
///
/// The workers' addresses are the worker plane's map: with API keys set, they are listed only
/// to a caller with a key (probes without one see the counts and states).
async fn ready(
    State(d): State<Arc<Dispatcher>>,
    headers: HeaderMap,
    keys: Arc<crate::front::ApiKeys>,
) -> Response {
    let authorization = headers
        .get(axum::http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let show_addrs = keys.check(authorization).is_ok();
    let describe = |pool: &crate::workers::WorkerPool| -> Vec<Value> {
        pool.all()
            .iter()
            .map(|w| {
                let load = w.load_report().unwrap_or_default();
                let mut v = json!({
                    "ready": w.is_ready(),
                    "in_flight": w.in_flight(),
                    "draining": w.is_draining(),
                    "running": load.running,
                    "waiting": load.waiting,
                    "blocks_used": load.blocks_used,
                    "cached_blocks": w.indexed_blocks(),
                    "disk_blocks": w.indexed_disk_blocks(),
                    "prefill_tokens_per_s": load.prefill_tokens_per_s,
                    "decoding": load.decoding,
                    "itl_target_ms": load.itl_target_ms,
                    "step_cost_ms": [load.step_fixed_ms, load.step_token_ms, load.step_key_ms],
                });
                if show_addrs {
                    v["addr"] = json!(w.addr.as_str());
                }
                v
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
    let base = &d.model.name;
    let mut data = vec![json!({
        "id": base,
        "object": "model",
        "created": 0,
        "owned_by": "tandem",
        "root": base,
        "parent": null,
        "max_model_len": d.model.max_context(),
    })];
    // The LoRA adapters the workers serve, as vLLM lists them: their base as parent.
    for (name, i) in d.loras() {
        data.push(json!({
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "root": i.path,
            "parent": base,
            "max_model_len": d.model.max_context(),
        }));
    }
    Json(json!({"object": "list", "data": data}))
}

/// vLLM's `/v1/load_lora_adapter` body.
#[derive(serde::Deserialize)]
struct LoadLora {
    lora_name: String,
    lora_path: String,
}

/// vLLM's `/v1/unload_lora_adapter` body.
#[derive(serde::Deserialize)]
struct UnloadLora {
    lora_name: String,
}

/// Has every worker read a LoRA adapter and serve it under `lora_name`.
async fn load_lora_adapter(
    State(d): State<Arc<Dispatcher>>,
    RequestBody(body): RequestBody,
) -> Result<String, ApiError> {
    let r: LoadLora = parse(&body)?;
    let info = d.load_lora(&r.lora_name, &r.lora_path).await?;
    Ok(format!(
        "Success: LoRA adapter '{}' added successfully (rank {}, {} bytes).",
        info.name, info.rank, info.bytes
    ))
}

/// Has every worker stop serving a LoRA adapter (its running requests finish).
async fn unload_lora_adapter(
    State(d): State<Arc<Dispatcher>>,
    RequestBody(body): RequestBody,
) -> Result<String, ApiError> {
    let r: UnloadLora = parse(&body)?;
    d.unload_lora(&r.lora_name).await?;
    Ok(format!(
        "Success: LoRA adapter '{}' removed successfully.",
        r.lora_name
    ))
}

/// vLLM's `/tokenize`: `{"count", "max_model_len", "tokens"}`.
async fn tokenize(
    State(d): State<Arc<Dispatcher>>,
    RequestBody(body): RequestBody,
) -> Result<Json<Value>, ApiError> {
    let r: TokenizeRequest = parse(&body)?;
    d.check_model(&r.model)?;
    let input = match (r.prompt, r.messages) {
        (Some(p), None) if r.tools.is_none() && r.chat_template_kwargs.is_none() => {
            PromptInput::Text(p)
        }
        (Some(_), None) => {
            return Err(ApiError::invalid(
                "tools and chat_template_kwargs go with messages, not a prompt",
                "tools",
            ))
        }
        (None, Some(msgs)) => {
            // What a chat request with these tools sends, so its count is the request's.
            let tools = Tools::parse(r.tools.as_deref(), None, None)?;
            let kwargs = r.chat_template_kwargs.unwrap_or_default();
            chat_input(&d, chat_messages(msgs)?, tools.as_ref(), kwargs)
        }
        _ => {
            return Err(ApiError::invalid(
                "send either prompt (text) or messages",
                "prompt",
            ))
        }
    };
    let ids = d
        .tokenize_with(
            input,
            r.add_special_tokens,
            r.add_generation_prompt.unwrap_or(true),
        )
        .await?;
    Ok(Json(
        json!({"count": ids.len(), "max_model_len": d.model.max_context(), "tokens": ids}),
    ))
}

/// vLLM's `/detokenize`: `{"prompt"}`, special tokens kept.
async fn detokenize(
    State(d): State<Arc<Dispatcher>>,
    RequestBody(body): RequestBody,
) -> Result<Json<Value>, ApiError> {
    let r: DetokenizeRequest = parse(&body)?;
    d.check_model(&r.model)?;
    d.check_vocabulary(&r.tokens, "tokens")?;
    let text = d
        .model
        .text
        .tokenizer
        .decode(&r.tokens, false)
        .map_err(|e| ApiError::invalid(e.to_string(), "tokens"))?;
    Ok(Json(json!({ "prompt": text })))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn completions(
    State(d): State<Arc<Dispatcher>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    RequestBody(body): RequestBody,
) -> Response {
    let span = trace::request_span("POST /v1/completions", "text_completion", &headers);
    let caller = caller.map(|Extension(c)| c).unwrap_or_default();
    match completion_request(&d, &body).await {
        Ok((preps, shape, stream)) => {
            let preps = preps
                .into_iter()
                .map(|p| trace::prepared(span.clone(), &d.model.name, p, &caller))
                .collect();
            serve(d, preps, shape, stream).await
        }
        Err(e) => invalid(&d, e, &span),
    }
}

/// A request refused before it reached the dispatcher (malformed, out of range): counted as
/// `invalid`, marked on its span and answered.
fn invalid(d: &Dispatcher, e: ApiError, span: &tracing::Span) -> Response {
    d.metrics.request("invalid");
    trace::failed(span, &e);
    e.into_response()
}

/// Generates each of `preps` (one per choice) and answers in `shape`. If one cannot start, the
/// ones started are dropped, which cancels them.
async fn serve(d: Arc<Dispatcher>, preps: Vec<Prepared>, shape: Shape, stream: bool) -> Response {
    let samples = preps.iter().map(|p| p.params.n.max(1) as usize).sum();
    if let Err(e) = d.check_samples(samples) {
        return e.into_response();
    }
    let mut generations = Vec::with_capacity(preps.len());
    for prep in preps {
        match d.generate(prep).await {
            Ok(g) => generations.push(g),
            Err(e) => return e.into_response(),
        }
    }
    respond(d, generations, shape, stream)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Starts one chat request's generation (its samples counted against the router's limit).
async fn chat_prepared(d: &Dispatcher, prep: Prepared) -> Result<Generation, ApiError> {
    d.check_samples(prep.params.n.max(1) as usize)?;
    d.generate(prep).await
}

pub(crate) use messages::anthropic_error;

/// The chat request another API's request was translated into (a translation that does not
/// parse is the router's fault, not the client's).
fn translated(chat: Value) -> Result<ChatRequest, ApiError> {
    serde_json::from_value(chat)
        .map_err(|e| ApiError::Internal(format!("a translated request did not parse: {e}")))
}

/// The prompt a translated chat request renders to (what the other APIs count).
fn translated_prompt(d: &Dispatcher, chat: Value) -> Result<PromptInput, ApiError> {
    let r = translated(chat)?;
    let tools = Tools::parse(r.tools.as_deref(), None, None)?;
    let kwargs = template_kwargs(d, r.chat_template_kwargs, r.reasoning_effort.as_deref())?;
    Ok(chat_input(
        d,
        chat_messages(r.messages)?,
        tools.as_ref(),
        kwargs,
    ))
}

/// Prompts one completion request may batch.
const MAX_BATCHED_PROMPTS: usize = 256;

async fn completion_request(
    d: &Dispatcher,
    body: &[u8],
) -> Result<(Vec<Prepared>, Shape, bool), ApiError> {
    let r: CompletionRequest = parse(body)?;
    r.not_served.check(r.sampling.n()?)?;
    // A batch: one choice per prompt, `index` in the order given.
    let inputs: Vec<PromptInput> = match r.prompt {
        PromptField::Text(t) => vec![PromptInput::Text(t)],
        PromptField::Ids(ids) => vec![PromptInput::Ids(ids)],
        PromptField::Texts(v) => v.into_iter().map(PromptInput::Text).collect(),
        PromptField::IdLists(v) => v.into_iter().map(PromptInput::Ids).collect(),
    };
    if inputs.is_empty() || inputs.len() > MAX_BATCHED_PROMPTS {
        return Err(ApiError::invalid(
            format!(
                "send between 1 and {MAX_BATCHED_PROMPTS} prompts, not {}",
                inputs.len()
            ),
            "prompt",
        ));
    }
    let mut params = r.sampling.params(r.max_tokens)?;
    if let Some(n) = r.logprobs {
        params.logprobs = true;
        params.top_logprobs = n;
    }
    let mut preps = Vec::with_capacity(inputs.len());
    let mut echoes = Vec::with_capacity(inputs.len());
    for input in inputs {
        echoes.push(match (&input, r.echo.unwrap_or(false)) {
            (PromptInput::Text(t), true) => Some(t.clone()),
            (PromptInput::Ids(ids), true) => Some(
                d.model
                    .text
                    .tokenizer
                    .decode(ids, false)
                    .map_err(|e| ApiError::invalid(e.to_string(), "prompt"))?,
            ),
            _ => None,
        });
        preps.push(
            d.prepare(&r.model, input, params.clone(), MaxTokensDefault::Fixed(16))
                .await?,
        );
    }
    let shape = Shape {
        api: Api::Completion,
        id: format!("cmpl-{}", preps[0].request_id),
        model: preps[0].model_name(&d.model.name),
        created: now(),
        logprobs: preps[0].params.logprobs,
        include_usage: r.sampling.include_usage(),
        echoes,
        n: params.n as usize,
        tool_calls: None,
        reasoning: None,
    };
    Ok((preps, shape, r.sampling.stream.unwrap_or(false)))
}

async fn chat_completions(
    State(d): State<Arc<Dispatcher>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    RequestBody(body): RequestBody,
) -> Response {
    let span = trace::request_span("POST /v1/chat/completions", "chat", &headers);
    let caller = caller.map(|Extension(c)| c).unwrap_or_default();
    match chat_request(&d, &body).await {
        Ok((prep, shape, stream)) => {
            let prep = trace::prepared(span, &d.model.name, prep, &caller);
            serve(d, vec![prep], shape, stream).await
        }
        Err(e) => invalid(&d, e, &span),
    }
}

/// Chat messages as a prompt, with the tools the model may call: rendered by a template that
/// takes them, or described in a system message for one that does not; `kwargs` are more
/// variables for the template.
fn chat_input(
    d: &Dispatcher,
    messages: Vec<ChatMessage>,
    tools: Option<&Tools>,
    kwargs: serde_json::Map<String, Value>,
) -> PromptInput {
    match (tools, template_takes_tools(d)) {
        (Some(t), true) => PromptInput::ChatWith(messages, t.entries(), kwargs),
        (None, true) => PromptInput::ChatWith(messages, Vec::new(), kwargs),
        (t, false) => {
            PromptInput::ChatWith(tools::without_tool_support(messages, t), Vec::new(), kwargs)
        }
    }
}

/// The template variables a chat request sets: its `chat_template_kwargs`, and for a model
/// that thinks, `enable_thinking` from `reasoning_effort` (unless the kwargs set it). A model
/// that does not reason takes no effort but `none`.
fn template_kwargs(
    d: &Dispatcher,
    kwargs: Option<serde_json::Map<String, Value>>,
    effort: Option<&str>,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut kwargs = kwargs.unwrap_or_default();
    let thinking = match effort {
        None => None,
        Some("none" | "minimal") => Some(false),
        Some("low" | "medium" | "high") => Some(true),
        Some(other) => {
            return Err(ApiError::invalid(
                format!("reasoning_effort {other:?} is not none, minimal, low, medium or high"),
                "reasoning_effort",
            ))
        }
    };
    match (thinking, d.model.reasoning) {
        (Some(true), false) => Err(ApiError::invalid(
            "reasoning_effort is not supported with this model: it does not reason (send none)",
            "reasoning_effort",
        )),
        (Some(on), true) => {
            kwargs.entry("enable_thinking").or_insert(json!(on));
            Ok(kwargs)
        }
        _ => Ok(kwargs),
    }
}

/// How a request's tool calls come back in the output (None without tools): in the model's
/// own style where its template renders the tools and the choice is the model's (`auto`);
/// Hermes blocks where the tools were described in the conversation (that is the format the
/// description asks for) or a grammar forces the calls (that is the format it writes).
fn call_style(d: &Dispatcher, forced: bool) -> tandem_model::ToolCallStyle {
    match template_takes_tools(d) && !forced {
        true => d.model.tool_calls,
        false => tandem_model::ToolCallStyle::Hermes,
    }
}

/// Whether the model's chat template renders a `tools` list itself.
fn template_takes_tools(d: &Dispatcher) -> bool {
    d.model
        .text
        .chat_template
        .as_ref()
        .is_some_and(|t| t.takes_tools())
}

async fn chat_request(d: &Dispatcher, body: &[u8]) -> Result<(Prepared, Shape, bool), ApiError> {
    chat_prepare(d, parse(body)?).await
}

/// A parsed chat request, checked and prepared: what it generates, how it answers, whether it
/// streams.
async fn chat_prepare(d: &Dispatcher, r: ChatRequest) -> Result<(Prepared, Shape, bool), ApiError> {
    r.not_served.check(r.sampling.n()?)?;
    let tools = Tools::parse(
        r.tools.as_deref(),
        r.tool_choice.as_ref(),
        r.parallel_tool_calls,
    )?;
    let messages = chat_messages(r.messages)?;
    let mut params = r
        .sampling
        .params(r.max_completion_tokens.or(r.max_tokens))?;
    let forced = tools.as_ref().and_then(Tools::grammar);
    let style = tools.as_ref().map(|_| call_style(d, forced.is_some()));
    if let Some(g) = forced {
        if let Some(other) = &params.grammar {
            return Err(ApiError::invalid(
                format!(
                    "tool_choice required (or a named function) sets the output's format: send it without {}",
                    other.param
                ),
                "tool_choice",
            ));
        }
        params.grammar = Some(RequestedGrammar {
            grammar: g,
            param: "tool_choice",
        });
    }
    let kwargs = template_kwargs(d, r.chat_template_kwargs, r.reasoning_effort.as_deref())?;
    let input = chat_input(d, messages, tools.as_ref(), kwargs);
    params.logprobs = r.logprobs.unwrap_or(false);
    params.top_logprobs = r.top_logprobs.unwrap_or(0);
    if params.top_logprobs > 0 && !params.logprobs {
        return Err(ApiError::invalid(
            "top_logprobs needs logprobs: true",
            "top_logprobs",
        ));
    }
    let prep = d
        .prepare(&r.model, input, params, MaxTokensDefault::RestOfContext)
        .await?;
    let shape = Shape {
        api: Api::Chat,
        id: format!("chatcmpl-{}", prep.request_id),
        model: prep.model_name(&d.model.name),
        created: now(),
        logprobs: prep.params.logprobs,
        include_usage: r.sampling.include_usage(),
        echoes: vec![None],
        n: prep.params.n as usize,
        tool_calls: style,
        reasoning: d
            .model
            .reasoning
            .then(|| reasoning::starts_in_thought(d, &prep.prompt)),
    };
    Ok((prep, shape, r.sampling.stream.unwrap_or(false)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    #[tokio::test]
    async fn a_panicking_handler_is_that_request_s_500_and_the_app_goes_on() {
        let app = axum::Router::new()
            .route(
                "/boom",
                get(|| async {
                    if true {
                        panic!("boom at the handler");
                    }
                    "unreached"
                }),
            )
            .route("/fine", get(|| async { "fine" }))
            .layer(middleware::from_fn(catch_panic));
        let get = |path: &str| {
            axum::http::Request::get(path)
                .body(axum::body::Body::empty())
                .unwrap()
        };
        let resp = app.clone().oneshot(get("/boom")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "internal_error");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("boom at the handler"));
        let resp = app.oneshot(get("/fine")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
    }
}
