//! Deterministic simulation of the VM lifecycle under random user requests
//! (reboots among them), controller restarts, guest misbehaviour (crashes,
//! power-offs, hangs, reboots inside the guest) and injected faults.
//!
//! Every seed is one run. A failure prints the seed; replay it with
//! `KEEL_SIM_SEED=<seed> cargo test -p keel-ctrl --test simulation`.
//! `KEEL_SIM_SEEDS=<n>` changes how many seeds run (default 1000), on
//! `KEEL_SIM_THREADS` threads (default: one per core).
//!
//! Checked after every step:
//! - never two live instances of one VM (the sim hypervisor records any start
//!   that happens while another instance of the VM is live);
//! - every live instance is the one its VM record names: bookkeeping is never
//!   dropped, nor a lookup error taken as "gone", while the instance lives;
//! - no stored record is lost: a record disappears only after its deletion
//!   was requested, and never while an instance of the VM is live (orphans
//!   planted behind the controller's back included).
//!
//! - the run-policy table: an exit nobody asked for of an instance that ran
//!   ends the run (`spec.power` becomes Stopped) exactly when the policy
//!   says so (Manual and Once: always; RerunOnFailure: after a guest
//!   power-off only; AlwaysOn and AlwaysOnUnlessStoppedManually: never),
//!   and a start that never ran never ends it.
//!
//! Checked at the end, after faults stop: every VM reaches the state its
//! record asks for within a bounded budget (nothing is stuck forever).

mod common;
#[path = "support/seeds.rs"]
mod seeds;

use std::collections::{BTreeMap, BTreeSet};

use common::{spec, World};
use keel_api::{ExitKind, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_hv::sim::{SimConfig, SimFaults};
use keel_hv::{DomainSpec, Hypervisor};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NAMES: [&str; 3] = ["alpha", "bravo", "charlie"];
const STEPS: usize = 250;
/// After faults stop, the longest it may take to converge: a full grace
/// period, the kill re-checks, the longest start backoff, boot, and slack.
const SETTLE_BUDGET_MS: u64 = 60_000 + 32_000 + 60_000 + 60_000;

fn random_faults(rng: &mut ChaCha8Rng) -> SimFaults {
    let crash_on_first_boot = rng.gen_bool(0.3);
    let mut pick = |p: f64| if rng.gen_bool(0.5) { p } else { 0.0 };
    SimFaults {
        lookup_unavailable: pick(0.3),
        op_unavailable: pick(0.2),
        vanish_between_calls: pick(0.05),
        ignore_powerdown: pick(0.3),
        crash_on_first_boot,
        spontaneous_exit: pick(0.03),
        ..Default::default()
    }
}

async fn run_seed(seed: u64) -> Result<(), String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let faults = random_faults(&mut rng);
    let sim = SimConfig {
        boot_ms: rng.gen_range(100..5_000),
        graceful_shutdown_ms: rng.gen_range(100..20_000),
        faults: faults.clone(),
        ..Default::default()
    };
    let mut w = World::new(seed, sim).await;
    *w.faulty.fail_rate.lock().unwrap() = if rng.gen_bool(0.5) { 0.1 } else { 0.0 };
    let mut deleting: BTreeSet<String> = BTreeSet::new();
    let mut existing: BTreeSet<String> = BTreeSet::new();
    let mut trace: Vec<String> = Vec::new();
    let mut orphans: BTreeSet<String> = BTreeSet::new();

    // Each VM's last version seen: every write is checked against the
    // version it replaced (writes are compare-and-swap, so that is the
    // record the writer decided on), however many reconciles a step ran.
    let mut last: BTreeMap<String, VirtualMachine> = BTreeMap::new();
    for step in 0..STEPS {
        let name = *NAMES.choose(&mut rng).unwrap();
        let roll = rng.gen_range(0..100);
        let what = match roll {
            0..=24 => {
                let exists = w.get(name).await.is_some();
                if !exists {
                    let policy = *RunPolicy::ALL.choose(&mut rng).unwrap();
                    let power = if rng.gen_bool(0.7) {
                        PowerState::Running
                    } else {
                        PowerState::Stopped
                    };
                    let grace = rng.gen_range(5..=60);
                    w.create(name, spec(policy, power, grace)).await;
                    deleting.remove(name);
                    existing.insert(name.to_string());
                    format!("create {name} {policy:?} {power:?} grace={grace}s")
                } else {
                    let op = rng.gen_range(0..6);
                    let result = match op {
                        0 => w.user_op(name, VirtualMachine::request_start).await,
                        1 => w.user_op(name, VirtualMachine::request_stop).await,
                        2 => w.user_op(name, VirtualMachine::request_restart).await,
                        5 => w.user_op(name, VirtualMachine::request_reboot).await,
                        3 => {
                            let policy = *RunPolicy::ALL.choose(&mut rng).unwrap();
                            w.user_op(name, move |vm| {
                                let mut s = vm.spec.clone();
                                s.run_policy = policy;
                                vm.replace_spec(s)
                            })
                            .await
                        }
                        _ => {
                            deleting.insert(name.to_string());
                            w.request_delete(name).await
                        }
                    };
                    format!("user op {op} on {name}: {result:?}")
                }
            }
            25..=74 => {
                if w.reconcile_due().await == 0 {
                    let jitter = rng.gen_range(0..500);
                    if let Some(at) = w.next_due() {
                        w.clock.advance_to(at + jitter);
                    }
                    w.reconcile_due().await;
                }
                format!("reconcile at t+{}", w.now() - common::T0)
            }
            75..=86 => {
                let by = rng.gen_range(0..8_000);
                w.clock.advance(by);
                format!("advance {by}ms")
            }
            87..=89 => {
                w.restart_controller().await;
                "controller restart".to_string()
            }
            90..=95 => {
                let live = w.hv.live_instances(name);
                let untracked = match w.get(name).await {
                    Some(vm) => vm.status.instance.is_none() && live.is_empty(),
                    None => false,
                };
                if untracked && rng.gen_bool(0.2) {
                    // An instance left behind by an earlier agent, unknown to the record:
                    // started, as that agent would have, on the VM's disks. (Adopted and
                    // seen running, they count as used, so they must exist.)
                    let orphan = format!("{name}-orphan-{step}");
                    let disks = spec(RunPolicy::Manual, PowerState::Running, 5).disks;
                    w.hv.start(&DomainSpec {
                        create_disks: keel_hv::DiskCreation::all_of(&disks),
                        disks,
                        ..DomainSpec::bare(name, &orphan, 1, 64)
                    })
                    .await
                    .ok();
                    orphans.insert(orphan.clone());
                    trace.push(format!("step {step}: orphan {orphan} planted"));
                    continue;
                }
                match (live.first(), rng.gen_range(0..4)) {
                    (Some(inst), 0) => {
                        w.hv.crash(inst);
                        format!("guest {inst} crashes")
                    }
                    (Some(inst), 1) => {
                        w.hv.guest_poweroff(inst);
                        format!("guest {inst} powers off")
                    }
                    (Some(inst), 2) => {
                        w.hv.guest_reset(inst);
                        format!("guest {inst} reboots")
                    }
                    (Some(inst), _) => {
                        w.hv.hang_guest(inst);
                        format!("guest {inst} hangs")
                    }
                    (None, _) => "no guest event".to_string(),
                }
            }
            _ => {
                let on = rng.gen_bool(0.5);
                w.hv.set_faults(if on {
                    faults.clone()
                } else {
                    SimFaults::default()
                });
                format!("faults {}", if on { "on" } else { "off" })
            }
        };
        trace.push(format!("step {step}: {what}"));
        check_step(&w, &existing, &deleting, &orphans)
            .await
            .map_err(|e| report(seed, &trace, &w, &e))?;
        for (name, version) in w.vm_versions().await {
            match version {
                Some(after) => {
                    if let Some(before) = last.get(&name) {
                        check_exit_per_policy(before, &after)
                            .map_err(|e| report(seed, &trace, &w, &e))?;
                    }
                    last.insert(name, after);
                }
                None => {
                    last.remove(&name);
                }
            }
        }
        // Records that finished deleting are no longer expected.
        for name in NAMES {
            if deleting.contains(name) && w.get(name).await.is_none() {
                existing.remove(name);
            }
        }
    }

    // Quiesce: faults stop, users stop; the controller must converge.
    w.hv.set_faults(SimFaults::default());
    *w.faulty.fail_rate.lock().unwrap() = 0.0;
    for name in NAMES {
        w.schedule(name);
    }
    let deadline = w.now() + SETTLE_BUDGET_MS;
    while w.now() < deadline {
        if !w.step_to_next().await {
            break;
        }
        check_step(&w, &existing, &deleting, &orphans)
            .await
            .map_err(|e| report(seed, &trace, &w, &e))?;
        if converged(&w).await.is_ok() {
            return Ok(());
        }
    }
    let why = converged(&w).await.err().unwrap_or_default();
    Err(report(
        seed,
        &trace,
        &w,
        &format!("not converged within {SETTLE_BUDGET_MS} ms after faults stopped: {why}"),
    ))
}

async fn check_step(
    w: &World,
    existing: &BTreeSet<String>,
    deleting: &BTreeSet<String>,
    orphans: &BTreeSet<String>,
) -> Result<(), String> {
    if let (n @ 1.., last) = keel_ctrl::transitions::refused_on_this_thread() {
        return Err(format!(
            "{n} forbidden phase transitions refused, the last: {last:?}"
        ));
    }
    w.check_no_untracked_instances_except(orphans).await?;
    for name in existing {
        if w.get(name).await.is_none() && !deleting.contains(name) {
            return Err(format!(
                "record of VM {name} lost without a deletion request"
            ));
        }
        if w.get(name).await.is_none() && !w.hv.live_instances(name).is_empty() {
            return Err(format!(
                "record of VM {name} deleted while an instance is live"
            ));
        }
    }
    Ok(())
}

/// When one step ended the recorded instance without a stop request, the
/// record's power follows the run-policy table (written out here, not
/// taken from the code under test).
fn check_exit_per_policy(before: &VirtualMachine, after: &VirtualMachine) -> Result<(), String> {
    let Some(inst) = &before.status.instance else {
        return Ok(());
    };
    let Some(exit) = after
        .status
        .last_exit
        .as_ref()
        .filter(|e| e.instance == inst.id)
    else {
        return Ok(());
    };
    if before.status.last_exit.as_ref() == Some(exit)
        || before.status.stop.is_some()
        || exit.requested
        || before.spec.power != PowerState::Running
        || before.spec.run_policy != after.spec.run_policy
        || before.deletion_requested_at.is_some()
        || before.restore.is_some()
    {
        return Ok(());
    }
    let ends = match before.spec.run_policy {
        RunPolicy::Manual | RunPolicy::Once => true,
        RunPolicy::RerunOnFailure => exit.kind == ExitKind::GuestPoweroff,
        RunPolicy::AlwaysOn | RunPolicy::AlwaysOnUnlessStoppedManually => false,
        RunPolicy::AlwaysOff => return Ok(()),
    };
    let ran = inst.start_error.is_none()
        && (inst.running_since.is_some() || exit.kind == ExitKind::GuestPoweroff);
    let intent_running = before
        .power_intent
        .as_ref()
        .is_some_and(|i| i.power == PowerState::Running);
    let stopped = ends && ran && !intent_running;
    if (after.spec.power == PowerState::Stopped) != stopped {
        return Err(format!(
            "{}: {:?} instance {} ended ({:?}, ran: {ran}) and power is now {:?}; the run-policy table says {}",
            before.name,
            before.spec.run_policy,
            inst.id,
            exit.kind,
            after.spec.power,
            if stopped { "Stopped" } else { "Running" }
        ));
    }
    Ok(())
}

async fn converged(w: &World) -> Result<(), String> {
    for name in NAMES {
        let live = w.hv.live_instances(name);
        match w.get(name).await {
            None => {
                if !live.is_empty() {
                    return Err(format!("{name}: deleted but {live:?} live"));
                }
            }
            Some(vm) if vm.deletion_requested_at.is_some() => {
                return Err(format!(
                    "{name}: deletion pending in phase {:?}",
                    vm.status.phase
                ))
            }
            Some(vm) if vm.wants_running() => {
                let recorded = vm.status.instance.as_ref().map(|i| i.id.clone());
                if vm.status.phase != Phase::Running
                    || live.len() != 1
                    || recorded.as_ref() != live.first()
                    || vm.restart_pending()
                {
                    return Err(format!(
                        "{name}: wants running, phase {:?}, live {live:?}, recorded {recorded:?}",
                        vm.status.phase
                    ));
                }
            }
            Some(vm) => {
                if vm.status.phase != Phase::Stopped
                    || !live.is_empty()
                    || vm.status.instance.is_some()
                {
                    return Err(format!(
                        "{name}: wants stopped, phase {:?}, live {live:?}",
                        vm.status.phase
                    ));
                }
            }
        }
    }
    Ok(())
}

fn report(seed: u64, trace: &[String], w: &World, err: &str) -> String {
    let tail = trace.len().saturating_sub(25);
    let hv_log = w.hv.log();
    let hv_tail = hv_log.len().saturating_sub(25);
    format!(
        "seed {seed} failed: {err}\nreplay: KEEL_SIM_SEED={seed} cargo test -p keel-ctrl --test simulation\nlast steps:\n  {}\nlast hypervisor calls:\n  {}",
        trace[tail..].join("\n  "),
        hv_log[hv_tail..].join("\n  ")
    )
}

#[test]
fn seeded_lifecycle_simulation() {
    let seeds = seeds::seeds("KEEL_SIM_SEED", "KEEL_SIM_SEEDS", 1000);
    seeds::run_seeds("simulation", "KEEL_SIM_SEED", &seeds, run_seed);
}
