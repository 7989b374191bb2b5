//! A draft model: a second, smaller model with the target's tokenizer that proposes each
//! decoding sequence's next tokens greedily (`--speculative draft:PATH`).
//!
//! It runs on the worker beside the target over a paged KV pool of its own: each sequence it
//! drafts for holds a block table in that pool and the tokens whose K/V the table holds
//! (`fed`). Before a sequence drafts, the longest prefix of `fed` that its tokens still start
//! with is kept and the rest is fed again (catch-up): the prompt the first time (after a local
//! prefill, a remote one, a migration or a preemption alike: the draft's K/V is computed where
//! the sequence decodes, never sent: it is a small model's prefill, and the prefill worker
//! need not load the draft nor the wire carry a second cache), then each step the tokens the
//! verification emitted past what the draft had fed. A proposal the target rejected is undone
//! by that prefix alone: nothing is written back.
//!
//! The pool is private: no prefix sharing, no copy-on-write, no disk tier. It has as many
//! blocks as the target's pool; where it runs out (sequences sharing a cached prefix in the
//! target hold it once there, here once each), the state of a sequence that does not draft in
//! the step is evicted, least recently used first, and failing that the sequence does not
//! draft. A sequence that left the engine (finished, cancelled, exported) gives its blocks
//! back at the next step.

use std::collections::{HashMap, HashSet};

use super::RequestId;
use crate::backend::{Backend, PoolSize};
use crate::device::cpu::{CpuBackend, CpuModel, WeightFormat};
use crate::error::EngineError;
use crate::forward::SeqBatch;
use crate::kv_cache::KvDtype;

/// A sequence's key: its request and sample.
pub(super) type Key = (RequestId, u32);

/// One sequence's state in the draft pool.
#[derive(Default)]
struct DraftSeq {
    /// Its blocks in the draft pool, in logical order (possibly more than `fed` fills).
    table: Vec<u32>,
    /// The tokens whose K/V the table holds, in order.
    fed: Vec<u32>,
    /// How many of `fed` are known to be the sequence's own tokens (they were its tokens when
    /// it last resumed, and its tokens only grow): the common prefix is looked for past them,
    /// so a step compares the tokens fed since, not the whole context.
    sure: usize,
    /// The step it last drafted in (eviction takes the least recent).
    used: u64,
}

/// The draft model, its pool and the sequences' states in it.
pub(super) struct Drafter {
    backend: Box<dyn Backend>,
    block_size: usize,
    free: Vec<u32>,
    seqs: HashMap<Key, DraftSeq>,
    step: u64,
}

impl Drafter {
    /// The draft model in `path` over a pool of `blocks` blocks of `block_size` tokens, its
    /// cache of `kv_dtype`; it must share the target's vocabulary (`vocab` ids).
    pub(super) fn load(
        path: &std::path::Path,
        (vocab, blocks, block_size, kv_dtype): (usize, usize, usize, KvDtype),
    ) -> Result<Self, EngineError> {
        let what = |e: &dyn std::fmt::Display| {
            EngineError::Config(format!("--speculative draft:{}: {e}", path.display()))
        };
        let loaded = tandem_model::load(path).map_err(|e| what(&e))?;
        let model = CpuModel::new(&loaded, WeightFormat::Native).map_err(|e| what(&e))?;
        let pool = PoolSize {
            block_size,
            kv_cache_mb: 0,
            num_blocks: Some(blocks),
            kv_dtype,
            gpu_memory_fraction: None,
        };
        let backend = CpuBackend::new(model, &pool).map_err(|e| what(&e))?;
        Self::new(Box::new(backend), vocab, block_size).map_err(|e| what(&e))
    }

    /// Drafts with `backend` (its pool's blocks of `block_size` tokens), for a target of `vocab`
    /// token ids.
    pub(super) fn new(
        backend: Box<dyn Backend>,
        vocab: usize,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        let v = backend.config().vocab_size;
        if v != vocab {
            return Err(EngineError::Config(format!(
                "the draft model has {v} token ids, the target {vocab}: a draft must share the target's tokenizer"
            )));
        }
        let blocks = backend.num_blocks() as u32;
        Ok(Self {
            block_size,
            free: (0..blocks).rev().collect(),
            backend,
            seqs: HashMap::new(),
            step: 0,
        })
    }

    /// Bytes of weights one draft forward reads.
    pub(super) fn weight_bytes(&self) -> usize {
        self.backend.weight_bytes()
    }

    /// Blocks of the draft pool no sequence holds, and all of them.
    #[cfg(test)]
    pub(super) fn blocks(&self) -> (usize, usize) {
        (self.free.len(), self.backend.num_blocks())
    }

    /// Starts a step: the states of sequences not in `live` give their blocks back.
    pub(super) fn begin_step(&mut self, live: &HashSet<Key>) {
        self.step += 1;
        let gone: Vec<Key> = self
            .seqs
            .keys()
            .filter(|k| !live.contains(k))
            .copied()
            .collect();
        for k in gone {
            self.evict(&k);
        }
    }

    /// A sequence left the engine: its state gives its blocks back.
    pub(super) fn release(&mut self, key: &Key) {
        self.evict(key);
    }

    fn evict(&mut self, key: &Key) {
        if let Some(s) = self.seqs.remove(key) {
            self.free.extend(s.table);
        }
    }

    /// Where the draft's K/V for a sequence holding `tokens` ends: the longest prefix of what
    /// it fed that `tokens` still starts with, short of the last token (which is fed again for
    /// its logits). The state is kept from eviction in this step.
    pub(super) fn resume(&mut self, key: Key, tokens: &[u32]) -> usize {
        let keep = self.kept(&key, tokens);
        let step = self.step;
        let s = self.seqs.entry(key).or_default();
        s.used = step;
        s.fed.truncate(keep);
        s.sure = keep;
        keep
    }

    /// Where [`Drafter::resume`] would find the draft's K/V for the sequence ending, changing
    /// nothing.
    pub(super) fn kept(&self, key: &Key, tokens: &[u32]) -> usize {
        self.seqs.get(key).map_or(0, |s| {
            let sure = s.sure.min(tokens.len());
            let more = s.fed[sure..]
                .iter()
                .zip(&tokens[sure..])
                .take_while(|(a, b)| a == b)
                .count();
            (sure + more).min(tokens.len().saturating_sub(1))
        })
    }

    /// Gives a sequence blocks for `tokens` tokens, evicting the least recently used states
    /// that do not draft in this step when the pool is out; false if that is not enough.
    pub(super) fn reserve(&mut self, key: Key, tokens: usize) -> bool {
        let need = tokens.div_ceil(self.block_size);
        loop {
            let have = self.seqs.get(&key).map_or(0, |s| s.table.len());
            if have >= need {
                return true;
            }
            if let Some(b) = self.free.pop() {
                self.seqs.entry(key).or_default().table.push(b);
                continue;
            }
            let victim = self
                .seqs
                .iter()
                .filter(|(k, s)| **k != key && s.used < self.step && !s.table.is_empty())
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| *k);
            match victim {
                Some(v) => self.evict(&v),
                None => return false,
            }
        }
    }

    /// One packed forward of the draft: each row `(sequence, new tokens, wants logits)` feeds
    /// its tokens after what the sequence fed; the logits (vocab each) of the last new token of
    /// those that want them, in order.
    pub(super) fn forward(
        &mut self,
        rows: &[(Key, &[u32], bool)],
    ) -> Result<Vec<f32>, EngineError> {
        let batch: Vec<SeqBatch<'_>> = rows
            .iter()
            .map(|(key, tokens, logits)| {
                let s = &self.seqs[key];
                SeqBatch {
                    tokens,
                    cached: s.fed.len(),
                    block_table: &s.table,
                    logits: usize::from(*logits),
                    lora: None,
                }
            })
            .collect();
        let out = self.backend.forward(&batch)?;
        drop(batch);
        for (key, tokens, _) in rows {
            self.seqs
                .get_mut(key)
                .expect("a row's state")
                .fed
                .extend_from_slice(tokens);
        }
        Ok(out)
    }

    /// Tokens the sequence's state has fed (a test's view).
    #[cfg(test)]
    pub(super) fn fed(&self, key: &Key) -> Option<&[u32]> {
        self.seqs.get(key).map(|s| s.fed.as_slice())
    }
}

impl super::Engine {
    /// Drafts `keep[i]` tokens for each running sequence with the draft model: a first forward
    /// feeds each drafting sequence's tokens past what its draft state holds (its last token
    /// at least) and takes the logits of the last, then forward after forward each sequence
    /// that drafts further feeds its latest proposed token, greedily. A sequence whose
    /// catch-up does not fit the step's token budget feeds what fits and drafts from a later
    /// step; one the draft pool cannot hold does not draft.
    pub(super) fn draft_model(&mut self, mut keep: Vec<usize>) -> Result<(), EngineError> {
        let typical = self.spec.as_ref().and_then(|s| s.typical_output);
        let Some(d) = self.spec.as_mut().and_then(|s| s.drafter.as_mut()) else {
            return Ok(());
        };
        let live: HashSet<Key> = self
            .running
            .iter()
            .chain(&self.waiting)
            .map(|s| (s.id, s.index))
            .collect();
        d.begin_step(&live);
        let mut budget = self.config.max_batched_tokens;
        // (running index, first token to feed, tokens fed, drafts)
        let mut plan: Vec<(usize, usize, usize, bool)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if keep[i] == 0 {
                continue;
            }
            let key = (s.id, s.index);
            let from = d.resume(key, &s.tokens);
            let need = s.tokens.len() - from;
            let take = need.min(budget);
            let drafts = take == need;
            let end = match drafts {
                true => s.tokens.len() + keep[i] - 1,
                false => from + take,
            };
            if take == 0 || !d.reserve(key, end) {
                keep[i] = 0;
                continue;
            }
            budget -= take;
            // Every token fed but a drafting sequence's last catches up.
            self.stats.spec.draft_prefill_tokens += (take - usize::from(drafts)) as u64;
            if !drafts {
                keep[i] = 0;
            }
            plan.push((i, from, from + take, drafts));
        }
        let vocab = self.backend.config().vocab_size;
        let max_ctx = self.backend.config().max_position_embeddings;
        let mut catch_up = 0.0;
        let mut last: Vec<u32> = vec![0; self.running.len()];
        let most = keep.iter().copied().max().unwrap_or(0);
        for p in 0..most.max(usize::from(!plan.is_empty())) {
            let t0 = std::time::Instant::now();
            let mut keys = 0u64;
            let mut rows: Vec<(Key, &[u32], bool)> = Vec::new();
            let mut drafting = Vec::new();
            if p == 0 {
                for &(i, from, to, drafts) in &plan {
                    let s = &self.running[i];
                    keys += ((from + 1)..=to).map(|n| n as u64).sum::<u64>();
                    rows.push(((s.id, s.index), &s.tokens[from..to], drafts));
                    if drafts {
                        drafting.push(i);
                    }
                }
            } else {
                for (i, s) in self.running.iter().enumerate() {
                    if keep[i] > p {
                        keys += (s.tokens.len() + p) as u64;
                        rows.push(((s.id, s.index), std::slice::from_ref(&last[i]), true));
                        drafting.push(i);
                    }
                }
            }
            if rows.is_empty() {
                break;
            }
            let n_rows: usize = rows.iter().map(|r| r.1.len()).sum();
            let logits = d.forward(&rows)?;
            drop(rows);
            if p == 0 {
                catch_up =
                    Self::charge_catch_up(&mut self.running, &plan, (t0.elapsed(), n_rows), |s| {
                        super::speculate::ahead(s.left(max_ctx), typical)
                    });
            }
            Self::take_drafted(
                &mut self.running,
                (&logits, vocab),
                &drafting,
                &mut last,
                &mut keep,
            );
            self.draft_cost
                .record(n_rows, keys, t0.elapsed().as_secs_f64());
        }
        if let Some(spec) = self.spec.as_mut() {
            spec.catch_up += catch_up;
        }
        Ok(())
    }

    /// Shares the `elapsed` time of a first draft forward of `rows` rows among the sequences
    /// of `plan` by the tokens each fed to catch up (all it fed but a drafting sequence's
    /// last): each sequence's share is charged to the `ahead(sequence)` tokens it is expected
    /// to make still (`Seq::draft_overhead`). Returns the seconds spent catching up.
    fn charge_catch_up(
        running: &mut [super::Seq],
        plan: &[(usize, usize, usize, bool)],
        (elapsed, rows): (std::time::Duration, usize),
        ahead: impl Fn(&super::Seq) -> usize,
    ) -> f64 {
        let mut spent = 0.0;
        for &(i, from, to, drafts) in plan {
            let fed = to - from - usize::from(drafts);
            if fed > 0 {
                let share = elapsed.as_secs_f64() * fed as f64 / rows.max(1) as f64;
                let s = &mut running[i];
                s.draft_overhead += share / ahead(s) as f64;
                spent += share;
            }
        }
        spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::tiny_model;

    fn drafter(blocks: usize) -> Drafter {
        let pool = PoolSize {
            block_size: 16,
            kv_cache_mb: 0,
            num_blocks: Some(blocks),
            kv_dtype: KvDtype::F32,
            gpu_memory_fraction: None,
        };
        let backend = CpuBackend::new(tiny_model(1), &pool).unwrap();
        Drafter::new(Box::new(backend), 97, 16).unwrap()
    }

    fn key(n: u64) -> Key {
        (RequestId(n), 0)
    }

    /// A state keeps the K/V of the prefix its sequence still starts with, short of the last
    /// token; the pool evicts the least recently used state that does not draft in the step,
    /// never one that does; states of sequences gone give their blocks back.
    #[test]
    fn states_resume_at_the_common_prefix_and_evict_the_least_recent() {
        let mut d = drafter(4);
        let tokens: Vec<u32> = (0..40).map(|t| t % 90 + 3).collect();
        d.begin_step(&HashSet::from([key(1)]));
        assert_eq!(d.resume(key(1), &tokens), 0);
        assert!(d.reserve(key(1), 40));
        assert_eq!(d.blocks().0, 1);
        let logits = d.forward(&[(key(1), &tokens, true)]).unwrap();
        assert_eq!(logits.len(), 97);
        assert_eq!(d.fed(&key(1)), Some(&tokens[..]));
        // The sequence went on differently after its 25th token: 25 stay, and all of a
        // sequence's tokens never do (its last is fed again).
        let mut other = tokens[..25].to_vec();
        other.extend([7, 8, 9]);
        assert_eq!(d.resume(key(1), &other), 25);
        assert_eq!(d.resume(key(1), &tokens[..25]), 24);
        assert_eq!(d.fed(&key(1)).unwrap().len(), 24);
        // Next step: sequence 2 needs 3 blocks; sequence 1 does not draft and is evicted.
        d.begin_step(&HashSet::from([key(1), key(2), key(3)]));
        d.resume(key(2), &tokens);
        assert!(d.reserve(key(2), 48));
        assert_eq!(d.fed(&key(1)), None, "evicted");
        // Sequence 3 cannot take sequence 2's blocks in the step sequence 2 drafts in.
        d.resume(key(3), &tokens);
        assert!(!d.reserve(key(3), 32));
        assert!(d.reserve(key(3), 16));
        assert_eq!(d.blocks(), (0, 4));
        // Sequence 2 left: its blocks come back at the next step.
        d.begin_step(&HashSet::from([key(3)]));
        assert_eq!(d.blocks(), (3, 4));
        d.release(&key(3));
        assert_eq!(d.blocks(), (4, 4));
    }

    /// A draft whose vocabulary is not the target's is refused, saying why.
    #[test]
    fn a_draft_of_another_vocabulary_is_refused() {
        let pool = PoolSize {
            block_size: 16,
            kv_cache_mb: 0,
            num_blocks: Some(4),
            kv_dtype: KvDtype::F32,
            gpu_memory_fraction: None,
        };
        let backend = CpuBackend::new(tiny_model(1), &pool).unwrap();
        let e = Drafter::new(Box::new(backend), 49152, 16).err().unwrap();
        assert!(e.to_string().contains("97 token ids"), "{e}");
    }
}
