//! The bound on each instance's console log.
//!
//! Why: QEMU appends everything the guest prints on ttyS0 to `console.log`,
//! without limit, next to the store and (by default) the disks: a guest's
//! `cat /dev/zero > /dev/ttyS0` wrote 9 MB in 20 s under TCG and would
//! fill the host's disk.
//!
//! How (logrotate's copytruncate): QEMU holds the log open for appending,
//! so it cannot be renamed away. Once it is over the cap, its last `cap`
//! bytes are copied to `console.log.1` (written aside and renamed, so a
//! reader sees the old or the new one whole) and the log is truncated;
//! QEMU's next write lands at its new end. An instance's logs then take at
//! most twice the cap plus what the guest prints between two looks. The
//! bytes printed between the copy and the truncation are lost, which is
//! the price of not owning QEMU's descriptor. Readers read `console.log.1`
//! and then `console.log`.

use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Weak;
use std::time::Duration;

/// The log's previous part.
pub fn rotated(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Rotates `log` if it is over `cap` bytes; whether it did.
pub fn rotate_if_over(log: &Path, cap: u64) -> io::Result<bool> {
    let mut file = match std::fs::File::open(log) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    if len <= cap {
        return Ok(false);
    }
    file.seek(SeekFrom::Start(len - cap))?;
    let mut kept = Vec::with_capacity(cap as usize);
    file.take(cap).read_to_end(&mut kept)?;
    let old = rotated(log);
    let mut tmp = old.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let mut aside = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)?;
    aside.write_all(&kept)?;
    std::fs::rename(&tmp, &old)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(log)?
        .set_len(0)?;
    Ok(true)
}

/// The last `max` bytes of the previous part and the log together, and
/// their total length.
pub fn tail(log: &Path, max: u64) -> io::Result<(Vec<u8>, u64)> {
    let current = read_tail(log, max)?;
    let mut total = current.1;
    let mut bytes = current.0;
    if (bytes.len() as u64) < max {
        let (older, older_len) = read_tail(&rotated(log), max - bytes.len() as u64)?;
        total += older_len;
        let mut joined = older;
        joined.extend_from_slice(&bytes);
        bytes = joined;
    }
    Ok((bytes, total))
}

/// The last `max` bytes of one file and its length; nothing if missing.
fn read_tail(path: &Path, max: u64) -> io::Result<(Vec<u8>, u64)> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        // Nothing printed yet (QEMU creates it on first output).
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((vec![], 0)),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    let start = len.saturating_sub(max);
    file.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::new();
    // Up to the length reported, though the guest may print on.
    file.take(len - start).read_to_end(&mut buf)?;
    Ok((buf, len))
}

/// Looks at every known instance's log every `every` and rotates those
/// over the cap, for as long as the driver lives.
pub(super) fn keep_bounded(driver: Weak<super::Inner>, every: Duration) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let Some(inner) = driver.upgrade() else {
                return;
            };
            let cap = inner.config.console_log_max_bytes;
            let logs: Vec<PathBuf> = inner
                .domains
                .lock()
                .expect("domains")
                .values()
                .map(|d| d.paths.console.clone())
                .collect();
            drop(inner);
            let rotated = tokio::task::spawn_blocking(move || {
                for log in logs {
                    match rotate_if_over(&log, cap) {
                        Ok(true) => {
                            tracing::info!(log = %log.display(), cap, "console log over its cap: rotated")
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(log = %log.display(), error = %e, "console log not rotated")
                        }
                    }
                }
            });
            let _ = rotated.await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_over_its_cap_keeps_its_end_aside_and_starts_again_under_an_appending_writer() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        // QEMU's side: one descriptor opened for appending, kept.
        let mut qemu = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        qemu.write_all(&b"x".repeat(900)).unwrap();
        qemu.write_all(b"END-OF-PART-ONE\n").unwrap();
        assert!(!rotate_if_over(&log, 1000).unwrap(), "under the cap");
        qemu.write_all(&b"y".repeat(200)).unwrap();
        assert!(rotate_if_over(&log, 1000).unwrap());
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        let old = std::fs::read(rotated(&log)).unwrap();
        assert_eq!(old.len(), 1000, "the last cap bytes are kept");
        assert!(old.ends_with(&b"y".repeat(200)));
        qemu.write_all(b"after\n").unwrap();
        assert_eq!(
            std::fs::read(&log).unwrap(),
            b"after\n",
            "the writer appends at the new end, not at its old offset"
        );
        let (tail_bytes, total) = tail(&log, 300).unwrap();
        assert_eq!(total, 1006);
        assert_eq!(tail_bytes.len(), 300);
        let mut expected = old[old.len() - 294..].to_vec();
        expected.extend_from_slice(b"after\n");
        assert_eq!(tail_bytes, expected, "the previous part, then the log");
    }

    #[test]
    fn no_log_is_nothing_to_rotate_or_read() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        assert!(!rotate_if_over(&log, 10).unwrap());
        assert_eq!(tail(&log, 10).unwrap(), (vec![], 0));
    }
}
