//! tandem-telemetry: one request, one trace, across the router and the decode and prefill workers.
//!
//! Owns: [`init`] (the process's log output and, when an OTLP endpoint is configured, an
//! OpenTelemetry span exporter), W3C trace-context propagation over HTTP headers and gRPC
//! metadata ([`adopt`], [`inject`]) and as the KV wire's context text ([`context_text`],
//! [`from_context_text`]), and [`record_past`] for phases whose times the engine reports once
//! they are over (queue, prefill, decode).
//!
//! Spans are `tracing` spans; the `tracing-opentelemetry` layer turns those of Tandem's own
//! crates (info level and above) into OpenTelemetry spans only while exporting. With no endpoint
//! configured that layer is not installed, info spans are disabled at their call sites and the
//! global tracer is OpenTelemetry's no-op one, so tracing off costs a relaxed load per span.
//!
//! Configuration is OpenTelemetry's own environment: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns export on, `OTEL_SDK_DISABLED=true` off again;
//! `OTEL_SERVICE_NAME` and
//! `OTEL_RESOURCE_ATTRIBUTES` name the service (default `tandem-<role>`);
//! `OTEL_TRACES_SAMPLER`/`_ARG`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS`, `_TIMEOUT` and
//! `_COMPRESSION` are honoured by the SDK. Only the gRPC protocol is built in.

#![deny(missing_docs)]

use std::collections::HashMap;
use std::time::SystemTime;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, SpanBuilder, SpanKind, TraceContextExt, Tracer as _};
use opentelemetry::{global, KeyValue};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

pub use opentelemetry::Context;
pub use opentelemetry::KeyValue as Attribute;
pub use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The instrumentation scope every Tandem span is recorded under.
const SCOPE: &str = "tandem";

/// What [`init`] installed; dropping it flushes and stops the span exporter.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// The exporter's gRPC client lives on this runtime (the batch processor exports from its own
    /// thread, outside any runtime the role builds).
    _runtime: Option<tokio::runtime::Runtime>,
}

impl Telemetry {
    /// True when spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("warning: flushing traces at exit: {e}");
            }
        }
    }
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// An `OTEL_*` setting names something this build cannot do or is malformed.
    #[error("{0}")]
    Config(String),
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The OTLP endpoint traces go to, when one is configured.
pub fn endpoint() -> Option<String> {
    env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
}

/// Installs the process's subscriber: log lines on stderr filtered by `log_filter` (an
/// `EnvFilter` directive), and, when an OTLP endpoint is configured, span export as `service`
/// (unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` names it). The W3C trace-context
/// propagator is installed either way.
pub fn init(service: &str, log_filter: &str) -> Result<Telemetry, TelemetryError> {
    global::set_text_map_propagator(TraceContextPropagator::new());
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(tracing_subscriber::EnvFilter::new(log_filter));
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let Some(endpoint) = endpoint().filter(|_| !disabled) else {
        tracing_subscriber::registry().with(logs).init();
        return Ok(Telemetry {
            provider: None,
            _runtime: None,
        });
    };
    let protocol =
        env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"));
    if let Some(p) = protocol.filter(|p| p != "grpc") {
        return Err(TelemetryError::Config(format!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={p}: this build exports traces over OTLP/gRPC only (set it to grpc or unset it)"
        )));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(|e| TelemetryError::Config(format!("starting the trace exporter: {e}")))?;
    let exporter = {
        let _in = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| TelemetryError::Config(format!("OTLP endpoint {endpoint}: {e}")))?
    };
    let named = env("OTEL_SERVICE_NAME").is_some()
        || env("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
    let mut resource = Resource::builder();
    if !named {
        resource = resource.with_service_name(service.to_string());
    }
    let resource = resource
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    global::set_tracer_provider(provider.clone());
    use opentelemetry::trace::TracerProvider as _;
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SCOPE))
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target().starts_with("tandem") && *m.level() <= tracing::Level::INFO
        }));
    tracing_subscriber::registry().with(logs).with(spans).init();
    Ok(Telemetry {
        provider: Some(provider),
        _runtime: Some(runtime),
    })
}

/// Whether `traceparent` has W3C's shape: `version-traceid-parentid-flags`, lowercase hex of 2,
/// 32, 16 and 2 digits (a later version may append fields). OpenTelemetry's own parser accepts
/// shorter ids, which the recommendation says to ignore; the values themselves (all-zero ids,
/// version `ff`) are left to it.
fn well_formed(traceparent: &str) -> bool {
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let parts: Vec<&str> = traceparent.trim().split('-').collect();
    parts.len() >= 4
        && hex(parts[0], 2)
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && (parts[0] != "00" || parts.len() == 4)
}

/// Makes the caller's trace context in `headers` (HTTP headers or gRPC metadata: `traceparent`,
/// `tracestate`) the parent of `span`. A missing or malformed `traceparent` leaves `span` the root
/// of a new trace.
pub fn adopt(span: &tracing::Span, headers: &http::HeaderMap) {
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok());
    if !traceparent.is_some_and(well_formed) {
        return;
    }
    let cx = global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    if cx.span().span_context().is_valid() {
        // Fails only for a span that is disabled or already started, which has no parent to set.
        let _ = span.set_parent(cx);
    }
}

/// Writes `span`'s trace context into outgoing `headers` (HTTP headers or gRPC metadata).
pub fn inject(span: &tracing::Span, headers: &mut http::HeaderMap) {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        global::get_text_map_propagator(|p| p.inject_context(&cx, &mut HeaderInjector(headers)));
    }
}

/// `span`'s trace context as the KV wire carries it: the `traceparent` value, then a newline and
/// the `tracestate` value when there is one. `None` when `span` is not being traced.
pub fn context_text(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    let parent = carrier.remove("traceparent")?;
    Some(
        match carrier.remove("tracestate").filter(|s| !s.is_empty()) {
            Some(state) => format!("{parent}\n{state}"),
            None => parent,
        },
    )
}

/// The context [`context_text`] wrote; `None` for anything malformed (the receiver's span then
/// starts from its own context).
pub fn from_context_text(text: &str) -> Option<Context> {
    let mut lines = text.splitn(2, '\n');
    let mut carrier = HashMap::new();
    let parent = lines.next().filter(|p| well_formed(p))?;
    carrier.insert("traceparent".to_string(), parent.to_string());
    if let Some(s) = lines.next() {
        carrier.insert("tracestate".to_string(), s.to_string());
    }
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// Records a finished span named `name` from `start` to `end` under `parent` (for phases the
/// engine times itself). Nothing is recorded when `parent` holds no traced span.
pub fn record_past(
    parent: &Context,
    name: &'static str,
    start: SystemTime,
    end: SystemTime,
    attributes: Vec<KeyValue>,
) {
    if !parent.span().span_context().is_valid() {
        return;
    }
    let tracer = global::tracer(SCOPE);
    let mut span = tracer.build_with_context(
        SpanBuilder::from_name(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attributes),
        parent,
    );
    span.end_with_timestamp(end.max(start));
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    fn remote(trace: u128, span: u64) -> Context {
        Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        ))
    }

    #[test]
    fn context_text_round_trips_and_rejects_garbage() {
        let cx = remote(0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331);
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        let text = carrier["traceparent"].clone();
        assert_eq!(
            text,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        let back = from_context_text(&text).expect("valid");
        assert_eq!(
            back.span().span_context().trace_id(),
            TraceId::from(0x0af7651916cd43dd8448eb211c80319c)
        );
        assert_eq!(
            back.span().span_context().span_id(),
            SpanId::from(0xb7ad6b7169203331)
        );
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b71692033-01",
        ] {
            assert!(
                from_context_text(bad).is_none(),
                "{bad:?} must start a new trace"
            );
        }
        let with_state = from_context_text(&format!("{text}\nvendor=abc")).expect("valid");
        assert_eq!(
            with_state.span().span_context().trace_state().get("vendor"),
            Some("abc")
        );
    }

    #[test]
    fn an_untraced_parent_records_nothing_and_does_not_panic() {
        let now = SystemTime::now();
        record_past(&Context::new(), "queue", now, now, Vec::new());
        assert!(context_text(&tracing::Span::none()).is_none());
        let mut h = http::HeaderMap::new();
        inject(&tracing::Span::none(), &mut h);
        assert!(h.is_empty());
    }
}
