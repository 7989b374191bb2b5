//! Greedy generation and last-position logits against HF transformers' float32 run
//! (../shared/golden), through the paged cache, with all prompts in one continuous batch.

use std::path::PathBuf;

use serde_json::Value;
use tandem_engine::{Engine, EngineConfig, LlamaModel, Request, SamplingParams, WeightFormat};

fn golden_dir() -> PathBuf {
    std::env::var_os("TANDEM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/golden"))
}

fn engine(format: WeightFormat, cfg: EngineConfig) -> (Engine, Vec<Value>) {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "model not found at {}: run `tandem model fetch` (scripts/test does)",
        p.display()
    );
    let m = tandem_model::load(&p).unwrap();
    let eos = m.tokenizer.eos_token_ids.clone();
    let e = Engine::new(LlamaModel::new(&m, format).unwrap(), cfg, eos).unwrap();
    let text = std::fs::read_to_string(golden_dir().join("smollm2_greedy.jsonl")).unwrap();
    (
        e,
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    )
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn requests(recs: &[Value]) -> Vec<Request> {
    recs.iter()
        .map(|r| Request {
            prompt: ids(&r["prompt_ids"]),
            params: SamplingParams {
                max_tokens: r["n_new"].as_u64().unwrap() as u32,
                ignore_eos: true,
                ..Default::default()
            },
        })
        .collect()
}

fn check_all(e: &mut Engine, recs: &[Value]) {
    let free0 = e.free_blocks();
    let outs = e.generate(requests(recs), |_| {}, |_| {}).unwrap();
    let mut exact = 0;
    for (r, o) in recs.iter().zip(&outs) {
        let want = ids(&r["generated_ids"]);
        if o.output_ids == want {
            exact += 1;
        } else {
            let at = o.output_ids.iter().zip(&want).position(|(a, b)| a != b);
            eprintln!(
                "{}: first difference at {at:?}\n got {:?}\nwant {:?}",
                r["id"], o.output_ids, want
            );
        }
    }
    assert_eq!(exact, recs.len(), "token-exact records");
    assert_eq!(e.free_blocks(), free0, "every block returned");
}

#[test]
fn greedy_tokens_equal_golden_in_one_batch() {
    let (mut e, recs) = engine(WeightFormat::Native, EngineConfig::default());
    check_all(&mut e, &recs);
}

#[test]
fn greedy_tokens_equal_golden_with_small_blocks_and_chunked_prefill() {
    // Block size 1 and 7, and a token budget that splits every long prompt over several steps.
    for bs in [1, 7] {
        let (mut e, recs) = engine(
            WeightFormat::Native,
            EngineConfig {
                block_size: bs,
                max_batched_tokens: 37,
                ..Default::default()
            },
        );
        check_all(&mut e, &recs);
    }
}

#[test]
fn f32_weights_give_the_same_tokens() {
    let (mut e, recs) = engine(WeightFormat::F32, EngineConfig::default());
    check_all(&mut e, &recs);
}

#[test]
fn last_position_logits_within_1e_3() {
    let (mut e, recs) = engine(WeightFormat::Native, EngineConfig::default());
    let mut checked = 0;
    for r in &recs {
        let id = r["id"].as_str().unwrap();
        let path = golden_dir().join(format!("smollm2_{id}_lastpos_logits.bin"));
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let want: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let got = e.prompt_logits(&ids(&r["prompt_ids"])).unwrap();
        assert_eq!(got.len(), want.len());
        let num: f64 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        eprintln!("{id}: relative L2 {rel:.2e}");
        assert!(rel < 1e-3, "{id}: relative L2 error {rel}");
        checked += 1;
    }
    assert_eq!(checked, 3, "three golden logit files");
}
