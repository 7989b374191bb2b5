//! `tandem bench serve`: load one OpenAI-compatible server, or two side by side, with a chosen
//! dataset and arrival process, from this process or from load agents (`tandem bench agent`),
//! and report latency percentiles, throughput and goodput (text, JSON, CSV, per-request records,
//! an HTML report with plots).
//!
//! Without `--url` it measures the serving stack's overhead on this machine: a router and one
//! decode worker started here as child processes against an engine in this process with the
//! same flags, the same requests to each, alternating for `--rounds` rounds.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_bench::load::dataset::{Dataset, DatasetSpec, LenDist};
use tandem_bench::load::measure::Slo;
use tandem_bench::load::run::{HttpTarget, Plan, Target};
use tandem_bench::load::schedule::{Arrival, Shape, StopAfter};
use tandem_bench::load::{agent, execute, report, Bench, Report, Sweep};
use tandem_discovery::Ready;
use tandem_engine::{EngineError, EngineHandle};

use crate::up::{router_addrs, sigterm, spawn, wait_for_line, wait_ready};
use crate::{fetch, EngineArgs};

#[derive(Args)]
pub struct BenchServeArgs {
    /// Server to load (http://host:port). Without it: a local router + decode worker, measured
    /// against the engine alone.
    #[arg(long)]
    url: Option<String>,
    /// Another server to run the same schedule against (repeatable: any number of them), each
    /// in turn, the order reversed every other round; ratios are the first over each other.
    #[arg(long)]
    compare: Vec<String>,
    /// Model name to send (default: the server's first).
    #[arg(long)]
    served_model: Option<String>,
    /// Model name to send to each --compare, in the same order (default: each server's first).
    #[arg(long)]
    compare_model: Vec<String>,
    /// Names for the reports, comma-separated: --url's, then each --compare's in order (default:
    /// their addresses).
    #[arg(long, value_delimiter = ',')]
    labels: Vec<String>,
    /// Requests to send (multi-turn: conversations), warmup included. Default 64 unless
    /// --duration bounds the run.
    #[arg(long)]
    requests: Option<usize>,
    /// Stop sending after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// The first N requests are sent but not measured.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Requests in flight at once (closed loop; the default, at 64). With --rate: a cap.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Open loop instead: this many requests/s.
    #[arg(long)]
    rate: Option<f64>,
    /// The open loop's arrivals: poisson, gamma:SHAPE or constant.
    #[arg(long, default_value = "poisson")]
    arrival: Arrival,
    /// Ramp the rate up linearly from 0 over this many seconds.
    #[arg(long)]
    ramp: Option<f64>,
    /// Run at several points: rate:R1,R2,... or concurrency:C1,C2,...; stops when goodput falls.
    #[arg(long)]
    sweep: Option<Sweep>,
    /// random, shared-prefix, multi-turn, edit (code and text to give back changed: what
    /// speculative decoding is for; each answer ends at the model's end of sequence, where every
    /// other dataset's requests run to their length), story (free-form: nothing to repeat),
    /// sharegpt:FILE or trace:FILE (Mooncake JSONL).
    #[arg(long, default_value = "random")]
    dataset: String,
    /// Prompt tokens (random), question tokens (shared-prefix) or tokens per message
    /// (multi-turn): N, A-B or normal:MEAN:STD.
    #[arg(long, default_value = "128")]
    prompt_len: LenDist,
    /// Output tokens: N, A-B or normal:MEAN:STD.
    #[arg(long, default_value = "128")]
    gen_len: LenDist,
    /// shared-prefix: distinct system prompts.
    #[arg(long, default_value_t = 4)]
    prefixes: usize,
    /// shared-prefix: questions per system prompt.
    #[arg(long, default_value_t = 16)]
    questions: usize,
    /// shared-prefix: tokens of a system prompt.
    #[arg(long, default_value_t = 512)]
    prefix_len: usize,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// trace: replay this many times faster than recorded.
    #[arg(long, default_value_t = 1.0)]
    trace_speedup: f64,
    /// random: every k-th request is a long prompt with a short answer (0: none).
    #[arg(long, default_value_t = 0)]
    long_every: usize,
    #[arg(long, default_value_t = 2048)]
    long_prompt_len: usize,
    #[arg(long, default_value_t = 8)]
    long_gen_len: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Goodput targets: ttft=MS,itl=MS,e2e=MS (any of them; itl is a request's mean gap).
    #[arg(long)]
    slo: Option<Slo>,
    /// Runs per point and target. Default 1 with --url, 3 without.
    #[arg(long)]
    rounds: Option<usize>,
    /// Load agents (host:port of `tandem bench agent`), comma-separated: each sends its share.
    #[arg(long, value_delimiter = ',')]
    agents: Vec<String>,
    /// An agent silent this many seconds is reported lost.
    #[arg(long, default_value_t = 30.0)]
    agent_silence: f64,
    /// More /metrics URLs of the first server's cluster (its workers), read before and after.
    #[arg(long = "metrics-url")]
    metrics_urls: Vec<String>,
    /// A request that receives nothing for this many seconds fails as a stall.
    #[arg(long, default_value_t = 120.0)]
    stall_timeout: f64,
    /// API key sent to every server as `Authorization: Bearer` (a tenant's, with --tenants).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// One JSON line per run (and the ratios) instead of a table.
    #[arg(long)]
    json: bool,
    /// Write an HTML report with plots.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write one CSV row per run.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Write every request's record as JSON lines.
    #[arg(long)]
    save_requests: Option<PathBuf>,
    /// No progress line on stderr.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args)]
pub struct BenchAgentArgs {
    /// Address to serve the coordinator on.
    #[arg(long, default_value = "0.0.0.0:7800")]
    listen: SocketAddr,
    /// The model file whose tokenizer writes text prompts (multi-turn, ShareGPT lengths).
    #[arg(long)]
    model: Option<PathBuf>,
}

/// Prints where it listens, then serves coordinators until stopped.
pub fn run_agent(a: BenchAgentArgs) -> Result<()> {
    let tokenizer = match &a.model {
        Some(p) => Some(tandem_model::load_text(p)?.tokenizer),
        None => None,
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        println!("bench agent listening on {}", listener.local_addr()?);
        agent::serve(listener, tokenizer, crate::serve::shutdown_signal()).await?;
        Ok(())
    })
}

async fn model_name(url: &str, given: &Option<String>, key: Option<&str>) -> Result<String> {
    if let Some(m) = given {
        return Ok(m.clone());
    }
    let mut req = reqwest::Client::new().get(format!("{url}/v1/models"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let v: serde_json::Value = req
        .send()
        .await
        .with_context(|| format!("{url}/v1/models"))?
        .json()
        .await
        .with_context(|| format!("{url}/v1/models"))?;
    Ok(v["data"][0]["id"].as_str().unwrap_or("").to_string())
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

impl BenchServeArgs {
    fn dataset_spec(&self) -> Result<DatasetSpec> {
        Ok(match self.dataset.as_str() {
            "random" => DatasetSpec::Random {
                input: self.prompt_len,
                output: self.gen_len,
                long_every: self.long_every,
                long_input: self.long_prompt_len,
                long_output: self.long_gen_len,
            },
            "shared-prefix" => DatasetSpec::SharedPrefix {
                prefixes: self.prefixes,
                questions: self.questions,
                prefix_len: self.prefix_len,
                question_len: self.prompt_len,
                output: self.gen_len,
            },
            "multi-turn" => DatasetSpec::MultiTurn {
                turns: self.turns,
                input: self.prompt_len,
                output: self.gen_len,
            },
            "edit" => DatasetSpec::Edit,
            "story" => DatasetSpec::Story {
                output: self.gen_len,
            },
            other => match other.split_once(':') {
                Some(("sharegpt", f)) => DatasetSpec::ShareGpt(f.into()),
                Some(("trace", f)) => DatasetSpec::Trace(f.into()),
                _ => bail!(
                    "--dataset {other:?}: datasets are random, shared-prefix, multi-turn, edit, story, sharegpt:FILE and trace:FILE"
                ),
            },
        })
    }

    fn plan(&self, dataset: &Dataset) -> Result<Plan> {
        let trace = dataset.trace_times(self.trace_speedup);
        let requests = match (self.requests, self.duration, dataset.len()) {
            (Some(n), _, _) => Some(n),
            (None, None, Some(len)) => Some(len),
            (None, None, None) => Some(64),
            (None, Some(_), _) => None,
        };
        let shape = match (self.rate, &trace) {
            (Some(_), Some(_)) => bail!("a trace brings its own arrival times: leave out --rate"),
            (Some(rate), None) => {
                if rate <= 0.0 {
                    bail!("--rate must be positive");
                }
                Shape::Open {
                    rate,
                    arrival: self.arrival,
                    ramp: self.ramp.map(Duration::from_secs_f64),
                    max_in_flight: self.concurrency,
                }
            }
            (None, Some(_)) => Shape::Open {
                rate: 1.0,
                arrival: Arrival::Constant,
                ramp: None,
                max_in_flight: self.concurrency,
            },
            (None, None) => Shape::Closed {
                concurrency: self.concurrency.unwrap_or(64).max(1),
            },
        };
        Ok(Plan {
            shape,
            bound: StopAfter {
                requests,
                duration: self.duration.map(Duration::from_secs_f64),
            },
            warmup: self.warmup,
            seed: self.seed,
            stall: Duration::from_secs_f64(self.stall_timeout),
            times: trace,
        })
    }

    fn describe(&self, plan: &Plan) -> String {
        let shape = match &plan.shape {
            _ if matches!(self.sweep, Some(Sweep::Rate(_))) => {
                format!("open loop at each sweep rate, {:?} arrivals", self.arrival)
            }
            _ if matches!(self.sweep, Some(Sweep::Concurrency(_))) => {
                "closed loop at each sweep concurrency".to_string()
            }
            Shape::Closed { concurrency } => format!("closed loop, {concurrency} in flight"),
            Shape::Open {
                rate,
                arrival,
                ramp,
                ..
            } if plan.times.is_none() => format!(
                "open loop, {rate} req/s {arrival:?}{}",
                ramp.map_or(String::new(), |r| format!(" ramped over {r:?}"))
            ),
            Shape::Open { .. } => format!("trace arrivals ({}x)", self.trace_speedup),
        };
        let bound = match (plan.bound.requests, plan.bound.duration) {
            (Some(n), Some(d)) => format!("{n} requests or {d:?}"),
            (Some(n), None) => format!("{n} requests"),
            (None, Some(d)) => format!("{d:?}"),
            (None, None) => String::new(),
        };
        format!(
            "dataset {} (prompt {:?}, output {:?}, seed {}); {shape}; {bound}, {} warmup{}{}",
            self.dataset,
            self.prompt_len,
            self.gen_len,
            self.seed,
            self.warmup,
            self.sweep
                .as_ref()
                .map_or(String::new(), |s| format!("; sweep {s:?}")),
            self.slo.map_or(String::new(), |s| format!("; SLO {s:?}")),
        )
    }
}

fn write_outputs(a: &BenchServeArgs, r: &Report) -> Result<()> {
    if a.json {
        for run in &r.runs {
            let mut v = serde_json::to_value(&run.summary)?;
            v["target"] = run.target.clone().into();
            v["point"] = run.point.into();
            v["round"] = (run.round + 1).into();
            v["server"] = serde_json::to_value(&run.server)?;
            v["lost_agents"] = serde_json::to_value(&run.lost_agents)?;
            println!("{v}");
        }
        if !r.ratios.is_empty() {
            println!(
                "{}",
                serde_json::json!({"ratios": r.ratios, "targets": r.targets})
            );
        }
    } else {
        print!("{}", report::text(r));
    }
    if let Some(p) = &a.report {
        let html = report::html(r).map_err(|e| anyhow::anyhow!("plotting: {e}"))?;
        std::fs::write(p, html).with_context(|| format!("writing {}", p.display()))?;
        eprintln!("report: {}", p.display());
    }
    if let Some(p) = &a.csv {
        std::fs::write(p, report::csv(r)).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.save_requests {
        std::fs::write(p, report::requests_jsonl(r))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    let lost: usize = r.runs.iter().map(|x| x.lost_agents.len()).sum();
    if lost > 0 {
        bail!("{lost} agent run(s) were lost: their shares are missing from the results");
    }
    Ok(())
}

/// Refuses numbers that cannot describe a run, naming the flag.
fn check_numbers(a: &BenchServeArgs) -> Result<()> {
    let positive = [
        ("--trace-speedup", Some(a.trace_speedup)),
        ("--stall-timeout", Some(a.stall_timeout)),
        ("--agent-silence", Some(a.agent_silence)),
        ("--duration", a.duration),
        ("--ramp", a.ramp),
        ("--rate", a.rate),
    ];
    for (flag, v) in positive {
        if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
            bail!("{flag} must be a positive number of seconds (or per second), not {v}");
        }
    }
    for (flag, v) in [
        ("--requests", a.requests),
        ("--concurrency", a.concurrency),
        ("--rounds", a.rounds),
    ] {
        if v == Some(0) {
            bail!("{flag} must be at least 1");
        }
    }
    if a.requests.is_some_and(|n| n <= a.warmup) {
        bail!(
            "--warmup {} leaves none of the --requests measured",
            a.warmup
        );
    }
    if a.compare_model.len() > a.compare.len() {
        bail!(
            "{} --compare-model for {} --compare: one model name a compared server at most",
            a.compare_model.len(),
            a.compare.len()
        );
    }
    if a.labels.len() > 1 + a.compare.len() {
        bail!(
            "{} --labels for {} servers (--url and each --compare)",
            a.labels.len(),
            1 + a.compare.len()
        );
    }
    Ok(())
}

pub fn run(a: BenchServeArgs) -> Result<()> {
    check_numbers(&a)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // Prompt ids must lie in the served model's vocabulary, and text needs its tokenizer: read
    // them from the model file.
    let path = match &a.engine.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model()?,
    };
    let loaded =
        tandem_model::load_text(&path).with_context(|| format!("reading {}", path.display()))?;
    let vocab = loaded.config.vocab_size as u32;
    let spec = a.dataset_spec()?;
    let dataset = Dataset::new(spec, a.seed, vocab, Some(loaded.tokenizer.clone()))?;
    let plan = a.plan(&dataset)?;
    let description = a.describe(&plan);
    let bench = Bench {
        dataset,
        plan,
        slo: a.slo.unwrap_or_default(),
        sweep: a.sweep.clone(),
        rounds: a.rounds.unwrap_or(if a.url.is_some() { 1 } else { 3 }),
        agents: a.agents.clone(),
        metrics: a.metrics_urls.clone(),
        progress: !a.quiet,
        agent_silence: Duration::from_secs_f64(a.agent_silence),
    };
    let in_flight = a.concurrency.unwrap_or(256);
    if let Some(url) = &a.url {
        let url = url.trim_end_matches('/').to_string();
        return rt.block_on(async {
            let label = |k: usize| a.labels.get(k).map(String::as_str);
            let mut targets = vec![Target::Http(
                HttpTarget::new(
                    &url,
                    &model_name(&url, &a.served_model, a.api_key.as_deref()).await?,
                    in_flight,
                )
                .labelled(label(0))
                .with_key(a.api_key.as_deref()),
            )];
            for (k, other) in a.compare.iter().enumerate() {
                let other = other.trim_end_matches('/').to_string();
                let model = model_name(
                    &other,
                    &a.compare_model.get(k).cloned(),
                    a.api_key.as_deref(),
                )
                .await?;
                targets.push(Target::Http(
                    HttpTarget::new(&other, &model, in_flight)
                        .labelled(label(k + 1))
                        .with_key(a.api_key.as_deref()),
                ));
            }
            let r = execute(&bench, &targets, description).await;
            write_outputs(&a, &r)
        });
    }
    if !a.compare.is_empty() || !a.labels.is_empty() || !a.agents.is_empty() {
        bail!("--compare, --labels and --agents need --url");
    }
    let mut engine_args = a.engine.clone();
    engine_args.model = Some(path);
    // The worker and the engine in this process schedule alike: the serving roles' step target
    // (and no ITL target) unless the flags set them.
    engine_args
        .step_target_ms
        .get_or_insert(crate::serve::SERVE_STEP_TARGET_MS);
    rt.block_on(overhead(&a, &engine_args, bench, description))
}

/// A local router + decode worker against an engine in this process, the same requests to each,
/// alternating rounds, and the CPU each side spent per output token.
async fn overhead(
    a: &BenchServeArgs,
    engine_args: &EngineArgs,
    bench: Bench,
    description: String,
) -> Result<()> {
    let mut wargs = vec![
        "decode".to_string(),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
    ];
    wargs.extend(engine_args.flags());
    let mut worker = spawn("decode", &wargs)?;
    let ready = wait_for_line(
        "decode",
        &mut worker,
        Ready::DECODE,
        Duration::from_secs(300),
    )
    .await?;
    let waddr = ready.grpc().to_string();
    let mut rargs = vec![
        "router".to_string(),
        "--host=127.0.0.1".into(),
        "--http-port=0".into(),
        "--grpc-port=0".into(),
        format!("--decode-workers={waddr}"),
        "--max-queue=100000".into(),
    ];
    if let Some(m) = &engine_args.model {
        rargs.push(format!("--model={}", m.display()));
    }
    let mut router = spawn("router", &rargs)?;
    let ready = wait_for_line(
        "router",
        &mut router,
        Ready::ROUTER,
        Duration::from_secs(120),
    )
    .await?;
    let http = format!("http://{}", router_addrs(&ready)?.0);
    wait_ready(&format!("{http}/ready"), Duration::from_secs(60)).await?;
    let model = model_name(&http, &a.served_model, None).await?;

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
    let targets = vec![
        Target::Http(HttpTarget::new(&http, &model, 256)),
        Target::Engine(handle.clone()),
    ];
    let (rpid, wpid) = (
        router.id().context("router pid")?,
        worker.id().context("worker pid")?,
    );
    let (r0, w0, e0) = (
        cpu_seconds(rpid)?,
        cpu_seconds(wpid)?,
        cpu_seconds(std::process::id())?,
    );
    let r = execute(&bench, &targets, description).await;
    let (r1, w1, e1) = (
        cpu_seconds(rpid)?,
        cpu_seconds(wpid)?,
        cpu_seconds(std::process::id())?,
    );
    write_outputs(a, &r)?;
    let tokens = |k: usize| -> f64 {
        r.runs
            .iter()
            .filter(|x| x.target_index == k)
            .map(|x| x.summary.output_tokens)
            .sum::<usize>()
            .max(1) as f64
    };
    let mut ratios: Vec<f64> = r.ratios.iter().map(|q| q.output_tok_s).collect();
    ratios.sort_by(f64::total_cmp);
    let median = ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN);
    let router_us = (r1 - r0) * 1e6 / tokens(0);
    // CPU per output token, cluster (router + worker) over engine; this process's CPU includes
    // the load generator's, so the ratio is a lower bound.
    let cpu_ratio = ((r1 - r0) + (w1 - w0)) / tokens(0) / ((e1 - e0) / tokens(1));
    if a.json {
        println!(
            "{}",
            serde_json::json!({"cluster_over_engine_median": median, "cluster_cpu_per_token_over_engine": cpu_ratio, "router_cpu_us_per_token": router_us, "rounds": ratios.len()})
        );
    } else {
        println!(
            "median of {} rounds: router + decode worker / engine alone {median:.3}x output tok/s; {cpu_ratio:.3}x CPU per token; router CPU {router_us:.1} us per streamed token",
            ratios.len()
        );
    }
    drop(handle);
    sigterm(&router);
    sigterm(&worker);
    let _ = tokio::time::timeout(Duration::from_secs(10), router.wait()).await;
    let _ = tokio::time::timeout(Duration::from_secs(40), worker.wait()).await;
    Ok(())
}
