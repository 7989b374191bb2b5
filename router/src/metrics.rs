//! The router's Prometheus metrics, served as `/metrics` on its HTTP port.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, &'static str)>;
type WorkerLabels = Vec<(&'static str, String)>;

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
}

/// How a generation request that passed the front door ended: answered to its finish, refused
/// by the router for its input, turned away (queue full, no worker), failed (no worker could
/// finish it), or cancelled (the client went away first).
pub const OUTCOMES: [&str; 5] = ["ok", "invalid", "refused", "failed", "cancelled"];

/// Why the router turned a request away before it reached a worker.
pub const REFUSALS: [&str; 6] = [
    "unauthorized",
    "queue_full",
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
        }
    }
}

impl RouterMetrics {
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
    /// (`unauthorized`, `queue_full`, `body_too_large`, `body_timeout`, `body_budget`,
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

    /// Every metric in the OpenMetrics text format, as `/metrics` serves it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        out
    }
}
