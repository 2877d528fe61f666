//! Restore brings back disks and hardware, not the operating decisions:
//! every run policy at snapshot time × every run policy at restore time ×
//! {running, stopped before the restore} × {first boot after restore
//! succeeds, crashes once}. The snapshot's own spec always says the
//! opposite power state, a different CPU count and a different grace
//! period, so a restore that took the power state or the policy from the
//! snapshot (instead of keeping the VM's and the intent recorded before the
//! maintenance window) fails here. Its third axis: a stop, start or
//! restore request at each step of a restore in progress, which must end
//! in the state the user last asked for.

mod common;

use common::{spec, World};
use keel_api::{Phase, PowerState, RunPolicy, SnapshotPhase, VirtualMachine};
use keel_ctrl::keys::snapshot_key;
use keel_hv::sim::{SimConfig, SimFaults};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SLOT: u32 = 7;
/// The VM's grace period before the restore; the snapshot's is tampered to
/// something else, and must not come back.
const GRACE_S: u64 = 30;
const SNAPSHOT_GRACE_S: u64 = 45;
/// The VM's CPU count at snapshot time: it must come back.
const SNAPSHOT_CPUS: u32 = 2;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 2_000,
        faults: SimFaults::default(),
        ..Default::default()
    }
}

struct Case {
    policy_at_snapshot: RunPolicy,
    /// The policy the VM has when the restore is requested.
    policy: RunPolicy,
    running_before: bool,
    first_boot_crashes: bool,
}

impl Case {
    fn same(policy: RunPolicy, running_before: bool, first_boot_crashes: bool) -> Self {
        Case {
            policy_at_snapshot: policy,
            policy,
            running_before,
            first_boot_crashes,
        }
    }
}

async fn set_policy(w: &mut World, policy: RunPolicy, power: PowerState, cpus: Option<u32>) {
    w.user_op("vm", move |vm| {
        let mut s = vm.spec.clone();
        s.run_policy = policy;
        s.power = power;
        if let Some(cpus) = cpus {
            s.cpus = cpus;
        }
        vm.replace_spec(s)
    })
    .await
    .unwrap();
    w.run_for(60_000).await;
}

/// Sets the case up, restores, and returns whether the VM ran before.
async fn restore_case(w: &mut World, case: &Case) -> bool {
    let name = "vm";
    let power_before = if case.running_before {
        PowerState::Running
    } else {
        PowerState::Stopped
    };
    w.create(name, spec(RunPolicy::Manual, PowerState::Running, GRACE_S))
        .await;
    w.run_for(5_000).await;
    w.hv.guest_write(name, SLOT, "in-snapshot").unwrap();
    // The snapshot is taken under its policy (offline when that stops it),
    // with a CPU count the VM no longer has at restore time.
    set_policy(
        w,
        case.policy_at_snapshot,
        PowerState::Running,
        Some(SNAPSHOT_CPUS),
    )
    .await;
    let snap = w.take_snapshot(name, "before").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{snap:?}");
    assert_eq!(snap.spec.run_policy, case.policy_at_snapshot);
    // Data is written by a running guest after the snapshot.
    set_policy(w, RunPolicy::Manual, PowerState::Running, Some(1)).await;
    w.hv.guest_write(name, SLOT, "after-snapshot").unwrap();
    set_policy(w, case.policy, power_before, None).await;
    let running_before = !w.hv.live_instances(name).is_empty();

    // The snapshot's spec says the opposite of the state before, and
    // another grace period.
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
    entry.value.spec.stop_grace_period_s = SNAPSHOT_GRACE_S;
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
    let vm = w.get(name).await.unwrap();
    let intent = vm.power_intent.clone().unwrap();
    assert_eq!(intent.power == PowerState::Running, running_before);
    // What `keel restore --wait` waits for.
    assert_eq!(
        vm.power_after_restore() == PowerState::Running,
        running_before
    );
    running_before
}

async fn assert_restored(w: &World, case: &Case, running_before: bool, case_label: &str) {
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
    assert_eq!(
        vm.spec.run_policy, case.policy,
        "{case_label}: the run policy from before the restore"
    );
    assert_eq!(
        vm.spec.cpus, SNAPSHOT_CPUS,
        "{case_label}: hardware restored"
    );
    assert_eq!(
        vm.spec.stop_grace_period_s, GRACE_S,
        "{case_label}: grace period kept"
    );
    let power = if running_before {
        PowerState::Running
    } else {
        PowerState::Stopped
    };
    assert!(vm.restored_to(power), "{case_label}: {vm:?}");
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
async fn restore_keeps_the_policy_and_power_state_from_before() {
    let mut ran = 0u64;
    for policy_at_snapshot in RunPolicy::ALL {
        for policy in RunPolicy::ALL {
            for running_before in [true, false] {
                for first_boot_crashes in [false, true] {
                    let case = Case {
                        policy_at_snapshot,
                        policy,
                        running_before,
                        first_boot_crashes,
                    };
                    let label = format!(
                        "snapshot under {policy_at_snapshot:?}, restored under {policy:?}, {} before, first boot {}",
                        if running_before { "running" } else { "stopped" },
                        if first_boot_crashes {
                            "crashes"
                        } else {
                            "succeeds"
                        }
                    );
                    let mut w = World::new(ran, sim()).await;
                    let was_running = restore_case(&mut w, &case).await;
                    // What each policy allows before the restore.
                    let expected_before = match policy {
                        RunPolicy::AlwaysOn => true,
                        RunPolicy::AlwaysOff => false,
                        _ => running_before,
                    };
                    assert_eq!(was_running, expected_before, "{label}");
                    w.run_for(180_000).await;
                    assert_restored(&w, &case, was_running, &label).await;
                    ran += 1;
                }
            }
        }
    }
    assert_eq!(ran as usize, RunPolicy::ALL.len().pow(2) * 4);
}

/// The measured bug: snapshotted while AlwaysOn and running, then switched
/// to Manual and stopped. The restore must end Manual and Stopped, and the
/// goal `keel restore --wait` computes from the restore's answer is reached
/// in the very write that ends the restore.
#[tokio::test]
async fn always_on_snapshot_restored_into_a_stopped_manual_vm_stays_stopped() {
    let mut w = World::new(5, sim()).await;
    w.create(
        "vm",
        spec(RunPolicy::AlwaysOn, PowerState::Running, GRACE_S),
    )
    .await;
    w.run_for(5_000).await;
    let snap = w.take_snapshot("vm", "on").await;
    assert_eq!(snap.spec.run_policy, RunPolicy::AlwaysOn);
    set_policy(&mut w, RunPolicy::Manual, PowerState::Running, None).await;
    w.user_op("vm", VirtualMachine::request_stop).await.unwrap();
    w.run_for(60_000).await;
    assert_eq!(w.get("vm").await.unwrap().status.phase, Phase::Stopped);

    let now = w.now();
    w.user_op("vm", move |vm| vm.request_restore("on", now))
        .await
        .unwrap();
    // The CLI's goal, from the record the restore request returns.
    let goal = w.get("vm").await.unwrap().power_after_restore();
    assert_eq!(goal, PowerState::Stopped);
    for _ in 0..100 {
        if w.get("vm").await.unwrap().restore.is_none() {
            break;
        }
        w.step_to_next().await;
    }
    let vm = w.get("vm").await.unwrap();
    assert!(vm.restore.is_none(), "{vm:?}");
    assert!(vm.restored_to(goal), "goal reached at once: {vm:?}");
    w.run_for(120_000).await;
    let vm = w.get("vm").await.unwrap();
    assert_eq!(vm.spec.run_policy, RunPolicy::Manual);
    assert_eq!(vm.spec.power, PowerState::Stopped);
    assert_eq!(vm.status.phase, Phase::Stopped);
    assert!(w.hv.live_instances("vm").is_empty());
}

/// The case the issue names: AlwaysOnUnlessStoppedManually, running before,
/// the first boot after restore crashes — it must come back running, by a
/// retry, not by luck.
#[tokio::test]
async fn aousm_running_before_comes_back_after_a_crashed_first_boot() {
    let mut w = World::new(77, sim()).await;
    let case = Case::same(RunPolicy::AlwaysOnUnlessStoppedManually, true, true);
    assert!(restore_case(&mut w, &case).await);
    w.run_for(180_000).await;
    let vm = w.get("vm").await.unwrap();
    let exit = vm.status.last_exit.clone().unwrap();
    assert!(
        !exit.requested,
        "the crash of the first boot was seen: {exit:?} {vm:?} {:?}",
        w.hv.log()
    );
    assert_restored(&w, &case, true, "AOUSM crash").await;
}

/// Controller restarts, store outages and hypervisor faults at any step of
/// a restore: it still ends in the recorded power state with restored disks.
#[tokio::test]
async fn restore_survives_controller_restarts_and_faults_at_any_step() {
    for seed in 0..60u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let case = Case {
            policy_at_snapshot: RunPolicy::ALL[rng.gen_range(0..RunPolicy::ALL.len())],
            policy: [RunPolicy::Manual, RunPolicy::AlwaysOnUnlessStoppedManually]
                [seed as usize % 2],
            running_before: rng.gen_bool(0.5),
            first_boot_crashes: rng.gen_bool(0.5),
        };
        let mut w = World::new(seed, sim()).await;
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
        w.schedule("vm");
        w.run_for(300_000).await;
        assert_restored(&w, &case, was_running, &format!("seed {seed}")).await;
    }
}

/// A restore refuses conflicting requests instead of losing them.
#[tokio::test]
async fn power_requests_wait_for_a_pending_restore() {
    let mut w = World::new(9, sim()).await;
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

/// Issue 25 item 7 (c), as tried with the CLI on the sim driver: `restore
/// s1` (no wait), `vm stop` as soon as it is accepted (the first restore
/// is over, its new instance still booting), `restore s2` at once. The
/// second restore must come back to the state the user last asked for
/// (Stopped), not to the intent the first restore recorded (Running).
#[tokio::test]
async fn a_stop_between_two_restores_is_kept() {
    let mut w = World::new(25, sim()).await;
    w.create(
        "vm",
        spec(
            RunPolicy::AlwaysOnUnlessStoppedManually,
            PowerState::Running,
            GRACE_S,
        ),
    )
    .await;
    w.run_for(5_000).await;
    w.take_snapshot("vm", "s1").await;
    w.take_snapshot("vm", "s2").await;
    let now = w.now();
    w.user_op("vm", move |vm| vm.request_restore("s1", now))
        .await
        .unwrap();
    let mut accepted = false;
    for _ in 0..200 {
        w.step_to_next().await;
        if w.user_op("vm", VirtualMachine::request_stop).await.is_ok() {
            accepted = true;
            break;
        }
    }
    assert!(accepted, "the stop was never accepted");
    let vm = w.get("vm").await.unwrap();
    assert_eq!(vm.spec.power, PowerState::Stopped);
    let now = w.now();
    w.user_op("vm", move |vm| vm.request_restore("s2", now))
        .await
        .unwrap();
    assert_eq!(
        w.get("vm").await.unwrap().power_after_restore(),
        PowerState::Stopped,
        "what `keel restore --wait` waits for"
    );
    w.run_for(60_000).await;
    let vm = w.get("vm").await.unwrap();
    assert_eq!(vm.spec.power, PowerState::Stopped, "{vm:?}");
    assert_eq!(vm.status.phase, Phase::Stopped, "{vm:?}");
    assert!(vm.restored_to(PowerState::Stopped), "{vm:?}");
    assert!(w.hv.live_instances("vm").is_empty());
}

/// A step of a restore in progress, as the VM's record shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum RestoreStep {
    /// Just requested: nothing done yet.
    Requested,
    /// The instance from before is being stopped.
    Stopping,
    /// The restore is over; its new instance has not run yet.
    Restored,
    /// The new instance runs but has not settled: the `Running` intent
    /// still stands (the settle window the 144 cases never asked into).
    Booting,
    /// Over: the intent is fulfilled.
    Settled,
}

impl RestoreStep {
    const ALL: [RestoreStep; 5] = [
        RestoreStep::Requested,
        RestoreStep::Stopping,
        RestoreStep::Restored,
        RestoreStep::Booting,
        RestoreStep::Settled,
    ];

    fn is_now(self, vm: &VirtualMachine) -> bool {
        let restoring = vm.restore.is_some();
        let running = vm.status.phase == Phase::Running;
        let intent = vm.power_intent.is_some();
        match self {
            RestoreStep::Requested => restoring && vm.status.stop.is_none(),
            RestoreStep::Stopping => restoring && vm.status.stop.is_some(),
            RestoreStep::Restored => !restoring && intent && !running,
            RestoreStep::Booting => !restoring && intent && running,
            RestoreStep::Settled => !restoring && !intent,
        }
    }

    /// Whether a restore of a VM that was stopped has this step: it
    /// stops nothing and boots nothing.
    fn of_a_stopped_vm(self) -> bool {
        matches!(self, RestoreStep::Requested | RestoreStep::Settled)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Request {
    Stop,
    Start,
    /// A restore from the second snapshot.
    Restore,
}

/// What the user has asked for so far, and so what the VM must end in.
struct Asked {
    policy: RunPolicy,
    power: PowerState,
    snapshot: &'static str,
}

impl Asked {
    /// Whether the API must take `req` on `vm`, and if not, what the
    /// refusal names.
    fn refusal(&self, req: Request, vm: &VirtualMachine) -> Option<&'static str> {
        if vm.restore.is_some() {
            return Some("restore");
        }
        match (req, self.policy) {
            (Request::Stop, RunPolicy::AlwaysOn) => Some("spec.run_policy"),
            (Request::Start, RunPolicy::AlwaysOff | RunPolicy::Once) => Some("spec.run_policy"),
            _ => None,
        }
    }

    fn take(&mut self, req: Request) {
        match req {
            Request::Stop => self.power = PowerState::Stopped,
            Request::Start => self.power = PowerState::Running,
            // A restore comes back to the state the user last asked for.
            Request::Restore => self.snapshot = "s2",
        }
    }

    fn end_state(&self) -> PowerState {
        match self.policy {
            RunPolicy::AlwaysOn => PowerState::Running,
            RunPolicy::AlwaysOff => PowerState::Stopped,
            _ => self.power,
        }
    }
}

async fn send(w: &mut World, req: Request) -> Result<(), String> {
    match req {
        Request::Stop => w.user_op("vm", VirtualMachine::request_stop).await,
        Request::Start => w.user_op("vm", VirtualMachine::request_start).await,
        Request::Restore => {
            let now = w.now();
            w.user_op("vm", move |vm| vm.request_restore("s2", now))
                .await
        }
    }
}

/// The third axis of the restore matrix: a stop, start or restore request
/// (alone, or two back to back, as a script or a quick user sends them)
/// at each step of a restore in progress, under every run policy, from a
/// running and from a stopped VM. A request is refused while the restore
/// is pending (naming `restore`), or by the policy; an accepted one is
/// never lost: the VM ends in the power state the user last asked for,
/// on the disks of the last restore taken.
#[tokio::test]
async fn requests_at_each_step_of_a_restore_end_in_the_state_last_asked_for() {
    use Request::*;
    let singles: Vec<Vec<Request>> = vec![vec![Stop], vec![Start], vec![Restore]];
    let mut pairs = vec![];
    for first in [Stop, Start, Restore] {
        for second in [Stop, Start, Restore] {
            if first != second {
                pairs.push(vec![first, second]);
            }
        }
    }
    let mut reached = std::collections::BTreeSet::new();
    let mut ran = 0u64;
    for policy in RunPolicy::ALL {
        for running_before in [true, false] {
            let forced = match policy {
                RunPolicy::AlwaysOn => Some(true),
                RunPolicy::AlwaysOff => Some(false),
                _ => None,
            };
            if forced.is_some_and(|f| f != running_before) {
                continue;
            }
            for step in RestoreStep::ALL {
                if !running_before && !step.of_a_stopped_vm() {
                    continue;
                }
                // While the restore is pending every request is refused,
                // so a second one adds nothing.
                let sequences = match step {
                    RestoreStep::Requested | RestoreStep::Stopping => &singles,
                    _ => &pairs,
                };
                for sequence in sequences {
                    let label = format!(
                        "{policy:?}, {} before, {sequence:?} at {step:?}",
                        if running_before { "running" } else { "stopped" }
                    );
                    let mut w = World::new(ran, sim()).await;
                    let power = if running_before {
                        PowerState::Running
                    } else {
                        PowerState::Stopped
                    };
                    w.create("vm", spec(RunPolicy::Manual, PowerState::Running, GRACE_S))
                        .await;
                    w.run_for(5_000).await;
                    for snapshot in ["s1", "s2"] {
                        w.hv.guest_write("vm", SLOT, &format!("in-{snapshot}"))
                            .unwrap();
                        let snap = w.take_snapshot("vm", snapshot).await;
                        assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{label}");
                    }
                    w.hv.guest_write("vm", SLOT, "after-snapshots").unwrap();
                    w.user_op("vm", move |vm| {
                        let mut s = vm.spec.clone();
                        s.run_policy = policy;
                        s.power = power;
                        vm.replace_spec(s)
                    })
                    .await
                    .unwrap();
                    w.run_for(15_000).await;
                    assert_eq!(
                        w.hv.live_instances("vm").is_empty(),
                        !running_before,
                        "{label}"
                    );
                    let now = w.now();
                    w.user_op("vm", move |vm| vm.request_restore("s1", now))
                        .await
                        .unwrap();
                    let mut at_step = step == RestoreStep::Requested;
                    for _ in 0..200 {
                        if at_step {
                            break;
                        }
                        w.step_to_next().await;
                        let vm = w.get("vm").await.unwrap();
                        at_step = step.is_now(&vm);
                        if !at_step
                            && step != RestoreStep::Settled
                            && RestoreStep::Settled.is_now(&vm)
                        {
                            break;
                        }
                    }
                    if !at_step {
                        continue;
                    }
                    reached.insert((step, sequence.clone()));
                    let mut asked = Asked {
                        policy,
                        power,
                        snapshot: "s1",
                    };
                    for &req in sequence {
                        let before = w.get("vm").await.unwrap();
                        let refusal = asked.refusal(req, &before);
                        match (send(&mut w, req).await, refusal) {
                            (Ok(()), None) => asked.take(req),
                            (Err(err), Some(field)) => {
                                assert!(err.contains(field), "{label}: {req:?} refused: {err}")
                            }
                            (got, refusal) => {
                                panic!("{label}: {req:?} answered {got:?}, expected a refusal naming {refusal:?}: {before:?}")
                            }
                        }
                    }
                    w.run_for(90_000).await;
                    let vm = w.get("vm").await.unwrap();
                    let end = asked.end_state();
                    assert!(
                        vm.restored_to(end),
                        "{label}: ends {:?}, expected {end:?}: {vm:?}",
                        vm.status.phase
                    );
                    assert_eq!(
                        w.hv.live_instances("vm").len(),
                        usize::from(end == PowerState::Running),
                        "{label}"
                    );
                    let data = format!("in-{}", asked.snapshot);
                    assert_eq!(
                        w.hv.disk_record("vm", SLOT).as_deref(),
                        Some(data.as_str()),
                        "{label}: disks"
                    );
                    assert!(
                        w.hv.violations().is_empty(),
                        "{label}: {:?}",
                        w.hv.violations()
                    );
                    ran += 1;
                }
            }
        }
    }
    for step in RestoreStep::ALL {
        let sequences = match step {
            RestoreStep::Requested | RestoreStep::Stopping => &singles,
            _ => &pairs,
        };
        for sequence in sequences {
            assert!(
                reached.contains(&(step, sequence.clone())),
                "{sequence:?} at {step:?} never reached"
            );
        }
    }
    println!("{ran} cases");
}
