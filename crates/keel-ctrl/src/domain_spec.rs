//! What a VM's instance is started with (`DomainSpec`), in one place for
//! both ways an instance begins: booted new from the spec, or as the
//! target of a live migration. Side by side, so that where they differ is
//! written down once, with why.

use keel_api::{Image, Instance, VirtualMachine};
use keel_hv::{DiskCreation, DomainSpec};

/// How the instance begins.
pub enum Launch<'a> {
    /// Booted from the spec: `create_disks` are made if missing, and every
    /// disk sits on the root complex.
    New {
        instance: &'a Instance,
        create_disks: DiskCreation,
    },
    /// The target of a live migration from `source_instance`: the guest's
    /// device state arrives from the source and fits only the source's
    /// hardware — its CPUs, memory and disks (a spec change that waits for
    /// a restart is not the target's), its spare ports and the disks
    /// plugged on them — and its disks are the source's, on storage both
    /// nodes share.
    IncomingFrom {
        target_instance: &'a str,
        source_instance: &'a str,
    },
}

pub fn for_instance(vm: &VirtualMachine, launch: Launch<'_>, images: Vec<Image>) -> DomainSpec {
    // Both: the same NIC (MAC) and seed, the same machine type and CPU
    // model (`hardware`) and firmware as recorded at the first start.
    let common = |instance: String| DomainSpec {
        vm: vm.name.clone(),
        instance,
        cpus: vm.spec.cpus,
        memory_mib: vm.spec.memory_mib,
        disks: vm.spec.disks.clone(),
        boot: vm.spec.boot.clone(),
        create_disks: DiskCreation::none(),
        network: vm.nic(),
        cloud_init: vm.spec.cloud_init.clone(),
        images,
        fenced: true,
        hardware: vm.status.hardware.clone(),
        hotplug_ports: 0,
        plugged: Vec::new(),
        clone_from: None,
        recorded_firmware: vm.status.firmware,
        tpm: None,
        balloon: false,
    };
    match launch {
        Launch::New {
            instance,
            create_disks,
        } => DomainSpec {
            create_disks,
            fenced: instance.fenced,
            hotplug_ports: instance.hotplug_ports,
            balloon: instance.balloon,
            clone_from: vm.status.clone_from.clone(),
            tpm: crate::tpm_state::tpm_use(vm),
            ..common(instance.id.clone())
        },
        Launch::IncomingFrom {
            target_instance,
            source_instance,
        } => {
            let source = vm
                .status
                .instance
                .as_ref()
                .filter(|i| i.id == source_instance);
            let started = source.and_then(|i| i.started_with.as_ref());
            DomainSpec {
                cpus: started.map_or(vm.spec.cpus, |s| s.cpus),
                memory_mib: started.map_or(vm.spec.memory_mib, |s| s.memory_mib),
                disks: crate::hotplug::instance_disks(vm, source),
                // The guest keeps the fencing its source was started with.
                fenced: vm.instance_fenced(source_instance),
                hotplug_ports: source.map_or(0, |i| i.hotplug_ports),
                plugged: source.map(|i| i.plugged.clone()).unwrap_or_default(),
                // A balloon device only if the source has one: a device
                // the source lacks fails the migration.
                balloon: source.is_some_and(|i| i.balloon),
                // The source's TPM, if it has one (the driver refuses the
                // migration then, with the reason); never a new one.
                tpm: started
                    .map_or(vm.spec.tpm.is_some(), |s| s.tpm)
                    .then(|| keel_hv::TpmUse {
                        version: vm.spec.tpm.unwrap_or_default().version,
                        may_create: false,
                    }),
                ..common(target_instance.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::Migration;

    fn vm_running(balloon: bool) -> VirtualMachine {
        let spec = serde_json::from_value(serde_json::json!({"cpus": 1, "memory_mib": 64}))
            .expect("a minimal spec");
        let mut vm = VirtualMachine::new("web", spec);
        vm.status.instance = Some(Instance {
            started_with: Some(crate::restart_required::started_with(&vm)),
            balloon,
            ..Instance::new("web-1", "a", 0)
        });
        vm
    }

    fn target_of(vm: &VirtualMachine) -> DomainSpec {
        for_instance(
            vm,
            Launch::IncomingFrom {
                target_instance: "web-2",
                source_instance: "web-1",
            },
            Vec::new(),
        )
    }

    #[test]
    fn a_migration_target_has_a_balloon_exactly_when_its_source_has_one() {
        // A source started before balloons were recorded: its target gets
        // none, or the device sets differ and the migration fails.
        let before = vm_running(false);
        assert!(!target_of(&before).balloon);
        let with = vm_running(true);
        assert!(target_of(&with).balloon);
        // And the record of the moved guest keeps saying so, for the next
        // migration from it.
        let m = Migration {
            id: "m1".into(),
            vm: "web".into(),
            vm_uid: String::new(),
            source_node: "a".into(),
            source_instance: "web-1".into(),
            target_node: "b".into(),
            target_instance: "web-2".into(),
            created_at: 5,
            tuning: Default::default(),
            status: Default::default(),
        };
        for source in [before, with] {
            let had = source.status.instance.as_ref().unwrap().balloon;
            let moved = crate::handover::migrated(&source, &m, 10);
            assert_eq!(moved.status.instance.unwrap().balloon, had);
        }
    }

    #[test]
    fn a_new_instance_is_launched_as_recorded() {
        let vm = vm_running(true);
        let instance = vm.status.instance.clone().unwrap();
        let launch = |instance: &Instance| {
            for_instance(
                &vm,
                Launch::New {
                    instance,
                    create_disks: DiskCreation::none(),
                },
                Vec::new(),
            )
        };
        assert!(launch(&instance).balloon);
        let unrecorded = Instance {
            balloon: false,
            ..instance
        };
        assert!(!launch(&unrecorded).balloon);
    }
}
