//! What the runtime hears: store records that changed or were (re)listed,
//! and domain events the hypervisor saw (exits, QMP events). Reconcilers
//! map these to keys ([`super::Reconciler::triggers`]).

use keel_hv::DomainEvent;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A record under a watched prefix was written or deleted.
    Changed { key: String },
    /// A record found by a list: at start, and after a watch broke, when
    /// changes may have been missed, every record is looked at again.
    Listed { key: String },
    /// The hypervisor saw something happen to an instance: its process
    /// exited, or its guest shut down, paused, resumed, reset, panicked, …
    /// A hint only: a lost one costs latency (the next scheduled look, the
    /// slow resync at the latest, finds what it announced), never
    /// correctness.
    Domain(DomainEvent),
}

impl Event {
    /// The store key the event is about, if it is about a record.
    pub fn key(&self) -> Option<&str> {
        match self {
            Event::Changed { key } | Event::Listed { key } => Some(key),
            Event::Domain(_) => None,
        }
    }
}
