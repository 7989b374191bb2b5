//! The Helm chart (deploy/helm/tandem), rendered the way an install would: `helm lint --strict`
//! and `helm template` for the default values and every example values file; every rendered
//! object valid under `kubernetes-validate --strict` (PyPI); every container's command line one
//! the binary accepts (so the chart cannot pass a flag `tandem` does not know); a values typo or
//! a wrong type refused by the schema naming the key; prefill and decode groups with different
//! tensor-parallel sizes refused at render; and deploy/k8s/tandem.yaml exactly what the chart
//! renders for users without Helm. `helm` comes from scripts/test (target/tools/helm) or
//! `TANDEM_HELM`. No Kubernetes cluster runs here: installing is not tested.

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use common::{helm, helm_render as render, output_text as text, python, yaml_objects as objects};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn chart() -> PathBuf {
    root().join("deploy/helm/tandem")
}

fn validate(yaml: &str, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("rendered.yaml");
    std::fs::write(&f, yaml).unwrap();
    let bin = python().with_file_name("kubernetes-validate");
    let o = Command::new(&bin)
        .arg("--strict")
        .arg(&f)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/test installs it)", bin.display()));
    assert!(o.status.success(), "{what}: {}", text(&o));
}

/// Every container's arguments, with the downward-API variables filled in, parse: the binary is
/// asked for `--help` after them, which it gives only when every flag before it is known and
/// every value valid.
fn commands_parse(objs: &[Value], what: &str) -> usize {
    let mut checked = 0;
    for o in objs {
        let containers = &o["spec"]["template"]["spec"]["containers"];
        for c in containers.as_array().into_iter().flatten() {
            let args: Vec<String> = c["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| {
                    a.as_str()
                        .unwrap()
                        .replace("$(POD_IP)", "10.0.0.7")
                        .replace("$(POD_NAME)", "pod-0")
                })
                .collect();
            let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
                .args(&args)
                .arg("--help")
                .env("TANDEM_KV_SECRET", "a-secret-of-enough-length")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{what}: {} {}: tandem {args:?} is refused: {}",
                o["kind"],
                o["metadata"]["name"],
                text(&out)
            );
            checked += 1;
            // The preStop hook's command, when there is one, is the binary's too.
            if let Some(cmd) = c["lifecycle"]["preStop"]["exec"]["command"].as_array() {
                let cmd: Vec<&str> = cmd.iter().map(|a| a.as_str().unwrap()).collect();
                assert_eq!(cmd[0], "tandem", "{what}: preStop {cmd:?}");
                let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
                    .args(&cmd[1..])
                    .arg("--help")
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "{what}: preStop {cmd:?} is refused: {}",
                    text(&out)
                );
            }
        }
    }
    checked
}

#[test]
fn the_chart_lints_renders_valid_objects_and_commands_the_binary_accepts() {
    let c = chart();
    let examples = ["", "examples/cpu.yaml", "examples/gpu-disagg.yaml"];
    for ex in examples {
        let values = c.join(ex);
        let mut extra = Vec::new();
        if !ex.is_empty() {
            extra = vec!["-f", values.to_str().unwrap()];
        }
        let mut lint = vec!["lint", "--strict", c.to_str().unwrap()];
        lint.extend_from_slice(&extra);
        let o = helm(&lint);
        assert!(o.status.success(), "helm lint {ex}: {}", text(&o));
        let yaml = render(&extra);
        validate(&yaml, ex);
        let objs = objects(&yaml);
        let kinds: Vec<&str> = objs.iter().map(|o| o["kind"].as_str().unwrap()).collect();
        for k in [
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "Secret",
            "Job",
            "NetworkPolicy",
        ] {
            assert!(kinds.contains(&k), "{ex}: no {k} in {kinds:?}");
        }
        // The worker plane: each group's ports take the release's router and workers only,
        // and the router has the secret its credential comes from.
        let roles = |rule: &serde_json::Value| -> Vec<String> {
            rule["from"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                        .as_str()
                        .unwrap()
                        .to_string()
                })
                .collect()
        };
        for o in objs.iter().filter(|o| o["kind"] == "NetworkPolicy") {
            let rule = &o["spec"]["ingress"][0];
            assert_eq!(roles(rule), ["router", "decode", "prefill"], "{ex}: {o}");
            let ports = rule["ports"].as_array().unwrap().len();
            let decode = o["metadata"]["name"] == "tandem-decode";
            assert_eq!(ports, if decode { 2 } else { 1 }, "{ex}: {o}");
            // GPU groups take NCCL payload links from the release's workers, on every port.
            let every_port: Vec<&serde_json::Value> = o["spec"]["ingress"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| r.get("ports").is_none())
                .collect();
            let gpu = ex.contains("gpu");
            assert_eq!(every_port.len(), gpu as usize, "{ex}: {o}");
            if let Some(r) = every_port.first() {
                assert_eq!(roles(r), ["decode", "prefill"], "{ex}: {o}");
            }
        }
        let router = objs
            .iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "tandem-router")
            .unwrap();
        let env = router["spec"]["template"]["spec"]["containers"][0]["env"].to_string();
        assert!(env.contains("TANDEM_KV_SECRET"), "{ex}: {env}");
        // Router, decode, prefill and the model fetch.
        assert_eq!(commands_parse(&objs, ex), 4, "{ex}");
        // Workers drain before Kubernetes kills them.
        for o in objs.iter().filter(|o| o["kind"] == "Deployment") {
            let spec = &o["spec"]["template"]["spec"];
            let args = spec["containers"][0]["args"].to_string();
            if let Some(i) = args.find("--drain-timeout-s=") {
                let drain: u64 = args[i + 18..].split('"').next().unwrap().parse().unwrap();
                let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
                assert!(grace > drain, "{ex}: grace {grace} s, drain {drain} s");
                // And they leave the cluster first.
                let hook = &spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"];
                assert_eq!(hook[1], "deregister", "{ex}: {hook}");
            }
        }
    }

    // The GPU example: its groups ask for GPUs, get a memory-backed /dev/shm and find each other
    // through etcd.
    let gpu = c.join("examples/gpu-disagg.yaml");
    let objs = objects(&render(&["-f", gpu.to_str().unwrap()]));
    let decode = objs
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "tandem-decode")
        .unwrap();
    let pod = &decode["spec"]["template"]["spec"];
    assert_eq!(
        pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        1
    );
    assert!(pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["emptyDir"]["medium"] == "Memory"));
    let args = pod["containers"][0]["args"].to_string();
    assert!(
        args.contains("--discovery=etcd://etcd-0.etcd:2379,etcd-1.etcd:2379"),
        "{args}"
    );
    assert!(args.contains("--device=cuda"), "{args}");

    // Tensor parallelism and the deadlines reach the workers and the router as flags the binary
    // takes; the two worker groups' degrees may differ (KV moves between TP sizes).
    let objs = objects(&render(&[
        "--set-json",
        "decode.tensorParallel=3",
        "--set-json",
        "decode.kvStallTimeoutMs=7000",
        "--set-json",
        "decode.kvDeadlineSlack=2.5",
        "--set-json",
        "router.workerStallTimeoutMs=20000",
        "--set-json",
        "decode.kvLink=\"off\"",
    ]));
    assert_eq!(commands_parse(&objs, "tp 3"), 4);
    let args = |name: &str| {
        objs.iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))["spec"]["template"]["spec"]["containers"][0]
            ["args"]
            .to_string()
    };
    let decode = args("tandem-decode");
    for flag in [
        "\"--tp=3\"",
        "\"--kv-stall-timeout-ms=7000\"",
        "\"--kv-deadline-slack=2.5\"",
        "\"--kv-link=off\"",
    ] {
        assert!(decode.contains(flag), "{flag}: {decode}");
    }
    assert!(!args("tandem-prefill").contains("--tp="));
    assert!(args("tandem-prefill").contains("\"--kv-link=auto\""));
    // Expert parallelism the same way, on one group.
    let objs = objects(&render(&["--set-json", "prefill.expertParallel=2"]));
    assert_eq!(commands_parse(&objs, "ep 2"), 4);
    let prefill = objs
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "tandem-prefill")
        .expect("the prefill group")["spec"]["template"]["spec"]["containers"][0]["args"]
        .to_string();
    assert!(prefill.contains("\"--ep=2\""), "{prefill}");
    // The disk tier: an emptyDir sized past the tier, or a claim the group shares.
    let objs = objects(&render(&[
        "--set-json",
        "decode.kvDisk={\"enabled\":true,\"sizeGb\":20}",
        "--set-json",
        "prefill.kvDisk={\"enabled\":true,\"claimName\":\"kv\",\"shared\":true}",
    ]));
    assert_eq!(commands_parse(&objs, "kv disk"), 4);
    let spec = |name: &str| {
        objs.iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))["spec"]["template"]["spec"]
            .clone()
    };
    let (d, p) = (spec("tandem-decode"), spec("tandem-prefill"));
    let d_args = d["containers"][0]["args"].to_string();
    assert!(
        d_args.contains("\"--kv-disk-dir=/kv-disk\"") && d_args.contains("\"--kv-disk-gb=20\"")
    );
    assert!(!d_args.contains("--kv-disk-shared"), "{d_args}");
    let volume = |s: &Value| {
        s["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "kv-disk")
            .cloned()
            .expect("a kv-disk volume")
    };
    assert_eq!(volume(&d)["emptyDir"]["sizeLimit"], "21Gi");
    assert_eq!(volume(&p)["persistentVolumeClaim"]["claimName"], "kv");
    assert!(p["containers"][0]["args"]
        .to_string()
        .contains("\"--kv-disk-shared\""));
    assert!(p["containers"][0]["volumeMounts"]
        .to_string()
        .contains("/kv-disk"));
    let router = args("tandem-router");
    assert!(
        router.contains("\"--worker-stall-timeout-ms=20000\""),
        "{router}"
    );

    // Tenants: the chart makes a Secret of the list, mounts its directory (so the kubelet's
    // updates reach the router, which reads the file again) and points --tenants at it; the
    // queue's limits become flags.
    let objs = objects(&render(&[
        "--set-json",
        "router.tenants={\"list\":[{\"name\":\"team-a\",\"keys\":[\"key-a\"],\"priority\":1,\"requests_per_minute\":600},{\"name\":\"team-b\",\"keys\":[\"key-b\"],\"max_concurrent\":4}]}",
        "--set-json",
        "router.maxInFlightPerWorker=8",
        "--set-json",
        "router.maxQueueWaitMs=30000",
    ]));
    assert_eq!(commands_parse(&objs, "tenants"), 4);
    let secret = objs
        .iter()
        .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == "tandem-tenants")
        .expect("the tenants Secret");
    // The file in the Secret is one the router takes, with the tenants of the values.
    let file = secret["stringData"]["tenants.yaml"].as_str().unwrap();
    let table = tandem_router::TenantTable::parse(file, false).unwrap();
    assert_eq!(table.tenants.len(), 2);
    assert_eq!(
        (
            table.tenants[0].priority,
            table.tenants[0].requests_per_minute
        ),
        (1, Some(600))
    );
    assert_eq!(table.lookup("key-b").unwrap().max_concurrent, Some(4));
    let router = objs
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "tandem-router")
        .unwrap()["spec"]["template"]["spec"]
        .clone();
    let router_args = router["containers"][0]["args"].to_string();
    for flag in [
        "\"--tenants=/etc/tandem/tenants/tenants.yaml\"",
        "\"--max-in-flight-per-worker=8\"",
        "\"--max-queue-wait-ms=30000\"",
    ] {
        assert!(router_args.contains(flag), "{flag}: {router_args}");
    }
    let mount = router["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "tenants")
        .cloned()
        .expect("the tenants mount");
    assert_eq!(mount["mountPath"], "/etc/tandem/tenants");
    assert!(mount.get("subPath").is_none(), "a subPath is never updated");
    assert!(router["volumes"]
        .to_string()
        .contains("\"secretName\":\"tandem-tenants\""));
    // An existing Secret instead: no Secret made, the same mount.
    let objs = objects(&render(&[
        "--set",
        "router.tenants.existingSecret=my-tenants",
    ]));
    assert!(!objs
        .iter()
        .any(|o| o["metadata"]["name"] == "tandem-tenants"));
    assert!(objs.iter().any(|o| o["kind"] == "Deployment"
        && o["spec"]["template"]["spec"]["volumes"]
            .to_string()
            .contains("\"secretName\":\"my-tenants\"")));
    // No tenants: no flag.
    assert!(!args("tandem-router").contains("--tenants"));
}

/// Stored responses: each router's own by default; one etcd store shared by the replicas
/// when there are several and etcd is known; etcd without endpoints refused. Several replicas
/// share the tenants' limits.
#[test]
fn several_routers_share_the_responses_store_and_the_tenants_limits() {
    let router_args = |extra: &[&str]| {
        let objs = objects(&render(extra));
        objs.iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "tandem-router")
            .unwrap()["spec"]["template"]["spec"]["containers"][0]["args"]
            .to_string()
    };
    let one = router_args(&[]);
    assert!(!one.contains("--responses-store"), "{one}");
    assert!(!one.contains("--router-replicas"), "{one}");
    assert!(one.contains("\"--responses-ttl-s=3600\""), "{one}");
    // Several replicas, no etcd known: each its own (memory).
    let no_etcd = router_args(&["--set", "router.replicas=3"]);
    assert!(!no_etcd.contains("--responses-store"), "{no_etcd}");
    // Several replicas with discovery's etcd: the store there, under the cluster's prefix.
    let shared = router_args(&[
        "--set",
        "router.replicas=3",
        "--set-json",
        r#"discovery.etcd.endpoints=["etcd-0:2379","etcd-1:2379"]"#,
    ]);
    for flag in [
        "\"--responses-store=etcd://etcd-0:2379,etcd-1:2379\"",
        "\"--cluster=tandem\"",
        "\"--discovery=k8s\"",
        "\"--router-replicas=3\"",
    ] {
        assert!(shared.contains(flag), "{flag}: {shared}");
    }
    // Asked for by name with endpoints of its own, and a TTL.
    let named = router_args(&[
        "--set",
        "router.responses.store=etcd",
        "--set-json",
        r#"router.responses.etcdEndpoints=["store:2379"]"#,
        "--set",
        "router.responses.ttlSeconds=600",
    ]);
    assert!(
        named.contains("\"--responses-store=etcd://store:2379\""),
        "{named}"
    );
    assert!(named.contains("\"--responses-ttl-s=600\""), "{named}");
    // Memory by name even with several replicas and etcd.
    let memory = router_args(&[
        "--set",
        "router.replicas=2",
        "--set",
        "router.responses.store=memory",
        "--set-json",
        r#"discovery.etcd.endpoints=["etcd-0:2379"]"#,
    ]);
    assert!(!memory.contains("--responses-store"), "{memory}");
    let c = chart();
    let o = helm(&[
        "template",
        "t",
        c.to_str().unwrap(),
        "--set",
        "router.responses.store=etcd",
    ]);
    assert!(!o.status.success(), "etcd without endpoints was accepted");
    assert!(
        text(&o).contains("router.responses.etcdEndpoints"),
        "{}",
        text(&o)
    );
}

#[test]
fn bad_values_are_refused_naming_what_is_wrong() {
    let c = chart();
    let c = c.to_str().unwrap();
    for (set, says) in [
        ("decode.replcas=2", "replcas"),
        ("decode.replicas=two", "replicas"),
        ("router.policy=fastest", "policy"),
        ("discovery.mode=consul", "mode"),
        ("router.maxInFlightPerWorker=-1", "maxInFlightPerWorker"),
        ("prefill.kvLink=rdma", "kvLink"),
    ] {
        let o = helm(&["lint", "--strict", c, "--set", set]);
        assert!(!o.status.success(), "{set} was accepted");
        assert!(text(&o).contains(says), "{set}: {}", text(&o));
    }
    // Tensor and expert parallelism run on the CPU in this release, and not together: each
    // refused with the reason; a degree past the binary's is refused by the schema (below).
    for (flags, says) in [
        (
            [
                "--set",
                "decode.device=cuda",
                "--set-json",
                "decode.tensorParallel=2",
            ],
            "decode.tensorParallel 2 on device cuda",
        ),
        (
            [
                "--set",
                "decode.device=cuda",
                "--set-json",
                "decode.expertParallel=2",
            ],
            "decode.expertParallel 2 on device cuda",
        ),
        (
            [
                "--set-json",
                "decode.expertParallel=2",
                "--set-json",
                "decode.tensorParallel=2",
            ],
            "not both",
        ),
        (
            [
                "--set-json",
                "decode.kvDisk.enabled=true",
                "--set-json",
                "decode.kvDisk.shared=true",
            ],
            "decode.kvDisk.shared needs a claimName",
        ),
    ] {
        let o = helm(&[&["template", "t", c][..], &flags[..]].concat());
        assert!(!o.status.success(), "{flags:?} was accepted");
        assert!(text(&o).contains(says), "{flags:?}: {}", text(&o));
    }
    let o = helm(&[
        "lint",
        "--strict",
        c,
        "--set-json",
        "prefill.tensorParallel=65",
    ]);
    assert!(!o.status.success(), "TP 65 was accepted");
    assert!(text(&o).contains("tensorParallel"), "{}", text(&o));
    let o = helm(&["template", "t", c, "--set", "discovery.mode=etcd"]);
    assert!(!o.status.success(), "etcd without endpoints was accepted");
    assert!(
        text(&o).contains("discovery.etcd.endpoints"),
        "{}",
        text(&o)
    );
}

#[test]
fn the_optional_monitoring_and_autoscaling_render() {
    let c = chart();
    let c = c.to_str().unwrap();
    let on = [
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.grafanaDashboard.enabled=true",
        "--set",
        "autoscaling.enabled=true",
        "--set",
        "autoscaling.prometheusAddress=http://prometheus.monitoring:9090",
    ];
    let mut lint = vec!["lint", "--strict", c];
    lint.extend_from_slice(&on);
    let o = helm(&lint);
    assert!(o.status.success(), "{}", text(&o));
    let objs = objects(&render(&on));
    let count = |kind: &str| objs.iter().filter(|o| o["kind"] == kind).count();
    assert_eq!(count("ServiceMonitor"), 2, "router and workers");
    assert_eq!(count("ScaledObject"), 2, "decode and prefill");
    // KEDA owns the groups' sizes: the Deployments leave replicas to it.
    for o in objs.iter().filter(|o| o["kind"] == "Deployment") {
        let name = o["metadata"]["name"].as_str().unwrap();
        assert_eq!(
            o["spec"]["replicas"].is_null(),
            name != "tandem-router",
            "{name}"
        );
    }
    let scaled = objs.iter().find(|o| o["kind"] == "ScaledObject").unwrap();
    let query = scaled["spec"]["triggers"][0]["metadata"]["query"]
        .as_str()
        .unwrap();
    assert!(query.contains("tandem_num_requests_waiting"), "{query}");
    // The planner's targets: decode scales on the mean inter-token gap, prefill on the TTFT's
    // 90th percentile, each a Value metric against its target (tests/e2e/prometheus.rs runs
    // the queries against a real Prometheus).
    let latency = |name: &str| -> (String, String) {
        let o = objs
            .iter()
            .find(|o| o["kind"] == "ScaledObject" && o["metadata"]["name"] == name)
            .unwrap();
        let t = &o["spec"]["triggers"][1];
        assert_eq!(t["metricType"], "Value", "{name}");
        (
            t["metadata"]["query"].as_str().unwrap().to_string(),
            t["metadata"]["threshold"].as_str().unwrap().to_string(),
        )
    };
    let (itl, at) = latency("tandem-decode");
    assert!(
        itl.contains("tandem_inter_token_latency_seconds_sum"),
        "{itl}"
    );
    assert_eq!(at, "100");
    let (ttft, at) = latency("tandem-prefill");
    assert!(ttft.contains("histogram_quantile(0.9"), "{ttft}");
    assert_eq!(at, "2000");
    // A target of 0 leaves only the queue trigger.
    let off = objects(&render(&[
        on[4],
        on[5],
        on[6],
        on[7],
        "--set",
        "autoscaling.decode.itlTargetMs=0",
    ]));
    let decode = off
        .iter()
        .find(|o| o["kind"] == "ScaledObject" && o["metadata"]["name"] == "tandem-decode")
        .unwrap();
    assert_eq!(decode["spec"]["triggers"].as_array().unwrap().len(), 1);
    // The dashboard the chart ships is deploy/grafana/tandem.json.
    let cm = objs.iter().find(|o| o["kind"] == "ConfigMap").unwrap();
    let shipped: Value = serde_json::from_str(cm["data"]["tandem.json"].as_str().unwrap()).unwrap();
    let source: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/tandem.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        shipped, source,
        "deploy/helm/tandem/files/tandem.json is out of date"
    );
    let o = helm(&["template", "t", c, "--set", "autoscaling.enabled=true"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("autoscaling.prometheusAddress"),
        "{}",
        text(&o)
    );
}

#[test]
fn the_plain_manifests_are_what_the_chart_renders() {
    let rendered = render(&["--set", "kvSecret.existingSecret=tandem-kv"]);
    let path = root().join("deploy/k8s/tandem.yaml");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    let body = on_disk
        .split_once("\n---\n")
        .map(|(_, rest)| format!("---\n{rest}"))
        .unwrap_or_default();
    assert!(
        body == rendered,
        "{} is out of date: run scripts/render-manifests",
        path.display()
    );
}
