//! The one place where router failures become HTTP statuses, OpenAI error bodies and gRPC codes.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tandem_types::ErrorKind;

use crate::workers::WorkerAddr;

/// Why a request was refused or failed, in the client's terms. Each variant has one HTTP status
/// ([`status`](Self::status)), one OpenAI error body ([`body`](Self::body)) and one gRPC code
/// ([`grpc`](Self::grpc)).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something out of range. `param` names the field.
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for the client.
        message: String,
        /// The request field at fault, when one is.
        param: Option<&'static str>,
    },
    /// Prompt and `max_tokens` together do not fit the model's context.
    #[error("the prompt has {prompt} tokens and asks for {max_tokens} more, but the model's context is {context} tokens: shorten the prompt or lower max_tokens")]
    ContextLength {
        /// Tokens in the prompt.
        prompt: usize,
        /// Output tokens asked for (or defaulted).
        max_tokens: usize,
        /// The model's context in tokens.
        context: usize,
    },
    /// What the request names (a stored response) is not here. `param` names the field that
    /// named it (none for a path), `code` the kind of thing missing.
    #[error("{message}")]
    NotFound {
        /// What is missing, for the client.
        message: String,
        /// The request field that named it, when one did.
        param: Option<&'static str>,
        /// OpenAI's code (`not_found`, `previous_response_not_found`).
        code: &'static str,
    },
    /// The request names a model this router does not serve.
    #[error("model {0:?} is not served here: GET /v1/models lists what is")]
    ModelNotFound(String),
    /// No API key, or a wrong one; the text says which, never the key.
    #[error("{0}")]
    Unauthorized(String),
    /// The body is over `--max-body-bytes` (the limit, in bytes).
    #[error("the request body is over the router's limit of {0} bytes")]
    BodyTooLarge(usize),
    /// The body paused for longer than `--body-stall-timeout-ms` (that long).
    #[error("the request body sent nothing for {0:?}: the router stopped waiting for it")]
    BodyTimeout(std::time::Duration),
    /// The body did not arrive whole within `--body-timeout-ms` (that long).
    #[error(
        "the request body did not arrive whole within {0:?}: the router stopped waiting for it"
    )]
    BodyDeadline(std::time::Duration),
    /// The router already has `--max-queue` requests in flight (that many): overloaded, 503.
    #[error("the router already has {0} requests in flight: retry later")]
    QueueFull(usize),
    /// The caller's tenant is over one of its quotas (`limit`, the file's field): 429, with
    /// the time until its bucket holds what the request needs.
    #[error("tenant {tenant:?} is over its {limit}: retry in {retry_after:.1?}")]
    OverQuota {
        /// The tenant's name.
        tenant: String,
        /// `requests_per_minute` or `tokens_per_minute`.
        limit: &'static str,
        /// When the bucket will hold what the request needs.
        retry_after: std::time::Duration,
    },
    /// The request waited in the router's queue past its wait limit, and was never sent: 503.
    #[error("the request waited {waited:.1?} in the router's queue, past its limit: retry later")]
    QueueTimeout {
        /// How long it waited.
        waited: std::time::Duration,
        /// What the queue's recent pace says a retry might wait.
        retry_after: std::time::Duration,
    },
    /// A pool of the router's own (grammar compiles, prompt tokenization) is full: the same
    /// request may succeed in a moment.
    #[error("the router is busy: {0}")]
    Busy(String),
    /// No decode worker is ready to take a request.
    #[error("no decode worker is ready: check that the workers are up and reachable")]
    NoWorker,
    /// A worker failed the request: a fault of the cluster, not of the request.
    #[error("worker {worker}: {message}")]
    Upstream {
        /// The worker that failed (the last one tried).
        worker: WorkerAddr,
        /// What went wrong, with the worker's gRPC code.
        message: String,
        /// How: `Unavailable` (the worker was lost, nothing left to move the request to:
        /// retrying may find another), `Internal` (it failed the request) or `Unsupported`
        /// (what it runs cannot serve it). The gRPC code follows it.
        kind: ErrorKind,
    },
    /// A worker is full or stopping: the same request may succeed in a moment.
    #[error("worker {worker} cannot take the request now: {message}")]
    WorkerUnavailable {
        /// The worker that turned the request away.
        worker: WorkerAddr,
        /// Its reason, with its gRPC code.
        message: String,
    },
    /// The router itself failed (its tokenizer, say): not the request's fault.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 for the request field `param`.
    pub fn invalid(message: impl Into<String>, param: &'static str) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param),
        }
    }

    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } | Self::ContextLength { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::NotFound { .. } => StatusCode::NOT_FOUND,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout(_) | Self::BodyDeadline(_) => StatusCode::REQUEST_TIMEOUT,
            Self::OverQuota { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::QueueFull(_)
            | Self::QueueTimeout { .. }
            | Self::Busy(_)
            | Self::NoWorker
            | Self::WorkerUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Upstream { .. } => StatusCode::BAD_GATEWAY,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type` and `code` for this error.
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            Self::InvalidRequest { .. } => ("invalid_request_error", "invalid_value"),
            Self::ContextLength { .. } => ("invalid_request_error", "context_length_exceeded"),
            Self::ModelNotFound(_) => ("invalid_request_error", "model_not_found"),
            Self::NotFound { code, .. } => ("invalid_request_error", code),
            Self::Unauthorized(_) => ("invalid_request_error", "invalid_api_key"),
            Self::BodyTooLarge(_) => ("invalid_request_error", "request_too_large"),
            Self::BodyTimeout(_) | Self::BodyDeadline(_) => {
                ("invalid_request_error", "request_timeout")
            }
            Self::OverQuota { .. } => ("rate_limit_error", "rate_limit_exceeded"),
            Self::QueueFull(_) => ("service_unavailable", "overloaded"),
            Self::QueueTimeout { .. } => ("service_unavailable", "queue_timeout"),
            Self::Busy(_) => ("service_unavailable", "busy"),
            Self::NoWorker => ("service_unavailable", "no_worker"),
            Self::WorkerUnavailable { .. } => ("service_unavailable", "worker_unavailable"),
            Self::Upstream { .. } => ("server_error", "upstream_error"),
            Self::Internal(_) => ("server_error", "internal_error"),
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}`
    pub fn body(&self) -> serde_json::Value {
        let (ty, code) = self.kind();
        let param = match self {
            Self::InvalidRequest { param, .. } | Self::NotFound { param, .. } => *param,
            Self::ContextLength { .. } => Some("messages"),
            Self::ModelNotFound(_) => Some("model"),
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": ty, "param": param, "code": code}})
    }

    /// How long the client should wait before it tries again (`Retry-After`), for the answers
    /// that say to.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Self::OverQuota { retry_after, .. } | Self::QueueTimeout { retry_after, .. } => {
                Some(*retry_after)
            }
            Self::QueueFull(_) | Self::Busy(_) | Self::WorkerUnavailable { .. } => {
                Some(std::time::Duration::from_secs(1))
            }
            _ => None,
        }
    }

    /// The gRPC status this error answers with; the ones to retry later carry
    /// `grpc-retry-pushback-ms`.
    pub fn grpc(&self) -> tonic::Status {
        let m = self.to_string();
        let pushback = |mut st: tonic::Status, after: Option<std::time::Duration>| {
            if let Some(d) = after {
                // gRPC's retry policy waits this long before its next attempt.
                let ms = d.as_millis().max(1).to_string();
                if let Ok(v) = ms.parse() {
                    st.metadata_mut().insert("grpc-retry-pushback-ms", v);
                }
            }
            st
        };
        match self {
            Self::InvalidRequest { .. } | Self::ContextLength { .. } => {
                tonic::Status::invalid_argument(m)
            }
            Self::ModelNotFound(_) | Self::NotFound { .. } => tonic::Status::not_found(m),
            Self::Unauthorized(_) => tonic::Status::unauthenticated(m),
            Self::BodyTooLarge(_) => tonic::Status::resource_exhausted(m),
            Self::BodyTimeout(_) | Self::BodyDeadline(_) => tonic::Status::deadline_exceeded(m),
            Self::OverQuota { .. } => {
                pushback(tonic::Status::resource_exhausted(m), self.retry_after())
            }
            Self::QueueFull(_) | Self::QueueTimeout { .. } => {
                pushback(tonic::Status::unavailable(m), self.retry_after())
            }
            Self::Busy(_) | Self::NoWorker | Self::WorkerUnavailable { .. } => {
                tonic::Status::unavailable(m)
            }
            Self::Upstream { kind, .. } => tandem_proto::wire::status(*kind, m),
            Self::Internal(_) => tonic::Status::internal(m),
        }
    }

    /// A worker's gRPC refusal in the client's terms, by the kind its code carries
    /// (tandem-proto's one mapping): the request's own faults are the client's (400), a busy or
    /// stopping worker is a 503 to retry, and anything else is the cluster's fault (502).
    pub fn from_worker(worker: &WorkerAddr, s: &tonic::Status) -> Self {
        let message = s.message().to_string();
        match tandem_proto::wire::kind(s.code()) {
            ErrorKind::InvalidRequest | ErrorKind::TooLarge => Self::InvalidRequest {
                message,
                param: None,
            },
            ErrorKind::Busy | ErrorKind::Unavailable => Self::WorkerUnavailable {
                worker: worker.clone(),
                message: format!("{}: {message}", s.code()),
            },
            kind @ (ErrorKind::Unsupported | ErrorKind::Internal) => Self::Upstream {
                worker: worker.clone(),
                message: format!("{}: {message}", s.code()),
                kind,
            },
        }
    }
}

impl ApiError {
    /// `Retry-After` in whole seconds, rounded up (at least 1), for the answers that say to
    /// retry.
    pub fn retry_after_header(&self) -> Option<axum::http::HeaderValue> {
        self.retry_after().map(|d| {
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            axum::http::HeaderValue::from(secs.max(1))
        })
    }
}

/// A bad sampling field: a 400 naming it as `param`.
impl From<tandem_types::SamplingError> for ApiError {
    fn from(e: tandem_types::SamplingError) -> Self {
        ApiError::invalid(e.to_string(), e.field())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::warn!(error = %self, "request failed");
        }
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let Some(after) = self.retry_after_header() {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, after);
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::wire;

    fn from(kind: ErrorKind) -> ApiError {
        ApiError::from_worker(&"w:1".into(), &wire::status(kind, "why"))
    }

    #[test]
    fn a_worker_failure_is_the_client_s_fault_only_when_its_kind_says_so() {
        let cases = [
            (ErrorKind::InvalidRequest, StatusCode::BAD_REQUEST),
            (ErrorKind::TooLarge, StatusCode::BAD_REQUEST),
            (ErrorKind::Busy, StatusCode::SERVICE_UNAVAILABLE),
            (ErrorKind::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
            (ErrorKind::Unsupported, StatusCode::BAD_GATEWAY),
            (ErrorKind::Internal, StatusCode::BAD_GATEWAY),
        ];
        for (kind, want) in cases {
            let e = from(kind);
            assert_eq!(e.status(), want, "{kind:?}");
            assert_eq!(
                e.status().is_client_error(),
                kind.is_client_fault(),
                "{kind:?}"
            );
            assert!(e.to_string().contains("why"), "{e}");
        }
    }

    #[test]
    fn busy_answers_say_when_to_retry() {
        for e in [from(ErrorKind::Busy), ApiError::QueueFull(4)] {
            let r = e.into_response();
            assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], "1");
        }
        let r = from(ErrorKind::Internal).into_response();
        assert!(r.headers().get(axum::http::header::RETRY_AFTER).is_none());
        // A quota's wait is its bucket's, rounded up to whole seconds; gRPC's in milliseconds.
        let e = ApiError::OverQuota {
            tenant: "a".into(),
            limit: "tokens_per_minute",
            retry_after: std::time::Duration::from_millis(2300),
        };
        assert_eq!(
            e.grpc().metadata().get("grpc-retry-pushback-ms").unwrap(),
            "2300"
        );
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], "3");
    }

    #[test]
    fn a_bad_field_names_its_param_in_the_openai_body() {
        let e: ApiError = tandem_types::SamplingError::TopP(1.5).into();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let b = e.body();
        assert_eq!(b["error"]["param"], "top_p");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["message"], "top_p must be in (0, 1], got 1.5");
    }

    #[test]
    fn each_error_has_its_http_status_and_grpc_code() {
        use tonic::Code;
        let d = std::time::Duration::from_secs(1);
        let cases = [
            (ApiError::invalid("x", "prompt"), 400, Code::InvalidArgument),
            (
                ApiError::ContextLength {
                    prompt: 1,
                    max_tokens: 2,
                    context: 2,
                },
                400,
                Code::InvalidArgument,
            ),
            (ApiError::ModelNotFound("m".into()), 404, Code::NotFound),
            (
                ApiError::Unauthorized("no".into()),
                401,
                Code::Unauthenticated,
            ),
            (ApiError::BodyTooLarge(1), 413, Code::ResourceExhausted),
            (ApiError::BodyTimeout(d), 408, Code::DeadlineExceeded),
            (ApiError::QueueFull(1), 503, Code::Unavailable),
            (
                ApiError::OverQuota {
                    tenant: "a".into(),
                    limit: "requests_per_minute",
                    retry_after: d,
                },
                429,
                Code::ResourceExhausted,
            ),
            (
                ApiError::QueueTimeout {
                    waited: d,
                    retry_after: d,
                },
                503,
                Code::Unavailable,
            ),
            (ApiError::NoWorker, 503, Code::Unavailable),
            (from(ErrorKind::Busy), 503, Code::Unavailable),
            // A worker's failure: gRPC clients retry UNAVAILABLE on their own, so only a lost
            // worker says it; one that failed the request, or cannot serve it, says so.
            (from(ErrorKind::Internal), 502, Code::Internal),
            (from(ErrorKind::Unsupported), 502, Code::FailedPrecondition),
            (
                ApiError::Upstream {
                    worker: "w:1".into(),
                    message: "the stream ended without a finish".into(),
                    kind: ErrorKind::Unavailable,
                },
                502,
                Code::Unavailable,
            ),
            (ApiError::Internal("x".into()), 500, Code::Internal),
        ];
        for (e, http, code) in cases {
            assert_eq!(e.status().as_u16(), http, "{e}");
            assert_eq!(e.grpc().code(), code, "{e}");
        }
    }
}
