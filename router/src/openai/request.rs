//! The request bodies of both endpoints as OpenAI (and vLLM) define them, and the checks that
//! need nothing but the body.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use tandem_model::ChatMessage;

use crate::dispatch::{GenParams, RequestedGrammar};
use crate::error::ApiError;
use tandem_types::Grammar;

pub(super) fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::InvalidRequest {
        message: format!("request body is not valid JSON for this endpoint: {e}"),
        param: None,
    })
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// Most samples one request may ask for (OpenAI's limit on `n`).
pub(super) const MAX_N: u32 = 128;

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The sampling fields both endpoints share.
#[derive(Deserialize, Default)]
#[serde(default)]
pub(super) struct Sampling {
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
    pub(super) stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    response_format: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_grammar: Option<String>,
}

impl Sampling {
    /// Samples per prompt (OpenAI's `n`), checked: 1 to [`MAX_N`].
    pub(super) fn n(&self) -> Result<u32, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_N => Ok(n),
            n => Err(ApiError::invalid(
                format!("n must be between 1 and {MAX_N}, not {n}"),
                "n",
            )),
        }
    }

    pub(super) fn params(&self, max_tokens: Option<u64>) -> Result<GenParams, ApiError> {
        if self.stream_options.is_some() && self.stream != Some(true) {
            return Err(ApiError::invalid(
                "stream_options is only allowed when stream is true",
                "stream_options",
            ));
        }
        Ok(GenParams {
            n: self.n()?,
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
            logit_bias: self.logit_bias()?,
            grammar: self.grammar()?,
        })
    }

    /// OpenAI's `logit_bias`: token ids (as JSON object keys) to numbers.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(k, v)| {
                let token = k.trim().parse::<u32>().map_err(|_| {
                    ApiError::invalid(
                        format!("logit_bias keys are token ids, got {k:?}"),
                        "logit_bias",
                    )
                })?;
                let bias = v.as_f64().ok_or_else(|| {
                    ApiError::invalid(
                        format!("logit_bias values are numbers, got {v} for token {token}"),
                        "logit_bias",
                    )
                })?;
                Ok((token, bias as f32))
            })
            .collect()
    }

    /// What the output must match: OpenAI's `response_format`, or one of vLLM's `guided_*`
    /// fields; two at once are refused (which should win is the client's to say).
    fn grammar(&self) -> Result<Option<RequestedGrammar>, ApiError> {
        let mut found: Vec<RequestedGrammar> = Vec::new();
        if let Some(f) = &self.response_format {
            if let Some(g) = response_format(f)? {
                found.push(RequestedGrammar {
                    grammar: g,
                    param: "response_format",
                });
            }
        }
        if let Some(j) = &self.guided_json {
            let schema = match j {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            found.push(RequestedGrammar {
                grammar: Grammar::JsonSchema(schema),
                param: "guided_json",
            });
        }
        if let Some(r) = &self.guided_regex {
            found.push(RequestedGrammar {
                grammar: Grammar::Regex(r.clone()),
                param: "guided_regex",
            });
        }
        if let Some(c) = &self.guided_choice {
            found.push(RequestedGrammar {
                grammar: Grammar::Choice(c.clone()),
                param: "guided_choice",
            });
        }
        if let Some(l) = &self.guided_grammar {
            found.push(RequestedGrammar {
                grammar: Grammar::Lark(l.clone()),
                param: "guided_grammar",
            });
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|g| g.param).collect();
            return Err(ApiError::invalid(
                format!("give one output format, not several ({})", names.join(", ")),
                found[1].param,
            ));
        }
        Ok(found.pop())
    }

    pub(super) fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// Fields of OpenAI's (and vLLM's) API that this router does not serve yet. They are refused
/// with a reason rather than ignored: ignoring one would answer something other than what the
/// client asked for (an unbiased sample, free text instead of JSON, no tool call).
#[derive(Deserialize, Default)]
#[serde(default)]
pub(super) struct NotServed {
    best_of: Option<u32>,
    functions: Option<Vec<Value>>,
    function_call: Option<Value>,
    suffix: Option<String>,
    /// Every field the endpoint does not know: refused unless [`TAKEN`] (or a neutral value).
    #[serde(flatten)]
    other: std::collections::BTreeMap<String, Value>,
}

/// OpenAI fields that change nothing the server does, taken as sent: who the caller is
/// (`user`, `safety_identifier`), tags (`metadata`), the billing tier (`service_tier`), a prompt
/// cache routing hint (`prompt_cache_key`: the prefix cache needs none).
const TAKEN: &[&str] = &[
    "user",
    "safety_identifier",
    "metadata",
    "service_tier",
    "prompt_cache_key",
];

impl NotServed {
    /// Refuses the first field that asks for what is not served (its neutral values pass:
    /// `best_of` equal to `n`, no functions, `function_call: "none"`, an empty suffix).
    pub(super) fn check(&self, n: u32) -> Result<(), ApiError> {
        let refuse = |what: &str, param: &'static str| {
            Err(ApiError::invalid(
                format!("{what} is not supported by this server yet"),
                param,
            ))
        };
        match self.best_of {
            Some(b) if b < n => {
                return Err(ApiError::invalid(
                    format!("best_of ({b}) must be at least n ({n})"),
                    "best_of",
                ))
            }
            Some(b) if b > n => {
                return refuse(
                    "best_of greater than n (drawing more samples to return the likeliest)",
                    "best_of",
                )
            }
            _ => {}
        }
        if self.functions.as_ref().is_some_and(|f| !f.is_empty()) {
            return refuse("the legacy functions field (send tools)", "functions");
        }
        if self.function_call.as_ref().is_some_and(|c| c != "none") {
            return refuse(
                "the legacy function_call field (send tool_choice)",
                "function_call",
            );
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return refuse("suffix (insertion)", "suffix");
        }
        // Anything else is either taken (it changes nothing here), neutral, or refused naming
        // it, never ignored: ignoring it would answer something else than was asked.
        for (k, v) in &self.other {
            let neutral = match k.as_str() {
                k if TAKEN.contains(&k) => true,
                // Nothing is stored here to retrieve later.
                "store" => v.is_null() || *v == Value::Bool(false),
                "modalities" => v.is_null() || *v == serde_json::json!(["text"]),
                _ => false,
            };
            if !neutral {
                return Err(ApiError::InvalidRequest {
                    message: format!(
                        "unrecognized request argument supplied: {k} (this server does not serve it)"
                    ),
                    param: None,
                });
            }
        }
        Ok(())
    }
}

/// OpenAI's `response_format`: `text` (free), `json_object`, or `json_schema` with its
/// `json_schema.schema` (`strict` or not, the schema is enforced).
fn response_format(f: &Value) -> Result<Option<Grammar>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, "response_format");
    let kind = f
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("response_format needs a \"type\"".into()))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Grammar::JsonObject)),
        "json_schema" => {
            let schema = f
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(
                    || bad("response_format json_schema needs json_schema.schema".into()),
                )?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(bad("json_schema.schema must be a JSON Schema object".into()));
            }
            Ok(Some(Grammar::JsonSchema(schema.to_string())))
        }
        other => Err(bad(format!(
            "response_format type {other:?} is not one of text, json_object, json_schema"
        ))),
    }
}

/// vLLM's `POST /tokenize`: a prompt, or chat messages through the model's template.
#[derive(Deserialize)]
pub(super) struct TokenizeRequest {
    #[serde(default)]
    pub(super) model: String,
    #[serde(default)]
    pub(super) prompt: Option<String>,
    #[serde(default)]
    pub(super) messages: Option<Vec<Message>>,
    /// Tools the model may call, with messages: rendered as a chat request renders them.
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
    /// The tokenizer's BOS and the like (default: true for a prompt, false for messages).
    #[serde(default)]
    pub(super) add_special_tokens: Option<bool>,
    /// For messages: end with the assistant's turn opened (default true).
    #[serde(default)]
    pub(super) add_generation_prompt: Option<bool>,
    /// For messages: more variables for the chat template, as in a chat request.
    #[serde(default)]
    pub(super) chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// vLLM's `POST /detokenize`.
#[derive(Deserialize)]
pub(super) struct DetokenizeRequest {
    #[serde(default)]
    pub(super) model: String,
    pub(super) tokens: Vec<u32>,
}

#[derive(Deserialize)]
pub(super) struct CompletionRequest {
    #[serde(default)]
    pub(super) model: String,
    pub(super) prompt: PromptField,
    #[serde(default)]
    pub(super) max_tokens: Option<u64>,
    /// Number of alternatives to report per token (OpenAI: an integer, not a bool).
    #[serde(default)]
    pub(super) logprobs: Option<u32>,
    #[serde(default)]
    pub(super) echo: Option<bool>,
    #[serde(flatten)]
    pub(super) sampling: Sampling,
    #[serde(flatten)]
    pub(super) not_served: NotServed,
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

/// A chat message. Every field OpenAI defines is served or refused naming it; an unknown one
/// is refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    /// The speaker's name: passed to the template (most ignore it).
    #[serde(default)]
    name: Option<String>,
    /// An assistant's refusal (its text, where it has no content).
    #[serde(default)]
    refusal: Option<String>,
    /// An earlier answer's reasoning, as this API returned it: passed to the template.
    #[serde(default, alias = "reasoning")]
    reasoning_content: Option<String>,
    /// An earlier answer's citations, as a client sends the answer back: nothing to do.
    #[serde(default)]
    #[allow(dead_code)]
    annotations: Option<Value>,
    /// An earlier answer's audio: not served (text only).
    #[serde(default)]
    audio: Option<Value>,
    /// The legacy function call: refused (send tool_calls).
    #[serde(default)]
    function_call: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<Value>>,
    #[serde(default)]
    tool_call_id: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct ChatRequest {
    #[serde(default)]
    pub(super) model: String,
    pub(super) messages: Vec<Message>,
    #[serde(default)]
    pub(super) max_tokens: Option<u64>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub(super) logprobs: Option<bool>,
    #[serde(default)]
    pub(super) top_logprobs: Option<u32>,
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) tool_choice: Option<Value>,
    #[serde(default)]
    pub(super) parallel_tool_calls: Option<bool>,
    /// More variables for the chat template (vLLM's): `enable_thinking` for Qwen3's, say.
    #[serde(default)]
    pub(super) chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// OpenAI's reasoning effort: `none` (or `minimal`) turns a thinking model's thinking off,
    /// `low`, `medium` and `high` on; a model that does not reason takes only `none`.
    #[serde(default)]
    pub(super) reasoning_effort: Option<String>,
    #[serde(flatten)]
    pub(super) sampling: Sampling,
    #[serde(flatten)]
    pub(super) not_served: NotServed,
}

pub(super) fn chat_messages(msgs: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    msgs.into_iter()
        .enumerate()
        .map(|(i, m)| {
            if m.role == "tool" && m.tool_call_id.as_deref().is_none_or(str::is_empty) {
                return Err(ApiError::invalid(
                    format!("missing required parameter messages[{i}].tool_call_id: a tool message answers a call by its id"),
                    "messages",
                ));
            }
            if m.audio.as_ref().is_some_and(|a| !a.is_null()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].audio: audio is not served: this model reads text"),
                    "messages",
                ));
            }
            if m.function_call.as_ref().is_some_and(|f| !f.is_null()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].function_call: the legacy function_call is not served (send tool_calls)"),
                    "messages",
                ));
            }
            let content = match m.content {
                None => m.refusal.clone().unwrap_or_default(),
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
            let tool_calls = match m.tool_calls {
                Some(c) if !c.is_empty() => Some(super::tools::calls_for_template(&c)?),
                _ => None,
            };
            Ok(ChatMessage {
                role: m.role,
                content,
                tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
                reasoning_content: m.reasoning_content,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn messages(v: Value) -> Result<Vec<ChatMessage>, ApiError> {
        let msgs: Vec<Message> = parse(v.to_string().as_bytes())?;
        chat_messages(msgs)
    }

    /// Every field of a chat message is served or refused naming it: a name and an earlier
    /// answer's reasoning reach the template, a refusal is the assistant's text, citations
    /// are taken, audio and the legacy function call are refused, and so is an unknown field.
    #[test]
    fn every_message_field_is_served_or_refused() {
        let m = messages(json!([
            {"role": "user", "content": "hi", "name": "ada"},
            {"role": "assistant", "content": null, "refusal": "I cannot.", "annotations": []},
            {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
            {"role": "assistant", "content": "5", "reasoning": "2+3"},
        ]))
        .unwrap();
        assert_eq!(m[0].name.as_deref(), Some("ada"));
        assert_eq!(m[1].content, "I cannot.");
        assert_eq!(m[2].reasoning_content.as_deref(), Some("2+2"));
        assert_eq!(m[3].reasoning_content.as_deref(), Some("2+3"));
        let refused = |v: Value| messages(v).unwrap_err().to_string();
        assert!(refused(json!([{"role": "assistant", "audio": {"id": "a1"}}])).contains("audio"));
        let legacy =
            json!([{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]);
        assert!(refused(legacy).contains("function_call"));
        let unknown = json!([{"role": "user", "content": "x", "colour": "red"}]);
        assert!(refused(unknown).contains("unknown field `colour`"));
    }
}
