//! Validation and tokenization: an API request becomes token ids and worker parameters, or a 400
//! naming the field.

use std::sync::atomic::Ordering;

use tandem_proto::worker as pb;
use tandem_types::SamplingParams;

use super::{
    Dispatcher, GenParams, MaxTokensDefault, Prepared, PromptInput, RouterRequestId, ServedModel,
};
use crate::error::ApiError;

/// Most stop strings one request may give (each is matched against every piece of text).
pub const MAX_STOP_STRINGS: usize = 16;

/// Bytes per token assumed for a tokenizer whose vocabulary cannot be read as bytes.
pub(super) const FALLBACK_TOKEN_BYTES: usize = 256;

/// Refuses (400, naming `param`) a text of more bytes than `limit`: the context's tokens times
/// the longest token's bytes, so no tokenization of it could fit.
fn check_bytes(text: &str, limit: usize, param: &'static str) -> Result<(), ApiError> {
    if text.len() > limit {
        return Err(ApiError::invalid(
            format!(
                "the prompt has {} bytes, more than the model's context could hold in any \
                 tokens ({limit} bytes at most): shorten it",
                text.len()
            ),
            param,
        ));
    }
    Ok(())
}

/// [`Dispatcher::tokenize_with`]'s work, on a blocking thread: the text (or the chat rendered
/// through the template) is measured against `limit` bytes before it is tokenized.
fn tokenize_in(
    model: &ServedModel,
    limit: usize,
    input: PromptInput,
    add_special_tokens: Option<bool>,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let m = &model.text;
    let internal = |e: tandem_model::ModelError| ApiError::Internal(e.to_string());
    let (text, special, param) = match input {
        PromptInput::Text(t) => (t, add_special_tokens.unwrap_or(true), "prompt"),
        PromptInput::Chat(msgs) => {
            return tokenize_in(
                model,
                limit,
                PromptInput::ChatWith(msgs, Vec::new(), Default::default()),
                add_special_tokens,
                add_generation_prompt,
            )
        }
        PromptInput::ChatWith(msgs, tools, kwargs) => {
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
                .render_with(
                    &msgs,
                    add_generation_prompt,
                    (!tools.is_empty()).then_some(&tools[..]),
                    &kwargs,
                )
                .map_err(|e| ApiError::invalid(e.to_string(), "messages"))?;
            (text, add_special_tokens.unwrap_or(false), "messages")
        }
        PromptInput::Ids(ids) => return Ok(ids),
    };
    check_bytes(&text, limit, param)?;
    m.tokenizer.encode(&text, special).map_err(internal)
}

impl Dispatcher {
    /// Refuses a model name this router does not serve (empty means the served one).
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        self.resolve_model(model).map(drop)
    }

    /// The LoRA adapter `model` names (None for the base model, or empty), as the workers
    /// report serving it; a name neither the base's nor any adapter's is not found.
    pub fn resolve_model(&self, model: &str) -> Result<Option<pb::LoraRef>, ApiError> {
        if model.is_empty() || model == self.model.name {
            return Ok(None);
        }
        match self.loras().remove(model) {
            Some(i) => Ok(Some(pb::LoraRef {
                name: i.name,
                content_hash: i.content_hash,
            })),
            None => Err(ApiError::ModelNotFound(model.to_string())),
        }
    }

    /// Has every worker up (decode and prefill) read the adapter at `path` and serve it as
    /// `name`: vLLM's `/v1/load_lora_adapter`. The path is each worker's (a volume they all
    /// mount). A bad adapter is refused with the workers' reason, and kept nowhere.
    pub async fn load_lora(&self, name: &str, path: &str) -> Result<pb::LoraInfo, ApiError> {
        if name.is_empty() || name == self.model.name {
            return Err(ApiError::invalid(
                format!("lora_name {name:?}: an adapter needs a name of its own"),
                "lora_name",
            ));
        }
        let workers = self.workers_up();
        if workers.is_empty() {
            return Err(ApiError::NoWorker);
        }
        let req = pb::LoadLoraRequest {
            name: name.to_string(),
            path: path.to_string(),
        };
        let calls = workers.iter().map(|w| w.client().load_lora(req.clone()));
        let mut loaded = None;
        let mut failed = Vec::new();
        for (w, r) in workers.iter().zip(futures::future::join_all(calls).await) {
            match r {
                Ok(info) => {
                    w.note_lora(info.clone());
                    loaded.get_or_insert(info);
                }
                Err(e) => failed.push((w.addr.clone(), e)),
            }
        }
        if let Some((addr, e)) = failed.first() {
            let refused =
                |c| matches!(c, tonic::Code::InvalidArgument | tonic::Code::AlreadyExists);
            if refused(e.code()) {
                // What is wrong is the adapter (or its name): the client's to fix.
                for w in workers
                    .iter()
                    .filter(|w| !failed.iter().any(|(a, _)| *a == w.addr))
                {
                    let _ = w.client().unload_lora(name).await;
                    w.forget_lora(name);
                }
                return Err(ApiError::invalid(e.message().to_string(), "lora_path"));
            }
            tracing::warn!(adapter = name, worker = %addr, error = %e.message(), "a worker did not load the LoRA adapter");
        }
        loaded.ok_or_else(|| {
            let (worker, e) = failed.swap_remove(0);
            ApiError::Upstream {
                worker,
                message: e.message().to_string(),
                kind: tandem_types::ErrorKind::Unavailable,
            }
        })
    }

    /// Has every worker up stop serving adapter `name` (vLLM's `/v1/unload_lora_adapter`):
    /// requests running with it finish; new ones are refused. Not found when none served it.
    pub async fn unload_lora(&self, name: &str) -> Result<(), ApiError> {
        let workers = self.workers_up();
        let calls = workers.iter().map(|w| w.client().unload_lora(name));
        let mut found = false;
        for (w, r) in workers.iter().zip(futures::future::join_all(calls).await) {
            match r {
                Ok(()) => found = true,
                Err(e) if e.code() == tonic::Code::NotFound => {}
                Err(e) => {
                    tracing::warn!(adapter = name, worker = %w.addr, error = %e.message(), "a worker did not unload the LoRA adapter")
                }
            }
            w.forget_lora(name);
        }
        match found {
            true => Ok(()),
            false => Err(ApiError::NotFound {
                message: format!("LoRA adapter {name:?} is not loaded"),
                param: Some("lora_name"),
                code: "not_found",
            }),
        }
    }

    /// Every worker up, decode then prefill.
    fn workers_up(&self) -> Vec<std::sync::Arc<crate::workers::Worker>> {
        let prefill = self.prefill_pool.iter().flat_map(|p| p.up());
        self.pool.up().into_iter().chain(prefill).collect()
    }

    /// Every LoRA adapter a worker of this router's pools serves, by name.
    pub fn loras(&self) -> std::collections::BTreeMap<String, pb::LoraInfo> {
        let pools = std::iter::once(&*self.pool).chain(self.prefill_pool.as_deref());
        crate::workers::served_loras(pools)
    }

    /// The prompt's token ids: text with BOS added, chat rendered through the model's template,
    /// ids checked against the vocabulary. Refuses (400) an empty or unrenderable chat, an id
    /// outside the vocabulary and a text too long for the context to hold whatever its tokens.
    pub async fn tokenize(&self, input: PromptInput) -> Result<Vec<u32>, ApiError> {
        self.tokenize_with(input, None, true).await
    }

    /// [`Dispatcher::tokenize`] with vLLM's `/tokenize` options: `add_special_tokens` (default:
    /// true for text, false for chat, whose template writes its own) and, for chat,
    /// `add_generation_prompt` (end with the assistant's turn opened, as a generation does).
    ///
    /// Rendering and tokenizing run on the blocking pool, one prompt per core at a time
    /// (others wait their turn), and a text is measured before it is tokenized: one with more
    /// bytes than the context's tokens can stand for is refused unread.
    pub async fn tokenize_with(
        &self,
        input: PromptInput,
        add_special_tokens: Option<bool>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ApiError> {
        if let PromptInput::Ids(ids) = input {
            self.check_vocabulary(&ids, "prompt")?;
            return Ok(ids);
        }
        let _turn = self
            .tokenizing
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Internal("the tokenizer pool is closed".into()))?;
        let model = self.model.clone();
        let limit = self
            .model
            .max_context()
            .saturating_mul(self.max_token_bytes);
        tokio::task::spawn_blocking(move || {
            tokenize_in(
                &model,
                limit,
                input,
                add_special_tokens,
                add_generation_prompt,
            )
        })
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizing the prompt: {e}")))?
    }

    /// Refuses (400, naming `param`) an id outside the model's vocabulary.
    pub fn check_vocabulary(&self, ids: &[u32], param: &'static str) -> Result<(), ApiError> {
        let vocab = self.model.text.config.vocab_size;
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(bad) => Err(ApiError::invalid(
                format!("token id {bad} is outside the vocabulary of {vocab}"),
                param,
            )),
            None => Ok(()),
        }
    }

    /// Validates and tokenizes; every refusal here is the client's to fix (400).
    pub async fn prepare(
        &self,
        model: &str,
        input: PromptInput,
        params: GenParams,
        default_max: MaxTokensDefault,
    ) -> Result<Prepared, ApiError> {
        let lora = self.resolve_model(model)?;
        let p = &params;
        // OpenAI's defaults where the body leaves a field out; the one check every layer shares.
        let mut sampling = SamplingParams {
            temperature: p.temperature.unwrap_or(1.0),
            top_k: SamplingParams::api_top_k(p.top_k.unwrap_or(0))?,
            top_p: p.top_p.unwrap_or(1.0),
            min_p: p.min_p.unwrap_or(0.0),
            repetition_penalty: p.repetition_penalty.unwrap_or(1.0),
            presence_penalty: p.presence_penalty.unwrap_or(0.0),
            frequency_penalty: p.frequency_penalty.unwrap_or(0.0),
            seed: p.seed,
            top_logprobs: p.top_logprobs,
            // Checked again below, once the prompt's length settles the default.
            max_tokens: p.max_tokens.map_or(1, |n| n.min(u32::MAX as u64) as u32),
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            logit_bias: p.logit_bias.clone(),
            grammar: p.grammar.as_ref().map(|g| g.grammar.clone()),
        };
        // The fields first: a bad one is refused before the prompt is tokenized.
        sampling.check()?;
        if p.stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                format!(
                    "at most {MAX_STOP_STRINGS} stop strings, got {}",
                    p.stop.len()
                ),
                "stop",
            ));
        }
        let biased: Vec<u32> = sampling.logit_bias.iter().map(|&(t, _)| t).collect();
        self.check_vocabulary(&biased, "logit_bias")?;
        if let Some(g) = &p.grammar {
            // Compiled here only to be refused here: each worker compiles its own. The compile
            // runs on the grammar compiler's own threads; this blocking-pool thread only waits
            // for it, as a thread serving streams must not (a large schema takes milliseconds,
            // the vocabulary's index on first use a few hundred).
            let (grammars, grammar) = (self.grammars.clone(), g.grammar.clone());
            tokio::task::spawn_blocking(move || grammars.compile(&grammar).map(drop))
                .await
                .map_err(|e| ApiError::Internal(format!("checking the grammar: {e}")))?
                .map_err(|e| match e {
                    tandem_grammar::GrammarError::Invalid(m) => {
                        ApiError::invalid(format!("{}: {m}", g.param), g.param)
                    }
                    tandem_grammar::GrammarError::Busy(m) => ApiError::Busy(m),
                    tandem_grammar::GrammarError::Internal(m) => ApiError::Internal(m),
                    other => ApiError::invalid(other.to_string(), g.param),
                })?;
        }
        let prompt = self.tokenize(input).await?;
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty", "prompt"));
        }
        let context = self.model.max_context();
        let max_tokens = match (p.max_tokens, default_max) {
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
        let request_id = RouterRequestId(format!(
            "{}-{}",
            self.id_prefix,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        ));
        sampling.max_tokens = max_tokens as u32;
        let sampling = sampling.validate()?;
        Ok(Prepared {
            request_id,
            prompt,
            params,
            sampling,
            trace: tracing::Span::none(),
            caller: Default::default(),
            lora,
        })
    }
}
