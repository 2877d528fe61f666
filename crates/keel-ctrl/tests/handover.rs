//! The handover of a live migration, with the source killed at each step.
//! A target waits paused once the whole state has arrived and runs only
//! after the migration's success is recorded (and the VM record names it).
//! A source gone before any outcome was seen is "unknown", settled by the
//! target's state: never a guess. The harness checks at every tick that no
//! VM executes twice and that what executes is what the record names.

mod cluster;

use cluster::Cluster;
use keel_api::{Migration, MigrationPhase, Phase, RunPolicy};
use keel_ctrl::LifecycleConfig;
use keel_hv::sim::SimFaults;
use keel_hv::{DomainState, Hypervisor};

const DATA: &str = "written before the drain";

/// VM `vm` on node a with data on its disk, node b empty, a draining.
async fn draining() -> Cluster {
    let c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.agent("a").hv.guest_write("vm", 1, DATA).unwrap();
    c.drain("a").await;
    c
}

async fn migration(c: &Cluster) -> Option<Migration> {
    c.migrations_of("vm").await.into_iter().last()
}

/// Ticks until the VM's (latest) migration satisfies `pred`.
async fn until(c: &mut Cluster, what: &str, pred: impl Fn(&Migration) -> bool) -> Migration {
    for _ in 0..100 {
        if let Some(m) = migration(c).await.filter(|m| pred(m)) {
            return m;
        }
        c.tick().await;
    }
    panic!("never {what}: {:?}", migration(c).await);
}

async fn target_state(c: &Cluster, m: &Migration) -> Option<DomainState> {
    c.agent("b")
        .hv
        .info(&m.target_instance)
        .await
        .ok()
        .map(|i| i.state)
}

/// The migration failed and the VM came back from its disk: running once,
/// its data there.
async fn failed_and_restarted(c: &mut Cluster, id: &str) {
    c.run(60_000).await;
    let m = c
        .migrations_of("vm")
        .await
        .into_iter()
        .find(|m| m.id == id)
        .unwrap();
    assert_eq!(m.status.phase, MigrationPhase::Failed, "{m:?}");
    let vm = c.vm("vm").await;
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    let node = vm.status.instance.as_ref().unwrap().node.clone();
    assert!(c.executing_on(&node, "vm"));
    assert_eq!(
        c.agent(&node).hv.disk_record("vm", 1).as_deref(),
        Some(DATA)
    );
    // The target of the failed attempt never ran and is gone.
    assert!(!c
        .agent("b")
        .hv
        .executing_instances("vm")
        .contains(&m.target_instance));
}

/// The migration succeeded and the target runs the guest: no restart.
async fn handed_over(c: &mut Cluster, id: &str) -> Migration {
    c.run(10_000).await;
    let m = c
        .migrations_of("vm")
        .await
        .into_iter()
        .find(|m| m.id == id)
        .unwrap();
    assert_eq!(m.status.phase, MigrationPhase::Succeeded, "{m:?}");
    let vm = c.vm("vm").await;
    let inst = vm.status.instance.clone().unwrap();
    assert_eq!(
        (inst.node.as_str(), inst.id.as_str()),
        ("b", m.target_instance.as_str())
    );
    assert_eq!(vm.status.phase, Phase::Running, "{vm:?}");
    assert!(
        vm.status.last_exit.is_none(),
        "restarted, not handed over: {vm:?}"
    );
    assert_eq!(target_state(c, &m).await, Some(DomainState::Running));
    assert!(c.executing_on("b", "vm"));
    assert_eq!(c.agent("b").hv.disk_record("vm", 1).as_deref(), Some(DATA));
    m
}

#[tokio::test]
async fn source_killed_before_the_target_starts() {
    let mut c = draining().await;
    let b = c.agents.iter().position(|a| a.name == "b").unwrap();
    c.agents[b].migrations_stuck = true;
    let m = until(&mut c, "created", |m| {
        m.status.phase == MigrationPhase::Pending
    })
    .await;
    c.agent("a").hv.crash(&m.source_instance);
    c.agents[b].migrations_stuck = false;
    failed_and_restarted(&mut c, &m.id).await;
}

#[tokio::test]
async fn source_killed_while_the_target_listens() {
    let mut c = draining().await;
    let a = c.agents.iter().position(|a| a.name == "a").unwrap();
    c.agents[a].migrations_stuck = true;
    let m = until(&mut c, "target ready", |m| {
        m.status.phase == MigrationPhase::TargetReady
    })
    .await;
    c.agent("a").hv.crash(&m.source_instance);
    c.agents[a].migrations_stuck = false;
    failed_and_restarted(&mut c, &m.id).await;
}

#[tokio::test]
async fn source_killed_mid_stream() {
    let mut c = draining().await;
    let m = until(&mut c, "sending", |m| {
        m.status.phase == MigrationPhase::Running
    })
    .await;
    assert_eq!(target_state(&c, &m).await, Some(DomainState::Starting));
    c.agent("a").hv.crash(&m.source_instance);
    failed_and_restarted(&mut c, &m.id).await;
}

/// Everything arrived, the source's agent has not yet seen the outcome,
/// and the source dies: unknown from the source, settled by the target,
/// which holds the whole state.
#[tokio::test]
async fn source_killed_after_the_state_arrived_before_the_outcome_was_seen() {
    let mut c = draining().await;
    let a = c.agents.iter().position(|a| a.name == "a").unwrap();
    let m = until(&mut c, "sending", |m| {
        m.status.phase == MigrationPhase::Running
    })
    .await;
    c.agents[a].migrations_stuck = true;
    for _ in 0..20 {
        if target_state(&c, &m).await == Some(DomainState::Paused) {
            break;
        }
        c.tick().await;
    }
    assert_eq!(
        target_state(&c, &m).await,
        Some(DomainState::Paused),
        "arrived, waiting"
    );
    c.run(2_000).await;
    assert_eq!(
        target_state(&c, &m).await,
        Some(DomainState::Paused),
        "the target ran before the outcome was recorded"
    );
    c.agent("a").hv.crash(&m.source_instance);
    c.agents[a].migrations_stuck = false;
    let m = handed_over(&mut c, &m.id).await;
    assert!(m.status.source_gone_at.is_some(), "{m:?}");
}

/// As above, but the source's whole node loses power: nobody reports the
/// source gone; once its lease is out (it is fenced), the target settles.
#[tokio::test]
async fn source_node_lost_after_the_state_arrived() {
    let mut c = draining().await;
    let a = c.agents.iter().position(|a| a.name == "a").unwrap();
    let m = until(&mut c, "sending", |m| {
        m.status.phase == MigrationPhase::Running
    })
    .await;
    c.agents[a].migrations_stuck = true;
    for _ in 0..20 {
        if target_state(&c, &m).await == Some(DomainState::Paused) {
            break;
        }
        c.tick().await;
    }
    c.agents[a].running = false;
    c.agents[a].hv.power_failure();
    let lease = LifecycleConfig::default().node_lease_ms;
    c.run(lease / 2).await;
    let now = migration(&c).await.unwrap();
    assert_eq!(
        now.status.phase,
        MigrationPhase::Running,
        "settled by a guess: {now:?}"
    );
    assert_eq!(target_state(&c, &m).await, Some(DomainState::Paused));
    c.run(lease).await;
    handed_over(&mut c, &m.id).await;
}

/// The success is recorded, the VM record still names the source, and the
/// source dies: the recorded success is honoured, the target resumes.
#[tokio::test]
async fn source_killed_after_the_success_was_recorded() {
    let mut c = draining().await;
    until(&mut c, "sending", |m| {
        m.status.phase == MigrationPhase::Running
    })
    .await;
    // The VM controllers hold still, so the success is on the migration
    // but not yet on the VM (the runtime would otherwise take it over at
    // once: the migration's change wakes its VM).
    for a in c.agents.iter_mut() {
        a.vms_stuck = true;
    }
    let m = until(&mut c, "succeeded", |m| {
        m.status.phase == MigrationPhase::Succeeded
    })
    .await;
    let vm = c.vm("vm").await;
    assert_eq!(
        vm.status.instance.unwrap().id,
        m.source_instance,
        "handover not yet on the VM"
    );
    assert_eq!(target_state(&c, &m).await, Some(DomainState::Paused));
    c.agent("a").hv.crash(&m.source_instance);
    for a in c.agents.iter_mut() {
        a.vms_stuck = false;
    }
    handed_over(&mut c, &m.id).await;
}

/// The target gets the whole state but the source reports a failure and
/// runs on. A target that ran on arrival would run beside it; this one
/// never runs and is ended.
#[tokio::test]
async fn an_unconfirmed_handover_never_runs_the_target() {
    let mut c = draining().await;
    c.agent("a").hv.set_faults(SimFaults {
        handover_unconfirmed: 1.0,
        ..Default::default()
    });
    until(&mut c, "sending", |m| {
        m.status.phase == MigrationPhase::Running
    })
    .await;
    // b's agent pauses, so nothing on b (garbage collection) can hide a
    // target that ran by itself.
    let b = c.agents.iter().position(|a| a.name == "b").unwrap();
    c.agents[b].running = false;
    let m = until(&mut c, "failed", |m| {
        m.status.phase == MigrationPhase::Failed
    })
    .await;
    assert!(c.executing_on("a", "vm"), "the source runs on");
    assert_eq!(
        target_state(&c, &m).await,
        Some(DomainState::Paused),
        "arrived"
    );
    assert!(!c
        .agent("b")
        .hv
        .executing_instances("vm")
        .contains(&m.target_instance));
    c.agents[b].running = true;
    c.run(5_000).await;
    assert!(
        c.agent("b")
            .hv
            .live_instances("vm")
            .iter()
            .all(|i| i != &m.target_instance),
        "the abandoned target is ended"
    );
}

/// What the VM record and the target said at one tick after the handover.
#[derive(Debug)]
struct Seen {
    at: keel_api::Millis,
    phase: Phase,
    target: Option<DomainState>,
}

/// Carries the VM's migration (already requested) through its handover,
/// with b's migration controller held for a few seconds once the record
/// names the target: the target's VM controller then looks at it while it
/// still waits paused, as a loaded machine may order those looks. Every
/// tick from the handover on, until the target has run for a while.
async fn through_the_handover(c: &mut Cluster) -> Vec<Seen> {
    let m = until(c, "sending", |m| m.status.phase == MigrationPhase::Running).await;
    let b = c.agent_index("b");
    c.agents[b].migrations_stuck = true;
    let mut seen: Vec<Seen> = vec![];
    let mut target_ran_for = 0;
    for _ in 0..200 {
        c.tick().await;
        let vm = c.vm("vm").await;
        if vm.status.instance.as_ref().map(|i| &i.id) != Some(&m.target_instance) {
            assert!(seen.is_empty(), "the record left the target: {vm:?}");
            continue;
        }
        let target = target_state(c, &m).await;
        seen.push(Seen {
            at: c.now(),
            phase: vm.status.phase,
            target,
        });
        if seen.len() == 6 {
            c.agents[b].migrations_stuck = false;
        }
        if target == Some(DomainState::Running) {
            target_ran_for += 1;
            if target_ran_for == 10 {
                return seen;
            }
        }
    }
    panic!(
        "the target never ran for long: {seen:?}\n{}",
        c.explain("vm").await
    );
}

/// The guest of a live migration never stopped: from the handover on, the
/// record says Running, also while the target still waits to be resumed.
fn running_throughout(seen: &[Seen]) {
    assert!(
        seen.iter().any(|s| s.target == Some(DomainState::Paused)),
        "the target was never seen waiting after the handover: {seen:?}"
    );
    let fell_back: Vec<(keel_api::Millis, Phase)> = seen
        .iter()
        .filter(|s| s.phase != Phase::Running)
        .map(|s| (s.at - seen[0].at, s.phase))
        .collect();
    assert!(
        fell_back.is_empty(),
        "not Running after the handover (ms after it, phase): {fell_back:?}\nall: {seen:?}"
    );
}

/// Once the target has run, it is an instance like any other.
async fn resumed(c: &Cluster) {
    let inst = c.vm("vm").await.status.instance.unwrap();
    assert_eq!(inst.resuming_after, None, "{inst:?}");
}

#[tokio::test]
async fn a_drained_vm_is_running_from_the_handover_on() {
    let mut c = draining().await;
    let seen = through_the_handover(&mut c).await;
    running_throughout(&seen);
    resumed(&c).await;
    let id = migration(&c).await.unwrap().id;
    handed_over(&mut c, &id).await;
}

#[tokio::test]
async fn a_vm_migrated_on_request_is_running_from_the_handover_on() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.agent("a").hv.guest_write("vm", 1, DATA).unwrap();
    let now = c.now();
    c.update_vm("vm", |v| v.request_migration(Some("b"), now).unwrap())
        .await;
    let seen = through_the_handover(&mut c).await;
    running_throughout(&seen);
    resumed(&c).await;
    let id = migration(&c).await.unwrap().id;
    let m = handed_over(&mut c, &id).await;
    let outcome = c.vm("vm").await.status.migrate_outcome.unwrap();
    assert!(outcome.succeeded, "{outcome:?}");
    assert_eq!(outcome.migration.as_deref(), Some(m.id.as_str()));
}
