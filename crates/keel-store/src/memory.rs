//! In-memory store for simulation tests.
//!
//! Everything lives behind one `std::sync::Mutex`, never held across an
//! `.await`, so the store behaves the same under any runtime and a seeded
//! current-thread simulation replays identically. Leases are timed by an
//! injected [`Clock`] and expire lazily: every operation (and
//! [`MemoryStore::expire_leases`]) first deletes the keys of leases whose
//! deadline has passed, so a simulation that moves a `ManualClock` sees the
//! deletions on its next store call rather than at a wall-clock moment.
//!
//! Fault injection ([`MemoryStore::set_fail_next`],
//! [`MemoryStore::set_fault_hook`], [`MemoryStore::set_fail_probability`],
//! [`MemoryStore::fail_watches`], [`MemoryStore::compact`]) lets tests drive
//! the controller through the store failures it has to survive.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use async_trait::async_trait;
use keel_api::{Clock, Millis, SystemClock};
use tokio::sync::{mpsc, watch};

use crate::{
    check_batch, Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch,
    WatchEvent, Write,
};

/// How many revisions of history are kept for `watch(.., from)` by default.
pub const DEFAULT_HISTORY_LIMIT: usize = 10_000;

/// Events a watch forwards per lock acquisition; bounds how long a slow
/// watcher can hold the store lock.
const WATCH_BATCH: usize = 256;
/// History entries scanned per lock acquisition, so a watch on a quiet
/// prefix does not hold the lock while skipping a long busy history.
const WATCH_SCAN: usize = 4096;
/// Buffer between a watch's pump task and its consumer.
const WATCH_CHANNEL: usize = 256;

/// The kind of operation a fault hook is asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Get,
    Put,
    Delete,
    List,
    Watch,
    GrantLease,
    KeepAlive,
    RevokeLease,
    /// [`MemoryStore::expire_leases`].
    ExpireLeases,
}

impl OpKind {
    /// Whether the operation can change the store.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            OpKind::Put
                | OpKind::Delete
                | OpKind::GrantLease
                | OpKind::KeepAlive
                | OpKind::RevokeLease
                | OpKind::ExpireLeases
        )
    }
}

/// An operation about to run, as shown to a fault hook.
#[derive(Debug, Clone, Copy)]
pub struct Op<'a> {
    pub kind: OpKind,
    /// The key, or the prefix for `List`/`Watch`; empty for lease operations.
    pub key: &'a str,
    /// The lease for `KeepAlive`, `RevokeLease` and `put_with_lease`.
    pub lease: Option<LeaseId>,
}

impl Op<'_> {
    /// What an injected `Unavailable` error names as its key.
    fn subject(&self) -> String {
        match (self.kind, self.lease) {
            (OpKind::KeepAlive | OpKind::RevokeLease, Some(l)) => format!("lease {l}"),
            (OpKind::GrantLease, _) => "lease (grant)".to_string(),
            (OpKind::ExpireLeases, _) => "leases (expiry)".to_string(),
            _ => self.key.to_string(),
        }
    }
}

/// What an injected fault does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Fail with `Unavailable` without touching the store.
    Unavailable(String),
    /// Apply the operation, then report `Unavailable` anyway: the reply was
    /// lost after the commit, as with a timeout against a real server. The
    /// caller cannot tell this from `Unavailable`, which is the point.
    /// Behaves like `Unavailable` for reads and watches.
    AppliedThenUnavailable(String),
}

/// Decides, per operation, whether to inject a fault. Called with the store
/// lock held, in operation order: it must not call back into the store.
pub type FaultHook = Box<dyn FnMut(&Op<'_>) -> Option<Fault> + Send>;

struct Slot {
    value: Vec<u8>,
    create_revision: Revision,
    mod_revision: Revision,
    lease: Option<LeaseId>,
}

struct Lease {
    ttl_ms: u64,
    expires_at: Millis,
    keys: BTreeSet<String>,
}

#[derive(Default)]
struct Faults {
    fail_next: u64,
    hook: Option<FaultHook>,
    injected: u64,
}

impl Faults {
    fn check(&mut self, op: &Op<'_>) -> Option<Fault> {
        if self.fail_next > 0 {
            self.fail_next -= 1;
            self.injected += 1;
            return Some(Fault::Unavailable("injected fault (fail_next)".into()));
        }
        let fault = self.hook.as_mut()?(op);
        if fault.is_some() {
            self.injected += 1;
        }
        fault
    }
}

struct State {
    kv: BTreeMap<String, Slot>,
    revision: Revision,
    /// Every change after `compacted`, in revision order: one event per
    /// revision, except an atomic write ([`Store::write_all`]), which has
    /// one per key at its one revision. Every revision has at least one
    /// event, so watches are gap-free; history is kept and dropped in whole
    /// revisions, so nobody sees half of an atomic write.
    history: VecDeque<WatchEvent>,
    compacted: Revision,
    history_limit: usize,
    leases: BTreeMap<LeaseId, Lease>,
    next_lease: LeaseId,
    /// Earliest lease deadline, so the per-operation expiry check is one
    /// comparison rather than a scan of all leases.
    earliest_expiry: Option<Millis>,
    faults: Faults,
    /// Bumped by `fail_watches`; a watch started under an older epoch ends.
    watch_epoch: u64,
    watch_fail_reason: String,
}

impl State {
    fn record(&mut self, event: WatchEvent) {
        self.history.push_back(event);
        self.trim_history();
    }

    /// Drops the oldest revisions (all their events) while more than
    /// `history_limit` revisions are kept; never the newest revision.
    fn trim_history(&mut self) {
        while self.revision - self.compacted > self.history_limit as Revision {
            let Some(oldest) = self.history.front().map(WatchEvent::revision) else {
                break;
            };
            if oldest >= self.revision {
                break;
            }
            while self.history.front().is_some_and(|e| e.revision() == oldest) {
                self.history.pop_front();
            }
            self.compacted = oldest;
        }
    }

    /// Fails unless `guard` (if any) still names its key's incarnation.
    fn check_guard(&self, guard: Option<&Guard>) -> Result<(), StoreError> {
        match guard {
            Some(g)
                if self.kv.get(&g.key).map(|s| s.create_revision) != Some(g.create_revision) =>
            {
                Err(g.lost())
            }
            _ => Ok(()),
        }
    }

    fn put(
        &mut self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: Option<LeaseId>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        self.check_guard(guard)?;
        let actual = self.kv.get(key).map(|s| s.mod_revision);
        if let Some(conflict) = precondition.conflict(key, actual) {
            return Err(conflict);
        }
        if let Some(l) = lease {
            if !self.leases.contains_key(&l) {
                return Err(StoreError::LeaseNotFound { lease: l });
            }
        }
        let revision = self.revision + 1;
        self.revision = revision;
        self.apply_put(key, value, lease, revision);
        Ok(revision)
    }

    /// Every write of `writes` at one new revision, or none (see
    /// [`Store::write_all`]).
    fn write_all(
        &mut self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        check_batch(&writes)?;
        self.check_guard(guard)?;
        for write in &writes {
            let actual = self.kv.get(write.key()).map(|s| s.mod_revision);
            if let Some(conflict) = write.conflict(actual) {
                return Err(conflict);
            }
        }
        let revision = self.revision + 1;
        self.revision = revision;
        for write in writes {
            match write {
                Write::Put { key, value, .. } => self.apply_put(&key, value, None, revision),
                Write::Delete { key, .. } => self.apply_remove(&key, revision),
            }
        }
        Ok(revision)
    }

    /// Writes the key at `revision`, already checked and claimed.
    fn apply_put(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>, revision: Revision) {
        let existing = self.kv.get(key);
        let old_lease = existing.and_then(|s| s.lease);
        let create_revision = existing.map_or(revision, |s| s.create_revision);
        if old_lease != lease {
            if let Some(old) = old_lease.and_then(|l| self.leases.get_mut(&l)) {
                old.keys.remove(key);
            }
            if let Some(new) = lease.and_then(|l| self.leases.get_mut(&l)) {
                new.keys.insert(key.to_string());
            }
        }
        let entry = Entry {
            key: key.to_string(),
            value,
            create_revision,
            mod_revision: revision,
        };
        match self.kv.get_mut(key) {
            Some(slot) => {
                slot.value.clone_from(&entry.value);
                slot.mod_revision = revision;
                slot.lease = lease;
            }
            None => {
                self.kv.insert(
                    entry.key.clone(),
                    Slot {
                        value: entry.value.clone(),
                        create_revision,
                        mod_revision: revision,
                        lease,
                    },
                );
            }
        }
        self.record(WatchEvent::Put(entry));
    }

    fn delete(
        &mut self,
        key: &str,
        expected: Revision,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        self.check_guard(guard)?;
        let actual = self.kv.get(key).map(|s| s.mod_revision);
        if let Some(conflict) = Precondition::Revision(expected).conflict(key, actual) {
            return Err(conflict);
        }
        Ok(self.remove(key))
    }

    /// Removes an existing key unconditionally, as one revision.
    fn remove(&mut self, key: &str) -> Revision {
        let revision = self.revision + 1;
        self.revision = revision;
        self.apply_remove(key, revision);
        revision
    }

    /// Removes an existing key at `revision`, already claimed.
    fn apply_remove(&mut self, key: &str, revision: Revision) {
        let lease = self.kv.remove(key).and_then(|s| s.lease);
        if let Some(l) = lease.and_then(|l| self.leases.get_mut(&l)) {
            l.keys.remove(key);
        }
        self.record(WatchEvent::Deleted {
            key: key.to_string(),
            revision,
        });
    }

    /// Drops a lease and deletes its keys in key order, one revision each,
    /// so watchers resuming from "last seen + 1" never skip half a lease.
    fn drop_lease(&mut self, id: LeaseId) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        for key in &lease.keys {
            self.remove(key);
        }
        self.recompute_earliest();
        true
    }

    fn recompute_earliest(&mut self) {
        self.earliest_expiry = self.leases.values().map(|l| l.expires_at).min();
    }

    /// Expires every lease whose deadline is at or before `now`; returns how many.
    fn expire(&mut self, now: Millis) -> usize {
        if self.earliest_expiry.is_none_or(|e| now < e) {
            return 0;
        }
        let due: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in &due {
            self.drop_lease(*id);
        }
        due.len()
    }

    fn compact(&mut self, revision: Revision) {
        let upto = revision.min(self.revision);
        while self.history.front().is_some_and(|e| e.revision() <= upto) {
            self.history.pop_front();
        }
        self.compacted = self.compacted.max(upto);
    }
}

struct Inner {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    /// Wakes watch pumps after a change. A `watch` channel rather than
    /// `Notify` because it remembers a change that happened while a pump was
    /// busy sending, and because dropping the store drops the sender, which
    /// is how pumps learn the store is gone.
    changed: watch::Sender<()>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("memory store mutex poisoned")
    }
}

/// Deterministic in-memory [`Store`]. Cloning shares the same store.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store whose leases run on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// A store whose leases run on `clock` (usually a `ManualClock`).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        let (changed, _) = watch::channel(());
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    kv: BTreeMap::new(),
                    revision: 0,
                    history: VecDeque::new(),
                    compacted: 0,
                    history_limit: DEFAULT_HISTORY_LIMIT,
                    leases: BTreeMap::new(),
                    next_lease: 1,
                    earliest_expiry: None,
                    faults: Faults::default(),
                    watch_epoch: 0,
                    watch_fail_reason: String::new(),
                }),
                clock,
                changed,
            }),
        }
    }

    /// Keeps only the last `limit` revisions of history (at least 1); older
    /// watch starting points get `Compacted`.
    pub fn with_history_limit(self, limit: usize) -> Self {
        {
            let mut st = self.inner.lock();
            st.history_limit = limit.max(1);
            st.trim_history();
        }
        self
    }

    /// The current store revision.
    pub fn revision(&self) -> Revision {
        self.inner.lock().revision
    }

    /// Every key in key order, without expiring leases or consulting fault
    /// hooks: for simulation invariant checks, not for code under test.
    pub fn dump(&self) -> Vec<Entry> {
        let st = self.inner.lock();
        st.kv
            .iter()
            .map(|(k, s)| Entry {
                key: k.clone(),
                value: s.value.clone(),
                create_revision: s.create_revision,
                mod_revision: s.mod_revision,
            })
            .collect()
    }

    /// The next `n` operations (of any kind) fail with `Unavailable` and do
    /// not touch the store. Replaces any previous count.
    pub fn set_fail_next(&self, n: u64) {
        self.inner.lock().faults.fail_next = n;
    }

    /// Consulted for every operation once the `set_fail_next` budget is used
    /// up; `None` removes the hook.
    pub fn set_fault_hook(&self, hook: Option<FaultHook>) {
        self.inner.lock().faults.hook = hook;
    }

    /// Fails each operation with probability `p` (not applied), drawn from a
    /// generator seeded with `seed` so a simulation seed replays exactly.
    /// Replaces any fault hook.
    pub fn set_fail_probability(&self, p: f64, seed: u64) {
        let mut rng = SplitMix64(seed);
        self.set_fault_hook(Some(Box::new(move |_op: &Op<'_>| {
            (rng.next_f64() < p).then(|| Fault::Unavailable("injected fault (probability)".into()))
        })));
    }

    /// How many faults have been injected so far.
    pub fn injected_faults(&self) -> u64 {
        self.inner.lock().faults.injected
    }

    /// Ends every open watch with `Unavailable` (naming its prefix), as if
    /// the connection to a server dropped. Watches opened later are fine.
    pub fn fail_watches(&self, reason: &str) {
        {
            let mut st = self.inner.lock();
            st.watch_epoch += 1;
            st.watch_fail_reason = reason.to_string();
        }
        self.inner.changed.send_replace(());
    }

    /// Discards history up to and including `revision`, so watches from
    /// there (including running ones that have not caught up) get
    /// `Compacted`.
    pub fn compact(&self, revision: Revision) {
        self.inner.lock().compact(revision);
        self.inner.changed.send_replace(());
    }

    /// Expires due leases now; returns how many expired. Operations do this
    /// lazily anyway; call it after moving a clock when no other operation
    /// is due but watchers should see the deletions.
    pub fn expire_leases(&self) -> Result<usize, StoreError> {
        self.run(OpKind::ExpireLeases, "", None, |_, _| Ok(0))
            .map(|(expired_now, _)| expired_now)
    }

    /// Runs one operation: lazy lease expiry, fault injection, then `f`.
    /// Returns `f`'s result with the number of leases expired on the way.
    fn run<T>(
        &self,
        kind: OpKind,
        key: &str,
        lease: Option<LeaseId>,
        f: impl FnOnce(&mut State, Millis) -> Result<T, StoreError>,
    ) -> Result<(usize, T), StoreError> {
        self.run_ops(&[Op { kind, key, lease }], f)
    }

    /// [`Self::run`] for an operation made of several (an atomic write):
    /// the fault hook is asked about each in turn, as if they were made one
    /// after the other, and the first fault it injects is the whole
    /// operation's.
    fn run_ops<T>(
        &self,
        ops: &[Op<'_>],
        f: impl FnOnce(&mut State, Millis) -> Result<T, StoreError>,
    ) -> Result<(usize, T), StoreError> {
        let now = self.inner.clock.now_ms();
        let mut st = self.inner.lock();
        let before = st.revision;
        let expired = st.expire(now);
        let fault = ops
            .iter()
            .find_map(|op| st.faults.check(op).map(|fault| (op, fault)));
        let result = match fault {
            Some((op, Fault::Unavailable(reason))) => Err(StoreError::Unavailable {
                key: op.subject(),
                reason,
            }),
            Some((op, Fault::AppliedThenUnavailable(reason))) => {
                if op.kind.is_write() {
                    // The outcome is deliberately discarded: the caller
                    // only learns that the reply was lost.
                    let _ = f(&mut st, now);
                }
                Err(StoreError::Unavailable {
                    key: op.subject(),
                    reason,
                })
            }
            None => f(&mut st, now),
        };
        let changed = st.revision != before;
        drop(st);
        if changed {
            self.inner.changed.send_replace(());
        }
        result.map(|v| (expired, v))
    }

    fn op<T>(
        &self,
        kind: OpKind,
        key: &str,
        lease: Option<LeaseId>,
        f: impl FnOnce(&mut State, Millis) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.run(kind, key, lease, f).map(|(_, v)| v)
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.op(OpKind::Get, key, None, |st, _| {
            Ok(st.kv.get(key).map(|s| Entry {
                key: key.to_string(),
                value: s.value.clone(),
                create_revision: s.create_revision,
                mod_revision: s.mod_revision,
            }))
        })
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
    ) -> Result<Revision, StoreError> {
        self.op(OpKind::Put, key, None, |st, _| {
            st.put(key, value, precondition, None, None)
        })
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.op(OpKind::Put, key, Some(lease), |st, _| {
            st.put(key, value, precondition, Some(lease), None)
        })
    }

    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.op(OpKind::Delete, key, None, |st, _| {
            st.delete(key, revision, None)
        })
    }

    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.op(OpKind::Put, key, None, |st, _| {
            st.put(key, value, precondition, None, Some(guard))
        })
    }

    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.op(OpKind::Delete, key, None, |st, _| {
            st.delete(key, revision, Some(guard))
        })
    }

    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        let keys: Vec<(OpKind, String)> = writes
            .iter()
            .map(|w| match w {
                Write::Put { key, .. } => (OpKind::Put, key.clone()),
                Write::Delete { key, .. } => (OpKind::Delete, key.clone()),
            })
            .collect();
        let ops: Vec<Op<'_>> = keys
            .iter()
            .map(|(kind, key)| Op {
                kind: *kind,
                key,
                lease: None,
            })
            .collect();
        self.run_ops(&ops, |st, _| st.write_all(writes, guard))
            .map(|(_, revision)| revision)
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError> {
        self.op(OpKind::List, prefix, None, |st, _| {
            let entries = st
                .kv
                .range::<str, _>((
                    std::ops::Bound::Included(prefix),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, s)| Entry {
                    key: k.clone(),
                    value: s.value.clone(),
                    create_revision: s.create_revision,
                    mod_revision: s.mod_revision,
                })
                .collect();
            Ok((entries, st.revision))
        })
    }

    async fn count(&self, prefix: &str) -> Result<u64, StoreError> {
        self.op(OpKind::List, prefix, None, |st, _| {
            let n = st
                .kv
                .range::<str, _>((
                    std::ops::Bound::Included(prefix),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(k, _)| k.starts_with(prefix))
                .count();
            Ok(n as u64)
        })
    }

    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError> {
        // Subscribe before checking history so a change made between the
        // check and the pump's first read still wakes the pump.
        let changed = self.inner.changed.subscribe();
        let epoch = self.op(OpKind::Watch, prefix, None, |st, _| {
            if from.max(1) <= st.compacted {
                return Err(StoreError::Compacted {
                    prefix: prefix.to_string(),
                    from,
                    compacted: st.compacted,
                });
            }
            Ok(st.watch_epoch)
        })?;
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL);
        tokio::spawn(pump(
            Arc::downgrade(&self.inner),
            prefix.to_string(),
            from.max(1),
            epoch,
            changed,
            tx,
        ));
        Ok(Watch::new(rx))
    }

    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError> {
        self.op(OpKind::GrantLease, "", None, |st, now| {
            let id = st.next_lease;
            st.next_lease += 1;
            let expires_at = now.saturating_add(ttl_ms);
            st.leases.insert(
                id,
                Lease {
                    ttl_ms,
                    expires_at,
                    keys: BTreeSet::new(),
                },
            );
            st.earliest_expiry = Some(st.earliest_expiry.map_or(expires_at, |e| e.min(expires_at)));
            Ok(id)
        })
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.op(OpKind::KeepAlive, "", Some(lease), |st, now| {
            let l = st
                .leases
                .get_mut(&lease)
                .ok_or(StoreError::LeaseNotFound { lease })?;
            l.expires_at = now.saturating_add(l.ttl_ms);
            st.recompute_earliest();
            Ok(())
        })
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.op(OpKind::RevokeLease, "", Some(lease), |st, _| {
            if st.drop_lease(lease) {
                Ok(())
            } else {
                Err(StoreError::LeaseNotFound { lease })
            }
        })
    }
}

/// Feeds one watch from the history. Pulling from history (instead of the
/// writer pushing into channels) means a slow watcher never blocks writers
/// and never loses events: it just falls behind until compaction overtakes
/// it, when it gets `Compacted`, as with etcd. Holds only a weak reference
/// so dropping the store ends the watch.
async fn pump(
    store: Weak<Inner>,
    prefix: String,
    mut cursor: Revision,
    epoch: u64,
    mut changed: watch::Receiver<()>,
    out: mpsc::Sender<Result<WatchEvent, StoreError>>,
) {
    let mut batch = Vec::with_capacity(WATCH_BATCH);
    loop {
        // Mark the current change as seen before reading, so a write that
        // lands after the read below is guaranteed to wake us again.
        changed.borrow_and_update();
        let caught_up = {
            let Some(inner) = store.upgrade() else { return };
            let st = inner.lock();
            if st.watch_epoch != epoch {
                batch.push(Err(StoreError::Unavailable {
                    key: prefix.clone(),
                    reason: st.watch_fail_reason.clone(),
                }));
                false
            } else if cursor <= st.compacted {
                batch.push(Err(StoreError::Compacted {
                    prefix: prefix.clone(),
                    from: cursor,
                    compacted: st.compacted,
                }));
                false
            } else if cursor > st.revision {
                true
            } else {
                let start = st.history.partition_point(|e| e.revision() < cursor);
                let mut current = None;
                let mut next = st.revision + 1;
                for (scanned, event) in st.history.range(start..).enumerate() {
                    let revision = event.revision();
                    // Stop only between revisions: the next pass (or a
                    // failure reported before it) never splits the events
                    // of one atomic write.
                    if current != Some(revision) {
                        if batch.len() >= WATCH_BATCH || scanned >= WATCH_SCAN {
                            next = revision;
                            break;
                        }
                        current = Some(revision);
                    }
                    if event.key().starts_with(prefix.as_str()) {
                        batch.push(Ok(event.clone()));
                    }
                }
                cursor = next;
                cursor > st.revision
            }
        };
        for item in batch.drain(..) {
            let fatal = item.is_err();
            if out.send(item).await.is_err() || fatal {
                return;
            }
        }
        if caught_up {
            tokio::select! {
                r = changed.changed() => if r.is_err() { return },
                _ = out.closed() => return,
            }
        }
    }
}

/// Small, fast, seedable generator for probabilistic faults; avoids pulling
/// `rand` into the store for one coin flip per operation.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}
