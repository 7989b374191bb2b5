//! The Llama model on a CUDA GPU: its weights in bf16 in device memory, the KV pool there too,
//! and the op set of [`crate::forward`] in bf16 with f32 accumulation. Block ids and tables are
//! the block manager's, so the scheduler is the same on either device.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tandem_kernels::cuda::runtime::{
    AttnBatch, CopyEvent, CopyStream, CudaOps, CudaSlice, OpTimer, PinnedHost, StepProfile,
};
use tandem_kernels::ops::RopeTable;
use tandem_kernels::KvLayout;
use tandem_kv_transfer::Float;
use tandem_model::{ModelConfig, TensorData, TensorName};

use crate::backend::{Backend, PoolSize};
use crate::device::ranks::StepOut;
use crate::device::staging::{Completion, DeviceKv, DeviceKvFormat, InFlight, Pinned, PinnedMem};
use crate::error::EngineError;
use crate::forward::{self, ModelWeights, PackedStep, SeqBatch, StepOps};
use crate::kv_cache::KvDtype;
use crate::shard::{vocab_pieces, Part, TpShard};
use tandem_collective::{Collective, NcclRank};
use tandem_model::LoadedModel;
use tandem_types::BlockId;

/// bf16 values as their bits, which is how device buffers hold them.
type Bf16 = CudaSlice<u16>;

/// A Llama model and its paged bf16 KV pool on one CUDA device.
pub struct CudaModel {
    /// The model's shape.
    pub config: ModelConfig,
    /// The part of the model this device holds: the whole, or a tensor-parallel rank's share
    /// (its heads and their slice of the pool, its MLP features, its slice of the vocabulary).
    pub shard: TpShard,
    /// The GPU's stream and kernels every step runs through.
    pub ops: CudaOps,
    weights: ModelWeights<Bf16, Bf16>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    max_pos: usize,
    /// Per layer: [blocks][kv heads][block_size][head_dim].
    k_cache: Vec<Bf16>,
    v_cache: Vec<Bf16>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the device pool.
    pub num_blocks: usize,
    /// The pool as KV transfers reach it.
    pub(crate) kv: Arc<CudaKv>,
}

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}

/// Work a profiled step queues on the stream ahead of itself ([`CudaModel::profile_greedy`]).
pub type LeadWork<'a> = &'a mut dyn FnMut(&CudaOps) -> Result<(), EngineError>;

impl CudaModel {
    /// Uploads a model's tensors (decoded to f32, rounded to bf16) to device `ordinal` and makes a
    /// KV pool of `num_blocks` blocks of `block_size` tokens.
    pub fn from_tensors(
        ordinal: usize,
        config: &ModelConfig,
        tensors: &BTreeMap<String, TensorData>,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let shard = TpShard::whole(config);
        let (ops, weights) = Self::upload(ordinal, config, tensors, &shard)?;
        Self::assemble(ops, config, shard, weights, block_size, num_blocks)
    }

    /// `shard`'s part of a model's tensors (decoded to f32, rounded to bf16) uploaded to device
    /// `ordinal`: the device's ops and the weights, waited for.
    pub(crate) fn upload(
        ordinal: usize,
        config: &ModelConfig,
        tensors: &BTreeMap<String, TensorData>,
        shard: &TpShard,
    ) -> Result<(CudaOps, ModelWeights<Bf16, Bf16>), EngineError> {
        Self::check_family(config)?;
        let ops = CudaOps::new(ordinal)?;
        let up = |parts: &[Part]| -> Result<Bf16, EngineError> {
            let mut all = Vec::new();
            for p in parts {
                all.extend(bf16_bits(&p.tensor(tensors)?.to_f32()?));
            }
            Ok(ops.upload(&all)?)
        };
        let weights = ModelWeights::build(config, shard, up, up)?;
        ops.synchronize()?;
        Ok((ops, weights))
    }

    /// A model of `config`'s shape with random weights made on the device (benchmarks: no
    /// download, no host copy of billions of values).
    pub fn random(
        ordinal: usize,
        config: &ModelConfig,
        seed: u64,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        Self::check_family(config)?;
        let ops = CudaOps::new(ordinal)?;
        let made = Cell::new(0u64);
        let rnd = |parts: &[Part], scale: f32| -> Result<Bf16, EngineError> {
            let len: usize = parts.iter().map(|p| p.elems(config)).sum();
            let mut x = ops.alloc_bf16(len)?;
            made.set(made.get() + 1);
            let s = seed.wrapping_mul(1_000_003).wrapping_add(made.get());
            ops.fill_random(&mut x, s, scale)?;
            Ok(x)
        };
        let weights = ModelWeights::build(
            config,
            &TpShard::whole(config),
            // The embedding's rows are looked up, not multiplied: unit scale, like the norms.
            |parts| {
                rnd(
                    parts,
                    if parts == [Part::whole(TensorName::Embedding)] {
                        1.0
                    } else {
                        0.02
                    },
                )
            },
            |parts| rnd(parts, 1.0),
        )?;
        let shard = TpShard::whole(config);
        Self::assemble(ops, config, shard, weights, block_size, num_blocks)
    }

    /// The CUDA forward runs Llama and Mistral layers (Mistral's context stopped at its sliding
    /// window); Qwen's biases and head norms are the CPU's for now.
    fn check_family(config: &ModelConfig) -> Result<(), EngineError> {
        let f = config.family;
        if f.qkv_bias() || f.qk_norm() {
            return Err(EngineError::Unsupported(format!(
                "{f:?} models on a GPU (its q/k/v biases or head norms are not built for CUDA yet): run them with --device cpu"
            )));
        }
        Ok(())
    }

    pub(crate) fn assemble(
        ops: CudaOps,
        config: &ModelConfig,
        shard: TpShard,
        weights: ModelWeights<Bf16, Bf16>,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let mut c = config.clone();
        if let Some(w) = c.sliding_window.take() {
            // The CUDA kernels attend to the whole context: within the window that is the
            // model's sliding attention exactly, so the context stops at the window here.
            if w < c.max_position_embeddings {
                tracing::warn!(
                    window = w,
                    "the CUDA attention has no sliding window yet: the context stops at the window (the CPU backend serves the whole context)"
                );
                c.max_position_embeddings = w;
            }
        }
        let rope = RopeTable::new(
            &c.rope_inv_freq(),
            c.rope_position_scale(),
            c.max_position_embeddings,
        );
        let (cos, sin) = rope.tables();
        // The pool holds this device's KV heads.
        let local = shard.local_config(&c);
        let per_layer = num_blocks * local.num_kv_heads * block_size * c.head_dim;
        let mut k_cache = Vec::with_capacity(c.num_layers);
        let mut v_cache = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            k_cache.push(ops.alloc_bf16(per_layer)?);
            v_cache.push(ops.alloc_bf16(per_layer)?);
        }
        let kv = Arc::new(CudaKv::new(
            &ops, &local, &k_cache, &v_cache, block_size, num_blocks,
        )?);
        Ok(Self {
            kv,
            cos: ops.upload(cos)?,
            sin: ops.upload(sin)?,
            max_pos: rope.max_pos(),
            ops,
            weights,
            k_cache,
            v_cache,
            block_size,
            num_blocks,
            config: c,
            shard,
        })
    }

    /// Copies each `(from, to)` block's K and V, every layer (copy-on-write of a shared block).
    pub fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        let c = &self.config;
        let len = self.shard.kv_heads.len() * self.block_size * c.head_dim;
        for &(from, to) in pairs {
            let (from, to) = (from.0 as usize * len, to.0 as usize * len);
            for cache in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
                self.ops.copy_within(cache, from, to, len)?;
            }
        }
        Ok(())
    }

    /// Bytes of weights one decode step reads (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        2 * self.weights.matrices().map(|m| m.len()).sum::<usize>()
    }

    /// Bytes of K and V per token of context, all layers (this device's heads).
    pub fn kv_bytes_per_token(&self) -> usize {
        Self::kv_bytes_per_block(&self.shard.local_config(&self.config), 1)
    }

    /// Bytes of one block of `block_size` tokens in the bf16 pool, K and V of every layer.
    pub fn kv_bytes_per_block(c: &ModelConfig, block_size: usize) -> usize {
        2 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * block_size
    }

    /// Fills every cache block with random values (benchmarks that need long contexts without
    /// prefilling them).
    pub fn randomize_cache(&mut self, seed: u64) -> Result<(), EngineError> {
        for (i, (k, v)) in self.k_cache.iter_mut().zip(&mut self.v_cache).enumerate() {
            self.ops.fill_random(k, seed ^ (2 * i as u64 + 1), 1.0)?;
            self.ops.fill_random(v, seed ^ (2 * i as u64 + 2), 1.0)?;
        }
        Ok(())
    }

    /// Runs one packed step; returns f32 logits (vocab each) for the sequences with
    /// `logits` rows, in order, as [`crate::CpuModel::forward`] does.
    pub fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        match self.forward_device(seqs, None, None)?.0 {
            Some((logits, _)) => Ok(self.ops.download(&logits)?),
            None => Ok(Vec::new()),
        }
    }

    /// One packed step that picks each next token on the device (argmax), so only the ids and
    /// their log-probabilities come back: what a greedy decode step costs.
    pub fn forward_greedy(
        &mut self,
        seqs: &[SeqBatch<'_>],
    ) -> Result<Vec<(u32, f32)>, EngineError> {
        let Some((logits, n)) = self.forward_device(seqs, None, None)?.0 else {
            return Ok(Vec::new());
        };
        self.argmax(&logits, n)
    }

    /// [`Self::forward_greedy`] with an event before and after each op (benchmarks): the step's
    /// device time by op (see [`OpTimer`] for what a span holds). `lead`, where given, queues
    /// work on the stream first, so that the device is still busy with it while the host queues
    /// the whole step: the spans are then the ops' own device time.
    pub fn profile_greedy(
        &mut self,
        seqs: &[SeqBatch<'_>],
        lead: Option<LeadWork<'_>>,
    ) -> Result<StepProfile, EngineError> {
        if let Some(lead) = lead {
            lead(&self.ops)?;
        }
        // About ten ops a layer, and the step's own.
        let timer = self.ops.op_timer(10 * self.weights.layers.len() + 8)?;
        let (out, timer) = self.forward_device(seqs, None, Some(timer))?;
        let mut timer =
            timer.ok_or_else(|| EngineError::Internal("a step lost its timer".into()))?;
        if let Some((logits, n)) = out {
            timer.begin(&self.ops.stream, "pick and download")?;
            let picks = self.argmax(&logits, n);
            timer.end(&self.ops.stream)?;
            picks?;
        }
        Ok(timer.finish()?)
    }

    /// Each of `n` rows of logits' argmax and its log-probability, picked on the device.
    fn argmax(&self, logits: &CudaSlice<f32>, n: usize) -> Result<Vec<(u32, f32)>, EngineError> {
        let mut ids = self.ops.upload(&vec![-1i32; n])?;
        let mut logprobs = self.ops.alloc_f32(n)?;
        self.ops
            .argmax(logits, n, self.config.vocab_size, &mut ids, &mut logprobs)?;
        let ids = self.ops.download(&ids)?;
        let logprobs = self.ops.download(&logprobs)?;
        Ok(ids
            .into_iter()
            .zip(logprobs)
            .map(|(i, lp)| (i as u32, lp))
            .collect())
    }

    /// One packed step of a tensor-parallel rank, in lockstep with its group's other ranks
    /// through `comm`: rank 0's logits (or picks), nothing from the others.
    pub(crate) fn forward_rank(
        &mut self,
        seqs: &[SeqBatch<'_>],
        picks: bool,
        comm: &mut NcclRank,
    ) -> Result<StepOut, EngineError> {
        let rank = self.shard.rank;
        let (out, _) = self.forward_device(seqs, Some(comm), None)?;
        Ok(match (out, rank, picks) {
            (Some((logits, n)), 0, true) => StepOut::Picks(self.argmax(&logits, n)?),
            (Some((logits, _)), 0, false) => StepOut::Logits(self.ops.download(&logits)?),
            _ => StepOut::Logits(Vec::new()),
        })
    }

    /// The step's logits left on the device, with their row count; None when no sequence wants
    /// them (after the step has finished). A tensor-parallel rank exchanges through `comm` and
    /// waits for its collectives under the group's watchdog before returning. `timer`, given
    /// back, marks each op.
    #[allow(clippy::type_complexity)]
    fn forward_device(
        &mut self,
        seqs: &[SeqBatch<'_>],
        comm: Option<&mut NcclRank>,
        timer: Option<OpTimer>,
    ) -> Result<(Option<(CudaSlice<f32>, usize)>, Option<OpTimer>), EngineError> {
        let c = &self.config;
        let step = PackedStep::new(
            seqs,
            c.vocab_size,
            self.max_pos,
            self.block_size,
            self.num_blocks,
        )?;
        let t = step.tokens.len();
        if t == 0 {
            return Ok((None, timer));
        }
        let n = step.logit_rows.len();
        // The step's inputs (ids, positions, slots, the attention batch) go up first.
        let mut timer = timer;
        if let Some(t) = timer.as_mut() {
            t.begin(&self.ops.stream, "inputs")?;
        }
        let mut ops = CudaStep::new(
            &self.ops,
            c,
            &self.shard,
            (&self.cos, &self.sin),
            (&mut self.k_cache, &mut self.v_cache),
            self.block_size,
            &step,
            comm,
        )?;
        if let Some(t) = timer.as_mut() {
            t.end(&self.ops.stream)?;
        }
        ops.timer = timer;
        let layers = self.weights.layers.len();
        let logits = forward::forward(
            &mut ops,
            &self.weights,
            c,
            &self.shard,
            t,
            n,
            layers,
            !step.lora.is_empty(),
            None,
        )?;
        if let Some(comm) = ops.comm.as_mut() {
            // A peer that never comes fails the step here, not in the copy of the logits.
            comm.wait_queued()?;
        }
        Ok((logits.map(|l| (l, n)), ops.timer.take()))
    }
}

/// One packed step on a CUDA device: the op set of [`crate::forward`] over the device pool, with
/// the step's inputs uploaded once.
struct CudaStep<'a> {
    o: &'a CudaOps,
    hidden: usize,
    /// (q heads, kv heads, head dim).
    heads: (usize, usize, usize),
    eps: f32,
    rope: (&'a CudaSlice<f32>, &'a CudaSlice<f32>),
    k_cache: &'a mut [Bf16],
    v_cache: &'a mut [Bf16],
    block_size: usize,
    ids: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    /// None when no row wants logits (the step ends before the head).
    logit_rows: Option<CudaSlice<i32>>,
    batch: AttnBatch,
    /// A tensor-parallel rank's group.
    comm: Option<&'a mut NcclRank>,
    /// The rank's slice of the vocabulary (all of it for the whole model) and the whole's size.
    vocab: (std::ops::Range<usize>, usize),
    /// The step's token ids as indices into the rank's slice of the embedding (-1: another
    /// rank's token); None for the whole model, which looks up `ids`.
    local_ids: Option<CudaSlice<i32>>,
    /// Events around each op, where a benchmark asks where the time goes.
    timer: Option<OpTimer>,
}

impl<'a> CudaStep<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        o: &'a CudaOps,
        c: &ModelConfig,
        shard: &TpShard,
        rope: (&'a CudaSlice<f32>, &'a CudaSlice<f32>),
        (k_cache, v_cache): (&'a mut [Bf16], &'a mut [Bf16]),
        block_size: usize,
        step: &PackedStep<'_>,
        comm: Option<&'a mut NcclRank>,
    ) -> Result<Self, EngineError> {
        // A group of one (a test's) exchanges nothing, but waits as a group does.
        if !shard.is_whole() && comm.is_none() {
            return Err(EngineError::Internal(format!(
                "a CUDA step of rank {} of {} without its group",
                shard.rank, shard.size
            )));
        }
        let i32s = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
        let ids: Vec<i32> = step.tokens.iter().map(|&x| x as i32).collect();
        let slots: Vec<i64> = step.slots.iter().map(|&s| s as i64).collect();
        let tables: Vec<&[u32]> = step.seqs.iter().map(|s| s.block_table).collect();
        let q_len: Vec<usize> = step.seqs.iter().map(|s| s.q_len).collect();
        let context: Vec<usize> = step.seqs.iter().map(|s| s.context).collect();
        let logit_rows = match step.logit_rows.is_empty() {
            true => None,
            false => Some(o.upload(&i32s(&step.logit_rows))?),
        };
        let local_ids = match shard.is_whole() {
            true => None,
            false => Some(o.upload(&vocab_slice_ids(&step.tokens, &shard.vocab))?),
        };
        Ok(Self {
            o,
            hidden: c.hidden_size,
            heads: (shard.q_heads.len(), shard.kv_heads.len(), c.head_dim),
            eps: c.rms_norm_eps,
            rope,
            k_cache,
            v_cache,
            block_size,
            ids: o.upload(&ids)?,
            positions: o.upload(&i32s(&step.positions))?,
            slots: o.upload(&slots)?,
            logit_rows,
            batch: o.attn_batch(&tables, &q_len, &context, (shard.q_heads.len(), c.head_dim))?,
            comm,
            vocab: (shard.vocab.clone(), c.vocab_size),
            local_ids,
            timer: None,
        })
    }

    /// Runs `f`, an op called `what`, between two of the timer's events where there is one.
    fn timed<T>(
        &mut self,
        what: &'static str,
        f: impl FnOnce(&mut Self) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if let Some(t) = self.timer.as_mut() {
            t.begin(&self.o.stream, what)?;
        }
        let out = f(self)?;
        if let Some(t) = self.timer.as_mut() {
            t.end(&self.o.stream)?;
        }
        Ok(out)
    }
}

impl StepOps for CudaStep<'_> {
    type Act = Bf16;
    type Logits = CudaSlice<f32>;
    type Matrix = Bf16;
    type Vector = Bf16;

    fn alloc(&self, len: usize) -> Result<Bf16, EngineError> {
        Ok(self.o.alloc_bf16(len)?)
    }

    fn alloc_logits(&self, len: usize) -> Result<CudaSlice<f32>, EngineError> {
        Ok(self.o.alloc_f32(len)?)
    }

    fn embed(&mut self, table: &Bf16, out: &mut Bf16) -> Result<(), EngineError> {
        // A rank's slice: its tokens' rows, zeros for the others (the all-reduce that follows
        // adds the one rank's row that holds each token).
        self.timed("embedding", |s| {
            let ids = s.local_ids.as_ref().unwrap_or(&s.ids);
            Ok(s.o.embedding(ids, table, out, s.hidden)?)
        })
    }

    fn rms_norm(
        &mut self,
        x: &Bf16,
        w: &Bf16,
        out: &mut Bf16,
        rows: usize,
    ) -> Result<(), EngineError> {
        self.timed("norms", |s| Ok(s.o.rms_norm(x, w, out, rows, s.eps)?))
    }

    fn add_rms_norm(
        &mut self,
        x: &mut Bf16,
        delta: &Bf16,
        w: &Bf16,
        out: &mut Bf16,
        rows: usize,
    ) -> Result<(), EngineError> {
        self.timed("norms", |s| {
            Ok(s.o.add_rms_norm(x, delta, w, out, rows, s.eps)?)
        })
    }

    fn matmul(
        &mut self,
        w: &Bf16,
        x: &Bf16,
        mnk: (usize, usize, usize),
        out: &mut Bf16,
    ) -> Result<(), EngineError> {
        self.timed("products", |s| Ok(s.o.gemm(x, w, out, mnk)?))
    }

    fn attention(
        &mut self,
        layer: usize,
        qkv: &mut Bf16,
        out: &mut Bf16,
    ) -> Result<(), EngineError> {
        let (nq, nkv, hd) = self.heads;
        let t = self.slots.len();
        self.timed("rotary", |s| {
            Ok(s.o.qkv_rope(qkv, &s.positions, s.rope.0, s.rope.1, t, s.heads)?)
        })?;
        self.timed("kv writes", |s| {
            Ok(s.o.write_kv(
                qkv,
                &s.slots,
                &mut s.k_cache[layer],
                &mut s.v_cache[layer],
                s.heads,
                s.block_size,
            )?)
        })?;
        self.timed("attention", |s| {
            Ok(s.o.attention(
                &mut s.batch,
                qkv,
                (nq + 2 * nkv) * hd,
                &s.k_cache[layer],
                &s.v_cache[layer],
                out,
                s.heads,
                s.block_size,
            )?)
        })
    }

    fn silu_mul(
        &mut self,
        gate_up: &Bf16,
        out: &mut Bf16,
        rows: usize,
        ff: usize,
    ) -> Result<(), EngineError> {
        self.timed("silu·mul", |s| Ok(s.o.silu_mul(gate_up, out, rows, ff)?))
    }

    fn final_norm(
        &mut self,
        x: &mut Bf16,
        delta: &Bf16,
        w: &Bf16,
        scratch: &mut Bf16,
        out: &mut Bf16,
    ) -> Result<(), EngineError> {
        let t = self.slots.len();
        self.timed("norms", |s| {
            let rows = s.logit_rows.as_ref().ok_or_else(|| {
                EngineError::Internal("the final norm of a step with no logit rows".into())
            })?;
            s.o.add_rms_norm(x, delta, w, scratch, t, s.eps)?;
            Ok(s.o.gather_rows(rows, scratch, out, s.hidden)?)
        })
    }

    fn head(
        &mut self,
        w: &Bf16,
        x: &Bf16,
        mnk: (usize, usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        self.timed("lm head", |s| Ok(s.o.gemm(x, w, out, mnk)?))
    }

    fn all_reduce(&mut self, x: &mut Bf16) -> Result<(), EngineError> {
        let comm = self.comm.as_mut().ok_or_else(|| {
            EngineError::Internal("an all-reduce in a step of the whole model".into())
        })?;
        // Every rank's partial sums gathered, then summed in rank order (not NCCL's
        // all-reduce): the same bits on every rank, whatever the step's row count.
        let mut parts = self.o.alloc_bf16(comm.size() * x.len())?;
        comm.all_gather_bf16_queued(x, &mut parts)?;
        Ok(self.o.sum_ranks(&parts, comm.size(), x)?)
    }

    fn gather_logits(
        &mut self,
        local: &CudaSlice<f32>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let o = self.o;
        let comm = self.comm.as_mut().ok_or_else(|| {
            EngineError::Internal("a gather of logits in a step of the whole model".into())
        })?;
        // Each rank's rows padded to an equal slice of the vocabulary, gathered rank after
        // rank, then laid out row after row: as the CPU's ranks do (the same slices).
        let (mine, vocab) = (self.vocab.0.len(), self.vocab.1);
        let (chunk, pieces) = vocab_pieces(vocab, comm.size());
        let mut padded = o.alloc_f32(rows * chunk)?;
        o.copy_cols((local, 0, mine.max(1)), (&mut padded, 0, chunk), rows, mine)?;
        let mut all = o.alloc_f32(comm.size() * rows * chunk)?;
        comm.all_gather_f32_queued(&padded, &mut all)?;
        for (r, &(from, len)) in pieces.iter().enumerate() {
            o.copy_cols(
                (&all, r * rows * chunk, chunk),
                (out, from, vocab),
                rows,
                len,
            )?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), EngineError> {
        match self.comm.as_mut() {
            // Waited for under the group's watchdog: a peer that never comes fails the step.
            Some(comm) => Ok(comm.wait_queued()?),
            None => Ok(self.o.synchronize()?),
        }
    }
}

/// `tokens` as indices into the rows `vocab` of a rank's slice of the embedding, -1 for a token
/// outside it (the embedding kernel gives it zeros).
fn vocab_slice_ids(tokens: &[u32], vocab: &std::ops::Range<usize>) -> Vec<i32> {
    tokens
        .iter()
        .map(|&t| match vocab.contains(&(t as usize)) {
            true => (t as usize - vocab.start) as i32,
            false => -1,
        })
        .collect()
}

impl CudaModel {
    /// `loaded`'s weights in bf16 on CUDA device `ordinal`, with a bf16 pool of the configured
    /// size. The cache is the model's dtype there: `--kv-dtype int8` is refused.
    pub fn for_engine(
        ordinal: usize,
        loaded: &LoadedModel,
        pool: &PoolSize,
    ) -> Result<Self, EngineError> {
        pool.check()?;
        if pool.kv_dtype != KvDtype::F32 {
            return Err(EngineError::Config(format!(
                "--kv-dtype {} is for the CPU cache only; on a CUDA device the cache is bf16 (leave --kv-dtype at its default)",
                pool.kv_dtype
            )));
        }
        let c = &loaded.config;
        let block_bytes = CudaModel::kv_bytes_per_block(c, pool.block_size);
        let shard = TpShard::whole(c);
        let (ops, weights) = CudaModel::upload(ordinal, c, &loaded.tensors, &shard)?;
        // The pool takes what the weights leave.
        let num_blocks = match pool.gpu_memory_fraction {
            None => pool.blocks(block_bytes),
            Some(f) => {
                let (free, total) = ops.memory()?;
                blocks_for_fraction(f, free, total, block_bytes)?
            }
        };
        CudaModel::assemble(ops, c, shard, weights, pool.block_size, num_blocks)
    }
}

impl Backend for CudaModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        CudaModel::forward(self, seqs)
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
        CudaModel::copy_blocks(self, pairs)
    }

    fn weight_bytes(&self) -> usize {
        CudaModel::weight_bytes(self)
    }

    fn kv_bytes_per_token(&self) -> f64 {
        CudaModel::kv_bytes_per_token(self) as f64
    }

    fn kv_dtype_name(&self) -> &'static str {
        "bf16"
    }

    fn device_kv(&self) -> Option<Arc<dyn DeviceKv>> {
        Some(self.kv.clone())
    }

    fn device(&self) -> String {
        self.ops.gpu.to_string()
    }
}

/// The pool's blocks under `--gpu-memory-fraction f`: what `f` of the device's `total` bytes
/// leaves once everything held now (`total - free`: the weights, the kernels, other processes)
/// is counted, in blocks of `block_bytes`; refused when that is not one block.
pub(crate) fn blocks_for_fraction(
    f: f64,
    free: usize,
    total: usize,
    block_bytes: usize,
) -> Result<usize, EngineError> {
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let budget = f * total as f64 - (total - free.min(total)) as f64;
    let blocks = (budget.max(0.0) / block_bytes as f64) as usize;
    if blocks == 0 {
        return Err(EngineError::Config(format!(
            "--gpu-memory-fraction {f}: {:.0} MiB of the device's {:.0} MiB, but {:.0} MiB is held already (the weights and anything else on it): no room for one KV block of {:.2} MiB",
            mib(f * total as f64),
            mib(total as f64),
            mib((total - free.min(total)) as f64),
            mib(block_bytes as f64)
        )));
    }
    Ok(blocks)
}

impl Drop for CudaModel {
    fn drop(&mut self) {
        // The caches are freed after this: no copy may still run into or out of them.
        self.kv.retire();
    }
}

/// The CUDA pool as KV transfers reach it ([`DeviceKv`]): each layer's K and V allocations by
/// device address, copied through page-locked memory on a stream of their own.
pub(crate) struct CudaKv {
    fmt: DeviceKvFormat,
    copies: CopyStream,
    /// Per layer, where its K and V allocations start; None once the model is gone (copies are
    /// queued under this lock, so none starts after the caches are freed).
    addrs: Mutex<Option<Vec<(u64, u64)>>>,
}

impl CudaKv {
    fn new(
        ops: &CudaOps,
        c: &ModelConfig,
        k: &[Bf16],
        v: &[Bf16],
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let copies = CopyStream::new(ops)?;
        let addrs = k
            .iter()
            .zip(v)
            .map(|(k, v)| (copies.address(k), copies.address(v)))
            .collect();
        Ok(Self {
            fmt: DeviceKvFormat {
                layout: KvLayout {
                    block_size,
                    num_kv_heads: c.num_kv_heads,
                    head_dim: c.head_dim,
                },
                layers: c.num_layers,
                blocks: num_blocks,
                dtype: Float::Bf16,
                // write_kv stores K as [block][kv head][slot][dim].
                k_transposed: false,
            },
            copies,
            addrs: Mutex::new(Some(addrs)),
        })
    }

    /// Waits for every copy and refuses any later one: the caches are about to be freed.
    fn retire(&self) {
        let mut a = self.addrs.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = self.copies.synchronize() {
            tracing::error!(error = %e, "KV copies failed as the device pool was freed");
        }
        *a = None;
    }

    /// Queues a copy of each frame between the pool and `buf` (frame after frame) and records
    /// its completion.
    fn queue(
        &self,
        mut buf: Pinned,
        frames: &[(usize, usize)],
        upload: bool,
    ) -> Result<InFlight, EngineError> {
        let n = self.fmt.frame_bytes();
        let half = n / 2;
        self.fmt.check_copy(frames, buf.len())?;
        let guard = self.addrs.lock().unwrap_or_else(|p| p.into_inner());
        let addrs = guard
            .as_ref()
            .ok_or_else(|| EngineError::Device("the device's KV pool is gone".into()))?;
        // An export goes after the steps queued so far: it reads what they computed. An import
        // does not wait for them: its blocks are reserved, so no step queued reads or writes
        // them (a freed block's last step finished before it was freed: every step ends with
        // the host reading its results), and its copies overlap the steps.
        let ordered = match upload {
            true => Ok(()),
            false => self.copies.after_compute(),
        };
        let queued = ordered.and_then(|()| {
            for (i, &(layer, block)) in frames.iter().enumerate() {
                let (k, v) = addrs[layer];
                let at = (block * half) as u64;
                let frame = &mut buf.bytes_mut()[i * n..(i + 1) * n];
                let (fk, fv) = frame.split_at_mut(half);
                // SAFETY: (layer, block) is inside the pool (check_copy), whose allocations
                // outlive every copy (`retire` waits for them under this lock); the buffer
                // travels in the InFlight that waits for the event recorded below (or, on an
                // error, outlives the wait below), and the blocks' owner leaves them alone
                // until then (DeviceKv's contract).
                unsafe {
                    match upload {
                        true => {
                            self.copies.to_device(k + at, fk)?;
                            self.copies.to_device(v + at, fv)?;
                        }
                        false => {
                            self.copies.to_host(fk, k + at)?;
                            self.copies.to_host(fv, v + at)?;
                        }
                    }
                }
            }
            Ok(())
        });
        match queued.and_then(|()| self.copies.record()) {
            Ok(done) => Ok(InFlight::new(buf, Box::new(CudaDone(done)))),
            Err(e) => {
                // Copies queued before the failure must finish before the buffer is freed.
                let _ = self.copies.synchronize();
                Err(e.into())
            }
        }
    }
}

struct CudaPinned(PinnedHost);

impl PinnedMem for CudaPinned {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}

struct CudaDone(CopyEvent);

impl Completion for CudaDone {
    fn ready(&self) -> Result<bool, String> {
        self.0.ready().map_err(|e| e.to_string())
    }
    fn wait(&self) -> Result<(), String> {
        self.0.wait().map_err(|e| e.to_string())
    }
}

impl DeviceKv for CudaKv {
    fn format(&self) -> DeviceKvFormat {
        self.fmt
    }

    fn pinned(&self, bytes: usize) -> Result<Pinned, EngineError> {
        Ok(Pinned::new(Box::new(CudaPinned(
            self.copies.pinned(bytes)?,
        ))))
    }

    fn download(&self, frames: &[(usize, usize)], buf: Pinned) -> Result<InFlight, EngineError> {
        self.queue(buf, frames, false)
    }

    unsafe fn upload(
        &self,
        buf: Pinned,
        frames: &[(usize, usize)],
    ) -> Result<InFlight, EngineError> {
        self.queue(buf, frames, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's embedding looks up its own tokens by their row in its slice, and gives the
    /// others zeros.
    #[test]
    fn a_rank_looks_up_its_slice_of_the_vocabulary() {
        assert_eq!(
            vocab_slice_ids(&[0, 24, 25, 49, 50, 99], &(25..50)),
            vec![-1, -1, 0, 24, -1, -1]
        );
        assert_eq!(vocab_slice_ids(&[3, 7], &(0..8)), vec![3, 7]);
    }

    /// The pool takes what the fraction leaves after everything held, in whole blocks; a
    /// fraction the weights already fill is refused saying how much is held.
    #[test]
    fn a_memory_fraction_sizes_the_pool_after_what_is_held() {
        let gib = 1usize << 30;
        let mib = 1usize << 20;
        // 80 GiB, 16 GiB held: 0.9 of 80 is 72, less 16 leaves 56 GiB of 2 MiB blocks.
        assert_eq!(
            blocks_for_fraction(0.9, 64 * gib, 80 * gib, 2 * mib).unwrap(),
            56 * 512
        );
        assert_eq!(
            blocks_for_fraction(1.0, 10 * mib, 10 * mib, 3 * mib).unwrap(),
            3
        );
        let e = blocks_for_fraction(0.2, 64 * gib, 80 * gib, 2 * mib)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("16384 MiB of the device's 81920 MiB, but 16384 MiB is held"),
            "{e}"
        );
    }
}
