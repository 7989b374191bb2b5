//! The cluster across hosts, started from the Helm chart. Network namespaces stand in for the
//! hosts: a router, two prefill and two decode workers and a DNS server each get their own, with
//! an address in 10.77.0.0/24 on a veth pair plugged into a bridge in a "switch" namespace; the
//! client runs in one more. Nothing leaves those namespaces.
//!
//! Each process is a container of the rendered chart (`helm template`): its arguments and
//! environment are the chart's, with what Kubernetes would fill in filled in the same way (the
//! pod's IP and name, the KV secret from the rendered Secret, `$(VAR)` in arguments, the model
//! volume at its mount path), so a flag the chart passes that the binary does not take fails
//! here. The DNS server plays the cluster's DNS: the headless Services' SRV records list the
//! ready pods, and the router (pointed at it through the chart's `router.extraArgs`) follows
//! them.
//!
//! The golden prompts are served exactly, with remote prefill across hosts, to the official
//! OpenAI client and to a concurrent load. Then, with requests streaming: a decode and a prefill
//! host's workers are killed (SIGKILL, then restarted as the kubelet would); a decode host's
//! link is taken down (a silent partition) and brought back; and a decode worker is stopped the
//! way Kubernetes stops a pod (the chart's preStop hook, then SIGTERM). Every request still
//! completes with the golden text, the partitioned worker returns to idle with no KV block held,
//! and the stopped one finishes its streams where they run and exits cleanly.
//!
//! Figures printed: rendered commands started -> cluster ready, and the golden load's throughput
//! across hosts against the same commands on loopback, in this run.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::netns::{block_in, Net};
use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

/// The test network: 10.77.0.0/24, only inside this test's namespaces.
const SUBNET: &str = "10.77.0";
const DNS_IP: &str = "10.77.0.53";
const ROUTER_IP: &str = "10.77.0.2";
const CLIENT_IP: &str = "10.77.0.100";

/// One container of the rendered chart, ready to run as a process.
#[derive(Clone, Debug)]
struct Container {
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// The ports it declares, by name.
    ports: HashMap<String, u16>,
}

/// The rendered chart: each Deployment's pod template (by component), replicas, Secrets.
struct Rendered {
    objects: Vec<Value>,
}

impl Rendered {
    fn deployment(&self, component: &str) -> &Value {
        self.objects
            .iter()
            .find(|o| {
                o["kind"] == "Deployment"
                    && o["metadata"]["labels"]["app.kubernetes.io/component"] == component
            })
            .unwrap_or_else(|| panic!("no {component} Deployment rendered"))
    }

    fn replicas(&self, component: &str) -> usize {
        self.deployment(component)["spec"]["replicas"]
            .as_u64()
            .unwrap() as usize
    }

    /// A Secret's value, as the kubelet hands it to a container.
    fn secret(&self, name: &str, key: &str) -> String {
        let s = self
            .objects
            .iter()
            .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("secret {name} not rendered"));
        let b64 = s["data"][key].as_str().unwrap();
        let o = Command::new(python())
            .args([
                "-c",
                "import base64, sys; sys.stdout.write(base64.b64decode(sys.argv[1]).decode())",
                b64,
            ])
            .output()
            .unwrap();
        assert!(o.status.success());
        String::from_utf8(o.stdout).unwrap()
    }

    /// The component's container as pod `pod_name` at `pod_ip` runs it.
    fn container(&self, component: &str, pod_name: &str, pod_ip: &str) -> Container {
        let pod = &self.deployment(component)["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        assert!(
            c["command"].is_null(),
            "{component}: the image's entrypoint (tandem) is what runs"
        );
        // Volumes: the model cache is this machine's.
        let model_dir = model_path().parent().unwrap().display().to_string();
        let mounts: Vec<String> = c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["name"] == "models")
            .map(|m| m["mountPath"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(mounts.len(), 1, "{component}: the model volume is mounted");
        let local = |s: &str| s.replacen(&mounts[0], &model_dir, 1);
        let mut env = Vec::new();
        for e in c["env"].as_array().into_iter().flatten() {
            let name = e["name"].as_str().unwrap().to_string();
            let value = if let Some(v) = e["value"].as_str() {
                local(v)
            } else if let Some(f) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                match f {
                    "status.podIP" => pod_ip.to_string(),
                    "metadata.name" => pod_name.to_string(),
                    other => panic!("{component}: env {name} from field {other} is not modelled"),
                }
            } else if let Some(s) = e["valueFrom"]["secretKeyRef"].as_object() {
                self.secret(s["name"].as_str().unwrap(), s["key"].as_str().unwrap())
            } else {
                panic!("{component}: env {e} is not modelled");
            };
            env.push((name, value));
        }
        // Kubernetes expands $(VAR) in arguments from the container's environment.
        let args = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let mut a = a.as_str().unwrap().to_string();
                for (k, v) in &env {
                    a = a.replace(&format!("$({k})"), v);
                }
                local(&a)
            })
            .collect();
        let ports = c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["name"].as_str().unwrap().to_string(),
                    p["containerPort"].as_u64().unwrap() as u16,
                )
            })
            .collect();
        Container { args, env, ports }
    }

    /// The headless Service of a worker group: its DNS name and SRV owner name.
    fn srv_name(&self, component: &str) -> String {
        let svc = self
            .objects
            .iter()
            .find(|o| {
                o["kind"] == "Service"
                    && o["spec"]["clusterIP"] == "None"
                    && o["spec"]["selector"]["app.kubernetes.io/component"] == component
            })
            .unwrap_or_else(|| panic!("no headless Service for {component}"));
        let name = svc["metadata"]["name"].as_str().unwrap();
        let port = svc["spec"]["ports"][0]["name"].as_str().unwrap();
        format!("_{port}._tcp.{name}.default.svc.cluster.local.")
    }
}

/// A running container: its process, and where its log goes.
struct Pod {
    name: String,
    host: String,
    ip: String,
    proc: Option<Proc>,
    container: Container,
    log: PathBuf,
}

/// Starts `c` in namespace `ns`, its stderr appended to `log`; [`Starting::wait`] waits for its
/// ready line.
fn start_container(ns: &str, c: &Container, log: &Path) -> Starting {
    let role = c.args[0].as_str();
    let marker = Ready::marker(role).unwrap_or_else(|| panic!("unknown role {role}"));
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns])
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args(&c.args)
        .envs(c.env.iter().map(|(k, v)| (k, v)))
        .stderr(Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap(),
        ));
    start_command(cmd, marker)
}

impl Pod {
    /// `decode` or `prefill`.
    fn component(&self) -> &str {
        &self.container.args[0]
    }

    fn port(&self) -> u16 {
        self.container.ports["grpc"]
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.ip, self.port())
    }

    /// Kills the container (SIGKILL) and takes the pod out of the Service's records.
    fn kill(&mut self, zone: &mut Zone) {
        self.proc.as_ref().unwrap().signal(libc::SIGKILL);
        zone.set(self.component(), &self.name, &self.ip, self.port(), false);
        self.proc = None;
    }

    /// Starts the container again, as the kubelet does, and lists the pod once it is up.
    fn restart(&mut self, net: &Net, zone: &mut Zone) {
        self.proc = Some(
            start_container(&net.ns(&self.host), &self.container, &self.log)
                .wait()
                .0,
        );
        zone.set(self.component(), &self.name, &self.ip, self.port(), true);
    }
}

/// The cluster's DNS zone: the headless Services' SRV records (ready pods only) and each pod's
/// A record, as cluster DNS serves them.
struct Zone {
    path: PathBuf,
    /// (component, SRV owner name)
    services: Vec<(String, String)>,
    /// (component, pod name, IP, port)
    ready: Vec<(String, String, String, u16)>,
}

impl Zone {
    /// The zone of `services` (component, SRV owner name) with no pod ready yet, in `path`.
    fn new(path: PathBuf, services: Vec<(String, String)>) -> Self {
        let zone = Self {
            path,
            services,
            ready: Vec::new(),
        };
        zone.write();
        zone
    }

    /// Marks pod `name` (of Service `component`) at `ip` ready or not, and rewrites the file.
    fn set(&mut self, component: &str, name: &str, ip: &str, port: u16, ready: bool) {
        self.ready.retain(|(_, n, _, _)| n != name);
        if ready {
            self.ready.push((
                component.to_string(),
                name.to_string(),
                ip.to_string(),
                port,
            ));
        }
        self.write();
    }

    fn write(&self) {
        let mut srv = serde_json::Map::new();
        let mut a = serde_json::Map::new();
        for (comp, owner) in &self.services {
            let mut records = Vec::new();
            for (c, n, ip, port) in &self.ready {
                if c == comp {
                    let target = format!("{n}.{}", owner.split_once("._tcp.").unwrap().1);
                    records.push(json!([target, port]));
                    a.insert(target, json!([ip]));
                }
            }
            srv.insert(owner.clone(), json!(records));
        }
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, json!({"srv": srv, "a": a}).to_string()).unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
    }
}

/// One golden case as the load sends it: streamed, greedy, `ignore_eos`, so its text is known.
struct Case {
    id: String,
    path: &'static str,
    body: Value,
    want: String,
    tokens: usize,
}

fn cases(model: &str) -> Vec<Case> {
    let tok = tandem_model::load_text(&model_path()).unwrap().tokenizer;
    golden()
        .iter()
        .map(|g| {
            let e = expected(&tok, g);
            let n = g["n_new"].as_u64().unwrap() as usize;
            let mut body = json!({
                "model": model, "max_tokens": n, "temperature": 0, "stream": true,
                "ignore_eos": true, "stream_options": {"include_usage": true},
            });
            let path = if g["chat"].is_array() {
                body["messages"] = g["chat"].clone();
                "/v1/chat/completions"
            } else {
                body["prompt"] = g["prompt"].clone();
                "/v1/completions"
            };
            Case {
                id: g["id"].as_str().unwrap().to_string(),
                path,
                body,
                want: e.text_ignore_eos,
                tokens: n,
            }
        })
        .collect()
}

/// Sends `case` and checks the whole answer: the golden text, `length`, its token count. A
/// stream may pause (a migration waits out the router's stall timeout) but not for minutes.
async fn send(c: &reqwest::Client, http: &str, case: &Case) -> usize {
    let mut resp = c
        .post(format!("{http}{}", case.path))
        .json(&case.body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", case.id));
    assert_eq!(resp.status(), 200, "{}", case.id);
    let mut body = Vec::new();
    loop {
        let chunk = tokio::time::timeout(Duration::from_secs(180), resp.chunk())
            .await
            .unwrap_or_else(|_| panic!("{}: the stream went silent", case.id))
            .unwrap_or_else(|e| panic!("{}: {e}", case.id));
        match chunk {
            Some(b) => body.extend_from_slice(&b),
            None => break,
        }
    }
    let (text, finish, usage) = read_stream(&String::from_utf8(body).unwrap());
    assert_eq!(text, case.want, "{}: text differs from golden", case.id);
    assert_eq!(finish.as_deref(), Some("length"), "{}", case.id);
    assert_eq!(
        usage.unwrap()["completion_tokens"].as_u64(),
        Some(case.tokens as u64),
        "{}",
        case.id
    );
    case.tokens
}

/// Every case `copies` times, `concurrency` at once: output tokens and seconds.
async fn load(
    http: String,
    cases: Arc<Vec<Case>>,
    copies: usize,
    concurrency: usize,
) -> (usize, f64) {
    let c = reqwest::Client::new();
    let started = Instant::now();
    let jobs: Vec<usize> = (0..copies * cases.len()).collect();
    let tokens: usize = futures::stream::iter(jobs)
        .map(|i| {
            let (c, http, cases) = (c.clone(), http.clone(), cases.clone());
            async move { send(&c, &http, &cases[i % cases.len()]).await }
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<usize>>()
        .await
        .into_iter()
        .sum();
    (tokens, started.elapsed().as_secs_f64())
}

/// Whether the router sees `decode` decode and `prefill` prefill workers ready.
async fn cluster_ready(http: &str, decode: usize, prefill: usize) -> bool {
    let Ok(r) = reqwest::get(format!("{http}/ready")).await else {
        return false;
    };
    let Ok(v) = r.json::<Value>().await else {
        return false;
    };
    let p = v["prefill_workers"].as_array().cloned().unwrap_or_default();
    v["ready_workers"] == decode && p.iter().filter(|w| w["ready"] == true).count() == prefill
}

/// Requests running on the worker at `addr` (its `/metrics`), 0 while it cannot be reached.
async fn running(addr: &str) -> f64 {
    try_scrape(addr)
        .await
        .map(|m| metric(&m, "tandem_num_requests_running"))
        .unwrap_or(0.0)
}

/// The load, run from the client's namespace; `when` is checked there while it runs, and once
/// it holds `act` runs on this thread (the one that started the processes). Returns the load's
/// output tokens.
fn load_with_fault(
    net: &Net,
    http: &str,
    cases: &Arc<Vec<Case>>,
    watch: String,
    act: impl FnOnce(),
) -> usize {
    let (tx, rx) = std::sync::mpsc::channel();
    let (http, cases) = (http.to_string(), cases.clone());
    let ns = net.ns("client");
    let client = std::thread::spawn(move || {
        block_in(&ns, move || async move {
            let run = tokio::spawn(load(http, cases, 2, 12));
            // Mid-stream: the watched worker is generating for some of them.
            until("the watched worker never ran a request", || {
                let w = watch.clone();
                async move { running(&w).await > 0.0 }
            })
            .await;
            tx.send(()).unwrap();
            run.await.unwrap().0
        })
    });
    rx.recv().expect("the load ended before the fault");
    act();
    client
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Prints the end of every log when the test fails.
struct Logs(Vec<PathBuf>);

impl Drop for Logs {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for l in &self.0 {
                let text = std::fs::read_to_string(l).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                eprintln!("--- {} (last 40 lines)", l.display());
                for line in &lines[lines.len().saturating_sub(40)..] {
                    eprintln!("{line}");
                }
            }
        }
    }
}

/// The chart as this test installs it: two workers per group, small caches, one thread each
/// (seven processes share this machine), every prompt of 16 tokens or more prefilled remotely,
/// and the router resolving through the test's DNS server.
fn render_chart() -> Rendered {
    let objects = helm_objects(&[
        "--namespace",
        "default",
        "--set",
        "decode.replicas=2",
        "--set",
        "prefill.replicas=2",
        "--set",
        "decode.kvCacheMb=128",
        "--set",
        "prefill.kvCacheMb=128",
        "--set",
        "decode.threads=1",
        "--set",
        "prefill.threads=1",
        "--set",
        "router.disaggMinTokens=16",
        "--set",
        "discovery.refreshMs=200",
        "--set-json",
        &format!("router.extraArgs=[\"--dns-server={DNS_IP}:53\"]"),
    ]);
    Rendered { objects }
}

#[test]
fn the_chart_runs_across_hosts_and_loses_nothing_when_one_fails() {
    let rendered = render_chart();
    // The cluster's secret as the chart made it: the test's own calls to workers carry the
    // credential derived from it.
    let kv_secret = rendered.secret("tandem-kv", "kv-secret");
    assert_eq!(rendered.replicas("router"), 1);
    assert_eq!(rendered.replicas("decode"), 2);
    assert_eq!(rendered.replicas("prefill"), 2);
    let dir = tempfile::tempdir().unwrap();
    let mut net = Net::new();
    let mut logs = Logs(Vec::new());

    // The cluster's DNS, on its own host.
    let dns_ns = net.host("dns", DNS_IP);
    let mut zone = Zone::new(
        dir.path().join("zone.json"),
        ["decode", "prefill"]
            .iter()
            .map(|c| (c.to_string(), rendered.srv_name(c)))
            .collect(),
    );
    let _dns = python_server_in(
        Some(&dns_ns),
        "dns_server.py",
        &["53".into(), zone.path.display().to_string(), DNS_IP.into()],
    );

    // Hosts: the router, p0 p1, d0 d1, and the client.
    let mut pods = Vec::new();
    let router_ns = net.host("router", ROUTER_IP);
    let mut n = 10;
    for comp in ["prefill", "decode"] {
        for i in 0..rendered.replicas(comp) {
            let host = format!("{}{i}", &comp[..1]);
            let ip = format!("{SUBNET}.{n}");
            n += 1;
            net.host(&host, &ip);
            let name = format!("tandem-{comp}-{i}");
            let container = rendered.container(comp, &name, &ip);
            let log = dir.path().join(format!("{host}.log"));
            logs.0.push(log.clone());
            pods.push(Pod {
                name,
                host,
                ip,
                proc: None,
                container,
                log,
            });
        }
    }
    let client_ns = net.host("client", CLIENT_IP);
    let router_c = rendered.container("router", "tandem-router-0", ROUTER_IP);
    let http = format!("http://{ROUTER_IP}:{}", router_c.ports["http"]);
    let router_log = dir.path().join("router.log");
    logs.0.push(router_log.clone());

    // Every container at once, as an install starts them; a pod's record appears once it is up
    // (its ready line: loaded and warm, what the readiness probe waits for).
    let started = Instant::now();
    let router_start = start_container(&router_ns, &router_c, &router_log);
    let starting: Vec<Starting> = pods
        .iter()
        .map(|p| start_container(&net.ns(&p.host), &p.container, &p.log))
        .collect();
    for (p, s) in pods.iter_mut().zip(starting) {
        p.proc = Some(s.wait().0);
        zone.set(p.component(), &p.name, &p.ip, p.port(), true);
    }
    let router = router_start.wait().0;
    let h = http.clone();
    block_in(&client_ns, move || async move {
        until("the cluster never became ready", || cluster_ready(&h, 2, 2)).await
    });
    let ready_after = started.elapsed();

    let model = {
        let h = http.clone();
        block_in(&client_ns, move || async move {
            models(&h).await["data"][0]["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
    };
    // The load: every golden case twice, 12 at once, on cold caches. Its throughput is the
    // figure; the loopback baseline below runs the same on a fresh cluster.
    let cases = Arc::new(cases(&model));
    let (tokens, secs) = {
        let (h, c) = (http.clone(), cases.clone());
        block_in(&client_ns, move || load(h, c, 2, 12))
    };
    let across = tokens as f64 / secs;
    // The golden prompts through the official OpenAI client, from the client's host.
    let tok = tandem_model::load_text(&model_path()).unwrap().tokenizer;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(openai_python_client_in(
            Some(&client_ns),
            &format!("{http}/v1"),
            &model,
            &tok,
            &[],
        ));

    // Prompts were prefilled on the prefill hosts and their KV crossed to the decode hosts.
    // One sample of `addr`'s /metrics, read from the client's host.
    let sample = |addr: String, key: &'static str| {
        block_in(&client_ns, move || async move {
            metric(&scrape(&addr).await, key)
        })
    };
    let remote = sample(
        http.clone(),
        r#"tandem_prefill_requests_total{mode="remote"}"#,
    );
    assert!(remote > 0.0, "no prompt was prefilled remotely");
    let moved: f64 = pods
        .iter()
        .filter(|p| p.component() == "decode")
        .map(|p| sample(p.addr(), r#"tandem_kv_transfers_total{result="ok"}"#))
        .sum();
    assert!(moved > 0.0, "no KV crossed between hosts");
    let all_tokens = 2 * cases.iter().map(|c| c.tokens).sum::<usize>();

    // A decode and a prefill host's workers die mid-stream (SIGKILL); their pods leave the
    // Services' records, and the kubelet starts the containers again.
    let migrations = || sample(http.clone(), "tandem_request_migrations_total");
    let before = migrations();
    let d1 = pods.iter().position(|p| p.host == "d1").unwrap();
    let p1 = pods.iter().position(|p| p.host == "p1").unwrap();
    let watch = pods[d1].addr();
    let got = load_with_fault(&net, &http, &cases, watch, || {
        for i in [d1, p1] {
            pods[i].kill(&mut zone);
        }
    });
    assert_eq!(got, all_tokens, "every request completed");
    let after = migrations();
    assert!(after > before, "the killed decode worker's streams moved");
    for i in [d1, p1] {
        pods[i].restart(&net, &mut zone);
    }
    let h = http.clone();
    block_in(&client_ns, move || async move {
        until("the restarted workers never rejoined", || {
            cluster_ready(&h, 2, 2)
        })
        .await
    });

    // A decode host's cable is pulled mid-stream: its streams go silent and the router moves
    // them after its stall timeout. Plugged back, the worker is routable again and holds nothing.
    let d0 = pods.iter().position(|p| p.host == "d0").unwrap();
    let d0_addr = pods[d0].addr();
    let before = after;
    let got = load_with_fault(&net, &http, &cases, d0_addr.clone(), || {
        net.link("d0", false)
    });
    assert_eq!(got, all_tokens, "every request completed");
    let after = migrations();
    assert!(after > before, "the cut-off worker's streams moved");
    net.link("d0", true);
    let (h, a, secret) = (http.clone(), d0_addr, kv_secret.clone());
    block_in(&client_ns, move || async move {
        until("the reconnected worker never became ready", || {
            cluster_ready(&h, 2, 2)
        })
        .await;
        until("the reconnected worker kept requests or KV blocks", || {
            let (a, secret) = (a.clone(), secret.clone());
            async move {
                let l = worker_load_by(&a, &secret).await;
                l.running == 0 && l.waiting == 0 && l.blocks_used == 0 && l.in_flight == 0
            }
        })
        .await;
    });
    // And it serves again.
    let (h, c) = (http.clone(), cases.clone());
    let (got, _) = block_in(&client_ns, move || load(h, c, 1, 12));
    assert_eq!(got * 2, all_tokens);

    // Only the worker's own host, with the cluster's credential, may make it leave.
    let a = pods[d0].addr();
    let token = worker_token(&kv_secret);
    let refused = block_in(&client_ns, move || async move {
        let c = reqwest::Client::new();
        let url = format!("http://{a}/deregister");
        let without = c.post(&url).send().await.unwrap().status();
        let with = c
            .post(&url)
            .header("authorization", token.header())
            .send()
            .await
            .unwrap()
            .status();
        (without, with)
    });
    assert_eq!((refused.0.as_u16(), refused.1.as_u16()), (401, 403));

    // A graceful stop mid-stream, as Kubernetes does it: the chart's preStop hook runs in the
    // pod (the worker leaves: not routed to, and hands its running streams over), the pod
    // leaves the records, then SIGTERM. Every stream completes: those that ran there move as
    // hand-offs (their KV pulled from the leaving worker, which the router keeps as a peer
    // after the records drop it), none as a failure, and the worker exits cleanly once it has
    // been pulled.
    let pre_stop: Vec<String> = rendered.deployment("decode")["spec"]["template"]["spec"]
        ["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        .as_array()
        .expect("the decode pods have a preStop hook")
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    assert_eq!(pre_stop[0], "tandem");
    let before = migrations();
    let handoffs = || sample(http.clone(), "tandem_request_handoffs_total");
    let handed_before = handoffs();
    let watch = pods[d1].addr();
    let got = load_with_fault(&net, &http, &cases, watch, || {
        let p = &mut pods[d1];
        let o = Command::new("ip")
            .args(["netns", "exec", &net.ns(&p.host)])
            .arg(env!("CARGO_BIN_EXE_tandem"))
            .args(&pre_stop[1..])
            // An exec hook runs in the container, with its environment (the cluster's secret).
            .envs(p.container.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        assert!(o.status.success(), "preStop: {}", output_text(&o));
        let comp = p.component().to_string();
        zone.set(&comp, &p.name, &p.ip, p.port(), false);
        p.proc.as_ref().unwrap().signal(libc::SIGTERM);
    });
    assert_eq!(got, all_tokens, "every request completed");
    let (moved, handed) = (migrations() - before, handoffs() - handed_before);
    assert_eq!(moved, handed, "every stream that moved was handed over");
    assert!(handed > 0.0, "the leaving worker had streams running");
    let status = pods[d1]
        .proc
        .as_mut()
        .unwrap()
        .wait_exit(Duration::from_secs(300))
        .expect("the drained worker exited");
    assert!(status.success(), "{status}");

    for p in pods.iter_mut() {
        p.proc = None;
    }
    drop(router);

    // The baseline: the same containers on one host over loopback (the pods share 127.0.0.1, so
    // a group's second pod takes the next ports; their SRV records carry them).
    let loop_ns = net.host("loop", &format!("{SUBNET}.200"));
    let mut zone_l = Zone::new(dir.path().join("zone-loop.json"), zone.services.clone());
    let _dns_l = python_server_in(
        Some(&loop_ns),
        "dns_server.py",
        &["53".into(), zone_l.path.display().to_string()],
    );
    let log = dir.path().join("loopback.log");
    logs.0.push(log.clone());
    let mut lr = router_c.clone();
    for a in lr.args.iter_mut() {
        if a.starts_with("--dns-server=") {
            *a = "--dns-server=127.0.0.1:53".into();
        }
    }
    let mut loop_procs = vec![start_container(&loop_ns, &lr, &log)];
    let mut loop_pods = Vec::new();
    for comp in ["prefill", "decode"] {
        for i in 0..rendered.replicas(comp) {
            let name = format!("tandem-{comp}-{i}");
            let mut c = rendered.container(comp, &name, "127.0.0.1");
            for a in c.args.iter_mut() {
                for flag in ["--port=", "--kv-port="] {
                    if let Some(p) = a.strip_prefix(flag) {
                        *a = format!("{flag}{}", p.parse::<usize>().unwrap() + i);
                    }
                }
            }
            loop_procs.push(start_container(&loop_ns, &c, &log));
            loop_pods.push((comp, name, c.ports["grpc"] + i as u16));
        }
    }
    let loop_procs: Vec<Proc> = loop_procs.into_iter().map(|s| s.wait().0).collect();
    for (comp, name, port) in &loop_pods {
        zone_l.set(comp, name, "127.0.0.1", *port, true);
    }
    let h = format!("http://127.0.0.1:{}", router_c.ports["http"]);
    let c = cases.clone();
    let (tokens_l, secs_l) = block_in(&loop_ns, move || async move {
        until("the loopback cluster never became ready", || {
            cluster_ready(&h, 2, 2)
        })
        .await;
        load(h, c, 2, 12).await
    });
    assert_eq!(tokens_l, all_tokens);
    let loopback = tokens_l as f64 / secs_l;
    drop(loop_procs);
    println!(
        "multi-host (network namespaces, rendered chart, {}): commands started -> cluster ready {} ms; golden load ({} streams, 12 at once) across hosts {:.1} output tok/s, on loopback {:.1} output tok/s, ratio {:.3}",
        cpu_name(),
        ready_after.as_millis(),
        2 * cases.len(),
        across,
        loopback,
        across / loopback
    );
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default()
}
