//! `POST /api/v1/images/{name}/import-url`: the server downloads an image
//! from an `http(s)://` URL itself, so a CLI far from the image (or from
//! the server) streams nothing; `GET` on the same path reports an import
//! in progress (phase, bytes done, total) for the CLI's progress line.
//!
//! The download goes through the upload path of [`super::images`]: into a
//! temporary file of the image store, hashed while it streams, checked
//! against the expected `sha256` or `sha512` *before* the format probe,
//! then probed and refused like an upload (not qcow2 or raw, a backing
//! file, ...), recorded and renamed into place. Every failure (the URL
//! unreachable or answering an error, a wrong checksum, a body past
//! `--max-image-size`, no room) is the request's answer, naming `url`,
//! `sha256`/`sha512` or `size`, and leaves neither a file nor a record:
//! the temporary file goes with the upload when the handler returns, and
//! also when the client goes away mid-download (the handler is dropped).
//!
//! The HTTP client is ureq, on a blocking thread that hands 1 MiB chunks
//! to the handler through a bounded channel: it is already the CLI's
//! client, its rustls connector verifies HTTPS against the webpki roots,
//! and it follows a bounded number of redirects. A dropped handler closes
//! the channel, which ends the thread at its next chunk.

use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use keel_api::{ImageKind, Millis};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha512};

use super::extract::{JsonBody, NameParam};
use super::images::{admit, image_error, record, too_large};
use super::{ApiError, AppState};

/// Redirects followed before the import is refused (naming `url`).
pub const MAX_REDIRECTS: u32 = 5;
/// A URL longer than this is refused: no image URL needs more.
const MAX_URL_LEN: usize = 4096;
/// What the download thread reads at a time (and the channel holds 4 of).
const CHUNK_BYTES: usize = 1 << 20;
/// A server silent this long (connecting, answering, or mid-body) fails
/// the import rather than holding a temporary file open for ever.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The request body of `POST /api/v1/images/{name}/import-url`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImportUrlRequest {
    pub url: String,
    #[serde(default)]
    pub kind: ImageKind,
    /// The SHA-256 the download must have, hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The SHA-512 the download must have, hex (Debian publishes these).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha512: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImportPhase {
    /// Connecting, following redirects, waiting for the answer's headers.
    Connecting,
    /// Streaming the body to the temporary file.
    Downloading,
    /// Comparing the checksum, probing the format, recording.
    Checking,
}

/// An import in progress, as `GET …/import-url` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ImportProgress {
    pub name: String,
    pub url: String,
    pub phase: ImportPhase,
    pub bytes_done: u64,
    /// The announced `Content-Length`, if the server sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    pub started_at: Millis,
}

/// The URL imports running in this process, by image name: one at a time
/// per name (a second is a 409), each gone from here when it ends.
#[derive(Debug, Default)]
pub struct ImageImports {
    active: Mutex<HashMap<String, ImportProgress>>,
}

/// One import's place in [`ImageImports`]; given back when dropped.
struct ImportSlot {
    book: Arc<ImageImports>,
    name: String,
}

impl ImageImports {
    fn claim(self: &Arc<Self>, progress: ImportProgress) -> Result<ImportSlot, ApiError> {
        let mut active = self.active.lock().expect("imports lock");
        if let Some(running) = active.get(&progress.name) {
            return Err(ApiError::conflict(
                "name",
                format!(
                    "image {} is being imported from {} already",
                    running.name, running.url
                ),
            ));
        }
        let name = progress.name.clone();
        active.insert(name.clone(), progress);
        Ok(ImportSlot {
            book: self.clone(),
            name,
        })
    }

    pub fn get(&self, name: &str) -> Option<ImportProgress> {
        self.active.lock().expect("imports lock").get(name).cloned()
    }
}

impl ImportSlot {
    fn update(&self, change: impl FnOnce(&mut ImportProgress)) {
        if let Some(p) = self
            .book
            .active
            .lock()
            .expect("imports lock")
            .get_mut(&self.name)
        {
            change(p);
        }
    }
}

impl Drop for ImportSlot {
    fn drop(&mut self) {
        self.book
            .active
            .lock()
            .expect("imports lock")
            .remove(&self.name);
    }
}

/// The checksum a download must match.
enum Expected {
    None,
    Sha256(String),
    Sha512(String, Box<Sha512>),
}

fn checked_url(url: &str) -> Result<(), ApiError> {
    let bad = |why: &str| ApiError::bad_request("url", format!("{url:?}: {why}"));
    if url.len() > MAX_URL_LEN {
        return Err(bad("longer than 4096 characters"));
    }
    let uri: ureq::http::Uri = url.parse().map_err(|e| bad(&format!("not a URL: {e}")))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(bad("only http:// and https:// URLs can be imported")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    Ok(())
}

fn checked_hex(field: &str, value: &str, len: usize) -> Result<String, ApiError> {
    let hex = value.trim().to_ascii_lowercase();
    if hex.len() != len || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::bad_request(
            field,
            format!("{value:?} is not a {field}: {len} hex digits expected"),
        ));
    }
    Ok(hex)
}

fn expected(req: &ImportUrlRequest) -> Result<Expected, ApiError> {
    match (&req.sha256, &req.sha512) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "sha512",
            "give sha256 or sha512, not both",
        )),
        (Some(sum), None) => Ok(Expected::Sha256(checked_hex("sha256", sum, 64)?)),
        (None, Some(sum)) => Ok(Expected::Sha512(
            checked_hex("sha512", sum, 128)?,
            Box::new(Sha512::new()),
        )),
        (None, None) => Ok(Expected::None),
    }
}

fn unreachable_url(url: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!("cannot download {url}: {why}"),
    )
    .with_field("url")
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(MAX_REDIRECTS)
        .timeout_connect(Some(STALL_TIMEOUT))
        .timeout_recv_response(Some(STALL_TIMEOUT))
        .timeout_per_read(Some(STALL_TIMEOUT))
        // A server that sent more than it announced leaves bytes on the
        // connection: never reuse one.
        .max_idle_connections(0)
        .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
        .build()
        .new_agent()
}

/// `GET /api/v1/images/{name}/import-url`: the import in progress, or 404.
pub async fn progress(
    State(state): State<AppState>,
    NameParam(name): NameParam,
) -> Result<Json<ImportProgress>, ApiError> {
    state.image_imports.get(&name).map(Json).ok_or_else(|| {
        ApiError::not_found(format!("no import of image {name} is in progress")).with_field("name")
    })
}

/// `POST /api/v1/images/{name}/import-url`: download, check, record; the
/// 201 of the image once it is in place.
pub async fn import_url(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    JsonBody(req): JsonBody<ImportUrlRequest>,
) -> Result<Response, ApiError> {
    checked_url(&req.url)?;
    let mut expected = expected(&req)?;
    admit(&state, &name).await?;
    let slot = state.image_imports.claim(ImportProgress {
        name: name.clone(),
        url: req.url.clone(),
        phase: ImportPhase::Connecting,
        bytes_done: 0,
        total_bytes: None,
        started_at: state.clock.now_ms(),
    })?;
    let url = req.url.clone();
    let response = tokio::task::spawn_blocking(move || agent().get(&url).call())
        .await
        .map_err(|e| unreachable_url(&req.url, e))?
        .map_err(|e| match e {
            ureq::Error::TooManyRedirects => {
                unreachable_url(&req.url, format!("more than {MAX_REDIRECTS} redirects"))
            }
            e => unreachable_url(&req.url, e),
        })?;
    let status = response.status();
    if !status.is_success() {
        return Err(unreachable_url(
            &req.url,
            format!("its server answered {status}"),
        ));
    }
    let max_bytes = state.limits.max_image_bytes;
    let total = response.body().content_length();
    if let Some(total) = total {
        if total > max_bytes {
            return Err(too_large(
                max_bytes,
                &format!("the download ({total} bytes announced)"),
            ));
        }
        state
            .images
            .check_room(&name, total)
            .await
            .map_err(|e| image_error(e).with_field("size"))?;
    }
    let mut upload = state
        .images
        .begin(&name)
        .await
        .map_err(|e| image_error(e).with_field("size"))?;
    slot.update(|p| {
        p.phase = ImportPhase::Downloading;
        p.total_bytes = total;
    });
    let (chunks, mut received) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(4);
    tokio::task::spawn_blocking(move || {
        let mut body = response.into_body().into_reader();
        loop {
            let mut buf = vec![0u8; CHUNK_BYTES];
            let read = body.read(&mut buf).map(|n| {
                buf.truncate(n);
                buf
            });
            let last = !matches!(&read, Ok(b) if !b.is_empty());
            // A closed channel: the import ended (failed, or its client
            // left); dropping the body closes the connection.
            if chunks.blocking_send(read).is_err() || last {
                return;
            }
        }
    });
    // Every early return below drops `upload`, which removes its file.
    while let Some(chunk) = received.recv().await {
        let chunk = chunk.map_err(|e| {
            unreachable_url(
                &req.url,
                format!("the download broke off after {} bytes: {e}", upload.size()),
            )
        })?;
        if chunk.is_empty() {
            break;
        }
        if upload.size() + chunk.len() as u64 > max_bytes {
            return Err(too_large(max_bytes, "the download"));
        }
        upload
            .write(&chunk)
            .await
            .map_err(|e| image_error(e).with_field("size"))?;
        if let Expected::Sha512(_, hasher) = &mut expected {
            hasher.update(&chunk);
        }
        let done = upload.size();
        slot.update(|p| p.bytes_done = done);
    }
    slot.update(|p| p.phase = ImportPhase::Checking);
    let (field, want, got) = match expected {
        Expected::None => ("", String::new(), String::new()),
        Expected::Sha256(want) => ("sha256", want, upload.sha256_so_far()),
        Expected::Sha512(want, hasher) => {
            let sum = hasher.finalize();
            (
                "sha512",
                want,
                sum.iter().map(|b| format!("{b:02x}")).collect(),
            )
        }
    };
    if want != got {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "the download from {} ({} bytes) has {field} {got}, not {want}: refused, nothing kept",
                req.url,
                upload.size()
            ),
        )
        .with_field(field));
    }
    let staged = state
        .images
        .finish(upload, req.kind, state.clock.now_ms())
        .await
        .map_err(|e| match e {
            // The file is the URL's content: name what the user gave.
            e @ keel_hv::images::ImageError::Rejected { .. } => image_error(e).with_field("url"),
            e => image_error(e),
        })?;
    let created = record(&state, staged).await?;
    tracing::info!(image = %name, url = %req.url, "image imported from a URL");
    drop(slot);
    Ok(created)
}

/// Adds the URL import's routes and types to the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let name_param = json!({"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}});
    let mut created = json!({"201": {"description": "Downloaded, checked and recorded", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ImageResponse"}}}}});
    for (code, why) in [
        ("400", "Bad name, url, kind or checksum (field names which)"),
        ("401", "Missing or wrong bearer token"),
        ("409", "An image of that name exists, or is being imported; or --max-images reached"),
        ("413", "The download is larger than --max-image-size (announced or as it streams); field: size"),
        ("422", "The checksum does not match (field: sha256 or sha512), or the download is not an image Keel boots (field: url)"),
        ("502", "The URL could not be downloaded: no connection, an error status, too many redirects, a broken body; field: url"),
        ("507", "The image dir has no room for it; field: size"),
    ] {
        created[code] = error(why);
    }
    doc["paths"]["/api/v1/images/{name}/import-url"] = json!({
        "post": {
            "summary": "Import image NAME from an http(s) URL the server downloads itself (HTTPS verified against the webpki roots, at most 5 redirects), checked against sha256 or sha512 while it streams, then like an upload. Answered when the image is in place; any failure leaves nothing.",
            "operationId": "importImageFromUrl",
            "parameters": [name_param.clone()],
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ImportUrlRequest"}}}},
            "responses": created
        },
        "get": {
            "summary": "The URL import of image NAME in progress", "operationId": "getImageImport",
            "parameters": [name_param],
            "responses": {
                "200": {"description": "In progress", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ImportProgress"}}}},
                "401": error("Missing or wrong bearer token"),
                "404": error("No import of that image is in progress (done, failed or never started)")
            }
        }
    });
}
