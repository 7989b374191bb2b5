//! tandem-prefill-worker: the gRPC `tandem.worker.v1.Prefill` service around an engine in prefill
//! mode.
//!
//! Owns: [`PrefillService`] (Prefill, and the Info/Load/KvEvents the router orders candidates by),
//! its `/metrics`, health and graceful shutdown ([`serve`]). Prompts are scheduled by the engine
//! like any others: batched with other prefills, chunked to the token budget, reusing this
//! worker's own prefix cache. As each step fills blocks the engine hands them out
//! ([`tandem_engine::StreamEvent::Kv`]) and this service pushes exactly the requested ones to the
//! decode worker over a [`KvTransport`] while the engine computes the next chunk; then it answers
//! with the first token. A cancelled call (the decode worker gave up or its client left) drops the
//! engine request and the connection, which stops both compute and transfer.
//!
//! Reuses the decode worker's engine↔proto conversions ([`tandem_decode_worker::convert`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tandem_decode_worker::convert::{
    kv_event_stream, load_report, sampling_params, status, worker_info, BoxStream,
};
use tandem_decode_worker::metrics::{counter, engine_metrics};
use tandem_decode_worker::WorkerIdentity;
use tandem_engine::{EngineHandle, Request, StreamEvent};
use tandem_kv_transfer::{BlockFrame, KvStream, KvTransport};
use tandem_proto::worker::{self as pb, prefill_server::PrefillServer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::{Request as GrpcRequest, Response, Status};

/// Counted since start, for `/metrics`.
#[derive(Debug, Default)]
pub struct PrefillCounts {
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    pub prefilled_tokens: AtomicU64,
    pub bytes_sent: AtomicU64,
}

struct Shared {
    engine: Arc<EngineHandle>,
    transport: Arc<dyn KvTransport>,
    identity: WorkerIdentity,
    in_flight: AtomicUsize,
    draining: AtomicBool,
    counts: PrefillCounts,
}

/// The `Prefill` service. Cheap to clone; all clones share one engine.
#[derive(Clone)]
pub struct PrefillService {
    shared: Arc<Shared>,
    stopped: watch::Receiver<bool>,
}

/// Ends a [`PrefillService`]'s KV-event streams and refuses new prefills.
pub struct Shutdown {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl Shutdown {
    /// Refuses new prefills, waits up to `deadline` for running ones, ends the event streams.
    pub async fn drain(&self, deadline: Duration) -> usize {
        self.shared.draining.store(true, Ordering::SeqCst);
        let t0 = tokio::time::Instant::now();
        while self.shared.in_flight.load(Ordering::SeqCst) > 0 && t0.elapsed() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = self.stop.send(true);
        self.shared.in_flight.load(Ordering::SeqCst)
    }
}

struct InFlight<'a>(&'a Shared);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PrefillService {
    pub fn new(
        engine: Arc<EngineHandle>,
        transport: Arc<dyn KvTransport>,
        identity: WorkerIdentity,
    ) -> (Self, Shutdown) {
        let shared = Arc::new(Shared {
            engine,
            transport,
            identity,
            in_flight: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            counts: PrefillCounts::default(),
        });
        let (stop, stopped) = watch::channel(false);
        (
            Self {
                shared: shared.clone(),
                stopped,
            },
            Shutdown { shared, stop },
        )
    }

    pub fn counts(&self) -> &PrefillCounts {
        &self.shared.counts
    }

    /// Runs one prefill: engine chunks out to the destination as they come, then the answer.
    async fn run(&self, req: pb::PrefillRequest) -> Result<pb::PrefillResponse, Status> {
        let s = &self.shared;
        let dest = req
            .destination
            .ok_or_else(|| Status::invalid_argument("no KV destination"))?;
        let limits = s.engine.limits();
        let bs = limits.block_size;
        let cached = req.cached_tokens as usize;
        let prompt_len = req.prompt_ids.len();
        if !cached.is_multiple_of(bs) || cached >= prompt_len {
            return Err(Status::invalid_argument(format!(
                "cached_tokens {cached} must be a multiple of the block size {bs} below the prompt length {prompt_len}"
            )));
        }
        let want_blocks = prompt_len.div_ceil(bs) - cached / bs;
        if dest.block_ids.len() != want_blocks {
            return Err(Status::invalid_argument(format!(
                "{} destination blocks for {} tokens after {cached} cached: {want_blocks} needed",
                dest.block_ids.len(),
                prompt_len - cached
            )));
        }
        let mut params = sampling_params(req.sampling, None);
        params.max_tokens = 1;
        let mut stream = s
            .engine
            .submit_prefill(
                Request {
                    prompt: req.prompt_ids,
                    params,
                    resume: Vec::new(),
                },
                cached,
            )
            .map_err(status)?;
        let mut conn: Box<dyn KvStream> = s.transport.open(&dest.endpoint).await.map_err(|e| {
            Status::unavailable(format!(
                "cannot reach the KV endpoint {}: {e}",
                dest.endpoint
            ))
        })?;
        let send_err = |e| Status::unavailable(format!("sending KV to {}: {e}", dest.endpoint));
        let mut first = None;
        let mut sent = 0u64;
        while let Some(ev) = stream.next().await {
            match ev {
                StreamEvent::Kv(c) => {
                    let frames: Vec<BlockFrame<'_>> = (0..c.blocks)
                        .flat_map(|j| {
                            let block = dest.block_ids[c.first + j];
                            (0..c.layers.len()).map(move |layer| (layer, j, block))
                        })
                        .map(|(layer, j, block)| BlockFrame {
                            layer: layer as u32,
                            block,
                            payload: c.frame(layer, j),
                        })
                        .collect();
                    conn.send_blocks(dest.transfer_id, &frames)
                        .await
                        .map_err(send_err)?;
                    sent += frames.iter().map(|f| f.payload.len() as u64).sum::<u64>();
                }
                StreamEvent::Token(t) => first = Some(t),
                StreamEvent::Finished(_) => break,
                StreamEvent::Failed(e) => {
                    let _ = conn.abort(dest.transfer_id).await;
                    return Err(Status::internal(format!("prefill failed: {e}")));
                }
            }
        }
        let first = first.ok_or_else(|| Status::internal("the engine stopped mid-prefill"))?;
        conn.end(dest.transfer_id).await.map_err(send_err)?;
        s.counts.bytes_sent.fetch_add(sent, Ordering::Relaxed);
        s.counts
            .prefilled_tokens
            .fetch_add((prompt_len - cached) as u64, Ordering::Relaxed);
        Ok(pb::PrefillResponse {
            first_token: Some(tandem_decode_worker::convert::token(&first)),
            prefilled_tokens: (prompt_len - cached) as u32,
            cached_tokens: cached as u32,
        })
    }
}

/// Counts a prefill as cancelled unless it finished (the future was dropped mid-way).
struct Outcome<'a> {
    counts: &'a PrefillCounts,
    done: bool,
}

impl Drop for Outcome<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.counts.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    type KvEventsStream = BoxStream<pb::KvEventBatch>;

    async fn prefill(
        &self,
        request: GrpcRequest<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let s = &self.shared;
        if s.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "this prefill worker is draining for shutdown",
            ));
        }
        s.in_flight.fetch_add(1, Ordering::SeqCst);
        let _in_flight = InFlight(s);
        let mut outcome = Outcome {
            counts: &s.counts,
            done: false,
        };
        let req = request.into_inner();
        let id = req.request_id.clone();
        let r = self.run(req).await;
        outcome.done = true;
        match &r {
            Ok(_) => s.counts.ok.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "prefill failed");
                s.counts.failed.fetch_add(1, Ordering::Relaxed)
            }
        };
        r.map(Response::new)
    }

    async fn info(
        &self,
        _: GrpcRequest<pb::InfoRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        let s = &self.shared;
        Ok(Response::new(worker_info(&s.identity, s.engine.limits())))
    }

    async fn load(
        &self,
        _: GrpcRequest<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadReport>, Status> {
        let s = &self.shared;
        Ok(Response::new(load_report(
            s.engine.stats(),
            s.in_flight.load(Ordering::SeqCst),
            s.draining.load(Ordering::SeqCst),
        )))
    }

    async fn kv_events(
        &self,
        _: GrpcRequest<pb::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        Ok(Response::new(kv_event_stream(
            &self.shared.engine,
            self.stopped.clone(),
        )?))
    }
}

#[derive(Clone)]
struct Metrics(Arc<Shared>);

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrefillMetrics")
    }
}

impl Collector for Metrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        engine_metrics(&mut enc, &s.engine.stats())?;
        let c = &s.counts;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut enc,
            "tandem_prefill_requests",
            "Prefill calls served, by result",
            &[
                (&[("result", "ok")], l(&c.ok)),
                (&[("result", "failed")], l(&c.failed)),
                (&[("result", "cancelled")], l(&c.cancelled)),
            ],
        )?;
        counter(
            &mut enc,
            "tandem_prefill_tokens",
            "Prompt tokens prefilled for decode workers",
            &[(&[], l(&c.prefilled_tokens))],
        )?;
        counter(
            &mut enc,
            "tandem_kv_transfer_sent_bytes",
            "KV payload bytes sent to decode workers",
            &[(&[], l(&c.bytes_sent))],
        )
    }
}

/// Serves `service` (plus grpc.health.v1 and `/metrics`) on `listener` until `signal`, then
/// drains for up to `drain_deadline`.
pub async fn serve(
    listener: TcpListener,
    service: PrefillService,
    shutdown: Shutdown,
    signal: impl std::future::Future<Output = ()> + Send,
    drain_deadline: Duration,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<PrefillServer<PrefillService>>()
        .await;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let drained = async move {
        signal.await;
        reporter
            .set_not_serving::<PrefillServer<PrefillService>>()
            .await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let left = shutdown.drain(drain_deadline).await;
        if left > 0 {
            tracing::warn!(left, "drain deadline passed with prefills still running");
        }
    };
    let metrics = tandem_decode_worker::metrics::router(Metrics(service.shared.clone()));
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .tcp_nodelay(true)
        .accept_http1(true)
        .add_routes(tonic::service::Routes::from(metrics))
        .add_service(health)
        .add_service(PrefillServer::new(service))
        .serve_with_incoming_shutdown(incoming, drained)
        .await
}
