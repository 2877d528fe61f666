//! Prometheus metrics (`GET /metrics`, bearer token required), encoded by
//! the `prometheus-client` crate in the OpenMetrics text format, which
//! Prometheus scrapes natively.

mod tally;
pub mod vm_figures;
mod vm_records;
mod vm_series;

use std::sync::Arc;

use keel_api::{ExitKind, Migration, MigrationPhase, Phase, StopReason, VirtualMachine};
use keel_ctrl::keys::{MIGRATIONS_PREFIX, VMS_PREFIX};
use keel_ctrl::LifecycleObserver;
use keel_hv::stats_cache::StatsCache;
use keel_store::{Store, StoreError, TypedStore};
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tally::PhaseTally;
use tokio::sync::watch;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;

/// Operation durations: from a fraction of a second (a stop) to minutes
/// (a hung guest's grace period, a slow migration).
const DURATION_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0,
];

/// The process's metrics. The controllers report into it as their
/// [`LifecycleObserver`]; the store is read at scrape time for gauges.
pub struct Metrics {
    registry: Registry,
    vms: Family<Labels, Gauge>,
    migrations: Family<Labels, Gauge>,
    requests: Family<Labels, Counter>,
    reconcile_errors: Family<Labels, Counter>,
    operations: Family<Labels, Histogram>,
    unrequested_exits: Family<Labels, Counter>,
    migrations_finished: Family<Labels, Histogram>,
    undecodable: Gauge,
    forbidden_transitions: Gauge,
    /// VMs and migrations by phase, kept by watching the store (see
    /// [`Metrics::count_from`]); a scrape lists only while they are not.
    vm_phases: Arc<PhaseTally>,
    migration_phases: Arc<PhaseTally>,
    /// Where to keep the counts from, until the first scrape starts it.
    counting: std::sync::Mutex<Option<CountFrom>>,
    /// The node whose VMs' figures this process reports (the one whose
    /// hypervisor runs in it); unset: none.
    vm_source: std::sync::OnceLock<VmSource>,
    /// What the per-VM rows need of the records, kept by a watch like the
    /// phase counts.
    vm_records: Arc<vm_records::VmRecords>,
}

/// The node this process runs guests on, and its guests' figures.
struct VmSource {
    node: String,
    stats: Arc<StatsCache>,
    clock: Arc<dyn keel_api::Clock>,
}

/// The store to count from, and when to stop.
type CountFrom = (Arc<dyn Store>, watch::Receiver<bool>);

fn vm_phase(value: &[u8]) -> Option<usize> {
    let vm: VirtualMachine = serde_json::from_slice(value).ok()?;
    Some(phase_index(vm.status.phase))
}

fn migration_phase(value: &[u8]) -> Option<usize> {
    let m: Migration = serde_json::from_slice(value).ok()?;
    MIGRATION_PHASES.iter().position(|p| *p == m.status.phase)
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
        let migrations = Family::<Labels, Gauge>::default();
        registry.register(
            "migrations",
            "Migration records by phase",
            migrations.clone(),
        );
        let reconcile_errors = Family::<Labels, Counter>::default();
        registry.register(
            "reconcile_errors",
            "Reconciles that failed (store or hypervisor error) and were retried, by controller (vm, snapshot, migration)",
            reconcile_errors.clone(),
        );
        // Present at 0 from the start, so alerts on it have a series.
        for controller in ["vm", "snapshot", "migration"] {
            let _ = reconcile_errors.get_or_create(&vec![("controller", controller.to_string())]);
        }
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "api_requests",
            "HTTP requests served, by method and status code",
            requests.clone(),
        );
        let operations = Family::<Labels, Histogram>::new_with_constructor(duration_histogram);
        registry.register(
            "operation_duration_seconds",
            "How long lifecycle operations took: start (recorded to running), and stops by reason (user, restart, delete, policy, restore, evict: power button to observed gone)",
            operations.clone(),
        );
        let unrequested_exits = Family::<Labels, Counter>::default();
        registry.register(
            "unrequested_exits",
            "Instances that ended without being asked to (crashes, guest power-offs, vanished), by kind; restarts follow per run policy",
            unrequested_exits.clone(),
        );
        let migrations_finished =
            Family::<Labels, Histogram>::new_with_constructor(duration_histogram);
        registry.register(
            "migration_duration_seconds",
            "Live migrations that ended, by result, from creation to the end",
            migrations_finished.clone(),
        );
        let undecodable = Gauge::default();
        registry.register(
            "undecodable_records",
            "Stored records that could not be decoded when last read: lists skip them; each is logged and recorded as an event naming its key",
            undecodable.clone(),
        );
        let forbidden_transitions = Gauge::default();
        registry.register(
            "forbidden_transitions",
            "Writes of a VM record this process refused since it started because the phase change is forbidden (keel_api::Phase::may_become): each is a bug, logged with both phases",
            forbidden_transitions.clone(),
        );
        Self {
            counting: Default::default(),
            vm_source: Default::default(),
            vm_records: Default::default(),
            vm_phases: Arc::new(PhaseTally::new(VMS_PREFIX, PHASES.len(), vm_phase)),
            migration_phases: Arc::new(PhaseTally::new(
                MIGRATIONS_PREFIX,
                MIGRATION_PHASES.len(),
                migration_phase,
            )),
            undecodable,
            forbidden_transitions,
            registry,
            vms,
            migrations,
            requests,
            reconcile_errors,
            operations,
            unrequested_exits,
            migrations_finished,
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

    /// From the first scrape on, keeps the counts of VMs and migrations by
    /// phase current from `store`'s watch until `stop` turns true, so a
    /// scrape costs the same whatever the number of VMs. Not before: a
    /// process nobody scrapes adds no watcher to every VM write.
    pub fn count_from(&self, store: Arc<dyn Store>, stop: watch::Receiver<bool>) {
        *self.counting.lock().expect("metrics lock") = Some((store, stop));
    }

    /// Reports the figures of the VMs running on `node`, read through
    /// `stats` (the node's hypervisor, in this process): per-VM series on
    /// `/metrics` and the rows of `GET /api/v1/vm-stats`. Set once.
    pub fn report_vms_of(
        &self,
        node: &str,
        stats: Arc<StatsCache>,
        clock: Arc<dyn keel_api::Clock>,
    ) {
        let _ = self.vm_source.set(VmSource {
            node: node.to_string(),
            stats,
            clock,
        });
    }

    /// The figures of the VMs running on this process's node (none when
    /// it runs no guests).
    pub async fn vm_stats(
        &self,
        store: &TypedStore,
    ) -> Result<vm_figures::VmStatsPage, StoreError> {
        let Some(source) = self.vm_source.get() else {
            return Ok(vm_figures::VmStatsPage::default());
        };
        self.start_counting();
        let stats = source.stats.get().await;
        let records = match self.vm_records.on_node(&source.node) {
            Some(records) => records,
            None => {
                let (vms, _) = store.list::<VirtualMachine>(VMS_PREFIX).await?;
                vms.iter()
                    .filter_map(|(_, e)| vm_records::RecordFacts::of(&e.value))
                    .collect()
            }
        };
        Ok(vm_figures::VmStatsPage {
            node: Some(source.node.clone()),
            sampled_at: stats.sampled_at,
            stale_reason: stats.stale_reason.clone(),
            vms: vm_figures::rows(&records, &source.node, &stats, source.clock.now_ms()),
            agents: Vec::new(),
        })
    }

    fn start_counting(&self) {
        let Some((store, stop)) = self.counting.lock().expect("metrics lock").take() else {
            return;
        };
        tokio::spawn(self.vm_phases.clone().keep(store.clone(), stop.clone()));
        if self.vm_source.get().is_some() {
            tokio::spawn(
                self.vm_records
                    .clone()
                    .keep(store.clone(), VMS_PREFIX, stop.clone()),
            );
        }
        tokio::spawn(self.migration_phases.clone().keep(store, stop));
    }

    /// Counts the VMs in the store by phase (every phase, zeros included)
    /// and encodes all metrics, with the per-VM rows of other nodes
    /// (`remote_rows`, from their agents) beside this node's, and `extra`
    /// series of the caller's.
    pub async fn render(
        &self,
        store: &TypedStore,
        remote_rows: Vec<vm_figures::VmFigures>,
        extra: Option<Registry>,
    ) -> Result<String, StoreError> {
        self.start_counting();
        let vm_counts = match self.vm_phases.counts() {
            Some(counts) => counts,
            None => {
                let (vms, _) = store.list::<VirtualMachine>(VMS_PREFIX).await?;
                let mut counts = vec![0i64; PHASES.len()];
                for (_, entry) in &vms {
                    counts[phase_index(entry.value.status.phase)] += 1;
                }
                counts
            }
        };
        for (phase, count) in PHASES.iter().zip(vm_counts) {
            self.vms
                .get_or_create(&vec![("phase", format!("{phase:?}"))])
                .set(count);
        }
        let migration_counts = match self.migration_phases.counts() {
            Some(counts) => counts,
            None => {
                let (migrations, _) = store.list::<Migration>(MIGRATIONS_PREFIX).await?;
                MIGRATION_PHASES
                    .iter()
                    .map(|phase| {
                        migrations
                            .iter()
                            .filter(|(_, m)| m.value.status.phase == *phase)
                            .count() as i64
                    })
                    .collect()
            }
        };
        for (phase, count) in MIGRATION_PHASES.iter().zip(migration_counts) {
            self.migrations
                .get_or_create(&vec![("phase", format!("{phase:?}"))])
                .set(count);
        }
        self.undecodable
            .set(store.undecodable().current().len() as i64);
        let (refused, _) = keel_ctrl::transitions::refused_so_far();
        self.forbidden_transitions
            .set(i64::try_from(refused).unwrap_or(i64::MAX));
        let mut rows = match self.vm_source.get() {
            Some(_) => self.vm_stats(store).await?.vms,
            None => Vec::new(),
        };
        let vm_series = if rows.is_empty() && remote_rows.is_empty() {
            None
        } else {
            rows.extend(remote_rows);
            rows.sort_by(|a, b| a.vm.cmp(&b.vm));
            Some(vm_series::registry(&rows))
        };
        let mut out = String::new();
        let written = encode_registry(&mut out, &self.registry)
            .and_then(|()| vm_series.map_or(Ok(()), |r| encode_registry(&mut out, &r)))
            .and_then(|()| extra.map_or(Ok(()), |r| encode_registry(&mut out, &r)))
            .and_then(|()| encode_eof(&mut out));
        written.expect("writing to a String cannot fail");
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

const MIGRATION_PHASES: [MigrationPhase; 5] = [
    MigrationPhase::Pending,
    MigrationPhase::TargetReady,
    MigrationPhase::Running,
    MigrationPhase::Succeeded,
    MigrationPhase::Failed,
];

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

impl LifecycleObserver for Metrics {
    fn stop_finished(&self, reason: StopReason, seconds: f64) {
        let op = format!("stop_{reason:?}").to_lowercase();
        self.operations
            .get_or_create(&vec![("operation", op)])
            .observe(seconds);
    }

    fn start_finished(&self, seconds: f64) {
        self.operations
            .get_or_create(&vec![("operation", "start".to_string())])
            .observe(seconds);
    }

    fn unrequested_exit(&self, kind: ExitKind) {
        self.unrequested_exits
            .get_or_create(&vec![("kind", format!("{kind:?}"))])
            .inc();
    }

    fn migration_finished(&self, succeeded: bool, seconds: f64) {
        let result = if succeeded { "succeeded" } else { "failed" };
        self.migrations_finished
            .get_or_create(&vec![("result", result.to_string())])
            .observe(seconds);
    }

    fn reconcile_failed(&self, controller: &'static str) {
        self.reconcile_errors
            .get_or_create(&vec![("controller", controller.to_string())])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn renders_phases_and_requests() {
        let store = TypedStore::new(Arc::new(keel_store::memory::MemoryStore::new()));
        let m = Metrics::new();
        m.observe_request("GET", 200);
        m.observe_request("BREW", 418);
        let text = m.render(&store, Vec::new(), None).await.unwrap();
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

    #[tokio::test]
    async fn renders_what_the_controllers_report() {
        let store = TypedStore::new(Arc::new(keel_store::memory::MemoryStore::new()));
        let m = Metrics::new();
        m.stop_finished(StopReason::Restart, 0.04);
        m.start_finished(2.5);
        m.unrequested_exit(ExitKind::Crashed);
        m.migration_finished(true, 0.7);
        m.reconcile_failed("vm");
        let text = m.render(&store, Vec::new(), None).await.unwrap();
        for needle in [
            "keel_operation_duration_seconds_count{operation=\"stop_restart\"} 1",
            "keel_operation_duration_seconds_count{operation=\"start\"} 1",
            "keel_unrequested_exits_total{kind=\"Crashed\"} 1",
            "keel_migration_duration_seconds_count{result=\"succeeded\"} 1",
            "keel_reconcile_errors_total{controller=\"vm\"} 1",
            "keel_migrations{phase=\"Running\"} 0",
        ] {
            assert!(text.contains(needle), "{needle} missing in:\n{text}");
        }
    }

    #[tokio::test]
    async fn counts_undecodable_records() {
        use keel_store::Precondition;
        let store = TypedStore::new(Arc::new(keel_store::memory::MemoryStore::new()));
        let m = Metrics::new();
        let text = m.render(&store, Vec::new(), None).await.unwrap();
        assert!(text.contains("keel_undecodable_records 0"), "{text}");
        assert!(text.contains("keel_forbidden_transitions 0"), "{text}");
        store
            .raw()
            .put("/vms/broken", b"[]".to_vec(), Precondition::Absent)
            .await
            .unwrap();
        let text = m
            .render(&store, Vec::new(), None)
            .await
            .expect("a bad record fails no scrape");
        assert!(text.contains("keel_undecodable_records 1"), "{text}");
    }
}
