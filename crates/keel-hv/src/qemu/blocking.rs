//! Filesystem work off the async threads. Driver calls run on the tokio
//! workers every VM's reconcile shares; a `std::fs` call there (a disk
//! dir on a slow or hung network filesystem, an fsync under load, removing
//! a big disk image) would stall every other VM's look on that worker, not
//! only the call that made it. So blocking work goes to tokio's blocking
//! pool, and only the calling operation waits for it.

use std::io;
use std::path::PathBuf;

use serde::Serialize;

use super::layout;

/// Runs `work` on the blocking pool. A panic in it is resumed here, as if
/// it had run inline; the pool refusing it (runtime shutting down) is an
/// error naming `what`.
pub(super) async fn unblocked<T: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(io::Error::other(format!("{what}: blocking task: {e}"))),
    }
}

/// [`layout::write_json_atomic`] (write, fsync, rename, fsync the dir) on
/// the blocking pool.
pub(super) async fn write_json(path: &std::path::Path, value: &impl Serialize) -> io::Result<()> {
    let bytes = layout::json_bytes(value)?;
    let path = path.to_path_buf();
    unblocked("write record", move || {
        layout::write_bytes_atomic(&path, &bytes)
    })
    .await
}

/// Removes a file; absent is fine.
pub(super) async fn remove_file(path: PathBuf) -> io::Result<()> {
    match tokio::fs::remove_file(&path).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Removes a directory tree; absent is fine.
pub(super) async fn remove_dir_all(path: PathBuf) -> io::Result<()> {
    match tokio::fs::remove_dir_all(&path).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
