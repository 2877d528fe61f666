//! A clone against real QEMU, through the controller runtime as `keel
//! serve` runs it: a snapshot of the running source (live), then a clone
//! whose first start copies the disk at the snapshot (`qemu-img convert`
//! while the source's QEMU holds the file) and boots on it: the guest's
//! record from before the snapshot is there, one written after is not,
//! its NIC has its own MAC, and the source runs on in the same QEMU. A
//! linked clone boots the same way on an overlay of a frozen base, which
//! goes with its last clone.

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

/// A linked clone boots on an overlay of a frozen copy of its source's
/// disk at the snapshot: the guest reads the record from before the
/// snapshot, the base is read-only and noted as used by the clone, and it
/// goes when the clone, its last user, is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linked_clone_boots_on_an_overlay_of_a_frozen_base_kept_while_it_is_used() {
    let Some(env) = Env::new().await else { return };
    let began = Instant::now();
    let mut spec = Env::spec(RunPolicy::Manual, 30);
    spec.assign_identity([8; 12]);
    env.create("lsrc", spec).await;
    let (_source, mut guest) = env.ready("lsrc", BOOT).await;
    guest.put(1, "in the base").await.unwrap();
    let snap = env.take_snapshot("lsrc", "s1").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{snap:?}");
    guest.put(1, "after the snapshot").await.unwrap();

    let vm = env.vm("lsrc").await;
    let mut clone = vm
        .clone_at("lcopy", &snap, PowerState::Running, [9; 12])
        .unwrap();
    clone.status.clone_from.as_mut().unwrap().linked = true;
    env.store.create(&vm_key("lcopy"), &clone).await.unwrap();
    let (_copy, mut copy_guest) = env.ready("lcopy", BOOT).await;
    eprintln!(
        "linked clone running {:?} after the source's start",
        began.elapsed()
    );
    assert_eq!(copy_guest.get(1).await.unwrap(), "in the base");

    let disk = env.driver.disk_path("lcopy", "data");
    let base = keel_hv::qcow2::backing_file(&disk)
        .unwrap()
        .expect("the linked clone's disk has a backing file");
    assert!(
        base.to_string_lossy()
            .contains(&format!(".clone-bases/lsrc-{}/s1/data.qcow2", vm.uid)),
        "{}",
        base.display()
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&base).unwrap().permissions().mode();
    assert_eq!(mode & 0o222, 0, "the base is read-only: {mode:o}");
    assert!(base.with_extension("users").join("lcopy").is_file());

    env.user("lcopy", |v| {
        v.deletion_requested_at = Some(1);
        Ok(())
    })
    .await;
    let deadline = Instant::now() + BOOT;
    while env
        .store
        .get::<keel_api::VirtualMachine>(&vm_key("lcopy"))
        .await
        .unwrap()
        .is_some()
    {
        assert!(
            Instant::now() < deadline,
            "lcopy not deleted within {BOOT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!base.exists(), "the base outlived its last clone");
    // The source runs on with its own later write.
    assert_eq!(guest.get(1).await.unwrap(), "after the snapshot");
}
