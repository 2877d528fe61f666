//! The guest side of the lifecycle on the sim driver and a manual clock:
//! readiness (set, reported, reset by a restart), the guest-agent shutdown
//! fallback of a stop, and filesystem freezes around live snapshots.

mod common;

use common::{spec, World};
use keel_api::{ExitKind, Phase, PowerState, Readiness, RunPolicy, SnapshotPhase, VirtualMachine};
use keel_hv::sim::{SimConfig, SimFaults};

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 1_000,
        graceful_shutdown_ms: 2_000,
        // The agent comes up 5 s after the guest starts running.
        agent_ready_ms: 5_000,
        ..Default::default()
    }
}

async fn running(w: &mut World, name: &str, readiness: Readiness) -> VirtualMachine {
    let mut s = spec(RunPolicy::Manual, PowerState::Running, 60);
    s.readiness = readiness;
    w.create(name, s).await;
    w.run_for(2_000).await;
    let vm = w.get(name).await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    vm
}

#[tokio::test]
async fn agent_readiness_is_set_with_addresses_and_reset_by_a_restart() {
    let mut w = World::new(1, sim()).await;
    let vm = running(&mut w, "web", Readiness::Agent).await;
    assert_eq!(vm.ready_since(), None, "running is not ready");
    let r = vm
        .status
        .instance
        .as_ref()
        .unwrap()
        .readiness
        .clone()
        .unwrap();
    assert!(
        r.reason
            .as_deref()
            .unwrap()
            .contains("guest agent not answering"),
        "{r:?}"
    );
    assert!(!r.agent);

    w.run_for(6_000).await;
    let vm = w.get("web").await.unwrap();
    let first = vm.status.instance.clone().unwrap();
    let ready_at = vm.ready_since().expect("the agent answered");
    // Probed every second while not ready: seen within a second of it.
    let agent_up = first.created_at + 1_000 + 5_000;
    assert!(
        (agent_up..=agent_up + 1_000).contains(&ready_at),
        "{ready_at} vs {agent_up}"
    );
    let r = first.readiness.clone().unwrap();
    assert!(r.agent && r.reason.is_none());
    let addrs: Vec<&str> = r.addresses.iter().map(|a| a.address.as_str()).collect();
    assert_eq!(addrs, ["10.0.2.15/24"], "loopback left out");
    assert_eq!(r.hostname.as_deref(), Some("web"));

    // A restart: the new instance starts out not ready, and becomes ready
    // only once its own agent answers.
    w.user_op("web", VirtualMachine::request_restart)
        .await
        .unwrap();
    let mut saw_new_not_ready = false;
    for _ in 0..40 {
        w.run_for(500).await;
        let vm = w.get("web").await.unwrap();
        if let Some(inst) = &vm.status.instance {
            if inst.id != first.id && vm.status.phase == Phase::Running {
                if vm.ready_since().is_none() {
                    saw_new_not_ready = true;
                } else {
                    assert!(vm.ready_since().unwrap() > ready_at);
                    assert!(saw_new_not_ready, "readiness carried over the restart");
                    return;
                }
            }
        }
    }
    panic!("the new instance never became ready");
}

#[tokio::test]
async fn console_readiness_waits_for_its_text() {
    let mut w = World::new(2, sim()).await;
    running(&mut w, "a", Readiness::Console("KEEL-GUEST-READY".into())).await;
    running(&mut w, "b", Readiness::Console("NEVER-PRINTED".into())).await;
    running(&mut w, "c", Readiness::None).await;
    w.run_for(2_000).await;
    let a = w.get("a").await.unwrap();
    assert!(a.ready_since().is_some(), "{:?}", a.status.instance);
    let b = w.get("b").await.unwrap();
    assert!(b.ready_since().is_none());
    let reason = b
        .status
        .instance
        .unwrap()
        .readiness
        .unwrap()
        .reason
        .unwrap();
    assert!(reason.contains("NEVER-PRINTED"), "{reason}");
    let c = w.get("c").await.unwrap();
    assert_eq!(
        c.ready_since(),
        c.status.instance.as_ref().unwrap().running_since
    );
}

/// A guest that ignores the power button is asked through its agent at half
/// the grace period, and powers off before the forced kill.
#[tokio::test]
async fn stop_falls_back_to_the_guest_agent_before_the_kill() {
    let mut w = World::new(3, sim()).await;
    running(&mut w, "web", Readiness::Agent).await;
    w.run_for(6_000).await;
    let inst = w.get("web").await.unwrap().status.instance.unwrap().id;
    w.hv.ignore_acpi(&inst);
    let stop_at = w.now();
    w.user_op("web", VirtualMachine::request_stop)
        .await
        .unwrap();
    w.run_for(29_000).await;
    assert!(
        !w.hv.agent_shutdown_requested(&inst),
        "not before half the grace period"
    );
    assert_eq!(w.hv.live_instances("web"), vec![inst.clone()]);
    w.run_for(2_000).await;
    assert!(w.hv.agent_shutdown_requested(&inst));
    let vm = w.get("web").await.unwrap();
    let asked = vm.status.stop.as_ref().unwrap().agent_shutdown_at.unwrap();
    assert_eq!(asked - stop_at, 30_000);
    w.run_for(10_000).await;
    let vm = w.get("web").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Stopped);
    let exit = vm.status.last_exit.unwrap();
    assert_eq!(
        exit.kind,
        ExitKind::GuestPoweroff,
        "powered off, not killed"
    );
    assert!(exit.at - stop_at < 40_000);
}

/// Without an answering agent the fallback fails (the reason is on the
/// record) and the kill at the end of the grace period still comes.
#[tokio::test]
async fn a_silent_agent_still_ends_in_the_kill() {
    let mut w = World::new(4, sim()).await;
    running(&mut w, "web", Readiness::None).await;
    let inst = w.get("web").await.unwrap().status.instance.unwrap().id;
    w.hv.hang_guest(&inst);
    let stop_at = w.now();
    w.user_op("web", VirtualMachine::request_stop)
        .await
        .unwrap();
    // Shown until the next press, a second later.
    w.run_for(30_500).await;
    let vm = w.get("web").await.unwrap();
    let msg = vm.status.message.clone().unwrap_or_default();
    assert!(msg.contains("guest agent"), "{msg}");
    w.run_for(40_000).await;
    let vm = w.get("web").await.unwrap();
    let exit = vm.status.last_exit.unwrap();
    assert_eq!(exit.kind, ExitKind::Killed);
    assert!(exit.at - stop_at >= 60_000);
}

#[tokio::test]
async fn live_snapshots_are_quiesced_and_always_thawed() {
    let mut w = World::new(5, sim()).await;
    running(&mut w, "db", Readiness::Agent).await;
    w.run_for(6_000).await;
    let inst = w.get("db").await.unwrap().status.instance.unwrap().id;

    let snap = w.take_snapshot("db", "s1").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready);
    assert!(
        snap.status.live && snap.status.quiesced,
        "{:?}",
        snap.status
    );
    assert_eq!(w.hv.freeze_state(&inst), Some((false, 1, 1)));

    // The snapshot itself fails: the guest is thawed all the same.
    w.hv.set_faults(SimFaults {
        op_unavailable: 1.0,
        ..Default::default()
    });
    let snap = w.take_snapshot("db", "s2").await;
    assert_ne!(snap.status.phase, SnapshotPhase::Ready);
    let (frozen, freezes, thaws) = w.hv.freeze_state(&inst).unwrap();
    assert!(!frozen, "left frozen after a failed snapshot");
    assert!(
        freezes > 1 && thaws == freezes,
        "{freezes} freezes, {thaws} thaws"
    );
    w.hv.set_faults(SimFaults::default());

    // The agent stops answering between looks: the snapshot is taken,
    // crash-consistent, and says so.
    w.hv.silence_agent(&inst, true);
    let snap = w.take_snapshot("db", "s3").await;
    assert_eq!(snap.status.phase, SnapshotPhase::Ready);
    assert!(snap.status.live && !snap.status.quiesced);
    assert!(
        snap.status
            .quiesce_note
            .as_deref()
            .unwrap()
            .contains("not quiesced"),
        "{:?}",
        snap.status
    );
    // Once a probe (every 30 s for a ready guest) has seen the agent
    // silent, no freeze is even tried.
    w.run_for(31_000).await;
    let (_, freezes_before, _) = w.hv.freeze_state(&inst).unwrap();
    let snap = w.take_snapshot("db", "s4").await;
    assert!(!snap.status.quiesced);
    assert_eq!(w.hv.freeze_state(&inst).unwrap().1, freezes_before);
}

/// Issue 32: a guest whose agent answers with one 20 KB interface name,
/// 2,000 addresses and a host name full of terminal escapes. Its VM is
/// reconciled as any other (running, ready), and what its record keeps of
/// the guest is capped, escaped and small.
#[tokio::test]
async fn a_hostile_agent_answer_is_capped_and_its_vm_still_reconciles() {
    let addrs: Vec<serde_json::Value> = (0..2_000u32)
        .map(|i| serde_json::json!({"ip-address": format!("10.{}.{}.1", i / 256, i % 256), "prefix": 24}))
        .chain([serde_json::json!({"ip-address": "\u{1b}[2J", "prefix": 300})])
        .collect();
    let mut cfg = sim();
    cfg.agent_answers = Some(keel_hv::sim::SimAgentAnswers {
        interfaces: serde_json::json!([{"name": "x".repeat(20_000), "ip-addresses": addrs}]),
        host_name: serde_json::json!({"host-name": "web\u{1b}]0;pwned\u{7}\u{1b}[2J"}),
    });
    let mut w = World::new(3, cfg).await;
    running(&mut w, "web", Readiness::Agent).await;
    w.run_for(6_000).await;
    let vm = w.get("web").await.unwrap();
    assert_eq!(vm.status.phase, Phase::Running);
    assert!(vm.ready_since().is_some(), "{:?}", vm.status);
    let r = vm
        .status
        .instance
        .as_ref()
        .unwrap()
        .readiness
        .clone()
        .unwrap();
    assert_eq!(r.addresses.len(), keel_api::readiness::MAX_GUEST_ADDRESSES);
    assert!(r
        .addresses
        .iter()
        .all(|a| a.interface.len() <= keel_api::readiness::MAX_INTERFACE_NAME));
    assert_eq!(r.hostname.as_deref(), Some("web\\x1b]0;pwned\\x07\\x1b[2J"));
    let note = r.agent_note.as_deref().unwrap();
    assert!(note.contains("kept 64 of 2000 addresses"), "{note}");
    assert!(note.contains("dropped 1 addresses"), "{note}");
    let record = serde_json::to_vec(&vm).unwrap();
    assert!(record.len() < 16 * 1024, "{} bytes", record.len());
    eprintln!("record of the hostile guest's VM: {} bytes", record.len());
}
