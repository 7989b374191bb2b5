//! The router's front door: who may call (API keys), how the bytes arrive (TLS or plain TCP), and
//! how much of the router a client may hold (request head and body limits, and clients that stop
//! sending or stop reading).
//!
//! Owns: [`FrontDoorArgs`] (the flags), [`ApiKeys`] (checked by the HTTP middleware
//! [`require_key`] and the gRPC interceptor [`ApiKeys::interceptor`]), the TLS configuration,
//! [`accept`] (one accept loop for both ports: TLS handshakes under a deadline, every connection
//! wrapped in a [`Conn`](conn::Conn)) and [`serve_http`] (hyper connections with header limits
//! and timeouts).
//!
//! Every limit is on the client's own progress, never on the model's: a head must arrive within
//! `--header-timeout-ms`, a body must not pause for `--body-stall-timeout-ms` and must arrive
//! whole within `--body-timeout-ms`, the bodies arriving at once may hold at most
//! `--max-body-bytes-in-flight` of the router's memory, and a response the client stops reading
//! is cut off after `--write-stall-timeout-ms` without progress. None of them holds a queue slot:
//! the router takes one only once the whole body is in.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

/// The limits' defaults, for the flags and for [`FrontDoorArgs::default`].
const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;
const DEFAULT_MAX_HEADER_BYTES: usize = 64 << 10;
const DEFAULT_MAX_HEADERS: usize = 100;
const DEFAULT_HEADER_TIMEOUT_MS: u64 = 10_000;
const DEFAULT_BODY_STALL_TIMEOUT_MS: u64 = 10_000;
const DEFAULT_BODY_TIMEOUT_MS: u64 = 60_000;
const DEFAULT_MAX_BODY_BYTES_IN_FLIGHT: usize = 256 << 20;
const DEFAULT_WRITE_STALL_TIMEOUT_MS: u64 = 60_000;
const DEFAULT_TENANTS_RELOAD_MS: u64 = 2_000;

/// The front door's flags (part of `tandem router`'s).
#[derive(Args, Clone, Debug)]
pub struct FrontDoorArgs {
    /// API key clients must send as `Authorization: Bearer KEY`, on HTTP and gRPC (repeatable or
    /// comma-separated). None given (and no --api-key-file): the API is open.
    #[arg(
        long = "api-key",
        env = "TANDEM_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and lines starting with # are skipped).
    #[arg(long, env = "TANDEM_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Tenants (JSON or YAML): `{"tenants": [{"name", "keys": [...], "priority",
    /// "requests_per_minute", "tokens_per_minute", "max_concurrent", "max_queue_wait_ms",
    /// "weight"}]}`. Each key is its tenant's; a key in no tenant is refused like a wrong key.
    /// Read again when it changes (every --tenants-reload-ms), without a restart. Not with
    /// --api-key or --api-key-file.
    #[arg(long, env = "TANDEM_TENANTS", conflicts_with_all = ["api_keys", "api_key_file"])]
    pub tenants: Option<PathBuf>,
    /// How often the --tenants file is looked at for changes, in milliseconds.
    #[arg(long, env = "TANDEM_TENANTS_RELOAD_MS", default_value_t = DEFAULT_TENANTS_RELOAD_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub tenants_reload_ms: u64,
    /// Key(s) `/metrics` requires, as a Bearer token (repeatable or comma-separated). None:
    /// `/metrics` is open, like `/health` and `/ready`, which always are.
    #[arg(
        long = "metrics-api-key",
        env = "TANDEM_METRICS_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub metrics_api_keys: Vec<String>,
    /// PEM certificate chain: serve HTTP and gRPC over TLS (needs --tls-key).
    #[arg(long, env = "TANDEM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "TANDEM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Largest request body in bytes; a larger one gets 413.
    #[arg(long, env = "TANDEM_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers) in bytes; a larger one gets 431 (HTTP/1)
    /// or a stream reset (HTTP/2).
    #[arg(long, env = "TANDEM_MAX_HEADER_BYTES", default_value_t = DEFAULT_MAX_HEADER_BYTES)]
    pub max_header_bytes: usize,
    /// Most headers in one HTTP/1 request; more get 431.
    #[arg(long, env = "TANDEM_MAX_HEADERS", default_value_t = DEFAULT_MAX_HEADERS)]
    pub max_headers: usize,
    /// A connection must finish its TLS handshake, and send a complete request head, within this
    /// many milliseconds of opening (and of each keep-alive request), or it is closed.
    #[arg(long, env = "TANDEM_HEADER_TIMEOUT_MS", default_value_t = DEFAULT_HEADER_TIMEOUT_MS)]
    pub header_timeout_ms: u64,
    /// A request body that sends no byte for this many milliseconds gets 408.
    #[arg(long, env = "TANDEM_BODY_STALL_TIMEOUT_MS", default_value_t = DEFAULT_BODY_STALL_TIMEOUT_MS)]
    pub body_stall_timeout_ms: u64,
    /// A request body must arrive whole within this many milliseconds, or it gets 408 (a body
    /// trickled just faster than the stall timeout would otherwise hold its bytes for ever).
    #[arg(long, env = "TANDEM_BODY_TIMEOUT_MS", default_value_t = DEFAULT_BODY_TIMEOUT_MS)]
    pub body_timeout_ms: u64,
    /// Bytes of request bodies the router holds while they arrive, every connection together;
    /// a body that would pass it gets 503 (busy, retry) at once. At least --max-body-bytes.
    #[arg(
        long,
        env = "TANDEM_MAX_BODY_BYTES_IN_FLIGHT",
        default_value_t = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT
    )]
    pub max_body_bytes_in_flight: usize,
    /// A connection whose client reads nothing of the response for this many milliseconds (its
    /// receive window full) is closed; its request is cancelled.
    #[arg(long, env = "TANDEM_WRITE_STALL_TIMEOUT_MS", default_value_t = DEFAULT_WRITE_STALL_TIMEOUT_MS)]
    pub write_stall_timeout_ms: u64,
}

impl Default for FrontDoorArgs {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            api_key_file: None,
            tenants: None,
            tenants_reload_ms: DEFAULT_TENANTS_RELOAD_MS,
            metrics_api_keys: Vec::new(),
            tls_cert: None,
            tls_key: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            header_timeout_ms: DEFAULT_HEADER_TIMEOUT_MS,
            body_stall_timeout_ms: DEFAULT_BODY_STALL_TIMEOUT_MS,
            body_timeout_ms: DEFAULT_BODY_TIMEOUT_MS,
            max_body_bytes_in_flight: DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
            write_stall_timeout_ms: DEFAULT_WRITE_STALL_TIMEOUT_MS,
        }
    }
}

/// Why the front door's flags make no front door.
#[derive(Debug, thiserror::Error)]
pub enum FrontDoorError {
    /// `--api-key-file` could not be read.
    #[error("cannot read API key file {path}: {source}")]
    KeyFile {
        /// The file as given.
        path: PathBuf,
        /// Why reading it failed.
        source: io::Error,
    },
    /// `--api-key-file` holds no key (only blank lines and comments).
    #[error("API key file {0} has no keys: an empty file would leave the API open")]
    NoKeys(PathBuf),
    /// A key is empty or has whitespace in it, so no `Authorization` header could carry it.
    #[error("an API key is empty or has whitespace in it")]
    BadKey,
    /// The certificate or key file is unreadable or not PEM.
    #[error("TLS {what} {path}: {message}")]
    Pem {
        /// Which file: `certificate` or `key`.
        what: &'static str,
        /// The file as given.
        path: PathBuf,
        /// The PEM reader's error.
        message: String,
    },
    /// rustls refused the certificate and key (they do not match, say).
    #[error("TLS configuration: {0}")]
    Tls(String),
    /// The tenants file cannot be read or does not make tenants (the reason names the file).
    #[error("{0}")]
    Tenants(String),
    /// A limit flag is below its minimum: the flag's name (without `--`) and that minimum.
    #[error("--{0} must be at least {1}")]
    TooSmall(&'static str, u64),
}

/// How long a client may take, and how much it may send, on every connection.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Largest request body, in bytes.
    pub max_body: usize,
    /// Largest request head (request line and headers), in bytes.
    pub max_header_bytes: usize,
    /// Most headers in one HTTP/1 request.
    pub max_headers: usize,
    /// Time a connection has to finish its TLS handshake and send a request head.
    pub header_timeout: Duration,
    /// Longest pause allowed within a request body.
    pub body_stall: Duration,
    /// Longest a request body may take to arrive whole.
    pub body_deadline: Duration,
    /// Bytes of request bodies held while they arrive, all connections together.
    pub body_in_flight: usize,
    /// Longest a response may go without the client reading any of it.
    pub write_stall: Duration,
}

/// Everything the front door needs, resolved from its flags.
pub struct FrontDoor {
    /// Keys the API (generation, tokenization, model list) requires; empty: open.
    pub api_keys: Arc<ApiKeys>,
    /// The tenants, when `--tenants` names a file (their keys are `api_keys`).
    pub tenants: Option<Arc<crate::flow::Tenants>>,
    /// How often the tenants file is looked at for changes.
    pub tenants_reload: Duration,
    /// Keys `/metrics` requires; empty: open.
    pub metrics_keys: Arc<ApiKeys>,
    /// The limits on every client connection.
    pub limits: ConnLimits,
    /// HTTP's acceptor (ALPN h2 and http/1.1) and gRPC's (h2 only), when TLS is on.
    pub tls: Option<(TlsAcceptor, TlsAcceptor)>,
}

impl FrontDoorArgs {
    /// Reads the key file and the TLS certificate and key, and checks every limit.
    pub fn resolve(&self) -> Result<FrontDoor, FrontDoorError> {
        let mut keys = self.api_keys.clone();
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path).map_err(|source| FrontDoorError::KeyFile {
                path: path.clone(),
                source,
            })?;
            let from_file: Vec<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect();
            if from_file.is_empty() {
                return Err(FrontDoorError::NoKeys(path.clone()));
            }
            keys.extend(from_file);
        }
        for (name, v, min) in [
            ("max-body-bytes", self.max_body_bytes as u64, 1),
            ("max-header-bytes", self.max_header_bytes as u64, 1024),
            ("max-headers", self.max_headers as u64, 8),
            ("header-timeout-ms", self.header_timeout_ms, 1),
            ("body-stall-timeout-ms", self.body_stall_timeout_ms, 1),
            ("body-timeout-ms", self.body_timeout_ms, 1),
            (
                "max-body-bytes-in-flight",
                self.max_body_bytes_in_flight as u64,
                self.max_body_bytes as u64,
            ),
            ("write-stall-timeout-ms", self.write_stall_timeout_ms, 1),
        ] {
            if v < min {
                return Err(FrontDoorError::TooSmall(name, min));
            }
        }
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some((
                TlsAcceptor::from(tls_config(cert, key, &[b"h2", b"http/1.1"])?),
                TlsAcceptor::from(tls_config(cert, key, &[b"h2"])?),
            )),
            _ => None,
        };
        let tenants = match &self.tenants {
            Some(path) => Some(Arc::new(
                crate::flow::Tenants::load(path).map_err(FrontDoorError::Tenants)?,
            )),
            None => None,
        };
        let api_keys = match &tenants {
            Some(t) => ApiKeys::of_tenants(t.clone()),
            None => ApiKeys::new(&keys)?,
        };
        Ok(FrontDoor {
            api_keys: Arc::new(api_keys),
            tenants,
            tenants_reload: Duration::from_millis(self.tenants_reload_ms.max(1)),
            metrics_keys: Arc::new(ApiKeys::new(&self.metrics_api_keys)?),
            limits: ConnLimits {
                max_body: self.max_body_bytes,
                max_header_bytes: self.max_header_bytes,
                max_headers: self.max_headers,
                header_timeout: Duration::from_millis(self.header_timeout_ms),
                body_stall: Duration::from_millis(self.body_stall_timeout_ms),
                body_deadline: Duration::from_millis(self.body_timeout_ms),
                body_in_flight: self.max_body_bytes_in_flight,
                write_stall: Duration::from_millis(self.write_stall_timeout_ms),
            },
            tls,
        })
    }
}

fn tls_config(
    cert: &Path,
    key: &Path,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ServerConfig>, FrontDoorError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    fn pem_err(
        what: &'static str,
        path: &Path,
    ) -> impl FnOnce(rustls::pki_types::pem::Error) -> FrontDoorError {
        let path = path.to_path_buf();
        move |e| FrontDoorError::Pem {
            what,
            path,
            message: e.to_string(),
        }
    }
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(pem_err("certificate", cert))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_err("certificate", cert))?;
    if certs.is_empty() {
        return Err(FrontDoorError::Pem {
            what: "certificate",
            path: cert.to_path_buf(),
            message: "no CERTIFICATE section".into(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(pem_err("key", key))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| FrontDoorError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| FrontDoorError::Tls(e.to_string()))?;
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

mod conn;
mod keys;
mod serve;
#[cfg(test)]
mod tests;

pub use keys::{require_key, ApiKeys};
pub use serve::{accept, serve_http};
