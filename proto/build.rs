//! Generates the tonic/prost code from the .proto files with protox (a protobuf compiler in
//! Rust), so building needs no `protoc` on the machine. The encoded descriptor set is written
//! beside the code for gRPC reflection.

use std::path::PathBuf;

use prost::Message;

const PROTOS: &[&str] = &[
    "tandem/v1/generation.proto",
    "tandem/worker/v1/worker.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(PROTOS, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("tandem_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
