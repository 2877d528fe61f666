//! Each agent hears only the changes of the VMs that concern its node (it
//! watches its node's copies of the VM records), and looks at its own VMs
//! when something happens to them, when a passing state is due to pass,
//! and at the slow resync; a booting guest once more when its boot
//! settles. No look may cost a store read of the record: with ten agents,
//! that was ten reads for each write, and a read per VM per look. The
//! agent's index, kept by the same watch, has the record. And a change
//! wakes only the agent it concerns: fifty nodes made fifty looks at each
//! write.

mod cluster;

use std::sync::atomic::Ordering;

use cluster::Cluster;
use keel_api::{Phase, RunPolicy};

#[tokio::test]
async fn agents_read_no_vm_record_from_the_store_while_their_index_is_current() {
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
    assert_eq!(
        c.agents[a].vm_reads.load(Ordering::SeqCst),
        0,
        "the owner read its VM's record from the store"
    );
    assert_eq!(
        c.agents[b].vm_reads.load(Ordering::SeqCst),
        0,
        "b was woken for a's VM and read it from the store"
    );
    assert_eq!(
        c.vm("vm").await.spec.stop_grace_period_s,
        c.agents[a]
            .vms
            .reflector()
            .read(|i| i.get("vm").unwrap().vm.spec.stop_grace_period_s)
            .unwrap(),
        "the owner's index has every change"
    );
    // And the index does not hide a VM that becomes b's: drained off a,
    // it runs on b.
    c.drain("a").await;
    c.run(30_000).await;
    let vm = c.vm("vm").await;
    assert_eq!(vm.owner_node(), Some("b"), "{}", c.explain("vm").await);
    assert_eq!(vm.status.phase, Phase::Running);
}

#[tokio::test]
async fn a_vms_change_wakes_only_the_agent_it_concerns() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.run(2_000).await;
    assert_eq!(c.vm("vm").await.status.phase, Phase::Running);
    let (a, b) = (c.agent_index("a"), c.agent_index("b"));
    for round in 1..=3 {
        c.update_vm("vm", |vm| vm.spec.stop_grace_period_s += 1)
            .await;
        let wanted = c.vm("vm").await.spec.stop_grace_period_s;
        // At the same instant: nothing else is due on either.
        let looks_on_b = c.agents[b].runtime.settle().await;
        let looks_on_a = c.agents[a].runtime.settle().await;
        let indexed = |i: usize| {
            c.agents[i]
                .vms
                .reflector()
                .read(|index| index.get("vm").unwrap().vm.spec.stop_grace_period_s)
                .unwrap()
        };
        // b did not even hear the change: a's VM is not in its index, and
        // b answers no question about the whole cluster from it (a look
        // that needs one lists the store).
        let b_index = c.agents[b].vms.reflector();
        assert!(
            b_index
                .read(|index| index.get("vm").is_none() && index.is_empty())
                .unwrap(),
            "round {round}: b's index holds a's VM"
        );
        assert!(b_index.read_whole(|_| ()).is_none());
        assert!(c.agents[a].vms.reflector().read_whole(|_| ()).is_none());
        // … and was not woken for a VM that is a's before and after it.
        assert_eq!(looks_on_b, 0, "round {round}: b looked at a's VM");
        assert_eq!(indexed(a), wanted);
        assert!(looks_on_a >= 1, "round {round}: a was not woken for its VM");
    }
}

/// The running instance's `running_since`, once it has one.
async fn running_since(c: &Cluster, vm: &str) -> Option<keel_api::Millis> {
    c.vm(vm)
        .await
        .status
        .instance
        .and_then(|inst| inst.running_since)
}

/// Node `a` with VM `vm` just booted on it, and when it started running.
async fn booted_on_a() -> (Cluster, keel_api::Millis) {
    let mut c = Cluster::new(cluster::sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    for _ in 0..20 {
        if let Some(since) = running_since(&c, "vm").await {
            return (c, since);
        }
        c.tick().await;
    }
    panic!("the VM does not run: {}", c.explain("vm").await)
}

/// A booting guest is looked at once its boot settles, not every
/// `poll_ms` until then: at 10,000 VMs starting, those looks were most of
/// an agent's. What they were for (a guest dying in its first seconds)
/// wakes the VM by the hypervisor's exit event.
#[tokio::test]
async fn a_booting_vm_is_looked_at_when_its_boot_settles_not_every_poll() {
    let cfg = keel_ctrl::LifecycleConfig::default();
    let (mut c, since) = booted_on_a().await;
    // Its Running write, readiness and their echoes come first.
    c.run(2_000).await;
    let mut looks = 0;
    while c.now() + cluster::TICK_MS < since + cfg.boot_settle_ms {
        looks += c.tick_counting_looks().await["a"];
    }
    assert_eq!(
        looks, 0,
        "looked at while booting, with nothing announced (poll every {} ms)",
        cfg.poll_ms
    );
    let settled = c.tick_counting_looks().await["a"] + c.tick_counting_looks().await["a"];
    assert_eq!(settled, 1, "looked at once as the boot settled");
    assert_eq!(c.vm("vm").await.status.phase, Phase::Running);
}

/// A guest that dies while booting is seen at once, by its exit event:
/// no look was due before its boot would have settled.
#[tokio::test]
async fn a_guest_dying_while_booting_is_seen_at_once() {
    let (mut c, _) = booted_on_a().await;
    c.run(3_000).await;
    let crashed = c.vm("vm").await.status.instance.expect("an instance").id;
    c.agent("a").hv.crash(&crashed);
    c.tick().await;
    let vm = c.vm("vm").await;
    assert_eq!(
        vm.status.last_exit.as_ref().map(|e| e.instance.as_str()),
        Some(crashed.as_str()),
        "the crash was not seen within a tick: {}",
        c.explain("vm").await
    );
}
