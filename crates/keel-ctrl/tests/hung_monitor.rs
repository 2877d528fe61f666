//! A hung monitor never keeps a VM from stopping: a QEMU that does not
//! answer QMP (stopped with SIGSTOP, say) is `Observed::Unknown` at every
//! look, and a stop asked for then still runs its grace period and ends in
//! a kill, which needs no monitor. Run on the node's production runtime and
//! the sim driver's stopped process (`SimHypervisor::stop_process`).

mod common;

use common::{spec, World};
use keel_api::{ExitKind, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_hv::sim::{SimConfig, SimFaults};

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 1_500,
        faults: SimFaults::default(),
        ..Default::default()
    }
}

async fn running_vm(w: &mut World, name: &str, grace_s: u64) -> String {
    w.create(name, spec(RunPolicy::Manual, PowerState::Running, grace_s))
        .await;
    w.run_for(12_000).await;
    let vm = w.get(name).await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    vm.status.instance.unwrap().id
}

/// The acceptance case of issue 25 item 5 in the simulation: stopped
/// before the stop is asked, the instance is killed when the 10 s grace
/// period ends, the VM says why meanwhile, and it is Stopped only once the
/// process was seen gone.
#[tokio::test]
async fn a_stop_of_a_stopped_process_ends_in_a_kill_at_the_grace_end() {
    let mut w = World::new(21, sim()).await;
    let inst = running_vm(&mut w, "hungmon", 10).await;
    w.hv.stop_process(&inst);
    // A stopped QEMU announces nothing (no event, no exit): a steadily
    // running VM's hang is seen at its next look, the resync at the latest.
    w.run_for(w.cfg.resync_ms + 1_000).await;
    let vm = w.get("hungmon").await.unwrap();
    assert!(
        vm.status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("state unknown")),
        "{vm:?}"
    );

    let asked = w.now();
    w.user_op("hungmon", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.run_for(5_000).await;
    let vm = w.get("hungmon").await.unwrap();
    let stop = vm.status.stop.clone().expect("the stop began");
    assert_eq!(
        stop.requested_at, asked,
        "at the first look after the request"
    );
    assert_eq!(vm.status.phase, Phase::Stopping);
    let message = vm.status.message.clone().unwrap_or_default();
    assert!(
        message.contains("state unknown") && message.contains("forced kill"),
        "the reason is on the VM: {message}"
    );
    assert_eq!(w.hv.live_instances("hungmon"), std::slice::from_ref(&inst));

    w.run_for(7_000).await;
    let vm = w.get("hungmon").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Stopped, "{vm:?}");
    let exit = vm.status.last_exit.expect("exit recorded");
    assert_eq!((exit.kind, exit.requested), (ExitKind::Killed, true));
    assert!(
        exit.at >= asked + 10_000 && exit.at <= asked + 12_000,
        "killed at the grace end: {}",
        exit.at - asked
    );
    assert!(w.hv.live_instances("hungmon").is_empty());
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
    let kill_at =
        w.hv.log()
            .iter()
            .find_map(|l| {
                l.strip_suffix(&format!(": kill {inst}"))?
                    .strip_prefix("t=")?
                    .parse::<u64>()
                    .ok()
            })
            .expect("killed");
    assert_eq!(kill_at - asked, 10_000, "the kill comes at the grace end");
}

/// A delete of such a VM goes the same way, and the record goes only once
/// the instance was seen gone.
#[tokio::test]
async fn a_delete_of_a_stopped_process_kills_it_then_deletes_the_record() {
    let mut w = World::new(22, sim()).await;
    let inst = running_vm(&mut w, "hungdel", 10).await;
    w.hv.stop_process(&inst);
    w.request_delete("hungdel").await.unwrap();
    w.run_for(5_000).await;
    let vm = w
        .get("hungdel")
        .await
        .expect("kept while the process lives");
    assert_eq!(vm.status.phase, Phase::Deleting);
    assert_eq!(w.hv.live_instances("hungdel"), [inst]);
    w.run_for(10_000).await;
    assert!(w.get("hungdel").await.is_none(), "deleted after the kill");
    assert!(w.hv.live_instances("hungdel").is_empty());
    assert!(w.hv.violations().is_empty(), "{:?}", w.hv.violations());
}
