//! The workers this router knows (one pool for decode workers, one for prefill workers), and
//! what it knows about each.
//!
//! For every address discovery reports, the pool keeps a lazily connected gRPC channel and two
//! background tasks: a monitor (Info once, then Load every poll interval; a failed call marks the
//! worker not ready until one succeeds) and a KV follower (the worker's KV-event stream into a
//! [`KvIndex`]; on a gap or a broken stream the index is cleared and the stream reopened, which
//! starts with a fresh snapshot). Requests in flight are counted here by the router itself, so
//! load-based policies see their own decisions at once rather than a poll later.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::StreamExt;

use tandem_model::{block_hashes_from, chain_root, BlockHash};
use tandem_proto::worker as pb;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::client::{Connect, GrpcConnect, WorkerClient};

use crate::kv_index::KvIndex;
use crate::metrics::RouterMetrics;
use crate::policy::{Candidate, RoutingPolicy};
use tandem_discovery::{Expect, Refusal};

/// How a pool watches its workers.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// How often each worker's load is polled; failed calls back off from it, doubling up to
    /// 5 s.
    pub poll_interval: Duration,
    /// How long opening a connection to a worker may take.
    pub connect_timeout: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(2),
        }
    }
}

/// Which service a pool's workers serve (both also serve WorkerControl: Info, Load, KvEvents).
pub use tandem_discovery::Role;

/// What every pool of one router shares: its metrics, and what it requires of a worker before
/// routing to it (the served model, the cluster's block size).
#[derive(Clone, Default)]
pub struct PoolShared {
    /// Where joins, leaves, refusals and per-worker requests are counted.
    pub metrics: Arc<RouterMetrics>,
    /// The check every worker's Info must pass.
    pub expect: Arc<Expect>,
}

#[derive(Default)]
struct WorkerState {
    info: Option<pb::WorkerInfo>,
    load: Option<pb::LoadReport>,
    ready: bool,
    /// Why the router does not use this worker (its Info failed the pool's check).
    refused: Option<Refusal>,
    /// This router's own count of its requests there when the latest load report came.
    own_at_report: usize,
}

/// Where the block-hash chain of a request run with `lora` starts (the base's root for none):
/// the worker's engine hashes its blocks from the adapter's content hash.
pub fn lora_root(lora: Option<&pb::LoraRef>) -> BlockHash {
    chain_root(lora.map(|l| l.content_hash).filter(|&h| h != 0))
}

/// Every LoRA adapter the workers of `pools` report, by name: the first report of each name
/// (workers serving one name with other weights are told apart by content hash when routing).
pub fn served_loras<'a>(
    pools: impl IntoIterator<Item = &'a WorkerPool>,
) -> std::collections::BTreeMap<String, pb::LoraInfo> {
    let mut out = std::collections::BTreeMap::new();
    for p in pools {
        for w in p.up() {
            for i in w.loras() {
                out.entry(i.name.clone()).or_insert(i);
            }
        }
    }
    out
}

/// A worker, named by the address it serves on (`host:port`): what discovery reports, what the
/// router connects to and what logs and errors name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerAddr(String);

impl WorkerAddr {
    /// The address as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for WorkerAddr {
    fn from(addr: String) -> Self {
        Self(addr)
    }
}

impl From<&str> for WorkerAddr {
    fn from(addr: &str) -> Self {
        Self(addr.to_string())
    }
}

impl std::fmt::Display for WorkerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One worker as this router knows it: its client, what its Info and Load last said, its
/// prefix-cache index, and the router's own count of its requests.
pub struct Worker {
    /// Where it serves.
    pub addr: WorkerAddr,
    /// Which pool it is in.
    pub role: Role,
    client: Arc<dyn WorkerClient>,
    shared: PoolShared,
    state: Mutex<WorkerState>,
    kv: Mutex<KvIndex>,
    in_flight: AtomicUsize,
    assigned: AtomicU64,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Worker {
    fn new(
        addr: WorkerAddr,
        role: Role,
        client: Arc<dyn WorkerClient>,
        shared: PoolShared,
    ) -> Arc<Self> {
        Arc::new(Self {
            addr,
            role,
            client,
            shared,
            state: Mutex::new(WorkerState::default()),
            kv: Mutex::new(KvIndex::default()),
            in_flight: AtomicUsize::new(0),
            assigned: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
        })
    }

    /// The calls this router makes to the worker.
    pub fn client(&self) -> &dyn WorkerClient {
        self.client.as_ref()
    }

    /// Leading tokens of `prompt` (run with `lora`, or the base) this worker holds in its
    /// prefix cache or its disk tier (it computes neither), as far as the router's index knows.
    pub fn cached_prefix_tokens(&self, prompt: &[u32], lora: Option<&pb::LoraRef>) -> usize {
        let bs = self.info().map(|i| i.block_size).unwrap_or(16).max(1) as usize;
        let hashes = block_hashes_from(lora_root(lora), prompt, bs);
        self.kv
            .lock()
            .expect("kv index")
            .matched_prefix(&hashes)
            .blocks()
            * bs
    }

    /// Whether it serves `lora` (by name, and by content hash where the reference has one), as
    /// its latest load report (or a load this router asked for since) says; always for the base.
    pub fn serves(&self, lora: Option<&pb::LoraRef>) -> bool {
        let Some(l) = lora else { return true };
        let s = self.state.lock().expect("worker state");
        s.load.as_ref().is_some_and(|r| {
            r.loras.iter().any(|i| {
                i.name == l.name && (l.content_hash == 0 || i.content_hash == l.content_hash)
            })
        })
    }

    /// The LoRA adapters its latest load report lists (with those this router had it load
    /// since).
    pub fn loras(&self) -> Vec<pb::LoraInfo> {
        let s = self.state.lock().expect("worker state");
        s.load.as_ref().map_or(Vec::new(), |r| r.loras.clone())
    }

    /// Records that the worker serves the adapter `info` describes (it answered a LoadLora),
    /// until its next load report says what it serves.
    pub fn note_lora(&self, info: pb::LoraInfo) {
        let mut s = self.state.lock().expect("worker state");
        let r = s.load.get_or_insert_with(Default::default);
        r.loras.retain(|i| i.name != info.name);
        r.loras.push(info);
    }

    /// Records that the worker no longer serves adapter `name`, until its next load report.
    pub fn forget_lora(&self, name: &str) {
        let mut s = self.state.lock().expect("worker state");
        if let Some(r) = s.load.as_mut() {
            r.loras.retain(|i| i.name != name);
        }
    }

    /// Whether requests may go to it: its Info and Load answered, it passed the pool's check and
    /// it is not draining.
    pub fn is_ready(&self) -> bool {
        let s = self.state.lock().expect("worker state");
        s.ready
            && s.info.is_some()
            && s.refused.is_none()
            && !s.load.as_ref().is_some_and(|l| l.draining)
    }

    /// What its Info said; `None` until it answers, and again after a failed call (it may have
    /// come back as another process).
    pub fn info(&self) -> Option<pb::WorkerInfo> {
        self.state.lock().expect("worker state").info.clone()
    }

    /// Requests (and remote prefills) this router has in flight on it.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests on it from every router: what its latest load report counted in flight (every
    /// router's requests), moved by what this router started or ended there since; never below
    /// this router's own count. Several routers in front of the same workers so balance by
    /// what each worker holds, not by their own shares of it.
    pub fn load(&self) -> usize {
        let own = self.in_flight();
        let s = self.state.lock().expect("worker state");
        match &s.load {
            Some(r) => (r.in_flight as usize + own)
                .saturating_sub(s.own_at_report)
                .max(own),
            None => own,
        }
    }

    /// Blocks the router's index holds for this worker (from its KV-event stream).
    pub fn indexed_blocks(&self) -> usize {
        self.kv.lock().expect("kv index").len()
    }

    /// The worker's latest `Load` answer (none before its first).
    pub fn load_report(&self) -> Option<pb::LoadReport> {
        self.state.lock().expect("worker state").load.clone()
    }

    /// Blocks the router's index says the worker holds in its disk tier.
    pub fn indexed_disk_blocks(&self) -> usize {
        self.kv.lock().expect("kv index").disk_len()
    }

    /// Takes the worker for draining at once (it handed a request over), ahead of its next
    /// load report: no new requests go to it, but it still serves pulls of what it holds.
    pub fn mark_draining(&self) {
        if let Some(l) = self.state.lock().expect("worker state").load.as_mut() {
            l.draining = true;
        }
    }

    /// Whether it answers (its Info and Load did, and it passed the pool's check), draining or
    /// not: a peer the KV it holds can be pulled from.
    pub fn is_up(&self) -> bool {
        let s = self.state.lock().expect("worker state");
        s.ready && s.info.is_some() && s.refused.is_none()
    }

    /// Whether it reports draining (or the router took it for draining).
    pub fn is_draining(&self) -> bool {
        let s = self.state.lock().expect("worker state");
        s.load.as_ref().is_some_and(|l| l.draining)
    }

    /// Stops following it (its monitor and KV-event tasks); false, for `retain`.
    fn stop(&self) -> bool {
        for t in self.tasks.lock().expect("tasks").drain(..) {
            t.abort();
        }
        false
    }

    /// Marks the worker unreachable after a failed call; the monitor brings it back.
    pub fn mark_down(&self) {
        self.state.lock().expect("worker state").ready = false;
    }

    /// Counts a request against this worker until the returned guard drops.
    pub fn start_request(self: &Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.assigned.fetch_add(1, Ordering::Relaxed);
        self.shared.metrics.worker_request(self.role, &self.addr);
        InFlightGuard(self.clone())
    }

    async fn monitor(self: Arc<Self>, cfg: PoolConfig) {
        let role = self.role.name();
        let mut backoff = cfg.poll_interval;
        loop {
            let need_info = self.state.lock().expect("worker state").info.is_none();
            let ok = if need_info {
                match self.client.info().await {
                    Ok(info) => match self.shared.expect.check(&info.model, info.block_size) {
                        Ok(()) => {
                            tracing::info!(worker = %self.addr, role, model = %info.model, block_size = info.block_size, "worker found");
                            let mut s = self.state.lock().expect("worker state");
                            s.info = Some(info);
                            s.refused = None;
                            true
                        }
                        Err(refusal) => {
                            let mut s = self.state.lock().expect("worker state");
                            if s.refused.as_ref() != Some(&refusal) {
                                tracing::warn!(worker = %self.addr, role, reason = %refusal, "worker refused: not routing to it");
                                self.shared
                                    .metrics
                                    .worker_refused(self.role, refusal.label());
                                s.refused = Some(refusal);
                            }
                            false
                        }
                    },
                    Err(e) => {
                        tracing::debug!(worker = %self.addr, error = %e, "info failed");
                        false
                    }
                }
            } else {
                true
            };
            let ok = ok
                && match self.client.load().await {
                    Ok(r) => {
                        let own = self.in_flight();
                        let mut s = self.state.lock().expect("worker state");
                        s.load = Some(r);
                        s.own_at_report = own;
                        if !s.ready {
                            tracing::info!(worker = %self.addr, role, "worker ready");
                        }
                        s.ready = true;
                        true
                    }
                    Err(e) => {
                        tracing::debug!(worker = %self.addr, error = %e, "load failed");
                        false
                    }
                };
            if ok {
                backoff = cfg.poll_interval;
            } else {
                let mut s = self.state.lock().expect("worker state");
                if s.ready {
                    tracing::warn!(worker = %self.addr, role, "worker unreachable");
                }
                // It may come back as a different process: ask again who it is.
                s.ready = false;
                s.info = None;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            tokio::time::sleep(backoff).await;
        }
    }

    async fn follow_kv(self: Arc<Self>, cfg: PoolConfig) {
        let mut backoff = cfg.poll_interval;
        loop {
            if let Ok(mut stream) = self.client.kv_events().await {
                backoff = cfg.poll_interval;
                while let Some(Ok(batch)) = stream.next().await {
                    if let Err(gap) = self.kv.lock().expect("kv index").apply(batch) {
                        tracing::warn!(worker = %self.addr, %gap, "resubscribing for a snapshot");
                        break;
                    }
                }
            }
            self.kv.lock().expect("kv index").clear();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        for t in self.tasks.lock().expect("tasks").drain(..) {
            t.abort();
        }
    }
}

/// A request in flight on a worker; dropping it ends the count.
pub struct InFlightGuard(Arc<Worker>);

impl InFlightGuard {
    /// The worker the request is counted against.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.0
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every known worker of one role, kept in step with discovery.
pub struct WorkerPool {
    role: Role,
    workers: RwLock<Vec<Arc<Worker>>>,
    /// Workers discovery no longer lists that were draining when it dropped them (a
    /// terminating pod leaves DNS at once): kept, and followed, while they answer, as peers the
    /// KV of the requests they handed over is pulled from ([`Self::up`]); never sent requests.
    leaving: RwLock<Vec<Arc<Worker>>>,
    cfg: PoolConfig,
    connect: Arc<dyn Connect>,
    shared: PoolShared,
}

impl WorkerPool {
    /// Starts following `addrs` over gRPC; must be called inside a tokio runtime.
    pub fn spawn(
        role: Role,
        addrs: watch::Receiver<Vec<WorkerAddr>>,
        cfg: PoolConfig,
    ) -> Arc<Self> {
        let connect = Arc::new(GrpcConnect {
            connect_timeout: cfg.connect_timeout,
            token: None,
        });
        Self::spawn_with(role, addrs, cfg, connect)
    }

    /// Starts following `addrs`, reaching each worker through `connect`.
    pub fn spawn_with(
        role: Role,
        addrs: watch::Receiver<Vec<WorkerAddr>>,
        cfg: PoolConfig,
        connect: Arc<dyn Connect>,
    ) -> Arc<Self> {
        Self::start(role, addrs, cfg, connect, PoolShared::default())
    }

    /// Starts following `addrs`, reaching each worker through `connect`, counting into and
    /// checking workers against `shared`.
    pub fn start(
        role: Role,
        mut addrs: watch::Receiver<Vec<WorkerAddr>>,
        cfg: PoolConfig,
        connect: Arc<dyn Connect>,
        shared: PoolShared,
    ) -> Arc<Self> {
        let pool = Arc::new(Self {
            role,
            workers: RwLock::new(Vec::new()),
            leaving: RwLock::new(Vec::new()),
            cfg,
            connect,
            shared,
        });
        pool.sync(&addrs.borrow_and_update().clone());
        let weak = Arc::downgrade(&pool);
        tokio::spawn(async move {
            while addrs.changed().await.is_ok() {
                let Some(pool) = weak.upgrade() else { return };
                let list = addrs.borrow_and_update().clone();
                pool.sync(&list);
            }
        });
        pool
    }

    fn sync(&self, addrs: &[WorkerAddr]) {
        let mut ws = self.workers.write().expect("workers");
        let mut leaving = self.leaving.write().expect("leaving workers");
        let mut by_addr: HashMap<WorkerAddr, Arc<Worker>> =
            ws.drain(..).map(|w| (w.addr.clone(), w)).collect();
        for a in addrs {
            if let Some(w) = by_addr.remove(a) {
                ws.push(w);
                continue;
            }
            // Listed again while leaving: it is one of the pool's again.
            if let Some(i) = leaving.iter().position(|w| &w.addr == a) {
                ws.push(leaving.remove(i));
                continue;
            }
            match self.connect.connect(a) {
                Ok(client) => {
                    tracing::info!(worker = %a, role = self.role.name(), "worker joined");
                    self.shared.metrics.membership(self.role, "join");
                    let w = Worker::new(a.clone(), self.role, client, self.shared.clone());
                    let mut t = w.tasks.lock().expect("tasks");
                    t.push(tokio::spawn(w.clone().monitor(self.cfg)));
                    t.push(tokio::spawn(w.clone().follow_kv(self.cfg)));
                    drop(t);
                    ws.push(w);
                }
                Err(e) => tracing::error!("{e}"),
            }
        }
        // Workers no longer listed are dropped here (their tasks stop once requests finish),
        // but a draining one is kept aside while it answers: peers pull what it handed over.
        for (addr, w) in by_addr {
            tracing::info!(worker = %addr, role = self.role.name(), "worker left");
            self.shared.metrics.membership(self.role, "leave");
            if w.is_up() && w.is_draining() {
                leaving.push(w);
                continue;
            }
            w.stop();
        }
        leaving.retain(|w| w.is_up() || w.stop());
    }

    /// The metrics this pool counts into (shared by every pool of the router).
    pub fn metrics(&self) -> &Arc<RouterMetrics> {
        &self.shared.metrics
    }

    /// Every worker in the pool now (one per address discovery lists), ready or not.
    pub fn all(&self) -> Vec<Arc<Worker>> {
        self.workers.read().expect("workers").clone()
    }

    /// The workers requests may go to now ([`Worker::is_ready`]).
    pub fn ready(&self) -> Vec<Arc<Worker>> {
        self.all().into_iter().filter(|w| w.is_ready()).collect()
    }

    /// The workers that answer, draining ones too ([`Worker::is_up`]), and those discovery
    /// dropped while they drain and that still answer: where KV can be pulled from.
    pub fn up(&self) -> Vec<Arc<Worker>> {
        let mut up: Vec<Arc<Worker>> = self.all().into_iter().filter(|w| w.is_up()).collect();
        let mut leaving = self.leaving.write().expect("leaving workers");
        // One that stopped answering is gone for good.
        leaving.retain(|w| w.is_up() || w.stop());
        up.extend(leaving.iter().cloned());
        up
    }

    /// The worker `policy` picks for `prompt` run with `lora` (None: the base) among the ready
    /// ones not in `exclude` that serve it.
    pub fn pick(
        &self,
        policy: &dyn RoutingPolicy,
        prompt: &[u32],
        lora: Option<&pb::LoraRef>,
        exclude: &[WorkerAddr],
    ) -> Option<Arc<Worker>> {
        let ready: Vec<Arc<Worker>> = self
            .ready()
            .into_iter()
            .filter(|w| !exclude.contains(&w.addr) && w.serves(lora))
            .collect();
        if ready.is_empty() {
            return None;
        }
        let mut hashes_by_block_size: HashMap<u32, Vec<tandem_model::BlockHash>> = HashMap::new();
        let candidates: Vec<Candidate> = ready
            .iter()
            .map(|w| {
                let mut c = Candidate {
                    load: w.load(),
                    assigned: w.assigned.load(Ordering::Relaxed),
                    ..Default::default()
                };
                if policy.needs_prefix_match() {
                    let bs = w.info().map(|i| i.block_size).unwrap_or(16).max(1);
                    let hashes = hashes_by_block_size
                        .entry(bs)
                        .or_insert_with(|| block_hashes_from(lora_root(lora), prompt, bs as usize));
                    c.prompt_blocks = hashes.len();
                    let m = w.kv.lock().expect("kv index").matched_prefix(hashes);
                    c.cached_blocks = m.pool;
                    c.disk_blocks = m.disk;
                }
                c
            })
            .collect();
        Some(ready[policy.pick(&candidates)].clone())
    }
}
