//! Where the engine's steps run. The scheduler, block manager and sampler are the same on every
//! device; they see a [`Backend`]: one packed step's logits (or picks) and the pool's size in
//! blocks. The CPU model over a host pool ([`CpuBackend`]) and the CUDA model over a device pool
//! ([`GpuLlama`]) are the two in production; tests drive the scheduler with fakes.

use tandem_kernels::cuda::DeviceSpec;
use tandem_model::{LlamaConfig, LoadedModel};

use crate::engine::{EngineConfig, OpTimes};
use crate::gpu::GpuLlama;
use crate::kv_cache::{KvDtype, KvPool};
use crate::model::{LlamaModel, SeqBatch, WeightFormat};
use crate::tp::{TpCpuBackend, TpCpuConfig, TpStats};
use crate::EngineError;
use tandem_types::BlockId;

/// A device that runs the model's steps over its KV pool.
pub trait Backend: Send {
    /// The model's shape.
    fn config(&self) -> &LlamaConfig;

    /// One packed step over the pool; f32 logits (vocab each) for the sequences that want them,
    /// in order.
    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError>;

    /// Whether [`Backend::forward_argmax`] picks tokens where the logits are (a GPU), so a step
    /// whose samplers all take the argmax need not bring the logits back.
    fn picks_on_device(&self) -> bool {
        false
    }

    /// One packed step that returns, for each sequence that wants logits, the argmax token (the
    /// first on ties) and its log-probability. By default from [`Backend::forward`]'s logits.
    fn forward_argmax(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<(u32, f32)>, EngineError> {
        let logits = self.forward(seqs)?;
        let vocab = self.config().vocab_size;
        let mut lp = vec![0f32; vocab];
        Ok(logits
            .chunks_exact(vocab)
            .map(|row| {
                tandem_kernels::ops::log_softmax(row, &mut lp);
                let t = tandem_kernels::ops::argmax(row);
                (t as u32, lp[t])
            })
            .collect())
    }

    /// Blocks in the pool.
    fn num_blocks(&self) -> usize;

    /// Copies each `(from, to)` block's K/V, every layer, in order: a sequence's own copy of a
    /// block it shared with a parallel sample (copy-on-write), before the step that writes it.
    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError>;

    /// The host pool, which KV transfers read from and write into; None when the cache lives
    /// elsewhere, or is split over tensor-parallel ranks.
    fn host_pool(&self) -> Option<&KvPool> {
        None
    }

    /// Every rank's host pool with the KV heads it holds, in rank order (one pool of every
    /// head without tensor parallelism); empty when the cache lives elsewhere.
    fn host_pools(&self) -> Vec<RankPool<'_>> {
        self.host_pool()
            .map(|pool| RankPool {
                heads: 0..pool.layout.num_kv_heads as u32,
                pool,
            })
            .into_iter()
            .collect()
    }

    /// Bytes of weights one decode step reads.
    fn weight_bytes(&self) -> usize;

    /// Bytes of cache per token of context, all layers.
    fn kv_bytes_per_token(&self) -> f64;

    /// The cache's element type, as workers advertise it.
    fn kv_dtype_name(&self) -> &'static str;

    /// Where steps run, for logs and benchmark headers.
    fn device(&self) -> String;

    /// Whether steps run on the CPU (in one rank or several).
    fn is_cpu(&self) -> bool {
        false
    }

    /// The CPU model, when steps run on the CPU in one rank.
    fn cpu_model(&self) -> Option<&LlamaModel> {
        None
    }

    /// Ranks of the tensor-parallel group the steps run on (1: no tensor parallelism).
    fn tp(&self) -> usize {
        1
    }

    /// The group's collective costs so far (None without tensor parallelism).
    fn tp_stats(&self) -> Option<TpStats> {
        None
    }

    /// Times each op of every forward from now on (`on`); false when this backend cannot.
    fn profile_ops(&mut self, on: bool) -> bool {
        let _ = on;
        false
    }

    /// The latest forward's split by op (None when not profiling).
    fn take_op_times(&mut self) -> Option<OpTimes> {
        None
    }
}

/// One tensor-parallel rank's host KV pool: the model's KV heads `heads` of every block.
pub struct RankPool<'a> {
    /// The KV heads the pool holds.
    pub heads: std::ops::Range<u32>,
    /// The pool.
    pub pool: &'a KvPool,
}

/// Blocks a pool of `config`'s size holds at `block_bytes` a block: `num_blocks` if given, else
/// as many as `kv_cache_mb` fits (at least one).
pub(crate) fn pool_blocks(config: &EngineConfig, block_bytes: usize) -> usize {
    config
        .num_blocks
        .unwrap_or(config.kv_cache_mb * (1 << 20) / block_bytes)
        .max(1)
}

/// The CPU model over a host KV pool.
pub struct CpuBackend {
    model: LlamaModel,
    kv: KvPool,
    /// The latest forward's split by op, while profiling.
    ops: Option<OpTimes>,
}

impl CpuBackend {
    /// The CPU model with a pool of the configured size and dtype (`config` checked: see
    /// [`EngineConfig::check`]).
    pub fn new(model: LlamaModel, config: &EngineConfig) -> Result<Self, EngineError> {
        let layout = model.kv_layout(config.block_size);
        let layers = model.config.num_layers;
        let block_bytes = KvPool::bytes_per_block(layout, config.kv_dtype, layers);
        let kv = KvPool::new(
            layout,
            config.kv_dtype,
            layers,
            pool_blocks(config, block_bytes),
        )
        .map_err(|e| EngineError::Startup(format!("allocating the KV pool: {e}")))?;
        Ok(Self {
            model,
            kv,
            ops: None,
        })
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &LlamaConfig {
        &self.model.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        let times = self.ops.as_mut().map(|t| {
            *t = OpTimes::default();
            t
        });
        self.model.forward_timed(seqs, &mut self.kv, times)
    }

    fn profile_ops(&mut self, on: bool) -> bool {
        self.ops = on.then(OpTimes::default);
        true
    }

    fn take_op_times(&mut self) -> Option<OpTimes> {
        self.ops
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        for &(from, to) in pairs {
            self.kv.copy_block(from.0 as usize, to.0 as usize);
        }
        Ok(())
    }

    fn host_pool(&self) -> Option<&KvPool> {
        Some(&self.kv)
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    fn kv_bytes_per_token(&self) -> f64 {
        let kv = &self.kv;
        KvPool::bytes_per_token(kv.layout, kv.dtype, kv.num_layers)
    }

    fn kv_dtype_name(&self) -> &'static str {
        self.kv.dtype.name()
    }

    fn device(&self) -> String {
        "cpu".into()
    }

    fn cpu_model(&self) -> Option<&LlamaModel> {
        Some(&self.model)
    }

    fn is_cpu(&self) -> bool {
        true
    }
}

impl GpuLlama {
    /// `loaded`'s weights in bf16 on CUDA device `ordinal`, with a bf16 pool of the configured
    /// size. The cache is the model's dtype there: `--kv-dtype int8` is refused.
    pub fn for_engine(
        ordinal: usize,
        loaded: &LoadedModel,
        config: &EngineConfig,
    ) -> Result<Self, EngineError> {
        config.check()?;
        if config.kv_dtype != KvDtype::F32 {
            return Err(EngineError::Config(format!(
                "--kv-dtype {} is for the CPU cache only; on a CUDA device the cache is bf16 (leave --kv-dtype at its default)",
                config.kv_dtype
            )));
        }
        let c = &loaded.config;
        let block_bytes = GpuLlama::kv_bytes_per_block(c, config.block_size);
        let blocks = pool_blocks(config, block_bytes);
        GpuLlama::from_tensors(ordinal, c, &loaded.tensors, config.block_size, blocks)
    }
}

impl Backend for GpuLlama {
    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        GpuLlama::forward(self, seqs)
    }

    fn picks_on_device(&self) -> bool {
        true
    }

    fn forward_argmax(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<(u32, f32)>, EngineError> {
        self.forward_greedy(seqs)
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        GpuLlama::copy_blocks(self, pairs)
    }

    fn weight_bytes(&self) -> usize {
        GpuLlama::weight_bytes(self)
    }

    fn kv_bytes_per_token(&self) -> f64 {
        GpuLlama::kv_bytes_per_token(self) as f64
    }

    fn kv_dtype_name(&self) -> &'static str {
        "bf16"
    }

    fn device(&self) -> String {
        self.ops.gpu.to_string()
    }
}

/// The backend `device` names for `loaded`: the CPU model with its weights held as `format`
/// says, split over `tp`'s rank threads when it has more than one, or the model uploaded to a
/// CUDA device.
pub fn on(
    device: DeviceSpec,
    loaded: &LoadedModel,
    config: &EngineConfig,
    format: WeightFormat,
    tp: TpCpuConfig,
) -> Result<Box<dyn Backend>, EngineError> {
    config.check()?;
    Ok(match device {
        DeviceSpec::Cpu if tp.size > 1 => Box::new(TpCpuBackend::new(loaded, format, config, tp)?),
        DeviceSpec::Cpu => Box::new(CpuBackend::new(LlamaModel::new(loaded, format)?, config)?),
        DeviceSpec::Cuda(_) if tp.size > 1 => {
            return Err(EngineError::Unsupported(format!(
                "--tp {} on a CUDA device: the NCCL ranks are not built yet (run --tp 1 on a GPU, or --tp on --device cpu)",
                tp.size
            )))
        }
        DeviceSpec::Cuda(n) => Box::new(GpuLlama::for_engine(n, loaded, config)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tiny_model;
    use crate::sampler::Sampler;
    use tandem_types::ValidSampling;

    /// What a device's argmax step must return: per row, the token and log-probability the
    /// host sampler would have produced from the logits.
    #[test]
    fn argmax_steps_pick_what_the_sampler_would() {
        let config = EngineConfig {
            num_blocks: Some(8),
            ..EngineConfig::default()
        };
        let mut b = CpuBackend::new(tiny_model(3), &config).unwrap();
        assert!(!b.picks_on_device());
        assert_eq!(b.kv_dtype_name(), "f32");
        assert_eq!(b.device(), "cpu");
        let (p0, p1) = ([5u32, 9, 2, 7], [11u32, 3]);
        let (t0, t1) = ([0u32, 1], [2u32]);
        let batch = [
            SeqBatch {
                tokens: &p0,
                cached: 0,
                block_table: &t0,
                want_logits: true,
            },
            SeqBatch {
                tokens: &p1,
                cached: 0,
                block_table: &t1,
                want_logits: true,
            },
        ];
        let logits = b.forward(&batch).unwrap();
        let picks = b.forward_argmax(&batch).unwrap();
        let vocab = b.config().vocab_size;
        assert_eq!(picks.len(), 2);
        for (row, &(token, logprob)) in logits.chunks_exact(vocab).zip(&picks) {
            let mut s = Sampler::new(ValidSampling::default(), &[], None);
            assert!(s.argmax_only());
            let want = s.sample(row);
            assert_eq!((want.token, want.logprob), (token, logprob));
            let mut a = Sampler::new(ValidSampling::default(), &[], None);
            assert_eq!(a.accept(token, logprob), want);
        }
    }
}
