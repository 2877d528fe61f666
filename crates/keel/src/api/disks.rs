//! `/api/v1/vms/{name}/disks…`: one disk of a VM's spec added, removed or
//! grown (`keel vm disk add|remove|resize`), each a compare-and-swap of the
//! VM record; the rules are `keel_api::disk_change`'s. The controller
//! carries the change out: a running VM's added disk is plugged in
//! (`keel_ctrl::hotplug`) and its resized one grown under the guest
//! (`keel_ctrl::online_resize`); otherwise the VM's next start makes an
//! added disk and grows a resized one (a removed disk of a running VM, or
//! one beyond its spare ports, waits for it).

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use keel_api::{validate_name, DiskChangeError, DiskSpec};
use keel_store::Revision;
use serde::{Deserialize, Serialize};

use super::extract::{JsonBody, NameParam, OptJsonBody, QueryParams};
use super::vms::{mutate, vm_response};
use super::write::expected_revision;
use super::{ApiError, AppState};

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddDiskRequest {
    pub name: String,
    pub size_mib: u64,
    /// The revision the client read; alternatively `If-Match` or `?revision=`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<Revision>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeDiskRequest {
    pub size_mib: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<Revision>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveDiskRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<Revision>,
}

/// A VM and one of its disks from the path (`{name}/disks/{disk}`); a bad
/// disk name names the field `disk`.
pub struct DiskParams {
    pub vm: String,
    pub disk: String,
}

impl<S: Send + Sync> FromRequestParts<S> for DiskParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path((vm, disk)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(|r| ApiError::bad_request("name", r.body_text()))?;
        for (field, value) in [("name", &vm), ("disk", &disk)] {
            validate_name(field, value)
                .map_err(|e| ApiError::bad_request(e.field.clone(), e.to_string()))?;
        }
        Ok(DiskParams { vm, disk })
    }
}

fn answer(err: DiskChangeError) -> ApiError {
    let e = err.error().clone();
    match err {
        DiskChangeError::Unknown(_) => ApiError::not_found(e.message).with_field(e.field),
        DiskChangeError::Invalid(_) => ApiError::invalid(e),
        DiskChangeError::Refused(_) => ApiError::refused(e),
    }
}

pub async fn add(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    JsonBody(req): JsonBody<AddDiskRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, req.revision)?;
    validate_name("disk", &req.name)
        .map_err(|e| ApiError::bad_request(e.field.clone(), e.to_string()))?;
    let disk = DiskSpec {
        name: req.name.clone(),
        size_mib: req.size_mib,
        image: None,
    };
    let (vm, revision) = mutate(&state, &name, expected, |vm| {
        vm.add_disk(disk.clone()).map_err(answer)
    })
    .await?;
    tracing::info!(vm = %name, disk = %req.name, size_mib = req.size_mib, "disk added");
    Ok(vm_response(StatusCode::CREATED, vm, revision))
}

pub async fn remove(
    State(state): State<AppState>,
    params: DiskParams,
    headers: HeaderMap,
    mut query: QueryParams,
    OptJsonBody(req): OptJsonBody<RemoveDiskRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, req.and_then(|r| r.revision))?;
    let DiskParams { vm: name, disk } = params;
    let (vm, revision) = mutate(&state, &name, expected, |vm| {
        vm.remove_disk(&disk).map(|_| ()).map_err(answer)
    })
    .await?;
    tracing::info!(vm = %name, %disk, "disk removed from the spec; its file stays");
    Ok(vm_response(StatusCode::OK, vm, revision))
}

pub async fn resize(
    State(state): State<AppState>,
    params: DiskParams,
    headers: HeaderMap,
    mut query: QueryParams,
    JsonBody(req): JsonBody<ResizeDiskRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, req.revision)?;
    let DiskParams { vm: name, disk } = params;
    let (vm, revision) = mutate(&state, &name, expected, |vm| {
        vm.resize_disk(&disk, req.size_mib).map_err(answer)
    })
    .await?;
    tracing::info!(vm = %name, %disk, size_mib = req.size_mib, "disk resized in the spec");
    Ok(vm_response(StatusCode::OK, vm, revision))
}

/// The routes' entries in the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let with = |mut ok: serde_json::Value, errs: &[(&str, &str)]| {
        for (code, why) in errs {
            ok[*code] = error(why);
        }
        ok
    };
    let vm_ok = |code: &str, description: &str| json!({code: {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/VmResponse"}}}}});
    let name = json!({"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}});
    let disk = json!({"name": "disk", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}});
    let revision = json!({"name": "revision", "in": "query", "required": false, "schema": {"type": "integer", "minimum": 0}});
    let if_match = json!({"name": "If-Match", "in": "header", "required": false, "schema": {"type": "string"}});
    let common = [
        ("400", "Malformed name or body"),
        ("401", "Missing, wrong, expired or revoked bearer token"),
        ("403", "The token's role is not admin"),
        ("503", "Store unavailable"),
    ];
    let errs = |extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
        common.iter().chain(extra).copied().collect()
    };
    let paths = json!({
        "/api/v1/vms/{name}/disks": {"post": {
            "summary": "Add a blank disk to the VM's spec (admin): plugged into a running VM on a spare root port, made at a stopped VM's next start",
            "operationId": "addDisk",
            "parameters": [name, revision, if_match],
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AddDiskRequest"}}}},
            "responses": with(vm_ok("201", "Added to the spec"), &errs(&[("404", "No such VM"), ("409", "A disk of that name exists (field disk), a stale revision, or a restore or deletion is under way"), ("422", "Size out of range (field size) or a bad disk name")]))
        }},
        "/api/v1/vms/{name}/disks/{disk}": {"delete": {
            "summary": "Remove a disk from the VM's spec (admin). Its file stays in the VM's disk dir until the VM is deleted, and a used disk keeps its record: added back under its name it is that disk. The disk the VM boots from is refused (409 naming disk)",
            "operationId": "removeDisk",
            "parameters": [name, disk, revision, if_match],
            "responses": with(vm_ok("200", "Removed from the spec"), &errs(&[("404", "No such VM, or no such disk (field disk)"), ("409", "The boot disk (field disk), a stale revision, or a restore or deletion is under way")]))
        }},
        "/api/v1/vms/{name}/disks/{disk}/resize": {"post": {
            "summary": "Grow a disk (admin): a running VM's disk is grown under its guest at once (block_resize), a stopped one's file at its next start (qemu-img resize). A smaller size is refused (422 naming size)",
            "operationId": "resizeDisk",
            "parameters": [name, disk, revision, if_match],
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ResizeDiskRequest"}}}},
            "responses": with(vm_ok("200", "Resized in the spec"), &errs(&[("404", "No such VM, or no such disk (field disk)"), ("409", "A stale revision, or a restore or deletion is under way"), ("422", "Smaller than the disk, or out of range (field size)")]))
        }}
    });
    if let (Some(t), Some(a)) = (doc["paths"].as_object_mut(), paths.as_object()) {
        t.extend(a.clone());
    }
}
