//! tandem-kv-transfer: moving KV-cache blocks between workers.
//!
//! Owns: the versioned wire format ([`wire`], documented in docs/kv-wire.md: frames with
//! transfer id, layer, destination block, length and xxh3 checksum), peer authentication by
//! mutual challenge-response over a shared secret ([`auth`]), the sending seam [`KvTransport`]
//! with its TCP implementation ([`transport`]), a sender's chunk cut into the frames a receiver of
//! any tensor-parallel size takes ([`FramePlan`], rebuilding head ranges with [`regroup`]), and the receiving endpoint [`KvReceiver`] that
//! writes frames straight into the blocks granted to a transfer, enforces deadlines and counts
//! every rejected frame by reason ([`receiver`]), payload links beside a connection (NCCL between
//! GPUs, thread ranks in tests: [`link`]), and the disk tier that keeps blocks in files
//! keyed by their prefix hash, checksummed like frames ([`disk`]). Does not own the KV pool (tandem-engine; the
//! pool is reached through [`BlockSink`]) or the prefill/decode handshake (the workers).

#![deny(missing_docs)]

pub mod auth;
pub mod disk;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod link;
mod receiver;
mod regroup;
pub mod shape;
mod transport;
pub mod wire;
mod xxh3;

pub use auth::Secret;
pub use disk::{DiskError, DiskTier, DiskTierConfig, DiskTierStats};
#[cfg(feature = "fault-injection")]
pub use fault::WireFault;
pub use link::{LinkAnswer, LinkFabric, LinkKind, LinkOffer, NcclFabric, PairLink, ThreadFabric};
pub use receiver::{BlockSink, KvReceiver, Rejections, TransferGrant, TransferStats};
pub use regroup::{FramePlan, HeadsKv, OutgoingChunk};
pub use shape::{convert_values, regroup, Float, KvShape};
pub use tandem_types::BlockId;
pub use transport::{BlockFrame, KvStream, KvTransport, TcpTransport};

/// Why a KV transfer, or setting one up, failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The connection failed.
    #[error("kv transfer i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The connection's opening exchange went wrong (not a Tandem KV peer, a bad version).
    #[error("kv handshake: {0}")]
    Handshake(String),
    /// The peer could not show it holds the cluster's KV secret.
    #[error("the peer did not prove it holds the KV secret")]
    Unauthenticated,
    /// The two workers' caches cannot exchange blocks (another model, head size, block size or
    /// dtype); the text says what differs.
    #[error("kv caches do not map: {0}")]
    Mismatch(String),
    /// The receiver has no such transfer at the endpoint the sender dialed (never granted,
    /// already ended, or granted at another endpoint: a relayed handshake); the text says which.
    #[error("kv transfer not granted: {0}")]
    NotGranted(String),
    /// A frame header that does not decode.
    #[error("kv wire: {0}")]
    Wire(#[from] wire::WireError),
    /// The receiving sink could not store what arrived (a device copy failed); the text says
    /// why.
    #[error("kv blocks could not be stored: {0}")]
    Sink(String),
    /// The receiver refused a frame; the reason names the check.
    #[error("a frame was rejected ({0})")]
    Rejected(&'static str),
    /// The grant's deadline passed before the transfer ended.
    #[error("the transfer did not complete before its deadline")]
    Expired,
    /// The sender gave up on the transfer.
    #[error("the sender aborted the transfer")]
    Aborted,
    /// The sender ended the transfer before every granted block layer arrived.
    #[error("the sender ended the transfer with {missing} block layers missing")]
    Incomplete {
        /// Block layers granted and never received.
        missing: usize,
    },
    /// The receiver's holder revoked the grant (the request went away).
    #[error("the transfer was revoked")]
    Closed,
    /// A payload link between the two sides failed (its rank could not be built, a peer did
    /// not come within the watchdog, a message of another length); the text says which.
    #[error("kv payload link: {0}")]
    Link(String),
    /// The transfer's configuration is unusable (a bad secret, an unusable address).
    #[error("{0}")]
    Config(String),
}
