//! Prometheus exposition of a worker's state at scrape time, served as `/metrics` on the worker's
//! gRPC port (plain HTTP/1.1 is accepted there for it).
//!
//! Values live where they are counted (the engine's stats, the KV receiver's atomics, the remote
//! prefill counts); each role's [`Collector`] reads them on each scrape, so nothing is counted
//! twice. This module holds what both roles write: the families' encoders, the engine's own
//! metrics, and the `/metrics` route.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tandem_engine::EngineStats;

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

/// Requests and KV pool occupancy of an engine.
pub fn engine_metrics(enc: &mut DescriptorEncoder, s: &EngineStats) -> std::fmt::Result {
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
    )
}

/// The text exposition of `collector`.
pub fn render(collector: impl Collector) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(collector));
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        tracing::error!(error = %e, "encoding metrics");
    }
    out
}

/// `GET /metrics` answering with `render(make())`.
pub fn router<C: Collector + Clone>(collector: C) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let c = collector.clone();
            async move {
                (
                    [(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)],
                    render(c),
                )
            }
        }),
    )
}
