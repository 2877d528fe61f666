//! `/api/v1/vms/{name}/snapshots` and `/api/v1/vms/{name}/restore`.
//!
//! The API only records requests: a snapshot record (Pending) that the
//! snapshot controller takes, a `deletion_requested_at` it acts on, a
//! `restore` on the VM the VM controller carries out. Refusals name the
//! field that stands in the way.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Json;
use keel_api::{validate_name, Snapshot, SnapshotPhase, SnapshotStatus, VirtualMachine};
use keel_ctrl::keys::{snapshot_key, snapshots_of_prefix, vm_key};
use keel_store::{Revision, StoreError};
use serde::{Deserialize, Serialize};

use super::extract::{JsonBody, NameParam, QueryParams, SnapshotParams};
use super::limits::check_cap;
use super::paging::PageRequest;
use super::vms::{self, vm_response};
use super::write::{self, expected_revision, with_etag};
use super::{ApiError, AppState};

/// `POST /api/v1/vms/{name}/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    pub name: String,
}

/// `POST /api/v1/vms/{name}/restore`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreVmRequest {
    pub snapshot: String,
    /// The VM revision the client read; alternatively `If-Match` or `?revision=`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<Revision>,
}

/// One snapshot and the store revision of its record (also sent as `ETag`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotResponse {
    pub revision: Revision,
    pub snapshot: Snapshot,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotList {
    /// The store revision the list is consistent with.
    pub revision: Revision,
    pub items: Vec<SnapshotResponse>,
    /// Present when more items follow: pass it as `?continue=` for the next page.
    #[serde(rename = "continue", default, skip_serializing_if = "Option::is_none")]
    pub continue_token: Option<String>,
}

crate::impl_paged!(SnapshotList);

/// Records a snapshot request (phase Pending) with a copy of the VM's spec;
/// the snapshot controller takes it.
pub async fn create(
    State(state): State<AppState>,
    NameParam(vm_name): NameParam,
    query: QueryParams,
    JsonBody(req): JsonBody<CreateSnapshotRequest>,
) -> Result<Response, ApiError> {
    query.finish()?;
    validate_name("name", &req.name).map_err(ApiError::invalid)?;
    let vm = state
        .store
        .get::<VirtualMachine>(&vm_key(&vm_name))
        .await?
        .ok_or_else(|| vms::not_found(&vm_name))?
        .value;
    refuse_if_busy(&vm)?;
    let snapshots = state
        .store
        .raw()
        .count(&snapshots_of_prefix(&vm_name))
        .await?;
    check_cap(
        snapshots,
        state.limits.max_snapshots_per_vm,
        &format!("snapshots of VM {vm_name}"),
        "--max-snapshots-per-vm",
    )?;
    let snap = Snapshot {
        vm: vm_name.clone(),
        name: req.name.clone(),
        spec: vm.spec.clone(),
        requested_at: state.clock.now_ms(),
        deletion_requested_at: None,
        status: SnapshotStatus::default(),
    };
    snap.validate().map_err(ApiError::invalid)?;
    let key = snapshot_key(&vm_name, &req.name);
    let revision = match state.store.create(&key, &snap).await {
        Ok(revision) => revision,
        Err(StoreError::Conflict { .. }) => {
            return Err(ApiError::conflict(
                "name",
                format!("VM {vm_name} already has a snapshot {}", req.name),
            ))
        }
        Err(e) => return Err(e.into()),
    };
    // There is no multi-key transaction: a restore or deletion requested
    // between the read above and the create slipped past the check. Look
    // again and withdraw the request if so (the controller does not take a
    // snapshot while either is pending, so nothing was taken yet).
    let now_vm = state.store.get::<VirtualMachine>(&vm_key(&vm_name)).await?;
    let busy = match &now_vm {
        None => Some(vms::not_found(&vm_name)),
        Some(e) => refuse_if_busy(&e.value).err(),
    };
    if let Some(err) = busy {
        withdraw(&state, &key, revision).await;
        return Err(err);
    }
    tracing::info!(vm = %vm_name, snapshot = %req.name, revision, "snapshot requested");
    let mut resp = with_etag(
        StatusCode::CREATED,
        SnapshotResponse {
            revision,
            snapshot: snap,
        },
        revision,
    );
    let location = format!("/api/v1/vms/{vm_name}/snapshots/{}", req.name);
    if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    Ok(resp)
}

/// Removes a snapshot request this handler just created and must refuse
/// after all: deleted outright if untouched, else marked for deletion (the
/// controller then removes it).
async fn withdraw(state: &AppState, key: &str, revision: Revision) {
    match state.store.delete(key, revision).await {
        Ok(_) => return,
        Err(StoreError::Conflict { .. }) => {}
        Err(err) => tracing::warn!(key, %err, "withdrawing a refused snapshot request"),
    }
    let now = state.clock.now_ms();
    let marked = write::mutate::<Snapshot>(
        state,
        key,
        key,
        None,
        || ApiError::not_found("gone"),
        |s| {
            s.deletion_requested_at.get_or_insert(now);
            Ok(())
        },
    )
    .await;
    if let Err(err) = marked {
        if err.status() != StatusCode::NOT_FOUND {
            tracing::warn!(key, %err, "marking a refused snapshot request for deletion");
        }
    }
}

/// No snapshot while the VM's disks are about to be replaced or removed.
fn refuse_if_busy(vm: &VirtualMachine) -> Result<(), ApiError> {
    if vm.deletion_requested_at.is_some() {
        return Err(ApiError::conflict(
            "deletion_requested_at",
            format!("VM {} is being deleted", vm.name),
        ));
    }
    if let Some(r) = &vm.restore {
        return Err(ApiError::conflict(
            "restore",
            format!(
                "VM {} is being restored from snapshot {}; try again when it is done",
                vm.name, r.snapshot
            ),
        ));
    }
    Ok(())
}

pub async fn list(
    State(state): State<AppState>,
    NameParam(vm_name): NameParam,
    mut query: QueryParams,
) -> Result<Json<SnapshotList>, ApiError> {
    let page = PageRequest::take(&mut query)?;
    query.finish()?;
    if state
        .store
        .get::<VirtualMachine>(&vm_key(&vm_name))
        .await?
        .is_none()
    {
        return Err(vms::not_found(&vm_name));
    }
    let (entries, revision) = state
        .store
        .list::<Snapshot>(&snapshots_of_prefix(&vm_name))
        .await?;
    let items: Vec<SnapshotResponse> = entries
        .into_iter()
        .map(|(_, e)| SnapshotResponse {
            revision: e.revision,
            snapshot: e.value,
        })
        .collect();
    // Oldest first: the token is `<requested_at>.<name>` of the last one.
    let after = page
        .after
        .as_deref()
        .map(|t| {
            t.split_once('.')
                .and_then(|(at, name)| Some((at.parse::<u64>().ok()?, name.to_string())))
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "continue",
                        format!("continue={t:?} is not a token this list gave"),
                    )
                })
        })
        .transpose()?;
    let (items, continue_token) = page.page(
        items,
        |s| (s.snapshot.requested_at, s.snapshot.name.clone()),
        after,
        |(at, name)| format!("{at}.{name}"),
    );
    Ok(Json(SnapshotList {
        revision,
        items,
        continue_token,
    }))
}

pub async fn get(
    State(state): State<AppState>,
    params: SnapshotParams,
    query: QueryParams,
) -> Result<Response, ApiError> {
    query.finish()?;
    let entry = state
        .store
        .get::<Snapshot>(&snapshot_key(&params.vm, &params.snapshot))
        .await?;
    match entry {
        Some(e) => Ok(with_etag(
            StatusCode::OK,
            SnapshotResponse {
                revision: e.revision,
                snapshot: e.value,
            },
            e.revision,
        )),
        None => Err(missing(&state, &params.vm, &params.snapshot).await),
    }
}

/// Marks the snapshot for deletion; the controller removes it from the
/// disks, then deletes the record. Repeating it changes nothing. Refused
/// while the VM is being restored from it.
pub async fn delete(
    State(state): State<AppState>,
    params: SnapshotParams,
    headers: HeaderMap,
    mut query: QueryParams,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    let SnapshotParams { vm, snapshot } = &params;
    let key = snapshot_key(vm, snapshot);
    if state.store.get::<Snapshot>(&key).await?.is_none() {
        return Err(missing(&state, vm, snapshot).await);
    }
    if let Some(entry) = state.store.get::<VirtualMachine>(&vm_key(vm)).await? {
        if entry
            .value
            .restore
            .as_ref()
            .is_some_and(|r| &r.snapshot == snapshot)
        {
            return Err(ApiError::conflict(
                "snapshot",
                format!(
                    "VM {vm} is being restored from snapshot {snapshot}; delete it when the restore is done"
                ),
            ));
        }
    }
    let now = state.clock.now_ms();
    let (snap, revision) = write::mutate::<Snapshot>(
        &state,
        &key,
        &format!("snapshot {vm}/{snapshot}"),
        expected,
        || snapshot_not_found(vm, snapshot),
        |s| {
            s.deletion_requested_at.get_or_insert(now);
            Ok(())
        },
    )
    .await?;
    tracing::info!(%vm, %snapshot, revision, "snapshot deletion requested");
    Ok(with_etag(
        StatusCode::ACCEPTED,
        SnapshotResponse {
            revision,
            snapshot: snap,
        },
        revision,
    ))
}

/// Records the restore on the VM (with the power state to return to); the
/// controller stops the VM, puts disks and spec back, and brings it back
/// to that power state.
pub async fn restore(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    JsonBody(req): JsonBody<RestoreVmRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, req.revision)?;
    validate_name("snapshot", &req.snapshot).map_err(ApiError::invalid)?;
    if state
        .store
        .get::<VirtualMachine>(&vm_key(&name))
        .await?
        .is_none()
    {
        return Err(vms::not_found(&name));
    }
    let snap = state
        .store
        .get::<Snapshot>(&snapshot_key(&name, &req.snapshot))
        .await?
        .ok_or_else(|| snapshot_not_found(&name, &req.snapshot))?
        .value;
    if snap.deletion_requested_at.is_some() {
        return Err(ApiError::conflict(
            "snapshot",
            format!("snapshot {name}/{} is being deleted", req.snapshot),
        ));
    }
    match snap.status.phase {
        SnapshotPhase::Ready => {}
        phase => {
            return Err(ApiError::conflict(
                "snapshot",
                format!(
                    "snapshot {name}/{} is {phase:?}, not Ready{}",
                    req.snapshot,
                    snap.status
                        .message
                        .as_deref()
                        .map(|m| format!(": {m}"))
                        .unwrap_or_default()
                ),
            ))
        }
    }
    let now = state.clock.now_ms();
    let (vm, revision) = vms::mutate(&state, &name, expected, |vm| {
        vm.request_restore(&req.snapshot, now)
            .map_err(ApiError::refused)
    })
    .await?;
    tracing::info!(vm = %name, snapshot = %req.snapshot, revision, "restore requested");
    Ok(vm_response(StatusCode::ACCEPTED, vm, revision))
}

fn snapshot_not_found(vm: &str, snapshot: &str) -> ApiError {
    ApiError::not_found(format!("VM {vm} has no snapshot {snapshot}")).with_field("snapshot")
}

/// A missing snapshot: 404 naming the VM if it is the VM that is missing.
async fn missing(state: &AppState, vm: &str, snapshot: &str) -> ApiError {
    match state.store.get::<VirtualMachine>(&vm_key(vm)).await {
        Ok(None) => vms::not_found(vm),
        Ok(Some(_)) => snapshot_not_found(vm, snapshot),
        Err(e) => e.into(),
    }
}
