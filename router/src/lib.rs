//! tandem-router: the front door. OpenAI-compatible HTTP and the `tandem.v1.Generation` gRPC
//! API, tokenization and chat templates, routing to decode workers, incremental detokenization
//! and stop strings.
//!
//! Owns: [`RouterArgs`] (the `tandem router` flags) and [`serve`], which runs a router over a
//! [`ServedModel`] from [`load_model`]; the [`Dispatcher`], the path both APIs share (validate,
//! tokenize, pick a worker, stream its tokens back as text, move a request whose worker dies);
//! the two API surfaces over it ([`routes`] for HTTP, [`GenerationService`] for gRPC) behind the
//! [`FrontDoor`] (API keys, TLS, client limits); the [`Flow`] controller (tenants from
//! `--tenants`, their quotas, and the router's queue by priority band and fair share); the
//! routing [`policy`] implementations (one file
//! each behind [`RoutingPolicy`]); the [`WorkerPool`]s with what the router knows of each
//! [`Worker`] (readiness, load, a prefix-cache index fed by its KV events); the [`Discovery`] seam
//! the pools follow (static lists, etcd cards or Kubernetes DNS, chosen by [`DiscoverySpec`]);
//! the [`WorkerClient`]/[`Connect`] seam to the workers; [`ApiError`], where every failure gets
//! its HTTP status and gRPC code; and the [`RouterMetrics`].
//!
//! Does not own any model compute: it reads the model file only for its tokenizer, template and
//! context length, and never links the engine.
//!
//! Main types: [`Dispatcher`] with its [`DispatchConfig`], [`Prepared`] requests and the
//! [`Generation`] that streams [`Chunk`]s; [`WorkerPool`] with its [`PoolConfig`]; [`ApiError`].
//! Everything is exported here; the modules are private except [`policy`], which keeps
//! [`policy::build`] and the policies themselves.
//!
//! ```
//! use tandem_router::{policy, ApiError, Candidate, PolicyKind};
//!
//! // A policy sees one candidate per ready worker and answers with an index.
//! let least_load = policy::build(PolicyKind::LeastLoad, Default::default());
//! let busy = Candidate { load: 3, ..Default::default() };
//! let idle = Candidate { load: 0, ..Default::default() };
//! assert_eq!(least_load.pick(&[busy, idle]), 1);
//!
//! // Every refusal has one HTTP status (and one gRPC code).
//! assert_eq!(ApiError::QueueFull(64).status().as_u16(), 503);
//! ```

#![deny(missing_docs)]

mod client;
mod discovery;
mod dispatch;
mod error;
mod flow;
mod front;
mod grpc;
mod kv_index;
mod metrics;
mod openai;
pub mod policy;
mod text;
mod trace;
mod workers;

pub use client::{Connect, WorkerClient, WorkerStream};
pub use discovery::Discovery;
pub use dispatch::{
    Chunk, DispatchConfig, Dispatcher, FinishKind, GenParams, Generation, MaxTokensDefault,
    Prepared, PromptInput, ReasoningParser, RouterRequestId, ServedModel, TokenOut, Usage,
};
pub use error::ApiError;
pub use flow::{Caller, Flow, FlowConfig, Permit, TenantSpec, TenantTable, Tenants};
pub use front::{ApiKeys, ConnLimits, FrontDoor, FrontDoorArgs, FrontDoorError};
pub use grpc::GenerationService;
pub use metrics::RouterMetrics;
pub use openai::{routes, Responses, StoreConfig, StoreSpec};
pub use policy::{Candidate, DisaggConfig, KvAwareConfig, PolicyKind, RoutingPolicy};
pub use tandem_discovery::DiscoverySpec;
pub use workers::{InFlightGuard, PoolConfig, PoolShared, Role, Worker, WorkerAddr, WorkerPool};

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use futures::StreamExt;
use tokio::net::TcpListener;

use crate::client::GrpcConnect;
use crate::discovery::{DnsDiscovery, DnsResolver, FileDiscovery, Published};

/// `tandem router` flags.
#[derive(Args, Clone, Debug)]
pub struct RouterArgs {
    /// GGUF file or HF directory the tokenizer and chat template come from (the default model
    /// when not given).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// The cluster's secret (the workers' `TANDEM_KV_SECRET`): the router derives the worker
    /// plane's credential from it and sends it on every call to a worker. Prefer the
    /// environment variable to the flag.
    #[arg(long, env = "TANDEM_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
    /// The model name clients send (default: the model file's name).
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// How the model writes tool calls, which the router parses out of its output with
    /// `tool_choice: auto`: hermes (`<tool_call>` blocks), mistral (`[TOOL_CALLS]` and a JSON
    /// list), llama3_json (the output a JSON call). Default: what the chat template shows
    /// (hermes for a template without tools, which is told to write that).
    #[arg(long, env = "TANDEM_TOOL_CALL_PARSER")]
    pub tool_call_parser: Option<tandem_model::ToolCallStyle>,
    /// How the model's reasoning is told from its answer, and split out (chat's
    /// `reasoning_content`, Responses reasoning items, Messages thinking blocks): qwen3 or
    /// deepseek_r1 (`<think>...</think>` before the answer), none. Default: qwen3 where the
    /// chat template writes `<think>`, else none.
    #[arg(long, env = "TANDEM_REASONING_PARSER")]
    pub reasoning_parser: Option<ReasoningParser>,
    /// Address to listen on.
    #[arg(long, env = "TANDEM_HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// OpenAI-compatible HTTP port (0: any free port).
    #[arg(long, env = "TANDEM_HTTP_PORT", default_value_t = 8000)]
    pub http_port: u16,
    /// gRPC port for tandem.v1.Generation (0: any free port).
    #[arg(long, env = "TANDEM_GRPC_PORT", default_value_t = 50051)]
    pub grpc_port: u16,
    /// Decode workers, host:port, comma-separated (static discovery).
    #[arg(long, env = "TANDEM_DECODE_WORKERS", value_delimiter = ',')]
    pub decode_workers: Vec<String>,
    /// How a request's decode worker is chosen.
    #[arg(long, env = "TANDEM_POLICY", default_value = "kv-aware")]
    pub policy: PolicyKind,
    /// Most requests in flight through the router (waiting in its queue or at the workers);
    /// more are refused with 503 and `Retry-After` (overloaded).
    #[arg(long, env = "TANDEM_MAX_QUEUE", default_value_t = 4096)]
    pub max_queue: usize,
    /// Most samples this router keeps at each ready decode worker; more wait in the router's
    /// queue, which dispatches by priority band and, within a band, by tenants' fair shares of
    /// tokens served. 0: no limit (only a tenant's max_concurrent holds requests back, and the
    /// engines order what they are sent by priority).
    #[arg(long, env = "TANDEM_MAX_IN_FLIGHT_PER_WORKER", default_value_t = 0)]
    pub max_in_flight_per_worker: usize,
    /// Routers behind one Service that share the tenants' limits: each enforces its share (a
    /// tenant's requests and tokens a minute over N, its max_concurrent over N rounded up), so
    /// N replicas together hold a tenant to about its quota when the Service spreads the load
    /// evenly (the chart sets router.replicas). 1: this router's limits are the tenants'.
    #[arg(long, env = "TANDEM_ROUTER_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub router_replicas: u32,
    /// Longest a request waits in the router's queue before it is refused with 503 (before
    /// any work is done), for tenants that set no max_queue_wait_ms. 0: no limit.
    #[arg(long, env = "TANDEM_MAX_QUEUE_WAIT_MS", default_value_t = 0)]
    pub max_queue_wait_ms: u64,
    /// kv-aware: blocks of prefill that one in-flight request on a worker is worth.
    #[arg(long, env = "TANDEM_KV_LOAD_WEIGHT", default_value_t = 1.0)]
    pub kv_load_weight: f64,
    /// kv-aware: blocks of prefill that reading one block back from a worker's disk tier is
    /// worth.
    #[arg(long, env = "TANDEM_KV_DISK_WEIGHT", default_value_t = 0.1)]
    pub kv_disk_weight: f64,
    /// kv-aware: fall back to least-load when the busiest worker has this many more requests in
    /// flight than the idlest ...
    #[arg(long, env = "TANDEM_BALANCE_ABS", default_value_t = 8)]
    pub balance_abs: usize,
    /// ... and this many times as many.
    #[arg(long, env = "TANDEM_BALANCE_REL", default_value_t = 1.5)]
    pub balance_rel: f64,
    /// How often each worker's load is polled, in milliseconds.
    #[arg(long, env = "TANDEM_POLL_MS", default_value_t = 500)]
    pub poll_ms: u64,
    /// Prefill workers, host:port, comma-separated (static discovery). None: every prompt is
    /// prefilled on its decode worker.
    #[arg(long, env = "TANDEM_PREFILL_WORKERS", value_delimiter = ',')]
    pub prefill_workers: Vec<String>,
    /// A prompt is prefilled on a prefill worker when at least this many of its tokens are not
    /// in the chosen decode worker's prefix cache.
    #[arg(long, env = "TANDEM_DISAGG_MIN_TOKENS", default_value_t = 256)]
    pub disagg_min_tokens: usize,
    /// Prompts this router keeps in flight on one prefill worker before it prefers prefilling
    /// locally.
    #[arg(long, env = "TANDEM_PREFILL_CAPACITY", default_value_t = 4)]
    pub prefill_capacity: usize,
    /// Never pull a prompt's KV from another decode worker that holds more of its prefix (in
    /// its pool or on its disk) than the chosen one; compute it instead.
    #[arg(long, env = "TANDEM_NO_PEER_PULL")]
    pub no_peer_pull: bool,
    /// Times a request may move to another decode worker when its worker dies mid-stream.
    #[arg(long, env = "TANDEM_MAX_MIGRATIONS", default_value_t = 2)]
    pub max_migrations: u32,
    /// Give up on a decode worker's stream (and move the request to another worker) after this
    /// many milliseconds without a token or heartbeat (workers send one every second of
    /// silence), as when the worker is frozen or cut off.
    #[arg(long, env = "TANDEM_WORKER_STALL_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub worker_stall_timeout_ms: u64,
    /// How workers are found: `static` (the --decode-workers and --prefill-workers lists),
    /// `file:PATH` (a JSON file `{"decode": ["host:port", ...], "prefill": [...]}`, read
    /// again when it changes), `etcd://HOST:PORT[,HOST:PORT...]` (workers register their
    /// cards there), or `k8s` (the
    /// two lists name headless Services, re-resolved through DNS: `name:port` for A records,
    /// `_grpc._tcp.name...` without a port for SRV records).
    #[arg(long, env = "TANDEM_DISCOVERY", default_value = "static")]
    pub discovery: DiscoverySpec,
    /// The cluster's name: with etcd, its workers' cards live under /tandem/<cluster>/.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "tandem")]
    pub cluster: String,
    /// Milliseconds etcd gets to answer a call before it counts as unreachable (at start:
    /// an error naming it).
    #[arg(long, env = "TANDEM_ETCD_TIMEOUT_MS", default_value_t = 5_000)]
    pub etcd_timeout_ms: u64,
    /// k8s: the DNS server (`ip:port`) to resolve the Services' names through, instead of the
    /// system's (`/etc/resolv.conf`).
    #[arg(long, env = "TANDEM_DNS_SERVER")]
    pub dns_server: Option<SocketAddr>,
    /// k8s: how often the Services' DNS names are resolved again, in milliseconds.
    #[arg(long, env = "TANDEM_DNS_REFRESH_MS", default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub dns_refresh_ms: u64,
    /// file:PATH: how often the worker-list file is read again, in milliseconds.
    #[arg(long, env = "TANDEM_FILE_REFRESH_MS", default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
    pub file_refresh_ms: u64,
    /// Tokens per KV block the cluster's workers use; a worker with another is refused, as is
    /// one serving another model (default: the first worker's block size).
    #[arg(long, env = "TANDEM_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Who may call and how much a client may hold: API keys, TLS, and the request limits.
    #[command(flatten)]
    pub door: FrontDoorArgs,
    /// Where the Responses API keeps stored responses (`store: true`, for GET and
    /// `previous_response_id`): `memory` (this router's, bounded by --responses-store-mb, least
    /// recently used evicted first) or `etcd://HOST:PORT[,HOST:PORT...]` (shared by every router
    /// of the cluster, under /tandem/<cluster>/responses/; needs the `etcd` feature).
    #[arg(long, env = "TANDEM_RESPONSES_STORE", default_value = "memory")]
    pub responses_store: openai::StoreSpec,
    /// Memory store: most MiB of stored responses kept.
    #[arg(long, env = "TANDEM_RESPONSES_STORE_MB", default_value_t = 256)]
    pub responses_store_mb: u64,
    /// Seconds a stored response is kept after it was last written.
    #[arg(long, env = "TANDEM_RESPONSES_TTL_S", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..))]
    pub responses_ttl_s: u64,
}

/// Why the router could not start or stopped serving; each says what to change.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// A listening port could not be opened (taken, or the host is not this machine's).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The `host:port` asked for.
        addr: String,
        /// The operating system's refusal.
        source: std::io::Error,
    },
    /// Static or k8s discovery was chosen with no `--decode-workers` to start from.
    #[error("no decode workers given: pass --decode-workers host:port,... (or --discovery etcd://HOST:PORT)")]
    NoWorkers,
    /// The discovery service failed at start (etcd unreachable, a bad cluster name).
    #[error("discovery: {0}")]
    Discovery(#[from] tandem_discovery::DiscoveryError),
    /// `--discovery etcd://...` on a build without the `etcd` feature.
    #[error("--discovery {0}: this tandem was built without etcd support; build it with `cargo build --release --features etcd` (its etcd client needs protoc: apt-get install protobuf-compiler)")]
    NoEtcd(DiscoverySpec),
    /// The front door's flags make no front door (an unreadable key file, a bad certificate).
    #[error(transparent)]
    FrontDoor(#[from] FrontDoorError),
    /// The worker-list file of file discovery could not be read at start.
    #[error("file discovery: {0}")]
    File(String),
    /// The DNS resolver for k8s discovery could not start.
    #[error("k8s discovery: {0}")]
    Dns(String),
    /// A server failed while running, or its address could not be read back.
    #[error("server: {0}")]
    Serve(String),
    /// A setting that cannot work (a KV secret too short to be the cluster's).
    #[error("{0}")]
    Config(String),
}

/// Where the router ended up listening.
#[derive(Clone, Copy, Debug)]
pub struct Listening {
    /// The OpenAI-compatible HTTP API's address (the real port when 0 was asked for).
    pub http: SocketAddr,
    /// The `tandem.v1.Generation` gRPC API's address.
    pub grpc: SocketAddr,
}

async fn bind(host: &str, port: u16) -> Result<TcpListener, RouterError> {
    let addr = format!("{host}:{port}");
    TcpListener::bind(&addr)
        .await
        .map_err(|source| RouterError::Bind { addr, source })
}

/// Runs the router until `shutdown` resolves. `on_bound` learns the listening addresses as soon
/// as both ports are open.
pub async fn serve(
    args: RouterArgs,
    model: ServedModel,
    on_bound: impl FnOnce(Listening),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let door = args.door.resolve()?;
    let shared = PoolShared {
        metrics: Arc::new(RouterMetrics::new(&model.name)),
        expect: Arc::new(tandem_discovery::Expect::new(
            vec![model.name.clone(), model.text.name.clone()],
            args.block_size,
        )),
    };
    let discovery = discover(&args, shared.clone()).await?;
    let pool_cfg = PoolConfig {
        poll_interval: Duration::from_millis(args.poll_ms.max(10)),
        ..Default::default()
    };
    let token = match &args.kv_secret {
        Some(s) => {
            let secret = tandem_kv_transfer::Secret::new(s.as_bytes().to_vec())
                .map_err(|e| RouterError::Config(e.to_string()))?;
            let header = format!("Bearer {}", secret.rpc_token());
            Some(header.parse().map_err(|_| {
                RouterError::Config("the worker credential is not a header value".into())
            })?)
        }
        None => {
            tracing::warn!("no TANDEM_KV_SECRET: calling workers without the cluster's credential (workers with a secret will refuse)");
            None
        }
    };
    let connect = Arc::new(GrpcConnect {
        connect_timeout: pool_cfg.connect_timeout,
        token,
    });
    let pool = WorkerPool::start(
        Role::Decode,
        discovery.decode_workers(),
        pool_cfg,
        connect.clone(),
        shared.clone(),
    );
    // Static: a prefill pool only when prefill workers were named. Found workers may come later.
    let prefill_pool =
        (args.discovery != DiscoverySpec::Static || !args.prefill_workers.is_empty()).then(|| {
            WorkerPool::start(
                Role::Prefill,
                discovery.prefill_workers(),
                pool_cfg,
                connect,
                shared,
            )
        });
    let policy = policy::build(
        args.policy,
        KvAwareConfig {
            load_weight: args.kv_load_weight,
            disk_weight: args.kv_disk_weight,
            balance_abs: args.balance_abs,
            balance_rel: args.balance_rel,
        },
    );
    let dispatcher = Arc::new(Dispatcher::new(
        Arc::new(model),
        pool,
        prefill_pool,
        policy,
        DispatchConfig {
            max_queue: args.max_queue,
            disagg: DisaggConfig {
                min_tokens: args.disagg_min_tokens,
                capacity: args.prefill_capacity.max(1),
                pull_from_peers: !args.no_peer_pull,
                ..Default::default()
            },
            max_migrations: args.max_migrations,
            stall: Duration::from_millis(args.worker_stall_timeout_ms),
            flow: FlowConfig {
                per_worker: (args.max_in_flight_per_worker > 0)
                    .then_some(args.max_in_flight_per_worker),
                max_wait: (args.max_queue_wait_ms > 0)
                    .then(|| Duration::from_millis(args.max_queue_wait_ms)),
                replicas: args.router_replicas,
            },
        },
    ));
    if let Some(tenants) = &door.tenants {
        dispatcher.flow.configure(&tenants.table());
        watch_tenants(
            tenants.clone(),
            dispatcher.flow.clone(),
            dispatcher.metrics.clone(),
            door.tenants_reload,
        );
    }
    let store = openai::ResponseStore::open(&openai::StoreConfig {
        spec: args.responses_store.clone(),
        max_bytes: args.responses_store_mb.saturating_mul(1 << 20),
        ttl: Duration::from_secs(args.responses_ttl_s),
        cluster: args.cluster.clone(),
        timeout: Duration::from_millis(args.etcd_timeout_ms.max(1)),
    })
    .await
    .map_err(RouterError::Config)?;
    let responses = openai::Responses::new(store);
    let http = bind(&args.host, args.http_port).await?;
    let grpc = bind(&args.host, args.grpc_port).await?;
    let bound = Listening {
        http: http
            .local_addr()
            .map_err(|e| RouterError::Serve(e.to_string()))?,
        grpc: grpc
            .local_addr()
            .map_err(|e| RouterError::Serve(e.to_string()))?,
    };
    on_bound(bound);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let (http_tls, grpc_tls) = door.tls.clone().unzip();
    let app = routes(dispatcher.clone(), &door, responses);
    let http_task = tokio::spawn(front::serve_http(
        front::accept(http, http_tls, door.limits),
        app,
        door.limits,
        stopped(stop_rx.clone()),
    ));

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<tandem_proto::v1::generation_server::GenerationServer<grpc::GenerationService>>()
        .await;
    // Reflection in both versions: grpcurl 1.8 (still the common packaged one) speaks only
    // v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // The descriptor set also holds the workers' services: advertise only ours.
            .with_service_name("tandem.v1.Generation")
            .with_service_name("grpc.health.v1.Health")
            .with_service_name("grpc.reflection.v1.ServerReflection")
            .with_service_name("grpc.reflection.v1alpha.ServerReflection")
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| RouterError::Serve(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| RouterError::Serve(format!("reflection: {e}")))?;
    let grpc_task = tokio::spawn({
        let stop = stopped(stop_rx.clone());
        // Health and reflection stay open (probes and grpcurl's discovery); generation needs a
        // key when keys are set.
        let svc = tonic::service::interceptor::InterceptedService::new(
            tandem_proto::v1::generation_server::GenerationServer::new(
                grpc::GenerationService::new(dispatcher.clone()),
            ),
            door.api_keys
                .clone()
                .interceptor(dispatcher.metrics.clone()),
        );
        let conns = front::accept(grpc, grpc_tls, door.limits);
        let incoming =
            tokio_stream::wrappers::ReceiverStream::new(conns).map(Ok::<_, std::io::Error>);
        async move {
            tonic::transport::Server::builder()
                // A panic in any call is that call's INTERNAL status (tandem_proto::guard).
                .layer(tandem_proto::guard::CatchPanicLayer)
                // No `tcp_nodelay` here: the builder applies it only to a listener it binds;
                // `front::accept` sets it on every connection it hands over.
                .http2_max_header_list_size(
                    u32::try_from(door.limits.max_header_bytes).unwrap_or(u32::MAX),
                )
                .http2_keepalive_interval(Some(Duration::from_secs(20)))
                .http2_keepalive_timeout(Some(Duration::from_secs(20)))
                .add_service(health)
                .add_service(reflection_v1)
                .add_service(reflection_v1alpha)
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, stop)
                .await
                .map_err(|e| RouterError::Serve(format!("grpc: {e}")))
        }
    });
    let (h, g) = tokio::join!(http_task, grpc_task);
    h.map_err(|e| RouterError::Serve(e.to_string()))?;
    g.map_err(|e| RouterError::Serve(e.to_string()))??;
    Ok(())
}

/// Reads the tenants file again every `every` while the router runs: a changed file that
/// parses takes effect at once, one that does not leaves the tenants as they were.
fn watch_tenants(
    tenants: Arc<Tenants>,
    flow: Arc<Flow>,
    metrics: Arc<RouterMetrics>,
    every: Duration,
) {
    let weak = Arc::downgrade(&flow);
    drop(flow);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(flow) = weak.upgrade() else { return };
            match tenants.reload() {
                Ok(None) => {}
                Ok(Some(table)) => {
                    flow.configure(&table);
                    metrics.tenants_reload("ok");
                    tracing::info!(tenants = table.tenants.len(), "tenants file read again");
                }
                Err(e) => {
                    metrics.tenants_reload("error");
                    tracing::error!(error = %e, "tenants file not taken: the tenants stay as they were");
                }
            }
        }
    });
}

/// The discovery backend `args` choose.
async fn discover(
    args: &RouterArgs,
    shared: PoolShared,
) -> Result<Box<dyn Discovery>, RouterError> {
    let addrs = |v: &[String]| v.iter().map(|a| WorkerAddr::from(a.as_str())).collect();
    // Static and k8s discovery start from the command line's lists; etcd and a list file name
    // the workers themselves.
    let listed = matches!(args.discovery, DiscoverySpec::Static | DiscoverySpec::K8s);
    if listed && args.decode_workers.is_empty() {
        return Err(RouterError::NoWorkers);
    }
    match &args.discovery {
        DiscoverySpec::Static => Ok(Box::new(Published::fixed(
            addrs(&args.decode_workers),
            addrs(&args.prefill_workers),
        ))),
        DiscoverySpec::K8s => Ok(Box::new(
            DnsDiscovery::start(
                args.decode_workers.clone(),
                args.prefill_workers.clone(),
                Duration::from_millis(args.dns_refresh_ms),
                Arc::new(DnsResolver::new(args.dns_server).map_err(RouterError::Dns)?),
            )
            .await,
        )),
        DiscoverySpec::File { path } => Ok(Box::new(
            FileDiscovery::start(path.clone(), Duration::from_millis(args.file_refresh_ms))
                .map_err(RouterError::File)?,
        )),
        #[cfg(feature = "etcd")]
        DiscoverySpec::Etcd { endpoints } => {
            let cluster = tandem_discovery::ClusterPath::new(&args.cluster)
                .map_err(tandem_discovery::DiscoveryError::from)?;
            let found = discovery::EtcdDiscovery::start(
                endpoints.clone(),
                cluster,
                Duration::from_millis(args.etcd_timeout_ms.max(1)),
                shared,
            )
            .await?;
            Ok(Box::new(found))
        }
        #[cfg(not(feature = "etcd"))]
        spec @ DiscoverySpec::Etcd { .. } => {
            let _ = shared;
            Err(RouterError::NoEtcd(spec.clone()))
        }
    }
}

/// Reads the model's text side (tokenizer, template, context) for the router.
pub fn load_model(
    path: &std::path::Path,
    served_name: Option<String>,
) -> Result<ServedModel, tandem_model::ModelError> {
    let text = tandem_model::load_text(path)?;
    let tool_calls = text
        .chat_template
        .as_ref()
        .map(|t| t.tool_call_style())
        .unwrap_or_default();
    let reasoning = text.chat_template.as_ref().is_some_and(|t| t.thinks());
    Ok(ServedModel {
        name: served_name.unwrap_or_else(|| text.name.clone()),
        text,
        tool_calls,
        reasoning,
    })
}
