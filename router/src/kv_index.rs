//! Which block hashes one decode worker holds in its prefix cache, kept current from the worker's
//! KV-event stream: a snapshot, then events applied strictly in sequence order. A gap (a lost or
//! reordered event) makes the index unusable: the caller drops it and resubscribes for a fresh
//! snapshot, as DESIGN.md §4 says.

use std::collections::HashSet;

use tandem_model::BlockHash;
use tandem_proto::worker as pb;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV event gap: expected sequence {expected}, got {got}")]
pub struct Gap {
    pub expected: u64,
    pub got: u64,
}

#[derive(Debug, Default)]
pub struct KvIndex {
    hashes: HashSet<u64>,
    /// The next sequence number expected; `None` before the first snapshot.
    next_seq: Option<u64>,
}

impl KvIndex {
    /// Applies one message of the stream.
    pub fn apply(&mut self, batch: pb::KvEventBatch) -> Result<(), Gap> {
        if let Some(s) = batch.snapshot {
            self.hashes = s.block_hashes.into_iter().collect();
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
                None => {}
            }
        }
        Ok(())
    }

    /// Forgets everything (the stream ended: the worker may have restarted with an empty cache).
    pub fn clear(&mut self) {
        self.hashes.clear();
        self.next_seq = None;
    }

    /// How many of the prompt's leading blocks are cached here.
    pub fn matched_prefix(&self, prompt: &[BlockHash]) -> usize {
        prompt
            .iter()
            .take_while(|h| self.hashes.contains(&h.0))
            .count()
    }

    pub fn len(&self) -> usize {
        self.hashes.len()
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
        assert_eq!(ix.matched_prefix(&h(&[1, 3, 2])), 2);
        assert_eq!(ix.matched_prefix(&h(&[2, 1])), 0);
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn a_gap_clears_the_index_and_says_so() {
        let mut ix = KvIndex::default();
        ix.apply(pb::KvEventBatch {
            snapshot: Some(pb::KvSnapshot {
                next_seq: 1,
                block_hashes: vec![9],
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
