//! The router's Prometheus metrics, served as `/metrics` on its HTTP port.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, &'static str)>;

pub struct RouterMetrics {
    registry: Registry,
    prefill: Family<Labels, Counter>,
    migrations: Counter,
    refused: Family<Labels, Counter>,
    requests: Family<Labels, Counter>,
}

/// How a generation request that passed the front door ended: answered to its finish, refused
/// by the router for its input, turned away (queue full, no worker), failed (no worker could
/// finish it), or cancelled (the client went away first).
pub const OUTCOMES: [&str; 5] = ["ok", "invalid", "refused", "failed", "cancelled"];

/// Why the router turned a request away before it reached a worker.
pub const REFUSALS: [&str; 5] = [
    "unauthorized",
    "queue_full",
    "body_too_large",
    "body_timeout",
    "no_worker",
];

impl Default for RouterMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let prefill = Family::<Labels, Counter>::default();
        registry.register(
            "tandem_prefill_requests",
            "Requests routed, by where their prompt is prefilled (remote: a prefill worker)",
            prefill.clone(),
        );
        let migrations = Counter::default();
        registry.register(
            "tandem_request_migrations",
            "Streams moved to another decode worker after theirs failed mid-request",
            migrations.clone(),
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
        // Both modes exist from the start, so a dashboard's rate() has a series to work on.
        for mode in ["remote", "local"] {
            let _ = prefill.get_or_create(&vec![("mode", mode)]);
        }
        Self {
            registry,
            prefill,
            migrations,
            refused,
            requests,
        }
    }
}

impl RouterMetrics {
    pub fn prefill(&self, remote: bool) {
        let mode = if remote { "remote" } else { "local" };
        self.prefill.get_or_create(&vec![("mode", mode)]).inc();
    }

    pub fn migration(&self) {
        self.migrations.inc();
    }

    /// `reason` is one of [`REFUSALS`].
    pub fn refused(&self, reason: &'static str) {
        debug_assert!(REFUSALS.contains(&reason), "{reason}");
        self.refused.get_or_create(&vec![("reason", reason)]).inc();
    }

    /// `outcome` is one of [`OUTCOMES`].
    pub fn request(&self, outcome: &'static str) {
        debug_assert!(OUTCOMES.contains(&outcome), "{outcome}");
        self.requests
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        out
    }
}
