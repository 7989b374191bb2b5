//! The bodies of the coverage-guided fuzz targets: each takes any bytes and panics only on a
//! finding. `fuzz_targets/` runs them under libFuzzer (`scripts/fuzz`, which says how it gets
//! the toolchain); the end-to-end suite replays every file of `corpus/` through them on every
//! run of `scripts/test` (`tests/e2e/fuzz_corpus.rs`), so a crash once found and saved there
//! stays a regression test.
//!
//! | target | what it feeds |
//! |---|---|
//! | `grammar` | a Lark grammar, JSON Schema, regular expression or choice list (the first byte picks) through the grammar compiler's checks and pool, then a few masked steps |
//! | `openai_body` | a POST body to `/v1/completions` or `/v1/chat/completions` (the first byte picks) through the router's real HTTP app, no worker behind it |
//! | `kv_wire` | a KV frame header, and the bytes a peer sends in the handshake, to both sides of it |
//! | `gguf` | a GGUF file through the model loader |
//! | `safetensors` | a safetensors file (beside a small config) through the HF directory loader |

use std::sync::{Arc, OnceLock};

use tandem_grammar::{Grammar, GrammarError, Grammars};

/// A target's body: any bytes in, a panic only on a finding.
pub type Target = fn(&[u8]);

/// Every target by name, as `fuzz_targets/` and the corpus replay call them.
pub const TARGETS: &[(&str, Target)] = &[
    ("grammar", grammar),
    ("openai_body", openai_body),
    ("kv_wire", kv_wire),
    ("gguf", gguf),
    ("safetensors", safetensors),
];

/// The default model's vocabulary (what the servers compile grammars against), indexed once,
/// and its size.
fn grammars() -> &'static (Grammars, u32) {
    static G: OnceLock<(Grammars, u32)> = OnceLock::new();
    G.get_or_init(|| {
        let m = tandem_model::load_text(&tandem_model::default_model_path())
            .expect("the default model (scripts/test or `tandem model fetch` fetches it)");
        let vocab = m.config.vocab_size;
        let g = Grammars::new(&m.tokenizer, vocab).expect("the vocabulary indexes");
        (g, u32::try_from(vocab).expect("a vocabulary of u32 ids"))
    })
}

/// A grammar of the kind the first byte picks compiles or is refused with a reason, never an
/// internal error (a panic on a compile thread becomes one); a compiled one then takes up to 8
/// steps, each the lowest token its mask allows past an offset the input picks.
pub fn grammar(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest).into_owned();
    let g = match kind % 4 {
        0 => Grammar::Lark(text),
        1 => Grammar::JsonSchema(text),
        2 => Grammar::Regex(text),
        _ => Grammar::Choice(text.split('\n').map(str::to_string).collect()),
    };
    let (grammars, vocab) = grammars();
    let mut c = match grammars.compile(&g) {
        Ok(c) => c,
        Err(GrammarError::Internal(e)) => panic!("internal error compiling {g:?}: {e}"),
        Err(_) => return,
    };
    let skip = usize::from(kind / 4);
    for _ in 0..8 {
        let mask = match c.allowed() {
            Ok(m) => m,
            Err(GrammarError::Internal(e)) => panic!("internal error in a mask: {e}"),
            Err(_) => return,
        };
        let allowed: Vec<u32> = (0..*vocab).filter(|&t| mask.allows(t)).collect();
        let Some(&t) = allowed.get(skip % allowed.len().max(1)) else {
            return;
        };
        if c.consume(t).is_err() || c.is_finished() {
            return;
        }
    }
}

/// The router's HTTP app over the default model's tokenizer and template, with no worker.
struct Router {
    rt: tokio::runtime::Runtime,
    app: axum::Router,
}

fn router() -> &'static Router {
    static R: OnceLock<Router> = OnceLock::new();
    R.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let model = Arc::new(
            tandem_router::load_model(&tandem_model::default_model_path(), None)
                .expect("the default model"),
        );
        let app = {
            let _guard = rt.enter();
            let (_tx, rx) = tokio::sync::watch::channel(Vec::<tandem_router::WorkerAddr>::new());
            let pool = tandem_router::WorkerPool::spawn(
                tandem_router::Role::Decode,
                rx,
                tandem_router::PoolConfig::default(),
            );
            let policy = tandem_router::policy::build(
                tandem_router::PolicyKind::LeastLoad,
                Default::default(),
            );
            let dispatcher = Arc::new(tandem_router::Dispatcher::new(
                model,
                pool,
                None,
                policy,
                tandem_router::DispatchConfig {
                    max_queue: 64,
                    disagg: Default::default(),
                    max_migrations: 0,
                    stall: std::time::Duration::from_secs(10),
                    flow: Default::default(),
                },
            ));
            let door = tandem_router::FrontDoorArgs {
                max_body_bytes: 1 << 20,
                ..Default::default()
            }
            .resolve()
            .expect("front door limits");
            let responses =
                tandem_router::Responses::in_memory(16 << 20, std::time::Duration::from_secs(600));
            tandem_router::routes(dispatcher, &door, responses)
        };
        Router { rt, app }
    })
}

/// A body posted to the completions, chat or responses route (by the first byte) gets a client error with
/// an OpenAI error body, or 503 `no_worker` when it is valid: never a 5xx of the router's own
/// (its panic guard answers a panic with 500).
pub fn openai_body(data: &[u8]) {
    use tower::ServiceExt;
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    let path = match kind % 3 {
        0 => "/v1/completions",
        1 => "/v1/chat/completions",
        _ => "/v1/responses",
    };
    let r = router();
    let (status, bytes) = r.rt.block_on(async {
        let req = axum::http::Request::builder()
            .method("POST")
            .uri(path)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.to_vec()))
            .expect("a request");
        let resp = r.app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .expect("the answer's body");
        (status, bytes)
    });
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{status}: the body is not JSON ({e})"));
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{status}: {v}"
    );
    assert!(
        (400..500).contains(&status) || (status == 503 && v["error"]["code"] == "no_worker"),
        "{status}: {v}"
    );
}

/// The first `HEADER_LEN` bytes decode as a frame header or fail cleanly (what decodes encodes
/// back to the same header); all of them, as the peer's side of a handshake, fail it on both
/// ends without a panic or a hang.
pub fn kv_wire(data: &[u8]) {
    use tandem_kv_transfer::wire::{FrameHeader, HEADER_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if let Ok(b) = <[u8; HEADER_LEN]>::try_from(data.get(..HEADER_LEN).unwrap_or_default()) {
        if let Ok(h) = FrameHeader::decode(&b) {
            assert_eq!(FrameHeader::decode(&h.encode()).ok(), Some(h));
        }
    }
    let secret = tandem_kv_transfer::Secret::new("fuzz-cluster-secret-0123456789").expect("secret");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let peer = |bytes: Vec<u8>| {
            let (ours, mut theirs) = tokio::io::duplex(4096);
            let task = tokio::spawn(async move {
                let _ = theirs.write_all(&bytes).await;
                let _ = theirs.shutdown().await;
                let mut sink = Vec::new();
                let _ = theirs.read_to_end(&mut sink).await;
            });
            (ours, task)
        };
        let limit = std::time::Duration::from_secs(30);
        let (mut ours, task) = peer(data.to_vec());
        let accepted = tokio::time::timeout(
            limit,
            tandem_kv_transfer::auth::accept(&mut ours, &secret, None, |_, _| Ok(())),
        )
        .await;
        drop(ours);
        let _ = task.await;
        assert!(matches!(accepted, Ok(Err(_))), "accept: {accepted:?}");
        let (mut ours, task) = peer(data.to_vec());
        let connected = tokio::time::timeout(
            limit,
            tandem_kv_transfer::auth::connect(&mut ours, &secret, None, 1, "127.0.0.1:1"),
        )
        .await;
        drop(ours);
        let _ = task.await;
        assert!(matches!(connected, Ok(Err(_))), "connect: {connected:?}");
    });
}

/// A GGUF file loads or is refused with an error; nothing panics.
pub fn gguf(data: &[u8]) {
    let _ = tandem_model::gguf::parse_bytes(data);
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, data).expect("the file");
    let _ = tandem_model::load(&path);
}

/// The config [`safetensors`] loads its files beside: a one-layer Llama of 4 tokens.
const CONFIG: &str = r#"{"model_type":"llama","hidden_size":8,"intermediate_size":16,
    "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"vocab_size":4,
    "max_position_embeddings":64,"rms_norm_eps":1e-5,"rope_theta":10000.0,
    "tie_word_embeddings":true}"#;

/// A safetensors file (beside [`CONFIG`]) loads or is refused with an error; nothing panics.
pub fn safetensors(data: &[u8]) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    std::fs::write(dir.path().join("config.json"), CONFIG).expect("the config");
    std::fs::write(dir.path().join("model.safetensors"), data).expect("the weights");
    let _ = tandem_model::load(dir.path());
}
