//! The lifecycle's tunables, shared by every decision and executor.

use keel_api::{DiskHome, Millis};

use crate::event_retention::EventRetention;

/// Tunables of the lifecycle. Times in milliseconds.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// This node's name, recorded on instances it starts.
    pub node: String,
    /// First re-check after a graceful power-down request; doubles each time.
    pub stop_backoff_initial_ms: Millis,
    pub stop_backoff_max_ms: Millis,
    /// How often a force-killed instance is re-checked (and re-killed).
    pub kill_recheck_ms: Millis,
    /// Re-check interval after a failed lookup or hypervisor call.
    pub retry_ms: Millis,
    /// Backoff between failed starts: initial, doubling, capped.
    pub start_backoff_initial_ms: Millis,
    pub start_backoff_max_ms: Millis,
    /// An instance running this long counts as a successful boot.
    pub boot_settle_ms: Millis,
    /// How often a VM in a transitional state is looked at: an instance
    /// not running yet, a pause, a start waiting for room or for a drain,
    /// a migration under way. A running guest is watched through the
    /// hypervisor's domain events instead, and looked at once its boot
    /// settles (`boot_settle_ms`), then only every `resync_ms`.
    pub poll_ms: Millis,
    /// How often a VM with nothing under way (running steadily, or
    /// stopped with nothing to do) is looked at anyway, jittered per VM
    /// (`resync`): the safety net for a missed domain event. Nothing in
    /// fencing or the one-instance rule depends on it.
    pub resync_ms: Millis,
    /// A node whose heartbeat is older than this is not ready: nothing new
    /// is placed on it.
    pub node_ready_ms: Millis,
    /// A node's lease: once its heartbeat is older than this, its VMs are
    /// taken over by other nodes (their instances count as fenced).
    pub node_lease_ms: Millis,
    /// An agent that could not renew its heartbeat for this long ends every
    /// domain on its node, so they are gone before its lease runs out.
    /// Must be well below `node_lease_ms`.
    pub self_fence_ms: Millis,
    /// The directory this node keeps VM disks in, if other nodes share it
    /// (mounted at the same path); `None`: the disks are node-local.
    pub shared_disk_dir: Option<String>,
    /// This agent's incarnation (see `NodeStatus::incarnation`); `None`
    /// claims none and checks none (tests, single host).
    pub incarnation: Option<String>,
    /// How often a running guest that is not ready yet is probed.
    pub readiness_probe_ms: Millis,
    /// How often a ready guest's agent is asked again (its addresses).
    pub readiness_refresh_ms: Millis,
    /// The caps on the event history the cluster's leader keeps.
    pub event_retention: EventRetention,
    /// The versioned machine type a VM first started on this node gets
    /// (the driver's `NodeFacts::hardware`). `None`: none is recorded, and
    /// the driver uses its configured machine (simulations, tests).
    pub default_machine: Option<String>,
    /// How this node's capacity follows from its host (`--reserve-memory`,
    /// `--cpu-overcommit`, `--memory-overcommit`).
    pub capacity: keel_api::CapacityPolicy,
}

impl LifecycleConfig {
    /// Where the disks of VMs started on this node live.
    pub fn disk_home(&self) -> DiskHome {
        match &self.shared_disk_dir {
            Some(dir) => DiskHome::Shared(dir.clone()),
            None => DiskHome::Node(self.node.clone()),
        }
    }
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            node: "local".into(),
            stop_backoff_initial_ms: 1_000,
            stop_backoff_max_ms: 32_000,
            kill_recheck_ms: 1_000,
            retry_ms: 1_000,
            start_backoff_initial_ms: 1_000,
            start_backoff_max_ms: 32_000,
            boot_settle_ms: 10_000,
            poll_ms: 2_000,
            resync_ms: 60_000,
            node_ready_ms: 15_000,
            node_lease_ms: 40_000,
            self_fence_ms: 20_000,
            shared_disk_dir: None,
            incarnation: None,
            readiness_probe_ms: 1_000,
            readiness_refresh_ms: 30_000,
            event_retention: EventRetention::default(),
            default_machine: None,
            capacity: keel_api::CapacityPolicy::default(),
        }
    }
}
