//! Serving workloads through the engine under different batching policies.
//!
//! - `mixed`: requests with prompts of 20–1000 tokens and outputs of 10–300 (uniform, fixed seed):
//!   the case where a batch that waits for its longest member wastes the most.
//! - `shared-prefix`: one 500-token system prompt followed by a short question (10–30 tokens) and
//!   a short answer (16–48 tokens): the case the prefix cache is for.
//!
//! Policies: `sequential` (one request at a time), `static` (batches of [`STATIC_BATCH`] that run
//! until their longest member is done before the next batch starts) and `continuous` (every
//! request in one engine, joining and leaving at step granularity).

use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::Serialize;
use tandem_engine::{Engine, EngineError, Finished, Request, SamplingParams};

/// Requests per batch under the static policy.
pub const STATIC_BATCH: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    Mixed,
    SharedPrefix,
}

impl std::str::FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mixed" => Ok(Self::Mixed),
            "shared-prefix" => Ok(Self::SharedPrefix),
            o => Err(format!("unknown workload {o:?} (mixed|shared-prefix)")),
        }
    }
}

impl Workload {
    /// The issue-sized default request count.
    pub fn default_requests(self) -> usize {
        match self {
            Self::Mixed => 200,
            Self::SharedPrefix => 64,
        }
    }

    /// The requests, deterministic in `seed`.
    pub fn requests(self, n: usize, vocab: u32, seed: u64) -> Vec<Request> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        // Ids above the special-token range; outputs ignore EOS so lengths are as drawn.
        let toks = |rng: &mut rand_chacha::ChaCha8Rng, n: usize| -> Vec<u32> {
            (0..n).map(|_| rng.gen_range(100..vocab)).collect()
        };
        let system = toks(&mut rng, 500);
        (0..n)
            .map(|_| {
                let (prompt, out) = match self {
                    Self::Mixed => {
                        let p = rng.gen_range(20..=1000);
                        (toks(&mut rng, p), rng.gen_range(10..=300))
                    }
                    Self::SharedPrefix => {
                        let q = rng.gen_range(10..=30);
                        let mut p = system.clone();
                        p.extend(toks(&mut rng, q));
                        (p, rng.gen_range(16..=48))
                    }
                };
                Request {
                    resume: Vec::new(),
                    prompt,
                    params: SamplingParams {
                        max_tokens: out,
                        ignore_eos: true,
                        ..Default::default()
                    },
                }
            })
            .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Sequential,
    Static,
    Continuous,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sequential" => Ok(Self::Sequential),
            "static" => Ok(Self::Static),
            "continuous" => Ok(Self::Continuous),
            o => Err(format!(
                "unknown policy {o:?} (sequential|static|continuous)"
            )),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct WorkloadReport {
    pub workload: Workload,
    pub policy: Policy,
    pub prefix_caching: bool,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub wall_s: f64,
    pub output_tok_s: f64,
    /// Prompt tokens found in the prefix cache / prompt tokens looked up.
    pub prefix_hit_rate: f64,
    pub preemptions: u64,
    pub ttft_s_p50: f64,
    pub ttft_s_p90: f64,
    pub e2e_s_p50: f64,
}

/// Serves `requests` under `policy` on `engine`, from an empty prefix cache.
pub fn run(
    engine: &mut Engine,
    workload: Workload,
    policy: Policy,
    requests: Vec<Request>,
) -> Result<WorkloadReport, EngineError> {
    engine.clear_prefix_cache();
    let before = engine.stats();
    let n = requests.len();
    let prompt_tokens = requests.iter().map(|r| r.prompt.len()).sum();
    let t0 = Instant::now();
    // Every request is submitted at t0: latencies under the sequential and static policies
    // include the time spent waiting for earlier batches.
    let mut done: Vec<(Finished, f64)> = Vec::with_capacity(n);
    let groups: Vec<Vec<Request>> = match policy {
        Policy::Sequential => requests.into_iter().map(|r| vec![r]).collect(),
        Policy::Static => requests.chunks(STATIC_BATCH).map(|c| c.to_vec()).collect(),
        Policy::Continuous => vec![requests],
    };
    for g in groups {
        let offset = t0.elapsed().as_secs_f64();
        for f in engine.generate(g, |_| {}, |_| {})? {
            done.push((f, offset));
        }
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let after = engine.stats();
    let output_tokens = done.iter().map(|(f, _)| f.output_ids.len()).sum();
    let mut ttft: Vec<f64> = done.iter().map(|(f, o)| f.ttft_s + o).collect();
    let mut e2e: Vec<f64> = done.iter().map(|(f, o)| f.e2e_s + o).collect();
    let lookups = after.prefix_lookup_tokens - before.prefix_lookup_tokens;
    let hits = after.prefix_hit_tokens - before.prefix_hit_tokens;
    Ok(WorkloadReport {
        workload,
        policy,
        prefix_caching: engine.config.prefix_caching,
        requests: n,
        prompt_tokens,
        output_tokens,
        wall_s,
        output_tok_s: output_tokens as f64 / wall_s,
        prefix_hit_rate: if lookups > 0 {
            hits as f64 / lookups as f64
        } else {
            0.0
        },
        preemptions: after.preemptions - before.preemptions,
        ttft_s_p50: crate::percentile(&mut ttft, 0.5),
        ttft_s_p90: crate::percentile(&mut ttft, 0.9),
        e2e_s_p50: crate::percentile(&mut e2e, 0.5),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_have_the_documented_shapes() {
        let m = Workload::Mixed.requests(200, 49152, 7);
        assert_eq!(m.len(), 200);
        assert!(m
            .iter()
            .all(|r| (20..=1000).contains(&r.prompt.len())
                && (10..=300).contains(&r.params.max_tokens)));
        assert_eq!(
            m[3].prompt,
            Workload::Mixed.requests(200, 49152, 7)[3].prompt
        );
        let s = Workload::SharedPrefix.requests(10, 49152, 7);
        assert!(s.iter().all(
            |r| r.prompt[..500] == s[0].prompt[..500] && (510..=530).contains(&r.prompt.len())
        ));
        assert_ne!(s[0].prompt[500..], s[1].prompt[500..]);
    }
}
