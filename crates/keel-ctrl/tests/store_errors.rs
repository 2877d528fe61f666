//! A store failure is reported as a store failure, with its cause: never
//! as a hypervisor error, never as "instance state unknown". And the
//! compare-and-swap fence of a process alone on its store (SQLite).

use std::sync::Arc;

use keel_api::{
    DiskSpec, ManualClock, PowerState, Readiness, RestoreRequest, RunPolicy, VirtualMachine, VmSpec,
};
use keel_ctrl::keys::vm_key;
use keel_ctrl::{error_chain, LifecycleConfig, ReconcileError, VmController};
use keel_hv::sim::{SimConfig, SimHypervisor};
use keel_store::memory::{Fault, MemoryStore, OpKind};
use keel_store::{StoreError, TypedStore};

const CAUSE: &str = "injected: etcd leader lost";

fn spec(power: PowerState) -> VmSpec {
    VmSpec {
        memory_mib: 64,
        disks: vec![],
        run_policy: RunPolicy::Manual,
        power,
        readiness: Readiness::None,
        ..keel_testkit::spec::vm_spec()
    }
}

/// A controller for node "local" whose store fails every `kind` on `key`.
async fn world(
    vm: VirtualMachine,
    kind: OpKind,
    key: &'static str,
) -> (MemoryStore, TypedStore, VmController) {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let memory = MemoryStore::with_clock(clock.clone());
    let store = TypedStore::new(Arc::new(memory.clone()));
    store.create(&vm_key(&vm.name), &vm).await.unwrap();
    let hv = Arc::new(SimHypervisor::new(clock.clone(), 7, SimConfig::default()));
    let ctrl = VmController::new(store.clone(), hv, clock, LifecycleConfig::default());
    // The heartbeat makes the node's lease fresh, so a start is allowed.
    ctrl.heartbeat(None).await.unwrap();
    memory.set_fault_hook(Some(Box::new(move |op| {
        (op.kind == kind && op.key == key).then(|| Fault::Unavailable(CAUSE.into()))
    })));
    (memory, store, ctrl)
}

async fn record(store: &TypedStore, name: &str) -> VirtualMachine {
    store.get(&vm_key(name)).await.unwrap().unwrap().value
}

#[tokio::test]
async fn an_unreadable_image_record_fails_the_start_as_a_store_error() {
    let mut s = spec(PowerState::Running);
    s.disks = vec![DiskSpec {
        name: "root".into(),
        size_mib: 64,
        image: Some("debian".into()),
    }];
    let mut vm = VirtualMachine::new("web", s);
    vm.status.node = Some("local".into());
    let (_memory, store, ctrl) = world(vm, OpKind::Get, "/images/debian").await;

    let err = ctrl.reconcile("web").await.unwrap_err();
    match &err {
        ReconcileError::StoreForAction { vm, source, .. } => {
            assert_eq!(vm, "web");
            assert!(
                matches!(source, StoreError::Unavailable { reason, .. } if reason == CAUSE),
                "{source:?}"
            );
        }
        other => panic!("a store failure reported as {other:?}"),
    }
    let chain = error_chain(&err);
    assert!(chain.contains("image") && chain.contains(CAUSE), "{chain}");
    // The cause is said once, in its own link of the chain.
    assert_eq!(chain.matches(CAUSE).count(), 1, "{chain}");
    // And on the record, for `keel vm get`.
    let vm = record(&store, "web").await;
    let message = vm.status.message.unwrap_or_default();
    assert!(message.contains(CAUSE), "{message}");
    let start_error = vm
        .status
        .instance
        .and_then(|i| i.start_error)
        .unwrap_or_default();
    assert!(!start_error.contains("hypervisor"), "{start_error}");
}

#[tokio::test]
async fn an_unreadable_snapshot_holds_the_restore_and_says_the_store_failed() {
    let mut vm = VirtualMachine::new("web", spec(PowerState::Stopped));
    vm.status.node = Some("local".into());
    vm.restore = Some(RestoreRequest {
        snapshot: "s1".into(),
        requested_at: 1,
    });
    let (_memory, store, ctrl) = world(vm, OpKind::Get, "/snapshots/web/s1").await;

    ctrl.reconcile("web").await.unwrap();
    let vm = record(&store, "web").await;
    assert!(
        vm.restore.is_some(),
        "the restore must wait, not be abandoned"
    );
    let message = vm.status.message.unwrap_or_default();
    assert!(
        message.contains("cannot read snapshot s1 from the store") && message.contains(CAUSE),
        "{message}"
    );
    assert!(
        !message.contains("lookup failed") && !message.contains("cannot list domains"),
        "a store failure read as a node failure: {message}"
    );
}

/// `keel serve` on SQLite runs the control plane's cluster controller,
/// leading for good: it places without any election (no `/leader` key),
/// by compare-and-swap.
#[tokio::test]
async fn a_sole_cluster_controller_places_without_an_election() {
    let vm = VirtualMachine::new("web", spec(PowerState::Running));
    let (_memory, store, ctrl) = world(vm, OpKind::Get, "/nothing").await;
    let cluster = keel_ctrl::ClusterController::sole(
        store.clone(),
        Arc::new(ManualClock::new(1_000_000)),
        LifecycleConfig::default(),
    );
    assert!(cluster.elected_by().is_none());
    let report = cluster.reconcile().await.unwrap().expect("always leading");
    assert_eq!(report.placed, 1, "{report:?}");
    assert_eq!(
        record(&store, "web").await.status.node.as_deref(),
        Some("local")
    );
    assert!(store
        .raw()
        .get(keel_ctrl::keys::LEADER_KEY)
        .await
        .unwrap()
        .is_none());
    drop(ctrl);
}
