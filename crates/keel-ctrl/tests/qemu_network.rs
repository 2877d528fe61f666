//! The NIC through the controller runtime and real QEMU: the MAC the guest
//! sees is the record's, across a restart; a missing bridge is a start
//! failure whose reason is on the VM record (`keel vm get`'s message).

mod qemu;

use std::time::Duration;

use keel_api::{NetworkMode, NetworkSpec, Phase, RunPolicy, VirtualMachine};
use qemu::Env;

const BOOT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guest_sees_the_records_mac_across_a_restart() {
    let Some(env) = Env::new().await else { return };
    let mut spec = Env::spec(RunPolicy::Manual, 30);
    spec.network.mac = Some("52:54:00:c0:ff:ee".into());
    env.create("web", spec).await;
    let (first, mut guest) = env.ready("web", BOOT).await;
    assert_eq!(guest.command("mac").await.unwrap(), "MAC 52:54:00:c0:ff:ee");
    drop(guest);
    env.user("web", VirtualMachine::request_restart).await;
    env.wait_for("web", BOOT, "restarted", |vm| {
        vm.status.phase == Phase::Running
            && vm.status.instance.as_ref().is_some_and(|i| i.id != first)
    })
    .await;
    let (_, mut guest) = env.ready("web", BOOT).await;
    assert_eq!(
        guest.command("mac").await.unwrap(),
        "MAC 52:54:00:c0:ff:ee",
        "after a restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bridge_is_reported_on_the_vm() {
    let Some(env) = Env::new().await else { return };
    let mut spec = Env::spec(RunPolicy::Manual, 30);
    spec.network = NetworkSpec {
        mode: NetworkMode::Bridge,
        bridge: Some("kbr-absent0".into()),
        ..Default::default()
    };
    env.create("lan", spec).await;
    let vm = env
        .wait_for("lan", BOOT, "report the start failure", |vm| {
            vm.status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("bridge kbr-absent0 not found"))
        })
        .await;
    eprintln!("message: {}", vm.status.message.unwrap());
}
