//! End to end: the router's front door. API keys on HTTP and gRPC, TLS with the official OpenAI
//! Python client, request body and header limits, and clients that stall (a head never finished,
//! a body that stops, a stream never read) against real `tandem router` and `tandem decode`
//! processes on loopback.

use crate::common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tandem_proto::v1 as api;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A test CA and a certificate for 127.0.0.1 and localhost signed by it, as PEM files.
struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    ca_pem: String,
}

fn pki() -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose,
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "tandem test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let mut leaf =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let leaf = leaf.signed_by(&leaf_key, &ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ca_path, cert, key) = (
        dir.path().join("ca.pem"),
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
    );
    std::fs::write(&ca_path, ca.pem()).unwrap();
    std::fs::write(&cert, leaf.pem()).unwrap();
    std::fs::write(&key, leaf_key.serialize_pem()).unwrap();
    Pki {
        _dir: dir,
        ca: ca_path,
        cert,
        key,
        ca_pem: ca.pem(),
    }
}

fn host(http: &str) -> &str {
    http.trim_start_matches("http://")
}

/// Sends `request` on a fresh connection and reads until the router closes it (or a minute
/// passes, which fails the test).
async fn raw(http: &str, request: &[u8]) -> String {
    let mut s = TcpStream::connect(host(http)).await.unwrap();
    s.write_all(request).await.unwrap();
    read_to_close(&mut s).await
}

async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        let mut buf = [0u8; 8192];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the router never closed the connection");
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads HTTP/2 frames until the router closes the connection (or a minute passes, which fails
/// the test), answering each PING with its acknowledgement; returns the frame types seen.
async fn answer_pings_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut kinds = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        let mut head = [0u8; 9];
        while s.read_exact(&mut head).await.is_ok() {
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            if s.read_exact(&mut payload).await.is_err() {
                break;
            }
            kinds.push(head[3]);
            if head[3] == 6 && head[4] & 1 == 0 {
                let mut ack = head;
                ack[4] = 1;
                let _ = s.write_all(&ack).await;
                let _ = s.write_all(&payload).await;
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the router never closed the idle HTTP/2 connection"
    );
    kinds
}

/// The status code of a raw HTTP/1.1 response.
fn status_of(response: &str) -> u16 {
    response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn body_of(response: &str) -> Value {
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or("");
    serde_json::from_str(body).unwrap_or(Value::Null)
}

async fn send(
    c: &reqwest::Client,
    http: &str,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = match body {
        Some(b) => c.post(format!("{http}{path}")).json(&b),
        None => c.get(format!("{http}{path}")),
    };
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.unwrap();
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn completion(max_tokens: u32) -> Value {
    json!({"prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_limits_and_stalled_clients() {
    let (_w, waddr) = start_worker(&[]);
    let r = start_router(
        std::slice::from_ref(&waddr),
        &[
            "--api-key=key-one,key-two",
            "--metrics-api-key=metrics-key",
            "--max-body-bytes=65536",
            "--header-timeout-ms=1000",
            "--body-stall-timeout-ms=1000",
            // One request at a time: a stalled client that held a slot would make the next
            // request a 503.
            "--max-queue=1",
        ],
    );
    // /ready is open with keys on.
    wait_ready(&r, 1).await;
    let c = reqwest::Client::new();
    let http = r.http.as_str();

    // Probes stay open.
    let (s, _, v) = send(&c, http, "/health", None, None).await;
    assert_eq!((s, v), (200, json!("ok")));
    // ... but names the workers' addresses only to a caller with a key.
    let (s, _, v) = send(&c, http, "/ready", None, None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["workers"][0]["ready"], true, "{v}");
    assert!(v["workers"][0].get("addr").is_none(), "{v}");
    let (_, _, v) = send(&c, http, "/ready", Some("key-two"), None).await;
    assert_eq!(v["workers"][0]["addr"], waddr.as_str(), "{v}");

    // The API needs one of the keys, as a Bearer token.
    let mut unauthorized = 0.0;
    for (path, key, body) in [
        ("/v1/completions", None, Some(completion(2))),
        ("/v1/completions", Some("key-three"), Some(completion(2))),
        ("/v1/models", None, None),
        ("/metrics", None, None),
        ("/metrics", Some("key-one"), None),
    ] {
        let (s, h, v) = send(&c, http, path, key, body).await;
        assert_eq!(s, 401, "{path} {key:?}: {v}");
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(h.get("www-authenticate").unwrap(), "Bearer");
        unauthorized += 1.0;
    }
    let (s, _, v) = send(&c, http, "/v1/models", Some("key-two"), None).await;
    assert_eq!(s, 200, "{v}");
    let model = v["data"][0]["id"].as_str().unwrap().to_string();
    let (s, _, v) = send(
        &c,
        http,
        "/v1/completions",
        Some("key-one"),
        Some(completion(4)),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let answer = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!answer.is_empty());

    // Anthropic's clients send the key bare, in x-api-key; a wrong one is refused in
    // Anthropic's shape.
    for (key, status) in [("key-two", 200), ("key-three", 401)] {
        let resp = c
            .post(format!("{http}/v1/messages"))
            .header("x-api-key", key)
            .json(&json!({"model": model, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "Hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status, "{key}");
        let v: Value = resp.json().await.unwrap();
        if status == 200 {
            assert_eq!(
                (v["type"].as_str(), v["usage"]["output_tokens"].as_u64()),
                (Some("message"), Some(2)),
                "{v}"
            );
        } else {
            assert_eq!(v["error"]["type"], "authentication_error", "{v}");
            unauthorized += 1.0;
        }
    }

    // gRPC: the same keys as `authorization` metadata; health needs none.
    {
        use api::generation_client::GenerationClient;
        let mut g = GenerationClient::connect(r.grpc.clone()).await.unwrap();
        let req = |key: Option<&str>| {
            let mut req = tonic::Request::new(api::GenerateRequest {
                model: model.clone(),
                prompt: Some(api::generate_request::Prompt::Text(
                    "The capital of France is".into(),
                )),
                sampling: Some(api::SamplingParams {
                    temperature: Some(0.0),
                    ..Default::default()
                }),
                stopping: Some(api::StoppingCriteria {
                    max_tokens: Some(4),
                    ignore_eos: true,
                    ..Default::default()
                }),
                ..Default::default()
            });
            if let Some(k) = key {
                req.metadata_mut()
                    .insert("authorization", format!("Bearer {k}").parse().unwrap());
            }
            req
        };
        for key in [None, Some("nope")] {
            let e = g.generate(req(key)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
            unauthorized += 1.0;
        }
        let mut s = g.generate(req(Some("key-two"))).await.unwrap().into_inner();
        let mut text = String::new();
        while let Some(m) = s.message().await.unwrap() {
            text += &m.text;
        }
        assert_eq!(
            text, answer,
            "gRPC and HTTP answer the same greedy request alike"
        );
        assert_eq!(grpc_health(&r.grpc, "").await, 1, "SERVING");
    }

    // Bodies over the limit: 413, whether Content-Length says so or a chunked body grows.
    let big = json!({"prompt": "x".repeat(70_000), "max_tokens": 1});
    let (s, _, v) = send(&c, http, "/v1/completions", Some("key-one"), Some(big)).await;
    assert_eq!(s, 413, "{v}");
    assert_eq!(v["error"]["code"], "request_too_large");
    let chunks = (0..10).map(|_| Ok::<_, std::io::Error>(vec![b' '; 8192]));
    let resp = c
        .post(format!("{http}/v1/completions"))
        .bearer_auth("key-one")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 413);

    // Header floods: too many headers, or one too large, get 431.
    let many: String = (0..200).map(|i| format!("x-h{i}: v\r\n")).collect();
    let resp = raw(
        http,
        format!("GET /health HTTP/1.1\r\nHost: t\r\n{many}\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status_of(&resp), 431, "{resp}");
    let huge = format!(
        "GET /health HTTP/1.1\r\nHost: t\r\nx-big: {}\r\n\r\n",
        "a".repeat(100_000)
    );
    assert_eq!(status_of(&raw(http, huge.as_bytes()).await), 431);
    assert_eq!(send(&c, http, "/health", None, None).await.0, 200);

    // A head never finished, and a connection that sends nothing: closed, holding nothing.
    let mut half_head = TcpStream::connect(host(http)).await.unwrap();
    half_head
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        .await
        .unwrap();
    let mut silent = TcpStream::connect(host(http)).await.unwrap();
    // An HTTP/2 client that sends its preface and settings, then no request.
    let mut h2_idle = TcpStream::connect(host(http)).await.unwrap();
    h2_idle
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    // A body that stops half way.
    let mut slow_body = TcpStream::connect(host(http)).await.unwrap();
    slow_body
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer key-one\r\n\
              Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ",
        )
        .await
        .unwrap();
    // Meanwhile the one queue slot is free for a client that sends its request.
    let (s, _, v) = send(
        &c,
        http,
        "/v1/completions",
        Some("key-two"),
        Some(completion(4)),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], answer.as_str());
    assert_eq!(read_to_close(&mut half_head).await, "");
    assert_eq!(read_to_close(&mut silent).await, "");
    // It answers every PING, as a live client does (the server's keep-alive alone would leave
    // it open): the router's settings come back, then the close.
    let frames = answer_pings_to_close(&mut h2_idle).await;
    assert!(frames.contains(&4), "the server's SETTINGS: {frames:?}");
    let resp = read_to_close(&mut slow_body).await;
    assert_eq!(status_of(&resp), 408, "{resp}");
    assert_eq!(body_of(&resp)["error"]["code"], "request_timeout");

    // A stream opened and never read: the request runs to its end on the worker, and its queue
    // slot and KV blocks come back; the next client is served.
    let mut unread = TcpStream::connect(host(http)).await.unwrap();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                      "ignore_eos": true, "stream": true})
    .to_string();
    unread
        .write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer key-one\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    // Its status line, to know it was admitted; nothing more is read.
    let mut head = [0u8; 12];
    unread.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let end = Instant::now() + Duration::from_secs(120);
    let mut queue_full = 0.0;
    loop {
        let (s, _, v) = send(
            &c,
            http,
            "/v1/completions",
            Some("key-one"),
            Some(completion(2)),
        )
        .await;
        if s == 200 {
            break;
        }
        assert_eq!(s, 503, "{v}");
        assert_eq!(v["error"]["code"], "overloaded", "{v}");
        queue_full += 1.0;
        assert!(
            Instant::now() < end,
            "the unread stream never gave its slot back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let load = wait_idle(&waddr).await;
    assert_eq!(load.running, 0);
    drop(unread);

    // Every refusal was counted, by reason.
    let m = parse_metrics(
        &c.get(format!("{http}/metrics"))
            .bearer_auth("metrics-key")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    let refused = |reason: &str| {
        metric(
            &m,
            &format!("tandem_router_refused_requests_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(refused("unauthorized"), unauthorized);
    assert_eq!(refused("body_too_large"), 2.0);
    assert_eq!(refused("body_timeout"), 1.0);
    assert_eq!(refused("queue_full"), queue_full);
    // What passed the front door, by how it ended: four completions, one message and one gRPC
    // generation answered, the 503s (overloaded) turned away.
    let outcome = |o: &str| {
        metric(
            &m,
            &format!("tandem_router_requests_total{{outcome=\"{o}\"}}"),
        )
    };
    assert_eq!(outcome("ok"), 6.0);
    assert_eq!(outcome("refused"), queue_full);
    assert_eq!(
        outcome("invalid") + outcome("failed") + outcome("cancelled"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_the_openai_client_and_grpc_with_keys() {
    let pki = pki();
    let (_w, waddr) = start_worker(&[]);
    let r = start_router(
        std::slice::from_ref(&waddr),
        &[
            "--api-key=tls-key",
            &format!("--tls-cert={}", pki.cert.display()),
            &format!("--tls-key={}", pki.key.display()),
        ],
    );
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    let grpc = r.grpc.replace("http://", "https://");
    let channel = tonic::transport::Channel::from_shared(grpc)
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut g = api::generation_client::GenerationClient::new(channel);
    let keyed = |key: &str| {
        let mut req = tonic::Request::new(api::ListModelsRequest {});
        req.metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
        req
    };
    let e = g.list_models(keyed("wrong")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let model = g
        .list_models(keyed("tls-key"))
        .await
        .unwrap()
        .into_inner()
        .models[0]
        .id
        .clone();

    // Ready once a greedy request over TLS is answered.
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let mut req = tonic::Request::new(api::GenerateRequest {
            model: model.clone(),
            prompt: Some(api::generate_request::Prompt::Text("Hi".into())),
            stopping: Some(api::StoppingCriteria {
                max_tokens: Some(1),
                ..Default::default()
            }),
            ..Default::default()
        });
        req.metadata_mut()
            .insert("authorization", "Bearer tls-key".parse().unwrap());
        match g.generate(req).await {
            Ok(s) => {
                let mut s = s.into_inner();
                while s.message().await.unwrap().is_some() {}
                break;
            }
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                assert!(Instant::now() < end, "no worker over TLS: {e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    // Plain HTTP to the TLS port gets no answer: the handshake fails and the socket closes.
    let plain = raw(&r.http, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert!(!plain.contains("200 OK"), "{plain}");

    // The official client over https, with the key: every golden case exact, and a wrong key
    // is its AuthenticationError.
    let tok = tandem_model::load_text(&model_path()).unwrap().tokenizer;
    let base = format!("https://{}/v1", host(&r.http));
    openai_python_client(
        &base,
        &model,
        &tok,
        &[
            "--api-key=tls-key".to_string(),
            format!("--ca-cert={}", pki.ca.display()),
        ],
    )
    .await;
    wait_idle(&waddr).await;
}

/// A body trickled just faster than the stall timeout still meets the whole-body deadline (408),
/// and the bodies arriving at once cannot hold more of the router than its in-flight budget: the
/// one that would pass it is a 503 at once, and the budget comes back when the others go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_many_bodies_are_bounded() {
    let (_w, waddr) = start_worker(&[]);
    // A whole-body deadline shorter than the stall timeout, which the trickle never meets.
    let r = start_router(
        std::slice::from_ref(&waddr),
        &["--body-stall-timeout-ms=5000", "--body-timeout-ms=1500"],
    );
    wait_ready(&r, 1).await;
    let s = TcpStream::connect(host(&r.http)).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    wr.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
          Content-Length: 1000\r\n\r\n",
    )
    .await
    .unwrap();
    // One byte every 200 ms until the router stops taking them (1000 bytes: 200 s).
    let trickle = tokio::spawn(async move {
        for _ in 0..1000 {
            if wr.write_all(b" ").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), rd.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the router never answered the trickled body");
    trickle.abort();
    let resp = String::from_utf8_lossy(&out).into_owned();
    assert_eq!(status_of(&resp), 408, "{resp}");
    let err = &body_of(&resp)["error"];
    assert_eq!(err["code"], "request_timeout", "{resp}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("did not arrive whole"),
        "{resp}"
    );

    // Bodies of 60 000 bytes under a budget of 128 KiB: two fit, a third does not.
    let r = start_router(
        std::slice::from_ref(&waddr),
        &[
            "--max-body-bytes=65536",
            "--max-body-bytes-in-flight=131072",
            "--body-stall-timeout-ms=120000",
            "--body-timeout-ms=120000",
        ],
    );
    wait_ready(&r, 1).await;
    let http = r.http.as_str();
    let head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
                 Content-Length: 60000\r\n\r\n";
    // Three bodies, head and a first byte each: two fill the budget, so exactly one of the
    // three is refused before a byte more of it is read, whichever reached the budget last (the
    // router takes connections concurrently, so not necessarily the last one sent).
    let mut conns = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(host(http)).await.unwrap();
        s.write_all(head).await.unwrap();
        s.write_all(b"{").await.unwrap();
        conns.push(s);
    }
    let (refused, resp) = {
        let reads = conns.iter_mut().enumerate().map(|(i, s)| {
            Box::pin(async move {
                let mut out = Vec::new();
                s.read_to_end(&mut out).await.unwrap();
                (i, String::from_utf8_lossy(&out).into_owned())
            })
        });
        tokio::time::timeout(Duration::from_secs(60), futures::future::select_all(reads))
            .await
            .expect("none of three bodies was refused while two held the budget")
            .0
    };
    let mut holders = conns;
    holders.remove(refused);
    // The other two hold the budget: nothing has come back to them.
    for h in &mut holders {
        let mut byte = [0u8; 1];
        let got = tokio::time::timeout(Duration::from_millis(300), h.read(&mut byte)).await;
        assert!(got.is_err(), "a second body was answered: {got:?}");
    }
    assert_eq!(status_of(&resp), 503, "{resp}");
    let err = &body_of(&resp)["error"];
    assert_eq!(err["code"], "busy", "{resp}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("--max-body-bytes-in-flight"),
        "{resp}"
    );
    assert!(
        resp.contains("retry-after: 1") || resp.contains("Retry-After: 1"),
        "{resp}"
    );

    // The holders go: their share comes back, and a whole body of the same size is served.
    drop(holders);
    let mut body =
        json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}).to_string();
    body.push_str(&" ".repeat(60_000 - body.len()));
    let request = [
        &b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
           Connection: close\r\nContent-Length: 60000\r\n\r\n"[..],
        body.as_bytes(),
    ]
    .concat();
    let mut served = None;
    for _ in 0..50 {
        let resp = raw(http, &request).await;
        if status_of(&resp) != 503 {
            served = Some(resp);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let resp = served.expect("the budget never came back after the holders closed");
    assert_eq!(status_of(&resp), 200, "{resp}");
}
