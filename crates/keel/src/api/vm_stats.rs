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
    let disk = json!({"type": "object", "properties": {
        "disk": {"type": "string"}, "read_bytes": {"type": "integer"}, "write_bytes": {"type": "integer"},
        "read_ops": {"type": "integer"}, "write_ops": {"type": "integer"},
        "read_time_ns": {"type": "integer"}, "write_time_ns": {"type": "integer"}
    }});
    let nic = json!({"type": "object", "properties": {
        "nic": {"type": "string"}, "receive_bytes": {"type": "integer"}, "transmit_bytes": {"type": "integer"},
        "receive_packets": {"type": "integer"}, "transmit_packets": {"type": "integer"}
    }});
    let row = json!({"type": "object", "required": ["vm", "node", "instance", "cpus", "memory_configured_bytes", "ready", "restarts", "guest_resets", "disks", "nics"], "properties": {
        "vm": {"type": "string"}, "node": {"type": "string"}, "instance": {"type": "string"},
        "cpus": {"type": "integer"}, "memory_configured_bytes": {"type": "integer"},
        "ready": {"type": "boolean"}, "uptime_seconds": {"type": ["number", "null"]},
        "restarts": {"type": "integer"}, "guest_resets": {"type": "integer"},
        "cpu_seconds": {"type": ["number", "null"], "description": "CPU time of the VM's QEMU process"},
        "rss_bytes": {"type": ["integer", "null"], "description": "Resident memory of the VM's QEMU process"},
        "disks": {"type": "array", "items": disk},
        "nics": {"type": "array", "items": nic, "description": "Bridged NICs only: user-mode networking has no counters"},
        "guest_memory": {"type": "object", "description": "The guest's own view of its memory, as its balloon driver reports it; absent without a balloon device or before the first report", "properties": {
            "total_bytes": {"type": ["integer", "null"]}, "free_bytes": {"type": ["integer", "null"]},
            "available_bytes": {"type": ["integer", "null"]},
            "reported_at": {"type": "integer", "description": "When the guest sent the report (seconds since the epoch, the host's clock); asked every 10 s"}
        }}
    }});
    doc["components"]["schemas"]["VmStatsPage"] = json!({"type": "object", "required": ["node", "sampled_at", "vms"], "properties": {
        "node": {"type": ["string", "null"], "description": "The node whose VMs these are; null: this server runs no guests"},
        "sampled_at": {"type": "integer", "description": "When the hypervisor's figures were read (ms since the epoch)"},
        "stale_reason": {"type": "string", "description": "Why the figures are from an earlier read"},
        "vms": {"type": "array", "items": row},
        "agents": {"type": "array", "description": "With cluster=true: each agent node asked, and whether its rows are in vms", "items": {"type": "object", "required": ["node", "answered"], "properties": {
            "node": {"type": "string"}, "answered": {"type": "boolean"}
        }}}
    }});
}
