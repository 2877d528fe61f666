//! `PUT /api/v1/vms/{name}/import[?start=true][&keep_identity=true]`, an
//! archive of `keel vm export` as the body: a new VM `name` on this
//! server's node, its disks the archive's.
//!
//! The body is unpacked as it streams (never held in memory, never
//! written twice) into a staging directory beside the image store, under
//! the same caps as an image upload (`--max-image-size` for the whole
//! archive, the free-space floor while it is written). Every file is
//! summed as it is written and checked against the manifest; only then
//! are the disks moved into the VM's disk dir (by the driver, which
//! refuses a file that is not a standalone disk) and the record created,
//! its disks recorded as made and used. A failure at any step leaves no
//! record and no file: the staging directory goes when the handler ends,
//! and disks moved into place are deleted again if the record cannot be
//! created.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::path::Path;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use keel_api::vm_export::{MANIFEST_FILE, MAX_MANIFEST_BYTES};
use keel_api::{ExportManifest, PowerState, VirtualMachine};
use keel_ctrl::keys::vm_key;
use keel_store::StoreError;
use sha2::{Digest, Sha256};

use super::extract::{NameParam, QueryParams};
use super::images::too_large;
use super::vm_count::Place;
use super::vm_export::{node_home, to_hex, Staging};
use super::vms::{new_vm_uid, vm_response};
use super::{ApiError, AppState};

/// How often the unpacking checks the free-space floor.
const FREE_SPACE_CHECK_BYTES: u64 = 256 << 20;

struct Asked {
    place: Place,
    name: String,
    start: bool,
    keep_identity: bool,
}

pub async fn import(
    State(state): State<AppState>,
    name: Result<NameParam, ApiError>,
    query: Result<QueryParams, ApiError>,
    body: Body,
) -> Result<Response, ApiError> {
    let mut stream = body.into_data_stream();
    // A refusal is answered only once the body is read (and dropped): a
    // client still sending when the connection closes sees a broken pipe,
    // never the answer naming the bad field.
    let asked = match admit(&state, name, query).await {
        Ok(asked) => asked,
        Err(refused) => {
            while let Some(Ok(_)) = stream.next().await {}
            return Err(refused);
        }
    };
    let staging = match Staging::new(&state, "import").await {
        Ok(s) => s,
        Err(e) => {
            while let Some(Ok(_)) = stream.next().await {}
            return Err(e);
        }
    };
    let (tx, rx) = std::sync::mpsc::sync_channel::<Bytes>(8);
    let dir = staging.path().to_path_buf();
    let limits = Caps {
        max_bytes: state.limits.max_image_bytes,
        floor: state.images.min_free_bytes(),
    };
    let unpacking =
        tokio::task::spawn_blocking(move || unpack(ChannelReader::new(rx), &dir, limits));
    let mut received = 0u64;
    let mut broke_off = None;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(chunk) => {
                received += chunk.len() as u64;
                // Counted here too: what follows the archive's end is
                // never read by the unpacking, but is still received.
                if received > limits.max_bytes {
                    drop(tx);
                    let _ = unpacking.await;
                    return Err(too_large(limits.max_bytes, "the export"));
                }
                // Once the unpacking stopped (a refusal, which its answer
                // explains), the rest is read and dropped: a client cut
                // off mid-send would see a broken pipe, not the answer.
                let _ = tx.send(chunk);
            }
            Err(e) => {
                broke_off = Some(format!("the upload broke off after {received} bytes: {e}"));
                break;
            }
        }
    }
    drop(tx);
    let unpacked = unpacking
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    if let Some(why) = broke_off {
        return Err(ApiError::bad_request("body", why));
    }
    let manifest = unpacked?;
    create(&state, asked, manifest, &staging).await
}

async fn admit(
    state: &AppState,
    name: Result<NameParam, ApiError>,
    query: Result<QueryParams, ApiError>,
) -> Result<Asked, ApiError> {
    let NameParam(name) = name?;
    let mut query = query?;
    let start = query.take_bool("start")?.unwrap_or(false);
    let keep_identity = query.take_bool("keep_identity")?.unwrap_or(false);
    query.finish()?;
    if state
        .store
        .get::<VirtualMachine>(&vm_key(&name))
        .await?
        .is_some()
    {
        return Err(ApiError::conflict(
            "name",
            format!("VM {name} already exists"),
        ));
    }
    if state.node.is_none() {
        return Err(ApiError::conflict(
            "node",
            "this server runs no node to keep the VM's disks on; import through the server of a node",
        ));
    }
    // Held through the upload: an import in progress is a create.
    let place = state
        .vm_count
        .take_place(state.store.raw().as_ref(), &name, state.limits.max_vms)
        .await?;
    Ok(Asked {
        place,
        name,
        start,
        keep_identity,
    })
}

async fn create(
    state: &AppState,
    asked: Asked,
    manifest: ExportManifest,
    staging: &Staging,
) -> Result<Response, ApiError> {
    let Asked {
        place,
        name,
        start,
        keep_identity,
    } = asked;
    let node = state.node.as_ref().expect("admitted with a node");
    let home = node_home(state, node).await?.ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "node {} has not registered its storage yet; try again",
                node.node
            ),
        )
    })?;
    let power = if start {
        PowerState::Running
    } else {
        PowerState::Stopped
    };
    let mut vm = VirtualMachine::imported(
        &name,
        &manifest,
        home,
        state.clock.now_ms(),
        power,
        keep_identity,
        rand::random(),
    )
    .map_err(ApiError::invalid)?;
    vm.uid = new_vm_uid();
    super::images::resolve(state, &mut vm.spec).await?;
    super::host_ports::refuse_clash(state, &vm.name, &vm.spec).await?;
    node.hv
        .import_disks(&name, &vm.spec.disks, staging.path())
        .await
        .map_err(|e| {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, keel_ctrl::error_chain(&e))
                .with_field("file")
        })?;
    match state.store.create(&vm_key(&name), &vm).await {
        Ok(revision) => {
            place.created();
            tracing::info!(vm = %name, from = %manifest.vm, snapshot = %manifest.snapshot,
                revision, "VM imported");
            let mut resp = vm_response(StatusCode::CREATED, vm, revision);
            if let Ok(v) = HeaderValue::from_str(&format!("/api/v1/vms/{name}")) {
                resp.headers_mut().insert(header::LOCATION, v);
            }
            Ok(resp)
        }
        Err(e) => {
            // No record names these disks: they go.
            if let Err(del) = node.hv.delete_disks(&name).await {
                tracing::warn!(vm = %name, error = %del, "could not remove the disks of a failed import");
            }
            match e {
                StoreError::Conflict { .. } => Err(ApiError::conflict(
                    "name",
                    format!("VM {name} already exists"),
                )),
                e => Err(e.into()),
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Caps {
    max_bytes: u64,
    floor: u64,
}

fn not_an_export(why: impl Into<String>) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!("not a usable Keel VM export: {}", why.into()),
    )
    .with_field("file")
}

/// Unpacks the archive into `dir`: the manifest first, then exactly the
/// files it lists, each checked against its size and SHA-256.
fn unpack(reader: ChannelReader, dir: &Path, caps: Caps) -> Result<ExportManifest, ApiError> {
    let mut counted = Counted {
        inner: reader,
        read: 0,
        caps,
        checked_at: 0,
        dir: dir.to_path_buf(),
        refused: None,
    };
    let result = unpack_entries(&mut counted, dir);
    // A cap hit shows as a read error inside tar: answer with the cap.
    match counted.refused.take() {
        Some(refused) => Err(refused),
        None => result,
    }
}

fn unpack_entries(reader: &mut Counted, dir: &Path) -> Result<ExportManifest, ApiError> {
    let io_failed = |e: io::Error| not_an_export(format!("the archive cannot be read: {e}"));
    let mut archive = tar::Archive::new(reader);
    let mut entries = archive.entries().map_err(io_failed)?;
    let mut manifest: Option<ExportManifest> = None;
    let mut seen: BTreeMap<String, ()> = BTreeMap::new();
    for entry in entries.by_ref() {
        let mut entry = entry.map_err(io_failed)?;
        let path = entry
            .path()
            .map_err(io_failed)?
            .to_string_lossy()
            .into_owned();
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(not_an_export(format!("{path:?} is not a plain file")));
        }
        let Some(m) = &manifest else {
            if path != MANIFEST_FILE {
                return Err(not_an_export(format!(
                    "its first file is {path:?}, not {MANIFEST_FILE}"
                )));
            }
            if entry.size() > MAX_MANIFEST_BYTES {
                return Err(not_an_export(format!("{MANIFEST_FILE} is too large")));
            }
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).map_err(io_failed)?;
            let parsed: ExportManifest = serde_json::from_slice(&bytes)
                .map_err(|e| not_an_export(format!("{MANIFEST_FILE}: {e}")))?;
            parsed.check().map_err(ApiError::invalid)?;
            manifest = Some(parsed);
            continue;
        };
        let Some(listed) = m.file(&path).cloned() else {
            return Err(not_an_export(format!("{path:?} is not in its manifest")));
        };
        if seen.insert(path.clone(), ()).is_some() {
            return Err(not_an_export(format!("{path:?} is in it twice")));
        }
        // Names were checked by the manifest: disk files and the vars
        // file, plain names that stay inside `dir`.
        let target = dir.join(&listed.name);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&target)
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("{}: {e}", target.display()),
                )
            })?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = entry.read(&mut buf).map_err(io_failed)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            bytes += n as u64;
            out.write_all(&buf[..n]).map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("{}: {e}", target.display()),
                )
            })?;
        }
        out.sync_all()
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("sync: {e}")))?;
        let sum = to_hex(&hasher.finalize());
        if bytes != listed.bytes || sum != listed.sha256 {
            return Err(not_an_export(format!(
                "{} does not match its manifest ({bytes} bytes, SHA-256 {sum}; the manifest \
                 says {} bytes, {}): the file is damaged",
                listed.name, listed.bytes, listed.sha256
            )));
        }
    }
    let Some(manifest) = manifest else {
        return Err(not_an_export(format!("it has no {MANIFEST_FILE}")));
    };
    if let Some(missing) = manifest.files.iter().find(|f| !seen.contains_key(&f.name)) {
        return Err(not_an_export(format!(
            "{} is in its manifest but not in the archive (cut short?)",
            missing.name
        )));
    }
    Ok(manifest)
}

/// The body as a `Read`, with the caps applied as it is read.
struct Counted {
    inner: ChannelReader,
    read: u64,
    caps: Caps,
    checked_at: u64,
    dir: std::path::PathBuf,
    refused: Option<ApiError>,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.caps.max_bytes {
            self.refused = Some(too_large(self.caps.max_bytes, "the export"));
            return Err(io::Error::other("over the size cap"));
        }
        if self.read - self.checked_at >= FREE_SPACE_CHECK_BYTES {
            self.checked_at = self.read;
            if let Err(why) = keel_hv::free_space::check_floor(
                &self.dir,
                self.caps.floor,
                0,
                "not importing further",
            ) {
                self.refused = Some(ApiError::new(StatusCode::INSUFFICIENT_STORAGE, why));
                return Err(io::Error::other("below the free-space floor"));
            }
        }
        Ok(n)
    }
}

/// Reads the chunks the handler passes on from the request body.
struct ChannelReader {
    rx: std::sync::mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl ChannelReader {
    fn new(rx: std::sync::mpsc::Receiver<Bytes>) -> Self {
        Self {
            rx,
            current: Bytes::new(),
        }
    }
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.recv() {
                Ok(chunk) => self.current = chunk,
                // The body ended (or broke off: the handler says so).
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// The route in the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let mut responses = json!({"201": {"description": "VM created from the export (stopped, or starting with `start`), its disks in place", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/VmResponse"}}}}});
    for (code, why) in [
        ("400", "Malformed name or query, or the upload broke off (`body`)"),
        ("401", "Missing, wrong, expired or revoked bearer token"),
        ("403", "The token's role is not admin"),
        ("409", "A VM of that name exists (`name`), or this server runs no node (`node`)"),
        ("413", "The archive is larger than --max-image-size (`size`)"),
        ("422", "Not an export this server reads, a file that does not match its manifest, or a disk that is not a standalone qcow2 (`file`); an invalid spec (its field); an image the spec names is missing"),
        ("503", "Store unavailable, or the node has not registered yet"),
        ("507", "The image dir's filesystem is at its free-space floor"),
    ] {
        responses[code] = error(why);
    }
    doc["paths"]["/api/v1/vms/{name}/import"] = json!({"put": {
        "summary": "Create VM `name` from an archive written by the export route (admin), sent as the body. Its disks are the archive's (recorded as made, never made blank); it gets a MAC and cloud-init instance-id of its own and no published ports unless `keep_identity`. A failed import stores nothing",
        "operationId": "importVm",
        "parameters": [
            {"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}},
            {"name": "start", "in": "query", "required": false, "schema": {"type": "boolean"}},
            {"name": "keep_identity", "in": "query", "required": false, "schema": {"type": "boolean"}}
        ],
        "requestBody": {"required": true, "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}},
        "responses": responses
    }});
}
