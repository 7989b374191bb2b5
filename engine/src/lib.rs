//! tandem-engine: the model forward over a paged KV cache, and the loop that serves requests.
//!
//! Owns: the forward of the Llama family (Llama, Mistral, Qwen2, Qwen3), written once against a
//! device op set (`StepOps`, in the `forward` module) and run by each device
//! ([`device`]: [`CpuModel`] over tandem-kernels behind [`CpuBackend`], the same split over
//! tensor-parallel rank threads in [`TpCpuBackend`], and [`CudaModel`]); the [`Backend`] trait the
//! scheduler steps through, built from a [`PoolSize`] ([`device::on`] picks one for a device);
//! the KV pool ([`KvPool`], f32, f16 or int8), the [`BlockManager`] (ref counts, prefix cache, LRU
//! eviction, events for the router), the [`Sampler`], the [`Engine`] (one packed forward per
//! step, planned by a [`Scheduler`]: by default iteration-level, decode first, chunked prefill
//! within a token budget, preemption by recompute) and the [`EngineHandle`] that runs it on its own thread behind
//! channels. There is no contiguous-cache path: every token's K/V lives in paged blocks, prefill
//! and decode alike.
//!
//! Does not own: networking (the workers), file formats and text (tandem-model), or arithmetic
//! kernels (tandem-kernels).
//!
//! The modules, lowest first; each uses only those before it, so the crate reads bottom-up:
//!
//! | module | what it holds |
//! | --- | --- |
//! | `error` | [`EngineError`] and whose fault each failure is |
//! | `block_manager`, `kv_cache`, `sampler` | the block bookkeeping, the pool's memory, sampling |
//! | [`spec`] | speculative decoding's proposers ([`spec::Proposer`]: n-gram lookup, suffix decoding) |
//! | `shard` | which part of the model a tensor-parallel rank holds ([`TpShard`]) |
//! | `forward` | the forward over `StepOps`, a step's [`SeqBatch`]es packed into rows, [`OpTimes`] |
//! | [`backend`] | the [`Backend`] trait, [`PoolSize`], [`RankPool`], [`TpStats`], the slowdown hook |
//! | [`device`] | `cpu` ([`CpuModel`], [`CpuBackend`]), `tp_cpu`, `cuda`; [`device::on`] |
//! | `engine` | the engine ([`Engine`], [`EngineConfig`], requests, events, stats), its step in stages, the [`Scheduler`] seam ([`StepPlan`]; [`Continuous`], [`StaticBatches`]), and the disk tier under its prefix cache ([`KvDiskConfig`]) |
//! | `handle` | [`EngineHandle`]: the engine on its own thread, per-request streams |
//!
//! Main types: [`Engine`] with its [`EngineConfig`], [`Request`] and [`Event`]s; [`EngineHandle`]
//! with its [`RequestStream`] of [`StreamEvent`]s; [`EngineError`]. Everything is exported here;
//! the modules are private except [`backend`] and [`device`].

#![deny(missing_docs)]

// The modules in layers, lowest first: each uses only those listed before it.
pub mod backend;
mod block_manager;
pub mod device;
mod engine;
mod error;
mod forward;
mod handle;
mod kv_cache;
mod sampler;
mod shard;
pub mod spec;
#[cfg(test)]
mod testing;

pub use backend::{Backend, DevicePool, PoolSize, RankPool, TpStats};
pub use block_manager::{BlockCounts, BlockManager, KvEvent, KvEventKind, PoolFull, SeqBlocks};
pub use device::cpu::{CpuBackend, CpuModel, WeightFormat};
pub use device::cuda::CudaModel;
pub use device::staging::{DeviceKv, DeviceKvFormat, DeviceSink, InFlight, Pinned};
pub use device::tp_cpu::{TpCpuBackend, TpCpuConfig};
pub use device::tp_cuda::TpCudaBackend;
pub use engine::{
    Continuous, Cost, DiskCounts, Engine, EngineConfig, EngineStats, Event, FinishReason, Finished,
    KvChunk, KvDiskConfig, KvPiece, Limits, PrefillOrder, Request, RequestId, Reservation,
    ResumedCounts, Samples, Scheduler, SeqInfo, SpecCounts, StaticBatches, StepCost, StepPlan,
    StepStats, TokenEvent, MAX_PASSED, MIN_ITL_PREFILL_CHUNK, MIN_PREFILL_CHUNK,
};
pub use error::EngineError;
pub use forward::{ExpertLoad, OpTimes, SeqBatch};
pub use handle::{EngineHandle, KvUpdate, RequestStream, StreamEvent};
pub use kv_cache::{KvDtype, KvPool, KvPoolWriter};
pub use sampler::{Sampled, Sampler};
pub use shard::TpShard;
pub use spec::{SpecConfig, SpecMethod};
pub use tandem_types::{BlockId, ErrorKind, SamplingError, SamplingParams, ValidSampling};
