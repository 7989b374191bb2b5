//! Tensor parallelism against the golden records: SmolLM2 split over 3 rank threads (one KV
//! head and three query heads each) generates the golden tokens, its last-position logits are
//! within the golden tolerance, and, fed the golden tokens, it predicts what one rank predicts.

mod golden_support;

use golden_support::*;
use std::time::Duration;
use tandem_engine::backend::Backend;
use tandem_engine::{
    CpuBackend, CpuModel, Engine, EngineConfig, SeqBatch, TpCpuBackend, TpCpuConfig, WeightFormat,
};

fn tp(size: usize, m: &tandem_model::LoadedModel, cfg: &EngineConfig) -> TpCpuBackend {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let setup = TpCpuConfig {
        size,
        threads_per_rank: (cores / size).max(1),
        watchdog: Duration::from_secs(600),
        max_step_tokens: cfg.max_batched_tokens,
        max_step_seqs: cfg.max_seqs,
        experts: false,
    };
    TpCpuBackend::new(m, WeightFormat::Native, &cfg.pool(), setup).unwrap()
}

#[test]
fn tp3_generates_the_golden_tokens_in_one_batch() {
    let m = default_model();
    let cfg = golden_config();
    let b = tp(3, &m, &cfg);
    assert_eq!(b.device(), "cpu, tp 3");
    let mut e = Engine::with_backend(Box::new(b), cfg, m.tokenizer.eos_token_ids.clone()).unwrap();
    let recs = golden_records().1;
    let outs = run_all(&mut e, &recs);
    let exact = count_exact(&recs, &outs);
    eprintln!("tp 3: {exact} of {} golden records token-exact", recs.len());
    assert_eq!(exact, recs.len(), "token-exact records at tp 3");
    assert_no_blocks_held(&e);
}

#[test]
fn tp3_last_position_logits_within_1e_3() {
    let m = default_model();
    let cfg = golden_config();
    let b = tp(3, &m, &cfg);
    let mut e = Engine::with_backend(Box::new(b), cfg, m.tokenizer.eos_token_ids.clone()).unwrap();
    check_lastpos_logits(&mut e, "tp 3 ");
}

/// Every golden record's prompt and golden tokens, fed one step at a time to a backend, all
/// records in one batch: at each position, the argmax and the logits' row.
fn teacher_forced(
    b: &mut dyn Backend,
    recs: &[serde_json::Value],
    bs: usize,
) -> Vec<Vec<(u32, Vec<f32>)>> {
    let vocab = b.config().vocab_size;
    let mut next_block = 0u32;
    let seqs: Vec<(Vec<u32>, Vec<u32>, Vec<u32>)> = recs
        .iter()
        .map(|r| {
            let (p, g) = (ids(&r["prompt_ids"]), ids(&r["generated_ids"]));
            let n = (p.len() + g.len()).div_ceil(bs) as u32;
            let table = (next_block..next_block + n).collect();
            next_block += n;
            (p, g, table)
        })
        .collect();
    let mut out: Vec<Vec<(u32, Vec<f32>)>> = vec![Vec::new(); recs.len()];
    let longest = seqs.iter().map(|s| s.1.len()).max().unwrap();
    for k in 0..longest {
        // Step k: the prompt (k = 0) or golden token k - 1, for every record that has one.
        let live: Vec<usize> = (0..seqs.len()).filter(|&i| k < seqs[i].1.len()).collect();
        let batch: Vec<SeqBatch<'_>> = live
            .iter()
            .map(|&i| {
                let (p, g, table) = &seqs[i];
                let (tokens, cached) = match k {
                    0 => (&p[..], 0),
                    _ => (&g[k - 1..k], p.len() + k - 1),
                };
                SeqBatch {
                    tokens,
                    cached,
                    block_table: table,
                    logits: 1,
                    lora: None,
                }
            })
            .collect();
        let logits = b.forward(&batch).unwrap();
        for (&i, row) in live.iter().zip(logits.chunks_exact(vocab)) {
            let t = tandem_kernels::ops::argmax(row) as u32;
            out[i].push((t, row.to_vec()));
        }
    }
    out
}

/// Fed the golden tokens, TP 3 predicts at every position the token one rank predicts, except
/// where one rank's two best logits are closer than the two runs' own difference there.
#[test]
fn tp3_teacher_forced_next_tokens_agree_with_tp1() {
    let m = default_model();
    let recs = golden_records().1;
    let bs = 16;
    let blocks: usize = recs
        .iter()
        .map(|r| (ids(&r["prompt_ids"]).len() + ids(&r["generated_ids"]).len()).div_ceil(bs))
        .sum();
    let cfg = EngineConfig {
        num_blocks: Some(blocks),
        block_size: bs,
        ..Default::default()
    };
    let mut one = CpuBackend::new(
        CpuModel::new(&m, WeightFormat::Native).unwrap(),
        &cfg.pool(),
    )
    .unwrap();
    let want = teacher_forced(&mut one, &recs, bs);
    drop(one);
    let mut three = tp(3, &m, &cfg);
    let got = teacher_forced(&mut three, &recs, bs);
    let (mut positions, mut agree, mut worst) = (0, 0, 0f64);
    for (r, (g, w)) in recs.iter().zip(got.iter().zip(&want)) {
        for (k, ((gt, grow), (wt, wrow))) in g.iter().zip(w).enumerate() {
            positions += 1;
            let diff = grow
                .iter()
                .zip(wrow)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            let scale = wrow.iter().fold(0f32, |a, v| a.max(v.abs()));
            worst = worst.max((diff / scale) as f64);
            if gt == wt {
                agree += 1;
                continue;
            }
            // A tie within the runs' difference may break either way; anything else is a bug.
            let mut top = wrow.clone();
            top.sort_by(|a, b| b.total_cmp(a));
            assert!(
                top[0] - top[1] <= 2.0 * diff,
                "{} position {k}: tp 3 predicts {gt}, tp 1 {wt} (margin {}, difference {diff})",
                r["id"],
                top[0] - top[1]
            );
        }
    }
    eprintln!(
        "tp 3 vs tp 1, teacher-forced: {agree} of {positions} next tokens agree; worst logit difference {worst:.2e} of the row's largest"
    );
    assert!(worst < 1e-4, "worst relative logit difference {worst}");
    let st = three.tp_stats().unwrap();
    eprintln!(
        "tp 3: {} collectives a rank, {:.1} MB each rank contributed, {:.2} s in collectives (mean over ranks)",
        st.calls,
        st.values as f64 * 4.0 / 1e6,
        st.collective.as_secs_f64()
    );
}
