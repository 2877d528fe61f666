//! Back home after maintenance: a drain that moves a VM off its node marks
//! the VM with that node, in the write that moves it (by live migration,
//! or by the fallback's stop and start elsewhere); asked back (the API's
//! `uncordon --return`, `VirtualMachine::request_return`), the VM
//! live-migrates home through a user's bounded migration, without a
//! restart. A required anti-affinity pair over two nodes keeps the drain
//! from putting both members on one node: the eviction names the rule,
//! and the member waits with the reason instead.

mod cluster;

use cluster::Cluster;
use keel_api::{Phase, RunPolicy, VirtualMachine};

async fn until(
    c: &mut Cluster,
    what: &str,
    pred: impl Fn(&VirtualMachine) -> bool,
) -> VirtualMachine {
    for _ in 0..300 {
        let vm = c.vm("vm").await;
        if pred(&vm) {
            return vm;
        }
        c.tick().await;
    }
    panic!("never {what}: {:?}", c.vm("vm").await);
}

fn on(vm: &VirtualMachine, node: &str) -> bool {
    vm.status.phase == Phase::Running
        && vm.status.instance.as_ref().is_some_and(|i| i.node == node)
        && vm.status.eviction.is_none()
}

#[tokio::test]
async fn a_drained_vm_is_migrated_back_when_asked() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    c.drain("a").await;
    let moved = until(&mut c, "moved to b", |vm| on(vm, "b")).await;
    let mark = moved
        .status
        .drained_from
        .clone()
        .expect("marked by the drain");
    assert_eq!(mark.node, "a");
    let instance = moved.status.instance.clone().unwrap().id;
    c.update_node("a", |n| {
        n.uncordon_by_keel();
    })
    .await;
    let now = c.now();
    c.update_vm("vm", move |vm| vm.request_return("a", now).unwrap())
        .await;
    let home = until(&mut c, "back on a", |vm| on(vm, "a")).await;
    assert!(home.status.drained_from.is_none(), "{:?}", home.status);
    assert!(home
        .status
        .migrate_outcome
        .as_ref()
        .is_some_and(|o| o.succeeded));
    // Live: the same guest, moved twice, never restarted.
    assert_eq!(home.status.last_exit, moved.status.last_exit);
    assert_ne!(home.status.instance.unwrap().id, instance);
    assert!(!c.executing_on("b", "vm"));
}

#[tokio::test]
async fn a_vm_the_fallback_moved_is_marked_too() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    // Every migration fails: the drain falls back to stop and start on b.
    for a in &c.agents {
        a.hv.set_faults(keel_hv::sim::SimFaults {
            migration_fails: 1.0,
            ..Default::default()
        });
    }
    c.drain("a").await;
    let moved = until(&mut c, "started on b", |vm| on(vm, "b")).await;
    assert_eq!(
        moved.status.drained_from.map(|d| d.node).as_deref(),
        Some("a")
    );
}

#[tokio::test]
async fn a_drain_leaves_a_required_pair_member_waiting_with_the_reason() {
    let mut c = Cluster::new(cluster::sim());
    c.apart = vec!["vm".into(), "w2".into()];
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.create("w2", RunPolicy::AlwaysOn).await;
    c.run(5_000).await;
    assert!(c.executing_on("b", "w2"));
    c.drain("a").await;
    // The drain says which rule keeps the VM from migrating before it
    // falls back to the stop, not only "no node to migrate to".
    until(&mut c, "an eviction naming the rule", |vm| {
        vm.status
            .eviction
            .as_ref()
            .and_then(|e| e.message.as_deref())
            .is_some_and(|m| {
                m.contains("no node to migrate to: no node may take VM vm by its placement rules")
                    && m.contains("b has VM w2 of anti-affinity group")
            })
    })
    .await;
    let waits = until(&mut c, "wait with the reason", |vm| {
        vm.status.instance.is_none()
            && vm
                .status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("b has VM w2 of anti-affinity group"))
    })
    .await;
    assert_eq!(waits.status.phase, Phase::Pending, "{:?}", waits.status);
    c.run(30_000).await;
    assert!(!c.executing_on("b", "vm"));
    assert!(c.executing_on("b", "w2"));
}
