//! What the controllers report for metrics. The binary implements it (with
//! Prometheus); the controllers only call it, so they stay free of any
//! metrics library, and tests can count what happened.

use keel_api::{ExitKind, StopReason, VirtualMachine};

pub trait LifecycleObserver: Send + Sync {
    /// A stop (of any reason) ended: the instance was observed gone
    /// `seconds` after the stop began.
    fn stop_finished(&self, _reason: StopReason, _seconds: f64) {}
    /// A new instance was first seen running `seconds` after it was recorded.
    fn start_finished(&self, _seconds: f64) {}
    /// An instance ended without being asked to (crash, guest power-off,
    /// vanished); the run policy decides whether it comes back.
    fn unrequested_exit(&self, _kind: ExitKind) {}
    /// A live migration ended, `seconds` after it was created.
    fn migration_finished(&self, _succeeded: bool, _seconds: f64) {}
    /// A reconcile failed and will be retried (`controller`: vm, snapshot, migration).
    fn reconcile_failed(&self, _controller: &'static str) {}
}

/// Reports nothing.
pub struct NoObserver;

impl LifecycleObserver for NoObserver {}

/// Reports what changed between two consecutive versions of a VM record
/// that the controller wrote.
pub(crate) fn report_transition(
    observer: &dyn LifecycleObserver,
    old: &VirtualMachine,
    new: &VirtualMachine,
) {
    let (old_status, new_status) = (&old.status, &new.status);
    if let (Some(_), None) = (&old_status.instance, &new_status.instance) {
        match (&old_status.stop, &new_status.last_exit) {
            (Some(stop), Some(exit)) => {
                let seconds = exit.at.saturating_sub(stop.requested_at) as f64 / 1000.0;
                observer.stop_finished(stop.reason, seconds);
            }
            (None, Some(exit)) => observer.unrequested_exit(exit.kind),
            _ => {}
        }
    }
    if let Some(inst) = &new_status.instance {
        let newly_running = old_status
            .instance
            .as_ref()
            .is_none_or(|o| o.id != inst.id || o.running_since.is_none());
        if let (true, Some(since)) = (newly_running, inst.running_since) {
            observer.start_finished(since.saturating_sub(inst.created_at) as f64 / 1000.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use keel_api::{ExitRecord, Instance, StopProgress, VmSpec};

    use super::*;

    #[derive(Default)]
    struct Log(Mutex<Vec<String>>);

    impl LifecycleObserver for Log {
        fn stop_finished(&self, reason: StopReason, seconds: f64) {
            self.0
                .lock()
                .unwrap()
                .push(format!("stop {reason:?} {seconds}"));
        }
        fn start_finished(&self, seconds: f64) {
            self.0.lock().unwrap().push(format!("start {seconds}"));
        }
        fn unrequested_exit(&self, kind: ExitKind) {
            self.0.lock().unwrap().push(format!("exit {kind:?}"));
        }
    }

    fn vm() -> VirtualMachine {
        let spec: VmSpec = serde_json::from_str(r#"{"cpus":1,"memory_mib":64}"#).unwrap();
        VirtualMachine::new("a", spec)
    }

    fn instance(running_since: Option<u64>) -> Instance {
        Instance {
            running_since,
            ..Instance::new("a-1", "n", 1_000)
        }
    }

    #[test]
    fn reports_starts_stops_and_crashes_once_each() {
        let log = Log::default();
        let mut starting = vm();
        starting.status.instance = Some(instance(None));
        let mut running = starting.clone();
        running.status.instance = Some(instance(Some(3_500)));
        report_transition(&log, &starting, &running);
        report_transition(&log, &running, &running);

        let mut stopping = running.clone();
        stopping.status.stop = Some(StopProgress {
            reason: StopReason::Restart,
            requested_at: 10_000,
            attempts: 1,
            next_check_at: 11_000,
            forced_at: None,
            agent_shutdown_at: None,
        });
        let mut gone = vm();
        gone.status.last_exit = Some(ExitRecord {
            instance: "a-1".into(),
            at: 10_250,
            kind: ExitKind::GuestPoweroff,
            requested: true,
            reason: None,
        });
        report_transition(&log, &stopping, &gone);
        let mut crashed = gone.clone();
        crashed.status.last_exit.as_mut().unwrap().kind = ExitKind::Crashed;
        report_transition(&log, &running, &crashed);
        assert_eq!(
            *log.0.lock().unwrap(),
            ["start 2.5", "stop Restart 0.25", "exit Crashed"]
        );
    }
}
