//! The image store's files: where they live, how an import is checked and
//! made visible, and the checksum check before a VM is started on one.
//!
//! ```text
//! image_dir/
//!   <name>.<sha256>.qcow2 | .raw  disk images (read-only, 0444)
//!   <name>.<sha256>.kernel        kernels for direct boot
//!   <name>.<sha256>.initrd        initrds for direct boot
//!   <name>.<sha256>.iso           ISO 9660 images for CD-ROMs
//!   <name>.qcow2 | .raw | ...     the same, imported before names carried the checksum
//!   .overlays/<image file>/<id>   the overlays made on an image (`crate::image_refs`)
//!   .import-<name>-<pid>-<n>      an upload in progress (never an image)
//! ```
//!
//! A file is named by its image's name *and* checksum because a VM's root
//! disk is a qcow2 overlay that names its base by path: an image deleted
//! and imported again under the same name gets another path, so no overlay
//! made on the first can ever open the second as its base. Files imported
//! before (`<name>.<ext>`) are still found there, and their overlays keep
//! naming that path.
//!
//! An upload is written to a temporary file, hashed while it streams (never
//! held in memory), checked (`qemu-img info` for disks: qcow2 or raw only, no
//! backing file, no external data file, no encryption), fsynced, and only
//! then renamed into place (and the directory fsynced): a partial upload is
//! never an image. The `Image` record in the store is the authority on what
//! the file must be; [`ImageStore::verify`] compares the file's SHA-256 with
//! it before a VM uses the file, so a missing, truncated or replaced file
//! fails the start instead of booting something else. The hash of a file
//! whose identity (device, inode, size, mtime, ctime) has not changed since
//! it last matched is not recomputed.
//!
//! In a cluster the API server (which imports) and the nodes (which boot)
//! are different hosts: the image dir must then be storage they all mount at
//! the same path, like a shared disk dir, since a VM's root disk is a qcow2
//! overlay naming its image by absolute path.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use keel_api::{validate_name, Image, ImageFormat, ImageKind, Millis};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

/// Temporary uploads older than this are left by a crashed import and
/// removed when a store is opened; younger ones may be another server's
/// upload in progress (a shared image dir).
const STALE_UPLOAD: Duration = Duration::from_secs(24 * 3600);

const UPLOAD_PREFIX: &str = ".import-";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("image dir {path}: {reason}")]
    Dir { path: PathBuf, reason: String },
    /// The uploaded file is not something Keel will boot: the client's
    /// mistake (4xx).
    #[error("image {name}: {reason}")]
    Rejected { name: String, reason: String },
    /// The node failed (disk full, qemu-img missing): not the client's
    /// mistake (5xx).
    #[error("image {name}: {op}: {reason}")]
    Io {
        name: String,
        op: &'static str,
        reason: String,
    },
    /// The image dir's filesystem is below its free-space floor.
    #[error("image {name}: {reason}")]
    NoSpace { name: String, reason: String },
    #[error("image {name}: file {} is missing (is the image dir shared storage every node mounts at the same path?)", path.display())]
    Missing { name: String, path: PathBuf },
    #[error("image {name}: file {} has sha256 {actual} (size {size} bytes), but the image was imported with {expected}: it was changed or replaced; not booting it", path.display())]
    ChecksumMismatch {
        name: String,
        path: PathBuf,
        expected: String,
        actual: String,
        size: u64,
    },
}

/// What identifies a file's content without reading it: any write changes
/// the ctime, which no user can set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }
}

#[derive(Debug)]
pub struct ImageStore {
    dir: PathBuf,
    qemu_img: PathBuf,
    /// Bounds each `qemu-img info`.
    timeout: Duration,
    /// Files whose hash matched their record, by path.
    verified: Mutex<HashMap<PathBuf, (FileStamp, String)>>,
    uploads: AtomicU64,
    /// No upload starts or goes on while the dir's filesystem has less
    /// free ([`crate::free_space`]); 0: no floor.
    min_free_bytes: u64,
}

/// How much an upload writes between two looks at the free space.
const FREE_SPACE_CHECK_BYTES: u64 = 64 << 20;

impl ImageStore {
    /// Opens (creating it if missing) the image dir. Absolute, since
    /// overlays name their image by path.
    pub fn open(dir: &Path, qemu_img: &Path, timeout: Duration) -> Result<Self, ImageError> {
        let err = |reason: String| ImageError::Dir {
            path: dir.to_path_buf(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
        let abs = dir.canonicalize().map_err(|e| err(e.to_string()))?;
        let Some(text) = abs.to_str() else {
            return Err(err("path is not UTF-8".into()));
        };
        if text.contains([',', ':']) {
            // qemu-img's backing-file option and QEMU's -drive would misread it.
            return Err(err("path must not contain ',' or ':'".into()));
        }
        let store = Self {
            dir: abs,
            qemu_img: qemu_img.to_path_buf(),
            timeout,
            verified: Mutex::new(HashMap::new()),
            uploads: AtomicU64::new(0),
            min_free_bytes: crate::free_space::DEFAULT_MIN_FREE_DISK_MIB << 20,
        };
        store.remove_stale_uploads();
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The free space kept on the image dir's filesystem
    /// (`--min-free-disk-mib`).
    pub fn min_free_bytes(&self) -> u64 {
        self.min_free_bytes
    }

    /// The free-space floor (`--min-free-disk-mib`); 0 turns it off.
    pub fn with_min_free_bytes(mut self, bytes: u64) -> Self {
        self.min_free_bytes = bytes;
        self
    }

    /// Where the file of `image` goes: named by its name and checksum.
    /// `None` for a record that is not valid (it can have no file here).
    pub fn path(&self, image: &Image) -> Option<PathBuf> {
        image.validate().ok()?;
        Some(self.dir.join(format!(
            "{}.{}.{}",
            image.name,
            image.sha256,
            extension(image)
        )))
    }

    /// Where the file of `image` was put by a Keel whose file names did not
    /// carry the checksum; still read, so existing stores keep working.
    pub fn legacy_path(&self, image: &Image) -> Option<PathBuf> {
        image.validate().ok()?;
        Some(
            self.dir
                .join(format!("{}.{}", image.name, extension(image))),
        )
    }

    /// The file of `image` that exists: under its checksum name, else
    /// under the name an older Keel gave it. `None` if neither.
    async fn existing_path(&self, image: &Image) -> Result<Option<PathBuf>, ImageError> {
        for path in [self.path(image), self.legacy_path(image)]
            .into_iter()
            .flatten()
        {
            // The image dir is shared in a cluster: even a stat may be slow.
            match tokio::fs::metadata(&path).await {
                Ok(_) => return Ok(Some(path)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&image.name, "stat", &path, e)),
            }
        }
        Ok(None)
    }

    /// Refuses (`NoSpace`) an import of `needed` bytes that the image
    /// dir's filesystem cannot hold above its floor, before any is written.
    pub async fn check_room(&self, name: &str, needed: u64) -> Result<(), ImageError> {
        let (dir, floor) = (self.dir.clone(), self.min_free_bytes);
        let free = tokio::task::spawn_blocking(move || crate::free_space::free_bytes(&dir))
            .await
            .map_err(|e| io_err(name, "free space", &self.dir, io::Error::other(e)))?
            .map_err(|e| io_err(name, "free space", &self.dir, e))?;
        if free >= needed.saturating_add(floor) {
            return Ok(());
        }
        Err(ImageError::NoSpace {
            name: name.to_string(),
            reason: format!(
                "not importing: {needed} bytes do not fit in the {} MiB free on the filesystem of {} \
                 (above its floor of {} MiB, --min-free-disk-mib)",
                free >> 20,
                self.dir.display(),
                floor >> 20
            ),
        })
    }

    /// Starts an upload of image `name` into a temporary file.
    pub async fn begin(&self, name: &str) -> Result<Upload, ImageError> {
        validate_name("name", name).map_err(|e| ImageError::Rejected {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        check_space(name, &self.dir, self.min_free_bytes).await?;
        let n = self.uploads.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!("{UPLOAD_PREFIX}{name}-{}-{n}", std::process::id()));
        let file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .await
            .map_err(|e| io_err(name, "create upload file", &tmp, e))?;
        Ok(Upload {
            name: name.to_string(),
            file: Some(file),
            hasher: Sha256::new(),
            size: 0,
            tmp: TempFile(Some(tmp)),
            dir: self.dir.clone(),
            min_free_bytes: self.min_free_bytes,
            space_checked_at: 0,
        })
    }

    /// Ends an upload: flushes and fsyncs it, checks it is an image of
    /// `kind` Keel will boot, and returns it ready to commit.
    pub async fn finish(
        &self,
        mut upload: Upload,
        kind: ImageKind,
        now: Millis,
    ) -> Result<Staged, ImageError> {
        let name = upload.name.clone();
        let tmp = upload.tmp.path().to_path_buf();
        let mut file = upload.file.take().expect("an upload is finished once");
        file.flush()
            .await
            .and(file.sync_all().await)
            .map_err(|e| io_err(&name, "sync upload", &tmp, e))?;
        drop(file);
        if upload.size == 0 {
            return Err(rejected(&name, "the upload is empty"));
        }
        let (format, virtual_size) = match kind {
            ImageKind::Disk => self.inspect_disk(&name, &tmp).await?,
            ImageKind::Kernel => {
                check_kernel(&name, &tmp)?;
                (ImageFormat::Raw, upload.size)
            }
            ImageKind::Initrd => (ImageFormat::Raw, upload.size),
            ImageKind::Iso => {
                check_iso(&name, &tmp)?;
                (ImageFormat::Raw, upload.size)
            }
        };
        let sha256 = hex::encode(upload.hasher.clone().finalize());
        let image = Image {
            name: name.clone(),
            kind,
            format,
            size_bytes: upload.size,
            virtual_size_bytes: virtual_size,
            sha256,
            created_at: now,
        };
        Ok(Staged {
            image,
            tmp: std::mem::take(&mut upload.tmp),
        })
    }

    /// Moves a checked upload into place (read-only), durably. Called after
    /// the record was created, so a name is never taken by two files.
    pub fn commit(&self, mut staged: Staged) -> Result<PathBuf, ImageError> {
        use std::os::unix::fs::PermissionsExt;
        let name = staged.image.name.clone();
        let path = self
            .path(&staged.image)
            .ok_or_else(|| rejected(&name, "invalid name"))?;
        let tmp = staged.tmp.path().to_path_buf();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444))
            .map_err(|e| io_err(&name, "make read-only", &tmp, e))?;
        // Replaces only a file no record named (left by a failed delete).
        std::fs::rename(&tmp, &path).map_err(|e| io_err(&name, "rename into place", &path, e))?;
        staged.tmp.0 = None;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err(&name, "sync image dir", &self.dir, e))?;
        let meta = std::fs::metadata(&path).map_err(|e| io_err(&name, "stat", &path, e))?;
        self.remember(&path, FileStamp::of(&meta), &staged.image.sha256);
        Ok(path)
    }

    /// The image's file, after checking its content is what was imported.
    pub async fn verify(&self, image: &Image) -> Result<PathBuf, ImageError> {
        let name = image.name.clone();
        let path = self
            .path(image)
            .ok_or_else(|| rejected(&name, "not a valid image record"))?;
        let path = self.existing_path(image).await?.unwrap_or(path);
        let meta = match tokio::fs::metadata(&path).await {
            Ok(m) if m.is_file() => m,
            Ok(_) => return Err(ImageError::Missing { name, path }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ImageError::Missing { name, path })
            }
            Err(e) => return Err(io_err(&name, "stat", &path, e)),
        };
        let stamp = FileStamp::of(&meta);
        let known = self
            .verified
            .lock()
            .expect("verified lock")
            .get(&path)
            .cloned();
        if known.is_some_and(|(s, sha)| s == stamp && sha == image.sha256) {
            return Ok(path);
        }
        let hashed = path.clone();
        let actual = tokio::task::spawn_blocking(move || sha256_file(&hashed))
            .await
            .map_err(|e| io_err(&name, "hash", &path, io::Error::other(e)))?
            .map_err(|e| io_err(&name, "hash", &path, e))?;
        if actual != image.sha256 {
            return Err(ImageError::ChecksumMismatch {
                name,
                path,
                expected: image.sha256.clone(),
                actual,
                size: stamp.size,
            });
        }
        self.remember(&path, stamp, &actual);
        Ok(path)
    }

    /// Removes the image's file (under either name); absent is success.
    pub fn remove(&self, image: &Image) -> Result<(), ImageError> {
        for path in [self.path(image), self.legacy_path(image)]
            .into_iter()
            .flatten()
        {
            self.verified.lock().expect("verified lock").remove(&path);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&image.name, "remove", &path, e)),
            }
        }
        Ok(())
    }

    fn remember(&self, path: &Path, stamp: FileStamp, sha: &str) {
        self.verified
            .lock()
            .expect("verified lock")
            .insert(path.to_path_buf(), (stamp, sha.to_string()));
    }

    fn remove_stale_uploads(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let stale = entry
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > STALE_UPLOAD);
            if stale
                && entry
                    .file_name()
                    .to_string_lossy()
                    .starts_with(UPLOAD_PREFIX)
            {
                tracing::info!(path = %entry.path().display(), "removing an abandoned image upload");
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// `qemu-img info` of an uploaded disk image: its format and virtual
    /// size, or why Keel will not boot it.
    async fn inspect_disk(
        &self,
        name: &str,
        file: &Path,
    ) -> Result<(ImageFormat, u64), ImageError> {
        let mut cmd = tokio::process::Command::new(&self.qemu_img);
        let run = crate::unprivileged::without_capabilities(&mut cmd)
            .args(["info", "--output=json"])
            .arg(file)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(self.timeout, run)
            .await
            .map_err(|_| ImageError::Io {
                name: name.to_string(),
                op: "qemu-img info",
                reason: format!("no answer within {:?}", self.timeout),
            })?
            .map_err(|e| io_err(name, "run qemu-img", &self.qemu_img, e))?;
        if !out.status.success() {
            return Err(rejected(
                name,
                format!(
                    "qemu-img cannot read it: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        let info: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| ImageError::Io {
                name: name.to_string(),
                op: "qemu-img info",
                reason: format!("unreadable output: {e}"),
            })?;
        check_disk_info(name, &info)
    }
}

fn extension(image: &Image) -> &'static str {
    match (image.kind, image.format) {
        (ImageKind::Disk, f) => f.as_str(),
        (ImageKind::Kernel, _) => "kernel",
        (ImageKind::Initrd, _) => "initrd",
        (ImageKind::Iso, _) => "iso",
    }
}

/// The rules for a disk image, on `qemu-img info --output=json`.
pub fn check_disk_info(
    name: &str,
    info: &serde_json::Value,
) -> Result<(ImageFormat, u64), ImageError> {
    let format = match info["format"].as_str() {
        Some("qcow2") => ImageFormat::Qcow2,
        Some("raw") => ImageFormat::Raw,
        other => {
            return Err(rejected(
                name,
                format!(
                    "format {} is not supported; import qcow2 or raw (qemu-img convert -O qcow2 IN OUT)",
                    other.unwrap_or("(unknown)")
                ),
            ))
        }
    };
    // A backing file or an external data file would make QEMU (as root)
    // open whatever path the image names.
    if let Some(backing) = info["backing-filename"].as_str() {
        return Err(rejected(
            name,
            format!(
                "it has a backing file ({backing}); import a standalone image \
                 (qemu-img convert -O qcow2 IN OUT)"
            ),
        ));
    }
    let specific = &info["format-specific"]["data"];
    if let Some(data_file) = specific["data-file"].as_str() {
        return Err(rejected(
            name,
            format!(
                "it keeps its data in an external data file ({data_file}); import a \
                 standalone image (qemu-img convert -O qcow2 IN OUT)"
            ),
        ));
    }
    if info["encrypted"].as_bool() == Some(true) || !specific["encrypt"].is_null() {
        return Err(rejected(
            name,
            "it is encrypted; import an unencrypted image",
        ));
    }
    if specific["corrupt"].as_bool() == Some(true) {
        return Err(rejected(
            name,
            "qcow2 marks it corrupt (qemu-img check -r all)",
        ));
    }
    if info["dirty-flag"].as_bool() == Some(true) {
        return Err(rejected(
            name,
            "it was not closed cleanly (dirty flag set); repair it with qemu-img check -r all",
        ));
    }
    let size = info["virtual-size"]
        .as_u64()
        .filter(|s| *s > 0)
        .ok_or_else(|| rejected(name, "qemu-img reports no virtual size"))?;
    Ok((format, size))
}

/// A Linux x86 boot image carries "HdrS" at 0x202 (the boot protocol's
/// header): anything else is refused at import, not at first boot.
fn check_kernel(name: &str, file: &Path) -> Result<(), ImageError> {
    let mut head = [0u8; 0x206];
    let ok = std::fs::File::open(file)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok();
    if ok && &head[0x202..0x206] == b"HdrS" {
        Ok(())
    } else {
        Err(rejected(
            name,
            "not a Linux kernel image (no x86 boot protocol header \"HdrS\" at 0x202)",
        ))
    }
}

/// Where ISO 9660 puts its first volume descriptor: after 16 sectors of
/// 2048 bytes the system area holds (an MBR or anything else).
const ISO_DESCRIPTOR_OFFSET: u64 = 16 * 2048;

/// An ISO 9660 image (what an installer CD is): its first volume
/// descriptor carries the standard identifier `CD001`. Anything else
/// (a disk image imported with the wrong kind, say) is refused, since the
/// guest would see a CD-ROM it cannot read.
fn check_iso(name: &str, file: &Path) -> Result<(), ImageError> {
    use std::io::{Seek, SeekFrom};
    let mut identifier = [0u8; 6];
    let ok = std::fs::File::open(file)
        .and_then(|mut f| {
            f.seek(SeekFrom::Start(ISO_DESCRIPTOR_OFFSET))?;
            f.read_exact(&mut identifier)
        })
        .is_ok();
    if ok && &identifier[1..6] == b"CD001" {
        Ok(())
    } else {
        Err(rejected(
            name,
            "not an ISO 9660 image (no volume descriptor \"CD001\" at 32769); \
             a disk image is imported with --kind disk",
        ))
    }
}

fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

fn rejected(name: &str, reason: impl Into<String>) -> ImageError {
    ImageError::Rejected {
        name: name.to_string(),
        reason: reason.into(),
    }
}

fn io_err(name: &str, op: &'static str, path: &Path, e: io::Error) -> ImageError {
    ImageError::Io {
        name: name.to_string(),
        op,
        reason: format!("{}: {e}", path.display()),
    }
}

/// A temporary file removed when dropped, unless taken.
#[derive(Debug, Default)]
struct TempFile(Option<PathBuf>);

impl TempFile {
    fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// An upload in progress. Dropped before [`ImageStore::finish`] (the client
/// went away, the body failed), its file is removed.
#[derive(Debug)]
pub struct Upload {
    name: String,
    file: Option<tokio::fs::File>,
    hasher: Sha256,
    size: u64,
    tmp: TempFile,
    dir: PathBuf,
    min_free_bytes: u64,
    space_checked_at: u64,
}

/// Refuses an upload (its start, or going on) below the floor.
async fn check_space(name: &str, dir: &Path, floor: u64) -> Result<(), ImageError> {
    let (dir, doing) = (dir.to_path_buf(), "not importing".to_string());
    let checked =
        tokio::task::spawn_blocking(move || crate::free_space::check_floor(&dir, floor, 0, &doing))
            .await
            .unwrap_or_else(|e| Err(format!("free space: {e}")));
    checked.map_err(|reason| ImageError::NoSpace {
        name: name.to_string(),
        reason,
    })
}

impl Upload {
    pub async fn write(&mut self, chunk: &[u8]) -> Result<(), ImageError> {
        if self.size - self.space_checked_at >= FREE_SPACE_CHECK_BYTES {
            check_space(&self.name, &self.dir, self.min_free_bytes).await?;
            self.space_checked_at = self.size;
        }
        let file = self.file.as_mut().expect("not finished");
        file.write_all(chunk)
            .await
            .map_err(|e| io_err(&self.name, "write upload", self.tmp.path(), e))?;
        self.hasher.update(chunk);
        self.size += chunk.len() as u64;
        Ok(())
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The SHA-256 (hex) of what was written so far: a download is checked
    /// against its expected sum before the (slower) format probe.
    pub fn sha256_so_far(&self) -> String {
        hex::encode(self.hasher.clone().finalize())
    }
}

/// A checked upload, not yet visible. Dropped without
/// [`ImageStore::commit`], its file is removed.
#[derive(Debug)]
pub struct Staged {
    pub image: Image,
    tmp: TempFile,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &Path) -> ImageStore {
        ImageStore::open(dir, Path::new("qemu-img"), Duration::from_secs(30)).unwrap()
    }

    async fn import(
        store: &ImageStore,
        name: &str,
        kind: ImageKind,
        bytes: &[u8],
    ) -> Result<Staged, ImageError> {
        let mut up = store.begin(name).await?;
        for chunk in bytes.chunks(7) {
            up.write(chunk).await?;
        }
        store.finish(up, kind, 5).await
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    #[tokio::test]
    async fn an_initrd_is_hashed_while_it_streams_and_appears_only_when_committed() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let staged = import(&s, "init", ImageKind::Initrd, b"hello world")
            .await
            .unwrap();
        assert_eq!(
            staged.image.sha256,
            "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9"
        );
        assert_eq!(
            (staged.image.size_bytes, staged.image.format),
            (11, ImageFormat::Raw)
        );
        let image = staged.image.clone();
        assert!(s.verify(&image).await.is_err(), "not visible before commit");
        let path = s.commit(staged).unwrap();
        let file = format!("init.{}.initrd", image.sha256);
        assert_eq!(path, dir.path().canonicalize().unwrap().join(&file));
        assert_eq!(s.verify(&image).await.unwrap(), path);
        assert_eq!(leftovers(dir.path()), [file]);
    }

    #[tokio::test]
    async fn an_iso_needs_its_volume_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let mut iso = vec![0u8; 17 * 2048];
        iso[32768..32774].copy_from_slice(b"\x01CD001");
        let staged = import(&s, "installer", ImageKind::Iso, &iso).await.unwrap();
        assert_eq!(staged.image.format, ImageFormat::Raw);
        let image = staged.image.clone();
        let path = s.commit(staged).unwrap();
        assert!(path.to_string_lossy().ends_with(".iso"), "{path:?}");
        // A disk image (here: blank, as qemu-img makes raw ones) is no ISO.
        let err = import(&s, "disk", ImageKind::Iso, &vec![0u8; 17 * 2048])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::Rejected { reason, .. } if reason.contains("CD001")),
            "{err}"
        );
        let err = import(&s, "short", ImageKind::Iso, b"tiny")
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::Rejected { .. }), "{err}");
        assert_eq!(
            leftovers(dir.path()),
            [format!("installer.{}.iso", image.sha256)]
        );
    }

    #[tokio::test]
    async fn abandoned_and_rejected_uploads_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let mut up = s.begin("half").await.unwrap();
        up.write(b"partial").await.unwrap();
        assert_eq!(leftovers(dir.path()).len(), 1);
        drop(up);
        assert!(leftovers(dir.path()).is_empty());
        let err = import(&s, "k", ImageKind::Kernel, b"not a kernel")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::Rejected { reason, .. } if reason.contains("HdrS")),
            "{err}"
        );
        let staged = import(&s, "x", ImageKind::Initrd, b"x").await.unwrap();
        drop(staged);
        assert!(leftovers(dir.path()).is_empty());
        assert!(matches!(
            s.begin("../x").await.unwrap_err(),
            ImageError::Rejected { .. }
        ));
    }

    #[tokio::test]
    async fn a_changed_file_fails_verification_naming_both_sums() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let staged = import(&s, "init", ImageKind::Initrd, b"original")
            .await
            .unwrap();
        let image = staged.image.clone();
        let path = s.commit(staged).unwrap();
        s.verify(&image).await.unwrap();
        // Same size, different content: the cached match must not hide it.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"replaced").unwrap();
        let err = s.verify(&image).await.unwrap_err();
        assert!(
            matches!(&err, ImageError::ChecksumMismatch { expected, .. } if *expected == image.sha256),
            "{err}"
        );
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            s.verify(&image).await.unwrap_err(),
            ImageError::Missing { .. }
        ));
    }

    #[tokio::test]
    async fn a_name_imported_again_with_other_content_gets_another_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let first = import(&s, "init", ImageKind::Initrd, b"first")
            .await
            .unwrap();
        let first_image = first.image.clone();
        let first_path = s.commit(first).unwrap();
        s.remove(&first_image).unwrap();
        let second = import(&s, "init", ImageKind::Initrd, b"second")
            .await
            .unwrap();
        let second_image = second.image.clone();
        let second_path = s.commit(second).unwrap();
        assert_ne!(first_path, second_path, "the path names the content");
        assert!(!first_path.exists());
        assert_eq!(s.verify(&second_image).await.unwrap(), second_path);
        assert!(matches!(
            s.verify(&first_image).await.unwrap_err(),
            ImageError::Missing { .. }
        ));
    }

    #[tokio::test]
    async fn a_file_stored_under_its_name_alone_is_still_found_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let staged = import(&s, "init", ImageKind::Initrd, b"older keel")
            .await
            .unwrap();
        let image = staged.image.clone();
        drop(staged);
        let legacy = s.dir().join("init.initrd");
        std::fs::write(&legacy, b"older keel").unwrap();
        assert_eq!(s.legacy_path(&image).unwrap(), legacy);
        assert_eq!(s.verify(&image).await.unwrap(), legacy);
        s.remove(&image).unwrap();
        assert!(leftovers(dir.path()).is_empty());
    }

    #[test]
    fn disk_rules_on_qemu_img_info() {
        let ok = serde_json::json!({"format": "qcow2", "virtual-size": 1048576,
            "format-specific": {"type": "qcow2", "data": {"corrupt": false}}, "dirty-flag": false});
        assert_eq!(
            check_disk_info("d", &ok).unwrap(),
            (ImageFormat::Qcow2, 1048576)
        );
        let raw = serde_json::json!({"format": "raw", "virtual-size": 512});
        assert_eq!(check_disk_info("d", &raw).unwrap().0, ImageFormat::Raw);
        for (info, why) in [
            (
                serde_json::json!({"format": "vmdk", "virtual-size": 1}),
                "vmdk",
            ),
            (
                serde_json::json!({"format": "qcow2", "virtual-size": 1, "backing-filename": "/etc/shadow"}),
                "backing file",
            ),
            (
                serde_json::json!({"format": "qcow2", "virtual-size": 1,
                "format-specific": {"data": {"data-file": "/dev/sda"}}}),
                "data file",
            ),
            (
                serde_json::json!({"format": "qcow2", "virtual-size": 1, "encrypted": true}),
                "encrypted",
            ),
            (
                serde_json::json!({"format": "qcow2", "virtual-size": 1, "dirty-flag": true}),
                "dirty",
            ),
        ] {
            let err = check_disk_info("d", &info).unwrap_err();
            assert!(err.to_string().contains(why), "{why}: {err}");
        }
    }
}
