//! `tandem plan`: how many prefill and decode workers a load needs (the model in
//! `tandem_bench::plan`), and `tandem bench profile`, which measures a worker kind for it.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_bench::plan::{self, sim, DecodePoint, Load, Profile, Targets};

use crate::EngineArgs;

#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    /// A worker kind's profile (JSON, from `tandem bench profile`): the decode workers', and the
    /// prefill workers' unless --prefill-profile is given.
    #[arg(long)]
    profile: PathBuf,
    /// The prefill workers' profile, when they differ from the decode workers.
    #[arg(long)]
    prefill_profile: Option<PathBuf>,
    /// Requests a second (Poisson arrivals).
    #[arg(long)]
    rate: f64,
    /// Prompt tokens, MIN-MAX (uniform) or one number.
    #[arg(long, default_value = "200")]
    prompt_len: String,
    /// Output tokens, MIN-MAX (uniform) or one number.
    #[arg(long, default_value = "128")]
    gen_len: String,
    /// Target for the 90th percentile time to first token, ms.
    #[arg(long, default_value_t = 2000.0)]
    ttft_ms: f64,
    /// Target for the mean inter-token gap, ms (the decode workers run with this
    /// --itl-target-ms).
    #[arg(long, default_value_t = 50.0)]
    itl_ms: f64,
    /// Most workers of each role to consider.
    #[arg(long, default_value_t = 16)]
    max_workers: usize,
    /// Also simulate the best shapes step by step (the same profiles), as a check of the model.
    #[arg(long)]
    simulate: bool,
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// `A-B` or `N` as an inclusive range.
fn range(s: &str, what: &str) -> Result<(usize, usize)> {
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let (a, b): (usize, usize) = (
        a.trim().parse().with_context(|| format!("{what} {s:?}"))?,
        b.trim().parse().with_context(|| format!("{what} {s:?}"))?,
    );
    if a == 0 || a > b {
        bail!("{what} {s:?}: MIN-MAX with 1 <= MIN <= MAX");
    }
    Ok((a, b))
}

fn read_profile(path: &PathBuf) -> Result<Profile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let p: Profile =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    p.check().map_err(anyhow::Error::msg)?;
    Ok(p)
}

pub fn run(a: PlanArgs) -> Result<()> {
    let decode = read_profile(&a.profile)?;
    let prefill = match &a.prefill_profile {
        Some(p) => read_profile(p)?,
        None => decode.clone(),
    };
    let load = Load {
        rate: a.rate,
        prompt: range(&a.prompt_len, "--prompt-len")?,
        output: range(&a.gen_len, "--gen-len")?,
    };
    load.check().map_err(anyhow::Error::msg)?;
    if !(a.ttft_ms > 0.0 && a.itl_ms > 0.0) {
        bail!("--ttft-ms and --itl-ms must be positive");
    }
    let targets = Targets {
        ttft_p90_ms: a.ttft_ms,
        itl_ms: a.itl_ms,
    };
    let p = plan::plan(&prefill, &decode, &load, &targets, a.max_workers.max(1));
    // The cheapest shapes that meet the targets, and the nearest that do not.
    let mut shown: Vec<_> = p
        .tried
        .iter()
        .filter(|e| e.ttft_p90_ms.is_finite())
        .collect();
    shown.sort_by(|x, y| x.cores.cmp(&y.cores).then(x.itl_ms.total_cmp(&y.itl_ms)));
    shown.truncate(12);
    let simulated: Vec<_> = if a.simulate {
        shown
            .iter()
            .map(|e| {
                Some(sim::simulate(
                    &prefill, &decode, &load, e.shape, a.itl_ms, 4000, 1,
                ))
            })
            .collect()
    } else {
        vec![None; shown.len()]
    };
    if a.json {
        let rows: Vec<_> = shown
            .iter()
            .zip(&simulated)
            .map(|(e, s)| serde_json::json!({"model": e, "simulated": s, "meets": e.meets(&targets)}))
            .collect();
        println!(
            "{}",
            serde_json::json!({"best": p.best, "load": load, "targets": targets, "shapes": rows})
        );
        return Ok(());
    }
    println!(
        "load: {} req/s, prompts {}-{} tokens, outputs {}-{}; targets: TTFT p90 <= {} ms, mean ITL <= {} ms",
        load.rate, load.prompt.0, load.prompt.1, load.output.0, load.output.1, a.ttft_ms, a.itl_ms
    );
    println!(
        "profiles: decode {:?} ({} cores, {:.0} prompt tok/s, {:.1} ms a step alone), prefill {:?} ({} cores, {:.0} prompt tok/s)",
        decode.kind,
        decode.cores,
        decode.prefill_tokens_per_s,
        decode.step_ms(1.0),
        prefill.kind,
        prefill.cores,
        prefill.prefill_tokens_per_s
    );
    println!(
        "{:>8} {:>7} {:>6} {:>14} {:>10} {:>8} {}",
        "prefill",
        "decode",
        "cores",
        "ttft p90 ms",
        "itl ms",
        "streams",
        if a.simulate {
            "simulated ttft p90 / itl ms"
        } else {
            ""
        }
    );
    for (e, s) in shown.iter().zip(&simulated) {
        println!(
            "{:>8} {:>7} {:>6} {:>14.0} {:>10.1} {:>8.1} {}{}",
            e.shape.prefill,
            e.shape.decode,
            e.cores,
            e.ttft_p90_ms,
            e.itl_ms,
            e.batch,
            s.map_or(String::new(), |s| format!(
                "{:.0} / {:.1}",
                s.ttft_p90_ms, s.itl_ms
            )),
            if e.meets(&targets) { "  meets" } else { "" }
        );
    }
    match p.best {
        Some(b) => println!(
            "plan: {} prefill and {} decode workers ({} cores), decode workers with --itl-target-ms={}",
            b.shape.prefill, b.shape.decode, b.cores, a.itl_ms
        ),
        None => println!(
            "plan: no shape of up to {} workers a role meets the targets (raise --max-workers or the targets)",
            a.max_workers
        ),
    }
    Ok(())
}

#[derive(Args)]
pub struct BenchProfileArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Where the profile goes (JSON).
    #[arg(long)]
    out: PathBuf,
    /// A name for the worker kind (default: the CPU, its kernel level and threads).
    #[arg(long)]
    kind: Option<String>,
    /// Decode batch sizes to time.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    batches: Vec<usize>,
    /// Prompt tokens per sequence (the context the decode steps attend to, and the prompt whose
    /// prefill rate is measured).
    #[arg(long, default_value_t = 256)]
    prompt_len: usize,
    /// Decode steps timed at each batch.
    #[arg(long, default_value_t = 32)]
    gen_len: usize,
}

/// Measures a worker kind on this machine: its prefill rate (one prompt alone) and its decode
/// step's time at each batch size, with the engine the workers run.
pub fn bench_profile(a: BenchProfileArgs) -> Result<()> {
    let mut batches = a.batches.clone();
    batches.sort_unstable();
    batches.dedup();
    if batches.first() == Some(&0) || batches.is_empty() {
        bail!("--batches: one or more sizes of at least 1");
    }
    let (mut engine, _) = a.engine.build()?;
    let weights = format!("{:?}", a.engine.weights).to_lowercase();
    let mut decode = Vec::new();
    let mut prefill = 0.0;
    let mut first = None;
    for &batch in &batches {
        let b = tandem_bench::EngineBench {
            batch,
            prompt_len: a.prompt_len,
            gen_len: a.gen_len.max(2),
            seed: batch as u64,
            grammar: None,
            profile: false,
            adapters: Vec::new(),
        };
        let r = tandem_bench::run_engine_bench(&mut engine, &b, &weights)?;
        engine.clear_prefix_cache();
        if batch == batches[0] {
            prefill = r.prefill_tok_s;
        }
        eprintln!(
            "batch {batch}: step {:.2} ms (p50), prefill {:.0} tok/s",
            r.step_ms_p50, r.prefill_tok_s
        );
        decode.push(DecodePoint {
            batch,
            step_ms: r.step_ms_p50,
        });
        first.get_or_insert(r);
    }
    let r = first.expect("a batch ran");
    let stats = engine.stats();
    let block = a.engine.block_size;
    // Streams the pool holds at twice the profiled context, at most --max-seqs.
    let max_batch =
        (stats.blocks_total * block / (2 * a.prompt_len).max(1)).clamp(1, a.engine.max_seqs);
    let profile = Profile {
        kind: a
            .kind
            .clone()
            .unwrap_or_else(|| format!("{} {} {} threads", r.cpu.model, r.simd, r.threads)),
        cores: r.threads,
        prefill_tokens_per_s: prefill,
        decode,
        max_batch,
    };
    profile.check().map_err(anyhow::Error::msg)?;
    std::fs::write(&a.out, serde_json::to_string_pretty(&profile)? + "\n")
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!("{}", a.out.display());
    Ok(())
}
