//! Why a VM is looked at again when its step asks: named in the runtime's
//! `reconcile` span of that next look (`requeue`), so a log line says
//! "stopping: re-check ACPI shutdown (backoff 4 s)" rather than only a
//! time. The decision and its joined steps (readiness, reboot, resize,
//! hotplug) each pick a time, and the earliest wins; which one did is read
//! back here from the record the step leaves, the one place that sees
//! them all after they are joined.

use std::borrow::Cow;

use keel_api::{Millis, VirtualMachine};

use crate::config::LifecycleConfig;
use crate::resync::resync_at;

/// Why `after` (the record as the step leaves it) is looked at again at
/// `at`, judged at `now`.
pub fn why_next_look(
    after: &VirtualMachine,
    at: Millis,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Cow<'static, str> {
    let secs = |ms: Millis| ms.div_ceil(1000);
    if at <= now {
        return "more to do at once".into();
    }
    if let Some(stop) = after.status.stop.as_ref().filter(|s| s.next_check_at == at) {
        return match (stop.forced_at, stop.agent_shutdown_at) {
            (Some(_), _) => "stopping: killed, re-check the process is gone".into(),
            (None, Some(_)) => format!(
                "stopping: re-check the guest agent's power-off (backoff {} s)",
                secs(at - now)
            )
            .into(),
            (None, None) => format!(
                "stopping: re-check ACPI shutdown (backoff {} s)",
                secs(at - now)
            )
            .into(),
        };
    }
    if after.status.next_start_at == Some(at) {
        return format!("restart backoff ({} s)", secs(at - now)).into();
    }
    if at == resync_at(&after.name, now, cfg) {
        return "steady resync".into();
    }
    if let Some(inst) = &after.status.instance {
        let not_ready = inst
            .readiness
            .as_ref()
            .is_some_and(|r| r.ready_at.is_none());
        if not_ready && at == now + cfg.readiness_probe_ms {
            return "ready probe".into();
        }
        match inst.running_since {
            None => return "starting: waiting for the instance to run".into(),
            Some(since) if now < since + cfg.boot_settle_ms => {
                return "booting: until the boot settles".into()
            }
            Some(_) => {}
        }
    }
    if at == now + cfg.retry_ms {
        return "waiting: retry interval".into();
    }
    if at == now + cfg.poll_ms {
        return "waiting: fast look at a passing state".into();
    }
    "the VM's next look".into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{StopProgress, StopReason};

    fn vm() -> VirtualMachine {
        VirtualMachine::new("web", keel_testkit::spec::vm_spec())
    }

    fn stopping(next_check_at: Millis, forced_at: Option<Millis>) -> VirtualMachine {
        let mut vm = vm();
        vm.status.stop = Some(StopProgress {
            reason: StopReason::User,
            requested_at: 0,
            attempts: 3,
            next_check_at,
            forced_at,
            agent_shutdown_at: None,
        });
        vm
    }

    #[test]
    fn each_schedule_is_named_by_what_set_the_time() {
        let cfg = LifecycleConfig::default();
        let now = 100_000;
        let why = |vm: &VirtualMachine, at| why_next_look(vm, at, now, &cfg);
        assert_eq!(
            why(&stopping(now + 4_000, None), now + 4_000),
            "stopping: re-check ACPI shutdown (backoff 4 s)"
        );
        assert_eq!(
            why(&stopping(now + 500, Some(now)), now + 500),
            "stopping: killed, re-check the process is gone"
        );
        let mut backing_off = vm();
        backing_off.status.next_start_at = Some(now + 8_000);
        assert_eq!(why(&backing_off, now + 8_000), "restart backoff (8 s)");
        let resync = resync_at("web", now, &cfg);
        assert_eq!(why(&vm(), resync), "steady resync");
        assert_eq!(why(&vm(), now), "more to do at once");
        assert_eq!(why(&vm(), now + cfg.retry_ms), "waiting: retry interval");
    }
}
