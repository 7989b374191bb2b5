//! The end-to-end tests: each module starts `tandem` processes (clusters, workers, the CLI) and
//! talks to them as clients and operators do. One test executable for all of them, so the build
//! compiles the shared helpers once and links one binary instead of one per file; run one file's
//! tests with its module name as the filter (`cargo test --release --test e2e -- disagg::`).

mod common;

mod bench_agents;
mod cluster;
mod disagg;
mod disagg_moe;
mod disagg_tp;
mod discovery;
mod dns_discovery;
mod front_door;
mod fuzz_corpus;
mod generate_cli;
mod grpcurl;
mod helm;
mod hostile;
mod image;
mod kv_disk;
mod lora;
mod multihost;
mod peer_pull;
mod prometheus;
mod reasoning;
mod reproducible;
mod routers;
mod soak;
mod speculative;
mod tenants;
mod tool_styles;
mod tracing;
