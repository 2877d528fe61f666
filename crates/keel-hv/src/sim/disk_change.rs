//! What the simulated changes of a running domain's disks (online growth,
//! plugs) check first, as the QEMU driver's calls meet them: a monitor
//! that answers, the injected faults, a refusal the test asked for, and a
//! domain that runs its guest.

use super::{sim_failed, SimDomain, SimHypervisor, SimState};
use crate::HvError;

impl SimHypervisor {
    /// From now on, growing or plugging a disk of `instance` fails with
    /// `why` (`None`: it works again).
    pub fn refuse_disk_changes(&self, instance: &str, why: Option<&str>) {
        let mut s = self.lock();
        match why {
            Some(why) => s
                .disk_changes_refused
                .insert(instance.to_string(), why.to_string()),
            None => s.disk_changes_refused.remove(instance),
        };
    }
}

impl SimState {
    /// The domain `instance`, if its disks can be changed now by `op`.
    pub(super) fn live_for_disk_change(
        &mut self,
        instance: &str,
        op: &'static str,
    ) -> Result<&mut SimDomain, HvError> {
        self.monitor_answers(instance, op)?;
        let p = self.config.faults.op_unavailable;
        self.maybe_unavailable(instance, op, p)?;
        if let Some(why) = self.disk_changes_refused.get(instance) {
            return Err(sim_failed(instance, op, why.clone()));
        }
        let d = self.domain_mut(instance)?;
        if !d.executing() {
            return Err(sim_failed(
                instance,
                op,
                format!("the guest is not running ({:?})", d.state),
            ));
        }
        Ok(d)
    }
}
