//! One row per VM running on this process's node: what its record says
//! (configured size, readiness, uptime, restarts) joined with what the
//! hypervisor reads of its instance (`keel_hv::vm_stats`). `/metrics`
//! encodes these rows as series; `GET /api/v1/vm-stats` serves them as
//! JSON, which `keel vm top` turns into rates.

use keel_api::Millis;
use keel_hv::vm_stats::{DiskStats, GuestMemory, NicStats, NodeStats};
use serde::{Deserialize, Serialize};

use super::vm_records::RecordFacts;

/// `GET /api/v1/vm-stats`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmStatsPage {
    /// The node whose VMs these are; `None`: this server runs no guests
    /// (a control plane without an agent), so it has none to report.
    pub node: Option<String>,
    /// When the hypervisor's figures were read (ms since the epoch).
    pub sampled_at: Millis,
    /// Why the hypervisor's figures are from an earlier read, if they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_reason: Option<String>,
    pub vms: Vec<VmFigures>,
    /// Asked for the cluster (`?cluster=true`): each bare agent node
    /// asked for its VMs' rows, and whether it answered (its rows are in
    /// `vms` then). Empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agents: Vec<AgentAnswer>,
}

/// Whether an agent node's rows are in a cluster-wide page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AgentAnswer {
    pub node: String,
    pub answered: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmFigures {
    pub vm: String,
    pub node: String,
    pub instance: String,
    pub cpus: u32,
    pub memory_configured_bytes: u64,
    /// The guest is up (per its readiness setting).
    pub ready: bool,
    /// Since the instance was first seen running; `None` before.
    pub uptime_seconds: Option<f64>,
    /// Instances started after the VM's first (restarts after exits,
    /// user restarts, moves to another node).
    pub restarts: u64,
    /// Resets inside the current instance (reboots).
    pub guest_resets: u32,
    /// CPU time of the instance's process, all threads, in seconds.
    pub cpu_seconds: Option<f64>,
    pub rss_bytes: Option<u64>,
    pub disks: Vec<DiskStats>,
    pub nics: Vec<NicStats>,
    /// The guest's own view of its memory (its balloon driver's report);
    /// absent without a balloon device or before the first report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_memory: Option<GuestMemory>,
}

const MIB: u64 = 1 << 20;

/// The rows of the VMs among `records` whose instance is on `node`, by name.
pub fn rows(records: &[RecordFacts], node: &str, stats: &NodeStats, now: Millis) -> Vec<VmFigures> {
    let mut rows: Vec<VmFigures> = records
        .iter()
        .filter(|r| r.node == node)
        .map(|r| {
            let read = stats.of_instance(&r.instance);
            VmFigures {
                vm: r.vm.clone(),
                node: node.to_string(),
                instance: r.instance.clone(),
                cpus: r.cpus,
                memory_configured_bytes: r.memory_mib.saturating_mul(MIB),
                ready: r.ready_since.is_some(),
                uptime_seconds: r
                    .running_since
                    .map(|since| now.saturating_sub(since) as f64 / 1000.0),
                restarts: r.instance_seq.saturating_sub(1),
                guest_resets: r.resets,
                cpu_seconds: read.and_then(|d| d.cpu_seconds),
                rss_bytes: read.and_then(|d| d.rss_bytes),
                disks: read.map(|d| d.disks.clone()).unwrap_or_default(),
                nics: read.map(|d| d.nics.clone()).unwrap_or_default(),
                guest_memory: read.and_then(|d| d.guest_memory),
            }
        })
        .collect();
    rows.sort_by(|a, b| a.vm.cmp(&b.vm));
    rows
}
