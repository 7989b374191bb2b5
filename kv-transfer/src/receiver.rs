//! The receiving side (a decode worker): a TCP listener that authenticates peers and writes
//! block frames straight into the blocks granted to a transfer.
//!
//! The decode worker allocates blocks first, then [`KvReceiver::grant`]s them to a new transfer
//! with a deadline; the returned [`TransferGrant`] resolves when every (layer, block) of the grant
//! has arrived intact, and fails on the first bad frame, an abort, or the deadline. Dropping the
//! grant revokes it: later frames for it are rejected as unknown. Every rejected frame is counted
//! by reason. A frame's payload is always read in full before it is judged, so one bad frame does
//! not desynchronize the connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::RngCore;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::time::Instant;

use tandem_types::BlockId;

use crate::auth::{self, Secret};
use crate::link::{LinkAnswer, LinkFabric, LinkOffer, PairLink, BUSY_WAIT, LINK_DEVICE, LINK_ID};
use crate::shape::{convert_values, Float, KvShape};
use crate::wire::{checksum, FrameHeader, FrameKind, HEADER_LEN, MAX_CONTEXT};
use crate::TransferError;
use std::ops::Range;

/// Where granted blocks are written: the worker's KV pool (or a test buffer).
pub trait BlockSink: Send + Sync {
    /// Bytes of one layer of one block: every whole-block frame's exact payload length.
    fn frame_len(&self) -> usize;
    /// Layers per block: every granted block is complete once each has arrived.
    fn layers(&self) -> u32;
    /// Writes one layer of one block. Called only for blocks granted to a live transfer, after
    /// the frame's length and checksum were checked.
    fn write(&self, layer: u32, block: BlockId, payload: &[u8]);
    /// The KV head ranges the sink takes frames of, one per tensor-parallel rank's heads
    /// (replicas once): a block layer is complete once each has arrived. Empty: whole-block
    /// frames only; a sink of one range also takes whole-block frames as that range.
    fn pieces(&self) -> Vec<Range<u32>> {
        Vec::new()
    }
    /// Bytes of one layer of one block of piece `piece`'s heads.
    fn piece_len(&self, piece: usize) -> usize {
        let _ = piece;
        self.frame_len()
    }
    /// Writes piece `piece` of one layer of one block (after the same checks as [`Self::write`]).
    fn write_piece(&self, layer: u32, block: BlockId, piece: usize, payload: &[u8]) {
        let _ = piece;
        self.write(layer, block, payload)
    }
    /// Waits until every write so far has reached the blocks, and says whether any write into
    /// `blocks` (a grant's) failed: a sink that stores asynchronously (a GPU's cache, through
    /// staging buffers) finishes its copies here. A grant settles its sink with its blocks
    /// before its transfer is reported complete, or when it is dropped without that, so a
    /// block is never handed back to the engine (or freed) with a copy into it still in flight.
    fn settle(&self, blocks: &[BlockId]) -> Result<(), String> {
        let _ = blocks;
        Ok(())
    }
}

/// The frame length a sender of `conv`'s first type sends for a sink piece of `sink_len` bytes
/// of its second type (the sink's own length without a conversion).
fn wire_len(sink_len: usize, conv: Option<(Float, Float)>) -> usize {
    match conv {
        None => sink_len,
        Some((from, to)) => sink_len / to.bytes() * from.bytes(),
    }
}

/// Why frames were refused, counted since the receiver started.
#[derive(Debug, Default)]
pub struct Rejections {
    /// Frames for a transfer id no live grant has.
    pub unknown_transfer: AtomicU64,
    /// Frames for a block outside their transfer's grant.
    pub block_not_granted: AtomicU64,
    /// Frames for a layer the sink does not have.
    pub bad_layer: AtomicU64,
    /// Frames whose payload is not one block layer long.
    pub bad_length: AtomicU64,
    /// Frames whose payload does not match their checksum.
    pub bad_checksum: AtomicU64,
    /// Frames that arrived after their grant's deadline.
    pub expired: AtomicU64,
    /// Headers that did not decode.
    pub malformed: AtomicU64,
    /// Connections that failed the secret handshake.
    pub unauthenticated: AtomicU64,
    /// Block frames whose KV heads are not a range the sink takes.
    pub bad_heads: AtomicU64,
    /// Connections from a sender whose cache cannot map onto this one (refused with the reason).
    pub mismatched: AtomicU64,
    /// Connections naming a transfer with no live grant here, or another endpoint than this
    /// receiver's (a relayed handshake): refused with the reason.
    pub not_granted: AtomicU64,
    /// Frames whose header tag does not match the connection's session (injected, replayed or
    /// reordered): the connection is closed and its transfer failed.
    pub bad_tag: AtomicU64,
    /// Block frames whose payload did not come over the connection's payload link (the link
    /// failed or timed out, or the frame named a link the connection does not have): the
    /// connection is closed and its transfer failed.
    pub link_failed: AtomicU64,
}

impl Rejections {
    /// `(reason, count)` for every reason, for metrics.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("unknown_transfer", l(&self.unknown_transfer)),
            ("block_not_granted", l(&self.block_not_granted)),
            ("bad_layer", l(&self.bad_layer)),
            ("bad_length", l(&self.bad_length)),
            ("bad_checksum", l(&self.bad_checksum)),
            ("expired", l(&self.expired)),
            ("malformed", l(&self.malformed)),
            ("unauthenticated", l(&self.unauthenticated)),
            ("bad_heads", l(&self.bad_heads)),
            ("mismatched", l(&self.mismatched)),
            ("not_granted", l(&self.not_granted)),
            ("bad_tag", l(&self.bad_tag)),
            ("link_failed", l(&self.link_failed)),
        ]
    }

    /// Frames and connections refused for any reason.
    pub fn total(&self) -> u64 {
        self.snapshot().iter().map(|(_, n)| n).sum()
    }
}

/// What a completed transfer moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferStats {
    /// Block frames written.
    pub frames: u64,
    /// Payload bytes written.
    pub bytes: u64,
    /// The sender's trace context (W3C `traceparent`, then a newline and `tracestate` when
    /// present), when it sent one.
    pub context: Option<String>,
    /// When the first frame of the transfer arrived (`None` for an empty grant).
    pub first_frame: Option<std::time::SystemTime>,
}

struct Grant {
    /// Destination block -> which (layer, piece)s have arrived, layer-major.
    blocks: HashMap<BlockId, Vec<bool>>,
    /// The sink's head ranges (empty: whole-block frames).
    pieces: Vec<Range<u32>>,
    remaining: usize,
    /// None: the grant holder watches progress itself and revokes the grant when it gives up.
    deadline: Option<Instant>,
    sink: Arc<dyn BlockSink>,
    frames: u64,
    bytes: u64,
    context: Option<String>,
    first_frame: Option<std::time::SystemTime>,
    done: Option<oneshot::Sender<Result<TransferStats, TransferError>>>,
}

impl Grant {
    fn finish(&mut self, r: Result<TransferStats, TransferError>) {
        if let Some(tx) = self.done.take() {
            let _ = tx.send(r);
        }
    }

    fn stats(&mut self) -> TransferStats {
        TransferStats {
            frames: self.frames,
            bytes: self.bytes,
            context: self.context.take(),
            first_frame: self.first_frame,
        }
    }

    fn heard(&mut self) {
        self.first_frame
            .get_or_insert_with(std::time::SystemTime::now);
    }
}

struct Inner {
    secret: Secret,
    shape: Option<KvShape>,
    /// The endpoint senders are told to dial (`host:port`): a handshake must name it.
    endpoint: Mutex<String>,
    grants: Mutex<HashMap<u64, Grant>>,
    rejections: Rejections,
    bytes: AtomicU64,
    /// Of those, the bytes that came on payload links.
    link_bytes: AtomicU64,
    /// The payload links senders offer, and the pairs joined.
    links: Mutex<ReceiverLinks>,
    /// Link offers answered, by answer (in [`LinkAnswer::ALL`]'s order).
    link_answers: [AtomicU64; 4],
}

/// Most payload links a receiver keeps (each an NCCL communicator holding device buffers); past
/// it, the one idle longest is dropped for a new one, or the offer declined when none is idle.
const MAX_LINKS: usize = 64;
/// How long an idle link is kept for its sender's next connection.
const IDLE_LINK_FOR: Duration = Duration::from_secs(600);
/// How often idle links past [`IDLE_LINK_FOR`] are dropped.
const LINK_SWEEP: Duration = Duration::from_secs(60);

/// A receiver's payload links: the fabric it joins senders' offers with (none: every offer is
/// declined), and every pair joined, by id: idle since when, or busy with a connection (None).
#[derive(Default)]
struct ReceiverLinks {
    fabric: Option<Arc<dyn LinkFabric>>,
    pairs: HashMap<[u8; LINK_ID], Option<(PairLink, Instant)>>,
}

impl ReceiverLinks {
    /// The answer to `offer`, and this side's end of the pair when it is taken.
    fn answer(&mut self, offer: &LinkOffer) -> (LinkAnswer, Option<PairLink>) {
        let Some(f) = self.fabric.clone().filter(|f| f.kind() == offer.kind) else {
            return (LinkAnswer::Never, None);
        };
        // Both ranks on one device (a prefill and a decode worker sharing a GPU): NCCL refuses
        // such a pair, so the connection keeps the payloads.
        if offer.device != [0; LINK_DEVICE] && offer.device == f.device() {
            return (LinkAnswer::Never, None);
        }
        self.sweep();
        if offer.reuse {
            return match self.pairs.get_mut(&offer.id) {
                None => (LinkAnswer::Declined, None),
                Some(None) => (LinkAnswer::Busy, None),
                Some(idle) => (LinkAnswer::Joined, idle.take().map(|(end, _)| end)),
            };
        }
        if self.pairs.contains_key(&offer.id) {
            return (LinkAnswer::Declined, None);
        }
        if self.pairs.len() >= MAX_LINKS {
            let longest_idle = self
                .pairs
                .iter()
                .filter_map(|(id, p)| p.as_ref().map(|(_, since)| (*since, *id)))
                .min();
            match longest_idle {
                Some((_, id)) => drop(self.pairs.remove(&id)),
                None => return (LinkAnswer::Declined, None),
            }
        }
        match f.join(offer.id, 1) {
            Ok(end) => {
                self.pairs.insert(offer.id, None);
                (LinkAnswer::Joined, Some(end))
            }
            Err(e) => {
                tracing::warn!(error = %e, link = offer.kind.name(), "kv payload link declined");
                (LinkAnswer::Declined, None)
            }
        }
    }

    /// Drops the pairs idle past [`IDLE_LINK_FOR`].
    fn sweep(&mut self) {
        let now = Instant::now();
        self.pairs.retain(|_, p| {
            p.as_ref()
                .is_none_or(|(_, since)| now.duration_since(*since) < IDLE_LINK_FOR)
        });
    }
}

/// A connection's hold on its payload link: idle again when the connection ends in step (every
/// payload whose header it read taken from the link), dropped and forgotten otherwise.
struct LinkLease {
    inner: Arc<Inner>,
    id: [u8; LINK_ID],
    end: Option<PairLink>,
    in_step: bool,
}

impl Drop for LinkLease {
    fn drop(&mut self) {
        let mut links = self.inner.links.lock().expect("links");
        match (self.end.take(), self.in_step) {
            (Some(end), true) => {
                links.pairs.insert(self.id, Some((end, Instant::now())));
            }
            _ => drop(links.pairs.remove(&self.id)),
        }
    }
}

impl Inner {
    /// Ends a transfer with an error (it stays unknown from then on).
    fn fail(&self, id: u64, e: TransferError) {
        if let Some(mut g) = self.grants.lock().expect("grants").remove(&id) {
            g.finish(Err(e));
        }
    }
}

/// A decode worker's KV endpoint.
#[derive(Clone)]
pub struct KvReceiver {
    inner: Arc<Inner>,
    addr: SocketAddr,
}

impl KvReceiver {
    /// Listens on `addr` (port 0 picks one) and serves connections until the runtime stops;
    /// senders learn nothing of its cache, and whole-block frames are what its sinks take.
    pub async fn bind(addr: &str, secret: Secret) -> Result<Self, TransferError> {
        Self::bind_with(addr, secret, None).await
    }

    /// [`KvReceiver::bind`] for a cache of `shape`: a sender whose cache does not map onto it
    /// is refused at the handshake with the reason, and senders learn the head ranges its
    /// ranks take.
    pub async fn bind_with(
        addr: &str,
        secret: Secret,
        shape: Option<KvShape>,
    ) -> Result<Self, TransferError> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let inner = Arc::new(Inner {
            secret,
            shape,
            endpoint: Mutex::new(local.to_string()),
            grants: Mutex::new(HashMap::new()),
            rejections: Rejections::default(),
            bytes: AtomicU64::new(0),
            link_bytes: AtomicU64::new(0),
            links: Mutex::default(),
            link_answers: Default::default(),
        });
        // Idle links are dropped once past their time even where no offer comes to do it.
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(LINK_SWEEP).await;
                let Some(inner) = weak.upgrade() else { return };
                inner.links.lock().expect("links").sweep();
            }
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            loop {
                let Ok((sock, peer)) = listener.accept().await else {
                    continue;
                };
                let Some(inner) = weak.upgrade() else { return };
                tokio::spawn(async move {
                    if let Err(e) = serve_connection(&inner, sock).await {
                        tracing::debug!(%peer, error = %e, "kv connection closed");
                    }
                });
            }
        });
        Ok(Self { inner, addr: local })
    }

    /// The address senders connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets the endpoint this receiver's grants are advertised at (`host:port`; the bound
    /// address until set): a sender's handshake must name it, so one relayed through another
    /// address is refused.
    pub fn advertise(&self, endpoint: impl Into<String>) {
        *self.inner.endpoint.lock().expect("endpoint") = endpoint.into();
    }

    /// Joins the payload links senders offer that `fabric` can make (the same kind): their
    /// block payloads then come on the link, their headers over the connection. Without one,
    /// every offer is declined.
    pub fn join_links(&self, fabric: Arc<dyn LinkFabric>) {
        self.inner.links.lock().expect("links").fabric = Some(fabric);
    }

    /// Payload links joined and idle, kept for their senders' next connections.
    pub fn idle_links(&self) -> usize {
        let links = self.inner.links.lock().expect("links");
        links.pairs.values().filter(|p| p.is_some()).count()
    }

    /// Link offers answered since start, by answer.
    pub fn link_answers(&self) -> Vec<(LinkAnswer, u64)> {
        LinkAnswer::ALL
            .iter()
            .map(|&a| {
                (
                    a,
                    self.inner.link_answers[a as usize].load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    /// Payload links held by a connection now.
    pub fn busy_links(&self) -> usize {
        let links = self.inner.links.lock().expect("links");
        links.pairs.values().filter(|p| p.is_none()).count()
    }

    /// The endpoint senders must name in their handshake.
    pub fn endpoint(&self) -> String {
        self.inner.endpoint.lock().expect("endpoint").clone()
    }

    /// What this receiver has refused so far, by reason.
    pub fn rejections(&self) -> &Rejections {
        &self.inner.rejections
    }

    /// Payload bytes written into granted blocks so far.
    pub fn bytes_received(&self) -> u64 {
        self.inner.bytes.load(Ordering::Relaxed)
    }

    /// Of [`Self::bytes_received`], the bytes that came on payload links.
    pub fn link_bytes_received(&self) -> u64 {
        self.inner.link_bytes.load(Ordering::Relaxed)
    }

    /// Grants not yet completed, failed or revoked.
    pub fn open_grants(&self) -> usize {
        self.inner.grants.lock().expect("grants").len()
    }

    /// Grants `blocks` (every layer of each) to a new transfer that must complete within
    /// `deadline`. The transfer id is random: with the connection authenticated, knowing it is
    /// what entitles a sender to these blocks.
    pub fn grant(
        &self,
        blocks: &[BlockId],
        sink: Arc<dyn BlockSink>,
        deadline: Duration,
    ) -> TransferGrant {
        self.grant_until(blocks, sink, Some(Instant::now() + deadline))
    }

    /// Grants `blocks` to a new transfer with no deadline of its own: the holder follows the
    /// sender's progress ([`TransferGrant::frames_received`]) and drops the grant when it stops.
    pub fn grant_open(&self, blocks: &[BlockId], sink: Arc<dyn BlockSink>) -> TransferGrant {
        self.grant_until(blocks, sink, None)
    }

    fn grant_until(
        &self,
        blocks: &[BlockId],
        sink: Arc<dyn BlockSink>,
        deadline: Option<Instant>,
    ) -> TransferGrant {
        let layers = sink.layers() as usize;
        let pieces = sink.pieces();
        let per_block = layers * pieces.len().max(1);
        let (tx, rx) = oneshot::channel();
        let sink_kept = sink.clone();
        let mut map = HashMap::new();
        for &b in blocks {
            map.insert(b, vec![false; per_block]);
        }
        let remaining = map.len() * per_block;
        let mut grants = self.inner.grants.lock().expect("grants");
        let id = loop {
            let id = rand::rngs::OsRng.next_u64();
            if id != 0 && !grants.contains_key(&id) {
                break id;
            }
        };
        let mut g = Grant {
            blocks: map,
            pieces,
            remaining,
            deadline,
            sink,
            frames: 0,
            bytes: 0,
            context: None,
            first_frame: None,
            done: Some(tx),
        };
        if remaining == 0 {
            let stats = g.stats();
            g.finish(Ok(stats));
        }
        grants.insert(id, g);
        TransferGrant {
            id,
            deadline,
            rx: Some(rx),
            inner: self.inner.clone(),
            sink: sink_kept,
            blocks: blocks.to_vec(),
            settled: false,
        }
    }
}

/// Blocks granted to one transfer; dropping it revokes the grant.
pub struct TransferGrant {
    id: u64,
    deadline: Option<Instant>,
    rx: Option<oneshot::Receiver<Result<TransferStats, TransferError>>>,
    inner: Arc<Inner>,
    /// The grant's sink and blocks, settled when the transfer completes, or when the grant is
    /// dropped before.
    sink: Arc<dyn BlockSink>,
    blocks: Vec<BlockId>,
    settled: bool,
}

impl TransferGrant {
    /// The transfer id a sender names in every frame of this transfer.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Frames written into this grant's blocks so far (0 once the transfer ended).
    pub fn frames_received(&self) -> u64 {
        let grants = self.inner.grants.lock().expect("grants");
        grants.get(&self.id).map_or(0, |g| g.frames)
    }

    /// Resolves when every granted block has arrived intact, or with the reason it never will.
    pub async fn wait(&mut self) -> Result<TransferStats, TransferError> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(TransferError::Closed);
        };
        let r = match self.deadline {
            Some(at) => match tokio::time::timeout_at(at, rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(TransferError::Closed),
                Err(_) => Err(TransferError::Expired),
            },
            None => rx.await.unwrap_or(Err(TransferError::Closed)),
        };
        self.rx = None;
        self.inner.grants.lock().expect("grants").remove(&self.id);
        // Complete once the sink holds it all, not when the last frame was handed to it.
        let settled = self.sink.settle(&self.blocks).map_err(TransferError::Sink);
        self.settled = true;
        r.and_then(|stats| settled.map(|()| stats))
    }
}

impl Drop for TransferGrant {
    fn drop(&mut self) {
        // No frame reaches the sink for this grant once it is gone from the map; the copies
        // already handed to it finish before the blocks go back to their owner.
        self.inner.grants.lock().expect("grants").remove(&self.id);
        if !self.settled {
            if let Err(e) = self.sink.settle(&self.blocks) {
                tracing::warn!(transfer = self.id, error = %e, "KV copies into revoked blocks failed");
            }
        }
    }
}

/// What a block frame is, judged against the grants (under the lock, before any write).
enum Verdict {
    /// Write it as this piece of the block layer.
    Write(usize),
    Reject(&'static str, Option<TransferError>),
}

fn judge(
    r: &Rejections,
    grants: &HashMap<u64, Grant>,
    h: &FrameHeader,
    payload: &[u8],
    conv: Option<(Float, Float)>,
) -> Verdict {
    let Some(g) = grants.get(&h.transfer) else {
        r.unknown_transfer.fetch_add(1, Ordering::Relaxed);
        return Verdict::Reject("unknown transfer", None);
    };
    if g.deadline.is_some_and(|d| Instant::now() > d) {
        r.expired.fetch_add(1, Ordering::Relaxed);
        return Verdict::Reject("expired", Some(TransferError::Expired));
    }
    if h.layer >= g.sink.layers() {
        r.bad_layer.fetch_add(1, Ordering::Relaxed);
        return Verdict::Reject("bad layer", Some(TransferError::Rejected("bad_layer")));
    }
    if !g.blocks.contains_key(&BlockId(h.block)) {
        r.block_not_granted.fetch_add(1, Ordering::Relaxed);
        return Verdict::Reject(
            "block not granted",
            Some(TransferError::Rejected("block_not_granted")),
        );
    }
    let heads = h.head_start as u32..h.head_start as u32 + h.head_count as u32;
    let piece = match (g.pieces.is_empty(), h.head_count) {
        (true, 0) => Some(0),
        (true, _) => None,
        // A sink of one range takes whole-block frames as that range.
        (false, 0) if g.pieces.len() == 1 => Some(0),
        (false, _) => g.pieces.iter().position(|p| *p == heads),
    };
    let Some(piece) = piece else {
        r.bad_heads.fetch_add(1, Ordering::Relaxed);
        return Verdict::Reject("bad heads", Some(TransferError::Rejected("bad_heads")));
    };
    let want = wire_len(
        match g.pieces.is_empty() {
            true => g.sink.frame_len(),
            false => g.sink.piece_len(piece),
        },
        conv,
    );
    if payload.len() != want {
        r.bad_length.fetch_add(1, Ordering::Relaxed);
        return Verdict::Reject("bad length", Some(TransferError::Rejected("bad_length")));
    }
    if checksum(payload) != h.checksum {
        r.bad_checksum.fetch_add(1, Ordering::Relaxed);
        return Verdict::Reject(
            "bad checksum",
            Some(TransferError::Rejected("bad_checksum")),
        );
    }
    Verdict::Write(piece)
}

/// Bytes read from the socket but not yet consumed. Frames are judged, checksummed and copied
/// into the pool from this buffer in place: one copy out of the kernel, one into the pool.
struct FrameReader {
    sock: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The receiver and the transfer the connection is bound to: a read waits as long as its
    /// grant lives (its holder judges the sender's progress), and the connection closes once
    /// the grant is gone.
    inner: Arc<Inner>,
    transfer: u64,
}

/// How often a waiting read looks whether its connection's grant still lives.
const LIVENESS_CHECK: Duration = Duration::from_millis(500);

/// Receive buffer per connection: several frames per read call.
const RECV_BUFFER: usize = 1 << 20;

impl FrameReader {
    fn new(sock: TcpStream, inner: Arc<Inner>, transfer: u64) -> Self {
        Self {
            sock,
            buf: vec![0; RECV_BUFFER],
            start: 0,
            end: 0,
            inner,
            transfer,
        }
    }

    /// One read into `buf[from..to]`; an error once the connection's grant is gone.
    async fn read_at(&mut self, from: usize, to: usize) -> std::io::Result<usize> {
        loop {
            match tokio::time::timeout(LIVENESS_CHECK, self.sock.read(&mut self.buf[from..to]))
                .await
            {
                Ok(r) => return r,
                Err(_) => {
                    let live = self
                        .inner
                        .grants
                        .lock()
                        .expect("grants")
                        .contains_key(&self.transfer);
                    if !live {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the connection's transfer ended: closing it",
                        ));
                    }
                }
            }
        }
    }

    /// Makes `need` bytes available at the read position. `Ok(false)`: the peer closed the
    /// connection cleanly, between frames (`at_boundary`) and with nothing pending.
    async fn fill(&mut self, need: usize, at_boundary: bool) -> std::io::Result<bool> {
        if self.end - self.start >= need {
            return Ok(true);
        }
        if self.start + need > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if need > self.buf.len() {
                self.buf.resize(need, 0);
            }
        }
        while self.end - self.start < need {
            let n = self.read_at(self.end, self.buf.len()).await?;
            if n == 0 {
                if at_boundary && self.end == self.start {
                    return Ok(false);
                }
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.end += n;
        }
        Ok(true)
    }

    /// Reads past the next `n` bytes without keeping them: a frame refused by its header alone
    /// is passed over in the buffer the connection already has, so a header announcing a huge
    /// payload makes the receiver allocate nothing.
    async fn skip(&mut self, mut n: usize) -> std::io::Result<()> {
        let pending = (self.end - self.start).min(n);
        self.start += pending;
        n -= pending;
        while n > 0 {
            // Everything pending was consumed: read into the whole buffer and drop it.
            self.start = 0;
            self.end = 0;
            let room = self.buf.len().min(n);
            let got = self.read_at(0, room).await?;
            if got == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            n -= got;
        }
        Ok(())
    }

    /// The next `n` bytes (made available by [`Self::fill`]), consumed.
    fn take(&mut self, n: usize) -> &[u8] {
        let at = self.start;
        self.start += n;
        &self.buf[at..at + n]
    }
}

/// Takes a link payload of `len` bytes for the connection bound to `bound`, failing that
/// transfer when it does not come. As a read of the connection does, it waits as long as the
/// transfer's grant lives: once the grant is gone (a sender that stopped mid-frame, whose
/// attempt its decode worker gave up) the connection closes, its link given up, instead of
/// waiting out the link's watchdog.
async fn from_link(
    inner: &Inner,
    bound: u64,
    end: &PairLink,
    len: usize,
) -> Result<Vec<u8>, TransferError> {
    let recv = end.recv(len);
    tokio::pin!(recv);
    loop {
        match tokio::time::timeout(LIVENESS_CHECK, &mut recv).await {
            Ok(r) => {
                return r.inspect_err(|e| {
                    inner.rejections.link_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(transfer = bound, error = %e, "kv payload link failed: closing");
                    inner.fail(bound, TransferError::Rejected("link_failed"));
                })
            }
            Err(_) if !inner.grants.lock().expect("grants").contains_key(&bound) => {
                return Err(TransferError::Link(
                    "the connection's transfer ended while a payload was awaited on the link: closing it"
                        .into(),
                ))
            }
            Err(_) => {}
        }
    }
}

async fn serve_connection(inner: &Arc<Inner>, mut sock: TcpStream) -> Result<(), TransferError> {
    sock.set_nodelay(true)?;
    // Admitted only for a live grant, at the endpoint this receiver advertises.
    let admit = |transfer: u64, endpoint: &str| {
        let mine = inner.endpoint.lock().expect("endpoint").clone();
        if endpoint != mine {
            return Err(format!(
                "this receiver is advertised at {mine}, not {endpoint}"
            ));
        }
        match inner.grants.lock().expect("grants").contains_key(&transfer) {
            true => Ok(()),
            false => Err(format!(
                "no live grant {transfer:#x} here (never granted, ended or revoked)"
            )),
        }
    };
    // A sender's offered link: joined, or taken idle, where this receiver has a fabric of its
    // kind; the connection holds it until it ends.
    let mut lease: Option<LinkLease> = None;
    let join = async |offer: &LinkOffer| {
        let give_up = Instant::now() + BUSY_WAIT;
        let (answer, end) = loop {
            let (answer, end) = inner.links.lock().expect("links").answer(offer);
            // A pair offered again the moment its sender's transfer ended: the connection
            // before is reading its last frames and gives the pair back at once.
            if answer != LinkAnswer::Busy || Instant::now() >= give_up {
                break (answer, end);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        inner.link_answers[answer as usize].fetch_add(1, Ordering::Relaxed);
        if let Some(end) = end {
            lease = Some(LinkLease {
                inner: inner.clone(),
                id: offer.id,
                end: Some(end),
                in_step: false,
            });
        }
        answer
    };
    let handshake = tokio::time::timeout(
        Duration::from_secs(5),
        auth::accept_linked(&mut sock, &inner.secret, inner.shape.as_ref(), admit, join),
    )
    .await;
    let session = match handshake {
        Ok(Ok(session)) => session,
        Ok(Err(e @ TransferError::Mismatch(_))) => {
            inner.rejections.mismatched.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "kv sender refused");
            return Err(e);
        }
        Ok(Err(e @ TransferError::NotGranted(_))) => {
            inner.rejections.not_granted.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "kv sender refused");
            return Err(e);
        }
        Ok(Err(e)) => {
            inner
                .rejections
                .unauthenticated
                .fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        Err(_) => {
            inner
                .rejections
                .unauthenticated
                .fetch_add(1, Ordering::Relaxed);
            return Err(TransferError::Handshake("handshake timed out".into()));
        }
    };
    let bound = session.transfer();
    // A sender whose cache stores another float type: its frames' values are converted to
    // this cache's type before they are written (the checksum covers them as sent).
    let conv = inner
        .shape
        .as_ref()
        .zip(session.peer())
        .and_then(|(mine, peer)| mine.conversion_from(peer));
    let mut converted = Vec::new();
    let mut r = FrameReader::new(sock, inner.clone(), bound);
    let mut seq = 0u64;
    let mut ended_told = false;
    loop {
        if !r.fill(HEADER_LEN, true).await? {
            // Ended between frames: every payload its headers announced was taken from the
            // link, which can serve the sender's next connection.
            if let Some(lease) = lease.as_mut() {
                lease.in_step = true;
            }
            return Ok(());
        }
        let conn_link = lease.as_ref().and_then(|l| l.end.as_ref());
        let hb: &[u8; HEADER_LEN] = r.take(HEADER_LEN).try_into().expect("header length");
        // The tag first: a header not sealed with this session's key as its frame number is
        // not the sender's, and nothing after it can be trusted.
        if !session.verify(seq, hb) {
            inner.rejections.bad_tag.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                transfer = bound,
                frame = seq,
                "kv frame tag does not match: closing"
            );
            inner.fail(bound, TransferError::Rejected("bad_tag"));
            return Err(TransferError::Rejected("bad_tag"));
        }
        seq += 1;
        let h = match FrameHeader::decode(hb) {
            Ok(h) => h,
            Err(e) => {
                // Out of sync: nothing after this can be trusted.
                inner.rejections.malformed.fetch_add(1, Ordering::Relaxed);
                return Err(TransferError::Wire(e));
            }
        };
        // A payload on the link: only a block frame's, only on a connection that joined one.
        let link = match (h.on_link, conn_link) {
            (false, _) => None,
            (true, Some(end)) if h.kind == FrameKind::Block => Some(end),
            (true, _) => {
                inner.rejections.link_failed.fetch_add(1, Ordering::Relaxed);
                let e = TransferError::Link(format!(
                    "a {:?} frame names a payload link this connection does not have",
                    h.kind
                ));
                tracing::warn!(transfer = bound, error = %e, "kv frame refused: closing");
                inner.fail(bound, TransferError::Rejected("link_failed"));
                return Err(e);
            }
        };

        if h.transfer != bound {
            // Sealed by the sender, but for another transfer than the one it was admitted for:
            // counted and passed over.
            inner
                .rejections
                .unknown_transfer
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                transfer = h.transfer,
                bound,
                "kv frame for another transfer than its connection's: passed over"
            );
            match link {
                Some(end) => drop(from_link(inner, bound, end, h.len as usize).await?),
                None => r.skip(h.len as usize).await?,
            }
            continue;
        }
        // The longest payload this header may announce, judged before a byte of it is read:
        // a block frame is one layer of one block (or of one rank's heads) of a live grant,
        // a trace context at most MAX_CONTEXT, an end or abort nothing.
        let most = match h.kind {
            FrameKind::Block => {
                let grants = inner.grants.lock().expect("grants");
                grants
                    .get(&h.transfer)
                    .map_or(0, |g| match g.pieces.is_empty() {
                        true => wire_len(g.sink.frame_len(), conv),
                        false => (0..g.pieces.len())
                            .map(|p| wire_len(g.sink.piece_len(p), conv))
                            .max()
                            .unwrap_or(0),
                    })
            }
            FrameKind::Context => MAX_CONTEXT,
            FrameKind::End | FrameKind::Abort => 0,
        };
        if h.len as usize > most {
            let known = inner
                .grants
                .lock()
                .expect("grants")
                .contains_key(&h.transfer);
            let counter = match known {
                true => &inner.rejections.bad_length,
                false => &inner.rejections.unknown_transfer,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if known {
                tracing::warn!(
                    transfer = h.transfer,
                    len = h.len,
                    most,
                    "kv frame longer than its transfer allows: passed over unread"
                );
                inner.fail(h.transfer, TransferError::Rejected("bad_length"));
            } else if !ended_told {
                // A failed or revoked transfer's sender goes on until it hears: its frames are
                // counted one by one, and told of once.
                ended_told = true;
                tracing::warn!(
                    transfer = h.transfer,
                    "kv frames after their transfer ended (failed or revoked): passing them over"
                );
            }
            // A link payload is taken and dropped (the length is at most MAX_PAYLOAD, and the
            // header is the authenticated sender's), so the link stays in step with the headers.
            match link {
                Some(end) => drop(from_link(inner, bound, end, h.len as usize).await?),
                None => r.skip(h.len as usize).await?,
            }
            continue;
        }
        let linked;
        let payload: &[u8] = match link {
            Some(end) => {
                linked = from_link(inner, bound, end, h.len as usize).await?;
                &linked
            }
            None => {
                r.fill(h.len as usize, false).await?;
                r.take(h.len as usize)
            }
        };
        match h.kind {
            FrameKind::Block => {
                // The write happens under the lock: a grant revoked (and its blocks freed by the
                // engine) can never see a late write.
                let mut grants = inner.grants.lock().expect("grants");
                match judge(&inner.rejections, &grants, &h, payload, conv) {
                    Verdict::Write(piece) => {
                        let g = grants.get_mut(&h.transfer).expect("judged");
                        let values = match conv {
                            None => payload,
                            Some((from, to)) => {
                                convert_values(from, payload, to, &mut converted);
                                &converted
                            }
                        };
                        match g.pieces.is_empty() {
                            true => g.sink.write(h.layer, BlockId(h.block), values),
                            false => g.sink.write_piece(h.layer, BlockId(h.block), piece, values),
                        }
                        inner
                            .bytes
                            .fetch_add(payload.len() as u64, Ordering::Relaxed);
                        if h.on_link {
                            inner
                                .link_bytes
                                .fetch_add(payload.len() as u64, Ordering::Relaxed);
                        }
                        g.heard();
                        g.frames += 1;
                        g.bytes += payload.len() as u64;
                        let at = h.layer as usize * g.pieces.len().max(1) + piece;
                        let seen = &mut g.blocks.get_mut(&BlockId(h.block)).expect("judged")[at];
                        if !*seen {
                            *seen = true;
                            g.remaining -= 1;
                            if g.remaining == 0 {
                                let stats = g.stats();
                                g.finish(Ok(stats));
                            }
                        }
                    }
                    Verdict::Reject(why, fail) => {
                        drop(grants);
                        tracing::warn!(
                            transfer = h.transfer,
                            layer = h.layer,
                            block = h.block,
                            why,
                            "kv frame rejected"
                        );
                        if let Some(e) = fail {
                            inner.fail(h.transfer, e);
                        }
                    }
                }
            }
            FrameKind::End => {
                let mut grants = inner.grants.lock().expect("grants");
                if let Some(g) = grants.get_mut(&h.transfer) {
                    if g.remaining > 0 {
                        let missing = g.remaining;
                        drop(grants);
                        inner.fail(h.transfer, TransferError::Incomplete { missing });
                    }
                }
            }
            FrameKind::Abort => inner.fail(h.transfer, TransferError::Aborted),
            FrameKind::Context => {
                let mut grants = inner.grants.lock().expect("grants");
                let Some(g) = grants.get_mut(&h.transfer) else {
                    inner
                        .rejections
                        .unknown_transfer
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let why = if payload.len() > MAX_CONTEXT {
                    inner.rejections.bad_length.fetch_add(1, Ordering::Relaxed);
                    Some("bad_length")
                } else if checksum(payload) != h.checksum {
                    inner
                        .rejections
                        .bad_checksum
                        .fetch_add(1, Ordering::Relaxed);
                    Some("bad_checksum")
                } else {
                    None
                };
                match why {
                    Some(why) => {
                        drop(grants);
                        tracing::warn!(transfer = h.transfer, why, "kv context frame rejected");
                        inner.fail(h.transfer, TransferError::Rejected(why));
                    }
                    None => {
                        g.heard();
                        // Text that is not UTF-8 is no trace context: the transfer goes on untraced.
                        g.context = std::str::from_utf8(payload).ok().map(str::to_string);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::{LinkKind, ThreadFabric};

    fn offer(fabric: &ThreadFabric, reuse: bool, id: [u8; LINK_ID]) -> LinkOffer {
        LinkOffer {
            kind: fabric.kind(),
            id,
            device: [0; LINK_DEVICE],
            reuse,
        }
    }

    /// A receiver's links: a new pair is joined and busy; offered again it is busy until its
    /// connection gives it back in step, then taken; one given back out of step is gone (offered
    /// again: declined); an offer from its own device, of another kind or with no fabric is
    /// declined; past the bound the longest idle is dropped, and with every pair busy a new one
    /// is declined.
    #[tokio::test]
    async fn links_are_joined_kept_idle_taken_again_and_bounded() {
        let inner = Arc::new(Inner {
            secret: Secret::random(),
            shape: None,
            endpoint: Mutex::new(String::new()),
            grants: Mutex::default(),
            rejections: Rejections::default(),
            bytes: AtomicU64::new(0),
            link_bytes: AtomicU64::new(0),
            links: Mutex::default(),
            link_answers: Default::default(),
        });
        let fabric = ThreadFabric::new(Duration::from_secs(30));
        let answer = |o: &LinkOffer| inner.links.lock().unwrap().answer(o);
        let lease = |id, end| LinkLease {
            inner: inner.clone(),
            id,
            end,
            in_step: false,
        };
        let id = fabric.offer().unwrap();
        assert_eq!(
            answer(&offer(&fabric, false, id)).0,
            LinkAnswer::Never,
            "no fabric"
        );
        inner.links.lock().unwrap().fabric = Some(fabric.clone());

        let (a, end) = answer(&offer(&fabric, false, id));
        assert_eq!((a, end.is_some()), (LinkAnswer::Joined, true));
        assert_eq!(answer(&offer(&fabric, true, id)).0, LinkAnswer::Busy);
        assert_eq!(
            answer(&offer(&fabric, false, id)).0,
            LinkAnswer::Declined,
            "joined already"
        );
        let mut held = lease(id, end);
        held.in_step = true;
        drop(held);
        let (a, end) = answer(&offer(&fabric, true, id));
        assert_eq!((a, end.is_some()), (LinkAnswer::Joined, true));
        drop(lease(id, end));
        assert_eq!(
            answer(&offer(&fabric, true, id)).0,
            LinkAnswer::Declined,
            "given back out of step"
        );

        let own = ThreadFabric::on_device(Duration::from_secs(30), [9; LINK_DEVICE]);
        inner.links.lock().unwrap().fabric = Some(own.clone());
        let mine = LinkOffer {
            device: [9; LINK_DEVICE],
            ..offer(&own, false, own.offer().unwrap())
        };
        assert_eq!(answer(&mine).0, LinkAnswer::Never, "its own device");
        let nccl = LinkOffer {
            kind: LinkKind::Nccl,
            ..offer(&own, false, [1; LINK_ID])
        };
        assert_eq!(answer(&nccl).0, LinkAnswer::Never, "another kind");

        inner.links.lock().unwrap().fabric = Some(fabric.clone());
        let mut leases = Vec::new();
        for _ in 0..MAX_LINKS {
            let id = fabric.offer().unwrap();
            let (a, end) = answer(&offer(&fabric, false, id));
            assert_eq!(a, LinkAnswer::Joined);
            leases.push(lease(id, end));
        }
        let extra = fabric.offer().unwrap();
        assert_eq!(
            answer(&offer(&fabric, false, extra)).0,
            LinkAnswer::Declined,
            "all busy"
        );
        let first = leases[0].id;
        for l in &mut leases {
            l.in_step = true;
        }
        drop(leases);
        // The first made the longest idle, whatever the clock's resolution.
        if let Some(Some((_, since))) = inner.links.lock().unwrap().pairs.get_mut(&first) {
            *since = since.checked_sub(Duration::from_secs(1)).unwrap_or(*since);
        }
        assert_eq!(inner.links.lock().unwrap().pairs.len(), MAX_LINKS);
        assert_eq!(
            answer(&offer(&fabric, false, extra)).0,
            LinkAnswer::Joined,
            "one idle dropped"
        );
        assert_eq!(inner.links.lock().unwrap().pairs.len(), MAX_LINKS);
        assert_eq!(
            answer(&offer(&fabric, true, first)).0,
            LinkAnswer::Declined,
            "the longest idle went"
        );
    }
}
