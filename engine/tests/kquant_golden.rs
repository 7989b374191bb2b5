//! The golden checks on the files users download: SmolLM2 requantized by llama.cpp's quantizer
//! (what `llama-quantize` runs) to Q4_K_M, Q5_K_M, Q6_K and Q4_0 (scripts/kquant-golden makes
//! them, and beside each a copy with every quantized tensor dequantized to f32 by gguf-py, the
//! decoder HF transformers loads GGUF with). Each file's greedy tokens for the golden prompts,
//! from the native kernels (each tensor in its own type), equal the tokens of its f32 copy, whose
//! path (f32 weights) the golden checks hold to HF transformers' float32 run.

mod golden_support;

use std::path::PathBuf;

use golden_support::*;
use tandem_engine::{CpuModel, Engine, WeightFormat};
use tandem_model::GgmlType;

/// The folder scripts/kquant-golden fills: `TANDEM_KQUANTS`, or `kquants` in the model cache.
fn kquants_dir() -> PathBuf {
    let dir = std::env::var_os("TANDEM_KQUANTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| tandem_model::model_cache_dir().join("kquants"));
    assert!(
        dir.is_dir(),
        "k-quant files not found in {}: run scripts/kquant-golden (scripts/test does)",
        dir.display()
    );
    dir
}

fn engine_for(path: &std::path::Path) -> (Engine, tandem_model::LoadedModel) {
    assert!(
        path.exists(),
        "{} is missing: run scripts/kquant-golden",
        path.display()
    );
    let m = tandem_model::load(path).unwrap();
    let eos = m.tokenizer.eos_token_ids.clone();
    let e = Engine::new(
        CpuModel::new(&m, WeightFormat::Native).unwrap(),
        golden_config(),
        eos,
    )
    .unwrap();
    (e, m)
}

/// The file's tensor types, by count.
fn types_of(m: &tandem_model::LoadedModel) -> Vec<(GgmlType, usize)> {
    let mut counts: Vec<(GgmlType, usize)> = Vec::new();
    for t in m.tensors.values() {
        match counts.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, n)) => *n += 1,
            None => counts.push((t.ty, 1)),
        }
    }
    counts
}

fn check(name: &str, must_hold: &[GgmlType]) {
    let dir = kquants_dir();
    let (mut native, m) = engine_for(&dir.join(format!("SmolLM2-135M-Instruct.{name}.gguf")));
    let types = types_of(&m);
    eprintln!("{name}: tensor types {types:?}");
    for ty in must_hold {
        assert!(
            types.iter().any(|(t, _)| t == ty),
            "{name} holds no {ty} tensor: {types:?}"
        );
    }
    drop(m);
    let (mut reference, r) =
        engine_for(&dir.join(format!("SmolLM2-135M-Instruct.{name}-f32.gguf")));
    assert!(
        types_of(&r).iter().all(|(t, _)| *t == GgmlType::F32),
        "the reference is all f32"
    );
    drop(r);
    let recs = golden_records().1;
    let got = run_all(&mut native, &recs);
    let want = run_all(&mut reference, &recs);
    let mut tokens = 0;
    for ((rec, g), w) in recs.iter().zip(&got).zip(&want) {
        assert_eq!(g, w, "{name}: record {}", rec["id"]);
        assert_eq!(g.len() as u64, rec["n_new"].as_u64().unwrap());
        tokens += g.len();
    }
    eprintln!("{name}: {} records, {tokens} tokens equal", recs.len());
    assert_no_blocks_held(&native);
}

#[test]
fn q4_k_m_tokens_equal_its_dequantized_weights() {
    check(
        "Q4_K_M",
        &[GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q8_0],
    );
}

#[test]
fn q5_k_m_tokens_equal_its_dequantized_weights() {
    check("Q5_K_M", &[GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q5_1]);
}

#[test]
fn q6_k_tokens_equal_its_dequantized_weights() {
    check("Q6_K", &[GgmlType::Q6K]);
}

#[test]
fn q4_0_tokens_equal_its_dequantized_weights() {
    check("Q4_0", &[GgmlType::Q4_0]);
}
