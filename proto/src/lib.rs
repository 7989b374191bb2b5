//! tandem-proto: the gRPC contracts, generated at build time from `proto/**/*.proto`.
//!
//! Owns: `tandem.v1` (the public `Generation` API the router serves: Generate, Tokenize,
//! ListModels) and `tandem.worker.v1` (the worker API: `Decode` served by decode workers, `Prefill`
//! by prefill workers, `WorkerControl` by both), the encoded descriptor set for gRPC reflection,
//! and the wire's side of the shared words in tandem-types ([`wire`]: a request's sampling to and
//! from its messages, a failure's kind to and from a gRPC code), so both ends of a call map them
//! the same way; [`guard`], the layer that turns a panic in any call into that call's `INTERNAL`
//! status. Does not own any other behaviour: conversions to engine or router types live
//! with those crates.
//!
//! Main items: [`v1`] and [`worker`] (the generated messages, clients and servers, documented by
//! their `.proto` files' comments where those have them), [`wire`] (the shared conversions) and
//! [`FILE_DESCRIPTOR_SET`].

#![deny(missing_docs)]

pub mod guard;
pub mod wire;

/// `tandem.v1`, the public API the router serves: the `Generation` service (Generate, Tokenize,
/// ListModels), its messages, client and server.
#[allow(missing_docs)]
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

/// `tandem.worker.v1`, the worker API: the `Decode` service of decode workers, `Prefill` of
/// prefill workers, `WorkerControl` of both, their messages, clients and servers.
#[allow(missing_docs)]
pub mod worker {
    tonic::include_proto!("tandem.worker.v1");
}

/// Every file's descriptor, encoded, for `tonic-reflection` (so grpcurl works without .proto files).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/tandem_descriptor.bin"));
