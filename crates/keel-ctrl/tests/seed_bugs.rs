//! One focused regression test per lifecycle bug that mature platforms have
//! shipped. Each fails when the corresponding rule in keel-ctrl is undone.

mod common;

use common::{spec, World};
use keel_api::{ExitKind, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_hv::sim::{SimConfig, SimFaults};
use keel_hv::{DomainSpec, Hypervisor};

fn slow_guest() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 30_000,
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

/// Bug: stopping dropped the domain's bookkeeping, so a restart saw "no
/// instance" and started a second one while the first was still powering off.
#[tokio::test]
async fn restart_keeps_bookkeeping_until_the_old_instance_is_gone() {
    let mut w = World::new(1, slow_guest()).await;
    let old = running_vm(&mut w, "web").await;
    w.user_op("web", VirtualMachine::request_restart)
        .await
        .unwrap();

    // The guest needs 30 s to power off; step through it second by second.
    let mut saw_stopping = false;
    for _ in 0..29 {
        w.run_for(1_000).await;
        w.check_no_untracked_instances().await.unwrap();
        let vm = w.get("web").await.unwrap();
        assert_eq!(
            vm.status.instance.as_ref().map(|i| i.id.as_str()),
            Some(old.as_str())
        );
        assert_eq!(w.hv.live_instances("web"), vec![old.clone()]);
        saw_stopping |= vm.status.phase == Phase::Stopping;
    }
    assert!(saw_stopping);
    w.run_for(40_000).await;
    let vm = w.get("web").await.unwrap();
    let new = vm.status.instance.unwrap().id;
    assert_ne!(new, old);
    assert_eq!(vm.status.phase, Phase::Running);
    assert_eq!(w.hv.live_instances("web"), vec![new]);
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
}

/// Bug: a failed lookup during the stop wait was read as "the domain is
/// gone", ending the wait early; the replacement started next to a guest
/// that was still running.
#[tokio::test]
async fn lookup_error_during_stop_never_counts_as_gone() {
    let mut w = World::new(2, slow_guest()).await;
    let old = running_vm(&mut w, "db").await;
    w.hv.hang_guest(&old);
    w.user_op("db", VirtualMachine::request_restart)
        .await
        .unwrap();
    w.run_for(500).await;
    assert_eq!(w.get("db").await.unwrap().status.phase, Phase::Stopping);

    w.hv.set_faults(SimFaults {
        lookup_unavailable: 1.0,
        ..Default::default()
    });
    // Well past the 60 s grace period: the controller escalates to a kill,
    // but while it cannot see the domain it must not record it as gone.
    for _ in 0..90 {
        w.run_for(1_000).await;
        w.check_no_untracked_instances().await.unwrap();
        let vm = w.get("db").await.unwrap();
        assert_eq!(
            vm.status.instance.as_ref().map(|i| i.id.as_str()),
            Some(old.as_str())
        );
    }
    assert!(w
        .get("db")
        .await
        .unwrap()
        .status
        .stop
        .unwrap()
        .forced_at
        .is_some());

    w.hv.set_faults(SimFaults::default());
    w.run_for(10_000).await;
    let vm = w.get("db").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running);
    assert_ne!(vm.status.instance.unwrap().id, old);
    let exit = vm.status.last_exit.unwrap();
    assert_eq!((exit.kind, exit.requested), (ExitKind::Killed, true));
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
}

/// Bug: while lookups failed during a stop, a due re-check was requeued at
/// now + 1 ms, and the controller spun for the rest of the grace period.
/// It re-checks at the retry interval, and still forces at the grace end.
#[tokio::test]
async fn failing_lookups_during_a_stop_do_not_spin() {
    let mut w = World::new(4, slow_guest()).await;
    let old = running_vm(&mut w, "db").await;
    w.hv.hang_guest(&old);
    w.user_op("db", VirtualMachine::request_stop).await.unwrap();
    w.reconcile_due().await;
    let stop = w.get("db").await.unwrap().status.stop.unwrap();
    let grace_end = stop.requested_at + 60_000;
    w.hv.set_faults(SimFaults {
        lookup_unavailable: 1.0,
        ..Default::default()
    });
    let mut reconciles = 0;
    while w.now() < grace_end + 1_000 {
        assert!(w.next_due().is_some(), "nothing scheduled");
        w.clock.advance_to(w.next_due().unwrap());
        reconciles += w.reconcile_due().await;
    }
    assert!(
        reconciles <= 100,
        "{reconciles} reconciles during a 60 s stop with failing lookups"
    );
    let stop = w.get("db").await.unwrap().status.stop.unwrap();
    assert_eq!(stop.forced_at, Some(grace_end), "forced at the grace end");

    w.hv.set_faults(SimFaults::default());
    w.run_for(5_000).await;
    let vm = w.get("db").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Stopped, "{vm:?}");
    assert!(w.hv.live_instances("db").is_empty());
}

/// Bug: on delete, the lookup of where the VM runs failed, the error was
/// swallowed, and the record (and disks) were removed while the VM still ran.
#[tokio::test]
async fn delete_waits_while_the_domain_lookup_fails() {
    let mut w = World::new(3, slow_guest()).await;
    w.create("cache", spec(RunPolicy::Manual, PowerState::Stopped, 60))
        .await;
    w.run_for(2_000).await;
    assert_eq!(w.get("cache").await.unwrap().status.phase, Phase::Stopped);
    // An instance the record does not know about (left by a crashed agent).
    w.hv.start(&DomainSpec::bare("cache", "cache-orphan", 1, 64))
        .await
        .unwrap();
    w.hv.set_faults(SimFaults {
        lookup_unavailable: 1.0,
        ..Default::default()
    });
    w.request_delete("cache").await.unwrap();
    w.run_for(120_000).await;
    let vm = w
        .get("cache")
        .await
        .expect("record must survive a failed lookup");
    assert!(vm.status.message.unwrap().contains("cannot list domains"));
    assert!(w.hv.has_disks("cache"));

    // Once the node answers, the orphan is adopted, stopped, and only then
    // is the record deleted.
    w.hv.set_faults(SimFaults::default());
    w.run_for(120_000).await;
    assert!(w.get("cache").await.is_none());
    assert!(w.hv.live_instances("cache").is_empty());
    assert!(!w.hv.has_disks("cache"));
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
}

/// Bug: the domain was seen running, then vanished before the next call,
/// which answered NotFound; treated as an error, the VM was stuck forever.
/// NotFound means absent, wherever it is seen.
#[tokio::test]
async fn not_found_between_two_calls_means_absent() {
    let mut w = World::new(4, slow_guest()).await;
    let old = running_vm(&mut w, "api").await;
    w.hv.set_faults(SimFaults {
        vanish_between_calls: 1.0,
        ..Default::default()
    });
    w.user_op("api", VirtualMachine::request_restart)
        .await
        .unwrap();
    w.run_for(1_000).await;
    w.hv.set_faults(SimFaults::default());
    w.run_for(10_000).await;
    let vm = w.get("api").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    assert_ne!(vm.status.instance.unwrap().id, old);
    assert_eq!(vm.status.last_exit.unwrap().kind, ExitKind::Vanished);
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
}

/// Stop is graceful first and forced only after the grace period.
#[tokio::test]
async fn hung_guest_is_killed_after_the_grace_period_not_before() {
    let mut w = World::new(5, slow_guest()).await;
    let inst = running_vm(&mut w, "hung").await;
    w.hv.hang_guest(&inst);
    w.user_op("hung", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.run_for(59_000).await;
    assert_eq!(w.hv.live_instances("hung"), vec![inst.clone()]);
    w.run_for(3_000).await;
    assert!(w.hv.live_instances("hung").is_empty());
    let vm = w.get("hung").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Stopped);
    assert_eq!(vm.status.last_exit.unwrap().kind, ExitKind::Killed);
}

/// Bug: a start that failed (a kernel that is not a kernel) left the VM in
/// BackOff with no word of why; the reason was only in the server log.
/// Now it is on the record while the VM waits, and on the exit record.
#[tokio::test]
async fn a_failed_start_shows_its_reason_on_the_record() {
    let mut w = World::new(6, slow_guest()).await;
    w.hv.fail_next_starts("web", 2, "could not load kernel '/k': Invalid argument");
    w.create(
        "web",
        spec(
            RunPolicy::AlwaysOnUnlessStoppedManually,
            PowerState::Running,
            60,
        ),
    )
    .await;
    // Failed at once and seen gone at once (the record's own change wakes
    // the VM); 1 s of backoff, the second failure, then 2 s of backoff.
    w.run_for(1_500).await;
    let vm = w.get("web").await.unwrap();
    assert_eq!(vm.status.phase, Phase::BackOff, "{vm:?}");
    let message = vm.status.message.clone().unwrap_or_default();
    assert!(
        message.contains("could not load kernel") && message.contains("next start in"),
        "{message:?}"
    );
    let exit = vm.status.last_exit.unwrap();
    assert!(
        exit.reason
            .as_deref()
            .is_some_and(|r| r.contains("could not load kernel")),
        "{exit:?}"
    );
    // The reason stays while it waits, not only at the moment of failure
    // (still in the 2 s of backoff after the second failure).
    w.run_for(1_000).await;
    let vm = w.get("web").await.unwrap();
    assert_eq!(vm.status.phase, Phase::BackOff);
    assert!(vm.status.message.unwrap().contains("could not load kernel"));

    // Once starts work again it runs, and the message is gone.
    w.run_for(20_000).await;
    let vm = w.get("web").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    assert_eq!(vm.status.message, None);
}

/// Bug: a Manual VM whose start failed flipped to `power: Stopped`, silently
/// cancelling the user's start. A start that never ran is a failed start:
/// the request stays, and the start is retried with backoff.
#[tokio::test]
async fn a_manual_vm_whose_start_fails_keeps_the_start_request() {
    let mut w = World::new(7, slow_guest()).await;
    w.hv.fail_next_starts("job", 3, "qemu exited during start");
    w.create("job", spec(RunPolicy::Manual, PowerState::Running, 60))
        .await;
    let mut backoffs = 0;
    for _ in 0..30 {
        w.run_for(1_000).await;
        let vm = w.get("job").await.unwrap();
        assert_eq!(vm.spec.power, PowerState::Running, "{vm:?}");
        backoffs += usize::from(vm.status.phase == Phase::BackOff);
    }
    assert!(backoffs > 0);
    let vm = w.get("job").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    // Three failures: backoff 1 + 2 + 4 s before the fourth start.
    assert_eq!(vm.status.instance.unwrap().id, "job-4");

    // A Manual guest that ran and then crashed stays stopped, as before.
    let inst = w.get("job").await.unwrap().status.instance.unwrap().id;
    w.run_for(15_000).await;
    w.hv.crash(&inst);
    w.run_for(5_000).await;
    let vm = w.get("job").await.unwrap();
    assert_eq!(
        (vm.spec.power, vm.status.phase),
        (PowerState::Stopped, Phase::Stopped)
    );
}
