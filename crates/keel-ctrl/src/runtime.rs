//! Drives a [`VmController`] in real time: every VM is reconciled when a
//! change to its record arrives or its requested re-check time comes.

use std::sync::Arc;
use std::time::Duration;

use keel_api::{Clock, VirtualMachine};
use keel_store::StoreError;
use tokio::sync::watch;

use crate::keys::{name_of, VMS_PREFIX};
use crate::{VmController, WorkQueue};

/// Runs until `stop` turns true. Store outages are retried, never fatal.
pub async fn run_vm_controller(
    ctrl: Arc<VmController>,
    clock: Arc<dyn Clock>,
    mut stop: watch::Receiver<bool>,
) {
    let retry_ms = ctrl.config().retry_ms;
    while !*stop.borrow() {
        if let Err(err) = run_until_watch_breaks(&ctrl, &clock, &mut stop).await {
            tracing::warn!(%err, "VM controller watch ended; re-listing");
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(retry_ms)) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

async fn run_until_watch_breaks(
    ctrl: &VmController,
    clock: &Arc<dyn Clock>,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), StoreError> {
    let (vms, revision) = ctrl.store().list::<VirtualMachine>(VMS_PREFIX).await?;
    let mut watch = ctrl.store().raw().watch(VMS_PREFIX, revision + 1).await?;
    let mut queue = WorkQueue::default();
    let now = clock.now_ms();
    for (key, _) in &vms {
        if let Some(name) = name_of(VMS_PREFIX, key) {
            queue.schedule(name, now);
        }
    }
    loop {
        let now = clock.now_ms();
        for name in queue.pop_due(now) {
            match ctrl.reconcile(&name).await {
                Ok(Some(at)) => queue.schedule(&name, at),
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(%err, "reconcile failed");
                    queue.schedule(&name, clock.now_ms() + ctrl.config().retry_ms);
                }
            }
        }
        let wait_ms = queue
            .next_due()
            .map(|at| at.saturating_sub(clock.now_ms()))
            .unwrap_or(60_000);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
            event = watch.next() => match event {
                Some(Ok(event)) => {
                    if let Some(name) = name_of(VMS_PREFIX, event.key()) {
                        queue.schedule(name, clock.now_ms());
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
