//! The sending side (a prefill worker): the [`KvTransport`] seam and its TCP implementation.
//!
//! A transport opens an authenticated [`KvStream`] for one transfer to a receiver's endpoint; the
//! stream writes block frames (header sealed with the session's key + payload, checksummed)
//! straight from the caller's memory in vectored writes, so a prefill chunk's blocks go out as soon as its layers are computed while the next
//! chunk computes. Tests wrap a transport to damage frames in flight; production has TCP (and, on
//! GPUs, NCCL behind the same trait).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::auth::{self, Secret, Session};
use crate::link::{LinkAnswer, LinkFabric, LinkOffer, PairLink};
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
/// Idle links kept per receiver (each an NCCL communicator holding device buffers): as many as
/// transfers to one receiver commonly run at once.
const IDLE_LINKS_PER_RECEIVER: usize = 8;
/// How long an idle link is kept for its receiver.
const IDLE_LINK_FOR: Duration = Duration::from_secs(600);
/// How often idle links past [`IDLE_LINK_FOR`] are dropped.
const LINK_SWEEP: Duration = Duration::from_secs(60);

/// A sender's payload links: its fabric, the pairs joined and idle per receiver (offered again
/// before a new one is made), and the receivers whose link failed lately.
struct SenderLinks {
    fabric: Arc<dyn LinkFabric>,
    state: Mutex<SenderLinkState>,
    /// Whether the task dropping idle links past their time runs.
    sweeping: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct SenderLinkState {
    /// Idle pairs per receiver, the longest idle first.
    idle: HashMap<String, Vec<(LinkOffer, PairLink, Instant)>>,
    /// Receivers offered no link until then: one failed, or a new pair was declined.
    unlinked: HashMap<String, Instant>,
    /// Receivers that never take this sender's links (no fabric of its kind, its own device):
    /// an offer made to them would be left behind (an NCCL id keeps a thread and a socket
    /// waiting for ranks that never come).
    never: HashSet<String>,
}

/// What one connection offers: a pair, and this side's end of it when it is offered again.
struct Offered {
    offer: LinkOffer,
    end: Option<PairLink>,
}

impl SenderLinkState {
    /// Drops the idle pairs past [`IDLE_LINK_FOR`].
    fn sweep(&mut self, now: Instant) {
        for ends in self.idle.values_mut() {
            ends.retain(|(_, _, since)| now.duration_since(*since) < IDLE_LINK_FOR);
        }
        self.idle.retain(|_, ends| !ends.is_empty());
    }
}

impl SenderLinks {
    /// What to offer `endpoint`: an idle pair of it, or a new one; none where a link to it
    /// failed lately or the fabric cannot make a pair (the connection carries the payloads).
    fn offer(&self, endpoint: &str) -> Option<Offered> {
        let now = Instant::now();
        {
            let mut st = self.state.lock().expect("links");
            if st.never.contains(endpoint)
                || st.unlinked.get(endpoint).is_some_and(|&until| now < until)
            {
                return None;
            }
            st.unlinked.remove(endpoint);
            st.sweep(now);
            // The longest idle first: the one the receiver surely gave back.
            if let Some(ends) = st.idle.get_mut(endpoint).filter(|e| !e.is_empty()) {
                let (offer, end, _) = ends.remove(0);
                return Some(Offered {
                    offer,
                    end: Some(end),
                });
            }
        }
        match self.fabric.offer() {
            Ok(id) => Some(Offered {
                offer: LinkOffer {
                    kind: self.fabric.kind(),
                    id,
                    device: self.fabric.device(),
                    reuse: false,
                },
                end: None,
            }),
            Err(e) => {
                tracing::warn!(error = %e, link = self.fabric.kind().name(), "no KV payload link offered");
                None
            }
        }
    }

    /// This side's end of the pair after the handshake answered `answer` (an error: no answer).
    fn settle(
        &self,
        endpoint: &str,
        offered: Offered,
        answer: Option<LinkAnswer>,
    ) -> Result<Option<(LinkOffer, PairLink)>, TransferError> {
        let Offered { offer, end } = offered;
        match (answer, end) {
            (Some(LinkAnswer::Joined), Some(end)) => Ok(Some((offer, end))),
            (Some(LinkAnswer::Joined), None) => Ok(Some((
                LinkOffer {
                    reuse: true,
                    ..offer
                },
                self.fabric.join(offer.id, 0)?,
            ))),
            // Still busy with the connection before on the receiver: kept for the next.
            (Some(LinkAnswer::Busy), Some(end)) => {
                self.idle(endpoint, offer, end);
                Ok(None)
            }
            (Some(LinkAnswer::Never), end) => {
                tracing::info!(
                    endpoint,
                    link = self.fabric.kind().name(),
                    "this KV receiver takes no payload links from here (no fabric of this kind, or the same device): TCP only"
                );
                if end.is_none() {
                    self.fabric.withdraw(offer.id);
                }
                let mut st = self.state.lock().expect("links");
                st.idle.remove(endpoint);
                st.never.insert(endpoint.to_string());
                Ok(None)
            }
            // A new pair declined (no room, its join failed): none offered for a while, each
            // offer made and not taken being left behind.
            (Some(LinkAnswer::Declined), None) => {
                self.fabric.withdraw(offer.id);
                self.state
                    .lock()
                    .expect("links")
                    .unlinked
                    .insert(endpoint.to_string(), Instant::now() + UNLINKED_FOR);
                Ok(None)
            }
            // No answer: a new pair is given up; a reused one (declined: the receiver no longer
            // has it; or no answer) dropped.
            (_, None) => {
                self.fabric.withdraw(offer.id);
                Ok(None)
            }
            (_, Some(_)) => Ok(None),
        }
    }

    /// Starts the task that drops idle links past their time, once.
    fn sweep_from_now_on(self: &Arc<Self>) {
        if self
            .sweeping
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(LINK_SWEEP).await;
                let Some(links) = weak.upgrade() else { return };
                links.state.lock().expect("links").sweep(Instant::now());
            }
        });
    }

    /// Keeps `end` for `endpoint`'s next connection (beyond the per-receiver bound, dropped).
    fn idle(&self, endpoint: &str, offer: LinkOffer, end: PairLink) {
        let mut st = self.state.lock().expect("links");
        let ends = st.idle.entry(endpoint.to_string()).or_default();
        if ends.len() < IDLE_LINKS_PER_RECEIVER {
            ends.push((offer, end, Instant::now()));
        }
    }

    /// Gives links to `endpoint` up for a while after one failed.
    fn failed(&self, endpoint: &str, e: &TransferError) {
        tracing::warn!(
            endpoint,
            error = %e,
            "KV payload link failed: payloads to this receiver go over TCP for {} s",
            UNLINKED_FOR.as_secs()
        );
        let mut st = self.state.lock().expect("links");
        st.idle.remove(endpoint);
        st.unlinked
            .insert(endpoint.to_string(), Instant::now() + UNLINKED_FOR);
    }
}

/// KV frames over TCP, authenticated with the cluster secret; block payloads on a payload link
/// beside the connection where this side has a fabric and the receiver joins its offer.
pub struct TcpTransport {
    secret: Secret,
    shape: Option<KvShape>,
    link: Option<Arc<SenderLinks>>,
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
    /// the receiver joins (it has a fabric of the same kind), over the connection otherwise. A
    /// link outlives its connection: once a transfer ends with it in step, it is offered again
    /// to the same receiver (an NCCL communicator is made once per pair, not per transfer).
    pub fn with_link(mut self, fabric: Arc<dyn LinkFabric>) -> Self {
        self.link = Some(Arc::new(SenderLinks {
            fabric,
            state: Mutex::default(),
            sweeping: Default::default(),
        }));
        self
    }

    /// Links joined and idle, kept to be offered again (over every receiver).
    pub fn idle_links(&self) -> usize {
        self.link.as_ref().map_or(0, |l| {
            l.state
                .lock()
                .expect("links")
                .idle
                .values()
                .map(Vec::len)
                .sum()
        })
    }
}

impl KvTransport for TcpTransport {
    fn open<'a>(
        &'a self,
        endpoint: &'a str,
        transfer: u64,
    ) -> BoxFuture<'a, Result<Box<dyn KvStream>, TransferError>> {
        Box::pin(async move {
            let offered = self.link.as_ref().and_then(|l| {
                l.sweep_from_now_on();
                l.offer(endpoint)
            });
            let connect = async {
                let mut s = TcpStream::connect(endpoint).await?;
                s.set_nodelay(true)?;
                let session = auth::connect_linked(
                    &mut s,
                    &self.secret,
                    self.shape.as_ref(),
                    transfer,
                    endpoint,
                    offered.as_ref().map(|o| o.offer),
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
            // The offered pair: this side's end where the receiver took it.
            let link = match (&self.link, offered) {
                (Some(links), Some(offered)) => {
                    let answer = connected.as_ref().ok().map(|(_, s)| s.link_answer());
                    links.settle(endpoint, offered, answer)?
                }
                _ => None,
            };
            let (sock, session) = connected?;
            Ok(Box::new(TcpKvStream {
                sock,
                session,
                link,
                links: self.link.clone(),
                in_step: true,
                endpoint: endpoint.to_string(),
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
    /// The payload link both sides took (as it is offered again): block payloads go on it,
    /// their headers on `sock`.
    link: Option<(LinkOffer, PairLink)>,
    /// Where the link goes back, idle, when the stream is dropped with it in step.
    links: Option<Arc<SenderLinks>>,
    /// Every payload whose header went out went on the link too (no send interrupted or
    /// failed): the link may serve the receiver's next transfer.
    in_step: bool,
    /// The receiver's endpoint.
    endpoint: String,
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

impl Drop for TcpKvStream {
    fn drop(&mut self) {
        if let (Some((offer, end)), Some(links), true) =
            (self.link.take(), &self.links, self.in_step)
        {
            links.idle(&self.endpoint, offer, end);
        }
    }
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
                if let Some((_, link)) = &self.link {
                    // The sealed headers on the connection, then each payload on the link in
                    // the same order: the receiver takes a payload from the link as it reads
                    // its header. Out of step until every one of them is sent.
                    self.in_step = false;
                    let mut slices: Vec<std::io::IoSlice<'_>> =
                        headers.iter().map(|h| std::io::IoSlice::new(h)).collect();
                    write_all_vectored(&mut self.sock, &mut slices).await?;
                    for (i, f) in batch.iter().enumerate() {
                        if let Err(e) = link.send(payload(i, f).to_vec()).await {
                            // The transfer fails (and is retried); the next ones to this
                            // receiver go over TCP for a while rather than fail the same way.
                            if let Some(links) = &self.links {
                                links.failed(&self.endpoint, &e);
                            }
                            return Err(e);
                        }
                    }
                    self.in_step = true;
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
