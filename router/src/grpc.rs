//! The public gRPC API, `tandem.v1.Generation`, on the same dispatch path as HTTP.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tandem_model::ChatMessage;
use tandem_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::dispatch::{
    Dispatcher, FinishKind, GenParams, MaxTokensDefault, PromptInput, RequestedGrammar,
};
use crate::trace;

/// The `tandem.v1.Generation` service (Generate, Tokenize, ListModels) over a dispatcher.
pub struct GenerationService {
    d: Arc<Dispatcher>,
}

impl GenerationService {
    /// The service, sending its requests through `d`.
    pub fn new(d: Arc<Dispatcher>) -> Self {
        Self { d }
    }
}

fn prompt_input(
    text: Option<String>,
    chat: Option<pb::ChatMessages>,
    ids: Option<pb::TokenIds>,
) -> Result<PromptInput, Status> {
    match (text, chat, ids) {
        (Some(t), None, None) => Ok(PromptInput::Text(t)),
        (None, Some(c), None) => Ok(PromptInput::Chat(
            c.messages
                .into_iter()
                .map(|m| ChatMessage {
                    role: m.role,
                    content: m.content,
                    ..Default::default()
                })
                .collect(),
        )),
        (None, None, Some(ids)) => Ok(PromptInput::Ids(ids.ids)),
        _ => Err(Status::invalid_argument(
            "set the prompt: text, chat or token_ids",
        )),
    }
}

fn finish_reason(f: FinishKind) -> pb::FinishReason {
    match f {
        FinishKind::Stop => pb::FinishReason::Stop,
        FinishKind::Length => pb::FinishReason::Length,
        FinishKind::Cancelled => pb::FinishReason::Cancelled,
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    type GenerateStream = GenStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenStream>, Status> {
        let (metadata, extensions, r) = request.into_parts();
        let caller = extensions
            .get::<crate::flow::Caller>()
            .cloned()
            .unwrap_or_default();
        let (text, chat, ids) = match r.prompt {
            Some(pb::generate_request::Prompt::Text(t)) => (Some(t), None, None),
            Some(pb::generate_request::Prompt::Chat(c)) => (None, Some(c), None),
            Some(pb::generate_request::Prompt::TokenIds(t)) => (None, None, Some(t)),
            None => (None, None, None),
        };
        let is_chat = chat.is_some();
        let span = trace::request_span(
            "tandem.v1.Generation/Generate",
            if is_chat { "chat" } else { "text_completion" },
            metadata.as_ref(),
        );
        let d = &self.d;
        let input = prompt_input(text, chat, ids).inspect_err(|e| {
            d.metrics.request("invalid");
            trace::failed(&span, &e.message());
        })?;
        let s = r.sampling.unwrap_or_default();
        let st = r.stopping.unwrap_or_default();
        let params = GenParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k.map(i64::from),
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            seed: s.seed,
            max_tokens: st.max_tokens.map(u64::from),
            stop: st.stop,
            stop_token_ids: st.stop_token_ids,
            ignore_eos: st.ignore_eos,
            skip_special_tokens: r.skip_special_tokens.unwrap_or(true),
            logprobs: s.logprobs || s.top_logprobs > 0,
            top_logprobs: s.top_logprobs,
            logit_bias: s.logit_bias.iter().map(|(&t, &b)| (t, b)).collect(),
            grammar: s.format.and_then(|f| f.kind).map(output_format),
            n: 1,
        };
        let default_max = if is_chat {
            MaxTokensDefault::RestOfContext
        } else {
            MaxTokensDefault::Fixed(16)
        };
        let prep = d
            .prepare(&r.model, input, params, default_max)
            .await
            .map_err(|e| {
                d.metrics.request("invalid");
                trace::failed(&span, &e);
                e.grpc()
            })?;
        let prep = trace::prepared(span, &d.model.name, prep, &caller);
        let request_id = if r.request_id.is_empty() {
            prep.request_id.to_string()
        } else {
            r.request_id
        };
        let logprobs = prep.params.logprobs;
        let g = d.generate(prep).await.map_err(|e| e.grpc())?;
        let d = d.clone();
        let stream = futures::stream::unfold(Some(g), move |g| {
            let d = d.clone();
            let request_id = request_id.clone();
            async move {
                let mut g = g?;
                // One sample: the public gRPC API has no `n`.
                let c = match g.next().await? {
                    Ok((_, c)) => c,
                    Err(e) => return Some((Err(e.grpc()), None)),
                };
                let tok = &d.model.text.tokenizer;
                let piece = |id: u32| tok.decode(&[id], false).unwrap_or_default();
                let mut msg = pb::GenerateResponse {
                    request_id,
                    text: c.text,
                    token_ids: c.tokens.iter().map(|t| t.id).collect(),
                    ..Default::default()
                };
                if logprobs {
                    msg.logprobs = c
                        .tokens
                        .iter()
                        .map(|t| pb::TokenLogprob {
                            token_id: t.id,
                            token: piece(t.id),
                            logprob: t.logprob,
                            top: t
                                .top
                                .iter()
                                .map(|&(id, logprob)| pb::TopLogprob {
                                    token_id: id,
                                    token: piece(id),
                                    logprob,
                                })
                                .collect(),
                        })
                        .collect();
                }
                let last = c.finish.is_some();
                if let Some((f, u)) = c.finish {
                    msg.finish_reason = finish_reason(f) as i32;
                    msg.usage = Some(pb::Usage {
                        prompt_tokens: u.prompt_tokens,
                        completion_tokens: u.completion_tokens,
                        cached_prompt_tokens: u.cached_prompt_tokens,
                    });
                }
                Some((Ok(msg), if last { None } else { Some(g) }))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let r = request.into_inner();
        self.d.check_model(&r.model).map_err(|e| e.grpc())?;
        let input = match r.prompt {
            Some(pb::tokenize_request::Prompt::Text(t)) => prompt_input(Some(t), None, None)?,
            Some(pb::tokenize_request::Prompt::Chat(c)) => prompt_input(None, Some(c), None)?,
            None => prompt_input(None, None, None)?,
        };
        let ids = self.d.tokenize(input).await.map_err(|e| e.grpc())?;
        Ok(Response::new(pb::TokenizeResponse {
            token_ids: ids,
            max_context: self.d.model.max_context() as u32,
        }))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let max_context = self.d.model.max_context() as u32;
        let base = pb::Model {
            id: self.d.model.name.clone(),
            max_context,
            owned_by: "tandem".into(),
        };
        // Then the LoRA adapters the workers serve, by name.
        let adapters = self.d.loras().into_keys().map(|id| pb::Model {
            id,
            max_context,
            owned_by: "tandem".into(),
        });
        Ok(Response::new(pb::ListModelsResponse {
            models: std::iter::once(base).chain(adapters).collect(),
        }))
    }
}

/// The public API's output format as the grammar the workers enforce.
fn output_format(kind: pb::output_format::Kind) -> RequestedGrammar {
    use pb::output_format::Kind;
    use tandem_types::Grammar;
    let grammar = match kind {
        Kind::JsonSchema(s) => Grammar::JsonSchema(s),
        Kind::JsonObject(_) => Grammar::JsonObject,
        Kind::Regex(r) => Grammar::Regex(r),
        Kind::Choice(c) => Grammar::Choice(c.options),
        Kind::Lark(l) => Grammar::Lark(l),
    };
    RequestedGrammar {
        grammar,
        param: "sampling.format",
    }
}
