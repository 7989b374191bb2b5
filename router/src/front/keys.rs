//! API keys: who may call the router, over HTTP and gRPC.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::FrontDoorError;
use crate::error::ApiError;
use crate::flow::{Caller, Tenants};
use crate::metrics::RouterMetrics;

/// Who may call: a set of API keys, kept as SHA-256 digests and compared in constant time, or
/// the tenants file's keys, each naming its tenant. Neither: everything is allowed.
#[derive(Default)]
pub struct ApiKeys {
    keys: Vec<[u8; 32]>,
    tenants: Option<Arc<Tenants>>,
}

impl ApiKeys {
    /// The set of `keys`; [`FrontDoorError::BadKey`] when one is empty or has whitespace in it.
    pub fn new(keys: &[String]) -> Result<Self, FrontDoorError> {
        keys.iter()
            .map(|k| {
                if k.is_empty() || k.chars().any(char::is_whitespace) {
                    Err(FrontDoorError::BadKey)
                } else {
                    Ok(Sha256::digest(k.as_bytes()).into())
                }
            })
            .collect::<Result<_, _>>()
            .map(|keys| Self {
                keys,
                tenants: None,
            })
    }

    /// The keys of `tenants` (read again as the file changes): each call is its key's tenant's.
    pub fn of_tenants(tenants: Arc<Tenants>) -> Self {
        Self {
            keys: Vec::new(),
            tenants: Some(tenants),
        }
    }

    /// Whether there are no keys, so every call is allowed.
    pub fn is_open(&self) -> bool {
        self.keys.is_empty() && self.tenants.is_none()
    }

    /// Checks an `Authorization` header's value: the caller it makes, or (the error) what was
    /// wrong, never the key.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<Caller, String> {
        if self.is_open() {
            return Ok(Caller::default());
        }
        let Some(value) = authorization else {
            return Err("no API key given: send it as 'Authorization: Bearer KEY'".into());
        };
        let token = std::str::from_utf8(value)
            .ok()
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        let Some(token) = token else {
            return Err("the Authorization header must be 'Bearer KEY'".into());
        };
        self.check_token(token)
    }

    /// Checks a key as sent bare (Anthropic's `x-api-key` header).
    pub fn check_token(&self, token: &str) -> Result<Caller, String> {
        if self.is_open() {
            return Ok(Caller::default());
        }
        if let Some(tenants) = &self.tenants {
            // A hash lookup of the key's digest: its time says nothing of the key.
            return tenants
                .table()
                .lookup(token)
                .map(|t| Caller::tenant(&t.name))
                .ok_or_else(|| "incorrect API key provided".into());
        }
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // Every key is compared, so the time taken says nothing of which one came close.
        let matched = self
            .keys
            .iter()
            .fold(subtle::Choice::from(0), |acc, k| acc | k.ct_eq(&digest));
        if bool::from(matched) {
            Ok(Caller::default())
        } else {
            Err("incorrect API key provided".into())
        }
    }

    /// The gRPC form of [`check`](Self::check): UNAUTHENTICATED without a valid key; the
    /// [`Caller`] goes into the request's extensions.
    pub fn interceptor(
        self: Arc<Self>,
        metrics: Arc<RouterMetrics>,
    ) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
        move |mut req: tonic::Request<()>| {
            let header = req.metadata().get("authorization").map(|v| v.as_bytes());
            match self.check(header) {
                Ok(caller) => {
                    req.extensions_mut().insert(caller);
                    Ok(req)
                }
                Err(m) => {
                    metrics.refused("unauthorized");
                    Err(ApiError::Unauthorized(m).grpc())
                }
            }
        }
    }
}

/// HTTP middleware: the request goes on only with a valid key, its [`Caller`] in its
/// extensions (401 with an OpenAI error body and `WWW-Authenticate: Bearer` otherwise).
pub async fn require_key(
    State((keys, metrics)): State<(Arc<ApiKeys>, Arc<RouterMetrics>)>,
    mut req: Request,
    next: Next,
) -> Response {
    let header = req.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
    // Anthropic's clients send the key bare in x-api-key.
    let bare = req.headers().get("x-api-key");
    let checked = match (header, bare) {
        (None, Some(k)) => match k.to_str() {
            Ok(k) => keys.check_token(k.trim()),
            Err(_) => Err("the x-api-key header is not text".into()),
        },
        _ => keys.check(header),
    };
    match checked {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Err(m) => {
            metrics.refused("unauthorized");
            let e = ApiError::Unauthorized(m);
            if req.uri().path().starts_with("/v1/messages") {
                return crate::openai::anthropic_error(&e);
            }
            let mut resp = e.into_response();
            resp.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            resp
        }
    }
}
