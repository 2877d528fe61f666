//! A UEFI VM's variable store in its snapshots.
//!
//! The store (`uefi-vars.fd`, OVMF's pflash unit 1, raw) is firmware state
//! as much as the disks are guest state: boot entries, boot order, Secure
//! Boot keys. A restore that brought the disks back but kept today's store
//! could boot an entry that points at nothing on the restored disks. Being
//! raw, it has no internal snapshots, so each snapshot keeps a copy of its
//! own beside the disks: `uefi-vars.snapshots/<snapshot>.fd` (snapshot
//! names are validated as names, so they are safe file names; the
//! directory goes with the disks when the VM is deleted).
//!
//! Taken live, the copy is made while the guest is paused for the disks'
//! snapshots: QEMU writes the flash synchronously as the firmware programs
//! it, so with no vCPU running the file is the store as the guest left it.
//! A snapshot taken when the VM had no store (never booted with UEFI)
//! keeps none; restoring it leaves the store as it is.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use super::super::boot::UEFI_VARS;
use super::super::layout::rename_noreplace;

/// The directory, in the VM's disk dir, of its snapshots' stores.
pub const SNAPSHOTS_DIR: &str = "uefi-vars.snapshots";

/// A VM's variable store and its snapshots' copies.
#[derive(Debug, Clone)]
pub struct VarsStore {
    live: PathBuf,
    copies: PathBuf,
}

impl VarsStore {
    /// The store of the VM whose disks are in `vm_disks`.
    pub fn of(vm_disks: &Path) -> Self {
        Self {
            live: vm_disks.join(UEFI_VARS),
            copies: vm_disks.join(SNAPSHOTS_DIR),
        }
    }

    pub fn copy_of(&self, snapshot: &str) -> PathBuf {
        self.copies.join(format!("{snapshot}.fd"))
    }

    /// Keeps the current store as snapshot `snapshot`'s, replacing an
    /// older copy of that name. `Ok(false)`: the VM has no store, and the
    /// snapshot keeps none.
    pub fn save(&self, snapshot: &str) -> io::Result<bool> {
        let copy = self.copy_of(snapshot);
        if !self.live.is_file() {
            remove_if_present(&copy)?;
            return Ok(false);
        }
        fs::create_dir_all(&self.copies)?;
        durable_copy(&self.live, &copy)?;
        Ok(true)
    }

    /// Puts snapshot `snapshot`'s copy back as the VM's store. `Ok(false)`:
    /// the snapshot has none, and the store is left as it is.
    pub fn restore(&self, snapshot: &str) -> io::Result<bool> {
        let copy = self.copy_of(snapshot);
        if !copy.is_file() {
            return Ok(false);
        }
        durable_copy(&copy, &self.live)?;
        Ok(true)
    }

    pub fn remove(&self, snapshot: &str) -> io::Result<()> {
        remove_if_present(&self.copy_of(snapshot))
    }
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Copies `from` over `to` so that `to` is always either the old file or
/// the whole new one, also after a power loss: a temporary file beside it,
/// fsynced, renamed into place, the directory fsynced.
fn durable_copy(from: &Path, to: &Path) -> io::Result<()> {
    let dir = to
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no directory", to.display())))?;
    let name = to
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = fs::copy(from, &tmp)
        .and_then(|_| File::open(&tmp)?.sync_all())
        .and_then(|()| {
            // Over an existing file: rename replaces it atomically. Into an
            // empty place: the same, without replacing a directory.
            if to.exists() {
                fs::rename(&tmp, to)
            } else {
                rename_noreplace(&tmp, to)
            }
        })
        .and_then(|()| File::open(dir)?.sync_all());
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_keeps_the_store_and_a_restore_brings_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let vars = VarsStore::of(dir.path());
        assert!(!vars.save("s0").unwrap(), "no store: nothing kept");
        assert!(!vars.copy_of("s0").exists());

        fs::write(dir.path().join(UEFI_VARS), b"boot entries at s1").unwrap();
        assert!(vars.save("s1").unwrap());
        fs::write(dir.path().join(UEFI_VARS), b"changed later").unwrap();

        assert!(vars.restore("s1").unwrap());
        assert_eq!(
            fs::read(dir.path().join(UEFI_VARS)).unwrap(),
            b"boot entries at s1"
        );
        // Without a copy of its own the store stays.
        fs::write(dir.path().join(UEFI_VARS), b"today").unwrap();
        assert!(!vars.restore("s0").unwrap());
        assert_eq!(fs::read(dir.path().join(UEFI_VARS)).unwrap(), b"today");

        vars.remove("s1").unwrap();
        vars.remove("s1").unwrap();
        assert!(!vars.restore("s1").unwrap());
        let left: Vec<_> = fs::read_dir(dir.path().join(SNAPSHOTS_DIR))
            .unwrap()
            .collect();
        assert!(left.is_empty(), "no temporary files left: {left:?}");
    }
}
