//! One request's streams of chunks: tokens become text per sample, heartbeats are skipped, a
//! silent or lost worker's samples move to another worker with the tokens they have.
//!
//! A request with parallel samples (`n`) opens one worker stream for all of them: the worker
//! computes the prompt once and forks the samples over its blocks. Each sample has its own text
//! (stop strings, special tokens) and ends on its own. If that worker fails, every sample still
//! going resumes on its own stream (one per sample, each keeping its index and so its random
//! stream), since each has its own tokens to resume after.

use std::collections::VecDeque;
use std::sync::Arc;

use futures::StreamExt;
use tandem_proto::worker as pb;
use tandem_types::ErrorKind;
use tokio::time::Instant;
use tracing::Instrument;

use super::route::{Opened, Route};
use super::{Chunk, FinishKind, QueueSlot, ServedModel, TokenOut, Usage};
use crate::client::WorkerStream;
use crate::error::ApiError;
use crate::text::TextAssembler;
use crate::trace;
use crate::workers::{InFlightGuard, WorkerAddr};

/// One worker stream and the samples it serves.
pub(super) struct Leg {
    stream: WorkerStream<pb::DecodeResponse>,
    guard: InFlightGuard,
    /// Held on the first candidate prefill worker until the first token arrives.
    prefill_guard: Option<InFlightGuard>,
    /// The samples whose tokens come on this stream.
    samples: Vec<u32>,
    /// It must send something (a token, a finish, a heartbeat) by then, or it is given up on.
    deadline: Instant,
    /// The stream's id on its worker, once a message with tokens has told it (0: not yet, or a
    /// worker that cannot stop samples).
    stream_id: u64,
}

impl Leg {
    pub(super) fn new(opened: Opened, samples: Vec<u32>, stall: std::time::Duration) -> Self {
        Self {
            stream: opened.stream,
            guard: opened.guard,
            prefill_guard: opened.prefill_guard,
            samples,
            deadline: Instant::now() + stall,
            stream_id: 0,
        }
    }

    fn worker(&self) -> &WorkerAddr {
        &self.guard.worker().addr
    }
}

/// One sample's answer so far.
pub(super) struct Sample {
    assembler: TextAssembler,
    completion_tokens: u32,
    /// Every token received so far: what a migrated sample resumes from.
    emitted: Vec<u32>,
    done: bool,
}

impl Sample {
    pub(super) fn new(assembler: TextAssembler) -> Self {
        Self {
            assembler,
            completion_tokens: 0,
            emitted: Vec::new(),
            done: false,
        }
    }
}

/// One request's answer as it arrives. Dropping it cancels the request on its workers.
pub struct Generation {
    pub(super) legs: Vec<Leg>,
    pub(super) samples: Vec<Sample>,
    /// Chunks taken from the streams and not handed out yet, with their samples.
    pub(super) ready: VecDeque<(u32, Chunk)>,
    pub(super) model: Arc<ServedModel>,
    pub(super) prompt_tokens: u32,
    /// The request as first sent: a migrated sample's is this one with its index and tokens.
    pub(super) request: pb::DecodeRequest,
    pub(super) route: Route,
    pub(super) tried: Vec<WorkerAddr>,
    pub(super) migrations_left: u32,
    /// Migrations done so far.
    pub(super) migrations: u32,
    /// How it ended, once it has: counted when the generation is dropped (`cancelled` if the
    /// client went away before either).
    pub(super) outcome: Option<&'static str>,
    /// The request's span: ends when the generation drops.
    pub(super) span: tracing::Span,
    /// Its place among the dispatched: given back (with the output tokens, charged to its
    /// tenant) when it drops.
    pub(super) permit: crate::flow::Permit,
    pub(super) _slot: QueueSlot,
}

impl Drop for Generation {
    fn drop(&mut self) {
        let completion: u64 = self
            .samples
            .iter()
            .map(|s| u64::from(s.completion_tokens))
            .sum();
        self.permit.finish(completion);
        self.route
            .metrics
            .request(self.outcome.unwrap_or("cancelled"));
    }
}

/// Whether a failed stream means its worker is gone (move the request) rather than that the
/// request itself was refused (report it). A worker whose engine failed under the request says
/// so; that request is reported, not moved (it may be what made the engine fail).
fn worker_lost(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Cancelled
    ) && !tandem_proto::wire::is_engine_failed(s)
}

/// What one wait on the streams gave: which leg, and its message, failure or silence.
enum Arrival {
    Message(pb::DecodeResponse),
    /// The worker is gone (or silent past the stall deadline): move its samples.
    Lost(ApiError),
    /// The worker is draining and handed its samples over: move them, pulling their K/V
    /// from it.
    HandedOff(ApiError),
    /// The worker refused the request: report it.
    Refused(ApiError),
}

impl Generation {
    /// The decode worker serving the request now (the first still streaming; another one
    /// after a migration).
    pub fn worker(&self) -> Option<&WorkerAddr> {
        self.legs.first().map(Leg::worker)
    }

    /// Samples the request asked for (`n`).
    pub fn samples(&self) -> usize {
        self.samples.len()
    }

    /// The next chunk, with the sample it belongs to; `None` once every sample has finished.
    /// When a decode worker fails mid-stream its samples move to another one, resuming after
    /// the tokens already received, so the caller sees each sample as one continuous answer.
    pub async fn next(&mut self) -> Option<Result<(u32, Chunk), ApiError>> {
        loop {
            if let Some((i, c)) = self.ready.pop_front() {
                if c.finish.is_some() && self.samples.iter().all(|s| s.done) {
                    self.outcome.get_or_insert("ok");
                    if let Some((kind, last)) = &c.finish {
                        let usage = Usage {
                            completion_tokens: self
                                .samples
                                .iter()
                                .map(|s| s.completion_tokens)
                                .sum(),
                            ..*last
                        };
                        trace::finished(&self.span, *kind, &usage);
                    }
                }
                return Some(Ok((i, c)));
            }
            if self.samples.iter().all(|s| s.done) || self.legs.is_empty() {
                return None;
            }
            let (k, arrival) = self.wait().await;
            let failure = match arrival {
                Arrival::Message(m) => match self.absorb(k, m) {
                    Ok(()) => continue,
                    Err(e) => return Some(Err(self.fail(e))),
                },
                Arrival::Refused(e) => return Some(Err(self.fail(e))),
                Arrival::Lost(e) => (e, false),
                Arrival::HandedOff(e) => (e, true),
            };
            if let Err(e) = self.migrate(k, failure).await {
                return Some(Err(self.fail(e)));
            }
        }
    }

    /// Waits for the first leg with something to say; heartbeats only move its deadline.
    async fn wait(&mut self) -> (usize, Arrival) {
        let stall = self.route.stall;
        loop {
            let waits = self.legs.iter_mut().enumerate().map(|(k, leg)| {
                Box::pin(async move {
                    let got = tokio::time::timeout_at(leg.deadline, leg.stream.next()).await;
                    (k, got)
                })
            });
            let ((k, got), _, _) = futures::future::select_all(waits).await;
            let worker = self.legs[k].worker().clone();
            let arrival = match got {
                Err(_) => Arrival::Lost(ApiError::Upstream {
                    worker,
                    message: format!(
                        "the worker sent nothing, not even a heartbeat, for {stall:?}"
                    ),
                    kind: ErrorKind::Unavailable,
                }),
                Ok(Some(Ok(m))) => {
                    self.legs[k].deadline = Instant::now() + stall;
                    // A heartbeat: the worker is alive and still working on it.
                    if m.tokens.is_empty() && m.finish.is_none() && m.finished.is_empty() {
                        continue;
                    }
                    Arrival::Message(m)
                }
                Ok(None) => Arrival::Lost(ApiError::Upstream {
                    worker,
                    message: "the stream ended without a finish".into(),
                    kind: ErrorKind::Unavailable,
                }),
                Ok(Some(Err(s))) if tandem_proto::wire::is_handed_off(&s) => {
                    Arrival::HandedOff(ApiError::from_worker(&worker, &s))
                }
                Ok(Some(Err(s))) if worker_lost(&s) => {
                    Arrival::Lost(ApiError::from_worker(&worker, &s))
                }
                Ok(Some(Err(s))) => Arrival::Refused(ApiError::from_worker(&worker, &s)),
            };
            return (k, arrival);
        }
    }

    /// Ends the whole request with `e` (its streams dropped, which cancels them).
    fn fail(&mut self, e: ApiError) -> ApiError {
        self.legs.clear();
        self.ready.clear();
        for s in &mut self.samples {
            s.done = true;
        }
        self.outcome = Some("failed");
        trace::failed(&self.span, &e);
        e
    }

    /// Reopens leg `k`'s unfinished samples on other decode workers after `failure` (one
    /// stream each), or gives `failure` back.
    /// The samples leg `k` carries that have not finished.
    fn unfinished(&self, k: usize) -> Vec<u32> {
        self.legs[k]
            .samples
            .iter()
            .copied()
            .filter(|&i| !self.samples[i as usize].done)
            .collect()
    }

    ///
    /// A hand-over (`handed_off`: the worker drains) is no failure: it does not count against
    /// `--max-migrations`, and the worker stays up, draining, for the K/V to be pulled from it.
    async fn migrate(
        &mut self,
        k: usize,
        (failure, handed_off): (ApiError, bool),
    ) -> Result<(), ApiError> {
        if !handed_off && self.migrations_left == 0 {
            return Err(failure);
        }
        if !handed_off {
            self.migrations_left -= 1;
        }
        let moving = self.unfinished(k);
        let leg = self.legs.remove(k);
        let lost = leg.worker().clone();
        match handed_off {
            true => leg.guard.worker().mark_draining(),
            false => leg.guard.worker().mark_down(),
        }
        drop(leg);
        let resumed: usize = moving
            .iter()
            .map(|&i| self.samples[i as usize].emitted.len())
            .sum();
        match handed_off {
            true => {
                tracing::info!(request = %self.request.request_id, worker = %lost, samples = moving.len(), tokens = resumed, "decode worker draining handed the request over; resuming it elsewhere")
            }
            false => {
                tracing::warn!(request = %self.request.request_id, worker = %lost, samples = moving.len(), tokens = resumed, error = %failure, "decode worker lost mid-stream; migrating")
            }
        }
        let span = tracing::info_span!(
            parent: &self.span,
            "migrate",
            tandem.migrate.from = %lost,
            tandem.migrate.reason = %failure,
            tandem.migrate.resumed_tokens = resumed as i64,
            tandem.route.worker = tracing::field::Empty,
            tandem.route.cached_tokens = tracing::field::Empty,
            tandem.route.prefill = tracing::field::Empty,
            tandem.route.prefill_candidates = tracing::field::Empty,
            tandem.route.local_estimate_s = tracing::field::Empty,
            tandem.route.remote_estimate_s = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        self.tried.push(lost);
        for i in moving {
            let request = pb::DecodeRequest {
                n: 1,
                first_index: i,
                ..self.request.clone()
            };
            let opened = self
                .route
                .open(request, &self.samples[i as usize].emitted, &mut self.tried)
                .instrument(span.clone())
                .await
                .map_err(|_| {
                    span.record("otel.status_code", "error");
                    failure.clone()
                })?;
            self.legs.push(Leg::new(opened, vec![i], self.route.stall));
        }
        self.route.metrics.migration(handed_off);
        self.migrations += 1;
        self.span
            .record("tandem.migrations", i64::from(self.migrations));
        Ok(())
    }

    /// Asks leg `k`'s worker to finish `samples` (cut by stop strings here) while the leg's other
    /// samples go on, so they stop taking its steps and blocks. In the background: the answer
    /// changes nothing here (the samples' text has ended already), and a worker that does not
    /// know the call (it names no stream id) runs them to their own end.
    fn stop_on_worker(&self, k: usize, samples: Vec<u32>) {
        let leg = &self.legs[k];
        if leg.stream_id == 0 {
            // A worker that does not name its streams cannot stop samples either.
            return;
        }
        let worker = leg.guard.worker().clone();
        let request = pb::StopSamplesRequest {
            request_id: self.request.request_id.clone(),
            indices: samples,
            stream_id: leg.stream_id,
        };
        tokio::spawn(async move {
            let (id, samples) = (request.request_id.clone(), request.indices.clone());
            if let Err(e) = worker.client().stop_samples(request).await {
                tracing::debug!(request = %id, worker = %worker.addr, ?samples, error = %e, "stopping samples on the worker failed; they run to their own end");
            }
        });
    }

    /// Turns a message of leg `k` into chunks, one per sample it speaks of, in order.
    fn absorb(&mut self, k: usize, msg: pb::DecodeResponse) -> Result<(), ApiError> {
        let tok = &self.model.text.tokenizer;
        let internal = |e: tandem_model::ModelError| ApiError::Internal(e.to_string());
        let leg = &mut self.legs[k];
        if !msg.tokens.is_empty() {
            leg.prefill_guard = None;
        }
        if msg.stream_id != 0 {
            leg.stream_id = msg.stream_id;
        }
        let worker = leg.worker().clone();
        let serves = |i: u32| {
            if leg.samples.contains(&i) {
                Ok(i as usize)
            } else {
                Err(ApiError::Upstream {
                    worker: worker.clone(),
                    message: format!("the worker sent sample {i}, which it does not serve"),
                    kind: ErrorKind::Internal,
                })
            }
        };
        let mut chunks: Vec<(u32, Chunk)> = Vec::new();
        // Samples a stop string ended here: the worker cannot see it, and runs them on.
        let mut cut: Vec<u32> = Vec::new();
        let chunk_of = |chunks: &mut Vec<(u32, Chunk)>, i: u32| -> usize {
            match chunks.iter().position(|(j, _)| *j == i) {
                Some(p) => p,
                None => {
                    chunks.push((i, Chunk::default()));
                    chunks.len() - 1
                }
            }
        };
        for t in msg.tokens {
            let s = &mut self.samples[serves(t.index)?];
            if s.done {
                // Cut at a stop string already: the rest of its tokens are not part of it.
                continue;
            }
            s.completion_tokens += 1;
            s.emitted.push(t.id);
            let piece = s.assembler.push(tok, t.id).map_err(internal)?;
            let at = chunk_of(&mut chunks, t.index);
            let c = &mut chunks[at].1;
            c.text.push_str(&piece.text);
            c.tokens.push(TokenOut {
                id: t.id,
                logprob: t.logprob,
                top: t.top.iter().map(|x| (x.id, x.logprob)).collect(),
            });
            if piece.stopped {
                s.done = true;
                cut.push(t.index);
                c.stop = piece.stop;
                c.finish = Some((
                    FinishKind::Stop,
                    Usage {
                        prompt_tokens: self.prompt_tokens,
                        completion_tokens: s.completion_tokens,
                        cached_prompt_tokens: 0,
                    },
                ));
            }
        }
        let last = msg.finish.is_some();
        let finished_here: Vec<u32> = msg
            .finished
            .iter()
            .chain(&msg.finish)
            .map(|f| f.index)
            .collect();
        for f in msg.finished.into_iter().chain(msg.finish) {
            let s = &mut self.samples[serves(f.index)?];
            if s.done {
                continue;
            }
            let piece = s.assembler.finish(tok).map_err(internal)?;
            let at = chunk_of(&mut chunks, f.index);
            let c = &mut chunks[at].1;
            c.text.push_str(&piece.text);
            if piece.stopped {
                c.stop = piece.stop;
            }
            let kind = match pb::FinishReason::try_from(f.reason) {
                _ if piece.stopped => FinishKind::Stop,
                Ok(pb::FinishReason::Length) => FinishKind::Length,
                Ok(pb::FinishReason::Cancelled) => FinishKind::Cancelled,
                _ => FinishKind::Stop,
            };
            s.done = true;
            c.finish = Some((
                kind,
                Usage {
                    prompt_tokens: f.prompt_tokens,
                    completion_tokens: s.completion_tokens,
                    cached_prompt_tokens: f.cached_prompt_tokens,
                },
            ));
        }
        let open = self.unfinished(k);
        if last && !open.is_empty() {
            return Err(ApiError::Upstream {
                worker: self.legs[k].worker().clone(),
                message: format!("the stream ended before samples {open:?} finished"),
                kind: ErrorKind::Internal,
            });
        }
        // A finish that came in the same message needs no stop.
        cut.retain(|i| !finished_here.contains(i));
        if open.is_empty() {
            // Every sample on it is done (a stop string cut the last one short, or its finish
            // came): dropping the stream cancels whatever the worker still runs of it.
            self.legs.remove(k);
        } else if !cut.is_empty() {
            self.stop_on_worker(k, cut);
        }
        self.ready.extend(chunks);
        Ok(())
    }
}
