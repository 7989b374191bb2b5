//! The Llama model on the CPU: its weights as tandem-kernels holds them (quantized as stored, or
//! f32) and the op set of [`crate::forward`] over a host KV pool, in f32.
//!
//! A step runs one packed batch: the new tokens of every scheduled sequence, one after another
//! (prefill chunks and single decode tokens alike). Each token carries its position and the cache
//! slot its K/V goes to; attention reads each sequence's blocks through its block table. Logits
//! are computed only for the rows that need a next token.

use std::collections::BTreeMap;
use std::sync::Arc;

use rayon::prelude::*;
use tandem_kernels::ops::{self, RopeTable};
use tandem_kernels::{
    matmul_many, paged_attention, paged_attention_strided, prepare_and_write_kv, AttnSpec,
    KvLayout, Linear, Product, SeqAttn, Weight,
};

use tandem_model::{LoadedModel, ModelConfig, TensorData};

use crate::backend::{Backend, PoolSize};
use crate::error::EngineError;
use crate::forward::{
    self, ExpertLoad, LoraSite, ModelWeights, OpTimes, PackedStep, SeqBatch, StepOps,
};
use crate::kv_cache::KvPool;
use crate::shard::{vocab_pieces, TpShard};
use tandem_collective::{Collective, SingleRank};
use tandem_types::BlockId;

/// How weights are held in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// As stored in the file (quantized stays quantized).
    #[default]
    Native,
    /// Everything decoded to f32 at load.
    F32,
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(Self::Native),
            "f32" => Ok(Self::F32),
            o => Err(format!("unknown weight format {o:?} (native|f32)")),
        }
    }
}

/// A Llama model on the CPU, or one tensor-parallel rank's share of it: its weights in host
/// memory, run over a [`KvPool`] of its KV heads.
pub struct CpuModel {
    /// The model's shape.
    pub config: ModelConfig,
    /// The part of the model this one holds (all of it outside tensor parallelism).
    pub shard: TpShard,
    /// The model as the shard sees it: its heads, MLP features and vocabulary slice.
    local: ModelConfig,
    weights: ModelWeights<Linear, Vec<f32>>,
    rope: RopeTable,
    /// Rows routed to each expert (a mixture of experts; shared by a group's ranks).
    expert_load: Option<Arc<ExpertLoad>>,
}

/// One matrix of `parts` stacked by rows (a single part is itself).
fn stack_rows(parts: Vec<Weight>) -> Result<Weight, EngineError> {
    Weight::stack(parts).map_err(|e| EngineError::Model(format!("a fused projection: {e}")))
}

impl CpuModel {
    /// Builds the model from a loaded model file, holding its weights as `format` says.
    pub fn new(m: &LoadedModel, format: WeightFormat) -> Result<Self, EngineError> {
        Self::from_tensors(&m.config, &m.tensors, format)
    }

    /// Builds the model from its config and tensors under their canonical (GGUF-style) names.
    pub fn from_tensors(
        config: &ModelConfig,
        tensors: &BTreeMap<String, TensorData>,
        format: WeightFormat,
    ) -> Result<Self, EngineError> {
        Self::shard_from_tensors(config, tensors, format, TpShard::whole(config))
    }

    /// `shard`'s part of the model from its config and tensors.
    pub fn shard_from_tensors(
        config: &ModelConfig,
        tensors: &BTreeMap<String, TensorData>,
        format: WeightFormat,
        shard: TpShard,
    ) -> Result<Self, EngineError> {
        let c = config.clone();
        let f32w = format == WeightFormat::F32;
        let weights = ModelWeights::build(
            &c,
            &shard,
            |parts| {
                let parts = parts
                    .iter()
                    .map(|p| Ok(Weight::from_tensor(p.tensor(tensors)?.as_ref(), f32w)?))
                    .collect::<Result<Vec<_>, EngineError>>()?;
                Ok(Linear::new(stack_rows(parts)?))
            },
            |parts| {
                let mut v = Vec::new();
                for p in parts {
                    v.extend(p.tensor(tensors)?.to_f32()?);
                }
                Ok(v)
            },
        )?;
        let rope = RopeTable::new(
            &c.rope_inv_freq(),
            c.rope_position_scale(),
            c.max_position_embeddings,
        );
        let expert_load = c.moe.as_ref().map(|m| Arc::new(ExpertLoad::new(m.experts)));
        Ok(Self {
            weights,
            rope,
            expert_load,
            local: shard.local_config(&c),
            shard,
            config: c,
        })
    }

    /// The shape of one layer's KV block of `block_size` tokens for this model (for a shard, of
    /// its KV heads).
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            block_size,
            num_kv_heads: self.shard.kv_heads.len(),
            head_dim: self.config.head_dim,
        }
    }

    /// Rows routed to each expert so far (a mixture of experts).
    pub fn expert_load(&self) -> Option<Arc<ExpertLoad>> {
        self.expert_load.clone()
    }

    /// Counts this model's routing into `load` (the one counter of a group's ranks).
    pub(crate) fn share_expert_load(&mut self, load: Arc<ExpertLoad>) {
        if self.expert_load.is_some() {
            self.expert_load = Some(load);
        }
    }

    /// Bytes of weights one decode step of one sequence reads (every matrix once, of a mixture
    /// of experts the share a token runs; norms are negligible).
    pub fn weight_bytes(&self) -> usize {
        self.weights_by_op().iter().map(|w| w.1).sum()
    }

    /// Each product's weights as one step reads them, summed over the layers: `(name, bytes,
    /// weights)`, named as [`OpTimes::named`] names the products. A mixture of experts' are the
    /// `router`'s and the `experts`' (every expert's times the share of them a token runs: what
    /// one token reads and multiplies by).
    pub fn weights_by_op(&self) -> Vec<(&'static str, usize, usize)> {
        let size = |l: &Linear| (l.weight().bytes(), l.weight().rows() * l.weight().cols());
        let mut by: Vec<(&'static str, usize, usize)> = Vec::new();
        let mut add = |name, (b, n): (usize, usize)| match by.iter_mut().find(|w| w.0 == name) {
            Some(w) => {
                w.1 += b;
                w.2 += n;
            }
            None => by.push((name, b, n)),
        };
        for l in &self.weights.layers {
            add("qkv", size(&l.qkv));
            add("o", size(&l.o));
            match &l.mlp {
                forward::Mlp::Dense { gate_up, down } => {
                    add("gate_up", size(gate_up));
                    add("down", size(down));
                }
                forward::Mlp::Experts(x) => {
                    add("router", size(&x.router));
                    let (b, n) = x.experts.iter().fold((0, 0), |(b, n), (gu, d)| {
                        let (gu, d) = (size(gu), size(d));
                        (b + gu.0 + d.0, n + gu.1 + d.1)
                    });
                    let share = |v: usize| v * x.active / x.total.max(1);
                    add("experts", (share(b), share(n)));
                }
            }
        }
        add("head", size(self.weights.head()));
        by
    }

    /// Projections (and the head) whose batched products run on the AMX tiles: none on CPUs
    /// without AMX.
    pub fn tiled_projections(&self) -> usize {
        self.weights.matrices().filter(|l| l.tiles()).count()
    }

    /// Runs one packed step; returns logits (vocab each) for the rows the sequences ask for (`logits`), in
    /// order.
    ///
    /// The step runs on a thread of the compute pool: its few hundred parallel regions (every
    /// product, attention, the row-wise work) then fork inside the pool. From a thread outside it,
    /// each region would be handed over and waited for, a wake-up and a sleep apiece, which costs
    /// more than the small products of a decode step.
    pub fn forward(&self, seqs: &[SeqBatch<'_>], kv: &mut KvPool) -> Result<Vec<f32>, EngineError> {
        self.forward_timed(seqs, kv, None)
    }

    /// [`Self::forward`], adding each op's time to `times` when given.
    pub fn forward_timed(
        &self,
        seqs: &[SeqBatch<'_>],
        kv: &mut KvPool,
        times: Option<&mut OpTimes>,
    ) -> Result<Vec<f32>, EngineError> {
        rayon::scope(|_| self.forward_rank(seqs, kv, &mut SingleRank, times))
    }

    /// [`Self::forward`] through the first `layers` layers only, then the final norm and the
    /// head (an early exit: a self-draft's proposals). It writes those layers' K/V at the
    /// step's positions, the bits the whole model writes there for the same tokens.
    pub fn forward_layers(
        &self,
        seqs: &[SeqBatch<'_>],
        kv: &mut KvPool,
        layers: usize,
    ) -> Result<Vec<f32>, EngineError> {
        if self.shard.ep.is_some() || !self.shard.is_whole() {
            return Err(EngineError::Unsupported(
                "an early exit on a tensor- or expert-parallel rank".into(),
            ));
        }
        let layers = layers.min(self.weights.layers.len());
        rayon::scope(|_| self.forward_step_layers(seqs, kv, &mut SingleRank, layers, None))
    }

    /// This shard's part of one packed step, in lockstep with the other ranks of its group
    /// through `comm` (the calls of every rank must be the same steps in the same order): the
    /// whole vocabulary's logits, on every rank. Runs in the caller's compute pool. Each op's
    /// time is added to `times` when given.
    pub fn forward_rank(
        &self,
        seqs: &[SeqBatch<'_>],
        kv: &mut KvPool,
        comm: &mut dyn Collective,
        times: Option<&mut OpTimes>,
    ) -> Result<Vec<f32>, EngineError> {
        let (rank, size) = self.shard.group();
        if comm.size() != size || comm.rank() != rank {
            return Err(EngineError::Internal(format!(
                "rank {} of {} runs the shard of rank {rank} of {size}",
                comm.rank(),
                comm.size(),
            )));
        }
        if self.shard.ep.is_some() && size > 1 {
            // Data-parallel attention: this rank's run of the step's sequences (every rank
            // runs every layer, with no rows if need be: the experts' exchanges are
            // collectives), then every rank's logits to rank 0, in rank order: the step's.
            let mine = &seqs[ep_share(seqs, rank, size)];
            let logits = self.forward_step(mine, kv, comm, times)?;
            let mut sends = vec![Vec::new(); size];
            sends[0] = logits;
            let got = comm.all_to_all(&sends)?;
            return Ok(got.concat());
        }
        self.forward_step(seqs, kv, comm, times)
    }

    /// One packed step of `seqs` on this shard (see [`Self::forward_rank`]).
    fn forward_step(
        &self,
        seqs: &[SeqBatch<'_>],
        kv: &mut KvPool,
        comm: &mut dyn Collective,
        times: Option<&mut OpTimes>,
    ) -> Result<Vec<f32>, EngineError> {
        let layers = self.weights.layers.len();
        self.forward_step_layers(seqs, kv, comm, layers, times)
    }

    /// [`Self::forward_step`] through the first `layers` layers.
    fn forward_step_layers(
        &self,
        seqs: &[SeqBatch<'_>],
        kv: &mut KvPool,
        comm: &mut dyn Collective,
        layers: usize,
        times: Option<&mut OpTimes>,
    ) -> Result<Vec<f32>, EngineError> {
        let c = &self.config;
        let bs = kv.layout.block_size;
        let step = PackedStep::new(seqs, c.vocab_size, self.rope.max_pos(), bs, kv.num_blocks())?;
        let t = step.tokens.len();
        // A rank of an expert-parallel group runs even without rows: its experts serve the
        // others'.
        if t == 0 && self.shard.ep.is_none_or(|(_, size)| size == 1) {
            return Ok(Vec::new());
        }
        let mut ops = CpuStep::new(self, comm, kv, &step);
        let n = step.logit_rows.len();
        let lora = !step.lora.is_empty();
        let logits = forward::forward(
            &mut ops,
            &self.weights,
            c,
            &self.shard,
            t,
            n,
            layers,
            lora,
            times,
        )?;
        Ok(logits.unwrap_or_default())
    }
}

/// One packed step on the CPU: the op set of [`crate::forward`] in f32 over the host pool, each
/// op's rows split into parallel tasks on the compute pool.
struct CpuStep<'a> {
    /// The model as this rank sees it (its heads, features and vocabulary slice).
    c: &'a ModelConfig,
    /// The whole vocabulary.
    vocab: usize,
    shard: &'a TpShard,
    comm: &'a mut dyn Collective,
    rope: &'a RopeTable,
    kv: &'a mut KvPool,
    step: &'a PackedStep<'a>,
    attn: Vec<SeqAttn<'a>>,
    /// Where routed rows are counted (a mixture of experts).
    load: Option<&'a ExpertLoad>,
    /// A mixture of experts' buffers, reused by the step's layers.
    moe: ExpertScratch,
    /// How many rows go on after [`StepOps::keep_logit_rows`] (the rows that want logits),
    /// moved to the top of the step's buffers; None: every row.
    kept: Option<usize>,
}

impl<'a> CpuStep<'a> {
    fn new(
        model: &'a CpuModel,
        comm: &'a mut dyn Collective,
        kv: &'a mut KvPool,
        step: &'a PackedStep<'a>,
    ) -> Self {
        let c = &model.local;
        let attn = step
            .seqs
            .iter()
            .map(|s| SeqAttn {
                q_start: s.q_start,
                q_len: s.q_len,
                context_len: s.context,
                block_table: s.block_table,
            })
            .collect();
        Self {
            c,
            vocab: model.config.vocab_size,
            shard: &model.shard,
            comm,
            rope: &model.rope,
            kv,
            step,
            attn,
            load: model.expert_load.as_deref(),
            moe: ExpertScratch::default(),
            kept: None,
        }
    }

    /// `out = rms_norm(x) · w` over all of `x`'s rows, in tasks of [`ROW_TASK`] rows.
    fn norm(&self, x: &[f32], w: &[f32], out: &mut [f32]) {
        let chunk = ROW_TASK * self.c.hidden_size;
        x.par_chunks(chunk)
            .zip(out.par_chunks_mut(chunk))
            .for_each(|(xc, oc)| ops::rms_norm(xc, w, self.c.rms_norm_eps, oc));
    }
}

impl StepOps for CpuStep<'_> {
    type Act = Vec<f32>;
    type Logits = Vec<f32>;
    type Matrix = Linear;
    type Vector = Vec<f32>;

    fn alloc(&self, len: usize) -> Result<Vec<f32>, EngineError> {
        Ok(vec![0f32; len])
    }

    fn alloc_logits(&self, len: usize) -> Result<Vec<f32>, EngineError> {
        Ok(vec![0f32; len])
    }

    fn embed(&mut self, table: &Linear, out: &mut Vec<f32>) -> Result<(), EngineError> {
        let vocab = &self.shard.vocab;
        if self.shard.is_whole() {
            ops::embedding(&self.step.tokens, table.weight(), out);
            return Ok(());
        }
        // A slice of the vocabulary: its tokens' rows, zeros for the others (the all-reduce
        // that follows adds the one rank's row that holds each token).
        let h = self.c.hidden_size;
        for (&tok, row) in self.step.tokens.iter().zip(out.chunks_exact_mut(h)) {
            match vocab.contains(&(tok as usize)) {
                true => table.weight().row_f32(tok as usize - vocab.start, row),
                false => row.fill(0.0),
            }
        }
        Ok(())
    }

    fn rms_norm(
        &mut self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        out: &mut Vec<f32>,
        _rows: usize,
    ) -> Result<(), EngineError> {
        self.norm(x, w, out);
        Ok(())
    }

    fn add_rms_norm(
        &mut self,
        x: &mut Vec<f32>,
        delta: &Vec<f32>,
        w: &Vec<f32>,
        out: &mut Vec<f32>,
        rows: usize,
    ) -> Result<(), EngineError> {
        let len = rows * self.c.hidden_size;
        add_rows(&mut x[..len], &delta[..len], ROW_TASK * self.c.hidden_size);
        self.norm(&x[..len], w, &mut out[..len]);
        Ok(())
    }

    fn matmul(
        &mut self,
        w: &Linear,
        x: &Vec<f32>,
        (rows, n, k): (usize, usize, usize),
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        // (The step's buffers have room for every row; after `keep_logit_rows` fewer go on.)
        Ok(w.matmul(&x[..rows * k], rows, &mut out[..rows * n])?)
    }

    fn qkv_extras(
        &mut self,
        qkv: &mut Vec<f32>,
        bias: Option<&Vec<f32>>,
        norms: Option<(&Vec<f32>, &Vec<f32>)>,
        _rows: usize,
    ) -> Result<(), EngineError> {
        let c = self.c;
        let hd = c.head_dim;
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let width = qd + 2 * kvd;
        let eps = c.rms_norm_eps;
        qkv.par_chunks_mut(ROW_TASK * width).for_each(|rows| {
            let mut head = vec![0f32; hd];
            for row in rows.chunks_exact_mut(width) {
                if let Some(b) = bias {
                    row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
                if let Some((qn, kn)) = norms {
                    // Query heads, then key heads; the values are left as they are.
                    let (q, k) = row.split_at_mut(qd);
                    let heads = q
                        .chunks_exact_mut(hd)
                        .map(|h| (h, qn))
                        .chain(k[..kvd].chunks_exact_mut(hd).map(|h| (h, kn)));
                    for (h, w) in heads {
                        head.copy_from_slice(h);
                        ops::rms_norm(&head, w, eps, h);
                    }
                }
            }
        });
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        qkv: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let c = self.c;
        let hd = c.head_dim;
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let qkv_w = qd + 2 * kvd;
        // The queries and keys rotated where they are, in the fused rows, which the cache
        // writes and attention then read in place (copying them out first, into buffers of
        // their own, cost a 512-token prefill of the model 1.5-2 ms of its 85 ms of attention
        // on a 2-core Zen 3). Each row is rotated by the task that writes its keys and values
        // into the cache, just before: one pass over the rows, not a pass of its own first.
        let t = self.step.positions.len();
        if self.step.slots.len() != t {
            return Err(EngineError::Internal(format!(
                "{} cache slots for {t} rows",
                self.step.slots.len()
            )));
        }
        if qkv.len() < t * qkv_w {
            return Err(EngineError::Internal(format!(
                "{} q|k|v values for {t} rows of {qkv_w}",
                qkv.len()
            )));
        }
        let (rope, positions) = (self.rope, &self.step.positions);
        let layout = self.kv.layout;
        let mut cache = self.kv.layer_mut(layer);
        // A row's query heads and key heads are one run of heads, rotated together. (A step
        // of no rows, an expert-parallel rank's, prepares and writes nothing.)
        let heads = c.num_heads + c.num_kv_heads;
        prepare_and_write_kv(
            &mut cache,
            layout,
            &mut qkv[..t * qkv_w],
            qkv_w,
            qd,
            &self.step.slots,
            |t, row| ops::rope(&mut row[..qd + kvd], &positions[t..t + 1], heads, rope),
        )?;
        let spec = AttnSpec {
            n_heads: c.num_heads,
            scale: 1.0 / (hd as f32).sqrt(),
            window: c.sliding_window,
        };
        let Some(n) = self.kept else {
            paged_attention_strided(qkv, qkv_w, spec, cache.as_ref(), layout, &self.attn, out)?;
            return Ok(());
        };
        // Only the rows that want logits: each sequence's last ones, moved up in order (a
        // row's output is the same whatever rows are beside it).
        let rows = &self.step.logit_rows;
        let mut q = Vec::with_capacity(n * qd);
        for &r in rows {
            q.extend_from_slice(&qkv[r * qkv_w..r * qkv_w + qd]);
        }
        let mut seqs = Vec::new();
        let mut at = 0;
        for s in &self.attn {
            let end = s.q_start + s.q_len;
            let wanted = rows[at..]
                .iter()
                .take_while(|&&r| r >= s.q_start && r < end)
                .count();
            if wanted > 0 {
                seqs.push(SeqAttn {
                    q_start: at,
                    q_len: wanted,
                    ..*s
                });
            }
            at += wanted;
        }
        if at != n {
            return Err(EngineError::Internal(
                "the rows that want logits are not their sequences' last".into(),
            ));
        }
        if n > 0 {
            paged_attention(&q, spec, cache.as_ref(), layout, &seqs, &mut out[..n * qd])?;
        }
        Ok(())
    }

    fn silu_mul(
        &mut self,
        gate_up: &Vec<f32>,
        out: &mut Vec<f32>,
        rows: usize,
        ff: usize,
    ) -> Result<(), EngineError> {
        tandem_kernels::silu_rows(&gate_up[..rows * 2 * ff], ff, &mut out[..rows * ff]);
        Ok(())
    }

    fn gate_up_silu(
        &mut self,
        w: &Linear,
        x: &Vec<f32>,
        (m, ff, k): (usize, usize, usize),
        gate_up: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        // One pass where gate|up would leave the caches between two (a 512-token prefill of
        // the default model wrote and read back 6.3 MB of it a layer; see `matmul_silu`).
        Ok(w.matmul_silu(&x[..m * k], m, gate_up, &mut out[..m * ff])?)
    }

    fn route(
        &mut self,
        x: &forward::Experts<Linear>,
        hidden: &Vec<f32>,
        rows: usize,
    ) -> Result<forward::Routing, EngineError> {
        let (n, h) = (x.total, self.c.hidden_size);
        let mut scores = vec![0f32; rows * n];
        x.router.matmul(&hidden[..rows * h], rows, &mut scores)?;
        let routing = forward::Routing::from_scores(&scores, n, x.active, x.norm_topk);
        if let Some(l) = self.load {
            l.add(&routing);
        }
        Ok(routing)
    }

    fn experts(
        &mut self,
        x: &forward::Experts<Linear>,
        hidden: &Vec<f32>,
        routing: &forward::Routing,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let (h, k) = (self.c.hidden_size, routing.active);
        let rows = routing.expert.len() / k.max(1);
        let row = |r: usize| &hidden[r * h..(r + 1) * h];
        let s = &mut self.moe;
        // Where each (row, choice)'s expert output is: a row of `s.ys` (computed here) or of
        // `y` (sent back by the rank that computed it).
        let (y, at): (&[f32], &[usize]) = match self.shard.ep {
            Some((_, size)) if size > 1 => {
                // Dispatch: each choice's row to the rank that holds its expert, tagged with
                // the expert; the ranks compute what they were sent; combine: the outputs
                // come back in the order they went.
                let owner = |e: u32| TpShard::expert_owner(e as usize, x.total, size);
                let mut sends: Vec<Vec<f32>> = vec![Vec::new(); size];
                let mut sent: Vec<Vec<usize>> = vec![Vec::new(); size];
                for (i, &e) in routing.expert.iter().enumerate() {
                    let d = owner(e);
                    sends[d].push(f32::from_bits(e));
                    sends[d].extend_from_slice(row(i / k));
                    sent[d].push(i);
                }
                let got = self.comm.all_to_all(&sends)?;
                // (`expert_rows` refuses a row of an expert this rank does not hold.)
                let items: Vec<(usize, &[f32])> = got
                    .iter()
                    .flat_map(|g| g.chunks_exact(h + 1))
                    .map(|c| (c[0].to_bits() as usize, &c[1..]))
                    .collect();
                expert_rows(x, h, &items, s)?;
                let mut backs = Vec::with_capacity(size);
                let mut from = 0;
                for g in &got {
                    let n = g.len() / (h + 1);
                    let mut b = Vec::with_capacity(n * h);
                    for &j in &s.slot[from..from + n] {
                        b.extend_from_slice(&s.ys[j * h..(j + 1) * h]);
                    }
                    backs.push(b);
                    from += n;
                }
                let back = self.comm.all_to_all(&backs)?;
                s.back.clear();
                s.back.resize(routing.expert.len() * h, 0.0);
                for (d, idx) in sent.iter().enumerate() {
                    if back[d].len() != idx.len() * h {
                        return Err(EngineError::Internal(format!(
                            "expert rank {d} returned {} values for {} rows",
                            back[d].len(),
                            idx.len()
                        )));
                    }
                    for (&i, v) in idx.iter().zip(back[d].chunks_exact(h)) {
                        s.back[i * h..(i + 1) * h].copy_from_slice(v);
                    }
                }
                s.slot.clear();
                s.slot.extend(0..routing.expert.len());
                (&s.back, &s.slot)
            }
            _ => {
                let items: Vec<(usize, &[f32])> = routing
                    .expert
                    .iter()
                    .enumerate()
                    .map(|(i, &e)| (e as usize, row(i / k)))
                    .collect();
                expert_rows(x, h, &items, s)?;
                (&s.ys, &s.slot)
            }
        };
        // Each row's sum over its experts in expert order (as transformers adds them), the
        // weight applied to each expert's output first: the same bits wherever each ran.
        out[..rows * h]
            .par_chunks_mut(h)
            .with_min_len(ROW_TASK)
            .enumerate()
            .for_each(|(r, o)| {
                o.fill(0.0);
                let mut order: Vec<(u32, usize)> =
                    (0..k).map(|j| (routing.expert[r * k + j], j)).collect();
                order.sort_unstable();
                for &(_, j) in &order {
                    let i = r * k + j;
                    let w = routing.weight[i];
                    for (o, v) in o.iter_mut().zip(&y[at[i] * h..(at[i] + 1) * h]) {
                        *o += v * w;
                    }
                }
            });
        Ok(())
    }

    fn lora(
        &mut self,
        layer: usize,
        site: LoraSite,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        use tandem_model::LoraTarget::*;
        if !self.shard.is_whole() {
            return Err(EngineError::Unsupported(
                "LoRA adapters on a tensor-parallel rank".into(),
            ));
        }
        let c = self.c;
        let (h, ff) = (c.hidden_size, c.intermediate_size);
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        // The projection's input width, its (fused) output's, and where each pair's outputs
        // start in it.
        let (k, n, parts) = match site {
            LoraSite::Qkv => (h, qd + 2 * kvd, vec![(Q, 0), (K, qd), (V, qd + kvd)]),
            LoraSite::O => (qd, h, vec![(O, 0)]),
            LoraSite::GateUp => (h, 2 * ff, vec![(Gate, 0), (Up, ff)]),
            LoraSite::Down => (ff, h, vec![(Down, 0)]),
        };
        let mut jobs = Vec::new();
        for g in &self.step.lora {
            for &(target, off) in &parts {
                if let Some(p) = g.adapter.pair(layer, target) {
                    jobs.push(ops::LoraJob {
                        a: &p.a,
                        bt: &p.bt,
                        rank: p.rank,
                        scale: p.scale,
                        off,
                        rows: &g.rows,
                    });
                }
            }
        }
        ops::lora_add(&jobs, x, k, out, n);
        Ok(())
    }

    fn keep_logit_rows(&mut self, x: &mut Vec<f32>) -> Result<Option<usize>, EngineError> {
        let rows = &self.step.logit_rows;
        let (n, h) = (rows.len(), self.c.hidden_size);
        // An expert-parallel group keeps every row: its ranks run different rows, and the
        // experts' exchanges are of each rank's rows. (A tensor-parallel group's ranks run the
        // same rows and keep the same ones.)
        if n == self.step.tokens.len() || self.shard.is_expert_parallel() {
            return Ok(None);
        }
        // Rows only move up (`rows` ascends), so each is read before it is overwritten.
        for (i, &r) in rows.iter().enumerate() {
            x.copy_within(r * h..(r + 1) * h, i * h);
        }
        self.kept = Some(n);
        Ok(Some(n))
    }

    fn final_norm(
        &mut self,
        x: &mut Vec<f32>,
        delta: &Vec<f32>,
        w: &Vec<f32>,
        _scratch: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let h = self.c.hidden_size;
        if let Some(n) = self.kept {
            // Only the rows that want logits are left, at the top.
            add_rows(&mut x[..n * h], &delta[..n * h], ROW_TASK * h);
            for (i, o) in out.chunks_exact_mut(h).take(n).enumerate() {
                ops::rms_norm(&x[i * h..(i + 1) * h], w, self.c.rms_norm_eps, o);
            }
            return Ok(());
        }
        add_rows(x, delta, ROW_TASK * h);
        // Only the rows that want logits: a decode step's tokens all do, a prefill chunk's one.
        for (i, &r) in self.step.logit_rows.iter().enumerate() {
            ops::rms_norm(
                &x[r * h..(r + 1) * h],
                w,
                self.c.rms_norm_eps,
                &mut out[i * h..(i + 1) * h],
            );
        }
        Ok(())
    }

    fn head(
        &mut self,
        w: &Linear,
        x: &Vec<f32>,
        mnk: (usize, usize, usize),
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        self.matmul(w, x, mnk, out)
    }

    fn all_reduce(&mut self, x: &mut Vec<f32>) -> Result<(), EngineError> {
        // After `keep_logit_rows` the only rows left are the kept ones, at the top (each
        // value is summed over the ranks in rank order, however long the buffer: the same bits).
        let len = self.kept.map_or(x.len(), |n| n * self.c.hidden_size);
        Ok(self.comm.all_reduce_sum(&mut x[..len])?)
    }

    fn gather_logits(
        &mut self,
        local: &Vec<f32>,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        // Each rank's rows padded to an equal slice of the vocabulary, gathered rank after
        // rank, then laid out row after row.
        let (vocab, size) = (self.vocab, self.shard.size);
        let (chunk, pieces) = vocab_pieces(vocab, size);
        let mine = self.shard.vocab.len();
        let mut padded = vec![0f32; rows * chunk];
        for (p, l) in padded
            .chunks_exact_mut(chunk)
            .zip(local.chunks_exact(mine.max(1)))
        {
            p[..mine].copy_from_slice(&l[..mine]);
        }
        let mut all = vec![0f32; size * rows * chunk];
        self.comm.all_gather(&padded, &mut all)?;
        for (r, (from, len)) in pieces.into_iter().enumerate() {
            let part = &all[r * rows * chunk..(r + 1) * rows * chunk];
            for (o, p) in out.chunks_exact_mut(vocab).zip(part.chunks_exact(chunk)) {
                o[from..from + len].copy_from_slice(&p[..len]);
            }
        }
        Ok(())
    }
}

/// The sequences of a step that rank `rank` of an expert-parallel group of `size` computes: a
/// contiguous run, the runs' token counts as even as whole sequences allow (the same split on
/// every rank, so each knows the others').
fn ep_share(seqs: &[SeqBatch<'_>], rank: usize, size: usize) -> std::ops::Range<usize> {
    let total: usize = seqs.iter().map(|s| s.tokens.len()).sum();
    // Sequence i goes to the rank whose share of the tokens its middle token falls in.
    let owner =
        |before: usize, len: usize| ((2 * before + len) * size / (2 * total.max(1))).min(size - 1);
    let (mut start, mut end, mut before) = (seqs.len(), seqs.len(), 0);
    for (i, s) in seqs.iter().enumerate() {
        let o = owner(before, s.tokens.len());
        if o == rank && start == seqs.len() {
            start = i;
        }
        if o > rank {
            end = i;
            break;
        }
        before += s.tokens.len();
    }
    start.min(end)..end
}

/// The outputs of experts held here (`x`'s, from `x.first`) for `items` (each an expert and an
/// input row of `h` values), unweighted, into `s.ys` (item `i`'s at row `s.slot[i]`): each
/// expert's rows gathered and run through its gate|up, silu · up and down, every expert with rows at once (each product
/// parallel inside). A row's output does not depend on which other rows share its expert (the
/// products are batch-invariant).
fn expert_rows(
    x: &forward::Experts<Linear>,
    h: usize,
    items: &[(usize, &[f32])],
    s: &mut ExpertScratch,
) -> Result<(), EngineError> {
    let held = x.first..x.first + x.experts.len();
    // Rows of each expert held, then where each expert's run of rows starts: the rows are laid
    // out expert after expert, in the items' order within an expert.
    let mut count = vec![0usize; x.experts.len()];
    for (e, _) in items {
        if !held.contains(e) {
            return Err(EngineError::Internal(format!(
                "a row for expert {e}, outside the experts held here ({held:?})"
            )));
        }
        count[e - x.first] += 1;
    }
    let mut start = Vec::with_capacity(count.len() + 1);
    start.push(0);
    for c in &count {
        start.push(start.last().copied().unwrap_or(0) + c);
    }
    let mut next = start.clone();
    s.slot.clear();
    s.slot.extend(items.iter().map(|(e, _)| {
        let j = next[e - x.first];
        next[e - x.first] += 1;
        j
    }));
    let mut item_at = vec![0usize; items.len()];
    for (i, &j) in s.slot.iter().enumerate() {
        item_at[j] = i;
    }
    let (n, ff) = (items.len(), x.ff);
    // Grown only: every value is written before it is read.
    for (buf, width) in [
        (&mut s.xs, h),
        (&mut s.gu, 2 * ff),
        (&mut s.act, ff),
        (&mut s.ys, h),
    ] {
        if buf.len() < n * width {
            buf.resize(n * width, 0.0);
        }
    }
    s.xs[..n * h]
        .par_chunks_mut(h)
        .with_min_len(ROW_TASK)
        .zip(&item_at)
        .for_each(|(dst, &i)| dst.copy_from_slice(items[i].1));
    // Every expert's gate|up in one parallel pass, silu · up, and every down in another (two
    // forks and joins a layer, however many experts run).
    let grouped = |input: &[f32], k: usize, out: &mut [f32], width: usize, down: bool| {
        let mut products = Vec::new();
        let mut rest = out;
        for (e, c) in count.iter().enumerate() {
            let (o, r) = std::mem::take(&mut rest).split_at_mut(c * width);
            rest = r;
            if *c == 0 {
                continue;
            }
            products.push(Product {
                x: &input[start[e] * k..start[e + 1] * k],
                m: *c,
                w: match down {
                    false => x.experts[e].0.weight(),
                    true => x.experts[e].1.weight(),
                },
                out: o,
            });
        }
        matmul_many(&mut products)
    };
    grouped(&s.xs[..n * h], h, &mut s.gu[..n * 2 * ff], 2 * ff, false)?;
    s.act[..n * ff]
        .par_chunks_mut(ff)
        .with_min_len(ROW_TASK)
        .zip(s.gu[..n * 2 * ff].par_chunks(2 * ff))
        .for_each(|(a, g2)| {
            let (g, u) = g2.split_at(ff);
            ops::silu_mul_to(g, u, a);
        });
    grouped(&s.act[..n * ff], ff, &mut s.ys[..n * h], h, true)?;
    Ok(())
}

/// A mixture of experts' buffers for one step's layers: the rows gathered expert after expert
/// (`xs`), their gate|up outputs (`gu`), activations (`act`) and outputs (`ys`); where each
/// item's row went (`slot`); and, under expert parallelism, the outputs sent back (`back`).
#[derive(Default)]
struct ExpertScratch {
    xs: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    ys: Vec<f32>,
    slot: Vec<usize>,
    back: Vec<f32>,
}

/// Rows per task of the row-wise work in a step (norms, rotary, activation).
const ROW_TASK: usize = 16;

/// `x += y`, in parallel chunks of `chunk` values.
fn add_rows(x: &mut [f32], y: &[f32], chunk: usize) {
    x.par_chunks_mut(chunk)
        .zip(y.par_chunks(chunk))
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

/// A small random Llama for tests of the engine's bookkeeping (fast enough for property tests).
#[cfg(test)]
pub(crate) fn tiny_model(seed: u64) -> CpuModel {
    let (c, tensors) = crate::testing::tiny_tensors(seed);
    CpuModel::from_tensors(&c, &tensors, WeightFormat::Native).expect("consistent shapes")
}

/// The CPU model over a host KV pool.
pub struct CpuBackend {
    model: CpuModel,
    kv: KvPool,
    /// The latest forward's split by op, while profiling.
    ops: Option<OpTimes>,
}

impl CpuBackend {
    /// The model it runs.
    pub fn model(&self) -> &CpuModel {
        &self.model
    }

    /// The CPU model with a pool of `pool`'s size and dtype.
    pub fn new(model: CpuModel, pool: &PoolSize) -> Result<Self, EngineError> {
        pool.check()?;
        let layout = model.kv_layout(pool.block_size);
        let layers = model.config.num_layers;
        let block_bytes = KvPool::bytes_per_block(layout, pool.kv_dtype, layers);
        let kv = KvPool::new(layout, pool.kv_dtype, layers, pool.blocks(block_bytes))
            .map_err(|e| EngineError::Startup(format!("allocating the KV pool: {e}")))?;
        Ok(Self {
            model,
            kv,
            ops: None,
        })
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        let times = self.ops.as_mut().map(|t| {
            *t = OpTimes::default();
            t
        });
        self.model.forward_timed(seqs, &mut self.kv, times)
    }

    fn forward_layers(
        &mut self,
        seqs: &[SeqBatch<'_>],
        layers: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.model.forward_layers(seqs, &mut self.kv, layers)
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn expert_load(&self) -> Option<Arc<ExpertLoad>> {
        self.model.expert_load()
    }

    fn supports_lora(&self) -> bool {
        let m = &self.model;
        m.shard.is_whole() && m.config.moe.is_none()
    }

    fn is_cpu(&self) -> bool {
        true
    }

    fn prunes_last_layer(&self) -> bool {
        !self.model.shard.is_expert_parallel()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvDtype;
    use crate::sampler::Sampler;
    use tandem_types::ValidSampling;

    /// A pool of eight f32 blocks of 16 slots.
    fn pool_of_8() -> PoolSize {
        PoolSize {
            block_size: 16,
            kv_cache_mb: 0,
            num_blocks: Some(8),
            kv_dtype: KvDtype::F32,
            gpu_memory_fraction: None,
        }
    }

    /// What a device's argmax step must return: per row, the token and log-probability the
    /// host sampler would have produced from the logits.
    #[test]
    fn argmax_steps_pick_what_the_sampler_would() {
        let pool = pool_of_8();
        let mut b = CpuBackend::new(tiny_model(3), &pool).unwrap();
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
                logits: 1,
                lora: None,
            },
            SeqBatch {
                tokens: &p1,
                cached: 0,
                block_table: &t1,
                logits: 1,
                lora: None,
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

    /// The last layer goes on only with the rows that want logits: those rows' logits have the
    /// bits they have where every row wants them, and the rows left behind still leave their
    /// keys and values in the cache (a step after one that wanted no logits at all, a prompt's
    /// chunk before its last, reads the same cache).
    #[test]
    fn the_last_layer_keeps_only_the_rows_that_want_logits_and_changes_no_bit() {
        let pool = pool_of_8();
        let p0: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % 50).collect();
        let p1 = [11u32, 3, 40, 8, 21];
        let (t0, t1) = ([0u32, 1], [2u32]);
        let step = |logits: [usize; 2]| {
            let mut b = CpuBackend::new(tiny_model(5), &pool).unwrap();
            let batch = [
                SeqBatch {
                    tokens: &p0,
                    cached: 0,
                    block_table: &t0,
                    logits: logits[0],
                    lora: None,
                },
                SeqBatch {
                    tokens: &p1,
                    cached: 0,
                    block_table: &t1,
                    logits: logits[1],
                    lora: None,
                },
            ];
            let got = b.forward(&batch).unwrap();
            // One more token for each: it reads every key and value the step cached.
            let next = [
                SeqBatch {
                    tokens: &[4],
                    cached: p0.len(),
                    block_table: &t0,
                    logits: 1,
                    lora: None,
                },
                SeqBatch {
                    tokens: &[9],
                    cached: p1.len(),
                    block_table: &t1,
                    logits: 1,
                    lora: None,
                },
            ];
            let after = b.forward(&next).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (bits(&got), bits(&after))
        };
        let vocab = tiny_model(5).config.vocab_size;
        let row = |all: &[u32], r: usize| all[r * vocab..(r + 1) * vocab].to_vec();
        // Every row wants logits: nothing is left behind.
        let (all, after_all) = step([p0.len(), p1.len()]);
        assert_eq!(all.len(), (p0.len() + p1.len()) * vocab);
        for (logits, rows) in [
            ([1, 1], vec![19, 24]),
            ([0, 3], vec![22, 23, 24]),
            ([2, 0], vec![18, 19]),
            ([0, 0], vec![]),
        ] {
            let (got, after) = step(logits);
            let want: Vec<u32> = rows.iter().flat_map(|&r| row(&all, r)).collect();
            assert_eq!(got, want, "{logits:?}");
            assert_eq!(after, after_all, "the step after {logits:?}");
        }
    }

    /// The slowdown hook refuses a factor that is not a number of at least 1, and around a
    /// backend it changes no result, only the time.
    #[test]
    fn a_slowed_backend_gives_the_same_logits_and_refuses_bad_factors() {
        let pool = pool_of_8();
        let make = || Box::new(CpuBackend::new(tiny_model(3), &pool).unwrap()) as Box<dyn Backend>;
        for factor in [0.5, f64::NAN, f64::INFINITY] {
            assert!(
                crate::backend::Slowed::new(make(), factor).is_err(),
                "{factor}"
            );
        }
        let mut plain = make();
        let mut slowed = crate::backend::Slowed::new(make(), 2.0).unwrap();
        let (p, t) = ([5u32, 9, 2, 7], [0u32]);
        let batch = [SeqBatch {
            tokens: &p,
            cached: 0,
            block_table: &t,
            logits: 1,
            lora: None,
        }];
        let want = plain.forward(&batch).unwrap();
        let got = slowed.forward(&batch).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(slowed.device(), "cpu");
        assert!(slowed.as_any().downcast_ref::<CpuBackend>().is_some());
    }
}
