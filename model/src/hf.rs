//! HF model directories: config.json, model.safetensors (or shards listed in
//! model.safetensors.index.json), tokenizer.json, tokenizer_config.json, generation_config.json.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use serde_json::Value;

use crate::quant::GgmlType;
use crate::{
    ChatTemplate, ExpertPart, GenerationDefaults, LayerTensor, LoadedModel, ModelConfig,
    ModelError, TensorData, TensorName, Tokenizer,
};

fn read_json(path: &Path) -> Result<Option<Value>, ModelError> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| ModelError::Format(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::io(path, e)),
    }
}

/// A token given as `"<s>"` or as `{"content": "<s>", ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

pub(crate) fn load_dir(dir: &Path, name: String, weights: bool) -> Result<LoadedModel, ModelError> {
    let cfg_path = dir.join("config.json");
    let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
    let config = ModelConfig::from_hf_json(&cfg_text)?;
    let cfg_json: Value =
        serde_json::from_str(&cfg_text).map_err(|e| ModelError::Config(e.to_string()))?;

    // Weights: one file, or shards named by the index.
    let files: Vec<String> = match read_json(&dir.join("model.safetensors.index.json"))? {
        _ if !weights => Vec::new(),
        Some(index) => {
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    ModelError::Format("model.safetensors.index.json has no weight_map".into())
                })?;
            let mut f: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            f.sort();
            f.dedup();
            f
        }
        None => vec!["model.safetensors".into()],
    };
    let mut tensors = BTreeMap::new();
    // One expert's matrices at a time, merged below into llama.cpp's tensors of every expert.
    let mut experts: BTreeMap<String, BTreeMap<usize, TensorData>> = BTreeMap::new();
    for f in files {
        if f.contains('/') || f.contains("..") {
            return Err(ModelError::Format(format!(
                "shard name {f:?} points outside the model directory"
            )));
        }
        let path = dir.join(&f);
        let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
        // SAFETY: read-only map of a model file, as in the GGUF reader.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
        let st = safetensors::SafeTensors::deserialize(&map)
            .map_err(|e| ModelError::Format(format!("{}: {e}", path.display())))?;
        for (tname, view) in st.tensors() {
            let (canon, part) = match TensorName::from_hf(&tname) {
                Some(c) => (c, None),
                None => match TensorName::from_hf_expert(&tname) {
                    Some((c, p)) => (c, Some(p)),
                    None => continue,
                },
            };
            let ty = match view.dtype() {
                safetensors::Dtype::F32 => GgmlType::F32,
                safetensors::Dtype::F16 => GgmlType::F16,
                safetensors::Dtype::BF16 => GgmlType::BF16,
                other => {
                    return Err(ModelError::Unsupported(format!(
                        "tensor {tname} has dtype {other:?}"
                    )))
                }
            };
            let t = TensorData {
                ty,
                shape: view.shape().to_vec(),
                data: view.data().to_vec(),
            };
            match part {
                None => {
                    tensors.insert(canon.canonical(), t);
                }
                Some(ExpertPart::One(e)) => {
                    experts.entry(canon.canonical()).or_default().insert(e, t);
                }
                Some(ExpertPart::GateUp) => {
                    let (gate, up) = split_gate_up(&tname, t)?;
                    let TensorName::Layer(i, _) = canon else {
                        unreachable!("an expert tensor is a layer's")
                    };
                    tensors.insert(canon.canonical(), gate);
                    tensors.insert(TensorName::layer(i, LayerTensor::FfnUpExps).canonical(), up);
                }
            }
        }
    }
    for (name, parts) in experts {
        tensors.insert(name.clone(), merge_experts(&name, parts)?);
    }

    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        return Err(ModelError::NotFound(tok_path));
    }
    let inner = tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
    let tcfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let gcfg = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
    let ids = |v: Option<&Value>| -> Vec<u32> {
        match v {
            Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|n| n as u32)
                .collect(),
            _ => vec![],
        }
    };
    let mut extra_eos = ids(gcfg.get("eos_token_id"));
    extra_eos.extend(ids(cfg_json.get("eos_token_id")));
    let bos = token_text(tcfg.get("bos_token"));
    let eos = token_text(tcfg.get("eos_token"));
    let add_bos = tcfg
        .get("add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let tokenizer = Tokenizer::from_hf(inner, bos, eos, &extra_eos, add_bos);
    let template_src = match tcfg.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        // A list of named templates: take "default".
        Some(Value::Array(a)) => a
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template").and_then(|s| s.as_str()))
            .map(str::to_string),
        _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
    };
    let chat_template = match template_src {
        Some(src) => Some(ChatTemplate::new(
            &src,
            tokenizer.bos_token.as_deref(),
            tokenizer.eos_token.as_deref(),
        )?),
        None => None,
    };
    let generation = GenerationDefaults {
        temperature: gcfg
            .get("temperature")
            .and_then(|v| v.as_f64())
            .map(|v| v as f32),
        top_p: gcfg.get("top_p").and_then(|v| v.as_f64()).map(|v| v as f32),
        top_k: gcfg.get("top_k").and_then(|v| v.as_u64()).map(|v| v as u32),
    };
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or(name);
    let model = LoadedModel {
        config,
        tokenizer,
        chat_template,
        generation,
        tensors,
        name,
    };
    if weights {
        crate::check_shapes(&model)?;
    }
    Ok(model)
}

/// Each expert's matrix (expert index to tensor, all of one type and shape), as one tensor of
/// every expert: `[experts, rows, cols]`, expert after expert.
fn merge_experts(name: &str, parts: BTreeMap<usize, TensorData>) -> Result<TensorData, ModelError> {
    let n = parts.len();
    let first = parts.values().next().expect("at least one expert");
    let (ty, shape) = (first.ty, first.shape.clone());
    let mut data = Vec::with_capacity(first.data.len() * n);
    for (i, (e, t)) in parts.iter().enumerate() {
        if *e != i {
            return Err(ModelError::Format(format!(
                "{name}: expert {i} is missing (the checkpoint has {n} experts' matrices)"
            )));
        }
        if t.ty != ty || t.shape != shape || shape.len() != 2 {
            return Err(ModelError::Format(format!(
                "{name}: expert {e} is {} {:?}, expert 0 {ty} {shape:?}",
                t.ty, t.shape
            )));
        }
        data.extend_from_slice(&t.data);
    }
    Ok(TensorData {
        ty,
        shape: vec![n, shape[0], shape[1]],
        data,
    })
}

/// transformers' fused gate|up of every expert (`[experts, 2·ff, hidden]`, each expert's gate
/// rows then its up rows) as the gate and up tensors of every expert.
fn split_gate_up(name: &str, t: TensorData) -> Result<(TensorData, TensorData), ModelError> {
    let [e, rows, cols] = t.shape[..] else {
        return Err(ModelError::Format(format!(
            "{name} has shape {:?}, expected [experts, 2·ff, hidden]",
            t.shape
        )));
    };
    if rows % 2 != 0 || !t.data.len().is_multiple_of((e * rows).max(1)) {
        return Err(ModelError::Format(format!(
            "{name} has shape {:?}",
            t.shape
        )));
    }
    let half = t.data.len() / e.max(1) / 2;
    let (mut gate, mut up) = (
        Vec::with_capacity(t.data.len() / 2),
        Vec::with_capacity(t.data.len() / 2),
    );
    for x in t.data.chunks_exact(2 * half.max(1)) {
        gate.extend_from_slice(&x[..half]);
        up.extend_from_slice(&x[half..]);
    }
    let part = |data| TensorData {
        ty: t.ty,
        shape: vec![e, rows / 2, cols],
        data,
    };
    Ok((part(gate), part(up)))
}
