//! One decoding of each VM record for all the readers of one store in one
//! process.
//!
//! Every node's reflector takes in every VM change, since placement and
//! the start guard need the whole cluster's allocation. Where several
//! nodes live in one process on one store (`keel serve --sim-nodes`, the
//! simulations), and beside the cluster controller in every `keel serve`,
//! each reader decoded the same record again and held its own copy: with
//! 50 nodes a change cost 50 decodes, and under 10,000 creates the readers
//! fell so far behind that the store's history no longer reached back to
//! them, so each listed and decoded every record again, and fell further
//! behind. A record at one revision is one value, so whoever decodes it
//! first shares it, and every index holds the same copy.
//!
//! Keyed by the store's (key, `mod_revision`), which names one value in
//! one store only: readers of different stores never share a
//! [`VmDecodes`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keel_api::VirtualMachine;
use keel_store::Revision;

/// The newest decoded record of each VM, as any reader sharing it saw it.
#[derive(Debug, Default)]
pub struct VmDecodes {
    newest: Mutex<HashMap<String, (Revision, Arc<VirtualMachine>)>>,
}

impl VmDecodes {
    fn held(&self, name: &str, revision: Revision) -> Option<Arc<VirtualMachine>> {
        let newest = self.lock();
        let (held_at, vm) = newest.get(name)?;
        (*held_at == revision).then(|| vm.clone())
    }

    /// Keeps `vm` as `name`'s record at `revision` unless a newer one is
    /// held: a reader lagging behind the others must not make them decode
    /// again what they are about to read.
    fn keep(&self, name: &str, revision: Revision, vm: &Arc<VirtualMachine>) {
        let mut newest = self.lock();
        match newest.get_mut(name) {
            Some((held_at, _)) if *held_at >= revision => {}
            Some(held) => *held = (revision, vm.clone()),
            None => {
                newest.insert(name.to_string(), (revision, vm.clone()));
            }
        }
    }

    /// `name` was deleted at `revision`: its older records are let go.
    fn forget(&self, name: &str, revision: Revision) {
        let mut newest = self.lock();
        if newest.get(name).is_some_and(|(at, _)| *at < revision) {
            newest.remove(name);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Revision, Arc<VirtualMachine>)>> {
        self.newest.lock().expect("vm decodes lock")
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// How one reader decodes VM records: on its own, or sharing each decoded
/// record with the other readers of its store.
#[derive(Debug, Clone, Default)]
pub struct VmDecoder {
    shared: Option<Arc<VmDecodes>>,
}

impl VmDecoder {
    pub fn sharing(decodes: Arc<VmDecodes>) -> Self {
        Self {
            shared: Some(decodes),
        }
    }

    /// `name`'s record as stored at `revision`; `None` if it does not
    /// decode as a VM of that name (a list skips those).
    pub fn decode(
        &self,
        name: &str,
        revision: Revision,
        value: &[u8],
    ) -> Option<Arc<VirtualMachine>> {
        if let Some(vm) = self
            .shared
            .as_ref()
            .and_then(|shared| shared.held(name, revision))
        {
            return Some(vm);
        }
        let vm: VirtualMachine = serde_json::from_slice(value).ok()?;
        if vm.name != name {
            return None;
        }
        let vm = Arc::new(vm);
        self.written(&vm, revision);
        Some(vm)
    }

    /// `vm` as written at `revision` by this process: the readers sharing
    /// it take the watch's echo of that write without decoding it.
    pub fn written(&self, vm: &Arc<VirtualMachine>, revision: Revision) {
        if let Some(shared) = &self.shared {
            shared.keep(&vm.name, revision, vm);
        }
    }

    pub fn deleted(&self, name: &str, revision: Revision) {
        if let Some(shared) = &self.shared {
            shared.forget(name, revision);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::tests::vm;

    fn bytes(v: &VirtualMachine) -> Vec<u8> {
        serde_json::to_vec(v).unwrap()
    }

    /// Two readers of one store: the second gets the very record the first
    /// decoded (the same allocation, not an equal copy), whatever bytes it
    /// brings; a reader alone, or at another revision, decodes for itself.
    #[test]
    fn readers_sharing_a_store_decode_each_revision_once() {
        let decodes = Arc::new(VmDecodes::default());
        let (a, b) = (
            VmDecoder::sharing(decodes.clone()),
            VmDecoder::sharing(decodes.clone()),
        );
        let on_n1 = vm("x", Some("n1"));
        let first = a.decode("x", 5, &bytes(&on_n1)).unwrap();
        // Bytes that would decode differently prove the second reader
        // did not decode them: at revision 5, `x` is one value.
        let second = b.decode("x", 5, b"not json").unwrap();
        assert!(Arc::ptr_eq(&first, &second));

        // A lagging reader's older revision is decoded, and does not
        // displace the newer record the others will read.
        let on_n2 = vm("x", Some("n2"));
        let newer = a.decode("x", 7, &bytes(&on_n2)).unwrap();
        let older = b.decode("x", 6, &bytes(&on_n1)).unwrap();
        assert_eq!(older.owner_node(), Some("n1"));
        assert!(Arc::ptr_eq(&newer, &b.decode("x", 7, b"").unwrap()));

        // Deleted: let go, so nothing is held for VMs that are gone.
        a.deleted("x", 8);
        assert_eq!(decodes.len(), 0);
        assert!(b.decode("x", 7, b"").is_none());

        // Alone, nothing is shared; a record of another name is refused.
        let alone = VmDecoder::default();
        assert!(alone.decode("x", 5, b"not json").is_none());
        assert!(alone.decode("y", 5, &bytes(&on_n1)).is_none());
        assert!(b.decode("y", 9, &bytes(&on_n1)).is_none());
    }
}
