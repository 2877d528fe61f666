//! Nodes (hosts that run VMs), their cordon and drain state.

use serde::{Deserialize, Serialize};

use crate::{MigrationTuning, Millis};

pub const DEFAULT_EVICTION_WINDOW_MS: Millis = 10 * 60 * 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub enum Accelerator {
    Kvm,
    Tcg,
    /// The in-memory simulation driver.
    Sim,
}

/// A host that runs VMs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Node {
    pub name: String,
    /// No new VMs are placed on a cordoned node.
    #[serde(default)]
    pub cordoned: bool,
    /// Keel cordoned it (for a drain). Keel lifts only its own cordons; a
    /// node an operator cordoned stays cordoned until the operator says so.
    #[serde(default)]
    pub cordoned_by_keel: bool,
    /// The operator's labels (`keel node label`), which VMs' node
    /// selectors require ([`crate::placement`]).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: crate::Labels,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<Drain>,
    /// A bounded pause of takeover (a planned agent restart): see [`NodeFreeze`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze: Option<NodeFreeze>,
    #[serde(default)]
    pub status: NodeStatus,
}

/// The longest freeze Keel accepts: a freeze keeps guests running with no
/// agent looking after them, so it must stay short.
pub const MAX_FREEZE_MS: Millis = 60 * 60 * 1000;

/// A bounded freeze of a node, for a planned agent restart (an upgrade):
/// while it lasts, the node's VMs are not taken over even though its agent
/// is silent, and its guests keep running; the agent extends the node's
/// fence lease to the freeze's end before it exits, so the guests are
/// fenced if it has not returned by then, and the cluster takes over only
/// after that end plus the usual margin. The agent clears it when it is
/// back, or once the freeze is over.
///
/// The freeze is judged on each observer's own clock, as liveness is: its
/// end is `duration_ms` after the observer first saw it, never a wall-clock
/// time of another host, so a skewed clock cannot stretch or shorten it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeFreeze {
    /// When it was asked for, on the asker's wall clock: shown to users
    /// and, with the duration, it tells one freeze from the next.
    pub requested_at: Millis,
    pub duration_ms: Millis,
    /// Who asked and why, e.g. `agent restart (SIGTERM)`.
    pub reason: String,
}

impl NodeFreeze {
    /// What tells this freeze from another: a replacement has a new one.
    pub fn key(&self) -> (Millis, Millis) {
        (self.requested_at, self.duration_ms)
    }
}

/// A request to move every VM off the node: live migration first, then
/// (per VM, when migration cannot be done in time) graceful stop and start
/// elsewhere. Each phase has a bounded window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Drain {
    pub requested_at: Millis,
    #[serde(default)]
    pub windows: EvictionWindows,
    /// How its migrations are run and bounded.
    #[serde(default)]
    pub tuning: MigrationTuning,
    /// Set when no VM is left on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Millis>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EvictionWindows {
    /// From the start of an eviction until its migration is under way.
    pub submit_ms: Millis,
    /// From submission until the migration has completed.
    pub migrate_ms: Millis,
    /// From giving up on migration until the VM is off the node (graceful
    /// stop; forced at the end).
    pub fallback_ms: Millis,
}

impl Default for EvictionWindows {
    fn default() -> Self {
        Self {
            submit_ms: DEFAULT_EVICTION_WINDOW_MS,
            migrate_ms: DEFAULT_EVICTION_WINDOW_MS,
            fallback_ms: DEFAULT_EVICTION_WINDOW_MS,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<Accelerator>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hypervisor: Option<String>,
    #[serde(default)]
    pub last_heartbeat: Millis,
    /// Where this node keeps VM disks; `None` (older agents): node-local.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_home: Option<crate::DiskHome>,
    /// How this node receives live migrations; `None`: older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<crate::MigrationEndpoint>,
    /// The identity of the storage its disks are on (a marker in the disk
    /// dir): nodes with the same one see the same images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_id: Option<String>,
    /// Which agent runs this node: an id kept in its data dir. A second
    /// agent with the same node name (another host, another data dir) is
    /// refused while this one is alive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<String>,
    /// Where this node's agent serves the consoles of its VMs
    /// (`keel agent --console-listen`), e.g. `http://10.0.0.7:7070`: control planes
    /// pass `vm console` and `vm logs` on to it. `None`: it serves none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_url: Option<String>,
    /// The machine types and CPU models this node's QEMU provides: VMs are
    /// placed and migrated only where their recorded hardware is.
    /// `None`: older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<crate::HostHardware>,
    /// What this node offers its guests (its host less the reserve, times
    /// the overcommit): VMs are placed only where they fit. `None`: older
    /// agents, or a driver that cannot tell (nothing is judged by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<crate::NodeCapacity>,
}

impl Node {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            cordoned: false,
            cordoned_by_keel: false,
            labels: Default::default(),
            drain: None,
            freeze: None,
            status: NodeStatus::default(),
        }
    }

    /// Starts a drain, cordoning the node if nobody has yet. Idempotent: an
    /// active drain keeps its original start (and so its deadlines).
    pub fn request_drain(&mut self, now: Millis, windows: EvictionWindows) {
        self.request_tuned_drain(now, windows, MigrationTuning::default())
    }

    /// [`Node::request_drain`] with its migrations' tuning.
    pub fn request_tuned_drain(
        &mut self,
        now: Millis,
        windows: EvictionWindows,
        tuning: MigrationTuning,
    ) {
        if !self.cordoned {
            self.cordoned = true;
            self.cordoned_by_keel = true;
        }
        match &self.drain {
            Some(d) if d.completed_at.is_none() => {}
            _ => {
                self.drain = Some(Drain {
                    requested_at: now,
                    windows,
                    tuning,
                    completed_at: None,
                })
            }
        }
    }

    /// Ends a drain and lifts the cordon if Keel set it. Returns whether the
    /// node is schedulable again (false: an operator's cordon remains).
    pub fn uncordon_by_keel(&mut self) -> bool {
        self.drain = None;
        if self.cordoned_by_keel {
            self.cordoned = false;
            self.cordoned_by_keel = false;
        }
        !self.cordoned
    }

    /// An operator cordons the node; this cordon is theirs to lift.
    pub fn cordon_by_operator(&mut self) {
        self.cordoned = true;
        self.cordoned_by_keel = false;
    }

    /// Where this node keeps VM disks.
    pub fn disk_home(&self) -> crate::DiskHome {
        self.status
            .disk_home
            .clone()
            .unwrap_or_else(|| crate::DiskHome::Node(self.name.clone()))
    }

    /// Freezes the node for `duration_ms` (see [`NodeFreeze`]). A freeze in
    /// force is replaced only by one at least as long: its guests' fence
    /// lease may already have been extended by the old one's length, and a
    /// shorter freeze would let the cluster take over before they are
    /// fenced. Only the node's agent ends a freeze.
    pub fn request_freeze(
        &mut self,
        now: Millis,
        duration_ms: Millis,
        reason: impl Into<String>,
    ) -> Result<(), crate::ValidationError> {
        if duration_ms == 0 || duration_ms > MAX_FREEZE_MS {
            return Err(crate::ValidationError::new(
                "for",
                format!(
                    "{duration_ms} ms is out of range 1..={MAX_FREEZE_MS} ms (at most an hour)"
                ),
            ));
        }
        if let Some(old) = &self.freeze {
            if duration_ms < old.duration_ms {
                return Err(crate::ValidationError::new(
                    "for",
                    format!(
                        "node {} is frozen for {} ms already; a freeze can be replaced only by one at least as long",
                        self.name, old.duration_ms
                    ),
                ));
            }
        }
        self.freeze = Some(NodeFreeze {
            requested_at: now,
            duration_ms,
            reason: reason.into(),
        });
        Ok(())
    }

    pub fn draining(&self) -> Option<&Drain> {
        self.drain.as_ref().filter(|d| d.completed_at.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keel_lifts_only_its_own_cordon() {
        let mut n = Node::new("a");
        n.request_drain(1, EvictionWindows::default());
        assert!(n.cordoned && n.cordoned_by_keel);
        assert!(n.uncordon_by_keel());
        assert!(!n.cordoned);

        let mut n = Node::new("b");
        n.cordon_by_operator();
        n.request_drain(1, EvictionWindows::default());
        assert!(!n.cordoned_by_keel);
        assert!(!n.uncordon_by_keel());
        assert!(n.cordoned, "an operator's cordon stays");
    }

    #[test]
    fn a_freeze_is_bounded_and_replaced_only_by_a_longer_one() {
        let mut n = Node::new("a");
        assert_eq!(n.request_freeze(1, 0, "x").unwrap_err().field, "for");
        assert!(n.request_freeze(1, MAX_FREEZE_MS + 1, "x").is_err());
        n.request_freeze(1, 60_000, "first").unwrap();
        assert!(n.request_freeze(2, 59_999, "shorter").is_err());
        assert_eq!(n.freeze.as_ref().unwrap().reason, "first");
        n.request_freeze(3, 60_000, "again").unwrap();
        assert_eq!(n.freeze.as_ref().unwrap().key(), (3, 60_000));
    }

    #[test]
    fn repeated_drain_keeps_the_first_start() {
        let mut n = Node::new("a");
        n.request_drain(5, EvictionWindows::default());
        n.request_drain(9, EvictionWindows::default());
        assert_eq!(n.drain.unwrap().requested_at, 5);
    }
}
