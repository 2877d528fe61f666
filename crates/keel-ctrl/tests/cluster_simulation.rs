//! Seeded simulation of a three-node cluster: random user requests,
//! drains and uncordons (some asking back what the drains moved off),
//! network partitions of one agent, host power
//! failures, migration failures and late successes, controller restarts.
//! Each node's wall clock is off by up to a minute either way, and steps
//! by more than a lease either way now and then. VMs are
//! deleted and created again under the same name (a new uid), a node may
//! lose power and never return, and some worlds have no shared storage.
//! At every tick no VM executes twice anywhere and every executing
//! instance is the recorded one (or the target of a handover from it);
//! without shared storage a VM (by uid) executes only on the node holding
//! its disks: never a boot on blank disks. Once the chaos stops, every VM
//! reaches the state its record asks for, except that one whose disks
//! are on a node that never returned waits, stopped, saying why. In half
//! the worlds with shared storage each node has room for three VMs only,
//! and at every tick no node's live guests take more than it offers. In
//! half the worlds two VMs are a required anti-affinity pair, and at every
//! tick no node holds a live domain of both.
//!
//! A failure names its seed: `KEEL_CLUSTER_SEED=<n> cargo test -p keel-ctrl
//! --test cluster_simulation`; `KEEL_CLUSTER_SEEDS=<n>` sets how many (default 200).

mod cluster;
#[path = "support/seeds.rs"]
mod seeds;

use std::sync::atomic::Ordering;

use std::collections::BTreeMap;

use cluster::{Cluster, TICK_MS};
use keel_api::{EvictionWindows, RunPolicy, VirtualMachine};
use keel_hv::sim::{SimConfig, SimFaults};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NODES: [&str; 3] = ["a", "b", "c"];
const VMS: [&str; 4] = ["v0", "v1", "v2", "v3"];
const CHAOS_TICKS: usize = 240;
const SETTLE_MS: u64 = 300_000;

async fn run_seed(seed: u64) -> Result<(), String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Its own stream, so the worlds of the other draws stay what they were.
    let mut extra = ChaCha8Rng::seed_from_u64(seed ^ 0x6b65_656c);
    let faults = SimFaults {
        migration_fails: if rng.gen_bool(0.5) { 0.3 } else { 0.0 },
        cancel_too_late: if rng.gen_bool(0.5) { 0.5 } else { 0.0 },
        handover_unconfirmed: if extra.gen_bool(0.5) { 0.3 } else { 0.0 },
        ..Default::default()
    };
    let sim = SimConfig {
        boot_ms: rng.gen_range(200..3_000),
        graceful_shutdown_ms: rng.gen_range(100..5_000),
        migration_ms: rng.gen_range(500..20_000),
        agent_ready_ms: 0,
        faults,
        agent_answers: None,
        host: None,
    };
    // A third stream for the draws added with deletes, lost nodes and
    // node-local disks.
    let mut more = ChaCha8Rng::seed_from_u64(seed ^ 0x7569_6473);
    let local_disks = more.gen_bool(0.3);
    // A fifth stream: in half the worlds with shared storage, each node
    // offers room for three of the four VMs (1 CPU and 1.4 GiB less the
    // 1 GiB reserve: 400 MiB, 128 MiB each), so that placement, drains
    // and takeovers must go by fit; two nodes up hold all four.
    let mut room = ChaCha8Rng::seed_from_u64(seed ^ 0x726f_6f6d);
    let sized = !local_disks && room.gen_bool(0.5);
    let sim = SimConfig {
        host: sized.then_some(keel_api::HostResources {
            cpus: 1,
            memory_mib: 1_024 + 400,
        }),
        ..sim
    };
    let mut c = if local_disks {
        Cluster::with_local_disks(sim)
    } else {
        Cluster::new(sim)
    };
    // Wall clocks up to a minute apart: liveness and takeover must not
    // depend on them.
    for node in NODES {
        let skew = if rng.gen_bool(0.7) {
            rng.gen_range(-60_000..=60_000)
        } else {
            0
        };
        c.skew_ms.insert(node.to_string(), skew);
        c.add_node(node).await;
    }
    // A sixth stream: in half the worlds v0 and v1 are a required
    // anti-affinity pair, kept on distinct nodes through placement,
    // drains, migrations and takeovers.
    let mut groups = ChaCha8Rng::seed_from_u64(seed ^ 0x6170_6172);
    if groups.gen_bool(0.5) {
        c.apart = vec!["v0".into(), "v1".into()];
    }
    for vm in VMS {
        let policy = *[
            RunPolicy::AlwaysOn,
            RunPolicy::Manual,
            RunPolicy::AlwaysOnUnlessStoppedManually,
            RunPolicy::RerunOnFailure,
            RunPolicy::Once,
        ]
        .choose(&mut rng)
        .unwrap();
        c.create(vm, policy).await;
    }
    let mut powered_off: Vec<usize> = Vec::new();
    // Lost for good: never powered on again.
    let mut dead: Option<usize> = None;
    // Deleted, to be created again (same name, new uid) once gone.
    let mut recreate: Vec<&str> = Vec::new();
    // Without shared storage: where each VM's (uid's) disks are.
    let mut homes: BTreeMap<String, String> = BTreeMap::new();
    let mut trace = vec![format!(
        "clock skews {:?}, local disks {local_disks}, room for 3 VMs a node {sized}, apart {:?}",
        c.skew_ms, c.apart
    )];
    // A fourth stream: wall-clock steps of one node by more than a lease,
    // either way, away from its usual skew or back to it (as NTP corrects
    // a clock that strayed). Nothing that decides a fence, a takeover or a
    // freeze may be measured on them.
    let mut clocks = ChaCha8Rng::seed_from_u64(seed ^ 0x636c_6f63);
    let mut strayed: BTreeMap<&str, i64> = BTreeMap::new();
    for tick in 0..CHAOS_TICKS {
        if clocks.gen_bool(0.03) {
            let node = *NODES.choose(&mut clocks).unwrap();
            let away = strayed.get(node).copied().unwrap_or(0);
            let to = if away != 0 && clocks.gen_bool(0.5) {
                0
            } else {
                clocks.gen_range(45_000..=120_000) * if clocks.gen_bool(0.5) { 1 } else { -1 }
            };
            c.step_wall(node, to - away);
            strayed.insert(node, to);
            trace.push(format!(
                "t{tick}: wall clock of {node} steps {} ms",
                to - away
            ));
        }
        let roll = rng.gen_range(0..100);
        let more_roll = more.gen_range(0..100);
        let what = match roll {
            _ if more_roll < 2 => {
                let vm = *VMS.choose(&mut more).unwrap();
                if recreate.contains(&vm) {
                    "tick".to_string()
                } else {
                    let now = c.now();
                    c.update_vm(vm, move |v: &mut VirtualMachine| {
                        v.deletion_requested_at.get_or_insert(now);
                    })
                    .await;
                    recreate.push(vm);
                    format!("delete {vm} (to be created again)")
                }
            }
            _ if more_roll == 2 && dead.is_none() && more.gen_bool(0.3) => {
                let i = more.gen_range(0..NODES.len());
                c.agents[i].running = false;
                c.agents[i].hv.power_failure();
                powered_off.retain(|p| *p != i);
                dead = Some(i);
                format!("power failure {}, for good", NODES[i])
            }
            0..=7 => {
                let vm = *VMS.choose(&mut rng).unwrap();
                let op = rng.gen_range(0..3);
                c.update_vm(vm, move |v: &mut VirtualMachine| {
                    let _ = match op {
                        0 => v.request_start(),
                        1 => v.request_stop(),
                        _ => v.request_restart(),
                    };
                })
                .await;
                format!("user op {op} on {vm}")
            }
            8..=10 => {
                let node = *NODES.choose(&mut rng).unwrap();
                let now = c.now();
                let windows = EvictionWindows {
                    submit_ms: rng.gen_range(1_000..20_000),
                    migrate_ms: rng.gen_range(1_000..30_000),
                    fallback_ms: rng.gen_range(5_000..60_000),
                };
                c.update_node(node, move |n| n.request_drain(now, windows))
                    .await;
                format!("drain {node} {windows:?}")
            }
            11..=13 => {
                let node = *NODES.choose(&mut rng).unwrap();
                c.update_node(node, |n| {
                    n.uncordon_by_keel();
                })
                .await;
                // Half the time with `--return`: what its drains moved
                // off is asked back.
                if groups.gen_bool(0.5) {
                    let now = c.now();
                    for vm in VMS {
                        let key = keel_ctrl::keys::vm_key(vm);
                        if c.store.get::<VirtualMachine>(&key).await.unwrap().is_some() {
                            c.update_vm(vm, move |v: &mut VirtualMachine| {
                                let _ = v.request_return(node, now);
                            })
                            .await;
                        }
                    }
                    format!("uncordon {node} --return")
                } else {
                    format!("uncordon {node}")
                }
            }
            14..=15 => {
                let i = rng.gen_range(0..NODES.len());
                let cut = !c.agents[i].partitioned.load(Ordering::SeqCst);
                c.agents[i].partitioned.store(cut, Ordering::SeqCst);
                format!("partition {} {cut}", NODES[i])
            }
            16 => {
                let i = rng.gen_range(0..NODES.len());
                if dead == Some(i) {
                    "tick".to_string()
                } else if powered_off.contains(&i) {
                    c.agents[i].running = true;
                    powered_off.retain(|p| *p != i);
                    format!("power on {}", NODES[i])
                } else {
                    c.agents[i].running = false;
                    c.agents[i].hv.power_failure();
                    powered_off.push(i);
                    format!("power failure {}", NODES[i])
                }
            }
            17 => {
                c.restart_controllers();
                "controller restarts".to_string()
            }
            _ => "tick".to_string(),
        };
        trace.push(format!("t{tick}: {what}"));
        let caught = std::panic::AssertUnwindSafe(c.tick());
        if let Err(e) = futures_catch(caught).await {
            return Err(report(seed, &trace, &e));
        }
        if let Err(e) = after_tick(&mut c, &mut recreate, &mut homes, local_disks, &mut more).await
        {
            return Err(report(seed, &trace, &e));
        }
    }
    // The chaos stops: every host up but the dead one, every link back, no
    // drain or cordon.
    for (i, a) in c.agents.iter_mut().enumerate() {
        a.running = dead != Some(i);
        a.partitioned.store(false, Ordering::SeqCst);
    }
    for node in NODES {
        c.update_node(node, |n| {
            n.uncordon_by_keel();
        })
        .await;
    }
    c.restart_controllers();
    let mut waited = 0;
    let dead = dead.map(|i| NODES[i]);
    while waited < SETTLE_MS {
        if let Err(e) = futures_catch(std::panic::AssertUnwindSafe(c.tick())).await {
            return Err(report(seed, &trace, &e));
        }
        if let Err(e) = after_tick(&mut c, &mut recreate, &mut homes, local_disks, &mut more).await
        {
            return Err(report(seed, &trace, &e));
        }
        waited += TICK_MS;
        if stranded_only(&c, &recreate, dead).await && converged(&c, dead).await.is_ok() {
            return Ok(());
        }
    }
    let why = match converged(&c, dead).await {
        Err(why) => why,
        Ok(()) => {
            let mut why = format!("deleted VMs {recreate:?} never went away");
            for vm in &recreate {
                why.push_str(&format!("\n{}", c.explain(vm).await));
            }
            why
        }
    };
    Err(report(
        seed,
        &trace,
        &format!("not converged after {SETTLE_MS} ms: {why}"),
    ))
}

/// After each tick: deleted VMs that are gone are created again (a new
/// uid, a random policy); without shared storage, every executing
/// instance is on the node that holds its VM's disks.
async fn after_tick(
    c: &mut Cluster,
    recreate: &mut Vec<&str>,
    homes: &mut BTreeMap<String, String>,
    local_disks: bool,
    rng: &mut ChaCha8Rng,
) -> Result<(), String> {
    if let (n @ 1.., last) = keel_ctrl::transitions::refused_on_this_thread() {
        return Err(format!(
            "{n} forbidden phase transitions refused, the last: {last:?}"
        ));
    }
    let mut i = 0;
    while i < recreate.len() {
        let vm = recreate[i];
        let gone = c
            .store
            .get::<VirtualMachine>(&keel_ctrl::keys::vm_key(vm))
            .await
            .map_err(|e| e.to_string())?
            .is_none();
        if gone {
            let executing: Vec<String> = c
                .agents
                .iter()
                .flat_map(|a| a.hv.executing_instances(vm))
                .collect();
            if !executing.is_empty() {
                return Err(format!("{vm} deleted while {executing:?} execute"));
            }
            let policy = *POLICIES.choose(rng).unwrap();
            c.create(vm, policy).await;
            recreate.remove(i);
        } else {
            i += 1;
        }
    }
    if local_disks {
        for vm in VMS {
            let Some(record) = c
                .store
                .get::<VirtualMachine>(&keel_ctrl::keys::vm_key(vm))
                .await
                .map_err(|e| e.to_string())?
            else {
                continue;
            };
            for a in &c.agents {
                if a.hv.executing_instances(vm).is_empty() {
                    continue;
                }
                let home = homes
                    .entry(record.value.uid.clone())
                    .or_insert_with(|| a.name.clone());
                if *home != a.name {
                    return Err(format!(
                        "{vm} (uid {}) executes on {} but its disks are on {home}: a boot on blank disks",
                        record.value.uid, a.name
                    ));
                }
            }
        }
    }
    Ok(())
}

const POLICIES: [RunPolicy; 5] = [
    RunPolicy::AlwaysOn,
    RunPolicy::Manual,
    RunPolicy::AlwaysOnUnlessStoppedManually,
    RunPolicy::RerunOnFailure,
    RunPolicy::Once,
];

/// Whether every VM still to be deleted has its disks on the lost node:
/// it cannot be deleted before they are (and waits, saying why).
async fn stranded_only(c: &Cluster, recreate: &[&str], dead: Option<&str>) -> bool {
    for vm in recreate {
        let record = c.vm(vm).await;
        let on_dead = dead.is_some_and(|d| {
            record.status.disk_home == Some(keel_api::DiskHome::Node(d.to_string()))
        });
        if !on_dead {
            return false;
        }
    }
    true
}

/// Every VM in the state its record asks for; one whose disks are only on
/// `dead` (a node that never returns) instead waits with no instance and
/// the reason on its record.
async fn converged(c: &Cluster, dead: Option<&str>) -> Result<(), String> {
    for vm in VMS {
        let record = c.vm(vm).await;
        let stranded = dead.is_some_and(|d| {
            record.status.disk_home == Some(keel_api::DiskHome::Node(d.to_string()))
        });
        // An instance that was never fenced (no other node could take it
        // over) stays recorded on its node, running or stopping, whatever
        // the VM wants now: only that node can end it.
        let kept_on_dead = record
            .status
            .instance
            .as_ref()
            .is_some_and(|inst| !inst.fenced && dead == Some(inst.node.as_str()));
        if stranded && (record.wants_running() || kept_on_dead) {
            let message = record.status.message.as_deref().unwrap_or_default();
            let waits = if record.status.instance.is_none() {
                message.contains("where its disks are")
            } else {
                kept_on_dead && message.contains("waits for its node")
            };
            if !waits {
                return Err(format!(
                    "{vm} has its disks on lost node {}: {:?}",
                    dead.unwrap_or_default(),
                    record.status
                ));
            }
            continue;
        }
        let executing: Vec<(String, String)> = c
            .agents
            .iter()
            .flat_map(|a| {
                a.hv.executing_instances(vm)
                    .into_iter()
                    .map(|i| (a.name.clone(), i))
                    .collect::<Vec<_>>()
            })
            .collect();
        let recorded = record
            .status
            .instance
            .as_ref()
            .map(|i| (i.node.clone(), i.id.clone()));
        if record.wants_running() {
            if executing.len() != 1 || recorded.as_ref() != executing.first() {
                return Err(format!(
                    "{vm} wants running: executing {executing:?}, recorded {recorded:?}"
                ));
            }
        } else if !executing.is_empty() || recorded.is_some() {
            return Err(format!(
                "{vm} wants stopped: executing {executing:?}, recorded {recorded:?}"
            ));
        }
    }
    Ok(())
}

/// Runs a tick, turning an invariant panic into an error with its message.
async fn futures_catch<F: std::future::Future<Output = ()>>(
    f: std::panic::AssertUnwindSafe<F>,
) -> Result<(), String> {
    use futures_util::FutureExt;
    f.catch_unwind().await.map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into())
    })
}

fn report(seed: u64, trace: &[String], err: &str) -> String {
    let tail = trace.len().saturating_sub(30);
    format!(
        "seed {seed} failed: {err}\nreplay: KEEL_CLUSTER_SEED={seed} cargo test -p keel-ctrl --test cluster_simulation\nlast events:\n  {}",
        trace[tail..].join("\n  ")
    )
}

#[test]
fn seeded_cluster_simulation() {
    let seeds = seeds::seeds("KEEL_CLUSTER_SEED", "KEEL_CLUSTER_SEEDS", 200);
    seeds::run_seeds("cluster simulation", "KEEL_CLUSTER_SEED", &seeds, run_seed);
}
