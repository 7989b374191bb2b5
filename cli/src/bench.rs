//! `tandem bench`: the engine's throughput beside this machine's roofline, the KV transfer
//! against a plain TCP copy, the GPU figures, and (in `bench_serve`) a router under load.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use tandem_bench::workload::{self, Policy, Workload};
use tandem_engine::{Engine, KvDtype};

use crate::{bench_serve, fetch, EngineArgs};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Engine throughput (prefill, decode) next to this machine's measured roofline.
    Engine(Box<BenchEngineArgs>),
    /// Load an OpenAI-compatible server (or two side by side) with a dataset and an arrival
    /// process: TTFT, inter-token, TPOT and end-to-end percentiles, throughput, goodput, the
    /// servers' own counters, an HTML report (a local cluster against the engine alone when no
    /// --url is given).
    Serve(Box<bench_serve::BenchServeArgs>),
    /// Serve a coordinator's share of a distributed load (`bench serve --agents`).
    Agent(bench_serve::BenchAgentArgs),
    /// KV transfer throughput over loopback against a plain TCP copy of the same bytes.
    KvTransfer(BenchKvArgs),
    /// Time to first token of a long prompt whose KV is computed, read back from the disk tier
    /// (from the disk, and from the page cache), or found in the pool; the prefill rate beside
    /// the tier's read rate.
    KvTiers(Box<BenchTiersArgs>),
    /// A worker kind's profile for `tandem plan`: its prefill rate and its decode step's time
    /// by batch size, measured with the engine the workers run, saved as JSON.
    Profile(Box<crate::plan::BenchProfileArgs>),
    /// GPU figures for a Llama-3-8B-shaped model with random bf16 weights: copy bandwidth, bf16
    /// GEMM rate, decode step time against the roofline, prefill MFU, decode attention bandwidth.
    Gpu(BenchGpuArgs),
}

#[derive(Args)]
pub struct BenchGpuArgs {
    /// The GPU: cuda or cuda:N.
    #[arg(long, default_value = "cuda:0")]
    device: tandem_kernels::cuda::DeviceSpec,
    /// Decode batch sizes (1k-token contexts each).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    batches: Vec<usize>,
    /// One JSON line instead of a table.
    #[arg(long)]
    json: bool,
}

fn bench_gpu(a: BenchGpuArgs) -> Result<()> {
    let tandem_kernels::cuda::DeviceSpec::Cuda(ordinal) = a.device else {
        anyhow::bail!("bench gpu needs a CUDA device (--device cuda:N)");
    };
    let r = tandem_bench::gpu::run(ordinal, &a.batches)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "gpu bench: {} (Llama-3-8B shape, random bf16 weights)",
        r.device
    );
    println!(
        "  copy bandwidth   {:>10.1} GB/s (read + write)",
        r.copy_gb_s
    );
    match (r.peak_tflops, r.gemm_of_peak) {
        (Some(p), Some(f)) => println!(
            "  bf16 GEMM        {:>10.1} TFLOP/s (8192³, f32 accumulation), {:.1}% of the card's {p:.0}",
            r.gemm_tflops,
            100.0 * f
        ),
        _ => println!(
            "  bf16 GEMM        {:>10.1} TFLOP/s (8192³, f32 accumulation; no peak known for this card)",
            r.gemm_tflops
        ),
    }
    for p in &r.products {
        let (m, n, k) = p.mnk;
        println!(
            "  product {m:>4}×{n:>5}×{k:>5}  {:>9.1} µs  {:>6.0} GB/s  {:>6.1} TFLOP/s  fallback {:>9.1} µs ({:.1}×)",
            p.us,
            p.gb_s,
            p.tflops,
            p.fallback_us,
            p.fallback_us / p.us
        );
    }
    let named = |ops: &[(String, f64)], digits: usize| -> String {
        let ops: Vec<String> = ops
            .iter()
            .map(|(n, ms)| format!("{n} {ms:.digits$}"))
            .collect();
        ops.join(", ")
    };
    for d in &r.decode {
        println!(
            "  decode batch {:>3}  {:>8.2} ms/step  roofline {:>6.2} ms  {:>5.1}% of roofline  {:>8.0} tok/s  ({}; eager {:.2} ms, {:.1}%)",
            d.batch,
            d.step_ms,
            d.roofline_ms,
            100.0 * d.of_roofline,
            d.tok_s,
            if d.graph { "a CUDA graph" } else { "no graph: its capture failed" },
            d.eager_ms,
            100.0 * d.roofline_ms / d.eager_ms
        );
        if !d.ops_ms.is_empty() {
            println!(
                "    an eager step on the device {:.2} ms: {}, between ops {:.2}; paced by the host {:.2} ms",
                d.device_ms,
                named(&d.ops_ms, 2),
                d.device_gaps_ms,
                d.paced_ms
            );
        }
    }
    println!(
        "  prefill {} tok   {:>10.0} tok/s  MFU {:.1}% ({}), {:.1}% of the measured GEMM rate",
        r.prefill_tokens,
        r.prefill_tok_s,
        100.0 * r.prefill_mfu,
        if r.peak_tflops.is_some() {
            "of the card's peak"
        } else {
            "of the measured GEMM rate: no peak known"
        },
        100.0 * r.prefill_of_gemm
    );
    if !r.prefill_ops_ms.is_empty() {
        println!(
            "    the prefill step on the device, ms: {}",
            named(&r.prefill_ops_ms, 1)
        );
    }
    println!(
        "  decode attention {:>10.1} GB/s  {:.1}% of the copy bandwidth",
        r.attention_gb_s,
        100.0 * r.attention_of_copy
    );
    Ok(())
}

#[derive(Args)]
pub struct BenchTiersArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt lengths to time.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    prompt_tokens: Vec<usize>,
    /// Rounds per length (medians are reported), each with a prompt of its own.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long)]
    json: bool,
}

/// One prompt length's medians (seconds to the first token).
#[derive(serde::Serialize)]
struct TierTimes {
    prompt_tokens: usize,
    compute_s: f64,
    disk_s: f64,
    page_cache_s: f64,
    pool_s: f64,
    /// Payload bytes read back per second from the disk (the tier's own count).
    disk_read_gb_s: f64,
}

fn bench_tiers(mut a: BenchTiersArgs) -> Result<()> {
    // The tier in a directory of its own (under --kv-disk-dir when given: put it on the disk
    // to measure), removed afterwards.
    let base = a
        .engine
        .kv_disk_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base)?;
    let dir = tempfile::tempdir_in(&base)?;
    a.engine.kv_disk_dir = Some(dir.path().to_path_buf());
    let longest = a.prompt_tokens.iter().copied().max().unwrap_or(0);
    a.engine.max_batched_tokens = a.engine.max_batched_tokens.max(longest);
    let (mut engine, loaded) = a.engine.build()?;
    let vocab = loaded.config.vocab_size as u64;
    let bs = a.engine.block_size;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let ttft = |engine: &mut tandem_engine::Engine, prompt: &[u32]| -> Result<f64> {
        let r = tandem_engine::Request::greedy(prompt.to_vec(), 1)?;
        let out = engine.generate(vec![r], |_| {}, |_| {})?;
        Ok(out[0].ttft_s)
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows = Vec::new();
    for &len in &a.prompt_tokens {
        anyhow::ensure!(
            len > bs,
            "--prompt-tokens {len}: longer than a block, please"
        );
        let (mut compute, mut disk, mut page, mut pool, mut rates) =
            (vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..a.rounds.max(1) {
            let prompt: Vec<u32> = (0..len).map(|_| (next() % vocab) as u32).collect();
            compute.push(ttft(&mut engine, &prompt)?);
            // Out of the pool, onto the disk, and out of the page cache.
            engine.clear_prefix_cache();
            let tier = engine.disk_tier().expect("configured");
            tier.flush();
            let hashes: Vec<u64> = tandem_model::block_hashes(&prompt[..len - 1], bs)
                .iter()
                .map(|h| h.0)
                .collect();
            let cold = hashes.iter().all(|&h| drop_cached_pages(&tier.path_of(h)));
            let before = tier.stats();
            let t = ttft(&mut engine, &prompt)?;
            let after = engine.disk_tier().expect("configured").stats();
            if cold {
                disk.push(t);
                rates.push(
                    (after.read_bytes - before.read_bytes) as f64
                        / (after.read_seconds - before.read_seconds).max(1e-9)
                        / 1e9,
                );
            }
            // Again from the page cache (the files were just read).
            engine.clear_prefix_cache();
            page.push(ttft(&mut engine, &prompt)?);
            pool.push(ttft(&mut engine, &prompt)?);
        }
        rows.push(TierTimes {
            prompt_tokens: len,
            compute_s: median(compute),
            disk_s: if disk.is_empty() {
                f64::NAN
            } else {
                median(disk)
            },
            page_cache_s: median(page),
            pool_s: median(pool),
            disk_read_gb_s: if rates.is_empty() {
                f64::NAN
            } else {
                median(rates)
            },
        });
    }
    if a.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    let kv_per_token = engine.stats().disk_tier.map_or(0.0, |t| {
        t.write_bytes as f64 / (t.writes.max(1) * bs as u64) as f64
    });
    println!(
        "kv tiers: {} [{}], {}, KV {:.1} KiB a token, tier in {}",
        a.engine
            .model
            .as_deref()
            .map_or("the default model".into(), |p| p.display().to_string()),
        tandem_bench::roofline::cpu_info(),
        tandem_kernels::isa::summary(),
        kv_per_token / 1024.0,
        base.display()
    );
    println!("  prompt   computed     disk (read)    page cache   pool      computed / disk");
    for r in &rows {
        println!(
            "  {:>6}   {:>7.1} ms   {:>7.1} ms ({:.2} GB/s)   {:>7.1} ms   {:>6.1} ms   {:.1}x",
            r.prompt_tokens,
            r.compute_s * 1e3,
            r.disk_s * 1e3,
            r.disk_read_gb_s,
            r.page_cache_s * 1e3,
            r.pool_s * 1e3,
            r.compute_s / r.disk_s
        );
    }
    if rows.iter().any(|r| r.disk_s.is_nan()) {
        println!("  (disk: the system kept the files in its page cache; the disk column is empty)");
    }
    Ok(())
}

/// Asks the kernel to drop a file's pages from its cache (written back first), so the next
/// read comes from the disk; false where it cannot say it did.
fn drop_cached_pages(path: &std::path::Path) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    if f.sync_all().is_err() {
        return false;
    }
    // SAFETY: a valid descriptor; the advice changes no file contents.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
}

#[derive(Args)]
pub struct BenchKvArgs {
    /// Model whose KV layout to use (the default model when not given).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Prompt lengths whose KV blocks to transfer.
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    prompt_tokens: Vec<usize>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value = "f32")]
    kv_dtype: KvDtype,
    /// Alternating rounds (medians are reported).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    #[arg(long)]
    json: bool,
}

fn bench_kv(a: BenchKvArgs) -> Result<()> {
    let path = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model()?,
    };
    let m = tandem_model::load_text(&path)?;
    let layout = tandem_kernels::KvLayout {
        block_size: a.block_size,
        num_kv_heads: m.config.num_kv_heads,
        head_dim: m.config.head_dim,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let rows = rt
        .block_on(tandem_bench::kv::run(
            layout,
            a.kv_dtype,
            m.config.num_layers,
            &a.prompt_tokens,
            a.rounds,
        ))
        .map_err(|e| anyhow::anyhow!(e))?;
    let sums = tandem_bench::kv::checksum_rates(
        tandem_engine::KvPool::frame_bytes(layout, a.kv_dtype),
        a.rounds,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    if a.json {
        println!("{}", serde_json::to_string(&sums)?);
    } else {
        println!(
            "frame checksum ({} B frames, 64 MiB): xxh3 crate {:.1} GB/s, wire format {:.1} GB/s ({:.2}x)",
            sums.frame_bytes, sums.crate_gb_s, sums.wire_gb_s, sums.wire_gb_s / sums.crate_gb_s
        );
    }
    for r in rows {
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            println!(
                "{:>5} tokens {:>4} blocks {:>7.1} MB: kv transfer {:>7.2} ms ({:>5.2} GB/s), plain TCP copy {:>7.2} ms ({:>5.2} GB/s), transfer / TCP {:.2}x; cache-resident TCP {:>7.2} ms, {:.2}x",
                r.prompt_tokens, r.blocks, r.bytes as f64 / 1e6, r.transfer_ms, r.transfer_gb_s, r.tcp_ms, r.tcp_gb_s, r.ratio, r.tcp_cached_ms, r.ratio_cached
            );
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct BenchEngineArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Concurrent sequences.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Generated tokens per sequence.
    #[arg(long, default_value_t = 128)]
    gen_len: usize,
    /// Seed for the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Serve a workload instead of one batch: mixed (prompts 20-1000, outputs 10-300 tokens) or
    /// shared-prefix (a 500-token system prompt and a short question).
    #[arg(long)]
    workload: Option<Workload>,
    /// Batching policies to compare on the workload (comma-separated): sequential; static
    /// (batches of 16 that wait for their longest member, run as one fixed batch: prompts padded
    /// to the longest, every row stepped to the longest output); static-packed (the same batches
    /// without padding: a row leaves when its request is done); continuous.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "sequential,static,static-packed,continuous"
    )]
    policy: Vec<Policy>,
    /// Requests in the workload (default: 200 mixed, 64 shared-prefix).
    #[arg(long)]
    requests: Option<usize>,
    /// One JSON line (per run) instead of a table.
    #[arg(long)]
    json: bool,
    /// Time each op of the steps' forward (each op waited for before the next starts) and print
    /// the prefill's split and a decode step's: milliseconds, share and, for the products, the
    /// rates they read their weights at and compute at.
    #[arg(long)]
    profile: bool,
    /// Also decode under this JSON Schema (a file; bench/schemas/records.json never ends) and
    /// compare: unconstrained and constrained runs alternate, twice each, and the best of each
    /// is reported with their ratio.
    #[arg(long)]
    json_schema: Option<PathBuf>,
    /// Also decode with this many random LoRA adapters (PEFT files written to a temporary
    /// directory and read back as `--lora` reads them), the batch spread over them round-robin,
    /// and compare with the base: the runs alternate, twice each, best of each reported with
    /// their ratio, beside each adapter's read time and memory.
    #[arg(long, default_value_t = 0)]
    loras: usize,
    /// The random adapters' rank.
    #[arg(long, default_value_t = 16)]
    lora_rank: usize,
    /// The random adapters' target modules (comma-separated among q_proj, k_proj, v_proj,
    /// o_proj, gate_proj, up_proj, down_proj; default all seven).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )]
    lora_targets: Vec<String>,
    /// Run the batch this many times (each round its own random prompts, from --seed on, so no
    /// round finds another's in the prefix cache), each measured against the roofline taken
    /// right after it: a line per round, then the round with the median prefill rate against
    /// its peak in full. On a machine whose speed moves (a shared VM) the median of a few
    /// rounds, each over its own peak, says more than one run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100),
          conflicts_with_all = ["workload", "json_schema", "loras"])]
    rounds: u32,
}

/// Serves a workload under each policy (and, for shared-prefix, continuous without the prefix
/// cache), printing output tokens/s next to the roofline bound of the steps each policy ran, and
/// continuous's ratios to the others, measured and bound.
fn bench_workload(a: &BenchEngineArgs, engine: &mut Engine, w: Workload) -> Result<()> {
    let n = a.requests.unwrap_or(w.default_requests());
    let vocab = engine.model_config().vocab_size as u32;
    let roof = engine
        .backend()
        .is_cpu()
        .then(tandem_bench::roofline::measure);
    if let (Some(r), false) = (&roof, a.json) {
        println!(
            "roofline: {:.1} GB/s copy, {:.1} GFLOP/s f32 FMA peak; a bound prices each step the engine ran at the slower of the two",
            r.mem_bw_gb_s, r.f32_peak_gflops
        );
    }
    let mut runs = Vec::new();
    let mut plan: Vec<(Policy, bool)> = a.policy.iter().map(|&p| (p, true)).collect();
    if w == Workload::SharedPrefix && a.policy.contains(&Policy::Continuous) {
        plan.push((Policy::Continuous, false));
    }
    for (p, cache) in plan {
        engine.config.prefix_caching = cache && !a.engine.no_prefix_caching;
        let r = workload::run(engine, w, p, w.requests(n, vocab, a.seed), roof.as_ref())?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            let bound = match (r.roofline_output_tok_s, r.roofline_s, r.roofline_decode_steps_s) {
                (Some(b), Some(all), Some(decode)) => format!(
                    "  bound {b:>6.1} ({:>3.0}% of it; steps with prefill {:.1} s for {:.1} s bound, decode only {:.1} s for {:.1})",
                    100.0 * r.output_tok_s / b,
                    r.prefill_steps_s,
                    all - decode,
                    r.decode_steps_s,
                    decode
                ),
                _ => String::new(),
            };
            println!(
                "{:>13} {:<12} {:>4} req  {:>7.1} out tok/s{bound}  computed {:>6} tok  wall {:>6.1} s  prefix hits {:>5.1}%  ttft p50 {:>6.2} s  preempted {}",
                r.policy.name(),
                if r.prefix_caching { "prefix cache" } else { "no cache" },
                r.requests,
                r.output_tok_s,
                r.computed_tokens,
                r.wall_s,
                100.0 * r.prefix_hit_rate,
                r.ttft_s_p50,
                r.preemptions
            );
        }
        runs.push(r);
    }
    if a.json {
        return Ok(());
    }
    let Some(c) = runs
        .iter()
        .find(|r| r.policy == Policy::Continuous && r.prefix_caching)
    else {
        return Ok(());
    };
    for r in runs.iter().filter(|r| !std::ptr::eq(*r, c)) {
        let bound = match (c.roofline_s, r.roofline_s) {
            // Output tokens per bound second, continuous over the other.
            (Some(cb), Some(rb)) => format!(
                "  (bound of the two schedules: {:.2}x)",
                (c.output_tokens as f64 / cb) / (r.output_tokens as f64 / rb)
            ),
            _ => String::new(),
        };
        println!(
            "continuous / {} ({}): {:.2}x{bound}",
            r.policy.name(),
            if r.prefix_caching {
                "prefix cache"
            } else {
                "no cache"
            },
            c.output_tok_s / r.output_tok_s
        );
    }
    Ok(())
}

fn bench_engine(a: BenchEngineArgs) -> Result<()> {
    let (mut engine, _) = a.engine.build()?;
    if let Some(w) = a.workload {
        return bench_workload(&a, &mut engine, w);
    }
    let b = tandem_bench::EngineBench {
        batch: a.batch,
        prompt_len: a.prompt_len,
        gen_len: a.gen_len,
        seed: a.seed,
        grammar: None,
        profile: a.profile,
        adapters: Vec::new(),
    };
    let weights = format!("{:?}", a.engine.weights).to_lowercase();
    if let Some(path) = &a.json_schema {
        return bench_constrained(&a, &mut engine, b, &weights, path);
    }
    if a.loras > 0 {
        return bench_lora(&a, &mut engine, b, &weights);
    }
    let mut reports = Vec::new();
    for round in 0..a.rounds {
        let b = tandem_bench::EngineBench {
            seed: a.seed.wrapping_add(round.into()),
            ..b.clone()
        };
        let r = tandem_bench::run_engine_bench(&mut engine, &b, &weights)?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else if a.rounds > 1 {
            println!("{}", round_line(round, &r));
        }
        reports.push(r);
    }
    let r = median_round(reports);
    if a.rounds > 1 && !a.json {
        println!("the median round by the prefill's rate against its peak, in full:");
    }
    if !a.json {
        let on_cpu = r.device.starts_with("cpu");
        if on_cpu {
            println!(
                "engine bench: batch {} prompt {} gen {} weights {} threads {} tp {}{}",
                r.batch,
                r.prompt_len,
                r.gen_len,
                r.weights,
                r.threads,
                r.tp,
                // An expert-parallel group says so (its attention is one rank's: tp 1).
                r.device
                    .strip_prefix("cpu, ep ")
                    .map(|n| format!(" ep {n}"))
                    .unwrap_or_default()
            );
            println!("  cpu            {}", r.cpu);
            println!(
                "  kernels        {:>10}   ({}; TANDEM_ISA caps it)",
                r.simd, r.simd_detail
            );
            println!(
                "  prefill        {:>10.1} tok/s   ({:.0}% of the f32 FMA peak)",
                r.prefill_tok_s,
                100.0 * r.prefill_flop_efficiency
            );
        } else {
            println!(
                "engine bench: batch {} prompt {} gen {} on {} (bf16)",
                r.batch, r.prompt_len, r.gen_len, r.device
            );
            println!("  prefill        {:>10.1} tok/s", r.prefill_tok_s);
        }
        println!(
            "  decode         {:>10.1} tok/s   (all sequences)",
            r.decode_tok_s
        );
        println!(
            "  step p50/p90   {:>10.2} / {:.2} ms",
            r.step_ms_p50, r.step_ms_p90
        );
        if r.tp > 1 {
            println!(
                "  tp {}           {:>10.2} ms compute + {:.2} ms collectives a decode step ({:.0}%; {:.0} KB a rank)",
                r.tp,
                r.step_ms_p50 - r.collective_ms_p50,
                r.collective_ms_p50,
                100.0 * r.collective_ms_p50 / r.step_ms_p50.max(1e-9),
                r.collective_values_per_step * 4.0 / 1e3
            );
            for a in &r.all_reduce {
                println!(
                    "  all-reduce     {:>10.1} KB: {:.1} us, {:.2} GB/s ({:.0}% of the copy rate)",
                    a.bytes as f64 / 1e3,
                    a.us,
                    a.gb_s,
                    100.0 * a.gb_s / r.mem_bw_gb_s.max(1e-9)
                );
            }
        }
        if !on_cpu {
            println!("  (the GPU's roofline: tandem bench gpu)");
            return Ok(());
        }
        println!(
            "  roofline       {:>10.1} GB/s copy, {:.1} GFLOP/s f32 FMA peak with {} instructions ({:.1} the products' own f32 GEMM)",
            r.mem_bw_gb_s, r.f32_peak_gflops, r.simd, r.f32_gflops
        );
        println!(
            "  decode reads   {:>10.1} MB/step = {:.0}% of bandwidth",
            r.decode_bytes_per_step / 1e6,
            100.0 * r.decode_bw_efficiency
        );
        if let Some(ops) = &r.prefill_ops {
            let title = format!(
                "prefill by op ({} prompt tokens, ms of the whole prefill and share of its {:.2} ms):",
                r.batch * r.prompt_len,
                r.prefill_ms
            );
            print_ops(&title, ops, r.prefill_ms, &r);
        }
        if let Some(ops) = &r.decode_ops {
            print_ops(
                "decode step by op (mean ms a step, share of the p50 step):",
                ops,
                r.step_ms_p50,
                &r,
            );
        }
        if !r.expert_rows.is_empty() {
            let rows = &r.expert_rows;
            let total: u64 = rows.iter().sum();
            let mean = total as f64 / rows.len() as f64;
            let max = rows.iter().copied().max().unwrap_or(0);
            println!(
                "  expert rows     {total} over {} experts (all layers): min {}, mean {mean:.1}, max {max} (the busiest {:.2}x the mean)",
                rows.len(),
                rows.iter().copied().min().unwrap_or(0),
                if mean > 0.0 { max as f64 / mean } else { 0.0 }
            );
        }
    }
    if a.profile && r.decode_ops.is_none() && !a.json {
        println!("  (no per-op profile: only the CPU backend with one rank times its ops)");
    }
    Ok(())
}

/// One round of `bench engine --rounds`: its prefill and decode rates, and on the CPU the
/// prefill's share of the FMA peak measured right after it.
fn round_line(round: u32, r: &tandem_bench::EngineReport) -> String {
    let peak = match r.f32_peak_gflops {
        p if p > 0.0 => format!(
            " ({:.0}% of {:.1} GFLOP/s, the FMA peak after it)",
            100.0 * r.prefill_flop_efficiency,
            p
        ),
        _ => String::new(),
    };
    format!(
        "round {round}: prefill {:.1} tok/s{peak}, decode {:.1} tok/s, step p50 {:.2} ms",
        r.prefill_tok_s, r.decode_tok_s, r.step_ms_p50
    )
}

/// The middle round (the lower middle of an even count) with the rounds ordered by their
/// prefill's share of their own FMA peak; by the prefill rate alone where no peak was measured
/// (a GPU).
fn median_round(mut reports: Vec<tandem_bench::EngineReport>) -> tandem_bench::EngineReport {
    let key = |r: &tandem_bench::EngineReport| match r.prefill_flop_efficiency {
        e if e > 0.0 => e,
        _ => r.prefill_tok_s,
    };
    reports.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let mid = (reports.len() - 1) / 2;
    reports.swap_remove(mid)
}

/// A split by op (the prefill's or a decode step's): milliseconds, share of `total_ms`, and for
/// the products the rates they read their weights at and compute at, against the copy rate and
/// the FMA peak (one bounds a batch of one, the other a large batch or a prompt).
fn print_ops(
    title: &str,
    ops: &[tandem_bench::OpShare],
    total_ms: f64,
    r: &tandem_bench::EngineReport,
) {
    let step = total_ms.max(1e-9);
    println!("  {title}");
    for o in ops.iter().filter(|o| o.ms > 0.0) {
        let secs = o.ms / 1e3;
        // The weights a product reads, at what rate (blank where an op has none, so the FLOP
        // rates line up).
        let reads = match o.weight_bytes {
            0 => String::new(),
            b => {
                let gb_s = b as f64 / secs / 1e9;
                format!(
                    "{:>6.1} MB of weights at {gb_s:>5.1} GB/s ({:>2.0}% of the copy rate), ",
                    b as f64 / 1e6,
                    100.0 * gb_s / r.mem_bw_gb_s.max(1e-9)
                )
            }
        };
        // A product's FLOPs, or the prefill's attention's.
        let rate = match o.flops {
            f if f > 0.0 => {
                let gflop_s = f / secs / 1e9;
                format!(
                    "  {reads:>59}{gflop_s:>6.1} GFLOP/s ({:>2.0}% of the FMA peak)",
                    100.0 * gflop_s / r.f32_peak_gflops.max(1e-9)
                )
            }
            _ => String::new(),
        };
        println!(
            "    {:<12} {:>8.2} ms {:>5.1}%{rate}",
            o.op,
            o.ms,
            100.0 * o.ms / step
        );
    }
    let timed: f64 = ops.iter().map(|o| o.ms).sum();
    println!(
        "    {:<12} {:>8.2} ms {:>5.1}%  (sampling, scheduling and the gaps between ops)",
        "other",
        (step - timed).max(0.0),
        100.0 * (step - timed).max(0.0) / step
    );
}

/// Decode with and without a JSON Schema constraint, alternating, best of two each.
fn bench_constrained(
    a: &BenchEngineArgs,
    engine: &mut Engine,
    b: tandem_bench::EngineBench,
    weights: &str,
    schema: &std::path::Path,
) -> Result<()> {
    let text = std::fs::read_to_string(schema)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", schema.display()))?;
    let constrained = tandem_bench::EngineBench {
        grammar: Some(tandem_grammar::Grammar::JsonSchema(text)),
        ..b.clone()
    };
    let (mut free, mut held) = (0f64, 0f64);
    for round in 0..2 {
        for (run, best) in [(&b, &mut free), (&constrained, &mut held)] {
            let r = tandem_bench::run_engine_bench(engine, run, weights)?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "round {round} {:<13} decode {:>8.1} tok/s  step p50 {:>7.2} ms  ({} tokens under the grammar)",
                    if run.grammar.is_some() { "json schema" } else { "unconstrained" },
                    r.decode_tok_s,
                    r.step_ms_p50,
                    r.constrained_tokens,
                );
            }
            *best = best.max(r.decode_tok_s);
        }
    }
    if !a.json {
        println!(
            "batch {}: json schema / unconstrained decode = {:.3} ({:.1} / {:.1} tok/s, best of 2 each; cpu {}; kernels {})",
            b.batch,
            held / free,
            held,
            free,
            tandem_bench::roofline::cpu_info().model,
            tandem_kernels::simd_level()
        );
    }
    Ok(())
}

/// The base against `a.loras` random adapters (see [`BenchEngineArgs::loras`]).
fn bench_lora(
    a: &BenchEngineArgs,
    engine: &mut Engine,
    b: tandem_bench::EngineBench,
    weights: &str,
) -> Result<()> {
    use tandem_model::LoraTarget;
    let c = engine.model_config().clone();
    let targets = a
        .lora_targets
        .iter()
        .map(|m| {
            LoraTarget::ALL
                .into_iter()
                .find(|t| t.module() == m)
                .ok_or_else(|| anyhow::anyhow!("--lora-targets: unknown module {m:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let tmp = tempfile::tempdir()?;
    let mut adapters = Vec::new();
    let mut read_s = Vec::new();
    for i in 0..a.loras {
        let dir = tmp.path().join(format!("lora-{i}"));
        let rank = a.lora_rank;
        tandem_model::write_random_lora(&dir, &c, rank, 2.0 * rank as f32, &targets, i as u64)?;
        let t0 = std::time::Instant::now();
        let ad = tandem_model::load_lora(&format!("lora-{i}"), &dir, &c, rank)?;
        read_s.push(t0.elapsed().as_secs_f64());
        adapters.push(std::sync::Arc::new(ad));
    }
    let with = tandem_bench::EngineBench {
        adapters: adapters.clone(),
        ..b.clone()
    };
    let (mut base, mut lora) = (0f64, 0f64);
    for round in 0..2 {
        for (run, best) in [(&b, &mut base), (&with, &mut lora)] {
            engine.clear_prefix_cache();
            let r = tandem_bench::run_engine_bench(engine, run, weights)?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "round {round} {:<16} decode {:>8.1} tok/s  step p50 {:>7.2} ms",
                    match run.adapters.len() {
                        0 => "base".to_string(),
                        n => format!("{n} adapters"),
                    },
                    r.decode_tok_s,
                    r.step_ms_p50,
                );
            }
            *best = best.max(r.decode_tok_s);
        }
    }
    if !a.json {
        let bytes = adapters[0].bytes();
        let mean_ms = 1e3 * read_s.iter().sum::<f64>() / read_s.len() as f64;
        println!(
            "adapter: rank {}, {} targets, {:.2} MB in memory (f32), read and checked in {:.1} ms (mean of {})",
            a.lora_rank,
            targets.len(),
            bytes as f64 / 1e6,
            mean_ms,
            read_s.len()
        );
        println!(
            "batch {} over {} adapters / base decode = {:.3} ({:.1} / {:.1} tok/s, best of 2 each; weights {}; cpu {}; kernels {})",
            b.batch,
            a.loras,
            lora / base,
            lora,
            base,
            weights,
            tandem_bench::roofline::cpu_info().model,
            tandem_kernels::simd_level()
        );
    }
    Ok(())
}

/// Runs one `tandem bench` command.
pub fn run(what: BenchCommand) -> Result<()> {
    match what {
        BenchCommand::Engine(a) => bench_engine(*a),
        BenchCommand::Serve(a) => bench_serve::run(*a),
        BenchCommand::Agent(a) => bench_serve::run_agent(a),
        BenchCommand::KvTransfer(a) => bench_kv(a),
        BenchCommand::KvTiers(a) => bench_tiers(*a),
        BenchCommand::Gpu(a) => bench_gpu(a),
        BenchCommand::Profile(a) => crate::plan::bench_profile(*a),
    }
}
