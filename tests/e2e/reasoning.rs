//! Reasoning split out of the answer, through the engine: the tiny Qwen3 of the families tests
//! served with a thinking chat template (a copy of its directory with that template), its
//! output forced through the tags by a regular expression where the split itself is checked,
//! and each API's reasoning (chat's `reasoning_content`, a Responses reasoning item, a Messages
//! `thinking` block) equal to chat's, whole and streamed; thinking turned off by each API's
//! switch writes the empty thought into the prompt.

use crate::common;

use common::*;
use serde_json::{json, Value};

/// Qwen3's way: ChatML, an earlier answer's thought dropped, `enable_thinking: false` writing
/// an empty thought into the prompt.
const QWEN3_THINKING: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}";

/// DeepSeek-R1's way: the generation prompt opens the thought.
const R1_THINKING: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}";

/// One decode worker and a router serving the model in `dir`; its name.
async fn serve(dir: &std::path::Path) -> (Proc, Router, String) {
    let (w, addr, _) = Launch::decode().model(dir).spawn_decode();
    let r = Launch::router(std::slice::from_ref(&addr))
        .model(dir)
        .spawn_router();
    wait_ready(&r, 1).await;
    let model = models(&r.http).await["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    (w, r, model)
}

/// A streamed request's `data:` payloads (JSON), the closing `[DONE]` left out.
async fn streamed(http: &str, path: &str, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let text = reqwest::Client::new()
        .post(format!("{http}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    sse_events(&text)
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap_or_else(|_| panic!("bad event {e}")))
        .collect()
}

/// The texts of the streamed chat deltas' `field`, joined.
fn chat_deltas(events: &[Value], field: &str) -> String {
    events
        .iter()
        .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["delta"][field].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thinking_model_s_reasoning_is_split_from_its_answer() {
    let dir = qwen3_with_template(QWEN3_THINKING);
    let (_w, r, model) = serve(dir.path()).await;
    let msgs = json!([{"role": "user", "content": "Once upon a time"}]);
    let regex = "<think>\n[a-z ]{4,12}\n</think>\n\n[a-z ]{4,12}";
    let chat = json!({"model": model, "messages": msgs, "max_tokens": 64, "temperature": 0,
                      "guided_regex": regex});
    let whole = post_ok(&r.http, "/v1/chat/completions", chat.clone()).await;
    let m = &whole["choices"][0]["message"];
    let thought = m["reasoning_content"]
        .as_str()
        .expect("reasoning")
        .to_string();
    let answer = m["content"].as_str().expect("an answer").to_string();
    assert!(thought.len() >= 4 && answer.len() >= 4, "{m}");
    // The same prompt's raw output is exactly the thought in its tags, then the answer.
    let tok = post_ok(
        &r.http,
        "/tokenize",
        json!({"model": model, "messages": msgs}),
    )
    .await;
    let raw = post_ok(
        &r.http,
        "/v1/completions",
        json!({"model": model, "prompt": tok["tokens"], "max_tokens": 64, "temperature": 0,
               "guided_regex": regex}),
    )
    .await;
    assert_eq!(
        raw["choices"][0]["text"].as_str().unwrap(),
        format!("<think>\n{thought}\n</think>\n\n{answer}")
    );
    // Streamed: the same split, in `reasoning_content` and `content` deltas.
    let events = streamed(&r.http, "/v1/chat/completions", chat).await;
    assert_eq!(chat_deltas(&events, "reasoning_content"), thought);
    assert_eq!(chat_deltas(&events, "content"), answer);

    // Thinking off: the empty thought is in the prompt, and the output is all answer.
    let off = json!({"enable_thinking": false});
    let tok_off = post_ok(
        &r.http,
        "/tokenize",
        json!({"model": model, "messages": msgs, "chat_template_kwargs": off}),
    )
    .await;
    let prompt_off = post_ok(
        &r.http,
        "/detokenize",
        json!({"model": model, "tokens": tok_off["tokens"]}),
    )
    .await;
    assert!(
        prompt_off["prompt"]
            .as_str()
            .unwrap()
            .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{prompt_off}"
    );
    let n_off = tok_off["count"].as_u64().unwrap();
    assert!(n_off > tok["count"].as_u64().unwrap());
    let plain = json!({"model": model, "messages": msgs, "max_tokens": 8, "temperature": 0,
                       "guided_regex": "[a-z ]{4,12}", "chat_template_kwargs": off});
    let v = post_ok(&r.http, "/v1/chat/completions", plain).await;
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], Value::Null);
    assert_eq!(v["usage"]["prompt_tokens"], n_off);
    // Each API's switch turns it off the same way (the same prompt).
    let v = post_ok(
        &r.http,
        "/v1/chat/completions",
        json!({"model": model, "messages": msgs, "max_tokens": 2, "reasoning_effort": "none"}),
    )
    .await;
    assert_eq!(v["usage"]["prompt_tokens"], n_off, "reasoning_effort none");
    let v = post_ok(
        &r.http,
        "/v1/responses",
        json!({"model": model, "input": msgs, "max_output_tokens": 2,
               "reasoning": {"effort": "none"}}),
    )
    .await;
    assert_eq!(v["usage"]["input_tokens"], n_off, "reasoning.effort none");
    let v = post_ok(
        &r.http,
        "/v1/messages",
        json!({"model": model, "messages": msgs, "max_tokens": 2}),
    )
    .await;
    assert_eq!(v["usage"]["input_tokens"], n_off, "no thinking asked");
    let v = post_ok(
        &r.http,
        "/v1/messages",
        json!({"model": model, "messages": msgs, "max_tokens": 2,
               "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    )
    .await;
    assert_eq!(v["usage"]["input_tokens"], tok["count"], "thinking enabled");
}

/// A template that opens the thought in the prompt: the output is reasoning until `</think>`
/// (the tiny model never writes it, so all of it here), the same text through each API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_gives_the_thought_that_chat_gives() {
    let dir = qwen3_with_template(R1_THINKING);
    let (_w, r, model) = serve(dir.path()).await;
    let msgs = json!([{"role": "user", "content": "Once upon a time"}]);
    let whole = post_ok(
        &r.http,
        "/v1/chat/completions",
        json!({"model": model, "messages": msgs, "max_tokens": 12, "temperature": 0}),
    )
    .await;
    let m = &whole["choices"][0]["message"];
    let thought = m["reasoning_content"]
        .as_str()
        .expect("reasoning")
        .to_string();
    assert!(!thought.is_empty());
    assert_eq!(m["content"], "");

    let body = json!({"model": model, "input": msgs, "max_output_tokens": 12, "temperature": 0,
                      "reasoning": {"effort": "high", "summary": "auto"}});
    let v = post_ok(&r.http, "/v1/responses", body.clone()).await;
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{v}");
    assert_eq!(out[0]["type"], "reasoning");
    assert_eq!(out[0]["content"][0]["text"], thought.as_str());
    assert_eq!(
        v["usage"]["output_tokens_details"]["reasoning_tokens"],
        v["usage"]["output_tokens"]
    );
    let events = streamed(&r.http, "/v1/responses", body).await;
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .map(|e| e["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, thought);
    assert!(events
        .iter()
        .any(|e| e["type"] == "response.reasoning_text.done" && e["text"] == thought.as_str()));

    let body = json!({"model": model, "messages": msgs, "max_tokens": 12, "temperature": 0,
                      "thinking": {"type": "enabled", "budget_tokens": 1024}});
    let v = post_ok(&r.http, "/v1/messages", body.clone()).await;
    assert_eq!(
        v["content"],
        json!([{"type": "thinking", "thinking": thought, "signature": ""}])
    );
    let events = streamed(&r.http, "/v1/messages", body).await;
    let deltas: String = events
        .iter()
        .filter(|e| e["delta"]["type"] == "thinking_delta")
        .map(|e| e["delta"]["thinking"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, thought);
}
