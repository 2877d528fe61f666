//! Keel's state lives behind the [`Store`] trait: a revisioned key-value
//! store in the style of etcd v3. Every write bumps one store-wide revision;
//! writes are conditional on the revision the writer read, so a stale writer
//! gets [`StoreError::Conflict`] instead of silently overwriting.

// Production code handles its errors; `unwrap` is for tests (which
// compile this crate with cfg(test)), `expect` states an invariant.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod conformance;
mod error;
pub mod etcd;
pub mod memory;
pub mod node_shards;
pub mod sqlite;
mod typed;

pub use error::StoreError;
pub use typed::{Batch, Listing, TypedEntry, TypedStore, Undecodable, UndecodableLog};

use async_trait::async_trait;

/// Store-wide, strictly increasing revision. 0 means "never written".
pub type Revision = u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Vec<u8>,
    /// Revision at which the key was created (changes if it is deleted and re-created).
    pub create_revision: Revision,
    /// Revision of the last write to this key; the token for compare-and-swap.
    pub mod_revision: Revision,
}

/// The condition a write is made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precondition {
    /// The key must not exist (create).
    Absent,
    /// The key must exist with exactly this `mod_revision`.
    Revision(Revision),
}

impl Precondition {
    /// The `mod_revision` it expects (`None`: the key absent).
    pub fn expected(self) -> Option<Revision> {
        match self {
            Precondition::Absent => None,
            Precondition::Revision(r) => Some(r),
        }
    }

    /// The `Conflict` a write of `key` under this precondition gives
    /// against the key's current `mod_revision` (`None`: absent), or
    /// `None` if it holds.
    pub fn conflict(self, key: &str, actual: Option<Revision>) -> Option<StoreError> {
        let expected = self.expected();
        (actual != expected).then(|| StoreError::Conflict {
            key: key.to_string(),
            expected,
            actual,
        })
    }
}

/// One write of an atomic batch (see [`Store::write_all`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// Writes `value` at `key` if `precondition` holds. The key is not
    /// attached to a lease (a leased key is detached, as by `put`).
    Put {
        key: String,
        value: Vec<u8>,
        precondition: Precondition,
    },
    /// Deletes `key` if its `mod_revision` is `revision`.
    Delete { key: String, revision: Revision },
}

impl Write {
    pub fn key(&self) -> &str {
        match self {
            Write::Put { key, .. } | Write::Delete { key, .. } => key,
        }
    }

    /// The `Conflict` this write's precondition gives against the key's
    /// current `mod_revision` (`None`: absent), or `None` if it holds.
    pub fn conflict(&self, actual: Option<Revision>) -> Option<StoreError> {
        let precondition = match self {
            Write::Put { precondition, .. } => *precondition,
            Write::Delete { revision, .. } => Precondition::Revision(*revision),
        };
        precondition.conflict(self.key(), actual)
    }
}

/// Refuses a batch [`Store::write_all`] cannot apply as asked: empty, or
/// naming a key twice (which write would win is not defined).
pub fn check_batch(writes: &[Write]) -> Result<(), StoreError> {
    let Some(first) = writes.first() else {
        return Err(StoreError::InvalidWrite {
            key: String::new(),
            reason: "an atomic write needs at least one key".into(),
        });
    };
    let mut seen = std::collections::HashSet::with_capacity(writes.len());
    for write in writes {
        if !seen.insert(write.key()) {
            return Err(StoreError::InvalidWrite {
                key: write.key().to_string(),
                reason: format!(
                    "the key is written twice in one atomic write (first key {})",
                    first.key()
                ),
            });
        }
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    Put(Entry),
    Deleted { key: String, revision: Revision },
}

impl WatchEvent {
    pub fn revision(&self) -> Revision {
        match self {
            WatchEvent::Put(e) => e.mod_revision,
            WatchEvent::Deleted { revision, .. } => *revision,
        }
    }
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(e) => &e.key,
            WatchEvent::Deleted { key, .. } => key,
        }
    }
}

/// A stream of changes under a prefix, in revision order, without gaps.
pub struct Watch {
    pub(crate) rx: tokio::sync::mpsc::Receiver<Result<WatchEvent, StoreError>>,
}

impl Watch {
    pub fn new(rx: tokio::sync::mpsc::Receiver<Result<WatchEvent, StoreError>>) -> Self {
        Self { rx }
    }
    /// The next change; `None` once the store is closed. An error (for
    /// example `Compacted`) ends the watch: re-list and watch again.
    pub async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        self.rx.recv().await
    }

    /// What [`Self::next`] gives, if it need not wait: `None` while no
    /// change has arrived (and the store is open).
    pub fn next_now(&mut self) -> Option<Option<Result<WatchEvent, StoreError>>> {
        match self.rx.try_recv() {
            Ok(item) => Some(Some(item)),
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => Some(None),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => None,
        }
    }
}

pub type LeaseId = i64;

/// Fences a write on a key the writer created and still owns: typically a
/// leader key held under a lease. A guarded write applies only if `key`
/// exists with exactly this `create_revision`, checked atomically with the
/// write itself; once the key is deleted (lease expired or revoked) or
/// re-created by someone else, every write under the guard fails with
/// [`StoreError::GuardLost`] and changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Guard {
    pub key: String,
    pub create_revision: Revision,
}

impl Guard {
    /// Whether `entry` (the guard key as read now) is still this guard's key.
    pub fn holds(&self, entry: Option<&Entry>) -> bool {
        entry.is_some_and(|e| e.key == self.key && e.create_revision == self.create_revision)
    }

    pub(crate) fn lost(&self) -> StoreError {
        StoreError::GuardLost {
            guard: self.key.clone(),
        }
    }
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError>;

    /// Writes `value` if `precondition` holds; returns the new revision.
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
    ) -> Result<Revision, StoreError>;

    /// Like `put`, but the key is deleted when `lease` expires or is revoked.
    /// A plain `put` over a leased key detaches it from its lease, as in etcd.
    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError>;

    /// Deletes the key if its `mod_revision` is `revision`.
    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError>;

    /// Like `put`, and only while `guard` holds (see [`Guard`]): the guard
    /// and the precondition are checked atomically with the write. A lost
    /// guard is reported as [`StoreError::GuardLost`] even if the
    /// precondition fails too. The result names no lease: the written key
    /// is not attached to one.
    ///
    /// The default refuses every guarded write (fail closed), so a wrapper
    /// store that does not forward it can never write unfenced.
    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError>;

    /// Like `delete`, and only while `guard` holds; see `put_guarded`.
    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError>;

    /// Applies every write in `writes` or none, as one new revision that
    /// all of them share: each written key's `mod_revision` (and a created
    /// key's `create_revision`) is the returned revision, and watchers see
    /// one event per key at that revision, in the order given. Every
    /// precondition (and `guard`, if given, as in `put_guarded`) is checked
    /// atomically with all the writes; if one fails nothing is written and
    /// the error is the `Conflict` of the first failing write, naming its
    /// key (`GuardLost` wins over a conflict). An empty batch, or one that
    /// names a key twice, is `InvalidWrite`.
    ///
    /// The default refuses every batch (fail closed), so a wrapper store
    /// that does not forward it can never write half of one.
    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        let _ = guard;
        Err(StoreError::Unavailable {
            key: writes
                .first()
                .map(|w| w.key().to_string())
                .unwrap_or_default(),
            reason: "this store does not implement atomic writes of several keys".into(),
        })
    }

    /// All keys under `prefix` in key order, and the store revision the list
    /// is consistent with (the revision to watch from, plus one).
    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError>;

    /// How many keys are under `prefix`. The default lists them; the
    /// stores count without reading values, so a cap checked at every
    /// create costs no copy of every record.
    async fn count(&self, prefix: &str) -> Result<u64, StoreError> {
        Ok(self.list(prefix).await?.0.len() as u64)
    }

    /// Changes under `prefix` with revision >= `from` (0 and 1 both mean
    /// "everything still in history"). Fails with `Compacted` if part of
    /// that range is no longer kept; the error may also arrive as the first
    /// item of the stream.
    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError>;

    /// A lease that expires `ttl_ms` after its last keep-alive. Expiry and
    /// revocation delete every key attached to the lease.
    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError>;
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError>;
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError>;
}
