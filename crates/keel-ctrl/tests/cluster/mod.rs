//! Several simulated nodes sharing one store, one clock and shared storage.
//! Each node runs the production runtime ([`Runtime`]): the cluster moves
//! the clock a tick at a time and lets each running node do what its
//! watches, exit hints and schedule make due. The control plane's
//! cluster controller (alone on the store, as `keel serve` runs it on
//! SQLite) places VMs and takes over lost nodes' VMs each tick.
#![allow(dead_code)]

#[path = "../support/cas.rs"]
mod cas;
#[path = "../support/faulty_store.rs"]
mod faulty_store;
#[path = "../support/housekeeping.rs"]
mod housekeeping;
use faulty_store::FaultyStore;
use housekeeping::VirtualHousekeeping;
#[path = "../support/sim_node.rs"]
mod sim_node;
use sim_node::{sim_host, NodeWiring, SimNode};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use keel_api::{
    Clock, EvictionWindows, ManualClock, Migration, Millis, Node, RunPolicy, VirtualMachine, VmSpec,
};
use keel_ctrl::keys::{migrations_of_prefix, node_key, vm_key, VMS_PREFIX};
use keel_ctrl::{ClusterController, LifecycleConfig, MigrationController, Runtime, VmController};
use keel_hv::sim::{SimConfig, SimFabric, SimFaults, SimHypervisor};
use keel_store::memory::MemoryStore;
use keel_store::node_shards::ShardedStore;
use keel_store::{Store, TypedStore};

pub const T0: Millis = 1_700_000_000_000;
pub const TICK_MS: Millis = 500;

pub struct Agent {
    pub name: String,
    pub hv: SimHypervisor,
    pub vms: Arc<VmController>,
    pub migrations: Arc<MigrationController>,
    /// The node's runtime, driving `vms`, its snapshot controller and
    /// `migrations`.
    pub runtime: Runtime,
    /// What its process is made of, kept across restarts; its stuck
    /// switches follow `migrations_stuck` and `vms_stuck` each tick.
    wiring: NodeWiring,
    /// A stopped agent does nothing: no heartbeat, no reconciles.
    pub running: bool,
    /// The agent heartbeats but its migration controller is stuck.
    pub migrations_stuck: bool,
    /// The agent heartbeats but its VM controller is stuck.
    pub vms_stuck: bool,
    /// The agent runs but cannot reach the store.
    pub partitioned: Arc<AtomicBool>,
    /// VM records the agent read from the store.
    pub vm_reads: Arc<std::sync::atomic::AtomicU64>,
    /// Its heartbeat and chores, on production's schedule.
    pub house: VirtualHousekeeping,
}

impl Agent {
    /// A new process of this agent on the same wiring (`support/sim_node.rs`).
    fn restart_process(&mut self) {
        let node = SimNode::start(&self.wiring);
        self.vms = node.vms;
        self.migrations = node.migrations;
        self.runtime = node.runtime;
    }
}

pub struct Cluster {
    pub clock: ManualClock,
    pub memory: MemoryStore,
    pub store: TypedStore,
    pub fabric: SimFabric,
    pub agents: Vec<Agent>,
    /// The control plane: on the true clock and the unfaulted store (a
    /// partition cuts nodes off, not it).
    pub control: Arc<ClusterController>,
    pub sim: SimConfig,
    /// Each node keeps its disks to itself (no shared storage).
    pub local_disks: bool,
    /// How far each node's wall clock is off (ms, either way). The
    /// controllers see it; the store and the simulated hosts keep true time.
    pub skew_ms: BTreeMap<String, i64>,
    /// Each node's wall-clock offset in force (from `skew_ms` when the node
    /// joined, then moved by [`Cluster::step_wall`]); its monotonic clock
    /// is the true one.
    wall_offsets: BTreeMap<String, Arc<std::sync::atomic::AtomicI64>>,
    /// VMs created so far: each gets a uid of its own, as from the API.
    pub created: u64,
    /// VMs created as members of one required anti-affinity group
    /// ([`APART_GROUP`]): at every tick, no node holds a live domain of
    /// two of them.
    pub apart: Vec<String>,
}

/// The required anti-affinity group of [`Cluster::apart`].
pub const APART_GROUP: &str = "apart";

/// `inner` with the per-node copies of its VM records, as a cluster's
/// processes write it (`keel::distributed::with_node_copies`).
fn with_node_copies(inner: Arc<dyn Store>) -> ShardedStore {
    ShardedStore::new(inner, VMS_PREFIX, keel_ctrl::node_concern::record_nodes())
}

/// A node's clocks: its wall clock is true time plus an offset that a
/// test may step either way; its monotonic clock never steps.
#[derive(Clone)]
pub struct SkewedClock {
    base: ManualClock,
    offset_ms: Arc<std::sync::atomic::AtomicI64>,
}

impl Clock for SkewedClock {
    fn now_ms(&self) -> Millis {
        self.base
            .now_ms()
            .saturating_add_signed(self.offset_ms.load(Ordering::SeqCst))
    }
    fn mono(&self) -> keel_api::Mono {
        self.base.mono()
    }
}

pub fn spec(policy: RunPolicy) -> VmSpec {
    VmSpec {
        run_policy: policy,
        stop_grace_period_s: 30,
        ..keel_testkit::spec::vm_spec()
    }
}

pub fn windows() -> EvictionWindows {
    EvictionWindows {
        submit_ms: 10_000,
        migrate_ms: 20_000,
        fallback_ms: 40_000,
    }
}

impl Cluster {
    pub fn new(sim: SimConfig) -> Self {
        let clock = ManualClock::new(T0);
        let shared: Arc<dyn Clock> = Arc::new(clock.clone());
        let memory = MemoryStore::with_clock(shared.clone());
        // As every process of a cluster writes it: VM records with their
        // per-node copies, which each agent watches (its own only).
        let raw: Arc<dyn Store> = Arc::new(with_node_copies(Arc::new(memory.clone())));
        let control = Arc::new(ClusterController::sole(
            TypedStore::new(raw.clone()),
            shared,
            LifecycleConfig::default(),
        ));
        Self {
            clock,
            memory,
            control,
            store: TypedStore::new(raw),
            fabric: SimFabric::default(),
            agents: Vec::new(),
            sim,
            local_disks: false,
            skew_ms: BTreeMap::new(),
            apart: Vec::new(),
            wall_offsets: BTreeMap::new(),
            created: 0,
        }
    }

    /// Nodes without shared storage: each its own disks, nothing migrates.
    pub fn with_local_disks(sim: SimConfig) -> Self {
        Self {
            local_disks: true,
            ..Self::new(sim)
        }
    }

    /// The common start: node `a` runs VM `vm` under `policy`, then node
    /// `b` joins (empty).
    pub async fn vm_on_a_then_b(policy: RunPolicy) -> Cluster {
        let mut c = Cluster::new(sim());
        c.add_node("a").await;
        c.create("vm", policy).await;
        c.run(3_000).await;
        c.add_node("b").await;
        c
    }

    pub fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    pub fn make_agent(&self, name: &str, seed: u64) -> Agent {
        let own = SimFabric::default();
        let fabric = if self.local_disks { &own } else { &self.fabric };
        let hv = sim_host(
            Arc::new(self.clock.clone()),
            seed,
            self.sim.clone(),
            Some((fabric, name)),
        );
        let offset_ms = self
            .wall_offsets
            .get(name)
            .cloned()
            .unwrap_or_else(|| Arc::new(self.skew_ms.get(name).copied().unwrap_or(0).into()));
        let clock = Arc::new(SkewedClock {
            base: self.clock.clone(),
            offset_ms,
        });
        let partitioned = Arc::new(AtomicBool::new(false));
        let vm_reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut faulty =
            FaultyStore::partitionable(Arc::new(self.memory.clone()), partitioned.clone());
        faulty.vm_reads = vm_reads.clone();
        // The agent's own connection, faults and all, writing copies and
        // watching its node's.
        let sharded = Arc::new(with_node_copies(Arc::new(faulty)));
        let own_records = Some(sharded.node_view(name).unwrap());
        let wiring = NodeWiring {
            cfg: LifecycleConfig {
                node: name.to_string(),
                // One fabric: every node sees the same disks.
                shared_disk_dir: (!self.local_disks).then(|| "/sim-fabric".into()),
                ..Default::default()
            },
            stuck_requeue_ms: TICK_MS,
            own_records,
            ..NodeWiring::new(clock, sharded, hv.clone())
        };
        let node = SimNode::start(&wiring);
        Agent {
            vm_reads,
            name: name.to_string(),
            hv,
            vms: node.vms,
            migrations: node.migrations,
            runtime: node.runtime,
            wiring,
            vms_stuck: false,
            running: true,
            migrations_stuck: false,
            partitioned,
            house: VirtualHousekeeping::new(self.clock.mono()),
        }
    }

    pub async fn add_node(&mut self, name: &str) {
        let skew = self.skew_ms.get(name).copied().unwrap_or(0);
        self.wall_offsets
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(skew.into()));
        let agent = self.make_agent(name, self.agents.len() as u64 + 1);
        agent.vms.heartbeat(None).await.unwrap();
        self.agents.push(agent);
    }

    /// `node`'s wall clock is set `by` ms forward (back, if negative), as an
    /// operator or NTP would; no time passes. Its controllers see it at once.
    pub fn step_wall(&mut self, node: &str, by: i64) {
        let skew = self.skew_ms.get(node).copied().unwrap_or(0);
        self.wall_offsets
            .entry(node.to_string())
            .or_insert_with(|| Arc::new(skew.into()))
            .fetch_add(by, Ordering::SeqCst);
    }

    /// Every agent process restarts: new controllers, same store and nodes.
    pub fn restart_controllers(&mut self) {
        for a in &mut self.agents {
            a.restart_process();
        }
    }

    /// One agent process restarts (same host, guests and hypervisor):
    /// new controllers, nothing carried over in memory.
    pub fn restart_agent(&mut self, name: &str) {
        let i = self.agents.iter().position(|a| a.name == name).unwrap();
        let mono = self.clock.mono();
        let a = &mut self.agents[i];
        a.restart_process();
        a.running = true;
        a.house = VirtualHousekeeping::new(mono);
    }

    pub fn agent_index(&self, name: &str) -> usize {
        self.agents.iter().position(|a| a.name == name).unwrap()
    }

    pub fn agent(&self, name: &str) -> &Agent {
        self.agents.iter().find(|a| a.name == name).unwrap()
    }

    pub async fn create(&mut self, name: &str, policy: RunPolicy) {
        assert!(self.try_create(name, policy).await, "VM {name} exists");
    }

    /// Creates the VM unless one of that name exists; whether it did.
    pub async fn try_create(&mut self, name: &str, policy: RunPolicy) -> bool {
        self.created += 1;
        let mut vm = VirtualMachine::new(name, spec(policy));
        vm.uid = format!("{:016x}", self.created);
        if self.apart.iter().any(|m| m == name) {
            vm.spec.placement.anti_affinity = Some(keel_api::AntiAffinity {
                group: APART_GROUP.into(),
                preferred: false,
            });
        }
        self.store.create(&vm_key(name), &vm).await.is_ok()
    }

    pub async fn vm(&self, name: &str) -> VirtualMachine {
        self.store
            .get::<VirtualMachine>(&vm_key(name))
            .await
            .unwrap()
            .unwrap()
            .value
    }

    pub async fn node(&self, name: &str) -> Node {
        self.store
            .get::<Node>(&node_key(name))
            .await
            .unwrap()
            .unwrap()
            .value
    }

    pub async fn update_node(&self, name: &str, f: impl Fn(&mut Node)) {
        cas::update(&self.store, &node_key(name), f).await
    }

    pub async fn update_vm(&self, name: &str, f: impl Fn(&mut VirtualMachine)) {
        cas::update(&self.store, &vm_key(name), f).await
    }

    pub async fn drain(&self, name: &str) {
        let now = self.now();
        self.update_node(name, |n| n.request_drain(now, windows()))
            .await;
    }

    pub async fn migrations_of(&self, vm: &str) -> Vec<Migration> {
        let (all, _) = self
            .store
            .list::<Migration>(&migrations_of_prefix(vm))
            .await
            .unwrap();
        all.into_iter().map(|(_, e)| e.value).collect()
    }

    /// One tick: time moves, then every running agent does its
    /// housekeeping and lets its runtime do what is due.
    pub async fn tick(&mut self) {
        self.tick_counting_looks().await;
    }

    /// [`Self::tick`], returning how many reconciles each running agent
    /// finished in it, by node.
    pub async fn tick_counting_looks(&mut self) -> BTreeMap<String, usize> {
        self.clock.advance(TICK_MS);
        if let Err(err) = self.control.reconcile().await {
            panic!("cluster pass on the unfaulted store: {err}");
        }
        let mut looks = BTreeMap::new();
        for a in self.agents.iter_mut().filter(|a| a.running) {
            a.house.run_due(&a.vms, &self.clock).await;
            a.wiring
                .migrations_stuck
                .store(a.migrations_stuck, Ordering::SeqCst);
            a.wiring.vms_stuck.store(a.vms_stuck, Ordering::SeqCst);
            looks.insert(a.name.clone(), a.runtime.settle().await);
        }
        self.check_invariants().await;
        looks
    }

    pub async fn run(&mut self, ms: Millis) {
        for _ in 0..ms / TICK_MS {
            self.tick().await;
        }
    }

    pub async fn check_invariants(&self) {
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
        // No node's live guests ever take more than it offers.
        for a in self.agents.iter().filter(|a| a.running) {
            let Some(cap) = self.node(&a.name).await.status.capacity else {
                continue;
            };
            let live = a.hv.live_demand();
            if u64::from(cap.cpus) < live.cpus || cap.memory_mib < live.memory_mib {
                let mut who = Vec::new();
                for (_, vm) in &vms {
                    for inst in a.hv.live_instances(&vm.value.name) {
                        who.push(format!("{inst} ({:?})", vm.value.status));
                    }
                }
                panic!(
                    "node {} over its capacity: live guests take {live:?}, it offers {cap:?}:\n{}",
                    a.name,
                    who.join("\n")
                );
            }
        }
        // No node ever holds a live domain of two members of a required
        // anti-affinity group: not while placing, migrating (source and
        // target both count) or taking over.
        for a in &self.agents {
            let members: Vec<(String, Vec<String>)> = self
                .apart
                .iter()
                .map(|m| (m.clone(), a.hv.live_instances(m)))
                .filter(|(_, live)| !live.is_empty())
                .collect();
            if members.len() > 1 {
                let mut why = String::new();
                for (m, _) in &members {
                    why.push_str(&format!("\n{}", self.explain(m).await));
                }
                panic!(
                    "node {} holds two members of anti-affinity group {APART_GROUP}: {members:?}{why}",
                    a.name
                );
            }
        }
        for (vm, list) in executing {
            if list.len() > 1 {
                panic!(
                    "VM {vm} executes twice: {list:?}\n{}",
                    self.explain(&vm).await
                );
            }
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
            if !handover {
                panic!(
                    "VM {vm}: executing {list:?}, record names {recorded:?}\n{}",
                    self.explain(&vm).await
                );
            }
        }
    }

    /// The VM's record, its migrations and each node's last hypervisor
    /// calls: what a failing invariant needs to be understood.
    pub async fn explain(&self, vm: &str) -> String {
        let logs: Vec<String> = self
            .agents
            .iter()
            .map(|a| {
                let log = a.hv.log();
                let tail = log.len().saturating_sub(10);
                format!("{}: {}", a.name, log[tail..].join(" | "))
            })
            .collect();
        let nodes: Vec<String> = {
            let mut out = Vec::new();
            for a in &self.agents {
                let n = self.node(&a.name).await;
                out.push(format!(
                    "{} heartbeat={} running={} partitioned={}",
                    a.name,
                    n.status.last_heartbeat,
                    a.running,
                    a.partitioned.load(std::sync::atomic::Ordering::SeqCst)
                ));
            }
            out
        };
        format!(
            "now: {}\nrecord: {:?}\nmigrations: {:?}\nnodes: {:?}\nhypervisors:\n{}",
            self.now(),
            self.vm(vm).await.status,
            self.migrations_of(vm).await,
            nodes,
            logs.join("\n")
        )
    }

    pub fn executing_on(&self, node: &str, vm: &str) -> bool {
        !self.agent(node).hv.executing_instances(vm).is_empty()
    }
}

pub fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 2_000,
        migration_ms: 3_000,
        agent_ready_ms: 0,
        faults: SimFaults::default(),
        agent_answers: None,
        host: None,
    }
}
