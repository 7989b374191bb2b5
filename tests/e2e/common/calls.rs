//! Calls to a running cluster and waits on it: the router's HTTP API and state, the workers'
//! WorkerControl calls with the cluster's credential, gRPC health, SSE bodies.

use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_proto::worker as wpb;

use super::{Router, KV_SECRET};

/// Waits until the router sees `workers` decode workers and all its prefill workers ready.
pub async fn wait_ready(r: &Router, workers: usize) {
    let c = reqwest::Client::new();
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(resp) = c.get(format!("{}/ready", r.http)).send().await {
            if let Ok(v) = resp.json::<Value>().await {
                // Every prefill worker too: one still unprobed would make the first
                // requests prefill locally.
                let prefill_ready = v["prefill_workers"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().all(|p| p["ready"] == true));
                if v["ready_workers"] == workers && prefill_ready {
                    return;
                }
            }
        }
        assert!(
            Instant::now() < end,
            "router not ready with {workers} workers"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The router's `/ready` body (what it knows about each worker).
pub async fn router_state(http: &str) -> Value {
    reqwest::get(format!("{http}/ready"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls `ok` every 20 ms until it holds; the bound (300 s) only catches a cluster that never
/// gets there.
pub async fn until<F, Fut>(what: &str, ok: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + Duration::from_secs(300);
    while !ok().await {
        assert!(Instant::now() < end, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The address of the one decode worker that holds a request in flight, by the router's view.
pub async fn worker_holding_the_stream(http: &str) -> String {
    router_state(http).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["in_flight"] == 1)
        .expect("one worker holds the stream")["addr"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Waits until the router's KV index holds at least `blocks` blocks for some worker.
pub async fn wait_router_cached(r: &Router, blocks: u64) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let v = router_state(&r.http).await;
        let most = v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|w| w["cached_blocks"].as_u64())
            .max()
            .unwrap_or(0);
        if most >= blocks {
            return;
        }
        assert!(
            Instant::now() < end,
            "router index never reached {blocks} blocks: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The gRPC health status of `service` ("" for the server) at `url` (`http://host:port`).
pub async fn grpc_health(url: &str, service: &str) -> i32 {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

/// `message` as a call to a worker, with the test cluster's credential (derived from
/// [`KV_SECRET`], which every process the tests start has).
pub fn authed<T>(message: T) -> tonic::Request<T> {
    authed_by(KV_SECRET, message)
}

/// `message` as a call to a worker of the cluster whose secret is `secret`.
pub fn authed_by<T>(secret: &str, message: T) -> tonic::Request<T> {
    let mut call = tonic::Request::new(message);
    worker_token(secret).attach(&mut call);
    call
}

/// The worker plane's credential of the cluster whose secret is `secret`.
pub fn worker_token(secret: &str) -> tandem_worker::WorkerToken {
    let secret = tandem_kv_transfer::Secret::new(secret.as_bytes().to_vec()).unwrap();
    tandem_worker::WorkerToken::from_secret(&secret)
}

pub async fn worker_load(addr: &str) -> wpb::LoadReport {
    worker_load_by(addr, KV_SECRET).await
}

/// [`worker_load`] for a worker of the cluster whose secret is `secret`.
pub async fn worker_load_by(addr: &str, secret: &str) -> wpb::LoadReport {
    let mut c = wpb::worker_control_client::WorkerControlClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to worker");
    c.load(authed_by(secret, wpb::LoadRequest {}))
        .await
        .unwrap()
        .into_inner()
}

/// Waits until the worker holds no request and no referenced block.
pub async fn wait_idle(addr: &str) -> wpb::LoadReport {
    // Idle comes within milliseconds of the last answer; the bound only ends a test whose worker
    // leaked, and is wide so that a machine running many tests at once never trips it.
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let l = worker_load(addr).await;
        if l.running == 0 && l.waiting == 0 && l.blocks_used == 0 && l.in_flight == 0 {
            return l;
        }
        assert!(Instant::now() < end, "worker did not return to idle: {l:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `data:` payloads of an SSE body.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                .map(|s| s.to_string())
        })
        .collect()
}

/// Text, finish reason and usage of a streamed completion or chat completion.
pub fn read_stream(body: &str) -> (String, Option<String>, Option<Value>) {
    let events = sse_events(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|_| panic!("bad event {e}"));
        assert!(v.get("error").is_none(), "{v}");
        if !v["usage"].is_null() {
            usage = Some(v["usage"].clone());
        }
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["text"].as_str() {
                text += t;
            }
            if let Some(t) = c["delta"]["content"].as_str() {
                text += t;
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish, usage)
}

pub async fn post(http: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{http}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// [`post`] that must answer 200: the body.
pub async fn post_ok(http: &str, path: &str, body: Value) -> Value {
    let (status, v) = post(http, path, body).await;
    assert_eq!(status, 200, "{path}: {v}");
    v
}

/// The router's `GET /v1/models` answer (`data[0]` is the served model).
pub async fn models(http: &str) -> Value {
    reqwest::get(format!("{http}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Greedy generation of `ids` through the router's gRPC API: token ids and usage.
pub async fn generate_ids(
    grpc: &str,
    ids: &[u32],
    max_tokens: u32,
) -> (Vec<u32>, tandem_proto::v1::Usage) {
    let mut c = tandem_proto::v1::generation_client::GenerationClient::connect(grpc.to_string())
        .await
        .unwrap();
    let req = tandem_proto::v1::GenerateRequest {
        prompt: Some(tandem_proto::v1::generate_request::Prompt::TokenIds(
            tandem_proto::v1::TokenIds { ids: ids.to_vec() },
        )),
        sampling: Some(tandem_proto::v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(tandem_proto::v1::StoppingCriteria {
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut s = c.generate(req).await.unwrap().into_inner();
    let mut out = Vec::new();
    let mut usage = None;
    while let Some(m) = s.message().await.unwrap() {
        out.extend(m.token_ids);
        if m.usage.is_some() {
            usage = m.usage;
        }
    }
    (out, usage.expect("usage on the last message"))
}

/// `len` token ids of the default model, a prompt of their own for each `seed` (none of them
/// shares a block with another seed's).
pub fn id_prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|t| 1000 + (t * 7919 + seed * 104_729 + t * t) % 30_000)
        .collect()
}

/// The greedy completion of 8 tokens after token ids `ids`, through the router.
pub async fn complete_ids(r: &Router, ids: &[u32]) -> String {
    let model = models(&r.http).await["data"][0]["id"].clone();
    let (s, v) = post(
        &r.http,
        "/v1/completions",
        serde_json::json!({"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
               "ignore_eos": true}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Waits until the router's view of every worker has a measured prefill rate.
pub async fn wait_prefill_rates(r: &Router) {
    until("the router knows every worker's prefill rate", || async {
        let v = router_state(&r.http).await;
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["prefill_tokens_per_s"].as_f64().unwrap_or(0.0) > 0.0)
    })
    .await;
}
