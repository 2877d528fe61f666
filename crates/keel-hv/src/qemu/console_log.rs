//! The bound on each instance's console log, and positions in it that
//! survive the bound.
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
//!
//! A position is counted in bytes the guest printed since the instance
//! began, not in bytes of the current file: each rotation adds the length
//! it cut to `console.log.cut`. So a scan that had read part of the log
//! before a rotation goes on in `console.log.1` where it stopped (a marker
//! printed just before a rotation is found: the flooding-guest test missed
//! one before), and a reset's console position still names the same byte
//! after rotations. Rotation, scans and position reads of one log take one
//! lock, so none sees the copy done and the truncation not.

use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::layout::{json_bytes, read_json};
use crate::guest_info::LogScan;

/// One instance's console log, with what rotations cut from its front.
#[derive(Debug)]
pub struct ConsoleLog {
    path: PathBuf,
    /// Bytes cut by rotations so far: the current file's first byte is at
    /// this position. Kept in `console.log.cut`.
    cut: Mutex<u64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct CutRecord {
    bytes: u64,
}

/// Where the bytes cut by rotations are counted.
fn cut_file(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".cut");
    PathBuf::from(name)
}

impl ConsoleLog {
    /// The log at `path`, with the cut its rotations recorded (none yet:
    /// zero). An unreadable record is logged and counts from zero: a
    /// position informs readiness by console and the reset's boot, never
    /// whether the guest runs.
    pub fn open(path: PathBuf) -> Self {
        let cut = read_json::<CutRecord>(&cut_file(&path)).unwrap_or_else(|e| {
            tracing::warn!(log = %path.display(), "cannot read the console log's cut: {e}");
            None
        });
        Self {
            cut: Mutex::new(cut.unwrap_or_default().bytes),
            path,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The position of the log's end: everything the guest printed so far.
    pub fn end(&self) -> u64 {
        let cut = self.cut.lock().expect("console log cut");
        *cut + file_len(&self.path).unwrap_or(0)
    }

    /// Rotates the log if it is over `cap` bytes; whether it did.
    pub fn rotate_if_over(&self, cap: u64) -> io::Result<bool> {
        let mut cut = self.cut.lock().expect("console log cut");
        let Some(len) = rotate_if_over(&self.path, cap, |len| {
            // Counted before the truncation: a crash between the two moves
            // later positions forward (a scan skips, never reads twice).
            // Renamed into place but not fsynced: the guest's output after
            // the length was taken is lost until the truncation, so this
            // stays short, and a power failure costs only positions.
            let file = cut_file(&self.path);
            let mut tmp = file.clone().into_os_string();
            tmp.push(".tmp");
            std::fs::write(&tmp, json_bytes(&CutRecord { bytes: *cut + len })?)?;
            std::fs::rename(&tmp, &file)
        })?
        else {
            return Ok(false);
        };
        *cut += len;
        Ok(true)
    }

    /// The bytes from position `from` on (at most `max`), from the previous
    /// part and then the log, and the position they begin at: later than
    /// `from` when rotations dropped what followed it, earlier when `from`
    /// is past the end (positions lost in a crash).
    pub fn read_from(&self, from: u64, max: u64) -> io::Result<(u64, Vec<u8>)> {
        let cut = *self.cut.lock().expect("console log cut");
        let current_len = file_len(&self.path)?;
        let from = from.min(cut + current_len);
        let mut bytes = Vec::new();
        let mut start = from;
        if from < cut {
            let older = rotated(&self.path);
            let older_len = file_len(&older)?;
            let older_start = cut.saturating_sub(older_len);
            start = from.max(older_start);
            read_range(&older, start - older_start, older_len, max, &mut bytes)?;
        }
        let room = max.saturating_sub(bytes.len() as u64);
        if room > 0 {
            // The previous part read to its end (else no room is left): the
            // log follows without a gap.
            let at = from.saturating_sub(cut);
            read_range(&self.path, at, current_len, room, &mut bytes)?;
        }
        Ok((start, bytes))
    }

    /// Feeds `scan` what followed its position (up to `max` bytes).
    pub fn scan(&self, mut scan: LogScan, needle: &[u8], max: u64) -> io::Result<LogScan> {
        let (start, chunk) = self.read_from(scan.offset, max)?;
        if start != scan.offset {
            scan.jump_to(start);
        }
        scan.feed(needle, &chunk);
        Ok(scan)
    }

    /// The last `max` bytes of the previous part and the log together, and
    /// their total length.
    pub fn tail(&self, max: u64) -> io::Result<(Vec<u8>, u64)> {
        let _alone = self.cut.lock().expect("console log cut");
        tail(&self.path, max)
    }
}

/// A file's length; a missing file is empty (QEMU creates the log on the
/// guest's first output).
fn file_len(path: &Path) -> io::Result<u64> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

/// Appends `path`'s bytes from `at` up to `len` (the length seen; the guest
/// may print on), at most `max` of them.
fn read_range(path: &Path, at: u64, len: u64, max: u64, into: &mut Vec<u8>) -> io::Result<()> {
    if at >= len {
        return Ok(());
    }
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e)?,
    };
    file.seek(SeekFrom::Start(at))?;
    file.take((len - at).min(max)).read_to_end(into)?;
    Ok(())
}

/// The log's previous part.
pub fn rotated(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Rotates `log` if it is over `cap` bytes: the length it cut, if it did.
/// `before_truncation` runs once the previous part is in place.
fn rotate_if_over(
    log: &Path,
    cap: u64,
    before_truncation: impl FnOnce(u64) -> io::Result<()>,
) -> io::Result<Option<u64>> {
    let mut file = match std::fs::File::open(log) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    if len <= cap {
        return Ok(None);
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
    before_truncation(len)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(log)?
        .set_len(0)?;
    Ok(Some(len))
}

fn tail(log: &Path, max: u64) -> io::Result<(Vec<u8>, u64)> {
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
            let logs: Vec<_> = inner
                .domains
                .lock()
                .expect("domains")
                .values()
                .map(|d| d.console_log.clone())
                .collect();
            drop(inner);
            let rotated = tokio::task::spawn_blocking(move || {
                for log in logs {
                    match log.rotate_if_over(cap) {
                        Ok(true) => {
                            tracing::info!(log = %log.path().display(), cap, "console log over its cap: rotated")
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(log = %log.path().display(), error = %e, "console log not rotated")
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

    /// QEMU's side: one descriptor opened for appending, kept.
    fn appender(log: &Path) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap()
    }

    #[test]
    fn a_log_over_its_cap_keeps_its_end_aside_and_starts_again_under_an_appending_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let log = ConsoleLog::open(path.clone());
        let mut qemu = appender(&path);
        qemu.write_all(&b"x".repeat(900)).unwrap();
        qemu.write_all(b"END-OF-PART-ONE\n").unwrap();
        assert!(!log.rotate_if_over(1000).unwrap(), "under the cap");
        qemu.write_all(&b"y".repeat(200)).unwrap();
        assert!(log.rotate_if_over(1000).unwrap());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        let old = std::fs::read(rotated(&path)).unwrap();
        assert_eq!(old.len(), 1000, "the last cap bytes are kept");
        assert!(old.ends_with(&b"y".repeat(200)));
        qemu.write_all(b"after\n").unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"after\n",
            "the writer appends at the new end, not at its old offset"
        );
        let (tail_bytes, total) = log.tail(300).unwrap();
        assert_eq!(total, 1006);
        assert_eq!(tail_bytes.len(), 300);
        let mut expected = old[old.len() - 294..].to_vec();
        expected.extend_from_slice(b"after\n");
        assert_eq!(tail_bytes, expected, "the previous part, then the log");
        assert_eq!(log.end(), 1116 + 6, "a position counts what was cut");
        assert_eq!(
            ConsoleLog::open(path).end(),
            1122,
            "the cut is kept for the next Keel"
        );
    }

    #[test]
    fn a_scan_goes_on_in_the_previous_part_after_a_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let log = ConsoleLog::open(path.clone());
        let mut qemu = appender(&path);
        qemu.write_all(&b"f".repeat(800)).unwrap();
        let scan = log.scan(LogScan::default(), b"AFTER-42", 1 << 20).unwrap();
        assert!(!scan.found);
        assert_eq!(scan.offset, 800);
        // The marker is printed, then the log is rotated before the next
        // look: it is in the previous part only.
        qemu.write_all(b"..AFTER-4").unwrap();
        qemu.write_all(b"2\n$ ").unwrap();
        qemu.write_all(&b"f".repeat(300)).unwrap();
        assert!(log.rotate_if_over(1000).unwrap());
        qemu.write_all(b"prompt$ ").unwrap();
        let scan = log.scan(scan, b"AFTER-42", 1 << 20).unwrap();
        assert!(scan.found, "the marker before the rotation is found");
        assert_eq!(scan.offset, 1113 + 8);

        // Bounded reads continue across the two parts without a gap.
        let mut scan = LogScan::default();
        let mut reads = 0;
        while !scan.found && reads < 1000 {
            scan = log.scan(scan, b"fffprompt", 7).unwrap();
            reads += 1;
        }
        assert!(scan.found, "a match across the previous part and the log");
        // Reads of 7 from the first byte still kept (113); the match ends
        // at 1119.
        assert_eq!(scan.offset, 113 + 7 * 144);
    }

    #[test]
    fn what_rotations_dropped_is_skipped_and_never_matched_across() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let log = ConsoleLog::open(path.clone());
        let mut qemu = appender(&path);
        qemu.write_all(b"AFT").unwrap();
        let scan = log.scan(LogScan::default(), b"AFTER", 1 << 20).unwrap();
        qemu.write_all(&b"z".repeat(200)).unwrap();
        assert!(log.rotate_if_over(100).unwrap());
        qemu.write_all(b"ER and on").unwrap();
        let scan = log.scan(scan, b"AFTER", 1 << 20).unwrap();
        assert!(!scan.found, "'AFT' and 'ER' were never next to each other");
        assert_eq!(scan.offset, 203 + 9);
        // A position past the end (a cut lost in a crash) reads from the end.
        let past = log
            .scan(LogScan::after_reset(1, 10_000), b"MARK", 1 << 20)
            .unwrap();
        assert_eq!(past.offset, 203 + 9);
        qemu.write_all(b" MARK").unwrap();
        let scan = log.scan(past, b"MARK", 1 << 20).unwrap();
        assert!(scan.found, "what follows the end is read");
    }

    #[test]
    fn no_log_is_nothing_to_rotate_or_read() {
        let dir = tempfile::tempdir().unwrap();
        let log = ConsoleLog::open(dir.path().join("console.log"));
        assert!(!log.rotate_if_over(10).unwrap());
        assert_eq!(log.tail(10).unwrap(), (vec![], 0));
        assert_eq!(log.end(), 0);
        assert_eq!(log.read_from(0, 10).unwrap(), (0, vec![]));
    }
}
