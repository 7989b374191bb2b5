//! The request bodies of both endpoints as OpenAI (and vLLM) define them, and the checks that
//! need nothing but the body.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use tandem_model::ChatMessage;

use crate::dispatch::GenParams;
use crate::error::ApiError;

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
}

impl Sampling {
    pub(super) fn params(&self, max_tokens: Option<u64>) -> Result<GenParams, ApiError> {
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
    logit_bias: Option<serde_json::Map<String, Value>>,
    response_format: Option<Value>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    functions: Option<Vec<Value>>,
    function_call: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<Value>,
    guided_choice: Option<Value>,
    guided_grammar: Option<Value>,
    suffix: Option<String>,
}

impl NotServed {
    /// Refuses the first field that asks for what is not served (its neutral values pass:
    /// `best_of: 1`, an empty `logit_bias`, `response_format: {"type": "text"}`, no tools,
    /// `tool_choice: "none"`, an empty suffix).
    pub(super) fn check(&self) -> Result<(), ApiError> {
        let refuse = |what: &str, param: &'static str| {
            Err(ApiError::invalid(
                format!("{what} is not supported by this server yet"),
                param,
            ))
        };
        if self.best_of.is_some_and(|b| b > 1) {
            return refuse("best_of > 1 (one sample per request)", "best_of");
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("logit_bias", "logit_bias");
        }
        if let Some(f) = &self.response_format {
            let kind = f.get("type").and_then(Value::as_str).unwrap_or("");
            if kind != "text" {
                return refuse(
                    &format!("response_format {kind:?} (structured outputs)"),
                    "response_format",
                );
            }
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty())
            || self.functions.as_ref().is_some_and(|f| !f.is_empty())
        {
            return refuse("tool calling (tools, functions)", "tools");
        }
        let none = |v: &Option<Value>| v.as_ref().is_none_or(|c| c == "none");
        if !none(&self.tool_choice) {
            return refuse("tool_choice other than \"none\"", "tool_choice");
        }
        if !none(&self.function_call) {
            return refuse("function_call", "function_call");
        }
        for (v, param) in [
            (&self.guided_json, "guided_json"),
            (&self.guided_regex, "guided_regex"),
            (&self.guided_choice, "guided_choice"),
            (&self.guided_grammar, "guided_grammar"),
        ] {
            if v.is_some() {
                return refuse(&format!("{param} (guided decoding)"), param);
            }
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return refuse("suffix (insertion)", "suffix");
        }
        Ok(())
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
    /// The tokenizer's BOS and the like (default: true for a prompt, false for messages).
    #[serde(default)]
    pub(super) add_special_tokens: Option<bool>,
    /// For messages: end with the assistant's turn opened (default true).
    #[serde(default)]
    pub(super) add_generation_prompt: Option<bool>,
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

#[derive(Deserialize)]
pub(super) struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
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
    #[serde(flatten)]
    pub(super) sampling: Sampling,
    #[serde(flatten)]
    pub(super) not_served: NotServed,
}

pub(super) fn chat_messages(msgs: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
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
