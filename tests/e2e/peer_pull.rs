//! KV pulled from a peer: a prompt one decode worker holds, sent to another, is not computed
//! there: the router names the holder as the prompt's prefill worker, the holder's Prefill
//! service (beside its Decode service) computes only what it lacks and pushes every block over the
//! KV plane, and the text is what the holder itself gives. With the pull turned off, the second
//! worker computes the prompt.

use crate::common;

use common::netns::{block_in, start_in};
use common::*;

/// Two decode workers behind a round-robin router (so the second request of a prompt goes to
/// the worker that lacks it), prompts of 64 tokens or more uncached eligible for remote prefill.
async fn two_workers(pull: bool) -> (Vec<(Proc, String, String)>, Router) {
    let workers: Vec<(Proc, String, String)> = (0..2).map(|_| start_decode(&[])).collect();
    let addrs: Vec<String> = workers.iter().map(|(_, a, _)| a.clone()).collect();
    let mut flags = vec!["--policy=round-robin", "--disagg-min-tokens=64"];
    if !pull {
        flags.push("--no-peer-pull");
    }
    let router = start_router(&addrs, &flags);
    wait_ready(&router, 2).await;
    (workers, router)
}

async fn moved(workers: &[(Proc, String, String)]) -> Vec<f64> {
    let mut v = Vec::new();
    for (_, addr, _) in workers {
        v.push(metric(
            &scrape(addr).await,
            "tandem_kv_transfer_bytes_total",
        ));
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_one_decode_worker_holds_is_pulled_by_the_other() {
    let (workers, router) = two_workers(true).await;
    let p = id_prompt(7, 200);
    let want = complete_ids(&router, &p).await;
    // The router's index hears of the blocks the first worker cached.
    wait_router_cached(&router, 12).await;
    let before = moved(&workers).await;
    let got = complete_ids(&router, &p).await;
    assert_eq!(got, want);
    let after = moved(&workers).await;
    // One worker received the prompt's KV (12 full blocks and the last, partial one), the
    // other none.
    let gained: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(
        gained.iter().any(|&g| g > 0.0) && gained.contains(&0.0),
        "{gained:?}"
    );
    let rm = scrape(&router.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="remote"}"#),
        1.0
    );
    // Nothing was measured before that pull: the threshold decided.
    assert_eq!(
        metric(
            &rm,
            r#"tandem_router_prefill_crossover_total{estimate="unmeasured"}"#
        ),
        1.0
    );
    // The puller measured the link it pulled over, and reports it with its KV size a token.
    let (w0, w1) = (workers[0].1.clone(), workers[1].1.clone());
    let (holder, puller) = if gained[1] > 0.0 {
        (&w0, &w1)
    } else {
        (&w1, &w0)
    };
    let load = worker_load(puller).await;
    assert!(load.kv_bytes_per_token > 0.0, "{load:?}");
    let link = load
        .kv_links
        .iter()
        .find(|l| &l.source == holder)
        .unwrap_or_else(|| panic!("no link from {holder}: {load:?}"));
    assert!(link.bytes_per_s > 0.0);

    // Round robin: one unique prompt each (both measure a prefill rate), then a prompt on the
    // holder and again on the puller, over the link it measured: this time the rates decide.
    for seed in [20, 21] {
        complete_ids(&router, &id_prompt(seed, 200)).await;
    }
    wait_prefill_rates(&router).await;
    let q = id_prompt(22, 200);
    let want = complete_ids(&router, &q).await;
    wait_router_cached(&router, 24).await;
    assert_eq!(complete_ids(&router, &q).await, want);
    let rm = scrape(&router.http).await;
    let measured = metric(
        &rm,
        r#"tandem_router_prefill_crossover_total{estimate="remote_faster"}"#,
    ) + metric(
        &rm,
        r#"tandem_router_prefill_crossover_total{estimate="local_faster"}"#,
    );
    assert_eq!(measured, 1.0, "{rm:?}");

    // Without the pull, the second request of a prompt is computed where it lands.
    let (workers, router) = two_workers(false).await;
    let p = id_prompt(8, 200);
    let want = complete_ids(&router, &p).await;
    wait_router_cached(&router, 12).await;
    assert_eq!(complete_ids(&router, &p).await, want);
    assert_eq!(moved(&workers).await, [0.0, 0.0]);
    let rm = scrape(&router.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="remote"}"#),
        0.0
    );
}

/// The measured crossover over a slow link: two decode workers on hosts whose links are shaped to
/// 20 Mbit/s (a 128-token prompt's KV, 6 MB, takes about 2.4 s to cross; computing it takes a
/// small part of that on any machine CI runs on). The first pull goes by the threshold (nothing is
/// measured yet) and measures the link; once each worker has measured its prefill rate, a prompt
/// held by the other worker is computed where it lands: the estimate said so.
#[test]
fn over_a_link_slower_than_computing_the_prompt_is_computed_instead_of_pulled() {
    use tandem_discovery::Ready;
    let mut net = common::netns::Net::new();
    let hosts = [
        net.host("d0", "10.79.0.2"),
        net.host("d1", "10.79.0.3"),
        net.host("rt", "10.79.0.4"),
    ];
    for h in &hosts[..2] {
        let tc = std::process::Command::new("ip")
            .args([
                "netns", "exec", h, "tc", "qdisc", "add", "dev", "eth0", "root",
            ])
            .args(["tbf", "rate", "20mbit", "burst", "32kbit", "latency", "1s"])
            .output()
            .expect("tc (iproute2)");
        assert!(
            tc.status.success(),
            "{}",
            String::from_utf8_lossy(&tc.stderr)
        );
    }
    let model = format!("--model={}", model_path().display());
    let args = |a: &[&str]| -> Vec<String> { a.iter().map(|s| s.to_string()).collect() };
    let mut procs = Vec::new();
    let mut addrs = Vec::new();
    for (h, ip) in hosts[..2].iter().zip(["10.79.0.2", "10.79.0.3"]) {
        let (p, line) = start_in(
            h,
            &args(&[
                "decode",
                &format!("--host={ip}"),
                "--port=0",
                &model,
                "--kv-cache-mb=256",
                "--kv-port=0",
            ]),
            Ready::DECODE,
        );
        procs.push(p);
        addrs.push(ready_line(&line).grpc().to_string());
    }
    let (router, line) = start_in(
        &hosts[2],
        &args(&[
            "router",
            "--host=127.0.0.1",
            "--http-port=0",
            "--grpc-port=0",
            &model,
            "--poll-ms=100",
            &format!("--decode-workers={}", addrs.join(",")),
            "--policy=round-robin",
            "--disagg-min-tokens=64",
        ]),
        Ready::ROUTER,
    );
    let r = router_at(router, &line);
    block_in(&hosts[2], move || async move {
        wait_ready(&r, 2).await;
        let moved = || async {
            let mut v = Vec::new();
            for a in &addrs {
                v.push(metric(&scrape(a).await, "tandem_kv_transfer_bytes_total"));
            }
            v
        };
        let crossover = |said: &str| {
            let r = &r;
            let key = format!(r#"tandem_router_prefill_crossover_total{{estimate="{said}"}}"#);
            async move { metric(&scrape(&r.http).await, &key) }
        };
        // A prompt, then again on the other worker: pulled (nothing measured yet).
        let a = id_prompt(30, 128);
        let want = complete_ids(&r, &a).await;
        wait_router_cached(&r, 8).await;
        assert_eq!(complete_ids(&r, &a).await, want);
        assert_eq!(crossover("unmeasured").await, 1.0);
        let pulled: f64 = moved().await.iter().sum();
        assert!(pulled > 0.0);
        // One unique prompt each: both measure their prefill rates.
        for seed in [31, 32] {
            complete_ids(&r, &id_prompt(seed, 128)).await;
        }
        wait_prefill_rates(&r).await;
        // A prompt on the first worker, then on the second, which measured the slow link:
        // computed there, nothing pulled.
        let indexed = || async {
            let v = router_state(&r.http).await;
            v["workers"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|w| w["cached_blocks"].as_u64())
                .sum::<u64>()
        };
        let before = indexed().await;
        let d = id_prompt(33, 128);
        let want = complete_ids(&r, &d).await;
        until("the router indexes the new prompt's blocks", || async {
            indexed().await >= before + 8
        })
        .await;
        assert_eq!(complete_ids(&r, &d).await, want);
        assert_eq!(crossover("local_faster").await, 1.0);
        assert_eq!(crossover("remote_faster").await, 0.0);
        let total: f64 = moved().await.iter().sum();
        assert_eq!(total, pulled, "nothing pulled the second time");
    });
    drop(procs);
}
