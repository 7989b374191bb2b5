//! The Helm chart: `helm` (installed by scripts/test), rendering the chart, its objects as JSON.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use super::{python, repo_root};

/// `helm ARGS`: scripts/test installs it in target/tools (or `TANDEM_HELM` names it).
pub fn helm(args: &[&str]) -> std::process::Output {
    let bin = std::env::var_os("TANDEM_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/tools/helm"));
    Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/test installs helm)", bin.display()))
}

/// A command's stdout and stderr, as text.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `helm template tandem deploy/helm/tandem EXTRA`: the rendered YAML.
pub fn helm_render(extra: &[&str]) -> String {
    let chart = repo_root().join("deploy/helm/tandem");
    let mut args = vec!["template", "tandem", chart.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = helm(&args);
    assert!(
        o.status.success(),
        "helm template {extra:?}: {}",
        output_text(&o)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Rendered objects as JSON (PyYAML, which kubernetes-validate brings along).
pub fn yaml_objects(yaml: &str) -> Vec<Value> {
    use std::io::Write;
    let mut p = Command::new(python())
        .args([
            "-c",
            "import sys, yaml, json; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let o = p.wait_with_output().unwrap();
    assert!(o.status.success());
    serde_json::from_slice(&o.stdout).unwrap()
}

/// [`helm_render`] as objects.
pub fn helm_objects(extra: &[&str]) -> Vec<Value> {
    yaml_objects(&helm_render(extra))
}
