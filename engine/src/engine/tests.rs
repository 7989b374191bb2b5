use super::*;
use crate::device::cpu::tiny_model;
use crate::kv_cache::KvDtype;
use crate::sampler::Sampled;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use tandem_types::SamplingParams;

/// A greedy request that runs to `max_tokens`.
pub(crate) fn req(prompt: Vec<u32>, max_tokens: u32) -> Request {
    Request::greedy(prompt, max_tokens).unwrap()
}

pub(crate) fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(tiny_model(1), cfg, vec![]).unwrap()
}

/// The defaults with a pool sized for the tiny model (still thousands of blocks): the
/// default gigabyte would be faulted in by every engine a test makes.
pub(crate) fn config() -> EngineConfig {
    EngineConfig {
        kv_cache_mb: 16,
        ..EngineConfig::default()
    }
}

#[test]
fn step_stats_count_the_work_of_each_step() {
    // Two prompts of 5 and 3 tokens, a 4-token budget: step 1 prefills 4 of the first; step
    // 2 its last token (which samples) and 3 of the second, which samples too; then both
    // decode together.
    let mut e = engine(EngineConfig {
        max_batched_tokens: 4,
        ..config()
    });
    let mut steps = Vec::new();
    e.generate(
        vec![req(vec![3, 4, 5, 6, 7], 2), req(vec![8, 9, 10], 2)],
        |_| {},
        |s| steps.push(*s),
    )
    .unwrap();
    let got: Vec<_> = steps
        .iter()
        .map(|s| {
            (
                s.prefill_tokens,
                s.decode_tokens,
                s.logit_rows,
                s.attended_keys,
                s.context_tokens,
            )
        })
        .collect();
    // Keys: a row at position p sees p + 1. Step 1: 1+2+3+4. Step 2: the first prompt's
    // last row sees 5, the second prompt's rows 1, 2 and 3. Step 3: positions 5 and 3 see 6
    // and 4.
    assert_eq!(
        got,
        vec![
            (4, 0, 0, 10, 4),
            (4, 0, 2, 5 + 6, 5 + 3),
            (0, 2, 2, 6 + 4, 6 + 4)
        ]
    );
}

#[test]
fn stats_tell_the_queued_prompt_work_and_the_measured_speed() {
    let mut e = engine(EngineConfig {
        max_batched_tokens: 4,
        ..config()
    });
    assert_eq!(
        e.stats().prefill_tokens_per_s,
        0.0,
        "nothing measured before the first step"
    );
    e.add(RequestId(1), req(vec![3, 4, 5, 6, 7], 2)).unwrap();
    e.add(RequestId(2), req(vec![8, 9, 10], 2)).unwrap();
    assert_eq!(e.stats().pending_prompt_tokens, 8);
    let (_, step) = e.step().unwrap();
    assert_eq!(step.prefill_tokens, 4);
    let s = e.stats();
    assert_eq!(s.pending_prompt_tokens, 4, "4 of the first prompt computed");
    assert!(step.seconds > 0.0);
    assert_eq!(s.prefill_tokens_per_s, 4.0 / step.seconds);
    e.step().unwrap();
    assert_eq!(e.stats().pending_prompt_tokens, 0);
}

/// Runs `e` until `id` finishes; its output tokens after `first`.
fn run_to_end(e: &mut Engine, id: RequestId) -> Vec<u32> {
    let mut out = Vec::new();
    loop {
        let (events, _) = e.step().unwrap();
        for ev in events {
            match ev {
                Event::Token(t) if t.request == id => out.push(t.sampled.token),
                Event::Finished(f) if f.request == id => return out,
                _ => {}
            }
        }
    }
}

/// Runs `r` in prefill mode on `e`: its first token and the KV chunks it emitted, in order.
fn prefill_export(e: &mut Engine, r: Request, skip: usize) -> (Sampled, Vec<KvChunk>) {
    let id = RequestId(1000);
    e.add_prefill(id, r, skip).unwrap();
    let (mut first, mut chunks) = (None, Vec::new());
    while e.has_work() {
        for ev in e.step().unwrap().0 {
            match ev {
                Event::Kv(c) => {
                    assert!(first.is_none(), "blocks come before the token");
                    chunks.push(c);
                }
                Event::Token(t) => first = Some(t.sampled),
                Event::Finished(f) => assert_eq!(f.output_ids.len(), 1),
            }
        }
    }
    (first.expect("a first token"), chunks)
}

/// Writes a prefill side's chunks into the reservation's blocks of `e`'s pool; checks they
/// cover every reserved block once, in order.
fn fill(e: &Engine, r: &Reservation, chunks: &[KvChunk]) {
    let w = e.kv_pool().expect("a CPU engine").writer();
    let mut next = 0;
    for c in chunks {
        assert_eq!(c.first, next);
        for j in 0..c.blocks {
            for layer in 0..c.layers() {
                let b = r.blocks[c.first + j];
                let frame = c.pieces[0].frame(layer, j);
                // SAFETY: reserved for a remote prefill: the engine does not touch these blocks.
                unsafe { w.write(layer, b.index(), frame).unwrap() };
            }
        }
        next += c.blocks;
    }
    assert_eq!(next, r.blocks.len());
}

#[test]
fn a_remotely_prefilled_request_decodes_like_a_local_one() {
    let prompt: Vec<u32> = (0..45).map(|t| (t * 11 + 5) % 97).collect();
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
        let cfg = EngineConfig {
            kv_dtype: dtype,
            ..config()
        };
        let want = engine(cfg.clone())
            .generate(vec![req(prompt.clone(), 10)], |_| {}, |_| {})
            .unwrap()[0]
            .output_ids
            .clone();
        let mut prefill = engine(cfg.clone());
        let mut decode = engine(cfg.clone());
        let id = RequestId(7);
        let r = decode
            .reserve_remote(id, req(prompt.clone(), 10))
            .unwrap()
            .expect("room");
        assert_eq!(r.cached_tokens, 0);
        assert_eq!(r.blocks.len(), 3, "45 tokens in 16-token blocks");
        let (first, kv) = prefill_export(&mut prefill, req(prompt.clone(), 10), 0);
        fill(&decode, &r, &kv);
        let ev = decode.join_remote(id, first.clone(), 0).unwrap();
        assert!(matches!(&ev[..], [Event::Token(t)] if t.sampled.token == want[0]));
        let mut got = vec![first.token];
        got.extend(run_to_end(&mut decode, id));
        assert_eq!(got, want, "{dtype:?}");
        check_counts(&decode);
        assert_eq!(decode.stats().blocks_used, 0);
    }
}

/// An engine on the tiny model whose pool is reached only through the host fake of a device,
/// copies completing `ms` late.
fn on_fake_device(cfg: EngineConfig, ms: u64) -> Engine {
    let cpu = CpuBackend::new(tiny_model(1), &cfg.pool()).unwrap();
    let b = crate::device::fake::FakeDeviceBackend::new(
        Box::new(cpu),
        std::time::Duration::from_millis(ms),
    )
    .unwrap();
    Engine::with_backend(Box::new(b), cfg, vec![]).unwrap()
}

/// The staging paths a GPU worker's KV takes, on the host fake: a prefill engine whose pool is
/// behind the device exports the same chunks, byte for byte, as one over a host pool (in
/// chunked prefill, so several chunks); a decode engine behind the device takes them through a
/// DeviceSink (settled before it joins) and decodes what a local prefill does; neither leaks a
/// block.
#[test]
fn a_device_pool_exports_and_imports_kv_through_staging_exactly() {
    use tandem_kv_transfer::BlockSink;
    let prompt: Vec<u32> = (0..45).map(|t| (t * 13 + 2) % 97).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let cfg = EngineConfig {
            kv_dtype: dtype,
            max_batched_tokens: 20,
            ..config()
        };
        let want = engine(cfg.clone())
            .generate(vec![req(prompt.clone(), 10)], |_| {}, |_| {})
            .unwrap()[0]
            .output_ids
            .clone();
        let (first_host, host) =
            prefill_export(&mut engine(cfg.clone()), req(prompt.clone(), 10), 0);
        let mut prefill = on_fake_device(cfg.clone(), 2);
        assert!(prefill.kv_pool().is_none());
        let (first, kv) = prefill_export(&mut prefill, req(prompt.clone(), 10), 0);
        assert_eq!(first.token, first_host.token);
        assert_eq!(kv.len(), host.len());
        assert!(kv.len() >= 3, "chunked: {} chunks", kv.len());
        for (a, b) in kv.iter().zip(&host) {
            assert_eq!((a.first, a.blocks, a.pieces.len()), (b.first, b.blocks, 1));
            assert_eq!(a.pieces[0].heads, b.pieces[0].heads);
            assert_eq!(a.pieces[0].layers, b.pieces[0].layers, "{dtype:?}");
        }
        assert_eq!(prefill.stats().blocks_used, 0);

        let mut decode = on_fake_device(cfg.clone(), 2);
        let dev = decode.backend().device_kv().expect("a device pool");
        // SAFETY: the blocks written are the reservation's, which the engine leaves alone.
        let sink = unsafe { crate::DeviceSink::new(dev) };
        let id = RequestId(9);
        let r = decode
            .reserve_remote(id, req(prompt.clone(), 10))
            .unwrap()
            .expect("room");
        for c in &kv {
            for j in 0..c.blocks {
                for layer in 0..c.layers() {
                    sink.write(
                        layer as u32,
                        r.blocks[c.first + j],
                        c.pieces[0].frame(layer, j),
                    );
                }
            }
        }
        sink.settle(&r.blocks).unwrap();
        decode.join_remote(id, first.clone(), 0).unwrap();
        let mut got = vec![first.token];
        got.extend(run_to_end(&mut decode, id));
        assert_eq!(got, want, "{dtype:?}");
        check_counts(&decode);
        assert_eq!(decode.stats().blocks_used, 0);
    }
}

#[test]
fn remotely_prefilled_parallel_samples_fork_on_the_decode_side() {
    // Greedy, so every sample is the local answer; the decode side computes the prompt's last
    // token again (the logits the samples draw from) and forks there.
    let prompt: Vec<u32> = (0..45).map(|t| (t * 13 + 2) % 97).collect();
    let want = engine(config())
        .generate(vec![req(prompt.clone(), 8)], |_| {}, |_| {})
        .unwrap()[0]
        .output_ids
        .clone();
    let (mut prefill, mut decode) = (engine(config()), engine(config()));
    let id = RequestId(9);
    let three = Request {
        samples: Samples { count: 3, first: 0 },
        ..req(prompt.clone(), 8)
    };
    let r = decode.reserve_remote(id, three).unwrap().expect("room");
    let (first, kv) = prefill_export(&mut prefill, req(prompt.clone(), 8), 0);
    fill(&decode, &r, &kv);
    assert!(decode.join_remote(id, first, 0).unwrap().is_empty());
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let mut ended = 0;
    let mut steps = 0;
    while decode.has_work() {
        let (events, st) = decode.step().unwrap();
        if steps == 0 {
            assert_eq!(st.prefill_tokens, 1, "only the last prompt token again");
        }
        steps += 1;
        for ev in events {
            match ev {
                Event::Token(t) => got[t.index as usize].push(t.sampled.token),
                Event::Finished(f) => {
                    assert_eq!(f.output_ids, got[f.index as usize]);
                    ended += 1;
                }
                Event::Kv(_) => panic!("not prefill mode"),
            }
        }
    }
    assert_eq!(ended, 3);
    assert!(got.iter().all(|g| *g == want), "{got:?} vs {want:?}");
    check_counts(&decode);
    assert_eq!(decode.stats().blocks_used, 0);
}

#[test]
fn a_remote_prefill_sends_only_what_the_decode_cache_lacks() {
    let prompt: Vec<u32> = (0..50).map(|t| (t * 7 + 3) % 97).collect();
    let want = engine(config())
        .generate(vec![req(prompt.clone(), 8)], |_| {}, |_| {})
        .unwrap()[0]
        .output_ids
        .clone();
    let mut decode = engine(config());
    // An earlier conversation turn left the first 40 tokens (two full blocks) cached.
    decode
        .generate(vec![req(prompt[..40].to_vec(), 1)], |_| {}, |_| {})
        .unwrap();
    let id = RequestId(9);
    let r = decode
        .reserve_remote(id, req(prompt.clone(), 8))
        .unwrap()
        .unwrap();
    assert_eq!(r.cached_tokens, 32);
    assert_eq!(r.blocks.len(), 2, "tokens 32..50");
    // The prefill side chunks the prompt (8-token budget) and has a prefix of its own
    // cached (24 tokens: one full block), so blocks come out in several chunks.
    let mut prefill = engine(EngineConfig {
        max_batched_tokens: 8,
        ..config()
    });
    prefill
        .generate(vec![req(prompt[..24].to_vec(), 1)], |_| {}, |_| {})
        .unwrap();
    let (first, kv) = prefill_export(&mut prefill, req(prompt.clone(), 8), r.cached_tokens);
    assert!(kv.len() >= 2, "streamed per chunk: {}", kv.len());
    fill(&decode, &r, &kv);
    decode.join_remote(id, first.clone(), 0).unwrap();
    let mut got = vec![first.token];
    got.extend(run_to_end(&mut decode, id));
    assert_eq!(got, want);
    for bad in [8, 50, 64] {
        assert!(
            prefill
                .add_prefill(RequestId(1), req(prompt.clone(), 8), bad)
                .is_err(),
            "skip {bad}: not a block multiple below the prompt length"
        );
    }
}

#[test]
fn a_failed_transfer_falls_back_to_a_local_prefill_and_cancel_frees_reservations() {
    let prompt: Vec<u32> = (0..30).map(|t| (t * 5 + 1) % 97).collect();
    let want = engine(config())
        .generate(vec![req(prompt.clone(), 6)], |_| {}, |_| {})
        .unwrap()[0]
        .output_ids
        .clone();
    let mut decode = engine(config());
    let id = RequestId(3);
    let r = decode
        .reserve_remote(id, req(prompt.clone(), 6))
        .unwrap()
        .unwrap();
    // A broken transfer left garbage in the blocks.
    let kv = decode.kv_pool().expect("a CPU engine");
    let frame_len = KvPool::frame_bytes(kv.layout, kv.dtype);
    let layers = kv.num_layers;
    let junk = KvChunk {
        request: id,
        first: 0,
        blocks: r.blocks.len(),
        pieces: vec![KvPiece {
            heads: 0..kv.layout.num_kv_heads as u32,
            layers: vec![vec![0x7fu8; frame_len * r.blocks.len()]; layers],
            frame_len,
        }],
    };
    fill(&decode, &r, &[junk]);
    assert!(decode.prefill_locally(id));
    assert_eq!(run_to_end(&mut decode, id), want);
    check_counts(&decode);
    assert_eq!(decode.stats().blocks_used, 0);

    let id2 = RequestId(4);
    decode.reserve_remote(id2, req(prompt, 6)).unwrap().unwrap();
    assert!(decode.stats().blocks_used > 0);
    decode.cancel(id2);
    let (events, _) = decode.step().unwrap();
    assert!(
        matches!(&events[..], [Event::Finished(f)] if f.finish_reason == FinishReason::Cancelled)
    );
    assert_eq!(decode.stats().blocks_used, 0);
    check_counts(&decode);
}

#[test]
fn a_resumed_request_continues_exactly_where_the_first_run_stopped() {
    let prompt: Vec<u32> = (0..21).map(|t| (t * 13 + 2) % 97).collect();
    let sampled = |resume: Vec<u32>| seeded_resumed(&prompt, 42, resume);
    let full = uninterrupted(sampled(vec![]));
    assert_eq!(full.len(), 14);
    for k in [1, 6, 13] {
        let got = engine(config())
            .generate(vec![sampled(full[..k].to_vec())], |_| {}, |_| {})
            .unwrap()[0]
            .output_ids
            .clone();
        assert_eq!(got, full, "resumed after {k} tokens");
    }
    let e = engine(config());
    assert!(e.validate(&sampled(full.clone())).is_err(), "nothing left");
    assert!(e.validate(&sampled(vec![500])).is_err(), "bad token");
}

/// A resumed request whose KV (its prompt and the tokens streamed before the move) comes from
/// another engine: the last streamed token is computed again here and the stream goes on with
/// the tokens of the run that was never moved (seeded sampling with a penalty: the sampler knows
/// the streamed tokens).
#[test]
fn a_resumed_request_takes_its_kv_from_elsewhere_and_continues_exactly() {
    let prompt: Vec<u32> = (0..37).map(|t| (t * 11 + 3) % 97).collect();
    let sampled = |resume: Vec<u32>| seeded_resumed(&prompt, 7, resume);
    let full = uninterrupted(sampled(vec![]));
    for k in [1, 6, 13] {
        let mut decode = engine(config());
        let id = RequestId(5);
        let r = decode
            .reserve_remote(id, sampled(full[..k].to_vec()))
            .unwrap()
            .unwrap();
        // The holder computes (or finds) the KV of every token streamed so far.
        let held: Vec<u32> = prompt.iter().chain(&full[..k]).copied().collect();
        let mut holder = engine(config());
        let (first, kv) = prefill_export(&mut holder, req(held, 1), r.cached_tokens);
        fill(&decode, &r, &kv);
        let events = decode.join_remote(id, first, r.cached_tokens).unwrap();
        assert!(events.is_empty(), "the holder's token is not used");
        assert_eq!(run_to_end(&mut decode, id), full[k..], "resumed after {k}");
        check_counts(&decode);
        assert_eq!(decode.stats().blocks_used, 0);
    }
}

/// A drain hands a running sequence over: the engine that resumes it pulls every token's K/V
/// from the one that ran it (whole blocks from the prefix cache, the partly filled last one
/// parked), which computes only the last streamed token, never computed before; the blocks
/// are the bits a fresh computation gives, and the seeded continuation is the uninterrupted
/// run's.
#[test]
fn a_handed_off_sequence_is_pulled_with_nothing_computed_again() {
    let prompt: Vec<u32> = (0..37).map(|t| (t * 11 + 3) % 97).collect();
    let sampled = |resume: Vec<u32>| seeded_resumed(&prompt, 7, resume);
    let full = uninterrupted(sampled(vec![]));
    let k = 6;
    // The worker that drains: the request runs until it has streamed k tokens.
    let mut old = engine(config());
    let id = RequestId(5);
    old.add(id, sampled(vec![])).unwrap();
    let mut streamed = Vec::new();
    while streamed.len() < k {
        for ev in old.step().unwrap().0 {
            if let Event::Token(t) = ev {
                streamed.push(t.sampled.token);
            }
        }
    }
    assert_eq!(streamed, full[..k]);
    assert_eq!(old.hand_off(), vec![id]);
    assert!(!old.has_work());
    // 37 + 5 tokens computed: two whole blocks of 16 cached, ten tokens parked.
    assert_eq!(old.stats().parked_tails, (1, 0));
    // The worker that takes it over holds nothing; it pulls from the old one.
    let mut new = engine(config());
    let r = new
        .reserve_remote(id, sampled(streamed.clone()))
        .unwrap()
        .unwrap();
    assert_eq!(r.cached_tokens, 0);
    let held: Vec<u32> = prompt.iter().chain(&streamed).copied().collect();
    let before = old.stats().prefix_hit_tokens;
    let (first, kv) = prefill_export(&mut old, req(held.clone(), 1), r.cached_tokens);
    let held_by_old = (old.stats().prefix_hit_tokens - before) as usize;
    assert_eq!(
        held_by_old,
        held.len() - 1,
        "all but the last streamed token found"
    );
    assert_eq!(old.stats().parked_tails, (1, 1));
    // The bits of a computation from scratch.
    let (_, fresh) = prefill_export(&mut engine(config()), req(held.clone(), 1), 0);
    let frames = |chunks: &[KvChunk]| -> Vec<Vec<u8>> {
        chunks
            .iter()
            .flat_map(|c| {
                (0..c.blocks).flat_map(move |j| {
                    (0..c.layers()).map(move |l| c.pieces[0].frame(l, j).to_vec())
                })
            })
            .collect()
    };
    assert_eq!(frames(&kv), frames(&fresh));
    fill(&new, &r, &kv);
    assert!(new.join_remote(id, first, held_by_old).unwrap().is_empty());
    assert_eq!(run_to_end(&mut new, id), full[k..]);
    assert_eq!(new.stats().blocks_used, 0);
    // Every token's K/V moved: none computed again.
    let moved = ResumedCounts {
        requests: 1,
        context_tokens: held.len() as u64 - 1,
        recomputed_tokens: 0,
    };
    assert_eq!(new.stats().resumed, moved);
    // The parked tail is let go; nothing stays held.
    old.block_manager().release_tails();
    assert_eq!(old.stats().blocks_used, 0);
    check_counts(&old);
}

/// What `r` generates on a fresh engine, run to its end without a move.
fn uninterrupted(r: Request) -> Vec<u32> {
    engine(config())
        .generate(vec![r], |_| {}, |_| {})
        .unwrap()
        .remove(0)
        .output_ids
}

/// 14 tokens after `prompt` at temperature 0.9 with `seed` and a frequency penalty, resumed
/// after `resume` (the tokens a first run streamed).
fn seeded_resumed(prompt: &[u32], seed: u64, resume: Vec<u32>) -> Request {
    let params = SamplingParams {
        max_tokens: 14,
        temperature: 0.9,
        seed: Some(seed),
        frequency_penalty: 0.5,
        ignore_eos: true,
        ..Default::default()
    };
    Request {
        resume,
        ..Request::new(prompt.to_vec(), params.validate().unwrap())
    }
}

fn check_counts(e: &Engine) {
    let st = e.stats();
    assert_eq!(
        st.blocks_free + st.blocks_cached + st.blocks_used,
        st.blocks_total,
        "{st:?}"
    );
}

/// One request of a [`Plan`]: the step it arrives at and, for some, a step to cancel it at or
/// a step to stop one of its samples at (what a stop string found by the caller does).
#[derive(Clone, Debug)]
pub(crate) struct Planned {
    pub arrive: usize,
    pub cancel: Option<usize>,
    pub stop: Option<(usize, u32)>,
    pub request: Request,
}

/// Requests in arrival order.
pub(crate) type Plan = Vec<Planned>;

/// Up to `n` greedy requests the engine takes (prompts of fewer than `max_prompt` tokens from a
/// three-token alphabet, so prefixes are shared often; fewer than `max_out` output tokens; half
/// of them in priority bands from -2 to 2),
/// arriving within `arrive_within` steps, a `cancel_p` share of them cancelled within
/// `cancel_within` steps of arriving, and the same share of those with parallel samples having
/// one sample stopped within that time.
#[allow(clippy::too_many_arguments)]
pub(crate) fn random_plan(
    e: &Engine,
    rng: &mut impl Rng,
    n: usize,
    max_prompt: usize,
    max_out: u32,
    arrive_within: usize,
    cancel_p: f64,
    cancel_within: usize,
) -> Plan {
    let mut plan = Vec::new();
    for _ in 0..n {
        let len = rng.gen_range(1..max_prompt);
        let prompt: Vec<u32> = (0..len).map(|_| rng.gen_range(0..3)).collect();
        let mut r = req(prompt, rng.gen_range(1..max_out));
        // One request in four has parallel samples (greedy: each one's tokens are the
        // request's own, so a sample that reads another's K/V shows).
        if rng.gen_bool(0.25) {
            r.samples.count = rng.gen_range(2..5);
        }
        // Half in a band of their own (tenants' priorities): a higher band is admitted first
        // and preempted last, so a step's plan need not follow the running set's order.
        if rng.gen_bool(0.5) {
            r.priority = rng.gen_range(-2..=2);
        }
        if e.validate(&r).is_err() {
            continue;
        }
        let arrive = rng.gen_range(0..arrive_within);
        let cancel = rng
            .gen_bool(cancel_p)
            .then(|| arrive + rng.gen_range(0..cancel_within));
        let stop = (r.samples.count > 1 && rng.gen_bool(cancel_p)).then(|| {
            (
                arrive + rng.gen_range(0..cancel_within),
                rng.gen_range(0..r.samples.count),
            )
        });
        plan.push(Planned {
            arrive,
            cancel,
            stop,
            request: r,
        });
    }
    plan
}

/// Per request of a plan, per sample: what a run gave.
pub(crate) type PerSample<T> = Vec<Vec<T>>;

/// Steps `e` through `plan` (at least `min_steps` steps, then until it is idle), checking after
/// every step that the pool's block counts add up: each request's samples' ends and streamed
/// tokens, in the plan's order. Fails when a sample ends twice or never, or the engine stops
/// progressing.
pub(crate) fn run_plan(
    e: &mut Engine,
    plan: &Plan,
    min_steps: usize,
) -> Result<(PerSample<Finished>, PerSample<Vec<u32>>), TestCaseError> {
    let width = |p: &Planned| p.request.samples.count as usize;
    let mut finished: PerSample<Option<Finished>> =
        plan.iter().map(|p| vec![None; width(p)]).collect();
    let mut tokens: PerSample<Vec<u32>> = plan.iter().map(|p| vec![Vec::new(); width(p)]).collect();
    let mut step = 0;
    while step < min_steps || e.has_work() {
        for (i, p) in plan.iter().enumerate() {
            if p.arrive == step {
                e.add(RequestId(i as u64), p.request.clone()).unwrap();
            }
            if p.cancel == Some(step) {
                e.cancel(RequestId(i as u64));
            }
            if let Some((_, sample)) = p.stop.filter(|&(at, _)| at == step) {
                e.stop_samples(RequestId(i as u64), &[sample]);
            }
        }
        let (events, _) = e.step().unwrap();
        let st = e.stats();
        prop_assert_eq!(
            st.blocks_free + st.blocks_cached + st.blocks_used,
            st.blocks_total,
            "{:?}",
            st
        );
        for ev in events {
            match ev {
                Event::Token(t) => {
                    tokens[t.request.0 as usize][t.index as usize].push(t.sampled.token)
                }
                Event::Kv(_) => prop_assert!(false, "no prefill-mode requests here"),
                Event::Finished(f) => {
                    let slot = &mut finished[f.request.0 as usize][f.index as usize];
                    prop_assert!(slot.is_none(), "finished twice");
                    *slot = Some(f);
                }
            }
        }
        step += 1;
        prop_assert!(step < 10_000, "no progress");
    }
    let finished = finished
        .into_iter()
        .map(|samples| {
            samples
                .into_iter()
                .map(|f| {
                    f.ok_or_else(|| {
                        TestCaseError::fail("a sample neither finished nor was cancelled")
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<_, _>>()?;
    Ok((finished, tokens))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random arrivals, lengths and cancels over a pool small enough to force preemption, under
    /// either scheduling policy:
    /// block states always add up, nothing leaks, every request finishes or is cancelled,
    /// and every request that ran to the end produced the tokens it produces alone.
    #[test]
    fn scheduler_serves_everything_without_leaks(
        seed in any::<u64>(),
        n in 1usize..10,
        block_size in prop::sample::select(vec![1usize, 4, 16]),
        pool_tokens in 48usize..160,
        budget in 3usize..48,
        max_seqs in 1usize..6,
        lookahead in prop::sample::select(vec![0usize, 8, 64]),
        static_size in prop::option::of(1usize..4),
    ) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let cfg = EngineConfig {
            block_size,
            num_blocks: Some(pool_tokens.div_ceil(block_size)),
            max_batched_tokens: budget,
            max_seqs,
            admission_lookahead: lookahead,
            ..config()
        };
        let mut e = engine(cfg.clone());
        // The default policy, or static batches of a few requests.
        if let Some(size) = static_size {
            e.set_scheduler(Box::new(StaticBatches::new(size)));
        }
        let plan = random_plan(&e, &mut rng, n, 40, 24, 15, 0.2, 20);
        let (finished, tokens) = run_plan(&mut e, &plan, 40)?;
        let st = e.stats();
        prop_assert_eq!(st.blocks_used, 0);
        prop_assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total);
        let mut alone = engine(config());
        for (i, p) in plan.iter().enumerate() {
            let r = &p.request;
            for (f, streamed) in finished[i].iter().zip(&tokens[i]) {
                prop_assert_eq!(&f.output_ids, streamed, "stream and result agree");
                match f.finish_reason {
                    FinishReason::Cancelled => {
                        prop_assert!(f.output_ids.len() <= r.params.max_tokens as usize)
                    }
                    FinishReason::Error => prop_assert!(false, "no grammar, no error: {f:?}"),
                    FinishReason::Stop => {
                        prop_assert_eq!(p.stop.map(|s| s.1), Some(f.index), "only the stopped one");
                        prop_assert!(f.output_ids.len() <= r.params.max_tokens as usize)
                    }
                    FinishReason::Length => {
                        prop_assert_eq!(f.output_ids.len(), r.params.max_tokens as usize);
                        // Greedy: every sample is what the prompt alone gives.
                        alone.clear_prefix_cache();
                        let one = Request { samples: Samples::ONE, ..r.clone() };
                        let want = alone.generate(vec![one], |_| {}, |_| {}).unwrap();
                        prop_assert_eq!(&f.output_ids, &want[0].output_ids);
                    }
                }
            }
        }
    }
}

#[test]
fn admission_leaves_room_to_grow() {
    // 24 blocks of 4: the first request needs 3 now and 16 more within the lookahead, so the
    // second (3 now, 19 within the lookahead) waits instead of being preempted later.
    let mut e = engine(EngineConfig {
        block_size: 4,
        num_blocks: Some(24),
        ..config()
    });
    e.add(RequestId(0), req((0..10).collect(), 80)).unwrap();
    e.add(RequestId(1), req((20..30).collect(), 80)).unwrap();
    e.step().unwrap();
    assert_eq!((e.stats().running, e.stats().waiting), (1, 1));
    while e.has_work() {
        e.step().unwrap();
    }
    assert_eq!(e.stats().preemptions, 0);
}

#[test]
fn prefix_hits_skip_computation() {
    let mut e = engine(EngineConfig {
        block_size: 4,
        ..config()
    });
    let prompt: Vec<u32> = (0..18).collect();
    let mut prefill = [0usize; 3];
    let mut outs = Vec::new();
    for (k, p) in prefill.iter_mut().enumerate() {
        if k == 2 {
            e.clear_prefix_cache();
        }
        let o = e
            .generate(
                vec![req(prompt.clone(), 5)],
                |_| {},
                |s| *p += s.prefill_tokens,
            )
            .unwrap();
        outs.push(o[0].output_ids.clone());
        if k == 1 {
            assert_eq!(o[0].cached_prompt_tokens, 16);
        }
    }
    // 18 tokens = 4 full blocks + 2: the second run reuses the 4 blocks.
    assert_eq!(prefill, [18, 2, 18]);
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0], outs[2]);
    let st = e.stats();
    assert_eq!((st.prefix_lookup_tokens, st.prefix_hit_tokens), (54, 16));
    // A prompt that is a prefix of the cached one, ending exactly on a block boundary, still
    // computes its last block (its logits are needed).
    let mut p = 0;
    e.generate(
        vec![req(prompt[..8].to_vec(), 1)],
        |_| {},
        |s| p += s.prefill_tokens,
    )
    .unwrap();
    assert_eq!(p, 4);
}

#[test]
fn oldest_sequences_keep_running_when_the_pool_is_short() {
    // Two requests that each need most of the pool over their lifetime: admission's lookahead
    // lets both start, the newer one is preempted as they grow, the older one finishes first,
    // then the newer one completes with the same tokens as without any of this.
    let mut e = engine(EngineConfig {
        block_size: 4,
        num_blocks: Some(60),
        ..config()
    });
    let a = req((0..10).collect(), 200);
    let b = req((20..30).collect(), 200);
    let out = e
        .generate(vec![a.clone(), b.clone()], |_| {}, |_| {})
        .unwrap();
    assert!(e.stats().preemptions >= 1);
    assert_eq!(out[0].preemptions, 0, "the oldest is never the victim");
    assert!(out[1].preemptions >= 1);
    let mut fresh = engine(config());
    let want = fresh.generate(vec![a, b], |_| {}, |_| {}).unwrap();
    assert_eq!(out[0].output_ids, want[0].output_ids);
    assert_eq!(out[1].output_ids, want[1].output_ids);
}

/// A higher band's request, queued after a lower band's, is admitted first; a preempted
/// sequence goes back to the head of its own band, not ahead of a higher one.
#[test]
fn a_higher_band_is_admitted_first() {
    // One sequence at a time: the queue's order is the order they run in.
    let mut e = engine(EngineConfig {
        max_seqs: 1,
        ..config()
    });
    let with = |p: i32, r: Request| Request { priority: p, ..r };
    e.add(RequestId(0), with(0, req((0..6).collect(), 3)))
        .unwrap();
    e.add(RequestId(1), with(0, req((10..16).collect(), 3)))
        .unwrap();
    e.add(RequestId(2), with(5, req((20..26).collect(), 3)))
        .unwrap();
    e.add(RequestId(3), with(-1, req((30..36).collect(), 3)))
        .unwrap();
    e.add(RequestId(4), with(5, req((40..46).collect(), 3)))
        .unwrap();
    let mut order = Vec::new();
    while e.has_work() {
        for ev in e.step().unwrap().0 {
            if let Event::Finished(f) = ev {
                order.push(f.request.0);
            }
        }
    }
    assert_eq!(order, [2, 4, 0, 1, 3]);
}

/// A higher band's prompt admitted beside a lower band's decode goes in below it in the running
/// set, after it in the plan; both finishing in that step leave the set whole (taken in the
/// plan's order reversed, the lower index went first and the engine panicked: "removal index
/// (is 1) should be < len (is 1)").
#[test]
fn two_finishing_out_of_index_order_in_one_step_both_leave() {
    let mut e = engine(config());
    let low = Request {
        priority: 0,
        ..req((0..6).collect(), 2)
    };
    let high = Request {
        priority: 5,
        ..req((20..26).collect(), 1)
    };
    e.add(RequestId(0), low).unwrap();
    // The low band's prompt and first token.
    let (first, _) = e.step().unwrap();
    assert!(first.iter().all(|ev| !matches!(ev, Event::Finished(_))));
    e.add(RequestId(1), high).unwrap();
    // Its last token and the high band's only one, in one step.
    let (second, _) = e.step().unwrap();
    let done: Vec<(u64, usize)> = second
        .iter()
        .filter_map(|ev| match ev {
            Event::Finished(f) => Some((f.request.0, f.output_ids.len())),
            _ => None,
        })
        .collect();
    assert_eq!(done, [(0, 2), (1, 1)], "in step order");
    assert!(!e.has_work());
    assert_eq!(e.stats().blocks_used, 0);
}

/// When the pool runs short, a lower band's sequence is preempted before a higher band's,
/// though it is the older; each still gets the tokens it gets alone.
#[test]
fn a_lower_band_is_preempted_first() {
    let mut e = engine(EngineConfig {
        block_size: 4,
        num_blocks: Some(60),
        ..config()
    });
    let low = Request {
        priority: -3,
        ..req((0..10).collect(), 200)
    };
    let high = Request {
        priority: 2,
        ..req((20..30).collect(), 200)
    };
    let out = e
        .generate(vec![low.clone(), high.clone()], |_| {}, |_| {})
        .unwrap();
    assert!(e.stats().preemptions >= 1);
    assert_eq!(out[1].preemptions, 0, "the higher band is never the victim");
    assert!(out[0].preemptions >= 1, "the older, lower one is");
    let mut fresh = engine(config());
    let want = fresh.generate(vec![low, high], |_| {}, |_| {}).unwrap();
    assert_eq!(bits(out), bits(want));
}

/// Each finished request's tokens and the bits of their log-probabilities.
fn bits(out: Vec<Finished>) -> Vec<(Vec<u32>, Vec<u32>)> {
    out.into_iter()
        .map(|f| {
            let lp = f.logprobs.iter().map(|l| l.to_bits()).collect();
            (f.output_ids, lp)
        })
        .collect()
}

/// A self-draft (the tiny model's first of its two layers, drafting greedily) changes no
/// token: greedy runs with it give every request the tokens and log-probabilities of runs
/// without, bit for bit, and its proposals were verified.
#[test]
fn a_self_draft_changes_no_token() {
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..20u32).map(|t| 3 + (t * 7 + i) % 50).collect())
        .collect();
    let run = |speculative| {
        let mut e = engine(EngineConfig {
            speculative,
            ..config()
        });
        let reqs = prompts.iter().map(|p| req(p.clone(), 24)).collect();
        let out = e.generate(reqs, |_| {}, |_| {}).unwrap();
        assert_eq!(e.stats().blocks_used, 0);
        (bits(out), e.stats().spec)
    };
    let (plain, _) = run(None);
    let spec = crate::spec::SpecConfig {
        method: crate::spec::SpecMethod::SelfDraft(1),
        tokens: 3,
        adaptive: false,
    };
    let (drafted, counts) = run(Some(spec));
    assert_eq!(drafted, plain);
    assert!(counts.drafts > 0 && counts.draft_tokens > 0, "{counts:?}");
}

/// A draft model: the tiny model's first `layers` layers (its own weights, so a draft of the
/// target), over a pool of `blocks` blocks.
fn tiny_draft(layers: usize, blocks: usize) -> Box<dyn Backend> {
    use crate::backend::PoolSize;
    use crate::device::cpu::{CpuBackend, CpuModel, WeightFormat};
    let (mut c, tensors) = crate::testing::tiny_tensors(1);
    c.num_layers = layers;
    let model = CpuModel::from_tensors(&c, &tensors, WeightFormat::Native).unwrap();
    let pool = PoolSize {
        block_size: config().block_size,
        kv_cache_mb: 0,
        num_blocks: Some(blocks),
        kv_dtype: KvDtype::F32,
        gpu_memory_fraction: None,
    };
    Box::new(CpuBackend::new(model, &pool).unwrap())
}

/// A draft model's catch-up is charged to the tokens it serves, not to the step it runs in:
/// a sequence's first decode step feeds its prompt to the draft model, and that forward's
/// time, shared by the rows fed to catch up, is taken out of the step's measure and spread
/// over the tokens the sequence may still make; each step that speculates bears the shares
/// of the tokens it made.
#[test]
fn a_draft_model_s_catch_up_is_charged_to_the_tokens_it_serves() {
    use super::spec_ab::Arm;
    let mut e = engine(config());
    e.set_draft_model("tiny", tiny_draft(2, 1000), 3, true)
        .unwrap();
    let prompt: Vec<u32> = (0..40u32).map(|t| 3 + (t * 7) % 50).collect();
    e.add(RequestId(1), req(prompt, 30)).unwrap();
    // The prompt's step samples the first token; nothing decodes, nothing drafts.
    e.step().unwrap();
    assert_eq!(e.running[0].draft_overhead, 0.0);
    // The first decode step speculates (the outcome check tries speculation first): the draft
    // model catches up over the prompt (40 tokens) and drafts from the first token.
    let t0 = Instant::now();
    let (events, _) = e.step().unwrap();
    let wall = t0.elapsed().as_secs_f64();
    let made = events
        .iter()
        .filter(|e| matches!(e, Event::Token(_)))
        .count();
    let spec = e.spec.as_ref().unwrap();
    let caught_up = spec.catch_up;
    assert_eq!(e.stats().spec.draft_prefill_tokens, 40);
    assert!(
        caught_up > 0.0 && caught_up < wall,
        "{caught_up} of {wall} s"
    );
    // Shared over the 29 tokens it could still make after its first.
    let s = &e.running[0];
    let overhead = s.draft_overhead;
    assert!(
        (overhead * 29.0 - caught_up).abs() <= 1e-12 * caught_up,
        "{overhead} {caught_up}"
    );
    // The step is measured without the catch-up, with the charge of the tokens it made: at
    // least as fast as its wall time less that, however the clock went.
    assert!(
        made > 1,
        "the draft is the target's own first layers: {made} tokens"
    );
    let rate = spec.ab.rate(1, Arm::Speculate);
    let floor = made as f64 / (wall - caught_up + made as f64 * overhead);
    assert!(rate >= floor, "{rate} tok/s measured, {floor} at least");
    // A later step catches up at most over a proposal's last token (verification accepted
    // it, the draft model never fed it), charged the same way over what is left then.
    e.step().unwrap();
    let spec = e.spec.as_ref().unwrap();
    let left = (29 - made) as f64;
    let added = e.running[0].draft_overhead - overhead;
    assert!(
        e.stats().spec.draft_prefill_tokens <= 41,
        "{:?}",
        e.stats().spec
    );
    assert!(
        (added * left - spec.catch_up).abs() <= 1e-9 * caught_up,
        "{added} {}",
        spec.catch_up
    );
}

/// Where speculation is not chosen (a batch size's first steps here), one sequence catches up
/// at most: of three prompts that start decoding together, the draft model is fed one. And a
/// catch-up is shared over no more tokens than the sequences that finished made on average.
#[test]
fn one_sequence_catches_up_where_speculation_is_not_chosen() {
    let mut e = engine(config());
    e.set_draft_model("tiny", tiny_draft(2, 1000), 3, true)
        .unwrap();
    let prompt = |n: u32| -> Vec<u32> { (0..40u32).map(|t| 3 + (t * 7 + n) % 50).collect() };
    for n in 0..3u32 {
        e.add(RequestId(u64::from(n)), req(prompt(n), 12)).unwrap();
    }
    // The prompts' step, then the first decode step of three.
    e.step().unwrap();
    e.step().unwrap();
    assert_eq!(e.stats().spec.draft_prefill_tokens, 40);
    // The one caught up lags a token or two after; the others are not fed.
    e.step().unwrap();
    assert!(
        e.stats().spec.draft_prefill_tokens <= 42,
        "{:?}",
        e.stats().spec
    );
    while !e.running.is_empty() {
        e.step().unwrap();
    }
    // Three sequences made 12 tokens each: a request that may make 30 is charged its catch-up
    // as if it made 12 (on a fresh engine, where its first decode step speculates).
    assert_eq!(e.spec.as_ref().unwrap().typical_output, Some(12.0));
    let mut e = engine(config());
    e.set_draft_model("tiny", tiny_draft(2, 1000), 3, true)
        .unwrap();
    e.spec.as_mut().unwrap().typical_output = Some(12.0);
    e.add(RequestId(3), req(prompt(3), 30)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    let caught_up = e.spec.as_ref().unwrap().catch_up;
    let overhead = e.running[0].draft_overhead;
    assert!(caught_up > 0.0);
    assert!(
        (overhead * 12.0 - caught_up).abs() <= 1e-12 * caught_up,
        "{overhead} {caught_up}"
    );
}

/// A draft model changes no token: with the target itself as its draft (every proposal
/// accepted: the draft's rows are the target's bits), with a smaller draft (the target's
/// first layer alone, which the target overrules), and with that draft over a pool too small
/// for every sequence (states evicted, sequences that cannot draft decoding plainly), greedy
/// and seeded requests get the tokens and log-probabilities of runs without, bit for bit;
/// every block of both pools is back when they end.
#[test]
fn a_draft_model_changes_no_token_and_gives_its_blocks_back() {
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..20u32).map(|t| 3 + (t * 7 + i) % 50).collect())
        .collect();
    let run_with = |draft: Option<Box<dyn Backend>>, adaptive: bool| {
        let mut e = engine(config());
        if let Some(d) = draft {
            e.set_draft_model("tiny", d, 3, adaptive).unwrap();
        }
        let mut reqs: Vec<Request> = prompts.iter().map(|p| req(p.clone(), 24)).collect();
        reqs.push(seeded_resumed(&prompts[1], 11, Vec::new()));
        let out = e.generate(reqs, |_| {}, |_| {}).unwrap();
        let verified: Vec<(u32, u32)> = out.iter().map(|f| f.spec_tokens).collect();
        assert_eq!(e.stats().blocks_used, 0);
        if let Some((free, all)) = e.draft_pool() {
            assert_eq!(free, all, "every draft block is back");
        }
        (bits(out), e.stats().spec, verified)
    };
    let run = |draft| run_with(draft, false);
    let (plain, _, _) = run(None);
    let (same, counts, verified) = run(Some(tiny_draft(2, 1000)));
    assert_eq!(same, plain);
    // The greedy requests take every proposal (the draft's rows are the target's bits); the
    // seeded one draws what it draws.
    for &(proposed, accepted) in &verified[..4] {
        assert!(proposed > 0 && accepted == proposed, "{verified:?}");
    }
    assert!(counts.accepted_tokens < counts.draft_tokens, "{counts:?}");
    let (small, counts, _) = run(Some(tiny_draft(1, 1000)));
    assert_eq!(small, plain);
    assert!(counts.draft_tokens > 0, "{counts:?}");
    assert!(counts.accepted_tokens < counts.draft_tokens, "{counts:?}");
    // Blocks of 16 tokens: each sequence's draft state needs 2 or 3; 5 blocks hold two.
    let (short, counts, verified) = run(Some(tiny_draft(1, 5)));
    assert_eq!(short, plain);
    assert!(counts.draft_tokens > 0, "{counts:?}");
    assert!(verified.iter().any(|v| v.0 > 0), "{verified:?}");
    // Adaptive: at each batch size the first steps speculate and the next ones decode plainly
    // (whatever the clock then says), and neither changes a token.
    let (adaptive, counts, _) = run_with(Some(tiny_draft(2, 1000)), true);
    assert_eq!(adaptive, plain);
    assert!(counts.plain_steps >= 3, "{counts:?}");
}
