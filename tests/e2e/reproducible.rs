//! The reproducibility promise end to end: a seeded, temperature-1 `n` = 4 completion gives the
//! same four texts cold, on a prefix hit, with 16 other requests running, prefilled on a prefill
//! worker and locally on a decode worker, and after its decode worker is killed mid-stream (each
//! sample resumes on another worker). Real `tandem prefill`, `decode` and `router` processes on
//! loopback. The prompt is long enough to cross attention's segment cut (256 keys), so a row
//! computed in a prefill chunk and the same row after a prefix hit meet every kernel path.

use crate::common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

/// The probe: about 300 prompt tokens, four seeded samples at temperature 1.
fn probe() -> Value {
    let prompt = "The lighthouse keeper wrote in his log every night. ".repeat(28)
        + "Tonight, the keeper wrote:";
    json!({
        "prompt": prompt,
        "n": 4,
        "seed": 4141,
        "temperature": 1.0,
        "max_tokens": 40,
        "ignore_eos": true,
    })
}

/// The four texts of a (non-streamed) completion, and the whole response.
async fn texts(http: &str, body: &Value) -> (Vec<String>, Value) {
    let (status, v) = post(http, "/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    let mut out = vec![String::new(); 4];
    for c in v["choices"].as_array().unwrap() {
        out[c["index"].as_u64().unwrap() as usize] = c["text"].as_str().unwrap().to_string();
    }
    assert!(out.iter().all(|t| !t.is_empty()), "{v}");
    (out, v)
}

/// The four texts of a streamed completion; `mid` runs once ten events are in (to hit a worker
/// mid-stream).
async fn streamed_texts(http: &str, body: &Value, mid: impl AsyncFnOnce()) -> Vec<String> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let resp = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut chunks = resp.bytes_stream();
    let mut raw = String::new();
    let mut mid = Some(mid);
    while let Some(c) = chunks.next().await {
        raw += std::str::from_utf8(&c.unwrap()).unwrap();
        if mid.is_some() && sse_events(&raw).len() >= 10 {
            (mid.take().unwrap())().await;
        }
    }
    assert!(mid.is_none(), "the stream ended before it could be hit");
    let events = sse_events(&raw);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{raw}");
    let mut out = vec![String::new(); 4];
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        for c in v["choices"].as_array().unwrap() {
            out[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_samples_are_the_same_cold_cached_loaded_remote_local_and_migrated() {
    let (_p, paddr) = start_prefill(&[]);
    let (mut d1, d1addr, _) = start_decode(&[]);
    let (mut d2, d2addr, _) = start_decode(&[]);
    let (_d3, d3addr, _) = start_decode(&[]);
    // Every prompt prefilled on the prefill worker.
    let remote = start_router(
        &[d1addr.clone(), d2addr.clone()],
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=1",
        ],
    );
    // Prefilled on its decode worker.
    let local = start_router(std::slice::from_ref(&d3addr), &[]);
    wait_ready(&remote, 2).await;
    wait_ready(&local, 1).await;
    let body = probe();

    // Cold, prefilled remotely.
    let (want, _) = texts(&remote.http, &body).await;
    let rm = scrape(&remote.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="remote"}"#),
        1.0,
        "the cold request was prefilled on the prefill worker"
    );
    assert!(
        want.iter().collect::<std::collections::BTreeSet<_>>().len() > 1,
        "temperature 1 gives different samples: {want:?}"
    );

    // Cold, prefilled locally on another decode worker.
    assert_eq!(texts(&local.http, &body).await.0, want, "prefilled locally");
    assert_eq!(
        metric(
            &scrape(&local.http).await,
            r#"tandem_prefill_requests_total{mode="local"}"#
        ),
        1.0
    );

    // Again: the decode worker holds the prompt's blocks (a prefix hit), whole and streamed.
    let (hit, v) = texts(&remote.http, &body).await;
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "a prefix hit: {v}"
    );
    assert_eq!(hit, want, "on a prefix hit");
    assert_eq!(
        streamed_texts(&remote.http, &body, async || {}).await,
        want,
        "streamed on a prefix hit"
    );

    // With 16 other requests running on the same workers (other prompts, other lengths).
    let others: Vec<_> = (0..16)
        .map(|i| {
            let http = remote.http.clone();
            tokio::spawn(async move {
                let body = json!({
                    "prompt": format!("Request {i}: list {} things about the sea.", i + 2),
                    "max_tokens": 48 + 4 * i,
                    "temperature": 0.7,
                    "ignore_eos": true,
                });
                let (status, v) = post(&http, "/v1/completions", body).await;
                assert_eq!(status, 200, "{v}");
            })
        })
        .collect();
    until("the other requests are running", || async {
        let s = router_state(&remote.http).await;
        s["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["in_flight"].as_u64().unwrap())
            .sum::<u64>()
            >= 8
    })
    .await;
    assert_eq!(
        texts(&local.http, &body).await.0,
        want,
        "locally, while the others run elsewhere"
    );
    assert_eq!(
        texts(&remote.http, &body).await.0,
        want,
        "among 16 other requests"
    );
    for o in others {
        o.await.unwrap();
    }

    // Streamed, its decode worker killed mid-stream: every sample resumes on the other worker
    // after its own tokens.
    let before = metric(
        &scrape(&remote.http).await,
        "tandem_request_migrations_total",
    );
    let http = remote.http.clone();
    let migrated = streamed_texts(&remote.http, &body, async || {
        let busy = worker_holding_the_stream(&http).await;
        let victim = if busy == d1addr { &mut d1 } else { &mut d2 };
        victim.signal(libc::SIGKILL);
        victim.wait_exit(Duration::from_secs(5));
    })
    .await;
    assert_eq!(migrated, want, "after migration");
    assert!(
        metric(
            &scrape(&remote.http).await,
            "tandem_request_migrations_total"
        ) > before,
        "the stream was migrated"
    );
}
