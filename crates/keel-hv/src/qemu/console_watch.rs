//! Readiness by console without a poll: an instance whose readiness is a
//! console text is known ready the moment its guest prints it, not at the
//! next readiness probe (once a second, which cost a start half a second
//! on average).
//!
//! QEMU writes the console log itself (a file chardev), so Keel learns of
//! new output from inotify(7) on the log's directory: each change to
//! `console.log` (or to its previous part, which a rotation writes) wakes
//! a scan of what was added since the last one. The bare QEMU of
//! `keel bench start` is watched the same way ([`ConsoleChanges`] and the
//! same incremental scan, see `bare::console_shows`), so the two sides of
//! that comparison detect readiness alike.
//!
//! A wake is a hint and the scan decides; a wake lost all the same costs at
//! most [`RECHECK`] (and, for the controllers, the readiness probe still
//! looks as before). A watch ends once the text showed or the instance is
//! gone, so an idle guest that is ready costs nothing.

use std::ffi::OsString;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use inotify::{EventStream, Inotify, WatchMask};

use super::monitor::{Domain, Phase};
use super::QemuDriver;
use crate::DomainEventKind;

/// The longest a watch sleeps without a wake before it scans again.
pub const RECHECK: Duration = Duration::from_secs(2);

/// Changes to one console log and its previous part.
pub struct ConsoleChanges {
    events: EventStream<Vec<u8>>,
    /// The log's file name: `console.log`, and `console.log.1` after it.
    name: OsString,
}

impl ConsoleChanges {
    /// Starts noting changes to the log at `log` (which need not exist
    /// yet: QEMU creates it). Taken before the first scan, so nothing
    /// printed between that scan and the watch is missed.
    pub fn watch(log: &Path) -> io::Result<Self> {
        let (Some(dir), Some(name)) = (log.parent(), log.file_name()) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a file in a directory", log.display()),
            ));
        };
        let inotify = Inotify::init()?;
        // The directory, not the file: the file may not exist yet, and a
        // rotation renames its previous part into place.
        inotify.watches().add(
            dir,
            WatchMask::MODIFY | WatchMask::CREATE | WatchMask::MOVED_TO,
        )?;
        Ok(Self {
            events: inotify.into_event_stream(vec![0u8; 4096])?,
            name: name.to_owned(),
        })
    }

    /// Waits until the log or its previous part changed, or [`RECHECK`]
    /// passed.
    pub async fn changed(&mut self) -> io::Result<()> {
        let name = self.name.as_encoded_bytes();
        let wait = async {
            while let Some(event) = self.events.next().await {
                let event = event?;
                if event
                    .name
                    .as_ref()
                    .is_some_and(|n| n.as_encoded_bytes().starts_with(name))
                {
                    return Ok(());
                }
            }
            Err(io::Error::other("the inotify stream ended"))
        };
        tokio::time::timeout(RECHECK, wait).await.unwrap_or(Ok(()))
    }
}

/// What the driver keeps of one watch, per instance and text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WatchState {
    Following,
    /// The text showed in the boot after this many resets.
    Shown {
        resets: u32,
    },
}

impl QemuDriver {
    /// See `Hypervisor::watch_console`.
    pub(super) fn follow_console(
        &self,
        instance: &str,
        text: &str,
        shown: Box<dyn FnOnce() + Send>,
    ) {
        let Ok(domain) = self.existing(instance, "watch console") else {
            return;
        };
        let key = (instance.to_string(), text.to_string());
        {
            let mut watches = self.inner.console_watches.lock().expect("console watches");
            match watches.get(&key) {
                Some(WatchState::Following) => return,
                // Shown in this boot: the probe finds it; a new boot
                // (a reset) is watched again.
                Some(WatchState::Shown { resets }) if *resets == domain.resets().count => return,
                Some(WatchState::Shown { .. }) | None => {}
            }
            watches.insert(key.clone(), WatchState::Following);
        }
        let inner = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let outcome = follow(&inner, &domain, &key.0, &key.1).await;
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let mut watches = inner.console_watches.lock().expect("console watches");
            match outcome {
                Ok(Some(resets)) => {
                    watches.insert(key, WatchState::Shown { resets });
                    drop(watches);
                    // The flag first, then the event: the look the event
                    // causes must find the flag set.
                    shown();
                    domain.announce(DomainEventKind::ConsoleShowed);
                }
                Ok(None) => {
                    watches.remove(&key);
                }
                Err(e) => {
                    watches.remove(&key);
                    tracing::debug!(instance = %key.0, "console watch ended: {e}");
                }
            }
        });
    }
}

/// Scans the console each time it changed until `text` shows (the resets
/// of the boot it showed in) or the instance is gone (`None`). Holds the
/// driver only while it scans, so a dropped driver ends the watch.
async fn follow(
    inner: &std::sync::Weak<super::Inner>,
    domain: &Domain,
    instance: &str,
    text: &str,
) -> Result<Option<u32>, String> {
    let mut changes =
        ConsoleChanges::watch(domain.console_log.path()).map_err(|e| e.to_string())?;
    loop {
        let resets = domain.resets().count;
        let Some(inner) = inner.upgrade() else {
            return Ok(None);
        };
        let driver = QemuDriver { inner };
        if driver
            .scan_console(instance, text)
            .await
            .map_err(|e| e.to_string())?
        {
            return Ok(Some(resets));
        }
        drop(driver);
        if matches!(domain.phase(), Phase::Exited(_)) {
            return Ok(None);
        }
        changes.changed().await.map_err(|e| e.to_string())?;
    }
}
