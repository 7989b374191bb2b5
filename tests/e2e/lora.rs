//! LoRA adapters through a cluster: a prefill worker and two decode workers, one of them (and
//! the prefill worker) started with `--lora alpha=...`, behind a router. Requests select an
//! adapter by `model` and get HF + PEFT's greedy tokens (model/tests/lora); they go to the
//! worker that serves it, their long prompts to the prefill worker that serves it too; adapters
//! load and unload at run time, a running request finishing with the adapter it started with;
//! and an adapter no decode worker serves is loaded where the request goes.

use std::path::PathBuf;

use futures::StreamExt;
use serde_json::{json, Value};
use tandem_proto::worker as wpb;

use crate::common::*;

fn adapter_dir(name: &str) -> PathBuf {
    repo_root().join("model/tests/lora").join(name)
}

/// Adapter `name`'s reference for its prompt `i`: prompt ids and HF + PEFT's greedy tokens.
fn reference(name: &str, i: usize) -> (Vec<u32>, Vec<u32>) {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(adapter_dir(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    let p = &v["prompts"][i];
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    (ids(&p["prompt_ids"]), ids(&p["greedy"]))
}

/// A greedy completion of `prompt` (token ids) with `model`: its text and its length.
async fn complete(http: &str, model: &str, prompt: &[u32], n: usize) -> (u16, Value) {
    post(
        http,
        "/v1/completions",
        json!({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
               "ignore_eos": true}),
    )
    .await
}

/// Checks that `model` gives adapter `name`'s reference tokens on its prompt `i`.
async fn check_reference(
    http: &str,
    model: &str,
    name: &str,
    i: usize,
    tok: &tandem_model::Tokenizer,
) {
    let (prompt, greedy) = reference(name, i);
    let (status, body) = complete(http, model, &prompt, greedy.len()).await;
    assert_eq!(status, 200, "{body}");
    let want = tok.decode(&greedy, true).unwrap();
    assert_eq!(
        body["choices"][0]["text"],
        want.as_str(),
        "{model} on prompt {i}"
    );
}

/// Waits until the router lists adapter `name` (it learns it from the workers' load reports).
async fn wait_listed(http: &str, name: &str) {
    until(&format!("{name} listed"), || async {
        models(http).await["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == name)
    })
    .await;
}

async fn load_lora_on(addr: &str, name: &str, path: &std::path::Path) -> wpb::LoraInfo {
    let mut c = wpb::worker_control_client::WorkerControlClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    c.load_lora(authed(wpb::LoadLoraRequest {
        name: name.into(),
        path: path.display().to_string(),
    }))
    .await
    .unwrap()
    .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adapters_are_served_routed_loaded_and_unloaded_through_the_cluster() {
    let tok = tandem_model::load_text(&model_path()).unwrap().tokenizer;
    let alpha = format!("--lora=alpha={}", adapter_dir("alpha").display());
    let (_p, paddr) = start_prefill(&[&alpha]);
    let (_a, a_addr) = start_worker(&[&alpha]);
    let (_b, b_addr) = start_worker(&[]);
    let r = start_router(
        &[a_addr.clone(), b_addr.clone()],
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=16",
        ],
    );
    wait_ready(&r, 2).await;
    let http = r.http.clone();
    // The router learns what each worker serves from its load reports.
    wait_listed(&http, "alpha").await;
    let listed = models(&http).await;
    let base = listed["data"][0]["id"].as_str().unwrap().to_string();
    let a = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "alpha")
        .unwrap()
        .clone();
    assert_eq!(a["parent"], base.as_str());
    assert_eq!(a["root"], adapter_dir("alpha").display().to_string());

    // Alpha's requests go to the decode worker that serves it, whatever the load; the long
    // prompt (chat, 30-odd tokens) is prefilled on the prefill worker, with alpha too.
    let sent = |m: &std::collections::HashMap<String, f64>, w: &str| {
        metric(
            m,
            &format!(
                "tandem_router_worker_requests_total{{worker_role=\"decode\",worker=\"{w}\"}}"
            ),
        )
    };
    let before = scrape(&http).await;
    for i in [0, 1, 0] {
        check_reference(&http, "alpha", "alpha", i, &tok).await;
    }
    let after = scrape(&http).await;
    assert_eq!(sent(&after, &a_addr) - sent(&before, &a_addr), 3.0);
    assert_eq!(sent(&after, &b_addr), sent(&before, &b_addr));
    assert_eq!(
        metric(
            &after,
            "tandem_router_lora_requests_total{lora_adapter=\"alpha\"}"
        ),
        3.0
    );
    assert!(metric(&after, "tandem_prefill_requests_total{mode=\"remote\"}") >= 1.0);
    // The workers count their adapters' requests: alpha's three on A, the remote one on the
    // prefill worker.
    let wa = scrape(&a_addr).await;
    assert_eq!(
        metric(&wa, "tandem_lora_requests_total{lora_adapter=\"alpha\"}"),
        3.0
    );
    assert_eq!(metric(&wa, "tandem_lora_adapters{state=\"resident\"}"), 1.0);
    assert!(
        metric(
            &scrape(&paddr).await,
            "tandem_lora_requests_total{lora_adapter=\"alpha\"}"
        ) >= 1.0
    );
    // The base model is served as before, on either worker.
    let (status, body) = complete(&http, &base, &reference("alpha", 0).0, 8).await;
    assert_eq!(status, 200, "{body}");
    // A model that is neither: not found.
    let (status, body) = complete(&http, "nope", &[504, 3575], 4).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (404, &json!("model_not_found"))
    );

    // Run-time loading: every worker reads beta; its requests get its reference.
    let v = reqwest::Client::new()
        .post(format!("{http}/v1/load_lora_adapter"))
        .json(&json!({"lora_name": "beta", "lora_path": adapter_dir("beta")}))
        .send()
        .await
        .unwrap();
    assert_eq!(v.status(), 200, "{:?}", v.text().await);
    for addr in [&a_addr, &b_addr, &paddr] {
        let l = worker_load(addr).await;
        assert!(
            l.loras.iter().any(|i| i.name == "beta" && i.resident),
            "{addr}"
        );
    }
    check_reference(&http, "beta", "beta", 0, &tok).await;
    check_reference(&http, "beta", "beta", 1, &tok).await;
    // A bad adapter is refused with the reason, and no worker keeps anything.
    let (status, body) = post(
        &http,
        "/v1/load_lora_adapter",
        json!({"lora_name": "bad", "lora_path": "/nonexistent/adapter"}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no such adapter directory"),
        "{body}"
    );
    for addr in [&a_addr, &b_addr, &paddr] {
        assert!(!worker_load(addr)
            .await
            .loras
            .iter()
            .any(|i| i.name == "bad"));
    }

    // Unloading under load: streams running with beta finish, whole; new ones are refused.
    let (prompt, _) = reference("beta", 1);
    let running: Vec<_> = (0..3)
        .map(|_| {
            let (http, prompt) = (http.clone(), prompt.clone());
            tokio::spawn(async move { complete(&http, "beta", &prompt, 48).await })
        })
        .collect();
    until("beta's requests running", || async {
        let l = worker_load(&a_addr).await;
        let m = worker_load(&b_addr).await;
        l.running + m.running >= 3
    })
    .await;
    let (status, body) = post(
        &http,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "beta"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for t in running {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 48, "{body}");
    }
    let (status, body) = complete(&http, "beta", &prompt, 4).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (404, &json!("model_not_found"))
    );
    let (status, _) = post(
        &http,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "beta"}),
    )
    .await;
    assert_eq!(status, 404);

    // An adapter only the prefill worker serves: the router loads it on the decode worker its
    // request goes to, from the same path.
    load_lora_on(&paddr, "gamma", &adapter_dir("gamma")).await;
    wait_listed(&http, "gamma").await;
    check_reference(&http, "gamma", "gamma", 0, &tok).await;
    let m = scrape(&http).await;
    assert_eq!(metric(&m, "tandem_router_lora_placements_total"), 1.0);
    let served: usize =
        [&a_addr, &b_addr]
            .iter()
            .map(|a| async move {
                worker_load(a).await.loras.iter().any(|i| i.name == "gamma") as usize
            })
            .collect::<futures::stream::FuturesOrdered<_>>()
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .sum();
    assert_eq!(
        served, 1,
        "gamma on the one decode worker its request went to"
    );
    check_reference(&http, "gamma", "gamma", 1, &tok).await;
    assert_eq!(
        metric(&scrape(&http).await, "tandem_router_lora_placements_total"),
        1.0,
        "the second request went where gamma was"
    );
}

/// A stream run with an adapter, its decode worker killed mid-stream: it resumes on the other
/// decode worker with the same adapter (loaded there from the path the prefill worker read it
/// from), and its text is the text of the stream uninterrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_migrated_stream_keeps_its_adapter() {
    let alpha = format!("--lora=alpha={}", adapter_dir("alpha").display());
    let (_p, paddr) = start_prefill(&[&alpha]);
    let (mut a, a_addr) = start_worker(&[&alpha]);
    let (_b, b_addr) = start_worker(&[]);
    let r = start_router(
        &[a_addr, b_addr.clone()],
        &[&format!("--prefill-workers={paddr}")],
    );
    wait_ready(&r, 2).await;
    let http = r.http.clone();
    wait_listed(&http, "alpha").await;
    let (prompt, _) = reference("alpha", 1);
    let body = json!({"model": "alpha", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                      "ignore_eos": true});
    let (status, whole) = post(&http, "/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{whole}");
    let want = whole["choices"][0]["text"].as_str().unwrap().to_string();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&streamed)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut chunks = resp.bytes_stream();
    let (mut raw, mut killed) = (String::new(), false);
    while let Some(c) = chunks.next().await {
        raw += std::str::from_utf8(&c.unwrap()).unwrap();
        if !killed && sse_events(&raw).len() >= 10 {
            // Alpha's stream runs on A, the one decode worker that serves it.
            a.signal(libc::SIGKILL);
            a.wait_exit(std::time::Duration::from_secs(5));
            killed = true;
        }
    }
    assert!(killed, "the stream ended before A could be killed");
    let events = sse_events(&raw);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{raw}");
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        text += v["choices"][0]["text"].as_str().unwrap();
    }
    assert_eq!(text, want, "the migrated stream's text");
    let m = scrape(&http).await;
    assert!(metric(&m, "tandem_request_migrations_total") >= 1.0);
    assert_eq!(metric(&m, "tandem_router_lora_placements_total"), 1.0);
    assert!(worker_load(&b_addr)
        .await
        .loras
        .iter()
        .any(|i| i.name == "alpha"));
}
