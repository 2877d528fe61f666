//! Strict forms of the resource types that request bodies embed.
//!
//! Stored records are read leniently (keel-api ignores unknown fields, so a
//! record written by a newer Keel still decodes), but a request body with a
//! field Keel does not know is a client's mistake and is refused with 400
//! naming the field. These mirrors of [`VmSpec`] and its parts refuse
//! unknown fields and convert into the resource types; the conversions are
//! struct literals both ways, so a field added to `VmSpec` does not compile
//! until it is added here too.

use keel_api::{
    BootSpec, DiskSpec, Firmware, PowerState, RunPolicy, VmSpec, DEFAULT_STOP_GRACE_PERIOD_S,
};
use serde::{Deserialize, Deserializer};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictVmSpec {
    cpus: u32,
    memory_mib: u64,
    #[serde(default)]
    disks: Vec<StrictDiskSpec>,
    #[serde(default)]
    boot: StrictBootSpec,
    #[serde(default)]
    run_policy: RunPolicy,
    #[serde(default)]
    power: PowerState,
    #[serde(default)]
    restart_generation: u64,
    #[serde(default = "default_grace")]
    stop_grace_period_s: u64,
    #[serde(default)]
    node: Option<String>,
}

fn default_grace() -> u64 {
    DEFAULT_STOP_GRACE_PERIOD_S
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictDiskSpec {
    name: String,
    /// May be left out for a disk made from an image: the API makes it the
    /// image's virtual size (a 0 here is that "left out", and refused for
    /// a disk without an image by validation, naming the field).
    #[serde(default)]
    size_mib: u64,
    #[serde(default)]
    image: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictBootSpec {
    #[serde(default)]
    kernel: Option<String>,
    #[serde(default)]
    initrd: Option<String>,
    #[serde(default)]
    cmdline: Option<String>,
    #[serde(default)]
    firmware: Option<Firmware>,
}

impl From<StrictVmSpec> for VmSpec {
    fn from(s: StrictVmSpec) -> Self {
        let StrictVmSpec {
            cpus,
            memory_mib,
            disks,
            boot,
            run_policy,
            power,
            restart_generation,
            stop_grace_period_s,
            node,
        } = s;
        let StrictBootSpec {
            kernel,
            initrd,
            cmdline,
            firmware,
        } = boot;
        VmSpec {
            cpus,
            memory_mib,
            disks: disks
                .into_iter()
                .map(
                    |StrictDiskSpec {
                         name,
                         size_mib,
                         image,
                     }| DiskSpec {
                        name,
                        size_mib,
                        image,
                    },
                )
                .collect(),
            boot: BootSpec {
                kernel,
                initrd,
                cmdline,
                firmware,
            },
            run_policy,
            power,
            restart_generation,
            stop_grace_period_s,
            node,
        }
    }
}

/// Field list check the other way: every field of `VmSpec` (and its parts)
/// must be named here, so a new one cannot be forgotten in the mirror.
#[allow(dead_code)]
fn covers_every_field(spec: VmSpec) {
    let VmSpec {
        cpus: _,
        memory_mib: _,
        disks,
        boot,
        run_policy: _,
        power: _,
        restart_generation: _,
        stop_grace_period_s: _,
        node: _,
    } = spec;
    let BootSpec {
        kernel: _,
        initrd: _,
        cmdline: _,
        firmware: _,
    } = boot;
    for DiskSpec {
        name: _,
        size_mib: _,
        image: _,
    } in disks
    {}
}

/// `#[serde(deserialize_with = "strict::vm_spec")]`: a `VmSpec` that
/// refuses unknown fields at every level.
pub fn vm_spec<'de, D: Deserializer<'de>>(d: D) -> Result<VmSpec, D::Error> {
    StrictVmSpec::deserialize(d).map(VmSpec::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Body {
        #[serde(deserialize_with = "vm_spec")]
        spec: VmSpec,
    }

    #[test]
    fn reads_what_the_lenient_type_writes() {
        let spec = VmSpec {
            cpus: 2,
            memory_mib: 128,
            disks: vec![DiskSpec {
                name: "data".into(),
                size_mib: 64,
                image: Some("debian".into()),
            }],
            boot: BootSpec {
                kernel: Some("k".into()),
                initrd: Some("i".into()),
                cmdline: Some("console=ttyS0".into()),
                firmware: Some(Firmware::Uefi),
            },
            run_policy: RunPolicy::Manual,
            power: PowerState::Stopped,
            restart_generation: 3,
            stop_grace_period_s: 7,
            node: Some("n1".into()),
        };
        let json = serde_json::json!({ "spec": spec });
        let body: Body = serde_json::from_value(json).unwrap();
        assert_eq!(body.spec, spec);
        let minimal: Body = serde_json::from_str(r#"{"spec":{"cpus":1,"memory_mib":64}}"#).unwrap();
        let lenient: VmSpec = serde_json::from_str(r#"{"cpus":1,"memory_mib":64}"#).unwrap();
        assert_eq!(minimal.spec, lenient, "same defaults as the stored type");
    }

    #[test]
    fn refuses_unknown_fields_at_every_level() {
        for body in [
            r#"{"spec":{"cpus":1,"memory_mib":64,"bogus":1}}"#,
            r#"{"spec":{"cpus":1,"memory_mib":64,"boot":{"bogus":1}}}"#,
            r#"{"spec":{"cpus":1,"memory_mib":64,"disks":[{"name":"a","size_mib":1,"bogus":1}]}}"#,
        ] {
            let err = serde_json::from_str::<Body>(body).err().expect(body);
            assert!(err.to_string().contains("bogus"), "{body}: {err}");
        }
    }
}
