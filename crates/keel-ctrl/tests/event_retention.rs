//! The event history stays bounded: the cluster's leader (here the sole
//! controller of `keel serve`) keeps the newest `per_vm` events of each
//! VM and `total` overall, drops those of deleted VMs, and prunes once
//! per interval on its injected clock. A VM's events are written in the
//! same store write as the record change they tell of, and an event's
//! key taken beforehand never stops that record's write.

mod common;

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

// ---- events written with their record --------------------------------------

fn boot_in_a_second() -> keel_hv::sim::SimConfig {
    keel_hv::sim::SimConfig {
        boot_ms: 1_000,
        ..Default::default()
    }
}

/// Every change of `vm` in the store from revision 1 up to now, read from
/// a watch: the VM's record versions as (revision written from, revision,
/// record) and its events as (key, revision, event), each in revision order.
async fn history_of(
    w: &common::World,
    vm: &str,
) -> (Vec<(u64, u64, VirtualMachine)>, Vec<(String, u64, Event)>) {
    use keel_store::{Precondition, WatchEvent};
    let mut watch = w.raw.watch("/", 1).await.unwrap();
    let sentinel = w
        .raw
        .put("/~sentinel", b"s".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let (mut records, mut events) = (Vec::new(), Vec::new());
    let mut from = 0;
    loop {
        let item = tokio::time::timeout(std::time::Duration::from_secs(10), watch.next())
            .await
            .expect("the watch keeps up")
            .expect("the watch is open")
            .expect("the watch works");
        let WatchEvent::Put(e) = item else { continue };
        if e.mod_revision == sentinel {
            return (records, events);
        }
        if e.key == vm_key(vm) {
            records.push((
                from,
                e.mod_revision,
                serde_json::from_slice(&e.value).unwrap(),
            ));
            from = e.mod_revision;
        } else if e.key.starts_with(&format!("{EVENTS_PREFIX}{vm}/")) {
            events.push((
                e.key,
                e.mod_revision,
                serde_json::from_slice(&e.value).unwrap(),
            ));
        }
    }
}

#[tokio::test]
async fn phase_events_are_written_with_their_vm_record_at_one_revision() {
    use keel_api::{PowerState, RunPolicy};
    use keel_ctrl::keys::change_event_key;
    let mut w = common::World::new(1, boot_in_a_second()).await;
    w.create(
        "web",
        common::spec(RunPolicy::Manual, PowerState::Running, 10),
    )
    .await;
    w.run_for(6_000).await;
    assert_eq!(w.get("web").await.unwrap().status.phase, Phase::Running);
    w.user_op("web", |vm| {
        vm.spec.power = PowerState::Stopped;
        Ok(())
    })
    .await
    .unwrap();
    w.run_for(20_000).await;
    assert_eq!(w.get("web").await.unwrap().status.phase, Phase::Stopped);

    let (records, events) = history_of(&w, "web").await;
    let phases: Vec<(Phase, Phase)> = events.iter().map(|(_, _, e)| (e.from, e.to)).collect();
    assert_eq!(
        phases,
        [
            (Phase::Pending, Phase::Starting),
            (Phase::Starting, Phase::Running),
            (Phase::Running, Phase::Stopping),
            (Phase::Stopping, Phase::Stopped),
        ],
        "every phase change is an event, in order"
    );
    for (key, revision, event) in &events {
        let (from, _, record) = records
            .iter()
            .find(|(_, at, _)| at == revision)
            .unwrap_or_else(|| {
                panic!("no write of the VM at its event's revision {revision}: {key}")
            });
        assert_eq!(
            record.status.phase, event.to,
            "the event at {revision} tells of the record written at it"
        );
        assert_eq!(event.vm, "web");
        assert!(!event.reason.is_empty(), "{event:?}");
        assert_eq!(
            key,
            &change_event_key("web", *from, 0),
            "the key is the revision the record was written from"
        );
    }
    let (listed, _) = w
        .user
        .list::<Event>(&format!("{EVENTS_PREFIX}web/"))
        .await
        .unwrap();
    let listed: Vec<&String> = listed.iter().map(|(k, _)| k).collect();
    let written: Vec<&String> = events.iter().map(|(k, _, _)| k).collect();
    assert_eq!(
        listed, written,
        "the keys list in the order the events happened"
    );
}

/// Events are best effort: with the key of every event the VM's writes
/// would make already taken, the writes still happen (without their
/// events) and the keys' holders are left alone.
#[tokio::test]
async fn an_event_key_taken_beforehand_does_not_stop_the_record_write() {
    use keel_api::{PowerState, RunPolicy};
    use keel_ctrl::keys::change_event_key;
    // Fewer than the leader's cap of events per VM, which would prune
    // the oldest blockers and free their keys.
    const BLOCKED: u64 = 190;
    let mut w = common::World::new(1, boot_in_a_second()).await;
    w.create(
        "web",
        common::spec(RunPolicy::Manual, PowerState::Running, 10),
    )
    .await;
    let created = w.memory.revision();
    // The VM's first write is made from its create; the blockers take
    // revisions themselves, so the later ones are made from after them.
    let first = created + BLOCKED + 2;
    for from in std::iter::once(created).chain(first..first + BLOCKED) {
        let blocker = Event {
            at: T0,
            vm: "web".into(),
            from: Phase::default(),
            to: Phase::default(),
            reason: format!("blocker {from}"),
            key: None,
        };
        w.user
            .create(&change_event_key("web", from, 0), &blocker)
            .await
            .unwrap();
    }
    w.run_for(6_000).await;
    let vm = w
        .user
        .get::<VirtualMachine>(&vm_key("web"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(vm.value.status.phase, Phase::Running, "{vm:?}");
    assert!(
        vm.revision < first + BLOCKED,
        "the VM's writes were made from blocked revisions ({first}..{}): {}",
        first + BLOCKED,
        vm.revision
    );
    let (records, events) = history_of(&w, "web").await;
    assert!(
        records
            .iter()
            .any(|(from, _, r)| *from >= first && r.status.phase == Phase::Running),
        "the write to Running was made from a blocked revision"
    );
    let strays: Vec<_> = events
        .iter()
        .filter(|(_, _, e)| !e.reason.starts_with("blocker "))
        .collect();
    assert!(strays.is_empty(), "no event but the blockers: {strays:?}");
    assert_eq!(events.len() as u64, BLOCKED + 1, "every blocker is kept");
    for (key, _, event) in &events {
        assert!(
            event.reason.starts_with("blocker ")
                && key.ends_with(&format!(
                    "{}-00",
                    event.reason.trim_start_matches("blocker ")
                )),
            "a blocker was overwritten: {key} {event:?}"
        );
    }
}
