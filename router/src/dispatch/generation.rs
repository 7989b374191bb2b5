//! One request's stream of chunks: tokens become text, heartbeats are skipped, a silent or lost
//! worker's request moves to another worker with the tokens it has.

use std::sync::Arc;

use futures::StreamExt;
use tandem_proto::worker as pb;
use tracing::Instrument;

use super::route::Route;
use super::{Chunk, FinishKind, QueueSlot, ServedModel, TokenOut, Usage};
use crate::client::WorkerStream;
use crate::error::ApiError;
use crate::text::TextAssembler;
use crate::trace;
use crate::workers::{InFlightGuard, WorkerAddr};

/// One request's answer as it arrives. Dropping it cancels the request on the worker.
pub struct Generation {
    pub(super) stream: Option<WorkerStream<pb::DecodeResponse>>,
    pub(super) assembler: TextAssembler,
    pub(super) model: Arc<ServedModel>,
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
    pub(super) done: bool,
    pub(super) guard: InFlightGuard,
    pub(super) prefill_guard: Option<InFlightGuard>,
    /// Every token received so far: what a migrated stream resumes from.
    pub(super) emitted: Vec<u32>,
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
    pub(super) _slot: QueueSlot,
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.route
            .metrics
            .request(self.outcome.unwrap_or("cancelled"));
    }
}

/// Whether a failed stream means its worker is gone (move the request) rather than that the
/// request itself was refused (report it).
fn worker_lost(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Cancelled
    )
}

impl Generation {
    /// The decode worker serving the request now (another one after a migration).
    pub fn worker(&self) -> &WorkerAddr {
        &self.guard.worker().addr
    }

    /// The next chunk; `None` after the one carrying the finish. When the decode worker fails
    /// mid-stream the request moves to another one, resuming after the tokens already
    /// received, so the caller sees one continuous answer.
    pub async fn next(&mut self) -> Option<Result<Chunk, ApiError>> {
        loop {
            if self.done {
                return None;
            }
            let stream = self.stream.as_mut()?;
            let stall = self.route.stall;
            let failure = match tokio::time::timeout(stall, stream.next()).await {
                Err(_) => ApiError::Upstream {
                    worker: self.worker().clone(),
                    message: format!(
                        "the worker sent nothing, not even a heartbeat, for {stall:?}"
                    ),
                },
                // A heartbeat: the worker is alive and still working on it.
                Ok(Some(Ok(m))) if m.tokens.is_empty() && m.finish.is_none() => continue,
                Ok(Some(Ok(m))) => {
                    let chunk = self.absorb(m);
                    self.outcome = match &chunk {
                        Ok(c) => match &c.finish {
                            Some((kind, usage)) => {
                                trace::finished(&self.span, *kind, usage);
                                Some("ok")
                            }
                            None => None,
                        },
                        Err(e) => {
                            trace::failed(&self.span, e);
                            Some("failed")
                        }
                    };
                    return Some(chunk);
                }
                Ok(None) => ApiError::Upstream {
                    worker: self.worker().clone(),
                    message: "the stream ended without a finish".into(),
                },
                Ok(Some(Err(s))) if worker_lost(&s) => ApiError::from_worker(self.worker(), &s),
                Ok(Some(Err(s))) => {
                    self.done = true;
                    self.outcome = Some("failed");
                    let e = ApiError::from_worker(self.worker(), &s);
                    trace::failed(&self.span, &e);
                    return Some(Err(e));
                }
            };
            if let Err(e) = self.migrate(failure).await {
                self.done = true;
                self.outcome = Some("failed");
                trace::failed(&self.span, &e);
                return Some(Err(e));
            }
        }
    }

    /// Reopens the request on another decode worker after `failure`, or gives `failure` back.
    async fn migrate(&mut self, failure: ApiError) -> Result<(), ApiError> {
        if self.migrations_left == 0 {
            return Err(failure);
        }
        self.migrations_left -= 1;
        let lost = self.worker().clone();
        tracing::warn!(request = %self.request.request_id, worker = %lost, tokens = self.emitted.len(), error = %failure, "decode worker lost mid-stream; migrating");
        self.guard.worker().mark_down();
        self.stream = None;
        let span = tracing::info_span!(
            parent: &self.span,
            "migrate",
            tandem.migrate.from = %lost,
            tandem.migrate.reason = %failure,
            tandem.migrate.resumed_tokens = self.emitted.len() as i64,
            tandem.route.worker = tracing::field::Empty,
            tandem.route.cached_tokens = tracing::field::Empty,
            tandem.route.prefill = tracing::field::Empty,
            tandem.route.prefill_candidates = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        self.tried.push(lost);
        let opened = self
            .route
            .open(self.request.clone(), &self.emitted, &mut self.tried)
            .instrument(span.clone())
            .await
            .map_err(|_| {
                span.record("otel.status_code", "error");
                failure
            })?;
        self.route.metrics.migration();
        self.migrations += 1;
        self.span
            .record("tandem.migrations", i64::from(self.migrations));
        self.stream = Some(opened.stream);
        self.guard = opened.guard;
        self.prefill_guard = None;
        Ok(())
    }

    fn absorb(&mut self, msg: pb::DecodeResponse) -> Result<Chunk, ApiError> {
        let tok = &self.model.text.tokenizer;
        let internal = |e: tandem_model::ModelError| ApiError::Internal(e.to_string());
        let mut chunk = Chunk::default();
        if !msg.tokens.is_empty() {
            self.prefill_guard = None;
        }
        for t in msg.tokens {
            self.completion_tokens += 1;
            self.emitted.push(t.id);
            let piece = self.assembler.push(tok, t.id).map_err(internal)?;
            chunk.text.push_str(&piece.text);
            chunk.tokens.push(TokenOut {
                id: t.id,
                logprob: t.logprob,
                top: t.top.iter().map(|x| (x.id, x.logprob)).collect(),
            });
            if piece.stopped {
                // Dropping the stream cancels the rest on the worker.
                self.stream = None;
                self.done = true;
                chunk.finish = Some((
                    FinishKind::Stop,
                    Usage {
                        prompt_tokens: self.prompt_tokens,
                        completion_tokens: self.completion_tokens,
                        cached_prompt_tokens: 0,
                    },
                ));
                return Ok(chunk);
            }
        }
        if let Some(f) = msg.finish {
            let piece = self.assembler.finish(tok).map_err(internal)?;
            chunk.text.push_str(&piece.text);
            let kind = match pb::FinishReason::try_from(f.reason) {
                _ if piece.stopped => FinishKind::Stop,
                Ok(pb::FinishReason::Length) => FinishKind::Length,
                Ok(pb::FinishReason::Cancelled) => FinishKind::Cancelled,
                _ => FinishKind::Stop,
            };
            self.done = true;
            chunk.finish = Some((
                kind,
                Usage {
                    prompt_tokens: f.prompt_tokens,
                    completion_tokens: self.completion_tokens,
                    cached_prompt_tokens: f.cached_prompt_tokens,
                },
            ));
        }
        Ok(chunk)
    }
}
