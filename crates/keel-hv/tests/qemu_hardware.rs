//! The machine type and CPU model against real QEMU: the driver reads what
//! its QEMU provides, starts a VM as its recorded hardware (not the alias
//! or the host's CPU), and refuses, before QEMU is asked, hardware its
//! QEMU cannot provide, saying which.

mod common;

use common::{spec, Fixture};
use keel_api::hardware::{DEFAULT_CPU_MODEL, HOST_CPU};
use keel_hv::{HvError, Hypervisor};

#[tokio::test]
async fn a_vm_runs_as_its_recorded_hardware_and_hardware_qemu_lacks_starts_nothing() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let offered = hv
        .facts()
        .await
        .hardware
        .expect("the qemu driver tells its hardware");
    // The configured alias (q35) as the version it stands for here.
    assert!(
        offered.default_machine.starts_with("pc-q35-")
            && offered.machines.contains(&offered.default_machine),
        "{offered:?}"
    );
    assert!(
        !offered.machines.iter().any(|m| m == "q35"),
        "aliases are no machines"
    );
    assert!(offered.cpu_models.iter().any(|m| m == DEFAULT_CPU_MODEL));
    assert!(
        !offered.cpu_models.iter().any(|m| m == HOST_CPU),
        "no host CPU to pass through under TCG"
    );

    let older = offered
        .machines
        .iter()
        .find(|m| m.starts_with("pc-q35-") && **m != offered.default_machine)
        .expect("QEMU keeps older q35 versions")
        .clone();
    let mut s = spec("hw", "hw-1");
    s.hardware = Some(keel_api::VmHardware {
        machine: older.clone(),
        cpu_model: "Nehalem-v2".into(),
    });
    hv.start(&s).await.unwrap();
    let pid = hv.pid("hw-1").expect("running");
    let argv: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let after = |flag: &str| argv.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
    assert_eq!(
        after("-machine").as_deref(),
        Some(older.as_str()),
        "{argv:?}"
    );
    assert_eq!(after("-cpu").as_deref(), Some("Nehalem-v2"), "{argv:?}");
    hv.kill("hw-1").await.unwrap();

    for (machine, cpu, says) in [
        ("pc-q35-99.0", DEFAULT_CPU_MODEL, "machine type pc-q35-99.0"),
        (offered.default_machine.as_str(), HOST_CPU, "needs KVM"),
        (
            offered.default_machine.as_str(),
            "Pentium-v99",
            "CPU model Pentium-v99",
        ),
    ] {
        let mut s = spec("hw2", "hw2-1");
        s.hardware = Some(keel_api::VmHardware {
            machine: machine.into(),
            cpu_model: cpu.into(),
        });
        match hv.start(&s).await {
            Err(HvError::Failed { reason, .. }) => {
                assert!(reason.contains(says), "{reason}")
            }
            other => panic!("{machine}/{cpu} started: {other:?}"),
        }
        assert_eq!(hv.pid("hw2-1"), None, "nothing started");
        assert!(hv.domains_of("hw2").await.unwrap().is_empty());
    }
}
