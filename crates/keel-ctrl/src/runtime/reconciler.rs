//! The contract between the runtime and a controller, after kube-rs'
//! `Controller`: which keys an event wakes, one look at one key, and how
//! long to wait after a failed look.

use async_trait::async_trait;
use keel_api::Millis;
use keel_store::StoreError;

use super::event::Event;
use crate::keys::{migration_of, name_of, snapshot_of, NODES_PREFIX, VMS_PREFIX};
use crate::requeue::Requeue;
use crate::{MigrationController, ReconcileError, SnapshotController, SnapshotError, VmController};

#[async_trait]
pub trait Reconciler: Send + Sync + 'static {
    /// An error with its cause in `source()`; logged as the whole chain.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Names this reconciler's keys in logs and metrics.
    fn kind(&self) -> &'static str;

    /// The keys `event` makes due now.
    fn triggers(&self, event: &Event) -> Vec<String>;

    /// One look at `key`; when to look again and why (`None`: not unless
    /// an event asks). An error means the step was not completed.
    async fn reconcile(&self, key: &str) -> Result<Option<Requeue>, Self::Error>;

    /// How long after a failed look, the `attempts`-th in a row, to try
    /// again.
    fn error_policy(&self, err: &Self::Error, attempts: u32) -> Millis;
}

/// Keyed by VM name: woken by its record, by its snapshots (one may unblock
/// a restore waiting on it), its migrations (their progress moves its
/// eviction on), its instances' domain events (exits, QMP events), and a
/// drain of its node beginning or ending.
#[async_trait]
impl Reconciler for VmController {
    type Error = ReconcileError;

    fn kind(&self) -> &'static str {
        "vm"
    }

    fn triggers(&self, event: &Event) -> Vec<String> {
        let vm = match event {
            Event::Domain(event) => Some(event.vm.as_str()),
            Event::Changed { key }
                if name_of(NODES_PREFIX, key) == Some(self.config().node.as_str()) =>
            {
                return self.woken_by_own_node_change();
            }
            Event::Changed { key } | Event::Listed { key } => name_of(VMS_PREFIX, key)
                .or_else(|| snapshot_of(key).map(|(vm, _)| vm))
                .or_else(|| migration_of(key).map(|(vm, _)| vm)),
        };
        vm.map(str::to_string).into_iter().collect()
    }

    async fn reconcile(&self, key: &str) -> Result<Option<Requeue>, ReconcileError> {
        VmController::look(self, key).await
    }

    /// Flat, not growing: a store or hypervisor outage must not push a
    /// VM's stop schedule further out than the outage itself.
    fn error_policy(&self, _err: &ReconcileError, _attempts: u32) -> Millis {
        self.config().retry_ms
    }
}

/// Keyed by the snapshot's store key.
#[async_trait]
impl Reconciler for SnapshotController {
    type Error = SnapshotError;

    fn kind(&self) -> &'static str {
        "snapshot"
    }

    fn triggers(&self, event: &Event) -> Vec<String> {
        event
            .key()
            .filter(|key| snapshot_of(key).is_some())
            .map(str::to_string)
            .into_iter()
            .collect()
    }

    async fn reconcile(&self, key: &str) -> Result<Option<Requeue>, SnapshotError> {
        let Some((vm, name)) = snapshot_of(key) else {
            return Ok(None);
        };
        SnapshotController::look(self, vm, name).await
    }

    fn error_policy(&self, _err: &SnapshotError, _attempts: u32) -> Millis {
        self.config().retry_ms
    }
}

/// Keyed by the migration's store key.
#[async_trait]
impl Reconciler for MigrationController {
    type Error = StoreError;

    fn kind(&self) -> &'static str {
        "migration"
    }

    fn triggers(&self, event: &Event) -> Vec<String> {
        event
            .key()
            .filter(|key| migration_of(key).is_some())
            .map(str::to_string)
            .into_iter()
            .collect()
    }

    async fn reconcile(&self, key: &str) -> Result<Option<Requeue>, StoreError> {
        let Some((vm, id)) = migration_of(key) else {
            return Ok(None);
        };
        MigrationController::reconcile_why(self, vm, id).await
    }

    /// Flat: a migration's windows are counted on the record, and a
    /// growing pause would spend them waiting.
    fn error_policy(&self, _err: &StoreError, _attempts: u32) -> Millis {
        self.config().retry_ms
    }
}
