//! Helpers shared by the end-to-end tests, by concern: [`process`] starts `tandem` roles (one
//! builder, [`Launch`]) and reads their ready lines; [`calls`] talks to a running cluster and
//! waits on it; [`metrics`] reads `/metrics`; [`python`] runs the Python clients and test
//! servers; [`etcd`] and [`chart`] the etcd server and the Helm chart; [`netns`] network
//! namespaces standing in for hosts. This file holds the golden records and the test model.
#![allow(dead_code)]

pub mod calls;
pub mod chart;
pub mod etcd;
pub mod metrics;
pub mod netns;
pub mod process;
pub mod python;

pub use calls::*;
pub use chart::*;
pub use etcd::*;
pub use metrics::*;
pub use process::*;
pub use python::*;

use std::path::PathBuf;

use serde_json::Value;

/// Warnings and errors of the workers a test runs in its own process, written through the test
/// harness's capture: a test that fails shows why its workers gave up (a failed attempt, a
/// refused frame), one that passes shows nothing. Installed once per test binary.
pub fn capture_worker_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
            .with_test_writer()
            .with_ansi(false)
            .try_init();
    });
}

/// The KV secret every test cluster shares.
pub const KV_SECRET: &str = "test-kv-secret-0123456789";

/// The golden records' file (`$TANDEM_GOLDEN`, else `../shared/golden`).
pub fn golden_file() -> PathBuf {
    std::env::var_os("TANDEM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/golden"))
        .join("smollm2_greedy.jsonl")
}

pub fn golden() -> Vec<Value> {
    std::fs::read_to_string(golden_file())
        .expect("golden file")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The tiny Qwen3 of the families tests as an HF directory, copied with `template` as its chat
/// template (a family's template the committed one does not have: thinking, tools).
pub fn qwen3_with_template(template: &str) -> tempfile::TempDir {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("model/tests/families/qwen3");
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap())
            .unwrap();
    cfg["chat_template"] = serde_json::json!(template);
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    dir
}

pub fn model_path() -> PathBuf {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "{} missing: run scripts/test (it fetches the model)",
        p.display()
    );
    p
}

pub struct Expect {
    pub text_ignore_eos: String,
    pub text_eos: String,
    pub tokens_eos: usize,
    pub finish_eos: &'static str,
}

pub fn expected(tok: &tandem_model::Tokenizer, r: &Value) -> Expect {
    let ids: Vec<u32> = serde_json::from_value(r["generated_ids"].clone()).unwrap();
    let (cut, tokens_eos, finish_eos) = match r["first_eos_index"].as_u64() {
        Some(i) => (i as usize, i as usize + 1, "stop"),
        None => (ids.len(), ids.len(), "length"),
    };
    Expect {
        text_ignore_eos: tok.decode(&ids, true).unwrap(),
        text_eos: tok.decode(&ids[..cut], true).unwrap(),
        tokens_eos,
        finish_eos,
    }
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}
