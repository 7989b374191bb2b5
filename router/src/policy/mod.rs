//! Routing policies: which decode worker serves a request. One file per policy, one trait.
//!
//! A policy sees one [`Candidate`] per ready worker, computed by the worker pool at the moment of
//! the decision, and returns the index of the one to use. Policies hold no worker state of their
//! own beyond a counter, so they are pure functions of their input and tested as such.
//!
//! [`build`] makes the policy a [`PolicyKind`] names; the seam's types are also exported at the
//! crate root.

pub(crate) mod disagg;
mod kv_aware;
mod least_load;
mod round_robin;

pub use disagg::DisaggConfig;
pub use kv_aware::{KvAware, KvAwareConfig};
pub use least_load::LeastLoad;
pub use round_robin::RoundRobin;

/// What a policy knows about one ready worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidate {
    /// Requests on the worker from every router (its load report, moved by this router's own
    /// starts and ends since).
    pub load: usize,
    /// Requests this router has ever sent it (breaks ties so equal choices spread).
    pub assigned: u64,
    /// Leading prompt blocks the worker holds in its prefix cache (only filled in for policies
    /// that say they need it).
    pub cached_blocks: usize,
    /// Prompt blocks past those that it holds in its disk tier (read back, not computed).
    pub disk_blocks: usize,
    /// Full blocks in the prompt.
    pub prompt_blocks: usize,
}

/// A way of choosing a request's decode worker among the ready ones, from what the pool knows of
/// each at the moment of the decision.
pub trait RoutingPolicy: Send + Sync {
    /// The policy's `--policy` name, for logs.
    fn name(&self) -> &'static str;
    /// Whether [`Candidate::cached_blocks`] must be computed (it costs an index lookup).
    fn needs_prefix_match(&self) -> bool {
        false
    }
    /// Index into `candidates` (never empty) of the chosen worker.
    fn pick(&self, candidates: &[Candidate]) -> usize;
}

/// The policy names the `--policy` flag takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyKind {
    /// Each request to the next ready worker in turn, ignoring load and caches.
    RoundRobin,
    /// The worker with the fewest requests in flight from this router.
    LeastLoad,
    /// The worker that already caches the most of the prompt, weighed against its load.
    KvAware,
}

/// The policy `kind` names; `kv` configures only [`KvAware`].
pub fn build(kind: PolicyKind, kv: KvAwareConfig) -> std::sync::Arc<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => std::sync::Arc::new(RoundRobin::default()),
        PolicyKind::LeastLoad => std::sync::Arc::new(LeastLoad),
        PolicyKind::KvAware => std::sync::Arc::new(KvAware::new(kv)),
    }
}

/// Index of the smallest key; ties go to the earliest.
pub(crate) fn argmin<K: PartialOrd>(c: &[Candidate], key: impl Fn(&Candidate) -> K) -> usize {
    let mut best = 0;
    for i in 1..c.len() {
        if key(&c[i]) < key(&c[best]) {
            best = i;
        }
    }
    best
}
