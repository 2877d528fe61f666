//! Which hardware (machine type, CPU model) a VM's next instance gets, and
//! whether a node can run a VM's: the decisions over the records of
//! [`keel_api::hardware`]. The machine type is fixed at the first start for
//! the VM's life; the CPU model follows the spec when it names one, at the
//! next new instance (a migration keeps the instance's own).

use keel_api::{hardware::DEFAULT_CPU_MODEL, Node, VirtualMachine, VmHardware};

/// The hardware of an instance of `vm` started now: its recorded machine
/// type, or `default_machine` (the starting node's version of its
/// configured machine) for its first; the spec's CPU model, else the one
/// recorded, else the migratable default. `None` while nothing is recorded
/// and the node tells no default (the driver's own choice, as before).
pub fn for_new_instance(vm: &VirtualMachine, default_machine: Option<&str>) -> Option<VmHardware> {
    let recorded = vm.status.hardware.as_ref();
    let machine = recorded
        .map(|hw| hw.machine.clone())
        .or_else(|| default_machine.map(str::to_string))?;
    let cpu_model = vm
        .spec
        .cpu_model
        .clone()
        .or_else(|| recorded.map(|hw| hw.cpu_model.clone()))
        .unwrap_or_else(|| DEFAULT_CPU_MODEL.to_string());
    Some(VmHardware { machine, cpu_model })
}

/// Why `node` cannot run `vm`'s recorded hardware, if it cannot. A VM with
/// none recorded, or a node that advertises none (an older agent), is not
/// judged: the node's driver refuses what it lacks, with the reason.
pub fn node_lacks(vm: &VirtualMachine, node: &Node) -> Option<String> {
    let hw = vm.status.hardware.as_ref()?;
    let offered = node.status.hardware.as_ref()?;
    offered
        .lacks(hw)
        .map(|why| format!("node {}: {why}", node.name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::HostHardware;

    fn vm(cpu_model: Option<&str>, recorded: Option<(&str, &str)>) -> VirtualMachine {
        // The API's minimal spec: every field but these has its default.
        let spec = serde_json::from_value(serde_json::json!({"cpus": 1, "memory_mib": 64}))
            .expect("a minimal spec");
        let mut vm = VirtualMachine::new("web", spec);
        vm.spec.cpu_model = cpu_model.map(str::to_string);
        vm.status.hardware = recorded.map(|(machine, cpu)| VmHardware {
            machine: machine.into(),
            cpu_model: cpu.into(),
        });
        vm
    }

    #[test]
    fn the_first_start_records_the_nodes_version_and_later_ones_keep_it() {
        let first = for_new_instance(&vm(None, None), Some("pc-q35-7.2")).unwrap();
        assert_eq!(first.machine, "pc-q35-7.2");
        assert_eq!(first.cpu_model, DEFAULT_CPU_MODEL);
        // On a node with a newer QEMU, the machine stays the recorded one.
        let later = vm(None, Some(("pc-q35-7.2", "qemu64-v1")));
        assert_eq!(
            for_new_instance(&later, Some("pc-q35-9.0"))
                .unwrap()
                .machine,
            "pc-q35-7.2"
        );
        assert_eq!(for_new_instance(&vm(None, None), None), None);
    }

    #[test]
    fn the_cpu_model_follows_the_spec_when_it_names_one() {
        let asked = vm(Some("host"), Some(("pc-q35-7.2", "qemu64-v1")));
        assert_eq!(for_new_instance(&asked, None).unwrap().cpu_model, "host");
        // Unnamed again: the recorded one stays, not back to the default.
        let kept = vm(None, Some(("pc-q35-7.2", "Nehalem-v2")));
        assert_eq!(
            for_new_instance(&kept, None).unwrap().cpu_model,
            "Nehalem-v2"
        );
    }

    #[test]
    fn only_a_node_advertising_less_than_the_vm_needs_is_judged() {
        let mut node = Node::new("b");
        let old = vm(None, Some(("pc-q35-8.0", "qemu64-v1")));
        assert_eq!(
            node_lacks(&old, &node),
            None,
            "an older agent tells nothing"
        );
        node.status.hardware = Some(HostHardware {
            default_machine: "pc-q35-7.2".into(),
            machines: vec!["pc-q35-7.2".into()],
            cpu_models: vec!["qemu64-v1".into()],
        });
        let why = node_lacks(&old, &node).unwrap();
        assert!(
            why.contains("node b") && why.contains("pc-q35-8.0"),
            "{why}"
        );
        assert_eq!(
            node_lacks(&vm(None, Some(("pc-q35-7.2", "qemu64-v1"))), &node),
            None
        );
        assert_eq!(node_lacks(&vm(None, None), &node), None);
    }
}
