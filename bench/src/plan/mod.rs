//! Sizing a cluster: how many prefill and decode workers a load needs to meet its latency targets
//! at least cost, from measured profiles of the workers (`tandem plan`).
//!
//! The model (see [`model`]): prefill workers are a queue of prompts (M/G/c: Erlang C with the
//! Allen–Cunneen correction for the prompt lengths' spread); a decode worker holds, by Little's
//! law, `b = λ_w × output tokens × ITL` streams, and its inter-token gap is its measured step time
//! at that batch, `ITL = t(b)`, solved as a fixed point. Without prefill workers (colocated) each
//! decode worker computes its own prompts too: a share `u` of its time goes to prompts, its
//! streams' gaps stretch to `t(b) / (1 - u)` and a prompt gets only what the decodes leave. That
//! is the disaggregation crossover (DistServe, Splitwise): colocated is cheaper while prompts are
//! a small share of the work, prefill workers pay once prompt work would break the ITL target.
//! [`sim`] checks the model against a step-level simulation of the same cluster.

pub mod model;
pub mod sim;

use serde::{Deserialize, Serialize};

/// What one worker kind does on its cores, measured (`tandem plan profile`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// A name for the kind (the machine, the model, its threads).
    pub kind: String,
    /// Cores one worker of this kind takes (its cost).
    pub cores: usize,
    /// Prompt tokens it computes a second (one prompt at a time, no decodes beside).
    pub prefill_tokens_per_s: f64,
    /// Milliseconds of a decode step by batch size, batches ascending; between points the time
    /// is interpolated, past the last it grows along the last two.
    pub decode: Vec<DecodePoint>,
    /// Most streams one worker holds at once (its KV pool at the load's lengths, `--max-seqs`).
    pub max_batch: usize,
}

/// One measured decode step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    /// Streams in the step.
    pub batch: usize,
    /// Its milliseconds (the median of the measured steps).
    pub step_ms: f64,
}

impl Profile {
    /// Refuses a profile the model cannot use.
    pub fn check(&self) -> Result<(), String> {
        if self.cores == 0 {
            return Err(format!("profile {:?}: cores must be at least 1", self.kind));
        }
        if !self.prefill_tokens_per_s.is_finite() || self.prefill_tokens_per_s <= 0.0 {
            return Err(format!(
                "profile {:?}: prefill_tokens_per_s must be positive",
                self.kind
            ));
        }
        if self.decode.is_empty() {
            return Err(format!("profile {:?}: no decode points", self.kind));
        }
        for w in self.decode.windows(2) {
            if w[1].batch <= w[0].batch {
                return Err(format!(
                    "profile {:?}: decode batches must ascend",
                    self.kind
                ));
            }
        }
        if self
            .decode
            .iter()
            .any(|p| p.batch == 0 || !p.step_ms.is_finite() || p.step_ms <= 0.0)
        {
            return Err(format!(
                "profile {:?}: each decode point needs a batch and a positive step_ms",
                self.kind
            ));
        }
        if self.max_batch == 0 {
            return Err(format!(
                "profile {:?}: max_batch must be at least 1",
                self.kind
            ));
        }
        Ok(())
    }

    /// A profile from a worker's own fitted step cost, as it reports it (`Load`'s
    /// `step_*_ms`: a step's fixed milliseconds, per token computed, per key attended), for
    /// streams holding `context` tokens of KV on average, up to `max_batch` of them: decode
    /// steps at batches 1, 2, 4, ... `max_batch` of `fixed + b (token + key × context)`, and
    /// prompts at `prefill_tokens_per_s` when the worker measured one (else one token's cost
    /// with half a prompt of `prompt` tokens attended). None before the worker timed a step.
    pub fn from_step_cost(
        kind: &str,
        cores: usize,
        step_ms: [f64; 3],
        prefill_tokens_per_s: f64,
        prompt: f64,
        context: f64,
        max_batch: usize,
    ) -> Option<Self> {
        let [fixed, token, key] = step_ms;
        if !(fixed >= 0.0 && token > 0.0 && key >= 0.0) || max_batch == 0 {
            return None;
        }
        let row = token + key * context.max(0.0);
        let mut batches: Vec<usize> = std::iter::successors(Some(1usize), |b| Some(b * 2))
            .take_while(|&b| b < max_batch)
            .collect();
        batches.push(max_batch);
        let prefill_tokens_per_s = if prefill_tokens_per_s > 0.0 {
            prefill_tokens_per_s
        } else {
            1e3 / (token + key * prompt.max(0.0) / 2.0)
        };
        let p = Self {
            kind: kind.to_string(),
            cores: cores.max(1),
            prefill_tokens_per_s,
            decode: batches
                .into_iter()
                .map(|b| DecodePoint {
                    batch: b,
                    step_ms: fixed + b as f64 * row,
                })
                .collect(),
            max_batch,
        };
        p.check().ok().map(|_| p)
    }

    /// Milliseconds of a decode step of `b` streams (fractional: a mean batch).
    pub fn step_ms(&self, b: f64) -> f64 {
        let d = &self.decode;
        let b = b.max(1.0);
        if d.len() == 1 {
            // One point: the step's time as measured, whatever the batch (a floor).
            return d[0].step_ms * (b / d[0].batch as f64).max(1.0);
        }
        let i = d.partition_point(|p| (p.batch as f64) < b);
        let (lo, hi) = match i {
            0 => (d[0], d[1]),
            i if i >= d.len() => (d[d.len() - 2], d[d.len() - 1]),
            i => (d[i - 1], d[i]),
        };
        let slope = (hi.step_ms - lo.step_ms) / (hi.batch - lo.batch) as f64;
        (lo.step_ms + slope * (b - lo.batch as f64)).max(d[0].step_ms.min(lo.step_ms))
    }
}

/// The load to plan for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// Requests a second (Poisson arrivals).
    pub rate: f64,
    /// Prompt tokens: uniform between these (inclusive).
    pub prompt: (usize, usize),
    /// Output tokens: uniform between these (inclusive).
    pub output: (usize, usize),
}

impl Load {
    /// The mean prompt length.
    pub fn prompt_mean(&self) -> f64 {
        (self.prompt.0 + self.prompt.1) as f64 / 2.0
    }

    /// The mean output length.
    pub fn output_mean(&self) -> f64 {
        (self.output.0 + self.output.1) as f64 / 2.0
    }

    /// The squared coefficient of variation of the prompt lengths (uniform).
    pub fn prompt_cv2(&self) -> f64 {
        let (a, b) = (self.prompt.0 as f64, self.prompt.1 as f64);
        let m = (a + b) / 2.0;
        if m <= 0.0 {
            return 0.0;
        }
        ((b - a + 1.0).powi(2) - 1.0) / 12.0 / (m * m)
    }

    /// Refuses a load the model cannot use.
    pub fn check(&self) -> Result<(), String> {
        if !self.rate.is_finite() || self.rate <= 0.0 {
            return Err("the rate must be a positive number of requests a second".into());
        }
        if self.prompt.0 == 0 || self.prompt.0 > self.prompt.1 {
            return Err("prompt lengths must be MIN-MAX with 1 <= MIN <= MAX".into());
        }
        if self.output.0 == 0 || self.output.0 > self.output.1 {
            return Err("output lengths must be MIN-MAX with 1 <= MIN <= MAX".into());
        }
        Ok(())
    }
}

/// The latency targets: the 90th percentile of the time to first token, and the mean gap
/// between a stream's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Targets {
    /// The 90th percentile time to first token, ms.
    pub ttft_p90_ms: f64,
    /// The mean inter-token gap, ms.
    pub itl_ms: f64,
}

/// A cluster shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape {
    /// Prefill workers (0: every prompt computed where it decodes).
    pub prefill: usize,
    /// Decode workers.
    pub decode: usize,
}

/// What the model (or the simulation) says a shape gives.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// The shape estimated.
    pub shape: Shape,
    /// Cores the shape takes.
    pub cores: usize,
    /// 90th percentile time to first token, ms (infinite: the shape cannot keep up).
    pub ttft_p90_ms: f64,
    /// Mean inter-token gap, ms (infinite: it cannot keep up).
    pub itl_ms: f64,
    /// Mean streams on a decode worker.
    pub batch: f64,
}

impl Estimate {
    /// Whether it meets both targets.
    pub fn meets(&self, t: &Targets) -> bool {
        self.ttft_p90_ms <= t.ttft_p90_ms && self.itl_ms <= t.itl_ms
    }
}

/// The plan: the cheapest shape that meets the targets by the model (fewest cores; among equals
/// the lowest ITL), with every shape tried.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// The shape to run, if any meets the targets.
    pub best: Option<Estimate>,
    /// Every shape estimated.
    pub tried: Vec<Estimate>,
}

/// Plans `load` under `targets` over shapes of up to `max_workers` workers of each role.
pub fn plan(
    prefill: &Profile,
    decode: &Profile,
    load: &Load,
    targets: &Targets,
    max_workers: usize,
) -> Plan {
    let mut tried = Vec::new();
    for p in 0..=max_workers {
        for d in 1..=max_workers {
            tried.push(model::estimate_at(
                prefill,
                decode,
                load,
                Shape {
                    prefill: p,
                    decode: d,
                },
                targets.itl_ms,
            ));
        }
    }
    let best = tried
        .iter()
        .filter(|e| e.meets(targets))
        .min_by(|a, b| cheaper(a, b))
        .copied();
    Plan { best, tried }
}

/// The plan's order: fewer cores first, then the lower ITL, then the lower TTFT.
fn cheaper(a: &Estimate, b: &Estimate) -> std::cmp::Ordering {
    a.cores
        .cmp(&b.cores)
        .then(a.itl_ms.total_cmp(&b.itl_ms))
        .then(a.ttft_p90_ms.total_cmp(&b.ttft_p90_ms))
}

/// The shape to run within `prefill` and `decode` workers (each `(least, most)`): the
/// cheapest of `plan`'s shapes in those bounds that meets `targets`, or, when none does, the
/// one that comes closest (the lowest TTFT, then ITL: the most capacity the bounds allow).
pub fn within(
    plan: &Plan,
    targets: &Targets,
    prefill: (usize, usize),
    decode: (usize, usize),
) -> Option<Estimate> {
    let inside = |e: &&Estimate| {
        (prefill.0..=prefill.1).contains(&e.shape.prefill)
            && (decode.0..=decode.1).contains(&e.shape.decode)
    };
    let cheapest = plan
        .tried
        .iter()
        .filter(inside)
        .filter(|e| e.meets(targets))
        .min_by(|a, b| cheaper(a, b));
    cheapest
        .or_else(|| {
            plan.tried.iter().filter(inside).min_by(|a, b| {
                a.ttft_p90_ms
                    .total_cmp(&b.ttft_p90_ms)
                    .then(a.itl_ms.total_cmp(&b.itl_ms))
                    .then(b.cores.cmp(&a.cores))
            })
        })
        .copied()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// About what one 2-thread worker of the default model does on a Zen 4 (`tandem bench
    /// engine --threads 2`: 6.5 ms a step alone, 1.2-1.7 ms a row more).
    pub(crate) fn zen4() -> Profile {
        Profile {
            kind: "test".into(),
            cores: 2,
            prefill_tokens_per_s: 1000.0,
            decode: [
                (1, 6.5),
                (2, 8.2),
                (4, 10.5),
                (8, 16.9),
                (16, 28.0),
                (32, 50.0),
            ]
            .iter()
            .map(|&(batch, step_ms)| DecodePoint { batch, step_ms })
            .collect(),
            max_batch: 64,
        }
    }

    #[test]
    fn step_times_interpolate_and_extrapolate() {
        let p = zen4();
        assert_eq!(p.step_ms(1.0), 6.5);
        assert_eq!(p.step_ms(0.2), 6.5);
        assert!((p.step_ms(3.0) - 9.35).abs() < 1e-9);
        assert_eq!(p.step_ms(32.0), 50.0);
        // Past the last point, along the last two: 22 ms per 16 rows.
        assert!((p.step_ms(48.0) - 72.0).abs() < 1e-9);
        assert!(p.check().is_ok());
        let mut bad = zen4();
        bad.decode.swap(0, 1);
        assert!(bad.check().unwrap_err().contains("ascend"));
    }

    #[test]
    fn a_profile_from_a_fitted_step_cost() {
        let p =
            Profile::from_step_cost("live", 2, [6.0, 1.5, 0.001], 0.0, 200.0, 500.0, 40).unwrap();
        let batches: Vec<usize> = p.decode.iter().map(|d| d.batch).collect();
        assert_eq!(batches, [1, 2, 4, 8, 16, 32, 40]);
        // 6 ms fixed, 1.5 + 0.5 ms a row.
        assert!((p.step_ms(1.0) - 8.0).abs() < 1e-9);
        assert!((p.step_ms(40.0) - 86.0).abs() < 1e-9);
        // No measured prefill rate: a token's cost with half the prompt attended.
        assert!((p.prefill_tokens_per_s - 1e3 / 1.6).abs() < 1e-9);
        let measured =
            Profile::from_step_cost("live", 2, [6.0, 1.5, 0.0], 700.0, 200.0, 0.0, 1).unwrap();
        assert_eq!(measured.prefill_tokens_per_s, 700.0);
        assert_eq!(measured.decode.len(), 1);
        // Not timed yet, or nonsense: none.
        assert!(Profile::from_step_cost("live", 2, [0.0; 3], 0.0, 1.0, 1.0, 8).is_none());
        assert!(
            Profile::from_step_cost("live", 2, [1.0, f64::NAN, 0.0], 0.0, 1.0, 1.0, 8).is_none()
        );
        assert!(Profile::from_step_cost("live", 2, [1.0, 1.0, 0.0], 0.0, 1.0, 1.0, 0).is_none());
    }

    #[test]
    fn within_bounds_the_cheapest_that_meets_else_the_most_capacity() {
        let p = zen4();
        let t = Targets {
            ttft_p90_ms: 1500.0,
            itl_ms: 50.0,
        };
        let heavy = Load {
            rate: 6.0,
            prompt: (190, 210),
            output: (64, 64),
        };
        let plan = super::plan(&p, &p, &heavy, &t, 8);
        let best = plan.best.unwrap();
        // Bounds that hold the plan's best: the same shape.
        let got = within(&plan, &t, (0, 8), (1, 8)).unwrap();
        assert_eq!(got.shape, best.shape);
        // Bounds too tight to meet the targets: the most capacity they allow.
        let tight = within(&plan, &t, (0, 0), (1, 2)).unwrap();
        assert!(!tight.meets(&t));
        assert_eq!(
            tight.shape,
            Shape {
                prefill: 0,
                decode: 2
            }
        );
        // Empty bounds: none.
        assert!(within(&plan, &t, (0, 0), (9, 9)).is_none());
    }

    #[test]
    fn the_plan_is_the_cheapest_shape_that_meets_the_targets() {
        let p = zen4();
        let t = Targets {
            ttft_p90_ms: 1500.0,
            itl_ms: 50.0,
        };
        let light = Load {
            rate: 0.2,
            prompt: (190, 210),
            output: (64, 64),
        };
        let plan = plan(&p, &p, &light, &t, 6);
        // A light load: one colocated worker.
        assert_eq!(
            plan.best.unwrap().shape,
            Shape {
                prefill: 0,
                decode: 1
            }
        );
        // More load: more workers, and nothing cheaper meets the targets.
        let heavy = Load { rate: 6.0, ..light };
        let plan = super::plan(&p, &p, &heavy, &t, 8);
        let best = plan.best.unwrap();
        assert!(best.cores > 2, "{best:?}");
        assert!(plan
            .tried
            .iter()
            .filter(|e| e.cores < best.cores)
            .all(|e| !e.meets(&t)));
        // Targets no shape meets: none.
        let strict = Targets {
            ttft_p90_ms: 1.0,
            itl_ms: 1.0,
        };
        assert!(super::plan(&p, &p, &heavy, &strict, 4).best.is_none());
    }
}
