//! The spans both worker roles write for a request (tandem-telemetry exports them when traces are
//! on): the gRPC server span, whose parent is the caller's context in the call's metadata, and the
//! engine's phases recorded from the times it reports when the request leaves it.
//!
//! Names and attributes follow OpenTelemetry's RPC and GenAI conventions where they exist
//! (`rpc.*`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`,
//! `gen_ai.response.finish_reasons`); Tandem's own are under `tandem.`.

use std::time::{Duration, SystemTime};

use tandem_engine::{FinishReason, Finished};
use tandem_telemetry::{Attribute, OpenTelemetrySpanExt};
use tracing::field::Empty;

/// The server span of one worker RPC (`service`/`method`), a child of the caller's span when the
/// call's `metadata` carries a valid `traceparent`.
pub fn server_span(
    service: &'static str,
    method: &'static str,
    model: &str,
    request_id: &str,
    prompt_tokens: usize,
    metadata: &tonic::metadata::MetadataMap,
) -> tracing::Span {
    let span = tracing::info_span!(
        "worker_rpc",
        otel.name = %format_args!("{service}/{method}"),
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_description = Empty,
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
        gen_ai.request.model = %model,
        gen_ai.usage.input_tokens = prompt_tokens as i64,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.response.finish_reasons = Empty,
        tandem.request_id = %request_id,
        tandem.prefill.cached_tokens = Empty,
        tandem.preemptions = Empty,
    );
    tandem_telemetry::adopt(&span, metadata.as_ref());
    span
}

/// Marks `span` failed with `why`.
pub fn failed(span: &tracing::Span, why: &dyn std::fmt::Display) {
    span.record("otel.status_code", "error");
    span.record("otel.status_description", tracing::field::display(why));
}

/// The finish reason as the GenAI conventions spell it.
fn reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
        FinishReason::Cancelled => "cancelled",
        FinishReason::Error => "error",
    }
}

/// Records what the engine reported when `f` left it: totals on `span`, and the phases under it
/// as spans of their own, timed from `submitted` (when the engine got the request). `local` says
/// whether the prompt was prefilled by this engine (queue and prefill spans) or came from a
/// prefill worker (the remote prefill span already covers it).
pub fn finished(span: &tracing::Span, submitted: SystemTime, f: &Finished, local: bool) {
    if span.is_disabled() {
        return;
    }
    let output = f.output_ids.len() as i64;
    span.record("gen_ai.usage.output_tokens", output);
    span.record("gen_ai.response.finish_reasons", reason(f.finish_reason));
    span.record(
        "tandem.prefill.cached_tokens",
        f.cached_prompt_tokens as i64,
    );
    span.record("tandem.preemptions", i64::from(f.preemptions));
    let cx = span.context();
    let at = |s: f64| submitted + Duration::from_secs_f64(s.max(0.0));
    let prompt = f.prompt_ids.len() as i64;
    let cached = f.cached_prompt_tokens as i64;
    if local {
        tandem_telemetry::record_past(&cx, "queue", submitted, at(f.queue_s), Vec::new());
        if f.ttft_s > 0.0 {
            tandem_telemetry::record_past(
                &cx,
                "prefill",
                at(f.queue_s),
                at(f.ttft_s),
                vec![
                    Attribute::new("gen_ai.usage.input_tokens", prompt),
                    Attribute::new("tandem.prefill.computed_tokens", prompt - cached),
                    Attribute::new("tandem.prefill.cached_tokens", cached),
                ],
            );
        }
    }
    if f.ttft_s > 0.0 && output > 1 {
        let mut attrs = vec![Attribute::new("gen_ai.usage.output_tokens", output)];
        // Speculation's share of the decode: proposed tokens verified, and accepted.
        let (proposed, accepted) = f.spec_tokens;
        if proposed > 0 {
            attrs.push(Attribute::new(
                "tandem.spec_decode.draft_tokens",
                i64::from(proposed),
            ));
            attrs.push(Attribute::new(
                "tandem.spec_decode.accepted_tokens",
                i64::from(accepted),
            ));
        }
        tandem_telemetry::record_past(&cx, "decode", at(f.ttft_s), at(f.e2e_s), attrs);
    }
}
