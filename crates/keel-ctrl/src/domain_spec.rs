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
    };
    match launch {
        Launch::New {
            instance,
            create_disks,
        } => DomainSpec {
            create_disks,
            fenced: instance.fenced,
            hotplug_ports: instance.hotplug_ports,
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
