//! Spec changes that wait for a restart: what an instance was started with
//! (`Instance::started_with`, recorded with the instance before the node is
//! asked to start it) against the spec now, for the fields only a new
//! instance takes. The VM controller keeps the difference in
//! `status.restart_required` while the instance lives.

use keel_api::started_with::digest;
use keel_api::{StartedWith, VirtualMachine};

/// What an instance started now from `vm`'s spec is started with.
pub fn started_with(vm: &VirtualMachine) -> StartedWith {
    StartedWith {
        generation: vm.generation,
        cpus: vm.spec.cpus,
        memory_mib: vm.spec.memory_mib,
        disks: vm.spec.disks.iter().map(|d| d.name.clone()).collect(),
        boot: digest(&vm.spec.boot),
        network: digest(&vm.nic()),
        cloud_init: digest(&vm.spec.cloud_init),
        cpu_model: vm.spec.cpu_model.clone(),
        tpm: vm.spec.tpm.is_some(),
    }
}

/// The fields (`cpus`, `memory`, `disks`, `boot`, `network`, `cloud_init`,
/// `cpu_model`, `tpm`)
/// in which `vm`'s spec differs from what its instance was started with.
/// None without an instance, or for one from before this was recorded
/// (nothing is known to differ).
pub fn fields(vm: &VirtualMachine) -> Vec<String> {
    let Some(was) = vm
        .status
        .instance
        .as_ref()
        .and_then(|i| i.started_with.as_ref())
    else {
        return Vec::new();
    };
    let now = started_with(vm);
    // The instance's disks: those it started with and those plugged since.
    let has = vm
        .status
        .instance
        .as_ref()
        .and_then(|i| i.disk_names())
        .unwrap_or_else(|| was.disks.clone());
    [
        ("cpus", was.cpus != now.cpus),
        ("memory", was.memory_mib != now.memory_mib),
        ("disks", has != now.disks),
        ("boot", was.boot != now.boot),
        ("network", was.network != now.network),
        ("cloud_init", was.cloud_init != now.cloud_init),
        // A model named now that the instance did not start with; unnaming
        // it keeps the recorded one, which the instance has.
        (
            "cpu_model",
            now.cpu_model.is_some() && now.cpu_model != was.cpu_model,
        ),
        ("tpm", was.tpm != now.tpm),
    ]
    .into_iter()
    .filter(|(_, changed)| *changed)
    .map(|(field, _)| field.to_string())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{Instance, VmSpec};

    fn vm() -> VirtualMachine {
        let spec: VmSpec = serde_json::from_str(
            r#"{"cpus":1,"memory_mib":128,"disks":[{"name":"root","size_mib":64}]}"#,
        )
        .unwrap();
        let mut vm = VirtualMachine::new("web", spec);
        vm.status.instance = Some(Instance {
            started_with: Some(started_with(&vm)),
            ..Instance::new("web-1", "a", 0)
        });
        vm
    }

    #[test]
    fn each_start_only_field_is_named_and_nothing_else() {
        let mut v = vm();
        assert!(fields(&v).is_empty());
        v.spec.stop_grace_period_s = 5;
        v.spec.run_policy = keel_api::RunPolicy::Manual;
        assert!(fields(&v).is_empty(), "taken at once, no restart");
        v.spec.cpus = 2;
        v.spec.memory_mib = 256;
        assert_eq!(fields(&v), ["cpus", "memory"]);
        v.spec.disks[0].size_mib = 128;
        assert_eq!(fields(&v), ["cpus", "memory"], "a disk keeps its size");
        v.spec.disks.push(v.spec.disks[0].clone());
        v.spec.disks[1].name = "extra".into();
        v.spec.boot.cmdline = Some("quiet".into());
        v.spec.network.publish.push("8080:80".parse().unwrap());
        v.spec.cloud_init = Some(keel_api::CloudInitSpec {
            ssh_authorized_keys: vec!["ssh-ed25519 AAAA".into()],
            user_data: None,
            instance_id: None,
        });
        assert_eq!(
            fields(&v),
            ["cpus", "memory", "disks", "boot", "network", "cloud_init"]
        );
        v.spec.tpm = Some(keel_api::TpmSpec::default());
        assert_eq!(fields(&v).last().map(String::as_str), Some("tpm"));
        // An instance from before `started_with`: nothing known to differ.
        v.status.instance.as_mut().unwrap().started_with = None;
        assert!(fields(&v).is_empty());
    }
}
