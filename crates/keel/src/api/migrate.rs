//! `POST /api/v1/vms/{name}/migrate`: records the user's migration request
//! on the VM (`VirtualMachine::request_migration`); the VM's agent carries
//! it out through a drain's path. Refusals name the field: `name` (no such
//! VM), `status.phase` (not running), `to` (the current node, unknown,
//! cordoned, draining or not ready), `migrate` / `status.eviction` (a
//! migration already in flight).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use keel_api::{Node, VirtualMachine};
use keel_ctrl::keys::{node_key, vm_key};
use keel_ctrl::LifecycleConfig;
use keel_store::Revision;
use serde::{Deserialize, Serialize};

use super::extract::{JsonBody, NameParam, QueryParams};
use super::vms::{self, vm_response};
use super::write::expected_revision;
use super::{ApiError, AppState};

#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrateVmRequest {
    /// The node to move to; absent: the scheduler's best candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// The revision the client read; alternatively `If-Match` or `?revision=`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<Revision>,
}

pub async fn migrate(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    JsonBody(req): JsonBody<MigrateVmRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, req.revision)?;
    if let Some(to) = &req.to {
        keel_api::validate_name("to", to).map_err(ApiError::invalid)?;
    }
    let vm = state
        .store
        .get::<VirtualMachine>(&vm_key(&name))
        .await?
        .ok_or_else(|| vms::not_found(&name))?
        .value;
    let now = state.clock.now_ms();
    // The VM's own checks first (running, not the node it is on, nothing
    // in flight), then what only the node records tell.
    vm.clone()
        .request_migration(req.to.as_deref(), now)
        .map_err(ApiError::refused)?;
    // The TPM's state cannot go with a live migration (see qemu::tpm): refused
    // here rather than tried and failed, or its state risked.
    let started_with_tpm = vm
        .status
        .instance
        .as_ref()
        .and_then(|i| i.started_with.as_ref())
        .map_or(vm.spec.tpm.is_some(), |s| s.tpm);
    if started_with_tpm {
        return Err(ApiError::conflict(
            "spec.tpm",
            format!(
                "VM {name} runs with a TPM, whose state live migration cannot carry: stop it \
                 and start it on the other node (its TPM state goes with its disks)"
            ),
        ));
    }
    if let Some(inst) = &vm.status.instance {
        if let Some(node) = state.store.get::<Node>(&node_key(&inst.node)).await? {
            if node.value.draining().is_some() {
                return Err(ApiError::conflict(
                    "status.eviction",
                    format!(
                        "node {} is being drained: its drain migrates VM {name}",
                        inst.node
                    ),
                ));
            }
        }
    }
    if let Some(to) = &req.to {
        check_target(&state, &vm, to, now).await?;
    }
    let (vm, revision) = vms::mutate(&state, &name, expected, |vm| {
        vm.request_migration(req.to.as_deref(), now)
            .map_err(ApiError::refused)
    })
    .await?;
    tracing::info!(vm = %name, to = ?req.to, revision, "migration requested");
    Ok(vm_response(StatusCode::ACCEPTED, vm, revision))
}

/// Whether node `to` can take `vm` now: known, not cordoned or draining,
/// able to run its recorded machine type and CPU model,
/// and heard from recently (by its own heartbeat time; the agent decides
/// again by what it has seen when it acts).
async fn check_target(
    state: &AppState,
    vm: &VirtualMachine,
    to: &str,
    now: u64,
) -> Result<(), ApiError> {
    let Some(node) = state.store.get::<Node>(&node_key(to)).await? else {
        return Err(ApiError::not_found(format!("node {to} not found")).with_field("to"));
    };
    let node = node.value;
    if node.cordoned || node.draining().is_some() {
        return Err(ApiError::conflict(
            "to",
            format!("node {to} is cordoned or draining: it takes no VMs"),
        ));
    }
    if let Some(why) = keel_ctrl::hardware::node_lacks(vm, &node) {
        return Err(ApiError::conflict(
            "to",
            format!(
                "{why}: VM {} runs as that and migrates only as that",
                vm.name
            ),
        ));
    }
    let ready_ms = LifecycleConfig::default().node_ready_ms;
    if node.freeze.is_some() || now.saturating_sub(node.status.last_heartbeat) > ready_ms {
        return Err(ApiError::conflict(
            "to",
            format!(
                "node {to} is not ready (no heartbeat within {}s)",
                ready_ms / 1000
            ),
        ));
    }
    Ok(())
}
