//! Snapshots are taken and deleted only by the node that owns the VM. Two
//! agents on separate fabrics (separate disk dirs): the other node must
//! not snapshot disks of its own (creating blank ones) and call it Ready.

use std::sync::Arc;

use keel_api::{
    Clock, ManualClock, Millis, Phase, RunPolicy, Snapshot, SnapshotPhase, VirtualMachine, VmSpec,
};
use keel_ctrl::keys::{snapshot_key, vm_key};
use keel_ctrl::{LifecycleConfig, SnapshotController, VmController};
use keel_hv::sim::{SimConfig, SimFabric, SimHypervisor};
use keel_store::memory::MemoryStore;
use keel_store::TypedStore;

const T0: Millis = 1_700_000_000_000;

struct Node {
    hv: SimHypervisor,
    vms: VmController,
    snaps: SnapshotController,
}

fn node(store: &TypedStore, clock: &ManualClock, name: &str, seed: u64) -> Node {
    let shared: Arc<dyn Clock> = Arc::new(clock.clone());
    let sim = SimConfig {
        boot_ms: 100,
        graceful_shutdown_ms: 100,
        ..SimConfig::default()
    };
    // A fabric of its own: this node's disks are its alone.
    let hv = SimHypervisor::join(shared.clone(), seed, sim, &SimFabric::default(), name);
    let cfg = LifecycleConfig {
        node: name.into(),
        ..LifecycleConfig::default()
    };
    let vms = VmController::new(store.clone(), Arc::new(hv.clone()), shared, cfg);
    let snaps = vms.snapshot_controller();
    Node { hv, vms, snaps }
}

async fn vm(store: &TypedStore) -> VirtualMachine {
    store
        .get::<VirtualMachine>(&vm_key("vm"))
        .await
        .unwrap()
        .unwrap()
        .value
}

async fn snap(store: &TypedStore) -> Option<Snapshot> {
    store
        .get::<Snapshot>(&snapshot_key("vm", "s1"))
        .await
        .unwrap()
        .map(|e| e.value)
}

/// Both agents reconcile the VM until `done` holds, moving the clock.
async fn settle(
    store: &TypedStore,
    clock: &ManualClock,
    nodes: &[&Node],
    done: impl Fn(&VirtualMachine) -> bool,
) {
    // The control plane, as `keel serve` on SQLite runs it: it places.
    let control = keel_ctrl::ClusterController::sole(
        store.clone(),
        Arc::new(clock.clone()),
        LifecycleConfig::default(),
    );
    for _ in 0..100 {
        for n in nodes {
            n.vms.heartbeat(None).await.unwrap();
        }
        control.reconcile().await.unwrap();
        for n in nodes {
            let _ = n.vms.reconcile("vm").await;
        }
        if done(&vm(store).await) {
            return;
        }
        clock.advance(100);
    }
    panic!("never settled: {:?}", vm(store).await);
}

#[tokio::test]
async fn only_the_owner_takes_and_deletes_snapshots() {
    let clock = ManualClock::new(T0);
    let store = TypedStore::new(Arc::new(MemoryStore::with_clock(Arc::new(clock.clone()))));
    let a = node(&store, &clock, "a", 1);
    let b = node(&store, &clock, "b", 2);
    let spec = VmSpec {
        memory_mib: 64,
        disks: vec![keel_testkit::spec::disk("root", 16)],
        run_policy: RunPolicy::Manual,
        stop_grace_period_s: 10,
        node: Some("a".into()),
        ..keel_testkit::spec::vm_spec()
    };
    store
        .create(&vm_key("vm"), &VirtualMachine::new("vm", spec.clone()))
        .await
        .unwrap();
    settle(&store, &clock, &[&a, &b], |v| {
        v.status.phase == Phase::Running
    })
    .await;
    a.hv.guest_write("vm", 1, "written on a").unwrap();
    // Stopped: no instance anywhere, so an offline snapshot is possible.
    let mut stopped = store
        .get::<VirtualMachine>(&vm_key("vm"))
        .await
        .unwrap()
        .unwrap();
    stopped.value.request_stop().unwrap();
    store
        .update(&vm_key("vm"), &stopped.value, stopped.revision)
        .await
        .unwrap();
    settle(&store, &clock, &[&a, &b], |v| {
        v.status.phase == Phase::Stopped && v.status.instance.is_none()
    })
    .await;
    assert_eq!(vm(&store).await.owner_node(), Some("a"));

    let request = Snapshot {
        vm: "vm".into(),
        name: "s1".into(),
        spec,
        requested_at: clock.now_ms(),
        deletion_requested_at: None,
        status: Default::default(),
    };
    store
        .create(&snapshot_key("vm", "s1"), &request)
        .await
        .unwrap();

    // b is first to look: it leaves the snapshot to a, touches no disk.
    for _ in 0..3 {
        assert!(b.snaps.reconcile("vm", "s1").await.unwrap().is_some());
        clock.advance(100);
    }
    assert_eq!(
        snap(&store).await.unwrap().status.phase,
        SnapshotPhase::Pending
    );
    assert!(!b.hv.has_disks("vm"), "b created disks of its own");

    assert_eq!(a.snaps.reconcile("vm", "s1").await.unwrap(), None);
    let taken = snap(&store).await.unwrap();
    assert_eq!(taken.status.phase, SnapshotPhase::Ready, "{taken:?}");
    assert!(!taken.status.live);
    assert!(a.hv.has_snapshot("vm", "s1"));
    // Ready: b has nothing left to do with it either.
    assert_eq!(b.snaps.reconcile("vm", "s1").await.unwrap(), None);

    // Deletion, too, is the owner's: b neither forgets the record (which
    // would leave the snapshot in a's disks) nor touches disks.
    let mut entry = store
        .get::<Snapshot>(&snapshot_key("vm", "s1"))
        .await
        .unwrap()
        .unwrap();
    entry.value.deletion_requested_at = Some(clock.now_ms());
    store
        .update(&snapshot_key("vm", "s1"), &entry.value, entry.revision)
        .await
        .unwrap();
    assert!(b.snaps.reconcile("vm", "s1").await.unwrap().is_some());
    assert!(snap(&store).await.is_some(), "b deleted the record");
    assert!(a.hv.has_snapshot("vm", "s1"));
    for _ in 0..3 {
        if a.snaps.reconcile("vm", "s1").await.unwrap().is_none() {
            break;
        }
    }
    assert!(snap(&store).await.is_none());
    assert!(
        !a.hv.has_snapshot("vm", "s1"),
        "a removed it from its disks"
    );
    assert!(!b.hv.has_disks("vm"));
}
