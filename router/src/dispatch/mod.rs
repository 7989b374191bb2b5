//! The path every request takes, whichever API it came in on: validate, template, tokenize,
//! pick a worker, stream tokens back as text.
//!
//! [`Dispatcher::prepare`] turns an API request into token ids and worker parameters, refusing
//! what cannot be served (400s). [`Dispatcher::generate`] takes a slot in the router's queue
//! (429 when full), asks the routing policy for a worker (503 when none is ready), and opens the
//! worker's stream, trying the next worker when one is unreachable. The returned [`Generation`]
//! yields [`Chunk`]s; dropping it cancels the request on the worker.
//!
//! Files: this one holds the request types and the dispatcher; `prepare` the validation and
//! tokenization (every 400), `route` the choice of decode and prefill workers and the opening of
//! a stream, `generation` the stream itself with its heartbeats, stall deadline and migration.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tandem_grammar::GrammarCompiler;
use tandem_model::{ChatMessage, LoadedModel};
use tandem_proto::worker as pb;
use tandem_types::ValidSampling;
use tracing::Instrument;

mod generation;
mod prepare;
mod route;

pub use generation::Generation;
use generation::{Leg, Sample};

use crate::error::ApiError;
use crate::flow::{Caller, Flow, FlowConfig};
use crate::metrics::RouterMetrics;
use crate::policy::disagg::DisaggConfig;
use crate::policy::RoutingPolicy;
use crate::text::TextAssembler;
use crate::trace;
use crate::workers::WorkerPool;
use route::Route;

/// The model the router serves: everything about text, nothing about weights.
pub struct ServedModel {
    /// The name clients send as `model` and the APIs list (`--served-model-name`, or the model
    /// file's).
    pub name: String,
    /// The model file's text side: tokenizer, chat template and config (no weights).
    pub text: LoadedModel,
    /// How the model writes tool calls (its template's style, or `--tool-call-parser`).
    pub tool_calls: tandem_model::ToolCallStyle,
    /// Whether the model thinks in `<think>...</think>` before it answers, which the APIs
    /// split out as reasoning (its template shows it, or `--reasoning-parser`).
    pub reasoning: bool,
}

/// `--reasoning-parser`: how reasoning is told from the answer in a model's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// `<think>...</think>` before the answer (Qwen3's, DeepSeek-R1's).
    Think,
    /// No reasoning: the whole output is the answer.
    None,
}

impl std::str::FromStr for ReasoningParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen3" | "deepseek_r1" | "think" => Ok(Self::Think),
            "none" => Ok(Self::None),
            o => Err(format!(
                "unknown reasoning parser {o:?} (qwen3, deepseek_r1, none)"
            )),
        }
    }
}

impl ServedModel {
    /// The model with tool calls parsed as `style` says, where given.
    pub fn with_tool_call_parser(mut self, style: Option<tandem_model::ToolCallStyle>) -> Self {
        if let Some(s) = style {
            self.tool_calls = s;
        }
        self
    }

    /// The model with reasoning split out as `parser` says, where given.
    pub fn with_reasoning_parser(mut self, parser: Option<ReasoningParser>) -> Self {
        if let Some(p) = parser {
            self.reasoning = p == ReasoningParser::Think;
        }
        self
    }

    /// The model's context in tokens: prompt and output together must fit it.
    pub fn max_context(&self) -> usize {
        self.text.config.max_position_embeddings
    }
}

/// A request's prompt in whichever form its API gave it.
pub enum PromptInput {
    /// Tokenized with special tokens (BOS) added.
    Text(String),
    /// Rendered through the chat template with the assistant turn opened.
    Chat(Vec<ChatMessage>),
    /// The same, with the tools the model may call passed to a template that renders them
    /// (none: empty), and more variables for the template (vLLM's `chat_template_kwargs`).
    ChatWith(
        Vec<ChatMessage>,
        Vec<serde_json::Value>,
        serde_json::Map<String, serde_json::Value>,
    ),
    /// Token ids, sent as they are once checked against the vocabulary.
    Ids(Vec<u32>),
}

/// Sampling and stopping as the APIs give them; `None` means the default.
#[derive(Clone, Debug, Default)]
pub struct GenParams {
    /// Softmax temperature (default 1; 0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches this (default 1,
    /// off).
    pub top_p: Option<f32>,
    /// 0 or negative: off (vLLM takes -1).
    pub top_k: Option<i64>,
    /// Tokens less likely than this fraction of the likeliest one are dropped (default 0, off).
    pub min_p: Option<f32>,
    /// HF-style multiplicative penalty on prompt and output tokens (default 1, off).
    pub repetition_penalty: Option<f32>,
    /// OpenAI-style additive penalty on tokens already generated (default 0).
    pub presence_penalty: Option<f32>,
    /// OpenAI-style penalty per occurrence of a generated token (default 0).
    pub frequency_penalty: Option<f32>,
    /// Seed of the request's own random stream (none: drawn from the system).
    pub seed: Option<u64>,
    /// Most output tokens; the default is the API's ([`MaxTokensDefault`]).
    pub max_tokens: Option<u64>,
    /// Strings that end the output; the text is cut before the first one that appears.
    pub stop: Vec<String>,
    /// Token ids that end the output (as EOS does).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating after EOS, up to `max_tokens`.
    pub ignore_eos: bool,
    /// Leave special tokens (BOS, EOS, template markers) out of the text.
    pub skip_special_tokens: bool,
    /// Return each output token's log-probability.
    pub logprobs: bool,
    /// Also return this many of the likeliest alternatives with each token.
    pub top_logprobs: u32,
    /// Added to these tokens' logits (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// What the output must match (structured outputs); none: free text.
    pub grammar: Option<RequestedGrammar>,
    /// Parallel samples of the prompt (OpenAI's `n`; 0 is taken as 1).
    pub n: u32,
}

/// A request's grammar with the field that gave it (its 400 names that field).
#[derive(Clone, Debug)]
pub struct RequestedGrammar {
    /// The grammar.
    pub grammar: tandem_types::Grammar,
    /// The API field it came in (`response_format`, `guided_json`, ...).
    pub param: &'static str,
}

/// When `max_tokens` is not given: OpenAI's completions default, or the rest of the context.
#[derive(Clone, Copy, Debug)]
pub enum MaxTokensDefault {
    /// This many tokens (the completions API's 16).
    Fixed(u32),
    /// Whatever the prompt leaves of the model's context (the chat API's).
    RestOfContext,
}

/// The router's name for one request: unique within the cluster's routers (this process's id
/// and a counter), sent to the worker and used in the OpenAI response ids and in logs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouterRequestId(String);

impl RouterRequestId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RouterRequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A request ready for a worker.
pub struct Prepared {
    /// The id this router gave the request.
    pub request_id: RouterRequestId,
    /// The prompt's token ids (never empty).
    pub prompt: Vec<u32>,
    /// The request's parameters as the API gave them.
    pub params: GenParams,
    /// Checked once, here; the worker API carries it as is.
    sampling: ValidSampling,
    /// The request's span (disabled unless the API edge traces it).
    trace: tracing::Span,
    /// Who it is for (its tenant), from its API key.
    caller: Caller,
    /// The LoRA adapter its `model` names (None: the base model).
    pub lora: Option<pb::LoraRef>,
}

impl Prepared {
    /// The model it runs, as responses name it: its LoRA adapter's name, or `base`'s.
    pub fn model_name(&self, base: &str) -> String {
        self.lora.as_ref().map_or(base, |l| &l.name).to_string()
    }

    /// The request, for `caller` (its key's tenant): its quotas, its band in the queue.
    pub fn for_caller(mut self, caller: Caller) -> Self {
        if let Some(t) = &caller.tenant {
            self.trace.record("tandem.tenant", &**t);
        }
        self.caller = caller;
        self
    }

    /// The request, traced under `span`: its routing, migrations and the worker's spans hang
    /// from it, and it records how the request ended.
    pub fn traced(mut self, span: tracing::Span) -> Self {
        self.trace = span;
        self
    }
}

/// Why a request's output ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishKind {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The worker cancelled it (its shutdown deadline passed).
    Cancelled,
}

impl FinishKind {
    /// OpenAI's `finish_reason` for it.
    pub fn as_openai(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            // A request cancelled by the worker (shutdown deadline) ends as if cut short.
            Self::Cancelled => "abort",
        }
    }
}

/// A finished request's token counts, as OpenAI's `usage` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated (a stop string's tokens included).
    pub completion_tokens: u32,
    /// Prompt tokens the worker found in its prefix cache rather than prefilled (0 when the
    /// router cut the output at a stop string before the worker's own finish).
    pub cached_prompt_tokens: u32,
}

/// One generated token with its log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    /// The token's id.
    pub id: u32,
    /// Its log-probability under the model's raw distribution (before penalties and
    /// temperature).
    pub logprob: f32,
    /// The likeliest alternatives as `(id, logprob)`, best first (`top_logprobs` of them).
    pub top: Vec<(u32, f32)>,
}

/// A piece of the answer: new text, the tokens it covers, and on the last one the finish.
#[derive(Clone, Debug, Default)]
pub struct Chunk {
    /// Text released by these tokens (may be empty while a possible stop string is held back).
    pub text: String,
    /// The tokens received since the last chunk.
    pub tokens: Vec<TokenOut>,
    /// On the last chunk: why the output ended, and the request's counts.
    pub finish: Option<(FinishKind, Usage)>,
    /// On the last chunk of an output a stop string ended: that string.
    pub stop: Option<String>,
}

/// The dispatcher's limits.
pub struct DispatchConfig {
    /// Most requests in flight through this router.
    pub max_queue: usize,
    /// When a prompt is prefilled on a prefill worker.
    pub disagg: DisaggConfig,
    /// Times one request may move to another decode worker after its worker fails mid-stream.
    pub max_migrations: u32,
    /// A decode worker's stream that sends nothing, not even its heartbeat, for this long is
    /// given up on as if the worker had died (and the request moves on).
    pub stall: Duration,
    /// The router's queue: room per worker and the default wait limit.
    pub flow: FlowConfig,
}

/// The request path both APIs share: validation and tokenization, the router's queue, the choice
/// of workers, and the stream back. One per router, shared by every connection.
pub struct Dispatcher {
    /// The model this router serves.
    pub model: Arc<ServedModel>,
    /// The decode workers.
    pub pool: Arc<WorkerPool>,
    /// Prefill workers, when the cluster has any.
    pub prefill_pool: Option<Arc<WorkerPool>>,
    /// How a request's decode worker is chosen.
    pub policy: Arc<dyn RoutingPolicy>,
    /// The router's metrics (the decode pool's registry, shared with every pool).
    pub metrics: Arc<RouterMetrics>,
    /// The router's queue and its tenants.
    pub flow: Arc<Flow>,
    cfg: DispatchConfig,
    queued: Arc<AtomicUsize>,
    next_id: AtomicU64,
    /// What this router's request ids start with: random per process, so routers side by side
    /// (in containers, every one of them pid 1) do not give the same ids.
    id_prefix: String,
    /// Compiles requests' grammars to refuse a bad one here, before it is routed.
    grammars: Arc<GrammarCompiler>,
    /// Prompts being rendered or tokenized now, at most one per core: that work runs on the
    /// blocking pool, never on the threads that serve streams, and a flood of large prompts
    /// waits here rather than taking every core and the memory each needs.
    tokenizing: Arc<tokio::sync::Semaphore>,
    /// The most bytes one token of the vocabulary stands for: a text longer than the context
    /// times this cannot fit, whatever its tokens.
    max_token_bytes: usize,
}

/// Slots in the router's queue, one per sample, released on drop.
struct QueueSlot(Arc<AtomicUsize>, usize);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::SeqCst);
    }
}

impl Dispatcher {
    /// A dispatcher over `pool` (and `prefill_pool`, when there is one) that counts into the
    /// decode pool's metrics.
    pub fn new(
        model: Arc<ServedModel>,
        pool: Arc<WorkerPool>,
        prefill_pool: Option<Arc<WorkerPool>>,
        policy: Arc<dyn RoutingPolicy>,
        cfg: DispatchConfig,
    ) -> Self {
        // One registry for the router: the pools count joins, leaves and refusals into it.
        let metrics = pool.metrics().clone();
        let grammars = Arc::new(GrammarCompiler::new(
            model.text.tokenizer.clone(),
            model.text.config.vocab_size,
        ));
        let max_token_bytes = model
            .text
            .tokenizer
            .vocab_bytes()
            .ok()
            .and_then(|v| v.iter().map(|e| e.bytes.len()).max())
            .unwrap_or(prepare::FALLBACK_TOKEN_BYTES)
            .max(1);
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let flow = Flow::new(
            cfg.flow,
            {
                let pool = pool.clone();
                move || pool.ready().len()
            },
            metrics.clone(),
        );
        Self {
            flow,
            grammars,
            tokenizing: Arc::new(tokio::sync::Semaphore::new(cores.clamp(1, 8))),
            max_token_bytes,
            model,
            pool,
            prefill_pool,
            policy,
            metrics,
            cfg,
            queued: Arc::new(AtomicUsize::new(0)),
            next_id: AtomicU64::new(1),
            id_prefix: {
                use std::hash::BuildHasher;
                // The standard library seeds each RandomState from the OS's random source.
                let r = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
                format!("{:08x}", r as u32)
            },
        }
    }

    /// Samples holding a slot in the router's queue now (from [`generate`](Self::generate)
    /// until their [`Generation`] drops): a request with `n` samples holds `n`.
    pub fn in_flight(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Refuses (400) a request whose samples (prompts × `n`) alone are more than the queue
    /// holds: it could never be admitted, so retrying would not help.
    pub fn check_samples(&self, samples: usize) -> Result<(), ApiError> {
        if samples > self.cfg.max_queue {
            return Err(ApiError::invalid(
                format!(
                    "the request asks for {samples} samples (prompts × n), more than the \
                     router's queue of {}: send fewer prompts or a smaller n",
                    self.cfg.max_queue
                ),
                "n",
            ));
        }
        Ok(())
    }

    /// Sends the request to a worker and returns its stream of chunks. Its samples take that
    /// many slots of the queue, so one request of many samples cannot crowd out the rest.
    pub async fn generate(&self, prep: Prepared) -> Result<Generation, ApiError> {
        let samples = prep.params.n.max(1) as usize;
        self.check_samples(samples)?;
        let before = self.queued.fetch_add(samples, Ordering::SeqCst);
        let slot = QueueSlot(self.queued.clone(), samples);
        if before + samples > self.cfg.max_queue {
            self.metrics.refused("queue_full");
            self.metrics.request("refused");
            if let Some(t) = &prep.caller.tenant {
                // The label is the flow's to give (bounded); the refusal counts under it.
                let label = self.flow.label(t);
                self.metrics.tenant_request(&label, "overloaded");
            }
            let e = ApiError::QueueFull(self.cfg.max_queue);
            trace::failed(&prep.trace, &e);
            return Err(e);
        }
        // The tenant's quotas, then its turn in the router's queue.
        let permit = match self
            .flow
            .admit(&prep.caller, samples, prep.prompt.len() as u64)
            .await
        {
            Ok(p) => p,
            Err(e) => {
                self.metrics.refused(match e {
                    ApiError::OverQuota { .. } => "over_quota",
                    ApiError::QueueTimeout { .. } => "queue_timeout",
                    _ => "unauthorized",
                });
                self.metrics.request("refused");
                trace::failed(&prep.trace, &e);
                return Err(e);
            }
        };
        if !prep.trace.is_disabled() {
            prep.trace
                .record("tandem.queue.wait_ms", permit.waited().as_secs_f64() * 1e3);
            prep.trace
                .record("tandem.tenant.priority", i64::from(permit.priority()));
        }
        let (sampling, stopping) = tandem_proto::wire::sampling_to_wire(&prep.sampling);
        let n = prep.params.n.max(1);
        let request = pb::DecodeRequest {
            request_id: prep.request_id.to_string(),
            prompt_ids: prep.prompt.clone(),
            sampling: Some(sampling),
            stopping: Some(stopping),
            prefill: None,
            resume_ids: Vec::new(),
            n,
            first_index: 0,
            priority: permit.priority(),
            lora: prep.lora.clone(),
        };
        if let Some(l) = &prep.lora {
            self.metrics.lora_request(&l.name);
        }
        let route = Route {
            pool: self.pool.clone(),
            prefill_pool: self.prefill_pool.clone(),
            policy: self.policy.clone(),
            disagg: self.cfg.disagg,
            metrics: self.metrics.clone(),
            stall: self.cfg.stall,
        };
        let mut tried = Vec::new();
        let routing = tracing::info_span!(
            parent: &prep.trace,
            "route",
            tandem.route.policy = self.policy.name(),
            tandem.route.worker = tracing::field::Empty,
            tandem.route.cached_tokens = tracing::field::Empty,
            tandem.route.prefill = tracing::field::Empty,
            tandem.route.prefill_candidates = tracing::field::Empty,
            tandem.route.local_estimate_s = tracing::field::Empty,
            tandem.route.remote_estimate_s = tracing::field::Empty,
        );
        let open = match route
            .open(request.clone(), &[], &mut tried)
            .instrument(routing)
            .await
        {
            Ok(o) => o,
            Err(e) => {
                if matches!(e, ApiError::NoWorker) {
                    self.metrics.refused("no_worker");
                    self.metrics.request("refused");
                } else {
                    self.metrics.request("failed");
                }
                trace::failed(&prep.trace, &e);
                return Err(e);
            }
        };
        tracing::debug!(request = %prep.request_id, worker = %open.guard.worker().addr, prompt = prep.prompt.len(), remote = open.prefill_guard.is_some(), n, "routed");
        let samples = (0..n)
            .map(|_| {
                Sample::new(TextAssembler::new(
                    prep.params.skip_special_tokens,
                    prep.params.stop.clone(),
                ))
            })
            .collect();
        Ok(Generation {
            legs: vec![Leg::new(open, (0..n).collect(), route.stall)],
            samples,
            ready: Default::default(),
            model: self.model.clone(),
            prompt_tokens: prep.prompt.len() as u32,
            request,
            route,
            tried,
            migrations_left: self.cfg.max_migrations,
            migrations: 0,
            outcome: None,
            span: prep.trace,
            permit,
            _slot: slot,
        })
    }
}
