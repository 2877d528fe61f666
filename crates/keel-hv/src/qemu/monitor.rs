//! One [`Domain`] per instance directory, and for each live QEMU process a
//! monitor task that owns its QMP connection.
//!
//! The monitor exists because QEMU serves one QMP client at a time and sends
//! the `SHUTDOWN` event (the only record of *why* it exits) exactly once: a
//! connection has to be held open for the process's whole life. Driver calls
//! (`info`, `shutdown`) borrow that connection instead of opening their own.
//!
//! Lifecycle of a domain, each step taken by one writer:
//!
//! ```text
//! Launching --spawned + QMP answered (start)--> Live --process gone (monitor)--> Exited
//!     |                                           ^
//!     +-- start failed: directory removed         +-- re-adopted at driver start
//! ```
//!
//! `Exited` is entered only after `exit.json` was written, so the file and the
//! in-memory phase never disagree for longer than the write.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_api::{Clock, Millis, SystemClock};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::AbortHandle;

use super::console_log::ConsoleLog;
use super::layout::{
    exit_cause, read_json, write_json_atomic, ExitRecord, InstancePaths, ShutdownRecord,
};
use super::proc::{self, PidFd};
use super::qmp::{QmpClient, QmpEvent};
use super::qmp_events::domain_event_kind;
use super::reset_count::{counts_as_reset, ResetCounter, ResetRecord};
use crate::{DomainEvent, DomainEventKind, DomainState, HvError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Directory claimed; QEMU is being spawned or its QMP is not up yet.
    Launching { pid: Option<u32> },
    /// The process was alive when last looked at; a monitor watches it.
    Live { pid: u32 },
    /// The process is gone and `exit.json` is written.
    Exited(ExitRecord),
}

/// The monitor's QMP connection, as far as driver calls are concerned.
#[derive(Debug, Clone)]
enum QmpLink {
    /// The monitor has not finished its first connection attempt (just
    /// adopted; a previous Keel's connection may still be closing). Callers
    /// wait for the outcome instead of reporting a transient failure.
    Pending,
    /// Not connected; `last_error` says why. The monitor keeps retrying.
    Down {
        last_error: String,
    },
    Up(Arc<QmpClient>),
}

#[derive(Debug)]
pub struct Domain {
    pub instance: String,
    pub vm: String,
    pub started_at: Millis,
    pub paths: InstancePaths,
    /// The QMP `-chardev` argument: identifies this instance's process.
    pub marker: String,
    /// Launched under the fence keeper (`DomainSpec::fenced`).
    pub fenced: bool,
    qmp_timeout: Duration,
    phase: watch::Sender<Phase>,
    link: watch::Sender<QmpLink>,
    last_shutdown: Mutex<Option<ShutdownRecord>>,
    /// The guest's resets (its reboots, `system_reset`): the instance goes
    /// on through them.
    resets: ResetCounter,
    /// The guest's serial console log, bounded (`console_log`).
    pub console_log: Arc<ConsoleLog>,
    /// This process decided to kill QEMU: set before the signal, so the
    /// exit it causes is Keel's kill even before the marker file is
    /// written (after the signal: a kill never waits on the disk).
    kill_requested: std::sync::atomic::AtomicBool,
    task: Mutex<Option<AbortHandle>>,
    /// Where this domain's exit and monitor events are announced.
    domain_events: broadcast::Sender<DomainEvent>,
}

/// How the monitor learns the process ended.
pub enum ProcessWatch {
    /// Keel spawned it: `wait` reaps it (no zombie) and yields its status.
    Child(tokio::process::Child),
    /// Adopted after a Keel restart: not our child, so watch a pidfd.
    PidFd(PidFd),
}

impl ProcessWatch {
    /// Cancel-safe: used inside `select!`.
    async fn exited(&mut self) -> (Option<String>, &'static str) {
        match self {
            ProcessWatch::Child(child) => match child.wait().await {
                Ok(status) => (Some(status.to_string()), "parent wait"),
                Err(e) => (Some(format!("wait failed: {e}")), "parent wait"),
            },
            ProcessWatch::PidFd(fd) => {
                fd.exited().await;
                (None, "pidfd")
            }
        }
    }
}

/// How long, after the process is gone, the monitor keeps reading QMP for a
/// SHUTDOWN event still buffered in the socket.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

impl Domain {
    /// The domain of `instance`, launched (or to be) from `spec`.
    pub fn new(
        instance: String,
        spec: &crate::DomainSpec,
        started_at: Millis,
        paths: InstancePaths,
        qmp_timeout: Duration,
        phase: Phase,
        domain_events: broadcast::Sender<DomainEvent>,
    ) -> Arc<Domain> {
        let marker = paths.qmp_chardev_arg();
        let console_log = Arc::new(ConsoleLog::open(paths.console.clone()));
        let resets = ResetCounter::load(paths.resets.clone(), console_log.clone());
        Arc::new(Domain {
            resets,
            console_log,
            instance,
            vm: spec.vm.clone(),
            started_at,
            paths,
            marker,
            fenced: spec.fenced,
            qmp_timeout,
            phase: watch::Sender::new(phase),
            link: watch::Sender::new(QmpLink::Pending),
            last_shutdown: Mutex::new(None),
            kill_requested: Default::default(),
            task: Mutex::new(None),
            domain_events,
        })
    }

    pub fn phase(&self) -> Phase {
        self.phase.borrow().clone()
    }

    pub fn set_phase(&self, phase: Phase) {
        self.phase.send_replace(phase);
    }

    pub fn pid(&self) -> Option<u32> {
        match self.phase() {
            Phase::Launching { pid } => pid,
            Phase::Live { pid } => Some(pid),
            Phase::Exited(_) => None,
        }
    }

    /// Whether this instance's process is alive, checked against /proc (not
    /// only the pid: a reused pid runs another command line).
    pub fn process_alive(&self) -> bool {
        self.pid()
            .is_some_and(|pid| proc::is_instance_process(pid, &self.marker))
    }

    /// Waits until the monitor has recorded the exit, at most `timeout`.
    pub async fn wait_exited(&self, timeout: Duration) -> Option<ExitRecord> {
        let mut rx = self.phase.subscribe();
        let waited =
            tokio::time::timeout(timeout, rx.wait_for(|p| matches!(p, Phase::Exited(_)))).await;
        match waited {
            Ok(Ok(phase)) => match &*phase {
                Phase::Exited(rec) => Some(rec.clone()),
                _ => None,
            },
            _ => None,
        }
    }

    /// The domain's state. Only `Unavailable` when the process is alive and
    /// QMP cannot tell us more.
    pub async fn state(&self) -> Result<DomainState, HvError> {
        let pid = match self.phase() {
            Phase::Exited(rec) => return Ok(DomainState::Exited(rec.cause)),
            Phase::Launching { .. } => return Ok(DomainState::Starting),
            Phase::Live { pid } => pid,
        };
        let failure = match self.qmp().await {
            Ok(client) => match client.query_status().await {
                Ok(status) => return Ok(super::layout::run_state(&status.status)),
                Err(e) => e.to_string(),
            },
            Err(e) => e,
        };
        self.state_without_qmp(pid, "info", failure).await
    }

    /// QMP failed: if the process is gone the domain has exited (whatever the
    /// monitor has not yet written down); if it is alive we know nothing.
    pub async fn state_without_qmp(
        &self,
        pid: u32,
        op: &'static str,
        failure: String,
    ) -> Result<DomainState, HvError> {
        if proc::is_instance_process(pid, &self.marker) {
            return Err(HvError::Unavailable {
                instance: self.instance.clone(),
                op,
                reason: format!("QEMU pid {pid} is alive but QMP is unreachable: {failure}"),
                source: None,
            });
        }
        if let Some(rec) = self
            .wait_exited(DRAIN_AFTER_EXIT + Duration::from_secs(1))
            .await
        {
            return Ok(DomainState::Exited(rec.cause));
        }
        // The monitor is slow or gone: answer from the same evidence it uses.
        Ok(DomainState::Exited(exit_cause(
            self.shutdown_reason().as_deref(),
            self.kill_was_requested(),
        )))
    }

    /// The monitor's QMP connection; waits (bounded) while the monitor's
    /// first attempt is still under way.
    pub async fn qmp(&self) -> Result<Arc<QmpClient>, String> {
        let mut rx = self.link.subscribe();
        // The first attempt is itself bounded by qmp_timeout; the margin
        // covers the reconnect delay.
        let settled = tokio::time::timeout(
            self.qmp_timeout + Duration::from_secs(1),
            rx.wait_for(|l| !matches!(l, QmpLink::Pending)),
        )
        .await;
        let link = match settled {
            Ok(Ok(link)) => link.clone(),
            _ => return Err("QMP connection not established yet".into()),
        };
        match link {
            QmpLink::Up(client) if !client.is_closed() => Ok(client),
            QmpLink::Up(_) => Err("QMP connection closed".into()),
            QmpLink::Down { last_error } => Err(last_error),
            QmpLink::Pending => unreachable!("waited for a settled link"),
        }
    }

    fn set_link(&self, link: QmpLink) {
        self.link.send_replace(link);
    }

    /// The guest's resets so far, with where its current boot's console
    /// output begins.
    pub fn resets(&self) -> ResetRecord {
        self.resets.current()
    }

    /// Announces `kind` for this instance. Nobody listening is fine: the
    /// events are hints, for latency only.
    pub(super) fn announce(&self, kind: DomainEventKind) {
        let _ = self
            .domain_events
            .send(DomainEvent::new(&self.vm, &self.instance, kind));
    }

    fn on_event(&self, event: QmpEvent) {
        if event.event == "RESET" {
            let reason = event
                .data
                .get("reason")
                .and_then(|r| r.as_str())
                .unwrap_or("unknown");
            if !counts_as_reset(reason) {
                return;
            }
            match self.resets.note(reason, SystemClock.now_ms()) {
                None => {
                    tracing::debug!(instance = %self.instance, reason, "RESET of the reset just counted")
                }
                Some(rec) => {
                    tracing::info!(instance = %self.instance, reason, resets = rec.count, "guest reset");
                    // A hint, as for an exit: look at the instance now.
                    self.announce(DomainEventKind::Reset);
                }
            }
            return;
        }
        if event.event == "MIGRATION" {
            // Enabled on sources by `migrate`; targets send it unasked.
            let status = event
                .data
                .get("status")
                .and_then(|s| s.as_str())
                .unwrap_or("?");
            tracing::info!(instance = %self.instance, status, "migration");
        }
        let kind = domain_event_kind(&event);
        // The SHUTDOWN's record is written before anyone is woken by it:
        // the look it causes must find why QEMU is going.
        let shutdown = event.as_shutdown();
        if let Some(shutdown) = shutdown {
            self.record_shutdown(shutdown);
        }
        match kind {
            Some(kind) => {
                tracing::debug!(instance = %self.instance, event = %event.event, "QMP event, announced");
                self.announce(kind);
            }
            None => {
                tracing::debug!(instance = %self.instance, event = %event.event, "QMP event");
            }
        }
    }

    fn record_shutdown(&self, shutdown: super::qmp::ShutdownEvent) {
        tracing::info!(instance = %self.instance, reason = %shutdown.reason, "QEMU is shutting down");
        let record = ShutdownRecord {
            reason: shutdown.reason,
            guest: shutdown.guest,
            at: SystemClock.now_ms(),
        };
        if let Err(e) = write_json_atomic(&self.paths.shutdown, &record) {
            tracing::warn!(instance = %self.instance, "cannot persist SHUTDOWN event: {e}");
        }
        *self.last_shutdown.lock().expect("shutdown lock") = Some(record);
    }

    /// The SHUTDOWN reason seen by this monitor, or persisted by an earlier
    /// Keel process that watched the same QEMU.
    /// Records, in memory, that Keel is about to kill QEMU.
    pub fn note_kill_requested(&self) {
        self.kill_requested
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Keel killed it: this process said so, or the marker (of this or an
    /// earlier Keel, or of the fence keeper) says so.
    fn kill_was_requested(&self) -> bool {
        self.kill_requested
            .load(std::sync::atomic::Ordering::SeqCst)
            || self.paths.kill_marker.exists()
    }

    fn shutdown_reason(&self) -> Option<String> {
        if let Some(rec) = &*self.last_shutdown.lock().expect("shutdown lock") {
            return Some(rec.reason.clone());
        }
        read_json::<ShutdownRecord>(&self.paths.shutdown)
            .ok()
            .flatten()
            .map(|r| r.reason)
    }

    /// Writes the exit record and enters `Exited`. Called once the process is
    /// known to be gone; a second call keeps the first record.
    pub fn finish(&self, exit_status: Option<String>, observed_by: &str) -> ExitRecord {
        if let Phase::Exited(rec) = self.phase() {
            return rec;
        }
        if let Ok(Some(rec)) = read_json::<ExitRecord>(&self.paths.exit) {
            self.set_phase(Phase::Exited(rec.clone()));
            return rec;
        }
        let shutdown_reason = self.shutdown_reason();
        let kill_requested = self.kill_was_requested();
        let rec = ExitRecord {
            cause: exit_cause(shutdown_reason.as_deref(), kill_requested),
            at: SystemClock.now_ms(),
            shutdown_reason,
            kill_requested,
            exit_status,
            observed_by: observed_by.to_string(),
        };
        if let Err(e) = write_json_atomic(&self.paths.exit, &rec) {
            // Still report the exit: the process is gone either way, and a
            // later Keel re-derives the same cause from the same files.
            tracing::error!(instance = %self.instance, "cannot write exit record: {e}");
        }
        tracing::info!(instance = %self.instance, cause = ?rec.cause, status = ?rec.exit_status, "QEMU exited");
        self.set_phase(Phase::Exited(rec.clone()));
        self.announce(DomainEventKind::Exited);
        rec
    }

    /// Starts the monitor. `connected` is the QMP session `start` opened; an
    /// adopted process starts without one and the monitor connects.
    pub fn spawn_monitor(
        self: &Arc<Self>,
        watch: ProcessWatch,
        connected: Option<(QmpClient, mpsc::UnboundedReceiver<QmpEvent>)>,
    ) {
        let events = connected.map(|(client, events)| {
            self.set_link(QmpLink::Up(Arc::new(client)));
            events
        });
        let task = tokio::spawn(run_monitor(self.clone(), watch, events));
        *self.task.lock().expect("task lock") = Some(task.abort_handle());
    }

    /// Stops watching without touching the process (driver dropped).
    pub fn detach(&self) {
        if let Some(task) = self.task.lock().expect("task lock").take() {
            task.abort();
        }
        self.set_link(QmpLink::Down {
            last_error: "driver dropped".into(),
        });
    }
}

async fn run_monitor(
    domain: Arc<Domain>,
    mut watch: ProcessWatch,
    mut events: Option<mpsc::UnboundedReceiver<QmpEvent>>,
) {
    let mut retry_in = Duration::ZERO;
    let (status, observed_by) = loop {
        match events.as_mut() {
            Some(rx) => tokio::select! {
                exit = watch.exited() => break exit,
                event = rx.recv() => match event {
                    Some(event) => domain.on_event(event),
                    None => {
                        // QEMU closed QMP: usually it is exiting; otherwise
                        // reconnect so info keeps working.
                        domain.set_link(QmpLink::Down { last_error: "QMP connection closed".into() });
                        events = None;
                        retry_in = Duration::from_millis(50);
                    }
                },
            },
            None => tokio::select! {
                exit = watch.exited() => break exit,
                connected = connect_after(&domain, retry_in) => match connected {
                    Ok((client, rx)) => {
                        tracing::debug!(instance = %domain.instance, "QMP connected");
                        domain.set_link(QmpLink::Up(Arc::new(client)));
                        events = Some(rx);
                    }
                    Err(e) => {
                        domain.set_link(QmpLink::Down { last_error: e });
                        retry_in = (retry_in * 2).clamp(Duration::from_millis(100), RECONNECT_MAX);
                    }
                },
            },
        }
    };
    if let Some(mut rx) = events {
        let _ = tokio::time::timeout(DRAIN_AFTER_EXIT, async {
            while let Some(event) = rx.recv().await {
                domain.on_event(event);
            }
        })
        .await;
    }
    domain.set_link(QmpLink::Down {
        last_error: "QEMU exited".into(),
    });
    domain.finish(status, observed_by);
}

async fn connect_after(
    domain: &Domain,
    delay: Duration,
) -> Result<(QmpClient, mpsc::UnboundedReceiver<QmpEvent>), String> {
    tokio::time::sleep(delay).await;
    QmpClient::connect(&domain.paths.qmp, domain.qmp_timeout)
        .await
        .map_err(|e| e.to_string())
}
