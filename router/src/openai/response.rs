//! Answers: one JSON body, or server-sent events as the tokens come; usage and log-probabilities
//! in OpenAI's shapes for both endpoints.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt};
use serde_json::{json, Value};

use super::reasoning::{split_reasoning, ThinkSplitter};
use super::tools::{split_calls, CallParser};
use crate::dispatch::{Chunk, Dispatcher, FinishKind, Generation, TokenOut, Usage};
use crate::error::ApiError;

/// Per-token log-probability entries, with each token's text.
pub(super) struct TokenTexts<'a> {
    pub(super) d: &'a Dispatcher,
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

    pub(super) fn chat_entry(&self, t: &TokenOut) -> Value {
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
pub(super) enum Api {
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
pub(super) struct Shape {
    pub(super) api: Api,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    pub(super) logprobs: bool,
    pub(super) include_usage: bool,
    /// Per prompt: its text, for `echo`.
    pub(super) echoes: Vec<Option<String>>,
    /// Samples per prompt (`n`): choice `p * n + i` is prompt `p`'s sample `i`.
    pub(super) n: usize,
    /// The request has tools: the model's calls (written in this style) become `tool_calls`,
    /// not text.
    pub(super) tool_calls: Option<tandem_model::ToolCallStyle>,
    /// The model thinks: its reasoning is split out of the answer (`Some(true)`: the prompt
    /// opened the thought).
    pub(super) reasoning: Option<bool>,
}

/// Usage of a batch: the sum of its choices' output, each prompt counted once (its first
/// sample's choice carries it).
fn add_usage(total: &mut Usage, u: &Usage, first_sample: bool) {
    total.completion_tokens += u.completion_tokens;
    if first_sample {
        total.prompt_tokens += u.prompt_tokens;
        total.cached_prompt_tokens += u.cached_prompt_tokens;
    }
}

/// One choice generated to its end: its text (after any echo), the echo's length, its tokens,
/// how it finished, its usage.
struct Done {
    text: String,
    prompt_len: usize,
    tokens: Vec<TokenOut>,
    finish: FinishKind,
    usage: Usage,
}

/// Every sample of one prompt generated to its end, in sample order.
async fn collect(mut g: Generation, echo: Option<String>) -> Result<Vec<Done>, ApiError> {
    let start = echo.unwrap_or_default();
    type Part = (String, Vec<TokenOut>, Option<(FinishKind, Usage)>);
    let mut parts: Vec<Part> = (0..g.samples())
        .map(|_| (start.clone(), Vec::new(), None))
        .collect();
    while let Some(c) = g.next().await {
        let (i, c) = c?;
        let part = &mut parts[i as usize];
        part.0.push_str(&c.text);
        part.1.extend(c.tokens);
        if c.finish.is_some() {
            part.2 = c.finish;
        }
    }
    parts
        .into_iter()
        .map(|(text, tokens, finish)| {
            let (finish, usage) =
                finish.ok_or_else(|| ApiError::Internal("stream ended without a finish".into()))?;
            Ok(Done {
                text,
                prompt_len: start.len(),
                tokens,
                finish,
                usage,
            })
        })
        .collect()
}

/// Answers with `generations`, one per choice (`index` in order), whole or streamed.
pub(super) async fn respond(
    d: Arc<Dispatcher>,
    generations: Vec<Generation>,
    shape: Shape,
    stream: bool,
) -> Result<Response, ApiError> {
    if stream {
        return Ok(Sse::new(sse_stream(d, generations, shape))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    // Every choice is read at once: each runs on its worker meanwhile.
    let done = futures::future::try_join_all(
        generations
            .into_iter()
            .zip(shape.echoes.iter().cloned())
            .map(|(g, echo)| collect(g, echo)),
    )
    .await?;
    let tt = TokenTexts { d: &d };
    let mut total = Usage::default();
    let mut choices = Vec::with_capacity(done.len() * shape.n);
    for (index, c) in done.into_iter().flatten().enumerate() {
        let Done {
            text,
            prompt_len,
            tokens,
            finish,
            usage,
        } = c;
        add_usage(&mut total, &usage, index.is_multiple_of(shape.n));
        choices.push(match shape.api {
            Api::Completion => json!({
                "index": index,
                "text": text,
                "logprobs": if shape.logprobs { tt.completion_logprobs(&tokens, prompt_len) } else { Value::Null },
                "finish_reason": finish.as_openai(),
            }),
            Api::Chat => {
                let (reasoning, text) = match shape.reasoning {
                    Some(in_thought) => {
                        let (r, a) = split_reasoning(&text, in_thought);
                        (Some(r).filter(|r| !r.is_empty()), a)
                    }
                    None => (None, text),
                };
                let (mut message, reason) = if let Some(style) = shape.tool_calls {
                    let (content, calls) = split_calls(&shape.id, &text, style);
                    let mut m = json!({"role": "assistant", "content": content});
                    let mut reason = finish.as_openai();
                    if !calls.is_empty() {
                        m["tool_calls"] = calls.iter().map(|c| c.json(None)).collect();
                        if finish == FinishKind::Stop {
                            reason = "tool_calls";
                        }
                    }
                    (m, reason)
                } else {
                    (
                        json!({"role": "assistant", "content": text}),
                        finish.as_openai(),
                    )
                };
                if shape.reasoning.is_some() {
                    message["reasoning_content"] = json!(reasoning);
                }
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": if shape.logprobs {
                        json!({"content": tokens.iter().map(|t| tt.chat_entry(t)).collect::<Vec<_>>()})
                    } else { Value::Null },
                    "finish_reason": reason,
                })
            }
        });
    }
    Ok(Json(json!({
        "id": shape.id,
        "object": shape.api.object(false),
        "created": shape.created,
        "model": shape.model,
        "choices": choices,
        "usage": usage_json(&total),
    }))
    .into_response())
}

/// The chunks of every choice as they come, each with its choice's index.
type Merged = futures::stream::SelectAll<
    std::pin::Pin<Box<dyn Stream<Item = Result<(usize, Chunk), ApiError>> + Send>>,
>;

struct SseState {
    d: Arc<Dispatcher>,
    chunks: Merged,
    shape: Shape,
    /// Per choice: bytes of text sent so far (for completion logprobs' text offsets).
    sent: Vec<usize>,
    /// Per choice, when the request has tools: the calls being parsed out of its text.
    parsers: Vec<Option<CallParser>>,
    /// Per choice, when the model thinks: its reasoning being split from its answer.
    splitters: Vec<Option<ThinkSplitter>>,
    /// Choices finished, and their usage so far.
    done: usize,
    usage: Usage,
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

    fn choice(&mut self, index: usize, c: &Chunk, finish: Option<FinishKind>) -> Value {
        let tt = TokenTexts { d: &self.d };
        let reason = finish.map(|f| f.as_openai());
        let v = match self.shape.api {
            Api::Completion => json!({
                "index": index,
                "text": c.text,
                "logprobs": if self.shape.logprobs { tt.completion_logprobs(&c.tokens, self.sent[index]) } else { Value::Null },
                "finish_reason": reason,
            }),
            Api::Chat => {
                let mut reason = reason;
                let (reasoning, answer) = match &mut self.splitters[index] {
                    Some(s) => s.feed(&c.text, finish.is_some()),
                    None => (String::new(), c.text.clone()),
                };
                let mut delta = match &mut self.parsers[index] {
                    Some(p) => {
                        let before = p.calls();
                        let (mut text, mut calls) = p.push(&answer);
                        if finish.is_some() {
                            let (rest, more) = p.finish();
                            text.push_str(&rest);
                            calls.extend(more);
                        }
                        let mut delta = json!({});
                        if !text.is_empty() {
                            delta["content"] = json!(text);
                        }
                        if !calls.is_empty() {
                            delta["tool_calls"] = calls
                                .iter()
                                .enumerate()
                                .map(|(k, call)| call.json(Some(before + k)))
                                .collect();
                        }
                        if p.calls() > 0 && finish == Some(FinishKind::Stop) {
                            reason = Some("tool_calls");
                        }
                        delta
                    }
                    None if answer.is_empty() && (finish.is_some() || !reasoning.is_empty()) => {
                        json!({})
                    }
                    None => json!({"content": answer}),
                };
                if !reasoning.is_empty() {
                    delta["reasoning_content"] = json!(reasoning);
                }
                json!({
                    "index": index,
                    "delta": delta,
                    "logprobs": if self.shape.logprobs {
                        json!({"content": c.tokens.iter().map(|t| tt.chat_entry(t)).collect::<Vec<_>>()})
                    } else { Value::Null },
                    "finish_reason": reason,
                })
            }
        };
        self.sent[index] += c.text.len();
        v
    }

    fn start(&mut self) {
        self.started = true;
        match self.shape.api {
            Api::Chat => {
                for index in 0..self.sent.len() {
                    let ev = self.chunk_json(
                        vec![json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})],
                        None,
                    );
                    self.queue.push_back(ev);
                }
            }
            Api::Completion => {
                for index in 0..self.sent.len() {
                    if let Some(echo) = self.shape.echoes[index / self.shape.n].clone() {
                        let ev = self.chunk_json(
                            vec![json!({"index": index, "text": echo, "logprobs": null, "finish_reason": null})],
                            None,
                        );
                        self.sent[index] += echo.len();
                        self.queue.push_back(ev);
                    }
                }
            }
        }
    }

    fn absorb(&mut self, index: usize, c: Chunk) {
        let finish = c.finish;
        let has_content = !c.text.is_empty() || !c.tokens.is_empty();
        if has_content || finish.is_some() {
            let choice = self.choice(index, &c, finish.map(|f| f.0));
            let ev = self.chunk_json(vec![choice], None);
            self.queue.push_back(ev);
        }
        if let Some((_, usage)) = finish {
            add_usage(&mut self.usage, &usage, index.is_multiple_of(self.shape.n));
            self.done += 1;
            if self.done == self.sent.len() {
                if self.shape.include_usage {
                    let usage = self.usage;
                    let ev = self.chunk_json(vec![], Some(&usage));
                    self.queue.push_back(ev);
                }
                self.queue.push_back(Event::default().data("[DONE]"));
                self.finished = true;
            }
        }
    }
}

fn sse_stream(
    d: Arc<Dispatcher>,
    generations: Vec<Generation>,
    shape: Shape,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let per = shape.n;
    let n = generations.len() * per;
    let chunks: Merged =
        futures::stream::select_all(generations.into_iter().enumerate().map(|(prompt, g)| {
            let s = futures::stream::unfold(g, move |mut g| async move {
                let c = g.next().await?;
                Some((c.map(|(i, c)| (prompt * per + i as usize, c)), g))
            });
            Box::pin(s) as std::pin::Pin<Box<dyn Stream<Item = _> + Send>>
        }));
    let parsers = (0..n)
        .map(|i| shape.tool_calls.map(|s| CallParser::new(&shape.id, i, s)))
        .collect();
    let splitters = (0..n)
        .map(|_| shape.reasoning.map(ThinkSplitter::new))
        .collect();
    let st = SseState {
        d,
        chunks,
        shape,
        sent: vec![0; n],
        parsers,
        splitters,
        done: 0,
        usage: Usage::default(),
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
            match st.chunks.next().await {
                Some(Ok((index, c))) => st.absorb(index, c),
                Some(Err(e)) => {
                    // Headers are gone: the error travels as an event, then the stream ends
                    // (the other choices' generations are dropped with it, which cancels them).
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
