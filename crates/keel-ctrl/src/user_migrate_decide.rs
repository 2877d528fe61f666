//! Carrying out the user's `keel vm migrate`, as a pure function.
//!
//! The same eviction marker, reservation and `Migration` record as a
//! drain's (`evict_decide`), with the drain's default tuning and limits on
//! parallel migrations, but: one attempt, no fallback (nothing forces the
//! VM off, so a failure leaves it running where it is, the reason on
//! `status.migrate_outcome`), and a drain's migrations go first when the
//! cluster's limit binds.

use keel_api::migration::DEFAULT_MIGRATION_START_MS;
use keel_api::{
    Eviction, Instance, MigrateOutcome, MigrateRequest, Migration, MigrationPhase, MigrationTuning,
    Millis, VirtualMachine,
};
use keel_hv::DomainState;

use crate::config::LifecycleConfig;
use crate::handover::{migrated, no_target, reserve_and_create};
use crate::step::{persist_if_changed, Step};
use crate::view::ClusterView;

/// `None`: no user migration to carry out, carry on as usual.
pub(crate) fn decide_user_migration(
    vm: &VirtualMachine,
    inst: &Instance,
    state: DomainState,
    cluster: &ClusterView,
    now: Millis,
    cfg: &LifecycleConfig,
) -> Option<Step> {
    let poll = Step::Wait {
        requeue_at: now + cfg.poll_ms,
    };
    // One under way is seen through even if a drain began meanwhile (it
    // moves the VM off too); one not begun yet is left to the drain, and
    // is moot once the drain moved the VM.
    if let Some(ev) = vm.status.eviction.as_ref().filter(|e| e.user) {
        return Some(follow(vm, ev, inst, state, cluster, now, poll));
    }
    if cluster.drain.is_some() {
        return None;
    }
    let req = vm.pending_migration()?;
    if let Some(m) = &cluster.migration {
        // A drain's attempt left behind and still in flight: let it end.
        if !m.status.phase.is_final() {
            return Some(poll);
        }
    }
    if state != DomainState::Running {
        return Some(poll);
    }
    // Its target is launched with the instance's disks, in flux until
    // then.
    if let Some(change) = inst.disk_change_under_way() {
        let mut next = vm.clone();
        next.status.message = Some(format!("migration waiting for {change} to finish"));
        return Some(persist_if_changed(vm, next, None, now + cfg.poll_ms));
    }
    let target = match target_of(req, cluster) {
        Ok(t) => t,
        Err(why) => return Some(finish(vm, req, None, false, why, now)),
    };
    if let Err(why) = free_slot(inst, &target, cluster, &MigrationTuning::default()) {
        let mut next = vm.clone();
        next.status.message = Some(format!("migration waiting for a slot: {why}"));
        return Some(persist_if_changed(vm, next, None, now + cfg.poll_ms));
    }
    let mut reserving = vm.clone();
    reserving.status.eviction = Some(Eviction::submitting(
        req.requested_at,
        now,
        Some(now + DEFAULT_MIGRATION_START_MS),
        true,
    ));
    reserving.status.message = None;
    Some(reserve_and_create(&reserving, inst, &target, cluster, now))
}

/// The attempt under way: adopt its target, or record how it failed.
fn follow(
    vm: &VirtualMachine,
    ev: &Eviction,
    inst: &Instance,
    state: DomainState,
    cluster: &ClusterView,
    now: Millis,
    poll: Step,
) -> Step {
    let migration = cluster
        .migration
        .as_ref()
        .filter(|m| ev.migration.as_deref() == Some(m.id.as_str()));
    let req = vm
        .migrate
        .clone()
        .filter(|r| r.requested_at == ev.drain_requested_at)
        .unwrap_or(MigrateRequest {
            requested_at: ev.drain_requested_at,
            from_node: inst.node.clone(),
            to: None,
        });
    match migration {
        Some(m) if m.status.phase == MigrationPhase::Succeeded && m.is_from(vm) => Step::Persist {
            vm: Box::new(migrated(vm, m, now)),
            then: None,
            requeue_at: now,
        },
        Some(m) if m.status.phase.is_final() => {
            let why = format!(
                "migration {} failed: {}; the VM keeps running on node {}",
                m.id,
                m.status.message.as_deref().unwrap_or("no reason given"),
                inst.node
            );
            finish(vm, &req, Some(m.id.clone()), false, why, now)
        }
        Some(_) => poll,
        // Reserved, but the record was not created (a crash in between):
        // create it now, from the reservation, once the source runs (after
        // a restart meanwhile, the new instance may still be booting).
        None if ev.migration.is_some() && state != DomainState::Running => poll,
        None if ev.migration.is_some() => match target_of(&req, cluster) {
            Ok(target) => reserve_and_create(vm, inst, &target, cluster, now),
            Err(why) => finish(vm, &req, ev.migration.clone(), false, why, now),
        },
        None => finish(
            vm,
            &req,
            None,
            false,
            "no migration was reserved".into(),
            now,
        ),
    }
}

/// The user's target if it can take the VM now, else the scheduler's best.
fn target_of(req: &MigrateRequest, cluster: &ClusterView) -> Result<String, String> {
    match &req.to {
        Some(to) if cluster.targets.contains(to) => Ok(to.clone()),
        Some(to) => Err(format!(
            "node {to} cannot take the VM now (not ready, cordoned, without room, or its QEMU lacks the VM's machine type or CPU model)"
        )),
        None => cluster
            .targets
            .first()
            .cloned()
            .ok_or_else(|| no_target(cluster)),
    }
}

/// Whether a migration from `inst` to `target` fits the limits, counting
/// the drains' VMs still waiting for a slot as taking one first.
fn free_slot(
    inst: &Instance,
    target: &str,
    cluster: &ClusterView,
    tuning: &MigrationTuning,
) -> Result<(), String> {
    let others: Vec<&Migration> = cluster
        .in_flight
        .iter()
        .filter(|m| !m.status.phase.is_final() && m.source_instance != inst.id)
        .collect();
    let per_cluster = tuning.parallel_per_cluster as usize;
    let taken = others.len() + cluster.drain_evictions_waiting;
    if taken >= per_cluster {
        return Err(format!(
            "{} of {per_cluster} migrations in flight in the cluster, {} more waiting for drains (drains go first)",
            others.len(),
            cluster.drain_evictions_waiting
        ));
    }
    let per_node = tuning.parallel_per_node as usize;
    for node in [inst.node.as_str(), target] {
        let on = others
            .iter()
            .filter(|m| m.source_node == node || m.target_node == node)
            .count();
        if on >= per_node {
            return Err(format!(
                "{on} of {per_node} migrations in flight on node {node}"
            ));
        }
    }
    Ok(())
}

/// The request is over: the outcome names it, so it is not tried again.
fn finish(
    vm: &VirtualMachine,
    req: &MigrateRequest,
    migration: Option<String>,
    succeeded: bool,
    message: String,
    now: Millis,
) -> Step {
    let mut next = vm.clone();
    tracing::info!(vm = %vm.name, succeeded, why = %message, "user migration over");
    next.status.eviction = None;
    next.status.migrate_outcome = Some(MigrateOutcome {
        requested_at: req.requested_at,
        migration,
        succeeded,
        message,
    });
    Step::Persist {
        vm: Box::new(next),
        then: None,
        requeue_at: now,
    }
}
