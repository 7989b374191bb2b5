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
use crate::link::{LinkAnswer, LinkFabric, LinkOffer, PairLink, BUSY_WAIT};
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
/// How long a receiver that answered it never takes this sender's links is offered none (a
/// worker restarted at its address may take them).
const NEVER_FOR: Duration = Duration::from_secs(3600);
/// How long a receiver that declined a new pair (no room, its join failed) is offered none.
const DECLINED_FOR: Duration = Duration::from_secs(60);

/// What a handshake said of a link offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reply {
    /// The receiver's answer.
    Answered(LinkAnswer),
    /// The connection was refused (status 2 or 3): the offer was not looked at.
    Refused,
    /// No answer came (the connection or its handshake failed).
    Unanswered,
}

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
    /// Receivers offered no link until then: one failed, a new pair was declined, or the
    /// receiver never takes this sender's links (no fabric of its kind, its own device). An
    /// offer not taken is left behind (an NCCL id keeps a thread and a socket waiting for
    /// ranks that never come), so none is made to them.
    unlinked: HashMap<String, Instant>,
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
            if st.unlinked.get(endpoint).is_some_and(|&until| now < until) {
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

    /// This side's end of the pair after the handshake's `reply`.
    fn settle(
        &self,
        endpoint: &str,
        offered: Offered,
        reply: Reply,
    ) -> Result<Option<(LinkOffer, PairLink)>, TransferError> {
        let Offered { offer, end } = offered;
        let stop_offers = |what: &str, secs: Duration| {
            tracing::info!(
                endpoint,
                link = self.fabric.kind().name(),
                "this KV receiver {what}: no payload link offered to it for {} s",
                secs.as_secs()
            );
            self.unlink(endpoint, secs);
        };
        match (reply, end) {
            (Reply::Answered(LinkAnswer::Joined), Some(end)) => Ok(Some((offer, end))),
            (Reply::Answered(LinkAnswer::Joined), None) => Ok(Some((
                LinkOffer {
                    reuse: true,
                    ..offer
                },
                self.fabric.join(offer.id, 0)?,
            ))),
            // Still busy with the connection before on the receiver, or not looked at (the
            // connection was refused): kept for the next.
            (Reply::Answered(LinkAnswer::Busy) | Reply::Refused, Some(end)) => {
                self.idle(endpoint, offer, end);
                Ok(None)
            }
            (Reply::Answered(LinkAnswer::Never), end) => {
                if end.is_none() {
                    self.fabric.withdraw(offer.id);
                }
                stop_offers(
                    "takes no payload links from here (no fabric of this kind, or the same device)",
                    NEVER_FOR,
                );
                Ok(None)
            }
            // A new pair declined (no room, its join failed): none offered for a while, each
            // offer made and not taken being left behind.
            (Reply::Answered(LinkAnswer::Declined), None) => {
                self.fabric.withdraw(offer.id);
                stop_offers("declined a new payload link", DECLINED_FOR);
                Ok(None)
            }
            // A new pair not answered, or refused with its connection: given up. A reused one
            // declined (the receiver no longer has it) or not answered: dropped.
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
        self.unlink(endpoint, UNLINKED_FOR);
    }

    /// Drops `endpoint`'s idle links and offers it none for `secs`.
    fn unlink(&self, endpoint: &str, secs: Duration) {
        let mut st = self.state.lock().expect("links");
        st.idle.remove(endpoint);
        st.unlinked
            .insert(endpoint.to_string(), Instant::now() + secs);
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
            // A pair offered again may wait on the receiver for its previous connection.
            let reusing = offered.as_ref().is_some_and(|o| o.offer.reuse);
            let limit = self.connect_timeout + if reusing { BUSY_WAIT } else { Duration::ZERO };
            let connected = tokio::time::timeout(limit, connect)
                .await
                .map_err(|_| {
                    TransferError::Handshake(format!("connecting to {endpoint} timed out"))
                })
                .and_then(|r| r);
            // The offered pair: this side's end where the receiver took it.
            let link = match (&self.link, offered) {
                (Some(links), Some(offered)) => {
                    let reply = match &connected {
                        Ok((_, s)) => Reply::Answered(s.link_answer()),
                        Err(TransferError::NotGranted(_) | TransferError::Mismatch(_)) => {
                            Reply::Refused
                        }
                        Err(_) => Reply::Unanswered,
                    };
                    links.settle(endpoint, offered, reply)?
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::ThreadFabric;

    fn links(fabric: &Arc<ThreadFabric>) -> SenderLinks {
        SenderLinks {
            fabric: fabric.clone(),
            state: Mutex::default(),
            sweeping: Default::default(),
        }
    }

    const EP: &str = "10.0.0.9:7300";

    /// Every reply to a new pair and to one offered again: joined (kept, then offered again,
    /// the longest idle first), busy and refused (kept), declined and unanswered (a new pair
    /// withdrawn, a reused end dropped), never and a declined new pair (no offer for a while);
    /// no pair is ever left offered on the fabric.
    #[tokio::test]
    async fn each_reply_keeps_drops_or_withdraws_the_pair() {
        let fabric = ThreadFabric::new(Duration::from_secs(30));
        let l = links(&fabric);
        let joined = |l: &SenderLinks| {
            let o = l.offer(EP).unwrap();
            assert!(!o.offer.reuse);
            // The receiver's end, joined as it would be.
            let theirs = fabric.join(o.offer.id, 1).unwrap();
            let (offer, end) = l
                .settle(EP, o, Reply::Answered(LinkAnswer::Joined))
                .unwrap()
                .unwrap();
            (offer, end, theirs)
        };
        let (first, end1, _t1) = joined(&l);
        let (second, end2, _t2) = joined(&l);
        assert!(
            first.reuse && second.reuse,
            "a joined pair is offered again as such"
        );
        l.idle(EP, first, end1);
        l.idle(EP, second, end2);
        // The longest idle first; busy and refused keep it (behind the other).
        let o = l.offer(EP).unwrap();
        assert_eq!((o.offer.id, o.offer.reuse), (first.id, true));
        assert!(l
            .settle(EP, o, Reply::Answered(LinkAnswer::Busy))
            .unwrap()
            .is_none());
        let o = l.offer(EP).unwrap();
        assert_eq!(o.offer.id, second.id);
        assert!(l.settle(EP, o, Reply::Refused).unwrap().is_none());
        let ids: Vec<_> = l.state.lock().unwrap().idle[EP]
            .iter()
            .map(|(o, _, _)| o.id)
            .collect();
        assert_eq!(ids, [first.id, second.id]);
        // Declined or unanswered, a reused end is dropped.
        for reply in [Reply::Answered(LinkAnswer::Declined), Reply::Unanswered] {
            let o = l.offer(EP).unwrap();
            assert!(o.offer.reuse);
            assert!(l.settle(EP, o, reply).unwrap().is_none());
        }
        assert!(l.state.lock().unwrap().idle[EP].is_empty());
        // A new pair refused or unanswered is withdrawn, and offers go on.
        for reply in [Reply::Refused, Reply::Unanswered] {
            let o = l.offer(EP).unwrap();
            assert!(!o.offer.reuse);
            assert!(l.settle(EP, o, reply).unwrap().is_none());
            assert_eq!(fabric.pending(), 0);
        }
        // Declined or never: withdrawn, and no more offers to that receiver for a while.
        for (reply, secs) in [
            (LinkAnswer::Declined, DECLINED_FOR),
            (LinkAnswer::Never, NEVER_FOR),
        ] {
            let l = links(&fabric);
            let o = l.offer(EP).unwrap();
            assert!(l.settle(EP, o, Reply::Answered(reply)).unwrap().is_none());
            assert_eq!(fabric.pending(), 0);
            assert!(l.offer(EP).is_none(), "{reply:?}");
            let other = l.offer("10.0.0.10:7300").expect("another receiver");
            fabric.withdraw(other.offer.id);
            let until = l.state.lock().unwrap().unlinked[EP];
            let left = until.saturating_duration_since(Instant::now());
            assert!(left > secs / 2 && left <= secs, "{reply:?}: {left:?}");
        }
    }
}
