//! The guest-facing channels of an instance: its serial console (ttyS0,
//! logged to `console.log` and attachable through `console.sock`) and its
//! guest agent (`qga.sock`, see [`super::guest_agent`]).
//!
//! Every guest-agent call is bounded (`QemuConfig::agent_timeout`, longer
//! for a freeze) and serialised per instance: the channel carries one
//! conversation, and two interleaved ones would read each other's replies.
//!
//! A freeze is recorded (`fs-frozen` in the instance dir) before it is
//! sent and removed once a thaw succeeded; a driver that finds the marker
//! on adoption thaws the guest, so a Keel that died between the two does
//! not leave the guest's filesystems frozen for good.

use std::sync::Arc;
use std::time::Duration;

use super::guest_agent::{self, QgaError, QgaSession};
use super::monitor::{Domain, Phase};
use super::QemuDriver;
use crate::guest_info::LogScan;
use crate::{ConsoleStream, GuestInfo, HvError};

/// The most a single log read returns.
pub const MAX_LOG_READ: u64 = 4 << 20;

fn failed(instance: &str, op: &'static str, reason: impl std::fmt::Display) -> HvError {
    HvError::Failed {
        instance: instance.to_string(),
        op,
        reason: reason.to_string(),
        source: None,
    }
}

impl QemuDriver {
    pub(super) fn live_domain(
        &self,
        instance: &str,
        op: &'static str,
    ) -> Result<Arc<Domain>, HvError> {
        let domain = self.existing(instance, op)?;
        match domain.phase() {
            Phase::Live { .. } => Ok(domain),
            Phase::Launching { .. } => Err(super::unavailable(
                instance,
                op,
                "QEMU is still launching".into(),
            )),
            Phase::Exited(_) => Err(failed(instance, op, "the instance has exited")),
        }
    }

    pub(super) async fn read_console_log(
        &self,
        instance: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, u64), HvError> {
        let domain = self.existing(instance, "read console log")?;
        let log = domain.console_log.clone();
        let max = max_bytes.min(MAX_LOG_READ);
        let read = tokio::task::spawn_blocking(move || log.tail(max))
            .await
            .map_err(|e| failed(instance, "read console log", e))?;
        read.map_err(|e| failed(instance, "read console log", e))
    }

    pub(super) async fn scan_console(&self, instance: &str, text: &str) -> Result<bool, HvError> {
        let domain = self.existing(instance, "scan console log")?;
        let key = (instance.to_string(), text.to_string());
        let mut scan = self
            .inner
            .console_scans
            .lock()
            .expect("console scans")
            .get(&key)
            .cloned()
            .unwrap_or_default();
        // The guest reset since the last look: it boots again, and only
        // what it printed since counts.
        let resets = domain.resets();
        if resets.count != scan.resets {
            scan = LogScan::after_reset(resets.count, resets.console_offset);
        }
        if scan.found {
            return Ok(true);
        }
        let log = domain.console_log.clone();
        let needle = text.as_bytes().to_vec();
        // Bounded per call; the next probe continues from here.
        let scanned = tokio::task::spawn_blocking(move || log.scan(scan, &needle, MAX_LOG_READ))
            .await
            .map_err(|e| failed(instance, "scan console log", e))?
            .map_err(|e| failed(instance, "scan console log", e))?;
        let found = scanned.found;
        self.inner
            .console_scans
            .lock()
            .expect("console scans")
            .insert(key, scanned);
        Ok(found)
    }

    /// Drops what is remembered about a cleaned-up instance.
    pub(super) fn forget_guest(&self, instance: &str) {
        self.inner
            .console_scans
            .lock()
            .expect("console scans")
            .retain(|(i, _), _| i != instance);
        self.inner
            .console_watches
            .lock()
            .expect("console watches")
            .retain(|(i, _), _| i != instance);
        self.inner
            .agent_locks
            .lock()
            .expect("agent locks")
            .remove(instance);
    }

    pub(super) async fn attach_console(&self, instance: &str) -> Result<ConsoleStream, HvError> {
        let op = "attach console";
        let domain = self.live_domain(instance, op)?;
        let claim = self.inner.console_slots.claim(instance).ok_or_else(|| {
            failed(
                instance,
                op,
                "another console session is attached; only one at a time",
            )
        })?;
        let timeout = self.inner.config.qmp_timeout;
        let stream = tokio::time::timeout(
            timeout,
            tokio::net::UnixStream::connect(&domain.paths.console_sock),
        )
        .await
        .map_err(|_| {
            failed(
                instance,
                op,
                format!("console socket: no answer within {timeout:?}"),
            )
        })?
        .map_err(|e| {
            let context = domain.paths.console_sock.display().to_string();
            HvError::failed_by(instance, op, context, e)
        })?;
        Ok(ConsoleStream::new(Box::new(stream), Some(Box::new(claim))))
    }

    /// Runs `f` on a fresh agent session, alone on the instance's channel.
    /// The wait for the channel counts against the timeout too.
    pub(super) async fn with_agent<T>(
        &self,
        instance: &str,
        op: &'static str,
        f: impl for<'a> FnOnce(
            &'a mut QgaSession,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, QgaError>> + Send + 'a>,
        >,
    ) -> Result<T, HvError> {
        let domain = self.live_domain(instance, op)?;
        let timeout = self.inner.config.agent_timeout;
        let lock = self
            .inner
            .agent_locks
            .lock()
            .expect("agent locks")
            .entry(instance.to_string())
            .or_default()
            .clone();
        let _alone = tokio::time::timeout(timeout, lock.lock_owned())
            .await
            .map_err(|_| failed(instance, op, "guest agent channel busy with another call"))?;
        let mut session = QgaSession::open(&domain.paths.qga, timeout)
            .await
            .map_err(|e| failed(instance, op, e))?;
        f(&mut session).await.map_err(|e| failed(instance, op, e))
    }

    pub(super) async fn agent_info(&self, instance: &str) -> Result<GuestInfo, HvError> {
        let domain = match self.live_domain(instance, "query guest agent") {
            Ok(d) => d,
            Err(e @ (HvError::NotFound { .. } | HvError::Unavailable { .. })) => return Err(e),
            Err(e) => return Ok(GuestInfo::silent(e.to_string())),
        };
        let timeout = self.inner.config.agent_timeout;
        let lock = self
            .inner
            .agent_locks
            .lock()
            .expect("agent locks")
            .entry(instance.to_string())
            .or_default()
            .clone();
        let Ok(_alone) = tokio::time::timeout(timeout, lock.lock_owned()).await else {
            return Ok(GuestInfo::silent(
                "guest agent channel busy with another call",
            ));
        };
        Ok(guest_agent::probe(&domain.paths.qga, timeout).await)
    }

    pub(super) async fn agent_freeze(&self, instance: &str) -> Result<u32, HvError> {
        let domain = self.live_domain(instance, "freeze filesystems")?;
        // Recorded first: if Keel dies before the thaw, adoption thaws.
        tokio::fs::write(&domain.paths.fs_frozen, b"frozen\n")
            .await
            .map_err(|e| failed(instance, "freeze filesystems", e))?;
        let freeze_timeout = self.inner.config.freeze_timeout;
        self.with_agent(instance, "freeze filesystems", move |s| {
            Box::pin(async move { s.fs_freeze(freeze_timeout).await })
        })
        .await
    }

    pub(super) async fn agent_thaw(&self, instance: &str) -> Result<u32, HvError> {
        let domain = self.existing(instance, "thaw filesystems")?;
        let timeout = self.inner.config.freeze_timeout;
        let thawed = self
            .with_agent(instance, "thaw filesystems", move |s| {
                Box::pin(async move { s.fs_thaw(timeout).await })
            })
            .await?;
        let _ = tokio::fs::remove_file(&domain.paths.fs_frozen).await;
        Ok(thawed)
    }

    pub(super) async fn agent_shutdown(&self, instance: &str) -> Result<(), HvError> {
        self.with_agent(instance, "shut down through the guest agent", |s| {
            Box::pin(async move { s.shutdown().await })
        })
        .await
    }
}

/// On adoption: a previous Keel froze this guest's filesystems and did not
/// get to thaw them. Thawed in the background, retried for a while (the
/// agent may be busy, or the adopting driver not fully up).
pub(super) fn thaw_left_frozen(driver: QemuDriver, instance: String) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        for attempt in 0..10u32 {
            match driver.agent_thaw(&instance).await {
                Ok(n) => {
                    tracing::warn!(%instance, filesystems = n, "thawed a guest an interrupted snapshot left frozen");
                    return;
                }
                Err(HvError::NotFound { .. }) => return,
                Err(e) => {
                    tracing::warn!(%instance, attempt, "cannot thaw a guest left frozen yet: {e}");
                    tokio::time::sleep(Duration::from_secs(1 << attempt.min(4))).await;
                }
            }
        }
        tracing::error!(%instance, "gave up thawing a guest an interrupted snapshot left frozen");
    });
}
