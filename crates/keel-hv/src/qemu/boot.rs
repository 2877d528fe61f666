//! How a guest boots, as QEMU arguments: a kernel handed to QEMU (the
//! node's default test guest, or kernel and initrd images of the image
//! store), or firmware booting the first disk (SeaBIOS, QEMU's own; or
//! OVMF for UEFI, with a writable variable store of the VM's own kept beside
//! its disks, so boot entries persist and move with shared storage).
//!
//! Boot files always come from the image store or the node's configuration:
//! a spec naming a host path (as records written before the image store
//! did) fails the start with the reason, and nothing is read.

use std::path::{Path, PathBuf};

use keel_api::{Firmware, Image, ImageKind};

use super::cdrom::Cdrom;
use super::opts::opt_escape;
use crate::images::ImageStore;
use crate::DomainSpec;

/// The file name of a VM's UEFI variable store, in its disk directory.
pub const UEFI_VARS: &str = "uefi-vars.fd";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UefiFiles {
    /// OVMF's code, read-only, shared by every VM.
    pub code: PathBuf,
    /// The VM's own copy of the variable store template.
    pub vars: PathBuf,
    /// Secure Boot ([`super::secure_boot`]): `code` is OVMF's Secure Boot
    /// build, `vars` a copy of the template with Microsoft's keys.
    pub secure: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootPlan {
    /// Direct kernel boot (under SeaBIOS, or OVMF if `uefi`).
    Kernel {
        kernel: PathBuf,
        initrd: Option<PathBuf>,
        cmdline: String,
        uefi: Option<UefiFiles>,
    },
    /// Firmware boots the first disk (`bootindex=0` on it), or the
    /// CD-ROM when there is one that goes first.
    Disk {
        uefi: Option<UefiFiles>,
        cdrom: Option<Cdrom>,
    },
}

impl BootPlan {
    /// Whether firmware boots from the first disk, which then carries a
    /// bootindex ([`BootPlan::first_disk_bootindex`]).
    pub fn boots_first_disk(&self) -> bool {
        matches!(self, BootPlan::Disk { .. })
    }

    /// The first disk's `bootindex`: 0, or 1 behind a CD-ROM that goes
    /// first.
    pub fn first_disk_bootindex(&self) -> u32 {
        match self {
            BootPlan::Disk {
                cdrom: Some(Cdrom { first: true, .. }),
                ..
            } => 1,
            BootPlan::Disk { .. } | BootPlan::Kernel { .. } => 0,
        }
    }

    pub fn uefi(&self) -> Option<&UefiFiles> {
        match self {
            BootPlan::Kernel { uefi, .. } | BootPlan::Disk { uefi, .. } => uefi.as_ref(),
        }
    }

    /// The CD-ROM's arguments ([`Cdrom::args`]); none without one.
    pub fn cdrom_args(&self) -> Vec<String> {
        match self {
            BootPlan::Disk {
                cdrom: Some(cdrom), ..
            } => cdrom.args(),
            BootPlan::Disk { cdrom: None, .. } | BootPlan::Kernel { .. } => Vec::new(),
        }
    }

    /// The boot arguments of QEMU's command line.
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(uefi) = self.uefi() {
            a.push("-drive".into());
            a.push(format!(
                "if=pflash,format=raw,unit=0,readonly=on,file={}",
                opt_escape(&uefi.code)
            ));
            a.push("-drive".into());
            a.push(format!(
                "if=pflash,format=raw,unit=1,file={}",
                opt_escape(&uefi.vars)
            ));
            if uefi.secure {
                a.extend(super::secure_boot::args().map(String::from));
            }
        }
        match self {
            BootPlan::Kernel {
                kernel,
                initrd,
                cmdline,
                ..
            } => {
                a.push("-kernel".into());
                a.push(kernel.to_string_lossy().into_owned());
                if let Some(initrd) = initrd {
                    a.push("-initrd".into());
                    a.push(initrd.to_string_lossy().into_owned());
                }
                a.push("-append".into());
                a.push(cmdline.clone());
            }
            // Only the devices with a bootindex are tried.
            BootPlan::Disk { .. } => a.extend(["-boot".into(), "strict=on".into()]),
        }
        a
    }
}

/// The node's own boot configuration (not user input).
#[derive(Debug, Clone)]
pub struct BootDefaults<'a> {
    pub kernel: Option<&'a Path>,
    pub initrd: Option<&'a Path>,
    pub cmdline: &'a str,
    pub ovmf_code: &'a Path,
    /// OVMF's Secure Boot build (`firmware: uefi-secure`).
    pub ovmf_code_secure: &'a Path,
}

/// The image record `name` of `kind`, from those the controller passed.
fn record<'a>(
    spec: &'a DomainSpec,
    field: &str,
    name: &str,
    kind: ImageKind,
) -> Result<&'a Image, String> {
    if keel_api::validate_name(field, name).is_err() {
        return Err(format!(
            "{field} {name:?} is not an image name: boot files and disk images come from the \
             image store (keel image import NAME FILE --kind {kind}), never a host path; \
             change the VM's spec"
        ));
    }
    let image = spec
        .images
        .iter()
        .find(|i| i.name == name)
        .ok_or_else(|| format!("{field}: image {name} is not in the image store (deleted?)"))?;
    if image.kind != kind {
        return Err(format!(
            "{field}: image {name} is a {} image, not a {kind}",
            image.kind
        ));
    }
    Ok(image)
}

/// Every image file the spec uses, checked against its record, by name.
pub async fn verified_images(
    store: &ImageStore,
    spec: &DomainSpec,
) -> Result<Vec<(Image, PathBuf)>, String> {
    let mut out: Vec<(Image, PathBuf)> = Vec::new();
    let wanted = spec
        .disks
        .iter()
        .enumerate()
        .filter_map(|(i, d)| {
            d.image
                .as_ref()
                .map(|n| (format!("disks[{i}].image"), n.clone(), ImageKind::Disk))
        })
        .chain(
            spec.boot
                .kernel
                .iter()
                .map(|n| ("spec.boot.kernel".to_string(), n.clone(), ImageKind::Kernel)),
        )
        .chain(
            spec.boot
                .initrd
                .iter()
                .map(|n| ("spec.boot.initrd".to_string(), n.clone(), ImageKind::Initrd)),
        )
        .chain(
            spec.boot
                .cdrom
                .iter()
                .map(|n| ("spec.boot.cdrom".to_string(), n.clone(), ImageKind::Iso)),
        );
    for (field, name, kind) in wanted {
        if out.iter().any(|(i, _)| i.name == name) {
            continue;
        }
        let image = record(spec, &field, &name, kind)?.clone();
        let path = store.verify(&image).await.map_err(|e| e.to_string())?;
        out.push((image, path));
    }
    Ok(out)
}

fn path_of<'a>(images: &'a [(Image, PathBuf)], name: &str) -> Option<&'a Path> {
    images
        .iter()
        .find(|(i, _)| i.name == name)
        .map(|(_, p)| p.as_path())
}

/// How `spec` boots, from its verified images and the node's defaults.
/// `vars` is where the VM's UEFI variable store is (created by the caller).
pub fn plan(
    spec: &DomainSpec,
    images: &[(Image, PathBuf)],
    defaults: &BootDefaults<'_>,
    vars: &Path,
) -> Result<BootPlan, String> {
    let boot = &spec.boot;
    let uefi = boot.firmware.filter(|f| f.is_uefi()).map(|firmware| {
        let secure = firmware == Firmware::UefiSecure;
        let code = if secure {
            defaults.ovmf_code_secure
        } else {
            defaults.ovmf_code
        };
        UefiFiles {
            code: code.to_path_buf(),
            vars: vars.to_path_buf(),
            secure,
        }
    });
    if let Some(uefi) = &uefi {
        if !uefi.code.is_file() {
            return Err(format!(
                "{} firmware {} is missing (install Debian's ovmf package: scripts/setup)",
                if uefi.secure {
                    "UEFI Secure Boot"
                } else {
                    "UEFI"
                },
                uefi.code.display()
            ));
        }
    }
    let image_file = |name: &String| {
        path_of(images, name)
            .map(Path::to_path_buf)
            .ok_or_else(|| format!("image {name} was not verified"))
    };
    if boot.cdrom.is_some() && boot.kernel.is_some() {
        // Validation refuses this; a record from elsewhere fails here.
        return Err("spec.boot.cdrom and spec.boot.kernel: a VM boots one of them".into());
    }
    let cdrom = boot
        .cdrom
        .as_ref()
        .map(|name| {
            Ok::<_, String>(Cdrom {
                iso: image_file(name)?,
                first: keel_api::cdrom::cdrom_first(Some(name), boot.first),
            })
        })
        .transpose()?;
    let from_disk = boot.kernel.is_none()
        && (boot.firmware.is_some()
            || cdrom.is_some()
            || spec.disks.first().is_some_and(|d| d.image.is_some()));
    if from_disk {
        if spec.disks.is_empty() && cdrom.is_none() {
            return Err("firmware boot needs a disk to boot from; the VM has none".into());
        }
        return Ok(BootPlan::Disk { uefi, cdrom });
    }
    let (kernel, initrd) = match &boot.kernel {
        Some(name) => (
            image_file(name)?,
            // A spec that names its kernel gets only its own initrd.
            boot.initrd.as_ref().map(image_file).transpose()?,
        ),
        None => {
            let kernel = defaults.kernel.map(Path::to_path_buf).ok_or_else(|| {
                "no kernel: spec.boot.kernel is unset and no default kernel is configured"
                    .to_string()
            })?;
            let initrd = match &boot.initrd {
                Some(name) => Some(image_file(name)?),
                None => defaults.initrd.map(Path::to_path_buf),
            };
            (kernel, initrd)
        }
    };
    for file in std::iter::once(&kernel).chain(initrd.as_ref()) {
        if !file.is_file() {
            return Err(format!(
                "{} does not exist (for the test guest run scripts/build-test-guest)",
                file.display()
            ));
        }
    }
    Ok(BootPlan::Kernel {
        kernel,
        initrd,
        cmdline: boot
            .cmdline
            .clone()
            .unwrap_or_else(|| defaults.cmdline.to_string()),
        uefi,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{BootSpec, DiskSpec, ImageFormat};

    fn spec(boot: BootSpec, disk_image: Option<&str>) -> DomainSpec {
        DomainSpec {
            cloud_init: None,
            fenced: true,
            network: Default::default(),
            vm: "web".into(),
            instance: "web-1".into(),
            cpus: 1,
            memory_mib: 128,
            disks: vec![DiskSpec {
                name: "root".into(),
                size_mib: 64,
                image: disk_image.map(Into::into),
            }],
            boot,
            create_disks: crate::DiskCreation::Legacy(true),
            images: vec![],
            hardware: None,
            hotplug_ports: 0,
            plugged: Vec::new(),
            clone_from: None,
            recorded_firmware: None,
            tpm: None,
            balloon: false,
        }
    }

    fn defaults(dir: &Path) -> BootDefaults<'_> {
        let _ = dir;
        BootDefaults {
            kernel: None,
            initrd: None,
            cmdline: "console=ttyS0",
            ovmf_code: Path::new("/nonexistent/OVMF_CODE.fd"),
            ovmf_code_secure: Path::new("/nonexistent/OVMF_CODE.ms.fd"),
        }
    }

    #[test]
    fn a_vm_from_an_image_boots_its_first_disk_through_seabios() {
        let plan = plan(
            &spec(BootSpec::default(), Some("debian")),
            &[],
            &defaults(Path::new("/")),
            Path::new("/v"),
        )
        .unwrap();
        assert_eq!(
            plan,
            BootPlan::Disk {
                uefi: None,
                cdrom: None
            }
        );
        assert!(plan.boots_first_disk());
        let args = plan.args();
        assert!(
            !args.iter().any(|a| a == "-kernel" || a.contains("pflash")),
            "{args:?}"
        );
        assert_eq!(args, ["-boot", "strict=on"]);
    }

    #[test]
    fn uefi_needs_ovmf_and_keeps_code_read_only() {
        let boot = BootSpec {
            firmware: Some(Firmware::Uefi),
            ..Default::default()
        };
        let err = plan(
            &spec(boot.clone(), Some("debian")),
            &[],
            &defaults(Path::new("/")),
            Path::new("/v"),
        )
        .unwrap_err();
        assert!(err.contains("ovmf"), "{err}");
        let code = tempfile::NamedTempFile::new().unwrap();
        let d = BootDefaults {
            ovmf_code: code.path(),
            ..defaults(Path::new("/"))
        };
        let p = plan(
            &spec(boot, Some("debian")),
            &[],
            &d,
            Path::new("/disks/web/uefi-vars.fd"),
        )
        .unwrap();
        let args = p.args().join(" ");
        assert!(
            args.contains(&format!(
                "if=pflash,format=raw,unit=0,readonly=on,file={}",
                code.path().display()
            )),
            "{args}"
        );
        assert!(
            args.contains("if=pflash,format=raw,unit=1,file=/disks/web/uefi-vars.fd"),
            "{args}"
        );
    }

    #[test]
    fn secure_boot_takes_the_secure_code_with_smm_and_a_locked_flash() {
        let boot = BootSpec {
            firmware: Some(Firmware::UefiSecure),
            ..Default::default()
        };
        let err = plan(
            &spec(boot.clone(), Some("debian")),
            &[],
            &defaults(Path::new("/")),
            Path::new("/v"),
        )
        .unwrap_err();
        assert!(
            err.contains("Secure Boot") && err.contains("OVMF_CODE.ms.fd"),
            "{err}"
        );
        let code = tempfile::NamedTempFile::new().unwrap();
        let plain = tempfile::NamedTempFile::new().unwrap();
        let d = BootDefaults {
            ovmf_code: plain.path(),
            ovmf_code_secure: code.path(),
            ..defaults(Path::new("/"))
        };
        let p = plan(
            &spec(boot, Some("debian")),
            &[],
            &d,
            Path::new("/disks/web/uefi-vars.fd"),
        )
        .unwrap();
        assert!(p.uefi().unwrap().secure);
        let args = p.args().join(" ");
        assert!(
            args.contains(&format!(
                "if=pflash,format=raw,unit=0,readonly=on,file={} \
                 -drive if=pflash,format=raw,unit=1,file=/disks/web/uefi-vars.fd \
                 -machine smm=on -global driver=cfi.pflash01,property=secure,value=on",
                code.path().display()
            )),
            "{args}"
        );
        // Plain UEFI: neither SMM nor the locked flash.
        let plain_boot = BootSpec {
            firmware: Some(Firmware::Uefi),
            ..Default::default()
        };
        let p = plan(&spec(plain_boot, Some("debian")), &[], &d, Path::new("/v")).unwrap();
        let args = p.args().join(" ");
        assert!(!args.contains("smm") && !args.contains("secure"), "{args}");
        assert!(args.contains(&plain.path().display().to_string()), "{args}");
    }

    #[test]
    fn host_paths_are_refused_and_nothing_is_read() {
        let boot = BootSpec {
            kernel: Some("/boot/vmlinuz".into()),
            initrd: Some("/etc/shadow".into()),
            ..Default::default()
        };
        let s = spec(boot, None);
        let err = futures_lite(verified_images(
            &ImageStore::open(
                tempfile::tempdir().unwrap().path(),
                Path::new("qemu-img"),
                std::time::Duration::from_secs(5),
            )
            .unwrap(),
            &s,
        ))
        .unwrap_err();
        assert!(
            err.contains("spec.boot.kernel") && err.contains("host path"),
            "{err}"
        );
        // Without its verified file, no plan names it.
        assert!(plan(&s, &[], &defaults(Path::new("/")), Path::new("/v")).is_err());
    }

    #[test]
    fn a_missing_or_wrong_kind_record_fails_naming_the_field() {
        let boot = BootSpec {
            kernel: Some("vmlinuz".into()),
            ..Default::default()
        };
        let mut s = spec(boot, None);
        assert!(record(&s, "spec.boot.kernel", "vmlinuz", ImageKind::Kernel)
            .unwrap_err()
            .contains("not in the image store"));
        s.images.push(Image {
            name: "vmlinuz".into(),
            kind: ImageKind::Initrd,
            format: ImageFormat::Raw,
            size_bytes: 1,
            virtual_size_bytes: 1,
            sha256: "0".repeat(64),
            created_at: 0,
        });
        assert!(record(&s, "spec.boot.kernel", "vmlinuz", ImageKind::Kernel)
            .unwrap_err()
            .contains("not a kernel"));
    }

    fn futures_lite<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }
}
