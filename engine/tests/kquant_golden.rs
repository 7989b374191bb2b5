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
use tandem_engine::backend::Backend;
use tandem_engine::{CpuBackend, CpuModel, Engine, EngineConfig, SeqBatch, WeightFormat};
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

/// Decode steps after the prefill in [`teacher_forced_logits`].
const DECODE_STEPS: usize = 4;

/// The records the bit-for-bit check feeds: of the golden prompts up to 64 tokens, the shortest
/// and the longest (1 and 51 tokens), each with its golden tokens after it.
fn short_records() -> Vec<serde_json::Value> {
    let mut recs: Vec<_> = golden_records()
        .1
        .into_iter()
        .filter(|r| ids(&r["prompt_ids"]).len() <= 64)
        .collect();
    recs.sort_by_key(|r| ids(&r["prompt_ids"]).len());
    let longest = recs.pop().unwrap();
    vec![recs.swap_remove(0), longest]
}

/// The file's logits for each record's prompt and golden tokens, both records in each step: a
/// prefill of all but the last [`DECODE_STEPS`] tokens with logits at every position, then one
/// token a step with the last position's. Every row, in order, and the vocabulary's size.
fn teacher_forced_logits(path: &std::path::Path, recs: &[serde_json::Value]) -> (Vec<f32>, usize) {
    let m = tandem_model::load(path).unwrap();
    let bs = 16;
    let seqs: Vec<Vec<u32>> = recs
        .iter()
        .map(|r| [ids(&r["prompt_ids"]), ids(&r["generated_ids"])].concat())
        .collect();
    let tables: Vec<Vec<u32>> = seqs
        .iter()
        .scan(0u32, |next, s| {
            let n = s.len().div_ceil(bs) as u32;
            *next += n;
            Some((*next - n..*next).collect())
        })
        .collect();
    let cfg = EngineConfig {
        num_blocks: Some(tables.iter().map(Vec::len).sum()),
        block_size: bs,
        ..Default::default()
    };
    let mut b = CpuBackend::new(
        CpuModel::new(&m, WeightFormat::Native).unwrap(),
        &cfg.pool(),
    )
    .unwrap();
    let vocab = b.config().vocab_size;
    let mut out = Vec::new();
    for step in 0..=DECODE_STEPS {
        let batch: Vec<SeqBatch<'_>> = seqs
            .iter()
            .zip(&tables)
            .map(|(s, table)| {
                let first = s.len() - DECODE_STEPS;
                let (tokens, cached) = match step {
                    0 => (&s[..first], 0),
                    _ => (&s[first + step - 1..first + step], first + step - 1),
                };
                SeqBatch {
                    tokens,
                    cached,
                    block_table: table,
                    logits: tokens.len(),
                    lora: None,
                }
            })
            .collect();
        out.extend(b.forward(&batch).unwrap());
    }
    (out, vocab)
}

/// Fed the same tokens, the file and its f32 copy give the same logits, bit for bit, at every
/// position of a prefill and of the decode steps after it.
fn check_bits(name: &str) {
    let dir = kquants_dir();
    let recs = short_records();
    let (got, vocab) = teacher_forced_logits(
        &dir.join(format!("SmolLM2-135M-Instruct.{name}.gguf")),
        &recs,
    );
    let (want, _) = teacher_forced_logits(
        &dir.join(format!("SmolLM2-135M-Instruct.{name}-f32.gguf")),
        &recs,
    );
    // A row for every token of both records.
    let rows = recs
        .iter()
        .map(|r| ids(&r["prompt_ids"]).len() + ids(&r["generated_ids"]).len())
        .sum::<usize>();
    assert!(
        rows > 2 * DECODE_STEPS && vocab > 0,
        "{rows} rows of {vocab}"
    );
    assert_eq!((got.len(), want.len()), (rows * vocab, rows * vocab));
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{name}: logit {} of row {} of {rows} is {} natively and {} from the f32 copy",
            i % vocab,
            i / vocab,
            got[i],
            want[i]
        );
    }
    eprintln!(
        "{name}: {rows} rows of {vocab} logits equal bit for bit (records {}, {}; kernels {})",
        recs[0]["id"],
        recs[1]["id"],
        tandem_kernels::isa::active().name()
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
