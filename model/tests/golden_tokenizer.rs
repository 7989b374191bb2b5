//! The GGUF-built tokenizer and chat template against the golden files in ../shared/golden
//! (computed with HF transformers, tokenizer fixed to match llama.cpp).

use std::path::PathBuf;

use serde_json::Value;
use tandem_model::{ChatMessage, IncrementalDecoder, LoadedModel};

fn golden_dir() -> PathBuf {
    std::env::var_os("TANDEM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/golden"))
}

fn model() -> LoadedModel {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "model not found at {}: run `tandem model fetch` (scripts/test does)",
        p.display()
    );
    tandem_model::load(&p).expect("load default model")
}

fn jsonl(name: &str) -> Vec<Value> {
    let p = golden_dir().join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).expect("golden line"))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn tokenizer_cases_encode_and_decode() {
    let m = model();
    let cases = jsonl("smollm2_tokenizer_cases.jsonl");
    assert_eq!(cases.len(), 50);
    for c in &cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = m.tokenizer.encode(text, true).unwrap();
        assert_eq!(got, want, "case {}: {text:?}", c["case"]);
        assert_eq!(
            m.tokenizer.encode(text, false).unwrap(),
            ids(&c["ids_no_special"]),
            "case {} without specials",
            c["case"]
        );
        let decoded = m.tokenizer.decode(&want, false).unwrap();
        assert_eq!(
            decoded,
            c["decoded"].as_str().unwrap(),
            "case {} decode",
            c["case"]
        );
        // Streaming decode yields the same text, piece by piece, never a half character.
        let mut inc = IncrementalDecoder::new(false);
        let mut streamed = String::new();
        for &id in &want {
            let piece = inc.push(&m.tokenizer, id).unwrap();
            assert!(
                !piece.contains('\u{FFFD}') || decoded.contains('\u{FFFD}'),
                "case {}: partial char",
                c["case"]
            );
            streamed += &piece;
        }
        streamed += &inc.finish(&m.tokenizer).unwrap();
        assert_eq!(streamed, decoded, "case {} streamed", c["case"]);
    }
}

#[test]
fn golden_prompts_and_chat_template() {
    let m = model();
    let tmpl = m
        .chat_template
        .as_ref()
        .expect("SmolLM2 GGUF has a chat template");
    let recs = jsonl("smollm2_greedy.jsonl");
    assert_eq!(recs.len(), 12);
    let mut chats = 0;
    for r in &recs {
        let want = ids(&r["prompt_ids"]);
        let prompt = r["prompt"].as_str().unwrap();
        assert_eq!(
            m.tokenizer.encode(prompt, true).unwrap(),
            want,
            "{}",
            r["id"]
        );
        if let Some(chat) = r["chat"].as_array() {
            let msgs: Vec<ChatMessage> = chat
                .iter()
                .map(|v| serde_json::from_value(v.clone()).unwrap())
                .collect();
            let text = tmpl.render(&msgs, true).unwrap();
            assert_eq!(text, prompt, "{}: rendered chat", r["id"]);
            assert_eq!(
                m.tokenizer.encode(&text, true).unwrap(),
                want,
                "{}: chat ids",
                r["id"]
            );
            chats += 1;
        }
        // The generated text decodes back exactly.
        let gen = ids(&r["generated_ids"]);
        assert_eq!(
            m.tokenizer.decode(&gen, false).unwrap(),
            r["generated_text"].as_str().unwrap(),
            "{}",
            r["id"]
        );
    }
    assert!(chats >= 2, "golden has chat records");
}

#[test]
fn model_config_matches_golden() {
    let m = model();
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir().join("smollm2_config.json")).unwrap(),
    )
    .unwrap();
    let c = &m.config;
    assert_eq!(
        c.num_layers,
        g["num_hidden_layers"].as_u64().unwrap() as usize
    );
    assert_eq!(c.num_heads, 9);
    assert_eq!(c.num_kv_heads, 3);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.rope_theta, 100000.0);
    assert!(c.tie_word_embeddings);
    assert_eq!(m.tokenizer.eos_token_ids, vec![2]);
    assert_eq!(m.tokenizer.bos_token_id, Some(1));
    assert!(!m.tokenizer.add_bos);
    assert_eq!(
        m.tensor("token_embd.weight").unwrap().ty,
        tandem_model::GgmlType::Q8_0
    );
    assert_eq!(
        m.tensor("blk.0.attn_q.weight").unwrap().ty,
        tandem_model::GgmlType::Q4_1
    );
}
