//! Flow control at the router: each request's tenant (from its API key), the tenant's quotas
//! (requests and tokens a minute, as token buckets), and the router's queue, which holds
//! requests while the decode workers are full or their tenant is at its concurrency limit and
//! dispatches them by priority band and, within a band, by fairness in tokens served.
//!
//! Owns: [`Flow`] (the queue and the tenants' live state), [`Caller`] (who a request is for),
//! [`Permit`] (a dispatched request's place, given back when its generation drops), and the
//! tenants file ([`Tenants`], [`TenantTable`], [`TenantSpec`]).
//!
//! Fairness is a virtual token counter per tenant (Sheng et al., "Fairness in Serving Large
//! Language Models", OSDI 2024): a tenant's counter grows by the tokens it is served (prompt at
//! dispatch, output at the finish) divided by its weight, and the waiting tenant of the highest
//! band with the lowest counter goes next. A tenant that starts waiting has its counter lifted
//! to the lowest of the band's waiting tenants (or the band's last dispatched), so time spent
//! idle is not banked into a later burst. Bands are strict: a higher band's waiting request
//! always goes first.
//!
//! Refusals: over a quota, 429 with `Retry-After` from the tenant's bucket (when the bucket
//! will hold what the request needs); waiting past the tenant's (or the router's) wait limit,
//! 503 with `Retry-After` before any work is done. Quota taken by a request that is refused
//! while it waits is given back.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::metrics::RouterMetrics;

mod tenants;

pub use tenants::{TenantSpec, TenantTable, Tenants};

/// Who a request is for: its tenant's name, or nobody (no `--tenants`: one shared queue).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    /// The tenant, when the router has tenants.
    pub tenant: Option<Arc<str>>,
}

impl Caller {
    /// A request of tenant `name`.
    pub fn tenant(name: &str) -> Self {
        Self {
            tenant: Some(name.into()),
        }
    }
}

/// The queue's limits that are not a tenant's.
#[derive(Clone, Copy, Debug, Default)]
pub struct FlowConfig {
    /// Most samples dispatched to each ready decode worker at once (by this router); more wait
    /// in the router's queue. None: no limit (the queue holds only requests whose tenant is at
    /// its concurrency limit).
    pub per_worker: Option<usize>,
    /// Longest a request waits in the queue, for a tenant that sets none. None: no limit.
    pub max_wait: Option<Duration>,
    /// Routers sharing the tenants' limits (`--router-replicas`; 0 or 1: this one alone): each
    /// enforces its share, a tenant's rates over N and its concurrency over N rounded up.
    pub replicas: u32,
}

/// A token bucket of `per_min` a minute: holds at most a minute's worth, refilled evenly.
/// Its level may go below zero (a long answer charged at its finish); then it refuses until
/// it has refilled.
#[derive(Clone, Debug)]
struct Bucket {
    per_min: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_min: f64, now: Instant) -> Self {
        Self {
            per_min,
            level: per_min,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_min / 60.0).min(self.per_min);
        self.at = now;
    }

    /// How long until the bucket holds `need` (at most its size): none when it does now.
    fn short(&self, need: f64) -> Option<Duration> {
        let need = need.min(self.per_min);
        (self.level < need)
            .then(|| Duration::from_secs_f64((need - self.level) * 60.0 / self.per_min))
    }

    /// A new size: a raised quota is there at once, a lowered one caps the level.
    fn resize(&mut self, per_min: f64, now: Instant) {
        self.refill(now);
        if per_min > self.per_min {
            self.level += per_min - self.per_min;
        }
        self.per_min = per_min;
        self.level = self.level.min(per_min);
    }
}

/// One request waiting in the queue.
struct Waiter {
    seq: u64,
    samples: usize,
    prompt: u64,
    tx: oneshot::Sender<()>,
}

/// A tenant's live state.
struct Live {
    label: String,
    priority: i32,
    weight: f64,
    max_concurrent: Option<u32>,
    max_wait: Option<Duration>,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    /// Its requests dispatched and not finished.
    in_flight: u32,
    /// Its virtual token counter.
    counter: f64,
    queue: VecDeque<Waiter>,
    /// Gone from the tenants file: dropped once nothing of it waits or runs.
    retired: bool,
}

impl Live {
    fn new(label: String) -> Self {
        Self {
            label,
            priority: 0,
            weight: 1.0,
            max_concurrent: None,
            max_wait: None,
            requests: None,
            tokens: None,
            in_flight: 0,
            counter: 0.0,
            queue: VecDeque::new(),
            retired: false,
        }
    }

    /// Takes `spec`'s limits, this router's `share`-th of them (rates over `share`,
    /// concurrency over `share` rounded up).
    fn set(&mut self, spec: &TenantSpec, label: String, now: Instant, share: u32) {
        let n = share.max(1);
        fn bucket(b: &mut Option<Bucket>, per_min: Option<f64>, now: Instant) {
            *b = match (b.take(), per_min) {
                (Some(mut old), Some(p)) => {
                    old.resize(p, now);
                    Some(old)
                }
                (None, Some(p)) => Some(Bucket::new(p, now)),
                (_, None) => None,
            };
        }
        self.label = label;
        self.priority = spec.priority;
        self.weight = spec.weight;
        self.max_concurrent = spec.max_concurrent.map(|m| m.div_ceil(n).max(1));
        self.max_wait = spec.max_queue_wait_ms.map(Duration::from_millis);
        bucket(
            &mut self.requests,
            spec.requests_per_minute
                .map(|r| f64::from(r) / f64::from(n)),
            now,
        );
        bucket(
            &mut self.tokens,
            spec.tokens_per_minute.map(|t| t as f64 / f64::from(n)),
            now,
        );
        self.retired = false;
    }

    fn full(&self) -> bool {
        self.max_concurrent.is_some_and(|m| self.in_flight >= m)
    }
}

/// The queue's state, under one lock.
#[derive(Default)]
struct State {
    /// Every tenant's; the key `""` is the anonymous caller's (no tenants).
    live: HashMap<Arc<str>, Live>,
    /// Samples dispatched and not finished.
    dispatched: usize,
    /// Requests waiting.
    waiting: usize,
    next_seq: u64,
    /// Each band's virtual time: the counter of the tenant it dispatched last.
    vtime: HashMap<i32, f64>,
    /// When recent requests finished (the last 64): the rate `Retry-After` estimates from.
    finished: VecDeque<Instant>,
}

impl State {
    /// Seconds a request that would wait behind everything waiting now might wait: the waiting
    /// requests over the recent finish rate, 1 to 60.
    fn retry_after(&self, now: Instant) -> Duration {
        let secs = match (self.finished.front(), self.finished.len()) {
            (Some(first), n) if n >= 2 => {
                let span = now
                    .saturating_duration_since(*first)
                    .as_secs_f64()
                    .max(1e-3);
                (self.waiting.max(1) as f64) / (n as f64 / span)
            }
            _ => 1.0,
        };
        Duration::from_secs_f64(secs.clamp(1.0, 60.0))
    }
}

/// The router's queue and its tenants' live state. One per router.
pub struct Flow {
    cfg: FlowConfig,
    state: Mutex<State>,
    /// Decode workers ready now (the capacity is `per_worker` times this).
    ready_workers: Box<dyn Fn() -> usize + Send + Sync>,
    metrics: Arc<RouterMetrics>,
}

/// How often the queue looks again without an event (a worker that became ready frees
/// capacity without a request finishing).
const TICK: Duration = Duration::from_millis(100);

impl Flow {
    /// A queue dispatching to `ready_workers()` decode workers, with no tenants (every caller
    /// anonymous, no quotas) until [`configure`](Self::configure) gives it some.
    pub fn new(
        cfg: FlowConfig,
        ready_workers: impl Fn() -> usize + Send + Sync + 'static,
        metrics: Arc<RouterMetrics>,
    ) -> Arc<Self> {
        let flow = Arc::new(Self {
            cfg,
            state: Mutex::new(State::default()),
            ready_workers: Box::new(ready_workers),
            metrics,
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak: Weak<Self> = Arc::downgrade(&flow);
            rt.spawn(async move {
                let mut tick = tokio::time::interval(TICK);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let Some(flow) = weak.upgrade() else { return };
                    let mut st = flow.lock();
                    if st.waiting > 0 {
                        flow.pump(&mut st);
                    }
                }
            });
        }
        flow
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the tenants of `table`: new ones start with full buckets, changed ones keep their
    /// state with the new limits (a raised quota is there at once), removed ones are dropped
    /// once nothing of theirs waits or runs.
    pub fn configure(&self, table: &TenantTable) {
        let now = Instant::now();
        let mut st = self.lock();
        for live in st.live.values_mut() {
            live.retired = true;
        }
        for (i, spec) in table.tenants.iter().enumerate() {
            let label = TenantTable::label(i, &spec.name);
            st.live
                .entry(spec.name.as_str().into())
                .or_insert_with(|| Live::new(label.clone()))
                .set(spec, label, now, self.cfg.replicas);
        }
        st.live
            .retain(|_, l| !(l.retired && l.in_flight == 0 && l.queue.is_empty()));
        for (i, spec) in table.tenants.iter().enumerate() {
            self.metrics
                .tenant_known(&TenantTable::label(i, &spec.name));
        }
        // A raised concurrency limit may let someone go now.
        self.pump(&mut st);
    }

    /// The metrics label of tenant `name` (empty when it is not known).
    pub fn label(&self, name: &str) -> String {
        self.lock()
            .live
            .get(name)
            .map(|l| l.label.clone())
            .unwrap_or_default()
    }

    /// Requests waiting in the queue now.
    pub fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// Samples dispatched and not finished.
    pub fn dispatched(&self) -> usize {
        self.lock().dispatched
    }

    /// Takes `caller`'s quota for a request of `samples` samples and `prompt` prompt tokens
    /// and waits for its turn: the permit to send it to a worker, or why not (429 over a quota,
    /// 503 past the wait limit, 401 for a tenant that was removed).
    pub async fn admit(
        self: &Arc<Self>,
        caller: &Caller,
        samples: usize,
        prompt: u64,
    ) -> Result<Permit, ApiError> {
        let key: Arc<str> = caller.tenant.clone().unwrap_or_else(|| "".into());
        let now = Instant::now();
        let (seq, rx, max_wait, label, priority) = {
            let mut guard = self.lock();
            let st = &mut *guard;
            if !st.live.contains_key(&key) {
                if caller.tenant.is_some() {
                    return Err(ApiError::Unauthorized(
                        "the API key's tenant was removed".into(),
                    ));
                }
                st.live.insert(key.clone(), Live::new(String::new()));
            }
            let live = st.live.get_mut(&key).expect("inserted");
            let (label, priority) = (live.label.clone(), live.priority);
            // Quotas: a request a minute, and its prompt's tokens a minute (output tokens are
            // charged at its finish).
            let mut short: Option<(&'static str, Duration)> = None;
            if let Some(b) = &mut live.requests {
                b.refill(now);
                short = b.short(1.0).map(|d| ("requests_per_minute", d));
            }
            if let Some(b) = &mut live.tokens {
                b.refill(now);
                if let Some(d) = b.short(prompt as f64) {
                    if short.is_none_or(|(_, s)| d > s) {
                        short = Some(("tokens_per_minute", d));
                    }
                }
            }
            if let Some((limit, wait)) = short {
                self.metrics.tenant_request(&label, "over_quota");
                return Err(ApiError::OverQuota {
                    tenant: key.to_string(),
                    limit,
                    retry_after: wait,
                });
            }
            if let Some(b) = &mut live.requests {
                b.level -= 1.0;
            }
            if let Some(b) = &mut live.tokens {
                b.level -= prompt as f64;
            }
            // A tenant that starts waiting catches up with its band.
            if live.queue.is_empty() {
                let band = live.priority;
                let floor = st
                    .live
                    .iter()
                    .filter(|(k, l)| **k != key && l.priority == band && !l.queue.is_empty())
                    .map(|(_, l)| l.counter)
                    .min_by(f64::total_cmp)
                    .or_else(|| st.vtime.get(&band).copied())
                    .unwrap_or(0.0);
                let live = st.live.get_mut(&key).expect("present");
                live.counter = live.counter.max(floor);
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            let (tx, rx) = oneshot::channel();
            let live = st.live.get_mut(&key).expect("present");
            let max_wait = live.max_wait.or(self.cfg.max_wait);
            live.queue.push_back(Waiter {
                seq,
                samples,
                prompt,
                tx,
            });
            st.waiting += 1;
            self.metrics.tenant_queued(&label, 1);
            self.pump(st);
            (seq, rx, max_wait, label, priority)
        };
        let mut waiting = Waiting {
            flow: self.clone(),
            key: key.clone(),
            seq,
            samples,
            prompt,
            rx,
            taken: false,
        };
        let turn = match max_wait {
            Some(w) => tokio::time::timeout(w, &mut waiting.rx).await.ok(),
            None => Some((&mut waiting.rx).await),
        };
        let given = match turn {
            Some(r) => r.is_ok(),
            // Past the wait limit: out of the queue, unless its turn came just now.
            None => !waiting.withdraw(),
        };
        if !given {
            let waited = now.elapsed();
            self.metrics.tenant_request(&label, "queue_timeout");
            waiting.taken = true;
            let retry_after = self.lock().retry_after(Instant::now());
            return Err(ApiError::QueueTimeout {
                waited,
                retry_after,
            });
        }
        waiting.taken = true;
        let waited = now.elapsed();
        self.metrics.tenant_request(&label, "admitted");
        self.metrics.tenant_wait(&label, waited);
        self.metrics.tenant_tokens(&label, "prompt", prompt);
        Ok(Permit {
            flow: self.clone(),
            key,
            label,
            samples,
            completion: 0,
            waited,
            priority,
        })
    }

    /// Dispatches waiting requests while there is room: the highest band first, within it the
    /// tenant with the lowest counter (then the longest waiting), skipping tenants at their
    /// concurrency limit. Strict order: when the next request does not fit, nothing after it
    /// goes either (a large request is not starved by small ones).
    fn pump(&self, st: &mut State) {
        let capacity = self
            .cfg
            .per_worker
            .map(|p| p.saturating_mul((self.ready_workers)()));
        loop {
            let best = st
                .live
                .iter()
                .filter(|(_, l)| !l.queue.is_empty() && !l.full())
                .min_by(|(_, a), (_, b)| {
                    b.priority
                        .cmp(&a.priority)
                        .then(a.counter.total_cmp(&b.counter))
                        .then(a.queue[0].seq.cmp(&b.queue[0].seq))
                })
                .map(|(k, _)| k.clone());
            let Some(key) = best else { return };
            let live = st.live.get_mut(&key).expect("found");
            let samples = live.queue[0].samples;
            if let Some(cap) = capacity {
                // Room for it, or nothing dispatched at all (a request larger than the whole
                // capacity still runs alone; with no worker ready, it fails as it would).
                if st.dispatched > 0 && st.dispatched + samples > cap {
                    return;
                }
            }
            let w = live.queue.pop_front().expect("not empty");
            st.waiting -= 1;
            self.metrics.tenant_queued(&live.label, -1);
            if w.tx.send(()).is_err() {
                // Its caller is gone (it withdraws under this lock, so this is a race lost
                // before the lock): nothing to dispatch.
                continue;
            }
            let before = live.counter;
            live.counter += w.prompt as f64 / live.weight;
            live.in_flight += 1;
            self.metrics.tenant_in_flight(&live.label, 1);
            let band = live.priority;
            st.dispatched += samples;
            let v = st.vtime.entry(band).or_insert(before);
            *v = v.max(before);
        }
    }

    /// A dispatched request finished with `completion` output tokens: its tenant's counter and
    /// token bucket are charged, and its room goes to the next in line.
    fn release(&self, key: &Arc<str>, samples: usize, completion: u64) {
        let now = Instant::now();
        let mut guard = self.lock();
        let st = &mut *guard;
        st.dispatched = st.dispatched.saturating_sub(samples);
        st.finished.push_back(now);
        if st.finished.len() > 64 {
            st.finished.pop_front();
        }
        if let Some(live) = st.live.get_mut(key) {
            live.in_flight = live.in_flight.saturating_sub(1);
            self.metrics.tenant_in_flight(&live.label, -1);
            live.counter += completion as f64 / live.weight;
            if let Some(b) = &mut live.tokens {
                b.refill(now);
                b.level -= completion as f64;
            }
            if live.retired && live.in_flight == 0 && live.queue.is_empty() {
                st.live.remove(key);
            }
        }
        self.pump(st);
    }
}

/// A request's wait for its turn; dropped before it got one (the client went away), it leaves
/// the queue, and a turn given just then is given back.
struct Waiting {
    flow: Arc<Flow>,
    key: Arc<str>,
    seq: u64,
    samples: usize,
    prompt: u64,
    rx: oneshot::Receiver<()>,
    taken: bool,
}

impl Waiting {
    /// Leaves the queue; false when the turn had already come (the request goes on).
    fn withdraw(&mut self) -> bool {
        let mut guard = self.flow.lock();
        let st = &mut *guard;
        let Some(live) = st.live.get_mut(&self.key) else {
            return self.rx.try_recv().is_err();
        };
        if let Some(i) = live.queue.iter().position(|w| w.seq == self.seq) {
            live.queue.remove(i);
            st.waiting -= 1;
            self.flow.metrics.tenant_queued(&live.label, -1);
            // Nothing was served: its quota goes back.
            if let Some(b) = &mut live.requests {
                b.level += 1.0;
            }
            if let Some(b) = &mut live.tokens {
                b.level += self.prompt as f64;
            }
            // Someone behind it may fit now.
            self.flow.pump(st);
            return true;
        }
        self.rx.try_recv().is_err()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.taken && !self.withdraw() {
            // The turn came as the caller left: give the room back.
            self.flow.release(&self.key, self.samples, 0);
        }
    }
}

/// A dispatched request's place: while it lives the request counts against its tenant's
/// concurrency and the workers' room; dropped (with the output tokens it was given by
/// [`finish`](Self::finish)), it charges them and lets the next request go.
pub struct Permit {
    flow: Arc<Flow>,
    key: Arc<str>,
    label: String,
    samples: usize,
    completion: u64,
    waited: Duration,
    priority: i32,
}

impl Permit {
    /// The output tokens the request was given, charged to its tenant when the permit drops.
    pub fn finish(&mut self, completion: u64) {
        self.completion = completion;
    }

    /// How long the request waited in the queue.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The request's priority band.
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// Its tenant's metrics label (empty for the anonymous caller).
    pub fn label(&self) -> &str {
        &self.label
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.flow
            .metrics
            .tenant_tokens(&self.label, "completion", self.completion);
        self.flow.release(&self.key, self.samples, self.completion);
    }
}

#[cfg(test)]
mod tests;
