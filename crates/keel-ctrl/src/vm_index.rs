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
use std::sync::{Arc, Mutex};

use keel_api::{Millis, Node, VirtualMachine};
use keel_store::{Entry, Revision, WatchEvent};

use crate::keys::{name_of, NODES_PREFIX, VMS_PREFIX};
use crate::node_concern::NodeConcern;
use crate::schedule::NodeLoad;
use crate::vm_decodes::VmDecoder;

#[derive(Debug, Clone, PartialEq)]
pub struct IndexedVm {
    /// Shared with the other indexes of this store in this process (see
    /// [`crate::vm_decodes`]), and cheap to move when the index grows.
    pub vm: Arc<VirtualMachine>,
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
    /// How the records the watch brings are decoded.
    decoder: VmDecoder,
}

impl VmIndex {
    pub fn of(entries: impl IntoIterator<Item = (VirtualMachine, Revision)>) -> Self {
        let entries = entries.into_iter();
        let mut index = Self::default();
        index.vms.reserve(entries.size_hint().0);
        for (vm, revision) in entries {
            index.upsert(vm, revision);
        }
        index
    }

    /// This index decodes the watch's records with `decoder`.
    pub fn decoding_with(mut self, decoder: VmDecoder) -> Self {
        self.decoder = decoder;
        self
    }

    /// Takes in `vm` as written at `revision`, unless a newer record of it
    /// is already here (an event for a write this process already took in
    /// arrives after it).
    pub fn upsert(&mut self, vm: impl Into<Arc<VirtualMachine>>, revision: Revision) {
        let vm = vm.into();
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
        if let Some(inst) = &vm.status.instance {
            match self.newest_instance.get_mut(&inst.node) {
                Some(newest) => *newest = (*newest).max(inst.created_at),
                None => {
                    self.newest_instance
                        .insert(inst.node.clone(), inst.created_at);
                }
            }
        }
        if let Some(held) = self.vms.get_mut(&vm.name) {
            // Most changes are a VM's status on the node it stays on: its
            // place in the name-ordered sets stands, and every node's
            // index takes every change, so moving it out and back in was
            // most of what a change cost (50 nodes in one process).
            if held.vm.owner_node() == vm.owner_node() {
                self.load.remove(&held.vm);
                self.load.add(&vm);
                *held = IndexedVm { vm, revision };
                return;
            }
        }
        self.forget(&vm.name);
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

    /// This process's own write of `vm` at `revision`: taken in, and handed
    /// to the readers sharing its decodes, which will find it when the
    /// watch echoes the write.
    pub fn written(&mut self, vm: VirtualMachine, revision: Revision) {
        let vm = Arc::new(vm);
        self.decoder.written(&vm, revision);
        self.upsert(vm, revision);
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
        self.apply_judged(event, |_| true);
    }

    /// [`Self::apply`], judging the change on the records it touches:
    /// whether `concerns` holds for the record held before it or the one
    /// it brings. The index holds every record that decodes, so none held
    /// before means none existed (or none anyone could act on); a record
    /// that does not decode cannot be judged and counts as concerning.
    pub fn apply_judged(
        &mut self,
        event: &WatchEvent,
        concerns: impl Fn(&VirtualMachine) -> bool,
    ) -> bool {
        let Some(name) = name_of(VMS_PREFIX, event.key()) else {
            return true;
        };
        let before = self.vms.get(name).is_some_and(|held| concerns(&held.vm));
        let brought = match event {
            WatchEvent::Put(entry) => {
                match self.decoder.decode(name, entry.mod_revision, &entry.value) {
                    Some(vm) => {
                        let judged = concerns(&vm);
                        self.upsert(vm, entry.mod_revision);
                        judged
                    }
                    None => {
                        self.remove(name, entry.mod_revision);
                        true
                    }
                }
            }
            WatchEvent::Deleted { revision, .. } => {
                self.decoder.deleted(name, *revision);
                self.remove(name, *revision);
                false
            }
        };
        // The watch delivers in revision order: nothing older than this
        // event is still to come from it.
        if !self.tombstones.is_empty() {
            let delivered = event.revision();
            self.tombstones.retain(|_, deleted| *deleted > delivered);
        }
        before || brought
    }

    /// `name`'s record, if held here.
    pub fn get(&self, name: &str) -> Option<&IndexedVm> {
        self.vms.get(name)
    }

    /// The VMs known.
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
    /// Which VM changes are handed on to wake a reconcile (the per-node
    /// view); every change is taken into the index whatever it says.
    concern: NodeConcern,
    decoder: VmDecoder,
    /// Whether it is fed only the records that concern its node (the
    /// node's view of a store with per-node copies,
    /// `keel_store::node_shards`): it then answers no question about the
    /// whole cluster.
    own_only: bool,
}

#[derive(Debug)]
struct Reflected {
    vms: VmIndex,
    nodes: BTreeMap<String, Node>,
}

impl ClusterReflector {
    /// An empty reflector whose changes wake reconciles only as `concern`
    /// says.
    pub fn judging(concern: NodeConcern) -> Self {
        Self {
            state: Mutex::default(),
            concern,
            decoder: VmDecoder::default(),
            own_only: false,
        }
    }

    /// This reflector is fed only the records that concern its node: a
    /// record missing from it may exist (read the store), and a question
    /// about the whole cluster ([`Self::read_whole`]) is not answered.
    pub fn fed_own_records_only(mut self) -> Self {
        self.own_only = true;
        self
    }

    /// Whether it holds only the records concerning its node.
    pub fn holds_own_records_only(&self) -> bool {
        self.own_only
    }

    /// This reflector decodes records with `decoder` (shared with the
    /// other readers of its store in this process).
    pub fn decoding_with(mut self, decoder: VmDecoder) -> Self {
        self.decoder = decoder;
        self
    }

    /// Starts over from a list of every VM record and every node record
    /// (undecodable ones are left out, as a typed list leaves them out).
    pub fn reset(&self, vms: &[Entry], nodes: &[Entry]) {
        let mut index = VmIndex::default().decoding_with(self.decoder.clone());
        index.vms.reserve(vms.len());
        for e in vms {
            let Some(name) = name_of(VMS_PREFIX, &e.key) else {
                continue;
            };
            if let Some(vm) = self.decoder.decode(name, e.mod_revision, &e.value) {
                index.upsert(vm, e.mod_revision);
            }
        }
        let vms = index;
        let nodes = nodes
            .iter()
            .filter_map(|e| decoded_node(&e.key, &e.value))
            .map(|n| (n.name.clone(), n))
            .collect();
        *self.lock() = Some(Reflected { vms, nodes });
    }

    /// Takes in one change from the watch on VM or node records; whether
    /// it is to be handed on to wake a reconcile. A VM's change is when
    /// its record before or after it concerns this node
    /// ([`NodeConcern::change_concerns`]); a node's change always is (its
    /// own drain wakes its VMs), and so is any change while there is no
    /// index to judge it by.
    pub fn apply(&self, event: &WatchEvent) -> bool {
        let mut state = self.lock();
        let Some(state) = state.as_mut() else {
            return true;
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
            true
        } else {
            state
                .vms
                .apply_judged(event, |vm| self.concern.concerns(vm))
        }
    }

    /// Whether the record at `key`, as listed into the index, is to be
    /// looked at by this node: any record but a VM held here that does not
    /// concern it (one that did not decode is looked at).
    pub fn listed_concerns(&self, key: &str) -> bool {
        let Some(name) = name_of(VMS_PREFIX, key) else {
            return true;
        };
        self.read(|index| {
            index
                .get(name)
                .is_none_or(|held| self.concern.concerns(&held.vm))
        })
        .unwrap_or(true)
    }

    /// This process's own write of `vm` at `revision`: taken in now, so
    /// its next look does not wait for the watch to bring it back.
    pub fn written(&self, vm: &VirtualMachine, revision: Revision) {
        let vm = Arc::new(vm.clone());
        self.decoder.written(&vm, revision);
        if let Some(state) = self.lock().as_mut() {
            state.vms.upsert(vm, revision);
        }
    }

    /// This process deleted `name`'s record at `revision`.
    pub fn deleted(&self, name: &str, revision: Revision) {
        self.decoder.deleted(name, revision);
        if let Some(state) = self.lock().as_mut() {
            state.vms.remove(name, revision);
        }
    }

    /// The watch broke: changes may be missed until the next list.
    pub fn lost(&self) {
        *self.lock() = None;
    }

    /// `read` of the current VM index; `None` while there is none. For
    /// this node's own questions: fed only its own records, it holds no
    /// others ([`Self::read_whole`]).
    pub fn read<R>(&self, read: impl FnOnce(&VmIndex) -> R) -> Option<R> {
        self.lock().as_ref().map(|s| read(&s.vms))
    }

    /// `read` of the current VM index, for questions about the whole
    /// cluster (where a VM could move): `None` also when it holds only its
    /// node's records.
    pub fn read_whole<R>(&self, read: impl FnOnce(&VmIndex) -> R) -> Option<R> {
        if self.own_only {
            return None;
        }
        self.read(read)
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

    fn bigger(mut v: VirtualMachine) -> VirtualMachine {
        v.spec.cpus += 3;
        v.spec.memory_mib *= 4;
        v
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
            // A change on the node it stays on, of what it takes there.
            (bigger(vm("c", Some("n1"))), 7),
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
        assert_eq!(
            index.get("c").unwrap().vm.spec.cpus,
            bigger(vm("c", None)).spec.cpus
        );

        // A deletion older than the record it would remove is ignored.
        index.apply(&WatchEvent::Deleted {
            key: format!("{VMS_PREFIX}c"),
            revision: 6,
        });
        assert!(index.get("c").is_some());
        index.apply(&WatchEvent::Deleted {
            key: format!("{VMS_PREFIX}c"),
            revision: 8,
        });
        assert!(index.get("c").is_none());
        assert_eq!(index.owned_by("n1").count(), 0);
        assert_eq!(index.load().on_node_besides("n2", &vm("x", None)), 1);

        // A record that no longer decodes leaves the index, as a list skips it.
        index.apply(&WatchEvent::Put(Entry {
            key: format!("{VMS_PREFIX}a"),
            value: b"not json".to_vec(),
            create_revision: 1,
            mod_revision: 9,
        }));
        assert!(index.get("a").is_none());
        assert_eq!(index.len(), 1);
    }

    /// Two nodes of one process on one store: one decoding of a change,
    /// one copy of the record, in both indexes; so is this process's own
    /// write, which its watch echoes.
    #[test]
    fn reflectors_sharing_decodes_hold_one_copy_of_each_record() {
        let decoder = VmDecoder::sharing(Arc::default());
        let (n1, n2) = (
            ClusterReflector::judging(NodeConcern::of_node("n1")).decoding_with(decoder.clone()),
            ClusterReflector::judging(NodeConcern::of_node("n2")).decoding_with(decoder),
        );
        n1.reset(&[], &[]);
        n2.reset(&[], &[]);
        let held = |r: &ClusterReflector| r.read(|i| i.get("a").unwrap().vm.clone()).unwrap();
        let change = put(&vm("a", Some("n1")), 3);
        assert!(n1.apply(&change));
        assert!(!n2.apply(&change));
        assert!(Arc::ptr_eq(&held(&n1), &held(&n2)));

        n2.written(&vm("a", Some("n2")), 4);
        n1.apply(&put(&vm("a", Some("n2")), 4));
        assert!(Arc::ptr_eq(&held(&n1), &held(&n2)));
        assert_eq!(held(&n1).owner_node(), Some("n2"));
    }

    /// n1's reflector takes in every change (its load counts the VMs of
    /// n2 and n3 too) but hands on only those about VMs it acts on: its
    /// own, and one leaving it, judged by the record it held before the
    /// change, whether the VM goes to another node or is deleted.
    #[test]
    fn a_nodes_reflector_hands_on_only_changes_of_its_vms_and_those_leaving_it() {
        let reflector = ClusterReflector::judging(NodeConcern::of_node("n1"));
        reflector.reset(&[], &[]);
        let deleted = |name: &str, revision| WatchEvent::Deleted {
            key: format!("{VMS_PREFIX}{name}"),
            revision,
        };
        assert!(!reflector.apply(&put(&vm("a", Some("n2")), 1)));
        assert!(!reflector.apply(&put(&vm("a", Some("n3")), 2)));
        assert!(!reflector.apply(&deleted("a", 3)));
        assert!(!reflector.apply(&put(&vm("b", None), 4)));
        assert!(reflector.apply(&put(&vm("b", Some("n1")), 5)));
        // Off n1: the record held before says it was n1's.
        assert!(reflector.apply(&put(&vm("b", Some("n2")), 6)));
        assert!(!reflector.apply(&put(&vm("b", Some("n3")), 7)));
        assert!(reflector.apply(&put(&vm("c", Some("n1")), 8)));
        assert!(reflector.apply(&deleted("c", 9)));
        // A record that does not decode cannot be judged: handed on.
        assert!(reflector.apply(&WatchEvent::Put(Entry {
            key: format!("{VMS_PREFIX}d"),
            value: b"not json".to_vec(),
            create_revision: 10,
            mod_revision: 10,
        })));
        let on = |node: &str| reflector.read(|i| i.owned_by(node).count()).unwrap();
        assert_eq!((on("n1"), on("n3")), (0, 1));

        // A list looks again only at what concerns n1.
        let entry = |v: &VirtualMachine| Entry {
            key: format!("{VMS_PREFIX}{}", v.name),
            value: serde_json::to_vec(v).unwrap(),
            create_revision: 1,
            mod_revision: 11,
        };
        reflector.reset(
            &[entry(&vm("e", Some("n1"))), entry(&vm("f", Some("n2")))],
            &[],
        );
        assert!(reflector.listed_concerns(&format!("{VMS_PREFIX}e")));
        assert!(!reflector.listed_concerns(&format!("{VMS_PREFIX}f")));
        assert!(reflector.listed_concerns("/snapshots/f/s1"));

        // Without an index (a broken watch) nothing can be judged.
        reflector.lost();
        assert!(reflector.apply(&put(&vm("f", Some("n3")), 12)));
    }
}
