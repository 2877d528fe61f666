//! A clone against real QEMU, through the controller runtime as `keel
//! serve` runs it: a snapshot of the running source (live), then a clone
//! whose first start copies the disk at the snapshot (`qemu-img convert`
//! while the source's QEMU holds the file) and boots on it: the guest's
//! record from before the snapshot is there, one written after is not,
//! its NIC has its own MAC, and the source runs on in the same QEMU.

mod qemu;

use std::time::{Duration, Instant};

use keel_api::{PowerState, RunPolicy, SnapshotPhase};
use keel_ctrl::keys::vm_key;
use qemu::Env;

const BOOT: Duration = Duration::from_secs(60);

fn cmdline(pid: i32) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap())
        .replace('\0', " ")
}

fn mac_of(cmdline: &str) -> String {
    cmdline
        .split([',', ' '])
        .find_map(|part| part.strip_prefix("mac="))
        .unwrap_or_else(|| panic!("no mac= in {cmdline}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_of_a_running_vm_boots_on_a_copy_of_its_disk_at_the_snapshot() {
    let Some(env) = Env::new().await else { return };
    let began = Instant::now();
    let mut spec = Env::spec(RunPolicy::Manual, 30);
    spec.assign_identity([6; 12]);
    env.create("csrc", spec).await;
    let (source, mut guest) = env.ready("csrc", BOOT).await;
    guest.put(1, "in the snapshot").await.unwrap();

    let snap = env.take_snapshot("csrc", "s1").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{snap:?}");
    assert!(snap.status.live);
    guest.put(2, "after the snapshot").await.unwrap();

    let vm = env.vm("csrc").await;
    let clone = vm
        .clone_at("ccopy", &snap, PowerState::Running, [7; 12])
        .unwrap();
    env.store.create(&vm_key("ccopy"), &clone).await.unwrap();
    let (copy, mut copy_guest) = env.ready("ccopy", BOOT).await;
    eprintln!(
        "clone running {:?} after the source's start",
        began.elapsed()
    );
    assert_eq!(copy_guest.get(1).await.unwrap(), "in the snapshot");
    assert_ne!(
        copy_guest.get(2).await.ok().as_deref(),
        Some("after the snapshot"),
        "written after the snapshot"
    );
    let copied = env.driver.disk_path("ccopy", "data");
    assert!(copied.is_file(), "{} not made", copied.display());
    assert_ne!(copied, env.driver.disk_path("csrc", "data"));

    let src_pids = env.qemu_pids(&format!("guest={source}"));
    let copy_pids = env.qemu_pids(&format!("guest={copy}"));
    assert_eq!((src_pids.len(), copy_pids.len()), (1, 1));
    assert_ne!(
        mac_of(&cmdline(src_pids[0])),
        mac_of(&cmdline(copy_pids[0]))
    );
    // The source runs on, in the same QEMU, with its own later write.
    assert_eq!(env.vm("csrc").await.status.instance.unwrap().id, source);
    assert_eq!(guest.get(2).await.unwrap(), "after the snapshot");
}
