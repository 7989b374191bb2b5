//! tandem-bench: benchmarks that print numbers and ratios, each next to what the hardware allows.
//!
//! One module per benchmark, named by its path (they share entry-point names such as `run`):
//! - the engine benchmark (`tandem bench engine`, here at the root): prefill and decode throughput
//!   of the engine in this process, next to this machine's roofline measured in the same run
//!   ([`roofline`]: memory bandwidth by a large copy, f32 compute by a large GEMM);
//! - [`workload`]: serving workloads through the engine under batching policies, each run priced
//!   at the roofline;
//! - [`load`]: the load generator for clusters (`tandem bench serve`, `tandem bench agent`):
//!   arrival processes, datasets, goodput, distributed load, side-by-side runs, HTML reports;
//! - [`kv`]: KV transfer throughput over loopback against a plain TCP copy (`tandem bench
//!   kv-transfer`);
//! - [`gpu`]: a Llama-3-8B-shaped model on one GPU against the card's measured roofline
//!   (`tandem bench gpu`).
//!
//! Main types: [`EngineBench`] and [`EngineReport`] (the engine benchmark),
//! [`roofline::Roofline`], [`workload::WorkloadReport`], [`load::Bench`] and
//! [`load::Report`], [`kv::KvBenchRow`], [`gpu::GpuReport`].

#![deny(missing_docs)]

pub mod collective;
pub mod gpu;
pub mod kv;
pub mod load;
pub mod plan;
pub mod roofline;

pub mod workload;

use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::Serialize;
use tandem_engine::{Engine, EngineError, Request, SamplingParams};
use tandem_types::Grammar;

/// What to run.
#[derive(Clone, Debug)]
pub struct EngineBench {
    /// Requests run together.
    pub batch: usize,
    /// Prompt tokens per request (random ids).
    pub prompt_len: usize,
    /// Tokens generated per request (EOS ignored).
    pub gen_len: usize,
    /// Seed of the random prompts.
    pub seed: u64,
    /// Every request's output must match this (structured outputs); none: free.
    pub grammar: Option<Grammar>,
    /// Time each op of the steps' forward ([`EngineReport::decode_ops`],
    /// [`EngineReport::prefill_ops`]).
    pub profile: bool,
    /// LoRA adapters the requests run with, request `i` with adapter `i mod len` (none: the
    /// base model).
    pub adapters: Vec<std::sync::Arc<tandem_model::LoraAdapter>>,
}

/// One op's share of a decode step or of the prefill, from a profile of the steps.
#[derive(Clone, Debug, Serialize)]
pub struct OpShare {
    /// The op, as [`tandem_engine::OpTimes::named`] names it.
    pub op: &'static str,
    /// Milliseconds spent in it: a decode step's (the mean over the decode steps), or the whole
    /// prefill's (the sum over the steps that computed prompt tokens).
    pub ms: f64,
    /// Bytes of weights it reads in those milliseconds, once a step (products only; 0 for the
    /// rest).
    pub weight_bytes: usize,
    /// FLOPs it does in those milliseconds: a product's 2 a weight a row; the prefill's
    /// attention, its prompts' causal scores and weighted values ([`prompt_attention_flops`]),
    /// whose milliseconds include the rotary embedding and the cache writes (so its rate is a
    /// floor); 0 for the rest.
    pub flops: f64,
}

/// The engine benchmark's figures, next to this machine's roofline.
#[derive(Clone, Debug, Serialize)]
pub struct EngineReport {
    /// Requests run together.
    pub batch: usize,
    /// Prompt tokens per request.
    pub prompt_len: usize,
    /// Tokens generated per request.
    pub gen_len: usize,
    /// The caller's label for the weights (a path or a model name).
    pub weights: String,
    /// Where the steps ran: `cpu`, or the GPU's name.
    pub device: String,
    /// Threads in rayon's pool, which the CPU kernels run on.
    pub threads: usize,
    /// The kernel level the engine ran at (`TANDEM_ISA`), and what it uses.
    pub simd: &'static str,
    /// The instructions that kernel level uses, spelled out.
    pub simd_detail: &'static str,
    /// The CPU the figures were measured on.
    pub cpu: roofline::CpuInfo,
    /// Prompt tokens per second over the steps that prefilled.
    pub prefill_tok_s: f64,
    /// Generated tokens per second, all sequences together, over the pure decode steps.
    pub decode_tok_s: f64,
    /// Median milliseconds per pure decode step.
    pub step_ms_p50: f64,
    /// 90th-percentile milliseconds per pure decode step.
    pub step_ms_p90: f64,
    /// This CPU's roofline (zero when the engine ran on a GPU: `tandem bench gpu` measures that).
    pub mem_bw_gb_s: f64,
    /// A 1024³ f32 GEMM on all threads, in GFLOP/s (zero on a GPU).
    pub f32_gflops: f64,
    /// This CPU's peak f32 FMA rate, in GFLOP/s (zero on a GPU).
    pub f32_peak_gflops: f64,
    /// Bytes one decode step must read: all weights once (of a mixture of experts, those of the
    /// experts its rows ran), plus every sequence's KV at the median context length.
    pub decode_bytes_per_step: f64,
    /// decode_bytes_per_step / step_ms_p50 / mem_bw_gb_s.
    pub decode_bw_efficiency: f64,
    /// Prefill FLOP rate (projections and head) as a fraction of the peak f32 FMA rate.
    pub prefill_flop_efficiency: f64,
    /// Seconds the whole batch took, prefill and decode.
    pub wall_s: f64,
    /// Tensor-parallel ranks (1: none).
    pub tp: usize,
    /// Median milliseconds of a pure decode step the ranks spent in collectives (all-reduces
    /// and the logits' gather, waiting for peers included); the rest of the step is compute.
    pub collective_ms_p50: f64,
    /// Values (f32) each rank all-reduced or gathered in a pure decode step, the median.
    pub collective_values_per_step: f64,
    /// The ranks' all-reduce on its own, at one decode step's hidden rows and at 4 MiB (empty
    /// at TP 1).
    pub all_reduce: Vec<collective::AllReduceRate>,
    /// Tokens sampled under a grammar (0 without one; a grammar that ended early stops its
    /// sequence, so fewer than batch × gen_len).
    pub constrained_tokens: usize,
    /// With a profile: a decode step's time by op, in the forward's order.
    pub decode_ops: Option<Vec<OpShare>>,
    /// With a profile: the prefill's time by op (every step that computed prompt tokens, and
    /// any decode rows that shared those steps), in the forward's order.
    pub prefill_ops: Option<Vec<OpShare>>,
    /// Milliseconds the steps that computed prompt tokens took, all together.
    pub prefill_ms: f64,
    /// A mixture of experts: rows each expert computed over the run, summed over the layers
    /// (empty for a dense model).
    pub expert_rows: Vec<u64>,
}

pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the benchmark on `engine` (weights label for the report only).
pub fn run_engine_bench(
    engine: &mut Engine,
    b: &EngineBench,
    weights: &str,
) -> Result<EngineReport, EngineError> {
    let vocab = engine.model_config().vocab_size as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(b.seed);
    let params = SamplingParams {
        max_tokens: b.gen_len as u32,
        ignore_eos: true,
        grammar: b.grammar.clone(),
        ..Default::default()
    }
    .validate()?;
    // Random ids above the special-token range: realistic attention and no early stop.
    let requests: Vec<Request> = (0..b.batch)
        .map(|i| {
            let prompt = (0..b.prompt_len)
                .map(|_| rng.gen_range(100..vocab))
                .collect();
            let mut r = Request::new(prompt, params.clone());
            if !b.adapters.is_empty() {
                r.adapter = Some(b.adapters[i % b.adapters.len()].clone());
            }
            r
        })
        .collect();
    let profiled = b.profile && engine.profile_ops(true);
    let mut ops = tandem_engine::OpTimes::default();
    let mut prefill_op_times = tandem_engine::OpTimes::default();
    // Rows through the projections and through the head in the prefill's steps.
    let mut prefill_rows = (0usize, 0usize);
    let mut prefill_steps = 0usize;
    let mut prefill = (0usize, 0f64);
    let mut decode = (0usize, 0f64);
    let mut steps = Vec::new();
    let mut collective = Vec::new();
    let mut values = Vec::new();
    let t0 = Instant::now();
    let mut sampled = 0usize;
    // Experts run (summed over routings) and routings, in the prefill's steps and the decode's.
    let load = engine.expert_load();
    let runs = || load.as_ref().map_or((0, 0), |l| l.runs());
    let mut last_runs = runs();
    let (mut prefill_runs, mut decode_runs) = ((0u64, 0u64), (0u64, 0u64));
    engine.generate(
        requests,
        |_| sampled += 1,
        |s| {
            let now = runs();
            let d = (now.0 - last_runs.0, now.1 - last_runs.1);
            last_runs = now;
            let into = if s.prefill_tokens > 0 {
                &mut prefill_runs
            } else {
                &mut decode_runs
            };
            into.0 += d.0;
            into.1 += d.1;
            if s.prefill_tokens > 0 {
                prefill.0 += s.prefill_tokens;
                prefill.1 += s.seconds;
                prefill_rows.0 += s.prefill_tokens + s.decode_tokens;
                prefill_rows.1 += s.logit_rows;
                prefill_steps += 1;
                if let Some(o) = s.ops {
                    prefill_op_times += o;
                }
            } else {
                decode.0 += s.decode_tokens;
                decode.1 += s.seconds;
                steps.push(s.seconds * 1e3);
                if let Some(o) = s.ops {
                    ops += o;
                }
                collective.push(s.collective_seconds * 1e3);
                values.push(s.collective_values as f64);
            }
        },
    )?;
    let wall_s = t0.elapsed().as_secs_f64();
    if profiled {
        engine.profile_ops(false);
    }
    let weights_by_op = engine
        .cpu_model()
        .filter(|_| profiled)
        .map(|m| m.weights_by_op())
        .unwrap_or_default();
    // Each op's milliseconds (its seconds × `scale`), weights read in `steps` steps and FLOPs
    // at `rows` rows a projection and `head_rows` through the head.
    // The ops this model has: a dense MLP's three, or a mixture of experts' two.
    let experts = engine.model_config().moe.is_some();
    let lora = !b.adapters.is_empty();
    let has = move |op: &str| match op {
        "gate_up" | "silu" | "down" => !experts,
        "router" | "experts" => experts,
        "lora" => lora,
        _ => true,
    };
    // The experts' weights a step reads: the share `weights_by_op` gives (the `active` experts
    // a row runs) times the experts that ran per routing over `active`.
    let active = engine
        .model_config()
        .moe
        .as_ref()
        .map_or(1, |m| m.active.max(1)) as f64;
    let expert_reads = |(ran, routings): (u64, u64)| match routings {
        0 => 1.0,
        n => ran as f64 / n as f64 / active,
    };
    // A pruning device's last layer runs its output product and MLP only for the rows that
    // want logits (not with adapters): those ops' FLOPs at `rows` rows a layer but the last,
    // `head_rows` there.
    let layers = engine.model_config().num_layers.max(1) as f64;
    let prunes = engine.backend().prunes_last_layer() && !lora;
    // (Summed over the layers and divided after, so that whole counts stay whole.)
    let op_flops = move |op: &str, n: f64, rows: f64, head_rows: f64| match op {
        "o" | "gate_up" | "down" | "router" | "experts" if prunes => {
            2.0 * n * (rows * (layers - 1.0) + head_rows) / layers
        }
        _ => 2.0 * n * rows,
    };
    let shares = |times: &tandem_engine::OpTimes,
                  scale: f64,
                  steps: usize,
                  rows: f64,
                  head_rows: f64,
                  reads: f64,
                  attention_flops: f64| {
        times
            .named()
            .into_iter()
            .filter(|(op, _)| has(op))
            .map(|(op, s)| {
                let (bytes, n) = weights_by_op
                    .iter()
                    .find(|w| w.0 == op)
                    .map_or((0, 0), |w| (w.1, w.2));
                let rows = if op == "head" { head_rows } else { rows };
                let bytes = match op {
                    "experts" => (bytes as f64 * reads).round() as usize,
                    _ => bytes,
                };
                OpShare {
                    op,
                    ms: s * scale,
                    weight_bytes: bytes * steps,
                    flops: match op {
                        "attention" => attention_flops,
                        _ => op_flops(op, n as f64, rows, head_rows),
                    },
                }
            })
            .collect::<Vec<_>>()
    };
    // A decode step's rows: one a sequence, each also a row of the head.
    let rows = decode.0 as f64 / steps.len().max(1) as f64;
    let decode_ops = profiled.then(|| {
        shares(
            &ops,
            1e3 / steps.len().max(1) as f64,
            1,
            rows,
            rows,
            expert_reads(decode_runs),
            // (A decode step's attention reads the cache: its rate against the FMA peak says
            // nothing.)
            0.0,
        )
    });
    let prefill_ops = (profiled && prefill.0 > 0).then(|| {
        shares(
            &prefill_op_times,
            1e3,
            prefill_steps,
            prefill_rows.0 as f64,
            prefill_rows.1 as f64,
            // (Per prefill step: the runs summed over the steps are spread over them.)
            expert_reads(prefill_runs),
            // The prompts' own attention (their random tokens share no prefix). Decode rows
            // that shared a prefill step (a batch whose prompts took several steps) are not
            // counted: the rate is a floor there.
            b.batch as f64
                * match prunes {
                    true => pruned_prompt_attention_flops(engine.model_config(), b.prompt_len),
                    false => prompt_attention_flops(engine.model_config(), b.prompt_len),
                },
        )
    });
    let tp = engine.backend().tp();
    let roof = if engine.backend().is_cpu() {
        roofline::measure()
    } else {
        roofline::Roofline::default()
    };
    let step_ms_p50 = percentile(&mut steps, 0.5);
    let step_ms_p90 = percentile(&mut steps, 0.9);
    let kv_per_token = engine.backend().kv_bytes_per_token();
    let median_ctx = b.prompt_len as f64 + b.gen_len as f64 / 2.0;
    // A mixture of experts' step reads the experts its rows ran, more than one row's `active`.
    let expert_bytes = engine
        .cpu_model()
        .and_then(|m| m.weights_by_op().into_iter().find(|w| w.0 == "experts"))
        .map_or(0.0, |w| w.1 as f64);
    let decode_bytes = engine.backend().weight_bytes() as f64
        + expert_bytes * (expert_reads(decode_runs) - 1.0)
        + b.batch as f64 * median_ctx * kv_per_token;
    let ratio = |x: f64, roof: f64| if roof > 0.0 { x / roof } else { 0.0 };
    let prefill_tok_s = if prefill.1 > 0.0 {
        prefill.0 as f64 / prefill.1
    } else {
        0.0
    };
    // 2 FLOPs per weight per token for the projections; the head runs once per sequence
    // (`prompt_len` tokens a prefill). (Until issue 45's session this counted the head for every
    // prompt token, which overstated a dense model's prefill fraction by the head's share of
    // its weights: SmolLM2's 87% was 69%.)
    // Where the last layer keeps only the rows that want logits, its output product and MLP
    // run once a prompt too.
    let c = engine.model_config();
    let once = match prunes {
        true => last_layer_kept_params(c) as f64,
        false => 0.0,
    };
    let flops_per_token = 2.0
        * (projection_params(c) as f64 - once
            + ((c.vocab_size * c.hidden_size) as f64 + once) / b.prompt_len.max(1) as f64);
    Ok(EngineReport {
        batch: b.batch,
        prompt_len: b.prompt_len,
        gen_len: b.gen_len,
        weights: weights.to_string(),
        device: engine.backend().device(),
        threads: rayon::current_num_threads(),
        simd: tandem_kernels::simd_level(),
        simd_detail: tandem_kernels::isa::active().describe(),
        cpu: roofline::cpu_info(),
        prefill_tok_s,
        decode_tok_s: if decode.1 > 0.0 {
            decode.0 as f64 / decode.1
        } else {
            0.0
        },
        step_ms_p50,
        step_ms_p90,
        mem_bw_gb_s: roof.mem_bw_gb_s,
        f32_gflops: roof.f32_gflops,
        f32_peak_gflops: roof.f32_peak_gflops,
        decode_bytes_per_step: decode_bytes,
        decode_bw_efficiency: if step_ms_p50 > 0.0 {
            ratio(decode_bytes / (step_ms_p50 / 1e3), roof.mem_bw_gb_s * 1e9)
        } else {
            0.0
        },
        prefill_flop_efficiency: ratio(prefill_tok_s * flops_per_token, roof.f32_peak_gflops * 1e9),
        wall_s,
        tp,
        collective_ms_p50: percentile(&mut collective, 0.5),
        collective_values_per_step: percentile(&mut values, 0.5),
        all_reduce: match tp {
            1 => Vec::new(),
            _ => [b.batch * engine.model_config().hidden_size, 1 << 20]
                .into_iter()
                .map(|n| collective::all_reduce_rate(tp, n, 200))
                .collect(),
        },
        constrained_tokens: if b.grammar.is_some() { sampled } else { 0 },
        decode_ops,
        prefill_ops,
        prefill_ms: prefill.1 * 1e3,
        expert_rows: engine
            .expert_load()
            .map(|l| l.snapshot())
            .unwrap_or_default(),
    })
}

/// FLOPs of a prompt's causal attention computed whole: each of its `len` tokens' scores against
/// the keys it sees (itself and those before it, within the model's sliding window) and the
/// sum of their values weighted by the probabilities, two FLOPs a multiply-add, every query head
/// of every layer.
pub fn prompt_attention_flops(c: &tandem_model::ModelConfig, len: usize) -> f64 {
    key_flops(c) * (c.num_layers * prompt_keys(c, len)) as f64
}

/// [`prompt_attention_flops`] where the last layer attends the prompt's last row alone: every
/// layer's keys but the last's, where that row's.
pub fn pruned_prompt_attention_flops(c: &tandem_model::ModelConfig, len: usize) -> f64 {
    let last = len.checked_sub(1).map_or(0, |p| row_keys(c, p));
    key_flops(c) * (c.num_layers.saturating_sub(1) * prompt_keys(c, len) + last) as f64
}

/// The keys a prompt's `len` tokens see in one layer, summed.
fn prompt_keys(c: &tandem_model::ModelConfig, len: usize) -> usize {
    (0..len).map(|p| row_keys(c, p)).sum()
}

/// The keys the token at position `p` sees in one layer: itself and those before it, within the
/// model's sliding window.
fn row_keys(c: &tandem_model::ModelConfig, p: usize) -> usize {
    c.sliding_window.map_or(p + 1, |w| (p + 1).min(w))
}

/// FLOPs of one key seen by one token in one layer: its score and its weighted value, a
/// multiply-add a head dimension each, for every query head.
fn key_flops(c: &tandem_model::ModelConfig) -> f64 {
    (c.num_heads * 2 * 2 * c.head_dim) as f64
}

/// A layer's weights past its q|k|v product (the output product and the MLP, or the router
/// and the experts a token runs): what the last layer runs only for the rows that want logits.
fn last_layer_kept_params(c: &tandem_model::ModelConfig) -> usize {
    c.hidden_size * (c.num_heads * c.head_dim) + mlp_params(c)
}

/// A layer's MLP weights a token runs: the dense MLP's, or a mixture of experts' router and
/// the experts a token runs.
fn mlp_params(c: &tandem_model::ModelConfig) -> usize {
    let h = c.hidden_size;
    match &c.moe {
        None => 3 * h * c.intermediate_size,
        Some(m) => h * m.experts + 3 * h * m.expert_ff * m.active,
    }
}

/// Weights in the layers' projections (attention and MLP), the head not included.
pub(crate) fn projection_params(c: &tandem_model::ModelConfig) -> usize {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let per_layer = h * (c.num_heads * hd) * 2 + h * (c.num_kv_heads * hd) * 2 + mlp_params(c);
    c.num_layers * per_layer
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two layers of four query heads of 8 (over two KV heads), with a sliding window or not.
    fn small(window: Option<usize>) -> tandem_model::ModelConfig {
        let mut c = serde_json::json!({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100});
        if let Some(w) = window {
            c["sliding_window"] = w.into();
        }
        tandem_model::ModelConfig::from_hf_json(&c.to_string()).unwrap()
    }

    #[test]
    fn a_prompts_attention_counts_the_keys_each_token_sees() {
        // 512 tokens see 1 + 2 + … + 512 keys: 131,328. Each key costs a score and a weighted
        // value, 8 multiply-adds each, for 4 heads in 2 layers.
        let per_key = 2.0 * 4.0 * 4.0 * 8.0;
        let c = small(None);
        assert_eq!((c.head_dim, c.sliding_window), (8, None));
        assert_eq!(prompt_attention_flops(&c, 512), per_key * 131_328.0);
        assert_eq!(prompt_attention_flops(&c, 0), 0.0);
        // A window of 4: the first tokens see 1, 2, 3 keys, every later one 4.
        let c = small(Some(4));
        assert_eq!(c.sliding_window, Some(4));
        assert_eq!(
            prompt_attention_flops(&c, 10),
            per_key * (1 + 2 + 3 + 4 * 7) as f64
        );
    }

    #[test]
    fn a_last_layer_of_one_row_counts_that_rows_keys_and_weights_alone() {
        // Two layers: the first attends 1 + … + 10 = 55 keys, the last the last row's 10; each
        // key of a layer 8 multiply-adds for its score and 8 for its value, for 4 heads.
        let per_key = 4.0 * 4.0 * 8.0;
        let c = small(None);
        assert_eq!(
            pruned_prompt_attention_flops(&c, 10),
            per_key * (55.0 + 10.0)
        );
        assert_eq!(
            pruned_prompt_attention_flops(&c, 1),
            prompt_attention_flops(&c, 1)
        );
        assert_eq!(pruned_prompt_attention_flops(&c, 0), 0.0);
        // Within a window of 4: the first layer 1 + 2 + 3 + 4·7 = 34 keys, the last row 4.
        let c = small(Some(4));
        assert_eq!(
            pruned_prompt_attention_flops(&c, 10),
            per_key * (34.0 + 4.0)
        );
        // The output product (32 × 32) and the MLP (3 × 32 × 64) of a layer.
        assert_eq!(last_layer_kept_params(&c), 32 * 32 + 3 * 32 * 64);
    }
}
