//! OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE` of it,
//! `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items` and
//! `POST /v1/responses/input_tokens`, served by the same path as chat completions.
//!
//! A request is checked in the Responses API's terms, turned into the chat request it means
//! (`instructions` as the system prompt; message items, `function_call` items as the
//! assistant's tool calls, `function_call_output` items as tool messages; function tools;
//! `text.format` as `response_format`; `max_output_tokens`), generated like one and answered as
//! a response object: output items (an assistant `message` with `output_text`, `function_call`
//! items in the model's own call format or a forced one), `status` (`completed`, `incomplete`
//! with `max_output_tokens`, `cancelled`, `failed`), usage with cached tokens. Streamed, it is
//! the typed event sequence the official client parses (`response.created`,
//! `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
//! `response.output_text.delta`, ..., `response.function_call_arguments.delta`/`.done`,
//! `response.completed`), each with its `sequence_number`; a failure mid-way is an `error`
//! event then `response.failed`.
//!
//! `store` (default true) keeps the response and its conversation in the [`ResponseStore`];
//! `previous_response_id` continues that conversation (the follow-up sends only its new input;
//! the earlier instructions are not carried over, as OpenAI specifies). `background: true`
//! answers at once with an `in_progress` response, generates on the router, and is polled with
//! GET and stopped with cancel.
//!
//! Fields this server cannot honour are refused naming them: hosted tools (web search, file
//! search, ...), `conversation`, `prompt` templates, `truncation: auto`, reasoning effort on a
//! model that does not reason, image and file inputs.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::Stream;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::body::RequestBody;
use super::reasoning::ThinkSplitter;
use super::request::parse;
use super::response::TokenTexts;
use super::store::{ResponseStore, Running, RunningTask, StoredResponse};
use super::tools::{CallParser, ToolCall};
use super::{chat_prepared, now};
use crate::dispatch::{Chunk, Dispatcher, FinishKind, Generation, Usage};
use crate::error::ApiError;
use crate::flow::Caller;
use crate::trace;

/// The Responses API's state: the stored responses and the background ones running here.
pub struct Responses {
    pub(crate) store: ResponseStore,
    pub(crate) running: Running,
}

impl Responses {
    pub(crate) fn new(store: ResponseStore) -> Arc<Self> {
        Arc::new(Self {
            store,
            running: Running::default(),
        })
    }

    /// With a memory store of at most `max_bytes`, entries living `ttl`.
    pub fn in_memory(max_bytes: u64, ttl: std::time::Duration) -> Arc<Self> {
        Self::new(ResponseStore::memory(max_bytes, ttl))
    }
}

/// `input`: a string (one user message) or items.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// `text`: the output's format, and its verbosity (only the default is served).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TextConfig {
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    verbosity: Option<String>,
}

/// `stream_options`: obfuscation pads events against side channels on shared networks; the
/// events here carry none, so it is taken either way.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    #[allow(dead_code)]
    include_obfuscation: Option<bool>,
}

/// A create request. Unknown fields are refused naming them; known ones this server cannot
/// honour are refused in [`CreateRequest::check`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Option<Input>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    text: Option<TextConfig>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    max_tool_calls: Option<u64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    background: Option<bool>,
    #[serde(default)]
    include: Option<Vec<String>>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    truncation: Option<String>,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
    /// Who the caller is, a prompt-cache routing hint (the KV-aware router needs none), how
    /// long to keep the prompt cached (the prefix cache keeps what it can), the billing tier:
    /// taken, echoed where the response has the field.
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    safety_identifier: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    prompt_cache_key: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    prompt_cache_retention: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    service_tier: Option<String>,
    // Not served: refused when set.
    #[serde(default)]
    conversation: Option<Value>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    context_management: Option<Value>,
    #[serde(default)]
    background_options: Option<Value>,
    #[serde(default)]
    prompt_cache_options: Option<Value>,
    #[serde(default)]
    moderation: Option<Value>,
    #[serde(default)]
    access_programs: Option<Value>,
    #[serde(default)]
    image: Option<Value>,
    // vLLM's sampling extensions, as in chat.
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    ignore_eos: Option<bool>,
}

/// `include` values served: log-probabilities of the output text, and a reasoning item's
/// encrypted content (none is made here: reasoning, where a model has it, comes back as text).
const INCLUDES: &[&str] = &[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
];

/// Most metadata pairs, and the longest key and value (OpenAI's limits).
const METADATA_PAIRS: usize = 16;
const METADATA_KEY: usize = 64;
const METADATA_VALUE: usize = 512;

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::invalid(message, param)
}

impl CreateRequest {
    /// Refuses what is not served, naming it.
    fn check(&self) -> Result<(), ApiError> {
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        for (field, given, what) in [
            (
                "conversation",
                set(&self.conversation),
                "conversation objects (send previous_response_id, or the items)",
            ),
            ("prompt", set(&self.prompt), "stored prompt templates"),
            (
                "context_management",
                set(&self.context_management),
                "context management (compaction)",
            ),
            (
                "background_options",
                set(&self.background_options),
                "background options",
            ),
            (
                "prompt_cache_options",
                set(&self.prompt_cache_options),
                "prompt cache options (the prefix cache needs none)",
            ),
            ("moderation", set(&self.moderation), "moderation"),
            (
                "access_programs",
                set(&self.access_programs),
                "access programs",
            ),
            ("image", set(&self.image), "image generation"),
        ] {
            if given {
                return Err(bad(
                    format!("{field}: {what} not served by this server"),
                    field,
                ));
            }
        }
        if self.stream_options.is_some() && self.stream != Some(true) {
            return Err(bad(
                "stream_options is only allowed when stream is true",
                "stream_options",
            ));
        }
        match self.truncation.as_deref() {
            None | Some("disabled") => {}
            Some("auto") => {
                return Err(bad(
                    "truncation \"auto\" is not served: a conversation over the model's context is refused (send disabled, or fewer items)",
                    "truncation",
                ))
            }
            Some(other) => {
                return Err(bad(
                    format!("truncation {other:?} is not auto or disabled"),
                    "truncation",
                ))
            }
        }
        if let Some(t) = &self.text {
            match t.verbosity.as_deref() {
                None | Some("medium") => {}
                Some(v) => {
                    return Err(bad(
                        format!(
                        "text.verbosity {v:?} is not served: this model has one verbosity (medium)"
                    ),
                        "text",
                    ))
                }
            }
        }
        for inc in self.include.iter().flatten() {
            if !INCLUDES.contains(&inc.as_str()) {
                return Err(bad(
                    format!(
                        "include {inc:?} is not served (served: {})",
                        INCLUDES.join(", ")
                    ),
                    "include",
                ));
            }
        }
        if let Some(m) = &self.metadata {
            check_metadata(m)?;
        }
        if self.background == Some(true) {
            if self.store == Some(false) {
                return Err(bad(
                    "background responses are stored: send store true (or leave it out)",
                    "background",
                ));
            }
            if self.stream == Some(true) {
                return Err(bad("streaming a background response is not served: poll it with GET /v1/responses/{id}", "background"));
            }
        }
        Ok(())
    }

    /// Whether the output text's log-probabilities were asked for.
    fn logprobs(&self) -> bool {
        self.include
            .iter()
            .flatten()
            .any(|i| i == "message.output_text.logprobs")
            || self.top_logprobs.is_some_and(|n| n > 0)
    }
}

/// `reasoning`, checked against the model: one that thinks takes an effort (`none` and
/// `minimal` turn its thinking off, `low`, `medium` and `high` on) and a summary setting (its
/// reasoning comes back whole, as the reasoning item's content, with no summary); one that does
/// not reason takes only an absent or `none` effort. The effort, where one was given.
fn check_reasoning(r: Option<&Value>, reasons: bool) -> Result<Option<String>, ApiError> {
    let Some(r) = r.filter(|r| !r.is_null()) else {
        return Ok(None);
    };
    let mut effort = None;
    let Some(obj) = r.as_object() else {
        return Err(bad(
            "reasoning is an object: {\"effort\": ...}",
            "reasoning",
        ));
    };
    for (k, v) in obj {
        match (k.as_str(), v) {
            (_, Value::Null) => {}
            ("effort", Value::String(e)) if e == "none" => effort = Some(e.clone()),
            ("effort", Value::String(e))
                if reasons && matches!(e.as_str(), "minimal" | "low" | "medium" | "high") =>
            {
                effort = Some(e.clone())
            }
            ("summary" | "generate_summary", Value::String(s))
                if reasons && matches!(s.as_str(), "auto" | "concise" | "detailed") => {}
            ("effort" | "summary" | "generate_summary", _) if reasons => {
                return Err(bad(
                    format!("reasoning.{k} {v} is not served (effort: none, minimal, low, medium, high; summary: auto, concise, detailed)"),
                    "reasoning",
                ))
            }
            ("effort" | "summary" | "generate_summary", _) => {
                return Err(bad(
                    format!("reasoning.{k} is not supported with this model: it does not reason"),
                    "reasoning",
                ))
            }
            (other, _) => {
                return Err(bad(
                    format!("reasoning.{other} is not a reasoning setting (effort, summary)"),
                    "reasoning",
                ))
            }
        }
    }
    Ok(effort)
}

fn check_metadata(m: &Map<String, Value>) -> Result<(), ApiError> {
    if m.len() > METADATA_PAIRS {
        return Err(bad(
            format!("metadata has {} pairs: at most {METADATA_PAIRS}", m.len()),
            "metadata",
        ));
    }
    for (k, v) in m {
        let ok = k.chars().count() <= METADATA_KEY
            && v.as_str()
                .is_some_and(|s| s.chars().count() <= METADATA_VALUE);
        if !ok {
            return Err(bad(
                format!("metadata {k:?}: keys are strings of at most {METADATA_KEY} characters, values strings of at most {METADATA_VALUE}"),
                "metadata",
            ));
        }
    }
    Ok(())
}

/// A new id with `prefix`: 128 random bits (a stored response is found by its id alone).
fn new_id(prefix: &str) -> String {
    let n: u128 = rand::random();
    format!("{prefix}_{n:032x}")
}

/// The request's input as items, each with its `type` and an `id` (what is stored and listed).
fn input_items(input: Option<Input>) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        None => return Err(bad("input: field required", "input")),
        Some(Input::Text(t)) => vec![json!({
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": t}],
        })],
        Some(Input::Items(items)) => items,
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, mut item)| {
            let Some(obj) = item.as_object_mut() else {
                return Err(bad(
                    format!("input[{i}] is not an item (an object)"),
                    "input",
                ));
            };
            if !obj.contains_key("type") && obj.contains_key("role") {
                obj.insert("type".into(), json!("message"));
            }
            if !obj.get("id").is_some_and(Value::is_string) {
                let prefix = match obj.get("type").and_then(Value::as_str) {
                    Some("function_call") => "fc",
                    Some("function_call_output") => "fco",
                    Some("reasoning") => "rs",
                    _ => "msg",
                };
                obj.insert("id".into(), json!(new_id(prefix)));
            }
            Ok(item)
        })
        .collect()
}

/// The text of a message item's content: a string, or text parts (`input_text`, and from the
/// assistant `output_text` and `refusal`), joined as chat joins its parts.
fn content_text(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for (j, p) in parts.iter().enumerate() {
                let text = match p["type"].as_str() {
                    Some("input_text" | "output_text") => p["text"].as_str(),
                    Some("refusal") => p["refusal"].as_str(),
                    other => {
                        return Err(bad(
                            format!("{at}.content[{j}]: parts of type {other:?} are not served: this model reads text (input_text)"),
                            "input",
                        ))
                    }
                };
                s.push_str(text.ok_or_else(|| {
                    bad(
                        format!("{at}.content[{j}]: a text part needs its text"),
                        "input",
                    )
                })?);
            }
            Ok(s)
        }
        _ => Err(bad(
            format!("{at}.content is a string or a list of parts"),
            "input",
        )),
    }
}

/// The chat messages (OpenAI's chat shape) a conversation of items means: `instructions`
/// first as the system prompt; consecutive function calls joined into one assistant message
/// (with the assistant's text just before them); reasoning items left out (templates drop an
/// earlier turn's reasoning).
fn chat_messages_of(instructions: Option<&str>, items: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out: Vec<Value> = Vec::new();
    if let Some(i) = instructions {
        out.push(json!({"role": "system", "content": i}));
    }
    // Whether the last message is an assistant's that calls may still join.
    let mut open_assistant = false;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        match item["type"].as_str() {
            Some("message") => {
                let role = item["role"].as_str().unwrap_or("");
                if !matches!(role, "user" | "assistant" | "system" | "developer") {
                    return Err(bad(
                        format!("{at}.role {role:?} is not user, assistant, system or developer"),
                        "input",
                    ));
                }
                let text = content_text(&item["content"], &at)?;
                out.push(json!({"role": role, "content": text}));
                open_assistant = role == "assistant";
            }
            Some("function_call") => {
                let (Some(call_id), Some(name)) =
                    (item["call_id"].as_str(), item["name"].as_str())
                else {
                    return Err(bad(
                        format!("{at}: a function_call item needs its call_id and name"),
                        "input",
                    ));
                };
                let arguments = item["arguments"].as_str().unwrap_or("{}");
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}});
                if !open_assistant {
                    out.push(json!({"role": "assistant", "content": ""}));
                    open_assistant = true;
                }
                let last = out.last_mut().expect("an assistant message");
                match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => last["tool_calls"] = json!([call]),
                }
            }
            Some("function_call_output") => {
                let Some(call_id) = item["call_id"].as_str() else {
                    return Err(bad(
                        format!("{at}: a function_call_output item needs the call_id it answers"),
                        "input",
                    ));
                };
                let output = match &item["output"] {
                    Value::Null => {
                        return Err(bad(
                            format!("{at}: a function_call_output item needs its output"),
                            "input",
                        ))
                    }
                    other => content_text(other, &at)?,
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
                open_assistant = false;
            }
            Some("reasoning") => {}
            Some("item_reference") => {
                return Err(bad(
                    format!("{at}: item references are not served: send the item itself, or continue with previous_response_id"),
                    "input",
                ))
            }
            other => {
                return Err(bad(
                    format!("{at}: items of type {other:?} are not served (message, function_call, function_call_output, reasoning)"),
                    "input",
                ))
            }
        }
    }
    if out
        .iter()
        .all(|m| m["role"] == "system" || m["role"] == "developer")
    {
        return Err(bad(
            "input: the conversation needs at least one user message",
            "input",
        ));
    }
    Ok(out)
}

/// Chat's tools for the Responses API's (function tools only).
fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| match t["type"].as_str() {
            Some("function") => {
                let mut f = Map::new();
                f.insert("name".into(), t["name"].clone());
                for k in ["description", "parameters"] {
                    if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                        f.insert(k.into(), v.clone());
                    }
                }
                Ok(json!({"type": "function", "function": f}))
            }
            other => Err(bad(
                format!("tools[{i}]: tools of type {other:?} are not served (function tools only)"),
                "tools",
            )),
        })
        .collect()
}

/// Chat's `tool_choice` for the Responses API's.
fn chat_tool_choice(c: &Value) -> Result<Value, ApiError> {
    match c {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => Ok(c.clone()),
        Value::Object(o) if o.get("type") == Some(&json!("function")) => match o["name"].as_str() {
            Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
            None => Err(bad(
                "tool_choice of type function names it: {\"type\": \"function\", \"name\": ...}",
                "tool_choice",
            )),
        },
        other => Err(bad(
            format!("tool_choice {other} is not served (auto, none, required, or {{\"type\": \"function\", \"name\": ...}})"),
            "tool_choice",
        )),
    }
}

/// Chat's `response_format` for `text.format`.
fn response_format(f: &Value) -> Result<Option<Value>, ApiError> {
    match f["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let Some(schema) = f.get("schema") else {
                return Err(bad("text.format json_schema needs its schema", "text"));
            };
            let name = f["name"].as_str().unwrap_or("output");
            Ok(Some(json!({"type": "json_schema",
                "json_schema": {"name": name, "schema": schema}})))
        }
        other => Err(bad(
            format!("text.format type {other:?} is not text, json_object or json_schema"),
            "text",
        )),
    }
}

/// The chat request `r` means over `conversation`.
fn chat_body(r: &CreateRequest, conversation: &[Value], reasons: bool) -> Result<Value, ApiError> {
    let effort = check_reasoning(r.reasoning.as_ref(), reasons)?;
    let messages = chat_messages_of(r.instructions.as_deref(), conversation)?;
    let mut body = json!({
        "model": r.model.clone().unwrap_or_default(),
        "messages": messages,
    });
    if let Some(t) = r.tools.as_deref().filter(|t| !t.is_empty()) {
        body["tools"] = json!(chat_tools(t)?);
    }
    if let Some(c) = &r.tool_choice {
        body["tool_choice"] = chat_tool_choice(c)?;
    }
    if let Some(f) = r.text.as_ref().and_then(|t| t.format.as_ref()) {
        if let Some(rf) = response_format(f)? {
            body["response_format"] = rf;
        }
    }
    if r.logprobs() {
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(r.top_logprobs.unwrap_or(0));
    }
    let fields = [
        (
            "max_completion_tokens",
            r.max_output_tokens.map(|v| json!(v)),
        ),
        ("temperature", r.temperature.map(|v| json!(v))),
        ("top_p", r.top_p.map(|v| json!(v))),
        ("top_k", r.top_k.map(|v| json!(v))),
        ("min_p", r.min_p.map(|v| json!(v))),
        ("repetition_penalty", r.repetition_penalty.map(|v| json!(v))),
        ("seed", r.seed.map(|v| json!(v))),
        ("ignore_eos", r.ignore_eos.map(|v| json!(v))),
        ("reasoning_effort", effort.map(|v| json!(v))),
        (
            "parallel_tool_calls",
            r.parallel_tool_calls.map(|v| json!(v)),
        ),
    ];
    for (k, v) in fields {
        if let Some(v) = v {
            body[k] = v;
        }
    }
    Ok(body)
}

/// The response object before any output: what the request set, echoed.
fn skeleton(r: &CreateRequest, id: &str, model: &str, created: u64, store: bool) -> Value {
    let tool_choice = r.tool_choice.clone().unwrap_or(json!("auto"));
    let format = r
        .text
        .as_ref()
        .and_then(|t| t.format.clone())
        .unwrap_or(json!({"type": "text"}));
    json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": r.background.unwrap_or(false),
        "completed_at": null,
        "error": null,
        "incomplete_details": null,
        "instructions": r.instructions,
        "max_output_tokens": r.max_output_tokens,
        "max_tool_calls": r.max_tool_calls,
        "model": model,
        "output": [],
        "parallel_tool_calls": r.parallel_tool_calls.unwrap_or(false),
        "previous_response_id": r.previous_response_id,
        "reasoning": {
            "effort": r.reasoning.as_ref().and_then(|v| v.get("effort")).cloned().unwrap_or(Value::Null),
            "summary": r.reasoning.as_ref().and_then(|v| v.get("summary")).cloned().unwrap_or(Value::Null),
        },
        "service_tier": "default",
        "store": store,
        "temperature": r.temperature.unwrap_or(1.0),
        "text": {"format": format, "verbosity": "medium"},
        "tool_choice": tool_choice,
        "tools": r.tools.clone().unwrap_or_default(),
        "top_logprobs": r.top_logprobs.unwrap_or(0),
        "top_p": r.top_p.unwrap_or(1.0),
        "truncation": "disabled",
        "usage": null,
        "user": r.user,
        "metadata": r.metadata.clone().unwrap_or_default(),
    })
}

fn usage(u: &Usage, reasoning_tokens: u32) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The reasoning item being written.
struct OpenReasoning {
    id: String,
    index: usize,
    text: String,
}

/// The assistant message item being written.
struct OpenMessage {
    id: String,
    index: usize,
    text: String,
    logprobs: Vec<Value>,
}

/// Builds the response from the generation's chunks: its output items, and (when streaming)
/// the events that say so, in order.
struct Builder {
    /// For the tokens' texts, where log-probabilities were asked for.
    texts: Option<Arc<Dispatcher>>,
    response: Value,
    /// The model thinks: its reasoning split out into a reasoning item.
    splitter: Option<ThinkSplitter>,
    reasoning: Option<OpenReasoning>,
    /// Tokens generated inside the thought.
    reasoning_tokens: u32,
    parser: Option<CallParser>,
    logprobs: bool,
    max_calls: Option<u64>,
    message: Option<OpenMessage>,
    /// With tools: whitespace at the end of the text so far, held until more text follows
    /// (the message's text is trimmed, as chat's is, and a call-only output has no message).
    held: String,
    output: Vec<Value>,
    calls: u64,
    streaming: bool,
    events: VecDeque<Value>,
    done: bool,
    /// Why the response failed, where it did.
    failure: Option<ApiError>,
}

impl Builder {
    fn new(
        texts: Option<Arc<Dispatcher>>,
        response: Value,
        tools: Option<tandem_model::ToolCallStyle>,
        max_calls: Option<u64>,
        streaming: bool,
    ) -> Self {
        let id = response["id"].as_str().unwrap_or_default().to_string();
        Self {
            logprobs: texts.is_some(),
            texts,
            response,
            splitter: None,
            reasoning: None,
            reasoning_tokens: 0,
            parser: tools.map(|s| CallParser::new(&id, 0, s)),
            max_calls,
            message: None,
            held: String::new(),
            output: Vec::new(),
            calls: 0,
            streaming,
            events: VecDeque::new(),
            done: false,
            failure: None,
        }
    }

    /// The builder for a model that thinks (`Some(true)`: the prompt opened the thought).
    fn with_reasoning(mut self, in_thought: Option<bool>) -> Self {
        self.splitter = in_thought.map(ThinkSplitter::new);
        self
    }

    fn reasoning_item(r: &OpenReasoning, status: &str) -> Value {
        json!({"type": "reasoning", "id": r.id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": r.text}]})
    }

    /// Reasoning text, into the reasoning item (opened at the first).
    fn reasoning_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if self.reasoning.is_none() {
            let r = OpenReasoning {
                id: new_id("rs"),
                index: self.output.len(),
                text: String::new(),
            };
            let mut item = Self::reasoning_item(&r, "in_progress");
            item["content"] = json!([]);
            self.emit(
                "response.output_item.added",
                json!({"output_index": r.index, "item": item}),
            );
            self.emit(
                "response.content_part.added",
                json!({"item_id": r.id, "output_index": r.index, "content_index": 0,
                    "part": {"type": "reasoning_text", "text": ""}}),
            );
            self.reasoning = Some(r);
        }
        let r = self.reasoning.as_mut().expect("open");
        r.text.push_str(text);
        let (id, index) = (r.id.clone(), r.index);
        self.emit(
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}),
        );
    }

    fn close_reasoning(&mut self, status: &str) {
        let Some(r) = self.reasoning.take() else {
            return;
        };
        let item = Self::reasoning_item(&r, status);
        self.emit(
            "response.reasoning_text.done",
            json!({"item_id": r.id, "output_index": r.index, "content_index": 0, "text": r.text}),
        );
        self.emit(
            "response.content_part.done",
            json!({"item_id": r.id, "output_index": r.index, "content_index": 0,
                "part": item["content"][0]}),
        );
        self.emit(
            "response.output_item.done",
            json!({"output_index": r.index, "item": item}),
        );
        self.output.push(item);
    }

    fn emit(&mut self, kind: &str, mut v: Value) {
        if self.streaming {
            v["type"] = json!(kind);
            self.events.push_back(v);
        }
    }

    fn message_item(m: &OpenMessage, status: &str, logprobs: bool) -> Value {
        let mut part = json!({"type": "output_text", "text": m.text, "annotations": []});
        if logprobs {
            part["logprobs"] = json!(m.logprobs);
        }
        json!({"type": "message", "id": m.id, "status": status, "role": "assistant",
            "content": [part]})
    }

    /// Text (and the tokens that made it, when it is exactly theirs) for the message item.
    fn text(&mut self, text: &str, lps: Vec<Value>) {
        if text.is_empty() && lps.is_empty() {
            return;
        }
        let mut text = text.to_string();
        if self.parser.is_some() {
            // Leading whitespace is dropped; trailing whitespace waits for more text.
            let whole = match &self.message {
                None => text.trim_start().to_string(),
                Some(_) => std::mem::take(&mut self.held) + &text,
            };
            let kept = whole.trim_end().len();
            self.held = whole[kept..].to_string();
            text = whole[..kept].to_string();
            if text.is_empty() {
                return;
            }
        }
        if self.message.is_none() {
            self.close_reasoning("completed");
            let m = OpenMessage {
                id: new_id("msg"),
                index: self.output.len(),
                text: String::new(),
                logprobs: Vec::new(),
            };
            let item = Self::message_item(&m, "in_progress", false);
            let mut item = item;
            item["content"] = json!([]);
            self.emit(
                "response.output_item.added",
                json!({"output_index": m.index, "item": item}),
            );
            let mut part = json!({"type": "output_text", "text": "", "annotations": []});
            if self.logprobs {
                part["logprobs"] = json!([]);
            }
            self.emit(
                "response.content_part.added",
                json!({"item_id": m.id, "output_index": m.index, "content_index": 0, "part": part}),
            );
            self.message = Some(m);
        }
        let m = self.message.as_mut().expect("open");
        m.text.push_str(&text);
        m.logprobs.extend(lps.iter().cloned());
        let (id, index) = (m.id.clone(), m.index);
        self.emit(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "delta": text, "logprobs": lps}),
        );
    }

    fn close_message(&mut self, status: &str) {
        self.held.clear();
        let Some(m) = self.message.take() else {
            return;
        };
        let item = Self::message_item(&m, status, self.logprobs);
        let part = item["content"][0].clone();
        self.emit(
            "response.output_text.done",
            json!({"item_id": m.id, "output_index": m.index, "content_index": 0,
                "text": m.text, "logprobs": part.get("logprobs").cloned().unwrap_or(json!([]))}),
        );
        self.emit(
            "response.content_part.done",
            json!({"item_id": m.id, "output_index": m.index, "content_index": 0, "part": part}),
        );
        self.emit(
            "response.output_item.done",
            json!({"output_index": m.index, "item": item}),
        );
        self.output.push(item);
    }

    fn call(&mut self, c: &ToolCall) {
        if self.max_calls.is_some_and(|m| self.calls >= m) {
            return;
        }
        self.close_reasoning("completed");
        self.close_message("completed");
        self.held.clear();
        self.calls += 1;
        let index = self.output.len();
        let id = new_id("fc");
        let item = |status: &str, args: &str| {
            json!({"type": "function_call", "id": id, "call_id": c.id, "name": c.name,
                "arguments": args, "status": status})
        };
        self.emit(
            "response.output_item.added",
            json!({"output_index": index, "item": item("in_progress", "")}),
        );
        self.emit(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": c.arguments}),
        );
        self.emit(
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "arguments": c.arguments, "name": c.name}),
        );
        let done = item("completed", &c.arguments);
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        self.output.push(done);
    }

    /// The response as it stands, with `status`.
    fn snapshot(&self, status: &str) -> Value {
        let mut r = self.response.clone();
        r["status"] = json!(status);
        r["output"] = json!(self.output);
        r
    }

    /// The opening events.
    fn start(&mut self) {
        let r = self.snapshot("in_progress");
        self.emit("response.created", json!({"response": r}));
        self.emit("response.in_progress", json!({"response": r}));
    }

    fn absorb(&mut self, c: Chunk) {
        // The thought first: what the splitter keeps for the answer goes on below.
        let (reasoning, answer) = match &mut self.splitter {
            Some(s) => {
                if s.thinking() {
                    self.reasoning_tokens += c.tokens.len() as u32;
                }
                s.feed(&c.text, c.finish.is_some())
            }
            None => (String::new(), c.text.clone()),
        };
        self.reasoning_text(&reasoning);
        let (text, calls, exact) = match &mut self.parser {
            Some(p) => {
                let (mut text, mut calls) = p.push(&answer);
                if c.finish.is_some() {
                    let (rest, more) = p.finish();
                    text.push_str(&rest);
                    calls.extend(more);
                }
                (text, calls, false)
            }
            // A chunk's tokens are the answer's only where none of its text was reasoning.
            None => (answer, Vec::new(), reasoning.is_empty()),
        };
        let lps = match (&self.texts, exact) {
            (Some(d), true) => {
                let tt = TokenTexts { d };
                c.tokens.iter().map(|t| tt.chat_entry(t)).collect()
            }
            _ => Vec::new(),
        };
        self.text(&text, lps);
        for call in &calls {
            self.call(call);
        }
        if let Some((finish, u)) = c.finish {
            self.end(finish, Some(&u));
        }
    }

    /// Ends the response: how the output ended, and its counts (none: cancelled here, by
    /// the client's cancel of a background response).
    fn end(&mut self, finish: FinishKind, u: Option<&Usage>) {
        let (status, item_status, details) = match (finish, u) {
            (FinishKind::Stop, _) => ("completed", "completed", Value::Null),
            (FinishKind::Length, _) => (
                "incomplete",
                "incomplete",
                json!({"reason": "max_output_tokens"}),
            ),
            (FinishKind::Cancelled, None) => ("cancelled", "incomplete", Value::Null),
            // Cut short by the worker's shutdown: incomplete, and the stream says so.
            (FinishKind::Cancelled, Some(_)) => ("incomplete", "incomplete", Value::Null),
        };
        self.close_reasoning(item_status);
        self.close_message(item_status);
        let mut r = self.snapshot(status);
        r["incomplete_details"] = details;
        r["completed_at"] = json!(now());
        if let Some(u) = u {
            r["usage"] = usage(u, self.reasoning_tokens);
        }
        let kind = match status {
            "completed" => "response.completed",
            "incomplete" => "response.incomplete",
            _ => "response.cancelled",
        };
        if kind != "response.cancelled" {
            self.emit(kind, json!({"response": r}));
        }
        self.response = r;
        self.done = true;
    }

    /// Ends the response as failed with `e`.
    fn fail(&mut self, e: &ApiError) {
        self.close_reasoning("incomplete");
        self.close_message("incomplete");
        let body = e.body();
        let code = body["error"]["code"].clone();
        let message = e.to_string();
        self.emit(
            "error",
            json!({"code": code, "message": message, "param": body["error"]["param"]}),
        );
        let mut r = self.snapshot("failed");
        r["error"] = json!({"code": code, "message": message});
        self.emit("response.failed", json!({"response": r}));
        self.response = r;
        self.done = true;
        self.failure = Some(e.clone());
    }
}

/// What a create request became before it generates.
struct Started {
    prep: crate::dispatch::Prepared,
    builder: Builder,
    /// The conversation to store with the response (none when `store` is false).
    stored_input: Option<Vec<Value>>,
    stream: bool,
    background: bool,
}

/// The conversation a `previous_response_id` continues: the stored response's input and its
/// output (none without one). Refuses one not stored, or still in progress.
async fn previous_conversation(rs: &Responses, prev: Option<&str>) -> Result<Vec<Value>, ApiError> {
    let Some(prev) = prev else {
        return Ok(Vec::new());
    };
    let Some(p) = rs.store.get(prev).await? else {
        return Err(ApiError::NotFound {
            message: format!("Previous response with id {prev:?} not found (it was never stored, was deleted, or expired)"),
            param: Some("previous_response_id"),
            code: "previous_response_not_found",
        });
    };
    if matches!(p.status(), "in_progress" | "queued") {
        return Err(bad(
            format!("previous response {prev:?} is still in progress: wait for it to complete"),
            "previous_response_id",
        ));
    }
    let mut c = p.input.clone();
    c.extend(
        p.response["output"]
            .as_array()
            .into_iter()
            .flatten()
            .cloned(),
    );
    Ok(c)
}

async fn start(d: &Arc<Dispatcher>, rs: &Responses, body: &[u8]) -> Result<Started, ApiError> {
    let mut r: CreateRequest = parse(body)?;
    r.check()?;
    let model = r.model.clone().unwrap_or_default();
    d.check_model(&model)?;
    let store = r.store.unwrap_or(true);
    let mut conversation = previous_conversation(rs, r.previous_response_id.as_deref()).await?;
    let logprobs = r.logprobs();
    let stream = r.stream.unwrap_or(false);
    let background = r.background.unwrap_or(false);
    let new_items = input_items(r.input.take())?;
    conversation.extend(new_items);
    let chat = chat_body(&r, &conversation, d.model.reasoning)?;
    let (prep, shape, _) = super::chat_prepare(d, super::translated(chat)?).await?;
    let id = new_id("resp");
    let response = skeleton(&r, &id, &shape.model, now(), store);
    Ok(Started {
        prep,
        builder: Builder::new(
            logprobs.then(|| d.clone()),
            response,
            shape.tool_calls,
            r.max_tool_calls,
            stream,
        )
        .with_reasoning(shape.reasoning),
        stored_input: store.then_some(conversation),
        stream,
        background,
    })
}

/// Stores the response as it stands (where the request asked for it).
async fn keep(rs: &Responses, b: &Builder, input: &Option<Vec<Value>>) {
    let Some(input) = input else {
        return;
    };
    let id = b.response["id"].as_str().unwrap_or_default().to_string();
    let stored = StoredResponse {
        response: b.response.clone(),
        input: input.clone(),
    };
    if let Err(e) = rs.store.put(&id, stored).await {
        tracing::warn!(response = %id, error = %e, "could not store a response");
    }
}

/// The generation to its end into `b`; `cancel` resolving stops it there (background).
async fn run(
    b: &mut Builder,
    mut g: Generation,
    cancel: Option<tokio::sync::oneshot::Receiver<()>>,
) {
    let mut cancel = cancel;
    while !b.done {
        let next = match cancel.as_mut() {
            Some(c) => tokio::select! {
                n = g.next() => n,
                _ = c => {
                    b.end(FinishKind::Cancelled, None);
                    return;
                }
            },
            None => g.next().await,
        };
        match next {
            Some(Ok((_, c))) => b.absorb(c),
            Some(Err(e)) => b.fail(&e),
            None => b.fail(&ApiError::Internal(
                "the stream ended without a finish".into(),
            )),
        }
    }
}

pub(super) async fn create(
    State(d): State<Arc<Dispatcher>>,
    Extension(rs): Extension<Arc<Responses>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    RequestBody(body): RequestBody,
) -> Response {
    let span = trace::request_span("POST /v1/responses", "chat", &headers);
    let caller = caller.map(|Extension(c)| c).unwrap_or_default();
    let Started {
        prep,
        mut builder,
        stored_input,
        stream,
        background,
    } = match start(&d, &rs, &body).await {
        Ok(s) => s,
        Err(e) => {
            d.metrics.request("invalid");
            trace::failed(&span, &e);
            return e.into_response();
        }
    };
    let prep = trace::prepared(span, &d.model.name, prep, &caller);
    let g = match chat_prepared(&d, prep).await {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    let id = builder.response["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if background {
        let mut queued = builder.snapshot("in_progress");
        queued["background"] = json!(true);
        builder.response = queued.clone();
        keep(&rs, &builder, &stored_input).await;
        let (tx, rx) = tokio::sync::oneshot::channel();
        // The task runs once it is registered, so that its own removal at its end follows.
        let (go, registered) = tokio::sync::oneshot::channel::<()>();
        let task_rs = rs.clone();
        let task_id = id.clone();
        let task = tokio::spawn(async move {
            let _ = registered.await;
            run(&mut builder, g, Some(rx)).await;
            keep(&task_rs, &builder, &stored_input).await;
            task_rs.running.take(&task_id);
        });
        rs.running.insert(id, RunningTask { cancel: tx, task });
        let _ = go.send(());
        return Json(queued).into_response();
    }
    if stream {
        return Sse::new(events(builder, g, rs, stored_input))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    run(&mut builder, g, None).await;
    keep(&rs, &builder, &stored_input).await;
    if let Some(e) = builder.failure.take() {
        tracing::warn!(response = %id, error = %e, "a response failed");
        return e.into_response();
    }
    Json(builder.response).into_response()
}

/// The streamed response: the builder's events as they come, each with its sequence number;
/// the response stored once it has ended.
fn events(
    b: Builder,
    g: Generation,
    rs: Arc<Responses>,
    stored_input: Option<Vec<Value>>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    struct St {
        b: Builder,
        g: Generation,
        rs: Arc<Responses>,
        input: Option<Vec<Value>>,
        seq: u64,
        started: bool,
        stored: bool,
    }
    let st = St {
        b,
        g,
        rs,
        input: stored_input,
        seq: 0,
        started: false,
        stored: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(mut ev) = st.b.events.pop_front() {
                ev["sequence_number"] = json!(st.seq);
                st.seq += 1;
                let kind = ev["type"].as_str().unwrap_or("message").to_string();
                let e = Event::default().event(kind).data(ev.to_string());
                return Some((Ok(e), st));
            }
            if st.b.done {
                if !st.stored {
                    st.stored = true;
                    keep(&st.rs, &st.b, &st.input).await;
                }
                return None;
            }
            if !st.started {
                st.started = true;
                st.b.start();
                continue;
            }
            match st.g.next().await {
                Some(Ok((_, c))) => st.b.absorb(c),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "stream failed");
                    st.b.fail(&e);
                }
                None => st.b.fail(&ApiError::Internal(
                    "the stream ended without a finish".into(),
                )),
            }
        }
    })
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        message: format!(
            "Response with id {id:?} not found (it was never stored, was deleted, or expired)"
        ),
        param: None,
        code: "not_found",
    }
}

/// Query of `GET /v1/responses/{id}`.
#[derive(Deserialize)]
pub(super) struct GetQuery {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    #[allow(dead_code)]
    include: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    starting_after: Option<u64>,
    #[serde(default)]
    #[allow(dead_code)]
    include_obfuscation: Option<bool>,
}

pub(super) async fn retrieve(
    Extension(rs): Extension<Arc<Responses>>,
    Path(id): Path<String>,
    Query(q): Query<GetQuery>,
) -> Response {
    if q.stream == Some(true) {
        return bad(
            "stream: resuming a response's stream is not served; GET it without stream",
            "stream",
        )
        .into_response();
    }
    match rs.store.get(&id).await {
        Ok(Some(r)) => Json(r.response.clone()).into_response(),
        Ok(None) => not_found(&id).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn delete(
    Extension(rs): Extension<Arc<Responses>>,
    Path(id): Path<String>,
) -> Response {
    // A background response still running is stopped first (its task stores its end, which
    // the delete then removes).
    rs.running.stop(&id).await;
    match rs.store.delete(&id).await {
        Ok(true) => {
            Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response()
        }
        Ok(false) => not_found(&id).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn cancel(
    Extension(rs): Extension<Arc<Responses>>,
    Path(id): Path<String>,
) -> Response {
    rs.running.stop(&id).await;
    match rs.store.get(&id).await {
        Ok(Some(r)) if r.response["background"] != true => bad(
            "only a response created with background: true can be cancelled",
            "response_id",
        )
        .into_response(),
        Ok(Some(r)) if matches!(r.status(), "in_progress" | "queued") => bad(
            format!("response {id:?} runs on another router: cancel it there"),
            "response_id",
        )
        .into_response(),
        Ok(Some(r)) => Json(r.response.clone()).into_response(),
        Ok(None) => not_found(&id).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Query of `GET /v1/responses/{id}/input_items`.
#[derive(Deserialize)]
pub(super) struct ListQuery {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    order: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    include: Option<String>,
}

/// Most items one page lists, and the default.
const MAX_PAGE: usize = 100;
const DEFAULT_PAGE: usize = 20;

pub(super) async fn input_items_list(
    Extension(rs): Extension<Arc<Responses>>,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Response {
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return bad(format!("limit must be between 1 and {MAX_PAGE}"), "limit").into_response();
    }
    let desc = match q.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(o) => {
            return bad(format!("order {o:?} is not asc or desc"), "order").into_response();
        }
    };
    let r = match rs.store.get(&id).await {
        Ok(Some(r)) => r,
        Ok(None) => return not_found(&id).into_response(),
        Err(e) => return e.into_response(),
    };
    let mut items: Vec<&Value> = r.input.iter().collect();
    if desc {
        items.reverse();
    }
    let from = match &q.after {
        None => 0,
        Some(a) => match items.iter().position(|i| i["id"] == a.as_str()) {
            Some(p) => p + 1,
            None => {
                return bad(
                    format!("after: no item {a:?} in this response's input"),
                    "after",
                )
                .into_response()
            }
        },
    };
    let page: Vec<&Value> = items.iter().skip(from).take(limit).copied().collect();
    let has_more = from + page.len() < items.len();
    Json(json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": has_more,
    }))
    .into_response()
}

/// `POST /v1/responses/input_tokens`: the tokens a request's input would take, without
/// generating.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CountRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Option<Input>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    text: Option<Value>,
    #[serde(default)]
    truncation: Option<String>,
    #[serde(default)]
    conversation: Option<Value>,
    /// A hosted model's tone preset: not served.
    #[serde(default)]
    personality: Option<Value>,
}

pub(super) async fn input_tokens(
    State(d): State<Arc<Dispatcher>>,
    Extension(rs): Extension<Arc<Responses>>,
    RequestBody(body): RequestBody,
) -> Response {
    let counted = async {
        let c: CountRequest = parse(&body)?;
        if c.personality.as_ref().is_some_and(|p| !p.is_null()) {
            return Err(bad(
                "personality is not served by this server",
                "personality",
            ));
        }
        let mut r = CreateRequest {
            model: c.model,
            input: c.input,
            instructions: c.instructions,
            tools: c.tools,
            tool_choice: c.tool_choice,
            parallel_tool_calls: c.parallel_tool_calls,
            reasoning: c.reasoning,
            truncation: c.truncation,
            conversation: c.conversation,
            previous_response_id: c.previous_response_id,
            ..CreateRequest::empty()
        };
        r.check()?;
        if let Some(m) = &r.model {
            d.check_model(m)?;
        }
        let mut conversation =
            previous_conversation(&rs, r.previous_response_id.as_deref()).await?;
        conversation.extend(input_items(r.input.take())?);
        let chat = chat_body(&r, &conversation, d.model.reasoning)?;
        d.tokenize_with(super::translated_prompt(&d, chat)?, None, true)
            .await
    };
    match counted.await {
        Ok(ids) => Json(json!({"object": "response.input_tokens", "input_tokens": ids.len()}))
            .into_response(),
        Err(e) => e.into_response(),
    }
}

impl CreateRequest {
    /// A request with nothing set (what `input_tokens` fills in).
    fn empty() -> Self {
        serde_json::from_value(json!({})).expect("every field is optional")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(v: Value) -> Result<CreateRequest, ApiError> {
        parse(v.to_string().as_bytes())
    }

    /// Items become the chat messages they mean: instructions first, a message's text parts
    /// joined, an assistant's text and the calls after it one message, each output a tool
    /// message answering its call, reasoning left out.
    #[test]
    fn items_become_their_chat_messages() {
        let mut r = request(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use metric units."},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Paris and Rome?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "Checking.", "annotations": []}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        }))
        .unwrap();
        r.check().unwrap();
        let items = input_items(r.input.take()).unwrap();
        assert!(items
            .iter()
            .all(|i| i["id"].is_string() && i["type"].is_string()));
        let body = chat_body(&r, &items, false).unwrap();
        assert_eq!(
            body["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": "Use metric units."},
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
            ])
        );
        assert_eq!(
            body["tools"],
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
        );
        assert_eq!(
            body["tool_choice"],
            json!({"type": "function", "function": {"name": "get_weather"}})
        );
        assert_eq!(body["max_completion_tokens"], json!(9));
        assert_eq!(
            body["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}})
        );
        // The translated request is one the chat path takes.
        let _: super::super::request::ChatRequest = serde_json::from_value(body).unwrap();
        // A string input is one user message.
        let items = input_items(Some(Input::Text("hi".into()))).unwrap();
        assert_eq!(
            chat_messages_of(None, &items).unwrap(),
            vec![json!({"role": "user", "content": "hi"})]
        );
    }

    /// What is malformed or not served is a 400 naming it.
    #[test]
    fn what_is_malformed_or_not_served_is_refused_naming_it() {
        let base = json!({"model": "m", "input": "hi"});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            b
        };
        let refused = |v: Value| -> String {
            let mut r = match request(v.clone()) {
                Err(e) => return e.to_string(),
                Ok(r) => r,
            };
            if let Err(e) = r.check() {
                return e.to_string();
            }
            let items = match input_items(r.input.take()) {
                Err(e) => return e.to_string(),
                Ok(i) => i,
            };
            match chat_body(&r, &items, false) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("accepted {v}"),
            }
        };
        assert!(refused(with("temprature", json!(1))).contains("unknown field `temprature`"));
        assert!(refused(with("conversation", json!("conv_1"))).contains("conversation"));
        assert!(refused(with("prompt", json!({"id": "p"}))).contains("prompt"));
        assert!(refused(with("truncation", json!("auto"))).contains("truncation"));
        assert!(refused(with("reasoning", json!({"effort": "high"}))).contains("reasoning.effort"));
        assert!(refused(with("include", json!(["file_search_call.results"]))).contains("include"));
        assert!(refused(with(
            "stream_options",
            json!({"include_obfuscation": false})
        ))
        .contains("stream_options"));
        assert!(refused(
            with("background", json!(true))
                .as_object()
                .map(|o| {
                    let mut o = o.clone();
                    o.insert("store".into(), json!(false));
                    Value::Object(o)
                })
                .unwrap()
        )
        .contains("store"));
        let web = json!([{"type": "web_search"}]);
        assert!(refused(with("tools", web)).contains("tools[0]"));
        let image =
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]);
        assert!(refused(with("input", image)).contains("input[0].content[0]"));
        let refitem = json!([{"type": "item_reference", "id": "msg_1"}]);
        assert!(refused(with("input", refitem)).contains("item references"));
        let call =
            json!([{"role": "user", "content": "x"}, {"type": "function_call", "name": "f"}]);
        assert!(refused(with("input", call)).contains("input[1]"));
        let output = json!([{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c"}]);
        assert!(refused(with("input", output)).contains("needs its output"));
        let only_system = json!([{"role": "system", "content": "x"}]);
        assert!(refused(with("input", only_system)).contains("at least one user message"));
        let role = json!([{"role": "tool", "content": "x"}]);
        assert!(refused(with("input", role)).contains("input[0].role"));
        assert!(
            refused(with("tool_choice", json!({"type": "allowed_tools"}))).contains("tool_choice")
        );
        assert!(refused(with("text", json!({"format": {"type": "xml"}}))).contains("text.format"));
        assert!(refused(with("text", json!({"verbosity": "low"}))).contains("verbosity"));
        let many: Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert!(refused(with("metadata", Value::Object(many))).contains("metadata"));
        assert!(refused(json!({"model": "m"})).contains("input: field required"));
        // What is taken: null settings, reasoning off, the served includes, caller tags.
        let mut ok = with("reasoning", json!({"effort": "none", "summary": null}));
        ok["include"] = json!([
            "message.output_text.logprobs",
            "reasoning.encrypted_content"
        ]);
        ok["conversation"] = Value::Null;
        ok["metadata"] = json!({"team": "a"});
        ok["prompt_cache_key"] = json!("k");
        ok["prompt_cache_retention"] = json!("24h");
        ok["service_tier"] = json!("auto");
        ok["safety_identifier"] = json!("u1");
        ok["truncation"] = json!("disabled");
        ok["text"] = json!({"format": {"type": "text"}, "verbosity": "medium"});
        let mut r = request(ok).unwrap();
        r.check().unwrap();
        assert!(r.logprobs());
        let items = input_items(r.input.take()).unwrap();
        let body = chat_body(&r, &items, false).unwrap();
        assert_eq!(body["logprobs"], json!(true));
        assert!(body.get("response_format").is_none());
    }

    /// The builder turns a generation's chunks into output items and the typed events, in the
    /// order the official client expects; a forced call becomes a function_call item.
    #[test]
    fn the_builder_writes_items_and_events_in_order() {
        let r = request(json!({"model": "m", "input": "hi"})).unwrap();
        let base = skeleton(&r, "resp_1", "m", 1, true);
        let mut b = Builder::new(None, base.clone(), None, None, true);
        b.start();
        let chunk = |t: &str| Chunk {
            text: t.into(),
            ..Default::default()
        };
        b.absorb(chunk("Hello"));
        b.absorb(chunk(" world"));
        let mut last = chunk("!");
        last.finish = Some((
            FinishKind::Length,
            Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                cached_prompt_tokens: 2,
            },
        ));
        b.absorb(last);
        let kinds: Vec<String> = b
            .events
            .iter()
            .map(|e| e["type"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        let r = &b.response;
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["output"][0]["content"][0]["text"], "Hello world!");
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 2);
        assert_eq!(r["usage"]["total_tokens"], 8);
        assert_eq!(b.events[7]["text"], "Hello world!");

        // A Hermes call: no message item (only whitespace around it), one function_call.
        let mut b = Builder::new(
            None,
            base,
            Some(tandem_model::ToolCallStyle::Hermes),
            None,
            true,
        );
        b.absorb(chunk(
            "\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}",
        ));
        let mut last = chunk("\n</tool_call>\n");
        last.finish = Some((FinishKind::Stop, Usage::default()));
        b.absorb(last);
        let kinds: Vec<&str> = b
            .events
            .iter()
            .map(|e| e["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let out = &b.response["output"];
        assert_eq!(out.as_array().unwrap().len(), 1);
        // With tools, the message's text is trimmed as chat trims it, and its deltas add up
        // to it.
        let mut t = Builder::new(
            None,
            skeleton(
                &request(json!({"model": "m", "input": "hi"})).unwrap(),
                "r",
                "m",
                1,
                true,
            ),
            Some(tandem_model::ToolCallStyle::Hermes),
            None,
            true,
        );
        t.absorb(chunk("  Hello  "));
        let mut last = chunk(" world \n");
        last.finish = Some((FinishKind::Stop, Usage::default()));
        t.absorb(last);
        let text = t.response["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap();
        assert_eq!(text, "Hello   world");
        let deltas: String = t
            .events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, text);
        assert_eq!(out[0]["type"], "function_call");
        assert_eq!(out[0]["name"], "f");
        assert_eq!(out[0]["arguments"], "{\"x\":1}");
        assert!(out[0]["call_id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(b.response["status"], "completed");
    }
}
