//! A VM spec to start a test from: the smallest VM the test guest boots
//! (one CPU, 128 MiB, one 64 MiB disk `root`, readiness through the guest
//! agent), with every other field at the API's default. A test names only
//! what it is about and takes the rest from here:
//!
//! ```
//! # use keel_api::{RunPolicy, VmSpec};
//! let spec = VmSpec { run_policy: RunPolicy::AlwaysOn, ..keel_testkit::spec::vm_spec() };
//! assert_eq!(spec.cpus, 1);
//! ```
//!
//! (`VmSpec` has no `Default`: the API requires CPUs and memory, so a
//! default in production code would hide a missing field.)

use keel_api::{DiskSpec, Readiness, VmSpec, DEFAULT_STOP_GRACE_PERIOD_S};

pub fn vm_spec() -> VmSpec {
    VmSpec {
        cpus: 1,
        memory_mib: 128,
        disks: vec![disk("root", 64)],
        boot: Default::default(),
        run_policy: Default::default(),
        power: Default::default(),
        restart_generation: 0,
        stop_grace_period_s: DEFAULT_STOP_GRACE_PERIOD_S,
        node: None,
        readiness: Readiness::Agent,
        network: Default::default(),
        cloud_init: None,
        ha: None,
        cpu_model: None,
        placement: Default::default(),
        tpm: None,
    }
}

/// A blank disk of `size_mib`.
pub fn disk(name: &str, size_mib: u64) -> DiskSpec {
    DiskSpec {
        name: name.into(),
        size_mib,
        image: None,
    }
}
