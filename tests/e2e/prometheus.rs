//! A real Prometheus (Debian's `prometheus`, installed by scripts/test) scrapes every role of a
//! running disaggregated cluster; after a few requests, each metric of the vLLM-compatible set is
//! read back through Prometheus' HTTP API and checked against what the client saw: generated and
//! prompt tokens, requests by finish reason, one TTFT and end-to-end observation per request, one
//! inter-token gap per token after the first, and the prefill worker's own share.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Prometheus on a free loopback port, scraping `targets` (host:port) every second.
fn prometheus(dir: &std::path::Path, targets: &[(&str, &str)]) -> (Proc, String) {
    let jobs: String = targets
        .iter()
        .map(|(job, t)| {
            format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{t}']\n")
        })
        .collect();
    let config = format!("global:\n  scrape_interval: 1s\nscrape_configs:\n{jobs}");
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let child = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the prometheus binary (scripts/test installs Debian's prometheus)");
    (Proc { child }, format!("http://{addr}"))
}

/// The value of an instant query that returns one sample, or `None` while it returns none.
async fn query(prom: &str, q: &str) -> Option<f64> {
    let encoded: String = q
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let v: Value = reqwest::Client::new()
        .get(format!("{prom}/api/v1/query?query={encoded}"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let result = v["data"]["result"].as_array()?;
    if result.len() != 1 {
        return None;
    }
    result[0]["value"][1].as_str()?.parse().ok()
}

/// The first value of `q` that `ok` accepts (`want` says which, for the failure). Prometheus
/// scrapes every second, and a scrape that failed (one slower than the 1 s timeout on a loaded
/// machine) leaves the target's series stale until the next; the bound only catches a value
/// that never comes, and says what it last saw.
async fn wait_for(prom: &str, q: &str, want: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let end = Instant::now() + Duration::from_secs(120);
    loop {
        match query(prom, q).await {
            Some(v) if ok(v) => return v,
            got => assert!(
                Instant::now() < end,
                "{q}: Prometheus says {got:?}, want {want}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The value of `q` once Prometheus has one.
async fn value(prom: &str, q: &str) -> f64 {
    wait_for(prom, q, "a value", |_| true).await
}

/// Waits until Prometheus answers `q` with `want`.
async fn expect(prom: &str, q: &str, want: f64) {
    wait_for(prom, q, &want.to_string(), |v| v == want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_vllm_metric_set_from_every_role_with_the_values_served() {
    // The prefill worker with a disk tier: its families are on the dashboard too.
    let disk = tempfile::tempdir().unwrap();
    let (_p, paddr) = start_prefill(&[&format!("--kv-disk-dir={}", disk.path().display())]);
    let (_d, daddr, _kv) = start_decode(&[]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=64",
        ],
    );
    wait_ready(&r, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let router_addr = r.http.trim_start_matches("http://").to_string();
    let (_prom, prom) = prometheus(
        dir.path(),
        &[
            ("router", &router_addr),
            ("decode", &daddr),
            ("prefill", &paddr),
        ],
    );
    let model = router_state(&r.http).await["model"]
        .as_str()
        .unwrap()
        .to_string();

    // The chart's KEDA latency triggers, read from a render (the namespace matcher dropped: this
    // Prometheus scrapes without one): before any request they say 0 (nothing to scale for).
    let scalers: Vec<(String, String)> = helm_objects(&[
        "--set",
        "autoscaling.enabled=true",
        "--set",
        "autoscaling.prometheusAddress=http://prometheus:9090",
        "--set",
        "prefill.replicas=1",
        "--set",
        "autoscaling.window=10m",
    ])
    .iter()
    .filter(|o| o["kind"] == "ScaledObject")
    .flat_map(|o| o["spec"]["triggers"].as_array().unwrap().clone())
    .filter(|t| t["metricType"] == "Value")
    .map(|t| {
        (
            t["metadata"]["query"]
                .as_str()
                .unwrap()
                .replace(",namespace=\"default\"", ""),
            t["metadata"]["threshold"].as_str().unwrap().to_string(),
        )
    })
    .collect();
    assert_eq!(scalers.len(), 2, "the ITL and TTFT triggers");
    for (q, _) in &scalers {
        expect(&prom, q, 0.0).await;
    }

    // Short prompts prefill on the decode worker, long ones (>= 64 tokens) on the prefill
    // worker unless the measured crossover says otherwise (see below).
    let long = "The history of the city is long and full of events. ".repeat(12);
    let again = format!("Once more, and slowly: {long}");
    let prompts = [
        "Hello there",
        "Name three colours",
        long.as_str(),
        again.as_str(),
    ];
    let (mut completion, mut prompt_tokens, mut gaps) = (0.0, 0.0, 0.0);
    for (i, p) in prompts.iter().enumerate() {
        let max_tokens = 3 + i as u64;
        let (status, body) = post(
            &r.http,
            "/v1/completions",
            json!({"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                   "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let n = body["usage"]["completion_tokens"].as_f64().unwrap();
        assert_eq!(n, max_tokens as f64);
        completion += n;
        gaps += n - 1.0;
        prompt_tokens += body["usage"]["prompt_tokens"].as_f64().unwrap();
    }
    let requests = prompts.len() as f64;
    let routed = scrape(&r.http).await;
    let remote = metric(&routed, "tandem_prefill_requests_total{mode=\"remote\"}");
    // A prompt with at least the threshold's uncached tokens is estimated, and goes remote
    // unless the measured crossover (the decode worker's own rate against the prefill worker's
    // and the link's, as the router last polled them) says computing it where it decodes is
    // sooner. The threshold is --disagg-min-tokens (both long prompts), or fewer while the
    // decode worker reports a stream decoding under its ITL target, but never below the
    // engine's 16-token prompt floor: the short prompts (a few tokens) are never estimated,
    // however low the decode worker's measured rate. The first estimate has nothing measured.
    // So the remote prefills are exactly the estimates that did not say local; what follows
    // counts those.
    let crossover = |said: &str| {
        metric(
            &routed,
            &format!("tandem_router_prefill_crossover_total{{estimate=\"{said}\"}}"),
        )
    };
    let estimates: f64 = ["unmeasured", "remote_faster", "local_faster"]
        .map(crossover)
        .iter()
        .sum();
    let view = router_state(&r.http).await;
    eprintln!(
        "{remote} remote prefills; the crossover: {} unmeasured, {} remote faster, {} local faster",
        crossover("unmeasured"),
        crossover("remote_faster"),
        crossover("local_faster")
    );
    assert_eq!(estimates, 2.0, "the two long prompts: {view}");
    assert!(crossover("unmeasured") >= 1.0, "the first estimate: {view}");
    assert_eq!(remote, estimates - crossover("local_faster"), "{view}");

    let d = |name: &str| format!("{name}{{role=\"decode\",model_name=\"{model}\"}}");
    let p = |name: &str| format!("{name}{{role=\"prefill\",model_name=\"{model}\"}}");
    expect(&prom, &d("tandem_generation_tokens_total"), completion).await;
    expect(&prom, &d("tandem_prompt_tokens_total"), prompt_tokens).await;
    expect(
        &prom,
        &format!("sum({})", d("tandem_request_success_total")),
        requests,
    )
    .await;
    expect(
        &prom,
        "tandem_request_success_total{role=\"decode\",finished_reason=\"length\"}",
        requests,
    )
    .await;
    for h in [
        "tandem_time_to_first_token_seconds",
        "tandem_e2e_request_latency_seconds",
        "tandem_request_queue_time_seconds",
        "tandem_request_prefill_time_seconds",
        "tandem_request_decode_time_seconds",
    ] {
        expect(&prom, &d(&format!("{h}_count")), requests).await;
        // Every observation is at most the largest bucket's bound: +Inf holds them all.
        expect(
            &prom,
            &format!("{h}_bucket{{role=\"decode\",le=\"+Inf\"}}"),
            requests,
        )
        .await;
        let sum = value(&prom, &d(&format!("{h}_sum"))).await;
        assert!(sum >= 0.0, "{h}_sum {sum}");
    }
    expect(&prom, &d("tandem_inter_token_latency_seconds_count"), gaps).await;
    let ttft = value(&prom, &d("tandem_time_to_first_token_seconds_sum")).await;
    let e2e = value(&prom, &d("tandem_e2e_request_latency_seconds_sum")).await;
    assert!(ttft > 0.0 && ttft <= e2e, "ttft {ttft} e2e {e2e}");
    expect(&prom, &d("tandem_num_requests_running"), 0.0).await;
    expect(&prom, &d("tandem_num_requests_waiting"), 0.0).await;
    let usage = value(&prom, &d("tandem_kv_cache_usage_perc")).await;
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    let queries = value(&prom, &d("tandem_prefix_cache_queries_total")).await;
    let hits = value(&prom, &d("tandem_prefix_cache_hits_total")).await;
    assert!(
        queries >= prompt_tokens - 1.0 && hits <= queries,
        "{queries} {hits}"
    );

    // The prefill worker counts its own: one finished request per remote prefill, the prompt
    // tokens it computed, and a first token each.
    expect(
        &prom,
        &format!("sum({})", p("tandem_request_success_total")),
        remote,
    )
    .await;
    expect(
        &prom,
        &p("tandem_time_to_first_token_seconds_count"),
        remote,
    )
    .await;
    expect(&prom, &p("tandem_generation_tokens_total"), remote).await;
    // Tandem's own families carry the same labels: the KV transfers the decode worker took in,
    // one duration each and no failure, and the prefill worker's calls.
    expect(
        &prom,
        &d("tandem_kv_transfer_duration_seconds_count"),
        remote,
    )
    .await;
    let kv_secs = value(&prom, &d("tandem_kv_transfer_duration_seconds_sum")).await;
    assert!(kv_secs > 0.0, "{kv_secs}");
    expect(
        &prom,
        &format!("sum({})", d("tandem_kv_transfer_failures_total")),
        0.0,
    )
    .await;
    expect(
        &prom,
        &format!("count({})", d("tandem_kv_transfer_failures_total")),
        4.0,
    )
    .await;
    expect(
        &prom,
        &format!(
            "tandem_prefill_requests_total{{role=\"prefill\",model_name=\"{model}\",result=\"ok\"}}"
        ),
        remote,
    )
    .await;
    // The router: every request answered, labelled like the workers.
    expect(
        &prom,
        &format!(
            "tandem_router_requests_total{{role=\"router\",model_name=\"{model}\",outcome=\"ok\"}}"
        ),
        requests,
    )
    .await;
    expect(
        &prom,
        "tandem_prefill_requests_total{job=\"router\",mode=\"remote\"}",
        remote,
    )
    .await;

    // Every metric the Grafana dashboard charts is one some role of this cluster exports (a
    // router with tenants exports theirs: one without has no tenant to show).
    let tenants = tempfile::tempdir().unwrap();
    let file = tenants.path().join("tenants.yaml");
    std::fs::write(&file, "tenants: [{name: a, keys: [key-a]}]").unwrap();
    let tr = start_router(
        std::slice::from_ref(&daddr),
        &[&format!("--tenants={}", file.display())],
    );
    wait_ready(&tr, 1).await;
    let mut families = std::collections::HashSet::new();
    for addr in [
        r.http.clone(),
        tr.http.clone(),
        format!("http://{daddr}"),
        format!("http://{paddr}"),
    ] {
        let page = reqwest::get(format!("{addr}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                families.insert(rest.split_whitespace().next().unwrap().to_string());
            }
        }
    }
    let dashboard = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/tandem.json"),
    )
    .unwrap();
    let dashboard: Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let mut charted = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for (i, _) in expr.match_indices("tandem_") {
                let name: String = expr[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let base = ["_bucket", "_total"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix))
                    .unwrap_or(&name);
                assert!(
                    families.contains(base),
                    "the dashboard charts {name}, which no role exports"
                );
                charted += 1;
            }
        }
    }
    assert!(charted >= 20, "{charted}");

    // Now the latency triggers read served requests: a mean gap (ms) no longer than all the
    // requests took, a TTFT percentile above 0. (The families appeared with the first requests'
    // values, which a rate does not see: two more requests, now that they are scraped.)
    for p in ["Hello again", long.as_str()] {
        let (status, body) = post(
            &r.http,
            "/v1/completions",
            json!({"model": model, "prompt": p, "max_tokens": 4, "temperature": 0,
                   "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    expect(
        &prom,
        &d("tandem_e2e_request_latency_seconds_count"),
        requests + 2.0,
    )
    .await;
    let e2e = value(&prom, &d("tandem_e2e_request_latency_seconds_sum")).await;
    for (q, threshold) in &scalers {
        let v = wait_for(&prom, q, "above 0", |v| v > 0.0).await;
        assert!(
            v.is_finite() && v <= 1000.0 * e2e,
            "{q}: {v} ms, e2e sum {e2e} s"
        );
        assert!(threshold.parse::<f64>().unwrap() > 0.0, "{q}: {threshold}");
    }
}
