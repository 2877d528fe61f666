//! Which machine types and CPU models this node's QEMU provides, read once
//! from `-machine help` and `-cpu help` when the driver starts, and what a
//! configured machine alias (`q35`) stands for here. A VM's recorded
//! hardware ([`keel_api::hardware`]) is checked against it before QEMU is
//! asked, so a node that cannot run it says why instead of QEMU's error,
//! and the node record advertises it for placement and migration.

use std::path::Path;
use std::process::Stdio;

use keel_api::{hardware::HOST_CPU, Accelerator, HostHardware};

use super::QemuInitError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Catalog {
    /// The versioned machine type the configured machine names.
    pub default_machine: String,
    /// Versioned (non-alias) machine types.
    pub machines: Vec<String>,
    /// CPU model names, aliases included (`qemu64` is as good a name as
    /// `qemu64-v1` under a versioned machine type).
    pub cpu_models: Vec<String>,
}

impl Catalog {
    pub async fn probe(binary: &Path, configured_machine: &str) -> Result<Catalog, QemuInitError> {
        let machines = help(binary, "-machine").await?;
        let cpus = help(binary, "-cpu").await?;
        Ok(Catalog::parse(&machines, &cpus, configured_machine))
    }

    /// From the two help texts. A configured machine that is no alias is
    /// its own version (an operator who configured `pc-q35-7.1` gets it).
    pub fn parse(machine_help: &str, cpu_help: &str, configured_machine: &str) -> Catalog {
        let mut machines = Vec::new();
        let mut default_machine = configured_machine.to_string();
        // "q35                  Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-7.2)"
        for line in machine_help.lines().skip(1) {
            let Some(name) = line.split_whitespace().next() else {
                continue;
            };
            match line.split("(alias of ").nth(1) {
                Some(rest) => {
                    if name == configured_machine {
                        default_machine = rest.trim_end().trim_end_matches(')').to_string();
                    }
                }
                None => machines.push(name.to_string()),
            }
        }
        // "x86 Nehalem-v2            Intel Core i7 9xx (Nehalem Core i7, IBRS update)"
        let cpu_models = cpu_help
            .lines()
            .take_while(|line| !line.trim().is_empty())
            .filter_map(|line| {
                let mut words = line.split_whitespace();
                (words.next() == Some("x86"))
                    .then(|| words.next())
                    .flatten()
                    .map(str::to_string)
            })
            .collect();
        Catalog {
            default_machine,
            machines,
            cpu_models,
        }
    }

    /// What the node offers now: the host CPU only where the guests run
    /// under KVM (TCG has no host CPU to pass through).
    pub fn offered(&self, accelerator: Option<Accelerator>) -> HostHardware {
        let mut cpu_models: Vec<String> = self
            .cpu_models
            .iter()
            .filter(|m| *m != HOST_CPU)
            .cloned()
            .collect();
        if accelerator == Some(Accelerator::Kvm) {
            cpu_models.push(HOST_CPU.to_string());
        }
        HostHardware {
            default_machine: self.default_machine.clone(),
            machines: self.machines.clone(),
            cpu_models,
        }
    }
}

async fn help(binary: &Path, flag: &str) -> Result<String, QemuInitError> {
    let missing = |reason: String| QemuInitError::QemuMissing {
        binary: binary.to_path_buf(),
        reason,
    };
    let out = tokio::process::Command::new(binary)
        .args([flag, "help"])
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| missing(e.to_string()))?;
    if !out.status.success() {
        return Err(missing(format!("{flag} help exited with {}", out.status)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Excerpts of QEMU 7.2's output.
    const MACHINES: &str = "\
Supported machines are:
microvm              microvm (i386)
pc                   Standard PC (i440FX + PIIX, 1996) (alias of pc-i440fx-7.2)
pc-i440fx-7.2        Standard PC (i440FX + PIIX, 1996) (default)
pc-i440fx-7.1        Standard PC (i440FX + PIIX, 1996)
q35                  Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-7.2)
pc-q35-7.2           Standard PC (Q35 + ICH9, 2009)
pc-q35-7.1           Standard PC (Q35 + ICH9, 2009)
";
    const CPUS: &str = "\
Available CPUs:
x86 Nehalem               (alias configured by machine type)
x86 Nehalem-v2            Intel Core i7 9xx (Nehalem Core i7, IBRS update)
x86 host                  KVM processor with all supported host features
x86 qemu64                (alias configured by machine type)
x86 qemu64-v1             QEMU Virtual CPU version 2.5+

Recognized CPUID flags:
  3dnow 3dnowext
";

    #[test]
    fn an_alias_resolves_to_its_version_and_only_versions_are_machines() {
        let c = Catalog::parse(MACHINES, CPUS, "q35");
        assert_eq!(c.default_machine, "pc-q35-7.2");
        assert!(c.machines.contains(&"pc-q35-7.1".to_string()));
        assert!(!c.machines.iter().any(|m| m == "q35" || m == "pc"));
        assert_eq!(
            c.cpu_models,
            ["Nehalem", "Nehalem-v2", "host", "qemu64", "qemu64-v1"]
        );
        assert_eq!(
            Catalog::parse(MACHINES, CPUS, "pc-q35-7.1").default_machine,
            "pc-q35-7.1"
        );
    }

    #[test]
    fn the_host_cpu_is_offered_only_under_kvm() {
        let c = Catalog::parse(MACHINES, CPUS, "q35");
        assert!(!c
            .offered(Some(Accelerator::Tcg))
            .cpu_models
            .contains(&"host".into()));
        assert!(!c.offered(None).cpu_models.contains(&"host".into()));
        assert!(c
            .offered(Some(Accelerator::Kvm))
            .cpu_models
            .contains(&"host".into()));
    }
}
