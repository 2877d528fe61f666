//! Guest reboots inside a running instance, decided by pure functions the
//! VM controller applies to the step `vm_decide` chose.
//!
//! - A reset the driver counted (`DomainInfo::resets` above the instance's
//!   `resets`) is the guest rebooting: same instance, same process. It is
//!   recorded on the instance (count, time), readiness starts over (not
//!   ready until a probe after the reset says so), and an event is written.
//!   Nothing else changes: no exit, no backoff, no run policy involved.
//! - A `keel vm reboot` (`reboot_generation` above the observed one) is
//!   taken up once: the progress is recorded on the instance first, then
//!   the guest is asked through its agent (or, with no agent answering, the
//!   hypervisor resets it at once); a guest that has not reset by the end
//!   of its stop grace period is reset by the hypervisor (`system_reset`).

use keel_api::reboot::RESET_SEEN_WITHIN_MS;
use keel_api::{Event, Millis, Phase, RebootProgress, VirtualMachine};
use keel_hv::DomainState;

use crate::joined_step::{alive, instance_event, same_instance, writable};
use crate::step::{HvAction, Step};
use crate::view::Observed;

/// Whether a reboot is under way on the recorded instance.
fn under_way(vm: &VirtualMachine) -> bool {
    vm.status
        .instance
        .as_ref()
        .is_some_and(|i| i.reboot.is_some())
}

fn persist(old: &VirtualMachine, next: VirtualMachine, then: Option<HvAction>, at: Millis) -> Step {
    Step::Persist {
        vm: Box::new(next),
        then,
        requeue_at: at,
    }
    .unless_unchanged(old)
}

/// `step` with the resets the driver counted (`resets`, from the lookup of
/// the recorded instance) taken into the record.
pub fn note_resets(
    vm: &VirtualMachine,
    observed: &Observed,
    resets: Option<u32>,
    step: Step,
    now: Millis,
) -> Step {
    let (Some(counted), true) = (resets, alive(observed)) else {
        return step;
    };
    let seen = vm.status.instance.as_ref().map_or(0, |i| i.resets);
    // Fewer than recorded: a driver that lost its count. Never counted down.
    if counted <= seen {
        return step;
    }
    let Some((mut next, requeue_at)) = writable(vm, &step) else {
        return step;
    };
    let inst = next.status.instance.as_mut().expect("writable has one");
    inst.resets = counted;
    inst.last_reset_at = Some(now);
    if let Some(r) = inst.readiness.as_mut() {
        r.ready_at = None;
        r.agent = false;
        r.reason = Some(format!(
            "guest rebooted (reset {counted} of instance {}); not up again yet",
            inst.id
        ));
    }
    if inst
        .reboot
        .as_ref()
        .is_some_and(|p| counted > p.resets_before)
    {
        inst.reboot = None;
    }
    persist(vm, next, None, requeue_at.min(now))
}

/// The event for the resets `new` recorded since `old`, if any.
pub fn reset_event(old: &VirtualMachine, new: &VirtualMachine, now: Millis) -> Option<Event> {
    let (before, after) = same_instance(old, new)?;
    if after.resets <= before.resets {
        return None;
    }
    let asked = before.reboot.is_some() && after.reboot.is_none();
    Some(instance_event(
        old,
        new,
        now,
        format!(
            "guest rebooted{}: instance {} goes on (reset {} of it)",
            if asked { " as requested" } else { "" },
            after.id,
            after.resets
        ),
    ))
}

/// `step` carrying out the user's `keel vm reboot`, if one is pending or
/// under way and nothing else is being done to the instance.
pub fn reboot_step(vm: &VirtualMachine, observed: &Observed, step: Step, now: Millis) -> Step {
    if !vm.reboot_pending() && !under_way(vm) {
        return step;
    }
    let Some((mut next, requeue_at)) = writable(vm, &step) else {
        // No instance (or another step under way): a pending request
        // waits; once nothing runs it is void (see below).
        // No instance runs: the request is void, also when this very step
        // starts a new one (a reboot is of the guest that ran when asked).
        return match (&vm.status.instance, step) {
            (None, Step::Wait { requeue_at }) if vm.reboot_pending() => {
                let mut next = vm.clone();
                next.status.observed_reboot_generation = vm.reboot_generation;
                persist(vm, next, None, requeue_at)
            }
            (
                None,
                Step::Persist {
                    vm: mut next,
                    then,
                    requeue_at,
                },
            ) => {
                next.status.observed_reboot_generation = vm.reboot_generation;
                Step::Persist {
                    vm: next,
                    then,
                    requeue_at,
                }
            }
            (_, other) => other,
        };
    };
    // From the record as this step leaves it: a reset noted in this very
    // look has ended the reboot under way.
    if !next.reboot_pending() && !under_way(&next) {
        return step;
    }
    let grace_ms = vm.spec.stop_grace_period_s.saturating_mul(1000);
    let stopping = next.status.stop.is_some() || !next.wants_running();
    let phase = next.status.phase;
    let inst = next.status.instance.as_mut().expect("writable has one");
    if let Some(p) = inst.reboot.clone() {
        if stopping {
            inst.reboot = None;
            return persist(vm, next, None, requeue_at);
        }
        if !alive(observed) {
            return step;
        }
        return match p.reset_sent_at {
            None if now >= p.fallback_at => {
                inst.reboot = Some(RebootProgress {
                    reset_sent_at: Some(now),
                    ..p
                });
                let id = inst.id.clone();
                persist(
                    vm,
                    next,
                    Some(HvAction::Reset(id)),
                    now + RESET_SEEN_WITHIN_MS,
                )
            }
            None => persist(vm, next, None, requeue_at.min(p.fallback_at)),
            Some(sent) if now >= sent + RESET_SEEN_WITHIN_MS => {
                inst.reboot = None;
                next.status.message = Some(format!(
                    "reboot: the hypervisor was told to reset the guest at {sent}, and no reset \
                     was seen; the instance runs on"
                ));
                persist(vm, next, None, requeue_at)
            }
            Some(sent) => persist(vm, next, None, requeue_at.min(sent + RESET_SEEN_WITHIN_MS)),
        };
    }
    // A request to take up.
    if stopping || !matches!(phase, Phase::Running | Phase::Starting) {
        next.status.observed_reboot_generation = next.reboot_generation;
        return persist(vm, next, None, requeue_at);
    }
    if phase != Phase::Running || observed != &Observed::Instance(DomainState::Running) {
        // Booting, paused or unseen: asked again at the next look.
        return step;
    }
    let agent = inst.readiness.as_ref().is_some_and(|r| r.agent);
    let id = inst.id.clone();
    inst.reboot = Some(RebootProgress {
        generation: vm.reboot_generation,
        requested_at: now,
        resets_before: inst.resets,
        fallback_at: now + grace_ms,
        reset_sent_at: (!agent).then_some(now),
    });
    next.status.observed_reboot_generation = vm.reboot_generation;
    let (action, look) = if agent {
        (HvAction::GuestReboot(id), now + grace_ms)
    } else {
        // No agent to ask (QEMU has no ACPI reboot button): the fallback now.
        (HvAction::Reset(id), now + RESET_SEEN_WITHIN_MS)
    };
    persist(vm, next, Some(action), requeue_at.min(look))
}
