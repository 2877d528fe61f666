//! Takes and deletes snapshots. A snapshot is taken live (the running
//! instance is paused for it) or offline (no instance); never while the VM
//! is between the two, when a lookup failed, or while a restore is pending.
//!
//! Only the node that owns the VM ([`VirtualMachine::owner_node`], the same
//! rule as the VM controller's) touches its disks: its disks are in that
//! node's disk dir, and any other node would snapshot (or create) disks of
//! its own. The others look again later, in case the VM moves to them.

use std::sync::Arc;

use keel_api::{Clock, Millis, Snapshot, SnapshotPhase, VirtualMachine};
use keel_hv::{HvError, Hypervisor};
use keel_store::{StoreError, TypedStore};

use crate::config::LifecycleConfig;
use crate::keys::{snapshot_key, vm_key};
use crate::requeue::Requeue;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {vm}/{snapshot}: store")]
    Store {
        vm: String,
        snapshot: String,
        #[source]
        source: StoreError,
    },
}

/// How the disks can be snapshotted right now.
enum Access {
    Live(String),
    Offline,
    /// Transitional or unknown: look again later.
    NotNow(String),
}

pub struct SnapshotController {
    store: TypedStore,
    hv: Arc<dyn Hypervisor>,
    clock: Arc<dyn Clock>,
    cfg: LifecycleConfig,
}

impl SnapshotController {
    pub fn new(
        store: TypedStore,
        hv: Arc<dyn Hypervisor>,
        clock: Arc<dyn Clock>,
        cfg: LifecycleConfig,
    ) -> Self {
        Self {
            store,
            hv,
            clock,
            cfg,
        }
    }

    pub fn config(&self) -> &crate::LifecycleConfig {
        &self.cfg
    }

    /// One look at one snapshot; returns when to look again (`None`: done).
    pub async fn reconcile(
        &self,
        vm_name: &str,
        name: &str,
    ) -> Result<Option<Millis>, SnapshotError> {
        Ok(self.look(vm_name, name).await?.map(|next| next.at))
    }

    /// [`Self::reconcile`], with why the snapshot is looked at again
    /// (named in the runtime's span of that look).
    pub async fn look(&self, vm_name: &str, name: &str) -> Result<Option<Requeue>, SnapshotError> {
        let key = snapshot_key(vm_name, name);
        let err = |source| SnapshotError::Store {
            vm: vm_name.to_string(),
            snapshot: name.to_string(),
            source,
        };
        let Some(entry) = self.store.get::<Snapshot>(&key).await.map_err(err)? else {
            return Ok(None);
        };
        let mut snap = entry.value;
        let now = self.clock.now_ms();
        let retry = now + self.cfg.retry_ms;
        let vm = self
            .store
            .get::<VirtualMachine>(&vm_key(vm_name))
            .await
            .map_err(err)?
            .map(|e| e.value);

        let mine = vm
            .as_ref()
            .is_some_and(|vm| vm.owner_node() == Some(self.cfg.node.as_str()));
        if snap.deletion_requested_at.is_some() {
            // Without a VM record its disks, and the snapshot in them, are gone.
            if vm.is_some() {
                if !mine {
                    return Ok(Some(Requeue::at(
                        retry,
                        "deleting: the VM is another node's, waiting for it",
                    )));
                }
                if let Err(e) = self
                    .hv
                    .delete_snapshot(vm_name, &snap.spec.disks, name)
                    .await
                {
                    tracing::warn!(vm = vm_name, snapshot = name, err = %crate::error_chain(&e), "delete failed");
                    return Ok(Some(Requeue::at(
                        retry,
                        "deleting: retry after a failed delete",
                    )));
                }
            }
            return match self.store.delete(&key, entry.revision).await {
                Ok(_) | Err(StoreError::Conflict { .. }) => {
                    Ok(Some(Requeue::at(now, "deleted or changed: read it again")))
                }
                Err(source) => Err(err(source)),
            };
        }
        if snap.status.phase != SnapshotPhase::Pending {
            return Ok(None);
        }
        let Some(vm) = vm else {
            snap.status.phase = SnapshotPhase::Failed;
            snap.status.message = Some(format!("VM {vm_name} not found"));
            return self
                .write(&key, &snap, entry.revision, now)
                .await
                .map_err(err);
        };
        if !mine {
            return Ok(Some(Requeue::at(
                retry,
                "pending: the VM is another node's, waiting for it",
            )));
        }
        let instance = match self.access(&vm).await {
            Access::Live(id) => Some(id),
            Access::Offline => None,
            Access::NotNow(why) => {
                let next = Requeue::at(retry, format!("pending: {why}"));
                if snap.status.message.as_deref() != Some(why.as_str()) {
                    snap.status.message = Some(why);
                    let _ = self.store.update(&key, &snap, entry.revision).await;
                }
                return Ok(Some(next));
            }
        };
        let (taken, quiesce) = match &instance {
            Some(id) => {
                // Last look said the agent is silent: skip the freeze
                // rather than spend its timeouts (twice) on every attempt.
                let agent_seen = vm
                    .status
                    .instance
                    .as_ref()
                    .and_then(|i| i.readiness.as_ref())
                    .is_none_or(|r| r.agent);
                if agent_seen {
                    quiesced_snapshot(self.hv.clone(), vm_name, &snap.spec.disks, id, name).await
                } else {
                    let taken = self
                        .hv
                        .snapshot_disks(vm_name, &snap.spec.disks, Some(id), name)
                        .await;
                    (
                        taken,
                        Quiesce {
                            quiesced: false,
                            note: Some(
                                "guest agent not answering at the last look: not quiesced".into(),
                            ),
                        },
                    )
                }
            }
            None => (
                self.hv
                    .snapshot_disks(vm_name, &snap.spec.disks, None, name)
                    .await,
                Quiesce::default(),
            ),
        };
        match taken {
            Ok(()) => {
                snap.status.phase = SnapshotPhase::Ready;
                snap.status.taken_at = Some(self.clock.now_ms());
                snap.status.live = instance.is_some();
                snap.status.quiesced = quiesce.quiesced;
                snap.status.quiesce_note = quiesce.note;
                snap.status.message = None;
            }
            Err(e @ HvError::Storage { .. }) => {
                snap.status.phase = SnapshotPhase::Failed;
                snap.status.message = Some(crate::error_chain(&e));
            }
            Err(e) => {
                // Written only when it changes: the write wakes this
                // snapshot again through the watch, and an unchanged
                // rewrite would retry at once instead of after `retry`.
                let message = crate::error_chain(&e);
                if snap.status.message.as_deref() != Some(message.as_str()) {
                    snap.status.message = Some(message);
                    let _ = self.store.update(&key, &snap, entry.revision).await;
                }
                return Ok(Some(Requeue::at(
                    retry,
                    "pending: retry after a failed snapshot",
                )));
            }
        }
        self.write(&key, &snap, entry.revision, now)
            .await
            .map_err(err)
    }

    async fn access(&self, vm: &VirtualMachine) -> Access {
        if vm.restore.is_some() || vm.deletion_requested_at.is_some() {
            return Access::NotNow(format!("VM {} is being restored or deleted", vm.name));
        }
        if vm.status.stop.is_some() {
            return Access::NotNow(format!("VM {} is stopping", vm.name));
        }
        match &vm.status.instance {
            Some(inst) => match self.hv.info(&inst.id).await {
                Ok(info) if info.state == keel_hv::DomainState::Running => {
                    Access::Live(inst.id.clone())
                }
                Ok(info) => Access::NotNow(format!("instance {} is {:?}", inst.id, info.state)),
                Err(e) => Access::NotNow(crate::error_chain(&e)),
            },
            None => match self.hv.domains_of(&vm.name).await {
                Ok(domains) if !domains.is_empty() => {
                    Access::NotNow(format!("VM {} has an instance being cleaned up", vm.name))
                }
                Ok(_) => Access::Offline,
                Err(e) => Access::NotNow(crate::error_chain(&e)),
            },
        }
    }

    async fn write(
        &self,
        key: &str,
        snap: &Snapshot,
        revision: u64,
        now: Millis,
    ) -> Result<Option<Requeue>, StoreError> {
        match self.store.update(key, snap, revision).await {
            Ok(_) => Ok(None),
            Err(StoreError::Conflict { .. }) => Ok(Some(Requeue::at(
                now,
                "the record changed meanwhile: read it again",
            ))),
            Err(e) => Err(e),
        }
    }
}

/// Whether (and how) a live snapshot was quiesced.
#[derive(Debug, Default)]
struct Quiesce {
    quiesced: bool,
    note: Option<String>,
}

/// Freeze, snapshot, thaw. In a task of its own, so that the thaw runs
/// even if the caller stops waiting; the thaw is sent whatever the freeze
/// or the snapshot did (a freeze that timed out here may still have
/// happened in the guest), and retried a few times. Every agent call is
/// bounded by the driver.
async fn quiesced_snapshot(
    hv: Arc<dyn Hypervisor>,
    vm: &str,
    disks: &[keel_api::DiskSpec],
    instance: &str,
    name: &str,
) -> (Result<(), HvError>, Quiesce) {
    let (vm, disks, instance, name) = (
        vm.to_string(),
        disks.to_vec(),
        instance.to_string(),
        name.to_string(),
    );
    let task = tokio::spawn(async move {
        let frozen = hv.fs_freeze(&instance).await;
        let taken = hv.snapshot_disks(&vm, &disks, Some(&instance), &name).await;
        let mut thaw_error = None;
        for attempt in 0..3u64 {
            match hv.fs_thaw(&instance).await {
                Ok(_) | Err(HvError::NotFound { .. }) => {
                    thaw_error = None;
                    break;
                }
                Err(e) => {
                    thaw_error = Some(crate::error_chain(&e));
                    if frozen.is_err() {
                        // Nothing was frozen by us as far as we know; one
                        // try is enough.
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200 * (attempt + 1))).await;
                }
            }
        }
        let quiesce = match (&frozen, thaw_error) {
            (Ok(_), None) => Quiesce {
                quiesced: true,
                note: None,
            },
            (Ok(_), Some(e)) => {
                tracing::error!(%vm, %instance, "thaw after snapshot failed: {e}");
                Quiesce {
                    quiesced: true,
                    note: Some(format!("thaw after the snapshot failed: {e}")),
                }
            }
            (Err(e), _) => Quiesce {
                quiesced: false,
                note: Some(format!("not quiesced: {}", crate::error_chain(e))),
            },
        };
        (taken, quiesce)
    });
    match task.await {
        Ok(done) => done,
        Err(e) => (
            Err(HvError::failed_by(
                String::new(),
                "snapshot",
                "snapshot task failed",
                e,
            )),
            Quiesce::default(),
        ),
    }
}
