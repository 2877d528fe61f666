//! A clone on the sim driver and a manual clock: made from a snapshot of a
//! running VM, its first start copies the source's disks as the snapshot
//! holds them (a write after the snapshot is not in the copy), with a MAC
//! of its own; the source runs on untouched. A clone whose snapshot is
//! gone before its first start fails that start with the reason and gets
//! no blank disks.

mod common;

use common::{spec, World};
use keel_api::{Phase, PowerState, RunPolicy, SnapshotPhase};
use keel_ctrl::keys::{snapshot_key, vm_key};
use keel_hv::sim::SimConfig;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        agent_ready_ms: 1_000,
        ..Default::default()
    }
}

async fn running_with_snapshot(w: &mut World) -> keel_api::VirtualMachine {
    let mut s = spec(RunPolicy::AlwaysOn, PowerState::Running, 10);
    s.assign_identity([3; 12]);
    w.create("src", s).await;
    w.run_for(4_000).await;
    let vm = w.get("src").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running);
    w.hv.guest_write("src", 1, "before the snapshot").unwrap();
    let snap = w.take_snapshot("src", "s1").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready, "{snap:?}");
    assert!(snap.status.live, "taken from the running guest");
    w.hv.guest_write("src", 2, "after the snapshot").unwrap();
    w.get("src").await.unwrap()
}

async fn snapshot(w: &World) -> keel_api::Snapshot {
    w.user
        .get::<keel_api::Snapshot>(&snapshot_key("src", "s1"))
        .await
        .unwrap()
        .unwrap()
        .value
}

#[tokio::test]
async fn a_clone_starts_on_copies_of_the_disks_at_the_snapshot() {
    let mut w = World::new(21, sim()).await;
    let src = running_with_snapshot(&mut w).await;
    let snap = snapshot(&w).await;
    let clone = src
        .clone_at("copy", &snap, PowerState::Running, [4; 12])
        .unwrap();
    w.user.create(&vm_key("copy"), &clone).await.unwrap();
    w.run_for(5_000).await;

    let copy = w.get("copy").await.unwrap();
    assert_eq!(copy.status.phase, Phase::Running, "{copy:?}");
    assert_eq!(
        w.hv.disk_record("copy", 1).as_deref(),
        Some("before the snapshot")
    );
    assert_eq!(
        w.hv.disk_record("copy", 2),
        None,
        "written after the snapshot"
    );
    assert_ne!(copy.spec.network.mac, src.spec.network.mac);
    assert_eq!(copy.status.clone_from.as_ref().unwrap().snapshot, "s1");
    let record = copy.status.disks.clone().unwrap();
    assert!(record.iter().all(|d| d.used), "{record:?}");
    // The source runs on, its disks its own.
    let src_now = w.get("src").await.unwrap();
    assert_eq!(
        src_now.status.instance.unwrap().id,
        src.status.instance.unwrap().id
    );
    assert_eq!(
        w.hv.disk_record("src", 2).as_deref(),
        Some("after the snapshot")
    );
    w.check_no_untracked_instances().await.unwrap();
}

#[tokio::test]
async fn a_clone_whose_snapshot_is_gone_gets_no_blank_disks() {
    let mut w = World::new(22, sim()).await;
    let src = running_with_snapshot(&mut w).await;
    let mut snap = snapshot(&w).await;
    let clone = src
        .clone_at("orphan", &snap, PowerState::Running, [5; 12])
        .unwrap();
    // The snapshot is deleted before the clone's first start.
    snap.deletion_requested_at = Some(w.now());
    let entry = w
        .user
        .get::<keel_api::Snapshot>(&snapshot_key("src", "s1"))
        .await
        .unwrap()
        .unwrap();
    w.user
        .update(&snapshot_key("src", "s1"), &snap, entry.revision)
        .await
        .unwrap();
    w.run_for(5_000).await;
    assert!(!w.hv.has_snapshot("src", "s1"), "deleted from the disks");
    w.user.create(&vm_key("orphan"), &clone).await.unwrap();
    w.run_for(10_000).await;
    let orphan = w.get("orphan").await.unwrap();
    assert_ne!(orphan.status.phase, Phase::Running, "{orphan:?}");
    let why = format!(
        "{:?} {:?}",
        orphan.status.message,
        orphan
            .status
            .last_exit
            .as_ref()
            .and_then(|e| e.reason.clone())
    );
    assert!(
        why.contains("snapshot s1") && why.contains("no blank disk"),
        "{why}"
    );
    assert!(!w.hv.has_disk("orphan", "root"), "no blank disk made");
}
