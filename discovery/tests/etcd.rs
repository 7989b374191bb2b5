//! Registration and the router's view against a real etcd (the `etcd` binary: scripts/test
//! installs Debian's etcd-server), started here on free loopback ports with a temporary data
//! directory, stopped and restarted mid-test.
#![cfg(feature = "etcd")]

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_discovery::{follow, Cards, ClusterPath, KvStore, Registration, Role, WorkerCard};
use tokio::sync::watch;

/// Answers from a local etcd come in milliseconds; this bounds only a broken one.
const TIMEOUT: Duration = Duration::from_secs(5);
const TTL: Duration = Duration::from_secs(2);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Etcd {
    child: Child,
    port: u16,
}

impl Etcd {
    fn start(dir: &std::path::Path, port: u16) -> Self {
        let peer = free_port();
        let child = Command::new("etcd")
            .args([
                "--name=t",
                &format!("--data-dir={}", dir.display()),
                &format!("--listen-client-urls=http://127.0.0.1:{port}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{port}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-cluster=t=http://127.0.0.1:{peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the etcd binary (scripts/test installs Debian's etcd-server)");
        Self { child, port }
    }

    fn endpoints(&self) -> Vec<String> {
        vec![format!("http://127.0.0.1:{}", self.port)]
    }

    /// Runs `etcdctl ARGS` against this etcd; returns its stdout.
    fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=127.0.0.1:{}", self.port))
            .args(args)
            .output()
            .expect("etcdctl (scripts/test installs Debian's etcd-client)");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

fn card(role: Role, id: &str) -> WorkerCard {
    WorkerCard {
        role,
        worker_id: id.into(),
        grpc_addr: format!("127.0.0.1:{}", 1000 + id.len()),
        kv_addr: None,
        model: "m".into(),
        block_size: 16,
        kv_dtype: "f32".into(),
        tp: 1,
        version: "test".into(),
    }
}

/// Registers a worker `id` of `role` in `etcd` (the default card).
fn register(etcd: &Etcd, cluster: &ClusterPath, role: Role, id: &str) -> Registration {
    Registration::start(etcd.endpoints(), cluster, card(role, id), TTL, TIMEOUT).unwrap()
}

/// Waits until the view satisfies `ok`; the bound is generous (etcd answers in milliseconds,
/// a lease expires after its TTL) and a failure prints the last view.
async fn wait_view(rx: &mut watch::Receiver<Cards>, what: &str, ok: impl Fn(&Cards) -> bool) {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        if ok(&rx.borrow_and_update()) {
            return;
        }
        let left = end.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{what}: view is {:?}",
            rx.borrow().keys().collect::<Vec<_>>()
        );
        let _ = tokio::time::timeout(left, rx.changed()).await;
    }
}

fn ids(view: &Cards) -> Vec<String> {
    view.values().map(|c| c.worker_id.clone()).collect()
}

/// Starts etcd and waits until it answers.
async fn started(dir: &std::path::Path, port: u16) -> Etcd {
    let etcd = Etcd::start(dir, port);
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let probe = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([&format!("--endpoints=127.0.0.1:{port}"), "get", "probe"])
            .output();
        if probe.is_ok_and(|o| o.status.success()) {
            return etcd;
        }
        assert!(Instant::now() < end, "etcd did not start on port {port}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_leave_expire_and_survive_an_etcd_restart() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut etcd = started(dir.path(), port).await;
    let cluster = ClusterPath::new("t1").unwrap();
    let malformed = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = malformed.clone();
    let mut view = follow(
        etcd.endpoints(),
        cluster.clone(),
        TIMEOUT,
        Arc::new(move |key, _| seen.lock().unwrap().push(key.to_string())),
    )
    .await
    .unwrap();
    assert!(view.borrow().is_empty());

    // Two workers register; the view shows both with their cards.
    let d0 = register(&etcd, &cluster, Role::Decode, "d0");
    let p0 = register(&etcd, &cluster, Role::Prefill, "p0");
    assert_eq!(d0.key(), "/tandem/t1/decode/d0");
    wait_view(&mut view, "both registered", |v| v.len() == 2).await;
    assert_eq!(view.borrow()[p0.key()], card(Role::Prefill, "p0"));

    // A card that is not one is skipped and reported; a key of another cluster is not seen.
    etcd.ctl(&["put", "/tandem/t1/decode/bad", "{\"role\": 3}"]);
    etcd.ctl(&[
        "put",
        "/tandem/t2/decode/x",
        &card(Role::Decode, "x").to_json(),
    ]);
    let end = Instant::now() + Duration::from_secs(60);
    while malformed.lock().unwrap().is_empty() {
        assert!(Instant::now() < end, "malformed card not reported");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        *malformed.lock().unwrap(),
        vec!["/tandem/t1/decode/bad".to_string()]
    );
    assert_eq!(ids(&view.borrow()), vec!["d0", "p0"]);

    // Deregistering removes the key at once (not after the TTL).
    p0.deregister().await;
    wait_view(&mut view, "p0 deregistered", |v| ids(v) == ["d0"]).await;

    // A worker that stops keeping its lease alive (what kill -9 leaves) goes after its TTL.
    let granted = etcd.ctl(&["lease", "grant", "2"]);
    let lease = granted.split_whitespace().nth(1).expect("lease id");
    etcd.ctl(&[
        "put",
        &format!("--lease={lease}"),
        &cluster.key(Role::Decode, "killed").unwrap(),
        &card(Role::Decode, "killed").to_json(),
    ]);
    wait_view(&mut view, "killed appears", |v| v.len() == 2).await;
    wait_view(&mut view, "killed expires", |v| ids(v) == ["d0"]).await;

    // etcd stops: the view keeps what it knew. It comes back with its data: the registration
    // is still (or again) there, a worker that registers now is seen, and one whose key was
    // written while the follower was cut off shows up through the fresh list.
    etcd.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ids(&view.borrow()), vec!["d0"]);
    let etcd = started(dir.path(), port).await;
    etcd.ctl(&[
        "put",
        &cluster.key(Role::Prefill, "direct").unwrap(),
        &card(Role::Prefill, "direct").to_json(),
    ]);
    let d1 = register(&etcd, &cluster, Role::Decode, "d1");
    wait_view(&mut view, "after the restart", |v| {
        ids(v) == ["d0", "d1", "direct"]
    })
    .await;
    assert!(d0.stats().registered.load(Ordering::Relaxed));
    drop(d1);
    drop(d0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_etcd_gets_the_registrations_back_and_drops_stale_members() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut etcd = started(dir.path(), port).await;
    let cluster = ClusterPath::new("t3").unwrap();
    let mut view = follow(
        etcd.endpoints(),
        cluster.clone(),
        TIMEOUT,
        Arc::new(|_, _| {}),
    )
    .await
    .unwrap();
    let d0 = register(&etcd, &cluster, Role::Decode, "d0");
    etcd.ctl(&[
        "put",
        &cluster.key(Role::Decode, "stale").unwrap(),
        &card(Role::Decode, "stale").to_json(),
    ]);
    wait_view(&mut view, "both", |v| v.len() == 2).await;

    // etcd comes back empty (its data lost): the worker's lease is gone, so it registers again
    // under a new one; the follower lists afresh and forgets the member etcd no longer has.
    etcd.stop();
    let fresh = tempfile::tempdir().unwrap();
    let _etcd = started(fresh.path(), port).await;
    wait_view(&mut view, "re-registered, stale gone", |v| ids(v) == ["d0"]).await;
    let end = Instant::now() + Duration::from_secs(60);
    while d0.stats().registrations.load(Ordering::Relaxed) < 2 {
        assert!(Instant::now() < end, "no second registration");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d0.deregister().await;
    wait_view(&mut view, "deregistered", |v| v.is_empty()).await;
}

#[tokio::test]
async fn an_etcd_that_is_down_at_start_is_a_clear_error() {
    let port = free_port();
    let endpoints = vec![format!("http://127.0.0.1:{port}")];
    let cluster = ClusterPath::new("t2").unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let err = follow(endpoints.clone(), cluster.clone(), TIMEOUT, {
        let calls = calls.clone();
        Arc::new(move |_, _| {
            calls.fetch_add(1, Ordering::Relaxed);
        })
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains(&format!("etcd at 127.0.0.1:{port}")), "{err}");
    let err = tokio::task::spawn_blocking(move || {
        Registration::start(endpoints, &cluster, card(Role::Decode, "d"), TTL, TIMEOUT)
            .err()
            .map(|e| e.to_string())
    })
    .await
    .unwrap()
    .expect("registration against a down etcd fails");
    assert!(err.contains(&format!("etcd at 127.0.0.1:{port}")), "{err}");
}

/// The key-value store (the router's stored responses): values under its prefix, replaced,
/// read, deleted, and gone by themselves once their lease's TTL has passed since the last
/// write; a down etcd is a clear error at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_store_puts_gets_deletes_and_expires_values() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = started(dir.path(), free_port()).await;
    let kv = KvStore::connect(
        etcd.endpoints(),
        "/tandem/kv/responses/".into(),
        TTL,
        TIMEOUT,
    )
    .await
    .unwrap();
    assert_eq!(kv.get("a").await.unwrap(), None);
    kv.put("a", b"one".to_vec()).await.unwrap();
    kv.put("b", b"two".to_vec()).await.unwrap();
    kv.put("a", b"three".to_vec()).await.unwrap();
    assert_eq!(kv.get("a").await.unwrap().as_deref(), Some(&b"three"[..]));
    assert_eq!(
        etcd.ctl(&["get", "--prefix", "--keys-only", "/tandem/kv/responses/"])
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["/tandem/kv/responses/a", "/tandem/kv/responses/b"]
    );
    assert!(kv.delete("b").await.unwrap());
    assert!(!kv.delete("b").await.unwrap());
    assert_eq!(kv.get("b").await.unwrap(), None);
    // "a" expires on its own once its lease runs out (etcd's clock; waited for, not timed).
    let end = Instant::now() + Duration::from_secs(60);
    while kv.get("a").await.unwrap().is_some() {
        assert!(Instant::now() < end, "a value outlived its lease by far");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let port = free_port();
    let err = KvStore::connect(
        vec![format!("http://127.0.0.1:{port}")],
        "/x/".into(),
        TTL,
        TIMEOUT,
    )
    .await
    .err()
    .expect("a down etcd")
    .to_string();
    assert!(err.contains(&format!("etcd at 127.0.0.1:{port}")), "{err}");
}
