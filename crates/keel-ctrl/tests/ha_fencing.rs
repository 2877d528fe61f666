//! Fence only what could run elsewhere: an instance is fenced (killed when
//! its node's lease lapses, taken over once the node is lost) only if HA
//! is on *and* its disks are shared. Any other guest keeps running through
//! its agent's death and store partitions, its VM keeps its instance with
//! the reason on its record, and the agent takes it up again when back.
//! The harness checks after every tick that no VM executes twice.

mod cluster;

use std::sync::atomic::Ordering;

use cluster::{sim, Cluster};
use keel_api::{Phase, RunPolicy};
use keel_ctrl::LifecycleConfig;

fn lease_ms() -> u64 {
    LifecycleConfig::default().node_lease_ms
}

/// Node `a` runs `vm` (with `ha`), on local disks or shared ones; node `b`
/// joins empty.
async fn vm_on_a(local_disks: bool, ha: Option<bool>) -> Cluster {
    let mut c = if local_disks {
        Cluster::with_local_disks(sim())
    } else {
        Cluster::new(sim())
    };
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.update_vm("vm", |v| v.spec.ha = ha).await;
    c.run(3_000).await;
    assert!(c.executing_on("a", "vm"), "{}", c.explain("vm").await);
    c.add_node("b").await;
    c
}

fn executing(c: &Cluster, node: &str) -> Vec<String> {
    c.agent(node).hv.executing_instances("vm")
}

/// Local disks (HA asked for or not): the agent dies (kill -9: no
/// heartbeat, no fence renewal) for well past the node lease. Its guest is
/// never killed, the VM keeps its instance and node with the reason on the
/// record, and the restarted agent re-adopts the same instance: Running,
/// no new instance.
#[tokio::test]
async fn a_dead_agents_unfenced_guest_keeps_running_and_is_readopted() {
    for ha in [None, Some(true)] {
        let mut c = vm_on_a(true, ha).await;
        let before = c.vm("vm").await.status.instance.unwrap();
        assert!(!before.fenced, "ha {ha:?} on local disks fences nothing");
        c.agents[0].running = false;
        for _ in 0..(lease_ms() + 30_000) / 500 {
            c.tick().await;
            assert_eq!(executing(&c, "a"), vec![before.id.clone()], "ha {ha:?}");
        }
        let vm = c.vm("vm").await;
        let inst = vm.status.instance.clone().expect("instance kept");
        assert_eq!(
            (inst.id.as_str(), inst.node.as_str()),
            (before.id.as_str(), "a")
        );
        let message = vm.status.message.clone().unwrap_or_default();
        assert!(
            message.contains("node a lost its lease")
                && message.contains(&format!("instance {} is not fenced", before.id))
                && message.contains("disks node-local")
                && message.contains("waits for its node"),
            "{message:?}"
        );
        assert!(!c.agents[1].hv.has_disks("vm"), "b made disks for the VM");

        c.restart_agent("a");
        c.run(5_000).await;
        let vm = c.vm("vm").await;
        assert_eq!(vm.status.phase, Phase::Running, "{}", c.explain("vm").await);
        assert_eq!(vm.status.instance.unwrap().id, before.id, "no new instance");
        assert_eq!(vm.status.message, None, "the reason went with the wait");
        assert_eq!(executing(&c, "a"), vec![before.id.clone()]);
        assert_eq!(vm.status.instance_seq, 1);
    }
}

/// Local disks: the agent runs but cannot reach the store for a minute.
/// It does not fence its unfenced guest itself either, and once the store
/// is back the VM is Running on the same instance.
#[tokio::test]
async fn a_partitioned_agent_spares_its_unfenced_guest() {
    let mut c = vm_on_a(true, None).await;
    let before = c.vm("vm").await.status.instance.unwrap();
    c.agents[0].partitioned.store(true, Ordering::SeqCst);
    for _ in 0..(lease_ms() + 20_000) / 500 {
        c.tick().await;
        assert_eq!(executing(&c, "a"), vec![before.id.clone()]);
    }
    c.agents[0].partitioned.store(false, Ordering::SeqCst);
    c.run(5_000).await;
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.phase, Phase::Running, "{}", c.explain("vm").await);
    assert_eq!(vm.status.instance.unwrap().id, before.id);
    assert_eq!(executing(&c, "a"), vec![before.id]);
    assert!(executing(&c, "b").is_empty());
}

/// Shared disks, HA by default on: fenced as before. The partitioned
/// agent kills its guest, and b takes the VM over after the node lease.
#[tokio::test]
async fn shared_disks_with_ha_are_fenced_and_taken_over() {
    let mut c = vm_on_a(false, None).await;
    let before = c.vm("vm").await.status.instance.unwrap();
    assert!(before.fenced);
    c.agents[0].partitioned.store(true, Ordering::SeqCst);
    c.run(lease_ms() + 10_000).await;
    assert!(executing(&c, "a").is_empty(), "a fenced its instance");
    assert!(c.executing_on("b", "vm"), "b took over");
    assert_ne!(c.vm("vm").await.status.instance.unwrap().id, before.id);
}

/// Shared disks with HA off: never fenced, never taken over, though
/// another node could open its disks.
#[tokio::test]
async fn shared_disks_with_ha_off_wait_for_their_node() {
    let mut c = vm_on_a(false, Some(false)).await;
    let before = c.vm("vm").await.status.instance.unwrap();
    assert!(!before.fenced);
    c.agents[0].running = false;
    c.run(lease_ms() + 20_000).await;
    assert_eq!(executing(&c, "a"), vec![before.id.clone()]);
    assert!(executing(&c, "b").is_empty());
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.instance.as_ref().unwrap().id, before.id);
    let message = vm.status.message.unwrap_or_default();
    assert!(message.contains("(ha off)"), "{message:?}");
    c.restart_agent("a");
    c.run(5_000).await;
    assert_eq!(c.vm("vm").await.status.phase, Phase::Running);
    assert_eq!(executing(&c, "a"), vec![before.id]);
}

/// `spec.ha` changed on a running VM applies to the next instance only:
/// turned on for an unfenced guest, the cluster still does not start a
/// second instance beside it; turned off for a fenced one, the running
/// instance stays fenced. A restart makes a new instance with the new
/// setting.
#[tokio::test]
async fn changing_ha_on_a_running_vm_keeps_the_running_instances_fencing() {
    let mut c = vm_on_a(false, Some(false)).await;
    let unfenced = c.vm("vm").await.status.instance.unwrap();
    c.update_vm("vm", |v| {
        v.spec.ha = Some(true);
        v.generation += 1;
    })
    .await;
    c.run(3_000).await;
    assert!(!c.vm("vm").await.status.instance.unwrap().fenced);
    c.agents[0].running = false;
    c.run(lease_ms() + 20_000).await;
    // The harness would have failed on two executing instances.
    assert_eq!(executing(&c, "a"), vec![unfenced.id.clone()]);
    assert!(executing(&c, "b").is_empty());
    c.restart_agent("a");
    c.run(5_000).await;

    // A restart: the new instance takes the new setting, fenced.
    c.update_vm("vm", |v| v.request_restart().unwrap()).await;
    c.run(20_000).await;
    let fenced = c.vm("vm").await.status.instance.unwrap();
    assert_ne!(fenced.id, unfenced.id, "{}", c.explain("vm").await);
    assert!(fenced.fenced);

    // Now off again while it runs: this instance stays fenced, and is
    // fenced and taken over when its agent is cut off.
    c.update_vm("vm", |v| {
        v.spec.ha = Some(false);
        v.generation += 1;
    })
    .await;
    c.run(3_000).await;
    let running = c.vm("vm").await.status.instance.unwrap();
    assert_eq!(running.id, fenced.id);
    assert!(running.fenced);
    let a = c.agent_index("a");
    c.agents[a].partitioned.store(true, Ordering::SeqCst);
    c.run(lease_ms() + 10_000).await;
    assert!(executing(&c, "a").is_empty(), "a fenced its instance");
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    assert!(!c.vm("vm").await.status.instance.unwrap().fenced);
}
