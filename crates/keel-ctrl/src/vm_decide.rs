//! The VM lifecycle as a pure function: stored record + what the node
//! reports + the time → the next step. No I/O, no clock reads, so every
//! branch can be tested by constructing its inputs.
//!
//! The rules that keep two instances of one VM from ever existing:
//! - `status.instance` is written *before* the hypervisor is asked to start,
//!   and cleared only *after* the instance was observed gone (exited or
//!   NotFound) and cleaned up.
//! - A failed lookup (`Observed::Unknown`) never counts as gone; it only
//!   keeps the stop schedule (and its escalation to force) running.
//! - Before a new instance starts, the node is asked for every domain of the
//!   VM; any live one (an orphan) is adopted and stopped first, and a failed
//!   listing blocks the start (and the deletion of the record).
//! - Once a stop has begun it runs to completion; a new start waits for it.

use keel_api::{
    disk_record, ExitKind, ExitRecord, Instance, Migration, MigrationPhase, Millis, Phase,
    PowerState, RunPolicy, Snapshot, SnapshotPhase, StopReason, VirtualMachine,
};
use keel_hv::{DomainInfo, DomainState, ExitCause};

use crate::config::LifecycleConfig;
use crate::evict_decide::decide_eviction;
use crate::restart_required;
use crate::step::{backoff, persist_if_changed, HvAction, Step};
use crate::stop::{agent_shutdown_at, begin_stop, grace_end};
use crate::user_migrate_decide::decide_user_migration;
use crate::view::{ClusterView, Observed, RestoreSource};

pub fn decide(
    vm: &VirtualMachine,
    observed: &Observed,
    cluster: &ClusterView,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    // A migration from the recorded instance that succeeded has handed the
    // guest over, whatever the source looks like now (paused, stopped,
    // unreachable) and whether or not the drain still lasts: the target is
    // the instance.
    if let (Some(inst), Some(m)) = (&vm.status.instance, &cluster.migration) {
        if m.status.phase == MigrationPhase::Succeeded
            && m.source_instance == inst.id
            && m.is_from(vm)
        {
            return Step::Persist {
                vm: Box::new(crate::handover::migrated(vm, m, now)),
                then: None,
                requeue_at: now,
            };
        }
    }
    match (&vm.status.instance, observed) {
        // The source of a migration not yet settled is gone: it may have
        // handed over to a target that now waits with the whole state. The
        // migration settles first (Succeeded: the target is the instance;
        // Failed: the instance is gone), never a guess here.
        (Some(_), Observed::InstanceAbsent | Observed::Instance(DomainState::Exited(_)))
            if migration_in_flight(vm, cluster) =>
        {
            Step::Wait {
                requeue_at: now + cfg.retry_ms,
            }
        }
        (Some(_), Observed::Unknown(err)) => lookup_failed(vm, err, cluster, now, cfg),
        (Some(inst), Observed::InstanceAbsent) => instance_gone(vm, inst, None, now, cfg),
        (Some(inst), Observed::Instance(DomainState::Exited(cause))) => {
            instance_gone(vm, inst, Some(*cause), now, cfg)
        }
        (Some(inst), Observed::Instance(state)) => {
            instance_alive(vm, inst, *state, cluster, now, cfg)
        }
        // The observation is for a different shape of record (it changed
        // under us): look again at once.
        (Some(_), Observed::NoInstance { .. })
        | (None, Observed::Instance(_))
        | (None, Observed::InstanceAbsent) => Step::Wait { requeue_at: now },
        (None, Observed::Unknown(err)) => {
            let mut next = vm.clone();
            next.status.message = Some(format!(
                "cannot list domains of VM {} on node {}: {err}; retrying",
                vm.name, cfg.node
            ));
            persist_if_changed(vm, next, None, now + cfg.retry_ms)
        }
        (
            None,
            Observed::NoInstance {
                domains,
                restore_source,
            },
        ) => no_instance(vm, domains, restore_source, cluster, now, cfg),
    }
}

fn lookup_failed(
    vm: &VirtualMachine,
    err: &str,
    cluster: &ClusterView,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    let mut next = vm.clone();
    next.status.message = Some(format!("lookup failed, instance state unknown: {err}"));
    let inst = vm.status.instance.as_ref().expect("caller checked");
    // A stop asked for begins whatever the node can tell: a hung monitor
    // must not keep the grace period from starting, or its end from
    // forcing a kill (which needs no monitor). Only a migration in flight
    // holds it, as it would a running instance; its deadlines end it.
    if vm.status.stop.is_none() && !migration_in_flight(vm, cluster) {
        if let Some(reason) = should_stop(vm) {
            let step = begin_stop(next, inst, reason, now, cfg);
            return match step {
                Step::Persist {
                    mut vm,
                    then,
                    requeue_at,
                } => {
                    vm.status.message = Some(stopping_unseen(&vm, err));
                    Step::Persist {
                        vm,
                        then,
                        requeue_at,
                    }
                }
                other => other,
            };
        }
    }
    // A drain goes on too: an instance nobody can see is not sent
    // anywhere (as one not running), so its eviction's windows run out and
    // fall back to the stop, forced at the fallback window's end.
    if vm.status.stop.is_none() && should_stop(vm).is_none() {
        match decide_eviction(vm, inst, DomainState::Starting, cluster, now, cfg) {
            None | Some(Step::Wait { .. }) => {}
            Some(step) => return step,
        }
    }
    // The stop schedule keeps running: if the grace period is over, force
    // even though we cannot see the instance; a kill of an absent domain is
    // harmless. Gone is only ever concluded from a successful lookup.
    if let Some(stop) = &vm.status.stop {
        next.status.message = Some(stopping_unseen(vm, err));
        let grace_end = grace_end(vm, stop.requested_at);
        if now >= stop.next_check_at {
            let inst = inst.id.clone();
            if now >= grace_end {
                let stop = next.status.stop.as_mut().expect("cloned");
                stop.forced_at.get_or_insert(now);
                stop.next_check_at = now + cfg.kill_recheck_ms;
                next.status.message = Some(stopping_unseen(&next, err));
                return Step::Persist {
                    vm: Box::new(next),
                    then: Some(HvAction::Kill(inst)),
                    requeue_at: now + cfg.kill_recheck_ms,
                };
            }
        }
        // Look again at the retry interval, or sooner if the schedule's
        // next check or the force at the grace end comes first. A check
        // that is already due (it needs a successful lookup) is no reason
        // to look again at once.
        let due = if stop.next_check_at > now {
            stop.next_check_at
        } else {
            grace_end
        };
        let requeue_at = (now + cfg.retry_ms).min(due.max(now + 1));
        return persist_if_changed(vm, next, None, requeue_at);
    }
    persist_if_changed(vm, next, None, now + cfg.retry_ms)
}

/// What `keel vm get` says while a stop runs on an instance nobody can
/// look at: why, and when the kill comes.
fn stopping_unseen(vm: &VirtualMachine, err: &str) -> String {
    let Some(stop) = &vm.status.stop else {
        return format!("lookup failed, instance state unknown: {err}");
    };
    let what = match stop.forced_at {
        Some(_) => "killed, waiting to see the process gone".to_string(),
        None => format!(
            "forced kill at the end of the grace period ({}s after the stop began)",
            grace_end(vm, stop.requested_at).saturating_sub(stop.requested_at) / 1000
        ),
    };
    format!(
        "stopping ({:?}) with the instance's state unknown: {err}; {what}",
        stop.reason
    )
}

fn should_stop(vm: &VirtualMachine) -> Option<StopReason> {
    if let Some(stop) = &vm.status.stop {
        return Some(stop.reason);
    }
    if vm.deletion_requested_at.is_some() {
        return Some(StopReason::Delete);
    }
    if vm.restore.is_some() {
        return Some(StopReason::Restore);
    }
    if !vm.wants_running() {
        return Some(match vm.spec.run_policy {
            RunPolicy::AlwaysOff => StopReason::Policy,
            _ => StopReason::User,
        });
    }
    if vm.restart_pending() {
        return Some(StopReason::Restart);
    }
    None
}

fn instance_alive(
    vm: &VirtualMachine,
    inst: &Instance,
    state: DomainState,
    cluster: &ClusterView,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    let mut next = vm.clone();
    next.status.message = None;
    // A user's stop, restart, restore or delete wins over an eviction: it
    // is honoured at once by the normal stop (which first waits for the
    // migration controller to cancel a migration in flight, since the VM
    // no longer wants it), not retried against for the drain's windows.
    if should_stop(vm).is_none() {
        if let Some(step) = decide_user_migration(vm, inst, state, cluster, now, cfg) {
            return step;
        }
        if let Some(step) = decide_eviction(vm, inst, state, cluster, now, cfg) {
            return step;
        }
    }
    let Some(reason) = should_stop(vm) else {
        return keep_running(vm, next, inst, state, now, cfg);
    };
    let Some(stop) = &vm.status.stop else {
        if migration_in_flight(vm, cluster) {
            // Stopping a source mid-stream could hand over a guest that is
            // powering off, or leave a target to run beside a new instance:
            // the migration controller cancels it (no longer wanted) first.
            return Step::Wait {
                requeue_at: now + cfg.retry_ms,
            };
        }
        return begin_stop(next, inst, reason, now, cfg);
    };
    if now < stop.next_check_at {
        return Step::Wait {
            requeue_at: stop.next_check_at,
        };
    }
    let grace_end = grace_end(vm, stop.requested_at);
    let progress = next.status.stop.as_mut().expect("cloned");
    if stop.forced_at.is_some() || now >= grace_end {
        progress.forced_at.get_or_insert(now);
        progress.next_check_at = now + cfg.kill_recheck_ms;
        return Step::Persist {
            vm: Box::new(next),
            then: Some(HvAction::Kill(inst.id.clone())),
            requeue_at: now + cfg.kill_recheck_ms,
        };
    }
    // Half-way through the grace period a guest that still runs has
    // ignored the power button so far: ask its agent (if it has one) to
    // power off, once, before the forced kill at the end.
    let agent_at = agent_shutdown_at(stop.requested_at, grace_end);
    if stop.agent_shutdown_at.is_none() && now >= agent_at {
        progress.agent_shutdown_at = Some(now);
        progress.next_check_at = after_agent_shutdown(now, now, cfg).min(grace_end);
        let requeue_at = progress.next_check_at;
        return Step::Persist {
            vm: Box::new(next),
            then: Some(HvAction::GuestShutdown(inst.id.clone())),
            requeue_at,
        };
    }
    // Still within the grace period: press again (a guest that was still
    // booting may have missed the first press) and back off.
    let backoff = backoff(
        cfg.stop_backoff_initial_ms,
        cfg.stop_backoff_max_ms,
        stop.attempts,
    );
    progress.attempts += 1;
    progress.next_check_at = match stop.agent_shutdown_at {
        // The agent's power-off takes a few seconds: look again soon after
        // it, backing off anew from there.
        Some(asked) => after_agent_shutdown(asked, now, cfg),
        None => (now + backoff).min(agent_at.max(now + 1)),
    }
    .min(grace_end);
    let requeue_at = progress.next_check_at;
    Step::Persist {
        vm: Box::new(next),
        then: Some(HvAction::Shutdown(inst.id.clone())),
        requeue_at,
    }
}

/// The first check after `now` on the schedule that restarts at the agent
/// shutdown `asked`: `asked` + 1, 3, 7, 15 … s (steps doubling, capped).
fn after_agent_shutdown(asked: Millis, now: Millis, cfg: &LifecycleConfig) -> Millis {
    let mut step = cfg.stop_backoff_initial_ms.max(1);
    let mut at = asked + step;
    while at <= now {
        step = step.saturating_mul(2).min(cfg.stop_backoff_max_ms.max(1));
        at += step;
    }
    at
}

/// Whether a live migration from the recorded instance is still under way.
fn migration_in_flight(vm: &VirtualMachine, cluster: &ClusterView) -> bool {
    let recorded = vm.status.instance.as_ref().map(|i| i.id.as_str());
    cluster
        .migration
        .as_ref()
        .is_some_and(|m| !m.status.phase.is_final() && Some(m.source_instance.as_str()) == recorded)
}

fn keep_running(
    vm: &VirtualMachine,
    mut next: VirtualMachine,
    inst: &Instance,
    state: DomainState,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    let running = state == DomainState::Running;
    // A migration's target not resumed yet: its guest is in the pause of
    // the handover, not booting, and the migration controller resumes it.
    let resuming = inst.resuming_after.is_some()
        && matches!(state, DomainState::Paused | DomainState::Starting);
    let since = inst.running_since.or(running.then_some(now));
    let settled = since.is_some_and(|s| now >= s + cfg.boot_settle_ms);
    let status = &mut next.status;
    status.phase = if running || resuming {
        Phase::Running
    } else {
        Phase::Starting
    };
    status.observed_generation = vm.generation;
    if let Some(instance) = status.instance.as_mut() {
        instance.running_since = since;
        if running {
            // The start call failed (timed out, say), but the guest runs.
            instance.start_error = None;
            // Resumed: from now on a pause is a pause like any other.
            instance.resuming_after = None;
        }
    }
    if running {
        // The guest has run on the disks it was started with: from now on
        // they are the VM's data, and no start anywhere may create blank
        // ones instead. (`disks_used` for builds before per-disk records.)
        status.disks_used = true;
        let home = status
            .disk_home
            .get_or_insert_with(|| cfg.disk_home())
            .clone();
        // With the disks plugged in since (a plug under way is marked by
        // its confirmation, `hotplug`).
        let started = inst
            .attached_disk_names()
            .unwrap_or_else(|| vm.spec.disks.iter().map(|d| d.name.clone()).collect());
        let mut records = vm.status.disk_records(&vm.spec, &home);
        disk_record::mark_used(&mut records, &started, &home);
        status.disks = Some(records);
        crate::tpm_state::mark_used(status, inst, now);
    }
    status.restart_required = restart_required::fields(vm);
    if settled {
        status.failed_starts = 0;
        status.next_start_at = None;
        // The re-created instance booted: the recorded intent is fulfilled.
        if next
            .power_intent
            .as_ref()
            .is_some_and(|i| i.power == PowerState::Running)
        {
            next.power_intent = None;
        }
    }
    let requeue_at = match since {
        // Booting: looked at once the boot counts as settled (the start
        // backoff and a fulfilled power intent are cleared then). A guest
        // dying in its first seconds, the likeliest crash there is, wakes
        // its VM by the hypervisor's exit event like any other; a look
        // every `poll_ms` meanwhile found nothing those events do not
        // bring, and was most of an agent's looks while VMs were starting.
        Some(s) if !settled => s + cfg.boot_settle_ms,
        // Running steadily: the hypervisor's events (exit, SHUTDOWN, STOP,
        // RESET, GUEST_PANICKED, …) wake this VM; the resync only backs
        // them up.
        _ if running => crate::resync::resync_at(&vm.name, now, cfg),
        // Paused, or not yet running (QEMU before its vCPUs run): a state
        // that is meant to pass, looked at on the fast schedule.
        _ => now + cfg.poll_ms,
    };
    persist_if_changed(vm, next, None, requeue_at)
}

fn instance_gone(
    vm: &VirtualMachine,
    inst: &Instance,
    cause: Option<ExitCause>,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    let mut next = vm.clone();
    let requested = vm.status.stop.is_some();
    let kind = match cause {
        Some(ExitCause::Poweroff) => ExitKind::GuestPoweroff,
        Some(ExitCause::Crashed) => ExitKind::Crashed,
        Some(ExitCause::Killed) => ExitKind::Killed,
        None => ExitKind::Vanished,
    };
    // A start that failed, or an instance that ended before it was ever
    // seen running (other than by the guest's own power-off), never ran:
    // the user's request to run it is not fulfilled and must not be dropped.
    let never_ran = inst.start_error.is_some()
        || (inst.running_since.is_none() && cause != Some(ExitCause::Poweroff));
    let status = &mut next.status;
    status.last_exit = Some(ExitRecord {
        instance: inst.id.clone(),
        at: now,
        kind,
        requested,
        reason: inst.start_error.clone(),
    });
    status.instance = None;
    status.stop = None;
    status.message = None;
    status.restart_required.clear();
    if vm
        .status
        .stop
        .as_ref()
        .is_some_and(|s| s.reason == StopReason::Evict)
    {
        // Evicted: the next instance starts wherever the scheduler says,
        // and a drain's return may bring it back.
        if let Some(ev) = status.eviction.take().filter(|e| !e.user) {
            status.drained_from = Some(keel_api::DrainedFrom {
                node: inst.node.clone(),
                drain_requested_at: ev.drain_requested_at,
            });
        }
        status.node = None;
    }
    // Whatever restart was asked for is satisfied by the next fresh start.
    status.observed_restart_generation = vm.spec.restart_generation;
    let mut booted = false;
    if !requested {
        booted = inst
            .running_since
            .is_some_and(|since| now >= since + cfg.boot_settle_ms);
        status.failed_starts = if booted { 0 } else { status.failed_starts + 1 };
        status.next_start_at = Some(
            now + if booted {
                0
            } else {
                backoff(
                    cfg.start_backoff_initial_ms,
                    cfg.start_backoff_max_ms,
                    status.failed_starts - 1,
                )
            },
        );
        // A run that ended this way ends for good under some policies
        // (Manual, Once; RerunOnFailure after a power-off), unless it never
        // ran or a recorded power intent says it must come back (a failed
        // first boot after restore).
        if vm.spec.run_policy.run_ends_after(kind) && !intent_running(vm) && !never_ran {
            next.spec.power = PowerState::Stopped;
            next.generation += 1;
        }
    }
    next.status.phase = phase_without_instance(&next, now);
    if !requested {
        let retry_in = (next.status.phase == Phase::BackOff)
            .then(|| next.status.next_start_at.unwrap_or(now).saturating_sub(now));
        next.status.message = unrequested_exit_message(inst, kind, booted, retry_in);
    }
    // Clean up first: the record must keep naming the instance until the
    // node has forgotten it. NotFound from cleanup is success.
    Step::ActThenPersist {
        action: HvAction::Cleanup(inst.id.clone()),
        vm: Box::new(next),
        requeue_at: now,
    }
}

/// Why an instance nobody asked to stop is gone, for `status.message`.
/// `None` after a stable run: `last_exit` says how it ended, and the
/// restart (if any) is immediate.
fn unrequested_exit_message(
    inst: &Instance,
    kind: ExitKind,
    booted: bool,
    retry_in: Option<Millis>,
) -> Option<String> {
    let what = match &inst.start_error {
        Some(err) => err.clone(),
        None if booted => return None,
        None if inst.running_since.is_none() => {
            format!("instance {} ended ({kind:?}) before it ran", inst.id)
        }
        None => format!("instance {} ended ({kind:?}) while booting", inst.id),
    };
    Some(match retry_in {
        Some(ms) => format!("{what}; next start in {}s", ms.div_ceil(1000)),
        None => what,
    })
}

/// The VM's node lost its lease: its instance counts as gone (the node
/// fenced itself, or is down), the way a crash does, and the VM goes back
/// to the scheduler.
///
/// A migration from the recorded instance changes that: if it succeeded,
/// the target runs the guest and becomes the instance; if it is still in
/// flight, nothing is decided until the target's agent settles it (`None`),
/// since the target may already be running the guest, unless the
/// target's node is in `lost` too (fenced: it runs nothing).
///
/// Only a fenced instance counts as gone. An unfenced one (HA off, or
/// disks no other node sees) was never killed by its node's silence: the
/// VM keeps it and its node, with the reason on its record (`None` once
/// it says so), and is taken up again by that node's agent.
pub fn take_over_from_lost_node(
    vm: &VirtualMachine,
    node: &str,
    migrations: &[Migration],
    lost: &[String],
    now: Millis,
) -> Option<VirtualMachine> {
    let from_recorded = |m: &&Migration| m.is_from(vm);
    if let Some(m) = migrations
        .iter()
        .filter(from_recorded)
        .find(|m| m.status.phase == MigrationPhase::Succeeded)
    {
        return Some(crate::handover::migrated(vm, m, now));
    }
    if migrations
        .iter()
        .filter(from_recorded)
        .any(|m| !m.status.phase.is_final() && !lost.contains(&m.target_node))
    {
        return None;
    }
    if let Some(inst) = vm.status.instance.as_ref().filter(|i| !i.fenced) {
        // Nothing killed it when its node went silent, and no other node
        // may start it beside it: it keeps its instance and its node, and
        // the node's agent takes it up again when it is back.
        let mut next = vm.clone();
        next.status.message = Some(format!(
            "node {node} lost its lease; instance {} is not fenced ({}), so it waits for its node",
            inst.id,
            why_not_fenced(vm)
        ));
        return (next.status.message != vm.status.message).then_some(next);
    }
    let mut next = vm.clone();
    let requested = vm.status.stop.is_some();
    if let Some(inst) = &vm.status.instance {
        next.status.last_exit = Some(ExitRecord {
            instance: inst.id.clone(),
            at: now,
            kind: ExitKind::Vanished,
            requested,
            reason: Some(format!("node {node} lost its lease")),
        });
    }
    next.status.instance = None;
    next.status.stop = None;
    next.status.eviction = None;
    next.status.node = None;
    next.status.observed_restart_generation = vm.spec.restart_generation;
    next.status.message = Some(format!(
        "node {node} lost its lease; its instance counts as fenced"
    ));
    // Lost with its node: an infrastructure failure, the way a vanished
    // instance is. An instance that never ran was a failed start, retried.
    let never_ran = vm
        .status
        .instance
        .as_ref()
        .is_some_and(|i| i.start_error.is_some() || i.running_since.is_none());
    if !requested
        && vm.spec.run_policy.run_ends_after(ExitKind::Vanished)
        && !intent_running(vm)
        && !never_ran
    {
        next.spec.power = PowerState::Stopped;
        next.generation += 1;
    }
    next.status.phase = phase_without_instance(&next, now);
    Some(next)
}

/// Why an instance was launched unfenced, as far as the record tells:
/// the decision was made at its start, and the spec may have changed since.
fn why_not_fenced(vm: &VirtualMachine) -> &'static str {
    match &vm.status.disk_home {
        Some(home) if !home.is_shared() => "disks node-local",
        Some(_) => "ha off",
        None => "ha off / disks node-local",
    }
}

/// Whether a restore's recorded `Running` intent is still to be fulfilled.
fn intent_running(vm: &VirtualMachine) -> bool {
    vm.power_intent
        .as_ref()
        .is_some_and(|i| i.power == PowerState::Running)
}

fn phase_without_instance(vm: &VirtualMachine, now: Millis) -> Phase {
    if vm.deletion_requested_at.is_some() {
        Phase::Deleting
    } else if !vm.wants_running() {
        Phase::Stopped
    } else if vm.status.next_start_at.is_some_and(|at| at > now) {
        Phase::BackOff
    } else {
        Phase::Pending
    }
}

fn no_instance(
    vm: &VirtualMachine,
    domains: &[DomainInfo],
    restore_source: &RestoreSource,
    cluster: &ClusterView,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    let mut next = vm.clone();
    next.status.message = None;
    if let (None, Some(home)) = (&vm.status.disks, &vm.status.disk_home) {
        // A record from before per-disk records: read once, as early as
        // possible, while its spec still names the disks it had then.
        next.status.disks = Some(vm.status.disk_records(&vm.spec, home));
    }
    // Anything of this VM still on the node is dealt with before a start
    // or a deletion: a live one is adopted (and then stopped or kept by the
    // normal rules), an exited one is cleaned up.
    if let Some(live) = domains.iter().find(|d| !d.state.is_exited()) {
        // Fenced as it was launched: the record must not promise a fence
        // the guest does not have (the cluster would take it over).
        next.status.instance = Some(Instance {
            fenced: live.fenced,
            ..Instance::new(&live.instance, &cfg.node, live.started_at)
        });
        next.status.message = Some(format!("adopted untracked instance {}", live.instance));
        return Step::Persist {
            vm: Box::new(next),
            then: None,
            requeue_at: now,
        };
    }
    if let Some(exited) = domains.first() {
        return Step::ActThenPersist {
            action: HvAction::Cleanup(exited.instance.clone()),
            vm: Box::new(next),
            requeue_at: now,
        };
    }
    if vm.deletion_requested_at.is_some() {
        return Step::DeleteRecord;
    }
    if let Some(request) = &vm.restore {
        return restore(vm, &request.snapshot, restore_source, now, cfg);
    }
    if cluster
        .migration
        .as_ref()
        .is_some_and(|m| !m.status.phase.is_final())
    {
        // Its target may still start running the guest: settle it first.
        return Step::Wait {
            requeue_at: now + cfg.retry_ms,
        };
    }
    next.status.observed_restart_generation = vm.spec.restart_generation;
    next.status.observed_generation = vm.generation;
    let pinned_here = vm.spec.node.as_deref() == Some(cfg.node.as_str());
    if cluster.drain.is_some() && !pinned_here {
        // Not this node's any more, running or not: back to the scheduler,
        // so the drain can complete (and its return may bring it back).
        next.status.eviction = None;
        next.status.node = None;
        if let Some(drain) = cluster.drain.as_ref().filter(|_| vm.wants_running()) {
            next.mark_drained_from(&cfg.node, drain.requested_at);
        }
        next.status.phase = if vm.wants_running() {
            Phase::Pending
        } else {
            Phase::Stopped
        };
        return persist_if_changed(vm, next, None, now);
    }
    if !vm.wants_running() {
        // Nothing runs and nothing should: a `Stopped` intent is fulfilled,
        // and a `Running` one was overruled by a later stop request.
        next.power_intent = None;
        next.status.phase = Phase::Stopped;
        next.status.failed_starts = 0;
        next.status.next_start_at = None;
        // Nothing to do until the record changes, and a change wakes it.
        let requeue_at = crate::resync::resync_at(&vm.name, now, cfg);
        return persist_if_changed(vm, next, None, requeue_at);
    }
    if let Some(at) = vm.status.next_start_at.filter(|at| *at > now) {
        next.status.phase = Phase::BackOff;
        // The failure that put it here stays visible until the next try.
        next.status.message = vm.status.message.clone();
        return persist_if_changed(vm, next, None, at);
    }
    if cluster.drain.is_some() {
        // Pinned to this node: it waits for the drain to end.
        next.status.eviction = None;
        next.status.phase = Phase::Pending;
        next.status.message = Some(format!("pinned to draining node {}", cfg.node));
        // The fast look: the drain's end is a node record, which wakes no
        // VM's reconcile.
        return persist_if_changed(vm, next, None, now + cfg.poll_ms);
    }
    let here = cfg.disk_home();
    if let Some(home) = vm.status.disk_home.as_ref().filter(|h| **h != here) {
        // Its disks are where this node cannot see them: starting here
        // would mean blank disks in place of the VM's own. Back to the
        // scheduler, which places it only where its disks are.
        next.status.node = None;
        next.status.phase = Phase::Pending;
        next.status.message = Some(format!(
            "the disks of VM {} are on {home}, which node {} does not see; not started here",
            vm.name, cfg.node
        ));
        // Handed back to the scheduler: a state meant to pass quickly.
        return persist_if_changed(vm, next, None, now + cfg.poll_ms);
    }
    if let Some(why) = &cluster.no_room_here {
        // Beside what is allocated here it would overcommit the node
        // (which ends in the host's OOM killer ending guests), break a
        // placement rule (a required anti-affinity member already here,
        // a label the node has lost) or bind a port another VM holds:
        // back to the scheduler, which places it only where it may go
        // (or, pinned here, it waits).
        if !pinned_here {
            next.status.node = None;
        }
        next.status.phase = Phase::Pending;
        next.status.message = Some(format!("not started here: {why}"));
        // The fast look: the room is freed by other VMs' changes, which
        // wake no reconcile of this one.
        return persist_if_changed(vm, next, None, now + cfg.poll_ms);
    }
    // Each disk of the spec is recorded before the node is asked to make
    // it; the start may make only those no instance has run on.
    let mut records = vm.status.disk_records(&vm.spec, &here);
    disk_record::record_start(&mut records, &vm.spec.disk_names(), &here, now);
    next.status.disks = Some(records);
    // Decided now, with the instance, and never again for it: the driver
    // launches it fenced or not, and a later change of `spec.ha` is for
    // the next instance.
    let fenced = vm.spec.fenced_on(&here);
    next.status.disk_home.get_or_insert(here);
    // Recorded before the start, with the instance: every later instance
    // and every migration target runs as the same machine.
    next.status.hardware = crate::hardware::for_new_instance(vm, cfg.default_machine.as_deref());
    // The firmware too, once: its variable store is made for it.
    next.status
        .firmware
        .get_or_insert(vm.spec.boot.firmware.unwrap_or_default());
    let id = next.mint_instance_id();
    next.status.instance = Some(Instance {
        started_with: Some(restart_required::started_with(vm)),
        disk_sizes_mib: crate::online_resize::sizes_at_start(vm),
        hotplug_ports: keel_api::HOTPLUG_PORTS,
        balloon: true,
        fenced,
        ..Instance::new(id, &cfg.node, now)
    });
    next.status.restart_required.clear();
    next.status.next_start_at = None;
    next.status.phase = Phase::Starting;
    Step::Persist {
        vm: Box::new(next),
        then: Some(HvAction::Start),
        requeue_at: now + cfg.retry_ms,
    }
}

/// The instance is gone; put the disks and spec back from the snapshot and,
/// in the same write, turn the recorded power intent into `spec.power`.
fn restore(
    vm: &VirtualMachine,
    snapshot: &str,
    source: &RestoreSource,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    match source {
        RestoreSource::Found(snap) if snap.status.phase == SnapshotPhase::Ready => {
            let mut next = finish_restore(vm, Some(snap), now);
            next.status.message = Some(format!("restored from snapshot {snapshot}"));
            Step::ActThenPersist {
                action: HvAction::RestoreDisks(snapshot.to_string()),
                vm: Box::new(next),
                requeue_at: now,
            }
        }
        RestoreSource::Found(snap) if snap.status.phase == SnapshotPhase::Pending => {
            let mut next = vm.clone();
            next.status.message = Some(format!("waiting for snapshot {snapshot} to be taken"));
            // A restore under way: the snapshot's write wakes this VM, and
            // the fast look covers a missed one.
            persist_if_changed(vm, next, None, now + cfg.poll_ms)
        }
        RestoreSource::Unreadable(err) => {
            // Not "missing": the restore waits for the store to answer.
            let mut next = vm.clone();
            next.status.message = Some(format!(
                "restore waits: cannot read snapshot {snapshot} from the store: {err}"
            ));
            persist_if_changed(vm, next, None, now + cfg.retry_ms)
        }
        RestoreSource::Found(_) | RestoreSource::Missing | RestoreSource::NotNeeded => {
            // Nothing to restore from: end the maintenance window with the
            // disks as they are, and still honour the recorded power state.
            let mut next = finish_restore(vm, None, now);
            next.status.message = Some(format!(
                "restore abandoned: snapshot {snapshot} is missing or failed; disks unchanged"
            ));
            Step::Persist {
                vm: Box::new(next),
                then: None,
                requeue_at: now,
            }
        }
    }
}

fn finish_restore(vm: &VirtualMachine, snap: Option<&Snapshot>, now: Millis) -> VirtualMachine {
    let mut next = vm.clone();
    if let Some(snap) = snap {
        // Hardware and disks from the snapshot; the run policy and the
        // other operating decisions stay as they were before the restore.
        next.spec = vm.spec.restored_from(&snap.spec);
    }
    let power = vm.power_after_restore();
    next.spec.power = power;
    if power == PowerState::Stopped {
        // Nothing has to boot: the intent is fulfilled by this write. A
        // `Running` intent stays until the new instance has booted.
        next.power_intent = None;
    }
    next.restore = None;
    next.generation += 1;
    next.status.failed_starts = 0;
    next.status.next_start_at = None;
    next.status.observed_restart_generation = next.spec.restart_generation;
    next.status.phase = phase_without_instance(&next, now);
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{DiskHome, StopProgress, VmSpec};

    fn vm() -> VirtualMachine {
        VirtualMachine::new(
            "web",
            VmSpec {
                disks: vec![],
                run_policy: RunPolicy::Manual,
                ..keel_testkit::spec::vm_spec()
            },
        )
    }

    /// The README's run-policy table for exits nobody asked for: whether
    /// the run ends (`spec.power` becomes Stopped, nothing restarts). A
    /// start that never ran (a start error, or an end before it was seen
    /// running other than by power-off) never ends the run.
    #[test]
    fn unrequested_exits_end_the_run_per_policy() {
        use ExitKind::*;
        let cfg = LifecycleConfig::default();
        // Poweroff, Crashed, Killed, Vanished: ends the run?
        let table = [
            (RunPolicy::AlwaysOn, [false, false, false, false]),
            (RunPolicy::AlwaysOnUnlessStoppedManually, [false; 4]),
            (RunPolicy::Manual, [true; 4]),
            (RunPolicy::Once, [true; 4]),
            (RunPolicy::RerunOnFailure, [true, false, false, false]),
        ];
        let exits = [
            (
                Observed::Instance(DomainState::Exited(ExitCause::Poweroff)),
                GuestPoweroff,
            ),
            (
                Observed::Instance(DomainState::Exited(ExitCause::Crashed)),
                Crashed,
            ),
            (
                Observed::Instance(DomainState::Exited(ExitCause::Killed)),
                Killed,
            ),
            (Observed::InstanceAbsent, Vanished),
        ];
        for (policy, ends) in table {
            for ((observed, kind), ends) in exits.iter().zip(ends) {
                for (running_since, start_error) in [
                    (Some(0), None),
                    (None, None),
                    (None, Some("boom".to_string())),
                ] {
                    let mut v = vm();
                    v.spec.run_policy = policy;
                    v.status.instance = Some(Instance {
                        running_since,
                        start_error: start_error.clone(),
                        ..Instance::new("web-1", "local", 0)
                    });
                    let ran = start_error.is_none()
                        && (running_since.is_some() || *kind == GuestPoweroff);
                    let step = decide(&v, observed, &ClusterView::default(), 100_000, &cfg);
                    let Step::ActThenPersist { vm: next, .. } = step else {
                        panic!("{policy:?} {kind:?}: {step:?}")
                    };
                    let label = format!("{policy:?} after {kind:?}, ran: {ran}");
                    assert_eq!(
                        next.status.last_exit.as_ref().unwrap().kind,
                        *kind,
                        "{label}"
                    );
                    assert_eq!(
                        next.spec.power == PowerState::Stopped,
                        ends && ran,
                        "{label}"
                    );
                    assert_eq!(next.wants_running(), !(ends && ran), "{label}");
                }
            }
        }
    }

    /// A lost node is an infrastructure failure: RerunOnFailure runs the VM
    /// elsewhere, Once and Manual keep a run that happened ended, and a
    /// start that never ran is retried under all of them.
    #[test]
    fn lost_node_ends_the_run_per_policy() {
        for (policy, ran, keeps_running) in [
            (RunPolicy::AlwaysOn, true, true),
            (RunPolicy::AlwaysOnUnlessStoppedManually, true, true),
            (RunPolicy::RerunOnFailure, true, true),
            (RunPolicy::Manual, true, false),
            (RunPolicy::Once, true, false),
            (RunPolicy::Manual, false, true),
            (RunPolicy::Once, false, true),
        ] {
            let mut v = vm();
            v.spec.run_policy = policy;
            v.status.instance = Some(Instance {
                running_since: ran.then_some(0),
                ..Instance::new("web-1", "n1", 0)
            });
            let next = take_over_from_lost_node(&v, "n1", &[], &[], 100_000).unwrap();
            assert!(next.status.instance.is_none());
            assert_eq!(next.wants_running(), keeps_running, "{policy:?} ran: {ran}");
        }
    }

    /// While lookups fail mid-stop, the next look is at the retry
    /// interval, or at the schedule's next check or the grace end when one
    /// comes sooner; never "at once" for a check that is already due.
    #[test]
    fn failed_lookup_during_a_stop_requeues_at_retry_bounded_by_the_grace_end() {
        let cfg = LifecycleConfig::default();
        let t0 = 100_000;
        let grace_end = t0 + 60_000;
        // (now, next_check_at) → requeue_at
        for (now, next_check_at, expected) in [
            (t0 + 10_000, t0 + 3_000, t0 + 11_000),
            (t0 + 10_000, t0 + 10_000, t0 + 11_000),
            (t0 + 10_000, t0 + 10_400, t0 + 10_400),
            (grace_end - 300, t0 + 31_000, grace_end),
        ] {
            let mut v = vm();
            v.spec.power = PowerState::Stopped;
            v.status.instance = Some(Instance::new("web-1", "local", 0));
            v.status.stop = Some(StopProgress {
                reason: StopReason::User,
                requested_at: t0,
                attempts: 3,
                next_check_at,
                forced_at: None,
                agent_shutdown_at: None,
            });
            let observed = Observed::Unknown("unavailable".into());
            let requeue_at = match decide(&v, &observed, &ClusterView::default(), now, &cfg) {
                Step::Wait { requeue_at }
                | Step::Persist {
                    requeue_at,
                    then: None,
                    ..
                } => requeue_at,
                other => panic!("{other:?}"),
            };
            assert_eq!(requeue_at - t0, expected - t0, "now {}", now - t0);
        }
    }

    /// A stop asked for while the node cannot tell the instance's state
    /// (a hung monitor) still begins: the power button is tried, the grace
    /// period runs, its end is a kill, and the reason is on the record
    /// meanwhile. Gone (Stopped) only once the process is seen gone.
    #[test]
    fn a_stop_of_an_instance_nobody_can_see_begins_and_ends_in_a_kill() {
        let cfg = LifecycleConfig::default();
        let t0 = 100_000;
        let mut v = vm();
        v.spec.stop_grace_period_s = 10;
        v.status.phase = Phase::Running;
        v.status.instance = Some(Instance {
            running_since: Some(0),
            ..Instance::new("web-1", "local", 0)
        });
        v.spec.power = PowerState::Stopped;
        let unknown = Observed::Unknown("QMP query-status not answered within 5s".into());
        let mut now = t0;
        let mut actions = vec![];
        while now < t0 + 11_000 {
            match decide(&v, &unknown, &ClusterView::default(), now, &cfg) {
                Step::Persist {
                    vm,
                    then,
                    requeue_at,
                } => {
                    actions.extend(then.map(|a| (now - t0, a)));
                    v = *vm;
                    now = requeue_at;
                }
                Step::Wait { requeue_at } => now = requeue_at,
                other => panic!("{other:?}"),
            }
            let message = v.status.message.clone().unwrap_or_default();
            assert!(
                message.contains("state unknown") && message.contains("not answered"),
                "{message}"
            );
            assert_ne!(v.status.phase, Phase::Stopped, "stopped unseen at {now}");
        }
        assert_eq!(v.status.phase, Phase::Stopping);
        assert_eq!(
            actions,
            [
                (0, HvAction::Shutdown("web-1".into())),
                (10_000, HvAction::Kill("web-1".into())),
            ]
        );
        let stop = v.status.stop.clone().unwrap();
        assert_eq!((stop.requested_at, stop.forced_at), (t0, Some(t0 + 10_000)));
        assert!(v.status.message.as_ref().unwrap().contains("killed"));
        // Seen gone: stopped, as a requested stop.
        let gone = Observed::Instance(DomainState::Exited(ExitCause::Killed));
        let Step::ActThenPersist {
            action, vm: next, ..
        } = decide(&v, &gone, &ClusterView::default(), now, &cfg)
        else {
            panic!("expected cleanup");
        };
        assert_eq!(action, HvAction::Cleanup("web-1".into()));
        assert_eq!(next.status.phase, Phase::Stopped);
        assert!(next.status.last_exit.unwrap().requested);
    }

    /// ...but not under a migration in flight from it: that is settled
    /// first (its deadlines see to it), as for an instance that answers.
    #[test]
    fn a_stop_of_an_unseen_migration_source_waits_for_the_migration() {
        let cfg = LifecycleConfig::default();
        let mut v = vm();
        v.status.instance = Some(Instance::new("web-1", "local", 0));
        v.spec.power = PowerState::Stopped;
        let mut m: Migration = serde_json::from_value(serde_json::json!({
            "id": "web-m1", "vm": "web", "source_node": "local",
            "source_instance": "web-1", "target_node": "b",
            "target_instance": "web-2", "created_at": 0,
            "status": {"phase": "Running"}
        }))
        .unwrap();
        let cluster = |m: &Migration| ClusterView {
            migration: Some(m.clone()),
            ..Default::default()
        };
        let unknown = Observed::Unknown("QMP not answered".into());
        let step = decide(&v, &unknown, &cluster(&m), 1_000, &cfg);
        assert!(
            !matches!(step, Step::Persist { then: Some(_), .. }),
            "{step:?}"
        );
        m.status.phase = MigrationPhase::Failed;
        let step = decide(&v, &unknown, &cluster(&m), 1_000, &cfg);
        assert!(
            matches!(
                step,
                Step::Persist {
                    then: Some(HvAction::Shutdown(_)),
                    ..
                }
            ),
            "{step:?}"
        );
    }

    #[test]
    fn nothing_starts_where_the_disks_are_not() {
        let cfg = LifecycleConfig {
            node: "b".into(),
            ..Default::default()
        };
        let mut v = vm();
        v.status.node = Some("b".into());
        v.status.instance_seq = 3;
        v.status.disks_used = true;
        v.status.disk_home = Some(DiskHome::Node("a".into()));
        let observed = Observed::NoInstance {
            domains: vec![],
            restore_source: RestoreSource::NotNeeded,
        };
        let Step::Persist { vm: next, then, .. } =
            decide(&v, &observed, &ClusterView::default(), 1_000, &cfg)
        else {
            panic!("expected the reason to be recorded");
        };
        assert_eq!(then, None, "no start");
        assert!(next.status.instance.is_none() && next.status.node.is_none());
        assert!(next
            .status
            .message
            .unwrap()
            .contains("node-local storage on node a"));

        // On its own node it starts, and a first start records the home.
        let here = LifecycleConfig {
            node: "a".into(),
            ..Default::default()
        };
        let step = decide(&v, &observed, &ClusterView::default(), 1_000, &here);
        assert!(matches!(
            step,
            Step::Persist {
                then: Some(HvAction::Start),
                ..
            }
        ));
        let fresh = vm();
        let Step::Persist { vm: next, .. } =
            decide(&fresh, &observed, &ClusterView::default(), 1_000, &here)
        else {
            panic!()
        };
        assert_eq!(next.status.disk_home, Some(DiskHome::Node("a".into())));
        assert!(
            next.status.instance.as_ref().unwrap().balloon,
            "a new instance is recorded with a balloon device"
        );
        let records = next.status.disks.unwrap();
        assert!(
            records.iter().all(|r| !r.used),
            "made, not used: {records:?}"
        );
    }

    #[test]
    fn nothing_starts_where_there_is_no_room() {
        let cfg = LifecycleConfig {
            node: "a".into(),
            ..Default::default()
        };
        let mut v = vm();
        v.status.node = Some("a".into());
        let observed = Observed::NoInstance {
            domains: vec![],
            restore_source: RestoreSource::NotNeeded,
        };
        let full = ClusterView {
            no_room_here: Some("node a has 0 CPU and 0 MiB free".into()),
            ..ClusterView::default()
        };
        let Step::Persist { vm: next, then, .. } = decide(&v, &observed, &full, 1_000, &cfg) else {
            panic!("expected the reason to be recorded");
        };
        assert_eq!(then, None, "no start");
        assert!(next.status.instance.is_none());
        assert_eq!(next.status.node, None, "back to the scheduler");
        assert_eq!(next.status.phase, Phase::Pending);
        assert!(next.status.message.unwrap().contains("0 MiB free"));
        // Pinned here, it waits on this node.
        v.spec.node = Some("a".into());
        let Step::Persist { vm: next, then, .. } = decide(&v, &observed, &full, 1_000, &cfg) else {
            panic!()
        };
        assert_eq!((then, next.status.node.as_deref()), (None, Some("a")));
        // With room, it starts.
        assert!(matches!(
            decide(&v, &observed, &ClusterView::default(), 1_000, &cfg),
            Step::Persist {
                then: Some(HvAction::Start),
                ..
            }
        ));
    }

    /// A migration's target is Running while it waits to be resumed; once
    /// it has run, a pause is a pause like any other (Starting).
    #[test]
    fn a_handed_over_target_is_running_until_it_has_resumed() {
        let cfg = LifecycleConfig {
            node: "b".into(),
            ..Default::default()
        };
        let mut v = vm();
        v.status.phase = Phase::Running;
        v.status.instance = Some(Instance {
            running_since: Some(1_000),
            resuming_after: Some("web-m1".into()),
            ..Instance::new("web-2", "b", 500)
        });
        let look = |v: &VirtualMachine, state: DomainState| match decide(
            v,
            &Observed::Instance(state),
            &ClusterView::default(),
            2_000,
            &cfg,
        ) {
            Step::Persist { vm, then: None, .. } => *vm,
            Step::Wait { .. } => v.clone(),
            other => panic!("{state:?}: {other:?}"),
        };
        for state in [DomainState::Paused, DomainState::Starting] {
            let next = look(&v, state);
            assert_eq!(next.status.phase, Phase::Running, "{state:?}");
            assert!(next.status.instance.unwrap().resuming_after.is_some());
        }
        let resumed = look(&v, DomainState::Running);
        assert_eq!(resumed.status.phase, Phase::Running);
        assert_eq!(
            resumed.status.instance.as_ref().unwrap().resuming_after,
            None
        );
        assert_eq!(
            look(&resumed, DomainState::Paused).status.phase,
            Phase::Starting
        );
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let seq: Vec<_> = (0..8).map(|a| backoff(1000, 32_000, a)).collect();
        assert_eq!(seq, [1000, 2000, 4000, 8000, 16000, 32000, 32000, 32000]);
    }

    #[test]
    fn stop_schedule_is_1_2_4_then_force_at_grace_end() {
        let cfg = LifecycleConfig::default();
        let mut v = vm();
        v.status.instance = Some(Instance {
            running_since: Some(0),
            ..Instance::new("web-1", "local", 0)
        });
        v.spec.power = PowerState::Stopped;
        let running = Observed::Instance(DomainState::Running);
        let mut now = 100_000;
        let mut checks = vec![];
        for _ in 0..20 {
            match decide(&v, &running, &ClusterView::default(), now, &cfg) {
                Step::Persist {
                    vm,
                    then,
                    requeue_at,
                } => {
                    checks.push((now - 100_000, then.clone()));
                    v = *vm;
                    now = requeue_at;
                }
                Step::Wait { requeue_at } => now = requeue_at,
                other => panic!("{other:?}"),
            }
            if matches!(checks.last(), Some((_, Some(HvAction::Kill(_))))) {
                break;
            }
        }
        let times: Vec<_> = checks.iter().map(|(t, _)| *t).collect();
        // The power button at 0, 1, 3, 7, 15 s; the guest agent at half
        // the grace period, re-checked 1, 3, 7, 15 s after it (pressing
        // again); the kill at the end of the grace period.
        assert_eq!(
            times,
            [0, 1000, 3000, 7000, 15000, 30000, 31000, 33000, 37000, 45000, 60000]
        );
        let presses = |r: std::ops::Range<usize>| {
            checks[r]
                .iter()
                .all(|(_, a)| matches!(a, Some(HvAction::Shutdown(_))))
        };
        assert!(presses(0..5) && presses(6..10));
        assert_eq!(checks[5].1, Some(HvAction::GuestShutdown("web-1".into())));
        assert!(matches!(checks[10].1, Some(HvAction::Kill(_))));
        assert_eq!(
            v.status.stop.as_ref().unwrap().agent_shutdown_at,
            Some(130_000)
        );
    }
}
