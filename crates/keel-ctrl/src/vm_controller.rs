//! Applies [`decide`]'s steps: the only place the VM lifecycle does I/O.

use std::sync::Arc;

use keel_api::{
    Clock, Event, EvictionPhase, Migration, MigrationPhase, Millis, Mono, Node, NodeFreeze, Phase,
    Snapshot, VirtualMachine,
};
use keel_hv::{DiskDetach, DomainSpec, HvError, Hypervisor};
use keel_store::{StoreError, TypedEntry, TypedStore};

use crate::cluster_controller::{self, ClusterState};
use crate::config::LifecycleConfig;
use crate::error_chain::error_chain;
use crate::events::{put_event, record_event, report_undecodable};
use crate::fence::Fence;
use crate::keys::{
    migration_key, migrations_of_prefix, node_key, snapshot_key, snapshots_of_prefix, vm_key,
    MIGRATIONS_PREFIX, VMS_PREFIX,
};
use crate::node_lease::liveness::{ClockReading, Liveness};
use crate::node_lease::{LeaseHolder, LeasePlan, NodeLease};
use crate::observe::{report_transition, LifecycleObserver, NoObserver};
use crate::schedule::candidate_nodes;
use crate::step::{HvAction, Step};
use crate::transitions::{self, ForbiddenTransition};
use crate::view::{ClusterView, Observed, RestoreSource};
use crate::vm_decide::decide;
use crate::vm_index::{ClusterReflector, VmIndex};

/// The cause is in `source()`, never repeated in the message: print the
/// chain (`error_chain`) to see all of it.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("VM {vm}: store")]
    Store {
        vm: String,
        #[source]
        source: StoreError,
    },
    #[error("VM {vm}: hypervisor")]
    Hypervisor {
        vm: String,
        #[source]
        source: HvError,
    },
    /// A store read or write that a step's action needed (image records,
    /// the migration record): the store failed, not the hypervisor.
    #[error("VM {vm}: store, to {op}")]
    StoreForAction {
        vm: String,
        op: &'static str,
        #[source]
        source: StoreError,
    },
    #[error(transparent)]
    Forbidden(#[from] ForbiddenTransition),
}

#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Another agent claimed this node's name: this one must not renew its
    /// lease (its guests are fenced) or act for the node any more.
    #[error("node {node} is now run by another agent (incarnation {theirs}; this agent is {ours}); not renewing this agent's lease")]
    Superseded {
        node: String,
        theirs: String,
        ours: String,
    },
    /// The record was written, but the local fence lease could not be
    /// extended to match it.
    #[error("cannot extend the local fence lease")]
    Fence(#[source] HvError),
}

/// Why a step's action failed: the hypervisor, or the store holding a
/// record the action reads or creates. Never one reported as the other.
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    #[error(transparent)]
    Hypervisor(#[from] HvError),
    #[error("{op}")]
    Store {
        op: &'static str,
        #[source]
        source: StoreError,
    },
}

impl ActError {
    fn for_vm(self, vm: &str) -> ReconcileError {
        let vm = vm.to_string();
        match self {
            ActError::Hypervisor(source) => ReconcileError::Hypervisor { vm, source },
            ActError::Store { op, source } => ReconcileError::StoreForAction { vm, op, source },
        }
    }
}

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
    /// Readiness probes of this node's guests.
    probes: crate::readiness::GuestProbes,
    /// Every VM record, kept current by the runtime's watch; read where a
    /// decision looks at the whole cluster (drains, migrations).
    vm_index: Arc<ClusterReflector>,
    /// Which change of this node's record wakes its VMs (a drain's).
    drain_wake: crate::drain_wake::DrainWake,
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
        Self {
            store,
            hv,
            clock,
            cfg,
            observer: Arc::new(NoObserver),
            liveness: Default::default(),
            lease: Default::default(),
            probes,
            vm_index: Default::default(),
            drain_wake: Default::default(),
        }
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

    /// Every node and VM as read now, taken into this agent's liveness
    /// view at the clocks' reading from before the reads.
    async fn read_cluster(&self) -> Result<ClusterState, StoreError> {
        let looked = ClockReading::now(&*self.clock);
        let nodes = ClusterState::read_nodes(&self.store).await?;
        let mut state = ClusterState::read(&self.store, nodes, Liveness::default()).await?;
        state.liveness = self.observe_nodes(&state.nodes, &state.vms, looked);
        state.looked_at = looked;
        Ok(state)
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

    /// Writes this node's heartbeat (creating its record on first call).
    /// The heartbeat reads nothing but this node's own record and does
    /// nothing else: no other record, however broken, and no store slow to
    /// list the others, can keep it from being renewed.
    pub async fn heartbeat(
        &self,
        facts: Option<&keel_hv::NodeFacts>,
    ) -> Result<(), HeartbeatError> {
        self.heartbeat_planned(facts).await.map(|_| ())
    }

    /// [`Self::heartbeat`], returning how the local lease is to be renewed.
    async fn heartbeat_planned(
        &self,
        facts: Option<&keel_hv::NodeFacts>,
    ) -> Result<LeasePlan, HeartbeatError> {
        let sent_at = self.clock.mono();
        let node = self
            .update_own_record(|node, now| {
                node.status.last_heartbeat = now;
                node.status.disk_home = Some(self.cfg.disk_home());
                if let Some(facts) = facts {
                    node.status.accelerator = facts.accelerator;
                    node.status.hypervisor = Some(facts.hypervisor.clone());
                    node.status.migration = facts.migration.clone();
                    node.status.storage_id = facts.storage_id.clone();
                    node.status.hardware = facts.hardware.clone();
                    node.status.capacity = facts.host.map(|h| self.cfg.capacity.offered(h));
                }
            })
            .await?;
        Ok(self
            .lease
            .heartbeat_ok(sent_at, node.freeze.as_ref(), &self.cfg))
    }

    /// Changes this node's own record (creating it if absent) by
    /// compare-and-swap, refusing if another incarnation holds the name.
    /// Returns the record as written.
    async fn update_own_record(
        &self,
        mut change: impl FnMut(&mut Node, Millis),
    ) -> Result<Node, HeartbeatError> {
        let key = node_key(&self.cfg.node);
        loop {
            let now = self.clock.now_ms();
            let current = self.store.get::<Node>(&key).await?;
            let mut node = current
                .as_ref()
                .map(|e| e.value.clone())
                .unwrap_or_else(|| Node::new(&self.cfg.node));
            if let (Some(ours), Some(theirs)) = (&self.cfg.incarnation, &node.status.incarnation) {
                if ours != theirs {
                    return Err(HeartbeatError::Superseded {
                        node: self.cfg.node.clone(),
                        theirs: theirs.clone(),
                        ours: ours.clone(),
                    });
                }
            }
            if self.cfg.incarnation.is_some() {
                node.status.incarnation = self.cfg.incarnation.clone();
            }
            change(&mut node, now);
            let result = match &current {
                Some(e) => self.store.update(&key, &node, e.revision).await,
                None => self.store.create(&key, &node).await,
            };
            match result {
                Ok(_) => return Ok(node),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A planned restart: freezes this node for `wanted_ms` (longer if a
    /// freeze in force ends later), so the cluster takes over none of its
    /// VMs meanwhile, and extends the local fence lease to the freeze's
    /// end, so the guests keep running without the agent and are fenced
    /// if it has not returned by then. Written together with a heartbeat.
    /// Returns the freeze's end on this agent's monotonic clock.
    pub async fn freeze_for_restart(
        &self,
        wanted_ms: Millis,
        reason: &str,
    ) -> Result<Mono, HeartbeatError> {
        let sent_at = self.clock.mono();
        let requested_at = self.clock.now_ms();
        let node = self
            .update_own_record(|node, now| {
                let duration_ms =
                    self.lease
                        .own_freeze_ms(sent_at, wanted_ms, node.freeze.as_ref());
                node.freeze = Some(NodeFreeze {
                    requested_at,
                    duration_ms,
                    reason: reason.to_string(),
                });
                node.status.last_heartbeat = now;
            })
            .await?;
        let freeze = node.freeze.expect("written above");
        let end = self.lease.froze(sent_at, &freeze);
        let left = end.since(self.clock.mono());
        self.hv
            .renew_fence(std::time::Duration::from_millis(left))
            .await
            .map_err(HeartbeatError::Fence)?;
        tracing::warn!(node = %self.cfg.node, duration_ms = freeze.duration_ms, reason,
            "node frozen: its guests keep running until the agent returns, and are fenced at the freeze's end");
        Ok(end)
    }

    /// Removes the freeze `key` from this node's record (not a newer one).
    async fn clear_freeze(&self, key: (Millis, Millis)) -> Result<(), HeartbeatError> {
        let mut cleared = false;
        self.update_own_record(|node, _| {
            if node.freeze.as_ref().is_some_and(|f| f.key() == key) {
                node.freeze = None;
                cleared = true;
            }
        })
        .await?;
        if cleared {
            tracing::info!(node = %self.cfg.node, "freeze ended: the agent is back, or the freeze is over");
        }
        Ok(())
    }

    /// Records this node's drain as complete if no VM is left on it. A VM
    /// record that cannot be decoded might be one of this node's: the
    /// drain stays open until it is repaired or removed. One of the
    /// chores: it lists every VM, which may take longer than a heartbeat
    /// may.
    async fn complete_drain(&self) -> Result<(), StoreError> {
        let key = node_key(&self.cfg.node);
        let own = self.store.get::<Node>(&key).await?;
        if own.is_none_or(|node| node.value.draining().is_none()) {
            return Ok(());
        }
        let vms = self
            .store
            .list_with_skipped::<VirtualMachine>(VMS_PREFIX)
            .await?;
        if let Some(bad) = vms.skipped.first() {
            tracing::warn!(node = %self.cfg.node, key = %bad.key,
                "drain not recorded complete: a VM record cannot be decoded");
            return Ok(());
        }
        let me = Some(self.cfg.node.as_str());
        if vms.entries.iter().any(|(_, v)| v.value.owner_node() == me) {
            return Ok(());
        }
        loop {
            let Some(current) = self.store.get::<Node>(&key).await? else {
                return Ok(());
            };
            let mut node = current.value;
            let Some(drain) = node.drain.as_mut().filter(|d| d.completed_at.is_none()) else {
                return Ok(());
            };
            drain.completed_at = Some(self.clock.now_ms());
            match self.store.update(&key, &node, current.revision).await {
                Ok(_) => {
                    tracing::info!(node = %self.cfg.node, "drain complete: no VM left on the node");
                    return Ok(());
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes the heartbeat and, once it reached the store, renews the
    /// node's local fence lease (which the QEMU driver's keepers enforce
    /// even if this process dies) with what is left of `self_fence_ms`,
    /// counted from before the write was sent.
    ///
    /// Under a freeze the lease reaches to the freeze's end. A freeze that
    /// is over, or that this agent finds on its first heartbeat (it is
    /// back), is removed from the record, and only after the lease was cut
    /// back to the normal window: the cluster then counts the normal lease
    /// again, and the guests must not outlive it.
    pub async fn heartbeat_and_renew(
        &self,
        facts: Option<&keel_hv::NodeFacts>,
    ) -> Result<(), HeartbeatError> {
        let plan = self.heartbeat_planned(facts).await?;
        let left = plan.renew_until.since(self.clock.mono());
        if let Err(err) = self
            .hv
            .renew_fence(std::time::Duration::from_millis(left))
            .await
        {
            // The guests will be fenced when the lease lapses: loud, but
            // nothing else to do than try again at the next heartbeat.
            tracing::error!(node = %self.cfg.node, %err, "cannot renew the local fence lease");
            return Ok(());
        }
        if let Some(key) = plan.clear_freeze {
            if let Err(err) = self.clear_freeze(key).await {
                tracing::warn!(node = %self.cfg.node, err = %error_chain(&err), "cannot clear the node's freeze; trying again at the next heartbeat");
            }
        }
        Ok(())
    }

    /// [`Self::heartbeat_and_renew`] with the driver's current facts.
    pub async fn renew_lease(&self) -> Result<(), HeartbeatError> {
        let facts = self.hv.facts().await;
        self.heartbeat_and_renew(Some(&facts)).await
    }

    /// Whether this agent must end its guests now, its last good heartbeat
    /// having been at `last_ok` (see [`NodeLease::self_fence_due`]).
    pub fn self_fence_due(&self, last_ok: Mono) -> bool {
        self.lease
            .self_fence_due(last_ok, self.clock.mono(), &self.cfg)
    }

    /// Taking over the VMs of nodes whose lease ran out (with
    /// `cluster_duties`), recording a drain of this node complete, ending
    /// stray domains.
    pub async fn chores(&self) {
        if self.cfg.cluster_duties {
            if let Err(err) = self.take_over_lost_nodes().await {
                tracing::warn!(err = %error_chain(&err), "taking over from lost nodes failed");
            }
        }
        if let Err(err) = self.complete_drain().await {
            tracing::warn!(node = %self.cfg.node, err = %error_chain(&err), "cannot check whether the drain is complete");
        }
        if let Err(err) = self.collect_garbage().await {
            tracing::warn!(err = %error_chain(&err), "garbage collection failed");
        }
        report_undecodable(&self.store, self.clock.now_ms(), Fence::Cas).await;
    }

    /// This agent cannot renew its lease: before it runs out and another
    /// node starts these VMs, end every fenced domain here. The unfenced
    /// ones no other node may start keep running, to be taken up again.
    pub async fn self_fence(&self) {
        let listing = match self.hv.list().await {
            Ok(listing) => listing,
            Err(err) => {
                tracing::error!(node = %self.cfg.node, %err, "self-fence: cannot list domains");
                return;
            }
        };
        // A domain whose state nobody could read may be running: it is
        // ended too. All at once, so one slow kill delays no other.
        let mut kills = tokio::task::JoinSet::new();
        for instance in listing.fenced_instances() {
            tracing::error!(node = %self.cfg.node, instance,
                "self-fence: lease not renewed, ending instance");
            let (hv, instance) = (self.hv.clone(), instance.to_string());
            kills.spawn(async move {
                if let Err(err) = hv.kill(&instance).await {
                    tracing::error!(instance, %err, "self-fence: kill failed");
                }
            });
        }
        kills.join_all().await;
    }

    /// VMs owned by a node whose lease has run out move back to the
    /// scheduler. Never earlier: until then the node may still run them.
    /// (Single-process mode; under a control plane its leader does this.)
    pub async fn take_over_lost_nodes(&self) -> Result<(), StoreError> {
        let mut state = self.read_cluster().await?;
        let now = state.looked_at.wall;
        let lost = state
            .liveness
            .lost(Some(&self.cfg.node), state.looked_at.mono, &self.cfg);
        if lost.is_empty() {
            return Ok(());
        }
        cluster_controller::take_over(&self.store, &mut state, &lost, now, Fence::Cas).await?;
        Ok(())
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
        let Some(entry) = self.record(&key, name).await.map_err(store_err)? else {
            return Ok(None);
        };
        let vm = entry.value;
        match vm.owner_node() {
            // Another node's agent looks after it; a change wakes us again.
            Some(node) if node != self.cfg.node => return Ok(None),
            // The control plane's leader places it; a change wakes us again.
            None if !self.cfg.cluster_duties => return Ok(None),
            None => return self.place(&vm, entry.revision).await.map_err(store_err),
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
            Step::Wait { requeue_at } => Ok(Some(requeue_at)),
            Step::Persist {
                then: Some(HvAction::Start),
                ..
            } if !self.lease.fresh(self.clock.mono(), &self.cfg) => {
                // No heartbeat got through within the lease: the cluster
                // may be about to start this node's VMs elsewhere.
                tracing::warn!(vm = name, node = %self.cfg.node,
                    "not starting: this node's lease is stale (no heartbeat got through within it)");
                Ok(Some(now + self.cfg.retry_ms))
            }
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
                Ok(Some(requeue_at))
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
                    return Ok(Some(now + self.cfg.poll_ms));
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
                match self.store.delete(&key, entry.revision).await {
                    Ok(revision) => {
                        self.vm_index.deleted(name, revision);
                        tracing::info!(vm = name, "deleted");
                        let event = Event {
                            at: now,
                            vm: name.to_string(),
                            from: vm.status.phase,
                            to: Phase::Deleting,
                            reason: "record deleted: instance gone, disks removed".into(),
                            key: None,
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
                value: v.vm.clone(),
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

    /// Chooses the node for a VM that has none (single-process mode).
    /// Every agent computes the same choice; the compare-and-swap lets one
    /// write it.
    async fn place(
        &self,
        vm: &VirtualMachine,
        revision: u64,
    ) -> Result<Option<Millis>, StoreError> {
        let mut state = self.read_cluster().await?;
        let now = state.looked_at.wall;
        cluster_controller::place(
            &self.store,
            &mut state,
            vm,
            revision,
            now,
            &self.cfg,
            Fence::Cas,
        )
        .await
        .map(Some)
    }

    /// This node's drain and, while draining, the VM's migration and the
    /// nodes it could move to.
    async fn cluster_view(&self, vm: &VirtualMachine) -> Result<ClusterView, StoreError> {
        // The eviction's migration is looked at even when the drain has
        // ended: one that succeeded meanwhile must still be taken.
        let migration = match vm
            .status
            .eviction
            .as_ref()
            .and_then(|e| e.migration.as_ref())
        {
            Some(id) => self
                .store
                .get::<Migration>(&migration_key(&vm.name, id))
                .await?
                .map(|e| e.value),
            None => None,
        };
        let me = match self.vm_index.node(&self.cfg.node) {
            Some(me) => me,
            None => self
                .store
                .get::<Node>(&node_key(&self.cfg.node))
                .await?
                .map(|e| e.value),
        };
        let drain = me.as_ref().and_then(|n| n.draining().cloned());
        // Only for a start: its placement rules, the ports held here and
        // what the other VMs placed here take, from the index (a VM the
        // index lacks is not counted: a start it lets through the
        // leader's placement, by the same index, did too).
        let no_room_here = match &me {
            Some(me) if vm.status.instance.is_none() && vm.wants_running() => {
                self.no_room_on(vm, me).await
            }
            _ => None,
        };
        // A user's migration to start needs the same look around as a drain.
        if drain.is_none() && vm.pending_migration().is_none() {
            return Ok(ClusterView {
                migration,
                no_room_here,
                ..ClusterView::default()
            });
        };
        let now = ClockReading::now(&*self.clock);
        let nodes = match self.vm_index.nodes() {
            Some(nodes) => nodes,
            None => ClusterState::read_nodes(&self.store).await?,
        };
        // The index the runtime keeps; listed here only without one (no
        // runtime behind this controller, or its watch broke).
        let around = |vms: &VmIndex| self.look_around(vm, &nodes, vms, now);
        let (targets, no_target, drain_evictions_waiting) = match self.vm_index.read(around) {
            Some(found) => found,
            None => around(&ClusterState::read_vms(&self.store).await?.0),
        };
        let (all, _) = self.store.list::<Migration>(MIGRATIONS_PREFIX).await?;
        let in_flight = all
            .into_iter()
            .map(|(_, e)| e.value)
            .filter(|m| !m.status.phase.is_final())
            .collect();
        Ok(ClusterView {
            drain,
            migration,
            targets,
            no_target,
            in_flight,
            drain_evictions_waiting,
            no_room_here,
        })
    }

    /// Why `vm` cannot start on this node (`me`) beside what the records
    /// allocate here and the live domains they do not account for (a
    /// given-up migration's target, a handed-over source, until ended).
    /// A listing that fails counts nothing extra: the records still bound
    /// it.
    async fn no_room_on(&self, vm: &VirtualMachine, me: &Node) -> Option<String> {
        // The live domains can deny only room (on a node that reports its
        // capacity), an anti-affinity group or a published port: without
        // any of those the listing, whose cost grows with every domain of
        // the node, is not asked for at each start (10,000 sim VMs took
        // 48 s to run instead of 8 with it).
        let live_domains_matter = me.status.capacity.is_some()
            || vm.spec.placement.anti_affinity.is_some()
            || !vm.spec.network.publish.is_empty();
        let listing = if live_domains_matter {
            self.hv.list().await.map(|l| l.domains)
        } else {
            Ok(Vec::new())
        };
        let domains = match listing {
            Ok(domains) => domains,
            Err(err) => {
                tracing::debug!(vm = %vm.name, %err, "no domain listing for the room check");
                Vec::new()
            }
        };
        self.vm_index
            .read(|vms| {
                let extra = crate::schedule::unaccounted(&domains, &me.name, |name| {
                    vms.get(name).map(|v| &v.vm)
                });
                crate::schedule::room_on(vm, me, vms.load(), &extra)
            })
            .and_then(Result::err)
    }

    /// Where `vm` could move now, best first (or why nowhere), and how
    /// many VMs on draining nodes still wait for a migration: the part of
    /// the view that looks at every VM, answered from an index of them.
    fn look_around(
        &self,
        vm: &VirtualMachine,
        nodes: &[Node],
        vms: &VmIndex,
        now: ClockReading,
    ) -> (Vec<String>, Option<String>, usize) {
        let liveness = self.observe_nodes(nodes, vms, now);
        let here = Some(self.cfg.node.as_str());
        let targets = candidate_nodes(vm, nodes, vms.load(), here, &liveness, now, &self.cfg);
        let no_target = targets.is_empty().then(|| {
            crate::schedule::why_no_node(vm, nodes, vms.load(), here, &liveness, now, &self.cfg)
        });
        let draining: Vec<&str> = nodes
            .iter()
            .filter(|n| n.draining().is_some())
            .map(|n| n.name.as_str())
            .collect();
        let drain_evictions_waiting = draining
            .iter()
            .flat_map(|node| vms.owned_by(node))
            .map(|v| &v.vm)
            .filter(|v| {
                v.status
                    .instance
                    .as_ref()
                    .is_some_and(|i| draining.contains(&i.node.as_str()))
                    && v.status.eviction.as_ref().is_none_or(|e| {
                        !e.user && e.phase == EvictionPhase::Submitting && e.migration.is_none()
                    })
            })
            .count();
        (targets, no_target, drain_evictions_waiting)
    }

    /// Ends domains on this node that no VM record (and no migration in
    /// flight) accounts for: the source of a finished migration, the target
    /// of an abandoned one, instances of VMs now owned elsewhere. Killing an
    /// extra instance is always safe; the recorded one is never touched.
    pub async fn collect_garbage(&self) -> Result<(), ReconcileError> {
        self.end_stray_domains().await?;
        self.collect_migrations().await
    }

    /// Deletes final migration records beyond the last few of each VM this
    /// node owns (`migrations_to_collect`), and every final one of a VM
    /// whose record is gone. Each delete is a compare-and-swap on the
    /// revision read, so a record that changed meanwhile stays.
    async fn collect_migrations(&self) -> Result<(), ReconcileError> {
        let store_err = |source| ReconcileError::Store {
            vm: String::new(),
            source,
        };
        let (all, _) = self
            .store
            .list::<Migration>(MIGRATIONS_PREFIX)
            .await
            .map_err(store_err)?;
        let mut by_vm: std::collections::BTreeMap<&str, Vec<&keel_store::TypedEntry<Migration>>> =
            Default::default();
        for (_, entry) in &all {
            by_vm
                .entry(entry.value.vm.as_str())
                .or_default()
                .push(entry);
        }
        for (name, entries) in by_vm {
            let record = self
                .store
                .get::<VirtualMachine>(&vm_key(name))
                .await
                .map_err(store_err)?
                .map(|e| e.value);
            if record
                .as_ref()
                .is_some_and(|vm| vm.owner_node() != Some(self.cfg.node.as_str()))
            {
                continue;
            }
            let migrations: Vec<Migration> = entries.iter().map(|e| e.value.clone()).collect();
            for id in crate::evict_decide::migrations_to_collect(record.as_ref(), &migrations) {
                let Some(entry) = entries.iter().find(|e| e.value.id == id) else {
                    continue;
                };
                match self
                    .store
                    .delete(&migration_key(name, &id), entry.revision)
                    .await
                {
                    Ok(_) | Err(StoreError::Conflict { .. }) => {}
                    Err(source) => return Err(store_err(source)),
                }
            }
        }
        Ok(())
    }

    async fn end_stray_domains(&self) -> Result<(), ReconcileError> {
        let listing = match self.hv.list().await {
            Ok(listing) => listing,
            Err(err) => {
                tracing::debug!(%err, "garbage collection: cannot list domains");
                return Ok(());
            }
        };
        // A domain nobody can read is neither ended nor cleaned up: it may
        // be the recorded instance, or one mid-handover. The others go on.
        for u in &listing.unknown {
            tracing::debug!(instance = %u.instance, err = %u.error,
                "garbage collection: domain state unknown, left alone");
        }
        for d in listing.domains {
            // The recorded instance, as the index has it: the usual case,
            // answered without a read per domain on every pass. Anything
            // else is read afresh before a domain is ended.
            let recorded_here = self.vm_index.read(|index| {
                index
                    .get(&d.vm)
                    .and_then(|v| v.vm.status.instance.as_ref())
                    .is_some_and(|inst| inst.id == d.instance)
            });
            if recorded_here == Some(true) {
                continue;
            }
            let store_err = |source| ReconcileError::Store {
                vm: d.vm.clone(),
                source,
            };
            let record = self
                .store
                .get::<VirtualMachine>(&vm_key(&d.vm))
                .await
                .map_err(store_err)?
                .map(|e| e.value);
            let owner_adopts = match &record {
                Some(vm) => match &vm.status.instance {
                    Some(inst) if inst.id == d.instance => continue,
                    Some(_) => false,
                    // The owner adopts or cleans up its own untracked domains.
                    None => {
                        vm.owner_node() == Some(self.cfg.node.as_str()) || vm.owner_node().is_none()
                    }
                },
                None => false,
            };
            let migrations = self
                .store
                .list_with_skipped::<Migration>(&migrations_of_prefix(&d.vm))
                .await
                .map_err(store_err)?;
            // ...but not the target of a failed migration, which never got
            // the guest: the owner neither adopts it nor starts beside it.
            let failed_target = migrations.entries.iter().any(|(_, m)| {
                m.value.target_instance == d.instance
                    && m.value.status.phase == MigrationPhase::Failed
            });
            if owner_adopts && !failed_target {
                continue;
            }
            // An undecodable migration may be the one this domain serves.
            if !migrations.skipped.is_empty() {
                continue;
            }
            let migrations = migrations.entries;
            let recorded = record
                .as_ref()
                .and_then(|vm| vm.status.instance.as_ref())
                .map(|i| i.id.as_str());
            let in_flight = migrations.iter().any(|(_, m)| {
                let m = &m.value;
                let involved = m.target_instance == d.instance || m.source_instance == d.instance;
                // A succeeded migration whose VM record still names the
                // source is mid-handover: the target is about to be recorded.
                let handing_over = m.status.phase == MigrationPhase::Succeeded
                    && recorded == Some(m.source_instance.as_str());
                involved && (!m.status.phase.is_final() || handing_over)
            });
            if in_flight {
                continue;
            }
            let result = if d.state.is_exited() {
                self.hv.cleanup(&d.instance).await
            } else {
                tracing::info!(vm = %d.vm, instance = %d.instance, "ending unaccounted domain");
                self.hv.kill(&d.instance).await
            };
            if let Err(err) = result {
                if !err.is_not_found() {
                    tracing::warn!(vm = %d.vm, instance = %d.instance, %err, "garbage collection");
                }
            }
        }
        Ok(())
    }

    async fn record_event(
        &self,
        old: &VirtualMachine,
        new: &VirtualMachine,
        revision: u64,
        now: Millis,
    ) {
        report_transition(self.observer.as_ref(), old, new);
        if let Some(event) = crate::reboot::reset_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "guest reset");
            self.put_event(&event, revision).await;
        }
        if let Some(event) = crate::hotplug::plugged_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "disk plugged in");
            self.put_event(&event, revision).await;
        }
        if let Some(event) = crate::hot_unplug::unplugged_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "disk unplugged");
            self.put_event(&event, revision).await;
        }
        if let Some(event) = crate::online_resize::grown_event(old, new, now) {
            tracing::info!(vm = %new.name, reason = %event.reason, "disk grown online");
            self.put_event(&event, revision).await;
        }
        record_event(&self.store, old, new, revision, now, Fence::Cas).await
    }

    async fn put_event(&self, event: &Event, revision: u64) {
        put_event(&self.store, event, revision, Fence::Cas).await
    }

    /// What the node says, and the guest resets the driver counted in the
    /// recorded instance. A failed lookup is `Unknown`, never "absent".
    async fn observe(&self, vm: &VirtualMachine) -> (Observed, Option<u32>) {
        match &vm.status.instance {
            Some(inst) => match self.hv.info(&inst.id).await {
                Ok(info) => (Observed::Instance(info.state), Some(info.resets)),
                Err(HvError::NotFound { .. }) => (Observed::InstanceAbsent, None),
                Err(err) => (Observed::Unknown(err.to_string()), None),
            },
            None => {
                // This VM's domains only: another VM's hung domain neither
                // delays nor blocks this one's start.
                let domains = match self.hv.domains_of(&vm.name).await {
                    Ok(domains) => domains,
                    Err(err) => return (Observed::Unknown(err.to_string()), None),
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
                    .start(&DomainSpec {
                        vm: vm.name.clone(),
                        instance: inst.id.clone(),
                        cpus: vm.spec.cpus,
                        memory_mib: vm.spec.memory_mib,
                        disks: vm.spec.disks.clone(),
                        boot: vm.spec.boot.clone(),
                        create_disks: self.disks_to_make(vm),
                        network: vm.nic(),
                        cloud_init: vm.spec.cloud_init.clone(),
                        images,
                        fenced: inst.fenced,
                        hardware: vm.status.hardware.clone(),
                        hotplug_ports: inst.hotplug_ports,
                        // A new instance: every disk on the root complex.
                        plugged: Vec::new(),
                        clone_from: vm.status.clone_from.clone(),
                        recorded_firmware: vm.status.firmware,
                        tpm: crate::tpm_state::tpm_use(vm),
                    })
                    .await?)
            }
            HvAction::Shutdown(id) => Ok(absent_is_ok(self.hv.shutdown(id).await)?),
            HvAction::GuestShutdown(id) => Ok(absent_is_ok(self.hv.guest_shutdown(id).await)?),
            HvAction::GuestReboot(id) => match self.hv.guest_reboot(id).await {
                Err(err) if !err.is_not_found() => {
                    tracing::info!(vm = %vm.name, instance = id, %err,
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

    /// Compare-and-swap write. `Ok(None)` on conflict: someone wrote first,
    /// so the step is void and the VM must be looked at again.
    async fn write(
        &self,
        key: &str,
        vm: &VirtualMachine,
        revision: u64,
    ) -> Result<Option<u64>, ReconcileError> {
        match self.store.update(key, vm, revision).await {
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

/// The heartbeat loop's view of the controller (`node_lease::heartbeat`).
impl LeaseHolder for VmController {
    type Error = HeartbeatError;

    fn node(&self) -> &str {
        &self.cfg.node
    }

    async fn renew_lease(&self) -> Result<(), HeartbeatError> {
        VmController::renew_lease(self).await
    }

    fn self_fence_due(&self, last_ok: Mono) -> bool {
        VmController::self_fence_due(self, last_ok)
    }

    async fn self_fence(&self) {
        VmController::self_fence(self).await
    }
}
