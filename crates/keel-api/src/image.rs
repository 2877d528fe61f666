//! The Image resource: a file in Keel's image store (a disk image a VM's
//! root disk is made from, a kernel or initrd for direct kernel boot, or an
//! installer ISO for a VM's CD-ROM).
//!
//! The record is the authority on what the file must be: its sha256 is
//! checked by the node before a VM is started on it, so a missing,
//! truncated or replaced file fails the start instead of booting something
//! else. Records are written once, by the import, and never changed.

use serde::{Deserialize, Serialize};

use crate::{validate_name, Millis, ValidationError};

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ImageKind {
    /// A bootable disk image (qcow2 or raw): a VM's root disk is a qcow2
    /// overlay on it.
    #[default]
    Disk,
    /// A Linux kernel for direct kernel boot (`spec.boot.kernel`).
    Kernel,
    /// An initrd for direct kernel boot (`spec.boot.initrd`).
    Initrd,
    /// An ISO 9660 image (an installer) for a VM's CD-ROM
    /// (`spec.boot.cdrom`): attached read-only, never a disk's base.
    Iso,
}

impl ImageKind {
    pub const ALL: [ImageKind; 4] = [
        ImageKind::Disk,
        ImageKind::Kernel,
        ImageKind::Initrd,
        ImageKind::Iso,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ImageKind::Disk => "disk",
            ImageKind::Kernel => "kernel",
            ImageKind::Initrd => "initrd",
            ImageKind::Iso => "iso",
        }
    }
}

impl std::fmt::Display for ImageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ImageKind {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ImageKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                ValidationError::new(
                    "kind",
                    format!("{s:?} is not one of disk, kernel, initrd, iso"),
                )
            })
    }
}

/// The on-disk format, as `qemu-img info` reported it at import. Kernels,
/// initrds and ISOs are plain files: `raw`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImageFormat {
    Qcow2,
    Raw,
}

impl ImageFormat {
    /// The name QEMU uses (`-F`, `format=`).
    pub fn as_str(self) -> &'static str {
        match self {
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Raw => "raw",
        }
    }
}

impl std::fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Image {
    pub name: String,
    pub kind: ImageKind,
    pub format: ImageFormat,
    /// Bytes of the stored file.
    pub size_bytes: u64,
    /// The disk size a guest sees (qcow2: its virtual size); for kernels,
    /// initrds and raw images, the file size.
    pub virtual_size_bytes: u64,
    /// Lowercase hex of the file's SHA-256.
    pub sha256: String,
    pub created_at: Millis,
}

const MIB: u64 = 1 << 20;

impl Image {
    /// The smallest disk in MiB (Keel's disk unit) that holds the image.
    pub fn virtual_size_mib(&self) -> u64 {
        self.virtual_size_bytes.div_ceil(MIB)
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_name("name", &self.name)?;
        if self.sha256.len() != 64
            || !self
                .sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(ValidationError::new(
                "sha256",
                "must be 64 lowercase hex digits",
            ));
        }
        if self.kind != ImageKind::Disk && self.format != ImageFormat::Raw {
            return Err(ValidationError::new(
                "format",
                format!("a {} image is a plain file (raw)", self.kind),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> Image {
        Image {
            name: "debian".into(),
            kind: ImageKind::Disk,
            format: ImageFormat::Qcow2,
            size_bytes: 1000,
            virtual_size_bytes: 3 * MIB + 1,
            sha256: "a".repeat(64),
            created_at: 1,
        }
    }

    #[test]
    fn virtual_size_rounds_up_to_whole_mib() {
        assert_eq!(image().virtual_size_mib(), 4);
        let exact = Image {
            virtual_size_bytes: 2 * MIB,
            ..image()
        };
        assert_eq!(exact.virtual_size_mib(), 2);
    }

    #[test]
    fn validation_names_the_field() {
        assert!(image().validate().is_ok());
        let bad = Image {
            sha256: "A".repeat(64),
            ..image()
        };
        assert_eq!(bad.validate().unwrap_err().field, "sha256");
        let bad = Image {
            kind: ImageKind::Kernel,
            ..image()
        };
        assert_eq!(bad.validate().unwrap_err().field, "format");
        assert_eq!("floppy".parse::<ImageKind>().unwrap_err().field, "kind");
        assert_eq!("initrd".parse::<ImageKind>().unwrap(), ImageKind::Initrd);
        assert_eq!("iso".parse::<ImageKind>().unwrap(), ImageKind::Iso);
        let bad = Image {
            kind: ImageKind::Iso,
            ..image()
        };
        assert_eq!(bad.validate().unwrap_err().field, "format");
    }

    #[test]
    fn stored_records_tolerate_unknown_fields() {
        let json = r#"{"name":"d","kind":"disk","format":"raw","size_bytes":1,
            "virtual_size_bytes":1,"sha256":"x","created_at":1,"schema_version":9,"new":1}"#;
        let img: Image = serde_json::from_str(json).unwrap();
        assert_eq!(img.format, ImageFormat::Raw);
    }
}
