//! The worker plane's credential: every worker RPC (`Decode`, `Prefill`, `WorkerControl`) and a
//! worker's `POST /deregister` must carry `authorization: Bearer <token>`, the token derived
//! from the cluster's KV secret ([`Secret::rpc_token`]). Health, reflection and `/metrics` stay
//! open for probes and scrapers. Without a secret a worker's plane is open (it says so when it
//! starts).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tandem_kv_transfer::Secret;

/// The header value a worker RPC carries, and checks it in constant time.
#[derive(Clone)]
pub struct WorkerToken {
    header: Arc<str>,
    digest: [u8; 32],
}

impl std::fmt::Debug for WorkerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerToken(..)")
    }
}

impl WorkerToken {
    /// The cluster's token, from its KV secret.
    pub fn from_secret(secret: &Secret) -> Self {
        let header: Arc<str> = format!("Bearer {}", secret.rpc_token()).into();
        let digest = Sha256::digest(header.as_bytes()).into();
        Self { header, digest }
    }

    /// Adds the credential to an outgoing call.
    pub fn attach<T>(&self, call: &mut tonic::Request<T>) {
        if let Ok(v) = self.header.parse() {
            call.metadata_mut().insert("authorization", v);
        }
    }

    /// The `authorization` header's value, for a plain HTTP call (`/deregister`).
    pub fn header(&self) -> &str {
        &self.header
    }

    /// Whether `presented` (an `authorization` header) is this token.
    pub fn accepts(&self, presented: Option<&HeaderValue>) -> bool {
        let got: [u8; 32] = Sha256::digest(presented.map_or(&[][..], HeaderValue::as_bytes)).into();
        got.ct_eq(&self.digest).into()
    }
}

/// Whether `path` is one the credential guards: the worker's own services and `/deregister`.
fn guarded(path: &str) -> bool {
    path.starts_with("/tandem.worker.") || path == "/deregister"
}

/// The middleware: a guarded path without the token is refused (gRPC UNAUTHENTICATED, or 401
/// for `/deregister`) before any handler runs.
pub async fn require(
    State(token): State<Option<WorkerToken>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(token) = token else {
        return next.run(req).await;
    };
    if !guarded(req.uri().path()) || token.accepts(req.headers().get("authorization")) {
        return next.run(req).await;
    }
    tracing::warn!(
        path = req.uri().path(),
        "worker call without the cluster's credential refused"
    );
    let why = "this worker needs the cluster's credential (authorization: Bearer, derived from TANDEM_KV_SECRET)";
    if req.uri().path() == "/deregister" {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(serde_json::json!({"error": why})),
        )
            .into_response();
    }
    tonic::Status::unauthenticated(why).into_http::<axum::body::Body>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_cluster_s_token_is_accepted_and_only_guarded_paths_need_it() {
        let secret = Secret::new(b"a-cluster-secret-of-length".to_vec()).unwrap();
        let t = WorkerToken::from_secret(&secret);
        let other =
            WorkerToken::from_secret(&Secret::new(b"another-secret-of-length".to_vec()).unwrap());
        let hv = |s: &str| HeaderValue::from_str(s).unwrap();
        assert!(t.accepts(Some(&hv(t.header()))));
        assert!(!t.accepts(Some(&hv(other.header()))));
        assert!(!t.accepts(None));
        assert!(!t.accepts(Some(&hv(&format!("Bearer {}", secret.to_text())))));
        // The token is not the secret, and differs per secret.
        assert!(!t.header().contains(&secret.to_text()));
        assert_ne!(t.header(), other.header());
        for open in [
            "/grpc.health.v1.Health/Check",
            "/metrics",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ] {
            assert!(!guarded(open), "{open}");
        }
        for closed in [
            "/tandem.worker.v1.Decode/Generate",
            "/tandem.worker.v1.Prefill/Prefill",
            "/tandem.worker.v1.WorkerControl/Load",
            "/deregister",
        ] {
            assert!(guarded(closed), "{closed}");
        }
    }
}
