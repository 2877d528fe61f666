//! The HTTP API, `/api/v1`, JSON in and out. Every error, including
//! axum's own rejections and unmatched routes, is `{"error", "field"}`.
//!
//! Writes are read → modify → compare-and-swap, retried a bounded number
//! of times on a conflict with another writer; a revision the client sent
//! (`If-Match` or `revision`) is never retried: stale means 409.

pub mod agent_figures;
pub mod audit;
pub mod audited_write;
pub mod clone;
pub mod console;
pub mod console_proxy;
pub mod disks;
pub mod drain_return;
mod error;
pub mod events;
mod extract;
pub mod freeze;
pub mod host_ports;
pub mod image_urls;
pub mod images;
pub mod limits;
pub mod migrate;
pub mod migrations;
pub mod node_labels;
pub mod nodes;
pub mod openapi;
pub mod paging;
pub(crate) mod require_token;
pub mod roles;
pub mod snapshots;
pub mod strict;
pub mod token_limits;
pub mod tokens;
pub mod vm_count;
pub mod vm_export;
pub mod vm_import;
pub mod vm_stats;
pub mod vm_watch;
pub mod vms;
pub mod vnc;
mod vnc_doc;
pub mod whoami;
mod write;
pub mod ws_auth;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use keel_api::Clock;
use keel_store::TypedStore;
use tokio::sync::watch;

pub use error::{ApiError, ErrorBody};
pub use extract::{parse_json, MAX_BODY_BYTES};

use crate::metrics::Metrics;
pub use require_token::Door;

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub store: TypedStore,
    pub clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
    /// Turns true when the server shuts down; ends `follow` streams.
    pub shutdown: watch::Receiver<bool>,
    /// Where imported images' files go.
    pub images: Arc<keel_hv::images::ImageStore>,
    /// The node this process runs guests on, if any: consoles and console
    /// logs of VMs there are served from it.
    pub node: Option<NodeAccess>,
    /// The caps on VMs, snapshots, images and follow streams.
    pub limits: limits::ApiLimits,
    /// The event streams followed now, against `limits.max_follows`.
    pub follows: Arc<limits::FollowSlots>,
    /// The VMs counted against `limits.max_vms`, and the creates' places.
    pub vm_count: vm_count::VmCount,
    /// This server's cluster credentials (`agent_link`), with which it
    /// reaches other nodes' agents for their consoles; `None`: it does not.
    pub cluster_creds: Option<std::path::PathBuf>,
    /// The URL imports in progress, for their progress reports.
    pub image_imports: Arc<image_urls::ImageImports>,
}

/// A node whose hypervisor is in this process.
#[derive(Clone)]
pub struct NodeAccess {
    pub node: String,
    pub hv: Arc<dyn keel_hv::Hypervisor>,
}

pub fn router(state: AppState, door: Door) -> Router {
    let metrics = state.metrics.clone();
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .route("/api/v1/openapi.json", get(openapi::document))
        .route("/api/v1/vms", get(vms::list).post(vms::create))
        .route("/api/v1/vms/{name}", get(vms::get).delete(vms::delete))
        .route("/api/v1/vm-stats", get(vm_stats::list))
        .route("/api/v1/vms/{name}/spec", put(vms::replace_spec))
        .route("/api/v1/vms/{name}/start", post(vms::start))
        .route("/api/v1/vms/{name}/stop", post(vms::stop))
        .route("/api/v1/vms/{name}/restart", post(vms::restart))
        .route("/api/v1/vms/{name}/reboot", post(vms::reboot))
        .route("/api/v1/vms/{name}/disks", post(disks::add))
        .route("/api/v1/vms/{name}/disks/{disk}", delete(disks::remove))
        .route(
            "/api/v1/vms/{name}/disks/{disk}/resize",
            post(disks::resize),
        )
        .route("/api/v1/vms/{name}/restore", post(snapshots::restore))
        .route("/api/v1/vms/{name}/clone", post(clone::clone))
        .route("/api/v1/vms/{name}/export", get(vm_export::export))
        .route(
            "/api/v1/vms/{name}/import",
            // The upload is unpacked as it streams: no body limit applies.
            put(vm_import::import).layer(DefaultBodyLimit::disable()),
        )
        .route("/api/v1/vms/{name}/migrate", post(migrate::migrate))
        .route("/api/v1/vms/{name}/console", get(console::attach))
        .route("/api/v1/vms/{name}/console/log", get(console::log))
        .route("/api/v1/vms/{name}/vnc", get(vnc::attach))
        .route(
            "/api/v1/vms/{name}/snapshots",
            get(snapshots::list).post(snapshots::create),
        )
        .route(
            "/api/v1/vms/{name}/snapshots/{snap}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/api/v1/images", get(images::list))
        .route(
            "/api/v1/images/{name}",
            // The upload streams to a file: no body limit applies.
            put(images::import)
                .layer(DefaultBodyLimit::disable())
                .get(images::get)
                .delete(images::delete),
        )
        .route(
            "/api/v1/images/{name}/import-url",
            get(image_urls::progress).post(image_urls::import_url),
        )
        .route("/api/v1/events", get(events::list))
        .route("/api/v1/migrations", get(migrations::list))
        .route("/api/v1/nodes", get(nodes::list))
        .route("/api/v1/nodes/{name}", get(nodes::get))
        .route("/api/v1/nodes/{name}/cordon", post(nodes::cordon))
        .route("/api/v1/nodes/{name}/uncordon", post(nodes::uncordon))
        .route("/api/v1/nodes/{name}/drain", post(nodes::drain))
        .route("/api/v1/nodes/{name}/freeze", post(freeze::freeze))
        .route("/api/v1/nodes/{name}/labels", post(node_labels::label))
        .route("/api/v1/tokens", get(tokens::list).post(tokens::create))
        .route("/api/v1/tokens/{id}", delete(tokens::revoke))
        .route("/api/v1/whoami", get(whoami::whoami))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            door,
            require_token::require_token,
        ))
        .layer(middleware::from_fn_with_state(metrics, observe))
        .with_state(state)
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn metrics_text(State(state): State<AppState>) -> Result<Response, ApiError> {
    let agents = agent_figures::gather(&state).await?;
    let extra = (!agents.up.is_empty()).then(|| agents.registry());
    let text = state
        .metrics
        .render(&state.store, agents.rows, extra)
        .await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
        )],
        text,
    )
        .into_response())
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no such endpoint: {}", req.uri().path()))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// Outermost layer: counts every response by status and makes sure an
/// error response from anywhere (a layer, hyper) still has the JSON shape.
async fn observe(State(metrics): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    let resp = next.run(req).await;
    let status = resp.status();
    metrics.observe_request(&method, status.as_u16());
    tracing::debug!(%method, %path, status = status.as_u16(), "request");
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if (status.is_client_error() || status.is_server_error()) && !is_json {
        let reason = status.canonical_reason().unwrap_or("error");
        let mut fixed = ApiError::new(status, reason.to_string()).into_response();
        for name in [header::WWW_AUTHENTICATE, header::ALLOW] {
            if let Some(v) = resp.headers().get(&name) {
                fixed.headers_mut().insert(name, v.clone());
            }
        }
        return fixed;
    }
    resp
}
