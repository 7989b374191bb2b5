//! Reading PEFT LoRA adapters (the random adapters of `model/tests/lora`) against the default
//! model's shape: what is read, and every kind of bad adapter refused with its reason.

use std::path::{Path, PathBuf};

use tandem_model::{load_lora, LoraTarget, ModelConfig, ModelError};

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/lora")
        .join(name)
}

/// SmolLM2-135M's shape, with `layers` layers and `hidden` wide.
fn base(layers: usize, hidden: usize) -> ModelConfig {
    let heads = hidden / 64;
    ModelConfig::from_hf_json(
        &serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": 1536,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "tie_word_embeddings": true
        })
        .to_string(),
    )
    .unwrap()
}

fn smollm2() -> ModelConfig {
    base(30, 576)
}

#[test]
fn an_adapter_is_read_with_its_ranks_scales_and_targets() {
    let c = smollm2();
    let a = load_lora("alpha", &dir("alpha"), &c, 64).unwrap();
    assert_eq!((a.rank, a.alpha), (8, 16.0));
    assert_eq!(a.targets, vec![LoraTarget::Q, LoraTarget::V]);
    assert_eq!(
        a.base_model.as_deref(),
        Some("HuggingFaceTB/SmolLM2-135M-Instruct")
    );
    let q = a.pair(0, LoraTarget::Q).unwrap();
    assert_eq!(
        (q.rank, q.scale, q.a.len(), q.bt.len()),
        (8, 2.0, 8 * 576, 8 * 576)
    );
    assert_eq!(a.pair(29, LoraTarget::V).unwrap().bt.len(), 8 * 192);
    assert!(a.pair(0, LoraTarget::K).is_none() && a.pair(30, LoraTarget::Q).is_none());
    // q: A 8×576 and B 576×8, v: A 8×576 and B 192×8, in each of 30 layers, f32.
    assert_eq!(a.bytes(), 30 * 8 * (576 + 576 + 576 + 192) * 4);
    assert!(a.fits(&c) && !a.fits(&base(29, 576)));
    // rsLoRA: alpha / sqrt(r) = 8 / 2.
    let b = load_lora("beta", &dir("beta"), &c, 64).unwrap();
    assert_eq!(b.targets, LoraTarget::ALL.to_vec());
    assert_eq!(b.pair(3, LoraTarget::Down).unwrap().scale, 4.0);
    // Every adapter's content hash is its own, and never the base chain's root.
    let hashes: Vec<u64> = ["alpha", "beta", "gamma", "delta"]
        .iter()
        .map(|n| load_lora(n, &dir(n), &c, 64).unwrap().content_hash)
        .collect();
    let mut distinct = hashes.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 4);
    assert!(hashes.iter().all(|&h| h != 0));
    // The same files read again hash the same.
    assert_eq!(
        load_lora("x", &dir("alpha"), &c, 64).unwrap().content_hash,
        hashes[0]
    );
}

/// A copy of adapter `name` in a temporary directory, its config changed by `edit`.
fn copy(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    let src = dir(name);
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        t.path().join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    edit(&mut cfg);
    std::fs::write(t.path().join("adapter_config.json"), cfg.to_string()).unwrap();
    t
}

fn refused(path: &Path, c: &ModelConfig, max_rank: usize) -> String {
    match load_lora("bad", path, c, max_rank) {
        Err(e @ ModelError::Adapter(_)) => e.to_string(),
        other => panic!("{}: {other:?}", path.display()),
    }
}

#[test]
fn bad_adapters_are_refused_with_the_reason() {
    let c = smollm2();
    let cases: Vec<(tempfile::TempDir, &str)> = vec![
        (
            copy("alpha", |v| {
                v["target_modules"] = serde_json::json!(["q_proj", "lm_head"])
            }),
            "unknown target module \"lm_head\"",
        ),
        (
            copy("alpha", |v| {
                v["target_modules"] = serde_json::json!(["q_proj"])
            }),
            "v_proj is not in target_modules",
        ),
        (copy("alpha", |v| v["use_dora"] = true.into()), "DoRA"),
        (copy("alpha", |v| v["r"] = 16.into()), "says r = 16"),
        (
            copy("alpha", |v| {
                v["modules_to_save"] = serde_json::json!(["lm_head"])
            }),
            "modules_to_save",
        ),
        (
            copy("alpha", |v| v["peft_type"] = "IA3".into()),
            "is not LORA",
        ),
        (
            copy("alpha", |v| v["target_modules"] = ".*proj".into()),
            "a pattern is not supported",
        ),
    ];
    for (t, why) in &cases {
        let e = refused(t.path(), &c, 64);
        assert!(e.contains(why), "{e} (wanted {why})");
    }
    // A rank above the limit.
    let e = refused(&dir("alpha"), &c, 4);
    assert!(e.contains("rank 8 is above --max-lora-rank 4"), "{e}");
    // Another base: wider, or with fewer layers.
    let e = refused(&dir("alpha"), &base(30, 768), 64);
    assert!(e.contains("the base needs [rank, 768]"), "{e}");
    let e = refused(&dir("beta"), &base(12, 576), 64);
    assert!(e.contains("but the base has 12 layers"), "{e}");
    // Missing and broken files.
    let e = refused(Path::new("/nonexistent/adapter"), &c, 64);
    assert!(e.contains("no such adapter directory"), "{e}");
    let t = copy("alpha", |_| {});
    std::fs::remove_file(t.path().join("adapter_model.safetensors")).unwrap();
    assert!(refused(t.path(), &c, 64).contains("no adapter_model.safetensors"));
    let t = copy("alpha", |_| {});
    let st = t.path().join("adapter_model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    assert!(refused(t.path(), &c, 64).contains("adapter_model.safetensors"));
    let t = copy("alpha", |_| {});
    std::fs::write(t.path().join("adapter_config.json"), "{not json").unwrap();
    assert!(refused(t.path(), &c, 64).contains("adapter_config.json"));
}
