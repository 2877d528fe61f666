//! A rolling upgrade, with a fixture of the previous release's records
//! (as Keel at commit dc86783 wrote them: no schema version, no disk home,
//! no incarnation) and one record from a newer Keel (fields this one does
//! not know), on one store. The current controllers adopt the old release's
//! running guest without a restart, restart it on its own disks (never
//! creating blank ones: the old record says it ran), place the newer
//! record's VM, and keep the nodes' heartbeats going.

mod cluster;

use cluster::{sim, Cluster};
use keel_api::{Phase, VirtualMachine};
use keel_ctrl::keys::{node_key, vm_key};
use keel_hv::{DomainSpec, Hypervisor};
use keel_store::Precondition;

/// `/vms/legacy` as the previous release stored it: running on node a as
/// instance legacy-1.
fn legacy_vm(now: u64) -> Vec<u8> {
    format!(
        r#"{{"name":"legacy","generation":1,
        "spec":{{"cpus":1,"memory_mib":128,"disks":[{{"name":"root","size_mib":64}}],
                 "boot":{{}},"run_policy":"AlwaysOn","power":"Running","restart_generation":0,
                 "stop_grace_period_s":30}},
        "status":{{"phase":"Running","observed_generation":1,
                   "instance":{{"id":"legacy-1","node":"a","created_at":{now},"running_since":{now}}},
                   "observed_restart_generation":0,"instance_seq":1,"failed_starts":0,
                   "node":"a","migration_seq":0}}}}"#
    )
    .into_bytes()
}

/// `/vms/future` as a newer Keel might write it.
fn future_vm() -> Vec<u8> {
    br#"{"name":"future","generation":1,"schema_version":9,"added_later":{"x":1},
        "spec":{"cpus":1,"memory_mib":128,"disks":[],"boot":{},"run_policy":"AlwaysOn",
                "power":"Running","restart_generation":0,"stop_grace_period_s":30,
                "also_new":true},
        "status":{}}"#
        .to_vec()
}

#[tokio::test]
async fn records_of_the_previous_and_a_newer_release_keep_working() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.add_node("b").await;
    // The old release's guest, still running on a.
    c.agents[0]
        .hv
        .start(&DomainSpec {
            vm: "legacy".into(),
            instance: "legacy-1".into(),
            cpus: 1,
            memory_mib: 128,
            disks: vec![keel_api::DiskSpec {
                name: "root".into(),
                size_mib: 64,
                image: None,
            }],
            boot: Default::default(),
            create_disks: keel_hv::DiskCreation::Only(vec!["root".into()]),
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
        })
        .await
        .unwrap();
    c.agents[0]
        .hv
        .guest_write("legacy", 3, "from the old release")
        .unwrap();
    let raw = c.store.raw().clone();
    raw.put(&vm_key("legacy"), legacy_vm(c.now()), Precondition::Absent)
        .await
        .unwrap();
    raw.put(&vm_key("future"), future_vm(), Precondition::Absent)
        .await
        .unwrap();
    // Node a's record as the old release wrote it (no disk home, no
    // incarnation): the new agent's heartbeat fills them in.
    let old_node = format!(
        r#"{{"name":"a","cordoned":false,"cordoned_by_keel":false,"status":{{"last_heartbeat":{}}}}}"#,
        c.now()
    );
    let current = raw.get(&node_key("a")).await.unwrap().unwrap();
    raw.put(
        &node_key("a"),
        old_node.into_bytes(),
        Precondition::Revision(current.mod_revision),
    )
    .await
    .unwrap();

    c.run(10_000).await;
    let legacy = c.vm("legacy").await;
    assert_eq!(legacy.status.phase, Phase::Running, "{legacy:?}");
    assert_eq!(
        legacy.status.instance.as_ref().unwrap().id,
        "legacy-1",
        "adopted, not restarted"
    );
    let future = c.vm("future").await;
    assert_eq!(future.status.phase, Phase::Running, "{future:?}");
    assert!(c.node("a").await.status.last_heartbeat > 0);
    assert!(c.node("a").await.status.disk_home.is_some());

    // A restart after the upgrade: the new instance needs the old disks and
    // gets them; no blank disk, the guest's record is there.
    c.update_vm("legacy", |v: &mut VirtualMachine| {
        v.request_restart().unwrap();
    })
    .await;
    c.run(20_000).await;
    let legacy = c.vm("legacy").await;
    assert_eq!(legacy.status.phase, Phase::Running, "{legacy:?}");
    assert_ne!(legacy.status.instance.as_ref().unwrap().id, "legacy-1");
    // The old record said it ran: its disk is read as made and used.
    let records = legacy.status.disks.clone().unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(records[0].name == "root" && records[0].used && records[0].made_at.is_none());
    assert!(
        legacy.status.disks_used,
        "still set for builds before per-disk records"
    );
    assert_eq!(
        c.agents[0].hv.disk_record("legacy", 3).as_deref(),
        Some("from the old release")
    );

    // A disk added after the upgrade is new: the next start makes it, and
    // only it.
    c.update_vm("legacy", |v: &mut VirtualMachine| {
        let mut spec = v.spec.clone();
        spec.disks.push(keel_api::DiskSpec {
            name: "extra".into(),
            size_mib: 64,
            image: None,
        });
        v.replace_spec(spec).unwrap();
        v.request_restart().unwrap();
    })
    .await;
    c.run(20_000).await;
    let legacy = c.vm("legacy").await;
    assert_eq!(legacy.status.phase, Phase::Running, "{legacy:?}");
    assert!(c.agents[0].hv.has_disk("legacy", "extra"));
    let extra = legacy.status.disks.as_ref().unwrap();
    assert!(extra.iter().all(|r| r.used), "{extra:?}");
    assert_eq!(
        c.agents[0].hv.disk_record("legacy", 3).as_deref(),
        Some("from the old release")
    );
}
