//! Chaos soak and overload, end to end through `tandem up`.
//!
//! The soak sends a mix of requests (greedy golden prompts streamed and not, sampled ones,
//! streams the client drops, bad input) through a cluster of two prefill and two decode workers
//! while a controller `kill -9`s a prefill worker, then a decode worker, then freezes one
//! (SIGSTOP for 5 s), in turn, every `TANDEM_SOAK_EVERY` answered requests. It asserts that no
//! request hangs or comes back malformed, that every greedy answer equals its golden output
//! token for token, that every worker's KV pool and grants are back to empty afterwards, and
//! that the router's counters add up to what the clients saw. The size that runs in
//! `scripts/test` fits CI; `scripts/soak` runs the long one (1,000 requests, an event every 100).
//!
//! The overload test sends ten times more concurrent clients than the router's `--max-queue`
//! and checks the 503s (overloaded), the admitted requests' answers and latency, and each role's peak memory.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

/// The two tests load the machine and time what they see: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The processes `tandem up` started, by role (its children's second argument).
fn roles(up: i32) -> Vec<(String, i32)> {
    let mut out: Vec<(String, i32)> = children(up)
        .into_iter()
        .map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let role = cmd
                .split(|&b| b == 0)
                .nth(1)
                .map(|r| String::from_utf8_lossy(r).into_owned())
                .unwrap_or_default();
            (role, pid)
        })
        .collect();
    out.sort();
    out
}

/// Peak resident memory of a process, in MiB (VmHWM).
fn peak_rss_mib(pid: i32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: signalling a process this test started (through tandem up).
    unsafe {
        libc::kill(pid, sig);
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[derive(Debug)]
enum Outcome {
    /// Answered completely (and, when greedy, exactly); the latency in seconds when greedy.
    Ok(Option<f64>),
    /// Bad input refused with 400 and an error body.
    Refused,
    /// The client dropped the stream on purpose.
    Cancelled,
    /// A clean error: an error status with an OpenAI error body, or an error event in a stream.
    CleanError(String),
    /// Anything else: a hang, a malformed answer, wrong tokens. Must never happen.
    Broken(String),
}

struct Case {
    path: &'static str,
    body: Value,
    stream: bool,
    /// The exact text when greedy.
    expect: Option<String>,
    max_tokens: u64,
}

fn greedy_case(g: &Value, tok: &tandem_model::Tokenizer, stream: bool) -> Case {
    let e = expected(tok, g);
    let n = g["n_new"].as_u64().unwrap();
    let mut body = json!({"max_tokens": n, "temperature": 0, "ignore_eos": true,
                          "stream": stream});
    let path = if let Some(chat) = g["chat"].as_array() {
        body["messages"] = json!(chat);
        "/v1/chat/completions"
    } else {
        body["prompt"] = g["prompt_ids"].clone();
        "/v1/completions"
    };
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    Case {
        path,
        body,
        stream,
        expect: Some(e.text_ignore_eos),
        max_tokens: n,
    }
}

/// Reads an answer (streamed or not) and judges it against `case`.
async fn judge(case: &Case, resp: reqwest::Response, t0: Instant) -> Outcome {
    let status = resp.status().as_u16();
    if status != 200 {
        let v: Value = resp.json().await.unwrap_or(Value::Null);
        return if v["error"]["message"].is_string() {
            Outcome::CleanError(format!("{status}: {}", v["error"]["message"]))
        } else {
            Outcome::Broken(format!("{status} without an error body: {v}"))
        };
    }
    let (text, finish, tokens) = if case.stream {
        let mut body = resp.bytes_stream();
        let mut raw = String::new();
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) => raw += &String::from_utf8_lossy(&c),
                Err(e) => return Outcome::Broken(format!("stream broke: {e}")),
            }
        }
        let events = sse_events(&raw);
        if events.last().map(String::as_str) != Some("[DONE]") {
            return Outcome::Broken(format!("stream without [DONE]: {raw}"));
        }
        let (mut text, mut finish, mut tokens) = (String::new(), None, None);
        for e in &events[..events.len() - 1] {
            let Ok(v) = serde_json::from_str::<Value>(e) else {
                return Outcome::Broken(format!("bad event {e}"));
            };
            if v.get("error").is_some() {
                return Outcome::CleanError(format!("error event: {v}"));
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n);
            }
            for c in v["choices"].as_array().into_iter().flatten() {
                text += c["text"]
                    .as_str()
                    .or(c["delta"]["content"].as_str())
                    .unwrap_or("");
                if let Some(f) = c["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
            }
        }
        (text, finish, tokens)
    } else {
        let v: Value = match resp.json().await {
            Ok(v) => v,
            Err(e) => return Outcome::Broken(format!("body: {e}")),
        };
        let c = &v["choices"][0];
        (
            c["text"]
                .as_str()
                .or(c["message"]["content"].as_str())
                .unwrap_or("")
                .to_string(),
            c["finish_reason"].as_str().map(String::from),
            v["usage"]["completion_tokens"].as_u64(),
        )
    };
    if finish.as_deref() != Some("length") || tokens != Some(case.max_tokens) {
        return Outcome::Broken(format!(
            "finish {finish:?}, {tokens:?} tokens of {}",
            case.max_tokens
        ));
    }
    match &case.expect {
        Some(want) if &text != want => {
            Outcome::Broken(format!("greedy text differs: {text:?} != {want:?}"))
        }
        Some(_) => Outcome::Ok(Some(t0.elapsed().as_secs_f64())),
        None => Outcome::Ok(None),
    }
}

/// Request `i` of the mix.
async fn one(
    c: &reqwest::Client,
    http: &str,
    golden: &[Value],
    tok: &tandem_model::Tokenizer,
    i: usize,
) -> Outcome {
    let send = |path: &str, body: Value| c.post(format!("{http}{path}")).json(&body).send();
    let t0 = Instant::now();
    match i % 10 {
        // Greedy golden prompts, streamed and not.
        0..=5 => {
            let case = greedy_case(&golden[(i / 2) % golden.len()], tok, i.is_multiple_of(2));
            match send(case.path, case.body.clone()).await {
                Ok(resp) => judge(&case, resp, t0).await,
                Err(e) => Outcome::Broken(format!("send: {e}")),
            }
        }
        // A stream the client drops after its first tokens.
        6 => {
            let body = json!({"prompt": "Tell me a long story about a lighthouse.",
                              "max_tokens": 64, "ignore_eos": true, "stream": true});
            let resp = match send("/v1/completions", body).await {
                Ok(r) => r,
                Err(e) => return Outcome::Broken(format!("send: {e}")),
            };
            if resp.status().as_u16() != 200 {
                return Outcome::CleanError(format!("cancel case: {}", resp.status()));
            }
            let mut s = resp.bytes_stream();
            let mut seen = String::new();
            while sse_events(&seen).len() < 2 {
                match s.next().await {
                    Some(Ok(b)) => seen += &String::from_utf8_lossy(&b),
                    _ => return Outcome::Broken(format!("stream ended early: {seen}")),
                }
            }
            Outcome::Cancelled
        }
        // Bad input: each gets 400 with an error body.
        7 => {
            let resp = match (i / 10) % 4 {
                0 => {
                    c.post(format!("{http}/v1/completions"))
                        .header("content-type", "application/json")
                        .body("{\"prompt\": ")
                        .send()
                        .await
                }
                1 => {
                    send(
                        "/v1/completions",
                        json!({"prompt": "hi", "temperature": -1}),
                    )
                    .await
                }
                2 => {
                    send(
                        "/v1/completions",
                        json!({"prompt": "hi", "max_tokens": 100_000_000u64}),
                    )
                    .await
                }
                _ => {
                    send(
                        "/v1/chat/completions",
                        json!({"messages": [{"role": "wizard", "content": 3}]}),
                    )
                    .await
                }
            };
            match resp {
                Ok(r) if r.status().as_u16() == 400 => {
                    let v: Value = r.json().await.unwrap_or(Value::Null);
                    if v["error"]["message"].is_string() {
                        Outcome::Refused
                    } else {
                        Outcome::Broken(format!("400 without an error body: {v}"))
                    }
                }
                Ok(r) => Outcome::Broken(format!("bad input got {}", r.status())),
                Err(e) => Outcome::Broken(format!("send: {e}")),
            }
        }
        // Sampled, with a seed: complete, not compared.
        _ => {
            let stream = i % 2 == 1;
            let case = Case {
                path: "/v1/completions",
                body: json!({"prompt": "Write a haiku about rain.", "max_tokens": 16,
                             "temperature": 0.9, "top_p": 0.95, "seed": i,
                             "ignore_eos": true, "stream": stream,
                             "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }}),
                stream,
                expect: None,
                max_tokens: 16,
            };
            match send(case.path, case.body.clone()).await {
                Ok(resp) => judge(&case, resp, t0).await,
                Err(e) => Outcome::Broken(format!("send: {e}")),
            }
        }
    }
}

#[derive(Default, Debug)]
struct Tally {
    ok: usize,
    refused: usize,
    cancelled: usize,
    clean_errors: Vec<String>,
    broken: Vec<String>,
    greedy_latency: Vec<f64>,
}

/// Runs requests `range` with `concurrency` clients; `answered` counts those finished.
async fn run(
    http: &str,
    golden: &[Value],
    tok: &tandem_model::Tokenizer,
    range: std::ops::Range<usize>,
    concurrency: usize,
    answered: &AtomicUsize,
) -> Tally {
    // A request that sends nothing for two minutes counts as hung (none should be close).
    let c = reqwest::Client::builder()
        .read_timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let tally = Mutex::new(Tally::default());
    futures::stream::iter(range)
        .for_each_concurrent(concurrency, |i| {
            let (c, tally) = (&c, &tally);
            async move {
                let o = one(c, http, golden, tok, i).await;
                answered.fetch_add(1, Ordering::SeqCst);
                let mut t = tally.lock().unwrap();
                match o {
                    Outcome::Ok(lat) => {
                        t.ok += 1;
                        t.greedy_latency.extend(lat);
                    }
                    Outcome::Refused => t.refused += 1,
                    Outcome::Cancelled => t.cancelled += 1,
                    Outcome::CleanError(e) => t.clean_errors.push(format!("#{i}: {e}")),
                    Outcome::Broken(e) => t.broken.push(format!("#{i}: {e}")),
                }
            }
        })
        .await;
    tally.into_inner().unwrap()
}

/// Waits until every worker the router lists is ready and holds no request, no used KV block
/// and no open grant or prefill; returns the last scrape of each.
async fn wait_settled(http: &str) -> Vec<(String, String, std::collections::HashMap<String, f64>)> {
    let end = Instant::now() + Duration::from_secs(180);
    loop {
        let state = router_state(http).await;
        let mut all = Vec::new();
        let mut settled = true;
        for (pool, role) in [("workers", "decode"), ("prefill_workers", "prefill")] {
            for w in state[pool].as_array().unwrap() {
                let addr = w["addr"].as_str().unwrap().to_string();
                settled &= w["ready"] == true && w["in_flight"] == 0;
                let m = try_scrape(&addr).await.unwrap_or_default();
                settled &= !m.is_empty()
                    && metric(&m, r#"tandem_kv_blocks{state="used"}"#) == 0.0
                    && metric(&m, r#"tandem_requests{state="running"}"#) == 0.0
                    && metric(&m, r#"tandem_requests{state="waiting"}"#) == 0.0
                    && metric(&m, "tandem_kv_grants_open") == 0.0
                    && metric(&m, "tandem_prefill_in_flight") == 0.0;
                all.push((role.to_string(), addr, m));
            }
        }
        if settled {
            return all;
        }
        assert!(
            Instant::now() < end,
            "workers never settled (a leaked block, grant or request?): {:#?}",
            all.iter()
                .map(|(r, a, m)| (
                    r,
                    a,
                    m.iter()
                        .filter(|(k, _)| k.contains("kv_blocks")
                            || k.contains("grants")
                            || k.contains("in_flight")
                            || k.starts_with("tandem_requests"))
                        .collect::<Vec<_>>()
                ))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn start_up(extra: &[&str]) -> (Proc, String) {
    let mut args: Vec<String> = vec![
        "up".into(),
        format!("--model={}", model_path().display()),
        "--http-port=0".into(),
        "--grpc-port=0".into(),
        "--worker-arg=--kv-cache-mb=256".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let (up, line) = spawn(&args, Ready::UP);
    let http = format!("http://{}", up_http(&line));
    (up, http)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak_loses_nothing_and_leaks_nothing() {
    let _serial = SERIAL.lock().await;
    let requests = env_usize("TANDEM_SOAK_REQUESTS", 200);
    let every = env_usize("TANDEM_SOAK_EVERY", 30).max(1);
    let calm = env_usize("TANDEM_SOAK_CALM", requests / 4);
    let concurrency = env_usize("TANDEM_SOAK_CONCURRENCY", 8);
    let (up, http) = start_up(&[
        "--decode-workers=2",
        "--prefill-workers=2",
        // Most golden prompts are prefilled remotely.
        "--disagg-min-tokens=16",
    ]);
    let golden = golden();
    let tok = tandem_model::load_text(&model_path()).unwrap().tokenizer;

    // Calm: the same mix with nothing failing, for the latency baseline.
    let answered = AtomicUsize::new(0);
    let quiet = run(&http, &golden, &tok, 0..calm, concurrency, &answered).await;

    // Chaos: the controller acts each time `every` more requests are answered.
    let answered = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let up_pid = up.pid();
    let controller = std::thread::spawn({
        let (answered, stop) = (answered.clone(), stop.clone());
        move || {
            let mut events = Vec::new();
            let mut next = every;
            while !stop.load(Ordering::SeqCst) {
                // Nothing happens once the last request is answered.
                if answered.load(Ordering::SeqCst) < next || next >= requests {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                let k = next / every - 1;
                next += every;
                let live = roles(up_pid);
                let of = |role: &str| -> Vec<i32> {
                    live.iter()
                        .filter(|(r, _)| r == role)
                        .map(|&(_, p)| p)
                        .collect()
                };
                let (what, role) = match k % 3 {
                    0 => ("kill -9", "prefill"),
                    1 => ("kill -9", "decode"),
                    _ => (
                        "SIGSTOP 5 s",
                        if (k / 3).is_multiple_of(2) {
                            "decode"
                        } else {
                            "prefill"
                        },
                    ),
                };
                let pids = of(role);
                let Some(&pid) = pids.get((k / 3) % pids.len().max(1)) else {
                    events.push(format!("{what} {role}: none running"));
                    continue;
                };
                if what == "kill -9" {
                    signal(pid, libc::SIGKILL);
                } else {
                    signal(pid, libc::SIGSTOP);
                    std::thread::sleep(Duration::from_secs(5));
                    signal(pid, libc::SIGCONT);
                }
                events.push(format!("{what} {role} {pid}"));
            }
            events
        }
    });
    let t0 = Instant::now();
    let chaos = run(
        &http,
        &golden,
        &tok,
        calm..calm + requests,
        concurrency,
        &answered,
    )
    .await;
    let chaos_secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    let events = controller.join().unwrap();

    // Afterwards every worker (restarted ones included) is idle with an empty KV pool.
    let workers = wait_settled(&http).await;
    let router = scrape(&http).await;
    let outcome = |o: &str| {
        metric(
            &router,
            &format!("tandem_router_requests_total{{outcome=\"{o}\"}}"),
        )
    };
    let rss: Vec<(String, f64)> = roles(up_pid)
        .into_iter()
        .map(|(r, p)| (r, peak_rss_mib(p)))
        .collect();

    let mut ql = quiet.greedy_latency.clone();
    let mut cl = chaos.greedy_latency.clone();
    println!("soak: {calm} calm + {requests} chaos requests, {concurrency} clients, an event every {every} answered");
    println!("events ({}): {events:?}", events.len());
    for (name, t) in [("calm", &quiet), ("chaos", &chaos)] {
        println!(
            "{name}: ok {} refused (bad input) {} cancelled {} clean errors {} broken {}",
            t.ok,
            t.refused,
            t.cancelled,
            t.clean_errors.len(),
            t.broken.len()
        );
    }
    println!(
        "greedy latency calm p50 {:.2} s p99 {:.2} s; chaos p50 {:.2} s p99 {:.2} s; chaos phase {:.1} s",
        percentile(&mut ql, 0.5),
        percentile(&mut ql, 0.99),
        percentile(&mut cl, 0.5),
        percentile(&mut cl, 0.99),
        chaos_secs
    );
    println!(
        "router: ok {} invalid {} refused {} failed {} cancelled {}; migrations {}, prefills remote {} local {}",
        outcome("ok"),
        outcome("invalid"),
        outcome("refused"),
        outcome("failed"),
        outcome("cancelled"),
        metric(&router, "tandem_request_migrations_total"),
        metric(&router, r#"tandem_prefill_requests_total{mode="remote"}"#),
        metric(&router, r#"tandem_prefill_requests_total{mode="local"}"#),
    );
    for (role, addr, m) in &workers {
        println!(
            "{role} {addr}: blocks used {} cached {} free {}",
            metric(m, r#"tandem_kv_blocks{state="used"}"#),
            metric(m, r#"tandem_kv_blocks{state="cached"}"#),
            metric(m, r#"tandem_kv_blocks{state="free"}"#)
        );
    }
    println!("peak RSS (MiB, restarted workers since their restart): {rss:?}");
    for e in chaos.clean_errors.iter().chain(&quiet.clean_errors) {
        println!("clean error {e}");
    }

    let all = |f: fn(&Tally) -> usize| f(&quiet) + f(&chaos);
    assert!(
        quiet.broken.is_empty() && chaos.broken.is_empty(),
        "broken answers: {:#?}",
        quiet.broken.iter().chain(&chaos.broken).collect::<Vec<_>>()
    );
    assert!(quiet.clean_errors.is_empty(), "errors with nothing failing");
    assert_eq!(events.len(), (requests - 1) / every, "{events:?}");
    // The router saw every request once and ended each the way the client did.
    let total: f64 = ["ok", "invalid", "refused", "failed", "cancelled"]
        .iter()
        .map(|o| outcome(o))
        .sum();
    assert_eq!(total as usize, calm + requests);
    assert_eq!(outcome("invalid") as usize, all(|t| t.refused));
    assert_eq!(outcome("refused"), 0.0);
    assert_eq!(
        (outcome("ok") + outcome("cancelled")) as usize,
        all(|t| t.ok) + all(|t| t.cancelled),
        "a dropped stream ends as ok or cancelled, every other answer as ok"
    );
    assert_eq!(
        outcome("failed") as usize,
        all(|t| t.clean_errors.len()),
        "clean errors: {:?}",
        chaos.clean_errors
    );
    drop(up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_with_retry_after_and_stays_bounded() {
    let _serial = SERIAL.lock().await;
    const MAX_QUEUE: usize = 4;
    const CLIENTS: usize = 10 * MAX_QUEUE;
    const ATTEMPTS: usize = 6;
    let (worker, waddr) = start_worker(&[]);
    let router = start_router(
        std::slice::from_ref(&waddr),
        &[&format!("--max-queue={MAX_QUEUE}")],
    );
    wait_ready(&router, 1).await;
    let http = router.http.clone();
    let c = reqwest::Client::builder()
        .read_timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let body = json!({"prompt": "The capital of France is", "max_tokens": 16,
                      "temperature": 0, "ignore_eos": true});
    let ask = || async {
        let t0 = Instant::now();
        let r = c
            .post(format!("{http}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let v: Value = r.json().await.unwrap();
        (status, retry, v, t0.elapsed().as_secs_f64())
    };
    // One request alone, three times: the latency an admitted request is held to.
    let mut alone = Vec::new();
    let mut answer = None;
    for _ in 0..3 {
        let (s, _, v, t) = ask().await;
        assert_eq!(s, 200, "{v}");
        answer.get_or_insert(v["choices"][0]["text"].clone());
        alone.push(t);
    }
    let alone = percentile(&mut alone, 0.5);
    let answer = answer.unwrap();

    // The router's own view of what it has in flight, sampled throughout.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = tokio::spawn({
        let (http, stop) = (http.clone(), stop.clone());
        async move {
            let mut most = 0;
            while !stop.load(Ordering::SeqCst) {
                let v = router_state(&http).await;
                let n: u64 = v["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|w| w["in_flight"].as_u64().unwrap())
                    .sum();
                most = most.max(n);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            most
        }
    });
    let t0 = Instant::now();
    let results: Vec<(u16, Option<String>, Value, f64)> = futures::stream::iter(0..CLIENTS)
        .map(|_| async {
            let mut out = Vec::new();
            for _ in 0..ATTEMPTS {
                let r = ask().await;
                // Clients wait as told before trying again, as OpenAI's do.
                if let Some(secs) = r.1.as_deref().and_then(|s| s.parse::<u64>().ok()) {
                    tokio::time::sleep(Duration::from_secs(secs)).await;
                }
                out.push(r);
            }
            out
        })
        .buffer_unordered(CLIENTS)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .flatten()
        .collect();
    let wall = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    let most_in_flight = sampler.await.unwrap();

    let mut admitted = Vec::new();
    let mut too_many = 0;
    for (s, retry, v, t) in &results {
        match s {
            200 => {
                assert_eq!(v["choices"][0]["text"], answer, "{v}");
                assert_eq!(v["usage"]["completion_tokens"], 16);
                admitted.push(*t);
            }
            503 => {
                assert_eq!(retry.as_deref(), Some("1"));
                assert_eq!(v["error"]["code"], "overloaded");
                too_many += 1;
            }
            _ => panic!("overload answered {s}: {v}"),
        }
    }
    let m = scrape(&http).await;
    let tokens = admitted.len() as f64 * 16.0;
    let (p50, p99, max) = (
        percentile(&mut admitted.clone(), 0.5),
        percentile(&mut admitted.clone(), 0.99),
        percentile(&mut admitted.clone(), 1.0),
    );
    println!(
        "overload: {CLIENTS} clients x {ATTEMPTS} attempts, --max-queue {MAX_QUEUE}: {} admitted, {too_many} refused with 503 in {wall:.1} s; admitted throughput {:.1} tok/s",
        admitted.len(),
        tokens / wall
    );
    println!(
        "admitted latency p50 {p50:.2} s p99 {p99:.2} s max {max:.2} s (alone {alone:.2} s); most in flight {most_in_flight}"
    );
    println!(
        "peak RSS: router {:.0} MiB, decode worker {:.0} MiB",
        peak_rss_mib(router.proc.pid()),
        peak_rss_mib(worker.pid())
    );
    assert_eq!(results.len(), CLIENTS * ATTEMPTS);
    assert!(too_many > 0 && !admitted.is_empty());
    assert!(
        most_in_flight <= MAX_QUEUE as u64,
        "{most_in_flight} in flight"
    );
    assert_eq!(
        metric(
            &m,
            r#"tandem_router_refused_requests_total{reason="queue_full"}"#
        ),
        too_many as f64
    );
    assert_eq!(
        metric(&m, r#"tandem_router_requests_total{outcome="ok"}"#),
        (admitted.len() + 3) as f64
    );
    // Admitted requests share the worker with at most MAX_QUEUE - 1 others: their latency stays
    // within a small multiple of a request alone, however many clients wait outside.
    assert!(
        max <= 4.0 * MAX_QUEUE as f64 * alone,
        "admitted max {max:.2} s vs alone {alone:.2} s"
    );
    // The router holds no per-client state beyond the request: bounded however many knock.
    assert!(peak_rss_mib(router.proc.pid()) < 512.0);
    wait_idle(&waddr).await;
}
