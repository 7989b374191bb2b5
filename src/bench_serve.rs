//! `tandem bench serve`: load a router and report latency percentiles and throughput.
//!
//! With `--url`, it loads that router. Without, it measures the serving stack's overhead on this
//! machine: first the requests go straight into an engine in this process (the baseline), then
//! the same requests go through a router and one decode worker started here as child processes
//! with the same engine flags; it prints both, their throughput ratio, and the router's CPU time
//! per streamed token (from /proc).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tandem_bench::serve::{run_engine, run_http, LoadSpec, ServeReport};
use tandem_engine::{EngineError, EngineHandle};

use crate::up::{
    router_addrs, sigterm, spawn, wait_for_line, wait_ready, worker_addr, DECODE_READY,
    ROUTER_READY,
};
use crate::{fetch, EngineArgs};

#[derive(Args)]
pub struct BenchServeArgs {
    /// Router to load (http://host:port). Without it: a local router + decode worker, measured
    /// against the engine alone.
    #[arg(long)]
    url: Option<String>,
    /// Model name to send (default: the router's first).
    #[arg(long)]
    served_model: Option<String>,
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Requests in flight at once (closed loop).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Open loop instead: Poisson arrivals at this many requests/s.
    #[arg(long)]
    rate: Option<f64>,
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    gen_len: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Mixed workload: every k-th request is a long prompt with a short answer (0: none).
    #[arg(long, default_value_t = 0)]
    long_every: usize,
    #[arg(long, default_value_t = 2048)]
    long_prompt_len: usize,
    #[arg(long, default_value_t = 8)]
    long_gen_len: usize,
    /// One JSON line per run instead of a table.
    #[arg(long)]
    json: bool,
    /// Without --url: rounds of engine-then-cluster, alternating (the ratio is their median).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[command(flatten)]
    engine: EngineArgs,
}

fn print(r: &ServeReport, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        println!(
            "{:<22} {:>4} req ({} failed)  {:>8.1} out tok/s  wall {:>6.1} s  ttft p50/p99 {:>7.1}/{:>7.1} ms  itl p50/p99 {:>6.1}/{:>6.1} ms  e2e p50/p99 {:>7.0}/{:>7.0} ms",
            r.target, r.requests, r.errors, r.output_tok_s, r.wall_s, r.ttft_ms_p50, r.ttft_ms_p99,
            r.itl_ms_p50, r.itl_ms_p99, r.e2e_ms_p50, r.e2e_ms_p99
        );
        if let (Some(a), Some(b), Some(m), Some(c), Some(d)) = (
            r.short_itl_ms_p50,
            r.short_itl_ms_p99,
            r.short_itl_ms_max,
            r.long_ttft_ms_p50,
            r.long_ttft_ms_p99,
        ) {
            println!(
                "{:<22} short requests' itl p50/p99/max {a:>6.1}/{b:>6.1}/{m:>7.1} ms  long prompts' ttft p50/p99 {c:>7.1}/{d:>7.1} ms",
                ""
            );
        }
        if let Some(e) = &r.first_error {
            println!("  first error: {e}");
        }
    }
    Ok(())
}

/// user + system CPU seconds of a process so far.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the ")" that ends the command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

async fn model_name(url: &str, given: &Option<String>) -> Result<String> {
    if let Some(m) = given {
        return Ok(m.clone());
    }
    let v: serde_json::Value = reqwest::get(format!("{url}/v1/models"))
        .await
        .with_context(|| format!("{url}/v1/models"))?
        .json()
        .await?;
    Ok(v["data"][0]["id"].as_str().unwrap_or("").to_string())
}

pub fn run(a: BenchServeArgs) -> Result<()> {
    let spec = LoadSpec {
        requests: a.requests,
        concurrency: a.concurrency,
        rate: a.rate,
        prompt_len: a.prompt_len,
        gen_len: a.gen_len,
        seed: a.seed,
        long_every: a.long_every,
        long_prompt_len: a.long_prompt_len,
        long_gen_len: a.long_gen_len,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if let Some(url) = &a.url {
        let url = url.trim_end_matches('/').to_string();
        // Prompt ids must lie in the served model's vocabulary: read it from the model file.
        let path = match &a.engine.model {
            Some(p) => p.clone(),
            None => fetch::ensure_default_model()?,
        };
        let vocab = tandem_model::load_text(&path)
            .with_context(|| format!("reading {}", path.display()))?
            .config
            .vocab_size as u32;
        return rt.block_on(async {
            let model = model_name(&url, &a.served_model).await?;
            let r = run_http(&url, &model, &spec, vocab).await;
            print(&r, a.json)
        });
    }

    let mut engine_args = a.engine.clone();
    if engine_args.model.is_none() {
        engine_args.model = Some(fetch::ensure_default_model()?);
    }
    rt.block_on(compare(&a, &engine_args, spec))
}

/// A local router + decode worker against an engine in this process, the same requests to each,
/// alternating for `--rounds` rounds (a new seed each round, so neither side replays its prefix
/// cache) so that machine noise hits both alike.
async fn compare(a: &BenchServeArgs, engine_args: &EngineArgs, spec: LoadSpec) -> Result<()> {
    let mut wargs = vec![
        "decode".to_string(),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
    ];
    wargs.extend(engine_args.flags());
    let mut worker = spawn("decode", &wargs)?;
    let waddr = worker_addr(
        &wait_for_line(
            "decode",
            &mut worker,
            DECODE_READY,
            Duration::from_secs(300),
        )
        .await?,
    );
    let mut rargs = vec![
        "router".to_string(),
        "--host=127.0.0.1".into(),
        "--http-port=0".into(),
        "--grpc-port=0".into(),
        format!("--decode-workers={waddr}"),
        format!("--max-queue={}", spec.requests.max(1024)),
    ];
    if let Some(m) = &engine_args.model {
        rargs.push(format!("--model={}", m.display()));
    }
    let mut router = spawn("router", &rargs)?;
    let line = wait_for_line(
        "router",
        &mut router,
        ROUTER_READY,
        Duration::from_secs(120),
    )
    .await?;
    let http = format!("http://{}", router_addrs(&line)?.0);
    wait_ready(&format!("{http}/ready"), Duration::from_secs(60)).await?;
    let model = model_name(&http, &a.served_model).await?;

    let build_args = engine_args.clone();
    let handle = Arc::new(
        EngineHandle::spawn(move || {
            build_args
                .build()
                .map(|(e, _)| e)
                .map_err(|e| EngineError::Startup(format!("{e:#}")))
        })
        .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let vocab = handle.limits().vocab_size as u32;
    let rpid = router.id().context("router pid")?;
    let wpid = worker.id().context("worker pid")?;
    let mut ratios = Vec::new();
    let mut router_us = Vec::new();
    let mut cpu_ratios = Vec::new();
    for round in 0..a.rounds.max(1) {
        let spec = LoadSpec {
            seed: spec.seed + round as u64,
            ..spec.clone()
        };
        let c0 = cpu_seconds(std::process::id())?;
        let base = run_engine(handle.clone(), &spec).await;
        let base_cpu = cpu_seconds(std::process::id())? - c0;
        let (r0, w0) = (cpu_seconds(rpid)?, cpu_seconds(wpid)?);
        let r = run_http(&http, &model, &spec, vocab).await;
        let (r1, w1) = (cpu_seconds(rpid)?, cpu_seconds(wpid)?);
        let tokens = r.output_tokens.max(1) as f64;
        let ratio = r.output_tok_s / base.output_tok_s;
        ratios.push(ratio);
        router_us.push((r1 - r0) * 1e6 / tokens);
        // CPU seconds per output token, cluster (router + worker) over engine: the overhead in
        // a form that CPU stolen by other tenants of the machine does not skew as much.
        let cpu_ratio =
            ((r1 - r0) + (w1 - w0)) / tokens / (base_cpu / base.output_tokens.max(1) as f64);
        cpu_ratios.push(cpu_ratio);
        if a.json {
            println!("{}", serde_json::to_string(&base)?);
            println!("{}", serde_json::to_string(&r)?);
        } else {
            println!("round {}", round + 1);
            print(&base, false)?;
            print(&r, false)?;
            println!(
                "  cluster / engine {ratio:.3}x tok/s, {cpu_ratio:.3}x CPU per token; router CPU {:.1} us per streamed token; cores busy: engine process {:.2}, decode worker {:.2}",
                (r1 - r0) * 1e6 / tokens,
                base_cpu / base.wall_s,
                (w1 - w0) / r.wall_s
            );
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let rounds = ratios.len();
    let (ratio, cpu, cpu_ratio) = (
        median(&mut ratios),
        median(&mut router_us),
        median(&mut cpu_ratios),
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({"cluster_over_engine_median": ratio, "cluster_cpu_per_token_over_engine_median": cpu_ratio, "router_cpu_us_per_token_median": cpu, "rounds": rounds})
        );
    } else {
        println!(
            "median of {rounds} rounds: router + decode worker / engine alone {ratio:.3}x output tok/s, {cpu_ratio:.3}x CPU per token; router CPU {cpu:.1} us per streamed token"
        );
    }
    drop(handle);
    sigterm(&router);
    sigterm(&worker);
    let _ = tokio::time::timeout(Duration::from_secs(10), router.wait()).await;
    let _ = tokio::time::timeout(Duration::from_secs(40), worker.wait()).await;
    Ok(())
}
