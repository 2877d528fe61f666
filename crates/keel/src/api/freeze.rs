//! `POST /api/v1/nodes/{name}/freeze`: a bounded freeze of a node, for a
//! planned agent restart (see `keel_api::NodeFreeze`): its VMs are not
//! taken over while it lasts, and its guests keep running. Only the node's
//! agent ends a freeze (when it is back, or once it is over), so there is
//! no unfreeze: a shorter freeze could let the cluster take over guests
//! whose fence lease was already extended by a longer one.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use keel_api::MAX_FREEZE_MS;
use serde::{Deserialize, Serialize};

use super::extract::{JsonBody, NameParam, QueryParams};
use super::nodes::{mutate_node, node_response};
use super::write::expected_revision;
use super::{ApiError, AppState};

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FreezeRequest {
    /// How long, in seconds (1..=3600), counted by each observer from when
    /// it first sees the freeze.
    pub for_s: u64,
    /// Shown on the node; default `frozen by operator`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

pub const MAX_REASON_BYTES: usize = 256;

pub async fn freeze(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    JsonBody(req): JsonBody<FreezeRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    let max_s = MAX_FREEZE_MS / 1000;
    if !(1..=max_s).contains(&req.for_s) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("for_s: {} is out of range 1..={max_s} seconds", req.for_s),
        )
        .with_field("for_s"));
    }
    let reason = req
        .reason
        .clone()
        .unwrap_or_else(|| "frozen by operator".into());
    if reason.len() > MAX_REASON_BYTES || reason.contains(['\n', '\0']) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("reason: at most {MAX_REASON_BYTES} bytes on one line"),
        )
        .with_field("reason"));
    }
    let now = state.clock.now_ms();
    let (node, revision) = mutate_node(&state, &name, expected, |n| {
        n.request_freeze(now, req.for_s * 1000, reason.clone())
            .map_err(|e| ApiError::refused(e).with_field("for_s"))
    })
    .await?;
    tracing::warn!(node = %name, revision, for_s = req.for_s, %reason, "node frozen: its VMs are not taken over until the freeze ends");
    Ok(node_response(StatusCode::OK, node, revision))
}
