//! Node drain: migrate first, within bounded windows, then fall back to
//! stop and start elsewhere. Several simulated nodes share one store, one
//! clock and shared storage; every tick each node agent heartbeats, ends
//! stray domains and looks at every VM and migration (level-triggered, so
//! polling everything is the same as reacting to watches, only slower).
//!
//! Checked at every tick: no VM ever has two executing instances across
//! the cluster, and an executing instance is always the one its record names.

mod cluster;

use cluster::{sim, Cluster};
use keel_api::{
    EvictionPhase, EvictionWindows, MigrationPhase, MigrationTuning, Node, Phase, RunPolicy,
    Snapshot, SnapshotPhase, VirtualMachine,
};
use keel_ctrl::keys::{snapshot_key, vm_key, MIGRATIONS_PREFIX};
use keel_ctrl::KEEP_FINAL_MIGRATIONS;
use keel_hv::sim::{SimConfig, SimFaults};

/// Three VMs on node a, node b joins, a is drained: all three move to b by
/// live migration (no stop), their disk data intact, the drain completes
/// and a stays cordoned by Keel.
#[tokio::test]
async fn drain_live_migrates_every_vm() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    for name in ["one", "two", "three"] {
        c.create(name, RunPolicy::AlwaysOnUnlessStoppedManually)
            .await;
    }
    c.run(5_000).await;
    for name in ["one", "two", "three"] {
        assert!(c.executing_on("a", name), "{name} runs on a");
        c.agent("a")
            .hv
            .guest_write(name, 1, &format!("data of {name}"))
            .unwrap();
    }
    c.add_node("b").await;
    c.drain("a").await;
    c.run(30_000).await;
    for name in ["one", "two", "three"] {
        let vm = c.vm(name).await;
        assert_eq!(vm.status.phase, Phase::Running, "{name}: {vm:?}");
        assert!(c.executing_on("b", name), "{name} runs on b");
        assert_eq!(vm.status.instance.as_ref().unwrap().node, "b");
        assert!(
            vm.status.last_exit.is_none(),
            "{name} was stopped, not migrated: {vm:?}"
        );
        assert_eq!(
            c.agent("b").hv.disk_record(name, 1),
            Some(format!("data of {name}"))
        );
        let ms = c.migrations_of(name).await;
        assert_eq!(ms.len(), 1, "one migration per attempt: {ms:?}");
        assert_eq!(ms[0].status.phase, MigrationPhase::Succeeded);
        assert!(
            c.agent("a").hv.live_instances(name).is_empty(),
            "source cleaned up"
        );
    }
    let a = c.node("a").await;
    assert!(a.cordoned && a.cordoned_by_keel);
    assert!(a.drain.unwrap().completed_at.is_some());
}

/// No node to go to (the only other one is cordoned by its operator): the
/// eviction degrades at once to stop here; the VM starts elsewhere only when
/// a node can take it.
#[tokio::test]
async fn no_target_degrades_to_stop_and_starts_elsewhere_later() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.update_node("b", Node::cordon_by_operator).await;
    c.drain("a").await;
    c.run(10_000).await;
    let vm = c.vm("vm").await;
    assert!(vm.status.instance.is_none(), "{vm:?}");
    assert!(c.migrations_of("vm").await.is_empty());
    // Keel does not lift the operator's cordon; the operator does.
    c.update_node("b", |n| {
        n.cordoned = false;
    })
    .await;
    c.run(5_000).await;
    assert!(c.executing_on("b", "vm"));
    assert_eq!(c.vm("vm").await.status.phase, Phase::Running);
}

/// The target never gets ready: the submission window expires, the
/// migration is marked failed, the VM is stopped and started elsewhere.
#[tokio::test]
async fn submission_window_expiry_falls_back() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.agents[1].migrations_stuck = true;
    c.drain("a").await;
    c.run(9_000).await;
    let ev = c.vm("vm").await.status.eviction.unwrap();
    assert_eq!(
        ev.phase,
        EvictionPhase::Submitting,
        "still within the window"
    );
    c.run(3_000).await;
    let ev = c.vm("vm").await.status.eviction.unwrap();
    assert_eq!(ev.phase, EvictionPhase::Fallback);
    assert!(ev.message.unwrap().contains("submission window expired"));
    c.agents[1].migrations_stuck = false;
    c.run(20_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{vm:?}");
    assert!(vm.status.last_exit.unwrap().requested);
    let ms = c.migrations_of("vm").await;
    assert!(
        ms.iter().all(|m| m.status.phase == MigrationPhase::Failed),
        "{ms:?}"
    );
}

/// A migration slower than its window is cancelled and the VM falls back.
#[tokio::test]
async fn migration_window_expiry_cancels_and_falls_back() {
    let mut c = Cluster::new(SimConfig {
        migration_ms: 60_000,
        ..sim()
    });
    c.add_node("a").await;
    c.create("vm", RunPolicy::Manual).await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.drain("a").await;
    c.run(15_000).await;
    assert_eq!(
        c.vm("vm").await.status.eviction.unwrap().phase,
        EvictionPhase::Migrating
    );
    c.run(15_000).await;
    let vm = c.vm("vm").await;
    assert!(
        c.executing_on("b", "vm"),
        "restarted on b after the fallback: {vm:?}"
    );
    assert_eq!(
        c.migrations_of("vm").await[0].status.phase,
        MigrationPhase::Failed
    );
    assert!(vm.status.last_exit.is_some(), "fell back through a stop");
}

/// The cancel comes too late and the migration completes after its
/// window: the success is honoured, the VM is not stopped.
#[tokio::test]
async fn late_migration_success_is_honoured() {
    let mut c = Cluster::new(SimConfig {
        migration_ms: 25_000,
        faults: SimFaults {
            cancel_too_late: 1.0,
            ..Default::default()
        },
        ..sim()
    });
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.agent("a").hv.guest_write("vm", 3, "kept").unwrap();
    c.add_node("b").await;
    c.drain("a").await;
    c.run(60_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{vm:?}");
    assert!(vm.status.last_exit.is_none(), "not stopped: {vm:?}");
    assert_eq!(
        c.migrations_of("vm").await[0].status.phase,
        MigrationPhase::Succeeded
    );
    assert_eq!(
        c.agent("b").hv.disk_record("vm", 3).as_deref(),
        Some("kept")
    );
}

/// Controller restarts mid-drain resume the stored windows; they do not
/// open new ones.
#[tokio::test]
async fn controller_restart_resumes_the_stored_deadlines() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.agents[1].migrations_stuck = true;
    c.drain("a").await;
    c.run(4_000).await;
    let before = c.vm("vm").await.status.eviction.unwrap();
    for _ in 0..4 {
        c.restart_controllers();
        c.run(1_000).await;
    }
    let after = c.vm("vm").await.status.eviction.unwrap();
    assert_eq!(before.submit_deadline, after.submit_deadline);
    assert_eq!(before.started_at, after.started_at);
    // The window ends where the record says; the VM sees that at its next
    // look (every `poll_ms`, 2 s, as a drain itself is noticed: node
    // records are not watched).
    let deadline = before.submit_deadline.unwrap();
    c.run((deadline + 2_000).saturating_sub(c.now())).await;
    assert_eq!(
        c.vm("vm").await.status.eviction.unwrap().phase,
        EvictionPhase::Fallback
    );
}

/// Missing or invalid deadlines (a record from an older Keel, or damaged)
/// count as expired: straight to the fallback.
#[tokio::test]
async fn missing_or_invalid_markers_fall_back() {
    for case in ["missing", "invalid"] {
        let mut c = Cluster::new(sim());
        c.add_node("a").await;
        c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
            .await;
        c.run(3_000).await;
        c.add_node("b").await;
        c.agents[1].migrations_stuck = true;
        c.drain("a").await;
        // The VM sees the drain at its next look (node records are not
        // watched; a running VM is looked at every 2 s).
        for _ in 0..8 {
            c.tick().await;
            if c.vm("vm").await.status.eviction.is_some() {
                break;
            }
        }
        c.update_vm("vm", |vm| {
            let ev = vm.status.eviction.as_mut().unwrap();
            ev.submit_deadline = match case {
                "missing" => None,
                _ => Some(ev.started_at - 1),
            };
        })
        .await;
        c.tick().await;
        let ev = c.vm("vm").await.status.eviction.unwrap();
        assert_eq!(ev.phase, EvictionPhase::Fallback, "{case}");
    }
}

/// A VM carrying a failed migration from an earlier drain gets a new
/// attempt in the next drain instead of being skipped.
#[tokio::test]
async fn stale_failed_migration_gets_a_new_attempt() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    // An earlier drain of a: its migration failed; then the drain was cancelled.
    c.agents[1].hv.set_faults(SimFaults {
        op_unavailable: 1.0,
        ..Default::default()
    });
    c.drain("a").await;
    c.run(2_000).await;
    let stale = c.vm("vm").await.status.eviction.unwrap();
    assert!(c
        .migrations_of("vm")
        .await
        .iter()
        .any(|m| m.status.phase == MigrationPhase::Failed));
    c.update_node("a", |n| {
        n.uncordon_by_keel();
    })
    .await;
    c.agents[1].hv.set_faults(SimFaults::default());
    // Long enough for every window of the stale marker to have passed.
    c.run(60_000).await;
    assert!(c.executing_on("a", "vm"));
    // The called-off drain's eviction, its migration failed, is dropped:
    // its reserved target no longer holds b's room.
    let vm = c.vm("vm").await;
    assert!(stale.migration.is_some(), "{stale:?}");
    assert_eq!(vm.status.eviction, None, "marker left behind");
    assert_eq!(vm.incoming_on(), None);
    // The new drain: a fresh attempt, which succeeds.
    c.drain("a").await;
    c.run(20_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{vm:?}");
    assert!(
        vm.status.last_exit.is_none(),
        "migrated, not stopped: {vm:?}"
    );
    let ms = c.migrations_of("vm").await;
    assert_eq!(
        ms.last().unwrap().status.phase,
        MigrationPhase::Succeeded,
        "{ms:?}"
    );
}

/// Many controller restarts during a drain: each attempt's migration
/// record is created once.
#[tokio::test]
async fn a_migration_is_created_once_per_attempt() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.drain("a").await;
    for _ in 0..20 {
        c.restart_controllers();
        c.tick().await;
    }
    c.run(10_000).await;
    assert!(c.executing_on("b", "vm"));
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1, "{ms:?}");
    assert_eq!(c.vm("vm").await.status.migration_seq, 1);
}

/// A crash between reserving a migration on the VM record and creating its
/// record: the retry creates the reserved migration, not a second one.
#[tokio::test]
async fn a_reserved_migration_is_created_under_its_reserved_id() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    let mut failed_once = false;
    c.memory
        .set_fault_hook(Some(Box::new(move |op: &keel_store::memory::Op<'_>| {
            if !failed_once
                && op.kind == keel_store::memory::OpKind::Put
                && op.key.starts_with(MIGRATIONS_PREFIX)
            {
                failed_once = true;
                return Some(keel_store::memory::Fault::Unavailable("lost create".into()));
            }
            None
        })));
    c.drain("a").await;
    c.run(15_000).await;
    assert!(c.executing_on("b", "vm"));
    let ms = c.migrations_of("vm").await;
    assert_eq!(
        ms.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        [keel_api::Migration::id_for("vm", &c.vm("vm").await.uid, 1)]
    );
    assert_eq!(c.vm("vm").await.status.migration_seq, 1);
}

/// A stopped VM assigned to the draining node moves to another node's
/// books too (it does not start), so the drain completes.
#[tokio::test]
async fn a_stopped_vm_does_not_hold_up_a_drain() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("idle", RunPolicy::Manual).await;
    c.run(3_000).await;
    c.update_vm("idle", |vm| {
        vm.request_stop().unwrap();
    })
    .await;
    c.run(5_000).await;
    assert_eq!(c.vm("idle").await.status.phase, Phase::Stopped);
    c.add_node("b").await;
    c.drain("a").await;
    c.run(5_000).await;
    let vm = c.vm("idle").await;
    assert_eq!(vm.status.node.as_deref(), Some("b"), "{vm:?}");
    assert_eq!(vm.status.phase, Phase::Stopped);
    assert!(vm.status.instance.is_none());
    assert!(c.node("a").await.drain.unwrap().completed_at.is_some());
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum UserRequest {
    Stop,
    Restart,
    Restore,
    Delete,
}

/// Takes snapshot `name` of `vm` on node `node` (live), as its agent's
/// snapshot controller does.
async fn take_snapshot(c: &mut Cluster, node: &str, vm: &str, name: &str) {
    let snap = Snapshot {
        vm: vm.into(),
        name: name.into(),
        spec: c.vm(vm).await.spec,
        requested_at: c.now(),
        deletion_requested_at: None,
        status: Default::default(),
    };
    let key = snapshot_key(vm, name);
    c.store.create(&key, &snap).await.unwrap();
    let snaps = c.agent(node).vms.snapshot_controller();
    for _ in 0..20 {
        if let Ok(None) = snaps.reconcile(vm, name).await {
            break;
        }
        c.tick().await;
    }
    let snap = c.store.get::<Snapshot>(&key).await.unwrap().unwrap().value;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{snap:?}");
}

/// User requests win over an eviction: a stop, restart, restore or delete
/// asked for while the VM is being migrated off a draining node (windows
/// of 10 minutes each) is done within the VM's grace period (30 s), with
/// the migration cancelled and not attempted again.
#[tokio::test]
async fn user_requests_during_a_drain_are_honoured_within_the_grace_period() {
    for request in [
        UserRequest::Stop,
        UserRequest::Restart,
        UserRequest::Restore,
        UserRequest::Delete,
    ] {
        let mut c = Cluster::new(SimConfig {
            migration_ms: 600_000,
            ..sim()
        });
        c.add_node("a").await;
        c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
            .await;
        c.run(3_000).await;
        c.agent("a").hv.guest_write("vm", 1, "in-snapshot").unwrap();
        if request == UserRequest::Restore {
            take_snapshot(&mut c, "a", "vm", "s").await;
            c.agent("a").hv.guest_write("vm", 1, "after").unwrap();
        }
        c.add_node("b").await;
        let now = c.now();
        c.update_node("a", |n| n.request_drain(now, EvictionWindows::default()))
            .await;
        c.run(5_000).await;
        let ev = c.vm("vm").await.status.eviction.unwrap();
        assert_eq!(ev.phase, EvictionPhase::Migrating, "{request:?}: {ev:?}");

        let requested = c.now();
        c.update_vm("vm", |vm| match request {
            UserRequest::Stop => vm.request_stop().unwrap(),
            UserRequest::Restart => vm.request_restart().unwrap(),
            UserRequest::Restore => vm.request_restore("s", requested).unwrap(),
            UserRequest::Delete => {
                vm.deletion_requested_at.get_or_insert(requested);
            }
        })
        .await;
        let grace_ms = c.vm("vm").await.spec.stop_grace_period_s * 1000;
        let mut done = false;
        while !done && c.now() < requested + grace_ms {
            c.tick().await;
            let record = c
                .store
                .get::<VirtualMachine>(&vm_key("vm"))
                .await
                .unwrap()
                .map(|e| e.value);
            let on = |node| c.executing_on(node, "vm");
            done = match (request, &record) {
                (UserRequest::Delete, None) => !on("a") && !on("b"),
                (UserRequest::Delete, Some(_)) => false,
                (_, None) => panic!("{request:?}: record lost"),
                (UserRequest::Stop, Some(vm)) => {
                    vm.status.phase == Phase::Stopped
                        && vm.status.instance.is_none()
                        && !on("a")
                        && !on("b")
                }
                (UserRequest::Restart | UserRequest::Restore, Some(vm)) => {
                    vm.restore.is_none()
                        && vm.status.phase == Phase::Running
                        && vm.status.observed_restart_generation == vm.spec.restart_generation
                        && vm.status.instance.as_ref().is_some_and(|i| i.node == "b")
                        && vm.status.last_exit.is_some()
                        && !on("a")
                }
            };
        }
        assert!(
            done,
            "{request:?} not honoured within the {grace_ms} ms grace period: {}",
            c.explain("vm").await
        );
        let ms = c.migrations_of("vm").await;
        assert!(
            ms.len() <= 1 && ms.iter().all(|m| m.status.phase == MigrationPhase::Failed),
            "{request:?}: the migration is cancelled, not tried again: {ms:?}"
        );
        if request == UserRequest::Restore {
            assert_eq!(
                c.agent("b").hv.disk_record("vm", 1).as_deref(),
                Some("in-snapshot")
            );
        }
    }
}

/// Attempts that fail at once (the target cannot start an incoming
/// instance) are retried with backoff, not back to back for the whole
/// submission window; and only the last few final migration records of a
/// VM are kept.
#[tokio::test]
async fn failed_attempts_back_off_and_old_migrations_are_collected() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.agent("b").hv.set_faults(SimFaults {
        op_unavailable: 1.0,
        ..Default::default()
    });
    let now = c.now();
    c.update_node("a", |n| {
        n.request_drain(
            now,
            EvictionWindows {
                submit_ms: 60_000,
                ..cluster::windows()
            },
        )
    })
    .await;
    // 50 s into the submission window (60 s).
    c.run(50_000).await;
    let vm = c.vm("vm").await;
    let ev = vm.status.eviction.clone().unwrap();
    assert_eq!(ev.phase, EvictionPhase::Submitting, "{vm:?}");
    let attempts = vm.status.migration_seq;
    // Backoff 1, 2, 4, 8, 16, 32 s: about six attempts in 50 s (back to
    // back it was fifty).
    assert!(
        (4..=8).contains(&attempts),
        "{attempts} attempts in 50 s of the submission window"
    );
    assert!(
        ev.message
            .as_deref()
            .unwrap_or("")
            .contains("next attempt in"),
        "{ev:?}"
    );
    c.agent("b").hv.set_faults(SimFaults::default());
    c.run(60_000).await;
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    let ms = c.migrations_of("vm").await;
    assert!(
        ms.len() <= KEEP_FINAL_MIGRATIONS,
        "only the last {KEEP_FINAL_MIGRATIONS} are kept: {ms:?}"
    );
    let vm = c.vm("vm").await;
    let newest = keel_api::Migration::id_for("vm", &vm.uid, vm.status.migration_seq);
    assert!(
        ms.iter().any(|m| m.id == newest),
        "the newest is kept: {ms:?}"
    );
}

async fn tuned_drain(c: &Cluster, node: &str, windows: EvictionWindows, tuning: MigrationTuning) {
    let now = c.now();
    c.update_node(node, |n| n.request_tuned_drain(now, windows, tuning))
        .await;
}

/// The drain's limits on parallel migrations hold at every tick: per node
/// (2 by default: node a sends at most two at a time) and cluster-wide; and
/// they are used, not undercut. Every VM still leaves by live migration.
#[tokio::test]
async fn parallel_migrations_stay_within_the_node_and_cluster_limits() {
    let per_node_default = MigrationTuning::default();
    let cluster_of_three = MigrationTuning {
        parallel_per_cluster: 3,
        parallel_per_node: 10,
        ..MigrationTuning::default()
    };
    for (tuning, most) in [(per_node_default, 2), (cluster_of_three, 3)] {
        let mut c = Cluster::new(sim());
        c.add_node("a").await;
        let names = ["v1", "v2", "v3", "v4", "v5", "v6"];
        for name in names {
            c.create(name, RunPolicy::AlwaysOnUnlessStoppedManually)
                .await;
        }
        c.run(3_000).await;
        c.add_node("b").await;
        c.add_node("c").await;
        let windows = EvictionWindows {
            submit_ms: 120_000,
            ..cluster::windows()
        };
        tuned_drain(&c, "a", windows, tuning).await;
        let mut seen = 0;
        for _ in 0..120 {
            c.tick().await;
            let mut in_flight = Vec::new();
            for name in names {
                in_flight.extend(
                    c.migrations_of(name)
                        .await
                        .into_iter()
                        .filter(|m| !m.status.phase.is_final()),
                );
            }
            for node in ["a", "b", "c"] {
                let here = in_flight
                    .iter()
                    .filter(|m| m.source_node == node || m.target_node == node)
                    .count();
                assert!(
                    here <= tuning.parallel_per_node as usize,
                    "{here} in flight on {node}: {in_flight:?}"
                );
            }
            assert!(in_flight.len() <= tuning.parallel_per_cluster as usize);
            seen = seen.max(in_flight.len());
        }
        assert_eq!(seen, most, "{tuning:?}: the limit is used");
        for name in names {
            let vm = c.vm(name).await;
            assert_ne!(vm.status.instance.as_ref().unwrap().node, "a", "{name}");
            assert!(vm.status.last_exit.is_none(), "{name} was stopped: {vm:?}");
        }
    }
}

/// A migration past its completion timeout (per GiB of guest memory) or
/// without progress for the progress timeout is cancelled, with the reason
/// on its record, well before the drain's migrate window ends; and the
/// source is sent with the drain's tuning (auto-converge on by default).
#[tokio::test]
async fn overdue_or_stalled_migrations_are_cancelled() {
    let windows = EvictionWindows {
        submit_ms: 5_000,
        migrate_ms: 600_000,
        fallback_ms: 40_000,
    };
    // (tuning, sim, expected reason, cancelled by)
    let completion = MigrationTuning {
        completion_timeout_per_gib_s: 10,
        bandwidth_mib_s: Some(64),
        downtime_limit_ms: Some(200),
        ..MigrationTuning::default()
    };
    let progress = MigrationTuning {
        progress_timeout_s: 20,
        ..MigrationTuning::default()
    };
    let slow = SimConfig {
        migration_ms: 300_000,
        ..sim()
    };
    let stalling = SimConfig {
        migration_ms: 20_000,
        faults: SimFaults {
            migration_stalls: 1.0,
            ..Default::default()
        },
        ..sim()
    };
    for (tuning, sim, reason, by_ms) in [
        (completion, slow, "not completed within 10s", 12_000),
        (
            progress,
            stalling,
            "no progress for 20s",
            10_000 + 20_000 + 7_000,
        ),
    ] {
        let mut c = Cluster::new(sim);
        c.add_node("a").await;
        c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
            .await;
        c.run(3_000).await;
        let source = c.vm("vm").await.status.instance.unwrap().id;
        c.add_node("b").await;
        tuned_drain(&c, "a", windows, tuning).await;
        let start = c.now();
        let mut failed = None;
        while failed.is_none() && c.now() < start + by_ms {
            c.tick().await;
            failed = c
                .migrations_of("vm")
                .await
                .into_iter()
                .find(|m| m.status.phase == MigrationPhase::Failed);
        }
        let m = failed.unwrap_or_else(|| panic!("{reason}: not cancelled in {by_ms} ms"));
        assert!(
            m.status
                .message
                .as_deref()
                .unwrap_or("")
                .starts_with(reason),
            "{m:?}"
        );
        assert_eq!(m.tuning, tuning);
        let params = c.agent("a").hv.migration_params(&source).unwrap();
        assert!(params.auto_converge);
        assert_eq!(
            params.max_bandwidth,
            tuning.bandwidth_mib_s.map(|b| b << 20)
        );
        assert_eq!(params.downtime_limit_ms, tuning.downtime_limit_ms);
        assert!(!c.executing_on("b", "vm"), "the target never ran");
    }
}
