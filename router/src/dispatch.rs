//! The path every request takes, whichever API it came in on: validate, template, tokenize,
//! pick a worker, stream tokens back as text.
//!
//! [`Dispatcher::prepare`] turns an API request into token ids and worker parameters, refusing
//! what cannot be served (400s). [`Dispatcher::generate`] takes a slot in the router's queue
//! (429 when full), asks the routing policy for a worker (503 when none is ready), and opens the
//! worker's stream, trying the next worker when one is unreachable. The returned [`Generation`]
//! yields [`Chunk`]s; dropping it cancels the request on the worker.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tandem_model::{ChatMessage, LoadedModel};
use tandem_proto::worker as pb;
use tonic::Streaming;

use crate::error::ApiError;
use crate::metrics::RouterMetrics;
use crate::policy::disagg::{self, DisaggConfig, PrefillCandidate};
use crate::policy::RoutingPolicy;
use crate::text::TextAssembler;
use crate::workers::{InFlightGuard, Worker, WorkerPool};

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

/// A request ready for a worker.
pub struct Prepared {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub params: GenParams,
    sampling: pb::Sampling,
    stopping: pb::Stopping,
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

fn check_range(ok: bool, message: String, param: &'static str) -> Result<(), ApiError> {
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(message, param))
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
        Self {
            model,
            pool,
            prefill_pool,
            policy,
            metrics: Arc::new(RouterMetrics::default()),
            cfg,
            queued: Arc::new(AtomicUsize::new(0)),
            next_id: AtomicU64::new(1),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

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

    /// Sends the request to a worker and returns its stream of chunks.
    pub async fn generate(&self, prep: Prepared) -> Result<Generation, ApiError> {
        let n = self.queued.fetch_add(1, Ordering::SeqCst);
        let slot = QueueSlot(self.queued.clone());
        if n >= self.cfg.max_queue {
            self.metrics.refused("queue_full");
            self.metrics.request("refused");
            return Err(ApiError::QueueFull(self.cfg.max_queue));
        }
        let request = pb::DecodeRequest {
            request_id: prep.request_id.clone(),
            prompt_ids: prep.prompt.clone(),
            sampling: Some(prep.sampling),
            stopping: Some(prep.stopping),
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

/// Everything needed to (re)open a request's stream on a decode worker.
struct Route {
    pool: Arc<WorkerPool>,
    prefill_pool: Option<Arc<WorkerPool>>,
    policy: Arc<dyn RoutingPolicy>,
    disagg: DisaggConfig,
    metrics: Arc<RouterMetrics>,
    stall: Duration,
}

/// A stream opened on a decode worker.
struct Opened {
    stream: Streaming<pb::DecodeResponse>,
    guard: InFlightGuard,
    /// Held on the first candidate prefill worker until the first token arrives.
    prefill_guard: Option<InFlightGuard>,
}

impl Route {
    /// The prefill plan for `prompt` on decode worker `d`: remote with ordered candidates when
    /// the disaggregation policy says so, else local.
    fn plan(&self, d: &Worker, prompt: &[u32]) -> (pb::PrefillPlan, Option<InFlightGuard>) {
        let local = pb::PrefillPlan {
            plan: Some(pb::prefill_plan::Plan::Local(pb::LocalPrefill {})),
        };
        let Some(pp) = &self.prefill_pool else {
            return (local, None);
        };
        let uncached = prompt.len().saturating_sub(d.cached_prefix_tokens(prompt));
        if uncached < self.disagg.min_tokens {
            return (local, None);
        }
        let ready = pp.ready();
        let cands: Vec<PrefillCandidate> = ready
            .iter()
            .map(|w| PrefillCandidate {
                in_flight: w.in_flight(),
                cached_tokens: w.cached_prefix_tokens(prompt),
            })
            .collect();
        let order = disagg::plan(&self.disagg, prompt.len(), uncached, &cands);
        let Some(&first) = order.first() else {
            return (local, None);
        };
        let guard = ready[first].start_request();
        let plan = pb::PrefillPlan {
            plan: Some(pb::prefill_plan::Plan::Remote(pb::RemotePrefill {
                prefill_addrs: order.iter().map(|&i| ready[i].addr.clone()).collect(),
            })),
        };
        (plan, Some(guard))
    }

    /// Opens `request` (with `resume` as the tokens already streamed) on a ready decode worker
    /// not in `tried`, trying the next one when a worker is unreachable.
    async fn open(
        &self,
        mut request: pb::DecodeRequest,
        resume: &[u32],
        tried: &mut Vec<String>,
    ) -> Result<Opened, ApiError> {
        request.resume_ids = resume.to_vec();
        loop {
            let Some(worker) = self
                .pool
                .pick(self.policy.as_ref(), &request.prompt_ids, tried)
            else {
                return Err(match tried.last() {
                    None => ApiError::NoWorker,
                    Some(last) => ApiError::Upstream {
                        worker: last.clone(),
                        message: "no decode worker could take the request".into(),
                    },
                });
            };
            let guard = worker.start_request();
            // A resumed request is prefilled where it decodes (its prompt is mostly cached
            // nowhere, and the first token is already out).
            let (plan, prefill_guard) = if resume.is_empty() {
                self.plan(&worker, &request.prompt_ids)
            } else {
                (
                    pb::PrefillPlan {
                        plan: Some(pb::prefill_plan::Plan::Local(pb::LocalPrefill {})),
                    },
                    None,
                )
            };
            let remote = prefill_guard.is_some();
            request.prefill = Some(plan);
            match worker.client().generate(request.clone()).await {
                Ok(r) => {
                    if resume.is_empty() {
                        self.metrics.prefill(remote);
                    }
                    return Ok(Opened {
                        stream: r.into_inner(),
                        guard,
                        prefill_guard,
                    });
                }
                Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown) => {
                    tracing::warn!(worker = %worker.addr, error = %s, "worker unavailable, trying another");
                    worker.mark_down();
                    tried.push(worker.addr.clone());
                }
                Err(s) => return Err(ApiError::from_worker(&worker.addr, &s)),
            }
        }
    }
}

/// One request's answer as it arrives. Dropping it cancels the request on the worker.
pub struct Generation {
    stream: Option<Streaming<pb::DecodeResponse>>,
    assembler: TextAssembler,
    model: Arc<ServedModel>,
    prompt_tokens: u32,
    completion_tokens: u32,
    done: bool,
    guard: InFlightGuard,
    prefill_guard: Option<InFlightGuard>,
    /// Every token received so far: what a migrated stream resumes from.
    emitted: Vec<u32>,
    request: pb::DecodeRequest,
    route: Route,
    tried: Vec<String>,
    migrations_left: u32,
    /// How it ended, once it has: counted when the generation is dropped (`cancelled` if the
    /// client went away before either).
    outcome: Option<&'static str>,
    _slot: QueueSlot,
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.route
            .metrics
            .request(self.outcome.unwrap_or("cancelled"));
    }
}

/// Whether a failed stream means its worker is gone (move the request) rather than that the
/// request itself was refused (report it).
fn worker_lost(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Cancelled
    )
}

impl Generation {
    pub fn worker(&self) -> &str {
        &self.guard.worker().addr
    }

    /// The next chunk; `None` after the one carrying the finish. When the decode worker fails
    /// mid-stream the request moves to another one, resuming after the tokens already
    /// received, so the caller sees one continuous answer.
    pub async fn next(&mut self) -> Option<Result<Chunk, ApiError>> {
        loop {
            if self.done {
                return None;
            }
            let stream = self.stream.as_mut()?;
            let stall = self.route.stall;
            let failure = match tokio::time::timeout(stall, stream.message()).await {
                Err(_) => ApiError::Upstream {
                    worker: self.worker().to_string(),
                    message: format!(
                        "the worker sent nothing, not even a heartbeat, for {stall:?}"
                    ),
                },
                // A heartbeat: the worker is alive and still working on it.
                Ok(Ok(Some(m))) if m.tokens.is_empty() && m.finish.is_none() => continue,
                Ok(Ok(Some(m))) => {
                    let chunk = self.absorb(m);
                    self.outcome = match &chunk {
                        Ok(c) if c.finish.is_some() => Some("ok"),
                        Ok(_) => None,
                        Err(_) => Some("failed"),
                    };
                    return Some(chunk);
                }
                Ok(Ok(None)) => ApiError::Upstream {
                    worker: self.worker().to_string(),
                    message: "the stream ended without a finish".into(),
                },
                Ok(Err(s)) if worker_lost(&s) => ApiError::from_worker(self.worker(), &s),
                Ok(Err(s)) => {
                    self.done = true;
                    self.outcome = Some("failed");
                    return Some(Err(ApiError::from_worker(self.worker(), &s)));
                }
            };
            if let Err(e) = self.migrate(failure).await {
                self.done = true;
                self.outcome = Some("failed");
                return Some(Err(e));
            }
        }
    }

    /// Reopens the request on another decode worker after `failure`, or gives `failure` back.
    async fn migrate(&mut self, failure: ApiError) -> Result<(), ApiError> {
        if self.migrations_left == 0 {
            return Err(failure);
        }
        self.migrations_left -= 1;
        let lost = self.worker().to_string();
        tracing::warn!(request = %self.request.request_id, worker = %lost, tokens = self.emitted.len(), error = %failure, "decode worker lost mid-stream; migrating");
        self.guard.worker().mark_down();
        self.stream = None;
        self.tried.push(lost);
        let opened = self
            .route
            .open(self.request.clone(), &self.emitted, &mut self.tried)
            .await
            .map_err(|_| failure)?;
        self.route.metrics.migration();
        self.stream = Some(opened.stream);
        self.guard = opened.guard;
        self.prefill_guard = None;
        Ok(())
    }

    fn absorb(&mut self, msg: pb::DecodeResponse) -> Result<Chunk, ApiError> {
        let tok = &self.model.text.tokenizer;
        let internal = |e: tandem_model::ModelError| ApiError::Internal(e.to_string());
        let mut chunk = Chunk::default();
        if !msg.tokens.is_empty() {
            self.prefill_guard = None;
        }
        for t in msg.tokens {
            self.completion_tokens += 1;
            self.emitted.push(t.id);
            let piece = self.assembler.push(tok, t.id).map_err(internal)?;
            chunk.text.push_str(&piece.text);
            chunk.tokens.push(TokenOut {
                id: t.id,
                logprob: t.logprob,
                top: t.top.iter().map(|x| (x.id, x.logprob)).collect(),
            });
            if piece.stopped {
                // Dropping the stream cancels the rest on the worker.
                self.stream = None;
                self.done = true;
                chunk.finish = Some((
                    FinishKind::Stop,
                    Usage {
                        prompt_tokens: self.prompt_tokens,
                        completion_tokens: self.completion_tokens,
                        cached_prompt_tokens: 0,
                    },
                ));
                return Ok(chunk);
            }
        }
        if let Some(f) = msg.finish {
            let piece = self.assembler.finish(tok).map_err(internal)?;
            chunk.text.push_str(&piece.text);
            let kind = match pb::FinishReason::try_from(f.reason) {
                _ if piece.stopped => FinishKind::Stop,
                Ok(pb::FinishReason::Length) => FinishKind::Length,
                Ok(pb::FinishReason::Cancelled) => FinishKind::Cancelled,
                _ => FinishKind::Stop,
            };
            self.done = true;
            chunk.finish = Some((
                kind,
                Usage {
                    prompt_tokens: f.prompt_tokens,
                    completion_tokens: self.completion_tokens,
                    cached_prompt_tokens: f.cached_prompt_tokens,
                },
            ));
        }
        Ok(chunk)
    }
}
