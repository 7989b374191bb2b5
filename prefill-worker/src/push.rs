//! The push: one admitted prefill run through the engine, each chunk of blocks it hands out cut
//! into the frames the decode worker's ranks take ([`FramePlan`]) and sent over the transport
//! while the engine computes the next, heartbeats to the caller throughout (while a slow link
//! takes the frames too), then the first token; and the span of the KV push.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use tandem_engine::{ErrorKind, KvChunk, Request, StreamEvent};
use tandem_kv_transfer::{FramePlan, HeadsKv, KvStream, OutgoingChunk};
use tandem_proto::wire::status as fail;
use tandem_proto::worker as pb;
use tandem_telemetry::OpenTelemetrySpanExt;
use tandem_worker::convert::status;
use tonic::Status;

use crate::admission::{Admitted, Checked};
use crate::{Shared, HEARTBEAT};

/// Why a prefill stopped before its answer.
pub(crate) enum Stop {
    /// The caller went away (cancelled, or gave up on this worker).
    Gone,
    /// The call failed with this status.
    Failed(Status),
}

impl From<Status> for Stop {
    fn from(s: Status) -> Self {
        Stop::Failed(s)
    }
}

pub(crate) type Updates = tokio::sync::mpsc::Sender<Result<pb::PrefillUpdate, Status>>;

fn update(u: pb::prefill_update::Update) -> Result<pb::PrefillUpdate, Status> {
    Ok(pb::PrefillUpdate { update: Some(u) })
}

impl Shared {
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
    pub(crate) async fn run(
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
        let priority = req.priority;
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
        // The decode worker runs the same adapter: the same name and the same weights (content
        // hash), or the prompt is refused here.
        let adapter = self
            .identity
            .loras
            .resolve(req.lora.as_ref())
            .await
            .map_err(Stop::Failed)?;
        let submitted = SystemTime::now();
        let request = self
            .engine
            .compile(Request {
                priority,
                adapter,
                ..Request::new(req.prompt_ids, sampling)
            })
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
        let mut found = 0;
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
                    let out = outgoing(&c);
                    let plan = match FramePlan::new(&out, want.as_deref(), self.shape.as_ref()) {
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
                    let frames = plan.frames(&out, &dest.block_ids);
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
                    found = f.cached_prompt_tokens;
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
                found_tokens: found.max(cached) as u32,
            },
        )))
        .await
        .map_err(|_| Stop::Gone)
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

/// An engine chunk as the KV transport sends it.
fn outgoing(c: &KvChunk) -> OutgoingChunk<'_> {
    OutgoingChunk {
        first: c.first,
        blocks: c.blocks,
        pieces: c
            .pieces
            .iter()
            .map(|p| HeadsKv {
                heads: &p.heads,
                layers: &p.layers,
                frame_len: p.frame_len,
            })
            .collect(),
    }
}
