//! The KV pools as the destination of transfers: a [`BlockSink`] over the writers of every
//! tensor-parallel rank's pool, host or device (a GPU's, through staging) ([`KvTarget`],
//! [`KvSink`]), and the [`KvShape`] a worker describes its cache with.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tandem_engine::{BlockId, DevicePool, DeviceSink, EngineHandle, KvPoolWriter};
use tandem_kv_transfer::{BlockSink, KvShape};

/// Where a worker's KV lives, as transfers reach it: its engine's host pools (each
/// tensor-parallel rank's writer with its KV heads) or its devices' pools (each rank's GPU pool
/// with its KV heads, through page-locked staging).
#[derive(Clone)]
pub enum KvTarget {
    /// The host pools' writers, in rank order.
    Host(Vec<(Range<u32>, KvPoolWriter)>),
    /// The device pools, in rank order.
    Device(Vec<DevicePool>),
}

impl KvTarget {
    /// The engine's cache: its host pools if it has them, else its devices' pools; None when
    /// transfers cannot reach it.
    pub fn of(engine: &EngineHandle) -> Option<Self> {
        let writers = engine.kv_writers();
        let devices = engine.kv_devices();
        match (writers.is_empty(), devices.is_empty()) {
            (false, _) => Some(Self::Host(writers)),
            (true, false) => Some(Self::Device(devices)),
            (true, true) => None,
        }
    }

    /// The cache as the KV handshake describes it, for a worker serving `model`.
    pub fn shape(&self, model: &str) -> Option<KvShape> {
        match self {
            Self::Host(w) => kv_shape(model, w),
            Self::Device(d) => {
                let f = d.first()?.1.format();
                Some(shape_of(
                    model,
                    d.iter().map(|(h, _)| h),
                    f.layers,
                    (f.layout.head_dim, f.layout.block_size),
                    f.dtype_name(),
                ))
            }
        }
    }
}

/// A receiver's sink over a [`KvTarget`]: the frames of each distinct KV head range of its
/// ranks, written into every rank that holds it.
pub struct KvSink(Arc<PoolSink>);

impl KvSink {
    /// The sink over `target`.
    ///
    /// # Safety
    /// As [`PoolSink::new`]: every block granted to a transfer with this sink must be left
    /// alone by the engine until that grant has ended, and no block may be granted to two
    /// transfers at once.
    pub unsafe fn new(target: KvTarget) -> Self {
        Self(Arc::new(match target {
            // SAFETY: forwarded to the caller.
            KvTarget::Host(w) => unsafe { PoolSink::new(w) },
            // SAFETY: forwarded to the caller.
            KvTarget::Device(d) => unsafe { PoolSink::devices(d) },
        }))
    }

    /// The sink as grants take it.
    pub fn block_sink(&self) -> Arc<dyn BlockSink> {
        self.0.clone()
    }

    /// Bytes written into each tensor-parallel rank's pool so far, in rank order.
    pub fn rank_bytes(&self) -> Vec<u64> {
        self.0.rank_bytes()
    }
}

/// How one rank's pool is written: straight into host memory, or through a device's staging.
enum RankWriter {
    Host(KvPoolWriter),
    Device(DeviceSink),
}

impl RankWriter {
    fn frame_bytes(&self) -> usize {
        match self {
            Self::Host(w) => w.frame_bytes(),
            Self::Device(d) => d.format().frame_bytes(),
        }
    }

    fn num_layers(&self) -> usize {
        match self {
            Self::Host(w) => w.num_layers(),
            Self::Device(d) => d.format().layers,
        }
    }
}

/// The ranks (by number) whose pools hold one range of heads, and their writers.
type Replicas = Vec<(usize, RankWriter)>;

/// Writes received frames into the engine's KV pools, host or device: one piece per distinct KV
/// head range of its ranks, written into every rank that holds it.
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
        Self::over(
            writers
                .into_iter()
                .map(|(h, w)| (h, RankWriter::Host(w)))
                .collect(),
        )
    }

    /// A sink over each rank's device pool with its KV heads, as `EngineHandle::kv_devices`
    /// gives them: frames staged and uploaded, and waited for when a grant settles.
    ///
    /// # Safety
    /// As [`PoolSink::new`].
    pub unsafe fn devices(pools: Vec<DevicePool>) -> Self {
        Self::over(
            pools
                .into_iter()
                // SAFETY: forwarded to the caller.
                .map(|(h, d)| (h, RankWriter::Device(unsafe { DeviceSink::new(d) })))
                .collect(),
        )
    }

    fn over(writers: Vec<(Range<u32>, RankWriter)>) -> Self {
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
            match w {
                // SAFETY: the receiver calls this only for blocks granted to a live transfer,
                // after checking layer, block, heads and length; `new`'s contract keeps the
                // engine off them.
                RankWriter::Host(w) => {
                    if let Err(e) = unsafe { w.write(layer as usize, block.index(), payload) } {
                        tracing::error!(error = %e, "KV frame passed the receiver's checks but not the pool's");
                    }
                }
                // A frame that cannot be staged fails its block, reported when it settles.
                RankWriter::Device(d) => d.write(layer, block, payload),
            }
        }
    }

    fn settle(&self, blocks: &[BlockId]) -> Result<(), String> {
        // Every device's copies are waited for, even after one failed.
        let mut first = None;
        for (rank, w) in self.ranks.iter().flat_map(|(_, r)| r) {
            if let RankWriter::Device(d) = w {
                if let Err(e) = d.settle(blocks) {
                    first.get_or_insert(format!("rank {rank}'s device pool: {e}"));
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// The cache `writers` write into (every rank's, as `EngineHandle::kv_writers` gives them) of a
/// worker serving `model`, as its KV handshake describes it; None without a host cache.
pub fn kv_shape(model: &str, writers: &[(Range<u32>, KvPoolWriter)]) -> Option<KvShape> {
    let (_, first) = writers.first()?;
    Some(shape_of(
        model,
        writers.iter().map(|(h, _)| h),
        first.num_layers(),
        (first.layout().head_dim, first.layout().block_size),
        first.dtype().name(),
    ))
}

/// A cache of ranks holding `heads` each (replicas counted once), as the KV handshake
/// describes it.
fn shape_of<'a>(
    model: &str,
    heads: impl Iterator<Item = &'a Range<u32>>,
    layers: usize,
    (head_dim, block_size): (usize, usize),
    dtype: &str,
) -> KvShape {
    let mut pieces: Vec<Range<u32>> = Vec::new();
    for h in heads {
        if !pieces.contains(h) {
            pieces.push(h.clone());
        }
    }
    pieces.sort_by_key(|h| h.start);
    KvShape {
        model: model.to_string(),
        layers: layers as u32,
        kv_heads: pieces.iter().map(|h| h.end).max().unwrap_or(0),
        head_dim: head_dim as u32,
        block_size: block_size as u32,
        dtype: dtype.to_string(),
        pieces,
    }
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
