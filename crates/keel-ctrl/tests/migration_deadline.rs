//! A migration in Running has a deadline: a source that stops answering
//! (its QEMU stopped, `SimHypervisor::stop_process`) or a cancel that never
//! takes no longer holds the VM. Past it the migration is Failed with its
//! reason, the source stays the VM's one instance (the target never runs:
//! it runs only after a recorded success), and the VM can be stopped again.

mod cluster;

use cluster::{sim, Cluster};
use keel_api::{ExitKind, Migration, MigrationPhase, Phase, RunPolicy};
use keel_hv::sim::{SimConfig, SimFaults};

/// Migrations that send a little and then nothing more, as to a target
/// that stopped reading; `cancel_too_late`: a cancel does not take either.
fn stalling(cancel_too_late: bool) -> SimConfig {
    SimConfig {
        faults: SimFaults {
            migration_stalls: 1.0,
            cancel_too_late: if cancel_too_late { 1.0 } else { 0.0 },
            ..Default::default()
        },
        ..sim()
    }
}

/// Node `a` runs `vm`, `b` joins, and a user migration to `b` is sending.
async fn migrating(sim: SimConfig) -> (Cluster, String, Migration) {
    let mut c = Cluster::new(sim);
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOnUnlessStoppedManually)
        .await;
    c.run(3_000).await;
    c.add_node("b").await;
    let source = c.vm("vm").await.status.instance.unwrap().id;
    let now = c.now();
    c.update_vm("vm", |v| v.request_migration(Some("b"), now).unwrap())
        .await;
    for _ in 0..40 {
        c.tick().await;
        if let Some(m) = running(&c).await {
            return (c, source, m);
        }
    }
    panic!("never sending: {}", c.explain("vm").await);
}

async fn running(c: &Cluster) -> Option<Migration> {
    c.migrations_of("vm")
        .await
        .into_iter()
        .find(|m| m.status.phase == MigrationPhase::Running)
}

/// Ticks until the VM's migration is final (at most `ms`); returns it and
/// when it became final.
async fn until_final(c: &mut Cluster, ms: u64) -> (Migration, u64) {
    let end = c.now() + ms;
    while c.now() < end {
        c.tick().await;
        let m = c.migrations_of("vm").await.pop().expect("migration record");
        if m.status.phase.is_final() {
            return (m, c.now());
        }
    }
    panic!("not final within {ms} ms: {}", c.explain("vm").await);
}

fn only_source_runs(c: &Cluster, source: &str) {
    assert_eq!(c.agent("a").hv.executing_instances("vm"), [source]);
    assert!(c.agent("b").hv.executing_instances("vm").is_empty());
}

/// The record carries the source's own figures for a progress display
/// (`keel vm migrate --wait` on a terminal): what was sent, the total and
/// what remains, recorded together.
#[tokio::test]
async fn a_sending_migration_records_sent_total_and_remaining_bytes() {
    let (mut c, _, _) = migrating(stalling(false)).await;
    c.run(2_000).await;
    let m = running(&c).await.expect("still sending");
    let sent = m.status.progress_bytes.expect("progress recorded");
    let total = m.status.progress_total_bytes.expect("total recorded");
    let remaining = m
        .status
        .progress_remaining_bytes
        .expect("remaining recorded");
    assert!(sent > 0 && sent < total, "{sent} of {total}");
    assert_eq!(sent + remaining, total);
}

/// The source stops answering mid-migration: nothing more is seen sent,
/// so it is failed at the progress timeout (150 s) counted from the last
/// progress seen, the source stays the instance, and a stop asked after
/// ends in a kill at the grace end.
#[tokio::test]
async fn a_source_that_stops_answering_fails_its_migration_at_the_progress_timeout() {
    let (mut c, source, m) = migrating(stalling(false)).await;
    let deadline = m.status.running_deadline.expect("recorded when it began");
    let started = m.status.started_at.unwrap();
    // 150 s per GiB of 128 MiB, plus the progress timeout for the cancel.
    assert_eq!(deadline - started, 300_000);
    c.run(3_000).await;
    c.agent("a").hv.stop_process(&source);
    let stopped_at = c.now();
    let (m, failed_at) = until_final(&mut c, 200_000).await;
    assert_eq!(m.status.phase, MigrationPhase::Failed);
    let why = m.status.message.clone().unwrap_or_default();
    assert!(
        why.contains("no progress seen for 150s") && why.contains("not answered"),
        "{why}"
    );
    let last_progress = m.status.progress_at.unwrap_or(started);
    assert!(last_progress <= stopped_at);
    assert!(
        failed_at >= last_progress + 150_000 && failed_at <= last_progress + 152_000,
        "at the progress timeout: {}",
        failed_at - last_progress
    );
    c.run(5_000).await;
    only_source_runs(&c, &source);
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.instance.as_ref().unwrap().id, source);

    let asked = c.now();
    c.update_vm("vm", |v| v.request_stop().unwrap()).await;
    c.run(35_000).await;
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.phase, Phase::Stopped, "{}", c.explain("vm").await);
    let exit = vm.status.last_exit.unwrap();
    assert_eq!((exit.kind, exit.requested), (ExitKind::Killed, true));
    assert!(exit.at <= asked + 32_000, "{}", exit.at - asked);
    assert!(c.agent("a").hv.live_instances("vm").is_empty());
    assert!(c.agent("b").hv.executing_instances("vm").is_empty());
}

/// A stop asked while the migration's source does not answer: nobody
/// wants the migration any more and it cannot be cancelled, so it is
/// failed at once and the stop runs in the VM's own grace period (30 s),
/// not after the migration's timeouts.
#[tokio::test]
async fn a_stop_under_a_hung_migration_source_runs_within_the_grace_period() {
    let (mut c, source, _) = migrating(stalling(false)).await;
    c.run(2_000).await;
    c.agent("a").hv.stop_process(&source);
    let asked = c.now();
    c.update_vm("vm", |v| v.request_stop().unwrap()).await;
    let (m, failed_at) = until_final(&mut c, 10_000).await;
    assert_eq!(m.status.phase, MigrationPhase::Failed);
    let why = m.status.message.clone().unwrap_or_default();
    assert!(why.contains("no longer wanted"), "{why}");
    assert!(failed_at - asked <= 2_000, "{}", failed_at - asked);
    only_source_runs(&c, &source);
    c.run(35_000).await;
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.phase, Phase::Stopped, "{}", c.explain("vm").await);
    let exit = vm.status.last_exit.unwrap();
    assert_eq!((exit.kind, exit.requested), (ExitKind::Killed, true));
    assert!(exit.at - asked <= 30_000 + 3_000, "{}", exit.at - asked);
    assert!(c.agent("b").hv.executing_instances("vm").is_empty());
}

/// The source answers but a cancel never takes (it stays Active): the
/// running deadline recorded on the migration ends it, also across a
/// restart of every controller in between.
#[tokio::test]
async fn a_cancel_that_never_takes_is_ended_by_the_recorded_deadline() {
    let (mut c, source, m) = migrating(stalling(true)).await;
    let deadline = m.status.running_deadline.expect("recorded");
    c.run(200_000).await;
    let m = running(&c).await.expect("still running, cancelling");
    assert!(
        m.status
            .message
            .as_deref()
            .is_some_and(|w| w.starts_with("cancelling: not completed within 150s")),
        "{:?}",
        m.status
    );
    c.restart_controllers();
    let (m, failed_at) = until_final(&mut c, 120_000).await;
    assert_eq!(m.status.phase, MigrationPhase::Failed);
    let why = m.status.message.unwrap_or_default();
    assert!(why.contains("not finished by its deadline (300s"), "{why}");
    assert!(
        failed_at >= deadline && failed_at <= deadline + 1_000,
        "{}",
        failed_at as i64 - deadline as i64
    );
    c.run(5_000).await;
    only_source_runs(&c, &source);
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.instance.unwrap().id, source);
    assert_eq!(vm.status.phase, Phase::Running);
}

/// A drain of a node whose VM's QEMU is stopped: nothing is sent from an
/// instance nobody can see, so the submission window runs out, the
/// eviction falls back to the stop, the kill comes at the grace end, and
/// only then does the VM start on the other node.
#[tokio::test]
async fn a_drain_evicts_a_vm_whose_qemu_is_stopped_by_a_kill_then_a_start_elsewhere() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    c.create("vm", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    c.add_node("b").await;
    let source = c.vm("vm").await.status.instance.unwrap().id;
    c.agent("a").hv.stop_process(&source);
    c.run(2_000).await;
    let drained = c.now();
    c.drain("a").await;
    let mut killed_at = None;
    for _ in 0..200 {
        c.tick().await;
        if killed_at.is_none() && c.agent("a").hv.live_instances("vm").is_empty() {
            killed_at = Some(c.now());
        }
        if c.executing_on("b", "vm") {
            break;
        }
    }
    let killed_at = killed_at.expect("the stopped source was killed");
    assert!(
        (drained + 40_000..=drained + 43_000).contains(&killed_at),
        "submission window (10 s) then the 30 s grace: {}",
        killed_at - drained
    );
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    let vm = c.vm("vm").await;
    let exit = vm.status.last_exit.unwrap();
    assert_eq!(
        (exit.instance.as_str(), exit.kind),
        (source.as_str(), ExitKind::Killed)
    );
    assert!(c.migrations_of("vm").await.is_empty(), "nothing was sent");
}
