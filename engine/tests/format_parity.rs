//! A small random Llama written by this test to GGUF (unquantized, q/k rows permuted the way
//! llama.cpp's converter stores them) and to an HF directory (safetensors, single and sharded)
//! gives the same logits from both loaders.

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use serde_json::json;
use tandem_engine::{CpuModel, Engine, EngineConfig, WeightFormat};
use tandem_model::gguf::{self, MetaValue, TensorToWrite};
use tandem_model::GgmlType;

const H: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = 16;
const FF: usize = 96;
const LAYERS: usize = 2;
const VOCAB: usize = 32;

fn vocab() -> Vec<String> {
    let mut v: Vec<String> = ["<|endoftext|>", "a", "b", "c", "d", "ab", "cd", "abcd"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    while v.len() < VOCAB {
        v.push(format!("t{}", v.len()));
    }
    v
}

/// HF-layout tensors: (HF name, shape, values).
fn random_model(seed: u64, tied: bool) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t = |name: String, shape: Vec<usize>, norm: bool| {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| {
                if norm {
                    1.0 + rng.gen_range(-0.1..0.1)
                } else {
                    rng.gen_range(-0.3..0.3)
                }
            })
            .collect();
        (name, shape, v)
    };
    let mut out = vec![t("model.embed_tokens.weight".into(), vec![VOCAB, H], false)];
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}.");
        out.push(t(p.clone() + "input_layernorm.weight", vec![H], true));
        out.push(t(
            p.clone() + "self_attn.q_proj.weight",
            vec![HEADS * HD, H],
            false,
        ));
        out.push(t(
            p.clone() + "self_attn.k_proj.weight",
            vec![KV_HEADS * HD, H],
            false,
        ));
        out.push(t(
            p.clone() + "self_attn.v_proj.weight",
            vec![KV_HEADS * HD, H],
            false,
        ));
        out.push(t(
            p.clone() + "self_attn.o_proj.weight",
            vec![H, HEADS * HD],
            false,
        ));
        out.push(t(
            p.clone() + "post_attention_layernorm.weight",
            vec![H],
            true,
        ));
        out.push(t(p.clone() + "mlp.gate_proj.weight", vec![FF, H], false));
        out.push(t(p.clone() + "mlp.up_proj.weight", vec![FF, H], false));
        out.push(t(p.clone() + "mlp.down_proj.weight", vec![H, FF], false));
    }
    out.push(t("model.norm.weight".into(), vec![H], true));
    if !tied {
        out.push(t("lm_head.weight".into(), vec![VOCAB, H], false));
    }
    out
}

/// llama.cpp's converter: rows of each head reordered for adjacent-pair RoPE.
fn permute(w: &[f32], n_head: usize) -> Vec<f32> {
    let cols = H;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for a in 0..2 {
            for b in 0..HD / 2 {
                let src = h * HD + a * HD / 2 + b;
                let dst = h * HD + 2 * b + a;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn gguf_name(hf: &str) -> String {
    let n = hf.strip_prefix("model.").unwrap_or(hf);
    match n {
        "embed_tokens.weight" => return "token_embd.weight".into(),
        "norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = n.strip_prefix("layers.").unwrap();
    let (i, f) = rest.split_once('.').unwrap();
    let g = match f {
        "input_layernorm.weight" => "attn_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        "post_attention_layernorm.weight" => "ffn_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        _ => panic!("{f}"),
    };
    format!("blk.{i}.{g}.weight")
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_gguf(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let s = |x: &str| MetaValue::String(x.into());
    let u = MetaValue::U32;
    let md = vec![
        ("general.architecture".to_string(), s("llama")),
        ("llama.embedding_length".into(), u(H as u32)),
        ("llama.feed_forward_length".into(), u(FF as u32)),
        ("llama.block_count".into(), u(LAYERS as u32)),
        ("llama.attention.head_count".into(), u(HEADS as u32)),
        ("llama.attention.head_count_kv".into(), u(KV_HEADS as u32)),
        ("llama.context_length".into(), u(256)),
        ("llama.rope.freq_base".into(), MetaValue::F32(10000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            MetaValue::F32(1e-5),
        ),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("default")),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::Array(vocab().iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(
                (0..VOCAB)
                    .map(|i| MetaValue::I32(if i == 0 { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.merges".into(),
            MetaValue::Array(["a b", "c d", "ab cd"].iter().map(|m| s(m)).collect()),
        ),
        ("tokenizer.ggml.eos_token_id".into(), u(0)),
    ];
    let encoded: Vec<(String, Vec<u64>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, v)| {
            let g = gguf_name(name);
            let v = if g.ends_with("attn_q.weight") {
                permute(v, HEADS)
            } else if g.ends_with("attn_k.weight") {
                permute(v, KV_HEADS)
            } else {
                v.clone()
            };
            (
                g,
                shape.iter().rev().map(|&d| d as u64).collect(),
                bytes(&v),
            )
        })
        .collect();
    let tw: Vec<TensorToWrite<'_>> = encoded
        .iter()
        .map(|(n, d, b)| TensorToWrite {
            name: n.clone(),
            dims: d.clone(),
            ty: GgmlType::F32,
            data: b,
        })
        .collect();
    gguf::write(path, &md, &tw).unwrap();
}

fn write_hf(dir: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], tied: bool, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = json!({"model_type": "llama", "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tied});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), s.clone(), bytes(v)))
        .collect();
    let per = data.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in data.chunks(per).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
        };
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = chunk
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for (n, _, _) in chunk {
            weight_map.insert(n.clone(), json!(file));
        }
    }
    if shards > 1 {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            json!({"metadata": {}, "weight_map": weight_map}).to_string(),
        )
        .unwrap();
    }
    let v: HashMap<String, usize> = vocab()
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i))
        .collect();
    let tok = json!({"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": v, "merges": ["a b", "c d", "ab cd"]}});
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}).to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": [0, 7], "temperature": 0.6}).to_string(),
    )
    .unwrap();
}

fn logits(path: &Path, prompt: &[u32]) -> (Vec<f32>, tandem_model::LoadedModel) {
    let m = tandem_model::load(path).unwrap();
    let mut e = Engine::new(
        CpuModel::new(&m, WeightFormat::Native).unwrap(),
        EngineConfig {
            block_size: 4,
            kv_cache_mb: 4,
            ..Default::default()
        },
        vec![0],
    )
    .unwrap();
    (e.prompt_logits(prompt).unwrap(), m)
}

#[test]
fn gguf_and_safetensors_give_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = vec![7, 1, 2, 3, 4, 5, 6, 9, 10, 11, 30, 31, 2];
    for (tied, shards) in [(true, 1), (false, 1), (false, 3)] {
        let tensors = random_model(42 + shards as u64, tied);
        let g = dir.path().join(format!("m-{tied}-{shards}.gguf"));
        write_gguf(&g, &tensors);
        let hf = dir.path().join(format!("hf-{tied}-{shards}"));
        write_hf(&hf, &tensors, tied, shards);
        let (a, gm) = logits(&g, &prompt);
        let (b, hm) = logits(&hf, &prompt);
        assert_eq!(a.len(), VOCAB);
        assert!(
            a.iter().any(|&x| x.abs() > 1e-3),
            "logits are not trivially zero"
        );
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "tied={tied} shards={shards}: {x} vs {y}"
            );
        }
        // Both tokenizers agree, and the HF side read its config files.
        assert_eq!(
            gm.tokenizer.encode("abcd ab", false).unwrap(),
            hm.tokenizer.encode("abcd ab", false).unwrap()
        );
        assert_eq!(gm.tokenizer.encode("abcd", false).unwrap(), vec![7]);
        assert_eq!(hm.tokenizer.eos_token_ids, vec![0, 7]);
        assert_eq!(hm.generation.temperature, Some(0.6));
        assert_eq!(gm.config.tie_word_embeddings, tied);
        let msgs = [tandem_model::ChatMessage {
            role: "user".into(),
            content: "ab".into(),
            ..Default::default()
        }];
        assert_eq!(
            hm.chat_template
                .as_ref()
                .unwrap()
                .render(&msgs, true)
                .unwrap(),
            "ab"
        );
    }
}

#[test]
fn a_truncated_gguf_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let g = dir.path().join("m.gguf");
    write_gguf(&g, &random_model(1, true));
    let full = std::fs::read(&g).unwrap();
    for cut in [10, 100, 1000, full.len() / 2, full.len() - 1] {
        std::fs::write(&g, &full[..cut]).unwrap();
        let e = tandem_model::load(&g)
            .err()
            .expect("truncated file must not load");
        assert!(
            e.to_string().contains("malformed") || e.to_string().contains("truncated"),
            "{e}"
        );
    }
}
