//! Guest reboots on the sim driver and a manual clock: a reset inside the
//! guest keeps the instance (same id, same domain), is counted and
//! recorded as an event, and makes readiness start over; `keel vm reboot`
//! resets the guest once, through its agent or by the hypervisor after the
//! grace period, also across a controller restart.

mod common;

use common::{spec, World};
use keel_api::{Instance, Phase, PowerState, Readiness, RunPolicy, VirtualMachine};
use keel_hv::sim::SimConfig;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 2_000,
        agent_ready_ms: 3_000,
        ..Default::default()
    }
}

/// A Manual VM whose guest is up (its agent answers), grace period 10 s.
async fn ready(w: &mut World, name: &str, readiness: Readiness) -> Instance {
    let mut s = spec(RunPolicy::Manual, PowerState::Running, 10);
    s.readiness = readiness;
    w.create(name, s).await;
    w.run_for(6_000).await;
    let vm = w.get(name).await.unwrap();
    assert!(vm.ready_since().is_some(), "{vm:?}");
    vm.status.instance.unwrap()
}

fn count(log: &[String], what: &str) -> usize {
    log.iter().filter(|l| l.contains(what)).count()
}

#[tokio::test]
async fn a_guest_reboot_is_a_reset_of_the_same_instance_and_readiness_starts_over() {
    let mut w = World::new(1, sim()).await;
    let first = ready(&mut w, "web", Readiness::Agent).await;

    assert!(w.hv.guest_reset(&first.id));
    let reset_at = w.now();
    w.run_for(500).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(vm.status.phase, Phase::Running);
    assert_eq!(inst.id, first.id, "same instance");
    assert_eq!(w.hv.live_instances("web"), std::slice::from_ref(&first.id));
    assert_eq!(inst.resets, 1);
    assert!(vm.status.last_exit.is_none(), "no exit: {vm:?}");
    assert_eq!(vm.spec.power, PowerState::Running, "a reboot ends no run");
    assert_eq!(
        vm.ready_since(),
        None,
        "not ready until the guest is up again"
    );
    let r = inst.readiness.clone().unwrap();
    assert!(!r.agent && r.reason.is_some(), "{r:?}");
    let trail = w.event_reasons("web").await;
    assert!(
        trail.iter().any(|e| e.starts_with("guest rebooted:")
            && e.contains(&first.id)
            && e.contains("reset 1")),
        "{trail:?}"
    );

    // Up again once its agent answers in the new boot (1 s + 3 s after the reset).
    w.run_for(5_000).await;
    let vm = w.get("web").await.unwrap();
    let ready_at = vm.ready_since().expect("ready again");
    assert!(ready_at >= reset_at + 4_000, "{ready_at} vs {reset_at}");
    assert_eq!(vm.status.instance.unwrap().id, first.id);

    // A loop of resets shows in the count.
    for _ in 0..3 {
        w.hv.guest_reset(&first.id);
        w.run_for(1_000).await;
    }
    let vm = w.get("web").await.unwrap();
    assert_eq!(vm.status.instance.unwrap().resets, 4);
    assert_eq!(vm.status.instance_seq, 1, "never a new instance");
}

#[tokio::test]
async fn a_reboot_request_resets_the_guest_once_through_its_agent_across_a_controller_restart() {
    let mut w = World::new(2, sim()).await;
    let first = ready(&mut w, "web", Readiness::Agent).await;

    w.user_op("web", VirtualMachine::request_reboot)
        .await
        .unwrap();
    // The controller goes away before it has looked; the request is on the record.
    w.restart_controller().await;
    w.run_for(500).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, first.id);
    assert_eq!(inst.resets, 1, "{vm:?}");
    assert_eq!(vm.status.observed_reboot_generation, 1);
    assert!(inst.reboot.is_none(), "done: {inst:?}");
    let log = w.hv.log();
    assert_eq!(count(&log, "guest-shutdown reboot: reset"), 1, "{log:?}");
    assert_eq!(count(&log, "system_reset"), 0, "{log:?}");
    assert!(w
        .event_reasons("web")
        .await
        .iter()
        .any(|e| e.starts_with("guest rebooted as requested")));

    // Once: nothing more happens to it, and it is ready again.
    w.restart_controller().await;
    w.run_for(20_000).await;
    let vm = w.get("web").await.unwrap();
    assert_eq!(vm.status.instance.as_ref().unwrap().resets, 1);
    assert_eq!(vm.status.instance_seq, 1);
    assert!(vm.ready_since().is_some());

    // A stopped VM is not rebooted.
    w.user_op("web", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.run_for(10_000).await;
    let err = w
        .user_op("web", VirtualMachine::request_reboot)
        .await
        .unwrap_err();
    assert!(err.contains("not Running"), "{err}");
}

#[tokio::test]
async fn a_guest_that_does_not_reboot_is_reset_by_the_hypervisor_after_the_grace_period() {
    let mut w = World::new(3, sim()).await;
    let first = ready(&mut w, "web", Readiness::Agent).await;
    w.hv.ignore_reboot(&first.id);

    w.user_op("web", VirtualMachine::request_reboot)
        .await
        .unwrap();
    let asked = w.now();
    w.run_for(1_000).await;
    let vm = w.get("web").await.unwrap();
    let progress = vm
        .status
        .instance
        .clone()
        .unwrap()
        .reboot
        .expect("under way");
    assert_eq!(progress.fallback_at, progress.requested_at + 10_000);
    // A controller restart in the wait: the agent is not asked again, and
    // the recorded fallback time holds.
    w.restart_controller().await;
    w.run_for(7_000).await;
    assert_eq!(
        w.hv.resets(&first.id),
        Some(0),
        "no reset before the grace ends"
    );
    w.run_for(4_000).await;
    let log = w.hv.log();
    assert_eq!(count(&log, "guest-shutdown reboot"), 1, "{log:?}");
    assert_eq!(count(&log, "system_reset: reset"), 1, "{log:?}");
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.unwrap();
    assert_eq!((inst.id.as_str(), inst.resets), (first.id.as_str(), 1));
    assert!(inst.reboot.is_none());
    assert!(inst.last_reset_at.unwrap() >= asked + 10_000);
}

#[tokio::test]
async fn without_an_agent_a_reboot_request_resets_at_once() {
    let mut w = World::new(4, sim()).await;
    let first = ready(&mut w, "web", Readiness::Console("KEEL-GUEST-READY".into())).await;
    w.hv.silence_agent(&first.id, true);
    w.run_for(2_000).await;

    w.user_op("web", VirtualMachine::request_reboot)
        .await
        .unwrap();
    w.run_for(300).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.resets, 1, "{vm:?}");
    assert_eq!(count(&w.hv.log(), "system_reset: reset"), 1);
    // Console readiness looks at the new boot only: not ready until the
    // guest prints its marker again (boot_ms after the reset).
    assert_eq!(vm.ready_since(), None, "{inst:?}");
    w.run_for(2_500).await;
    assert!(w.get("web").await.unwrap().ready_since().is_some());
}
