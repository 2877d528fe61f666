//! Applies [`decide`]'s steps: the only place the VM lifecycle does I/O.
//! The node's other duties live beside it: `node_agent` (heartbeat,
//! freeze, drain completion, self-fence), `placement` (cluster view, room
//! check) and `garbage` (stray domains, finished migrations).

mod garbage;
mod node_agent;
mod placement;

use crate::config::LifecycleConfig;
use crate::error_chain::error_chain;
use crate::events::phase_event;
use crate::fence::Fence;
use crate::keys::{migration_key, migrations_of_prefix, snapshot_key, snapshots_of_prefix, vm_key};
use crate::node_lease::liveness::{ClockReading, Liveness};
use crate::node_lease::NodeLease;
use crate::observe::{report_transition, LifecycleObserver, NoObserver};
use crate::recorded_write::{write_with_events, RecordChange};
use crate::requeue::Requeue;
use crate::step::{HvAction, Step};
use crate::transitions;
use crate::view::{Observed, RestoreSource};
use crate::vm_decide::decide;
use crate::vm_index::{ClusterReflector, VmIndex};
use crate::vm_next_look::why_next_look;
use keel_api::{
    Clock, Event, Migration, MigrationPhase, Millis, Node, Phase, Snapshot, VirtualMachine,
};
use keel_hv::{DiskDetach, HvError, Hypervisor};
use keel_store::{StoreError, TypedEntry, TypedStore};
use std::sync::Arc;

/// Why a VM whose record changed under its look (a compare-and-swap
/// refused) is looked at again at once.
const WRITE_CONFLICT: &str = "the record changed meanwhile: read it again";

pub use crate::error::{ActError, HeartbeatError, ReconcileError};

pub struct VmController {
    store: TypedStore,
    hv: Arc<dyn Hypervisor>,
    clock: Arc<dyn Clock>,
    cfg: LifecycleConfig,
    observer: Arc<dyn LifecycleObserver>,
    /// Other nodes' heartbeats as this agent has seen them, on its clock.
    liveness: std::sync::Mutex<Liveness>,
    /// This node's own lease and freeze, as this agent counts them.
    lease: Arc<NodeLease>,
    /// This node's record as last written here: the heartbeat writes on it.
    own_record: crate::node_lease::own_record::OwnRecord,
    /// Readiness probes of this node's guests.
    probes: crate::readiness::GuestProbes,
    /// Every VM record, kept current by the runtime's watch; read where a
    /// decision looks at the whole cluster (drains, migrations).
    vm_index: Arc<ClusterReflector>,
    /// Which change of this node's record wakes its VMs (a drain's).
    drain_wake: crate::drain_wake::DrainWake,
    /// What the runtime lists and watches for this node: the node's view
    /// of a store with per-node copies of the VM records, or (`None`) the
    /// store itself.
    watched: Option<Arc<dyn keel_store::Store>>,
    /// Every VM record, listed for the looks about the whole cluster when
    /// the index holds only this node's.
    whole: crate::own_records::WholeView,
}

impl VmController {
    pub fn new(
        store: TypedStore,
        hv: Arc<dyn Hypervisor>,
        clock: Arc<dyn Clock>,
        cfg: LifecycleConfig,
    ) -> Self {
        let mut probes = crate::readiness::GuestProbes::new(hv.clone(), clock.clone());
        probes.interval_ms = cfg.readiness_probe_ms;
        probes.ready_interval_ms = cfg.readiness_refresh_ms;
        // Only its own VMs' changes wake this node (the per-node view).
        let vm_index = Arc::new(ClusterReflector::judging(
            crate::node_concern::NodeConcern::of_node(&cfg.node),
        ));
        Self {
            store,
            hv,
            clock,
            cfg,
            observer: Arc::new(NoObserver),
            liveness: Default::default(),
            lease: Default::default(),
            own_record: Default::default(),
            probes,
            vm_index,
            drain_wake: Default::default(),
            watched: None,
            whole: Default::default(),
        }
    }

    /// This node's runtime lists and watches `view`, a store in which the
    /// VM records prefix holds only the records that concern this node
    /// (`keel_store::node_shards::ShardedStore::node_view`): no other
    /// node's change reaches it. A record not held is read from the store;
    /// a look about the whole cluster lists it. Set before the reflector
    /// is handed to a runtime: it starts a new one.
    pub fn watching_own_records(mut self, view: Arc<dyn keel_store::Store>) -> Self {
        self.vm_index = Arc::new(
            ClusterReflector::judging(crate::node_concern::NodeConcern::of_node(&self.cfg.node))
                .fed_own_records_only(),
        );
        self.watched = Some(view);
        self
    }

    /// The store this node's runtime lists and watches.
    pub fn watched_store(&self) -> Arc<dyn keel_store::Store> {
        self.watched
            .clone()
            .unwrap_or_else(|| self.store.raw().clone())
    }

    /// This node decodes VM records with `decoder`, shared with the other
    /// readers of its store in this process ([`crate::vm_decodes`]), each
    /// as it comes.
    /// Set before the reflector is handed to a runtime: it starts a new
    /// one.
    pub fn decoding_with(mut self, decoder: crate::vm_decodes::VmDecoder) -> Self {
        self.vm_index = Arc::new(
            ClusterReflector::judging(crate::node_concern::NodeConcern::of_node(&self.cfg.node))
                .decoding_with(decoder),
        );
        self
    }

    /// The VMs a change of this node's record (just taken into the
    /// index) wakes: all it owns when its drain began or ended, else none.
    pub fn woken_by_own_node_change(&self) -> Vec<String> {
        self.drain_wake.woken(&self.vm_index, &self.cfg.node)
    }

    /// The index of every VM this controller reads; whoever watches the
    /// VM records for it (the runtime) keeps it current.
    pub fn reflector(&self) -> &Arc<ClusterReflector> {
        &self.vm_index
    }

    /// This node's lease as this agent counts it.
    pub fn lease(&self) -> &Arc<NodeLease> {
        &self.lease
    }

    /// `nodes` (and the VMs read after them) taken into this agent's
    /// liveness view at `now`; the view.
    fn observe_nodes(&self, nodes: &[Node], vms: &VmIndex, now: ClockReading) -> Liveness {
        let mut liveness = self.liveness.lock().expect("liveness lock");
        liveness.observe_with(nodes, |node| vms.newest_instance_on(node), now);
        liveness.clone()
    }

    pub fn config(&self) -> &LifecycleConfig {
        &self.cfg
    }

    pub fn store(&self) -> &TypedStore {
        &self.store
    }

    /// Domain events (exits, QMP events) from this node's hypervisor, if
    /// it gives them.
    pub fn domain_events(&self) -> Option<tokio::sync::broadcast::Receiver<keel_hv::DomainEvent>> {
        self.hv.domain_events()
    }

    /// Reports lifecycle transitions (and, through the runtime, failed
    /// reconciles) to `observer`, e.g. for metrics.
    pub fn with_observer(mut self, observer: Arc<dyn LifecycleObserver>) -> Self {
        self.observer = observer;
        self
    }

    pub fn observer(&self) -> &Arc<dyn LifecycleObserver> {
        &self.observer
    }

    /// A migration controller working on the same store, node and clock.
    pub fn migration_controller(&self) -> crate::MigrationController {
        crate::MigrationController::new(
            self.store.clone(),
            self.hv.clone(),
            self.clock.clone(),
            self.cfg.clone(),
        )
        .with_observer(self.observer.clone())
        .with_lease(self.lease.clone())
        .with_index(self.vm_index.clone())
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
        Ok(self.look(name).await?.map(|next| next.at))
    }

    /// [`Self::reconcile`], with why the VM is looked at again (named in
    /// the runtime's span of that look).
    pub async fn look(&self, name: &str) -> Result<Option<Requeue>, ReconcileError> {
        let key = vm_key(name);
        let store_err = |source| ReconcileError::Store {
            vm: name.to_string(),
            source,
        };
        let Some(entry) = self.record(&key, name).await.map_err(store_err)? else {
            return Ok(None);
        };
        let vm = entry.value;
        keel_hv::start_marks::mark(name, "reconcile_begun");
        match vm.owner_node() {
            // Another node's agent looks after it; a change wakes us again.
            Some(node) if node != self.cfg.node => return Ok(None),
            // The cluster controller places it; a change wakes us again.
            None => return Ok(None),
            Some(_) => {}
        }
        let cluster = self.cluster_view(&vm).await.map_err(store_err)?;
        let (observed, resets) = self.observe(&vm).await;
        let now = self.clock.now_ms();
        let step = decide(&vm, &observed, &cluster, now, &self.cfg);
        let step = crate::reboot::note_resets(&vm, &observed, resets, step, now);
        let step = self.with_readiness(&vm, &observed, step, now).await;
        let step = crate::reboot::reboot_step(&vm, &observed, step, now);
        let step = crate::online_resize::grow_step(&vm, &observed, step, now);
        let step = crate::hotplug::plug_step(&vm, &observed, step, now);
        let step = crate::hot_unplug::unplug_step(&vm, &observed, step, now);
        if let Step::Persist { vm: next, .. } | Step::ActThenPersist { vm: next, .. } = &step {
            // Before anything is done for it: an action must not run for
            // a record that will be refused.
            transitions::check(&vm, next)?;
        }
        match step {
            Step::Wait { requeue_at } => Ok(Some(Requeue::at(
                requeue_at,
                why_next_look(&vm, requeue_at, now, &self.cfg),
            ))),
            Step::Persist {
                then: Some(HvAction::Start),
                ..
            } if !self.lease.fresh(self.clock.mono(), &self.cfg) => {
                // No heartbeat got through within the lease: the cluster
                // may be about to start this node's VMs elsewhere.
                tracing::warn!(vm = name, node = %self.cfg.node,
                    "not starting: this node's lease is stale (no heartbeat got through within it)");
                Ok(Some(Requeue::at(
                    now + self.cfg.retry_ms,
                    "not starting: this node's lease is stale",
                )))
            }
            Step::Persist {
                vm: next,
                then,
                requeue_at,
            } => {
                let Some(revision) = self
                    .write_recorded(&key, &vm, &next, entry.revision, now)
                    .await?
                else {
                    return Ok(Some(Requeue::at(now, WRITE_CONFLICT)));
                };
                if then == Some(HvAction::Start) {
                    keel_hv::start_marks::mark(name, "instance_recorded");
                }
                if vm.ready_since().is_none() && next.ready_since().is_some() {
                    keel_hv::start_marks::mark(name, "ready_written");
                }
                if let Some(action) = then {
                    if let Err(err) = self.act(&next, &action).await {
                        let why = error_chain(&err);
                        tracing::warn!(vm = name, ?action, err = %why, "action failed");
                        let mut noted = (*next).clone();
                        noted.status.message = Some(why.clone());
                        if action == HvAction::Start {
                            if let Some(inst) = noted.status.instance.as_mut() {
                                inst.start_error = Some(why);
                            }
                        }
                        // Best effort: a conflict means someone else wrote newer state.
                        let _ = self.write(&key, &noted, revision).await;
                        return Err(err.for_vm(name));
                    }
                }
                Ok(Some(Requeue::at(
                    requeue_at,
                    why_next_look(&next, requeue_at, now, &self.cfg),
                )))
            }
            Step::ActThenPersist {
                action,
                vm: next,
                requeue_at,
            } => {
                let acted = match &action {
                    HvAction::DetachDisk { instance, disk } => {
                        self.detach_disk(&vm.name, instance, disk).await
                    }
                    _ => self.act(&next, &action).await.map(|()| true),
                };
                if let Ok(false) = acted {
                    // Not done yet (the guest holds on to the disk): nothing
                    // to store, the record already says what it waits for.
                    // An unplug under way keeps the fast look (besides the
                    // DEVICE_DELETED event): a guest may never answer.
                    return Ok(Some(Requeue::at(
                        now + self.cfg.poll_ms,
                        "disk unplug under way",
                    )));
                }
                if let Err(err) = acted {
                    // The step is retried; its reason is on the record
                    // meanwhile (a restore whose disks cannot be put back
                    // says why), written once, not at every retry.
                    let why = error_chain(&err);
                    if vm.status.message.as_deref() != Some(why.as_str()) {
                        let mut noted = vm.clone();
                        noted.status.message = Some(why);
                        let _ = self.write(&key, &noted, entry.revision).await;
                    }
                    return Err(err.for_vm(name));
                }
                match self
                    .write_recorded(&key, &vm, &next, entry.revision, now)
                    .await?
                {
                    Some(_) => Ok(Some(Requeue::at(
                        requeue_at,
                        why_next_look(&next, requeue_at, now, &self.cfg),
                    ))),
                    None => Ok(Some(Requeue::at(now, WRITE_CONFLICT))),
                }
            }
            Step::DeleteRecord => {
                self.act(&vm, &HvAction::DeleteDisks)
                    .await
                    .map_err(|err| err.for_vm(name))?;
                // Its migrations go with it: a VM created later under the
                // same name must not find them.
                let (migrations, _) = self
                    .store
                    .list::<Migration>(&migrations_of_prefix(name))
                    .await
                    .map_err(store_err)?;
                for (key, m) in migrations {
                    match self.store.delete(&key, m.revision).await {
                        Ok(_) | Err(StoreError::Conflict { .. }) => {}
                        Err(source) => return Err(store_err(source)),
                    }
                }
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
                let event = Event {
                    at: now,
                    vm: name.to_string(),
                    from: vm.status.phase,
                    to: Phase::Deleting,
                    reason: "record deleted: instance gone, disks removed".into(),
                    key: None,
                };
                let deleted = write_with_events(
                    &self.store,
                    &key,
                    RecordChange::<VirtualMachine>::Delete,
                    entry.revision,
                    &[event],
                    Fence::Cas,
                )
                .await;
                match deleted {
                    Ok(revision) => {
                        self.vm_index.deleted(name, revision);
                        tracing::info!(vm = name, "deleted");
                        Ok(None)
                    }
                    Err(StoreError::Conflict { .. }) => Ok(Some(Requeue::at(now, WRITE_CONFLICT))),
                    Err(source) => Err(store_err(source)),
                }
            }
        }
    }

    /// The VM's record with the revision to write it under: from the index
    /// the runtime keeps, else from the store. The index is as fresh as the
    /// change that woke this look, and nothing is started or recorded from
    /// it but by a compare-and-swap on that revision, which a newer record
    /// refuses; a store read is only a snapshot a little less old. A VM the
    /// index does not know is read from the store. (Every agent is woken by
    /// every VM's change; a store read each time only to find the VM is
    /// another node's cost ten agents ten reads per write.)
    async fn record(
        &self,
        key: &str,
        name: &str,
    ) -> Result<Option<TypedEntry<VirtualMachine>>, StoreError> {
        let indexed = self.vm_index.read(|index| {
            index.get(name).map(|v| TypedEntry {
                value: VirtualMachine::clone(&v.vm),
                revision: v.revision,
            })
        });
        match indexed.flatten() {
            Some(entry) => Ok(Some(entry)),
            None => self.store.get::<VirtualMachine>(key).await,
        }
    }

    /// `step` with the instance's readiness brought up to date, for an
    /// instance that is alive and stays recorded: a probe result that
    /// changes it is written along with the step (or as a step of its own
    /// instead of a wait), and a guest not ready yet is looked at again
    /// within the probe interval.
    async fn with_readiness(
        &self,
        vm: &VirtualMachine,
        observed: &Observed,
        step: Step,
        now: Millis,
    ) -> Step {
        let Some(inst) = &vm.status.instance else {
            self.probes.forget_others(&vm.name, None);
            return step;
        };
        self.probes.forget_others(&vm.name, Some(&inst.id));
        if !matches!(
            observed,
            Observed::Instance(keel_hv::DomainState::Running | keel_hv::DomainState::Paused)
        ) {
            return step;
        }
        let (mut next, then, requeue_at) = match step {
            Step::Wait { requeue_at } => (vm.clone(), None, requeue_at),
            Step::Persist {
                vm: next,
                then: None,
                requeue_at,
            } if next.status.instance.as_ref().map(|i| &i.id) == Some(&inst.id) => {
                (*next, None, requeue_at)
            }
            other => return other,
        };
        let phase = next.status.phase;
        if !matches!(phase, Phase::Running | Phase::Starting) {
            return Step::Persist {
                vm: Box::new(next),
                then,
                requeue_at,
            }
            .unless_unchanged(vm);
        }
        let probe = if phase == Phase::Running {
            // The instance as it is to be written: a reset just noted
            // makes its readiness, and so its probe, start over.
            let probed = next.status.instance.clone().unwrap_or_else(|| inst.clone());
            self.probes.latest(vm, &probed).await
        } else {
            None
        };
        let current = next.status.instance.as_mut().expect("checked above");
        let readiness = crate::readiness::next_readiness(vm, current, phase, probe.as_ref(), now);
        if readiness.ready_at.is_some() && vm.ready_since().is_none() {
            keel_hv::start_marks::mark(&vm.name, "ready_seen");
        }
        let requeue_at = if readiness.ready_at.is_none() {
            requeue_at.min(now + self.cfg.readiness_probe_ms)
        } else {
            requeue_at
        };
        current.readiness = Some(readiness);
        Step::Persist {
            vm: Box::new(next),
            then,
            requeue_at,
        }
        .unless_unchanged(vm)
    }

    /// The events `new` makes of `old`, in the order they are recorded:
    /// a guest reset, disks plugged, unplugged or grown, the phase change.
    fn change_events(&self, old: &VirtualMachine, new: &VirtualMachine, now: Millis) -> Vec<Event> {
        let mut events = Vec::new();
        if let Some(event) = crate::reboot::reset_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "guest reset");
            events.push(event);
        }
        if let Some(event) = crate::hotplug::plugged_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "disk plugged in");
            events.push(event);
        }
        if let Some(event) = crate::hot_unplug::unplugged_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "disk unplugged");
            events.push(event);
        }
        if let Some(event) = crate::online_resize::grown_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "disk grown online");
            events.push(event);
        }
        events.extend(phase_event(old, new, now));
        events
    }

    /// What the node says, and the guest resets the driver counted in the
    /// recorded instance. A failed lookup is `Unknown`, never "absent".
    async fn observe(&self, vm: &VirtualMachine) -> (Observed, Option<u32>) {
        match &vm.status.instance {
            Some(inst) => match self.hv.info(&inst.id).await {
                Ok(info) => (Observed::Instance(info.state), Some(info.resets)),
                Err(HvError::NotFound { .. }) => (Observed::InstanceAbsent, None),
                Err(err) => (Observed::Unknown(error_chain(&err)), None),
            },
            None => {
                // This VM's domains only: another VM's hung domain neither
                // delays nor blocks this one's start.
                let domains = match self.hv.domains_of(&vm.name).await {
                    Ok(domains) => domains,
                    Err(err) => return (Observed::Unknown(error_chain(&err)), None),
                };
                if let Some(why) = self.unhanded_target(vm, &domains).await {
                    return (Observed::Unknown(why), None);
                }
                let restore_source = match &vm.restore {
                    None => RestoreSource::NotNeeded,
                    Some(r) => match self
                        .store
                        .get::<Snapshot>(&snapshot_key(&vm.name, &r.snapshot))
                        .await
                    {
                        Ok(Some(snap)) => RestoreSource::Found(Box::new(snap.value)),
                        Ok(None) => RestoreSource::Missing,
                        // The store failed, not the node: what runs is known.
                        Err(err) => RestoreSource::Unreadable(err),
                    },
                };
                let observed = Observed::NoInstance {
                    domains,
                    restore_source,
                };
                (observed, None)
            }
        }
    }

    /// Why a live domain of `vm` here must be neither adopted nor started
    /// beside: it is the target of a migration of the VM that has not
    /// handed over (still in flight, or failed and to be ended by garbage
    /// collection). It never got the guest's state; adopted, it would be an
    /// instance that never boots.
    async fn unhanded_target(
        &self,
        vm: &VirtualMachine,
        domains: &[keel_hv::DomainInfo],
    ) -> Option<String> {
        if !domains.iter().any(|d| !d.state.is_exited()) {
            return None;
        }
        let migrations = match self
            .store
            .list::<Migration>(&migrations_of_prefix(&vm.name))
            .await
        {
            Ok((all, _)) => all,
            Err(err) => return Some(err.to_string()),
        };
        migrations.into_iter().find_map(|(_, m)| {
            let m = m.value;
            let target = domains
                .iter()
                .find(|d| !d.state.is_exited() && d.instance == m.target_instance)?;
            (m.target_node == self.cfg.node && m.status.phase != MigrationPhase::Succeeded).then(
                || {
                    format!(
                        "instance {} is the target of migration {} ({:?}), not handed over",
                        target.instance, m.id, m.status.phase
                    )
                },
            )
        })
    }

    /// The disks of `vm`'s spec its start here may make where missing
    /// (`keel_api::disk_record::makeable`); the others must exist.
    fn disks_to_make(&self, vm: &VirtualMachine) -> keel_hv::DiskCreation {
        let here = self.cfg.disk_home();
        let records = vm.status.disk_records(&vm.spec, &here);
        let names = vm.spec.disk_names();
        keel_hv::DiskCreation::Only(keel_api::disk_record::makeable(&records, &names, &here))
    }

    /// NotFound from shutdown, kill or cleanup means the domain is absent,
    /// which is what those calls want: success. The next lookup sees it too.
    async fn act(&self, vm: &VirtualMachine, action: &HvAction) -> Result<(), ActError> {
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
                let images = crate::images::records_for(&self.store, &vm.spec)
                    .await
                    .map_err(|source| ActError::Store {
                        op: "read the records of the VM's images",
                        source,
                    })?;
                Ok(self
                    .hv
                    .start(&crate::domain_spec::for_instance(
                        vm,
                        crate::domain_spec::Launch::New {
                            instance: inst,
                            create_disks: self.disks_to_make(vm),
                        },
                        images,
                    ))
                    .await?)
            }
            HvAction::Shutdown(id) => Ok(absent_is_ok(self.hv.shutdown(id).await)?),
            HvAction::GuestShutdown(id) => Ok(absent_is_ok(self.hv.guest_shutdown(id).await)?),
            HvAction::GuestReboot(id) => match self.hv.guest_reboot(id).await {
                Err(err) if !err.is_not_found() => {
                    tracing::info!(vm = %vm.name, instance = id, err = %crate::error_chain(&err),
                        "reboot: the guest agent cannot be asked; resetting through the hypervisor");
                    Ok(absent_is_ok(self.hv.reset(id).await)?)
                }
                other => Ok(absent_is_ok(other)?),
            },
            HvAction::Reset(id) => Ok(absent_is_ok(self.hv.reset(id).await)?),
            HvAction::AttachDisk {
                instance,
                disk,
                port,
                create,
            } => {
                let plug = crate::hotplug::disk_plug(vm, instance, disk, *port, *create);
                Ok(self.hv.attach_disk(&plug).await?)
            }
            HvAction::DetachDisk { instance, disk } => {
                // The first ask: the guest lets go later, seen at a next look.
                self.detach_disk(&vm.name, instance, disk).await.map(|_| ())
            }
            HvAction::GrowDisk {
                instance,
                disk,
                size_mib,
            } => Ok(absent_is_ok(
                self.hv.grow_disk(&vm.name, instance, disk, *size_mib).await,
            )?),
            HvAction::Kill(id) => Ok(absent_is_ok(self.hv.kill(id).await)?),
            HvAction::Cleanup(id) => Ok(absent_is_ok(self.hv.cleanup(id).await)?),
            HvAction::DeleteDisks => Ok(self.hv.delete_disks(&vm.name).await?),
            HvAction::CreateMigration(m) => {
                let key = migration_key(&m.vm, &m.id);
                match self.store.create(&key, m.as_ref()).await {
                    // Already there: this attempt's record, created before a retry.
                    Ok(_) | Err(StoreError::Conflict { .. }) => Ok(()),
                    Err(source) => Err(ActError::Store {
                        op: "create the migration record",
                        source,
                    }),
                }
            }
            HvAction::RestoreDisks(snapshot) => Ok(self
                .hv
                .restore_disks(&vm.name, &vm.spec.disks, snapshot)
                .await?),
        }
    }

    /// Asks the node to unplug `disk`; whether it is gone (an instance
    /// gone has no disks).
    async fn detach_disk(&self, vm: &str, instance: &str, disk: &str) -> Result<bool, ActError> {
        match self.hv.detach_disk(vm, instance, disk).await {
            Ok(DiskDetach::Gone) => Ok(true),
            Ok(DiskDetach::Pending) => Ok(false),
            Err(err) if err.is_not_found() => Ok(true),
            Err(err) => Err(err.into()),
        }
    }

    /// [`Self::write`] of a step's record, with the events it makes of
    /// `old` in the same store write.
    async fn write_recorded(
        &self,
        key: &str,
        old: &VirtualMachine,
        vm: &VirtualMachine,
        revision: u64,
        now: Millis,
    ) -> Result<Option<u64>, ReconcileError> {
        let events = self.change_events(old, vm, now);
        let written = write_with_events(
            &self.store,
            key,
            RecordChange::Update(vm),
            revision,
            &events,
            Fence::Cas,
        )
        .await;
        let revision = self.taken_in(vm, written)?;
        if revision.is_some() {
            report_transition(self.observer.as_ref(), old, vm);
        }
        Ok(revision)
    }

    /// Compare-and-swap write. `Ok(None)` on conflict: someone wrote first,
    /// so the step is void and the VM must be looked at again.
    async fn write(
        &self,
        key: &str,
        vm: &VirtualMachine,
        revision: u64,
    ) -> Result<Option<u64>, ReconcileError> {
        let written = self.store.update(key, vm, revision).await;
        self.taken_in(vm, written)
    }

    /// A write of `vm` as a step takes it: into the index once made,
    /// `None` on conflict.
    fn taken_in(
        &self,
        vm: &VirtualMachine,
        written: Result<u64, StoreError>,
    ) -> Result<Option<u64>, ReconcileError> {
        match written {
            Ok(rev) => {
                self.vm_index.written(vm, rev);
                Ok(Some(rev))
            }
            Err(StoreError::Conflict { .. }) => Ok(None),
            Err(source) => Err(ReconcileError::Store {
                vm: vm.name.clone(),
                source,
            }),
        }
    }
}
