//! Kubernetes discovery through DNS against a real DNS server standing in for the cluster's
//! (tests/dns_server.py on PyPI's dnslib, installed by scripts/test): the router, started with
//! `--discovery k8s --dns-server`, follows a headless Service's SRV records (one per ready pod,
//! each with its port: here every worker shares 127.0.0.1), re-resolved every refresh. A worker
//! added to the records takes requests; one killed with SIGKILL stops being routed to as soon as
//! the pool's own probes see it gone (before DNS drops it, as in Kubernetes, where endpoints
//! follow readiness with a delay); one removed from the records leaves the router's view.
//! Prints the figures (worker start to first routed request, kill to not routed).

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use common::*;
use serde_json::{json, Value};

const SERVICE: &str = "_grpc._tcp.tandem-decode.test";

/// The DNS server on a free loopback port: its process, address and zone file.
fn dns_server(dir: &Path) -> (Proc, String, PathBuf) {
    let port = free_port();
    let zone = dir.join("zone.json");
    write_zone(&zone, &[]);
    let args = [port.to_string(), zone.display().to_string()];
    let p = python_server("dns_server.py", &args);
    (p, format!("127.0.0.1:{port}"), zone)
}

/// The Service's records: one SRV per worker (`127.0.0.1:port`), its target a name with an A
/// record, as a headless Service's pods have.
fn write_zone(zone: &Path, workers: &[&str]) {
    let mut srv = Vec::new();
    let mut a = serde_json::Map::new();
    for w in workers {
        let port: u16 = w.rsplit_once(':').unwrap().1.parse().unwrap();
        let host = format!("pod-{port}.tandem-decode.test.");
        srv.push(json!([host, port]));
        a.insert(host, json!(["127.0.0.1"]));
    }
    let body = json!({"srv": {format!("{SERVICE}."): srv}, "a": a});
    let tmp = zone.with_extension("tmp");
    std::fs::write(&tmp, body.to_string()).unwrap();
    std::fs::rename(&tmp, zone).unwrap();
}

/// `worker`'s entry in the router's view (`None` when it is not in it).
async fn view_of(http: &str, worker: &str) -> Option<Value> {
    router_state(http).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["addr"] == worker)
        .cloned()
}

async fn routed_to(http: &str, worker: &str) -> f64 {
    metric(
        &scrape(http).await,
        &format!(
            "tandem_router_worker_requests_total{{worker_role=\"decode\",worker=\"{worker}\"}}"
        ),
    )
}

async fn one_request(http: &str, model: &str) {
    let (status, body) = post(
        http,
        "/v1/completions",
        json!({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_discovery_follows_a_services_srv_records() {
    let dir = tempfile::tempdir().unwrap();
    let (_dns, dns, zone) = dns_server(dir.path());
    let (_a, a) = start_worker(&[]);
    write_zone(&zone, &[&a]);
    let r = start_router(
        &[SERVICE.to_string()],
        &[
            "--discovery=k8s",
            &format!("--dns-server={dns}"),
            "--dns-refresh-ms=200",
        ],
    );
    wait_ready(&r, 1).await;
    let model = router_state(&r.http).await["model"]
        .as_str()
        .unwrap()
        .to_string();
    one_request(&r.http, &model).await;
    assert_eq!(routed_to(&r.http, &a).await, 1.0);

    // A new pod: its record appears once it is up (Kubernetes adds it when it turns ready).
    let started = Instant::now();
    let (b_proc, b) = start_worker(&[]);
    write_zone(&zone, &[&a, &b]);
    let http = r.http.clone();
    let (m, bb) = (model.clone(), b.clone());
    until("the new worker never took a request", || {
        let (http, m, bb) = (http.clone(), m.clone(), bb.clone());
        async move {
            one_request(&http, &m).await;
            routed_to(&http, &bb).await > 0.0
        }
    })
    .await;
    let first_routed = started.elapsed();
    let joins = metric(
        &scrape(&r.http).await,
        "tandem_discovery_membership_changes_total{worker_role=\"decode\",change=\"join\"}",
    );
    assert_eq!(joins, 2.0, "both pods joined through DNS");

    // SIGKILL: its record stays for now; the pool's probes stop routing to it.
    let killed = Instant::now();
    b_proc.signal(libc::SIGKILL);
    let (http, bb) = (r.http.clone(), b.clone());
    until("the killed worker stayed routable", || {
        let (http, bb) = (http.clone(), bb.clone());
        async move {
            view_of(&http, &bb)
                .await
                .is_some_and(|w| w["ready"] == false)
        }
    })
    .await;
    let not_routed = killed.elapsed();
    let before = routed_to(&r.http, &b).await;
    for _ in 0..5 {
        one_request(&r.http, &model).await;
    }
    assert_eq!(
        routed_to(&r.http, &b).await,
        before,
        "no request went to the dead worker"
    );

    // Its record goes: it leaves the view at the next resolve.
    write_zone(&zone, &[&a]);
    let (http, bb) = (r.http.clone(), b.clone());
    until("the removed record stayed in the view", || {
        let (http, bb) = (http.clone(), bb.clone());
        async move { view_of(&http, &bb).await.is_none() }
    })
    .await;
    assert!(view_of(&r.http, &a)
        .await
        .is_some_and(|w| w["ready"] == true));
    one_request(&r.http, &model).await;
    println!(
        "k8s discovery (SRV, refresh 200 ms): worker start -> first routed request {} ms; SIGKILL -> not routed {} ms",
        first_routed.as_millis(),
        not_routed.as_millis()
    );
}
