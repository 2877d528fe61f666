//! The `ha` line of `keel vm get`: what the user asked for, and what it
//! means where the disks are — only an instance on shared disks is fenced.

use keel_api::{DiskHome, VirtualMachine};

pub fn describe(vm: &VirtualMachine) -> (&'static str, String) {
    ("ha", summary(vm))
}

fn summary(vm: &VirtualMachine) -> String {
    let Some(home) = &vm.status.disk_home else {
        // Not started yet: the disk home, and so the default, is open.
        return match vm.spec.ha {
            Some(true) => "on (fenced only if its disks are on shared storage)".into(),
            Some(false) => "off (never fenced)".into(),
            None => "default (on if its disks are on shared storage)".into(),
        };
    };
    let on = if vm.spec.ha_on(home) { "on" } else { "off" };
    let fenced = vm.spec.fenced_on(home);
    let why = match home {
        DiskHome::Node(node) if vm.spec.ha_on(home) => {
            format!("not fenced: disks on node-local storage of {node}")
        }
        DiskHome::Node(_) => "not fenced".to_string(),
        DiskHome::Shared(dir) if fenced => format!("fenced: disks on shared storage {dir}"),
        DiskHome::Shared(_) => "not fenced".to_string(),
    };
    let mut line = format!("{on} ({why})");
    if let Some(inst) = vm.status.instance.as_ref().filter(|i| i.fenced != fenced) {
        // The decision was made when the instance started; a changed
        // `spec.ha` waits for the next one.
        line.push_str(&format!(
            "; instance {} runs {} until it ends",
            inst.id,
            if inst.fenced { "fenced" } else { "unfenced" }
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{Instance, VmSpec};

    fn vm(ha: Option<bool>, home: Option<DiskHome>, fenced: Option<bool>) -> VirtualMachine {
        let spec: VmSpec = serde_json::from_str(r#"{"cpus":1,"memory_mib":64}"#).unwrap();
        let mut vm = VirtualMachine::new("v", VmSpec { ha, ..spec });
        vm.status.disk_home = home;
        vm.status.instance = fenced.map(|fenced| Instance {
            fenced,
            ..Instance::new("v-3", "n1", 1)
        });
        vm
    }

    #[test]
    fn says_what_is_fenced_where() {
        let local = || Some(DiskHome::Node("n1".into()));
        let shared = || Some(DiskHome::Shared("/nfs".into()));
        assert_eq!(
            summary(&vm(Some(true), local(), Some(false))),
            "on (not fenced: disks on node-local storage of n1)"
        );
        assert_eq!(summary(&vm(None, local(), Some(false))), "off (not fenced)");
        assert_eq!(
            summary(&vm(None, shared(), Some(true))),
            "on (fenced: disks on shared storage /nfs)"
        );
        assert_eq!(
            summary(&vm(Some(false), shared(), Some(true))),
            "off (not fenced); instance v-3 runs fenced until it ends"
        );
        assert_eq!(
            summary(&vm(None, None, None)),
            "default (on if its disks are on shared storage)"
        );
    }
}
