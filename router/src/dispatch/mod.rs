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

use tandem_model::{ChatMessage, LoadedModel};
use tandem_proto::worker as pb;
use tandem_types::ValidSampling;

mod generation;
mod prepare;
mod route;

pub use generation::Generation;

use crate::error::ApiError;
use crate::metrics::RouterMetrics;
use crate::policy::disagg::DisaggConfig;
use crate::policy::RoutingPolicy;
use crate::text::TextAssembler;
use crate::workers::WorkerPool;
use route::Route;

/// The model the router serves: everything about text, nothing about weights.
pub struct ServedModel {
    pub name: String,
    pub text: LoadedModel,
}

impl ServedModel {
    pub fn max_context(&self) -> usize {
        self.text.config.max_position_embeddings
    }
}

pub enum PromptInput {
    /// Tokenized with special tokens (BOS) added.
    Text(String),
    /// Rendered through the chat template with the assistant turn opened.
    Chat(Vec<ChatMessage>),
    Ids(Vec<u32>),
}

/// Sampling and stopping as the APIs give them; `None` means the default.
#[derive(Clone, Debug, Default)]
pub struct GenParams {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 or negative: off (vLLM takes -1).
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub max_tokens: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    pub logprobs: bool,
    pub top_logprobs: u32,
}

/// When `max_tokens` is not given: OpenAI's completions default, or the rest of the context.
#[derive(Clone, Copy, Debug)]
pub enum MaxTokensDefault {
    Fixed(u32),
    RestOfContext,
}

/// The router's name for one request: unique within the cluster's routers (this process's id
/// and a counter), sent to the worker and used in the OpenAI response ids and in logs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RequestId(String);

impl RequestId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A request ready for a worker.
pub struct Prepared {
    pub request_id: RequestId,
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// Checked once, here; the worker API carries it as is.
    sampling: ValidSampling,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishKind {
    Stop,
    Length,
    Cancelled,
}

impl FinishKind {
    pub fn as_openai(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            // A request cancelled by the worker (shutdown deadline) ends as if cut short.
            Self::Cancelled => "abort",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_prompt_tokens: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// A piece of the answer: new text, the tokens it covers, and on the last one the finish.
#[derive(Clone, Debug, Default)]
pub struct Chunk {
    pub text: String,
    pub tokens: Vec<TokenOut>,
    pub finish: Option<(FinishKind, Usage)>,
}

pub struct DispatchConfig {
    /// Most requests in flight through this router.
    pub max_queue: usize,
    pub disagg: DisaggConfig,
    /// Times one request may move to another decode worker after its worker fails mid-stream.
    pub max_migrations: u32,
    /// A decode worker's stream that sends nothing, not even its heartbeat, for this long is
    /// given up on as if the worker had died (and the request moves on).
    pub stall: Duration,
}

pub struct Dispatcher {
    pub model: Arc<ServedModel>,
    pub pool: Arc<WorkerPool>,
    /// Prefill workers, when the cluster has any.
    pub prefill_pool: Option<Arc<WorkerPool>>,
    pub policy: Arc<dyn RoutingPolicy>,
    pub metrics: Arc<RouterMetrics>,
    cfg: DispatchConfig,
    queued: Arc<AtomicUsize>,
    next_id: AtomicU64,
}

/// A slot in the router's queue, released on drop.
struct QueueSlot(Arc<AtomicUsize>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Dispatcher {
    pub fn new(
        model: Arc<ServedModel>,
        pool: Arc<WorkerPool>,
        prefill_pool: Option<Arc<WorkerPool>>,
        policy: Arc<dyn RoutingPolicy>,
        cfg: DispatchConfig,
    ) -> Self {
        // One registry for the router: the pools count joins, leaves and refusals into it.
        let metrics = pool.metrics().clone();
        Self {
            model,
            pool,
            prefill_pool,
            policy,
            metrics,
            cfg,
            queued: Arc::new(AtomicUsize::new(0)),
            next_id: AtomicU64::new(1),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Sends the request to a worker and returns its stream of chunks.
    pub async fn generate(&self, prep: Prepared) -> Result<Generation, ApiError> {
        let n = self.queued.fetch_add(1, Ordering::SeqCst);
        let slot = QueueSlot(self.queued.clone());
        if n >= self.cfg.max_queue {
            self.metrics.refused("queue_full");
            self.metrics.request("refused");
            return Err(ApiError::QueueFull(self.cfg.max_queue));
        }
        let (sampling, stopping) = tandem_proto::wire::sampling_to_wire(&prep.sampling);
        let request = pb::DecodeRequest {
            request_id: prep.request_id.to_string(),
            prompt_ids: prep.prompt.clone(),
            sampling: Some(sampling),
            stopping: Some(stopping),
            prefill: None,
            resume_ids: Vec::new(),
        };
        let route = Route {
            pool: self.pool.clone(),
            prefill_pool: self.prefill_pool.clone(),
            policy: self.policy.clone(),
            disagg: self.cfg.disagg,
            metrics: self.metrics.clone(),
            stall: self.cfg.stall,
        };
        let mut tried = Vec::new();
        let open = match route.open(request.clone(), &[], &mut tried).await {
            Ok(o) => o,
            Err(e) => {
                if matches!(e, ApiError::NoWorker) {
                    self.metrics.refused("no_worker");
                    self.metrics.request("refused");
                } else {
                    self.metrics.request("failed");
                }
                return Err(e);
            }
        };
        tracing::debug!(request = %prep.request_id, worker = %open.guard.worker().addr, prompt = prep.prompt.len(), remote = open.prefill_guard.is_some(), "routed");
        Ok(Generation {
            stream: Some(open.stream),
            assembler: TextAssembler::new(
                prep.params.skip_special_tokens,
                prep.params.stop.clone(),
            ),
            model: self.model.clone(),
            prompt_tokens: prep.prompt.len() as u32,
            completion_tokens: 0,
            done: false,
            guard: open.guard,
            prefill_guard: open.prefill_guard,
            emitted: Vec::new(),
            request,
            route,
            tried,
            migrations_left: self.cfg.max_migrations,
            outcome: None,
            _slot: slot,
        })
    }
}
