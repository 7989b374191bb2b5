//! The router's Prometheus metrics, served as `/metrics` on its HTTP port.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, &'static str)>;
type WorkerLabels = Vec<(&'static str, String)>;
type TenantLabels = Vec<(&'static str, String)>;

/// How a tenant's request fared at the router's queue.
pub const TENANT_OUTCOMES: [&str; 4] = ["admitted", "over_quota", "queue_timeout", "overloaded"];

use tandem_discovery::Role;

/// The router's counters and their registry: requests by outcome and refusal, routing (remote or
/// local prefill, migrations, requests per worker) and discovery (joins, leaves, refused workers,
/// malformed cards). One per router, shared by its pools and its dispatcher.
pub struct RouterMetrics {
    registry: Registry,
    prefill: Family<Labels, Counter>,
    crossover: Family<Labels, Counter>,
    migrations: Counter,
    handoffs: Counter,
    refused: Family<Labels, Counter>,
    requests: Family<Labels, Counter>,
    worker_requests: Family<WorkerLabels, Counter>,
    membership: Family<Labels, Counter>,
    refused_workers: Family<Labels, Counter>,
    malformed_cards: Counter,
    tenant_requests: Family<TenantLabels, Counter>,
    tenant_tokens: Family<TenantLabels, Counter>,
    tenant_wait: Family<TenantLabels, Histogram>,
    tenant_queued: Family<TenantLabels, Gauge>,
    tenant_in_flight: Family<TenantLabels, Gauge>,
    queued: Gauge,
    tenant_reloads: Family<Labels, Counter>,
    admitted: Counter,
    tokens: Family<Labels, Counter>,
    lora_requests: Family<WorkerLabels, Counter>,
    lora_placements: Counter,
}

/// How a generation request that passed the front door ended: answered to its finish, refused
/// by the router for its input, turned away (queue full, no worker), failed (no worker could
/// finish it), or cancelled (the client went away first).
pub const OUTCOMES: [&str; 5] = ["ok", "invalid", "refused", "failed", "cancelled"];

/// Why the router turned a request away before it reached a worker.
pub const REFUSALS: [&str; 8] = [
    "unauthorized",
    "queue_full",
    "over_quota",
    "queue_timeout",
    "body_too_large",
    "body_timeout",
    "body_budget",
    "no_worker",
];

impl Default for RouterMetrics {
    /// Metrics labelled with an empty model name (for tests).
    fn default() -> Self {
        Self::new("")
    }
}

impl RouterMetrics {
    /// The router's metrics for `model`: every sample labelled `model_name` and `role="router"`.
    pub fn new(model: &str) -> Self {
        let mut registry = Registry::with_labels(
            [
                ("model_name".into(), model.to_string().into()),
                ("role".into(), "router".into()),
            ]
            .into_iter(),
        );
        let prefill = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_prefill_requests",
            "Requests routed, by where their prompt is prefilled (remote: a prefill worker)",
            prefill.clone(),
        );
        let crossover = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_router_prefill_crossover",
            "Prompts long enough to prefill elsewhere with somewhere to go (a prefill worker, or a peer holding more of them), by what the measured rates said: remote_faster (a prefill worker or peer, its compute and its link to the decode worker, beats computing there), local_faster (computing there wins), unmeasured (a rate not known yet: the threshold decides)",
            crossover.clone(),
        );
        for said in ["remote_faster", "local_faster", "unmeasured"] {
            let _ = crossover.get_or_create(&vec![("estimate", said)]);
        }
        let migrations = Counter::default();
        registry.register(
            "tandem_request_migrations",
            "Streams moved to another decode worker after theirs failed mid-request (hand-overs of a draining worker included)",
            migrations.clone(),
        );
        let handoffs = Counter::default();
        registry.register(
            "tandem_request_handoffs",
            "Streams moved to another decode worker because theirs drained and handed them over (their KV pulled from it)",
            handoffs.clone(),
        );
        let refused = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_router_refused_requests",
            "Requests turned away before reaching a worker, by reason",
            refused.clone(),
        );
        for reason in REFUSALS {
            let _ = refused.get_or_create(&vec![("reason", reason)]);
        }
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_router_requests",
            "Generation requests (HTTP and gRPC) by how they ended",
            requests.clone(),
        );
        for outcome in OUTCOMES {
            let _ = requests.get_or_create(&vec![("outcome", outcome)]);
        }
        let worker_requests = Family::<WorkerLabels, Counter>::default();
        registry.register(
            "tandem_router_worker_requests",
            "Requests (and remote prefills) the router sent to each worker",
            worker_requests.clone(),
        );
        let membership = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_discovery_membership_changes",
            "Workers that joined or left this router's view of the cluster",
            membership.clone(),
        );
        let refused_workers = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_discovery_refused_workers",
            "Workers found but not used, by reason (another model or block size)",
            refused_workers.clone(),
        );
        let malformed_cards = Counter::default();
        registry.register(
            "tandem_discovery_malformed_cards",
            "Values under the cluster's etcd prefix that are not worker cards (skipped)",
            malformed_cards.clone(),
        );
        let tenant_requests = Family::<TenantLabels, Counter>::default();
        registry.register(
            "tandem_router_tenant_requests",
            "Generation requests by tenant and by how they fared at the router's queue: admitted (sent to a worker), over_quota (429), queue_timeout (503 after waiting past the limit), overloaded (503, the router full)",
            tenant_requests.clone(),
        );
        let tenant_tokens = Family::<TenantLabels, Counter>::default();
        registry.register(
            "tandem_router_tenant_tokens",
            "Tokens served by tenant: prompt (at dispatch) and completion (at the finish)",
            tenant_tokens.clone(),
        );
        let tenant_wait = Family::<TenantLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 17))
        });
        registry.register(
            "tandem_router_tenant_queue_wait_seconds",
            "Time a tenant's admitted requests waited in the router's queue",
            tenant_wait.clone(),
        );
        let tenant_queued = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "tandem_router_tenant_queued_requests",
            "A tenant's requests waiting in the router's queue now",
            tenant_queued.clone(),
        );
        let tenant_in_flight = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "tandem_router_tenant_running_requests",
            "A tenant's requests dispatched to workers and not finished",
            tenant_in_flight.clone(),
        );
        let queued = Gauge::default();
        registry.register(
            "tandem_router_queued_requests",
            "Requests waiting in the router's queue now (every tenant)",
            queued.clone(),
        );
        let admitted = Counter::default();
        registry.register(
            "tandem_router_admitted_requests",
            "Generation requests admitted past the router's queue and sent to workers (every tenant, and callers of none): the offered load a planner sizes the workers for",
            admitted.clone(),
        );
        let tokens = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_router_tokens",
            "Tokens served (every tenant, and callers of none): prompt (at dispatch) and completion (at the finish)",
            tokens.clone(),
        );
        for kind in ["prompt", "completion"] {
            let _ = tokens.get_or_create(&vec![("kind", kind)]);
        }
        let lora_requests = Family::<WorkerLabels, Counter>::default();
        registry.register(
            "tandem_router_lora_requests",
            "Generation requests admitted by the LoRA adapter they run with (lora_adapter; the base model's are not counted here)",
            lora_requests.clone(),
        );
        let lora_placements = Counter::default();
        registry.register(
            "tandem_router_lora_placements",
            "LoRA adapters the router had a decode worker load because no ready worker served a request's adapter",
            lora_placements.clone(),
        );
        let tenant_reloads = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_router_tenants_reloads",
            "Times the tenants file was read again after it changed: ok, or error (the tenants stay as they were)",
            tenant_reloads.clone(),
        );
        for outcome in ["ok", "error"] {
            let _ = tenant_reloads.get_or_create(&vec![("outcome", outcome)]);
        }
        for role in Role::ALL {
            for change in ["join", "leave"] {
                let _ = membership
                    .get_or_create(&vec![("worker_role", role.name()), ("change", change)]);
            }
            for reason in ["model", "block_size"] {
                let _ = refused_workers
                    .get_or_create(&vec![("worker_role", role.name()), ("reason", reason)]);
            }
        }
        // Both modes exist from the start, so a dashboard's rate() has a series to work on.
        for mode in ["remote", "local"] {
            let _ = prefill.get_or_create(&vec![("mode", mode)]);
        }
        Self {
            registry,
            prefill,
            crossover,
            migrations,
            handoffs,
            refused,
            requests,
            worker_requests,
            membership,
            refused_workers,
            malformed_cards,
            tenant_requests,
            tenant_tokens,
            tenant_wait,
            tenant_queued,
            tenant_in_flight,
            queued,
            tenant_reloads,
            admitted,
            tokens,
            lora_requests,
            lora_placements,
        }
    }
}

impl RouterMetrics {
    /// A request admitted with LoRA adapter `name`.
    pub fn lora_request(&self, name: &str) {
        self.lora_requests
            .get_or_create(&vec![("lora_adapter", name.to_string())])
            .inc();
    }

    /// A decode worker loaded an adapter for a request that no ready worker served.
    pub fn lora_placed(&self) {
        self.lora_placements.inc();
    }

    /// What the measured crossover said for a prompt long enough to go remote: the seconds
    /// computing it on its decode worker would take, and the best candidate's.
    pub fn prefill_estimate(&self, local_s: Option<f64>, best_remote_s: Option<f64>) {
        let said = match (local_s, best_remote_s) {
            (Some(l), Some(r)) if r < l => "remote_faster",
            (Some(_), Some(_)) => "local_faster",
            _ => "unmeasured",
        };
        self.crossover
            .get_or_create(&vec![("estimate", said)])
            .inc();
    }

    /// A request routed, its prompt prefilled on a prefill worker (`remote`) or on its decode
    /// worker.
    pub fn prefill(&self, remote: bool) {
        let mode = if remote { "remote" } else { "local" };
        self.prefill.get_or_create(&vec![("mode", mode)]).inc();
    }

    /// A stream moved to another decode worker after its worker failed, or (`handed_off`)
    /// drained and handed it over.
    pub fn migration(&self, handed_off: bool) {
        self.migrations.inc();
        if handed_off {
            self.handoffs.inc();
        }
    }

    /// A request turned away before it reached a worker; `reason` is one of `REFUSALS`
    /// (`unauthorized`, `queue_full`, `over_quota`, `queue_timeout`, `body_too_large`, `body_timeout`, `body_budget`,
    /// `no_worker`).
    pub fn refused(&self, reason: &'static str) {
        debug_assert!(REFUSALS.contains(&reason), "{reason}");
        self.refused.get_or_create(&vec![("reason", reason)]).inc();
    }

    /// A generation request ended; `outcome` is one of `OUTCOMES` (`ok`, `invalid`, `refused`,
    /// `failed`, `cancelled`).
    pub fn request(&self, outcome: &'static str) {
        debug_assert!(OUTCOMES.contains(&outcome), "{outcome}");
        self.requests
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    /// A request (or a remote prefill) sent to `worker`.
    pub fn worker_request(&self, role: Role, worker: &impl std::fmt::Display) {
        self.worker_requests
            .get_or_create(&vec![
                ("worker_role", role.name().to_string()),
                ("worker", worker.to_string()),
            ])
            .inc();
    }

    /// A worker joined (`"join"`) or left (`"leave"`) the view.
    pub fn membership(&self, role: Role, change: &'static str) {
        self.membership
            .get_or_create(&vec![("worker_role", role.name()), ("change", change)])
            .inc();
    }

    /// A worker was found but refused (`reason`: a [`tandem_discovery::Refusal`] label).
    pub fn worker_refused(&self, role: Role, reason: &'static str) {
        self.refused_workers
            .get_or_create(&vec![("worker_role", role.name()), ("reason", reason)])
            .inc();
    }

    /// A value under the cluster's prefix was not a worker card.
    pub fn malformed_card(&self) {
        self.malformed_cards.inc();
    }

    /// A tenant of the tenants file (its label): its series exist from the start, so a
    /// dashboard's rate() has something to work on.
    pub fn tenant_known(&self, tenant: &str) {
        for outcome in TENANT_OUTCOMES {
            let _ = self
                .tenant_requests
                .get_or_create(&tenant_labels(tenant, "outcome", outcome));
        }
        for kind in ["prompt", "completion"] {
            let _ = self
                .tenant_tokens
                .get_or_create(&tenant_labels(tenant, "kind", kind));
        }
        let t = vec![("tenant", tenant.to_string())];
        let _ = self.tenant_queued.get_or_create(&t);
        let _ = self.tenant_in_flight.get_or_create(&t);
        let _ = self.tenant_wait.get_or_create(&t);
    }

    /// A request of `tenant` (its label; empty: no tenants, counted only in the totals) fared
    /// `outcome`, one of `TENANT_OUTCOMES`.
    pub fn tenant_request(&self, tenant: &str, outcome: &'static str) {
        debug_assert!(TENANT_OUTCOMES.contains(&outcome), "{outcome}");
        if outcome == "admitted" {
            self.admitted.inc();
        }
        if !tenant.is_empty() {
            self.tenant_requests
                .get_or_create(&tenant_labels(tenant, "outcome", outcome))
                .inc();
        }
    }

    /// Tokens served to `tenant` (empty: counted only in the totals), of `kind` (`prompt` or
    /// `completion`).
    pub fn tenant_tokens(&self, tenant: &str, kind: &'static str, n: u64) {
        self.tokens.get_or_create(&vec![("kind", kind)]).inc_by(n);
        if !tenant.is_empty() {
            self.tenant_tokens
                .get_or_create(&tenant_labels(tenant, "kind", kind))
                .inc_by(n);
        }
    }

    /// An admitted request of `tenant` waited `waited` in the queue.
    pub fn tenant_wait(&self, tenant: &str, waited: std::time::Duration) {
        if !tenant.is_empty() {
            self.tenant_wait
                .get_or_create(&vec![("tenant", tenant.to_string())])
                .observe(waited.as_secs_f64());
        }
    }

    /// A request of `tenant` joined (`+1`) or left (`-1`) the queue.
    pub fn tenant_queued(&self, tenant: &str, delta: i64) {
        self.queued.inc_by(delta);
        if !tenant.is_empty() {
            self.tenant_queued
                .get_or_create(&vec![("tenant", tenant.to_string())])
                .inc_by(delta);
        }
    }

    /// A request of `tenant` was dispatched (`+1`) or finished (`-1`).
    pub fn tenant_in_flight(&self, tenant: &str, delta: i64) {
        if !tenant.is_empty() {
            self.tenant_in_flight
                .get_or_create(&vec![("tenant", tenant.to_string())])
                .inc_by(delta);
        }
    }

    /// The tenants file was read again: `ok` or `error`.
    pub fn tenants_reload(&self, outcome: &'static str) {
        self.tenant_reloads
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    /// Every metric in the OpenMetrics text format, as `/metrics` serves it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        out
    }
}

fn tenant_labels(tenant: &str, key: &'static str, value: &'static str) -> TenantLabels {
    vec![("tenant", tenant.to_string()), (key, value.to_string())]
}
