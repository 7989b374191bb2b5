//! tandem-proto: the gRPC contracts, generated at build time from `proto/**/*.proto`.
//!
//! Owns: `tandem.v1` (the public `Generation` API the router serves: Generate, Tokenize,
//! ListModels) and `tandem.worker.v1` (the worker API: `Decode` served by decode workers, `Prefill`
//! by prefill workers), plus the encoded descriptor set for gRPC reflection. Does not own any
//! behaviour: conversions to engine or router types live with those crates.

/// The public API.
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

/// The worker API.
pub mod worker {
    tonic::include_proto!("tandem.worker.v1");
}

/// Every file's descriptor, encoded, for `tonic-reflection` (so grpcurl works without .proto files).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/tandem_descriptor.bin"));
