//! A VM's disks written out for an export (`keel vm export`) and an
//! export's files made the disks of a new VM (`keel vm import`).
//!
//! Export reads each disk at a snapshot with `qemu-img convert -l
//! snapshot.name=S`, as a clone's copy does (`clone_disk`): the snapshot
//! was taken with the guest paused and its filesystems frozen through the
//! guest agent where there is one, it does not change while the guest
//! runs on, and `-U` reads the image the running QEMU holds. Chosen over
//! a QMP `blockdev-backup` because it needs no job on the guest's QEMU,
//! works the same on a stopped VM, and its output has no backing file (a
//! disk made from an image is written whole). It copies one moment, not
//! the internal snapshots of the qcow2.
//!
//! Import refuses a file that is not a standalone qcow2 (the checks of an
//! image upload: a backing file or external data file would make QEMU
//! open a host path the file names), then moves it into the VM's disk
//! dir under a temporary name and renames it into place without replacing
//! anything.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use keel_api::vm_export::{disk_file, UEFI_VARS_FILE};
use keel_api::{validate_name, DiskSpec};

use super::layout::rename_noreplace;
use super::snapshot::uefi_vars::VarsStore;
use super::{blocking, QemuDriver};
use crate::HvError;

/// The slowest copy an export waits for: 25 MiB/s (beyond the storage
/// timeout every `qemu-img` call has), as for a clone's copy.
const COPY_MS_PER_MIB: u64 = 40;

impl QemuDriver {
    pub(super) async fn write_export(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        snapshot: &str,
        dir: &Path,
    ) -> Result<Vec<String>, HvError> {
        let storage = |reason: String| HvError::Storage {
            vm: vm.to_string(),
            op: "export",
            reason,
            source: None,
        };
        validate_name("vm", vm).map_err(|e| storage(e.to_string()))?;
        validate_name("snapshot", snapshot).map_err(|e| storage(e.to_string()))?;
        let mut written = Vec::new();
        for disk in disks {
            validate_name("disk", &disk.name).map_err(|e| storage(e.to_string()))?;
            let from = self.inner.layout.disk(vm, &disk.name);
            let name = disk_file(&disk.name);
            let to = dir.join(&name);
            let mut cmd = tokio::process::Command::new(&self.inner.config.qemu_img);
            crate::unprivileged::without_capabilities(&mut cmd);
            cmd.args(["convert", "-q", "-U", "-f", "qcow2", "-O", "qcow2", "-l"])
                .arg(format!("snapshot.name={snapshot}"))
                .arg(&from)
                .arg(&to)
                .stdin(Stdio::null())
                .kill_on_drop(true);
            let timeout = self.inner.config.storage_timeout
                + std::time::Duration::from_millis(disk.size_mib.saturating_mul(COPY_MS_PER_MIB));
            tracing::info!(%vm, disk = %disk.name, %snapshot, "exporting a disk at the snapshot");
            let out = match tokio::time::timeout(timeout, cmd.output()).await {
                Ok(Ok(out)) => out,
                Ok(Err(e)) => {
                    return Err(storage(format!(
                        "run {}: {e}",
                        self.inner.config.qemu_img.display()
                    )))
                }
                Err(_) => {
                    return Err(storage(format!(
                        "qemu-img convert of disk {}: no answer within {timeout:?}",
                        disk.name
                    )))
                }
            };
            if !out.status.success() {
                return Err(storage(format!(
                    "qemu-img convert {} at snapshot {snapshot} ({}): {}",
                    from.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            written.push(name);
        }
        let vars = VarsStore::of(&self.inner.layout.vm_disks(vm)).copy_of(snapshot);
        let to = dir.join(UEFI_VARS_FILE);
        let copied = blocking::unblocked(
            "copy the UEFI variable store",
            move || match std::fs::copy(&vars, &to) {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(io::Error::new(e.kind(), format!("{}: {e}", vars.display()))),
            },
        )
        .await
        .map_err(|e| storage(format!("UEFI variable store at snapshot {snapshot}: {e}")))?;
        if copied {
            written.push(UEFI_VARS_FILE.to_string());
        }
        Ok(written)
    }

    pub(super) async fn take_import(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        dir: &Path,
    ) -> Result<(), HvError> {
        let storage = |reason: String| HvError::Storage {
            vm: vm.to_string(),
            op: "import",
            reason,
            source: None,
        };
        validate_name("vm", vm).map_err(|e| storage(e.to_string()))?;
        let _vm = self.lock_vm(vm).await;
        for disk in disks {
            validate_name("disk", &disk.name).map_err(|e| storage(e.to_string()))?;
            self.check_standalone_qcow2(&dir.join(disk_file(&disk.name)))
                .await
                .map_err(|why| storage(format!("disk {}: {why}", disk.name)))?;
        }
        let vm_dir = self.inner.layout.vm_disks(vm);
        let mut moves: Vec<(PathBuf, PathBuf)> = disks
            .iter()
            .map(|d| {
                let name = disk_file(&d.name);
                (dir.join(&name), self.inner.layout.disk(vm, &d.name))
            })
            .collect();
        let vars = dir.join(UEFI_VARS_FILE);
        if tokio::fs::try_exists(&vars).await.unwrap_or(false) {
            moves.push((vars, vm_dir.join(super::boot::UEFI_VARS)));
        }
        let floor = self.inner.config.min_free_disk_bytes;
        let vm_name = vm.to_string();
        blocking::unblocked("move imported disks into place", move || {
            place_all(&vm_name, &vm_dir, &moves, floor)
        })
        .await
        .map_err(|e| storage(e.to_string()))
    }

    /// `Err(why)` unless `file` is a qcow2 that names no other file.
    async fn check_standalone_qcow2(&self, file: &Path) -> Result<(), String> {
        let mut cmd = tokio::process::Command::new(&self.inner.config.qemu_img);
        let run = crate::unprivileged::without_capabilities(&mut cmd)
            .args(["info", "--output=json", "-f", "qcow2"])
            .arg(file)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let timeout = self.inner.config.storage_timeout;
        let out = match tokio::time::timeout(timeout, run).await {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => return Err(format!("run qemu-img: {e}")),
            Err(_) => return Err(format!("qemu-img info: no answer within {timeout:?}")),
        };
        if !out.status.success() {
            return Err(format!(
                "not a qcow2 image qemu-img can read: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let info: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| format!("qemu-img info: unreadable output: {e}"))?;
        crate::images::check_disk_info("the exported disk", &info)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// Moves (or, across filesystems, copies) each `(from, to)` into place,
/// never replacing a file; on failure removes what it placed.
fn place_all(vm: &str, vm_dir: &Path, moves: &[(PathBuf, PathBuf)], floor: u64) -> io::Result<()> {
    std::fs::create_dir_all(vm_dir)?;
    let mut placed: Vec<&Path> = Vec::new();
    let mut result = Ok(());
    for (from, to) in moves {
        if let Err(e) = place(vm, vm_dir, from, to, floor) {
            result = Err(e);
            break;
        }
        placed.push(to);
    }
    if result.is_err() {
        for to in placed {
            let _ = std::fs::remove_file(to);
        }
    }
    result?;
    std::fs::File::open(vm_dir)?.sync_all()
}

fn place(vm: &str, vm_dir: &Path, from: &Path, to: &Path, floor: u64) -> io::Result<()> {
    let name = to
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let tmp = vm_dir.join(format!(".{name}.import.{}.tmp", std::process::id()));
    let moved = match std::fs::rename(from, &tmp) {
        Ok(()) => Ok(()),
        // The export was staged on another filesystem than the disk dir.
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            let needed = std::fs::metadata(from)?.len();
            let doing = format!("not importing {name} of VM {vm}");
            crate::free_space::check_floor(vm_dir, floor, needed, &doing)
                .map_err(io::Error::other)?;
            std::fs::copy(from, &tmp).and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        }
        Err(e) => Err(e),
    };
    let done = moved.and_then(|()| rename_noreplace(&tmp, to));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(io::Error::new(
            e.kind(),
            if e.kind() == io::ErrorKind::AlreadyExists {
                format!("{} exists: an import never replaces a disk", to.display())
            } else {
                format!("{}: {e}", to.display())
            },
        ));
    }
    Ok(())
}
