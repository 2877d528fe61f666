//! A clone's disk made as a copy of its source's at a snapshot (`keel vm
//! clone`): `qemu-img convert -l snapshot.name=S` reads the disk as the
//! snapshot holds it, which does not change while the source runs (qcow2
//! copies a cluster a snapshot shares before writing it), so `-U` lets
//! the copy read the image a running QEMU has open. A disk made from an
//! image is copied onto the same image (`-B`): the clone's own overlay,
//! holding only what the source changed. Built under a temporary name and
//! moved into place, like every new disk: a crash leaves no half copy that
//! looks ready.
//!
//! A UEFI source's variable store as the snapshot kept it (boot entries,
//! boot order, Secure Boot keys) is copied too, before the clone's first
//! start would make a fresh one from the template: the clone's disks at
//! the snapshot go with the firmware state that boots them.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use keel_api::{CloneSource, DiskSpec, Image};

use super::layout::rename_noreplace;
use super::snapshot::uefi_vars::VarsStore;
use super::{blocking, QemuDriver};

/// The slowest copy a clone waits for: 25 MiB/s (beyond the storage
/// timeout every `qemu-img` call has).
const COPY_MS_PER_MIB: u64 = 40;

impl QemuDriver {
    pub(super) async fn copy_at_snapshot(
        &self,
        vm: &str,
        source: &CloneSource,
        disk: &DiskSpec,
        base: Option<&(Image, PathBuf)>,
        tmp: &Path,
        path: &Path,
    ) -> Result<(), String> {
        self.copy_clone_vars(vm, source).await?;
        if source.linked {
            return self.make_linked(vm, source, disk, base, tmp, path).await;
        }
        let from = self.inner.layout.disk(&source.vm, &disk.name);
        let what = format!(
            "disk {} of VM {vm} is a copy of VM {}'s disk {} at snapshot {}",
            disk.name, source.vm, disk.name, source.snapshot
        );
        let exists = tokio::fs::try_exists(&from)
            .await
            .map_err(|e| format!("{what}: {}: {e}", from.display()))?;
        if !exists {
            return Err(format!(
                "{what}, which is missing at {} (VM {} deleted, or on another node?): no \
                 blank disk is made in its place",
                from.display(),
                source.vm
            ));
        }
        let qemu_img = &self.inner.config.qemu_img;
        let mut cmd = tokio::process::Command::new(qemu_img);
        crate::unprivileged::without_capabilities(&mut cmd);
        cmd.args(["convert", "-q", "-U", "-f", "qcow2", "-O", "qcow2", "-l"])
            .arg(format!("snapshot.name={}", source.snapshot));
        if let Some((image, base)) = base {
            cmd.args(["-F", image.format.as_str(), "-B"]).arg(base);
        }
        let timeout = self.inner.config.storage_timeout
            + std::time::Duration::from_millis(disk.size_mib.saturating_mul(COPY_MS_PER_MIB));
        tracing::info!(%vm, disk = %disk.name, source = %source.vm, snapshot = %source.snapshot,
            "copying a clone's disk from its source at the snapshot");
        let run = cmd
            .arg(&from)
            .arg(tmp)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let failed = |why: String| async move {
            let _ = blocking::remove_file(tmp.to_path_buf()).await;
            Err(format!("{what}: {why}"))
        };
        let out = match tokio::time::timeout(timeout, run).await {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => return failed(format!("run {}: {e}", qemu_img.display())).await,
            Err(_) => {
                return failed(format!("qemu-img convert: no answer within {timeout:?}")).await
            }
        };
        if !out.status.success() {
            return failed(format!(
                "qemu-img convert {} ({}): {}",
                from.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
            .await;
        }
        move_into_place(tmp, path, "move a cloned disk into place").await
    }

    /// The source's variable store at the snapshot as the clone's, unless
    /// the clone has one already or the snapshot kept none.
    async fn copy_clone_vars(&self, vm: &str, source: &CloneSource) -> Result<(), String> {
        let from = VarsStore::of(&self.inner.layout.vm_disks(&source.vm)).copy_of(&source.snapshot);
        let vm_dir = self.inner.layout.vm_disks(vm);
        blocking::unblocked("copy a clone's UEFI variable store", move || {
            let to = vm_dir.join(super::boot::UEFI_VARS);
            if to.exists() {
                return Ok(());
            }
            let tmp = vm_dir.join(format!(
                ".{}.clone.{}.tmp",
                super::boot::UEFI_VARS,
                std::process::id()
            ));
            match std::fs::copy(&from, &tmp) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            let placed = std::fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .and_then(|()| rename_noreplace(&tmp, &to));
            match placed {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => std::fs::remove_file(&tmp),
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    Err(e)
                }
                Ok(()) => Ok(()),
            }
        })
        .await
        .map_err(|e| {
            format!(
                "UEFI variable store of VM {vm} from VM {}'s at snapshot {}: {e}",
                source.vm, source.snapshot
            )
        })
    }
}

/// Moves a disk made at `tmp` to `path`, never over one that is there:
/// one already there was made meanwhile by another start from the same
/// snapshot (or base), so the loser's copy is dropped and both succeed.
pub(super) async fn move_into_place(
    tmp: &Path,
    path: &Path,
    what: &'static str,
) -> Result<(), String> {
    let (from_tmp, to) = (tmp.to_path_buf(), path.to_path_buf());
    match blocking::unblocked(what, move || rename_noreplace(&from_tmp, &to)).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let _ = blocking::remove_file(tmp.to_path_buf()).await;
            Ok(())
        }
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}
