//! Disks plugged into a running instance (`keel vm disk add` of a running
//! VM), decided by pure functions the VM controller applies to the step
//! `vm_decide` chose, like `reboot.rs` and `online_resize.rs`.
//!
//! A plug is two steps, so that a crash between any two of its moments
//! leaves nothing unaccounted for:
//! 1. Recorded first: the instance names the disk and its root port
//!    (`Instance::plugged`, not yet confirmed) and `status.disks` records
//!    the disk as made here, in one write; then the node is asked to plug
//!    it (make it if missing and allowed, attach it).
//! 2. At the next look the node is asked again (attaching an attached disk
//!    is a no-op) and only once that worked is the plug confirmed
//!    (`attached_at`) and the disk marked used.
//!
//! So a disk is never made without a record (a blank one made in place of
//! a used disk stays impossible: the record of a used disk allows no
//! making), and never attached without the instance naming it (a
//! migration target gets it on its port). A disk whose spec names an
//! image, or an instance without a free port (one from before ports, or
//! with all of them taken), waits for the next start: `restart required:
//! disks` says so.

use keel_api::{disk_record, DiskSpec, Event, Millis, PluggedDisk, VirtualMachine};

use crate::joined_step::{
    disk_change_may_finish, disks_may_change, instance_event, quiet, same_instance, writable,
};
use crate::step::{HvAction, Step};
use crate::view::Observed;

/// `step` plugging in a disk the spec has and the running instance lacks,
/// or finishing a plug under way, if nothing else is being done to it.
pub fn plug_step(vm: &VirtualMachine, observed: &Observed, step: Step, now: Millis) -> Step {
    let Some(inst) = vm.status.instance.as_ref() else {
        return step;
    };
    let Some(has) = inst.disk_names() else {
        return step;
    };
    let under_way = inst.plug_under_way().cloned();
    let wanted = vm
        .spec
        .disks
        .iter()
        .find(|d| d.image.is_none() && !has.contains(&d.name));
    if under_way.is_none()
        && (wanted.is_none() || inst.free_port().is_none() || inst.unplug_under_way().is_some())
    {
        return step;
    }
    let Some(home) = vm.status.disk_home.clone() else {
        return step;
    };
    let may = match under_way {
        // Confirmed only with the node's answer: joined to a step that
        // changes nothing else, which a refused plug would drop.
        Some(_) => disk_change_may_finish(vm, observed) && quiet(&step),
        None => disks_may_change(vm, observed),
    };
    if !may {
        return step;
    }
    let Some((mut next, requeue_at)) = writable(vm, &step) else {
        return step;
    };
    let id = inst.id.clone();
    if next.status.instance.as_ref().map(|i| &i.id) != Some(&id) {
        return step;
    }
    let mut records = next.status.disk_records(&next.spec, &home);
    // From the records before this step marks anything: a disk this plug
    // made is made here and unused until its confirmation.
    let makeable = |name: &str, records: &[keel_api::DiskRecord]| {
        disk_record::makeable(records, &[name], &home)
            .iter()
            .any(|d| d == name)
    };
    let inst = next.status.instance.as_mut().expect("checked above");
    if let Some(plug) = under_way {
        let create = makeable(&plug.disk, &records);
        let entry = inst
            .plugged
            .iter_mut()
            .find(|p| p.disk == plug.disk)
            .expect("under way");
        entry.attached_at = Some(now);
        disk_record::mark_used(&mut records, std::slice::from_ref(&plug.disk), &home);
        next.status.disks = Some(records);
        next.status.message = Some(format!(
            "disk {} plugged into the running guest (root port {})",
            plug.disk, plug.port
        ));
        return Step::ActThenPersist {
            action: HvAction::AttachDisk {
                instance: id,
                disk: plug.disk,
                port: plug.port,
                create,
            },
            vm: Box::new(next),
            requeue_at: requeue_at.min(now),
        };
    }
    let disk = wanted.expect("checked above").clone();
    let port = inst.free_port().expect("checked above");
    inst.plugged.push(PluggedDisk {
        disk: disk.name.clone(),
        port,
        attached_at: None,
        detach_requested_at: None,
    });
    inst.disk_sizes_mib.insert(disk.name.clone(), disk.size_mib);
    disk_record::record_plug(&mut records, &disk.name, &home, now);
    let create = makeable(&disk.name, &records);
    next.status.disks = Some(records);
    // The instance has the disk from now on: no restart is due for it
    // (the step chose restart_required from the record before the plug).
    next.status.restart_required = crate::restart_required::fields(&next);
    next.status.message = Some(format!(
        "plugging disk {} into the running guest (root port {port})",
        disk.name
    ));
    Step::Persist {
        vm: Box::new(next),
        then: Some(HvAction::AttachDisk {
            instance: id,
            disk: disk.name,
            port,
            create,
        }),
        // The confirmation at the next look.
        requeue_at: requeue_at.min(now),
    }
}

/// The disks instance `inst` of `vm` has, in the guest's order (those it
/// started with, then those plugged since), as a migration target must be
/// launched with them: the spec's entry for each, or for one dropped from
/// the spec since the start, the disk as the instance has it. The spec's
/// disks for an instance from before `started_with`.
pub fn instance_disks(vm: &VirtualMachine, inst: Option<&keel_api::Instance>) -> Vec<DiskSpec> {
    let Some((inst, names)) = inst.and_then(|i| Some((i, i.disk_names()?))) else {
        return vm.spec.disks.clone();
    };
    names
        .into_iter()
        .map(|name| {
            let size = inst.disk_sizes_mib.get(&name).copied();
            match vm.spec.disks.iter().find(|d| d.name == name) {
                Some(d) => DiskSpec {
                    // As large as the instance has it (a growth not yet
                    // carried out is the target's to do, once it runs).
                    size_mib: size.unwrap_or(d.size_mib),
                    ..d.clone()
                },
                None => DiskSpec {
                    size_mib: size.unwrap_or(1),
                    name,
                    image: None,
                },
            }
        })
        .collect()
}

/// What the node is asked to plug into `instance`: the spec's disk (or,
/// dropped from the spec since the plug was recorded, the disk as the
/// instance has it).
pub fn disk_plug(
    vm: &VirtualMachine,
    instance: &str,
    disk: &str,
    port: u32,
    create: bool,
) -> keel_hv::DiskPlug {
    let spec = vm
        .spec
        .disks
        .iter()
        .find(|d| d.name == disk)
        .cloned()
        .unwrap_or_else(|| DiskSpec {
            name: disk.to_string(),
            size_mib: vm
                .status
                .instance
                .as_ref()
                .and_then(|i| i.disk_sizes_mib.get(disk).copied())
                .unwrap_or(1),
            image: None,
        });
    keel_hv::DiskPlug {
        vm: vm.name.clone(),
        instance: instance.to_string(),
        disk: spec,
        port,
        create,
    }
}

/// The event for a plug `new` confirms since `old`.
pub fn plugged_event(old: &VirtualMachine, new: &VirtualMachine, now: Millis) -> Option<Event> {
    let (before, after) = same_instance(old, new)?;
    let confirmed: Vec<String> = after
        .plugged
        .iter()
        .filter(|p| p.attached_at.is_some())
        .filter(|p| {
            !before
                .plugged
                .iter()
                .any(|b| b.disk == p.disk && b.attached_at.is_some())
        })
        .map(|p| format!("disk {} on root port {}", p.disk, p.port))
        .collect();
    if confirmed.is_empty() {
        return None;
    }
    Some(instance_event(
        old,
        new,
        now,
        format!(
            "plugged into the running guest (instance {}): {}",
            after.id,
            confirmed.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::joined_step::fixtures::{migrating, up, wait_until};
    use keel_api::{DiskHome, HOTPLUG_PORTS};

    const NOW: Millis = 80_000;

    fn running(ports: u32) -> VirtualMachine {
        let mut vm = crate::joined_step::fixtures::running(r#"[{"name":"root","size_mib":64}]"#);
        vm.status.disk_home = Some(DiskHome::Node("a".into()));
        vm.status.instance.as_mut().unwrap().hotplug_ports = ports;
        vm
    }

    fn added(mut vm: VirtualMachine, name: &str) -> VirtualMachine {
        vm.spec.disks.push(DiskSpec {
            name: name.into(),
            size_mib: 32,
            image: None,
        });
        vm
    }

    fn wait() -> Step {
        wait_until(NOW + 30_000)
    }

    #[test]
    fn a_plug_is_recorded_first_and_confirmed_only_after_the_node_did_it() {
        let mut vm = added(running(HOTPLUG_PORTS), "data");
        // As the look that chose the step found it: a disk the instance lacks.
        vm.status.restart_required = crate::restart_required::fields(&vm);
        assert_eq!(vm.status.restart_required, ["disks"]);
        let Step::Persist {
            vm: recorded,
            then: Some(action),
            ..
        } = plug_step(&vm, &up(), wait(), NOW)
        else {
            panic!("not recorded first")
        };
        let plug = HvAction::AttachDisk {
            instance: "web-1".into(),
            disk: "data".into(),
            port: 0,
            create: true,
        };
        assert_eq!(action, plug);
        let inst = recorded.status.instance.as_ref().unwrap();
        assert_eq!(
            inst.plugged,
            [PluggedDisk {
                disk: "data".into(),
                port: 0,
                attached_at: None,
                detach_requested_at: None
            }]
        );
        assert!(recorded.status.restart_required.is_empty(), "{recorded:?}");
        let record = recorded.status.disks.as_ref().unwrap();
        let data = record.iter().find(|r| r.name == "data").unwrap();
        assert!(!data.used && data.made_at == Some(NOW), "{record:?}");
        assert_eq!(plugged_event(&vm, &recorded, NOW), None);

        // The next look asks again, and confirms only through ActThenPersist.
        let Step::ActThenPersist {
            action,
            vm: confirmed,
            ..
        } = plug_step(&recorded, &up(), wait(), NOW + 10)
        else {
            panic!("not confirmed after the node")
        };
        assert_eq!(action, plug);
        let inst = confirmed.status.instance.as_ref().unwrap();
        assert_eq!(inst.plugged[0].attached_at, Some(NOW + 10));
        let record = confirmed.status.disks.as_ref().unwrap();
        assert!(record.iter().find(|r| r.name == "data").unwrap().used);
        let event = plugged_event(&recorded, &confirmed, NOW + 10).unwrap();
        assert!(
            event.reason.contains("disk data on root port 0"),
            "{event:?}"
        );
        assert_eq!(plug_step(&confirmed, &up(), wait(), NOW + 20), wait());

        // A second disk takes the next port.
        let two = added((*confirmed).clone(), "logs");
        let Step::Persist { vm: next, .. } = plug_step(&two, &up(), wait(), NOW + 30) else {
            panic!("second not plugged")
        };
        assert_eq!(next.status.instance.unwrap().plugged[1].port, 1);
    }

    #[test]
    fn a_migration_target_gets_the_instances_disks_not_the_specs() {
        let mut vm = running(HOTPLUG_PORTS);
        let inst = vm.status.instance.as_mut().unwrap();
        inst.plugged.push(PluggedDisk {
            disk: "logs".into(),
            port: 2,
            attached_at: Some(5),
            detach_requested_at: None,
        });
        inst.disk_sizes_mib.insert("logs".into(), 40);
        // Since then: root grown (not yet carried out), logs dropped from
        // the spec, a disk added that has no port yet.
        vm.spec.disks[0].size_mib = 99;
        vm = added(vm, "later");
        let disks = instance_disks(&vm, vm.status.instance.as_ref());
        let got: Vec<(&str, u64)> = disks
            .iter()
            .map(|d| (d.name.as_str(), d.size_mib))
            .collect();
        assert_eq!(got, [("root", 64), ("logs", 40)]);
        // An instance from before `started_with`: the spec's, as before.
        vm.status.instance.as_mut().unwrap().started_with = None;
        assert_eq!(
            instance_disks(&vm, vm.status.instance.as_ref()),
            vm.spec.disks
        );
    }

    #[test]
    fn without_a_free_port_or_for_an_image_disk_it_waits_for_a_restart() {
        let vm = added(running(0), "data");
        assert_eq!(plug_step(&vm, &up(), wait(), NOW), wait());
        let mut image = added(running(HOTPLUG_PORTS), "data");
        image.spec.disks[1].image = Some("debian-12".into());
        assert_eq!(plug_step(&image, &up(), wait(), NOW), wait());
    }

    #[test]
    fn not_while_stopping_migrating_or_unseen() {
        let vm = added(running(HOTPLUG_PORTS), "data");
        let unseen = Observed::Unknown("monitor hung".into());
        assert_eq!(plug_step(&vm, &unseen, wait(), NOW), wait());
        let mut stopping = vm.clone();
        stopping.spec.power = keel_api::PowerState::Stopped;
        assert_eq!(plug_step(&stopping, &up(), wait(), NOW), wait());
        let mut moving = vm.clone();
        migrating(&mut moving);
        assert_eq!(plug_step(&moving, &up(), wait(), NOW), wait());
        let shutdown = Step::Persist {
            vm: Box::new(vm.clone()),
            then: Some(HvAction::Shutdown("web-1".into())),
            requeue_at: NOW,
        };
        assert_eq!(plug_step(&vm, &up(), shutdown.clone(), NOW), shutdown);
    }
}
