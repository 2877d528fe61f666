//! What the changes of a running instance that join the step `vm_decide`
//! chose (`reboot`, `online_resize`, `hotplug`, `hot_unplug`) have in common: whether the
//! instance is alive, the record the chosen step leaves (to which such a
//! change may add), whether nothing else is being done to the instance,
//! and the event such a change records.

use keel_api::{Event, Instance, Millis, Phase, VirtualMachine};
use keel_hv::DomainState;

use crate::step::Step;
use crate::view::Observed;

/// Whether the observed instance is alive (its guest can have reset).
pub(crate) fn alive(observed: &Observed) -> bool {
    matches!(
        observed,
        Observed::Instance(DomainState::Running | DomainState::Paused)
    )
}

/// The record `step` writes (or the one read, for a wait), if the step
/// leaves the same instance recorded and asks for no action yet: a step
/// that a further change of that instance's record can join.
pub(crate) fn writable(vm: &VirtualMachine, step: &Step) -> Option<(VirtualMachine, Millis)> {
    let id = vm.status.instance.as_ref().map(|i| &i.id)?;
    match step {
        Step::Wait { requeue_at } => Some((vm.clone(), *requeue_at)),
        Step::Persist {
            vm: next,
            then: None,
            requeue_at,
        } if next.status.instance.as_ref().map(|i| &i.id) == Some(id) => {
            Some(((**next).clone(), *requeue_at))
        }
        _ => None,
    }
}

/// Whether `vm`'s instance runs with nothing else under way that a change
/// of its disks would disturb: no stop asked or in progress, no migration
/// (its target opens the same files), no restore.
pub(crate) fn disks_may_change(vm: &VirtualMachine, observed: &Observed) -> bool {
    vm.status.phase == Phase::Running
        && alive(observed)
        && vm.status.stop.is_none()
        && vm.wants_running()
        && vm.status.eviction.is_none()
        && vm.restore.is_none()
}

/// Whether a change of `vm`'s disks begun earlier (a plug or unplug under
/// way) may be carried on: the instance runs, no stop or restore is under
/// way, and no migration has been reserved. A drain or migration that has
/// not reserved one yet waits for the change to end (its target is
/// launched with the instance's disks), so the change must be able to.
pub(crate) fn disk_change_may_finish(vm: &VirtualMachine, observed: &Observed) -> bool {
    vm.status.phase == Phase::Running
        && alive(observed)
        && vm.status.stop.is_none()
        && vm.wants_running()
        && vm
            .status
            .eviction
            .as_ref()
            .is_none_or(|e| e.migration.is_none())
        && vm.restore.is_none()
}

/// Whether `step` changes nothing: a step that may not be stored (an
/// action whose outcome decides whether its record is written) joins only
/// such a one, so that whatever else a look found (a readiness change, a
/// reset) is never dropped with it.
pub(crate) fn quiet(step: &Step) -> bool {
    matches!(step, Step::Wait { .. })
}

/// The instance `old` and `new` both record, as each records it: an
/// event of a change inside it is only for the same instance.
pub(crate) fn same_instance<'a>(
    old: &'a VirtualMachine,
    new: &'a VirtualMachine,
) -> Option<(&'a Instance, &'a Instance)> {
    let (before, after) = (old.status.instance.as_ref()?, new.status.instance.as_ref()?);
    (before.id == after.id).then_some((before, after))
}

/// An event of `new`'s running instance (not a phase change of its own).
pub(crate) fn instance_event(
    old: &VirtualMachine,
    new: &VirtualMachine,
    now: Millis,
    reason: String,
) -> Event {
    Event {
        at: now,
        vm: new.name.clone(),
        from: old.status.phase,
        to: new.status.phase,
        reason,
        key: None,
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    use keel_api::{Instance, Millis, Phase, VirtualMachine, VmSpec};
    use keel_hv::DomainState;

    use crate::step::Step;
    use crate::view::Observed;

    /// VM `web` running instance `web-1` on node `a`, with `disks` (JSON),
    /// its sizes and start recorded as a start records them.
    pub fn running(disks: &str) -> VirtualMachine {
        let spec: VmSpec =
            serde_json::from_str(&format!(r#"{{"cpus":1,"memory_mib":128,"disks":{disks}}}"#))
                .unwrap();
        let mut vm = VirtualMachine::new("web", spec);
        vm.status.phase = Phase::Running;
        vm.status.instance = Some(Instance {
            started_with: Some(crate::restart_required::started_with(&vm)),
            disk_sizes_mib: vm
                .spec
                .disks
                .iter()
                .map(|d| (d.name.clone(), d.size_mib))
                .collect(),
            running_since: Some(1_000),
            ..Instance::new("web-1", "a", 0)
        });
        vm
    }

    pub fn up() -> Observed {
        Observed::Instance(DomainState::Running)
    }

    pub fn wait_until(at: Millis) -> Step {
        Step::Wait { requeue_at: at }
    }

    /// A migration under way, as an eviction records it.
    pub fn migrating(vm: &mut VirtualMachine) {
        vm.status.eviction = Some(
            serde_json::from_str(r#"{"drain_requested_at":1,"phase":"Migrating","started_at":1}"#)
                .unwrap(),
        );
    }
}
