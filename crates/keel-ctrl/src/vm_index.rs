//! Every VM record, indexed the ways cluster-level duties look them up:
//! the VMs without a node, the VMs of each node, how many each node has,
//! and the newest instance each node recorded.
//!
//! A pass that lists the whole store and then scans every VM for every
//! node made 10,000 VMs cost 10,000 decodes per pass and a pass per
//! create. The index is built from one list and then kept current by the
//! watch opened right after it (a reflector, in kube-rs' words), so a pass
//! costs what it acts on: the unplaced VMs and those of lost nodes.
//!
//! The index may lag the store by the events not yet delivered. That is
//! safe because nothing is written from it without the revision it was
//! read at: a write over a stale entry is refused (`Conflict`) and the VM
//! is looked at again once its newer record arrives.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

use keel_api::{Millis, Node, VirtualMachine};
use keel_store::{Entry, Revision, WatchEvent};

use crate::keys::{name_of, NODES_PREFIX, VMS_PREFIX};
use crate::schedule::NodeLoad;

#[derive(Debug, Clone, PartialEq)]
pub struct IndexedVm {
    pub vm: VirtualMachine,
    /// The record's `mod_revision`: the token its next write is made under.
    pub revision: Revision,
}

#[derive(Debug, Clone, Default)]
pub struct VmIndex {
    vms: HashMap<String, IndexedVm>,
    /// Names of VMs with no node (neither an instance nor a placement).
    unplaced: BTreeSet<String>,
    /// Names of the VMs each node owns (`VirtualMachine::owner_node`).
    by_owner: HashMap<String, BTreeSet<String>>,
    load: NodeLoad,
    /// The newest `created_at` of an instance recorded on each node, as
    /// ever seen here: a node that records a new instance is alive.
    newest_instance: HashMap<String, Millis>,
    /// VMs removed here, with the revision of their deletion, until the
    /// watch has delivered that revision: an event of an earlier write
    /// still on its way (this process's own, taken in at once and echoed
    /// by the watch after its delete) must not bring the VM back, or its
    /// deletion, disks first, runs again, perhaps under a VM created
    /// since with that name.
    tombstones: HashMap<String, Revision>,
}

impl VmIndex {
    pub fn of(entries: impl IntoIterator<Item = (VirtualMachine, Revision)>) -> Self {
        let mut index = Self::default();
        for (vm, revision) in entries {
            index.upsert(vm, revision);
        }
        index
    }

    /// Takes in `vm` as written at `revision`, unless a newer record of it
    /// is already here (an event for a write this process already took in
    /// arrives after it).
    pub fn upsert(&mut self, vm: VirtualMachine, revision: Revision) {
        if let Some(old) = self.vms.get(&vm.name) {
            if old.revision > revision {
                return;
            }
        }
        match self.tombstones.get(&vm.name) {
            // Written before the deletion this index has taken in.
            Some(deleted) if *deleted >= revision => return,
            // Created again since.
            Some(_) => {
                self.tombstones.remove(&vm.name);
            }
            None => {}
        }
        self.forget(&vm.name);
        if let Some(inst) = &vm.status.instance {
            let newest = self.newest_instance.entry(inst.node.clone()).or_default();
            *newest = (*newest).max(inst.created_at);
        }
        match vm.owner_node() {
            Some(node) => {
                self.by_owner
                    .entry(node.to_string())
                    .or_default()
                    .insert(vm.name.clone());
            }
            None => {
                self.unplaced.insert(vm.name.clone());
            }
        }
        self.load.add(&vm);
        self.vms.insert(vm.name.clone(), IndexedVm { vm, revision });
    }

    /// The VM named `name` is gone as of `revision` (deleted, or its record
    /// can no longer be read: a list skips those too).
    pub fn remove(&mut self, name: &str, revision: Revision) {
        if self.vms.get(name).is_some_and(|v| v.revision > revision) {
            return;
        }
        self.forget(name);
        let deleted = self.tombstones.entry(name.to_string()).or_default();
        *deleted = (*deleted).max(revision);
    }

    fn forget(&mut self, name: &str) {
        let Some(old) = self.vms.remove(name) else {
            return;
        };
        self.load.remove(&old.vm);
        match old.vm.owner_node() {
            Some(node) => {
                if let Some(names) = self.by_owner.get_mut(node) {
                    names.remove(name);
                    if names.is_empty() {
                        self.by_owner.remove(node);
                    }
                }
            }
            None => {
                self.unplaced.remove(name);
            }
        }
    }

    /// Applies one change from the watch on [`VMS_PREFIX`]. A record that
    /// does not decode leaves the index, as a list would skip it.
    pub fn apply(&mut self, event: &WatchEvent) {
        let Some(name) = name_of(VMS_PREFIX, event.key()) else {
            return;
        };
        match event {
            WatchEvent::Put(entry) => {
                match serde_json::from_slice::<VirtualMachine>(&entry.value) {
                    Ok(vm) if vm.name == name => self.upsert(vm, entry.mod_revision),
                    _ => self.remove(name, entry.mod_revision),
                }
            }
            WatchEvent::Deleted { revision, .. } => self.remove(name, *revision),
        }
        // The watch delivers in revision order: nothing older than this
        // event is still to come from it.
        if !self.tombstones.is_empty() {
            let delivered = event.revision();
            self.tombstones.retain(|_, deleted| *deleted > delivered);
        }
    }

    pub fn get(&self, name: &str) -> Option<&IndexedVm> {
        self.vms.get(name)
    }

    pub fn len(&self) -> usize {
        self.vms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.vms.is_empty()
    }

    /// Names of the VMs without a node, in name order.
    pub fn unplaced(&self) -> impl Iterator<Item = &str> {
        self.unplaced.iter().map(String::as_str)
    }

    /// The VMs `node` owns, in name order.
    pub fn owned_by<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a IndexedVm> + 'a {
        self.by_owner
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|name| self.vms.get(name))
    }

    pub fn load(&self) -> &NodeLoad {
        &self.load
    }

    /// The newest instance ever seen recorded on `node` (0 for none).
    pub fn newest_instance_on(&self, node: &str) -> Millis {
        self.newest_instance.get(node).copied().unwrap_or(0)
    }
}

/// The VM records ([`VmIndex`]) and node records, shared between the
/// reader of their watches, which keeps them current, and reconciles,
/// which read them. Empty (`None`) until the first list and again from a
/// broken watch until the next list: a reader then reads the store for
/// itself rather than trust records that miss changes.
#[derive(Debug, Default)]
pub struct ClusterReflector {
    state: Mutex<Option<Reflected>>,
}

#[derive(Debug)]
struct Reflected {
    vms: VmIndex,
    nodes: BTreeMap<String, Node>,
}

impl ClusterReflector {
    /// Starts over from a list of every VM record and every node record
    /// (undecodable ones are left out, as a typed list leaves them out).
    pub fn reset(&self, vms: &[Entry], nodes: &[Entry]) {
        let vms = VmIndex::of(vms.iter().filter_map(|e| {
            let name = name_of(VMS_PREFIX, &e.key)?;
            let vm: VirtualMachine = serde_json::from_slice(&e.value).ok()?;
            (vm.name == name).then_some((vm, e.mod_revision))
        }));
        let nodes = nodes
            .iter()
            .filter_map(|e| decoded_node(&e.key, &e.value))
            .map(|n| (n.name.clone(), n))
            .collect();
        *self.lock() = Some(Reflected { vms, nodes });
    }

    /// Takes in one change from the watch on VM or node records.
    pub fn apply(&self, event: &WatchEvent) {
        let mut state = self.lock();
        let Some(state) = state.as_mut() else {
            return;
        };
        if let Some(name) = name_of(NODES_PREFIX, event.key()) {
            let node = match event {
                WatchEvent::Put(e) => decoded_node(&e.key, &e.value),
                WatchEvent::Deleted { .. } => None,
            };
            match node {
                Some(node) => state.nodes.insert(name.to_string(), node),
                None => state.nodes.remove(name),
            };
        } else {
            state.vms.apply(event);
        }
    }

    /// This process's own write of `vm` at `revision`: taken in now, so
    /// its next look does not wait for the watch to bring it back.
    pub fn written(&self, vm: &VirtualMachine, revision: Revision) {
        if let Some(state) = self.lock().as_mut() {
            state.vms.upsert(vm.clone(), revision);
        }
    }

    /// This process deleted `name`'s record at `revision`.
    pub fn deleted(&self, name: &str, revision: Revision) {
        if let Some(state) = self.lock().as_mut() {
            state.vms.remove(name, revision);
        }
    }

    /// The watch broke: changes may be missed until the next list.
    pub fn lost(&self) {
        *self.lock() = None;
    }

    /// `read` of the current VM index; `None` while there is none.
    pub fn read<R>(&self, read: impl FnOnce(&VmIndex) -> R) -> Option<R> {
        self.lock().as_ref().map(|s| read(&s.vms))
    }

    /// Every node record, in name order; `None` while there is no index.
    pub fn nodes(&self) -> Option<Vec<Node>> {
        self.lock()
            .as_ref()
            .map(|s| s.nodes.values().cloned().collect())
    }

    /// `name`'s record (`Some(None)`: there is none); `None` while there
    /// is no index.
    pub fn node(&self, name: &str) -> Option<Option<Node>> {
        self.lock().as_ref().map(|s| s.nodes.get(name).cloned())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Reflected>> {
        self.state.lock().expect("cluster reflector lock")
    }
}

fn decoded_node(key: &str, value: &[u8]) -> Option<Node> {
    let name = name_of(NODES_PREFIX, key)?;
    let node: Node = serde_json::from_slice(value).ok()?;
    (node.name == name).then_some(node)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::tests::vm;

    fn put(v: &VirtualMachine, revision: Revision) -> WatchEvent {
        WatchEvent::Put(Entry {
            key: format!("{VMS_PREFIX}{}", v.name),
            value: serde_json::to_vec(v).unwrap(),
            create_revision: 1,
            mod_revision: revision,
        })
    }

    /// This process wrote a VM (rev 10: deletion requested, taken in at
    /// once) and deleted it (rev 11); the watch then brings the echo of
    /// rev 10. The VM stays gone, or its deletion would run again; a VM
    /// created again under its name (rev 12) is taken in, and so is any
    /// later write once the watch has delivered the deletion.
    #[test]
    fn a_late_event_of_an_earlier_write_does_not_bring_a_deleted_vm_back() {
        let mut index = VmIndex::default();
        let mut deleting = vm("a", Some("n1"));
        deleting.deletion_requested_at = Some(1);
        index.upsert(deleting.clone(), 10);
        index.remove("a", 11);
        for stale in [9, 10] {
            index.apply(&put(&deleting, stale));
            assert!(index.get("a").is_none(), "rev {stale} brought it back");
        }
        assert_eq!(index.owned_by("n1").count(), 0);
        assert_eq!(index.tombstones.get("a"), Some(&11));
        // The watch delivers the deletion itself: nothing older can come.
        index.apply(&WatchEvent::Deleted {
            key: format!("{VMS_PREFIX}a"),
            revision: 11,
        });
        assert!(index.tombstones.is_empty());
        let again = vm("a", Some("n2"));
        index.apply(&put(&again, 12));
        assert_eq!(index.get("a").map(|v| v.revision), Some(12));
        assert_eq!(index.owned_by("n2").count(), 1);

        // Created again before the watch caught up: the newer record wins
        // over the tombstone, the older echo still does not.
        let mut index = VmIndex::default();
        index.upsert(deleting.clone(), 10);
        index.remove("a", 11);
        index.upsert(again.clone(), 12);
        index.apply(&put(&deleting, 10));
        assert_eq!(index.get("a").map(|v| v.revision), Some(12));
        assert!(index.tombstones.is_empty());
    }

    /// Whatever order writes arrive in, the index equals one built from
    /// scratch out of the newest record of each VM: unplaced set, owners,
    /// and load all agree with a recount.
    #[test]
    fn the_index_always_equals_a_rebuild_from_the_newest_records() {
        let mut index = VmIndex::default();
        let mut newest: HashMap<String, (VirtualMachine, Revision)> = HashMap::new();
        let steps: Vec<(VirtualMachine, Revision)> = vec![
            (vm("a", None), 1),
            (vm("b", Some("n1")), 2),
            (vm("a", Some("n2")), 4),
            // A stale event for a write already taken in: ignored.
            (vm("a", None), 3),
            (vm("c", Some("n1")), 5),
            (vm("b", None), 6),
        ];
        for (v, rev) in steps {
            index.apply(&put(&v, rev));
            let keep = newest.get(&v.name).is_none_or(|(_, r)| *r <= rev);
            if keep {
                newest.insert(v.name.clone(), (v, rev));
            }
            let rebuilt = VmIndex::of(newest.values().cloned());
            assert_eq!(index.load(), rebuilt.load());
            assert_eq!(
                index.unplaced().collect::<Vec<_>>(),
                rebuilt.unplaced().collect::<Vec<_>>()
            );
            for node in ["n1", "n2"] {
                let names = |i: &VmIndex| -> Vec<String> {
                    i.owned_by(node).map(|v| v.vm.name.clone()).collect()
                };
                assert_eq!(names(&index), names(&rebuilt), "owned by {node}");
            }
        }
        assert_eq!(index.unplaced().collect::<Vec<_>>(), ["b"]);
        assert_eq!(index.get("a").unwrap().revision, 4);

        // A deletion older than the record it would remove is ignored.
        index.apply(&WatchEvent::Deleted {
            key: format!("{VMS_PREFIX}c"),
            revision: 4,
        });
        assert!(index.get("c").is_some());
        index.apply(&WatchEvent::Deleted {
            key: format!("{VMS_PREFIX}c"),
            revision: 7,
        });
        assert!(index.get("c").is_none());
        assert_eq!(index.owned_by("n1").count(), 0);
        assert_eq!(index.load().on_node_besides("n2", &vm("x", None)), 1);

        // A record that no longer decodes leaves the index, as a list skips it.
        index.apply(&WatchEvent::Put(Entry {
            key: format!("{VMS_PREFIX}a"),
            value: b"not json".to_vec(),
            create_revision: 1,
            mod_revision: 8,
        }));
        assert!(index.get("a").is_none());
        assert_eq!(index.len(), 1);
    }
}
