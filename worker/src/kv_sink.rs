//! The KV pool as the destination of transfers: a [`BlockSink`] over a [`KvPoolWriter`].

use tandem_engine::{BlockId, KvPoolWriter};
use tandem_kv_transfer::BlockSink;

/// Writes received frames straight into the engine's KV pool.
pub struct PoolSink {
    writer: KvPoolWriter,
}

impl PoolSink {
    /// # Safety
    /// Every block granted to a transfer with this sink must be left alone by the engine (not
    /// read, written, freed or shared) until that grant has ended, and no block may be granted
    /// to two transfers at once: the receiver writes granted blocks from its own threads.
    pub unsafe fn new(writer: KvPoolWriter) -> Self {
        Self { writer }
    }
}

impl BlockSink for PoolSink {
    fn frame_len(&self) -> usize {
        self.writer.frame_bytes()
    }

    fn layers(&self) -> u32 {
        self.writer.num_layers() as u32
    }

    fn write(&self, layer: u32, block: BlockId, payload: &[u8]) {
        // SAFETY: the receiver calls this only for blocks granted to a live transfer, after
        // checking layer, block and length; `new`'s contract keeps the engine off them.
        if let Err(e) = unsafe { self.writer.write(layer as usize, block.index(), payload) } {
            tracing::error!(error = %e, "KV frame passed the receiver's checks but not the pool's");
        }
    }
}
