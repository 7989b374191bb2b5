//! Validation and tokenization: an API request becomes token ids and worker parameters, or a 400
//! naming the field.

use std::sync::atomic::Ordering;

use tandem_proto::worker as pb;

use super::{Dispatcher, GenParams, MaxTokensDefault, Prepared, PromptInput};
use crate::error::ApiError;

fn check_range(ok: bool, message: String, param: &'static str) -> Result<(), ApiError> {
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(message, param))
    }
}

impl Dispatcher {
    /// Refuses a model name this router does not serve (empty means the served one).
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model.is_empty() || model == self.model.name {
            Ok(())
        } else {
            Err(ApiError::ModelNotFound(model.to_string()))
        }
    }

    pub fn tokenize(&self, input: PromptInput) -> Result<Vec<u32>, ApiError> {
        let m = &self.model.text;
        let internal = |e: tandem_model::ModelError| ApiError::Internal(e.to_string());
        match input {
            PromptInput::Text(t) => m.tokenizer.encode(&t, true).map_err(internal),
            PromptInput::Chat(msgs) => {
                if msgs.is_empty() {
                    return Err(ApiError::invalid("messages must not be empty", "messages"));
                }
                let t = m.chat_template.as_ref().ok_or_else(|| {
                    ApiError::invalid(
                        "this model has no chat template: use /v1/completions",
                        "messages",
                    )
                })?;
                let text = t
                    .render(&msgs, true)
                    .map_err(|e| ApiError::invalid(e.to_string(), "messages"))?;
                m.tokenizer.encode(&text, false).map_err(internal)
            }
            PromptInput::Ids(ids) => {
                let vocab = m.config.vocab_size;
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(ApiError::invalid(
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                        "prompt",
                    ));
                }
                Ok(ids)
            }
        }
    }

    /// Validates and tokenizes; every refusal here is the client's to fix (400).
    pub fn prepare(
        &self,
        model: &str,
        input: PromptInput,
        params: GenParams,
        default_max: MaxTokensDefault,
    ) -> Result<Prepared, ApiError> {
        self.check_model(model)?;
        let p = &params;
        let temperature = p.temperature.unwrap_or(1.0);
        check_range(
            temperature.is_finite() && (0.0..=2.0).contains(&temperature),
            format!("temperature must be in [0, 2], got {temperature}"),
            "temperature",
        )?;
        let top_p = p.top_p.unwrap_or(1.0);
        check_range(
            top_p > 0.0 && top_p <= 1.0,
            format!("top_p must be in (0, 1], got {top_p}"),
            "top_p",
        )?;
        let top_k = p.top_k.unwrap_or(0);
        check_range(
            top_k >= -1,
            format!("top_k must be -1 (off), 0 (off) or positive, got {top_k}"),
            "top_k",
        )?;
        let min_p = p.min_p.unwrap_or(0.0);
        check_range(
            (0.0..=1.0).contains(&min_p),
            format!("min_p must be in [0, 1], got {min_p}"),
            "min_p",
        )?;
        let rep = p.repetition_penalty.unwrap_or(1.0);
        check_range(
            rep.is_finite() && rep > 0.0 && rep <= 2.0,
            format!("repetition_penalty must be in (0, 2], got {rep}"),
            "repetition_penalty",
        )?;
        for (name, v) in [
            ("presence_penalty", p.presence_penalty),
            ("frequency_penalty", p.frequency_penalty),
        ] {
            let v = v.unwrap_or(0.0);
            check_range(
                (-2.0..=2.0).contains(&v),
                format!("{name} must be in [-2, 2], got {v}"),
                name,
            )?;
        }
        check_range(
            p.top_logprobs <= 20,
            format!("top_logprobs must be at most 20, got {}", p.top_logprobs),
            "top_logprobs",
        )?;
        check_range(
            p.stop.len() <= 16,
            format!("at most 16 stop strings, got {}", p.stop.len()),
            "stop",
        )?;
        let prompt = self.tokenize(input)?;
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty", "prompt"));
        }
        let context = self.model.max_context();
        let max_tokens = match (p.max_tokens, default_max) {
            (Some(0), _) => {
                return Err(ApiError::invalid(
                    "max_tokens must be at least 1",
                    "max_tokens",
                ))
            }
            (Some(n), _) => n as usize,
            (None, MaxTokensDefault::Fixed(n)) => n as usize,
            (None, MaxTokensDefault::RestOfContext) => context.saturating_sub(prompt.len()).max(1),
        };
        if prompt.len() + max_tokens > context {
            return Err(ApiError::ContextLength {
                prompt: prompt.len(),
                max_tokens,
                context,
            });
        }
        let request_id = format!(
            "{:x}-{}",
            std::process::id(),
            self.next_id.fetch_add(1, Ordering::Relaxed)
        );
        let sampling = pb::Sampling {
            temperature,
            top_k: top_k.max(0) as u32,
            top_p,
            min_p,
            repetition_penalty: rep,
            presence_penalty: p.presence_penalty.unwrap_or(0.0),
            frequency_penalty: p.frequency_penalty.unwrap_or(0.0),
            seed: p.seed,
            top_logprobs: p.top_logprobs,
        };
        let stopping = pb::Stopping {
            max_tokens: max_tokens as u32,
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
        };
        Ok(Prepared {
            request_id,
            prompt,
            params,
            sampling,
            stopping,
        })
    }
}
