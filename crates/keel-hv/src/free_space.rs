//! The free-space floor of the filesystems Keel writes guests' data to
//! (the disk dir, the image store): below it no disk is created and no
//! image imported, so guests and uploads cannot fill the filesystem that
//! also holds the store, the instances' records and the console logs.
//! A guest writing into a disk it already has is not stopped by this.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub const DEFAULT_MIN_FREE_DISK_MIB: u64 = 1024;

/// Bytes available to an unprivileged writer on the filesystem of `path`.
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs is plain data, valid when zeroed.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a statvfs that outlives the call.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// `Ok` when the filesystem of `dir` has more than `floor_bytes` free
/// (and `needed_bytes` more, for a write of known size); else why not, for
/// the VM's message or the API's answer. `doing` says what was refused.
pub fn check_floor(
    dir: &Path,
    floor_bytes: u64,
    needed_bytes: u64,
    doing: &str,
) -> Result<(), String> {
    if floor_bytes == 0 {
        return Ok(());
    }
    let free =
        free_bytes(dir).map_err(|e| format!("{doing}: free space of {}: {e}", dir.display()))?;
    if free >= floor_bytes.saturating_add(needed_bytes) {
        return Ok(());
    }
    Err(format!(
        "{doing}: only {} MiB free on the filesystem of {}, {}below the floor of {} MiB \
         (--min-free-disk-mib); free some space or lower the floor",
        free >> 20,
        dir.display(),
        if needed_bytes > 0 {
            format!("which less the {} MiB needed is ", needed_bytes >> 20)
        } else {
            String::new()
        },
        floor_bytes >> 20,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_above_the_free_space_refuses_naming_it() {
        let dir = std::env::temp_dir();
        let free = free_bytes(&dir).unwrap();
        assert!(check_floor(&dir, 1 << 20, 0, "x").is_ok());
        let err = check_floor(&dir, free + (1 << 30), 0, "creating disk d").unwrap_err();
        assert!(
            err.starts_with("creating disk d: only") && err.contains("--min-free-disk-mib"),
            "{err}"
        );
        assert!(
            check_floor(&dir, 0, u64::MAX, "off").is_ok(),
            "0 turns the floor off"
        );
    }
}
