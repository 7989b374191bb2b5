//! A request's body, read under the front door's limits before anything of the router is held.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::FromRequest;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use crate::error::ApiError;
use crate::metrics::RouterMetrics;

/// The front door's body limits, as a request extension for [`RequestBody`].
#[derive(Clone)]
pub(super) struct BodyLimits {
    pub(super) max: usize,
    pub(super) stall: Duration,
    pub(super) metrics: Arc<RouterMetrics>,
}

/// Reads and drops up to `budget` more bytes of a refused body, so that a client still sending
/// a body somewhat over the limit reads its 413 rather than a reset connection. A larger body is
/// cut off.
async fn drain(body: &mut axum::body::BodyDataStream, budget: usize, stall: Duration) {
    let mut left = budget;
    while left > 0 {
        match tokio::time::timeout(stall, body.next()).await {
            Ok(Some(Ok(chunk))) => left = left.saturating_sub(chunk.len()),
            _ => return,
        }
    }
}

/// A request's whole body, read under the front door's limits: over the size limit is 413 (at
/// once when `Content-Length` says so), a pause longer than the stall timeout is 408. Nothing
/// of the router is held while it arrives.
pub(super) struct RequestBody(pub(super) Bytes);

impl<S: Send + Sync> FromRequest<S> for RequestBody {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, _: &S) -> Result<Self, Response> {
        let Some(limits) = req.extensions().get::<BodyLimits>().cloned() else {
            return Err(ApiError::Internal("body limits not set".into()).into_response());
        };
        let refuse = |e: ApiError, reason| {
            limits.metrics.refused(reason);
            e.into_response()
        };
        let declared = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let mut body = req.into_body().into_data_stream();
        if let Some(n) = declared.filter(|&n| n > limits.max as u64) {
            if n <= 2 * limits.max as u64 {
                drain(&mut body, n as usize, limits.stall).await;
            }
            return Err(refuse(ApiError::BodyTooLarge(limits.max), "body_too_large"));
        }
        let mut buf = Vec::with_capacity(declared.unwrap_or(0) as usize);
        loop {
            match tokio::time::timeout(limits.stall, body.next()).await {
                Err(_) => return Err(refuse(ApiError::BodyTimeout(limits.stall), "body_timeout")),
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(ApiError::InvalidRequest {
                        message: format!("could not read the request body: {e}"),
                        param: None,
                    }
                    .into_response())
                }
                Ok(Some(Ok(chunk))) => {
                    if buf.len() + chunk.len() > limits.max {
                        drain(&mut body, limits.max, limits.stall).await;
                        return Err(refuse(ApiError::BodyTooLarge(limits.max), "body_too_large"));
                    }
                    buf.extend_from_slice(&chunk);
                }
            }
        }
        Ok(Self(Bytes::from(buf)))
    }
}
