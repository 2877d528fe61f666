//! What the per-VM rows need of each VM record (its instance, node, size,
//! readiness, restarts), kept current by a watch from the first scrape on,
//! as `tally` keeps the phase counts: a scrape then reads no record and
//! decodes none, whatever the number of VMs (decoding 1,000 records was
//! most of a scrape's cost).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keel_api::{Millis, VirtualMachine};
use keel_store::{Entry, Store, WatchEvent};
use tokio::sync::watch;

/// One VM with an instance, as far as its figures go.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordFacts {
    pub vm: String,
    pub instance: String,
    pub node: String,
    pub cpus: u32,
    pub memory_mib: u64,
    pub running_since: Option<Millis>,
    pub ready_since: Option<Millis>,
    pub instance_seq: u64,
    pub resets: u32,
}

impl RecordFacts {
    /// `None` for a VM without an instance (it has no figures).
    pub fn of(vm: &VirtualMachine) -> Option<RecordFacts> {
        let instance = vm.status.instance.as_ref()?;
        Some(RecordFacts {
            vm: vm.name.clone(),
            instance: instance.id.clone(),
            node: instance.node.clone(),
            cpus: vm.spec.cpus,
            memory_mib: vm.spec.memory_mib,
            running_since: instance.running_since,
            ready_since: vm.ready_since(),
            instance_seq: vm.status.instance_seq,
            resets: instance.resets,
        })
    }

    fn decode(value: &[u8]) -> Option<RecordFacts> {
        let vm: VirtualMachine = serde_json::from_slice(value).ok()?;
        Self::of(&vm)
    }
}

/// The facts of every VM with an instance, by store key. Empty (`None`)
/// until the first list, and from a broken watch until the next.
#[derive(Default)]
pub struct VmRecords {
    state: Mutex<Option<HashMap<String, RecordFacts>>>,
}

impl VmRecords {
    /// The facts of the VMs whose instance is on `node`, if current.
    pub fn on_node(&self, node: &str) -> Option<Vec<RecordFacts>> {
        let state = self.lock();
        let records = state.as_ref()?;
        Some(
            records
                .values()
                .filter(|f| f.node == node)
                .cloned()
                .collect(),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<HashMap<String, RecordFacts>>> {
        self.state.lock().expect("vm records lock")
    }

    fn set(&self, key: &str, facts: Option<RecordFacts>) {
        if let Some(records) = self.lock().as_mut() {
            match facts {
                Some(f) => {
                    records.insert(key.to_string(), f);
                }
                None => {
                    records.remove(key);
                }
            }
        }
    }

    /// Keeps the facts current with `prefix` of the store's watch until
    /// `stop` turns true.
    pub async fn keep(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        prefix: &'static str,
        stop: watch::Receiver<bool>,
    ) {
        crate::prefix_view::keep(&*self, &*store, prefix, stop).await
    }
}

impl crate::prefix_view::PrefixView for VmRecords {
    fn reset(&self, entries: &[Entry]) {
        let records = entries
            .iter()
            .filter_map(|e| Some((e.key.clone(), RecordFacts::decode(&e.value)?)))
            .collect();
        *self.lock() = Some(records);
    }

    fn apply(&self, event: &WatchEvent) {
        match event {
            WatchEvent::Put(e) => self.set(&e.key, RecordFacts::decode(&e.value)),
            WatchEvent::Deleted { key, .. } => self.set(key, None),
        }
    }

    /// Facts that may miss changes are not used.
    fn broke(&self) {
        *self.lock() = None;
    }
}
