//! `POST /api/v1/nodes/{name}/labels`: the operator's labels on a node,
//! which VMs' node selectors require (`keel_api::placement`). A label
//! removed does not move a VM already running there; its next start goes
//! by the labels of that moment.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use keel_api::placement::validate_labels;
use keel_api::Labels;
use serde::{Deserialize, Serialize};

use super::extract::{JsonBody, NameParam, QueryParams};
use super::nodes::{mutate_node, node_response};
use super::write::expected_revision;
use super::{ApiError, AppState};

#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LabelRequest {
    /// Labels to set (a key already there takes the new value).
    #[serde(default)]
    pub set: Labels,
    /// Keys to remove (one not there is no error).
    #[serde(default)]
    pub remove: Vec<String>,
}

pub async fn label(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    JsonBody(req): JsonBody<LabelRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    validate_labels("set", &req.set).map_err(invalid)?;
    if let Some(key) = req.remove.iter().find(|k| req.set.contains_key(*k)) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("remove: {key:?} is also in set"),
        )
        .with_field("remove"));
    }
    let (node, revision) = mutate_node(&state, &name, expected, |n| {
        n.labels.extend(req.set.clone());
        n.labels.retain(|k, _| !req.remove.contains(k));
        validate_labels("labels", &n.labels).map_err(invalid)
    })
    .await?;
    tracing::info!(node = %name, revision, labels = ?node.labels, "labels changed");
    Ok(node_response(StatusCode::OK, node, revision))
}

fn invalid(e: keel_api::ValidationError) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()).with_field(&e.field)
}

pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let mut responses = json!({"200": {"description": "The node with its labels", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/NodeResponse"}}}}});
    for (code, why) in [
        ("400", "Malformed name or body"),
        ("401", "Missing, wrong, expired or revoked bearer token"),
        ("403", "The token's role is not admin"),
        ("404", "No such node"),
        ("412", "The node's revision is not the one given"),
        ("422", "A label key or value that is not allowed, too many labels, or a key both set and removed (the field is named)"),
        ("503", "Store unavailable"),
    ] {
        responses[code] = error(why);
    }
    doc["paths"]["/api/v1/nodes/{name}/labels"] = json!({"post": {
        "summary": "Set and remove the node's labels (admin); VMs' node selectors require them at placement and start",
        "operationId": "labelNode",
        "parameters": [{"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}}],
        "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LabelRequest"}}}},
        "responses": responses
    }});
}
