//! Expert parallelism gives the bits of one rank: the tiny Qwen3-MoE (8 experts) and Mixtral
//! (4) split over 2 and 4 rank threads, several sequences at once (prompts of different lengths
//! prefilled together, in chunks, then decoded), every logit of every step equal, bit for bit,
//! to the logits of the same steps on one rank; and through the engine, the same tokens.

use std::path::PathBuf;
use std::time::Duration;

use tandem_engine::backend::Backend;
use tandem_engine::{
    CpuBackend, CpuModel, Engine, EngineConfig, Request, Samples, SamplingParams, SeqBatch,
    TpCpuBackend, TpCpuConfig, WeightFormat,
};

fn load(family: &str) -> tandem_model::LoadedModel {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/families")
        .join(family)
        .join("model.gguf");
    tandem_model::load(&p).unwrap()
}

fn ep(size: usize, m: &tandem_model::LoadedModel, cfg: &EngineConfig) -> TpCpuBackend {
    let setup = TpCpuConfig {
        size,
        threads_per_rank: 1,
        watchdog: Duration::from_secs(600),
        max_step_tokens: cfg.max_batched_tokens,
        max_step_seqs: cfg.max_seqs,
        experts: true,
    };
    TpCpuBackend::new(m, WeightFormat::Native, &cfg.pool(), setup).unwrap()
}

/// Five sequences: prompts of 3 to 40 tokens, the first two prefilled in two chunks (the
/// second chunk beside the others' whole prompts), then 6 decode steps of all five, each
/// step's every logit.
fn steps(b: &mut dyn Backend) -> Vec<Vec<f32>> {
    let prompts: Vec<Vec<u32>> = [40usize, 3, 17, 25, 9]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n as u32)
                .map(|t| (t * 31 + i as u32 * 7 + 5) % 384)
                .collect()
        })
        .collect();
    let tables: Vec<Vec<u32>> = (0..prompts.len() as u32)
        .map(|i| (i * 4..i * 4 + 4).collect())
        .collect();
    let mut out = Vec::new();
    let seq = |tokens, cached, i: usize| SeqBatch {
        tokens,
        cached,
        block_table: &tables[i],
        logits: 1,
        lora: None,
    };
    // The first halves of the first two prompts alone.
    let (h0, h1) = (prompts[0].len() / 2, prompts[1].len() / 2);
    out.push(
        b.forward(&[seq(&prompts[0][..h0], 0, 0), seq(&prompts[1][..h1], 0, 1)])
            .unwrap(),
    );
    let mut batch = vec![seq(&prompts[0][h0..], h0, 0), seq(&prompts[1][h1..], h1, 1)];
    batch.extend((2..prompts.len()).map(|i| seq(&prompts[i][..], 0, i)));
    out.push(b.forward(&batch).unwrap());
    let mut last: Vec<u32> = (0..prompts.len() as u32).map(|i| 11 + i).collect();
    for k in 0..6 {
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let batch: Vec<SeqBatch<'_>> = (0..prompts.len())
            .map(|i| SeqBatch {
                tokens: &toks[i][..],
                cached: prompts[i].len() + k,
                block_table: &tables[i],
                logits: 1,
                lora: None,
            })
            .collect();
        let logits = b.forward(&batch).unwrap();
        let vocab = logits.len() / prompts.len();
        last = logits
            .chunks_exact(vocab)
            .map(|r| tandem_kernels::ops::argmax(r) as u32)
            .collect();
        out.push(logits);
    }
    out
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn expert_ranks_give_the_bits_of_one_rank() {
    for family in ["qwen3_moe", "mixtral"] {
        let m = load(family);
        let cfg = EngineConfig {
            num_blocks: Some(32),
            block_size: 16,
            ..Default::default()
        };
        let mut one = CpuBackend::new(
            CpuModel::new(&m, WeightFormat::Native).unwrap(),
            &cfg.pool(),
        )
        .unwrap();
        let want = steps(&mut one);
        assert!(want.iter().flatten().all(|x| x.is_finite()));
        for size in [2, 4] {
            let mut group = ep(size, &m, &cfg);
            assert_eq!(group.device(), format!("cpu, ep {size}"));
            let got = steps(&mut group);
            assert_eq!(bits(&got), bits(&want), "{family}: ep {size}");
        }
    }
}

#[test]
fn expert_parallel_engines_generate_what_one_rank_does() {
    let m = load("qwen3_moe");
    let cfg = EngineConfig {
        kv_cache_mb: 4,
        max_batched_tokens: 24,
        ..EngineConfig::default()
    };
    // Six greedy requests, and a seeded one sampled at temperature 1 three times (n = 3).
    let requests = || -> Vec<Request> {
        let mut r: Vec<Request> = (0..6u32)
            .map(|i| {
                let prompt: Vec<u32> = (0..5 + 7 * i).map(|t| (t * 13 + i) % 384).collect();
                Request::greedy(prompt, 12).unwrap()
            })
            .collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            max_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        };
        r.push(Request {
            samples: Samples { count: 3, first: 0 },
            ..Request::new((0..20).collect(), params.validate().unwrap())
        });
        r
    };
    let run = |b: Box<dyn Backend>| {
        let mut e = Engine::with_backend(b, cfg.clone(), vec![]).unwrap();
        let outs = e.generate(requests(), |_| {}, |_| {}).unwrap();
        assert_eq!(e.stats().blocks_used, 0);
        outs.into_iter().map(|o| o.output_ids).collect::<Vec<_>>()
    };
    let want = run(Box::new(
        CpuBackend::new(
            CpuModel::new(&m, WeightFormat::Native).unwrap(),
            &cfg.pool(),
        )
        .unwrap(),
    ));
    assert!(want.iter().all(|o| o.len() == 12));
    assert_eq!(want.len(), 9, "six greedy outputs and three samples");
    assert!(
        want[6..].windows(2).any(|w| w[0] != w[1]),
        "the samples differ"
    );
    for size in [2, 4] {
        let got = run(Box::new(ep(size, &m, &cfg)));
        assert_eq!(got, want, "ep {size}");
    }
}

#[test]
fn expert_parallelism_refuses_what_it_cannot_split() {
    let cfg = EngineConfig::default();
    let setup = |size| TpCpuConfig {
        size,
        threads_per_rank: 1,
        watchdog: Duration::from_secs(10),
        max_step_tokens: cfg.max_batched_tokens,
        max_step_seqs: cfg.max_seqs,
        experts: true,
    };
    // 4 experts over 3 ranks, and a dense model.
    let e = TpCpuBackend::new(
        &load("mixtral"),
        WeightFormat::Native,
        &cfg.pool(),
        setup(3),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("4 experts") && e.contains("3 ranks"), "{e}");
    let e = TpCpuBackend::new(&load("qwen3"), WeightFormat::Native, &cfg.pool(), setup(2))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("no experts"), "{e}");
}
