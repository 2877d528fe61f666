//! One row per VM running on this process's node: what its record says
//! (configured size, readiness, uptime, restarts) joined with what the
//! hypervisor reads of its instance (`keel_hv::vm_stats`). `/metrics`
//! encodes these rows as series; `GET /api/v1/vm-stats` serves them as
//! JSON, which `keel vm top` turns into rates.

use keel_api::{Millis, VirtualMachine};
use keel_hv::vm_stats::{DiskStats, NicStats, NodeStats};
use serde::{Deserialize, Serialize};

/// `GET /api/v1/vm-stats`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
}

const MIB: u64 = 1 << 20;

/// The rows of the VMs among `vms` whose instance is on `node`, by name.
pub fn rows(vms: &[VirtualMachine], node: &str, stats: &NodeStats, now: Millis) -> Vec<VmFigures> {
    let mut rows: Vec<VmFigures> = vms
        .iter()
        .filter_map(|vm| {
            let instance = vm.status.instance.as_ref().filter(|i| i.node == node)?;
            let read = stats.of_instance(&instance.id);
            Some(VmFigures {
                vm: vm.name.clone(),
                node: node.to_string(),
                instance: instance.id.clone(),
                cpus: vm.spec.cpus,
                memory_configured_bytes: vm.spec.memory_mib.saturating_mul(MIB),
                ready: vm.ready_since().is_some(),
                uptime_seconds: instance
                    .running_since
                    .map(|since| now.saturating_sub(since) as f64 / 1000.0),
                restarts: vm.status.instance_seq.saturating_sub(1),
                guest_resets: instance.resets,
                cpu_seconds: read.and_then(|r| r.cpu_seconds),
                rss_bytes: read.and_then(|r| r.rss_bytes),
                disks: read.map(|r| r.disks.clone()).unwrap_or_default(),
                nics: read.map(|r| r.nics.clone()).unwrap_or_default(),
            })
        })
        .collect();
    rows.sort_by(|a, b| a.vm.cmp(&b.vm));
    rows
}
