//! A request's body, read under the front door's limits before anything of the router is held.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::FromRequest;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::front::ConnLimits;
use crate::metrics::RouterMetrics;

/// The budget counts bodies in KiB, so that a budget of gigabytes fits a semaphore's permits.
const BUDGET_UNIT: usize = 1024;

/// The front door's body limits, as a request extension for [`RequestBody`].
#[derive(Clone)]
pub(super) struct BodyLimits {
    max: usize,
    stall: Duration,
    deadline: Duration,
    /// `--max-body-bytes-in-flight` in [`BUDGET_UNIT`]s: what the bodies arriving now may hold.
    budget: Arc<Semaphore>,
    budget_bytes: usize,
    metrics: Arc<RouterMetrics>,
}

impl BodyLimits {
    pub(super) fn new(limits: &ConnLimits, metrics: Arc<RouterMetrics>) -> Self {
        let units = (limits.body_in_flight / BUDGET_UNIT).clamp(1, Semaphore::MAX_PERMITS);
        Self {
            max: limits.max_body,
            stall: limits.body_stall,
            deadline: limits.body_deadline,
            budget: Arc::new(Semaphore::new(units)),
            budget_bytes: limits.body_in_flight,
            metrics,
        }
    }

    /// Grows what a body holds of the in-flight budget to cover `bytes` in all, or says the
    /// budget cannot.
    fn cover(&self, held: &mut Option<OwnedSemaphorePermit>, bytes: usize) -> Result<(), ()> {
        let have = held.as_ref().map_or(0, |p| p.num_permits());
        let want = bytes.div_ceil(BUDGET_UNIT);
        if want <= have {
            return Ok(());
        }
        let more = u32::try_from(want - have).map_err(|_| ())?;
        let p = self
            .budget
            .clone()
            .try_acquire_many_owned(more)
            .map_err(|_| ())?;
        match held {
            Some(h) => h.merge(p),
            None => *held = Some(p),
        }
        Ok(())
    }

    fn spent(&self) -> ApiError {
        ApiError::Busy(format!(
            "the request bodies arriving now hold all of the router's {} bytes for them \
             (--max-body-bytes-in-flight): retry in a moment",
            self.budget_bytes
        ))
    }
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
/// once when `Content-Length` says so), a pause longer than the stall timeout or a body not whole
/// within the body deadline is 408, and a body the in-flight budget cannot take is 503 (at once
/// when `Content-Length` says so; the budget comes back when the body is in). Nothing of the
/// router's queue is held while it arrives.
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
        // What this body holds of the in-flight budget: the declared length up front, else each
        // chunk as it comes. Dropped (given back) when this returns.
        let mut held = None;
        let declared = declared.unwrap_or(0) as usize;
        if limits.cover(&mut held, declared).is_err() {
            return Err(refuse(limits.spent(), "body_budget"));
        }
        let deadline = Instant::now() + limits.deadline;
        let mut buf = Vec::with_capacity(declared);
        loop {
            let next = tokio::time::timeout(limits.stall, body.next());
            match tokio::time::timeout_at(deadline, next).await {
                Err(_) => {
                    return Err(refuse(
                        ApiError::BodyDeadline(limits.deadline),
                        "body_timeout",
                    ))
                }
                Ok(Err(_)) => {
                    return Err(refuse(ApiError::BodyTimeout(limits.stall), "body_timeout"))
                }
                Ok(Ok(None)) => break,
                Ok(Ok(Some(Err(e)))) => {
                    return Err(ApiError::InvalidRequest {
                        message: format!("could not read the request body: {e}"),
                        param: None,
                    }
                    .into_response())
                }
                Ok(Ok(Some(Ok(chunk)))) => {
                    if buf.len() + chunk.len() > limits.max {
                        drain(&mut body, limits.max, limits.stall).await;
                        return Err(refuse(ApiError::BodyTooLarge(limits.max), "body_too_large"));
                    }
                    if limits.cover(&mut held, buf.len() + chunk.len()).is_err() {
                        return Err(refuse(limits.spent(), "body_budget"));
                    }
                    buf.extend_from_slice(&chunk);
                }
            }
        }
        Ok(Self(Bytes::from(buf)))
    }
}
