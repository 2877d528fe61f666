//! The hand-over of a running VM to another node, shared by the two
//! decisions that move one (a drain's eviction, `evict_decide`, and a
//! user's `vm migrate`, `user_migrate_decide`): reserving and creating the
//! migration, the VM record once the target runs the guest, and why there
//! is no target.

use keel_api::{Instance, Migration, MigrationStatus, Millis, Phase, VirtualMachine};

use crate::step::{persist_if_changed, HvAction, Step};
use crate::view::ClusterView;

/// `vm` after migration `m` handed it over: the target is its instance.
pub(crate) fn migrated(vm: &VirtualMachine, m: &Migration, now: Millis) -> VirtualMachine {
    let mut next = vm.clone();
    // The guest moved, it did not boot again: it is as ready as it was
    // (its console log, which a console readiness check reads, stayed
    // with the source).
    let source = vm
        .status
        .instance
        .as_ref()
        .filter(|i| i.id == m.source_instance);
    let readiness = source.and_then(|i| i.readiness.clone());
    next.status.instance = Some(Instance {
        running_since: Some(now),
        readiness,
        // The guest's hardware is the source's.
        started_with: source.and_then(|i| i.started_with.clone()),
        // Its disks are the source's, at the sizes the source had them,
        // plugged ones on the same ports (the target was launched so).
        disk_sizes_mib: source.map(|i| i.disk_sizes_mib.clone()).unwrap_or_default(),
        hotplug_ports: source.map_or(0, |i| i.hotplug_ports),
        plugged: source.map(|i| i.plugged.clone()).unwrap_or_default(),
        balloon: source.is_some_and(|i| i.balloon),
        resuming_after: Some(m.id.clone()),
        // As the target was launched (the migration controller's start).
        fenced: vm.instance_fenced(&m.source_instance),
        ..Instance::new(&m.target_instance, &m.target_node, m.created_at)
    });
    next.status.node = Some(m.target_node.clone());
    next.status.phase = Phase::Running;
    next.status.message = Some(format!(
        "migrated from node {} to node {} by migration {}",
        m.source_node, m.target_node, m.id
    ));
    if let Some(ev) = vm.status.eviction.as_ref().filter(|e| e.user) {
        next.status.migrate_outcome = Some(keel_api::MigrateOutcome {
            requested_at: ev.drain_requested_at,
            migration: Some(m.id.clone()),
            succeeded: true,
            message: format!(
                "{}{}",
                next.status.message.as_deref().unwrap_or_default(),
                m.status
                    .downtime_ms
                    .map(|d| format!(", downtime {d} ms"))
                    .unwrap_or_default()
            ),
        });
    }
    match vm.status.eviction.as_ref() {
        // The user chose where it runs now: not the drain's to return.
        Some(ev) if ev.user => next.status.drained_from = None,
        Some(ev) => next.mark_drained_from(&m.source_node, ev.drain_requested_at),
        None => {}
    }
    next.status.eviction = None;
    next
}

/// "no node to migrate to", and why when the view says (which nodes lack
/// room, which placement rule each other node breaks).
pub(crate) fn no_target(cluster: &ClusterView) -> String {
    match &cluster.no_target {
        Some(why) => format!("no node to migrate to: {why}"),
        None => "no node to migrate to".to_string(),
    }
}

/// Reserves the migration to `target` on the record (or reuses the
/// reservation) and creates it, with the drain's tuning.
pub(crate) fn reserve_and_create(
    vm: &VirtualMachine,
    inst: &Instance,
    target: &str,
    cluster: &ClusterView,
    now: Millis,
) -> Step {
    let mut next = vm.clone();
    let (id, target_instance) = match reservation(vm, inst) {
        Some(reserved) => reserved,
        None => {
            next.status.migration_seq += 1;
            let id = Migration::id_for(&vm.name, &vm.uid, next.status.migration_seq);
            let target_instance = next.mint_instance_id();
            let e = next.status.eviction.as_mut().expect("eviction present");
            e.migration = Some(id.clone());
            e.migration_source = Some(inst.id.clone());
            e.migration_target = Some(target_instance.clone());
            (id, target_instance)
        }
    };
    // Where the incoming instance takes room from now on (the same record
    // write as the reservation, so no placement meanwhile overlooks it).
    next.status
        .eviction
        .as_mut()
        .expect("eviction present")
        .migration_target_node = Some(target.to_string());
    let migration = Migration {
        id,
        vm: vm.name.clone(),
        vm_uid: vm.uid.clone(),
        source_node: inst.node.clone(),
        source_instance: inst.id.clone(),
        target_node: target.to_string(),
        target_instance,
        created_at: now,
        tuning: cluster.drain.as_ref().map(|d| d.tuning).unwrap_or_default(),
        status: MigrationStatus {
            // Within the eviction's submission window, which bounds it anyway.
            start_deadline: vm.status.eviction.as_ref().and_then(|e| e.submit_deadline),
            ..MigrationStatus::default()
        },
    };
    let create = HvAction::CreateMigration(Box::new(migration));
    persist_if_changed(vm, next, Some(create), now + 500)
}

/// The migration reserved on `vm`'s eviction and its target instance,
/// while the reservation holds: it was made from `inst`. One made from an
/// earlier instance (the VM restarted between the reservation and the
/// creation of the record) is void, and a new one is minted: re-created
/// from it, the migration moved the running instance to a target of its
/// own id.
fn reservation(vm: &VirtualMachine, inst: &Instance) -> Option<(String, String)> {
    let ev = vm.status.eviction.as_ref()?;
    let id = ev.migration.clone()?;
    let target = ev.migration_target.clone().unwrap_or_else(|| {
        // Reserved by a Keel that kept no target: the counter's value
        // then, unless a start has taken it since (and so runs as `inst`).
        format!("{}-{}", vm.name, vm.status.instance_seq)
    });
    let from_inst = ev.migration_source.as_ref().is_none_or(|s| *s == inst.id);
    (from_inst && target != inst.id).then_some((id, target))
}
