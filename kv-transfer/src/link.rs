//! A payload link: a second channel beside a KV connection, between the sender's and the
//! receiver's ranks of a two-rank collective group, that block payloads can travel on while
//! their sealed headers go over the authenticated TCP connection (NCCL send/recv between two
//! GPUs, where the link is faster than the host's network).
//!
//! A [`LinkFabric`] is what a worker can make links with: it makes a pair's id on the sender
//! ([`LinkFabric::offer`]), and each side joins the pair by that id as its rank, 0 the sender and
//! 1 the receiver ([`LinkFabric::join`]). The id crosses the wire inside the KV handshake, under
//! both sides' MACs. Two fabrics:
//! - [`NcclFabric`]: an NCCL communicator of two ranks on the worker's GPU; payloads are staged
//!   through a device buffer (the collective's host-buffer send/recv), so their xxh3 digest is
//!   taken on the staged host copy on both sides, as over TCP;
//! - [`ThreadFabric`]: two ranks of a [`ThreadGroup`] in one process, the fabric the tests of the
//!   link's logic run on where no second GPU is (one card cannot hold two NCCL ranks).
//!
//! A rank is not `Send` (an NCCL communicator stays on the thread that made it): each end of a
//! link is a thread of its own that builds its rank there and serves the end's sends and
//! receives in order, and [`PairLink`] is the handle to it. Building an NCCL rank waits for the
//! peer's (NCCL's initialisation is collective), so `join` returns at once and a rank that could
//! not be built fails the end's first operation. Each operation, the rank's building included,
//! is bounded: one not answered within twice the fabric's watchdog fails, and the end with it
//! (a rank whose peer never joins leaves its thread waiting in NCCL's initialisation, which has
//! no watchdog of its own; its sender then gives links to that receiver up for a while).
//! Messages keep their boundaries: a receive names the length the matching send sent (the frame header's), and a receive of another length fails.

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rand::RngCore;
use tandem_collective::{Collective, NcclId, NcclRank, ThreadGroup, ThreadRank};
use tokio::sync::oneshot;

use crate::TransferError;

/// Bytes of a pair's id (an NCCL unique id's size).
pub const LINK_ID: usize = 128;
/// Bytes of a fabric's device identity (a CUDA device UUID's size); all zeros: no device.
pub const LINK_DEVICE: usize = 16;

/// The kind of a fabric, as the handshake names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum LinkKind {
    /// NCCL between two GPUs.
    Nccl = 1,
    /// Two thread ranks of one process.
    Threads = 2,
}

impl LinkKind {
    /// The kind a handshake byte names, if any.
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Nccl),
            2 => Some(Self::Threads),
            _ => None,
        }
    }

    /// Its name, for logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nccl => "nccl",
            Self::Threads => "threads",
        }
    }
}

/// How long a receiver offered a pair still busy with the connection before waits for that
/// connection to give it back (the sender's previous transfer just ended, so its end is read at
/// once) before it answers busy; a sender offering a pair again allows its handshake this long
/// more.
pub const BUSY_WAIT: Duration = Duration::from_secs(1);

/// A sender's offer of a payload link, as its handshake carries it (under its MAC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkOffer {
    /// The sender's fabric.
    pub kind: LinkKind,
    /// The pair's id, made by the sender's fabric.
    pub id: [u8; LINK_ID],
    /// The device the sender's rank runs on (zeros: none).
    pub device: [u8; LINK_DEVICE],
    /// The pair is one both sides joined on an earlier connection, offered again: the receiver
    /// takes its idle end of it instead of joining a new pair (an NCCL communicator is made once
    /// per pair of ranks, not once per transfer).
    pub reuse: bool,
}

/// A receiver's answer to a link offer (under its MAC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum LinkAnswer {
    /// Not taken: this connection carries every payload; a reused pair is gone on the receiver
    /// (the sender drops its end too).
    Declined = 0,
    /// Joined (or, for a reuse, taken): payloads come on the link.
    Joined = 1,
    /// A reused pair still busy on the receiver with the connection before (it has not read
    /// that connection's end yet): this connection carries every payload, and the sender keeps
    /// its end for the next.
    Busy = 2,
    /// Never taken from this sender: the receiver has no fabric of the offer's kind, or its
    /// fabric is on the offer's device. The sender offers that receiver no more links.
    Never = 3,
}

impl LinkAnswer {
    /// Every answer, in the order of their values.
    pub const ALL: [LinkAnswer; 4] = [Self::Declined, Self::Joined, Self::Busy, Self::Never];

    /// Its name, for metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::Declined => "declined",
            Self::Joined => "joined",
            Self::Busy => "busy",
            Self::Never => "never",
        }
    }
}

/// What a worker makes payload links with.
pub trait LinkFabric: Send + Sync {
    /// Its kind: a peer offering another kind's link is declined (the connection stays TCP).
    fn kind(&self) -> LinkKind;
    /// The device its ranks run on (a GPU's UUID; zeros: none). A peer offering a link from
    /// the same device is declined: one device cannot hold both ranks of a pair (NCCL refuses
    /// it), as when a prefill and a decode worker share a card.
    fn device(&self) -> [u8; LINK_DEVICE] {
        [0; LINK_DEVICE]
    }
    /// A new pair's id, made by the sender.
    fn offer(&self) -> Result<[u8; LINK_ID], TransferError>;
    /// This side's end of the pair `id` names, as `rank` (0: the sender, 1: the receiver).
    fn join(&self, id: [u8; LINK_ID], rank: usize) -> Result<PairLink, TransferError>;
    /// Gives up an offered pair that will not be joined (the receiver declined it, the
    /// handshake failed).
    fn withdraw(&self, id: [u8; LINK_ID]) {
        let _ = id;
    }
}

fn link_error(e: impl std::fmt::Display) -> TransferError {
    TransferError::Link(e.to_string())
}

/// One operation for an end's thread, with where its answer goes.
enum Op {
    Send(Vec<u8>, oneshot::Sender<Result<(), TransferError>>),
    Recv(usize, oneshot::Sender<Result<Vec<u8>, TransferError>>),
}

/// One end of a payload link: a thread holding a rank of a two-rank group, serving this end's
/// sends and receives in the order they are asked for. The thread ends when the handle is dropped.
pub struct PairLink {
    ops: mpsc::Sender<Op>,
    kind: LinkKind,
    /// How long an operation may take, from being asked to being answered.
    bound: Duration,
    /// Why the end is given up, once an operation overran its bound.
    broken: Mutex<Option<String>>,
}

impl std::fmt::Debug for PairLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PairLink")
            .field("kind", &self.kind)
            .finish()
    }
}

/// Bytes as the collective carries them: f32 words (bit copies, never arithmetic), the last one
/// padded with zeros.
fn to_words(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_ne_bytes(w)
        })
        .collect()
}

fn from_words(words: &[f32], len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    out.truncate(len);
    out
}

impl PairLink {
    /// An end whose rank `make` builds on the end's own thread; its peer is the group's other
    /// rank. An operation (the first one's wait for the rank included) not answered within
    /// twice `watchdog` fails, and every later one with it.
    pub fn start<C, F>(kind: LinkKind, watchdog: Duration, make: F) -> Result<Self, TransferError>
    where
        C: Collective,
        F: FnOnce() -> Result<C, tandem_collective::CollectiveError> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel::<Op>();
        std::thread::Builder::new()
            .name(format!("tandem-kv-link-{}", kind.name()))
            .spawn(move || serve(make, rx))
            .map_err(link_error)?;
        Ok(Self {
            ops: tx,
            kind,
            bound: watchdog.saturating_mul(2),
            broken: Mutex::default(),
        })
    }

    /// Waits for an operation's answer within the bound, giving the end up when it overruns.
    async fn answer<T>(
        &self,
        what: &str,
        rx: oneshot::Receiver<Result<T, TransferError>>,
    ) -> Result<T, TransferError> {
        match tokio::time::timeout(self.bound, rx).await {
            Ok(r) => r.map_err(|_| gone())?,
            Err(_) => {
                let why = format!(
                    "a {what} on the link was not answered within {} ms (its rank never built, or its peer never came)",
                    self.bound.as_millis()
                );
                *self.broken.lock().expect("broken") = Some(why.clone());
                Err(TransferError::Link(why))
            }
        }
    }

    fn check(&self) -> Result<(), TransferError> {
        match self.broken.lock().expect("broken").clone() {
            Some(why) => Err(TransferError::Link(why)),
            None => Ok(()),
        }
    }

    /// The fabric it was made by.
    pub fn kind(&self) -> LinkKind {
        self.kind
    }

    /// Sends `bytes` to the peer, which receives them with a [`PairLink::recv`] of their length.
    pub async fn send(&self, bytes: Vec<u8>) -> Result<(), TransferError> {
        self.check()?;
        let (tx, rx) = oneshot::channel();
        self.ops.send(Op::Send(bytes, tx)).map_err(|_| gone())?;
        self.answer("send", rx).await
    }

    /// Receives the peer's next message, which must be `len` bytes long.
    pub async fn recv(&self, len: usize) -> Result<Vec<u8>, TransferError> {
        self.check()?;
        let (tx, rx) = oneshot::channel();
        self.ops.send(Op::Recv(len, tx)).map_err(|_| gone())?;
        self.answer("receive", rx).await
    }
}

fn gone() -> TransferError {
    TransferError::Link("the link's thread is gone (its rank failed)".into())
}

/// An end's thread: builds the rank, then serves operations until the handle is dropped. After a
/// failure every later operation fails with it (the group is given up: the ranks no longer agree
/// where they are).
fn serve<C: Collective>(
    make: impl FnOnce() -> Result<C, tandem_collective::CollectiveError>,
    ops: mpsc::Receiver<Op>,
) {
    let mut rank = make().map_err(|e| format!("joining the link: {e}"));
    let mut failed: Option<String> = None;
    while let Ok(op) = ops.recv() {
        if let Some(why) = failed.clone().or_else(|| rank.as_ref().err().cloned()) {
            refuse(op, why);
            continue;
        }
        let c = rank.as_mut().expect("checked above");
        let peer = 1 - c.rank();
        match op {
            Op::Send(bytes, answer) => {
                // The length first (two words), so a receive of another length fails with both
                // lengths instead of reading a short or a long message.
                let len = (bytes.len() as u64).to_le_bytes();
                let r = c
                    .send(peer, &to_words(&len))
                    .and_then(|()| c.send(peer, &to_words(&bytes)))
                    .map_err(|e| format!("sending on the link: {e}"));
                if let Err(e) = &r {
                    failed = Some(e.clone());
                }
                let _ = answer.send(r.map_err(TransferError::Link));
            }
            Op::Recv(len, answer) => {
                let r = recv_exact(c, peer, len);
                if let Err(e) = &r {
                    failed = Some(e.clone());
                }
                let _ = answer.send(r.map_err(TransferError::Link));
            }
        }
    }
}

/// Fails `op` with `why` (a rank that could not be built, or a group given up).
fn refuse(op: Op, why: String) {
    match op {
        Op::Send(_, a) => {
            let _ = a.send(Err(TransferError::Link(why)));
        }
        Op::Recv(_, a) => {
            let _ = a.send(Err(TransferError::Link(why)));
        }
    }
}

fn recv_exact<C: Collective>(c: &mut C, peer: usize, len: usize) -> Result<Vec<u8>, String> {
    let mut head = [0f32; 2];
    c.recv(peer, &mut head)
        .map_err(|e| format!("receiving on the link: {e}"))?;
    let sent = u64::from_le_bytes(from_words(&head, 8).try_into().expect("8 bytes"));
    if sent != len as u64 {
        return Err(format!(
            "the link's next message is {sent} bytes, the frame announced {len}"
        ));
    }
    let mut words = vec![0f32; len.div_ceil(4)];
    c.recv(peer, &mut words)
        .map_err(|e| format!("receiving on the link: {e}"))?;
    Ok(from_words(&words, len))
}

/// NCCL links on one GPU of this worker: a communicator of two ranks per connection.
pub struct NcclFabric {
    ordinal: usize,
    uuid: [u8; LINK_DEVICE],
    watchdog: Duration,
}

impl NcclFabric {
    /// Links from CUDA device `ordinal`; an operation waits at most `watchdog` for the peer.
    /// Refused where the CUDA driver or NCCL cannot be loaded.
    pub fn new(ordinal: usize, watchdog: Duration) -> Result<Self, TransferError> {
        if !tandem_collective::nccl::available() {
            return Err(TransferError::Link(
                "NCCL is not available here (no CUDA driver or no libnccl on the library path)"
                    .into(),
            ));
        }
        let uuid = tandem_collective::nccl::device_uuid(ordinal).map_err(link_error)?;
        Ok(Self {
            ordinal,
            uuid,
            watchdog,
        })
    }
}

impl LinkFabric for NcclFabric {
    fn kind(&self) -> LinkKind {
        LinkKind::Nccl
    }

    fn device(&self) -> [u8; LINK_DEVICE] {
        self.uuid
    }

    fn offer(&self) -> Result<[u8; LINK_ID], TransferError> {
        Ok(NcclId::new().map_err(link_error)?.to_bytes())
    }

    fn join(&self, id: [u8; LINK_ID], rank: usize) -> Result<PairLink, TransferError> {
        let (ordinal, watchdog) = (self.ordinal, self.watchdog);
        PairLink::start(LinkKind::Nccl, watchdog, move || {
            NcclRank::new(ordinal, rank, 2, NcclId::from_bytes(&id), watchdog)
        })
    }
}

/// Links between thread ranks of this process: the sender's offer makes a group of two and
/// keeps both ranks under a fresh id until each side joins.
pub struct ThreadFabric {
    watchdog: Duration,
    device: [u8; LINK_DEVICE],
    offered: std::sync::atomic::AtomicU64,
    pending: Mutex<HashMap<[u8; LINK_ID], [Option<ThreadRank>; 2]>>,
}

impl ThreadFabric {
    /// A fabric whose links wait at most `watchdog` for a peer's message.
    pub fn new(watchdog: Duration) -> Arc<Self> {
        Self::on_device(watchdog, [0; LINK_DEVICE])
    }

    /// [`ThreadFabric::new`], its ranks said to run on `device` (as two workers sharing one
    /// GPU would: a receiver declines an offer from its own device).
    pub fn on_device(watchdog: Duration, device: [u8; LINK_DEVICE]) -> Arc<Self> {
        Arc::new(Self {
            watchdog,
            device,
            offered: Default::default(),
            pending: Mutex::default(),
        })
    }

    /// Pairs offered so far.
    pub fn offered(&self) -> u64 {
        self.offered.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Pairs offered and not yet joined by both sides.
    pub fn pending(&self) -> usize {
        self.pending.lock().expect("pending").len()
    }
}

impl LinkFabric for ThreadFabric {
    fn kind(&self) -> LinkKind {
        LinkKind::Threads
    }

    fn device(&self) -> [u8; LINK_DEVICE] {
        self.device
    }

    fn offer(&self) -> Result<[u8; LINK_ID], TransferError> {
        let mut id = [0u8; LINK_ID];
        rand::rngs::OsRng.fill_bytes(&mut id);
        self.offered
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut ranks = ThreadGroup::ranks(2, 1, self.watchdog).into_iter();
        let pair = [ranks.next(), ranks.next()];
        self.pending.lock().expect("pending").insert(id, pair);
        Ok(id)
    }

    fn join(&self, id: [u8; LINK_ID], rank: usize) -> Result<PairLink, TransferError> {
        let mut pending = self.pending.lock().expect("pending");
        let pair = pending
            .get_mut(&id)
            .ok_or_else(|| TransferError::Link("no such thread link offered here".into()))?;
        let r = pair
            .get_mut(rank)
            .and_then(Option::take)
            .ok_or_else(|| TransferError::Link(format!("rank {rank} of the link is taken")))?;
        if pair.iter().all(Option::is_none) {
            pending.remove(&id);
        }
        drop(pending);
        PairLink::start(LinkKind::Threads, self.watchdog, move || Ok(r))
    }

    fn withdraw(&self, id: [u8; LINK_ID]) {
        self.pending.lock().expect("pending").remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WATCHDOG: Duration = Duration::from_secs(30);

    /// Messages of every length from 0 to 9 bytes and a block frame's, in order, both ways, the
    /// bytes exact (NaN patterns included: words are copied, never computed with).
    #[tokio::test]
    async fn bytes_cross_exactly_in_order_both_ways() {
        let fabric = ThreadFabric::new(WATCHDOG);
        let id = fabric.offer().unwrap();
        let (s, r) = (fabric.join(id, 0).unwrap(), fabric.join(id, 1).unwrap());
        assert_eq!(fabric.pending(), 0);
        let msgs: Vec<Vec<u8>> = (0..10)
            .map(|n| (0..n as u8).map(|i| i.wrapping_mul(37) ^ 0xff).collect())
            .chain([vec![0xff; 24576], (0..24577u32).map(|i| i as u8).collect()])
            .collect();
        for m in &msgs {
            s.send(m.clone()).await.unwrap();
        }
        for m in &msgs {
            assert_eq!(&r.recv(m.len()).await.unwrap(), m);
        }
        r.send(b"back".to_vec()).await.unwrap();
        assert_eq!(s.recv(4).await.unwrap(), b"back");
    }

    /// A receive of another length than the send's fails with both lengths, and the link fails
    /// every operation after it.
    #[tokio::test]
    async fn a_receive_of_another_length_fails_the_link() {
        let fabric = ThreadFabric::new(WATCHDOG);
        let id = fabric.offer().unwrap();
        let (s, r) = (fabric.join(id, 0).unwrap(), fabric.join(id, 1).unwrap());
        s.send(vec![1; 100]).await.unwrap();
        let e = r.recv(96).await.unwrap_err().to_string();
        assert!(e.contains("100 bytes") && e.contains("96"), "{e}");
        s.send(vec![2; 4]).await.unwrap();
        let e = r.recv(4).await.unwrap_err().to_string();
        assert!(e.contains("100 bytes"), "the first failure, again: {e}");
    }

    /// A peer that never sends: the receive fails at the watchdog instead of hanging.
    #[tokio::test]
    async fn a_silent_peer_fails_the_receive_at_the_watchdog() {
        // (A second: the end's own bound, twice the watchdog, answers instead where the
        // link's thread is held up for a watchdog's length, as a busy machine can at 200 ms.)
        let fabric = ThreadFabric::new(Duration::from_secs(1));
        let id = fabric.offer().unwrap();
        let (_s, r) = (fabric.join(id, 0).unwrap(), fabric.join(id, 1).unwrap());
        let e = r.recv(8).await.unwrap_err().to_string();
        assert!(e.contains("did not arrive"), "{e}");
    }

    /// Joining an id never offered, or a rank twice, is refused with the reason.
    #[test]
    fn strangers_and_second_joins_are_refused() {
        let fabric = ThreadFabric::new(WATCHDOG);
        let e = fabric.join([7; LINK_ID], 1).unwrap_err().to_string();
        assert!(e.contains("no such thread link"), "{e}");
        let id = fabric.offer().unwrap();
        let _r = fabric.join(id, 1).unwrap();
        let e = fabric.join(id, 1).unwrap_err().to_string();
        assert!(e.contains("rank 1 of the link is taken"), "{e}");
        assert_eq!(fabric.pending(), 1, "rank 0 still to join");
    }

    /// An end whose rank is never built (an NCCL initialisation whose peer never joins, which
    /// has no watchdog of its own): its first operation fails at twice the watchdog, and every
    /// later one at once.
    #[tokio::test]
    async fn a_rank_never_built_fails_its_operations_within_the_bound() {
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let end = PairLink::start::<ThreadRank, _>(
            LinkKind::Nccl,
            Duration::from_millis(50),
            move || {
                let _ = held.recv();
                Err(tandem_collective::CollectiveError::Device("never".into()))
            },
        )
        .unwrap();
        let e = end.send(vec![1]).await.unwrap_err().to_string();
        assert!(e.contains("not answered within 100 ms"), "{e}");
        let e = end.recv(1).await.unwrap_err().to_string();
        assert!(e.contains("not answered within 100 ms"), "{e}");
        drop(hold);
    }

    /// An end whose rank could not be built fails each operation with why.
    #[tokio::test]
    async fn a_rank_that_could_not_be_built_fails_every_operation() {
        let end = PairLink::start::<ThreadRank, _>(LinkKind::Nccl, WATCHDOG, || {
            Err(tandem_collective::CollectiveError::Device("no GPU".into()))
        })
        .unwrap();
        for _ in 0..2 {
            let e = end.send(vec![1, 2]).await.unwrap_err().to_string();
            assert!(
                e.contains("joining the link") && e.contains("no GPU"),
                "{e}"
            );
        }
        let e = end.recv(2).await.unwrap_err().to_string();
        assert!(e.contains("no GPU"), "{e}");
    }
}
