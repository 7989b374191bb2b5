//! The Llama forward, written once against the op set a device provides ([`StepOps`]), and the
//! model's weights, gathered once by [`TensorName`] whatever a device keeps them as
//! ([`ModelWeights`]).
//!
//! A device implements the ops on its own buffers (f32 rows on the CPU, bf16 on a CUDA GPU) for
//! one packed step: the new tokens of every scheduled sequence one after another, each with its
//! position and its cache slot. [`forward`] strings the ops into the model: embedding, then per
//! layer the norms, projections, attention over the paged cache and MLP with their residuals,
//! then the final norm and the head over the rows that want logits.

use serde::Serialize;
use tandem_model::{LayerTensor, LoraAdapter, ModelConfig, TensorName};

use crate::error::EngineError;
use crate::shard::{Cut, Part, TpShard};

/// One packed step's operations on a device. The implementor holds the step's inputs (token
/// ids, positions, cache slots, the sequences' block tables and the rows that want logits) and
/// the KV cache it writes and reads; [`forward`] calls the ops in the model's order.
pub(crate) trait StepOps {
    /// A matrix of activations, rows of one width.
    type Act;
    /// Rows of f32 logits.
    type Logits;
    /// A projection's weights.
    type Matrix;
    /// A norm's weights.
    type Vector;

    /// An activation buffer of `len` values.
    fn alloc(&self, len: usize) -> Result<Self::Act, EngineError>;
    /// A logits buffer of `len` values.
    fn alloc_logits(&self, len: usize) -> Result<Self::Logits, EngineError>;
    /// The step's activation buffers once it is done with them, in the order it allocated
    /// them: dropped, unless the device keeps them (a CUDA graph's, which it replays over).
    fn keep(&mut self, bufs: Vec<Self::Act>) {
        drop(bufs);
    }
    /// A logits buffer the step made but does not return (it failed): dropped, as [`Self::keep`].
    fn keep_logits(&mut self, logits: Self::Logits) {
        drop(logits);
    }
    /// `out[t] = table[token t]`.
    fn embed(&mut self, table: &Self::Matrix, out: &mut Self::Act) -> Result<(), EngineError>;
    /// `out = rms_norm(x) · w`, `rows` rows.
    fn rms_norm(
        &mut self,
        x: &Self::Act,
        w: &Self::Vector,
        out: &mut Self::Act,
        rows: usize,
    ) -> Result<(), EngineError>;
    /// `x += delta; out = rms_norm(x) · w`, `rows` rows.
    fn add_rms_norm(
        &mut self,
        x: &mut Self::Act,
        delta: &Self::Act,
        w: &Self::Vector,
        out: &mut Self::Act,
        rows: usize,
    ) -> Result<(), EngineError>;
    /// `out = x · wᵀ`, `(m, n, k)`: `m` rows of `k` values in, of `n` out.
    fn matmul(
        &mut self,
        w: &Self::Matrix,
        x: &Self::Act,
        mnk: (usize, usize, usize),
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;
    /// The parts some families add to the fused q|k|v rows before attention, in HF's order:
    /// `bias` (q|k|v stacked, Qwen2) added to every row, then each query head RMS-normed by
    /// `q_norm` and each key head by `k_norm` (Qwen3). A device that has not built them refuses.
    fn qkv_extras(
        &mut self,
        qkv: &mut Self::Act,
        bias: Option<&Self::Vector>,
        norms: Option<(&Self::Vector, &Self::Vector)>,
        rows: usize,
    ) -> Result<(), EngineError> {
        let _ = (qkv, rows);
        if bias.is_some() || norms.is_some() {
            return Err(EngineError::Unsupported(
                "q/k/v biases and head norms (Qwen2, Qwen3) on this device".into(),
            ));
        }
        Ok(())
    }
    /// Layer `layer`'s attention from its fused q|k|v rows: rotary embedding of q and k at each
    /// token's position, k and v into the cache at each token's slot, then each sequence's
    /// queries over its cached context (causal within the step) into `out`.
    fn attention(
        &mut self,
        layer: usize,
        qkv: &mut Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;
    /// `out = silu(gate) · up` for `rows` rows of [gate | up], `ff` wide each half.
    fn silu_mul(
        &mut self,
        gate_up: &Self::Act,
        out: &mut Self::Act,
        rows: usize,
        ff: usize,
    ) -> Result<(), EngineError>;
    /// `out = silu(gate) · up` of the product `x · wᵀ` (`(m, ff, k)`: `w` stacks `ff` gate rows
    /// over `ff` up rows): [`StepOps::matmul`] into `gate_up` and [`StepOps::silu_mul`] of it,
    /// unless a device does both in one pass with the same bits (the CPU: the product's halves
    /// never leave its threads' caches; `gate_up` is then left as it was).
    fn gate_up_silu(
        &mut self,
        w: &Self::Matrix,
        x: &Self::Act,
        (m, ff, k): (usize, usize, usize),
        gate_up: &mut Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), EngineError> {
        self.matmul(w, x, (m, 2 * ff, k), gate_up)?;
        self.silu_mul(gate_up, out, m, ff)
    }
    /// Adds each LoRA adapter's low-rank product to its rows of projection `site`'s output `out`
    /// (from `x`, the projection's input), layer `layer`: `out += scale · B·(A·x)` for every
    /// pair the adapter has there, the rows of one adapter together so that its A and B are
    /// read once. Only called for a step with adapters; a device that has not built them refuses.
    fn lora(
        &mut self,
        layer: usize,
        site: LoraSite,
        x: &Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), EngineError> {
        let _ = (layer, site, x, out);
        Err(EngineError::Unsupported(
            "LoRA adapters on this device".into(),
        ))
    }
    /// From here to the end of the step only the rows that want logits go on: the next
    /// [`Self::attention`] still rotates and caches every row's keys and values but computes
    /// only those rows' outputs, into its `out`'s first rows in order; `x`'s rows are moved up
    /// the same way; [`Self::final_norm`] then takes `x`'s first rows. Called in the last layer,
    /// after its q|k|v product, where some rows want no logits. Returns how many rows go on, or
    /// None (the default) where the device computes every row to the end.
    fn keep_logit_rows(&mut self, x: &mut Self::Act) -> Result<Option<usize>, EngineError> {
        let _ = x;
        Ok(None)
    }
    /// `x += delta` over all rows, then the rows that want logits, normed by `w`, into `out` in
    /// order. `scratch` (as large as `x`) may hold every row's norm on the way. (After
    /// [`Self::keep_logit_rows`], `x` and `delta` hold only those rows, first.)
    fn final_norm(
        &mut self,
        x: &mut Self::Act,
        delta: &Self::Act,
        w: &Self::Vector,
        scratch: &mut Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;
    /// `out = x · wᵀ` into f32 logits, `(m, n, k)` as for [`StepOps::matmul`].
    fn head(
        &mut self,
        w: &Self::Matrix,
        x: &Self::Act,
        mnk: (usize, usize, usize),
        out: &mut Self::Logits,
    ) -> Result<(), EngineError>;
    /// `x` summed over the ranks of the step's tensor-parallel group, in place on every rank:
    /// the partial sums of a row-parallel product, or the vocab-parallel embedding. Only
    /// called in a group of more than one rank.
    fn all_reduce(&mut self, x: &mut Self::Act) -> Result<(), EngineError> {
        let _ = x;
        Err(EngineError::Unsupported(
            "tensor parallelism on this device".into(),
        ))
    }
    /// Every rank's `local` logits (`rows` rows of its vocabulary slice) into `out` (`rows`
    /// rows of the whole vocabulary), on every rank. Only called in a group of more than one.
    fn gather_logits(
        &mut self,
        local: &Self::Logits,
        rows: usize,
        out: &mut Self::Logits,
    ) -> Result<(), EngineError> {
        let _ = (local, rows, out);
        Err(EngineError::Unsupported(
            "tensor parallelism on this device".into(),
        ))
    }
    /// A mixture of experts' routing of `rows` rows of `x` (normed): the router's scores, a
    /// softmax over every expert, the `experts.active` best of each row and their weights
    /// (renormalized where `experts.norm_topk`). A device that has not built experts refuses.
    fn route(
        &mut self,
        experts: &Experts<Self::Matrix>,
        x: &Self::Act,
        rows: usize,
    ) -> Result<Routing, EngineError> {
        let _ = (experts, x, rows);
        Err(EngineError::Unsupported(
            "mixture-of-experts layers on this device".into(),
        ))
    }
    /// `out` = each row's experts' outputs on its row of `x`, weighted as `routing` says: the
    /// rows grouped by expert, so that each expert's weights are read once.
    fn experts(
        &mut self,
        experts: &Experts<Self::Matrix>,
        x: &Self::Act,
        routing: &Routing,
        out: &mut Self::Act,
    ) -> Result<(), EngineError> {
        let _ = (experts, x, routing, out);
        Err(EngineError::Unsupported(
            "mixture-of-experts layers on this device".into(),
        ))
    }
    /// Waits for the step's work when nothing is returned (a device that runs ops
    /// asynchronously); nothing on the CPU.
    fn finish(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
}

/// A projection of a layer whose output LoRA adapters add to, as the forward fuses them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoraSite {
    /// The fused q|k|v product (the adapter's q, k and v pairs).
    Qkv,
    /// The attention output.
    O,
    /// The fused gate|up product.
    GateUp,
    /// The down product.
    Down,
}

/// One adapter's rows of a packed step.
pub(crate) struct LoraRows<'a> {
    pub adapter: &'a LoraAdapter,
    /// Its sequences' token rows, in step order.
    pub rows: Vec<usize>,
}

/// One decoder layer's weights as a device holds them.
pub(crate) struct LayerWeights<M, V> {
    pub attn_norm: V,
    /// q, k and v projections stacked by rows: one product per layer instead of three.
    pub qkv: M,
    /// q, k and v biases stacked the same way (Qwen2).
    pub qkv_bias: Option<V>,
    /// Per-head RMS norm weights of queries and keys (Qwen3).
    pub qk_norm: Option<(V, V)>,
    pub o: M,
    pub ffn_norm: V,
    pub mlp: Mlp<M>,
}

/// A layer's MLP.
pub(crate) enum Mlp<M> {
    /// One SwiGLU MLP: gate and up projections stacked by rows, and down.
    Dense { gate_up: M, down: M },
    /// A mixture of experts.
    Experts(Experts<M>),
}

/// A mixture of experts' weights and routing settings (see [`tandem_model::MoeConfig`]).
pub(crate) struct Experts<M> {
    /// The router: a score for each expert.
    pub router: M,
    /// Each expert's gate|up (stacked by rows) and down: those this rank holds, experts
    /// `first..`.
    pub experts: Vec<(M, M)>,
    /// The first expert held.
    pub first: usize,
    /// Experts in the layer.
    pub total: usize,
    /// Experts each row runs.
    pub active: usize,
    /// Whether the chosen experts' weights are renormalized to sum to one.
    pub norm_topk: bool,
    /// Width of each expert's gate and up.
    pub ff: usize,
}

/// Each row's chosen experts and their weights: row `r`'s are at `r·active ..`, best first.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Routing {
    pub active: usize,
    pub expert: Vec<u32>,
    pub weight: Vec<f32>,
}

impl Routing {
    /// Routing of `rows` rows from their router scores (`rows × n` values): a softmax over the
    /// `n` experts (in f32, its sum in expert order), the `active` largest (the lower index first
    /// on a tie), renormalized by their sum (best first) where `norm`. Row by row, so a row's
    /// routing never depends on the others.
    pub fn from_scores(scores: &[f32], n: usize, active: usize, norm: bool) -> Self {
        let rows = scores.len() / n.max(1);
        let mut r = Self {
            active,
            expert: Vec::with_capacity(rows * active),
            weight: Vec::with_capacity(rows * active),
        };
        let mut p = vec![0f32; n];
        let mut order: Vec<u32> = Vec::with_capacity(n);
        for row in scores.chunks_exact(n) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (p, &s) in p.iter_mut().zip(row) {
                *p = (s - max).exp();
                sum += *p;
            }
            for p in p.iter_mut() {
                *p /= sum;
            }
            order.clear();
            order.extend(0..n as u32);
            // Stable: equal probabilities keep the lower index first.
            order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
            let top = &order[..active];
            let total: f32 = top.iter().map(|&e| p[e as usize]).sum();
            r.expert.extend_from_slice(top);
            r.weight.extend(top.iter().map(|&e| match norm {
                true => p[e as usize] / total,
                false => p[e as usize],
            }));
        }
        r
    }
}

/// Rows routed to each expert of a mixture of experts since the model was built, summed over its
/// layers (and over the ranks of a group): what an operator watches for load imbalance. Read
/// while steps run (atomic counters).
#[derive(Debug)]
pub struct ExpertLoad {
    rows: Vec<std::sync::atomic::AtomicU64>,
    /// Experts that ran (had rows) summed over the routings counted, and the routings.
    runs: std::sync::atomic::AtomicU64,
    routings: std::sync::atomic::AtomicU64,
}

impl ExpertLoad {
    /// Counters for `experts` experts.
    pub fn new(experts: usize) -> Self {
        Self {
            rows: (0..experts).map(|_| Default::default()).collect(),
            runs: Default::default(),
            routings: Default::default(),
        }
    }

    /// Counts a layer's routing.
    pub(crate) fn add(&self, r: &Routing) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut ran = vec![false; self.rows.len()];
        for &e in &r.expert {
            if let Some(c) = self.rows.get(e as usize) {
                c.fetch_add(1, Relaxed);
                ran[e as usize] = true;
            }
        }
        let runs = ran.iter().filter(|&&r| r).count() as u64;
        self.runs.fetch_add(runs, Relaxed);
        self.routings.fetch_add(1, Relaxed);
    }

    /// Experts that ran, summed over the routings so far, and the routings: a step of many
    /// rows reads more experts' weights than the `active` a row runs.
    pub fn runs(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.runs.load(Relaxed), self.routings.load(Relaxed))
    }

    /// Rows each expert has computed so far, in expert order.
    pub fn snapshot(&self) -> Vec<u64> {
        self.rows
            .iter()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            .collect()
    }
}

/// A Llama model's weights as a device holds them: matrices `M`, norm vectors `V`.
pub(crate) struct ModelWeights<M, V> {
    pub layers: Vec<LayerWeights<M, V>>,
    /// The token embedding; also the output head when the two are tied.
    pub embed: M,
    /// None when the head is tied to the embedding.
    pub head: Option<M>,
    pub norm: V,
}

impl<M, V> ModelWeights<M, V> {
    /// Builds `shard`'s part of every weight of a `c` model: `matrix` makes one matrix from
    /// tensor parts stacked by rows (one part for most; q|k|v and gate|up fused), `vector` one
    /// vector from parts laid end to end (a norm; q|k|v biases fused). A whole shard asks for
    /// whole tensors.
    pub fn build(
        c: &ModelConfig,
        shard: &TpShard,
        mut matrix: impl FnMut(&[Part]) -> Result<M, EngineError>,
        mut vector: impl FnMut(&[Part]) -> Result<V, EngineError>,
    ) -> Result<Self, EngineError> {
        use LayerTensor::*;
        let whole = shard.is_whole();
        let cut = |name: TensorName, c: Cut| Part {
            name,
            cut: if whole { Cut::Whole } else { c },
        };
        let rows = |name, r: &std::ops::Range<usize>, scale: usize| {
            cut(name, Cut::Rows(r.start * scale..r.end * scale))
        };
        let cols = |name, r: &std::ops::Range<usize>, scale: usize| {
            cut(name, Cut::Cols(r.start * scale..r.end * scale))
        };
        let hd = c.head_dim;
        let (q, kv, ff) = (&shard.q_heads, &shard.kv_heads, &shard.ff);
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |t| TensorName::layer(i, t);
            let qkv = |[tq, tk, tv]: [LayerTensor; 3]| {
                [rows(n(tq), q, hd), rows(n(tk), kv, hd), rows(n(tv), kv, hd)]
            };
            layers.push(LayerWeights {
                attn_norm: vector(&[Part::whole(n(AttnNorm))])?,
                qkv: matrix(&qkv([AttnQ, AttnK, AttnV]))?,
                qkv_bias: match c.family.qkv_bias() {
                    true => Some(vector(&qkv([AttnQBias, AttnKBias, AttnVBias]))?),
                    false => None,
                },
                qk_norm: match c.family.qk_norm() {
                    true => Some((
                        vector(&[Part::whole(n(AttnQNorm))])?,
                        vector(&[Part::whole(n(AttnKNorm))])?,
                    )),
                    false => None,
                },
                o: matrix(&[cols(n(AttnOutput), q, hd)])?,
                ffn_norm: vector(&[Part::whole(n(FfnNorm))])?,
                mlp: match &c.moe {
                    None => Mlp::Dense {
                        gate_up: matrix(&[rows(n(FfnGate), ff, 1), rows(n(FfnUp), ff, 1)])?,
                        down: matrix(&[cols(n(FfnDown), ff, 1)])?,
                    },
                    Some(m) => {
                        let expert = |t, e| Part {
                            name: n(t),
                            cut: Cut::Expert(e),
                        };
                        let experts = shard
                            .experts
                            .clone()
                            .map(|e| {
                                Ok((
                                    matrix(&[expert(FfnGateExps, e), expert(FfnUpExps, e)])?,
                                    matrix(&[expert(FfnDownExps, e)])?,
                                ))
                            })
                            .collect::<Result<Vec<_>, EngineError>>()?;
                        Mlp::Experts(Experts {
                            router: matrix(&[Part::whole(n(FfnGateInp))])?,
                            experts,
                            first: shard.experts.start,
                            total: m.experts,
                            active: m.active,
                            norm_topk: m.norm_topk,
                            ff: m.expert_ff,
                        })
                    }
                },
            });
        }
        let embed = matrix(&[rows(TensorName::Embedding, &shard.vocab, 1)])?;
        let head = if c.tie_word_embeddings {
            None
        } else {
            Some(matrix(&[rows(TensorName::Output, &shard.vocab, 1)])?)
        };
        Ok(Self {
            layers,
            embed,
            head,
            norm: vector(&[Part::whole(TensorName::OutputNorm)])?,
        })
    }

    /// The output head: its own matrix, or the embedding when tied.
    pub fn head(&self) -> &M {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// Every matrix a step multiplies by: the layers' projections, then the output head.
    pub fn matrices(&self) -> impl Iterator<Item = &M> {
        self.layers
            .iter()
            .flat_map(|l| {
                let mlp: Vec<&M> = match &l.mlp {
                    Mlp::Dense { gate_up, down } => vec![gate_up, down],
                    Mlp::Experts(x) => std::iter::once(&x.router)
                        .chain(x.experts.iter().flat_map(|(gu, d)| [gu, d]))
                        .collect(),
                };
                [&l.qkv, &l.o].into_iter().chain(mlp)
            })
            .chain([self.head()])
    }
}

/// Runs op `$call` on device `$d`; with a profile (`$times`, an `Option<&mut OpTimes>`), waits
/// for the device to finish it and adds its time to the profile's `$slot`.
macro_rules! op {
    ($times:expr, $d:expr, $slot:ident, $call:expr) => {{
        match $times.as_deref_mut() {
            None => $call,
            Some(times) => {
                let t0 = std::time::Instant::now();
                let r = $call;
                $d.finish()?;
                times.$slot += t0.elapsed().as_secs_f64();
                r
            }
        }
    }};
}

/// One packed step of `shard`'s part of a `c` model with its `weights` on device `d`, over
/// `tokens` token rows of which `logit_rows` want logits: those logits (the whole vocabulary's,
/// on every rank), or None when no row wants them. In a group of more than one rank, the ranks
/// run this in lockstep: each all-reduce and gather is a collective of the group. With `times`,
/// each op's time is added to it (the device finishing each op before the next starts).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<D: StepOps>(
    d: &mut D,
    weights: &ModelWeights<D::Matrix, D::Vector>,
    c: &ModelConfig,
    shard: &TpShard,
    tokens: usize,
    logit_rows: usize,
    layers: usize,
    lora: bool,
    mut times: Option<&mut OpTimes>,
) -> Result<Option<D::Logits>, EngineError> {
    let t = tokens;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let ff = shard.ff.len();
    let (qd, kvd) = (shard.q_heads.len() * hd, shard.kv_heads.len() * hd);
    let n = logit_rows;
    // Every buffer first, and every one back to the device however the step ends (a CUDA
    // graph's capture hands out buffers it keeps, which must never be freed inside it).
    let sizes = [
        t * h,
        t * h,
        t * (qd + 2 * kvd),
        t * qd,
        t * h,
        t * 2 * ff,
        t * ff,
        n * h,
    ];
    let mut bufs = Vec::with_capacity(sizes.len());
    for len in sizes.into_iter().take(if n > 0 { 8 } else { 7 }) {
        match d.alloc(len) {
            Ok(b) => bufs.push(b),
            Err(e) => {
                d.keep(bufs);
                return Err(e);
            }
        }
    }
    let mut logits = match n {
        0 => None,
        _ => match d.alloc_logits(n * shard.vocab.len()) {
            Ok(l) => Some(l),
            Err(e) => {
                d.keep(bufs);
                return Err(e);
            }
        },
    };
    let out = layers_and_head(
        d,
        weights,
        c,
        shard,
        t,
        n,
        layers,
        lora,
        &mut times,
        &mut bufs,
        &mut logits,
    );
    d.keep(bufs);
    match out {
        Ok(all) => Ok(all.or(logits)),
        Err(e) => {
            if let Some(l) = logits {
                d.keep_logits(l);
            }
            Err(e)
        }
    }
}

/// [`forward`]'s ops over its buffers (`x, hbuf, qkv, att, proj, gu, act` and, where rows want
/// logits, `last`) into `logits`: None, or a tensor-parallel group's gathered logits (then
/// `logits` holds this rank's slice).
#[allow(clippy::too_many_arguments)]
fn layers_and_head<D: StepOps>(
    d: &mut D,
    weights: &ModelWeights<D::Matrix, D::Vector>,
    c: &ModelConfig,
    shard: &TpShard,
    t: usize,
    n: usize,
    layers: usize,
    lora: bool,
    times: &mut Option<&mut OpTimes>,
    bufs: &mut [D::Act],
    logits: &mut Option<D::Logits>,
) -> Result<Option<D::Logits>, EngineError> {
    let tp = !shard.is_whole();
    let (h, hd) = (c.hidden_size, c.head_dim);
    let ff = shard.ff.len();
    let (qd, kvd) = (shard.q_heads.len() * hd, shard.kv_heads.len() * hd);
    let [x, hbuf, qkv, att, proj, gu, act, rest @ ..] = bufs else {
        return Err(EngineError::Internal("a step without its buffers".into()));
    };
    op!(times, d, embed, d.embed(&weights.embed, x))?;
    if tp {
        op!(times, d, collectives, d.all_reduce(x))?;
    }
    // `layers` below the model's: an early exit (a self-draft), its last layer's output
    // normed and put through the head as the whole model's is.
    //
    // The rows the layers compute: every row, until the last layer's attention has cached
    // every row's keys and values; from there, where the device can, only the rows that want
    // logits (a prompt's last, of its hundreds: 3% of a 30-layer model's prefill). Each row's
    // values are its own whatever rows are beside it, so the kept rows' bits do not change.
    // (Not with adapters, whose rows are counted by sequence.)
    let last = layers.min(weights.layers.len()).saturating_sub(1);
    let mut m = t;
    for (li, l) in weights.layers.iter().enumerate().take(layers) {
        if li == 0 {
            op!(times, d, norms, d.rms_norm(x, &l.attn_norm, hbuf, t))?;
        } else {
            // The previous layer's MLP output joins the residual here.
            op!(
                times,
                d,
                norms,
                d.add_rms_norm(x, proj, &l.attn_norm, hbuf, t)
            )?;
        }
        op!(
            times,
            d,
            qkv,
            d.matmul(&l.qkv, hbuf, (t, qd + 2 * kvd, h), qkv)
        )?;
        if lora {
            op!(times, d, lora, d.lora(li, LoraSite::Qkv, hbuf, qkv))?;
        }
        if l.qkv_bias.is_some() || l.qk_norm.is_some() {
            let norms = l.qk_norm.as_ref().map(|(q, k)| (q, k));
            op!(
                times,
                d,
                qkv,
                d.qkv_extras(qkv, l.qkv_bias.as_ref(), norms, t)
            )?;
        }
        let kept = match li == last && !lora && n < t {
            true => d.keep_logit_rows(x)?,
            false => None,
        };
        m = kept.unwrap_or(m);
        op!(times, d, attention, d.attention(li, qkv, att))?;
        if kept == Some(0) {
            // No row wants logits (a prompt's chunk before its last): its keys and values,
            // cached, were all the last layer had to give. (A step of no rows goes through
            // every layer: an expert-parallel rank's experts serve the other ranks' rows.)
            break;
        }
        op!(times, d, o, d.matmul(&l.o, att, (m, h, qd), proj))?;
        if lora {
            op!(times, d, lora, d.lora(li, LoraSite::O, att, proj))?;
        }
        if tp {
            op!(times, d, collectives, d.all_reduce(proj))?;
        }
        op!(
            times,
            d,
            norms,
            d.add_rms_norm(x, proj, &l.ffn_norm, hbuf, m)
        )?;
        match &l.mlp {
            Mlp::Dense { gate_up, down } => {
                if lora {
                    // The adapters add to the product before silu·mul: two passes.
                    op!(
                        times,
                        d,
                        gate_up,
                        d.matmul(gate_up, hbuf, (m, 2 * ff, h), gu)
                    )?;
                    op!(times, d, lora, d.lora(li, LoraSite::GateUp, hbuf, gu))?;
                    op!(times, d, silu, d.silu_mul(gu, act, m, ff))?;
                } else {
                    // (Timed as the product where a device fuses them.)
                    op!(
                        times,
                        d,
                        gate_up,
                        d.gate_up_silu(gate_up, hbuf, (m, ff, h), gu, act)
                    )?;
                }
                op!(times, d, down, d.matmul(down, act, (m, h, ff), proj))?;
                if lora {
                    op!(times, d, lora, d.lora(li, LoraSite::Down, act, proj))?;
                }
            }
            Mlp::Experts(_) if lora => {
                return Err(EngineError::Unsupported(
                    "LoRA adapters on a mixture-of-experts model".into(),
                ))
            }
            Mlp::Experts(x) => {
                let routing = op!(times, d, router, d.route(x, hbuf, m))?;
                op!(times, d, experts, d.experts(x, hbuf, &routing, proj))?;
            }
        }
        if tp {
            op!(times, d, collectives, d.all_reduce(proj))?;
        }
    }
    let (Some(last), Some(logits)) = (rest.first_mut(), logits.as_mut()) else {
        d.finish()?;
        return Ok(None);
    };
    op!(
        times,
        d,
        norms,
        d.final_norm(x, proj, &weights.norm, hbuf, last)
    )?;
    let vocab = shard.vocab.len();
    op!(
        times,
        d,
        head,
        d.head(weights.head(), last, (n, vocab, h), logits)
    )?;
    if !tp {
        return Ok(None);
    }
    let mut all = d.alloc_logits(n * c.vocab_size)?;
    op!(times, d, collectives, d.gather_logits(logits, n, &mut all))?;
    Ok(Some(all))
}

/// One sequence's part of a step.
#[derive(Clone, Debug)]
pub struct SeqBatch<'a> {
    /// New token ids this step.
    pub tokens: &'a [u32],
    /// Tokens already in the cache before this step.
    pub cached: usize,
    /// Physical KV block ids in logical order, covering the cached and the new tokens.
    pub block_table: &'a [u32],
    /// How many of the sequence's last new tokens this step produces logits for (0: none; 1:
    /// the last, to sample the next token; more: a speculative step verifying proposed tokens).
    pub logits: usize,
    /// The LoRA adapter the sequence runs with (None: the base model).
    pub lora: Option<&'a LoraAdapter>,
}

/// One sequence's part of a [`PackedStep`] (only sequences with new tokens appear).
pub(crate) struct PackedSeq<'a> {
    /// Row of its first new token.
    pub q_start: usize,
    pub q_len: usize,
    /// Tokens in the cache after the step, the new ones included.
    pub context: usize,
    pub block_table: &'a [u32],
}

/// A step's sequences flattened into token rows, checked against the model and the pool: what
/// every device's forward starts from.
pub(crate) struct PackedStep<'a> {
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// Cache slot (block · block_size + offset) of each token's K/V.
    pub slots: Vec<usize>,
    /// Rows whose logits the step returns, in order.
    pub logit_rows: Vec<usize>,
    pub seqs: Vec<PackedSeq<'a>>,
    /// The rows of each adapter the step runs, in order of first appearance (empty: none).
    pub lora: Vec<LoraRows<'a>>,
}

impl<'a> PackedStep<'a> {
    pub fn new(
        seqs: &[SeqBatch<'a>],
        vocab: usize,
        max_pos: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let mut step = PackedStep {
            tokens: Vec::with_capacity(t),
            positions: Vec::with_capacity(t),
            slots: Vec::with_capacity(t),
            logit_rows: Vec::new(),
            seqs: Vec::with_capacity(seqs.len()),
            lora: Vec::new(),
        };
        for s in seqs {
            let q_start = step.tokens.len();
            let ctx = s.cached + s.tokens.len();
            if ctx > max_pos {
                return Err(EngineError::ContextOverflow {
                    tokens: ctx,
                    max: max_pos,
                });
            }
            if ctx > s.block_table.len() * block_size
                || s.block_table.iter().any(|&b| b as usize >= num_blocks)
            {
                return Err(EngineError::Internal(format!(
                    "{ctx} tokens but blocks {:?} of a pool of {num_blocks}",
                    s.block_table
                )));
            }
            for (i, &tok) in s.tokens.iter().enumerate() {
                if tok as usize >= vocab {
                    return Err(EngineError::BadToken { id: tok, vocab });
                }
                let p = s.cached + i;
                step.tokens.push(tok);
                step.positions.push(p);
                step.slots
                    .push(s.block_table[p / block_size] as usize * block_size + p % block_size);
            }
            if s.tokens.is_empty() {
                continue;
            }
            let rows = s.logits.min(s.tokens.len());
            step.logit_rows
                .extend(step.tokens.len() - rows..step.tokens.len());
            step.seqs.push(PackedSeq {
                q_start,
                q_len: s.tokens.len(),
                context: ctx,
                block_table: s.block_table,
            });
            if let Some(a) = s.lora {
                let rows = q_start..q_start + s.tokens.len();
                match step.lora.iter_mut().find(|g| std::ptr::eq(g.adapter, a)) {
                    Some(g) => g.rows.extend(rows),
                    None => step.lora.push(LoraRows {
                        adapter: a,
                        rows: rows.collect(),
                    }),
                }
            }
        }
        Ok(step)
    }
}

/// Seconds one step's forward spent in each op (summed over the layers): the split a profile
/// of the steps reports. Taken around each op as the device finishes it, so the sum is the
/// forward's time less the gaps between ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct OpTimes {
    /// The token embedding (and its all-reduce across ranks).
    pub embed: f64,
    /// RMS norms, with the residual adds they fuse.
    pub norms: f64,
    /// The fused q|k|v product (with Qwen's biases and head norms).
    pub qkv: f64,
    /// Rotary embedding, the cache writes and attention over the paged cache.
    pub attention: f64,
    /// The attention output product.
    pub o: f64,
    /// The fused gate|up product.
    pub gate_up: f64,
    /// silu(gate) · up.
    pub silu: f64,
    /// The down product.
    pub down: f64,
    /// The output head (the rows that sample).
    pub head: f64,
    /// All-reduces and the logits gather of a tensor-parallel group.
    pub collectives: f64,
    /// A mixture of experts' router: scores, softmax and top-k.
    pub router: f64,
    /// A mixture of experts' expert products (gate|up, silu, down) and their weighted sum.
    pub experts: f64,
    /// LoRA adapters' low-rank products.
    pub lora: f64,
}

impl OpTimes {
    /// Each op's name and seconds, in the forward's order.
    pub fn named(&self) -> [(&'static str, f64); 13] {
        [
            ("embed", self.embed),
            ("norms", self.norms),
            ("qkv", self.qkv),
            ("attention", self.attention),
            ("o", self.o),
            ("gate_up", self.gate_up),
            ("silu", self.silu),
            ("down", self.down),
            ("router", self.router),
            ("experts", self.experts),
            ("lora", self.lora),
            ("head", self.head),
            ("collectives", self.collectives),
        ]
    }
}

impl std::ops::AddAssign for OpTimes {
    fn add_assign(&mut self, o: Self) {
        self.embed += o.embed;
        self.norms += o.norms;
        self.qkv += o.qkv;
        self.attention += o.attention;
        self.o += o.o;
        self.gate_up += o.gate_up;
        self.silu += o.silu;
        self.down += o.down;
        self.head += o.head;
        self.collectives += o.collectives;
        self.router += o.router;
        self.experts += o.experts;
        self.lora += o.lora;
    }
}

#[cfg(test)]
mod tests {
    use super::Routing;

    /// The best experts after a softmax over all of them, best first, a tie to the lower index,
    /// renormalized only when asked; each row on its own.
    #[test]
    fn routing_takes_the_best_experts_of_each_row() {
        let scores = [0.0, 1.0, 3.0, 2.0, /* row 2 */ 5.0, 5.0, 0.0, 5.0];
        let r = Routing::from_scores(&scores, 4, 2, true);
        assert_eq!(r.expert, vec![2, 3, 0, 1]);
        let (a, b) = (r.weight[0], r.weight[1]);
        assert!(
            (a + b - 1.0).abs() < 1e-6 && (a / b - 1f32.exp()).abs() < 1e-5,
            "{a} {b}"
        );
        assert!((r.weight[2] - 0.5).abs() < 1e-6 && (r.weight[3] - 0.5).abs() < 1e-6);
        let raw = Routing::from_scores(&scores, 4, 2, false);
        assert_eq!(raw.expert, r.expert);
        let z: f32 = [0.0f32, 1.0, 3.0, 2.0]
            .iter()
            .map(|x| (x - 3.0).exp())
            .sum();
        assert!((raw.weight[0] - 1.0 / z).abs() < 1e-6, "{}", raw.weight[0]);
        // Row 1 alone routes as it does beside row 2.
        let alone = Routing::from_scores(&scores[4..], 4, 2, true);
        assert_eq!(alone.expert, r.expert[2..]);
        assert_eq!(alone.weight, r.weight[2..]);
    }

    /// The load counts each expert's rows, and per routing the experts that ran (once each,
    /// however many rows chose them): what a batched step reads.
    #[test]
    fn expert_load_counts_rows_and_the_experts_that_ran() {
        let load = super::ExpertLoad::new(4);
        // Rows choose {2, 3} and {0, 1}: four experts ran.
        let scores = [0.0, 1.0, 3.0, 2.0, /* row 2 */ 5.0, 5.0, 0.0, 5.0];
        load.add(&Routing::from_scores(&scores, 4, 2, true));
        // Both rows choose {2, 3}: two ran.
        load.add(&Routing::from_scores(
            &[0.0, 1.0, 3.0, 2.0, 0.0, 1.0, 3.0, 2.0],
            4,
            2,
            true,
        ));
        assert_eq!(load.snapshot(), vec![1, 1, 3, 3]);
        assert_eq!(load.runs(), (6, 2));
    }
}
