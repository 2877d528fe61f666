//! What a node offers its guests, and what a VM asks of it.
//!
//! A node's agent reports its host's CPUs and memory; the node offers
//! guests the host's memory less a reserve for the host itself, and its
//! CPUs and memory each times an overcommit factor (CPUs are time-shared
//! well, so 4 by default; memory is not: 1, since a host that runs out
//! has its OOM killer end guests, a crash Keel did not choose). Placement
//! puts a VM only where its CPUs and memory fit beside what is already
//! allocated there.

use serde::{Deserialize, Serialize};

use crate::validation::ValidationError;

/// What a host has, as its agent read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HostResources {
    pub cpus: u32,
    pub memory_mib: u64,
}

/// What a node offers its guests in all (not what is left).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeCapacity {
    /// vCPUs the node's guests may have together.
    pub cpus: u32,
    /// Memory (MiB) the node's guests may have together.
    pub memory_mib: u64,
    /// The host it was worked out from.
    pub host: HostResources,
}

/// How a node's capacity follows from its host (`--reserve-memory`,
/// `--cpu-overcommit`, `--memory-overcommit`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CapacityPolicy {
    /// Memory kept for the host (QEMU's own overhead, the agent, the OS).
    pub reserve_memory_mib: u64,
    pub cpu_overcommit: f64,
    pub memory_overcommit: f64,
}

/// Above this, an overcommit factor is a typo.
pub const MAX_OVERCOMMIT: f64 = 64.0;

impl Default for CapacityPolicy {
    fn default() -> Self {
        Self {
            reserve_memory_mib: 1024,
            cpu_overcommit: 4.0,
            memory_overcommit: 1.0,
        }
    }
}

impl CapacityPolicy {
    pub fn validate(&self) -> Result<(), ValidationError> {
        for (field, factor) in [
            ("cpu_overcommit", self.cpu_overcommit),
            ("memory_overcommit", self.memory_overcommit),
        ] {
            if !(factor.is_finite() && (0.1..=MAX_OVERCOMMIT).contains(&factor)) {
                return Err(ValidationError::new(
                    field,
                    format!("{factor} is not a factor in 0.1..={MAX_OVERCOMMIT}"),
                ));
            }
        }
        Ok(())
    }

    /// What a node on `host` offers.
    pub fn offered(&self, host: HostResources) -> NodeCapacity {
        let memory = host.memory_mib.saturating_sub(self.reserve_memory_mib);
        NodeCapacity {
            cpus: (f64::from(host.cpus) * self.cpu_overcommit).floor() as u32,
            memory_mib: (memory as f64 * self.memory_overcommit).floor() as u64,
            host,
        }
    }
}

/// What a VM, or the VMs on a node together, take of its capacity.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
pub struct Demand {
    pub cpus: u64,
    pub memory_mib: u64,
}

impl Demand {
    pub fn plus(self, other: Demand) -> Demand {
        Demand {
            cpus: self.cpus + other.cpus,
            memory_mib: self.memory_mib + other.memory_mib,
        }
    }

    pub fn minus(self, other: Demand) -> Demand {
        Demand {
            cpus: self.cpus.saturating_sub(other.cpus),
            memory_mib: self.memory_mib.saturating_sub(other.memory_mib),
        }
    }
}

impl NodeCapacity {
    /// What is left of it beside `allocated`.
    pub fn free(&self, allocated: Demand) -> Demand {
        Demand {
            cpus: u64::from(self.cpus),
            memory_mib: self.memory_mib,
        }
        .minus(allocated)
    }

    /// Whether `demand` fits beside `allocated`.
    pub fn fits(&self, allocated: Demand, demand: Demand) -> bool {
        let free = self.free(allocated);
        demand.cpus <= free.cpus && demand.memory_mib <= free.memory_mib
    }

    /// The larger of the CPU and memory shares `allocated` takes, in
    /// thousandths: nodes are filled evenly by it, not by VM count.
    pub fn share_permille(&self, allocated: Demand) -> u64 {
        // A node that offers none of it is full.
        let share = |used: u64, of: u64| used.saturating_mul(1000).checked_div(of).unwrap_or(1000);
        share(allocated.cpus, u64::from(self.cpus))
            .max(share(allocated.memory_mib, self.memory_mib))
    }
}

/// `mib` as people read it: `512 MiB`, `3.5 GiB`.
pub fn human_mib(mib: u64) -> String {
    if mib < 1024 {
        format!("{mib} MiB")
    } else if mib.is_multiple_of(1024) {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{:.1} GiB", mib as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_offers_its_host_less_the_reserve_times_the_overcommit() {
        let host = HostResources {
            cpus: 2,
            memory_mib: 24 * 1024,
        };
        let cap = CapacityPolicy::default().offered(host);
        assert_eq!((cap.cpus, cap.memory_mib), (8, 23 * 1024));
        let tight = CapacityPolicy {
            reserve_memory_mib: 64 * 1024,
            cpu_overcommit: 1.0,
            memory_overcommit: 1.5,
        };
        let cap = tight.offered(host);
        assert_eq!(
            (cap.cpus, cap.memory_mib),
            (2, 0),
            "a reserve above the host"
        );
        assert!(CapacityPolicy {
            cpu_overcommit: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(CapacityPolicy {
            memory_overcommit: f64::NAN,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(CapacityPolicy::default().validate().is_ok());
    }

    #[test]
    fn fit_and_share() {
        let cap = CapacityPolicy::default().offered(HostResources {
            cpus: 1,
            memory_mib: 5 * 1024,
        });
        let used = Demand {
            cpus: 2,
            memory_mib: 3 * 1024,
        };
        assert!(cap.fits(
            used,
            Demand {
                cpus: 2,
                memory_mib: 1024
            }
        ));
        assert!(!cap.fits(
            used,
            Demand {
                cpus: 3,
                memory_mib: 1
            }
        ));
        assert!(!cap.fits(
            used,
            Demand {
                cpus: 1,
                memory_mib: 1025
            }
        ));
        assert_eq!(cap.share_permille(used), 750);
        assert_eq!(human_mib(3584), "3.5 GiB");
        assert_eq!(human_mib(2048), "2 GiB");
        assert_eq!(human_mib(300), "300 MiB");
    }
}
