//! `/api/v1/vms`: create, read, replace the spec, power requests, delete.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_api::{VirtualMachine, VmSpec};
use keel_ctrl::keys::{vm_key, VMS_PREFIX};
use keel_store::{Revision, StoreError};
use serde::{Deserialize, Serialize};

use super::extract::{BodyBytes, JsonBody, NameParam, QueryParams};
use super::paging::PageRequest;
use super::write::{self, expected_revision};
use super::{parse_json, ApiError, AppState};

/// `POST /api/v1/vms`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVmRequest {
    pub name: String,
    /// Strict: the stored `VmSpec` ignores unknown fields, a request does not.
    #[serde(deserialize_with = "super::strict::vm_spec")]
    pub spec: VmSpec,
}

/// `PUT /api/v1/vms/{name}/spec`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplaceSpecRequest {
    #[serde(deserialize_with = "super::strict::vm_spec")]
    pub spec: VmSpec,
    /// The revision the client read; alternatively `If-Match` or `?revision=`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<Revision>,
}

/// One VM and the store revision of its record (also sent as `ETag`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmResponse {
    pub revision: Revision,
    pub vm: VirtualMachine,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmList {
    /// The store revision the list is consistent with.
    pub revision: Revision,
    pub items: Vec<VmResponse>,
    /// Present when more items follow: pass it as `?continue=` for the next page.
    #[serde(rename = "continue", default, skip_serializing_if = "Option::is_none")]
    pub continue_token: Option<String>,
}

crate::impl_paged!(VmList);

/// Parses and validates a create request body: a VM ready to store, or a
/// 4xx error naming the field (400 for malformed or mistyped JSON, 422 for
/// values out of range).
/// A fresh VM uid (`VirtualMachine::uid`): 64 random bits, so a VM
/// deleted and created again under its name is never taken for the old one.
pub fn new_vm_uid() -> String {
    format!("{:016x}", rand::random::<u64>())
}

pub fn parse_create(body: &[u8]) -> Result<VirtualMachine, ApiError> {
    let vm = parse_create_unchecked(body)?;
    vm.validate().map_err(ApiError::invalid)?;
    Ok(vm)
}

/// The request's VM before validation: `create` first fills in what the
/// images it names say (a root disk's size), then validates.
fn parse_create_unchecked(body: &[u8]) -> Result<VirtualMachine, ApiError> {
    let req: CreateVmRequest = parse_json(body)?;
    let mut vm = VirtualMachine::new(req.name, req.spec);
    // The MAC (and cloud-init's instance-id) are fixed here, once: the
    // stored spec carries them for the VM's life.
    vm.spec.assign_identity(rand::random());
    Ok(vm)
}

pub async fn list(
    State(state): State<AppState>,
    mut query: QueryParams,
) -> Result<Response, ApiError> {
    let watch = query.take_bool("watch")?.unwrap_or(false);
    let only = query.take_name("name")?;
    let page = PageRequest::take(&mut query)?;
    query.finish()?;
    if watch {
        if !page.is_default() {
            return Err(ApiError::bad_request(
                "watch",
                "limit and continue page a list; watch streams every VM, then each change",
            ));
        }
        return super::vm_watch::stream(state, only).await;
    }
    if only.is_some() {
        return Err(ApiError::bad_request(
            "name",
            "name narrows a watch to one VM (watch=true); GET /api/v1/vms/NAME reads one",
        ));
    }
    let (entries, revision) = state.store.list::<VirtualMachine>(VMS_PREFIX).await?;
    let items = entries
        .into_iter()
        .map(|(_, e)| VmResponse {
            revision: e.revision,
            vm: e.value,
        })
        .collect();
    let (items, continue_token) = page.page_by_name(items, |i| &i.vm.name);
    Ok(Json(VmList {
        revision,
        items,
        continue_token,
    })
    .into_response())
}

pub async fn create(
    State(state): State<AppState>,
    query: QueryParams,
    BodyBytes(body): BodyBytes,
) -> Result<Response, ApiError> {
    query.finish()?;
    let mut vm = parse_create_unchecked(&body)?;
    vm.uid = new_vm_uid();
    super::images::resolve(&state, &mut vm.spec).await?;
    vm.validate().map_err(ApiError::invalid)?;
    super::host_ports::refuse_clash(&state, &vm.name, &vm.spec).await?;
    let place = state
        .vm_count
        .take_place(state.store.raw().as_ref(), &vm.name, state.limits.max_vms)
        .await?;
    let key = vm_key(&vm.name);
    match super::audited_write::create(&state.store, &key, &vm, StatusCode::CREATED).await {
        Ok(revision) => {
            place.created();
            tracing::info!(vm = %vm.name, revision, "VM created");
            let location = format!("/api/v1/vms/{}", vm.name);
            let mut resp = vm_response(StatusCode::CREATED, vm, revision);
            if let Ok(v) = HeaderValue::from_str(&location) {
                resp.headers_mut().insert(header::LOCATION, v);
            }
            Ok(resp)
        }
        Err(StoreError::Conflict { .. }) => Err(ApiError::conflict(
            "name",
            format!("VM {} already exists", vm.name),
        )),
        Err(e) => Err(e.into()),
    }
}

pub async fn get(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    query: QueryParams,
) -> Result<Response, ApiError> {
    query.finish()?;
    match state.store.get::<VirtualMachine>(&vm_key(&name)).await? {
        Some(e) => Ok(vm_response(StatusCode::OK, e.value, e.revision)),
        None => Err(not_found(&name)),
    }
}

pub async fn replace_spec(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    JsonBody(mut req): JsonBody<ReplaceSpecRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, req.revision)?.ok_or_else(|| {
        ApiError::new(
            StatusCode::PRECONDITION_REQUIRED,
            "replacing a spec needs the revision you read: send `If-Match: <revision>` or a \"revision\" field",
        )
        .with_field("revision")
    })?;
    super::images::resolve(&state, &mut req.spec).await?;
    req.spec.validate().map_err(ApiError::invalid)?;
    super::host_ports::refuse_clash(&state, &name, &req.spec).await?;
    let (vm, revision) = mutate(&state, &name, Some(expected), |vm| {
        let mut spec = req.spec.clone();
        spec.inherit_identity(&vm.spec, vm.mac());
        spec.assign_identity(rand::random());
        vm.replace_spec(spec).map_err(ApiError::refused)
    })
    .await?;
    Ok(vm_response(StatusCode::OK, vm, revision))
}

pub async fn start(
    state: State<AppState>,
    name: NameParam,
    headers: HeaderMap,
    query: QueryParams,
) -> Result<Response, ApiError> {
    power(state, name, headers, query, VirtualMachine::request_start).await
}

pub async fn stop(
    state: State<AppState>,
    name: NameParam,
    headers: HeaderMap,
    query: QueryParams,
) -> Result<Response, ApiError> {
    power(state, name, headers, query, VirtualMachine::request_stop).await
}

pub async fn restart(
    state: State<AppState>,
    name: NameParam,
    headers: HeaderMap,
    query: QueryParams,
) -> Result<Response, ApiError> {
    power(state, name, headers, query, VirtualMachine::request_restart).await
}

/// Reboots the running guest inside its instance (`VirtualMachine::request_reboot`).
pub async fn reboot(
    state: State<AppState>,
    name: NameParam,
    headers: HeaderMap,
    query: QueryParams,
) -> Result<Response, ApiError> {
    power(state, name, headers, query, VirtualMachine::request_reboot).await
}

async fn power(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    request: fn(&mut VirtualMachine) -> Result<(), keel_api::ValidationError>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    let (vm, revision) = mutate(&state, &name, expected, |vm| {
        request(vm).map_err(ApiError::refused)
    })
    .await?;
    keel_hv::start_marks::mark(&name, "api_written");
    Ok(vm_response(StatusCode::OK, vm, revision))
}

/// Marks the VM for deletion; the controller stops its instance, removes
/// its disks and then the record. Repeating it changes nothing.
pub async fn delete(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    let now = state.clock.now_ms();
    let (vm, revision) = mutate(&state, &name, expected, |vm| {
        vm.deletion_requested_at.get_or_insert(now);
        Ok(())
    })
    .await?;
    tracing::info!(vm = %name, revision, "deletion requested");
    Ok(vm_response(StatusCode::ACCEPTED, vm, revision))
}

/// [`write::mutate`] of the VM record.
pub(super) async fn mutate(
    state: &AppState,
    name: &str,
    expected: Option<Revision>,
    change: impl FnMut(&mut VirtualMachine) -> Result<(), ApiError>,
) -> Result<(VirtualMachine, Revision), ApiError> {
    write::mutate(
        state,
        &vm_key(name),
        &format!("VM {name}"),
        expected,
        || not_found(name),
        change,
    )
    .await
}

pub(super) fn not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("VM {name} not found")).with_field("name")
}

pub(super) fn vm_response(status: StatusCode, vm: VirtualMachine, revision: Revision) -> Response {
    write::with_etag(status, VmResponse { revision, vm }, revision)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_create_accepts_minimal_and_names_fields() {
        let vm = parse_create(br#"{"name":"web","spec":{"cpus":1,"memory_mib":64}}"#).unwrap();
        assert_eq!(vm.name, "web");
        assert_eq!(vm.generation, 1);
        let err = parse_create(br#"{"name":"a/b","spec":{"cpus":1,"memory_mib":64}}"#).unwrap_err();
        assert_eq!((err.status().as_u16(), err.field()), (422, Some("name")));
        let err = parse_create(br#"{"name":"a","spec":{"cpus":1,"memory_mib":0}}"#).unwrap_err();
        assert_eq!(err.field(), Some("spec.memory_mib"));
        let err = parse_create(br#"{"name":"a","spec":{"cpus":1,"memory_mib":64},"status":{}}"#)
            .unwrap_err();
        assert_eq!((err.status().as_u16(), err.field()), (400, Some("status")));
    }
}
