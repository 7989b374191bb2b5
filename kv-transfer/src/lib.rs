//! tandem-kv-transfer: moving KV-cache blocks between workers.
//!
//! Owns: the versioned wire format ([`wire`], documented in docs/kv-wire.md: frames with
//! transfer id, layer, destination block, length and xxh3 checksum), peer authentication by
//! mutual challenge-response over a shared secret ([`auth`]), the sending seam [`KvTransport`]
//! with its TCP implementation ([`transport`]), and the receiving endpoint [`KvReceiver`] that
//! writes frames straight into the blocks granted to a transfer, enforces deadlines and counts
//! every rejected frame by reason ([`receiver`]). Does not own the KV pool (tandem-engine; the
//! pool is reached through [`BlockSink`]) or the prefill/decode handshake (the workers).

pub mod auth;
pub mod receiver;
pub mod transport;
pub mod wire;
pub mod xxh3;

pub use auth::Secret;
pub use receiver::{BlockSink, KvReceiver, Rejections, TransferGrant, TransferStats};
pub use tandem_types::BlockId;
pub use transport::{BlockFrame, KvStream, KvTransport, TcpTransport};

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("kv transfer i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("kv handshake: {0}")]
    Handshake(String),
    #[error("the peer did not prove it holds the KV secret")]
    Unauthenticated,
    #[error("kv wire: {0}")]
    Wire(#[from] wire::WireError),
    #[error("a frame was rejected ({0})")]
    Rejected(&'static str),
    #[error("the transfer did not complete before its deadline")]
    Expired,
    #[error("the sender aborted the transfer")]
    Aborted,
    #[error("the sender ended the transfer with {missing} block layers missing")]
    Incomplete { missing: usize },
    #[error("the transfer was revoked")]
    Closed,
    #[error("{0}")]
    Config(String),
}
