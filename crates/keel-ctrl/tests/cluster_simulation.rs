//! Seeded simulation of a three-node cluster: random user requests,
//! drains and uncordons, network partitions of one agent, host power
//! failures, migration failures and late successes, controller restarts.
//! Each node's wall clock is off by up to a minute either way.
//! At every tick no VM executes twice anywhere and every executing
//! instance is the recorded one (or the target of a handover from it);
//! once the chaos stops, every VM reaches the state its record asks for.
//!
//! A failure names its seed: `KEEL_CLUSTER_SEED=<n> cargo test -p keel-ctrl
//! --test cluster_simulation`; `KEEL_CLUSTER_SEEDS=<n>` runs more (default 60).

mod cluster;
#[path = "support/seeds.rs"]
mod seeds;

use std::sync::atomic::Ordering;

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
    let mut c = Cluster::new(SimConfig {
        boot_ms: rng.gen_range(200..3_000),
        graceful_shutdown_ms: rng.gen_range(100..5_000),
        migration_ms: rng.gen_range(500..20_000),
        agent_ready_ms: 0,
        faults,
    });
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
    let mut trace = vec![format!("clock skews {:?}", c.skew_ms)];
    for tick in 0..CHAOS_TICKS {
        let roll = rng.gen_range(0..100);
        let what = match roll {
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
                format!("uncordon {node}")
            }
            14..=15 => {
                let i = rng.gen_range(0..NODES.len());
                let cut = !c.agents[i].partitioned.load(Ordering::SeqCst);
                c.agents[i].partitioned.store(cut, Ordering::SeqCst);
                format!("partition {} {cut}", NODES[i])
            }
            16 => {
                let i = rng.gen_range(0..NODES.len());
                if powered_off.contains(&i) {
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
    }
    // The chaos stops: every host up, every link back, no drain or cordon.
    for a in &mut c.agents {
        a.running = true;
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
    while waited < SETTLE_MS {
        if let Err(e) = futures_catch(std::panic::AssertUnwindSafe(c.tick())).await {
            return Err(report(seed, &trace, &e));
        }
        waited += TICK_MS;
        if converged(&c).await.is_ok() {
            return Ok(());
        }
    }
    let why = converged(&c).await.unwrap_err();
    Err(report(
        seed,
        &trace,
        &format!("not converged after {SETTLE_MS} ms: {why}"),
    ))
}

async fn converged(c: &Cluster) -> Result<(), String> {
    for vm in VMS {
        let record = c.vm(vm).await;
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

#[tokio::test(flavor = "current_thread")]
async fn seeded_cluster_simulation() {
    let seeds = seeds::seeds("KEEL_CLUSTER_SEED", "KEEL_CLUSTER_SEEDS", 60);
    seeds::run_seeds("cluster simulation", &seeds, run_seed).await;
}
