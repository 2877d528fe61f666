//! The node's production runtime, driven on a manual clock: what wakes a
//! reconcile (exit hints, watch events, the relist after a broken watch)
//! and that one VM's hung hypervisor call holds up that VM only.

mod common;
#[path = "support/reconcile_spans.rs"]
mod reconcile_spans;

use common::{spec, World};
use keel_api::{ExitKind, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_ctrl::RuntimeConfig;
use keel_hv::sim::{SimConfig, SimFaults};
use keel_hv::Hypervisor;
use reconcile_spans::ReconcileSpans;
use tracing_subscriber::layer::SubscriberExt;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 1_500,
        faults: SimFaults::default(),
        ..Default::default()
    }
}

async fn running_vm(w: &mut World, name: &str) -> String {
    w.create(name, spec(RunPolicy::Manual, PowerState::Running, 60))
        .await;
    w.run_for(5_000).await;
    let vm = w.get(name).await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    vm.status.instance.unwrap().id
}

/// The VM controller's index of every VM, as the runtime keeps it.
fn indexed(w: &World, name: &str) -> Option<Option<VirtualMachine>> {
    w.ctrl
        .reflector()
        .read(|index| index.get(name).map(|v| VirtualMachine::clone(&v.vm)))
}

/// For each seed: a guest's own power-off is noticed at the instant the
/// driver reports it (not at the VM's next scheduled look), and after the
/// store's watches break, a change made meanwhile (never delivered as an
/// event) is acted on once the runtime has listed again. All along, the
/// VM index the controller reads matches the store while the watches are
/// open, and is withdrawn while they are broken.
#[tokio::test]
async fn exit_hints_and_a_broken_watch_go_through_the_runtime() {
    for seed in 0..8 {
        let mut w = World::new(seed, sim()).await;
        let inst = running_vm(&mut w, "web").await;
        let next_look = w.runtime.due_at("vm", "web").expect("web is re-checked");
        assert!(next_look > w.now(), "seed {seed}");

        // The exit hint: reconciled at once, the clock standing still.
        w.hv.guest_poweroff(&inst);
        w.reconcile_due().await;
        let vm = w.get("web").await.unwrap();
        let exit = vm.status.last_exit.clone().expect("exit recorded");
        assert_eq!(
            (exit.instance.as_str(), exit.kind, exit.at),
            (inst.as_str(), ExitKind::GuestPoweroff, w.now()),
            "seed {seed}: {vm:?}"
        );
        assert_eq!(vm.status.phase, Phase::Stopped, "seed {seed}: {vm:?}");
        w.run_for(10_000).await;
        // Just after a scheduled look, so the next is `poll_ms` away.
        let look = w.runtime.due_at("vm", "web").expect("re-checked");
        w.clock.advance_to(look);
        w.reconcile_due().await;
        let next_look = w.runtime.due_at("vm", "web").expect("re-checked");
        assert!(next_look > w.now() + w.cfg.retry_ms, "seed {seed}");

        assert_eq!(indexed(&w, "web"), Some(w.get("web").await), "seed {seed}");

        // The watches break; the start asked for meanwhile is no event.
        w.memory.fail_watches("the store restarted");
        w.reconcile_due().await;
        assert_eq!(
            indexed(&w, "web"),
            None,
            "seed {seed}: kept without a watch"
        );
        w.user_op("web", VirtualMachine::request_start)
            .await
            .unwrap();
        let asked_at = w.now();
        w.reconcile_due().await;
        assert_eq!(
            w.get("web").await.unwrap().status.instance,
            None,
            "seed {seed}: started before the relist, so not through it"
        );
        // The relist comes `retry_ms` later, and with it the start.
        w.run_for(w.cfg.retry_ms).await;
        w.reconcile_due().await;
        let vm = w.get("web").await.unwrap();
        let started = vm
            .status
            .instance
            .as_ref()
            .expect("started after the relist");
        assert_eq!(started.created_at, asked_at + w.cfg.retry_ms, "seed {seed}");
        assert!(
            started.created_at < next_look,
            "seed {seed}: by the schedule, not the relist"
        );
        // And the watches work again: a stop now is acted on at once.
        w.user_op("web", VirtualMachine::request_stop)
            .await
            .unwrap();
        w.reconcile_due().await;
        assert!(
            w.get("web").await.unwrap().status.stop.is_some(),
            "seed {seed}: the reopened watch did not deliver"
        );
        assert_eq!(indexed(&w, "web"), Some(w.get("web").await), "seed {seed}");
    }
}

/// A VM whose hypervisor calls hang (a QMP socket that never answers)
/// holds up that VM only: another VM's stop keeps its schedule (ACPI at
/// once, re-checked after 1 s and 2 s more, so seen off at +3 s). And the
/// hung VM is never reconciled twice at once: a change to it waits for the
/// hung look, then is acted on.
#[tokio::test]
async fn a_hung_hypervisor_call_on_one_vm_does_not_delay_another_vms_stop() {
    let mut w = World::new(11, sim()).await;
    let stuck = running_vm(&mut w, "stuck").await;
    running_vm(&mut w, "web").await;

    w.hv.hang_calls(&stuck);
    w.schedule("stuck");
    w.reconcile_due().await;
    assert_eq!(w.hv.hanging_calls(), 1, "the stuck VM's look hangs");

    let asked = w.now();
    w.user_op("web", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.user_op("stuck", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.run_for(3_000).await;
    let web = w.get("web").await.unwrap();
    assert_eq!(web.status.phase, Phase::Stopped, "{web:?}");
    let exit = web.status.last_exit.unwrap();
    assert!(exit.requested);
    assert_eq!(exit.kind, ExitKind::GuestPoweroff);
    assert_eq!(
        exit.at,
        asked + 3_000,
        "seen off at the schedule's second re-check"
    );

    // One look at a time: the change to the stuck VM started no second one.
    assert_eq!(w.hv.hanging_calls(), 1);
    assert_eq!(w.runtime.in_flight(), 1);
    assert!(w.get("stuck").await.unwrap().status.stop.is_none());
    // Released, the hung look finishes and the stop asked for meanwhile runs.
    w.hv.release_calls(&stuck);
    w.reconcile_due().await;
    assert_eq!(w.runtime.in_flight(), 0);
    let vm = w.get("stuck").await.unwrap();
    assert!(vm.status.stop.is_some(), "{vm:?}");
}

/// The same with room for one reconcile at a time (what the old sequential
/// loop was): the hung call holds up the other VM's stop. This is what the
/// test above catches.
#[tokio::test]
async fn with_one_reconcile_at_a_time_the_hung_call_holds_up_every_vm() {
    let mut w = World::new(11, sim()).await.with_runtime(RuntimeConfig {
        max_concurrent_reconciles: 1,
    });
    let stuck = running_vm(&mut w, "stuck").await;
    running_vm(&mut w, "web").await;
    w.hv.hang_calls(&stuck);
    w.schedule("stuck");
    w.reconcile_due().await;
    w.user_op("web", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.run_for(30_000).await;
    let web = w.get("web").await.unwrap();
    assert_eq!(web.status.stop, None, "{web:?}");
    assert_eq!(web.status.phase, Phase::Running);
}

/// A VM whose domain cannot be looked at (its calls hang) keeps no other
/// VM on the node from starting: a new VM's look asks the node for its own
/// domains only (`Hypervisor::domains_of`), not for every domain's state.
#[tokio::test]
async fn a_hung_lookup_of_one_vms_domain_does_not_keep_another_vm_from_starting() {
    let mut w = World::new(12, sim()).await;
    let stuck = running_vm(&mut w, "stuck").await;
    w.hv.hang_calls(&stuck);
    w.schedule("stuck");
    w.reconcile_due().await;
    assert_eq!(w.hv.hanging_calls(), 1, "the stuck VM's look hangs");

    let created = w.now();
    w.create("web", spec(RunPolicy::Manual, PowerState::Running, 60))
        .await;
    w.run_for(5_000).await;
    let web = w.get("web").await.unwrap();
    assert_eq!(web.status.phase, Phase::Running, "{web:?}");
    let instance = web.status.instance.unwrap();
    assert_eq!(instance.created_at, created, "started at its first look");
    assert_eq!(w.hv.hanging_calls(), 1, "the stuck VM's look still hangs");
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
    w.hv.release_calls(&stuck);
    w.reconcile_due().await;
    assert_eq!(w.runtime.in_flight(), 0);
}

/// ...but a VM's own domain that cannot be looked at holds its start: an
/// untracked domain of the VM whose state nobody can read may be running,
/// and "unknown" is never "absent".
#[tokio::test]
async fn a_vms_own_unreadable_domain_holds_its_start() {
    let mut w = World::new(13, sim()).await;
    w.create("cache", spec(RunPolicy::Manual, PowerState::Stopped, 60))
        .await;
    w.run_for(2_000).await;
    assert_eq!(w.get("cache").await.unwrap().status.phase, Phase::Stopped);
    // Left by an earlier agent, unknown to the record, and not answering.
    w.hv.start(&keel_hv::DomainSpec::bare("cache", "cache-orphan", 1, 64))
        .await
        .unwrap();
    w.hv.hang_calls("cache-orphan");
    w.user_op("cache", VirtualMachine::request_start)
        .await
        .unwrap();
    w.run_for(10_000).await;
    let vm = w.get("cache").await.unwrap();
    assert_eq!(vm.status.instance, None, "{vm:?}");
    assert_eq!(w.hv.live_instances("cache"), ["cache-orphan"]);
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
    // Readable again: adopted and stopped by the normal rules, or started
    // after; never a second instance beside it.
    w.hv.release_calls("cache-orphan");
    w.run_for(30_000).await;
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
}

/// Garbage collection ends the domains no record accounts for, but never
/// one it cannot read (it may be running, maybe mid-handover): that one is
/// left alone, not even asked, and the others are still ended.
#[tokio::test]
async fn garbage_collection_leaves_an_unreadable_domain_alone_and_ends_the_others() {
    let w = World::new(14, sim()).await;
    for instance in ["ghost-1", "stray-1"] {
        let vm = instance.trim_end_matches("-1");
        w.hv.start(&keel_hv::DomainSpec::bare(vm, instance, 1, 64))
            .await
            .unwrap();
    }
    w.hv.hang_calls("ghost-1");
    // Bounded only so that a broken build fails instead of hanging.
    tokio::time::timeout(std::time::Duration::from_secs(10), w.ctrl.collect_garbage())
        .await
        .expect("garbage collection waited on the unreadable domain")
        .unwrap();
    assert!(
        w.hv.live_instances("stray").is_empty(),
        "the stray is ended"
    );
    assert_eq!(w.hv.live_instances("ghost"), ["ghost-1"]);
    assert_eq!(
        w.hv.hanging_calls(),
        0,
        "nothing asked the unreadable domain"
    );
}

/// The production driver itself (`run_vm_controller`, as `keel serve`
/// runs it), on tokio's paused clock: it wakes for due looks, for an exit
/// hint (a power-off seen within a millisecond, not at the next look) and
/// relists after the watches break.
#[tokio::test(start_paused = true)]
async fn the_production_driver_wakes_on_hints_and_relists() {
    use keel_ctrl::keys::vm_key;
    use keel_store::{memory::MemoryStore, TypedStore};
    use std::sync::Arc;
    use std::time::Duration;

    let clock: Arc<dyn keel_api::Clock> =
        Arc::new(common::tokio_clock::TokioClock::starting_at(common::T0));
    let memory = MemoryStore::with_clock(clock.clone());
    let store = TypedStore::new(Arc::new(memory.clone()));
    let hv = keel_hv::sim::SimHypervisor::new(clock.clone(), 3, sim());
    let cfg = keel_ctrl::LifecycleConfig::default();
    let ctrl = Arc::new(keel_ctrl::VmController::new(
        store.clone(),
        Arc::new(hv.clone()),
        clock.clone(),
        cfg.clone(),
    ));
    // As `keel serve` on SQLite: the sole cluster controller places.
    let cluster = Arc::new(keel_ctrl::ClusterController::sole(
        store.clone(),
        clock.clone(),
        cfg,
    ));
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let control = tokio::spawn(keel_ctrl::run_control_plane(cluster, stop_rx.clone()));
    let task = tokio::spawn(keel_ctrl::run_vm_controller(ctrl, clock.clone(), stop_rx));
    let get = |name: &'static str| {
        let store = store.clone();
        async move {
            store
                .get::<VirtualMachine>(&vm_key(name))
                .await
                .unwrap()
                .unwrap()
                .value
        }
    };
    use common::tokio_clock::until;

    let vm = keel_api::VirtualMachine::new("web", spec(RunPolicy::Manual, PowerState::Running, 60));
    store.create(&vm_key("web"), &vm).await.unwrap();
    let ran = until(10_000, || async {
        get("web").await.status.phase == Phase::Running
    })
    .await;
    assert!(ran.is_some(), "{:?}", get("web").await.status);

    let inst = get("web").await.status.instance.unwrap().id;
    hv.guest_poweroff(&inst);
    let seen = until(1_000, || async {
        get("web").await.status.last_exit.is_some()
    })
    .await;
    assert!(
        seen.is_some_and(|ms| ms <= 1),
        "power-off seen after {seen:?} ms, not at once"
    );

    memory.fail_watches("the store restarted");
    tokio::time::sleep(Duration::from_millis(1)).await;
    store_request_start(&store).await;
    let started = until(5_000, || async {
        get("web").await.status.instance.is_some()
    })
    .await;
    let started = started.expect("started after the relist");
    assert!(
        started <= 1_001,
        "started after {started} ms (relist after 1 s)"
    );

    stop.send(true).unwrap();
    task.await.unwrap();
    control.await.unwrap();
}

async fn store_request_start(store: &keel_store::TypedStore) {
    common::cas::modify(
        store,
        &keel_ctrl::keys::vm_key("web"),
        |vm: &mut VirtualMachine| vm.request_start().map_err(|e| e.to_string()),
    )
    .await
    .unwrap();
}

/// A guest that ignores the power button is looked at again on the stop's
/// backoff, and the span of each such look says so (not only when): the
/// VM controller's step carries why it asks to look again.
#[tokio::test(flavor = "current_thread")]
async fn a_look_on_the_stop_backoff_names_it() {
    let spans = ReconcileSpans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let mut w = World::new(3, sim()).await;
    let inst = running_vm(&mut w, "web").await;
    w.hv.ignore_acpi(&inst);
    w.run_for(1_000).await;
    spans.arm();
    w.user_op("web", VirtualMachine::request_stop)
        .await
        .unwrap();
    // Within the first half of the 60 s grace period: only the power
    // button, pressed again on its backoff.
    w.run_for(20_000).await;
    let whys = spans.take_whys("vm", "web");
    let on_backoff: Vec<&String> = whys
        .iter()
        .filter(|why| why.contains("stopping: re-check ACPI shutdown (backoff "))
        .collect();
    assert!(on_backoff.len() >= 2, "{whys:#?}");
    assert!(
        on_backoff
            .iter()
            .all(|why| why.starts_with("requeue after ")),
        "{whys:#?}"
    );
    assert_eq!(w.hv.live_instances("web"), vec![inst]);
}

/// A snapshot asked for while its VM stops is looked at again on the
/// retry interval, and the span of each such look says what it waits
/// for (the snapshot controller's own reason, not a fixed text).
#[tokio::test(flavor = "current_thread")]
async fn a_snapshot_waiting_for_a_stopping_vm_names_it() {
    let spans = ReconcileSpans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let mut w = World::new(3, sim()).await;
    let inst = running_vm(&mut w, "web").await;
    spans.arm();
    w.hv.ignore_acpi(&inst);
    w.user_op("web", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.run_for(1_000).await;
    let snap = keel_api::Snapshot {
        vm: "web".into(),
        name: "s1".into(),
        spec: w.get("web").await.unwrap().spec,
        requested_at: w.now(),
        deletion_requested_at: None,
        status: Default::default(),
    };
    let key = keel_ctrl::keys::snapshot_key("web", "s1");
    w.user.create(&key, &snap).await.unwrap();
    w.run_for(3 * w.cfg.retry_ms).await;
    let whys = spans.take_whys("snapshot", &key);
    let waiting = format!(
        "requeue after {} ms: pending: VM web is stopping",
        w.cfg.retry_ms
    );
    assert!(whys.contains(&waiting), "{whys:#?}");
}
