//! Speculative decoding over the token cache: a proposer that knows the fake's next tokens (and
//! gets some wrong on purpose) shows that verification keeps exactly the tokens the request's
//! own history makes, gives back the blocks of rejected tokens, cuts proposals at `max_tokens`
//! and stop tokens, takes the same draws of a seeded stream as decoding without speculation, and
//! is sized by the measured cost of the steps.

use super::super::tests::{random_plan, run_plan};
use super::*;
use crate::spec::{Proposer, SpecConfig, SpecMethod};

/// Proposes the fake's own continuation, with one wrong token at a position that moves with
/// the sequence's length (`cycle`: some proposals are accepted whole, some in part, some not at
/// all), or none wrong, or the first wrong (`Wrong::First`).
#[derive(Clone, Copy)]
enum Wrong {
    Cycle,
    Never,
    First,
}

struct Oracle(Wrong);

impl Proposer for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }

    fn propose(&self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        let wrong = match self.0 {
            Wrong::Cycle => Some(tokens.len() % (k + 2)),
            Wrong::Never => None,
            Wrong::First => Some(0),
        };
        let mut ctx = tokens.to_vec();
        for j in 0..k {
            let mut t = next_token(&ctx);
            if wrong == Some(j) {
                t = (t + 1) % VOCAB as u32;
            }
            out.push(t);
            ctx.push(t);
        }
    }
}

/// An engine over a token cache of `num_blocks` that speculates `k` tokens with `oracle`.
fn speculating(num_blocks: usize, cfg: EngineConfig, k: usize, oracle: Wrong) -> (Engine, StepLog) {
    let (mut e, log) = engine(num_blocks, cfg);
    let spec = SpecConfig {
        method: SpecMethod::Ngram,
        tokens: k,
        adaptive: false,
    };
    e.set_proposer(spec, Box::new(Oracle(oracle)));
    (e, log)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// The scheduler's own property test with speculation on: random arrivals, lengths,
    /// cancels, parallel samples and shared prefixes over pools small enough to preempt, and
    /// proposals of 1 to 6 tokens accepted whole, in part or not at all: every request makes
    /// exactly the tokens its own history makes, no step holds more rows than the budget, and
    /// every block is free or cached at the end.
    #[test]
    fn speculation_keeps_every_sequence_its_own_tokens_and_blocks(
        seed in any::<u64>(),
        n in 1usize..10,
        block_size in prop::sample::select(vec![1usize, 2, 4, 16]),
        pool_tokens in 48usize..200,
        budget in 1usize..64,
        max_seqs in 1usize..8,
        k in 1usize..7,
        adaptive in any::<bool>(),
        prefix_caching in any::<bool>(),
    ) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let cfg = EngineConfig {
            block_size,
            max_batched_tokens: budget,
            max_seqs,
            admission_lookahead: 0,
            prefix_caching,
            ..super::super::tests::config()
        };
        let (mut e, log) = speculating(pool_tokens.div_ceil(block_size), cfg, k, Wrong::Cycle);
        if let Some(s) = &mut e.spec {
            s.config.adaptive = adaptive;
        }
        let plan = random_plan(&e, &mut rng, n, 40, 40, 20, 0.15, 30);
        let (finished, _) = run_plan(&mut e, &plan, 50)?;
        for &(rows, _) in log.lock().unwrap().iter() {
            prop_assert!(rows <= budget, "{} rows over a budget of {}", rows, budget);
        }
        let st = e.stats();
        prop_assert_eq!(st.blocks_used, 0);
        prop_assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total);
        prop_assert!(st.spec.accepted_tokens <= st.spec.draft_tokens);
        for (i, p) in plan.iter().enumerate() {
            let r = &p.request;
            let want = expected(&r.prompt, r.params.max_tokens as usize);
            for f in &finished[i] {
                match f.finish_reason {
                    FinishReason::Length => prop_assert_eq!(&f.output_ids, &want),
                    _ => prop_assert_eq!(&f.output_ids[..], &want[..f.output_ids.len()]),
                }
            }
        }
    }
}

#[test]
fn proposals_are_verified_in_one_step_and_counted_by_position() {
    let cfg = EngineConfig {
        block_size: 4,
        ..super::super::tests::config()
    };
    let prompt: Vec<u32> = (0..10).collect();
    let want = expected(&prompt, 21);
    // Always right, 4 a step: the prompt's step makes one token, each later step five.
    let (mut e, log) = speculating(64, cfg.clone(), 4, Wrong::Never);
    let out = e
        .generate(vec![req(prompt.clone(), 21)], |_| {}, |_| {})
        .unwrap();
    assert_eq!(out[0].output_ids, want);
    assert_eq!(
        *log.lock().unwrap(),
        [(10, 1), (5, 1), (5, 1), (5, 1), (5, 1)]
    );
    let c = e.stats().spec;
    assert_eq!((c.drafts, c.draft_tokens, c.accepted_tokens), (4, 16, 16));
    assert_eq!(c.accepted_per_position[..5], [4, 4, 4, 4, 0]);
    // Always wrong at the first: each step makes one token, as without speculation.
    let (mut e, log) = speculating(64, cfg, 4, Wrong::First);
    let out = e.generate(vec![req(prompt, 6)], |_| {}, |_| {}).unwrap();
    assert_eq!(out[0].output_ids, want[..6]);
    assert_eq!(log.lock().unwrap().len(), 6);
    let c = e.stats().spec;
    // (Proposals shrink with the room left under max_tokens: 4, 3, 2, 1, then none.)
    assert_eq!((c.drafts, c.draft_tokens, c.accepted_tokens), (4, 10, 0));
}

/// A rejected proposal's blocks go back at once: after every step the sequence holds the
/// blocks of its computed tokens and at most its last one's, though each step reserved room
/// for eight more.
#[test]
fn rejected_tokens_give_their_blocks_back() {
    let cfg = EngineConfig {
        block_size: 2,
        prefix_caching: false,
        ..super::super::tests::config()
    };
    let (mut e, _) = speculating(64, cfg, 8, Wrong::Cycle);
    let prompt: Vec<u32> = (0..5).collect();
    e.add(RequestId(1), req(prompt.clone(), 30)).unwrap();
    let mut len = prompt.len();
    while e.has_work() {
        for ev in e.step().unwrap().0 {
            if matches!(ev, Event::Token(_)) {
                len += 1;
            }
        }
        if e.has_work() {
            let held = e.stats().blocks_used;
            assert!(
                (len - 1).div_ceil(2) <= held && held <= len.div_ceil(2),
                "{held} blocks for {len} tokens"
            );
        }
    }
    assert_eq!(len, 35);
    assert_eq!(e.stats().blocks_used, 0);
    let c = e.stats().spec;
    assert!(
        c.accepted_tokens > 0 && c.accepted_tokens < c.draft_tokens,
        "{c:?}"
    );
}

#[test]
fn max_tokens_and_stop_tokens_cut_a_proposal() {
    let cfg = super::super::tests::config();
    let prompt: Vec<u32> = (0..10).collect();
    let want = expected(&prompt, 12);
    // Proposals of 8, all right: max_tokens 5 ends the output at 5 all the same.
    let (mut e, _) = speculating(64, cfg.clone(), 8, Wrong::Never);
    let out = e
        .generate(vec![req(prompt.clone(), 5)], |_| {}, |_| {})
        .unwrap();
    assert_eq!(out[0].output_ids, want[..5]);
    assert_eq!(out[0].finish_reason, FinishReason::Length);
    // A stop token inside an accepted proposal: the output ends on it.
    let at = (3..12).find(|&i| !want[..i].contains(&want[i])).unwrap();
    let stopping = Request::new(
        prompt.clone(),
        SamplingParams {
            max_tokens: 12,
            stop_token_ids: vec![want[at]],
            ..Default::default()
        }
        .validate()
        .unwrap(),
    );
    let out = e.generate(vec![stopping.clone()], |_| {}, |_| {}).unwrap();
    assert_eq!(out[0].output_ids, want[..=at]);
    assert_eq!(out[0].finish_reason, FinishReason::Stop);
    assert_eq!(out[0].logprobs.len(), at + 1);
    let (mut plain, _) = engine(64, cfg);
    let alone = plain.generate(vec![stopping], |_| {}, |_| {}).unwrap();
    assert_eq!(alone[0].output_ids, out[0].output_ids);
    assert_eq!(e.stats().blocks_used, 0);
}

/// Tokens and log-probabilities as bits, per sample.
fn bits(r: &Run) -> Vec<(u32, Vec<(u32, u32)>)> {
    r.0.iter()
        .map(|(&i, t)| (i, t.iter().map(|&(t, lp)| (t, lp.to_bits())).collect()))
        .collect()
}

/// Sampling at temperature 0.25 (the fake's likeliest token about half the time): with a
/// seed, every sample's tokens and log-probabilities are the bits decoding without speculation
/// gives, one sample or several, whatever was accepted.
#[test]
fn seeded_samples_are_the_same_bits_with_and_without_speculation() {
    let cfg = EngineConfig {
        block_size: 4,
        ..super::super::tests::config()
    };
    let prompt: Vec<u32> = (0..10).collect();
    for n in [1, 3] {
        let (mut plain, _) = engine(256, cfg.clone());
        let want = run(&mut plain, sampled(prompt.clone(), n, 0.25, 11, 40));
        let (mut e, _) = speculating(256, cfg.clone(), 4, Wrong::Never);
        let got = run(&mut e, sampled(prompt.clone(), n, 0.25, 11, 40));
        assert_eq!(bits(&got), bits(&want), "{n} samples");
        let c = e.stats().spec;
        assert!(
            c.accepted_tokens > 0 && c.accepted_tokens < c.draft_tokens,
            "{c:?}"
        );
        assert_eq!(e.stats().blocks_used, 0);
    }
}

/// The decode steps measured at 10 ms and 1 ms a row.
fn cost_10_ms_a_step_and_1_a_row(e: &mut Engine) {
    e.decode_cost = StepCost::default();
    for t in [1usize, 5, 20, 40, 80] {
        e.decode_cost.record(t, 0, 0.010 + 0.001 * t as f64);
    }
}

/// An engine proposing four tokens, always right, sized by the adaptive policy.
fn adaptive() -> Engine {
    let (mut e, _) = speculating(1024, super::super::tests::config(), 4, Wrong::Never);
    if let Some(s) = &mut e.spec {
        s.config.adaptive = true;
    }
    e
}

/// The policy against a cost of 10 ms a step and 1 ms a row: one sequence gains from its
/// first two proposed tokens at the prior's acceptance (0.5, 0.25 tokens for a millisecond
/// each against a step of 11 ms for one token), not from the third; forty sequences gain from
/// none (a row's millisecond is worth more than half a token in a step of 50 ms for forty).
#[test]
fn the_policy_verifies_proposals_only_where_they_pay() {
    let cfg = EngineConfig {
        max_seqs: 64,
        ..super::super::tests::config()
    };
    for (seqs, verified, withheld) in [(1u64, 2u64, 2u64), (40, 0, 160)] {
        let (mut e, _) = speculating(1024, cfg.clone(), 4, Wrong::Never);
        if let Some(s) = &mut e.spec {
            s.config.adaptive = true;
        }
        for i in 0..seqs {
            e.add(RequestId(i), req(vec![1 + i as u32, 2, 3], 20))
                .unwrap();
        }
        e.step().unwrap();
        cost_10_ms_a_step_and_1_a_row(&mut e);
        e.step().unwrap();
        let c = e.stats().spec;
        assert_eq!(
            (c.draft_tokens, c.withheld_tokens),
            (verified, withheld),
            "{seqs} sequences: {c:?}"
        );
    }
}

/// A proposer's speculation is checked by its outcome as a draft model's is: at a batch size
/// where steps that speculated were measured to make tokens more slowly than plain ones, the
/// steps decode plainly whatever the policy's cost model expects (here every proposal pays by
/// it: always accepted, 10 ms a step and 1 ms a row); where they were measured faster, they
/// verify what is proposed.
#[test]
fn a_proposer_s_speculation_is_checked_by_its_outcome() {
    use super::super::spec_ab::{Arm, WARM};
    for (spec_rate, plain_rate) in [(1.0, 1000.0), (1000.0, 1.0)] {
        let mut e = adaptive();
        e.add(RequestId(0), req(vec![1, 2, 3], 40)).unwrap();
        e.step().unwrap();
        // The batch of one past its first tries of each arm, each arm measured.
        if let Some(s) = &mut e.spec {
            for _ in 0..2 * WARM {
                s.ab.arm(1);
            }
            s.ab.record(1, Arm::Speculate, 1, 1.0 / spec_rate);
            s.ab.record(1, Arm::Plain, 1, 1.0 / plain_rate);
        }
        for _ in 0..4 {
            // (Pinned again before each step: a step records its measured time into the
            // cost model, and a stalled one could make the next withhold every proposal.)
            cost_10_ms_a_step_and_1_a_row(&mut e);
            e.step().unwrap();
        }
        let c = e.stats().spec;
        match spec_rate > plain_rate {
            true => assert!(c.draft_tokens >= 4 && c.plain_steps == 0, "{c:?}"),
            false => assert_eq!((c.draft_tokens, c.plain_steps), (0, 4), "{c:?}"),
        }
    }
}

/// A model's draft forward reads its weights whoever drafts: the sequences that draft share its
/// fixed part. At 10 ms a decode step and 0.2 ms a row, and 4 ms a draft forward and 0.05 ms a
/// row, eight sequences whose proposals are always accepted each draft (a token costs 0.75 ms
/// with the forward shared eight ways), while one such sequence beside seven whose proposals
/// never are drafts nothing: alone it would pay the whole forward, 4.25 ms a token, though
/// priced as if all eight drafted (0.75 ms) it would have kept all four.
#[test]
fn drafting_sequences_share_a_draft_forward_s_fixed_part() {
    let good = super::super::speculate::Acceptance::after(4, &[4; 12]);
    let bad = super::super::speculate::Acceptance::after(4, &[0; 12]);
    for (bad_ones, drafting) in [(0usize, 8usize), (7, 0)] {
        let mut e = adaptive();
        for i in 0..8u64 {
            e.add(RequestId(i), req(vec![1 + i as u32, 2, 3], 40))
                .unwrap();
        }
        e.step().unwrap();
        assert!(e.running.iter().all(|s| s.pending() == 1));
        e.decode_cost = StepCost::default();
        e.draft_cost = StepCost::default();
        for t in [1usize, 2, 4, 8, 16, 40] {
            e.decode_cost.record(t, 0, 0.010 + 0.0002 * t as f64);
            e.draft_cost.record(t, 0, 0.004 + 0.00005 * t as f64);
        }
        for (i, s) in e.running.iter_mut().enumerate() {
            s.accept = if i < bad_ones { bad } else { good };
        }
        let keep = e.size_drafts(vec![4; 8], 0.1, &[]);
        assert_eq!(
            keep.iter().filter(|&&k| k > 0).count(),
            drafting,
            "{bad_ones} never accepted: {keep:?}"
        );
    }
}

/// The policy weighs each position by its own acceptance: a sequence whose first proposed token
/// was accepted every other time, but whose later ones always were once reached (pooled
/// estimate 0.67; first position 0.44, then 0.88, 0.91, 0.93), verifies all four of its
/// tokens at 10 ms a step and 1 ms a row; by the pooled estimate alone the fourth would not
/// pay (0.67⁴ = 0.20 of a token for a millisecond, where the step makes 2.43 tokens in 14 ms
/// and the margin asks 1.25 times that rate).
#[test]
fn the_policy_weighs_each_position_by_its_own_acceptance() {
    let history = super::super::speculate::Acceptance::after(4, &[4, 0, 4, 0, 4, 0, 4, 0]);
    for (accept, verified) in [(history, 4u64), (history.pooled_only(), 3)] {
        let mut e = adaptive();
        e.add(RequestId(0), req(vec![1, 2, 3], 20)).unwrap();
        e.step().unwrap();
        cost_10_ms_a_step_and_1_a_row(&mut e);
        e.running[0].accept = accept;
        e.step().unwrap();
        let c = e.stats().spec;
        assert_eq!(
            (c.draft_tokens, c.withheld_tokens),
            (verified, 4 - verified),
            "{accept:?}: {c:?}"
        );
    }
}

/// A sequence starts from the worker's recent acceptance: on a worker whose earlier requests
/// had every proposed token accepted, a new request's first proposal is verified whole (four
/// tokens at 10 ms a step and 1 ms a row), where a fresh worker's prior (0.5 at every position)
/// verifies two.
#[test]
fn a_sequence_starts_from_the_worker_s_recent_acceptance() {
    let first_proposal = |warm_up: u64| {
        let mut e = adaptive();
        let earlier: Vec<Request> = (0..warm_up)
            .map(|i| req(vec![9 + i as u32, 2, 3], 200))
            .collect();
        // The earlier requests verify every proposal whole: under the adaptive policy, what
        // they verify would follow the step-against-step check's and the cost model's
        // measures of the fake's microseconds, which a busy machine changes (plain steps
        // measured faster, fewer verifications, a lower recent acceptance).
        let adapt = |e: &mut Engine, on: bool| {
            if let Some(s) = &mut e.spec {
                s.config.adaptive = on;
            }
        };
        adapt(&mut e, false);
        e.generate(earlier, |_| {}, |_| {}).unwrap();
        adapt(&mut e, true);
        let recent = e.spec.as_ref().map(|s| s.recent.at(3)).unwrap();
        e.add(RequestId(99), req(vec![1, 2, 3], 20)).unwrap();
        e.step().unwrap();
        cost_10_ms_a_step_and_1_a_row(&mut e);
        let before = e.stats().spec.draft_tokens;
        e.step().unwrap();
        (e.stats().spec.draft_tokens - before, recent)
    };
    assert_eq!(first_proposal(0), (2, 0.5));
    let (verified, recent) = first_proposal(6);
    assert!(recent > 0.9, "{recent}");
    assert_eq!(verified, 4);
}

/// A self-draft needs a backend that can stop after some layers, and fewer layers than the
/// model has: anything else is refused when the engine is made, saying why.
#[test]
fn a_self_draft_is_refused_where_it_cannot_run() {
    let draft = |n| EngineConfig {
        speculative: Some(SpecConfig::new(SpecMethod::SelfDraft(n), 4)),
        ..super::super::tests::config()
    };
    let fake = |cfg: EngineConfig| {
        let b = TokenCache::new(16, cfg.block_size, 512, Default::default());
        Engine::with_backend(Box::new(b), cfg, vec![])
    };
    let e = fake(draft(1))
        .err()
        .expect("the token cache cannot stop early");
    assert!(e.to_string().contains("self:1"), "{e}");
    assert!(e.to_string().contains("early exit"), "{e}");
    let model = crate::device::cpu::tiny_model(1);
    let layers = model.config.num_layers;
    let e = Engine::new(model, draft(layers), vec![])
        .err()
        .expect("as many layers as the model");
    assert!(
        e.to_string()
            .contains(&format!("fewer than the model's {layers} layers")),
        "{e}"
    );
    let model = crate::device::cpu::tiny_model(1);
    assert!(Engine::new(model, draft(layers - 1), vec![]).is_ok());
}
