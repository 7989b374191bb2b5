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
use tandem_engine::{Reservation, Sampled};
use tandem_kv_transfer::{KvReceiver, Secret, TransferError, TransferGrant, TransferStats};
use tandem_proto::worker::{self as pb, prefill_client::PrefillClient};
use tandem_telemetry::Attribute;
use tonic::transport::{Channel, Endpoint};

use tandem_worker::{KvSink, KvTarget};

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

/// A remote prefill that succeeded: the first token the prefill side sampled, and the leading
/// tokens it found in its own caches rather than computed.
#[derive(Debug)]
pub struct Pulled {
    /// The prefill side's first token.
    pub first: Sampled,
    /// Leading prompt tokens the prefill side held (its prefix cache, disk tier, or a
    /// handed-off sequence's parked blocks).
    pub source_cached: usize,
}

/// This worker's KV ingress: the receiver, the address prefill workers reach it at, and the
/// `Prefill` clients.
pub struct RemotePrefill {
    receiver: KvReceiver,
    endpoint: String,
    sink: KvSink,
    deadlines: Deadlines,
    clients: Mutex<HashMap<String, PrefillClient<Channel>>>,
    /// The cluster's credential, on every `Prefill` call.
    token: tandem_worker::WorkerToken,
    /// What remote prefill has done since start.
    pub counts: RemoteCounts,
    /// The rate each source's transfers arrived at.
    pub links: Arc<tandem_worker::LinkRates>,
}

impl RemotePrefill {
    /// Listens for KV on `bind` (`host:port`, port 0 picks one); prefill workers are told to send
    /// to `advertise_host` and the bound port. Each attempt lives while the prefill worker makes
    /// progress, within `deadlines`.
    ///
    /// The receiver describes `target` (every tensor-parallel rank's pool of a worker serving
    /// `model`, or its device's pool, as `KvTarget::of` gives them) in its handshake: senders
    /// with a cache that does not map are refused with the reason, and the others send each
    /// rank's KV heads (converted here where the two caches store other float types).
    ///
    /// # Safety
    /// `target` must belong to the engine whose reservations are passed to [`Self::prefill`]:
    /// only reserved (parked) blocks are ever granted, which the engine leaves alone.
    pub async unsafe fn bind(
        bind: &str,
        advertise_host: &str,
        secret: Secret,
        model: &str,
        target: KvTarget,
        deadlines: Deadlines,
    ) -> Result<Self, TransferError> {
        let shape = target.shape(model).ok_or_else(|| {
            TransferError::Config("a KV receiver needs the engine's host pools".into())
        })?;
        let token = tandem_worker::WorkerToken::from_secret(&secret);
        let receiver = KvReceiver::bind_with(bind, secret, Some(shape)).await?;
        let endpoint = format!("{advertise_host}:{}", receiver.local_addr().port());
        // A sender's handshake must name this endpoint: one relayed through another address
        // is refused.
        receiver.advertise(endpoint.clone());
        Ok(Self {
            receiver,
            endpoint,
            // SAFETY: forwarded to the caller (see above).
            sink: unsafe { KvSink::new(target) },
            deadlines,
            clients: Mutex::new(HashMap::new()),
            token,
            counts: RemoteCounts::default(),
            links: Arc::default(),
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
    /// every candidate failed (the caller prefills locally). `grant` holds the live attempt's
    /// grant: the caller keeps it in a place that drops before the engine request, so blocks are
    /// revoked before they are freed.
    ///
    /// A prefill worker whose engine failed while it held the request answers with a status
    /// marked `tandem-engine-failed`: that status is the `Err`, and neither another candidate nor
    /// this worker's own engine is tried, since the request may be what made the engine fail (the
    /// router does not move it either).
    pub async fn prefill(
        &self,
        ask: Ask<'_>,
        candidates: &[String],
        grant: &mut Option<TransferGrant>,
    ) -> Result<Option<Pulled>, tonic::Status> {
        let Ask { request_id, .. } = ask;
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
                Err(Attempt::EngineFailed(s)) => {
                    tandem_worker::trace::failed(&span, &s.message());
                    self.counts.failures[Failure::PrefillError as usize]
                        .fetch_add(1, Ordering::Relaxed);
                    "engine_failed"
                }
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
                    return Ok(Some(first));
                }
                Err(Attempt::EngineFailed(s)) => {
                    self.counts.transfers_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(request = request_id, prefill = %addr, error = %s.message(), "a prefill worker's engine failed under this request; ending it, not trying another");
                    *grant = None;
                    return Err(s);
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
        Ok(None)
    }

    async fn attempt(
        &self,
        addr: &str,
        ask: &Ask<'_>,
        grant: &mut Option<TransferGrant>,
        span: &tracing::Span,
    ) -> Result<Pulled, Attempt> {
        let Ask {
            request_id,
            prompt,
            sampling,
            priority,
            lora,
            reservation,
        } = *ask;
        let mut client = self
            .client(addr)
            .map_err(|e| Attempt::Failed(Failure::Unreachable, e))?;
        let granted = Instant::now();
        let g = grant.insert(
            self.receiver
                .grant_open(&reservation.blocks, self.sink.block_sink()),
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
            priority,
            lora: lora.cloned(),
        });
        tandem_telemetry::inject(span, call.metadata_mut().as_mut());
        self.token.attach(&mut call);
        let mut watch = Progress::new(self.deadlines, uncached, Instant::now());
        // Opening the call waits for the worker's admission; it too must not hang.
        let mut updates = tokio::select! {
            r = client.prefill(call) => r.map_err(|s| match s.code() {
                _ if tandem_proto::wire::is_engine_failed(&s) => Attempt::EngineFailed(s),
                tonic::Code::ResourceExhausted => Attempt::Refused(s.message().to_string()),
                tonic::Code::Unavailable => Attempt::Failed(Failure::Unreachable, s.message().to_string()),
                c => Attempt::Failed(Failure::PrefillError, format!("{c}: {}", s.message())),
            })?.into_inner(),
            _ = tokio::time::sleep_until(watch.give_up_at()) => return Err(watch.stalled(Instant::now())),
        };
        let mut first: Option<Pulled> = None;
        let mut arrived = false;
        let mut check = tokio::time::interval(PROGRESS_CHECK);
        while first.is_none() || !arrived {
            tokio::select! {
                m = updates.message(), if first.is_none() => {
                    let u = m
                        .map_err(|s| if tandem_proto::wire::is_engine_failed(&s) {
                            Attempt::EngineFailed(s)
                        } else {
                            prefill_error(format!("{}: {}", s.code(), s.message()))
                        })?
                        .ok_or_else(|| prefill_error("the prefill worker ended the call without a first token"))?;
                    match u.update {
                        Some(pb::prefill_update::Update::Accepted(a)) => watch.accepted(&a, Instant::now()),
                        Some(pb::prefill_update::Update::Progress(p)) => watch.beat(&p, Instant::now()),
                        Some(pb::prefill_update::Update::Done(r)) => {
                            let t = r.first_token.ok_or_else(|| prefill_error("the prefill worker sent no first token"))?;
                            first = Some(Pulled {
                                first: Sampled {
                                    token: t.id,
                                    logprob: t.logprob,
                                    top: t.top.iter().map(|x| (x.id, x.logprob)).collect(),
                                },
                                source_cached: r.found_tokens as usize,
                            });
                        }
                        None => {}
                    }
                }
                r = g.wait(), if !arrived => {
                    let stats = match r {
                        Ok(stats) => stats,
                        // The sender gave up, and its call is about to say why: an engine that
                        // failed under this request must not be followed by another prefill.
                        Err(e @ TransferError::Aborted) if first.is_none() => {
                            return Err(why_aborted(&mut updates, &watch, e).await)
                        }
                        Err(e) => return Err(Attempt::Failed(Failure::Transfer, e.to_string())),
                    };
                    self.counts.duration.observe(granted.elapsed().as_secs_f64());
                    received(span, &stats, reservation.blocks.len());
                    // The link's rate, first frame to last (frames come as the sender computes:
                    // a pull of a prefix it holds runs at the link's own).
                    if let Some(first) = stats.first_frame {
                        let took = first.elapsed().map_or(0.0, |d| d.as_secs_f64());
                        self.links.record(addr, stats.bytes, took);
                    }
                    arrived = true;
                }
                _ = check.tick() => watch.frames(g.frames_received(), Instant::now()),
                _ = tokio::time::sleep_until(watch.give_up_at()) => return Err(watch.stalled(Instant::now())),
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
pub struct Ask<'a> {
    /// The request's id.
    pub request_id: &'a str,
    /// Its whole prompt.
    pub prompt: &'a [u32],
    /// Its sampling (for the first token).
    pub sampling: &'a pb::Sampling,
    /// Its priority band.
    pub priority: i32,
    /// Its LoRA adapter (the prefill worker must run the same weights).
    pub lora: Option<&'a pb::LoraRef>,
    /// The blocks reserved for it here, and how many leading tokens they hold already.
    pub reservation: &'a Reservation,
}

/// How one candidate's attempt ended, when it did not succeed.
enum Attempt {
    /// Turned away before any work (RESOURCE_EXHAUSTED): busy, not broken.
    Refused(String),
    /// Failed for the reason given, with what went wrong.
    Failed(Failure, String),
    /// The prefill worker's engine failed while it held the request (its status, marked).
    EngineFailed(tonic::Status),
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

/// Why a transfer's sender aborted it, as its prefill call ends: an engine failure when the
/// call's status says so, else the abort itself. Waits no longer than the attempt's progress
/// deadline.
async fn why_aborted(
    updates: &mut tonic::Streaming<pb::PrefillUpdate>,
    watch: &Progress,
    aborted: TransferError,
) -> Attempt {
    let transfer = || Attempt::Failed(Failure::Transfer, aborted.to_string());
    let end = async {
        loop {
            match updates.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return transfer(),
                Err(s) if tandem_proto::wire::is_engine_failed(&s) => {
                    return Attempt::EngineFailed(s)
                }
                Err(_) => return transfer(),
            }
        }
    };
    tokio::select! {
        a = end => a,
        _ = tokio::time::sleep_until(watch.give_up_at()) => transfer(),
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
/// measured, so a slow machine is given proportionally longer. Once KV frames arrive, each new
/// one gives it the prompt's allowance again from then on: a transfer that is moving is never
/// cut for the link being slower than the worker computes (a 1 Gb/s link carries an 8B model's
/// KV several times slower than one GPU prefills it), and one that stops is left as before.
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
    /// The rate the worker first told, in tokens per second.
    rate: Option<f64>,
    /// When the latest KV frame was seen.
    last_frame: Option<Instant>,
}

/// The bound on a whole attempt, at the worker's rate.
struct AttemptBound {
    at: Instant,
    /// Seconds it allows, from the start or from the latest frame.
    secs: f64,
    /// Tokens they are for.
    tokens: f64,
    rate: f64,
    /// Whether it counts from the latest KV frame (else from the start).
    from_frame: bool,
}

impl Progress {
    fn new(d: Deadlines, uncached: usize, now: Instant) -> Self {
        Self {
            d,
            uncached,
            started: now,
            last: now,
            frames: 0,
            queued: 0,
            rate: None,
            last_frame: None,
        }
    }

    fn accepted(&mut self, a: &pb::PrefillAccepted, now: Instant) {
        self.last = now;
        self.queued = a.queued_tokens;
        self.rate(a.tokens_per_second);
    }

    fn beat(&mut self, p: &pb::PrefillProgress, now: Instant) {
        self.last = now;
        self.rate(p.tokens_per_second);
    }

    /// Takes the worker's rate, the first time it has one (a worker that has not computed
    /// anything yet learns it on its first step): from then on it bounds the attempt.
    fn rate(&mut self, tokens_per_second: f64) {
        if self.rate.is_none() && tokens_per_second > 0.0 {
            self.rate = Some(tokens_per_second);
        }
    }

    /// `n` frames have arrived by `now` (the receiver's count: it only grows).
    fn frames(&mut self, n: u64, now: Instant) {
        if n > self.frames {
            self.frames = n;
            self.last = now;
            self.last_frame = Some(now);
        }
    }

    /// The bound on the whole attempt, once the worker has told its rate: its queue and this
    /// prompt from the start, or, once KV frames arrive, the prompt from the latest one (the
    /// queue ahead is done then, and what is left is this prompt's computing and sending, which
    /// a slow link may stretch past any bound on computing alone), whichever is later.
    fn bound(&self) -> Option<AttemptBound> {
        let rate = self.rate?;
        let allowance = |tokens: f64| {
            let secs = self.d.stall.as_secs_f64() + self.d.slack * tokens / rate;
            secs.min(1e7)
        };
        let tokens = self.queued as f64 + self.uncached as f64;
        let secs = allowance(tokens);
        let whole = AttemptBound {
            at: self.started + Duration::from_secs_f64(secs),
            secs,
            tokens,
            rate,
            from_frame: false,
        };
        let Some(frame) = self.last_frame else {
            return Some(whole);
        };
        let tokens = self.uncached as f64;
        let secs = allowance(tokens);
        let at = frame + Duration::from_secs_f64(secs);
        Some(if at > whole.at {
            AttemptBound {
                at,
                secs,
                tokens,
                rate,
                from_frame: true,
            }
        } else {
            whole
        })
    }

    fn give_up_at(&self) -> tokio::time::Instant {
        let silent = self.last + self.d.stall;
        let at = match self.bound() {
            Some(b) => silent.min(b.at),
            None => silent,
        };
        at.into()
    }

    fn stalled(&self, now: Instant) -> Attempt {
        Attempt::Failed(Failure::Stalled, self.why(now))
    }

    fn why(&self, now: Instant) -> String {
        match self.bound().filter(|b| b.at <= now) {
            Some(b) => {
                let AttemptBound {
                    secs, tokens, rate, ..
                } = b;
                let what = match b.from_frame {
                    true => format!("no KV frame for {secs:.1} s"),
                    false => format!("not done within {secs:.1} s"),
                };
                format!(
                    "{what} ({tokens} tokens at the worker's {rate:.0} tokens/s, slack {}x)",
                    self.d.slack
                )
            }
            None => format!(
                "no word from the prefill worker for {:.1} s (no heartbeat, no KV frame)",
                (now - self.last).as_secs_f64()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stall allowance of 2 s and a slack of 4.
    const DEADLINES: Deadlines = Deadlines {
        stall: Duration::from_secs(2),
        slack: 4.0,
    };

    /// A frame every second, a link four times slower than the worker computes: the attempt
    /// lives as long as frames come; when they stop (heartbeats still coming) it is left after
    /// the prompt's allowance from the last one. Times are given, not read from a clock.
    #[test]
    fn a_moving_transfer_is_never_cut_for_a_slow_link_and_a_stopped_one_is_left() {
        let (t0, d) = (Instant::now(), DEADLINES);
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        let gives_up = |p: &Progress| (p.give_up_at().into_std() - t0).as_secs_f64();
        // 1000 tokens at 1000 tokens/s behind 500 queued: 2 + 4 x 1.5 = 8 s for the whole.
        let mut p = Progress::new(d, 1000, t0);
        let accepted = pb::PrefillAccepted {
            queued_tokens: 500,
            tokens_per_second: 1000.0,
        };
        p.accepted(&accepted, t0);
        assert_eq!(gives_up(&p), 2.0, "silence: the stall allowance");
        let beat = pb::PrefillProgress {
            tokens_per_second: 900.0,
        };
        for k in 1..=7 {
            p.beat(&beat, at(k as f64));
            assert_eq!(gives_up(&p), (k as f64 + 2.0).min(8.0), "beat at {k} s");
        }
        assert!(p.why(at(8.0)).starts_with("not done within 8.0 s"));
        // Frames from 7.5 s to 40.5 s, one a second: the bound on computing alone (8 s) would
        // have cut it; each frame gives the prompt's allowance (2 + 4 x 1 = 6 s) from then on.
        for k in 0..34 {
            let now = 7.5 + k as f64;
            p.frames(k + 1, at(now));
            p.beat(&beat, at(now + 0.5));
            assert_eq!(gives_up(&p), now + 2.5, "frame at {now} s");
        }
        // A count that does not grow is no progress.
        p.frames(34, at(41.0));
        // The frames stop, the heartbeats do not: left 6 s after the last frame.
        for k in 0..5 {
            p.beat(&beat, at(41.0 + k as f64));
        }
        assert_eq!(gives_up(&p), 40.5 + 6.0);
        let why = p.why(at(46.5));
        assert!(why.starts_with("no KV frame for 6.0 s"), "{why}");
    }

    #[test]
    fn a_rate_told_after_frames_came_bounds_the_attempt_from_the_latest_frame() {
        let (t0, d) = (Instant::now(), DEADLINES);
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        let gives_up = |p: &Progress| (p.give_up_at().into_std() - t0).as_secs_f64();
        // A fresh worker knows no rate yet, and its heartbeats wait while it sends over a slow
        // link: frames every 0.5 s are all that comes, and only silence bounds it.
        let mut p = Progress::new(d, 1000, t0);
        let fresh = pb::PrefillAccepted {
            queued_tokens: 0,
            tokens_per_second: 0.0,
        };
        p.accepted(&fresh, t0);
        assert_eq!(gives_up(&p), 2.0);
        for k in 1..=18 {
            p.frames(k, at(0.5 * k as f64));
            assert_eq!(gives_up(&p), 0.5 * k as f64 + 2.0);
        }
        // Its first rate comes at 9 s, past the 6 s (2 + 4 x 1) the prompt is allowed from the
        // start: the bound counts from the latest frame instead.
        let beat = pb::PrefillProgress {
            tokens_per_second: 1000.0,
        };
        p.beat(&beat, at(9.0));
        assert_eq!(gives_up(&p), 11.0, "silence bounds it");
        // The frames stop, the heartbeats do not: left 6 s after the last frame.
        for k in 10..=16 {
            p.beat(&beat, at(k as f64));
        }
        assert_eq!(gives_up(&p), 15.0);
        let why = p.why(at(15.0));
        assert!(why.starts_with("no KV frame for 6.0 s"), "{why}");
    }
}
