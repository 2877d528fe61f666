//! Disks plugged into a running instance (`keel vm disk add` of a running
//! VM). On q35, the default machine, a PCI device can be added only under
//! a PCIe root port, never on the root complex itself, so each instance is
//! launched with a few spare root ports (`Instance::hotplug_ports`,
//! decided with the instance and passed to its migration targets, whose
//! command line must match). A plugged disk takes one of them
//! (`Instance::plugged`) and is recorded before it is attached: a crash in
//! between leaves a record the next look completes, never a disk attached
//! that no record names, and never a disk made that no record keeps.

use serde::{Deserialize, Serialize};

use crate::{Instance, Millis};

/// Spare root ports of a new instance: disks that can be added to it
/// without a restart. Each costs the guest a PCI bridge.
pub const HOTPLUG_PORTS: u32 = 4;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluggedDisk {
    pub disk: String,
    /// The root port it sits on (`0..hotplug_ports`).
    pub port: u32,
    /// When the node confirmed it attached; `None` while the plug is under
    /// way (recorded, asked of the node, not yet confirmed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached_at: Option<Millis>,
}

impl Instance {
    /// The disks this instance has, by name, in the guest's order: those it
    /// was started with, then those plugged since (also one still being
    /// plugged). `None` for an instance from before `started_with`.
    pub fn disk_names(&self) -> Option<Vec<String>> {
        let started = &self.started_with.as_ref()?.disks;
        Some(
            started
                .iter()
                .cloned()
                .chain(self.plugged.iter().map(|p| p.disk.clone()))
                .collect(),
        )
    }

    /// A root port no plugged disk holds, if any is left.
    pub fn free_port(&self) -> Option<u32> {
        (0..self.hotplug_ports).find(|port| self.plugged.iter().all(|p| p.port != *port))
    }

    /// The plug under way (recorded, not yet confirmed), if any.
    pub fn plug_under_way(&self) -> Option<&PluggedDisk> {
        self.plugged.iter().find(|p| p.attached_at.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StartedWith;

    #[test]
    fn plugged_disks_follow_the_started_ones_and_take_free_ports() {
        let mut inst = Instance::new("web-1", "a", 0);
        assert_eq!(inst.disk_names(), None);
        inst.started_with = Some(StartedWith {
            generation: 1,
            cpus: 1,
            memory_mib: 64,
            disks: vec!["root".into()],
            boot: String::new(),
            network: String::new(),
            cloud_init: String::new(),
            cpu_model: None,
        });
        assert_eq!(inst.free_port(), None, "no ports: nothing to plug into");
        inst.hotplug_ports = 2;
        assert_eq!(inst.free_port(), Some(0));
        inst.plugged.push(PluggedDisk {
            disk: "data".into(),
            port: 0,
            attached_at: None,
        });
        assert_eq!(inst.plug_under_way().map(|p| p.disk.as_str()), Some("data"));
        assert_eq!(inst.free_port(), Some(1));
        inst.plugged[0].attached_at = Some(5);
        inst.plugged.push(PluggedDisk {
            disk: "logs".into(),
            port: 1,
            attached_at: Some(6),
        });
        assert_eq!(inst.free_port(), None);
        assert_eq!(inst.plug_under_way(), None);
        assert_eq!(inst.disk_names().unwrap(), ["root", "data", "logs"]);
    }
}
