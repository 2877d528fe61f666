//! The heartbeat path does the heartbeat and the fence-lease renewal only,
//! and a planned restart writes its freeze before it waits for anything:
//! neither a slow store under another chore nor long work in flight at
//! shutdown may cost a healthy node its guests. Both run the production
//! driver (`run_vm_controller`, `RunningControllers`: housekeeping with its
//! timeouts) on tokio's paused clock, with the sim driver enforcing the
//! fence lease as the keeper does.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::slow_store::SlowStore;
use common::tokio_clock::{until, TokioClock};
use common::{spec, T0};
use keel_api::{Clock, EvictionWindows, Node, PowerState, RunPolicy, VirtualMachine};
use keel_ctrl::keys::{node_key, vm_key};
use keel_ctrl::{
    ClusterController, LifecycleConfig, RunningControllers, RuntimeConfig, VmController,
};
use keel_hv::sim::{SimConfig, SimHypervisor};
use keel_store::memory::MemoryStore;
use keel_store::{Store, TypedStore};

/// How long the production heartbeat may take before it counts as failed
/// (`runtime::HOUSEKEEPING_MS`).
const HEARTBEAT_TIMEOUT_MS: u64 = 5_000;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 1_500,
        ..Default::default()
    }
}

struct Node1 {
    clock: Arc<dyn Clock>,
    store: TypedStore,
    hv: SimHypervisor,
    ctrl: Arc<VmController>,
}

impl Node1 {
    fn on(raw: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        let store = TypedStore::new(raw);
        let hv = SimHypervisor::new(clock.clone(), 5, sim());
        let ctrl = Arc::new(VmController::new(
            store.clone(),
            Arc::new(hv.clone()),
            clock.clone(),
            // Disks another node could open: its guests are fenced (HA on
            // by default), which is what these tests are about.
            LifecycleConfig {
                shared_disk_dir: Some("/sim-shared".into()),
                ..Default::default()
            },
        ));
        Self {
            clock,
            store,
            hv,
            ctrl,
        }
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    async fn node(&self) -> Node {
        let key = node_key(&self.ctrl.config().node);
        self.store.get::<Node>(&key).await.unwrap().unwrap().value
    }

    async fn vm(&self, name: &str) -> VirtualMachine {
        let key = vm_key(name);
        self.store.get(&key).await.unwrap().unwrap().value
    }

    /// Creates `name` running and waits (virtual time) until it runs;
    /// its instance. The control plane's passes (as `keel serve` on
    /// SQLite makes them) place it once the node has registered.
    async fn running_vm(&self, name: &str) -> String {
        let vm = VirtualMachine::new(name, spec(RunPolicy::Manual, PowerState::Running, 60));
        self.store.create(&vm_key(name), &vm).await.unwrap();
        let cluster = ClusterController::sole(
            self.store.clone(),
            self.clock.clone(),
            self.ctrl.config().clone(),
        );
        let ran = until(10_000, || async {
            cluster.reconcile().await.unwrap();
            self.vm(name).await.status.instance.is_some()
                && !self.hv.live_instances(name).is_empty()
        })
        .await;
        assert!(ran.is_some(), "{:?}", self.vm(name).await.status);
        self.vm(name).await.status.instance.unwrap().id
    }

    /// The guest `instance` of `vm` still runs, the node's heartbeat is
    /// recent (no older than one heartbeat interval and its timeout), and
    /// nothing was fenced.
    async fn assert_healthy(&self, vm: &str, instance: &str, what: &str) {
        assert_eq!(
            self.hv.live_instances(vm),
            [instance],
            "{what}: the guest was ended; {:?}",
            self.hv.log()
        );
        let beat = self.node().await.status.last_heartbeat;
        assert!(
            self.now() - beat <= 2 * HEARTBEAT_TIMEOUT_MS,
            "{what}: last heartbeat {} ms ago",
            self.now() - beat
        );
        assert!(
            !self
                .hv
                .log()
                .iter()
                .any(|l| l.contains("fence lease lapsed")),
            "{what}: {:?}",
            self.hv.log()
        );
    }
}

fn tokio_clock() -> Arc<dyn Clock> {
    Arc::new(TokioClock::starting_at(T0))
}

/// One node on the production housekeeping, its store wrapped to be made
/// slow, with VM `web` running (its instance).
struct Running {
    n: Node1,
    memory: MemoryStore,
    slow: SlowStore,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    instance: String,
}

async fn running_on_a_slow_store() -> Running {
    let clock = tokio_clock();
    let memory = MemoryStore::with_clock(clock.clone());
    let slow = SlowStore::new(Arc::new(memory.clone()));
    let n = Node1::on(Arc::new(slow.clone()), clock.clone());
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(keel_ctrl::run_vm_controller(
        n.ctrl.clone(),
        clock.clone(),
        stop_rx,
    ));
    let instance = n.running_vm("web").await;
    Running {
        n,
        memory,
        slow,
        stop,
        task,
        instance,
    }
}

/// A draining node whose store lists VMs slower than the heartbeat's
/// timeout (the drain's completion check lists every VM): the heartbeat
/// and the fence lease go on being renewed, the guest runs on, nothing is
/// fenced; and the drain's completion is still checked, on the chores'
/// schedule. (With the check inside the heartbeat, the whole heartbeat was
/// dropped at its timeout, every time, and the keeper ended the guest.)
#[tokio::test(start_paused = true)]
async fn a_slow_vm_list_never_holds_up_the_heartbeat_or_the_fence_lease() {
    let Running {
        n,
        slow,
        stop,
        task,
        instance,
        ..
    } = running_on_a_slow_store().await;

    // Drained, its VM has nowhere to go (no other node): the drain stops
    // it, but its guest ignores the power button (and has no agent), so it
    // runs on until the drain's fallback window ends (10 min). The drain
    // stays open meanwhile, its completion checked at every round of
    // housekeeping.
    n.hv.hang_guest(&instance);
    let key = node_key("local");
    let drained = common::cas::modify(&n.store, &key, |node: &mut Node| {
        node.request_drain(n.now(), EvictionWindows::default());
        Ok::<_, String>(())
    });
    assert!(drained.await.unwrap(), "no node record");
    slow.slow_lists("/vms/", Duration::from_millis(HEARTBEAT_TIMEOUT_MS + 3_000));
    for second in 1..=60 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        n.assert_healthy("web", &instance, &format!("{second} s into the slow lists"))
            .await;
    }
    assert!(
        slow.slow_lists_done() > 0,
        "nothing listed VMs: the test tests nothing"
    );
    assert!(n.node().await.draining().is_some());

    // The VM leaves (deleted): the drain is recorded complete, the lists
    // as slow as ever.
    let key = vm_key("web");
    let deleted = common::cas::modify(&n.store, &key, |vm: &mut VirtualMachine| {
        vm.deletion_requested_at = Some(n.now());
        Ok::<_, String>(())
    });
    assert!(deleted.await.unwrap(), "no VM record");
    n.hv.guest_poweroff(&instance);
    let completed = until(60_000, || async {
        n.node()
            .await
            .drain
            .is_some_and(|d| d.completed_at.is_some())
    })
    .await;
    assert!(completed.is_some(), "{:?}", n.node().await.drain);
    stop.send(true).unwrap();
    task.await.unwrap();
    assert!(n.hv.violations().is_empty(), "{:?}", n.hv.violations());
}

/// A slow link to the store: every read or write of the node's record
/// takes 3.5 s, most of the heartbeat's bound, and one heartbeat's write
/// hangs outright. The guest runs on, never fenced: a heartbeat is one
/// write (on the revision of the agent's own last write), and heartbeats
/// start one interval apart whatever each takes, so the one that hung is
/// followed at once by one that gets through. (With a read before each
/// write, every heartbeat outlasted its bound; with the next heartbeat
/// counted from the end of the last, the one after the hang started
/// nearly twenty seconds after the last good one, and the keeper ended
/// the guest.)
#[tokio::test(start_paused = true)]
async fn a_slow_store_link_and_one_hung_heartbeat_never_fence_a_healthy_node() {
    let Running {
        n,
        memory,
        slow,
        stop,
        task,
        instance,
    } = running_on_a_slow_store().await;

    // Read past the slow link: the checks must not wait on it.
    let direct = TypedStore::new(Arc::new(memory.clone()));
    let own_record = node_key(&n.ctrl.config().node);
    let last_heartbeat = || async {
        let node = direct.get::<Node>(&own_record).await.unwrap().unwrap();
        node.value.status.last_heartbeat
    };
    slow.slow_keys(&own_record, Duration::from_millis(3_500));
    let mut longest_gap = 0;
    let mut beat = last_heartbeat().await;
    for second in 1..=90 {
        if second == 30 {
            slow.hang_next_write();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let what = format!("{second} s into the slow link");
        assert_eq!(
            n.hv.live_instances("web"),
            [instance.as_str()],
            "{what}: the guest was ended; {:?}",
            n.hv.log()
        );
        let now = last_heartbeat().await;
        if now != beat {
            longest_gap = longest_gap.max(now - beat);
            beat = now;
        }
    }
    assert!(slow.hang_met(), "no heartbeat hung: the test tests nothing");
    assert!(
        n.now() - beat < 10_000,
        "the heartbeats stopped getting through: the last was sent {} ms ago",
        n.now() - beat
    );
    // One interval between heartbeats, two around the one that hung.
    assert!(longest_gap <= 10_000, "heartbeats {longest_gap} ms apart");
    stop.send(true).unwrap();
    task.await.unwrap();
    assert!(n.hv.violations().is_empty(), "{:?}", n.hv.violations());
}

const FREEZE_MS: u64 = 60_000;

/// A planned restart (SIGTERM) while a reconcile is under way that takes
/// longer than the fence lease and the freeze together (its hypervisor
/// call hangs, as a large image's first hash or a disk delete can take
/// minutes): the freeze is on the record at once, before the slow work
/// ends; the heartbeat goes on until the work is done, so the guest is
/// never fenced while the agent is there; and the freeze written at the
/// exit is counted from the exit, the keeper ending the guest only at its
/// end. (Before, the heartbeat ended at once and the freeze was written
/// only after the in-flight reconciles: the lease lapsed meanwhile.)
#[tokio::test(start_paused = true)]
async fn a_planned_restart_freezes_first_and_heartbeats_until_the_work_in_flight_ends() {
    let clock = tokio_clock();
    let memory = MemoryStore::with_clock(clock.clone());
    let n = Node1::on(Arc::new(memory.clone()), clock.clone());
    let controllers =
        RunningControllers::start(n.ctrl.clone(), clock.clone(), RuntimeConfig::default())
            .await
            .unwrap();
    let instance = n.running_vm("web").await;
    n.hv.hang_calls(&instance);
    let hung = until(10_000, || async { n.hv.hanging_calls() == 1 }).await;
    assert!(hung.is_some(), "web's next look did not reach the driver");

    let asked = n.now();
    let restart = tokio::spawn(async move {
        controllers
            .freeze_and_shutdown(FREEZE_MS, "agent restart (test)")
            .await
    });
    let frozen = until(HEARTBEAT_TIMEOUT_MS, || async {
        n.node().await.freeze.is_some()
    })
    .await;
    assert!(
        frozen.is_some(),
        "no freeze on the record while the work in flight goes on"
    );
    assert_eq!(n.hv.hanging_calls(), 1, "the slow work is still under way");

    // Past the fence lease (20 s) and past the freeze itself.
    let work_ms = FREEZE_MS + 2 * LifecycleConfig::default().self_fence_ms;
    for second in 1..=work_ms / 1_000 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        n.assert_healthy("web", &instance, &format!("{second} s into the shutdown"))
            .await;
        assert!(
            !restart.is_finished(),
            "exited before the work in flight ended"
        );
    }

    n.hv.release_calls(&instance);
    let end = restart.await.unwrap().unwrap();
    let exited = n.now();
    let exited_mono = n.clock.mono();
    assert!(exited >= asked + work_ms);
    let freeze = n.node().await.freeze.expect("frozen at the exit");
    assert!(
        end >= exited_mono.plus(FREEZE_MS),
        "the freeze counts from {end:?} - {FREEZE_MS}, before the exit at {exited_mono:?}"
    );
    assert!(freeze.duration_ms >= FREEZE_MS, "{freeze:?}");

    // Without its agent the guest runs to the freeze's end, then its keeper
    // ends it.
    tokio::time::sleep(Duration::from_millis(end.since(n.clock.mono()) - 1_000)).await;
    assert_eq!(n.hv.live_instances("web"), [instance.as_str()]);
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert!(n.hv.live_instances("web").is_empty(), "{:?}", n.hv.log());
    assert!(n.hv.violations().is_empty(), "{:?}", n.hv.violations());
}
