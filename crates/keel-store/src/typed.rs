//! JSON-typed access on top of any [`Store`].
//!
//! Stored records are read leniently (fields this build does not know are
//! ignored: a newer Keel may have written them) and every record written
//! carries [`keel_api::SCHEMA_VERSION`] in a top-level `schema_version`
//! field. A record that cannot be decoded at all (a hand edit, a type change)
//! never fails a whole list: it is skipped, logged once per revision naming
//! its key, and kept in the store's [`UndecodableLog`] for the agents to
//! record as an event and for the metrics.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::{de::DeserializeOwned, Serialize};

use crate::{Guard, Precondition, Revision, Store, StoreError, Write};

#[derive(Debug, Clone, PartialEq)]
pub struct TypedEntry<T> {
    pub value: T,
    pub revision: Revision,
}

/// A stored record that could not be decoded as the type it was read as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Undecodable {
    pub key: String,
    /// The record's `mod_revision`: a rewrite is reported anew.
    pub revision: Revision,
    pub reason: String,
}

/// A list that skipped what it could not decode.
#[derive(Debug, Clone, PartialEq)]
pub struct Listing<T> {
    pub entries: Vec<(String, TypedEntry<T>)>,
    /// Entries under the prefix that were left out, undecodable.
    pub skipped: Vec<Undecodable>,
    /// The store revision the list is consistent with.
    pub revision: Revision,
}

/// The undecodable records this process has seen, shared by every clone
/// of a [`TypedStore`].
#[derive(Debug, Default)]
pub struct UndecodableLog {
    inner: Mutex<LogState>,
}

#[derive(Debug, Default)]
struct LogState {
    /// Undecodable now, as far as the last read of each key knows.
    current: BTreeMap<String, Undecodable>,
    /// Seen, not yet taken by [`UndecodableLog::take_unreported`].
    unreported: Vec<Undecodable>,
    /// (key, revision) pairs ever seen undecodable: reported only once.
    seen: std::collections::BTreeSet<(String, Revision)>,
    skipped_total: u64,
}

impl UndecodableLog {
    fn found(&self, bad: &Undecodable) {
        let mut s = self.inner.lock().expect("log lock");
        s.skipped_total += 1;
        s.current.insert(bad.key.clone(), bad.clone());
        if s.seen.insert((bad.key.clone(), bad.revision)) {
            tracing::warn!(key = %bad.key, revision = bad.revision, reason = %bad.reason,
                "stored record cannot be decoded; skipped");
            s.unreported.push(bad.clone());
        }
    }

    fn decoded(&self, key: &str) {
        let mut s = self.inner.lock().expect("log lock");
        s.current.remove(key);
    }

    /// Keys under `prefix` the list just read did not find undecodable
    /// (deleted or repaired) are no longer current.
    fn listed(&self, prefix: &str, bad: &[Undecodable]) {
        let mut s = self.inner.lock().expect("log lock");
        s.current
            .retain(|k, _| !k.starts_with(prefix) || bad.iter().any(|b| &b.key == k));
    }

    /// The records undecodable at their last read, in key order.
    pub fn current(&self) -> Vec<Undecodable> {
        let s = self.inner.lock().expect("log lock");
        s.current.values().cloned().collect()
    }

    /// How many times a record was skipped or refused as undecodable.
    pub fn skipped_total(&self) -> u64 {
        self.inner.lock().expect("log lock").skipped_total
    }

    /// Records newly found undecodable (each key and revision once) since
    /// the last call, for recording as events.
    pub fn take_unreported(&self) -> Vec<Undecodable> {
        std::mem::take(&mut self.inner.lock().expect("log lock").unreported)
    }

    /// Puts back what could not be recorded, to try again later.
    pub fn put_back(&self, bad: Undecodable) {
        self.inner.lock().expect("log lock").unreported.push(bad);
    }
}

#[derive(Clone)]
pub struct TypedStore {
    inner: Arc<dyn Store>,
    undecodable: Arc<UndecodableLog>,
}

impl TypedStore {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            undecodable: Arc::default(),
        }
    }

    pub fn raw(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    /// What this store has found undecodable.
    pub fn undecodable(&self) -> &Arc<UndecodableLog> {
        &self.undecodable
    }

    /// An undecodable record is an error here (`Corrupt`, naming the key),
    /// and is reported like a skipped one.
    pub async fn get<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<TypedEntry<T>>, StoreError> {
        match self.inner.get(key).await? {
            None => {
                self.undecodable.decoded(key);
                Ok(None)
            }
            Some(e) => match decode(&e.value) {
                Ok(value) => {
                    self.undecodable.decoded(key);
                    Ok(Some(TypedEntry {
                        value,
                        revision: e.mod_revision,
                    }))
                }
                Err(reason) => {
                    let bad = Undecodable {
                        key: key.to_string(),
                        revision: e.mod_revision,
                        reason: reason.clone(),
                    };
                    self.undecodable.found(&bad);
                    Err(StoreError::Corrupt {
                        key: key.to_string(),
                        reason,
                    })
                }
            },
        }
    }

    pub async fn create<T: Serialize>(&self, key: &str, value: &T) -> Result<Revision, StoreError> {
        self.inner
            .put(key, encode(value), Precondition::Absent)
            .await
    }

    /// Writes `value` only if the key is still at `revision`.
    pub async fn update<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        revision: Revision,
    ) -> Result<Revision, StoreError> {
        self.inner
            .put(key, encode(value), Precondition::Revision(revision))
            .await
    }

    pub async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.inner.delete(key, revision).await
    }

    /// `create`, only while `guard` holds (see [`Guard`]).
    pub async fn create_guarded<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner
            .put_guarded(key, encode(value), Precondition::Absent, guard)
            .await
    }

    /// `update`, only while `guard` holds.
    pub async fn update_guarded<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner
            .put_guarded(key, encode(value), Precondition::Revision(revision), guard)
            .await
    }

    /// `delete`, only while `guard` holds.
    pub async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner.delete_guarded(key, revision, guard).await
    }

    /// Every entry under `prefix` that decodes; the undecodable ones are
    /// skipped (and reported). For callers to whom a missing entry only
    /// means less to go on; where an absent record would lead to acting
    /// (ending a domain, taking a VM over), use [`TypedStore::list_with_skipped`].
    pub async fn list<T: DeserializeOwned>(
        &self,
        prefix: &str,
    ) -> Result<(Vec<(String, TypedEntry<T>)>, Revision), StoreError> {
        let listing = self.list_with_skipped(prefix).await?;
        Ok((listing.entries, listing.revision))
    }

    /// Every entry under `prefix`, and apart from them the ones that could
    /// not be decoded (also reported to [`TypedStore::undecodable`]).
    pub async fn list_with_skipped<T: DeserializeOwned>(
        &self,
        prefix: &str,
    ) -> Result<Listing<T>, StoreError> {
        let (entries, revision) = self.inner.list(prefix).await?;
        let mut out = Vec::with_capacity(entries.len());
        let mut skipped = Vec::new();
        for e in entries {
            match decode(&e.value) {
                Ok(value) => out.push((
                    e.key,
                    TypedEntry {
                        value,
                        revision: e.mod_revision,
                    },
                )),
                Err(reason) => {
                    let bad = Undecodable {
                        key: e.key,
                        revision: e.mod_revision,
                        reason,
                    };
                    self.undecodable.found(&bad);
                    skipped.push(bad);
                }
            }
        }
        self.undecodable.listed(prefix, &skipped);
        Ok(Listing {
            entries: out,
            skipped,
            revision,
        })
    }
}

/// JSON, with `schema_version` set at the top level of an object.
fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut json = serde_json::to_value(value).expect("resource types always serialize");
    if let serde_json::Value::Object(map) = &mut json {
        map.insert(
            keel_api::SCHEMA_VERSION_FIELD.to_string(),
            keel_api::SCHEMA_VERSION.into(),
        );
    }
    serde_json::to_vec(&json).expect("a JSON value always serializes")
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    serde_json::from_slice(bytes).map_err(|e| e.to_string())
}

/// Typed writes gathered for one [`Store::write_all`]: every record or
/// none, at one revision. Records are encoded as [`TypedStore::create`]
/// and [`TypedStore::update`] encode them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    writes: Vec<Write>,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Creates `key`, which must be absent.
    pub fn create<T: Serialize>(mut self, key: &str, value: &T) -> Self {
        self.writes.push(Write::Put {
            key: key.to_string(),
            value: encode(value),
            precondition: Precondition::Absent,
        });
        self
    }

    /// Writes `key`, which must still be at `revision`.
    pub fn update<T: Serialize>(mut self, key: &str, value: &T, revision: Revision) -> Self {
        self.writes.push(Write::Put {
            key: key.to_string(),
            value: encode(value),
            precondition: Precondition::Revision(revision),
        });
        self
    }

    /// Deletes `key`, which must still be at `revision`.
    pub fn delete(mut self, key: &str, revision: Revision) -> Self {
        self.writes.push(Write::Delete {
            key: key.to_string(),
            revision,
        });
        self
    }

    /// The batch without its writes to keys for which `drop` says so.
    pub fn without(mut self, drop: impl Fn(&str) -> bool) -> Self {
        self.writes.retain(|w| !drop(w.key()));
        self
    }

    pub fn writes(&self) -> &[Write] {
        &self.writes
    }
}

impl TypedStore {
    /// Applies `batch` as one atomic write (see [`Store::write_all`]),
    /// only while `guard` holds if one is given.
    pub async fn write_all(
        &self,
        batch: Batch,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        self.inner.write_all(batch.writes, guard).await
    }
}
