//! Greedy generation and last-position logits against HF transformers' float32 run
//! (../shared/golden), through the paged cache, with all prompts in one continuous batch.

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use serde_json::Value;
use tandem_engine::{
    Engine, EngineConfig, Event, KvDtype, KvPool, LlamaModel, Request, RequestId, SamplingParams,
    WeightFormat,
};

fn golden_dir() -> PathBuf {
    std::env::var_os("TANDEM_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/golden"))
}

fn engine(format: WeightFormat, cfg: EngineConfig) -> (Engine, Vec<Value>) {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "model not found at {}: run `tandem model fetch` (scripts/test does)",
        p.display()
    );
    let m = tandem_model::load(&p).unwrap();
    let eos = m.tokenizer.eos_token_ids.clone();
    let e = Engine::new(LlamaModel::new(&m, format).unwrap(), cfg, eos).unwrap();
    let text = std::fs::read_to_string(golden_dir().join("smollm2_greedy.jsonl")).unwrap();
    (
        e,
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    )
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn requests(recs: &[Value]) -> Vec<Request> {
    recs.iter()
        .map(|r| Request {
            resume: Vec::new(),
            prompt: ids(&r["prompt_ids"]),
            params: SamplingParams {
                max_tokens: r["n_new"].as_u64().unwrap() as u32,
                ignore_eos: true,
                ..Default::default()
            },
        })
        .collect()
}

/// Every block is back in the pool (free or cached), none held.
fn assert_no_blocks_held(e: &Engine) {
    let st = e.stats();
    assert_eq!(st.blocks_used, 0, "{st:?}");
    assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total, "{st:?}");
}

/// Number of records whose generated ids equal the golden ones (differences are printed).
fn count_exact(recs: &[Value], outs: &[Vec<u32>]) -> usize {
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

fn run_all(e: &mut Engine, recs: &[Value]) -> Vec<Vec<u32>> {
    let outs = e.generate(requests(recs), |_| {}, |_| {}).unwrap();
    outs.into_iter().map(|o| o.output_ids).collect()
}

fn check_all(e: &mut Engine, recs: &[Value]) {
    let outs = run_all(e, recs);
    assert_eq!(count_exact(recs, &outs), recs.len(), "token-exact records");
    assert_no_blocks_held(e);
}

#[test]
fn greedy_tokens_equal_golden_in_one_batch() {
    let (mut e, recs) = engine(WeightFormat::Native, EngineConfig::default());
    check_all(&mut e, &recs);
}

#[test]
fn greedy_tokens_equal_golden_with_small_blocks_and_chunked_prefill() {
    // Block size 1 and 7, and a token budget that splits every long prompt over several steps.
    for bs in [1, 7] {
        let (mut e, recs) = engine(
            WeightFormat::Native,
            EngineConfig {
                block_size: bs,
                max_batched_tokens: 37,
                ..Default::default()
            },
        );
        check_all(&mut e, &recs);
    }
}

#[test]
fn f32_weights_give_the_same_tokens() {
    let (mut e, recs) = engine(WeightFormat::F32, EngineConfig::default());
    check_all(&mut e, &recs);
}

#[test]
fn last_position_logits_within_1e_3() {
    let (mut e, recs) = engine(WeightFormat::Native, EngineConfig::default());
    let mut checked = 0;
    for r in &recs {
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
        let num: f64 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        eprintln!("{id}: relative L2 {rel:.2e}");
        assert!(rel < 1e-3, "{id}: relative L2 error {rel}");
        checked += 1;
    }
    assert_eq!(checked, 3, "three golden logit files");
}

#[test]
fn random_arrivals_equal_each_prompt_alone_and_golden() {
    let (mut e, recs) = engine(WeightFormat::Native, EngineConfig::default());
    // Each prompt alone (the prefix cache is cleared so nothing is shared).
    let mut alone = Vec::new();
    for r in requests(&recs) {
        e.clear_prefix_cache();
        alone.push(
            e.generate(vec![r], |_| {}, |_| {})
                .unwrap()
                .remove(0)
                .output_ids,
        );
    }
    assert_eq!(count_exact(&recs, &alone), recs.len());
    // All of them, arriving at random steps while others run.
    e.clear_prefix_cache();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut arrivals: Vec<(usize, usize)> =
        (0..recs.len()).map(|i| (rng.gen_range(0..40), i)).collect();
    arrivals.sort();
    let reqs = requests(&recs);
    let mut got: Vec<Option<Vec<u32>>> = vec![None; recs.len()];
    let mut step = 0;
    let mut next = 0;
    while next < arrivals.len() || e.has_work() {
        while next < arrivals.len() && arrivals[next].0 <= step {
            let i = arrivals[next].1;
            e.add(RequestId(i as u64), reqs[i].clone()).unwrap();
            next += 1;
        }
        let (events, _) = e.step().unwrap();
        for ev in events {
            if let Event::Finished(f) = ev {
                got[f.request.0 as usize] = Some(f.output_ids);
            }
        }
        step += 1;
    }
    let got: Vec<Vec<u32>> = got.into_iter().map(|o| o.expect("finished")).collect();
    assert_eq!(got, alone, "batched with random arrivals equals alone");
    assert_no_blocks_held(&e);
}

#[test]
fn preempted_sequences_recompute_the_same_tokens() {
    let cfg = EngineConfig::default();
    let (probe, recs) = engine(WeightFormat::Native, cfg.clone());
    let layout = probe.model.kv_layout(cfg.block_size);
    let block_bytes = KvPool::bytes_per_block(layout, KvDtype::F32, probe.model.config.num_layers);
    let biggest = requests(&recs)
        .iter()
        .map(|r| (r.prompt.len() + r.params.max_tokens as usize).div_ceil(cfg.block_size))
        .max()
        .unwrap();
    drop(probe);
    // Room for the biggest request and a little more: the batch must preempt to get through.
    let mb = ((biggest + 4) * block_bytes).div_ceil(1 << 20);
    for prefix_caching in [false, true] {
        let (mut e, recs) = engine(
            WeightFormat::Native,
            EngineConfig {
                kv_cache_mb: mb,
                prefix_caching,
                // Admit whenever a first chunk fits, so growth must preempt.
                admission_lookahead: 0,
                ..cfg.clone()
            },
        );
        check_all(&mut e, &recs);
        let st = e.stats();
        assert!(
            st.preemptions > 0,
            "pool of {} blocks: {st:?}",
            st.blocks_total
        );
        eprintln!(
            "prefix caching {prefix_caching}: {} preemptions over {} blocks",
            st.preemptions, st.blocks_total
        );
    }
}

#[test]
fn prefix_cache_hits_recompute_fewer_tokens_and_keep_tokens_exact() {
    let (mut e, recs) = engine(WeightFormat::Native, EngineConfig::default());
    let mut prefill = [0usize; 2];
    for p in &mut prefill {
        let outs = e
            .generate(requests(&recs), |_| {}, |s| *p += s.prefill_tokens)
            .unwrap();
        let outs: Vec<Vec<u32>> = outs.into_iter().map(|o| o.output_ids).collect();
        assert_eq!(count_exact(&recs, &outs), recs.len());
    }
    let st = e.stats();
    let prompt_tokens: usize = requests(&recs).iter().map(|r| r.prompt.len()).sum();
    assert_eq!(
        prefill[0], prompt_tokens,
        "first run computes every prompt token"
    );
    // Second run: every full block of every prompt (but the one holding the last token) is cached.
    let reusable: usize = requests(&recs)
        .iter()
        .map(|r| (r.prompt.len() - 1) / 16 * 16)
        .sum();
    assert_eq!(prefill[1], prompt_tokens - reusable, "{st:?}");
    assert_eq!(st.prefix_hit_tokens as usize, reusable);
    assert_no_blocks_held(&e);
}

#[test]
fn int8_kv_cache_tokens_against_golden() {
    let (mut e, recs) = engine(
        WeightFormat::Native,
        EngineConfig {
            kv_dtype: KvDtype::Int8,
            ..Default::default()
        },
    );
    let outs = run_all(&mut e, &recs);
    let exact = count_exact(&recs, &outs);
    eprintln!(
        "int8 KV: {exact} of {} golden records token-exact",
        recs.len()
    );
    assert!(exact >= INT8_EXACT_FLOOR, "{exact} exact");
    assert_no_blocks_held(&e);
}

/// Golden records that stay token-exact with the int8 KV cache: 5 of 12 measured (the others
/// part from the f32 reference after 5 to 26 tokens, where rounding flips a near-tie). A floor, so a
/// regression in the int8 path shows.
const INT8_EXACT_FLOOR: usize = 5;
