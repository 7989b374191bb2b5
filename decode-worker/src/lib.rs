//! tandem-decode-worker: the gRPC `tandem.worker.v1.Decode` service around an engine.
//!
//! Owns: [`DecodeService`] (Generate streams, heartbeats on them, remote prefill plans through
//! [`remote`]) and the decode worker's metrics. [`serve`] runs it beside what every worker serves
//! (tandem-worker: WorkerControl, health, `/metrics`, the graceful drain: on the shutdown signal
//! the worker reports NOT_SERVING, refuses new requests with UNAVAILABLE, lets in-flight ones
//! finish within a deadline, then ends its KV-event streams and closes). Does not own the engine
//! loop (an [`EngineHandle`] runs it on its own thread) or any routing.
//!
//! Data flow: a `Generate` call is validated and submitted to the engine handle; the engine's
//! per-request channel becomes the response stream, several tokens per message when the client
//! reads slower than the engine steps. Dropping the response stream (client cancel, router gone)
//! drops the request stream, which cancels the request and frees its KV blocks within a step.

#![deny(missing_docs)]

pub mod metrics;
pub mod remote;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::Stream;
use tandem_engine::{
    EngineHandle, Request, RequestId, RequestStream, Reservation, Samples, StreamEvent,
};
use tandem_kv_transfer::TransferGrant;
use tandem_proto::wire::sampling_from_wire;
use tandem_proto::worker::{self as pb, decode_server::DecodeServer};
use tandem_worker::convert::{finish, status, token, BoxStream};
use tandem_worker::metrics::RequestMetrics;
use tandem_worker::trace;
use tandem_worker::{ControlService, InFlight};
pub use tandem_worker::{Drain, WorkerIdentity};
use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::{Request as GrpcRequest, Response, Status};
use tracing::Instrument;

use crate::remote::RemotePrefill;

/// The `Decode` service. Cheap to clone; all clones share one engine.
#[derive(Clone)]
pub struct DecodeService {
    engine: Arc<EngineHandle>,
    identity: WorkerIdentity,
    drain: Arc<Drain>,
    /// KV ingress for remote plans; without it every request is prefilled here.
    remote: Option<Arc<RemotePrefill>>,
    /// Per-request measures in vLLM's terms.
    requests: Arc<RequestMetrics>,
    /// The streams running here (what StopSamples names).
    running: Arc<Running>,
}

/// The streams running on this worker, by their ids (the engine's request ids, which it never
/// gives twice): each `Generate` call's caller id and the samples it serves, while its stream
/// lives. A caller's id alone does not name a stream: two routers, or two clients, may send the
/// same one.
#[derive(Default)]
struct Running(std::sync::Mutex<Streams>);

/// Each live stream's caller id and the samples it serves, by stream.
type Streams = HashMap<RequestId, (String, std::ops::Range<u32>)>;

impl Running {
    /// Notes that stream `id` serves `samples` of the caller's request `key` until the entry is
    /// dropped.
    fn enter(self: &Arc<Self>, key: &str, id: RequestId, samples: Samples) -> RunningEntry {
        let range = samples.first..samples.first.saturating_add(samples.count);
        self.lock().insert(id, (key.to_string(), range));
        RunningEntry {
            running: self.clone(),
            id,
        }
    }

    /// Those of `indices` stream `id` serves, when it runs here for the caller's request `key`.
    fn serving(&self, id: RequestId, key: &str, indices: &[u32]) -> Option<Vec<u32>> {
        let map = self.lock();
        let (_, range) = map.get(&id).filter(|(caller, _)| caller == key)?;
        Some(
            indices
                .iter()
                .copied()
                .filter(|i| range.contains(i))
                .collect(),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Streams> {
        // The map is consistent after every operation on it: a panic elsewhere while the lock was
        // held leaves nothing half done.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A stream's place in [`Running`], taken out when the stream ends.
struct RunningEntry {
    running: Arc<Running>,
    id: RequestId,
}

impl Drop for RunningEntry {
    fn drop(&mut self) {
        self.running.lock().remove(&self.id);
    }
}

impl DecodeService {
    /// A decode worker over `engine`; its [`Drain`] is the one [`serve`] stops it with.
    pub fn new(engine: Arc<EngineHandle>, identity: WorkerIdentity) -> Self {
        Self {
            requests: Arc::new(RequestMetrics::new()),
            engine,
            identity,
            drain: Drain::new(),
            remote: None,
            running: Arc::default(),
        }
    }

    /// Serves remote prefill plans through `remote` (built over this service's engine).
    pub fn with_remote(mut self, remote: Arc<RemotePrefill>) -> Self {
        self.remote = Some(remote);
        self
    }

    /// Remote prefill, when this worker takes KV from prefill workers.
    pub fn remote(&self) -> Option<&Arc<RemotePrefill>> {
        self.remote.as_ref()
    }

    /// The engine this service feeds.
    pub fn engine(&self) -> &Arc<EngineHandle> {
        &self.engine
    }

    /// The WorkerControl service (Info, Load, KvEvents) of this worker.
    pub fn control(&self) -> ControlService {
        let c = ControlService::new(
            self.engine.clone(),
            self.identity.clone(),
            self.drain.clone(),
        );
        match &self.remote {
            Some(r) => c.with_links(r.links.clone()),
            None => c,
        }
    }
}

/// What a request's stream measures as its events pass.
struct Observe {
    metrics: Arc<RequestMetrics>,
    last_token: Option<Instant>,
    /// The request's server span (disabled when traces are off); lives as long as the stream.
    span: tracing::Span,
    /// When the engine got the request: the origin of the times it reports.
    submitted: SystemTime,
    /// Whether this engine prefilled the prompt (false once a prefill worker did).
    local: bool,
    /// The sample whose token gaps are measured (its first).
    timed_sample: u32,
}

/// Folds one engine event into a response; true when it was the last (`done`: the stream has
/// given its last event, so a finish is the request's, not one sample's of several).
fn fold(
    msg: &mut pb::DecodeResponse,
    ev: StreamEvent,
    done: bool,
    obs: &mut Observe,
) -> Result<bool, Status> {
    match ev {
        StreamEvent::Token(t) => {
            // Gaps between one sample's tokens: its siblings' tokens come in the same steps.
            if t.index == obs.timed_sample {
                let now = Instant::now();
                if let Some(last) = obs.last_token.replace(now) {
                    obs.metrics.token_gap(now - last);
                }
            }
            msg.tokens.push(token(&t));
            Ok(false)
        }
        StreamEvent::Finished(f) => {
            obs.metrics.finished(&f);
            if let Some(e) = &f.error {
                // The request's grammar could not go on: the whole request fails with it (a
                // status the router passes on as the client's error), nothing unconstrained.
                let s = Status::invalid_argument(e.clone());
                trace::failed(&obs.span, &s.message());
                return Err(s);
            }
            if !done {
                // One of several samples: the stream goes on with the others.
                msg.finished.push(finish(&f));
                return Ok(false);
            }
            trace::finished(&obs.span, obs.submitted, &f, obs.local);
            msg.finish = Some(finish(&f));
            Ok(true)
        }
        StreamEvent::Failed(e) => {
            let s = status(e);
            trace::failed(&obs.span, &s.message());
            Err(s)
        }
        StreamEvent::Kv(_) => Err(Status::internal("KV chunk on a decode stream")),
    }
}

/// A remote prefill still to do before the request's first token.
struct Pending {
    remote: Arc<RemotePrefill>,
    request_id: String,
    prompt: Vec<u32>,
    sampling: pb::Sampling,
    priority: i32,
    lora: Option<pb::LoraRef>,
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
    /// A failure that came after tokens not yet sent: it ends the stream after them.
    failed: Option<Status>,
    observe: Observe,
    _running: RunningEntry,
    _in_flight: InFlight,
}

/// The response stream of one request: waits for an event, then takes whatever else is ready.
fn response_stream(
    state: GenState,
) -> impl Stream<Item = Result<pb::DecodeResponse, Status>> + Send {
    futures::stream::unfold(state, |mut st| async move {
        if let Some(s) = st.failed.take() {
            st.done = true;
            return Some((Err(s), st));
        }
        if st.done {
            return None;
        }
        if let Some(p) = st.pending.take() {
            let span = tracing::info_span!(
                parent: &st.observe.span,
                "remote_prefill",
                tandem.prefill.candidates = p.candidates.len() as i64,
                tandem.prefill.cached_tokens = p.reservation.cached_tokens as i64,
                tandem.prefill.result = tracing::field::Empty,
            );
            let first = p
                .remote
                .prefill(
                    remote::Ask {
                        request_id: &p.request_id,
                        prompt: &p.prompt,
                        sampling: &p.sampling,
                        priority: p.priority,
                        lora: p.lora.as_ref(),
                        reservation: &p.reservation,
                    },
                    &p.candidates,
                    &mut st.grant,
                )
                .instrument(span.clone())
                .await;
            span.record(
                "tandem.prefill.result",
                match &first {
                    Ok(Some(_)) => "remote",
                    Ok(None) => "local_fallback",
                    Err(_) => "engine_failed",
                },
            );
            match first {
                Ok(Some(pulled)) => {
                    st.observe.local = false;
                    st.engine
                        .join_remote(&st.stream, pulled.first, pulled.source_cached)
                }
                Ok(None) => st.engine.prefill_locally(&st.stream),
                // A prefill engine failed under this request: it ends here, with that status
                // (marked, so the router reports it rather than moving it). Dropping the state
                // revokes the grant, then cancels the engine request, which frees its blocks.
                Err(s) => {
                    st.done = true;
                    return Some((Err(s), st));
                }
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
            match fold(&mut msg, ev, st.stream.is_done(), &mut st.observe) {
                Ok(l) => last = l,
                // Tokens sampled before the failure go out first (a request that moves resumes
                // after them, not before).
                Err(e) if !msg.tokens.is_empty() || !msg.finished.is_empty() => {
                    st.failed = Some(e);
                    break;
                }
                Err(e) => {
                    st.done = true;
                    return Some((Err(e), st));
                }
            }
            next = if last { None } else { st.stream.try_next() };
        }
        if !msg.tokens.is_empty() {
            // What StopSamples names this stream by.
            msg.stream_id = st.stream.id().0;
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

    async fn generate(
        &self,
        request: GrpcRequest<pb::DecodeRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let in_flight = self
            .drain
            .enter()
            .map_err(tandem_proto::wire::draining_status)?;
        let (metadata, _, req) = request.into_parts();
        let span = trace::server_span(
            "tandem.worker.v1.Decode",
            "Generate",
            &self.identity.model,
            &req.request_id,
            req.prompt_ids.len(),
            &metadata,
        );
        let fail = |s: Status| {
            trace::failed(&span, &s.message());
            s
        };
        let params = sampling_from_wire(req.sampling.clone(), req.stopping.clone())
            .validate()
            .map_err(|e| fail(status(e.into())))?;
        let candidates = match req.prefill.and_then(|p| p.plan) {
            Some(pb::prefill_plan::Plan::Remote(r)) => r.prefill_addrs,
            _ => Vec::new(),
        };
        let samples = Samples {
            count: req.n.max(1),
            first: req.first_index,
        };
        let adapter = self
            .identity
            .loras
            .resolve(req.lora.as_ref())
            .await
            .map_err(fail)?;
        let request = Request {
            prompt: req.prompt_ids,
            params,
            resume: req.resume_ids,
            constraint: None,
            samples,
            priority: req.priority,
            adapter,
        };
        let request = self
            .engine
            .compile(request)
            .await
            .map_err(|e| fail(status(e)))?;
        let mut pending = None;
        let submitted = SystemTime::now();
        let stream = match (&self.remote, candidates.is_empty()) {
            (Some(remote), false) => {
                // The tokens whose KV comes from the candidates: the prompt, and for a request
                // resumed here the tokens streamed before (their KV is held where they ran, or
                // computed by the candidate).
                let prompt: Vec<u32> = request
                    .prompt
                    .iter()
                    .chain(&request.resume)
                    .copied()
                    .collect();
                match self.engine.reserve_remote(request.clone()).await {
                    Ok(Some((stream, reservation))) => {
                        pending = Some(Pending {
                            remote: remote.clone(),
                            request_id: req.request_id.clone(),
                            prompt,
                            sampling: req.sampling.unwrap_or_default(),
                            priority: req.priority,
                            lora: req.lora.clone(),
                            reservation,
                            candidates,
                        });
                        stream
                    }
                    Ok(None) => {
                        remote
                            .counts
                            .no_room
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        self.engine.submit(request).map_err(|e| fail(status(e)))?
                    }
                    Err(e) => return Err(fail(status(e))),
                }
            }
            _ => self.engine.submit(request).map_err(|e| fail(status(e)))?,
        };
        tracing::debug!(request = %req.request_id, engine_id = stream.id().0, remote = pending.is_some(), "accepted");
        let running = self.running.enter(&req.request_id, stream.id(), samples);
        Ok(Response::new(Box::pin(with_heartbeats(
            response_stream(GenState {
                grant: None,
                pending,
                engine: self.engine.clone(),
                stream,
                done: false,
                failed: None,
                observe: Observe {
                    metrics: self.requests.clone(),
                    last_token: None,
                    span,
                    submitted,
                    local: true,
                    timed_sample: req.first_index,
                },
                _running: running,
                _in_flight: in_flight,
            }),
            HEARTBEAT,
        ))))
    }

    async fn stop_samples(
        &self,
        request: GrpcRequest<pb::StopSamplesRequest>,
    ) -> Result<Response<pb::StopSamplesResponse>, Status> {
        let req = request.into_inner();
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is empty"));
        }
        let id = RequestId(req.stream_id);
        let serving = self.running.serving(id, &req.request_id, &req.indices);
        if let Some(indices) = &serving {
            self.engine.stop_samples(id, indices);
        }
        tracing::debug!(request = %req.request_id, stream = req.stream_id, samples = ?req.indices, found = serving.is_some(), "stop samples");
        Ok(Response::new(pb::StopSamplesResponse {
            found: serving.is_some(),
        }))
    }
}

/// Serves `service` (with WorkerControl, grpc.health.v1 and `/metrics`) on `listener` until
/// `signal` resolves, then drains: NOT_SERVING, new requests refused, in-flight ones given up to
/// `drain_deadline`.
pub async fn serve(
    listener: TcpListener,
    service: DecodeService,
    signal: impl std::future::Future<Output = ()> + Send,
    drain_deadline: Duration,
    token: Option<tandem_worker::WorkerToken>,
) -> Result<(), tonic::transport::Error> {
    serve_beside(listener, service, |r| r, signal, drain_deadline, token).await
}

/// [`serve`], with more services on the same port (`beside` adds them to the decode service's
/// routes): the Prefill service its peers pull prefixes from.
pub async fn serve_beside(
    listener: TcpListener,
    service: DecodeService,
    beside: impl FnOnce(tonic::service::Routes) -> tonic::service::Routes,
    signal: impl std::future::Future<Output = ()> + Send,
    drain_deadline: Duration,
    token: Option<tandem_worker::WorkerToken>,
) -> Result<(), tonic::transport::Error> {
    let metrics = metrics::DecodeMetrics {
        engine: service.engine.clone(),
        remote: service.remote.clone(),
        requests: service.requests.clone(),
        loras: service.identity.loras.clone(),
    };
    let control = service.control();
    tandem_worker::serve(
        listener,
        beside(tonic::service::Routes::new(DecodeServer::new(service))),
        DecodeServer::<DecodeService>::NAME,
        control,
        metrics,
        signal,
        drain_deadline,
        token,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_samples_names_a_live_stream_of_the_caller_s_request_and_only_its_samples() {
        let running = Arc::new(Running::default());
        let samples = |first, count| Samples { count, first };
        // A request's stream (samples 0..4), its migrated sample 5 on another, and another
        // router's request under the same caller id.
        let a = running.enter("req", RequestId(7), samples(0, 4));
        let b = running.enter("req", RequestId(9), samples(5, 1));
        let same_id = running.enter("req", RequestId(8), samples(0, 2));
        assert_eq!(
            running.serving(RequestId(7), "req", &[1, 5, 3, 4, 40]),
            Some(vec![1, 3])
        );
        assert_eq!(running.serving(RequestId(9), "req", &[1, 5]), Some(vec![5]));
        assert_eq!(running.serving(RequestId(8), "req", &[1, 3]), Some(vec![1]));
        // A stream is named by its id and its caller's id together.
        assert_eq!(running.serving(RequestId(7), "other", &[1]), None);
        assert_eq!(running.serving(RequestId(70), "req", &[1]), None);
        drop(a);
        assert_eq!(running.serving(RequestId(7), "req", &[1]), None);
        assert_eq!(running.serving(RequestId(9), "req", &[5]), Some(vec![5]));
        drop((b, same_id));
        assert!(running.lock().is_empty(), "no entry left behind");
    }
}
