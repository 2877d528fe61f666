//! Published host ports are a node's resource: on one host (or between
//! VMs pinned to one node) a second VM publishing a port another already
//! publishes is refused at create and spec change, naming the holder,
//! since only one of them could ever bind it. In a cluster the scheduler
//! keeps the holders of one port on distinct nodes instead
//! (`keel_ctrl::placement_rules`).

use keel_api::{Node, VirtualMachine, VmSpec};
use keel_ctrl::keys::{NODES_PREFIX, VMS_PREFIX};

use super::{ApiError, AppState};

/// `Err` (409, naming the field and the VM holding the port) when `spec`
/// for VM `name` publishes a host port another VM holds where both must
/// run on one node.
pub async fn refuse_clash(state: &AppState, name: &str, spec: &VmSpec) -> Result<(), ApiError> {
    if spec.network.publish.is_empty() {
        return Ok(());
    }
    let (nodes, _) = state.store.list::<Node>(NODES_PREFIX).await?;
    let (vms, _) = state.store.list::<VirtualMachine>(VMS_PREFIX).await?;
    let others = vms.iter().map(|(_, e)| &e.value);
    let one_host = nodes.len() <= 1;
    let Some((holder, port)) = keel_ctrl::placement_rules::port_clash(name, spec, others, one_host)
    else {
        return Ok(());
    };
    let i = spec
        .network
        .publish
        .iter()
        .position(|p| p.clashes_with(&port))
        .unwrap_or_default();
    Err(ApiError::conflict(
        format!("spec.network.publish[{i}]"),
        format!(
            "host port {} is published by VM {}{}: only one of them could bind it",
            port.listener(),
            holder.name,
            if one_host {
                " on this host"
            } else {
                " on the same node"
            }
        ),
    ))
}
