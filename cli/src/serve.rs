//! `tandem decode`, `tandem prefill` and `tandem router`: the long-running roles.
//!
//! Each prints one line to stdout once its ports are open (`tandem decode: listening on ADDR kv
//! ADDR`, `tandem prefill: listening on ADDR`, `tandem router: http ADDR grpc ADDR`) so a
//! supervisor (`tandem up`, a test) learns the addresses even when it asked for port 0. SIGINT and
//! SIGTERM start a graceful shutdown.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tandem_decode_worker::remote::{Deadlines, RemotePrefill};
use tandem_decode_worker::{DecodeService, Drain, WorkerIdentity};
use tandem_discovery::{DiscoverySpec, Ready, Role, WorkerCard};
use tandem_engine::{EngineError, EngineHandle};
use tandem_kernels::cuda::DeviceSpec;
use tandem_kv_transfer::{LinkFabric, NcclFabric, Secret, TcpTransport};
use tandem_prefill_worker::{PrefillLimits, PrefillService};
use tandem_router::RouterArgs;

use crate::{fetch, EngineArgs};

#[derive(Args, Clone, Debug)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, env = "TANDEM_HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// gRPC port (0: any free port).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 50100)]
    pub port: u16,
    /// This worker's name in logs and `Info` (default: decode-<port>).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Seconds in-flight requests get to finish after SIGTERM before the worker exits anyway.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// On SIGTERM (or `tandem deregister`), hand the running requests over instead of
    /// finishing them: their streams end, the router resumes them on other decode workers, and
    /// those pull their KV from here, which serves the pulls for up to this many seconds (it
    /// stops sooner once every handed-off request has been pulled). For rolling upgrades, where
    /// other decode workers stay up (the chart sets 30); a request with nowhere to go fails.
    /// 0 (the default): no hand-over, the requests finish here within --drain-timeout-s. Needs
    /// the KV plane (TANDEM_KV_SECRET).
    #[arg(long, env = "TANDEM_HANDOFF_WINDOW_S", default_value_t = 0)]
    pub handoff_window_s: u64,
    /// Port prefill workers push KV blocks to (0: any free port).
    #[arg(long, env = "TANDEM_KV_PORT", default_value_t = 50300)]
    pub kv_port: u16,
    /// Host prefill workers reach this worker's KV port at (default: --host, or 127.0.0.1 when
    /// that is 0.0.0.0). In Kubernetes, the pod IP.
    #[arg(long, env = "TANDEM_KV_ADVERTISE_HOST")]
    pub kv_advertise_host: Option<String>,
    /// Milliseconds a remote prefill may go without a word from its prefill worker (it sends a
    /// heartbeat every 250 ms while it works, and KV frames) before the next candidate is tried.
    #[arg(long, env = "TANDEM_KV_STALL_TIMEOUT_MS", default_value_t = 5_000)]
    pub kv_stall_timeout_ms: u64,
    /// A remote prefill may take this many times what the prefill worker's queue and the prompt
    /// take at the rate it measured (plus the stall timeout): slower machines get longer.
    #[arg(long, env = "TANDEM_KV_DEADLINE_SLACK", default_value_t = 4.0)]
    pub kv_deadline_slack: f64,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[command(flatten)]
    pub secret: SecretArgs,
    #[command(flatten)]
    pub link: KvLinkArgs,
    #[command(flatten)]
    pub register: RegisterArgs,
}

#[derive(Args, Clone, Debug)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, env = "TANDEM_HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// gRPC port (0: any free port).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 50200)]
    pub port: u16,
    /// This worker's name in logs and `Info` (default: prefill-<port>).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Seconds running prefills get to finish after SIGTERM.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Milliseconds of queued prompt work (at this worker's measured rate) beyond which a new
    /// prefill is refused with RESOURCE_EXHAUSTED, so its decode worker goes elsewhere at once.
    #[arg(long, env = "TANDEM_MAX_QUEUE_WAIT_MS", default_value_t = 10_000)]
    pub max_queue_wait_ms: u64,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[command(flatten)]
    pub secret: SecretArgs,
    #[command(flatten)]
    pub link: KvLinkArgs,
    #[command(flatten)]
    pub register: RegisterArgs,
}

/// How the router finds a worker, and what the worker does about it.
#[derive(Args, Clone, Debug)]
pub struct RegisterArgs {
    /// How the router finds this worker: `static` or `k8s` (the router's flags or a Service name
    /// it), or `etcd://HOST:PORT[,HOST:PORT...]` (this worker registers its card there under a
    /// lease, and deletes it first when it drains).
    #[arg(long, env = "TANDEM_DISCOVERY", default_value = "static")]
    pub discovery: DiscoverySpec,
    /// The cluster's name: with etcd, the card lives under /tandem/<cluster>/<role>/<worker-id>.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "tandem")]
    pub cluster: String,
    /// Host the router and other workers reach this worker at (default: --host, or 127.0.0.1
    /// when that is 0.0.0.0). In Kubernetes, the pod IP.
    #[arg(long, env = "TANDEM_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Seconds the etcd lease lives without a keep-alive (renewed every third of it): how long
    /// a worker that died without deregistering stays listed.
    #[arg(long, env = "TANDEM_LEASE_TTL_S", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_ttl_s: u64,
    /// Milliseconds etcd gets to answer a call (at start: an error naming it).
    #[arg(long, env = "TANDEM_ETCD_TIMEOUT_MS", default_value_t = 5_000)]
    pub etcd_timeout_ms: u64,
}

impl RegisterArgs {
    /// The host others reach this worker at.
    fn advertise(&self, host: &str) -> String {
        self.advertise_host.clone().unwrap_or_else(|| {
            if host == "0.0.0.0" {
                "127.0.0.1".into()
            } else {
                host.to_string()
            }
        })
    }

    /// Registers `card` when discovery is etcd; `None` otherwise.
    async fn register(&self, card: WorkerCard) -> Result<Option<Registration>> {
        let DiscoverySpec::Etcd { endpoints } = &self.discovery else {
            return Ok(None);
        };
        start_registration(self, endpoints.clone(), card)
            .await
            .map(Some)
    }
}

#[cfg(feature = "etcd")]
type Registration = tandem_discovery::Registration;

#[cfg(feature = "etcd")]
async fn start_registration(
    a: &RegisterArgs,
    endpoints: Vec<String>,
    card: WorkerCard,
) -> Result<Registration> {
    let cluster = tandem_discovery::ClusterPath::new(&a.cluster)?;
    let ttl = Duration::from_secs(a.lease_ttl_s);
    let timeout = Duration::from_millis(a.etcd_timeout_ms.max(1));
    // The first registration waits for etcd's answer: off the async threads.
    tokio::task::spawn_blocking(move || {
        Registration::start(endpoints, &cluster, card, ttl, timeout)
    })
    .await?
    .context("registering in etcd")
}

/// Without the etcd feature there is nothing to register with.
#[cfg(not(feature = "etcd"))]
struct Registration;

#[cfg(not(feature = "etcd"))]
impl Registration {
    async fn deregister(self) {}
}

#[cfg(not(feature = "etcd"))]
async fn start_registration(
    a: &RegisterArgs,
    _endpoints: Vec<String>,
    _card: WorkerCard,
) -> Result<Registration> {
    anyhow::bail!(
        "--discovery {}: this tandem was built without etcd support; build it with `cargo build --release --features etcd` (its etcd client needs protoc: apt-get install protobuf-compiler)",
        a.discovery
    )
}

/// Resolves on SIGINT or SIGTERM, after deleting the worker's card (if it has one): the router
/// stops sending new requests before the drain begins. A worker that leaves first (`tandem
/// deregister`, the preStop hook) deletes its card then, and still waits for the signal. A
/// worker whose engine fails (its thread panicked: every request it held has its error) deletes
/// its card and stops at once, for its supervisor to start a new one.
///
/// With a `handoff`, the worker hands its running requests over first ([`HandOff`]) and
/// keeps its card while the workers that resume them pull their KV.
async fn deregister_then_drain(
    registration: Option<Registration>,
    drain: Arc<Drain>,
    engine: Arc<EngineHandle>,
    handoff: Option<HandOff>,
) {
    // One listener throughout: a SIGTERM that comes while the card is being deleted still counts.
    let mut signal = std::pin::pin!(shutdown_signal());
    let left_first = tokio::select! {
        _ = &mut signal => false,
        _ = drain.left() => true,
        why = engine.failed() => {
            tracing::error!(why, "the engine failed: leaving the cluster and stopping");
            false
        }
    };
    // (A SIGTERM during the hand-over, as Kubernetes sends one right after the preStop hook,
    // is kept for below: the window bounds the wait.)
    if let Some(h) = handoff.filter(|_| engine.failure().is_none()) {
        h.run(&drain, &engine).await;
    }
    if let Some(r) = registration {
        r.deregister().await;
    }
    if left_first {
        tokio::select! {
            _ = signal => {}
            _ = engine.failed() => {}
        }
    }
}

/// A decode worker's hand-over on a drain: its running requests end with a hand-off status
/// (the router resumes each on another decode worker), and the worker serves the pulls of
/// their KV through its Prefill service until every one has been pulled, none is in flight,
/// or `window` passes.
struct HandOff {
    /// The Prefill service's calls in flight (the pulls).
    pulls: Arc<Drain>,
    window: Duration,
}

impl HandOff {
    async fn run(&self, drain: &Drain, engine: &EngineHandle) {
        // No new requests from here on (Load reports draining); then hand over those that run.
        drain.leave();
        let handed = engine.hand_off().await;
        let (parked, _) = engine.stats().parked_tails;
        tracing::info!(
            requests = handed,
            parked,
            window_s = self.window.as_secs_f64(),
            "draining: handed the running requests over; serving the pulls of their KV"
        );
        let until = tokio::time::Instant::now() + self.window;
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            let (parked, pulled) = engine.stats().parked_tails;
            if pulled >= parked && self.pulls.in_flight() == 0 {
                tracing::info!(pulled, "every handed-off request was pulled");
                return;
            }
            if tokio::time::Instant::now() >= until {
                tracing::warn!(
                    not_pulled = parked - pulled,
                    "hand-off window passed: the requests not pulled are computed again where they resumed"
                );
                return;
            }
            tick.tick().await;
        }
    }
}

/// After the server stopped: an error naming the panic if the engine failed (the process
/// exits with it, non-zero, so that it is restarted).
fn engine_outcome(role: &str, engine: &EngineHandle) -> Result<()> {
    match engine.failure() {
        Some(why) => anyhow::bail!(
            "tandem {role}: the engine failed ({why}); stopped so that it is restarted"
        ),
        None => {
            eprintln!("tandem {role}: stopped");
            Ok(())
        }
    }
}

/// A worker's card, as the router checks it.
fn card(
    role: Role,
    identity: &WorkerIdentity,
    grpc: String,
    kv: Option<String>,
    limits: tandem_engine::Limits,
) -> WorkerCard {
    WorkerCard {
        role,
        worker_id: identity.worker_id.clone(),
        grpc_addr: grpc,
        kv_addr: kv,
        model: identity.model.clone(),
        block_size: u32::try_from(limits.block_size).unwrap_or(u32::MAX),
        kv_dtype: identity.kv_dtype.clone(),
        tp: u32::try_from(limits.tensor_parallel).unwrap_or(u32::MAX),
        version: env!("CARGO_PKG_VERSION").to_string(),
    }
}

#[derive(Args, Clone, Debug)]
pub struct SecretArgs {
    /// The cluster's KV secret (at least 16 bytes), shared by prefill and decode workers: peers
    /// prove they hold it before any KV moves. Prefer the environment variable to the flag.
    #[arg(long, env = "TANDEM_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
}

/// Where KV block payloads travel between two GPU workers (`--kv-link`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLinkMode {
    /// On an NCCL link where this worker runs on a GPU and NCCL loads; TCP otherwise.
    Auto,
    /// On an NCCL link, refused at start where this worker cannot make one.
    Nccl,
    /// Always over the TCP connection.
    Off,
}

impl std::str::FromStr for KvLinkMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "nccl" => Ok(Self::Nccl),
            "off" => Ok(Self::Off),
            _ => Err(format!("unknown KV link {s:?} (auto, nccl or off)")),
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct KvLinkArgs {
    /// Where KV block payloads travel between GPU workers: `auto` offers (prefill) and joins
    /// (decode) an NCCL link beside each KV connection when this worker runs on a GPU and NCCL
    /// loads, the payloads then going GPU to GPU while headers, checksums and deadlines stay on
    /// the TCP connection (a peer that cannot join keeps to TCP); `nccl` the same, refused at
    /// start where this worker cannot make NCCL links; `off` TCP only.
    #[arg(long, env = "TANDEM_KV_LINK", default_value = "auto")]
    pub kv_link: KvLinkMode,
    /// Milliseconds an NCCL link waits for its peer's side of a payload before the transfer
    /// fails (and is retried or prefilled locally); a link's setup and any one operation are
    /// given up after twice this.
    #[arg(long, env = "TANDEM_KV_LINK_WATCHDOG_MS", default_value_t = 30_000)]
    pub kv_link_watchdog_ms: u64,
}

impl KvLinkArgs {
    /// The GPU this worker's links would run on, if any; refused where `nccl` was asked on the
    /// CPU.
    fn ordinal(&self, device: DeviceSpec) -> Result<Option<usize>> {
        match (self.kv_link, device) {
            (KvLinkMode::Off, _) | (KvLinkMode::Auto, DeviceSpec::Cpu) => Ok(None),
            (KvLinkMode::Nccl, DeviceSpec::Cpu) => anyhow::bail!(
                "--kv-link nccl: NCCL links join GPUs, and this worker runs on the CPU (--device cpu)"
            ),
            (_, DeviceSpec::Cuda(n)) => Ok(Some(n)),
        }
    }

    /// The fabric this worker offers or joins payload links with, on `device`; None: TCP only.
    fn fabric(&self, device: DeviceSpec, role: &str) -> Result<Option<Arc<dyn LinkFabric>>> {
        let Some(ordinal) = self.ordinal(device)? else {
            return Ok(None);
        };
        let watchdog = Duration::from_millis(self.kv_link_watchdog_ms.max(1));
        match NcclFabric::new(ordinal, watchdog) {
            Ok(f) => {
                eprintln!("tandem {role}: KV payloads between GPUs on NCCL links (cuda:{ordinal})");
                Ok(Some(Arc::new(f)))
            }
            Err(e) if self.kv_link == KvLinkMode::Auto => {
                eprintln!("tandem {role}: KV payloads over TCP only: {e}");
                Ok(None)
            }
            Err(e) => anyhow::bail!("--kv-link nccl: {e}"),
        }
    }
}

impl SecretArgs {
    fn secret(&self) -> Result<Secret> {
        let text = self.kv_secret.as_deref().context(
            "no KV secret: set TANDEM_KV_SECRET (or --kv-secret) to the same value of at least 16 bytes on every prefill and decode worker",
        )?;
        Secret::new(text.as_bytes().to_vec()).map_err(|e| anyhow::anyhow!("{e}"))
    }
}

/// A serving worker's step target unless `--step-target-ms` says otherwise. Measured on 2 cores
/// of Zen 5 (`scripts/bench-scheduler`, against no target: vLLM's policy of FCFS steps of up to
/// 2048 tokens): a burst of 8 prompts reaches its first tokens at 0.51-0.54x the median TTFT, and
/// with long prompts mixed in at 0.15-0.24x with 0.29-0.31x the p99 inter-token gap; output
/// tokens/s within the rounds' noise. 100 ms bounded the gaps closer (0.12-0.13x) at 1.3-2x the
/// p99 TTFT under overload.
pub(crate) const SERVE_STEP_TARGET_MS: f64 = 250.0;

/// Prompt tokens a step target never cuts (`EngineConfig::step_target_whole`): a step holding
/// a prompt chunk may take as long as this many tokens cost. On 2 cores of Zen 4 a 200-token
/// prompt took 260-330 ms in the server, just over the 250 ms target, so every prompt was
/// computed in two steps, each shared with a neighbour's head or tail. Under Poisson arrivals
/// of 200-token prompts there (`tandem bench serve --compare`, this rule's binary beside the
/// plain target's, 2026-12-06) it gave 0.83-0.94x the TTFT p50 at 2 requests a second and the
/// same at 4, and on a burst with a 1500-token prompt every 4th 1.10x the output with the p99
/// gap 376 ms against 282. Where 256 tokens fit in the target (a faster machine) nothing
/// changes.
pub(crate) const STEP_TARGET_WHOLE_TOKENS: usize = 256;

// The serving roles set no ITL target (`--itl-target-ms`) of their own: the step target above
// already bounds a decoding stream's gaps (at about 250 ms), and a tighter one costs the first
// tokens, the output and the goodput. On the Poisson sweep of `scripts/bench-serve-peer` (2
// cores of an Intel Xeon with AMX, 200-token prompts, 64 output tokens, 2026-12-05) 100 ms cut
// the gaps' p99 from 197-258 ms to 103-117 ms at 1-4 requests a second but took the TTFT p50 to
// 1.10-1.40x at 1-8, the output to 0.89-0.92x at 4 and 8, the goodput at 8 to 0.66x, and the
// ITL p50 to 1.1-2.0x (every step of a busy worker held near the target); with none, Tandem's
// gaps' p99 stayed below vLLM's CPU build's (238-769 ms) at every rate.

/// Loads the engine on its own thread; returns it with the model's name and the cache's dtype.
/// What a started engine serves: its model's name and shape, its KV element type, and whether
/// its device runs LoRA adapters.
struct Started {
    model: String,
    kv_dtype: String,
    config: tandem_model::ModelConfig,
    lora: bool,
}

fn start_engine(engine: &EngineArgs) -> Result<(EngineHandle, Started)> {
    let model_path = match &engine.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model()?,
    };
    let mut engine_args = engine.clone();
    engine_args.model = Some(model_path);
    engine_args
        .step_target_ms
        .get_or_insert(SERVE_STEP_TARGET_MS);
    let (name_tx, name_rx) = std::sync::mpsc::channel();
    let handle = EngineHandle::spawn(move || {
        let (engine, loaded) = engine_args
            .build()
            .map_err(|e| EngineError::Startup(format!("{e:#}")))?;
        let _ = name_tx.send(Started {
            model: loaded.name.clone(),
            kv_dtype: engine.backend().kv_dtype_name().to_string(),
            config: engine.model_config().clone(),
            lora: engine.backend().supports_lora(),
        });
        Ok(engine)
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let started = name_rx
        .recv()
        .context("engine thread died while starting")?;
    Ok((handle, started))
}

/// The LoRA adapters a worker serves.
#[derive(Args, Clone, Debug)]
pub struct LoraArgs {
    /// A LoRA adapter to serve from the start, NAME=PATH (a PEFT directory with
    /// adapter_config.json and adapter_model.safetensors); repeatable (or comma-separated in
    /// TANDEM_LORAS). Requests select one by naming it as their `model`; more are loaded at run
    /// time with POST /v1/load_lora_adapter.
    #[arg(long = "lora", env = "TANDEM_LORAS", value_delimiter = ',')]
    pub loras: Vec<String>,
    /// The largest adapter rank accepted.
    #[arg(long, env = "TANDEM_MAX_LORA_RANK", default_value_t = 64)]
    pub max_lora_rank: usize,
    /// Adapters held in memory at once; past it the least recently used one no request holds
    /// is dropped and read again from its path when next asked for.
    #[arg(long, env = "TANDEM_MAX_LORAS", default_value_t = 8)]
    pub max_loras: usize,
}

impl LoraArgs {
    /// The worker's adapters, those of `--lora` read and checked against the engine's model
    /// (any bad one stops the worker with its reason).
    fn registry(&self, started: &Started) -> Result<Arc<tandem_worker::Loras>> {
        if !started.lora {
            if !self.loras.is_empty() {
                anyhow::bail!("--lora: this worker's device runs the base model only (LoRA adapters run on the CPU, one rank)");
            }
            return Ok(Arc::new(tandem_worker::Loras::none(started.config.clone())));
        }
        if self.max_loras == 0 {
            anyhow::bail!("--max-loras must be at least 1");
        }
        let l =
            tandem_worker::Loras::new(started.config.clone(), self.max_lora_rank, self.max_loras);
        for spec in &self.loras {
            let (name, path) = spec
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--lora {spec:?}: expected NAME=PATH"))?;
            if name == started.model {
                anyhow::bail!("--lora {spec:?}: the base model's name");
            }
            let t0 = std::time::Instant::now();
            let info = l
                .load(name, std::path::Path::new(path))
                .map_err(|e| anyhow::anyhow!("--lora {spec:?}: {e}"))?;
            tracing::info!(
                adapter = name,
                path,
                rank = info.rank,
                bytes = info.bytes,
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "LoRA adapter loaded"
            );
        }
        Ok(Arc::new(l))
    }
}

/// Resolves when the process gets SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The async runtime for the network side. A decode worker gives it one thread: its compute
/// runs on rayon threads that every extra runnable thread would preempt.
fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Opens a worker's gRPC port and names the worker (`<role>-<port>` unless `worker_id` is given).
async fn bind_worker(
    host: &str,
    port: u16,
    role: &str,
    worker_id: Option<String>,
    started: Started,
    loras: Arc<tandem_worker::Loras>,
) -> Result<(
    tokio::net::TcpListener,
    std::net::SocketAddr,
    WorkerIdentity,
)> {
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .with_context(|| format!("cannot listen on {host}:{port}"))?;
    let addr = listener.local_addr()?;
    let identity = WorkerIdentity {
        worker_id: worker_id.unwrap_or_else(|| format!("{role}-{}", addr.port())),
        model: started.model,
        kv_dtype: started.kv_dtype,
        loras,
    };
    Ok((listener, addr, identity))
}

pub fn run_decode(a: DecodeArgs) -> Result<()> {
    if !(a.kv_deadline_slack.is_finite() && a.kv_deadline_slack >= 1.0) {
        anyhow::bail!(
            "--kv-deadline-slack {} must be a number of at least 1 (it multiplies the prefill worker's own timings)",
            a.kv_deadline_slack
        );
    }
    // A secret is needed only to take remote plans; without one this worker prefills everything.
    let secret = match a.secret.kv_secret {
        Some(_) => Some(a.secret.secret()?),
        None => None,
    };
    // The secret is also the worker plane's credential: without one, anyone who reaches this
    // worker's port can call it.
    let token = secret.as_ref().map(tandem_worker::WorkerToken::from_secret);
    if token.is_none() {
        eprintln!(
            "tandem decode: no TANDEM_KV_SECRET: this worker's RPCs are open to anyone who reaches its port; set the cluster's secret on every process"
        );
    }
    // Without a secret this worker has no KV plane to use links on; a link mode it could not
    // make is refused alike.
    let link = match secret {
        Some(_) => a.link.fabric(a.engine.device, "decode")?,
        None => a.link.ordinal(a.engine.device).map(|_| None)?,
    };
    let (handle, started) = start_engine(&a.engine)?;
    let loras = a.lora.registry(&started)?;
    let target = tandem_worker::KvTarget::of(&handle);
    let handle = Arc::new(handle);
    let rt = runtime(1)?;
    rt.block_on(async move {
        let (listener, addr, identity) = bind_worker(
            &a.host,
            a.port,
            "decode",
            a.worker_id.clone(),
            started,
            loras,
        )
        .await?;
        let advertise = a.register.advertise(&a.host);
        let grpc_addr = format!("{advertise}:{}", addr.port());
        let mut service = DecodeService::new(handle.clone(), identity.clone());
        let mut kv_addr = None;
        let mut peer = None;
        if let Some(secret) = secret {
            let advertise = a
                .kv_advertise_host
                .clone()
                .unwrap_or_else(|| advertise.clone());
            let target = target.context(
                "KV transfers reach neither a host pool nor a device pool of this engine",
            )?;
            // SAFETY: the target is this engine's, and RemotePrefill grants only blocks the
            // engine reserved and parked for a remote prefill.
            let remote = unsafe {
                RemotePrefill::bind(
                    &format!("{}:{}", a.host, a.kv_port),
                    &advertise,
                    secret.clone(),
                    &identity.model,
                    target.clone(),
                    Deadlines {
                        stall: Duration::from_millis(a.kv_stall_timeout_ms),
                        slack: a.kv_deadline_slack,
                    },
                )
            }
            .await
            .with_context(|| format!("cannot listen for KV on {}:{}", a.host, a.kv_port))?;
            if let Some(f) = &link {
                remote.receiver().join_links(f.clone());
            }
            kv_addr = Some(remote.endpoint().to_string());
            service = service.with_remote(Arc::new(remote));
            // Its peers pull the prefixes it holds through the Prefill service on its port: its
            // engine computes what it lacks of the prompt and pushes every block.
            let shape = target
                .shape(&identity.model)
                .context("a decode worker serves its peers from its KV pool")?;
            let mut transport = TcpTransport::new(secret).with_shape(shape);
            if let Some(f) = link {
                transport = transport.with_link(f);
            }
            peer = Some(PrefillService::new(
                handle.clone(),
                Arc::new(transport),
                identity.clone(),
                PrefillLimits::default(),
            ));
        }
        let card = card(
            Role::Decode,
            &identity,
            grpc_addr,
            kv_addr.clone(),
            handle.limits(),
        );
        let registration = a.register.register(card).await?;
        println!(
            "{}",
            Ready::Decode {
                grpc: addr.to_string(),
                kv: kv_addr
            }
        );
        std::io::stdout().flush()?;
        let drain = service.control().drain().clone();
        // Hand-over needs the peer Prefill service, over which the KV is pulled.
        let handoff = peer
            .as_ref()
            .filter(|_| a.handoff_window_s > 0)
            .map(|p| HandOff {
                pulls: p.control().drain().clone(),
                window: Duration::from_secs(a.handoff_window_s),
            });
        tandem_decode_worker::serve_beside(
            listener,
            service,
            |routes| match peer {
                Some(p) => tandem_prefill_worker::beside(p, routes),
                None => routes,
            },
            deregister_then_drain(registration, drain, handle.clone(), handoff),
            Duration::from_secs(a.drain_timeout_s),
            token,
        )
        .await
        .context("decode worker")?;
        engine_outcome("decode", &handle)
    })
}

pub fn run_prefill(a: PrefillArgs) -> Result<()> {
    let secret = a.secret.secret()?;
    let token = tandem_worker::WorkerToken::from_secret(&secret);
    let link = a.link.fabric(a.engine.device, "prefill")?;
    let (handle, started) = start_engine(&a.engine)?;
    let loras = a.lora.registry(&started)?;
    let handle = Arc::new(handle);
    let rt = runtime(1)?;
    rt.block_on(async move {
        let (listener, addr, identity) = bind_worker(
            &a.host,
            a.port,
            "prefill",
            a.worker_id.clone(),
            started,
            loras,
        )
        .await?;
        let grpc_addr = format!("{}:{}", a.register.advertise(&a.host), addr.port());
        let card = card(Role::Prefill, &identity, grpc_addr, None, handle.limits());
        let shape = tandem_worker::KvTarget::of(&handle)
            .and_then(|t| t.shape(&identity.model))
            .context("a prefill worker sends from its engine's KV pool (host or device)")?;
        let mut transport = TcpTransport::new(secret).with_shape(shape);
        if let Some(f) = link {
            transport = transport.with_link(f);
        }
        let service = PrefillService::new(
            handle.clone(),
            Arc::new(transport),
            identity,
            PrefillLimits {
                max_queue_wait: Duration::from_millis(a.max_queue_wait_ms),
            },
        );
        let registration = a.register.register(card).await?;
        println!(
            "{}",
            Ready::Prefill {
                grpc: addr.to_string()
            }
        );
        std::io::stdout().flush()?;
        let drain = service.control().drain().clone();
        tandem_prefill_worker::serve(
            listener,
            service,
            deregister_then_drain(registration, drain, handle.clone(), None),
            Duration::from_secs(a.drain_timeout_s),
            Some(token),
        )
        .await
        .context("prefill worker")?;
        engine_outcome("prefill", &handle)
    })
}

#[derive(Args, Clone, Debug)]
pub struct DeregisterArgs {
    /// The worker's gRPC port on this host (its `--port`).
    #[arg(long)]
    pub port: u16,
    #[command(flatten)]
    pub secret: SecretArgs,
}

/// Asks the worker listening on 127.0.0.1:PORT to leave the cluster; prints its answer.
pub fn run_deregister(a: DeregisterArgs) -> Result<()> {
    let url = format!("http://127.0.0.1:{}/deregister", a.port);
    runtime(1)?.block_on(async {
        let mut req = reqwest::Client::new().post(&url);
        if a.secret.kv_secret.is_some() {
            let token = tandem_worker::WorkerToken::from_secret(&a.secret.secret()?);
            req = req.header("authorization", token.header());
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("no worker answers at {url}"))?;
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            anyhow::bail!("{url}: {status}: {body}");
        }
        println!("{body}");
        Ok(())
    })
}

pub fn run_router(a: RouterArgs) -> Result<()> {
    let path = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model()?,
    };
    let model = tandem_router::load_model(&path, a.served_model_name.clone())
        .with_context(|| format!("loading the tokenizer from {}", path.display()))?
        .with_tool_call_parser(a.tool_call_parser)
        .with_reasoning_parser(a.reasoning_parser);
    let rt = runtime(2)?;
    rt.block_on(async move {
        tandem_router::serve(
            a,
            model,
            |b| {
                println!(
                    "{}",
                    Ready::Router {
                        http: b.http.to_string(),
                        grpc: b.grpc.to_string()
                    }
                );
                let _ = std::io::stdout().flush();
            },
            shutdown_signal(),
        )
        .await
        .context("router")
    })
}
