//! End to end: real `tandem router` and `tandem decode` processes on loopback, driven through
//! the OpenAI Python client, a gRPC client and raw HTTP.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tandem_proto::v1 as api;

/// grpc.health.v1 says SERVING and reflection lists the services (what grpcurl relies on).
async fn grpc_health_and_reflection(r: &Router) {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::{
        server_reflection_request, server_reflection_response, ServerReflectionRequest,
    };
    let channel = tonic::transport::Endpoint::from_shared(r.grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut h = HealthClient::new(channel.clone());
    let st = h
        .check(tonic_health::pb::HealthCheckRequest {
            service: "tandem.v1.Generation".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        st.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let mut refl = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut resp = refl
        .server_reflection_info(futures::stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        msg.message_response
    else {
        panic!("unexpected reflection answer {msg:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in ["tandem.v1.Generation", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == want), "{names:?}");
    }
}

/// A stop string that spans tokens (" Paris." then "\n", "\n", "The") ends the text before it,
/// streamed or not, with finish_reason "stop".
async fn stop_strings(r: &Router, model: &str) {
    for stream in [false, true] {
        let body = json!({"model": model, "prompt": "The capital of France is", "max_tokens": 20,
                          "temperature": 0, "stop": ["\n\nThe", "never"], "stream": stream});
        let resp = reqwest::Client::new()
            .post(format!("{}/v1/completions", r.http))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let (text, finish) = if stream {
            let (t, f, _) = read_stream(&resp.text().await.unwrap());
            (t, f)
        } else {
            let v: Value = resp.json().await.unwrap();
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string),
            )
        };
        assert_eq!(text, " Paris.", "stream={stream}");
        assert_eq!(finish.as_deref(), Some("stop"));
    }
}

async fn grpc_client(r: &Router, model: &str, tok: &tandem_model::Tokenizer) {
    use api::generation_client::GenerationClient;
    let mut c = GenerationClient::connect(r.grpc.clone()).await.unwrap();
    let models = c
        .list_models(api::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models[0].id, model);
    let recs = golden();
    let mut calls = Vec::new();
    for g in &recs {
        let prompt = match g["chat"].as_array() {
            Some(chat) => api::generate_request::Prompt::Chat(api::ChatMessages {
                messages: chat
                    .iter()
                    .map(|m| api::ChatMessage {
                        role: m["role"].as_str().unwrap().into(),
                        content: m["content"].as_str().unwrap().into(),
                    })
                    .collect(),
            }),
            None => api::generate_request::Prompt::Text(g["prompt"].as_str().unwrap().into()),
        };
        // Tokenize agrees with the golden prompt ids.
        let tp = match &prompt {
            api::generate_request::Prompt::Chat(m) => {
                api::tokenize_request::Prompt::Chat(m.clone())
            }
            api::generate_request::Prompt::Text(t) => {
                api::tokenize_request::Prompt::Text(t.clone())
            }
            _ => unreachable!(),
        };
        let ids = c
            .tokenize(api::TokenizeRequest {
                model: String::new(),
                prompt: Some(tp),
            })
            .await
            .unwrap()
            .into_inner()
            .token_ids;
        let want_prompt: Vec<u32> = serde_json::from_value(g["prompt_ids"].clone()).unwrap();
        assert_eq!(ids, want_prompt, "{}", g["id"]);
        for ignore_eos in [true, false] {
            let req = api::GenerateRequest {
                model: model.into(),
                prompt: Some(prompt.clone()),
                sampling: Some(api::SamplingParams {
                    temperature: Some(0.0),
                    logprobs: true,
                    ..Default::default()
                }),
                stopping: Some(api::StoppingCriteria {
                    max_tokens: g["n_new"].as_u64().map(|n| n as u32),
                    ignore_eos,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let mut c = c.clone();
            calls.push(async move {
                let mut s = c.generate(req).await.unwrap().into_inner();
                let mut text = String::new();
                let mut ids = Vec::new();
                let mut last = None;
                while let Some(m) = s.message().await.unwrap() {
                    text += &m.text;
                    assert_eq!(m.logprobs.len(), m.token_ids.len());
                    ids.extend(m.token_ids);
                    if m.finish_reason != 0 {
                        last = Some((m.finish_reason, m.usage.unwrap()));
                    }
                }
                (ignore_eos, text, ids, last.expect("a final message"))
            });
        }
    }
    let results = futures::future::join_all(calls).await;
    for (g, pair) in recs.iter().zip(results.chunks(2)) {
        let e = expected(tok, g);
        let golden_ids: Vec<u32> = serde_json::from_value(g["generated_ids"].clone()).unwrap();
        for (ignore_eos, text, ids, (finish, usage)) in pair {
            if *ignore_eos {
                assert_eq!(ids, &golden_ids, "{} token ids", g["id"]);
                assert_eq!(text, &e.text_ignore_eos, "{}", g["id"]);
                assert_eq!(*finish, api::FinishReason::Length as i32);
            } else {
                assert_eq!(ids, &golden_ids[..e.tokens_eos], "{}", g["id"]);
                assert_eq!(text, &e.text_eos, "{}", g["id"]);
                let want = if e.finish_eos == "stop" {
                    api::FinishReason::Stop
                } else {
                    api::FinishReason::Length
                };
                assert_eq!(*finish, want as i32, "{}", g["id"]);
            }
            assert_eq!(usage.completion_tokens as usize, ids.len());
            assert_eq!(usage.prompt_tokens, g["n_prompt"].as_u64().unwrap() as u32);
        }
    }
}

/// A request to `path` (chat or completions) with `field` set to `value` is a 400 naming the
/// field; returns its message.
async fn refused(r: &Router, model: &str, path: &str, field: &str, value: Value) -> String {
    let mut body = if path.ends_with("chat/completions") {
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    } else {
        json!({"model": model, "prompt": "hi"})
    };
    body[field] = value;
    let (s, v) = post(&r.http, path, body.clone()).await;
    assert_eq!(s, 400, "{body} -> {v}");
    assert_eq!(v["error"]["param"], field, "{body} -> {v}");
    v["error"]["message"].as_str().unwrap().to_string()
}

async fn bad_input(r: &Router, model: &str) {
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        (
            chat,
            json!({"model": model, "messages": msgs, "temperature": -1}),
            400,
            "invalid_value",
        ),
        (
            chat,
            json!({"model": model, "messages": msgs, "top_p": 0}),
            400,
            "invalid_value",
        ),
        (
            chat,
            json!({"model": model, "messages": msgs, "presence_penalty": 3}),
            400,
            "invalid_value",
        ),
        (
            chat,
            json!({"model": model, "messages": msgs, "top_logprobs": 50, "logprobs": true}),
            400,
            "invalid_value",
        ),
        (
            chat,
            json!({"model": model, "messages": msgs, "max_tokens": 0}),
            400,
            "invalid_value",
        ),
        (
            chat,
            json!({"model": "gpt-17", "messages": msgs}),
            404,
            "model_not_found",
        ),
        (
            chat,
            json!({"model": model, "messages": []}),
            400,
            "invalid_value",
        ),
        (
            chat,
            json!({"model": model, "messages": msgs, "max_tokens": 100000}),
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": "word ".repeat(9000)}),
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": [1, 2, 99999999]}),
            400,
            "invalid_value",
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": "hi", "n": 0}),
            400,
            "invalid_value",
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": "hi", "n": 129}),
            400,
            "invalid_value",
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": "hi", "n": 3, "best_of": 2}),
            400,
            "invalid_value",
        ),
        (
            "/v1/completions",
            json!({"model": model}),
            400,
            "invalid_value",
        ),
    ];
    // What is not served yet is refused naming the field, never ignored.
    for (path, field, value) in [
        ("/v1/completions", "best_of", json!(3)),
        ("/v1/completions", "suffix", json!("end")),
        (chat, "functions", json!([{"name": "f", "parameters": {}}])),
        (chat, "function_call", json!("auto")),
    ] {
        let m = refused(r, model, path, field, value).await;
        assert!(m.contains("not supported"), "{field}: {m}");
    }
    // A field the endpoint does not know is refused naming it, as OpenAI refuses one; those that
    // change nothing here (who calls, tags, the tier, not storing, text out) are taken.
    // A reasoning effort on a model that does not reason: refused naming it.
    let m = refused(r, model, chat, "reasoning_effort", json!("high")).await;
    assert!(
        m.contains("reasoning_effort") && m.contains("does not reason"),
        "{m}"
    );
    for (path, field, value) in [
        (chat, "store", json!(true)),
        (chat, "modalities", json!(["text", "audio"])),
        ("/v1/completions", "min_tokens", json!(5)),
        ("/v1/completions", "max_completion_tokens", json!(5)),
    ] {
        let mut body = if path == chat {
            json!({"model": model, "messages": msgs, "max_tokens": 1})
        } else {
            json!({"model": model, "prompt": "hi", "max_tokens": 1})
        };
        body[field] = value;
        let (s, v) = post(&r.http, path, body.clone()).await;
        assert_eq!(s, 400, "{body} -> {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(
            m.contains(&format!("unrecognized request argument supplied: {field}")),
            "{m}"
        );
    }
    let taken = json!({"model": model, "messages": msgs, "max_tokens": 1, "user": "u",
        "safety_identifier": "s", "metadata": {"k": "v"}, "service_tier": "auto",
        "prompt_cache_key": "p", "store": false, "modalities": ["text"]});
    let (s, v) = post(&r.http, chat, taken).await;
    assert_eq!(s, 200, "{v}");
    // Structured outputs and logit_bias that cannot be served are refused naming the field and
    // the problem.
    for (path, field, value, says) in [
        (
            "/v1/completions",
            "logit_bias",
            json!({"1": 101}),
            "[-100, 100]",
        ),
        (
            "/v1/completions",
            "logit_bias",
            json!({"one": 1}),
            "token ids",
        ),
        (
            "/v1/completions",
            "logit_bias",
            json!({"1": "up"}),
            "numbers",
        ),
        (
            "/v1/completions",
            "logit_bias",
            json!({"99999999": 1}),
            "vocabulary",
        ),
        (
            "/v1/completions",
            "guided_regex",
            json!("[a-"),
            "guided_regex",
        ),
        ("/v1/completions", "guided_choice", json!([]), "empty"),
        (
            "/v1/completions",
            "guided_grammar",
            json!("start: nothere"),
            "nothere",
        ),
        (
            chat,
            "response_format",
            json!({"type": "json_schema"}),
            "schema",
        ),
        (chat, "response_format", json!({"type": "xml"}), "xml"),
        (
            chat,
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": {"not": {}}}}),
            "not",
        ),
        (chat, "tool_choice", json!("required"), "needs tools"),
        (
            chat,
            "tools",
            json!([{"type": "function", "function": {"name": "no spaces"}}]),
            "no spaces",
        ),
        (chat, "tool_choice", json!("sometimes"), "sometimes"),
    ] {
        let m = refused(r, model, path, field, value).await;
        assert!(m.contains(says), "{field}: {m}");
    }
    let (s, v) = post(
        &r.http,
        "/v1/completions",
        json!({"model": model, "prompt": "hi", "guided_regex": "a+",
               "guided_choice": ["a", "b"]}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not several"));
    // Their neutral values pass.
    let (s, v) = post(
        &r.http,
        chat,
        json!({"model": model, "messages": msgs, "max_tokens": 1, "best_of": 1,
               "logit_bias": {}, "response_format": {"type": "text"}, "tools": [],
               "tool_choice": "none"}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    for (path, body, status, code) in cases {
        let (s, v) = post(&r.http, path, body.clone()).await;
        assert_eq!(s, status, "{body} -> {v}");
        assert_eq!(v["error"]["code"], code, "{body} -> {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
        assert!(v["error"]["type"].is_string());
    }
    // Malformed JSON.
    let resp = reqwest::Client::new()
        .post(format!("{}{chat}", r.http))
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // Still serving.
    let (s, v) = post(
        &r.http,
        "/v1/completions",
        json!({"model": model, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], " Paris.\n");
}

/// vLLM's /tokenize and /detokenize: the model's tokenizer and chat template, the counts a
/// generation reports, and a round trip.
async fn tokenize_detokenize(r: &Router, model: &str, tok: &tandem_model::Tokenizer) {
    let text = "The capital of France is";
    let (s, v) = post(
        &r.http,
        "/tokenize",
        json!({"model": model, "prompt": text}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let want = tok.encode(text, true).unwrap();
    let got: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(got, want);
    assert_eq!(v["count"], want.len());
    let models = models(&r.http).await;
    assert_eq!(v["max_model_len"], models["data"][0]["max_model_len"]);
    let (_, v) = post(
        &r.http,
        "/detokenize",
        json!({"model": model, "tokens": want}),
    )
    .await;
    assert!(v["prompt"].as_str().unwrap().ends_with(text), "{v}");

    // Messages: as many tokens as a chat completion's prompt.
    let msgs = json!([{"role": "user", "content": "What is 2 + 2?"}]);
    let (s, v) = post(
        &r.http,
        "/tokenize",
        json!({"model": model, "messages": msgs}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (_, done) = post(
        &r.http,
        "/v1/chat/completions",
        json!({"model": model, "messages": msgs, "max_tokens": 1, "temperature": 0}),
    )
    .await;
    assert_eq!(v["count"], done["usage"]["prompt_tokens"], "{v} {done}");
    let (_, open) = post(
        &r.http,
        "/tokenize",
        json!({"model": model, "messages": msgs, "add_generation_prompt": false}),
    )
    .await;
    assert!(open["count"].as_u64() < v["count"].as_u64(), "{open} {v}");
    // With tools: what a chat request with them sends, whether the template renders tools or
    // they are described in a system message.
    let tools = json!([{"type": "function", "function": {"name": "add", "description": "Adds two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]);
    let (s, with) = post(
        &r.http,
        "/tokenize",
        json!({"model": model, "messages": msgs, "tools": tools}),
    )
    .await;
    assert_eq!(s, 200, "{with}");
    let (_, done) = post(
        &r.http,
        "/v1/chat/completions",
        json!({"model": model, "messages": msgs, "tools": tools, "max_tokens": 1, "temperature": 0}),
    )
    .await;
    assert_eq!(
        with["count"], done["usage"]["prompt_tokens"],
        "{with} {done}"
    );
    assert!(with["count"].as_u64() > v["count"].as_u64(), "{with} {v}");
    let (s, e) = post(
        &r.http,
        "/tokenize",
        json!({"model": model, "prompt": "x", "tools": tools}),
    )
    .await;
    assert_eq!((s, &e["error"]["param"]), (400, &json!("tools")), "{e}");

    for (path, body, param) in [
        ("/tokenize", json!({"model": model}), "prompt"),
        (
            "/detokenize",
            json!({"model": model, "tokens": [1, 99999999]}),
            "tokens",
        ),
    ] {
        let (s, v) = post(&r.http, path, body.clone()).await;
        assert_eq!(s, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    let (s, v) = post(
        &r.http,
        "/tokenize",
        json!({"model": "gpt-17", "prompt": "x"}),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    // As OpenAI refuses them: stream_options without stream, a tool message without the id
    // of the call it answers.
    let chat = "/v1/chat/completions";
    let m = refused(
        r,
        model,
        chat,
        "stream_options",
        json!({"include_usage": true}),
    )
    .await;
    assert!(m.contains("only allowed when stream is true"), "{m}");
    let body = json!({"model": model, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "tool", "content": "42"},
    ]});
    let (s, v) = post(&r.http, chat, body).await;
    assert_eq!(
        (s, v["error"]["param"].as_str()),
        (400, Some("messages")),
        "{v}"
    );
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("messages[1].tool_call_id"), "{m}");
    request_ids(r, model).await;
}

/// Every response carries an `x-request-id`: a new `req_` id each time, or the client's own,
/// given back as it came (an answer, a refusal, a route that does not exist alike).
async fn request_ids(r: &Router, model: &str) {
    let c = reqwest::Client::new();
    let id_of = |resp: &reqwest::Response| {
        resp.headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    let mut seen = std::collections::HashSet::new();
    for path in ["/v1/models", "/v1/nothing-here", "/health"] {
        let resp = c.get(format!("{}{path}", r.http)).send().await.unwrap();
        let id = id_of(&resp);
        assert!(id.starts_with("req_") && id.len() == 36, "{path}: {id:?}");
        assert!(seen.insert(id), "ids are new each time");
    }
    let body = json!({"model": model, "prompt": "hi", "max_tokens": 2});
    for (status, body) in [
        (200, body),
        (404, json!({"model": "gpt-17", "prompt": "hi"})),
    ] {
        let resp = c
            .post(format!("{}/v1/completions", r.http))
            .header("x-request-id", "trace-abc.123")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status);
        assert_eq!(id_of(&resp), "trace-abc.123");
    }
}

/// A completion with several prompts: one choice per prompt, in order, each what the prompt
/// alone gives, usage summed; streamed too, with one [DONE] after every choice has finished.
async fn batched_prompts(r: &Router, model: &str, tok: &tandem_model::Tokenizer) {
    let prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"];
    let mut alone = Vec::new();
    let mut usage = (0, 0);
    for p in prompts {
        let (s, v) = post(
            &r.http,
            "/v1/completions",
            json!({"model": model, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        alone.push(v["choices"][0]["text"].as_str().unwrap().to_string());
        usage.0 += v["usage"]["prompt_tokens"].as_u64().unwrap();
        usage.1 += v["usage"]["completion_tokens"].as_u64().unwrap();
    }
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| tok.encode(p, true).unwrap())
        .collect();
    for prompt in [json!(prompts), json!(ids)] {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                          "ignore_eos": true});
        let (s, v) = post(&r.http, "/v1/completions", body.clone()).await;
        assert_eq!(s, 200, "{v}");
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), prompts.len(), "{v}");
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
            assert_eq!(c["text"], alone[i], "prompt {i}");
        }
        assert_eq!(v["usage"]["prompt_tokens"], usage.0);
        assert_eq!(v["usage"]["completion_tokens"], usage.1);

        // Streamed, with echo: each choice's text comes under its index.
        let mut body = body;
        body["stream"] = json!(true);
        body["echo"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let text = reqwest::Client::new()
            .post(format!("{}/v1/completions", r.http))
            .json(&body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let events = sse_events(&text);
        assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let mut texts = vec![String::new(); prompts.len()];
        let mut finished = 0;
        let mut streamed_usage = Value::Null;
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e).unwrap();
            if !v["usage"].is_null() {
                streamed_usage = v["usage"].clone();
            }
            for c in v["choices"].as_array().unwrap() {
                let i = c["index"].as_u64().unwrap() as usize;
                texts[i] += c["text"].as_str().unwrap();
                finished += usize::from(c["finish_reason"].is_string());
            }
        }
        assert_eq!(finished, prompts.len());
        for i in 0..prompts.len() {
            assert_eq!(
                texts[i],
                format!("{}{}", tok.decode(&ids[i], false).unwrap(), alone[i])
            );
        }
        assert_eq!(streamed_usage["completion_tokens"], usage.1);
    }
    let (s, v) = post(
        &r.http,
        "/v1/completions",
        json!({"model": model, "prompt": vec!["x"; 257]}),
    )
    .await;
    assert_eq!(
        (s, v["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{v}"
    );
}

/// `n` = 4 with a seed: four different samples of one prompt, computed once, its blocks held
/// once in the pool while the four decode; the same request again gives the same four, and
/// sample 0 is what `n` = 1 gives.
async fn parallel_samples(r: &Router, worker: &str, model: &str, tok: &tandem_model::Tokenizer) {
    use futures::StreamExt;
    let idle = wait_idle(worker).await;
    use tandem_proto::worker as wpb;
    let mut info =
        wpb::worker_control_client::WorkerControlClient::connect(format!("http://{worker}"))
            .await
            .unwrap();
    let bs = info
        .info(authed(wpb::InfoRequest {}))
        .await
        .unwrap()
        .into_inner()
        .block_size as usize;
    // Long (a few hundred tokens, many blocks) and open-ended, so samples part ways.
    let topics = [
        "the sea",
        "a mountain village",
        "an old clock",
        "the first snow",
        "a lost letter",
        "the night market",
        "a quiet library",
        "the summer storm",
        "a red bicycle",
        "the harbour lights",
    ];
    let mut prompt: String = topics
        .iter()
        .chain(&topics)
        .enumerate()
        .map(|(i, t)| {
            format!(
                "Note {i}: I once wrote about {t}, and it reminded me of something else entirely. "
            )
        })
        .collect();
    prompt += "Now, a new story begins:";
    let p = tok.encode(&prompt, true).unwrap().len();
    const MAX: usize = 32;
    let body = json!({"model": model, "prompt": prompt, "n": 4, "max_tokens": MAX,
                      "temperature": 1.0, "seed": 11, "ignore_eos": true});
    let (s, whole) = post(&r.http, "/v1/completions", body.clone()).await;
    assert_eq!(s, 200, "{whole}");
    let texts: Vec<&str> = whole["choices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i);
            assert_eq!(c["finish_reason"], "length");
            c["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(texts.len(), 4);
    let mut distinct = texts.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "four different samples: {texts:?}");
    assert_eq!(
        whole["usage"]["prompt_tokens"], p,
        "the prompt counted once"
    );
    assert_eq!(whole["usage"]["completion_tokens"], 4 * MAX);
    let mut one = body.clone();
    one["n"] = json!(1);
    let (_, v) = post(&r.http, "/v1/completions", one).await;
    assert_eq!(v["choices"][0]["text"], texts[0], "sample 0 is n = 1's");

    // Streamed: once every sample has tokens, the pool holds the prompt's full blocks once and
    // a few blocks of each sample's own (not four copies of the prompt). A client that the
    // machine's load holds back can ask the worker only after it is done with all 32 tokens
    // (once in a CI run on 2 cores): then the request is sent again (the same seed, the same
    // samples), five times at most, until the worker is asked while it still decodes. (The
    // engine's own test, `parallel_samples_share_the_prompt_and_each_reads_its_own_history`,
    // checks the same step by step.)
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let full = (p / bs) as u32;
    let own = (p % bs + MAX).div_ceil(bs) as u32;
    let mut observed = None;
    for _ in 0..5 {
        let resp = reqwest::Client::new()
            .post(format!("{}/v1/completions", r.http))
            .json(&streamed)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let mut chunks = resp.bytes_stream();
        let mut seen = String::new();
        let started = |seen: &str| {
            let mut idx = std::collections::BTreeSet::new();
            for e in sse_events(seen) {
                if let Ok(v) = serde_json::from_str::<Value>(&e) {
                    for c in v["choices"].as_array().into_iter().flatten() {
                        idx.insert(c["index"].as_u64().unwrap());
                    }
                }
            }
            idx.len()
        };
        while started(&seen) < 4 {
            seen += &String::from_utf8_lossy(&chunks.next().await.unwrap().unwrap());
        }
        let busy = worker_load(worker).await;
        while let Some(c) = chunks.next().await {
            seen += &String::from_utf8_lossy(&c.unwrap());
        }
        let mut texts_streamed = vec![String::new(); 4];
        for e in sse_events(&seen).iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            for c in v["choices"].as_array().unwrap() {
                texts_streamed[c["index"].as_u64().unwrap() as usize] +=
                    c["text"].as_str().unwrap();
            }
        }
        assert_eq!(
            texts_streamed, texts,
            "the same seed, the same four samples"
        );
        if busy.running > 0 {
            observed = Some(busy);
            break;
        }
        wait_idle(worker).await;
    }
    let busy = observed.expect("the worker was asked while the streamed samples decoded");
    assert!(
        busy.blocks_used >= full && busy.blocks_used <= full + 4 * own,
        "{busy:?}: {full} shared blocks and at most {own} of each sample's own"
    );
    let after = wait_idle(worker).await;
    assert_eq!(after.blocks_used, idle.blocks_used);

    // A stop string cuts one sample at its start while the others run on: the worker is told to
    // stop that one, so it does not go on to max_tokens there. Every sample's whole text is
    // known first (the same seed), and the stop string is the shortest start of one sample's
    // text that no other sample's contains.
    const LONG: usize = 160;
    let mut long = body.clone();
    long["max_tokens"] = json!(LONG);
    let (s, v) = post(&r.http, "/v1/completions", long.clone()).await;
    assert_eq!(s, 200, "{v}");
    let whole: Vec<String> = (0..4)
        .map(|i| v["choices"][i]["text"].as_str().unwrap().to_string())
        .collect();
    let (cut, stop) = (0..4)
        .find_map(|j| {
            let t = &whole[j];
            (1..=t.len())
                .filter(|&k| t.is_char_boundary(k))
                .map(|k| &t[..k])
                .find(|s| (0..4).all(|i| i == j || !whole[i].contains(s)))
                .map(|s| (j, s.to_string()))
        })
        .unwrap_or_else(|| panic!("no sample starts with text of its own: {whole:?}"));
    let before = scrape(worker).await;
    long["stop"] = json!([stop]);
    let (s, v) = post(&r.http, "/v1/completions", long).await;
    assert_eq!(s, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let i = c["index"].as_u64().unwrap() as usize;
        if i == cut {
            assert_eq!(c["finish_reason"], "stop", "{v}");
            assert_eq!(c["text"], "", "cut at its start ({stop:?})");
        } else {
            assert_eq!(c["finish_reason"], "length", "sample {i}: {v}");
            assert_eq!(c["text"], whole[i], "sample {i} goes on as before");
        }
    }
    wait_idle(worker).await;
    let after = scrape(worker).await;
    let grew = |key: &str| metric(&after, key) - metric(&before, key);
    assert_eq!(
        grew(r#"tandem_request_success_total{finished_reason="stop"}"#),
        1.0,
        "the cut sample ends on the worker as stopped"
    );
    assert_eq!(
        grew(r#"tandem_request_success_total{finished_reason="length"}"#),
        3.0
    );
    let generated = grew("tandem_generation_tokens_total");
    assert!(
        generated < (4 * LONG) as f64,
        "the cut sample stopped early on the worker: {generated} tokens generated"
    );
}

async fn cancel_mid_stream(r: &Router, worker: &str, model: &str) {
    use futures::StreamExt;
    let idle = wait_idle(worker).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", r.http))
        .json(
            &json!({"model": model, "prompt": "Once upon a time", "max_tokens": 2000,
                      "temperature": 0, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    while sse_events(&seen).len() < 4 {
        seen += &String::from_utf8_lossy(&body.next().await.unwrap().unwrap());
    }
    let busy = worker_load(worker).await;
    assert_eq!(busy.running, 1, "{busy:?}");
    assert!(busy.blocks_used > 0, "{busy:?}");
    drop(body);
    let after = wait_idle(worker).await;
    assert_eq!(after.blocks_used, idle.blocks_used);
    assert_eq!(after.blocks_free + after.blocks_cached, after.blocks_total);
}

async fn concurrent_streams(r: &Router, model: &str) {
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Write a short note number {i} about the sea and the"))
        .collect();
    let body = |p: &str, stream: bool| {
        let mut b = json!({"model": model, "prompt": p, "max_tokens": 24, "temperature": 0,
               "ignore_eos": true, "stream": stream});
        // (Only with stream, as OpenAI takes it.)
        if stream {
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    };
    let mut want = Vec::new();
    for p in &prompts {
        let (s, v) = post(&r.http, "/v1/completions", body(p, false)).await;
        assert_eq!(s, 200);
        want.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let client = reqwest::Client::new();
    let calls = (0..64).map(|i| {
        let client = client.clone();
        let b = body(&prompts[i % 8], true);
        let url = format!("{}/v1/completions", r.http);
        async move {
            let resp = client.post(url).json(&b).send().await.unwrap();
            assert_eq!(resp.status().as_u16(), 200);
            (i, resp.text().await.unwrap())
        }
    });
    for (i, body) in futures::future::join_all(calls).await {
        let (text, finish, usage) = read_stream(&body);
        assert_eq!(text, want[i % 8], "stream {i}");
        assert_eq!(finish.as_deref(), Some("length"));
        assert_eq!(usage.unwrap()["completion_tokens"], 24);
    }
}

/// One decode worker with a router in front of it, shared by the scenarios below: started once,
/// by the first of them that runs (a cluster's start is most of such a test's time). Each
/// scenario is a test of its own, so each runs and fails by name.
struct OneWorker {
    router: Router,
    /// The decode worker's gRPC address.
    worker: String,
    /// The served model's name.
    model: String,
    _worker: Proc,
}

static ONE_WORKER: tokio::sync::OnceCell<OneWorker> = tokio::sync::OnceCell::const_new();
/// The scenarios take turns on the cluster: several read the worker's load and need it to
/// themselves. (A tokio mutex: a scenario that fails does not poison the others' turns.)
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The shared cluster, ready and idle, and this scenario's turn on it; the scenario ends with
/// [`OneWorker::done`].
async fn one_worker() -> (tokio::sync::MutexGuard<'static, ()>, &'static OneWorker) {
    let turn = TURN.lock().await;
    let c = ONE_WORKER
        .get_or_init(|| async {
            // Started from a thread that lives as long as the test binary: the processes die
            // with the thread that started them (PR_SET_PDEATHSIG), and a test's thread ends
            // with its test.
            let (tx, rx) = tokio::sync::oneshot::channel();
            std::thread::spawn(move || {
                let (proc, worker) = start_worker(&[]);
                let router = start_router(std::slice::from_ref(&worker), &[]);
                let _ = tx.send((proc, worker, router));
                loop {
                    std::thread::park();
                }
            });
            let (proc, worker, router) = rx.await.expect("the shared cluster started");
            wait_ready(&router, 1).await;
            let model = models(&router.http).await["data"][0]["id"]
                .as_str()
                .unwrap()
                .to_string();
            OneWorker {
                router,
                worker,
                model,
                _worker: proc,
            }
        })
        .await;
    // Idle whatever the scenario before did (one that failed did not reach its `done`).
    wait_idle(&c.worker).await;
    (turn, c)
}

impl OneWorker {
    /// The model's tokenizer.
    fn tokenizer(&self) -> tandem_model::Tokenizer {
        tandem_model::load_text(&model_path()).unwrap().tokenizer
    }

    /// After a scenario: the worker holds nothing (no request, no referenced block).
    async fn done(&self) {
        wait_idle(&self.worker).await;
    }
}

/// The official OpenAI Python client: every golden case, four ways, exact text, finish reason
/// and usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_gets_the_golden_text() {
    let (_turn, c) = one_worker().await;
    let url = format!("{}/v1", c.router.http);
    openai_python_client(&url, &c.model, &c.tokenizer(), &[]).await;
    c.done().await;
}

/// Anthropic's Messages API through the official Anthropic Python client: text equal to the
/// chat endpoint's, streamed and whole, stop sequences, tool_use round trips, count_tokens and
/// errors in Anthropic's shapes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_python_client_speaks_the_messages_api() {
    let (_turn, c) = one_worker().await;
    assert!(anthropic_python_client(&c.router.http, &c.model, &[]).await >= 16);
    c.done().await;
}

/// The Responses API through the official OpenAI client (create, stream, a function-call round
/// trip, a `previous_response_id` chain, structured output, retrieve, input items, delete,
/// background and cancel, input tokens, errors) and through an agent of the OpenAI Agents SDK
/// with a function tool on its default Responses model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_and_the_agents_sdk_speak_the_responses_api() {
    let (_turn, c) = one_worker().await;
    assert!(responses_python_client(&c.router.http, &c.model, &[]).await >= 28);
    c.done().await;
}

/// Structured outputs through the OpenAI Python client, each answer valid for its schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_through_the_python_client_follow_their_schemas() {
    let (_turn, c) = one_worker().await;
    let url = format!("{}/v1", c.router.http);
    assert!(structured_python_client(&url, &c.model, false).await >= 20);
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_api_gives_the_golden_tokens() {
    let (_turn, c) = one_worker().await;
    grpc_client(&c.router, &c.model, &c.tokenizer()).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_says_serving_and_reflection_lists_the_services() {
    let (_turn, c) = one_worker().await;
    grpc_health_and_reflection(&c.router).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_across_tokens_ends_the_text_before_it() {
    let (_turn, c) = one_worker().await;
    stop_strings(&c.router, &c.model).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_error_and_the_worker_stays_whole() {
    let (_turn, c) = one_worker().await;
    bad_input(&c.router, &c.model).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_agree_with_the_model() {
    let (_turn, c) = one_worker().await;
    tokenize_detokenize(&c.router, &c.model, &c.tokenizer()).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_prompts_each_get_what_they_get_alone() {
    let (_turn, c) = one_worker().await;
    batched_prompts(&c.router, &c.model, &c.tokenizer()).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_parallel_samples_are_computed_once_and_repeat() {
    let (_turn, c) = one_worker().await;
    parallel_samples(&c.router, &c.worker, &c.model, &c.tokenizer()).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_dropped_mid_way_frees_its_blocks() {
    let (_turn, c) = one_worker().await;
    cancel_mid_stream(&c.router, &c.worker, &c.model).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_each_get_their_own_text() {
    let (_turn, c) = one_worker().await;
    concurrent_streams(&c.router, &c.model).await;
    c.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_follows_prefixes_and_spreads_the_rest() {
    let (_w0, a0) = start_worker(&["--threads=1"]);
    let (_w1, a1) = start_worker(&["--threads=1"]);
    let r = start_router(&[a0.clone(), a1.clone()], &["--policy=kv-aware"]);
    wait_ready(&r, 2).await;
    let shared = golden()
        .iter()
        .find(|g| g["id"] == "dev_long_history")
        .unwrap()["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    for i in 0..4 {
        let (s, v) = post(
            &r.http,
            "/v1/completions",
            json!({"prompt": format!("{shared} Question {i}:"), "max_tokens": 2, "temperature": 0}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        if i == 0 {
            // The worker's KV events reach the router's index: its ~49 prompt blocks.
            wait_router_cached(&r, 40).await;
        }
    }
    let (l0, l1) = (worker_load(&a0).await, worker_load(&a1).await);
    let (hot, cold) = if l0.prefix_lookup_tokens > 0 {
        (l0, l1)
    } else {
        (l1, l0)
    };
    assert_eq!(
        cold.prefix_lookup_tokens, 0,
        "all four went to one worker: {cold:?}"
    );
    // Requests 2-4 reuse at least 700 of the ~790 shared tokens each.
    assert!(hot.prefix_hit_tokens >= 3 * 700, "{hot:?}");

    let before = (worker_load(&a0).await, worker_load(&a1).await);
    let words = ["apple", "river", "mountain", "engine", "violin", "desert"];
    for w in words {
        let (s, v) = post(
            &r.http,
            "/v1/completions",
            json!({"prompt": format!("{} and then", format!("{w} ").repeat(60)), "max_tokens": 2, "temperature": 0}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
    }
    let after = (worker_load(&a0).await, worker_load(&a1).await);
    let got0 = after.0.prefix_lookup_tokens - before.0.prefix_lookup_tokens;
    let got1 = after.1.prefix_lookup_tokens - before.1.prefix_lookup_tokens;
    assert!(
        got0 > 0 && got1 > 0,
        "distinct prefixes spread: {got0} / {got1}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_limit_no_worker_and_graceful_drain() {
    use futures::StreamExt;
    // No worker reachable: 503, and /ready says so.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let lonely = start_router(&[dead], &[]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ready = reqwest::get(format!("{}/ready", lonely.http))
        .await
        .unwrap();
    assert_eq!(ready.status().as_u16(), 503);
    let (s, v) = post(
        &lonely.http,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "no_worker");
    drop(lonely);

    // Queue limit of one: a second request while the first streams gets 503 (overloaded).
    let (mut w, waddr) = start_worker(&["--drain-timeout-s=60"]);
    let r = start_router(std::slice::from_ref(&waddr), &["--max-queue=1"]);
    wait_ready(&r, 1).await;
    let long = json!({"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", r.http))
        .json(&long)
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    while sse_events(&seen).len() < 2 {
        seen += &String::from_utf8_lossy(&body.next().await.unwrap().unwrap());
    }
    let full = reqwest::Client::new()
        .post(format!("{}/v1/completions", r.http))
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(full.status().as_u16(), 503);
    assert_eq!(
        full.headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );
    let v: Value = full.json().await.unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    let refused = scrape(&r.http).await;
    assert_eq!(
        metric(
            &refused,
            r#"tandem_router_refused_requests_total{reason="queue_full"}"#
        ),
        1.0
    );

    // SIGTERM the worker mid-stream: the stream still completes, new work is refused, and the
    // worker exits cleanly once drained.
    w.signal(libc::SIGTERM);
    while let Some(chunk) = body.next().await {
        seen += &String::from_utf8_lossy(&chunk.unwrap());
    }
    let (text, finish, _) = read_stream(&seen);
    assert_eq!(finish.as_deref(), Some("length"), "{seen}");
    assert!(!text.is_empty());
    let status = w
        .wait_exit(Duration::from_secs(30))
        .expect("worker exits after draining");
    assert!(status.success(), "{status:?}");
    let (s, v) = post(
        &r.http,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 2}),
    )
    .await;
    assert!(s == 503 || s == 502, "{s} {v}");
    let _ = waddr;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_restarts_a_crashed_worker_and_stops_cleanly() {
    let args: Vec<String> = vec![
        "up".into(),
        format!("--model={}", model_path().display()),
        "--http-port=0".into(),
        "--grpc-port=0".into(),
        "--decode-workers=1".into(),
        "--prefill-workers=1".into(),
        "--disagg-min-tokens=1".into(),
        format!("--worker-arg=--kv-cache-mb={TEST_POOL_MB}"),
    ];
    let (mut up, line) = spawn(&args, Ready::UP);
    let http = format!("http://{}", up_http(&line));
    let before = children(up.pid());
    assert_eq!(
        before.len(),
        3,
        "a prefill worker, a decode worker and a router: {before:?}"
    );
    let ask = || async {
        post(
            &http,
            "/v1/completions",
            json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
        )
        .await
    };
    let (s, v) = ask().await;
    assert_eq!(
        (s, v["choices"][0]["text"].as_str()),
        (200, Some(" Paris.\n"))
    );

    // Every prompt is prefilled remotely here: the secret up made reached both workers.
    let m = scrape(&http).await;
    assert_eq!(
        metric(&m, r#"tandem_prefill_requests_total{mode="remote"}"#),
        1.0
    );

    // Kill -9 the decode worker (the second child started): up restarts it on the same port.
    let worker = before[1];
    // SAFETY: signalling a process this test started (through up).
    unsafe {
        libc::kill(worker, libc::SIGKILL);
    }
    let end = Instant::now() + Duration::from_secs(90);
    loop {
        let now = children(up.pid());
        if !now.contains(&worker) && now.len() == 3 {
            let (s, v) = ask().await;
            if s == 200 {
                assert_eq!(v["choices"][0]["text"], " Paris.\n");
                break;
            }
        }
        assert!(
            Instant::now() < end,
            "worker not restarted: children {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Ctrl-C while up waits to restart a crashed worker (its second crash within a minute: a
    // 2 s back-off) stops everything as well. The signal goes once the crashed worker is reaped
    // and before its successor starts; should this test be held up past the back-off, it
    // comes after the restart instead, the case above.
    let kids = children(up.pid());
    let worker = *kids
        .iter()
        .find(|k| !before.contains(k))
        .expect("the restarted worker");
    // SAFETY: as above.
    unsafe {
        libc::kill(worker, libc::SIGKILL);
    }
    let end = Instant::now() + Duration::from_secs(90);
    while children(up.pid()).contains(&worker) {
        assert!(Instant::now() < end, "the crashed worker was never reaped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let kids = children(up.pid());
    up.signal(libc::SIGINT);
    let status = up
        .wait_exit(Duration::from_secs(60))
        .expect("up exits on Ctrl-C");
    assert!(status.success(), "{status:?}");
    for k in kids {
        assert!(!alive(k), "child {k} outlived tandem up");
    }
}

/// `tandem up --autoscale`: a step in load makes the plan (on a fixed, slow profile, so the
/// shape depends on the offered load alone, not on this machine's speed) ask for a second
/// decode worker, which up starts and the router joins; under the trickle that follows it asks
/// for one, and up drains the second (it leaves the router's pool, finishes its requests, and
/// only then stops). Every request of both phases is answered in full and no KV block stays
/// held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_autoscale_adds_a_decode_worker_under_a_load_step_and_drains_it_under_a_trickle() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("slow.json");
    // 200 prompt tokens a second; 50 ms decode steps alone, 100 ms at 8 streams.
    let slow = json!({
        "kind": "slow", "cores": 1, "prefill_tokens_per_s": 200.0,
        "decode": [{"batch": 1, "step_ms": 50.0}, {"batch": 8, "step_ms": 100.0}],
        "max_batch": 8
    });
    std::fs::write(&profile, slow.to_string()).unwrap();
    let args: Vec<String> = vec![
        "up".into(),
        format!("--model={}", model_path().display()),
        "--http-port=0".into(),
        "--grpc-port=0".into(),
        "--decode-workers=1".into(),
        "--prefill-workers=0".into(),
        "--worker-threads=1".into(),
        "--autoscale".into(),
        "--max-decode-workers=2".into(),
        format!("--autoscale-profile={}", profile.display()),
        "--autoscale-interval-s=0.2".into(),
        "--autoscale-window-s=2".into(),
        "--scale-down-after-s=2".into(),
        format!("--worker-arg=--kv-cache-mb={TEST_POOL_MB}"),
    ];
    let (mut up, line) = spawn(&args, Ready::UP);
    let http = format!("http://{}", up_http(&line));
    let serving = |v: &Value| {
        v["workers"].as_array().map_or(0, |ws| {
            ws.iter()
                .filter(|w| w["ready"] == true && w["draining"] == false)
                .count()
        })
    };
    assert_eq!(serving(&router_state(&http).await), 1);
    assert_eq!(
        children(up.pid()).len(),
        2,
        "a router and one decode worker"
    );

    // Requests at `every` apart until `done` holds; then every answer.
    async fn load_until<F, Fut>(
        http: &str,
        every: Duration,
        first: usize,
        done: F,
    ) -> Vec<(u16, Value)>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let mut sent = Vec::new();
        let end = Instant::now() + Duration::from_secs(300);
        let mut i = first;
        while !done().await {
            assert!(
                Instant::now() < end,
                "the cluster did not get there under load"
            );
            let http = http.to_string();
            sent.push(tokio::spawn(async move {
                post(
                    &http,
                    "/v1/completions",
                    json!({"prompt": format!("Request {i}: the capital of France is"),
                           "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
                )
                .await
            }));
            i += 1;
            tokio::time::sleep(every).await;
        }
        let mut answers = Vec::new();
        for s in sent {
            answers.push(s.await.unwrap());
        }
        answers
    }
    let check = |answers: &[(u16, Value)]| {
        for (s, v) in answers {
            assert_eq!(*s, 200, "{v}");
            assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
        }
    };

    // 4 requests a second (16 output tokens each): more than one slow worker keeps within
    // the ITL target by the profile, so the plan wants two.
    let burst = load_until(&http, Duration::from_millis(250), 0, || async {
        serving(&router_state(&http).await) == 2
    })
    .await;
    check(&burst);
    assert_eq!(
        children(up.pid()).len(),
        3,
        "a router and two decode workers"
    );

    // One a second: one worker is enough; the second is drained under this traffic.
    let pid = up.pid();
    let trickle = load_until(&http, Duration::from_secs(1), 1000, || async {
        serving(&router_state(&http).await) == 1 && children(pid).len() == 2
    })
    .await;
    assert!(!trickle.is_empty());
    check(&trickle);

    // No KV block left held on the worker that stays.
    until(
        "the remaining worker holds no request and no block",
        || async {
            let v = router_state(&http).await;
            let ws = v["workers"].as_array().cloned().unwrap_or_default();
            ws.len() == 1
                && ws[0]["running"] == 0
                && ws[0]["waiting"] == 0
                && ws[0]["in_flight"] == 0
                && ws[0]["blocks_used"] == 0
        },
    )
    .await;

    up.signal(libc::SIGINT);
    let status = up
        .wait_exit(Duration::from_secs(60))
        .expect("up exits on Ctrl-C");
    assert!(status.success(), "{status:?}");
}

/// scripts/cluster-check, the GPU check's cluster stage (a GPU decode worker taking KV from a
/// CPU and a GPU prefill worker), run here with every role on the CPU so that the script itself
/// is exercised where no GPU is: every golden prompt prefilled remotely, its KV moved, and the
/// texts those of the decode worker prefilling itself.
#[test]
fn the_gpu_checks_cluster_stage_passes_on_the_cpu() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cluster-check");
    let out = std::process::Command::new(python())
        .arg(&script)
        .arg(format!("--tandem={}", env!("CARGO_BIN_EXE_tandem")))
        .arg(format!("--golden={}", golden_file().display()))
        .args(["--device=cpu", "--prefill-devices=cpu", "--records=0"])
        .arg(format!("--up-arg=--model={}", model_path().display()))
        .arg("--up-arg=--worker-threads=1")
        .arg(format!(
            "--up-arg=--worker-arg=--kv-cache-mb={TEST_POOL_MB}"
        ))
        .output()
        .expect("run scripts/cluster-check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let n = golden().len();
    assert!(
        out.status.success(),
        "{:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // The KV's size is the golden prompts'; none of it on a link (CPU workers have none).
    let (head, tail) = (
        format!("cluster cpu prefill -> cpu decode: pass ({n} requests, {n} prefilled remotely, {n} KV transfers ("),
        format!(" MiB, 0.0 on an NCCL link), {n}/{n} texts equal the local prefill's)"),
    );
    let mib = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&head)?.strip_suffix(&tail))
        .unwrap_or_else(|| panic!("{head:?} ... {tail:?} not in\n{stdout}"));
    assert!(mib.parse::<f64>().unwrap() > 1.0, "{mib} MiB of KV");
}
