//! `keel vm migrate`: a migration the user asked for, carried out by the
//! VM's agent through a drain's path (reservation, `Migration` record,
//! migration controller), but with one attempt and no fallback, and after
//! the drains when the cluster's limit on parallel migrations binds.

mod cluster;

use cluster::{sim, Cluster};
use keel_api::{MigrationPhase, Phase, RunPolicy};
use keel_hv::sim::SimFaults;

async fn request(c: &Cluster, vm: &str, to: Option<&str>) {
    let now = c.now();
    let to = to.map(str::to_string);
    c.update_vm(vm, |v| v.request_migration(to.as_deref(), now).unwrap())
        .await;
}

/// Moves the running VM live (no stop), its disk data along, once.
#[tokio::test]
async fn a_user_migration_moves_the_vm_live_once() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.run(2_000).await;
    c.agent("a").hv.guest_write("vm", 1, "before").unwrap();
    request(&c, "vm", Some("b")).await;
    c.run(20_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    assert_eq!(vm.status.phase, Phase::Running);
    assert!(
        vm.status.last_exit.is_none(),
        "stopped, not migrated: {vm:?}"
    );
    assert!(vm.status.eviction.is_none());
    let outcome = vm.status.migrate_outcome.clone().expect("outcome recorded");
    assert!(outcome.succeeded, "{outcome:?}");
    assert_eq!(c.agent("b").hv.disk_record("vm", 1), Some("before".into()));
    assert!(c.agent("a").hv.live_instances("vm").is_empty());
    // The request stays on the record, handled: never carried out again.
    c.run(20_000).await;
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1, "{ms:?}");
    assert_eq!(ms[0].status.phase, MigrationPhase::Succeeded);
    assert_eq!(Some(ms[0].id.clone()), outcome.migration);
    assert!(c.executing_on("b", "vm"));
}

/// Without `--to` the scheduler's best candidate is taken.
#[tokio::test]
async fn without_a_target_the_scheduler_picks_one() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    request(&c, "vm", None).await;
    c.run(20_000).await;
    assert!(c.executing_on("b", "vm"), "{}", c.explain("vm").await);
    assert!(c.vm("vm").await.status.migrate_outcome.unwrap().succeeded);
}

/// A failed attempt leaves the VM running on its source, untouched, with
/// the reason on the record; it is neither retried nor stopped.
#[tokio::test]
async fn a_failed_user_migration_leaves_the_vm_running_on_the_source() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
    c.run(2_000).await;
    let before = c.vm("vm").await.status.instance.unwrap();
    c.agent("a").hv.set_faults(SimFaults {
        migration_fails: 1.0,
        ..Default::default()
    });
    request(&c, "vm", Some("b")).await;
    c.run(30_000).await;
    c.agent("a").hv.set_faults(SimFaults::default());
    c.run(30_000).await;
    let vm = c.vm("vm").await;
    assert!(c.executing_on("a", "vm"), "{}", c.explain("vm").await);
    assert!(!c.executing_on("b", "vm"));
    assert_eq!(vm.status.phase, Phase::Running);
    assert_eq!(
        vm.status.instance.as_ref().unwrap().id,
        before.id,
        "same instance"
    );
    assert!(vm.status.last_exit.is_none(), "never stopped: {vm:?}");
    assert!(vm.status.eviction.is_none());
    let outcome = vm.status.migrate_outcome.unwrap();
    assert!(!outcome.succeeded);
    assert!(outcome.message.contains("failed"), "{}", outcome.message);
    assert!(outcome.message.contains("keeps running on node a"));
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1, "one attempt, no retry: {ms:?}");
    assert_eq!(ms[0].status.phase, MigrationPhase::Failed);
}

/// While a drain's VMs wait for a migration slot, a user migration does
/// not take one: it starts only after the drain's have.
#[tokio::test]
async fn a_drain_goes_first_when_the_limit_binds() {
    let mut c = Cluster::new(sim());
    c.add_node("a").await;
    let drained: Vec<String> = (0..6).map(|i| format!("d{i}")).collect();
    for name in &drained {
        c.create(name, RunPolicy::AlwaysOn).await;
    }
    c.run(3_000).await;
    c.add_node("c").await;
    c.create("mine", RunPolicy::AlwaysOn).await;
    c.run(3_000).await;
    assert!(c.executing_on("c", "mine"), "{}", c.explain("mine").await);
    c.add_node("b").await;
    c.run(1_000).await;
    // Six VMs leave a, two at a time (the per-node limit): the other four
    // wait, and with the two in flight fill the cluster's five slots.
    c.drain("a").await;
    c.run(1_000).await;
    request(&c, "mine", Some("b")).await;
    let mut waited = false;
    let mut mine_started_with_drain_waiting = false;
    for _ in 0..200 {
        c.tick().await;
        let mut waiting = 0;
        for name in &drained {
            let vm = c.vm(name).await;
            if vm.status.instance.as_ref().is_some_and(|i| i.node == "a")
                && vm
                    .status
                    .eviction
                    .as_ref()
                    .is_none_or(|e| e.migration.is_none())
            {
                waiting += 1;
            }
        }
        let mine = c.migrations_of("mine").await;
        if waiting > 1 && !mine.is_empty() {
            mine_started_with_drain_waiting = true;
        }
        if mine.is_empty()
            && c.vm("mine")
                .await
                .status
                .message
                .is_some_and(|m| m.contains("drains go first"))
        {
            waited = true;
        }
    }
    assert!(waited, "the user migration never waited for the drain");
    assert!(
        !mine_started_with_drain_waiting,
        "the user migration took a slot while the drain's VMs waited"
    );
    c.run(30_000).await;
    assert!(c.executing_on("b", "mine"), "{}", c.explain("mine").await);
    for name in &drained {
        assert!(!c.executing_on("a", name), "{name} still on a");
    }
}

/// A drain that begins while a user migration is under way lets it end
/// (here: its target never gets ready, so it fails at its start deadline),
/// then moves the VM itself; the request, survived by an agent restart,
/// is never carried out again once the VM left its node.
#[tokio::test]
async fn a_drain_during_a_user_migration_lets_it_end_then_moves_the_vm() {
    let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOn).await;
    c.add_node("c").await;
    c.run(1_000).await;
    c.agents[1].migrations_stuck = true;
    request(&c, "vm", Some("b")).await;
    c.restart_agent("a");
    c.run(2_000).await;
    let ev = c
        .vm("vm")
        .await
        .status
        .eviction
        .expect("user migration reserved");
    assert!(ev.user && ev.migration.is_some(), "{ev:?}");
    c.drain("a").await;
    c.run(10_000).await;
    // Still the user's attempt: the drain does not start a second one.
    let ms = c.migrations_of("vm").await;
    assert_eq!(ms.len(), 1, "{ms:?}");
    assert!(c.vm("vm").await.status.eviction.unwrap().user);
    c.run(150_000).await;
    c.agents[1].migrations_stuck = false;
    c.run(60_000).await;
    let vm = c.vm("vm").await;
    let outcome = vm.status.migrate_outcome.clone().expect("outcome");
    assert!(!outcome.succeeded, "{outcome:?}");
    let node = vm.status.instance.as_ref().unwrap().node.clone();
    assert_ne!(node, "a", "the drain moved it: {}", c.explain("vm").await);
    assert!(c.executing_on(&node, "vm"));
    let count = c.migrations_of("vm").await.len();
    c.run(30_000).await;
    assert_eq!(c.migrations_of("vm").await.len(), count, "nothing more");
}

/// Issue 25 item 7 (a): an agent reserved the user's migration on the
/// record (ids and target instance) and stopped before it created the
/// migration record; the user restarted the VM before the record was
/// made. The reservation was made from the instance that is gone: the
/// migration made later moves the running instance to a target id never
/// given out before, the VM ends on b, and nothing of it is left on a (a
/// target named like its source left the paused source on a for good:
/// garbage collection took it for the recorded instance). Both as a
/// record of this Keel (the reservation names its source and target)
/// and of an older one (it does not).
#[tokio::test]
async fn a_restart_between_reservation_and_record_mints_a_new_target_instance() {
    for names_its_instances in [true, false] {
        let mut c = Cluster::vm_on_a_then_b(RunPolicy::AlwaysOnUnlessStoppedManually).await;
        c.run(2_000).await;
        let a = c.agent_index("a");
        c.agents[a].vms_stuck = true;
        c.tick().await;
        let before = c.vm("vm").await;
        let first = before.status.instance.clone().unwrap().id;
        let now = c.now();
        // What the reservation wrote before the agent went away.
        let seq = before.status.instance_seq + 1;
        let reserved_target = format!("vm-{seq}");
        let mut eviction = serde_json::json!({
            "drain_requested_at": now,
            "phase": "Submitting",
            "started_at": now,
            "submit_deadline": now + 300_000,
            "migration": keel_api::Migration::id_for("vm", &before.uid, before.status.migration_seq + 1),
            "user": true,
        });
        if names_its_instances {
            eviction["migration_source"] = first.clone().into();
            eviction["migration_target"] = reserved_target.clone().into();
        }
        let eviction: keel_api::Eviction = serde_json::from_value(eviction).unwrap();
        c.update_vm("vm", |v| {
            v.request_migration(Some("b"), now).unwrap();
            v.status.eviction = Some(eviction.clone());
            v.status.instance_seq = seq;
            v.status.migration_seq += 1;
        })
        .await;
        c.agents[a].vms_stuck = false;
        c.update_vm("vm", |v| v.request_restart().unwrap()).await;
        c.run(10_000).await;
        let label = format!("names its instances: {names_its_instances}");
        let restarted_from = c.vm("vm").await.status.last_exit.map(|e| e.instance);
        assert_eq!(restarted_from, Some(first.clone()), "{label}");
        c.run(30_000).await;
        let ms = c.migrations_of("vm").await;
        assert_eq!(ms.len(), 1, "{label}: {ms:?}");
        let m = &ms[0];
        let given_out = [first.clone(), reserved_target.clone()];
        assert!(
            !given_out.contains(&m.source_instance) && m.target_instance != m.source_instance,
            "{label}: {m:?}"
        );
        assert!(
            !given_out.contains(&m.target_instance),
            "{label}: target {} was given out before: {m:?}",
            m.target_instance
        );
        assert_eq!(m.status.phase, MigrationPhase::Succeeded, "{label}: {m:?}");
        let vm = c.vm("vm").await;
        assert_eq!(
            vm.status.instance.as_ref().unwrap().id,
            m.target_instance,
            "{label}"
        );
        assert!(
            c.executing_on("b", "vm"),
            "{label}: {}",
            c.explain("vm").await
        );
        assert!(
            c.agent("a").hv.live_instances("vm").is_empty(),
            "{label}: left on a: {:?}\n{}",
            c.agent("a").hv.live_instances("vm"),
            c.explain("vm").await
        );
    }
}
