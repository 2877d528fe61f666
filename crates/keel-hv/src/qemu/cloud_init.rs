//! The cloud-init NoCloud seed: a small FAT image labelled `CIDATA` with
//! `meta-data` and `user-data`, attached read-only after the VM's own disks.
//!
//! It is rebuilt at every start in the instance directory (it is derived
//! from the spec, not user data, and goes away with the instance). The
//! image is written in-process with the `fatfs` crate rather than by
//! `mkfs.vfat` + `mcopy`: no extra host packages, no child processes to
//! bound and clean up, and the same bytes from the same spec.
//!
//! `meta-data` carries an `instance-id` that stays the VM's for its whole
//! life (assigned at create, kept in the spec), so cloud-init runs its
//! once-per-instance modules (default user, keys, SSH host keys) on the
//! first boot only, and `local-hostname` = the VM's name.
//!
//! `user-data`:
//! - keys only: a generated `#cloud-config` with `ssh_authorized_keys`,
//!   which cloud-init gives to the image's default user (`debian` on
//!   Debian's cloud images);
//! - user-data only: the user's, byte for byte;
//! - both: a MIME multipart, the user's part first, then Keel's key part
//!   with `merge_how` list-append / dict-no-replace, so the keys are added
//!   to whatever the user's cloud-config says and nothing of it is
//!   replaced. A user's script or `#include` runs as it would alone.

use std::io::{self, Seek, SeekFrom, Write};
use std::path::Path;

use base64::Engine as _;
use keel_api::CloudInitSpec;

/// FAT12 of 2 MiB: room for 64 KiB of user-data, base64'd in a multipart.
const IMAGE_BYTES: u64 = 2 << 20;

/// The NoCloud label (cloud-init matches it case-insensitively).
const LABEL: [u8; 11] = *b"CIDATA     ";

/// The two files of the seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub meta_data: String,
    pub user_data: String,
}

/// The instance-id of a VM whose cloud-init settings carry none (a record
/// not written through the API): a function of the name, so still stable.
pub fn derived_instance_id(vm: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"keel-iid:".iter().chain(vm.as_bytes()) {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("i-{hash:016x}")
}

impl Seed {
    /// The seed for VM `vm` (its name is the hostname). The spec was
    /// validated: keys are single lines, the instance-id is plain.
    pub fn render(vm: &str, spec: &CloudInitSpec) -> Seed {
        let instance_id = spec
            .instance_id
            .clone()
            .unwrap_or_else(|| derived_instance_id(vm));
        let meta_data = format!("instance-id: {instance_id}\nlocal-hostname: {vm}\n");
        let keys = (!spec.ssh_authorized_keys.is_empty()).then(|| {
            let mut c = String::from("#cloud-config\n");
            if spec.user_data.is_some() {
                c.push_str(
                    "merge_how:\n  - name: list\n    settings: [append]\n  - name: dict\n    settings: [no_replace, recurse_list]\n",
                );
            }
            c.push_str("ssh_authorized_keys:\n");
            for key in &spec.ssh_authorized_keys {
                // A JSON string is a YAML double-quoted scalar: the key's
                // comment may hold anything YAML would otherwise parse.
                let quoted = serde_json::to_string(key.trim()).expect("strings serialize");
                c.push_str(&format!("  - {quoted}\n"));
            }
            c
        });
        let user_data = match (&spec.user_data, keys) {
            (Some(user), None) => user.clone(),
            (None, Some(keys)) => keys,
            (Some(user), Some(keys)) => {
                multipart(&[("text/plain", user), ("text/cloud-config", &keys)])
            }
            // Refused by validation; an empty cloud-config does nothing.
            (None, None) => "#cloud-config\n".into(),
        };
        Seed {
            meta_data,
            user_data,
        }
    }

    /// Writes the FAT image to `path` (replacing any), fsynced.
    pub fn write_image(&self, path: &Path) -> io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        file.set_len(IMAGE_BYTES)?;
        fatfs::format_volume(
            &mut file,
            fatfs::FormatVolumeOptions::new()
                .volume_label(LABEL)
                .fat_type(fatfs::FatType::Fat12),
        )?;
        file.seek(SeekFrom::Start(0))?;
        {
            let fs = fatfs::FileSystem::new(&mut file, fatfs::FsOptions::new())?;
            {
                let root = fs.root_dir();
                for (name, body) in [
                    ("meta-data", &self.meta_data),
                    ("user-data", &self.user_data),
                ] {
                    let mut f = root.create_file(name)?;
                    f.truncate()?;
                    f.write_all(body.as_bytes())?;
                    f.flush()?;
                }
            }
            fs.unmount()?;
        }
        file.sync_all()
    }
}

/// A `multipart/mixed` message; every part base64-encoded, so no content
/// can contain the boundary or trip over line endings.
fn multipart(parts: &[(&str, &str)]) -> String {
    const BOUNDARY: &str = "==keel-cloud-init-boundary==";
    let mut m =
        format!("Content-Type: multipart/mixed; boundary=\"{BOUNDARY}\"\nMIME-Version: 1.0\n\n");
    for (i, (ctype, body)) in parts.iter().enumerate() {
        let b64 = base64::engine::general_purpose::STANDARD.encode(body.as_bytes());
        m.push_str(&format!(
            "--{BOUNDARY}\nContent-Type: {ctype}; charset=\"utf-8\"\nMIME-Version: 1.0\n\
             Content-Transfer-Encoding: base64\n\
             Content-Disposition: attachment; filename=\"part-{i}\"\n\n"
        ));
        for line in b64.as_bytes().chunks(76) {
            m.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
            m.push('\n');
        }
    }
    m.push_str(&format!("--{BOUNDARY}--\n"));
    m
}

/// The `-drive` for the seed: read-only raw virtio disk, after the VM's own.
pub fn drive_arg(image: &Path) -> String {
    format!(
        "file={},if=virtio,format=raw,readonly=on,id=cidata",
        super::opts::opt_escape(image)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBvQ4m8y8kJqkVv6Zl9m8oQb2F2k9eW4k2q0o1v2w3x4 me@host: #1";

    fn spec(keys: bool, user: Option<&str>) -> CloudInitSpec {
        CloudInitSpec {
            ssh_authorized_keys: if keys { vec![KEY.into()] } else { vec![] },
            user_data: user.map(String::from),
            instance_id: Some("i-00ff".into()),
        }
    }

    #[test]
    fn meta_data_names_the_instance_and_host() {
        let seed = Seed::render("web", &spec(true, None));
        assert_eq!(seed.meta_data, "instance-id: i-00ff\nlocal-hostname: web\n");
        let seed = Seed::render(
            "web",
            &CloudInitSpec {
                instance_id: None,
                ..spec(true, None)
            },
        );
        assert_eq!(
            seed.meta_data,
            format!(
                "instance-id: {}\nlocal-hostname: web\n",
                derived_instance_id("web")
            )
        );
        assert_ne!(derived_instance_id("web"), derived_instance_id("db"));
    }

    #[test]
    fn keys_alone_become_a_cloud_config_for_the_default_user() {
        let seed = Seed::render("web", &spec(true, None));
        assert_eq!(
            seed.user_data,
            format!(
                "#cloud-config\nssh_authorized_keys:\n  - {}\n",
                serde_json::to_string(KEY).unwrap()
            )
        );
        assert!(!seed.user_data.contains("merge_how"));
    }

    #[test]
    fn user_data_alone_is_passed_verbatim() {
        let user = "#!/bin/sh\necho hi\n";
        assert_eq!(
            Seed::render("web", &spec(false, Some(user))).user_data,
            user
        );
    }

    #[test]
    fn both_become_a_multipart_with_the_keys_appended() {
        let user = "#cloud-config\npackages: [htop]\n";
        let seed = Seed::render("web", &spec(true, Some(user)));
        let m = &seed.user_data;
        assert!(m.starts_with("Content-Type: multipart/mixed;"), "{m}");
        // Decode the parts back.
        let parts: Vec<String> = m
            .split("--==keel-cloud-init-boundary==")
            .skip(1)
            .filter(|p| !p.starts_with("--"))
            .map(|p| {
                let body: String = p.split("\n\n").nth(1).unwrap().lines().collect();
                String::from_utf8(
                    base64::engine::general_purpose::STANDARD
                        .decode(body)
                        .unwrap(),
                )
                .unwrap()
            })
            .collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], user);
        assert!(
            parts[1].starts_with("#cloud-config\nmerge_how:"),
            "{}",
            parts[1]
        );
        assert!(parts[1].contains("settings: [append]"));
        assert!(parts[1].contains(&serde_json::to_string(KEY).unwrap()));
    }

    #[test]
    fn the_image_is_fat_labelled_cidata_with_both_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cidata.img");
        let seed = Seed::render("web", &spec(true, Some(&"x".repeat(64 * 1024))));
        seed.write_image(&path).unwrap();
        // Again over the first: a restart rebuilds it in place.
        seed.write_image(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), IMAGE_BYTES);
        let file = std::fs::File::open(&path).unwrap();
        let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_label(), "CIDATA");
        assert_eq!(
            fs.read_volume_label_from_root_dir().unwrap().as_deref(),
            Some("CIDATA")
        );
        for (name, want) in [
            ("meta-data", &seed.meta_data),
            ("user-data", &seed.user_data),
        ] {
            let mut got = String::new();
            fs.root_dir()
                .open_file(name)
                .unwrap()
                .read_to_string(&mut got)
                .unwrap();
            assert_eq!(&got, want, "{name}");
        }
    }
}
