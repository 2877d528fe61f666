//! The qemu driver against real QEMU and the test guest from
//! `scripts/build-test-guest`, under TCG so the result does not depend on
//! the host's KVM.
//!
//! Missing QEMU or guest is a failure, not a skip: these tests are the only
//! proof the driver works. `KEEL_SKIP_QEMU_TESTS=1` skips them explicitly.
//! The guest is found in `$KEEL_GUEST_DIR` or `<workspace>/target/guest`.
//!
//! Each test has its own data dir; a guard kills every QEMU started from it
//! when the test ends, passed or not. The helpers are in `common/mod.rs`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{guest_dir, pid_alive, spec, Fixture, KillGuard, STOP};
use keel_api::Accelerator;
use keel_hv::qemu::{AccelChoice, QemuConfig, QemuDriver};
use keel_hv::{DomainState, ExitCause, HvError, Hypervisor};

#[tokio::test]
async fn boots_to_the_ready_marker_under_tcg() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let facts = hv.facts().await;
    assert_eq!(facts.accelerator, Some(Accelerator::Tcg));
    assert!(
        facts.accelerator_note.contains("tcg"),
        "{}",
        facts.accelerator_note
    );
    assert!(
        facts.hypervisor.starts_with("qemu "),
        "{}",
        facts.hypervisor
    );

    let mut ch = fx.boot("web", "web-1").await;
    let info = hv.info("web-1").await.unwrap();
    assert_eq!(info.state, DomainState::Running);
    assert_eq!(info.vm, "web");
    let pid = info.pid.expect("a running domain has a pid");
    assert_eq!(hv.pid("web-1"), Some(pid));
    // Its own session: Ctrl-C or a hangup aimed at Keel does not reach it.
    // SAFETY: getsid(2) has no memory effects.
    assert_eq!(unsafe { libc::getsid(pid as i32) }, pid as i32);

    let ticks = ch.ticks().await.unwrap();
    assert!(!ticks.boot_id.is_empty());
    let listed = hv.list().await.unwrap();
    assert!(listed.unknown.is_empty(), "{listed:?}");
    assert_eq!(listed.domains.len(), 1);
    assert_eq!(listed.domains[0].instance, "web-1");
    assert_eq!(hv.domains_of("web").await.unwrap(), listed.domains);
    assert!(hv.domains_of("we").await.unwrap().is_empty());

    let err = hv.start(&spec("web", "web-1")).await.unwrap_err();
    assert_eq!(
        err,
        HvError::AlreadyExists {
            instance: "web-1".into()
        }
    );
}

#[tokio::test]
async fn graceful_stop_powers_off_and_cleanup_forgets() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    fx.boot("web", "web-1").await;
    let pid = hv.pid("web-1").unwrap();

    let t = Instant::now();
    hv.shutdown("web-1").await.unwrap();
    let state = fx.wait_for("web-1", STOP, DomainState::is_exited).await;
    eprintln!("power-off took {:?}", t.elapsed());
    assert_eq!(state, DomainState::Exited(ExitCause::Poweroff));
    assert!(!pid_alive(pid), "QEMU pid {pid} still alive");
    // Reaped by the monitor, not left a zombie.
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "pid {pid} not reaped"
    );
    assert_eq!(hv.info("web-1").await.unwrap().pid, None);

    // Exited domains stay known, and stopping them again is a no-op.
    hv.shutdown("web-1").await.unwrap();
    hv.kill("web-1").await.unwrap();
    assert_eq!(
        hv.info("web-1").await.unwrap().state,
        DomainState::Exited(ExitCause::Poweroff),
        "a later kill does not rewrite how it ended"
    );

    hv.cleanup("web-1").await.unwrap();
    let gone = HvError::NotFound {
        instance: "web-1".into(),
    };
    assert_eq!(hv.info("web-1").await.unwrap_err(), gone);
    assert_eq!(hv.cleanup("web-1").await.unwrap_err(), gone);
    assert_eq!(hv.shutdown("web-1").await.unwrap_err(), gone);
    assert_eq!(hv.kill("web-1").await.unwrap_err(), gone);
    assert!(hv.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_guest_ignoring_the_power_button_is_killed() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let mut ch = fx.boot("hung", "hung-1").await;
    ch.set_acpi(false).await.unwrap();

    hv.shutdown("hung-1").await.unwrap();
    // The one fixed wait: proving something does *not* happen takes time.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(hv.info("hung-1").await.unwrap().state, DomainState::Running);
    assert!(matches!(
        hv.cleanup("hung-1").await.unwrap_err(),
        HvError::StillRunning {
            state: DomainState::Running,
            ..
        }
    ));

    hv.kill("hung-1").await.unwrap();
    let state = fx.wait_for("hung-1", STOP, DomainState::is_exited).await;
    assert_eq!(state, DomainState::Exited(ExitCause::Killed));
    hv.cleanup("hung-1").await.unwrap();
}

#[tokio::test]
async fn acknowledged_writes_survive_into_the_next_instance() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let record = format!("record-{}", std::process::id());
    let mut ch = fx.boot("db", "db-1").await;
    ch.put(7, &record).await.unwrap();
    // Right after the acknowledgement: no time for anything to settle.
    hv.shutdown("db-1").await.unwrap();
    let state = fx.wait_for("db-1", STOP, DomainState::is_exited).await;
    assert_eq!(state, DomainState::Exited(ExitCause::Poweroff));
    hv.cleanup("db-1").await.unwrap();

    let disk = fx.dir.path().join("disks/db/data.qcow2");
    assert!(
        disk.is_file(),
        "the disk belongs to the VM and outlives instances"
    );

    let mut ch = fx.boot("db", "db-2").await;
    assert_eq!(ch.get(7).await.unwrap(), record);

    // Disks are not deleted from under a live instance.
    assert!(matches!(
        hv.delete_disks("db").await.unwrap_err(),
        HvError::Storage { .. }
    ));
    hv.kill("db-2").await.unwrap();
    hv.cleanup("db-2").await.unwrap();
    hv.delete_disks("db").await.unwrap();
    assert!(!disk.exists());
    hv.delete_disks("db").await.unwrap();
}

#[tokio::test]
async fn a_new_driver_re_adopts_running_guests() {
    let Some(mut fx) = Fixture::new().await else {
        return;
    };
    let mut ch = fx.boot("web", "web-1").await;
    let pid = fx.hv().pid("web-1").unwrap();

    fx.reopen().await;
    let hv = fx.hv();
    let info = hv.info("web-1").await.unwrap();
    assert_eq!(info.state, DomainState::Running);
    assert_eq!(info.pid, Some(pid));
    assert_eq!(info.vm, "web");
    // The guest did not notice.
    ch.ping().await.unwrap();

    hv.kill("web-1").await.unwrap();
    let state = fx.wait_for("web-1", STOP, DomainState::is_exited).await;
    assert_eq!(state, DomainState::Exited(ExitCause::Killed));
    assert!(!pid_alive(pid));
    hv.cleanup("web-1").await.unwrap();
    assert!(hv.info("web-1").await.unwrap_err().is_not_found());
}

#[tokio::test]
async fn exits_while_no_driver_watches_are_recorded_on_adoption() {
    let Some(mut fx) = Fixture::new().await else {
        return;
    };
    fx.boot("web", "web-1").await;
    let pid = fx.hv().pid("web-1").unwrap();
    drop(fx.driver.take());
    // Not Keel's kill: a crash as far as Keel can tell.
    // SAFETY: kill(2) on the QEMU this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let deadline = Instant::now() + STOP;
    while pid_alive(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fx.reopen().await;
    let hv = fx.hv();
    assert_eq!(
        hv.info("web-1").await.unwrap().state,
        DomainState::Exited(ExitCause::Crashed)
    );
    hv.cleanup("web-1").await.unwrap();
}

#[tokio::test]
async fn unreachable_qmp_on_a_live_process_is_unavailable() {
    let Some(mut fx) = Fixture::new().await else {
        return;
    };
    fx.boot("web", "web-1").await;
    let pid = fx.hv().pid("web-1").unwrap();
    std::fs::remove_file(fx.hv().qmp_socket("web-1")).unwrap();
    // A fresh driver cannot reach QMP any more; the old one's connection
    // would have survived the unlink.
    fx.reopen().await;
    let hv = fx.hv();

    // Listed on its own as unknown, with the reason; never as absent.
    let listing = hv.list().await.unwrap();
    assert!(listing.domains.is_empty(), "{listing:?}");
    assert_eq!(listing.unknown.len(), 1, "{listing:?}");
    assert_eq!(listing.unknown[0].vm.as_deref(), Some("web"));
    for err in [
        hv.info("web-1").await.unwrap_err(),
        listing.unknown[0].error.clone(),
        hv.domains_of("web").await.unwrap_err(),
        hv.shutdown("web-1").await.unwrap_err(),
    ] {
        assert!(
            matches!(&err, HvError::Unavailable { instance, .. } if instance == "web-1"),
            "{err:?}"
        );
    }
    assert!(pid_alive(pid));
    assert!(matches!(
        hv.cleanup("web-1").await.unwrap_err(),
        HvError::StillRunning { .. }
    ));

    // Killing needs no QMP.
    hv.kill("web-1").await.unwrap();
    assert_eq!(
        hv.info("web-1").await.unwrap().state,
        DomainState::Exited(ExitCause::Killed)
    );
    hv.cleanup("web-1").await.unwrap();
}

#[tokio::test]
async fn a_frozen_qemu_is_unavailable_not_exited() {
    let Some(fx) = Fixture::with(|mut c| {
        c.qmp_timeout = Duration::from_secs(1);
        c
    })
    .await
    else {
        return;
    };
    let hv = fx.hv();
    fx.boot("web", "web-1").await;
    let pid = hv.pid("web-1").unwrap() as i32;
    // SAFETY: kill(2) on the QEMU this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let t = Instant::now();
    let err = hv.info("web-1").await.unwrap_err();
    assert!(matches!(err, HvError::Unavailable { .. }), "{err:?}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "bounded by the QMP timeout"
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_eq!(hv.info("web-1").await.unwrap().state, DomainState::Running);
    hv.kill("web-1").await.unwrap();
    hv.cleanup("web-1").await.unwrap();
}

/// One stopped QEMU (its QMP never answers) is listed as unknown on its
/// own, beside the running one; and the domains of another VM are read
/// without waiting for it, even of a VM whose name it extends (`web-1-1`
/// is VM `web-1`'s, found among `web-…` by name and never asked).
#[tokio::test]
async fn a_hung_domain_is_listed_unknown_and_delays_no_other_vms_lookup() {
    const QMP_TIMEOUT: Duration = Duration::from_secs(3);
    let Some(fx) = Fixture::with(|mut c| {
        c.qmp_timeout = QMP_TIMEOUT;
        c
    })
    .await
    else {
        return;
    };
    let hv = fx.hv();
    fx.boot("web-1", "web-1-1").await;
    fx.boot("web", "web-1").await;
    let stopped = hv.pid("web-1-1").unwrap() as i32;
    // SAFETY: kill(2) on the QEMU this test started.
    unsafe { libc::kill(stopped, libc::SIGSTOP) };

    let t = Instant::now();
    let listing = hv.list().await.unwrap();
    let listed_in = t.elapsed();
    eprintln!("list with one stopped QEMU: {listed_in:?}");
    assert_eq!(listing.domains.len(), 1, "{listing:?}");
    assert_eq!(
        (
            listing.domains[0].instance.as_str(),
            listing.domains[0].state
        ),
        ("web-1", DomainState::Running)
    );
    assert_eq!(listing.unknown.len(), 1, "{listing:?}");
    let unknown = &listing.unknown[0];
    assert_eq!(
        (unknown.instance.as_str(), unknown.vm.as_deref()),
        ("web-1-1", Some("web-1"))
    );
    assert!(
        matches!(&unknown.error, HvError::Unavailable { instance, .. } if instance == "web-1-1"),
        "{unknown:?}"
    );
    assert!(listed_in < QMP_TIMEOUT * 3, "bounded: {listed_in:?}");
    assert_eq!(listing.instances().count(), 2, "both are to be fenced");

    let t = Instant::now();
    let web = hv.domains_of("web").await.unwrap();
    let looked_in = t.elapsed();
    eprintln!("domains_of(web) beside the stopped QEMU: {looked_in:?}");
    assert_eq!(web, listing.domains);
    assert!(
        looked_in < QMP_TIMEOUT / 2,
        "waited for the stopped QEMU: {looked_in:?}"
    );
    // Its own VM's lookup fails: unknown is never absent.
    let err = hv.domains_of("web-1").await.unwrap_err();
    assert!(
        matches!(&err, HvError::Unavailable { instance, .. } if instance == "web-1-1"),
        "{err:?}"
    );

    // SAFETY: as above.
    unsafe { libc::kill(stopped, libc::SIGCONT) };
    for instance in ["web-1-1", "web-1"] {
        hv.kill(instance).await.unwrap();
        hv.cleanup(instance).await.unwrap();
    }
    assert!(hv.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn failed_starts_leave_nothing_behind() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let mut bad = spec("web", "web-1");
    bad.boot.kernel = Some("/nonexistent/vmlinuz".into());
    let err = hv.start(&bad).await.unwrap_err();
    assert!(
        matches!(&err, HvError::Failed { instance, .. } if instance == "web-1"),
        "{err:?}"
    );
    assert!(hv.info("web-1").await.unwrap_err().is_not_found());

    assert!(err.to_string().contains("host path"), "{err}");

    // QEMU itself refuses (a boot header and nothing else): the start
    // fails with its log. The kernel is an image of the driver's store.
    let images = keel_hv::images::ImageStore::open(
        &fx.dir.path().join("images"),
        std::path::Path::new("qemu-img"),
        Duration::from_secs(30),
    )
    .unwrap();
    let mut upload = images.begin("bad").await.unwrap();
    let mut header = vec![0u8; 0x400];
    header[0x202..0x206].copy_from_slice(b"HdrS");
    upload.write(&header).await.unwrap();
    let staged = images
        .finish(upload, keel_api::ImageKind::Kernel, 1)
        .await
        .unwrap();
    bad.images = vec![staged.image.clone()];
    images.commit(staged).unwrap();
    bad.boot.kernel = Some("bad".into());
    let err = hv.start(&bad).await.unwrap_err();
    assert!(err.to_string().contains("qemu"), "{err}");
    assert!(hv.info("web-1").await.unwrap_err().is_not_found());

    for name in ["../etc", "Web", ""] {
        let err = hv.start(&spec("web", name)).await.unwrap_err();
        assert!(matches!(err, HvError::Failed { .. }), "{err:?}");
        assert!(hv.info(name).await.unwrap_err().is_not_found());
    }
    let err = hv.start(&spec("../web", "web-2")).await.unwrap_err();
    assert!(matches!(err, HvError::Failed { .. }), "{err:?}");
    assert!(hv.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn kvm_probe_falls_back_to_tcg_with_a_note() {
    let Some(guest) = guest_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _guard = KillGuard {
        data_dir: dir.path().canonicalize().unwrap(),
    };
    let mut config = QemuConfig::new(dir.path()).with_test_guest(&guest);
    config.accel = AccelChoice::Auto;
    config.probe_timeout = Duration::from_millis(1);
    let hv = QemuDriver::new(config).await.unwrap();
    assert_eq!(hv.accelerator().await, Accelerator::Tcg);
    let facts = hv.facts().await;
    assert_eq!(
        facts.accelerator,
        Some(Accelerator::Tcg),
        "{}",
        facts.accelerator_note
    );
    let note = &facts.accelerator_note;
    assert!(note.ends_with("; using tcg"), "{note}");
    // Whichever way KVM is unavailable here, the note says so.
    assert!(note.contains("kvm"), "{note}");
    eprintln!("probe note: {note}");
}

/// The driver is built without waiting for the probe; a start issued while
/// it runs waits for the verdict and launches under it.
#[tokio::test]
async fn a_start_during_the_kvm_probe_launches_under_its_verdict() {
    let Some(guest) = guest_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _guard = KillGuard {
        data_dir: dir.path().canonicalize().unwrap(),
    };
    let mut config = QemuConfig::new(dir.path()).with_test_guest(&guest);
    config.accel = AccelChoice::Auto;
    config.probe_banner_timeout = Duration::from_secs(2);
    let hv = QemuDriver::new(config).await.unwrap();
    hv.start(&spec("web", "web-1")).await.unwrap();
    let facts = hv.facts().await;
    let settled = facts.accelerator.expect("a start waits for the verdict");
    let record: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("instances/web-1/spec.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        record["accelerator"],
        format!("{settled:?}"),
        "{}",
        facts.accelerator_note
    );
    hv.kill("web-1").await.unwrap();
}

/// The real probe with its default timeout, to see what this host gets:
/// `cargo test -p keel-hv --test qemu_e2e -- --ignored --nocapture real_kvm_probe`
#[tokio::test]
#[ignore = "depends on the host's KVM; run by hand"]
async fn real_kvm_probe() {
    let Some(guest) = guest_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _guard = KillGuard {
        data_dir: dir.path().canonicalize().unwrap(),
    };
    let mut config = QemuConfig::new(dir.path()).with_test_guest(&guest);
    config.accel = AccelChoice::Auto;
    let t = Instant::now();
    let hv = QemuDriver::new(config).await.unwrap();
    eprintln!("driver built after {:?}", t.elapsed());
    let accelerator = hv.accelerator().await;
    let facts = hv.facts().await;
    eprintln!(
        "settled after {:?}: {:?}: {}",
        t.elapsed(),
        accelerator,
        facts.accelerator_note
    );
}

/// A data dir of 200 characters (sockets cannot live under it: `sun_path`
/// holds 107 bytes): the guest boots, a fresh driver re-adopts it over QMP,
/// and its power-off is observed; cleanup leaves no socket dir behind.
#[tokio::test]
async fn a_data_dir_of_any_length_boots_and_readopts() {
    let Some(guest) = guest_dir() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut data_dir = tmp.path().canonicalize().unwrap();
    while data_dir.as_os_str().len() < 200 {
        data_dir.push("a-rather-long-directory-name");
    }
    let _guard = KillGuard {
        data_dir: data_dir.clone(),
    };
    let config = || common::tcg_config(&data_dir, &guest);
    let hv = QemuDriver::new(config()).await.unwrap();
    let mut ch = common::boot(&hv, &spec("web", "web-1")).await;
    let sockets = hv.qmp_socket("web-1").parent().unwrap().to_path_buf();
    assert!(
        !sockets.starts_with(&data_dir),
        "sockets under the long data dir: {}",
        sockets.display()
    );
    ch.ticks().await.unwrap();

    // As after a Keel restart: the new driver finds the socket dir in the
    // instance's record and speaks QMP to the running guest.
    drop(hv);
    let hv = QemuDriver::new(config()).await.unwrap();
    assert_eq!(hv.info("web-1").await.unwrap().state, DomainState::Running);
    common::stop_and_cleanup(&hv, "web-1").await;
    assert!(!sockets.exists(), "{} left behind", sockets.display());
}

/// A VM that has run on its disks never gets blank ones: a start that may
/// not create disks fails, naming the missing image, and leaves nothing.
#[tokio::test]
async fn a_start_that_may_not_create_disks_fails_on_missing_ones() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let used = keel_hv::DomainSpec {
        create_disks: keel_hv::DiskCreation::none(),
        ..spec("web", "web-1")
    };
    let err = fx.hv().start(&used).await.unwrap_err();
    assert!(
        matches!(&err, HvError::Failed { reason, .. } if reason.contains("missing at")),
        "{err:?}"
    );
    assert!(!fx.hv().disk_path("web", "data").exists());
    assert!(fx.hv().info("web-1").await.unwrap_err().is_not_found());

    // Per disk: a new disk may be made beside a used one, but not while the
    // used one is missing; the refusal comes before anything is made, even
    // of a disk listed before it.
    let mut two = used.clone();
    two.instance = "web-2".into();
    two.disks.insert(
        0,
        keel_api::DiskSpec {
            name: "extra".into(),
            size_mib: 16,
            image: None,
        },
    );
    two.create_disks = keel_hv::DiskCreation::Only(vec!["extra".into()]);
    let err = fx.hv().start(&two).await.unwrap_err();
    assert!(
        err.to_string().contains("disk data of VM web is missing"),
        "{err}"
    );
    assert!(
        !fx.hv().disk_path("web", "extra").exists(),
        "made before the check"
    );
}

/// An instance directory that went missing (deleted by hand, a lost mount)
/// is not "gone" while its QEMU lives: the lookup is Unavailable, never
/// NotFound, so no controller starts a second instance beside it.
#[tokio::test]
async fn a_missing_instance_dir_is_not_gone_while_its_qemu_lives() {
    let Some(mut fx) = Fixture::new().await else {
        return;
    };
    fx.boot("web", "web-1").await;
    let dir = fx.hv().instance_dir("web-1");
    let aside = fx.dir.path().join("moved-away");
    drop(fx.driver.take());
    std::fs::rename(&dir, &aside).unwrap();
    fx.reopen().await;
    let err = fx.hv().info("web-1").await.unwrap_err();
    assert!(matches!(err, HvError::Unavailable { .. }), "{err:?}");
    assert!(fx.hv().cleanup("web-1").await.is_err());
    // Back in place (a remount): the next driver finds it running.
    std::fs::rename(&aside, &dir).unwrap();
    fx.reopen().await;
    assert_eq!(
        fx.hv().info("web-1").await.unwrap().state,
        DomainState::Running
    );
    common::stop_and_cleanup(fx.hv(), "web-1").await;
}

/// The figures of a running guest (`stats_all`): its QEMU's CPU time grows
/// while it works, its resident memory is real, its data disk's write
/// counters grow with the guest's acknowledged writes, and an exited
/// instance has no figures.
#[tokio::test]
async fn stats_of_a_running_guest_grow_with_its_work() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    // With a balloon device, as every new instance has: the guest's own
    // view of its memory comes through it.
    let spec = keel_hv::DomainSpec {
        balloon: true,
        ..common::spec("busy", "busy-1")
    };
    let mut ch = common::boot(hv, &spec).await;
    let figures = |all: Vec<keel_hv::vm_stats::DomainStats>| {
        all.into_iter()
            .find(|d| d.instance == "busy-1")
            .expect("the running instance has figures")
    };
    let before = figures(hv.stats_all().await.unwrap());
    assert_eq!(before.vm, "busy");
    assert!(
        before.rss_bytes.unwrap() > 16 << 20,
        "resident memory of a booted guest: {before:?}"
    );
    let disk = |d: &keel_hv::vm_stats::DomainStats| {
        d.disks
            .iter()
            .find(|x| x.disk == "data")
            .cloned()
            .unwrap_or_else(|| panic!("the data disk, by its spec name: {d:?}"))
    };
    assert_eq!(before.disks.len(), 1, "only the VM's own disks: {before:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut slot = 0;
    let after = loop {
        // Each put is a write the guest waits for to be on the disk.
        ch.put(slot % 8, &"x".repeat(400)).await.unwrap();
        slot += 1;
        let now = figures(hv.stats_all().await.unwrap());
        if now.cpu_seconds > before.cpu_seconds && disk(&now).write_ops > disk(&before).write_ops {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "figures did not grow: {before:?} then {now:?}"
        );
    };
    assert!(disk(&after).write_bytes > disk(&before).write_bytes);
    assert!(after.nics.is_empty(), "user-mode NICs have no counters");

    // The guest's balloon driver reports its kernel's figures once polling
    // is on (the first read asked for it): all the memory it manages,
    // a little under the configured 256 MiB, most of it free in this
    // small guest.
    let deadline = Instant::now() + Duration::from_secs(60);
    let guest = loop {
        let now = figures(hv.stats_all().await.unwrap());
        if let Some(guest) = now.guest_memory {
            break guest;
        }
        assert!(
            Instant::now() < deadline,
            "no guest memory figures from the balloon: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let total = guest.total_bytes.expect("the guest reports its total");
    assert!(
        total <= 256 << 20 && total > 128 << 20,
        "total close to the configured memory: {guest:?}"
    );
    let free = guest.free_bytes.expect("the guest reports its free memory");
    assert!(free > 0 && free < total, "{guest:?}");
    if let Some(available) = guest.available_bytes {
        assert!(available >= free && available <= total, "{guest:?}");
    }
    // And fresh: polled (every 10 s), the guest reports again, rather than
    // only the once its driver does when it loads.
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let now = figures(hv.stats_all().await.unwrap());
        let again = now.guest_memory.and_then(|g| g.reported_at);
        if again > guest.reported_at {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no new report from the guest after {guest:?}: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    hv.kill("busy-1").await.unwrap();
    fx.wait_for("busy-1", STOP, DomainState::is_exited).await;
    let all = hv.stats_all().await.unwrap();
    assert!(
        all.iter().all(|d| d.instance != "busy-1"),
        "an exited instance has no figures: {all:?}"
    );
    hv.cleanup("busy-1").await.unwrap();
}
