//! Property-based fuzzing of what the KV receiver reads from the network: frame headers, the
//! handshake (random bytes from either side, and a recorded handshake replayed), and a live
//! receiver fed random frame streams by an authenticated peer. Nothing may panic or hang, no
//! byte may land in a grant the peer was not told of, and the receiver must take a good
//! transfer afterwards.
//!
//! `PROPTEST_CASES` sets the number of cases per property (`scripts/fuzz` runs many more).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use proptest::prelude::*;
use std::sync::atomic::Ordering;
use tandem_kv_transfer::auth;
use tandem_kv_transfer::wire::{checksum, FrameHeader, FrameKind, HEADER_LEN};
use tandem_kv_transfer::{
    BlockId, BlockSink, KvReceiver, KvTransport, Secret, TcpTransport, TransferError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn secret() -> Secret {
    Secret::new("fuzz-cluster-secret-0123456789").unwrap()
}

fn cases(default: u32) -> ProptestConfig {
    ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

/// Records every write.
#[derive(Default)]
struct MemSink {
    written: Mutex<HashMap<(u32, u32), Vec<u8>>>,
}

const FRAME: usize = 256;
const LAYERS: u32 = 2;

impl BlockSink for MemSink {
    fn frame_len(&self) -> usize {
        FRAME
    }
    fn layers(&self) -> u32 {
        LAYERS
    }
    fn write(&self, layer: u32, block: BlockId, payload: &[u8]) {
        let block = block.0;
        self.written
            .lock()
            .unwrap()
            .insert((layer, block), payload.to_vec());
    }
}

struct Live {
    rt: tokio::runtime::Runtime,
    rx: KvReceiver,
}

fn live() -> &'static Live {
    static L: OnceLock<Live> = OnceLock::new();
    L.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let rx = rt
            .block_on(KvReceiver::bind("127.0.0.1:0", secret()))
            .unwrap();
        Live { rt, rx }
    })
}

/// One frame a hostile but authenticated peer sends.
#[derive(Debug, Clone)]
enum Junk {
    /// A well-formed header (its checksum right or not) and `len` payload bytes.
    Frame {
        kind: u8,
        layer: u32,
        block: u32,
        len: u32,
        /// The transfer: the granted one (`true`, when the peer was told of it) or a made-up one.
        granted: bool,
        transfer: u64,
        good_sum: bool,
    },
    /// Bytes of anything.
    Raw(Vec<u8>),
}

fn junk() -> impl Strategy<Value = Junk> {
    prop_oneof![
        4 => (
            1u8..=3,
            prop_oneof![0u32..LAYERS + 1, any::<u32>()],
            prop_oneof![0u32..8, any::<u32>()],
            prop_oneof![Just(FRAME as u32), 0u32..600],
            any::<bool>(),
            any::<u64>(),
            any::<bool>(),
        )
            .prop_map(|(kind, layer, block, len, granted, transfer, good_sum)| Junk::Frame {
                kind,
                layer,
                block,
                len,
                granted,
                transfer,
                good_sum,
            }),
        1 => prop::collection::vec(any::<u8>(), 0..120).prop_map(Junk::Raw),
    ]
}

proptest! {
    #![proptest_config(cases(2048))]

    #[test]
    fn any_header_bytes_decode_or_fail_cleanly(bytes in prop::collection::vec(any::<u8>(), HEADER_LEN)) {
        let b: [u8; HEADER_LEN] = bytes.try_into().unwrap();
        if let Ok(h) = FrameHeader::decode(&b) {
            // What decodes is what encodes.
            prop_assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        }
    }

    #[test]
    fn a_mutated_good_header_decodes_or_fails_cleanly(
        layer: u32, transfer: u64, block: u32, pos in 0usize..HEADER_LEN, byte: u8,
    ) {
        let mut b = FrameHeader::block(transfer, layer, block, &[1, 2, 3]).encode();
        b[pos] = byte;
        let _ = FrameHeader::decode(&b);
    }
}

/// Our end of a connection whose peer sends `bytes`, closes its side and reads what comes.
fn random_peer(bytes: Vec<u8>) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<()>) {
    let (ours, mut theirs) = tokio::io::duplex(4096);
    let peer = tokio::spawn(async move {
        let _ = theirs.write_all(&bytes).await;
        let _ = theirs.shutdown().await;
        let mut sink = Vec::new();
        let _ = theirs.read_to_end(&mut sink).await;
    });
    (ours, peer)
}

proptest! {
    #![proptest_config(cases(256))]

    /// Random bytes from the sender's side never pass the receiver's handshake, and random
    /// bytes from the receiver's side never pass the sender's.
    #[test]
    fn random_peers_never_pass_the_handshake(
        from_peer in prop::collection::vec(any::<u8>(), 0..200),
        valid_hello in any::<bool>(),
    ) {
        let rt = &live().rt;
        let (accepted, connected) = rt.block_on(async {
            let mut peer_bytes = from_peer.clone();
            if valid_hello {
                // A hello with the right magic and version, then junk for the MAC.
                let mut h = b"TKV1".to_vec();
                h.extend_from_slice(&tandem_kv_transfer::wire::VERSION.to_le_bytes());
                h.extend_from_slice(&peer_bytes);
                peer_bytes = h;
            }
            // Receiver side against a random sender, then sender side against a random
            // receiver.
            let (mut ours, peer) = random_peer(peer_bytes.clone());
            let accepted = tokio::time::timeout(Duration::from_secs(30), auth::accept(&mut ours, &secret(), None, |_, _| Ok(()))).await;
            drop(ours);
            let _ = peer.await;
            let (mut ours, peer) = random_peer(peer_bytes);
            let connected = tokio::time::timeout(Duration::from_secs(30), auth::connect(&mut ours, &secret(), None, 1, "127.0.0.1:1")).await;
            drop(ours);
            let _ = peer.await;
            (accepted, connected)
        });
        prop_assert!(matches!(accepted, Ok(Err(_))), "accept: {:?}", accepted);
        prop_assert!(matches!(connected, Ok(Err(_))), "connect: {:?}", connected);
    }
}

proptest! {
    #![proptest_config(cases(96))]

    /// An authenticated peer sending any stream of frames and bytes writes nothing into a grant
    /// it was not told of, and leaves the receiver able to take a good transfer.
    #[test]
    fn a_hostile_sender_cannot_touch_other_grants_or_break_the_receiver(
        frames in prop::collection::vec(junk(), 1..24),
    ) {
        let l = live();
        let told = Arc::new(MemSink::default());
        let other = Arc::new(MemSink::default());
        l.rt.block_on(async {
            let told_grant = l.rx.grant_open(&ids(&[0, 1, 2]), told.clone());
            let mut other_grant = l.rx.grant_open(&ids(&[0, 1, 2]), other.clone());
            let mut s = tokio::net::TcpStream::connect(l.rx.local_addr()).await.unwrap();
            let session = auth::connect(&mut s, &secret(), None, told_grant.id(), &l.rx.endpoint())
                .await
                .unwrap();
            let mut seq = 0u64;
            for f in &frames {
                let bytes = match f {
                    Junk::Raw(b) => b.clone(),
                    Junk::Frame { kind, layer, block, len, granted, transfer, good_sum } => {
                        let payload: Vec<u8> = (0..*len).map(|i| (i * 7) as u8).collect();
                        let id = if *granted { told_grant.id() } else { *transfer };
                        let mut h = FrameHeader::block(id, *layer, *block, &payload);
                        h.kind = match kind {
                            1 => FrameKind::Block,
                            2 => FrameKind::End,
                            _ => FrameKind::Abort,
                        };
                        if !good_sum {
                            h.checksum = checksum(&payload) ^ 1;
                        }
                        let mut hb = h.encode();
                        session.seal(seq, &mut hb);
                        seq += 1;
                        let mut b = hb.to_vec();
                        b.extend_from_slice(&payload);
                        b
                    }
                };
                if s.write_all(&bytes).await.is_err() {
                    // The receiver closed on a bad frame: that is its answer.
                    break;
                }
            }
            drop(s);
            drop(told_grant);
            // The other grant saw nothing; a good transfer to it still lands.
            tokio::time::sleep(Duration::from_millis(5)).await;
            assert!(other.written.lock().unwrap().is_empty(), "a stray frame landed");
            let t = TcpTransport::new(secret());
            let mut good = t.open(&l.rx.endpoint(), other_grant.id()).await.unwrap();
            for layer in 0..LAYERS {
                for b in 0..3u32 {
                    good.send_block(other_grant.id(), layer, BlockId(b), &[b as u8; FRAME]).await.unwrap();
                }
            }
            good.end(other_grant.id()).await.unwrap();
            let stats = tokio::time::timeout(Duration::from_secs(60), other_grant.wait())
                .await
                .expect("the good transfer finishes")
                .expect("and succeeds");
            assert_eq!(stats.frames, u64::from(LAYERS) * 3);
        });
        let written = other.written.lock().unwrap();
        prop_assert_eq!(written.len(), (LAYERS * 3) as usize);
        prop_assert!(written.iter().all(|(&(_, b), p)| p == &vec![b as u8; FRAME]));
    }
}

/// A handshake recorded from one session and replayed on a new connection is refused: the
/// receiver's fresh nonce makes the recorded MAC worthless.
#[tokio::test]
async fn a_replayed_handshake_is_refused() {
    // Session one, through a relay that records what the sender says.
    let (mut sender, relay_a) = tokio::io::duplex(4096);
    let (relay_b, mut receiver) = tokio::io::duplex(4096);
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let (mut a_r, mut a_w) = tokio::io::split(relay_a);
    let (mut b_r, mut b_w) = tokio::io::split(relay_b);
    let rec = recorded.clone();
    let up = tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        while let Ok(n) = a_r.read(&mut buf).await {
            if n == 0 {
                break;
            }
            rec.lock().unwrap().extend_from_slice(&buf[..n]);
            if b_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    let down = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut b_r, &mut a_w).await;
    });
    let key = secret();
    let (a, c) = tokio::join!(
        auth::accept(&mut receiver, &key, None, |_, _| Ok(())),
        auth::connect(&mut sender, &key, None, 7, "127.0.0.1:1")
    );
    a.unwrap();
    c.unwrap();
    drop((sender, receiver));
    let _ = tokio::join!(up, down);
    let replay = recorded.lock().unwrap().clone();
    assert!(
        replay.len() > 6 + 32,
        "the sender's hello and MAC were recorded"
    );

    // Session two: the same bytes again.
    let (mut ours, mut theirs) = tokio::io::duplex(4096);
    let peer = tokio::spawn(async move {
        let _ = theirs.write_all(&replay).await;
        let mut sink = Vec::new();
        let _ = theirs.read_to_end(&mut sink).await;
    });
    let r = auth::accept(&mut ours, &secret(), None, |_, _| Ok(())).await;
    assert!(
        matches!(r, Err(tandem_kv_transfer::TransferError::Unauthenticated)),
        "{r:?}"
    );
    drop(ours);
    peer.await.unwrap();
}

/// Block ids from their numbers.
fn ids(blocks: &[u32]) -> Vec<BlockId> {
    blocks.iter().map(|&b| BlockId(b)).collect()
}

/// A header announcing the wire's largest payload (64 MiB) for a granted transfer, then
/// nothing: the receiver refuses it by its header alone (a block frame of this grant is one
/// 256-byte layer), failing the transfer at once instead of waiting to buffer 64 MiB; the
/// announced bytes are passed over unkept, the connection closes with its transfer, and the
/// receiver takes the next transfer.
#[tokio::test]
async fn a_header_longer_than_its_grant_allows_is_refused_before_its_payload() {
    let rx = KvReceiver::bind("127.0.0.1:0", secret()).await.unwrap();
    let sink = Arc::new(MemSink::default());
    let mut grant = rx.grant_open(&ids(&[0]), sink.clone());
    let mut s = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let session = auth::connect(&mut s, &secret(), None, grant.id(), &rx.endpoint())
        .await
        .unwrap();
    let mut h = FrameHeader::block(grant.id(), 0, 0, &[0u8; FRAME]);
    h.len = tandem_kv_transfer::wire::MAX_PAYLOAD;
    let mut hb = h.encode();
    session.seal(0, &mut hb);
    s.write_all(&hb).await.unwrap();
    let failed = grant.wait().await;
    assert!(
        matches!(failed, Err(TransferError::Rejected("bad_length"))),
        "{failed:?}"
    );
    assert_eq!(rx.rejections().bad_length.load(Ordering::Relaxed), 1);
    assert!(sink.written.lock().unwrap().is_empty());
    // The announced bytes are passed over, not kept (the connection may close once they are
    // and its transfer is gone).
    let filler = vec![7u8; 1 << 20];
    for _ in 0..64 {
        if s.write_all(&filler).await.is_err() {
            break;
        }
    }
    drop(s);
    let other = Arc::new(MemSink::default());
    let mut good = rx.grant_open(&ids(&[0]), other.clone());
    let t = TcpTransport::new(secret());
    let mut g = t.open(&rx.endpoint(), good.id()).await.unwrap();
    for layer in 0..LAYERS {
        g.send_block(good.id(), layer, BlockId(0), &[9u8; FRAME])
            .await
            .unwrap();
    }
    let stats = good.wait().await.unwrap();
    assert_eq!(stats.frames, u64::from(LAYERS));
}
