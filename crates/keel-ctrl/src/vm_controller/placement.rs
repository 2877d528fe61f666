//! Where a VM goes, as this node's controller sees it (the cluster
//! controller places; every node checks there is room on it before a
//! start): the cluster view a decision needs, and the room check.

use crate::cluster_controller::ClusterState;
use crate::keys::{migration_key, node_key, MIGRATIONS_PREFIX};
use crate::node_lease::liveness::ClockReading;
use crate::schedule::candidate_nodes;
use crate::view::ClusterView;
use crate::vm_index::VmIndex;
use keel_api::{EvictionPhase, Migration, Node, VirtualMachine};
use keel_store::StoreError;

use super::VmController;

impl VmController {
    /// This node's drain and, while draining, the VM's migration and the
    /// nodes it could move to.
    pub(super) async fn cluster_view(
        &self,
        vm: &VirtualMachine,
    ) -> Result<ClusterView, StoreError> {
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
        let (targets, no_target, drain_evictions_waiting) = match self.vm_index.read_whole(around) {
            Some(found) => found,
            None => around(&*self.whole.read(&self.store, &*self.clock).await?),
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
                tracing::debug!(vm = %vm.name, err = %crate::error_chain(&err), "no domain listing for the room check");
                Vec::new()
            }
        };
        crate::own_records::no_room_on(&self.vm_index, &self.store, vm, me, &domains).await
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
}
