//! Identities that cross crates: a KV block.

use std::fmt;

/// A block of a worker's KV pool: its index in the pool. The engine's block manager hands them
/// out; a decode worker grants them to a KV transfer, which writes each layer of each block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index in the pool.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}
