//! The guest's virtual hardware that must not change under it: the
//! machine type and the CPU model. A machine alias such as `q35` means the
//! newest version the node's QEMU has, so a QEMU upgrade (or another node
//! with another QEMU) would silently hand the guest another chipset, and a
//! migration between the two would fail or corrupt it. Keel records the
//! versioned machine type (`pc-q35-7.2`) and the CPU model at a VM's first
//! start and starts every later instance, and every migration target, with
//! the same; a node whose QEMU cannot provide them is not used.

use serde::{Deserialize, Serialize};

use crate::ValidationError;

/// The CPU model that passes the host's CPU through: fastest, but it ties
/// the guest to hosts with the same CPU, so only on request.
pub const HOST_CPU: &str = "host";

/// The CPU model a VM gets unless its spec names one: QEMU's baseline
/// x86-64 model, versioned, which every host and TCG provide, so the VM
/// migrates anywhere.
pub const DEFAULT_CPU_MODEL: &str = "qemu64-v1";

/// What a VM's instances run as, fixed at its first start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmHardware {
    /// A versioned machine type, e.g. `pc-q35-7.2`.
    pub machine: String,
    /// A QEMU CPU model name, or [`HOST_CPU`].
    pub cpu_model: String,
}

/// What a node's QEMU offers, advertised on its node record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HostHardware {
    /// The versioned machine type a new VM gets here (what the configured
    /// alias, `q35`, stands for in this QEMU).
    pub default_machine: String,
    /// Every machine type this QEMU can start, versioned names only.
    pub machines: Vec<String>,
    /// Every CPU model this QEMU knows (`host` only where KVM is in use).
    pub cpu_models: Vec<String>,
}

impl HostHardware {
    /// The hardware a VM with no recorded hardware gets at its first start
    /// here: the node's versioned machine type and the spec's CPU model, or
    /// the migratable default.
    pub fn for_first_start(&self, cpu_model: Option<&str>) -> VmHardware {
        VmHardware {
            machine: self.default_machine.clone(),
            cpu_model: cpu_model.unwrap_or(DEFAULT_CPU_MODEL).to_string(),
        }
    }

    /// Why this node cannot run `hw`, if it cannot. A node that reports no
    /// lists (an older agent, a driver that cannot tell) is not judged
    /// here: its QEMU refuses what it lacks when asked to start it.
    pub fn lacks(&self, hw: &VmHardware) -> Option<String> {
        if !self.machines.is_empty() && !self.machines.contains(&hw.machine) {
            return Some(format!(
                "its QEMU cannot provide machine type {} (newest here: {})",
                hw.machine, self.default_machine
            ));
        }
        if !self.cpu_models.is_empty() && !self.cpu_models.contains(&hw.cpu_model) {
            return Some(if hw.cpu_model == HOST_CPU {
                "CPU model host (passthrough) needs KVM, which it does not use".to_string()
            } else {
                format!("its QEMU does not know CPU model {}", hw.cpu_model)
            });
        }
        None
    }
}

/// `spec.cpu_model`: a QEMU CPU model name (letters, digits, `-`, `_`,
/// `.`), or `host`. Whether a node knows it is checked where it starts.
pub fn validate_cpu_model(model: &str) -> Result<(), ValidationError> {
    let ok = !model.is_empty()
        && model.len() <= 64
        && model
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ValidationError::new(
            "spec.cpu_model",
            format!(
                "{model:?} is not a CPU model name (letters, digits, '-', '_', '.'; at most 64)"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostHardware {
        HostHardware {
            default_machine: "pc-q35-7.2".into(),
            machines: vec!["pc-q35-7.2".into(), "pc-q35-7.1".into()],
            cpu_models: vec!["qemu64-v1".into(), "Nehalem-v2".into()],
        }
    }

    #[test]
    fn a_first_start_gets_the_versioned_machine_and_a_migratable_cpu() {
        let hw = host().for_first_start(None);
        assert_eq!(hw.machine, "pc-q35-7.2");
        assert_eq!(hw.cpu_model, DEFAULT_CPU_MODEL);
        assert_eq!(host().for_first_start(Some("host")).cpu_model, "host");
    }

    #[test]
    fn a_node_lacking_the_machine_or_cpu_says_which() {
        let older = VmHardware {
            machine: "pc-q35-8.0".into(),
            cpu_model: "qemu64-v1".into(),
        };
        assert!(host().lacks(&older).unwrap().contains("pc-q35-8.0"));
        let passthrough = VmHardware {
            machine: "pc-q35-7.1".into(),
            cpu_model: HOST_CPU.into(),
        };
        assert!(host().lacks(&passthrough).unwrap().contains("KVM"));
        let fine = host().for_first_start(Some("Nehalem-v2"));
        assert_eq!(host().lacks(&fine), None);
        assert_eq!(HostHardware::default().lacks(&older), None);
    }

    #[test]
    fn cpu_model_names_are_checked() {
        assert!(validate_cpu_model("Nehalem-v2").is_ok());
        assert!(validate_cpu_model("host").is_ok());
        let err = validate_cpu_model("a,b=on").unwrap_err();
        assert_eq!(err.field, "spec.cpu_model");
        assert!(validate_cpu_model("").is_err());
    }
}
