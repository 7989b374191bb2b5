//! The sending side (a prefill worker): the [`KvTransport`] seam and its TCP implementation.
//!
//! A transport opens an authenticated [`KvStream`] for one transfer to a receiver's endpoint; the
//! stream writes block frames (header sealed with the session's key + payload, checksummed)
//! straight from the caller's memory in vectored writes, so a prefill chunk's blocks go out as soon as its layers are computed while the next
//! chunk computes. Tests wrap a transport to damage frames in flight; production has TCP (and, on
//! GPUs, NCCL behind the same trait).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::auth::{self, Secret, Session};
use crate::link::{LinkFabric, LinkOffer, PairLink};
use crate::shape::KvShape;
use crate::wire::{FrameHeader, FrameKind, HEADER_LEN, MAX_CONTEXT};
use crate::TransferError;
use tandem_types::BlockId;

/// Opens streams of KV frames to receivers.
pub trait KvTransport: Send + Sync {
    /// An authenticated stream for `transfer` to the receiver at `endpoint` (`host:port`, as
    /// the receiver's grant advertised it): the receiver admits it only for that live grant at
    /// that endpoint.
    fn open<'a>(
        &'a self,
        endpoint: &'a str,
        transfer: u64,
    ) -> BoxFuture<'a, Result<Box<dyn KvStream>, TransferError>>;
}

/// One layer of one destination block (or of some of its KV heads), ready to go.
#[derive(Clone, Debug)]
pub struct BlockFrame<'a> {
    /// The layer.
    pub layer: u32,
    /// The block in the receiver's pool, as granted.
    pub block: BlockId,
    /// The KV heads the payload holds: one of the receiver's head ranges, or `0..0` for every
    /// head of the block.
    pub heads: std::ops::Range<u16>,
    /// The layer's bytes of the block (of those heads), in the pool's layout.
    pub payload: &'a [u8],
}

/// One authenticated connection to a receiver, bound to the transfer it was opened for.
pub trait KvStream: Send {
    /// The receiver's cache, as it described it in the handshake (its KV head ranges among
    /// it): None when it gave none, and takes whole-block frames.
    fn peer(&self) -> Option<&KvShape> {
        None
    }
    /// Sends block frames of one transfer, in order; they are on the wire (or in the kernel's
    /// socket buffer) when this returns.
    fn send_blocks<'a>(
        &'a mut self,
        transfer: u64,
        frames: &'a [BlockFrame<'a>],
    ) -> BoxFuture<'a, Result<(), TransferError>>;
    /// Sends one block frame.
    fn send_block<'a>(
        &'a mut self,
        transfer: u64,
        layer: u32,
        block: BlockId,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            let frame = [BlockFrame {
                layer,
                block,
                heads: 0..0,
                payload,
            }];
            self.send_blocks(transfer, &frame).await
        })
    }
    /// Says the transfer is complete (the receiver checks nothing is missing).
    fn end(&mut self, transfer: u64) -> BoxFuture<'_, Result<(), TransferError>>;
    /// Gives the transfer up (the receiver fails it at once instead of at its deadline).
    fn abort(&mut self, transfer: u64) -> BoxFuture<'_, Result<(), TransferError>>;
    /// Tells the receiver the trace context of this transfer (at most
    /// [`crate::wire::MAX_CONTEXT`] bytes of W3C trace-context text), before its first block.
    fn context<'a>(
        &'a mut self,
        transfer: u64,
        context: &'a str,
    ) -> BoxFuture<'a, Result<(), TransferError>>;
}

/// Payload bytes hashed and then handed to one vectored write. Hashing first brings the
/// payloads into cache, so the kernel's copy into the socket reads them from L2 rather than
/// memory; 256 KiB (ten f32 block frames of SmolLM2) measured best on loopback.
const WRITE_BATCH: usize = 256 << 10;
/// Most frames (two slices each) in one vectored write, within every platform's IOV_MAX.
const WRITE_BATCH_FRAMES: usize = 256;

/// How long a receiver whose payload link failed gets its payloads over TCP before a link is
/// offered to it again.
const UNLINKED_FOR: Duration = Duration::from_secs(600);

/// KV frames over TCP, authenticated with the cluster secret; block payloads on a payload link
/// beside the connection where this side has a fabric and the receiver joins its offer.
pub struct TcpTransport {
    secret: Secret,
    shape: Option<KvShape>,
    link: Option<Arc<dyn LinkFabric>>,
    /// Receivers whose payload link failed, and until when they get payloads over TCP.
    unlinked: Arc<Mutex<HashMap<String, Instant>>>,
    connect_timeout: Duration,
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::fault::WireFault>,
}

impl TcpTransport {
    /// A transport that proves `secret` to every receiver it opens.
    pub fn new(secret: Secret) -> Self {
        Self {
            secret,
            shape: None,
            link: None,
            unlinked: Arc::default(),
            connect_timeout: Duration::from_secs(3),
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }

    /// Damages frames on the wire as `fault` says (tests only: the `fault-injection` feature).
    #[cfg(feature = "fault-injection")]
    pub fn with_fault(mut self, fault: crate::fault::WireFault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Describes the sender's cache as `shape` in every handshake: a receiver whose cache
    /// does not map onto it refuses the connection with the reason.
    pub fn with_shape(mut self, shape: KvShape) -> Self {
        self.shape = Some(shape);
        self
    }

    /// Offers a payload link of `fabric` in every handshake: block payloads travel on it where
    /// the receiver joins (it has a fabric of the same kind), over the connection otherwise.
    pub fn with_link(mut self, fabric: Arc<dyn LinkFabric>) -> Self {
        self.link = Some(fabric);
        self
    }

    /// A link to offer `endpoint`, if this side has a fabric, it can make a pair, and no link
    /// to that receiver failed lately (the connection carries the payloads otherwise).
    fn offer(&self, endpoint: &str) -> Option<(Arc<dyn LinkFabric>, LinkOffer)> {
        let fabric = self.link.clone()?;
        {
            let mut unlinked = self.unlinked.lock().expect("unlinked");
            match unlinked.get(endpoint) {
                Some(&until) if Instant::now() < until => return None,
                Some(_) => {
                    unlinked.remove(endpoint);
                }
                None => {}
            }
        }
        match fabric.offer() {
            Ok(id) => Some((
                fabric.clone(),
                LinkOffer {
                    kind: fabric.kind(),
                    id,
                    device: fabric.device(),
                },
            )),
            Err(e) => {
                tracing::warn!(error = %e, link = fabric.kind().name(), "no KV payload link offered");
                None
            }
        }
    }
}

impl KvTransport for TcpTransport {
    fn open<'a>(
        &'a self,
        endpoint: &'a str,
        transfer: u64,
    ) -> BoxFuture<'a, Result<Box<dyn KvStream>, TransferError>> {
        Box::pin(async move {
            let offer = self.offer(endpoint);
            let connect = async {
                let mut s = TcpStream::connect(endpoint).await?;
                s.set_nodelay(true)?;
                let session = auth::connect_linked(
                    &mut s,
                    &self.secret,
                    self.shape.as_ref(),
                    transfer,
                    endpoint,
                    offer.as_ref().map(|(_, o)| *o),
                )
                .await?;
                Ok::<_, TransferError>((s, session))
            };
            let connected = tokio::time::timeout(self.connect_timeout, connect)
                .await
                .map_err(|_| {
                    TransferError::Handshake(format!("connecting to {endpoint} timed out"))
                })
                .and_then(|r| r);
            // The offered pair: joined as rank 0 where the receiver joined it, given up otherwise.
            let link = match (&connected, offer) {
                (Ok((_, session)), Some((fabric, o))) if session.link().is_some() => {
                    Some(fabric.join(o.id, 0)?)
                }
                (_, Some((fabric, o))) => {
                    fabric.withdraw(o.id);
                    None
                }
                (_, None) => None,
            };
            let (sock, session) = connected?;
            Ok(Box::new(TcpKvStream {
                sock,
                session,
                link,
                endpoint: endpoint.to_string(),
                unlinked: self.unlinked.clone(),
                seq: 0,
                #[cfg(feature = "fault-injection")]
                fault: self.fault.clone(),
            }) as Box<dyn KvStream>)
        })
    }
}

struct TcpKvStream {
    sock: TcpStream,
    session: Session,
    /// The payload link both sides joined: block payloads go on it, their headers on `sock`.
    link: Option<PairLink>,
    /// The receiver's endpoint, and where its link is marked failed when it fails.
    endpoint: String,
    unlinked: Arc<Mutex<HashMap<String, Instant>>>,
    /// The number of the next frame: what its tag covers.
    seq: u64,
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::fault::WireFault>,
}

/// Writes every byte of `bufs` (in order) with as few vectored writes as the socket allows.
async fn write_all_vectored(
    sock: &mut TcpStream,
    bufs: &mut [std::io::IoSlice<'_>],
) -> Result<(), TransferError> {
    let mut bufs = bufs;
    while !bufs.is_empty() {
        let n = sock.write_vectored(bufs).await?;
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
        }
        std::io::IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

impl TcpKvStream {
    /// Refuses frames of another transfer than the connection's.
    fn bound(&self, transfer: u64) -> Result<(), TransferError> {
        match transfer == self.session.transfer() {
            true => Ok(()),
            false => Err(TransferError::Config(format!(
                "a KV stream opened for transfer {:#x} cannot carry transfer {transfer:#x}",
                self.session.transfer()
            ))),
        }
    }

    /// `header`, sealed as the connection's next frame.
    fn seal(&mut self, header: &FrameHeader) -> [u8; HEADER_LEN] {
        let mut h = header.encode();
        self.session.seal(self.seq, &mut h);
        self.seq += 1;
        h
    }

    async fn control(
        &mut self,
        kind: FrameKind,
        transfer: u64,
        payload: &[u8],
    ) -> Result<(), TransferError> {
        self.bound(transfer)?;
        let h = self.seal(&FrameHeader::control(kind, transfer, payload));
        let mut slices = [std::io::IoSlice::new(&h), std::io::IoSlice::new(payload)];
        write_all_vectored(&mut self.sock, &mut slices).await
    }
}

impl KvStream for TcpKvStream {
    fn peer(&self) -> Option<&KvShape> {
        self.session.peer()
    }

    fn send_blocks<'a>(
        &'a mut self,
        transfer: u64,
        frames: &'a [BlockFrame<'a>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            self.bound(transfer)?;
            let mut rest = frames;
            while !rest.is_empty() {
                // A batch: at least one frame, then as many as fit the byte and slice budgets.
                let mut take = 1;
                let mut bytes = rest[0].payload.len();
                while take < rest.len().min(WRITE_BATCH_FRAMES)
                    && bytes + rest[take].payload.len() <= WRITE_BATCH
                {
                    bytes += rest[take].payload.len();
                    take += 1;
                }
                let (batch, tail) = rest.split_at(take);
                let on_link = self.link.is_some();
                let headers: Vec<[u8; HEADER_LEN]> = batch
                    .iter()
                    .map(|f| {
                        let h = FrameHeader::block(transfer, f.layer, f.block.0, f.payload)
                            .heads(f.heads.clone());
                        self.seal(&if on_link { h.via_link() } else { h })
                    })
                    .collect();
                // Under fault injection, a payload damaged after its header took the checksum.
                #[cfg(feature = "fault-injection")]
                let damaged: Vec<Option<Vec<u8>>> = match &self.fault {
                    Some(fault) => batch.iter().map(|f| fault.damage(f.payload)).collect(),
                    None => Vec::new(),
                };
                #[cfg(feature = "fault-injection")]
                let payload = |i: usize, f: &'a BlockFrame<'a>| {
                    damaged
                        .get(i)
                        .and_then(|d| d.as_deref())
                        .unwrap_or(f.payload)
                };
                #[cfg(not(feature = "fault-injection"))]
                let payload = |_: usize, f: &'a BlockFrame<'a>| f.payload;
                if let Some(link) = &self.link {
                    // The sealed headers on the connection, then each payload on the link in
                    // the same order: the receiver takes a payload from the link as it reads
                    // its header.
                    let mut slices: Vec<std::io::IoSlice<'_>> =
                        headers.iter().map(|h| std::io::IoSlice::new(h)).collect();
                    write_all_vectored(&mut self.sock, &mut slices).await?;
                    for (i, f) in batch.iter().enumerate() {
                        if let Err(e) = link.send(payload(i, f).to_vec()).await {
                            // The transfer fails (and is retried); the next ones to this
                            // receiver go over TCP for a while rather than fail the same way.
                            tracing::warn!(
                                endpoint = %self.endpoint,
                                error = %e,
                                "KV payload link failed: payloads to this receiver go over TCP for {} s",
                                UNLINKED_FOR.as_secs()
                            );
                            self.unlinked
                                .lock()
                                .expect("unlinked")
                                .insert(self.endpoint.clone(), Instant::now() + UNLINKED_FOR);
                            return Err(e);
                        }
                    }
                    rest = tail;
                    continue;
                }
                let mut slices: Vec<std::io::IoSlice<'_>> = headers
                    .iter()
                    .zip(batch)
                    .enumerate()
                    .flat_map(|(i, (h, f))| {
                        [
                            std::io::IoSlice::new(h),
                            std::io::IoSlice::new(payload(i, f)),
                        ]
                    })
                    .collect();
                write_all_vectored(&mut self.sock, &mut slices).await?;
                rest = tail;
            }
            Ok(())
        })
    }

    fn end(&mut self, transfer: u64) -> BoxFuture<'_, Result<(), TransferError>> {
        Box::pin(self.control(FrameKind::End, transfer, &[]))
    }

    fn abort(&mut self, transfer: u64) -> BoxFuture<'_, Result<(), TransferError>> {
        Box::pin(self.control(FrameKind::Abort, transfer, &[]))
    }

    fn context<'a>(
        &'a mut self,
        transfer: u64,
        context: &'a str,
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            if context.len() > MAX_CONTEXT {
                return Err(TransferError::Config(format!(
                    "a trace context of {} bytes is over the {MAX_CONTEXT}-byte limit",
                    context.len()
                )));
            }
            self.control(FrameKind::Context, transfer, context.as_bytes())
                .await
        })
    }
}
