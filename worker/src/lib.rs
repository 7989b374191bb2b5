//! tandem-worker: what a decode worker and a prefill worker share, so that the two roles are
//! siblings and neither depends on the other.
//!
//! Owns: a worker's [`WorkerIdentity`]; the [`ControlService`] both roles serve
//! (`tandem.worker.v1.WorkerControl`: Info, Load and the KV-event stream the router follows);
//! the [`Drain`] that counts requests in flight and stops a worker gracefully; [`serve`], the
//! gRPC server every role runs (its own service, WorkerControl, grpc.health.v1 and `/metrics` on
//! one port, then the drain on the shutdown signal); the Prometheus encoders and the engine's own
//! metrics ([`metrics`]); the engine↔worker API conversions and the one mapping of an engine
//! failure to a gRPC status ([`convert`]); the KV pool as the destination of a transfer
//! ([`PoolSink`]) and the rates its KV links were measured at ([`LinkRates`]); the LoRA adapters
//! it serves ([`Loras`]); and the spans of a request's trace both roles write ([`trace`]).
//!
//! Does not own: either role's own work (tandem-decode-worker's `Generate`,
//! tandem-prefill-worker's `Prefill`), the engine loop, or routing.

#![deny(missing_docs)]

mod auth;
mod control;
pub mod convert;
mod drain;
mod kv_sink;
pub mod links;
mod lora;
pub mod metrics;
mod serve;
pub mod trace;

pub use auth::WorkerToken;
pub use control::ControlService;
pub use drain::{Drain, InFlight};
pub use kv_sink::{kv_shape, KvSink, KvTarget, PoolSink};
pub use links::LinkRates;
pub use lora::{LoraError, Loras};
pub use serve::serve;

/// What a worker says about itself in `Info`.
#[derive(Clone, Debug)]
pub struct WorkerIdentity {
    /// Unique in the cluster (the CLI uses the advertised address).
    pub worker_id: String,
    /// The served model's name.
    pub model: String,
    /// The KV cache's element type, as `--kv-dtype` names it.
    pub kv_dtype: String,
    /// The LoRA adapters it serves.
    pub loras: std::sync::Arc<Loras>,
}
