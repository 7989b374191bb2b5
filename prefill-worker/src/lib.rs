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
//! answers with is made from an [`ErrorKind`] (`tandem_proto::wire::status`), so its codes are
//! the ones every other path uses for the same fault.

#![deny(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::histogram::Histogram;
use tandem_engine::{
    BlockId, EngineHandle, ErrorKind, KvChunk, Request, StreamEvent, ValidSampling,
};
use tandem_kv_transfer::{BlockFrame, KvShape, KvStream, KvTransport};
use tandem_proto::wire::{sampling_from_wire, status as fail};
use tandem_proto::worker::{self as pb, prefill_server::PrefillServer};
use tandem_telemetry::OpenTelemetrySpanExt;
use tandem_worker::convert::{status, BoxStream};
use tandem_worker::metrics::{
    counter, engine_metrics, gauge, seconds, seconds_counter, RequestMetrics,
};
use tandem_worker::trace;
pub use tandem_worker::WorkerIdentity;
use tandem_worker::{ControlService, Drain, InFlight};
use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::{Request as GrpcRequest, Response, Status};
use tracing::Instrument;

/// Counted since start, for `/metrics`.
#[derive(Debug)]
pub struct PrefillCounts {
    /// Calls whose KV all arrived and whose first token went back.
    pub ok: AtomicU64,
    /// Calls that failed (the engine, the KV send).
    pub failed: AtomicU64,
    /// Calls whose caller went away first.
    pub cancelled: AtomicU64,
    /// Calls turned away up front because the queue would hold them too long.
    pub refused: AtomicU64,
    /// Prompt tokens this worker computed.
    pub prefilled_tokens: AtomicU64,
    /// KV payload bytes sent to decode workers.
    pub bytes_sent: AtomicU64,
    /// Per prefill, seconds from connecting to its decode worker to its last frame sent.
    pub send_duration: Histogram,
    /// Nanoseconds prefills waited for the link to take their KV frames.
    pub send_blocked_ns: AtomicU64,
}

impl Default for PrefillCounts {
    fn default() -> Self {
        Self {
            ok: AtomicU64::default(),
            failed: AtomicU64::default(),
            cancelled: AtomicU64::default(),
            refused: AtomicU64::default(),
            prefilled_tokens: AtomicU64::default(),
            bytes_sent: AtomicU64::default(),
            send_duration: tandem_worker::metrics::latency_histogram(),
            send_blocked_ns: AtomicU64::default(),
        }
    }
}

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

/// One admitted prefill: counted in flight, its unsent tokens counted as queued, until dropped.
struct Admitted {
    shared: Arc<Shared>,
    unsent: u64,
    _in_flight: InFlight,
}

impl Admitted {
    /// `tokens` more of the prompt went out (a chunk's last block may be partly prompt: counted
    /// up to what is left).
    fn sent(&mut self, tokens: u64) {
        let t = tokens.min(self.unsent);
        self.unsent -= t;
        self.shared.queued_tokens.fetch_sub(t, Ordering::SeqCst);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.shared
            .queued_tokens
            .fetch_sub(self.unsent, Ordering::SeqCst);
    }
}

/// Why a prefill stopped before its answer.
enum Stop {
    /// The caller went away (cancelled, or gave up on this worker).
    Gone,
    Failed(Status),
}

impl From<Status> for Stop {
    fn from(s: Status) -> Self {
        Stop::Failed(s)
    }
}

type Updates = tokio::sync::mpsc::Sender<Result<pb::PrefillUpdate, Status>>;

fn update(u: pb::prefill_update::Update) -> Result<pb::PrefillUpdate, Status> {
    Ok(pb::PrefillUpdate { update: Some(u) })
}

/// What a call asks for, checked before anything is admitted.
struct Checked {
    dest: pb::KvDestination,
    cached: usize,
    uncached: usize,
    sampling: ValidSampling,
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
        let shape = tandem_worker::kv_shape(&identity.model, &engine.kv_writers());
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

impl Shared {
    fn check(&self, req: &pb::PrefillRequest) -> Result<Checked, Status> {
        let dest = req
            .destination
            .clone()
            .ok_or_else(|| fail(ErrorKind::InvalidRequest, "no KV destination"))?;
        let bs = self.engine.limits().block_size;
        let cached = req.cached_tokens as usize;
        let prompt_len = req.prompt_ids.len();
        if !cached.is_multiple_of(bs) || cached >= prompt_len {
            return Err(fail(ErrorKind::InvalidRequest, format!(
                "cached_tokens {cached} must be a multiple of the block size {bs} below the prompt length {prompt_len}"
            )));
        }
        let want_blocks = prompt_len.div_ceil(bs) - cached / bs;
        if dest.block_ids.len() != want_blocks {
            return Err(fail(
                ErrorKind::InvalidRequest,
                format!(
                "{} destination blocks for {} tokens after {cached} cached: {want_blocks} needed",
                dest.block_ids.len(),
                prompt_len - cached
            ),
            ));
        }
        // A prefill samples the first token and stops.
        let one = pb::Stopping {
            max_tokens: 1,
            ..Default::default()
        };
        let sampling = sampling_from_wire(req.sampling.clone(), Some(one))
            .validate()
            .map_err(|e| status(e.into()))?;
        Ok(Checked {
            dest,
            cached,
            uncached: prompt_len - cached,
            sampling,
        })
    }

    /// Admits `uncached` tokens unless the queue ahead would hold them past the limit; returns
    /// the admission and the tokens queued ahead of it.
    fn admit(self: &Arc<Self>, uncached: usize) -> Result<(Admitted, u64), Status> {
        let in_flight = self
            .drain
            .enter()
            .map_err(|m| fail(ErrorKind::Unavailable, m))?;
        let rate = self.engine.stats().prefill_tokens_per_s;
        let limit = self.limits.max_queue_wait.as_secs_f64();
        let uncached = uncached as u64;
        let mut ahead = self.queued_tokens.load(Ordering::SeqCst);
        loop {
            let wait = ahead as f64 / rate;
            if rate > 0.0 && ahead > 0 && wait > limit {
                self.counts.refused.fetch_add(1, Ordering::Relaxed);
                return Err(fail(ErrorKind::Busy, format!(
                    "prefill queue full: {ahead} prompt tokens ahead, about {wait:.1} s at {rate:.0} tokens/s (limit {limit:.1} s); try another worker"
                )));
            }
            match self.queued_tokens.compare_exchange(
                ahead,
                ahead + uncached,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(now) => ahead = now,
            }
        }
        Ok((
            Admitted {
                shared: self.clone(),
                unsent: uncached,
                _in_flight: in_flight,
            },
            ahead,
        ))
    }

    /// Tells the caller this worker is alive and the rate it computes at; `Gone` when the caller
    /// has gone. A full channel means the caller has not read the last beats yet: it will see
    /// this worker's progress in the next one.
    fn beat(&self, tx: &Updates) -> Result<(), Stop> {
        let progress = pb::PrefillProgress {
            tokens_per_second: self.engine.stats().prefill_tokens_per_s,
        };
        match tx.try_send(update(pb::prefill_update::Update::Progress(progress))) {
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => Err(Stop::Gone),
            _ => Ok(()),
        }
    }

    /// Runs one admitted prefill: engine chunks out to the destination as they come, heartbeats
    /// to the caller while it works (and while the link takes its KV), then the answer.
    async fn run(
        &self,
        req: pb::PrefillRequest,
        checked: Checked,
        admitted: &mut Admitted,
        ahead: u64,
        tx: &Updates,
    ) -> Result<(), Stop> {
        let Checked {
            dest,
            cached,
            uncached,
            sampling,
        } = checked;
        let bs = self.engine.limits().block_size;
        let server = tracing::Span::current();
        let prefill = tracing::info_span!(
            parent: &server,
            "prefill",
            gen_ai.usage.input_tokens = req.prompt_ids.len() as i64,
            tandem.prefill.computed_tokens = uncached as i64,
            tandem.prefill.cached_tokens = cached as i64,
            tandem.prefill.queued_tokens_ahead = ahead as i64,
        );
        let submitted = SystemTime::now();
        let request = self
            .engine
            .compile(Request::new(req.prompt_ids, sampling))
            .await
            .map_err(status)?;
        let mut stream = self
            .engine
            .submit_prefill(request, cached)
            .map_err(status)?;
        let stats = self.engine.stats();
        tx.send(update(pb::prefill_update::Update::Accepted(
            pb::PrefillAccepted {
                queued_tokens: ahead,
                tokens_per_second: stats.prefill_tokens_per_s,
            },
        )))
        .await
        .map_err(|_| Stop::Gone)?;
        let mut kv = KvSpan::new(&prefill, &dest.endpoint, dest.block_ids.len());
        let connecting = Instant::now();
        let mut conn: Box<dyn KvStream> = self
            .transport
            .open(&dest.endpoint, dest.transfer_id)
            .await
            .map_err(|e| {
                fail(
                    ErrorKind::Unavailable,
                    format!("cannot reach the KV endpoint {}: {e}", dest.endpoint),
                )
            })?;
        // A receiver whose cache cannot take this one's: the receiver refuses it too when this
        // side describes its cache, but a transport that does not is caught here.
        if let (Some(mine), Some(peer)) = (self.shape.as_ref(), conn.peer()) {
            if let Some(why) = mine.mismatch(peer) {
                return Err(fail(
                    ErrorKind::Unsupported,
                    format!("KV caches do not map ({}): {why}", dest.endpoint),
                )
                .into());
            }
        }
        let send_err = |e| {
            fail(
                ErrorKind::Unavailable,
                format!("sending KV to {}: {e}", dest.endpoint),
            )
        };
        if let Some(cx) = tandem_telemetry::context_text(&kv.span) {
            conn.context(dest.transfer_id, &cx)
                .await
                .map_err(send_err)?;
        }
        let mut first = None;
        let mut sent = 0u64;
        let mut beat = tokio::time::interval(HEARTBEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                _ = beat.tick() => {
                    self.beat(tx)?;
                    continue;
                }
                _ = tx.closed() => return Err(Stop::Gone),
            };
            let Some(ev) = ev else { break };
            match ev {
                StreamEvent::Kv(c) => {
                    let want = conn.peer().map(|p| p.pieces.clone());
                    let regrouped = match regroup_for(&c, want.as_deref(), self.shape.as_ref()) {
                        Ok(r) => r,
                        Err(why) => {
                            let _ = conn.abort(dest.transfer_id).await;
                            return Err(fail(
                                ErrorKind::Unsupported,
                                format!("cannot send KV to {}: {why}", dest.endpoint),
                            )
                            .into());
                        }
                    };
                    let frames = chunk_frames(&c, &dest.block_ids, &regrouped);
                    let sending = Instant::now();
                    // Beats go on while a slow link takes the frames: the caller hears that
                    // this worker is alive, and its rate, whatever the link's speed.
                    let send = conn.send_blocks(dest.transfer_id, &frames);
                    tokio::pin!(send);
                    let sent_them = loop {
                        tokio::select! {
                            r = &mut send => break r,
                            _ = beat.tick() => self.beat(tx)?,
                            _ = tx.closed() => return Err(Stop::Gone),
                        }
                    };
                    let blocked = u64::try_from(sending.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    self.counts
                        .send_blocked_ns
                        .fetch_add(blocked, Ordering::Relaxed);
                    sent_them.map_err(send_err)?;
                    sent += frames.iter().map(|f| f.payload.len() as u64).sum::<u64>();
                    kv.bytes = sent;
                    admitted.sent((c.blocks * bs) as u64);
                }
                StreamEvent::Token(t) => first = Some(t),
                StreamEvent::Finished(f) => {
                    self.requests.finished(&f);
                    if let Some(e) = f.error {
                        // The first token's grammar could not go on: the request fails.
                        let _ = conn.abort(dest.transfer_id).await;
                        return Err(fail(ErrorKind::InvalidRequest, e).into());
                    }
                    tandem_worker::trace::finished(&server, submitted, &f, false);
                    tandem_telemetry::record_past(
                        &prefill.context(),
                        "queue",
                        submitted,
                        submitted + Duration::from_secs_f64(f.queue_s.max(0.0)),
                        Vec::new(),
                    );
                    break;
                }
                StreamEvent::Failed(e) => {
                    let _ = conn.abort(dest.transfer_id).await;
                    return Err(status(e).into());
                }
            }
        }
        let first =
            first.ok_or_else(|| fail(ErrorKind::Internal, "the engine stopped mid-prefill"))?;
        conn.end(dest.transfer_id).await.map_err(send_err)?;
        self.counts
            .send_duration
            .observe(connecting.elapsed().as_secs_f64());
        kv.done();
        self.counts.bytes_sent.fetch_add(sent, Ordering::Relaxed);
        self.counts
            .prefilled_tokens
            .fetch_add(uncached as u64, Ordering::Relaxed);
        tx.send(update(pb::prefill_update::Update::Done(
            pb::PrefillResponse {
                first_token: Some(tandem_worker::convert::token(&first)),
                prefilled_tokens: uncached as u32,
                cached_tokens: cached as u32,
            },
        )))
        .await
        .map_err(|_| Stop::Gone)
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

/// The span of one KV push: bytes as they go out, the result when it ends (a push dropped before
/// [`KvSpan::done`] failed).
struct KvSpan {
    span: tracing::Span,
    bytes: u64,
    ok: bool,
}

impl KvSpan {
    fn new(parent: &tracing::Span, endpoint: &str, blocks: usize) -> Self {
        let span = tracing::info_span!(
            parent: parent,
            "kv_transfer",
            otel.kind = "producer",
            otel.status_code = tracing::field::Empty,
            server.address = %endpoint,
            tandem.kv.blocks = blocks as i64,
            tandem.kv.bytes = tracing::field::Empty,
            tandem.kv.result = tracing::field::Empty,
        );
        Self {
            span,
            bytes: 0,
            ok: false,
        }
    }

    fn done(&mut self) {
        self.ok = true;
    }
}

impl Drop for KvSpan {
    fn drop(&mut self) {
        self.span.record("tandem.kv.bytes", self.bytes as i64);
        self.span
            .record("tandem.kv.result", if self.ok { "ok" } else { "failed" });
        if !self.ok {
            self.span.record("otel.status_code", "error");
        }
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
        let stats = s.engine.stats();
        engine_metrics(&mut enc, &stats, &s.engine.limits())?;
        s.requests.encode(&mut enc, &stats)?;
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
                (&[("result", "refused")], l(&c.refused)),
            ],
        )?;
        gauge(
            &mut enc,
            "tandem_prefill_in_flight",
            "Prefill calls admitted and not yet finished (their KV sends included)",
            &[(&[], s.drain.in_flight() as i64)],
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
        )?;
        seconds(
            &mut enc,
            "tandem_kv_send_duration",
            "Time from connecting to a decode worker to the last KV frame of a prefill sent (its computing included: frames go as the prompt is computed)",
            &c.send_duration,
        )?;
        seconds_counter(
            &mut enc,
            "tandem_kv_send_blocked",
            "Time prefills waited for the link to take their KV frames (it grows when the link is slower than computing)",
            l(&c.send_blocked_ns) as f64 / 1e9,
        )
    }
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

/// What a receiver takes of each block layer: frames of its ranks' KV head ranges, each either a
/// piece of the chunk as it is (the two sides' ranks hold the same heads) or rebuilt from the
/// chunk's pieces; or one whole-block frame, for a receiver that described no ranges.
struct Regrouped {
    /// Per frame of a block layer: the header's heads, and the chunk piece it is, if one is.
    targets: Vec<(std::ops::Range<u16>, Option<usize>)>,
    /// The rebuilt frames, `[block][layer][target]` over the targets that are no piece.
    built: Vec<Vec<u8>>,
}

/// Plans (and rebuilds where needed) chunk `c`'s frames for a receiver taking head ranges
/// `want` (None: whole blocks), with this worker's cache `mine` for the layout; or why the
/// chunk cannot make them (a receiver whose heads this worker's pieces do not cover).
fn regroup_for(
    c: &KvChunk,
    want: Option<&[std::ops::Range<u32>]>,
    mine: Option<&KvShape>,
) -> Result<Regrouped, String> {
    let all =
        c.pieces.first().map_or(0, |p| p.heads.start)..c.pieces.last().map_or(0, |p| p.heads.end);
    let ranges: Vec<(std::ops::Range<u16>, std::ops::Range<u32>)> = match want {
        Some(w) if !w.is_empty() => w
            .iter()
            .map(|r| {
                let h = u16::try_from(r.start).and_then(|s| Ok(s..u16::try_from(r.end)?));
                h.map(|h| (h, r.clone()))
                    .map_err(|_| format!("KV heads {r:?} do not fit a frame header"))
            })
            .collect::<Result<_, _>>()?,
        _ => vec![(0..0, all)],
    };
    let targets: Vec<(std::ops::Range<u16>, Option<usize>, std::ops::Range<u32>)> = ranges
        .into_iter()
        .map(|(h, r)| {
            let direct = c.pieces.iter().position(|p| p.heads == r);
            (h, direct, r)
        })
        .collect();
    let mut built = Vec::new();
    if targets.iter().any(|(_, direct, _)| direct.is_none()) {
        let shape = mine.ok_or("this worker has no host cache to rebuild KV heads from")?;
        for j in 0..c.blocks {
            for layer in 0..c.layers() {
                let have: Vec<(std::ops::Range<u32>, &[u8])> = c
                    .pieces
                    .iter()
                    .map(|p| (p.heads.clone(), p.frame(layer, j)))
                    .collect();
                for (_, direct, r) in &targets {
                    if direct.is_none() {
                        let frame = tandem_kv_transfer::regroup(shape, &have, r.clone())
                            .ok_or_else(|| format!("this worker's KV does not hold heads {r:?}"))?;
                        built.push(frame);
                    }
                }
            }
        }
    }
    Ok(Regrouped {
        targets: targets.into_iter().map(|(h, d, _)| (h, d)).collect(),
        built,
    })
}

/// Chunk `c`'s block frames to destination blocks `dest` (the receiver's ids of the prompt's
/// blocks), block after block, layer after layer, as `g` planned them.
fn chunk_frames<'a>(c: &'a KvChunk, dest: &[u32], g: &'a Regrouped) -> Vec<BlockFrame<'a>> {
    let mut built = g.built.iter();
    let mut frames = Vec::with_capacity(c.blocks * c.layers() * g.targets.len());
    for j in 0..c.blocks {
        let block = BlockId(dest[c.first + j]);
        for layer in 0..c.layers() {
            for (heads, direct) in &g.targets {
                let payload = match direct {
                    Some(p) => c.pieces[*p].frame(layer, j),
                    None => built.next().map_or(&[][..], |b| &b[..]),
                };
                frames.push(BlockFrame {
                    layer: layer as u32,
                    block,
                    heads: heads.clone(),
                    payload,
                });
            }
        }
    }
    frames
}

#[cfg(test)]
// Lists of KV head ranges with a single range (every head) are what these tests mean.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use tandem_engine::{KvPiece, RequestId};

    fn shape() -> KvShape {
        KvShape {
            model: "m".into(),
            layers: 2,
            kv_heads: 3,
            head_dim: 4,
            block_size: 2,
            dtype: "f32".into(),
            pieces: vec![0..1, 1..2, 2..3],
        }
    }

    /// A chunk of two blocks from a worker whose three ranks hold one head each.
    fn chunk(s: &KvShape) -> KvChunk {
        let len = s.frame_len(1);
        let pieces = (0..3u32)
            .map(|h| KvPiece {
                heads: h..h + 1,
                layers: (0..2)
                    .map(|l| {
                        (0..2 * len)
                            .map(|i| (i as u32 + 100 * h + 7 * l) as u8)
                            .collect()
                    })
                    .collect(),
                frame_len: len,
            })
            .collect();
        KvChunk {
            request: RequestId(1),
            first: 0,
            blocks: 2,
            pieces,
        }
    }

    /// Frames for receivers of other sizes: a matching range goes as the piece itself, others
    /// are rebuilt (whole blocks for a receiver of one rank or of no ranges); heads the chunk
    /// does not hold are refused.
    #[test]
    fn frames_follow_the_receivers_head_ranges() {
        let s = shape();
        let c = chunk(&s);
        let dest = [10, 11];
        let g = regroup_for(&c, Some(&[0..1, 1..3]), Some(&s)).unwrap();
        let frames = chunk_frames(&c, &dest, &g);
        // Two blocks × two layers × two ranges, block-major.
        assert_eq!(frames.len(), 8);
        assert_eq!(
            (frames[0].heads.clone(), frames[0].block),
            (0..1, BlockId(10))
        );
        assert_eq!(frames[0].payload, c.pieces[0].frame(0, 0));
        assert_eq!(frames[1].heads, 1..3);
        let have: Vec<(std::ops::Range<u32>, &[u8])> = c
            .pieces
            .iter()
            .map(|p| (p.heads.clone(), p.frame(0, 0)))
            .collect();
        assert_eq!(
            Some(frames[1].payload.to_vec()),
            tandem_kv_transfer::regroup(&s, &have, 1..3)
        );
        assert_eq!((frames[7].layer, frames[7].block), (1, BlockId(11)));
        for want in [None, Some(&[0..3][..])] {
            let g = regroup_for(&c, want, Some(&s)).unwrap();
            let frames = chunk_frames(&c, &dest, &g);
            assert_eq!(frames.len(), 4);
            assert!(frames.iter().all(|f| f.payload.len() == s.frame_len(3)));
            let heads = if want.is_none() { 0..0 } else { 0..3 };
            assert!(frames.iter().all(|f| f.heads == heads));
        }
        let e = regroup_for(&c, Some(&[0..4]), Some(&s)).err().unwrap();
        assert!(e.contains("does not hold heads 0..4"), "{e}");
        let e = regroup_for(&c, Some(&[0..3]), None).err().unwrap();
        assert!(e.contains("no host cache"), "{e}");
    }
}
