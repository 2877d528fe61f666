//! Disks are made per disk, and changes that wait for a restart are shown:
//! on the sim driver and a manual clock. A disk added to a VM that ran is
//! made at its next start (alone: the used one must exist, never made
//! blank); a used disk lost, or dropped from the spec and added back, fails
//! the start with the reason on the record; records from before per-disk
//! records read safely; `status.restart_required` names CPU and memory
//! changes of a running VM until a restart.

mod common;

use common::{spec, World};
use keel_api::{DiskSpec, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_ctrl::keys::vm_key;
use keel_hv::sim::SimConfig;
use keel_store::Precondition;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 2_000,
        ..Default::default()
    }
}

fn disk(name: &str) -> DiskSpec {
    DiskSpec {
        name: name.into(),
        size_mib: 64,
        image: None,
    }
}

/// A Manual VM `name` that ran on its disk `root` (a record written by its
/// guest) and was stopped.
async fn ran_and_stopped(w: &mut World, name: &str) -> VirtualMachine {
    w.create(name, spec(RunPolicy::Manual, PowerState::Running, 10))
        .await;
    w.run_for(3_000).await;
    assert_eq!(w.get(name).await.unwrap().status.phase, Phase::Running);
    w.hv.guest_write(name, 1, "the VM's data").unwrap();
    w.user_op(name, VirtualMachine::request_stop).await.unwrap();
    w.run_for(5_000).await;
    let vm = w.get(name).await.unwrap();
    assert_eq!(vm.status.phase, Phase::Stopped, "{vm:?}");
    vm
}

async fn replace_disks(w: &mut World, name: &str, disks: Vec<DiskSpec>) {
    w.user_op(name, |vm| {
        let mut s = vm.spec.clone();
        s.disks = disks.clone();
        vm.replace_spec(s)
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_disk_added_to_a_vm_that_ran_is_made_at_its_next_start() {
    let mut w = World::new(1, sim()).await;
    let before = ran_and_stopped(&mut w, "d1").await;
    let root = before.status.disks.clone().unwrap();
    assert!(root.len() == 1 && root[0].used, "{root:?}");

    replace_disks(&mut w, "d1", vec![disk("root"), disk("extra")]).await;
    w.user_op("d1", VirtualMachine::request_start)
        .await
        .unwrap();
    let asked = w.now();
    w.run_for(3_000).await;
    let vm = w.get("d1").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    assert!(w.hv.has_disk("d1", "extra"));
    assert_eq!(
        w.hv.disk_record("d1", 1).as_deref(),
        Some("the VM's data"),
        "root is the old disk, not a blank one"
    );
    let records = vm.status.disks.unwrap();
    let find = |n: &str| records.iter().find(|r| r.name == n).unwrap().clone();
    assert_eq!(find("root"), root[0], "root's record is unchanged");
    let extra = find("extra");
    assert!(extra.used, "the new instance ran on it: {extra:?}");
    assert!(extra.made_at.is_some_and(|t| t >= asked), "{extra:?}");
    assert_eq!(Some(extra.home), vm.status.disk_home);
}

#[tokio::test]
async fn a_used_disk_that_is_gone_is_never_made_blank() {
    let mut w = World::new(2, sim()).await;
    ran_and_stopped(&mut w, "d2").await;
    // Deleted behind Keel's back (or its storage is not mounted), while
    // a new disk waits to be made: the start makes neither.
    w.hv.lose_disk("d2", "root");
    replace_disks(&mut w, "d2", vec![disk("root"), disk("extra")]).await;
    w.user_op("d2", VirtualMachine::request_start)
        .await
        .unwrap();
    w.run_for(3_000).await;
    let vm = w.get("d2").await.unwrap();
    assert_ne!(vm.status.phase, Phase::Running, "{vm:?}");
    assert!(!w.hv.has_disk("d2", "root") && !w.hv.has_disk("d2", "extra"));
    let why = vm.status.message.clone().unwrap_or_default();
    assert!(
        why.contains("disk root of VM d2 is missing"),
        "the reason is on the record: {vm:?}"
    );
}

/// A disk dropped from the spec keeps its record once it was used, so the
/// same name added back means that disk: if it is gone, the start fails.
#[tokio::test]
async fn a_used_disk_dropped_and_added_back_must_still_exist() {
    let mut w = World::new(3, sim()).await;
    ran_and_stopped(&mut w, "d3").await;
    replace_disks(&mut w, "d3", vec![disk("other")]).await;
    w.user_op("d3", VirtualMachine::request_start)
        .await
        .unwrap();
    w.run_for(3_000).await;
    assert_eq!(w.get("d3").await.unwrap().status.phase, Phase::Running);
    w.user_op("d3", VirtualMachine::request_stop).await.unwrap();
    w.run_for(5_000).await;
    let vm = w.get("d3").await.unwrap();
    let names: Vec<&str> = vm
        .status
        .disks
        .as_ref()
        .unwrap()
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    assert_eq!(names, ["root", "other"], "root's record stays");

    w.hv.lose_disk("d3", "root");
    replace_disks(&mut w, "d3", vec![disk("root"), disk("other")]).await;
    w.user_op("d3", VirtualMachine::request_start)
        .await
        .unwrap();
    w.run_for(3_000).await;
    let vm = w.get("d3").await.unwrap();
    assert_ne!(vm.status.phase, Phase::Running, "{vm:?}");
    assert!(!w.hv.has_disk("d3", "root"), "made blank");
    assert!(vm
        .status
        .message
        .unwrap_or_default()
        .contains("disk root of VM d3 is missing"));
}

/// A stopped VM as the release before per-disk records stored it.
fn legacy_record(disks_used: bool) -> Vec<u8> {
    format!(
        r#"{{"name":"old","generation":3,
        "spec":{{"cpus":1,"memory_mib":128,"disks":[{{"name":"root","size_mib":64}}],
                 "boot":{{}},"run_policy":"Manual","power":"Stopped","restart_generation":0,
                 "stop_grace_period_s":10}},
        "status":{{"phase":"Stopped","observed_generation":3,"observed_restart_generation":0,
                   "instance_seq":1,"failed_starts":0,"migration_seq":0,
                   "disk_home":{{"node":"local"}},"disks_used":{disks_used}}}}}"#
    )
    .into_bytes()
}

/// `disks_used: true` means every disk its spec names was made and used:
/// one that is not there fails the start. `false`: none was used, and the
/// start makes it.
#[tokio::test]
async fn records_from_before_per_disk_records_read_safely() {
    for used in [true, false] {
        let mut w = World::new(4, sim()).await;
        w.register_node().await;
        w.raw
            .put(&vm_key("old"), legacy_record(used), Precondition::Absent)
            .await
            .unwrap();
        w.run_for(1_000).await;
        let vm = w.get("old").await.unwrap();
        // Read once and kept: the disks the spec names now.
        let records = vm.status.disks.clone().unwrap_or_default();
        assert_eq!(
            records.iter().map(|r| r.used).collect::<Vec<_>>(),
            if used { vec![true] } else { vec![] },
            "{vm:?}"
        );
        w.user_op("old", VirtualMachine::request_start)
            .await
            .unwrap();
        w.run_for(3_000).await;
        let vm = w.get("old").await.unwrap();
        if used {
            assert_ne!(vm.status.phase, Phase::Running, "{vm:?}");
            assert!(!w.hv.has_disk("old", "root"), "made blank");
            assert!(vm.status.message.unwrap_or_default().contains("missing"));
        } else {
            assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
            assert!(w.hv.has_disk("old", "root"));
        }
    }
}

#[tokio::test]
async fn cpu_and_memory_changes_of_a_running_vm_wait_for_a_restart() {
    let mut w = World::new(5, sim()).await;
    w.create("r1", spec(RunPolicy::Manual, PowerState::Running, 10))
        .await;
    w.run_for(3_000).await;
    let vm = w.get("r1").await.unwrap();
    assert!(vm.status.restart_required.is_empty(), "{vm:?}");
    let first = vm.status.instance.unwrap();
    assert_eq!(first.started_with.as_ref().unwrap().cpus, 1);

    w.user_op("r1", |vm| {
        let mut s = vm.spec.clone();
        s.cpus = 2;
        s.memory_mib = 256;
        s.stop_grace_period_s = 20;
        vm.replace_spec(s)
    })
    .await
    .unwrap();
    w.run_for(500).await;
    let vm = w.get("r1").await.unwrap();
    assert_eq!(vm.status.restart_required, ["cpus", "memory"]);
    assert_eq!(vm.status.instance.as_ref().unwrap().id, first.id);

    // Put back as it was: nothing waits.
    w.user_op("r1", |vm| {
        let mut s = vm.spec.clone();
        s.memory_mib = 128;
        vm.replace_spec(s)
    })
    .await
    .unwrap();
    w.run_for(500).await;
    assert_eq!(w.get("r1").await.unwrap().status.restart_required, ["cpus"]);

    w.user_op("r1", VirtualMachine::request_restart)
        .await
        .unwrap();
    w.run_for(8_000).await;
    let vm = w.get("r1").await.unwrap();
    let second = vm.status.instance.clone().unwrap();
    assert_ne!(second.id, first.id);
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    assert!(vm.status.restart_required.is_empty(), "{vm:?}");
    assert_eq!(second.started_with.unwrap().cpus, 2);
}
