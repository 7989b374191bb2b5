//! The accept loop and the HTTP server over accepted connections.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;

use super::conn::{Conn, Wire};
use super::ConnLimits;

/// Accepts connections until the receiver is dropped. Each TLS handshake runs in its own task
/// under the header timeout, so a client that stalls it holds nothing but its socket.
pub fn accept(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
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
    limits: ConnLimits,
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
        // Set when the connection's first request arrives: an HTTP/2 client that sends its
        // preface (which lifts the opening deadline) and then no request, answering pings
        // forever, is closed at the header timeout like an HTTP/1 one that sends no head.
        let began = Arc::new(AtomicBool::new(false));
        let seen = began.clone();
        let svc = TowerToHyperService::new(tower::util::MapRequest::new(app.clone(), move |req| {
            seen.store(true, Ordering::Relaxed);
            req
        }));
        let serving = builder
            .serve_connection_with_upgrades(TokioIo::new(conn), svc)
            .into_owned();
        let serving = graceful.watch(serving);
        let opening = limits.header_timeout;
        tokio::spawn(async move {
            let idle = async {
                tokio::time::sleep(opening).await;
                if began.load(Ordering::Relaxed) {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                r = serving => if let Err(e) = r {
                    tracing::debug!(error = %e, "HTTP connection ended");
                },
                // Dropping the connection closes it.
                _ = idle => tracing::debug!("connection opened no request within the header timeout: closed"),
            }
        });
    }
    drop(conns);
    graceful.shutdown().await;
}
