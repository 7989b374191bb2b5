//! The KV wire format, version 7 (docs/kv-wire.md is the reference; keep the two in step).
//!
//! After the handshake (see [`crate::auth`]) a connection carries frames, each a fixed 56-byte
//! little-endian header followed by the payload:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 2 | magic `0x4B54` ("TK") |
//! | 2 | 1 | kind: 1 block, 2 end of transfer, 3 abort, 4 trace context |
//! | 3 | 1 | flags: bit 0, the payload travels on the connection's payload link (other bits 0) |
//! | 4 | 4 | layer |
//! | 8 | 8 | transfer id |
//! | 16 | 4 | destination block id |
//! | 20 | 4 | payload length in bytes |
//! | 24 | 8 | xxh3-64 of the payload |
//! | 32 | 2 | first KV head of a block frame |
//! | 34 | 2 | KV heads of a block frame (0: every head of the block) |
//! | 36 | 4 | reserved, 0 |
//! | 40 | 16 | tag: HMAC-SHA256(session key, frame number u64 \| bytes 0..40), first 16 bytes |
//!
//! A block frame's payload is one layer of one destination block, of its KV heads
//! `first..first + heads`, exactly as a pool of those heads lays it out (K then V; for int8,
//! values then per-head scales): a receiver whose tensor-parallel ranks each hold some heads
//! takes a frame per rank's heads. End and abort frames carry no payload; their layer, block
//! and head fields are 0. A block frame flagged as on the link has its payload sent on the
//! connection's payload link ([`crate::link`]) instead of after its header: the header (its
//! length and checksum under the connection's tag) still comes over TCP, and the receiver takes
//! exactly that length from the link before it judges the frame.

use crate::xxh3::xxh3_64;

/// Protocol version spoken in the handshake.
pub const VERSION: u16 = 7;
/// First bytes of every handshake message.
pub const HELLO_MAGIC: [u8; 4] = *b"TKV1";
/// First bytes of every frame header.
pub const FRAME_MAGIC: u16 = 0x4B54;
/// Bytes of every frame header, its tag included.
pub const HEADER_LEN: usize = 56;
/// Where the header's tag starts: bytes before it are what the tag covers.
pub const TAG_AT: usize = 40;
/// Largest payload a receiver accepts before even looking at the transfer (a corrupt length
/// must not make it allocate gigabytes).
pub const MAX_PAYLOAD: u32 = 64 << 20;
/// Largest trace-context frame payload.
pub const MAX_CONTEXT: usize = 1024;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// One layer of one block; a payload follows.
    Block = 1,
    /// The sender has sent every frame of the transfer.
    End = 2,
    /// The sender gives the transfer up.
    Abort = 3,
    /// The trace context of the sender's transfer span, so the receiver's span joins the
    /// request's trace; optional, before the transfer's first block.
    Context = 4,
}

/// The fixed-size header in front of every frame (little-endian on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame is.
    pub kind: FrameKind,
    /// The layer a block frame carries (0 for control frames).
    pub layer: u32,
    /// The transfer the frame belongs to: the id of the receiver's grant.
    pub transfer: u64,
    /// The destination block of a block frame (0 for control frames).
    pub block: u32,
    /// Payload bytes after the header.
    pub len: u32,
    /// xxh3-64 of the payload.
    pub checksum: u64,
    /// The first KV head a block frame carries.
    pub head_start: u16,
    /// The KV heads a block frame carries (0: every head of the block).
    pub head_count: u16,
    /// The payload travels on the connection's payload link, not after the header (block
    /// frames of a connection whose handshake joined a link only).
    pub on_link: bool,
}

/// A header that does not decode.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The header does not start with the frame magic.
    #[error("bad frame magic {0:#06x}: not a Tandem KV stream or out of sync")]
    Magic(u16),
    /// The kind byte names no frame kind.
    #[error("unknown frame kind {0}")]
    Kind(u8),
    /// The payload length is over [`MAX_PAYLOAD`].
    #[error("payload of {0} bytes is over the {MAX_PAYLOAD}-byte limit")]
    TooLong(u32),
}

impl FrameHeader {
    /// The header of a block frame carrying `payload`.
    pub fn block(transfer: u64, layer: u32, block: u32, payload: &[u8]) -> Self {
        Self {
            kind: FrameKind::Block,
            layer,
            transfer,
            block,
            len: payload.len() as u32,
            checksum: checksum(payload),
            head_start: 0,
            head_count: 0,
            on_link: false,
        }
    }

    /// The same header, its payload sent on the connection's payload link.
    pub fn via_link(mut self) -> Self {
        self.on_link = true;
        self
    }

    /// The header of a block frame carrying KV heads `heads` (all of them when `heads` is
    /// `0..0`).
    pub fn heads(mut self, heads: std::ops::Range<u16>) -> Self {
        self.head_start = heads.start;
        self.head_count = heads.end - heads.start;
        self
    }

    /// The header of a control frame (end, abort, or trace context with `payload`).
    pub fn control(kind: FrameKind, transfer: u64, payload: &[u8]) -> Self {
        Self {
            kind,
            layer: 0,
            transfer,
            block: 0,
            len: payload.len() as u32,
            checksum: checksum(payload),
            head_start: 0,
            head_count: 0,
            on_link: false,
        }
    }

    /// The header's bytes, its tag zero ([`crate::auth::Session::seal`] writes it).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[2] = self.kind as u8;
        b[3] = self.on_link as u8;
        b[4..8].copy_from_slice(&self.layer.to_le_bytes());
        b[8..16].copy_from_slice(&self.transfer.to_le_bytes());
        b[16..20].copy_from_slice(&self.block.to_le_bytes());
        b[20..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.checksum.to_le_bytes());
        b[32..34].copy_from_slice(&self.head_start.to_le_bytes());
        b[34..36].copy_from_slice(&self.head_count.to_le_bytes());
        b
    }

    /// Reads a header, refusing a bad magic, kind or length.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, WireError> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let magic = u16_at(0);
        if magic != FRAME_MAGIC {
            return Err(WireError::Magic(magic));
        }
        let kind = match b[2] {
            1 => FrameKind::Block,
            2 => FrameKind::End,
            3 => FrameKind::Abort,
            4 => FrameKind::Context,
            k => return Err(WireError::Kind(k)),
        };
        let len = u32_at(20);
        if len > MAX_PAYLOAD {
            return Err(WireError::TooLong(len));
        }
        Ok(Self {
            kind,
            layer: u32_at(4),
            transfer: u64_at(8),
            block: u32_at(16),
            len,
            checksum: u64_at(24),
            head_start: u16_at(32),
            head_count: u16_at(34),
            on_link: b[3] & 1 == 1,
        })
    }
}

/// The frame checksum: xxh3-64 of the payload bytes.
pub fn checksum(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn headers_round_trip(kind in 1u8..=4, layer: u32, transfer: u64, block: u32,
                              len in 0u32..=MAX_PAYLOAD, sum: u64, head_start: u16, head_count: u16,
                        on_link: bool) {
            let h = FrameHeader {
                kind: match kind {
                    1 => FrameKind::Block,
                    2 => FrameKind::End,
                    3 => FrameKind::Abort,
                    _ => FrameKind::Context,
                },
                layer, transfer, block, len, checksum: sum, head_start, head_count, on_link,
            };
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let b: [u8; HEADER_LEN] = bytes.try_into().unwrap();
            let _ = FrameHeader::decode(&b);
        }
    }

    #[test]
    fn layout_is_the_documented_one() {
        let h = FrameHeader::block(0x0102030405060708, 7, 9, b"abc");
        let b = h.encode();
        assert_eq!(&b[0..2], &[0x54, 0x4B]);
        assert_eq!((b[2], b[3]), (1, 0));
        assert_eq!(h.via_link().encode()[3], 1);
        assert_eq!(&b[4..8], &7u32.to_le_bytes());
        assert_eq!(&b[8..16], &0x0102030405060708u64.to_le_bytes());
        assert_eq!(&b[16..20], &9u32.to_le_bytes());
        assert_eq!(&b[20..24], &3u32.to_le_bytes());
        assert_eq!(&b[24..32], &xxh3_64(b"abc").to_le_bytes());
        assert_eq!(&b[32..40], &[0u8; 8]);
        let h = h.heads(2..5).encode();
        assert_eq!(
            (&h[32..34], &h[34..36]),
            (&2u16.to_le_bytes()[..], &3u16.to_le_bytes()[..])
        );
        assert_eq!(&h[36..40], &[0u8; 4]);
        let mut bad = b;
        bad[20..24].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert_eq!(
            FrameHeader::decode(&bad),
            Err(WireError::TooLong(MAX_PAYLOAD + 1))
        );
        bad[0] = 0;
        assert!(matches!(
            FrameHeader::decode(&bad),
            Err(WireError::Magic(_))
        ));
    }
}
