//! `keel vm create --secure-boot` and `--tpm`: the firmware the flags
//! name together, and how `keel vm get` shows a TPM.

use keel_api::{Firmware, VirtualMachine};

/// `spec.boot.firmware` from `--firmware` and `--secure-boot`: Secure
/// Boot is UEFI's, so with `--firmware uefi` (or none) it is
/// `uefi-secure`, and with `--firmware bios` a mistake named here.
pub fn firmware(named: Option<Firmware>, secure_boot: bool) -> anyhow::Result<Option<Firmware>> {
    if !secure_boot {
        return Ok(named);
    }
    match named {
        None | Some(Firmware::Uefi) | Some(Firmware::UefiSecure) => Ok(Some(Firmware::UefiSecure)),
        Some(Firmware::Bios) => anyhow::bail!(
            "spec.boot.firmware: --secure-boot needs UEFI firmware, and --firmware bios names \
             SeaBIOS (leave --firmware out, or say uefi)"
        ),
    }
}

/// The TPM line of `keel vm get`: its version, and whether its state is
/// the VM's data yet.
pub fn tpm_summary(vm: &VirtualMachine) -> Option<String> {
    let tpm = vm.spec.tpm?;
    Some(match vm.status.tpm_used_since {
        Some(_) => format!("{} (state kept with the disks, in use)", tpm.version),
        None => format!("{} (state made at the first start)", tpm.version),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secure_boot_is_uefis_and_bios_with_it_is_refused_naming_the_field() {
        assert_eq!(firmware(None, false).unwrap(), None);
        assert_eq!(
            firmware(Some(Firmware::Bios), false).unwrap(),
            Some(Firmware::Bios)
        );
        assert_eq!(firmware(None, true).unwrap(), Some(Firmware::UefiSecure));
        assert_eq!(
            firmware(Some(Firmware::Uefi), true).unwrap(),
            Some(Firmware::UefiSecure)
        );
        let err = firmware(Some(Firmware::Bios), true)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("spec.boot.firmware"), "{err}");
    }

    #[test]
    fn get_tells_whether_the_tpms_state_is_the_vms_data_yet() {
        let spec = serde_json::from_value(serde_json::json!({"cpus": 1, "memory_mib": 64}))
            .expect("a minimal spec");
        let mut vm = VirtualMachine::new("web", spec);
        assert_eq!(tpm_summary(&vm), None);
        vm.spec.tpm = Some(keel_api::TpmSpec::default());
        assert_eq!(
            tpm_summary(&vm).unwrap(),
            "2.0 (state made at the first start)"
        );
        vm.status.tpm_used_since = Some(1);
        assert!(tpm_summary(&vm).unwrap().contains("in use"));
    }
}
