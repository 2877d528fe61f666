//! UEFI Secure Boot (`firmware: uefi-secure`): what QEMU needs beyond a
//! plain UEFI guest.
//!
//! OVMF's Secure Boot build keeps its authenticated variables (the keys
//! that decide what may boot) behind System Management Mode, so that the
//! guest's OS cannot rewrite them: QEMU must emulate SMM (`smm=on`, which
//! only q35 has) and let only SMM code write the flash
//! (`cfi.pflash01`'s `secure`). The VM's own variable store is copied
//! from the template with Microsoft's keys enrolled, so Secure Boot is on
//! from the first boot and Windows or a distribution's signed shim boots.

/// QEMU's arguments beyond the pflash drives. A second `-machine` is
/// merged with the first by QEMU, so the machine type stays as recorded.
pub fn args() -> [&'static str; 4] {
    [
        "-machine",
        "smm=on",
        "-global",
        "driver=cfi.pflash01,property=secure,value=on",
    ]
}

/// Why a Secure Boot guest cannot run as `machine`, if it cannot: SMM is
/// q35's (the i440fx `pc` machine's flash cannot be locked to SMM).
pub fn machine_refused(machine: &str) -> Option<String> {
    (!super::hotplug::is_q35(machine)).then(|| {
        format!(
            "spec.boot.firmware uefi-secure needs the q35 machine type (Secure Boot's \
             variables are guarded by SMM), and this VM's machine is {machine}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smm_guards_the_flash_and_only_q35_has_it() {
        assert_eq!(
            args().join(" "),
            "-machine smm=on -global driver=cfi.pflash01,property=secure,value=on"
        );
        assert_eq!(machine_refused("q35"), None);
        assert_eq!(machine_refused("pc-q35-7.2"), None);
        let why = machine_refused("pc-i440fx-7.2").unwrap();
        assert!(
            why.contains("spec.boot.firmware") && why.contains("q35"),
            "{why}"
        );
    }
}
