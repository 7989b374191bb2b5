//! Where the workers are. A [`Discovery`] backend publishes the current decode-worker addresses
//! on a watch channel; the worker pool follows it. The static backend (addresses from the command
//! line) is the default; etcd and Kubernetes DNS backends plug in behind the same trait.

use tokio::sync::watch;

use crate::workers::WorkerAddr;

pub trait Discovery: Send + Sync {
    /// Decode worker addresses (`host:port`), now and whenever they change.
    fn decode_workers(&self) -> watch::Receiver<Vec<WorkerAddr>>;
    /// Prefill worker addresses, now and whenever they change.
    fn prefill_workers(&self) -> watch::Receiver<Vec<WorkerAddr>>;
}

/// Fixed lists, from `--decode-workers` and `--prefill-workers`.
pub struct StaticDiscovery {
    decode: watch::Sender<Vec<WorkerAddr>>,
    prefill: watch::Sender<Vec<WorkerAddr>>,
}

impl StaticDiscovery {
    pub fn new(decode: Vec<WorkerAddr>, prefill: Vec<WorkerAddr>) -> Self {
        Self {
            decode: watch::Sender::new(decode),
            prefill: watch::Sender::new(prefill),
        }
    }
}

impl Discovery for StaticDiscovery {
    fn decode_workers(&self) -> watch::Receiver<Vec<WorkerAddr>> {
        self.decode.subscribe()
    }

    fn prefill_workers(&self) -> watch::Receiver<Vec<WorkerAddr>> {
        self.prefill.subscribe()
    }
}
