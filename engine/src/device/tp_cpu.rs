//! Tensor parallelism on the CPU: one process, one thread per rank, each with its share of the
//! weights ([`CpuModel::shard_from_tensors`]), its slice of the KV pool (its KV heads) and its
//! own compute pool, exchanging through a [`ThreadGroup`]. The ranks run in lockstep as a
//! [`RankGroup`] (rank threads, a failed step's group rebuilt), which the GPUs' ranks share.
//!
//! With `experts` set, the group is expert-parallel instead ([`TpShard::expert_rank`]): each
//! rank holds a block of a mixture of experts' experts and everything else whole, the ranks share
//! one KV pool, and each step's sequences are split among them (attention data-parallel).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tandem_collective::{RankStats, ThreadGroup, ThreadRank};
use tandem_model::{LoadedModel, ModelConfig, TensorData};
use tandem_types::BlockId;

use crate::backend::{Backend, RankPool};
use crate::backend::{PoolSize, TpStats};
use crate::device::cpu::{CpuModel, WeightFormat};
use crate::device::ranks::{RankGroup, RankWork, StepOut};
use crate::error::EngineError;
use crate::forward::SeqBatch;
use crate::kv_cache::KvPool;
use crate::shard::TpShard;

/// How a CPU tensor-parallel group is set up.
#[derive(Clone, Debug)]
pub struct TpCpuConfig {
    /// Ranks (threads, each with its share of the model).
    pub size: usize,
    /// Compute threads of each rank's pool.
    pub threads_per_rank: usize,
    /// How long a collective waits for its peers before it fails the step.
    pub watchdog: Duration,
    /// The largest step the scheduler sends: tokens (its batch budget) and sequences (its
    /// cap). They size the buffer the ranks exchange through.
    pub max_step_tokens: usize,
    /// See `max_step_tokens`.
    pub max_step_seqs: usize,
    /// Split the experts of a mixture of experts over the ranks (expert parallelism, attention
    /// data-parallel) instead of the heads and MLP features.
    pub experts: bool,
}

/// A CPU rank: its shard of the model, its slice of the pool and its compute threads.
struct CpuRank {
    model: CpuModel,
    kv: KvPool,
    pool: rayon::ThreadPool,
    /// Whether block copies are this rank's (expert ranks share one pool: rank 0 copies).
    copies: bool,
}

impl RankWork for CpuRank {
    type Comm = ThreadRank;
    type Join = ThreadRank;

    fn rank(&self) -> usize {
        self.model.shard.group().0
    }

    fn join(&mut self, join: ThreadRank) -> Result<ThreadRank, EngineError> {
        Ok(join)
    }

    fn step(
        &mut self,
        seqs: &[SeqBatch<'_>],
        _picks: bool,
        comm: &mut ThreadRank,
    ) -> Result<StepOut, EngineError> {
        let (model, kv) = (&self.model, &mut self.kv);
        self.pool
            .install(|| model.forward_rank(seqs, kv, comm, None))
            .map(StepOut::Logits)
    }

    fn copy(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        for &(from, to) in pairs.iter().filter(|_| self.copies) {
            self.kv.copy_block(from.0 as usize, to.0 as usize);
        }
        Ok(())
    }

    fn abort(comm: &mut ThreadRank, why: String) {
        comm.abort(why);
    }

    #[cfg(test)]
    fn poisoned(comm: &ThreadRank) -> bool {
        comm.poisoned()
    }
}

/// The CPU model split over a group of rank threads in this process.
pub struct TpCpuBackend {
    config: ModelConfig,
    /// Every rank's pool (another handle on the memory its thread steps through) and its KV
    /// heads: read between steps, never during one.
    pools: Vec<(std::ops::Range<u32>, KvPool)>,
    setup: TpCpuConfig,
    group: RankGroup<CpuRank>,
    /// Each rank's collective costs, counted on across rebuilt groups.
    stats: Vec<Arc<RankStats>>,
    num_blocks: usize,
    weight_bytes: usize,
    kv_bytes_per_token: f64,
    kv_dtype: &'static str,
    /// Rows routed to each expert, counted by every rank.
    expert_load: Option<Arc<crate::forward::ExpertLoad>>,
}

impl TpCpuBackend {
    /// `loaded` split over `setup.size` rank threads, with weights held as `format` says and a
    /// pool of `pool`'s size (the whole process's cache: every rank's slice together).
    pub fn new(
        loaded: &LoadedModel,
        format: WeightFormat,
        pool: &PoolSize,
        setup: TpCpuConfig,
    ) -> Result<Self, EngineError> {
        Self::from_tensors(&loaded.config, &loaded.tensors, format, pool, setup)
    }

    /// [`TpCpuBackend::new`] from a model's config and tensors.
    pub fn from_tensors(
        c: &ModelConfig,
        tensors: &BTreeMap<String, TensorData>,
        format: WeightFormat,
        pool: &PoolSize,
        setup: TpCpuConfig,
    ) -> Result<Self, EngineError> {
        pool.check()?;
        if setup.size == 0 || setup.threads_per_rank == 0 {
            return Err(EngineError::Config(
                "a tensor-parallel group needs at least one rank of at least one thread".into(),
            ));
        }
        let shards = match setup.experts {
            true => (0..setup.size)
                .map(|r| TpShard::expert_rank(c, r, setup.size))
                .collect::<Result<Vec<_>, _>>()?,
            false => TpShard::plan_all(c, setup.size)?,
        };
        let mut models = shards
            .into_iter()
            .map(|s| CpuModel::shard_from_tensors(c, tensors, format, s))
            .collect::<Result<Vec<_>, _>>()?;
        // One count for the group: each rank adds the rows it routes.
        let expert_load = models.first().and_then(CpuModel::expert_load);
        if let Some(load) = &expert_load {
            for m in &mut models {
                m.share_expert_load(load.clone());
            }
        }
        let layouts: Vec<_> = models
            .iter()
            .map(|m| m.kv_layout(pool.block_size))
            .collect();
        // Expert ranks share one pool of every KV head; tensor-parallel ranks each have their
        // heads' slice.
        let pooled = match setup.experts {
            true => &layouts[..1],
            false => &layouts[..],
        };
        let block_bytes: usize = pooled
            .iter()
            .map(|&l| KvPool::bytes_per_block(l, pool.kv_dtype, c.num_layers))
            .sum();
        let num_blocks = pool.blocks(block_bytes);
        let weight_bytes = models.iter().map(|m| m.weight_bytes()).sum();
        // A step's largest exchange in one round: its activations, or its logits' slices.
        let capacity = (setup.max_step_tokens * c.hidden_size)
            .max(setup.max_step_seqs * c.vocab_size.div_ceil(setup.size))
            .clamp(1 << 12, 1 << 22);
        let mut works = Vec::with_capacity(setup.size);
        let mut pools = Vec::with_capacity(setup.size);
        let new_pool = |layout| {
            KvPool::new(layout, pool.kv_dtype, c.num_layers, num_blocks)
                .map_err(|e| EngineError::Startup(format!("allocating the KV pool: {e}")))
        };
        let shared = match setup.experts {
            true => Some(new_pool(layouts[0])?),
            false => None,
        };
        for (model, layout) in models.into_iter().zip(layouts) {
            // Expert ranks write the blocks of their own sequences only, so they share one
            // pool; block copies are rank 0's.
            let kv = match &shared {
                Some(p) => p.alias(),
                None => new_pool(layout)?,
            };
            let heads = &model.shard.kv_heads;
            if shared.is_none() || pools.is_empty() {
                pools.push((heads.start as u32..heads.end as u32, kv.alias()));
            }
            let rank = model.shard.group().0;
            let copies = shared.is_none() || rank == 0;
            let threads = rayon::ThreadPoolBuilder::new()
                .num_threads(setup.threads_per_rank)
                .thread_name(move |i| format!("tp{rank}-{i}"))
                .build()
                .map_err(|e| EngineError::Startup(format!("rank {rank}'s compute pool: {e}")))?;
            works.push(CpuRank {
                model,
                kv,
                pool: threads,
                copies,
            });
        }
        let stats: Vec<Arc<RankStats>> = (0..setup.size).map(|_| Arc::default()).collect();
        let counted = stats.clone();
        let (size, watchdog) = (setup.size, setup.watchdog);
        let group = RankGroup::start(
            works,
            Box::new(move || {
                Ok(ThreadGroup::ranks(size, capacity, watchdog)
                    .into_iter()
                    .zip(&counted)
                    .map(|(r, s)| r.counting_into(s.clone()))
                    .collect())
            }),
        )?;
        Ok(Self {
            config: c.clone(),
            pools,
            setup,
            group,
            stats,
            num_blocks,
            weight_bytes,
            kv_bytes_per_token: block_bytes as f64 / pool.block_size as f64,
            kv_dtype: pool.kv_dtype.name(),
            expert_load,
        })
    }

    /// Collective costs so far.
    pub fn stats(&self) -> TpStats {
        let n = self.stats.len().max(1) as u32;
        let total: Duration = self.stats.iter().map(|s| s.time()).sum();
        TpStats {
            size: self.stats.len(),
            calls: self.stats.first().map_or(0, |s| s.calls()),
            values: self.stats.first().map_or(0, |s| s.values()),
            collective: total / n,
        }
    }
}

impl Backend for TpCpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        self.group.logits(seqs)
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        self.group.copy(pairs)
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn kv_bytes_per_token(&self) -> f64 {
        self.kv_bytes_per_token
    }

    fn kv_dtype_name(&self) -> &'static str {
        self.kv_dtype
    }

    fn device(&self) -> String {
        match self.setup.experts {
            true => format!("cpu, ep {}", self.group.size()),
            false => format!("cpu, tp {}", self.group.size()),
        }
    }

    fn tp(&self) -> usize {
        // Expert ranks hold every head: their cache is one rank's, as TP 1's.
        match self.setup.experts {
            true => 1,
            false => self.group.size(),
        }
    }

    fn expert_load(&self) -> Option<Arc<crate::forward::ExpertLoad>> {
        self.expert_load.clone()
    }

    fn is_cpu(&self) -> bool {
        true
    }

    fn prunes_last_layer(&self) -> bool {
        // An expert-parallel group's ranks run different rows: they keep every row.
        !self.setup.experts
    }

    fn host_pools(&self) -> Vec<RankPool<'_>> {
        self.pools
            .iter()
            .map(|(heads, pool)| RankPool {
                heads: heads.clone(),
                pool,
            })
            .collect()
    }

    fn tp_stats(&self) -> Option<TpStats> {
        Some(self.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::CpuBackend;
    use crate::kv_cache::KvDtype;
    use crate::testing::tiny_tensors;

    fn setup(size: usize, watchdog: Duration) -> TpCpuConfig {
        TpCpuConfig {
            size,
            threads_per_rank: 1,
            watchdog,
            max_step_tokens: 2048,
            max_step_seqs: 256,
            experts: false,
        }
    }

    /// A prompt step of two sequences, then decode steps on the argmax tokens: every step's
    /// logits, row after row.
    fn run(b: &mut dyn Backend, steps: usize) -> Vec<Vec<f32>> {
        let vocab = b.config().vocab_size;
        let mut seqs: Vec<(Vec<u32>, usize, Vec<u32>)> = vec![
            (
                vec![5, 9, 2, 7, 60, 1, 33, 4, 8, 90],
                0,
                vec![0, 1, 2, 3, 4],
            ),
            (vec![11, 3, 96], 0, vec![5, 6, 7]),
        ];
        let mut out = Vec::new();
        for _ in 0..steps {
            let batch: Vec<SeqBatch<'_>> = seqs
                .iter()
                .map(|(t, cached, table)| SeqBatch {
                    tokens: t,
                    cached: *cached,
                    block_table: table,
                    logits: 1,
                    lora: None,
                })
                .collect();
            let logits = b.forward(&batch).unwrap();
            for ((t, cached, _), row) in seqs.iter_mut().zip(logits.chunks_exact(vocab)) {
                *cached += t.len();
                *t = vec![tandem_kernels::ops::argmax(row) as u32];
            }
            out.push(logits);
        }
        out
    }

    fn worst_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
    }

    /// TP 2 splits the tiny model's two KV heads, TP 4 replicates them: both give one rank's
    /// logits up to the rounding of the row-parallel sums, over a prompt step and decode steps
    /// that read the split caches, for every cache dtype; the argmax tokens are the same.
    #[test]
    fn split_forward_gives_one_ranks_logits() {
        let (c, tensors) = tiny_tensors(5);
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
            let cfg = PoolSize {
                num_blocks: Some(8),
                block_size: 4,
                kv_dtype: dtype,
                gpu_memory_fraction: None,
                kv_cache_mb: 0,
            };
            let model = CpuModel::from_tensors(&c, &tensors, WeightFormat::Native).unwrap();
            let mut one = CpuBackend::new(model, &cfg).unwrap();
            let want = run(&mut one, 6);
            for (tp, kv_share) in [(2, 1.0), (4, 2.0)] {
                let mut b = TpCpuBackend::from_tensors(
                    &c,
                    &tensors,
                    WeightFormat::Native,
                    &cfg,
                    setup(tp, Duration::from_secs(60)),
                )
                .unwrap();
                assert_eq!((b.tp(), b.num_blocks()), (tp, 8));
                assert_eq!(b.device(), format!("cpu, tp {tp}"));
                // Replicated heads take their room once per rank that keeps them.
                assert_eq!(b.kv_bytes_per_token(), kv_share * one.kv_bytes_per_token());
                // Split weights add up to the whole; replicated k/v rows count once a rank.
                match tp {
                    2 => assert_eq!(b.weight_bytes(), one.weight_bytes()),
                    _ => assert!(b.weight_bytes() > one.weight_bytes()),
                }
                let got = run(&mut b, 6);
                // f32 differs by the sums' order alone; a rounded cache can round a value that
                // differs in its last bit to the next step of its grid.
                let tol = match dtype {
                    KvDtype::F32 => 1e-5,
                    KvDtype::F16 => 2e-4,
                    KvDtype::Int8 => 1e-3,
                };
                let mut worst = 0f32;
                for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.len(), w.len());
                    let rel = worst_rel(g, w);
                    assert!(rel < tol, "{dtype} tp {tp} step {step}: {rel}");
                    worst = worst.max(rel);
                }
                eprintln!("{dtype} tp {tp}: worst relative difference {worst:.2e}");
                let st = b.stats();
                // Per step: the embedding, two per layer, the logits' gather.
                assert_eq!(st.calls, 6 * (2 + 2 * c.num_layers as u64));
                assert_eq!(st.size, tp);
            }
        }
    }

    /// A group's last layer goes on only with the rows that want logits, as one rank's does:
    /// those rows' logits, and the next step's (which reads every row's cached keys and
    /// values), have the bits of a step whose every row wants logits.
    #[test]
    fn a_group_keeps_only_the_rows_that_want_logits_and_changes_no_bit() {
        let (c, tensors) = tiny_tensors(5);
        let cfg = PoolSize {
            num_blocks: Some(8),
            block_size: 16,
            kv_dtype: KvDtype::F32,
            gpu_memory_fraction: None,
            kv_cache_mb: 0,
        };
        let p0: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % 50).collect();
        let p1 = [11u32, 3, 40, 8, 21];
        let (t0, t1) = ([0u32, 1], [2u32]);
        let vocab = c.vocab_size;
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let step = |logits: [usize; 2]| {
            let setup = setup(2, Duration::from_secs(60));
            let mut b = TpCpuBackend::from_tensors(&c, &tensors, WeightFormat::Native, &cfg, setup)
                .unwrap();
            let seq = |tokens, cached, table, logits| SeqBatch {
                tokens,
                cached,
                block_table: table,
                logits,
                lora: None,
            };
            let got = b
                .forward(&[seq(&p0, 0, &t0, logits[0]), seq(&p1, 0, &t1, logits[1])])
                .unwrap();
            let next = [seq(&[4], p0.len(), &t0, 1), seq(&[9], p1.len(), &t1, 1)];
            (bits(&got), bits(&b.forward(&next).unwrap()))
        };
        let (all, after_all) = step([p0.len(), p1.len()]);
        for (logits, rows) in [([1, 1], [19, 24]), ([0, 2], [23, 24])] {
            let (got, after) = step(logits);
            let want: Vec<u32> = rows
                .iter()
                .flat_map(|&r| all[r * vocab..(r + 1) * vocab].to_vec())
                .collect();
            assert_eq!(got, want, "{logits:?}");
            assert_eq!(after, after_all, "the step after {logits:?}");
        }
    }

    /// A rank that does not come to a collective fails the step with the watchdog's error,
    /// naming it; the group is rebuilt, and the next step is right again.
    #[test]
    fn a_stuck_rank_fails_the_step_and_the_group_recovers() {
        let (c, tensors) = tiny_tensors(6);
        let cfg = PoolSize {
            num_blocks: Some(8),
            block_size: 4,
            kv_dtype: KvDtype::F32,
            gpu_memory_fraction: None,
            kv_cache_mb: 0,
        };
        // A short watchdog: the stuck rank waits for the timeout (not for a time), so the test
        // does not depend on the machine's speed; the group rebuilt after it keeps the backend's
        // own watchdog, long for the steps that must succeed.
        let mut b = TpCpuBackend::from_tensors(
            &c,
            &tensors,
            WeightFormat::Native,
            &cfg,
            setup(2, Duration::from_secs(600)),
        )
        .unwrap();
        let want = run(&mut b, 1);
        let group = ThreadGroup::ranks(2, 1 << 12, Duration::from_millis(100));
        let joins = group
            .into_iter()
            .zip(&b.stats)
            .map(|(r, s)| r.counting_into(s.clone()))
            .collect();
        b.group.join_with(joins).unwrap();
        b.group.stall(1);
        let (toks, table) = ([5u32, 9, 2], [0u32]);
        let seq = [SeqBatch {
            tokens: &toks,
            cached: 0,
            block_table: &table,
            logits: 1,
            lora: None,
        }];
        let e = b.forward(&seq).unwrap_err().to_string();
        assert!(e.contains("ranks [1] did not arrive"), "{e}");
        assert_eq!(run(&mut b, 1), want);
        // A request's bad token fails on every rank before any collective, with its own error.
        let bad = [SeqBatch {
            tokens: &[500],
            cached: 0,
            block_table: &table,
            logits: 1,
            lora: None,
        }];
        let e = b.forward(&bad).unwrap_err().to_string();
        assert!(e.contains("500"), "{e}");
        assert_eq!(run(&mut b, 1), want);
        // A rank that panics fails the step with the panic's message (it aborts the group, so
        // its peer does not wait for the watchdog), and lives on for the next step.
        b.group.panic_next(0);
        let e = b.forward(&seq).unwrap_err().to_string();
        assert!(e.contains("rank 0 panicked: a test asked for it"), "{e}");
        assert_eq!(run(&mut b, 1), want);
        // The collectives of the four good steps (the embedding's, two a layer, the gather's)
        // are all counted, across the three groups: counts go on when a group is rebuilt.
        assert_eq!(b.stats().calls, 4 * (2 + 2 * c.num_layers as u64));
    }
}
