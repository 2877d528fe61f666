//! Disks grown under a running guest, on the sim driver and a manual clock:
//! the same instance goes on with the larger disk, the size is recorded on
//! it and an event says so; a growth the hypervisor refuses is retried with
//! its reason on the record and recorded only once it worked.

mod common;

use common::{spec, World};
use keel_api::{Phase, PowerState, RunPolicy};
use keel_hv::sim::SimConfig;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        agent_ready_ms: 1_000,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_running_vms_disk_grows_in_the_same_instance() {
    let mut w = World::new(7, sim()).await;
    w.create("web", spec(RunPolicy::AlwaysOn, PowerState::Running, 10))
        .await;
    w.run_for(4_000).await;
    let before = w.get("web").await.unwrap();
    let first = before.status.instance.clone().unwrap();
    assert_eq!(before.status.phase, Phase::Running);
    assert_eq!(first.disk_sizes_mib["root"], 64);
    assert_eq!(w.hv.disk_size_mib(&first.id, "root"), Some(64));

    w.user_op("web", |v| {
        v.resize_disk("root", 256).map_err(|e| e.error().clone())
    })
    .await
    .unwrap();
    w.run_for(1_000).await;
    let vm = w.get("web").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, first.id, "the same instance");
    assert_eq!(w.hv.live_instances("web"), std::slice::from_ref(&first.id));
    assert_eq!(w.hv.disk_size_mib(&first.id, "root"), Some(256));
    assert_eq!(inst.disk_sizes_mib["root"], 256);
    assert!(vm.status.restart_required.is_empty(), "{vm:?}");
    assert_eq!(vm.ready_since(), before.ready_since(), "the guest went on");
    let trail = w.event_reasons("web").await;
    assert!(
        trail
            .iter()
            .any(|e| e.contains("grown under the running guest")
                && e.contains("disk root from 64 MiB to 256 MiB")),
        "{trail:?}"
    );
}

#[tokio::test]
async fn a_refused_growth_shows_why_is_retried_and_recorded_only_once_done() {
    let mut w = World::new(8, sim()).await;
    w.create("db", spec(RunPolicy::AlwaysOn, PowerState::Running, 10))
        .await;
    w.run_for(4_000).await;
    let first = w.get("db").await.unwrap().status.instance.unwrap();
    w.hv.refuse_disk_changes(&first.id, Some("block_resize: device busy"));

    w.user_op("db", |v| {
        v.resize_disk("root", 128).map_err(|e| e.error().clone())
    })
    .await
    .unwrap();
    w.run_for(5_000).await;
    let vm = w.get("db").await.unwrap();
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(inst.id, first.id);
    assert_eq!(inst.disk_sizes_mib["root"], 64, "not recorded: not done");
    assert_eq!(w.hv.disk_size_mib(&first.id, "root"), Some(64));
    let message = vm.status.message.clone().unwrap_or_default();
    assert!(message.contains("block_resize: device busy"), "{vm:?}");
    assert_eq!(vm.status.phase, Phase::Running, "the guest runs on");

    w.hv.refuse_disk_changes(&first.id, None);
    w.run_for(60_000).await;
    let vm = w.get("db").await.unwrap();
    assert!(
        !vm.status
            .message
            .clone()
            .unwrap_or_default()
            .contains("busy"),
        "the old reason is gone once done: {vm:?}"
    );
    assert_eq!(vm.status.instance.unwrap().disk_sizes_mib["root"], 128);
    assert_eq!(w.hv.disk_size_mib(&first.id, "root"), Some(128));
}
