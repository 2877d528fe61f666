//! Placement by capacity on the sim driver and a manual clock: the node
//! reports its host (1 CPU, 2 GiB), so it offers 4 vCPUs and 1 GiB (the
//! default 1 GiB reserve, overcommit 4 and 1). A VM that does not fit
//! beside those running stays Pending with the reason, and runs once
//! another stops; a stopped VM placed there takes nothing, and starting
//! it again when the room is gone sends it back with the reason instead
//! of overcommitting the node.

mod common;

use common::{spec, World};
use keel_api::{HostResources, Node, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_ctrl::keys::node_key;
use keel_hv::sim::SimConfig;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        agent_ready_ms: 1_000,
        host: Some(HostResources {
            cpus: 1,
            memory_mib: 2_048,
        }),
        ..Default::default()
    }
}

async fn create(w: &mut World, name: &str, memory_mib: u64) {
    let mut s = spec(RunPolicy::Manual, PowerState::Running, 10);
    s.memory_mib = memory_mib;
    w.create(name, s).await;
}

#[tokio::test]
async fn a_vm_that_does_not_fit_waits_with_the_reason_and_runs_once_there_is_room() {
    let mut w = World::new(31, sim()).await;
    create(&mut w, "a", 768).await;
    w.run_for(4_000).await;
    assert_eq!(w.get("a").await.unwrap().status.phase, Phase::Running);
    let node = w
        .user
        .get::<Node>(&node_key("local"))
        .await
        .unwrap()
        .unwrap()
        .value;
    let cap = node.status.capacity.expect("reported with the heartbeat");
    assert_eq!((cap.cpus, cap.memory_mib), (4, 1_024));

    create(&mut w, "b", 512).await;
    w.run_for(5_000).await;
    let b = w.get("b").await.unwrap();
    assert_eq!(b.status.phase, Phase::Pending, "{b:?}");
    assert!(b.status.instance.is_none());
    assert_eq!(
        b.status.message.as_deref(),
        Some("no node has 1 CPU and 512 MiB free for VM b (free: local 3 CPU, 256 MiB)")
    );
    assert_eq!(w.hv.live_instances("b").len(), 0);

    w.user_op("a", VirtualMachine::request_stop).await.unwrap();
    w.run_for(20_000).await;
    assert_eq!(w.get("a").await.unwrap().status.phase, Phase::Stopped);
    let b = w.get("b").await.unwrap();
    assert_eq!(b.status.phase, Phase::Running, "{b:?}");

    // `a` is still placed on the node but takes nothing while stopped;
    // started again now, it would overcommit: not started, with why.
    w.user_op("a", VirtualMachine::request_start).await.unwrap();
    w.run_for(10_000).await;
    let a = w.get("a").await.unwrap();
    assert!(a.status.instance.is_none(), "{a:?}");
    assert_eq!(a.status.phase, Phase::Pending);
    let why = a.status.message.clone().unwrap_or_default();
    assert_eq!(
        why,
        "no node has 1 CPU and 768 MiB free for VM a (free: local 3 CPU, 512 MiB)"
    );
    w.check_no_untracked_instances().await.unwrap();
}
