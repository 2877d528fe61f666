//! Per-node copies of the VM records, so a node's agent can watch only
//! the records that concern it.
//!
//! etcd filters a watch by key range only. With every agent watching
//! every VM record, each change went to every agent (and etcd sent it to
//! each): at 10,000 VMs on 10 agents, nine in ten watch events an agent
//! received, and most of etcd's and the agents' CPU, were about other
//! nodes' VMs. [`ShardedStore`] keeps, beside each record under the
//! records prefix (`/vms/NAME`), a copy under each node the record names
//! as one to act on it (`/vm-shards/NODE/NAME`), written in the same
//! atomic write as the record; [`ShardedStore::node_view`] lists and
//! watches one node's copies as if they were the records.
//!
//! Invariant, kept by every write through this store: for a record at
//! revision `r`, a copy exists for exactly the nodes `members_of` names in
//! it, each holding the record's bytes at `mod_revision` `r`; a record
//! that leaves a node (or is deleted) deletes that node's copy, which the
//! node's watch sees as the record's deletion. No caller writes a copy:
//! a write to a shard key is refused. Each record write's copies are
//! written with exact preconditions (absent, or at the record's old
//! revision), so a wrong idea of the old record's nodes fails the write
//! instead of breaking the invariant; it is then read afresh and the
//! write made again. A copy's `create_revision` is the copy's own (the
//! revision the record came to that node), not the record's.
//!
//! A store written before this (or by a writer without it) has records
//! without copies: [`ShardedStore::repair`] rewrites each record whose
//! copies are wrong, with its copies.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::{
    check_batch, Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch,
    WatchEvent, Write,
};

/// The nodes a stored record is to be copied to (empty for a record no
/// node acts on, or one that does not decode).
pub type MembersOf = Arc<dyn Fn(&[u8]) -> Vec<String> + Send + Sync>;

/// Where the copies live: `<root><node>/<name>`.
pub const SHARDS_ROOT: &str = "/vm-shards/";

const FORWARD_CHANNEL: usize = 256;

/// A store that keeps per-node copies of the records under one prefix.
pub struct ShardedStore {
    inner: Arc<dyn Store>,
    shape: Arc<Shape>,
}

/// Where records and copies are, and what is known of each record's nodes.
struct Shape {
    records: String,
    shards: String,
    members_of: MembersOf,
    /// Each record at the revision last seen: writes need the old
    /// record's nodes, and a record seen by this process (its own write, a
    /// read, a watched change) is not read again for them.
    known: Mutex<HashMap<String, (Revision, Nodes)>>,
}

/// A record's nodes, or its bytes until they are asked for: most records
/// a process sees it never writes, and judging each change as it came
/// cost every watcher a decode per change.
enum Nodes {
    Judged(Vec<String>),
    Unjudged(Vec<u8>),
}

/// What [`ShardedStore::repair`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Repaired {
    /// Records rewritten with their copies.
    pub records: usize,
    /// Copies deleted whose record is gone.
    pub orphans: usize,
    /// Records or copies that changed meanwhile (left to their writer).
    pub raced: usize,
}

impl ShardedStore {
    /// Copies of the records under `records` (e.g. `/vms/`), to the nodes
    /// `members_of` names, under [`SHARDS_ROOT`].
    pub fn new(inner: Arc<dyn Store>, records: &str, members_of: MembersOf) -> Self {
        Self {
            inner,
            shape: Arc::new(Shape {
                records: records.to_string(),
                shards: SHARDS_ROOT.to_string(),
                members_of,
                known: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// A view of this store in which the records prefix holds only the
    /// records that concern `node` (a list and a watch of it read the
    /// node's copies); everything else is this store.
    pub fn node_view(self: &Arc<Self>, node: &str) -> Result<Arc<dyn Store>, StoreError> {
        if !valid_segment(node) {
            return Err(StoreError::InvalidWrite {
                key: node.to_string(),
                reason: "a node's shard needs a node name without '/'".into(),
            });
        }
        Ok(Arc::new(NodeView {
            store: Arc::clone(self),
            shard: format!("{}{node}/", self.shape.shards),
        }))
    }

    /// The nodes of `name`'s record at `revision`: as last seen, else
    /// read. `None` when the record is not at that revision (the write
    /// expecting it fails on the record itself).
    async fn members_at(
        &self,
        name: &str,
        revision: Revision,
    ) -> Result<Option<Vec<String>>, StoreError> {
        if let Some(members) = self.shape.judged_at(name, revision) {
            return Ok(Some(members));
        }
        match self
            .inner
            .get(&format!("{}{name}", self.shape.records))
            .await?
        {
            Some(entry) if entry.mod_revision == revision => {
                self.shape.learn_entry(&entry);
                Ok(self.shape.judged_at(name, revision))
            }
            _ => Ok(None),
        }
    }

    /// The copies' current revisions (`None`: absent) on `nodes`.
    async fn copies_now(
        &self,
        name: &str,
        nodes: Vec<String>,
    ) -> Result<BTreeMap<String, Option<Revision>>, StoreError> {
        let mut now = BTreeMap::new();
        for node in nodes {
            let entry = self.inner.get(&self.shape.copy_key(&node, name)).await?;
            now.insert(node, entry.map(|e| e.mod_revision));
        }
        Ok(now)
    }

    /// `writes` with the copy writes each record write needs, after all
    /// of the caller's writes (so a failing precondition of theirs is the
    /// one reported); and each record's nodes once written (`None`:
    /// deleted). With `afresh`, each copy's precondition is what the store
    /// holds now rather than what the invariant says it holds.
    async fn with_copies(
        &self,
        writes: &[Write],
        afresh: bool,
    ) -> Result<(Vec<Write>, Vec<(String, Option<Vec<String>>)>), StoreError> {
        let mut copies = Vec::new();
        let mut after = Vec::new();
        for write in writes {
            if self.shape.is_shard_key(write.key()) {
                return Err(StoreError::InvalidWrite {
                    key: write.key().to_string(),
                    reason: "a node's copy of a record is written only with the record".into(),
                });
            }
            let Some(name) = self.shape.record_name(write.key()) else {
                continue;
            };
            let (old_revision, value) = match write {
                Write::Put {
                    value,
                    precondition,
                    ..
                } => (precondition.expected(), Some(value)),
                Write::Delete { revision, .. } => (Some(*revision), None),
            };
            let old = match old_revision {
                Some(r) => self.members_at(name, r).await?.unwrap_or_default(),
                None => Vec::new(),
            };
            let new = value.map(|v| self.shape.members(v)).unwrap_or_default();
            let preconditions: BTreeMap<String, Option<Revision>> = if afresh {
                let candidates = old.iter().chain(&new).cloned().collect();
                self.copies_now(name, candidates).await?
            } else {
                old.iter()
                    .map(|n| (n.clone(), old_revision))
                    .chain(
                        new.iter()
                            .filter(|n| !old.contains(n))
                            .map(|n| (n.clone(), None)),
                    )
                    .collect()
            };
            for (node, held) in &preconditions {
                let key = self.shape.copy_key(node, name);
                match (value, new.contains(node), held) {
                    (Some(value), true, _) => copies.push(Write::Put {
                        key,
                        value: value.clone(),
                        precondition: match held {
                            Some(r) => Precondition::Revision(*r),
                            None => Precondition::Absent,
                        },
                    }),
                    (_, _, Some(r)) => copies.push(Write::Delete { key, revision: *r }),
                    (_, _, None) => {}
                }
            }
            after.push((name.to_string(), value.map(|_| new)));
        }
        let mut all = writes.to_vec();
        all.extend(copies);
        Ok((all, after))
    }

    /// Applies `writes` (at least one of them a record's) with their
    /// copies, all or nothing.
    async fn write_with_copies(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        check_batch(&writes)?;
        let mut afresh = false;
        loop {
            let (all, after) = self.with_copies(&writes, afresh).await?;
            match self.inner.write_all(all, guard).await {
                Ok(revision) => {
                    let mut known = self.shape.known();
                    for (name, members) in after {
                        match members {
                            Some(members) => {
                                known.insert(name, (revision, Nodes::Judged(members)));
                            }
                            None => {
                                known.remove(&name);
                            }
                        }
                    }
                    return Ok(revision);
                }
                // The caller's writes all held but a copy was not as the
                // invariant says (an old record's nodes misjudged, or a
                // record written without its copies): once more, with the
                // copies as they are now.
                Err(StoreError::Conflict { key, .. })
                    if self.shape.is_shard_key(&key) && !afresh =>
                {
                    tracing::debug!(copy = %key, "a node's copy was not as expected; writing again with the copies as stored");
                    self.forget(&writes);
                    afresh = true;
                }
                Err(StoreError::Conflict { key, .. }) if self.shape.is_shard_key(&key) => {
                    return Err(StoreError::Unavailable {
                        key,
                        reason:
                            "a node's copy of the record changed while it was written; try again"
                                .into(),
                    });
                }
                Err(err) => return Err(err),
            }
        }
    }

    fn forget(&self, writes: &[Write]) {
        let mut known = self.shape.known();
        for write in writes {
            if let Some(name) = self.shape.record_name(write.key()) {
                known.remove(name);
            }
        }
    }

    /// Makes every record's copies what the invariant says: a record
    /// whose copies are missing, stale or extra is written again
    /// (unchanged) with its copies, and a copy of a record that is gone is
    /// deleted. Safe beside other writers: each write is conditional, and
    /// one that races is left (its writer kept the invariant).
    pub async fn repair(&self) -> Result<Repaired, StoreError> {
        let (records, _) = self.inner.list(&self.shape.records).await?;
        let (copies, _) = self.inner.list(&self.shape.shards).await?;
        let mut held: HashMap<String, BTreeMap<String, Revision>> = HashMap::new();
        for copy in &copies {
            let Some(rest) = copy.key.strip_prefix(self.shape.shards.as_str()) else {
                continue;
            };
            if let Some((node, name)) = rest.split_once('/') {
                held.entry(name.to_string())
                    .or_default()
                    .insert(node.to_string(), copy.mod_revision);
            }
        }
        let mut repaired = Repaired::default();
        for record in &records {
            let Some(name) = self.shape.record_name(&record.key) else {
                continue;
            };
            let members = self.shape.members(&record.value);
            let copies = held.remove(name).unwrap_or_default();
            let right = copies.len() == members.len()
                && members
                    .iter()
                    .all(|n| copies.get(n) == Some(&record.mod_revision));
            if right {
                continue;
            }
            let mut writes = vec![Write::Put {
                key: record.key.clone(),
                value: record.value.clone(),
                precondition: Precondition::Revision(record.mod_revision),
            }];
            for node in &members {
                writes.push(Write::Put {
                    key: self.shape.copy_key(node, name),
                    value: record.value.clone(),
                    precondition: match copies.get(node) {
                        Some(r) => Precondition::Revision(*r),
                        None => Precondition::Absent,
                    },
                });
            }
            for (node, revision) in copies.iter().filter(|(n, _)| !members.contains(n)) {
                writes.push(Write::Delete {
                    key: self.shape.copy_key(node, name),
                    revision: *revision,
                });
            }
            match self.inner.write_all(writes, None).await {
                Ok(revision) => {
                    self.shape
                        .known()
                        .insert(name.to_string(), (revision, Nodes::Judged(members)));
                    repaired.records += 1;
                }
                Err(StoreError::Conflict { .. }) => repaired.raced += 1,
                Err(err) => return Err(err),
            }
        }
        // What is left holds copies of records that are gone.
        for (name, copies) in held {
            for (node, revision) in copies {
                match self
                    .inner
                    .delete(&self.shape.copy_key(&node, &name), revision)
                    .await
                {
                    Ok(_) => repaired.orphans += 1,
                    Err(StoreError::Conflict { .. }) => repaired.raced += 1,
                    Err(err) => return Err(err),
                }
            }
        }
        Ok(repaired)
    }

    /// Hands on `inner`'s events, without shard keys (when `hide` is set)
    /// and taking note of each record seen.
    fn forward(&self, mut inner: Watch, hide: bool, map: Option<String>) -> Watch {
        let (tx, rx) = mpsc::channel(FORWARD_CHANNEL);
        let store = Arc::clone(&self.shape);
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    _ = tx.closed() => return,
                    event = inner.next() => event,
                };
                let Some(event) = event else { return };
                let event = match event {
                    Ok(event) => event,
                    Err(err) => {
                        let _ = tx.send(Err(err)).await;
                        return;
                    }
                };
                let event = match &map {
                    Some(shard) => match store.as_record_event(shard, event) {
                        Some(event) => event,
                        None => continue,
                    },
                    None if hide && store.is_shard_key(event.key()) => continue,
                    None => event,
                };
                match &event {
                    WatchEvent::Put(entry) => store.learn_entry(entry),
                    WatchEvent::Deleted { key, revision } => {
                        if let Some(name) = store.record_name(key) {
                            store.learn(name, *revision, None);
                        }
                    }
                }
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Watch::new(rx)
    }
}

impl Shape {
    fn record_name<'a>(&self, key: &'a str) -> Option<&'a str> {
        key.strip_prefix(self.records.as_str())
            .filter(|name| valid_segment(name))
    }

    fn is_shard_key(&self, key: &str) -> bool {
        key.starts_with(self.shards.as_str())
    }

    /// Whether a write of `key` is one with copies (a record's), or one
    /// refused (a copy's): either way not the inner store's to take alone.
    fn copied(&self, key: &str) -> bool {
        self.record_name(key).is_some() || self.is_shard_key(key)
    }

    /// Whether a list or watch of `prefix` takes in shard keys.
    fn covers_shards(&self, prefix: &str) -> bool {
        self.shards.starts_with(prefix)
    }

    /// Whether a list or watch of `prefix` takes in records.
    fn covers_records(&self, prefix: &str) -> bool {
        self.records.starts_with(prefix) || prefix.starts_with(self.records.as_str())
    }

    fn copy_key(&self, node: &str, name: &str) -> String {
        format!("{}{node}/{name}", self.shards)
    }

    fn members(&self, value: &[u8]) -> Vec<String> {
        let set: BTreeSet<String> = (self.members_of)(value)
            .into_iter()
            .filter(|n| valid_segment(n))
            .collect();
        set.into_iter().collect()
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Revision, Nodes)>> {
        self.known.lock().expect("shard membership lock")
    }

    /// The nodes of `name`'s record at `revision`, if that is the record
    /// last seen (judged now if it was not yet).
    fn judged_at(&self, name: &str, revision: Revision) -> Option<Vec<String>> {
        let mut known = self.known();
        let (seen, nodes) = known.get_mut(name)?;
        if *seen != revision {
            return None;
        }
        let members = match nodes {
            Nodes::Judged(members) => members.clone(),
            Nodes::Unjudged(bytes) => self.members(bytes),
        };
        *nodes = Nodes::Judged(members.clone());
        Some(members)
    }

    /// Takes note of `name`'s record as read or written at `revision`.
    fn learn(&self, name: &str, revision: Revision, value: Option<&[u8]>) {
        let mut known = self.known();
        match value {
            Some(value) => {
                match known.get_mut(name) {
                    // A revision is one value: one already held (this
                    // process's own write coming back on the watch, most
                    // often, judged as it was written) is kept.
                    Some(held) if held.0 >= revision => {}
                    Some(held) => *held = (revision, Nodes::Unjudged(value.to_vec())),
                    None => {
                        known.insert(
                            name.to_string(),
                            (revision, Nodes::Unjudged(value.to_vec())),
                        );
                    }
                }
            }
            None => {
                if known.get(name).is_some_and(|held| held.0 <= revision) {
                    known.remove(name);
                }
            }
        }
    }

    fn learn_entry(&self, entry: &Entry) {
        if let Some(name) = self.record_name(&entry.key) {
            self.learn(name, entry.mod_revision, Some(&entry.value));
        }
    }

    /// A copy's event in `shard`, as its record's.
    fn as_record_event(&self, shard: &str, event: WatchEvent) -> Option<WatchEvent> {
        let record_key = |key: &str| {
            key.strip_prefix(shard)
                .filter(|name| valid_segment(name))
                .map(|name| format!("{}{name}", self.records))
        };
        match event {
            WatchEvent::Put(mut entry) => {
                entry.key = record_key(&entry.key)?;
                Some(WatchEvent::Put(entry))
            }
            WatchEvent::Deleted { key, revision } => Some(WatchEvent::Deleted {
                key: record_key(&key)?,
                revision,
            }),
        }
    }
}

fn valid_segment(s: &str) -> bool {
    !s.is_empty() && !s.contains('/')
}

#[async_trait]
impl Store for ShardedStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let entry = self.inner.get(key).await?;
        if let Some(entry) = &entry {
            self.shape.learn_entry(entry);
        }
        Ok(entry)
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
    ) -> Result<Revision, StoreError> {
        if self.shape.copied(key) {
            let write = Write::Put {
                key: key.to_string(),
                value,
                precondition,
            };
            return self.write_with_copies(vec![write], None).await;
        }
        self.inner.put(key, value, precondition).await
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        if self.shape.copied(key) {
            return Err(StoreError::InvalidWrite {
                key: key.to_string(),
                reason: "a record copied to nodes is not attached to a lease".into(),
            });
        }
        self.inner
            .put_with_lease(key, value, precondition, lease)
            .await
    }

    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        if self.shape.copied(key) {
            let write = Write::Delete {
                key: key.to_string(),
                revision,
            };
            return self.write_with_copies(vec![write], None).await;
        }
        self.inner.delete(key, revision).await
    }

    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        if self.shape.copied(key) {
            let write = Write::Put {
                key: key.to_string(),
                value,
                precondition,
            };
            return self.write_with_copies(vec![write], Some(guard)).await;
        }
        self.inner
            .put_guarded(key, value, precondition, guard)
            .await
    }

    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        if self.shape.copied(key) {
            let write = Write::Delete {
                key: key.to_string(),
                revision,
            };
            return self.write_with_copies(vec![write], Some(guard)).await;
        }
        self.inner.delete_guarded(key, revision, guard).await
    }

    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        if writes.iter().any(|w| self.shape.copied(w.key())) {
            return self.write_with_copies(writes, guard).await;
        }
        self.inner.write_all(writes, guard).await
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError> {
        let (mut entries, revision) = self.inner.list(prefix).await?;
        if self.shape.covers_shards(prefix) {
            entries.retain(|e| !self.shape.is_shard_key(&e.key));
        }
        Ok((entries, revision))
    }

    async fn count(&self, prefix: &str) -> Result<u64, StoreError> {
        if self.shape.covers_shards(prefix) {
            return Ok(self.list(prefix).await?.0.len() as u64);
        }
        self.inner.count(prefix).await
    }

    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError> {
        let inner = self.inner.watch(prefix, from).await?;
        let hide = self.shape.covers_shards(prefix);
        if hide || self.shape.covers_records(prefix) {
            return Ok(self.forward(inner, hide, None));
        }
        Ok(inner)
    }

    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError> {
        self.inner.grant_lease(ttl_ms).await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.keep_alive(lease).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.revoke_lease(lease).await
    }
}

/// One node's view: the records prefix lists and watches that node's
/// copies, as records.
struct NodeView {
    store: Arc<ShardedStore>,
    /// `<root><node>/`.
    shard: String,
}

impl NodeView {
    fn is_records(&self, prefix: &str) -> bool {
        prefix == self.store.shape.records
    }
}

#[async_trait]
impl Store for NodeView {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.store.get(key).await
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
    ) -> Result<Revision, StoreError> {
        self.store.put(key, value, precondition).await
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.store
            .put_with_lease(key, value, precondition, lease)
            .await
    }

    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.store.delete(key, revision).await
    }

    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.store
            .put_guarded(key, value, precondition, guard)
            .await
    }

    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.store.delete_guarded(key, revision, guard).await
    }

    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        self.store.write_all(writes, guard).await
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError> {
        if !self.is_records(prefix) {
            return self.store.list(prefix).await;
        }
        let (copies, revision) = self.store.inner.list(&self.shard).await?;
        let mut records = Vec::with_capacity(copies.len());
        for copy in copies {
            let Some(name) = copy.key.strip_prefix(self.shard.as_str()) else {
                continue;
            };
            if !valid_segment(name) {
                continue;
            }
            let entry = Entry {
                key: format!("{}{name}", self.store.shape.records),
                ..copy
            };
            self.store.shape.learn_entry(&entry);
            records.push(entry);
        }
        Ok((records, revision))
    }

    async fn count(&self, prefix: &str) -> Result<u64, StoreError> {
        if !self.is_records(prefix) {
            return self.store.count(prefix).await;
        }
        self.store.inner.count(&self.shard).await
    }

    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError> {
        if !self.is_records(prefix) {
            return self.store.watch(prefix, from).await;
        }
        let inner = self.store.inner.watch(&self.shard, from).await?;
        Ok(self.store.forward(inner, false, Some(self.shard.clone())))
    }

    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError> {
        self.store.grant_lease(ttl_ms).await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.store.keep_alive(lease).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.store.revoke_lease(lease).await
    }
}
