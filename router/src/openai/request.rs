//! The request bodies of both endpoints as OpenAI (and vLLM) define them, and the checks that
//! need nothing but the body.

use serde::de::DeserializeOwned;
use serde::Deserialize;
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
