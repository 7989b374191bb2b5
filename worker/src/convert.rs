//! Conversions between the engine's types and the worker API, shared by both worker roles (the
//! prefill worker serves the same Info/Load/KvEvents as the decode worker).

use std::pin::Pin;

use futures::Stream;
use tandem_engine::{
    EngineError, EngineHandle, EngineStats, FinishReason, Finished, KvEventKind, KvUpdate,
    TokenEvent,
};
use tandem_proto::worker as pb;
use tokio::sync::watch;
use tonic::Status;

/// A server stream of a gRPC method's responses.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// An engine refusal or failure as the gRPC status its kind maps to (one mapping, in
/// tandem-proto, for every worker): the caller's fault only when it was.
pub fn status(e: EngineError) -> Status {
    match e {
        EngineError::Failed(_) => tandem_proto::wire::engine_failed_status(e.kind(), e.to_string()),
        EngineError::HandedOff => tandem_proto::wire::handed_off_status(e.to_string()),
        e => tandem_proto::wire::status(e.kind(), e.to_string()),
    }
}

/// A sampled token (with its log-probability and alternatives) as the worker API sends it.
pub fn token(t: &TokenEvent) -> pb::Token {
    pb::Token {
        id: t.sampled.token,
        logprob: t.sampled.logprob,
        top: t
            .sampled
            .top
            .iter()
            .map(|&(id, logprob)| pb::TopToken { id, logprob })
            .collect(),
        index: t.index,
    }
}

/// A finished request's reason, counts and timings as the worker API sends them.
pub fn finish(f: &Finished) -> pb::Finish {
    let reason = match f.finish_reason {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
        // Never sent: a stream whose request failed ends with the error's status instead.
        FinishReason::Error => pb::FinishReason::Unspecified,
    };
    pb::Finish {
        reason: reason as i32,
        prompt_tokens: f.prompt_ids.len() as u32,
        cached_prompt_tokens: f.cached_prompt_tokens as u32,
        preemptions: f.preemptions,
        queue_seconds: f.queue_s,
        ttft_seconds: f.ttft_s,
        e2e_seconds: f.e2e_s,
        index: f.index,
    }
}

/// A change to the engine's prefix cache (a snapshot or events) as the KvEvents stream sends it.
pub fn kv_batch(update: KvUpdate) -> pb::KvEventBatch {
    match update {
        KvUpdate::Snapshot {
            next_seq,
            hashes,
            disk_hashes,
        } => pb::KvEventBatch {
            snapshot: Some(pb::KvSnapshot {
                next_seq,
                block_hashes: hashes.iter().map(|h| h.0).collect(),
                disk_block_hashes: disk_hashes.iter().map(|h| h.0).collect(),
            }),
            events: Vec::new(),
        },
        KvUpdate::Events(events) => pb::KvEventBatch {
            snapshot: None,
            events: events
                .into_iter()
                .map(|e| pb::KvEvent {
                    seq: e.seq,
                    kind: Some(match e.kind {
                        KvEventKind::Stored { parent, hashes } => {
                            pb::kv_event::Kind::Stored(pb::KvStored {
                                parent_hash: parent.map(|p| p.0),
                                block_hashes: hashes.iter().map(|h| h.0).collect(),
                            })
                        }
                        KvEventKind::Removed { hashes } => {
                            pb::kv_event::Kind::Removed(pb::KvRemoved {
                                block_hashes: hashes.iter().map(|h| h.0).collect(),
                            })
                        }
                        KvEventKind::DiskStored { hashes } => {
                            pb::kv_event::Kind::DiskStored(pb::KvStored {
                                parent_hash: None,
                                block_hashes: hashes.iter().map(|h| h.0).collect(),
                            })
                        }
                        KvEventKind::DiskRemoved { hashes } => {
                            pb::kv_event::Kind::DiskRemoved(pb::KvRemoved {
                                block_hashes: hashes.iter().map(|h| h.0).collect(),
                            })
                        }
                    }),
                })
                .collect(),
        },
    }
}

/// An `Info` answer: who the worker is and its engine's limits.
pub fn worker_info(id: &crate::WorkerIdentity, l: tandem_engine::Limits) -> pb::WorkerInfo {
    pb::WorkerInfo {
        worker_id: id.worker_id.clone(),
        model: id.model.clone(),
        block_size: l.block_size as u32,
        max_context: l.max_context as u32,
        vocab_size: l.vocab_size as u32,
        kv_dtype: id.kv_dtype.clone(),
        total_blocks: l.total_blocks as u32,
        tensor_parallel: l.tensor_parallel as u32,
    }
}

/// A `Load` answer from the engine's stats and the service's own counts.
pub fn load_report(s: EngineStats, in_flight: usize, draining: bool) -> pb::LoadReport {
    pb::LoadReport {
        running: s.running as u32,
        waiting: s.waiting as u32,
        blocks_total: s.blocks_total as u32,
        blocks_free: s.blocks_free as u32,
        blocks_cached: s.blocks_cached as u32,
        blocks_used: s.blocks_used as u32,
        prefix_lookup_tokens: s.prefix_lookup_tokens,
        prefix_hit_tokens: s.prefix_hit_tokens,
        preemptions: s.preemptions,
        in_flight: in_flight as u32,
        draining,
        prefill_tokens_per_s: s.prefill_tokens_per_s,
        kv_bytes_per_token: 0.0,
        kv_links: Vec::new(),
        decoding: s.decoding as u32,
        itl_target_ms: s.itl_target_ms,
        step_fixed_ms: s.step_cost_ms[0],
        step_token_ms: s.step_cost_ms[1],
        step_key_ms: s.step_cost_ms[2],
        loras: Vec::new(),
    }
}

/// The `KvEvents` stream of an engine: a snapshot, then batches of events (whatever is queued
/// goes into one message), until `stopped` turns true.
pub fn kv_event_stream(
    engine: &EngineHandle,
    stopped: watch::Receiver<bool>,
) -> Result<BoxStream<pb::KvEventBatch>, Status> {
    let rx = engine.subscribe_kv().map_err(status)?;
    let s = futures::stream::unfold((rx, stopped), |(mut rx, mut stopped)| async move {
        if *stopped.borrow() {
            return None;
        }
        tokio::select! {
            u = rx.recv() => {
                let mut batch = kv_batch(u?);
                while let Ok(more) = rx.try_recv() {
                    batch.events.extend(kv_batch(more).events);
                }
                Some((Ok(batch), (rx, stopped)))
            }
            _ = stopped.changed() => None,
        }
    });
    Ok(Box::pin(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn engine_failures_map_to_the_code_of_their_kind_not_to_invalid_argument() {
        let cases = [
            (EngineError::EmptyPrompt, Code::InvalidArgument),
            (
                EngineError::Sampling(tandem_engine::SamplingError::MaxTokens),
                Code::InvalidArgument,
            ),
            (
                EngineError::BadToken { id: 9, vocab: 4 },
                Code::InvalidArgument,
            ),
            (
                EngineError::ContextOverflow { tokens: 9, max: 4 },
                Code::OutOfRange,
            ),
            (
                EngineError::TooLargeForCache { need: 9, total: 4 },
                Code::OutOfRange,
            ),
            (
                EngineError::Unsupported("no".into()),
                Code::FailedPrecondition,
            ),
            (EngineError::Stopped, Code::Unavailable),
            (EngineError::Step("kernel".into()), Code::Internal),
            (EngineError::NotParked(3), Code::Internal),
            (EngineError::Internal("x".into()), Code::Internal),
            (EngineError::Failed("boom".into()), Code::Internal),
        ];
        for (e, code) in cases {
            let text = e.to_string();
            let failed = matches!(e, EngineError::Failed(_));
            let s = status(e);
            assert_eq!(s.code(), code, "{text}");
            assert_eq!(s.message(), text);
            // Only an engine that failed says so (the router does not move such a request).
            assert_eq!(tandem_proto::wire::is_engine_failed(&s), failed, "{text}");
        }
    }
}
