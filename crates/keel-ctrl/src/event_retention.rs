//! Bounded history under `/events/`: at most `per_vm` events per VM and
//! `total` overall, the oldest going first, and none of a VM that no
//! longer exists. Without it every phase change of every VM ever created
//! stayed in the store for good.
//!
//! The choice is pure ([`events_to_prune`]); [`prune_events`] lists,
//! chooses and deletes, each delete a compare-and-swap on the revision
//! listed (under the leader's guard where there is one), so an event
//! rewritten meanwhile is left alone.

use std::collections::{BTreeMap, HashSet};

use keel_api::Millis;
use keel_store::{Revision, StoreError, TypedStore};

use crate::fence::Fence;
use crate::keys::{event_subject, name_of, AUDIT_EVENTS, EVENTS_PREFIX, STORE_EVENTS, VMS_PREFIX};

pub const DEFAULT_MAX_EVENTS_PER_VM: usize = 200;
pub const DEFAULT_MAX_EVENTS: usize = 50_000;
/// The audit trail's own cap: it is one subject, but a busy one.
pub const DEFAULT_MAX_AUDIT_EVENTS: usize = 10_000;
/// How often the leader prunes: each pruning lists every event.
pub const PRUNE_INTERVAL_MS: Millis = 60_000;

/// The caps on the event history (`keel serve --max-events-per-vm`,
/// `--max-events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRetention {
    pub per_vm: usize,
    pub total: usize,
    /// The audit trail's cap (`--max-audit-events`) in place of `per_vm`.
    pub audit: usize,
}

impl Default for EventRetention {
    fn default() -> Self {
        Self {
            per_vm: DEFAULT_MAX_EVENTS_PER_VM,
            total: DEFAULT_MAX_EVENTS,
            audit: DEFAULT_MAX_AUDIT_EVENTS,
        }
    }
}

/// One stored event as listed: its key and `mod_revision`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedEvent {
    pub key: String,
    pub revision: Revision,
}

/// The events to delete: every event of a VM that `exists` denies (its VM
/// was deleted; events about records of no VM, [`STORE_EVENTS`], and the
/// audit trail, [`AUDIT_EVENTS`], are capped but never orphaned: who
/// deleted a VM stays known after it is gone), then the oldest beyond
/// `per_vm` of each VM (`audit` of the audit trail),
/// then the oldest beyond `total` of what is left. Age is the revision the
/// event was written at.
///
/// `exists` must reflect a read made *after* `events` was listed: an event
/// is written after its VM's record, so a VM missing from that later read
/// was deleted after the event, not created after it.
pub fn events_to_prune(
    events: &[ListedEvent],
    exists: impl Fn(&str) -> bool,
    limits: EventRetention,
) -> Vec<ListedEvent> {
    let mut by_vm: BTreeMap<&str, Vec<&ListedEvent>> = BTreeMap::new();
    for event in events {
        by_vm
            .entry(event_subject(&event.key))
            .or_default()
            .push(event);
    }
    let mut prune = Vec::new();
    let mut kept = Vec::new();
    for (vm, mut list) in by_vm {
        if vm != STORE_EVENTS && vm != AUDIT_EVENTS && !exists(vm) {
            prune.extend(list.into_iter().cloned());
            continue;
        }
        list.sort_by_key(|e| e.revision);
        let cap = if vm == AUDIT_EVENTS {
            limits.audit
        } else {
            limits.per_vm
        };
        let excess = list.len().saturating_sub(cap);
        prune.extend(list[..excess].iter().map(|e| (*e).clone()));
        kept.extend_from_slice(&list[excess..]);
    }
    kept.sort_by_key(|e| e.revision);
    let excess = kept.len().saturating_sub(limits.total);
    prune.extend(kept[..excess].iter().map(|e| (*e).clone()));
    prune
}

/// Lists the events, then the VMs, and deletes what [`events_to_prune`]
/// chooses. Returns how many were deleted. An event deleted or rewritten
/// meanwhile (a conflict) is skipped; a lost guard ends the pruning.
pub async fn prune_events(
    store: &TypedStore,
    limits: EventRetention,
    fence: Fence<'_>,
) -> Result<usize, StoreError> {
    let raw = store.raw();
    let (entries, _) = raw.list(EVENTS_PREFIX).await?;
    let events: Vec<ListedEvent> = entries
        .into_iter()
        .map(|e| ListedEvent {
            key: e.key,
            revision: e.mod_revision,
        })
        .collect();
    if events.is_empty() {
        return Ok(0);
    }
    let (vms, _) = raw.list(VMS_PREFIX).await?;
    let names: HashSet<&str> = vms
        .iter()
        .filter_map(|e| name_of(VMS_PREFIX, &e.key))
        .collect();
    let mut deleted = 0;
    for event in events_to_prune(&events, |vm| names.contains(vm), limits) {
        match fence.delete(store, &event.key, event.revision).await {
            Ok(_) => deleted += 1,
            Err(StoreError::Conflict { .. }) => {}
            Err(err) => return Err(err),
        }
    }
    if deleted > 0 {
        tracing::debug!(deleted, "pruned events");
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::event_key;

    fn ev(vm: &str, revision: Revision) -> ListedEvent {
        ListedEvent {
            key: event_key(vm, revision),
            revision,
        }
    }

    fn revisions(list: &[ListedEvent]) -> Vec<Revision> {
        let mut r: Vec<_> = list.iter().map(|e| e.revision).collect();
        r.sort_unstable();
        r
    }

    #[test]
    fn oldest_beyond_each_cap_and_all_of_deleted_vms_go() {
        let events = vec![
            ev("a", 1),
            ev("a", 4),
            ev("a", 7),
            ev("b", 2),
            ev("gone", 3),
            ev(STORE_EVENTS, 5),
            ev("b", 6),
        ];
        let limits = EventRetention {
            per_vm: 2,
            total: 100,
            audit: 100,
        };
        let exists = |vm: &str| vm != "gone";
        assert_eq!(revisions(&events_to_prune(&events, exists, limits)), [1, 3]);
        let limits = EventRetention {
            per_vm: 2,
            total: 3,
            audit: 100,
        };
        // Left after the per-VM cap: 2, 4, 5, 6, 7; the two oldest go.
        assert_eq!(
            revisions(&events_to_prune(&events, exists, limits)),
            [1, 2, 3, 4]
        );
    }

    #[test]
    fn the_audit_trail_has_its_own_cap_and_is_never_orphaned() {
        let events: Vec<ListedEvent> = (1..=5).map(|r| ev(AUDIT_EVENTS, r)).collect();
        let limits = EventRetention {
            per_vm: 1,
            total: 100,
            audit: 3,
        };
        // No VM exists, yet only the oldest beyond the audit cap go.
        assert_eq!(
            revisions(&events_to_prune(&events, |_| false, limits)),
            [1, 2]
        );
    }
}
