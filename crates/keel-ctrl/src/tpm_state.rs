//! The VM's TPM state as the controller keeps track of it: like a disk,
//! it may be made only until an instance has run with it
//! (`VmStatus::tpm_used_since`, set when an instance started with the TPM
//! is first seen running); from then on every start needs the state that
//! is there, and the driver refuses one that finds none.

use keel_api::{Instance, Millis, VirtualMachine, VmStatus};

/// What a start of `vm` now is told about its TPM.
pub fn tpm_use(vm: &VirtualMachine) -> Option<keel_hv::TpmUse> {
    vm.spec.tpm.map(|tpm| keel_hv::TpmUse {
        version: tpm.version,
        may_create: vm.status.tpm_used_since.is_none(),
    })
}

/// `inst` was seen running: if it was started with the TPM, the TPM's
/// state is the VM's data from now on.
pub fn mark_used(status: &mut VmStatus, inst: &Instance, now: Millis) {
    if inst.started_with.as_ref().is_some_and(|s| s.tpm) {
        status.tpm_used_since.get_or_insert(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(tpm: bool) -> VirtualMachine {
        let spec = serde_json::from_value(serde_json::json!({"cpus": 1, "memory_mib": 64}))
            .expect("a minimal spec");
        let mut vm = VirtualMachine::new("web", spec);
        vm.spec.tpm = tpm.then(keel_api::TpmSpec::default);
        vm
    }

    #[test]
    fn the_state_may_be_made_only_until_an_instance_ran_with_it() {
        assert_eq!(tpm_use(&vm(false)), None);
        let mut v = vm(true);
        assert!(tpm_use(&v).unwrap().may_create, "first start: made");
        let mut inst = Instance::new("web-1", "a", 0);
        inst.started_with = Some(crate::restart_required::started_with(&v));
        let mut status = v.status.clone();
        mark_used(&mut status, &inst, 7);
        assert_eq!(status.tpm_used_since, Some(7));
        // Seen running again later: the first time stays.
        mark_used(&mut status, &inst, 9);
        assert_eq!(status.tpm_used_since, Some(7));
        v.status = status;
        assert!(!tpm_use(&v).unwrap().may_create, "used: must exist");
        // An instance started before the TPM was added does not use it.
        let without = vm(false);
        inst.started_with = Some(crate::restart_required::started_with(&without));
        let mut fresh = vm(true).status;
        mark_used(&mut fresh, &inst, 7);
        assert_eq!(fresh.tpm_used_since, None);
    }
}
