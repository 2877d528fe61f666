//! One stored record that cannot be decoded (edited by hand, or of a shape
//! this build does not know) and one written by a newer Keel (an extra
//! field, as in a rolling upgrade) stop nothing: heartbeats, placement,
//! drains and the takeover of a lost node go on, and the bad key is
//! reported (an event naming it, the store's log of undecodable records).

mod cluster;

use cluster::{sim, spec, Cluster, TICK_MS};
use keel_api::{Event, Phase, RunPolicy, VirtualMachine};
use keel_ctrl::keys::{vm_key, EVENTS_PREFIX};
use keel_ctrl::LifecycleConfig;
use keel_store::Precondition;

const BROKEN: &str = "/vms/broken";
const BROKEN_NODE: &str = "/nodes/zz";

/// A VM record as a newer Keel would write it: fields this build lacks.
fn newer_record(name: &str) -> Vec<u8> {
    let mut json =
        serde_json::to_value(VirtualMachine::new(name, spec(RunPolicy::AlwaysOn))).unwrap();
    json["schema_version"] = 2.into();
    json["added_in_v2"] = serde_json::json!({"labels": {"team": "a"}});
    json["spec"]["added_in_v2"] = true.into();
    json["status"]["added_in_v2"] = 7.into();
    serde_json::to_vec(&json).unwrap()
}

async fn events_of(c: &Cluster, subject: &str) -> Vec<Event> {
    let (all, _) = c
        .store
        .list::<Event>(&format!("{EVENTS_PREFIX}{subject}/"))
        .await
        .unwrap();
    all.into_iter().map(|(_, e)| e.value).collect()
}

fn owner(vm: &VirtualMachine) -> String {
    vm.owner_node().unwrap().to_string()
}

#[tokio::test]
async fn an_undecodable_record_stops_nothing() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    assert!(c.executing_on("a", "vm"));
    c.add_node("b").await;
    c.add_node("c").await;

    let raw = c.store.raw().clone();
    raw.put(
        BROKEN,
        br#"{"name":"broken","spec":42}"#.to_vec(),
        Precondition::Absent,
    )
    .await
    .unwrap();
    raw.put(BROKEN_NODE, b"not json".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    raw.put(
        &vm_key("newer"),
        newer_record("newer"),
        Precondition::Absent,
    )
    .await
    .unwrap();

    // Placement goes on: the newer record is read despite its new fields.
    c.run(5_000).await;
    let newer = c.vm("newer").await;
    assert_eq!(newer.status.phase, Phase::Running, "{newer:?}");
    assert!(c.executing_on(&owner(&newer), "newer"));

    // A drain goes on, and the drained node's heartbeat with it.
    c.drain("a").await;
    for _ in 0..(30_000 / TICK_MS) {
        c.tick().await;
        // Renewed on schedule, every heartbeat interval.
        let every = keel_ctrl::node_lease::HEARTBEAT_INTERVAL_MS;
        assert!(
            c.now() - c.node("a").await.status.last_heartbeat < every,
            "a's heartbeat was not renewed while draining"
        );
        // What self-fencing goes by: every heartbeat succeeded.
        let mono = keel_api::Clock::mono(&c.clock);
        assert!(mono.since(c.agent("a").house.heartbeat.last_ok()) < every);
    }
    let vm = c.vm("vm").await;
    assert_ne!(owner(&vm), "a", "{vm:?}");
    assert!(
        vm.status.last_exit.is_none(),
        "migrated, not stopped: {vm:?}"
    );
    assert!(c.executing_on(&owner(&vm), "vm"));
    assert!(!c.executing_on("a", "vm"));
    // The broken record might be one of a's VMs: the drain is not called
    // complete until it is repaired or removed.
    assert_eq!(c.node("a").await.drain.unwrap().completed_at, None);

    // The bad keys are reported: one event each, across all agents.
    let events = events_of(&c, "broken").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].key.as_deref(), Some(BROKEN));
    assert!(events[0].reason.contains(BROKEN), "{events:?}");
    let events = events_of(&c, keel_ctrl::keys::STORE_EVENTS).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].key.as_deref(), Some(BROKEN_NODE));
    // The drained node lists every VM each heartbeat: it knows the key.
    let bad: Vec<String> = c
        .agent("a")
        .vms
        .store()
        .undecodable()
        .current()
        .into_iter()
        .map(|u| u.key)
        .collect();
    assert!(bad.contains(&BROKEN.to_string()), "{bad:?}");

    // Takeover goes on: the node now running vm loses power.
    let lost = owner(&c.vm("vm").await);
    let i = c.agents.iter().position(|a| a.name == lost).unwrap();
    c.agents[i].running = false;
    c.agents[i].hv.power_failure();
    c.run(LifecycleConfig::default().node_lease_ms + 10_000)
        .await;
    let vm = c.vm("vm").await;
    let now_on = owner(&vm);
    assert!(now_on != lost && now_on != "a", "{vm:?}");
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    assert!(c.executing_on(&now_on, "vm"));

    // Once the record is removed the drain completes and it is no longer
    // reported as undecodable.
    let entry = raw.get(BROKEN).await.unwrap().unwrap();
    raw.delete(BROKEN, entry.mod_revision).await.unwrap();
    // At a's next chores (one heartbeat interval at most).
    c.run(keel_ctrl::node_lease::HEARTBEAT_INTERVAL_MS).await;
    assert!(c.node("a").await.drain.unwrap().completed_at.is_some());
    assert!(!c
        .agent("a")
        .vms
        .store()
        .undecodable()
        .current()
        .iter()
        .any(|u| u.key == BROKEN));
}

/// A list that skips an undecodable record must not read as "no such
/// record" where absence leads to acting: a domain that a migration might
/// serve is not ended while one of its VM's migration records is unreadable.
#[tokio::test]
async fn garbage_collection_spares_a_domain_an_unreadable_migration_may_serve() {
    use keel_hv::{DomainSpec, Hypervisor};
    use std::sync::Arc;

    let clock = keel_api::ManualClock::new(cluster::T0);
    let shared: Arc<dyn keel_api::Clock> = Arc::new(clock.clone());
    let store = keel_store::TypedStore::new(Arc::new(keel_store::memory::MemoryStore::with_clock(
        shared.clone(),
    )));
    let hv = keel_hv::sim::SimHypervisor::new(shared.clone(), 1, sim());
    let agent = keel_ctrl::VmController::new(
        store.clone(),
        Arc::new(hv.clone()),
        shared,
        LifecycleConfig {
            node: "a".into(),
            ..LifecycleConfig::default()
        },
    );
    // An incoming migration target whose VM record is not here (yet).
    hv.start(&DomainSpec::bare("ghost", "ghost-7", 1, 64))
        .await
        .unwrap();
    let key = "/migrations/ghost/ghost-m1";
    let rev = store
        .raw()
        .put(key, b"{\"vm\":".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    for _ in 0..3 {
        agent.collect_garbage().await.unwrap();
        clock.advance(TICK_MS);
    }
    assert_eq!(hv.live_instances("ghost"), ["ghost-7"]);

    // Once the record is gone nothing accounts for the domain: it is ended.
    store.raw().delete(key, rev).await.unwrap();
    agent.collect_garbage().await.unwrap();
    assert!(hv.executing_instances("ghost").is_empty());
}
