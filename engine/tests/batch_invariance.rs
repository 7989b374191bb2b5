//! Batch invariance at the model level: a sequence's logits, and so the KV it writes, are the
//! same bits whatever else shares its steps (up to 64 other sequences of random lengths), however
//! its prompt is cut into chunks (chunked prefill; a prefix computed earlier, as a prefix-cache
//! hit gives it), and however many threads run the step, for f32, f16 and int8 KV caches. Compared
//! with `to_bits()`: the design promises identity, not closeness.
//!
//! The tiny random-weight family models (dense f32 from their HF files, quantized from their
//! GGUF files, a sliding window in Mistral's) run many random cases; the default model (Q4_1 and
//! Q8_0 products, its real sizes) runs a few long ones that cross attention's segment cuts.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use tandem_engine::{CpuModel, KvDtype, KvPool, SeqBatch, WeightFormat};

const BS: usize = 16;

/// A small deterministic generator for the cases' shapes.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

fn load(path: &Path, format: WeightFormat) -> CpuModel {
    let m = tandem_model::load(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    CpuModel::new(&m, format).unwrap()
}

fn family(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/families")
        .join(name)
}

/// One other sequence in the probe's steps: `ctx` tokens of which the last `new` are computed
/// each step (its earlier KV is whatever its blocks hold).
#[derive(Clone, Debug)]
struct Other {
    ctx: usize,
    new: usize,
    tokens: Vec<u32>,
}

/// How the probe runs: its prompt cut into `chunks` (lengths summing to the prompt's), with
/// `others` in every step, on `threads` threads.
#[derive(Clone, Debug)]
struct Plan {
    chunks: Vec<usize>,
    others: Vec<Other>,
    threads: usize,
}

/// The probe's logits after its prompt, and after one more (decode) token, under `plan`.
fn probe(
    model: &CpuModel,
    dtype: KvDtype,
    prompt: &[u32],
    next: u32,
    plan: &Plan,
) -> (Vec<f32>, Vec<f32>) {
    let total = prompt.len() + 1;
    let probe_blocks = total.div_ceil(BS);
    let other_blocks: usize = plan.others.iter().map(|o| o.ctx.div_ceil(BS)).sum();
    let mut kv = KvPool::new(
        model.kv_layout(BS),
        dtype,
        model.config.num_layers,
        probe_blocks + other_blocks,
    )
    .unwrap();
    // The probe's blocks after the others', in reverse: its physical layout differs from the
    // reference run's too.
    let mut next_block = 0u32;
    let mut tables: Vec<Vec<u32>> = plan
        .others
        .iter()
        .map(|o| {
            let t: Vec<u32> = (0..o.ctx.div_ceil(BS) as u32)
                .map(|i| next_block + i)
                .collect();
            next_block += t.len() as u32;
            t
        })
        .collect();
    let probe_table: Vec<u32> = (0..probe_blocks as u32)
        .rev()
        .map(|i| next_block + i)
        .collect();
    tables.push(probe_table);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(plan.threads)
        .build()
        .unwrap();
    let step = |kv: &mut KvPool, tokens: &[u32], cached: usize, want: bool| -> Vec<f32> {
        let mut seqs: Vec<SeqBatch<'_>> = plan
            .others
            .iter()
            .zip(&tables)
            .map(|(o, t)| SeqBatch {
                tokens: &o.tokens,
                cached: o.ctx - o.new,
                block_table: t,
                logits: 1,
                lora: None,
            })
            .collect();
        // The probe in the middle of the batch, not at an end.
        let at = seqs.len() / 2;
        seqs.insert(
            at,
            SeqBatch {
                tokens,
                cached,
                block_table: tables.last().unwrap(),
                logits: usize::from(want),
                lora: None,
            },
        );
        let logits = pool.install(|| model.forward(&seqs, kv)).unwrap();
        let vocab = model.config.vocab_size;
        if want {
            logits[at * vocab..(at + 1) * vocab].to_vec()
        } else {
            Vec::new()
        }
    };
    let mut cached = 0;
    let mut last = Vec::new();
    for (i, &c) in plan.chunks.iter().enumerate() {
        let want = i + 1 == plan.chunks.len();
        last = step(&mut kv, &prompt[cached..cached + c], cached, want);
        cached += c;
    }
    assert_eq!(cached, prompt.len());
    let decode = step(&mut kv, &[next], cached, true);
    (last, decode)
}

/// A random plan for a prompt of `len` tokens: chunks, 0 to `max_others` other sequences of up
/// to `max_ctx` tokens (most decoding one token, some prefilling a few), and 1 to 3 threads.
fn random_plan(rng: &mut Rng, len: usize, vocab: usize, max_others: usize, max_ctx: usize) -> Plan {
    let mut chunks = Vec::new();
    let mut left = len;
    while left > 0 {
        let c = if rng.below(3) == 0 {
            left
        } else {
            rng.range(1, left)
        };
        chunks.push(c);
        left -= c;
    }
    let others = (0..rng.range(0, max_others))
        .map(|_| {
            let ctx = rng.range(1, max_ctx);
            let new = if rng.below(4) == 0 {
                rng.range(1, ctx.min(12))
            } else {
                1
            };
            Other {
                ctx,
                new,
                tokens: (0..new).map(|_| rng.below(vocab) as u32).collect(),
            }
        })
        .collect();
    Plan {
        chunks,
        others,
        threads: rng.range(1, 3),
    }
}

fn assert_same_bits(what: &str, got: &[f32], want: &[f32], plan: &Plan) {
    assert_eq!(got.len(), want.len());
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: logit {i} is {} under {plan:?}, {} alone in one step",
            got[i], want[i]
        );
    }
}

/// The probe under `trials` random plans against the probe alone, in one chunk, on one thread.
fn check(
    model: &CpuModel,
    seed: u64,
    len: usize,
    trials: usize,
    max_others: usize,
    max_ctx: usize,
) {
    let mut rng = Rng(seed | 1);
    let vocab = model.config.vocab_size;
    let prompt: Vec<u32> = (0..len).map(|_| rng.below(vocab) as u32).collect();
    let next = rng.below(vocab) as u32;
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
        let alone = Plan {
            chunks: vec![len],
            others: vec![],
            threads: 1,
        };
        let (want_prompt, want_decode) = probe(model, dtype, &prompt, next, &alone);
        for _ in 0..trials {
            let plan = random_plan(&mut rng, len, vocab, max_others, max_ctx);
            let (got_prompt, got_decode) = probe(model, dtype, &prompt, next, &plan);
            assert_same_bits(
                &format!("{dtype:?} prompt"),
                &got_prompt,
                &want_prompt,
                &plan,
            );
            assert_same_bits(
                &format!("{dtype:?} decode"),
                &got_decode,
                &want_decode,
                &plan,
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    /// Tiny Llama 3 and Mistral (a sliding window of 8), dense from HF files and quantized from
    /// GGUF, prompts up to 200 tokens among up to 64 others.
    #[test]
    fn tiny_models_give_the_same_bits_in_any_batch(seed in any::<u64>(), len in 1usize..200) {
        for (name, file) in [("llama3", ""), ("llama3", "model.gguf"), ("mistral", "model.gguf")] {
            let path = family(name).join(file);
            let model = load(&path, WeightFormat::Native);
            check(&model, seed, len, 3, 64, 250);
        }
    }
}

/// The default model (Q4_1 and Q8_0 weights as stored, and decoded to f32): prompts long
/// enough to cross attention's segment cuts (256 keys), among up to 64 others.
#[test]
fn the_default_model_gives_the_same_bits_in_any_batch() {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "model not found at {}: run `tandem model fetch` (scripts/test does)",
        p.display()
    );
    for (format, seed, len) in [(WeightFormat::Native, 7, 300), (WeightFormat::F32, 11, 270)] {
        let model = load(&p, format);
        check(&model, seed, len, 2, 64, 600);
    }
}
