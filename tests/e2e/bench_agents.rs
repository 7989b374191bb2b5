//! `tandem bench serve --agents` across hosts: network namespaces stand in for a server host (a
//! router and a decode worker) and two load hosts, each running `tandem bench agent`, joined by a
//! bridge (10.77.0.0/24, only inside this test's namespaces). The coordinator, on the first load
//! host, gives each agent its share of one Poisson schedule: the merged results equal the same
//! schedule sent by one process. Then one load host's cable is pulled mid-run: that agent is
//! reported lost with its share, the other's half is kept, and the command fails.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::netns::{block_in, Net};
use common::*;
use serde_json::Value;

const SERVER: &str = "10.77.0.2";
const LOADERS: [&str; 2] = ["10.77.0.11", "10.77.0.12"];

/// `tandem ARGS` inside namespace `ns`.
fn tandem_in(ns: &str, args: &[String]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_tandem")])
        .args(args)
        .stderr(Stdio::inherit())
        .env("TANDEM_LOG", "warn")
        .env("TANDEM_KV_SECRET", KV_SECRET);
    c
}

/// Runs `tandem bench serve` in `ns`: whether it succeeded, and its first JSON line.
fn bench_in(ns: &str, args: &[String]) -> (bool, Value, String) {
    let mut all = vec!["bench".to_string(), "serve".into()];
    all.extend(args.iter().cloned());
    let out = tandem_in(ns, &all).output().expect("tandem bench serve");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let first = stdout
        .lines()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .unwrap_or_else(|| panic!("no JSON line in {stdout:?}"));
    (out.status.success(), first, stdout)
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

#[test]
fn agents_on_two_hosts_add_up_to_one_process_and_a_cut_one_is_reported() {
    let mut net = Net::new();
    let server = net.host("srv", SERVER);
    let loaders: Vec<String> = LOADERS
        .iter()
        .enumerate()
        .map(|(i, a)| net.host(&format!("ld{i}"), a))
        .collect();
    let model = format!("--model={}", model_path().display());
    let (_decode, rest) = spawn_command(
        tandem_in(
            &server,
            &strings(&[
                "decode",
                &format!("--host={SERVER}"),
                "--port=0",
                &model,
                "--kv-cache-mb=256",
                "--kv-port=0",
            ]),
        ),
        Ready::DECODE,
    );
    let worker = ready_line(&rest).grpc().to_string();
    let (router_proc, line) = spawn_command(
        tandem_in(
            &server,
            &strings(&[
                "router",
                &format!("--host={SERVER}"),
                "--http-port=0",
                "--grpc-port=0",
                &model,
                "--poll-ms=100",
                &format!("--decode-workers={worker}"),
            ]),
        ),
        Ready::ROUTER,
    );
    // Kept to the end of the test: dropping it stops the router.
    let router = router_at(router_proc, &line);
    let http = router.http.clone();
    let ready = format!("{http}/ready");
    // The router is ready as seen from a load host (its worker probed).
    block_in(&loaders[0], move || async move {
        let end = Instant::now() + Duration::from_secs(120);
        while reqwest::get(&ready)
            .await
            .map_or(true, |r| !r.status().is_success())
        {
            assert!(Instant::now() < end, "router not ready at {ready}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let _agents: Vec<Proc> = loaders
        .iter()
        .zip(LOADERS)
        .map(|(ns, a)| {
            let args = strings(&["bench", "agent", &format!("--listen={a}:7800"), &model]);
            spawn_command(tandem_in(ns, &args), "bench agent listening on").0
        })
        .collect();
    let agents = format!("--agents={}:7800,{}:7800", LOADERS[0], LOADERS[1]);
    let load = strings(&[
        "--url",
        &http,
        &model,
        "--requests=24",
        "--rate=6",
        "--arrival=poisson",
        "--prompt-len=8-24",
        "--gen-len=8",
        "--seed=3",
        "--json",
        "--quiet",
        "--agent-silence=3",
    ]);

    let (ok, alone, out) = bench_in(&loaders[0], &load);
    assert!(ok, "{out}");
    let mut spread_args = load.clone();
    spread_args.push(agents.clone());
    let (ok, spread, out) = bench_in(&loaders[0], &spread_args);
    assert!(ok, "{out}");
    assert_eq!(spread["lost_agents"], serde_json::json!([]), "{out}");
    for k in ["requests", "ok", "errors", "input_tokens", "output_tokens"] {
        assert_eq!(
            alone[k], spread[k],
            "{k}: one process {alone} / two agents {spread}"
        );
    }
    assert_eq!(alone["ok"], 24, "{alone}");
    assert_eq!(alone["output_tokens"], 24 * 8, "{alone}");
    // Every gap the agents measured is in the merged histogram: one between each two chunks of
    // a request. (Not the one process's count: a server sends two tokens in one chunk where its
    // stream fell behind the engine, which depends on the machine's load.)
    for (run, s) in [("one process", &alone), ("two agents", &spread)] {
        let chunks = s["output_chunks"].as_u64().unwrap_or(0);
        assert!(
            (24..=24 * 8).contains(&chunks),
            "{run}: {chunks} chunks of 24 × 8 tokens: {s}"
        );
        assert_eq!(
            s["itl"]["count"].as_u64(),
            Some(chunks - 24),
            "{run}: every gap in the merged histogram: {s}"
        );
    }

    // The second load host's cable is pulled while its share runs: that agent goes silent.
    let ns = loaders[0].clone();
    let run = std::thread::spawn(move || bench_in(&ns, &spread_args));
    std::thread::sleep(Duration::from_millis(1500));
    net.link("ld1", false);
    let (ok, cut, out) = run.join().unwrap();
    net.link("ld1", true);
    assert!(!ok, "a lost agent fails the command: {out}");
    let lost = cut["lost_agents"].as_array().unwrap();
    assert_eq!(lost.len(), 1, "{out}");
    let text = lost[0].as_str().unwrap();
    assert!(text.contains(&format!("{}:7800", LOADERS[1])), "{text}");
    // The other agent's half of the schedule (sessions 0, 2, 4, ...) is there, and done.
    assert_eq!(cut["requests"], 12, "{out}");
    assert_eq!(cut["ok"], 12, "{out}");
}

/// Numbers that cannot describe a run are refused before anything starts, naming the flag.
#[test]
fn bad_numbers_are_refused_with_the_flag_named() {
    for (args, flag) in [
        (vec!["--rate=0"], "--rate"),
        (vec!["--requests=0"], "--requests"),
        (vec!["--stall-timeout=-1"], "--stall-timeout"),
        (vec!["--requests=4", "--warmup=4"], "--warmup"),
        (vec!["--trace-speedup=0"], "--trace-speedup"),
        (vec!["--dataset=alpaca"], "--dataset"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["bench", "serve", "--url", "http://127.0.0.1:9"])
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
