//! Migrations belong to one VM, not to a name: their ids carry the VM's
//! uid, they are deleted with the VM, and only the VM they were made for,
//! from the instance they were made from, adopts one. A migration that
//! never started settles (Failed, with the reason), so a VM whose source
//! node died mid-handoff is recovered.

mod cluster;

use cluster::Cluster;
use keel_api::{Migration, MigrationPhase, MigrationStatus, MigrationTuning, RunPolicy};
use keel_ctrl::keys::migration_key;
use keel_ctrl::LifecycleConfig;

fn lease_ms() -> u64 {
    LifecycleConfig::default().node_lease_ms
}

/// Drain a: `vm` migrates to b. Returns the migration.
async fn migrate_off_a(c: &mut Cluster) -> Migration {
    c.drain("a").await;
    c.run(15_000).await;
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1, "{ms:?}");
    ms[0].clone()
}

/// Delete and create again under the same name: the old migration records
/// are gone with the old VM, and the new VM's first migration has an id of
/// its own.
#[tokio::test]
async fn migration_ids_are_unique_across_delete_and_recreate_and_go_with_the_vm() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    let first = migrate_off_a(&mut c).await;
    let old_uid = c.vm("vm").await.uid;
    assert_eq!(first.vm_uid, old_uid);
    assert!(first.id.contains(&old_uid), "{}", first.id);

    let now = c.now();
    c.update_vm("vm", |v| {
        v.deletion_requested_at.get_or_insert(now);
    })
    .await;
    let mut gone = false;
    for _ in 0..200 {
        c.tick().await;
        if c.store
            .get::<keel_api::VirtualMachine>("/vms/vm")
            .await
            .unwrap()
            .is_none()
        {
            gone = true;
            break;
        }
    }
    assert!(gone, "not deleted: {}", c.explain("vm").await);
    assert!(
        c.migrations_of("vm").await.is_empty(),
        "migrations outlived their VM"
    );

    c.update_node("a", |n| {
        n.uncordon_by_keel();
    })
    .await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(5_000).await;
    let vm = c.vm("vm").await;
    assert_ne!(vm.uid, old_uid);
    let owner = vm.status.instance.unwrap().node;
    c.drain(&owner).await;
    c.run(15_000).await;
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1, "{ms:?}");
    assert_ne!(ms[0].id, first.id);
    assert_eq!(ms[0].vm_uid, vm.uid);
}

/// A migration record left by an earlier VM of the same name, from an
/// instance of the same name as the new VM's (instance ids restart at 1),
/// marked Succeeded: when the new VM's node is lost, the takeover does not
/// adopt its target, which is not this VM's guest.
#[tokio::test]
async fn a_vm_never_adopts_a_migration_of_an_earlier_vm_of_its_name() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    let vm = c.vm("vm").await;
    let inst = vm.status.instance.clone().unwrap();
    let stray = Migration {
        id: Migration::id_for("vm", "00000000000000aa", 3),
        vm: "vm".into(),
        vm_uid: "00000000000000aa".into(),
        source_node: "a".into(),
        source_instance: inst.id.clone(),
        target_node: "b".into(),
        target_instance: "vm-99".into(),
        created_at: c.now(),
        tuning: MigrationTuning::default(),
        status: MigrationStatus {
            phase: MigrationPhase::Succeeded,
            finished_at: Some(c.now()),
            ..Default::default()
        },
    };
    c.store
        .create(&migration_key("vm", &stray.id), &stray)
        .await
        .unwrap();
    c.agents[0].running = false;
    c.agents[0].hv.power_failure();
    c.run(lease_ms() + 15_000).await;
    let vm = c.vm("vm").await;
    let now = vm.status.instance.clone().unwrap();
    assert_ne!(
        now.id, "vm-99",
        "adopted another VM's migration: {:?}",
        vm.status
    );
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    let exit = vm.status.last_exit.unwrap();
    assert_eq!(exit.instance, inst.id);
    assert!(exit.reason.unwrap().contains("lost its lease"));
}

/// The source's node loses power after the target got ready and before
/// anything was sent: the target's agent settles the migration as Failed
/// (the source is fenced, nothing more will come), and the VM is taken
/// over and runs on b instead of waiting for ever.
#[tokio::test]
async fn a_migration_whose_source_died_before_sending_settles_and_the_vm_recovers() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.agents[0].migrations_stuck = true;
    c.drain("a").await;
    let mut ready = false;
    for _ in 0..40 {
        c.tick().await;
        let ms = c.migrations_of("vm").await;
        if ms
            .iter()
            .any(|m| m.status.phase == MigrationPhase::TargetReady)
        {
            ready = true;
            break;
        }
    }
    assert!(ready, "{}", c.explain("vm").await);
    c.agents[0].running = false;
    c.agents[0].hv.power_failure();
    c.run(lease_ms() + 30_000).await;
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1);
    assert_eq!(ms[0].status.phase, MigrationPhase::Failed, "{:?}", ms[0]);
    let why = ms[0].status.message.clone().unwrap_or_default();
    assert!(why.contains("source node a lost"), "{why}");
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
}
