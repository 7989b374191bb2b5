//! OpenTelemetry traces across every role: an OTLP/gRPC receiver (tests/otlp_sink.py on PyPI's
//! `grpcio` and `opentelemetry-proto`, installed by scripts/test) gets the spans of a
//! disaggregated cluster's requests. A request sent with a known `traceparent` (an HTTP header,
//! or gRPC metadata) yields one tree under the client's span across the router, the decode worker
//! and the prefill worker, with the KV transfer under the prefill and its receipt on the decode
//! worker under the transfer (its context travelled over the KV wire); an invalid `traceparent`
//! starts a new trace and the request is served.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tandem_proto::v1 as api;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const GRPC_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const GRPC_CLIENT_SPAN: &str = "b7ad6b7169203331";

/// The OTLP receiver on a free loopback port: its process, endpoint URL and output file.
fn otlp_sink(dir: &Path) -> (Proc, String, PathBuf) {
    let port = free_port();
    let out = dir.join("spans.jsonl");
    let p = python_server(
        "otlp_sink.py",
        &[port.to_string(), out.display().to_string()],
    );
    (p, format!("http://127.0.0.1:{port}"), out)
}

fn read_spans(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The spans of `trace` once `done` says they are all there. The bound only catches an exporter
/// that never delivers: the cluster has already answered, and spans leave every 100 ms.
async fn spans_of(path: &Path, trace: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let spans: Vec<Value> = read_spans(path)
            .into_iter()
            .filter(|s| s["trace_id"] == trace)
            .collect();
        if done(&spans) {
            return spans;
        }
        assert!(
            Instant::now() < end,
            "trace {trace} incomplete: {}",
            serde_json::to_string_pretty(&spans).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn named<'a>(spans: &'a [Value], service: &str, name: &str) -> Vec<&'a Value> {
    spans
        .iter()
        .filter(|s| s["service"] == service && s["name"] == name)
        .collect()
}

fn one<'a>(spans: &'a [Value], service: &str, name: &str) -> &'a Value {
    let found = named(spans, service, name);
    assert_eq!(
        found.len(),
        1,
        "{service} {name}: {}",
        serde_json::to_string_pretty(spans).unwrap()
    );
    found[0]
}

fn has(spans: &[Value], service: &str, name: &str) -> bool {
    !named(spans, service, name).is_empty()
}

/// Every span's parent is `root_parent` or another span of the set: one tree.
fn assert_one_tree(spans: &[Value], root_parent: &str) {
    let ids: HashMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap(), s))
        .collect();
    let roots: Vec<&Value> = spans
        .iter()
        .filter(|s| s["parent_span_id"] == root_parent)
        .collect();
    assert_eq!(roots.len(), 1, "one span under the client's: {roots:?}");
    for s in spans {
        let parent = s["parent_span_id"].as_str().unwrap();
        assert!(
            parent == root_parent || ids.contains_key(parent),
            "span {} ({}) hangs from {parent}, which is not in the trace",
            s["name"],
            s["service"]
        );
    }
}

fn parent_of<'a>(spans: &'a [Value], s: &Value) -> &'a Value {
    spans
        .iter()
        .find(|p| p["span_id"] == s["parent_span_id"])
        .unwrap_or_else(|| panic!("no parent for {s}"))
}

fn attr(s: &Value, key: &str) -> Value {
    s["attributes"][key].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_router_decode_and_prefill_with_the_kv_transfer_under_the_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let (_sink, endpoint, out) = otlp_sink(dir.path());
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let (_p, paddr) = Launch::prefill().env(&env).spawn_prefill();
    // The decode worker speculates (every proposal verified): its decode span says how much.
    let (_d, daddr, _kv) = Launch::decode()
        .args(&["--speculative=ngram", "--speculative-fixed"])
        .env(&env)
        .spawn_decode();
    let r = Launch::router(std::slice::from_ref(&daddr))
        .args(&[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=64",
        ])
        .env(&env)
        .spawn_router();
    wait_ready(&r, 1).await;
    let model = router_state(&r.http).await["model"]
        .as_str()
        .unwrap()
        .to_string();

    // A long prompt, so it is prefilled on the prefill worker; the client's span is the parent.
    let long = "The history of the city is long and full of events. ".repeat(12);
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", r.http))
        .header("traceparent", format!("00-{TRACE}-{CLIENT_SPAN}-01"))
        .json(
            &json!({"model": model, "prompt": long, "max_tokens": 5, "temperature": 0,
                      "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 5);
    let prompt_tokens = body["usage"]["prompt_tokens"].as_i64().unwrap();

    let spans = spans_of(&out, TRACE, |s| {
        has(s, "tandem-router", "POST /v1/completions")
            && has(s, "tandem-decode", "tandem.worker.v1.Decode/Generate")
            && has(s, "tandem-decode", "decode")
            && has(s, "tandem-decode", "kv_receive")
            && has(s, "tandem-prefill", "tandem.worker.v1.Prefill/Prefill")
            && has(s, "tandem-prefill", "kv_transfer")
            && has(s, "tandem-prefill", "queue")
    })
    .await;
    assert_one_tree(&spans, CLIENT_SPAN);

    // The router: the request under the client's span, the routing decision under it, the
    // decode worker's request under the routing decision.
    let http = one(&spans, "tandem-router", "POST /v1/completions");
    assert_eq!(http["parent_span_id"], CLIENT_SPAN);
    assert_eq!(http["kind"], 2, "a server span");
    assert_eq!(attr(http, "gen_ai.request.model"), json!(model));
    assert_eq!(
        attr(http, "gen_ai.usage.input_tokens"),
        json!(prompt_tokens)
    );
    assert_eq!(attr(http, "gen_ai.usage.output_tokens"), json!(5));
    assert_eq!(
        attr(http, "gen_ai.response.finish_reasons"),
        json!("length")
    );
    let route = one(&spans, "tandem-router", "route");
    assert_eq!(parent_of(&spans, route)["span_id"], http["span_id"]);
    assert_eq!(attr(route, "tandem.route.worker"), json!(daddr));
    assert_eq!(attr(route, "tandem.route.prefill"), json!("remote"));
    assert!(attr(route, "tandem.route.policy").is_string());

    let decode = one(&spans, "tandem-decode", "tandem.worker.v1.Decode/Generate");
    assert_eq!(parent_of(&spans, decode)["span_id"], route["span_id"]);
    assert_eq!(attr(decode, "gen_ai.usage.output_tokens"), json!(5));
    let remote = one(&spans, "tandem-decode", "remote_prefill");
    assert_eq!(parent_of(&spans, remote)["span_id"], decode["span_id"]);
    assert_eq!(attr(remote, "tandem.prefill.result"), json!("remote"));
    let attempt = one(&spans, "tandem-decode", "tandem.worker.v1.Prefill/Prefill");
    assert_eq!(parent_of(&spans, attempt)["span_id"], remote["span_id"]);
    assert_eq!(attempt["kind"], 3, "a client span");
    assert_eq!(attr(attempt, "tandem.prefill.result"), json!("ok"));
    let decoding = one(&spans, "tandem-decode", "decode");
    assert_eq!(parent_of(&spans, decoding)["span_id"], decode["span_id"]);
    assert_eq!(attr(decoding, "gen_ai.usage.output_tokens"), json!(5));
    // The repeated sentence is proposed after the first token: each step up to the tokens
    // left less the one it samples (at most the proposal length, 3 then fewer: 6 in all at
    // most), some or none accepted.
    let drafted = attr(decoding, "tandem.spec_decode.draft_tokens")
        .as_i64()
        .unwrap();
    let accepted = attr(decoding, "tandem.spec_decode.accepted_tokens")
        .as_i64()
        .unwrap();
    assert!(
        (1..=6).contains(&drafted) && accepted <= drafted,
        "{decoding}"
    );

    // The prefill worker: its request under the decode worker's attempt, the prefill under it,
    // the KV transfer under the prefill, and the decode worker's receipt under the transfer.
    let pserver = one(&spans, "tandem-prefill", "tandem.worker.v1.Prefill/Prefill");
    assert_eq!(parent_of(&spans, pserver)["span_id"], attempt["span_id"]);
    let prefill = one(&spans, "tandem-prefill", "prefill");
    assert_eq!(parent_of(&spans, prefill)["span_id"], pserver["span_id"]);
    let computed = attr(prefill, "tandem.prefill.computed_tokens")
        .as_i64()
        .unwrap();
    let cached = attr(prefill, "tandem.prefill.cached_tokens")
        .as_i64()
        .unwrap();
    assert_eq!(computed + cached, prompt_tokens);
    assert!(computed > 0);
    let kv = one(&spans, "tandem-prefill", "kv_transfer");
    assert_eq!(parent_of(&spans, kv)["span_id"], prefill["span_id"]);
    assert_eq!(attr(kv, "tandem.kv.result"), json!("ok"));
    let bytes = attr(kv, "tandem.kv.bytes").as_i64().unwrap();
    assert!(bytes > 0);
    let blocks = attr(kv, "tandem.kv.blocks").as_i64().unwrap();
    assert!(blocks > 0);
    let receive = one(&spans, "tandem-decode", "kv_receive");
    assert_eq!(parent_of(&spans, receive)["span_id"], kv["span_id"]);
    assert_eq!(attr(receive, "tandem.kv.bytes"), json!(bytes));
    assert_eq!(attr(receive, "tandem.kv.blocks"), json!(blocks));
    let queue = one(&spans, "tandem-prefill", "queue");
    assert_eq!(parent_of(&spans, queue)["span_id"], prefill["span_id"]);
    for s in &spans {
        let (a, b) = (
            s["start_ns"].as_u64().unwrap(),
            s["end_ns"].as_u64().unwrap(),
        );
        assert!(a > 0 && b >= a, "span {} runs backwards", s["name"]);
    }

    // gRPC: the client's context in the call's metadata is the parent; a short prompt is
    // prefilled on the decode worker, whose queue and prefill are spans of their own.
    let mut c = api::generation_client::GenerationClient::connect(r.grpc.clone())
        .await
        .unwrap();
    let mut call = tonic::Request::new(api::GenerateRequest {
        model: model.clone(),
        prompt: Some(api::generate_request::Prompt::Text("Hello there".into())),
        sampling: Some(api::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(api::StoppingCriteria {
            max_tokens: Some(3),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    });
    call.metadata_mut().insert(
        "traceparent",
        format!("00-{GRPC_TRACE}-{GRPC_CLIENT_SPAN}-01")
            .parse()
            .unwrap(),
    );
    let mut stream = c.generate(call).await.unwrap().into_inner();
    let mut tokens = 0;
    while let Some(m) = stream.message().await.unwrap() {
        tokens += m.token_ids.len();
    }
    assert_eq!(tokens, 3);
    let spans = spans_of(&out, GRPC_TRACE, |s| {
        has(s, "tandem-router", "tandem.v1.Generation/Generate")
            && has(s, "tandem-decode", "prefill")
            && has(s, "tandem-decode", "queue")
            && has(s, "tandem-decode", "decode")
    })
    .await;
    assert_one_tree(&spans, GRPC_CLIENT_SPAN);
    let g = one(&spans, "tandem-router", "tandem.v1.Generation/Generate");
    assert_eq!(g["parent_span_id"], GRPC_CLIENT_SPAN);
    assert_eq!(
        attr(
            one(&spans, "tandem-router", "route"),
            "tandem.route.prefill"
        ),
        json!("local")
    );
    assert!(!has(
        &spans,
        "tandem-prefill",
        "tandem.worker.v1.Prefill/Prefill"
    ));

    // An invalid traceparent: served, and traced as a new trace of its own.
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", r.http))
        .header("traceparent", "00-not-a-trace-01")
        .json(&json!({"model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    let id = body["id"]
        .as_str()
        .unwrap()
        .trim_start_matches("cmpl-")
        .to_string();
    let end = Instant::now() + Duration::from_secs(60);
    let root = loop {
        let found = read_spans(&out).into_iter().find(|s| {
            s["name"] == "POST /v1/completions" && attr(s, "tandem.request_id") == json!(id)
        });
        if let Some(s) = found {
            break s;
        }
        assert!(Instant::now() < end, "no span for request {id}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        root["parent_span_id"], "",
        "a new trace starts at the router"
    );
    assert_ne!(root["trace_id"], TRACE);
    let trace = root["trace_id"].as_str().unwrap().to_string();
    let spans = spans_of(&out, &trace, |s| {
        has(s, "tandem-decode", "tandem.worker.v1.Decode/Generate")
    })
    .await;
    assert_one_tree(&spans, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_is_a_span_and_the_new_workers_request_hangs_from_it() {
    use futures::StreamExt;
    const MIGRATED: &str = "5e1ec7ed0000000000000000000000a1";
    let dir = tempfile::tempdir().unwrap();
    let (_sink, endpoint, out) = otlp_sink(dir.path());
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let (d1, a1, _) = Launch::decode().env(&env).spawn_decode();
    let (d2, a2, _) = Launch::decode().env(&env).spawn_decode();
    let r = Launch::router(&[a1.clone(), a2.clone()])
        .env(&env)
        .spawn_router();
    wait_ready(&r, 2).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", r.http))
        .header("traceparent", format!("00-{MIGRATED}-{CLIENT_SPAN}-01"))
        .json(
            &json!({"prompt": "Write a long story about a lighthouse keeper.",
                      "max_tokens": 80, "temperature": 0, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut raw = String::new();
    let mut victim = None;
    while let Some(chunk) = stream.next().await {
        raw.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        if victim.is_none() && sse_events(&raw).len() >= 10 {
            let busy = worker_holding_the_stream(&r.http).await;
            let p = if busy == a1 { &d1 } else { &d2 };
            p.signal(libc::SIGKILL);
            victim = Some(busy);
        }
    }
    let victim = victim.expect("the stream outlived the point it was to be hit at");
    let survivor = if victim == a1 { &a2 } else { &a1 };
    let (_, finish, _) = read_stream(&raw);
    assert_eq!(finish.as_deref(), Some("length"));

    let spans = spans_of(&out, MIGRATED, |s| {
        has(s, "tandem-router", "migrate")
            && has(s, "tandem-router", "POST /v1/completions")
            && has(s, "tandem-decode", "tandem.worker.v1.Decode/Generate")
    })
    .await;
    // The killed worker's span never ended, so it was never sent; everything else is one tree.
    assert_one_tree(&spans, CLIENT_SPAN);
    let http = one(&spans, "tandem-router", "POST /v1/completions");
    assert_eq!(attr(http, "tandem.migrations"), json!(1));
    assert_eq!(attr(http, "gen_ai.usage.output_tokens"), json!(80));
    let migrate = one(&spans, "tandem-router", "migrate");
    assert_eq!(parent_of(&spans, migrate)["span_id"], http["span_id"]);
    assert_eq!(attr(migrate, "tandem.migrate.from"), json!(victim));
    assert_eq!(attr(migrate, "tandem.route.worker"), json!(survivor));
    let resumed = attr(migrate, "tandem.migrate.resumed_tokens")
        .as_i64()
        .unwrap();
    assert!((1..80).contains(&resumed), "{resumed}");
    let decode = one(&spans, "tandem-decode", "tandem.worker.v1.Decode/Generate");
    assert_eq!(parent_of(&spans, decode)["span_id"], migrate["span_id"]);
}
