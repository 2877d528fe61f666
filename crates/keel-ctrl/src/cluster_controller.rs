//! Cluster-level duties: placing VMs that have no node, and taking over the
//! VMs of nodes whose lease ran out.
//!
//! The decisions are pure (`schedule::placement`, `schedule::lost_nodes`,
//! `vm_decide::take_over_from_lost_node`); this module reads the view and
//! writes the outcome, either by compare-and-swap alone ([`Fence::Cas`]:
//! a process alone on its store, [`ClusterController::sole`]) or by
//! compare-and-swap *and* the leader's guard
//! ([`Fence::Guard`]: the [`ClusterController`] of the elected control
//! plane, whose writes stop applying the moment its leader key is gone).

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use keel_api::{Clock, Migration, Millis, Mono, Node, VirtualMachine};
use keel_store::{Batch, Revision, StoreError, TypedStore, WatchEvent};
use tokio::sync::watch;

use crate::config::LifecycleConfig;
use crate::election::LeaderElection;
use crate::event_retention::{prune_events, PRUNE_INTERVAL_MS};
use crate::events::{phase_event, report_undecodable};
use crate::fence::Fence;
use crate::keys::{migrations_of_prefix, name_of, vm_key, NODES_PREFIX, VMS_PREFIX};
use crate::node_lease::liveness::{ClockReading, Liveness};
use crate::recorded_write::{write_with_events, RecordChange};
use crate::schedule::{placement, NodeLoad};
use crate::transitions;
use crate::vm_decide::take_over_from_lost_node;
use crate::vm_decodes::VmDecoder;
use crate::vm_index::VmIndex;

/// Longest a leader goes without a pass. Passes are driven by changes and
/// by the next node-lease deadline; this is only a backstop.
const MAX_IDLE_MS: Millis = 10_000;
/// Most VM changes taken in before a pass may run.
const ARRIVED_AT_ONCE: usize = 4_096;

/// Every node, every VM (indexed, with the revision it was read at), and
/// the reader's view of which nodes are alive.
pub(crate) struct ClusterState {
    pub nodes: Vec<Node>,
    pub vms: VmIndex,
    pub liveness: Liveness,
    /// When `liveness` last took in `nodes`.
    pub looked_at: ClockReading,
    /// The nodes the last pass found lost.
    pub lost: Vec<String>,
}

impl ClusterState {
    pub async fn read_nodes(store: &TypedStore) -> Result<Vec<Node>, StoreError> {
        let (nodes, _) = store.list::<Node>(NODES_PREFIX).await?;
        Ok(nodes.into_iter().map(|(_, e)| e.value).collect())
    }

    /// The VMs as listed now, and the revision of the list (a watch from
    /// just after it misses nothing).
    pub async fn read_vms(store: &TypedStore) -> Result<(VmIndex, Revision), StoreError> {
        let (vms, revision) = store.list::<VirtualMachine>(VMS_PREFIX).await?;
        let index = VmIndex::of(vms.into_iter().map(|(_, e)| (e.value, e.revision)));
        Ok((index, revision))
    }

    pub async fn read(
        store: &TypedStore,
        nodes: Vec<Node>,
        liveness: Liveness,
    ) -> Result<Self, StoreError> {
        let (vms, _) = Self::read_vms(store).await?;
        Ok(Self {
            nodes,
            vms,
            liveness,
            looked_at: ClockReading::default(),
            lost: Vec::new(),
        })
    }

    /// Keeps the view current after this writer's own write.
    fn written(&mut self, vm: VirtualMachine, revision: Revision) {
        self.vms.written(vm, revision);
    }

    /// Whether a change (already applied) calls for a pass now: a VM
    /// without a node, one whose record cannot be read (look anyway: it is
    /// reported), or one that came to a node the last pass found lost.
    fn needs_pass(&self, event: &WatchEvent) -> bool {
        let WatchEvent::Put(entry) = event else {
            return false;
        };
        let Some(name) = name_of(VMS_PREFIX, &entry.key) else {
            return false;
        };
        match self.vms.get(name) {
            None => true,
            Some(v) => {
                v.vm.owner_node()
                    .is_none_or(|owner| self.lost.iter().any(|l| l == owner))
            }
        }
    }
}

/// `vm`'s record with its placement (or why there is none) given `load`,
/// if that changes it and is an allowed change.
fn choose(
    vm: &VirtualMachine,
    state: &ClusterState,
    load: &NodeLoad,
    cfg: &LifecycleConfig,
) -> Option<VirtualMachine> {
    placement(
        vm,
        &state.nodes,
        load,
        &state.liveness,
        state.looked_at,
        cfg,
    )
    .filter(|next| transitions::check(vm, next).is_ok())
}

/// Writes a placement chosen from the record read at `revision`.
async fn write_placement(
    store: &TypedStore,
    fence: Fence<'_>,
    next: &VirtualMachine,
    revision: Revision,
) -> Result<Revision, StoreError> {
    let written = fence
        .update(store, &vm_key(&next.name), next, revision)
        .await?;
    log_placed(next);
    Ok(written)
}

/// Placements made in one store write. A burst of new VMs placed one
/// write each cost etcd a transaction, a raft entry and a message to
/// every watcher per VM; 32 records and the leader's guard also stay
/// well within etcd's default of 128 operations per transaction.
const PLACEMENTS_PER_WRITE: usize = 32;

/// Placement writes a pass keeps in flight at once: one at a time, a
/// burst of 10,000 new VMs took as many store round trips end to end.
const PLACEMENT_WRITES_IN_FLIGHT: usize = 4;

/// Writes `placements` (each from the revision it was read at) as one
/// store write, all or nothing; if one of them changed meanwhile, each
/// is written on its own, so that the others are not held up by it.
async fn write_placements(
    store: &TypedStore,
    fence: Fence<'_>,
    placements: Vec<(VirtualMachine, Revision)>,
) -> Vec<(VirtualMachine, Result<Revision, StoreError>)> {
    if placements.len() > 1 {
        let batch = placements
            .iter()
            .fold(Batch::new(), |batch, (next, revision)| {
                batch.update(&vm_key(&next.name), next, *revision)
            });
        match store.write_all(batch, fence.guard()).await {
            Ok(written) => {
                return placements
                    .into_iter()
                    .map(|(next, _)| {
                        log_placed(&next);
                        (next, Ok(written))
                    })
                    .collect()
            }
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => {
                return placements
                    .into_iter()
                    .map(|(next, _)| (next, Err(e.clone())))
                    .collect()
            }
        }
    }
    let mut outcomes = Vec::with_capacity(placements.len());
    for (next, revision) in placements {
        let written = write_placement(store, fence, &next, revision).await;
        outcomes.push((next, written));
    }
    outcomes
}

fn log_placed(next: &VirtualMachine) {
    if let Some(node) = &next.status.node {
        tracing::info!(vm = %next.name, %node, "placed");
    }
}

/// Chooses a node for every VM without one, each choice counting towards
/// the next ones' load, then writes them all, many to a store write and
/// several writes in flight at once. Counts the outcome into
/// `report`.
async fn place_all(
    store: &TypedStore,
    state: &mut ClusterState,
    cfg: &LifecycleConfig,
    fence: Fence<'_>,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    let now = state.looked_at.mono;
    let mut load = state.vms.load().clone();
    let mut writes = Vec::new();
    for name in state.vms.unplaced() {
        let Some(entry) = state.vms.get(name) else {
            continue;
        };
        match choose(&entry.vm, state, &load, cfg) {
            Some(next) => {
                load.replace(&entry.vm, &next);
                writes.push((next, entry.revision));
            }
            None => {
                report.unplaced += 1;
                report.next_at = report.next_at.min(now.plus(cfg.retry_ms));
            }
        }
    }
    let mut chunks = Vec::new();
    let mut writes = writes.into_iter().peekable();
    while writes.peek().is_some() {
        chunks.push(
            writes
                .by_ref()
                .take(PLACEMENTS_PER_WRITE)
                .collect::<Vec<_>>(),
        );
    }
    let outcomes: Vec<(VirtualMachine, Result<Revision, StoreError>)> = stream::iter(chunks)
        .map(|chunk| write_placements(store, fence, chunk))
        .buffer_unordered(PLACEMENT_WRITES_IN_FLIGHT)
        .flat_map(stream::iter)
        .collect()
        .await;
    let mut failed = None;
    for (next, written) in outcomes {
        let placed = next.status.node.is_some();
        match written {
            Ok(revision) => {
                state.written(next, revision);
                if placed {
                    report.placed += 1;
                    continue;
                }
                report.next_at = report.next_at.min(now.plus(cfg.retry_ms));
            }
            // Someone wrote first; the VM is looked at again at once.
            Err(StoreError::Conflict { .. }) => {
                report.next_at = report.next_at.min(now.plus(1));
            }
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
        report.unplaced += 1;
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Moves every VM owned by a node in `lost` back to the scheduler: its
/// instance counts as gone (the node fenced itself, or is down). Returns
/// how many were taken over.
pub(crate) async fn take_over(
    store: &TypedStore,
    state: &mut ClusterState,
    lost: &[String],
    now: Millis,
    fence: Fence<'_>,
) -> Result<usize, StoreError> {
    let mut taken = 0;
    let owned: Vec<(VirtualMachine, Revision)> = lost
        .iter()
        .flat_map(|node| state.vms.owned_by(node))
        .map(|v| (VirtualMachine::clone(&v.vm), v.revision))
        .collect();
    for (vm, read_at) in owned {
        let vm = &vm;
        let Some(owner) = vm.owner_node() else {
            continue;
        };
        let owner = owner.to_string();
        let migrations = store
            .list_with_skipped::<Migration>(&migrations_of_prefix(&vm.name))
            .await?;
        if let Some(bad) = migrations.skipped.first() {
            // It may be a migration to a live target still settling the VM.
            tracing::warn!(vm = %vm.name, key = %bad.key,
                "not taken over: one of its migration records cannot be decoded");
            continue;
        }
        let migrations: Vec<Migration> = migrations
            .entries
            .into_iter()
            .map(|(_, e)| e.value)
            .collect();
        let Some(next) = take_over_from_lost_node(vm, &owner, &migrations, lost, now) else {
            // A migration from the lost node is still being settled by its target.
            continue;
        };
        if transitions::check(vm, &next).is_err() {
            continue;
        }
        let events: Vec<_> = phase_event(vm, &next, now).into_iter().collect();
        let written = write_with_events(
            store,
            &vm_key(&vm.name),
            RecordChange::Update(&next),
            read_at,
            &events,
            fence,
        )
        .await;
        match written {
            Ok(revision) => {
                let kept = next.status.instance.is_some() && vm.status.instance.is_some();
                if kept {
                    tracing::warn!(vm = %next.name, node = %owner, "node lease expired; VM not fenced, waits for its node");
                } else {
                    tracing::warn!(vm = %next.name, node = %owner, "node lease expired; VM taken over");
                    taken += 1;
                }
                state.written(next, revision);
            }
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(taken)
}

/// What one leader pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassReport {
    /// When to pass again at the latest (changes may call for one sooner),
    /// on the leader's monotonic clock.
    pub next_at: Mono,
    pub placed: usize,
    /// VMs still without a node (no node can take them now).
    pub unplaced: usize,
    pub taken_over: usize,
}

/// Who may do the cluster-level duties, and how their writes are fenced.
enum Leadership {
    /// Control planes on a shared store: the elected leader, writing with
    /// its guard.
    Elected(Arc<LeaderElection>),
    /// The only process on its store (`keel serve` on SQLite: the data dir
    /// is locked to it): always the leader, writing by compare-and-swap.
    Sole,
}

/// The control plane's reconciler for cluster-level duties. It acts only
/// while its [`LeaderElection`] says this control plane leads, and writes
/// only with the leader's guard: a deposed leader cannot place or take
/// over anything, even while it still believes it leads.
pub struct ClusterController {
    store: TypedStore,
    clock: Arc<dyn Clock>,
    cfg: LifecycleConfig,
    leadership: Leadership,
    /// Kept across passes: nodes are judged on this controller's clock.
    liveness: std::sync::Mutex<Liveness>,
    /// When this controller last pruned the event history.
    pruned_at: std::sync::Mutex<Option<Millis>>,
    /// How the VM watch's records are decoded.
    decoder: VmDecoder,
}

impl ClusterController {
    /// `cfg` supplies the placement and node-lease timings; its `node` is unused.
    pub fn new(
        store: TypedStore,
        clock: Arc<dyn Clock>,
        cfg: LifecycleConfig,
        election: Arc<LeaderElection>,
    ) -> Self {
        Self {
            store,
            clock,
            cfg,
            leadership: Leadership::Elected(election),
            liveness: Default::default(),
            pruned_at: Default::default(),
            decoder: VmDecoder::default(),
        }
    }

    /// The same duties for a process that is alone on its store (SQLite):
    /// it always leads, and compare-and-swap alone fences its writes.
    pub fn sole(store: TypedStore, clock: Arc<dyn Clock>, cfg: LifecycleConfig) -> Self {
        Self {
            store,
            clock,
            cfg,
            leadership: Leadership::Sole,
            liveness: Default::default(),
            pruned_at: Default::default(),
            decoder: VmDecoder::default(),
        }
    }

    /// This controller decodes VM records with `decoder` (shared with the
    /// nodes of its store in this process, [`crate::vm_decodes`]).
    pub fn decoding_with(mut self, decoder: VmDecoder) -> Self {
        self.decoder = decoder;
        self
    }

    /// The election this controller follows; `None` for a sole one.
    pub fn elected_by(&self) -> Option<&Arc<LeaderElection>> {
        match &self.leadership {
            Leadership::Elected(election) => Some(election),
            Leadership::Sole => None,
        }
    }

    /// The election of an elected controller.
    ///
    /// # Panics
    /// On a [`ClusterController::sole`] one, which has none.
    pub fn election(&self) -> &Arc<LeaderElection> {
        self.elected_by()
            .expect("election() of a sole cluster controller")
    }

    fn is_leader(&self) -> bool {
        self.elected_by().is_none_or(|e| e.is_leader())
    }

    fn who(&self) -> String {
        self.elected_by()
            .map_or_else(|| "sole".to_string(), |e| e.id().to_string())
    }

    /// One pass, if this control plane leads: takes over the VMs of lost
    /// nodes, then places every VM without a node. `Ok(None)`: not the
    /// leader, nothing was done. A `GuardLost` error means leadership was
    /// lost under it: the election is told, and nothing more is written.
    pub async fn reconcile(&self) -> Result<Option<PassReport>, StoreError> {
        if !self.is_leader() {
            return Ok(None);
        }
        let mut state = ClusterState::read(&self.store, Vec::new(), Liveness::default()).await?;
        self.reconcile_over(&mut state).await
    }

    /// One pass over `state`, whose VMs are the caller's to keep current
    /// (the leader's watch does); the nodes are read afresh, as node
    /// liveness is judged by their heartbeats.
    async fn reconcile_over(
        &self,
        state: &mut ClusterState,
    ) -> Result<Option<PassReport>, StoreError> {
        let Some(election) = self.elected_by() else {
            return self.pass(Fence::Cas, state).await.map(Some);
        };
        let Some(guard) = election.guard() else {
            return Ok(None);
        };
        match self.pass(Fence::Guard(&guard), state).await {
            Err(e @ StoreError::GuardLost { .. }) => {
                election.lost(&guard);
                Err(e)
            }
            other => other.map(Some),
        }
    }

    async fn pass(
        &self,
        fence: Fence<'_>,
        state: &mut ClusterState,
    ) -> Result<PassReport, StoreError> {
        let looked = ClockReading::now(&*self.clock);
        let now = looked.wall;
        state.nodes = ClusterState::read_nodes(&self.store).await?;
        state.liveness = {
            let mut liveness = self.liveness.lock().expect("liveness lock");
            let vms = &state.vms;
            liveness.observe_with(&state.nodes, |node| vms.newest_instance_on(node), looked);
            liveness.clone()
        };
        state.looked_at = looked;
        let mut report = PassReport {
            next_at: looked.mono.plus(MAX_IDLE_MS),
            placed: 0,
            unplaced: 0,
            taken_over: 0,
        };
        if let Some(at) = state.liveness.next_loss(looked.mono, &self.cfg) {
            report.next_at = report.next_at.min(at);
        }
        let lost = state.liveness.lost(None, looked.mono, &self.cfg);
        tracing::trace!(?lost, liveness = ?state.liveness, "nodes judged");
        if !lost.is_empty() {
            report.taken_over = take_over(&self.store, state, &lost, now, fence).await?;
        }
        state.lost = lost;
        place_all(&self.store, state, &self.cfg, fence, &mut report).await?;
        report_undecodable(&self.store, now, fence).await;
        self.prune_events_if_due(now, fence).await?;
        Ok(report)
    }

    /// Keeps the event history within its caps, once per
    /// [`PRUNE_INTERVAL_MS`] (on this controller's clock). Only a lost
    /// guard is an error of the pass; anything else waits for the next.
    async fn prune_events_if_due(&self, now: Millis, fence: Fence<'_>) -> Result<(), StoreError> {
        {
            let mut pruned_at = self.pruned_at.lock().expect("pruned_at lock");
            if pruned_at.is_some_and(|at| now < at + PRUNE_INTERVAL_MS) {
                return Ok(());
            }
            *pruned_at = Some(now);
        }
        match prune_events(&self.store, self.cfg.event_retention, fence).await {
            Ok(_) => Ok(()),
            Err(err @ StoreError::GuardLost { .. }) => Err(err),
            Err(err) => {
                tracing::warn!(%err, "pruning events failed; trying again later");
                Ok(())
            }
        }
    }

    /// Runs until `stop` turns true: idle while following, passing while
    /// leading. Store outages are retried, never fatal.
    pub async fn run(&self, mut stop: watch::Receiver<bool>) {
        // A sole controller leads for good: its sender lives as long as
        // the loop, so `changed` never fires.
        let (_always, sole) = watch::channel(true);
        let mut leading = self.elected_by().map_or(sole, |e| e.subscribe());
        let retry = Duration::from_millis(self.cfg.retry_ms);
        while !*stop.borrow() {
            if !self.is_leader() {
                tokio::select! {
                    _ = leading.changed() => {}
                    _ = tokio::time::sleep(retry) => {}
                    _ = stop.changed() => {}
                }
                continue;
            }
            if let Err(err) = self.lead(&mut stop, &mut leading).await {
                tracing::warn!(%err, "cluster controller pass failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(retry) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    }

    /// Passes while leading: when a VM without a node appears, when a node
    /// changes while some VM could not be placed, and when the next pass is
    /// due (the next node-lease deadline). Returns once not leading.
    async fn lead(
        &self,
        stop: &mut watch::Receiver<bool>,
        leading: &mut watch::Receiver<bool>,
    ) -> Result<(), StoreError> {
        let raw = self.store.raw();
        // One list, then the watch from just after it keeps the VMs current.
        let (vms, revision) = ClusterState::read_vms(&self.store).await?;
        let mut vm_watch = raw.watch(VMS_PREFIX, revision + 1).await?;
        let mut node_watch = raw.watch(NODES_PREFIX, revision + 1).await?;
        let mut state = ClusterState {
            nodes: Vec::new(),
            vms: vms.decoding_with(self.decoder.clone()),
            liveness: Liveness::default(),
            looked_at: ClockReading::default(),
            lost: Vec::new(),
        };
        tracing::info!(candidate = %self.who(), vms = state.vms.len(),
            "leading: placing VMs, watching for lost nodes");
        let mut due = self.clock.mono();
        let mut unplaced = 0;
        loop {
            if self.clock.mono() >= due {
                let Some(report) = self.reconcile_over(&mut state).await? else {
                    tracing::info!(candidate = %self.who(), "no longer leading");
                    return Ok(());
                };
                if report.placed + report.taken_over > 0 {
                    tracing::debug!(?report, "cluster pass");
                }
                due = report.next_at;
                unplaced = report.unplaced;
            }
            let wait = due.since(self.clock.mono());
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
                event = vm_watch.next() => match event {
                    Some(Ok(event)) => {
                        // With what has arrived meanwhile: a pass after
                        // each event of a burst of creates placed them one
                        // by one, and fell behind the store for good.
                        let mut next = Some(Ok(event));
                        let mut taken = 0;
                        while let Some(event) = next {
                            let event = event?;
                            state.vms.apply(&event);
                            if state.needs_pass(&event) {
                                due = self.clock.mono();
                            }
                            taken += 1;
                            next = (taken < ARRIVED_AT_ONCE)
                                .then(|| vm_watch.next_now())
                                .flatten()
                                .flatten();
                        }
                    }
                    Some(Err(err)) => return Err(err),
                    None => return Ok(()),
                },
                event = node_watch.next() => match event {
                    // A node that changed (joined, became ready, uncordoned)
                    // may take a VM that could not be placed.
                    Some(Ok(_)) => {
                        if unplaced > 0 {
                            due = self.clock.mono();
                        }
                    }
                    Some(Err(err)) => return Err(err),
                    None => return Ok(()),
                },
                _ = leading.changed() => {
                    if !self.is_leader() {
                        return Ok(());
                    }
                }
                _ = stop.changed() => {
                    if *stop.borrow() {
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// Runs a control plane's election and cluster controller until `stop`
/// turns true; the election resigns at the end.
pub async fn run_control_plane(cluster: Arc<ClusterController>, stop: watch::Receiver<bool>) {
    match cluster.elected_by().cloned() {
        Some(election) => {
            tokio::join!(election.run(stop.clone()), cluster.run(stop));
        }
        None => cluster.run(stop).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::node_key;
    use crate::schedule::tests::vm;
    use keel_api::ManualClock;
    use keel_store::memory::MemoryStore;
    use std::collections::BTreeSet;

    async fn revisions_of_vms(store: &TypedStore) -> BTreeSet<Revision> {
        let (vms, _) = store.list::<VirtualMachine>(VMS_PREFIX).await.unwrap();
        assert!(vms.iter().all(|(_, e)| e.value.status.node.is_some()));
        vms.iter().map(|(_, e)| e.revision).collect()
    }

    /// A burst of new VMs is placed 32 to a store write.
    #[tokio::test]
    async fn placements_are_written_thirty_two_at_a_time() {
        let store = TypedStore::new(Arc::new(MemoryStore::new()));
        let clock = Arc::new(ManualClock::new(1_000_000));
        let mut node = Node::new("n1");
        node.status.last_heartbeat = clock.now_ms();
        store.create(&node_key("n1"), &node).await.unwrap();
        for i in 0..70 {
            let name = format!("vm-{i:02}");
            store
                .create(&vm_key(&name), &vm(&name, None))
                .await
                .unwrap();
        }
        let cluster = ClusterController::sole(store.clone(), clock, LifecycleConfig::default());
        let report = cluster.reconcile().await.unwrap().expect("a pass");
        assert_eq!((report.placed, report.unplaced), (70, 0));
        assert_eq!(
            revisions_of_vms(&store).await.len(),
            3,
            "70 placements are three writes"
        );
    }

    /// A batch with one record changed since it was read: that one is
    /// refused, the others are written.
    #[tokio::test]
    async fn a_stale_placement_fails_alone() {
        let store = TypedStore::new(Arc::new(MemoryStore::new()));
        let mut chunk = Vec::new();
        for name in ["a", "b", "c"] {
            let read_at = store.create(&vm_key(name), &vm(name, None)).await.unwrap();
            chunk.push((vm(name, Some("n1")), read_at));
        }
        let b = store
            .get::<VirtualMachine>(&vm_key("b"))
            .await
            .unwrap()
            .unwrap();
        store
            .update(&vm_key("b"), &b.value, b.revision)
            .await
            .unwrap();
        let outcomes = write_placements(&store, Fence::Cas, chunk).await;
        let results: Vec<(&str, bool)> = outcomes
            .iter()
            .map(|(v, r)| (v.name.as_str(), r.is_ok()))
            .collect();
        assert_eq!(results, [("a", true), ("b", false), ("c", true)]);
        assert!(matches!(outcomes[1].1, Err(StoreError::Conflict { .. })));
        for (name, placed) in [("a", true), ("b", false), ("c", true)] {
            let v = store
                .get::<VirtualMachine>(&vm_key(name))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(v.value.status.node.is_some(), placed, "{name}");
        }
    }
}
