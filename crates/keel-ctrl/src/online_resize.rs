//! Disks grown under a running guest (`keel vm disk resize` of a running
//! VM), decided by pure functions the VM controller applies to the step
//! `vm_decide` chose.
//!
//! The instance records the size each of its disks has
//! (`Instance::disk_sizes_mib`: the spec's at its start). A disk the spec
//! now asks to be larger is grown by the hypervisor first, and the new size
//! is recorded only once that worked (`ActThenPersist`): a failed or lost
//! growth is tried again at the next look, and the driver's growth is a
//! no-op on a disk already that large. One disk per look, and only while
//! nothing else is being done to the instance (no stop, no migration, no
//! other action in this step).
//!
//! Why not at the next start only: a full filesystem is the usual reason
//! to grow a disk, and the guest should not have to be restarted for it.
//! A disk the instance was not started with (added since) is for its next
//! start; so is every disk of an instance from before sizes were recorded.

use std::collections::BTreeMap;

use keel_api::{Event, Millis, VirtualMachine};

use crate::joined_step::{disks_may_change, instance_event, same_instance, writable};
use crate::step::{HvAction, Step};
use crate::view::Observed;

/// The sizes an instance started now from `vm`'s spec has.
pub fn sizes_at_start(vm: &VirtualMachine) -> BTreeMap<String, u64> {
    vm.spec
        .disks
        .iter()
        .map(|d| (d.name.clone(), d.size_mib))
        .collect()
}

/// The first disk of the recorded instance that the spec asks to be larger
/// than the instance has it: its name and the size asked.
fn next_growth(vm: &VirtualMachine) -> Option<(String, u64)> {
    let inst = vm.status.instance.as_ref()?;
    // A disk being plugged is made at its size.
    inst.attached_disk_names()?.into_iter().find_map(|name| {
        let has = *inst.disk_sizes_mib.get(&name)?;
        let asked = vm.spec.disks.iter().find(|d| d.name == name)?.size_mib;
        (asked > has).then_some((name, asked))
    })
}

/// `step` growing a disk of the running instance, if the spec asks for it
/// and nothing else is being done to the instance.
pub fn grow_step(vm: &VirtualMachine, observed: &Observed, step: Step, now: Millis) -> Step {
    let Some((disk, size_mib)) = next_growth(vm) else {
        return step;
    };
    if !disks_may_change(vm, observed) {
        return step;
    }
    let Some((mut next, requeue_at)) = writable(vm, &step) else {
        return step;
    };
    let inst = next.status.instance.as_mut().expect("writable has one");
    if inst.id != vm.status.instance.as_ref().expect("next_growth has one").id {
        return step;
    }
    let was = inst.disk_sizes_mib.insert(disk.clone(), size_mib);
    let instance = inst.id.clone();
    // Also in place of the reason of an earlier try that failed.
    next.status.message = Some(format!(
        "disk {disk} grown from {} MiB to {size_mib} MiB under the running guest",
        was.unwrap_or_default()
    ));
    Step::ActThenPersist {
        action: HvAction::GrowDisk {
            instance,
            disk,
            size_mib,
        },
        vm: Box::new(next),
        // The next disk to grow, if any, at the next look.
        requeue_at: requeue_at.min(now),
    }
}

/// The event for each disk `new` records grown since `old`, in one.
pub fn grown_event(old: &VirtualMachine, new: &VirtualMachine, now: Millis) -> Option<Event> {
    let (before, after) = same_instance(old, new)?;
    let grown: Vec<String> = after
        .disk_sizes_mib
        .iter()
        .filter_map(|(disk, &size)| {
            let was = *before.disk_sizes_mib.get(disk)?;
            (size > was).then(|| format!("disk {disk} from {was} MiB to {size} MiB"))
        })
        .collect();
    if grown.is_empty() {
        return None;
    }
    Some(instance_event(
        old,
        new,
        now,
        format!(
            "grown under the running guest (instance {}): {}",
            after.id,
            grown.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::joined_step::fixtures::{migrating, up, wait_until};
    use keel_api::{DiskSpec, StopProgress, StopReason};

    const NOW: Millis = 50_000;

    fn running() -> VirtualMachine {
        crate::joined_step::fixtures::running(
            r#"[{"name":"root","size_mib":64},{"name":"data","size_mib":100}]"#,
        )
    }

    fn wait() -> Step {
        wait_until(NOW + 30_000)
    }

    #[test]
    fn a_grown_disk_is_grown_first_and_recorded_after() {
        let mut vm = running();
        assert_eq!(grow_step(&vm, &up(), wait(), NOW), wait(), "nothing asked");
        vm.spec.disks[1].size_mib = 300;
        let Step::ActThenPersist {
            action,
            vm: next,
            requeue_at,
        } = grow_step(&vm, &up(), wait(), NOW)
        else {
            panic!("not grown")
        };
        assert_eq!(
            action,
            HvAction::GrowDisk {
                instance: "web-1".into(),
                disk: "data".into(),
                size_mib: 300
            }
        );
        assert_eq!(requeue_at, NOW);
        let inst = next.status.instance.as_ref().unwrap();
        assert_eq!(inst.disk_sizes_mib["data"], 300);
        assert_eq!(inst.disk_sizes_mib["root"], 64);
        let event = grown_event(&vm, &next, NOW).unwrap();
        assert!(
            event.reason.contains("disk data from 100 MiB to 300 MiB"),
            "{event:?}"
        );
        // Once recorded, nothing more to do.
        assert_eq!(grow_step(&next, &up(), wait(), NOW), wait());
    }

    #[test]
    fn a_plugged_disk_grows_once_its_plug_is_confirmed() {
        let mut vm = running();
        vm.spec.disks.push(DiskSpec {
            name: "logs".into(),
            size_mib: 40,
            image: None,
        });
        let inst = vm.status.instance.as_mut().unwrap();
        inst.disk_sizes_mib.insert("logs".into(), 32);
        inst.plugged.push(keel_api::PluggedDisk {
            disk: "logs".into(),
            port: 0,
            attached_at: None,
            detach_requested_at: None,
        });
        assert_eq!(grow_step(&vm, &up(), wait(), NOW), wait(), "plug under way");
        vm.status.instance.as_mut().unwrap().plugged[0].attached_at = Some(NOW - 1);
        let Step::ActThenPersist { action, .. } = grow_step(&vm, &up(), wait(), NOW) else {
            panic!("not grown")
        };
        assert_eq!(
            action,
            HvAction::GrowDisk {
                instance: "web-1".into(),
                disk: "logs".into(),
                size_mib: 40
            }
        );
    }

    #[test]
    fn a_pending_write_is_joined_and_an_action_is_never_replaced() {
        let mut vm = running();
        vm.spec.disks[0].size_mib = 128;
        let mut noted = vm.clone();
        noted.status.restart_required = vec!["cpus".into()];
        let persist = Step::Persist {
            vm: Box::new(noted),
            then: None,
            requeue_at: NOW + 2_000,
        };
        let Step::ActThenPersist { vm: next, .. } = grow_step(&vm, &up(), persist, NOW) else {
            panic!("not joined")
        };
        assert_eq!(next.status.restart_required, ["cpus"], "the write joined");
        let shutdown = Step::Persist {
            vm: Box::new(vm.clone()),
            then: Some(HvAction::Shutdown("web-1".into())),
            requeue_at: NOW,
        };
        assert_eq!(grow_step(&vm, &up(), shutdown.clone(), NOW), shutdown);
    }

    #[test]
    fn not_while_stopping_migrating_or_unseen_nor_for_disks_the_instance_lacks() {
        let mut vm = running();
        vm.spec.disks[1].size_mib = 300;
        let unseen = Observed::Unknown("monitor hung".into());
        assert_eq!(grow_step(&vm, &unseen, wait(), NOW), wait());
        assert_eq!(
            grow_step(&vm, &Observed::InstanceAbsent, wait(), NOW),
            wait()
        );

        let mut stopping = vm.clone();
        stopping.status.stop = Some(StopProgress {
            reason: StopReason::User,
            requested_at: NOW,
            attempts: 1,
            next_check_at: NOW + 1_000,
            forced_at: None,
            agent_shutdown_at: None,
        });
        assert_eq!(grow_step(&stopping, &up(), wait(), NOW), wait());

        let mut moving = vm.clone();
        migrating(&mut moving);
        assert_eq!(grow_step(&moving, &up(), wait(), NOW), wait());

        // Added since the start: the next start makes it at its size.
        let mut added = running();
        added.spec.disks.push(DiskSpec {
            name: "more".into(),
            ..added.spec.disks[1].clone()
        });
        added.spec.disks[2].size_mib = 500;
        assert_eq!(grow_step(&added, &up(), wait(), NOW), wait());

        // An instance from before sizes were kept.
        let mut old = vm.clone();
        old.status.instance.as_mut().unwrap().disk_sizes_mib.clear();
        assert_eq!(grow_step(&old, &up(), wait(), NOW), wait());
    }
}
