//! Back home after maintenance (`keel node uncordon NODE --return`, as
//! Incus' `cluster restore`): a drain that moves a VM off a node records
//! that node on the VM (`VmStatus::drained_from`), in the same write that
//! moves it; the return asks each VM so recorded to live-migrate back,
//! through the same bounded migrations as `keel vm migrate`.

use crate::{DrainedFrom, Millis, ValidationError, VirtualMachine};

impl VirtualMachine {
    /// Records that the drain of `node` (requested at `drain_requested_at`)
    /// moved this VM away.
    pub fn mark_drained_from(&mut self, node: &str, drain_requested_at: Millis) {
        self.status.drained_from = Some(DrainedFrom {
            node: node.to_string(),
            drain_requested_at,
        });
    }

    /// Asks for the VM's migration back to `node`, which a drain moved it
    /// away from, and forgets the mark (the return is asked once). `Err`
    /// naming why not (not moved from `node`, not running, a migration in
    /// flight); the mark is forgotten as well unless it names another node,
    /// since the VM cannot be brought back by a live migration now.
    pub fn request_return(&mut self, node: &str, now: Millis) -> Result<(), ValidationError> {
        if self
            .status
            .drained_from
            .as_ref()
            .is_none_or(|d| d.node != node)
        {
            return Err(ValidationError::new(
                "status.drained_from",
                format!("VM {} was not moved off node {node} by a drain", self.name),
            ));
        }
        self.status.drained_from = None;
        if self
            .status
            .instance
            .as_ref()
            .is_some_and(|i| i.node == node)
        {
            return Ok(());
        }
        self.request_migration(Some(node), now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running_on(node: &str) -> VirtualMachine {
        let spec = serde_json::from_value(serde_json::json!({"cpus": 1, "memory_mib": 64}))
            .expect("a minimal spec");
        let mut vm = VirtualMachine::new("v", spec);
        vm.status.instance = Some(crate::Instance::new("v-2", node, 0));
        vm.status.node = Some(node.into());
        vm.status.phase = crate::Phase::Running;
        vm
    }

    #[test]
    fn a_return_asks_once_and_only_for_the_drained_node() {
        let mut vm = running_on("b");
        assert_eq!(
            vm.request_return("a", 5).unwrap_err().field,
            "status.drained_from"
        );
        vm.mark_drained_from("a", 1);
        assert!(vm.request_return("c", 5).is_err());
        assert!(vm.status.drained_from.is_some());
        vm.request_return("a", 5).unwrap();
        assert_eq!(
            vm.pending_migration().and_then(|m| m.to.clone()).as_deref(),
            Some("a")
        );
        assert!(vm.status.drained_from.is_none());
        assert!(vm.request_return("a", 6).is_err());
    }

    #[test]
    fn a_stopped_vm_is_not_returned_and_forgets_the_mark() {
        let mut vm = running_on("b");
        vm.status.instance = None;
        vm.status.phase = crate::Phase::Stopped;
        vm.mark_drained_from("a", 1);
        assert_eq!(vm.request_return("a", 5).unwrap_err().field, "status.phase");
        assert!(vm.status.drained_from.is_none());
        assert!(vm.pending_migration().is_none());
    }
}
