//! Drain and restore with real QEMU guests, through the controller runtime.

mod qemu;

use std::time::Duration;

use keel_api::{
    EvictionWindows, Node, Phase, PowerState, RunPolicy, SnapshotPhase, VirtualMachine,
};
use keel_ctrl::keys::node_key;
use keel_hv::guest::GuestChannel;
use qemu::{qemu_pids, Env};

const BOOT: Duration = Duration::from_secs(90);

/// Three running guests on one node; the node is drained. Every guest ends
/// on the other node *without a reboot* (same boot id, its tick counter
/// still going) and with the record it wrote to its disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_a_node_live_migrates_its_three_guests() {
    let Some(mut env) = Env::new().await else {
        return;
    };
    let names = ["one", "two", "three"];
    for name in names {
        env.create(
            name,
            Env::spec(RunPolicy::AlwaysOnUnlessStoppedManually, 30),
        )
        .await;
    }
    let mut before = Vec::new();
    for name in names {
        let (instance, mut guest) = env.ready(name, BOOT).await;
        guest.put(9, &format!("kept by {name}")).await.unwrap();
        let ticks = guest.ticks().await.unwrap();
        before.push((instance, ticks));
    }
    env.add_node("b").await;
    let now = keel_api::Clock::now_ms(&keel_api::SystemClock);
    update_node(&env, "local", |n| {
        n.request_drain(
            now,
            EvictionWindows {
                submit_ms: 120_000,
                migrate_ms: 120_000,
                fallback_ms: 120_000,
            },
        )
    })
    .await;

    for (name, (old_instance, old_ticks)) in names.iter().zip(&before) {
        let vm = env
            .wait_for(name, BOOT, "moved to node b", |vm| {
                vm.status.phase == Phase::Running
                    && vm.status.instance.as_ref().is_some_and(|i| i.node == "b")
            })
            .await;
        assert!(
            vm.status.last_exit.is_none(),
            "{name} was stopped, not migrated: {vm:?}"
        );
        let inst = vm.status.instance.unwrap();
        assert_ne!(&inst.id, old_instance);
        // A migrated guest does not boot again: no new ready marker, so
        // talk to it directly.
        let mut guest = GuestChannel::connect(env.node_driver("b").command_socket(&inst.id))
            .await
            .unwrap();
        guest.sync(Duration::from_secs(30)).await.unwrap();
        let ticks = guest.ticks().await.unwrap();
        assert_eq!(ticks.boot_id, old_ticks.boot_id, "{name} rebooted");
        assert!(
            ticks.ticks >= old_ticks.ticks,
            "{name}: {ticks:?} after {old_ticks:?}"
        );
        assert_eq!(guest.get(9).await.unwrap(), format!("kept by {name}"));
    }
    // The sources were handed over and ended; the drain is complete and the
    // node stays cordoned by Keel until someone lifts it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let node = node(&env, "local").await;
        let sources_gone = qemu_pids(&format!("{}/n0/", env.data_dir.display())).is_empty();
        if sources_gone
            && node
                .drain
                .as_ref()
                .is_some_and(|d| d.completed_at.is_some())
        {
            assert!(node.cordoned && node.cordoned_by_keel);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "drain not completed: {node:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A snapshot taken while the guest runs, more writes, then a restore: the
/// guest's disk holds what it held at the snapshot, and the VM, running
/// before, runs after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_brings_back_the_snapshot_data_and_the_power_state() {
    let Some(env) = Env::new().await else { return };
    env.create(
        "db",
        Env::spec(RunPolicy::AlwaysOnUnlessStoppedManually, 30),
    )
    .await;
    let (first, mut guest) = env.ready("db", BOOT).await;
    guest.put(1, "in the snapshot").await.unwrap();
    let snap = env.take_snapshot("db", "nightly").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{snap:?}");
    assert!(snap.status.live);
    guest.put(1, "after the snapshot").await.unwrap();

    let now = keel_api::Clock::now_ms(&keel_api::SystemClock);
    env.user("db", move |vm| vm.request_restore("nightly", now))
        .await;
    let vm = env
        .wait_for("db", BOOT, "restored and running", |vm| {
            vm.restore.is_none()
                && vm.status.phase == Phase::Running
                && vm.status.instance.as_ref().is_some_and(|i| i.id != first)
        })
        .await;
    assert_eq!(vm.spec.power, PowerState::Running);
    let (_, mut guest) = env.ready("db", BOOT).await;
    assert_eq!(guest.get(1).await.unwrap(), "in the snapshot");
    let vm = env
        .wait_for(
            "db",
            Duration::from_secs(30),
            "intent converted",
            |vm: &VirtualMachine| vm.power_intent.is_none(),
        )
        .await;
    assert_eq!(vm.status.phase, Phase::Running);
}

async fn node(env: &Env, name: &str) -> Node {
    env.store
        .get::<Node>(&node_key(name))
        .await
        .unwrap()
        .unwrap()
        .value
}

async fn update_node(env: &Env, name: &str, f: impl Fn(&mut Node)) {
    qemu::cas::update(&env.store, &node_key(name), f).await
}
