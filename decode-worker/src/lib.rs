//! tandem-decode-worker: the gRPC `Decode` service around an engine in decode mode. It will allocate
//! blocks for each request, prefill locally or receive KV from a prefill worker, stream tokens with
//! continuous batching, report load and KV events, and drain in-flight requests on shutdown.
