//! A decode worker's metrics: the engine's (tandem-worker writes those for both roles) and its
//! KV ingress: grants, bytes, rejected frames, remote prefill attempts and fallbacks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tandem_engine::EngineHandle;
use tandem_worker::metrics::{
    counter, engine_metrics, expert_metrics, gauge, seconds, RequestMetrics,
};

use crate::remote::RemotePrefill;

/// A decode worker's metrics.
#[derive(Clone)]
pub struct DecodeMetrics {
    /// The engine whose stats are exported.
    pub engine: Arc<EngineHandle>,
    /// Remote prefill's counts and the KV receiver's refusals, when on.
    pub remote: Option<Arc<RemotePrefill>>,
    /// Per-request measures in vLLM's terms.
    pub requests: Arc<RequestMetrics>,
    /// The LoRA adapters it serves.
    pub loras: Arc<tandem_worker::Loras>,
}

impl std::fmt::Debug for DecodeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DecodeMetrics")
    }
}

impl Collector for DecodeMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let stats = self.engine.stats();
        engine_metrics(&mut enc, &stats, &self.engine.limits())?;
        expert_metrics(&mut enc, self.engine.expert_load().as_deref())?;
        self.requests.encode(&mut enc, &stats)?;
        self.loras.encode(&mut enc)?;
        let Some(r) = &self.remote else {
            return Ok(());
        };
        let rx = r.receiver();
        gauge(
            &mut enc,
            "tandem_kv_grants_open",
            "KV block grants waiting for a prefill worker's frames",
            &[(&[], rx.open_grants() as i64)],
        )?;
        counter(
            &mut enc,
            "tandem_kv_transfer_bytes",
            "KV payload bytes received into granted blocks",
            &[(&[], rx.bytes_received())],
        )?;
        counter(
            &mut enc,
            "tandem_kv_link_bytes",
            "Of the KV payload bytes received, those that came on a payload link beside the connection (NCCL between GPUs)",
            &[(&[], rx.link_bytes_received())],
        )?;
        let answers = rx.link_answers();
        let samples: Vec<([(&str, &str); 1], u64)> = answers
            .iter()
            .map(|(a, n)| ([("answer", a.name())], *n))
            .collect();
        let samples: Vec<(&[(&str, &str)], u64)> =
            samples.iter().map(|(l, n)| (&l[..], *n)).collect();
        counter(
            &mut enc,
            "tandem_kv_link_offers",
            "Payload links prefill workers offered, by this worker's answer: joined (payloads on the link), busy (a pair still in use: that transfer over TCP), declined (no room or a pair gone), never (no fabric of the kind, or the same device)",
            &samples,
        )?;
        let ranks: Vec<(String, u64)> = r
            .rank_bytes()
            .into_iter()
            .enumerate()
            .map(|(i, b)| (i.to_string(), b))
            .collect();
        let labels: Vec<[(&str, &str); 1]> =
            ranks.iter().map(|(i, _)| [("rank", i.as_str())]).collect();
        let samples: Vec<(&[(&str, &str)], u64)> = labels
            .iter()
            .zip(&ranks)
            .map(|(l, (_, b))| (&l[..], *b))
            .collect();
        counter(
            &mut enc,
            "tandem_kv_transfer_rank_bytes",
            "KV payload bytes written into each tensor-parallel rank's pool (a replicated head's bytes into each rank that holds it)",
            &samples,
        )?;
        let rejected: Vec<(Vec<(&str, &str)>, u64)> = rx
            .rejections()
            .snapshot()
            .into_iter()
            .map(|(reason, n)| (vec![("reason", reason)], n))
            .collect();
        let samples: Vec<(&[(&str, &str)], u64)> =
            rejected.iter().map(|(l, n)| (l.as_slice(), *n)).collect();
        counter(
            &mut enc,
            "tandem_kv_transfer_rejected_frames",
            "KV frames refused, by reason",
            &samples,
        )?;
        let c = &r.counts;
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut enc,
            "tandem_kv_transfers",
            "Remote prefill attempts by result (a failed one moves on to the next candidate)",
            &[
                (&[("result", "ok")], l(&c.transfers_ok)),
                (&[("result", "failed")], l(&c.transfers_failed)),
                (&[("result", "refused")], l(&c.transfers_refused)),
            ],
        )?;
        let reasons: Vec<([(&str, &str); 1], u64)> = crate::remote::Failure::ALL
            .iter()
            .map(|f| ([("reason", f.as_str())], l(&c.failures[*f as usize])))
            .collect();
        let samples: Vec<(&[(&str, &str)], u64)> =
            reasons.iter().map(|(l, n)| (l.as_slice(), *n)).collect();
        counter(
            &mut enc,
            "tandem_kv_transfer_failures",
            "Remote prefill attempts that failed, by reason",
            &samples,
        )?;
        seconds(
            &mut enc,
            "tandem_kv_transfer_duration",
            "Time from granting a transfer its blocks to the last one arriving",
            &c.duration,
        )?;
        counter(
            &mut enc,
            "tandem_remote_prefill_local_fallbacks",
            "Remote plans prefilled here instead, by why",
            &[
                (&[("reason", "all_candidates_failed")], l(&c.fallbacks)),
                (&[("reason", "no_room")], l(&c.no_room)),
            ],
        )
    }
}
