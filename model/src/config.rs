//! Llama-family model configuration (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3), read from GGUF
//! metadata or an HF `config.json`, and the rotary-embedding frequencies it implies.

use serde::Deserialize;

use crate::gguf::GgufFile;
use crate::ModelError;

/// How rotary frequencies are rescaled for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (HF `rope_type: linear`).
    Linear {
        /// What positions are divided by.
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling (HF `rope_type: llama3`).
    Llama3 {
        /// Divisor of the low frequencies (long wavelengths).
        factor: f32,
        /// Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
        /// divided by `factor`.
        low_freq_factor: f32,
        /// Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are
        /// kept; those in between are interpolated.
        high_freq_factor: f32,
        /// The context length (tokens) the model was trained on before scaling.
        original_max_position_embeddings: usize,
    },
    /// Per-frequency divisors given as a tensor (GGUF `rope_freqs.weight`).
    Factors(Vec<f32>),
}

/// The architectures Tandem runs, as configs and GGUF files name them.
pub const SUPPORTED: &str = "llama (Llama 2/3, SmolLM; with experts, Mixtral's GGUF), mistral, \
mixtral, qwen2 (Qwen2, Qwen2.5), qwen3, qwen3_moe (GGUF: qwen3moe)";

/// A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router scores every expert for each token,
/// the `active` best (after a softmax over all of them) run, and the token's MLP output is their
/// outputs weighted by their scores (renormalized to sum to one where `norm_topk`). Every expert
/// is a SwiGLU MLP `expert_ff` wide.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts in each layer.
    pub experts: usize,
    /// Experts each token runs.
    pub active: usize,
    /// Width of each expert's gate and up projections.
    pub expert_ff: usize,
    /// Whether the chosen experts' scores are divided by their sum.
    pub norm_topk: bool,
}

/// Which family a model is: what its layers have beyond Llama's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3, SmolLM: the plain layer.
    #[default]
    Llama,
    /// Mistral: a Llama layer, attention limited to a sliding window when the config sets one.
    Mistral,
    /// Qwen2 and Qwen2.5: biases on the q, k and v projections.
    Qwen2,
    /// Qwen3: an RMS norm on each query and key head before the rotary embedding.
    Qwen3,
}

impl Family {
    /// The family an HF `model_type` or a GGUF `general.architecture` names.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "llama" => Ok(Self::Llama),
            "mistral" => Ok(Self::Mistral),
            "qwen2" => Ok(Self::Qwen2),
            // The experts are the config's `moe`; the attention is the family's.
            "qwen3" | "qwen3_moe" | "qwen3moe" => Ok(Self::Qwen3),
            "mixtral" => Ok(Self::Mistral),
            other => Err(ModelError::Unsupported(format!(
                "architecture {other:?}; Tandem runs {SUPPORTED}"
            ))),
        }
    }

    /// Whether the q, k and v projections carry biases.
    pub fn qkv_bias(self) -> bool {
        self == Self::Qwen2
    }

    /// Whether each query and key head is RMS-normed before the rotary embedding.
    pub fn qk_norm(self) -> bool {
        self == Self::Qwen3
    }

    /// What a sliding window in the config becomes: `(window every layer slides, cap on the
    /// context)`. Mistral slides every layer. Qwen's optional window covers only its upper layers,
    /// which is not built: the context stops at the window instead, within which full attention
    /// and the window agree.
    fn window(self, window: Option<usize>) -> (Option<usize>, Option<usize>) {
        match self {
            Self::Mistral | Self::Llama => (window, None),
            Self::Qwen2 | Self::Qwen3 => (None, window),
        }
    }
}

/// The dimensions and settings of a Llama-family model: what its weights' shapes and the forward
/// pass follow from.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Width of the residual stream (elements per token).
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads (fewer than `num_heads` with grouped-query attention).
    pub num_kv_heads: usize,
    /// Elements per attention head.
    pub head_dim: usize,
    /// Number of token ids the embedding and the output head cover.
    pub vocab_size: usize,
    /// The context the model supports.
    pub max_position_embeddings: usize,
    /// Epsilon added to the mean square in every RMS norm.
    pub rms_norm_eps: f32,
    /// Base of the rotary embedding's frequencies.
    pub rope_theta: f32,
    /// How rotary frequencies are rescaled for long contexts, if at all.
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the output head reuses the token embedding (no `output.weight`).
    pub tie_word_embeddings: bool,
    /// The family, and with it the layer's extra parts (biases, head norms).
    pub family: Family,
    /// Mistral's sliding window: every layer's query at position `p` attends to the keys at
    /// `p + 1 - window ..= p` only. `None`: to every earlier key.
    pub sliding_window: Option<usize>,
    /// Every layer's MLP a mixture of experts; None: a dense MLP `intermediate_size` wide.
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// Checks that the dimensions describe a model the forward pass can run: none zero, query
    /// heads a multiple of KV heads, an even head dimension.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || self.num_layers == 0
            || self.hidden_size == 0
            || self.sliding_window == Some(0)
        {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads is not a multiple of {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if let Some(m) = &self.moe {
            if m.active == 0 || m.active > m.experts || m.expert_ff == 0 {
                return bad(format!(
                    "{} active of {} experts, {} wide",
                    m.active, m.experts, m.expert_ff
                ));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for rotary embeddings",
                self.head_dim
            ));
        }
        Ok(())
    }

    /// Inverse rotary frequencies, one per pair of dimensions, computed in f32 as HF transformers
    /// does so that long positions round the same way.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim;
        let base: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0f32 / self.rope_theta.powf((2 * i) as f32 / dim as f32))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { .. }) => base,
            Some(RopeScaling::Factors(f)) => base.iter().zip(f).map(|(b, f)| b / f).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = *original_max_position_embeddings as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Positions are divided by this before taking angles (linear scaling), else 1.
    pub fn rope_position_scale(&self) -> f32 {
        match self.rope_scaling {
            Some(RopeScaling::Linear { factor }) => 1.0 / factor,
            _ => 1.0,
        }
    }

    /// Reads the `llama.*` keys of a GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let arch = g
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .unwrap_or("llama")
            .to_string();
        let family = Family::from_name(&arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let req = |k: &str| -> Result<usize, ModelError> {
            g.get(&key(k))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::Config(format!("GGUF metadata {} is missing", key(k))))
        };
        let hidden_size = req("embedding_length")?;
        let num_heads = req("attention.head_count")?;
        let num_kv_heads = req("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = req("attention.key_length")
            .or_else(|_| req("rope.dimension_count"))
            .unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match req("vocab_size") {
            Ok(v) => v,
            Err(_) => g
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .ok_or_else(|| {
                    ModelError::Config(
                        "GGUF has neither llama.vocab_size nor tokenizer.ggml.tokens".into(),
                    )
                })?,
        };
        let f = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64());
        let (sliding_window, capped_window) = family.window(req("attention.sliding_window").ok());
        let rope_scaling = match g.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            Some("linear") => Some(RopeScaling::Linear {
                factor: f("rope.scaling.factor").unwrap_or(1.0) as f32,
            }),
            Some("none") | None => None,
            Some(other) => return Err(ModelError::Unsupported(format!("rope scaling {other:?}"))),
        };
        let ff = req("feed_forward_length");
        let moe = match req("expert_count") {
            Ok(experts) if experts > 0 => Some(MoeConfig {
                experts,
                active: req("expert_used_count")?,
                expert_ff: req("expert_feed_forward_length")
                    .or_else(|_| req("feed_forward_length"))?,
                // llama.cpp renormalizes for both qwen3moe and llama (Mixtral).
                norm_topk: g
                    .get(&key("expert_weights_norm"))
                    .and_then(|v| v.as_bool())
                    .unwrap_or(true),
            }),
            _ => None,
        };
        if g.get(&key("expert_shared_count"))
            .and_then(|v| v.as_u64())
            .unwrap_or(0)
            > 0
        {
            return Err(ModelError::Unsupported("shared experts".into()));
        }
        let cfg = Self {
            hidden_size,
            // A mixture of experts may have no dense width.
            intermediate_size: match &moe {
                Some(m) => ff.unwrap_or(m.expert_ff),
                None => ff?,
            },
            num_layers: req("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings: req("context_length")
                .unwrap_or(4096)
                .min(capped_window.unwrap_or(usize::MAX)),
            rms_norm_eps: f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f32,
            rope_theta: f("rope.freq_base").unwrap_or(10000.0) as f32,
            rope_scaling,
            // A GGUF without output.weight ties the head to the embedding; the loader decides.
            tie_word_embeddings: g.tensor(&crate::TensorName::Output.canonical()).is_none(),
            family,
            sliding_window,
            moe,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses an HF `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let c: HfConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        let model_type = c.model_type.as_deref().unwrap_or("llama");
        let family = Family::from_name(model_type)?;
        let moe = match model_type {
            "qwen3_moe" => {
                if c.decoder_sparse_step.unwrap_or(1) != 1
                    || c.mlp_only_layers.as_ref().is_some_and(|l| !l.is_empty())
                {
                    return Err(ModelError::Unsupported(
                        "dense MLP layers among the experts (mlp_only_layers, decoder_sparse_step)"
                            .into(),
                    ));
                }
                Some(MoeConfig {
                    // Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts.
                    experts: c.num_experts.or(c.num_local_experts).unwrap_or(0),
                    active: c.num_experts_per_tok.unwrap_or(0),
                    expert_ff: c.moe_intermediate_size.unwrap_or(0),
                    norm_topk: c.norm_topk_prob.unwrap_or(false),
                })
            }
            "mixtral" => Some(MoeConfig {
                experts: c.num_local_experts.or(c.num_experts).unwrap_or(0),
                active: c.num_experts_per_tok.unwrap_or(0),
                expert_ff: c.intermediate_size,
                norm_topk: true,
            }),
            _ => None,
        };
        if c.attention_bias == Some(true) && family != Family::Qwen2 {
            return Err(ModelError::Unsupported(
                "attention_bias (biases on the attention projections) outside Qwen2".into(),
            ));
        }
        if c.mlp_bias == Some(true) {
            return Err(ModelError::Unsupported(
                "mlp_bias (biases on the MLP projections)".into(),
            ));
        }
        let window = match family {
            Family::Qwen2 | Family::Qwen3 if c.use_sliding_window != Some(true) => None,
            _ => c.sliding_window,
        };
        let (sliding_window, capped_window) = family.window(window);

        let num_kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        let head_dim = c
            .head_dim
            .unwrap_or(c.hidden_size / c.num_attention_heads.max(1));
        let scaling = c.rope_scaling.as_ref().or(c.rope_parameters.as_ref());
        let rope_theta = c
            .rope_theta
            .or_else(|| {
                scaling
                    .and_then(|s| s.get("rope_theta"))
                    .and_then(|v| v.as_f64())
            })
            .unwrap_or(10000.0) as f32;
        let rope_scaling = match scaling {
            None => None,
            Some(s) => {
                let ty = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("default");
                let num = |k: &str, d: f64| s.get(k).and_then(|v| v.as_f64()).unwrap_or(d) as f32;
                match ty {
                    "default" => None,
                    "linear" => Some(RopeScaling::Linear {
                        factor: num("factor", 1.0),
                    }),
                    "llama3" => Some(RopeScaling::Llama3 {
                        factor: num("factor", 8.0),
                        low_freq_factor: num("low_freq_factor", 1.0),
                        high_freq_factor: num("high_freq_factor", 4.0),
                        original_max_position_embeddings: num(
                            "original_max_position_embeddings",
                            8192.0,
                        ) as usize,
                    }),
                    other => {
                        return Err(ModelError::Unsupported(format!(
                            "rope scaling type {other:?}"
                        )))
                    }
                }
            }
        };
        let max_pos = c
            .max_position_embeddings
            .unwrap_or(4096)
            .min(capped_window.unwrap_or(usize::MAX));
        let cfg = Self {
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: c.vocab_size,
            max_position_embeddings: max_pos,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            family,
            sliding_window,
            moe,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Map<String, serde_json::Value>>,
    rope_parameters: Option<serde_json::Map<String, serde_json::Value>>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_config_smollm2_like() {
        let c = ModelConfig::from_hf_json(
            r#"{"model_type":"llama","hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,
            "num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,"rms_norm_eps":1e-5,
            "rope_theta":100000.0,"tie_word_embeddings":true,"max_position_embeddings":8192}"#,
        )
        .unwrap();
        assert_eq!(
            (c.head_dim, c.num_kv_heads, c.tie_word_embeddings),
            (64, 3, true)
        );
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 100000f32.powf(-2.0 / 64.0)).abs() < 1e-9);
    }

    /// Mistral slides every layer over the whole context; Qwen's window (its upper layers only)
    /// is served as a context that stops at the window, and only when the config turns it on.
    #[test]
    fn sliding_windows_slide_or_cap_by_family() {
        let cfg = |ty: &str, extra: &str| {
            ModelConfig::from_hf_json(&format!(
                r#"{{"model_type":"{ty}","hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
                "num_attention_heads":2,"vocab_size":10,"max_position_embeddings":64,
                "sliding_window":16{extra}}}"#
            ))
            .unwrap()
        };
        let m = cfg("mistral", "");
        assert_eq!(
            (m.sliding_window, m.max_position_embeddings),
            (Some(16), 64)
        );
        let q = cfg("qwen2", "");
        assert_eq!((q.sliding_window, q.max_position_embeddings), (None, 64));
        let q = cfg("qwen2", r#","use_sliding_window":true"#);
        assert_eq!((q.sliding_window, q.max_position_embeddings), (None, 16));
        assert!(ModelConfig::from_hf_json(
            r#"{"model_type":"mistral","hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":2,"vocab_size":10,"sliding_window":0}"#
        )
        .is_err());
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let c = ModelConfig::from_hf_json(
            r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,
            "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"rope_theta":500000.0,
            "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192,"rope_type":"llama3"}}"#,
        )
        .unwrap();
        let f = c.rope_inv_freq();
        let base = ModelConfig {
            rope_scaling: None,
            ..c.clone()
        }
        .rope_inv_freq();
        assert_eq!(f[0], base[0]);
        assert!((f[63] - base[63] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn rejects_bad_configs() {
        assert!(ModelConfig::from_hf_json("{}").is_err());
        assert!(ModelConfig::from_hf_json(
            r#"{"model_type":"gpt2","hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"vocab_size":10}"#
        )
        .is_err());
        assert!(ModelConfig::from_hf_json(
            r#"{"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":2,"vocab_size":10}"#
        )
        .is_err());
    }
}
