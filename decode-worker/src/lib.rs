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

pub mod convert;
pub mod kv_sink;
pub mod metrics;
pub mod remote;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tandem_engine::{EngineHandle, Request, RequestStream, Reservation, StreamEvent};
use tandem_kv_transfer::TransferGrant;
use tandem_proto::wire::sampling_from_wire;
use tandem_proto::worker::{self as pb, decode_server::DecodeServer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::{Request as GrpcRequest, Response, Status};

use crate::convert::{finish, kv_event_stream, load_report, status, token, worker_info, BoxStream};
use crate::remote::RemotePrefill;

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
    /// KV ingress for remote plans; without it every request is prefilled here.
    remote: Option<Arc<RemotePrefill>>,
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
                remote: None,
            },
            Shutdown {
                in_flight,
                draining,
                stop,
            },
        )
    }

    /// Serves remote prefill plans through `remote` (built over this service's engine).
    pub fn with_remote(mut self, remote: Arc<RemotePrefill>) -> Self {
        self.remote = Some(remote);
        self
    }

    pub fn remote(&self) -> Option<&Arc<RemotePrefill>> {
        self.remote.as_ref()
    }

    pub fn engine(&self) -> &Arc<EngineHandle> {
        &self.engine
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
        StreamEvent::Failed(e) => Err(status(e)),
        StreamEvent::Kv(_) => Err(Status::internal("KV chunk on a decode stream")),
    }
}

/// A remote prefill still to do before the request's first token.
struct Pending {
    remote: Arc<RemotePrefill>,
    request_id: String,
    prompt: Vec<u32>,
    sampling: pb::Sampling,
    reservation: Reservation,
    candidates: Vec<String>,
}

/// Field order matters: a live transfer grant is revoked (dropped) before the engine request is
/// (dropping that cancels it and frees the blocks the grant covers).
struct GenState {
    grant: Option<TransferGrant>,
    pending: Option<Pending>,
    engine: Arc<EngineHandle>,
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
        if let Some(p) = st.pending.take() {
            let first = p
                .remote
                .prefill(
                    &p.request_id,
                    &p.prompt,
                    p.sampling,
                    &p.reservation,
                    &p.candidates,
                    &mut st.grant,
                )
                .await;
            match first {
                Some(first) => st.engine.join_remote(&st.stream, first),
                None => st.engine.prefill_locally(&st.stream),
            }
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

/// How often a `Generate` stream with nothing else to send says that its worker is alive.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// `inner`, with an empty message after every `every` of silence (waiting for KV blocks, a
/// remote or long local prefill, a slow step). The router tells a worker that is working, however
/// slowly, from one that is frozen or cut off by these: it gives up on a stream only when even
/// they stop.
fn with_heartbeats(
    inner: impl Stream<Item = Result<pb::DecodeResponse, Status>> + Send + 'static,
    every: Duration,
) -> impl Stream<Item = Result<pb::DecodeResponse, Status>> + Send {
    use futures::StreamExt;
    // The inner stream keeps its own state across polls, so a timed-out poll loses nothing.
    futures::stream::unfold(Box::pin(inner), move |mut inner| async move {
        match tokio::time::timeout(every, inner.next()).await {
            Ok(Some(item)) => Some((item, inner)),
            Ok(None) => None,
            Err(_) => Some((Ok(pb::DecodeResponse::default()), inner)),
        }
    })
}

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
        let params = sampling_from_wire(req.sampling, req.stopping.clone())
            .validate()
            .map_err(|e| status(e.into()))?;
        self.in_flight.count.fetch_add(1, Ordering::SeqCst);
        let guard = Guard(self.in_flight.clone());
        let candidates = match req.prefill.and_then(|p| p.plan) {
            Some(pb::prefill_plan::Plan::Remote(r)) if req.resume_ids.is_empty() => r.prefill_addrs,
            _ => Vec::new(),
        };
        let request = Request {
            prompt: req.prompt_ids,
            params,
            resume: req.resume_ids,
        };
        let mut pending = None;
        let stream = match (&self.remote, candidates.is_empty()) {
            (Some(remote), false) => {
                let prompt = request.prompt.clone();
                match self.engine.reserve_remote(request.clone()).await {
                    Ok(Some((stream, reservation))) => {
                        pending = Some(Pending {
                            remote: remote.clone(),
                            request_id: req.request_id.clone(),
                            prompt,
                            sampling: req.sampling.unwrap_or_default(),
                            reservation,
                            candidates,
                        });
                        stream
                    }
                    Ok(None) => {
                        remote.counts.no_room.fetch_add(1, Ordering::Relaxed);
                        self.engine.submit(request).map_err(status)?
                    }
                    Err(e) => return Err(status(e)),
                }
            }
            _ => self.engine.submit(request).map_err(status)?,
        };
        tracing::debug!(request = %req.request_id, engine_id = stream.id().0, remote = pending.is_some(), "accepted");
        Ok(Response::new(Box::pin(with_heartbeats(
            response_stream(GenState {
                grant: None,
                pending,
                engine: self.engine.clone(),
                stream,
                done: false,
                _guard: guard,
            }),
            HEARTBEAT,
        ))))
    }

    async fn info(
        &self,
        _: GrpcRequest<pb::InfoRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        Ok(Response::new(worker_info(
            &self.identity,
            self.engine.limits(),
        )))
    }

    async fn load(
        &self,
        _: GrpcRequest<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadReport>, Status> {
        Ok(Response::new(load_report(
            self.engine.stats(),
            self.in_flight.count.load(Ordering::SeqCst),
            self.draining.load(Ordering::SeqCst),
        )))
    }

    async fn kv_events(
        &self,
        _: GrpcRequest<pb::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        Ok(Response::new(kv_event_stream(
            &self.engine,
            self.stopped.clone(),
        )?))
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
    let metrics = metrics::router(metrics::DecodeMetrics {
        engine: service.engine.clone(),
        remote: service.remote.clone(),
    });
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .tcp_nodelay(true)
        .accept_http1(true)
        .add_routes(tonic::service::Routes::from(metrics))
        .add_service(health)
        .add_service(DecodeServer::new(service))
        .serve_with_incoming_shutdown(incoming, drained)
        .await
}
