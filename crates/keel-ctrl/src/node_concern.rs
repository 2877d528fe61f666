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
/// A record that does not decode concerns none (a node it left still sees
/// it leave; its reader reports it).
pub fn record_nodes() -> MembersOf {
    Arc::new(|bytes: &[u8]| {
        serde_json::from_slice::<VirtualMachine>(bytes)
            .map(|vm| nodes_of(&vm))
            .unwrap_or_default()
    })
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
}
