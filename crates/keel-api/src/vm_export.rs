//! A VM exported to one file (`keel vm export`) and made again from it,
//! on this cluster or another (`keel vm import`).
//!
//! The file is a tar archive: `manifest.json` first (this module's
//! [`ExportManifest`]: the format and its version, the VM's spec as the
//! snapshot the export was made from recorded it, its hardware, and each
//! other file with its size and SHA-256), then one standalone qcow2 per
//! disk (`<disk>.qcow2`, the disk at that snapshot, with no backing file:
//! a disk made from an image holds the image's data too) and, for a UEFI
//! VM, its variable store as the snapshot kept it (`uefi-vars.fd`).
//!
//! What does not go with it: the VM's snapshots (each disk is copied as
//! one moment, not with the snapshots inside its qcow2), its events, and
//! what belongs to the node it ran on (the node, the published host
//! ports). Imported, the VM has a MAC and cloud-init instance-id of its
//! own unless asked to keep them, and its disks are recorded as made and
//! used: they hold its data, and a start never makes blank ones instead.

use serde::{Deserialize, Serialize};

use crate::clock::Millis;
use crate::disk_record::{DiskHome, DiskRecord};
use crate::hardware::VmHardware;
use crate::validation::ValidationError;
use crate::vm::{PowerState, VirtualMachine, VmSpec};

/// What `format` says in every export.
pub const EXPORT_FORMAT: &str = "keel-vm-export";
/// The version this build writes and reads; another is refused on import.
pub const EXPORT_FORMAT_VERSION: u32 = 1;
/// The archive's first entry.
pub const MANIFEST_FILE: &str = "manifest.json";
/// A UEFI VM's variable store in the archive.
pub const UEFI_VARS_FILE: &str = "uefi-vars.fd";
/// The most a manifest may be (it is read into memory).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// The archive's name for disk `disk`.
pub fn disk_file(disk: &str) -> String {
    format!("{disk}.qcow2")
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExportedFile {
    pub name: String,
    pub bytes: u64,
    /// Hex SHA-256 of the file's bytes, checked on import.
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExportManifest {
    pub format: String,
    pub format_version: u32,
    /// The exported VM's name: the import's name unless another is given.
    pub vm: String,
    /// The snapshot the disks were copied at (one moment of all of them).
    pub snapshot: String,
    pub exported_at: Millis,
    /// The snapshot's spec, without the node it was placed on.
    pub spec: VmSpec,
    /// The machine type and CPU model the guest has run with, kept so the
    /// imported guest sees the same chipset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<VmHardware>,
    /// Every other entry of the archive, in order.
    pub files: Vec<ExportedFile>,
}

impl ExportManifest {
    /// The manifest of an export of `vm` at `snapshot` whose files are
    /// `files`.
    pub fn new(
        vm: &VirtualMachine,
        snapshot: &str,
        spec: &VmSpec,
        exported_at: Millis,
        files: Vec<ExportedFile>,
    ) -> Self {
        let mut spec = spec.clone();
        spec.node = None;
        ExportManifest {
            format: EXPORT_FORMAT.to_string(),
            format_version: EXPORT_FORMAT_VERSION,
            vm: vm.name.clone(),
            snapshot: snapshot.to_string(),
            exported_at,
            spec,
            hardware: vm.status.hardware.clone(),
            files,
        }
    }

    /// Whether this is an export this build can import: its format and
    /// version, a file for every disk of the spec, and no file that is
    /// neither a disk nor the variable store. Refusals name `file`.
    pub fn check(&self) -> Result<(), ValidationError> {
        let refuse = |why: String| Err(ValidationError::new("file", why));
        if self.format != EXPORT_FORMAT {
            return refuse(format!(
                "not a Keel VM export (format {:?}, expected {EXPORT_FORMAT:?})",
                self.format
            ));
        }
        if self.format_version != EXPORT_FORMAT_VERSION {
            return refuse(format!(
                "export format version {} is not the one this Keel reads ({EXPORT_FORMAT_VERSION})",
                self.format_version
            ));
        }
        let disks: Vec<String> = self.spec.disks.iter().map(|d| disk_file(&d.name)).collect();
        for (i, file) in self.files.iter().enumerate() {
            if !disks.contains(&file.name) && file.name != UEFI_VARS_FILE {
                return refuse(format!(
                    "the manifest lists {:?}, which is neither a disk of the VM nor its UEFI \
                     variable store",
                    file.name
                ));
            }
            if self.files[..i].iter().any(|f| f.name == file.name) {
                return refuse(format!("the manifest lists {:?} twice", file.name));
            }
            if file.sha256.len() != 64 || !file.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return refuse(format!(
                    "the SHA-256 of {:?} is not 64 hex digits",
                    file.name
                ));
            }
        }
        if let Some(missing) = disks
            .iter()
            .find(|d| !self.files.iter().any(|f| &f.name == *d))
        {
            return refuse(format!(
                "the manifest has no file {missing:?} for a disk of the VM"
            ));
        }
        Ok(())
    }

    /// The file entry named `name`.
    pub fn file(&self, name: &str) -> Option<&ExportedFile> {
        self.files.iter().find(|f| f.name == name)
    }
}

impl VirtualMachine {
    /// The VM `name` made from an export whose disks are now on `home`:
    /// the exported spec, powered on or not, with an identity of its own
    /// (`random` gives its MAC and instance-id; no published ports) unless
    /// `keep_identity`. Its disks are standalone copies (no image under
    /// them) recorded as made at `now` and used: never made again.
    pub fn imported(
        name: &str,
        manifest: &ExportManifest,
        home: DiskHome,
        now: Millis,
        power: PowerState,
        keep_identity: bool,
        random: [u8; 12],
    ) -> Result<VirtualMachine, ValidationError> {
        crate::validate_name("name", name)?;
        let mut spec = manifest.spec.clone();
        for disk in &mut spec.disks {
            disk.image = None;
        }
        let spec = spec.for_new_vm(power, random, keep_identity);
        let disks = spec
            .disk_names()
            .iter()
            .map(|d| DiskRecord {
                name: d.to_string(),
                made_at: Some(now),
                home: home.clone(),
                used: true,
            })
            .collect();
        let mut vm = VirtualMachine::new(name, spec);
        vm.status.disk_home = Some(home);
        vm.status.disks = Some(disks);
        vm.status.hardware = manifest.hardware.clone();
        vm.validate()?;
        Ok(vm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::tests::spec;
    use crate::CloudInitSpec;

    fn manifest() -> ExportManifest {
        let mut s = spec();
        s.assign_identity([1; 12]);
        s.cloud_init = Some(CloudInitSpec {
            user_data: Some("#cloud-config\n".into()),
            instance_id: Some("i-source".into()),
            ..Default::default()
        });
        s.network.publish = vec!["127.0.0.1:2222:22".parse().unwrap()];
        s.node = Some("a".into());
        let vm = VirtualMachine::new("src", s.clone());
        let files = s
            .disks
            .iter()
            .map(|d| ExportedFile {
                name: disk_file(&d.name),
                bytes: 1,
                sha256: "0".repeat(64),
            })
            .collect();
        ExportManifest::new(&vm, "s1", &s, 5, files)
    }

    #[test]
    fn an_import_has_the_exported_spec_an_identity_of_its_own_and_its_disks_made() {
        let m = manifest();
        assert_eq!(m.spec.node, None, "no node in an export");
        m.check().unwrap();
        let home = DiskHome::Node("b".into());
        let vm = VirtualMachine::imported(
            "copy",
            &m,
            home.clone(),
            9,
            PowerState::Stopped,
            false,
            [2; 12],
        )
        .unwrap();
        assert_eq!(vm.name, "copy");
        assert_ne!(vm.spec.network.mac, m.spec.network.mac);
        assert!(vm.spec.network.mac.is_some());
        assert!(vm.spec.network.publish.is_empty());
        let iid = vm.spec.cloud_init.as_ref().unwrap().instance_id.clone();
        assert!(
            iid.is_some() && iid.as_deref() != Some("i-source"),
            "{iid:?}"
        );
        assert_eq!(vm.status.disk_home, Some(home.clone()));
        let records = vm.status.disks.clone().unwrap();
        assert_eq!(records.len(), m.spec.disks.len());
        assert!(records
            .iter()
            .all(|r| r.used && r.home == home && r.made_at == Some(9)));
        assert!(vm.spec.disks.iter().all(|d| d.image.is_none()));

        let kept =
            VirtualMachine::imported("copy", &m, home, 9, PowerState::Running, true, [2; 12])
                .unwrap();
        assert_eq!(kept.spec.network.mac, m.spec.network.mac);
        assert_eq!(
            kept.spec.cloud_init.unwrap().instance_id.as_deref(),
            Some("i-source")
        );
        assert_eq!(kept.spec.power, PowerState::Running);
    }

    #[test]
    fn a_manifest_that_is_not_an_export_of_this_version_names_the_file() {
        let mut m = manifest();
        m.format = "tar".into();
        assert_eq!(m.check().unwrap_err().field, "file");
        let mut m = manifest();
        m.format_version = 2;
        assert_eq!(m.check().unwrap_err().field, "file");
        let mut m = manifest();
        m.files.pop();
        assert_eq!(m.check().unwrap_err().field, "file");
        let mut m = manifest();
        m.files[0].name = "../etc/passwd".into();
        assert_eq!(m.check().unwrap_err().field, "file");
        let mut m = manifest();
        m.files[0].sha256 = "nope".into();
        assert_eq!(m.check().unwrap_err().field, "file");
        let m = manifest();
        let bad_name = VirtualMachine::imported(
            "No Good",
            &m,
            DiskHome::Node("b".into()),
            1,
            PowerState::Stopped,
            false,
            [2; 12],
        );
        assert_eq!(bad_name.unwrap_err().field, "name");
    }
}
