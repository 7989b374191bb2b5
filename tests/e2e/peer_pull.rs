//! KV pulled from a peer: a prompt one decode worker holds, sent to another, is not computed
//! there: the router names the holder as the prompt's prefill worker, the holder's Prefill
//! service (beside its Decode service) computes only what it lacks and pushes every block over the
//! KV plane, and the text is what the holder itself gives. With the pull turned off, the second
//! worker computes the prompt.

use serde_json::{json, Value};

use crate::common;

use common::*;

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|t| 1000 + (t * 7919 + seed * 104_729 + t * t) % 30_000)
        .collect()
}

async fn complete(r: &Router, ids: &[u32]) -> String {
    let model = models(&r.http).await["data"][0]["id"].clone();
    let (s, v): (u16, Value) = post(
        &r.http,
        "/v1/completions",
        json!({"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
               "ignore_eos": true}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Two decode workers behind a round-robin router (so the second request of a prompt goes to
/// the worker that lacks it), prompts of 64 tokens or more uncached eligible for remote prefill.
async fn two_workers(pull: bool) -> (Vec<(Proc, String, String)>, Router) {
    let workers: Vec<(Proc, String, String)> = (0..2).map(|_| start_decode(&[])).collect();
    let addrs: Vec<String> = workers.iter().map(|(_, a, _)| a.clone()).collect();
    let mut flags = vec!["--policy=round-robin", "--disagg-min-tokens=64"];
    if !pull {
        flags.push("--no-peer-pull");
    }
    let router = start_router(&addrs, &flags);
    wait_ready(&router, 2).await;
    (workers, router)
}

async fn moved(workers: &[(Proc, String, String)]) -> Vec<f64> {
    let mut v = Vec::new();
    for (_, addr, _) in workers {
        v.push(metric(
            &scrape(addr).await,
            "tandem_kv_transfer_bytes_total",
        ));
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_one_decode_worker_holds_is_pulled_by_the_other() {
    let (workers, router) = two_workers(true).await;
    let p = prompt(7, 200);
    let want = complete(&router, &p).await;
    // The router's index hears of the blocks the first worker cached.
    wait_router_cached(&router, 12).await;
    let before = moved(&workers).await;
    let got = complete(&router, &p).await;
    assert_eq!(got, want);
    let after = moved(&workers).await;
    // One worker received the prompt's KV (12 full blocks and the last, partial one), the
    // other none.
    let gained: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(
        gained.iter().any(|&g| g > 0.0) && gained.contains(&0.0),
        "{gained:?}"
    );
    let rm = scrape(&router.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="remote"}"#),
        1.0
    );
    // Nothing was measured before that pull: the threshold decided.
    assert_eq!(
        metric(
            &rm,
            r#"tandem_router_prefill_crossover_total{estimate="unmeasured"}"#
        ),
        1.0
    );
    // The puller measured the link it pulled over, and reports it with its KV size a token.
    let (w0, w1) = (workers[0].1.clone(), workers[1].1.clone());
    let (holder, puller) = if gained[1] > 0.0 {
        (&w0, &w1)
    } else {
        (&w1, &w0)
    };
    let load = worker_load(puller).await;
    assert!(load.kv_bytes_per_token > 0.0, "{load:?}");
    let link = load
        .kv_links
        .iter()
        .find(|l| &l.source == holder)
        .unwrap_or_else(|| panic!("no link from {holder}: {load:?}"));
    assert!(link.bytes_per_s > 0.0);

    // Round robin: one unique prompt each (both measure a prefill rate), then a prompt on the
    // holder and again on the puller, over the link it measured: this time the rates decide.
    for seed in [20, 21] {
        complete(&router, &prompt(seed, 200)).await;
    }
    until("the router knows both workers' prefill rates", || async {
        let v = router_state(&router.http).await;
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["prefill_tokens_per_s"].as_f64().unwrap_or(0.0) > 0.0)
    })
    .await;
    let q = prompt(22, 200);
    let want = complete(&router, &q).await;
    wait_router_cached(&router, 24).await;
    assert_eq!(complete(&router, &q).await, want);
    let rm = scrape(&router.http).await;
    let measured = metric(
        &rm,
        r#"tandem_router_prefill_crossover_total{estimate="remote_faster"}"#,
    ) + metric(
        &rm,
        r#"tandem_router_prefill_crossover_total{estimate="local_faster"}"#,
    );
    assert_eq!(measured, 1.0, "{rm:?}");

    // Without the pull, the second request of a prompt is computed where it lands.
    let (workers, router) = two_workers(false).await;
    let p = prompt(8, 200);
    let want = complete(&router, &p).await;
    wait_router_cached(&router, 12).await;
    assert_eq!(complete(&router, &p).await, want);
    assert_eq!(moved(&workers).await, [0.0, 0.0]);
    let rm = scrape(&router.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="remote"}"#),
        0.0
    );
}
