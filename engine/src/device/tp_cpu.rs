//! Tensor parallelism on the CPU: one process, one thread per rank, each with its share of the
//! weights ([`CpuModel::shard_from_tensors`]), its slice of the KV pool (its KV heads) and its
//! own compute pool, exchanging through a [`ThreadGroup`]. The engine's one scheduler drives
//! them: every step (and every block copy) goes to all ranks, which run it in lockstep, and rank
//! 0's logits come back.
//!
//! With `experts` set, the group is expert-parallel instead ([`TpShard::expert_rank`]): each
//! rank holds a block of a mixture of experts' experts and everything else whole, the ranks share
//! one KV pool, and each step's sequences are split among them (attention data-parallel).
//!
//! A step that fails on any rank fails as a whole. The ranks are then idle, so the group is
//! rebuilt before the next step: a poisoned group (a rank that timed out, or gave up) does not
//! outlive the step it failed.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tandem_collective::{CollectiveError, RankStats, ThreadGroup, ThreadRank};
use tandem_model::{LoadedModel, ModelConfig, TensorData};
use tandem_types::BlockId;

use crate::backend::{Backend, RankPool};
use crate::backend::{PoolSize, TpStats};
use crate::device::cpu::{CpuModel, WeightFormat};
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

/// One step's sequences, owned, so every rank thread reads the same copy.
struct OwnedBatch {
    seqs: Vec<(Vec<u32>, usize, Vec<u32>, usize)>,
}

impl OwnedBatch {
    fn new(seqs: &[SeqBatch<'_>]) -> Self {
        Self {
            seqs: seqs
                .iter()
                .map(|s| {
                    let (t, b) = (s.tokens.to_vec(), s.block_table.to_vec());
                    (t, s.cached, b, s.logits)
                })
                .collect(),
        }
    }

    fn batches(&self) -> Vec<SeqBatch<'_>> {
        self.seqs
            .iter()
            .map(|(tokens, cached, table, want)| SeqBatch {
                tokens,
                cached: *cached,
                block_table: table,
                logits: *want,
                lora: None,
            })
            .collect()
    }
}

enum Job {
    Step(Arc<OwnedBatch>),
    Copy(Arc<Vec<(BlockId, BlockId)>>),
    /// A fresh rank of a new group, after a failed step.
    Regroup(ThreadRank),
    /// Test hook: the rank takes no job until its group has been given up, as a stuck rank.
    #[cfg(test)]
    StallUntilPoisoned,
    /// Test hook: the rank's next step panics inside its forward.
    #[cfg(test)]
    PanicNext,
}

/// A rank thread as the backend sees it.
struct Rank {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Result<Vec<f32>, EngineError>>,
    stats: Arc<RankStats>,
    thread: Option<JoinHandle<()>>,
}

/// The CPU model split over a group of rank threads in this process.
pub struct TpCpuBackend {
    config: ModelConfig,
    /// Every rank's pool (another handle on the memory its thread steps through) and its KV
    /// heads: read between steps, never during one.
    pools: Vec<(std::ops::Range<u32>, KvPool)>,
    setup: TpCpuConfig,
    capacity: usize,
    ranks: Vec<Rank>,
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
        let group = ThreadGroup::ranks(setup.size, capacity, setup.watchdog);
        let mut ranks = Vec::with_capacity(setup.size);
        let mut pools = Vec::with_capacity(setup.size);
        let new_pool = |layout| {
            KvPool::new(layout, pool.kv_dtype, c.num_layers, num_blocks)
                .map_err(|e| EngineError::Startup(format!("allocating the KV pool: {e}")))
        };
        let shared = match setup.experts {
            true => Some(new_pool(layouts[0])?),
            false => None,
        };
        for ((model, layout), comm) in models.into_iter().zip(layouts).zip(group) {
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
            let copies = shared.is_none() || model.shard.group().0 == 0;
            ranks.push(Rank::start(
                model,
                kv,
                comm,
                setup.threads_per_rank,
                copies,
            )?);
        }
        Ok(Self {
            config: c.clone(),
            pools,
            capacity,
            setup,
            ranks,
            num_blocks,
            weight_bytes,
            kv_bytes_per_token: block_bytes as f64 / pool.block_size as f64,
            kv_dtype: pool.kv_dtype.name(),
            expert_load,
        })
    }

    /// Collective costs so far.
    pub fn stats(&self) -> TpStats {
        let n = self.ranks.len().max(1) as u32;
        let total: Duration = self.ranks.iter().map(|r| r.stats.time()).sum();
        TpStats {
            size: self.ranks.len(),
            calls: self.ranks.first().map_or(0, |r| r.stats.calls()),
            values: self.ranks.first().map_or(0, |r| r.stats.values()),
            collective: total / n,
        }
    }

    /// Sends `job(rank)` to every rank and waits for all their answers: rank 0's result, or the
    /// step's first real error (a peer's timeout or poisoning is a consequence, not a cause).
    /// After a failure the group is rebuilt.
    fn all(&mut self, job: impl Fn() -> Job) -> Result<Vec<f32>, EngineError> {
        let gone = |i| EngineError::Step(format!("tensor-parallel rank {i} has stopped"));
        // Every rank that took the job is waited for, even when another could not take it:
        // none may still be running when this returns.
        let sent: Vec<bool> = self
            .ranks
            .iter()
            .map(|r| r.jobs.send(job()).is_ok())
            .collect();
        let mut results: Vec<Result<Vec<f32>, EngineError>> = Vec::with_capacity(self.ranks.len());
        for (i, (r, &sent)) in self.ranks.iter().zip(&sent).enumerate() {
            results.push(match sent {
                true => r.done.recv().unwrap_or_else(|_| Err(gone(i))),
                false => Err(gone(i)),
            });
        }
        if results.iter().all(|r| r.is_ok()) {
            return results.swap_remove(0);
        }
        let consequence =
            |e: &EngineError| matches!(e, EngineError::Collective(CollectiveError::Poisoned(_)));
        let err = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .find(|e| !consequence(e))
            .or_else(|| results.iter().find_map(|r| r.as_ref().err()))
            .map(|e| EngineError::Step(e.to_string()))
            .unwrap_or_else(|| EngineError::Internal("a failed step with no error".into()));
        let group = ThreadGroup::ranks(self.ranks.len(), self.capacity, self.setup.watchdog);
        for (r, comm) in self.ranks.iter().zip(group) {
            // A rank that is gone fails the next step by itself.
            let _ = r
                .jobs
                .send(Job::Regroup(comm.counting_into(r.stats.clone())));
        }
        Err(err)
    }
}

impl Rank {
    fn start(
        model: CpuModel,
        mut kv: KvPool,
        comm: ThreadRank,
        threads: usize,
        copies: bool,
    ) -> Result<Self, EngineError> {
        let rank = model.shard.group().0;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("tp{rank}-{i}"))
            .build()
            .map_err(|e| EngineError::Startup(format!("rank {rank}'s compute pool: {e}")))?;
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (reply, done) = mpsc::channel();
        let stats = comm.stats();
        let thread = std::thread::Builder::new()
            .name(format!("tp-rank-{rank}"))
            .spawn(move || {
                let mut comm = comm;
                #[cfg(test)]
                let mut panic_next = false;
                while let Ok(job) = inbox.recv() {
                    let out = match job {
                        Job::Step(batch) => {
                            let seqs = batch.batches();
                            #[cfg(test)]
                            let panics = std::mem::take(&mut panic_next);
                            let run = || {
                                #[cfg(test)]
                                assert!(!panics, "a test asked for it");
                                pool.install(|| model.forward_rank(&seqs, &mut kv, &mut comm, None))
                            };
                            // A panic fails the step like an error, without ending the thread.
                            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
                                .unwrap_or_else(|p| {
                                    let what = tandem_types::panic_message(p.as_ref());
                                    Err(EngineError::Internal(format!(
                                        "rank {rank} panicked: {what}"
                                    )))
                                });
                            if let Err(e) = &r {
                                // The others must not wait for this rank's next collective.
                                comm.abort(format!("rank {rank} failed: {e}"));
                            }
                            r
                        }
                        Job::Copy(pairs) => {
                            for &(from, to) in pairs.iter().filter(|_| copies) {
                                kv.copy_block(from.0 as usize, to.0 as usize);
                            }
                            Ok(Vec::new())
                        }
                        Job::Regroup(fresh) => {
                            comm = fresh;
                            continue;
                        }
                        #[cfg(test)]
                        Job::StallUntilPoisoned => {
                            while !comm.poisoned() {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            continue;
                        }
                        #[cfg(test)]
                        Job::PanicNext => {
                            panic_next = true;
                            continue;
                        }
                    };
                    if reply.send(out).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| EngineError::Startup(format!("starting rank {rank}'s thread: {e}")))?;
        Ok(Self {
            jobs,
            done,
            stats,
            thread: Some(thread),
        })
    }
}

impl Drop for TpCpuBackend {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            // Closing the channel ends the rank's loop.
            let (closed, _) = mpsc::channel();
            drop(std::mem::replace(&mut r.jobs, closed));
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Backend for TpCpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        let batch = Arc::new(OwnedBatch::new(seqs));
        self.all(|| Job::Step(batch.clone()))
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        if pairs.is_empty() {
            return Ok(());
        }
        let pairs = Arc::new(pairs.to_vec());
        self.all(|| Job::Copy(pairs.clone())).map(|_| ())
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
            true => format!("cpu, ep {}", self.ranks.len()),
            false => format!("cpu, tp {}", self.ranks.len()),
        }
    }

    fn tp(&self) -> usize {
        // Expert ranks hold every head: their cache is one rank's, as TP 1's.
        match self.setup.experts {
            true => 1,
            false => self.ranks.len(),
        }
    }

    fn expert_load(&self) -> Option<Arc<crate::forward::ExpertLoad>> {
        self.expert_load.clone()
    }

    fn is_cpu(&self) -> bool {
        true
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
        let group = ThreadGroup::ranks(2, b.capacity, Duration::from_millis(100));
        for (r, comm) in b.ranks.iter().zip(group) {
            let comm = comm.counting_into(r.stats.clone());
            r.jobs.send(Job::Regroup(comm)).unwrap();
        }
        b.ranks[1].jobs.send(Job::StallUntilPoisoned).unwrap();
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
        b.ranks[0].jobs.send(Job::PanicNext).unwrap();
        let e = b.forward(&seq).unwrap_err().to_string();
        assert!(e.contains("rank 0 panicked: a test asked for it"), "{e}");
        assert_eq!(run(&mut b, 1), want);
        // The collectives of the four good steps (the embedding's, two a layer, the gather's)
        // are all counted, across the three groups: counts go on when a group is rebuilt.
        assert_eq!(b.stats().calls, 4 * (2 + 2 * c.num_layers as u64));
    }
}
