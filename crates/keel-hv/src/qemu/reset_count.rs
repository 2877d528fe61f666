//! The resets of one instance's guest, counted from QMP `RESET` events by
//! its monitor and kept in `resets.json` in the instance dir, so a Keel
//! restarted beside a running QEMU reports the same count (QEMU itself
//! keeps none). A reset while no Keel held the monitor is not seen: QEMU
//! sends events to the connected client only.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use keel_api::Millis;
use serde::{Deserialize, Serialize};

use super::console_log::ConsoleLog;
use super::layout::{read_json, write_json_atomic};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetRecord {
    pub count: u32,
    /// The console log's end at the last reset (a position, see
    /// `console_log`): the guest's current boot printed what follows
    /// (readiness by console looks only there).
    pub console_offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reason: Option<String>,
    #[serde(default)]
    pub at: Millis,
}

/// `RESET` reasons that are a reset of the running guest. A snapshot
/// load resets the machine to put the saved state in, which is no boot.
pub fn counts_as_reset(reason: &str) -> bool {
    reason != "snapshot-load"
}

/// RESET events this close after a counted one are the same reset.
pub const SAME_RESET_WITHIN_MS: Millis = 1_000;

#[derive(Debug)]
pub struct ResetCounter {
    file: PathBuf,
    console: Arc<ConsoleLog>,
    record: Mutex<ResetRecord>,
}

impl ResetCounter {
    /// The count kept in `file` (none yet: zero). An unreadable file is
    /// logged and counts from zero: the count informs, it decides nothing
    /// about whether the guest runs.
    pub fn load(file: PathBuf, console: Arc<ConsoleLog>) -> Self {
        let record = read_json::<ResetRecord>(&file).unwrap_or_else(|e| {
            tracing::warn!(file = %file.display(), "cannot read the reset count: {e}");
            None
        });
        Self {
            file,
            console,
            record: Mutex::new(record.unwrap_or_default()),
        }
    }

    pub fn current(&self) -> ResetRecord {
        self.record.lock().expect("reset record").clone()
    }

    /// One more reset, for `reason`, at `at`; `None` for one that belongs
    /// to the reset just counted. A Linux reboot may try its reset methods
    /// one after the other (ACPI, then port 0xCF9, ...) before the first
    /// takes effect, and QEMU reports each: one reboot, two RESET events
    /// (the test guest's `reboot -f` under TCG). No guest boots that fast.
    pub fn note(&self, reason: &str, at: Millis) -> Option<ResetRecord> {
        let console_offset = self.console.end();
        let mut record = self.record.lock().expect("reset record");
        if record.count > 0 && at < record.at.saturating_add(SAME_RESET_WITHIN_MS) {
            return None;
        }
        record.count = record.count.saturating_add(1);
        record.console_offset = console_offset;
        record.last_reason = Some(reason.to_string());
        record.at = at;
        if let Err(e) = write_json_atomic(&self.file, &*record) {
            // Still counted in memory; only a Keel restart would lose it.
            tracing::warn!(file = %self.file.display(), "cannot persist the reset count: {e}");
        }
        Some(record.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_survives_a_new_counter_and_marks_the_console() {
        let dir = tempfile::tempdir().unwrap();
        let (file, console) = (
            dir.path().join("resets.json"),
            dir.path().join("console.log"),
        );
        std::fs::write(&console, b"first boot\n").unwrap();
        let console = Arc::new(ConsoleLog::open(console));
        let counter = ResetCounter::load(file.clone(), console.clone());
        assert_eq!(counter.current().count, 0);
        let rec = counter.note("guest-reset", 7).unwrap();
        assert_eq!((rec.count, rec.console_offset), (1, 11));
        // The same reboot reported twice is one reset.
        assert_eq!(
            counter.note("guest-reset", 7 + SAME_RESET_WITHIN_MS - 1),
            None
        );
        let again = ResetCounter::load(file, console);
        assert_eq!(again.current(), rec);
        assert!(!counts_as_reset("snapshot-load"));
        assert!(counts_as_reset("guest-reset") && counts_as_reset("host-qmp-system-reset"));
    }
}
