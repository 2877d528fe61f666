//! A drain between two nodes whose migrations travel over TCP with TLS on
//! loopback, through the controllers, with real QEMU guests: each node
//! has its own certificate from one cluster CA (made by the functions
//! behind `keel cluster init-ca` / `issue-cert`), and the source checks the
//! target node's name on its certificate.

mod qemu;

use std::ops::RangeInclusive;
use std::path::Path;
use std::time::Duration;

use keel_api::{
    EvictionWindows, Migration, MigrationPhase, MigrationTransport, Node, Phase, RunPolicy,
};
use keel_ctrl::keys::{migrations_of_prefix, node_key};
use keel_hv::guest::GuestChannel;
use keel_hv::qemu::{tls, QemuConfig};
use qemu::Env;

const BOOT: Duration = Duration::from_secs(90);
const PORTS: RangeInclusive<u16> = 47_340..=47_359;

fn over_tls(creds: &Path) -> impl FnOnce(QemuConfig) -> QemuConfig {
    let creds = creds.to_path_buf();
    move |mut c| {
        c.migration_address = Some("127.0.0.1".parse().unwrap());
        c.migration_ports = Some(PORTS);
        c.migration_tls = Some(creds);
        c
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_live_migrates_over_tls() {
    let creds = tempfile::tempdir().unwrap();
    let ca = creds.path().join("ca");
    tls::init_ca(&ca).unwrap();
    for node in ["local", "b"] {
        tls::issue(&ca, node, &creds.path().join(node)).unwrap();
    }
    let Some(mut env) = Env::new_with(over_tls(&creds.path().join("local"))).await else {
        return;
    };
    env.create(
        "web",
        Env::spec(RunPolicy::AlwaysOnUnlessStoppedManually, 30),
    )
    .await;
    let (old_instance, mut guest) = env.ready("web", BOOT).await;
    guest.put(4, "written before the move").await.unwrap();
    let before = guest.ticks().await.unwrap();
    drop(guest);
    env.add_node_with("b", over_tls(&creds.path().join("b")))
        .await;

    let now = keel_api::Clock::now_ms(&keel_api::SystemClock);
    let entry = env
        .store
        .get::<Node>(&node_key("local"))
        .await
        .unwrap()
        .unwrap();
    let mut node = entry.value;
    node.request_drain(
        now,
        EvictionWindows {
            submit_ms: 120_000,
            migrate_ms: 120_000,
            fallback_ms: 120_000,
        },
    );
    env.store
        .update(&node_key("local"), &node, entry.revision)
        .await
        .unwrap();

    let vm = env
        .wait_for("web", BOOT, "moved to node b", |vm| {
            vm.status.phase == Phase::Running
                && vm.status.instance.as_ref().is_some_and(|i| i.node == "b")
        })
        .await;
    assert!(
        vm.status.last_exit.is_none(),
        "stopped, not migrated: {vm:?}"
    );
    let inst = vm.status.instance.unwrap();
    assert_ne!(inst.id, old_instance);
    let (migrations, _) = env
        .store
        .list::<Migration>(&migrations_of_prefix("web"))
        .await
        .unwrap();
    let [(_, m)] = migrations.as_slice() else {
        panic!("expected one migration: {migrations:?}");
    };
    let m = &m.value;
    assert_eq!(m.status.phase, MigrationPhase::Succeeded, "{m:?}");
    assert_eq!(m.transport(), Some(MigrationTransport::TcpTls), "{m:?}");
    eprintln!(
        "migration {} over {:?} ({}): downtime {:?} ms, {} ms from creation to success",
        m.id,
        m.transport(),
        m.status.target_uri.as_deref().unwrap_or("-"),
        m.status.downtime_ms,
        m.status
            .finished_at
            .unwrap_or(0)
            .saturating_sub(m.created_at)
    );
    assert!(m.status.downtime_ms.is_some());

    // The same guest, not a reboot, still counting, with its record.
    let mut guest = GuestChannel::connect(env.node_driver("b").command_socket(&inst.id))
        .await
        .unwrap();
    guest.sync(Duration::from_secs(30)).await.unwrap();
    let ticks = guest.ticks().await.unwrap();
    assert_eq!(ticks.boot_id, before.boot_id, "the guest rebooted");
    // Counting on: the guest's clock stood still while the source was
    // paused for the transfer (TCG before QEMU 9.0), so a move right after
    // the first look may not have let a tick pass yet.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut ticks = ticks;
    while ticks.ticks <= before.ticks && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        ticks = guest.ticks().await.unwrap();
    }
    assert_eq!(ticks.boot_id, before.boot_id, "the guest rebooted");
    assert!(ticks.ticks > before.ticks, "{ticks:?} after {before:?}");
    assert_eq!(guest.get(4).await.unwrap(), "written before the move");
}
