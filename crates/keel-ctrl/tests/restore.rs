//! Restore keeps the power state: every run policy × {running, stopped
//! before the restore} × {first boot after restore succeeds, crashes once}.
//! The snapshot's own spec always says the opposite power state, so a
//! restore that took the power state from the restored spec (instead of the
//! intent recorded before the maintenance window) fails here.

mod common;

use common::{spec, World};
use keel_api::{Phase, PowerState, RunPolicy, SnapshotPhase, VirtualMachine};
use keel_ctrl::keys::snapshot_key;
use keel_hv::sim::{SimConfig, SimFaults};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SLOT: u32 = 7;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 2_000,
        faults: SimFaults::default(),
        ..Default::default()
    }
}

struct Case {
    policy: RunPolicy,
    running_before: bool,
    first_boot_crashes: bool,
}

/// Sets the case up, restores, and returns whether the VM ran before.
async fn restore_case(w: &mut World, case: &Case) -> bool {
    let name = "vm";
    let create_power = if case.running_before {
        PowerState::Running
    } else {
        PowerState::Stopped
    };
    let policy_at_create = match case.policy {
        // Data is written by a running guest; AlwaysOff never runs, so it
        // starts Manual and switches below.
        RunPolicy::AlwaysOff => RunPolicy::Manual,
        p => p,
    };
    w.create(name, spec(policy_at_create, PowerState::Running, 30))
        .await;
    w.run_for(5_000).await;
    w.hv.guest_write(name, SLOT, "in-snapshot").unwrap();
    let snap = w.take_snapshot(name, "before").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{snap:?}");
    assert!(snap.status.live);
    w.hv.guest_write(name, SLOT, "after-snapshot").unwrap();

    let policy = case.policy;
    w.user_op(name, move |vm| {
        let mut s = vm.spec.clone();
        s.run_policy = policy;
        s.power = create_power;
        vm.replace_spec(s)
    })
    .await
    .unwrap();
    w.run_for(60_000).await;
    let running_before = !w.hv.live_instances(name).is_empty();

    // The snapshot's spec says the opposite of the state before.
    let key = snapshot_key(name, "before");
    let mut entry = w
        .user
        .get::<keel_api::Snapshot>(&key)
        .await
        .unwrap()
        .unwrap();
    entry.value.spec.power = if running_before {
        PowerState::Stopped
    } else {
        PowerState::Running
    };
    w.user
        .update(&key, &entry.value, entry.revision)
        .await
        .unwrap();

    if case.first_boot_crashes {
        w.hv.crash_next_boot(name);
    }
    let now = w.now();
    w.user_op(name, move |vm| vm.request_restore("before", now))
        .await
        .unwrap();
    let intent = w.get(name).await.unwrap().power_intent.unwrap();
    assert_eq!(intent.power == PowerState::Running, running_before);
    running_before
}

async fn assert_restored(w: &World, running_before: bool, case_label: &str) {
    let vm = w.get("vm").await.unwrap();
    let live = w.hv.live_instances("vm");
    assert!(
        vm.restore.is_none(),
        "{case_label}: restore still pending: {vm:?}"
    );
    assert!(
        vm.power_intent.is_none(),
        "{case_label}: power intent not converted: {vm:?}"
    );
    if running_before {
        assert_eq!(vm.status.phase, Phase::Running, "{case_label}: {vm:?}");
        assert_eq!(live.len(), 1, "{case_label}");
    } else {
        assert_eq!(vm.status.phase, Phase::Stopped, "{case_label}: {vm:?}");
        assert!(live.is_empty(), "{case_label}");
    }
    assert_eq!(
        w.hv.disk_record("vm", SLOT).as_deref(),
        Some("in-snapshot"),
        "{case_label}: disks not restored"
    );
    assert!(
        w.hv.violations().is_empty(),
        "{case_label}: {:?}",
        w.hv.violations()
    );
}

#[tokio::test]
async fn restore_returns_every_policy_to_its_power_state() {
    let mut ran = 0;
    for policy in RunPolicy::ALL {
        for running_before in [true, false] {
            for first_boot_crashes in [false, true] {
                let case = Case {
                    policy,
                    running_before,
                    first_boot_crashes,
                };
                let label = format!(
                    "{policy:?}, {} before, first boot {}",
                    if running_before { "running" } else { "stopped" },
                    if first_boot_crashes {
                        "crashes"
                    } else {
                        "succeeds"
                    }
                );
                let mut w = World::new(ran, sim());
                let was_running = restore_case(&mut w, &case).await;
                // What each policy allows before the restore.
                let expected_before = match policy {
                    RunPolicy::AlwaysOn => true,
                    RunPolicy::AlwaysOff => false,
                    _ => running_before,
                };
                assert_eq!(was_running, expected_before, "{label}");
                w.run_for(180_000).await;
                assert_restored(&w, was_running, &label).await;
                ran += 1;
            }
        }
    }
    assert_eq!(ran, 16);
}

/// The case the issue names: AlwaysOnUnlessStoppedManually, running before,
/// the first boot after restore crashes — it must come back running, by a
/// retry, not by luck.
#[tokio::test]
async fn aousm_running_before_comes_back_after_a_crashed_first_boot() {
    let mut w = World::new(77, sim());
    let case = Case {
        policy: RunPolicy::AlwaysOnUnlessStoppedManually,
        running_before: true,
        first_boot_crashes: true,
    };
    assert!(restore_case(&mut w, &case).await);
    w.run_for(180_000).await;
    let vm = w.get("vm").await.unwrap();
    let exit = vm.status.last_exit.clone().unwrap();
    assert!(
        !exit.requested,
        "the crash of the first boot was seen: {exit:?} {vm:?} {:?}",
        w.hv.log()
    );
    assert_restored(&w, true, "AOUSM crash").await;
}

/// Controller restarts, store outages and hypervisor faults at any step of
/// a restore: it still ends in the recorded power state with restored disks.
#[tokio::test]
async fn restore_survives_controller_restarts_and_faults_at_any_step() {
    for seed in 0..60u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let case = Case {
            policy: [RunPolicy::Manual, RunPolicy::AlwaysOnUnlessStoppedManually]
                [seed as usize % 2],
            running_before: rng.gen_bool(0.5),
            first_boot_crashes: rng.gen_bool(0.5),
        };
        let mut w = World::new(seed, sim());
        let was_running = restore_case(&mut w, &case).await;
        *w.faulty.fail_rate.lock().unwrap() = 0.3;
        w.hv.set_faults(SimFaults {
            op_unavailable: 0.3,
            lookup_unavailable: 0.3,
            ..Default::default()
        });
        for _ in 0..200 {
            if rng.gen_bool(0.1) {
                w.restart_controller().await;
            }
            w.step_to_next().await;
            w.check_no_untracked_instances().await.unwrap();
        }
        *w.faulty.fail_rate.lock().unwrap() = 0.0;
        w.hv.set_faults(SimFaults::default());
        w.queue.schedule("vm", w.now());
        w.run_for(300_000).await;
        assert_restored(&w, was_running, &format!("seed {seed}")).await;
    }
}

/// A restore refuses conflicting requests instead of losing them.
#[tokio::test]
async fn power_requests_wait_for_a_pending_restore() {
    let mut w = World::new(9, sim());
    w.create("vm", spec(RunPolicy::Manual, PowerState::Running, 30))
        .await;
    w.run_for(5_000).await;
    w.take_snapshot("vm", "s").await;
    let now = w.now();
    w.user_op("vm", move |vm| vm.request_restore("s", now))
        .await
        .unwrap();
    let err = w
        .user_op("vm", VirtualMachine::request_stop)
        .await
        .unwrap_err();
    assert!(err.contains("restore"), "{err}");
    let err = w
        .user_op("vm", move |vm| vm.request_restore("s", now))
        .await
        .unwrap_err();
    assert!(err.contains("already being restored"), "{err}");
}
