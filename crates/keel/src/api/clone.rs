//! `POST /api/v1/vms/{name}/clone`: a new VM whose disks are copies of
//! this one's at one of its snapshots (`keel_api::clone`). The API only
//! records the clone; its first start, on a node that sees the source's
//! disks, makes the copies.

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use keel_api::{validate_name, PowerState, Snapshot, VirtualMachine};
use keel_ctrl::keys::{snapshot_key, vm_key};
use keel_store::StoreError;
use serde::{Deserialize, Serialize};

use super::extract::{JsonBody, NameParam, QueryParams};
use super::vms::{self, new_vm_uid, vm_response};
use super::{ApiError, AppState};

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CloneVmRequest {
    /// The new VM's name.
    pub name: String,
    /// The source's snapshot (Ready) the copies are made from.
    pub snapshot: String,
    /// Whether the clone is to run (it is created stopped otherwise).
    #[serde(default)]
    pub start: bool,
    /// Overlays on a frozen copy of the source's disks at the snapshot,
    /// shared with other linked clones of it, instead of full copies.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub linked: bool,
}

pub async fn clone(
    State(state): State<AppState>,
    NameParam(source): NameParam,
    query: QueryParams,
    JsonBody(req): JsonBody<CloneVmRequest>,
) -> Result<Response, ApiError> {
    query.finish()?;
    validate_name("name", &req.name).map_err(ApiError::invalid)?;
    validate_name("snapshot", &req.snapshot).map_err(ApiError::invalid)?;
    let src = state
        .store
        .get::<VirtualMachine>(&vm_key(&source))
        .await?
        .ok_or_else(|| vms::not_found(&source))?
        .value;
    let snapshot = state
        .store
        .get::<Snapshot>(&snapshot_key(&source, &req.snapshot))
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "VM {source} has no snapshot {} (take one: keel vm snapshot create)",
                req.snapshot
            ))
            .with_field("snapshot")
        })?
        .value;
    let power = if req.start {
        PowerState::Running
    } else {
        PowerState::Stopped
    };
    let mut clone = src
        .clone_at(&req.name, &snapshot, power, rand::random())
        .map_err(|e| match e.field.as_str() {
            // The state of the source or its snapshot stands in the way.
            "snapshot" | "vm" => ApiError::refused(e),
            _ => ApiError::invalid(e),
        })?;
    clone.uid = new_vm_uid();
    if let Some(from) = &mut clone.status.clone_from {
        from.linked = req.linked;
    }
    let place = state
        .vm_count
        .take_place(
            state.store.raw().as_ref(),
            &clone.name,
            state.limits.max_vms,
        )
        .await?;
    match state.store.create(&vm_key(&clone.name), &clone).await {
        Ok(revision) => {
            place.created();
            tracing::info!(vm = %clone.name, %source, snapshot = %req.snapshot, revision,
                "VM cloned");
            let location = format!("/api/v1/vms/{}", clone.name);
            let mut resp = vm_response(StatusCode::CREATED, clone, revision);
            if let Ok(v) = HeaderValue::from_str(&location) {
                resp.headers_mut().insert(header::LOCATION, v);
            }
            Ok(resp)
        }
        Err(StoreError::Conflict { .. }) => Err(ApiError::conflict(
            "name",
            format!("VM {} already exists", clone.name),
        )),
        Err(e) => Err(e.into()),
    }
}

/// The clone route and its request in the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let mut responses = json!({"201": {"description": "Clone recorded (stopped, or starting with `start`)", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/VmResponse"}}}}});
    for (code, why) in [
        ("400", "Malformed name or body"),
        ("401", "Missing, wrong, expired or revoked bearer token"),
        ("403", "The token's role is not admin"),
        ("404", "No such VM (`name`) or snapshot of it (`snapshot`)"),
        ("409", "A VM of that name exists (`name`), the snapshot is not Ready (`snapshot`), or the source has no disks yet (`vm`)"),
        ("413", "Body too large"),
        ("422", "Invalid name (`name`, `snapshot`)"),
        ("503", "Store unavailable"),
    ] {
        responses[code] = error(why);
    }
    doc["paths"]["/api/v1/vms/{name}/clone"] = json!({"post": {
        "summary": "Create a new VM (`name`) from a Ready snapshot of this one (admin): the snapshot's spec with a MAC, cloud-init instance-id and uid of its own and no published ports; its first start copies the disks at the snapshot, on a node that sees them",
        "operationId": "cloneVm",
        "parameters": [{"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}}],
        "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CloneVmRequest"}}}},
        "responses": responses
    }});
}
