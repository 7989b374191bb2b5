//! tandem-model: everything about a model that is files and text, and no compute.
//!
//! Owns: reading GGUF (v2/v3, over mmap) and HF directories (config.json, safetensors single or
//! sharded, tokenizer files, generation config); GGML block formats and their dequantization;
//! the Llama-family [`ModelConfig`]; the [`Tokenizer`] (HF `tokenizers`, or built from GGUF
//! metadata) with incremental detokenization; chat templates ([`ChatTemplate`], minijinja); and the
//! chained block hash ([`hash`]) that the engine's prefix cache and the router's KV index share.
//!
//! Does not own: any arithmetic on activations (tandem-kernels), or the model's forward pass
//! (tandem-engine).
//!
//! Entry point: [`load`] gives a [`LoadedModel`] with tensors under canonical (GGUF-style) names,
//! already converted to one convention: q/k projection rows in HF order, so the engine applies
//! HF's `rotate_half` rotary embedding whatever the file format.
//!
//! Main types: [`LoadedModel`] (a model read from disk), [`ModelConfig`] (its dimensions and
//! rotary settings), [`TensorData`] (one weight tensor, still in its file encoding) named by
//! [`TensorName`], [`Tokenizer`] and [`IncrementalDecoder`] (text to token ids and back, streamed),
//! [`ChatTemplate`] (messages to a prompt), [`LoraAdapter`] (a PEFT LoRA adapter checked against
//! its base, [`load_lora`]), [`BlockHash`] (a KV block's chained prefix hash) and
//! [`ModelError`]. Two modules are public as namespaces: [`gguf`] (a GGUF reader, and a writer for
//! tests and tools) and [`hash`] (the block hash the engine and the router must compute alike).

#![deny(missing_docs)]

mod chat;
mod config;
pub mod gguf;
pub mod hash;
mod hf;
mod lora;
mod names;
mod quant;
mod tokenizer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use chat::{ChatMessage, ChatTemplate, ToolCallStyle};
pub use config::{Family, ModelConfig, MoeConfig, RopeScaling, SUPPORTED};
pub use hash::{block_hashes, block_hashes_from, chain_root, file_identity, hash_block, BlockHash};
pub use lora::{load_lora, write_random_lora, LoraAdapter, LoraLayer, LoraPair, LoraTarget};
pub use names::{ExpertPart, LayerTensor, TensorName};
pub use quant::{dequantize, quantize_q4_1, quantize_q8_0, GgmlType};
pub use tokenizer::{IncrementalDecoder, Tokenizer, VocabEntry};

/// Why reading a model, or handling its text, failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Reading or writing a file failed for a reason other than its absence.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The model path does not exist.
    #[error("model file not found at {0}: pass --model PATH or run `tandem model fetch`")]
    NotFound(PathBuf),
    /// A model file is truncated, garbled or inconsistent; the message says what and where.
    #[error("malformed model file: {0}")]
    Format(String),
    /// A well-formed file asks for something Tandem does not run (an architecture, a tensor type).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The model configuration is missing a key or describes an impossible model.
    #[error("model config: {0}")]
    Config(String),
    /// The tokenizer could not be built, or could not encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template does not compile or fails to render.
    #[error("{0}")]
    Template(String),
    /// A tensor the forward pass needs is not in the file (the canonical name).
    #[error("tensor {0} is missing from the model file")]
    MissingTensor(String),
    /// A LoRA adapter is missing, malformed or does not fit the base model; the message says
    /// which file and why.
    #[error("LoRA adapter {0}")]
    Adapter(String),
}

impl ModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            Self::NotFound(path.to_path_buf())
        } else {
            Self::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

/// One weight tensor: its element type, row-major shape (`[rows, cols]` for a matrix) and bytes.
#[derive(Clone, Debug)]
pub struct TensorData {
    /// How the elements are encoded in `data`.
    pub ty: GgmlType,
    /// Row-major dimensions: `[rows, cols]` for a matrix, `[len]` for a vector.
    pub shape: Vec<usize>,
    /// The encoded elements, whole GGML blocks of `ty`.
    pub data: Vec<u8>,
}

impl TensorData {
    /// Number of elements (the product of `shape`).
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// Decodes the whole tensor to f32.
    pub fn to_f32(&self) -> Result<Vec<f32>, ModelError> {
        let mut out = vec![0f32; self.elems()];
        quant::dequantize(self.ty, &self.data, &mut out)?;
        Ok(out)
    }

    /// `(rows, cols)`: a vector is one row.
    fn matrix_shape(&self) -> Result<(usize, usize), ModelError> {
        match self.shape[..] {
            [r, c] => Ok((r, c)),
            [c] => Ok((1, c)),
            _ => Err(ModelError::Format(format!(
                "a tensor of shape {:?} is not a matrix or a vector",
                self.shape
            ))),
        }
    }

    /// Rows `range` of a matrix (elements `range` of a vector), in the same encoding: a
    /// tensor-parallel rank's share of a column-parallel projection.
    pub fn slice_rows(&self, range: std::ops::Range<usize>) -> Result<TensorData, ModelError> {
        let (rows, cols) = self.matrix_shape()?;
        if self.shape.len() == 1 {
            return self.slice_cols(range);
        }
        if range.start > range.end || range.end > rows {
            return Err(ModelError::Format(format!(
                "rows {range:?} of a {rows}-row tensor"
            )));
        }
        let rb = self.row_bytes(cols)?;
        Ok(TensorData {
            ty: self.ty,
            shape: vec![range.len(), cols],
            data: self.data[range.start * rb..range.end * rb].to_vec(),
        })
    }

    /// Expert `e`'s matrix of a tensor of every expert (`[experts, rows, cols]`), in the same
    /// encoding.
    pub fn expert(&self, e: usize) -> Result<TensorData, ModelError> {
        let [n, rows, cols] = self.shape[..] else {
            return Err(ModelError::Format(format!(
                "a tensor of shape {:?} is not a tensor of experts",
                self.shape
            )));
        };
        if e >= n {
            return Err(ModelError::Format(format!("expert {e} of {n}")));
        }
        let per = self.data.len() / n.max(1);
        if per * n != self.data.len() || self.ty.bytes_for(rows * cols) != Some(per) {
            return Err(ModelError::Format(format!(
                "{} bytes for {n} experts of {rows}×{cols} {}",
                self.data.len(),
                self.ty
            )));
        }
        Ok(TensorData {
            ty: self.ty,
            shape: vec![rows, cols],
            data: self.data[e * per..(e + 1) * per].to_vec(),
        })
    }

    /// Columns `range` of every row, in the same encoding: a rank's share of a row-parallel
    /// projection. A quantized tensor is cut only at its blocks' edges.
    pub fn slice_cols(&self, range: std::ops::Range<usize>) -> Result<TensorData, ModelError> {
        let (rows, cols) = self.matrix_shape()?;
        if range.start > range.end || range.end > cols {
            return Err(ModelError::Format(format!(
                "columns {range:?} of a {cols}-column tensor"
            )));
        }
        let be = self.ty.block_elems();
        if !range.start.is_multiple_of(be) || !range.end.is_multiple_of(be) {
            return Err(ModelError::Unsupported(format!(
                "columns {range:?} of a {} tensor: it can only be cut every {be} columns (its quantization blocks)",
                self.ty
            )));
        }
        let rb = self.row_bytes(cols)?;
        let (from, to) = (
            range.start / be * self.ty.block_bytes(),
            range.end / be * self.ty.block_bytes(),
        );
        let mut data = Vec::with_capacity(rows * (to - from));
        for row in self.data.chunks_exact(rb.max(1)).take(rows) {
            data.extend_from_slice(&row[from..to]);
        }
        let shape = match self.shape.len() {
            1 => vec![range.len()],
            _ => vec![rows, range.len()],
        };
        Ok(TensorData {
            ty: self.ty,
            shape,
            data,
        })
    }

    /// Bytes of one row of `cols` elements, checked against the data's length.
    fn row_bytes(&self, cols: usize) -> Result<usize, ModelError> {
        let rb = self.ty.bytes_for(cols).ok_or_else(|| {
            ModelError::Format(format!(
                "{cols} columns is not a whole number of {} blocks",
                self.ty
            ))
        })?;
        let rows = self.elems() / cols.max(1);
        if self.data.len() != rb * rows {
            return Err(ModelError::Format(format!(
                "a {:?} {} tensor holds {} bytes, not {}",
                self.shape,
                self.ty,
                self.data.len(),
                rb * rows
            )));
        }
        Ok(rb)
    }
}

/// Sampling defaults a model ships with (HF `generation_config.json`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// Sampling temperature, if the model sets one.
    pub temperature: Option<f32>,
    /// Nucleus-sampling probability mass, if the model sets one.
    pub top_p: Option<f32>,
    /// Number of most likely tokens to sample among, if the model sets one.
    pub top_k: Option<u32>,
}

/// A model read from disk: configuration, text handling and weights under canonical names
/// (`token_embd.weight`, `blk.N.attn_q.weight`, ..., `output.weight` when not tied).
pub struct LoadedModel {
    /// The model's dimensions and rotary settings.
    pub config: ModelConfig,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template the model ships with, if any.
    pub chat_template: Option<ChatTemplate>,
    /// Sampling defaults from `generation_config.json` (all unset for GGUF files).
    pub generation: GenerationDefaults,
    /// Weights by canonical name; empty when loaded with [`load_text`].
    pub tensors: BTreeMap<String, TensorData>,
    /// A name for the model: the file stem or directory name.
    pub name: String,
}

impl LoadedModel {
    /// The tensor stored under canonical name `name`, or [`ModelError::MissingTensor`].
    pub fn tensor(&self, name: &str) -> Result<&TensorData, ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// The tensor `name` names.
    pub fn get(&self, name: TensorName) -> Result<&TensorData, ModelError> {
        get_tensor(&self.tensors, name)
    }
}

/// `name`'s tensor among tensors stored under canonical names.
pub fn get_tensor(
    tensors: &BTreeMap<String, TensorData>,
    name: TensorName,
) -> Result<&TensorData, ModelError> {
    tensors
        .get(&name.canonical())
        .ok_or_else(|| ModelError::MissingTensor(name.canonical()))
}

/// Loads a GGUF file or an HF model directory.
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    load_with(path, true)
}

/// Loads only what handling text needs (config, tokenizer, chat template): `tensors` stays empty.
/// The router uses this; it never runs the model.
pub fn load_text(path: &Path) -> Result<LoadedModel, ModelError> {
    load_with(path, false)
}

fn load_with(path: &Path, weights: bool) -> Result<LoadedModel, ModelError> {
    if !path.exists() {
        return Err(ModelError::NotFound(path.to_path_buf()));
    }
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    if path.is_dir() {
        hf::load_dir(path, name, weights)
    } else {
        load_gguf(path, name, weights)
    }
}

fn load_gguf(path: &Path, name: String, weights: bool) -> Result<LoadedModel, ModelError> {
    let g = gguf::GgufFile::open(path)?;
    let config = ModelConfig::from_gguf(&g)?;
    let tokenizer = Tokenizer::from_gguf(&g)?;
    let chat_template = match g.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        Some(src) => Some(ChatTemplate::new(
            src,
            tokenizer.bos_token.as_deref(),
            tokenizer.eos_token.as_deref(),
        )?),
        None => None,
    };
    let mut tensors = BTreeMap::new();
    let mut config = config;
    for t in g
        .tensors
        .iter()
        .filter(|t| weights || TensorName::from_canonical(&t.name) == Some(TensorName::RopeFreqs))
    {
        let name = TensorName::from_canonical(&t.name);
        let mut data = TensorData {
            ty: t.ty,
            shape: t.shape(),
            data: g.tensor_bytes(t).to_vec(),
        };
        // llama.cpp's converter permutes Llama's (and Mistral's) q/k rows for its rotary
        // layout; Qwen's it leaves as HF has them.
        let permuted = matches!(config.family, Family::Llama | Family::Mistral);
        match name {
            Some(TensorName::Layer(_, LayerTensor::AttnQ)) if permuted => {
                unpermute_rope_rows(&mut data, config.num_heads, config.head_dim)?
            }
            Some(TensorName::Layer(_, LayerTensor::AttnK)) if permuted => {
                unpermute_rope_rows(&mut data, config.num_kv_heads, config.head_dim)?
            }
            Some(TensorName::RopeFreqs) => {
                config.rope_scaling = Some(RopeScaling::Factors(data.to_f32()?));
                continue;
            }
            _ => {}
        }
        tensors.insert(t.name.clone(), data);
    }
    let model = LoadedModel {
        config,
        tokenizer,
        chat_template,
        generation: GenerationDefaults::default(),
        tensors,
        name,
    };
    if weights {
        check_shapes(&model)?;
    }
    Ok(model)
}

/// GGUF files store each head's q/k rows interleaved (row 2b+a holds HF row a·hd/2+b) for
/// llama.cpp's adjacent-pair RoPE. Rows are whole quantized blocks, so they move without decoding.
fn unpermute_rope_rows(
    t: &mut TensorData,
    n_head: usize,
    head_dim: usize,
) -> Result<(), ModelError> {
    let rows = t.shape.first().copied().unwrap_or(0);
    if t.shape.len() != 2 || rows != n_head * head_dim {
        return Err(ModelError::Format(format!(
            "q/k projection has shape {:?}, expected [{}, _]",
            t.shape,
            n_head * head_dim
        )));
    }
    let row_bytes = t.data.len() / rows;
    let half = head_dim / 2;
    let mut out = vec![0u8; t.data.len()];
    for h in 0..n_head {
        for r in 0..head_dim {
            let src = h * head_dim + 2 * (r % half) + r / half;
            let dst = h * head_dim + r;
            out[dst * row_bytes..(dst + 1) * row_bytes]
                .copy_from_slice(&t.data[src * row_bytes..(src + 1) * row_bytes]);
        }
    }
    t.data = out;
    Ok(())
}

/// Checks that every tensor the forward pass needs is there with the shape the config implies.
fn check_shapes(m: &LoadedModel) -> Result<(), ModelError> {
    for name in TensorName::required(&m.config) {
        let t = m.get(name)?;
        let shape = name.shape(&m.config).unwrap_or_default();
        if t.shape != shape {
            return Err(ModelError::Format(format!(
                "tensor {name} has shape {:?}, the config implies {shape:?}",
                t.shape
            )));
        }
    }
    Ok(())
}

/// The default model's file name inside the model cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where fetched models live: `$TANDEM_MODEL_CACHE`, else `$XDG_CACHE_HOME/tandem/models`, else
/// `~/.cache/tandem/models`.
pub fn model_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_MODEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("tandem").join("models")
}

/// The model a command uses when given none: `$TANDEM_MODEL`, else the default in the cache.
pub fn default_model_path() -> PathBuf {
    std::env::var_os("TANDEM_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| model_cache_dir().join(DEFAULT_MODEL_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // 2 heads of dim 4, rows of one f32 each holding their HF row index.
        let n_head = 2;
        let hd = 4;
        let hf_rows: Vec<f32> = (0..8).map(|i| i as f32).collect();
        // llama.cpp: reshape(n_head, 2, hd/2).swapaxes(1,2)
        let mut gguf_rows = [0f32; 8];
        for h in 0..n_head {
            for a in 0..2 {
                for b in 0..hd / 2 {
                    gguf_rows[h * hd + 2 * b + a] = hf_rows[h * hd + a * hd / 2 + b];
                }
            }
        }
        let mut t = TensorData {
            ty: GgmlType::F32,
            shape: vec![8, 1],
            data: gguf_rows.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        unpermute_rope_rows(&mut t, n_head, hd).unwrap();
        assert_eq!(t.to_f32().unwrap(), hf_rows);
    }

    /// A Q4_1 matrix cut by rows and by columns decodes to the same cut of its whole decoding;
    /// a cut inside a block is refused.
    #[test]
    fn slices_decode_to_the_cut_of_the_whole() {
        let (rows, cols) = (5, 96);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let t = TensorData {
            ty: GgmlType::Q4_1,
            shape: vec![rows, cols],
            data: quantize_q4_1(&x),
        };
        let whole = t.to_f32().unwrap();
        let r = t.slice_rows(1..4).unwrap();
        assert_eq!(r.shape, vec![3, cols]);
        assert_eq!(r.to_f32().unwrap(), whole[cols..4 * cols]);
        let c = t.slice_cols(32..96).unwrap();
        assert_eq!(c.shape, vec![rows, 64]);
        let want: Vec<f32> = whole
            .chunks_exact(cols)
            .flat_map(|row| row[32..96].to_vec())
            .collect();
        assert_eq!(c.to_f32().unwrap(), want);
        let e = t.slice_cols(16..48).unwrap_err().to_string();
        assert!(e.contains("every 32 columns"), "{e}");
        assert!(t.slice_rows(4..6).is_err());
        // A vector's rows are its elements.
        let v = TensorData {
            ty: GgmlType::F32,
            shape: vec![6],
            data: (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect(),
        };
        assert_eq!(
            v.slice_rows(2..5).unwrap().to_f32().unwrap(),
            [2.0, 3.0, 4.0]
        );
    }

    #[test]
    fn missing_file_says_what_to_do() {
        let e = load(Path::new("/nonexistent/model.gguf")).err().unwrap();
        assert!(e.to_string().contains("tandem model fetch"), "{e}");
    }
}
