//! Serving workloads through the engine under different batching policies.
//!
//! - `mixed`: requests with prompts of 20–1000 tokens and outputs of 10–300 (uniform, fixed seed):
//!   the case where a batch that waits for its longest member wastes the most.
//! - `shared-prefix`: one 500-token system prompt followed by a short question (10–30 tokens) and
//!   a short answer (16–48 tokens): the case the prefix cache is for.
//!
//! Policies, each one of the engine's schedulers (`Policy::scheduler`) over one submission of
//! every request at once:
//! - `sequential`: one request at a time (static batches of one).
//! - `static`: batches of [`STATIC_BATCH`] run the way a static batcher runs them (one fixed
//!   batch tensor): every prompt padded to the batch's longest, and every row stepped until the
//!   batch's longest output is done; only each request's own tokens count as output. The padding
//!   is random tokens, so nothing of it is found in the prefix cache.
//! - `static-packed`: batches of [`STATIC_BATCH`] without the padding: a row leaves the batch when
//!   its request is done, but the next batch still waits for the longest member of this one.
//! - `continuous`: every request in one engine, joining and leaving at step granularity.
//!
//! Each run also reports its roofline bound: every step the engine ran, priced at this machine's
//! measured peak (the step's FLOPs at the FMA peak or its bytes at the copy bandwidth, whichever
//! takes longer), summed. The bound's ratio between two policies is the most any kernel could make
//! of their schedules on this hardware.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::Serialize;
use tandem_engine::{
    Continuous, Engine, EngineError, Request, Scheduler, StaticBatches, StepStats,
};

use crate::roofline::Roofline;

/// Requests per batch under the static policy.
pub const STATIC_BATCH: usize = 16;

/// A request mix to serve (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Prompts of 20–1000 tokens, outputs of 10–300.
    Mixed,
    /// A shared 500-token system prompt, a 10–30-token question, a 16–48-token answer.
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
                Request::greedy(prompt, out).expect("drawn lengths are at least 10 tokens")
            })
            .collect()
    }
}

/// How requests are batched (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// One request at a time.
    Sequential,
    /// Fixed batches, prompts padded to the longest, every row run to the longest output.
    Static,
    /// Fixed batches without padding; the next batch waits for this one's longest member.
    StaticPacked,
    /// Every request in one engine, joining and leaving at step granularity.
    Continuous,
}

impl Policy {
    /// Every policy, in the order reports list them.
    pub const ALL: [Policy; 4] = [
        Self::Sequential,
        Self::Static,
        Self::StaticPacked,
        Self::Continuous,
    ];

    /// The name flags and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sequential => "sequential",
            Self::Static => "static",
            Self::StaticPacked => "static-packed",
            Self::Continuous => "continuous",
        }
    }

    /// The engine's scheduler that batches this way (the static policy's padding is in the
    /// requests it is given).
    pub fn scheduler(self) -> Box<dyn Scheduler> {
        match self {
            Self::Sequential => Box::new(StaticBatches::new(1)),
            Self::Static | Self::StaticPacked => Box::new(StaticBatches::new(STATIC_BATCH)),
            Self::Continuous => Box::new(Continuous),
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|p| p.name()).collect();
                format!("unknown policy {s:?} ({})", names.join("|"))
            })
    }
}

/// One workload's run under one policy.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadReport {
    /// The request mix.
    pub workload: Workload,
    /// The batching policy.
    pub policy: Policy,
    /// Whether the engine reused cached prefixes.
    pub prefix_caching: bool,
    /// Requests served.
    pub requests: usize,
    /// Prompt tokens of all requests (before any padding).
    pub prompt_tokens: usize,
    /// The requests' own output tokens (a static batch's rows step past theirs; that is padding).
    pub output_tokens: usize,
    /// Tokens the engine computed: prompts and outputs, plus the static policy's padding and any
    /// recompute after preemption.
    pub computed_tokens: usize,
    /// Engine steps run.
    pub steps: usize,
    /// Seconds for the whole run.
    pub wall_s: f64,
    /// `output_tokens` / `wall_s`.
    pub output_tok_s: f64,
    /// Seconds in steps that prefilled (alone or with decodes).
    pub prefill_steps_s: f64,
    /// Seconds in steps that only decoded.
    pub decode_steps_s: f64,
    /// Seconds all the run's steps take priced at the roofline (absent where it was not
    /// measured: on a GPU).
    pub roofline_s: Option<f64>,
    /// Seconds the steps that only decoded take priced at the roofline.
    pub roofline_decode_steps_s: Option<f64>,
    /// `output_tokens` / `roofline_s`: the output rate the roofline allows this schedule.
    pub roofline_output_tok_s: Option<f64>,
    /// Prompt tokens found in the prefix cache / prompt tokens looked up.
    pub prefix_hit_rate: f64,
    /// Preemptions during the run.
    pub preemptions: u64,
    /// Median seconds from the run's start (when every request is submitted) to first token.
    pub ttft_s_p50: f64,
    /// 90th-percentile seconds from the run's start to first token.
    pub ttft_s_p90: f64,
    /// Median seconds from the run's start to a request's end.
    pub e2e_s_p50: f64,
}

/// The least time a step can take on a machine: its FLOPs at the FMA peak or its bytes at the
/// copy bandwidth, whichever is longer. Bytes are every weight once and the KV of every sequence
/// in the step once; FLOPs are two per weight per token (the head only for the rows that sample)
/// and four per head dimension per attended key (q·k and p·v).
#[derive(Clone, Copy, Debug)]
pub struct StepCost {
    body_flops: f64,
    head_flops: f64,
    key_flops: f64,
    weight_bytes: f64,
    kv_bytes_per_token: f64,
}

impl StepCost {
    /// The prices of `engine`'s model on its device.
    pub fn of(engine: &Engine) -> Self {
        let c = engine.model_config();
        Self {
            body_flops: 2.0 * crate::projection_params(c) as f64,
            head_flops: 2.0 * (c.vocab_size * c.hidden_size) as f64,
            key_flops: 4.0 * (c.num_layers * c.num_heads * c.head_dim) as f64,
            weight_bytes: engine.backend().weight_bytes() as f64,
            kv_bytes_per_token: engine.backend().kv_bytes_per_token(),
        }
    }

    /// The least seconds step `s` can take on a machine with roofline `roof`.
    pub fn seconds(&self, s: &StepStats, roof: &Roofline) -> f64 {
        let tokens = (s.prefill_tokens + s.decode_tokens) as f64;
        let flops = self.body_flops * tokens
            + self.head_flops * s.logit_rows as f64
            + self.key_flops * s.attended_keys as f64;
        let bytes = self.weight_bytes + self.kv_bytes_per_token * s.context_tokens as f64;
        (flops / (roof.f32_peak_gflops * 1e9)).max(bytes / (roof.mem_bw_gb_s * 1e9))
    }
}

/// A static batch as one fixed batch tensor holds it: prompts padded (with random tokens) to the
/// longest, and every row generating as many tokens as the longest output.
fn padded(batch: &[Request], vocab: u32, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<Request> {
    let prompt = batch.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let out = batch.iter().map(|r| r.params.max_tokens).max().unwrap_or(1);
    let out = std::num::NonZeroU32::new(out).expect("a valid request generates a token");
    batch
        .iter()
        .map(|r| {
            let mut r = r.clone();
            let pad = prompt - r.prompt.len();
            r.prompt.extend((0..pad).map(|_| rng.gen_range(100..vocab)));
            r.params = r.params.with_max_tokens(out);
            r
        })
        .collect()
}

/// Serves `requests` under `policy` on `engine`, from an empty prefix cache; with the machine's
/// roofline, also prices the steps it ran.
pub fn run(
    engine: &mut Engine,
    workload: Workload,
    policy: Policy,
    requests: Vec<Request>,
    roof: Option<&Roofline>,
) -> Result<WorkloadReport, EngineError> {
    engine.clear_prefix_cache();
    let before = engine.stats();
    let n = requests.len();
    let prompt_tokens = requests.iter().map(|r| r.prompt.len()).sum();
    let own_outputs: Vec<usize> = requests
        .iter()
        .map(|r| r.params.max_tokens as usize)
        .collect();
    let vocab = engine.model_config().vocab_size as u32;
    let mut pad_rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    let requests: Vec<Request> = match policy {
        Policy::Static => requests
            .chunks(STATIC_BATCH)
            .flat_map(|c| padded(c, vocab, &mut pad_rng))
            .collect(),
        _ => requests,
    };
    let cost = StepCost::of(engine);
    let mut steps: Vec<StepStats> = Vec::new();
    // Every request is submitted at t0, so latencies under the sequential and static policies
    // include the time spent waiting for earlier batches.
    let previous = engine.set_scheduler(policy.scheduler());
    let t0 = Instant::now();
    let served = engine.generate(requests, |_| {}, |s| steps.push(*s));
    engine.set_scheduler(previous);
    let done = served?;
    let wall_s = t0.elapsed().as_secs_f64();
    let after = engine.stats();
    // `generate` returns its requests in order.
    let output_tokens = done
        .iter()
        .zip(&own_outputs)
        .map(|(f, &own)| f.output_ids.len().min(own))
        .sum();
    let mut ttft: Vec<f64> = done.iter().map(|f| f.ttft_s).collect();
    let mut e2e: Vec<f64> = done.iter().map(|f| f.e2e_s).collect();
    let lookups = after.prefix_lookup_tokens - before.prefix_lookup_tokens;
    let hits = after.prefix_hit_tokens - before.prefix_hit_tokens;
    let priced = |decode_only: bool| {
        roof.map(|r| {
            steps
                .iter()
                .filter(|s| !decode_only || s.prefill_tokens == 0)
                .map(|s| cost.seconds(s, r))
                .sum::<f64>()
        })
    };
    let roofline_s = priced(false);
    let step_s = |prefill: bool| {
        steps
            .iter()
            .filter(|s| (s.prefill_tokens > 0) == prefill)
            .map(|s| s.seconds)
            .sum()
    };
    Ok(WorkloadReport {
        workload,
        policy,
        prefix_caching: engine.config.prefix_caching,
        requests: n,
        prompt_tokens,
        output_tokens,
        computed_tokens: steps
            .iter()
            .map(|s| s.prefill_tokens + s.decode_tokens)
            .sum(),
        steps: steps.len(),
        wall_s,
        output_tok_s: output_tokens as f64 / wall_s,
        prefill_steps_s: step_s(true),
        decode_steps_s: step_s(false),
        roofline_s,
        roofline_decode_steps_s: priced(true),
        roofline_output_tok_s: roofline_s.map(|t| output_tokens as f64 / t),
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

    #[test]
    fn policies_parse_by_the_names_they_print() {
        for p in Policy::ALL {
            assert_eq!(p.name().parse::<Policy>(), Ok(p));
            assert_eq!(
                serde_json::to_string(&p).unwrap(),
                format!("\"{}\"", p.name())
            );
        }
        let err = "batch".parse::<Policy>().unwrap_err();
        assert!(err.contains("static-packed"), "{err}");
    }

    #[test]
    fn a_static_batch_is_padded_to_its_longest_prompt_and_output() {
        let reqs = Workload::Mixed.requests(5, 49152, 3);
        let longest = reqs.iter().map(|r| r.prompt.len()).max().unwrap();
        let most = reqs.iter().map(|r| r.params.max_tokens).max().unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let p = padded(&reqs, 49152, &mut rng);
        for (r, q) in reqs.iter().zip(&p) {
            assert_eq!(q.prompt.len(), longest);
            assert_eq!(q.prompt[..r.prompt.len()], r.prompt[..]);
            assert_eq!(q.params.max_tokens, most);
        }
        // The pads differ between rows, so no row's padding is another's cached prefix.
        let short: Vec<_> = reqs
            .iter()
            .zip(&p)
            .filter(|(r, _)| r.prompt.len() + 16 <= longest)
            .map(|(r, q)| &q.prompt[r.prompt.len()..r.prompt.len() + 16])
            .collect();
        assert!(short.len() >= 2, "seed 3 gives short prompts");
        assert_ne!(short[0], short[1]);
    }

    #[test]
    fn a_step_costs_its_flops_or_its_bytes_whichever_is_slower() {
        let cost = StepCost {
            body_flops: 1e9,
            head_flops: 1e8,
            key_flops: 1e3,
            weight_bytes: 2e8,
            kv_bytes_per_token: 1e4,
        };
        let roof = Roofline {
            mem_bw_gb_s: 10.0,
            f32_gflops: 0.0,
            f32_peak_gflops: 100.0,
        };
        // A decode of one row: 1.101 GFLOP (11 ms) against 200 MB of weights and 10 MB of KV
        // (21 ms), memory-bound.
        let decode = StepStats {
            decode_tokens: 1,
            logit_rows: 1,
            attended_keys: 1000,
            context_tokens: 1000,
            ..Default::default()
        };
        let bytes = (2e8 + 1e7) / 10e9;
        assert!((cost.seconds(&decode, &roof) - bytes).abs() < 1e-12);
        // A prefill of 100 tokens: 100 GFLOP + the head once + 5050 keys, compute-bound.
        let prefill = StepStats {
            prefill_tokens: 100,
            logit_rows: 1,
            attended_keys: 5050,
            context_tokens: 100,
            ..Default::default()
        };
        let flops = (100.0 * 1e9 + 1e8 + 5050.0 * 1e3) / 100e9;
        assert!((cost.seconds(&prefill, &roof) - flops).abs() < 1e-12);
    }
}
