//! Peer authentication: mutual challenge-response over a shared secret (HMAC-SHA256), so the
//! secret never crosses the wire and a peer that does not hold it cannot write a byte. A
//! connection is bound to one transfer at one endpoint, and its frames are sealed with a key
//! derived from the handshake.
//!
//! ```text
//! receiver -> sender   "TKV1" | version u16 | receiver nonce (32 bytes) | shape
//! sender   -> receiver "TKV1" | version u16 | sender nonce (32) | shape | transfer u64
//!                      | endpoint length u16 | endpoint | link offer
//!                      | HMAC(secret, "tandem-kv/1 sender" | rn | sn | rshape | sshape | transfer | endpoint | offer)
//! receiver -> sender   status u8 (0 ok, 1 refused, 2 caches do not map, 3 transfer not granted
//!                      here) | [status 2, 3: reason length u16 | reason] | link answer u8
//!                      | HMAC(secret, "tandem-kv/1 receiver" | status, reason and answer | sn | rn | sshape | rshape | transfer | endpoint | offer)
//! session key          HMAC(secret, "tandem-kv/1 session" | rn | sn | transfer | endpoint)
//! ```
//!
//! The endpoint is the one the sender dialed, as the receiver's grant advertised it; the
//! receiver admits the connection only for a live grant at that endpoint, so a handshake relayed
//! through another address, or for another transfer, fails. Every frame header then carries a
//! tag, HMAC(session key, frame number | header)[..16] (the header holds the payload's xxh3), so
//! no frame can be injected, replayed or reordered on the connection.
//!
//! A link offer is a [`LinkKind`] byte (0: none) and, after a kind, a flags byte (bit 0: a pair
//! joined before, offered again), the pair's id ([`LINK_ID`] bytes) and the sender's device
//! ([`LINK_DEVICE`] bytes, zeros for none): the sender offers to carry block payloads on a payload link beside the
//! connection (NCCL between two GPUs, see [`crate::link`]); the receiver answers 1 when it joined
//! the pair as its rank (or took its idle end of a pair offered again), 0 when it declines (no
//! a refused connection, a pair it no longer has, no room), 2 when a pair offered again is still
//! busy with the connection before, and 3 when it will never take this sender's links (no
//! fabric of that kind, its own device); on all but 1 the connection carries every payload
//! itself.
//!
//! A shape is a u32 length and a [`KvShape`] (length 0: none given). Both sides check the
//! other's MAC in constant time. The receiver reads no frame before the sender's MAC checks out
//! and closes the connection when it does not, when the two caches cannot exchange blocks, or
//! when it has no such transfer (it says why for the last two).

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::link::{LinkAnswer, LinkKind, LinkOffer, LINK_DEVICE, LINK_ID};
use crate::shape::{KvShape, MAX_SHAPE};
use crate::wire::{HEADER_LEN, HELLO_MAGIC, TAG_AT, VERSION};
use crate::TransferError;

const NONCE: usize = 32;
const MAC: usize = 32;
/// Longest endpoint a handshake may name, in bytes.
pub const MAX_ENDPOINT: usize = 1024;

/// The cluster's shared KV secret (`--kv-secret` / `TANDEM_KV_SECRET`).
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Shortest secret accepted, in bytes.
pub const MIN_SECRET: usize = 16;

impl Secret {
    /// A secret of `bytes`; refused when shorter than [`MIN_SECRET`].
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, TransferError> {
        let b = bytes.into();
        if b.len() < MIN_SECRET {
            return Err(TransferError::Config(format!(
                "the KV secret must be at least {MIN_SECRET} bytes, got {}",
                b.len()
            )));
        }
        Ok(Self(b))
    }

    /// A fresh random secret (for a cluster started on one machine).
    pub fn random() -> Self {
        let mut b = vec![0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut b);
        Self(
            b.iter()
                .map(|x| format!("{x:02x}"))
                .collect::<String>()
                .into_bytes(),
        )
    }

    /// The secret as text (for passing to a child process).
    pub fn to_text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// The bearer token of the cluster's worker plane: what every worker RPC (and a worker's
    /// `/deregister`) must carry as `authorization: Bearer <token>`. Derived from the secret
    /// (HMAC-SHA256 under its own label, in hex), so the secret itself never crosses the wire
    /// and a token seen on it opens no KV handshake.
    pub fn rpc_token(&self) -> String {
        self.mac(RPC_LABEL, &[])
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        for p in parts {
            m.update(p);
        }
        m
    }
}

const SENDER_LABEL: &[u8] = b"tandem-kv/1 sender";
const RECEIVER_LABEL: &[u8] = b"tandem-kv/1 receiver";
const RPC_LABEL: &[u8] = b"tandem-worker-rpc/1";
const SESSION_LABEL: &[u8] = b"tandem-kv/1 session";

/// One authenticated connection: the transfer it is bound to, the peer's cache, and the key its
/// frame headers are sealed with.
#[derive(Clone)]
pub struct Session {
    transfer: u64,
    peer: Option<KvShape>,
    key: Hmac<Sha256>,
    link: Option<LinkOffer>,
    answer: LinkAnswer,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("transfer", &self.transfer)
            .field("peer", &self.peer)
            .field("link", &self.link.map(|o| o.kind))
            .finish_non_exhaustive()
    }
}

impl Session {
    fn new(secret: &Secret, binding: &Binding<'_>, peer: Option<KvShape>) -> Self {
        let key = secret
            .mac(
                SESSION_LABEL,
                &[
                    binding.rn,
                    binding.sn,
                    &binding.transfer.to_le_bytes(),
                    binding.endpoint,
                ],
            )
            .finalize()
            .into_bytes();
        Self {
            transfer: binding.transfer,
            peer,
            key: Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes any key length"),
            link: None,
            answer: LinkAnswer::Declined,
        }
    }

    /// How the receiver answered this side's link offer (declined where none was made).
    pub fn link_answer(&self) -> LinkAnswer {
        self.answer
    }

    /// The payload link both sides joined in the handshake (as the sender offered it), if
    /// any: block frames may then carry their payloads on it.
    pub fn link(&self) -> Option<LinkOffer> {
        self.link
    }

    /// The transfer this connection carries.
    pub fn transfer(&self) -> u64 {
        self.transfer
    }

    /// The other side's cache, as it described it (the receiver's, for a sender).
    pub fn peer(&self) -> Option<&KvShape> {
        self.peer.as_ref()
    }

    fn tag(&self, seq: u64, header: &[u8; HEADER_LEN]) -> Hmac<Sha256> {
        let mut m = self.key.clone();
        m.update(&seq.to_le_bytes());
        m.update(&header[..TAG_AT]);
        m
    }

    /// Writes frame `seq`'s tag (the connection's frames count from 0) into `header`.
    pub fn seal(&self, seq: u64, header: &mut [u8; HEADER_LEN]) {
        let tag = self.tag(seq, header).finalize().into_bytes();
        header[TAG_AT..].copy_from_slice(&tag[..HEADER_LEN - TAG_AT]);
    }

    /// Whether `header` carries frame `seq`'s tag (compared in constant time).
    pub fn verify(&self, seq: u64, header: &[u8; HEADER_LEN]) -> bool {
        self.tag(seq, header)
            .verify_truncated_left(&header[TAG_AT..])
            .is_ok()
    }
}

/// What both MACs and the session key bind: the nonces, the transfer and the dialed endpoint.
struct Binding<'a> {
    rn: &'a [u8],
    sn: &'a [u8],
    transfer: u64,
    endpoint: &'a [u8],
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// A shape as the handshake carries it: its encoding, or a zero length.
fn shape_bytes(shape: Option<&KvShape>) -> Vec<u8> {
    shape.map_or_else(|| 0u32.to_le_bytes().to_vec(), KvShape::encode)
}

/// Reads a shape: its bytes as sent (for the MACs) and the shape, if one was given.
async fn read_shape<S: AsyncRead + Unpin>(
    s: &mut S,
) -> Result<(Vec<u8>, Option<KvShape>), TransferError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_SHAPE {
        return Err(TransferError::Handshake(format!(
            "the peer's KV cache description of {n} bytes is over the {MAX_SHAPE}-byte limit"
        )));
    }
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).await?;
    let shape = match n {
        0 => None,
        _ => Some(KvShape::decode(&body)?),
    };
    let mut raw = len.to_vec();
    raw.extend_from_slice(&body);
    Ok((raw, shape))
}

/// A link offer as the handshake carries it: a kind byte (0: none), then flags, the pair's id
/// and the sender's device.
fn offer_bytes(offer: Option<&LinkOffer>) -> Vec<u8> {
    match offer {
        None => vec![0],
        Some(o) => [&[o.kind as u8, o.reuse as u8][..], &o.id, &o.device].concat(),
    }
}

/// Reads a link offer: its bytes as sent (for the MACs), and the offer when one was made of a
/// kind this side knows (another kind still carries an id and a device, and is declined).
async fn read_offer<S: AsyncRead + Unpin>(
    s: &mut S,
) -> Result<(Vec<u8>, Option<LinkOffer>), TransferError> {
    let mut kind = [0u8];
    s.read_exact(&mut kind).await?;
    if kind[0] == 0 {
        return Ok((kind.to_vec(), None));
    }
    let mut flags = [0u8];
    s.read_exact(&mut flags).await?;
    let mut id = [0u8; LINK_ID];
    s.read_exact(&mut id).await?;
    let mut device = [0u8; LINK_DEVICE];
    s.read_exact(&mut device).await?;
    let raw = [&kind[..], &flags, &id, &device].concat();
    let offer = LinkKind::from_byte(kind[0]).map(|kind| LinkOffer {
        kind,
        id,
        device,
        reuse: flags[0] & 1 == 1,
    });
    Ok((raw, offer))
}

async fn read_hello<S: AsyncRead + Unpin>(s: &mut S) -> Result<[u8; NONCE], TransferError> {
    let mut head = [0u8; 6];
    s.read_exact(&mut head).await?;
    if head[0..4] != HELLO_MAGIC {
        return Err(TransferError::Handshake(
            "peer does not speak the Tandem KV protocol".into(),
        ));
    }
    let v = u16::from_le_bytes([head[4], head[5]]);
    if v != VERSION {
        return Err(TransferError::Handshake(format!(
            "peer speaks KV protocol version {v}, this side {VERSION}"
        )));
    }
    let mut n = [0u8; NONCE];
    s.read_exact(&mut n).await?;
    Ok(n)
}

fn hello(n: &[u8; NONCE]) -> Vec<u8> {
    let mut b = Vec::with_capacity(6 + NONCE);
    b.extend_from_slice(&HELLO_MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(n);
    b
}

/// The receiver's half, describing its cache as `shape`. `admit` is asked, once the sender has
/// proved the secret, whether the transfer it names is granted here at the endpoint it dialed
/// (an `Err` is the reason it is not). Errors mean the peer is refused (the caller closes the
/// connection): [`TransferError::Mismatch`] when the two caches cannot exchange blocks and
/// [`TransferError::NotGranted`] when the transfer is not admitted, both told to the sender with
/// the reason.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
    shape: Option<&KvShape>,
    admit: impl FnOnce(u64, &str) -> Result<(), String>,
) -> Result<Session, TransferError> {
    accept_linked(s, secret, shape, admit, async |_: &LinkOffer| {
        LinkAnswer::Declined
    })
    .await
}

/// [`accept`], where a sender may offer a payload link: `join` is asked, once the connection is
/// admitted, to join the offered pair (of a kind this side knows) as the receiver's rank, or take
/// its idle end of a pair offered again, and answers; the answer goes back under this side's
/// MAC, and the session names the link when it was joined.
pub async fn accept_linked<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
    shape: Option<&KvShape>,
    admit: impl FnOnce(u64, &str) -> Result<(), String>,
    join: impl AsyncFnOnce(&LinkOffer) -> LinkAnswer,
) -> Result<Session, TransferError> {
    let rn = nonce();
    let rshape = shape_bytes(shape);
    let mut msg = hello(&rn);
    msg.extend_from_slice(&rshape);
    s.write_all(&msg).await?;
    s.flush().await?;
    let sn = read_hello(s).await?;
    let (sshape, theirs) = read_shape(s).await?;
    let mut transfer = [0u8; 8];
    s.read_exact(&mut transfer).await?;
    let transfer = u64::from_le_bytes(transfer);
    let mut n = [0u8; 2];
    s.read_exact(&mut n).await?;
    let n = u16::from_le_bytes(n) as usize;
    if n > MAX_ENDPOINT {
        return Err(TransferError::Handshake(format!(
            "the peer names an endpoint of {n} bytes, over the {MAX_ENDPOINT}-byte limit"
        )));
    }
    let mut endpoint = vec![0u8; n];
    s.read_exact(&mut endpoint).await?;
    let (offer_raw, offer) = read_offer(s).await?;
    let mut mac = [0u8; MAC];
    s.read_exact(&mut mac).await?;
    let binding = Binding {
        rn: &rn,
        sn: &sn,
        transfer,
        endpoint: &endpoint,
    };
    let bound = [&transfer.to_le_bytes()[..], &endpoint];
    if secret
        .mac(
            SENDER_LABEL,
            &[&rn, &sn, &rshape, &sshape, bound[0], bound[1], &offer_raw],
        )
        .verify_slice(&mac)
        .is_err()
    {
        let _ = s.write_all(&[1u8; 1 + MAC]).await;
        return Err(TransferError::Unauthenticated);
    }
    let refusal = match (shape, &theirs) {
        (Some(mine), Some(theirs)) => mine.mismatch(theirs).map(|w| (2u8, w)),
        // Frames of f16 and bf16 are the same length: a receiver of either must know which
        // the sender stores to convert them.
        (Some(mine), None) if mine.dtype == "f16" || mine.dtype == "bf16" => Some((
            2u8,
            format!(
                "the peer did not describe its KV cache; a receiver of {} frames must know the sender's element type",
                mine.dtype
            ),
        )),
        _ => None,
    }
    .or_else(|| {
        admit(transfer, &String::from_utf8_lossy(&endpoint))
            .err()
            .map(|w| (3u8, w))
    });
    // The offered link, joined only on a connection admitted, of a kind this side knows.
    let answer = match (&refusal, &offer) {
        (None, Some(o)) => match join(o).await {
            // Busy is an answer to a pair offered again only.
            LinkAnswer::Busy if !o.reuse => LinkAnswer::Declined,
            a => a,
        },
        _ => LinkAnswer::Declined,
    };
    let link = offer.filter(|_| answer == LinkAnswer::Joined);
    // Status, then (status 2 or 3) the reason, then the link answer, then the MAC over them and
    // the hello messages.
    let mut head = vec![refusal.as_ref().map_or(0, |(st, _)| *st)];
    if let Some((_, why)) = &refusal {
        let w = &why.as_bytes()[..why.len().min(u16::MAX as usize)];
        head.extend_from_slice(&(w.len() as u16).to_le_bytes());
        head.extend_from_slice(w);
    }
    head.push(answer as u8);
    let mac = secret
        .mac(
            RECEIVER_LABEL,
            &[
                &head, &sn, &rn, &sshape, &rshape, bound[0], bound[1], &offer_raw,
            ],
        )
        .finalize()
        .into_bytes();
    let mut reply = head;
    reply.extend_from_slice(&mac);
    s.write_all(&reply).await?;
    s.flush().await?;
    match refusal {
        Some((2, why)) => Err(TransferError::Mismatch(why)),
        Some((_, why)) => Err(TransferError::NotGranted(why)),
        None => Ok(Session {
            link,
            answer,
            ..Session::new(secret, &binding, theirs)
        }),
    }
}

/// The sender's half, describing its cache as `shape`, for `transfer` at `endpoint` (as the
/// receiver's grant advertised it, the address this side dialed): proves it holds the secret
/// and checks that the receiver does too and admits the transfer. The session carries the
/// receiver's cache, when it described one.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
    shape: Option<&KvShape>,
    transfer: u64,
    endpoint: &str,
) -> Result<Session, TransferError> {
    connect_linked(s, secret, shape, transfer, endpoint, None).await
}

/// [`connect`], offering the payload link `offer` names (its kind and the pair's id, made by this
/// side's fabric): the session names it when the receiver joined it, and none when the receiver
/// declined (the connection then carries every payload itself).
pub async fn connect_linked<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
    shape: Option<&KvShape>,
    transfer: u64,
    endpoint: &str,
    offer: Option<LinkOffer>,
) -> Result<Session, TransferError> {
    if endpoint.len() > MAX_ENDPOINT {
        return Err(TransferError::Config(format!(
            "a KV endpoint of {} bytes is over the {MAX_ENDPOINT}-byte limit",
            endpoint.len()
        )));
    }
    let rn = read_hello(s).await?;
    let (rshape, theirs) = read_shape(s).await?;
    let sn = nonce();
    let sshape = shape_bytes(shape);
    let tb = transfer.to_le_bytes();
    let eb = endpoint.as_bytes();
    let mut msg = hello(&sn);
    msg.extend_from_slice(&sshape);
    msg.extend_from_slice(&tb);
    msg.extend_from_slice(&(eb.len() as u16).to_le_bytes());
    msg.extend_from_slice(eb);
    let ob = offer_bytes(offer.as_ref());
    msg.extend_from_slice(&ob);
    msg.extend_from_slice(
        &secret
            .mac(SENDER_LABEL, &[&rn, &sn, &rshape, &sshape, &tb, eb, &ob])
            .finalize()
            .into_bytes(),
    );
    s.write_all(&msg).await?;
    s.flush().await?;
    let mut head = vec![0u8];
    s.read_exact(&mut head).await?;
    let why = match head[0] {
        0 => None,
        1 => return Err(TransferError::Unauthenticated),
        st @ (2 | 3) => {
            let mut n = [0u8; 2];
            s.read_exact(&mut n).await?;
            let mut why = vec![0u8; u16::from_le_bytes(n) as usize];
            s.read_exact(&mut why).await?;
            head.extend_from_slice(&n);
            head.extend_from_slice(&why);
            Some((st, String::from_utf8_lossy(&why).into_owned()))
        }
        other => {
            return Err(TransferError::Handshake(format!(
                "the receiver answered with unknown status {other}"
            )))
        }
    };
    let mut answer = [0u8];
    s.read_exact(&mut answer).await?;
    head.push(answer[0]);
    let mut mac = [0u8; MAC];
    s.read_exact(&mut mac).await?;
    secret
        .mac(
            RECEIVER_LABEL,
            &[&head, &sn, &rn, &sshape, &rshape, &tb, eb, &ob],
        )
        .verify_slice(&mac)
        .map_err(|_| TransferError::Handshake("the receiver does not hold the KV secret".into()))?;
    let binding = Binding {
        rn: &rn,
        sn: &sn,
        transfer,
        endpoint: eb,
    };
    match why {
        Some((2, why)) => Err(TransferError::Mismatch(format!(
            "the receiver refused: {why}"
        ))),
        Some((_, why)) => Err(TransferError::NotGranted(format!(
            "the receiver refused transfer {transfer:#x} at {endpoint}: {why}"
        ))),
        None => {
            let answer = match (answer[0], offer) {
                (0, _) => LinkAnswer::Declined,
                (1, Some(_)) => LinkAnswer::Joined,
                (2, Some(o)) if o.reuse => LinkAnswer::Busy,
                (3, Some(_)) => LinkAnswer::Never,
                (a, _) => {
                    return Err(TransferError::Handshake(format!(
                        "the receiver answered a link offer with {a}{}",
                        if offer.is_none() {
                            " though none was made"
                        } else {
                            ""
                        }
                    )))
                }
            };
            Ok(Session {
                link: offer.filter(|_| answer == LinkAnswer::Joined),
                answer,
                ..Session::new(secret, &binding, theirs)
            })
        }
    }
}

#[cfg(test)]
// Lists of KV head ranges with a single range (every head) are what these tests mean.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    const EP: &str = "10.0.0.7:7100";
    const T: u64 = 0x5eed;

    /// Admits transfer `T` at `EP` only.
    fn admit(t: u64, ep: &str) -> Result<(), String> {
        match (t, ep) {
            (T, EP) => Ok(()),
            (T, other) => Err(format!("not advertised at {other}")),
            _ => Err(format!("no grant {t:#x}")),
        }
    }

    #[tokio::test]
    async fn same_secret_passes_both_ways_and_a_wrong_one_is_refused() {
        let s = Secret::new("0123456789abcdef-cluster").unwrap();
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (r, c) = tokio::join!(
            accept(&mut a, &s, None, admit),
            connect(&mut b, &s, None, T, EP)
        );
        let (r, c) = (r.unwrap(), c.unwrap());
        assert_eq!((r.transfer(), c.transfer()), (T, T));
        assert_eq!(c.peer(), None);
        // Both ends hold the same session key: a header sealed by one checks at the other, as
        // its own frame number only, and not once altered.
        let mut h = [7u8; HEADER_LEN];
        c.seal(3, &mut h);
        assert!(r.verify(3, &h));
        assert!(!r.verify(4, &h), "another frame number");
        let mut bent = h;
        bent[9] ^= 1;
        assert!(!r.verify(3, &bent), "an altered header");

        let wrong = Secret::new("fedcba9876543210-intruder").unwrap();
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (r, c) = tokio::join!(
            accept(&mut a, &s, None, admit),
            connect(&mut b, &wrong, None, T, EP)
        );
        assert!(matches!(r, Err(TransferError::Unauthenticated)));
        assert!(matches!(c, Err(TransferError::Unauthenticated)));
    }

    /// A transfer not granted here, or one named at another endpoint than the receiver's (what a
    /// handshake relayed through another address names), is refused on both sides with the
    /// reason; a different session's key opens nothing.
    #[tokio::test]
    async fn a_transfer_or_endpoint_not_granted_is_refused_with_the_reason() {
        let s = Secret::new("0123456789abcdef-cluster").unwrap();
        for (t, ep, want) in [
            (T + 1, EP, "no grant 0x5eee"),
            (T, "10.9.9.9:7100", "not advertised at 10.9.9.9:7100"),
        ] {
            let (mut a, mut b) = tokio::io::duplex(1024);
            let (r, c) = tokio::join!(
                accept(&mut a, &s, None, admit),
                connect(&mut b, &s, None, t, ep)
            );
            assert!(
                matches!(&r, Err(TransferError::NotGranted(w)) if w == want),
                "{r:?}"
            );
            let c = c.unwrap_err().to_string();
            assert!(c.contains("not granted") && c.contains(want), "{c}");
        }
        // Two sessions of the same transfer and endpoint have different keys (fresh nonces).
        let session = || async {
            let (mut a, mut b) = tokio::io::duplex(1024);
            let (r, c) = tokio::join!(
                accept(&mut a, &s, None, admit),
                connect(&mut b, &s, None, T, EP)
            );
            (r.unwrap(), c.unwrap())
        };
        let ((r1, _), (_, c2)) = (session().await, session().await);
        let mut h = [1u8; HEADER_LEN];
        c2.seal(0, &mut h);
        assert!(!r1.verify(0, &h), "a frame of another session");
    }

    /// A receiver that answers a status this side does not know is refused, not trusted.
    #[tokio::test]
    async fn an_unknown_status_is_refused() {
        let s = Secret::new("0123456789abcdef-cluster").unwrap();
        let (mut a, mut b) = tokio::io::duplex(4096);
        let fake = async {
            let mut msg = hello(&nonce());
            msg.extend_from_slice(&shape_bytes(None));
            a.write_all(&msg).await.unwrap();
            let _ = read_hello(&mut a).await.unwrap();
            let _ = read_shape(&mut a).await.unwrap();
            let mut rest = [0u8; 8 + 2 + EP.len() + 1 + MAC];
            a.read_exact(&mut rest).await.unwrap();
            a.write_all(&[7u8; 1 + MAC]).await.unwrap();
        };
        let (_, c) = tokio::join!(fake, connect(&mut b, &s, None, T, EP));
        let e = c.unwrap_err().to_string();
        assert!(e.contains("unknown status 7"), "{e}");
    }

    fn shape(dtype: &str, pieces: Vec<std::ops::Range<u32>>) -> KvShape {
        KvShape {
            model: "SmolLM2".into(),
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            dtype: dtype.into(),
            pieces,
        }
    }

    /// The sender learns the receiver's head ranges; caches that cannot map are refused on
    /// both sides with the reason; a shape tampered with in flight fails the MAC.
    #[tokio::test]
    async fn shapes_cross_and_mismatches_are_refused_with_the_reason() {
        let s = Secret::new("0123456789abcdef-cluster").unwrap();
        let d = shape("f32", vec![0..1, 1..2, 2..3]);
        let p = shape("f32", vec![0..3]);
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (r, c) = tokio::join!(
            accept(&mut a, &s, Some(&d), admit),
            connect(&mut b, &s, Some(&p), T, EP)
        );
        assert_eq!(r.unwrap().peer(), Some(&p));
        assert_eq!(c.unwrap().peer(), Some(&d));

        let int8 = shape("int8", vec![0..3]);
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (r, c) = tokio::join!(
            accept(&mut a, &s, Some(&d), admit),
            connect(&mut b, &s, Some(&int8), T, EP)
        );
        let want = "the peer's KV cache dtype is int8, this worker's f32 (frames convert between f32, f16 and bf16 only)";
        assert!(
            matches!(&r, Err(TransferError::Mismatch(w)) if w == want),
            "{r:?}"
        );
        let c = c.unwrap_err().to_string();
        assert!(
            c.contains("the receiver refused") && c.contains(want),
            "{c}"
        );

        // A receiver of bf16 frames refuses a sender that says nothing of its cache (its f16
        // frames would pass as bf16); an f32 receiver takes one (lengths tell the types apart).
        let bf16 = shape("bf16", vec![0..3]);
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (r, c) = tokio::join!(
            accept(&mut a, &s, Some(&bf16), admit),
            connect(&mut b, &s, None, T, EP)
        );
        assert!(
            matches!(&r, Err(TransferError::Mismatch(w)) if w.contains("did not describe its KV cache")),
            "{r:?}"
        );
        assert!(c.is_err());
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (r, c) = tokio::join!(
            accept(&mut a, &s, Some(&d), admit),
            connect(&mut b, &s, None, T, EP)
        );
        assert!(r.is_ok() && c.is_ok());

        // A man in the middle that rewrites the receiver's shape: the sender's MAC covers the
        // shape it saw, so the receiver refuses it.
        let (mut a, mut mid_a) = tokio::io::duplex(4096);
        let (mut mid_b, mut b) = tokio::io::duplex(4096);
        let relay = async {
            let mut hello = vec![0u8; 6 + NONCE];
            mid_a.read_exact(&mut hello).await.unwrap();
            let _ = read_shape(&mut mid_a).await.unwrap();
            hello.extend_from_slice(&shape("f32", vec![0..3]).encode());
            mid_b.write_all(&hello).await.unwrap();
            let _ = tokio::io::copy_bidirectional(&mut mid_a, &mut mid_b).await;
        };
        let (r, _, _) = tokio::join!(
            async {
                let r = accept(&mut a, &s, Some(&d), admit).await;
                drop(a);
                r
            },
            async {
                let c = connect(&mut b, &s, Some(&p), T, EP).await;
                drop(b);
                c
            },
            relay
        );
        assert!(matches!(r, Err(TransferError::Unauthenticated)), "{r:?}");
    }

    /// A link offer crosses under both MACs: the receiver joins it as offered (kind and id) and
    /// both sessions name it; a receiver that does not join, a kind it does not know, or a
    /// connection it refuses answers no, and the offer is never put to `join` for a refused one.
    /// An offer altered in flight fails the sender's MAC.
    #[tokio::test]
    async fn a_link_offer_is_joined_or_declined_under_both_macs() {
        let s = Secret::new("0123456789abcdef-cluster").unwrap();
        let id = [0x5a; LINK_ID];
        let device = [0xd7; LINK_DEVICE];
        let offer = |kind| LinkOffer {
            kind,
            id,
            device,
            reuse: false,
        };
        for (kind, joins, t, want) in [
            (LinkKind::Threads as u8, true, T, true),
            (LinkKind::Nccl as u8, false, T, false),
            (9, true, T, false),
            (LinkKind::Threads as u8, true, T + 1, false),
        ] {
            let (mut a, mut b) = tokio::io::duplex(4096);
            let mut asked = None;
            let join = async |o: &LinkOffer| {
                asked = Some(*o);
                match joins {
                    true => LinkAnswer::Joined,
                    false => LinkAnswer::Declined,
                }
            };
            // The sender's own half, with a raw kind byte (a kind this build may not know).
            let sender = async {
                let rn = read_hello(&mut b).await.unwrap();
                let (rshape, _) = read_shape(&mut b).await.unwrap();
                let sn = nonce();
                let (sshape, tb, eb) = (shape_bytes(None), t.to_le_bytes(), EP.as_bytes());
                let ob = [&[kind, 0][..], &id, &device].concat();
                let mut msg = hello(&sn);
                for part in [&sshape[..], &tb, &(eb.len() as u16).to_le_bytes(), eb, &ob] {
                    msg.extend_from_slice(part);
                }
                let mac = s.mac(SENDER_LABEL, &[&rn, &sn, &rshape, &sshape, &tb, eb, &ob]);
                msg.extend_from_slice(&mac.finalize().into_bytes());
                b.write_all(&msg).await.unwrap();
            };
            let (r, ()) = tokio::join!(accept_linked(&mut a, &s, None, admit, join), sender);
            match want {
                true => {
                    assert_eq!(r.unwrap().link(), Some(offer(LinkKind::Threads)));
                    assert_eq!(asked, Some(offer(LinkKind::Threads)));
                }
                false => {
                    assert_eq!(r.map(|s| s.link()).unwrap_or(None), None);
                    assert_eq!(asked.is_some(), kind == LinkKind::Nccl as u8, "kind {kind}");
                }
            }
        }

        // Through the sender's own half: joined, and declined.
        for joins in [true, false] {
            let (mut a, mut b) = tokio::io::duplex(4096);
            let (r, c) = tokio::join!(
                accept_linked(&mut a, &s, None, admit, async |_: &LinkOffer| match joins {
                    true => LinkAnswer::Joined,
                    false => LinkAnswer::Declined,
                }),
                connect_linked(&mut b, &s, None, T, EP, Some(offer(LinkKind::Nccl)))
            );
            let want = joins.then_some(offer(LinkKind::Nccl));
            assert_eq!((r.unwrap().link(), c.unwrap().link()), (want, want));
        }

        // A pair offered again: taken, gone, or busy (which a fresh offer cannot be told).
        let again = LinkOffer {
            reuse: true,
            ..offer(LinkKind::Nccl)
        };
        for (o, said, want) in [
            (again, LinkAnswer::Joined, LinkAnswer::Joined),
            (again, LinkAnswer::Declined, LinkAnswer::Declined),
            (again, LinkAnswer::Busy, LinkAnswer::Busy),
            (
                offer(LinkKind::Nccl),
                LinkAnswer::Busy,
                LinkAnswer::Declined,
            ),
        ] {
            let (mut a, mut b) = tokio::io::duplex(4096);
            let mut seen = None;
            let (r, c) = tokio::join!(
                accept_linked(&mut a, &s, None, admit, async |o: &LinkOffer| {
                    seen = Some(o.reuse);
                    said
                }),
                connect_linked(&mut b, &s, None, T, EP, Some(o))
            );
            let (r, c) = (r.unwrap(), c.unwrap());
            assert_eq!(seen, Some(o.reuse));
            assert_eq!(
                (r.link_answer(), c.link_answer()),
                (want, want),
                "{o:?} {said:?}"
            );
            let joined = (want == LinkAnswer::Joined).then_some(o);
            assert_eq!((r.link(), c.link()), (joined, joined));
        }

        // A relay that rewrites the offered id: the receiver's MAC check fails.
        let (mut a, mut mid_a) = tokio::io::duplex(4096);
        let (mut mid_b, mut b) = tokio::io::duplex(4096);
        let relay = async {
            let mut first = vec![0u8; 6 + NONCE + 4];
            mid_a.read_exact(&mut first).await.unwrap();
            mid_b.write_all(&first).await.unwrap();
            let mut msg =
                vec![0u8; 6 + NONCE + 4 + 8 + 2 + EP.len() + 2 + LINK_ID + LINK_DEVICE + MAC];
            mid_b.read_exact(&mut msg).await.unwrap();
            msg[6 + NONCE + 4 + 8 + 2 + EP.len() + 2] ^= 1;
            mid_a.write_all(&msg).await.unwrap();
            let _ = tokio::io::copy_bidirectional(&mut mid_a, &mut mid_b).await;
        };
        let (r, _, _) = tokio::join!(
            async {
                let r = accept_linked(&mut a, &s, None, admit, async |_: &LinkOffer| {
                    LinkAnswer::Joined
                })
                .await;
                drop(a);
                r
            },
            async {
                let c = connect_linked(&mut b, &s, None, T, EP, Some(offer(LinkKind::Nccl))).await;
                drop(b);
                c
            },
            relay
        );
        assert!(matches!(r, Err(TransferError::Unauthenticated)), "{r:?}");
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(Secret::new("short").is_err());
        assert!(Secret::random().to_text().len() >= MIN_SECRET);
    }
}
