//! What an image is the base of, and the check that a disk made from an
//! image still sits on that image's content.
//!
//! A VM's disk made from an image is a qcow2 overlay naming the image file
//! by path; the image must outlive every such overlay, also one no VM's
//! spec names any more (a disk dropped from the spec, one a snapshot would
//! bring back). The driver notes each overlay it makes, in the image dir
//! (shared by the control planes that delete images and the nodes that make
//! overlays):
//!
//! ```text
//! image_dir/.overlays/<image file>/<id>   {"overlay": "/disks/web/root.qcow2", "storage": "<disk dir identity>"}
//! ```
//!
//! before creating the overlay (a crash leaves a note without an overlay,
//! never an overlay without a note), and again at every start (overlays
//! from before notes existed get theirs), and removes the notes when it
//! deletes the VM's disks. [`ImageStore::overlays_on`] reads them: an
//! overlay on storage this host sees (its disk dir carries the identity
//! noted) counts while its header names the image; one that is gone, or
//! now names another base, is a stale note and goes; one on storage this
//! host cannot see (another node's own disk dir) counts, since nothing here
//! can prove it gone.
//!
//! [`check_base`] is the last line: a disk's header must name the very file
//! its image's record was verified against, so a disk whose base was
//! deleted and imported again with other content (which gets another file,
//! `crate::images`) fails its start rather than reading another base.

use std::io;
use std::path::{Path, PathBuf};

use keel_api::Image;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::images::ImageStore;
use crate::qcow2;

/// In a disk dir: a random id written once by the first node to use it
/// (`qemu::disks::storage_identity`).
pub const STORAGE_ID_FILE: &str = ".keel-storage-id";

const OVERLAYS_DIR: &str = ".overlays";

/// The identity a disk dir carries, if it has one.
pub fn read_storage_id(disk_dir: &Path) -> io::Result<Option<String>> {
    match std::fs::read_to_string(disk_dir.join(STORAGE_ID_FILE)) {
        Ok(text) if !text.trim().is_empty() => Ok(Some(text.trim().to_string())),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct OverlayNote {
    overlay: PathBuf,
    /// The identity of the disk dir the overlay is in.
    storage: String,
}

/// An overlay that needs an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayUse {
    pub overlay: PathBuf,
    /// Why it counts without being looked at, if it was not: its storage is
    /// not visible from this host, or it could not be read.
    pub unseen: Option<String>,
}

impl std::fmt::Display for OverlayUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "overlay {}", self.overlay.display())?;
        if let Some(why) = &self.unseen {
            write!(f, " ({why})")?;
        }
        Ok(())
    }
}

impl ImageStore {
    /// Where the notes of overlays on `base` are; `None` for a file that is
    /// not in this store.
    fn notes_dir(&self, base: &Path) -> Option<PathBuf> {
        if base.parent() != Some(self.dir()) {
            return None;
        }
        Some(self.dir().join(OVERLAYS_DIR).join(base.file_name()?))
    }

    /// Notes (durably; idempotent) that `overlay`, in the disk dir of
    /// identity `storage`, is made on `base`, a file of this store.
    pub fn note_overlay(&self, base: &Path, overlay: &Path, storage: &str) -> io::Result<()> {
        let Some(dir) = self.notes_dir(base) else {
            return Err(io::Error::other(format!(
                "{} is not a file of the image store {}",
                base.display(),
                self.dir().display()
            )));
        };
        let note = OverlayNote {
            overlay: overlay.to_path_buf(),
            storage: storage.to_string(),
        };
        let path = dir.join(note_id(overlay));
        if read_note(&path).ok().as_ref() == Some(&note) {
            return Ok(());
        }
        std::fs::create_dir_all(&dir)?;
        let tmp = dir.join(format!(".{}.{}.tmp", note_id(overlay), std::process::id()));
        let bytes = serde_json::to_vec(&note).map_err(io::Error::other)?;
        let written = std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, &path))
            .and_then(|()| std::fs::File::open(&dir)?.sync_all());
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Drops the note of `overlay` on `base` (the overlay is gone).
    pub fn forget_overlay(&self, base: &Path, overlay: &Path) -> io::Result<()> {
        let Some(dir) = self.notes_dir(base) else {
            return Ok(());
        };
        match std::fs::remove_file(dir.join(note_id(overlay))) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        // The last note of the image: its directory goes too (a non-empty
        // one stays).
        let _ = std::fs::remove_dir(&dir);
        Ok(())
    }

    /// The overlays made on `image`'s file (under either of its names),
    /// dropping the notes of those seen gone.
    pub fn overlays_on(&self, image: &Image) -> io::Result<Vec<OverlayUse>> {
        let mut uses = Vec::new();
        for base in [self.path(image), self.legacy_path(image)]
            .into_iter()
            .flatten()
        {
            let Some(dir) = self.notes_dir(&base) else {
                continue;
            };
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for entry in entries {
                let path = entry?.path();
                if path
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                {
                    continue;
                }
                let note = match read_note(&path) {
                    Ok(note) => note,
                    Err(e) => {
                        uses.push(OverlayUse {
                            overlay: path,
                            unseen: Some(format!("its note is unreadable: {e}")),
                        });
                        continue;
                    }
                };
                match still_on(&note, &base) {
                    Ok(true) => uses.push(OverlayUse {
                        overlay: note.overlay,
                        unseen: None,
                    }),
                    Ok(false) => {
                        tracing::info!(overlay = %note.overlay.display(), base = %base.display(), "dropping the note of an overlay that is gone");
                        self.forget_overlay(&base, &note.overlay)?;
                    }
                    Err(why) => uses.push(OverlayUse {
                        overlay: note.overlay,
                        unseen: Some(why),
                    }),
                }
            }
        }
        Ok(uses)
    }
}

/// Whether the noted overlay still exists and names `base`; `Err` (with
/// why) when that cannot be seen from here, which counts as yes.
fn still_on(note: &OverlayNote, base: &Path) -> Result<bool, String> {
    let disk_dir = note
        .overlay
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("/"));
    match read_storage_id(disk_dir) {
        Ok(Some(id)) if id == note.storage => {}
        Ok(_) => {
            return Err(format!(
                "on disk storage {} that this host does not see",
                note.storage
            ))
        }
        Err(e) => return Err(format!("disk dir {}: {e}", disk_dir.display())),
    }
    match qcow2::backing_file(&note.overlay) {
        Ok(Some(backing)) => Ok(same_file(&backing, base)),
        Ok(None) => Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(format!("unreadable: {e}")),
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b
        || a.canonicalize()
            .is_ok_and(|a| b.canonicalize().ok() == Some(a))
}

/// Checks that `disk`, made from `image`, is an overlay on `base`, the file
/// `image`'s record was just verified against: never started on any other
/// base. A disk without a backing file (flattened) reads nothing else.
pub fn check_base(disk: &Path, image: &Image, base: &Path) -> Result<(), String> {
    let backing = qcow2::backing_file(disk).map_err(|e| {
        format!(
            "disk {} (made from image {}): cannot read its header: {e}",
            disk.display(),
            image.name
        )
    })?;
    match backing {
        Some(backing) if !same_file(&backing, base) => Err(format!(
            "disk {} was made on {}, but image {} is now the file {} (sha256 {}): the \
             content the disk was made on is gone (the image was deleted and imported \
             again?); not starting it on a different base",
            disk.display(),
            backing.display(),
            image.name,
            base.display(),
            image.sha256
        )),
        _ => Ok(()),
    }
}

fn note_id(overlay: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    hex::encode(&Sha256::digest(overlay.as_os_str().as_bytes())[..16])
}

fn read_note(path: &Path) -> io::Result<OverlayNote> {
    let bytes = std::fs::read(path)?;
    serde_json::from_slice(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Duration;

    fn overlay_on(base: &Path, overlay: &Path) {
        std::fs::create_dir_all(overlay.parent().unwrap()).unwrap();
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(base)
            .arg(overlay)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    async fn imported(store: &ImageStore, fill: u8) -> (Image, PathBuf) {
        let mut up = store.begin("base").await.unwrap();
        up.write(&[fill; 4096]).await.unwrap();
        let staged = store
            .finish(up, keel_api::ImageKind::Disk, 1)
            .await
            .unwrap();
        let image = staged.image.clone();
        (image, store.commit(staged).unwrap())
    }

    #[tokio::test]
    async fn an_overlay_counts_until_it_is_seen_gone() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let store = ImageStore::open(
            &root.join("images"),
            Path::new("qemu-img"),
            Duration::from_secs(30),
        )
        .unwrap();
        let (image, base) = imported(&store, 1).await;
        let disks = root.join("disks");
        std::fs::create_dir_all(&disks).unwrap();
        std::fs::write(disks.join(STORAGE_ID_FILE), "here\n").unwrap();
        let overlay = disks.join("web/root.qcow2");
        overlay_on(&base, &overlay);
        store.note_overlay(&base, &overlay, "here").unwrap();
        store.note_overlay(&base, &overlay, "here").unwrap();
        let away = disks.join("db/root.qcow2");
        store.note_overlay(&base, &away, "another-node").unwrap();
        let mut uses = store.overlays_on(&image).unwrap();
        uses.sort_by(|a, b| a.overlay.cmp(&b.overlay));
        assert_eq!(uses.len(), 2, "{uses:?}");
        assert_eq!((&uses[0].overlay, uses[0].unseen.is_some()), (&away, true));
        assert_eq!((&uses[1].overlay, &uses[1].unseen), (&overlay, &None));

        store.forget_overlay(&base, &away).unwrap();
        std::fs::remove_file(&overlay).unwrap();
        assert!(store.overlays_on(&image).unwrap().is_empty());
        assert!(
            !root
                .join("images/.overlays")
                .join(base.file_name().unwrap())
                .exists(),
            "the note of the gone overlay went with its directory"
        );
        assert!(store
            .note_overlay(Path::new("/etc/passwd"), &overlay, "here")
            .is_err());
    }

    #[tokio::test]
    async fn a_disk_starts_only_on_the_file_its_image_was_verified_as() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let store = ImageStore::open(
            &root.join("images"),
            Path::new("qemu-img"),
            Duration::from_secs(30),
        )
        .unwrap();
        let (first, first_base) = imported(&store, 1).await;
        let disk = root.join("disks/web/root.qcow2");
        overlay_on(&first_base, &disk);
        check_base(&disk, &first, &first_base).unwrap();

        store.remove(&first).unwrap();
        let (second, second_base) = imported(&store, 2).await;
        let err = check_base(&disk, &second, &second_base).unwrap_err();
        assert!(
            err.contains("different base") && err.contains(&second.sha256),
            "{err}"
        );

        // A disk made by an older Keel on the file named without checksum:
        // that file, verified, is its base.
        let legacy = store.legacy_path(&second).unwrap();
        std::fs::copy(&second_base, &legacy).unwrap();
        let old_disk = root.join("disks/old/root.qcow2");
        overlay_on(&legacy, &old_disk);
        check_base(&old_disk, &second, &legacy).unwrap();
        assert!(check_base(&old_disk, &second, &second_base).is_err());
    }
}
