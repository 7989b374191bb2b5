//! Helpers shared by the end-to-end tests: starting `tandem` processes, waiting for them, and
//! reading what they answer.
#![allow(dead_code)]

pub mod netns;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
pub use tandem_discovery::Ready;
use tandem_proto::worker as wpb;

/// The KV secret every test cluster shares.
pub const KV_SECRET: &str = "test-kv-secret-0123456789";

pub fn golden() -> Vec<Value> {
    let dir = std::env::var_os("TANDEM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/golden"));
    std::fs::read_to_string(dir.join("smollm2_greedy.jsonl"))
        .expect("golden file")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn model_path() -> PathBuf {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "{} missing: run scripts/test (it fetches the model)",
        p.display()
    );
    p
}

/// A child process killed (and reaped) on drop; the kernel kills it too if the test dies.
pub struct Proc {
    pub child: Child,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `tandem ARGS` and waits for the stdout line starting with `marker`; returns that line
/// (a role's ready line: read it with [`ready_line`]).
pub fn spawn(args: &[String], marker: &str) -> (Proc, String) {
    spawn_env(args, marker, &[])
}

/// [`spawn`] with extra environment variables.
pub fn spawn_env(args: &[String], marker: &str, env: &[(&str, &str)]) -> (Proc, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
    cmd.envs(env.iter().copied());
    cmd.args(args)
        .stderr(Stdio::inherit())
        .env("TANDEM_LOG", "warn")
        .env("TANDEM_KV_SECRET", KV_SECRET);
    spawn_command(cmd, marker)
}

/// Runs `cmd` (its stdout read here) and waits for the stdout line starting with `marker`;
/// returns that line.
pub fn spawn_command(cmd: Command, marker: &str) -> (Proc, String) {
    start_command(cmd, marker).wait()
}

/// A process started and not yet known to be ready: [`Starting::wait`] waits for its line.
pub struct Starting {
    proc: Proc,
    line: mpsc::Receiver<String>,
    what: String,
}

impl Starting {
    /// Waits for the process's ready line (the bound only catches one that never prints it).
    pub fn wait(mut self) -> (Proc, String) {
        match self.line.recv_timeout(Duration::from_secs(180)) {
            Ok(line) => (self.proc, line),
            Err(_) => {
                let status = self.proc.child.try_wait();
                panic!("{} did not print its ready line ({status:?})", self.what)
            }
        }
    }
}

/// Starts `cmd` (stdin closed, stdout read here, killed with this thread) without waiting:
/// several can start at once.
pub fn start_command(mut cmd: Command, marker: &str) -> Starting {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null()).stdout(Stdio::piped());
    // SAFETY: prctl only affects the child.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let what = format!("{cmd:?}");
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("start {what}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let wanted = marker.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if !sent && line.starts_with(&wanted) {
                let _ = tx.send(line.trim().to_string());
                sent = true;
            }
        }
    });
    Starting {
        proc: Proc { child },
        line: rx,
        what,
    }
}

/// A decode worker's gRPC address.
pub fn start_worker(extra: &[&str]) -> (Proc, String) {
    let (p, addr, _) = start_decode(extra);
    (p, addr)
}

/// A decode worker's gRPC and KV addresses.
pub fn start_decode(extra: &[&str]) -> (Proc, String, String) {
    start_decode_env(extra, &[])
}

/// [`start_decode`] with extra environment variables.
pub fn start_decode_env(extra: &[&str], env: &[(&str, &str)]) -> (Proc, String, String) {
    let mut args: Vec<String> = vec![
        "decode".into(),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
        format!("--model={}", model_path().display()),
        "--kv-cache-mb=256".into(),
        "--kv-port=0".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let (p, line) = spawn_env(&args, Ready::DECODE, env);
    match ready_line(&line) {
        Ready::Decode { grpc, kv } => (p, grpc, kv.unwrap_or_else(|| "none".into())),
        other => panic!("a decode worker printed {other}"),
    }
}

pub fn start_prefill(extra: &[&str]) -> (Proc, String) {
    start_prefill_env(extra, &[])
}

/// [`start_prefill`] with extra environment variables.
pub fn start_prefill_env(extra: &[&str], env: &[(&str, &str)]) -> (Proc, String) {
    let mut args: Vec<String> = vec![
        "prefill".into(),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
        format!("--model={}", model_path().display()),
        "--kv-cache-mb=256".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let (p, line) = spawn_env(&args, Ready::PREFILL, env);
    (p, ready_line(&line).grpc().to_string())
}

/// Samples of a Prometheus text page, `name{labels}` -> value. Every sample of a role's page
/// carries `model_name` and `role`; keys leave those two out, the other labels in page order.
pub fn parse_metrics(page: &str) -> std::collections::HashMap<String, f64> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((without_role_labels(k), v.parse().ok()?))
        })
        .collect()
}

/// `name{labels}` without its `model_name` and `role` labels (asserting they are there).
fn without_role_labels(key: &str) -> String {
    let (name, labels) = key.split_once('{').expect("every sample is labelled");
    let labels = labels.strip_suffix('}').expect("labels end with }");
    let mut kept = Vec::new();
    let mut seen = 0;
    let mut rest = labels;
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"").expect("label=\"value\"");
        // The value runs to the first quote not escaped by a backslash.
        let mut end = 0;
        let bytes = after.as_bytes();
        while bytes[end] != b'"' {
            end += if bytes[end] == b'\\' { 2 } else { 1 };
        }
        let v = &after[..end];
        if k == "model_name" || k == "role" {
            seen += 1;
        } else {
            kept.push(format!("{k}=\"{v}\""));
        }
        rest = after[end + 1..].trim_start_matches(',');
    }
    assert_eq!(seen, 2, "{key}: model_name and role on every sample");
    if kept.is_empty() {
        name.to_string()
    } else {
        format!("{name}{{{}}}", kept.join(","))
    }
}

/// The `/metrics` page of `addr` (host:port or a URL), or `None` while it cannot be reached.
pub async fn try_scrape(addr: &str) -> Option<std::collections::HashMap<String, f64>> {
    let url = if addr.starts_with("http") {
        format!("{addr}/metrics")
    } else {
        format!("http://{addr}/metrics")
    };
    let body = reqwest::get(url).await.ok()?.text().await.ok()?;
    Some(parse_metrics(&body))
}

/// The `/metrics` page of `addr`, which must answer.
pub async fn scrape(addr: &str) -> std::collections::HashMap<String, f64> {
    try_scrape(addr)
        .await
        .unwrap_or_else(|| panic!("{addr}/metrics did not answer"))
}

/// One sample of a scrape (0 when absent).
pub fn metric(m: &std::collections::HashMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

pub struct Router {
    pub proc: Proc,
    pub http: String,
    pub grpc: String,
}

pub fn start_router(workers: &[String], extra: &[&str]) -> Router {
    start_router_env(workers, extra, &[])
}

/// [`start_router`] with extra environment variables.
pub fn start_router_env(workers: &[String], extra: &[&str], env: &[(&str, &str)]) -> Router {
    let mut args: Vec<String> = vec![
        "router".into(),
        "--host=127.0.0.1".into(),
        "--http-port=0".into(),
        "--grpc-port=0".into(),
        format!("--model={}", model_path().display()),
        "--poll-ms=100".into(),
    ];
    if !workers.is_empty() {
        args.push(format!("--decode-workers={}", workers.join(",")));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let (proc, line) = spawn_env(&args, Ready::ROUTER, env);
    router_at(proc, &line)
}

/// A process's ready line, parsed by the one parser `tandem up` uses too.
pub fn ready_line(line: &str) -> Ready {
    Ready::parse(line).unwrap_or_else(|| panic!("not a ready line: {line:?}"))
}

/// The HTTP address of `tandem up`'s ready line.
pub fn up_http(line: &str) -> String {
    match ready_line(line) {
        Ready::Up { http, .. } => http,
        other => panic!("tandem up printed {other}"),
    }
}

/// The router `proc` whose ready line is `line`.
pub fn router_at(proc: Proc, line: &str) -> Router {
    match ready_line(line) {
        Ready::Router { http, grpc } => Router {
            proc,
            http: format!("http://{http}"),
            grpc: format!("http://{grpc}"),
        },
        other => panic!("a router printed {other}"),
    }
}

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
    let end = Instant::now() + Duration::from_secs(10);
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

pub struct Expect {
    pub text_ignore_eos: String,
    pub text_eos: String,
    pub tokens_eos: usize,
    pub finish_eos: &'static str,
}

pub fn expected(tok: &tandem_model::Tokenizer, r: &Value) -> Expect {
    let ids: Vec<u32> = serde_json::from_value(r["generated_ids"].clone()).unwrap();
    let (cut, tokens_eos, finish_eos) = match r["first_eos_index"].as_u64() {
        Some(i) => (i as usize, i as usize + 1, "stop"),
        None => (ids.len(), ids.len(), "length"),
    };
    Expect {
        text_ignore_eos: tok.decode(&ids, true).unwrap(),
        text_eos: tok.decode(&ids[..cut], true).unwrap(),
        tokens_eos,
        finish_eos,
    }
}

pub fn python() -> PathBuf {
    let p = std::env::var_os("TANDEM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/pyenv/bin/python")
        });
    assert!(
        p.exists(),
        "{} missing: scripts/test makes the venv with the OpenAI client",
        p.display()
    );
    p
}

/// Starts `tests/<script>` (a test server in Python) with `args` and waits for the line
/// "listening" it prints once it accepts.
pub fn python_server(script: &str, args: &[String]) -> Proc {
    python_server_in(None, script, args)
}

/// `python ARGS`, inside network namespace `netns` when given.
fn python_command(netns: Option<&str>) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(python());
            c
        }
        None => Command::new(python()),
    }
}

/// [`python_server`] inside network namespace `netns` (when given).
pub fn python_server_in(netns: Option<&str>, script: &str, args: &[String]) -> Proc {
    use std::io::BufRead;
    let mut child = python_command(netns)
        .arg(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests")
                .join(script),
        )
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("python {script}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        "listening",
        "{script} did not start (scripts/test installs what it imports)"
    );
    Proc { child }
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

/// Runs tests/openai_client.py (the official OpenAI Python client) against `base_url`: every
/// golden case four ways, exact text, finish reason and usage. `extra` goes to the script
/// (`--api-key=K`, `--ca-cert=PEM`).
pub async fn openai_python_client(
    base_url: &str,
    model: &str,
    tok: &tandem_model::Tokenizer,
    extra: &[String],
) {
    openai_python_client_in(None, base_url, model, tok, extra).await
}

/// [`openai_python_client`] run inside network namespace `netns` (when given).
pub async fn openai_python_client_in(
    netns: Option<&str>,
    base_url: &str,
    model: &str,
    tok: &tandem_model::Tokenizer,
    extra: &[String],
) {
    let cases: Vec<Value> = golden()
        .iter()
        .map(|g| {
            let e = expected(tok, g);
            let mut c = serde_json::json!({
                "id": g["id"],
                "max_tokens": g["n_new"],
                "prompt_tokens": g["n_prompt"],
                "text_ignore_eos": e.text_ignore_eos,
                "text_eos": e.text_eos,
                "tokens_eos": e.tokens_eos,
                "finish_eos": e.finish_eos,
            });
            if g["chat"].is_array() {
                c["kind"] = serde_json::json!("chat");
                c["messages"] = g["chat"].clone();
            } else {
                c["kind"] = serde_json::json!("completion");
                c["prompt"] = g["prompt"].clone();
            }
            c
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cases.json");
    std::fs::write(&path, serde_json::to_string(&cases).unwrap()).unwrap();
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = tokio::process::Command::from(python_command(netns))
        .arg(script)
        .arg(format!("--base-url={base_url}"))
        .arg(format!("--model={model}"))
        .arg(format!("--cases={}", path.display()))
        .args(extra)
        .output()
        .await
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "OpenAI client checks failed:\n{stdout}"
    );
    assert!(stdout.contains(&format!(
        "{n}/{n} OpenAI client checks passed",
        n = cases.len() * 4
    )));
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

/// Runs tests/structured_client.py (structured outputs through the official OpenAI Python
/// client, each answer validated with `jsonschema`) against `base_url`; `quick` runs each schema
/// once (greedy, not streamed) and nothing else. Returns the number of requests that generated.
pub async fn structured_python_client(base_url: &str, model: &str, quick: bool) -> usize {
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/structured_client.py");
    let mut cmd = tokio::process::Command::from(python_command(None));
    cmd.arg(script)
        .arg(format!("--base-url={base_url}"))
        .arg(format!("--model={model}"));
    if quick {
        cmd.arg("--quick");
    }
    let out = cmd.output().await.expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "structured output checks failed:\n{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.ends_with("structured output checks passed"))
        .expect("a summary line");
    let (passed, total) = line
        .split_whitespace()
        .next()
        .and_then(|f| f.split_once('/'))
        .expect("N/N");
    assert_eq!(passed, total, "{line}");
    total.parse().unwrap()
}

/// The child processes of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|x| x.parse::<i32>().ok()));
            }
        }
    }
    out.sort();
    out
}

/// Whether `pid` runs (a zombie still has a /proc entry; its state says so).
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// A free loopback port (free when asked; the caller binds it soon after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An etcd server on loopback (Debian's etcd-server, installed by scripts/test), killed on drop.
pub struct Etcd {
    pub proc: Proc,
    pub port: u16,
}

impl Etcd {
    /// Starts etcd on `port` with its data in `dir` and waits until it answers.
    pub fn start(dir: &std::path::Path, port: u16) -> Self {
        let peer = free_port();
        let child = Command::new("etcd")
            .args([
                "--name=t".to_string(),
                format!("--data-dir={}", dir.display()),
                format!("--listen-client-urls=http://127.0.0.1:{port}"),
                format!("--advertise-client-urls=http://127.0.0.1:{port}"),
                format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                format!("--initial-cluster=t=http://127.0.0.1:{peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the etcd binary (scripts/test installs Debian's etcd-server)");
        let etcd = Self {
            proc: Proc { child },
            port,
        };
        let end = Instant::now() + Duration::from_secs(60);
        while etcd.try_ctl(&["get", "probe"]).is_none() {
            assert!(Instant::now() < end, "etcd did not start on port {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        etcd
    }

    /// `--discovery` for this etcd.
    pub fn flag(&self) -> String {
        format!("--discovery=etcd://127.0.0.1:{}", self.port)
    }

    fn try_ctl(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=127.0.0.1:{}", self.port))
            .args(args)
            .output()
            .expect("etcdctl (scripts/test installs Debian's etcd-client)");
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `etcdctl ARGS` against this etcd, which must succeed; its stdout.
    pub fn ctl(&self, args: &[&str]) -> String {
        self.try_ctl(args)
            .unwrap_or_else(|| panic!("etcdctl {args:?} failed"))
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.ctl(&["get", "--prefix", "--keys-only", prefix])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    pub fn stop(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
    }
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `helm ARGS`: scripts/test installs it in target/tools (or `TANDEM_HELM` names it).
pub fn helm(args: &[&str]) -> std::process::Output {
    let bin = std::env::var_os("TANDEM_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/tools/helm"));
    Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/test installs helm)", bin.display()))
}

/// A command's stdout and stderr, as text.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `helm template tandem deploy/helm/tandem EXTRA`: the rendered YAML.
pub fn helm_render(extra: &[&str]) -> String {
    let chart = repo_root().join("deploy/helm/tandem");
    let mut args = vec!["template", "tandem", chart.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = helm(&args);
    assert!(
        o.status.success(),
        "helm template {extra:?}: {}",
        output_text(&o)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Rendered objects as JSON (PyYAML, which kubernetes-validate brings along).
pub fn yaml_objects(yaml: &str) -> Vec<Value> {
    use std::io::Write;
    let mut p = Command::new(python())
        .args([
            "-c",
            "import sys, yaml, json; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let o = p.wait_with_output().unwrap();
    assert!(o.status.success());
    serde_json::from_slice(&o.stdout).unwrap()
}

/// [`helm_render`] as objects.
pub fn helm_objects(extra: &[&str]) -> Vec<Value> {
    yaml_objects(&helm_render(extra))
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
