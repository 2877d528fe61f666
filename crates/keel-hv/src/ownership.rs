//! Keel's private files and directories must be its own.
//!
//! Why: modes alone do not make a file private. A data directory created
//! beforehand by another user stayed theirs after Keel's chmod, and that
//! user replaced the token with one of their choosing; the same holds for
//! the token file, the migration CA and a node's TLS directory. So each is
//! refused unless it belongs to the user Keel runs as, or to root (an
//! administrator's files, e.g. `/etc/keel/token` of the package).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    #[error(
        "{what} {} is owned by {owner}, not by this user ({me}) or root: \
         another user could replace what Keel keeps there; chown it to {me} or choose another",
        path.display()
    )]
    Foreign {
        what: &'static str,
        path: PathBuf,
        owner: String,
        me: String,
    },
    #[error("{what} {}", path.display())]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Refuses `path` (followed through symlinks) unless this process's
/// effective user or root owns it. `what` names it in the error.
pub fn ensure_owned(what: &'static str, path: &Path) -> Result<(), OwnershipError> {
    let meta = std::fs::metadata(path).map_err(|source| OwnershipError::Unreadable {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() == me || meta.uid() == 0 {
        return Ok(());
    }
    Err(OwnershipError::Foreign {
        what,
        path: path.to_path_buf(),
        owner: describe_user(meta.uid()),
        me: describe_user(me),
    })
}

/// `uid 65534 (nobody)`, or `uid 4242` for a uid without a name.
pub fn describe_user(uid: u32) -> String {
    match user_name(uid) {
        Some(name) => format!("uid {uid} ({name})"),
        None => format!("uid {uid}"),
    }
}

fn user_name(uid: u32) -> Option<String> {
    // SAFETY: passwd is plain data (integers and pointers); all-zero is a
    // valid value that getpwuid_r overwrites.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 4096];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes into `pwd` and `buf`, both ours and sized
    // as passed; `result` points at `pwd` on success.
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    // SAFETY: on success pw_name is a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    name.to_str().ok().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_files_pass_and_foreign_ones_are_refused_naming_the_owner() {
        let dir = tempfile::tempdir().unwrap();
        ensure_owned("data directory", dir.path()).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return; // only root can give a file away
        }
        let foreign = dir.path().join("theirs");
        std::fs::create_dir(&foreign).unwrap();
        std::os::unix::fs::chown(&foreign, Some(65534), None).unwrap();
        let err = ensure_owned("data directory", &foreign).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("data directory"), "{text}");
        assert!(text.contains("uid 65534"), "{text}");
        assert!(text.contains("not by this user (uid 0"), "{text}");
    }

    #[test]
    fn a_missing_path_is_an_error_naming_it() {
        let err = ensure_owned("token file", Path::new("/nonexistent/keel-token")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/keel-token"), "{err}");
    }
}
