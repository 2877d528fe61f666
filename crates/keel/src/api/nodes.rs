//! `/api/v1/nodes`: the hosts that run VMs, with what their heartbeat last
//! reported, and the operator's verbs on them: cordon, uncordon, drain
//! (and freeze, in `freeze.rs`).
//!
//! Keel lifts only the cordons it set itself (for a drain); an operator's
//! cordon is lifted only by `uncordon` with `{"operator": true}`.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use keel_api::{EvictionWindows, MigrationTuning, Millis, Node};
use keel_ctrl::keys::{node_key, NODES_PREFIX};
use keel_store::Revision;
use serde::{Deserialize, Serialize};

use super::extract::{NameParam, OptJsonBody, QueryParams};
use super::write::{self, expected_revision, with_etag};
use super::{ApiError, AppState};

/// Bounds of each eviction window, in seconds.
pub const MIN_WINDOW_S: u64 = 1;
pub const MAX_WINDOW_S: u64 = 86_400;

/// `POST /api/v1/nodes/{name}/uncordon`; the body is optional.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UncordonRequest {
    /// Lift an operator's cordon too (without it only Keel's own cordon and
    /// drain are lifted).
    #[serde(default)]
    pub operator: bool,
    /// Also ask the VMs this node's drains moved away to live-migrate back
    /// (`keel node uncordon --return`).
    #[serde(default, rename = "return")]
    pub return_vms: bool,
}

/// `POST /api/v1/nodes/{name}/drain`; the body is optional, each window
/// defaults to [`keel_api::node::DEFAULT_EVICTION_WINDOW_MS`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// Seconds from the start of a VM's eviction until its migration is under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submit_window_s: Option<u64>,
    /// Seconds from submission until the migration has completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate_window_s: Option<u64>,
    /// Seconds from giving up on migration until the VM is off the node
    /// (graceful stop, forced at the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_window_s: Option<u64>,
    /// How the drain's migrations are run and bounded; fields left out
    /// keep their defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tuning: Option<MigrationTuning>,
}

impl DrainRequest {
    /// The tuning asked for (defaults for what is left out), or a 422
    /// naming the field out of range.
    pub fn tuning(&self) -> Result<MigrationTuning, ApiError> {
        let tuning = self.tuning.unwrap_or_default();
        tuning.validate().map_err(|e| {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()).with_field(&e.field)
        })?;
        Ok(tuning)
    }

    /// The windows asked for, or a 422 naming the field out of range.
    pub fn windows(&self) -> Result<EvictionWindows, ApiError> {
        let default = EvictionWindows::default();
        let window = |field: &str, value: Option<u64>, default: Millis| match value {
            None => Ok(default),
            Some(s) if (MIN_WINDOW_S..=MAX_WINDOW_S).contains(&s) => Ok(s * 1000),
            Some(s) => Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("{field}: {s} is out of range {MIN_WINDOW_S}..={MAX_WINDOW_S} seconds"),
            )
            .with_field(field)),
        };
        Ok(EvictionWindows {
            submit_ms: window("submit_window_s", self.submit_window_s, default.submit_ms)?,
            migrate_ms: window(
                "migrate_window_s",
                self.migrate_window_s,
                default.migrate_ms,
            )?,
            fallback_ms: window(
                "fallback_window_s",
                self.fallback_window_s,
                default.fallback_ms,
            )?,
        })
    }
}

/// The node after an uncordon, and what it means.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UncordonResponse {
    pub revision: Revision,
    pub node: Node,
    /// New VMs may be placed on the node again.
    pub schedulable: bool,
    /// An operator's cordon remains (lift it with `{"operator": true}`).
    pub operator_cordon: bool,
    /// With `return`: the VMs asked back, and those that could not be.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "return")]
    pub returned: Option<super::drain_return::ReturnOutcome>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeResponse {
    pub revision: Revision,
    pub node: Node,
    /// What the VMs on it take of its capacity (those running there, and
    /// those placed there to run), as the VM records say now: in the
    /// answers to `GET /nodes` and `GET /nodes/{name}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<keel_api::Demand>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
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
    let load = allocations(&state).await?;
    let items = entries
        .into_iter()
        .map(|(_, e)| NodeResponse {
            revision: e.revision,
            allocated: Some(load.allocated(&e.value.name)),
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
        .ok_or_else(|| not_found(&name))?;
    let allocated = allocations(&state).await?.allocated(&name);
    Ok(with_etag(
        StatusCode::OK,
        NodeResponse {
            revision: entry.revision,
            node: entry.value,
            allocated: Some(allocated),
        },
        entry.revision,
    ))
}

/// What the VMs take of each node, from their records now.
async fn allocations(state: &AppState) -> Result<keel_ctrl::schedule::NodeLoad, ApiError> {
    let (vms, _) = state
        .store
        .list::<keel_api::VirtualMachine>(keel_ctrl::keys::VMS_PREFIX)
        .await?;
    Ok(keel_ctrl::schedule::NodeLoad::of(
        vms.iter().map(|(_, e)| &e.value),
    ))
}

/// The operator cordons the node: nothing new is placed on it. The cordon
/// is theirs (also when Keel had cordoned it for a drain): only
/// `uncordon` with `operator` lifts it.
pub async fn cordon(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    let (node, revision) = mutate(&state, &name, expected, |n| {
        n.cordon_by_operator();
        Ok(())
    })
    .await?;
    tracing::info!(node = %name, revision, "cordoned by operator");
    Ok(node_response(StatusCode::OK, node, revision))
}

/// Ends a drain and lifts Keel's own cordon; with `operator`, an
/// operator's cordon too.
pub async fn uncordon(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    OptJsonBody(req): OptJsonBody<UncordonRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    let req = req.unwrap_or_default();
    let (node, revision) = mutate(&state, &name, expected, |n| {
        let mut after = n.clone();
        after.uncordon_by_keel();
        if req.operator {
            after.cordoned = false;
            after.cordoned_by_keel = false;
        }
        if req.return_vms && after.cordoned {
            // Nothing may migrate to a cordoned node: refused before
            // anything changes.
            return Err(ApiError::conflict(
                "return",
                format!(
                    "node {name} stays cordoned by its operator, so no VM can return to it; \
                     add operator to lift that cordon too"
                ),
            ));
        }
        *n = after;
        Ok(())
    })
    .await?;
    let schedulable = !node.cordoned;
    let operator_cordon = node.cordoned && !node.cordoned_by_keel;
    tracing::info!(node = %name, revision, operator = req.operator, schedulable, "uncordoned");
    let returned = match req.return_vms {
        true => Some(super::drain_return::return_drained(&state, &name).await?),
        false => None,
    };
    Ok(with_etag(
        StatusCode::OK,
        UncordonResponse {
            revision,
            node,
            schedulable,
            operator_cordon,
            returned,
        },
        revision,
    ))
}

/// Starts a drain (cordoning the node if nobody has): every VM is moved
/// off, by live migration first, else stopped here and started elsewhere.
/// An active drain keeps its start and windows.
pub async fn drain(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    headers: HeaderMap,
    mut query: QueryParams,
    OptJsonBody(req): OptJsonBody<DrainRequest>,
) -> Result<Response, ApiError> {
    let from_query = query.take_u64("revision")?;
    query.finish()?;
    let expected = expected_revision(&headers, from_query, None)?;
    let req = req.unwrap_or_default();
    let windows = req.windows()?;
    let tuning = req.tuning()?;
    let now = state.clock.now_ms();
    let (node, revision) = mutate(&state, &name, expected, |n| {
        n.request_tuned_drain(now, windows, tuning);
        Ok(())
    })
    .await?;
    tracing::info!(node = %name, revision, ?windows, ?tuning, "drain requested");
    Ok(node_response(StatusCode::ACCEPTED, node, revision))
}

pub(crate) async fn mutate_node(
    state: &AppState,
    name: &str,
    expected: Option<Revision>,
    change: impl FnMut(&mut Node) -> Result<(), ApiError>,
) -> Result<(Node, Revision), ApiError> {
    mutate(state, name, expected, change).await
}

async fn mutate(
    state: &AppState,
    name: &str,
    expected: Option<Revision>,
    change: impl FnMut(&mut Node) -> Result<(), ApiError>,
) -> Result<(Node, Revision), ApiError> {
    write::mutate(
        state,
        &node_key(name),
        &format!("node {name}"),
        expected,
        || not_found(name),
        change,
    )
    .await
}

fn not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("node {name} not found")).with_field("name")
}

pub(crate) fn node_response(status: StatusCode, node: Node, revision: Revision) -> Response {
    with_etag(
        status,
        NodeResponse {
            revision,
            node,
            allocated: None,
        },
        revision,
    )
}
