//! A record's write and the events it makes, as one store write: a VM's
//! status and its phase event used to be two writes (the event keyed by
//! the status write's own revision), which at 10,000 VMs was much of what
//! the store did.
//!
//! The events' keys are derived from what is known before the commit and
//! unique per successful write: the revision the record is written *from*
//! (its compare-and-swap precondition), which a write can succeed from at
//! most once, plus the event's place in the write
//! ([`crate::keys::change_event_key`]). Events stay best effort in
//! meaning: if an event's key is taken, the record is written without its
//! events rather than not at all.

use keel_api::Event;
use keel_store::{Batch, Revision, StoreError, TypedStore};
use serde::Serialize;

use crate::fence::Fence;
use crate::keys::change_event_key;

/// What happens to the record.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RecordChange<'a, T> {
    /// Written with this value.
    Update(&'a T),
    Delete,
}

/// Writes `key` from `revision` as `change` says, with `events` (each the
/// event of `event.vm`) created along in the same store write, under
/// `fence`. The result is the record's: a `Conflict` names `key`.
pub(crate) async fn write_with_events<T: Serialize>(
    store: &TypedStore,
    key: &str,
    change: RecordChange<'_, T>,
    revision: Revision,
    events: &[Event],
    fence: Fence<'_>,
) -> Result<Revision, StoreError> {
    let record = || match change {
        RecordChange::Update(value) => Batch::new().update(key, value, revision),
        RecordChange::Delete => Batch::new().delete(key, revision),
    };
    let batch = events
        .iter()
        .enumerate()
        .fold(record(), |batch, (i, event)| {
            batch.create(&change_event_key(&event.vm, revision, i), event)
        });
    match store.write_all(batch, fence.guard()).await {
        Err(StoreError::Conflict { key: taken, .. }) if taken != key => {
            // Only a hand-made or restored record can hold the key: a
            // write from this revision that made it would have moved the
            // record on, and this write would have failed on the record.
            tracing::warn!(%key, event = %taken, "an event's key is taken; the record is written without its events");
            store.write_all(record(), fence.guard()).await
        }
        result => result,
    }
}
