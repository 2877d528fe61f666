//! A small world for driving one node on a manual clock: the in-memory
//! store, the sim hypervisor and the node's production runtime
//! ([`Runtime`]), which hears the store's watches and the driver's exit
//! hints and decides what to reconcile; the world only moves the clock.
//! Beside it, as `keel serve` on SQLite runs it, the sole cluster
//! controller places VMs and takes over a lost node's.
#![allow(dead_code)]

#[path = "../support/cas.rs"]
pub mod cas;
#[path = "../support/faulty_store.rs"]
mod faulty_store;
#[path = "../support/housekeeping.rs"]
mod housekeeping;
pub use faulty_store::FaultyStore;
use housekeeping::VirtualHousekeeping;
#[path = "../support/sim_node.rs"]
pub mod sim_node;
use sim_node::{sim_host, NodeWiring, SimNode};
#[path = "../support/slow_store.rs"]
pub mod slow_store;
#[path = "../support/tokio_clock.rs"]
pub mod tokio_clock;

use std::collections::BTreeSet;
use std::sync::Arc;

use keel_api::{
    Clock, ManualClock, Millis, PowerState, RunPolicy, Snapshot, ValidationError, VirtualMachine,
    VmSpec,
};
use keel_ctrl::keys::snapshot_key;
use keel_ctrl::keys::vm_key;
use keel_ctrl::{
    ClusterController, LifecycleConfig, Runtime, RuntimeConfig, SnapshotController, VmController,
};
use keel_hv::sim::{SimConfig, SimHypervisor};
use keel_store::memory::MemoryStore;
use keel_store::{Store, TypedStore};

pub const T0: Millis = 1_700_000_000_000;

pub fn spec(policy: RunPolicy, power: PowerState, grace_s: u64) -> VmSpec {
    VmSpec {
        run_policy: policy,
        power,
        stop_grace_period_s: grace_s,
        ..keel_testkit::spec::vm_spec()
    }
}

pub struct World {
    pub clock: ManualClock,
    pub memory: MemoryStore,
    pub raw: Arc<dyn Store>,
    pub faulty: Arc<FaultyStore>,
    /// What users write through: never faulted (the API retries for them).
    pub user: TypedStore,
    pub hv: SimHypervisor,
    pub ctrl: Arc<VmController>,
    pub snaps: Arc<SnapshotController>,
    pub cfg: LifecycleConfig,
    pub runtime_cfg: RuntimeConfig,
    pub runtime: Runtime,
    /// The process's cluster controller, alone on its store; its passes
    /// use the unfaulted store (its own retries are not under test here).
    pub cluster: Arc<ClusterController>,
    /// When the cluster controller asked to pass again at the latest.
    cluster_next: Option<keel_api::Mono>,
    /// The agent process's heartbeat and chores; `None` until it has
    /// registered the node.
    house: Option<VirtualHousekeeping>,
    /// Every write to a VM record, for [`Self::vm_versions`].
    history: keel_store::Watch,
}

impl World {
    pub async fn new(seed: u64, sim: SimConfig) -> Self {
        let clock = ManualClock::new(T0);
        let shared: Arc<dyn Clock> = Arc::new(clock.clone());
        let memory = MemoryStore::with_clock(shared.clone());
        let raw: Arc<dyn Store> = Arc::new(memory.clone());
        let faulty = Arc::new(FaultyStore::new(raw.clone(), seed));
        let hv = sim_host(shared.clone(), seed, sim, None);
        let cfg = LifecycleConfig::default();
        let runtime_cfg = RuntimeConfig::default();
        let node = SimNode::start(&Self::wiring(&clock, &faulty, &hv, &cfg, &runtime_cfg));
        let cluster = Self::cluster_controller(&clock, &raw, &cfg);
        let history = raw
            .watch(keel_ctrl::keys::VMS_PREFIX, 1)
            .await
            .expect("watch on the memory store");
        Self {
            history,
            snaps: node.snapshots,
            clock,
            memory,
            user: TypedStore::new(raw.clone()),
            raw,
            faulty,
            hv,
            ctrl: node.vms,
            cfg,
            runtime_cfg,
            runtime: node.runtime,
            cluster,
            cluster_next: None,
            house: None,
        }
    }

    fn cluster_controller(
        clock: &ManualClock,
        raw: &Arc<dyn Store>,
        cfg: &LifecycleConfig,
    ) -> Arc<ClusterController> {
        Arc::new(ClusterController::sole(
            TypedStore::new(raw.clone()),
            Arc::new(clock.clone()),
            cfg.clone(),
        ))
    }

    /// What the node process is made of (`support/sim_node.rs`): this
    /// world's clock, faulty store, host and configurations.
    fn wiring(
        clock: &ManualClock,
        faulty: &Arc<FaultyStore>,
        hv: &SimHypervisor,
        cfg: &LifecycleConfig,
        runtime_cfg: &RuntimeConfig,
    ) -> NodeWiring {
        NodeWiring {
            cfg: cfg.clone(),
            runtime_cfg: runtime_cfg.clone(),
            ..NodeWiring::new(Arc::new(clock.clone()), faulty.clone(), hv.clone())
        }
    }

    /// The same world with a runtime bound to `runtime_cfg` (set before
    /// anything runs).
    pub fn with_runtime(mut self, runtime_cfg: RuntimeConfig) -> Self {
        self.runtime_cfg = runtime_cfg;
        self.restart_node_process();
        self
    }

    fn restart_node_process(&mut self) {
        let node = SimNode::start(&Self::wiring(
            &self.clock,
            &self.faulty,
            &self.hv,
            &self.cfg,
            &self.runtime_cfg,
        ));
        self.ctrl = node.vms;
        self.snaps = node.snapshots;
        self.runtime = node.runtime;
        self.cluster = Self::cluster_controller(&self.clock, &self.raw, &self.cfg);
        self.cluster_next = None;
    }

    /// Registers this node (as its agent does on start).
    pub async fn register_node(&mut self) {
        self.ctrl
            .heartbeat(None)
            .await
            .expect("heartbeat on an unfaulted store");
        self.house = Some(VirtualHousekeeping::new(self.clock.mono()));
    }

    pub fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    /// A fresh controller process: nothing carried over but the store and the node.
    /// (Its runtime lists everything on start, so every VM is looked at.)
    pub async fn restart_controller(&mut self) {
        self.restart_node_process();
        self.house = None;
    }

    pub async fn create(&mut self, name: &str, spec: VmSpec) -> bool {
        if self.house.is_none() {
            let fail_rate = std::mem::replace(&mut *self.faulty.fail_rate.lock().unwrap(), 0.0);
            self.register_node().await;
            *self.faulty.fail_rate.lock().unwrap() = fail_rate;
        }
        let vm = VirtualMachine::new(name, spec);
        self.user.create(&vm_key(name), &vm).await.is_ok()
    }

    pub async fn get(&self, name: &str) -> Option<VirtualMachine> {
        self.user
            .get::<VirtualMachine>(&vm_key(name))
            .await
            .expect("unfaulted get")
            .map(|e| e.value)
    }

    /// The reasons of `vm`'s events, oldest first.
    pub async fn event_reasons(&self, vm: &str) -> Vec<String> {
        let (all, _) = self
            .user
            .list::<keel_api::Event>(&format!("{}{vm}/", keel_ctrl::keys::EVENTS_PREFIX))
            .await
            .unwrap();
        all.into_iter().map(|(_, e)| e.value.reason).collect()
    }

    /// A user request: read, modify, compare-and-swap, retry on conflict.
    pub async fn user_op(
        &mut self,
        name: &str,
        op: impl Fn(&mut VirtualMachine) -> Result<(), ValidationError>,
    ) -> Result<(), String> {
        let found = cas::modify(&self.user, &vm_key(name), |vm| {
            op(vm).map_err(|e| e.to_string())
        })
        .await?;
        if !found {
            return Err(format!("VM {name} not found"));
        }
        Ok(())
    }

    /// Asks for a snapshot and runs the node until its snapshot controller
    /// has taken it (or failed); returns the final record.
    pub async fn take_snapshot(&mut self, vm: &str, name: &str) -> Snapshot {
        let spec = self.get(vm).await.expect("VM exists").spec;
        let snap = Snapshot {
            vm: vm.into(),
            name: name.into(),
            spec,
            requested_at: self.now(),
            deletion_requested_at: None,
            status: Default::default(),
        };
        let key = snapshot_key(vm, name);
        self.user.create(&key, &snap).await.expect("new snapshot");
        for _ in 0..100 {
            self.reconcile_due().await;
            let done = self
                .user
                .get::<Snapshot>(&key)
                .await
                .expect("unfaulted get")
                .is_some_and(|e| e.value.status.phase != keel_api::SnapshotPhase::Pending);
            if done {
                break;
            }
            self.run_for(self.cfg.retry_ms).await;
        }
        self.user
            .get::<Snapshot>(&key)
            .await
            .expect("unfaulted get")
            .expect("snapshot record")
            .value
    }

    pub async fn request_delete(&mut self, name: &str) -> Result<(), String> {
        let now = self.now();
        self.user_op(name, |vm| {
            vm.deletion_requested_at.get_or_insert(now);
            Ok(())
        })
        .await
    }

    /// The node agent's periodic chores, on production's code and
    /// schedule (`support/housekeeping.rs`): the heartbeat (which keeps
    /// the node schedulable) and, while it gets through, the chores
    /// (garbage collection among them).
    pub async fn housekeeping(&mut self) {
        let clock = self.clock.clone();
        self.house
            .get_or_insert_with(|| VirtualHousekeeping::new(clock.mono()))
            .run_due(&self.ctrl, &clock)
            .await;
    }

    /// Lets the node do everything ready now: housekeeping, then its
    /// runtime (events in, due reconciles run). Returns how many
    /// reconciles finished.
    pub async fn reconcile_due(&mut self) -> usize {
        self.housekeeping().await;
        self.cluster_pass().await;
        self.runtime.settle().await
    }

    /// One pass of the cluster controller. Production's passes on every
    /// change of a VM or node record and at the next node-lease deadline;
    /// here on every step, which takes in every change made before it.
    async fn cluster_pass(&mut self) {
        match self.cluster.reconcile().await {
            Ok(report) => self.cluster_next = report.map(|r| r.next_at),
            Err(err) => panic!("cluster pass on the unfaulted store: {err}"),
        }
    }

    /// When the node next has something to do: its runtime, or its
    /// housekeeping.
    pub fn next_due(&self) -> Option<Millis> {
        let house = self.house.as_ref().map(|h| {
            let now = self.clock.mono();
            self.now() + h.next_due().since(now)
        });
        let cluster = self.cluster_next.map(|at| {
            let now = self.clock.mono();
            self.now() + at.since(now)
        });
        [self.runtime.next_wake(), house, cluster]
            .into_iter()
            .flatten()
            .min()
    }

    /// Asks the runtime for a look at VM `name` now (as a change would).
    pub fn schedule(&mut self, name: &str) {
        let now = self.now();
        self.runtime.schedule("vm", name, now);
    }

    /// Does what is ready now, then jumps the clock to the next due time
    /// (never backwards) and reconciles; whether anything was to do.
    pub async fn step_to_next(&mut self) -> bool {
        let ran = self.reconcile_due().await;
        match self.next_due() {
            Some(at) => {
                self.clock.advance_to(at.max(self.now()));
                self.reconcile_due().await;
                true
            }
            None => ran > 0,
        }
    }

    /// Every version of every VM record written since the last call, in
    /// revision order (`None`: deleted), read from a watch on the
    /// unfaulted store: what each single write changed, however many
    /// reconciles one step ran.
    pub async fn vm_versions(&mut self) -> Vec<(String, Option<VirtualMachine>)> {
        use std::future::Future;
        let mut out = Vec::new();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        loop {
            // Lets the watch's pump catch up with the writes.
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            let mut got = false;
            loop {
                let next = std::pin::pin!(self.history.next());
                let std::task::Poll::Ready(item) = next.poll(&mut cx) else {
                    break;
                };
                got = true;
                match item.expect("history watch open").expect("history watch") {
                    keel_store::WatchEvent::Put(e) => {
                        let vm: VirtualMachine =
                            serde_json::from_slice(&e.value).expect("VM record");
                        out.push((vm.name.clone(), Some(vm)));
                    }
                    keel_store::WatchEvent::Deleted { key, .. } => {
                        let name = key.trim_start_matches(keel_ctrl::keys::VMS_PREFIX);
                        out.push((name.to_string(), None));
                    }
                }
            }
            if !got {
                return out;
            }
        }
    }

    /// Runs the node for `ms` of sim time, jumping from one due time to
    /// the next.
    pub async fn run_for(&mut self, ms: Millis) {
        let end = self.now() + ms;
        self.reconcile_due().await;
        while let Some(at) = self.next_due() {
            if at > end {
                break;
            }
            self.clock.advance_to(at.max(self.now()));
            self.reconcile_due().await;
        }
        self.clock.advance_to(end);
    }

    /// Every live instance on the node is the one its VM record names.
    pub async fn check_no_untracked_instances(&self) -> Result<(), String> {
        self.check_no_untracked_instances_except(&BTreeSet::new())
            .await
    }

    /// Same, but `orphans` (planted behind the controller's back) may be live
    /// without a record naming them.
    pub async fn check_no_untracked_instances_except(
        &self,
        orphans: &BTreeSet<String>,
    ) -> Result<(), String> {
        if let Some(v) = self.hv.violations().first() {
            return Err(format!("hypervisor saw a violation: {v}"));
        }
        for vm in self.hv.live_vms() {
            let mut live = self.hv.live_instances(&vm);
            live.retain(|i| !orphans.contains(i));
            let recorded = self
                .get(&vm)
                .await
                .and_then(|r| r.status.instance.map(|i| i.id));
            for inst in &live {
                if recorded.as_deref() != Some(inst.as_str()) {
                    return Err(format!(
                        "instance {inst} of VM {vm} is live but the record names {recorded:?}: bookkeeping dropped before the instance was observed gone"
                    ));
                }
            }
        }
        Ok(())
    }
}
