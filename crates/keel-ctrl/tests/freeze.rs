//! Planned agent restarts: a bounded freeze of the node. While it lasts,
//! nothing of the node is taken over and its guests keep running without
//! their agent; the fence lease reaches to the freeze's end, so the guests
//! are fenced if the agent has not returned by then, and the cluster takes
//! over only after that end plus the margin a lost node gets. An agent back
//! within the freeze re-adopts its guests and ends the freeze. On a manual
//! clock, with the fence keeper modelled by the sim driver; the harness
//! checks after every tick that no VM executes twice.
//!
//! Also: an agent whose own lease is stale starts nothing.

mod cluster;

use cluster::{sim, Cluster};
use keel_api::{Phase, PowerState, RunPolicy};
use keel_ctrl::LifecycleConfig;

const FREEZE_MS: u64 = 120_000;

fn cfg() -> LifecycleConfig {
    LifecycleConfig::default()
}

/// The margin between the freeze's end and the takeover: as between a
/// lost node's fence and its takeover.
fn margin() -> u64 {
    cfg().node_lease_ms - cfg().self_fence_ms
}

/// Node a runs `vm`; its agent freezes the node (as on SIGTERM) and exits.
async fn frozen_and_gone(skew_a: i64, skew_b: i64) -> (Cluster, String, u64) {
    let mut c = Cluster::new(sim());
    c.skew_ms.insert("a".into(), skew_a);
    c.skew_ms.insert("b".into(), skew_b);
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.run(10_000).await;
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.phase, Phase::Running);
    let instance = vm.status.instance.unwrap().id;
    let a = c.agent_index("a");
    c.agents[a]
        .vms
        .freeze_for_restart(FREEZE_MS, "agent restart (test)")
        .await
        .unwrap();
    c.agents[a].running = false;
    let frozen_at = c.now();
    let node = c.node("a").await;
    assert_eq!(node.freeze.unwrap().duration_ms, FREEZE_MS);
    (c, instance, frozen_at)
}

/// The agent does not come back. Throughout the freeze the guest runs on a
/// and the VM stays a's; its keeper ends it at the freeze's end at the
/// latest, and only after end + margin does b start the VM. With clocks a
/// minute apart either way, the same.
#[tokio::test]
async fn no_takeover_during_a_freeze_and_after_it_only_once_the_guest_is_fenced() {
    for (skew_a, skew_b) in [(0, 0), (60_000, -60_000), (-60_000, 60_000)] {
        let (mut c, instance, frozen_at) = frozen_and_gone(skew_a, skew_b).await;
        let mut fenced_at = None;
        let mut taken_at = None;
        while c.now() < frozen_at + FREEZE_MS + margin() + 20_000 {
            c.tick().await;
            let now = c.now();
            if fenced_at.is_none() && !c.executing_on("a", "vm") {
                fenced_at = Some(now);
            }
            let vm = c.vm("vm").await;
            let owner = vm.owner_node().map(str::to_string);
            if taken_at.is_none() && owner.as_deref() != Some("a") {
                taken_at = Some(now);
            }
            if now <= frozen_at + FREEZE_MS {
                assert_eq!(owner.as_deref(), Some("a"), "taken over during the freeze");
                assert!(!c.executing_on("b", "vm"));
            }
            if now < frozen_at + FREEZE_MS - 1_000 {
                assert!(c.executing_on("a", "vm"), "the guest must keep running");
                assert_eq!(vm.status.instance.as_ref().unwrap().id, instance);
            }
        }
        let (fenced_at, taken_at) = (fenced_at.unwrap(), taken_at.expect("never taken over"));
        assert!(
            fenced_at <= frozen_at + FREEZE_MS + 500,
            "skew {skew_a}/{skew_b}: fenced {} ms after the freeze began",
            fenced_at - frozen_at
        );
        assert!(
            taken_at >= frozen_at + FREEZE_MS + margin(),
            "skew {skew_a}/{skew_b}: taken over {} ms after the freeze began",
            taken_at - frozen_at
        );
        assert!(taken_at > fenced_at);
        assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    }
}

/// The agent is back within the freeze: the same instance is re-adopted,
/// never restarted or taken over, and the freeze is gone from the record.
#[tokio::test]
async fn an_agent_back_within_the_freeze_keeps_its_guest_and_ends_the_freeze() {
    let (mut c, instance, frozen_at) = frozen_and_gone(30_000, -30_000).await;
    c.run(FREEZE_MS / 2).await;
    c.restart_agent("a");
    c.run(FREEZE_MS + margin() + 60_000).await;
    let vm = c.vm("vm").await;
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(
        (inst.id.as_str(), inst.node.as_str()),
        (instance.as_str(), "a")
    );
    assert_eq!(vm.status.phase, Phase::Running);
    assert!(c.executing_on("a", "vm") && !c.executing_on("b", "vm"));
    assert!(c.node("a").await.freeze.is_none(), "the freeze stays");
    assert!(c.now() > frozen_at + FREEZE_MS + margin());
}

/// An operator's freeze of a live node (`keel node freeze`), and then the
/// agent dies without a word (kill -9): the freeze still holds, counted
/// from before the agent saw it; the guest is fenced by its end and the
/// VM moves only after end + margin.
#[tokio::test]
async fn an_operator_freeze_holds_when_the_agent_then_dies() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.run(10_000).await;
    let asked_at = c.now();
    c.update_node("a", |n| {
        n.request_freeze(asked_at, FREEZE_MS, "operator").unwrap()
    })
    .await;
    c.run(20_000).await;
    assert!(c.node("a").await.freeze.is_some(), "a live agent keeps it");
    let a = c.agent_index("a");
    c.agents[a].running = false;
    let mut taken_at = None;
    while c.now() < asked_at + FREEZE_MS + margin() + 20_000 {
        c.tick().await;
        if c.now() < asked_at + FREEZE_MS - 6_000 {
            assert!(c.executing_on("a", "vm"), "fenced early");
        }
        if taken_at.is_none() && c.vm("vm").await.owner_node() != Some("a") {
            taken_at = Some(c.now());
        }
    }
    let taken_at = taken_at.expect("never taken over");
    assert!(
        taken_at >= asked_at + FREEZE_MS + margin(),
        "{}",
        taken_at - asked_at
    );
    assert!(c.executing_on("b", "vm"));
}

/// A live agent ends an operator's freeze once it is over, and its lease
/// is the normal one again: killed then, its guest is fenced and its VM
/// taken over as for any lost node.
#[tokio::test]
async fn a_freeze_ends_by_itself() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    let asked_at = c.now();
    c.update_node("a", |n| {
        n.request_freeze(asked_at, 30_000, "operator").unwrap()
    })
    .await;
    c.run(45_000).await;
    assert!(c.node("a").await.freeze.is_none(), "the freeze is over");
    let a = c.agent_index("a");
    c.agents[a].running = false;
    let stopped_at = c.now();
    c.run(cfg().node_lease_ms + 10_000).await;
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    let _ = stopped_at;
}

/// An agent whose heartbeat has not got through within its lease starts
/// nothing, though it can still write VM records; once a heartbeat gets
/// through, it starts the VM.
#[tokio::test]
async fn an_agent_whose_lease_is_stale_starts_nothing() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::Manual).await;
    c.update_vm("vm", |v| v.spec.power = PowerState::Stopped)
        .await;
    c.agents[0].vms.heartbeat(None).await.unwrap();
    // The control plane places it on the only node.
    c.control.reconcile().await.unwrap();
    for _ in 0..3 {
        c.agents[0].vms.reconcile("vm").await.unwrap();
    }
    c.clock.advance(cfg().self_fence_ms + 1);
    c.update_vm("vm", |v| v.request_start().unwrap()).await;
    for _ in 0..5 {
        c.agents[0].vms.reconcile("vm").await.unwrap();
        c.clock.advance(1_000);
    }
    let vm = c.vm("vm").await;
    assert!(vm.status.instance.is_none(), "{:?}", vm.status);
    assert!(!c.executing_on("a", "vm"));

    c.agents[0].vms.heartbeat(None).await.unwrap();
    for _ in 0..3 {
        c.agents[0].vms.reconcile("vm").await.unwrap();
    }
    assert!(c.vm("vm").await.status.instance.is_some());
}
