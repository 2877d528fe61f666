//! Which VM records a node's agent acts on: the per-node view's filter.
//!
//! Every agent watches every VM record (its index keeps the cluster's
//! allocation for placement and the start guard), but a look at a VM that
//! is another node's does nothing (`VmController::reconcile` returns at
//! once). Waking every agent for every VM's change made 50 nodes do 50
//! looks per write, each cloning the record. So a change wakes a node's
//! VM controller only when the record, before *or* after the change,
//! concerns the node: a VM leaving the node (migrated, handed back to the
//! scheduler, deleted) still reaches it through its old record.

use std::sync::Arc;

use keel_api::VirtualMachine;
use keel_store::node_shards::MembersOf;

/// The rule for one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConcern {
    /// `None`: every record concerns it (a watcher that is no node's).
    node: Option<String>,
}

impl Default for NodeConcern {
    fn default() -> Self {
        Self::everything()
    }
}

impl NodeConcern {
    /// The rule of `node`'s agent. A VM without a node is the cluster
    /// controller's to place, so it concerns no node until placed.
    pub fn of_node(node: &str) -> Self {
        Self {
            node: Some(node.to_string()),
        }
    }

    /// Every record concerns the watcher.
    pub fn everything() -> Self {
        Self { node: None }
    }

    /// The node judged for, if any.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// Whether `vm`, as recorded, is this node's to act on: its instance
    /// or its placement is here, or a migration reserved here is coming in.
    pub fn concerns(&self, vm: &VirtualMachine) -> bool {
        let Some(node) = self.node.as_deref() else {
            return true;
        };
        match vm.owner_node() {
            Some(owner) if owner == node => true,
            Some(_) | None => vm.incoming_on() == Some(node),
        }
    }

    /// Whether a change from `before` to `after` (`None`: no record, or
    /// none this watcher could read) concerns this node. A record it
    /// cannot judge (neither side known) concerns it: a wake too many
    /// costs one look, a wake too few could leave an instance unfenced.
    pub fn change_concerns(
        &self,
        before: Option<&VirtualMachine>,
        after: Option<&VirtualMachine>,
    ) -> bool {
        if before.is_none() && after.is_none() {
            return true;
        }
        before.is_some_and(|vm| self.concerns(vm)) || after.is_some_and(|vm| self.concerns(vm))
    }
}

/// The nodes `vm`, as recorded, concerns ([`NodeConcern::concerns`]
/// holds for exactly these): its owner, and a migration's target while
/// reserved.
pub fn nodes_of(vm: &VirtualMachine) -> Vec<String> {
    vm.owner_node()
        .into_iter()
        .chain(vm.incoming_on())
        .map(str::to_string)
        .collect()
}

/// The nodes a stored VM record concerns, for the store's per-node copies
/// (`keel_store::node_shards`): a node's agent then watches only its own.
/// A record whose status does not decode concerns none (a node it left
/// still sees it leave; its reader reports it).
///
/// Only the status fields [`nodes_of`] reads are decoded ([`RecordNodes`]):
/// every record write judges its record's nodes, and decoding the whole
/// record for them was a sixth of an agent's CPU at scale. A record whose
/// spec this build cannot read but whose status names a node keeps that
/// node's copy, so the node's agent reads it and reports it rather than
/// seeing it vanish.
pub fn record_nodes() -> MembersOf {
    Arc::new(|bytes: &[u8]| {
        serde_json::from_slice::<RecordNodes>(bytes)
            .map(|record| record.nodes())
            .unwrap_or_default()
    })
}

/// What of a stored `VirtualMachine` says which nodes it concerns, under
/// the same field names; everything else is skipped unread.
#[derive(serde::Deserialize)]
struct RecordNodes {
    #[serde(default)]
    status: StatusNodes,
}

#[derive(serde::Deserialize, Default)]
struct StatusNodes {
    #[serde(default)]
    instance: Option<InstanceNode>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    eviction: Option<EvictionTarget>,
}

#[derive(serde::Deserialize)]
struct InstanceNode {
    node: String,
}

#[derive(serde::Deserialize)]
struct EvictionTarget {
    #[serde(default)]
    migration: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    migration_target_node: Option<String>,
}

impl RecordNodes {
    /// [`nodes_of`] of the record: its owner, and a reserved migration's
    /// target. `VirtualMachine::incoming_on` leaves out a target that is
    /// the node the VM is allocated on, which is then its owner too: the
    /// set is the same without it.
    fn nodes(self) -> Vec<String> {
        let StatusNodes {
            instance,
            node,
            eviction,
        } = self.status;
        let owner = match instance {
            Some(inst) => Some(inst.node),
            None => node,
        };
        let incoming = eviction
            .filter(|ev| ev.migration.is_some())
            .and_then(|ev| ev.migration_target_node);
        let mut nodes: Vec<String> = owner.into_iter().collect();
        nodes.extend(incoming.filter(|target| !nodes.contains(target)));
        nodes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::tests::vm;

    #[test]
    fn a_node_is_concerned_by_its_own_vms_and_those_leaving_or_coming() {
        let n1 = NodeConcern::of_node("n1");
        let here = vm("a", Some("n1"));
        let there = vm("a", Some("n2"));
        let unplaced = vm("a", None);
        assert!(n1.concerns(&here));
        assert!(!n1.concerns(&there));
        assert!(!n1.concerns(&unplaced));
        assert!(NodeConcern::everything().concerns(&there));

        // Moving off the node (to another, back to the scheduler, deleted)
        // reaches it through the old record; moving between two others
        // does not.
        assert!(n1.change_concerns(Some(&here), Some(&there)));
        assert!(n1.change_concerns(Some(&here), Some(&unplaced)));
        assert!(n1.change_concerns(Some(&here), None));
        assert!(n1.change_concerns(Some(&there), Some(&here)));
        assert!(!n1.change_concerns(Some(&there), Some(&vm("a", Some("n3")))));
        assert!(!n1.change_concerns(None, Some(&there)));
        // Nothing known either side: looked at rather than risked.
        assert!(n1.change_concerns(None, None));
    }

    /// The target of a migration reserved on n1 is woken by the source's
    /// changes while the reservation holds.
    #[test]
    fn an_incoming_migration_concerns_its_target_node() {
        let mut leaving = vm("a", Some("n2"));
        leaving.status.eviction = Some(
            serde_json::from_value(serde_json::json!({
                "drain_requested_at": 1,
                "phase": "Submitting",
                "started_at": 1,
                "migration": "m1",
                "migration_target_node": "n1",
            }))
            .expect("an eviction"),
        );
        assert_eq!(leaving.incoming_on(), Some("n1"));
        assert!(NodeConcern::of_node("n1").concerns(&leaving));
        assert!(!NodeConcern::of_node("n3").concerns(&leaving));
        assert_eq!(nodes_of(&leaving), vec!["n2", "n1"]);
    }

    /// The store copies a record to exactly the nodes it concerns.
    #[test]
    fn a_record_is_copied_to_the_nodes_it_concerns() {
        let members = record_nodes();
        for (vm, nodes) in [(vm("a", Some("n1")), vec!["n1"]), (vm("a", None), vec![])] {
            let bytes = serde_json::to_vec(&vm).expect("encodes");
            assert_eq!(members(&bytes), nodes);
            for node in ["n1", "n2"] {
                assert_eq!(
                    NodeConcern::of_node(node).concerns(&vm),
                    nodes.contains(&node)
                );
            }
        }
        assert!(members(b"not a record").is_empty());
    }

    /// `vm` with `status` fields set from JSON, as a stored record has them.
    fn with_status(vm: &VirtualMachine, status: serde_json::Value) -> VirtualMachine {
        let mut record = serde_json::to_value(vm).expect("encodes");
        for (field, value) in status.as_object().expect("an object") {
            record["status"][field] = value.clone();
        }
        serde_json::from_value(record).expect("a record")
    }

    /// The copies' nodes, judged from the status alone, are the nodes the
    /// whole record concerns, for every way a record names a node.
    #[test]
    fn a_records_nodes_are_judged_from_its_status_alone_as_from_the_whole_record() {
        let members = record_nodes();
        let instance = |node: &str| serde_json::json!({"id": "a-1", "node": node, "created_at": 1});
        let eviction = |migration: Option<&str>, target: Option<&str>| {
            serde_json::json!({
                "drain_requested_at": 1, "phase": "Submitting", "started_at": 1,
                "migration": migration, "migration_target_node": target,
            })
        };
        let running = {
            let mut vm = vm("a", None);
            vm.spec.run_policy = keel_api::RunPolicy::AlwaysOn;
            vm
        };
        let cases = [
            with_status(&running, serde_json::json!({})),
            with_status(&running, serde_json::json!({"node": "n1"})),
            with_status(&running, serde_json::json!({"instance": instance("n1")})),
            // An instance's node is the owner, not the placement.
            with_status(
                &running,
                serde_json::json!({"node": "n2", "instance": instance("n1")}),
            ),
            with_status(&vm("a", Some("n1")), serde_json::json!({"instance": null})),
            // A reserved migration's target, and one not reserved (yet, or any more).
            with_status(
                &running,
                serde_json::json!({"instance": instance("n1"), "eviction": eviction(Some("m1"), Some("n2"))}),
            ),
            with_status(
                &running,
                serde_json::json!({"instance": instance("n1"), "eviction": eviction(None, Some("n2"))}),
            ),
            with_status(
                &running,
                serde_json::json!({"instance": instance("n1"), "eviction": eviction(Some("m1"), None)}),
            ),
            // A target that is the VM's own node, with an instance and without.
            with_status(
                &running,
                serde_json::json!({"instance": instance("n1"), "eviction": eviction(Some("m1"), Some("n1"))}),
            ),
            with_status(
                &running,
                serde_json::json!({"node": "n1", "eviction": eviction(Some("m1"), Some("n1"))}),
            ),
            // Stopped, placed, with a target on its placement (not allocated there).
            with_status(
                &vm("a", Some("n1")),
                serde_json::json!({"eviction": eviction(Some("m1"), Some("n1"))}),
            ),
        ];
        for vm in cases {
            let mut whole: Vec<String> = nodes_of(&vm);
            whole.sort();
            whole.dedup();
            let mut judged = members(&serde_json::to_vec(&vm).expect("encodes"));
            judged.sort();
            assert_eq!(judged, whole, "{:?}", vm.status);
        }
    }

    /// A record whose spec this build cannot read stays with the node its
    /// status names: its agent reads it and reports it, where a record
    /// judged to concern no node would vanish from that node's view.
    #[test]
    fn a_record_with_an_unreadable_spec_stays_with_its_node() {
        let mut record = serde_json::to_value(vm("a", Some("n1"))).expect("encodes");
        record["spec"] = serde_json::json!("not a spec");
        let bytes = serde_json::to_vec(&record).expect("encodes");
        assert!(serde_json::from_slice::<VirtualMachine>(&bytes).is_err());
        assert_eq!(record_nodes()(&bytes), vec!["n1"]);
        // A status that cannot be read names no node.
        record["status"] = serde_json::json!({"node": 7});
        assert!(record_nodes()(&serde_json::to_vec(&record).expect("encodes")).is_empty());
    }
}
