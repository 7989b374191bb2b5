//! Prometheus exposition of a worker's state at scrape time, served as `/metrics` on the worker's
//! gRPC port (plain HTTP/1.1 is accepted there for it).
//!
//! Values live where they are counted (the engine's stats, the KV receiver's atomics, the remote
//! prefill counts); each role's [`Collector`] reads them on each scrape, so nothing is counted
//! twice. This module holds what both roles write: the families' encoders, the engine's own
//! metrics, and the `/metrics` route.

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use tandem_engine::{EngineStats, FinishReason, Finished, Limits};

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Writes a counter family: `name` gets `_total` appended, `help` a full stop; one sample per
/// label set (one sample without labels is written bare).
pub fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: &[(&[(&str, &str)], u64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    if let [(&[], v)] = samples {
        return ConstCounter::new(*v).encode(m);
    }
    for (labels, v) in samples {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// Writes a gauge family; one sample per label set.
pub fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: &[(&[(&str, &str)], i64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in samples {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// Requests, KV pool occupancy and tensor-parallel ranks of an engine, from its `stats` and
/// `limits`.
pub fn engine_metrics(
    enc: &mut DescriptorEncoder,
    s: &EngineStats,
    limits: &Limits,
) -> std::fmt::Result {
    gauge(
        enc,
        "tandem_requests",
        "Requests in the engine by state",
        &[
            (&[("state", "running")], s.running as i64),
            (&[("state", "waiting")], s.waiting as i64),
        ],
    )?;
    gauge(
        enc,
        "tandem_kv_blocks",
        "KV cache blocks by state",
        &[
            (&[("state", "used")], s.blocks_used as i64),
            (&[("state", "cached")], s.blocks_cached as i64),
            (&[("state", "free")], s.blocks_free as i64),
        ],
    )?;
    counter(
        enc,
        "tandem_prefix_cache_lookup_tokens",
        "Prompt tokens looked up in the prefix cache",
        &[(&[], s.prefix_lookup_tokens)],
    )?;
    counter(
        enc,
        "tandem_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache",
        &[(&[], s.prefix_hit_tokens)],
    )?;
    counter(
        enc,
        "tandem_preemptions",
        "Sequences preempted for lack of KV blocks",
        &[(&[], s.preemptions)],
    )?;
    let r = &s.resumed;
    counter(
        enc,
        "tandem_resumed_requests",
        "Requests resumed here after a move from a worker that died or drained",
        &[(&[], r.requests)],
    )?;
    counter(
        enc,
        "tandem_resumed_kv_tokens",
        "Tokens of resumed requests whose KV existed before the move, by whether it was found (here or at the worker pulled from) or computed again",
        &[
            (&[("kv", "found")], r.context_tokens - r.recomputed_tokens),
            (&[("kv", "recomputed")], r.recomputed_tokens),
        ],
    )?;
    gauge(
        enc,
        "tandem_kv_parked_tails",
        "Partly filled KV blocks of handed-off sequences kept for the workers that resume them, by whether one has pulled them",
        &[
            (&[("pulled", "no")], (s.parked_tails.0 - s.parked_tails.1) as i64),
            (&[("pulled", "yes")], s.parked_tails.1 as i64),
        ],
    )?;
    spec_metrics(enc, s)?;
    gauge(
        enc,
        "tandem_tp_ranks",
        "Tensor-parallel ranks the engine's steps run on",
        &[(&[], limits.tensor_parallel as i64)],
    )?;
    seconds_counter(
        enc,
        "tandem_tp_collective",
        "Time the tensor-parallel ranks spent in collectives (all-reduces and the logits gather, waiting for peers included), the mean over ranks",
        s.collective_seconds,
    )?;
    disk_metrics(enc, s)
}

/// Speculative decoding (`--speculative`), in vLLM's `spec_decode` terms: proposals verified,
/// their tokens, the accepted ones, by position in the proposal (positions up to the last
/// that ever accepted one), and the tokens the policy held back. Zeros without speculation.
fn spec_metrics(enc: &mut DescriptorEncoder, s: &EngineStats) -> std::fmt::Result {
    let c = &s.spec;
    let counts = [
        (
            "tandem_spec_decode_num_drafts",
            "Speculative proposals verified (one per sequence and step)",
            c.drafts,
        ),
        (
            "tandem_spec_decode_num_draft_tokens",
            "Proposed tokens verified",
            c.draft_tokens,
        ),
        (
            "tandem_spec_decode_num_accepted_tokens",
            "Proposed tokens accepted (the target drew the proposed token)",
            c.accepted_tokens,
        ),
        (
            "tandem_spec_decode_num_withheld_tokens",
            "Proposed tokens not verified: the measured step cost said they would not pay",
            c.withheld_tokens,
        ),
        (
            "tandem_spec_decode_num_draft_prefill_tokens",
            "Tokens a draft model computed to catch sequences up (their prompts, and what verification emitted past its proposals), not proposing",
            c.draft_prefill_tokens,
        ),
        (
            "tandem_spec_decode_num_plain_steps",
            "Steps decoded without speculating because speculating steps were measured to make tokens more slowly at that batch size (or to measure plain steps)",
            c.plain_steps,
        ),
    ];
    for (name, help, v) in counts {
        counter(enc, name, help, &[(&[], v)])?;
    }
    let last = c
        .accepted_per_position
        .iter()
        .rposition(|&n| n > 0)
        .unwrap_or(0);
    let positions: Vec<String> = (0..=last).map(|p| p.to_string()).collect();
    let labels: Vec<[(&str, &str); 1]> = positions
        .iter()
        .map(|p| [("position", p.as_str())])
        .collect();
    let samples: Vec<(&[(&str, &str)], u64)> = labels
        .iter()
        .zip(&c.accepted_per_position)
        .map(|(l, &n)| (l.as_slice(), n))
        .collect();
    counter(
        enc,
        "tandem_spec_decode_num_accepted_tokens_per_pos",
        "Proposed tokens accepted, by position in the proposal (0: the first proposed)",
        &samples,
    )
}

/// The KV disk tier (`--kv-disk-dir`): what it holds, its traffic and latency, its refusals,
/// and what the engine did with it. Nothing without a tier.
fn disk_metrics(enc: &mut DescriptorEncoder, s: &EngineStats) -> std::fmt::Result {
    let Some(t) = &s.disk_tier else {
        return Ok(());
    };
    let d = &s.disk;
    gauge(
        enc,
        "tandem_kv_disk_blocks",
        "KV blocks held in the disk tier",
        &[(&[], t.blocks as i64)],
    )?;
    gauge(
        enc,
        "tandem_kv_disk_bytes",
        "Bytes of KV block files in the disk tier, and its capacity",
        &[
            (&[("kind", "used")], t.bytes as i64),
            (&[("kind", "capacity")], t.capacity_bytes as i64),
        ],
    )?;
    gauge(
        enc,
        "tandem_kv_disk_waiting_requests",
        "Requests waiting aside for their prefix's blocks from the disk tier",
        &[(&[], s.loading as i64)],
    )?;
    counter(
        enc,
        "tandem_kv_disk_blocks_written",
        "KV blocks the pool evicted and the disk tier wrote",
        &[(&[], t.writes)],
    )?;
    counter(
        enc,
        "tandem_kv_disk_blocks_read",
        "KV blocks read back from the disk tier into the pool",
        &[(&[], d.promoted)],
    )?;
    counter(
        enc,
        "tandem_kv_disk_bytes_moved",
        "Payload bytes written to and read from the disk tier",
        &[
            (&[("direction", "write")], t.write_bytes),
            (&[("direction", "read")], t.read_bytes),
        ],
    )?;
    seconds_counter(
        enc,
        "tandem_kv_disk_write",
        "Time the disk tier spent writing block files",
        t.write_seconds,
    )?;
    seconds_counter(
        enc,
        "tandem_kv_disk_read",
        "Time the disk tier spent reading and checking block files",
        t.read_seconds,
    )?;
    counter(
        enc,
        "tandem_kv_disk_refusals",
        "KV blocks the disk tier refused or lost, by reason",
        &[
            (&[("reason", "checksum")], t.checksum_failures),
            (&[("reason", "torn_at_start")], t.torn),
            (&[("reason", "write_error")], t.write_errors),
            (&[("reason", "queue_full")], t.write_dropped),
            (&[("reason", "read_failed")], d.load_failures),
        ],
    )?;
    counter(
        enc,
        "tandem_kv_disk_evictions",
        "KV blocks the disk tier removed to keep within its capacity",
        &[(&[], t.evictions)],
    )?;
    counter(
        enc,
        "tandem_kv_disk_wait_expired",
        "Requests that stopped waiting for their blocks from disk and computed them",
        &[(&[], d.wait_expired)],
    )
}

/// A mixture of experts' load: rows each expert has computed (summed over the layers), one
/// sample per expert, labelled by its index. Nothing for a dense model.
pub fn expert_metrics(enc: &mut DescriptorEncoder, load: Option<&[u64]>) -> std::fmt::Result {
    let Some(load) = load else {
        return Ok(());
    };
    let mut m = enc.encode_descriptor(
        "tandem_expert_rows",
        "Rows each expert of a mixture of experts computed, over the layers",
        None,
        MetricType::Counter,
    )?;
    for (e, &v) in load.iter().enumerate() {
        let e = e.to_string();
        ConstCounter::new(v).encode(m.encode_family(&[("expert", e.as_str())])?)?;
    }
    Ok(())
}

/// Writes a counter of seconds, one sample (`name` gets `_seconds_total` appended).
pub fn seconds_counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    secs: f64,
) -> std::fmt::Result {
    let m = enc.encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Counter)?;
    ConstCounter::new(secs).encode(m)
}

/// Bucket bounds in seconds for times from milliseconds (a GPU's first token) to minutes (a long
/// prompt queued on a CPU): roughly three per decade.
const LATENCY_BUCKETS: [f64; 22] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
];

/// Bucket bounds in seconds for whole requests and their phases.
const REQUEST_BUCKETS: [f64; 20] = [
    0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0,
];

/// The finish reasons requests are counted by, as vLLM names them (Stop, Length, Cancelled).
const FINISH_REASONS: [&str; 4] = ["stop", "length", "abort", "error"];

/// The per-request measures and engine gauges an operator's vLLM dashboards chart, with vLLM's
/// meaning and units under Tandem's prefix (`vllm:time_to_first_token_seconds` is
/// `tandem_time_to_first_token_seconds`, ...; the README's metrics table maps every one), each
/// labelled (like every family of a worker's page: [`router`] sets them on the registry) with
/// `model_name` and `role`. Observed where a request's events reach the worker's
/// gRPC edge, so the engine loop does no more work for them.
#[derive(Debug)]
pub struct RequestMetrics {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    prefill: Histogram,
    decode: Histogram,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    finished: [Counter; 4],
}

impl RequestMetrics {
    /// Empty measures.
    pub fn new() -> Self {
        let latency = || Histogram::new(LATENCY_BUCKETS);
        let request = || Histogram::new(REQUEST_BUCKETS);
        Self {
            ttft: latency(),
            itl: latency(),
            e2e: request(),
            queue: request(),
            prefill: request(),
            decode: request(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            finished: Default::default(),
        }
    }

    /// The gap between two consecutive tokens of one request.
    pub fn token_gap(&self, gap: Duration) {
        self.itl.observe(gap.as_secs_f64());
    }

    /// A request left the engine: its phases' times, its tokens, why it ended.
    pub fn finished(&self, f: &Finished) {
        self.e2e.observe(f.e2e_s);
        self.queue.observe(f.queue_s);
        if f.ttft_s > 0.0 {
            self.ttft.observe(f.ttft_s);
            self.prefill.observe((f.ttft_s - f.queue_s).max(0.0));
            self.decode.observe((f.e2e_s - f.ttft_s).max(0.0));
        }
        self.prompt_tokens.inc_by(f.prompt_ids.len() as u64);
        // Tokens sampled by this engine (a resumed request's earlier ones were counted where
        // they were sampled).
        self.generation_tokens.inc_by(f.logprobs.len() as u64);
        let i = match f.finish_reason {
            FinishReason::Stop => 0,
            FinishReason::Length => 1,
            FinishReason::Cancelled => 2,
            FinishReason::Error => 3,
        };
        self.finished[i].inc();
    }

    /// Writes the measures, and the engine gauges of `s`, in vLLM's terms.
    pub fn encode(&self, enc: &mut DescriptorEncoder, s: &EngineStats) -> std::fmt::Result {
        // The module's `gauge` writes integers; these are fractions.
        let gauge = |enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64| {
            let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(v).encode(m)
        };
        gauge(
            enc,
            "tandem_num_requests_running",
            "Requests in the running batch",
            s.running as f64,
        )?;
        gauge(
            enc,
            "tandem_num_requests_waiting",
            "Requests waiting to be admitted",
            s.waiting as f64,
        )?;
        let usage = if s.blocks_total == 0 {
            0.0
        } else {
            s.blocks_used as f64 / s.blocks_total as f64
        };
        gauge(
            enc,
            "tandem_kv_cache_usage_perc",
            "Fraction of KV cache blocks held by requests (1 = full)",
            usage,
        )?;
        let counts = [
            (
                "tandem_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                s.prefix_lookup_tokens,
            ),
            (
                "tandem_prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                s.prefix_hit_tokens,
            ),
            (
                "tandem_prompt_tokens",
                "Prompt tokens of finished requests",
                self.prompt_tokens.get(),
            ),
            (
                "tandem_generation_tokens",
                "Tokens generated (sampled by this worker)",
                self.generation_tokens.get(),
            ),
        ];
        for (name, help, v) in counts {
            counter(enc, name, help, &[(&[], v)])?;
        }
        let by_reason: Vec<[(&str, &str); 1]> = FINISH_REASONS
            .iter()
            .map(|reason| [("finished_reason", *reason)])
            .collect();
        let samples: Vec<(&[(&str, &str)], u64)> = by_reason
            .iter()
            .zip(&self.finished)
            .map(|(l, c)| (l.as_slice(), c.get()))
            .collect();
        counter(
            enc,
            "tandem_request_success",
            "Requests finished, by finish reason",
            &samples,
        )?;
        let hists: [(&str, &str, &Histogram); 6] = [
            (
                "tandem_time_to_first_token",
                "Time from arrival to the first token",
                &self.ttft,
            ),
            (
                "tandem_inter_token_latency",
                "Time between consecutive tokens of a request",
                &self.itl,
            ),
            (
                "tandem_e2e_request_latency",
                "Time from arrival to the last token",
                &self.e2e,
            ),
            (
                "tandem_request_queue_time",
                "Time a request waited before admission",
                &self.queue,
            ),
            (
                "tandem_request_prefill_time",
                "Time from admission to the first token",
                &self.prefill,
            ),
            (
                "tandem_request_decode_time",
                "Time from the first token to the last",
                &self.decode,
            ),
        ];
        for (name, help, h) in hists {
            seconds(enc, name, help, h)?;
        }
        Ok(())
    }
}

impl Default for RequestMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Writes a histogram family of seconds (`name` gets `_seconds` appended).
pub fn seconds(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    h: &Histogram,
) -> std::fmt::Result {
    let m = enc.encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
    h.encode(m)
}

/// A histogram with the bounds of [`seconds`]' latency families (1 ms to about 11 minutes).
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The text exposition of `collector`, every sample labelled with `labels` (a worker's
/// `model_name` and `role`).
pub fn render(collector: impl Collector, labels: &[(&'static str, String)]) -> String {
    let mut registry = Registry::with_labels(labels.iter().map(|(k, v)| {
        (
            std::borrow::Cow::Borrowed(*k),
            std::borrow::Cow::Owned(v.clone()),
        )
    }));
    registry.register_collector(Box::new(collector));
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        tracing::error!(error = %e, "encoding metrics");
    }
    out
}

/// `GET /metrics` answering with `collector`'s families, every sample labelled `model_name` and
/// `role` (as vLLM's dashboards select them).
pub fn router<C: Collector + Clone>(collector: C, model: &str, role: &str) -> axum::Router {
    let labels = std::sync::Arc::new([
        ("model_name", model.to_string()),
        ("role", role.to_string()),
    ]);
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let c = collector.clone();
            let labels = labels.clone();
            async move {
                (
                    [(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)],
                    render(c, labels.as_slice()),
                )
            }
        }),
    )
}
