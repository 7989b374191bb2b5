//! The TCP transport and receiver over loopback: transfers land intact, and every kind of bad
//! frame or peer is refused, counted, and writes nothing.

// Lists of KV head ranges with a single range (every head) are what these tests mean.
#![allow(clippy::single_range_in_vec_init)]

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_kv_transfer::link::LINK_ID;
use tandem_kv_transfer::wire::{FrameHeader, FrameKind, MAX_CONTEXT};
use tandem_kv_transfer::{
    BlockFrame, BlockId, BlockSink, KvReceiver, KvTransport, LinkFabric, LinkKind, LinkOffer,
    PairLink, Secret, TcpTransport, ThreadFabric, TransferError, WireFault,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A pool stand-in that records what was written where.
struct MemSink {
    frame_len: usize,
    layers: u32,
    written: Mutex<HashMap<(u32, u32), Vec<u8>>>,
}

impl MemSink {
    fn new(frame_len: usize, layers: u32) -> Arc<Self> {
        Arc::new(Self {
            frame_len,
            layers,
            written: Mutex::new(HashMap::new()),
        })
    }
    fn get(&self, layer: u32, block: u32) -> Option<Vec<u8>> {
        self.written.lock().unwrap().get(&(layer, block)).cloned()
    }
    fn count(&self) -> usize {
        self.written.lock().unwrap().len()
    }
}

impl BlockSink for MemSink {
    fn frame_len(&self) -> usize {
        self.frame_len
    }
    fn layers(&self) -> u32 {
        self.layers
    }
    fn write(&self, layer: u32, block: BlockId, payload: &[u8]) {
        let block = block.0;
        self.written
            .lock()
            .unwrap()
            .insert((layer, block), payload.to_vec());
    }
}

fn secret() -> Secret {
    Secret::new("test-cluster-secret-0123456789").unwrap()
}

fn payload(layer: u32, block: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 ^ layer.wrapping_mul(31) ^ block.wrapping_mul(7)) as u8)
        .collect()
}

async fn receiver() -> KvReceiver {
    KvReceiver::bind("127.0.0.1:0", secret()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_lands_every_block_intact() {
    let rx = receiver().await;
    let sink = MemSink::new(1024, 4);
    let blocks = [3u32, 7, 9];
    let mut grant = rx.grant(&ids(&blocks), sink.clone(), Duration::from_secs(10));
    let t = TcpTransport::new(secret());
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    for layer in 0..4 {
        for &b in &blocks {
            s.send_block(grant.id(), layer, BlockId(b), &payload(layer, b, 1024))
                .await
                .unwrap();
        }
    }
    s.end(grant.id()).await.unwrap();
    let stats = grant.wait().await.unwrap();
    assert_eq!((stats.frames, stats.bytes), (12, 12 * 1024));
    for layer in 0..4 {
        for &b in &blocks {
            assert_eq!(sink.get(layer, b).unwrap(), payload(layer, b, 1024));
        }
    }
    assert_eq!(rx.bytes_received(), 12 * 1024);
    assert_eq!(rx.rejections().total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_context_travels_with_its_transfer_and_a_damaged_one_fails_it() {
    let rx = receiver().await;
    let sink = MemSink::new(64, 1);
    let mut grant = rx.grant(&ids(&[2]), sink.clone(), Duration::from_secs(10));
    let t = TcpTransport::new(secret());
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    let cx = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\nvendor=abc";
    s.context(grant.id(), cx).await.unwrap();
    // A stream carries the transfer it was opened for only.
    assert!(matches!(
        s.context(grant.id() ^ 1, cx).await,
        Err(TransferError::Config(_))
    ));
    s.send_block(grant.id(), 0, BlockId(2), &payload(0, 2, 64))
        .await
        .unwrap();
    s.end(grant.id()).await.unwrap();
    let stats = grant.wait().await.unwrap();
    assert_eq!(stats.context.as_deref(), Some(cx));
    assert!(stats.first_frame.is_some());
    assert_eq!((stats.frames, stats.bytes), (1, 64));
    assert_eq!(rx.rejections().total(), 0);
    let too_long = "x".repeat(MAX_CONTEXT + 1);
    assert!(matches!(
        s.context(7, &too_long).await,
        Err(TransferError::Config(_))
    ));

    // A context frame whose checksum does not match fails its transfer at once.
    let mut grant = rx.grant(&ids(&[3]), sink.clone(), Duration::from_secs(60));
    let mut raw = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let session =
        tandem_kv_transfer::auth::connect(&mut raw, &secret(), None, grant.id(), &rx.endpoint())
            .await
            .unwrap();
    let mut h = FrameHeader::control(FrameKind::Context, grant.id(), cx.as_bytes());
    h.checksum ^= 1;
    let mut hb = h.encode();
    session.seal(0, &mut hb);
    raw.write_all(&hb).await.unwrap();
    raw.write_all(cx.as_bytes()).await.unwrap();
    assert!(matches!(
        grant.wait().await,
        Err(TransferError::Rejected("bad_checksum"))
    ));
    assert_eq!(rx.rejections().bad_checksum.load(Ordering::Relaxed), 1);
    assert_eq!(
        sink.count(),
        1,
        "nothing of the failed transfer was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_grant_counts_its_frames_and_waits_as_long_as_its_holder_does() {
    let rx = receiver().await;
    let sink = MemSink::new(256, 2);
    let mut grant = rx.grant_open(&ids(&[4, 5]), sink.clone());
    assert_eq!(grant.frames_received(), 0);
    let t = TcpTransport::new(secret());
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    let mut sent = 0;
    for layer in 0..2 {
        for b in [4u32, 5] {
            s.send_block(grant.id(), layer, BlockId(b), &payload(layer, b, 256))
                .await
                .unwrap();
            sent += 1;
            // The count the holder watches for progress follows every frame.
            let end = std::time::Instant::now() + Duration::from_secs(10);
            while grant.frames_received() < sent {
                assert!(std::time::Instant::now() < end, "frame {sent} not counted");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if sent < 4 {
                assert_eq!(grant.frames_received(), sent, "no frame counted twice");
            }
        }
    }
    s.end(grant.id()).await.unwrap();
    let stats = grant.wait().await.unwrap();
    assert_eq!((stats.frames, stats.bytes), (4, 4 * 256));
    assert_eq!(sink.count(), 4);
    assert_eq!(rx.rejections().total(), 0);
}

/// Block frames over `(layer, block, payload)` triples.
fn frames_of(bodies: &[(u32, u32, Vec<u8>)]) -> Vec<BlockFrame<'_>> {
    bodies
        .iter()
        .map(|(layer, block, p)| BlockFrame {
            layer: *layer,
            block: BlockId(*block),
            heads: 0..0,
            payload: p,
        })
        .collect()
}

/// Many frames in one `send_blocks` call (several vectored writes), frames larger than the
/// receiver's read buffer, and a peer that trickles its bytes a few at a time all land intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_large_and_trickled_frames_land_intact() {
    let rx = receiver().await;
    let t = TcpTransport::new(secret());

    // 3 layers x 40 blocks of 24 KiB: 2.9 MB in one call.
    let small = MemSink::new(24 << 10, 3);
    let blocks: Vec<u32> = (100..140).collect();
    let mut grant = rx.grant(&ids(&blocks), small.clone(), Duration::from_secs(10));
    let bodies: Vec<(u32, u32, Vec<u8>)> = (0..3)
        .flat_map(|l| blocks.iter().map(move |&b| (l, b, payload(l, b, 24 << 10))))
        .collect();
    let frames = frames_of(&bodies);
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    s.send_blocks(grant.id(), &frames).await.unwrap();
    s.end(grant.id()).await.unwrap();
    assert_eq!(grant.wait().await.unwrap().frames, 120);
    for (layer, block, p) in &bodies {
        assert_eq!(small.get(*layer, *block).as_ref(), Some(p));
    }

    // Frames of 3 MiB, over the 1 MiB read buffer.
    let big = MemSink::new(3 << 20, 2);
    let mut grant = rx.grant(&ids(&[1, 2]), big.clone(), Duration::from_secs(10));
    let bodies: Vec<(u32, u32, Vec<u8>)> = [(0, 1), (0, 2), (1, 1), (1, 2)]
        .into_iter()
        .map(|(l, b)| (l, b, payload(l, b, 3 << 20)))
        .collect();
    let frames = frames_of(&bodies);
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    s.send_blocks(grant.id(), &frames).await.unwrap();
    s.end(grant.id()).await.unwrap();
    grant.wait().await.unwrap();
    for (layer, block, p) in &bodies {
        assert_eq!(big.get(*layer, *block).as_ref(), Some(p));
    }

    // Two frames written 7 bytes at a time, headers and payloads split anywhere.
    let trickle = MemSink::new(300, 2);
    let mut grant = rx.grant(&ids(&[5]), trickle.clone(), Duration::from_secs(10));
    let mut raw = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    raw.set_nodelay(true).unwrap();
    let session =
        tandem_kv_transfer::auth::connect(&mut raw, &secret(), None, grant.id(), &rx.endpoint())
            .await
            .unwrap();
    let mut bytes = Vec::new();
    for layer in 0..2 {
        let p = payload(layer, 5, 300);
        let mut h = FrameHeader::block(grant.id(), layer, 5, &p).encode();
        session.seal(layer as u64, &mut h);
        bytes.extend_from_slice(&h);
        bytes.extend_from_slice(&p);
    }
    for piece in bytes.chunks(7) {
        raw.write_all(piece).await.unwrap();
        tokio::task::yield_now().await;
    }
    grant.wait().await.unwrap();
    assert_eq!(trickle.get(1, 5), Some(payload(1, 5, 300)));
    assert_eq!(rx.rejections().total(), 0);
    assert_eq!(
        rx.bytes_received(),
        120 * (24 << 10) + 4 * (3 << 20) + 2 * 300
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_the_secret_cannot_write() {
    let rx = receiver().await;
    let sink = MemSink::new(64, 1);
    let grant = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(10));
    let wrong = TcpTransport::new(Secret::new("not-the-cluster-secret-xyz").unwrap());
    let r = wrong.open(&rx.endpoint(), grant.id()).await;
    assert!(
        matches!(r, Err(TransferError::Unauthenticated)),
        "{:?}",
        r.err()
    );

    // A raw client that skips the handshake and writes a well-formed frame anyway.
    let mut raw = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let mut hello = [0u8; 38];
    raw.read_exact(&mut hello).await.unwrap();
    let body = payload(0, 1, 64);
    let h = FrameHeader::block(grant.id(), 0, 1, &body);
    let _ = raw.write_all(&h.encode()).await;
    let _ = raw.write_all(&body).await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut rest)).await;
    assert_eq!(sink.count(), 0, "nothing may reach the pool");
    assert_eq!(rx.rejections().unauthenticated.load(Ordering::Relaxed), 2);
    assert_eq!(rx.bytes_received(), 0);
}

/// Over the connection, and with the payloads on a payload link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_is_rejected_counted_and_fails_the_transfer() {
    for linked in [false, true] {
        flipped_byte(linked).await;
    }
}

async fn flipped_byte(linked: bool) {
    let rx = receiver().await;
    let fabric = ThreadFabric::new(Duration::from_secs(30));
    if linked {
        rx.join_links(fabric.clone());
    }
    let sink = MemSink::new(512, 2);
    let mut grant = rx.grant(&ids(&[4, 5]), sink.clone(), Duration::from_secs(10));
    // The production transport, with the second block frame damaged after its checksum.
    let fault = WireFault::flip_block_frame(2);
    let t = TcpTransport::new(secret())
        .with_fault(fault.clone())
        .with_link(fabric.clone());
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    for layer in 0..2 {
        for b in [4u32, 5] {
            s.send_block(grant.id(), layer, BlockId(b), &payload(layer, b, 512))
                .await
                .unwrap();
        }
    }
    s.end(grant.id()).await.unwrap();
    assert!(fault.fired());
    let r = grant.wait().await;
    assert!(
        matches!(r, Err(TransferError::Rejected("bad_checksum"))),
        "{r:?}"
    );
    assert_eq!(rx.rejections().bad_checksum.load(Ordering::Relaxed), 1);
    // The damaged frame (layer 0, block 5) never reached the pool; the transfer being failed,
    // the frames after it were refused as unknown.
    assert_eq!(sink.get(0, 5), None);
    assert_eq!(sink.get(0, 4), Some(payload(0, 4, 512)));
    // (The failure is reported at the bad frame; the receiver may still be reading the rest.)
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while rx.rejections().unknown_transfer.load(Ordering::Relaxed) < 2
        && std::time::Instant::now() < end
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(rx.rejections().unknown_transfer.load(Ordering::Relaxed), 2);
    assert_eq!(sink.count(), 1);
    // On a link, the frames passed over took their payloads from it: the link stayed in step
    // (nothing failed on it), and only the first frame's bytes were written.
    assert_eq!(rx.rejections().link_failed.load(Ordering::Relaxed), 0);
    assert_eq!(
        rx.link_bytes_received(),
        if linked { 512 } else { 0 },
        "linked: {linked}"
    );
    assert_eq!(fabric.pending(), 0, "linked: {linked}");
}

/// Block payloads on a payload link (two thread ranks of this process, standing where NCCL's two
/// GPUs would): every byte lands and is counted as the link's, lengths that are not whole words
/// included, and the headers still come over the connection. A receiver with no fabric declines
/// the offer, and the same transfer goes whole over the connection; either way the sender's
/// offered pair is joined or withdrawn, never left behind.
/// An offer from the receiver's own device (two workers sharing a GPU, where NCCL would refuse
/// the pair) is declined the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_on_a_link_land_intact_and_a_declined_offer_goes_over_the_connection() {
    let plain = ThreadFabric::new(Duration::from_secs(30));
    let one_gpu = ThreadFabric::on_device(Duration::from_secs(30), [0x42; 16]);
    for (fabric, receiver_has_one) in [(&plain, true), (&plain, false), (&one_gpu, true)] {
        let joins = receiver_has_one && fabric.device() == [0; 16];
        let rx = receiver().await;
        if receiver_has_one {
            rx.join_links((*fabric).clone());
        }
        let sink = MemSink::new(1002, 3);
        let blocks = [1u32, 6, 8];
        let mut grant = rx.grant(&ids(&blocks), sink.clone(), Duration::from_secs(30));
        let t = TcpTransport::new(secret()).with_link(fabric.clone());
        let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
        let bodies: Vec<(u32, u32, Vec<u8>)> = (0..3)
            .flat_map(|l| blocks.iter().map(move |&b| (l, b, payload(l, b, 1002))))
            .collect();
        s.send_blocks(grant.id(), &frames_of(&bodies))
            .await
            .unwrap();
        s.end(grant.id()).await.unwrap();
        let stats = grant.wait().await.unwrap();
        assert_eq!((stats.frames, stats.bytes), (9, 9 * 1002));
        for (layer, block, p) in &bodies {
            assert_eq!(sink.get(*layer, *block).as_ref(), Some(p));
        }
        assert_eq!(rx.bytes_received(), 9 * 1002);
        assert_eq!(
            rx.link_bytes_received(),
            if joins { 9 * 1002 } else { 0 },
            "joins: {joins}"
        );
        assert_eq!(rx.rejections().total(), 0);
        assert_eq!(fabric.pending(), 0, "joins: {joins}");
        // The pair outlives its connection on both sides, and the next transfer to the same
        // receiver takes it again instead of making a new one.
        drop(s);
        assert_eq!(t.idle_links(), joins as usize);
        wait_until(|| rx.idle_links() == joins as usize).await;
        let offered = fabric.offered();
        let mut grant = rx.grant(&ids(&[2]), sink.clone(), Duration::from_secs(30));
        let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
        let bodies: Vec<(u32, u32, Vec<u8>)> =
            (0..3).map(|l| (l, 2, payload(l, 2, 1002))).collect();
        s.send_blocks(grant.id(), &frames_of(&bodies))
            .await
            .unwrap();
        s.end(grant.id()).await.unwrap();
        grant.wait().await.unwrap();
        assert_eq!(sink.get(2, 2), Some(payload(2, 2, 1002)));
        assert_eq!(
            rx.link_bytes_received(),
            if joins { 12 * 1002 } else { 0 },
            "joins: {joins}"
        );
        // (A receiver that will never take one is offered none again.)
        assert_eq!(fabric.offered() - offered, 0, "joins: {joins}");
        let answered: Vec<u64> = rx.link_answers().iter().map(|(_, n)| *n).collect();
        // Declined, joined, busy, never: two joins, or one offer declined for good.
        let want = if joins { [0, 2, 0, 0] } else { [0, 0, 0, 1] };
        assert_eq!(answered, want, "joins: {joins}");
        assert_eq!(fabric.pending(), 0, "joins: {joins}");
    }
}

/// Waits (at most ten minutes: a bound for a broken build, not a timing) until `ok`.
async fn wait_until(ok: impl Fn() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(600);
    while !ok() {
        assert!(std::time::Instant::now() < end, "never came");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A fabric whose sender ends cannot build their rank (an NCCL initialisation that fails on the
/// prefill side); the receiver's ends are real thread ranks.
struct BrokenSenderFabric(Arc<ThreadFabric>);

impl LinkFabric for BrokenSenderFabric {
    fn kind(&self) -> LinkKind {
        LinkKind::Threads
    }
    fn offer(&self) -> Result<[u8; LINK_ID], TransferError> {
        self.0.offer()
    }
    fn join(&self, id: [u8; LINK_ID], rank: usize) -> Result<PairLink, TransferError> {
        if rank == 1 {
            return self.0.join(id, 1);
        }
        self.0.withdraw(id);
        PairLink::start::<tandem_collective::ThreadRank, _>(
            LinkKind::Threads,
            Duration::from_secs(30),
            || {
                Err(tandem_collective::CollectiveError::Device(
                    "ncclCommInitRank: unhandled system error".into(),
                ))
            },
        )
    }
    fn withdraw(&self, id: [u8; LINK_ID]) {
        self.0.withdraw(id)
    }
}

/// A link that fails on the sender's side fails that transfer on both sides (the receiver's at
/// its link's watchdog, `link_failed`), and the next transfer to the same receiver is offered
/// no link: it goes whole over TCP instead of failing the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_link_fails_its_transfer_and_that_receiver_then_gets_tcp() {
    let threads = ThreadFabric::new(Duration::from_millis(300));
    let rx = receiver().await;
    rx.join_links(threads.clone());
    let t = TcpTransport::new(secret()).with_link(Arc::new(BrokenSenderFabric(threads.clone())));
    let sink = MemSink::new(256, 1);

    let mut grant = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(600));
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    let e = s
        .send_block(grant.id(), 0, BlockId(1), &payload(0, 1, 256))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("unhandled system error"), "{e}");
    let r = grant.wait().await;
    assert!(
        matches!(r, Err(TransferError::Rejected("link_failed"))),
        "{r:?}"
    );
    drop(s);

    let mut grant = rx.grant(&ids(&[2]), sink.clone(), Duration::from_secs(600));
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    s.send_block(grant.id(), 0, BlockId(2), &payload(0, 2, 256))
        .await
        .unwrap();
    s.end(grant.id()).await.unwrap();
    grant.wait().await.unwrap();
    assert_eq!(sink.get(0, 2), Some(payload(0, 2, 256)));
    assert_eq!((rx.bytes_received(), rx.link_bytes_received()), (256, 0));
    assert_eq!(rx.rejections().link_failed.load(Ordering::Relaxed), 1);
    assert_eq!(threads.pending(), 0);
}

/// A connection admitted for `transfer` whose frames the test writes itself, with a new pair
/// of `fabric` offered and joined on both sides: the connection, its session and the sender's
/// end of the link (which sends nothing unless told).
async fn linked_connection(
    rx: &KvReceiver,
    fabric: &ThreadFabric,
    transfer: u64,
) -> (
    tokio::net::TcpStream,
    tandem_kv_transfer::auth::Session,
    PairLink,
) {
    let mut raw = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let offer = LinkOffer {
        kind: LinkKind::Threads,
        id: fabric.offer().unwrap(),
        device: fabric.device(),
        reuse: false,
    };
    let session = tandem_kv_transfer::auth::connect_linked(
        &mut raw,
        &secret(),
        None,
        transfer,
        &rx.endpoint(),
        Some(offer),
    )
    .await
    .unwrap();
    assert_eq!(session.link(), Some(offer));
    let end = fabric.join(offer.id, 0).unwrap();
    (raw, session, end)
}

/// A header whose payload never comes on the link fails its transfer at the link's watchdog,
/// counted as `link_failed`, and the connection closes; a header naming a link its connection
/// does not have is refused the same way at once. Nothing reaches the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_payload_that_never_comes_fails_the_transfer() {
    let fabric = ThreadFabric::new(Duration::from_millis(300));
    let rx = receiver().await;
    rx.join_links(fabric.clone());
    let sink = MemSink::new(64, 1);
    let body = payload(0, 2, 64);
    let link_failed = || rx.rejections().link_failed.load(Ordering::Relaxed);

    let mut grant = rx.grant(&ids(&[2]), sink.clone(), Duration::from_secs(600));
    let (mut raw, session, _silent) = linked_connection(&rx, &fabric, grant.id()).await;
    let h = FrameHeader::block(grant.id(), 0, 2, &body).via_link();
    raw.write_all(&sealed(&session, 0, h, &[])).await.unwrap();
    let r = grant.wait().await;
    assert!(
        matches!(r, Err(TransferError::Rejected("link_failed"))),
        "{r:?}"
    );
    assert_eq!(link_failed(), 1);
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(600), raw.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0))), "{closed:?}");

    let mut grant = rx.grant(&ids(&[2]), sink.clone(), Duration::from_secs(600));
    let (mut raw, session) = sealed_connection(&rx, grant.id()).await;
    assert_eq!(session.link(), None);
    let h = FrameHeader::block(grant.id(), 0, 2, &body).via_link();
    raw.write_all(&sealed(&session, 0, h, &body)).await.unwrap();
    let r = grant.wait().await;
    assert!(
        matches!(r, Err(TransferError::Rejected("link_failed"))),
        "{r:?}"
    );
    assert_eq!(link_failed(), 2);
    assert_eq!(sink.count(), 0, "nothing may reach the pool");
    assert_eq!((rx.bytes_received(), rx.link_bytes_received()), (0, 0));

    // A payload awaited on a link whose watchdog is far off: once the grant is revoked (its
    // holder gave the sender up), the connection closes and its link is dropped, not kept busy.
    let patient = ThreadFabric::new(Duration::from_secs(3600));
    rx.join_links(patient.clone());
    let grant = rx.grant(&ids(&[2]), sink.clone(), Duration::from_secs(600));
    let (mut raw, session, _stopped) = linked_connection(&rx, &patient, grant.id()).await;
    let h = FrameHeader::block(grant.id(), 0, 2, &body).via_link();
    raw.write_all(&sealed(&session, 0, h, &[])).await.unwrap();
    wait_until(|| rx.busy_links() == 1).await;
    drop(grant);
    let closed = tokio::time::timeout(Duration::from_secs(600), raw.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0))), "{closed:?}");
    wait_until(|| rx.busy_links() == 0).await;
    assert_eq!(rx.idle_links(), 0, "a link out of step is not kept");
    assert_eq!(
        link_failed(),
        2,
        "a revoked transfer's link is not a failure"
    );
}

/// A connection admitted for `transfer` whose frames the test writes itself, sealed in order.
async fn sealed_connection(
    rx: &KvReceiver,
    transfer: u64,
) -> (tokio::net::TcpStream, tandem_kv_transfer::auth::Session) {
    let mut raw = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let session =
        tandem_kv_transfer::auth::connect(&mut raw, &secret(), None, transfer, &rx.endpoint())
            .await
            .unwrap();
    (raw, session)
}

/// `h` (its payload `body`) sealed as frame `seq` of `session`.
fn sealed(
    session: &tandem_kv_transfer::auth::Session,
    seq: u64,
    h: FrameHeader,
    body: &[u8],
) -> Vec<u8> {
    let mut hb = h.encode();
    session.seal(seq, &mut hb);
    [&hb[..], body].concat()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_are_refused_by_reason_and_deadlines_expire() {
    let rx = receiver().await;
    let ep = rx.endpoint();
    let sink = MemSink::new(256, 2);
    let t = TcpTransport::new(secret());

    // A block outside the grant.
    let mut g1 = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&ep, g1.id()).await.unwrap();
    s.send_block(g1.id(), 0, BlockId(2), &payload(0, 2, 256))
        .await
        .unwrap();
    assert!(matches!(
        g1.wait().await,
        Err(TransferError::Rejected("block_not_granted"))
    ));
    // A wrong length.
    let mut g2 = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&ep, g2.id()).await.unwrap();
    s.send_block(g2.id(), 0, BlockId(1), &payload(0, 1, 200))
        .await
        .unwrap();
    assert!(matches!(
        g2.wait().await,
        Err(TransferError::Rejected("bad_length"))
    ));
    // A layer the pool does not have.
    let mut g3 = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&ep, g3.id()).await.unwrap();
    s.send_block(g3.id(), 9, BlockId(1), &payload(9, 1, 256))
        .await
        .unwrap();
    assert!(matches!(
        g3.wait().await,
        Err(TransferError::Rejected("bad_layer"))
    ));
    // Half a transfer, then silence: the deadline fails it, and a sender that comes after it
    // is refused at the handshake. (Two seconds: the connection, its handshake and the first
    // block must land before it, which a busy machine can hold up for a few hundred ms.)
    let mut g4 = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(2));
    let mut s = t.open(&ep, g4.id()).await.unwrap();
    s.send_block(g4.id(), 0, BlockId(1), &payload(0, 1, 256))
        .await
        .unwrap();
    assert!(matches!(g4.wait().await, Err(TransferError::Expired)));
    let late = t.open(&ep, g4.id()).await.err().expect("refused");
    assert!(matches!(late, TransferError::NotGranted(_)), "{late}");
    // An end with blocks missing.
    let mut g5 = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&ep, g5.id()).await.unwrap();
    s.end(g5.id()).await.unwrap();
    assert!(matches!(
        g5.wait().await,
        Err(TransferError::Incomplete { missing: 2 })
    ));
    // Abort.
    let mut g6 = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&ep, g6.id()).await.unwrap();
    s.abort(g6.id()).await.unwrap();
    assert!(matches!(g6.wait().await, Err(TransferError::Aborted)));

    // A sealed frame for another transfer than the connection's is counted and passed over;
    // the connection's own transfer goes on.
    let mut g7 = rx.grant(&ids(&[3]), sink.clone(), Duration::from_secs(10));
    let (mut raw, session) = sealed_connection(&rx, g7.id()).await;
    let other = payload(0, 3, 256);
    let mut bytes = sealed(&session, 0, FrameHeader::block(12345, 0, 3, &other), &other);
    for layer in 0..2 {
        let p = payload(layer, 3, 256);
        bytes.extend(sealed(
            &session,
            1 + layer as u64,
            FrameHeader::block(g7.id(), layer, 3, &p),
            &p,
        ));
    }
    raw.write_all(&bytes).await.unwrap();
    g7.wait().await.unwrap();
    assert_eq!(sink.get(1, 3), Some(payload(1, 3, 256)));

    // A frame whose tag is not its frame number's (replayed, reordered or injected) fails the
    // transfer and closes the connection before a byte of it is written.
    let mut g8 = rx.grant(&ids(&[4]), sink.clone(), Duration::from_secs(10));
    let (mut raw, session) = sealed_connection(&rx, g8.id()).await;
    let p = payload(0, 4, 256);
    raw.write_all(&sealed(
        &session,
        1,
        FrameHeader::block(g8.id(), 0, 4, &p),
        &p,
    ))
    .await
    .unwrap();
    assert!(matches!(
        g8.wait().await,
        Err(TransferError::Rejected("bad_tag"))
    ));
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), raw.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the connection of a bad tag is closed");

    // A connection whose grant goes away (its holder revoked it) is closed, though its sender
    // says nothing more.
    let g9 = rx.grant(&ids(&[5]), sink.clone(), Duration::from_secs(60));
    let (mut raw, _session) = sealed_connection(&rx, g9.id()).await;
    drop(g9);
    let closed = tokio::time::timeout(Duration::from_secs(30), raw.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "an idle connection outlived its grant");

    let count = |f: &std::sync::atomic::AtomicU64| f.load(Ordering::Relaxed);
    let r = rx.rejections();
    assert_eq!(count(&r.unknown_transfer), 1);
    assert_eq!(count(&r.block_not_granted), 1);
    assert_eq!(count(&r.bad_length), 1);
    assert_eq!(count(&r.bad_layer), 1);
    assert_eq!(count(&r.not_granted), 1);
    assert_eq!(count(&r.bad_tag), 1);
    // g4's first frame and g7's two were written, nothing else.
    assert_eq!(sink.count(), 3);
}

/// Block ids from their numbers.
fn ids(blocks: &[u32]) -> Vec<BlockId> {
    blocks.iter().map(|&b| BlockId(b)).collect()
}

/// A sink of tensor-parallel ranks: one piece per range of KV heads, each `head_len` bytes a
/// head, recording what was written where.
struct RankSink {
    pieces: Vec<std::ops::Range<u32>>,
    head_len: usize,
    written: Mutex<HashMap<(u32, u32, usize), Vec<u8>>>,
}

impl BlockSink for RankSink {
    fn frame_len(&self) -> usize {
        unreachable!("a sink of pieces takes no whole-block frames")
    }
    fn layers(&self) -> u32 {
        2
    }
    fn write(&self, _: u32, _: BlockId, _: &[u8]) {
        unreachable!("a sink of pieces takes no whole-block frames")
    }
    fn pieces(&self) -> Vec<std::ops::Range<u32>> {
        self.pieces.clone()
    }
    fn piece_len(&self, piece: usize) -> usize {
        self.pieces[piece].len() * self.head_len
    }
    fn write_piece(&self, layer: u32, block: BlockId, piece: usize, payload: &[u8]) {
        self.written
            .lock()
            .unwrap()
            .insert((layer, block.0, piece), payload.to_vec());
    }
}

fn kv_shape(dtype: &str, pieces: Vec<std::ops::Range<u32>>) -> tandem_kv_transfer::KvShape {
    tandem_kv_transfer::KvShape {
        model: "tiny".into(),
        layers: 2,
        kv_heads: 3,
        head_dim: 4,
        block_size: 2,
        dtype: dtype.into(),
        pieces,
    }
}

/// A receiver whose ranks hold heads 0..1 and 1..3: the sender learns the ranges in the
/// handshake; a frame per range and layer completes a block, a frame of other heads is refused
/// as `bad_heads`; a sender with another cache dtype is refused at the handshake with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_carry_head_ranges_and_caches_that_do_not_map_are_refused() {
    let ranges = vec![0..1, 1..3];
    let shape = kv_shape("f32", ranges.clone());
    let rx = KvReceiver::bind_with("127.0.0.1:0", secret(), Some(shape.clone()))
        .await
        .unwrap();
    let sink = Arc::new(RankSink {
        pieces: ranges.clone(),
        head_len: 8,
        written: Mutex::new(HashMap::new()),
    });
    let mut grant = rx.grant(&ids(&[5]), sink.clone(), Duration::from_secs(10));
    let t = TcpTransport::new(secret()).with_shape(kv_shape("f32", vec![0..3]));
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    assert_eq!(s.peer(), Some(&shape));
    let bodies: Vec<(u32, std::ops::Range<u16>, Vec<u8>)> = (0..2)
        .flat_map(|layer| {
            ranges.iter().map(move |r| {
                let heads = r.start as u16..r.end as u16;
                (layer, heads, payload(layer, r.start, r.len() * 8))
            })
        })
        .collect();
    // Everything but the last piece: the transfer is still open.
    let frames: Vec<BlockFrame<'_>> = bodies
        .iter()
        .map(|(layer, heads, p)| BlockFrame {
            layer: *layer,
            block: BlockId(5),
            heads: heads.clone(),
            payload: p,
        })
        .collect();
    s.send_blocks(grant.id(), &frames[..3]).await.unwrap();
    s.send_blocks(grant.id(), &frames[3..]).await.unwrap();
    let stats = grant.wait().await.unwrap();
    assert_eq!((stats.frames, stats.bytes), (4, 2 * 3 * 8));
    let w = sink.written.lock().unwrap().clone();
    assert_eq!(w.len(), 4);
    assert_eq!(w[&(1, 5, 1)], payload(1, 1, 16));

    // Heads 0..2 are no rank's range.
    let mut grant = rx.grant(&ids(&[6]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    let body = payload(0, 0, 16);
    let bad = [BlockFrame {
        layer: 0,
        block: BlockId(6),
        heads: 0..2,
        payload: &body,
    }];
    s.send_blocks(grant.id(), &bad).await.unwrap();
    assert!(matches!(
        grant.wait().await,
        Err(TransferError::Rejected("bad_heads"))
    ));
    assert_eq!(rx.rejections().bad_heads.load(Ordering::Relaxed), 1);

    let int8 = TcpTransport::new(secret()).with_shape(kv_shape("int8", vec![0..3]));
    let e = int8
        .open(&rx.endpoint(), grant.id())
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("the receiver refused: the peer's KV cache dtype is int8, this worker's f32"),
        "{e}"
    );
    // The receiver counts the refusal once its side of the handshake is done.
    for _ in 0..1000 {
        if rx.rejections().mismatched.load(Ordering::Relaxed) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(rx.rejections().mismatched.load(Ordering::Relaxed), 1);
}

/// A handshake relayed through another address (a listener that forwards every byte both ways
/// to the receiver, as a prefill worker tricked into dialing it would be): the sender's MAC
/// names the relay's address, not the receiver's, so the receiver refuses it with the reason and
/// nothing reaches the pool; dialed directly, the same grant lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_relayed_through_another_address_is_refused() {
    let rx = receiver().await;
    let sink = MemSink::new(64, 1);
    let mut grant = rx.grant(&ids(&[1]), sink.clone(), Duration::from_secs(30));
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap().to_string();
    let target = rx.local_addr();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = relay.accept().await {
            tokio::spawn(async move {
                let mut out = tokio::net::TcpStream::connect(target).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            });
        }
    });
    let t = TcpTransport::new(secret());
    let e = t
        .open(&relay_addr, grant.id())
        .await
        .err()
        .expect("a relayed handshake is refused");
    assert!(matches!(e, TransferError::NotGranted(_)), "{e}");
    assert!(
        e.to_string().contains(&format!(
            "advertised at {}, not {relay_addr}",
            rx.endpoint()
        )),
        "{e}"
    );
    // The receiver counts the refusal once its side of the handshake is done (the sender can
    // hear of it first).
    for _ in 0..1000 {
        if rx.rejections().not_granted.load(Ordering::Relaxed) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(rx.rejections().not_granted.load(Ordering::Relaxed), 1);
    assert_eq!(sink.count(), 0);
    // The receiver's own endpoint, as its grants advertise it, is admitted.
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    s.send_block(grant.id(), 0, BlockId(1), &payload(0, 1, 64))
        .await
        .unwrap();
    s.end(grant.id()).await.unwrap();
    grant.wait().await.unwrap();
    assert_eq!(sink.get(0, 1), Some(payload(0, 1, 64)));
}

/// A frame written at (layer, block).
type Written = ((u32, u32), Vec<u8>);

/// A sink that stores asynchronously, as a GPU's does: writes wait in flight until the sink
/// settles.
#[derive(Default)]
struct SettlingSink {
    frame_len: usize,
    in_flight: Mutex<Vec<Written>>,
    stored: Mutex<HashMap<(u32, u32), Vec<u8>>>,
    settles: std::sync::atomic::AtomicUsize,
}

impl BlockSink for SettlingSink {
    fn frame_len(&self) -> usize {
        self.frame_len
    }
    fn layers(&self) -> u32 {
        2
    }
    fn write(&self, layer: u32, block: BlockId, payload: &[u8]) {
        self.in_flight
            .lock()
            .unwrap()
            .push(((layer, block.0), payload.to_vec()));
    }
    fn settle(&self, blocks: &[BlockId]) -> Result<(), String> {
        assert!(!blocks.is_empty(), "a grant settles with its blocks");
        self.settles.fetch_add(1, Ordering::Relaxed);
        let mut stored = self.stored.lock().unwrap();
        stored.extend(self.in_flight.lock().unwrap().drain(..));
        Ok(())
    }
}

/// A receiver with a bf16 cache (a GPU's) takes an f32 sender's frames (a CPU's), converting
/// each value to nearest-even bf16 after checking the frame as sent; a frame of the receiver's
/// own length from that sender is a bad length; the transfer completes only once the sink has
/// settled its copies, and a revoked grant settles them before its blocks go back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn float_frames_convert_at_the_receiver_and_grants_settle_their_sink() {
    let shape = kv_shape("bf16", vec![0..3]);
    let rx = KvReceiver::bind_with("127.0.0.1:0", secret(), Some(shape))
        .await
        .unwrap();
    // 2 · 3 heads · 2 slots · 4 values.
    let values = 48;
    let sink = Arc::new(SettlingSink {
        frame_len: values * 2,
        ..Default::default()
    });
    let mut grant = rx.grant(&ids(&[4]), sink.clone(), Duration::from_secs(10));
    let t = TcpTransport::new(secret()).with_shape(kv_shape("f32", vec![0..3]));
    let f32s = |layer: u32| -> Vec<f32> {
        (0..values)
            .map(|i| (i as f32 - 20.5) * 0.37 + layer as f32 / 3.0)
            .collect()
    };
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    for layer in 0..2 {
        let body: Vec<u8> = f32s(layer).iter().flat_map(|v| v.to_le_bytes()).collect();
        s.send_block(grant.id(), layer, BlockId(4), &body)
            .await
            .unwrap();
    }
    let stats = grant.wait().await.unwrap();
    assert_eq!((stats.frames, stats.bytes), (2, 2 * values as u64 * 4));
    assert!(
        sink.in_flight.lock().unwrap().is_empty(),
        "completed before settling"
    );
    assert!(sink.settles.load(Ordering::Relaxed) >= 1);
    for layer in 0..2 {
        let want: Vec<u8> = f32s(layer)
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        assert_eq!(
            sink.stored.lock().unwrap()[&(layer, 4)],
            want,
            "layer {layer}"
        );
    }

    // The receiver's own frame length is not what an f32 sender sends.
    let mut grant = rx.grant(&ids(&[5]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    s.send_block(grant.id(), 0, BlockId(5), &vec![0u8; values * 2])
        .await
        .unwrap();
    assert!(matches!(
        grant.wait().await,
        Err(TransferError::Rejected("bad_length"))
    ));

    // Half a transfer, then the grant is revoked: what reached the sink is settled by then.
    let grant = rx.grant(&ids(&[6]), sink.clone(), Duration::from_secs(10));
    let mut s = t.open(&rx.endpoint(), grant.id()).await.unwrap();
    let body: Vec<u8> = f32s(0).iter().flat_map(|v| v.to_le_bytes()).collect();
    s.send_block(grant.id(), 0, BlockId(6), &body)
        .await
        .unwrap();
    for _ in 0..1000 {
        if !sink.in_flight.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sink.in_flight.lock().unwrap().len(), 1);
    drop(grant);
    assert!(sink.in_flight.lock().unwrap().is_empty());
    assert!(sink.stored.lock().unwrap().contains_key(&(0, 6)));
}
