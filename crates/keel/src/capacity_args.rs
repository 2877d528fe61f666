//! `--reserve-memory`, `--cpu-overcommit`, `--memory-overcommit` of `keel
//! serve` and `keel agent`: how the node's capacity follows from its host
//! (`keel_api::capacity`); and, for the sim driver (benchmarks and
//! simulations), the host it pretends to be.

use keel_api::{CapacityPolicy, HostResources};
use keel_ctrl::LifecycleConfig;
use keel_hv::sim::SimConfig;

use crate::args::CapacityArgs;

impl CapacityArgs {
    /// Puts the policy into `lifecycle` and the sim host into `sim`; an
    /// overcommit out of range is an error naming its flag.
    pub fn apply(
        &self,
        lifecycle: &mut LifecycleConfig,
        sim: &mut SimConfig,
    ) -> anyhow::Result<()> {
        let policy = CapacityPolicy {
            reserve_memory_mib: self.reserve_memory,
            cpu_overcommit: self.cpu_overcommit,
            memory_overcommit: self.memory_overcommit,
        };
        policy
            .validate()
            .map_err(|e| anyhow::anyhow!("--{}: {}", e.field.replace('_', "-"), e.message))?;
        lifecycle.capacity = policy;
        if let (Some(cpus), Some(memory_mib)) = (self.sim_host_cpus, self.sim_host_memory) {
            sim.host = Some(HostResources { cpus, memory_mib });
        }
        Ok(())
    }
}
