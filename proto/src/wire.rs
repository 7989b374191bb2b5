//! The shared words of tandem-types on the worker API's wire: written once, for both ends.

use tandem_types::{ErrorKind, Grammar, SamplingParams, ValidSampling};

use crate::worker as pb;

/// A checked request's sampling and stopping as the worker API carries them.
pub fn sampling_to_wire(s: &ValidSampling) -> (pb::Sampling, pb::Stopping) {
    (
        pb::Sampling {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            seed: s.seed,
            top_logprobs: s.top_logprobs,
            grammar: s.grammar.as_ref().map(grammar_to_wire),
            logit_bias: s
                .logit_bias
                .iter()
                .map(|&(token, bias)| pb::TokenBias { token, bias })
                .collect(),
        },
        pb::Stopping {
            max_tokens: s.max_tokens,
            stop_token_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos,
        },
    )
}

/// What the worker API's messages ask for, still to be checked. A missing message is all
/// defaults, and a proto zero means "off" where zero is not a valid value (top_p and
/// repetition_penalty 0 read as 1); a missing `Stopping` leaves max_tokens at 0, which the check
/// refuses.
pub fn sampling_from_wire(s: Option<pb::Sampling>, stop: Option<pb::Stopping>) -> SamplingParams {
    let s = s.unwrap_or_default();
    let stop = stop.unwrap_or_default();
    let off_at_zero = |v: f32| if v == 0.0 { 1.0 } else { v };
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: off_at_zero(s.top_p),
        min_p: s.min_p,
        repetition_penalty: off_at_zero(s.repetition_penalty),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        top_logprobs: s.top_logprobs,
        max_tokens: stop.max_tokens,
        stop_token_ids: stop.stop_token_ids,
        ignore_eos: stop.ignore_eos,
        logit_bias: s.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
        grammar: s.grammar.and_then(grammar_from_wire),
    }
}

fn grammar_to_wire(g: &Grammar) -> pb::Grammar {
    use pb::grammar::Kind;
    let kind = match g {
        Grammar::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Grammar::JsonObject => Kind::JsonObject(pb::JsonObject {}),
        Grammar::Regex(r) => Kind::Regex(r.clone()),
        Grammar::Choice(o) => Kind::Choice(pb::Choice { options: o.clone() }),
        Grammar::Lark(l) => Kind::Lark(l.clone()),
    };
    pb::Grammar { kind: Some(kind) }
}

/// A grammar message with no kind set reads as no grammar (free text).
fn grammar_from_wire(g: pb::Grammar) -> Option<Grammar> {
    use pb::grammar::Kind;
    Some(match g.kind? {
        Kind::JsonSchema(s) => Grammar::JsonSchema(s),
        Kind::JsonObject(_) => Grammar::JsonObject,
        Kind::Regex(r) => Grammar::Regex(r),
        Kind::Choice(c) => Grammar::Choice(c.options),
        Kind::Lark(l) => Grammar::Lark(l),
    })
}

/// The gRPC code a failure of `kind` is answered with.
pub fn code(kind: ErrorKind) -> tonic::Code {
    match kind {
        ErrorKind::InvalidRequest => tonic::Code::InvalidArgument,
        ErrorKind::TooLarge => tonic::Code::OutOfRange,
        ErrorKind::Busy => tonic::Code::ResourceExhausted,
        ErrorKind::Unavailable => tonic::Code::Unavailable,
        ErrorKind::Unsupported => tonic::Code::FailedPrecondition,
        ErrorKind::Internal => tonic::Code::Internal,
    }
}

/// A status with the code of `kind`.
pub fn status(kind: ErrorKind, message: impl Into<String>) -> tonic::Status {
    tonic::Status::new(code(kind), message)
}

/// Metadata on a worker's failed stream whose engine failed (its thread panicked: a bug) while
/// the request ran. The router reports such a request's error and does not move it to another
/// worker: if the request itself set the panic off, it would take that worker down too.
pub const ENGINE_FAILED: &str = "tandem-engine-failed";

/// [`status`], marked [`ENGINE_FAILED`].
pub fn engine_failed_status(kind: ErrorKind, message: impl Into<String>) -> tonic::Status {
    let mut s = status(kind, message);
    s.metadata_mut().insert(
        ENGINE_FAILED,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    s
}

/// Metadata on a worker's stream that ended because the worker is draining and handed the
/// request over: the K/V it computed stays there, to be pulled by the worker that resumes it.
/// The router moves such a request without counting it against its migrations or taking the
/// worker for dead: it still serves those pulls.
pub const HANDED_OFF: &str = "tandem-handed-off";

/// An UNAVAILABLE status marked [`HANDED_OFF`].
pub fn handed_off_status(message: impl Into<String>) -> tonic::Status {
    let mut s = status(ErrorKind::Unavailable, message);
    s.metadata_mut()
        .insert(HANDED_OFF, tonic::metadata::MetadataValue::from_static("1"));
    s
}

/// Metadata on a worker's refusal because it is draining for shutdown: the router takes it
/// for draining (no new requests), not for dead (a peer can still pull the K/V it holds).
pub const DRAINING: &str = "tandem-draining";

/// An UNAVAILABLE status marked [`DRAINING`].
pub fn draining_status(message: impl Into<String>) -> tonic::Status {
    let mut s = status(ErrorKind::Unavailable, message);
    s.metadata_mut()
        .insert(DRAINING, tonic::metadata::MetadataValue::from_static("1"));
    s
}

/// Whether a refusal says its worker is draining ([`DRAINING`]).
pub fn is_draining(s: &tonic::Status) -> bool {
    s.metadata().get(DRAINING).is_some()
}

/// Whether a failed stream's status says its worker handed the request over ([`HANDED_OFF`]).
pub fn is_handed_off(s: &tonic::Status) -> bool {
    s.metadata().get(HANDED_OFF).is_some()
}

/// Whether a failed stream's status says its worker's engine failed ([`ENGINE_FAILED`]).
pub fn is_engine_failed(s: &tonic::Status) -> bool {
    s.metadata().get(ENGINE_FAILED).is_some()
}

/// What a gRPC answer's code says about whose fault it was (the inverse of [`code`]; a code no
/// Tandem worker sends reads as the kind closest to it).
pub fn kind(code: tonic::Code) -> ErrorKind {
    use tonic::Code as C;
    match code {
        C::InvalidArgument | C::NotFound | C::AlreadyExists | C::Unauthenticated => {
            ErrorKind::InvalidRequest
        }
        C::OutOfRange => ErrorKind::TooLarge,
        C::ResourceExhausted | C::Aborted => ErrorKind::Busy,
        C::Unavailable | C::Cancelled | C::DeadlineExceeded => ErrorKind::Unavailable,
        C::FailedPrecondition | C::Unimplemented | C::PermissionDenied => ErrorKind::Unsupported,
        C::Ok | C::Unknown | C::Internal | C::DataLoss => ErrorKind::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checked_request_crosses_the_wire_unchanged() {
        let v = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: -0.5,
            frequency_penalty: 0.25,
            seed: Some(7),
            top_logprobs: 5,
            max_tokens: 33,
            stop_token_ids: vec![2, 9],
            ignore_eos: true,
            logit_bias: vec![(5, -100.0), (17, 2.5)],
            grammar: Some(Grammar::JsonSchema(r#"{"type":"integer"}"#.into())),
        }
        .validate()
        .unwrap();
        let (s, stop) = sampling_to_wire(&v);
        let back = sampling_from_wire(Some(s), Some(stop)).validate().unwrap();
        assert_eq!(back, v);
        for g in [
            Grammar::JsonObject,
            Grammar::Regex("a+".into()),
            Grammar::Choice(vec!["x".into(), "y".into()]),
            Grammar::Lark("start: \"a\"".into()),
        ] {
            let p = SamplingParams {
                grammar: Some(g),
                ..Default::default()
            };
            let v = p.clone().validate().unwrap();
            let (s, stop) = sampling_to_wire(&v);
            assert_eq!(sampling_from_wire(Some(s), Some(stop)), p);
        }
        let greedy = ValidSampling::default();
        let (s, stop) = sampling_to_wire(&greedy);
        assert_eq!(
            sampling_from_wire(Some(s), Some(stop)).validate().unwrap(),
            greedy
        );
    }

    #[test]
    fn zeros_mean_off_and_a_missing_stopping_is_refused() {
        let p = sampling_from_wire(
            None,
            Some(pb::Stopping {
                max_tokens: 4,
                ..Default::default()
            }),
        );
        assert_eq!(p.top_p, 1.0);
        assert_eq!(p.repetition_penalty, 1.0);
        assert!(p.validate().is_ok());
        assert_eq!(
            sampling_from_wire(None, None).validate(),
            Err(tandem_types::SamplingError::MaxTokens)
        );
    }

    #[test]
    fn every_kind_survives_the_round_trip_through_its_code() {
        for k in [
            ErrorKind::InvalidRequest,
            ErrorKind::TooLarge,
            ErrorKind::Busy,
            ErrorKind::Unavailable,
            ErrorKind::Unsupported,
            ErrorKind::Internal,
        ] {
            assert_eq!(kind(code(k)), k);
        }
    }
}
