//! `GET /api/v1/openapi.json`: the API described as OpenAPI 3.1.
//!
//! The schemas are derived (utoipa's `ToSchema`) from the very types the
//! handlers parse and answer with, their descriptions from those types'
//! doc comments: a field added, renamed or dropped there is in the
//! document at once. utoipa's bounds attributes take number literals
//! only, so the bounds are set here, each from the constant validation
//! applies ([`BOUNDS`]). The paths are written per route (here and in the
//! route's module); the tests hold them to the router and the role table.

use axum::Json;
use serde_json::{json, Value};

use super::{paging, MAX_BODY_BYTES};

pub async fn document() -> Json<Value> {
    Json(spec())
}

pub fn spec() -> Value {
    let name_param = json!({
        "name": "name", "in": "path", "required": true,
        "schema": {"$ref": "#/components/schemas/Name"}
    });
    let [page_limit, page_continue] = paging::openapi_parameters();
    let revision_query = json!({
        "name": "revision", "in": "query", "required": false,
        "description": "The revision you read; the request fails with 409 if the record changed since.",
        "schema": {"type": "integer", "minimum": 0}
    });
    let if_match = json!({
        "name": "If-Match", "in": "header", "required": false,
        "description": "The revision you read (the ETag); 409 if the record changed since.",
        "schema": {"type": "string"}
    });
    let errors = |codes: &[&str]| -> Value {
        let mut map = serde_json::Map::new();
        for code in codes {
            let description = match *code {
                "400" => "Malformed input: bad JSON, wrong type, unknown field, bad name or query parameter",
                "401" => "Missing or wrong bearer token",
                "403" => "The token's role may not do this (see README, Tokens and roles)",
                "429" => "The token's request rate limit",
                "404" => "No such resource",
                "409" => "Refused by the current state: already exists, stale revision, run policy, deletion in progress",
                "413" => "Body larger than the limit",
                "422" => "Well-formed but invalid values (range, name rules)",
                "428" => "A revision is required (If-Match, ?revision= or \"revision\")",
                "503" => "Store unavailable or the record kept changing; retry",
                _ => "Error",
            };
            map.insert(
                code.to_string(),
                json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}),
            );
        }
        Value::Object(map)
    };
    let with = |mut ok: Value, errs: Value| -> Value {
        ok.as_object_mut()
            .expect("object")
            .extend(errs.as_object().expect("object").clone());
        ok
    };
    let vm_ok = |code: &str, description: &str| -> Value {
        json!({code: {
            "description": description,
            "headers": {"ETag": {"description": "The record's revision, quoted", "schema": {"type": "string"}}},
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/VmResponse"}}}
        }})
    };
    let snap_param = json!({
        "name": "snap", "in": "path", "required": true,
        "description": "The snapshot's name (errors about it name the field `snapshot`)",
        "schema": {"$ref": "#/components/schemas/Name"}
    });
    let snap_ok = |code: &str, description: &str| -> Value {
        json!({code: {
            "description": description,
            "headers": {"ETag": {"description": "The record's revision, quoted", "schema": {"type": "string"}}},
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SnapshotResponse"}}}
        }})
    };
    let node_ok = |code: &str, description: &str, schema: &str| -> Value {
        json!({code: {
            "description": description,
            "headers": {"ETag": {"description": "The record's revision, quoted", "schema": {"type": "string"}}},
            "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}
        }})
    };
    let power = |verb: &str, what: &str| -> Value {
        json!({"post": {
            "summary": what,
            "operationId": format!("{verb}Vm"),
            "parameters": [name_param, revision_query, if_match],
            "responses": with(vm_ok("200", "The VM with the request recorded; the controller acts on it"), errors(&["400", "401", "404", "409", "503"]))
        }})
    };

    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Keel API",
            "version": "v1",
            "description": format!("VM lifecycle management. Every /api/v1 path and /metrics need `Authorization: Bearer <token>` (DATA_DIR/token, or one made by POST /api/v1/tokens) of a role the route allows (viewer reads; operator powers, snapshots, migrates, consoles; admin everything; else 403); /healthz is open. Request bodies are limited to {MAX_BODY_BYTES} bytes. Errors are {{\"error\": message, \"field\": offending field}}.")
        },
        "security": [{"bearer": []}],
        "paths": {
            "/healthz": {"get": {
                "summary": "Liveness", "security": [], "operationId": "healthz",
                "responses": {"200": {"description": "Serving", "content": {"application/json": {"schema": {"type": "object"}}}}}
            }},
            "/metrics": {"get": {
                "summary": "Prometheus metrics (OpenMetrics text): keel_vms{phase}, keel_reconcile_errors_total, keel_api_requests_total{method,status}; per VM on this server's node keel_vm_*{vm,node,instance} (CPU, memory, disks, network, uptime, restarts, readiness)",
                "operationId": "metrics",
                "responses": with(json!({"200": {"description": "Metrics", "content": {"application/openmetrics-text": {"schema": {"type": "string"}}}}}), errors(&["401", "503"]))
            }},
            "/api/v1/openapi.json": {"get": {
                "summary": "This document", "operationId": "openapi",
                "responses": with(json!({"200": {"description": "OpenAPI document", "content": {"application/json": {"schema": {"type": "object"}}}}}), errors(&["401"]))
            }},
            "/api/v1/vms": {
                "get": {
                    "summary": "List VMs", "operationId": "listVms",
                    "parameters": paging::openapi_parameters(),
                    "responses": with(json!({"200": {"description": "All VMs", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/VmList"}}}}}), errors(&["401", "503"]))
                },
                "post": {
                    "summary": "Create a VM", "operationId": "createVm",
                    "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreateVmRequest"}}}},
                    "responses": with(vm_ok("201", "Created"), errors(&["400", "401", "409", "413", "422", "503"]))
                }
            },
            "/api/v1/vms/{name}": {
                "get": {
                    "summary": "Get a VM", "operationId": "getVm",
                    "parameters": [name_param],
                    "responses": with(vm_ok("200", "The VM"), errors(&["400", "401", "404", "503"]))
                },
                "delete": {
                    "summary": "Request deletion: the instance is stopped, disks removed, then the record", "operationId": "deleteVm",
                    "parameters": [name_param, revision_query, if_match],
                    "responses": with(vm_ok("202", "Deletion requested"), errors(&["400", "401", "404", "409", "503"]))
                }
            },
            "/api/v1/vms/{name}/spec": {"put": {
                "summary": "Replace the spec (needs the revision read)", "operationId": "replaceVmSpec",
                "parameters": [name_param, revision_query, if_match],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReplaceSpecRequest"}}}},
                "responses": with(vm_ok("200", "Replaced"), errors(&["400", "401", "404", "409", "413", "422", "428", "503"]))
            }},
            "/api/v1/vms/{name}/start": power("start", "Ask the VM to run"),
            "/api/v1/vms/{name}/stop": power("stop", "Ask the VM to stop (graceful, forced after the grace period)"),
            "/api/v1/vms/{name}/restart": power("restart", "Restart: the old instance stops before a new one starts"),
            "/api/v1/vms/{name}/restore": {"post": {
                "summary": "Restore a Ready snapshot: the VM is stopped, disks and spec put back, and it returns to the power state it had (recorded in power_intent)",
                "operationId": "restoreVm",
                "parameters": [name_param, revision_query, if_match],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RestoreVmRequest"}}}},
                "responses": with(vm_ok("202", "Restore recorded; `restore` is cleared when done, `power_intent` once the VM is back in that state"), errors(&["400", "401", "404", "409", "413", "422", "503"]))
            }},
            "/api/v1/vms/{name}/migrate": {"post": {
                "summary": "Live-migrate the running VM (to `to`, or the scheduler's best node) with a drain's tuning and limits; a failure leaves it running where it is, the reason in status.migrate_outcome",
                "operationId": "migrateVm",
                "parameters": [name_param, revision_query, if_match],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/MigrateVmRequest"}}}},
                "responses": with(vm_ok("202", "Migration requested; `status.migrate_outcome` tells how it ended"), errors(&["400", "401", "404", "409", "413", "422", "503"]))
            }},
            "/api/v1/vms/{name}/console": {"get": {
                "summary": "Attach to the serial console: a WebSocket (Upgrade: websocket) carrying raw console bytes both ways in binary messages; one session per instance (409 while one is attached); 501 when the VM's node is not this server's",
                "operationId": "attachConsole",
                "parameters": [name_param],
                "responses": with(json!({"101": {"description": "Switching to the WebSocket"}}), errors(&["400", "401", "404", "409", "501", "503"]))
            }},
            "/api/v1/vms/{name}/console/log": {"get": {
                "summary": "The end (at most 1 MiB) of the current instance's console log, as text/plain; X-Keel-Instance names the instance",
                "operationId": "consoleLog",
                "parameters": [name_param, {"name": "tail", "in": "query", "required": false, "description": "Only the last N lines", "schema": {"type": "integer", "minimum": 0}}],
                "responses": with(json!({"200": {"description": "Console log", "content": {"text/plain": {"schema": {"type": "string"}}}}}), errors(&["400", "401", "404", "409", "501", "503"]))
            }},
            "/api/v1/vms/{name}/snapshots": {
                "get": {
                    "summary": "List the VM's snapshots, oldest first", "operationId": "listSnapshots",
                    "parameters": [name_param, page_limit, page_continue],
                    "responses": with(json!({"200": {"description": "Snapshots", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SnapshotList"}}}}}), errors(&["400", "401", "404", "503"]))
                },
                "post": {
                    "summary": "Request a snapshot of the VM's disks (taken live if it runs); refused while a restore or deletion is pending",
                    "operationId": "createSnapshot",
                    "parameters": [name_param],
                    "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreateSnapshotRequest"}}}},
                    "responses": with(snap_ok("201", "Recorded as Pending; the controller takes it (Ready or Failed)"), errors(&["400", "401", "404", "409", "413", "422", "503"]))
                }
            },
            "/api/v1/vms/{name}/snapshots/{snap}": {
                "get": {
                    "summary": "Get a snapshot", "operationId": "getSnapshot",
                    "parameters": [name_param, snap_param],
                    "responses": with(snap_ok("200", "The snapshot"), errors(&["400", "401", "404", "503"]))
                },
                "delete": {
                    "summary": "Request deletion: removed from the disks, then the record; refused while the VM is restored from it",
                    "operationId": "deleteSnapshot",
                    "parameters": [name_param, snap_param, revision_query, if_match],
                    "responses": with(snap_ok("202", "Deletion requested"), errors(&["400", "401", "404", "409", "503"]))
                }
            },
            "/api/v1/events": {"get": {
                "summary": "Recorded VM phase changes, oldest first", "operationId": "listEvents",
                "parameters": [
                    {"name": "vm", "in": "query", "required": false, "schema": {"$ref": "#/components/schemas/Name"}},
                    {"name": "follow", "in": "query", "required": false, "description": "Stream newline-delimited EventItem JSON, recorded events first, then new ones (no limit or continue)", "schema": {"type": "boolean"}},
                    page_limit, page_continue
                ],
                "responses": with(json!({"200": {"description": "Events", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/EventList"}},
                    "application/x-ndjson": {"schema": {"$ref": "#/components/schemas/EventItem"}}
                }}}), errors(&["400", "401", "503"]))
            }},
            "/api/v1/nodes": {"get": {
                "summary": "List nodes", "operationId": "listNodes",
                "responses": with(json!({"200": {"description": "Nodes", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/NodeList"}}}}}), errors(&["401", "503"]))
            }},
            "/api/v1/nodes/{name}": {"get": {
                "summary": "Get a node", "operationId": "getNode",
                "parameters": [name_param],
                "responses": with(node_ok("200", "The node", "NodeResponse"), errors(&["400", "401", "404", "503"]))
            }},
            "/api/v1/nodes/{name}/cordon": {"post": {
                "summary": "Operator cordon: no new VM is placed on the node; lifted only by uncordon with operator=true",
                "operationId": "cordonNode",
                "parameters": [name_param, revision_query, if_match],
                "responses": with(node_ok("200", "Cordoned", "NodeResponse"), errors(&["400", "401", "404", "409", "503"]))
            }},
            "/api/v1/nodes/{name}/uncordon": {"post": {
                "summary": "End a drain and lift Keel's own cordon; with operator=true an operator's cordon too",
                "operationId": "uncordonNode",
                "parameters": [name_param, revision_query, if_match],
                "requestBody": {"required": false, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/UncordonRequest"}}}},
                "responses": with(node_ok("200", "The node, whether it is schedulable, and whether an operator's cordon remains", "UncordonResponse"), errors(&["400", "401", "404", "409", "413", "503"]))
            }},
            "/api/v1/nodes/{name}/drain": {"post": {
                "summary": "Drain: cordon (if nobody has) and move every VM off, by live migration first, else stop here and start elsewhere; each phase bounded by its window. An active drain keeps its start and windows.",
                "operationId": "drainNode",
                "parameters": [name_param, revision_query, if_match],
                "requestBody": {"required": false, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DrainRequest"}}}},
                "responses": with(node_ok("202", "Drain recorded; drain.completed_at is set once no VM is left on the node", "NodeResponse"), errors(&["400", "401", "404", "409", "413", "422", "503"]))
            }},
            "/api/v1/nodes/{name}/freeze": {"post": {
                "summary": "Freeze the node for a planned agent restart: its VMs are not taken over until the freeze ends (counted by each observer from when it first sees it), its guests keep running, and they are fenced at its end if the agent has not returned. Only the node's agent ends a freeze; one in force is replaced only by one at least as long.",
                "operationId": "freezeNode",
                "parameters": [name_param, revision_query, if_match],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/FreezeRequest"}}}},
                "responses": with(node_ok("200", "Frozen", "NodeResponse"), errors(&["400", "401", "404", "409", "413", "422", "503"]))
            }},
            "/api/v1/migrations": {"get": {
                "summary": "Live migration attempts, oldest first", "operationId": "listMigrations",
                "parameters": [
                    {"name": "vm", "in": "query", "required": false, "schema": {"$ref": "#/components/schemas/Name"}}
                ],
                "responses": with(json!({"200": {"description": "Migrations", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/MigrationList"}}}}}), errors(&["400", "401", "503"]))
            }}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas()
        }
    });
    super::images::describe(&mut doc);
    super::image_urls::describe(&mut doc);
    super::tokens::describe(&mut doc);
    super::disks::describe(&mut doc);
    super::clone::describe(&mut doc);
    super::vm_export::describe(&mut doc);
    super::vm_import::describe(&mut doc);
    super::node_labels::describe(&mut doc);
    super::vnc_doc::describe(&mut doc);
    super::vm_stats::describe(&mut doc);
    super::whoami::describe(&mut doc);
    super::vm_watch::describe(&mut doc);
    super::ws_auth::describe(&mut doc);
    // Outside the macro above, which is at serde_json's recursion limit.
    doc["paths"]["/api/v1/vms/{name}/reboot"] = power(
        "reboot",
        "Reboot the running guest inside the same instance: through its guest agent, reset by \
         the hypervisor after the stop grace period (at once without an agent); 409 naming \
         status.phase unless the VM is Running",
    );
    doc
}

/// Every request and response body of the API; the types they hold are
/// collected with them.
#[derive(utoipa::OpenApi)]
#[openapi(components(schemas(
    super::error::ErrorBody,
    super::vms::CreateVmRequest,
    super::vms::ReplaceSpecRequest,
    super::vms::VmResponse,
    super::vms::VmList,
    super::events::EventItem,
    super::events::EventList,
    super::nodes::UncordonRequest,
    super::nodes::UncordonResponse,
    super::nodes::DrainRequest,
    super::nodes::NodeResponse,
    super::nodes::NodeList,
    super::freeze::FreezeRequest,
    super::node_labels::LabelRequest,
    super::snapshots::CreateSnapshotRequest,
    super::snapshots::RestoreVmRequest,
    super::snapshots::SnapshotResponse,
    super::snapshots::SnapshotList,
    super::migrate::MigrateVmRequest,
    super::migrations::MigrationItem,
    super::migrations::MigrationList,
    super::clone::CloneVmRequest,
    super::disks::AddDiskRequest,
    super::disks::ResizeDiskRequest,
    super::images::ImageResponse,
    super::images::ImageList,
    super::image_urls::ImportUrlRequest,
    super::image_urls::ImportProgress,
    super::tokens::TokenList,
    super::tokens::TokenResponse,
    super::tokens::CreatedToken,
    keel_api::CreateTokenRequest,
    crate::metrics::vm_figures::VmStatsPage,
)))]
struct Bodies;

/// A bound validation applies to a property, published on it.
#[derive(Debug, Clone, Copy)]
pub enum Bound {
    /// An integer in `min..=max`.
    Range(u64, u64),
    /// A string of at most this many bytes.
    MaxLength(usize),
    /// A list of at most this many items.
    MaxItems(usize),
    /// A resource name (`validate_name`).
    Name,
    /// A VM's name (`validate_vm_name`): shorter, for the ids derived from it.
    VmName,
    /// A string matching this pattern.
    Pattern(&'static str),
    /// Node labels (`placement::validate_labels`): at most so many, each
    /// key and value at most so long.
    Labels,
}

const NAME_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";

/// `(schema, property, bound)`, each bound read from the constant the
/// validation of that property uses.
pub const BOUNDS: &[(&str, &str, Bound)] = {
    use keel_api::migration::{
        MAX_BANDWIDTH_MIB_S, MAX_DOWNTIME_LIMIT_MS, MAX_MIGRATION_TIMEOUT_S,
        MAX_PARALLEL_MIGRATIONS,
    };
    use keel_api::{MAX_CMDLINE_BYTES, MAX_DISKS, MAX_DISK_SIZE_MIB, MAX_STOP_GRACE_PERIOD_S};
    use Bound::{Labels, MaxItems, MaxLength, Name, Pattern, Range, VmName};
    const WINDOW: Bound = Range(super::nodes::MIN_WINDOW_S, super::nodes::MAX_WINDOW_S);
    const DISK_SIZE: Bound = Range(1, MAX_DISK_SIZE_MIB);
    const TIMEOUT: Bound = Range(1, MAX_MIGRATION_TIMEOUT_S);
    const PARALLEL: Bound = Range(1, MAX_PARALLEL_MIGRATIONS);
    &[
        ("CreateVmRequest", "name", VmName),
        ("VirtualMachine", "name", VmName),
        ("VmSpec", "cpus", Range(1, keel_api::MAX_CPUS as u64)),
        (
            "VmSpec",
            "memory_mib",
            Range(keel_api::MIN_MEMORY_MIB, keel_api::MAX_MEMORY_MIB),
        ),
        ("VmSpec", "disks", MaxItems(MAX_DISKS)),
        (
            "VmSpec",
            "stop_grace_period_s",
            Range(1, MAX_STOP_GRACE_PERIOD_S),
        ),
        ("VmSpec", "node", Name),
        ("DiskSpec", "name", Name),
        ("DiskSpec", "size_mib", DISK_SIZE),
        ("DiskSpec", "image", Name),
        ("BootSpec", "cmdline", MaxLength(MAX_CMDLINE_BYTES)),
        ("BootSpec", "kernel", Name),
        ("BootSpec", "initrd", Name),
        ("BootSpec", "cdrom", Name),
        ("PlacementRules", "node_selector", Labels),
        ("AntiAffinity", "group", Name),
        ("PlacementRules", "affinity", Name),
        ("AddDiskRequest", "size_mib", DISK_SIZE),
        ("ResizeDiskRequest", "size_mib", DISK_SIZE),
        ("CloneVmRequest", "name", VmName),
        ("CloneVmRequest", "snapshot", Name),
        ("CreateSnapshotRequest", "name", Name),
        ("RestoreVmRequest", "snapshot", Name),
        ("MigrateVmRequest", "to", Name),
        ("Snapshot", "name", Name),
        ("Node", "name", Name),
        ("Node", "labels", Labels),
        ("LabelRequest", "set", Labels),
        ("DrainRequest", "submit_window_s", WINDOW),
        ("DrainRequest", "migrate_window_s", WINDOW),
        ("DrainRequest", "fallback_window_s", WINDOW),
        (
            "FreezeRequest",
            "for_s",
            Range(1, keel_api::MAX_FREEZE_MS / 1000),
        ),
        (
            "FreezeRequest",
            "reason",
            MaxLength(super::freeze::MAX_REASON_BYTES),
        ),
        ("MigrationTuning", "completion_timeout_per_gib_s", TIMEOUT),
        ("MigrationTuning", "progress_timeout_s", TIMEOUT),
        (
            "MigrationTuning",
            "bandwidth_mib_s",
            Range(1, MAX_BANDWIDTH_MIB_S),
        ),
        (
            "MigrationTuning",
            "downtime_limit_ms",
            Range(1, MAX_DOWNTIME_LIMIT_MS),
        ),
        ("MigrationTuning", "parallel_per_cluster", PARALLEL),
        ("MigrationTuning", "parallel_per_node", PARALLEL),
        ("CreateTokenRequest", "name", Name),
        (
            "CreateTokenRequest",
            "expires_in_s",
            Range(1, keel_api::api_token::MAX_TOKEN_LIFETIME_S),
        ),
        ("Image", "sha256", Pattern("^[0-9a-f]{64}$")),
        ("ImportUrlRequest", "sha256", Pattern("^[0-9a-fA-F]{64}$")),
        ("ImportUrlRequest", "sha512", Pattern("^[0-9a-fA-F]{128}$")),
    ]
};

impl Bound {
    fn keywords(self) -> Value {
        match self {
            Bound::Range(min, max) => json!({"minimum": min, "maximum": max}),
            Bound::MaxLength(max) => json!({"maxLength": max}),
            Bound::MaxItems(max) => json!({"maxItems": max}),
            Bound::Name => json!({"pattern": NAME_PATTERN, "maxLength": keel_api::MAX_NAME_LEN}),
            Bound::VmName => {
                json!({"pattern": NAME_PATTERN, "maxLength": keel_api::name::MAX_VM_NAME_LEN})
            }
            Bound::Pattern(pattern) => json!({"pattern": pattern}),
            Bound::Labels => json!({
                "maxProperties": keel_api::placement::MAX_LABELS,
                "propertyNames": {"maxLength": keel_api::placement::MAX_LABEL_LEN},
                "additionalProperties": {"type": "string", "maxLength": keel_api::placement::MAX_LABEL_LEN}
            }),
        }
    }
}

/// utoipa takes a type alias (`Millis`, `Revision`: u64; `Labels`: a
/// map) for a type of its own and refers to a schema named after what it
/// stands for (`u64`, `BTreeMap`); those references are replaced by the
/// schema itself, which then goes.
fn inline_aliases(schemas: &mut Value) {
    const ALIASED: [&str; 2] = ["u64", "BTreeMap"];
    let Some(all) = schemas.as_object_mut() else {
        return;
    };
    let targets: Vec<(String, Value)> = ALIASED
        .iter()
        .filter_map(|name| Some((format!("#/components/schemas/{name}"), all.remove(*name)?)))
        .collect();
    fn walk(value: &mut Value, targets: &[(String, Value)]) {
        match value {
            Value::Object(map) => {
                let aliased = map
                    .get("$ref")
                    .and_then(|r| targets.iter().find(|(t, _)| r == t));
                if let Some((_, Value::Object(schema))) = aliased {
                    map.remove("$ref");
                    for (key, v) in schema {
                        map.entry(key.clone()).or_insert_with(|| v.clone());
                    }
                }
                map.values_mut().for_each(|v| walk(v, targets));
            }
            Value::Array(items) => items.iter_mut().for_each(|v| walk(v, targets)),
            _ => {}
        }
    }
    all.values_mut().for_each(|v| walk(v, &targets));
}

/// The derived schemas with [`BOUNDS`] set on their properties, and
/// `Name`, which path parameters refer to. A row whose property is not
/// there (renamed, say) is left out; a test fails on it.
fn schemas() -> Value {
    let components = <Bodies as utoipa::OpenApi>::openapi().components;
    let mut schemas = serde_json::to_value(components.map(|c| c.schemas).unwrap_or_default())
        .unwrap_or_else(|_| json!({}));
    inline_aliases(&mut schemas);
    for (schema, property, bound) in BOUNDS {
        if let Some(target) = schemas[*schema]["properties"][*property].as_object_mut() {
            if let Value::Object(keywords) = bound.keywords() {
                target.extend(keywords);
            }
        }
    }
    schemas["Name"] = json!({"type": "string"});
    if let Value::Object(keywords) = Bound::Name.keywords() {
        if let Some(name) = schemas["Name"].as_object_mut() {
            name.extend(keywords);
        }
    }
    schemas
}

#[cfg(test)]
mod tests {
    use keel_api::migration::MigrationTuning;
    use keel_api::VmSpec;
    use serde_json::{json, Value};

    fn schema(name: &str) -> Value {
        super::spec()["components"]["schemas"][name].clone()
    }

    /// Every bound names a property the derived schemas have: a field
    /// renamed or moved fails here rather than losing its bound quietly.
    #[test]
    fn every_bound_names_a_derived_property() {
        let derived = serde_json::to_value(
            <super::Bodies as utoipa::OpenApi>::openapi()
                .components
                .unwrap()
                .schemas,
        )
        .unwrap();
        for (schema, property, _) in super::BOUNDS {
            assert!(
                derived[*schema]["properties"][*property].is_object(),
                "{schema}.{property} is not in the derived document"
            );
        }
    }

    /// Every `$ref` of the document names one of its schemas.
    #[test]
    fn every_reference_resolves() {
        let doc = super::spec();
        let text = doc.to_string();
        let mut checked = 0;
        for piece in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = piece.split('"').next().unwrap();
            assert!(
                doc["components"]["schemas"].get(name).is_some(),
                "dangling $ref {name}"
            );
            checked += 1;
        }
        assert!(checked > 50, "{checked} references");
    }

    /// The document's bound, and the validation's verdict at it and one
    /// past it, must agree: the two read one constant.
    #[test]
    fn the_documents_maxima_are_the_ones_validation_applies() {
        let tuning = schema("MigrationTuning");
        let mut checked = 0;
        for (field, property) in tuning["properties"].as_object().unwrap() {
            let Some(max) = property["maximum"].as_u64() else {
                continue;
            };
            let with = |v: u64| {
                let mut t = serde_json::to_value(MigrationTuning::default()).unwrap();
                t[field.as_str()] = json!(v);
                serde_json::from_value::<MigrationTuning>(t)
                    .unwrap()
                    .validate()
            };
            assert!(with(max).is_ok(), "{field} at its documented maximum {max}");
            let past = with(max + 1).expect_err(field);
            assert_eq!(past.field, format!("tuning.{field}"));
            checked += 1;
        }
        assert_eq!(checked, 6, "every bounded tuning field is checked");

        let grace = schema("VmSpec")["properties"]["stop_grace_period_s"]["maximum"]
            .as_u64()
            .unwrap();
        let spec = |s: u64| VmSpec {
            stop_grace_period_s: s,
            ..keel_testkit::spec::vm_spec()
        };
        assert!(spec(grace).validate().is_ok());
        assert_eq!(
            spec(grace + 1).validate().unwrap_err().field,
            "spec.stop_grace_period_s"
        );

        let cmdline = schema("BootSpec")["properties"]["cmdline"]["maxLength"]
            .as_u64()
            .unwrap() as usize;
        let boot = |len: usize| {
            let mut s = keel_testkit::spec::vm_spec();
            s.boot.kernel = Some("k".into());
            s.boot.cmdline = Some("x".repeat(len));
            s.validate()
        };
        assert!(boot(cmdline).is_ok());
        assert_eq!(boot(cmdline + 1).unwrap_err().field, "spec.boot.cmdline");

        let name = schema("Name")["maxLength"].as_u64().unwrap() as usize;
        assert!(keel_api::validate_name("name", &"a".repeat(name)).is_ok());
        assert!(keel_api::validate_name("name", &"a".repeat(name + 1)).is_err());
    }
}
