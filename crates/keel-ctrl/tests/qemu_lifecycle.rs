//! The lifecycle against real QEMU processes, through the controller
//! runtime exactly as `keel serve` runs it.

mod qemu;

use std::time::{Duration, Instant};

use keel_api::{Clock, ExitKind, Phase, RunPolicy, SystemClock, VirtualMachine};
use keel_ctrl::LifecycleConfig;
use keel_hv::Hypervisor;
use qemu::{qemu_pids_in, Env};
use tokio::io::AsyncWriteExt;

const BOOT: Duration = Duration::from_secs(60);

/// While a restart is in flight the process table never holds two QEMUs of
/// the VM: sampled every few milliseconds from the request until the new
/// guest is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_never_runs_two_qemu_processes() {
    let Some(env) = Env::new().await else { return };
    env.create("web", Env::spec(RunPolicy::Manual, 30)).await;
    let (old, _guest) = env.ready("web", BOOT).await;
    let needle = "guest=web-".to_string();
    let dir = env.data_dir.clone();
    let qemus = move || qemu_pids_in(&dir, &needle).len();
    assert_eq!(qemus(), 1);

    let sampler = tokio::task::spawn_blocking(move || {
        let mut max = 0;
        let mut samples = 0;
        let end = Instant::now() + Duration::from_secs(90);
        while Instant::now() < end {
            let n = qemus();
            max = max.max(n);
            samples += 1;
            if SAMPLER_STOP.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        (max, samples)
    });
    env.user("web", VirtualMachine::request_restart).await;
    let (new, _guest) = env.ready_after("web", &old).await;
    SAMPLER_STOP.store(true, std::sync::atomic::Ordering::SeqCst);
    let (max, samples) = sampler.await.unwrap();
    assert!(samples > 100, "sampled the process table {samples} times");
    assert_eq!(max, 1, "two QEMU processes of one VM existed at once");
    assert_ne!(new, old);
    let vm = env.vm("web").await;
    let exit = vm.status.last_exit.unwrap();
    assert_eq!((exit.kind, exit.requested), (ExitKind::GuestPoweroff, true));
}

static SAMPLER_STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Env {
    /// Ready with an instance other than `old`.
    async fn ready_after(&self, name: &str, old: &str) -> (String, keel_hv::guest::GuestChannel) {
        self.wait_for(name, BOOT, "restarted", |vm| {
            vm.status.phase == Phase::Running
                && vm.status.instance.as_ref().is_some_and(|i| i.id != old)
        })
        .await;
        self.ready(name, BOOT).await
    }
}

/// A record the guest wrote (and had acknowledged) survives a restart
/// requested in the same millisecond — ten times in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_restarts_ten_of_ten() {
    let Some(env) = Env::new().await else { return };
    env.create(
        "db",
        Env::spec(RunPolicy::AlwaysOnUnlessStoppedManually, 30),
    )
    .await;
    let (mut instance, mut guest) = env.ready("db", BOOT).await;
    for cycle in 0..10u32 {
        let text = format!("record-{cycle}-{}", instance);
        guest.put(cycle, &text).await.unwrap();
        env.user("db", VirtualMachine::request_restart).await;
        let (next, mut next_guest) = env.ready_after("db", &instance).await;
        for earlier in 0..=cycle {
            let got = next_guest.get(earlier).await.unwrap();
            assert!(
                got.starts_with(&format!("record-{earlier}-")),
                "cycle {cycle}, slot {earlier}: {got:?}"
            );
        }
        assert_eq!(next_guest.get(cycle).await.unwrap(), text, "cycle {cycle}");
        instance = next;
        guest = next_guest;
    }
}

/// Graceful stop ends with the process gone; a guest that ignores the power
/// button is force-killed once the grace period is over, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_is_graceful_then_forced_after_the_grace_period() {
    let Some(env) = Env::new().await else { return };
    env.create("calm", Env::spec(RunPolicy::Manual, 30)).await;
    env.create("hung", Env::spec(RunPolicy::Manual, 6)).await;
    let (calm, _g) = env.ready("calm", BOOT).await;
    let (hung, mut hung_guest) = env.ready("hung", BOOT).await;
    hung_guest.set_acpi(false).await.unwrap();

    let asked = Instant::now();
    env.user("calm", VirtualMachine::request_stop).await;
    env.user("hung", VirtualMachine::request_stop).await;
    let vm = env
        .wait_for("calm", Duration::from_secs(30), "stopped", |vm| {
            vm.status.phase == Phase::Stopped
        })
        .await;
    assert!(env.qemu_pids(&format!("guest={calm}")).is_empty());
    assert_eq!(vm.status.last_exit.unwrap().kind, ExitKind::GuestPoweroff);

    assert!(
        !env.qemu_pids(&format!("guest={hung}")).is_empty(),
        "the guest ignoring the power button still runs while calm has stopped"
    );
    let vm = env
        .wait_for("hung", Duration::from_secs(30), "stopped", |vm| {
            vm.status.phase == Phase::Stopped
        })
        .await;
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_secs(6),
        "killed after {took:?}, before the 6 s grace period"
    );
    assert!(env.qemu_pids(&format!("guest={hung}")).is_empty());
    assert_eq!(vm.status.last_exit.unwrap().kind, ExitKind::Killed);
}

/// A guest that powers itself off (`poweroff -f` typed on its console) is
/// seen within seconds, its VM stopped as its run policy says, although
/// a steadily running VM is looked at only every ten minutes here: the
/// driver's exit event wakes the reconcile, not a poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_poweroff_is_seen_through_its_event_not_the_resync() {
    let Some(env) = Env::new_with_lifecycle(|c| LifecycleConfig {
        resync_ms: 600_000,
        // Past its boot settle quickly: from then on only events (or the
        // resync) make the VM looked at.
        boot_settle_ms: 1_000,
        ..c
    })
    .await
    else {
        return;
    };
    env.create("quiet", Env::spec(RunPolicy::Manual, 30)).await;
    let (instance, _guest) = env.ready("quiet", BOOT).await;
    let vm = env
        .wait_for("quiet", BOOT, "ready", |vm| {
            vm.status
                .instance
                .as_ref()
                .and_then(|i| i.readiness.as_ref())
                .is_some_and(|r| r.ready_at.is_some())
        })
        .await;
    // Settled and ready: its next scheduled look is the ten-minute resync.
    let since = vm.status.instance.unwrap().running_since.unwrap();
    while SystemClock.now_ms() < since + 3_000 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let driver = env.node_driver("local");
    let mut console = driver.open_console(&instance).await.unwrap();
    // The shell may still be starting: type until the guest goes.
    let typed = Instant::now();
    while driver
        .info(&instance)
        .await
        .is_ok_and(|i| !i.state.is_exited())
    {
        assert!(typed.elapsed() < BOOT, "the guest never powered off");
        console.io.write_all(b"poweroff -f\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let gone = Instant::now();
    drop(console);
    let vm = env
        .wait_for("quiet", Duration::from_secs(60), "stopped", |vm| {
            vm.status.phase == Phase::Stopped
        })
        .await;
    let seen_after = gone.elapsed();
    let exit = vm.status.last_exit.unwrap();
    assert_eq!(
        (exit.kind, exit.requested),
        (ExitKind::GuestPoweroff, false)
    );
    assert!(
        seen_after < Duration::from_secs(10),
        "the power-off was seen {seen_after:?} after QEMU exited: not by its event"
    );
    eprintln!("guest power-off seen {seen_after:?} after QEMU exited");
}
