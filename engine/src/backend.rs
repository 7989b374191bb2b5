//! Where the engine's steps run: the CPU model over a host KV pool, or the CUDA model over a
//! device pool. The scheduler, block manager and sampler are the same for both; they see only
//! [`Backend::forward`] (logits for the rows that want them) and the pool's size in blocks.

use tandem_kernels::cuda::DeviceSpec;
use tandem_model::{LlamaConfig, LoadedModel};

use crate::engine::EngineConfig;
use crate::gpu::GpuLlama;
use crate::kv_cache::{KvDtype, KvPool};
use crate::model::{LlamaModel, SeqBatch};
use crate::EngineError;

// One per engine, built once: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Backend {
    Cpu { model: LlamaModel, kv: KvPool },
    Cuda(GpuLlama),
}

/// Blocks a pool of `config`'s size holds at `block_bytes` a block: `num_blocks` if given, else
/// as many as `kv_cache_mb` fits (at least one).
fn pool_blocks(config: &EngineConfig, block_bytes: usize) -> usize {
    config
        .num_blocks
        .unwrap_or(config.kv_cache_mb * (1 << 20) / block_bytes)
        .max(1)
}

impl Backend {
    /// The CPU model with a pool of the configured size and dtype (`config` checked: see
    /// [`EngineConfig::check`]).
    pub fn cpu(model: LlamaModel, config: &EngineConfig) -> Result<Self, EngineError> {
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
        Ok(Self::Cpu { model, kv })
    }

    /// `loaded`'s weights in bf16 on CUDA device `ordinal`, with a bf16 pool of the configured
    /// size. The cache is the model's dtype there: `--kv-dtype int8` is refused.
    pub fn cuda(
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
        let gpu = GpuLlama::from_tensors(ordinal, c, &loaded.tensors, config.block_size, blocks)?;
        Ok(Self::Cuda(gpu))
    }

    /// The backend `device` names: the CPU model (`model` builds it; only called for the CPU) or
    /// `loaded` uploaded to a CUDA device.
    pub fn on(
        device: DeviceSpec,
        loaded: &LoadedModel,
        config: &EngineConfig,
        model: impl FnOnce() -> Result<LlamaModel, EngineError>,
    ) -> Result<Self, EngineError> {
        config.check()?;
        match device {
            DeviceSpec::Cpu => Self::cpu(model()?, config),
            DeviceSpec::Cuda(n) => Self::cuda(n, loaded, config),
        }
    }

    pub fn config(&self) -> &LlamaConfig {
        match self {
            Self::Cpu { model, .. } => &model.config,
            Self::Cuda(g) => &g.config,
        }
    }

    /// One packed step over the pool; f32 logits (vocab each) for the sequences that want them.
    pub fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        match self {
            Self::Cpu { model, kv } => model.forward(seqs, kv),
            Self::Cuda(g) => g.forward(seqs),
        }
    }

    /// Whether [`Self::forward_argmax`] picks tokens where the logits are (a GPU), so a step
    /// whose samplers all take the argmax need not bring the logits back.
    pub fn picks_on_device(&self) -> bool {
        matches!(self, Self::Cuda(_))
    }

    /// One packed step that returns, for each sequence that wants logits, the argmax token and
    /// its log-probability (on a GPU, computed there).
    pub fn forward_argmax(
        &mut self,
        seqs: &[SeqBatch<'_>],
    ) -> Result<Vec<(u32, f32)>, EngineError> {
        match self {
            Self::Cuda(g) => g.forward_greedy(seqs),
            Self::Cpu { model, kv } => {
                let logits = model.forward(seqs, kv)?;
                let vocab = model.config.vocab_size;
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
        }
    }

    pub fn num_blocks(&self) -> usize {
        match self {
            Self::Cpu { kv, .. } => kv.num_blocks(),
            Self::Cuda(g) => g.num_blocks,
        }
    }

    /// The host pool, which KV transfers read from and write into; None on a GPU.
    pub fn host_pool(&self) -> Option<&KvPool> {
        match self {
            Self::Cpu { kv, .. } => Some(kv),
            Self::Cuda(_) => None,
        }
    }

    /// Bytes of weights one decode step reads.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Cpu { model, .. } => model.weight_bytes(),
            Self::Cuda(g) => g.weight_bytes(),
        }
    }

    /// Bytes of cache per token of context, all layers.
    pub fn kv_bytes_per_token(&self) -> f64 {
        match self {
            Self::Cpu { kv, .. } => KvPool::bytes_per_token(kv.layout, kv.dtype, kv.num_layers),
            Self::Cuda(g) => g.kv_bytes_per_token() as f64,
        }
    }

    /// The cache's element type, as workers advertise it.
    pub fn kv_dtype_name(&self) -> &'static str {
        match self {
            Self::Cpu { kv, .. } => kv.dtype.name(),
            Self::Cuda(_) => "bf16",
        }
    }

    /// Where steps run, for logs and benchmark headers.
    pub fn device(&self) -> String {
        match self {
            Self::Cpu { .. } => "cpu".into(),
            Self::Cuda(g) => g.ops.gpu.to_string(),
        }
    }
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
        let mut b = Backend::cpu(tiny_model(3), &config).unwrap();
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
            let mut s = Sampler::new(ValidSampling::default(), &[]);
            assert!(s.argmax_only());
            let want = s.sample(row);
            assert_eq!((want.token, want.logprob), (token, logprob));
            let mut a = Sampler::new(ValidSampling::default(), &[]);
            assert_eq!(a.accept(token, logprob), want);
        }
    }
}
