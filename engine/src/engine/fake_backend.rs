//! The scheduler driven by a fake device: [`TokenCache`] keeps, in place of K and V, the token id
//! each cache slot was written with, and picks each next token from the context it reads back
//! through the block table. A step that reads a slot nobody wrote, a block outside the pool or a
//! slot another sequence overwrote makes a different token than the request's own history, so
//! these tests check the block manager, the prefix cache, preemption and the step budget
//! exactly, without a model's arithmetic.

use std::sync::{Arc, Mutex};

use super::tests::{random_plan, req, run_plan};
use super::*;
use crate::forward::SeqBatch;
use proptest::prelude::*;
use rand::SeedableRng;
use tandem_types::{BlockId, SamplingParams};

const VOCAB: usize = 61;

/// Per step the fake ran: (token rows, sequences).
type StepLog = Arc<Mutex<Vec<(usize, usize)>>>;

/// The token a context of `tokens` produces next (a position-weighted hash).
fn next_token(tokens: &[u32]) -> u32 {
    let h = tokens.iter().enumerate().fold(17u64, |h, (i, &t)| {
        h.wrapping_mul(1_000_003)
            .wrapping_add((i as u64 + 1) * (t as u64 + 7))
    });
    (h % VOCAB as u64) as u32
}

/// What a request generates: each token from the prompt and the tokens before it.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    for _ in 0..n {
        ctx.push(next_token(&ctx));
    }
    ctx.split_off(prompt.len())
}

/// A device whose cache holds token ids.
struct TokenCache {
    config: ModelConfig,
    block_size: usize,
    slots: Vec<Option<u32>>,
    /// Shared with the test.
    steps: StepLog,
}

impl TokenCache {
    fn new(num_blocks: usize, block_size: usize, max_context: usize, steps: StepLog) -> Self {
        Self {
            config: ModelConfig {
                hidden_size: 8,
                intermediate_size: 8,
                num_layers: 1,
                num_heads: 1,
                num_kv_heads: 1,
                head_dim: 8,
                vocab_size: VOCAB,
                max_position_embeddings: max_context,
                rms_norm_eps: 1e-5,
                rope_theta: 1e4,
                rope_scaling: None,
                tie_word_embeddings: true,
                family: Default::default(),
                sliding_window: None,
                moe: None,
            },
            block_size,
            slots: vec![None; num_blocks * block_size],
            steps,
        }
    }

    fn slot(&self, table: &[u32], pos: usize) -> Result<usize, EngineError> {
        let bs = self.block_size;
        let block = *table.get(pos / bs).ok_or_else(|| {
            EngineError::Internal(format!("position {pos} beyond the block table {table:?}"))
        })? as usize;
        let slot = block * bs + pos % bs;
        if slot >= self.slots.len() {
            return Err(EngineError::Internal(format!(
                "block {block} outside the pool"
            )));
        }
        Ok(slot)
    }
}

impl Backend for TokenCache {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        let rows = seqs.iter().map(|s| s.tokens.len()).sum();
        let busy = seqs.iter().filter(|s| !s.tokens.is_empty()).count();
        self.steps.lock().unwrap().push((rows, busy));
        let mut logits = Vec::new();
        for s in seqs {
            let mut ctx = Vec::with_capacity(s.cached + s.tokens.len());
            for p in 0..s.cached {
                let slot = self.slot(s.block_table, p)?;
                ctx.push(self.slots[slot].ok_or_else(|| {
                    EngineError::Internal(format!("position {p} read from unwritten slot {slot}"))
                })?);
            }
            for (i, &t) in s.tokens.iter().enumerate() {
                let slot = self.slot(s.block_table, s.cached + i)?;
                self.slots[slot] = Some(t);
                ctx.push(t);
            }
            // One row for each of the last `logits` tokens, from the context up to it.
            let rows = s.logits.min(s.tokens.len());
            for end in ctx.len() - rows + 1..=ctx.len() {
                let mut row = vec![0f32; VOCAB];
                row[next_token(&ctx[..end]) as usize] = 1.0;
                logits.extend(row);
            }
        }
        Ok(logits)
    }

    fn num_blocks(&self) -> usize {
        self.slots.len() / self.block_size
    }

    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        let bs = self.block_size;
        for &(from, to) in pairs {
            let (from, to) = (from.0 as usize * bs, to.0 as usize * bs);
            self.slots.copy_within(from..from + bs, to);
        }
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        0
    }

    fn kv_bytes_per_token(&self) -> f64 {
        4.0
    }

    fn kv_dtype_name(&self) -> &'static str {
        "token"
    }

    fn device(&self) -> String {
        "token cache".into()
    }
}

/// An engine over a fresh token cache of `num_blocks`, and the cache's step log.
fn engine(num_blocks: usize, cfg: EngineConfig) -> (Engine, StepLog) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let b = TokenCache::new(num_blocks, cfg.block_size, 512, log.clone());
    (Engine::with_backend(Box::new(b), cfg, vec![]).unwrap(), log)
}

#[test]
fn the_fake_reads_back_what_a_request_wrote() {
    let cfg = EngineConfig {
        block_size: 4,
        ..super::tests::config()
    };
    let (mut e, log) = engine(64, cfg);
    let prompt: Vec<u32> = (0..10).collect();
    let out = e
        .generate(vec![req(prompt.clone(), 12)], |_| {}, |_| {})
        .unwrap();
    assert_eq!(out[0].output_ids, expected(&prompt, 12));
    // One prefill step of the 10 prompt tokens, then one row per step for the 11 decodes.
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 12);
    assert_eq!(log[0], (10, 1));
    assert!(log[1..].iter().all(|&s| s == (1, 1)), "{log:?}");
}

/// `n` samples of one prompt, at temperature `t` with `seed`, running to `max_tokens`.
fn sampled(prompt: Vec<u32>, n: u32, t: f32, seed: u64, max_tokens: u32) -> Request {
    Request {
        params: SamplingParams {
            temperature: t,
            seed: Some(seed),
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
        samples: Samples { count: n, first: 0 },
        ..req(prompt, max_tokens)
    }
}

/// Every step until idle: each sample's tokens with their log-probabilities, and the pool's
/// used blocks after each step.
type Run = (
    std::collections::BTreeMap<u32, Vec<(u32, f32)>>,
    Vec<Finished>,
    Vec<usize>,
);

fn run(e: &mut Engine, r: Request) -> Run {
    e.add(RequestId(5), r).unwrap();
    let (mut tokens, mut done, mut used) = (Default::default(), Vec::new(), Vec::new());
    let tokens: &mut std::collections::BTreeMap<u32, Vec<(u32, f32)>> = &mut tokens;
    while e.has_work() {
        for ev in e.step().unwrap().0 {
            match ev {
                Event::Token(t) => {
                    assert_eq!(t.request, RequestId(5));
                    let s = &t.sampled;
                    tokens
                        .entry(t.index)
                        .or_default()
                        .push((s.token, s.logprob));
                }
                Event::Finished(f) => done.push(f),
                Event::Kv(_) => panic!("no prefill mode here"),
            }
        }
        used.push(e.stats().blocks_used);
    }
    done.sort_by_key(|f| f.index);
    (tokens.clone(), done, used)
}

#[test]
fn parallel_samples_share_the_prompt_and_each_reads_its_own_history() {
    let cfg = EngineConfig {
        block_size: 4,
        ..super::tests::config()
    };
    let (mut e, log) = engine(64, cfg.clone());
    let prompt: Vec<u32> = (0..10).collect();
    // At temperature 0.25 the fake's likeliest token (logit 1 against 0) is drawn about half
    // the time: the samples part ways at once, and each token says whether the context it
    // was drawn from is the sample's own.
    let (tokens, done, used) = run(&mut e, sampled(prompt.clone(), 4, 0.25, 7, 12));
    assert_eq!(done.len(), 4);
    let lse = (1f32.exp() + (VOCAB - 1) as f32).ln();
    let mut outputs = Vec::new();
    for (i, f) in done.iter().enumerate() {
        assert_eq!(f.index, i as u32);
        assert_eq!(f.finish_reason, FinishReason::Length);
        let toks = &tokens[&f.index];
        assert_eq!(f.output_ids, toks.iter().map(|t| t.0).collect::<Vec<_>>());
        let mut ctx = prompt.clone();
        let mut hits = 0;
        for &(t, lp) in toks {
            // The logit-1 token of the sample's own context, and no other, has this logprob.
            let likeliest = next_token(&ctx) == t;
            hits += usize::from(likeliest);
            let want = if likeliest { 1.0 - lse } else { -lse };
            assert!((lp - want).abs() < 1e-5, "sample {i}: {toks:?}");
            ctx.push(t);
        }
        assert!(
            hits > 0,
            "sample {i} never drew the likeliest token: {toks:?}"
        );
        outputs.push(f.output_ids.clone());
    }
    outputs.sort();
    outputs.dedup();
    assert_eq!(outputs.len(), 4, "four different samples");
    // One prefill of the prompt for all four.
    assert_eq!(log.lock().unwrap()[0], (10, 1));
    // The prompt's 3 blocks, shared after the fork; then each sample's tail: the 2 full
    // prompt blocks counted once, 4 copies of the partial one (3 copied, 1 kept in place).
    assert_eq!(&used[..2], &[3, 6], "{used:?}");
    assert_eq!(*used.last().unwrap(), 0, "nothing held at the end");
    // Sample 0 is what the request with n = 1 draws.
    let (mut one, _) = engine(64, cfg);
    let (_, alone, _) = run(&mut one, sampled(prompt, 1, 0.25, 7, 12));
    assert_eq!(alone[0].output_ids, done[0].output_ids);
}

#[test]
fn samples_cancelled_before_and_after_their_fork_all_finish_once() {
    let cfg = EngineConfig {
        block_size: 4,
        max_batched_tokens: 4,
        ..super::tests::config()
    };
    for cancel_at in [0, 1, 2, 3, 5] {
        let (mut e, _) = engine(64, cfg.clone());
        e.add(RequestId(1), sampled((0..10).collect(), 3, 1.0, 3, 20))
            .unwrap();
        let mut ended = Vec::new();
        let mut step = 0;
        while e.has_work() {
            if step == cancel_at {
                e.cancel(RequestId(1));
            }
            for ev in e.step().unwrap().0 {
                if let Event::Finished(f) = ev {
                    assert_eq!(f.finish_reason, FinishReason::Cancelled);
                    ended.push(f.index);
                }
            }
            step += 1;
        }
        ended.sort();
        assert_eq!(ended, vec![0, 1, 2], "cancelled at step {cancel_at}");
        assert_eq!(e.stats().blocks_used, 0);
    }
}

#[test]
fn a_stopped_sample_leaves_with_its_blocks_and_its_siblings_run_on_unchanged() {
    // Prompt chunks of 4 tokens: the 10-token prompt takes three steps, so a stop at step 0 or
    // 1 comes before the samples fork (the one computing the prompt stands for them all), at
    // step 3 or later after it.
    let cfg = EngineConfig {
        block_size: 4,
        max_batched_tokens: 4,
        ..super::tests::config()
    };
    let prompt: Vec<u32> = (0..10).collect();
    let (mut whole, _) = engine(64, cfg.clone());
    let (_, all, used_all) = run(&mut whole, sampled(prompt.clone(), 3, 0.25, 7, 20));
    for (stop_at, sample) in [
        (0usize, 0u32),
        (0, 1),
        (1, 2),
        (3, 0),
        (3, 1),
        (5, 2),
        (8, 0),
    ] {
        let (mut e, _) = engine(64, cfg.clone());
        e.add(RequestId(1), sampled(prompt.clone(), 3, 0.25, 7, 20))
            .unwrap();
        let mut done: Vec<Finished> = Vec::new();
        let mut used = Vec::new();
        let mut step = 0;
        while e.has_work() {
            if step == stop_at {
                e.stop_samples(RequestId(1), &[sample]);
            }
            if step == stop_at + 1 {
                // Again, and an index the request does not have: both are ignored.
                e.stop_samples(RequestId(1), &[sample, 9]);
            }
            for ev in e.step().unwrap().0 {
                if let Event::Finished(f) = ev {
                    done.push(f);
                }
            }
            used.push(e.stats().blocks_used);
            step += 1;
        }
        let case = format!("sample {sample} stopped at step {stop_at}");
        done.sort_by_key(|f| f.index);
        assert_eq!(
            done.iter().map(|f| f.index).collect::<Vec<_>>(),
            vec![0, 1, 2],
            "{case}: each sample finishes once"
        );
        for (f, whole) in done.iter().zip(&all) {
            if f.index == sample {
                assert_eq!(f.finish_reason, FinishReason::Stop, "{case}");
                // What it made before the stop: none before the fork.
                let made = stop_at.saturating_sub(2);
                assert_eq!(f.output_ids, whole.output_ids[..made], "{case}");
            } else {
                // The others draw exactly what they draw when no sample is stopped.
                assert_eq!(f.finish_reason, FinishReason::Length, "{case}");
                assert_eq!(f.output_ids, whole.output_ids, "{case}");
            }
        }
        assert_eq!(e.stats().blocks_used, 0, "{case}: nothing held at the end");
        if stop_at >= 3 {
            // Its tail blocks went back the step it left (the run is otherwise the same).
            assert!(
                used[stop_at] < used_all[stop_at],
                "{case}: {used:?} against {used_all:?}"
            );
        }
    }
}

#[test]
fn samples_wider_than_max_seqs_wait_their_turn() {
    let cfg = EngineConfig {
        block_size: 4,
        max_seqs: 2,
        ..super::tests::config()
    };
    let (mut e, log) = engine(64, cfg);
    let (_, done, _) = run(&mut e, sampled((0..10).collect(), 5, 0.0, 1, 6));
    let want = expected(&(0..10).collect::<Vec<_>>(), 6);
    assert_eq!(done.len(), 5);
    assert!(done.iter().all(|f| f.output_ids == want));
    assert!(log.lock().unwrap().iter().all(|&(_, seqs)| seqs <= 2));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Random arrivals, lengths, cancels, priority bands and shared prefixes over pools small
    /// enough to preempt, prompts in arrival order or shortest first:
    /// every request that runs to its end makes exactly the tokens its own history makes, no
    /// step holds more rows than the budget or more sequences than max_seqs, the pool's counts
    /// add up after every step and every block is free or cached at the end.
    #[test]
    fn the_scheduler_keeps_every_sequence_its_own_cache(
        seed in any::<u64>(),
        n in 1usize..12,
        block_size in prop::sample::select(vec![1usize, 2, 4, 16]),
        pool_tokens in 32usize..200,
        budget in 1usize..64,
        max_seqs in 1usize..8,
        lookahead in prop::sample::select(vec![0usize, 8, 64]),
        prefix_caching in any::<bool>(),
        shortest_first in any::<bool>(),
    ) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let cfg = EngineConfig {
            block_size,
            max_batched_tokens: budget,
            max_seqs,
            admission_lookahead: lookahead,
            prefix_caching,
            prefill_order: match shortest_first {
                true => PrefillOrder::Shortest,
                false => PrefillOrder::Arrival,
            },
            ..super::tests::config()
        };
        let (mut e, log) = engine(pool_tokens.div_ceil(block_size), cfg);
        let plan = random_plan(&e, &mut rng, n, 48, 40, 20, 0.15, 30);
        let (finished, _) = run_plan(&mut e, &plan, 50)?;
        for &(rows, seqs) in log.lock().unwrap().iter() {
            prop_assert!(rows <= budget, "{} rows over a budget of {}", rows, budget);
            prop_assert!(seqs <= max_seqs, "{} sequences over {}", seqs, max_seqs);
        }
        let st = e.stats();
        prop_assert_eq!(st.blocks_used, 0);
        prop_assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total);
        for (i, p) in plan.iter().enumerate() {
            let r = &p.request;
            let want = expected(&r.prompt, r.params.max_tokens as usize);
            prop_assert_eq!(finished[i].len(), r.samples.count as usize);
            for f in &finished[i] {
                match f.finish_reason {
                    FinishReason::Length => prop_assert_eq!(&f.output_ids, &want),
                    FinishReason::Cancelled => {
                        prop_assert_eq!(&f.output_ids[..], &want[..f.output_ids.len()])
                    }
                    // Only a stopped sample, and only cut short: no stop tokens were set.
                    FinishReason::Stop => {
                        prop_assert_eq!(p.stop.map(|s| s.1), Some(f.index));
                        prop_assert_eq!(&f.output_ids[..], &want[..f.output_ids.len()])
                    }
                    FinishReason::Error => prop_assert!(false, "no grammar, no error: {f:?}"),
                }
            }
        }
    }
}

mod speculation;
