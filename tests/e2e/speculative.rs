//! Speculative decoding as clients see it: a speculating worker answers what a plain one
//! answers (structured outputs valid and the same, stop strings cutting at the same place,
//! seeded samples the same, logprobs the same), and says in its metrics what it proposed and
//! what was accepted.

use serde_json::{json, Value};

use crate::common::*;

/// The same request to both routers: the plain worker's answer and the speculating one's.
async fn both(plain: &Router, spec: &Router, path: &str, body: Value) -> (Value, Value) {
    let (s0, v0) = post(&plain.http, path, body.clone()).await;
    let (s1, v1) = post(&spec.http, path, body).await;
    assert_eq!((s0, s1), (200, 200), "{v0} {v1}");
    (v0, v1)
}

/// What a choice said and why it stopped (with its tokens' logprobs where asked for).
fn choice(v: &Value) -> (Value, Value, Value) {
    let c = &v["choices"][0];
    let text = match c.get("message") {
        Some(m) => m["content"].clone(),
        None => c["text"].clone(),
    };
    (text, c["finish_reason"].clone(), c["logprobs"].clone())
}

/// Every proposal verified (`--speculative-fixed`): the adaptive policy prices steps by their
/// measured time, so on a busy machine it may withhold nearly every proposal, and the counts
/// asserted below would depend on the machine's speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speculating_worker_answers_what_a_plain_one_answers() {
    answers_what_a_plain_worker_answers(&[
        "--speculative=ngram",
        "--num-speculative-tokens=6",
        "--speculative-fixed",
    ])
    .await;
}

/// The same with a draft model (the model's own file, every proposal verified): grammar masks
/// cut its proposals, stop strings and `max_tokens` end inside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_speculating_with_a_draft_model_answers_what_a_plain_one_answers() {
    let draft = format!(
        "--speculative=draft:{}",
        tandem_model::default_model_path().display()
    );
    // Four tokens a proposal at every kernel level (AVX2's default is two), so that stops and
    // `max_tokens` fall inside proposals as often.
    answers_what_a_plain_worker_answers(&[
        &draft,
        "--num-speculative-tokens=4",
        "--speculative-fixed",
    ])
    .await;
}

/// A plain worker and one started with `spec`, each behind a router: the structured-output
/// client's checks pass against the speculating one, and structured, stopped, seeded and
/// logprob-carrying requests get the same answers from both; the speculating worker's metrics
/// count what it proposed and accepted, the plain one's nothing.
async fn answers_what_a_plain_worker_answers(spec: &[&str]) {
    let (_d0, d0addr) = start_worker(&[]);
    let (_d1, d1addr) = start_worker(spec);
    let plain = start_router(std::slice::from_ref(&d0addr), &[]);
    let spec = start_router(std::slice::from_ref(&d1addr), &[]);
    wait_ready(&plain, 1).await;
    wait_ready(&spec, 1).await;
    let model = models(&spec.http).await["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The structured-output client's checks (every schema valid) against the speculating one.
    let checks = structured_python_client(&format!("{}/v1", spec.http), &model, true).await;
    assert!(checks > 0);
    let text = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over \
                the lazy dog again. Then the quick brown fox";
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "color": {"type": "string"},
            "legs": {"type": "integer"},
        },
        "required": ["name", "color", "legs"],
    });
    let requests = [
        // Structured: greedy JSON under a schema, the same document.
        (
            "/v1/chat/completions",
            json!({
                "model": model,
                "messages": [{"role": "user", "content": "Describe a fox as JSON with its name, color and legs."}],
                "max_tokens": 200,
                "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "fox", "schema": schema}},
            }),
        ),
        // Stop strings inside text the proposer guesses well: cut at the same place.
        (
            "/v1/completions",
            json!({"model": model, "prompt": text, "max_tokens": 60, "temperature": 0, "stop": ["dog again", "lazy cat"]}),
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": text, "max_tokens": 60, "temperature": 0, "stop": [" over"]}),
        ),
        // Seeded sampling with logprobs, and max_tokens ending inside a proposal.
        (
            "/v1/completions",
            json!({"model": model, "prompt": text, "max_tokens": 37, "temperature": 0.7, "seed": 5, "logprobs": 2, "ignore_eos": true}),
        ),
    ];
    for (path, body) in requests {
        let (v0, v1) = both(&plain, &spec, path, body.clone()).await;
        let (a, b) = (choice(&v0), choice(&v1));
        assert_eq!(a, b, "{body}");
        if path == "/v1/chat/completions" {
            assert_eq!(a.1, "stop", "{v0}");
            let doc: Value = serde_json::from_str(a.0.as_str().unwrap()).unwrap();
            assert!(doc["name"].is_string() && doc["legs"].is_i64(), "{doc}");
        }
    }
    let m = scrape(&d1addr).await;
    let accepted = metric(&m, "tandem_spec_decode_num_accepted_tokens_total");
    let proposed = metric(&m, "tandem_spec_decode_num_draft_tokens_total");
    assert!(accepted > 0.0 && accepted <= proposed, "{m:?}");
    assert!(
        metric(
            &m,
            "tandem_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}"
        ) > 0.0
    );
    let plain_m = scrape(&d0addr).await;
    assert_eq!(
        metric(&plain_m, "tandem_spec_decode_num_draft_tokens_total"),
        0.0
    );
}
