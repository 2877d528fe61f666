//! Drives the controllers in real time: each resource is reconciled when a
//! change to its record arrives or its requested re-check time comes.

use std::sync::Arc;
use std::time::Duration;

use keel_api::Clock;
use keel_store::StoreError;
use tokio::sync::watch;

use crate::keys::{
    migration_of, name_of, snapshot_of, MIGRATIONS_PREFIX, SNAPSHOTS_PREFIX, VMS_PREFIX,
};
use crate::{MigrationController, SnapshotController, VmController, WorkQueue};

/// How often this node's heartbeat is written and stray domains are ended.
const HOUSEKEEPING_MS: u64 = 5_000;

/// Runs the VM controller and a snapshot controller sharing its store, node
/// and clock, until `stop` turns true.
pub async fn run_vm_controller(
    vms: Arc<VmController>,
    clock: Arc<dyn Clock>,
    stop: watch::Receiver<bool>,
) {
    let snapshots = Arc::new(vms.snapshot_controller());
    let migrations = Arc::new(vms.migration_controller());
    run_controllers(vms, snapshots, migrations, clock, stop).await
}

/// Runs until `stop` turns true. Store outages are retried, never fatal.
pub async fn run_controllers(
    vms: Arc<VmController>,
    snapshots: Arc<SnapshotController>,
    migrations: Arc<MigrationController>,
    clock: Arc<dyn Clock>,
    stop: watch::Receiver<bool>,
) {
    // Housekeeping runs on its own: during a store outage the reconcile
    // loop is stuck re-listing, and that is exactly when self-fencing must
    // still happen.
    tokio::join!(
        run_reconcilers(&vms, &snapshots, &migrations, &clock, stop.clone()),
        run_housekeeping(&vms, &clock, stop),
    );
}

/// The heartbeat (with the fence-lease renewal) and the other chores run
/// on loops of their own: a chore stuck on a hung hypervisor or store call
/// must never delay the heartbeat, or a healthy node would be fenced.
async fn run_housekeeping(vms: &VmController, clock: &Arc<dyn Clock>, stop: watch::Receiver<bool>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    // The chores act on the cluster's state only while this node's own
    // heartbeat gets through, as a node cut off must not take over others.
    let heartbeat_ok_at = AtomicU64::new(clock.now_ms());
    let lease = async {
        let mut stop = stop.clone();
        let mut last_heartbeat_ok = clock.now_ms();
        while !*stop.borrow() {
            // A heartbeat that hangs counts as failed, so self-fencing is
            // judged on time, whatever the store does.
            let bounded = tokio::time::timeout(
                Duration::from_millis(HOUSEKEEPING_MS),
                vms.keep_lease(&mut last_heartbeat_ok),
            );
            let outcome = bounded.await;
            heartbeat_ok_at.store(last_heartbeat_ok, Ordering::Relaxed);
            if outcome.is_err() {
                tracing::warn!("heartbeat timed out");
                if vms.self_fence_due(last_heartbeat_ok) {
                    vms.self_fence().await;
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(HOUSEKEEPING_MS)) => {}
                _ = stop.changed() => {}
            }
        }
    };
    let chores = async {
        let mut stop = stop.clone();
        while !*stop.borrow() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(HOUSEKEEPING_MS)) => {}
                _ = stop.changed() => {}
            }
            let fresh = clock
                .now_ms()
                .saturating_sub(heartbeat_ok_at.load(Ordering::Relaxed))
                <= 2 * HOUSEKEEPING_MS;
            if !*stop.borrow() && fresh {
                vms.chores().await;
            }
        }
    };
    tokio::join!(lease, chores);
}

async fn run_reconcilers(
    vms: &VmController,
    snapshots: &SnapshotController,
    migrations: &MigrationController,
    clock: &Arc<dyn Clock>,
    mut stop: watch::Receiver<bool>,
) {
    let retry_ms = vms.config().retry_ms;
    while !*stop.borrow() {
        if let Err(err) = run_until_watch_breaks(vms, snapshots, migrations, clock, &mut stop).await
        {
            tracing::warn!(%err, "controller watch ended; re-listing");
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(retry_ms)) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

async fn run_until_watch_breaks(
    vms: &VmController,
    snapshots: &SnapshotController,
    migrations: &MigrationController,
    clock: &Arc<dyn Clock>,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), StoreError> {
    let store = vms.store().raw();
    let (vm_entries, vm_rev) = store.list(VMS_PREFIX).await?;
    let (snap_entries, snap_rev) = store.list(SNAPSHOTS_PREFIX).await?;
    let mut vm_watch = store.watch(VMS_PREFIX, vm_rev + 1).await?;
    let mut snap_watch = store.watch(SNAPSHOTS_PREFIX, snap_rev + 1).await?;
    let (mig_entries, mig_rev) = store.list(MIGRATIONS_PREFIX).await?;
    let mut mig_watch = store.watch(MIGRATIONS_PREFIX, mig_rev + 1).await?;
    let mut mig_queue = WorkQueue::default();
    for e in &mig_entries {
        if migration_of(&e.key).is_some() {
            mig_queue.schedule(&e.key, clock.now_ms());
        }
    }

    let mut vm_queue = WorkQueue::default();
    // An exit seen by the driver wakes its VM at once: without it a guest
    // that powered off in 40 ms waits for the stop schedule's next check.
    let mut exits = vms.exit_events();
    let mut snap_queue = WorkQueue::default();
    let now = clock.now_ms();
    for e in &vm_entries {
        if let Some(name) = name_of(VMS_PREFIX, &e.key) {
            vm_queue.schedule(name, now);
        }
    }
    for e in &snap_entries {
        if snapshot_of(&e.key).is_some() {
            snap_queue.schedule(&e.key, now);
        }
    }
    let retry_ms = vms.config().retry_ms;
    loop {
        let now = clock.now_ms();
        for name in vm_queue.pop_due(now) {
            match vms.reconcile(&name).await {
                Ok(Some(at)) => vm_queue.schedule(&name, at),
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(%err, "reconcile failed");
                    vms.observer().reconcile_failed("vm");
                    vm_queue.schedule(&name, clock.now_ms() + retry_ms);
                }
            }
        }
        for key in snap_queue.pop_due(now) {
            let Some((vm, name)) = snapshot_of(&key) else {
                continue;
            };
            match snapshots.reconcile(vm, name).await {
                Ok(Some(at)) => snap_queue.schedule(&key, at),
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(%err, "snapshot reconcile failed");
                    vms.observer().reconcile_failed("snapshot");
                    snap_queue.schedule(&key, clock.now_ms() + retry_ms);
                }
            }
        }
        for key in mig_queue.pop_due(now) {
            let Some((vm, id)) = migration_of(&key) else {
                continue;
            };
            match migrations.reconcile(vm, id).await {
                Ok(Some(at)) => mig_queue.schedule(&key, at),
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(%err, vm, migration = id, "migration reconcile failed");
                    vms.observer().reconcile_failed("migration");
                    mig_queue.schedule(&key, clock.now_ms() + retry_ms);
                }
            }
        }
        let next = [
            vm_queue.next_due(),
            snap_queue.next_due(),
            mig_queue.next_due(),
        ]
        .into_iter()
        .flatten()
        .min();
        let wait_ms = next
            .map(|at| at.saturating_sub(clock.now_ms()))
            .unwrap_or(60_000);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
            Some(exit) = next_exit(&mut exits) => {
                vm_queue.schedule(&exit.vm, clock.now_ms());
            }
            event = vm_watch.next() => match event {
                Some(Ok(event)) => {
                    if let Some(name) = name_of(VMS_PREFIX, event.key()) {
                        vm_queue.schedule(name, clock.now_ms());
                    }
                }
                Some(Err(err)) => return Err(err),
                None => return Ok(()),
            },
            event = snap_watch.next() => match event {
                Some(Ok(event)) => {
                    if snapshot_of(event.key()).is_some() {
                        snap_queue.schedule(event.key(), clock.now_ms());
                    }
                    // A snapshot may unblock a restore waiting on it.
                    if let Some((vm, _)) = snapshot_of(event.key()) {
                        vm_queue.schedule(vm, clock.now_ms());
                    }
                }
                Some(Err(err)) => return Err(err),
                None => return Ok(()),
            },
            event = mig_watch.next() => match event {
                Some(Ok(event)) => {
                    if let Some((vm, _)) = migration_of(event.key()) {
                        mig_queue.schedule(event.key(), clock.now_ms());
                        // A migration's progress moves its VM's eviction on.
                        vm_queue.schedule(vm, clock.now_ms());
                    }
                }
                Some(Err(err)) => return Err(err),
                None => return Ok(()),
            },
            _ = stop.changed() => {
                if *stop.borrow() {
                    return Ok(());
                }
            }
        }
    }
}

/// The next exit notification; never resolves without a channel.
async fn next_exit(
    exits: &mut Option<tokio::sync::broadcast::Receiver<keel_hv::DomainExit>>,
) -> Option<keel_hv::DomainExit> {
    use tokio::sync::broadcast::error::RecvError;
    let Some(rx) = exits else {
        return std::future::pending().await;
    };
    loop {
        match rx.recv().await {
            Ok(exit) => return Some(exit),
            // Missed some: the scheduled re-checks still find them.
            Err(RecvError::Lagged(_)) => continue,
            Err(RecvError::Closed) => {
                *exits = None;
                return std::future::pending().await;
            }
        }
    }
}
