//! End to end: tenants at the router (`--tenants FILE`). Keys name tenants and a key in no
//! tenant is refused; a tenant over its request quota gets 429 with a `Retry-After` that, when
//! honoured, succeeds; a higher band's request overtakes a queue of a lower one's; and a change
//! to the file changes a quota while the router runs. Against real `tandem router` and
//! `tandem decode` processes on loopback.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const TENANTS: &str = "
tenants:
  - name: flood
    keys: [key-flood]
    requests_per_minute: 6
  - name: batch
    keys: [key-batch]
  - name: vip
    keys: [key-vip]
    priority: 10
";

async fn complete(
    c: &reqwest::Client,
    http: &str,
    key: &str,
    max_tokens: u32,
) -> (u16, Option<String>, Value) {
    let r = c
        .post(format!("{http}/v1/completions"))
        .bearer_auth(key)
        .json(
            &json!({"prompt": "Once upon a time", "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (status, retry, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn tenants_get_their_quotas_bands_and_live_changes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.yaml");
    std::fs::write(&file, TENANTS).unwrap();
    let (_w, waddr) = start_worker(&[]);
    let r = start_router(
        std::slice::from_ref(&waddr),
        &[
            &format!("--tenants={}", file.display()),
            "--tenants-reload-ms=100",
            // One request at the worker at a time: the rest wait in the router's queue.
            "--max-in-flight-per-worker=1",
        ],
    );
    wait_ready(&r, 1).await;
    // The router closes a keep-alive connection idle for its header timeout (10 s): the client
    // must not pick one up as it closes, after honouring a Retry-After of as long.
    let c = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let http = r.http.as_str();

    // A key in no tenant is refused like a wrong key.
    let (s, _, v) = complete(&c, http, "key-nobody", 2).await;
    assert_eq!(s, 401, "{v}");

    // The flooder's bucket holds 6 requests: the seventh in the minute is over quota, told
    // when to come back; coming back then succeeds.
    for _ in 0..6 {
        let (s, _, v) = complete(&c, http, "key-flood", 2).await;
        assert_eq!(s, 200, "{v}");
    }
    let (s, retry, v) = complete(&c, http, "key-flood", 2).await;
    assert_eq!(s, 429, "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("requests_per_minute"),
        "{v}"
    );
    let retry: u64 = retry.expect("a Retry-After").parse().unwrap();
    assert!(
        (1..=10).contains(&retry),
        "one request of 6 a minute: {retry} s"
    );
    // The other tenants are untouched by the flooder's quota.
    let (s, _, v) = complete(&c, http, "key-batch", 2).await;
    assert_eq!(s, 200, "{v}");
    // gRPC callers are the same tenants: the flooder is over quota there too, told when to
    // come back; another tenant is served, a key in no tenant refused.
    {
        use tandem_proto::v1 as api;
        let mut g = api::generation_client::GenerationClient::connect(r.grpc.clone())
            .await
            .unwrap();
        let req = |key: &str| {
            let mut req = tonic::Request::new(api::GenerateRequest {
                prompt: Some(api::generate_request::Prompt::Text(
                    "Once upon a time".into(),
                )),
                stopping: Some(api::StoppingCriteria {
                    max_tokens: Some(2),
                    ignore_eos: true,
                    ..Default::default()
                }),
                ..Default::default()
            });
            req.metadata_mut()
                .insert("authorization", format!("Bearer {key}").parse().unwrap());
            req
        };
        let e = g.generate(req("key-flood")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        let pushback: u64 = e
            .metadata()
            .get("grpc-retry-pushback-ms")
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=10_000).contains(&pushback), "{pushback} ms");
        let e = g.generate(req("key-nobody")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        let mut s = g.generate(req("key-vip")).await.unwrap().into_inner();
        let mut tokens = 0;
        while let Some(m) = s.message().await.unwrap() {
            tokens += m.token_ids.len();
        }
        assert_eq!(tokens, 2);
    }
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let (s, _, v) = complete(&c, http, "key-flood", 2).await;
    assert_eq!(s, 200, "honouring Retry-After succeeds: {v}");

    // A long request runs, three more of the batch tenant's wait behind it, then the vip's
    // arrives: it goes as soon as the long one finishes, before the queue it found. (Long
    // enough that the four are queued, each seen in the router's metrics, before it ends,
    // on a fast machine whose scrapes a busy one holds up: 128 tokens.)
    let long = {
        let c = c.clone();
        let http = http.to_string();
        tokio::spawn(async move { complete(&c, &http, "key-batch", 128).await })
    };
    let end = Instant::now() + Duration::from_secs(60);
    while metric(
        &scrape(http).await,
        "tandem_router_tenant_running_requests{tenant=\"batch\"}",
    ) < 1.0
    {
        assert!(Instant::now() < end, "the long request never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut queued = Vec::new();
    for (i, key) in ["key-batch", "key-batch", "key-batch", "key-vip"]
        .into_iter()
        .enumerate()
    {
        let (c2, h2, order) = (c.clone(), http.to_string(), order.clone());
        queued.push(tokio::spawn(async move {
            let (s, _, v) = complete(&c2, &h2, key, 4).await;
            assert_eq!(s, 200, "{v}");
            order.lock().unwrap().push(key);
        }));
        // Each is in the queue before the next is sent.
        while metric(&scrape(http).await, "tandem_router_queued_requests") < (i + 1) as f64 {
            assert!(Instant::now() < end, "request {i} never queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let (s, _, v) = long.await.unwrap();
    assert_eq!(s, 200, "{v}");
    for q in queued {
        q.await.unwrap();
    }
    assert_eq!(
        *order.lock().unwrap(),
        ["key-vip", "key-batch", "key-batch", "key-batch"],
        "one at a time, the vip's first"
    );

    // The file changes: the flooder's quota is raised while the router runs.
    let mut over = 0;
    loop {
        let (s, _, _) = complete(&c, http, "key-flood", 2).await;
        if s == 429 {
            break;
        }
        over += 1;
        assert!(over < 10, "the flooder's bucket never ran dry");
    }
    std::fs::write(
        &file,
        TENANTS.replace("requests_per_minute: 6", "requests_per_minute: 6000"),
    )
    .unwrap();
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, _, v) = complete(&c, http, "key-flood", 2).await;
        if s == 200 {
            break;
        }
        assert_eq!(s, 429, "{v}");
        assert!(Instant::now() < end, "the raised quota never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A file that does not parse leaves the tenants as they were.
    std::fs::write(&file, "tenants: [{name: flood}]").unwrap();
    let end = Instant::now() + Duration::from_secs(30);
    while metric(
        &scrape(http).await,
        "tandem_router_tenants_reloads_total{outcome=\"error\"}",
    ) < 1.0
    {
        assert!(Instant::now() < end, "the broken file was never read");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s, _, v) = complete(&c, http, "key-flood", 2).await;
    assert_eq!(s, 200, "{v}");

    // Each tenant's requests and tokens, counted under its name.
    let m = scrape(http).await;
    let req = |t: &str, o: &str| {
        metric(
            &m,
            &format!("tandem_router_tenant_requests_total{{tenant=\"{t}\",outcome=\"{o}\"}}"),
        )
    };
    assert!(req("flood", "over_quota") >= 2.0);
    assert_eq!(req("vip", "admitted"), 2.0, "one over HTTP, one over gRPC");
    assert_eq!(req("batch", "admitted"), 5.0);
    assert_eq!(
        metric(
            &m,
            "tandem_router_tenant_tokens_total{tenant=\"vip\",kind=\"completion\"}"
        ),
        6.0,
        "4 over HTTP, 2 over gRPC"
    );
    assert_eq!(
        metric(&m, "tandem_router_tenants_reloads_total{outcome=\"ok\"}"),
        1.0
    );
    assert_eq!(metric(&m, "tandem_router_queued_requests"), 0.0);
    assert_eq!(
        metric(
            &m,
            "tandem_router_refused_requests_total{reason=\"over_quota\"}"
        ),
        req("flood", "over_quota")
    );
}
