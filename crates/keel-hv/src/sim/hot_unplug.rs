//! Simulated disk unplugs: the guest lets go of a plugged disk
//! `RELEASE_MS` after it was first asked, as a Linux guest's pciehp does a
//! few seconds after the attention button; until then every call answers
//! `Pending`, after it the disk is off the domain and its port free.

use super::SimHypervisor;
use crate::{DiskDetach, HvError};

const OP: &str = "unplug a disk";

/// How long a simulated guest takes to let go of a disk it was asked to.
pub const RELEASE_MS: keel_api::Millis = 2_000;

impl SimHypervisor {
    pub(super) fn detach_now(&self, instance: &str, disk: &str) -> Result<DiskDetach, HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        let d = s.live_for_disk_change(instance, OP)?;
        let Some(plug) = d.spec.plugged.iter_mut().find(|p| p.disk == disk) else {
            return Ok(DiskDetach::Gone);
        };
        let asked = *plug.detach_requested_at.get_or_insert(now);
        if now < asked + RELEASE_MS {
            if asked == now {
                s.log
                    .push(format!("t={now}: unplug disk {disk} from {instance} asked"));
            }
            return Ok(DiskDetach::Pending);
        }
        d.spec.plugged.retain(|p| p.disk != disk);
        d.spec.disks.retain(|x| x.name != disk);
        s.log
            .push(format!("t={now}: disk {disk} unplugged from {instance}"));
        Ok(DiskDetach::Gone)
    }
}
