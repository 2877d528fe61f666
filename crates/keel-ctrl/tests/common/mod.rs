//! A small world for driving the VM controller on a manual clock: the
//! in-memory store, the sim hypervisor and a work queue, stepped by hand.
#![allow(dead_code)]

#[path = "../support/cas.rs"]
pub mod cas;
#[path = "../support/faulty_store.rs"]
mod faulty_store;
pub use faulty_store::FaultyStore;

use std::collections::BTreeSet;
use std::sync::Arc;

use keel_api::{
    BootSpec, Clock, DiskSpec, ManualClock, Millis, PowerState, RunPolicy, Snapshot,
    ValidationError, VirtualMachine, VmSpec,
};
use keel_ctrl::keys::snapshot_key;
use keel_ctrl::keys::{vm_key, VMS_PREFIX};
use keel_ctrl::{LifecycleConfig, SnapshotController, VmController, WorkQueue};
use keel_hv::sim::{SimConfig, SimHypervisor};
use keel_store::memory::MemoryStore;
use keel_store::{Store, TypedStore};

pub const T0: Millis = 1_700_000_000_000;

pub fn spec(policy: RunPolicy, power: PowerState, grace_s: u64) -> VmSpec {
    VmSpec {
        cpus: 1,
        memory_mib: 128,
        disks: vec![DiskSpec {
            name: "root".into(),
            size_mib: 64,
            image: None,
        }],
        boot: BootSpec::default(),
        run_policy: policy,
        power,
        restart_generation: 0,
        stop_grace_period_s: grace_s,
        node: None,
        readiness: keel_api::Readiness::Agent,
        network: Default::default(),
        cloud_init: None,
    }
}

pub struct World {
    pub clock: ManualClock,
    pub raw: Arc<dyn Store>,
    pub faulty: Arc<FaultyStore>,
    /// What users write through: never faulted (the API retries for them).
    pub user: TypedStore,
    pub hv: SimHypervisor,
    pub ctrl: VmController,
    pub snaps: SnapshotController,
    pub cfg: LifecycleConfig,
    pub queue: WorkQueue,
    pub errors: usize,
    next_housekeeping: Millis,
}

impl World {
    pub fn new(seed: u64, sim: SimConfig) -> Self {
        let clock = ManualClock::new(T0);
        let shared: Arc<dyn Clock> = Arc::new(clock.clone());
        let raw: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(shared.clone()));
        let faulty = Arc::new(FaultyStore::new(raw.clone(), seed));
        let hv = SimHypervisor::new(shared.clone(), seed, sim);
        let cfg = LifecycleConfig::default();
        let ctrl = VmController::new(
            TypedStore::new(faulty.clone()),
            Arc::new(hv.clone()),
            shared,
            cfg.clone(),
        );
        let snaps = ctrl.snapshot_controller();
        Self {
            snaps,
            clock,
            user: TypedStore::new(raw.clone()),
            raw,
            faulty,
            hv,
            ctrl,
            cfg,
            queue: WorkQueue::default(),
            errors: 0,
            next_housekeeping: 0,
        }
    }

    /// Registers this node (as its agent does on start).
    pub async fn register_node(&mut self) {
        self.ctrl
            .heartbeat(None)
            .await
            .expect("heartbeat on an unfaulted store");
        self.next_housekeeping = self.now() + 5_000;
    }

    pub fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    /// A fresh controller process: nothing carried over but the store and the node.
    pub async fn restart_controller(&mut self) {
        let shared: Arc<dyn Clock> = Arc::new(self.clock.clone());
        self.ctrl = VmController::new(
            TypedStore::new(self.faulty.clone()),
            Arc::new(self.hv.clone()),
            shared,
            self.cfg.clone(),
        );
        self.snaps = self.ctrl.snapshot_controller();
        self.queue = WorkQueue::default();
        self.next_housekeeping = 0;
        let (vms, _) = self
            .user
            .list::<VirtualMachine>(VMS_PREFIX)
            .await
            .expect("unfaulted list");
        let now = self.now();
        for (_, vm) in vms {
            self.queue.schedule(&vm.value.name, now);
        }
    }

    pub async fn create(&mut self, name: &str, spec: VmSpec) -> bool {
        if self.next_housekeeping == 0 {
            let fail_rate = std::mem::replace(&mut *self.faulty.fail_rate.lock().unwrap(), 0.0);
            self.register_node().await;
            *self.faulty.fail_rate.lock().unwrap() = fail_rate;
        }
        let vm = VirtualMachine::new(name, spec);
        let ok = self.user.create(&vm_key(name), &vm).await.is_ok();
        self.queue.schedule(name, self.now());
        ok
    }

    pub async fn get(&self, name: &str) -> Option<VirtualMachine> {
        self.user
            .get::<VirtualMachine>(&vm_key(name))
            .await
            .expect("unfaulted get")
            .map(|e| e.value)
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
        self.queue.schedule(name, self.now());
        Ok(())
    }

    /// Asks for a snapshot and drives the snapshot controller until it is
    /// taken (or failed); returns the final record.
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
            match self.snaps.reconcile(vm, name).await {
                Ok(None) => break,
                _ => self.run_for(self.cfg.retry_ms).await,
            }
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

    /// The node agent's periodic chores, as the runtime does them: the
    /// heartbeat (which keeps the node schedulable) and garbage collection.
    pub async fn housekeeping(&mut self) {
        let now = self.now();
        if now < self.next_housekeeping {
            return;
        }
        if self.ctrl.heartbeat(None).await.is_ok() {
            self.next_housekeeping = now + 5_000;
        }
        let _ = self.ctrl.collect_garbage().await;
    }

    /// Reconciles everything due now. Returns how many reconciles ran.
    pub async fn reconcile_due(&mut self) -> usize {
        self.housekeeping().await;
        let now = self.now();
        let due = self.queue.pop_due(now);
        let n = due.len();
        for name in due {
            match self.ctrl.reconcile(&name).await {
                Ok(Some(at)) => self.queue.schedule(&name, at),
                Ok(None) => {}
                Err(_) => {
                    self.errors += 1;
                    self.queue.schedule(&name, self.now() + self.cfg.retry_ms);
                }
            }
        }
        n
    }

    /// Jumps the clock to the next due time (never backwards) and reconciles.
    pub async fn step_to_next(&mut self) -> bool {
        match self.queue.next_due() {
            Some(at) => {
                self.clock.advance_to(at);
                self.reconcile_due().await;
                true
            }
            None => false,
        }
    }

    /// Runs the controller until `until` (sim time) or until nothing is due.
    pub async fn run_for(&mut self, ms: Millis) {
        let end = self.now() + ms;
        while let Some(at) = self.queue.next_due() {
            if at > end {
                break;
            }
            self.clock.advance_to(at);
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
