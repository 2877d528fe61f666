//! Node drain: migrate first, within bounded windows, then fall back to
//! stop and start elsewhere. Several simulated nodes share one store, one
//! clock and shared storage; every tick each node agent heartbeats, ends
//! stray domains and looks at every VM and migration (level-triggered, so
//! polling everything is the same as reacting to watches, only slower).
//!
//! Checked at every tick: no VM ever has two executing instances across
//! the cluster, and an executing instance is always the one its record names.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_api::{
    Clock, EvictionPhase, EvictionWindows, ManualClock, Migration, MigrationPhase, Millis, Node,
    Phase, PowerState, RunPolicy, VirtualMachine, VmSpec,
};
use keel_ctrl::keys::{migrations_of_prefix, node_key, vm_key, MIGRATIONS_PREFIX, VMS_PREFIX};
use keel_ctrl::{LifecycleConfig, MigrationController, VmController};
use keel_hv::sim::{SimConfig, SimFabric, SimFaults, SimHypervisor};
use keel_store::memory::MemoryStore;
use keel_store::{Store, StoreError, TypedStore};

const T0: Millis = 1_700_000_000_000;
const TICK_MS: Millis = 500;

struct Agent {
    name: String,
    hv: SimHypervisor,
    vms: VmController,
    migrations: MigrationController,
    /// A stopped agent does nothing: no heartbeat, no reconciles.
    running: bool,
    /// The agent heartbeats but its migration controller is stuck.
    migrations_stuck: bool,
}

struct Cluster {
    clock: ManualClock,
    memory: MemoryStore,
    store: TypedStore,
    fabric: SimFabric,
    agents: Vec<Agent>,
    sim: SimConfig,
}

fn spec(policy: RunPolicy) -> VmSpec {
    VmSpec {
        cpus: 1,
        memory_mib: 128,
        disks: vec![keel_api::DiskSpec {
            name: "root".into(),
            size_mib: 64,
        }],
        boot: Default::default(),
        run_policy: policy,
        power: PowerState::Running,
        restart_generation: 0,
        stop_grace_period_s: 30,
        node: None,
    }
}

fn windows() -> EvictionWindows {
    EvictionWindows {
        submit_ms: 10_000,
        migrate_ms: 20_000,
        fallback_ms: 40_000,
    }
}

impl Cluster {
    fn new(sim: SimConfig) -> Self {
        let clock = ManualClock::new(T0);
        let shared: Arc<dyn Clock> = Arc::new(clock.clone());
        let memory = MemoryStore::with_clock(shared);
        let raw: Arc<dyn Store> = Arc::new(memory.clone());
        Self {
            clock,
            memory,
            store: TypedStore::new(raw),
            fabric: SimFabric::default(),
            agents: Vec::new(),
            sim,
        }
    }

    fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    fn make_agent(&self, name: &str, seed: u64) -> Agent {
        let shared: Arc<dyn Clock> = Arc::new(self.clock.clone());
        let hv = SimHypervisor::join(shared.clone(), seed, self.sim.clone(), &self.fabric, name);
        let cfg = LifecycleConfig {
            node: name.to_string(),
            ..Default::default()
        };
        let vms = VmController::new(self.store.clone(), Arc::new(hv.clone()), shared, cfg);
        let migrations = vms.migration_controller();
        Agent {
            name: name.to_string(),
            hv,
            vms,
            migrations,
            running: true,
            migrations_stuck: false,
        }
    }

    async fn add_node(&mut self, name: &str) {
        let agent = self.make_agent(name, self.agents.len() as u64 + 1);
        agent.vms.heartbeat(None).await.unwrap();
        self.agents.push(agent);
    }

    /// Every agent process restarts: new controllers, same store and nodes.
    fn restart_controllers(&mut self) {
        for i in 0..self.agents.len() {
            let shared: Arc<dyn Clock> = Arc::new(self.clock.clone());
            let a = &self.agents[i];
            let cfg = LifecycleConfig {
                node: a.name.clone(),
                ..Default::default()
            };
            let vms = VmController::new(self.store.clone(), Arc::new(a.hv.clone()), shared, cfg);
            let migrations = vms.migration_controller();
            let a = &mut self.agents[i];
            a.vms = vms;
            a.migrations = migrations;
        }
    }

    fn agent(&self, name: &str) -> &Agent {
        self.agents.iter().find(|a| a.name == name).unwrap()
    }

    async fn create(&mut self, name: &str, policy: RunPolicy) {
        let vm = VirtualMachine::new(name, spec(policy));
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

    async fn node(&self, name: &str) -> Node {
        self.store
            .get::<Node>(&node_key(name))
            .await
            .unwrap()
            .unwrap()
            .value
    }

    async fn update_node(&self, name: &str, f: impl Fn(&mut Node)) {
        loop {
            let e = self
                .store
                .get::<Node>(&node_key(name))
                .await
                .unwrap()
                .unwrap();
            let mut n = e.value;
            f(&mut n);
            match self.store.update(&node_key(name), &n, e.revision).await {
                Ok(_) => return,
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => panic!("{e}"),
            }
        }
    }

    async fn update_vm(&self, name: &str, f: impl Fn(&mut VirtualMachine)) {
        loop {
            let e = self
                .store
                .get::<VirtualMachine>(&vm_key(name))
                .await
                .unwrap()
                .unwrap();
            let mut v = e.value;
            f(&mut v);
            match self.store.update(&vm_key(name), &v, e.revision).await {
                Ok(_) => return,
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => panic!("{e}"),
            }
        }
    }

    async fn drain(&self, name: &str) {
        let now = self.now();
        self.update_node(name, |n| n.request_drain(now, windows()))
            .await;
    }

    async fn migrations_of(&self, vm: &str) -> Vec<Migration> {
        let (all, _) = self
            .store
            .list::<Migration>(&migrations_of_prefix(vm))
            .await
            .unwrap();
        all.into_iter().map(|(_, e)| e.value).collect()
    }

    /// One tick: time moves, then every running agent does its rounds.
    async fn tick(&mut self) {
        self.clock.advance(TICK_MS);
        let (vms, _) = self.store.list::<VirtualMachine>(VMS_PREFIX).await.unwrap();
        let (migrations, _) = self
            .store
            .list::<Migration>(MIGRATIONS_PREFIX)
            .await
            .unwrap();
        for a in self.agents.iter().filter(|a| a.running) {
            a.vms.heartbeat(None).await.unwrap();
            a.vms.collect_garbage().await.unwrap();
            for (_, vm) in &vms {
                // A few rounds, so chains of steps finish within the tick.
                for _ in 0..3 {
                    let _ = a.vms.reconcile(&vm.value.name).await;
                }
            }
            if !a.migrations_stuck {
                for (_, m) in &migrations {
                    let _ = a.migrations.reconcile(&m.value.vm, &m.value.id).await;
                }
            }
        }
        self.check_invariants().await;
    }

    async fn run(&mut self, ms: Millis) {
        for _ in 0..ms / TICK_MS {
            self.tick().await;
        }
    }

    async fn check_invariants(&self) {
        let mut executing: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        let (vms, _) = self.store.list::<VirtualMachine>(VMS_PREFIX).await.unwrap();
        for a in &self.agents {
            assert!(
                a.hv.violations().is_empty(),
                "node {}: {:?}",
                a.name,
                a.hv.violations()
            );
            for (_, vm) in &vms {
                for inst in a.hv.executing_instances(&vm.value.name) {
                    executing
                        .entry(vm.value.name.clone())
                        .or_default()
                        .push((a.name.clone(), inst));
                }
            }
        }
        for (vm, list) in executing {
            assert!(list.len() <= 1, "VM {vm} executes twice: {list:?}");
            let record = self.vm(&vm).await;
            let recorded = record
                .status
                .instance
                .as_ref()
                .map(|i| (i.node.clone(), i.id.clone()));
            if recorded.as_ref() == list.first() {
                continue;
            }
            // The hypervisor has handed over before the record caught up:
            // allowed only for the target of a migration from the recorded instance.
            let (node, inst) = &list[0];
            let handover = self.migrations_of(&vm).await.into_iter().any(|m| {
                &m.target_instance == inst
                    && &m.target_node == node
                    && recorded.as_ref().map(|r| &r.1) == Some(&m.source_instance)
            });
            assert!(
                handover,
                "VM {vm}: executing {list:?}, record names {recorded:?}"
            );
        }
    }

    fn executing_on(&self, node: &str, vm: &str) -> bool {
        !self.agent(node).hv.executing_instances(vm).is_empty()
    }
}

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 2_000,
        migration_ms: 3_000,
        faults: SimFaults::default(),
    }
}

/// Three VMs on node a, node b joins, a is drained: all three move to b by
/// live migration (no stop), their disk data intact, the drain completes
/// and a stays cordoned by Keel.
#[tokio::test]
async fn drain_live_migrates_every_vm() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    for name in ["one", "two", "three"] {
        c.create(name, RunPolicy::AlwaysOnUnlessStoppedManually)
            .await;
    }
    c.run(5_000).await;
    for name in ["one", "two", "three"] {
        assert!(c.executing_on("a", name), "{name} runs on a");
        c.agent("a")
            .hv
            .guest_write(name, 1, &format!("data of {name}"))
            .unwrap();
    }
    c.add_node("b").await;
    c.drain("a").await;
    c.run(30_000).await;
    for name in ["one", "two", "three"] {
        let vm = c.vm(name).await;
        assert_eq!(vm.status.phase, Phase::Running, "{name}: {vm:?}");
        assert!(c.executing_on("b", name), "{name} runs on b");
        assert_eq!(vm.status.instance.as_ref().unwrap().node, "b");
        assert!(
            vm.status.last_exit.is_none(),
            "{name} was stopped, not migrated: {vm:?}"
        );
        assert_eq!(
            c.agent("b").hv.disk_record(name, 1),
            Some(format!("data of {name}"))
        );
        let ms = c.migrations_of(name).await;
        assert_eq!(ms.len(), 1, "one migration per attempt: {ms:?}");
        assert_eq!(ms[0].status.phase, MigrationPhase::Succeeded);
        assert!(
            c.agent("a").hv.live_instances(name).is_empty(),
            "source cleaned up"
        );
    }
    let a = c.node("a").await;
    assert!(a.cordoned && a.cordoned_by_keel);
    assert!(a.drain.unwrap().completed_at.is_some());
}

/// No node to go to (the only other one is cordoned by its operator): the
/// eviction degrades at once to stop here; the VM starts elsewhere only when
/// a node can take it.
#[tokio::test]
async fn no_target_degrades_to_stop_and_starts_elsewhere_later() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.update_node("b", Node::cordon_by_operator).await;
    c.drain("a").await;
    c.run(10_000).await;
    let vm = c.vm("vm").await;
    assert!(vm.status.instance.is_none(), "{vm:?}");
    assert!(c.migrations_of("vm").await.is_empty());
    // Keel does not lift the operator's cordon; the operator does.
    c.update_node("b", |n| {
        n.cordoned = false;
    })
    .await;
    c.run(5_000).await;
    assert!(c.executing_on("b", "vm"));
    assert_eq!(c.vm("vm").await.status.phase, Phase::Running);
}

/// The target never gets ready: the submission window expires, the
/// migration is marked failed, the VM is stopped and started elsewhere.
#[tokio::test]
async fn submission_window_expiry_falls_back() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.agents[1].migrations_stuck = true;
    c.drain("a").await;
    c.run(9_000).await;
    let ev = c.vm("vm").await.status.eviction.unwrap();
    assert_eq!(
        ev.phase,
        EvictionPhase::Submitting,
        "still within the window"
    );
    c.run(3_000).await;
    let ev = c.vm("vm").await.status.eviction.unwrap();
    assert_eq!(ev.phase, EvictionPhase::Fallback);
    assert!(ev.message.unwrap().contains("submission window expired"));
    c.agents[1].migrations_stuck = false;
    c.run(20_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{vm:?}");
    assert!(vm.status.last_exit.unwrap().requested);
    let ms = c.migrations_of("vm").await;
    assert!(
        ms.iter().all(|m| m.status.phase == MigrationPhase::Failed),
        "{ms:?}"
    );
}

/// A migration slower than its window is cancelled and the VM falls back.
#[tokio::test]
async fn migration_window_expiry_cancels_and_falls_back() {
    let mut c = Cluster::new(SimConfig {
        migration_ms: 60_000,
        ..sim()
    });
    c.add_node("a").await;
    c.create("vm", RunPolicy::Manual).await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.drain("a").await;
    c.run(15_000).await;
    assert_eq!(
        c.vm("vm").await.status.eviction.unwrap().phase,
        EvictionPhase::Migrating
    );
    c.run(15_000).await;
    let vm = c.vm("vm").await;
    assert!(
        c.executing_on("b", "vm"),
        "restarted on b after the fallback: {vm:?}"
    );
    assert_eq!(
        c.migrations_of("vm").await[0].status.phase,
        MigrationPhase::Failed
    );
    assert!(vm.status.last_exit.is_some(), "fell back through a stop");
}

/// The cancel comes too late and the migration completes after its
/// window: the success is honoured, the VM is not stopped.
#[tokio::test]
async fn late_migration_success_is_honoured() {
    let mut c = Cluster::new(SimConfig {
        migration_ms: 25_000,
        faults: SimFaults {
            cancel_too_late: 1.0,
            ..Default::default()
        },
        ..sim()
    });
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.agent("a").hv.guest_write("vm", 3, "kept").unwrap();
    c.add_node("b").await;
    c.drain("a").await;
    c.run(60_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{vm:?}");
    assert!(vm.status.last_exit.is_none(), "not stopped: {vm:?}");
    assert_eq!(
        c.migrations_of("vm").await[0].status.phase,
        MigrationPhase::Succeeded
    );
    assert_eq!(
        c.agent("b").hv.disk_record("vm", 3).as_deref(),
        Some("kept")
    );
}

/// Controller restarts mid-drain resume the stored windows; they do not
/// open new ones.
#[tokio::test]
async fn controller_restart_resumes_the_stored_deadlines() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.agents[1].migrations_stuck = true;
    c.drain("a").await;
    c.run(4_000).await;
    let before = c.vm("vm").await.status.eviction.unwrap();
    for _ in 0..4 {
        c.restart_controllers();
        c.run(1_000).await;
    }
    let after = c.vm("vm").await.status.eviction.unwrap();
    assert_eq!(before.submit_deadline, after.submit_deadline);
    assert_eq!(before.started_at, after.started_at);
    c.run(3_000).await;
    assert_eq!(
        c.vm("vm").await.status.eviction.unwrap().phase,
        EvictionPhase::Fallback
    );
}

/// Missing or invalid deadlines (a record from an older Keel, or damaged)
/// count as expired: straight to the fallback.
#[tokio::test]
async fn missing_or_invalid_markers_fall_back() {
    for case in ["missing", "invalid"] {
        let mut c = Cluster::new(sim());
        c.add_node("a").await;
        c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
            .await;
        c.run(3_000).await;
        c.add_node("b").await;
        c.agents[1].migrations_stuck = true;
        c.drain("a").await;
        c.tick().await;
        c.update_vm("vm", |vm| {
            let ev = vm.status.eviction.as_mut().unwrap();
            ev.submit_deadline = match case {
                "missing" => None,
                _ => Some(ev.started_at - 1),
            };
        })
        .await;
        c.tick().await;
        let ev = c.vm("vm").await.status.eviction.unwrap();
        assert_eq!(ev.phase, EvictionPhase::Fallback, "{case}");
    }
}

/// A VM carrying a failed migration from an earlier drain gets a new
/// attempt in the next drain instead of being skipped.
#[tokio::test]
async fn stale_failed_migration_gets_a_new_attempt() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.add_node("b").await;
    // An earlier drain of a: its migration failed; then the drain was cancelled.
    c.agents[1].hv.set_faults(SimFaults {
        op_unavailable: 1.0,
        ..Default::default()
    });
    c.drain("a").await;
    c.run(2_000).await;
    let stale = c.vm("vm").await.status.eviction.unwrap();
    assert!(c
        .migrations_of("vm")
        .await
        .iter()
        .any(|m| m.status.phase == MigrationPhase::Failed));
    c.update_node("a", |n| {
        n.uncordon_by_keel();
    })
    .await;
    c.agents[1].hv.set_faults(SimFaults::default());
    // Long enough for every window of the stale marker to have passed.
    c.run(60_000).await;
    assert!(c.executing_on("a", "vm"));
    assert_eq!(
        c.vm("vm").await.status.eviction.as_ref(),
        Some(&stale),
        "marker left behind"
    );
    // The new drain: a fresh attempt, which succeeds.
    c.drain("a").await;
    c.run(20_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{vm:?}");
    assert!(
        vm.status.last_exit.is_none(),
        "migrated, not stopped: {vm:?}"
    );
    let ms = c.migrations_of("vm").await;
    assert_eq!(
        ms.last().unwrap().status.phase,
        MigrationPhase::Succeeded,
        "{ms:?}"
    );
}

/// Many controller restarts during a drain: each attempt's migration
/// record is created once.
#[tokio::test]
async fn a_migration_is_created_once_per_attempt() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.add_node("b").await;
    c.drain("a").await;
    for _ in 0..20 {
        c.restart_controllers();
        c.tick().await;
    }
    c.run(10_000).await;
    assert!(c.executing_on("b", "vm"));
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1, "{ms:?}");
    assert_eq!(c.vm("vm").await.status.migration_seq, 1);
}

/// A crash between reserving a migration on the VM record and creating its
/// record: the retry creates the reserved migration, not a second one.
#[tokio::test]
async fn a_reserved_migration_is_created_under_its_reserved_id() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.add_node("b").await;
    let mut failed_once = false;
    c.memory
        .set_fault_hook(Some(Box::new(move |op: &keel_store::memory::Op<'_>| {
            if !failed_once
                && op.kind == keel_store::memory::OpKind::Put
                && op.key.starts_with(MIGRATIONS_PREFIX)
            {
                failed_once = true;
                return Some(keel_store::memory::Fault::Unavailable("lost create".into()));
            }
            None
        })));
    c.drain("a").await;
    c.run(15_000).await;
    assert!(c.executing_on("b", "vm"));
    let ms = c.migrations_of("vm").await;
    assert_eq!(
        ms.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        ["vm-m1"]
    );
    assert_eq!(c.vm("vm").await.status.migration_seq, 1);
}
