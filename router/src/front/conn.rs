//! One accepted connection: TLS or plain bytes, with the deadlines on the client's own progress.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use super::ConnLimits;

/// The bytes of one connection, TLS or not.
pub(super) enum Wire {
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
pub(super) const OPENING_BYTES: usize = 24;

impl Conn {
    pub(super) fn new(wire: Wire, limits: &ConnLimits) -> Self {
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
