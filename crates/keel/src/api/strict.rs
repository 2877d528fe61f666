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
    AntiAffinity, BootDevice, BootSpec, CloudInitSpec, DiskSpec, Firmware, Graphics, NetworkMode,
    NetworkSpec, PlacementRules, PortForward, PowerState, Protocol, Readiness, RunPolicy, VmSpec,
    DEFAULT_STOP_GRACE_PERIOD_S,
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
    /// New VMs default to `agent` (stored records without it mean `none`).
    #[serde(default)]
    readiness: Readiness,
    #[serde(default)]
    network: StrictNetworkSpec,
    #[serde(default)]
    cloud_init: Option<StrictCloudInitSpec>,
    #[serde(default)]
    ha: Option<bool>,
    #[serde(default)]
    cpu_model: Option<String>,
    #[serde(default)]
    placement: StrictPlacementRules,
    #[serde(default)]
    tpm: Option<StrictTpmSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictTpmSpec {
    #[serde(default)]
    version: keel_api::TpmVersion,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictPlacementRules {
    #[serde(default)]
    node_selector: keel_api::Labels,
    #[serde(default)]
    anti_affinity: Option<StrictAntiAffinity>,
    #[serde(default)]
    affinity: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictAntiAffinity {
    group: String,
    #[serde(default)]
    preferred: bool,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictNetworkSpec {
    #[serde(default)]
    mac: Option<String>,
    #[serde(default)]
    mode: NetworkMode,
    #[serde(default)]
    bridge: Option<String>,
    #[serde(default)]
    publish: Vec<StrictPortForward>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictPortForward {
    #[serde(default = "keel_api::network::default_host_address")]
    host_address: String,
    host_port: u16,
    guest_port: u16,
    #[serde(default)]
    protocol: Protocol,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictCloudInitSpec {
    #[serde(default)]
    ssh_authorized_keys: Vec<String>,
    #[serde(default)]
    user_data: Option<String>,
    #[serde(default)]
    instance_id: Option<String>,
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
    cdrom: Option<String>,
    #[serde(default)]
    first: Option<BootDevice>,
    #[serde(default)]
    graphics: Option<Graphics>,
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
            readiness,
            network,
            cloud_init,
            ha,
            cpu_model,
            placement,
            tpm,
        } = s;
        let StrictPlacementRules {
            node_selector,
            anti_affinity,
            affinity,
        } = placement;
        let StrictNetworkSpec {
            mac,
            mode,
            bridge,
            publish,
        } = network;
        let StrictBootSpec {
            cdrom,
            first,
            graphics,
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
                cdrom,
                first,
                graphics,
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
            readiness,
            network: NetworkSpec {
                mac,
                mode,
                bridge,
                publish: publish
                    .into_iter()
                    .map(
                        |StrictPortForward {
                             host_address,
                             host_port,
                             guest_port,
                             protocol,
                         }| PortForward {
                            host_address,
                            host_port,
                            guest_port,
                            protocol,
                        },
                    )
                    .collect(),
            },
            cloud_init: cloud_init.map(
                |StrictCloudInitSpec {
                     ssh_authorized_keys,
                     user_data,
                     instance_id,
                 }| CloudInitSpec {
                    ssh_authorized_keys,
                    user_data,
                    instance_id,
                },
            ),
            ha,
            cpu_model,
            placement: PlacementRules {
                node_selector,
                anti_affinity: anti_affinity.map(|StrictAntiAffinity { group, preferred }| {
                    AntiAffinity { group, preferred }
                }),
                affinity,
            },
            tpm: tpm.map(|StrictTpmSpec { version }| keel_api::TpmSpec { version }),
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
        readiness: _,
        network,
        cloud_init,
        ha: _,
        cpu_model: _,
        placement,
        tpm,
    } = spec;
    if let Some(keel_api::TpmSpec { version: _ }) = tpm {}
    let PlacementRules {
        node_selector: _,
        anti_affinity,
        affinity: _,
    } = placement;
    if let Some(AntiAffinity {
        group: _,
        preferred: _,
    }) = anti_affinity
    {}
    let NetworkSpec {
        mac: _,
        mode: _,
        bridge: _,
        publish,
    } = network;
    for PortForward {
        host_address: _,
        host_port: _,
        guest_port: _,
        protocol: _,
    } in publish
    {}
    if let Some(CloudInitSpec {
        ssh_authorized_keys: _,
        user_data: _,
        instance_id: _,
    }) = cloud_init
    {}
    let BootSpec {
        cdrom: _,
        first: _,
        graphics: _,
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
                cdrom: None,
                first: Some(BootDevice::Disk),
                graphics: Some(Graphics::Vnc),
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
            readiness: Readiness::Console("login:".into()),
            network: NetworkSpec {
                mac: Some("52:54:00:00:00:01".into()),
                mode: NetworkMode::User,
                bridge: None,
                publish: vec![PortForward {
                    host_address: "127.0.0.1".into(),
                    host_port: 2222,
                    guest_port: 22,
                    protocol: Protocol::Udp,
                }],
            },
            cloud_init: Some(CloudInitSpec {
                ssh_authorized_keys: vec!["ssh-ed25519 AAAA".into()],
                user_data: Some("#cloud-config\n".into()),
                instance_id: Some("i-1".into()),
            }),
            ha: Some(false),
            cpu_model: Some("Nehalem-v2".into()),
            placement: Default::default(),
            tpm: Some(keel_api::TpmSpec::default()),
        };
        let json = serde_json::json!({ "spec": spec });
        let body: Body = serde_json::from_value(json).unwrap();
        assert_eq!(body.spec, spec);
        let minimal: Body = serde_json::from_str(r#"{"spec":{"cpus":1,"memory_mib":64}}"#).unwrap();
        let lenient: VmSpec = serde_json::from_str(r#"{"cpus":1,"memory_mib":64}"#).unwrap();
        // Same defaults as the stored type, but for readiness: a stored
        // record without it predates readiness (ready once running), a new
        // VM waits for its guest agent.
        assert_eq!(lenient.readiness, Readiness::None);
        assert_eq!(minimal.spec.readiness, Readiness::Agent);
        assert_eq!(
            minimal.spec,
            VmSpec {
                readiness: Readiness::Agent,
                ..lenient
            }
        );
    }

    #[test]
    fn refuses_unknown_fields_at_every_level() {
        for body in [
            r#"{"spec":{"cpus":1,"memory_mib":64,"bogus":1}}"#,
            r#"{"spec":{"cpus":1,"memory_mib":64,"boot":{"bogus":1}}}"#,
            r#"{"spec":{"cpus":1,"memory_mib":64,"disks":[{"name":"a","size_mib":1,"bogus":1}]}}"#,
            r#"{"spec":{"cpus":1,"memory_mib":64,"network":{"bogus":1}}}"#,
            r#"{"spec":{"cpus":1,"memory_mib":64,"network":{"publish":[{"host_port":1,"guest_port":2,"bogus":1}]}}}"#,
            r#"{"spec":{"cpus":1,"memory_mib":64,"cloud_init":{"bogus":1}}}"#,
        ] {
            let err = serde_json::from_str::<Body>(body).err().expect(body);
            assert!(err.to_string().contains("bogus"), "{body}: {err}");
        }
    }

    #[test]
    fn ha_is_a_boolean_or_left_out() {
        let body = |ha: &str| format!(r#"{{"spec":{{"cpus":1,"memory_mib":64{ha}}}}}"#);
        let spec = |ha: &str| serde_json::from_str::<Body>(&body(ha)).map(|b| b.spec.ha);
        assert_eq!(spec("").unwrap(), None);
        assert_eq!(spec(r#","ha":false"#).unwrap(), Some(false));
        assert_eq!(spec(r#","ha":true"#).unwrap(), Some(true));
        let err = spec(r#","ha":"yes""#).unwrap_err();
        assert!(err.to_string().contains("boolean"), "{err}");
    }
}
