//! Live migration between two qemu drivers on this host, against real QEMU
//! and the test guest. Each driver ("node") has its own data dir; the disks
//! are in a directory both share, as nodes on shared storage would.
//!
//! What is proven: the guest keeps running across the move (its tick
//! counter goes on, its boot id stays), its disk writes are there on the
//! target, the target has its own command channel, the source ends paused,
//! a disk plugged into the source is on the target (same port), and a
//! cancelled migration leaves the source running.
//!
//! Same conventions as `qemu_e2e.rs`: TCG, a guard that kills whatever a
//! test started; helpers in `common/mod.rs`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{boot, spec, wait_for, Cluster, BOOT, STOP};
use keel_hv::guest::{GuestChannel, Ticks};
use keel_hv::qemu::{tls, QemuDriver};
use keel_hv::{DomainSpec, DomainState, ExitCause, HvError, Hypervisor, MigrationProgress};

/// Bound on one migration of the 256 MiB test guest (about 1 s here).
const MIGRATE: Duration = Duration::from_secs(60);

fn target_spec(source: &DomainSpec, instance: &str) -> DomainSpec {
    DomainSpec {
        instance: instance.into(),
        ..source.clone()
    }
}

/// Polls the source until the migration is over; returns the last status
/// and whether it was ever seen active.
async fn wait_migration(hv: &QemuDriver, instance: &str) -> (MigrationProgress, bool) {
    let deadline = Instant::now() + MIGRATE;
    let mut seen_active = false;
    loop {
        let progress = hv.migration_status(instance).await.unwrap();
        match &progress {
            MigrationProgress::Active { .. } => seen_active = true,
            MigrationProgress::None => panic!("{instance}: no migration reported"),
            MigrationProgress::Completed { .. }
            | MigrationProgress::Failed { .. }
            | MigrationProgress::Unknown { .. } => return (progress, seen_active),
        }
        assert!(
            Instant::now() < deadline,
            "{instance}: migration not done after {MIGRATE:?}: {progress:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Connects to the target's own command channel and checks the guest is
/// the one that ran on the source, still counting.
async fn same_guest_on(hv: &QemuDriver, instance: &str, before: &Ticks) -> GuestChannel {
    assert_ne!(before.boot_id, "");
    let mut ch = GuestChannel::connect(hv.command_socket(instance))
        .await
        .unwrap();
    ch.sync(BOOT).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = ch.ticks().await.unwrap();
        assert_eq!(now.boot_id, before.boot_id, "the guest rebooted");
        if now.ticks > before.ticks {
            eprintln!("{instance}: ticks {} -> {}", before.ticks, now.ticks);
            return ch;
        }
        assert!(Instant::now() < deadline, "ticks stuck at {}", now.ticks);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Migrates `from`/`source` to a new instance `target` on `to` and checks
/// both ends; returns the target's channel. The source is killed and
/// cleaned up, as the controller does.
async fn migrate_and_check(
    from: &QemuDriver,
    source: &DomainSpec,
    to: &QemuDriver,
    target: &str,
    before: &Ticks,
) -> GuestChannel {
    let params = keel_hv::MigrationParams::default();
    let from_any = keel_hv::IncomingParams::default();
    migrate_and_check_with(from, source, to, target, before, &params, &from_any).await
}

/// [`migrate_and_check`] with the migration's parameters at both ends.
async fn migrate_and_check_with(
    from: &QemuDriver,
    source: &DomainSpec,
    to: &QemuDriver,
    target: &str,
    before: &Ticks,
    params: &keel_hv::MigrationParams,
    incoming: &keel_hv::IncomingParams,
) -> GuestChannel {
    let target = target_spec(source, target);
    let uri = to.prepare_incoming_from(&target, incoming).await.unwrap();
    eprintln!("{} listens at {uri}", target.instance);
    assert_eq!(
        to.info(&target.instance).await.unwrap().state,
        DomainState::Starting
    );
    // Whatever QEMU says about the incoming side, the target sends nothing.
    assert_eq!(
        to.migration_status(&target.instance).await.unwrap(),
        MigrationProgress::None
    );
    // Nothing under way (an earlier attempt may have failed).
    let earlier = from.migration_status(&source.instance).await.unwrap();
    assert!(
        matches!(
            earlier,
            MigrationProgress::None | MigrationProgress::Failed { .. }
        ),
        "{earlier:?}"
    );

    let t = Instant::now();
    from.migrate_tuned(&source.instance, &uri, params)
        .await
        .unwrap();
    // A retried call is a success; another target is not.
    from.migrate_tuned(&source.instance, &uri, params)
        .await
        .unwrap();
    let err = from
        .migrate(&source.instance, "unix:/nonexistent/migrate.sock")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, HvError::Failed { instance, .. } if *instance == source.instance),
        "{err:?}"
    );
    let (progress, _) = wait_migration(from, &source.instance).await;
    let MigrationProgress::Completed {
        total_ms,
        downtime_ms,
    } = progress
    else {
        panic!("migration failed: {progress:?}");
    };
    eprintln!(
        "{} -> {}: completed after {:?} (QEMU: total {total_ms} ms, downtime {downtime_ms:?} ms)",
        source.instance,
        target.instance,
        t.elapsed()
    );
    // Reported only once QEMU has filled in its figures.
    assert!(
        total_ms > 0 && downtime_ms.is_some(),
        "{total_ms} {downtime_ms:?}"
    );

    // The source handed over and stays paused until killed.
    assert_eq!(
        from.info(&source.instance).await.unwrap().state,
        DomainState::Paused
    );
    // The target has the whole state and waits, paused, until told to run
    // (Keel does once the success is recorded).
    let state = wait_for(to, &target.instance, STOP, |s| *s == DomainState::Paused).await;
    assert_eq!(state, DomainState::Paused);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        to.info(&target.instance).await.unwrap().state,
        DomainState::Paused,
        "the target ran by itself"
    );
    to.resume_incoming(&target.instance).await.unwrap();
    let state = wait_for(to, &target.instance, STOP, |s| *s == DomainState::Running).await;
    assert_eq!(state, DomainState::Running);
    // Repeating it is a success.
    to.resume_incoming(&target.instance).await.unwrap();
    let ch = same_guest_on(to, &target.instance, before).await;

    from.kill(&source.instance).await.unwrap();
    assert_eq!(
        from.info(&source.instance).await.unwrap().state,
        DomainState::Exited(ExitCause::Killed)
    );
    // The outcome outlives the source process.
    assert!(matches!(
        from.migration_status(&source.instance).await.unwrap(),
        MigrationProgress::Completed { .. }
    ));
    from.cleanup(&source.instance).await.unwrap();
    ch
}

#[tokio::test]
async fn a_running_guest_moves_to_another_node_and_back() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let a = cluster.node("a").await;
    let b = cluster.node("b").await;
    let web1 = spec("web", "web-1");
    let mut ch = boot(&a, &web1).await;
    ch.put(5, "hello").await.unwrap();
    // A few ticks in, so a counter that restarted would show.
    let before = loop {
        let t = ch.ticks().await.unwrap();
        if t.ticks >= 3 {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    let mut ch = migrate_and_check(&a, &web1, &b, "web-2", &before).await;
    assert_eq!(ch.get(5).await.unwrap(), "hello");
    // The source is gone: this is the target's own channel answering, and
    // its writes land on the shared disk.
    ch.put(5, "moved").await.unwrap();
    assert!(a.list().await.unwrap().is_empty());

    // Back again: web-2 arrived by migration, and QEMU reports that
    // incoming migration as "completed" until web-2 sends one of its own.
    let before = ch.ticks().await.unwrap();
    let web2 = target_spec(&web1, "web-2");
    let mut ch = migrate_and_check(&b, &web2, &a, "web-3", &before).await;
    assert_eq!(ch.get(5).await.unwrap(), "moved");
    a.kill("web-3").await.unwrap();
    a.cleanup("web-3").await.unwrap();
}

#[tokio::test]
async fn a_disk_plugged_on_the_source_is_on_the_target_after_the_move() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let a = cluster.node("a").await;
    let b = cluster.node("b").await;
    let db1 = DomainSpec {
        hotplug_ports: 2,
        ..spec("db", "db-1")
    };
    let mut ch = boot(&a, &db1).await;
    let extra = keel_api::DiskSpec {
        name: "extra".into(),
        size_mib: 24,
        image: None,
    };
    let plug = keel_hv::DiskPlug {
        vm: "db".into(),
        instance: "db-1".into(),
        disk: extra.clone(),
        port: 1,
        create: true,
    };
    a.attach_disk(&plug).await.unwrap();
    // Asked again (an answer lost): the disk it has, nothing added.
    a.attach_disk(&plug).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while ch.disk_bytes("vdb").await.ok() != Some(24 << 20) {
        assert!(Instant::now() < deadline, "the guest never saw vdb");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ch.disk_bytes("vdc").await.is_err(), "plugged once");
    let before = ch.ticks().await.unwrap();

    // The source as the controller describes it to a target: the plugged
    // disk after the others, on its port.
    let source = DomainSpec {
        disks: [db1.disks.clone(), vec![extra]].concat(),
        plugged: vec![keel_api::PluggedDisk {
            disk: "extra".into(),
            port: 1,
            attached_at: Some(1),
            detach_requested_at: None,
        }],
        ..db1.clone()
    };
    let mut ch = migrate_and_check(&a, &source, &b, "db-2", &before).await;
    assert_eq!(ch.disk_bytes("vdb").await.unwrap(), 24 << 20);
    b.kill("db-2").await.unwrap();
    b.cleanup("db-2").await.unwrap();
}

#[tokio::test]
async fn a_cancelled_migration_leaves_the_source_running() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    // 1 MiB/s, asked for by the migration's tuning (not the node's
    // setting): the guest's ~100 MiB of used memory would take minutes.
    // Auto-converge and a downtime limit are accepted by QEMU too.
    let a = cluster.node("a").await;
    let b = cluster.node("b").await;
    let web1 = spec("web", "web-1");
    let mut ch = boot(&a, &web1).await;
    let before = ch.ticks().await.unwrap();

    let uri = b
        .prepare_incoming(&target_spec(&web1, "web-2"))
        .await
        .unwrap();
    let params = keel_hv::MigrationParams {
        max_bandwidth: Some(1 << 20),
        auto_converge: true,
        downtime_limit_ms: Some(100),
        tls_peer: None,
    };
    a.migrate_tuned("web-1", &uri, &params).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match a.migration_status("web-1").await.unwrap() {
            MigrationProgress::Active {
                transferred_bytes, ..
            } if transferred_bytes > 0 => break,
            MigrationProgress::Active { .. } => {}
            other => panic!("expected an active migration, got {other:?}"),
        }
        assert!(Instant::now() < deadline, "migration never got going");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The cap holds: two seconds later, still under way and at most a few
    // MiB sent (uncapped, it would be done or far beyond).
    tokio::time::sleep(Duration::from_secs(2)).await;
    match a.migration_status("web-1").await.unwrap() {
        MigrationProgress::Active {
            transferred_bytes,
            total_bytes,
            remaining_bytes,
        } => {
            assert!(
                transferred_bytes < 6 << 20,
                "{transferred_bytes} bytes in ~2 s at 1 MiB/s"
            );
            // QEMU's own figure of what is left, for `--wait`'s ETA.
            assert!(
                remaining_bytes > 0 && remaining_bytes <= total_bytes,
                "{remaining_bytes} of {total_bytes} left"
            );
        }
        other => panic!("expected a capped, active migration, got {other:?}"),
    }

    a.cancel_migration("web-1").await.unwrap();
    let (progress, _) = wait_migration(&a, "web-1").await;
    assert_eq!(
        progress,
        MigrationProgress::Failed {
            reason: "cancelled".into()
        }
    );
    a.cancel_migration("web-1").await.unwrap();
    assert_eq!(a.info("web-1").await.unwrap().state, DomainState::Running);
    let now = ch.ticks().await.unwrap();
    assert_eq!(now.boot_id, before.boot_id);
    ch.ping().await.unwrap();

    // The target saw the stream end and gave up by itself.
    let state = wait_for(&b, "web-2", STOP, DomainState::is_exited).await;
    assert_eq!(state, DomainState::Exited(ExitCause::Crashed));
    b.cleanup("web-2").await.unwrap();

    a.kill("web-1").await.unwrap();
    a.cleanup("web-1").await.unwrap();
}

#[tokio::test]
async fn tcp_migration_and_refusals() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let a = cluster.node("a").await;
    let b = cluster
        .node_with("b", |mut c| {
            c.migration_address = Some("127.0.0.1".parse().unwrap());
            c
        })
        .await;

    // A target for disks the shared storage does not have is refused, and
    // leaves nothing behind.
    let err = b
        .prepare_incoming(&spec("ghost", "ghost-2"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, HvError::Failed { instance, .. } if instance == "ghost-2"),
        "{err:?}"
    );
    assert!(err.to_string().contains("shared"), "{err}");
    assert!(b.info("ghost-2").await.unwrap_err().is_not_found());
    // Only unix: and tcp: URIs are sent to.
    let err = a.migrate("web-1", "exec:true").await.unwrap_err();
    assert!(matches!(err, HvError::Failed { .. }), "{err:?}");
    assert!(a
        .migrate("web-1", "tcp:127.0.0.1:4444")
        .await
        .unwrap_err()
        .is_not_found());

    let web1 = spec("web", "web-1");
    let mut ch = boot(&a, &web1).await;
    ch.put(3, "over-tcp").await.unwrap();
    let before = ch.ticks().await.unwrap();
    let mut ch = migrate_and_check(&a, &web1, &b, "web-2", &before).await;
    assert_eq!(ch.get(3).await.unwrap(), "over-tcp");
    b.kill("web-2").await.unwrap();
    b.cleanup("web-2").await.unwrap();
}

/// A source killed mid-stream, before any outcome was seen, reports the
/// outcome as unknown (never as failed: only the target can tell), and the
/// target, which did not get the whole state, ends without ever running.
#[tokio::test]
async fn a_source_killed_mid_migration_leaves_the_outcome_unknown() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let a = cluster
        .node_with("a", |mut c| {
            c.migration_max_bandwidth = Some(1 << 20);
            c
        })
        .await;
    let b = cluster.node("b").await;
    let web1 = spec("web", "web-1");
    boot(&a, &web1).await;
    let uri = b
        .prepare_incoming(&target_spec(&web1, "web-2"))
        .await
        .unwrap();
    a.migrate("web-1", &uri).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(
        a.migration_status("web-1").await.unwrap(),
        MigrationProgress::Active { transferred_bytes, .. } if transferred_bytes > 0
    ) {
        assert!(Instant::now() < deadline, "migration never got going");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.kill("web-1").await.unwrap();
    let progress = a.migration_status("web-1").await.unwrap();
    assert!(
        matches!(progress, MigrationProgress::Unknown { .. }),
        "{progress:?}"
    );
    let state = wait_for(&b, "web-2", STOP, |s| s.is_exited()).await;
    assert!(state.is_exited(), "{state:?}");
    assert!(b.resume_incoming("web-2").await.is_err());
    a.cleanup("web-1").await.unwrap();
    b.cleanup("web-2").await.unwrap();
}

/// A node's driver listening on loopback, on a port range, with the
/// migration credentials in `creds` (none: plain TCP).
async fn tcp_node(cluster: &Cluster, name: &str, creds: Option<&Path>) -> QemuDriver {
    let creds = creds.map(Path::to_path_buf);
    cluster
        .node_with(name, move |mut c| {
            c.migration_address = Some("127.0.0.1".parse().unwrap());
            c.migration_ports = Some(PORTS);
            c.migration_tls = creds;
            c
        })
        .await
}

/// Loopback ports this test's targets listen on.
const PORTS: std::ops::RangeInclusive<u16> = 47_310..=47_329;

fn tls_to(node: &str) -> keel_hv::MigrationParams {
    keel_hv::MigrationParams {
        tls_peer: Some(node.into()),
        ..Default::default()
    }
}

fn from_node(node: &str) -> keel_hv::IncomingParams {
    keel_hv::IncomingParams {
        tls_peer: Some(node.into()),
    }
}

/// Over TCP with TLS, both peers verified against the cluster CA: the guest
/// moves (ticks go on, its record is there); a target whose certificate
/// comes from another CA gets nothing and the guest keeps running on the
/// source; and neither side drops to plain TCP.
#[tokio::test]
async fn tls_migration_and_a_target_of_another_ca() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let root = cluster.dir.path();
    // Keel's own credentials, as `keel cluster init-ca` / `issue-cert`
    // make them.
    let (ca, other_ca) = (root.join("ca"), root.join("other-ca"));
    tls::init_ca(&ca).unwrap();
    tls::init_ca(&other_ca).unwrap();
    for node in ["a", "b"] {
        tls::issue(&ca, node, &root.join(format!("creds-{node}"))).unwrap();
    }
    tls::issue(&other_ca, "c", &root.join("creds-c")).unwrap();
    let a = tcp_node(&cluster, "a", Some(&root.join("creds-a"))).await;
    let b = tcp_node(&cluster, "b", Some(&root.join("creds-b"))).await;
    let c = tcp_node(&cluster, "c", Some(&root.join("creds-c"))).await;
    let plain = tcp_node(&cluster, "plain", None).await;
    assert_eq!(
        b.migration_endpoint().transport,
        keel_api::MigrationTransport::TcpTls
    );

    let web1 = spec("web", "web-1");
    let mut ch = boot(&a, &web1).await;
    // On shared storage that takes O_DIRECT (ext4 here), the page cache of
    // neither host stands between the two QEMUs.
    let launched = std::fs::read_to_string(a.instance_dir("web-1").join("spec.json")).unwrap();
    assert!(launched.contains("cache=none"), "{launched}");
    ch.put(3, "over-tls").await.unwrap();
    let before = ch.ticks().await.unwrap();

    // The source checks the name on the target's certificate.
    let probe = target_spec(&web1, "web-probe");
    let uri = b.prepare_incoming(&probe).await.unwrap();
    let port: u16 = uri.rsplit_once(':').unwrap().1.parse().unwrap();
    assert!(
        uri.starts_with("tls+tcp:127.0.0.1:") && PORTS.contains(&port),
        "{uri}"
    );
    a.migrate_tuned("web-1", &uri, &tls_to("not-b"))
        .await
        .unwrap();
    let (progress, _) = wait_migration(&a, "web-1").await;
    assert!(
        matches!(progress, MigrationProgress::Failed { .. }),
        "{progress:?}"
    );
    assert_eq!(a.info("web-1").await.unwrap().state, DomainState::Running);
    let _ = b.kill("web-probe").await;
    b.cleanup("web-probe").await.unwrap();

    let mut ch = migrate_and_check_with(
        &a,
        &web1,
        &b,
        "web-2",
        &before,
        &tls_to("b"),
        &from_node("a"),
    )
    .await;
    assert_eq!(ch.get(3).await.unwrap(), "over-tls");

    // A target with a certificate of another CA: refused, the guest keeps
    // running on the source, the same boot, still counting.
    let uri = c
        .prepare_incoming(&target_spec(&web1, "web-3"))
        .await
        .unwrap();
    b.migrate_tuned("web-2", &uri, &tls_to("c")).await.unwrap();
    let (progress, _) = wait_migration(&b, "web-2").await;
    let MigrationProgress::Failed { reason } = progress else {
        panic!("a target of another CA got the guest: {progress:?}");
    };
    eprintln!("target of another CA: {reason}");
    assert_eq!(b.info("web-2").await.unwrap().state, DomainState::Running);
    let refused_at = ch.ticks().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = ch.ticks().await.unwrap();
        assert_eq!(now.boot_id, before.boot_id, "the guest rebooted");
        if now.ticks > refused_at.ticks {
            break;
        }
        assert!(Instant::now() < deadline, "ticks stuck at {}", now.ticks);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_ne!(
        c.info("web-3").await.unwrap().state,
        DomainState::Running,
        "the foreign target runs"
    );
    let _ = c.kill("web-3").await;
    c.cleanup("web-3").await.unwrap();

    // No plain TCP from a node with credentials, none to a node with them
    // from one without: refused before QEMU sends anything.
    let uri = plain
        .prepare_incoming(&target_spec(&web1, "web-4"))
        .await
        .unwrap();
    assert!(uri.starts_with("tcp:127.0.0.1:"), "{uri}");
    let err = b.migrate("web-2", &uri).await.unwrap_err();
    assert!(err.to_string().contains("in the clear"), "{err}");
    // The earlier attempt's outcome stays: nothing new was sent.
    assert!(matches!(
        b.migration_status("web-2").await.unwrap(),
        MigrationProgress::Failed { .. }
    ));
    plain.kill("web-4").await.unwrap();
    plain.cleanup("web-4").await.unwrap();
    let web5 = spec("web5", "web5-1");
    boot(&plain, &web5).await;
    let uri = b
        .prepare_incoming(&target_spec(&web5, "web5-2"))
        .await
        .unwrap();
    let err = plain.migrate("web5-1", &uri).await.unwrap_err();
    assert!(
        err.to_string().contains("no migration credentials"),
        "{err}"
    );
    for (hv, instance) in [(&b, "web5-2"), (&plain, "web5-1"), (&b, "web-2")] {
        hv.kill(instance).await.unwrap();
        hv.cleanup(instance).await.unwrap();
    }
}

/// Prepares `target` on `to` for a migration from node `a`, has `from`
/// send `source` there, and checks the target refused it: the source
/// fails and keeps running, and the target's QEMU says why (`because`).
async fn refused_by_target(
    from: &QemuDriver,
    source: &DomainSpec,
    to: &QemuDriver,
    target: &str,
    because: &[&str],
) {
    let uri = to
        .prepare_incoming_from(&target_spec(source, target), &from_node("a"))
        .await
        .unwrap();
    from.migrate_tuned(&source.instance, &uri, &tls_to("b"))
        .await
        .unwrap();
    let (progress, _) = wait_migration(from, &source.instance).await;
    let MigrationProgress::Failed { reason } = progress else {
        panic!("{target} got the guest: {progress:?}");
    };
    eprintln!("{target}: the source reports {reason}");
    assert_eq!(
        from.info(&source.instance).await.unwrap().state,
        DomainState::Running
    );
    assert_ne!(to.info(target).await.unwrap().state, DomainState::Running);
    // QEMU reports a refused handshake on its stderr, a moment after the
    // source saw the connection end.
    let log = to.instance_dir(target).join("qemu.log");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if because.iter().all(|b| text.contains(b)) {
            eprintln!("{target}: the target's QEMU says {}", text.trim());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{target}: no {because:?} in its QEMU log: {text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = to.kill(target).await;
    to.cleanup(target).await.unwrap();
}

/// A target prepared for a migration from node a admits a's certificate
/// only: a source presenting node m's certificate, signed by the same CA,
/// is refused (`tls-authz`); so is a's own certificate once revoked (the
/// CRL `revoke` wrote into the target's credentials); a's certificate
/// issued anew then moves the guest, the same boot with its record.
#[tokio::test]
async fn tls_target_admits_only_the_named_source_and_no_revoked_certificate() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let root = cluster.dir.path();
    let ca = root.join("authz-ca");
    tls::init_ca(&ca).unwrap();
    // The source's credentials hold whichever node's certificate a step
    // needs: QEMU reads the directory anew for every migration.
    let source_creds = root.join("authz-source-creds");
    let target_data = root.join("authz-target-data");
    let target_creds = target_data.join(tls::CREDS_DIR);
    tls::issue(&ca, "m", &source_creds).unwrap();
    tls::issue(&ca, "b", &target_creds).unwrap();
    let a = tcp_node(&cluster, "a", Some(&source_creds)).await;
    let b = tcp_node(&cluster, "b", Some(&target_creds)).await;

    let authz1 = spec("authz", "authz-1");
    let mut ch = boot(&a, &authz1).await;
    ch.put(5, "admitted once").await.unwrap();
    let before = ch.ticks().await.unwrap();
    drop(ch);

    // Another node's certificate, valid and of the same CA.
    refused_by_target(&a, &authz1, &b, "authz-2", &["CN=m", "denied"]).await;

    // Node a's own certificate, revoked, the new CRL given to the target.
    tls::issue(&ca, "a", &source_creds).unwrap();
    let revoked = tls::revoke(&ca, "a", std::slice::from_ref(&target_data)).unwrap();
    assert_eq!(revoked.distributed, vec![target_creds.clone()]);
    refused_by_target(&a, &authz1, &b, "authz-3", &["revoked"]).await;

    // Node a's certificate issued anew: admitted.
    tls::issue(&ca, "a", &source_creds).unwrap();
    let mut ch = migrate_and_check_with(
        &a,
        &authz1,
        &b,
        "authz-4",
        &before,
        &tls_to("b"),
        &from_node("a"),
    )
    .await;
    assert_eq!(ch.get(5).await.unwrap(), "admitted once");
    b.kill("authz-4").await.unwrap();
    b.cleanup("authz-4").await.unwrap();
}
