//! What a decision sees besides the record: the node's report on the VM
//! (`Observed`) and the cluster around it (`ClusterView`).

use keel_api::{Drain, Migration, Snapshot};
use keel_hv::{DomainInfo, DomainState};
use keel_store::StoreError;

/// What the node said about the VM.
#[derive(Debug, Clone, PartialEq)]
pub enum Observed {
    /// `status.instance` is set and the hypervisor reported it.
    Instance(DomainState),
    /// `status.instance` is set and the hypervisor said NotFound: absent.
    InstanceAbsent,
    /// No instance recorded; these are all domains of this VM on the node,
    /// and, when a restore is pending, the snapshot it restores.
    NoInstance {
        domains: Vec<DomainInfo>,
        restore_source: RestoreSource,
    },
    /// The lookup failed. Says nothing about whether anything runs.
    Unknown(String),
}

/// The snapshot a pending restore reads from, as found in the store.
#[derive(Debug, Clone, PartialEq)]
pub enum RestoreSource {
    /// No restore is pending.
    NotNeeded,
    Found(Box<Snapshot>),
    Missing,
    /// Reading it from the store failed: nothing is known about it.
    Unreadable(StoreError),
}

/// What the VM's node and its neighbours look like, for evictions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterView {
    /// This node's drain, while it is being drained.
    pub drain: Option<Drain>,
    /// The migration named by `status.eviction.migration`, if it exists.
    pub migration: Option<Migration>,
    /// Nodes the VM could move to now (ready, not cordoned, not this one),
    /// best first.
    pub targets: Vec<String>,
    /// Why `targets` is empty (which nodes lack room, which rule each
    /// other node breaks), for the eviction's and migration's message.
    pub no_target: Option<String>,
    /// Every migration in flight in the cluster (for the drain's limits on
    /// parallel migrations).
    pub in_flight: Vec<Migration>,
    /// VMs on draining nodes still waiting for a migration: they go before
    /// user migrations when the cluster's limit binds.
    pub drain_evictions_waiting: usize,
    /// Why this node has no room for the VM's next instance (its capacity
    /// less what the other VMs placed here take), when it is to start
    /// one: it is not started here then.
    pub no_room_here: Option<String>,
}
