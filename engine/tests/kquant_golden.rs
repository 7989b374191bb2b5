//! The golden checks on the files users download: SmolLM2 requantized by llama.cpp's quantizer
//! (what `llama-quantize` runs) to Q4_K_M, Q5_K_M, Q6_K and Q4_0 (scripts/kquant-golden makes
//! them, and beside each a copy with every quantized tensor dequantized to f32 by gguf-py, the
//! decoder HF transformers loads GGUF with). Each file's greedy tokens for the golden prompts,
//! from the native kernels (each tensor in its own type), equal the tokens of its f32 copy, whose
//! path (f32 weights) the golden checks hold to HF transformers' float32 run. And fed the same
//! tokens, each file gives its f32 copy's logits bit for bit: the native kernels dequantize every
//! panel to the values gguf-py writes and take the same product over them. That check runs at
//! every kernel level scripts/test runs (a prefill and a few decode steps of two records); the
//! token checks, which decode every record, at the best one.

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

/// The tensor types the file `name` must hold (the panel formats it is here to check).
fn must_hold(name: &str) -> &'static [GgmlType] {
    match name {
        "Q4_K_M" => &[GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q8_0],
        "Q5_K_M" => &[GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q5_1],
        "Q6_K" => &[GgmlType::Q6K],
        "Q4_0" => &[GgmlType::Q4_0],
        _ => panic!("no k-quant file {name}"),
    }
}

/// The file `name` (`copy`: its f32 copy), loaded, and checked to hold [`must_hold`]'s types
/// (the copy: f32 tensors only).
fn load(name: &str, copy: bool) -> tandem_model::LoadedModel {
    let file = format!(
        "SmolLM2-135M-Instruct.{name}{}.gguf",
        if copy { "-f32" } else { "" }
    );
    let path = kquants_dir().join(file);
    assert!(
        path.exists(),
        "{} is missing: run scripts/kquant-golden",
        path.display()
    );
    let m = tandem_model::load(&path).unwrap();
    let types = types_of(&m);
    if copy {
        assert!(
            types.iter().all(|(t, _)| *t == GgmlType::F32),
            "the reference is all f32: {types:?}"
        );
    } else {
        eprintln!("{name}: tensor types {types:?}");
        for ty in must_hold(name) {
            assert!(
                types.iter().any(|(t, _)| t == ty),
                "{name} holds no {ty} tensor: {types:?}"
            );
        }
    }
    m
}

fn engine_for(m: &tandem_model::LoadedModel) -> Engine {
    Engine::new(
        CpuModel::new(m, WeightFormat::Native).unwrap(),
        golden_config(),
        m.tokenizer.eos_token_ids.clone(),
    )
    .unwrap()
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

/// Every golden record's greedy tokens from the file equal its f32 copy's.
fn check(name: &str) {
    let mut native = engine_for(&load(name, false));
    let mut reference = engine_for(&load(name, true));
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
    check("Q4_K_M");
}

#[test]
fn q5_k_m_tokens_equal_its_dequantized_weights() {
    check("Q5_K_M");
}

#[test]
fn q6_k_tokens_equal_its_dequantized_weights() {
    check("Q6_K");
}

#[test]
fn q4_0_tokens_equal_its_dequantized_weights() {
    check("Q4_0");
}

/// Fed the same tokens, the file and its f32 copy give the same logits, bit for bit, at every
/// position of a prefill and of the decode steps after it.
fn check_bits(name: &str) {
    let recs = short_records();
    let (got, vocab) = teacher_forced_logits(&load(name, false), WeightFormat::Native, &recs);
    let (want, _) = teacher_forced_logits(&load(name, true), WeightFormat::Native, &recs);
    assert_same_bits(
        &got,
        &want,
        vocab,
        &recs,
        name,
        "natively",
        "from the f32 copy",
    );
}

#[test]
fn q4_k_m_logits_equal_its_dequantized_weights_bit_for_bit() {
    check_bits("Q4_K_M");
}

#[test]
fn q5_k_m_logits_equal_its_dequantized_weights_bit_for_bit() {
    check_bits("Q5_K_M");
}

#[test]
fn q6_k_logits_equal_its_dequantized_weights_bit_for_bit() {
    check_bits("Q6_K");
}

#[test]
fn q4_0_logits_equal_its_dequantized_weights_bit_for_bit() {
    check_bits("Q4_0");
}
