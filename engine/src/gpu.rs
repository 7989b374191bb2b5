//! The Llama forward on a CUDA GPU: the same packed step as [`crate::LlamaModel::forward`] (prefill
//! chunks and decode tokens in one batch over the paged cache), in bf16 with f32 accumulation, the
//! KV pool in device memory. Block ids and tables are the block manager's, so the scheduler is the
//! same on either device.

use std::collections::BTreeMap;

use tandem_kernels::cuda::runtime::{CudaOps, CudaSlice};
use tandem_kernels::ops::RopeTable;
use tandem_model::{LlamaConfig, TensorData};

use crate::model::{PackedStep, SeqBatch};
use crate::EngineError;

struct GpuLayer {
    attn_norm: CudaSlice<u16>,
    /// q, k and v stacked by rows.
    qkv: CudaSlice<u16>,
    o: CudaSlice<u16>,
    ffn_norm: CudaSlice<u16>,
    /// gate and up stacked by rows.
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

pub struct GpuLlama {
    pub config: LlamaConfig,
    pub ops: CudaOps,
    layers: Vec<GpuLayer>,
    embed: CudaSlice<u16>,
    /// None when tied to the embedding.
    head: Option<CudaSlice<u16>>,
    norm: CudaSlice<u16>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    max_pos: usize,
    /// Per layer: [blocks][kv heads][block_size][head_dim].
    k_cache: Vec<CudaSlice<u16>>,
    v_cache: Vec<CudaSlice<u16>>,
    pub block_size: usize,
    pub num_blocks: usize,
}

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}

impl GpuLlama {
    /// Uploads a model's tensors (decoded to f32, rounded to bf16) to device `ordinal` and makes a
    /// KV pool of `num_blocks` blocks of `block_size` tokens.
    pub fn from_tensors(
        ordinal: usize,
        config: &LlamaConfig,
        tensors: &BTreeMap<String, TensorData>,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let ops = CudaOps::new(ordinal)?;
        let get = |name: &str| -> Result<Vec<f32>, EngineError> {
            let t = tensors
                .get(name)
                .ok_or_else(|| tandem_model::ModelError::MissingTensor(name.to_string()))?;
            Ok(t.to_f32()?)
        };
        let up = |names: &[String]| -> Result<CudaSlice<u16>, EngineError> {
            let mut all = Vec::new();
            for n in names {
                all.extend(bf16_bits(&get(n)?));
            }
            Ok(ops.upload(&all)?)
        };
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(GpuLayer {
                attn_norm: up(&[p("attn_norm")])?,
                qkv: up(&[p("attn_q"), p("attn_k"), p("attn_v")])?,
                o: up(&[p("attn_output")])?,
                ffn_norm: up(&[p("ffn_norm")])?,
                gate_up: up(&[p("ffn_gate"), p("ffn_up")])?,
                down: up(&[p("ffn_down")])?,
            });
        }
        let embed = up(&["token_embd.weight".to_string()])?;
        let head = if config.tie_word_embeddings {
            None
        } else {
            Some(up(&["output.weight".to_string()])?)
        };
        let norm = up(&["output_norm.weight".to_string()])?;
        Self::assemble(
            ops, config, layers, embed, head, norm, block_size, num_blocks,
        )
    }

    /// A model of `config`'s shape with random weights made on the device (benchmarks: no
    /// download, no host copy of billions of values).
    pub fn random(
        ordinal: usize,
        config: &LlamaConfig,
        seed: u64,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let ops = CudaOps::new(ordinal)?;
        let c = config;
        let (h, hd, ff) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * hd;
        let mut n = 0u64;
        let mut rnd = |len: usize, scale: f32| -> Result<CudaSlice<u16>, EngineError> {
            let mut x = ops.alloc_bf16(len)?;
            n += 1;
            ops.fill_random(&mut x, seed.wrapping_mul(1_000_003).wrapping_add(n), scale)?;
            Ok(x)
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            layers.push(GpuLayer {
                attn_norm: rnd(h, 1.0)?,
                qkv: rnd(qkv_rows * h, 0.02)?,
                o: rnd(h * c.num_heads * hd, 0.02)?,
                ffn_norm: rnd(h, 1.0)?,
                gate_up: rnd(2 * ff * h, 0.02)?,
                down: rnd(h * ff, 0.02)?,
            });
        }
        let embed = rnd(c.vocab_size * h, 1.0)?;
        let head = if c.tie_word_embeddings {
            None
        } else {
            Some(rnd(c.vocab_size * h, 0.02)?)
        };
        let norm = rnd(h, 1.0)?;
        Self::assemble(
            ops, config, layers, embed, head, norm, block_size, num_blocks,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        ops: CudaOps,
        config: &LlamaConfig,
        layers: Vec<GpuLayer>,
        embed: CudaSlice<u16>,
        head: Option<CudaSlice<u16>>,
        norm: CudaSlice<u16>,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let c = config.clone();
        let rope = RopeTable::new(
            &c.rope_inv_freq(),
            c.rope_position_scale(),
            c.max_position_embeddings,
        );
        let (cos, sin) = rope.tables();
        let per_layer = num_blocks * c.num_kv_heads * block_size * c.head_dim;
        let mut k_cache = Vec::with_capacity(c.num_layers);
        let mut v_cache = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            k_cache.push(ops.alloc_bf16(per_layer)?);
            v_cache.push(ops.alloc_bf16(per_layer)?);
        }
        Ok(Self {
            cos: ops.upload(cos)?,
            sin: ops.upload(sin)?,
            max_pos: rope.max_pos(),
            ops,
            layers,
            embed,
            head,
            norm,
            k_cache,
            v_cache,
            block_size,
            num_blocks,
            config: c,
        })
    }

    /// Bytes of weights one decode step reads (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.len() + l.o.len() + l.gate_up.len() + l.down.len())
            .sum();
        2 * (l + self.head.as_ref().unwrap_or(&self.embed).len())
    }

    /// Bytes of K and V per token of context, all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        Self::kv_bytes_per_block(&self.config, 1)
    }

    /// Bytes of one block of `block_size` tokens in the bf16 pool, K and V of every layer.
    pub fn kv_bytes_per_block(c: &LlamaConfig, block_size: usize) -> usize {
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
    /// `want_logits`, in order, as [`crate::LlamaModel::forward`] does.
    pub fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        match self.forward_device(seqs)? {
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
        let Some((logits, n)) = self.forward_device(seqs)? else {
            return Ok(Vec::new());
        };
        let mut ids = self.ops.upload(&vec![-1i32; n])?;
        let mut logprobs = self.ops.alloc_f32(n)?;
        self.ops
            .argmax(&logits, n, self.config.vocab_size, &mut ids, &mut logprobs)?;
        let ids = self.ops.download(&ids)?;
        let logprobs = self.ops.download(&logprobs)?;
        Ok(ids
            .into_iter()
            .zip(logprobs)
            .map(|(i, lp)| (i as u32, lp))
            .collect())
    }

    /// The step's logits left on the device, with their row count; None when no sequence wants
    /// them (after the step has finished).
    fn forward_device(
        &mut self,
        seqs: &[SeqBatch<'_>],
    ) -> Result<Option<(CudaSlice<f32>, usize)>, EngineError> {
        let c = self.config.clone();
        let (h, hd, ff) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nq, nkv) = (c.num_heads, c.num_kv_heads);
        let (qd, qkv_w) = (nq * hd, (nq + 2 * nkv) * hd);
        let bs = self.block_size;
        let step = PackedStep::new(seqs, c.vocab_size, self.max_pos, bs, self.num_blocks)?;
        let t = step.tokens.len();
        if t == 0 {
            return Ok(None);
        }
        let ids: Vec<i32> = step.tokens.iter().map(|&x| x as i32).collect();
        let positions: Vec<i32> = step.positions.iter().map(|&p| p as i32).collect();
        let slots: Vec<i64> = step.slots.iter().map(|&s| s as i64).collect();
        let logit_rows: Vec<i32> = step.logit_rows.iter().map(|&r| r as i32).collect();
        let tables: Vec<&[u32]> = step.seqs.iter().map(|s| s.block_table).collect();
        let q_len: Vec<usize> = step.seqs.iter().map(|s| s.q_len).collect();
        let context: Vec<usize> = step.seqs.iter().map(|s| s.context).collect();
        let o = &self.ops;
        let ids_d = o.upload(&ids)?;
        let pos_d = o.upload(&positions)?;
        let slots_d = o.upload(&slots)?;
        let mut batch = o.attn_batch(&tables, &q_len, &context, (nq, hd))?;
        let mut x = o.alloc_bf16(t * h)?;
        let mut hbuf = o.alloc_bf16(t * h)?;
        let mut qkv = o.alloc_bf16(t * qkv_w)?;
        let mut att = o.alloc_bf16(t * qd)?;
        let mut proj = o.alloc_bf16(t * h)?;
        let mut gu = o.alloc_bf16(t * 2 * ff)?;
        let mut act = o.alloc_bf16(t * ff)?;
        let eps = c.rms_norm_eps;
        o.embedding(&ids_d, &self.embed, &mut x, h)?;
        for (li, l) in self.layers.iter().enumerate() {
            if li == 0 {
                o.rms_norm(&x, &l.attn_norm, &mut hbuf, t, eps)?;
            } else {
                // The previous layer's MLP output joins the residual here.
                o.add_rms_norm(&mut x, &proj, &l.attn_norm, &mut hbuf, t, eps)?;
            }
            o.gemm(&hbuf, &l.qkv, &mut qkv, (t, qkv_w, h))?;
            o.qkv_rope(&mut qkv, &pos_d, &self.cos, &self.sin, t, (nq, nkv, hd))?;
            o.write_kv(
                &qkv,
                &slots_d,
                &mut self.k_cache[li],
                &mut self.v_cache[li],
                (nq, nkv, hd),
                bs,
            )?;
            o.attention(
                &mut batch,
                &qkv,
                qkv_w,
                &self.k_cache[li],
                &self.v_cache[li],
                &mut att,
                (nq, nkv, hd),
                bs,
            )?;
            o.gemm(&att, &l.o, &mut proj, (t, h, qd))?;
            o.add_rms_norm(&mut x, &proj, &l.ffn_norm, &mut hbuf, t, eps)?;
            o.gemm(&hbuf, &l.gate_up, &mut gu, (t, 2 * ff, h))?;
            o.silu_mul(&gu, &mut act, t, ff)?;
            o.gemm(&act, &l.down, &mut proj, (t, h, ff))?;
        }
        let n = logit_rows.len();
        if n == 0 {
            o.synchronize()?;
            return Ok(None);
        }
        o.add_rms_norm(&mut x, &proj, &self.norm, &mut hbuf, t, eps)?;
        let rows_d = o.upload(&logit_rows)?;
        let mut last = o.alloc_bf16(n * h)?;
        o.gather_rows(&rows_d, &hbuf, &mut last, h)?;
        let head = self.head.as_ref().unwrap_or(&self.embed);
        let mut logits = o.alloc_f32(n * c.vocab_size)?;
        o.gemm(&last, head, &mut logits, (n, c.vocab_size, h))?;
        Ok(Some((logits, n)))
    }
}
