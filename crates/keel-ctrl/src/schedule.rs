//! Where a VM's next instance goes, and which nodes are lost. Pure
//! decisions over the stored view, written by the cluster controller: by
//! compare-and-swap on the VM record when it is alone on its store
//! (`keel serve` on SQLite), fenced by its leader key too when elected
//! among control planes (see `cluster_controller`).

use std::collections::HashMap;

use keel_api::capacity::human_mib;
use keel_api::{Demand, Node, VirtualMachine};

use crate::config::LifecycleConfig;
use crate::node_lease::liveness::{ClockReading, Liveness};
use crate::placement_rules::{preference, ruled_out, RulesLoad};

/// How many VMs each node owns: counted once per view and kept up to date
/// by the writer, so choosing a node costs O(nodes) and placing N VMs is
/// linear in N, not quadratic (a 10,000-VM burst would otherwise count
/// 10,000 VMs for each of them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeLoad {
    owned: HashMap<String, usize>,
    /// What the VMs that take a node's capacity take together
    /// (`VirtualMachine::allocated_on`).
    allocated: HashMap<String, Demand>,
    /// The groups and ports on each node (`placement_rules`).
    rules: RulesLoad,
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
        for node in vm.allocated_on().into_iter().chain(vm.incoming_on()) {
            let sum = self.allocated.entry(node.to_string()).or_default();
            *sum = sum.plus(vm.spec.demand());
        }
        self.rules.add(vm);
    }

    /// Stops counting `vm` (as it was counted by [`NodeLoad::add`]).
    pub fn remove(&mut self, vm: &VirtualMachine) {
        if let Some(count) = vm.owner_node().and_then(|n| self.owned.get_mut(n)) {
            *count = count.saturating_sub(1);
        }
        for node in vm.allocated_on().into_iter().chain(vm.incoming_on()) {
            if let Some(sum) = self.allocated.get_mut(node) {
                *sum = sum.minus(vm.spec.demand());
            }
        }
        self.rules.remove(vm);
    }

    /// The groups and ports on each node.
    pub fn rules(&self) -> &RulesLoad {
        &self.rules
    }

    /// What the VMs on `node` other than `vm` itself take of its capacity.
    pub fn allocated_besides(&self, node: &str, vm: &VirtualMachine) -> Demand {
        let all = self.allocated.get(node).copied().unwrap_or_default();
        let own = vm.allocated_on().into_iter().chain(vm.incoming_on());
        own.filter(|n| *n == node)
            .fold(all, |left, _| left.minus(vm.spec.demand()))
    }

    /// What the VMs on `node` take of its capacity.
    pub fn allocated(&self, node: &str) -> Demand {
        self.allocated.get(node).copied().unwrap_or_default()
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
/// `spec.node`, not `exclude`, where its disks, images and hardware are,
/// allowed by its placement rules and the ports held there
/// (`placement_rules`), and with room for its CPUs and memory beside what
/// is allocated there; those its preferences favour first (apart from its
/// preferred anti-affinity group, with its affinity group), then the
/// least filled (the larger of its CPU and memory shares once the VM is
/// on it), then the fewest VMs, then by name. A node that reports no
/// capacity (an older agent) is judged by count alone.
pub fn candidate_nodes(
    vm: &VirtualMachine,
    nodes: &[Node],
    load: &NodeLoad,
    exclude: Option<&str>,
    liveness: &Liveness,
    now: ClockReading,
    cfg: &LifecycleConfig,
) -> Vec<String> {
    let demand = vm.spec.demand();
    let mut candidates: Vec<((usize, bool), u64, usize, String)> =
        eligible_nodes(vm, nodes, exclude, liveness, now, cfg)
            .filter(|n| ruled_out(vm, n, &load.rules).is_none())
            .filter_map(|n| {
                let share = match &n.status.capacity {
                    None => 0,
                    Some(cap) => {
                        let used = load.allocated_besides(&n.name, vm);
                        if !cap.fits(used, demand) {
                            return None;
                        }
                        cap.share_permille(used.plus(demand))
                    }
                };
                Some((
                    preference(vm, n, &load.rules),
                    share,
                    load.on_node_besides(&n.name, vm),
                    n.name.clone(),
                ))
            })
            .collect();
    candidates.sort();
    candidates.into_iter().map(|(_, _, _, name)| name).collect()
}

/// Nodes `vm` may go to now by everything but capacity.
fn eligible_nodes<'a>(
    vm: &'a VirtualMachine,
    nodes: &'a [Node],
    exclude: Option<&'a str>,
    liveness: &'a Liveness,
    now: ClockReading,
    cfg: &'a LifecycleConfig,
) -> impl Iterator<Item = &'a Node> + 'a {
    nodes
        .iter()
        .filter(move |n| liveness.ready(n, now, cfg) && !n.cordoned && n.drain.is_none())
        .filter(move |n| Some(n.name.as_str()) != exclude)
        .filter(|n| vm.spec.node.as_deref().is_none_or(|pin| pin == n.name))
        // Only where its disks are: a VM never boots on blank disks.
        .filter(|n| {
            vm.status
                .disk_home
                .as_ref()
                .is_none_or(|h| *h == n.disk_home())
        })
        .filter(move |n| sees_the_same_images(vm, n, nodes))
        // Only where its QEMU provides the VM's machine type and CPU.
        .filter(|n| crate::hardware::node_lacks(vm, n).is_none())
}

/// Why `vm` fits on none of `eligible` (each has too little free), as the
/// record says it: what it needs and what each has.
fn no_room(vm: &VirtualMachine, eligible: &[&Node], load: &NodeLoad) -> String {
    let demand = vm.spec.demand();
    let each: Vec<String> = eligible
        .iter()
        .filter_map(|n| {
            let free = n.status.capacity?.free(load.allocated_besides(&n.name, vm));
            Some(format!(
                "{} {} CPU, {}",
                n.name,
                free.cpus,
                human_mib(free.memory_mib)
            ))
        })
        .collect();
    format!(
        "no node has {} CPU and {} free for VM {} (free: {})",
        demand.cpus,
        human_mib(demand.memory_mib),
        vm.name,
        each.join("; ")
    )
}

/// The VMs of the live domains on `node` that no record allocates there:
/// the target of a migration given up and the source of one handed over,
/// each until it is ended (`vm_of` finds a domain's VM). A domain of a VM
/// with no record is not counted (it is ended as a stray soon).
pub fn unaccounted<'a>(
    domains: &[keel_hv::DomainInfo],
    node: &str,
    vm_of: impl Fn(&str) -> Option<&'a VirtualMachine>,
) -> Vec<&'a VirtualMachine> {
    domains
        .iter()
        .filter(|d| !d.state.is_exited())
        .filter_map(|d| {
            let vm = vm_of(&d.vm)?;
            let recorded = vm.allocated_on() == Some(node)
                && vm
                    .status
                    .instance
                    .as_ref()
                    .is_some_and(|i| i.id == d.instance);
            let incoming = vm.incoming_on() == Some(node)
                && vm
                    .status
                    .eviction
                    .as_ref()
                    .and_then(|e| e.migration_target.as_deref())
                    == Some(d.instance.as_str());
            (!recorded && !incoming).then_some(vm)
        })
        .collect()
}

/// Whether `vm` can start on `node` as far as its placement rules, the
/// ports held there and its capacity go, beside what is allocated there
/// and the VMs of live domains no record accounts for (`unaccounted`,
/// sized by their specs, in the same groups, holding the same ports):
/// `Err` with the reason if not.
pub fn room_on(
    vm: &VirtualMachine,
    node: &Node,
    load: &NodeLoad,
    unaccounted: &[&VirtualMachine],
) -> Result<(), String> {
    if let Some(why) = ruled_out(vm, node, &load.rules) {
        return Err(format!("node {why}"));
    }
    let mut live = RulesLoad::default();
    for other in unaccounted.iter().filter(|o| o.name != vm.name) {
        live.add_on(other, &node.name);
    }
    if let Some(why) = ruled_out(vm, node, &live) {
        return Err(format!("node {why} (a domain being ended)"));
    }
    let Some(cap) = node.status.capacity else {
        return Ok(());
    };
    let extra = unaccounted
        .iter()
        .map(|v| v.spec.demand())
        .fold(Demand::default(), Demand::plus);
    let used = load.allocated_besides(&node.name, vm).plus(extra);
    let demand = vm.spec.demand();
    if cap.fits(used, demand) {
        return Ok(());
    }
    let free = cap.free(used);
    Err(format!(
        "node {} has {} CPU and {} free; VM {} needs {} CPU and {}",
        node.name,
        free.cpus,
        human_mib(free.memory_mib),
        vm.name,
        demand.cpus,
        human_mib(demand.memory_mib)
    ))
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
    if let Some(node) = candidate_nodes(vm, nodes, load, None, liveness, now, cfg).first() {
        next.status.node = Some(node.clone());
        next.status.message = None;
        return (next != *vm).then_some(next);
    }
    // None: why, told apart only now (a burst places most VMs above).
    next.status.message = Some(why_no_node(vm, nodes, load, None, liveness, now, cfg));
    (next != *vm).then_some(next)
}

/// Why no node (but `exclude`) can take `vm` now, as its record or its
/// eviction says it: the nodes without room, the placement rule each
/// other node breaks, or that no eligible node is left at all. Asked only
/// once [`candidate_nodes`] found none, so a burst of placements never
/// pays for the reasons.
pub fn why_no_node(
    vm: &VirtualMachine,
    nodes: &[Node],
    load: &NodeLoad,
    exclude: Option<&str>,
    liveness: &Liveness,
    now: ClockReading,
    cfg: &LifecycleConfig,
) -> String {
    let mut allowed: Vec<&Node> = Vec::new();
    let mut why: Vec<String> = Vec::new();
    for n in eligible_nodes(vm, nodes, exclude, liveness, now, cfg) {
        match ruled_out(vm, n, &load.rules) {
            None => allowed.push(n),
            Some(reason) => why.push(reason),
        }
    }
    if !allowed.is_empty() {
        no_room(vm, &allowed, load)
    } else if !why.is_empty() {
        format!(
            "no node may take VM {} by its placement rules: {}",
            vm.name,
            why.join("; ")
        )
    } else {
        format!(
            "no ready, uncordoned node{} can run VM {}{}{}{}",
            exclude.map(|n| format!(" but {n}")).unwrap_or_default(),
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
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use keel_api::{Millis, PowerState, RunPolicy, VmSpec};

    /// A small VM, placed on `node` or not (shared with other modules' tests).
    pub(crate) fn vm(name: &str, node: Option<&str>) -> VirtualMachine {
        let mut v = VirtualMachine::new(
            name,
            VmSpec {
                memory_mib: 64,
                disks: vec![],
                run_policy: RunPolicy::Manual,
                ..keel_testkit::spec::vm_spec()
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

    fn sized(name: &str, node: Option<&str>, cpus: u32, memory_mib: u64) -> VirtualMachine {
        let mut v = vm(name, node);
        v.spec.cpus = cpus;
        v.spec.memory_mib = memory_mib;
        v
    }

    /// A node offering `cpus` vCPUs and `memory_mib` (no reserve, no
    /// overcommit).
    fn offering(name: &str, cpus: u32, memory_mib: u64) -> Node {
        let mut n = node(name, 100_000);
        n.status.capacity = Some(
            keel_api::CapacityPolicy {
                reserve_memory_mib: 0,
                cpu_overcommit: 1.0,
                memory_overcommit: 1.0,
            }
            .offered(keel_api::HostResources { cpus, memory_mib }),
        );
        n
    }

    fn candidates(v: &VirtualMachine, nodes: &[Node], vms: &[VirtualMachine]) -> Vec<String> {
        candidate_nodes(
            v,
            nodes,
            &NodeLoad::of(vms),
            None,
            &Liveness::default(),
            at(100_000),
            &LifecycleConfig::default(),
        )
    }

    #[test]
    fn a_vm_goes_only_where_it_fits_and_the_least_filled_first() {
        // n1: 16 GiB with 12 placed; n2: 8 GiB with 2 placed (more VMs).
        let nodes = [offering("n1", 8, 16_384), offering("n2", 8, 8_192)];
        let vms = [
            sized("big", Some("n1"), 1, 12_288),
            sized("s1", Some("n2"), 1, 1_024),
            sized("s2", Some("n2"), 1, 1_024),
        ];
        // By share (n1 75 % + 1 GiB, n2 25 % + 1 GiB), not by count.
        assert_eq!(
            candidates(&sized("new", None, 1, 1_024), &nodes, &vms),
            ["n2", "n1"]
        );
        // 6 GiB fits only on n2; 7 GiB nowhere.
        assert_eq!(
            candidates(&sized("new", None, 1, 6_144), &nodes, &vms),
            ["n2"]
        );
        assert!(candidates(&sized("new", None, 1, 7_168), &nodes, &vms).is_empty());
        // CPUs count as well.
        assert_eq!(
            candidates(&sized("new", None, 7, 512), &nodes, &vms),
            ["n1"]
        );
        // A VM already on n1 does not count against itself.
        let mut moving = vms[0].clone();
        moving.spec.memory_mib = 16_384;
        assert_eq!(candidates(&moving, &nodes, &vms), ["n1"]);
        // A node that reports no capacity is judged by count alone.
        let old = [node("old", 100_000), offering("n2", 8, 8_192)];
        assert_eq!(
            candidates(&sized("new", None, 64, 1 << 20), &old, &vms),
            ["old"]
        );
    }

    #[test]
    fn a_stopped_vm_takes_nothing_and_a_running_one_its_instance_node() {
        let nodes = [offering("n1", 2, 2_048)];
        let mut stopped = sized("off", Some("n1"), 2, 2_048);
        stopped.spec.power = PowerState::Stopped;
        let load = NodeLoad::of([&stopped]);
        assert_eq!(load.allocated("n1"), keel_api::Demand::default());
        assert_eq!(
            candidates(&sized("new", None, 2, 2_048), &nodes, &[stopped]),
            ["n1"]
        );
        let mut running = sized("on", None, 1, 1_024);
        running.status.instance = Some(keel_api::Instance::new("on-1", "n1", 0));
        let mut load = NodeLoad::of([&running]);
        assert_eq!(load.allocated("n1").memory_mib, 1_024);
        let mut gone = running.clone();
        gone.status.instance = None;
        gone.spec.power = PowerState::Stopped;
        load.replace(&running, &gone);
        assert_eq!(load.allocated("n1"), keel_api::Demand::default());
    }

    /// The record `placement` gives `v` among `nodes` (all ready).
    fn place(v: &VirtualMachine, nodes: &[Node], load: &NodeLoad) -> VirtualMachine {
        placement(
            v,
            nodes,
            load,
            &Liveness::default(),
            at(100_000),
            &LifecycleConfig::default(),
        )
        .expect("a change")
    }

    #[test]
    fn nothing_fits_says_what_each_node_has_free() {
        let nodes = [offering("n1", 4, 4_096), offering("n2", 4, 8_192)];
        let vms = [
            sized("a", Some("n1"), 1, 512),
            sized("b", Some("n2"), 1, 1_024),
        ];
        let big = sized("huge", None, 2, 12_288);
        let next = place(&big, &nodes, &NodeLoad::of(&vms));
        assert_eq!(next.status.node, None);
        assert_eq!(
            next.status.message.as_deref(),
            Some("no node has 2 CPU and 12 GiB free for VM huge (free: n1 3 CPU, 3.5 GiB; n2 3 CPU, 7 GiB)")
        );
        let node = &nodes[0];
        let none = [];
        assert!(room_on(
            &sized("fits", None, 3, 3_584),
            node,
            &NodeLoad::of(&vms),
            &none
        )
        .is_ok());
        let why = room_on(
            &sized("not", None, 1, 3_585),
            node,
            &NodeLoad::of(&vms),
            &none,
        )
        .unwrap_err();
        assert!(why.contains("node n1 has 3 CPU and 3.5 GiB free"), "{why}");
    }

    #[test]
    fn members_of_a_required_group_go_to_distinct_nodes_or_wait() {
        let nodes = [
            offering("n1", 4, 4_096),
            offering("n2", 4, 4_096),
            offering("n3", 4, 4_096),
        ];
        let member = |name: &str| {
            let mut v = sized(name, None, 1, 512);
            v.spec.placement.anti_affinity = Some(keel_api::AntiAffinity {
                group: "web".into(),
                preferred: false,
            });
            v
        };
        let mut placed: Vec<VirtualMachine> = Vec::new();
        for name in ["w1", "w2", "w3"] {
            let next = place(&member(name), &nodes, &NodeLoad::of(&placed));
            placed.push(next);
        }
        let mut on: Vec<_> = placed
            .iter()
            .map(|v| v.status.node.clone().unwrap())
            .collect();
        on.sort();
        assert_eq!(on, ["n1", "n2", "n3"]);
        let fourth = place(&member("w4"), &nodes, &NodeLoad::of(&placed));
        assert_eq!(fourth.status.node, None);
        let why = fourth.status.message.unwrap();
        assert!(
            why.starts_with("no node may take VM w4 by its placement rules: n1 has VM w"),
            "{why}"
        );
        // Preferred: apart where it can, then shared rather than waiting.
        let mut soft = member("w4");
        soft.spec
            .placement
            .anti_affinity
            .as_mut()
            .unwrap()
            .preferred = true;
        let others: Vec<VirtualMachine> = placed
            .iter()
            .cloned()
            .map(|mut v| {
                v.spec.placement.anti_affinity.as_mut().unwrap().preferred = true;
                v
            })
            .collect();
        assert_eq!(candidates(&soft, &nodes, &others).len(), 3);
        // A start on a node holding a member is refused with the reason.
        let why = room_on(&member("w4"), &nodes[0], &NodeLoad::of(&placed), &[]).unwrap_err();
        assert!(why.contains("of anti-affinity group web"), "{why}");
        // So is one beside a member's domain that no record accounts for
        // (a handed-over source not yet ended).
        let mut moved = placed[0].clone();
        moved.status.node = Some("n2".into());
        let placed = [moved.clone()];
        assert!(room_on(&member("w4"), &nodes[0], &NodeLoad::of(&placed), &[]).is_ok());
        let why = room_on(&member("w4"), &nodes[0], &NodeLoad::of(&placed), &[&moved]).unwrap_err();
        assert!(why.contains("(a domain being ended)"), "{why}");
    }

    #[test]
    fn a_node_selector_is_required() {
        let mut nodes = [offering("n1", 4, 4_096), offering("n2", 4, 4_096)];
        nodes[1].labels.insert("disk".into(), "ssd".into());
        let mut v = sized("db", None, 1, 512);
        v.spec.placement.node_selector = [("disk".to_string(), "ssd".to_string())].into();
        assert_eq!(candidates(&v, &nodes, &[]), ["n2"]);
        nodes[1].labels.clear();
        let next = place(&v, &nodes, &NodeLoad::default());
        assert_eq!(
            next.status.message.as_deref(),
            Some("no node may take VM db by its placement rules: n1 lacks label disk=ssd; n2 lacks label disk=ssd")
        );
    }
}
