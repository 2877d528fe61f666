//! Simulated export and import (`keel vm export|import`): each disk's file
//! is a small JSON document instead of a qcow2. The guest's records go in
//! the first disk's (the guest writes them on its first disk, as the test
//! guest does on /dev/vda), so an imported VM's guest reads what the
//! exported one had written before the snapshot. A file that is not such
//! a document is refused, as the QEMU driver refuses one that is not a
//! standalone qcow2.

use std::collections::BTreeMap;
use std::path::Path;

use keel_api::vm_export::disk_file;
use keel_api::DiskSpec;
use serde::{Deserialize, Serialize};

use super::SimHypervisor;
use crate::HvError;

#[derive(Debug, Serialize, Deserialize)]
struct SimDiskFile {
    sim_disk: String,
    records: BTreeMap<u32, String>,
}

fn storage(vm: &str, op: &'static str, reason: String) -> HvError {
    HvError::Storage {
        vm: vm.to_string(),
        op,
        reason,
        source: None,
    }
}

impl SimHypervisor {
    pub(super) fn write_export(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        snapshot: &str,
        dir: &Path,
    ) -> Result<Vec<String>, HvError> {
        let records = self
            .disks()
            .get(vm)
            .and_then(|d| d.snapshots.get(snapshot))
            .cloned()
            .ok_or_else(|| storage(vm, "export", format!("snapshot {snapshot} not found")))?;
        let mut written = Vec::new();
        for (i, disk) in disks.iter().enumerate() {
            let file = SimDiskFile {
                sim_disk: disk.name.clone(),
                records: if i == 0 {
                    records.clone()
                } else {
                    BTreeMap::new()
                },
            };
            let name = disk_file(&disk.name);
            let bytes =
                serde_json::to_vec(&file).map_err(|e| storage(vm, "export", e.to_string()))?;
            std::fs::write(dir.join(&name), bytes)
                .map_err(|e| storage(vm, "export", format!("{name}: {e}")))?;
            written.push(name);
        }
        Ok(written)
    }

    pub(super) fn take_import(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        dir: &Path,
    ) -> Result<(), HvError> {
        let mut records = BTreeMap::new();
        for (i, disk) in disks.iter().enumerate() {
            let name = disk_file(&disk.name);
            let bytes = std::fs::read(dir.join(&name))
                .map_err(|e| storage(vm, "import", format!("{name}: {e}")))?;
            let file: SimDiskFile = serde_json::from_slice(&bytes).map_err(|e| {
                storage(
                    vm,
                    "import",
                    format!("disk {}: not a disk of this driver: {e}", disk.name),
                )
            })?;
            if i == 0 {
                records = file.records;
            }
        }
        let mut all = self.disks();
        let existing = all.entry(vm.to_string()).or_default();
        if let Some(made) = disks.iter().find(|d| existing.made.contains(&d.name)) {
            return Err(storage(
                vm,
                "import",
                format!("disk {} exists: an import never replaces a disk", made.name),
            ));
        }
        existing.made.extend(disks.iter().map(|d| d.name.clone()));
        existing.records = records;
        Ok(())
    }
}
