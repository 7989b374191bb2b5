//! Answers: one JSON body, or server-sent events as the tokens come; usage and log-probabilities
//! in OpenAI's shapes for both endpoints.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde_json::{json, Value};

use crate::dispatch::{Chunk, Dispatcher, FinishKind, Generation, TokenOut, Usage};
use crate::error::ApiError;

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
    /// The prompt text, for `echo`.
    pub(super) echo: Option<String>,
}

pub(super) async fn respond(
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
