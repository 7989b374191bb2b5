//! Tool calls in each family's own format, through the engine: the tiny Qwen3 of the families
//! tests served with a chat template that renders `tools` (a copy of its directory with that
//! template), one router per `--tool-call-parser` in front of one worker, the output forced by
//! a regular expression into that family's format with `tool_choice: auto`. Each router gives
//! the call (its name, and the arguments the raw output holds) through chat, whole and
//! streamed (the Responses and Messages APIs parse with the same parser, and take no regular
//! expression to force the format).

use crate::common;

use common::*;
use serde_json::{json, Value};

/// ChatML with the tools listed in a system turn, as a template that renders `tools` does.
const TOOLS_TEMPLATE: &str = "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_family_s_call_format_is_parsed_into_tool_calls() {
    let dir = qwen3_with_template(TOOLS_TEMPLATE);
    let (_w, addr, _) = Launch::decode().model(dir.path()).spawn_decode();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let msgs = json!([{"role": "user", "content": "Once upon a time"}]);
    let city = "[a-z]{3,8}";
    for (parser, regex) in [
        (
            "hermes",
            format!(
                r#"<tool_call>\n\{{"name": "get_weather", "arguments": \{{"city": "{city}"\}}\}}\n</tool_call>"#
            ),
        ),
        (
            "mistral",
            format!(
                r#"\[TOOL_CALLS\]\[\{{"name": "get_weather", "arguments": \{{"city": "{city}"\}}\}}\]"#
            ),
        ),
        (
            "llama3_json",
            format!(r#"\{{"name": "get_weather", "parameters": \{{"city": "{city}"\}}\}}"#),
        ),
    ] {
        let r = Launch::router(std::slice::from_ref(&addr))
            .model(dir.path())
            .args(&[&format!("--tool-call-parser={parser}")])
            .spawn_router();
        wait_ready(&r, 1).await;
        let model = models(&r.http).await["data"][0]["id"]
            .as_str()
            .unwrap()
            .to_string();
        // The raw output: the prompt (tools rendered) completed under the same expression.
        let tok = post_ok(
            &r.http,
            "/tokenize",
            json!({"model": model, "messages": msgs, "tools": tools}),
        )
        .await;
        let raw = post_ok(
            &r.http,
            "/v1/completions",
            json!({"model": model, "prompt": tok["tokens"], "max_tokens": 64,
                   "temperature": 0, "guided_regex": regex}),
        )
        .await;
        let raw = raw["choices"][0]["text"].as_str().unwrap().to_string();
        let at = raw.find("\"city\": \"").expect("the city") + 9;
        let said = &raw[at..at + raw[at..].find('"').unwrap()];
        let args = json!({"city": said});

        let chat = json!({"model": model, "messages": msgs, "tools": tools,
                          "tool_choice": "auto", "max_tokens": 64, "temperature": 0,
                          "guided_regex": regex});
        let v = post_ok(&r.http, "/v1/chat/completions", chat.clone()).await;
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{parser}: {raw:?} {v}");
        let call = &c["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather", "{parser}");
        let got: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(got, args, "{parser}: {raw:?}");
        assert_eq!(
            c["message"]["content"],
            Value::Null,
            "{parser}: no text beside the call"
        );

        let mut s = chat;
        s["stream"] = json!(true);
        let body = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", r.http))
            .json(&s)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let calls: Vec<Value> = sse_events(&body)
            .iter()
            .filter(|e| e.as_str() != "[DONE]")
            .map(|e| serde_json::from_str::<Value>(e).unwrap())
            .flat_map(|e| {
                e["choices"][0]["delta"]["tool_calls"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .collect();
        assert_eq!(calls.len(), 1, "{parser}: {body}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let got: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(got, args, "{parser} streamed");
    }
}
