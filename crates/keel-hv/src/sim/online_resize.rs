//! Simulated online disk growth: the domain's disk takes the new size at
//! once, as QEMU's `block_resize` gives it, and never shrinks.

use super::{sim_failed, SimHypervisor};
use crate::HvError;

const OP: &str = "grow a disk online";

impl SimHypervisor {
    pub(super) fn grow_disk_now(
        &self,
        instance: &str,
        disk: &str,
        size_mib: u64,
    ) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        let d = s.live_for_disk_change(instance, OP)?;
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
