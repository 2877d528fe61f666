//! Readiness against real QEMU and the test guest, through the controller
//! runtime as `keel serve` runs it: ready when the console shows the
//! guest's marker; a guest without an agent under `agent` readiness stays
//! not ready with the reason, and does not hold up the others. The
//! console's marker is seen when it shows, not at the next probe.

mod qemu;

use std::time::{Duration, Instant};

use keel_api::{Phase, Readiness, RunPolicy};
use keel_ctrl::LifecycleConfig;
use qemu::Env;

const BOOT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_marker_makes_the_guest_ready_and_a_missing_agent_does_not() {
    let Some(env) = Env::new().await else { return };
    let mut no_agent = Env::spec(RunPolicy::Manual, 10);
    no_agent.readiness = Readiness::Agent;
    // Created first, so its probes are under way while the other boots.
    env.create("mute", no_agent).await;
    env.create("web", Env::spec(RunPolicy::Manual, 10)).await;
    let t = Instant::now();
    let vm = env
        .wait_for("web", BOOT, "ready", |vm| vm.ready_since().is_some())
        .await;
    let inst = vm.status.instance.clone().unwrap();
    let ready_at = vm.ready_since().unwrap();
    let running_since = inst.running_since.unwrap();
    assert!(ready_at >= running_since, "{ready_at} < {running_since}");
    eprintln!(
        "web: ready {} ms after QEMU ran, {:?} after create",
        ready_at - running_since,
        t.elapsed()
    );
    // The marker is printed a few seconds into the boot, never at once.
    assert!(ready_at > inst.created_at);

    let vm = env
        .wait_for("mute", BOOT, "running a while", |vm| {
            vm.status.phase == Phase::Running
                && vm
                    .status
                    .instance
                    .as_ref()
                    .and_then(|i| i.readiness.as_ref())
                    .and_then(|r| r.reason.as_ref())
                    .is_some_and(|r| r.contains("guest-sync-delimited"))
        })
        .await;
    assert!(vm.ready_since().is_none(), "no agent, so never ready");
    let r = vm.status.instance.unwrap().readiness.unwrap();
    assert!(!r.agent && r.addresses.is_empty());
    eprintln!("mute: {}", r.reason.unwrap());
}

/// With the probe's interval far longer than the wait, only the driver's
/// console watch (`Hypervisor::watch_console` and its `ConsoleShowed`
/// event) can make the guest ready in time: the one probe made before the
/// guest printed anything says not ready, and the next is ten minutes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_marker_is_seen_when_it_shows_not_at_the_next_probe() {
    let Some(env) = Env::new_with_lifecycle(|c| LifecycleConfig {
        readiness_probe_ms: 600_000,
        ..c
    })
    .await
    else {
        return;
    };
    env.create("web", Env::spec(RunPolicy::Manual, 10)).await;
    let t = Instant::now();
    let vm = env
        .wait_for("web", BOOT, "ready", |vm| vm.ready_since().is_some())
        .await;
    let inst = vm.status.instance.clone().unwrap();
    let ready_at = vm.ready_since().unwrap();
    assert!(ready_at >= inst.running_since.unwrap());
    eprintln!(
        "web: ready {:?} after create, by the console watch",
        t.elapsed()
    );
}
