//! `uncordon` with `{"return": true}` (`keel node uncordon NODE --return`):
//! every VM the node's drains moved away (`VmStatus::drained_from`) is asked
//! to live-migrate back, each through the same bounded migration as
//! `keel vm migrate --to NODE`; those that cannot be (stopped, moving
//! already, on a node being drained) are named with the reason.

use keel_api::{Node, VirtualMachine};
use keel_ctrl::keys::{NODES_PREFIX, VMS_PREFIX};
use serde::{Deserialize, Serialize};

use super::{vms, ApiError, AppState};

/// A VM a return did not ask back, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NotReturned {
    pub vm: String,
    pub reason: String,
}

/// What the return asked: the VMs migrating back, and those not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReturnOutcome {
    pub returning: Vec<String>,
    pub not_returned: Vec<NotReturned>,
}

/// Asks every VM drained off `node` back to it.
pub async fn return_drained(state: &AppState, node: &str) -> Result<ReturnOutcome, ApiError> {
    let (entries, _) = state.store.list::<VirtualMachine>(VMS_PREFIX).await?;
    let now = state.clock.now_ms();
    let mut outcome = ReturnOutcome::default();
    let moved = entries.into_iter().map(|(_, e)| e.value).filter(|vm| {
        vm.status
            .drained_from
            .as_ref()
            .is_some_and(|d| d.node == node)
    });
    // Read once: every VM asked back is checked against the same nodes.
    let (nodes, _) = state.store.list::<Node>(NODES_PREFIX).await?;
    let draining = |name: &str| {
        nodes
            .iter()
            .any(|(_, e)| e.value.name == name && e.value.draining().is_some())
    };
    for vm in moved {
        if let Some(inst) = vm.status.instance.as_ref().filter(|i| draining(&i.node)) {
            outcome.not_returned.push(NotReturned {
                vm: vm.name.clone(),
                reason: format!("its node {} is being drained", inst.node),
            });
            continue;
        }
        let mut asked = None;
        let written = vms::mutate(state, &vm.name, None, |vm| {
            asked = Some(vm.request_return(node, now));
            Ok(())
        })
        .await;
        match (written, asked) {
            (Ok(_), Some(Ok(()))) => outcome.returning.push(vm.name.clone()),
            (Ok(_), Some(Err(why))) => outcome.not_returned.push(NotReturned {
                vm: vm.name.clone(),
                reason: why.message,
            }),
            // Deleted meanwhile, or the store failed: said, not hidden.
            (Err(e), _) => outcome.not_returned.push(NotReturned {
                vm: vm.name.clone(),
                reason: e.to_string(),
            }),
            (Ok(_), None) => {}
        }
    }
    tracing::info!(node, returning = ?outcome.returning, not_returned = outcome.not_returned.len(), "return after drain");
    Ok(outcome)
}
