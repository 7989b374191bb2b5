//! A step-level simulation of a cluster shape under a load, from the same profiles: Poisson
//! arrivals; prefill workers serve prompts first come, first served (the one free soonest takes
//! the next); each decode worker runs continuous batching, a step of `b` streams taking the
//! profile's step time and, colocated, its prompts computed in chunks beside the decodes as the
//! engine does under `--itl-target-ms` (what fits in the target, [`super::model::MIN_CHUNK`]
//! tokens at least; a step with no stream decoding takes up to 2048 prompt tokens). A request
//! goes to the decode worker with the fewest requests. It checks the planner's closed forms
//! against the mechanics they stand for.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};

use super::model::MIN_CHUNK;
use super::{Estimate, Load, Profile, Shape};

/// Prompt tokens a step with no decoding stream takes at most (`--max-batched-tokens`).
const MAX_BATCHED: usize = 2048;

struct Req {
    arrival: f64,
    prompt: usize,
    output: usize,
    first: Option<f64>,
    last: f64,
}

#[derive(Default)]
struct Worker {
    /// Streams: (request, tokens still to come).
    streams: Vec<(usize, usize)>,
    /// Prompts to compute here: (request, tokens left).
    prompts: VecDeque<(usize, usize)>,
    /// The running step: its end and the prompt tokens it computes.
    step: Option<(f64, usize)>,
    /// Requests that joined while a step ran (they join the next).
    joining: Vec<usize>,
}

impl Worker {
    fn load(&self) -> usize {
        self.streams.len() + self.prompts.len() + self.joining.len()
    }
}

/// Simulates `requests` requests (the first tenth not measured) of `load` on `shape`; seeded.
pub fn simulate(
    prefill: &Profile,
    decode: &Profile,
    load: &Load,
    shape: Shape,
    itl_target_ms: f64,
    requests: usize,
    seed: u64,
) -> Estimate {
    let cores = shape.prefill * prefill.cores + shape.decode * decode.cores;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let gap = Exp::new(load.rate).expect("a positive rate");
    let mut t = 0.0;
    let mut reqs: Vec<Req> = (0..requests)
        .map(|_| {
            t += gap.sample(&mut rng);
            Req {
                arrival: t,
                prompt: rng.gen_range(load.prompt.0..=load.prompt.1),
                output: rng.gen_range(load.output.0..=load.output.1),
                first: None,
                last: 0.0,
            }
        })
        .collect();
    // When each request reaches the decode pool: at once (colocated), or when a prefill worker
    // has computed its prompt (its first token then).
    let mut ready: Vec<(f64, usize)> = Vec::with_capacity(requests);
    if shape.prefill > 0 {
        let mut free = vec![0.0f64; shape.prefill];
        for (i, r) in reqs.iter_mut().enumerate() {
            let k = (0..free.len())
                .min_by(|&a, &b| free[a].total_cmp(&free[b]))
                .expect("a prefill worker");
            let done = free[k].max(r.arrival) + r.prompt as f64 / prefill.prefill_tokens_per_s;
            free[k] = done;
            r.first = Some(done);
            r.last = done;
            ready.push((done, i));
        }
        ready.sort_by(|a, b| a.0.total_cmp(&b.0));
    } else {
        ready.extend(reqs.iter().enumerate().map(|(i, r)| (r.arrival, i)));
    }
    let mut workers: Vec<Worker> = (0..shape.decode).map(|_| Worker::default()).collect();
    let rate_d = decode.prefill_tokens_per_s;
    let mut next = 0;
    loop {
        let step_end = workers
            .iter()
            .enumerate()
            .filter_map(|(k, w)| w.step.map(|(e, _)| (e, k)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let arrival = ready.get(next).copied();
        let (now, event) = match (arrival, step_end) {
            (None, None) => break,
            (Some((ta, i)), Some((te, _))) if ta <= te => (ta, Err(i)),
            (Some((ta, i)), None) => (ta, Err(i)),
            (_, Some((te, k))) => (te, Ok(k)),
        };
        let k = match event {
            Err(i) => {
                next += 1;
                let k = (0..workers.len())
                    .min_by_key(|&k| workers[k].load())
                    .expect("a decode worker");
                workers[k].joining.push(i);
                if workers[k].step.is_some() {
                    continue;
                }
                k
            }
            Ok(k) => {
                // The step ends: every stream in it gets a token, the chunk is computed.
                let w = &mut workers[k];
                let (_, mut chunk) = w.step.take().expect("a running step");
                for (i, left) in &mut w.streams {
                    reqs[*i].last = now;
                    *left -= 1;
                }
                w.streams.retain(|&(_, left)| left > 0);
                while chunk > 0 {
                    let Some((i, left)) = w.prompts.front_mut() else {
                        break;
                    };
                    let take = chunk.min(*left);
                    *left -= take;
                    chunk -= take;
                    if *left == 0 {
                        let i = *i;
                        w.prompts.pop_front();
                        reqs[i].first = Some(now);
                        reqs[i].last = now;
                        if reqs[i].output > 1 {
                            w.streams.push((i, reqs[i].output - 1));
                        }
                    }
                }
                k
            }
        };
        // The worker's next step, if it has work.
        let w = &mut workers[k];
        for i in std::mem::take(&mut w.joining) {
            if shape.prefill > 0 {
                if reqs[i].output > 1 {
                    w.streams.push((i, reqs[i].output - 1));
                }
            } else {
                w.prompts.push_back((i, reqs[i].prompt));
            }
        }
        let b = w.streams.len();
        let pending: usize = w.prompts.iter().map(|&(_, l)| l).sum();
        if b == 0 && pending == 0 {
            continue;
        }
        let decode_ms = if b > 0 { decode.step_ms(b as f64) } else { 0.0 };
        let chunk = if pending == 0 {
            0
        } else if b == 0 {
            pending.min(MAX_BATCHED)
        } else {
            let fits = ((itl_target_ms - decode_ms).max(0.0) / 1e3 * rate_d).floor();
            (fits.max(MIN_CHUNK) as usize).min(pending)
        };
        let ms = decode_ms + chunk as f64 / rate_d * 1e3;
        w.step = Some((now + ms / 1e3, chunk));
    }
    let skip = requests / 10;
    let measured = &reqs[skip..];
    let mut ttft: Vec<f64> = measured
        .iter()
        .map(|r| (r.first.unwrap_or(f64::INFINITY) - r.arrival) * 1e3)
        .collect();
    ttft.sort_by(f64::total_cmp);
    let p90 = ttft
        .get(((ttft.len() as f64 * 0.9).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0.0);
    let gaps: Vec<f64> = measured
        .iter()
        .filter(|r| r.output > 1)
        .map(|r| (r.last - r.first.unwrap_or(r.last)) * 1e3 / (r.output - 1) as f64)
        .collect();
    let itl = gaps.iter().sum::<f64>() / gaps.len().max(1) as f64;
    Estimate {
        shape,
        cores,
        ttft_p90_ms: p90,
        itl_ms: itl,
        batch: f64::NAN,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::zen4;
    use super::super::{plan, Targets};
    use super::*;

    fn shapes(max: usize) -> impl Iterator<Item = Shape> {
        (0..=max).flat_map(move |p| {
            (1..=max).map(move |d| Shape {
                prefill: p,
                decode: d,
            })
        })
    }

    /// The planner's shape meets the targets in the simulation, and no shape the simulation
    /// finds meeting them is more than one worker cheaper.
    #[test]
    fn the_plan_meets_its_targets_in_the_simulated_cluster() {
        let p = zen4();
        let targets = Targets {
            ttft_p90_ms: 2000.0,
            itl_ms: 60.0,
        };
        for rate in [0.5, 1.0, 2.0, 4.0, 8.0] {
            let load = Load {
                rate,
                prompt: (190, 210),
                output: (32, 96),
            };
            let best = plan(&p, &p, &load, &targets, 8).best.expect("a shape");
            let sim = simulate(&p, &p, &load, best.shape, targets.itl_ms, 3000, 7);
            assert!(
                sim.meets(&targets),
                "rate {rate}: {best:?} simulated {sim:?}"
            );
            let cheapest = shapes(8)
                .map(|s| simulate(&p, &p, &load, s, targets.itl_ms, 3000, 7))
                .filter(|e| e.meets(&targets))
                .map(|e| e.cores)
                .min()
                .expect("a shape meets the targets in simulation");
            assert!(
                best.cores <= cheapest + p.cores,
                "rate {rate}: planned {} cores, {cheapest} suffice in simulation",
                best.cores
            );
        }
    }

    #[test]
    fn a_simulated_shape_that_cannot_keep_up_misses() {
        let p = zen4();
        let load = Load {
            rate: 20.0,
            prompt: (190, 210),
            output: (64, 64),
        };
        // 20 prompts of 200 tokens a second on one 1000 token/s worker: the queue only grows.
        let one = Shape {
            prefill: 0,
            decode: 1,
        };
        let run = || simulate(&p, &p, &load, one, 50.0, 1000, 1);
        let sim = run();
        assert!(sim.ttft_p90_ms > 10_000.0, "{sim:?}");
        // The same seed, the same figures.
        let again = run();
        assert_eq!(sim.ttft_p90_ms, again.ttft_p90_ms);
        assert_eq!(sim.itl_ms, again.itl_ms);
    }
}
