//! tandem-router: the front door. It will serve OpenAI-compatible HTTP and gRPC `tandem.v1.Generation`,
//! apply chat templates and tokenize (tandem-model), pick decode and prefill workers through one
//! `RoutingPolicy` trait (round-robin, least-load, kv-aware, conditional disaggregation), discover
//! workers through a `Discovery` trait, and retry or migrate requests when workers fail. It never
//! depends on the engine or kernels.
