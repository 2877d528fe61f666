//! Applies [`decide`]'s steps: the only place the VM lifecycle does I/O.

use std::sync::Arc;

use keel_api::{Clock, Event, Millis, Phase, Snapshot, StopReason, VirtualMachine};
use keel_hv::{DomainSpec, HvError, Hypervisor};
use keel_store::{StoreError, TypedStore};

use crate::keys::{event_key, snapshot_key, snapshots_of_prefix, vm_key};
use crate::vm_decide::{decide, HvAction, LifecycleConfig, Observed, RestoreSource, Step};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("VM {vm}: store: {source}")]
    Store {
        vm: String,
        #[source]
        source: StoreError,
    },
    #[error("VM {vm}: hypervisor: {source}")]
    Hypervisor {
        vm: String,
        #[source]
        source: HvError,
    },
}

pub struct VmController {
    store: TypedStore,
    hv: Arc<dyn Hypervisor>,
    clock: Arc<dyn Clock>,
    cfg: LifecycleConfig,
}

impl VmController {
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

    pub fn config(&self) -> &LifecycleConfig {
        &self.cfg
    }

    pub fn store(&self) -> &TypedStore {
        &self.store
    }

    /// A snapshot controller working on the same store, node and clock.
    pub fn snapshot_controller(&self) -> crate::SnapshotController {
        crate::SnapshotController::new(
            self.store.clone(),
            self.hv.clone(),
            self.clock.clone(),
            self.cfg.clone(),
        )
    }

    /// One look at one VM. Returns when to look again (`None`: the record
    /// is gone). An error means the step was not completed; retry later.
    pub async fn reconcile(&self, name: &str) -> Result<Option<Millis>, ReconcileError> {
        let key = vm_key(name);
        let store_err = |source| ReconcileError::Store {
            vm: name.to_string(),
            source,
        };
        let Some(entry) = self
            .store
            .get::<VirtualMachine>(&key)
            .await
            .map_err(store_err)?
        else {
            return Ok(None);
        };
        let vm = entry.value;
        let observed = self.observe(&vm).await;
        let now = self.clock.now_ms();
        match decide(&vm, &observed, now, &self.cfg) {
            Step::Wait { requeue_at } => Ok(Some(requeue_at)),
            Step::Persist {
                vm: next,
                then,
                requeue_at,
            } => {
                let Some(revision) = self.write(&key, &next, entry.revision).await? else {
                    return Ok(Some(now));
                };
                self.record_event(&vm, &next, revision, now).await;
                if let Some(action) = then {
                    if let Err(err) = self.act(&next, &action).await {
                        tracing::warn!(vm = name, ?action, %err, "hypervisor call failed");
                        let mut noted = (*next).clone();
                        noted.status.message = Some(err.to_string());
                        // Best effort: a conflict means someone else wrote newer state.
                        let _ = self.write(&key, &noted, revision).await;
                        return Err(ReconcileError::Hypervisor {
                            vm: name.to_string(),
                            source: err,
                        });
                    }
                }
                Ok(Some(requeue_at))
            }
            Step::ActThenPersist {
                action,
                vm: next,
                requeue_at,
            } => {
                self.act(&next, &action)
                    .await
                    .map_err(|source| ReconcileError::Hypervisor {
                        vm: name.to_string(),
                        source,
                    })?;
                match self.write(&key, &next, entry.revision).await? {
                    Some(revision) => {
                        self.record_event(&vm, &next, revision, now).await;
                        Ok(Some(requeue_at))
                    }
                    None => Ok(Some(now)),
                }
            }
            Step::DeleteRecord => {
                self.act(&vm, &HvAction::DeleteDisks)
                    .await
                    .map_err(|source| ReconcileError::Hypervisor {
                        vm: name.to_string(),
                        source,
                    })?;
                // The snapshots lived in the disks just removed.
                let (snapshots, _) = self
                    .store
                    .list::<Snapshot>(&snapshots_of_prefix(name))
                    .await
                    .map_err(store_err)?;
                for (key, snap) in snapshots {
                    match self.store.delete(&key, snap.revision).await {
                        Ok(_) | Err(StoreError::Conflict { .. }) => {}
                        Err(source) => return Err(store_err(source)),
                    }
                }
                match self.store.delete(&key, entry.revision).await {
                    Ok(revision) => {
                        tracing::info!(vm = name, "deleted");
                        let event = Event {
                            at: now,
                            vm: name.to_string(),
                            from: vm.status.phase,
                            to: Phase::Deleting,
                            reason: "record deleted: instance gone, disks removed".into(),
                        };
                        self.put_event(&event, revision).await;
                        Ok(None)
                    }
                    Err(StoreError::Conflict { .. }) => Ok(Some(now)),
                    Err(source) => Err(store_err(source)),
                }
            }
        }
    }

    /// Keeps an operator-readable trail of phase changes. Best effort: the
    /// VM record is the truth, an event lost to a store hiccup is only logged.
    async fn record_event(
        &self,
        old: &VirtualMachine,
        new: &VirtualMachine,
        revision: u64,
        now: Millis,
    ) {
        if old.status.phase == new.status.phase {
            return;
        }
        let event = Event {
            at: now,
            vm: new.name.clone(),
            from: old.status.phase,
            to: new.status.phase,
            reason: change_reason(new),
        };
        tracing::info!(vm = %new.name, from = ?event.from, to = ?event.to, reason = %event.reason, "phase change");
        self.put_event(&event, revision).await;
    }

    async fn put_event(&self, event: &Event, revision: u64) {
        let key = event_key(&event.vm, revision);
        if let Err(err) = self.store.create(&key, event).await {
            tracing::warn!(vm = %event.vm, %err, "could not record event");
        }
    }

    /// What the node says. A failed lookup is `Unknown`, never "absent".
    async fn observe(&self, vm: &VirtualMachine) -> Observed {
        match &vm.status.instance {
            Some(inst) => match self.hv.info(&inst.id).await {
                Ok(info) => Observed::Instance(info.state),
                Err(HvError::NotFound { .. }) => Observed::InstanceAbsent,
                Err(err) => Observed::Unknown(err.to_string()),
            },
            None => {
                let domains = match self.hv.list().await {
                    Ok(all) => all.into_iter().filter(|d| d.vm == vm.name).collect(),
                    Err(err) => return Observed::Unknown(err.to_string()),
                };
                let restore_source = match &vm.restore {
                    None => RestoreSource::NotNeeded,
                    Some(r) => match self
                        .store
                        .get::<Snapshot>(&snapshot_key(&vm.name, &r.snapshot))
                        .await
                    {
                        Ok(Some(snap)) => RestoreSource::Found(Box::new(snap.value)),
                        Ok(None) => RestoreSource::Missing,
                        Err(err) => return Observed::Unknown(err.to_string()),
                    },
                };
                Observed::NoInstance {
                    domains,
                    restore_source,
                }
            }
        }
    }

    /// NotFound from shutdown, kill or cleanup means the domain is absent,
    /// which is what those calls want: success. The next lookup sees it too.
    async fn act(&self, vm: &VirtualMachine, action: &HvAction) -> Result<(), HvError> {
        let absent_is_ok = |r: Result<(), HvError>| match r {
            Err(HvError::NotFound { .. }) => Ok(()),
            other => other,
        };
        match action {
            HvAction::Start => {
                let inst = vm
                    .status
                    .instance
                    .as_ref()
                    .expect("decide records the instance before starting it");
                self.hv
                    .start(&DomainSpec {
                        vm: vm.name.clone(),
                        instance: inst.id.clone(),
                        cpus: vm.spec.cpus,
                        memory_mib: vm.spec.memory_mib,
                        disks: vm.spec.disks.clone(),
                        boot: vm.spec.boot.clone(),
                    })
                    .await
            }
            HvAction::Shutdown(id) => absent_is_ok(self.hv.shutdown(id).await),
            HvAction::Kill(id) => absent_is_ok(self.hv.kill(id).await),
            HvAction::Cleanup(id) => absent_is_ok(self.hv.cleanup(id).await),
            HvAction::DeleteDisks => self.hv.delete_disks(&vm.name).await,
            HvAction::RestoreDisks(snapshot) => {
                self.hv
                    .restore_disks(&vm.name, &vm.spec.disks, snapshot)
                    .await
            }
        }
    }

    /// Compare-and-swap write. `Ok(None)` on conflict: someone wrote first,
    /// so the step is void and the VM must be looked at again.
    async fn write(
        &self,
        key: &str,
        vm: &VirtualMachine,
        revision: u64,
    ) -> Result<Option<u64>, ReconcileError> {
        match self.store.update(key, vm, revision).await {
            Ok(rev) => Ok(Some(rev)),
            Err(StoreError::Conflict { .. }) => Ok(None),
            Err(source) => Err(ReconcileError::Store {
                vm: vm.name.clone(),
                source,
            }),
        }
    }
}

fn change_reason(vm: &VirtualMachine) -> String {
    let status = &vm.status;
    if let Some(stop) = &status.stop {
        return match stop.reason {
            StopReason::User => "stop requested by user".into(),
            StopReason::Restart => "restart requested".into(),
            StopReason::Delete => "delete requested".into(),
            StopReason::Policy => "run policy AlwaysOff".into(),
            StopReason::Restore => "restore from snapshot".into(),
            StopReason::Evict => "evicted from node".into(),
        };
    }
    if let (None, Some(exit)) = (&status.instance, &status.last_exit) {
        return format!(
            "instance {} exited ({:?}{})",
            exit.instance,
            exit.kind,
            if exit.requested { ", requested" } else { "" }
        );
    }
    if let Some(inst) = &status.instance {
        return format!("instance {} on node {}", inst.id, inst.node);
    }
    status
        .message
        .clone()
        .unwrap_or_else(|| "reconciled".into())
}
