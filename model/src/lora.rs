//! LoRA adapters in PEFT's format: a directory with `adapter_config.json` and
//! `adapter_model.safetensors`, read into f32 low-rank pairs checked against the base model.
//!
//! An adapter adds, to a projection `y = W·x` of the base, `scale · B·(A·x)` with `A` of
//! `rank × in` and `B` of `out × rank` (PEFT's `lora_A` and `lora_B`), `scale` being
//! `lora_alpha / rank` (`lora_alpha / √rank` with `use_rslora`). The projections it may touch
//! are a Llama layer's seven: q, k, v, o, gate, up and down. Everything is checked before
//! anything is kept: an adapter loads whole or not at all, and a refusal says why.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{ModelConfig, ModelError};

/// A projection of a decoder layer that an adapter can change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    /// The query projection.
    Q,
    /// The key projection.
    K,
    /// The value projection.
    V,
    /// The attention output projection.
    O,
    /// The MLP's gate projection.
    Gate,
    /// The MLP's up projection.
    Up,
    /// The MLP's down projection.
    Down,
}

impl LoraTarget {
    /// Every target, in this order (their index in [`LoraLayer`]).
    pub const ALL: [Self; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// PEFT's (and HF's) module name: `q_proj` ...
    pub fn module(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    /// The module's path inside a layer: `self_attn.q_proj` ...
    fn path(self) -> &'static str {
        match self {
            Self::Q => "self_attn.q_proj",
            Self::K => "self_attn.k_proj",
            Self::V => "self_attn.v_proj",
            Self::O => "self_attn.o_proj",
            Self::Gate => "mlp.gate_proj",
            Self::Up => "mlp.up_proj",
            Self::Down => "mlp.down_proj",
        }
    }

    /// The projection's `(in, out)` widths in a `c` model.
    pub fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let (h, hd, ff) = (c.hidden_size, c.head_dim, c.intermediate_size);
        match self {
            Self::Q => (h, c.num_heads * hd),
            Self::K | Self::V => (h, c.num_kv_heads * hd),
            Self::O => (c.num_heads * hd, h),
            Self::Gate | Self::Up => (h, ff),
            Self::Down => (ff, h),
        }
    }

    /// The target a module name of `target_modules` names: its last dotted part.
    fn from_module(name: &str) -> Option<Self> {
        let last = name.rsplit('.').next().unwrap_or(name);
        Self::ALL.into_iter().find(|t| t.module() == last)
    }

    /// The index of this target in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One projection's low-rank pair.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraPair {
    /// `rank × in`, row-major (PEFT's `lora_A.weight`).
    pub a: Vec<f32>,
    /// `rank × out`, row-major: PEFT's `lora_B.weight` (`out × rank`) transposed, so that the
    /// product's second half runs along the output.
    pub bt: Vec<f32>,
    /// The pair's rank.
    pub rank: usize,
    /// What `B·(A·x)` is multiplied by.
    pub scale: f32,
}

/// One layer's pairs, indexed by [`LoraTarget::index`].
pub type LoraLayer = [Option<LoraPair>; 7];

/// A LoRA adapter read from a PEFT directory and checked against a base model.
#[derive(Clone)]
pub struct LoraAdapter {
    /// The name requests select it by.
    pub name: String,
    /// The directory it was read from.
    pub path: PathBuf,
    /// Its largest rank.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f32,
    /// The projections it changes, in [`LoraTarget::ALL`] order.
    pub targets: Vec<LoraTarget>,
    /// `base_model_name_or_path`, as written.
    pub base_model: Option<String>,
    /// The xxh3 of its config and weights files, never 0: what the block hash of its sequences
    /// starts from (no prefix is shared across adapters or with the base) and what a remote
    /// prefill checks that both ends run the same adapter.
    pub content_hash: u64,
    /// Per layer of the base model, the pairs of that layer.
    pub layers: Vec<LoraLayer>,
}

impl std::fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraAdapter")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("rank", &self.rank)
            .field("targets", &self.targets)
            .field("content_hash", &format_args!("{:016x}", self.content_hash))
            .finish_non_exhaustive()
    }
}

impl LoraAdapter {
    /// Bytes its weights take in memory (f32).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| (p.a.len() + p.bt.len()) * 4)
            .sum()
    }

    /// Whether its pairs have the shapes of a `c` model's projections (it was read for that
    /// base, or one of the same shape).
    pub fn fits(&self, c: &ModelConfig) -> bool {
        self.layers.len() == c.num_layers
            && self.layers.iter().all(|l| {
                LoraTarget::ALL.into_iter().all(|t| match &l[t.index()] {
                    None => true,
                    Some(p) => {
                        let (inp, out) = t.dims(c);
                        p.rank > 0 && p.a.len() == p.rank * inp && p.bt.len() == p.rank * out
                    }
                })
            })
    }

    /// The pair of `target` in `layer`, if the adapter changes it there.
    pub fn pair(&self, layer: usize, target: LoraTarget) -> Option<&LoraPair> {
        self.layers.get(layer)?[target.index()].as_ref()
    }
}

fn bad(path: &Path, why: impl std::fmt::Display) -> ModelError {
    ModelError::Adapter(format!("{}: {why}", path.display()))
}

/// The settings of `adapter_config.json` that shape the weights, checked.
struct PeftConfig {
    rank: usize,
    /// Whether `rank_pattern` gives some modules a rank of their own.
    rank_pattern: bool,
    alpha: f32,
    rslora: bool,
    targets: Vec<LoraTarget>,
    base_model: Option<String>,
}

impl PeftConfig {
    fn parse(dir: &Path, v: &Value) -> Result<Self, ModelError> {
        let b = |why: String| bad(dir, why);
        match v.get("peft_type").and_then(Value::as_str) {
            Some("LORA") | None => {}
            Some(other) => return Err(b(format!("peft_type {other:?} is not LORA"))),
        }
        let rank = v
            .get("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| b("adapter_config.json has no positive integer \"r\"".into()))?
            as usize;
        let alpha = match v.get("lora_alpha") {
            None | Some(Value::Null) => rank as f64,
            Some(a) => a
                .as_f64()
                .ok_or_else(|| b("lora_alpha is not a number".into()))?,
        } as f32;
        let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
        for (k, what) in [
            ("use_dora", "DoRA (use_dora)"),
            ("fan_in_fan_out", "fan_in_fan_out weights"),
            ("lora_bias", "a LoRA bias (lora_bias)"),
            ("use_qalora", "QA-LoRA (use_qalora)"),
            ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
        ] {
            if flag(k) {
                return Err(b(format!("{what} is not supported")));
            }
        }
        match v.get("bias").and_then(Value::as_str) {
            None | Some("none") => {}
            Some(other) => {
                return Err(b(format!(
                    "bias {other:?} is not supported (only \"none\")"
                )))
            }
        }
        let nonempty = |k: &str| match v.get(k) {
            None | Some(Value::Null) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
        };
        if nonempty("modules_to_save") {
            return Err(b(
                "modules_to_save (fully trained modules beside the adapter) is not supported"
                    .into(),
            ));
        }
        for (k, what) in [
            ("alpha_pattern", "a per-module alpha_pattern"),
            ("layer_replication", "layer_replication"),
            (
                "alora_invocation_tokens",
                "an activated LoRA (alora_invocation_tokens)",
            ),
            (
                "trainable_token_indices",
                "trained token embeddings (trainable_token_indices)",
            ),
            ("target_parameters", "target_parameters"),
        ] {
            if nonempty(k) {
                return Err(b(format!("{what} is not supported")));
            }
        }
        let targets = match v.get("target_modules") {
            Some(Value::String(s)) if s == "all-linear" => LoraTarget::ALL.to_vec(),
            Some(Value::String(s)) => {
                return Err(b(format!(
                    "target_modules {s:?}: a pattern is not supported; list the modules"
                )))
            }
            Some(Value::Array(a)) => {
                let mut t = Vec::new();
                for m in a {
                    let name = m
                        .as_str()
                        .ok_or_else(|| b("target_modules holds a non-string".into()))?;
                    let target = LoraTarget::from_module(name).ok_or_else(|| {
                        b(format!(
                            "unknown target module {name:?} (q_proj, k_proj, v_proj, o_proj, \
                             gate_proj, up_proj, down_proj)"
                        ))
                    })?;
                    t.push(target);
                }
                t.sort();
                t.dedup();
                t
            }
            _ => return Err(b("adapter_config.json has no target_modules".into())),
        };
        if targets.is_empty() {
            return Err(b("target_modules is empty".into()));
        }
        Ok(Self {
            rank,
            rank_pattern: nonempty("rank_pattern"),
            alpha,
            rslora: flag("use_rslora"),
            targets,
            base_model: v
                .get("base_model_name_or_path")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    fn scale(&self, rank: usize) -> f32 {
        match self.rslora {
            true => self.alpha / (rank as f32).sqrt(),
            false => self.alpha / rank as f32,
        }
    }
}

/// `m`, `rows × cols` row-major with `cols` given, transposed.
fn transpose(m: &[f32], cols: usize) -> Vec<f32> {
    let rows = m.len() / cols;
    let mut t = vec![0f32; m.len()];
    for (r, row) in m.chunks_exact(cols).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            t[c * rows + r] = v;
        }
    }
    t
}

/// Which layer, target and half (`A` or `B`) a PEFT tensor name is.
fn parse_name(name: &str) -> Option<(usize, LoraTarget, bool)> {
    // base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (some writers keep the
    // adapter's own name: ...lora_A.default.weight)
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    let (idx, rest) = rest.split_once('.')?;
    let layer = idx.parse().ok()?;
    let (module, half) = if let Some((m, h)) = rest.split_once(".lora_A") {
        (m, h)
    } else {
        let (m, h) = rest.split_once(".lora_B")?;
        (m, h)
    };
    if !matches!(half, ".weight" | ".default.weight") {
        return None;
    }
    let target = LoraTarget::ALL.into_iter().find(|t| t.path() == module)?;
    Some((layer, target, rest.contains(".lora_A")))
}

/// Reads the PEFT adapter in `dir` for a `base` model, named `name`: refused (with the reason)
/// when a file is missing or malformed, a module is not one of a Llama layer's projections, a
/// shape does not fit the base, or a rank is above `max_rank`.
pub fn load_lora(
    name: &str,
    dir: &Path,
    base: &ModelConfig,
    max_rank: usize,
) -> Result<LoraAdapter, ModelError> {
    let cfg_path = dir.join("adapter_config.json");
    if !dir.is_dir() {
        return Err(bad(dir, "no such adapter directory"));
    }
    let cfg_bytes = std::fs::read(&cfg_path).map_err(|e| bad(&cfg_path, e))?;
    let cfg_json: Value = serde_json::from_slice(&cfg_bytes).map_err(|e| bad(&cfg_path, e))?;
    let cfg = PeftConfig::parse(dir, &cfg_json)?;
    let st_path = dir.join("adapter_model.safetensors");
    if !st_path.exists() {
        let why = match dir.join("adapter_model.bin").exists() {
            true => "adapter_model.bin (pickle) is not read: save the adapter as safetensors",
            false => "no adapter_model.safetensors",
        };
        return Err(bad(dir, why));
    }
    let bytes = std::fs::read(&st_path).map_err(|e| bad(&st_path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(&st_path, e))?;
    // Per layer and target: A, B and their rank, as the tensors come.
    type Halves = (Option<Vec<f32>>, Option<Vec<f32>>, usize);
    let mut layers: Vec<[Halves; 7]> = (0..base.num_layers).map(|_| Default::default()).collect();
    let mut rank = 0;
    // In name order: the same adapter is refused with the same reason every time.
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (tname, view) in tensors {
        let (layer, target, is_a) = parse_name(&tname).ok_or_else(|| {
            bad(
                &st_path,
                format!("tensor {tname:?} is not a LoRA pair of a layer's q/k/v/o/gate/up/down"),
            )
        })?;
        if layer >= base.num_layers {
            return Err(bad(
                &st_path,
                format!(
                    "{tname}: layer {layer}, but the base has {} layers",
                    base.num_layers
                ),
            ));
        }
        if !cfg.targets.contains(&target) {
            return Err(bad(
                &st_path,
                format!("{tname}: {} is not in target_modules", target.module()),
            ));
        }
        let shape = view.shape();
        let (inp, out) = target.dims(base);
        let r = match (is_a, shape) {
            (true, &[r, k]) if k == inp => r,
            (false, &[n, r]) if n == out => r,
            _ => {
                let want = match is_a {
                    true => format!("[rank, {inp}]"),
                    false => format!("[{out}, rank]"),
                };
                return Err(bad(
                    &st_path,
                    format!("{tname}: shape {shape:?}, the base needs {want}"),
                ));
            }
        };
        if r != cfg.rank && !cfg.rank_pattern {
            return Err(bad(
                &st_path,
                format!(
                    "{tname}: rank {r}, but adapter_config.json says r = {}",
                    cfg.rank
                ),
            ));
        }
        if r == 0 || r > max_rank {
            return Err(bad(
                &st_path,
                format!("{tname}: rank {r} is above --max-lora-rank {max_rank}"),
            ));
        }
        let data: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::F16 => view
                .data()
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::BF16 => view
                .data()
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => return Err(bad(&st_path, format!("{tname}: dtype {other:?}"))),
        };
        if data.iter().any(|x| !x.is_finite()) {
            return Err(bad(&st_path, format!("{tname}: holds NaN or infinity")));
        }
        let slot = &mut layers[layer][target.index()];
        if slot.2 != 0 && slot.2 != r {
            return Err(bad(
                &st_path,
                format!("{tname}: rank {r}, its other half's is {}", slot.2),
            ));
        }
        slot.2 = r;
        rank = rank.max(r);
        match is_a {
            true => slot.0 = Some(data),
            false => slot.1 = Some(data),
        }
    }
    let mut out = Vec::with_capacity(base.num_layers);
    for (i, l) in layers.into_iter().enumerate() {
        let mut pairs: LoraLayer = Default::default();
        for (t, (a, b, r)) in LoraTarget::ALL.into_iter().zip(l) {
            pairs[t.index()] = match (a, b) {
                (None, None) => None,
                (Some(a), Some(b)) => Some(LoraPair {
                    a,
                    bt: transpose(&b, r),
                    rank: r,
                    scale: cfg.scale(r),
                }),
                _ => {
                    return Err(bad(
                        &st_path,
                        format!(
                            "layer {i} {}: lora_A without lora_B or the reverse",
                            t.module()
                        ),
                    ))
                }
            };
        }
        out.push(pairs);
    }
    if rank == 0 {
        return Err(bad(&st_path, "holds no LoRA weights"));
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&cfg_bytes);
    h.update(&bytes);
    let content_hash = h.digest().max(1);
    Ok(LoraAdapter {
        name: name.to_string(),
        path: dir.to_path_buf(),
        rank,
        alpha: cfg.alpha,
        targets: cfg.targets,
        base_model: cfg.base_model,
        content_hash,
        layers: out,
    })
}

/// Writes a random LoRA adapter for a `base` model into `dir` as PEFT saves one
/// (`adapter_config.json` and `adapter_model.safetensors`, f32): rank `rank`, `lora_alpha`
/// `alpha`, the pairs of `targets` in every layer, A of scale `1/√in` and B of 0.05 (both
/// nonzero: PEFT's own initialization leaves B zero, a no-op), from `seed`. For benchmarks and
/// tests that need adapters of a model no committed adapter fits.
pub fn write_random_lora(
    dir: &Path,
    base: &ModelConfig,
    rank: usize,
    alpha: f32,
    targets: &[LoraTarget],
    seed: u64,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| bad(dir, e))?;
    // splitmix64, then a sum of uniforms: roughly normal, and no dependency for test weights.
    let mut state = seed;
    let mut normal = move || {
        let mut u = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..4).map(|_| u()).sum::<f32>() - 2.0
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in 0..base.num_layers {
        for &t in targets {
            let (inp, out) = t.dims(base);
            let name = |half: &str| {
                format!(
                    "base_model.model.model.layers.{layer}.{}.{half}.weight",
                    t.path()
                )
            };
            let a_scale = 1.0 / (inp as f32).sqrt() * 1.7;
            let a: Vec<u8> = (0..rank * inp)
                .flat_map(|_| (normal() * a_scale).to_le_bytes())
                .collect();
            let b: Vec<u8> = (0..out * rank)
                .flat_map(|_| (normal() * 0.05 * 1.7).to_le_bytes())
                .collect();
            tensors.push((name("lora_A"), vec![rank, inp], a));
            tensors.push((name("lora_B"), vec![out, rank], b));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, data)| {
            let v =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .map_err(|e| bad(dir, e))?;
            Ok((n.clone(), v))
        })
        .collect::<Result<_, ModelError>>()?;
    let st = dir.join("adapter_model.safetensors");
    safetensors::tensor::serialize_to_file(views, None, &st).map_err(|e| bad(&st, e))?;
    let cfg = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
        "target_modules": targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
    });
    let path = dir.join("adapter_config.json");
    std::fs::write(&path, cfg.to_string()).map_err(|e| bad(&path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_names_parse_to_layer_target_and_half() {
        assert_eq!(
            parse_name("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            Some((3, LoraTarget::Q, true))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.12.mlp.down_proj.lora_B.default.weight"),
            Some((12, LoraTarget::Down, false))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"),
            None
        );
        assert_eq!(parse_name("base_model.model.lm_head.lora_A.weight"), None);
    }
}
