//! The progress of long work under `--wait` (`keel vm migrate`, `keel node
//! drain`) as one line on stderr that is rewritten in place: phase, bytes
//! sent of the total, rate and ETA. Only when both stdout and stderr are a
//! terminal: a person is watching. In a script nothing is added, and the
//! lines `--wait` always printed stay as they were.
//!
//! The figures are the migration records' (`status.progress_*`), which the
//! source node's controller writes every few seconds; the rate is measured
//! between two such records, on the source's clock, so a slow poll here
//! never skews it.

use std::io::{IsTerminal, Write};

use keel_api::{Migration, MigrationPhase, Millis};

/// The one rewritten line, or nothing when no one is watching.
pub struct LiveLine {
    on_terminal: bool,
    shown: bool,
}

impl LiveLine {
    pub fn new() -> LiveLine {
        LiveLine {
            on_terminal: std::io::stdout().is_terminal() && std::io::stderr().is_terminal(),
            shown: false,
        }
    }

    /// Whether a line would be shown at all (so that what only feeds it
    /// need not be fetched in a script).
    pub fn is_on(&self) -> bool {
        self.on_terminal
    }

    /// Replaces the line with `text` (kept to one terminal line: a wrapped
    /// line could not be rewritten).
    pub fn show(&mut self, text: &str) {
        if !self.on_terminal {
            return;
        }
        let safe = keel_api::untrusted::terminal_safe(text);
        let fitted: String = safe.chars().take(terminal_columns() - 1).collect();
        eprint!("\r\x1b[K{fitted}");
        let _ = std::io::stderr().flush();
        self.shown = true;
    }

    /// Clears the line, before a line of its own is printed on stderr or
    /// when the wait ends.
    pub fn clear(&mut self) {
        if self.shown {
            eprint!("\r\x1b[K");
            let _ = std::io::stderr().flush();
            self.shown = false;
        }
    }
}

impl Drop for LiveLine {
    fn drop(&mut self) {
        self.clear();
    }
}

/// `COLUMNS` when the shell exports it, else the classic 80.
fn terminal_columns() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse::<usize>().ok())
        .filter(|&c| c >= 20)
        .unwrap_or(80)
}

/// One migration's sending rate, from the successive progress records it
/// is shown (bytes per second on the source's clock).
#[derive(Debug, Default)]
pub struct SendRate {
    last: Option<(Millis, u64)>,
    bytes_per_sec: Option<f64>,
}

impl SendRate {
    /// Takes in the record's progress (a record seen again changes nothing)
    /// and says the rate between the last two records.
    pub fn observe(&mut self, m: &Migration) -> Option<f64> {
        if let (Some(at), Some(sent)) = (m.status.progress_at, m.status.progress_bytes) {
            match self.last {
                Some((last_at, last_sent)) if at > last_at => {
                    let secs = (at - last_at) as f64 / 1000.0;
                    self.bytes_per_sec = Some(sent.saturating_sub(last_sent) as f64 / secs);
                    self.last = Some((at, sent));
                }
                Some(_) => {}
                None => self.last = Some((at, sent)),
            }
        }
        self.bytes_per_sec
    }
}

/// Sent, total, rate and ETA of a migration sending its memory; `None`
/// before its first progress record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sending {
    pub sent: u64,
    pub total: u64,
    pub remaining: u64,
    pub bytes_per_sec: Option<f64>,
}

impl Sending {
    pub fn of(m: &Migration, bytes_per_sec: Option<f64>) -> Option<Sending> {
        let s = &m.status;
        Some(Sending {
            sent: s.progress_bytes?,
            total: s.progress_total_bytes?,
            remaining: s.progress_remaining_bytes?,
            bytes_per_sec,
        })
    }

    /// Several migrations at once (a drain): their sums.
    pub fn sum(all: impl IntoIterator<Item = Sending>) -> Option<Sending> {
        all.into_iter().reduce(|a, b| Sending {
            sent: a.sent + b.sent,
            total: a.total + b.total,
            remaining: a.remaining + b.remaining,
            bytes_per_sec: match (a.bytes_per_sec, b.bytes_per_sec) {
                (Some(x), Some(y)) => Some(x + y),
                (x, y) => x.or(y),
            },
        })
    }

    /// `312.0 MiB of 1.0 GiB sent, 96.0 MiB to go, 24.0 MiB/s, ETA 4s`.
    pub fn describe(&self) -> String {
        let mut line = format!(
            "{} of {} sent, {} to go",
            bytes(self.sent),
            bytes(self.total),
            bytes(self.remaining)
        );
        if let Some(rate) = self.bytes_per_sec {
            line.push_str(&format!(", {}/s", bytes(rate as u64)));
            if let Some(eta) = eta_secs(self.remaining, rate) {
                line.push_str(&format!(", ETA {}", duration(eta)));
            }
        }
        line
    }
}

/// The line for one migration: `web: migration web-m1 a → b Running, …`.
pub fn migration_line(m: &Migration, bytes_per_sec: Option<f64>) -> String {
    let head = format!(
        "{}: migration {} {} → {}",
        m.vm, m.id, m.source_node, m.target_node
    );
    let what = match m.status.phase {
        MigrationPhase::Pending => "starting the target".to_string(),
        MigrationPhase::TargetReady => "target listening, starting to send".to_string(),
        MigrationPhase::Running => match Sending::of(m, bytes_per_sec) {
            Some(sending) => format!("sending: {}", sending.describe()),
            None => "sending".to_string(),
        },
        MigrationPhase::Succeeded => "succeeded".to_string(),
        MigrationPhase::Failed => "failed".to_string(),
    };
    format!("{head} {what}")
}

/// Seconds left at `bytes_per_sec`; none when nothing is moving.
pub fn eta_secs(remaining: u64, bytes_per_sec: f64) -> Option<u64> {
    (bytes_per_sec >= 1.0).then(|| (remaining as f64 / bytes_per_sec).ceil() as u64)
}

/// Binary units with one decimal: `512 B`, `1.5 KiB`, `312.0 MiB`, `2.0 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `45s`, `3m05s`, `1h02m`.
pub fn duration(secs: u64) -> String {
    match secs {
        0..=59 => format!("{secs}s"),
        60..=3599 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{MigrationStatus, MigrationTuning};

    fn migration(phase: MigrationPhase, progress: Option<(Millis, u64)>) -> Migration {
        Migration {
            id: "web-m1".into(),
            vm: "web".into(),
            vm_uid: "u".into(),
            source_node: "a".into(),
            source_instance: "web-1".into(),
            target_node: "b".into(),
            target_instance: "web-2".into(),
            created_at: 0,
            tuning: MigrationTuning::default(),
            status: MigrationStatus {
                phase,
                progress_at: progress.map(|p| p.0),
                progress_bytes: progress.map(|p| p.1),
                progress_total_bytes: progress.map(|_| 1 << 30),
                progress_remaining_bytes: progress.map(|p| (1u64 << 30) - p.1),
                ..Default::default()
            },
        }
    }

    #[test]
    fn bytes_and_durations_read_well() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(312 << 20), "312.0 MiB");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
        assert_eq!(duration(0), "0s");
        assert_eq!(duration(59), "59s");
        assert_eq!(duration(185), "3m05s");
        assert_eq!(duration(3720), "1h02m");
        // Rounded up: an ETA never says 0s while bytes remain.
        assert_eq!(eta_secs(100, 1000.0), Some(1));
        assert_eq!(eta_secs(96 << 20, f64::from(24 << 20)), Some(4));
        assert_eq!(eta_secs(1 << 20, 0.0), None);
    }

    #[test]
    fn the_line_says_phase_bytes_rate_and_eta() {
        let mut rate = SendRate::default();
        let first = migration(MigrationPhase::Running, Some((10_000, 256 << 20)));
        // One record: no rate yet, so no ETA.
        assert_eq!(
            migration_line(&first, rate.observe(&first)),
            "web: migration web-m1 a → b sending: 256.0 MiB of 1.0 GiB sent, 768.0 MiB to go"
        );
        // The same record seen again changes nothing.
        assert_eq!(rate.observe(&first), None);
        // 128 MiB more in 2 s of the source's clock: 64 MiB/s, 640 MiB
        // left, 10 s.
        let second = migration(MigrationPhase::Running, Some((12_000, 384 << 20)));
        assert_eq!(
            migration_line(&second, rate.observe(&second)),
            "web: migration web-m1 a → b sending: 384.0 MiB of 1.0 GiB sent, \
             640.0 MiB to go, 64.0 MiB/s, ETA 10s"
        );
        assert_eq!(
            migration_line(&migration(MigrationPhase::Running, None), None),
            "web: migration web-m1 a → b sending"
        );
        assert_eq!(
            migration_line(&migration(MigrationPhase::Pending, None), None),
            "web: migration web-m1 a → b starting the target"
        );
    }

    #[test]
    fn a_drain_sums_its_migrations() {
        let one = Sending {
            sent: 100 << 20,
            total: 256 << 20,
            remaining: 156 << 20,
            bytes_per_sec: Some(f64::from(10 << 20)),
        };
        let two = Sending {
            sent: 28 << 20,
            total: 256 << 20,
            remaining: 228 << 20,
            bytes_per_sec: None,
        };
        let both = Sending::sum([one, two]).unwrap();
        assert_eq!(
            both.describe(),
            "128.0 MiB of 512.0 MiB sent, 384.0 MiB to go, 10.0 MiB/s, ETA 39s"
        );
        assert_eq!(Sending::sum([]), None);
    }
}
