//! The decode side of a disaggregated prefill (DESIGN.md §2, steps 4-6).
//!
//! The engine has already reserved blocks for the prompt (reusing this worker's prefix cache), so
//! only the uncached tail is asked for. For each candidate prefill worker in the router's order:
//! grant the blocks to a fresh transfer on this worker's [`KvReceiver`], call `Prefill` with the
//! destination, and wait for both the answer (the first token) and every block to arrive intact.
//! A candidate that refuses (its queue is full), dies, stops making progress or sends a bad frame
//! costs that attempt only: the grant is revoked (late frames are rejected) and the next candidate gets a new one.
//! When none succeeds the caller prefills locally in the blocks it holds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use prometheus_client::metrics::histogram::Histogram;
use tandem_engine::{KvPoolWriter, Reservation, Sampled};
use tandem_kv_transfer::{
    BlockSink, KvReceiver, Secret, TransferError, TransferGrant, TransferStats,
};
use tandem_proto::worker::{self as pb, prefill_client::PrefillClient};
use tandem_telemetry::Attribute;
use tonic::transport::{Channel, Endpoint};

use tandem_worker::PoolSink;

/// How remote prefills ended, counted since start.
#[derive(Debug)]
pub struct RemoteCounts {
    /// Attempts whose blocks all arrived and whose first token came back.
    pub transfers_ok: AtomicU64,
    /// Attempts that failed (prefill worker error, stall, bad frame); the next candidate is tried.
    pub transfers_failed: AtomicU64,
    /// Attempts the prefill worker turned away up front (its queue was full); the next candidate
    /// is tried at once.
    pub transfers_refused: AtomicU64,
    /// Requests prefilled here after every candidate failed.
    pub fallbacks: AtomicU64,
    /// Remote plans taken locally because the pool had no room to reserve the prompt now.
    pub no_room: AtomicU64,
    /// Failed attempts by [`Failure`] (indexed by its value).
    pub failures: [AtomicU64; 4],
    /// Seconds from granting blocks to a transfer to the last of them arriving, per completed
    /// transfer (the prefill worker's compute included: blocks leave as chunks finish).
    pub duration: Histogram,
}

impl Default for RemoteCounts {
    fn default() -> Self {
        Self {
            transfers_ok: AtomicU64::new(0),
            transfers_failed: AtomicU64::new(0),
            transfers_refused: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            no_room: AtomicU64::new(0),
            failures: Default::default(),
            duration: tandem_worker::metrics::latency_histogram(),
        }
    }
}

/// This worker's KV ingress: the receiver, the address prefill workers reach it at, and the
/// `Prefill` clients.
pub struct RemotePrefill {
    receiver: KvReceiver,
    endpoint: String,
    sink: Arc<PoolSink>,
    deadlines: Deadlines,
    clients: Mutex<HashMap<String, PrefillClient<Channel>>>,
    /// What remote prefill has done since start.
    pub counts: RemoteCounts,
}

impl RemotePrefill {
    /// Listens for KV on `bind` (`host:port`, port 0 picks one); prefill workers are told to send
    /// to `advertise_host` and the bound port. Each attempt lives while the prefill worker makes
    /// progress, within `deadlines`.
    ///
    /// The receiver describes the cache `writers` write into (every tensor-parallel rank's pool
    /// of a worker serving `model`, as `EngineHandle::kv_writers` gives them) in its handshake:
    /// senders with a cache that does not map are refused with the reason, and the others send
    /// each rank's KV heads.
    ///
    /// # Safety
    /// `writers` must belong to the engine whose reservations are passed to [`Self::prefill`]:
    /// only reserved (parked) blocks are ever granted, which the engine leaves alone.
    pub async unsafe fn bind(
        bind: &str,
        advertise_host: &str,
        secret: Secret,
        model: &str,
        writers: Vec<(std::ops::Range<u32>, KvPoolWriter)>,
        deadlines: Deadlines,
    ) -> Result<Self, TransferError> {
        let shape = tandem_worker::kv_shape(model, &writers).ok_or_else(|| {
            TransferError::Config("a KV receiver needs the engine's host pools".into())
        })?;
        let receiver = KvReceiver::bind_with(bind, secret, Some(shape)).await?;
        let endpoint = format!("{advertise_host}:{}", receiver.local_addr().port());
        Ok(Self {
            receiver,
            endpoint,
            // SAFETY: forwarded to the caller (see above).
            sink: Arc::new(unsafe { PoolSink::new(writers) }),
            deadlines,
            clients: Mutex::new(HashMap::new()),
            counts: RemoteCounts::default(),
        })
    }

    /// The KV receiver's address as prefill workers are told it.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The KV receiver transfers arrive at.
    pub fn receiver(&self) -> &KvReceiver {
        &self.receiver
    }

    /// Bytes received into each tensor-parallel rank's pool so far, in rank order.
    pub fn rank_bytes(&self) -> Vec<u64> {
        self.sink.rank_bytes()
    }

    fn client(&self, addr: &str) -> Result<PrefillClient<Channel>, String> {
        let mut clients = self.clients.lock().expect("clients");
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad prefill worker address {addr:?}: {e}"))?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(20));
        let c = PrefillClient::new(endpoint.connect_lazy());
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Fills `reservation` from the candidates in order; the first token on success, `None` when
    /// every candidate failed. `grant` holds the live attempt's grant: the caller keeps it in a
    /// place that drops before the engine request, so blocks are revoked before they are freed.
    pub async fn prefill(
        &self,
        request_id: &str,
        prompt: &[u32],
        sampling: pb::Sampling,
        reservation: &Reservation,
        candidates: &[String],
        grant: &mut Option<TransferGrant>,
    ) -> Option<Sampled> {
        let ask = Ask {
            request_id,
            prompt,
            sampling: &sampling,
            reservation,
        };
        for addr in candidates {
            let span = tracing::info_span!(
                "prefill_attempt",
                otel.name = "tandem.worker.v1.Prefill/Prefill",
                otel.kind = "client",
                otel.status_code = tracing::field::Empty,
                otel.status_description = tracing::field::Empty,
                rpc.system = "grpc",
                rpc.service = "tandem.worker.v1.Prefill",
                rpc.method = "Prefill",
                server.address = %addr,
                tandem.prefill.result = tracing::field::Empty,
            );
            let r = self.attempt(addr, &ask, grant, &span).await;
            let result = match &r {
                Ok(_) => "ok",
                Err(Attempt::Refused(_)) => "refused",
                Err(Attempt::Failed(why, e)) => {
                    tandem_worker::trace::failed(&span, e);
                    self.counts.failures[*why as usize].fetch_add(1, Ordering::Relaxed);
                    why.as_str()
                }
            };
            span.record("tandem.prefill.result", result);
            match r {
                Ok(first) => {
                    self.counts.transfers_ok.fetch_add(1, Ordering::Relaxed);
                    return Some(first);
                }
                Err(Attempt::Refused(e)) => {
                    self.counts
                        .transfers_refused
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::info!(request = request_id, prefill = %addr, reason = %e, "prefill worker busy; trying the next candidate");
                }
                Err(Attempt::Failed(_, e)) => {
                    self.counts.transfers_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(request = request_id, prefill = %addr, error = %e, "remote prefill failed; trying the next candidate");
                }
            }
            // Revoke before anything else may touch the blocks.
            *grant = None;
        }
        *grant = None;
        self.counts.fallbacks.fetch_add(1, Ordering::Relaxed);
        None
    }

    async fn attempt(
        &self,
        addr: &str,
        ask: &Ask<'_>,
        grant: &mut Option<TransferGrant>,
        span: &tracing::Span,
    ) -> Result<Sampled, Attempt> {
        let Ask {
            request_id,
            prompt,
            sampling,
            reservation,
        } = *ask;
        let mut client = self
            .client(addr)
            .map_err(|e| Attempt::Failed(Failure::Unreachable, e))?;
        let granted = Instant::now();
        let g = grant.insert(
            self.receiver
                .grant_open(&reservation.blocks, self.sink.clone() as Arc<dyn BlockSink>),
        );
        let uncached = prompt.len() - reservation.cached_tokens;
        let mut call = tonic::Request::new(pb::PrefillRequest {
            request_id: request_id.to_string(),
            prompt_ids: prompt.to_vec(),
            cached_tokens: reservation.cached_tokens as u32,
            destination: Some(pb::KvDestination {
                endpoint: self.endpoint.clone(),
                transfer_id: g.id(),
                block_ids: reservation.blocks.iter().map(|b| b.0).collect(),
            }),
            sampling: Some(sampling.clone()),
        });
        tandem_telemetry::inject(span, call.metadata_mut().as_mut());
        let mut watch = Progress::new(self.deadlines, uncached);
        // Opening the call waits for the worker's admission; it too must not hang.
        let mut updates = tokio::select! {
            r = client.prefill(call) => r.map_err(|s| match s.code() {
                tonic::Code::ResourceExhausted => Attempt::Refused(s.message().to_string()),
                tonic::Code::Unavailable => Attempt::Failed(Failure::Unreachable, s.message().to_string()),
                c => Attempt::Failed(Failure::PrefillError, format!("{c}: {}", s.message())),
            })?.into_inner(),
            _ = tokio::time::sleep_until(watch.give_up_at()) => return Err(watch.stalled()),
        };
        let mut first: Option<Sampled> = None;
        let mut arrived = false;
        let mut check = tokio::time::interval(PROGRESS_CHECK);
        while first.is_none() || !arrived {
            tokio::select! {
                m = updates.message(), if first.is_none() => {
                    let u = m
                        .map_err(|s| prefill_error(format!("{}: {}", s.code(), s.message())))?
                        .ok_or_else(|| prefill_error("the prefill worker ended the call without a first token"))?;
                    match u.update {
                        Some(pb::prefill_update::Update::Accepted(a)) => watch.accepted(&a),
                        Some(pb::prefill_update::Update::Progress(p)) => watch.beat(&p),
                        Some(pb::prefill_update::Update::Done(r)) => {
                            let t = r.first_token.ok_or_else(|| prefill_error("the prefill worker sent no first token"))?;
                            first = Some(Sampled {
                                token: t.id,
                                logprob: t.logprob,
                                top: t.top.iter().map(|x| (x.id, x.logprob)).collect(),
                            });
                        }
                        None => {}
                    }
                }
                r = g.wait(), if !arrived => {
                    let stats = r.map_err(|e| Attempt::Failed(Failure::Transfer, e.to_string()))?;
                    self.counts.duration.observe(granted.elapsed().as_secs_f64());
                    received(span, &stats, reservation.blocks.len());
                    arrived = true;
                }
                _ = check.tick() => watch.frames(g.frames_received()),
                _ = tokio::time::sleep_until(watch.give_up_at()) => return Err(watch.stalled()),
            }
        }
        Ok(first.expect("loop ends with the first token"))
    }
}

/// Records the receiving side of a completed transfer as a span under the sender's transfer span
/// (its context came over the KV wire), or under this attempt's when the sender sent none.
fn received(attempt: &tracing::Span, stats: &TransferStats, blocks: usize) {
    use tandem_telemetry::OpenTelemetrySpanExt;
    if attempt.is_disabled() {
        return;
    }
    let parent = stats
        .context
        .as_deref()
        .and_then(tandem_telemetry::from_context_text)
        .unwrap_or_else(|| attempt.context());
    let now = SystemTime::now();
    tandem_telemetry::record_past(
        &parent,
        "kv_receive",
        stats.first_frame.unwrap_or(now),
        now,
        vec![
            Attribute::new("tandem.kv.bytes", stats.bytes as i64),
            Attribute::new("tandem.kv.frames", stats.frames as i64),
            Attribute::new("tandem.kv.blocks", blocks as i64),
        ],
    );
}

/// What every candidate is asked for.
#[derive(Clone, Copy)]
struct Ask<'a> {
    request_id: &'a str,
    prompt: &'a [u32],
    sampling: &'a pb::Sampling,
    reservation: &'a Reservation,
}

/// How one candidate's attempt ended, when it did not succeed.
enum Attempt {
    /// Turned away before any work (RESOURCE_EXHAUSTED): busy, not broken.
    Refused(String),
    /// Failed for the reason given, with what went wrong.
    Failed(Failure, String),
}

/// Why a remote prefill attempt failed, as `tandem_kv_transfer_failures_total` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The prefill worker could not be reached (bad address, connection refused, gone).
    Unreachable = 0,
    /// The prefill worker answered with an error or broke the call's protocol.
    PrefillError = 1,
    /// No word from the prefill worker within its progress deadline.
    Stalled = 2,
    /// The KV transfer itself failed: a frame refused, an abort, blocks missing at its end.
    Transfer = 3,
}

impl Failure {
    /// Every reason, in index order.
    pub const ALL: [Failure; 4] = [
        Failure::Unreachable,
        Failure::PrefillError,
        Failure::Stalled,
        Failure::Transfer,
    ];

    /// The reason's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Unreachable => "unreachable",
            Failure::PrefillError => "prefill_error",
            Failure::Stalled => "stalled",
            Failure::Transfer => "transfer",
        }
    }
}

fn prefill_error(e: impl Into<String>) -> Attempt {
    Attempt::Failed(Failure::PrefillError, e.into())
}

/// How often an attempt looks at the frames that arrived for it.
const PROGRESS_CHECK: Duration = Duration::from_millis(100);

/// Deadlines of a remote prefill, tied to the prefill worker's progress and its own measured
/// speed: a frozen, dead or unreachable worker is left after [`Deadlines::stall`] without a word
/// from it (it sends a heartbeat every 250 ms while it works, whatever its speed), and a live one
/// gets [`Deadlines::slack`] times the time its queue and this prompt take at the rate it
/// measured, so a slow machine is given proportionally longer.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// How long an attempt may go without a heartbeat or a KV frame.
    pub stall: Duration,
    /// Multiplier on the prefill worker's expected time for the work ahead of and in this prompt.
    pub slack: f64,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self {
            stall: Duration::from_secs(5),
            slack: 4.0,
        }
    }
}

/// What an attempt has seen of the prefill worker, and when it gives up.
struct Progress {
    d: Deadlines,
    uncached: usize,
    started: Instant,
    /// Last word from the worker: an update on the call or a KV frame.
    last: Instant,
    frames: u64,
    /// Tokens queued ahead of this prompt when the worker accepted it.
    queued: u64,
    /// Bound on the whole attempt, once the worker has told its rate.
    total: Option<(Instant, String)>,
}

impl Progress {
    fn new(d: Deadlines, uncached: usize) -> Self {
        let now = Instant::now();
        Self {
            d,
            uncached,
            started: now,
            last: now,
            frames: 0,
            queued: 0,
            total: None,
        }
    }

    fn heard(&mut self) {
        self.last = Instant::now();
    }

    fn accepted(&mut self, a: &pb::PrefillAccepted) {
        self.heard();
        self.queued = a.queued_tokens;
        self.rate(a.tokens_per_second);
    }

    fn beat(&mut self, p: &pb::PrefillProgress) {
        self.heard();
        self.rate(p.tokens_per_second);
    }

    /// Bounds the attempt by the worker's rate, the first time it has one (a worker that has not
    /// computed anything yet learns it on its first step).
    fn rate(&mut self, tokens_per_second: f64) {
        if self.total.is_some() || tokens_per_second.is_nan() || tokens_per_second <= 0.0 {
            return;
        }
        let tokens = self.queued as f64 + self.uncached as f64;
        let secs = self.d.stall.as_secs_f64() + self.d.slack * tokens / tokens_per_second;
        self.total = Some((
            self.started + Duration::from_secs_f64(secs.min(1e7)),
            format!(
                "not done within {secs:.1} s ({tokens} tokens at the worker's {tokens_per_second:.0} tokens/s, slack {}x)",
                self.d.slack
            ),
        ));
    }

    fn frames(&mut self, n: u64) {
        if n > self.frames {
            self.frames = n;
            self.heard();
        }
    }

    fn give_up_at(&self) -> tokio::time::Instant {
        let silent = self.last + self.d.stall;
        let at = match &self.total {
            Some((t, _)) => silent.min(*t),
            None => silent,
        };
        at.into()
    }

    fn stalled(&self) -> Attempt {
        Attempt::Failed(Failure::Stalled, self.why())
    }

    fn why(&self) -> String {
        let now = Instant::now();
        match &self.total {
            Some((t, why)) if *t <= now => why.clone(),
            _ => format!(
                "no word from the prefill worker for {:.1} s (no heartbeat, no KV frame)",
                (now - self.last).as_secs_f64()
            ),
        }
    }
}
