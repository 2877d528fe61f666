//! What a node's agent reads from the store when its index holds only
//! the records that concern its node (it watches the node's copies,
//! `keel_store::node_shards`): the records of its live domains that are
//! recorded elsewhere, for the room check on the node ([`no_room_on`],
//! a start's and an incoming migration's), and, for a question about the
//! whole cluster (where a draining VM could go), every record, listed at
//! most once in [`WHOLE_VIEW_MS`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keel_api::{Clock, Millis, Node, VirtualMachine};
use keel_hv::DomainInfo;
use keel_store::{StoreError, TypedStore};

use crate::cluster_controller::ClusterState;
use crate::keys::vm_key;
use crate::vm_index::{ClusterReflector, VmIndex};

/// How long a listed view of every VM serves the looks that need one. A
/// drain looks at each of its VMs every few seconds; each look listing
/// every record of the cluster would cost a drain of a full node that many
/// times the cluster's records. A view this old only picks migration
/// targets: the target checks its own room before it takes the guest.
pub const WHOLE_VIEW_MS: Millis = 2_000;

/// The records of `names` (VMs of live domains here) that `reflector`
/// does not hold because it holds only its node's and they are recorded
/// elsewhere (a handed-over migration's source, a given-up target): read
/// from the store, since they still take room here until ended. Empty for
/// a reflector fed every record.
pub async fn records_elsewhere(
    reflector: &ClusterReflector,
    store: &TypedStore,
    names: &[&str],
) -> Result<HashMap<String, VirtualMachine>, StoreError> {
    if !reflector.holds_own_records_only() {
        return Ok(HashMap::new());
    }
    let missing: Vec<String> = reflector
        .read(|index| {
            names
                .iter()
                .filter(|name| index.get(name).is_none())
                .map(|name| name.to_string())
                .collect()
        })
        .unwrap_or_else(|| names.iter().map(|n| n.to_string()).collect());
    let mut found = HashMap::with_capacity(missing.len());
    for name in missing {
        if let Some(entry) = store.get::<VirtualMachine>(&vm_key(&name)).await? {
            found.insert(name, entry.value);
        }
    }
    Ok(found)
}

/// Why `vm` has no room on `node` (this node) beside what the records
/// allocate there and the VMs of its live `domains` that no record
/// accounts for there (a given-up migration's target, a handed-over
/// source, until ended; `crate::schedule::unaccounted`). `None` while
/// there is no index. Records of those domains that the index does not
/// hold are read first ([`records_elsewhere`]): unread, they would go
/// uncounted, so a failed read is a reason too.
pub async fn no_room_on(
    reflector: &ClusterReflector,
    store: &TypedStore,
    vm: &VirtualMachine,
    node: &Node,
    domains: &[DomainInfo],
) -> Option<String> {
    let names: Vec<&str> = domains.iter().map(|d| d.vm.as_str()).collect();
    let elsewhere = match records_elsewhere(reflector, store, &names).await {
        Ok(found) => found,
        Err(err) => {
            return Some(format!(
                "cannot read the records of the live domains here: {}",
                crate::error_chain(&err)
            ))
        }
    };
    reflector
        .read(|vms| {
            let extra = crate::schedule::unaccounted(domains, &node.name, |name| {
                vms.get(name)
                    .map(|v| &*v.vm)
                    .or_else(|| elsewhere.get(name))
            });
            crate::schedule::room_on(vm, node, vms.load(), &extra).err()
        })
        .flatten()
}

/// Every VM record, as listed within the last [`WHOLE_VIEW_MS`].
#[derive(Debug, Default)]
pub struct WholeView {
    listed: Mutex<Option<(Millis, Arc<VmIndex>)>>,
}

impl WholeView {
    pub async fn read(
        &self,
        store: &TypedStore,
        clock: &dyn Clock,
    ) -> Result<Arc<VmIndex>, StoreError> {
        let now = clock.now_ms();
        if let Some((at, index)) = self.listed.lock().expect("whole view lock").as_ref() {
            if now >= *at && now - at < WHOLE_VIEW_MS {
                return Ok(Arc::clone(index));
            }
        }
        let index = Arc::new(ClusterState::read_vms(store).await?.0);
        *self.listed.lock().expect("whole view lock") = Some((now, Arc::clone(&index)));
        Ok(index)
    }
}
