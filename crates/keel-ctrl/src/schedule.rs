//! Where a VM's next instance goes. Every node agent computes the same
//! answer from the same stored view; the compare-and-swap on the VM record
//! lets exactly one of them write it.

use keel_api::{Millis, Node, VirtualMachine};

use crate::vm_decide::LifecycleConfig;

/// A node is ready while its heartbeat is fresh.
pub fn node_ready(node: &Node, now: Millis, cfg: &LifecycleConfig) -> bool {
    now.saturating_sub(node.status.last_heartbeat) <= cfg.node_ready_ms
}

/// Nodes `vm` may go to now, best first: ready, not cordoned, allowed by
/// `spec.node`, not `exclude`; fewest VMs first, then by name.
pub fn candidate_nodes(
    vm: &VirtualMachine,
    nodes: &[Node],
    vms: &[VirtualMachine],
    exclude: Option<&str>,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Vec<String> {
    let mut candidates: Vec<(usize, String)> = nodes
        .iter()
        .filter(|n| node_ready(n, now, cfg) && !n.cordoned && n.drain.is_none())
        .filter(|n| Some(n.name.as_str()) != exclude)
        .filter(|n| vm.spec.node.as_deref().is_none_or(|pin| pin == n.name))
        .map(|n| {
            let load = vms
                .iter()
                .filter(|v| v.name != vm.name && v.owner_node() == Some(n.name.as_str()))
                .count();
            (load, n.name.clone())
        })
        .collect();
    candidates.sort();
    candidates.into_iter().map(|(_, name)| name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{BootSpec, PowerState, RunPolicy, VmSpec};

    fn vm(name: &str, node: Option<&str>) -> VirtualMachine {
        let mut v = VirtualMachine::new(
            name,
            VmSpec {
                cpus: 1,
                memory_mib: 64,
                disks: vec![],
                boot: BootSpec::default(),
                run_policy: RunPolicy::Manual,
                power: PowerState::Running,
                restart_generation: 0,
                stop_grace_period_s: 60,
                node: None,
            },
        );
        v.status.node = node.map(str::to_string);
        v
    }

    fn node(name: &str, heartbeat: Millis) -> Node {
        let mut n = Node::new(name);
        n.status.last_heartbeat = heartbeat;
        n
    }

    #[test]
    fn least_loaded_ready_uncordoned_node_wins() {
        let cfg = LifecycleConfig::default();
        let mut cordoned = node("c", 100_000);
        cordoned.cordoned = true;
        let nodes = [
            node("a", 100_000),
            node("b", 100_000),
            cordoned,
            node("stale", 1),
        ];
        let vms = [vm("x", Some("a"))];
        let got = candidate_nodes(&vm("new", None), &nodes, &vms, None, 100_000, &cfg);
        assert_eq!(got, ["b", "a"]);
        let got = candidate_nodes(&vm("new", None), &nodes, &vms, Some("b"), 100_000, &cfg);
        assert_eq!(got, ["a"]);
    }
}
