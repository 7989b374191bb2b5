//! End to end: what a hostile or careless client sends must not take a process down or stall
//! others. Real `tandem router` and `tandem decode` processes on loopback; each case checks the
//! answer the client gets and that the processes it reached are the same processes after it.

use crate::common;

use common::*;
use serde_json::{json, Value};
use tandem_proto::v1 as api;
use tandem_proto::worker as wpb;

/// Lark rules `r0` .. `r{n}`, each naming the next: flat text, a deep recursion to compile.
fn lark_chain(n: usize) -> String {
    let mut s = String::from("start: r0\n");
    for i in 0..n {
        s += &format!("r{i}: r{}\n", i + 1);
    }
    s + &format!("r{n}: \"x\"\n")
}

/// A schema whose definitions `d0` .. `d{n}` each `$ref` the next.
fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert(format!("d{n}"), json!({"type": "integer"}));
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

/// Peak resident memory of `pid` so far, in MiB (`VmHWM`).
fn peak_rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// A router over one decode worker, both ready.
async fn one_worker() -> (Proc, String, Router) {
    let (worker, waddr) = start_worker(&[]);
    let r = start_router(std::slice::from_ref(&waddr), &[]);
    wait_ready(&r, 1).await;
    (worker, waddr, r)
}

/// Posts `body` to `path` and reads the whole (streamed) answer as text.
async fn post_text(http: &str, path: &str, body: &Value) -> String {
    reqwest::Client::new()
        .post(format!("{http}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chained_grammars_are_refused_and_every_process_lives() {
    let (worker, waddr, r) = one_worker().await;
    let http = r.http.as_str();
    let (router_pid, worker_pid) = (r.proc.pid(), worker.pid());
    let schema = ref_chain(800);
    let lark = lark_chain(800);
    let prompt = json!([{"role": "user", "content": "A number, please."}]);

    // Over HTTP, each way a grammar comes in: 400 naming the limit.
    let bodies = [
        json!({"messages": prompt, "max_tokens": 4, "guided_json": schema}),
        json!({"messages": prompt, "max_tokens": 4, "response_format":
               {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}),
        json!({"messages": prompt, "max_tokens": 4, "guided_grammar": lark}),
    ];
    for body in bodies {
        let (s, v) = post(http, "/v1/chat/completions", body).await;
        assert_eq!(s, 400, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("levels deep, over the limit of 512"), "{m}");
    }
    let (s, v) = post(
        http,
        "/v1/completions",
        json!({"prompt": "n =", "max_tokens": 4, "guided_grammar": lark}),
    )
    .await;
    assert_eq!(s, 400, "{v}");

    // Over the router's gRPC API.
    let mut g = api::generation_client::GenerationClient::connect(r.grpc.clone())
        .await
        .unwrap();
    let req = |kind: api::output_format::Kind| api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text("n =".into())),
        sampling: Some(api::SamplingParams {
            format: Some(api::OutputFormat { kind: Some(kind) }),
            ..Default::default()
        }),
        stopping: Some(api::StoppingCriteria {
            max_tokens: Some(4),
            ..Default::default()
        }),
        ..Default::default()
    };
    for kind in [
        api::output_format::Kind::Lark(lark.clone()),
        api::output_format::Kind::JsonSchema(schema.to_string()),
    ] {
        let e = g.generate(req(kind)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("levels deep"), "{e:?}");
    }

    // Straight to the decode worker, past the router: the worker compiles it itself.
    let mut d = wpb::decode_client::DecodeClient::connect(format!("http://{waddr}"))
        .await
        .unwrap();
    for kind in [
        wpb::grammar::Kind::Lark(lark.clone()),
        wpb::grammar::Kind::JsonSchema(schema.to_string()),
    ] {
        let req = wpb::DecodeRequest {
            request_id: "hostile".into(),
            prompt_ids: vec![1, 2, 3],
            sampling: Some(wpb::Sampling {
                grammar: Some(wpb::Grammar { kind: Some(kind) }),
                ..Default::default()
            }),
            stopping: Some(wpb::Stopping {
                max_tokens: 4,
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = match d.generate(authed(req)).await {
            Err(e) => e,
            Ok(s) => {
                let mut s = s.into_inner();
                loop {
                    match s.message().await {
                        Err(e) => break e,
                        Ok(Some(_)) => continue,
                        Ok(None) => panic!("the worker ran a grammar over the depth limit"),
                    }
                }
            }
        };
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }

    // The same processes serve a grammar within the limits.
    assert!(alive(router_pid) && alive(worker_pid));
    let (s, v) = post(
        http,
        "/v1/chat/completions",
        json!({"messages": prompt, "max_tokens": 8, "temperature": 0,
               "guided_json": ref_chain(20)}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(text).is_ok_and(|n| n.is_i64()),
        "{text:?}"
    );
    assert_eq!((r.proc.pid(), worker.pid()), (router_pid, worker_pid));
    assert!(alive(router_pid) && alive(worker_pid));
    eprintln!(
        "peak RSS: router {:.0} MiB, decode worker {:.0} MiB",
        peak_rss_mib(router_pid),
        peak_rss_mib(worker_pid)
    );
}

/// A Lark grammar the parser's item limit ends within fifty `a`s, mid-generation.
/// A streamed completion that failed: its error event (the last before `[DONE]`) and the text
/// of the chunks before it, none of which carries a finish reason (nothing finished).
fn text_then_error(text: &str) -> (Value, String) {
    let events = sse_events(text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let mut parsed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let error = parsed.pop().expect("an error event");
    let streamed = parsed
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap().iter())
        .map(|c| {
            assert!(c["finish_reason"].is_null(), "{c}");
            c["text"].as_str().unwrap_or("").to_string()
        })
        .collect();
    (error, streamed)
}

fn items_bomb() -> String {
    include_str!("../../grammar/tests/data/items_bomb.lark").into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_that_fails_mid_generation_ends_the_request_with_its_error() {
    let (_worker, waddr, r) = one_worker().await;
    let http = r.http.as_str();
    // The grammar may end after any `a`: the model is kept from ending it there.
    let eos = tandem_model::load_text(&model_path())
        .unwrap()
        .tokenizer
        .eos_token_ids;
    let bias: serde_json::Map<String, Value> =
        eos.iter().map(|e| (e.to_string(), json!(-100))).collect();
    let body = |stream: bool| {
        json!({"prompt": "a", "max_tokens": 300, "temperature": 0, "logit_bias": bias,
               "guided_grammar": items_bomb(), "stream": stream})
    };

    // Whole: the client's error, no text.
    let (s, v) = post(http, "/v1/completions", body(false)).await;
    assert_eq!(s, 400, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("grammar") && m.contains("max is 2000"), "{m}");
    // The reason, not the parser's state or the grammar sent back.
    assert!(m.len() < 400 && !m.contains("<non-verbose"), "{m}");

    // Streamed: the text that was in the grammar, then the error as an event and the end; no
    // finish reason, as nothing finished.
    let text = post_text(http, "/v1/completions", &body(true)).await;
    let (error, streamed) = text_then_error(&text);
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max is 2000")),
        "{error}"
    );
    assert!(
        streamed.len() >= 10 && streamed.chars().all(|c| c == 'a'),
        "{streamed:?}"
    );

    // gRPC: the stream ends with the error's status.
    let mut g = api::generation_client::GenerationClient::connect(r.grpc.clone())
        .await
        .unwrap();
    let req = api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text("a".into())),
        sampling: Some(api::SamplingParams {
            temperature: Some(0.0),
            logit_bias: eos.iter().map(|&e| (e, -100.0)).collect(),
            format: Some(api::OutputFormat {
                kind: Some(api::output_format::Kind::Lark(items_bomb())),
            }),
            ..Default::default()
        }),
        stopping: Some(api::StoppingCriteria {
            max_tokens: Some(300),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut s = g.generate(req).await.unwrap().into_inner();
    let e = loop {
        match s.message().await {
            Ok(Some(m)) => assert_eq!(m.finish_reason, 0, "{m:?}"),
            Ok(None) => panic!("the stream ended without the grammar's error"),
            Err(e) => break e,
        }
    };
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("max is 2000"), "{e:?}");
    // Nothing is left on the worker.
    wait_idle(&waddr).await;
}

/// A panic on a worker's engine thread (a bug; here the test hook's, in the engine's fourth
/// step) fails the requests that engine held with the panic's message, and they are not moved to
/// another worker (if the request set the panic off, it would take that worker down too); the
/// worker leaves the cluster and exits non-zero, for its supervisor to start a new one (`tandem
/// up` does: `cluster::up_restarts_a_crashed_worker_and_stops_cleanly`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_engine_fails_its_requests_and_its_worker_stops() {
    // Both workers would panic in their fourth step: a request moved to the other one would
    // take it down as well.
    let hook = [("TANDEM_TEST_PANIC_AT_STEP", "4")];
    let (a, a_addr, _) = Launch::decode().env(&hook).spawn_decode();
    let (b, b_addr, _) = Launch::decode().env(&hook).spawn_decode();
    let r = start_router(&[a_addr, b_addr], &[]);
    wait_ready(&r, 2).await;
    let http = r.http.as_str();
    // Step 1 prefills and samples, steps 2 and 3 decode: three tokens, then the panic.
    let text = post_text(
        http,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
                "stream": true}),
    )
    .await;
    let (error, streamed) = text_then_error(&text);
    let m = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        m.contains("the engine failed") && m.contains("engine step 4"),
        "{error}"
    );
    assert!(!streamed.is_empty(), "{text}");
    // The worker that held it stops by itself, with a failure; the other was never reached.
    let (mut failed, mut other) = (a, b);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Ok(Some(s)) = failed.child.try_wait() {
            break s;
        }
        if let Ok(Some(s)) = other.child.try_wait() {
            std::mem::swap(&mut failed, &mut other);
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no worker stopped after its engine failed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(!status.success(), "{status:?}");
    // The router lives on and serves the next request on the other worker (two steps, under
    // its hook's fourth).
    let (s, v) = post(
        http,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    assert!(alive(other.pid()) && alive(r.proc.pid()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompts_are_refused_unread_and_others_keep_moving() {
    let (worker, _waddr, r) = one_worker().await;
    let http = r.http.clone();
    let c = reqwest::Client::new();
    // A stream that runs through all of it, to its exact end.
    let streaming = {
        let http = http.clone();
        tokio::spawn(async move {
            let body = json!({"prompt": "The capital of France is", "max_tokens": 48,
                              "temperature": 0, "ignore_eos": true, "stream": true});
            read_stream(&post_text(&http, "/v1/completions", &body).await)
        })
    };
    // Two 30 MB prompts (under the 32 MiB body limit), a text and a chat message: refused by
    // their length alone, before any tokenizer sees them.
    let huge = "lorem ipsum ".repeat(2_500_000);
    let sent = std::time::Instant::now();
    let (a, b) = tokio::join!(
        post(
            &http,
            "/v1/completions",
            json!({"prompt": huge, "max_tokens": 1})
        ),
        post(
            &http,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 1})
        ),
    );
    for (s, v) in [a, b] {
        assert_eq!(s, 400, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("30000") && m.contains("bytes"), "{m}");
    }
    eprintln!("two 30 MB prompts refused in {:?}", sent.elapsed());
    // Prompts the byte check lets through but the context cannot hold are tokenized off the
    // async threads, and the router keeps answering meanwhile.
    let long = (0..60_000).map(|i| format!("w{i} ")).collect::<String>();
    let longs: Vec<_> = (0..4)
        .map(|_| {
            let (c, http, long) = (c.clone(), http.clone(), long.clone());
            tokio::spawn(async move {
                let v: Value = c
                    .post(format!("{http}/v1/completions"))
                    .json(&json!({"prompt": long, "max_tokens": 1}))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                v
            })
        })
        .collect();
    let asked = std::time::Instant::now();
    let health = c.get(format!("{http}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    eprintln!(
        "/health answered in {:?} with four long prompts in flight",
        asked.elapsed()
    );
    for l in longs {
        let v = l.await.unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    }
    let (text, finish, _) = streaming.await.unwrap();
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(!text.is_empty());
    let (router_mib, worker_mib) = (peak_rss_mib(r.proc.pid()), peak_rss_mib(worker.pid()));
    eprintln!("peak RSS: router {router_mib:.0} MiB, decode worker {worker_mib:.0} MiB");
    // Two 30 MB bodies are read whole (that is the body limit's job to bound); nothing more
    // may be made of them (tokenizing them took the router past 5 GB).
    assert!(router_mib < 1024.0, "router peak {router_mib:.0} MiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_plane_needs_the_cluster_s_credential() {
    let (_decode, daddr, _kv) = start_decode(&[]);
    let (_prefill, paddr) = start_prefill(&[]);
    // The router has the cluster's secret (every process the tests start does): it serves.
    let r = start_router(std::slice::from_ref(&daddr), &[]);
    wait_ready(&r, 1).await;
    let (s, v) = post(
        &r.http,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{v}");

    // A call with no credential, and one with another cluster's.
    fn without<T>(m: T) -> tonic::Request<T> {
        tonic::Request::new(m)
    }
    fn with_forged<T>(m: T) -> tonic::Request<T> {
        let other = tandem_kv_transfer::Secret::new(b"not-this-cluster-secret".to_vec()).unwrap();
        let mut r = tonic::Request::new(m);
        tandem_worker::WorkerToken::from_secret(&other).attach(&mut r);
        r
    }
    let refused = |e: tonic::Status| {
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    };
    for addr in [&daddr, &paddr] {
        let mut c =
            wpb::worker_control_client::WorkerControlClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
        refused(c.load(without(wpb::LoadRequest {})).await.unwrap_err());
        refused(c.info(with_forged(wpb::InfoRequest {})).await.unwrap_err());
        refused(
            c.kv_events(without(wpb::KvEventsRequest {}))
                .await
                .unwrap_err(),
        );
        assert!(c.load(authed(wpb::LoadRequest {})).await.is_ok());
        // Probes stay open.
        assert_eq!(
            grpc_health(&format!("http://{addr}"), "").await,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        // /deregister, even from loopback, needs it too.
        let resp = reqwest::Client::new()
            .post(format!("http://{addr}/deregister"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
    }
    // Decode straight to the worker, past the router's API keys: refused.
    let req = || wpb::DecodeRequest {
        request_id: "direct".into(),
        prompt_ids: vec![1, 2, 3],
        sampling: Some(wpb::Sampling::default()),
        stopping: Some(wpb::Stopping {
            max_tokens: 2,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut d = wpb::decode_client::DecodeClient::connect(format!("http://{daddr}"))
        .await
        .unwrap();
    refused(d.generate(without(req())).await.unwrap_err());
    refused(d.generate(with_forged(req())).await.unwrap_err());
    // Prefill, which would open a KV handshake on the caller's behalf: refused.
    let mut p = wpb::prefill_client::PrefillClient::connect(format!("http://{paddr}"))
        .await
        .unwrap();
    let prefill = wpb::PrefillRequest {
        request_id: "relay".into(),
        prompt_ids: vec![1, 2, 3],
        destination: Some(wpb::KvDestination {
            endpoint: "127.0.0.1:9".into(),
            transfer_id: 1,
            block_ids: vec![0],
        }),
        ..Default::default()
    };
    refused(p.prefill(without(prefill)).await.unwrap_err());
    // With the credential, the worker answers.
    let mut s = d.generate(authed(req())).await.unwrap().into_inner();
    let mut tokens = 0;
    while let Some(m) = s.message().await.unwrap() {
        tokens += m.tokens.len();
    }
    assert_eq!(tokens, 2);
}
