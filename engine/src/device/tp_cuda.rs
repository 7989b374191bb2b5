//! Tensor parallelism on CUDA GPUs: one rank thread per GPU, each with its share of the model in
//! bf16 ([`CudaModel`] of a [`TpShard`]: its query and KV heads and their slice of the pool, its
//! MLP features, its slice of the vocabulary), exchanging through NCCL on the rank's own compute
//! stream: an all-reduce of the embedding and of each row-parallel product, and a gather of the
//! logits. The ranks run in lockstep as a [`RankGroup`], the logic the CPU's ranks test.
//!
//! Rank `r` runs on device `first + r`. Each rank's collectives are queued behind its kernels,
//! and a step waits for them under the group's watchdog (`--tp-watchdog-secs`): a rank that never
//! comes fails the step on its peers with a timeout rather than hanging them, and the group is
//! rebuilt (a fresh NCCL id, every rank's communicator made again; the old ones aborted).
//!
//! KV transfers reach each rank's pool ([`Backend::device_pools`]): a prefill group exports
//! each rank's heads as a piece through its own staging, a decode group takes each piece into
//! the pool of every rank that holds those heads, whatever the other side's size.
//!
//! What runs here without a GPU: the group's logic (through the CPU's ranks), the shards'
//! split, the vocabulary's gather layout, and the transfers into and out of per-rank device
//! pools (through the host fake of a device per rank). What needs GPUs: this file's
//! [`RankWork`] and the kernels it calls; `scripts/gpu-check` runs them where two are lent.

use std::time::Duration;

use tandem_collective::{nccl, GroupAbort, NcclId, NcclRank};
use tandem_model::{LoadedModel, ModelConfig};
use tandem_types::BlockId;

use std::sync::Arc;

use crate::backend::{Backend, DevicePool, PoolSize};
use crate::device::cuda::{blocks_for_fraction, CudaModel};
use crate::device::ranks::{RankGroup, RankWork, StepOut};
use crate::device::staging::DeviceKv;
use crate::device::tp_cpu::TpCpuConfig;
use crate::error::EngineError;
use crate::forward::SeqBatch;
use crate::kv_cache::KvDtype;
use crate::shard::TpShard;

/// A GPU rank: its shard of the model and of the pool, on its device.
struct CudaRank {
    model: CudaModel,
    watchdog: Duration,
}

impl RankWork for CudaRank {
    type Comm = NcclRank;
    /// The group's id and the flag its ranks give it up with.
    type Join = (NcclId, GroupAbort);

    fn rank(&self) -> usize {
        self.model.shard.rank
    }

    fn join(&mut self, (id, abort): (NcclId, GroupAbort)) -> Result<NcclRank, EngineError> {
        let (rank, size) = (self.model.shard.rank, self.model.shard.size);
        Ok(NcclRank::on_stream(
            self.model.ops.stream.clone(),
            rank,
            size,
            id,
            self.watchdog,
            Some(abort),
        )?)
    }

    fn step(
        &mut self,
        seqs: &[SeqBatch<'_>],
        picks: bool,
        comm: &mut NcclRank,
    ) -> Result<StepOut, EngineError> {
        self.model.forward_rank(seqs, picks, comm)
    }

    fn copy(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        self.model.copy_blocks(pairs)
    }

    fn abort(comm: &mut NcclRank, why: String) {
        comm.poison(why);
    }

    #[cfg(test)]
    fn poisoned(comm: &NcclRank) -> bool {
        comm.poisoned()
    }
}

/// A model split over the GPUs `first..first + size`, a rank thread each.
pub struct TpCudaBackend {
    config: ModelConfig,
    group: RankGroup<CudaRank>,
    num_blocks: usize,
    weight_bytes: usize,
    kv_bytes_per_token: f64,
    device: String,
    /// Each rank's pool, with its KV heads, as KV transfers reach it.
    pools: Vec<DevicePool>,
}

impl TpCudaBackend {
    /// `loaded` split over `setup.size` GPUs from CUDA device `first` on, with a bf16 pool of
    /// `pool`'s size on each (every rank the same number of blocks, each of its heads).
    pub fn new(
        first: usize,
        loaded: &LoadedModel,
        pool: &PoolSize,
        setup: &TpCpuConfig,
    ) -> Result<Self, EngineError> {
        pool.check()?;
        let size = setup.size;
        if setup.experts {
            return Err(EngineError::Unsupported(
                "--ep on a CUDA device: expert parallelism runs on --device cpu".into(),
            ));
        }
        if pool.kv_dtype != KvDtype::F32 {
            return Err(EngineError::Config(format!(
                "--kv-dtype {} is for the CPU cache only; on a CUDA device the cache is bf16 (leave --kv-dtype at its default)",
                pool.kv_dtype
            )));
        }
        let last = first + size - 1;
        for ordinal in first..=last {
            let gpu = tandem_kernels::cuda::open(ordinal).map_err(|e| {
                EngineError::Startup(format!(
                    "--tp {size} from cuda:{first} puts its ranks on GPUs {first} to {last}: {e}"
                ))
            })?;
            // A step's buffers are freed while its collectives may still wait on a peer: only
            // stream-ordered frees keep the wait under the watchdog instead of inside a free.
            if !gpu.memory_pools {
                return Err(EngineError::Unsupported(format!(
                    "--tp {size} on {gpu}: the device has no stream-ordered memory pools, which tensor parallelism on CUDA needs"
                )));
            }
        }
        if !nccl::available() {
            return Err(EngineError::Unsupported(format!(
                "--tp {size} on CUDA needs NCCL: no libnccl was found on the library path"
            )));
        }
        let c = &loaded.config;
        let shards = TpShard::plan_all(c, size)?;
        let mut uploaded = Vec::with_capacity(size);
        for (r, shard) in shards.into_iter().enumerate() {
            let up = CudaModel::upload(first + r, c, &loaded.tensors, &shard).map_err(|e| {
                EngineError::Startup(format!(
                    "--tp {size} from cuda:{first} puts rank {r} on cuda:{}: {e}",
                    first + r
                ))
            })?;
            uploaded.push((shard, up));
        }
        // Every rank holds the same blocks, each of its own heads.
        let block_bytes =
            |s: &TpShard| CudaModel::kv_bytes_per_block(&s.local_config(c), pool.block_size);
        let num_blocks = match pool.gpu_memory_fraction {
            None => pool.blocks(uploaded.iter().map(|(s, _)| block_bytes(s)).sum()),
            Some(f) => {
                let mut least = usize::MAX;
                for (s, (ops, _)) in &uploaded {
                    let (free, total) = ops.memory()?;
                    least = least.min(blocks_for_fraction(f, free, total, block_bytes(s))?);
                }
                least
            }
        };
        let mut works = Vec::with_capacity(size);
        for (shard, (ops, weights)) in uploaded {
            let model = CudaModel::assemble(ops, c, shard, weights, pool.block_size, num_blocks)?;
            works.push(CudaRank {
                model,
                watchdog: setup.watchdog,
            });
        }
        let weight_bytes = works.iter().map(|w| w.model.weight_bytes()).sum();
        let kv_bytes_per_token = works
            .iter()
            .map(|w| w.model.kv_bytes_per_token() as f64)
            .sum();
        let device = format!("{}, tp {size}", works[0].model.ops.gpu);
        let pools = works
            .iter()
            .map(|w| {
                let h = &w.model.shard.kv_heads;
                let kv: Arc<dyn DeviceKv> = w.model.kv.clone();
                (h.start as u32..h.end as u32, kv)
            })
            .collect();
        let config = works[0].model.config.clone();
        let group = RankGroup::start(
            works,
            Box::new(move || Ok(vec![(NcclId::new()?, GroupAbort::default()); size])),
        )?;
        Ok(Self {
            config,
            group,
            num_blocks,
            weight_bytes,
            kv_bytes_per_token,
            device,
            pools,
        })
    }
}

impl Backend for TpCudaBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        self.group.logits(seqs)
    }

    fn picks_on_device(&self) -> bool {
        true
    }

    fn forward_argmax(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<(u32, f32)>, EngineError> {
        self.group.picks(seqs)
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
        "bf16"
    }

    fn device(&self) -> String {
        self.device.clone()
    }

    fn tp(&self) -> usize {
        self.group.size()
    }

    fn device_pools(&self) -> Vec<DevicePool> {
        self.pools.clone()
    }
}
