//! Disks plugged into a running instance (`keel vm disk add` of a running
//! VM). On q35, the default machine, a PCI device can be added only under
//! a PCIe root port, never on the root complex itself, so each instance is
//! launched with a few spare root ports (`Instance::hotplug_ports`,
//! decided with the instance and passed to its migration targets, whose
//! command line must match). A plugged disk takes one of them
//! (`Instance::plugged`) and is recorded before it is attached: a crash in
//! between leaves a record the next look completes, never a disk attached
//! that no record names, and never a disk made that no record keeps.
//!
//! A plugged disk dropped from the spec (`keel vm disk remove` of a running
//! VM) is unplugged the same way round: the request is recorded first
//! (`PluggedDisk::detach_requested_at`), the guest is asked to let go of
//! it (PCIe hot-unplug, which a guest grants when it has released the
//! device), and only once the node saw the device gone is the disk taken
//! off the instance and its port freed. A disk the instance started with
//! sits on the root complex, which cannot unplug: it goes at the next
//! start (`restart required: disks`).

use serde::{Deserialize, Serialize};

use crate::Millis;

/// Spare root ports of a new instance: disks that can be added to it
/// without a restart. Each costs the guest a PCI bridge.
pub const HOTPLUG_PORTS: u32 = 4;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PluggedDisk {
    pub disk: String,
    /// The root port it sits on (`0..hotplug_ports`).
    pub port: u32,
    /// When the node confirmed it attached; `None` while the plug is under
    /// way (recorded, asked of the node, not yet confirmed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached_at: Option<Millis>,
    /// When its unplug was recorded (the disk was dropped from the spec);
    /// the disk stays on its port until the node saw the guest let go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detach_requested_at: Option<Millis>,
}
