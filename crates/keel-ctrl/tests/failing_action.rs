//! An action that keeps failing is retried on the runtime's retry
//! schedule (`retry_ms`), not at once: neither the reason it writes onto
//! the record (a change of the record, which wakes the VM) nor the failure
//! itself may send the VM straight back into the same call, as fast as the
//! driver refuses it. Counted: the driver's refused calls.

mod common;

use common::{spec, World};
use keel_api::{Millis, Phase, PowerState, RunPolicy, VirtualMachine};
use keel_hv::sim::{SimConfig, SimFaults};

/// The driver calls refused since the faults were set, of `op`.
fn refused(w: &World, op: &str) -> usize {
    w.hv.log()
        .iter()
        .filter(|l| l.ends_with(&format!("{op} unavailable")))
        .count()
}

/// At most one try per retry interval, and one at the start.
fn bound(w: &World, ms: Millis) -> usize {
    (ms / w.cfg.retry_ms) as usize + 2
}

async fn running(seed: u64, name: &str, grace_s: u64) -> World {
    let mut w = World::new(
        seed,
        SimConfig {
            boot_ms: 1_000,
            ..Default::default()
        },
    )
    .await;
    w.create(name, spec(RunPolicy::Manual, PowerState::Running, grace_s))
        .await;
    w.run_for(10_000).await;
    assert_eq!(w.get(name).await.unwrap().status.phase, Phase::Running);
    // Every driver call fails without acting from now on.
    w.hv.set_faults(SimFaults {
        op_unavailable: 1.0,
        ..Default::default()
    });
    w
}

#[tokio::test]
async fn a_stop_that_keeps_failing_is_retried_on_the_retry_schedule() {
    let mut w = running(7, "failstop", 30).await;
    w.user_op("failstop", VirtualMachine::request_stop)
        .await
        .unwrap();
    let ms = 10_000;
    w.run_for(ms).await;
    let vm = w.get("failstop").await.unwrap();
    assert!(
        vm.status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("unavailable")),
        "the reason is on the VM: {vm:?}"
    );
    let tries = refused(&w, "shutdown");
    assert!(
        tries >= 2 && tries <= bound(&w, ms),
        "{tries} shutdown calls in {ms} ms (retry every {} ms)",
        w.cfg.retry_ms
    );
    // Once the driver answers again, the stop goes through.
    w.hv.set_faults(SimFaults::default());
    w.run_for(40_000).await;
    assert_eq!(
        w.get("failstop").await.unwrap().status.phase,
        Phase::Stopped
    );
}

#[tokio::test]
async fn a_delete_that_keeps_failing_is_retried_on_the_retry_schedule() {
    let mut w = running(8, "faildel", 5).await;
    w.request_delete("faildel").await.unwrap();
    let ms = 20_000;
    w.run_for(ms).await;
    let vm = w
        .get("faildel")
        .await
        .expect("not deleted while its domain cannot be ended");
    assert_eq!(vm.status.phase, Phase::Deleting);
    let tries = refused(&w, "kill") + refused(&w, "shutdown") + refused(&w, "cleanup");
    assert!(
        tries >= 2 && tries <= 2 * bound(&w, ms),
        "{tries} calls in {ms} ms: {:?}",
        w.hv.log()
    );
    w.hv.set_faults(SimFaults::default());
    w.run_for(30_000).await;
    assert!(
        w.get("faildel").await.is_none(),
        "deleted once the driver answers"
    );
}
