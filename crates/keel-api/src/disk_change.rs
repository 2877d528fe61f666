//! Day-two disk changes (`keel vm disk add|remove|resize`): one disk of a
//! VM's spec added, dropped or grown, each a compare-and-swap of the VM
//! record by the API.
//!
//! Why these rules: a disk holds the guest's data, so no change here ever
//! loses it. A disk only grows (shrinking would cut the guest's
//! filesystem); a removed disk's file stays where it is (and its record,
//! once an instance used it), so adding it back under its name is that
//! disk; the disk the VM boots from is never removed.

use crate::validation::ValidationError;
use crate::vm::{DiskSpec, VirtualMachine, MAX_DISK_SIZE_MIB};

/// Why a disk change is refused, by the kind of answer it deserves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskChangeError {
    /// The VM has no disk of that name.
    Unknown(ValidationError),
    /// The request itself is wrong (a size out of range, a shrink).
    Invalid(ValidationError),
    /// The VM's state refuses it (a duplicate name, the boot disk, a
    /// restore or deletion under way).
    Refused(ValidationError),
}

impl DiskChangeError {
    pub fn error(&self) -> &ValidationError {
        match self {
            DiskChangeError::Unknown(e)
            | DiskChangeError::Invalid(e)
            | DiskChangeError::Refused(e) => e,
        }
    }
}

impl VirtualMachine {
    /// Adds a blank disk at the end of the spec. A running VM has it
    /// plugged in (`hotplug`), a stopped one makes it at its next start
    /// (per-disk records, `disk_record`).
    pub fn add_disk(&mut self, disk: DiskSpec) -> Result<(), DiskChangeError> {
        self.refuse_if_busy().map_err(DiskChangeError::Refused)?;
        if self.spec.disks.iter().any(|d| d.name == disk.name) {
            return Err(DiskChangeError::Refused(ValidationError::new(
                "disk",
                format!("VM {} already has a disk {}", self.name, disk.name),
            )));
        }
        check_size(disk.size_mib)?;
        let mut spec = self.spec.clone();
        spec.disks.push(disk);
        spec.validate().map_err(DiskChangeError::Invalid)?;
        self.spec = spec;
        self.generation += 1;
        Ok(())
    }

    /// Drops `disk` from the spec. Its file stays in the VM's disk dir
    /// until the VM is deleted; a used one keeps its record, so adding it
    /// back under its name brings that disk back.
    pub fn remove_disk(&mut self, disk: &str) -> Result<DiskSpec, DiskChangeError> {
        self.refuse_if_busy().map_err(DiskChangeError::Refused)?;
        let index = self.disk_index(disk)?;
        if index == 0 && self.spec.boots_from_disk() {
            return Err(DiskChangeError::Refused(ValidationError::new(
                "disk",
                format!(
                    "disk {disk} is the disk VM {} boots from; it cannot be removed",
                    self.name
                ),
            )));
        }
        let removed = self.spec.disks.remove(index);
        self.generation += 1;
        Ok(removed)
    }

    /// Grows `disk` to `size_mib` (the same size changes nothing). A made
    /// disk's file is grown by the next start.
    pub fn resize_disk(&mut self, disk: &str, size_mib: u64) -> Result<(), DiskChangeError> {
        self.refuse_if_busy().map_err(DiskChangeError::Refused)?;
        let index = self.disk_index(disk)?;
        check_size(size_mib)?;
        let current = self.spec.disks[index].size_mib;
        if size_mib < current {
            return Err(DiskChangeError::Invalid(ValidationError::new(
                "size",
                format!(
                    "disk {disk} is {current} MiB; a disk only grows (shrinking would cut \
                     the guest's filesystem), so {size_mib} MiB is refused"
                ),
            )));
        }
        if size_mib != current {
            self.spec.disks[index].size_mib = size_mib;
            self.generation += 1;
        }
        Ok(())
    }

    fn disk_index(&self, disk: &str) -> Result<usize, DiskChangeError> {
        self.spec
            .disks
            .iter()
            .position(|d| d.name == disk)
            .ok_or_else(|| {
                DiskChangeError::Unknown(ValidationError::new(
                    "disk",
                    format!("VM {} has no disk {disk}", self.name),
                ))
            })
    }
}

fn check_size(size_mib: u64) -> Result<(), DiskChangeError> {
    if size_mib == 0 || size_mib > MAX_DISK_SIZE_MIB {
        return Err(DiskChangeError::Invalid(ValidationError::new(
            "size",
            format!("{size_mib} MiB is out of range 1..={MAX_DISK_SIZE_MIB}"),
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::tests::spec;

    fn vm() -> VirtualMachine {
        let mut spec = spec();
        spec.disks = vec![DiskSpec {
            name: "root".into(),
            size_mib: 100,
            image: Some("debian".into()),
        }];
        VirtualMachine::new("v", spec)
    }

    fn blank(name: &str, size_mib: u64) -> DiskSpec {
        DiskSpec {
            name: name.into(),
            size_mib,
            image: None,
        }
    }

    #[test]
    fn a_disk_is_added_once_and_grows_only() {
        let mut vm = vm();
        let generation = vm.generation;
        vm.add_disk(blank("data", 10)).unwrap();
        assert_eq!(vm.spec.disk_names(), ["root", "data"]);
        assert!(vm.generation > generation);
        let dup = vm.add_disk(blank("data", 20)).unwrap_err();
        assert!(
            matches!(&dup, DiskChangeError::Refused(e) if e.field == "disk"),
            "{dup:?}"
        );
        vm.resize_disk("data", 30).unwrap();
        assert_eq!(vm.spec.disks[1].size_mib, 30);
        let shrink = vm.resize_disk("data", 20).unwrap_err();
        assert!(
            matches!(&shrink, DiskChangeError::Invalid(e) if e.field == "size"),
            "{shrink:?}"
        );
        assert_eq!(vm.spec.disks[1].size_mib, 30);
        let unknown = vm.resize_disk("nope", 40).unwrap_err();
        assert!(
            matches!(&unknown, DiskChangeError::Unknown(e) if e.field == "disk"),
            "{unknown:?}"
        );
    }

    #[test]
    fn the_boot_disk_stays_and_another_goes() {
        let mut vm = vm();
        vm.add_disk(blank("data", 10)).unwrap();
        let boot = vm.remove_disk("root").unwrap_err();
        assert!(
            matches!(&boot, DiskChangeError::Refused(e) if e.field == "disk"),
            "{boot:?}"
        );
        assert_eq!(vm.remove_disk("data").unwrap().name, "data");
        assert_eq!(vm.spec.disk_names(), ["root"]);
        assert!(matches!(
            vm.remove_disk("data"),
            Err(DiskChangeError::Unknown(_))
        ));
    }
}
