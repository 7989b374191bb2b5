//! The tensors a Llama model is made of, named once: their canonical (GGUF-style) names, the HF
//! names they are read from, and the shapes a [`ModelConfig`] implies. The loaders, the shape
//! check and every device's weight upload go through [`TensorName`], so no other code spells a
//! tensor's name.

use std::fmt;

use crate::ModelConfig;

/// One of a decoder layer's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerTensor {
    /// RMS norm before attention.
    AttnNorm,
    /// Query projection.
    AttnQ,
    /// Key projection.
    AttnK,
    /// Value projection.
    AttnV,
    /// Attention output projection.
    AttnOutput,
    /// RMS norm before the MLP.
    FfnNorm,
    /// MLP gate projection.
    FfnGate,
    /// MLP up projection.
    FfnUp,
    /// MLP down projection.
    FfnDown,
    /// Query projection bias (Qwen2).
    AttnQBias,
    /// Key projection bias (Qwen2).
    AttnKBias,
    /// Value projection bias (Qwen2).
    AttnVBias,
    /// RMS norm of each query head (Qwen3).
    AttnQNorm,
    /// RMS norm of each key head (Qwen3).
    AttnKNorm,
    /// The router of a mixture of experts: a score for each expert, `[experts, hidden]`.
    FfnGateInp,
    /// Every expert's gate projection, `[experts, expert_ff, hidden]` (llama.cpp's merged tensor).
    FfnGateExps,
    /// Every expert's up projection, `[experts, expert_ff, hidden]`.
    FfnUpExps,
    /// Every expert's down projection, `[experts, hidden, expert_ff]`.
    FfnDownExps,
}

impl LayerTensor {
    /// Every layer tensor of any family.
    pub const ALL: [Self; 18] = [
        Self::AttnNorm,
        Self::AttnQ,
        Self::AttnK,
        Self::AttnV,
        Self::AttnOutput,
        Self::FfnNorm,
        Self::FfnGate,
        Self::FfnUp,
        Self::FfnDown,
        Self::AttnQBias,
        Self::AttnKBias,
        Self::AttnVBias,
        Self::AttnQNorm,
        Self::AttnKNorm,
        Self::FfnGateInp,
        Self::FfnGateExps,
        Self::FfnUpExps,
        Self::FfnDownExps,
    ];

    /// The layer tensors a model of config `c` has.
    pub fn of(c: &ModelConfig) -> Vec<Self> {
        let family = c.family;
        let mut all = Self::ALL[..6].to_vec();
        match c.moe {
            None => all.extend([Self::FfnGate, Self::FfnUp, Self::FfnDown]),
            Some(_) => all.extend([
                Self::FfnGateInp,
                Self::FfnGateExps,
                Self::FfnUpExps,
                Self::FfnDownExps,
            ]),
        }
        if family.qkv_bias() {
            all.extend([Self::AttnQBias, Self::AttnKBias, Self::AttnVBias]);
        }
        if family.qk_norm() {
            all.extend([Self::AttnQNorm, Self::AttnKNorm]);
        }
        all
    }

    /// The part of the canonical name after `blk.N.`.
    pub fn gguf(self) -> &'static str {
        match self {
            Self::AttnNorm => "attn_norm.weight",
            Self::AttnQ => "attn_q.weight",
            Self::AttnK => "attn_k.weight",
            Self::AttnV => "attn_v.weight",
            Self::AttnOutput => "attn_output.weight",
            Self::FfnNorm => "ffn_norm.weight",
            Self::FfnGate => "ffn_gate.weight",
            Self::FfnUp => "ffn_up.weight",
            Self::FfnDown => "ffn_down.weight",
            Self::AttnQBias => "attn_q.bias",
            Self::AttnKBias => "attn_k.bias",
            Self::AttnVBias => "attn_v.bias",
            Self::AttnQNorm => "attn_q_norm.weight",
            Self::AttnKNorm => "attn_k_norm.weight",
            Self::FfnGateInp => "ffn_gate_inp.weight",
            Self::FfnGateExps => "ffn_gate_exps.weight",
            Self::FfnUpExps => "ffn_up_exps.weight",
            Self::FfnDownExps => "ffn_down_exps.weight",
        }
    }

    /// The part of the HF name after `model.layers.N.`.
    pub fn hf(self) -> &'static str {
        match self {
            Self::AttnNorm => "input_layernorm.weight",
            Self::AttnQ => "self_attn.q_proj.weight",
            Self::AttnK => "self_attn.k_proj.weight",
            Self::AttnV => "self_attn.v_proj.weight",
            Self::AttnOutput => "self_attn.o_proj.weight",
            Self::FfnNorm => "post_attention_layernorm.weight",
            Self::FfnGate => "mlp.gate_proj.weight",
            Self::FfnUp => "mlp.up_proj.weight",
            Self::FfnDown => "mlp.down_proj.weight",
            Self::AttnQBias => "self_attn.q_proj.bias",
            Self::AttnKBias => "self_attn.k_proj.bias",
            Self::AttnVBias => "self_attn.v_proj.bias",
            Self::AttnQNorm => "self_attn.q_norm.weight",
            Self::AttnKNorm => "self_attn.k_norm.weight",
            // Qwen3-MoE's; Mixtral's is `block_sparse_moe.gate.weight` (see `from_hf`).
            Self::FfnGateInp => "mlp.gate.weight",
            // transformers' fused tensors of every expert (its own checkpoints keep one tensor
            // per expert, see [`TensorName::from_hf_expert`]).
            Self::FfnGateExps => "mlp.experts.gate_proj",
            Self::FfnUpExps => "mlp.experts.up_proj",
            Self::FfnDownExps => "mlp.experts.down_proj",
        }
    }
}

/// Where an HF tensor goes in a merged expert tensor ([`TensorName::from_hf_expert`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPart {
    /// Expert `.0`'s matrix, the merged tensor's slice `.0`.
    One(usize),
    /// transformers' fused gate|up of every expert (`[experts, 2·expert_ff, hidden]`): its
    /// first half of each expert's rows goes to the gate tensor, the second to the up tensor.
    GateUp,
}

/// A tensor of a Llama model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorName {
    /// The token embedding (also the output head when the two are tied).
    Embedding,
    /// The final RMS norm.
    OutputNorm,
    /// The output head, when not tied to the embedding.
    Output,
    /// Rotary frequency divisors some GGUF files carry.
    RopeFreqs,
    /// Tensor `.1` of layer `.0`.
    Layer(usize, LayerTensor),
}

impl TensorName {
    /// Shorthand for [`TensorName::Layer`].
    pub fn layer(index: usize, t: LayerTensor) -> Self {
        Self::Layer(index, t)
    }

    /// The canonical name tensors are stored under in a [`crate::LoadedModel`].
    pub fn canonical(self) -> String {
        self.to_string()
    }

    /// The tensor an HF safetensors name holds (None for names the engine does not use).
    pub fn from_hf(hf: &str) -> Option<Self> {
        let n = hf.strip_prefix("model.").unwrap_or(hf);
        match n {
            "embed_tokens.weight" => return Some(Self::Embedding),
            "norm.weight" => return Some(Self::OutputNorm),
            "lm_head.weight" => return Some(Self::Output),
            _ => {}
        }
        let (idx, field) = n.strip_prefix("layers.")?.split_once('.')?;
        let idx: usize = idx.parse().ok()?;
        if field == "block_sparse_moe.gate.weight" {
            return Some(Self::Layer(idx, LayerTensor::FfnGateInp));
        }
        let t = LayerTensor::ALL.into_iter().find(|t| t.hf() == field)?;
        Some(Self::Layer(idx, t))
    }

    /// The merged expert tensor an HF name is part of: one expert's gate, up or down projection
    /// (Qwen3-MoE `mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral
    /// `block_sparse_moe.experts.E.{w1,w3,w2}.weight`), or transformers' fused gate|up of every
    /// expert (`mlp.experts.gate_up_proj`, returned under the gate tensor's name).
    pub fn from_hf_expert(hf: &str) -> Option<(Self, ExpertPart)> {
        let n = hf.strip_prefix("model.").unwrap_or(hf);
        let (idx, field) = n.strip_prefix("layers.")?.split_once('.')?;
        let idx: usize = idx.parse().ok()?;
        if field == "mlp.experts.gate_up_proj" {
            return Some((
                Self::Layer(idx, LayerTensor::FfnGateExps),
                ExpertPart::GateUp,
            ));
        }
        let rest = field
            .strip_prefix("mlp.experts.")
            .or_else(|| field.strip_prefix("block_sparse_moe.experts."))?;
        let (e, proj) = rest.split_once('.')?;
        let t = match proj {
            "gate_proj.weight" | "w1.weight" => LayerTensor::FfnGateExps,
            "up_proj.weight" | "w3.weight" => LayerTensor::FfnUpExps,
            "down_proj.weight" | "w2.weight" => LayerTensor::FfnDownExps,
            _ => return None,
        };
        Some((Self::Layer(idx, t), ExpertPart::One(e.parse().ok()?)))
    }

    /// The tensor a canonical name holds (None for names the engine does not use).
    pub fn from_canonical(name: &str) -> Option<Self> {
        match name {
            "token_embd.weight" => return Some(Self::Embedding),
            "output_norm.weight" => return Some(Self::OutputNorm),
            "output.weight" => return Some(Self::Output),
            "rope_freqs.weight" => return Some(Self::RopeFreqs),
            _ => {}
        }
        let (idx, field) = name.strip_prefix("blk.")?.split_once('.')?;
        let idx: usize = idx.parse().ok()?;
        let t = LayerTensor::ALL.into_iter().find(|t| t.gguf() == field)?;
        Some(Self::Layer(idx, t))
    }

    /// Row-major shape `config` implies (`[rows, cols]` for a matrix, `[len]` for a vector);
    /// None for [`TensorName::RopeFreqs`], whose length the file decides.
    pub fn shape(self, c: &ModelConfig) -> Option<Vec<usize>> {
        let (h, ff) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        Some(match self {
            Self::Embedding | Self::Output => vec![c.vocab_size, h],
            Self::OutputNorm => vec![h],
            Self::RopeFreqs => return None,
            Self::Layer(_, t) => match t {
                LayerTensor::AttnNorm | LayerTensor::FfnNorm => vec![h],
                LayerTensor::AttnQ => vec![q, h],
                LayerTensor::AttnK | LayerTensor::AttnV => vec![kv, h],
                LayerTensor::AttnOutput => vec![h, q],
                LayerTensor::FfnGate | LayerTensor::FfnUp => vec![ff, h],
                LayerTensor::FfnDown => vec![h, ff],
                LayerTensor::AttnQBias => vec![q],
                LayerTensor::AttnKBias | LayerTensor::AttnVBias => vec![kv],
                LayerTensor::AttnQNorm | LayerTensor::AttnKNorm => vec![c.head_dim],
                LayerTensor::FfnGateInp => vec![c.moe.as_ref()?.experts, h],
                LayerTensor::FfnGateExps | LayerTensor::FfnUpExps => {
                    let m = c.moe.as_ref()?;
                    vec![m.experts, m.expert_ff, h]
                }
                LayerTensor::FfnDownExps => {
                    let m = c.moe.as_ref()?;
                    vec![m.experts, h, m.expert_ff]
                }
            },
        })
    }

    /// Every tensor the forward pass of a `config` model reads (the head only when not tied).
    pub fn required(c: &ModelConfig) -> Vec<Self> {
        let mut all = vec![Self::Embedding, Self::OutputNorm];
        if !c.tie_word_embeddings {
            all.push(Self::Output);
        }
        let layer = LayerTensor::of(c);
        for i in 0..c.num_layers {
            all.extend(layer.iter().map(|&t| Self::Layer(i, t)));
        }
        all
    }
}

impl fmt::Display for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Embedding => f.write_str("token_embd.weight"),
            Self::OutputNorm => f.write_str("output_norm.weight"),
            Self::Output => f.write_str("output.weight"),
            Self::RopeFreqs => f.write_str("rope_freqs.weight"),
            Self::Layer(i, t) => write!(f, "blk.{i}.{}", t.gguf()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Family;

    #[test]
    fn hf_names_map_to_canonical_ones() {
        let name = |hf: &str| TensorName::from_hf(hf).map(TensorName::canonical);
        assert_eq!(
            name("model.layers.12.mlp.down_proj.weight").as_deref(),
            Some("blk.12.ffn_down.weight")
        );
        assert_eq!(
            name("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(name("lm_head.weight").as_deref(), Some("output.weight"));
        assert_eq!(
            name("model.norm.weight").as_deref(),
            Some("output_norm.weight")
        );
        assert_eq!(name("model.layers.0.self_attn.rotary_emb.inv_freq"), None);
        assert_eq!(name("model.layers.x.mlp.up_proj.weight"), None);
    }

    #[test]
    fn canonical_names_read_back() {
        let c = ModelConfig {
            hidden_size: 8,
            intermediate_size: 16,
            num_layers: 2,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            vocab_size: 10,
            max_position_embeddings: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: None,
            tie_word_embeddings: false,
            family: Family::Llama,
            sliding_window: None,
            moe: None,
        };
        let all = TensorName::required(&c);
        assert_eq!(all.len(), 3 + 2 * 9);
        for n in all.iter().copied().chain([TensorName::RopeFreqs]) {
            assert_eq!(TensorName::from_canonical(&n.canonical()), Some(n), "{n}");
        }
        // Qwen2's biases, Qwen3's head norms: read back under both names, with their shapes.
        for (family, extra) in [(Family::Qwen2, 3), (Family::Qwen3, 2)] {
            let c = ModelConfig {
                family,
                ..c.clone()
            };
            let all = TensorName::required(&c);
            assert_eq!(all.len(), 3 + 2 * (9 + extra));
            for n in all {
                assert_eq!(TensorName::from_canonical(&n.canonical()), Some(n), "{n}");
                if let TensorName::Layer(i, t) = n {
                    let hf = format!("model.layers.{i}.{}", t.hf());
                    assert_eq!(TensorName::from_hf(&hf), Some(n), "{hf}");
                }
            }
        }
        assert_eq!(
            TensorName::layer(0, LayerTensor::AttnKBias).shape(&c),
            Some(vec![4])
        );
        assert_eq!(
            TensorName::layer(1, LayerTensor::AttnQNorm).canonical(),
            "blk.1.attn_q_norm.weight"
        );
        assert_eq!(
            TensorName::layer(1, LayerTensor::AttnK).canonical(),
            "blk.1.attn_k.weight"
        );
        assert_eq!(
            TensorName::layer(0, LayerTensor::AttnOutput).shape(&c),
            Some(vec![8, 8])
        );
        assert_eq!(
            TensorName::layer(0, LayerTensor::AttnV).shape(&c),
            Some(vec![4, 8])
        );
        assert_eq!(
            TensorName::layer(0, LayerTensor::FfnDown).shape(&c),
            Some(vec![8, 16])
        );
        assert_eq!(TensorName::RopeFreqs.shape(&c), None);
        assert_eq!(TensorName::from_canonical("blk.0.attn_o.bias"), None);
    }
}
