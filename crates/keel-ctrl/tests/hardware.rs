//! A VM's machine type and CPU model on the sim driver and a manual clock:
//! recorded versioned at the first start and given to every later
//! instance, also by a node whose QEMU now defaults to a newer machine; a
//! CPU model the spec names later takes effect at the next instance and
//! is shown as restart-required until then.

mod common;

use common::{spec, World};
use keel_api::{hardware::DEFAULT_CPU_MODEL, Phase, PowerState, RunPolicy, VmHardware};
use keel_hv::sim::SimConfig;

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 1_000,
        ..Default::default()
    }
}

async fn node_defaulting_to(w: &mut World, machine: &str) {
    w.cfg.default_machine = Some(machine.into());
    w.restart_controller().await;
}

async fn hardware_of_instance(w: &World, vm: &str) -> (String, Option<VmHardware>) {
    let vm = w.get(vm).await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    let id = vm.status.instance.unwrap().id;
    let started = w.hv.domain_spec(&id).expect("a live domain").hardware;
    (id, started)
}

#[tokio::test]
async fn the_machine_recorded_at_the_first_start_is_kept_across_restarts_and_upgrades() {
    let mut w = World::new(7, sim()).await;
    node_defaulting_to(&mut w, "pc-q35-7.2").await;
    let mut s = spec(RunPolicy::Manual, PowerState::Running, 5);
    s.readiness = keel_api::Readiness::None;
    w.create("db", s).await;
    w.run_for(3_000).await;
    let first = VmHardware {
        machine: "pc-q35-7.2".into(),
        cpu_model: DEFAULT_CPU_MODEL.into(),
    };
    let (id1, started) = hardware_of_instance(&w, "db").await;
    assert_eq!(started.as_ref(), Some(&first));
    assert_eq!(
        w.get("db").await.unwrap().status.hardware,
        Some(first.clone())
    );

    // QEMU upgraded: q35 now means a newer machine. The VM keeps its own.
    node_defaulting_to(&mut w, "pc-q35-9.0").await;
    w.user_op("db", |vm| vm.request_restart()).await.unwrap();
    w.run_for(10_000).await;
    let (id2, started) = hardware_of_instance(&w, "db").await;
    assert_ne!(id1, id2, "a new instance");
    assert_eq!(
        started,
        Some(first.clone()),
        "the recorded machine, not the node's new default"
    );

    // A CPU model named now waits for the next instance, said on the VM.
    w.user_op("db", |vm| {
        vm.spec.cpu_model = Some("Nehalem-v2".into());
        vm.generation += 1;
        Ok(())
    })
    .await
    .unwrap();
    w.run_for(3_000).await;
    let vm = w.get("db").await.unwrap();
    assert_eq!(vm.status.restart_required, ["cpu_model"]);
    assert_eq!(
        vm.status.hardware,
        Some(first.clone()),
        "the running instance's"
    );
    w.user_op("db", |vm| vm.request_restart()).await.unwrap();
    w.run_for(10_000).await;
    let (_, started) = hardware_of_instance(&w, "db").await;
    let nehalem = VmHardware {
        cpu_model: "Nehalem-v2".into(),
        ..first
    };
    assert_eq!(started, Some(nehalem.clone()));
    let vm = w.get("db").await.unwrap();
    assert_eq!(vm.status.hardware, Some(nehalem));
    assert!(vm.status.restart_required.is_empty(), "{vm:?}");
}

#[tokio::test]
async fn a_node_that_tells_no_machine_records_none_and_the_driver_chooses() {
    let mut w = World::new(8, sim()).await;
    let mut s = spec(RunPolicy::Manual, PowerState::Running, 5);
    s.readiness = keel_api::Readiness::None;
    w.create("web", s).await;
    w.run_for(3_000).await;
    let (_, started) = hardware_of_instance(&w, "web").await;
    assert_eq!(started, None);
    assert_eq!(w.get("web").await.unwrap().status.hardware, None);
}
