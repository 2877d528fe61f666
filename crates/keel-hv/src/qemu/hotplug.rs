//! Disks plugged into a running QEMU (`keel vm disk add` of a running VM)
//! and the spare PCIe root ports they go on.
//!
//! On q35 a PCI device can be added only under a root port ("Bus 'pcie.0'
//! does not support hotplugging"), so an instance asked for
//! `DomainSpec::hotplug_ports` is launched with that many empty
//! `pcie-root-port`s, last on the command line: every device before them
//! keeps the address it had without them. A plug makes the disk (if it is
//! missing and may be made), opens it (`blockdev-add`, the same cache mode
//! as the other disks) and adds a virtio-blk device on its port
//! (`device_add`). A migration target of an instance with plugged disks
//! has them on its command line, on the same ports, so the guest's device
//! state fits.
//!
//! Each step looks first: a disk QEMU already has open (by its file) is
//! attached, a node already opened is not opened again. So a plug repeated
//! after a lost answer, or after the agent restarted in between, finishes
//! the first one.

use serde::Deserialize;
use serde_json::json;

use super::query_block::BlockInfo;
use super::QemuDriver;
use crate::{DiskCreation, DiskPlug, HvError};

const OP: &str = "plug a disk in";

/// Whether `machine` is a q35 one, the only family whose ports Keel adds.
pub(super) fn is_q35(machine: &str) -> bool {
    machine == "q35" || machine.starts_with("pc-q35-")
}

/// The id of spare root port `port`.
pub(super) fn port_id(port: u32) -> String {
    format!("keel-hp{port}")
}

/// The block node and device id of plugged disk `disk`.
pub(super) fn plugged_id(disk: &str) -> String {
    format!("plugged-{disk}")
}

/// The root ports' arguments.
pub(super) fn port_args(ports: u32) -> Vec<String> {
    (0..ports)
        .flat_map(|port| {
            [
                "-device".to_string(),
                // Unique (chassis, slot) pairs, as QEMU asks of root ports.
                format!(
                    "pcie-root-port,id={},bus=pcie.0,chassis={},slot=0",
                    port_id(port),
                    port + 1
                ),
            ]
        })
        .collect()
}

#[derive(Debug, Deserialize)]
pub(super) struct NamedNode {
    #[serde(rename = "node-name")]
    pub node_name: String,
}

impl QemuDriver {
    pub(super) async fn attach_disk_online(&self, plug: &DiskPlug) -> Result<(), HvError> {
        let instance = plug.instance.as_str();
        let monitor = self.live_monitor(instance, OP).await?;
        if plug.disk.image.is_some() {
            return Err(monitor.failed(format!(
                "disk {} is made from an image: it is added at the next start",
                plug.disk.name
            )));
        }
        let file = self.disk_path(&plug.vm, &plug.disk.name);
        let blocks: Vec<BlockInfo> = monitor.query("query-block").await?;
        if blocks.iter().any(|b| b.open_on(&file).is_some()) {
            return Ok(());
        }
        let create = if plug.create {
            DiskCreation::Only(vec![plug.disk.name.clone()])
        } else {
            DiskCreation::none()
        };
        let made = self
            .ensure_disks(
                &plug.vm,
                std::slice::from_ref(&plug.disk),
                &create,
                &[],
                None,
            )
            .await
            .map_err(|e| monitor.failed(e))?;
        let path = made.into_iter().next().expect("one disk asked, one path");
        // Added back under its name: the disk it was, at least as large as
        // the spec asks (nothing has it open yet).
        self.grow_to_spec(&plug.vm, &plug.disk, &path)
            .await
            .map_err(|e| monitor.failed(e))?;
        let node = plugged_id(&plug.disk.name);
        let nodes: Vec<NamedNode> = monitor.query("query-named-block-nodes").await?;
        if !nodes.iter().any(|n| n.node_name == node) {
            // As the command line's cache=none or cache=writeback.
            let cache = json!({"direct": self.inner.direct_io, "no-flush": false});
            monitor
                .execute(
                    "blockdev-add",
                    Some(json!({
                        "driver": "qcow2",
                        "node-name": node,
                        "cache": cache,
                        "file": {"driver": "file", "filename": path.to_string_lossy(),
                            "cache": cache},
                    })),
                )
                .await?;
        }
        tracing::info!(vm = %plug.vm, %instance, disk = %plug.disk.name, port = plug.port,
            "plugging a disk into the running guest");
        monitor
            .execute(
                "device_add",
                Some(json!({
                    "driver": "virtio-blk-pci",
                    "id": node,
                    "drive": node,
                    "bus": port_id(plug.port),
                })),
            )
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_have_unique_chassis_and_only_q35_gets_them() {
        assert_eq!(
            port_args(2),
            [
                "-device",
                "pcie-root-port,id=keel-hp0,bus=pcie.0,chassis=1,slot=0",
                "-device",
                "pcie-root-port,id=keel-hp1,bus=pcie.0,chassis=2,slot=0"
            ]
        );
        assert!(is_q35("q35") && is_q35("pc-q35-7.2"));
        assert!(!is_q35("pc-i440fx-7.2") && !is_q35("pc"));
    }
}
