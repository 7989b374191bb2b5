//! The router's spans of a request: the API call (HTTP or gRPC; its parent is the client's
//! `traceparent`), the routing decision, and each migration. The decode worker's span hangs from
//! the routing decision (or the migration) through the trace context the worker client puts in
//! the call's metadata. Attributes follow OpenTelemetry's GenAI conventions where they exist.

use tracing::field::Empty;

use crate::dispatch::{FinishKind, Prepared, Usage};

/// The span of one API call named `name` (`POST /v1/completions`, `tandem.v1.Generation/Generate`)
/// doing the GenAI `operation`, a child of the caller's context in `headers` when it is valid.
pub(crate) fn request_span(
    name: &'static str,
    operation: &'static str,
    headers: &axum::http::HeaderMap,
) -> tracing::Span {
    let span = tracing::info_span!(
        "api_request",
        otel.name = name,
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_description = Empty,
        gen_ai.operation.name = operation,
        gen_ai.request.model = Empty,
        gen_ai.request.max_tokens = Empty,
        gen_ai.request.temperature = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.response.finish_reasons = Empty,
        tandem.request_id = Empty,
        tandem.migrations = Empty,
        tandem.tenant = Empty,
        tandem.tenant.priority = Empty,
        tandem.queue.wait_ms = Empty,
    );
    tandem_telemetry::adopt(&span, headers);
    span
}

/// Records what the request asks for, once it is prepared, and makes `span` its trace, the
/// request `caller`'s.
pub(crate) fn prepared(
    span: tracing::Span,
    model: &str,
    prep: Prepared,
    caller: &crate::flow::Caller,
) -> Prepared {
    if !span.is_disabled() {
        span.record("gen_ai.request.model", model);
        span.record("gen_ai.usage.input_tokens", prep.prompt.len() as i64);
        span.record("tandem.request_id", prep.request_id.as_str());
        if let Some(t) = prep.params.temperature {
            span.record("gen_ai.request.temperature", f64::from(t));
        }
        if let Some(m) = prep.params.max_tokens {
            span.record("gen_ai.request.max_tokens", m as i64);
        }
    }
    prep.traced(span).for_caller(caller.clone())
}

/// Marks `span` failed with `e`.
pub(crate) fn failed(span: &tracing::Span, e: &dyn std::fmt::Display) {
    span.record("otel.status_code", "error");
    span.record("otel.status_description", tracing::field::display(e));
}

/// Records how the request ended.
pub(crate) fn finished(span: &tracing::Span, kind: FinishKind, usage: &Usage) {
    span.record(
        "gen_ai.usage.output_tokens",
        i64::from(usage.completion_tokens),
    );
    span.record("gen_ai.response.finish_reasons", kind.as_openai());
}
