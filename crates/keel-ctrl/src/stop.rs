//! The start of a stop and its deadlines: when the power button gives way
//! to the guest agent, and when the stop turns into a kill. Shared by the
//! lifecycle (`vm_decide`) and evictions (`evict_decide`).

use keel_api::{Instance, Millis, Phase, StopProgress, StopReason, VirtualMachine};

use crate::config::LifecycleConfig;
use crate::step::{HvAction, Step};

/// Presses the power button and records the stop schedule.
pub(crate) fn begin_stop(
    mut next: VirtualMachine,
    inst: &Instance,
    reason: StopReason,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    next.status.phase = if reason == StopReason::Delete {
        Phase::Deleting
    } else {
        Phase::Stopping
    };
    let end = grace_end(&next, now);
    let first_check = (now + cfg.stop_backoff_initial_ms)
        .min(end.max(now + 1))
        .min(agent_shutdown_at(now, end).max(now + 1));
    next.status.stop = Some(StopProgress {
        reason,
        requested_at: now,
        attempts: 1,
        next_check_at: first_check,
        forced_at: None,
        agent_shutdown_at: None,
    });
    Step::Persist {
        vm: Box::new(next),
        then: Some(HvAction::Shutdown(inst.id.clone())),
        requeue_at: first_check,
    }
}

/// When a stop begun at `requested_at` falls back to the guest agent: half
/// the grace period (the agent's power-off then has the other half).
pub(crate) fn agent_shutdown_at(requested_at: Millis, grace_end: Millis) -> Millis {
    requested_at + grace_end.saturating_sub(requested_at) / 2
}

/// When a stop begun at `requested_at` turns into a kill: the grace period,
/// shortened by an eviction's fallback window (a missing window counts as
/// expired).
pub(crate) fn grace_end(vm: &VirtualMachine, requested_at: Millis) -> Millis {
    let end = requested_at + vm.spec.stop_grace_period_s * 1000;
    match (&vm.status.stop, &vm.status.eviction) {
        (Some(stop), Some(ev)) if stop.reason == StopReason::Evict => {
            end.min(ev.fallback_deadline.unwrap_or(requested_at))
        }
        _ => end,
    }
}
