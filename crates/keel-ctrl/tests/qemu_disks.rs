//! Per-disk creation and restart-required against real QEMU, through the
//! controller runtime as `keel serve` runs it: a disk added to a stopped
//! VM that ran is made at its next start, which runs with both disks (the
//! guest's record on the first is still there) and a disk resized while
//! stopped is grown before it boots; a CPU change of the
//! running VM shows as `restart_required` without a restart; a disk grown
//! under a running guest is grown in the same QEMU, and the guest sees it;
//! a disk plugged into a running guest is unplugged from it again.

mod qemu;

use std::time::{Duration, Instant};

use keel_api::{DiskSpec, Phase, RunPolicy, VirtualMachine};
use qemu::Env;

const BOOT: Duration = Duration::from_secs(60);

fn cmdline(pid: i32) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap())
        .replace('\0', " ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_added_after_the_first_run_is_made_and_both_are_attached() {
    let Some(env) = Env::new().await else { return };
    let began = Instant::now();
    let vm = "h5grow";
    env.create(vm, Env::spec(RunPolicy::Manual, 30)).await;
    let (first, mut guest) = env.ready(vm, BOOT).await;
    guest.put(7, "kept across the new disk").await.unwrap();
    drop(guest);
    env.user(vm, VirtualMachine::request_stop).await;
    env.wait_for(vm, BOOT, "stopped", |v| {
        v.status.phase == Phase::Stopped && v.status.instance.is_none()
    })
    .await;

    // `keel vm disk add` and `keel vm disk resize` of the stopped VM.
    env.user(vm, |v| {
        v.add_disk(DiskSpec {
            name: "extra".into(),
            size_mib: 16,
            image: None,
        })
        .map_err(|e| e.error().clone())?;
        v.resize_disk("data", 96).map_err(|e| e.error().clone())?;
        v.request_start()
    })
    .await;
    let (second, mut guest) = env.ready(vm, BOOT).await;
    assert_ne!(first, second);
    assert_eq!(
        guest.get(7).await.unwrap(),
        "kept across the new disk",
        "the first disk is the old one"
    );
    let data = env.driver.disk_path(vm, "data");
    let extra = env.driver.disk_path(vm, "extra");
    assert!(extra.is_file(), "{} not made", extra.display());
    assert_eq!(
        keel_hv::qcow2::virtual_size(&data).unwrap(),
        Some(96 << 20),
        "the resized disk was grown by the start"
    );
    let pids = env.qemu_pids(&format!("guest={second}"));
    assert_eq!(pids.len(), 1, "{pids:?}");
    let argv = cmdline(pids[0]);
    for disk in [&data, &extra] {
        assert!(
            argv.contains(&*disk.to_string_lossy()),
            "{} not on QEMU's command line: {argv}",
            disk.display()
        );
    }
    let record = env.vm(vm).await;
    let disks = record.status.disks.clone().unwrap();
    assert!(disks.iter().all(|d| d.used), "{disks:?}");

    // More CPUs for the running VM: shown, not applied by itself.
    env.user(vm, |v| {
        let mut spec = v.spec.clone();
        spec.cpus = 2;
        v.replace_spec(spec)
    })
    .await;
    let shown = env
        .wait_for(vm, Duration::from_secs(10), "showing the restart", |v| {
            v.status.restart_required == ["cpus"]
        })
        .await;
    assert_eq!(shown.status.instance.unwrap().id, second);
    eprintln!("took {:?}", began.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_vms_disk_grows_under_its_guest_without_a_restart() {
    let Some(env) = Env::new().await else { return };
    let vm = "h5online";
    env.create(vm, Env::spec(RunPolicy::Manual, 30)).await;
    let (first, mut guest) = env.ready(vm, BOOT).await;
    assert_eq!(guest.disk_bytes("vda").await.unwrap(), 64 << 20);
    guest.put(3, "written before the growth").await.unwrap();

    // `keel vm disk resize` of the running VM.
    env.user(vm, |v| {
        v.resize_disk("data", 160).map_err(|e| e.error().clone())
    })
    .await;
    let grown = env
        .wait_for(vm, Duration::from_secs(20), "grown", |v| {
            v.status
                .instance
                .as_ref()
                .is_some_and(|i| i.disk_sizes_mib.get("data") == Some(&160))
        })
        .await;
    assert_eq!(grown.status.instance.unwrap().id, first, "no new instance");
    assert_eq!(env.qemu_pids(&format!("guest={first}")).len(), 1);
    // The guest's kernel learns the new capacity from virtio-blk's config
    // change; the image's header has it already.
    guest_sees(&mut guest, "vda", 160 << 20).await;
    assert_eq!(
        keel_hv::qcow2::virtual_size(&env.driver.disk_path(vm, "data")).unwrap(),
        Some(160 << 20)
    );
    assert_eq!(guest.get(3).await.unwrap(), "written before the growth");
    let vm_now = env.vm(vm).await;
    assert_eq!(vm_now.status.phase, Phase::Running);
    assert!(vm_now.status.restart_required.is_empty(), "{vm_now:?}");
}

/// Polls the guest until it sees `dev` at `bytes`.
async fn guest_sees(guest: &mut keel_hv::guest::GuestChannel, dev: &str, bytes: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let seen = guest.disk_bytes(dev).await.ok();
        if seen == Some(bytes) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the guest sees {dev} at {seen:?}, not {bytes} bytes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_added_to_a_running_vm_is_plugged_in_and_kept_by_the_next_start() {
    let Some(env) = Env::new().await else { return };
    let vm = "h5plug";
    env.create(vm, Env::spec(RunPolicy::Manual, 30)).await;
    let (first, mut guest) = env.ready(vm, BOOT).await;
    assert!(guest.disk_bytes("vdb").await.is_err(), "no second disk yet");

    // `keel vm disk add` of the running VM.
    env.user(vm, |v| {
        v.add_disk(DiskSpec {
            name: "extra".into(),
            size_mib: 48,
            image: None,
        })
        .map_err(|e| e.error().clone())
    })
    .await;
    let plugged = env
        .wait_for(vm, Duration::from_secs(30), "plugged in", |v| {
            v.status.instance.as_ref().is_some_and(|i| {
                i.plugged
                    .iter()
                    .any(|p| p.disk == "extra" && p.attached_at.is_some())
            })
        })
        .await;
    assert_eq!(
        plugged.status.instance.as_ref().unwrap().id,
        first,
        "no new instance"
    );
    assert_eq!(env.qemu_pids(&format!("guest={first}")).len(), 1);
    assert!(plugged.status.restart_required.is_empty(), "{plugged:?}");
    let extra = env.driver.disk_path(vm, "extra");
    assert!(extra.is_file(), "{} not made", extra.display());
    let record = plugged.status.disks.unwrap();
    assert!(
        record.iter().any(|d| d.name == "extra" && d.used),
        "{record:?}"
    );
    guest_sees(&mut guest, "vdb", 48 << 20).await;

    // A plugged disk grows online too (its backend has no name: its node).
    env.user(vm, |v| {
        v.resize_disk("extra", 80).map_err(|e| e.error().clone())
    })
    .await;
    guest_sees(&mut guest, "vdb", 80 << 20).await;

    // `keel vm disk remove` of the running VM: unplugged from the same
    // QEMU once the guest let go of it, the port free again.
    let asked = Instant::now();
    env.user(vm, |v| {
        v.remove_disk("extra")
            .map(|_| ())
            .map_err(|e| e.error().clone())
    })
    .await;
    let unplugged = env
        .wait_for(vm, Duration::from_secs(60), "unplugged", |v| {
            v.status
                .instance
                .as_ref()
                .is_some_and(|i| i.plugged.is_empty())
        })
        .await;
    eprintln!("unplugged in {:?}", asked.elapsed());
    assert_eq!(unplugged.status.instance.as_ref().unwrap().id, first);
    assert_eq!(env.qemu_pids(&format!("guest={first}")).len(), 1);
    assert!(
        unplugged.status.restart_required.is_empty(),
        "{unplugged:?}"
    );
    assert!(
        guest.disk_bytes("vdb").await.is_err(),
        "the guest still has vdb"
    );
    assert!(extra.is_file(), "the file stays");

    // Added back: that disk (at its grown size), plugged in again.
    env.user(vm, |v| {
        v.add_disk(DiskSpec {
            name: "extra".into(),
            size_mib: 48,
            image: None,
        })
        .map_err(|e| e.error().clone())?;
        v.resize_disk("extra", 80).map_err(|e| e.error().clone())
    })
    .await;
    guest_sees(&mut guest, "vdb", 80 << 20).await;
    drop(guest);

    // The next instance has it from its start, on its command line.
    env.user(vm, VirtualMachine::request_stop).await;
    env.wait_for(vm, BOOT, "stopped", |v| {
        v.status.phase == Phase::Stopped && v.status.instance.is_none()
    })
    .await;
    env.user(vm, VirtualMachine::request_start).await;
    let (second, mut guest) = env.ready(vm, BOOT).await;
    assert_ne!(first, second);
    guest_sees(&mut guest, "vdb", 80 << 20).await;
    let pids = env.qemu_pids(&format!("guest={second}"));
    assert!(cmdline(pids[0]).contains(&*extra.to_string_lossy()));
}
