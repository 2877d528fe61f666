//! `GET /api/v1/vm-stats`: the figures of the VMs running on this server's
//! node (CPU time, memory, disk and network counters, uptime, readiness),
//! the same rows `/metrics` encodes as series. `keel vm top` reads it
//! twice and shows the rates between.
//!
//! With `?cluster=true` a control plane adds the rows of its bare agent
//! nodes, asked as its `/metrics` asks them (`super::agent_figures`), so
//! `keel vm top` sees the whole cluster from one server. Opt-in: the
//! agents themselves are asked without it, so no server ever asks
//! another to ask further.

use axum::extract::State;
use axum::Json;

use super::extract::QueryParams;
use super::{ApiError, AppState};
use crate::metrics::vm_figures::{AgentAnswer, VmStatsPage};

pub async fn list(
    State(state): State<AppState>,
    mut query: QueryParams,
) -> Result<Json<VmStatsPage>, ApiError> {
    let cluster = query.take_bool("cluster")?.unwrap_or(false);
    query.finish()?;
    let mut page = state.metrics.vm_stats(&state.store).await?;
    if cluster {
        let agents = super::agent_figures::gather(&state).await?;
        page.vms.extend(agents.rows);
        page.vms
            .sort_by(|a, b| (&a.vm, &a.node).cmp(&(&b.vm, &b.node)));
        page.agents = agents
            .up
            .into_iter()
            .map(|(node, answered)| AgentAnswer { node, answered })
            .collect();
    }
    Ok(Json(page))
}

/// Its path and schema in the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    doc["paths"]["/api/v1/vm-stats"] = json!({"get": {
        "summary": "Figures of the VMs running on this server's node (CPU time, memory, disk and network counters, uptime, readiness): what /metrics reports per VM",
        "operationId": "vmStats",
        "parameters": [{"name": "cluster", "in": "query", "required": false, "schema": {"type": "boolean"},
            "description": "Also the VMs of the cluster's bare agent nodes, asked over the agent link as /metrics asks them"}],
        "responses": {
            "200": {"description": "Per-VM figures", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/VmStatsPage"}}}},
            "401": {"description": "Missing or wrong bearer token", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            "503": {"description": "Store unavailable or the record kept changing; retry", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        }
    }});
}
