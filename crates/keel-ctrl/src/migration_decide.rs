//! One look at a migration, as a pure function: from the record, the VM,
//! what this node has seen of both instances and of the nodes, and the
//! clock, the step its `MigrationController` takes next.
//!
//! What is seen is read only when the decision needs it, in the order it
//! needs it: a missing observation is itself the answer (`Look`), and the
//! executor decides again once it has read it. Each read has effects a
//! blanket read would change (a node's heartbeat seen sooner moves when it
//! counts as lost; the simulated hypervisor's faults follow its calls).

use keel_api::{EvictionPhase, Migration, MigrationPhase, Millis, VirtualMachine};
use keel_hv::{DomainState, HvError, MigrationProgress};

use crate::config::LifecycleConfig;

/// How soon to look again while a migration moves (the source sends, the
/// target waits for the state or for the handover to be recorded): short,
/// since the VM's eviction and the user wait on each phase.
pub(crate) const MOVING_POLL_MS: Millis = 500;

/// Progress is recorded at most this often (the progress timeout is
/// measured from the last recorded progress).
const PROGRESS_RECORD_MS: Millis = 5_000;

/// What this node has read so far in this look; `None`: not read yet.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// The source node's lease ran out: it fenced itself or is down.
    pub source_node_lost: Option<bool>,
    /// The target node's lease ran out.
    pub target_node_lost: Option<bool>,
    /// This node's own lease is fresh (no lease to keep counts as fresh).
    pub own_lease_fresh: Option<bool>,
    /// Whether the incoming instance fits on this node, and if not why.
    pub room: Option<Result<(), String>>,
    /// What the source instance reports of its migration.
    pub source_progress: Option<Result<MigrationProgress, HvError>>,
    /// The target instance's state.
    pub target_state: Option<Result<DomainState, HvError>>,
}

/// A read the decision needs before it can say more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    SourceNodeLost,
    TargetNodeLost,
    OwnLease,
    /// Needs the VM: only asked for once the VM is known to be wanted.
    Room,
    SourceProgress,
    TargetState,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum MigrationStep {
    /// Read this, then decide again.
    Look(Look),
    /// Nothing left for this node to do.
    Forget,
    /// Nothing to change; look again at `requeue_at`.
    Wait { requeue_at: Millis, why: String },
    /// Something did not answer or is not ready; look again at
    /// `requeue_at` (logged as a warning).
    Retry { requeue_at: Millis, why: String },
    /// Store `m` (compare-and-swap on the revision read); look again at
    /// `requeue_at`, whether it was stored or lost the race.
    Record {
        m: Box<Migration>,
        requeue_at: Millis,
    },
    /// Store the final record `m` (Succeeded or Failed), for `why`.
    Finish { m: Box<Migration>, why: String },
    /// Start the incoming instance; `TargetReady` with its address once it
    /// listens, Failed if it cannot start.
    StartIncoming,
    /// Start sending to the target (unless `send` is false: the source
    /// already sends), then store `running`; Failed if it cannot start.
    Send {
        uri: String,
        send: bool,
        running: Box<Migration>,
        requeue_at: Millis,
    },
    /// Ask the source to cancel its migration (a failure to is only
    /// logged: nothing waits on it), then take `then`.
    CancelThen(Box<MigrationStep>),
    /// End the waiting target, then take `then`; if it cannot be ended,
    /// retry at `retry_at`.
    EndTargetThen {
        then: Box<MigrationStep>,
        retry_at: Millis,
    },
    /// Let the paused target run: the handover is recorded.
    ResumeTarget { retry_at: Millis },
}

impl MigrationStep {
    /// Why the look after this step's is wanted, for the runtime's span.
    pub(crate) fn why(&self) -> String {
        match self {
            MigrationStep::Look(look) => format!("reading {look:?}"),
            MigrationStep::Forget => "nothing left to do".into(),
            MigrationStep::Wait { why, .. } | MigrationStep::Retry { why, .. } => why.clone(),
            MigrationStep::Record { m, .. } => {
                format!("recorded the migration {:?}", m.status.phase)
            }
            MigrationStep::Finish { m, why } => format!("recorded {:?}: {why}", m.status.phase),
            MigrationStep::StartIncoming => "started the incoming instance".into(),
            MigrationStep::Send { .. } => "sending".into(),
            MigrationStep::CancelThen(then) => format!("cancel asked; {}", then.why()),
            MigrationStep::EndTargetThen { then, .. } => {
                format!("waiting target ended; {}", then.why())
            }
            MigrationStep::ResumeTarget { .. } => "resuming the target".into(),
        }
    }
}

/// The next step for migration `m` of `vm` on node `me`.
pub(crate) fn decide(
    m: &Migration,
    vm: Option<&VirtualMachine>,
    me: &str,
    seen: &Seen,
    now: Millis,
    cfg: &LifecycleConfig,
) -> MigrationStep {
    use MigrationStep::{Look as Read, Wait};
    if m.status.phase == MigrationPhase::Failed || (m.source_node != me && m.target_node != me) {
        return MigrationStep::Forget;
    }
    let poll = Wait {
        requeue_at: now + MOVING_POLL_MS,
        why: "the migration moves".into(),
    };
    if m.status.phase == MigrationPhase::Succeeded {
        if m.target_node != me {
            return MigrationStep::Forget;
        }
        return resume_target(m, vm, seen, now, cfg, poll);
    }
    // Still wanted: the VM's eviction names it and has not given up, and
    // nobody asked for the VM to stop, restart or go away meanwhile. (The
    // VM, not an earlier one of the same name, from its current instance.)
    let wanted = vm.is_some_and(|vm| {
        vm.status.eviction.as_ref().is_some_and(|e| {
            e.migration.as_deref() == Some(m.id.as_str()) && e.phase != EvictionPhase::Fallback
        }) && m.is_from(vm)
            && vm.wants_running()
            && !vm.restart_pending()
    });
    let fail = |why: String| MigrationStep::Finish {
        m: Box::new(failed(m, &why, now)),
        why,
    };
    let succeed = |how: &str, m: &Migration| MigrationStep::Finish {
        m: Box::new(succeeded(m, now)),
        why: how.to_string(),
    };
    match m.status.phase {
        MigrationPhase::Pending if m.target_node == me => {
            let Some(source_lost) = seen.source_node_lost else {
                return Read(Look::SourceNodeLost);
            };
            if source_lost {
                return fail(format!(
                    "source node {} lost before the migration started",
                    m.source_node
                ));
            }
            if !wanted {
                return fail("no longer wanted before the target started".into());
            }
            let Some(lease_fresh) = seen.own_lease_fresh else {
                return Read(Look::OwnLease);
            };
            if !lease_fresh {
                return MigrationStep::Retry {
                    requeue_at: now + cfg.retry_ms,
                    why: "not starting the incoming instance: this node's lease is stale".into(),
                };
            }
            // The hard check, made by the node that starts the instance,
            // against every start and incoming instance it knows of (its
            // own among them): a reservation chosen from an older view
            // never overcommits this node.
            match &seen.room {
                None => Read(Look::Room),
                Some(Err(why)) => fail(format!("no room on the target: {why}")),
                Some(Ok(())) => MigrationStep::StartIncoming,
            }
        }
        MigrationPhase::Pending | MigrationPhase::TargetReady if m.source_node == me && !wanted => {
            fail("cancelled before it was sent".into())
        }
        // Never started: given up at its deadline, so the VM is not held by
        // a migration that will not happen (a target that never got ready,
        // a handoff cut short).
        MigrationPhase::Pending | MigrationPhase::TargetReady
            if m.source_node == me && now >= m.start_deadline() =>
        {
            fail(format!(
                "not started by its deadline ({}s after it was created)",
                m.start_deadline().saturating_sub(m.created_at) / 1000
            ))
        }
        MigrationPhase::TargetReady if m.source_node == me => {
            let Some(progress) = &seen.source_progress else {
                return Read(Look::SourceProgress);
            };
            // Unknown: the source is gone after it may have sent
            // everything; the Running phase settles that by the target.
            let started = matches!(
                progress,
                Ok(MigrationProgress::Active { .. }
                    | MigrationProgress::Completed { .. }
                    | MigrationProgress::Unknown { .. })
            );
            let mut running = m.clone();
            running.status.phase = MigrationPhase::Running;
            running.status.started_at = Some(now);
            let memory_mib = vm.map_or(0, |vm| vm.spec.memory_mib);
            running.status.running_deadline = Some(m.running_deadline_from(now, memory_mib));
            MigrationStep::Send {
                uri: m.status.target_uri.clone().unwrap_or_default(),
                send: !started,
                running: Box::new(running),
                requeue_at: now + MOVING_POLL_MS,
            }
        }
        MigrationPhase::Running if m.source_node == me => {
            let Some(progress) = &seen.source_progress else {
                return Read(Look::SourceProgress);
            };
            let memory_mib = vm.map_or(0, |vm| vm.spec.memory_mib);
            if let Some(why) = overdue(m, progress, wanted, memory_mib, now) {
                // The source may not answer a cancel either: tried once,
                // but the record does not wait for it. Failed is safe
                // whatever the source does next, since a target runs only
                // after a recorded success, and the source stays the VM's
                // one instance.
                return MigrationStep::CancelThen(Box::new(fail(why)));
            }
            match progress {
                Ok(MigrationProgress::Completed { downtime_ms, .. }) => {
                    let mut done = m.clone();
                    done.status.downtime_ms = *downtime_ms;
                    succeed("source handed over", &done)
                }
                Ok(MigrationProgress::Failed { reason }) => fail(reason.clone()),
                Ok(MigrationProgress::None) => fail("source reports no migration".into()),
                Ok(MigrationProgress::Active {
                    transferred_bytes,
                    total_bytes,
                    remaining_bytes,
                }) => {
                    let check = check_progress(m, memory_mib, *transferred_bytes, now);
                    let cancel = !wanted || check.is_err();
                    // Recorded, so the reason outlives this controller; the
                    // migration is Failed only once the source says it
                    // stopped (a cancel may come too late).
                    let next = match check {
                        Err(why) if m.status.message.is_none() => {
                            let mut cancelling = m.clone();
                            cancelling.status.message = Some(format!("cancelling: {why}"));
                            MigrationStep::Record {
                                m: Box::new(cancelling),
                                requeue_at: now + MOVING_POLL_MS,
                            }
                        }
                        Ok(Some(progress)) => {
                            let mut moved = m.clone();
                            moved.status.progress_bytes = Some(progress);
                            moved.status.progress_at = Some(now);
                            moved.status.progress_total_bytes = Some(*total_bytes);
                            moved.status.progress_remaining_bytes = Some(*remaining_bytes);
                            MigrationStep::Record {
                                m: Box::new(moved),
                                requeue_at: now + MOVING_POLL_MS,
                            }
                        }
                        Err(_) | Ok(None) => poll,
                    };
                    if cancel {
                        MigrationStep::CancelThen(Box::new(next))
                    } else {
                        next
                    }
                }
                // Gone before an outcome was seen: not a failure. The target
                // settles it by its state; only if it cannot (its node is
                // lost, so it never ran) is it a failure.
                Ok(MigrationProgress::Unknown { reason }) => source_gone(m, reason, seen, now, cfg),
                Err(err) if err.is_not_found() => {
                    let reason = format!("source instance {} is gone", m.source_instance);
                    source_gone(m, &reason, seen, now, cfg)
                }
                Err(err) => {
                    let retry = now + cfg.retry_ms;
                    MigrationStep::Retry {
                        requeue_at: retry.min(m.running_deadline(memory_mib).max(now + 1)),
                        why: format!("migration status unknown: {}", crate::error_chain(err)),
                    }
                }
            }
        }
        // The target knows best whether the handover happened: its guest
        // runs only once the whole state has arrived. This also settles a
        // migration whose source node was lost mid-way.
        MigrationPhase::TargetReady | MigrationPhase::Running if m.target_node == me => {
            let Some(state) = &seen.target_state else {
                return Read(Look::TargetState);
            };
            match state {
                // Only a target started by a Keel that let targets run on
                // arrival: the handover happened.
                Ok(DomainState::Running) => succeed("target runs", m),
                // The whole state is here, and the target waits. While the
                // source lives, its outcome decides; once it is gone (seen
                // gone by its agent, or its node lost and so fenced)
                // nothing else can run the guest.
                Ok(DomainState::Paused) => {
                    let source_gone = match (m.status.source_gone_at, seen.source_node_lost) {
                        (Some(_), _) => true,
                        (None, Some(lost)) => lost,
                        (None, None) => return Read(Look::SourceNodeLost),
                    };
                    if source_gone {
                        succeed("the target holds the whole state and the source is gone", m)
                    } else {
                        poll
                    }
                }
                Ok(state) if state.is_exited() => fail("target ended before the handover".into()),
                Err(err) if err.is_not_found() => fail("target instance is gone".into()),
                Ok(_) => {
                    // Still waiting for the state, and the source's node is
                    // lost (fenced): the rest will never come, and this
                    // target never ran. Ended first: a waiting target must
                    // never be taken for the VM's instance once the VM
                    // moves on.
                    match seen.source_node_lost {
                        None => Read(Look::SourceNodeLost),
                        Some(true) => MigrationStep::EndTargetThen {
                            then: Box::new(fail(format!(
                                "source node {} lost before the whole state arrived",
                                m.source_node
                            ))),
                            retry_at: now + cfg.retry_ms,
                        },
                        Some(false) => poll,
                    }
                }
                Err(_) => poll,
            }
        }
        // Waiting for the other side.
        MigrationPhase::Pending
        | MigrationPhase::TargetReady
        | MigrationPhase::Running
        | MigrationPhase::Succeeded
        | MigrationPhase::Failed => Wait {
            requeue_at: now + cfg.poll_ms,
            why: "waiting for the other side".into(),
        },
    }
}

/// The source instance is gone without an outcome. If the target's node is
/// lost too, the target never ran (it runs only after a recorded success)
/// and is fenced: a failure. Otherwise the fact is recorded for the target
/// to settle.
fn source_gone(
    m: &Migration,
    reason: &str,
    seen: &Seen,
    now: Millis,
    cfg: &LifecycleConfig,
) -> MigrationStep {
    let Some(target_lost) = seen.target_node_lost else {
        return MigrationStep::Look(Look::TargetNodeLost);
    };
    if target_lost {
        let why = format!("{reason}, and target node {} is lost", m.target_node);
        return MigrationStep::Finish {
            m: Box::new(failed(m, &why, now)),
            why,
        };
    }
    if m.status.source_gone_at.is_some() {
        return MigrationStep::Wait {
            requeue_at: now + cfg.poll_ms,
            why: "the source is gone; the target settles it".into(),
        };
    }
    let mut gone = m.clone();
    gone.status.source_gone_at = Some(now);
    gone.status.message = Some(format!("{reason}; the target's state settles it"));
    MigrationStep::Record {
        m: Box::new(gone),
        requeue_at: now,
    }
}

/// The target of a recorded success: it runs once the VM record names it
/// too (the handover is on the VM as well). While the record still names
/// the source, the handover is being written; if it names neither, the VM
/// moved on and garbage collection ends this target.
fn resume_target(
    m: &Migration,
    vm: Option<&VirtualMachine>,
    seen: &Seen,
    now: Millis,
    cfg: &LifecycleConfig,
    poll: MigrationStep,
) -> MigrationStep {
    match vm.and_then(|v| v.status.instance.as_ref()) {
        Some(i) if i.id == m.target_instance => {}
        Some(i) if i.id == m.source_instance => return poll,
        _ => return MigrationStep::Forget,
    }
    let Some(state) = &seen.target_state else {
        return MigrationStep::Look(Look::TargetState);
    };
    match state {
        Ok(DomainState::Paused) => MigrationStep::ResumeTarget {
            retry_at: now + cfg.retry_ms,
        },
        Ok(DomainState::Starting) => poll,
        // Running already, or gone (the VM controller sees to that).
        Ok(_) => MigrationStep::Forget,
        Err(err) if err.is_not_found() => MigrationStep::Forget,
        Err(err) => MigrationStep::Retry {
            requeue_at: now + cfg.retry_ms,
            why: format!("cannot see the target: {}", crate::error_chain(err)),
        },
    }
}

/// `m`, recorded as succeeded at `now`.
pub(crate) fn succeeded(m: &Migration, now: Millis) -> Migration {
    let mut m = m.clone();
    m.status.phase = MigrationPhase::Succeeded;
    m.status.finished_at = Some(now);
    m
}

/// `m`, recorded as failed at `now` for `why`; a cancel for a timeout
/// recorded before keeps its reason first.
pub(crate) fn failed(m: &Migration, why: &str, now: Millis) -> Migration {
    let mut m = m.clone();
    m.status.phase = MigrationPhase::Failed;
    m.status.finished_at = Some(now);
    m.status.message = Some(match m.status.message.as_deref() {
        Some(cancelling) if cancelling.starts_with("cancelling: ") => {
            format!("{} ({why})", &cancelling["cancelling: ".len()..])
        }
        _ => why.to_string(),
    });
    m
}

/// Why a migration sending from this node's source must be failed now
/// without waiting for the source to report it stopped, or `None`. A
/// completed one never is (a migration that succeeds late is still taken),
/// nor one whose source is gone (the target's state settles it).
///
/// - Past its running deadline, whatever the source says: a cancel that
///   never takes, or a source that never answers, holds the VM no longer.
/// - The source does not answer and nobody wants the migration any more
///   (the VM is to stop, restart or go): it could not be cancelled anyway,
///   and the stop the user asked for waits on it.
/// - The source does not answer and nothing new was seen sent for the
///   progress timeout: the progress timeout, without the source's word.
pub(crate) fn overdue(
    m: &Migration,
    progress: &Result<MigrationProgress, HvError>,
    wanted: bool,
    memory_mib: u64,
    now: Millis,
) -> Option<String> {
    let unanswered = match progress {
        Ok(MigrationProgress::Completed { .. } | MigrationProgress::Unknown { .. }) => return None,
        Err(err) if err.is_not_found() => return None,
        Err(err) => Some(err),
        Ok(_) => None,
    };
    let deadline = m.running_deadline(memory_mib);
    let started = m.status.started_at.unwrap_or(m.created_at);
    let last_word = unanswered.map_or_else(String::new, |err| {
        format!("; the source: {}", crate::error_chain(err))
    });
    if now >= deadline {
        return Some(format!(
            "not finished by its deadline ({}s after it began sending){last_word}",
            deadline.saturating_sub(started) / 1000
        ));
    }
    let err = crate::error_chain(unanswered?);
    if !wanted {
        return Some(format!(
            "no longer wanted, and the source does not answer to cancel it: {err}"
        ));
    }
    let last_at = m.status.progress_at.unwrap_or(started);
    let timeout_ms = m.tuning.progress_timeout_s.saturating_mul(1000);
    (now.saturating_sub(last_at) >= timeout_ms).then(|| {
        format!(
            "no progress seen for {}s: the source does not answer: {err}",
            m.tuning.progress_timeout_s
        )
    })
}

/// A migration under way, `transferred` bytes sent so far, against its
/// tuning: `Err(why)` when it must be cancelled (it ran past its
/// completion timeout for `memory_mib` of guest memory, or sent nothing
/// new for the progress timeout); `Ok(Some(bytes))` when new progress is
/// to be recorded; `Ok(None)` otherwise.
pub(crate) fn check_progress(
    m: &Migration,
    memory_mib: u64,
    transferred: u64,
    now: Millis,
) -> Result<Option<u64>, String> {
    let t = &m.tuning;
    let started = m.status.started_at.unwrap_or(m.created_at);
    let limit = t.completion_timeout_ms(memory_mib);
    if now.saturating_sub(started) >= limit {
        return Err(format!(
            "not completed within {}s ({}s per GiB of {memory_mib} MiB)",
            limit / 1000,
            t.completion_timeout_per_gib_s
        ));
    }
    let last_at = m.status.progress_at.unwrap_or(started);
    let grew = transferred > m.status.progress_bytes.unwrap_or(0);
    if grew {
        let due = m.status.progress_at.is_none() || now >= last_at + PROGRESS_RECORD_MS;
        return Ok(due.then_some(transferred));
    }
    if now.saturating_sub(last_at) >= t.progress_timeout_s * 1000 {
        return Err(format!(
            "no progress for {}s ({} bytes sent)",
            t.progress_timeout_s, transferred
        ));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{Eviction, Instance, MigrationStatus, MigrationTuning, RunPolicy, VmSpec};
    use keel_hv::ExitCause;

    const T0: Millis = 1_000_000;

    fn migration(phase: MigrationPhase) -> Migration {
        Migration {
            id: "vm-m1".into(),
            vm_uid: String::new(),
            vm: "vm".into(),
            source_node: "a".into(),
            source_instance: "vm-1".into(),
            target_node: "b".into(),
            target_instance: "vm-2".into(),
            created_at: T0 - 1_000,
            tuning: MigrationTuning::default(),
            status: MigrationStatus {
                phase,
                started_at: (phase == MigrationPhase::Running).then_some(T0 - 500),
                target_uri: Some("tcp:b:4444".into()),
                ..Default::default()
            },
        }
    }

    /// The VM on instance `vm-1`, its eviction naming the migration (when
    /// `wanted`) or no migration at all.
    fn vm(wanted: bool, instance: &str) -> VirtualMachine {
        let mut vm = VirtualMachine::new(
            "vm",
            VmSpec {
                memory_mib: 2048,
                disks: vec![],
                run_policy: RunPolicy::AlwaysOn,
                ..keel_testkit::spec::vm_spec()
            },
        );
        vm.status.instance = Some(Instance::new(instance, "a", T0 - 10_000));
        let mut eviction = Eviction::submitting(T0 - 2_000, T0 - 2_000, None, false);
        eviction.phase = EvictionPhase::Migrating;
        eviction.migration = wanted.then(|| "vm-m1".to_string());
        vm.status.eviction = Some(eviction);
        vm
    }

    /// What a step does, as far as the table below cares.
    fn outcome(step: &MigrationStep) -> String {
        match step {
            MigrationStep::Look(look) => format!("look {look:?}"),
            MigrationStep::Forget => "forget".into(),
            MigrationStep::Wait { requeue_at, .. } => format!("wait +{}", requeue_at - T0),
            MigrationStep::Retry { requeue_at, .. } => format!("retry +{}", requeue_at - T0),
            MigrationStep::Record { m, .. } => format!("record {:?}", m.status.phase),
            MigrationStep::Finish { m, why } => format!("{:?}: {why}", m.status.phase),
            MigrationStep::StartIncoming => "start incoming".into(),
            MigrationStep::Send { send, .. } => format!("send {send}"),
            MigrationStep::CancelThen(then) => format!("cancel, {}", outcome(then)),
            MigrationStep::EndTargetThen { then, .. } => format!("end target, {}", outcome(then)),
            MigrationStep::ResumeTarget { .. } => "resume target".into(),
        }
    }

    fn active(transferred: u64) -> Result<MigrationProgress, HvError> {
        Ok(MigrationProgress::Active {
            transferred_bytes: transferred,
            total_bytes: 100,
            remaining_bytes: 100 - transferred,
        })
    }

    fn gone(instance: &str) -> HvError {
        HvError::NotFound {
            instance: instance.into(),
        }
    }

    fn unanswered() -> HvError {
        HvError::Unavailable {
            instance: "vm-1".into(),
            op: "query-migrate",
            reason: "monitor hung".into(),
            source: None,
        }
    }

    /// Node × phase × the VM × what was seen → the step.
    #[test]
    fn migration_table() {
        use MigrationPhase::{Failed, Pending, Running, Succeeded, TargetReady};
        let cfg = LifecycleConfig::default();
        let seen = |f: fn(&mut Seen)| {
            let mut s = Seen::default();
            f(&mut s);
            s
        };
        let wanted = Some(vm(true, "vm-1"));
        let unwanted = Some(vm(false, "vm-1"));
        let moved = Some(vm(true, "vm-2"));
        #[rustfmt::skip]
        let cases: Vec<(&str, MigrationPhase, Option<VirtualMachine>, Seen, &str)> = vec![
            ("c", Pending, wanted.clone(), Seen::default(), "forget"),
            ("b", Failed, wanted.clone(), Seen::default(), "forget"),
            // The target starts the incoming instance.
            ("b", Pending, wanted.clone(), Seen::default(), "look SourceNodeLost"),
            ("b", Pending, wanted.clone(), seen(|s| s.source_node_lost = Some(true)),
                "Failed: source node a lost before the migration started"),
            ("b", Pending, unwanted.clone(), seen(|s| s.source_node_lost = Some(false)),
                "Failed: no longer wanted before the target started"),
            ("b", Pending, None, seen(|s| s.source_node_lost = Some(false)),
                "Failed: no longer wanted before the target started"),
            ("b", Pending, wanted.clone(), seen(|s| s.source_node_lost = Some(false)), "look OwnLease"),
            ("b", Pending, wanted.clone(),
                seen(|s| { s.source_node_lost = Some(false); s.own_lease_fresh = Some(false) }),
                "retry +1000"),
            ("b", Pending, wanted.clone(),
                seen(|s| { s.source_node_lost = Some(false); s.own_lease_fresh = Some(true) }),
                "look Room"),
            ("b", Pending, wanted.clone(),
                seen(|s| { s.source_node_lost = Some(false); s.own_lease_fresh = Some(true); s.room = Some(Err("full".into())) }),
                "Failed: no room on the target: full"),
            ("b", Pending, wanted.clone(),
                seen(|s| { s.source_node_lost = Some(false); s.own_lease_fresh = Some(true); s.room = Some(Ok(())) }),
                "start incoming"),
            // The source waits for the target, sends, follows.
            ("a", Pending, wanted.clone(), Seen::default(), "wait +2000"),
            ("a", Pending, unwanted.clone(), Seen::default(), "Failed: cancelled before it was sent"),
            ("a", TargetReady, moved.clone(), Seen::default(), "Failed: cancelled before it was sent"),
            ("a", TargetReady, wanted.clone(), Seen::default(), "look SourceProgress"),
            ("a", TargetReady, wanted.clone(), seen(|s| s.source_progress = Some(Ok(MigrationProgress::None))), "send true"),
            ("a", TargetReady, wanted.clone(), seen(|s| s.source_progress = Some(active(1))), "send false"),
            ("a", Running, wanted.clone(), Seen::default(), "look SourceProgress"),
            ("a", Running, wanted.clone(), seen(|s| s.source_progress = Some(active(10))), "record Running"),
            ("a", Running, unwanted.clone(), seen(|s| s.source_progress = Some(active(10))), "cancel, record Running"),
            ("a", Running, wanted.clone(), seen(|s| s.source_progress = Some(active(0))), "wait +500"),
            ("a", Running, wanted.clone(),
                seen(|s| s.source_progress = Some(Ok(MigrationProgress::Completed { downtime_ms: Some(30), total_ms: 900 }))),
                "Succeeded: source handed over"),
            ("a", Running, wanted.clone(),
                seen(|s| s.source_progress = Some(Ok(MigrationProgress::Failed { reason: "socket closed".into() }))),
                "Failed: socket closed"),
            ("a", Running, wanted.clone(), seen(|s| s.source_progress = Some(Ok(MigrationProgress::None))),
                "Failed: source reports no migration"),
            ("a", Running, wanted.clone(), seen(|s| s.source_progress = Some(Err(unanswered()))), "retry +1000"),
            ("a", Running, unwanted.clone(), seen(|s| s.source_progress = Some(Err(unanswered()))),
                "cancel, Failed: no longer wanted, and the source does not answer to cancel it: domain vm-1: hypervisor unavailable during query-migrate: monitor hung"),
            // The source gone without an outcome: the target settles it.
            ("a", Running, wanted.clone(), seen(|s| s.source_progress = Some(Err(gone("vm-1")))), "look TargetNodeLost"),
            ("a", Running, wanted.clone(),
                seen(|s| { s.source_progress = Some(Err(gone("vm-1"))); s.target_node_lost = Some(false) }),
                "record Running"),
            ("a", Running, wanted.clone(),
                seen(|s| { s.source_progress = Some(Ok(MigrationProgress::Unknown { reason: "qemu gone".into() })); s.target_node_lost = Some(true) }),
                "Failed: qemu gone, and target node b is lost"),
            // The target judges by its own state.
            ("b", Running, wanted.clone(), Seen::default(), "look TargetState"),
            ("b", Running, wanted.clone(), seen(|s| s.target_state = Some(Ok(DomainState::Running))), "Succeeded: target runs"),
            ("b", TargetReady, wanted.clone(), seen(|s| s.target_state = Some(Ok(DomainState::Paused))), "look SourceNodeLost"),
            ("b", Running, wanted.clone(),
                seen(|s| { s.target_state = Some(Ok(DomainState::Paused)); s.source_node_lost = Some(false) }),
                "wait +500"),
            ("b", Running, wanted.clone(),
                seen(|s| { s.target_state = Some(Ok(DomainState::Paused)); s.source_node_lost = Some(true) }),
                "Succeeded: the target holds the whole state and the source is gone"),
            ("b", Running, wanted.clone(), seen(|s| s.target_state = Some(Ok(DomainState::Exited(ExitCause::Crashed)))),
                "Failed: target ended before the handover"),
            ("b", Running, wanted.clone(), seen(|s| s.target_state = Some(Err(gone("vm-2")))), "Failed: target instance is gone"),
            ("b", Running, wanted.clone(), seen(|s| s.target_state = Some(Err(unanswered()))), "wait +500"),
            ("b", Running, wanted.clone(),
                seen(|s| { s.target_state = Some(Ok(DomainState::Starting)); s.source_node_lost = Some(false) }),
                "wait +500"),
            ("b", Running, wanted.clone(),
                seen(|s| { s.target_state = Some(Ok(DomainState::Starting)); s.source_node_lost = Some(true) }),
                "end target, Failed: source node a lost before the whole state arrived"),
            // After the recorded success: resumed once the VM names it.
            ("a", Succeeded, moved.clone(), Seen::default(), "forget"),
            ("b", Succeeded, wanted.clone(), Seen::default(), "wait +500"),
            ("b", Succeeded, Some(vm(true, "vm-9")), Seen::default(), "forget"),
            ("b", Succeeded, moved.clone(), Seen::default(), "look TargetState"),
            ("b", Succeeded, moved.clone(), seen(|s| s.target_state = Some(Ok(DomainState::Paused))), "resume target"),
            ("b", Succeeded, moved.clone(), seen(|s| s.target_state = Some(Ok(DomainState::Starting))), "wait +500"),
            ("b", Succeeded, moved.clone(), seen(|s| s.target_state = Some(Ok(DomainState::Running))), "forget"),
            ("b", Succeeded, moved.clone(), seen(|s| s.target_state = Some(Err(unanswered()))), "retry +1000"),
        ];
        for (me, phase, vm, seen, expected) in cases {
            let step = decide(&migration(phase), vm.as_ref(), me, &seen, T0, &cfg);
            assert_eq!(outcome(&step), expected, "on {me}, {phase:?}, {seen:?}");
        }
    }

    #[test]
    fn a_source_not_started_by_its_deadline_is_failed() {
        let cfg = LifecycleConfig::default();
        let m = migration(MigrationPhase::TargetReady);
        let late = m.start_deadline();
        let step = decide(
            &m,
            Some(&vm(true, "vm-1")),
            "a",
            &Seen::default(),
            late,
            &cfg,
        );
        let MigrationStep::Finish { m: failed, why } = step else {
            panic!("{step:?}");
        };
        assert_eq!(failed.status.phase, MigrationPhase::Failed);
        assert!(why.starts_with("not started by its deadline"), "{why}");
    }

    #[test]
    fn a_failure_after_a_cancel_for_a_timeout_names_the_timeout_first() {
        let mut m = migration(MigrationPhase::Running);
        m.status.message = Some("cancelling: no progress for 150s".into());
        let done = failed(&m, "source reports no migration", T0);
        assert_eq!(
            done.status.message.as_deref(),
            Some("no progress for 150s (source reports no migration)")
        );
        assert_eq!(done.status.finished_at, Some(T0));
    }

    #[test]
    fn completion_and_progress_timeouts() {
        let t0 = T0;
        let m = |progress: Option<(u64, Millis)>| Migration {
            status: MigrationStatus {
                phase: MigrationPhase::Running,
                started_at: Some(t0),
                progress_bytes: progress.map(|p| p.0),
                progress_at: progress.map(|p| p.1),
                ..Default::default()
            },
            ..migration(MigrationPhase::Running)
        };
        // (recorded progress, memory MiB, bytes sent, now) → outcome
        let cases = [
            (None, 2048, 10, t0 + 1_000, Ok(Some(10))),
            (Some((10, t0 + 1_000)), 2048, 20, t0 + 3_000, Ok(None)),
            (Some((10, t0 + 1_000)), 2048, 20, t0 + 6_000, Ok(Some(20))),
            (Some((10, t0 + 1_000)), 2048, 10, t0 + 150_999, Ok(None)),
            (
                Some((10, t0 + 1_000)),
                2048,
                10,
                t0 + 151_000,
                Err("no progress for 150s"),
            ),
            (
                Some((10, t0 + 290_000)),
                2048,
                20,
                t0 + 299_999,
                Ok(Some(20)),
            ),
            (
                Some((10, t0 + 290_000)),
                2048,
                20,
                t0 + 300_000,
                Err("not completed within 300s"),
            ),
            (
                Some((10, t0 + 140_000)),
                512,
                20,
                t0 + 150_000,
                Err("not completed within 150s"),
            ),
        ];
        for (progress, memory, sent, now, expected) in cases {
            let got = check_progress(&m(progress), memory, sent, now);
            match (&got, &expected) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{progress:?} {sent} at +{}", now - t0),
                (Err(why), Err(start)) => assert!(why.starts_with(start), "{why}"),
                _ => panic!("{progress:?} {sent} at +{}: {got:?}", now - t0),
            }
        }
    }
}
