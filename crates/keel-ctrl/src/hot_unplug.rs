//! Plugged disks taken out of a running instance (`keel vm disk remove` of
//! a running VM), decided by pure functions the VM controller applies to
//! the step `vm_decide` chose, like `hotplug.rs`.
//!
//! An unplug is two steps, the mirror of a plug:
//! 1. Recorded first: the instance's entry for the disk notes the request
//!    (`PluggedDisk::detach_requested_at`), then the node asks the guest
//!    to let go of it.
//! 2. At each later look the node is asked again, and only once it saw
//!    the device gone and the disk closed is the disk taken off the
//!    instance (its root port free, the event recorded). While the guest
//!    holds on, nothing is written: the record says what it waits for.
//!
//! So an instance never names fewer disks than its QEMU has open: a
//! migration target is launched with every disk still attached, and the
//! port of a disk still there is never given to another. The disk's file
//! and record stay (`disk_change`): adding it back plugs that disk. A disk
//! the instance started with sits on the root complex, which cannot
//! unplug; it waits for the next start (`restart required: disks`).

use keel_api::{Event, Millis, VirtualMachine};

use crate::joined_step::{
    disk_change_may_finish, disks_may_change, instance_event, same_instance, writable,
};
use crate::step::{HvAction, Step};
use crate::view::Observed;

/// What the record says while the guest has not let go of `disk`.
pub fn waiting_message(disk: &str) -> String {
    format!(
        "unplugging disk {disk}: waiting for the guest to let go of it (a guest that \
         ignores PCIe hot-unplug keeps it until the VM restarts)"
    )
}

/// `step` unplugging a plugged disk the spec no longer has, or finishing
/// an unplug under way, if nothing else is being done to the instance.
pub fn unplug_step(vm: &VirtualMachine, observed: &Observed, step: Step, now: Millis) -> Step {
    let Some(inst) = vm.status.instance.as_ref() else {
        return step;
    };
    // One change of the instance's disks at a time.
    if inst.plug_under_way().is_some() {
        return step;
    }
    let id = inst.id.clone();
    if let Some(unplug) = inst.unplug_under_way().cloned() {
        if !disk_change_may_finish(vm, observed) {
            return step;
        }
        let Some((mut next, requeue_at)) = writable(vm, &step) else {
            return step;
        };
        // The look's own step clears the message of a running VM: it says
        // what the instance waits for as long as it waits.
        next.status.message = Some(waiting_message(&unplug.disk));
        if next != *vm {
            // Something else changed (readiness, a reset): stored first,
            // since the ask below stores nothing while the guest holds on.
            return Step::Persist {
                vm: Box::new(next),
                then: None,
                requeue_at: requeue_at.min(now),
            };
        }
        let inst = next.status.instance.as_mut().expect("checked above");
        inst.plugged.retain(|p| p.disk != unplug.disk);
        inst.disk_sizes_mib.remove(&unplug.disk);
        next.status.restart_required = crate::restart_required::fields(&next);
        next.status.message = Some(format!(
            "disk {} unplugged from the running guest (root port {} free)",
            unplug.disk, unplug.port
        ));
        // Stored only once the node answers that the disk is gone.
        return Step::ActThenPersist {
            action: HvAction::DetachDisk {
                instance: id,
                disk: unplug.disk,
            },
            vm: Box::new(next),
            requeue_at,
        };
    }
    let Some(dropped) = inst
        .plugged
        .iter()
        .find(|p| p.attached_at.is_some() && !vm.spec.disks.iter().any(|d| d.name == p.disk))
        .cloned()
    else {
        return step;
    };
    if !disks_may_change(vm, observed) {
        return step;
    }
    let Some((mut next, requeue_at)) = writable(vm, &step) else {
        return step;
    };
    let Some(inst) = next.status.instance.as_mut().filter(|i| i.id == id) else {
        return step;
    };
    let entry = inst
        .plugged
        .iter_mut()
        .find(|p| p.disk == dropped.disk)
        .expect("found above");
    entry.detach_requested_at = Some(now);
    next.status.message = Some(waiting_message(&dropped.disk));
    Step::Persist {
        vm: Box::new(next),
        then: Some(HvAction::DetachDisk {
            instance: id,
            disk: dropped.disk,
        }),
        // The node's answer at the next look.
        requeue_at: requeue_at.min(now),
    }
}

/// The event for an unplug `new` completes since `old`.
pub fn unplugged_event(old: &VirtualMachine, new: &VirtualMachine, now: Millis) -> Option<Event> {
    let (before, after) = same_instance(old, new)?;
    let gone: Vec<String> = before
        .plugged
        .iter()
        .filter(|p| p.detach_requested_at.is_some())
        .filter(|p| !after.plugged.iter().any(|a| a.disk == p.disk))
        .map(|p| format!("disk {} from root port {}", p.disk, p.port))
        .collect();
    if gone.is_empty() {
        return None;
    }
    Some(instance_event(
        old,
        new,
        now,
        format!(
            "unplugged from the running guest (instance {}): {}",
            after.id,
            gone.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::joined_step::fixtures::{migrating, up, wait_until};
    use keel_api::{DiskHome, PluggedDisk, HOTPLUG_PORTS};

    const NOW: Millis = 80_000;

    /// Running with `root` and a confirmed plug of `data` on port 1, which
    /// the spec no longer has.
    fn dropped() -> VirtualMachine {
        let mut vm = crate::joined_step::fixtures::running(r#"[{"name":"root","size_mib":64}]"#);
        vm.status.disk_home = Some(DiskHome::Node("a".into()));
        let inst = vm.status.instance.as_mut().unwrap();
        inst.hotplug_ports = HOTPLUG_PORTS;
        inst.plugged.push(PluggedDisk {
            disk: "data".into(),
            port: 1,
            attached_at: Some(5),
            detach_requested_at: None,
        });
        inst.disk_sizes_mib.insert("data".into(), 32);
        vm
    }

    fn wait() -> Step {
        wait_until(NOW + 30_000)
    }

    fn detach() -> HvAction {
        HvAction::DetachDisk {
            instance: "web-1".into(),
            disk: "data".into(),
        }
    }

    #[test]
    fn an_unplug_is_recorded_first_and_finished_only_after_the_node_saw_it_gone() {
        let vm = dropped();
        let Step::Persist {
            vm: asked,
            then: Some(action),
            ..
        } = unplug_step(&vm, &up(), wait(), NOW)
        else {
            panic!("not recorded first")
        };
        assert_eq!(action, detach());
        let inst = asked.status.instance.as_ref().unwrap();
        assert_eq!(inst.plugged[0].detach_requested_at, Some(NOW));
        assert_eq!(inst.free_port(), Some(0), "port 1 still held");
        assert_eq!(asked.status.message, Some(waiting_message("data")));
        assert_eq!(unplugged_event(&vm, &asked, NOW), None);

        // Later looks ask again and take the disk off only through
        // ActThenPersist, which stores nothing while the guest holds on.
        let Step::ActThenPersist {
            action,
            vm: gone,
            requeue_at,
        } = unplug_step(&asked, &up(), wait(), NOW + 10)
        else {
            panic!("not finished after the node")
        };
        assert_eq!(action, detach());
        assert_eq!(requeue_at, NOW + 30_000);
        let inst = gone.status.instance.as_ref().unwrap();
        assert!(inst.plugged.is_empty(), "{inst:?}");
        assert!(!inst.disk_sizes_mib.contains_key("data"));
        assert!(gone.status.restart_required.is_empty(), "{gone:?}");
        let event = unplugged_event(&asked, &gone, NOW + 10).unwrap();
        assert!(
            event.reason.contains("disk data from root port 1"),
            "{event:?}"
        );
        assert_eq!(unplug_step(&gone, &up(), wait(), NOW + 20), wait());
    }

    #[test]
    fn a_disk_the_instance_started_with_or_still_in_the_spec_stays() {
        let mut vm = dropped();
        vm.status.instance.as_mut().unwrap().plugged.clear();
        // root is the started-with disk and in the spec; nothing to do.
        assert_eq!(unplug_step(&vm, &up(), wait(), NOW), wait());
        let mut kept = dropped();
        kept.spec.disks.push(keel_api::DiskSpec {
            name: "data".into(),
            size_mib: 32,
            image: None,
        });
        assert_eq!(unplug_step(&kept, &up(), wait(), NOW), wait());
    }

    #[test]
    fn an_unplug_under_way_is_asked_only_of_a_look_that_stores_nothing_else() {
        let Step::Persist { vm: asked, .. } = unplug_step(&dropped(), &up(), wait(), NOW) else {
            panic!()
        };
        // A look that records something else (a reset counted): that is
        // stored, with the message kept; the unplug goes on at the next look.
        let mut reset = (*asked).clone();
        reset.status.instance.as_mut().unwrap().resets = 1;
        reset.status.message = None;
        let persist = Step::Persist {
            vm: Box::new(reset.clone()),
            then: None,
            requeue_at: NOW + 500,
        };
        let Step::Persist {
            vm: stored,
            then: None,
            requeue_at,
        } = unplug_step(&asked, &up(), persist, NOW)
        else {
            panic!("the reset not stored first")
        };
        assert_eq!(requeue_at, NOW);
        assert_eq!(stored.status.instance.as_ref().unwrap().resets, 1);
        assert_eq!(stored.status.message, Some(waiting_message("data")));
        // A look that only clears the message changes nothing: the node
        // is asked.
        let mut cleared = (*asked).clone();
        cleared.status.message = None;
        let clearing = Step::Persist {
            vm: Box::new(cleared),
            then: None,
            requeue_at: NOW + 500,
        };
        assert!(matches!(
            unplug_step(&asked, &up(), clearing, NOW),
            Step::ActThenPersist { .. }
        ));
    }

    #[test]
    fn not_while_stopping_unseen_or_a_migration_is_reserved() {
        let vm = dropped();
        let unseen = Observed::Unknown("monitor hung".into());
        assert_eq!(unplug_step(&vm, &unseen, wait(), NOW), wait());
        let mut stopping = vm.clone();
        stopping.spec.power = keel_api::PowerState::Stopped;
        assert_eq!(unplug_step(&stopping, &up(), wait(), NOW), wait());
        // A drain that has begun: no new unplug...
        let mut draining = vm.clone();
        migrating(&mut draining);
        assert_eq!(unplug_step(&draining, &up(), wait(), NOW), wait());
        // ...but one under way goes on until a migration is reserved.
        let mut under_way = draining.clone();
        under_way.status.instance.as_mut().unwrap().plugged[0].detach_requested_at = Some(1);
        under_way.status.message = Some(waiting_message("data"));
        assert!(matches!(
            unplug_step(&under_way, &up(), wait(), NOW),
            Step::ActThenPersist { .. }
        ));
        under_way.status.eviction.as_mut().unwrap().migration = Some("m".into());
        assert_eq!(unplug_step(&under_way, &up(), wait(), NOW), wait());
    }
}
