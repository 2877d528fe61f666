//! The event history stays bounded: the cluster's leader (here the sole
//! controller of `keel serve`) keeps the newest `per_vm` events of each
//! VM and `total` overall, drops those of deleted VMs, and prunes once
//! per interval on its injected clock.

use std::sync::Arc;

use keel_api::{Event, ManualClock, Phase, VirtualMachine, VmSpec};
use keel_ctrl::event_retention::{EventRetention, PRUNE_INTERVAL_MS};
use keel_ctrl::keys::{event_key, vm_key, EVENTS_PREFIX, STORE_EVENTS};
use keel_ctrl::{ClusterController, LifecycleConfig};
use keel_store::memory::MemoryStore;
use keel_store::TypedStore;

const T0: u64 = 1_000_000;

async fn add_events(store: &TypedStore, vm: &str, from: u64, count: u64) {
    for n in from..from + count {
        let event = Event {
            at: T0,
            vm: vm.to_string(),
            from: Phase::default(),
            to: Phase::default(),
            reason: format!("event {n}"),
            key: None,
        };
        store.create(&event_key(vm, n), &event).await.unwrap();
    }
}

/// The `n`s (from the reasons) of `vm`'s events, oldest first.
async fn numbers(store: &TypedStore, vm: &str) -> Vec<u64> {
    let (events, _) = store
        .list::<Event>(&format!("{EVENTS_PREFIX}{vm}/"))
        .await
        .unwrap();
    let mut out: Vec<(u64, u64)> = events
        .into_iter()
        .map(|(_, e)| {
            let n = e.value.reason.trim_start_matches("event ").parse().unwrap();
            (e.revision, n)
        })
        .collect();
    out.sort_unstable();
    out.into_iter().map(|(_, n)| n).collect()
}

fn controller(
    store: &TypedStore,
    clock: &Arc<ManualClock>,
    limits: EventRetention,
) -> ClusterController {
    let cfg = LifecycleConfig {
        event_retention: limits,
        ..LifecycleConfig::default()
    };
    ClusterController::sole(store.clone(), clock.clone(), cfg)
}

#[tokio::test]
async fn the_leader_keeps_the_newest_events_per_vm_and_overall() {
    let store = TypedStore::new(Arc::new(MemoryStore::new()));
    let spec: VmSpec = serde_json::from_value(
        serde_json::json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    )
    .unwrap();
    let vm = VirtualMachine::new("web", spec);
    store.create(&vm_key("web"), &vm).await.unwrap();
    add_events(&store, STORE_EVENTS, 0, 2).await;
    add_events(&store, "gone", 0, 3).await;
    add_events(&store, "web", 0, 250).await;
    let clock = Arc::new(ManualClock::new(T0));
    let limits = EventRetention {
        per_vm: 200,
        total: 50_000,
        ..Default::default()
    };
    let cluster = controller(&store, &clock, limits);

    cluster.reconcile().await.unwrap().expect("always leading");
    assert_eq!(numbers(&store, "web").await, (50..250).collect::<Vec<_>>());
    assert!(
        numbers(&store, "gone").await.is_empty(),
        "a deleted VM's events stay"
    );
    assert_eq!(
        numbers(&store, STORE_EVENTS).await,
        [0, 1],
        "events of no VM are not orphans"
    );

    // Within the interval nothing is listed again; after it, the cap holds.
    add_events(&store, "web", 250, 10).await;
    clock.advance(PRUNE_INTERVAL_MS - 1);
    cluster.reconcile().await.unwrap();
    assert_eq!(numbers(&store, "web").await.len(), 210);
    clock.advance(1);
    cluster.reconcile().await.unwrap();
    assert_eq!(numbers(&store, "web").await, (60..260).collect::<Vec<_>>());

    // The overall cap takes the oldest across VMs: the store's two first.
    let cluster = controller(
        &store,
        &clock,
        EventRetention {
            per_vm: 200,
            total: 150,
            ..Default::default()
        },
    );
    cluster.reconcile().await.unwrap();
    assert!(numbers(&store, STORE_EVENTS).await.is_empty());
    assert_eq!(numbers(&store, "web").await, (110..260).collect::<Vec<_>>());
}
