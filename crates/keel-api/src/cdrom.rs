//! A VM's CD-ROM: an image of kind `iso` from the image store attached
//! read-only (`spec.boot.cdrom`, an OS installer say), and which of it and
//! the first disk firmware tries first (`spec.boot.first`).
//!
//! Installing an OS is two phases on the same VM: boot the installer from
//! the CD-ROM onto a blank disk, then boot the disk. So the CD-ROM goes
//! first unless `first: disk` says otherwise, and firmware falls through to
//! the other device when the first holds nothing bootable (a blank disk).

use serde::{Deserialize, Serialize};

use crate::ValidationError;

/// The device firmware tries first when the VM has a CD-ROM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BootDevice {
    Cdrom,
    Disk,
}

impl BootDevice {
    pub fn as_str(self) -> &'static str {
        match self {
            BootDevice::Cdrom => "cdrom",
            BootDevice::Disk => "disk",
        }
    }
}

impl std::fmt::Display for BootDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BootDevice {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cdrom" => Ok(BootDevice::Cdrom),
            "disk" => Ok(BootDevice::Disk),
            _ => Err(ValidationError::new(
                "spec.boot.first",
                format!("{s:?} is not one of cdrom, disk"),
            )),
        }
    }
}

/// Whether firmware tries the CD-ROM before the first disk.
pub fn cdrom_first(cdrom: Option<&str>, first: Option<BootDevice>) -> bool {
    match (cdrom, first) {
        (None, _) => false,
        (Some(_), None | Some(BootDevice::Cdrom)) => true,
        (Some(_), Some(BootDevice::Disk)) => false,
    }
}

/// The rules between the CD-ROM and the rest of the boot spec (the image
/// name itself is checked with the spec's other image names).
pub fn validate(
    cdrom: Option<&str>,
    first: Option<BootDevice>,
    kernel: Option<&str>,
) -> Result<(), ValidationError> {
    if cdrom.is_some() && kernel.is_some() {
        // A kernel handed to QEMU boots before firmware looks at any
        // device: the CD-ROM would never boot.
        return Err(ValidationError::new(
            "spec.boot.cdrom",
            "a VM with spec.boot.kernel boots that kernel, never the CD-ROM; drop one of them",
        ));
    }
    if cdrom.is_none() && first == Some(BootDevice::Cdrom) {
        return Err(ValidationError::new(
            "spec.boot.first",
            "cdrom, but the VM has no CD-ROM (spec.boot.cdrom)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cdrom_goes_first_unless_the_disk_is_asked_for() {
        assert!(cdrom_first(Some("inst"), None));
        assert!(cdrom_first(Some("inst"), Some(BootDevice::Cdrom)));
        assert!(!cdrom_first(Some("inst"), Some(BootDevice::Disk)));
        assert!(!cdrom_first(None, None));
    }

    #[test]
    fn validation_names_the_field() {
        assert!(validate(Some("inst"), None, None).is_ok());
        assert!(validate(None, Some(BootDevice::Disk), None).is_ok());
        assert_eq!(
            validate(Some("inst"), None, Some("vmlinuz"))
                .unwrap_err()
                .field,
            "spec.boot.cdrom"
        );
        assert_eq!(
            validate(None, Some(BootDevice::Cdrom), None)
                .unwrap_err()
                .field,
            "spec.boot.first"
        );
        assert_eq!(
            "floppy".parse::<BootDevice>().unwrap_err().field,
            "spec.boot.first"
        );
    }
}
