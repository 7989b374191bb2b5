//! The one place where router failures become HTTP statuses, OpenAI error bodies and gRPC codes.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// What a 429 tells the client to wait, in seconds (`Retry-After`).
pub const RETRY_AFTER_S: &str = "1";

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something out of range. `param` names the field.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<&'static str>,
    },
    #[error("the prompt has {prompt} tokens and asks for {max_tokens} more, but the model's context is {context} tokens: shorten the prompt or lower max_tokens")]
    ContextLength {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("model {0:?} is not served here: GET /v1/models lists what is")]
    ModelNotFound(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("the request body is over the router's limit of {0} bytes")]
    BodyTooLarge(usize),
    #[error("the request body sent nothing for {0:?}: the router stopped waiting for it")]
    BodyTimeout(std::time::Duration),
    #[error("the router already has {0} requests in flight: retry later")]
    QueueFull(usize),
    #[error("no decode worker is ready: check that the workers are up and reachable")]
    NoWorker,
    /// A worker refused or failed the request.
    #[error("worker {worker}: {message}")]
    Upstream { worker: String, message: String },
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: &'static str) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } | Self::ContextLength { .. } | Self::ModelNotFound(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::NoWorker => StatusCode::SERVICE_UNAVAILABLE,
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
            Self::Unauthorized(_) => ("invalid_request_error", "invalid_api_key"),
            Self::BodyTooLarge(_) => ("invalid_request_error", "request_too_large"),
            Self::BodyTimeout(_) => ("invalid_request_error", "request_timeout"),
            Self::QueueFull(_) => ("rate_limit_error", "rate_limit_exceeded"),
            Self::NoWorker => ("service_unavailable", "no_worker"),
            Self::Upstream { .. } => ("server_error", "upstream_error"),
            Self::Internal(_) => ("server_error", "internal_error"),
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}`
    pub fn body(&self) -> serde_json::Value {
        let (ty, code) = self.kind();
        let param = match self {
            Self::InvalidRequest { param, .. } => *param,
            Self::ContextLength { .. } => Some("messages"),
            Self::ModelNotFound(_) => Some("model"),
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": ty, "param": param, "code": code}})
    }

    pub fn grpc(&self) -> tonic::Status {
        let m = self.to_string();
        match self {
            Self::InvalidRequest { .. } | Self::ContextLength { .. } => {
                tonic::Status::invalid_argument(m)
            }
            Self::ModelNotFound(_) => tonic::Status::not_found(m),
            Self::Unauthorized(_) => tonic::Status::unauthenticated(m),
            Self::BodyTooLarge(_) => tonic::Status::resource_exhausted(m),
            Self::BodyTimeout(_) => tonic::Status::deadline_exceeded(m),
            Self::QueueFull(_) => {
                let mut st = tonic::Status::resource_exhausted(m);
                // gRPC's retry policy waits this long before its next attempt.
                st.metadata_mut().insert(
                    "grpc-retry-pushback-ms",
                    tonic::metadata::MetadataValue::from_static("1000"),
                );
                st
            }
            Self::NoWorker => tonic::Status::unavailable(m),
            Self::Upstream { .. } => tonic::Status::unavailable(m),
            Self::Internal(_) => tonic::Status::internal(m),
        }
    }

    /// A worker's gRPC refusal in the client's terms: its invalid-argument answers are the
    /// client's fault (400), the rest are the cluster's.
    pub fn from_worker(worker: &str, s: &tonic::Status) -> Self {
        match s.code() {
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => Self::InvalidRequest {
                message: s.message().to_string(),
                param: None,
            },
            tonic::Code::ResourceExhausted => Self::InvalidRequest {
                message: s.message().to_string(),
                param: None,
            },
            _ => Self::Upstream {
                worker: worker.to_string(),
                message: format!("{}: {}", s.code(), s.message()),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::warn!(error = %self, "request failed");
        }
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let Self::QueueFull(_) = self {
            // In-flight requests last seconds: one is a fair time to wait before retrying.
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_S),
            );
        }
        resp
    }
}
