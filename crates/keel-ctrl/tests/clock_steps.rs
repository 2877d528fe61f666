//! Wall clocks that step. Every duration that decides a fence, a takeover
//! or a freeze is measured on the monotonic clock, so stepping any node's
//! wall clock by more than a lease, forward or back, with every agent
//! healthy, loses no node and moves, restarts or fences no VM; and a step
//! back during a freeze does not stretch the fence lease past the freeze's
//! end as the observers count it. The harness checks after every tick that
//! no VM executes twice.

mod cluster;

use cluster::{sim, Cluster};
use keel_api::{Phase, RunPolicy};
use keel_ctrl::LifecycleConfig;

const FREEZE_MS: u64 = 120_000;

/// Each VM's (node, instance id), or why not Running.
async fn placements(c: &Cluster, vms: &[&str]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in vms {
        let vm = c.vm(name).await;
        assert_eq!(vm.status.phase, Phase::Running, "{}", c.explain(name).await);
        let inst = vm.status.instance.unwrap();
        out.push((inst.node, inst.id));
    }
    out
}

#[tokio::test]
async fn wall_steps_of_healthy_nodes_move_restart_or_fence_nothing() {
    let lease = LifecycleConfig::default().node_lease_ms as i64;
    let mut c = Cluster::new(sim());
    for node in ["a", "b", "c"] {
        c.add_node(node).await;
    }
    let vms = ["v0", "v1", "v2", "v3", "v4", "v5"];
    for vm in vms {
        c.create(vm, RunPolicy::AlwaysOn).await;
    }
    c.run(20_000).await;
    let before = placements(&c, &vms).await;
    // Forward and back by more than a lease, one node at a time and all
    // at once, with time passing in between.
    let steps: [(&[&str], i64); 6] = [
        (&["a"], 90_000),
        (&["b"], -90_000),
        (&["c"], 2 * lease),
        (&["a", "b", "c"], -3 * lease),
        (&["a"], -90_000),
        (&["b", "c"], 3_600_000),
    ];
    for (nodes, by) in steps {
        for node in nodes {
            c.step_wall(node, by);
        }
        c.run(2 * lease as u64).await;
        assert_eq!(
            placements(&c, &vms).await,
            before,
            "after {by} ms on {nodes:?}"
        );
        for node in ["a", "b", "c"] {
            for vm in vms {
                let on = before
                    .iter()
                    .zip(vms)
                    .any(|((n, _), v)| n == node && v == vm);
                assert_eq!(c.executing_on(node, vm), on, "{vm} on {node}");
            }
        }
    }
}

/// Node a is frozen for a planned restart while its agent still runs; its
/// wall clock is set back 90 s; it heartbeats once more and dies. Its
/// guest is fenced by the freeze's end in true time (not 90 s later, as
/// when the lease was extended to a wall-clock end) and only then taken
/// over on b.
#[tokio::test]
async fn a_wall_step_back_during_a_freeze_does_not_stretch_the_fence_lease() {
    let cfg = LifecycleConfig::default();
    let margin = cfg.node_lease_ms - cfg.self_fence_ms;
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.run(10_000).await;
    let instance = c.vm("vm").await.status.instance.unwrap().id;
    let a = c.agent_index("a");
    c.agents[a]
        .vms
        .freeze_for_restart(FREEZE_MS, "agent restart (test)")
        .await
        .unwrap();
    let frozen_at = c.now();
    c.run(10_000).await;
    c.step_wall("a", -90_000);
    c.run(10_000).await;
    c.agents[a].running = false;
    let mut fenced_at = None;
    let mut taken_at = None;
    while c.now() < frozen_at + FREEZE_MS + margin + 120_000 {
        c.tick().await;
        let now = c.now();
        if fenced_at.is_none() && !c.executing_on("a", "vm") {
            fenced_at = Some(now);
        }
        let vm = c.vm("vm").await;
        if taken_at.is_none() && vm.owner_node() != Some("a") {
            taken_at = Some(now);
        }
        if now < frozen_at + FREEZE_MS - 1_000 {
            assert!(c.executing_on("a", "vm"), "fenced early");
            assert_eq!(vm.status.instance.unwrap().id, instance);
        }
    }
    let fenced_at = fenced_at.expect("never fenced");
    assert!(
        fenced_at <= frozen_at + FREEZE_MS + 500,
        "fenced {} ms after the freeze began",
        fenced_at - frozen_at
    );
    let taken_at = taken_at.expect("never taken over");
    assert!(taken_at > fenced_at);
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
}
