//! Where a VM's next instance goes, and which nodes are lost. Pure
//! decisions over the stored view: in single-process mode every node agent
//! computes the same answer and the compare-and-swap on the VM record lets
//! exactly one of them write it; with a control plane only the leader
//! writes it, fenced by its leader key (see `cluster`).

use std::collections::HashMap;

use keel_api::{Node, VirtualMachine};

use crate::config::LifecycleConfig;
use crate::node_lease::liveness::{ClockReading, Liveness};

/// How many VMs each node owns: counted once per view and kept up to date
/// by the writer, so choosing a node costs O(nodes) and placing N VMs is
/// linear in N, not quadratic (a 10,000-VM burst would otherwise count
/// 10,000 VMs for each of them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeLoad {
    owned: HashMap<String, usize>,
}

impl NodeLoad {
    pub fn of<'a>(vms: impl IntoIterator<Item = &'a VirtualMachine>) -> Self {
        let mut load = Self::default();
        for vm in vms {
            load.add(vm);
        }
        load
    }

    /// Counts `vm` on its owner, if it has one.
    pub fn add(&mut self, vm: &VirtualMachine) {
        if let Some(node) = vm.owner_node() {
            *self.owned.entry(node.to_string()).or_default() += 1;
        }
    }

    /// Stops counting `vm` (as it was counted by [`NodeLoad::add`]).
    pub fn remove(&mut self, vm: &VirtualMachine) {
        if let Some(count) = vm.owner_node().and_then(|n| self.owned.get_mut(n)) {
            *count = count.saturating_sub(1);
        }
    }

    /// `before` became `after` (one VM's record rewritten).
    pub fn replace(&mut self, before: &VirtualMachine, after: &VirtualMachine) {
        self.remove(before);
        self.add(after);
    }

    /// VMs on `node` other than `vm` itself.
    pub fn on_node_besides(&self, node: &str, vm: &VirtualMachine) -> usize {
        let all = self.owned.get(node).copied().unwrap_or(0);
        all.saturating_sub(usize::from(vm.owner_node() == Some(node)))
    }
}

/// Nodes `vm` may go to now, best first: ready, not cordoned, allowed by
/// `spec.node`, not `exclude`; fewest VMs first, then by name.
pub fn candidate_nodes(
    vm: &VirtualMachine,
    nodes: &[Node],
    load: &NodeLoad,
    exclude: Option<&str>,
    liveness: &Liveness,
    now: ClockReading,
    cfg: &LifecycleConfig,
) -> Vec<String> {
    let mut candidates: Vec<(usize, String)> = nodes
        .iter()
        .filter(|n| liveness.ready(n, now, cfg) && !n.cordoned && n.drain.is_none())
        .filter(|n| Some(n.name.as_str()) != exclude)
        .filter(|n| vm.spec.node.as_deref().is_none_or(|pin| pin == n.name))
        // Only where its disks are: a VM never boots on blank disks.
        .filter(|n| {
            vm.status
                .disk_home
                .as_ref()
                .is_none_or(|h| *h == n.disk_home())
        })
        .filter(|n| sees_the_same_images(vm, n, nodes))
        // Only where its QEMU provides the VM's machine type and CPU.
        .filter(|n| crate::hardware::node_lacks(vm, n).is_none())
        .map(|n| (load.on_node_besides(&n.name, vm), n.name.clone()))
        .collect();
    candidates.sort();
    candidates.into_iter().map(|(_, name)| name).collect()
}

/// Whether `candidate` sees the images `vm` runs on: the same storage
/// identity as the node the VM is on, when that node reports one (the same
/// path alone may be another filesystem on another host). A candidate
/// reporting none (an older agent), or another, does not.
fn sees_the_same_images(vm: &VirtualMachine, candidate: &Node, nodes: &[Node]) -> bool {
    let home = vm
        .status
        .node
        .as_deref()
        .and_then(|name| nodes.iter().find(|n| n.name == name))
        .and_then(|n| n.status.storage_id.as_ref());
    home.is_none_or(|id| candidate.status.storage_id.as_ref() == Some(id))
}

/// The record an unplaced `vm` should have: on the best candidate node,
/// or with a message saying why there is none. `None`: nothing to change.
pub fn placement(
    vm: &VirtualMachine,
    nodes: &[Node],
    load: &NodeLoad,
    liveness: &Liveness,
    now: ClockReading,
    cfg: &LifecycleConfig,
) -> Option<VirtualMachine> {
    let mut next = vm.clone();
    match candidate_nodes(vm, nodes, load, None, liveness, now, cfg).first() {
        Some(node) => {
            next.status.node = Some(node.clone());
            next.status.message = None;
        }
        None => {
            next.status.message = Some(format!(
                "no ready, uncordoned node can run VM {}{}{}{}",
                vm.name,
                vm.spec
                    .node
                    .as_ref()
                    .map(|n| format!(" (pinned to {n})"))
                    .unwrap_or_default(),
                vm.status
                    .disk_home
                    .as_ref()
                    .map(|h| format!(" where its disks are ({h})"))
                    .unwrap_or_default(),
                vm.status
                    .hardware
                    .as_ref()
                    .map(|hw| format!(
                        " with machine type {} and CPU model {}",
                        hw.machine, hw.cpu_model
                    ))
                    .unwrap_or_default()
            ));
        }
    }
    (next != *vm).then_some(next)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use keel_api::{BootSpec, Millis, PowerState, RunPolicy, VmSpec};

    /// A small VM, placed on `node` or not (shared with other modules' tests).
    pub(crate) fn vm(name: &str, node: Option<&str>) -> VirtualMachine {
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
                readiness: keel_api::Readiness::Agent,
                network: Default::default(),
                cloud_init: None,
                ha: None,
                cpu_model: None,
            },
        );
        v.status.node = node.map(str::to_string);
        v
    }

    fn at(ms: Millis) -> ClockReading {
        ClockReading {
            mono: keel_api::Mono::from_origin_ms(ms),
            wall: ms,
        }
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
        let got = candidate_nodes(
            &vm("new", None),
            &nodes,
            &NodeLoad::of(&vms),
            None,
            &Liveness::default(),
            at(100_000),
            &cfg,
        );
        assert_eq!(got, ["b", "a"]);
        let got = candidate_nodes(
            &vm("new", None),
            &nodes,
            &NodeLoad::of(&vms),
            Some("b"),
            &Liveness::default(),
            at(100_000),
            &cfg,
        );
        assert_eq!(got, ["a"]);
    }

    #[test]
    fn a_vm_goes_only_where_its_disks_are() {
        let cfg = LifecycleConfig::default();
        let shared = |name: &str| {
            let mut n = node(name, 100_000);
            n.status.disk_home = Some(keel_api::DiskHome::Shared("/nfs".into()));
            n
        };
        let nodes = [
            node("a", 100_000),
            node("b", 100_000),
            shared("s1"),
            shared("s2"),
        ];
        let mut local = vm("local", None);
        local.status.disk_home = Some(keel_api::DiskHome::Node("a".into()));
        assert_eq!(
            candidate_nodes(
                &local,
                &nodes,
                &NodeLoad::default(),
                None,
                &Liveness::default(),
                at(100_000),
                &cfg
            ),
            ["a"]
        );
        assert!(candidate_nodes(
            &local,
            &nodes,
            &NodeLoad::default(),
            Some("a"),
            &Liveness::default(),
            at(100_000),
            &cfg
        )
        .is_empty());
        let mut on_nfs = vm("nfs", None);
        on_nfs.status.disk_home = Some(keel_api::DiskHome::Shared("/nfs".into()));
        assert_eq!(
            candidate_nodes(
                &on_nfs,
                &nodes,
                &NodeLoad::default(),
                None,
                &Liveness::default(),
                at(100_000),
                &cfg
            ),
            ["s1", "s2"]
        );
        // The same path, but not the same storage: s2 mounts another
        // filesystem at /nfs (or none, an older agent).
        let mut nodes = nodes;
        nodes[2].status.storage_id = Some("id-1".into());
        nodes[3].status.storage_id = Some("id-2".into());
        on_nfs.status.node = Some("s1".into());
        let targets = |nodes: &[Node]| {
            candidate_nodes(
                &on_nfs,
                nodes,
                &NodeLoad::default(),
                Some("s1"),
                &Liveness::default(),
                at(100_000),
                &cfg,
            )
        };
        assert!(targets(&nodes).is_empty());
        nodes[3].status.storage_id = None;
        assert!(targets(&nodes).is_empty());
        nodes[3].status.storage_id = Some("id-1".into());
        assert_eq!(targets(&nodes), ["s2"]);
        // A new VM has no home yet: anywhere.
        assert_eq!(
            candidate_nodes(
                &vm("new", None),
                &nodes,
                &NodeLoad::default(),
                None,
                &Liveness::default(),
                at(100_000),
                &cfg
            )
            .len(),
            4
        );
    }
}
