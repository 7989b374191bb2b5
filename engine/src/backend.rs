//! Where the engine's steps run. The scheduler, block manager and sampler are the same on every
//! device; they see a [`Backend`]: one packed step's logits (or picks) and the pool's size in
//! blocks. The devices that implement it are in [`crate::device`]; tests drive the scheduler with
//! fakes. A backend is built from a [`PoolSize`], not from the scheduler's configuration.

use std::time::Duration;

use tandem_model::ModelConfig;

use crate::error::EngineError;
use crate::forward::{OpTimes, SeqBatch};
use crate::kv_cache::{KvDtype, KvPool};
use tandem_types::BlockId;

/// A device that runs the model's steps over its KV pool.
pub trait Backend: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;

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

    /// An early exit: one packed step through the model's first `layers` layers only, then its
    /// final norm and head (a self-draft's proposals); the K/V of those layers is written as
    /// the whole model writes it. By default refused.
    fn forward_layers(
        &mut self,
        seqs: &[SeqBatch<'_>],
        layers: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let _ = (seqs, layers);
        Err(EngineError::Unsupported(format!(
            "an early exit (a self-draft) on {}",
            self.device()
        )))
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

    /// The device's KV pool as KV transfers reach it (through page-locked staging), when the
    /// cache lives on one device rather than in host pools.
    fn device_kv(&self) -> Option<std::sync::Arc<dyn crate::device::staging::DeviceKv>> {
        None
    }

    /// Every rank's device pool with the KV heads it holds, in rank order (the one device's
    /// pool of every head without tensor parallelism); empty when the cache is in host pools.
    fn device_pools(&self) -> Vec<DevicePool> {
        self.device_kv()
            .map(|d| (0..d.format().layout.num_kv_heads as u32, d))
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

    /// Whether a step's last layer runs its output product, MLP and attention outputs only
    /// for the rows that want logits (`StepOps::keep_logit_rows`) where no adapter runs; by
    /// default every row goes on to the end.
    fn prunes_last_layer(&self) -> bool {
        false
    }

    /// Whether steps can run sequences with LoRA adapters (rows of several adapters and of
    /// the base in one step).
    fn supports_lora(&self) -> bool {
        false
    }

    /// The backend as `Any`, so the layer that knows a concrete backend can reach it (the
    /// engine's [`crate::Engine::cpu_model`]); by default nothing to reach.
    fn as_any(&self) -> &dyn std::any::Any {
        &()
    }

    /// Ranks of the tensor-parallel group the steps run on (1: no tensor parallelism).
    fn tp(&self) -> usize {
        1
    }

    /// The group's collective costs so far (None without tensor parallelism).
    fn tp_stats(&self) -> Option<TpStats> {
        None
    }

    /// A mixture of experts' rows per expert so far (None for a dense model, or a device that
    /// does not count them).
    fn expert_load(&self) -> Option<std::sync::Arc<crate::forward::ExpertLoad>> {
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

/// One tensor-parallel rank's device KV pool, as transfers reach it, and the model's KV heads
/// it holds.
pub type DevicePool = (
    std::ops::Range<u32>,
    std::sync::Arc<dyn crate::device::staging::DeviceKv>,
);

/// One tensor-parallel rank's host KV pool: the model's KV heads `heads` of every block.
pub struct RankPool<'a> {
    /// The KV heads the pool holds.
    pub heads: std::ops::Range<u32>,
    /// The pool.
    pub pool: &'a KvPool,
}

/// Collective time and traffic of a group so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TpStats {
    /// Ranks in the group.
    pub size: usize,
    /// Collectives each rank called.
    pub calls: u64,
    /// Values each rank contributed to them (f32s).
    pub values: u64,
    /// Time the ranks spent inside collectives, the mean over ranks.
    pub collective: Duration,
}

/// How big a backend's KV pool is, and how it is cut: what a backend is built from (the
/// scheduler's other settings are none of its business).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolSize {
    /// Tokens per KV block.
    pub block_size: usize,
    /// The pool's size in MiB, when `num_blocks` is not given.
    pub kv_cache_mb: usize,
    /// The pool's size in blocks, overriding `kv_cache_mb`.
    pub num_blocks: Option<usize>,
    /// The cache's element type.
    pub kv_dtype: KvDtype,
    /// On a GPU: the pool takes what this share of the device's memory leaves once everything
    /// held when it is sized (the weights, other processes) is counted; a step's activations
    /// come on top. Overrides `kv_cache_mb`. Refused on the CPU.
    pub gpu_memory_fraction: Option<f64>,
}

impl PoolSize {
    /// Blocks the pool holds at `block_bytes` a block: `num_blocks` if given, else as many as
    /// `kv_cache_mb` fits (at least one).
    pub fn blocks(&self, block_bytes: usize) -> usize {
        self.num_blocks
            .unwrap_or(self.kv_cache_mb * (1 << 20) / block_bytes)
            .max(1)
    }

    /// Refuses a pool of blocks of no tokens, and a memory fraction outside (0, 1].
    pub fn check(&self) -> Result<(), EngineError> {
        if self.block_size == 0 {
            return Err(EngineError::Config(
                "the block size must be positive".into(),
            ));
        }
        if let Some(f) = self.gpu_memory_fraction {
            if !(f > 0.0 && f <= 1.0) {
                return Err(EngineError::Config(format!(
                    "--gpu-memory-fraction {f} must be above 0 and at most 1"
                )));
            }
        }
        Ok(())
    }
}

/// A test hook around any backend: every forward and block copy takes `factor` times its own
/// running time, as on a machine that much slower (`TANDEM_TEST_SLOWDOWN`). The tests that run
/// a cluster through it show that no deadline depends on the machine's speed. It sits outside
/// the engine's step, so the normal step pays nothing for it.
pub struct Slowed {
    inner: Box<dyn Backend>,
    factor: f64,
}

impl Slowed {
    /// `inner` slowed `factor` times; a factor below 1 or not a number is refused.
    pub fn new(inner: Box<dyn Backend>, factor: f64) -> Result<Self, EngineError> {
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(EngineError::Config(format!(
                "slowdown {factor} must be a number of at least 1"
            )));
        }
        Ok(Self { inner, factor })
    }

    /// Runs `f`, then sleeps for `factor - 1` times its running time: its wall time, but no
    /// more than the CPU time the process spent meanwhile, so that a call the process was
    /// stopped (SIGSTOP) in the middle of is not stretched by the stop.
    fn slowed<T>(&mut self, f: impl FnOnce(&mut dyn Backend) -> T) -> T {
        let (t0, cpu0) = (std::time::Instant::now(), process_cpu_seconds());
        let r = f(self.inner.as_mut());
        let wall = t0.elapsed().as_secs_f64();
        let spent = match (cpu0, process_cpu_seconds()) {
            (Some(a), Some(b)) => wall.min(b - a),
            _ => wall,
        };
        std::thread::sleep(Duration::from_secs_f64(spent * (self.factor - 1.0)));
        r
    }
}

impl Backend for Slowed {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        self.slowed(|b| b.forward(seqs))
    }
    fn picks_on_device(&self) -> bool {
        self.inner.picks_on_device()
    }
    fn forward_argmax(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<(u32, f32)>, EngineError> {
        self.slowed(|b| b.forward_argmax(seqs))
    }
    fn forward_layers(
        &mut self,
        seqs: &[SeqBatch<'_>],
        layers: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.slowed(|b| b.forward_layers(seqs, layers))
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        self.slowed(|b| b.copy_blocks(pairs))
    }
    fn host_pool(&self) -> Option<&KvPool> {
        self.inner.host_pool()
    }
    fn host_pools(&self) -> Vec<RankPool<'_>> {
        self.inner.host_pools()
    }
    fn device_kv(&self) -> Option<std::sync::Arc<dyn crate::device::staging::DeviceKv>> {
        self.inner.device_kv()
    }
    fn device_pools(&self) -> Vec<DevicePool> {
        self.inner.device_pools()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn kv_bytes_per_token(&self) -> f64 {
        self.inner.kv_bytes_per_token()
    }
    fn kv_dtype_name(&self) -> &'static str {
        self.inner.kv_dtype_name()
    }
    fn device(&self) -> String {
        self.inner.device()
    }
    fn is_cpu(&self) -> bool {
        self.inner.is_cpu()
    }
    fn prunes_last_layer(&self) -> bool {
        self.inner.prunes_last_layer()
    }
    fn supports_lora(&self) -> bool {
        self.inner.supports_lora()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self.inner.as_any()
    }
    fn tp(&self) -> usize {
        self.inner.tp()
    }
    fn tp_stats(&self) -> Option<TpStats> {
        self.inner.tp_stats()
    }
    fn expert_load(&self) -> Option<std::sync::Arc<crate::forward::ExpertLoad>> {
        self.inner.expert_load()
    }
    fn profile_ops(&mut self, on: bool) -> bool {
        self.inner.profile_ops(on)
    }
    fn take_op_times(&mut self) -> Option<OpTimes> {
        self.inner.take_op_times()
    }
}

/// CPU time used by this process so far, every thread together (Unix).
fn process_cpu_seconds() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec we own.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(unix))]
    {
        None
    }
}
