//! Simulated online disk growth: the domain's disk takes the new size at
//! once, as QEMU's `block_resize` gives it, and never shrinks.

use super::{sim_failed, SimHypervisor};
use crate::HvError;

const OP: &str = "grow a disk online";

impl SimHypervisor {
    /// From now on, growing or plugging a disk of `instance` fails with
    /// `why` (`None`: it works again).
    pub fn refuse_disk_changes(&self, instance: &str, why: Option<&str>) {
        let mut s = self.lock();
        match why {
            Some(why) => s
                .growth_refused
                .insert(instance.to_string(), why.to_string()),
            None => s.growth_refused.remove(instance),
        };
    }

    pub(super) fn grow_disk_now(
        &self,
        instance: &str,
        disk: &str,
        size_mib: u64,
    ) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        s.monitor_answers(instance, OP)?;
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(instance, OP, p)?;
        if let Some(why) = s.growth_refused.get(instance) {
            return Err(sim_failed(instance, OP, why.clone()));
        }
        let d = s.domain_mut(instance)?;
        if !d.executing() {
            return Err(sim_failed(
                instance,
                OP,
                format!("the guest is not running ({:?})", d.state),
            ));
        }
        let Some(spec) = d.spec.disks.iter_mut().find(|x| x.name == disk) else {
            return Err(sim_failed(
                instance,
                OP,
                format!("disk {disk} is not attached to this instance"),
            ));
        };
        spec.size_mib = spec.size_mib.max(size_mib);
        s.log.push(format!(
            "t={now}: grow disk {disk} of {instance} to {size_mib} MiB"
        ));
        Ok(())
    }

    /// The size (MiB) disk `disk` has in `instance`, as its guest sees it.
    pub fn disk_size_mib(&self, instance: &str, disk: &str) -> Option<u64> {
        let s = self.lock();
        let d = s.domains.get(instance)?;
        d.spec
            .disks
            .iter()
            .find(|x| x.name == disk)
            .map(|x| x.size_mib)
    }
}
