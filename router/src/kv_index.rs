//! Which block hashes one decode worker holds in its prefix cache, and in its disk tier, kept
//! current from the worker's KV-event stream: a snapshot, then events applied strictly in sequence order. A gap (a lost or
//! reordered event) makes the index unusable: the caller drops it and resubscribes for a fresh
//! snapshot, as DESIGN.md §4 says.

use std::collections::HashSet;

use tandem_model::BlockHash;
use tandem_proto::worker as pb;

/// A prompt's leading blocks a worker holds, by tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Matched {
    /// In its pool.
    pub pool: usize,
    /// In its disk tier (among or after the pooled ones).
    pub disk: usize,
}

impl Matched {
    /// Blocks the worker does not compute.
    pub fn blocks(&self) -> usize {
        self.pool + self.disk
    }
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV event gap: expected sequence {expected}, got {got}")]
pub struct Gap {
    pub expected: u64,
    pub got: u64,
}

#[derive(Debug, Default)]
pub struct KvIndex {
    hashes: HashSet<u64>,
    /// Blocks in the worker's disk tier (read back there, not computed).
    disk: HashSet<u64>,
    /// The next sequence number expected; `None` before the first snapshot.
    next_seq: Option<u64>,
}

impl KvIndex {
    /// Applies one message of the stream.
    pub fn apply(&mut self, batch: pb::KvEventBatch) -> Result<(), Gap> {
        if let Some(s) = batch.snapshot {
            self.hashes = s.block_hashes.into_iter().collect();
            self.disk = s.disk_block_hashes.into_iter().collect();
            self.next_seq = Some(s.next_seq);
        }
        for e in batch.events {
            let expected = self.next_seq.unwrap_or(e.seq);
            if e.seq != expected {
                self.clear();
                return Err(Gap {
                    expected,
                    got: e.seq,
                });
            }
            self.next_seq = Some(e.seq + 1);
            match e.kind {
                Some(pb::kv_event::Kind::Stored(s)) => self.hashes.extend(s.block_hashes),
                Some(pb::kv_event::Kind::Removed(r)) => {
                    for h in r.block_hashes {
                        self.hashes.remove(&h);
                    }
                }
                Some(pb::kv_event::Kind::DiskStored(s)) => self.disk.extend(s.block_hashes),
                Some(pb::kv_event::Kind::DiskRemoved(r)) => {
                    for h in r.block_hashes {
                        self.disk.remove(&h);
                    }
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Forgets everything (the stream ended: the worker may have restarted with an empty cache).
    pub fn clear(&mut self) {
        self.hashes.clear();
        self.disk.clear();
        self.next_seq = None;
    }

    /// How many of the prompt's leading blocks are cached here: in the pool, and past those
    /// (the worker reads a run of them back) in its disk tier. A block in both counts as pooled.
    pub fn matched_prefix(&self, prompt: &[BlockHash]) -> Matched {
        let mut m = Matched::default();
        for h in prompt {
            if self.hashes.contains(&h.0) {
                m.pool += 1;
            } else if self.disk.contains(&h.0) {
                m.disk += 1;
            } else {
                break;
            }
        }
        m
    }

    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// Blocks in the worker's disk tier.
    pub fn disk_len(&self) -> usize {
        self.disk.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(seq: u64, hashes: &[u64]) -> pb::KvEvent {
        pb::KvEvent {
            seq,
            kind: Some(pb::kv_event::Kind::Stored(pb::KvStored {
                parent_hash: None,
                block_hashes: hashes.to_vec(),
            })),
        }
    }

    #[test]
    fn snapshot_then_events_in_order() {
        let mut ix = KvIndex::default();
        ix.apply(pb::KvEventBatch {
            snapshot: Some(pb::KvSnapshot {
                next_seq: 5,
                block_hashes: vec![1, 2],
                disk_block_hashes: vec![],
            }),
            events: vec![stored(5, &[3])],
        })
        .unwrap();
        ix.apply(pb::KvEventBatch {
            snapshot: None,
            events: vec![pb::KvEvent {
                seq: 6,
                kind: Some(pb::kv_event::Kind::Removed(pb::KvRemoved {
                    block_hashes: vec![2],
                })),
            }],
        })
        .unwrap();
        let h = |v: &[u64]| v.iter().map(|&x| BlockHash(x)).collect::<Vec<_>>();
        assert_eq!(ix.matched_prefix(&h(&[1, 3, 2])).blocks(), 2);
        assert_eq!(ix.matched_prefix(&h(&[2, 1])).blocks(), 0);
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn the_disk_tier_extends_a_match_past_the_pool() {
        let mut ix = KvIndex::default();
        ix.apply(pb::KvEventBatch {
            snapshot: Some(pb::KvSnapshot {
                next_seq: 1,
                block_hashes: vec![1],
                disk_block_hashes: vec![2, 9],
            }),
            events: vec![pb::KvEvent {
                seq: 1,
                kind: Some(pb::kv_event::Kind::DiskStored(pb::KvStored {
                    parent_hash: None,
                    block_hashes: vec![3, 1],
                })),
            }],
        })
        .unwrap();
        let h = |v: &[u64]| v.iter().map(|&x| BlockHash(x)).collect::<Vec<_>>();
        // 1 pooled (and on disk: counted once, as pooled), 2 and 3 on disk, 4 nowhere.
        assert_eq!(
            ix.matched_prefix(&h(&[1, 2, 3, 4])),
            Matched { pool: 1, disk: 2 }
        );
        ix.apply(pb::KvEventBatch {
            snapshot: None,
            events: vec![pb::KvEvent {
                seq: 2,
                kind: Some(pb::kv_event::Kind::DiskRemoved(pb::KvRemoved {
                    block_hashes: vec![3],
                })),
            }],
        })
        .unwrap();
        assert_eq!(
            ix.matched_prefix(&h(&[1, 2, 3, 4])),
            Matched { pool: 1, disk: 1 }
        );
        assert_eq!(ix.matched_prefix(&h(&[9])), Matched { pool: 0, disk: 1 });
    }

    #[test]
    fn a_gap_clears_the_index_and_says_so() {
        let mut ix = KvIndex::default();
        ix.apply(pb::KvEventBatch {
            snapshot: Some(pb::KvSnapshot {
                next_seq: 1,
                block_hashes: vec![9],
                disk_block_hashes: vec![],
            }),
            events: vec![stored(1, &[10])],
        })
        .unwrap();
        let e = ix
            .apply(pb::KvEventBatch {
                snapshot: None,
                events: vec![stored(3, &[11])],
            })
            .unwrap_err();
        assert_eq!(
            e,
            Gap {
                expected: 2,
                got: 3
            }
        );
        assert!(ix.is_empty());
    }
}
