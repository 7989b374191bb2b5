//! The prefill worker's measures for `/metrics`: what it has served since start, and the
//! collector that reads them with the engine's gauges and the per-request measures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::histogram::Histogram;
use tandem_worker::metrics::{
    counter, engine_metrics, expert_metrics, gauge, seconds, seconds_counter,
};

use crate::Shared;

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

/// The collector `/metrics` reads: the engine's gauges, the per-request measures and
/// [`PrefillCounts`].
#[derive(Clone)]
pub(crate) struct Metrics(pub(crate) Arc<Shared>);

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
        expert_metrics(&mut enc, s.engine.expert_load().as_deref())?;
        s.requests.encode(&mut enc, &stats)?;
        s.identity.loras.encode(&mut enc)?;
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
