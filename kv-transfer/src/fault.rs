//! Damage on the wire, for tests (the `fault-injection` feature): a [`WireFault`] set on the TCP
//! transport ([`crate::TcpTransport::with_fault`]) flips a byte of one block frame's payload after
//! its header took the checksum, as a bad link or a bad NIC would. Everything else about the
//! transport (the handshake, sealing, batching) is the production path.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Which frame to damage. Clones share one count, over every stream the transport opens.
#[derive(Clone, Debug)]
pub struct WireFault {
    /// The block frame to damage, counted from 1.
    nth: usize,
    /// Block frames sent so far.
    seen: Arc<AtomicUsize>,
    /// Whether the damage was done.
    done: Arc<AtomicBool>,
}

impl WireFault {
    /// Flips a byte in the middle of the payload of the `nth` block frame sent (from 1).
    pub fn flip_block_frame(nth: usize) -> Self {
        Self {
            nth: nth.max(1),
            seen: Arc::default(),
            done: Arc::default(),
        }
    }

    /// Whether the damage was done (a frame with a payload was damaged).
    pub fn fired(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// Counts one block frame going out: its damaged payload if it is the one.
    pub(crate) fn damage(&self, payload: &[u8]) -> Option<Vec<u8>> {
        let n = self.seen.fetch_add(1, Ordering::SeqCst) + 1;
        (n == self.nth && !payload.is_empty()).then(|| {
            let mut body = payload.to_vec();
            let mid = body.len() / 2;
            body[mid] ^= 0x40;
            self.done.store(true, Ordering::SeqCst);
            body
        })
    }
}
