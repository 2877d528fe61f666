//! Guest reboots against real QEMU and the test guest, through the
//! controller runtime as `keel serve` runs it: `reboot -f` typed on the
//! guest's console of a `Manual` VM, then `keel vm reboot` (the test guest
//! has no agent, so the hypervisor resets it at once). Both times the VM
//! is Running again with the same instance and the same QEMU process, the
//! reset is counted and recorded, and the guest is ready again only once
//! its new boot printed its marker.

mod qemu;

use std::time::{Duration, Instant};

use keel_api::{Event, Phase, RunPolicy, VirtualMachine};
use keel_ctrl::keys::EVENTS_PREFIX;
use keel_hv::Hypervisor;
use qemu::{qemu_pids_in, Env};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BOOT: Duration = Duration::from_secs(90);

async fn rebooted(env: &Env, name: &str, instance: &str, resets: u32) -> VirtualMachine {
    env.wait_for(
        name,
        BOOT,
        &format!("reset {resets} times and ready"),
        |vm| {
            vm.status.phase == Phase::Running
                && vm
                    .status
                    .instance
                    .as_ref()
                    .is_some_and(|i| i.id == instance && i.resets >= resets && i.reboot.is_none())
                && vm.ready_since().is_some()
        },
    )
    .await
}

async fn events(env: &Env, vm: &str) -> Vec<String> {
    let (all, _) = env
        .store
        .list::<Event>(&format!("{EVENTS_PREFIX}{vm}/"))
        .await
        .unwrap();
    all.into_iter().map(|(_, e)| e.value.reason).collect()
}

/// The console shell may still be starting after the ready marker: asks
/// until it answers (its arithmetic, not an echo of the input).
async fn shell_answers(console: &mut keel_hv::ConsoleStream) {
    let t = Instant::now();
    let mut seen = String::new();
    let mut buf = [0u8; 1024];
    while t.elapsed() < Duration::from_secs(30) {
        console
            .io
            .write_all(b"echo keel-$((6*7))-answer\n")
            .await
            .unwrap();
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(300), console.io.read(&mut buf)).await
            {
                seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                if seen.contains("keel-42-answer") {
                    return;
                }
            }
        }
    }
    panic!("the console shell never answered; saw {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_reboot_and_vm_reboot_keep_the_instance_and_its_qemu() {
    let Some(env) = Env::new().await else { return };
    env.create("rbt", Env::spec(RunPolicy::Manual, 10)).await;
    let t = Instant::now();
    let (instance, _guest) = env.ready("rbt", BOOT).await;
    let first_ready = env
        .wait_for("rbt", BOOT, "ready", |vm| vm.ready_since().is_some())
        .await
        .ready_since()
        .unwrap();
    let needle = "guest=rbt-".to_string();
    let pids = qemu_pids_in(&env.data_dir, &needle);
    assert_eq!(pids.len(), 1, "{pids:?}");

    // The guest reboots itself: busybox `reboot -f` on its console shell.
    let driver = env.node_driver("local").clone();
    let mut console = driver.open_console(&instance).await.unwrap();
    shell_answers(&mut console).await;
    console.io.write_all(b"reboot -f\n").await.unwrap();
    console.io.flush().await.unwrap();
    let vm = rebooted(&env, "rbt", &instance, 1).await;
    drop(console);
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.resets, 1, "one reboot, one reset");
    assert!(
        vm.ready_since().unwrap() > first_ready,
        "ready again, later"
    );
    assert!(inst.last_reset_at.unwrap() > first_ready);
    // Ready by the marker of the new boot, not the one already in the log:
    // a marker left from the first boot would make the guest ready at the
    // first look after the reset (its probe takes at most 200 ms), while
    // the new boot takes firmware, kernel and init under TCG (1.8 s on an
    // idle machine, ~10 s under load); and by then the log holds the
    // marker of each boot.
    let after_reset = vm.ready_since().unwrap() - inst.last_reset_at.unwrap();
    assert!(
        after_reset >= 1_000,
        "ready {after_reset} ms after the reset"
    );
    let log = std::fs::read_to_string(driver.console_log(&instance)).unwrap_or_default();
    assert!(
        log.matches("KEEL-GUEST-READY").count() >= 2,
        "the new boot's marker is in the console log ({after_reset} ms after the reset): {}",
        &log[log.len().saturating_sub(3000)..]
    );
    assert!(vm.status.last_exit.is_none(), "no exit: {vm:?}");
    assert_eq!(vm.status.instance_seq, 1, "no new instance");
    assert_eq!(qemu_pids_in(&env.data_dir, &needle), pids, "the same QEMU");
    let trail = events(&env, "rbt").await;
    assert!(
        trail.iter().any(|e| e.starts_with("guest rebooted:")),
        "{trail:?}"
    );
    eprintln!(
        "guest reboot: ready again {:?} after create, {} reset(s) counted",
        t.elapsed(),
        inst.resets
    );

    // `keel vm reboot`: no agent in the test guest, so system_reset at once.
    let asked = Instant::now();
    env.user("rbt", VirtualMachine::request_reboot).await;
    let before = inst.resets;
    let vm = env
        .wait_for("rbt", BOOT, "rebooted on request and ready", |vm| {
            vm.status.observed_reboot_generation == 1
                && vm.status.phase == Phase::Running
                && vm
                    .status
                    .instance
                    .as_ref()
                    .is_some_and(|i| i.resets > before && i.reboot.is_none())
                && vm.ready_since().is_some()
        })
        .await;
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, instance);
    assert_eq!(vm.status.instance_seq, 1, "no new instance");
    assert_eq!(qemu_pids_in(&env.data_dir, &needle), pids, "the same QEMU");
    assert_eq!(driver.info(&instance).await.unwrap().resets, inst.resets);
    let trail = events(&env, "rbt").await;
    assert!(
        trail
            .iter()
            .any(|e| e.starts_with("guest rebooted as requested")),
        "{trail:?}"
    );
    eprintln!("vm reboot: ready again after {:?}", asked.elapsed());
}
