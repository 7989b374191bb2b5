//! LoRA adapters against HF transformers + PEFT: four random adapters of the default model
//! (`model/tests/lora`, made by its `make_lora_adapters.py`: different targets, ranks and
//! scalings, one with rsLoRA), each alone within 1e-5 of PEFT's float32 logits and token-exact
//! on its greedy continuation; all four and the base mixed in one batch, each row the bits of
//! its solo run; and a cached prefix never shared across adapters.

mod golden_support;

use std::path::PathBuf;
use std::sync::Arc;

use golden_support::{assert_no_blocks_held, engine, golden_config, greedy_request, ids};
use serde_json::Value;
use tandem_engine::{CpuModel, KvDtype, KvPool, Request, SeqBatch, WeightFormat};
use tandem_model::LoraAdapter;

const ADAPTERS: [&str; 4] = ["alpha", "beta", "gamma", "delta"];

fn adapter_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/lora")
        .join(name)
}

fn adapter(name: &str) -> Arc<LoraAdapter> {
    let m = tandem_model::load(&tandem_model::default_model_path()).unwrap();
    Arc::new(tandem_model::load_lora(name, &adapter_dir(name), &m.config, 64).unwrap())
}

struct Case {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<f32>,
}

fn reference(name: &str) -> Vec<Case> {
    let dir = adapter_dir(name);
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Case {
            prompt: ids(&p["prompt_ids"]),
            greedy: ids(&p["greedy"]),
            logits: std::fs::read(dir.join(p["logits"].as_str().unwrap()))
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
        })
        .collect()
}

/// Largest |got − want| over the row, relative to the row's largest |want|.
fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

/// Adapter `name`'s greedy continuations of its prompts, in one batch, are PEFT's.
fn check_greedy(e: &mut tandem_engine::Engine, name: &str, a: &Arc<LoraAdapter>) {
    let cases = reference(name);
    let reqs = cases
        .iter()
        .map(|c| {
            let n = c.greedy.len() as u32;
            with_adapter(greedy_request(c.prompt.clone(), n), Some(a))
        })
        .collect();
    let outs = e.generate(reqs, |_| {}, |_| {}).unwrap();
    for (o, c) in outs.iter().zip(&cases) {
        assert_eq!(o.output_ids, c.greedy, "{name}: greedy tokens");
    }
}

fn with_adapter(mut r: Request, a: Option<&Arc<LoraAdapter>>) -> Request {
    r.adapter = a.cloned();
    r
}

#[test]
fn each_adapter_alone_equals_hf_peft_in_float32() {
    let (mut e, _) = engine(WeightFormat::F32, golden_config());
    for name in ADAPTERS {
        let a = adapter(name);
        for (i, case) in reference(name).iter().enumerate() {
            let got = e.prompt_logits_with(&case.prompt, Some(&a)).unwrap();
            let err = max_rel(&got, &case.logits);
            eprintln!("{name} prompt {i}: max relative logit error {err:.2e}");
            assert!(err <= 1e-5, "{name} prompt {i}: {err}");
            // Without the adapter the logits are the base's, far from PEFT's.
            let base = e.prompt_logits(&case.prompt).unwrap();
            assert!(max_rel(&base, &case.logits) > 1e-3, "{name}: no effect");
        }
        check_greedy(&mut e, name, &a);
    }
    assert_no_blocks_held(&e);
}

/// The default weights (Q4_1, kept quantized) with each adapter: PEFT's greedy tokens, and
/// logits as close to PEFT's as the base's are to HF's (the golden check's bound).
#[test]
fn each_adapter_on_the_quantized_weights_gives_peft_s_tokens() {
    let (mut e, _) = engine(WeightFormat::Native, golden_config());
    for name in ADAPTERS {
        let a = adapter(name);
        let cases = reference(name);
        for (i, c) in cases.iter().enumerate() {
            let got = e.prompt_logits_with(&c.prompt, Some(&a)).unwrap();
            let rel = golden_support::rel_l2(&got, &c.logits);
            eprintln!("{name} prompt {i}: relative L2 {rel:.2e}");
            assert!(rel < 1e-3, "{name} prompt {i}: {rel}");
        }
        check_greedy(&mut e, name, &a);
    }
}

/// Every (prompt, adapter or base) pair: sampled at temperature 1 with a seed, so the logits'
/// bits decide every token; returns (output ids, logprob bits) per request.
fn sampled(
    e: &mut tandem_engine::Engine,
    jobs: &[(Vec<u32>, Option<Arc<LoraAdapter>>)],
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let reqs = jobs
        .iter()
        .map(|(p, a)| {
            let params = tandem_types::SamplingParams {
                max_tokens: 12,
                temperature: 1.0,
                seed: Some(7),
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap();
            with_adapter(Request::new(p.clone(), params), a.as_ref())
        })
        .collect();
    e.generate(reqs, |_| {}, |_| {})
        .unwrap()
        .into_iter()
        .map(|o| {
            let bits = o.logprobs.iter().map(|l| l.to_bits()).collect();
            (o.output_ids, bits)
        })
        .collect()
}

#[test]
fn four_adapters_and_the_base_in_one_batch_give_each_row_its_solo_bits() {
    let (mut e, _) = engine(WeightFormat::Native, golden_config());
    let prompts: Vec<Vec<u32>> = reference("alpha").into_iter().map(|c| c.prompt).collect();
    let mut jobs = Vec::new();
    for p in &prompts {
        jobs.push((p.clone(), None));
        for name in ADAPTERS {
            jobs.push((p.clone(), Some(adapter(name))));
        }
    }
    let together = sampled(&mut e, &jobs);
    for (i, job) in jobs.iter().enumerate() {
        e.clear_prefix_cache();
        let alone = sampled(&mut e, std::slice::from_ref(job));
        let label = job.1.as_ref().map_or("base", |a| a.name.as_str());
        assert_eq!(
            together[i], alone[0],
            "request {i} ({label}) in the batch vs alone"
        );
    }
    // The adapters changed what was sampled or its probabilities: five different outputs
    // per prompt.
    for chunk in together.chunks(5) {
        let mut outs: Vec<_> = chunk.to_vec();
        outs.sort();
        outs.dedup();
        assert_eq!(outs.len(), 5, "{outs:?}");
    }
    assert_no_blocks_held(&e);
}

/// The forward itself: one packed prefill step of the five (prompt, adapter) rows gives each
/// row's logits the bits of the same row run alone.
#[test]
fn a_packed_step_of_mixed_adapters_equals_each_sequence_alone() {
    let m = tandem_model::load(&tandem_model::default_model_path()).unwrap();
    let model = CpuModel::new(&m, WeightFormat::Native).unwrap();
    let adapters: Vec<Arc<LoraAdapter>> = ADAPTERS.iter().map(|n| adapter(n)).collect();
    let prompt = reference("alpha").remove(1).prompt;
    let bs = 16;
    let per = prompt.len().div_ceil(bs);
    let rows = 1 + adapters.len();
    let mut kv = KvPool::new(
        model.kv_layout(bs),
        KvDtype::F32,
        model.config.num_layers,
        per * rows,
    )
    .unwrap();
    let tables: Vec<Vec<u32>> = (0..rows)
        .map(|r| ((r * per) as u32..((r + 1) * per) as u32).collect())
        .collect();
    let lora = |r: usize| match r {
        0 => None,
        r => Some(&*adapters[r - 1]),
    };
    let batch: Vec<SeqBatch> = (0..rows)
        .map(|r| SeqBatch {
            tokens: &prompt,
            cached: 0,
            block_table: &tables[r],
            logits: 1,
            lora: lora(r),
        })
        .collect();
    let together = model.forward(&batch, &mut kv).unwrap();
    let vocab = model.config.vocab_size;
    assert_eq!(together.len(), rows * vocab);
    for (r, seq) in batch.iter().enumerate() {
        let alone = model.forward(std::slice::from_ref(seq), &mut kv).unwrap();
        let want: Vec<u32> = alone.iter().map(|x| x.to_bits()).collect();
        let got: Vec<u32> = together[r * vocab..][..vocab]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert!(got == want, "row {r}: the batch changed its bits");
    }
}

#[test]
fn a_prefix_is_reused_within_an_adapter_and_never_across_adapters() {
    let (mut e, _) = engine(WeightFormat::Native, golden_config());
    let prompt = reference("alpha").remove(1).prompt;
    assert!(prompt.len() > 2 * 16, "a prompt of several blocks");
    let (alpha, beta) = (adapter("alpha"), adapter("beta"));
    let run = |e: &mut tandem_engine::Engine, a: Option<&Arc<LoraAdapter>>| {
        let r = with_adapter(greedy_request(prompt.clone(), 4), a);
        e.generate(vec![r], |_| {}, |_| {}).unwrap().remove(0)
    };
    e.drain_kv_events();
    let first = run(&mut e, Some(&alpha));
    assert_eq!(first.cached_prompt_tokens, 0);
    // The hashes the engine reports (to the router's index) start from alpha's content hash.
    let want = tandem_model::block_hashes_from(
        tandem_model::chain_root(Some(alpha.content_hash)),
        &prompt,
        16,
    );
    let stored: Vec<_> = e
        .drain_kv_events()
        .into_iter()
        .flat_map(|ev| match ev.kind {
            tandem_engine::KvEventKind::Stored { hashes, .. } => hashes,
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(stored[..want.len()], want[..]);
    assert!(want[0] != tandem_model::block_hashes(&prompt, 16)[0]);
    let beta_after_alpha = run(&mut e, Some(&beta));
    assert_eq!(
        beta_after_alpha.cached_prompt_tokens, 0,
        "beta took alpha's blocks"
    );
    let base = run(&mut e, None);
    assert_eq!(
        base.cached_prompt_tokens, 0,
        "the base took an adapter's blocks"
    );
    let again = run(&mut e, Some(&alpha));
    assert!(
        again.cached_prompt_tokens >= 32,
        "alpha's second run reused {} tokens",
        again.cached_prompt_tokens
    );
    assert_eq!(again.output_ids, first.output_ids);
    // What beta gave beside alpha's cache is what it gives on an empty one.
    e.clear_prefix_cache();
    assert_eq!(
        run(&mut e, Some(&beta)).output_ids,
        beta_after_alpha.output_ids
    );
    assert_no_blocks_held(&e);
}
