//! A VM's CD-ROM on QEMU's command line: the ISO image (an installer) on a
//! read-only drive of an IDE/AHCI CD-ROM device, which SeaBIOS and OVMF
//! both boot. The device sits on the machine's built-in controller (q35's
//! AHCI, pc's IDE), so adding it moves no PCI device of the VM.

use std::path::PathBuf;

use super::opts::opt_escape;

/// The drive id of the CD-ROM.
const DRIVE_ID: &str = "cdrom0";

/// The VM's CD-ROM: an ISO of the image store, verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cdrom {
    pub iso: PathBuf,
    /// Firmware tries it before the first disk (`bootindex=0`; the disk
    /// then has 1), else after it.
    pub first: bool,
}

impl Cdrom {
    pub fn args(&self) -> Vec<String> {
        let bootindex = if self.first { 0 } else { 1 };
        vec![
            "-drive".into(),
            format!(
                "file={},format=raw,if=none,media=cdrom,readonly=on,id={DRIVE_ID}",
                opt_escape(&self.iso)
            ),
            "-device".into(),
            format!("ide-cd,drive={DRIVE_ID},bootindex={bootindex}"),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_only_cdrom_with_its_place_in_the_boot_order() {
        let first = Cdrom {
            iso: PathBuf::from("/images/inst,1.abc.iso"),
            first: true,
        };
        assert_eq!(
            first.args(),
            [
                "-drive",
                "file=/images/inst,,1.abc.iso,format=raw,if=none,media=cdrom,readonly=on,id=cdrom0",
                "-device",
                "ide-cd,drive=cdrom0,bootindex=0"
            ]
        );
        let after = Cdrom {
            first: false,
            ..first
        };
        assert_eq!(after.args()[3], "ide-cd,drive=cdrom0,bootindex=1");
    }
}
