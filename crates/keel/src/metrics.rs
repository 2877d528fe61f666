//! Prometheus metrics (`GET /metrics`, bearer token required), encoded by
//! the `prometheus-client` crate in the OpenMetrics text format, which
//! Prometheus scrapes natively.

use std::sync::LazyLock;

use keel_api::{Phase, VirtualMachine};
use keel_ctrl::keys::VMS_PREFIX;
use keel_store::{StoreError, TypedStore};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;

/// Reconcile errors of this process, by controller. Process-wide because
/// the controllers report them only through `tracing` (see
/// [`ReconcileErrorLayer`]).
static RECONCILE_ERRORS: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);

pub struct Metrics {
    registry: Registry,
    vms: Family<Labels, Gauge>,
    requests: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("keel");
        let vms = Family::<Labels, Gauge>::default();
        registry.register("vms", "VMs by lifecycle phase", vms.clone());
        registry.register(
            "reconcile_errors",
            "Reconciles that failed (store or hypervisor error) and were retried, by controller (vm, snapshot, migration)",
            RECONCILE_ERRORS.clone(),
        );
        // Present at 0 from the start, so alerts on it have a series.
        for controller in ["vm", "snapshot", "migration"] {
            let _ = RECONCILE_ERRORS.get_or_create(&vec![("controller", controller.to_string())]);
        }
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "api_requests",
            "HTTP requests served, by method and status code",
            requests.clone(),
        );
        Self {
            registry,
            vms,
            requests,
        }
    }

    pub fn observe_request(&self, method: &str, status: u16) {
        // Methods outside the standard set are folded so labels stay bounded.
        let method = match method {
            "GET" | "HEAD" | "POST" | "PUT" | "DELETE" | "PATCH" | "OPTIONS" => method,
            _ => "OTHER",
        };
        self.requests
            .get_or_create(&vec![
                ("method", method.to_string()),
                ("status", status.to_string()),
            ])
            .inc();
    }

    /// Counts the VMs in the store by phase (every phase, zeros included)
    /// and encodes all metrics.
    pub async fn render(&self, store: &TypedStore) -> Result<String, StoreError> {
        let (vms, _) = store.list::<VirtualMachine>(VMS_PREFIX).await?;
        let mut counts = [0i64; PHASES.len()];
        for (_, entry) in &vms {
            counts[phase_index(entry.value.status.phase)] += 1;
        }
        for (phase, count) in PHASES.iter().zip(counts) {
            self.vms
                .get_or_create(&vec![("phase", format!("{phase:?}"))])
                .set(count);
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        Ok(out)
    }
}

const PHASES: [Phase; 7] = [
    Phase::Pending,
    Phase::Starting,
    Phase::Running,
    Phase::Stopping,
    Phase::Stopped,
    Phase::BackOff,
    Phase::Deleting,
];

/// Exhaustive, so a new phase fails to compile until it is listed above.
fn phase_index(phase: Phase) -> usize {
    match phase {
        Phase::Pending => 0,
        Phase::Starting => 1,
        Phase::Running => 2,
        Phase::Stopping => 3,
        Phase::Stopped => 4,
        Phase::BackOff => 5,
        Phase::Deleting => 6,
    }
}

/// Counts the controller runtime's `reconcile failed` warnings (`vm`) and
/// `<controller> reconcile failed` ones. keel-ctrl exposes no hook for
/// this, so the count is taken from its log events; installed by
/// `keel serve` next to the log formatter.
pub struct ReconcileErrorLayer;

impl<S: Subscriber> Layer<S> for ReconcileErrorLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() != Level::WARN || !meta.target().starts_with("keel_ctrl") {
            return;
        }
        let mut message = Message(None);
        event.record(&mut message);
        let Some(prefix) = message
            .0
            .as_deref()
            .and_then(|m| m.strip_suffix("reconcile failed"))
        else {
            return;
        };
        let controller = match prefix.trim() {
            "" => "vm",
            "snapshot" => "snapshot",
            "migration" => "migration",
            _ => "other",
        };
        RECONCILE_ERRORS
            .get_or_create(&vec![("controller", controller.to_string())])
            .inc();
    }
}

struct Message(Option<String>);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = Some(value.to_string());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tracing_subscriber::layer::SubscriberExt;

    #[tokio::test]
    async fn renders_phases_and_requests() {
        let store = TypedStore::new(Arc::new(keel_store::memory::MemoryStore::new()));
        let m = Metrics::new();
        m.observe_request("GET", 200);
        m.observe_request("BREW", 418);
        let text = m.render(&store).await.unwrap();
        assert!(text.contains("keel_vms{phase=\"Running\"} 0"), "{text}");
        assert!(
            text.contains("keel_api_requests_total{method=\"GET\",status=\"200\"} 1"),
            "{text}"
        );
        assert!(text.contains("method=\"OTHER\""), "{text}");
        assert!(
            text.contains("# TYPE keel_reconcile_errors counter"),
            "{text}"
        );
    }

    #[test]
    fn counts_reconcile_failures_from_logs() {
        let count = |c: &str| {
            RECONCILE_ERRORS
                .get_or_create(&vec![("controller", c.to_string())])
                .get()
        };
        let subscriber = tracing_subscriber::registry().with(ReconcileErrorLayer);
        let (vm, snap) = (count("vm"), count("snapshot"));
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "keel_ctrl::runtime", err = "boom", "reconcile failed");
            tracing::warn!(target: "keel_ctrl::runtime", err = "boom", "snapshot reconcile failed");
            tracing::warn!(target: "keel_ctrl::runtime", "something else");
            tracing::warn!(target: "other", "reconcile failed");
            tracing::info!(target: "keel_ctrl::runtime", "reconcile failed");
        });
        assert_eq!((count("vm"), count("snapshot")), (vm + 1, snap + 1));
    }
}
