//! What a node's running guests use: CPU time, memory, disk and network
//! counters per domain, as `Hypervisor::stats_all` reports them (read
//! through `stats_cache::StatsCache`).

use keel_api::Millis;
use serde::{Deserialize, Serialize};

/// One running domain's figures. A figure the driver cannot tell is
/// `None` (or an empty list), never a made-up zero.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DomainStats {
    pub instance: String,
    pub vm: String,
    /// CPU time the guest's process used (all its threads, vCPUs
    /// included), in seconds since it started.
    pub cpu_seconds: Option<f64>,
    /// Resident memory of the guest's process, in bytes.
    pub rss_bytes: Option<u64>,
    pub disks: Vec<DiskStats>,
    pub nics: Vec<NicStats>,
    /// The guest's own view of its memory, as its balloon driver reports
    /// it; `None` without a balloon device, or before the guest reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_memory: Option<GuestMemory>,
}

/// What the guest's kernel says of its memory (virtio-balloon statistics).
/// Each figure is one the guest's driver reports; older drivers report
/// fewer (no `available_bytes` before Linux 4.6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GuestMemory {
    /// Memory the guest's kernel manages (MemTotal).
    pub total_bytes: Option<u64>,
    /// Memory not used at all (MemFree).
    pub free_bytes: Option<u64>,
    /// Memory it could use without swapping, caches given up included
    /// (MemAvailable).
    pub available_bytes: Option<u64>,
    /// When the guest sent this report (seconds since the epoch, the
    /// host's clock): it is asked to every 10 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_at: Option<u64>,
}

/// A disk's counters since the instance started (`query-blockstats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DiskStats {
    /// The disk's name in the VM's spec.
    pub disk: String,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    /// Time the completed reads (writes) took, summed: divided by the ops,
    /// the mean latency.
    pub read_time_ns: u64,
    pub write_time_ns: u64,
}

/// A NIC's counters, from the guest's side: what it received and sent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NicStats {
    pub nic: String,
    pub receive_bytes: u64,
    pub transmit_bytes: u64,
    pub receive_packets: u64,
    pub transmit_packets: u64,
}

/// Every running domain's figures, as read at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStats {
    /// When they were read (the clock's milliseconds).
    pub sampled_at: Millis,
    pub domains: Vec<DomainStats>,
    /// Why the last read failed or was cut short, if it was: the figures
    /// are then those of an earlier read (or none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_reason: Option<String>,
}

impl NodeStats {
    pub fn of_instance(&self, instance: &str) -> Option<&DomainStats> {
        self.domains.iter().find(|d| d.instance == instance)
    }
}
