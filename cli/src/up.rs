//! `tandem up`: the whole cluster on this machine, as child processes on loopback.
//!
//! Starts P prefill workers (`tandem prefill`, default 1) and D decode workers (`tandem decode`,
//! default 1) sharing a random KV secret, waits for each to print its address, starts the router
//! pointed at them (long prompts are prefilled on the prefill workers, short ones where they
//! decode), waits until `/ready` answers 200 and prints the URL with a curl
//! example. Then it supervises: a child that exits is reported and restarted on the same port
//! with exponential backoff (reset once it has stayed up a minute) while the others keep serving.
//! Ctrl-C (or SIGTERM) sends SIGTERM to every child, waits for them to drain, and exits. Children
//! also get SIGKILL from the kernel if `tandem up` itself dies (Linux parent-death signal), so no
//! orphan keeps a port. With `--autoscale` the router follows a worker-list file `up` keeps, and
//! [`crate::autoscale`]'s planner starts and drains workers to the load the router sees.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser};
use tandem_discovery::Ready;
use tandem_proto::worker::LoadReport;
use tandem_router::PolicyKind;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use tandem_kernels::cuda::DeviceSpec;

use crate::autoscale::{self, Action, AutoscaleArgs, Bounds, Decider, Role, Totals, Window};
use crate::fetch;
use crate::serve::shutdown_signal;

#[derive(Args, Clone, Debug)]
pub struct UpArgs {
    /// GGUF file or HF directory (the default model, fetched if missing, when not given).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Decode workers to start.
    #[arg(
        long = "decode-workers",
        env = "TANDEM_UP_DECODE_WORKERS",
        default_value_t = 1
    )]
    decode_workers: usize,
    /// Prefill workers to start (0: every prompt is prefilled where it decodes). Default on the
    /// CPU: 1 on a machine of at least 8 cores, 0 below (the roles would split too few cores:
    /// one decode worker with every core serves more); 0 when decode workers run on a GPU (a
    /// GPU decode worker prefills faster than a CPU prefill worker would; ask for them, on a
    /// device with --prefill-device).
    #[arg(long = "prefill-workers", env = "TANDEM_UP_PREFILL_WORKERS")]
    prefill_workers: Option<usize>,
    /// Where decode workers run: cpu, or a CUDA GPU (cuda, cuda:N).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    device: DeviceSpec,
    /// Where prefill workers run: cpu, or a CUDA GPU (cuda, cuda:N). Their KV reaches decode
    /// workers on either device: a GPU's cache goes through page-locked staging, and a
    /// receiver converts f32 to bf16 (or back) where the two caches differ.
    #[arg(
        long = "prefill-device",
        env = "TANDEM_PREFILL_DEVICE",
        default_value = "cpu"
    )]
    prefill_device: DeviceSpec,
    /// Prompts with at least this many uncached tokens are prefilled on a prefill worker.
    #[arg(long, env = "TANDEM_DISAGG_MIN_TOKENS", default_value_t = 256)]
    disagg_min_tokens: usize,
    /// Address the router listens on.
    #[arg(long, env = "TANDEM_HOST", default_value = "127.0.0.1")]
    host: String,
    /// The router's OpenAI-compatible HTTP port.
    #[arg(long, env = "TANDEM_HTTP_PORT", default_value_t = 8000)]
    http_port: u16,
    /// The router's gRPC port.
    #[arg(long, env = "TANDEM_GRPC_PORT", default_value_t = 50051)]
    grpc_port: u16,
    /// First decode worker port (worker i gets base + i); 0 picks free ports.
    #[arg(long, env = "TANDEM_WORKER_BASE_PORT", default_value_t = 0)]
    worker_base_port: u16,
    /// Compute threads per decode worker (default: the cores shared evenly).
    #[arg(long, env = "TANDEM_WORKER_THREADS")]
    worker_threads: Option<usize>,
    /// Tensor-parallel ranks of each decode worker (its threads shared among them).
    #[arg(long = "decode-tp", env = "TANDEM_UP_DECODE_TP", default_value_t = 1)]
    decode_tp: u32,
    /// Tensor-parallel ranks of each prefill worker; it may differ from --decode-tp (the KV
    /// goes to each decode rank's heads whatever the two sizes).
    #[arg(long = "prefill-tp", env = "TANDEM_UP_PREFILL_TP", default_value_t = 1)]
    prefill_tp: u32,
    /// Routing policy.
    #[arg(long, env = "TANDEM_POLICY", default_value = "kv-aware")]
    policy: PolicyKind,
    /// Extra flags for the router, verbatim (repeatable), e.g. --router-arg=--max-queue=64.
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
    /// Extra flags for every worker (prefill and decode), verbatim (repeatable), e.g.
    /// --worker-arg=--kv-dtype=int8.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Seconds to wait for a child to start (model load included).
    #[arg(long, env = "TANDEM_START_TIMEOUT_S", default_value_t = 300)]
    start_timeout_s: u64,
    #[command(flatten)]
    lora: crate::serve::LoraArgs,
    #[command(flatten)]
    scale: AutoscaleArgs,
}

/// The (http, grpc) addresses of a router's ready line.
pub(crate) fn router_addrs(ready: &Ready) -> Result<(String, String)> {
    match ready {
        Ready::Router { http, grpc } => Ok((http.clone(), grpc.clone())),
        other => bail!("expected a router's ready line, got {other}"),
    }
}

/// A child's command line: its subcommand, the flags `tandem up` sets (by name, each once), then
/// the user's pass-through flags. [`ChildArgs::check`] parses the whole line with the role's own
/// clap struct, so a bad pass-through flag is refused before anything starts, and what `up`
/// needs to know of a role's settings it reads from that parse, not from the strings.
#[derive(Clone, Debug)]
struct ChildArgs {
    role: &'static str,
    set: Vec<(&'static str, String)>,
    extra: Vec<String>,
}

impl ChildArgs {
    fn new(role: &'static str, extra: &[String]) -> Self {
        Self {
            role,
            set: Vec::new(),
            extra: extra.to_vec(),
        }
    }

    /// Sets `--flag=value`, replacing an earlier value of the same flag.
    fn set(&mut self, flag: &'static str, value: impl ToString) -> &mut Self {
        let value = value.to_string();
        match self.set.iter_mut().find(|(f, _)| *f == flag) {
            Some(slot) => slot.1 = value,
            None => self.set.push((flag, value)),
        }
        self
    }

    fn argv(&self) -> Vec<String> {
        let mut v = vec![self.role.to_string()];
        v.extend(self.set.iter().map(|(f, x)| format!("--{f}={x}")));
        v.extend(self.extra.iter().cloned());
        v
    }

    /// The line as the child will read it (flags, then `TANDEM_*` variables, which it inherits).
    fn check(&self) -> Result<crate::Command> {
        let mut line = vec!["tandem".to_string()];
        line.extend(self.argv());
        crate::Cli::try_parse_from(&line)
            .map(|c| c.command)
            .map_err(|e| anyhow::anyhow!("the {} flags `{}`: {e}", self.role, line.join(" ")))
    }
}

/// One supervised child.
struct Proc {
    name: String,
    /// A worker's role; None for the router.
    role: Option<Role>,
    /// A worker's gRPC address (empty for the router).
    addr: String,
    /// The line it prints when ready.
    marker: &'static str,
    args: ChildArgs,
    child: Option<Child>,
    started: Instant,
    backoff: Duration,
    restarts: u32,
    /// When the autoscaler began draining it.
    draining: Option<Instant>,
}

impl Proc {
    fn new(
        name: String,
        role: Option<Role>,
        marker: &'static str,
        args: ChildArgs,
        child: Child,
    ) -> Self {
        Self {
            name,
            role,
            addr: String::new(),
            marker,
            args,
            child: Some(child),
            started: Instant::now(),
            backoff: Duration::from_secs(1),
            restarts: 0,
            draining: None,
        }
    }
}

impl Proc {
    /// Whether it is a worker of `role` that takes requests (not draining).
    fn serves(&self, role: Role) -> bool {
        self.role == Some(role) && self.draining.is_none()
    }
}

/// Writes the worker-list file the router follows: the workers that take requests.
fn write_worker_list(path: &std::path::Path, procs: &[Proc]) -> Result<()> {
    let of = |role| {
        procs
            .iter()
            .filter(|p| p.serves(role))
            .map(|p| p.addr.clone())
            .collect()
    };
    tandem_discovery::WorkerList {
        decode: of(Role::Decode),
        prefill: of(Role::Prefill),
    }
    .write(path)
    .with_context(|| format!("writing {}", path.display()))
}

/// Starts worker `name` of `role` on `port` (0: any) and waits for its ready line; restarts
/// reuse the port it got.
async fn start_worker(
    a: &UpArgs,
    role: Role,
    model: &str,
    name: String,
    port: u16,
    threads: usize,
    timeout: Duration,
) -> Result<Proc> {
    let marker = match role {
        Role::Prefill => Ready::PREFILL,
        Role::Decode => Ready::DECODE,
    };
    let mut args = worker_args(a, role.name(), model, &name, threads);
    args.set("port", port);
    let mut child = spawn(&name, &args.argv())?;
    let addr = wait_for_line(&name, &mut child, marker, timeout)
        .await?
        .grpc()
        .to_string();
    args.set("port", port_of(&addr));
    eprintln!("{name} listening on {addr}");
    let mut p = Proc::new(name, Some(role), marker, args, child);
    p.addr = addr;
    Ok(p)
}

pub(crate) fn spawn(name: &str, args: &[String]) -> Result<Child> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe and touches only the child's own state.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().with_context(|| format!("starting {name}"))
}

/// Reads the child's stdout until the line starting with `marker`, forwarding everything it
/// prints with a `[name]` prefix from then on. Returns that line, parsed ([`Ready`]).
pub(crate) async fn wait_for_line(
    name: &str,
    child: &mut Child,
    marker: &str,
    timeout: Duration,
) -> Result<Ready> {
    let stdout = child.stdout.take().context("child stdout")?;
    let stderr = child.stderr.take().context("child stderr")?;
    let tag = name.to_string();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            eprintln!("[{tag}] {l}");
        }
    });
    let mut lines = BufReader::new(stdout).lines();
    let found = tokio::time::timeout(timeout, async {
        while let Ok(Some(l)) = lines.next_line().await {
            if l.starts_with(marker) {
                return Some(l);
            }
            println!("[{name}] {l}");
        }
        None
    })
    .await;
    let tag = name.to_string();
    tokio::spawn(async move {
        while let Ok(Some(l)) = lines.next_line().await {
            println!("[{tag}] {l}");
        }
    });
    match found {
        Ok(Some(line)) => Ready::parse(&line)
            .with_context(|| format!("{name} printed a malformed ready line {line:?}")),
        Ok(None) => {
            let status = child.wait().await.ok();
            bail!("{name} exited before it was ready ({status:?}); its log is above")
        }
        Err(_) => bail!("{name} did not start within {} s", timeout.as_secs()),
    }
}

pub(crate) fn sigterm(child: &Child) {
    if let Some(pid) = child.id() {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
}

/// Waits until the router at `url` (its `/ready`) sees every worker it was given, decode and
/// prefill, as ready: a cluster that reports ready with its prefill worker still unprobed would
/// prefill its first requests locally.
pub(crate) async fn wait_ready(url: &str, timeout: Duration) -> Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    let all_ready = |body: &serde_json::Value| {
        ["workers", "prefill_workers"].iter().all(|pool| {
            body[pool]
                .as_array()
                .is_some_and(|ws| ws.iter().all(|w| w["ready"] == true))
        })
    };
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                if let Ok(body) = r.json::<serde_json::Value>().await {
                    if all_ready(&body) {
                        return Ok(());
                    }
                }
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the router did not see all its workers ready within {} s ({url})",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn run(mut a: UpArgs) -> Result<()> {
    if a.decode_workers == 0 {
        bail!("--decode-workers must be at least 1");
    }
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let prefill_workers = match (a.prefill_workers, a.device) {
        (None, DeviceSpec::Cpu) => default_cpu_prefill_workers(cores),
        (None, DeviceSpec::Cuda(_)) => 0,
        (Some(n), _) => n,
    };
    if a.prefill_workers.is_none() && a.device == DeviceSpec::Cpu && prefill_workers == 0 {
        eprintln!(
            "no prefill worker: this machine has {cores} cores (below {LOCAL_PREFILL_MIN_CORES}, one decode worker with all of them serves more); --prefill-workers=1 starts one"
        );
    }
    a.prefill_workers = Some(prefill_workers);
    // The pass-through flags, checked with each role's parser before anything starts.
    let placeholder = ["127.0.0.1:1".to_string()];
    if let crate::Command::Router(r) =
        router_args(&a, "x", &placeholder, &placeholder, None).check()?
    {
        if r.door.tls_cert.is_some() {
            bail!(
                "--tls-cert: tandem up watches its router over plain HTTP on this machine; for TLS run `tandem router --tls-cert ... --tls-key ...` with its workers (docs: README, Security)"
            );
        }
    }
    for role in ["prefill", "decode"] {
        worker_args(&a, role, "x", "w", 1).check()?;
    }
    if a.scale.autoscale {
        a.scale.check().map_err(anyhow::Error::msg)?;
        for p in [&a.scale.profile, &a.scale.prefill_profile]
            .into_iter()
            .flatten()
        {
            autoscale::read_profile(p)?;
        }
        if a.scale.prefill_profile.is_some() && a.scale.profile.is_none() {
            bail!("--autoscale-prefill-profile needs --autoscale-profile (the decode workers')");
        }
    }
    let model = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model()?,
    };
    // Threads: as given; else the cores shared by the workers there can be at most (the
    // autoscaler's bounds when given), else by those started.
    let most = match (a.scale.autoscale, a.scale.max_decode) {
        (true, Some(d)) => {
            d.max(a.decode_workers) + a.scale.max_prefill.unwrap_or(0).max(prefill_workers)
        }
        _ => a.decode_workers + prefill_workers,
    };
    let threads = a.worker_threads.unwrap_or((cores / most).max(1));
    if a.scale.autoscale {
        let b = scale_bounds(&a, threads);
        if b.decode.1 == b.decode.0 && b.prefill.1 == b.prefill.0 {
            eprintln!(
                "autoscale: nothing to scale: {} decode worker(s) of {threads} thread(s) take the {cores} cores; set --max-decode-workers (and --worker-threads) to let it add workers",
                b.decode.0
            );
        }
    }
    if std::env::var_os("TANDEM_KV_SECRET").is_none() {
        // One secret for this cluster, handed down in the environment (not argv, which other
        // users of the machine can read): the KV handshake's key and the worker plane's
        // credential, so only this cluster's router and workers can call its workers. Set
        // before any thread starts.
        std::env::set_var(
            "TANDEM_KV_SECRET",
            tandem_kv_transfer::Secret::random().to_text(),
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(supervise(a, model, threads))
}

/// Cores a CPU machine needs before `tandem up` starts a local prefill worker by default.
/// Below it the two roles would split too few cores: the decode worker, which prefills every
/// prompt under `--disagg-min-tokens` itself anyway, runs on half of them while the prefill
/// worker mostly waits. Measured on 2 cores (Zen 3), 64 requests of 200 prompt and 128 output
/// tokens, 8 in flight: one decode worker with both cores served 1.57-1.70x the output tokens of
/// one prefill and one decode worker with a core each, at 0.55-0.60x the TTFT p50 and 13x the
/// goodput (TTFT <= 5 s, ITL <= 250 ms); on the shared-prefix workload 1.66x the output tokens.
const LOCAL_PREFILL_MIN_CORES: usize = 8;

/// Prefill workers `tandem up` starts on a CPU machine of `cores` cores when not told.
fn default_cpu_prefill_workers(cores: usize) -> usize {
    usize::from(cores >= LOCAL_PREFILL_MIN_CORES)
}

/// A worker's command line: loopback, the given port (0: any), the model, its share of threads.
fn worker_args(
    a: &UpArgs,
    role: &'static str,
    model: &str,
    name: &str,
    threads: usize,
) -> ChildArgs {
    let mut c = ChildArgs::new(role, &a.worker_args);
    c.set("host", "127.0.0.1")
        .set("port", 0)
        .set("model", model)
        .set("threads", threads)
        .set("worker-id", name)
        .set("max-lora-rank", a.lora.max_lora_rank)
        .set("max-loras", a.lora.max_loras);
    if !a.lora.loras.is_empty() {
        c.set("lora", a.lora.loras.join(","));
    }
    if role == "decode" {
        // Ctrl-C stops every worker at once: no decode worker is left to hand requests over
        // to, so they finish where they run.
        c.set("kv-port", 0)
            .set("device", a.device)
            .set("tp", a.decode_tp)
            .set("handoff-window-s", 0);
    } else {
        c.set("device", a.prefill_device).set("tp", a.prefill_tp);
    }
    c
}

/// The router's command line, pointed at the workers: their lists, or the worker-list file
/// the autoscaler keeps (`list`).
fn router_args(
    a: &UpArgs,
    model: &str,
    decode: &[String],
    prefill: &[String],
    list: Option<&std::path::Path>,
) -> ChildArgs {
    let mut c = ChildArgs::new("router", &a.router_args);
    c.set("host", &a.host)
        .set("http-port", a.http_port)
        .set("grpc-port", a.grpc_port)
        .set("model", model)
        .set("disagg-min-tokens", a.disagg_min_tokens)
        .set(
            "policy",
            match a.policy {
                PolicyKind::RoundRobin => "round-robin",
                PolicyKind::LeastLoad => "least-load",
                PolicyKind::KvAware => "kv-aware",
            },
        );
    if let Some(path) = list {
        c.set("discovery", format!("file:{}", path.display()));
        return c;
    }
    c.set("decode-workers", decode.join(","));
    // None: no flag (an empty list would read as one worker with an empty address).
    if !prefill.is_empty() {
        c.set("prefill-workers", prefill.join(","));
    }
    c
}

/// The port at the end of `host:port` (0 when there is none).
fn port_of(addr: &str) -> u16 {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

async fn supervise(a: UpArgs, model: PathBuf, threads: usize) -> Result<()> {
    let timeout = Duration::from_secs(a.start_timeout_s);
    let model_s = model.display().to_string();
    let mut procs: Vec<Proc> = Vec::new();
    let prefill_n = a.prefill_workers.unwrap_or(0);
    let mut port = a.worker_base_port;
    for (role, n) in [(Role::Prefill, prefill_n), (Role::Decode, a.decode_workers)] {
        for i in 0..n {
            let name = format!("{}-{i}", role.name());
            procs.push(start_worker(&a, role, &model_s, name, port, threads, timeout).await?);
            if port != 0 {
                port += 1;
            }
        }
    }
    let addrs = |role| -> Vec<String> {
        procs
            .iter()
            .filter(|p| p.role == Some(role))
            .map(|p| p.addr.clone())
            .collect()
    };
    let (prefill_addrs, worker_addrs) = (addrs(Role::Prefill), addrs(Role::Decode));
    // With the autoscaler, the router follows a worker-list file it keeps.
    let list_dir = match a.scale.autoscale {
        true => Some(tempfile::Builder::new().prefix("tandem-up-").tempdir()?),
        false => None,
    };
    let list = list_dir.as_ref().map(|d| d.path().join("workers.json"));
    if let Some(path) = &list {
        write_worker_list(path, &procs)?;
    }
    let mut args = router_args(&a, &model_s, &worker_addrs, &prefill_addrs, list.as_deref());
    let mut router = spawn("router", &args.argv())?;
    let ready = wait_for_line("router", &mut router, Ready::ROUTER, timeout).await?;
    let (http, grpc) = router_addrs(&ready)?;
    // A restarted router listens where clients already connect.
    args.set("http-port", port_of(&http))
        .set("grpc-port", port_of(&grpc));
    procs.push(Proc::new(
        "router".into(),
        None,
        Ready::ROUTER,
        args,
        router,
    ));
    wait_ready(&format!("http://{http}/ready"), timeout).await?;
    // /ready is open even when the API needs a key.
    let served = reqwest::get(format!("http://{http}/ready"))
        .await?
        .json::<serde_json::Value>()
        .await?;
    let model_id = served["model"].as_str().unwrap_or("").to_string();
    println!();
    println!(
        "Tandem is up: router http://{http} (OpenAI API), gRPC {grpc}, {prefill_n} prefill and {} decode worker(s)",
        a.decode_workers
    );
    println!("Try:");
    println!(
        "  curl http://{http}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32}}'"
    );
    println!("Ctrl-C stops the cluster.");
    println!(
        "{}",
        Ready::Up {
            http: http.clone(),
            grpc: grpc.clone()
        }
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let mut scaler = match list {
        Some(path) => Some(Scaler::new(&a, path, &http, threads)?),
        None => None,
    };
    let stop = shutdown_signal();
    tokio::pin!(stop);
    // `stop` completes once: whichever wait sees it leaves this loop, not just the one around it
    // (polled again after completing, the signal's future would panic).
    'watch: loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
        if let Some(sc) = scaler.as_mut() {
            if sc.due() {
                if let Err(e) = sc.tick(&mut procs, &a, &model_s, timeout).await {
                    eprintln!("tandem up: autoscale: {e:#}");
                }
            }
        }
        for p in procs.iter_mut() {
            let exited = match p.child.as_mut() {
                Some(c) => c.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                if p.draining.is_some() {
                    // It was leaving: the autoscaler takes it out at its next look.
                    eprintln!(
                        "tandem up: {} exited while draining ({status}); not restarted",
                        p.name
                    );
                    p.child = None;
                    continue;
                }
                if p.started.elapsed() > Duration::from_secs(60) {
                    p.backoff = Duration::from_secs(1);
                }
                eprintln!(
                    "tandem up: {} exited ({status}); restarting in {:.0} s (restart {})",
                    p.name,
                    p.backoff.as_secs_f64(),
                    p.restarts + 1
                );
                p.child = None;
                tokio::select! {
                    _ = &mut stop => break 'watch,
                    _ = tokio::time::sleep(p.backoff) => {}
                }
                p.backoff = (p.backoff * 2).min(Duration::from_secs(30));
                p.restarts += 1;
                match spawn(&p.name, &p.args.argv()) {
                    Ok(mut c) => {
                        match wait_for_line(&p.name, &mut c, p.marker, timeout).await {
                            Ok(_) => eprintln!("tandem up: {} is back", p.name),
                            Err(e) => eprintln!("tandem up: {e:#}"),
                        }
                        p.child = Some(c);
                        p.started = Instant::now();
                    }
                    Err(e) => eprintln!("tandem up: {e:#}"),
                }
            }
        }
    }
    eprintln!("tandem up: stopping");
    // Router first (no new requests), then the workers drain what they have.
    for p in procs.iter().rev() {
        if let Some(c) = &p.child {
            sigterm(c);
        }
    }
    for p in procs.iter_mut() {
        if let Some(c) = p.child.as_mut() {
            if tokio::time::timeout(Duration::from_secs(40), c.wait())
                .await
                .is_err()
            {
                eprintln!("tandem up: {} did not stop in time; killing it", p.name);
                let _ = c.kill().await;
            }
        }
    }
    drop(list_dir);
    eprintln!("tandem up: stopped");
    Ok(())
}

/// The autoscaler's state in `tandem up` ([`crate::autoscale`]).
struct Scaler {
    cfg: AutoscaleArgs,
    bounds: Bounds,
    /// The worker-list file the router follows.
    list: PathBuf,
    /// The router's metrics page.
    metrics_url: String,
    window: Window,
    decider: Decider,
    /// The profiles from files (prefill, decode); None: from the workers' step costs.
    files: Option<(tandem_bench::plan::Profile, tandem_bench::plan::Profile)>,
    /// The next worker number of each role.
    next: [usize; 2],
    last: Option<Instant>,
    token: tandem_worker::WorkerToken,
    http: reqwest::Client,
    threads: usize,
    /// Each decode worker's Info (constant for its life), asked once, by address.
    infos: std::collections::HashMap<String, tandem_proto::worker::WorkerInfo>,
    /// The (wanted, serving) shapes it last reported, to report again only on a change.
    said: Option<(tandem_bench::plan::Shape, tandem_bench::plan::Shape)>,
}

impl Scaler {
    fn new(a: &UpArgs, list: PathBuf, router_http: &str, threads: usize) -> Result<Self> {
        let cfg = a.scale.clone();
        let files = match &cfg.profile {
            Some(d) => {
                let decode = autoscale::read_profile(d)?;
                let prefill = match &cfg.prefill_profile {
                    Some(p) => autoscale::read_profile(p)?,
                    None => decode.clone(),
                };
                Some((prefill, decode))
            }
            None => None,
        };
        let secret = std::env::var("TANDEM_KV_SECRET").context("the cluster's KV secret")?;
        let secret = tandem_kv_transfer::Secret::new(secret.into_bytes())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let bounds = scale_bounds(a, threads);
        eprintln!(
            "tandem up: autoscale: {}-{} decode and {}-{} prefill workers of {threads} thread(s), targets TTFT p90 {} ms, ITL {} ms, profile {}",
            bounds.decode.0,
            bounds.decode.1,
            bounds.prefill.0,
            bounds.prefill.1,
            cfg.ttft_ms,
            cfg.itl_ms,
            cfg.profile
                .as_ref()
                .map_or("from the workers' step costs".to_string(), |p| p.display().to_string()),
        );
        Ok(Self {
            bounds,
            list,
            metrics_url: format!("http://{router_http}/metrics"),
            window: Window::new(Duration::from_secs_f64(cfg.window_s)),
            decider: Decider::new(Duration::from_secs_f64(cfg.down_after_s)),
            files,
            next: [a.prefill_workers.unwrap_or(0), a.decode_workers],
            last: None,
            token: tandem_worker::WorkerToken::from_secret(&secret),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
            threads,
            infos: Default::default(),
            said: None,
            cfg,
        })
    }

    fn due(&self) -> bool {
        self.last
            .is_none_or(|t| t.elapsed().as_secs_f64() >= self.cfg.interval_s)
    }

    /// The worker's Load (and its Info when `info` and not known yet), over its control
    /// service; an error when it does not answer within 2 s (a hung worker must not hold the
    /// loop).
    async fn seen(&mut self, addr: &str, info: bool) -> Result<LoadReport> {
        tokio::time::timeout(Duration::from_secs(2), self.ask(addr, info))
            .await
            .map_err(|_| anyhow::anyhow!("{addr} did not answer within 2 s"))?
    }

    async fn ask(&mut self, addr: &str, info: bool) -> Result<LoadReport> {
        use tandem_proto::worker::{
            worker_control_client::WorkerControlClient, InfoRequest, LoadRequest,
        };
        let mut c = WorkerControlClient::connect(format!("http://{addr}")).await?;
        if info && !self.infos.contains_key(addr) {
            let mut call = tonic::Request::new(InfoRequest {});
            self.token.attach(&mut call);
            let i = c.info(call).await?.into_inner();
            self.infos.insert(addr.to_string(), i);
        }
        let mut call = tonic::Request::new(LoadRequest {});
        self.token.attach(&mut call);
        Ok(c.load(call).await?.into_inner())
    }

    /// Rewrites the worker list from the workers that serve.
    fn publish(&self, procs: &[Proc]) -> Result<()> {
        write_worker_list(&self.list, procs)
    }

    async fn tick(
        &mut self,
        procs: &mut Vec<Proc>,
        a: &UpArgs,
        model: &str,
        timeout: Duration,
    ) -> Result<()> {
        self.last = Some(Instant::now());
        let page = self
            .http
            .get(&self.metrics_url)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        self.window.push(Instant::now(), Totals::parse(&page));

        // The workers now; drains that are done end here.
        let mut seen: Vec<Option<LoadReport>> = Vec::new();
        let live = self.files.is_none();
        for p in procs.iter() {
            let s = match p.role {
                Some(role) => self.seen(&p.addr, live && role == Role::Decode).await.ok(),
                None => None,
            };
            seen.push(s);
        }
        let mut i = 0;
        while i < procs.len() {
            let Some(since) = procs[i].draining else {
                i += 1;
                continue;
            };
            let idle = seen[i]
                .as_ref()
                .is_none_or(|l| l.in_flight == 0 && l.running == 0 && l.waiting == 0);
            let late = since.elapsed().as_secs_f64() >= self.cfg.drain_timeout_s;
            if !(idle || late) {
                i += 1;
                continue;
            }
            let mut p = procs.remove(i);
            seen.remove(i);
            self.infos.remove(&p.addr);
            let status = match p.child.as_mut() {
                Some(c) => {
                    sigterm(c);
                    match tokio::time::timeout(Duration::from_secs(40), c.wait()).await {
                        Ok(s) => s.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                        Err(_) => {
                            let _ = c.kill().await;
                            "killed: it did not stop in time".to_string()
                        }
                    }
                }
                None => "not running".to_string(),
            };
            eprintln!(
                "tandem up: autoscale: {} drained in {:.1} s{} and stopped ({status})",
                p.name,
                since.elapsed().as_secs_f64(),
                if idle {
                    ""
                } else {
                    " (the drain timeout passed)"
                }
            );
        }

        let Some(load) = self.window.observed() else {
            return Ok(());
        };
        let profiles = match &self.files {
            Some(f) => Some(f.clone()),
            None => self.live_profile(procs, &seen, &load),
        };
        let Some((prefill, decode)) = profiles else {
            return Ok(());
        };
        let (want, estimate) =
            autoscale::wanted(&prefill, &decode, &load, &self.cfg.targets(), &self.bounds);
        let serving = |role| procs.iter().filter(|p| p.serves(role)).count();
        let have = tandem_bench::plan::Shape {
            prefill: serving(Role::Prefill),
            decode: serving(Role::Decode),
        };
        let waiting = Role::BOTH.map(|role| {
            procs
                .iter()
                .zip(&seen)
                .any(|(p, s)| p.role == Some(role) && s.as_ref().is_some_and(|l| l.waiting > 0))
        });
        let said = format!(
            "{:.2} req/s, {:.0} prompt and {:.0} output tokens a request: plan {} prefill + {} decode{}",
            load.rate,
            load.prompt_mean,
            load.output_mean,
            want.prefill,
            want.decode,
            estimate.map_or(String::new(), |e| format!(
                " (TTFT p90 {:.0} ms, ITL {:.0} ms by the model)",
                e.ttft_p90_ms, e.itl_ms
            ))
        );
        let actions = self.decider.decide(Instant::now(), have, want, waiting);
        // Said when it acts, and when the plan or the pools change (not every tick).
        let changed = self.said != Some((want, have));
        if !actions.is_empty() || (changed && (self.said.is_some() || want != have)) {
            eprintln!("tandem up: autoscale: {said}");
        }
        self.said = Some((want, have));
        for action in actions {
            match action {
                Action::Start(role, n) => {
                    for _ in 0..n {
                        let name = format!("{}-{}", role.name(), self.next[role as usize]);
                        self.next[role as usize] += 1;
                        let p =
                            start_worker(a, role, model, name, 0, self.threads, timeout).await?;
                        eprintln!("tandem up: autoscale: {} started", p.name);
                        procs.push(p);
                        self.publish(procs)?;
                    }
                }
                Action::Drain(role) => {
                    // The one with the least to finish; among equals the newest.
                    let pick = procs
                        .iter()
                        .enumerate()
                        .zip(&seen)
                        .filter(|((_, p), _)| p.serves(role))
                        .min_by_key(|((i, _), s)| {
                            let busy = s.as_ref().map_or(0, |l| l.in_flight + l.running);
                            (busy, std::cmp::Reverse(*i))
                        })
                        .map(|((i, _), _)| i);
                    let Some(i) = pick else { continue };
                    let url = format!("http://{}/deregister", procs[i].addr);
                    let answer = self
                        .http
                        .post(&url)
                        .header("authorization", self.token.header())
                        .send()
                        .await
                        .and_then(|r| r.error_for_status());
                    if let Err(e) = answer {
                        eprintln!(
                            "tandem up: autoscale: {}: {e}; not draining it",
                            procs[i].name
                        );
                        continue;
                    }
                    procs[i].draining = Some(Instant::now());
                    self.publish(procs)?;
                    eprintln!(
                        "tandem up: autoscale: draining {} (it finishes its requests first)",
                        procs[i].name
                    );
                }
            }
        }
        Ok(())
    }

    /// Profiles from the decode workers' own fitted step costs (the first that has one),
    /// for the lengths seen; None before any worker timed a step.
    fn live_profile(
        &self,
        procs: &[Proc],
        seen: &[Option<LoadReport>],
        load: &autoscale::Observed,
    ) -> Option<(tandem_bench::plan::Profile, tandem_bench::plan::Profile)> {
        let context = load.prompt_mean + load.output_mean / 2.0;
        let per_stream = (load.prompt_mean + load.output_mean).max(1.0);
        procs.iter().zip(seen).find_map(|(p, l)| {
            let (info, l) = (self.infos.get(&p.addr)?, l.as_ref()?);
            let tokens = f64::from(info.total_blocks) * f64::from(info.block_size.max(1));
            let max_batch = ((tokens / per_stream) as usize).max(1);
            let p = tandem_bench::plan::Profile::from_step_cost(
                "live",
                self.threads,
                [l.step_fixed_ms, l.step_token_ms, l.step_key_ms],
                l.prefill_tokens_per_s,
                load.prompt_mean,
                context,
                max_batch,
            )?;
            Some((p.clone(), p))
        })
    }
}

/// The autoscaler's bounds: from the flags given, and the cores for the most decode workers.
fn scale_bounds(a: &UpArgs, threads: usize) -> Bounds {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let prefill = a.prefill_workers.unwrap_or(0);
    let max_prefill = a.scale.max_prefill.unwrap_or(prefill).max(prefill);
    let fit = (cores / threads.max(1)).saturating_sub(max_prefill);
    let max_decode = a.scale.max_decode.unwrap_or(fit).max(a.decode_workers);
    Bounds {
        prefill: (prefill, max_prefill),
        decode: (a.decode_workers, max_decode),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(flags: &[&str]) -> UpArgs {
        let mut line = vec!["tandem", "up"];
        line.extend(flags);
        match crate::Cli::try_parse_from(line).unwrap().command {
            crate::Command::Up(a) => a,
            _ => unreachable!(),
        }
    }

    /// A local prefill worker only where each role keeps cores of its own.
    #[test]
    fn a_small_machine_runs_no_prefill_worker_by_default() {
        assert_eq!(default_cpu_prefill_workers(1), 0);
        assert_eq!(default_cpu_prefill_workers(2), 0);
        assert_eq!(default_cpu_prefill_workers(LOCAL_PREFILL_MIN_CORES - 1), 0);
        assert_eq!(default_cpu_prefill_workers(LOCAL_PREFILL_MIN_CORES), 1);
        assert_eq!(default_cpu_prefill_workers(64), 1);
    }

    #[test]
    fn a_child_line_sets_each_flag_once_and_keeps_the_pass_through_flags_last() {
        let a = up(&["--worker-arg=--kv-dtype=int8"]);
        let mut c = worker_args(&a, "decode", "/m.gguf", "decode-0", 3);
        c.set("port", 0);
        c.set("port", 40123);
        let argv = c.argv();
        assert_eq!(argv[0], "decode");
        assert_eq!(argv.iter().filter(|f| f.starts_with("--port=")).count(), 1);
        assert!(argv.contains(&"--port=40123".to_string()), "{argv:?}");
        assert!(argv.contains(&"--threads=3".to_string()), "{argv:?}");
        assert!(
            argv.contains(&"--handoff-window-s=0".to_string()),
            "{argv:?}"
        );
        assert_eq!(argv.last().unwrap(), "--kv-dtype=int8");
        match c.check().unwrap() {
            crate::Command::Decode(d) => assert_eq!((d.port, d.engine.tp), (40123, 1)),
            _ => panic!("not a decode line"),
        }
    }

    /// Decode workers run where --device says and prefill workers where --prefill-device says
    /// (the CPU unless asked): a GPU cluster with prefill workers is a valid plan, and each
    /// child's line is one its command accepts.
    #[test]
    fn each_role_runs_on_its_own_device() {
        let a = up(&[
            "--device=cuda:0",
            "--prefill-workers=1",
            "--prefill-device=cuda:1",
        ]);
        let d = worker_args(&a, "decode", "/m.gguf", "decode-0", 2);
        let p = worker_args(&a, "prefill", "/m.gguf", "prefill-0", 2);
        assert!(d.argv().contains(&"--device=cuda:0".to_string()));
        assert!(p.argv().contains(&"--device=cuda:1".to_string()));
        match p.check().unwrap() {
            crate::Command::Prefill(p) => assert_eq!(p.engine.device.to_string(), "cuda:1"),
            _ => panic!("not a prefill line"),
        }
        let cpu = up(&["--device=cuda", "--prefill-workers=1"]);
        let p = worker_args(&cpu, "prefill", "/m.gguf", "prefill-0", 2);
        assert!(
            p.argv().contains(&"--device=cpu".to_string()),
            "{:?}",
            p.argv()
        );
    }

    /// With no prefill workers the router gets no --prefill-workers flag (an empty one read as
    /// a worker with an empty address); with some, their list.
    #[test]
    fn the_router_gets_prefill_workers_only_when_there_are_some() {
        let a = up(&[]);
        let none = router_args(&a, "/m.gguf", &["127.0.0.1:1".into()], &[], None).argv();
        assert!(
            !none.iter().any(|f| f.starts_with("--prefill-workers")),
            "{none:?}"
        );
        let some = router_args(
            &a,
            "/m.gguf",
            &["127.0.0.1:1".into()],
            &["127.0.0.1:2".into(), "127.0.0.1:3".into()],
            None,
        );
        assert!(some
            .argv()
            .contains(&"--prefill-workers=127.0.0.1:2,127.0.0.1:3".to_string()));
        match some.check().unwrap() {
            crate::Command::Router(r) => assert_eq!(r.prefill_workers.len(), 2),
            _ => panic!("not a router line"),
        }
    }

    /// With the autoscaler the router follows the worker-list file up keeps, and the bounds
    /// come from the flags.
    #[test]
    fn with_the_autoscaler_the_router_follows_the_worker_list_file() {
        let a = up(&[
            "--autoscale",
            "--max-decode-workers=3",
            "--decode-workers=2",
        ]);
        let list = std::path::Path::new("/run/tandem-up/workers.json");
        let c = router_args(&a, "/m", &["127.0.0.1:1".into()], &[], Some(list));
        let argv = c.argv();
        assert!(
            argv.contains(&"--discovery=file:/run/tandem-up/workers.json".to_string()),
            "{argv:?}"
        );
        assert!(
            !argv.iter().any(|f| f.starts_with("--decode-workers")),
            "{argv:?}"
        );
        match c.check().unwrap() {
            crate::Command::Router(r) => assert_eq!(
                r.discovery,
                tandem_router::DiscoverySpec::File { path: list.into() }
            ),
            _ => panic!("not a router line"),
        }
        let b = scale_bounds(&a, 1);
        assert_eq!((b.decode, b.prefill), ((2, 3), (0, 0)));
        // A maximum below the start is the start.
        let a = up(&[
            "--autoscale",
            "--max-decode-workers=1",
            "--decode-workers=2",
            "--prefill-workers=1",
            "--max-prefill-workers=2",
        ]);
        let b = scale_bounds(&a, 1);
        assert_eq!((b.decode, b.prefill), ((2, 2), (1, 2)));
        for bad in [
            "--autoscale-interval-s=0",
            "--autoscale-window-s=-1",
            "--scale-down-after-s=nan",
        ] {
            let a = up(&["--autoscale", bad]);
            assert!(a.scale.check().is_err(), "{bad}");
        }
        assert!(up(&["--autoscale", "--scale-down-after-s=0"])
            .scale
            .check()
            .is_ok());
    }

    /// Prefill and decode workers get their own tensor-parallel sizes.
    #[test]
    fn each_role_gets_its_tensor_parallel_size() {
        let a = up(&["--decode-tp=3", "--prefill-tp=1"]);
        match worker_args(&a, "decode", "/m.gguf", "d", 3)
            .check()
            .unwrap()
        {
            crate::Command::Decode(d) => assert_eq!(d.engine.tp, 3),
            _ => panic!("not a decode line"),
        }
        match worker_args(&a, "prefill", "/m.gguf", "p", 1)
            .check()
            .unwrap()
        {
            crate::Command::Prefill(p) => assert_eq!(p.engine.tp, 1),
            _ => panic!("not a prefill line"),
        }
    }

    #[test]
    fn a_bad_pass_through_flag_is_refused_by_the_role_s_own_parser() {
        let a = up(&["--worker-arg=--no-such-flag"]);
        let Err(e) = worker_args(&a, "prefill", "/m", "p", 1).check() else {
            panic!("an unknown flag was accepted");
        };
        assert!(e.to_string().contains("--no-such-flag"), "{e}");
        let a = up(&["--router-arg=--max-queue=lots"]);
        let Err(e) = router_args(&a, "/m", &["127.0.0.1:1".into()], &[], None).check() else {
            panic!("a bad value was accepted");
        };
        assert!(e.to_string().contains("max-queue"), "{e}");
    }

    #[test]
    fn the_router_s_tls_flags_are_read_from_its_parse() {
        let a = up(&[
            "--router-arg=--tls-cert=/c.pem",
            "--router-arg=--tls-key=/k.pem",
        ]);
        match router_args(&a, "/m", &["127.0.0.1:1".into()], &[], None)
            .check()
            .unwrap()
        {
            crate::Command::Router(r) => {
                assert_eq!(r.door.tls_cert, Some(PathBuf::from("/c.pem")))
            }
            _ => panic!("not a router line"),
        }
        assert_eq!(port_of("127.0.0.1:8123"), 8123);
        assert_eq!(port_of("nonsense"), 0);
    }
}
