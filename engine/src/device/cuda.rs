//! The Llama model on a CUDA GPU: its weights in bf16 in device memory, the KV pool there too,
//! and the op set of [`crate::forward`] in bf16 with f32 accumulation. Block ids and tables are
//! the block manager's, so the scheduler is the same on either device.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tandem_kernels::cuda::runtime::{
    AttnBatch, CopyEvent, CopyStream, CudaOps, CudaSlice, OpTimer, PinnedHost, StepGraph,
    StepProfile,
};
use tandem_kernels::cuda::{graph_bucket, table_blocks, GRAPH_MAX_CONTEXT};
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
    /// Decode steps captured as CUDA graphs.
    graphs: DecodeGraphs,
}

/// Decode steps as CUDA graphs, one a batch-size bucket ([`GRAPH_BUCKETS`]), each captured at
/// its bucket's first step and replayed after: a step is then a few input copies and one
/// launch, not hundreds of launches the host queues one by one (a Llama-3-8B step is about ten
/// kernels a layer, each a few microseconds at batch 1). A step's rows are padded to its
/// bucket, which changes no row's bits (every kernel's arithmetic for a row is fixed by the
/// row alone, see `forward`). Steps with prompt tokens, proposals to verify, adapters, a longer
/// context than [`GRAPH_MAX_CONTEXT`] or more sequences than the largest bucket run eagerly, as
/// do a tensor-parallel rank's steps and profiled ones. Each graph keeps its step's buffers (a
/// step's activations, logits and attention partials at its bucket's rows), on top of the pool.
struct DecodeGraphs {
    /// Whether decode steps run as graphs (off: `--enforce-eager`).
    on: bool,
    /// The longest context a graph serves.
    max_context: usize,
    /// By their rows.
    graphs: BTreeMap<usize, DecodeGraph>,
    /// Buckets whose graph failed (to be made, or to run): their steps run eagerly from then on.
    failed: std::collections::BTreeSet<usize>,
    /// Steps run by replaying a graph.
    replays: u64,
}

/// One bucket's graph and the buffers it was captured over.
struct DecodeGraph {
    inp: StepInputs,
    /// The forward's activation buffers, in the order it allocates them.
    _acts: Vec<Bf16>,
    logits: CudaSlice<f32>,
    graph: StepGraph,
}

/// A decode step padded to the rows of its graph: sequence i in row i, each one new token that
/// samples; rows past the sequences pad (token 0 at position 0, no cache slot, no context).
#[derive(Debug, PartialEq)]
struct GraphStep {
    /// The bucket.
    rows: usize,
    ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i64>,
    /// `rows` rows of `max_blocks` entries: the blocks a row's context spans, then zeros.
    tables: Vec<i32>,
    context: Vec<i32>,
}

/// The graph step `step` runs as, or None where it runs eagerly (see [`DecodeGraphs`]).
fn graph_step(step: &PackedStep<'_>, max_context: usize, block_size: usize) -> Option<GraphStep> {
    let n = step.seqs.len();
    let decode = |s: &forward::PackedSeq<'_>| s.q_len == 1 && s.context <= max_context;
    if n == 0
        || !step.lora.is_empty()
        || step.tokens.len() != n
        || step.logit_rows.len() != n
        || !step.seqs.iter().all(decode)
    {
        return None;
    }
    let rows = graph_bucket(n)?;
    let max_blocks = table_blocks(max_context, block_size);
    let pad = |mut v: Vec<i32>, fill: i32| {
        v.resize(rows, fill);
        v
    };
    let mut tables = vec![0i32; rows * max_blocks];
    for (i, s) in step.seqs.iter().enumerate() {
        let spans = s.context.div_ceil(block_size);
        for (d, &b) in tables[i * max_blocks..][..spans]
            .iter_mut()
            .zip(s.block_table)
        {
            *d = b as i32;
        }
    }
    Some(GraphStep {
        rows,
        ids: pad(step.tokens.iter().map(|&t| t as i32).collect(), 0),
        positions: pad(step.positions.iter().map(|&p| p as i32).collect(), 0),
        slots: step
            .slots
            .iter()
            .map(|&s| s as i64)
            .chain(std::iter::repeat(-1))
            .take(rows)
            .collect(),
        tables,
        context: pad(step.seqs.iter().map(|s| s.context as i32).collect(), 0),
    })
}

/// Where a step's logits are: its own buffer, or the rows of the graph it ran as (its own
/// first, padding after).
enum StepLogits {
    Own(CudaSlice<f32>),
    Graph(usize),
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
            graphs: DecodeGraphs {
                on: true,
                max_context: GRAPH_MAX_CONTEXT.min(rope.max_pos()),
                graphs: BTreeMap::new(),
                failed: Default::default(),
                replays: 0,
            },
            config: c,
            shard,
        })
    }

    /// Whether decode steps run as CUDA graphs (on by default; off: every step runs eagerly,
    /// `--enforce-eager`; graphs captured before are kept for when they are on again).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs.on = on;
    }

    /// Whether decode steps run as CUDA graphs (off when asked).
    pub fn graphs_on(&self) -> bool {
        self.graphs.on
    }

    /// The graphs captured so far, by their rows.
    pub fn graph_rows(&self) -> Vec<usize> {
        self.graphs.graphs.keys().copied().collect()
    }

    /// The buckets whose graph failed, whose steps run eagerly (the log says why).
    pub fn graph_failures(&self) -> Vec<usize> {
        self.graphs.failed.iter().copied().collect()
    }

    /// How many steps ran by replaying a graph (a bucket's first step, which makes it, is not
    /// one).
    pub fn graph_replays(&self) -> u64 {
        self.graphs.replays
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
            Some((logits, n)) => self.download_logits(&logits, n),
            None => Ok(Vec::new()),
        }
    }

    /// A step's `n` rows of logits, on the host.
    fn download_logits(&self, l: &StepLogits, n: usize) -> Result<Vec<f32>, EngineError> {
        let len = n * self.config.vocab_size;
        Ok(self.ops.download_prefix(self.logits(l)?, len)?)
    }

    /// The buffer a step's logits are in.
    fn logits<'a>(&'a self, l: &'a StepLogits) -> Result<&'a CudaSlice<f32>, EngineError> {
        match l {
            StepLogits::Own(b) => Ok(b),
            StepLogits::Graph(rows) => {
                self.graphs
                    .graphs
                    .get(rows)
                    .map(|g| &g.logits)
                    .ok_or_else(|| {
                        EngineError::Internal(format!(
                            "no graph of {rows} rows holds a step's logits"
                        ))
                    })
            }
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
        self.argmax(self.logits(&logits)?, n)
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
            let picks = self.argmax(self.logits(&logits)?, n);
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
            (Some((logits, n)), 0, true) => StepOut::Picks(self.argmax(self.logits(&logits)?, n)?),
            (Some((logits, n)), 0, false) => StepOut::Logits(self.download_logits(&logits, n)?),
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
    ) -> Result<(Option<(StepLogits, usize)>, Option<OpTimer>), EngineError> {
        let step = PackedStep::new(
            seqs,
            self.config.vocab_size,
            self.max_pos,
            self.block_size,
            self.num_blocks,
        )?;
        let t = step.tokens.len();
        if t == 0 {
            return Ok((None, timer));
        }
        let n = step.logit_rows.len();
        if comm.is_none() && timer.is_none() && self.graphs.on {
            let g = graph_step(&step, self.graphs.max_context, self.block_size)
                .filter(|g| !self.graphs.failed.contains(&g.rows));
            if let Some(g) = g {
                match self.run_graph(&g) {
                    Ok(()) => return Ok((Some((StepLogits::Graph(g.rows), n)), None)),
                    Err(e) => {
                        // A stream left in a capture would fail everything after: then so
                        // does this step. Else whatever the graph's pass wrote into the cache,
                        // the eager step below writes again with the same bits.
                        self.ops.leave_capture()?;
                        tracing::warn!(
                            error = %e,
                            rows = g.rows,
                            "a decode step's CUDA graph failed: steps of this batch size run eagerly from now on"
                        );
                        self.graphs.graphs.remove(&g.rows);
                        self.graphs.failed.insert(g.rows);
                    }
                }
            }
        }
        let c = &self.config;
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
        Ok((logits.map(|l| (StepLogits::Own(l), n)), ops.timer.take()))
    }

    /// Runs a decode step as its bucket's graph: the step's inputs copied into the graph's
    /// buffers, then one launch. A bucket's first step makes the graph: the buffers, a pass that
    /// runs the step eagerly over them (its results are this step's), then the capture of the
    /// same forward over the same buffers, which runs nothing.
    fn run_graph(&mut self, g: &GraphStep) -> Result<(), EngineError> {
        if let Some(graph) = self.graphs.graphs.get_mut(&g.rows) {
            fill_graph_inputs(&self.ops, &mut graph.inp, g)?;
            graph.graph.launch()?;
            self.graphs.replays += 1;
            return Ok(());
        }
        let c = &self.config;
        let rows = g.rows;
        let heads = (self.shard.q_heads.len(), c.head_dim);
        let inp = StepInputs {
            ids: self.ops.upload(&g.ids)?,
            positions: self.ops.upload(&g.positions)?,
            slots: self.ops.upload(&g.slots)?,
            logit_rows: Some(self.ops.upload(&(0..rows as i32).collect::<Vec<_>>())?),
            batch: self.ops.decode_attn_batch(
                &g.tables,
                &g.context,
                self.graphs.max_context,
                self.block_size,
                heads,
            )?,
            local_ids: None,
        };
        let layers = self.weights.layers.len();
        let mut pass = |inp: StepInputs, scratch: Scratch<Bf16, CudaSlice<f32>>, capture: bool| {
            let mut step = CudaStep::with_inputs(
                &self.ops,
                c,
                &self.shard,
                (&self.cos, &self.sin),
                (&mut self.k_cache, &mut self.v_cache),
                self.block_size,
                inp,
                scratch,
                None,
            );
            let weights = &self.weights;
            let shard = &self.shard;
            let mut run = || {
                forward::forward(
                    &mut step, weights, c, shard, rows, rows, layers, false, None,
                )?
                .ok_or_else(|| EngineError::Internal("a decode graph made no logits".into()))
            };
            let (logits, graph) = match capture {
                true => {
                    let (l, g) = self.ops.capture(&mut run)?;
                    (l, Some(g))
                }
                false => (run()?, None),
            };
            Ok::<_, EngineError>((logits, graph, step.inp, step.scratch.into_inner()))
        };
        let (logits, _, inp, recorded) = pass(inp, Scratch::Record(Vec::new()), false)?;
        let replay = Scratch::replay(recorded, logits)?;
        let (logits, graph, inp, replayed) = pass(inp, replay, true)?;
        let kept = replayed.replayed()?;
        let graph = graph.ok_or_else(|| EngineError::Internal("a capture made no graph".into()))?;
        let bytes =
            kept.iter().map(|b| 2 * b.len()).sum::<usize>() + 4 * logits.len() + inp.batch.bytes();
        tracing::info!(
            rows,
            mib = bytes as f64 / (1u64 << 20) as f64,
            "captured a decode step's CUDA graph (mib: the buffers it keeps)"
        );
        self.graphs.graphs.insert(
            rows,
            DecodeGraph {
                inp,
                _acts: kept,
                logits,
                graph,
            },
        );
        Ok(())
    }
}

/// A graph step's inputs into a graph's buffers, in stream order (after the previous step).
fn fill_graph_inputs(
    ops: &CudaOps,
    inp: &mut StepInputs,
    g: &GraphStep,
) -> Result<(), EngineError> {
    ops.write(&mut inp.ids, &g.ids)?;
    ops.write(&mut inp.positions, &g.positions)?;
    ops.write(&mut inp.slots, &g.slots)?;
    Ok(ops.refill_decode_batch(&mut inp.batch, &g.tables, &g.context)?)
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
    inp: StepInputs,
    /// A tensor-parallel rank's group.
    comm: Option<&'a mut NcclRank>,
    /// The rank's slice of the vocabulary (all of it for the whole model) and the whole's size.
    vocab: (std::ops::Range<usize>, usize),
    /// Where the forward's buffers come from.
    scratch: RefCell<Scratch<Bf16, CudaSlice<f32>>>,
    /// Events around each op, where a benchmark asks where the time goes.
    timer: Option<OpTimer>,
}

/// A step's inputs on the device: what its ops read besides the weights and the cache.
struct StepInputs {
    ids: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    /// Cache slots (negative: a padding row, written nowhere).
    slots: CudaSlice<i64>,
    /// None when no row wants logits (the step ends before the head).
    logit_rows: Option<CudaSlice<i32>>,
    batch: AttnBatch,
    /// The step's token ids as indices into the rank's slice of the embedding (-1: another
    /// rank's token); None for the whole model, which looks up `ids`.
    local_ids: Option<CudaSlice<i32>>,
}

/// Where a step's activation (`A`) and logits (`L`) buffers come from.
enum Scratch<A, L> {
    /// Allocated for the step, freed after it.
    Fresh,
    /// Allocated, and kept once the forward is done with them (a graph's first pass).
    Record(Vec<A>),
    /// The recorded buffers handed out again in the order they were allocated (a graph's
    /// capture, in which nothing may be allocated), and given back into `kept`.
    Replay {
        acts: std::collections::VecDeque<A>,
        logits: Option<L>,
        kept: Vec<A>,
    },
}

/// A device buffer's length in values.
trait Buffer {
    fn values(&self) -> usize;
}

impl<T> Buffer for CudaSlice<T> {
    fn values(&self) -> usize {
        self.len()
    }
}

/// Whether the next recorded buffer (`next`) can be handed out for `len` values (`what`): it
/// must be there and hold that many. One that does not stays where it is (a buffer dropped
/// inside a capture would be freed there, which a capture refuses).
fn again<B: Buffer>(next: Option<&B>, len: usize, what: &str) -> Result<(), EngineError> {
    match next {
        Some(b) if b.values() == len => Ok(()),
        b => Err(EngineError::Internal(format!(
            "a graph capture asked for {len} {what} where its first pass had {:?}",
            b.map(|b| b.values())
        ))),
    }
}

impl<A: Buffer, L: Buffer> Scratch<A, L> {
    /// A recorded pass's buffers, to hand out again in order.
    fn replay(recorded: Self, logits: L) -> Result<Self, EngineError> {
        match recorded {
            Scratch::Record(acts) => Ok(Scratch::Replay {
                acts: acts.into(),
                logits: Some(logits),
                kept: Vec::new(),
            }),
            _ => Err(EngineError::Internal(
                "a graph's first pass kept no buffers".into(),
            )),
        }
    }

    /// An activation buffer of `len` values: the next recorded one when replaying (which must
    /// have that length), else `alloc`'s.
    fn act(
        &mut self,
        len: usize,
        alloc: impl FnOnce() -> Result<A, EngineError>,
    ) -> Result<A, EngineError> {
        match self {
            Scratch::Replay { acts, .. } => {
                again(acts.front(), len, "values")?;
                Ok(acts.pop_front().expect("checked"))
            }
            _ => alloc(),
        }
    }

    /// A logits buffer of `len` values, as [`Self::act`].
    fn logits(
        &mut self,
        len: usize,
        alloc: impl FnOnce() -> Result<L, EngineError>,
    ) -> Result<L, EngineError> {
        match self {
            Scratch::Replay { logits, .. } => {
                again(logits.as_ref(), len, "logits")?;
                Ok(logits.take().expect("checked"))
            }
            _ => alloc(),
        }
    }

    /// The forward's buffers, done with: dropped, or kept.
    fn keep(&mut self, bufs: Vec<A>) {
        match self {
            Scratch::Fresh => drop(bufs),
            Scratch::Record(kept) | Scratch::Replay { kept, .. } => kept.extend(bufs),
        }
    }

    /// The logits buffer of a forward that failed: dropped, or kept (a replay's goes back).
    fn keep_logits(&mut self, l: L) {
        match self {
            Scratch::Replay { logits, .. } => *logits = Some(l),
            _ => drop(l),
        }
    }

    /// A replay's buffers once the forward gave them all back, in allocation order.
    fn replayed(self) -> Result<Vec<A>, EngineError> {
        match self {
            Scratch::Replay { acts, kept, .. } if acts.is_empty() => Ok(kept),
            Scratch::Replay { acts, .. } => Err(EngineError::Internal(format!(
                "a graph's capture left {} of its first pass's buffers unused",
                acts.len()
            ))),
            _ => Err(EngineError::Internal(
                "a graph's capture kept no buffers".into(),
            )),
        }
    }
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
        let inp = StepInputs {
            ids: o.upload(&ids)?,
            positions: o.upload(&i32s(&step.positions))?,
            slots: o.upload(&slots)?,
            logit_rows,
            batch: o.attn_batch(&tables, &q_len, &context, (shard.q_heads.len(), c.head_dim))?,
            local_ids,
        };
        Ok(Self::with_inputs(
            o,
            c,
            shard,
            rope,
            (k_cache, v_cache),
            block_size,
            inp,
            Scratch::Fresh,
            comm,
        ))
    }

    /// A step over inputs already on the device, its buffers from `scratch`.
    #[allow(clippy::too_many_arguments)]
    fn with_inputs(
        o: &'a CudaOps,
        c: &ModelConfig,
        shard: &TpShard,
        rope: (&'a CudaSlice<f32>, &'a CudaSlice<f32>),
        (k_cache, v_cache): (&'a mut [Bf16], &'a mut [Bf16]),
        block_size: usize,
        inp: StepInputs,
        scratch: Scratch<Bf16, CudaSlice<f32>>,
        comm: Option<&'a mut NcclRank>,
    ) -> Self {
        Self {
            o,
            hidden: c.hidden_size,
            heads: (shard.q_heads.len(), shard.kv_heads.len(), c.head_dim),
            eps: c.rms_norm_eps,
            rope,
            k_cache,
            v_cache,
            block_size,
            inp,
            comm,
            vocab: (shard.vocab.clone(), c.vocab_size),
            scratch: RefCell::new(scratch),
            timer: None,
        }
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
        let alloc = || Ok(self.o.alloc_bf16(len)?);
        self.scratch.borrow_mut().act(len, alloc)
    }

    fn alloc_logits(&self, len: usize) -> Result<CudaSlice<f32>, EngineError> {
        let alloc = || Ok(self.o.alloc_f32(len)?);
        self.scratch.borrow_mut().logits(len, alloc)
    }

    fn keep(&mut self, bufs: Vec<Bf16>) {
        self.scratch.get_mut().keep(bufs);
    }

    fn keep_logits(&mut self, logits: CudaSlice<f32>) {
        self.scratch.get_mut().keep_logits(logits);
    }

    fn embed(&mut self, table: &Bf16, out: &mut Bf16) -> Result<(), EngineError> {
        // A rank's slice: its tokens' rows, zeros for the others (the all-reduce that follows
        // adds the one rank's row that holds each token).
        self.timed("embedding", |s| {
            let ids = s.inp.local_ids.as_ref().unwrap_or(&s.inp.ids);
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
        let t = self.inp.slots.len();
        self.timed("rotary", |s| {
            Ok(s.o.qkv_rope(qkv, &s.inp.positions, s.rope.0, s.rope.1, t, s.heads)?)
        })?;
        self.timed("kv writes", |s| {
            Ok(s.o.write_kv(
                qkv,
                &s.inp.slots,
                &mut s.k_cache[layer],
                &mut s.v_cache[layer],
                s.heads,
                s.block_size,
            )?)
        })?;
        self.timed("attention", |s| {
            Ok(s.o.attention(
                &mut s.inp.batch,
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
        let t = self.inp.slots.len();
        self.timed("norms", |s| {
            let rows = s.inp.logit_rows.as_ref().ok_or_else(|| {
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

    fn seq<'a>(tokens: &'a [u32], cached: usize, table: &'a [u32], logits: usize) -> SeqBatch<'a> {
        SeqBatch {
            tokens,
            cached,
            block_table: table,
            logits,
            lora: None,
        }
    }

    /// A decode step of three sequences runs in the graph of four rows: each sequence's token,
    /// position, slot, context and the blocks its context spans in its row, the fourth row
    /// padding that writes no slot and attends to nothing.
    #[test]
    fn a_decode_step_is_padded_to_its_graphs_rows() {
        let (t1, t2, t3) = ([7u32], [8u32], [9u32]);
        let (b1, b2, b3) = ([4u32, 9, 2], [5u32], [6u32, 3, 11, 12]);
        let seqs = [
            seq(&t1, 20, &b1, 1),
            seq(&t2, 0, &b2, 1),
            // A table longer than its context needs: only the blocks it spans go in.
            seq(&t3, 16, &b3, 1),
        ];
        let step = PackedStep::new(&seqs, 100, 64, 16, 16).unwrap();
        // Room for 64 tokens: four blocks a row.
        let g = graph_step(&step, 64, 16).unwrap();
        assert_eq!(g.rows, 4);
        assert_eq!(g.ids, vec![7, 8, 9, 0]);
        assert_eq!(g.positions, vec![20, 0, 16, 0]);
        assert_eq!(g.slots, vec![9 * 16 + 4, 5 * 16, 3 * 16, -1]);
        assert_eq!(g.context, vec![21, 1, 17, 0]);
        #[rustfmt::skip]
        assert_eq!(g.tables, vec![
            4, 9, 0, 0,
            5, 0, 0, 0,
            6, 3, 0, 0,
            0, 0, 0, 0,
        ]);
        // Each bucket's size, up to the largest.
        for (n, rows) in [(1, 1), (2, 2), (5, 8), (17, 24), (256, 256)] {
            let toks = vec![[1u32]; n];
            let seqs: Vec<_> = toks.iter().map(|t| seq(t, 3, &b2, 1)).collect();
            let step = PackedStep::new(&seqs, 100, 64, 16, 16).unwrap();
            assert_eq!(graph_step(&step, 64, 16).map(|g| g.rows), Some(rows), "{n}");
        }
    }

    impl Buffer for Vec<u16> {
        fn values(&self) -> usize {
            self.len()
        }
    }

    /// A graph's first pass keeps every buffer the forward allocates; its capture gets the
    /// same buffers back in the same order (the same memory: nothing allocated) and keeps them
    /// again; a capture that asks for other sizes, or leaves a buffer unused, is refused.
    #[test]
    fn a_capture_gets_the_first_passs_buffers_back_in_order() {
        type S = Scratch<Vec<u16>, Vec<u16>>;
        let fresh = |n: usize| move || Ok(vec![0u16; n]);
        let never = || -> Result<Vec<u16>, EngineError> { panic!("a replay allocated") };
        // The first pass: three activations and the logits, as a forward allocates them.
        let mut rec = S::Record(Vec::new());
        let acts: Vec<Vec<u16>> = [4, 6, 4]
            .iter()
            .map(|&n| rec.act(n, fresh(n)).unwrap())
            .collect();
        let at: Vec<*const u16> = acts.iter().map(|b| b.as_ptr()).collect();
        let logits = rec.logits(10, fresh(10)).unwrap();
        let logits_at = logits.as_ptr();
        rec.keep(acts);
        // The capture.
        let mut rep = S::replay(rec, logits).unwrap();
        let acts: Vec<Vec<u16>> = [4, 6, 4]
            .iter()
            .map(|&n| rep.act(n, never).unwrap())
            .collect();
        assert_eq!(acts.iter().map(|b| b.as_ptr()).collect::<Vec<_>>(), at);
        let logits = rep.logits(10, never).unwrap();
        assert_eq!(logits.as_ptr(), logits_at);
        rep.keep(acts);
        let kept = rep.replayed().unwrap();
        assert_eq!(kept.iter().map(|b| b.as_ptr()).collect::<Vec<_>>(), at);
        // Another size than the first pass's, a buffer left over, or no first pass: refused.
        let mut rec = S::Record(Vec::new());
        let acts = vec![rec.act(4, fresh(4)).unwrap(), rec.act(6, fresh(6)).unwrap()];
        rec.keep(acts);
        let mut rep = S::replay(rec, vec![0; 10]).unwrap();
        // Refused without dropping anything (inside a capture a drop would be a free): the
        // buffers stay to be handed out as recorded.
        assert!(rep.act(6, never).is_err());
        assert!(rep.logits(11, never).is_err());
        assert_eq!(rep.act(4, never).unwrap().len(), 4);
        let l = rep.logits(10, never).unwrap();
        let l_at = l.as_ptr();
        // A forward that fails gives its logits back with its buffers.
        rep.keep_logits(l);
        let again = rep.logits(10, never).unwrap();
        assert_eq!(again.as_ptr(), l_at);
        let mut rec = S::Record(Vec::new());
        let acts = vec![rec.act(4, fresh(4)).unwrap(), rec.act(6, fresh(6)).unwrap()];
        rec.keep(acts);
        let mut rep = S::replay(rec, vec![0; 10]).unwrap();
        let one = rep.act(4, never).unwrap();
        rep.keep(vec![one]);
        assert!(rep.replayed().is_err());
        assert!(S::replay(S::Fresh, vec![0; 10]).is_err());
        // An eager step's buffers are allocated each time and dropped.
        let mut eager = S::Fresh;
        let b = eager.act(3, fresh(3)).unwrap();
        eager.keep(vec![b]);
        assert!(eager.replayed().is_err());
    }

    /// Everything but one sampled token for each of at most 256 sequences within the graphs'
    /// context runs eagerly.
    #[test]
    fn steps_a_graph_cannot_replay_run_eagerly() {
        let (one, two) = ([1u32], [1u32, 2]);
        let table = [0u32, 1, 2, 3];
        let eager = |seqs: &[SeqBatch<'_>], max_context: usize| {
            let step = PackedStep::new(seqs, 100, 64, 16, 16).unwrap();
            graph_step(&step, max_context, 16).is_none()
        };
        assert!(!eager(&[seq(&one, 5, &table, 1)], 64));
        // A prompt chunk, or proposals to verify.
        assert!(eager(
            &[seq(&one, 5, &table, 1), seq(&two, 0, &table, 1)],
            64
        ));
        assert!(eager(&[seq(&two, 5, &table, 2)], 64));
        // A token that samples nothing.
        assert!(eager(&[seq(&one, 5, &table, 0)], 64));
        // A context past the graphs' (33 tokens where they hold 32).
        assert!(eager(&[seq(&one, 32, &table, 1)], 32));
        assert!(!eager(&[seq(&one, 31, &table, 1)], 32));
        // More sequences than the largest bucket.
        let toks = vec![[1u32]; 257];
        let seqs: Vec<_> = toks.iter().map(|t| seq(t, 3, &table, 1)).collect();
        assert!(eager(&seqs, 64));
        // An adapter's rows.
        let a = tandem_model::LoraAdapter {
            name: "a".into(),
            path: "a".into(),
            rank: 1,
            alpha: 1.0,
            targets: Vec::new(),
            base_model: None,
            content_hash: 1,
            layers: Vec::new(),
        };
        let mut s = seq(&one, 5, &table, 1);
        s.lora = Some(&a);
        assert!(eager(&[s], 64));
    }

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
