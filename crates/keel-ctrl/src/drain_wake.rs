//! A drain of this node, begun or ended, wakes every VM the node owns.
//!
//! A running VM is looked at only on its slow resync (`resync`) unless
//! something wakes it, and node records wake no reconcile by themselves
//! (their heartbeats change them every few seconds). A drain is the one
//! change of this node's record a running VM acts on (its eviction), so
//! that change, and only it, wakes them: once per drain begun or ended,
//! not once per heartbeat.

use std::sync::Mutex;

use keel_api::Drain;

use crate::vm_index::ClusterReflector;

#[derive(Debug, Default)]
pub struct DrainWake {
    /// This node's drain as last seen; `None`: not seen yet.
    seen: Mutex<Option<Option<Drain>>>,
}

impl DrainWake {
    /// After a change of `node`'s record was taken into `reflector`: the
    /// VMs `node` owns if its drain differs from the one last seen (first
    /// sighting: if there is one), else none.
    pub fn woken(&self, reflector: &ClusterReflector, node: &str) -> Vec<String> {
        let Some(record) = reflector.node(node) else {
            return Vec::new();
        };
        let drain = record.and_then(|n| n.draining().cloned());
        let mut seen = self.seen.lock().expect("drain wake lock");
        let changed = match &*seen {
            Some(before) => *before != drain,
            None => drain.is_some(),
        };
        *seen = Some(drain);
        drop(seen);
        if !changed {
            return Vec::new();
        }
        reflector
            .read(|vms| vms.owned_by(node).map(|i| i.vm.name.clone()).collect())
            .unwrap_or_default()
    }
}
