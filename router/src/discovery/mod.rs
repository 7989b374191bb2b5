//! Where the workers are. A [`Discovery`] backend publishes the current decode- and
//! prefill-worker addresses on watch channels; the worker pools follow them (a new address
//! joins, a vanished one leaves, and the pool's own probes decide readiness).
//!
//! Backends, chosen by `--discovery`, each giving [`Published`] lists: fixed ones (the command
//! line's), a [worker-list file](FileDiscovery) read again when it changes (`tandem up
//! --autoscale` keeps one), [`etcd`](EtcdDiscovery) (workers' cards in etcd, with the `etcd` feature) and
//! [`dns`](DnsDiscovery) (a headless Kubernetes Service's DNS records, re-resolved
//! periodically).

mod dns;
#[cfg(feature = "etcd")]
mod etcd;
mod file;

use tokio::sync::watch;

use crate::workers::WorkerAddr;

pub use dns::{DnsDiscovery, DnsResolver};
#[cfg(feature = "etcd")]
pub use etcd::EtcdDiscovery;
pub use file::FileDiscovery;

/// A source of the cluster's worker addresses.
pub trait Discovery: Send + Sync {
    /// Decode worker addresses (`host:port`), now and whenever they change.
    fn decode_workers(&self) -> watch::Receiver<Vec<WorkerAddr>>;
    /// Prefill worker addresses, now and whenever they change.
    fn prefill_workers(&self) -> watch::Receiver<Vec<WorkerAddr>>;
}

/// Two address lists, decode and prefill, as some backend keeps them: fixed ones from the
/// command line ([`Published::fixed`]), or lists a task keeps up to date (stopped on drop).
pub struct Published {
    decode: watch::Sender<Vec<WorkerAddr>>,
    prefill: watch::Sender<Vec<WorkerAddr>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Published {
    /// `decode` and `prefill`, once and for all (`--discovery static`).
    pub fn fixed(decode: Vec<WorkerAddr>, prefill: Vec<WorkerAddr>) -> Self {
        Self {
            decode: watch::Sender::new(decode),
            prefill: watch::Sender::new(prefill),
            task: None,
        }
    }

    /// Empty lists, and their senders for the backend's task to fill.
    fn empty() -> (
        Self,
        watch::Sender<Vec<WorkerAddr>>,
        watch::Sender<Vec<WorkerAddr>>,
    ) {
        let p = Self::fixed(Vec::new(), Vec::new());
        let (d, f) = (p.decode.clone(), p.prefill.clone());
        (p, d, f)
    }

    /// The task that keeps the lists; it stops when these lists are dropped.
    fn kept_by(mut self, task: tokio::task::JoinHandle<()>) -> Self {
        self.task = Some(task);
        self
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

impl Discovery for Published {
    fn decode_workers(&self) -> watch::Receiver<Vec<WorkerAddr>> {
        self.decode.subscribe()
    }

    fn prefill_workers(&self) -> watch::Receiver<Vec<WorkerAddr>> {
        self.prefill.subscribe()
    }
}

/// Replaces `tx`'s list with `next` (sorted, without repeats) when it differs.
fn publish(tx: &watch::Sender<Vec<WorkerAddr>>, mut next: Vec<WorkerAddr>) {
    next.sort();
    next.dedup();
    tx.send_if_modified(|cur| {
        let changed = *cur != next;
        if changed {
            *cur = next;
        }
        changed
    });
}
