//! The KV disk tier through a real worker (`--kv-disk-dir`): a prompt pushed out of a small pool
//! by others comes back from disk with the same text, the worker's `/metrics` counting the
//! blocks written and read; and after the worker restarts on the same directory, the prompt is
//! read back again instead of computed.

use crate::common;

use common::*;

/// Requests wait for their blocks from disk as long as the read takes (the default gives up
/// after 2 s and computes them): the tests count blocks read back, which a read slowed by a
/// busy machine must not turn into blocks computed.
const PATIENT: &str = "--kv-disk-max-wait-ms=600000";

/// A worker of 24 blocks (384 tokens) over the tier in `dir`, and its router.
fn cluster(dir: &std::path::Path) -> (Proc, String, Router) {
    let disk = format!("--kv-disk-dir={}", dir.display());
    let (p, worker) = start_worker(&["--kv-blocks=24", &disk, "--kv-disk-gb=1", PATIENT]);
    let router = start_router(std::slice::from_ref(&worker), &[]);
    (p, worker, router)
}

async fn counter(worker: &str, name: &str) -> f64 {
    metric(&scrape(worker).await, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_pushed_out_of_the_pool_comes_back_from_disk_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let a = id_prompt(0, 200);
    let (want, written) = {
        let (_p, worker, router) = cluster(dir.path());
        wait_ready(&router, 1).await;
        let want = complete_ids(&router, &a).await;
        // Three other prompts of 200 tokens leave nothing of the first in 24 blocks.
        for seed in 1..4 {
            complete_ids(&router, &id_prompt(seed, 200)).await;
        }
        // Written behind: wait for the first prompt's 12 full blocks (and more) to land.
        until("the evicted blocks are written", || async {
            counter(&worker, "tandem_kv_disk_blocks_written_total").await >= 12.0
        })
        .await;
        assert_eq!(
            counter(&worker, "tandem_kv_disk_blocks_read_total").await,
            0.0
        );
        let got = complete_ids(&router, &a).await;
        assert_eq!(got, want);
        let m = scrape(&worker).await;
        assert!(
            metric(&m, "tandem_kv_disk_blocks_read_total") >= 12.0,
            "{m:?}"
        );
        assert_eq!(
            metric(&m, "tandem_kv_disk_refusals_total{reason=\"checksum\"}"),
            0.0
        );
        assert_eq!(
            m.get("tandem_kv_disk_wait_expired_total"),
            Some(&0.0),
            "no request stopped waiting for its blocks"
        );
        assert!(metric(&m, "tandem_kv_disk_bytes_moved_total{direction=\"read\"}") > 0.0);
        assert!(metric(&m, "tandem_kv_disk_bytes{kind=\"used\"}") > 0.0);
        assert_eq!(
            metric(&m, "tandem_kv_disk_bytes{kind=\"capacity\"}"),
            (1u64 << 30) as f64
        );
        (want, metric(&m, "tandem_kv_disk_blocks_written_total"))
    };
    assert!(written >= 12.0);
    // A new worker on the same directory reads the prompt's blocks from its first request.
    let (_p, worker, router) = cluster(dir.path());
    wait_ready(&router, 1).await;
    assert_eq!(complete_ids(&router, &a).await, want);
    assert!(counter(&worker, "tandem_kv_disk_blocks_read_total").await >= 12.0);
    assert!(counter(&worker, "tandem_kv_disk_blocks").await >= 12.0);
}

/// The router knows which worker holds a prefix on disk (the workers' KV events name the tier):
/// a prompt pushed out to one worker's disk goes back to that worker, which reads it back.
/// (With reading back weighed as dear as computing, `--kv-disk-weight=1`, the tie goes to the
/// other worker and this fails: checked when it was written.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_sends_a_prompt_to_the_worker_holding_it_on_disk() {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let workers: Vec<(Proc, String)> = dirs
        .iter()
        .map(|d| {
            let disk = format!("--kv-disk-dir={}", d.path().display());
            start_worker(&["--kv-blocks=24", &disk, "--kv-disk-gb=1", PATIENT])
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|(_, a)| a.clone()).collect();
    let router = start_router(&addrs, &[]);
    wait_ready(&router, 2).await;
    let a = id_prompt(50, 200);
    let want = complete_ids(&router, &a).await;
    // Six others, spread over the two workers (no cache to choose by), push it out of the pool.
    for seed in 51..57 {
        complete_ids(&router, &id_prompt(seed, 200)).await;
    }
    until(
        "the router hears of the first prompt's blocks on disk",
        || async {
            let v = router_state(&router.http).await;
            v["workers"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|w| w["disk_blocks"].as_u64())
                .max()
                .unwrap_or(0)
                >= 12
        },
    )
    .await;
    let read = || async {
        let mut r = Vec::new();
        for w in &addrs {
            r.push(counter(w, "tandem_kv_disk_blocks_read_total").await);
        }
        r
    };
    let before = read().await;
    assert_eq!(complete_ids(&router, &a).await, want);
    let after = read().await;
    // One worker read the prompt's 12 full blocks back; the other computed nothing of it.
    let gained: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(
        gained.iter().any(|&g| g >= 12.0) && gained.contains(&0.0),
        "{gained:?}"
    );
}
