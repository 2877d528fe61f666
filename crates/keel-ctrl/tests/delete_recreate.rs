//! A VM deleted and created again under its name, on shared storage,
//! while the deleting agent's watch lags: the deletion (disks first) runs
//! once, for the VM it was asked for, never again for a late echo of that
//! VM's own earlier writes, which would remove the new VM's disks.

mod cluster;

use cluster::{spec, Cluster};
use keel_api::{RunPolicy, VirtualMachine};
use keel_ctrl::keys::{vm_key, VMS_PREFIX};
use keel_store::{Watch, WatchEvent};

/// The next event the watch already holds, without waiting for one.
async fn ready_event(watch: &mut Watch) -> Option<WatchEvent> {
    use std::future::Future;
    // Lets the watch's pump catch up with the writes.
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let next = std::pin::pin!(watch.next());
    match next.poll(&mut cx) {
        std::task::Poll::Ready(Some(Ok(event))) => Some(event),
        _ => None,
    }
}

/// Agent a deletes `vm` on its own writes alone (its watch holds back
/// their echoes); b then runs a new `vm` on the same shared disk dir; a's
/// watch delivers the echoes one by one, a look after each. The new VM's
/// disk data survives.
#[tokio::test]
async fn a_late_echo_of_a_deleted_vm_never_deletes_the_disks_of_its_successor() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.run(2_000).await;
    assert!(c.executing_on("a", "vm"), "{}", c.explain("vm").await);
    let (_, revision) = c.store.raw().list(VMS_PREFIX).await.unwrap();
    let mut lagging = c.store.raw().watch(VMS_PREFIX, revision + 1).await.unwrap();
    let a = c.agent_index("a");
    // a's runtime stops taking events in: it is driven by hand below.
    c.agents[a].running = false;
    let now = c.now();
    c.update_vm("vm", |v| {
        v.deletion_requested_at.get_or_insert(now);
    })
    .await;
    let request = ready_event(&mut lagging).await.expect("the delete request");
    c.agents[a].vms.reflector().apply(&request);
    let mut deleted = false;
    for _ in 0..120 {
        c.tick().await;
        let _ = c.agents[a].vms.reconcile("vm").await;
        if c.store
            .get::<VirtualMachine>(&vm_key("vm"))
            .await
            .unwrap()
            .is_none()
        {
            deleted = true;
            break;
        }
    }
    assert!(deleted, "{}", c.explain("vm").await);

    // A new VM of the same name, on b, with data on the shared disks.
    c.created += 1;
    let mut again = VirtualMachine::new("vm", spec(RunPolicy::AlwaysOn));
    again.uid = format!("{:016x}", c.created);
    again.spec.node = Some("b".into());
    c.store.create(&vm_key("vm"), &again).await.unwrap();
    c.run(5_000).await;
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    c.agent("b").hv.guest_write("vm", 1, "new").unwrap();

    // a's watch catches up, one event and one look at a time.
    let mut echoes = 0;
    while let Some(event) = ready_event(&mut lagging).await {
        echoes += 1;
        c.agents[a].vms.reflector().apply(&event);
        let _ = c.agents[a].vms.reconcile("vm").await;
    }
    assert!(echoes > 3, "only {echoes} events held back");
    assert_eq!(
        c.agent("b").hv.disk_record("vm", 1).as_deref(),
        Some("new"),
        "the new VM's disks were deleted: {}",
        c.agent("a").hv.log().join(" | ")
    );
    let vm = c.vm("vm").await;
    assert_eq!(vm.uid, again.uid);
    assert!(vm.deletion_requested_at.is_none());
    assert!(c.executing_on("b", "vm"));
}
