//! Python beside the tests (the venv scripts/test makes): test servers, and the official
//! OpenAI client and the structured-output client run against a cluster.

use std::io::BufReader;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use super::{expected, golden, Proc};

pub fn python() -> PathBuf {
    let p = std::env::var_os("TANDEM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/pyenv/bin/python")
        });
    assert!(
        p.exists(),
        "{} missing: scripts/test makes the venv with the OpenAI client",
        p.display()
    );
    p
}

/// Starts `tests/<script>` (a test server in Python) with `args` and waits for the line
/// "listening" it prints once it accepts.
pub fn python_server(script: &str, args: &[String]) -> Proc {
    python_server_in(None, script, args)
}

/// `python ARGS`, inside network namespace `netns` when given.
fn python_command(netns: Option<&str>) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(python());
            c
        }
        None => Command::new(python()),
    }
}

/// [`python_server`] inside network namespace `netns` (when given).
pub fn python_server_in(netns: Option<&str>, script: &str, args: &[String]) -> Proc {
    use std::io::BufRead;
    let mut child = python_command(netns)
        .arg(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests")
                .join(script),
        )
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("python {script}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        "listening",
        "{script} did not start (scripts/test installs what it imports)"
    );
    Proc { child }
}

/// Runs `tests/<script>` with `args` (inside `netns` when given), which must succeed; its
/// standard output (both outputs are printed for the test's log). `who` names the client.
async fn client_script(netns: Option<&str>, script: &str, args: &[String], who: &str) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let out = tokio::process::Command::from(python_command(netns))
        .arg(script)
        .args(args)
        .output()
        .await
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "{who} client checks failed:\n{stdout}"
    );
    stdout
}

/// Runs tests/anthropic_client.py (the official Anthropic Python client) against the router at
/// `http` (its root): the Messages API's checks, every one passed; their count.
pub async fn anthropic_python_client(http: &str, model: &str, extra: &[String]) -> usize {
    counted_checks("anthropic_client.py", "Anthropic", http, model, extra).await
}

/// Runs tests/responses_client.py (the official OpenAI Python client and the OpenAI Agents SDK)
/// against the router at `http` (its root): the Responses API's checks, every one passed;
/// their count.
pub async fn responses_python_client(http: &str, model: &str, extra: &[String]) -> usize {
    counted_checks("responses_client.py", "Responses", http, model, extra).await
}

/// A client script that ends with "N/M ... passed": every check passed; their count.
async fn counted_checks(
    script: &str,
    who: &str,
    http: &str,
    model: &str,
    extra: &[String],
) -> usize {
    let mut args = vec![format!("--base-url={http}"), format!("--model={model}")];
    args.extend_from_slice(extra);
    let stdout = client_script(None, script, &args, who).await;
    let last = stdout.lines().last().unwrap_or_default();
    let (passed, all) = last
        .split_once(' ')
        .and_then(|(n, _)| n.split_once('/'))
        .expect("a count line");
    assert_eq!(passed, all, "{last}");
    passed.parse().unwrap()
}

/// Runs tests/openai_client.py (the official OpenAI Python client) against `base_url`: every
/// golden case four ways, exact text, finish reason and usage. `extra` goes to the script
/// (`--api-key=K`, `--ca-cert=PEM`).
pub async fn openai_python_client(
    base_url: &str,
    model: &str,
    tok: &tandem_model::Tokenizer,
    extra: &[String],
) {
    openai_python_client_in(None, base_url, model, tok, extra).await
}

/// [`openai_python_client`] run inside network namespace `netns` (when given).
pub async fn openai_python_client_in(
    netns: Option<&str>,
    base_url: &str,
    model: &str,
    tok: &tandem_model::Tokenizer,
    extra: &[String],
) {
    let cases: Vec<Value> = golden()
        .iter()
        .map(|g| {
            let e = expected(tok, g);
            let mut c = serde_json::json!({
                "id": g["id"],
                "max_tokens": g["n_new"],
                "prompt_tokens": g["n_prompt"],
                "text_ignore_eos": e.text_ignore_eos,
                "text_eos": e.text_eos,
                "tokens_eos": e.tokens_eos,
                "finish_eos": e.finish_eos,
            });
            if g["chat"].is_array() {
                c["kind"] = serde_json::json!("chat");
                c["messages"] = g["chat"].clone();
            } else {
                c["kind"] = serde_json::json!("completion");
                c["prompt"] = g["prompt"].clone();
            }
            c
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cases.json");
    std::fs::write(&path, serde_json::to_string(&cases).unwrap()).unwrap();
    let mut args = vec![
        format!("--base-url={base_url}"),
        format!("--model={model}"),
        format!("--cases={}", path.display()),
    ];
    args.extend_from_slice(extra);
    let stdout = client_script(netns, "openai_client.py", &args, "OpenAI").await;
    assert!(stdout.contains(&format!(
        "{n}/{n} OpenAI client checks passed",
        n = cases.len() * 4
    )));
}

/// Runs tests/structured_client.py (structured outputs through the official OpenAI Python
/// client, each answer validated with `jsonschema`) against `base_url`; `quick` runs each schema
/// once (greedy, not streamed) and nothing else. Returns the number of requests that generated.
pub async fn structured_python_client(base_url: &str, model: &str, quick: bool) -> usize {
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/structured_client.py");
    let mut cmd = tokio::process::Command::from(python_command(None));
    cmd.arg(script)
        .arg(format!("--base-url={base_url}"))
        .arg(format!("--model={model}"));
    if quick {
        cmd.arg("--quick");
    }
    let out = cmd.output().await.expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "structured output checks failed:\n{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.ends_with("structured output checks passed"))
        .expect("a summary line");
    let (passed, total) = line
        .split_whitespace()
        .next()
        .and_then(|f| f.split_once('/'))
        .expect("N/N");
    assert_eq!(passed, total, "{line}");
    total.parse().unwrap()
}
