//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, served
//! by the same path as chat completions. A request is checked in Anthropic's terms, turned into
//! the chat request it means (system prompt, turns, `tool_use` blocks as the assistant's tool
//! calls, `tool_result` blocks as tool messages, tools with their `input_schema`, `tool_choice`
//! auto/any/tool/none as auto/required/named/none), generated like one, and answered in
//! Anthropic's shapes: a message with text and `tool_use` content blocks, `stop_reason`
//! (`end_turn`, `max_tokens`, `stop_sequence` with the sequence, `tool_use`), usage in input
//! and output tokens (prefix-cache hits as `cache_read_input_tokens`), streamed as Anthropic's
//! typed events, errors as `{"type": "error", "error": {"type", "message"}}`.

use std::convert::Infallible;
use std::sync::Arc;

use crate::flow::Caller;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::Stream;
use serde::Deserialize;
use serde_json::{json, Value};

use super::body::RequestBody;
use super::chat_prepared;
use super::reasoning::{split_reasoning, ThinkSplitter};
use super::request::parse;
use super::tools::{split_calls, CallParser, ToolCall};
use crate::dispatch::{Chunk, Dispatcher, FinishKind, Generation, Usage};
use crate::error::ApiError;
use crate::trace;

/// A Messages request. Fields this router does not know are refused naming them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MessagesRequest {
    model: String,
    max_tokens: Option<u64>,
    messages: Vec<AnthropicMessage>,
    #[serde(default)]
    system: Option<Blocks>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<AnthropicTool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    /// `user_id` for the caller's own tracking: accepted, nothing to do with it here.
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<Value>,
    /// Extended thinking: served off only (the models served here do not think in blocks).
    #[serde(default)]
    thinking: Option<Value>,
    /// A billing tier: one tier here.
    #[serde(default)]
    #[allow(dead_code)]
    service_tier: Option<String>,
    /// Prompt caching hints: the prefix cache needs none.
    #[serde(default)]
    #[allow(dead_code)]
    cache_control: Option<Value>,
    /// Structured output (`format`) and effort.
    #[serde(default)]
    output_config: Option<OutputConfig>,
    /// Only `standard`: there is no faster lane here.
    #[serde(default)]
    speed: Option<String>,
}

/// `output_config`: the answer's format (a JSON schema, through the structured-output path)
/// and the effort to put in (taken: it shapes extended thinking, which is not served).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputConfig {
    #[serde(default)]
    #[allow(dead_code)]
    effort: Option<String>,
    #[serde(default)]
    format: Option<Value>,
}

/// The body of `count_tokens`: what a request would send, without `max_tokens` or sampling.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CountRequest {
    model: String,
    messages: Vec<AnthropicMessage>,
    #[serde(default)]
    system: Option<Blocks>,
    #[serde(default)]
    tools: Option<Vec<AnthropicTool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    thinking: Option<Value>,
    /// Taken as in a request; none changes the prompt.
    #[serde(default)]
    #[allow(dead_code)]
    cache_control: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    output_config: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    output_format: Option<Value>,
    #[serde(default)]
    speed: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AnthropicMessage {
    role: String,
    content: Blocks,
}

/// Content: a string, or blocks.
#[derive(Deserialize)]
#[serde(untagged)]
enum Blocks {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AnthropicTool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    input_schema: Value,
    /// Prompt caching hints: the prefix cache needs none.
    #[serde(default)]
    #[allow(dead_code)]
    cache_control: Option<Value>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolChoice {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    disable_parallel_tool_use: Option<bool>,
}

/// A 400 in Anthropic's terms, naming the field at fault.
fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::invalid(message, param)
}

/// The text of a string or of text blocks (`what` names the field for errors).
fn text_of(b: &Blocks, what: &'static str) -> Result<String, ApiError> {
    match b {
        Blocks::Text(t) => Ok(t.clone()),
        Blocks::Blocks(blocks) => {
            let mut s = String::new();
            for block in blocks {
                match block["type"].as_str() {
                    Some("text") => s.push_str(block["text"].as_str().ok_or_else(|| {
                        bad(format!("a text block in {what} needs its \"text\""), what)
                    })?),
                    other => {
                        return Err(bad(
                            format!("{what} takes text blocks, not {other:?}"),
                            what,
                        ))
                    }
                }
            }
            Ok(s)
        }
    }
}

/// The chat messages (OpenAI's shape) an Anthropic conversation means.
fn openai_messages(
    system: Option<&Blocks>,
    messages: &[AnthropicMessage],
) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        out.push(json!({"role": "system", "content": text_of(s, "system")?}));
    }
    if messages.is_empty() {
        return Err(bad(
            "messages: at least one message is required",
            "messages",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let role = m.role.as_str();
        if !matches!(role, "user" | "assistant") {
            return Err(bad(
                format!("messages[{i}].role: {role:?} is not user or assistant"),
                "messages",
            ));
        }
        let blocks = match &m.content {
            Blocks::Text(t) => {
                out.push(json!({"role": role, "content": t}));
                continue;
            }
            Blocks::Blocks(b) => b,
        };
        let (mut text, mut calls) = (String::new(), Vec::new());
        for (j, block) in blocks.iter().enumerate() {
            let at = || format!("messages[{i}].content[{j}]");
            match (role, block["type"].as_str()) {
                (_, Some("text")) => {
                    let t = block["text"].as_str().ok_or_else(|| {
                        bad(format!("{}: a text block needs its \"text\"", at()), "messages")
                    })?;
                    text.push_str(t);
                }
                ("assistant", Some("tool_use")) => {
                    let (Some(id), Some(name)) = (block["id"].as_str(), block["name"].as_str())
                    else {
                        return Err(bad(
                            format!("{}: a tool_use block needs its \"id\" and \"name\"", at()),
                            "messages",
                        ));
                    };
                    let input = block.get("input").cloned().unwrap_or(json!({}));
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input.to_string()}}));
                }
                ("user", Some("tool_result")) => {
                    let Some(id) = block["tool_use_id"].as_str() else {
                        return Err(bad(
                            format!("{}: a tool_result block needs its \"tool_use_id\"", at()),
                            "messages",
                        ));
                    };
                    let content = match block.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(v) => {
                            let b: Blocks = serde_json::from_value(v.clone()).map_err(|_| {
                                bad(format!("{}: content is text or text blocks", at()), "messages")
                            })?;
                            text_of(&b, "messages")?
                        }
                    };
                    let content = match block["is_error"].as_bool() {
                        Some(true) => format!("Error: {content}"),
                        _ => content,
                    };
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                (_, other) => {
                    return Err(bad(
                        format!(
                            "{}: {role} content blocks of type {other:?} are not served (text, tool_use from the assistant, tool_result from the user)",
                            at()
                        ),
                        "messages",
                    ))
                }
            }
        }
        if !text.is_empty() || !calls.is_empty() {
            let mut m = json!({"role": role, "content": text});
            if !calls.is_empty() {
                m["tool_calls"] = json!(calls);
            }
            out.push(m);
        }
    }
    Ok(out)
}

/// OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, where given.
type OpenAiTools = (Option<Value>, Option<Value>, Option<bool>);

/// OpenAI's tools and tool choice for Anthropic's.
fn openai_tools(
    tools: Option<&[AnthropicTool]>,
    choice: Option<&ToolChoice>,
) -> Result<OpenAiTools, ApiError> {
    let tools = tools
        .map(|ts| {
            ts.iter()
                .map(|t| {
                    if let Some(k) = t.kind.as_deref().filter(|k| *k != "custom") {
                        return Err(bad(
                            format!("tool {:?}: server tools ({k}) are not served, only tools with an input_schema", t.name),
                            "tools",
                        ));
                    }
                    Ok(json!({"type": "function", "function": {
                        "name": t.name,
                        "description": t.description.clone().unwrap_or_default(),
                        "parameters": t.input_schema,
                    }}))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let (choice, parallel) = match choice {
        None => (None, None),
        Some(c) => {
            let parallel = c.disable_parallel_tool_use.map(|d| !d);
            let v = match (c.kind.as_str(), &c.name) {
                ("auto", _) => json!("auto"),
                ("any", _) => json!("required"),
                ("none", _) => json!("none"),
                ("tool", Some(name)) => json!({"type": "function", "function": {"name": name}}),
                ("tool", None) => {
                    return Err(bad(
                        "tool_choice of type tool names the tool",
                        "tool_choice",
                    ))
                }
                (other, _) => {
                    return Err(bad(
                        format!("tool_choice type {other:?} is not auto, any, tool or none"),
                        "tool_choice",
                    ))
                }
            };
            (Some(v), parallel)
        }
    };
    Ok((tools.map(Value::Array), choice, parallel))
}

/// Extended thinking, checked against the model: one that thinks thinks when asked
/// (`enabled`, with its `budget_tokens` taken and `max_tokens` bounding thought and answer
/// together, or `adaptive`) and not otherwise; one that does not takes only `disabled`. Whether
/// the model's thinking is on (None: it has none).
fn check_thinking(thinking: Option<&Value>, reasons: bool) -> Result<Option<bool>, ApiError> {
    let kind = thinking.map(|t| t["type"].as_str().unwrap_or(""));
    match (kind, reasons) {
        (None | Some("disabled"), true) => Ok(Some(false)),
        (None | Some("disabled"), false) => Ok(None),
        (Some("enabled" | "adaptive"), true) => Ok(Some(true)),
        (Some("enabled" | "adaptive"), false) => Err(bad(
            "thinking: extended thinking is not served by this model: it does not reason (send it disabled, or not at all)",
            "thinking",
        )),
        (Some(other), _) => Err(bad(
            format!("thinking type {other:?} is not enabled, adaptive or disabled"),
            "thinking",
        )),
    }
}

/// `speed`: only the standard lane.
fn check_speed(speed: Option<&str>) -> Result<(), ApiError> {
    match speed {
        None | Some("standard") => Ok(()),
        Some(other) => Err(bad(
            format!("speed {other:?} is not served: one lane here (standard)"),
            "speed",
        )),
    }
}

/// `output_config.format` as the chat request's `response_format`.
fn response_format(c: Option<&OutputConfig>) -> Result<Option<Value>, ApiError> {
    let Some(f) = c.and_then(|c| c.format.as_ref()) else {
        return Ok(None);
    };
    match (f["type"].as_str(), f.get("schema")) {
        (Some("json_schema"), Some(schema)) => Ok(Some(json!({"type": "json_schema",
            "json_schema": {"name": "output", "schema": schema}}))),
        _ => Err(bad(
            "output_config.format is {\"type\": \"json_schema\", \"schema\": {...}}",
            "output_config",
        )),
    }
}

/// The chat request an Anthropic request means, and whether it streams.
fn chat_body(r: MessagesRequest, reasons: bool) -> Result<(Value, bool), ApiError> {
    let Some(max_tokens) = r.max_tokens else {
        return Err(bad("max_tokens: field required", "max_tokens"));
    };
    let thinking = check_thinking(r.thinking.as_ref(), reasons)?;
    check_speed(r.speed.as_deref())?;
    let messages = openai_messages(r.system.as_ref(), &r.messages)?;
    let (tools, tool_choice, parallel) = openai_tools(r.tools.as_deref(), r.tool_choice.as_ref())?;
    let mut body = json!({
        "model": r.model,
        "messages": messages,
        "max_tokens": max_tokens,
    });
    let fields = [
        ("temperature", r.temperature.map(|v| json!(v))),
        ("top_p", r.top_p.map(|v| json!(v))),
        ("top_k", r.top_k.map(|v| json!(v))),
        ("stop", r.stop_sequences.map(|v| json!(v))),
        ("tools", tools),
        ("tool_choice", tool_choice),
        ("parallel_tool_calls", parallel.map(|v| json!(v))),
        (
            "response_format",
            response_format(r.output_config.as_ref())?,
        ),
        (
            "chat_template_kwargs",
            thinking.map(|on| json!({"enable_thinking": on})),
        ),
    ];
    for (k, v) in fields {
        if let Some(v) = v {
            body[k] = v;
        }
    }
    Ok((body, r.stream.unwrap_or(false)))
}

/// An error as Anthropic shapes it, with the status the API gives it.
pub(crate) fn anthropic_error(e: &ApiError) -> Response {
    let status = e.status();
    let kind = match status.as_u16() {
        400 | 413 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 => "timeout_error",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        _ => "api_error",
    };
    // Anthropic's names for the fields the chat request named.
    let message = e.to_string().replace("stop strings", "stop_sequences");
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    let mut resp = (status, Json(body)).into_response();
    if let Some(after) = e.retry_after_header() {
        resp.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, after);
    }
    resp
}

pub(super) async fn messages(
    State(d): State<Arc<Dispatcher>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    RequestBody(body): RequestBody,
) -> Response {
    let span = trace::request_span("POST /v1/messages", "chat", &headers);
    let caller = caller.map(|Extension(c)| c).unwrap_or_default();
    let started = async {
        let r: MessagesRequest = parse(&body)?;
        let (chat, stream) = chat_body(r, d.model.reasoning)?;
        let (prep, shape, _) = super::chat_prepare(&d, super::translated(chat)?).await?;
        Ok::<_, ApiError>((prep, shape, stream))
    };
    let (prep, shape, stream) = match started.await {
        Ok(x) => x,
        Err(e) => {
            d.metrics.request("invalid");
            trace::failed(&span, &e);
            return anthropic_error(&e);
        }
    };
    let prompt_tokens = prep.prompt.len();
    let prep = trace::prepared(span, &d.model.name, prep, &caller);
    let g = match chat_prepared(&d, prep).await {
        Ok(g) => g,
        Err(e) => return anthropic_error(&e),
    };
    let m = Msg {
        id: format!(
            "msg_{}",
            shape
                .id
                .trim_start_matches("chatcmpl-")
                .replace(['-', '.'], "")
        ),
        model: shape.model,
        tools: shape.tool_calls,
        reasoning: shape.reasoning,
        prompt_tokens,
    };
    if stream {
        return Sse::new(events(m, g))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    match whole(&m, g).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => anthropic_error(&e),
    }
}

/// `count_tokens`: `{"input_tokens"}`, what the same request's prompt holds.
pub(super) async fn count_tokens(
    State(d): State<Arc<Dispatcher>>,
    RequestBody(body): RequestBody,
) -> Response {
    let counted = async {
        let r: CountRequest = parse(&body)?;
        d.check_model(&r.model)?;
        let thinking = check_thinking(r.thinking.as_ref(), d.model.reasoning)?;
        check_speed(r.speed.as_deref())?;
        let messages = openai_messages(r.system.as_ref(), &r.messages)?;
        let (tools, _, _) = openai_tools(r.tools.as_deref(), r.tool_choice.as_ref())?;
        let mut chat = json!({"model": r.model, "messages": messages});
        if let Some(t) = tools {
            chat["tools"] = t;
        }
        if let Some(on) = thinking {
            chat["chat_template_kwargs"] = json!({"enable_thinking": on});
        }
        let input = super::translated_prompt(&d, chat)?;
        d.tokenize_with(input, None, true).await
    };
    match counted.await {
        Ok(ids) => Json(json!({"input_tokens": ids.len()})).into_response(),
        Err(e) => anthropic_error(&e),
    }
}

/// What the answer needs besides the generation.
struct Msg {
    id: String,
    model: String,
    /// The request has tools: calls in the output (written in this style) become `tool_use`
    /// blocks.
    tools: Option<tandem_model::ToolCallStyle>,
    /// The model thinks: its thought is a `thinking` block (`Some(true)`: the prompt opened
    /// it).
    reasoning: Option<bool>,
    prompt_tokens: usize,
}

/// Anthropic's `stop_reason` (and `stop_sequence`) for how an output ended.
fn stop_reason(finish: FinishKind, stop: Option<&str>, called: bool) -> (&'static str, Value) {
    match (finish, stop) {
        (FinishKind::Stop, Some(s)) => ("stop_sequence", json!(s)),
        (FinishKind::Stop, None) if called => ("tool_use", Value::Null),
        (FinishKind::Stop, None) => ("end_turn", Value::Null),
        (FinishKind::Length, _) => ("max_tokens", Value::Null),
        // Cut short by the worker's shutdown: the nearest Anthropic names.
        (FinishKind::Cancelled, _) => ("refusal", Value::Null),
    }
}

fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
    })
}

fn tool_use(c: &ToolCall) -> Value {
    let input: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
    json!({"type": "tool_use", "id": c.id.replacen("call_", "toolu_", 1), "name": c.name, "input": input})
}

/// The whole message, once generated.
async fn whole(m: &Msg, mut g: Generation) -> Result<Value, ApiError> {
    let (mut text, mut end, mut stop) = (String::new(), None, None);
    while let Some(c) = g.next().await {
        let (_, c) = c?;
        text.push_str(&c.text);
        if c.finish.is_some() {
            end = c.finish;
            stop = c.stop;
        }
    }
    let (finish, u) =
        end.ok_or_else(|| ApiError::Internal("stream ended without a finish".into()))?;
    let mut content = Vec::new();
    if let Some(in_thought) = m.reasoning {
        let (thought, answer) = split_reasoning(&text, in_thought);
        if !thought.is_empty() {
            content.push(thinking_block(&thought));
        }
        text = answer;
    }
    let called = if let Some(style) = m.tools {
        let (t, calls) = split_calls(&m.id, &text, style);
        if let Some(t) = t {
            content.push(json!({"type": "text", "text": t}));
        }
        content.extend(calls.iter().map(tool_use));
        !calls.is_empty()
    } else {
        if !text.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        false
    };
    let (reason, sequence) = stop_reason(finish, stop.as_deref(), called);
    Ok(json!({
        "id": m.id,
        "type": "message",
        "role": "assistant",
        "model": m.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(&u),
    }))
}

/// A thought as Anthropic's `thinking` block (unsigned: the thought is the model's own text).
fn thinking_block(thought: &str) -> Value {
    json!({"type": "thinking", "thinking": thought, "signature": ""})
}

fn event(kind: &'static str, data: Value) -> Event {
    Event::default().event(kind).data(data.to_string())
}

/// The streamed message: `message_start`, then per content block `content_block_start`, its
/// deltas (`text_delta`, or one `input_json_delta` with a call's whole input) and
/// `content_block_stop`, then `message_delta` with the stop reason and usage and
/// `message_stop`; a failure mid-way is an `error` event.
fn events(m: Msg, g: Generation) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    struct St {
        m: Msg,
        g: Generation,
        parser: Option<CallParser>,
        splitter: Option<ThinkSplitter>,
        /// Index of the next block, and whether a thinking or a text block is open.
        block: usize,
        thinking_open: bool,
        text_open: bool,
        calls: usize,
        queue: std::collections::VecDeque<Event>,
        started: bool,
        finished: bool,
    }
    impl St {
        fn thinking(&mut self, t: &str) {
            if t.is_empty() {
                return;
            }
            if !self.thinking_open {
                self.queue.push_back(event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": self.block,
                        "content_block": thinking_block("")}),
                ));
                self.thinking_open = true;
            }
            self.queue.push_back(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.block,
                    "delta": {"type": "thinking_delta", "thinking": t}}),
            ));
        }
        fn close_thinking(&mut self) {
            if self.thinking_open {
                self.queue.push_back(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": self.block}),
                ));
                self.thinking_open = false;
                self.block += 1;
            }
        }
        fn text(&mut self, t: &str) {
            if t.is_empty() {
                return;
            }
            self.close_thinking();
            if !self.text_open {
                self.queue.push_back(event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": self.block,
                        "content_block": {"type": "text", "text": ""}}),
                ));
                self.text_open = true;
            }
            self.queue.push_back(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.block,
                    "delta": {"type": "text_delta", "text": t}}),
            ));
        }
        fn close_text(&mut self) {
            if self.text_open {
                self.queue.push_back(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": self.block}),
                ));
                self.text_open = false;
                self.block += 1;
            }
        }
        fn call(&mut self, c: &ToolCall) {
            self.close_thinking();
            self.close_text();
            let mut start = tool_use(c);
            let input = std::mem::replace(&mut start["input"], json!({}));
            let i = self.block;
            self.queue.push_back(event(
                "content_block_start",
                json!({"type": "content_block_start", "index": i, "content_block": start}),
            ));
            self.queue.push_back(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
            ));
            self.queue.push_back(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ));
            self.block += 1;
            self.calls += 1;
        }
        fn absorb(&mut self, c: Chunk) {
            let (thought, answer) = match &mut self.splitter {
                Some(s) => s.feed(&c.text, c.finish.is_some()),
                None => (String::new(), c.text.clone()),
            };
            self.thinking(&thought);
            let (text, calls) = match &mut self.parser {
                Some(p) => {
                    let (mut text, mut calls) = p.push(&answer);
                    if c.finish.is_some() {
                        let (rest, more) = p.finish();
                        text.push_str(&rest);
                        calls.extend(more);
                    }
                    (text, calls)
                }
                None => (answer, Vec::new()),
            };
            self.text(&text);
            for call in &calls {
                self.call(call);
            }
            if let Some((finish, u)) = c.finish {
                self.close_thinking();
                self.close_text();
                let (reason, sequence) = stop_reason(finish, c.stop.as_deref(), self.calls > 0);
                self.queue.push_back(event(
                    "message_delta",
                    json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(&u)}),
                ));
                self.queue
                    .push_back(event("message_stop", json!({"type": "message_stop"})));
                self.finished = true;
            }
        }
    }
    let parser = m.tools.map(|s| CallParser::new(&m.id, 0, s));
    let splitter = m.reasoning.map(ThinkSplitter::new);
    let st = St {
        m,
        g,
        parser,
        splitter,
        block: 0,
        thinking_open: false,
        text_open: false,
        calls: 0,
        queue: Default::default(),
        started: false,
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
                st.started = true;
                let message = json!({
                    "id": st.m.id, "type": "message", "role": "assistant", "model": st.m.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": st.m.prompt_tokens, "output_tokens": 0},
                });
                st.queue.push_back(event(
                    "message_start",
                    json!({"type": "message_start", "message": message}),
                ));
                st.queue.push_back(event("ping", json!({"type": "ping"})));
                continue;
            }
            match st.g.next().await {
                Some(Ok((_, c))) => st.absorb(c),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "stream failed");
                    let kind = if e.status() == StatusCode::SERVICE_UNAVAILABLE {
                        "overloaded_error"
                    } else {
                        "api_error"
                    };
                    st.queue.push_back(event(
                        "error",
                        json!({"type": "error", "error": {"type": kind, "message": e.to_string()}}),
                    ));
                    st.finished = true;
                }
                None => st.finished = true,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(v: Value) -> Result<MessagesRequest, ApiError> {
        parse(v.to_string().as_bytes())
    }

    /// A conversation with a system prompt, a tool call and its result becomes the chat
    /// messages it means: the call as the assistant's tool_calls (its input as arguments), the
    /// result as a tool message answering the call's id.
    #[test]
    fn a_conversation_becomes_its_chat_messages() {
        let r = request(json!({
            "model": "m", "max_tokens": 9,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": true},
                ]},
            ],
            "stop_sequences": ["END"], "top_k": 5,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
        }))
        .unwrap();
        let (body, stream) = chat_body(r, false).unwrap();
        assert!(!stream);
        assert_eq!(
            body["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
            ])
        );
        assert_eq!(body["stop"], json!(["END"]));
        assert_eq!(body["top_k"], json!(5));
        assert_eq!(body["max_tokens"], json!(9));
        assert_eq!(
            body["tool_choice"],
            json!({"type": "function", "function": {"name": "get_weather"}})
        );
        assert_eq!(body["parallel_tool_calls"], json!(false));
        assert_eq!(
            body["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
        // The translated request is one the chat path takes.
        let _: super::super::request::ChatRequest = serde_json::from_value(body).unwrap();
    }

    /// What is malformed or not served is a 400 naming it: an unknown field, a missing
    /// max_tokens, a block of another type, a role, a tool choice, a server tool, thinking.
    #[test]
    fn what_is_malformed_or_not_served_is_refused_naming_it() {
        let base =
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            b
        };
        let refused = |v: Value| match request(v.clone()).and_then(|r| chat_body(r, false)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted {v}"),
        };
        assert!(refused(with("temperatur", json!(1))).contains("unknown field `temperatur`"));
        let mut no_max = base.clone();
        no_max.as_object_mut().unwrap().remove("max_tokens");
        assert!(refused(no_max).contains("max_tokens: field required"));
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        assert!(refused(with("messages", image)).contains("messages[0].content[0]"));
        let role = json!([{"role": "system", "content": "x"}]);
        assert!(refused(with("messages", role)).contains("messages[0].role"));
        assert!(refused(with("messages", json!([]))).contains("at least one message"));
        assert!(refused(with("tool_choice", json!({"type": "some"}))).contains("\"some\""));
        assert!(refused(with("tool_choice", json!({"type": "tool"}))).contains("names the tool"));
        let server = json!([{"name": "s", "type": "web_search_20250305", "input_schema": {}}]);
        assert!(refused(with("tools", server)).contains("server tools"));
        assert!(refused(with(
            "thinking",
            json!({"type": "enabled", "budget_tokens": 1024})
        ))
        .contains("thinking"));
        assert!(refused(with("speed", json!("fast"))).contains("speed \"fast\""));
        assert!(refused(with("container", json!("c1"))).contains("unknown field `container`"));
        let format = json!({"format": {"type": "xml"}});
        assert!(refused(with("output_config", format)).contains("output_config.format"));
        // Thinking off, metadata, the service tier, caching hints, the standard speed and an
        // output format are taken (the format as the chat request's response_format).
        let ok = with("thinking", json!({"type": "disabled"}));
        let mut ok = ok;
        ok["metadata"] = json!({"user_id": "u"});
        ok["service_tier"] = json!("auto");
        ok["cache_control"] = json!({"type": "ephemeral"});
        ok["speed"] = json!("standard");
        let schema = json!({"type": "object"});
        ok["output_config"] =
            json!({"effort": "low", "format": {"type": "json_schema", "schema": schema}});
        let (body, _) = request(ok).and_then(|r| chat_body(r, false)).unwrap();
        assert_eq!(
            body["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
        );
    }

    #[test]
    fn stop_reasons_are_anthropic_s() {
        assert_eq!(stop_reason(FinishKind::Stop, None, false).0, "end_turn");
        assert_eq!(stop_reason(FinishKind::Stop, None, true).0, "tool_use");
        assert_eq!(
            stop_reason(FinishKind::Stop, Some("END"), true),
            ("stop_sequence", json!("END"))
        );
        assert_eq!(stop_reason(FinishKind::Length, None, true).0, "max_tokens");
    }

    #[test]
    fn errors_have_anthropic_s_shape_and_status() {
        for (e, status, kind) in [
            (
                ApiError::invalid("x", "messages"),
                400,
                "invalid_request_error",
            ),
            (ApiError::ModelNotFound("m".into()), 404, "not_found_error"),
            (
                ApiError::Unauthorized("no".into()),
                401,
                "authentication_error",
            ),
            (ApiError::QueueFull(1), 503, "overloaded_error"),
            (
                ApiError::OverQuota {
                    tenant: "a".into(),
                    limit: "requests_per_minute",
                    retry_after: std::time::Duration::from_secs(2),
                },
                429,
                "rate_limit_error",
            ),
            (ApiError::NoWorker, 503, "overloaded_error"),
            (ApiError::Internal("x".into()), 500, "api_error"),
        ] {
            let r = anthropic_error(&e);
            assert_eq!(r.status().as_u16(), status, "{e}");
            let body =
                futures::executor::block_on(axum::body::to_bytes(r.into_body(), 1 << 16)).unwrap();
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(
                (v["type"].as_str(), v["error"]["type"].as_str()),
                (Some("error"), Some(kind))
            );
        }
    }
}
