//! tandem-prefill-worker: the gRPC `tandem.worker.v1.Prefill` service around an engine in prefill
//! mode.
//!
//! Owns: [`PrefillService`] (Prefill: admission by the queue's expected wait, progress
//! heartbeats, the KV push) and its metrics; [`serve`] runs it beside what every worker serves
//! (tandem-worker: the WorkerControl service the router orders candidates by, health, `/metrics`,
//! the graceful drain). Prompts are scheduled by the engine
//! like any others: batched with other prefills, chunked to the token budget, reusing this
//! worker's own prefix cache. As each step fills blocks the engine hands them out
//! ([`tandem_engine::StreamEvent::Kv`]) and this service pushes exactly the requested ones to the
//! decode worker over a [`KvTransport`] while the engine computes the next chunk; then it answers
//! with the first token. A cancelled call (the decode worker gave up or its client left) drops the
//! engine request and the connection, which stops both compute and transfer. Every status it
//! answers with is made from an [`tandem_engine::ErrorKind`] (`tandem_proto::wire::status`), so
//! its codes are the ones every other path uses for the same fault.
//!
//! Files, by concern (as in tandem-decode-worker): this one holds the service, its limits and
//! `serve`; `admission` checks a call and admits it by the queue's expected wait; `push` runs an
//! admitted prefill and sends its KV (each engine chunk cut into the frames the receiver's ranks
//! take by tandem-kv-transfer's [`tandem_kv_transfer::FramePlan`]); [`metrics`] its counts and
//! `/metrics` collector.

#![deny(missing_docs)]

mod admission;
pub mod metrics;
mod push;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tandem_engine::EngineHandle;
use tandem_kv_transfer::{KvShape, KvTransport};
use tandem_proto::worker::{self as pb, prefill_server::PrefillServer};
use tandem_worker::convert::BoxStream;
use tandem_worker::metrics::RequestMetrics;
use tandem_worker::trace;
pub use tandem_worker::WorkerIdentity;
use tandem_worker::{ControlService, Drain};
use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::{Request as GrpcRequest, Response, Status};
use tracing::Instrument;

use crate::metrics::Metrics;
pub use crate::metrics::PrefillCounts;
use crate::push::Stop;

/// How much work a prefill worker takes on.
#[derive(Clone, Copy, Debug)]
pub struct PrefillLimits {
    /// A prompt is refused (RESOURCE_EXHAUSTED, which callers retry elsewhere) when the prompt
    /// tokens already admitted would take longer than this at the worker's measured rate. Before
    /// the worker has measured a rate, everything is admitted.
    pub max_queue_wait: Duration,
}

impl Default for PrefillLimits {
    fn default() -> Self {
        Self {
            max_queue_wait: Duration::from_secs(10),
        }
    }
}

/// How often a running prefill tells its caller it is alive and how far the engine got.
pub const HEARTBEAT: Duration = Duration::from_millis(250);

/// What every call of the service shares: the engine, the transport, the admission's queue
/// and the counts.
struct Shared {
    engine: Arc<EngineHandle>,
    transport: Arc<dyn KvTransport>,
    identity: WorkerIdentity,
    limits: PrefillLimits,
    drain: Arc<Drain>,
    /// Uncached prompt tokens of admitted prefills whose blocks have not all been sent.
    queued_tokens: AtomicU64,
    counts: PrefillCounts,
    /// Per-request measures in vLLM's terms.
    requests: RequestMetrics,
    /// This worker's cache, for rebuilding frames of the head ranges a receiver's ranks take.
    shape: Option<KvShape>,
}

/// The `Prefill` service. Cheap to clone; all clones share one engine.
#[derive(Clone)]
pub struct PrefillService {
    shared: Arc<Shared>,
}

impl PrefillService {
    /// The Prefill service over `engine`, sending KV through `transport`.
    pub fn new(
        engine: Arc<EngineHandle>,
        transport: Arc<dyn KvTransport>,
        identity: WorkerIdentity,
        limits: PrefillLimits,
    ) -> Self {
        let requests = RequestMetrics::new();
        let shape = tandem_worker::KvTarget::of(&engine).and_then(|t| t.shape(&identity.model));
        Self {
            shared: Arc::new(Shared {
                shape,
                engine,
                transport,
                requests,
                identity,
                limits,
                drain: Drain::new(),
                queued_tokens: AtomicU64::new(0),
                counts: PrefillCounts::default(),
            }),
        }
    }

    /// The WorkerControl service (Info, Load, KvEvents) of this worker.
    pub fn control(&self) -> ControlService {
        let s = &self.shared;
        ControlService::new(s.engine.clone(), s.identity.clone(), s.drain.clone())
    }

    /// What this worker has done since start.
    pub fn counts(&self) -> &PrefillCounts {
        &self.shared.counts
    }

    /// Uncached prompt tokens admitted and not yet sent.
    pub fn queued_tokens(&self) -> u64 {
        self.shared.queued_tokens.load(Ordering::SeqCst)
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    type PrefillStream = BoxStream<pb::PrefillUpdate>;

    async fn prefill(
        &self,
        request: GrpcRequest<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let s = &self.shared;
        let (metadata, _, req) = request.into_parts();
        let span = trace::server_span(
            "tandem.worker.v1.Prefill",
            "Prefill",
            &s.identity.model,
            &req.request_id,
            req.prompt_ids.len(),
            &metadata,
        );
        let fail = |st: Status| {
            trace::failed(&span, &st.message());
            st
        };
        let checked = s.check(&req).map_err(&fail)?;
        let (mut admitted, ahead) = s.admit(checked.uncached).map_err(&fail)?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let shared = s.clone();
        tokio::spawn(async move {
            let id = req.request_id.clone();
            let r = shared
                .run(req, checked, &mut admitted, ahead, &tx)
                .instrument(span.clone())
                .await;
            let c = &shared.counts;
            match r {
                Ok(()) => c.ok.fetch_add(1, Ordering::Relaxed),
                Err(Stop::Gone) => {
                    trace::failed(&span, &"the caller went away");
                    c.cancelled.fetch_add(1, Ordering::Relaxed)
                }
                Err(Stop::Failed(e)) => {
                    trace::failed(&span, &e.message());
                    tracing::warn!(request = %id, error = %e, "prefill failed");
                    let _ = tx.send(Err(e)).await;
                    c.failed.fetch_add(1, Ordering::Relaxed)
                }
            };
            // The engine request (and the KV connection) end here, before the admission does.
            drop(admitted);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// `routes` with this service beside them: a decode worker serves Prefill to its peers, which pull
/// the prefixes it holds (its engine computes only what it lacks and pushes every block).
pub fn beside(service: PrefillService, routes: tonic::service::Routes) -> tonic::service::Routes {
    routes.add_service(PrefillServer::new(service))
}

/// Serves `service` (with WorkerControl, grpc.health.v1 and `/metrics`) on `listener` until
/// `signal`, then drains for up to `drain_deadline`; with `token`, every call of its own needs
/// the cluster's credential.
pub async fn serve(
    listener: TcpListener,
    service: PrefillService,
    signal: impl std::future::Future<Output = ()> + Send,
    drain_deadline: Duration,
    token: Option<tandem_worker::WorkerToken>,
) -> Result<(), tonic::transport::Error> {
    let metrics = Metrics(service.shared.clone());
    let control = service.control();
    tandem_worker::serve(
        listener,
        tonic::service::Routes::new(PrefillServer::new(service)),
        PrefillServer::<PrefillService>::NAME,
        control,
        metrics,
        signal,
        drain_deadline,
        token,
    )
    .await
}
