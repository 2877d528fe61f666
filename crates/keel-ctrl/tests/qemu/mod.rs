//! Real QEMU under the real controller runtime: a temp data dir, the QEMU
//! driver (TCG), an SQLite store, and `run_vm_controller` as `keel serve`
//! runs it, beside the sole cluster controller that places the VMs. Users
//! act through compare-and-swap writes, as the API does.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "../support/cas.rs"]
pub mod cas;

use keel_api::{
    Clock, Phase, PowerState, RunPolicy, SystemClock, ValidationError, VirtualMachine, VmSpec,
};
use keel_ctrl::keys::vm_key;
use keel_ctrl::{
    run_control_plane, run_vm_controller, ClusterController, LifecycleConfig, VmController,
};
use keel_hv::guest::GuestChannel;
use keel_hv::qemu::{AccelChoice, QemuConfig, QemuDriver};
use keel_store::sqlite::SqliteStore;
use keel_store::TypedStore;
use tokio::sync::watch;

pub use keel_testkit::guest::dir as guest_dir;
pub use keel_testkit::procs::{qemu_pids, qemu_pids_in};

impl Env {
    /// This environment's QEMUs whose command line names `needle`.
    pub fn qemu_pids(&self, needle: &str) -> Vec<i32> {
        qemu_pids_in(&self.data_dir, needle)
    }
}

/// One node: its QEMU driver and its agent (controller runtime).
pub struct NodeAgent {
    pub name: String,
    pub driver: QemuDriver,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

pub struct Env {
    /// The first node's driver (single-node tests use only this one).
    pub driver: QemuDriver,
    pub nodes: Vec<NodeAgent>,
    pub store: TypedStore,
    pub data_dir: PathBuf,
    guest: PathBuf,
    /// Changes every node's lifecycle config (`Env::new_with_lifecycle`).
    lifecycle: fn(LifecycleConfig) -> LifecycleConfig,
    /// The cluster controller's stop and task.
    control: Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
    _dir: tempfile::TempDir,
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some((stop, task)) = self.control.take() {
            let _ = stop.send(true);
            task.abort();
        }
        for node in &mut self.nodes {
            let _ = node.stop.send(true);
            if let Some(task) = node.task.take() {
                task.abort();
            }
        }
        for pid in qemu_pids(&self.data_dir.to_string_lossy()) {
            // SAFETY: kill(2) of a QEMU whose command line names our temp dir.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

impl Env {
    pub async fn new() -> Option<Env> {
        Self::new_with(|c| c).await
    }

    /// [`Env::new`] with the first node's ("local") driver config changed.
    pub async fn new_with(tweak: impl FnOnce(QemuConfig) -> QemuConfig) -> Option<Env> {
        Self::new_with_both(tweak, |c| c).await
    }

    /// [`Env::new`] with every node's lifecycle config changed.
    pub async fn new_with_lifecycle(
        lifecycle: fn(LifecycleConfig) -> LifecycleConfig,
    ) -> Option<Env> {
        Self::new_with_both(|c| c, lifecycle).await
    }

    async fn new_with_both(
        tweak: impl FnOnce(QemuConfig) -> QemuConfig,
        lifecycle: fn(LifecycleConfig) -> LifecycleConfig,
    ) -> Option<Env> {
        let guest = guest_dir()?;
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().canonicalize().unwrap();
        let store = TypedStore::new(Arc::new(
            SqliteStore::open(data_dir.join("keel.db")).unwrap(),
        ));
        let mut env = Env {
            driver: Self::driver(&data_dir, &guest, 0, tweak).await,
            nodes: Vec::new(),
            store,
            data_dir,
            guest,
            lifecycle,
            control: None,
            _dir: dir,
        };
        // As `keel serve` on SQLite: the one cluster controller places.
        let cluster = Arc::new(ClusterController::sole(
            env.store.clone(),
            Arc::new(SystemClock),
            env.node_lifecycle("control"),
        ));
        let (stop, stop_rx) = watch::channel(false);
        env.control = Some((stop, tokio::spawn(run_control_plane(cluster, stop_rx))));
        let driver = env.driver.clone();
        env.start_agent("local", driver).await;
        Some(env)
    }

    /// Nodes on one host share the disk directory, as nodes of a cluster
    /// share storage, so VMs can migrate between them.
    /// Node `index` keeps its instances in `<data dir>/n<index>` (short:
    /// socket paths are limited to 107 bytes).
    async fn driver(
        data_dir: &Path,
        guest: &Path,
        index: usize,
        tweak: impl FnOnce(QemuConfig) -> QemuConfig,
    ) -> QemuDriver {
        let mut config = QemuConfig::new(data_dir.join(format!("n{index}"))).with_test_guest(guest);
        config.accel = AccelChoice::Tcg;
        config.disk_dir = Some(data_dir.join("shared-disks"));
        QemuDriver::new(tweak(config)).await.unwrap()
    }

    /// Adds another node, with its own QEMU driver and agent.
    pub async fn add_node(&mut self, name: &str) -> QemuDriver {
        self.add_node_with(name, |c| c).await
    }

    /// [`Env::add_node`] with the node's driver config changed.
    pub async fn add_node_with(
        &mut self,
        name: &str,
        tweak: impl FnOnce(QemuConfig) -> QemuConfig,
    ) -> QemuDriver {
        let driver = Self::driver(&self.data_dir, &self.guest, self.nodes.len(), tweak).await;
        self.start_agent(name, driver.clone()).await;
        driver
    }

    async fn start_agent(&mut self, name: &str, driver: QemuDriver) {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let cfg = self.node_lifecycle(name);
        let ctrl = Arc::new(VmController::new(
            self.store.clone(),
            Arc::new(driver.clone()),
            clock.clone(),
            cfg,
        ));
        ctrl.heartbeat(None).await.unwrap();
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(run_vm_controller(ctrl, clock, stop_rx));
        self.nodes.push(NodeAgent {
            name: name.into(),
            driver,
            stop,
            task: Some(task),
        });
    }

    /// Node `name`'s lifecycle config (the cluster controller's timings
    /// too).
    fn node_lifecycle(&self, name: &str) -> LifecycleConfig {
        (self.lifecycle)(LifecycleConfig {
            node: name.into(),
            poll_ms: 500,
            // The nodes share one disk dir, as nodes on shared storage.
            shared_disk_dir: Some("/shared-test-disks".into()),
            ..Default::default()
        })
    }

    pub fn node_driver(&self, name: &str) -> &QemuDriver {
        &self
            .nodes
            .iter()
            .find(|n| n.name == name)
            .expect("node")
            .driver
    }

    pub fn spec(policy: RunPolicy, grace_s: u64) -> VmSpec {
        VmSpec {
            memory_mib: 256,
            disks: vec![keel_testkit::spec::disk("data", 64)],
            run_policy: policy,
            power: PowerState::Running,
            stop_grace_period_s: grace_s,
            readiness: keel_api::Readiness::Console("KEEL-GUEST-READY".into()),
            ..keel_testkit::spec::vm_spec()
        }
    }

    pub async fn create(&self, name: &str, spec: VmSpec) {
        self.store
            .create(&vm_key(name), &VirtualMachine::new(name, spec))
            .await
            .unwrap();
    }

    pub async fn vm(&self, name: &str) -> VirtualMachine {
        self.store
            .get::<VirtualMachine>(&vm_key(name))
            .await
            .unwrap()
            .expect("VM record")
            .value
    }

    /// A user request, as the API makes it: read, modify, compare-and-swap.
    pub async fn user(
        &self,
        name: &str,
        op: impl Fn(&mut VirtualMachine) -> Result<(), ValidationError>,
    ) {
        cas::update(&self.store, &vm_key(name), |vm: &mut VirtualMachine| {
            op(vm).unwrap()
        })
        .await
    }

    /// Asks for snapshot `name` of `vm` (its spec now) and waits until the
    /// node's snapshot controller has taken it (or failed); returns the
    /// final record.
    pub async fn take_snapshot(&self, vm: &str, name: &str) -> keel_api::Snapshot {
        use keel_api::{Snapshot, SnapshotPhase};
        let spec = self.vm(vm).await.spec;
        let key = keel_ctrl::keys::snapshot_key(vm, name);
        let request = Snapshot {
            vm: vm.into(),
            name: name.into(),
            spec,
            requested_at: 0,
            deletion_requested_at: None,
            status: Default::default(),
        };
        self.store.create(&key, &request).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let snap = self
                .store
                .get::<Snapshot>(&key)
                .await
                .unwrap()
                .unwrap()
                .value;
            if snap.status.phase != SnapshotPhase::Pending {
                return snap;
            }
            assert!(Instant::now() < deadline, "snapshot not taken: {snap:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `pred` holds for the VM record (polling; real QEMU runs
    /// in real time).
    pub async fn wait_for(
        &self,
        name: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&VirtualMachine) -> bool,
    ) -> VirtualMachine {
        let deadline = Instant::now() + timeout;
        loop {
            let vm = self.vm(name).await;
            if pred(&vm) {
                return vm;
            }
            assert!(
                Instant::now() < deadline,
                "VM {name}: not {what} within {timeout:?}: {vm:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for the VM's current instance to run and its guest to be
    /// ready; returns the instance id and a synced command channel.
    pub async fn ready(&self, name: &str, timeout: Duration) -> (String, GuestChannel) {
        let vm = self
            .wait_for(name, timeout, "running", |vm| {
                vm.status.phase == Phase::Running && vm.status.instance.is_some()
            })
            .await;
        let inst = vm.status.instance.unwrap();
        let driver = self.node_driver(&inst.node);
        let instance = inst.id;
        let guest = GuestChannel::connect_ready(
            &driver.console_log(&instance),
            &driver.command_socket(&instance),
            timeout,
        )
        .await
        .unwrap_or_else(|e| panic!("guest of {instance} not ready: {e}"));
        (instance, guest)
    }
}
