//! etcd: a worker's registration (its card under a lease) and the router's view of the cluster.
//!
//! A registration lives on a thread of its own with its own runtime, so a worker whose engine
//! and network threads are busy cannot starve the lease's keep-alives. The router's view is one
//! task: list the cluster's prefix, then watch it from the next revision; when the watch breaks
//! (etcd restarted, connection lost) or its revision was compacted, it lists again and replaces
//! the whole view, so a missed event cannot leave a stale member behind. While etcd cannot be
//! reached the last view stays: the workers keep serving.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use tokio::sync::{oneshot, watch};

use crate::{CardError, ClusterPath, DiscoveryError, WorkerCard};

/// Every valid card of a cluster, by key.
pub type Cards = BTreeMap<String, WorkerCard>;

fn failure(
    endpoints: &[String],
    what: &'static str,
    detail: impl std::fmt::Display,
) -> DiscoveryError {
    let hosts: Vec<&str> = endpoints
        .iter()
        .map(|e| e.trim_start_matches("http://"))
        .collect();
    DiscoveryError::Etcd {
        endpoints: hosts.join(","),
        what,
        detail: detail.to_string(),
    }
}

/// `call`, given up after `timeout` (an answer from etcd, not work of ours, is what is waited for).
async fn bounded<T, E: std::fmt::Display>(
    endpoints: &[String],
    what: &'static str,
    timeout: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(failure(endpoints, what, e)),
        Err(_) => Err(failure(
            endpoints,
            what,
            format!("no answer within {} ms", timeout.as_millis()),
        )),
    }
}

async fn connect(endpoints: &[String], timeout: Duration) -> Result<Client, DiscoveryError> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(timeout)
        // HTTP/2 pings find a silent etcd (a cut link) on the watch and keep-alive streams.
        .with_keep_alive(Duration::from_secs(2), timeout)
        .with_keep_alive_while_idle(true);
    bounded(
        endpoints,
        "connect",
        timeout,
        Client::connect(endpoints, Some(opts)),
    )
    .await
}

/// What a worker's registration has done so far.
#[derive(Debug, Default)]
pub struct RegistrationStats {
    /// Times the card was written under a new lease (1 after the first registration).
    pub registrations: AtomicU64,
    /// Whether the card is in etcd under a live lease now, as far as the worker knows.
    pub registered: AtomicBool,
}

/// A worker's card in etcd under a lease, kept alive until [`Registration::deregister`] (or
/// drop). Losing the lease (etcd restarted without its data, a pause longer than the TTL)
/// registers again under a new one.
pub struct Registration {
    key: String,
    stop: Option<oneshot::Sender<oneshot::Sender<()>>>,
    stats: Arc<RegistrationStats>,
}

impl Registration {
    /// Writes `card` under its key in `cluster` with a lease of `ttl` and keeps it there. Fails,
    /// naming the endpoints, when etcd does not answer within `timeout` at the first try.
    pub fn start(
        endpoints: Vec<String>,
        cluster: &ClusterPath,
        card: WorkerCard,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, DiscoveryError> {
        let key = cluster.key(card.role, &card.worker_id)?;
        let stats = Arc::new(RegistrationStats::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let keeper = Keeper {
            endpoints: endpoints.clone(),
            key: key.clone(),
            value: card.to_json(),
            ttl,
            timeout,
            stats: stats.clone(),
        };
        std::thread::Builder::new()
            .name("tandem-etcd-lease".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt.block_on(keeper.run(ready_tx, stop_rx)),
                    Err(e) => {
                        let _ = ready_tx.send(Err(failure(&keeper.endpoints, "runtime", e)));
                    }
                }
            })
            .map_err(|e| failure(&endpoints, "thread", e))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                key,
                stop: Some(stop_tx),
                stats,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(failure(&endpoints, "register", "the lease thread died")),
        }
    }

    /// The key the card lives under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// What the registration has done so far.
    pub fn stats(&self) -> &Arc<RegistrationStats> {
        &self.stats
    }

    /// Deletes the card and revokes the lease; returns once etcd has answered (or each call has
    /// timed out: the lease then expires on its own).
    pub async fn deregister(mut self) {
        if let Some(stop) = self.stop.take() {
            let (ack_tx, ack_rx) = oneshot::channel();
            if stop.send(ack_tx).is_ok() {
                let _ = ack_rx.await;
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // The thread deletes the key on its own; nobody waits for it.
        if let Some(stop) = self.stop.take() {
            let (ack_tx, _) = oneshot::channel();
            let _ = stop.send(ack_tx);
        }
    }
}

enum KeepAlive {
    Stop(oneshot::Sender<()>),
    Lost(String),
}

struct Keeper {
    endpoints: Vec<String>,
    key: String,
    value: String,
    ttl: Duration,
    timeout: Duration,
    stats: Arc<RegistrationStats>,
}

type StopRx = oneshot::Receiver<oneshot::Sender<()>>;

impl Keeper {
    async fn register(&self) -> Result<(Client, i64), DiscoveryError> {
        let ep = &self.endpoints;
        let mut client = connect(ep, self.timeout).await?;
        let ttl_s = self.ttl.as_secs().max(1) as i64;
        let lease = bounded(
            ep,
            "lease grant",
            self.timeout,
            client.lease_grant(ttl_s, None),
        )
        .await?
        .id();
        let opts = PutOptions::new().with_lease(lease);
        let put = client.put(self.key.clone(), self.value.clone(), Some(opts));
        bounded(ep, "put", self.timeout, put).await?;
        Ok((client, lease))
    }

    async fn run(
        self,
        ready: std::sync::mpsc::Sender<Result<(), DiscoveryError>>,
        mut stop: StopRx,
    ) {
        let mut first = Some(ready);
        let mut backoff = Duration::from_millis(200);
        loop {
            let attempt = tokio::select! {
                r = self.register() => r,
                ack = &mut stop => {
                    if let Ok(ack) = ack { let _ = ack.send(()); }
                    return;
                }
            };
            let (mut client, lease) = match attempt {
                Ok(registered) => registered,
                Err(e) => {
                    if let Some(ready) = first.take() {
                        let _ = ready.send(Err(e));
                        return;
                    }
                    tracing::warn!(key = %self.key, error = %e, "etcd registration failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        ack = &mut stop => {
                            if let Ok(ack) = ack { let _ = ack.send(()); }
                            return;
                        }
                    }
                    backoff = (backoff * 2).min(self.ttl.max(Duration::from_secs(1)));
                    continue;
                }
            };
            backoff = Duration::from_millis(200);
            let n = self.stats.registrations.fetch_add(1, Ordering::Relaxed) + 1;
            self.stats.registered.store(true, Ordering::Relaxed);
            match first.take() {
                Some(ready) => {
                    tracing::info!(key = %self.key, lease, "registered in etcd");
                    let _ = ready.send(Ok(()));
                }
                None => {
                    tracing::warn!(key = %self.key, lease, registrations = n, "registered in etcd again")
                }
            }
            match self.keep_alive(&mut client, lease, &mut stop).await {
                KeepAlive::Stop(ack) => {
                    // The key goes first: the router stops sending new requests before the
                    // worker drains the ones it has.
                    let ep = &self.endpoints;
                    if let Err(e) = bounded(
                        ep,
                        "delete",
                        self.timeout,
                        client.delete(self.key.clone(), None),
                    )
                    .await
                    {
                        tracing::warn!(key = %self.key, error = %e, "deregistering: the key stays until its lease expires");
                    }
                    let _ =
                        bounded(ep, "lease revoke", self.timeout, client.lease_revoke(lease)).await;
                    self.stats.registered.store(false, Ordering::Relaxed);
                    tracing::info!(key = %self.key, "deregistered from etcd");
                    let _ = ack.send(());
                    return;
                }
                KeepAlive::Lost(reason) => {
                    self.stats.registered.store(false, Ordering::Relaxed);
                    tracing::warn!(key = %self.key, %reason, "etcd lease lost; registering again");
                }
            }
        }
    }

    /// Renews the lease every third of its TTL until told to stop or the lease is lost.
    async fn keep_alive(&self, client: &mut Client, lease: i64, stop: &mut StopRx) -> KeepAlive {
        let stopped = |ack: Result<oneshot::Sender<()>, _>| match ack {
            Ok(ack) => KeepAlive::Stop(ack),
            // The registration was dropped without a deregister: still delete the key.
            Err(_) => KeepAlive::Stop(oneshot::channel().0),
        };
        let (mut keeper, mut answers) = tokio::select! {
            r = client.lease_keep_alive(lease) => match r {
                Ok(pair) => pair,
                Err(e) => return KeepAlive::Lost(e.to_string()),
            },
            ack = &mut *stop => return stopped(ack),
        };
        let every = (self.ttl / 3).max(Duration::from_millis(100));
        loop {
            if let Err(e) = keeper.keep_alive().await {
                return KeepAlive::Lost(e.to_string());
            }
            // No answer within a whole TTL means the lease is gone whatever etcd says later.
            let answer = tokio::select! {
                a = tokio::time::timeout(self.ttl.max(Duration::from_secs(1)), answers.message()) => a,
                ack = &mut *stop => return stopped(ack),
            };
            match answer {
                Ok(Ok(Some(a))) if a.ttl() > 0 => {}
                Ok(Ok(Some(_))) => return KeepAlive::Lost("the lease expired".into()),
                Ok(Ok(None)) => return KeepAlive::Lost("keep-alive stream closed".into()),
                Ok(Err(e)) => return KeepAlive::Lost(e.to_string()),
                Err(_) => return KeepAlive::Lost("no keep-alive answer within the TTL".into()),
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                ack = &mut *stop => return stopped(ack),
            }
        }
    }
}

/// Called for each stored value under the cluster's prefix that is not a valid card (key, why).
pub type OnMalformed = Arc<dyn Fn(&str, &CardError) + Send + Sync>;

async fn list(
    client: &mut Client,
    endpoints: &[String],
    cluster: &ClusterPath,
    timeout: Duration,
    on_malformed: &OnMalformed,
) -> Result<(Cards, i64), DiscoveryError> {
    let get = client.get(cluster.prefix(), Some(GetOptions::new().with_prefix()));
    let resp = bounded(endpoints, "list", timeout, get).await?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    let mut cards = Cards::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        match WorkerCard::parse(cluster, &key, kv.value()) {
            Ok(card) => {
                cards.insert(key, card);
            }
            Err(e) => on_malformed(&key, &e),
        }
    }
    Ok((cards, revision))
}

/// Lists the cluster's cards, then follows every change. Fails, naming the endpoints, when the
/// first list gets no answer within `timeout`; after that, a lost etcd keeps the last view
/// until it answers again, and the view is then listed afresh.
pub async fn follow(
    endpoints: Vec<String>,
    cluster: ClusterPath,
    timeout: Duration,
    on_malformed: OnMalformed,
) -> Result<watch::Receiver<Cards>, DiscoveryError> {
    let mut client = connect(&endpoints, timeout).await?;
    let (cards, revision) = list(&mut client, &endpoints, &cluster, timeout, &on_malformed).await?;
    let (tx, rx) = watch::channel(cards);
    let follower = Follower {
        endpoints,
        cluster,
        timeout,
        on_malformed,
        tx,
    };
    tokio::spawn(follower.run(client, revision));
    Ok(rx)
}

/// Why a watch ended, and whether it delivered anything first.
struct Ended {
    why: String,
    progressed: bool,
}

struct Follower {
    endpoints: Vec<String>,
    cluster: ClusterPath,
    timeout: Duration,
    on_malformed: OnMalformed,
    tx: watch::Sender<Cards>,
}

impl Follower {
    async fn run(self, mut client: Client, mut revision: i64) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.watch(&mut client, revision).await {
                Ok(()) => return, // nobody follows any more
                Err(Ended { why, progressed }) => {
                    tracing::warn!(%why, "etcd watch ended; listing the cluster again");
                    // A watch that fails before it delivers anything (refused, compacted at
                    // once) must not turn list-then-watch into a busy loop.
                    if progressed {
                        backoff = Duration::from_millis(100);
                    } else {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
            // List again until etcd answers; the last view stays meanwhile.
            loop {
                if self.tx.is_closed() {
                    return;
                }
                let relisted = async {
                    let mut c = connect(&self.endpoints, self.timeout).await?;
                    let (cards, rev) = list(
                        &mut c,
                        &self.endpoints,
                        &self.cluster,
                        self.timeout,
                        &self.on_malformed,
                    )
                    .await?;
                    Ok::<_, DiscoveryError>((c, cards, rev))
                }
                .await;
                match relisted {
                    Ok((c, cards, rev)) => {
                        self.tx.send_if_modified(|view| {
                            let changed = *view != cards;
                            *view = cards;
                            changed
                        });
                        client = c;
                        revision = rev;
                        tracing::info!(revision, "etcd view listed afresh");
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "etcd not answering; keeping the last view");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
    }

    /// Applies every change after `revision`; returns why the watch ended, or `Ok` once no one
    /// follows the view.
    async fn watch(&self, client: &mut Client, revision: i64) -> Result<(), Ended> {
        let mut progressed = false;
        let ended = |why: String, progressed: bool| Ended { why, progressed };
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = client
            .watch(self.cluster.prefix(), Some(opts))
            .await
            .map_err(|e| ended(e.to_string(), false))?;
        loop {
            let msg = tokio::select! {
                m = stream.message() => m,
                _ = self.tx.closed() => return Ok(()),
            };
            let resp = match msg {
                Ok(Some(r)) => r,
                Ok(None) => return Err(ended("the watch stream closed".into(), progressed)),
                Err(e) => return Err(ended(e.to_string(), progressed)),
            };
            if resp.compact_revision() > 0 {
                let why = format!(
                    "revision {} was compacted (oldest kept: {})",
                    revision + 1,
                    resp.compact_revision()
                );
                return Err(ended(why, progressed));
            }
            if resp.canceled() {
                let why = format!("the watch was cancelled: {}", resp.cancel_reason());
                return Err(ended(why, progressed));
            }
            progressed = true;
            self.tx.send_if_modified(|view| {
                let mut changed = false;
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    match ev.event_type() {
                        EventType::Delete => changed |= view.remove(&key).is_some(),
                        EventType::Put => {
                            match WorkerCard::parse(&self.cluster, &key, kv.value()) {
                                Ok(card) => {
                                    changed |= view.get(&key) != Some(&card);
                                    view.insert(key, card);
                                }
                                Err(e) => {
                                    (self.on_malformed)(&key, &e);
                                    changed |= view.remove(&key).is_some();
                                }
                            }
                        }
                    }
                }
                changed
            });
        }
    }
}

/// Small values kept in etcd under one prefix, each on a lease of its own so that it lives a
/// fixed time after its last write (the router's stored responses, shared by its replicas).
#[derive(Clone)]
pub struct KvStore {
    client: Client,
    endpoints: Vec<String>,
    prefix: String,
    ttl_s: i64,
    timeout: Duration,
}

impl KvStore {
    /// Reaches etcd at `endpoints` (a read under `prefix` must answer within `timeout`);
    /// values put live `ttl` (at least a second) after their last write.
    pub async fn connect(
        endpoints: Vec<String>,
        prefix: String,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, DiscoveryError> {
        let mut client = connect(&endpoints, timeout).await?;
        let probe = client.get(prefix.clone(), Some(GetOptions::new().with_count_only()));
        bounded(&endpoints, "read", timeout, probe).await?;
        Ok(Self {
            client,
            endpoints,
            prefix,
            ttl_s: i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX),
            timeout,
        })
    }

    /// Writes `value` under `key`, replacing what was there, for the store's TTL.
    pub async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), DiscoveryError> {
        let mut client = self.client.clone();
        let grant = client.lease_grant(self.ttl_s, None);
        let lease = bounded(&self.endpoints, "lease grant", self.timeout, grant).await?;
        let opts = PutOptions::new().with_lease(lease.id());
        let put = client.put(format!("{}{key}", self.prefix), value, Some(opts));
        bounded(&self.endpoints, "put", self.timeout, put).await?;
        Ok(())
    }

    /// The value under `key`, if one is there.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, DiscoveryError> {
        let mut client = self.client.clone();
        let get = client.get(format!("{}{key}", self.prefix), None);
        let resp = bounded(&self.endpoints, "get", self.timeout, get).await?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Removes `key`; whether it was there.
    pub async fn delete(&self, key: &str) -> Result<bool, DiscoveryError> {
        let mut client = self.client.clone();
        let del = client.delete(format!("{}{key}", self.prefix), None);
        let resp = bounded(&self.endpoints, "delete", self.timeout, del).await?;
        Ok(resp.deleted() > 0)
    }
}
