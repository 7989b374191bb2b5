//! The router's front door: who may call (API keys), how the bytes arrive (TLS or plain TCP), and
//! how much of the router a client may hold (request head and body limits, and clients that stop
//! sending or stop reading).
//!
//! Owns: [`FrontDoorArgs`] (the flags), [`ApiKeys`] (checked by the HTTP middleware
//! [`require_key`] and the gRPC interceptor [`ApiKeys::interceptor`]), the TLS configuration,
//! [`accept`] (one accept loop for both ports: TLS handshakes under a deadline, every connection
//! wrapped in a [`Conn`]) and [`serve_http`] (hyper connections with header limits and timeouts).
//!
//! Every limit is on the client's own progress, never on the model's: a head must arrive within
//! `--header-timeout-ms`, a body must not pause for `--body-stall-timeout-ms`, and a response the
//! client stops reading is cut off after `--write-stall-timeout-ms` without progress. None of them
//! holds a queue slot: the router takes one only once the whole body is in.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use clap::Args;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

use crate::error::ApiError;
use crate::metrics::RouterMetrics;

/// The limits' defaults, for the flags and for [`FrontDoorArgs::default`].
const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;
const DEFAULT_MAX_HEADER_BYTES: usize = 64 << 10;
const DEFAULT_MAX_HEADERS: usize = 100;
const DEFAULT_HEADER_TIMEOUT_MS: u64 = 10_000;
const DEFAULT_BODY_STALL_TIMEOUT_MS: u64 = 10_000;
const DEFAULT_WRITE_STALL_TIMEOUT_MS: u64 = 60_000;

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
            metrics_api_keys: Vec::new(),
            tls_cert: None,
            tls_key: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            header_timeout_ms: DEFAULT_HEADER_TIMEOUT_MS,
            body_stall_timeout_ms: DEFAULT_BODY_STALL_TIMEOUT_MS,
            write_stall_timeout_ms: DEFAULT_WRITE_STALL_TIMEOUT_MS,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FrontDoorError {
    #[error("cannot read API key file {path}: {source}")]
    KeyFile { path: PathBuf, source: io::Error },
    #[error("API key file {0} has no keys: an empty file would leave the API open")]
    NoKeys(PathBuf),
    #[error("an API key is empty or has whitespace in it")]
    BadKey,
    #[error("TLS {what} {path}: {message}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("--{0} must be at least {1}")]
    TooSmall(&'static str, u64),
}

/// How long a client may take, and how much it may send, on every connection.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_body: usize,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub header_timeout: Duration,
    pub body_stall: Duration,
    pub write_stall: Duration,
}

/// Everything the front door needs, resolved from its flags.
pub struct FrontDoor {
    pub api_keys: Arc<ApiKeys>,
    pub metrics_keys: Arc<ApiKeys>,
    pub limits: Limits,
    /// HTTP's acceptor (ALPN h2 and http/1.1) and gRPC's (h2 only), when TLS is on.
    pub tls: Option<(TlsAcceptor, TlsAcceptor)>,
}

impl FrontDoorArgs {
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
        Ok(FrontDoor {
            api_keys: Arc::new(ApiKeys::new(&keys)?),
            metrics_keys: Arc::new(ApiKeys::new(&self.metrics_api_keys)?),
            limits: Limits {
                max_body: self.max_body_bytes,
                max_header_bytes: self.max_header_bytes,
                max_headers: self.max_headers,
                header_timeout: Duration::from_millis(self.header_timeout_ms),
                body_stall: Duration::from_millis(self.body_stall_timeout_ms),
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

/// A set of API keys, kept as SHA-256 digests and compared in constant time. Empty: everything
/// is allowed.
#[derive(Default)]
pub struct ApiKeys(Vec<[u8; 32]>);

impl ApiKeys {
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
            .map(Self)
    }

    pub fn is_open(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks an `Authorization` header's value; the error says what was wrong, never the key.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
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
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // Every key is compared, so the time taken says nothing of which one came close.
        let matched = self
            .0
            .iter()
            .fold(subtle::Choice::from(0), |acc, k| acc | k.ct_eq(&digest));
        if bool::from(matched) {
            Ok(())
        } else {
            Err("incorrect API key provided".into())
        }
    }

    /// The gRPC form of [`check`](Self::check): UNAUTHENTICATED without a valid key.
    pub fn interceptor(
        self: Arc<Self>,
        metrics: Arc<RouterMetrics>,
    ) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
        move |req: tonic::Request<()>| {
            let header = req.metadata().get("authorization").map(|v| v.as_bytes());
            match self.check(header) {
                Ok(()) => Ok(req),
                Err(m) => {
                    metrics.refused("unauthorized");
                    Err(ApiError::Unauthorized(m).grpc())
                }
            }
        }
    }
}

/// HTTP middleware: the request goes on only with a valid key (401 with an OpenAI error body
/// and `WWW-Authenticate: Bearer` otherwise).
pub async fn require_key(
    State((keys, metrics)): State<(Arc<ApiKeys>, Arc<RouterMetrics>)>,
    req: Request,
    next: Next,
) -> Response {
    let header = req.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
    match keys.check(header) {
        Ok(()) => next.run(req).await,
        Err(m) => {
            metrics.refused("unauthorized");
            let mut resp = ApiError::Unauthorized(m).into_response();
            resp.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            resp
        }
    }
}

/// The bytes of one connection, TLS or not.
enum Wire {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// One accepted connection, after its TLS handshake. Reads until the first bytes of a request
/// have arrived are bounded by the header timeout (hyper bounds the rest of each HTTP/1 head);
/// a write that makes no progress for the write-stall timeout fails, which closes the
/// connection and so cancels its requests.
pub struct Conn {
    wire: Wire,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
    /// Bytes still to come before the opening deadline is lifted, and that deadline.
    opening: Option<(usize, Pin<Box<Sleep>>)>,
    write_stall: Duration,
    /// Since a write first waited: the socket's unacknowledged bytes then, and the deadline.
    stalled: Option<(Option<i64>, Pin<Box<Sleep>>)>,
}

/// Enough bytes to tell HTTP/1 from the HTTP/2 preface.
const OPENING_BYTES: usize = 24;

impl Conn {
    fn new(wire: Wire, limits: &Limits) -> Self {
        let tcp = match &wire {
            Wire::Plain(s) => s,
            Wire::Tls(s) => s.get_ref().0,
        };
        let (local, peer) = (tcp.local_addr().ok(), tcp.peer_addr().ok());
        Self {
            wire,
            local,
            peer,
            opening: Some((
                OPENING_BYTES,
                Box::pin(tokio::time::sleep(limits.header_timeout)),
            )),
            write_stall: limits.write_stall,
            stalled: None,
        }
    }

    fn wire(&mut self) -> Pin<&mut (dyn AsyncReadWrite + Unpin)> {
        match &mut self.wire {
            Wire::Plain(s) => Pin::new(s),
            Wire::Tls(s) => Pin::new(s.as_mut()),
        }
    }

    /// Called when a write returned Pending: fails once the client has taken nothing for the
    /// write-stall timeout. The kernel wakes a writer only when a good part of the send buffer
    /// is free, so a client that reads slowly can leave writes pending that long while still
    /// reading: the socket's unacknowledged bytes tell the two apart.
    fn poll_stall(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.write_stall;
        loop {
            let queued = self.unacked();
            let (since, sleep) = self
                .stalled
                .get_or_insert_with(|| (queued, Box::pin(tokio::time::sleep(limit))));
            ready!(sleep.as_mut().poll(cx));
            match (queued, *since) {
                (Some(now), Some(then)) if now < then => self.stalled = None,
                _ => {
                    return Poll::Ready(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client read nothing for {limit:?}"),
                    ))
                }
            }
        }
    }

    /// Bytes sent on the socket and not yet acknowledged by the client (Linux), which falls as
    /// the client reads.
    fn unacked(&self) -> Option<i64> {
        let tcp = match &self.wire {
            Wire::Plain(s) => s,
            Wire::Tls(s) => s.get_ref().0,
        };
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let mut n: libc::c_int = 0;
            // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int for a TCP socket we own.
            let rc = unsafe { libc::ioctl(tcp.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
            (rc == 0).then_some(i64::from(n))
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = tcp;
            None
        }
    }

    fn after_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending => match self.poll_stall(cx) {
                Poll::Ready(e) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
            done => {
                self.stalled = None;
                done
            }
        }
    }
}

trait AsyncReadWrite: AsyncRead + AsyncWrite {}
impl<T: AsyncRead + AsyncWrite> AsyncReadWrite for T {}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match self.wire().poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let got = buf.filled().len() - before;
                if let Some((left, _)) = &mut self.opening {
                    // End of stream ends the opening too.
                    *left = if got == 0 {
                        0
                    } else {
                        left.saturating_sub(got)
                    };
                    if *left == 0 {
                        self.opening = None;
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let expired = match &mut self.opening {
                    Some((_, deadline)) => deadline.as_mut().poll(cx).is_ready(),
                    None => false,
                };
                if expired {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no request arrived within the header timeout",
                    )))
                } else {
                    Poll::Pending
                }
            }
            err => err,
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = self.wire().poll_write(cx, buf);
        self.after_write(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = self.wire().poll_write_vectored(cx, bufs);
        self.after_write(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        match &self.wire {
            Wire::Plain(s) => s.is_write_vectored(),
            Wire::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = self.wire().poll_flush(cx);
        self.after_write(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.wire().poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        tonic::transport::server::TcpConnectInfo {
            local_addr: self.local,
            remote_addr: self.peer,
        }
    }
}

/// Accepts connections until the receiver is dropped. Each TLS handshake runs in its own task
/// under the header timeout, so a client that stalls it holds nothing but its socket.
pub fn accept(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: Limits,
) -> mpsc::Receiver<Conn> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                _ = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: back off rather than spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let tx = tx.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let wire = match tls {
                    None => Wire::Plain(tcp),
                    Some(acceptor) => {
                        match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp))
                            .await
                        {
                            Ok(Ok(s)) => Wire::Tls(Box::new(s)),
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                return;
                            }
                        }
                    }
                };
                let _ = tx.send(Conn::new(wire, &limits)).await;
            });
        }
    });
    rx
}

/// Serves the HTTP API on accepted connections until `stop` resolves, then lets open
/// connections finish.
pub async fn serve_http(
    mut conns: mpsc::Receiver<Conn>,
    app: axum::Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_headers(limits.max_headers)
        // hyper answers 431 when a head outgrows its read buffer.
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        // A peer that vanishes without closing is found within 40 s.
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20));
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let conn = tokio::select! {
            _ = &mut stop => break,
            c = conns.recv() => match c {
                Some(c) => c,
                None => break,
            },
        };
        let svc = TowerToHyperService::new(app.clone());
        let serving = builder
            .serve_connection_with_upgrades(TokioIo::new(conn), svc)
            .into_owned();
        let serving = graceful.watch(serving);
        tokio::spawn(async move {
            if let Err(e) = serving.await {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
        });
    }
    drop(conns);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn keys(k: &[&str]) -> ApiKeys {
        ApiKeys::new(&k.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn keys_accept_a_bearer_token_of_any_listed_key_and_nothing_else() {
        let k = keys(&["alpha", "beta-2"]);
        assert!(k.check(Some(b"Bearer alpha")).is_ok());
        assert!(k.check(Some(b"bearer beta-2")).is_ok());
        assert!(k.check(Some(b"Bearer  beta-2 ")).is_ok());
        assert_eq!(
            k.check(Some(b"Bearer alph")),
            Err("incorrect API key provided".into())
        );
        assert_eq!(
            k.check(Some(b"Bearer alpha2")),
            Err("incorrect API key provided".into())
        );
        assert!(k
            .check(Some(b"Basic alpha"))
            .unwrap_err()
            .contains("Bearer KEY"));
        assert!(k.check(Some(b"alpha")).unwrap_err().contains("Bearer KEY"));
        assert!(k.check(Some(b"Bearer \xff")).is_err());
        assert!(k.check(None).unwrap_err().contains("no API key"));
        // No keys: open.
        assert!(keys(&[]).check(None).is_ok());
        assert!(keys(&[]).is_open());
        // A key that could never be sent is refused at start.
        for bad in ["", "a b", "tab\there"] {
            assert!(matches!(
                ApiKeys::new(&[bad.to_string()]),
                Err(FrontDoorError::BadKey)
            ));
        }
    }

    #[test]
    fn a_key_file_adds_its_keys_and_an_empty_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("tandem-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# team keys\n\n  from-file-1 \nfrom-file-2\n").unwrap();
        let args = FrontDoorArgs {
            api_keys: vec!["flag-key".into()],
            api_key_file: Some(file.clone()),
            ..Default::default()
        };
        let door = args.resolve().unwrap();
        for ok in ["flag-key", "from-file-1", "from-file-2"] {
            assert!(
                door.api_keys
                    .check(Some(format!("Bearer {ok}").as_bytes()))
                    .is_ok(),
                "{ok}"
            );
        }
        assert!(door.api_keys.check(Some(b"Bearer # team keys")).is_err());
        assert!(door.metrics_keys.is_open());

        std::fs::write(&file, "# nothing here\n\n").unwrap();
        assert!(matches!(args.resolve(), Err(FrontDoorError::NoKeys(_))));
        let missing = FrontDoorArgs {
            api_key_file: Some(dir.join("absent")),
            ..Default::default()
        };
        assert!(matches!(
            missing.resolve(),
            Err(FrontDoorError::KeyFile { .. })
        ));
        let zero = FrontDoorArgs {
            header_timeout_ms: 0,
            ..Default::default()
        };
        assert!(matches!(
            zero.resolve(),
            Err(FrontDoorError::TooSmall("header-timeout-ms", 1))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tls_files_that_are_not_pem_are_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("tandem-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, "not a certificate").unwrap();
        std::fs::write(&key, "not a key").unwrap();
        let args = FrontDoorArgs {
            tls_cert: Some(cert),
            tls_key: Some(key),
            ..Default::default()
        };
        match args.resolve() {
            Err(FrontDoorError::Pem { what, .. }) => assert_eq!(what, "certificate"),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("garbage accepted as a certificate"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn limits(header: u64, write: u64) -> Limits {
        Limits {
            max_body: 1 << 20,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            header_timeout: Duration::from_millis(header),
            body_stall: Duration::from_secs(10),
            write_stall: Duration::from_millis(write),
        }
    }

    /// A connected pair: the server side as a [`Conn`], and the client's socket.
    async fn pair(l: Limits) -> (Conn, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (Conn::new(Wire::Plain(server), &l), client)
    }

    #[tokio::test]
    async fn a_client_that_never_reads_is_cut_off_after_the_write_stall() {
        let (mut conn, client) = pair(limits(10_000, 300)).await;
        let chunk = vec![7u8; 64 << 10];
        let mut written = 0usize;
        // The socket buffers fill, then writes stall; the stall becomes an error however long
        // the filling took.
        let err = loop {
            match conn.write(&chunk).await {
                Ok(n) => written += n,
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(written > 0);
        drop(client);
    }

    #[tokio::test]
    async fn a_slow_reader_that_keeps_reading_is_never_cut_off() {
        let (mut conn, mut client) = pair(limits(10_000, 1000)).await;
        let total = 8usize << 20;
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut got = 0;
            while got < total {
                let n = client.read(&mut buf).await.unwrap();
                assert!(n > 0);
                got += n;
                // Slower than the writer, but never idle for the stall timeout.
                if got % (256 << 10) < 4096 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            got
        });
        let chunk = vec![1u8; 64 << 10];
        for _ in 0..total / chunk.len() {
            conn.write_all(&chunk).await.unwrap();
        }
        conn.flush().await.unwrap();
        assert_eq!(reader.await.unwrap(), total);
    }

    #[tokio::test]
    async fn a_connection_that_sends_nothing_is_closed_after_the_header_timeout() {
        let (mut conn, _client) = pair(limits(200, 10_000)).await;
        let mut buf = [0u8; 64];
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn once_a_request_has_begun_the_opening_deadline_is_lifted() {
        let (mut conn, mut client) = pair(limits(200, 10_000)).await;
        client.write_all(&[b'x'; OPENING_BYTES]).await.unwrap();
        let mut buf = [0u8; 64];
        let mut got = 0;
        while got < OPENING_BYTES {
            got += conn.read(&mut buf[got..]).await.unwrap();
        }
        // Past the deadline, a read still waits for data rather than failing.
        let later = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(600)).await;
            client.write_all(b"more").await.unwrap();
            client
        });
        let n = conn.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"more");
        drop(later.await.unwrap());
    }
}
