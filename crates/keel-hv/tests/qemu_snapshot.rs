//! Disk snapshots of the qemu driver against real QEMU and the test guest:
//! live (QMP, guest paused for a moment) and offline (qemu-img), restore,
//! delete, and the retry rules (taking or deleting twice is fine, a partial
//! snapshot is retaken, a restore needs the snapshot on every disk).
//!
//! Same conventions as `qemu_e2e.rs`: TCG, one data dir per test, a guard
//! that kills whatever a test started; helpers in `common/mod.rs`.

mod common;

use std::time::{Duration, Instant};

use common::{boot, image_snapshots, stop_and_cleanup, Fixture, BOOT};
use keel_api::{BootSpec, DiskSpec};
use keel_hv::guest::GuestChannel;
use keel_hv::qemu::{QemuDriver, QmpClient};
use keel_hv::{DomainSpec, DomainState, HvError, Hypervisor};

/// Two disks, so "consistent" means something: the guest writes to the
/// first (/dev/vda); the second only has to carry the same snapshots.
fn disks() -> Vec<DiskSpec> {
    ["data", "logs"]
        .into_iter()
        .map(|name| DiskSpec {
            name: name.into(),
            size_mib: 32,
            image: None,
        })
        .collect()
}

fn db_spec(instance: &str) -> DomainSpec {
    DomainSpec {
        vm: "db".into(),
        instance: instance.into(),
        cpus: 1,
        memory_mib: 256,
        disks: disks(),
        boot: BootSpec::default(),
        create_disks: keel_hv::DiskCreation::all_of(&disks()),
        network: Default::default(),
        cloud_init: None,
        fenced: true,
        images: vec![],
        hardware: None,
        hotplug_ports: 0,
        plugged: Vec::new(),
        clone_from: None,
        recorded_firmware: None,
        tpm: None,
        balloon: false,
    }
}

/// Snapshot names on every disk of `vm`, in disk order.
fn snapshots_of(hv: &QemuDriver, vm: &str) -> Vec<Vec<String>> {
    disks()
        .iter()
        .map(|d| image_snapshots(&hv.disk_path(vm, &d.name)))
        .collect()
}

fn assert_storage_error(err: &HvError, vm: &str, mentions: &[&str]) {
    let HvError::Storage { vm: got, .. } = err else {
        panic!("expected a storage error, got {err:?}");
    };
    assert_eq!(got, vm, "{err}");
    let text = err.to_string();
    for m in mentions {
        assert!(text.contains(m), "{text:?} does not mention {m:?}");
    }
}

/// Waits until the guest's tick counter passes `after` (it counts seconds).
async fn ticks_pass(ch: &mut GuestChannel, after: u64, boot_id: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = ch.ticks().await.unwrap();
        assert_eq!(now.boot_id, boot_id, "the guest rebooted");
        if now.ticks > after {
            return now.ticks;
        }
        assert!(Instant::now() < deadline, "ticks stuck at {}", now.ticks);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
async fn a_live_snapshot_keeps_the_guest_running_and_restores_its_disks() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let mut ch = boot(hv, &db_spec("db-1")).await;
    ch.put(1, "before").await.unwrap();
    let t0 = ch.ticks().await.unwrap();

    let t = Instant::now();
    hv.snapshot_disks("db", &disks(), Some("db-1"), "s1")
        .await
        .unwrap();
    eprintln!("live snapshot of 2 disks took {:?}", t.elapsed());
    assert_eq!(hv.info("db-1").await.unwrap().state, DomainState::Running);
    assert!(
        !hv.instance_dir("db-1").join("snapshot-paused").exists(),
        "pause marker removed after resuming"
    );
    ticks_pass(&mut ch, t0.ticks, &t0.boot_id).await;
    assert_eq!(snapshots_of(hv, "db"), [["s1"], ["s1"]]);

    // A retry is a success and takes nothing new.
    hv.snapshot_disks("db", &disks(), Some("db-1"), "s1")
        .await
        .unwrap();
    assert_eq!(snapshots_of(hv, "db"), [["s1"], ["s1"]]);

    ch.put(1, "after").await.unwrap();
    assert_eq!(ch.get(1).await.unwrap(), "after");
    stop_and_cleanup(hv, "db-1").await;

    hv.restore_disks("db", &disks(), "s1").await.unwrap();
    let mut ch = boot(hv, &db_spec("db-2")).await;
    assert_eq!(ch.get(1).await.unwrap(), "before");

    // Never restored under a live guest.
    let err = hv.restore_disks("db", &disks(), "s1").await.unwrap_err();
    assert_storage_error(&err, "db", &["s1", "db-2"]);

    // Deleting while live goes through QEMU (qemu-img could not open the
    // images); deleting again is a success.
    hv.delete_snapshot("db", &disks(), "s1").await.unwrap();
    assert_eq!(snapshots_of(hv, "db"), [[""; 0], [""; 0]]);
    hv.delete_snapshot("db", &disks(), "s1").await.unwrap();
    ch.ping().await.unwrap();

    hv.kill("db-2").await.unwrap();
    hv.cleanup("db-2").await.unwrap();
    let err = hv.restore_disks("db", &disks(), "s1").await.unwrap_err();
    assert_storage_error(&err, "db", &["s1", "data"]);
}

#[tokio::test]
async fn offline_snapshots_round_trip_and_retries_are_harmless() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let mut ch = boot(hv, &db_spec("db-1")).await;
    ch.put(2, "one").await.unwrap();
    stop_and_cleanup(hv, "db-1").await;

    for _ in 0..2 {
        hv.snapshot_disks("db", &disks(), None, "gold")
            .await
            .unwrap();
    }
    assert_eq!(snapshots_of(hv, "db"), [["gold"], ["gold"]]);

    let mut ch = boot(hv, &db_spec("db-2")).await;
    ch.put(2, "two").await.unwrap();
    stop_and_cleanup(hv, "db-2").await;

    for _ in 0..2 {
        hv.restore_disks("db", &disks(), "gold").await.unwrap();
    }
    let mut ch = boot(hv, &db_spec("db-3")).await;
    assert_eq!(ch.get(2).await.unwrap(), "one");
    hv.kill("db-3").await.unwrap();
    hv.cleanup("db-3").await.unwrap();

    for _ in 0..2 {
        hv.delete_snapshot("db", &disks(), "gold").await.unwrap();
    }
    assert_eq!(snapshots_of(hv, "db"), [[""; 0], [""; 0]]);
}

/// No guest needed: snapshots of a VM that never ran, and the rules for
/// partial sets, checked on the image files.
#[tokio::test]
async fn partial_snapshots_are_retaken_and_restore_needs_every_disk() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    // Never started: the images are created, blank, like `start` would.
    hv.snapshot_disks("web", &disks(), None, "s1")
        .await
        .unwrap();
    let data = hv.disk_path("web", "data");
    let logs = hv.disk_path("web", "logs");
    assert!(data.is_file() && logs.is_file());

    // An earlier attempt that died midway: s1 lost from one disk, s2 taken
    // on one disk only.
    let qemu_img = |args: &[&str], disk: &std::path::Path| {
        let ok = std::process::Command::new("qemu-img")
            .args(args)
            .arg(disk)
            .status()
            .unwrap()
            .success();
        assert!(ok, "qemu-img {args:?} {}", disk.display());
    };
    qemu_img(&["snapshot", "-d", "s1"], &logs);
    qemu_img(&["snapshot", "-c", "s2"], &data);

    let err = hv.restore_disks("web", &disks(), "s1").await.unwrap_err();
    assert_storage_error(&err, "web", &["s1", "logs"]);

    // The partial s2 is replaced by a complete one, not completed: exactly
    // one s2 per disk.
    hv.snapshot_disks("web", &disks(), None, "s2")
        .await
        .unwrap();
    assert_eq!(image_snapshots(&data), ["s1", "s2"]);
    assert_eq!(image_snapshots(&logs), ["s2"]);
    hv.restore_disks("web", &disks(), "s2").await.unwrap();

    hv.delete_snapshot("web", &disks(), "s1").await.unwrap();
    assert_eq!(image_snapshots(&data), ["s2"]);

    // Names that qemu-img could read as options never reach it.
    let err = hv
        .snapshot_disks("web", &disks(), None, "-l")
        .await
        .unwrap_err();
    assert_storage_error(&err, "web", &["snapshot"]);
    // An instance the node does not know (gone since the caller looked)
    // leaves the disks offline.
    let res = hv
        .snapshot_disks("web", &disks(), Some("web-9"), "s3")
        .await;
    assert!(res.is_ok(), "{res:?}");
}

/// Keel died between pausing a guest for a snapshot and resuming it: the
/// next driver resumes it when it adopts the instance.
#[tokio::test]
async fn a_guest_left_paused_by_an_interrupted_snapshot_is_resumed() {
    let Some(mut fx) = Fixture::new().await else {
        return;
    };
    let mut ch = fx.boot("web", "web-1").await;
    let dir = fx.hv().instance_dir("web-1");
    let qmp_socket = fx.hv().qmp_socket("web-1");
    // Without a driver the QMP socket is free for this test to pause the
    // guest the way the snapshot code does.
    drop(fx.driver.take());
    std::fs::write(dir.join("snapshot-paused"), "s1\n").unwrap();
    let (qmp, _events) = QmpClient::connect(&qmp_socket, Duration::from_secs(5))
        .await
        .unwrap();
    qmp.execute("stop", None).await.unwrap();
    assert_eq!(qmp.query_status().await.unwrap().status, "paused");
    drop(qmp);

    fx.reopen().await;
    let state = fx
        .wait_for("web-1", BOOT, |s| *s == DomainState::Running)
        .await;
    assert_eq!(state, DomainState::Running);
    ch.ping().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while dir.join("snapshot-paused").exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!dir.join("snapshot-paused").exists());
    fx.hv().kill("web-1").await.unwrap();
    fx.hv().cleanup("web-1").await.unwrap();
}

/// A UEFI clone's first start makes its variable store a copy of its
/// source's as the snapshot kept it, not a fresh one from the template.
/// The driver's OVMF code is missing on purpose: the start fails after
/// the disks and the store are made, so no firmware writes the store
/// before it is compared (and no guest is booted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uefi_clones_first_start_copies_the_sources_variable_store_at_the_snapshot() {
    let Some(f) = Fixture::with(|mut c| {
        c.ovmf_code = "/nonexistent/OVMF_CODE_4M.fd".into();
        c
    })
    .await
    else {
        return;
    };
    let hv = f.hv();
    let disk = vec![DiskSpec {
        name: "data".into(),
        size_mib: 32,
        image: None,
    }];
    let source_disk = hv.disk_path("uefisrc", "data");
    std::fs::create_dir_all(source_disk.parent().unwrap()).unwrap();
    let made = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&source_disk)
        .arg("32M")
        .status()
        .unwrap();
    assert!(made.success());
    let vars = source_disk.parent().unwrap().join("uefi-vars.fd");
    std::fs::write(&vars, b"boot entries at s1").unwrap();
    hv.snapshot_disks("uefisrc", &disk, None, "s1")
        .await
        .unwrap();
    std::fs::write(&vars, b"changed after s1").unwrap();

    let mut spec = DomainSpec::bare("uefiseed", "uefiseed-1", 1, 256);
    spec.disks = disk.clone();
    spec.create_disks = keel_hv::DiskCreation::all_of(&disk);
    spec.boot.firmware = Some(keel_api::Firmware::Uefi);
    spec.clone_from = Some(keel_api::CloneSource {
        vm: "uefisrc".into(),
        vm_uid: "u1".into(),
        snapshot: "s1".into(),
        disks: vec!["data".into()],
        linked: false,
    });
    let err = hv.start(&spec).await.unwrap_err();
    assert!(err.to_string().contains("OVMF"), "{err}");
    let clone_dir = hv
        .disk_path("uefiseed", "data")
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(clone_dir.join("data.qcow2").is_file(), "the copy was made");
    let store = std::fs::read(clone_dir.join("uefi-vars.fd")).unwrap();
    assert!(
        store == b"boot entries at s1",
        "the clone's store is not the source's at the snapshot ({} bytes)",
        store.len()
    );
}

/// A linked clone whose base cannot be made (its source's disk is gone)
/// fails its start with the reason and leaves neither a note of it nor a
/// base: nothing keeps a base alive for a clone that has no disk on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linked_clone_whose_base_cannot_be_made_leaves_no_note_behind() {
    let Some(f) = Fixture::new().await else {
        return;
    };
    let hv = f.hv();
    let disk = vec![DiskSpec {
        name: "data".into(),
        size_mib: 32,
        image: None,
    }];
    let mut spec = DomainSpec::bare("thin", "thin-1", 1, 128);
    spec.disks = disk.clone();
    spec.create_disks = keel_hv::DiskCreation::all_of(&disk);
    spec.clone_from = Some(keel_api::CloneSource {
        vm: "gone".into(),
        vm_uid: "u9".into(),
        snapshot: "s1".into(),
        disks: vec!["data".into()],
        linked: true,
    });
    let err = hv.start(&spec).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("an overlay on VM gone's disk data"),
        "{err}"
    );
    assert!(!hv.disk_path("thin", "data").exists());
    let bases = hv
        .disk_path("thin", "data")
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join(".clone-bases/gone-u9/s1");
    let left: Vec<_> = std::fs::read_dir(&bases)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in {}: {left:?}", bases.display());
}
