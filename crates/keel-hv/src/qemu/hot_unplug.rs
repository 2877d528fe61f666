//! A plugged disk taken out of a running QEMU (`keel vm disk remove` of a
//! running VM).
//!
//! PCIe hot-unplug asks the guest: `device_del` presses the root port's
//! attention button, and the device goes only once the guest has let go of
//! it (Linux' pciehp does so within about five seconds, after the driver
//! released the disk). Until then the device is there and the disk open,
//! so each call looks first: a device still there is asked again (QEMU
//! refuses a second press within five seconds, "already in the process of
//! unplug", which is the same answer: pending), a device gone has its disk
//! closed (`blockdev-del`, which flushes what QEMU holds of the guest's
//! writes to the file), and a disk closed is gone. A repeat after a lost
//! answer or an agent restart finishes the first call's work.

use serde::Deserialize;
use serde_json::json;

use super::hotplug::{plugged_id, NamedNode};
use super::QemuDriver;
use crate::{DiskDetach, HvError};

const OP: &str = "unplug a disk";

/// A child of `/machine/peripheral`: a device added with an id.
#[derive(Debug, Deserialize)]
struct Peripheral {
    name: String,
}

/// Whether QEMU's refusal of `device_del` means that the device is still
/// being unplugged (asked within the last five seconds).
fn still_unplugging(refusal: &str) -> bool {
    refusal.contains("in the process of unplug")
}

/// Whether QEMU's refusal of `device_del` means that there is no such
/// device (gone between the look and the ask).
fn no_such_device(refusal: &str) -> bool {
    refusal.contains("not found")
}

impl QemuDriver {
    pub(super) async fn detach_disk_online(
        &self,
        vm: &str,
        instance: &str,
        disk: &str,
    ) -> Result<DiskDetach, HvError> {
        let monitor = self.live_monitor(instance, OP).await?;
        let id = plugged_id(disk);
        let devices: Vec<Peripheral> = monitor
            .query_with("qom-list", Some(json!({"path": "/machine/peripheral"})))
            .await?;
        if devices.iter().any(|d| d.name == id) {
            match monitor
                .try_execute("device_del", Some(json!({"id": id})))
                .await?
            {
                Ok(_) => {
                    tracing::info!(%vm, %instance, %disk,
                        "asked the guest to let go of a plugged disk");
                    return Ok(DiskDetach::Pending);
                }
                Err(refusal) if still_unplugging(&refusal) => return Ok(DiskDetach::Pending),
                Err(refusal) if no_such_device(&refusal) => {}
                Err(refusal) => return Err(monitor.failed(refusal)),
            }
        }
        let nodes: Vec<NamedNode> = monitor.query("query-named-block-nodes").await?;
        if nodes.iter().any(|n| n.node_name == id) {
            tracing::info!(%vm, %instance, %disk, "the guest let go of the disk; closing it");
            monitor
                .execute("blockdev-del", Some(json!({"node-name": id})))
                .await?;
        }
        Ok(DiskDetach::Gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemus_refusals_are_sorted() {
        // As QEMU 7.2 words them (qdev-monitor.c).
        let pending = "Device plugged-data is already in the process of unplug";
        assert!(still_unplugging(pending) && !no_such_device(pending));
        let gone = "Device 'plugged-data' not found";
        assert!(no_such_device(gone) && !still_unplugging(gone));
        assert!(!still_unplugging(
            "Bus 'pcie.0' does not support hotplugging"
        ));
    }
}
