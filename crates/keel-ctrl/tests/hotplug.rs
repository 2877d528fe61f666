//! Disks plugged into a running VM, on the sim driver and a manual clock:
//! the same instance goes on with the disk on a root port, the plug is
//! recorded before the node is asked and confirmed after; a plug the node
//! refuses stays recorded (the disk's record made, never used) with the
//! reason shown, and completes once the node can; more disks than spare
//! ports wait for the next start, which has them all. A plugged disk
//! dropped from the spec is unplugged from the same instance once the
//! guest lets go of it; one the instance started with waits for a restart.

mod common;

use common::{spec, World};
use keel_api::{DiskSpec, Phase, PowerState, RunPolicy, HOTPLUG_PORTS};
use keel_hv::sim::{SimConfig, UNPLUG_RELEASE_MS};

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        agent_ready_ms: 1_000,
        ..Default::default()
    }
}

fn disk(name: &str) -> DiskSpec {
    DiskSpec {
        name: name.into(),
        size_mib: 32,
        image: None,
    }
}

async fn running(w: &mut World, name: &str) -> String {
    w.create(name, spec(RunPolicy::AlwaysOn, PowerState::Running, 10))
        .await;
    w.run_for(4_000).await;
    let vm = w.get(name).await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running);
    vm.status.instance.unwrap().id
}

#[tokio::test]
async fn a_disk_added_to_a_running_vm_is_plugged_into_the_same_instance() {
    let mut w = World::new(11, sim()).await;
    let first = running(&mut w, "web").await;
    w.user_op("web", |v| {
        v.add_disk(disk("data")).map_err(|e| e.error().clone())
    })
    .await
    .unwrap();
    w.run_for(1_000).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, first, "the same instance");
    assert_eq!(w.hv.live_instances("web"), std::slice::from_ref(&first));
    assert_eq!(
        w.hv.attached_disks(&first).unwrap(),
        ["root", "data"],
        "attached to the running domain"
    );
    assert_eq!(inst.plugged.len(), 1);
    assert!(inst.plugged[0].attached_at.is_some(), "{inst:?}");
    let record = vm.status.disks.clone().unwrap();
    assert!(
        record.iter().any(|d| d.name == "data" && d.used),
        "{record:?}"
    );
    assert!(vm.status.restart_required.is_empty(), "{vm:?}");
    let trail = w.event_reasons("web").await;
    assert!(
        trail
            .iter()
            .any(|e| e.contains("plugged into the running guest")
                && e.contains("disk data on root port 0")),
        "{trail:?}"
    );

    // Removed from the spec: unplugged from the same instance, recorded
    // first and taken off only once the guest let go of it.
    w.user_op("web", |v| {
        v.remove_disk("data")
            .map(|_| ())
            .map_err(|e| e.error().clone())
    })
    .await
    .unwrap();
    w.run_for(UNPLUG_RELEASE_MS / 2).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert!(
        inst.plugged[0].detach_requested_at.is_some(),
        "recorded first: {inst:?}"
    );
    assert_eq!(
        w.hv.attached_disks(&first).unwrap(),
        ["root", "data"],
        "the guest has not let go yet"
    );
    assert!(
        vm.status
            .message
            .clone()
            .unwrap_or_default()
            .contains("waiting for the guest to let go"),
        "{vm:?}"
    );
    w.run_for(UNPLUG_RELEASE_MS * 2).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, first, "the same instance");
    assert!(inst.plugged.is_empty(), "taken off: {inst:?}");
    assert_eq!(inst.free_port(), Some(0));
    assert_eq!(w.hv.attached_disks(&first).unwrap(), ["root"]);
    assert!(vm.status.restart_required.is_empty(), "{vm:?}");
    let trail = w.event_reasons("web").await;
    assert!(
        trail
            .iter()
            .any(|e| e.contains("unplugged from the running guest")
                && e.contains("disk data from root port 0")),
        "{trail:?}"
    );
    let record = vm.status.disks.clone().unwrap();
    assert!(
        record.iter().any(|d| d.name == "data" && d.used),
        "the disk's record stays: {record:?}"
    );

    // Added back under its name: that disk, plugged again.
    w.user_op("web", |v| {
        v.add_disk(disk("data")).map_err(|e| e.error().clone())
    })
    .await
    .unwrap();
    w.run_for(1_000).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.unwrap();
    assert_eq!(inst.id, first);
    assert!(inst.plugged[0].attached_at.is_some(), "{inst:?}");
    assert_eq!(w.hv.attached_disks(&first).unwrap(), ["root", "data"]);
}

#[tokio::test]
async fn a_disk_the_vm_started_with_goes_at_the_next_start() {
    let mut w = World::new(14, sim()).await;
    w.create("two", {
        let mut s = spec(RunPolicy::AlwaysOn, PowerState::Running, 10);
        s.disks.push(disk("logs"));
        s
    })
    .await;
    w.run_for(4_000).await;
    let first = w.get("two").await.unwrap().status.instance.unwrap().id;
    w.user_op("two", |v| {
        v.remove_disk("logs")
            .map(|_| ())
            .map_err(|e| e.error().clone())
    })
    .await
    .unwrap();
    w.run_for(5_000).await;
    let vm = w.get("two").await.unwrap();
    assert_eq!(vm.status.instance.as_ref().unwrap().id, first);
    assert_eq!(
        w.hv.attached_disks(&first).unwrap(),
        ["root", "logs"],
        "on the root complex: no unplug"
    );
    assert_eq!(vm.status.restart_required, ["disks"]);
}

#[tokio::test]
async fn a_refused_plug_stays_recorded_and_completes_once_the_node_can() {
    let mut w = World::new(12, sim()).await;
    let first = running(&mut w, "db").await;
    w.hv.refuse_disk_changes(&first, Some("device_add: bus keel-hp0 busy"));
    w.user_op("db", |v| {
        v.add_disk(disk("wal")).map_err(|e| e.error().clone())
    })
    .await
    .unwrap();
    w.run_for(5_000).await;
    let vm = w.get("db").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, first);
    assert_eq!(inst.plugged.len(), 1, "recorded before it was asked");
    assert_eq!(inst.plugged[0].attached_at, None, "not confirmed: not done");
    let record = vm.status.disks.clone().unwrap();
    let wal = record.iter().find(|d| d.name == "wal").unwrap();
    assert!(!wal.used && wal.made_at.is_some(), "{record:?}");
    assert!(
        vm.status
            .message
            .clone()
            .unwrap_or_default()
            .contains("keel-hp0 busy"),
        "{vm:?}"
    );
    assert_eq!(w.hv.attached_disks(&first).unwrap(), ["root"]);

    w.hv.refuse_disk_changes(&first, None);
    w.run_for(60_000).await;
    let vm = w.get("db").await.unwrap();
    let inst = vm.status.instance.unwrap();
    assert!(inst.plugged[0].attached_at.is_some(), "{inst:?}");
    assert_eq!(inst.plugged[0].port, 0, "the port it was recorded on");
    assert_eq!(w.hv.attached_disks(&first).unwrap(), ["root", "wal"]);
}

#[tokio::test]
async fn more_disks_than_spare_ports_wait_for_the_next_start() {
    let mut w = World::new(13, sim()).await;
    let first = running(&mut w, "app").await;
    let names: Vec<String> = (0..=HOTPLUG_PORTS).map(|i| format!("d{i}")).collect();
    for name in &names {
        let name = name.clone();
        w.user_op("app", move |v| {
            v.add_disk(disk(&name)).map_err(|e| e.error().clone())
        })
        .await
        .unwrap();
    }
    w.run_for(5_000).await;
    let vm = w.get("app").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, first);
    assert_eq!(inst.plugged.len() as u32, HOTPLUG_PORTS);
    assert!(inst.plugged.iter().all(|p| p.attached_at.is_some()));
    assert_eq!(vm.status.restart_required, ["disks"], "one is left over");

    w.user_op("app", |v| v.request_restart()).await.unwrap();
    w.run_for(30_000).await;
    let vm = w.get("app").await.unwrap();
    let inst = vm.status.instance.unwrap();
    assert_ne!(inst.id, first);
    assert!(
        inst.plugged.is_empty(),
        "all on the root complex from the start"
    );
    assert_eq!(
        w.hv.attached_disks(&inst.id).unwrap().len(),
        names.len() + 1
    );
    assert!(vm.status.restart_required.is_empty());
}
