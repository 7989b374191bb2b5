//! A mixture of experts across the split: real `tandem prefill` and `tandem decode` processes
//! serving the tiny Qwen3-MoE (8 experts) with different expert-parallel sizes on each side. The
//! KV that moves is attention's only, so it maps whatever the sizes; every prompt is prefilled
//! remotely and the tokens are HF transformers' greedy continuation.

use std::path::PathBuf;

use crate::common;

use common::*;
use serde_json::Value;

fn family_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("model/tests/families/qwen3_moe")
}

async fn across(p_ep: usize, d_ep: usize) {
    let model = family_dir().join("model.gguf");
    let (_p, paddr) = Launch::prefill()
        .model(&model)
        .args(&[&format!("--ep={p_ep}")])
        .spawn_prefill();
    let (_d, daddr, _kv) = Launch::decode()
        .model(&model)
        .args(&[&format!("--ep={d_ep}")])
        .spawn_decode();
    let r = Launch::router(std::slice::from_ref(&daddr))
        .model(&model)
        .args(&[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=1",
        ])
        .spawn_router();
    wait_ready(&r, 1).await;
    let text = std::fs::read_to_string(family_dir().join("reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> { serde_json::from_value(reference[k].clone()).unwrap() };
    let (prompt, want) = (ids("prompt_ids"), ids("greedy"));
    // The whole prompt (HF's greedy tokens), and two shorter ones, each what one process gives
    // alone (prefilled locally, one rank).
    let loaded = tandem_model::load(&model).unwrap();
    let mut alone = tandem_engine::Engine::new(
        tandem_engine::CpuModel::new(&loaded, tandem_engine::WeightFormat::Native).unwrap(),
        tandem_engine::EngineConfig {
            kv_cache_mb: 4,
            ..Default::default()
        },
        vec![],
    )
    .unwrap();
    for cut in [prompt.len(), prompt.len() - 9, 5] {
        let (got, _) = generate_ids(&r.grpc, &prompt[..cut], want.len() as u32).await;
        let request = tandem_engine::Request::greedy(prompt[..cut].to_vec(), want.len() as u32);
        let local = alone
            .generate(vec![request.unwrap()], |_| {}, |_| {})
            .unwrap()
            .remove(0)
            .output_ids;
        assert_eq!(
            got, local,
            "P ep {p_ep} -> D ep {d_ep}: {cut} prompt tokens"
        );
        if cut == prompt.len() {
            assert_eq!(got, want, "P ep {p_ep} -> D ep {d_ep}: HF's greedy tokens");
        }
    }
    let dm = scrape(&daddr).await;
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="ok"}"#),
        3.0,
        "P ep {p_ep} -> D ep {d_ep}: every prompt prefilled remotely"
    );
    // Each worker counts its experts' rows, one sample per expert: the prefill side the
    // prompts' (those its prefix cache did not hold), the decode side at least the 15 later
    // tokens of each of the 3 requests; 2 of 8 experts a token in each of 2 layers. (One
    // prefill rank routes only a prompt's last token through the last layer: the others stop
    // once their keys and values are cached. So its count is a multiple of 2, not of 4.)
    let per_row = if p_ep == 1 { 2.0 } else { 4.0 };
    for (addr, least, per) in [(&paddr, 4u64, per_row), (&daddr, 4 * 15 * 3, 4.0)] {
        let m = scrape(addr).await;
        let rows: Vec<f64> = (0..8)
            .map(|e| metric(&m, &format!(r#"tandem_expert_rows_total{{expert="{e}"}}"#)))
            .collect();
        let total: f64 = rows.iter().sum();
        assert!(total >= least as f64, "{addr}: {rows:?}");
        assert_eq!(
            total % per,
            0.0,
            "{addr}: two experts in each of two layers: {rows:?}"
        );
    }
    let rm = scrape(&r.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="local"}"#),
        0.0
    );
    wait_idle(&daddr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_ep2_to_decode_ep1_gives_hf_tokens() {
    across(2, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_ep1_to_decode_ep4_gives_hf_tokens() {
    across(1, 4).await;
}
