//! The model families against HF transformers: tiny random-weight Llama 3, Qwen2, Qwen3 and
//! Mistral models (`model/tests/families`, made by its `make_tiny_models.py`), each loaded from
//! its HF directory (safetensors) and from its GGUF conversion. Every position's logits must be
//! within 1e-4 (relative to the row's largest logit) of HF's float32 logits, and the greedy
//! continuation must be HF's token for token.

mod golden_support;

use std::path::PathBuf;

use golden_support::{greedy_request, ids};
use serde_json::Value;
use tandem_engine::{CpuModel, Engine, EngineConfig, KvDtype, KvPool, SeqBatch, WeightFormat};

fn family_dir(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/families")
        .join(family)
}

/// Each family's end-of-turn token, and what its chat format writes for a user's "hi".
fn markers(family: &str) -> (&'static str, &'static str) {
    match family {
        "llama3" => (
            "<|eot_id|>",
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
        ),
        "mistral" => ("</s>", "[INST] hi [/INST]"),
        "qwen2" | "qwen3" | "qwen3_moe" => ("<|im_end|>", "<|im_start|>user\nhi<|im_end|>"),
        "mixtral" => ("</s>", "[INST] hi [/INST]"),
        other => panic!("no family {other}"),
    }
}

struct Reference {
    prompt: String,
    prompt_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn reference(family: &str) -> Reference {
    let text = std::fs::read_to_string(family_dir(family).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    Reference {
        prompt: v["prompt"].as_str().unwrap().to_string(),
        prompt_ids: ids(&v["prompt_ids"]),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
        greedy: ids(&v["greedy"]),
    }
}

/// The model's logits at each of the first `n` positions of `ids`, one token a step (the first
/// a prefill, then decodes over the cache).
fn logits_by_position(model: &CpuModel, ids: &[u32], n: usize) -> Vec<Vec<f32>> {
    let bs = 16;
    let blocks = ids.len().div_ceil(bs);
    let mut kv = KvPool::new(
        model.kv_layout(bs),
        KvDtype::F32,
        model.config.num_layers,
        blocks,
    )
    .unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    (0..n)
        .map(|i| {
            let batch = SeqBatch {
                tokens: &ids[i..i + 1],
                cached: i,
                block_table: &table,
                logits: 1,
                lora: None,
            };
            model.forward(&[batch], &mut kv).unwrap()
        })
        .collect()
}

/// The largest difference from the reference, relative to each row's largest logit.
fn worst_relative(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            g.iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs() / scale)
                .fold(0f32, f32::max)
        })
        .fold(0f32, f32::max)
}

fn greedy(model: CpuModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut e = Engine::new(
        model,
        EngineConfig {
            kv_cache_mb: 4,
            ..EngineConfig::default()
        },
        vec![],
    )
    .unwrap();
    let r = greedy_request(prompt.to_vec(), n as u32);
    e.generate(vec![r], |_| {}, |_| {}).unwrap()[0]
        .output_ids
        .clone()
}

/// Loads `family` from both of its files and checks logits at the first `positions` positions
/// and, when `greedy_too`, the greedy continuation.
fn check(family: &str, positions: Option<usize>, greedy_too: bool) {
    check_within(family, positions, greedy_too, 1e-4);
}

/// [`check`] with the logits within `tolerance` of the row's largest.
fn check_within(family: &str, positions: Option<usize>, greedy_too: bool, tolerance: f32) {
    let r = reference(family);
    let dir = family_dir(family);
    for path in [dir.clone(), dir.join("model.gguf")] {
        let loaded = tandem_model::load(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        assert_eq!(
            loaded.tokenizer.encode(&r.prompt, true).unwrap(),
            r.prompt_ids,
            "{path:?}: the tokenizer gives HF's ids"
        );
        // The family's own stop token and chat template, from either file.
        let tok = &loaded.tokenizer;
        let (eos, turn) = markers(family);
        let eos = tok.token_to_id(eos).unwrap();
        assert!(tok.eos_token_ids.contains(&eos), "{path:?}: {eos} stops");
        let chat = loaded.chat_template.as_ref().expect("a chat template");
        let user = tandem_model::ChatMessage {
            role: "user".into(),
            content: "hi".into(),
            ..Default::default()
        };
        let text = chat.render(&[user], true).unwrap();
        assert!(text.contains(turn), "{path:?}: {text:?}");
        let model = CpuModel::new(&loaded, WeightFormat::F32).unwrap();
        let n = positions.unwrap_or(r.prompt_ids.len());
        let got = logits_by_position(&model, &r.prompt_ids, n);
        let worst = worst_relative(&got, &r.logits[..n]);
        eprintln!("{family} {path:?}: worst logit difference {worst:.2e} of the row's largest");
        assert!(worst < tolerance, "{family} {path:?}: {worst}");
        if greedy_too {
            let out = greedy(model, &r.prompt_ids, r.greedy.len());
            assert_eq!(out, r.greedy, "{family} {path:?}: greedy tokens");
        }
    }
}

#[test]
fn llama3_matches_hf() {
    check("llama3", None, true);
}

#[test]
fn qwen2_matches_hf() {
    check("qwen2", None, true);
}

#[test]
fn qwen3_matches_hf() {
    check("qwen3", None, true);
}

/// A mixture of experts from HF's per-expert tensors and from llama.cpp's merged ones: the
/// config's experts, and every position's logits within 1e-5 of HF's.
fn check_moe(family: &str, experts: usize, active: usize, norm: bool) {
    for path in [family_dir(family), family_dir(family).join("model.gguf")] {
        let loaded = tandem_model::load(&path).unwrap();
        let m = loaded.config.moe.as_ref().expect("a mixture of experts");
        assert_eq!(
            (m.experts, m.active, m.norm_topk),
            (experts, active, norm),
            "{path:?}"
        );
        let down = loaded
            .tensors
            .get("blk.1.ffn_down_exps.weight")
            .expect("the merged down tensor");
        assert_eq!(down.shape, vec![experts, 64, m.expert_ff], "{path:?}");
    }
    check_within(family, None, true, 1e-5);
}

#[test]
fn qwen3_moe_matches_hf() {
    check_moe("qwen3_moe", 8, 2, true);
}

#[test]
fn mixtral_matches_hf() {
    check_moe("mixtral", 4, 2, true);
}

/// A sequence's logits through the experts are the same bits alone and beside other sequences
/// (whose tokens change which rows each expert computes), prefilled whole or in chunks.
#[test]
fn expert_layers_do_not_depend_on_the_batch() {
    for family in ["qwen3_moe", "mixtral"] {
        let r = reference(family);
        let loaded = tandem_model::load(&family_dir(family).join("model.gguf")).unwrap();
        let model = CpuModel::new(&loaded, WeightFormat::Native).unwrap();
        let ids = &r.prompt_ids;
        let other: Vec<u32> = ids.iter().rev().map(|&t| (t * 7 + 3) % 384).collect();
        let bs = 16;
        let pool = |blocks| KvPool::new(model.kv_layout(bs), KvDtype::F32, 2, blocks).unwrap();
        let blocks = ids.len().div_ceil(bs);
        let t0: Vec<u32> = (0..blocks as u32).collect();
        let t1: Vec<u32> = (blocks as u32..2 * blocks as u32).collect();
        let seq = |tokens, cached, table| SeqBatch {
            tokens,
            cached,
            block_table: table,
            logits: 1,
            lora: None,
        };
        let mut kv = pool(blocks);
        let alone = model.forward(&[seq(ids, 0, &t0)], &mut kv).unwrap();
        let mut kv = pool(2 * blocks);
        let both = model
            .forward(&[seq(&other, 0, &t1), seq(ids, 0, &t0)], &mut kv)
            .unwrap();
        let vocab = alone.len();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&both[vocab..]),
            bits(&alone),
            "{family}: beside another"
        );
        // In two chunks, the second beside the other sequence's first.
        let mut kv = pool(2 * blocks);
        let half = ids.len() / 2;
        let mut first = seq(&ids[..half], 0, &t0);
        first.logits = 0;
        model.forward(&[first], &mut kv).unwrap();
        let chunked = model
            .forward(
                &[seq(&other[..5], 0, &t1), seq(&ids[half..], half, &t0)],
                &mut kv,
            )
            .unwrap();
        assert_eq!(bits(&chunked[vocab..]), bits(&alone), "{family}: chunked");
    }
}

#[test]
fn mistral_matches_hf_with_its_sliding_window() {
    // The window is 8 keys and the prompt 30 tokens: from position 8 on every row slides.
    let r = reference("mistral");
    assert!(
        r.prompt_ids.len() > 3 * 8,
        "the reference reaches past the window"
    );
    for path in [
        family_dir("mistral"),
        family_dir("mistral").join("model.gguf"),
    ] {
        let loaded = tandem_model::load(&path).unwrap();
        assert_eq!(loaded.config.sliding_window, Some(8), "{path:?}");
        assert!(loaded.config.max_position_embeddings > 8, "{path:?}");
    }
    check("mistral", None, true);
}

#[test]
fn unsupported_architectures_name_what_is_supported() {
    let dir = std::env::temp_dir().join(format!("tandem-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = family_dir("qwen2");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replace("\"qwen2\"", "\"gpt_neox\"");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let e = tandem_model::load(&dir).err().expect("refused").to_string();
    assert!(
        e.contains("gpt_neox") && e.contains("qwen3") && e.contains("mistral"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
