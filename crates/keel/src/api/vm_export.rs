//! `GET /api/v1/vms/{name}/export?snapshot=S`: the VM as one tar archive
//! (`keel_api::vm_export` describes it): each disk as the snapshot holds
//! it, copied by the node's driver into a staging directory beside the
//! image store (the VM may run meanwhile), summed, then streamed to the
//! client behind a manifest. The staging directory is removed when the
//! stream ends, however it ends.
//!
//! Served by the server whose node sees the VM's disks (its own, or the
//! shared storage it mounts): the disks are read where they are.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use keel_api::vm_export::MANIFEST_FILE;
use keel_api::{
    validate_name, DiskHome, ExportManifest, ExportedFile, Node, Snapshot, SnapshotPhase,
    VirtualMachine,
};
use keel_ctrl::keys::{node_key, snapshot_key, vm_key};
use sha2::{Digest, Sha256};

use super::extract::{NameParam, QueryParams};
use super::vms;
use super::{ApiError, AppState, NodeAccess};

/// A directory of an export or import in progress, removed when dropped.
/// One a crashed server left behind is removed by a later one's start
/// once a day has passed without a change in it.
pub(super) struct Staging(PathBuf);

/// How the staging directories are named: `.vm-<what>-<pid>-<random>`.
const STAGING_PREFIX: &str = ".vm-";

/// A staging directory untouched this long belongs to no live export or
/// import (each writes into its directory as it goes).
const STALE_STAGING: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

fn remove_stale_staging(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry
            .metadata()
            .ok()
            .filter(|m| m.is_dir())
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_STAGING);
        if stale
            && entry
                .file_name()
                .to_string_lossy()
                .starts_with(STAGING_PREFIX)
        {
            tracing::info!(path = %entry.path().display(), "removing an abandoned VM export or import");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Staging {
    /// A new, empty directory for `what` in the image store's directory
    /// (its filesystem holds uploads; the floor applies to it).
    pub(super) async fn new(state: &AppState, what: &str) -> Result<Staging, ApiError> {
        let dir = state.images.dir().to_path_buf();
        let floor = state.images.min_free_bytes();
        let doing = format!("not starting the {what}");
        let checked = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || {
                remove_stale_staging(&dir);
                keel_hv::free_space::check_floor(&dir, floor, 0, &doing)
            }
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        if let Err(why) = checked {
            return Err(ApiError::new(StatusCode::INSUFFICIENT_STORAGE, why));
        }
        let path = dir.join(format!(
            "{STAGING_PREFIX}{what}-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        tokio::fs::create_dir(&path).await.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("create {}: {e}", path.display()),
            )
        })?;
        Ok(Staging(path))
    }

    pub(super) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The node of this server whose storage holds `vm`'s disks, or why not
/// (409 naming `vm`).
pub(super) async fn node_with_disks<'a>(
    state: &'a AppState,
    vm: &VirtualMachine,
) -> Result<&'a NodeAccess, ApiError> {
    let Some(home) = &vm.status.disk_home else {
        return Err(ApiError::conflict(
            "vm",
            format!("VM {} has no disks yet (it never started)", vm.name),
        ));
    };
    let node = state.node.as_ref().ok_or_else(|| {
        ApiError::conflict(
            "vm",
            format!(
                "this server runs no node, so it cannot read VM {}'s disks ({home}); \
                 ask the server of a node that sees them",
                vm.name
            ),
        )
    })?;
    if node_home(state, node).await?.as_ref() != Some(home) {
        return Err(ApiError::conflict(
            "vm",
            format!(
                "VM {}'s disks are on {home}, which node {} of this server does not see; \
                 ask the server of a node that sees them",
                vm.name, node.node
            ),
        ));
    }
    Ok(node)
}

/// Where the disks of VMs that start on `node` go, as its record says.
pub(super) async fn node_home(
    state: &AppState,
    node: &NodeAccess,
) -> Result<Option<DiskHome>, ApiError> {
    Ok(state
        .store
        .get::<Node>(&node_key(&node.node))
        .await?
        .and_then(|n| n.value.status.disk_home))
}

/// Size and hex SHA-256 of a file.
pub(super) fn sum_file(path: &Path) -> io::Result<(u64, String)> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok((bytes, to_hex(&hasher.finalize())))
}

pub(super) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub async fn export(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    mut query: QueryParams,
) -> Result<Response, ApiError> {
    let snapshot = query.take("snapshot")?.ok_or_else(|| {
        ApiError::bad_request(
            "snapshot",
            "name the snapshot to export at (?snapshot=S); `keel vm export` takes one",
        )
    })?;
    query.finish()?;
    validate_name("snapshot", &snapshot).map_err(ApiError::invalid)?;
    let vm = state
        .store
        .get::<VirtualMachine>(&vm_key(&name))
        .await?
        .ok_or_else(|| vms::not_found(&name))?
        .value;
    let snap = state
        .store
        .get::<Snapshot>(&snapshot_key(&name, &snapshot))
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "VM {name} has no snapshot {snapshot} (take one: keel vm snapshot create)"
            ))
            .with_field("snapshot")
        })?
        .value;
    if snap.status.phase != SnapshotPhase::Ready || snap.deletion_requested_at.is_some() {
        return Err(ApiError::conflict(
            "snapshot",
            format!(
                "snapshot {snapshot} of VM {name} is not ready ({:?}): an export is made \
                 from a snapshot that holds the disks",
                snap.status.phase
            ),
        ));
    }
    let node = node_with_disks(&state, &vm).await?;
    let staging = Staging::new(&state, "export").await?;
    let written = node
        .hv
        .export_disks(&name, &snap.spec.disks, &snapshot, staging.path())
        .await
        .map_err(|e| {
            let why = keel_ctrl::error_chain(&e);
            tracing::warn!(vm = %name, %snapshot, error = %why, "export failed");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, why)
        })?;
    let dir = staging.path().to_path_buf();
    let files = tokio::task::spawn_blocking(move || {
        written
            .into_iter()
            .map(|name| {
                let (bytes, sha256) = sum_file(&dir.join(&name))?;
                Ok(ExportedFile {
                    name,
                    bytes,
                    sha256,
                })
            })
            .collect::<io::Result<Vec<_>>>()
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("sum: {e}")))?;
    let manifest = ExportManifest::new(&vm, &snapshot, &snap.spec, state.clock.now_ms(), files);
    let manifest_bytes = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let length = archive_length(manifest_bytes.len() as u64, &manifest.files);
    tracing::info!(vm = %name, %snapshot, bytes = length, "exporting");

    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(8);
    tokio::task::spawn_blocking(move || {
        let mut out = ChannelWriter(tx.clone());
        if let Err(e) = write_archive(&mut out, &staging, &manifest_bytes, &manifest.files) {
            // The client sees the stream break off, not a complete archive.
            let _ = tx.blocking_send(Err(e));
        }
        drop(staging);
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut resp = (StatusCode::OK, Body::from_stream(stream)).into_response();
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-tar"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}.keel.tar\"")) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(resp)
}

/// The archive's size: each entry a 512-byte header and its data padded
/// to 512, then two zero blocks (what `tar::Builder` writes for plain
/// names, which these are: short and ASCII).
fn archive_length(manifest_bytes: u64, files: &[ExportedFile]) -> u64 {
    let entry = |bytes: u64| 512 + bytes.div_ceil(512) * 512;
    entry(manifest_bytes) + files.iter().map(|f| entry(f.bytes)).sum::<u64>() + 1024
}

fn write_archive(
    out: &mut ChannelWriter,
    staging: &Staging,
    manifest: &[u8],
    files: &[ExportedFile],
) -> io::Result<()> {
    let mut tar = tar::Builder::new(out);
    let header = |size: u64| {
        let mut h = tar::Header::new_ustar();
        h.set_size(size);
        h.set_mode(0o600);
        h.set_entry_type(tar::EntryType::Regular);
        h
    };
    let mut h = header(manifest.len() as u64);
    tar.append_data(&mut h, MANIFEST_FILE, manifest)?;
    for file in files {
        let f = std::fs::File::open(staging.path().join(&file.name))?;
        let mut h = header(file.bytes);
        // Exactly the summed bytes: a file that changed would not match.
        tar.append_data(&mut h, &file.name, f.take(file.bytes))?;
    }
    tar.into_inner()?.flush()
}

/// Hands what the archive writer writes to the response body; fails once
/// the client has gone (the body, and so the receiver, dropped).
struct ChannelWriter(tokio::sync::mpsc::Sender<io::Result<Bytes>>);

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the client went away"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The route in the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let mut responses = json!({"200": {"description": "The archive: manifest.json (format, version, spec, hardware, each file's size and SHA-256), then a standalone qcow2 per disk at the snapshot and a UEFI VM's variable store", "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}});
    for (code, why) in [
        ("400", "Malformed name, or no `snapshot`"),
        ("401", "Missing, wrong, expired or revoked bearer token"),
        ("403", "The token's role is not admin"),
        ("404", "No such VM (`name`) or snapshot of it (`snapshot`)"),
        ("409", "The snapshot is not Ready (`snapshot`), or this server's node does not see the VM's disks (`vm`)"),
        ("422", "Invalid snapshot name (`snapshot`)"),
        ("500", "The driver could not copy a disk (the reason)"),
        ("503", "Store unavailable"),
        ("507", "The image dir's filesystem is at its free-space floor"),
    ] {
        responses[code] = error(why);
    }
    doc["paths"]["/api/v1/vms/{name}/export"] = json!({"get": {
        "summary": "Export the VM as one tar archive (admin): each disk as a Ready snapshot of it holds it (the VM may run meanwhile), as standalone qcow2 files, with its spec. The VM's snapshots do not go with it",
        "operationId": "exportVm",
        "parameters": [
            {"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}},
            {"name": "snapshot", "in": "query", "required": true, "schema": {"$ref": "#/components/schemas/Name"}}
        ],
        "responses": responses
    }});
}
