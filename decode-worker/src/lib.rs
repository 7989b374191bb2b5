//! tandem-decode-worker: the gRPC `tandem.worker.v1.Decode` service around an engine.
//!
//! Owns: [`DecodeService`] (Generate streams, Info, Load, the KV-event stream), the worker's
//! health (grpc.health.v1) and its graceful shutdown ([`serve`]: on the shutdown signal the worker
//! reports NOT_SERVING, refuses new requests with UNAVAILABLE, lets in-flight ones finish within a
//! deadline, then ends its KV-event streams and closes). Does not own the engine loop (an
//! [`EngineHandle`] runs it on its own thread) or any routing.
//!
//! Data flow: a `Generate` call is validated and submitted to the engine handle; the engine's
//! per-request channel becomes the response stream, several tokens per message when the client
//! reads slower than the engine steps. Dropping the response stream (client cancel, router gone)
//! drops the request stream, which cancels the request and frees its KV blocks within a step.

pub mod kv_sink;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tandem_engine::{
    EngineError, EngineHandle, FinishReason, Finished, KvEventKind, KvUpdate, Request,
    RequestStream, SamplingParams, StreamEvent, TokenEvent,
};
use tandem_proto::worker::{self as pb, decode_server::DecodeServer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::{Request as GrpcRequest, Response, Status};

/// What a decode worker says about itself in `Info`.
#[derive(Clone, Debug)]
pub struct WorkerIdentity {
    pub worker_id: String,
    pub model: String,
    pub kv_dtype: String,
}

/// Counts requests between accept and the end of their stream; the drain waits for zero.
struct InFlight {
    count: AtomicUsize,
    changed: tokio::sync::Notify,
}

struct Guard(Arc<InFlight>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// The `Decode` service. Cheap to clone; all clones share one engine.
#[derive(Clone)]
pub struct DecodeService {
    engine: Arc<EngineHandle>,
    identity: WorkerIdentity,
    in_flight: Arc<InFlight>,
    draining: Arc<AtomicBool>,
    /// Flips to true when the worker stops: open KV-event streams end.
    stopped: watch::Receiver<bool>,
}

/// Drives a [`DecodeService`]'s shutdown.
pub struct Shutdown {
    in_flight: Arc<InFlight>,
    draining: Arc<AtomicBool>,
    stop: watch::Sender<bool>,
}

impl DecodeService {
    pub fn new(engine: Arc<EngineHandle>, identity: WorkerIdentity) -> (Self, Shutdown) {
        let in_flight = Arc::new(InFlight {
            count: AtomicUsize::new(0),
            changed: tokio::sync::Notify::new(),
        });
        let draining = Arc::new(AtomicBool::new(false));
        let (stop, stopped) = watch::channel(false);
        (
            Self {
                engine,
                identity,
                in_flight: in_flight.clone(),
                draining: draining.clone(),
                stopped,
            },
            Shutdown {
                in_flight,
                draining,
                stop,
            },
        )
    }
}

impl Shutdown {
    /// Stops taking requests, waits (up to `deadline`) for in-flight ones to finish, then ends
    /// the KV-event streams. Returns how many requests were still running at the deadline.
    pub async fn drain(&self, deadline: Duration) -> usize {
        self.draining.store(true, Ordering::SeqCst);
        let wait = async {
            loop {
                let changed = self.in_flight.changed.notified();
                if self.in_flight.count.load(Ordering::SeqCst) == 0 {
                    return;
                }
                changed.await;
            }
        };
        let _ = tokio::time::timeout(deadline, wait).await;
        let _ = self.stop.send(true);
        self.in_flight.count.load(Ordering::SeqCst)
    }
}

/// Maps an engine refusal to the gRPC status a client can act on.
fn status(e: EngineError) -> Status {
    match e {
        EngineError::InvalidRequest(_)
        | EngineError::ContextOverflow { .. }
        | EngineError::BadToken { .. } => Status::invalid_argument(e.to_string()),
        EngineError::TooLargeForCache { .. } => Status::resource_exhausted(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

fn sampling_params(req: &pb::DecodeRequest) -> SamplingParams {
    let s = req.sampling.unwrap_or_default();
    let stop = req.stopping.clone().unwrap_or_default();
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        min_p: s.min_p,
        repetition_penalty: if s.repetition_penalty == 0.0 {
            1.0
        } else {
            s.repetition_penalty
        },
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        top_logprobs: s.top_logprobs,
        max_tokens: stop.max_tokens,
        stop_token_ids: stop.stop_token_ids,
        ignore_eos: stop.ignore_eos,
    }
}

fn token(t: &TokenEvent) -> pb::Token {
    pb::Token {
        id: t.sampled.token,
        logprob: t.sampled.logprob,
        top: t
            .sampled
            .top
            .iter()
            .map(|&(id, logprob)| pb::TopToken { id, logprob })
            .collect(),
    }
}

fn finish(f: &Finished) -> pb::Finish {
    let reason = match f.finish_reason {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    };
    pb::Finish {
        reason: reason as i32,
        prompt_tokens: f.prompt_ids.len() as u32,
        cached_prompt_tokens: f.cached_prompt_tokens as u32,
        preemptions: f.preemptions,
        queue_seconds: f.queue_s,
        ttft_seconds: f.ttft_s,
        e2e_seconds: f.e2e_s,
    }
}

/// Folds one engine event into a response; true when it was the last.
fn fold(msg: &mut pb::DecodeResponse, ev: StreamEvent) -> Result<bool, Status> {
    match ev {
        StreamEvent::Token(t) => {
            msg.tokens.push(token(&t));
            Ok(false)
        }
        StreamEvent::Finished(f) => {
            msg.finish = Some(finish(&f));
            Ok(true)
        }
        StreamEvent::Failed(e) => Err(Status::internal(format!("engine failed: {e}"))),
    }
}

struct GenState {
    stream: RequestStream,
    done: bool,
    _guard: Guard,
}

/// The response stream of one request: waits for an event, then takes whatever else is ready.
fn response_stream(
    state: GenState,
) -> impl Stream<Item = Result<pb::DecodeResponse, Status>> + Send {
    futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let mut next = st.stream.next().await;
        if next.is_none() {
            st.done = true;
            return Some((Err(Status::internal("engine stopped mid-request")), st));
        }
        let mut msg = pb::DecodeResponse::default();
        let mut last = false;
        while let Some(ev) = next {
            match fold(&mut msg, ev) {
                Ok(l) => last = l,
                Err(e) => {
                    st.done = true;
                    return Some((Err(e), st));
                }
            }
            next = if last { None } else { st.stream.try_next() };
        }
        st.done = last;
        Some((Ok(msg), st))
    })
}

fn kv_batch(update: KvUpdate) -> pb::KvEventBatch {
    match update {
        KvUpdate::Snapshot { next_seq, hashes } => pb::KvEventBatch {
            snapshot: Some(pb::KvSnapshot {
                next_seq,
                block_hashes: hashes.iter().map(|h| h.0).collect(),
            }),
            events: Vec::new(),
        },
        KvUpdate::Events(events) => pb::KvEventBatch {
            snapshot: None,
            events: events
                .into_iter()
                .map(|e| pb::KvEvent {
                    seq: e.seq,
                    kind: Some(match e.kind {
                        KvEventKind::Stored { parent, hashes } => {
                            pb::kv_event::Kind::Stored(pb::KvStored {
                                parent_hash: parent.map(|p| p.0),
                                block_hashes: hashes.iter().map(|h| h.0).collect(),
                            })
                        }
                        KvEventKind::Removed { hashes } => {
                            pb::kv_event::Kind::Removed(pb::KvRemoved {
                                block_hashes: hashes.iter().map(|h| h.0).collect(),
                            })
                        }
                    }),
                })
                .collect(),
        },
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = BoxStream<pb::DecodeResponse>;
    type KvEventsStream = BoxStream<pb::KvEventBatch>;

    async fn generate(
        &self,
        request: GrpcRequest<pb::DecodeRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "this decode worker is draining for shutdown",
            ));
        }
        let req = request.into_inner();
        if let Some(pb::prefill_plan::Plan::Remote(_)) =
            req.prefill.as_ref().and_then(|p| p.plan.as_ref())
        {
            return Err(Status::unimplemented(
                "remote prefill is not served by this worker yet: send a local plan",
            ));
        }
        let params = sampling_params(&req);
        params.validate().map_err(status)?;
        self.in_flight.count.fetch_add(1, Ordering::SeqCst);
        let guard = Guard(self.in_flight.clone());
        let stream = self
            .engine
            .submit(Request {
                prompt: req.prompt_ids,
                params,
            })
            .map_err(status)?;
        tracing::debug!(request = %req.request_id, engine_id = stream.id().0, "accepted");
        Ok(Response::new(Box::pin(response_stream(GenState {
            stream,
            done: false,
            _guard: guard,
        }))))
    }

    async fn info(
        &self,
        _: GrpcRequest<pb::InfoRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        let l = self.engine.limits();
        Ok(Response::new(pb::WorkerInfo {
            worker_id: self.identity.worker_id.clone(),
            model: self.identity.model.clone(),
            block_size: l.block_size as u32,
            max_context: l.max_context as u32,
            vocab_size: l.vocab_size as u32,
            kv_dtype: self.identity.kv_dtype.clone(),
            total_blocks: l.total_blocks as u32,
            tensor_parallel: 1,
        }))
    }

    async fn load(
        &self,
        _: GrpcRequest<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadReport>, Status> {
        let s = self.engine.stats();
        Ok(Response::new(pb::LoadReport {
            running: s.running as u32,
            waiting: s.waiting as u32,
            blocks_total: s.blocks_total as u32,
            blocks_free: s.blocks_free as u32,
            blocks_cached: s.blocks_cached as u32,
            blocks_used: s.blocks_used as u32,
            prefix_lookup_tokens: s.prefix_lookup_tokens,
            prefix_hit_tokens: s.prefix_hit_tokens,
            preemptions: s.preemptions,
            in_flight: self.in_flight.count.load(Ordering::SeqCst) as u32,
            draining: self.draining.load(Ordering::SeqCst),
        }))
    }

    async fn kv_events(
        &self,
        _: GrpcRequest<pb::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        let rx = self.engine.subscribe_kv().map_err(status)?;
        let stopped = self.stopped.clone();
        let s = futures::stream::unfold((rx, stopped), |(mut rx, mut stopped)| async move {
            if *stopped.borrow() {
                return None;
            }
            tokio::select! {
                u = rx.recv() => {
                    let mut batch = kv_batch(u?);
                    // Coalesce what else is queued into one message.
                    while let Ok(more) = rx.try_recv() {
                        batch.events.extend(kv_batch(more).events);
                    }
                    Some((Ok(batch), (rx, stopped)))
                }
                _ = stopped.changed() => None,
            }
        });
        Ok(Response::new(Box::pin(s)))
    }
}

/// Serves `service` (plus grpc.health.v1) on `listener` until `signal` resolves, then drains:
/// NOT_SERVING, new requests refused, in-flight ones given up to `drain_deadline`.
pub async fn serve(
    listener: TcpListener,
    service: DecodeService,
    shutdown: Shutdown,
    signal: impl std::future::Future<Output = ()> + Send,
    drain_deadline: Duration,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<DecodeServer<DecodeService>>().await;
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let drained = async move {
        signal.await;
        tracing::info!(?addr, "shutting down: draining in-flight requests");
        reporter
            .set_not_serving::<DecodeServer<DecodeService>>()
            .await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let left = shutdown.drain(drain_deadline).await;
        if left > 0 {
            tracing::warn!(left, "drain deadline passed with requests still running");
        }
    };
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .tcp_nodelay(true)
        .add_service(health)
        .add_service(DecodeServer::new(service))
        .serve_with_incoming_shutdown(incoming, drained)
        .await
}
