//! Every agent is woken by every change of every VM (one watch on all VM
//! records). What it does then must not cost a store read per change for
//! VMs that are other nodes': with ten agents, that was ten reads for each
//! write. Each agent's VM index answers "not mine".

mod cluster;

use std::sync::atomic::Ordering;

use cluster::Cluster;
use keel_api::{Phase, RunPolicy};

#[tokio::test]
async fn an_agent_reads_no_record_of_another_nodes_vm_when_it_changes() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.run(2_000).await;
    assert_eq!(c.vm("vm").await.status.phase, Phase::Running);
    let (a, b) = (c.agent_index("a"), c.agent_index("b"));
    c.agents[a].vm_reads.store(0, Ordering::SeqCst);
    c.agents[b].vm_reads.store(0, Ordering::SeqCst);
    for _ in 0..5 {
        c.update_vm("vm", |vm| vm.spec.stop_grace_period_s += 1)
            .await;
        c.tick().await;
    }
    assert!(
        c.agents[a].vm_reads.load(Ordering::SeqCst) >= 5,
        "the owner reads its VM at each change"
    );
    assert_eq!(
        c.agents[b].vm_reads.load(Ordering::SeqCst),
        0,
        "b was woken for a's VM and read it from the store"
    );
    // And the index does not hide a VM that becomes b's: drained off a,
    // it runs on b.
    c.drain("a").await;
    c.run(30_000).await;
    let vm = c.vm("vm").await;
    assert_eq!(vm.owner_node(), Some("b"), "{}", c.explain("vm").await);
    assert_eq!(vm.status.phase, Phase::Running);
}
