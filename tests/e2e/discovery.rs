//! A cluster that finds itself through etcd (a real one, started here): workers register and
//! the router routes to them; a worker killed with SIGKILL leaves after its lease's TTL and gets
//! no request after that; a worker started later takes requests; etcd stopped and restarted
//! mid-run leaves the cluster serving the workers it knew, then re-synced; a SIGTERM'd worker
//! deletes its card before it drains, and its streams still finish; one told to leave by the
//! preStop hook (`tandem deregister`) deletes its card at once and runs until SIGTERM. Also:
//! malformed and incompatible cards are skipped and counted, and an etcd that is down at start
//! is an error.
//!
//! The figures the note reports (start to routed, kill to unrouted) are printed, never asserted.
#![cfg(feature = "etcd")]

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const CLUSTER: &str = "--cluster=disc";
const PREFIX: &str = "/tandem/disc/";
/// Seconds a killed worker stays listed: 3, so the test is short (the product's default is 10;
/// `TANDEM_TEST_LEASE_TTL_S=10` measures the figures with it).
fn ttl_s() -> u64 {
    std::env::var("TANDEM_TEST_LEASE_TTL_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

fn router(etcd: &Etcd) -> Router {
    start_router(&[], &[&etcd.flag(), CLUSTER, "--policy=round-robin"])
}

fn decode(etcd: &Etcd, env: &[(&str, &str)], extra: &[&str]) -> (Proc, String) {
    let mut args: Vec<String> = vec![
        "decode".into(),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
        format!("--model={}", model_path().display()),
        "--kv-cache-mb=128".into(),
        "--kv-port=0".into(),
        etcd.flag(),
        CLUSTER.into(),
        format!("--lease-ttl-s={}", ttl_s()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let (p, line) = Launch::command(&args, Ready::DECODE).env(env).spawn();
    (p, ready_line(&line).grpc().to_string())
}

/// The router's view of its decode workers: address -> ready.
async fn view(http: &str) -> Vec<(String, bool)> {
    let v = router_state(http).await;
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["addr"].as_str().unwrap().to_string(), w["ready"] == true))
        .collect()
}

/// Waits until the router's view satisfies `ok`; returns how long that took.
async fn wait_view(http: &str, what: &str, ok: impl Fn(&[(String, bool)]) -> bool) -> Duration {
    let start = Instant::now();
    loop {
        let v = view(http).await;
        if ok(&v) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{what}: router sees {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ready(v: &[(String, bool)], addr: &str) -> bool {
    v.iter().any(|(a, r)| a == addr && *r)
}

fn listed(v: &[(String, bool)], addr: &str) -> bool {
    v.iter().any(|(a, _)| a == addr)
}

/// Requests the router sent to `worker`.
async fn sent_to(http: &str, worker: &str) -> f64 {
    let m = scrape(http).await;
    metric(
        &m,
        &format!(
            "tandem_router_worker_requests_total{{worker_role=\"decode\",worker=\"{worker}\"}}"
        ),
    )
}

async fn complete(http: &str, model: &str, max_tokens: u64) -> Value {
    let (status, body) = post(
        http,
        "/v1/completions",
        json!({"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
               "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], max_tokens, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_found_through_etcd_follows_joins_deaths_drains_and_etcd_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut etcd = Etcd::start(dir.path(), port);
    let r = router(&etcd);
    let model = router_state(&r.http).await["model"]
        .as_str()
        .unwrap()
        .to_string();

    // A worker registers and takes requests.
    let started = Instant::now();
    let (a, a_addr) = decode(&etcd, &[], &[]);
    let up = wait_view(&r.http, "a ready", |v| ready(v, &a_addr)).await;
    println!(
        "figure: etcd: worker ready line -> routable in the router: {} ms (process start -> routable: {} ms)",
        up.as_millis(),
        started.elapsed().as_millis()
    );
    complete(&r.http, &model, 4).await;
    assert_eq!(sent_to(&r.http, &a_addr).await, 1.0);
    let key_of = |addr: &str| format!("{PREFIX}decode/decode-{}", addr.rsplit(':').next().unwrap());
    let keys = etcd.keys(PREFIX);
    assert_eq!(keys, vec![key_of(&a_addr)]);
    let card: Value =
        serde_json::from_str(etcd.ctl(&["get", "--print-value-only", &keys[0]]).trim()).unwrap();
    assert_eq!(card["grpc_addr"], a_addr.as_str());
    assert_eq!(card["role"], "decode");
    assert_eq!(card["block_size"], 16);

    // A card that is not one, and a worker with another block size: skipped and counted.
    etcd.ctl(&["put", "/tandem/disc/decode/broken", "not a card"]);
    let mut odd = card.clone();
    odd["worker_id"] = json!("odd");
    odd["grpc_addr"] = json!("127.0.0.1:9");
    odd["block_size"] = json!(32);
    etcd.ctl(&["put", "/tandem/disc/decode/odd", &odd.to_string()]);
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let m = scrape(&r.http).await;
        let malformed = metric(&m, "tandem_discovery_malformed_cards_total");
        let refused = metric(
            &m,
            "tandem_discovery_refused_workers_total{worker_role=\"decode\",reason=\"block_size\"}",
        );
        if malformed == 1.0 && refused == 1.0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "malformed {malformed}, refused {refused}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!listed(&view(&r.http).await, "127.0.0.1:9"));
    etcd.ctl(&["del", "--prefix", "/tandem/disc/decode/broken"]);
    etcd.ctl(&["del", "/tandem/disc/decode/odd"]);

    // A second worker joins and takes its share.
    let (mut b, b_addr) = decode(&etcd, &[], &[]);
    wait_view(&r.http, "b ready", |v| ready(v, &b_addr)).await;
    for _ in 0..4 {
        complete(&r.http, &model, 2).await;
    }
    assert!(sent_to(&r.http, &b_addr).await >= 2.0);

    // SIGKILL: the router stops routing to it at once (its probes fail) and forgets it when
    // its lease runs out; no request reaches it after that.
    let killed = Instant::now();
    a.signal(libc::SIGKILL);
    let unrouted = wait_view(&r.http, "a not ready", |v| !ready(v, &a_addr)).await;
    let gone = wait_view(&r.http, "a gone", |v| !listed(v, &a_addr)).await;
    println!(
        "figure: etcd (ttl {} s): SIGKILL -> not routed: {} ms, -> removed from the view: {} ms",
        ttl_s(),
        unrouted.as_millis(),
        killed.elapsed().as_millis().max(gone.as_millis())
    );
    assert!(!etcd.keys(PREFIX).contains(&key_of(&a_addr)));
    let before = sent_to(&r.http, &a_addr).await;
    for _ in 0..3 {
        complete(&r.http, &model, 2).await;
    }
    assert_eq!(sent_to(&r.http, &a_addr).await, before);

    // etcd goes away: the router keeps serving the worker it knew.
    etcd.stop();
    for _ in 0..3 {
        complete(&r.http, &model, 2).await;
    }
    assert!(ready(&view(&r.http).await, &b_addr));

    // etcd comes back: a worker that registers now is found (the router re-synced).
    let etcd = Etcd::start(dir.path(), port);
    let (mut c, c_addr) = decode(
        &etcd,
        &[("TANDEM_TEST_SLOWDOWN", "10")],
        &["--drain-timeout-s=3600"],
    );
    wait_view(&r.http, "c ready after the restart", |v| {
        ready(v, &c_addr) && ready(v, &b_addr)
    })
    .await;
    assert_eq!(etcd.keys(PREFIX).len(), 2);

    // SIGTERM on a worker with streams in flight (each of its steps is slowed tenfold): its
    // card goes first, while it still runs; the router stops routing to it; its streams finish.
    let before_c = sent_to(&r.http, &c_addr).await;
    let streams: Vec<_> = (0..4)
        .map(|_| {
            let (http, model) = (r.http.clone(), model.clone());
            tokio::spawn(async move { complete(&http, &model, 24).await })
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(120);
    while sent_to(&r.http, &c_addr).await < before_c + 1.0 {
        assert!(Instant::now() < end, "no request reached c");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.signal(libc::SIGTERM);
    let end = Instant::now() + Duration::from_secs(120);
    while etcd.keys(PREFIX).contains(&key_of(&c_addr)) {
        assert!(Instant::now() < end, "c's card still in etcd");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        c.child.try_wait().unwrap().is_none(),
        "c exited before its streams finished"
    );
    wait_view(&r.http, "c gone", |v| !listed(v, &c_addr)).await;
    for s in streams {
        let body = s.await.unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], "length");
    }
    let status = c
        .wait_exit(Duration::from_secs(120))
        .expect("c exits after draining");
    assert!(status.success(), "{status:?}");
    let after_c = sent_to(&r.http, &c_addr).await;
    complete(&r.http, &model, 2).await;
    assert_eq!(sent_to(&r.http, &c_addr).await, after_c);

    // Kubernetes' preStop hook (`tandem deregister` on the worker's host) before SIGTERM: the
    // card goes and the router drops the worker while it still runs; SIGTERM then stops it.
    let port = b_addr.rsplit_once(':').unwrap().1;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["deregister", &format!("--port={port}")])
        .env("TANDEM_KV_SECRET", KV_SECRET)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["deregistered"], true, "{answer}");
    let end = Instant::now() + Duration::from_secs(120);
    while etcd.keys(PREFIX).contains(&key_of(&b_addr)) {
        assert!(
            Instant::now() < end,
            "b's card still in etcd after deregister"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_view(&r.http, "b gone", |v| !listed(v, &b_addr)).await;
    assert!(
        b.child.try_wait().unwrap().is_none(),
        "b runs until SIGTERM"
    );
    assert!(worker_load(&b_addr).await.draining);
    b.signal(libc::SIGTERM);
    let status = b
        .wait_exit(Duration::from_secs(120))
        .expect("b exits after SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[test]
fn an_etcd_that_is_down_at_start_is_a_clear_error() {
    let port = free_port();
    for role in [
        vec![
            "router".to_string(),
            "--http-port=0".into(),
            "--grpc-port=0".into(),
        ],
        vec![
            "decode".to_string(),
            "--port=0".into(),
            "--kv-cache-mb=64".into(),
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(&role)
            .args([
                "--host=127.0.0.1".to_string(),
                format!("--model={}", model_path().display()),
                format!("--discovery=etcd://127.0.0.1:{port}"),
                "--etcd-timeout-ms=2000".into(),
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{}: {stderr}", role[0]);
        assert!(
            stderr.contains(&format!("etcd at 127.0.0.1:{port}")),
            "{}: {stderr}",
            role[0]
        );
    }
}

/// Two routers with `--responses-store etcd://...` share their stored responses: a response
/// created through one is retrieved, continued with `previous_response_id` (its conversation
/// put back together) and deleted through the other, and its key sits under the cluster's
/// prefix with a lease until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routers_share_stored_responses_through_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), free_port());
    let store = format!("--responses-store=etcd://127.0.0.1:{}", etcd.port);
    let (_w, addr) = start_worker(&[]);
    let a = start_router(std::slice::from_ref(&addr), &[&store, "--cluster=shared"]);
    let b = start_router(std::slice::from_ref(&addr), &[&store, "--cluster=shared"]);
    wait_ready(&a, 1).await;
    wait_ready(&b, 1).await;
    let model = models(&a.http).await["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, first) = post(
        &a.http,
        "/v1/responses",
        json!({"model": model, "input": "My name is Ada. Say hello to me.",
               "max_output_tokens": 12, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_string();
    assert_eq!(
        etcd.keys("/tandem/shared/responses/"),
        vec![format!("/tandem/shared/responses/{id}")]
    );
    let got: Value = reqwest::get(format!("{}/v1/responses/{id}", b.http))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["output"], first["output"], "{got}");
    // The follow-up through b is what a whole conversation sent to a gives.
    let (status, second) = post(
        &b.http,
        "/v1/responses",
        json!({"model": model, "input": "What is my name?", "previous_response_id": id,
               "max_output_tokens": 12, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{second}");
    let said = first["output"][0]["content"][0]["text"].as_str().unwrap();
    let (status, whole) = post(
        &a.http,
        "/v1/responses",
        json!({"model": model, "store": false, "max_output_tokens": 12, "temperature": 0,
               "input": [
                   {"role": "user", "content": "My name is Ada. Say hello to me."},
                   {"role": "assistant", "content": said},
                   {"role": "user", "content": "What is my name?"}]}),
    )
    .await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(
        second["output"][0]["content"][0]["text"],
        whole["output"][0]["content"][0]["text"]
    );
    assert_eq!(
        second["usage"]["input_tokens"], whole["usage"]["input_tokens"],
        "{second} {whole}"
    );
    let deleted = reqwest::Client::new()
        .delete(format!("{}/v1/responses/{id}", b.http))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    let gone = reqwest::get(format!("{}/v1/responses/{id}", a.http))
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
    assert_eq!(
        etcd.keys("/tandem/shared/responses/").len(),
        1,
        "the second one stays"
    );
}
