//! The KV pools as the destination of transfers: a [`BlockSink`] over the writers of every
//! tensor-parallel rank's pool, or over a device's pool through staging ([`KvTarget`],
//! [`KvSink`]), and the [`KvShape`] a worker describes its cache with.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tandem_engine::{BlockId, DeviceKv, DeviceSink, EngineHandle, KvPoolWriter};
use tandem_kv_transfer::{BlockSink, KvShape};

/// Where a worker's KV lives, as transfers reach it: its engine's host pools (each
/// tensor-parallel rank's writer with its KV heads) or a device's pool (a GPU's, through
/// page-locked staging).
#[derive(Clone)]
pub enum KvTarget {
    /// The host pools' writers, in rank order.
    Host(Vec<(Range<u32>, KvPoolWriter)>),
    /// A device's pool.
    Device(Arc<dyn DeviceKv>),
}

impl KvTarget {
    /// The engine's cache: its host pools if it has them, else its device's pool; None when
    /// transfers cannot reach it.
    pub fn of(engine: &EngineHandle) -> Option<Self> {
        let writers = engine.kv_writers();
        match (writers.is_empty(), engine.kv_device()) {
            (false, _) => Some(Self::Host(writers)),
            (true, Some(d)) => Some(Self::Device(d)),
            (true, None) => None,
        }
    }

    /// The cache as the KV handshake describes it, for a worker serving `model`.
    pub fn shape(&self, model: &str) -> Option<KvShape> {
        match self {
            Self::Host(w) => kv_shape(model, w),
            Self::Device(d) => {
                let f = d.format();
                let heads = f.layout.num_kv_heads as u32;
                Some(KvShape {
                    model: model.to_string(),
                    layers: f.layers as u32,
                    kv_heads: heads,
                    head_dim: f.layout.head_dim as u32,
                    block_size: f.layout.block_size as u32,
                    dtype: f.dtype_name().to_string(),
                    pieces: std::iter::once(0..heads).collect(),
                })
            }
        }
    }
}

/// A receiver's sink over a [`KvTarget`].
pub enum KvSink {
    /// Straight into the host pools.
    Pool(Arc<PoolSink>),
    /// Into a device's pool through staging slots.
    Device(Arc<DeviceSink>),
}

impl KvSink {
    /// The sink over `target`.
    ///
    /// # Safety
    /// As [`PoolSink::new`]: every block granted to a transfer with this sink must be left
    /// alone by the engine until that grant has ended, and no block may be granted to two
    /// transfers at once.
    pub unsafe fn new(target: KvTarget) -> Self {
        match target {
            // SAFETY: forwarded to the caller.
            KvTarget::Host(w) => Self::Pool(Arc::new(unsafe { PoolSink::new(w) })),
            // SAFETY: forwarded to the caller.
            KvTarget::Device(d) => Self::Device(Arc::new(unsafe { DeviceSink::new(d) })),
        }
    }

    /// The sink as grants take it.
    pub fn block_sink(&self) -> Arc<dyn BlockSink> {
        match self {
            Self::Pool(p) => p.clone(),
            Self::Device(d) => d.clone(),
        }
    }

    /// Bytes written into each tensor-parallel rank's pool so far, in rank order (one device
    /// pool: one rank).
    pub fn rank_bytes(&self) -> Vec<u64> {
        match self {
            Self::Pool(p) => p.rank_bytes(),
            Self::Device(d) => vec![d.bytes()],
        }
    }
}

/// The ranks (by number) whose pools hold one range of heads, and their writers.
type Replicas = Vec<(usize, KvPoolWriter)>;

/// Writes received frames straight into the engine's KV pools: one piece per distinct KV head
/// range of its ranks, written into every rank that holds it.
pub struct PoolSink {
    /// Per distinct head range, the ranks (by number) whose pools hold it.
    ranks: Vec<(Range<u32>, Replicas)>,
    /// Bytes written into each rank's pool.
    bytes: Vec<AtomicU64>,
}

impl PoolSink {
    /// A sink over `writers`: each rank's pool writer with its KV heads, as
    /// `EngineHandle::kv_writers` gives them.
    ///
    /// # Safety
    /// Every block granted to a transfer with this sink must be left alone by the engine (not
    /// read, written, freed or shared) until that grant has ended, and no block may be granted
    /// to two transfers at once: the receiver writes granted blocks from its own threads.
    pub unsafe fn new(writers: Vec<(Range<u32>, KvPoolWriter)>) -> Self {
        let bytes = writers.iter().map(|_| AtomicU64::new(0)).collect();
        let mut ranks: Vec<(Range<u32>, Replicas)> = Vec::new();
        for (rank, (heads, w)) in writers.into_iter().enumerate() {
            match ranks.iter_mut().find(|(h, _)| *h == heads) {
                Some((_, replicas)) => replicas.push((rank, w)),
                None => ranks.push((heads, vec![(rank, w)])),
            }
        }
        ranks.sort_by_key(|(h, _)| h.start);
        Self { ranks, bytes }
    }

    /// Bytes written into each tensor-parallel rank's pool so far, in rank order.
    pub fn rank_bytes(&self) -> Vec<u64> {
        self.bytes
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect()
    }
}

impl BlockSink for PoolSink {
    fn frame_len(&self) -> usize {
        self.ranks.iter().map(|(_, w)| w[0].1.frame_bytes()).sum()
    }

    fn layers(&self) -> u32 {
        self.ranks
            .first()
            .map_or(0, |(_, w)| w[0].1.num_layers() as u32)
    }

    fn write(&self, layer: u32, block: BlockId, payload: &[u8]) {
        // Whole-block frames reach only a sink of one range (the receiver's judge).
        self.write_piece(layer, block, 0, payload)
    }

    fn pieces(&self) -> Vec<Range<u32>> {
        self.ranks.iter().map(|(h, _)| h.clone()).collect()
    }

    fn piece_len(&self, piece: usize) -> usize {
        self.ranks[piece].1[0].1.frame_bytes()
    }

    fn write_piece(&self, layer: u32, block: BlockId, piece: usize, payload: &[u8]) {
        for (rank, w) in &self.ranks[piece].1 {
            self.bytes[*rank].fetch_add(payload.len() as u64, Ordering::Relaxed);
            // SAFETY: the receiver calls this only for blocks granted to a live transfer, after
            // checking layer, block, heads and length; `new`'s contract keeps the engine off them.
            if let Err(e) = unsafe { w.write(layer as usize, block.index(), payload) } {
                tracing::error!(error = %e, "KV frame passed the receiver's checks but not the pool's");
            }
        }
    }
}

/// The cache `writers` write into (every rank's, as `EngineHandle::kv_writers` gives them) of a
/// worker serving `model`, as its KV handshake describes it; None without a host cache.
pub fn kv_shape(model: &str, writers: &[(Range<u32>, KvPoolWriter)]) -> Option<KvShape> {
    let (_, first) = writers.first()?;
    let layout = first.layout();
    let mut pieces: Vec<Range<u32>> = Vec::new();
    for (h, _) in writers {
        if !pieces.contains(h) {
            pieces.push(h.clone());
        }
    }
    pieces.sort_by_key(|h| h.start);
    Some(KvShape {
        model: model.to_string(),
        layers: first.num_layers() as u32,
        kv_heads: pieces.iter().map(|h| h.end).max().unwrap_or(0),
        head_dim: layout.head_dim as u32,
        block_size: layout.block_size as u32,
        dtype: first.dtype().name().to_string(),
        pieces,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::{KvDtype, KvPool};
    use tandem_kernels::KvLayout;

    /// Four ranks over two KV heads (each head replicated on two ranks): the sink takes a
    /// frame per head and writes it into both ranks that hold it; a sender's shape and the
    /// sink agree on the ranges.
    #[test]
    fn replicated_heads_go_to_every_rank_that_holds_them() {
        let layout = KvLayout {
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let pools: Vec<KvPool> = (0..4)
            .map(|_| KvPool::new(layout, KvDtype::F32, 2, 3).unwrap())
            .collect();
        let heads = [0..1u32, 0..1, 1..2, 1..2];
        let writers = heads
            .iter()
            .zip(&pools)
            .map(|(h, p)| (h.clone(), p.writer()))
            .collect::<Vec<_>>();
        let shape = kv_shape("m", &writers).unwrap();
        assert_eq!(shape.pieces, [0..1, 1..2]);
        assert_eq!(shape.kv_heads, 2);
        // SAFETY: the pools belong to this test; nothing else touches them.
        let sink = unsafe { PoolSink::new(writers) };
        assert_eq!(sink.pieces(), shape.pieces);
        let frame = KvPool::frame_bytes(layout, KvDtype::F32);
        assert_eq!((sink.piece_len(1), shape.frame_len(1)), (frame, frame));
        let payload: Vec<u8> = (0..frame).map(|i| i as u8).collect();
        sink.write_piece(1, BlockId(2), 1, &payload);
        assert_eq!(sink.rank_bytes(), [0, 0, frame as u64, frame as u64]);
        let mut got = Vec::new();
        for (rank, pool) in pools.iter().enumerate() {
            pool.read_block(1, 2, &mut got);
            let want = if rank >= 2 {
                payload.clone()
            } else {
                vec![0; frame]
            };
            assert_eq!(got, want, "rank {rank}");
        }
    }
}
