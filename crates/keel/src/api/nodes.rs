//! `GET /api/v1/nodes` and `GET /api/v1/nodes/{name}`: the hosts that
//! run VMs, with what their heartbeat last reported.

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_api::Node;
use keel_ctrl::keys::{node_key, NODES_PREFIX};
use keel_store::Revision;
use serde::{Deserialize, Serialize};

use super::extract::{NameParam, QueryParams};
use super::{ApiError, AppState};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeResponse {
    pub revision: Revision,
    pub node: Node,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeList {
    pub revision: Revision,
    pub items: Vec<NodeResponse>,
}

pub async fn list(
    State(state): State<AppState>,
    query: QueryParams,
) -> Result<Json<NodeList>, ApiError> {
    query.finish()?;
    let (entries, revision) = state.store.list::<Node>(NODES_PREFIX).await?;
    let items = entries
        .into_iter()
        .map(|(_, e)| NodeResponse {
            revision: e.revision,
            node: e.value,
        })
        .collect();
    Ok(Json(NodeList { revision, items }))
}

pub async fn get(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    query: QueryParams,
) -> Result<Response, ApiError> {
    query.finish()?;
    let entry = state
        .store
        .get::<Node>(&node_key(&name))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("node {name} not found")).with_field("name"))?;
    let mut resp = Json(NodeResponse {
        revision: entry.revision,
        node: entry.value,
    })
    .into_response();
    resp.headers_mut().insert(
        header::ETAG,
        HeaderValue::from_str(&format!("\"{}\"", entry.revision))
            .expect("digits are a valid header"),
    );
    Ok(resp)
}
