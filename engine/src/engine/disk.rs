//! The disk tier under the prefix cache (`EngineConfig::kv_disk`): cached blocks the pool
//! evicts are copied out and written to disk behind the engine's back, and a new request whose
//! prefix is on disk has those blocks read back into the pool before it is scheduled, instead
//! of computing them again.
//!
//! - **Spill.** The block manager records each cached block it evicts ([`BlockManager::
//!   take_spilled`]); before anything writes a block allocated since (the step's forward and
//!   copies, a transfer into reserved blocks, a block read back), the engine copies the evicted
//!   blocks' contents out of every rank's pool and queues them for the tier's writer thread.
//!   A block the tier holds (or queues) already is not copied again. The copy is a memory copy
//!   on the engine thread; the write never is.
//! - **Read back.** A request's chained block hashes are looked up when it arrives: past the
//!   blocks the pool holds, the run of blocks the tier holds is read on the tier's reader
//!   thread, and the request waits aside (not in the queue: it does not hold up the requests
//!   behind it) until they have arrived or failed, or `max_wait` has passed. Each block read
//!   back is written into a block of the pool and cached under its hash (the pool's most
//!   recently used), where admission finds it as it finds any cached prefix: the same bits as
//!   the block that was spilled, so the request's tokens are the ones recompute would give.
//! - **Failures.** A block that fails its checksum is removed from the tier and counted there;
//!   the request computes it (and everything after it) as if it had not been on disk.
//!
//! [`BlockManager::take_spilled`]: crate::block_manager::BlockManager::take_spilled

use std::collections::HashSet;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use tandem_kv_transfer::disk::Loaded;
use tandem_kv_transfer::{DiskTier, DiskTierConfig};
use tandem_model::hash::{block_hashes_from, BlockHash};

use super::{Engine, KvDiskConfig, Seq};
use crate::backend::{Backend, RankPool};
use crate::error::EngineError;
use crate::kv_cache::KvPool;

/// The engine's side of its disk tier.
pub(super) struct Disk {
    tier: DiskTier,
    config: KvDiskConfig,
    tx: mpsc::Sender<Loaded>,
    rx: mpsc::Receiver<Loaded>,
    /// Called after each block read back (the engine's loop may be waiting for commands).
    wake: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Blocks being read.
    inflight: HashSet<u64>,
    /// Blocks read back and not yet in the pool, in arrival order.
    staged: Vec<(u64, Vec<u8>)>,
    /// Bytes of one block's payload (every rank's heads, every layer).
    payload_len: usize,
    /// What the event stream has said the tier holds (its snapshot's disk hashes).
    reported: HashSet<u64>,
    pub(super) stats: DiskCounts,
}

/// What the engine did with its disk tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiskCounts {
    /// Evicted blocks copied out and queued for writing.
    pub spilled: u64,
    /// Evicted blocks the tier's queue had no room for.
    pub spill_dropped: u64,
    /// Blocks read back into the pool.
    pub promoted: u64,
    /// Blocks that failed to read back (corrupt or gone): computed instead.
    pub load_failures: u64,
    /// Requests that stopped waiting for their blocks at `max_wait`.
    pub wait_expired: u64,
}

impl Disk {
    /// Opens the tier for an engine over `backend`'s host pools.
    pub(super) fn open(
        config: &KvDiskConfig,
        backend: &dyn Backend,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        let pools = backend.host_pools();
        if pools.is_empty() {
            return Err(EngineError::Unsupported(format!(
                "a KV disk tier needs a host KV cache: a {} cache is not supported",
                backend.device()
            )));
        }
        let pieces = pieces(&pools);
        let payload_len = pieces
            .iter()
            .map(|rp| rp.pool.num_layers * KvPool::frame_bytes(rp.pool.layout, rp.pool.dtype))
            .sum();
        // Blocks are interchangeable between engines that agree on all of this.
        let what = format!(
            "tandem kv disk v1|{}|block {block_size}|{}|{:?}",
            config.identity,
            backend.kv_dtype_name(),
            pieces
                .iter()
                .map(|rp| (rp.heads.clone(), rp.pool.num_layers, rp.pool.layout))
                .collect::<Vec<_>>()
        );
        let fingerprint = xxhash_rust::xxh3::xxh3_64(what.as_bytes());
        let mut tc = DiskTierConfig::new(&config.dir, config.capacity_bytes, fingerprint);
        tc.max_pending_bytes = config.max_pending_bytes;
        tc.rescan = config.rescan;
        let tier = DiskTier::open(tc).map_err(|e| {
            EngineError::Config(format!("the KV disk tier at {}: {e}", config.dir.display()))
        })?;
        let (tx, rx) = mpsc::channel();
        let reported = tier.hashes().into_iter().collect();
        Ok(Self {
            reported,
            tier,
            config: config.clone(),
            tx,
            rx,
            wake: None,
            inflight: HashSet::new(),
            staged: Vec::new(),
            payload_len,
            stats: DiskCounts::default(),
        })
    }

    /// The tier itself (its counters, and for tests its files).
    pub(super) fn tier(&self) -> &DiskTier {
        &self.tier
    }
}

/// Every distinct head range's pool, in rank order (a replicated range once): the pieces a
/// block's payload is made of.
fn pieces<'a>(pools: &[RankPool<'a>]) -> Vec<RankPool<'a>> {
    let mut out: Vec<RankPool<'a>> = Vec::new();
    for rp in pools {
        if !out.iter().any(|p| p.heads == rp.heads) {
            out.push(RankPool {
                heads: rp.heads.clone(),
                pool: rp.pool,
            });
        }
    }
    out
}

impl Engine {
    /// Sets what the disk tier calls after each block it reads back (the engine's loop waits
    /// for commands when only such reads are outstanding).
    pub fn set_disk_wake(&mut self, wake: Arc<dyn Fn() + Send + Sync>) {
        if let Some(d) = &mut self.disk {
            d.tier.set_notify(wake.clone());
            d.wake = Some(wake);
        }
    }

    /// The blocks the event stream says the disk tier holds, sorted (for a subscriber's
    /// snapshot; empty without a tier).
    pub fn disk_hashes(&self) -> Vec<BlockHash> {
        let mut h: Vec<BlockHash> = self
            .disk
            .iter()
            .flat_map(|d| d.reported.iter().map(|&h| BlockHash(h)))
            .collect();
        h.sort();
        h
    }

    /// The disk tier, if the engine has one.
    pub fn disk_tier(&self) -> Option<&DiskTier> {
        self.disk.as_ref().map(Disk::tier)
    }

    /// Whether the only work is requests waiting for blocks from disk: nothing to step until a
    /// read arrives (or the oldest wait runs out, at the returned instant).
    pub fn waits_on_disk_only(&self) -> Option<Instant> {
        let d = self.disk.as_ref()?;
        let idle = self.waiting.is_empty()
            && self.running.is_empty()
            && self.cancelled.is_empty()
            && self.stopped.is_empty();
        if !idle || self.loading.is_empty() {
            return None;
        }
        self.loading
            .iter()
            .map(|s| s.submitted + d.config.max_wait)
            .min()
    }

    /// A new request's way into the queue: straight in, or aside while the blocks of its
    /// prefix that the disk tier holds are read back.
    pub(super) fn enqueue(&mut self, mut s: Seq) {
        let bs = self.config.block_size;
        let Some(d) = self.disk.as_mut().filter(|_| self.config.prefix_caching) else {
            self.queue_back(s);
            return;
        };
        // The blocks admission could take over (it leaves the last token to compute).
        let full = s.tokens.len().saturating_sub(1) / bs;
        let mut want = Vec::new();
        for h in block_hashes_from(s.blocks.root(), &s.tokens[..full * bs], bs) {
            if self.blocks.holds(h) {
                continue;
            }
            if d.inflight.contains(&h.0) || d.staged.iter().any(|(x, _)| *x == h.0) {
                s.awaits.push(h.0);
                continue;
            }
            if !d.tier.contains(h.0) {
                break;
            }
            want.push(h.0);
            s.awaits.push(h.0);
        }
        if !want.is_empty() {
            d.inflight.extend(&want);
            d.tier.load(want, d.tx.clone(), d.wake.clone());
        }
        if s.awaits.is_empty() {
            self.queue_back(s);
        } else {
            self.loading.push(s);
        }
    }

    /// Before a step is scheduled: takes the blocks read back since the last step into the
    /// pool, and moves the requests whose reads are done (or waited `max_wait`) to the queue.
    pub(super) fn disk_turn(&mut self) -> Result<(), EngineError> {
        let Some(d) = self.disk.as_mut() else {
            return Ok(());
        };
        // What the tier wrote or lost since: events for the router's index.
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        for (h, present) in d.tier.take_changes() {
            if present && d.reported.insert(h) {
                stored.push(BlockHash(h));
            } else if !present && d.reported.remove(&h) {
                removed.push(BlockHash(h));
            }
        }
        self.blocks.emit_disk(true, stored);
        self.blocks.emit_disk(false, removed);
        while let Ok((hash, got)) = d.rx.try_recv() {
            d.inflight.remove(&hash);
            match got {
                Ok(payload) if payload.len() == d.payload_len => d.staged.push((hash, payload)),
                Ok(payload) => {
                    tracing::warn!(
                        hash = format!("{hash:016x}"),
                        bytes = payload.len(),
                        expected = d.payload_len,
                        "a KV block from disk has the wrong size: computed instead"
                    );
                    d.stats.load_failures += 1;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "a KV block was not read back: computed instead");
                    d.stats.load_failures += 1;
                }
            }
        }
        let staged = std::mem::take(&mut d.staged);
        let mut kept = Vec::new();
        for (hash, payload) in staged {
            let Some(b) = self.blocks.adopt(BlockHash(hash)) else {
                // Held already (computed meanwhile), or the pool has no block to give: the
                // request computes it.
                if !self.blocks.holds(BlockHash(hash)) {
                    kept.push((hash, payload));
                }
                continue;
            };
            // What the block held goes to disk before its new contents overwrite it.
            self.spill();
            let pools = self.backend.host_pools();
            let mut at = 0;
            for piece in pieces(&pools) {
                let frame = KvPool::frame_bytes(piece.pool.layout, piece.pool.dtype);
                for rp in pools.iter().filter(|rp| rp.heads == piece.heads) {
                    let w = rp.pool.writer();
                    for layer in 0..rp.pool.num_layers {
                        let bytes = &payload[at + layer * frame..at + (layer + 1) * frame];
                        // SAFETY: the block was just taken from the pool for these contents;
                        // nothing reads or writes it until this engine thread schedules it.
                        unsafe { w.write(layer, b.0 as usize, bytes) }
                            .map_err(EngineError::Step)?;
                    }
                }
                at += piece.pool.num_layers * frame;
            }
            let d = self.disk.as_mut().expect("checked above");
            d.stats.promoted += 1;
        }
        let d = self.disk.as_mut().expect("checked above");
        // A block the pool had no room for waits for the next step, as long as a request
        // waits for it.
        let wanted: HashSet<u64> = self
            .loading
            .iter()
            .flat_map(|s| s.awaits.iter().copied())
            .collect();
        kept.retain(|(h, _)| wanted.contains(h));
        d.staged = kept;
        let now = Instant::now();
        let (inflight, staged) = (&d.inflight, &d.staged);
        let mut ready = Vec::new();
        let mut i = 0;
        while i < self.loading.len() {
            let s = &mut self.loading[i];
            s.awaits
                .retain(|h| inflight.contains(h) || staged.iter().any(|(x, _)| x == h));
            let expired = now >= s.submitted + d.config.max_wait;
            if s.awaits.is_empty() || expired {
                if !s.awaits.is_empty() {
                    d.stats.wait_expired += 1;
                    s.awaits.clear();
                }
                ready.push(self.loading.remove(i));
            } else {
                i += 1;
            }
        }
        for s in ready {
            self.queue_back(s);
        }
        Ok(())
    }

    /// Copies the blocks the pool evicted since the last call out of every rank's pool and
    /// queues them for the disk tier, before anything writes them again.
    pub(super) fn spill(&mut self) {
        let Some(d) = self.disk.as_mut() else {
            return;
        };
        let evicted = self.blocks.take_spilled();
        if evicted.is_empty() {
            return;
        }
        let pools = self.backend.host_pools();
        let pieces = pieces(&pools);
        for (hash, b) in evicted {
            if d.tier.has_or_queued(hash.0) {
                continue;
            }
            let mut payload = Vec::with_capacity(d.payload_len);
            for rp in &pieces {
                for layer in 0..rp.pool.num_layers {
                    rp.pool.append_block(layer, b.0 as usize, &mut payload);
                }
            }
            if d.tier.put(hash.0, payload) {
                d.stats.spilled += 1;
            } else if !d.tier.has_or_queued(hash.0) {
                d.stats.spill_dropped += 1;
            }
        }
    }
}
