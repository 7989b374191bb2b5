//! Shared by the golden test binaries: the default model's engine, the golden records, and
//! checks of outputs and blocks against them.
#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;
use tandem_engine::backend::Backend;
use tandem_engine::{CpuBackend, CpuModel, Engine, EngineConfig, Request, SeqBatch, WeightFormat};

pub fn golden_dir() -> PathBuf {
    std::env::var_os("TANDEM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/golden"))
}

/// The engine settings the golden checks start from: the defaults, but a KV pool sized for the
/// golden records rather than a server's 1 GiB. All twelve at once take about 80 MiB of f32
/// cache; 256 MiB leaves room for the admission lookahead and the prefix cache's kept blocks, so
/// nothing preempts where a check expects a roomy pool. (An engine faults its whole pool in when
/// it is made: a GiB cost 0.5-2.7 s of kernel time in a test process on the 2-core test VMs,
/// and these binaries make dozens of engines at each kernel level.)
pub fn golden_config() -> EngineConfig {
    EngineConfig {
        kv_cache_mb: 256,
        ..EngineConfig::default()
    }
}

/// The default model, loaded (an error that says how to fetch it where it is missing).
pub fn default_model() -> tandem_model::LoadedModel {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "model not found at {}: run `tandem model fetch` (scripts/test does)",
        p.display()
    );
    tandem_model::load(&p).unwrap()
}

pub fn engine(format: WeightFormat, cfg: EngineConfig) -> (Engine, Vec<Value>) {
    let m = default_model();
    let eos = m.tokenizer.eos_token_ids.clone();
    let e = Engine::new(CpuModel::new(&m, format).unwrap(), cfg, eos).unwrap();
    (e, golden_records().1)
}

/// The golden file's path and its records.
pub fn golden_records() -> (PathBuf, Vec<Value>) {
    let path = golden_dir().join("smollm2_greedy.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let recs = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (path, recs)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A greedy request for `max_tokens` tokens after `prompt`, EOS ignored.
pub fn greedy_request(prompt: Vec<u32>, max_tokens: u32) -> Request {
    Request::greedy(prompt, max_tokens).unwrap()
}

pub fn requests(recs: &[Value]) -> Vec<Request> {
    recs.iter()
        .map(|r| greedy_request(ids(&r["prompt_ids"]), r["n_new"].as_u64().unwrap() as u32))
        .collect()
}

/// Every block is back in the pool (free or cached), none held.
pub fn assert_no_blocks_held(e: &Engine) {
    let st = e.stats();
    assert_eq!(st.blocks_used, 0, "{st:?}");
    assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total, "{st:?}");
}

/// Number of records whose generated ids equal the golden ones (differences are printed).
pub fn count_exact(recs: &[Value], outs: &[Vec<u32>]) -> usize {
    let mut exact = 0;
    for (r, o) in recs.iter().zip(outs) {
        let want = ids(&r["generated_ids"]);
        if *o == want {
            exact += 1;
        } else {
            let at = o.iter().zip(&want).position(|(a, b)| a != b);
            eprintln!(
                "{}: first difference at {at:?}\n got {:?}\nwant {:?}",
                r["id"], o, want
            );
        }
    }
    exact
}

pub fn run_all(e: &mut Engine, recs: &[Value]) -> Vec<Vec<u32>> {
    let outs = e.generate(requests(recs), |_| {}, |_| {}).unwrap();
    outs.into_iter().map(|o| o.output_ids).collect()
}

pub fn check_all(e: &mut Engine, recs: &[Value]) {
    let outs = run_all(e, recs);
    assert_eq!(count_exact(recs, &outs), recs.len(), "token-exact records");
    assert_no_blocks_held(e);
}

/// ‖got − want‖ / ‖want‖ in f64.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Every golden record's last-position logits from `e` within 1e-3 relative L2 of the golden
/// files (three of them), each printed with `label`.
pub fn check_lastpos_logits(e: &mut Engine, label: &str) {
    let mut checked = 0;
    for r in golden_records().1 {
        let id = r["id"].as_str().unwrap();
        let path = golden_dir().join(format!("smollm2_{id}_lastpos_logits.bin"));
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let want: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let got = e.prompt_logits(&ids(&r["prompt_ids"])).unwrap();
        assert_eq!(got.len(), want.len());
        let rel = rel_l2(&got, &want);
        eprintln!("{label}{id}: relative L2 {rel:.2e}");
        assert!(rel < 1e-3, "{label}{id}: relative L2 error {rel}");
        checked += 1;
    }
    assert_eq!(checked, 3, "three golden logit files");
}

/// Decode steps after the prefill in [`teacher_forced_logits`].
pub const DECODE_STEPS: usize = 4;

/// The records the bit-for-bit check feeds: of the golden prompts up to 64 tokens, the shortest
/// and the longest (1 and 51 tokens), each with its golden tokens after it.
pub fn short_records() -> Vec<Value> {
    let mut recs: Vec<_> = golden_records()
        .1
        .into_iter()
        .filter(|r| ids(&r["prompt_ids"]).len() <= 64)
        .collect();
    recs.sort_by_key(|r| ids(&r["prompt_ids"]).len());
    let longest = recs.pop().unwrap();
    vec![recs.swap_remove(0), longest]
}

/// The model's logits (its weights in `format`) for each record's prompt and golden tokens, all
/// records in each step: a prefill of all but the last [`DECODE_STEPS`] tokens with logits at
/// every position, then one token a step with the last position's. Every row, in order, and the
/// vocabulary's size.
pub fn teacher_forced_logits(
    m: &tandem_model::LoadedModel,
    format: WeightFormat,
    recs: &[Value],
) -> (Vec<f32>, usize) {
    let bs = 16;
    let seqs: Vec<Vec<u32>> = recs
        .iter()
        .map(|r| [ids(&r["prompt_ids"]), ids(&r["generated_ids"])].concat())
        .collect();
    let tables: Vec<Vec<u32>> = seqs
        .iter()
        .scan(0u32, |next, s| {
            let n = s.len().div_ceil(bs) as u32;
            *next += n;
            Some((*next - n..*next).collect())
        })
        .collect();
    let cfg = EngineConfig {
        num_blocks: Some(tables.iter().map(Vec::len).sum()),
        block_size: bs,
        ..Default::default()
    };
    let mut b = CpuBackend::new(CpuModel::new(m, format).unwrap(), &cfg.pool()).unwrap();
    let vocab = b.config().vocab_size;
    let mut out = Vec::new();
    for step in 0..=DECODE_STEPS {
        let batch: Vec<SeqBatch<'_>> = seqs
            .iter()
            .zip(&tables)
            .map(|(s, table)| {
                let first = s.len() - DECODE_STEPS;
                let (tokens, cached) = match step {
                    0 => (&s[..first], 0),
                    _ => (&s[first + step - 1..first + step], first + step - 1),
                };
                SeqBatch {
                    tokens,
                    cached,
                    block_table: table,
                    logits: tokens.len(),
                    lora: None,
                }
            })
            .collect();
        out.extend(b.forward(&batch).unwrap());
    }
    (out, vocab)
}

/// `got` and `want`, [`teacher_forced_logits`]' rows for `recs`, are equal bit for bit; a
/// difference names its logit and row, `label` and how each side was computed.
pub fn assert_same_bits(
    got: &[f32],
    want: &[f32],
    vocab: usize,
    recs: &[Value],
    label: &str,
    got_from: &str,
    want_from: &str,
) {
    // A row for every token of the records.
    let rows = recs
        .iter()
        .map(|r| ids(&r["prompt_ids"]).len() + ids(&r["generated_ids"]).len())
        .sum::<usize>();
    assert!(
        rows > 2 * DECODE_STEPS && vocab > 0,
        "{rows} rows of {vocab}"
    );
    assert_eq!((got.len(), want.len()), (rows * vocab, rows * vocab));
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{label}: logit {} of row {} of {rows} is {} {got_from} and {} {want_from}",
            i % vocab,
            i / vocab,
            got[i],
            want[i]
        );
    }
    let names: Vec<String> = recs.iter().map(|r| r["id"].to_string()).collect();
    eprintln!(
        "{label}: {rows} rows of {vocab} logits equal bit for bit (records {}; kernels {})",
        names.join(", "),
        tandem_kernels::isa::active().name()
    );
}
