//! Tensor parallelism across the split: real `tandem prefill` and `tandem decode` processes of
//! different tensor-parallel sizes exchange KV on loopback. Each decode rank receives exactly its
//! KV heads, whatever the prefill side's size, and the tokens are the golden ones; caches that
//! cannot map are refused at the KV handshake with the reason, and the prompt is prefilled
//! locally instead.

use crate::common;

use common::*;
use serde_json::Value;
use tandem_proto::worker as wpb;

fn ids(g: &Value, key: &str) -> Vec<u32> {
    serde_json::from_value(g[key].clone()).unwrap()
}

/// Bytes of one block of every layer of `heads` KV heads (f32 cache, 16-token blocks).
fn block_bytes(heads: usize) -> u64 {
    let m = tandem_model::load_text(&model_path()).unwrap();
    let c = &m.config;
    (2 * 16 * heads * c.head_dim * 4 * c.num_layers) as u64
}

/// Every golden prompt through a prefill worker of `p_tp` ranks and a decode worker of `d_tp`:
/// golden tokens, every prompt prefilled remotely, and each decode rank's bytes its heads' share
/// of the blocks that moved.
async fn mixed(p_tp: usize, d_tp: usize) {
    let (_p, paddr) = start_prefill(&[&format!("--tp={p_tp}")]);
    let (_d, daddr, _kv) = start_decode(&[&format!("--tp={d_tp}")]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=1",
        ],
    );
    wait_ready(&r, 1).await;
    // Each worker says how many ranks it runs.
    for (addr, tp) in [(&paddr, p_tp), (&daddr, d_tp)] {
        let url = format!("http://{addr}");
        let mut c = wpb::worker_control_client::WorkerControlClient::connect(url)
            .await
            .unwrap();
        let info = c
            .info(authed(wpb::InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.tensor_parallel, tp as u32, "{addr}");
    }
    let kv_heads = tandem_model::load_text(&model_path())
        .unwrap()
        .config
        .num_kv_heads;
    let rank_key = |i: usize| format!(r#"tandem_kv_transfer_rank_bytes_total{{rank="{i}"}}"#);
    let recs = golden();
    let mut blocks = 0u64;
    for g in &recs {
        let prompt = ids(g, "prompt_ids");
        let want = ids(g, "generated_ids");
        let (got, _) = generate_ids(&r.grpc, &prompt, want.len() as u32).await;
        assert_eq!(got, want, "P tp {p_tp} -> D tp {d_tp}, {}", g["id"]);
        // Distinct prompts: none shares a full block with an earlier one, so all move.
        blocks += prompt.len().div_ceil(16) as u64;
    }
    let dm = scrape(&daddr).await;
    let total = metric(&dm, "tandem_kv_transfer_bytes_total") as u64;
    assert_eq!(
        total,
        blocks * block_bytes(kv_heads),
        "P tp {p_tp} -> D tp {d_tp}"
    );
    let share = block_bytes(kv_heads / d_tp);
    for rank in 0..d_tp {
        let got = metric(&dm, &rank_key(rank)) as u64;
        eprintln!("P tp {p_tp} -> D tp {d_tp}: decode rank {rank} received {got} bytes");
        assert_eq!(got, blocks * share, "decode rank {rank} of {d_tp}");
    }
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="ok"}"#),
        recs.len() as f64
    );
    assert_eq!(metric(&dm, "tandem_tp_ranks"), d_tp as f64);
    let collective = metric(&dm, "tandem_tp_collective_seconds_total");
    match d_tp {
        1 => assert_eq!(collective, 0.0),
        _ => assert!(collective > 0.0, "{collective}"),
    }
    let rm = scrape(&r.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="local"}"#),
        0.0
    );
    wait_idle(&daddr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp1_to_decode_tp3_gives_the_golden_tokens() {
    mixed(1, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp3_to_decode_tp1_gives_the_golden_tokens() {
    mixed(3, 1).await;
}

/// Equal sizes: each prefill rank's piece goes as it is to the decode rank with the same heads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp3_to_decode_tp3_gives_the_golden_tokens() {
    mixed(3, 3).await;
}

/// A prefill worker started with `prefill_flag`, a decode worker of 3 ranks (f32) and a router
/// that sends every prompt to the prefill worker: the first golden record's greedy tokens come
/// back exactly. The processes (kept alive while held) and the decode worker's address.
async fn golden_through_a_prefill_worker(prefill_flag: &str) -> ((Proc, Proc, Router), String) {
    let (p, paddr) = start_prefill(&[prefill_flag]);
    let (d, daddr, _kv) = start_decode(&["--tp=3"]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=1",
        ],
    );
    wait_ready(&r, 1).await;
    let g = &golden()[0];
    let want = ids(g, "generated_ids");
    let (got, _) = generate_ids(&r.grpc, &ids(g, "prompt_ids"), want.len() as u32).await;
    assert_eq!(got, want, "{prefill_flag}");
    ((p, d, r), daddr)
}

/// A prefill worker with an int8 cache cannot fill an f32 one: the decode worker refuses its
/// KV connection at the handshake (the reason, naming the dtypes, is checked in the
/// kv-transfer tests) and prefills the prompt itself; the answer is still the golden one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caches_that_do_not_map_are_refused_at_the_handshake_and_prefilled_locally() {
    let (_procs, daddr) = golden_through_a_prefill_worker("--kv-dtype=int8").await;
    let dm = scrape(&daddr).await;
    assert_eq!(
        metric(
            &dm,
            r#"tandem_kv_transfer_rejected_frames_total{reason="mismatched"}"#
        ),
        1.0
    );
    assert_eq!(metric(&dm, "tandem_kv_transfer_bytes_total"), 0.0);
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="ok"}"#),
        0.0
    );
    assert_eq!(
        metric(
            &dm,
            r#"tandem_remote_prefill_local_fallbacks_total{reason="all_candidates_failed"}"#
        ),
        1.0
    );
    wait_idle(&daddr).await;
}

/// A prefill worker with an f16 cache fills a decode worker's f32 one of another TP size: the
/// handshake accepts the float types, the prefill side sends each decode rank's heads in f16
/// (half the bytes of f32), and the decode side widens every value (exactly) as it writes it.
/// The answer is the golden one and nothing was refused or prefilled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_f16_prefill_cache_fills_an_f32_decode_cache_converted_at_the_receiver() {
    let (_procs, daddr) = golden_through_a_prefill_worker("--kv-dtype=f16").await;
    let prompt = ids(&golden()[0], "prompt_ids");
    let dm = scrape(&daddr).await;
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="ok"}"#),
        1.0
    );
    assert_eq!(
        metric(
            &dm,
            r#"tandem_kv_transfer_rejected_frames_total{reason="mismatched"}"#
        ),
        0.0
    );
    // The prompt's blocks in f16 as sent: every layer, K and V of 3 heads of 64 per slot.
    let blocks = prompt.len().div_ceil(16) as f64;
    assert_eq!(
        metric(&dm, "tandem_kv_transfer_bytes_total"),
        blocks * 30.0 * (2 * 3 * 16 * 64 * 2) as f64
    );
    wait_idle(&daddr).await;
}
