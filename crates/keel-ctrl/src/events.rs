//! The operator-readable trail under `/events/`: phase changes of VMs and
//! records found undecodable.

use keel_api::{Event, Millis, Phase, StopReason, VirtualMachine};
use keel_store::{StoreError, TypedStore};

use crate::fence::Fence;
use crate::keys::{event_key, event_subject};

/// The event of a phase change, if `new` changes `old`'s phase: kept as
/// an operator-readable trail, written along with the VM record
/// ([`crate::recorded_write`]). Best effort: the VM record is the truth.
pub(crate) fn phase_event(
    old: &VirtualMachine,
    new: &VirtualMachine,
    now: Millis,
) -> Option<Event> {
    if old.status.phase == new.status.phase {
        return None;
    }
    let event = Event {
        at: now,
        vm: new.name.clone(),
        from: old.status.phase,
        to: new.status.phase,
        reason: change_reason(new),
        key: None,
    };
    tracing::info!(vm = %new.name, from = ?event.from, to = ?event.to, reason = %event.reason, "phase change");
    Some(event)
}

/// Records each record newly found undecodable as an event of the VM it
/// belongs to (see [`event_subject`]), once per key and revision across the
/// cluster: the event's key is derived from the record's revision, and
/// whoever creates it first wins. Ones that could not be written are kept
/// for the next call.
pub(crate) async fn report_undecodable(store: &TypedStore, now: Millis, fence: Fence<'_>) {
    for bad in store.undecodable().take_unreported() {
        let event = Event {
            at: now,
            vm: event_subject(&bad.key).to_string(),
            from: Phase::default(),
            to: Phase::default(),
            reason: format!(
                "record {} (revision {}) cannot be decoded and is skipped: {}",
                bad.key, bad.revision, bad.reason
            ),
            key: Some(bad.key.clone()),
        };
        match fence
            .create(store, &event_key(&event.vm, bad.revision), &event)
            .await
        {
            Ok(_) | Err(StoreError::Conflict { .. }) => {}
            Err(err) => {
                tracing::warn!(key = %bad.key, %err, "could not record the undecodable record");
                store.undecodable().put_back(bad);
            }
        }
    }
}

fn change_reason(vm: &VirtualMachine) -> String {
    let status = &vm.status;
    if let Some(stop) = &status.stop {
        return match stop.reason {
            StopReason::User => "stop requested by user".into(),
            StopReason::Restart => "restart requested".into(),
            StopReason::Delete => "delete requested".into(),
            StopReason::Policy => "run policy AlwaysOff".into(),
            StopReason::Restore => "restore from snapshot".into(),
            StopReason::Evict => "evicted from a draining node".into(),
        };
    }
    if let (None, Some(exit)) = (&status.instance, &status.last_exit) {
        return format!(
            "instance {} exited ({:?}{})",
            exit.instance,
            exit.kind,
            if exit.requested { ", requested" } else { "" }
        );
    }
    if let Some(inst) = &status.instance {
        return format!("instance {} on node {}", inst.id, inst.node);
    }
    status
        .message
        .clone()
        .unwrap_or_else(|| "reconciled".into())
}
