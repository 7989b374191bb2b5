//! The block manager: who owns which KV block, and which blocks hold a reusable prefix.
//!
//! Every block is in exactly one of three states:
//! - **free**: on the free list, holding nothing anyone wants;
//! - **used**: referenced by one or more sequences (`ref_count > 0`);
//! - **cached**: unreferenced, but holding a full block whose chained hash is in the prefix cache,
//!   kept in LRU order so a later request with the same prefix can take it back instead of
//!   recomputing it. Cached blocks are evicted (oldest first) only when the free list is empty.
//!
//! A full block gets its hash when its last token's K/V has been computed ([`SeqBlocks::commit`]);
//! from then on it can be shared. Every change to the set of cached hashes is recorded as a
//! [`KvEvent`] with a per-worker sequence number, for the router's index of who caches what.
//!
//! Sequences hold their blocks through [`SeqBlocks`], which releases them on drop, so a finished,
//! failed, cancelled or preempted sequence can never leak a block.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use tandem_model::hash::{hash_block, BlockHash, ROOT};

pub use tandem_types::BlockId;

/// A change to the set of blocks this worker caches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    /// Per-worker, starting at 1, no gaps: a consumer that sees a gap must ask for a snapshot.
    pub seq: u64,
    /// What changed.
    pub kind: KvEventKind,
}

/// What a [`KvEvent`] reports: hashes newly cached, or hashes dropped from the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEventKind {
    /// These block hashes are now cached here; `parent` is the hash of the block before the first
    /// one (`None` at the start of a sequence).
    Stored {
        /// Hash of the block before `hashes[0]` in its sequence; `None` when it is the first.
        parent: Option<BlockHash>,
        /// The chained hashes now cached, in sequence order.
        hashes: Vec<BlockHash>,
    },
    /// These block hashes are no longer cached here.
    Removed {
        /// The chained hashes evicted.
        hashes: Vec<BlockHash>,
    },
    /// These block hashes are now in this worker's disk tier (read back instead of computed:
    /// dearer than the pool, cheaper than recompute).
    DiskStored {
        /// The chained hashes written.
        hashes: Vec<BlockHash>,
    },
    /// These block hashes are no longer in this worker's disk tier.
    DiskRemoved {
        /// The chained hashes gone.
        hashes: Vec<BlockHash>,
    },
}

/// Counts of blocks by state. `free + cached + used == total` always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCounts {
    /// Blocks in the pool.
    pub total: usize,
    /// Blocks on the free list, holding nothing.
    pub free: usize,
    /// Unreferenced, holding a cached prefix block (evictable).
    pub cached: usize,
    /// Referenced by at least one sequence.
    pub used: usize,
}

#[derive(Debug)]
struct Inner {
    ref_count: Vec<u32>,
    /// The hash a block is cached under, if it is the cache's block for that hash.
    hash: Vec<Option<BlockHash>>,
    free: Vec<BlockId>,
    by_hash: HashMap<BlockHash, BlockId>,
    /// Unreferenced cached blocks by the tick they were released at (oldest first).
    lru: BTreeMap<u64, BlockId>,
    lru_tick: Vec<u64>,
    tick: u64,
    events: Vec<KvEvent>,
    next_event: u64,
    used: usize,
    /// Whether evicted blocks are recorded in `spilled` (a disk tier keeps them).
    spill: bool,
    /// Cached blocks evicted since the last [`BlockManager::take_spilled`], with their hashes:
    /// their contents are intact until something writes the block again.
    spilled: Vec<(BlockHash, BlockId)>,
    /// Handed-off sequences' last, partly filled blocks ([`SeqBlocks::park_tail`]), each held
    /// by one reference of its own.
    tails: Vec<Tail>,
}

/// A handed-off sequence: the whole blocks whose chained hash is `parent` ([`ROOT`] for none),
/// then its partly filled last block holding the K/V of `tokens` (no block when it ended on a
/// whole block). A sequence whose tokens continue that prefix takes the block instead of
/// computing them ([`SeqBlocks::reuse_prefix_and_tail`]); it is shared, so whoever writes it
/// first gets a copy of their own.
#[derive(Debug)]
struct Tail {
    parent: BlockHash,
    tokens: Vec<u32>,
    block: Option<BlockId>,
    /// Times a sequence took it.
    taken: u32,
}

impl Inner {
    fn emit(&mut self, kind: KvEventKind) {
        self.next_event += 1;
        self.events.push(KvEvent {
            seq: self.next_event,
            kind,
        });
    }

    fn take_ref(&mut self, b: BlockId) {
        let i = b.0 as usize;
        if self.ref_count[i] == 0 {
            self.lru.remove(&self.lru_tick[i]);
            self.used += 1;
        }
        self.ref_count[i] += 1;
    }

    fn release(&mut self, b: BlockId) {
        let i = b.0 as usize;
        assert!(self.ref_count[i] > 0, "block {} released twice", b.0);
        self.ref_count[i] -= 1;
        if self.ref_count[i] > 0 {
            return;
        }
        self.used -= 1;
        if self.hash[i].is_some() {
            self.tick += 1;
            self.lru_tick[i] = self.tick;
            self.lru.insert(self.tick, b);
        } else {
            self.free.push(b);
        }
    }

    /// Takes `n` blocks (ref count 1), evicting the least recently used cached blocks when the free
    /// list runs out; `None`, with nothing taken, when even that is not enough.
    fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.free.len() + self.lru.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        let mut evicted = Vec::new();
        while out.len() < n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = self.lru.pop_first().expect("counted above");
                    let h = self.hash[b.0 as usize]
                        .take()
                        .expect("cached blocks have a hash");
                    self.by_hash.remove(&h);
                    evicted.push(h);
                    if self.spill {
                        self.spilled.push((h, b));
                    }
                    b
                }
            };
            self.ref_count[b.0 as usize] = 1;
            self.used += 1;
            out.push(b);
        }
        if !evicted.is_empty() {
            self.emit(KvEventKind::Removed { hashes: evicted });
        }
        Some(out)
    }
}

/// The block pool of one worker. Single-threaded: it lives on the engine thread; clones share it.
#[derive(Clone, Debug)]
pub struct BlockManager {
    inner: Rc<RefCell<Inner>>,
    block_size: usize,
}

impl BlockManager {
    /// A pool of `total` blocks of `block_size` tokens each, all free. Panics if `block_size` is 0.
    pub fn new(total: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self {
            inner: Rc::new(RefCell::new(Inner {
                ref_count: vec![0; total],
                hash: vec![None; total],
                // Low ids first (popped from the back).
                free: (0..total as u32).rev().map(BlockId).collect(),
                by_hash: HashMap::new(),
                lru: BTreeMap::new(),
                lru_tick: vec![0; total],
                tick: 0,
                events: Vec::new(),
                next_event: 0,
                used: 0,
                spill: false,
                spilled: Vec::new(),
                tails: Vec::new(),
            })),
            block_size,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// How many blocks are free, cached and used now.
    pub fn counts(&self) -> BlockCounts {
        let s = self.inner.borrow();
        BlockCounts {
            total: s.ref_count.len(),
            free: s.free.len(),
            cached: s.lru.len(),
            used: s.used,
        }
    }

    /// Blocks an allocation could get now (free plus evictable).
    pub fn available(&self) -> usize {
        let s = self.inner.borrow();
        s.free.len() + s.lru.len()
    }

    /// Reference count of a block (for tests and invariant checks).
    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.inner.borrow().ref_count[b.0 as usize]
    }

    /// Events since the last call, in order.
    pub fn drain_events(&self) -> Vec<KvEvent> {
        std::mem::take(&mut self.inner.borrow_mut().events)
    }

    /// Records a change of the disk tier's contents in the event stream, numbered with the
    /// pool's own changes (nothing for an empty list).
    pub fn emit_disk(&self, stored: bool, hashes: Vec<BlockHash>) {
        if hashes.is_empty() {
            return;
        }
        let kind = if stored {
            KvEventKind::DiskStored { hashes }
        } else {
            KvEventKind::DiskRemoved { hashes }
        };
        self.inner.borrow_mut().emit(kind);
    }

    /// Every hash cached now, for a snapshot after an event gap, with the last event's number.
    pub fn snapshot(&self) -> (u64, Vec<BlockHash>) {
        let s = self.inner.borrow();
        let mut h: Vec<BlockHash> = s.by_hash.keys().copied().collect();
        h.sort();
        (s.next_event, h)
    }

    /// Evicts every unreferenced cached block (blocks in use keep their hashes).
    pub fn clear_cache(&self) {
        let mut s = self.inner.borrow_mut();
        let mut removed = Vec::new();
        while let Some((_, b)) = s.lru.pop_first() {
            let h = s.hash[b.0 as usize]
                .take()
                .expect("cached blocks have a hash");
            s.by_hash.remove(&h);
            removed.push(h);
            if s.spill {
                s.spilled.push((h, b));
            }
            s.free.push(b);
        }
        if !removed.is_empty() {
            s.emit(KvEventKind::Removed { hashes: removed });
        }
    }

    /// Handed-off sequences parked ([`SeqBlocks::park_tail`]) and how many of them a sequence
    /// that continues them has taken.
    pub fn tails(&self) -> (usize, usize) {
        let s = self.inner.borrow();
        (
            s.tails.len(),
            s.tails.iter().filter(|t| t.taken > 0).count(),
        )
    }

    /// Lets every parked tail go (its block returns to the pool unless a sequence holds it).
    pub fn release_tails(&self) {
        let mut s = self.inner.borrow_mut();
        for t in std::mem::take(&mut s.tails) {
            if let Some(b) = t.block {
                s.release(b);
            }
        }
    }

    /// Records every cached block evicted from now on (or not), for [`Self::take_spilled`].
    pub fn set_spill(&self, on: bool) {
        self.inner.borrow_mut().spill = on;
    }

    /// The cached blocks evicted since the last call, oldest first, with their hashes. Their
    /// contents stay as they were until the block is written again: the caller copies them out
    /// before anything writes a block it allocated since.
    pub fn take_spilled(&self) -> Vec<(BlockHash, BlockId)> {
        std::mem::take(&mut self.inner.borrow_mut().spilled)
    }

    /// Whether a block holding `hash` is in the pool (cached or in use).
    pub fn holds(&self, hash: BlockHash) -> bool {
        self.inner.borrow().by_hash.contains_key(&hash)
    }

    /// Takes a block for contents that come from elsewhere (a disk tier) and caches it under
    /// `hash` at once, unreferenced and the most recently used: the caller writes its contents
    /// before anything reads it (after copying out what [`Self::take_spilled`] says was
    /// evicted for it). `None` when the pool holds `hash` already or has no block to give.
    pub fn adopt(&self, hash: BlockHash) -> Option<BlockId> {
        let mut s = self.inner.borrow_mut();
        if s.by_hash.contains_key(&hash) {
            return None;
        }
        let b = s.allocate(1)?[0];
        s.hash[b.0 as usize] = Some(hash);
        s.by_hash.insert(hash, b);
        // Released at once: cached, at the young end of the LRU order.
        s.release(b);
        s.emit(KvEventKind::Stored {
            parent: None,
            hashes: vec![hash],
        });
        Some(b)
    }

    /// An empty block table for a new sequence.
    pub fn sequence(&self) -> SeqBlocks {
        self.sequence_from(ROOT)
    }

    /// An empty block table for a new sequence whose hash chain starts from `root`
    /// ([`tandem_model::chain_root`]: a LoRA adapter's sequences share blocks only with each
    /// other).
    pub fn sequence_from(&self, root: BlockHash) -> SeqBlocks {
        SeqBlocks {
            mgr: self.clone(),
            blocks: Vec::new(),
            hashes: Vec::new(),
            root,
        }
    }
}

/// No block is free or evictable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolFull;

/// The blocks of one sequence, in logical order, and the chained hashes of its full, computed
/// blocks. Dropping it releases every block.
#[derive(Debug)]
pub struct SeqBlocks {
    mgr: BlockManager,
    blocks: Vec<u32>,
    /// Hash of logical block i, for the committed (full and computed) blocks.
    hashes: Vec<BlockHash>,
    /// The parent of its first block.
    root: BlockHash,
}

impl SeqBlocks {
    /// The parent of its first block ([`BlockManager::sequence_from`]).
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// Physical block ids in logical order (the block table).
    pub fn ids(&self) -> &[u32] {
        &self.blocks
    }

    /// Blocks in the table.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the table holds no blocks.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Takes over the longest run of cached blocks that starts this sequence's `tokens`, leaving
    /// at least one token to compute (its logits are needed). Only for an empty table. Returns
    /// the number of tokens whose K/V is now in place (whole blocks).
    pub fn reuse_prefix(&mut self, tokens: &[u32]) -> usize {
        assert!(
            self.blocks.is_empty(),
            "prefix reuse on a sequence that has blocks"
        );
        let bs = self.mgr.block_size;
        let full = tokens.len().saturating_sub(1) / bs;
        let mut s = self.mgr.inner.borrow_mut();
        let mut parent = self.root;
        for chunk in tokens.chunks_exact(bs).take(full) {
            let h = hash_block(parent, chunk);
            let Some(&b) = s.by_hash.get(&h) else { break };
            s.take_ref(b);
            self.blocks.push(b.0);
            self.hashes.push(h);
            parent = h;
        }
        self.blocks.len() * bs
    }

    /// [`Self::reuse_prefix`], then, after the whole blocks, the parked tail ([`Self::park_tail`])
    /// that holds the most of the tokens that follow them (still leaving one to compute): its
    /// block is shared, so the caller makes it writable ([`Self::make_writable`]) before the
    /// step that writes it. A tail whose every token this sequence continues counts as taken
    /// (its sequence was pulled). Returns the tokens whose K/V is now in place.
    pub fn reuse_prefix_and_tail(&mut self, tokens: &[u32]) -> usize {
        let whole = self.reuse_prefix(tokens);
        let limit = tokens.len().saturating_sub(1);
        let parent = self.hashes.last().copied().unwrap_or(self.root);
        let rest = &tokens[whole.min(limit)..limit];
        let mut s = self.mgr.inner.borrow_mut();
        let best = s
            .tails
            .iter()
            .enumerate()
            .filter(|(_, t)| t.parent == parent)
            .map(|(i, t)| {
                let n = t
                    .tokens
                    .iter()
                    .zip(rest)
                    .take_while(|(a, b)| a == b)
                    .count();
                (n, i)
            })
            .max();
        let Some((n, i)) = best else {
            return whole;
        };
        let t = &mut s.tails[i];
        // Taken: this sequence continues all of it, or is all of it up to its own end (a
        // caller that heard of fewer of its tokens).
        if n == t.tokens.len() || n == rest.len() {
            t.taken += 1;
        }
        let Some(b) = t.block.filter(|_| n > 0) else {
            return whole;
        };
        s.take_ref(b);
        self.blocks.push(b.0);
        whole + n
    }

    /// Keeps a record of this sequence for a sequence that continues its tokens on another
    /// worker and pulls their K/V from here ([`Self::reuse_prefix_and_tail`]): its whole blocks
    /// are committed (cached as any are) and its last, partly filled block is kept (one
    /// reference of its own, until [`BlockManager::release_tails`]) with the tokens of
    /// `tokens[..computed]` it holds. False when nothing is computed.
    pub fn park_tail(&mut self, tokens: &[u32], computed: usize) -> bool {
        self.commit(tokens, computed);
        let bs = self.mgr.block_size;
        let whole = computed / bs;
        if computed == 0 || self.hashes.len() != whole {
            return false;
        }
        let block = self
            .blocks
            .get(whole)
            .filter(|_| !computed.is_multiple_of(bs))
            .map(|&b| BlockId(b));
        let parent = self.hashes.last().copied().unwrap_or(self.root);
        let mut s = self.mgr.inner.borrow_mut();
        if let Some(b) = block {
            s.take_ref(b);
        }
        s.tails.push(Tail {
            parent,
            tokens: tokens[whole * bs..computed].to_vec(),
            block,
            taken: 0,
        });
        true
    }

    /// Grows the table to hold `tokens` tokens; false, with nothing taken, if the pool is short.
    pub fn reserve(&mut self, tokens: usize) -> bool {
        let need = tokens.div_ceil(self.mgr.block_size);
        if need <= self.blocks.len() {
            return true;
        }
        match self
            .mgr
            .inner
            .borrow_mut()
            .allocate(need - self.blocks.len())
        {
            Some(more) => {
                self.blocks.extend(more.iter().map(|b| b.0));
                true
            }
            None => false,
        }
    }

    /// Records that the K/V of `tokens[..computed]` is in place: every block that is now full gets
    /// its chained hash and enters the prefix cache (unless another block already holds that
    /// prefix, in which case this one stays private and is freed, not cached, when released).
    pub fn commit(&mut self, tokens: &[u32], computed: usize) {
        let bs = self.mgr.block_size;
        let full = (computed / bs).min(self.blocks.len());
        if full <= self.hashes.len() {
            return;
        }
        let mut s = self.mgr.inner.borrow_mut();
        let first = self.hashes.len();
        let parent = self.hashes.last().copied();
        let mut stored = Vec::new();
        for i in first..full {
            let h = hash_block(
                self.hashes.last().copied().unwrap_or(self.root),
                &tokens[i * bs..(i + 1) * bs],
            );
            self.hashes.push(h);
            let b = self.blocks[i];
            if s.hash[b as usize].is_none() && !s.by_hash.contains_key(&h) {
                s.hash[b as usize] = Some(h);
                s.by_hash.insert(h, BlockId(b));
                stored.push(h);
            }
        }
        if !stored.is_empty() {
            // Blocks already cached by someone else are skipped, so a stored run may not start
            // right after `parent`; consumers treat `parent` as a hint, the hashes as the facts.
            s.emit(KvEventKind::Stored {
                parent: if first == 0 { None } else { parent },
                hashes: stored,
            });
        }
    }

    /// A second table over the same blocks (each one's reference count goes up by one): a
    /// parallel sample of the same prompt. Neither may write a shared block: before writing at a
    /// position, each calls [`Self::make_writable`], which gives it a copy of its own.
    pub fn fork(&self) -> SeqBlocks {
        let mut s = self.mgr.inner.borrow_mut();
        for &b in &self.blocks {
            s.take_ref(BlockId(b));
        }
        SeqBlocks {
            mgr: self.mgr.clone(),
            blocks: self.blocks.clone(),
            hashes: self.hashes.clone(),
            root: self.root,
        }
    }

    /// Copy-on-write: makes the block that holds token `pos` this sequence's alone before it is
    /// written. When another sequence shares it (a [`fork`](Self::fork)), a fresh block takes its
    /// place in this table and `Ok(Some((shared, fresh)))` says what the caller must copy before
    /// anything writes either; `Ok(None)` when it is this sequence's already (or `pos` is past the
    /// table); `Err(PoolFull)`, with nothing changed, when no block is left for the copy.
    pub fn make_writable(&mut self, pos: usize) -> Result<Option<(BlockId, BlockId)>, PoolFull> {
        let i = pos / self.mgr.block_size;
        let Some(&b) = self.blocks.get(i) else {
            return Ok(None);
        };
        let mut s = self.mgr.inner.borrow_mut();
        if s.ref_count[b as usize] <= 1 {
            return Ok(None);
        }
        let fresh = s.allocate(1).ok_or(PoolFull)?[0];
        s.release(BlockId(b));
        self.blocks[i] = fresh.0;
        Ok(Some((BlockId(b), fresh)))
    }

    /// Releases the blocks past those that hold `tokens` tokens (a speculative step reserved
    /// them for proposed tokens that were rejected). Only uncommitted blocks can go: the
    /// committed ones hold computed tokens.
    pub fn truncate(&mut self, tokens: usize) {
        let keep = tokens.div_ceil(self.mgr.block_size);
        assert!(
            keep >= self.hashes.len(),
            "truncating committed blocks ({} kept of {} committed)",
            keep,
            self.hashes.len()
        );
        if keep >= self.blocks.len() {
            return;
        }
        let mut s = self.mgr.inner.borrow_mut();
        for b in self.blocks.drain(keep..) {
            s.release(BlockId(b));
        }
    }

    /// Releases every block (the table is empty afterwards), as dropping would.
    pub fn clear(&mut self) {
        let mut s = self.mgr.inner.borrow_mut();
        for b in self.blocks.drain(..) {
            s.release(BlockId(b));
        }
        self.hashes.clear();
    }
}

impl Drop for SeqBlocks {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(m: &BlockManager) {
        let c = m.counts();
        assert_eq!(c.free + c.cached + c.used, c.total, "{c:?}");
        let s = m.inner.borrow();
        let referenced = s.ref_count.iter().filter(|&&r| r > 0).count();
        assert_eq!(referenced, c.used);
        for (h, b) in &s.by_hash {
            assert_eq!(s.hash[b.0 as usize], Some(*h));
        }
        for b in s.lru.values() {
            assert_eq!(s.ref_count[b.0 as usize], 0);
            assert!(s.hash[b.0 as usize].is_some());
        }
        for b in &s.free {
            assert_eq!(s.ref_count[b.0 as usize], 0);
            assert!(s.hash[b.0 as usize].is_none());
        }
    }

    /// A handed-off sequence's partly filled block outlives it and serves the sequence that
    /// continues its tokens (shared, copied before it is written); one that diverges inside
    /// it takes as much as matches; releasing the tails frees the block.
    #[test]
    fn a_parked_tail_serves_the_sequence_that_continues_it() {
        let m = BlockManager::new(8, 4);
        let toks: Vec<u32> = (1..=11).collect();
        let mut a = m.sequence();
        assert!(a.reserve(11));
        // Ten tokens computed: blocks 0-1 whole, block 2 holds two.
        assert!(a.park_tail(&toks, 10));
        let tail = a.ids()[2];
        drop(a);
        check(&m);
        assert_eq!(m.counts().used, 1, "only the tail stays referenced");
        assert_eq!(m.tails(), (1, 0));
        // The same tokens and one more: all ten in place, the eleventh to compute.
        let mut b = m.sequence();
        assert_eq!(b.reuse_prefix_and_tail(&toks), 10);
        assert_eq!(b.ids()[2], tail);
        assert_eq!(m.tails(), (1, 1));
        // Writing position 10 copies the shared block first.
        let (shared, fresh) = b.make_writable(10).unwrap().expect("a copy");
        assert_eq!(shared.0, tail);
        assert_ne!(fresh.0, tail);
        // Whole-block reuse alone stops at the blocks.
        let mut c = m.sequence();
        assert_eq!(c.reuse_prefix(&toks), 8);
        c.clear();
        // Diverging after one token of the tail: one token reused.
        let mut d = m.sequence();
        let other = [1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 100];
        assert_eq!(d.reuse_prefix_and_tail(&other), 9);
        // A caller that heard of fewer of its tokens takes what it knows of and counts as its
        // pull.
        let mut short = m.sequence();
        assert_eq!(short.reuse_prefix_and_tail(&toks[..10]), 9);
        assert_eq!(m.tails(), (1, 1));
        drop(short);
        // Another prefix before it: the tail is not theirs.
        let mut e = m.sequence();
        let moved = [7, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11];
        assert_eq!(e.reuse_prefix_and_tail(&moved), 0);
        // Ending on a whole block: a record and no block, taken by the sequence that goes on
        // from there.
        let mut f = m.sequence();
        assert!(f.reserve(8));
        assert!(f.park_tail(&toks[..8], 8));
        drop(f);
        assert_eq!(m.tails(), (2, 1));
        let mut g = m.sequence();
        assert_eq!(g.reuse_prefix_and_tail(&toks[..9]), 8);
        assert_eq!(g.ids().len(), 2);
        assert_eq!(m.tails(), (2, 2));
        // Nothing computed: nothing to park.
        assert!(!m.sequence().park_tail(&toks, 0));
        drop((b, d, e, g));
        m.release_tails();
        check(&m);
        assert_eq!(m.tails(), (0, 0));
        assert_eq!(m.counts().used, 0);
    }

    #[test]
    fn prefix_is_reused_and_evicted_last() {
        let m = BlockManager::new(4, 2);
        let toks = [1, 2, 3, 4, 5];
        let mut a = m.sequence();
        assert_eq!(a.reuse_prefix(&toks), 0);
        assert!(a.reserve(5));
        a.commit(&toks, 5);
        let ids = a.ids().to_vec();
        assert_eq!(m.counts().used, 3);
        let ev = m.drain_events();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].seq, 1);
        let expect = tandem_model::hash::block_hashes(&toks, 2);
        assert_eq!(
            ev[0].kind,
            KvEventKind::Stored {
                parent: None,
                hashes: expect.clone()
            }
        );
        drop(a);
        assert_eq!(
            m.counts(),
            BlockCounts {
                total: 4,
                free: 2,
                cached: 2,
                used: 0
            }
        );
        // Same prefix: both full blocks come back, the partial third is computed.
        let mut b = m.sequence();
        assert_eq!(b.reuse_prefix(&toks), 4);
        assert_eq!(b.ids(), &ids[..2]);
        assert_eq!(m.ref_count(BlockId(ids[0])), 1);
        // Exactly two full blocks: the last one is recomputed so its logits exist.
        let mut c = m.sequence();
        assert_eq!(c.reuse_prefix(&toks[..4]), 2);
        assert_eq!(m.ref_count(BlockId(ids[0])), 2);
        drop(b);
        drop(c);
        // Allocation uses free blocks before evicting cached ones, then evicts oldest first.
        let mut d = m.sequence();
        assert!(d.reserve(4));
        assert_eq!(m.counts().cached, 2);
        assert!(d.reserve(6));
        assert_eq!(m.counts().cached, 1);
        let ev = m.drain_events();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].seq, 2);
        assert_eq!(
            ev[0].kind,
            KvEventKind::Removed {
                hashes: vec![expect[1]]
            }
        );
        assert!(!d.reserve(12), "more than the pool");
        assert_eq!(d.len(), 3, "a failed reserve takes nothing");
        check(&m);
        m.clear_cache();
        assert_eq!(m.counts().cached, 0);
        assert_eq!(m.counts().free, 1);
        assert_eq!(
            m.drain_events()[0].kind,
            KvEventKind::Removed {
                hashes: vec![expect[0]]
            }
        );
        check(&m);
    }

    #[test]
    fn duplicate_prefix_computed_twice_is_cached_once() {
        let m = BlockManager::new(4, 2);
        let toks = [7, 8, 9];
        let (mut a, mut b) = (m.sequence(), m.sequence());
        assert!(a.reserve(3) && b.reserve(3));
        a.commit(&toks, 3);
        b.commit(&toks, 3);
        assert_eq!(m.snapshot().1.len(), 1);
        drop(a);
        drop(b);
        assert_eq!(m.counts().cached, 1);
        assert_eq!(m.counts().free, 3);
        check(&m);
    }

    #[test]
    fn a_fork_shares_every_block_and_copies_the_tail_it_writes() {
        let m = BlockManager::new(6, 4);
        let toks = [1, 2, 3, 4, 5, 6];
        let mut a = m.sequence();
        assert!(a.reserve(6));
        a.commit(&toks, 6);
        let mut b = a.fork();
        let mut c = a.fork();
        assert_eq!(b.ids(), a.ids());
        // Two blocks, each held three times: the prompt counted once in the pool.
        assert_eq!(m.counts().used, 2);
        assert_eq!(m.ref_count(BlockId(a.ids()[1])), 3);
        check(&m);
        // The full first block is never written again; the partial tail is, at position 6.
        let (tail, full) = (a.ids()[1], a.ids()[0]);
        let Ok(Some((from, to))) = b.make_writable(6) else {
            panic!("a shared tail is copied")
        };
        assert_eq!(from, BlockId(tail));
        assert_ne!(to, BlockId(tail));
        assert_eq!(b.ids(), &[full, to.0]);
        assert_eq!(m.ref_count(BlockId(tail)), 2);
        assert_eq!(b.make_writable(6), Ok(None), "now its own");
        let Ok(Some(_)) = c.make_writable(7) else {
            panic!("still shared with a")
        };
        // The last holder writes in place.
        assert_eq!(a.make_writable(6), Ok(None));
        assert_eq!(m.ref_count(BlockId(tail)), 1);
        assert_eq!(m.ref_count(BlockId(full)), 3);
        assert_eq!(m.counts().used, 4);
        check(&m);
        // Two blocks left: a fork of a fork that must copy while the pool is empty fails cleanly.
        let mut d = b.fork();
        let mut e = m.sequence();
        assert!(e.reserve(8));
        assert_eq!(m.available(), 0);
        let before = d.ids().to_vec();
        assert_eq!(d.make_writable(6), Err(PoolFull));
        assert_eq!(d.ids(), &before[..]);
        drop((a, b, c, d, e));
        let counts = m.counts();
        assert_eq!(counts.used, 0);
        assert_eq!(counts.free + counts.cached, 6);
        check(&m);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Start { seq: usize, len: usize, vocab: u32 },
        Grow { seq: usize, by: usize },
        Drop { seq: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..6, 1usize..20, 1u32..3).prop_map(|(seq, len, vocab)| Op::Start {
                seq,
                len,
                vocab
            }),
            (0usize..6, 1usize..6).prop_map(|(seq, by)| Op::Grow { seq, by }),
            (0usize..6).prop_map(|seq| Op::Drop { seq }),
        ]
    }

    proptest! {
        /// Random sequences over a small pool (tiny vocabularies make shared prefixes common):
        /// the three states always add up, ref counts match holders, events are numbered without
        /// gaps and replaying them gives the cached set.
        #[test]
        fn invariants_hold(ops in prop::collection::vec(op(), 1..80)) {
            let m = BlockManager::new(12, 2);
            let mut seqs: Vec<Option<(SeqBlocks, Vec<u32>, usize)>> = (0..6).map(|_| None).collect();
            let mut replay = std::collections::HashSet::new();
            let mut last_event = 0;
            for o in ops {
                match o {
                    Op::Start { seq, len, vocab } => {
                        let toks: Vec<u32> = (0..len as u32).map(|i| i % vocab).collect();
                        let mut s = m.sequence();
                        let reused = s.reuse_prefix(&toks);
                        prop_assert!(reused < len && reused.is_multiple_of(2));
                        if s.reserve(len) {
                            s.commit(&toks, len);
                            seqs[seq] = Some((s, toks, len));
                        } else {
                            seqs[seq] = None;
                        }
                    }
                    Op::Grow { seq, by } => {
                        if let Some((s, toks, n)) = seqs[seq].as_mut() {
                            let want = *n + by;
                            if s.reserve(want) {
                                toks.extend((0..by as u32).map(|i| i % 2));
                                *n = want;
                                s.commit(toks, want);
                            }
                        }
                    }
                    Op::Drop { seq } => seqs[seq] = None,
                }
                check(&m);
                let held: usize = seqs.iter().flatten().map(|(s, _, _)| s.len()).sum();
                prop_assert!(m.counts().used <= held);
                for e in m.drain_events() {
                    prop_assert_eq!(e.seq, last_event + 1);
                    last_event = e.seq;
                    match e.kind {
                        KvEventKind::Stored { hashes, .. } => {
                            for h in hashes { prop_assert!(replay.insert(h)); }
                        }
                        KvEventKind::Removed { hashes } => {
                            for h in hashes { prop_assert!(replay.remove(&h)); }
                        }
                        KvEventKind::DiskStored { .. } | KvEventKind::DiskRemoved { .. } => {
                            prop_assert!(false, "no disk tier here");
                        }
                    }
                }
                let mut r: Vec<_> = replay.iter().copied().collect();
                r.sort();
                prop_assert_eq!(m.snapshot(), (last_event, r));
            }
            seqs.clear();
            let c = m.counts();
            prop_assert_eq!(c.used, 0);
            prop_assert_eq!(c.free + c.cached, 12);
        }
    }
}
