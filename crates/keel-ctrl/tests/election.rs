//! Leader election among control planes and the leader's cluster duties,
//! on the in-memory store and a manual clock. A "dead" process is one that
//! simply stops taking steps: nothing is revoked, its lease runs out.

use std::sync::Arc;

use keel_api::{Clock, ManualClock, Millis, Phase, RunPolicy, VirtualMachine, VmSpec};
use keel_ctrl::keys::{vm_key, LEADER_KEY};
use keel_ctrl::{ClusterController, ElectionConfig, LeaderElection, LifecycleConfig, VmController};
use keel_hv::sim::{SimConfig, SimFabric, SimHypervisor};
use keel_store::memory::MemoryStore;
use keel_store::{Store, StoreError, TypedStore};

const T0: Millis = 1_700_000_000_000;

fn election_cfg() -> ElectionConfig {
    ElectionConfig {
        ttl_ms: 6_000,
        safety_margin_ms: 1_500,
        retry_ms: 1_000,
    }
}

struct World {
    clock: ManualClock,
    memory: MemoryStore,
    store: TypedStore,
    fabric: SimFabric,
}

impl World {
    fn new() -> Self {
        let clock = ManualClock::new(T0);
        let memory = MemoryStore::with_clock(Arc::new(clock.clone()));
        let store = TypedStore::new(Arc::new(memory.clone()));
        Self {
            clock,
            memory,
            store,
            fabric: SimFabric::default(),
        }
    }

    fn shared_clock(&self) -> Arc<dyn Clock> {
        Arc::new(self.clock.clone())
    }

    fn candidate(&self, id: &str) -> Arc<LeaderElection> {
        Arc::new(LeaderElection::new(
            Arc::new(self.memory.clone()),
            self.shared_clock(),
            id,
            election_cfg(),
        ))
    }

    fn control_plane(&self, id: &str) -> ClusterController {
        ClusterController::new(
            self.store.clone(),
            self.shared_clock(),
            LifecycleConfig::default(),
            self.candidate(id),
        )
    }

    /// A node agent under a control plane: no placement, no takeover.
    async fn agent(&self, node: &str) -> VmController {
        let hv = SimHypervisor::join(
            self.shared_clock(),
            7,
            SimConfig {
                boot_ms: 100,
                graceful_shutdown_ms: 100,
                ..SimConfig::default()
            },
            &self.fabric,
            node,
        );
        let cfg = LifecycleConfig {
            node: node.into(),
            // One fabric: every node sees the same disks.
            shared_disk_dir: Some("/sim-fabric".into()),
            ..LifecycleConfig::default()
        };
        let agent = VmController::new(self.store.clone(), Arc::new(hv), self.shared_clock(), cfg);
        agent.heartbeat(None).await.unwrap();
        agent
    }

    async fn create_vm(&self, name: &str) {
        let vm = VirtualMachine::new(
            name,
            VmSpec {
                memory_mib: 64,
                disks: vec![],
                run_policy: RunPolicy::AlwaysOn,
                stop_grace_period_s: 10,
                ..keel_testkit::spec::vm_spec()
            },
        );
        self.store.create(&vm_key(name), &vm).await.unwrap();
    }

    async fn vm(&self, name: &str) -> VirtualMachine {
        self.store
            .get::<VirtualMachine>(&vm_key(name))
            .await
            .unwrap()
            .unwrap()
            .value
    }
}

/// Steps every candidate in `alive` once; asserts at most one leads.
async fn round(alive: &[&LeaderElection]) -> Option<String> {
    for c in alive {
        c.step().await.unwrap();
    }
    let leaders: Vec<&str> = alive
        .iter()
        .filter(|c| c.is_leader())
        .map(|c| c.id())
        .collect();
    assert!(leaders.len() <= 1, "two leaders at once: {leaders:?}");
    leaders.first().map(|s| s.to_string())
}

#[tokio::test]
async fn only_one_of_two_candidates_leads() {
    let w = World::new();
    let a = w.candidate("a");
    let b = w.candidate("b");
    assert_eq!(round(&[&a, &b]).await.as_deref(), Some("a"));
    for _ in 0..20 {
        w.clock.advance(election_cfg().renew_every_ms());
        assert_eq!(
            round(&[&b, &a]).await.as_deref(),
            Some("a"),
            "a renewing leader keeps leading"
        );
    }
    let record = b.leader().await.unwrap().expect("a leader is recorded");
    assert_eq!(record.id, "a");
    assert_eq!(record.started_at, T0);
    assert!(b.guard().is_none());
}

#[tokio::test]
async fn a_dead_leader_is_replaced_once_its_lease_runs_out() {
    let w = World::new();
    let a = w.candidate("a");
    let b = w.candidate("b");
    assert_eq!(round(&[&a, &b]).await.as_deref(), Some("a"));
    let last_renewal = w.clock.now_ms();
    let cfg = election_cfg();
    // a dies: it takes no more steps. Every 100 ms: a must have stopped
    // counting itself leader before b can be elected, and b is elected
    // once the lease has run out.
    let mut b_elected_at = None;
    while b_elected_at.is_none() {
        w.clock.advance(100);
        let now = w.clock.now_ms();
        if now >= last_renewal + cfg.ttl_ms - cfg.safety_margin_ms {
            assert!(
                !a.is_leader(),
                "a still acts {} ms after its last renewal",
                now - last_renewal
            );
        }
        if round(&[&b]).await.is_some() {
            b_elected_at = Some(now);
        }
        assert!(!(a.is_leader() && b.is_leader()), "two leaders at {now}");
    }
    let elected = b_elected_at.unwrap();
    assert!(
        elected >= last_renewal + cfg.ttl_ms,
        "b elected {} ms after a's last renewal, before the lease ran out",
        elected - last_renewal
    );
    assert!(elected <= last_renewal + cfg.ttl_ms + 100);
    // a comes back (it was only paused): it finds its lease gone and follows.
    assert_eq!(round(&[&a, &b]).await.as_deref(), Some("b"));
    assert!(!a.step().await.unwrap());
}

#[tokio::test]
async fn a_deposed_leader_cannot_write() {
    let w = World::new();
    let a = w.candidate("a");
    let b = w.candidate("b");
    round(&[&a, &b]).await;
    let guard = a.guard().expect("a leads");
    w.store
        .create_guarded("/probe", &"a was here", &guard)
        .await
        .expect("the leader writes");
    // a is paused past its lease; b takes over.
    w.clock.advance(election_cfg().ttl_ms + 1);
    assert_eq!(round(&[&b]).await.as_deref(), Some("b"));
    let probe = w.store.get::<String>("/probe").await.unwrap().unwrap();
    match w
        .store
        .update_guarded("/probe", &"a again", probe.revision, &guard)
        .await
    {
        Err(StoreError::GuardLost { guard: key }) => assert_eq!(key, LEADER_KEY),
        other => panic!("a deposed leader's write: expected GuardLost, got {other:?}"),
    }
    assert_eq!(
        w.store
            .get::<String>("/probe")
            .await
            .unwrap()
            .unwrap()
            .value,
        "a was here"
    );
    let b_guard = b.guard().unwrap();
    w.store
        .update_guarded("/probe", &"b now", probe.revision, &b_guard)
        .await
        .expect("the new leader writes");
}

#[tokio::test]
async fn resigning_hands_over_at_once() {
    let w = World::new();
    let a = w.candidate("a");
    let b = w.candidate("b");
    round(&[&a, &b]).await;
    a.resign().await;
    assert!(!a.is_leader());
    assert_eq!(
        round(&[&b]).await.as_deref(),
        Some("b"),
        "no wait for the TTL"
    );
}

/// Someone deletes the leader key under a leader that still thinks it
/// leads, and another candidate is elected: the old leader's controller
/// writes nothing (GuardLost) and steps down.
#[tokio::test]
async fn a_leader_whose_key_was_replaced_places_nothing() {
    let w = World::new();
    let a = w.control_plane("a");
    let b = w.control_plane("b");
    round(&[a.election(), b.election()]).await;
    assert!(a.election().is_leader());
    let _agent = w.agent("n1").await;
    let key = w.memory.get(LEADER_KEY).await.unwrap().unwrap();
    w.memory.delete(LEADER_KEY, key.mod_revision).await.unwrap();
    assert!(b.election().step().await.unwrap(), "b takes the free key");
    assert!(a.election().is_leader(), "a has not noticed yet");
    w.create_vm("vm").await;
    match a.reconcile().await {
        Err(StoreError::GuardLost { .. }) => {}
        other => panic!("expected GuardLost, got {other:?}"),
    }
    assert!(!a.election().is_leader(), "GuardLost ends a's term");
    assert_eq!(w.vm("vm").await.status.node, None, "a placed nothing");
    let report = b.reconcile().await.unwrap().expect("b leads");
    assert_eq!(report.placed, 1);
    assert_eq!(w.vm("vm").await.status.node.as_deref(), Some("n1"));
}

#[tokio::test]
async fn placement_happens_only_through_the_leader() {
    let w = World::new();
    let a = w.control_plane("a");
    let b = w.control_plane("b");
    let n1 = w.agent("n1").await;
    let n2 = w.agent("n2").await;
    w.create_vm("one").await;
    // Agents under a control plane leave an unplaced VM alone.
    for _ in 0..3 {
        assert_eq!(n1.reconcile("one").await.unwrap(), None);
        assert_eq!(n2.reconcile("one").await.unwrap(), None);
    }
    assert_eq!(w.vm("one").await.status.node, None);
    // Nobody has campaigned yet: nobody places.
    assert_eq!(a.reconcile().await.unwrap(), None);
    round(&[a.election(), b.election()]).await;
    assert_eq!(
        b.reconcile().await.unwrap(),
        None,
        "a follower places nothing"
    );
    assert_eq!(w.vm("one").await.status.node, None);
    let report = a.reconcile().await.unwrap().expect("a leads");
    assert_eq!((report.placed, report.unplaced), (1, 0));
    let node = w.vm("one").await.status.node.expect("placed");
    let agent = if node == "n1" { &n1 } else { &n2 };
    run_agent(&w, agent, "one").await;
    assert_eq!(w.vm("one").await.status.phase, Phase::Running);

    // The leader dies; after its lease b leads and places the next VM.
    w.clock.advance(election_cfg().ttl_ms + 1);
    for agent in [&n1, &n2] {
        agent.heartbeat(None).await.unwrap();
    }
    assert_eq!(round(&[b.election()]).await.as_deref(), Some("b"));
    w.create_vm("two").await;
    assert_eq!(
        a.reconcile().await.unwrap(),
        None,
        "the dead leader places nothing"
    );
    assert_eq!(w.vm("two").await.status.node, None);
    let report = b.reconcile().await.unwrap().expect("b leads");
    assert_eq!(report.placed, 1);
    let two = w.vm("two").await.status.node.expect("placed by b");
    assert_ne!(two, node, "the emptier node");
}

/// Under a control plane, agents do not take over the VMs of a lost node;
/// the leader does, once the node's lease has run out, and places them.
#[tokio::test]
async fn the_leader_takes_over_vms_of_lost_nodes() {
    let w = World::new();
    let a = w.control_plane("a");
    round(&[a.election()]).await;
    let n1 = w.agent("n1").await;
    w.create_vm("vm").await;
    a.reconcile().await.unwrap().unwrap();
    run_agent(&w, &n1, "vm").await;
    let n2 = w.agent("n2").await;
    n1.heartbeat(None).await.unwrap();
    let lease_ms = LifecycleConfig::default().node_lease_ms;
    let lost_at = w.clock.now_ms() + lease_ms;
    // n1 goes silent. n2 keeps house; a keeps leading. The leader judges
    // the silence on its own clock, from its first look at n1's last
    // heartbeat (one pass after it was written): at most a pass late.
    let mut last = 0;
    while w.clock.now_ms() <= lost_at + 3_000 {
        w.clock.advance(1_000);
        a.election().step().await.unwrap();
        let heartbeat = keel_ctrl::node_lease::Heartbeat::new(w.clock.mono());
        if heartbeat.beat(&n2, &w.clock).await {
            n2.chores().await;
        }
        let owner = w.vm("vm").await.owner_node().map(str::to_string);
        if w.clock.now_ms() <= lost_at {
            assert_eq!(
                owner.as_deref(),
                Some("n1"),
                "taken over before n1's lease ran out"
            );
            let report = a.reconcile().await.unwrap().unwrap();
            assert_eq!(report.taken_over, 0);
        } else {
            assert_eq!(owner.as_deref(), Some("n1"), "an agent took over");
            let report = a.reconcile().await.unwrap().unwrap();
            last = report.taken_over;
            if last > 0 {
                break;
            }
        }
    }
    assert_eq!(last, 1, "the leader took the VM over");
    let vm = w.vm("vm").await;
    assert_eq!(
        vm.status.node.as_deref(),
        Some("n2"),
        "and placed it: {vm:?}"
    );
    run_agent(&w, &n2, "vm").await;
    assert_eq!(w.vm("vm").await.status.phase, Phase::Running);
}

/// Reconciles `vm` on `agent` until it runs, moving the clock.
async fn run_agent(w: &World, agent: &VmController, vm: &str) {
    for _ in 0..50 {
        let next = agent.reconcile(vm).await.unwrap();
        if w.vm(vm).await.status.phase == Phase::Running {
            return;
        }
        let now = w.clock.now_ms();
        w.clock.advance_to(next.unwrap_or(now + 100).max(now + 1));
    }
    panic!("{vm} never ran: {:?}", w.vm(vm).await);
}

/// A VM record that cannot be decoded, a node record that is not JSON
/// and a VM written by a newer Keel (fields this build lacks) do not stop
/// the leader: it places, takes over, and reports the bad keys as events.
#[tokio::test]
async fn undecodable_records_stop_no_leader_pass() {
    let w = World::new();
    let a = w.control_plane("a");
    round(&[a.election()]).await;
    let n1 = w.agent("n1").await;
    w.create_vm("vm").await;
    let raw = w.store.raw();
    raw.put(
        "/vms/broken",
        br#"{"name":"broken","spec":"?"}"#.to_vec(),
        keel_store::Precondition::Absent,
    )
    .await
    .unwrap();
    raw.put("/nodes/zz", b"{".to_vec(), keel_store::Precondition::Absent)
        .await
        .unwrap();
    let mut newer = serde_json::to_value(w.vm("vm").await).unwrap();
    newer["name"] = "newer".into();
    newer["added_in_v2"] = serde_json::json!([1, 2]);
    newer["spec"]["added_in_v2"] = true.into();
    raw.put(
        &vm_key("newer"),
        serde_json::to_vec(&newer).unwrap(),
        keel_store::Precondition::Absent,
    )
    .await
    .unwrap();

    let report = a.reconcile().await.unwrap().expect("a leads");
    assert_eq!((report.placed, report.unplaced), (2, 0), "{report:?}");
    run_agent(&w, &n1, "vm").await;
    let (events, _) = w
        .store
        .list::<keel_api::Event>("/events/broken/")
        .await
        .unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].1.value.key.as_deref(), Some("/vms/broken"));

    // The leader sees n1's instance (a sign of life: the lease counts
    // from here). Then n1 goes silent; once its lease is out the leader
    // takes its VMs over.
    a.reconcile().await.unwrap().expect("a leads");
    let n2 = w.agent("n2").await;
    w.clock
        .advance(LifecycleConfig::default().node_lease_ms + 1_000);
    a.election().step().await.unwrap();
    n2.heartbeat(None).await.unwrap();
    let report = a.reconcile().await.unwrap().expect("a leads");
    assert_eq!(report.taken_over, 2, "{report:?}");
    assert_eq!(w.vm("vm").await.status.node.as_deref(), Some("n2"));
}

/// A lost node's VM with a migration record that cannot be read is not
/// taken over: the migration may be to a live target about to settle the
/// VM. Once the record is readable (here: gone) it is.
#[tokio::test]
async fn takeover_waits_while_a_migration_of_the_vm_is_unreadable() {
    let w = World::new();
    let a = w.control_plane("a");
    round(&[a.election()]).await;
    let n1 = w.agent("n1").await;
    w.create_vm("vm").await;
    a.reconcile().await.unwrap().unwrap();
    run_agent(&w, &n1, "vm").await;
    // The leader sees n1's instance: its lease counts from here.
    a.reconcile().await.unwrap().unwrap();
    let key = "/migrations/vm/vm-m1";
    let rev = w
        .store
        .raw()
        .put(
            key,
            b"{\"vm\":1}".to_vec(),
            keel_store::Precondition::Absent,
        )
        .await
        .unwrap();
    let n2 = w.agent("n2").await;
    w.clock
        .advance(LifecycleConfig::default().node_lease_ms + 1_000);
    a.election().step().await.unwrap();
    n2.heartbeat(None).await.unwrap();
    let report = a.reconcile().await.unwrap().expect("a leads");
    assert_eq!(report.taken_over, 0, "{report:?}");
    assert_eq!(w.vm("vm").await.owner_node(), Some("n1"));

    w.store.raw().delete(key, rev).await.unwrap();
    let report = a.reconcile().await.unwrap().expect("a leads");
    assert_eq!(report.taken_over, 1, "{report:?}");
}

/// One pass places a burst of new VMs evenly: each choice counts towards
/// the load the next one sees, although the writes go out together.
#[tokio::test]
async fn one_pass_spreads_a_burst_evenly() {
    let w = World::new();
    let a = w.control_plane("a");
    round(&[a.election()]).await;
    let _n1 = w.agent("n1").await;
    let _n2 = w.agent("n2").await;
    let _n3 = w.agent("n3").await;
    for i in 0..30 {
        w.create_vm(&format!("vm-{i:02}")).await;
    }
    let report = a.reconcile().await.unwrap().expect("a leads");
    assert_eq!((report.placed, report.unplaced), (30, 0));
    let mut per_node = std::collections::BTreeMap::<String, usize>::new();
    for i in 0..30 {
        let node = w.vm(&format!("vm-{i:02}")).await.status.node.unwrap();
        *per_node.entry(node).or_default() += 1;
    }
    assert_eq!(
        per_node.values().copied().collect::<Vec<_>>(),
        [10, 10, 10],
        "{per_node:?}"
    );
}
