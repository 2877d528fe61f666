//! `/api/v1/images`: import (a streamed upload), list, get, delete; and the
//! check of the images a VM spec names, used when a VM is created or its
//! spec replaced.
//!
//! An import streams the request body into a temporary file of the image
//! store (never the whole file in memory), checks it, creates the record
//! (`/images/<name>`: the name is taken by that compare-and-swap) and only
//! then moves the file into place. A failed or abandoned upload leaves
//! neither a record nor a file.

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use futures_util::StreamExt;
use keel_api::{Image, ImageKind, Snapshot, VirtualMachine, VmSpec};
use keel_ctrl::keys::{image_key, IMAGES_PREFIX, SNAPSHOTS_PREFIX, VMS_PREFIX};
use keel_hv::images::{ImageError, Staged};
use keel_store::{Revision, StoreError};
use serde::{Deserialize, Serialize};

use super::extract::{NameParam, QueryParams};
use super::limits::check_cap;
use super::paging::PageRequest;
use super::write::with_etag;
use super::{ApiError, AppState};

/// One image and the store revision of its record (also sent as `ETag`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ImageResponse {
    pub revision: Revision,
    pub image: Image,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ImageList {
    /// The store revision the list is consistent with.
    pub revision: Revision,
    pub items: Vec<ImageResponse>,
    /// Present when more items follow: pass it as `?continue=` for the next page.
    #[serde(rename = "continue", default, skip_serializing_if = "Option::is_none")]
    pub continue_token: Option<String>,
}

crate::impl_paged!(ImageList);

fn not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("image {name} not found")).with_field("name")
}

pub(super) fn image_error(err: ImageError) -> ApiError {
    match err {
        ImageError::Rejected { .. } => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, err.to_string()).with_field("file")
        }
        ImageError::NoSpace { .. } => {
            ApiError::new(StatusCode::INSUFFICIENT_STORAGE, err.to_string())
        }
        _ => {
            tracing::warn!(%err, "image store");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, err.to_string())
        }
    }
}

/// `PUT /api/v1/images/{name}?kind=disk|kernel|initrd|iso`, the file as the body.
pub async fn import(
    State(state): State<AppState>,
    name: Result<NameParam, ApiError>,
    query: Result<QueryParams, ApiError>,
    body: Body,
) -> Result<Response, ApiError> {
    let mut stream = body.into_data_stream();
    let parsed = name.and_then(|NameParam(name)| {
        let mut query = query?;
        let kind = match query.take("kind")? {
            None => ImageKind::Disk,
            Some(k) => k.parse().map_err(ApiError::invalid)?,
        };
        query.finish()?;
        Ok((name, kind))
    });
    // A refusal is answered only once the body is read (and dropped): a
    // client still sending when the connection closes sees a broken pipe,
    // never the answer naming the bad field.
    let (name, kind) = match parsed {
        Ok(parsed) => parsed,
        Err(refused) => {
            while let Some(Ok(_)) = stream.next().await {}
            return Err(refused);
        }
    };
    // The body is still read (and dropped) on a refusal: a client whose
    // upload is cut off mid-send sees a broken pipe, not this answer.
    if let Err(refused) = admit(&state, &name).await {
        while let Some(Ok(_)) = stream.next().await {}
        return Err(refused);
    }
    let max_bytes = state.limits.max_image_bytes;
    let store = &state.images;
    let mut upload = match store.begin(&name).await {
        Ok(upload) => upload,
        Err(err) => {
            while let Some(Ok(_)) = stream.next().await {}
            return Err(image_error(err));
        }
    };
    while let Some(chunk) = stream.next().await {
        // The upload's file goes with `upload` when this returns early.
        let chunk = chunk.map_err(|e| {
            ApiError::bad_request(
                "body",
                format!("the upload broke off after {} bytes: {e}", upload.size()),
            )
        })?;
        if upload.size() + chunk.len() as u64 > max_bytes {
            return Err(too_large(max_bytes, "the upload"));
        }
        upload.write(&chunk).await.map_err(image_error)?;
    }
    let staged = store
        .finish(upload, kind, state.clock.now_ms())
        .await
        .map_err(image_error)?;
    record(&state, staged).await
}

/// Refuses an import before any byte is written: the name is taken, or
/// the store holds `--max-images` already. Early, so a name in use costs
/// no disk writes; the create in [`record`] is what decides.
pub(super) async fn admit(state: &AppState, name: &str) -> Result<(), ApiError> {
    if state.store.get::<Image>(&image_key(name)).await?.is_some() {
        return Err(exists(name));
    }
    let images = state.store.raw().count(IMAGES_PREFIX).await?;
    check_cap(images, state.limits.max_images, "images", "--max-images")
}

/// The 413 of an image past `--max-image-size`; `what` is what grew.
pub(super) fn too_large(max_bytes: u64, what: &str) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "{what} is larger than {max_bytes} bytes, the most an image may be \
             (keel serve --max-image-size)"
        ),
    )
    .with_field("size")
}

/// Creates the record of a checked import, then moves its file into
/// place: the 201, or nothing left behind.
pub(super) async fn record(state: &AppState, staged: Staged) -> Result<Response, ApiError> {
    let store = &state.images;
    let name = staged.image.name.clone();
    let key = image_key(&name);
    let image = staged.image.clone();
    image.validate().map_err(ApiError::invalid)?;
    let revision = match state.store.create(&key, &image).await {
        Ok(rev) => rev,
        Err(StoreError::Conflict { .. }) => return Err(exists(&name)),
        Err(e) => return Err(e.into()),
    };
    if let Err(err) = store.commit(staged) {
        // No image without its file: the record goes again.
        if let Err(e) = state.store.delete(&key, revision).await {
            tracing::error!(image = %name, %e, "could not remove the record of an image whose file failed");
        }
        return Err(image_error(err));
    }
    tracing::info!(image = %name, kind = %image.kind, format = %image.format, size = image.size_bytes, sha256 = %image.sha256, "image imported");
    Ok(with_etag(
        StatusCode::CREATED,
        ImageResponse { revision, image },
        revision,
    ))
}

fn exists(name: &str) -> ApiError {
    ApiError::conflict(
        "name",
        format!("image {name} already exists (delete it first, or import under another name)"),
    )
}

pub async fn list(
    State(state): State<AppState>,
    mut query: QueryParams,
) -> Result<Json<ImageList>, ApiError> {
    let page = PageRequest::take(&mut query)?;
    query.finish()?;
    let (entries, revision) = state.store.list::<Image>(IMAGES_PREFIX).await?;
    let items = entries
        .into_iter()
        .map(|(_, e)| ImageResponse {
            revision: e.revision,
            image: e.value,
        })
        .collect();
    let (items, continue_token) = page.page_by_name(items, |i| &i.image.name);
    Ok(Json(ImageList {
        revision,
        items,
        continue_token,
    }))
}

pub async fn get(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    query: QueryParams,
) -> Result<Response, ApiError> {
    query.finish()?;
    match state.store.get::<Image>(&image_key(&name)).await? {
        Some(e) => Ok(with_etag(
            StatusCode::OK,
            ImageResponse {
                revision: e.revision,
                image: e.value,
            },
            e.revision,
        )),
        None => Err(not_found(&name)),
    }
}

/// Refused (409, naming each) while anything needs the image: a VM whose
/// spec names it, a snapshot whose spec does (a restore brings it back), or
/// an overlay made on it that still exists (a VM's disk dropped from its
/// spec, or left by a VM record that is gone). An overlay names its base by
/// path; deleting the base would leave it unbootable, or with a file of
/// the same name, reading other content.
pub async fn delete(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    query: QueryParams,
) -> Result<Response, ApiError> {
    query.finish()?;
    let key = image_key(&name);
    let entry = state
        .store
        .get::<Image>(&key)
        .await?
        .ok_or_else(|| not_found(&name))?;
    let names_it = |spec: &VmSpec| spec.images().iter().any(|u| u.name == name);
    let vms = state
        .store
        .list_with_skipped::<VirtualMachine>(VMS_PREFIX)
        .await?;
    let snapshots = state
        .store
        .list_with_skipped::<Snapshot>(SNAPSHOTS_PREFIX)
        .await?;
    let mut users: Vec<String> = vms
        .entries
        .iter()
        .filter(|(_, e)| names_it(&e.value.spec))
        .map(|(_, e)| format!("VM {}", e.value.name))
        .collect();
    users.extend(
        snapshots
            .entries
            .iter()
            .filter(|(_, e)| names_it(&e.value.spec))
            .map(|(_, e)| format!("snapshot {}/{}", e.value.vm, e.value.name)),
    );
    let images = state.images.clone();
    let image = entry.value.clone();
    let overlays = tokio::task::spawn_blocking(move || images.overlays_on(&image))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("look for overlays on image {name}: {e}"),
            )
        })?
        .map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot tell whether image {name} is in use: its overlay notes: {e}"),
            )
        })?;
    users.extend(overlays.iter().map(ToString::to_string));
    if !users.is_empty() {
        return Err(ApiError::conflict(
            "name",
            format!(
                "image {name} is used by {}; delete those VMs, snapshots or disks made from it first",
                users.join(", ")
            ),
        ));
    }
    if let Some(bad) = vms.skipped.first().or(snapshots.skipped.first()) {
        // It might be one of them.
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "cannot tell whether image {name} is in use: record {} is unreadable ({})",
                bad.key, bad.reason
            ),
        ));
    }
    match state.store.delete(&key, entry.revision).await {
        Ok(_) => {}
        Err(StoreError::Conflict { .. }) => {
            return Err(ApiError::conflict(
                "name",
                format!("image {name} changed; try again"),
            ))
        }
        Err(e) => return Err(e.into()),
    }
    state.images.remove(&entry.value).map_err(image_error)?;
    tracing::info!(image = %name, "image deleted");
    Ok(with_etag(
        StatusCode::OK,
        ImageResponse {
            revision: entry.revision,
            image: entry.value,
        },
        entry.revision,
    ))
}

/// Checks every image `spec` names against the store: it must exist and be
/// of the kind the field wants; a disk made from an image is at least its
/// virtual size, which is also the size a disk gets that leaves it out
/// (`size_mib` 0). Names that are not valid are left to
/// [`VmSpec::validate`], which explains a host path.
pub async fn resolve(state: &AppState, spec: &mut VmSpec) -> Result<(), ApiError> {
    for used in spec.images() {
        if keel_api::validate_name(&used.field, &used.name).is_err() {
            continue;
        }
        let image = state
            .store
            .get::<Image>(&image_key(&used.name))
            .await?
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!(
                        "image {} not found (keel image list; keel image import {} FILE --kind {})",
                        used.name, used.name, used.kind
                    ),
                )
                .with_field(&used.field)
            })?
            .value;
        if image.kind != used.kind {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "image {} is a {} image; {} needs one of kind {}",
                    used.name, image.kind, used.field, used.kind
                ),
            )
            .with_field(&used.field));
        }
    }
    for (i, disk) in spec.disks.iter_mut().enumerate() {
        let Some(name) = &disk.image else { continue };
        let Some(image) = state.store.get::<Image>(&image_key(name)).await? else {
            continue;
        };
        let needed = image.value.virtual_size_mib();
        if disk.size_mib == 0 {
            disk.size_mib = needed;
        } else if disk.size_mib < needed {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "{} MiB is smaller than image {name}'s virtual size ({needed} MiB)",
                    disk.size_mib
                ),
            )
            .with_field(format!("spec.disks[{i}].size_mib")));
        }
    }
    Ok(())
}

/// Adds the image routes and types to the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let name_param = json!({"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}});
    let one = |code: &str, description: &str| json!({code: {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ImageResponse"}}}}});
    let with = |mut ok: serde_json::Value, errs: &[(&str, &str)]| {
        for (code, why) in errs {
            ok[*code] = error(why);
        }
        ok
    };
    let paths = json!({
        "/api/v1/images": {"get": {
            "summary": "List images", "operationId": "listImages",
            "parameters": super::paging::openapi_parameters(),
            "responses": with(json!({"200": {"description": "Images", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ImageList"}}}}}), &[("401", "Missing or wrong bearer token"), ("503", "Store unavailable")])
        }},
        "/api/v1/images/{name}": {
            "put": {
                "summary": "Import a file as image NAME: the body is the file, streamed (no size limit). Disk images must be qcow2 or raw without a backing file, external data file or encryption; a kernel must be a Linux x86 boot image; an iso an ISO 9660 image. The sha256 is recorded; a failed upload leaves nothing.",
                "operationId": "importImage",
                "parameters": [name_param.clone(), {"name": "kind", "in": "query", "required": false, "schema": {"type": "string", "enum": ["disk", "kernel", "initrd", "iso"], "default": "disk"}}],
                "requestBody": {"required": true, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                "responses": with(one("201", "Imported"), &[("400", "Bad name or kind, or the upload broke off"), ("401", "Missing or wrong bearer token"), ("409", "An image of that name exists"), ("422", "Not an image Keel boots (the reason says why); field: file"), ("500", "The node could not store it")])
            },
            "get": {
                "summary": "One image", "operationId": "getImage", "parameters": [name_param.clone()],
                "responses": with(one("200", "The image"), &[("401", "Missing or wrong bearer token"), ("404", "No such image")])
            },
            "delete": {
                "summary": "Delete an image and its file; refused while a VM's or a snapshot's spec names it, or an overlay made on it exists", "operationId": "deleteImage", "parameters": [name_param],
                "responses": with(one("200", "Deleted"), &[("401", "Missing or wrong bearer token"), ("404", "No such image"), ("409", "Used by VMs, snapshots or overlays (each named in the message)"), ("503", "Store unavailable, or a VM or snapshot record or an overlay note is unreadable")])
            }
        }
    });
    if let (Some(t), Some(a)) = (doc["paths"].as_object_mut(), paths.as_object()) {
        t.extend(a.clone());
    }
}
