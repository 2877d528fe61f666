//! The progress of an upload (`keel image import FILE`, `keel vm import
//! FILE`) as one line on stderr rewritten in place: bytes sent of the
//! file's size, rate and ETA. Only when a person is watching (stdout and
//! stderr a terminal, as for `--wait`'s line); in a script nothing is
//! added. The server takes the whole body before it answers, so what has
//! left this process is what the line counts.

use std::io::Read;
use std::time::{Duration, Instant};

use super::live_progress::{bytes, duration, eta_secs, LiveLine};

/// How often the line is rewritten at most.
const EVERY: Duration = Duration::from_millis(500);

/// A reader of the uploaded file that shows how much of it has been read
/// (sent) so far.
pub struct UploadProgress<R> {
    inner: R,
    what: String,
    total: u64,
    sent: u64,
    started: Instant,
    shown_at: Option<Instant>,
    line: LiveLine,
}

impl<R: Read> UploadProgress<R> {
    pub fn new(inner: R, what: &str, total: u64) -> Self {
        Self {
            inner,
            what: what.to_string(),
            total,
            sent: 0,
            started: Instant::now(),
            shown_at: None,
            line: LiveLine::new(),
        }
    }
}

impl<R: Read> Read for UploadProgress<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.sent += n as u64;
        if self.line.is_on() {
            let due = self.shown_at.is_none_or(|at| at.elapsed() >= EVERY);
            if n == 0 {
                self.line.clear();
            } else if due {
                let secs = self.started.elapsed().as_secs_f64();
                let rate = (secs > 0.0).then(|| self.sent as f64 / secs);
                self.line
                    .show(&upload_line(&self.what, self.sent, self.total, rate));
                self.shown_at = Some(Instant::now());
            }
        }
        Ok(n)
    }
}

/// `uploading debian.qcow2: 312.0 MiB of 2.0 GiB (15%), 48.0 MiB/s, ETA 36s`.
pub fn upload_line(what: &str, sent: u64, total: u64, bytes_per_sec: Option<f64>) -> String {
    let mut line = format!("uploading {what}: {} of {}", bytes(sent), bytes(total));
    if let Some(percent) = (sent.min(total) * 100).checked_div(total) {
        line.push_str(&format!(" ({percent}%)"));
    }
    if let Some(rate) = bytes_per_sec {
        line.push_str(&format!(", {}/s", bytes(rate as u64)));
        if let Some(eta) = eta_secs(total.saturating_sub(sent), rate) {
            line.push_str(&format!(", ETA {}", duration(eta)));
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_gives_bytes_share_rate_and_eta() {
        assert_eq!(
            upload_line("d.qcow2", 312 << 20, 2 << 30, Some(f64::from(48 << 20))),
            "uploading d.qcow2: 312.0 MiB of 2.0 GiB (15%), 48.0 MiB/s, ETA 37s"
        );
        assert_eq!(
            upload_line("d.iso", 0, 0, None),
            "uploading d.iso: 0 B of 0 B"
        );
    }

    /// In a script (no terminal here) the reader only passes the file
    /// through, whole.
    #[test]
    fn the_file_passes_through_unchanged() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut reader = UploadProgress::new(&data[..], "x", data.len() as u64);
        let mut out = Vec::new();
        reader.read_to_end(&mut out).unwrap();
        assert_eq!(out, data);
    }
}
