//! tandem-discovery: how the workers of a cluster find each other, and how the router finds them.
//!
//! Owns: the [`WorkerCard`] a worker publishes about itself (role, gRPC and KV addresses, model,
//! block size, KV dtype, tensor-parallel size, version); the key layout of a cluster in etcd
//! ([`ClusterPath`]: `/tandem/<cluster>/<role>/<worker-id>`, built and parsed in one place); the
//! `--discovery` choice ([`DiscoverySpec`]: static, a worker-list file, etcd or Kubernetes DNS) and
//! the list file's format ([`WorkerList`]); the check a router
//! makes before it sends a worker traffic ([`Expect`]: same model, same block size); and, with the
//! `etcd` feature, a worker's [`Registration`] (its card under a lease kept alive on its own
//! thread, re-registered when the lease is lost, deleted first on drain) and the router's
//! [`follow`] (list the cluster, then watch it; a broken or compacted watch starts over with a
//! fresh list); and the [`Ready`] line each process prints once its ports are open, with the one
//! parser of it that `tandem up` and the tests share.
//!
//! Does not own: the router's worker pool or its `Discovery` trait (tandem-router), or a worker's
//! drain (tandem-worker).
//!
//! ```
//! use tandem_discovery::{ClusterPath, Role};
//! let cluster = ClusterPath::new("prod").unwrap();
//! let key = cluster.key(Role::Decode, "decode-0").unwrap();
//! assert_eq!(key, "/tandem/prod/decode/decode-0");
//! assert_eq!(cluster.parse_key(&key), Some((Role::Decode, "decode-0")));
//! ```

#![deny(missing_docs)]

mod card;
#[cfg(feature = "etcd")]
mod etcd;
mod list;
mod ready;
mod spec;

pub use card::{CardError, ClusterPath, Expect, Refusal, Role, WorkerCard};
#[cfg(feature = "etcd")]
pub use etcd::{follow, Cards, KvStore, Registration, RegistrationStats};
pub use list::WorkerList;
pub use ready::Ready;
pub use spec::{DiscoverySpec, SpecError};

/// Why talking to the discovery service failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// etcd could not be reached or refused a call; names the endpoints and what was tried.
    #[error("etcd at {endpoints}: {what}: {detail}")]
    Etcd {
        /// The endpoints as given to `--discovery`.
        endpoints: String,
        /// The call that failed (connect, lease grant, put, list).
        what: &'static str,
        /// The client's error.
        detail: String,
    },
    /// The card or key was not valid (an empty id, a `/` in a name).
    #[error(transparent)]
    Card(#[from] CardError),
}
