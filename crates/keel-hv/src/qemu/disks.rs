//! A VM's disk images as a start needs them: created (qcow2, on a verified
//! image or blank) only where the spec allows it, required to exist
//! otherwise, and the UEFI variable store beside them.
//!
//! The disk dir's identity ([`storage_identity`]) tells nodes whether they
//! see the same images: the same path on two hosts is not the same storage
//! unless both read the same marker there.

use std::io;
use std::path::PathBuf;
use std::process::Stdio;

use keel_api::validate_name;

use super::layout::rename_noreplace;
use super::QemuDriver;
use super::{blocking, boot};
use crate::{free_space, DiskCreation, DomainSpec, HvError};

impl QemuDriver {
    /// Where disk `disk` of `vm` is (or would be) stored.
    pub fn disk_path(&self, vm: &str, disk: &str) -> PathBuf {
        match (validate_name("vm", vm), validate_name("disk", disk)) {
            (Ok(()), Ok(())) => self.inner.layout.disk(vm, disk),
            _ => self.inner.layout.disks_dir().join(".invalid-name"),
        }
    }

    /// Creates the missing qcow2 images `create` allows; existing ones are
    /// left as they are. A missing image it does not allow fails, naming
    /// it, before any is made: the VM has run on that disk, and a blank one
    /// must never take its place. Returns the image paths in `disks`
    /// order, or why not.
    pub(super) async fn ensure_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        create: &DiskCreation,
        images: &[(keel_api::Image, PathBuf)],
        clone: Option<&keel_api::CloneSource>,
    ) -> Result<Vec<PathBuf>, String> {
        let vm_dir = self.inner.layout.vm_disks(vm);
        tokio::fs::create_dir_all(&vm_dir)
            .await
            .map_err(|e| format!("{}: {e}", vm_dir.display()))?;
        let mut found = Vec::new();
        for disk in disks {
            let path = self.inner.layout.disk(vm, &disk.name);
            // The disk dir may be shared storage: even a stat can hang.
            let exists = tokio::fs::try_exists(&path)
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if !exists && !create.allows(&disk.name) {
                return Err(format!(
                    "disk {} of VM {vm} is missing at {}: the VM has run on it, so no \
                     blank one is made in its place (wrong node, or shared storage not mounted?)",
                    disk.name,
                    path.display()
                ));
            }
            found.push((path, exists));
        }
        let mut paths = Vec::new();
        for (disk, (path, exists)) in disks.iter().zip(found) {
            // Callers that only need the disks to exist (a snapshot) pass
            // no images; a start passes every one, verified.
            let base = disk
                .image
                .as_ref()
                .and_then(|name| images.iter().find(|(i, _)| &i.name == name));
            if let (Some(name), None, false) = (&disk.image, base, exists) {
                return Err(format!(
                    "disk {} of VM {vm} is made from image {name} at the VM's first start, \
                     which has not happened yet",
                    disk.name
                ));
            }
            if let Some((image, base)) = base {
                self.note_overlay(image, base, &path, exists).await?;
            }
            if !exists {
                let (dir, floor) = (vm_dir.clone(), self.inner.config.min_free_disk_bytes);
                let doing = format!("not creating disk {} of VM {vm}", disk.name);
                blocking::unblocked("free space of the disk dir", move || {
                    Ok(free_space::check_floor(&dir, floor, 0, &doing))
                })
                .await
                .unwrap_or_else(|e| Err(e.to_string()))?;
                // Built under a temporary name and moved into place, so a
                // crash never leaves a half-written image that looks ready.
                let tmp = vm_dir.join(format!(".{}.{}.tmp", disk.name, std::process::id()));
                if let Some(source) = clone.filter(|c| c.disks.contains(&disk.name)) {
                    self.copy_at_snapshot(vm, source, disk, base, &tmp, &path)
                        .await?;
                    paths.push(path);
                    continue;
                }
                let mut cmd = tokio::process::Command::new(&self.inner.config.qemu_img);
                crate::unprivileged::without_capabilities(&mut cmd);
                cmd.args(["create", "-q", "-f", "qcow2"]);
                if let Some((image, path)) = base {
                    // The VM's own overlay on the verified image: the image
                    // is never written, the overlay holds every change.
                    cmd.args(["-F", image.format.as_str(), "-b"]).arg(path);
                }
                let qemu_img = self.inner.config.qemu_img.display();
                let timeout = self.inner.config.storage_timeout;
                // Killed if it outlives its timeout (the future is dropped).
                let run = cmd
                    .arg(&tmp)
                    .arg(format!("{}M", disk.size_mib))
                    .stdin(Stdio::null())
                    .kill_on_drop(true)
                    .output();
                let out = match tokio::time::timeout(timeout, run).await {
                    Ok(out) => out.map_err(|e| format!("run {qemu_img}: {e}"))?,
                    Err(_) => {
                        let _ = blocking::remove_file(tmp).await;
                        return Err(format!(
                            "{qemu_img} create {}: no answer within {timeout:?}",
                            path.display()
                        ));
                    }
                };
                if !out.status.success() {
                    let _ = blocking::remove_file(tmp).await;
                    return Err(format!(
                        "qemu-img create {} ({}): {}",
                        path.display(),
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
                let (from, to) = (tmp.clone(), path.clone());
                match blocking::unblocked("move a new disk into place", move || {
                    rename_noreplace(&from, &to)
                })
                .await
                {
                    Ok(()) => {}
                    // Another start created it meanwhile; theirs is as good.
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        let _ = blocking::remove_file(tmp).await;
                    }
                    Err(e) => return Err(format!("{}: {e}", path.display())),
                }
            }
            paths.push(path);
        }
        Ok(paths)
    }

    /// A disk the spec asks to be larger than its file (`keel vm disk
    /// resize` of a stopped VM) is grown before the start, so the guest
    /// boots on the new size. Never shrunk: the API refuses a smaller size,
    /// and a file already larger is left alone.
    pub(super) async fn grow_to_spec(
        &self,
        vm: &str,
        disk: &keel_api::DiskSpec,
        path: &std::path::Path,
    ) -> Result<(), String> {
        let file = path.to_path_buf();
        let size = blocking::unblocked("read a disk's size", move || {
            Ok(crate::qcow2::virtual_size(&file))
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{}: {e}", path.display()))?;
        let wanted = disk.size_mib << 20;
        match size {
            Some(size) if size < wanted => {}
            _ => return Ok(()),
        }
        tracing::info!(%vm, disk = %disk.name, size_mib = disk.size_mib, "growing disk to its spec's size");
        let mut cmd = tokio::process::Command::new(&self.inner.config.qemu_img);
        crate::unprivileged::without_capabilities(&mut cmd);
        let run = cmd
            .args(["resize", "-q", "-f", "qcow2"])
            .arg(path)
            .arg(format!("{}M", disk.size_mib))
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let timeout = self.inner.config.storage_timeout;
        let out = tokio::time::timeout(timeout, run)
            .await
            .map_err(|_| {
                format!(
                    "qemu-img resize {}: no answer within {timeout:?}",
                    path.display()
                )
            })?
            .map_err(|e| format!("run {}: {e}", self.inner.config.qemu_img.display()))?;
        if !out.status.success() {
            return Err(format!(
                "grow disk {} of VM {vm} to {} MiB: qemu-img resize {} ({}): {}",
                disk.name,
                disk.size_mib,
                path.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    }

    /// Before a disk made from `image` is used: an existing one must sit
    /// on `base`, the file just verified against the image's record (never
    /// on another base); and the image store notes the overlay, so the
    /// image is not deleted while it exists. A note that cannot be written
    /// fails a new overlay (it would be unknown to image deletes); an
    /// existing one only warns, since its base check still guards it.
    async fn note_overlay(
        &self,
        image: &keel_api::Image,
        base: &std::path::Path,
        disk: &std::path::Path,
        exists: bool,
    ) -> Result<(), String> {
        let (driver, image, base, disk) = (
            self.clone(),
            image.clone(),
            base.to_path_buf(),
            disk.to_path_buf(),
        );
        let done = blocking::unblocked("check and note an image's overlay", move || {
            if exists {
                if let Err(why) = crate::image_refs::check_base(&disk, &image, &base) {
                    return Ok(Err(why));
                }
            }
            let noted =
                driver
                    .inner
                    .images
                    .note_overlay(&base, &disk, &driver.inner.storage_id);
            Ok(match noted {
                Ok(()) => Ok(()),
                Err(e) if exists => {
                    tracing::warn!(disk = %disk.display(), image = %image.name, error = %e, "could not note the disk as an overlay on its image");
                    Ok(())
                }
                Err(e) => Err(format!(
                    "note disk {} as an overlay on image {} in the image store: {e}",
                    disk.display(),
                    image.name
                )),
            })
        })
        .await;
        done.unwrap_or_else(|e| Err(e.to_string()))
    }

    /// The VM's own UEFI variable store beside its disks, copied from
    /// OVMF's template when missing (first UEFI start). An incoming target
    /// uses the source's and never makes one.
    pub(super) async fn ensure_uefi_vars(
        &self,
        spec: &DomainSpec,
        incoming: bool,
    ) -> Result<(), String> {
        if !spec.boot.firmware.is_some_and(|f| f.is_uefi()) {
            return Ok(());
        }
        // A copy and two fsyncs on the disk dir: on the blocking pool.
        let (driver, spec) = (self.clone(), spec.clone());
        let done = blocking::unblocked("UEFI variable store", move || {
            Ok(driver.ensure_uefi_vars_blocking(&spec, incoming))
        })
        .await;
        done.unwrap_or_else(|e| Err(e.to_string()))
    }

    fn ensure_uefi_vars_blocking(&self, spec: &DomainSpec, incoming: bool) -> Result<(), String> {
        let vm_dir = self.inner.layout.vm_disks(&spec.vm);
        let vars = vm_dir.join(boot::UEFI_VARS);
        if vars.is_file() {
            return Ok(());
        }
        if incoming {
            return Err(format!(
                "UEFI variable store of VM {} not found at {}: live migration needs the disk \
                 dir on storage shared with the source node",
                spec.vm,
                vars.display()
            ));
        }
        // Secure Boot's has Microsoft's keys enrolled, so it is on at once.
        let template = if spec.boot.firmware == Some(keel_api::Firmware::UefiSecure) {
            &self.inner.config.ovmf_vars_secure
        } else {
            &self.inner.config.ovmf_vars
        };
        let tmp = vm_dir.join(format!(".{}.{}.tmp", boot::UEFI_VARS, std::process::id()));
        std::fs::create_dir_all(&vm_dir)
            .and_then(|()| std::fs::copy(template, &tmp))
            .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                format!(
                    "copy UEFI variable store template {} (Debian's ovmf package): {e}",
                    template.display()
                )
            })?;
        match rename_noreplace(&tmp, &vars) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let _ = std::fs::remove_file(&tmp);
                Ok(())
            }
            Err(e) => Err(format!("{}: {e}", vars.display())),
        }
    }

    /// The images of an incoming migration's target: they must exist, since
    /// the source is running on them. A missing one means the disk dir is
    /// not the storage the source uses; creating a blank image would hand
    /// the guest an empty disk.
    pub(super) async fn existing_disks(&self, spec: &DomainSpec) -> Result<Vec<PathBuf>, HvError> {
        let paths: Vec<PathBuf> = spec
            .disks
            .iter()
            .map(|disk| self.inner.layout.disk(&spec.vm, &disk.name))
            .collect();
        // Stats on the (shared) disk dir: on the blocking pool.
        let checked = paths.clone();
        let present = blocking::unblocked("look for the source's disks", move || {
            Ok(checked.iter().map(|p| p.is_file()).collect::<Vec<bool>>())
        })
        .await
        .map_err(|e| HvError::failed_by(&spec.instance, "prepare incoming migration", "", e))?;
        spec.disks
            .iter()
            .zip(paths.into_iter().zip(present))
            .map(|(disk, (path, present))| {
                if present {
                    Ok(path)
                } else {
                    Err(HvError::Failed {
                        instance: spec.instance.clone(),
                        op: "prepare incoming migration",
                        reason: format!(
                            "disk {} of VM {} not found at {}: live migration needs the \
                             disk dir on storage shared with the source node",
                            disk.name,
                            spec.vm,
                            path.display()
                        ),
                        source: None,
                    })
                }
            })
            .collect()
    }
}

/// The qcow2 disks in `vm_dir` that have a backing file, with it: the
/// overlays whose notes go when the VM's disks are deleted.
pub(super) fn overlays_in(vm_dir: &std::path::Path) -> Vec<(PathBuf, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(vm_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "qcow2"))
        .filter_map(|p| {
            let base = crate::qcow2::backing_file(&p).ok()??;
            Some((p, base))
        })
        .collect()
}

/// Whether the filesystem at `disks` takes O_DIRECT (QEMU's `cache=none`):
/// a probe file opened with it. Shared storage (`QemuConfig::disk_dir`)
/// uses it where it can, because two hosts' page caches over a network
/// filesystem are not coherent: at a migration's switch-over the target
/// must read what the source wrote, not pages its own host cached before.
/// Where the filesystem refuses (tmpfs), `cache=writeback` stays, with a
/// warning: safe on one host (one page cache), not across hosts.
pub fn direct_io(disks: &std::path::Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = disks.join(format!(".keel-odirect-probe.{}", std::process::id()));
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe);
    let _ = std::fs::remove_file(&probe);
    match opened {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(
                disk_dir = %disks.display(),
                error = %e,
                "the disk dir does not take O_DIRECT: disks use cache=writeback, which is \
                 safe for migrations on one host only"
            );
            false
        }
    }
}

/// In the disk dir: a random id written once by the first node to use it.
pub use crate::image_refs::STORAGE_ID_FILE;

/// The identity of the storage at `disks`: read from its marker, or made
/// (exclusively, so two nodes starting together agree on the winner's).
pub fn storage_identity(disks: &std::path::Path) -> io::Result<String> {
    use std::io::Write;
    let path = disks.join(STORAGE_ID_FILE);
    let read = || crate::image_refs::read_storage_id(disks);
    if let Some(id) = read()? {
        return Ok(id);
    }
    let id = hex::encode(rand::random::<[u8; 16]>());
    let tmp = disks.join(format!(".{STORAGE_ID_FILE}.{}.tmp", std::process::id()));
    std::fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(id.as_bytes())?;
            f.sync_all()
        })
        .and_then(|()| rename_noreplace(&tmp, &path))
        .or_else(|e| {
            let _ = std::fs::remove_file(&tmp);
            // Another node made it meanwhile: theirs is the identity.
            if e.kind() == io::ErrorKind::AlreadyExists {
                Ok(())
            } else {
                Err(e)
            }
        })?;
    read()?.ok_or_else(|| io::Error::other(format!("{} is empty", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_on_one_disk_dir_share_its_identity_and_others_do_not() {
        let tmp = tempfile::tempdir().unwrap();
        let (shared, other) = (tmp.path().join("shared"), tmp.path().join("other"));
        std::fs::create_dir_all(&shared).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let first = storage_identity(&shared).unwrap();
        assert_eq!(first.len(), 32);
        assert_eq!(storage_identity(&shared).unwrap(), first);
        assert_ne!(storage_identity(&other).unwrap(), first);
    }
}
