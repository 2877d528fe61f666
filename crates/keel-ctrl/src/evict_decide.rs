//! Moving a running VM off a draining node, as a pure function.
//!
//! Migration first, in two bounded windows (submission, then the migration
//! itself), then the fallback: graceful stop here (forced at the end of the
//! fallback window) and a start elsewhere per run policy. The deadlines are
//! on the VM record, so a restarted controller resumes the same windows; a
//! missing or impossible deadline counts as expired. A migration that
//! succeeds is honoured whenever it is seen, even after its window. A
//! migration is reserved on the record (id and target instance) before it
//! is created, and created only if absent: once per attempt.

use keel_api::{
    Eviction, EvictionPhase, Instance, Migration, MigrationPhase, MigrationTuning, Millis,
    StopReason, VirtualMachine,
};
use keel_hv::DomainState;

use crate::config::LifecycleConfig;
use crate::handover::{migrated, no_target, reserve_and_create};
use crate::step::{backoff, persist_if_changed, Step};
use crate::stop::begin_stop;
use crate::view::ClusterView;

/// `None`: the node is not draining, carry on as usual.
pub(crate) fn decide_eviction(
    vm: &VirtualMachine,
    inst: &Instance,
    state: DomainState,
    cluster: &ClusterView,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Option<Step> {
    let Some(drain) = cluster.drain.as_ref() else {
        return drop_called_off(vm, cluster, now);
    };
    let windows = drain.windows;
    let ev = match &vm.status.eviction {
        Some(ev) if ev.drain_requested_at == drain.requested_at => ev,
        // Absent, or left by an earlier drain (a stale failure included):
        // a new attempt with fresh windows.
        _ => {
            let mut next = vm.clone();
            next.status.eviction = Some(Eviction::submitting(
                drain.requested_at,
                now,
                Some(now + windows.submit_ms),
                false,
            ));
            return Some(Step::Persist {
                vm: Box::new(next),
                then: None,
                requeue_at: now,
            });
        }
    };
    let migration = cluster
        .migration
        .as_ref()
        .filter(|m| ev.migration.as_deref() == Some(m.id.as_str()));
    if let Some(m) = migration {
        if m.status.phase == MigrationPhase::Succeeded && m.is_from(vm) {
            return Some(adopt_target(vm, m, now));
        }
    }
    let expired = |deadline: Option<Millis>| deadline.is_none_or(|d| now >= d || d < ev.started_at);
    let poll_at =
        |deadline: Option<Millis>| deadline.map_or(now, |d| d.min(now + cfg.poll_ms).max(now + 1));
    let poll = |deadline: Option<Millis>| Step::Wait {
        requeue_at: poll_at(deadline),
    };
    let step = match ev.phase {
        EvictionPhase::Submitting => match migration.map(|m| m.status.phase) {
            Some(MigrationPhase::Running) => {
                let mut next = vm.clone();
                let e = next.status.eviction.as_mut().expect("cloned");
                e.phase = EvictionPhase::Migrating;
                e.migrate_deadline = Some(now + windows.migrate_ms);
                Step::Persist {
                    vm: Box::new(next),
                    then: None,
                    requeue_at: now,
                }
            }
            _ if expired(ev.submit_deadline) => {
                fallback(vm, "submission window expired", now, windows.fallback_ms)
            }
            Some(MigrationPhase::Failed) => retry(vm, migration, now, cfg),
            Some(_) => poll(ev.submit_deadline),
            // Backing off after a failed attempt.
            None if ev.migration.is_none() && ev.next_attempt_at.is_some_and(|at| at > now) => {
                let at = ev.next_attempt_at.unwrap_or(now);
                Step::Wait {
                    requeue_at: ev.submit_deadline.map_or(at, |d| d.min(at)),
                }
            }
            None => match &ev.migration {
                // Reserved, but the record was not created (a crash in
                // between): create it now, from the reservation, once the
                // source runs (a restart meanwhile may still be booting).
                Some(_) if state != DomainState::Running => poll(ev.submit_deadline),
                Some(_) => match cluster.targets.first() {
                    Some(target) => reserve_and_create(vm, inst, target, cluster, now),
                    None => fallback(vm, &no_target(cluster), now, windows.fallback_ms),
                },
                None if state != DomainState::Running => poll(ev.submit_deadline),
                // No target could take the TPM's state (`qemu::tpm`): the
                // stop and start elsewhere at once, not after failed tries.
                None if inst.started_with.as_ref().is_some_and(|s| s.tpm) => fallback(
                    vm,
                    "the VM has a TPM, whose state a live migration cannot carry",
                    now,
                    windows.fallback_ms,
                ),
                None if cluster.targets.is_empty() => {
                    fallback(vm, &no_target(cluster), now, windows.fallback_ms)
                }
                // The target is launched with the instance's disks, which
                // are in flux until the plug or unplug ends (within the
                // submission window, which bounds a guest that never lets
                // go of a disk).
                None if inst.disk_change_under_way().is_some() => {
                    let change = inst.disk_change_under_way().unwrap_or_default();
                    let mut next = vm.clone();
                    let e = next.status.eviction.as_mut().expect("cloned");
                    e.message = Some(format!("waiting for {change} to finish"));
                    persist_if_changed(vm, next, None, poll_at(ev.submit_deadline))
                }
                None => match free_target(inst, cluster, &drain.tuning) {
                    Ok(target) => reserve_and_create(vm, inst, &target, cluster, now),
                    // Every slot is taken: wait (within the submission
                    // window) for one to free up.
                    Err(why) => {
                        let mut next = vm.clone();
                        let e = next.status.eviction.as_mut().expect("cloned");
                        e.message = Some(format!("waiting for a migration slot: {why}"));
                        persist_if_changed(vm, next, None, poll_at(ev.submit_deadline))
                    }
                },
            },
        },
        EvictionPhase::Migrating => match migration.map(|m| m.status.phase) {
            Some(MigrationPhase::Failed) if !expired(ev.submit_deadline) => {
                retry(vm, migration, now, cfg)
            }
            Some(MigrationPhase::Failed) => {
                fallback(vm, "migration failed", now, windows.fallback_ms)
            }
            None => fallback(vm, "migration record missing", now, windows.fallback_ms),
            _ if expired(ev.migrate_deadline) => {
                fallback(vm, "migration window expired", now, windows.fallback_ms)
            }
            _ => poll(ev.migrate_deadline),
        },
        EvictionPhase::Fallback => match migration {
            // Still being cancelled by the migration controller; stopping
            // the source under a running migration could hand over a guest
            // that is powering off.
            Some(m) if !m.status.phase.is_final() => Step::Wait {
                requeue_at: now + cfg.retry_ms,
            },
            _ => begin_stop(vm.clone(), inst, StopReason::Evict, now, cfg),
        },
    };
    Some(step)
}

/// The node no longer drains (the drain was called off) and the record
/// still carries the drain's eviction, submitting or migrating: with its
/// migration never created or ended without success, the eviction is
/// dropped, or its reserved target would hold that node's room (and its
/// anti-affinity group) for good. A migration still under way is seen
/// through first (`decide` honours its success); a fallback stop runs on.
fn drop_called_off(vm: &VirtualMachine, cluster: &ClusterView, now: Millis) -> Option<Step> {
    let ev = vm.status.eviction.as_ref().filter(|e| !e.user)?;
    if !matches!(
        ev.phase,
        EvictionPhase::Submitting | EvictionPhase::Migrating
    ) {
        return None;
    }
    let migration = cluster
        .migration
        .as_ref()
        .filter(|m| ev.migration.as_deref() == Some(m.id.as_str()));
    if migration.is_some_and(|m| m.status.phase != MigrationPhase::Failed) {
        return None;
    }
    let mut next = vm.clone();
    next.status.eviction = None;
    Some(Step::Persist {
        vm: Box::new(next),
        then: None,
        requeue_at: now,
    })
}

/// The target runs the guest now: it becomes the VM's instance.
fn adopt_target(vm: &VirtualMachine, m: &Migration, now: Millis) -> Step {
    Step::Persist {
        vm: Box::new(migrated(vm, m, now)),
        then: None,
        requeue_at: now,
    }
}

fn fallback(vm: &VirtualMachine, why: &str, now: Millis, fallback_ms: Millis) -> Step {
    let mut next = vm.clone();
    let e = next.status.eviction.as_mut().expect("eviction present");
    e.phase = EvictionPhase::Fallback;
    e.fallback_deadline = Some(now + fallback_ms);
    e.message = Some(format!("falling back to stop and start elsewhere: {why}"));
    tracing::info!(vm = %vm.name, why, "eviction falls back to stop");
    Step::Persist {
        vm: Box::new(next),
        then: None,
        requeue_at: now,
    }
}

/// The attempt failed within the submission window: a new attempt, with a
/// new migration (the failed one is never reused), after a backoff (the
/// start backoff: 1, 2, 4 … s, capped), so a target that fails at once is
/// not tried back to back for the whole window.
fn retry(
    vm: &VirtualMachine,
    failed: Option<&Migration>,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Step {
    let mut next = vm.clone();
    let e = next.status.eviction.as_mut().expect("eviction present");
    let wait = backoff(
        cfg.start_backoff_initial_ms,
        cfg.start_backoff_max_ms,
        e.failed_attempts,
    );
    e.failed_attempts += 1;
    e.next_attempt_at = Some(now + wait);
    e.phase = EvictionPhase::Submitting;
    e.migration = None;
    e.migration_source = None;
    e.migration_target = None;
    e.migrate_deadline = None;
    e.message = failed.map(|m| {
        format!(
            "migration {} failed: {}; next attempt in {}s",
            m.id,
            m.status.message.as_deref().unwrap_or("no reason given"),
            wait.div_ceil(1000)
        )
    });
    Step::Persist {
        vm: Box::new(next),
        then: None,
        requeue_at: now,
    }
}

/// The best target with a free slot under the drain's limits on parallel
/// migrations (cluster-wide, and per node for the source and the target),
/// or why there is none. Migrations of this VM do not count (a reserved
/// one is this very attempt). The limits hold as far as agents see each
/// other's migrations: two agents deciding at the same moment may each
/// take the last slot.
fn free_target(
    inst: &Instance,
    cluster: &ClusterView,
    tuning: &MigrationTuning,
) -> Result<String, String> {
    let others: Vec<&Migration> = cluster
        .in_flight
        .iter()
        .filter(|m| !m.status.phase.is_final() && m.source_instance != inst.id)
        .collect();
    let per_cluster = tuning.parallel_per_cluster as usize;
    let per_node = tuning.parallel_per_node as usize;
    if others.len() >= per_cluster {
        return Err(format!(
            "{} of {per_cluster} migrations in flight in the cluster",
            others.len()
        ));
    }
    let on = |node: &str| {
        others
            .iter()
            .filter(|m| m.source_node == node || m.target_node == node)
            .count()
    };
    let here = on(&inst.node);
    if here >= per_node {
        return Err(format!(
            "{here} of {per_node} migrations in flight on node {}",
            inst.node
        ));
    }
    cluster
        .targets
        .iter()
        .find(|t| on(t) < per_node)
        .cloned()
        .ok_or_else(|| format!("every target node has {per_node} migrations in flight"))
}

/// How many final (succeeded or failed) migration records of a VM are kept
/// for `keel migration list`; older ones are deleted.
pub const KEEP_FINAL_MIGRATIONS: usize = 3;

/// The ids of `vm_name`'s migration records that can be deleted: final
/// ones beyond the newest `KEEP_FINAL_MIGRATIONS`. Never one still in
/// flight, one the VM's eviction names, or one from the VM's recorded
/// instance (a succeeded one is still to be adopted, and lost-node
/// takeover and stray-domain collection look at it). `vm` is `None` once
/// the record is gone: then every final one goes.
pub fn migrations_to_collect(vm: Option<&VirtualMachine>, migrations: &[Migration]) -> Vec<String> {
    let keep = if vm.is_some() {
        KEEP_FINAL_MIGRATIONS
    } else {
        0
    };
    let named = vm
        .and_then(|v| v.status.eviction.as_ref())
        .and_then(|e| e.migration.as_deref());
    let recorded = vm
        .and_then(|v| v.status.instance.as_ref())
        .map(|i| i.id.as_str());
    let mut done: Vec<&Migration> = migrations
        .iter()
        .filter(|m| m.status.phase.is_final())
        .collect();
    // Newest first: ids are `<vm>-m<seq>`, seq counting up per VM.
    done.sort_by_key(|m| std::cmp::Reverse((seq_of(&m.id), m.created_at)));
    done.into_iter()
        .skip(keep)
        .filter(|m| Some(m.id.as_str()) != named && Some(m.source_instance.as_str()) != recorded)
        .map(|m| m.id.clone())
        .collect()
}

fn seq_of(id: &str) -> u64 {
    id.rsplit_once("-m")
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::HvAction;
    use keel_api::MigrationStatus;
    use keel_api::{Drain, RunPolicy, VmSpec};

    fn migration(seq: u64, phase: MigrationPhase, source: &str) -> Migration {
        Migration {
            id: format!("vm-m{seq}"),
            vm_uid: String::new(),
            vm: "vm".into(),
            source_node: "a".into(),
            source_instance: source.into(),
            target_node: "b".into(),
            target_instance: format!("vm-t{seq}"),
            created_at: seq,
            tuning: MigrationTuning::default(),
            status: MigrationStatus {
                phase,
                ..Default::default()
            },
        }
    }

    /// What `decide_eviction` did, as far as the table below cares.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Outcome {
        /// The target became the instance; the eviction is over.
        Adopt,
        ToMigrating,
        ToFallback,
        /// A new attempt after a backoff, the failed migration dropped.
        Retry,
        /// The reserved migration record is (re)created.
        Create,
        /// The graceful stop of the fallback begins.
        Stop,
        Wait,
    }

    fn outcome(before: &VirtualMachine, step: &Step) -> Outcome {
        let (next, then) = match step {
            Step::Wait { .. } => return Outcome::Wait,
            Step::Persist { vm, then, .. } => (vm, then),
            other => panic!("unexpected step {other:?}"),
        };
        let was = before.status.eviction.as_ref().expect("evicting").phase;
        match (then, &next.status.eviction) {
            (Some(HvAction::CreateMigration(_)), _) => Outcome::Create,
            (Some(HvAction::Shutdown(_)), _) => Outcome::Stop,
            (None, None) if next.status.instance.as_ref().unwrap().id == "vm-t1" => Outcome::Adopt,
            (None, Some(e)) if e.phase == EvictionPhase::Migrating && was != e.phase => {
                Outcome::ToMigrating
            }
            (None, Some(e)) if e.phase == EvictionPhase::Fallback && was != e.phase => {
                Outcome::ToFallback
            }
            (None, Some(e)) if e.failed_attempts == 1 && e.migration.is_none() => Outcome::Retry,
            _ => panic!("unclassified step {step:?}"),
        }
    }

    /// Eviction phase × the migration record's phase (`None`: the record
    /// it reserved is missing) × whether its windows have expired.
    #[test]
    fn eviction_table() {
        use EvictionPhase::{Fallback, Migrating, Submitting};
        use MigrationPhase::{Failed, Pending, Running, Succeeded, TargetReady};
        use Outcome::*;
        let mut expected: Vec<(EvictionPhase, Option<MigrationPhase>, bool, Outcome)> = vec![];
        for phase in EvictionPhase::ALL {
            for expired in [false, true] {
                // A succeeded migration is honoured in every phase, in time or not.
                expected.push((phase, Some(Succeeded), expired, Adopt));
            }
        }
        expected.extend([
            (Submitting, None, false, Create),
            (Submitting, None, true, ToFallback),
            (Submitting, Some(Pending), false, Wait),
            (Submitting, Some(Pending), true, ToFallback),
            (Submitting, Some(TargetReady), false, Wait),
            (Submitting, Some(TargetReady), true, ToFallback),
            // Sending already: the migration window takes over.
            (Submitting, Some(Running), false, ToMigrating),
            (Submitting, Some(Running), true, ToMigrating),
            (Submitting, Some(Failed), false, Retry),
            (Submitting, Some(Failed), true, ToFallback),
            (Migrating, None, false, ToFallback),
            (Migrating, None, true, ToFallback),
            (Migrating, Some(Pending), false, Wait),
            (Migrating, Some(Pending), true, ToFallback),
            (Migrating, Some(TargetReady), false, Wait),
            (Migrating, Some(TargetReady), true, ToFallback),
            (Migrating, Some(Running), false, Wait),
            (Migrating, Some(Running), true, ToFallback),
            // A new attempt only within the submission window.
            (Migrating, Some(Failed), false, Retry),
            (Migrating, Some(Failed), true, ToFallback),
            // The stop waits until a migration in flight is cancelled.
            (Fallback, None, false, Stop),
            (Fallback, None, true, Stop),
            (Fallback, Some(Pending), false, Wait),
            (Fallback, Some(Pending), true, Wait),
            (Fallback, Some(TargetReady), false, Wait),
            (Fallback, Some(TargetReady), true, Wait),
            (Fallback, Some(Running), false, Wait),
            (Fallback, Some(Running), true, Wait),
            (Fallback, Some(Failed), false, Stop),
            (Fallback, Some(Failed), true, Stop),
        ]);
        assert_eq!(expected.len(), 3 * 6 * 2, "every combination once");
        let now = 100_000;
        let cfg = LifecycleConfig::default();
        let drain = Drain {
            requested_at: 1_000,
            windows: Default::default(),
            tuning: Default::default(),
            completed_at: None,
        };
        for (phase, migration_phase, expired, want) in expected {
            let deadline = if expired { now - 1 } else { now + 60_000 };
            let mut vm = evicting_vm();
            vm.status.instance = Some(Instance::new("vm-1", "a", 0));
            vm.status.instance_seq = 1;
            vm.status.eviction = Some(Eviction {
                drain_requested_at: drain.requested_at,
                phase,
                started_at: 1_000,
                submit_deadline: Some(deadline),
                migrate_deadline: (phase != Submitting).then_some(deadline),
                fallback_deadline: (phase == Fallback).then_some(deadline),
                migration: Some("vm-m1".into()),
                migration_source: Some("vm-1".into()),
                migration_target: Some("vm-t1".into()),
                migration_target_node: None,
                failed_attempts: 0,
                next_attempt_at: None,
                message: None,
                user: false,
            });
            let cluster = ClusterView {
                drain: Some(drain.clone()),
                migration: migration_phase.map(|p| migration(1, p, "vm-1")),
                targets: vec!["b".into()],
                ..ClusterView::default()
            };
            let inst = vm.status.instance.clone().unwrap();
            let step = decide_eviction(&vm, &inst, DomainState::Running, &cluster, now, &cfg)
                .expect("draining");
            let got = outcome(&vm, &step);
            assert_eq!(
                got, want,
                "eviction {phase:?}, migration {migration_phase:?}, expired {expired}: {step:?}"
            );
            if let Step::Persist { vm: next, .. } = &step {
                crate::transitions::check(&vm, next).expect("the tables allow it");
            }
        }
    }

    fn evicting_vm() -> VirtualMachine {
        VirtualMachine::new(
            "vm",
            VmSpec {
                memory_mib: 64,
                disks: vec![],
                run_policy: RunPolicy::Manual,
                ..keel_testkit::spec::vm_spec()
            },
        )
    }

    #[test]
    fn no_migration_is_reserved_while_a_disk_change_is_under_way() {
        let now = 100_000;
        let cfg = LifecycleConfig::default();
        let drain = Drain {
            requested_at: 1_000,
            windows: Default::default(),
            tuning: Default::default(),
            completed_at: None,
        };
        let mut vm = evicting_vm();
        let mut inst = Instance::new("vm-1", "a", 0);
        inst.hotplug_ports = 1;
        inst.plugged.push(keel_api::PluggedDisk {
            disk: "data".into(),
            port: 0,
            attached_at: Some(5),
            detach_requested_at: Some(now - 10),
        });
        vm.status.instance = Some(inst.clone());
        vm.status.eviction = Some(Eviction::submitting(
            drain.requested_at,
            1_000,
            Some(now + 60_000),
            false,
        ));
        let cluster = ClusterView {
            drain: Some(drain),
            targets: vec!["b".into()],
            ..ClusterView::default()
        };
        let step = decide_eviction(&vm, &inst, DomainState::Running, &cluster, now, &cfg).unwrap();
        let Step::Persist {
            vm: next,
            then: None,
            ..
        } = &step
        else {
            panic!("reserved or created regardless: {step:?}")
        };
        let ev = next.status.eviction.as_ref().unwrap();
        assert_eq!(ev.migration, None);
        assert_eq!(
            ev.message.as_deref(),
            Some("waiting for the unplug of disk data to finish")
        );
        // Once the disk is gone, the migration is reserved and created.
        inst.plugged.clear();
        vm.status.instance = Some(inst.clone());
        let step = decide_eviction(&vm, &inst, DomainState::Running, &cluster, now, &cfg).unwrap();
        assert!(
            matches!(
                &step,
                Step::Persist {
                    then: Some(HvAction::CreateMigration(_)),
                    ..
                }
            ),
            "{step:?}"
        );
    }

    #[test]
    fn a_vm_running_with_a_tpm_falls_back_at_once_without_a_migration() {
        let now = 100_000;
        let cfg = LifecycleConfig::default();
        let drain = Drain {
            requested_at: 1_000,
            windows: Default::default(),
            tuning: Default::default(),
            completed_at: None,
        };
        let mut vm = evicting_vm();
        vm.spec.tpm = Some(keel_api::TpmSpec::default());
        let mut inst = Instance::new("vm-1", "a", 0);
        inst.started_with = Some(crate::restart_required::started_with(&vm));
        vm.status.instance = Some(inst.clone());
        vm.status.eviction = Some(Eviction::submitting(
            drain.requested_at,
            1_000,
            Some(now + 60_000),
            false,
        ));
        let cluster = ClusterView {
            drain: Some(drain),
            targets: vec!["b".into()],
            ..ClusterView::default()
        };
        let step = decide_eviction(&vm, &inst, DomainState::Running, &cluster, now, &cfg).unwrap();
        let Step::Persist {
            vm: next,
            then: None,
            ..
        } = &step
        else {
            panic!("a migration was tried: {step:?}")
        };
        let ev = next.status.eviction.as_ref().unwrap();
        assert_eq!((ev.phase, &ev.migration), (EvictionPhase::Fallback, &None));
        assert!(ev.message.as_deref().unwrap().contains("TPM"), "{ev:?}");
    }

    #[test]
    fn final_migrations_beyond_the_last_few_are_collected() {
        use MigrationPhase::*;
        let mut vm = VirtualMachine::new(
            "vm",
            VmSpec {
                memory_mib: 64,
                disks: vec![],
                run_policy: RunPolicy::Manual,
                ..keel_testkit::spec::vm_spec()
            },
        );
        vm.status.instance = Some(Instance::new("vm-9", "a", 0));
        // (migrations, the eviction names) → collected, oldest last
        let cases: Vec<(Vec<Migration>, Option<&str>, Vec<&str>)> = vec![
            (vec![], None, vec![]),
            (
                (1..=3).map(|n| migration(n, Failed, "vm-1")).collect(),
                None,
                vec![],
            ),
            (
                // 10 sorts after 9, not between 1 and 2.
                (1..=10).map(|n| migration(n, Failed, "vm-1")).collect(),
                None,
                vec![
                    "vm-m7", "vm-m6", "vm-m5", "vm-m4", "vm-m3", "vm-m2", "vm-m1",
                ],
            ),
            (
                vec![
                    migration(1, Failed, "vm-1"),
                    migration(2, Succeeded, "vm-9"),
                    migration(3, Failed, "vm-1"),
                    migration(4, Failed, "vm-1"),
                    migration(5, Failed, "vm-1"),
                    migration(6, Running, "vm-1"),
                    migration(7, Failed, "vm-1"),
                ],
                Some("vm-m1"),
                // m7, m5, m4 are kept; of the older ones m2 is from the
                // recorded instance and m1 is named; m6 is in flight.
                vec!["vm-m3"],
            ),
            (
                (1..=5).map(|n| migration(n, Failed, "vm-1")).collect(),
                Some("vm-m5"),
                vec!["vm-m2", "vm-m1"],
            ),
        ];
        for (ms, named, expected) in cases {
            let mut v = vm.clone();
            v.status.eviction = named.map(|id| Eviction {
                migration: Some(id.into()),
                ..Eviction::submitting(0, 0, None, false)
            });
            assert_eq!(migrations_to_collect(Some(&v), &ms), expected, "{named:?}");
        }
        // The VM is gone: every final record goes, in-flight ones stay.
        let ms = vec![migration(1, Failed, "vm-1"), migration(2, Pending, "vm-1")];
        assert_eq!(migrations_to_collect(None, &ms), ["vm-m1"]);
    }
}
