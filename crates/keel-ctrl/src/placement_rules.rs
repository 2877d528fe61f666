//! The placement rules of `keel_api::placement`, and published host
//! ports, over the stored view: which nodes they rule out for a VM, and
//! how its preferences order the rest. Pure decisions, kept up to date by
//! the writer of the scheduler's `NodeLoad` as VM records change.
//!
//! A VM takes part where it takes capacity (`VirtualMachine::allocated_on`
//! and `incoming_on`): where it runs, where it is placed to run next, and
//! where a migration of it is reserved. So a migration in flight keeps
//! its VM's group and ports on both nodes until it ends.

use std::collections::{BTreeMap, HashMap};

use keel_api::{Node, PortForward, VirtualMachine};

/// Which VMs take part in each group and hold which ports, by node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RulesLoad {
    /// (node, anti-affinity group) → its members there, and whether each
    /// requires the group apart.
    apart: HashMap<(String, String), BTreeMap<String, bool>>,
    /// (node, affinity group) → how many of its members are there.
    together: HashMap<(String, String), usize>,
    /// node → the published ports held there, and by which VM.
    ports: HashMap<String, Vec<(String, PortForward)>>,
}

fn nodes_of(vm: &VirtualMachine) -> impl Iterator<Item = &str> {
    vm.allocated_on().into_iter().chain(vm.incoming_on())
}

impl RulesLoad {
    pub fn add(&mut self, vm: &VirtualMachine) {
        for node in nodes_of(vm) {
            self.add_on(vm, node);
        }
    }

    /// Counts `vm` on `node`, where a live domain of it is.
    pub fn add_on(&mut self, vm: &VirtualMachine, node: &str) {
        let rules = &vm.spec.placement;
        if let Some(anti) = &rules.anti_affinity {
            self.apart
                .entry((node.to_string(), anti.group.clone()))
                .or_default()
                .insert(vm.name.clone(), !anti.preferred);
        }
        if let Some(group) = &rules.affinity {
            *self
                .together
                .entry((node.to_string(), group.clone()))
                .or_default() += 1;
        }
        if !vm.spec.network.publish.is_empty() {
            let held = self.ports.entry(node.to_string()).or_default();
            held.extend(
                vm.spec
                    .network
                    .publish
                    .iter()
                    .map(|p| (vm.name.clone(), p.clone())),
            );
        }
    }

    /// Stops counting `vm` (as it was counted by [`RulesLoad::add`]).
    pub fn remove(&mut self, vm: &VirtualMachine) {
        let rules = &vm.spec.placement;
        for node in nodes_of(vm) {
            if let Some(anti) = &rules.anti_affinity {
                let key = (node.to_string(), anti.group.clone());
                if let Some(members) = self.apart.get_mut(&key) {
                    members.remove(&vm.name);
                    if members.is_empty() {
                        self.apart.remove(&key);
                    }
                }
            }
            if let Some(group) = &rules.affinity {
                if let Some(n) = self.together.get_mut(&(node.to_string(), group.clone())) {
                    *n = n.saturating_sub(1);
                }
            }
            if let Some(held) = self.ports.get_mut(node) {
                held.retain(|(holder, _)| *holder != vm.name);
            }
        }
    }

    /// The other members of `vm`'s anti-affinity group on `node`, and
    /// whether each requires the group apart.
    fn apart_besides<'a>(
        &'a self,
        node: &str,
        vm: &'a VirtualMachine,
    ) -> impl Iterator<Item = (&'a String, bool)> + 'a {
        vm.spec
            .placement
            .anti_affinity
            .as_ref()
            .and_then(|anti| self.apart.get(&(node.to_string(), anti.group.clone())))
            .into_iter()
            .flatten()
            .filter(move |(name, _)| **name != vm.name)
            .map(|(name, required)| (name, *required))
    }

    /// Members of `vm`'s affinity group on `node`, itself not counted.
    fn together_besides(&self, node: &str, vm: &VirtualMachine) -> usize {
        let Some(group) = &vm.spec.placement.affinity else {
            return 0;
        };
        let all = self
            .together
            .get(&(node.to_string(), group.clone()))
            .copied()
            .unwrap_or(0);
        all.saturating_sub(usize::from(nodes_of(vm).any(|n| n == node)))
    }
}

/// Why `vm` may not go to `node` by its rules, or by the ports others
/// hold there: a node lacking a label its selector requires, a member of
/// its anti-affinity group there when either of them requires the group
/// apart, or a VM there holding a host port it publishes. `None`: allowed.
pub fn ruled_out(vm: &VirtualMachine, node: &Node, load: &RulesLoad) -> Option<String> {
    let unmet = vm.spec.placement.unmet_by(&node.labels);
    if !unmet.is_empty() {
        return Some(format!("{} lacks label {}", node.name, unmet.join(", ")));
    }
    let own_required = vm.spec.placement.required_apart().is_some();
    if let Some((member, _)) = load
        .apart_besides(&node.name, vm)
        .find(|(_, required)| own_required || *required)
    {
        let group = vm
            .spec
            .placement
            .anti_affinity
            .as_ref()
            .map(|a| a.group.as_str())
            .unwrap_or_default();
        return Some(format!(
            "{} has VM {member} of anti-affinity group {group}",
            node.name
        ));
    }
    let held = load.ports.get(&node.name).into_iter().flatten();
    for (holder, port) in held.filter(|(holder, _)| *holder != vm.name) {
        if vm.spec.network.publish.iter().any(|p| p.clashes_with(port)) {
            return Some(format!(
                "{} has VM {holder} holding host port {}",
                node.name,
                port.listener()
            ));
        }
    }
    None
}

/// How well `node` suits `vm`'s preferences, lower first: the members of
/// its (preferred) anti-affinity group there, then whether no member of
/// its affinity group is (when the group has any member somewhere).
pub fn preference(vm: &VirtualMachine, node: &Node, load: &RulesLoad) -> (usize, bool) {
    let apart = load.apart_besides(&node.name, vm).count();
    let together = load.together_besides(&node.name, vm) > 0;
    (apart, !together)
}

/// The VM of `others` whose published port `spec` would clash with where
/// they must share a host: one node for all (`one_host`), or both pinned
/// to the same node. `None`: no clash (in a cluster the scheduler keeps
/// holders of one port on distinct nodes).
pub fn port_clash<'a>(
    name: &str,
    spec: &keel_api::VmSpec,
    others: impl IntoIterator<Item = &'a VirtualMachine>,
    one_host: bool,
) -> Option<(&'a VirtualMachine, PortForward)> {
    others
        .into_iter()
        .filter(|o| o.name != name && o.deletion_requested_at.is_none())
        .filter(|o| one_host || (spec.node.is_some() && o.spec.node == spec.node))
        .find_map(|o| {
            let held = o
                .spec
                .network
                .publish
                .iter()
                .find(|q| spec.network.publish.iter().any(|p| p.clashes_with(q)))?;
            Some((o, held.clone()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::AntiAffinity;

    /// A small VM that wants to run, placed on `node` or not.
    fn vm(name: &str, node: Option<&str>) -> VirtualMachine {
        let spec = serde_json::from_value(serde_json::json!({"cpus": 1, "memory_mib": 64}))
            .expect("a minimal spec");
        let mut v = VirtualMachine::new(name, spec);
        v.status.node = node.map(str::to_string);
        v
    }

    fn member(name: &str, on: &str, group: &str, preferred: bool) -> VirtualMachine {
        let mut v = vm(name, Some(on));
        v.spec.placement.anti_affinity = Some(AntiAffinity {
            group: group.into(),
            preferred,
        });
        v
    }

    fn load(vms: &[VirtualMachine]) -> RulesLoad {
        let mut load = RulesLoad::default();
        vms.iter().for_each(|v| load.add(v));
        load
    }

    #[test]
    fn a_required_group_keeps_its_members_apart() {
        let a = Node::new("a");
        let b = Node::new("b");
        let placed = [member("w1", "a", "web", false)];
        let w2 = member("w2", "b", "web", false);
        assert_eq!(
            ruled_out(&w2, &a, &load(&placed)).as_deref(),
            Some("a has VM w1 of anti-affinity group web")
        );
        assert_eq!(ruled_out(&w2, &b, &load(&placed)), None);
        // Itself does not count; another group does not either.
        assert_eq!(ruled_out(&placed[0], &a, &load(&placed)), None);
        assert_eq!(
            ruled_out(&member("d1", "b", "db", false), &a, &load(&placed)),
            None
        );
        // A preferred member may not join a required one either: the
        // required member's rule would be broken.
        let soft = member("w3", "b", "web", true);
        assert!(ruled_out(&soft, &a, &load(&placed)).is_some());
        // Two preferred members may share, but apart comes first.
        let placed = [member("w1", "a", "web", true)];
        assert_eq!(ruled_out(&soft, &a, &load(&placed)), None);
        assert!(preference(&soft, &a, &load(&placed)) > preference(&soft, &b, &load(&placed)));
        // A stopped member takes no part.
        let mut off = member("w1", "a", "web", false);
        off.spec.power = keel_api::PowerState::Stopped;
        assert_eq!(ruled_out(&w2, &a, &load(&[off])), None);
        // Removing is the inverse of adding.
        let mut l = load(&[placed[0].clone()]);
        l.remove(&placed[0]);
        assert_eq!(l, RulesLoad::default());
    }

    #[test]
    fn a_migration_in_flight_holds_both_nodes() {
        let mut moving = member("w1", "a", "web", false);
        moving.status.instance = Some(keel_api::Instance::new("w1-1", "a", 0));
        let mut ev = keel_api::Eviction::submitting(0, 0, None, true);
        ev.migration = Some("w1-m1".into());
        ev.migration_target_node = Some("b".into());
        moving.status.eviction = Some(ev);
        let l = load(&[moving]);
        let w2 = member("w2", "c", "web", false);
        assert!(ruled_out(&w2, &Node::new("a"), &l).is_some());
        assert!(ruled_out(&w2, &Node::new("b"), &l).is_some());
        assert_eq!(ruled_out(&w2, &Node::new("c"), &l), None);
    }

    #[test]
    fn a_selector_requires_every_label() {
        let mut v = vm("v", None);
        v.spec.placement.node_selector = [("zone".to_string(), "eu".to_string())].into();
        let mut n = Node::new("n1");
        assert_eq!(
            ruled_out(&v, &n, &RulesLoad::default()).as_deref(),
            Some("n1 lacks label zone=eu")
        );
        n.labels.insert("zone".into(), "eu".into());
        assert_eq!(ruled_out(&v, &n, &RulesLoad::default()), None);
    }

    #[test]
    fn affinity_prefers_a_node_with_a_member() {
        let mut v = vm("v", None);
        v.spec.placement.affinity = Some("app".into());
        let mut other = vm("o", Some("b"));
        other.spec.placement.affinity = Some("app".into());
        let l = load(&[other]);
        assert!(preference(&v, &Node::new("b"), &l) < preference(&v, &Node::new("a"), &l));
        assert_eq!(ruled_out(&v, &Node::new("a"), &l), None);
    }

    #[test]
    fn a_published_port_is_held_on_its_node() {
        let mut holder = vm("h", Some("a"));
        holder.spec.network.publish = vec!["127.0.0.1:2400:22".parse().unwrap()];
        let mut v = vm("v", None);
        v.spec.network.publish = vec!["0.0.0.0:2400:80".parse().unwrap()];
        let l = load(std::slice::from_ref(&holder));
        assert_eq!(
            ruled_out(&v, &Node::new("a"), &l).as_deref(),
            Some("a has VM h holding host port 127.0.0.1:2400/tcp")
        );
        assert_eq!(ruled_out(&v, &Node::new("b"), &l), None);
        v.spec.network.publish = vec!["127.0.0.1:2400:22/udp".parse().unwrap()];
        assert_eq!(ruled_out(&v, &Node::new("a"), &l), None);
        // On one host, or pinned to one node, a second holder is refused.
        v.spec.network.publish = vec!["127.0.0.1:2400:22".parse().unwrap()];
        let others = [holder];
        assert_eq!(
            port_clash("v", &v.spec, &others, true).map(|(o, _)| o.name.as_str()),
            Some("h")
        );
        assert!(port_clash("v", &v.spec, &others, false).is_none());
        assert!(port_clash("h", &v.spec, &others, true).is_none());
    }
}
