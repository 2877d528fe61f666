//! A node that stops heartbeating is not ready, and its VMs are started
//! elsewhere only once its lease has expired. An agent cut off from the
//! store ends its own instances before that (self-fencing), so there is
//! never a moment with two executing instances of one VM.

mod cluster;

use std::sync::atomic::Ordering;

use cluster::{sim, Cluster};
use keel_api::{ExitKind, Phase, RunPolicy};
use keel_ctrl::LifecycleConfig;

fn lease_ms() -> u64 {
    LifecycleConfig::default().node_lease_ms
}

/// Host a loses power. Node b must not start the VM until a's lease has
/// run out (a might only be unreachable); then it does.
#[tokio::test]
async fn vms_of_a_lost_node_move_only_after_its_lease_expires() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    assert!(c.executing_on("a", "vm"));
    c.add_node("b").await;
    let last_heartbeat = c.node("a").await.status.last_heartbeat;
    c.agents[0].running = false;
    c.agents[0].hv.power_failure();

    while c.now() < last_heartbeat + lease_ms() {
        c.tick().await;
        assert!(
            !c.executing_on("b", "vm"),
            "started on b before a's lease expired"
        );
        assert_eq!(c.vm("vm").await.status.instance.unwrap().node, "a");
    }
    // b counts a's silence from its own first look (its first chores, an
    // interval after it started) and looks once an interval.
    c.run(3 * keel_ctrl::node_lease::HEARTBEAT_INTERVAL_MS)
        .await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{vm:?}");
    assert_eq!(vm.status.phase, Phase::Running);
    let exit = vm.status.last_exit.unwrap();
    assert_eq!(exit.kind, ExitKind::Vanished);
    assert!(exit.instance.starts_with("vm-1"));

    // The host comes back: it knows no domain and takes nothing back.
    c.agents[0].running = true;
    c.run(5_000).await;
    assert!(c.executing_on("b", "vm"));
    assert!(!c.executing_on("a", "vm"));
}

/// Node a's agent is cut off from the store while its guest keeps running.
/// It ends the guest itself before its lease runs out; b starts the VM
/// after. At no tick do both execute (checked by the harness every tick).
#[tokio::test]
async fn a_partitioned_agent_fences_itself_before_its_lease_expires() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.agents[0].partitioned.store(true, Ordering::SeqCst);
    c.run(lease_ms() + 10_000).await;
    assert!(!c.executing_on("a", "vm"), "a fenced its instance");
    assert!(c.executing_on("b", "vm"), "b took over");

    // The partition heals: a does not start anything of its own again.
    c.agents[0].partitioned.store(false, Ordering::SeqCst);
    c.run(10_000).await;
    assert!(!c.executing_on("a", "vm"));
    assert!(c.executing_on("b", "vm"));
}

/// A node that stops heartbeating gets no new VMs.
#[tokio::test]
async fn nothing_is_placed_on_a_node_that_is_not_ready() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.add_node("b").await;
    c.agents[1].running = false;
    c.run(LifecycleConfig::default().node_ready_ms + 1_000)
        .await;
    for name in ["x", "y", "z"] {
        c.create(name, RunPolicy::AlwaysOn).await;
    }
    c.run(3_000).await;
    for name in ["x", "y", "z"] {
        assert!(c.executing_on("a", name));
        assert_eq!(c.vm(name).await.status.instance.unwrap().node, "a");
    }
}

/// Nodes with disks of their own (no shared storage): when a's lease runs
/// out, its VM is not started on b, which would mean blank disks in place
/// of the VM's own. Its instance was never fenced, so it keeps it (a may
/// still run it) and waits, with the reason on its record, and runs on a
/// again, with its data, once a is back (`ha_fencing.rs` has the guests
/// that survive).
#[tokio::test]
async fn without_shared_storage_a_lost_nodes_vm_waits_for_its_disks() {
    let mut c = Cluster::with_local_disks(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    assert!(c.executing_on("a", "vm"));
    c.agents[0].hv.guest_write("vm", 7, "written on a").unwrap();
    c.add_node("b").await;
    c.agents[0].running = false;
    c.agents[0].hv.power_failure();

    c.run(lease_ms() + 30_000).await;
    assert!(!c.executing_on("b", "vm"), "started on b");
    assert!(!c.agents[1].hv.has_disks("vm"), "b made disks for the VM");
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.instance.as_ref().unwrap().node, "a", "{vm:?}");
    let message = vm.status.message.unwrap_or_default();
    assert!(
        message.contains("not fenced (disks node-local)") && message.contains("node a"),
        "{message:?}"
    );

    c.agents[0].running = true;
    c.run(20_000).await;
    assert!(c.executing_on("a", "vm"), "{}", c.explain("vm").await);
    assert_eq!(
        c.agents[0].hv.disk_record("vm", 7).as_deref(),
        Some("written on a")
    );
}
