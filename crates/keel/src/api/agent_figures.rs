//! The per-VM figures of a cluster's bare agent nodes on the control
//! plane's `/metrics`: at each scrape the control plane asks each agent
//! that serves a console port (`keel agent --console-listen`, its URL on
//! its node record) for `GET /api/v1/vm-stats` over the same mutual-TLS
//! link the consoles use (`crate::agent_link`), and encodes their rows
//! beside its own node's. One scrape target for the whole cluster, no
//! second set of credentials for Prometheus, and an agent's port stays
//! closed to everyone but the control planes.
//!
//! An agent that does not answer (in time) leaves its VMs out of that
//! scrape and says so: `keel_agent_vm_figures_up{node} 0`, and the reason
//! in the control plane's log.

use std::time::Duration;

use futures_util::StreamExt;
use keel_api::Node;
use keel_ctrl::keys::NODES_PREFIX;
use keel_store::StoreError;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::AppState;
use crate::metrics::vm_figures::{VmFigures, VmStatsPage};

/// How long one agent may take to answer; a scrape waits at most about
/// this long for all of them (they are asked at once, a few at a time).
const AGENT_TIMEOUT: Duration = Duration::from_secs(5);
/// The most one agent's page may be (a few hundred bytes per VM).
const MAX_PAGE_BYTES: u64 = 64 << 20;
/// Agents asked at the same time.
const AT_ONCE: usize = 16;

/// What the agents answered: their VMs' rows, and which agents did.
#[derive(Debug, Default)]
pub struct AgentFigures {
    pub rows: Vec<VmFigures>,
    /// Each agent asked, by node: whether its figures are in `rows`.
    pub up: Vec<(String, bool)>,
}

impl AgentFigures {
    /// `keel_agent_vm_figures_up{node}`: 1 if the agent's VMs are in this
    /// scrape.
    pub fn registry(&self) -> Registry {
        let mut registry = Registry::with_prefix("keel_agent");
        let up = Family::<Vec<(&'static str, String)>, Gauge>::default();
        registry.register(
            "vm_figures_up",
            "1 if the node agent's per-VM figures are in this scrape (asked over the agent link), 0 if it did not answer",
            up.clone(),
        );
        for (node, answered) in &self.up {
            up.get_or_create(&vec![("node", node.clone())])
                .set(i64::from(*answered));
        }
        registry
    }
}

/// Asks every agent node other than this server's own for its VMs'
/// figures. Nothing when this server has no cluster credentials (a
/// single-node `keel serve`, whose one node is its own).
pub async fn gather(state: &AppState) -> Result<AgentFigures, StoreError> {
    let Some(creds) = state.cluster_creds.clone() else {
        return Ok(AgentFigures::default());
    };
    let own = state.node.as_ref().map(|n| n.node.as_str());
    let (nodes, _) = state.store.list::<Node>(NODES_PREFIX).await?;
    let agents: Vec<(String, String)> = nodes
        .into_iter()
        .filter_map(|(_, e)| {
            let url = e.value.status.agent_url?;
            (Some(e.value.name.as_str()) != own).then_some((e.value.name, url))
        })
        .collect();
    let answers: Vec<(String, Result<VmStatsPage, String>)> = futures_util::stream::iter(agents)
        .map(|(node, url)| {
            let creds = creds.clone();
            async move {
                let asked = node.clone();
                let answer = tokio::task::spawn_blocking(move || fetch(&creds, &asked, &url)).await;
                let answer = answer.unwrap_or_else(|e| Err(e.to_string()));
                (node, answer)
            }
        })
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    let mut figures = AgentFigures::default();
    for (node, answer) in answers {
        match answer {
            // Only the rows of VMs the agent's node runs: an agent speaks
            // for its own node, never for another's.
            Ok(page) => {
                figures
                    .rows
                    .extend(page.vms.into_iter().filter(|r| r.node == node));
                figures.up.push((node, true));
            }
            Err(why) => {
                tracing::warn!(node, %why, "node agent's VM figures left out of this scrape");
                figures.up.push((node, false));
            }
        }
    }
    figures.up.sort();
    figures.rows.sort_by(|a, b| a.vm.cmp(&b.vm));
    Ok(figures)
}

/// One agent's `GET /api/v1/vm-stats`, its certificate checked to name
/// `node`.
fn fetch(creds: &std::path::Path, node: &str, url: &str) -> Result<VmStatsPage, String> {
    if !url.starts_with("https://") {
        return Err(format!(
            "its URL {url} is not https: figures are asked only over mutual TLS"
        ));
    }
    let trust = crate::agent_link::client_trust(creds, node).map_err(|e| format!("{e:#}"))?;
    let agent = trust.agent(
        ureq::Agent::config_builder()
            // Straight to the agent, never through an HTTP_PROXY.
            .proxy(None)
            .timeout_global(Some(AGENT_TIMEOUT))
            .build(),
    );
    let mut resp = agent
        .get(format!("{url}/api/v1/vm-stats"))
        .call()
        .map_err(|e| e.to_string())?;
    let body = resp
        .body_mut()
        .with_config()
        .limit(MAX_PAGE_BYTES)
        .read_to_vec()
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&body).map_err(|e| format!("not a VM figures page: {e}"))
}
