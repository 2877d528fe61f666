//! Linked clones (`keel vm clone --linked`): the clone's disk is a qcow2
//! overlay on a frozen copy of its source's disk at the snapshot, instead
//! of a full copy.
//!
//! ```text
//! disk_dir/.clone-bases/<source vm>-<source uid>/<snapshot>/
//!   <disk>.qcow2          the source's disk at the snapshot (0444; never written)
//!   <disk>.users/<vm>     one note per clone whose disk is an overlay on it
//! ```
//!
//! The base is made once per source, snapshot and disk (`qemu-img convert
//! -l`, as a full clone's copy, onto the same image for an image disk) and
//! shared by every linked clone of that snapshot; the source may go on
//! writing, delete the snapshot or be deleted itself, the base stays. It
//! lives outside every VM's disk dir, so deleting the source does not take
//! it, and it is removed only when the last clone that notes it deletes
//! its disks. A clone's note is written before its overlay is made, so a
//! base is never without a note of an overlay on it.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;

use keel_api::{CloneSource, DiskSpec, Image};

use super::clone_disk::move_into_place;
use super::layout::rename_noreplace;
use super::{blocking, QemuDriver};

/// Where the bases live, in the disk dir.
pub const BASES_DIR: &str = ".clone-bases";

/// Held while a note is added or a base is removed for want of one, so a
/// new clone's note never lands between the last note's removal and the
/// base's.
static BASES: Mutex<()> = Mutex::new(());

/// The slowest copy a clone waits for: 25 MiB/s, as for a full copy.
const COPY_MS_PER_MIB: u64 = 40;

impl QemuDriver {
    fn clone_base(&self, source: &CloneSource, disk: &str) -> PathBuf {
        self.inner
            .layout
            .disks_dir()
            .join(BASES_DIR)
            .join(format!("{}-{}", source.vm, source.vm_uid))
            .join(&source.snapshot)
            .join(format!("{disk}.qcow2"))
    }

    /// Makes `tmp` an overlay on the frozen base of `source`'s disk at the
    /// snapshot (made first if this is the first linked clone of it) and
    /// moves it to `path`.
    pub(super) async fn make_linked(
        &self,
        vm: &str,
        source: &CloneSource,
        disk: &DiskSpec,
        image: Option<&(Image, PathBuf)>,
        tmp: &Path,
        path: &Path,
    ) -> Result<(), String> {
        let base = self.clone_base(source, &disk.name);
        let what = format!(
            "disk {} of VM {vm} is an overlay on VM {}'s disk {} at snapshot {}",
            disk.name, source.vm, disk.name, source.snapshot
        );
        let (note_base, note_vm) = (base.clone(), vm.to_string());
        blocking::unblocked("note a linked clone", move || {
            let _held = BASES.lock().unwrap_or_else(|e| e.into_inner());
            let users = users_dir(&note_base);
            std::fs::create_dir_all(&users)?;
            std::fs::write(users.join(note_vm), b"")
        })
        .await
        .map_err(|e| format!("{what}: note it at {}: {e}", base.display()))?;
        let made: Result<(), String> = async {
            if !tokio::fs::try_exists(&base).await.unwrap_or(false) {
                let from = self.inner.layout.disk(&source.vm, &disk.name);
                let base_tmp = base.with_extension(format!("qcow2.{}.tmp", std::process::id()));
                let mut args: Vec<std::ffi::OsString> = vec![
                    "convert".into(),
                    "-q".into(),
                    "-U".into(),
                    "-f".into(),
                    "qcow2".into(),
                    "-O".into(),
                    "qcow2".into(),
                    "-l".into(),
                    format!("snapshot.name={}", source.snapshot).into(),
                ];
                if let Some((image, image_path)) = image {
                    args.extend(["-F".into(), image.format.as_str().into(), "-B".into()]);
                    args.push(image_path.into());
                }
                args.push(from.clone().into());
                args.push(base_tmp.clone().into());
                let timeout = self.inner.config.storage_timeout
                    + std::time::Duration::from_millis(disk.size_mib.saturating_mul(COPY_MS_PER_MIB));
                tracing::info!(%vm, disk = %disk.name, source = %source.vm, snapshot = %source.snapshot,
                    "making the frozen base of a linked clone");
                if let Err(why) = self.run_qemu_img(&args, timeout).await {
                    let _ = blocking::remove_file(base_tmp).await;
                    return Err(format!("{what}: {why}"));
                }
                let (t, b) = (base_tmp.clone(), base.clone());
                let placed = blocking::unblocked("move a clone base into place", move || {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o444))?;
                    match rename_noreplace(&t, &b) {
                        // Another clone's start made it meanwhile, the same.
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => std::fs::remove_file(&t),
                        other => other,
                    }
                })
                .await;
                if let Err(e) = placed {
                    let _ = blocking::remove_file(base_tmp).await;
                    return Err(format!("{what}: {}: {e}", base.display()));
                }
            }
            let args: Vec<std::ffi::OsString> = vec![
                "create".into(),
                "-q".into(),
                "-f".into(),
                "qcow2".into(),
                "-F".into(),
                "qcow2".into(),
                "-b".into(),
                base.clone().into(),
                tmp.into(),
                format!("{}M", disk.size_mib).into(),
            ];
            if let Err(why) = self
                .run_qemu_img(&args, self.inner.config.storage_timeout)
                .await
            {
                let _ = blocking::remove_file(tmp.to_path_buf()).await;
                return Err(format!("{what}: {why}"));
            }
            move_into_place(tmp, path, "move a linked clone's disk into place").await
        }
        .await;
        // A clone whose disk was not made holds no base: its note goes,
        // and a base made for it alone with it.
        if made.is_err() && !tokio::fs::try_exists(path).await.unwrap_or(true) {
            let (b, v) = (base.clone(), vm.to_string());
            if let Err(e) = blocking::unblocked("drop a failed linked clone's note", move || {
                release(&v, &[b])
            })
            .await
            {
                tracing::warn!(%vm, error = %e, "could not drop the note of a linked clone whose disk was not made");
            }
        }
        made
    }

    async fn run_qemu_img(
        &self,
        args: &[std::ffi::OsString],
        timeout: std::time::Duration,
    ) -> Result<(), String> {
        let qemu_img = &self.inner.config.qemu_img;
        let mut cmd = tokio::process::Command::new(qemu_img);
        crate::unprivileged::without_capabilities(&mut cmd);
        let run = cmd
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(timeout, run).await {
            Ok(Ok(out)) if out.status.success() => Ok(()),
            Ok(Ok(out)) => Err(format!(
                "qemu-img ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Ok(Err(e)) => Err(format!("run {}: {e}", qemu_img.display())),
            Err(_) => Err(format!("qemu-img: no answer within {timeout:?}")),
        }
    }
}

fn users_dir(base: &Path) -> PathBuf {
    base.with_extension("users")
}

/// The clone bases `vm`'s disks (in `vm_disks`) are overlays on, found by
/// their headers; read before the disks are deleted.
pub fn bases_of(disks_dir: &Path, vm_disks: &Path) -> Vec<PathBuf> {
    let bases = disks_dir.join(BASES_DIR);
    let Ok(entries) = std::fs::read_dir(vm_disks) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| crate::qcow2::backing_file(&e.path()).ok().flatten())
        .filter(|b| b.starts_with(&bases))
        .collect()
}

/// Drops `vm`'s note on each of `bases`, and each base no clone notes any
/// more (with its directories, once empty).
pub fn release(vm: &str, bases: &[PathBuf]) -> io::Result<()> {
    let _held = BASES.lock().unwrap_or_else(|e| e.into_inner());
    for base in bases {
        let users = users_dir(base);
        match std::fs::remove_file(users.join(vm)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let in_use = std::fs::read_dir(&users)
            .map(|mut d| d.next().is_some())
            .unwrap_or(false);
        if in_use {
            continue;
        }
        tracing::info!(base = %base.display(), "no linked clone uses this base any more: removing it");
        for gone in [std::fs::remove_dir(&users), std::fs::remove_file(base)] {
            match gone {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        // The snapshot's and the source's directories, once empty.
        let mut dir = base.parent();
        for _ in 0..2 {
            let Some(d) = dir else { break };
            if std::fs::remove_dir(d).is_err() {
                break;
            }
            dir = d.parent();
        }
    }
    Ok(())
}
