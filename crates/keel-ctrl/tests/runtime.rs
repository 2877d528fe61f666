//! The node's production runtime, driven on a manual clock: what wakes a
//! reconcile (exit hints, watch events, the relist after a broken watch)
//! and that one VM's hung hypervisor call holds up that VM only.

mod common;

use common::{spec, World};
use keel_api::{ExitKind, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_ctrl::RuntimeConfig;
use keel_hv::sim::{SimConfig, SimFaults};

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

/// For each seed: a guest's own power-off is noticed at the instant the
/// driver reports it (not at the VM's next scheduled look), and after the
/// store's watches break, a change made meanwhile (never delivered as an
/// event) is acted on once the runtime has listed again.
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

        // The watches break; the start asked for meanwhile is no event.
        w.memory.fail_watches("the store restarted");
        w.reconcile_due().await;
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
