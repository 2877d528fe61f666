//! Simulated disk plugs: a disk attached to a running domain on one of
//! its spare root ports, made first if it is missing and may be made, as
//! the QEMU driver does; attaching it again is a no-op.

use super::{sim_failed, SimHypervisor};
use crate::{DiskPlug, HvError};

const OP: &str = "plug a disk in";

impl SimHypervisor {
    pub(super) fn attach_now(&self, plug: &DiskPlug) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        let instance = plug.instance.as_str();
        let mut s = self.lock();
        let d = s.live_for_disk_change(instance, OP)?;
        let name = &plug.disk.name;
        if d.spec.disks.iter().any(|x| &x.name == name) {
            return Ok(());
        }
        if plug.port >= d.spec.hotplug_ports {
            return Err(sim_failed(
                instance,
                OP,
                format!(
                    "no root port {} (the instance has {})",
                    plug.port, d.spec.hotplug_ports
                ),
            ));
        }
        if let Some(other) = d.spec.plugged.iter().find(|x| x.port == plug.port) {
            return Err(sim_failed(
                instance,
                OP,
                format!("root port {} holds disk {}", plug.port, other.disk),
            ));
        }
        {
            let mut all = self.disks();
            let disks = all.entry(plug.vm.clone()).or_default();
            if !disks.made.contains(name) {
                if !plug.create {
                    return Err(sim_failed(
                        instance,
                        OP,
                        format!(
                            "disk {name} of VM {} is missing on node {}: the VM has run on \
                             it, so no blank one is made in its place",
                            plug.vm, self.node
                        ),
                    ));
                }
                disks.made.insert(name.clone());
            }
        }
        d.spec.disks.push(plug.disk.clone());
        d.spec.plugged.push(keel_api::PluggedDisk {
            disk: name.clone(),
            port: plug.port,
            attached_at: Some(now),
            detach_requested_at: None,
        });
        s.log.push(format!(
            "t={now}: plug disk {name} into {instance} on port {}",
            plug.port
        ));
        Ok(())
    }

    /// The disks `instance` has now, by name, in the guest's order.
    pub fn attached_disks(&self, instance: &str) -> Option<Vec<String>> {
        let s = self.lock();
        let d = s.domains.get(instance)?;
        Some(d.spec.disks.iter().map(|x| x.name.clone()).collect())
    }
}
