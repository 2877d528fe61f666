//! Embedded [`Store`] on SQLite: Keel's durable state on a single node.
//!
//! One dedicated thread owns the `Connection` and serves requests from a
//! channel, rather than `spawn_blocking` around a `Mutex<Connection>`:
//! SQLite admits one writer at a time anyway, so a single owner serialises
//! operations without lock contention or a blocking-pool thread parked per
//! waiting caller; requests that queue up while a commit is syncing are
//! applied together in one transaction (one fsync for the group); and watch
//! registration is trivially atomic with respect to writes, because the
//! thread does nothing else in between.
//!
//! Each batch runs in one transaction: lazy lease expiry, then every queued
//! request (each write bumps the revision, changes `kv` and appends to
//! `history`), then history compaction. Replies and watch events go out only
//! after `COMMIT` returns, so nobody ever observes a write that could still
//! roll back. If anything in a batch fails at the SQLite level, the whole
//! batch rolls back and every request in it gets `Unavailable`.
//!
//! An atomic write of several keys ([`Store::write_all`]) is one request:
//! it checks every precondition first and then writes all its keys at one
//! revision, so a conflict on any key leaves the rest of the batch (and
//! the other requests in it) untouched. Its history rows share that
//! revision, told apart by `seq` in the order given, and its watch events
//! go out as one group, so a watcher never sees half of it.
//!
//! Only writes made through this process's handle reach its watches; one
//! Keel process should own a database file.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_api::{Clock, Millis, SystemClock};
use rusqlite::{params, Connection, OptionalExtension, Transaction, TransactionBehavior};
use tokio::sync::{broadcast, mpsc, oneshot};

mod live_feed;

use live_feed::{Feed, LiveFeed};

use crate::{
    check_batch, Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch,
    WatchEvent, Write,
};

/// `PRAGMA application_id` of a Keel store ("KEEL"), so a database that
/// belongs to something else is refused instead of written into.
const APPLICATION_ID: i64 = 0x4B45_454C;
/// `PRAGMA user_version`; bump with a migration when the schema changes.
/// Version 2: history rows are keyed by `(rev, seq)`, as an atomic write
/// has one row per key at its one revision (version 1 had one per `rev`).
const SCHEMA_VERSION: i64 = 2;

const SCHEMA: &str = "
CREATE TABLE meta (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    revision INTEGER NOT NULL,
    compacted INTEGER NOT NULL
);
INSERT INTO meta (id, revision, compacted) VALUES (0, 0, 0);
CREATE TABLE kv (
    key TEXT PRIMARY KEY NOT NULL,
    value BLOB NOT NULL,
    create_rev INTEGER NOT NULL,
    mod_rev INTEGER NOT NULL,
    lease INTEGER
) WITHOUT ROWID;
CREATE INDEX kv_by_lease ON kv (lease) WHERE lease IS NOT NULL;
-- One row per key written; kind 0 = put (value, create_rev set), 1 = delete.
-- Rows of one revision (an atomic write) are ordered by seq.
CREATE TABLE history (
    rev INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    key TEXT NOT NULL,
    kind INTEGER NOT NULL,
    value BLOB,
    create_rev INTEGER,
    PRIMARY KEY (rev, seq)
);
-- AUTOINCREMENT so a revoked lease id is never handed out again: a stale
-- holder must not keep a new owner's lease alive.
CREATE TABLE leases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ttl_ms INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX leases_by_expiry ON leases (expires_at);
";

/// Schema version 1's one-row-per-revision history becomes version 2's,
/// each old row the only one (`seq` 0) of its revision.
const MIGRATE_1_TO_2: &str = "
CREATE TABLE history_v2 (
    rev INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    key TEXT NOT NULL,
    kind INTEGER NOT NULL,
    value BLOB,
    create_rev INTEGER,
    PRIMARY KEY (rev, seq)
);
INSERT INTO history_v2 (rev, seq, key, kind, value, create_rev)
    SELECT rev, 0, key, kind, value, create_rev FROM history ORDER BY rev;
DROP TABLE history;
ALTER TABLE history_v2 RENAME TO history;
";

const KIND_PUT: i64 = 0;
const KIND_DELETE: i64 = 1;

/// Requests applied in one transaction at most; bounds reply latency of the
/// first request in a batch.
const MAX_BATCH: usize = 64;
const REQUEST_QUEUE: usize = 1024;
/// Events a watch replays per request, so a far-behind watcher neither holds
/// the store thread long nor buffers the whole history in memory.
const REPLAY_PAGE: usize = 512;
const WATCH_CHANNEL: usize = 256;
/// How far apart [`Worker::mark`]s its revisions.
const MARK_EVERY_MS: Millis = 1_000;
/// TTLs are stored as SQLite integers; clamping keeps `now + ttl` in range.
const MAX_TTL_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

/// Tuning for [`SqliteStore::open_with`].
#[derive(Clone)]
pub struct SqliteOptions {
    /// Times leases. Deadlines are stored as wall-clock milliseconds, so
    /// they keep their meaning across a restart.
    pub clock: Arc<dyn Clock>,
    /// Revisions of history kept for `watch(.., from)`; older starting
    /// points get `Compacted`.
    pub history_limit: u64,
    /// History younger than this is kept beyond `history_limit`: a watcher
    /// that fell behind by less (many nodes in one process under a burst
    /// of writes) catches up from history instead of listing everything
    /// again, which only put it further behind. Judged on `clock`.
    pub history_min_age_ms: Millis,
    /// How long to wait for another connection's lock before failing.
    pub busy_timeout: Duration,
    /// Live events buffered per watch before it falls back to re-reading
    /// history (it never loses events, it only does more work).
    pub watch_buffer: usize,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            history_limit: 10_000,
            history_min_age_ms: 60_000,
            busy_timeout: Duration::from_secs(5),
            watch_buffer: 4096,
        }
    }
}

/// Why a database could not be opened as a Keel store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot open Keel store {}: {reason}", path.display())]
pub struct OpenError {
    pub path: PathBuf,
    pub reason: String,
}

impl From<OpenError> for StoreError {
    fn from(e: OpenError) -> Self {
        StoreError::Unavailable {
            key: e.path.display().to_string(),
            reason: e.reason,
        }
    }
}

/// What [`SqliteStore::durability`] reports: a file store runs with
/// `synchronous` `FULL` and `journal_mode` `wal`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durability {
    /// `OFF`, `NORMAL`, `FULL` or `EXTRA`.
    pub synchronous: String,
    /// As SQLite names it, lower case: `wal`, `delete`, `memory`, ...
    pub journal_mode: String,
}

/// Durable [`Store`] in a SQLite file. Cloning shares the same database
/// thread; it stops once every clone and watch is dropped.
#[derive(Clone)]
pub struct SqliteStore {
    requests: mpsc::Sender<Request>,
    path: Arc<str>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the store at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OpenError> {
        Self::open_with(path, SqliteOptions::default())
    }

    pub fn open_with(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self, OpenError> {
        let path = path.as_ref();
        let fail = |reason: String| OpenError {
            path: path.to_path_buf(),
            reason,
        };
        let conn = Connection::open(path).map_err(|e| fail(describe(&e)))?;
        prepare(&conn, &options, true).map_err(fail)?;
        Self::start(conn, path.display().to_string(), options).map_err(fail)
    }

    /// A private, non-durable database: for tests.
    pub fn open_in_memory() -> Result<Self, OpenError> {
        Self::open_in_memory_with(SqliteOptions::default())
    }

    pub fn open_in_memory_with(options: SqliteOptions) -> Result<Self, OpenError> {
        let fail = |reason: String| OpenError {
            path: PathBuf::from(":memory:"),
            reason,
        };
        let conn = Connection::open_in_memory().map_err(|e| fail(describe(&e)))?;
        prepare(&conn, &options, false).map_err(fail)?;
        Self::start(conn, ":memory:".to_string(), options).map_err(fail)
    }

    fn start(conn: Connection, path: String, options: SqliteOptions) -> Result<Self, String> {
        let (requests, rx) = mpsc::channel(REQUEST_QUEUE);
        let path: Arc<str> = path.into();
        let worker = Worker {
            conn,
            clock: options.clock,
            feed: LiveFeed::new(options.watch_buffer),
            history_limit: options.history_limit.max(1),
            history_min_age_ms: options.history_min_age_ms,
            marks: VecDeque::new(),
            path: path.clone(),
        };
        std::thread::Builder::new()
            .name("keel-store-sqlite".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| format!("spawning the store thread: {e}"))?;
        Ok(Self { requests, path })
    }

    /// The database path (`:memory:` for in-memory stores).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The durability settings in force on the store's own connection, as
    /// SQLite reports them (`PRAGMA synchronous`, `PRAGMA journal_mode`).
    pub async fn durability(&self) -> Result<Durability, StoreError> {
        match self.call(Op::Durability).await? {
            Outcome::Durability(d) => Ok(d),
            other => Err(unexpected("durability", &other)),
        }
    }

    /// Expires due leases now, deleting their keys; returns how many
    /// expired. Operations do this lazily anyway; run it periodically so
    /// watchers see expiries even when nothing else touches the store.
    pub async fn expire_leases(&self) -> Result<usize, StoreError> {
        match self.call(Op::Expire).await? {
            Outcome::Expired(n) => Ok(n),
            other => Err(unexpected("leases (expiry)", &other)),
        }
    }

    async fn call(&self, op: Op) -> Result<Outcome, StoreError> {
        call(&self.requests, op).await
    }
}

/// Caller-side round trip to the store thread. Dropping the future after
/// the request is queued does not cancel it; like any RPC, it may still
/// apply.
async fn call(requests: &mpsc::Sender<Request>, op: Op) -> Result<Outcome, StoreError> {
    let subject = op.subject();
    let (reply, rx) = oneshot::channel();
    if requests.send(Request { op, reply }).await.is_err() {
        return Err(stopped(subject));
    }
    match rx.await {
        Ok(result) => result,
        Err(_) => Err(stopped(subject)),
    }
}

fn stopped(key: String) -> StoreError {
    StoreError::Unavailable {
        key,
        reason: "the SQLite store thread has stopped".into(),
    }
}

fn unexpected(key: &str, outcome: &Outcome) -> StoreError {
    StoreError::Unavailable {
        key: key.to_string(),
        reason: format!("internal error: unexpected reply {}", outcome.name()),
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        match self.call(Op::Get { key: key.into() }).await? {
            Outcome::Entry(e) => Ok(e),
            other => Err(unexpected(key, &other)),
        }
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
    ) -> Result<Revision, StoreError> {
        let op = Op::Put {
            key: key.into(),
            value,
            precondition,
            lease: None,
            guard: None,
        };
        match self.call(op).await? {
            Outcome::Revision(r) => Ok(r),
            other => Err(unexpected(key, &other)),
        }
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        let op = Op::Put {
            key: key.into(),
            value,
            precondition,
            lease: Some(lease),
            guard: None,
        };
        match self.call(op).await? {
            Outcome::Revision(r) => Ok(r),
            other => Err(unexpected(key, &other)),
        }
    }

    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        let op = Op::Delete {
            key: key.into(),
            revision,
            guard: None,
        };
        match self.call(op).await? {
            Outcome::Revision(r) => Ok(r),
            other => Err(unexpected(key, &other)),
        }
    }

    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        precondition: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        let op = Op::Put {
            key: key.into(),
            value,
            precondition,
            lease: None,
            guard: Some(guard.clone()),
        };
        match self.call(op).await? {
            Outcome::Revision(r) => Ok(r),
            other => Err(unexpected(key, &other)),
        }
    }

    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        let op = Op::Delete {
            key: key.into(),
            revision,
            guard: Some(guard.clone()),
        };
        match self.call(op).await? {
            Outcome::Revision(r) => Ok(r),
            other => Err(unexpected(key, &other)),
        }
    }

    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        check_batch(&writes)?;
        let key = writes[0].key().to_string();
        let op = Op::WriteAll {
            writes,
            guard: guard.cloned(),
        };
        match self.call(op).await? {
            Outcome::Revision(r) => Ok(r),
            other => Err(unexpected(&key, &other)),
        }
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError> {
        match self
            .call(Op::List {
                prefix: prefix.into(),
            })
            .await?
        {
            Outcome::List(entries, rev) => Ok((entries, rev)),
            other => Err(unexpected(prefix, &other)),
        }
    }

    async fn count(&self, prefix: &str) -> Result<u64, StoreError> {
        match self
            .call(Op::Count {
                prefix: prefix.into(),
            })
            .await?
        {
            Outcome::Count(n) => Ok(n),
            other => Err(unexpected(prefix, &other)),
        }
    }

    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError> {
        let first = replay(&self.requests, prefix, from).await?;
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL);
        tokio::spawn(pump(
            self.requests.downgrade(),
            prefix.to_string(),
            first,
            tx,
        ));
        Ok(Watch::new(rx))
    }

    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError> {
        match self.call(Op::Grant { ttl_ms }).await? {
            Outcome::Lease(id) => Ok(id),
            other => Err(unexpected("lease (grant)", &other)),
        }
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        match self.call(Op::KeepAlive { lease }).await? {
            Outcome::Done => Ok(()),
            other => Err(unexpected(&format!("lease {lease}"), &other)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        match self.call(Op::Revoke { lease }).await? {
            Outcome::Done => Ok(()),
            other => Err(unexpected(&format!("lease {lease}"), &other)),
        }
    }
}

async fn replay(
    requests: &mpsc::Sender<Request>,
    prefix: &str,
    from: Revision,
) -> Result<Replay, StoreError> {
    let op = Op::Replay {
        prefix: prefix.into(),
        from,
    };
    match call(requests, op).await? {
        Outcome::Replay(r) => Ok(r),
        other => Err(unexpected(prefix, &other)),
    }
}

/// Feeds one watch: history pages first, then live events from the
/// broadcast. The broadcast receiver is created by the store thread in the
/// same transaction that read the last page, and `last` is the revision
/// that page was consistent with, so filtering live events to `> last`
/// leaves neither a gap nor a duplicate. If the watcher is too slow and the
/// broadcast overflows, it re-reads history from where it was instead of
/// losing events. Holds only a weak sender so dropping the store ends it.
async fn pump(
    requests: mpsc::WeakSender<Request>,
    prefix: String,
    mut replayed: Replay,
    out: mpsc::Sender<Result<WatchEvent, StoreError>>,
) {
    loop {
        for event in replayed.events.drain(..) {
            if out.send(Ok(event)).await.is_err() {
                return;
            }
        }
        let resume_from = match replayed.live.take() {
            None => replayed.next,
            Some((mut live, mut last)) => loop {
                let received = tokio::select! {
                    _ = out.closed() => return,
                    r = live.recv() => r,
                };
                match received {
                    Ok(group) => {
                        let Some(revision) = group.first().map(WatchEvent::revision) else {
                            continue;
                        };
                        if revision <= last {
                            continue;
                        }
                        last = revision;
                        for event in group.iter() {
                            if event.key().starts_with(prefix.as_str())
                                && out.send(Ok(event.clone())).await.is_err()
                            {
                                return;
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => break last + 1,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            },
        };
        let Some(requests_now) = requests.upgrade() else {
            return;
        };
        let next = replay(&requests_now, &prefix, resume_from).await;
        drop(requests_now);
        match next {
            Ok(r) => replayed = r,
            Err(e) => {
                let _ = out.send(Err(e)).await;
                return;
            }
        }
    }
}

struct Request {
    op: Op,
    reply: oneshot::Sender<Result<Outcome, StoreError>>,
}

enum Op {
    Get {
        key: String,
    },
    Put {
        key: String,
        value: Vec<u8>,
        precondition: Precondition,
        lease: Option<LeaseId>,
        guard: Option<Guard>,
    },
    Delete {
        key: String,
        revision: Revision,
        guard: Option<Guard>,
    },
    /// Never empty, no key twice: checked before it is sent.
    WriteAll {
        writes: Vec<Write>,
        guard: Option<Guard>,
    },
    List {
        prefix: String,
    },
    Count {
        prefix: String,
    },
    Replay {
        prefix: String,
        from: Revision,
    },
    Grant {
        ttl_ms: u64,
    },
    KeepAlive {
        lease: LeaseId,
    },
    Revoke {
        lease: LeaseId,
    },
    Expire,
    Durability,
}

impl Op {
    /// What an error about this request names.
    fn subject(&self) -> String {
        match self {
            Op::Get { key } | Op::Put { key, .. } | Op::Delete { key, .. } => key.clone(),
            Op::WriteAll { writes, .. } => writes
                .first()
                .map(|w| w.key().to_string())
                .unwrap_or_default(),
            Op::List { prefix } | Op::Count { prefix } | Op::Replay { prefix, .. } => {
                prefix.clone()
            }
            Op::Grant { .. } => "lease (grant)".into(),
            Op::KeepAlive { lease } | Op::Revoke { lease } => format!("lease {lease}"),
            Op::Expire => "leases (expiry)".into(),
            Op::Durability => "durability".into(),
        }
    }
}

enum Outcome {
    Entry(Option<Entry>),
    Revision(Revision),
    List(Vec<Entry>, Revision),
    Count(u64),
    Replay(Replay),
    Lease(LeaseId),
    Done,
    Expired(usize),
    Durability(Durability),
}

impl Outcome {
    fn name(&self) -> &'static str {
        match self {
            Outcome::Entry(_) => "entry",
            Outcome::Revision(_) => "revision",
            Outcome::List(..) => "list",
            Outcome::Count(_) => "count",
            Outcome::Replay(_) => "replay",
            Outcome::Lease(_) => "lease",
            Outcome::Done => "done",
            Outcome::Expired(_) => "expired",
            Outcome::Durability(_) => "durability",
        }
    }
}

/// One page of history for a watch.
struct Replay {
    events: Vec<WatchEvent>,
    /// Where the next page starts if `live` is `None`.
    next: Revision,
    /// Set on the last page: the live feed, and the revision this page is
    /// consistent with (live events at or below it were already replayed).
    live: Option<(Feed, Revision)>,
}

struct Worker {
    conn: Connection,
    clock: Arc<dyn Clock>,
    /// One message per revision and segment: the events of an atomic
    /// write travel together, so a lagging watcher resumes between
    /// revisions.
    feed: LiveFeed,
    history_limit: u64,
    history_min_age_ms: Millis,
    /// The revision reached at moments about a second apart, oldest
    /// first, back to `history_min_age_ms` ago: how far back that reaches.
    marks: VecDeque<(Millis, Revision)>,
    path: Arc<str>,
}

impl Worker {
    /// The oldest revision compaction must keep: the one reached
    /// `history_min_age_ms` ago (nothing is that old yet: keep all).
    fn kept_from(&self, now: Millis) -> Revision {
        if self.history_min_age_ms == 0 {
            return Revision::MAX;
        }
        let cutoff = now.saturating_sub(self.history_min_age_ms);
        self.marks
            .iter()
            .take_while(|(at, _)| *at <= cutoff)
            .last()
            .map_or(0, |(_, revision)| *revision)
    }

    fn mark(&mut self, now: Millis, revision: Revision) {
        if self
            .marks
            .back()
            .is_none_or(|(at, _)| now >= at.saturating_add(MARK_EVERY_MS))
        {
            self.marks.push_back((now, revision));
        }
        let cutoff = now.saturating_sub(self.history_min_age_ms);
        // One mark at or before the cutoff is all `kept_from` needs.
        while self.marks.get(1).is_some_and(|(at, _)| *at <= cutoff) {
            self.marks.pop_front();
        }
    }

    fn run(mut self, mut rx: mpsc::Receiver<Request>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        while rx.blocking_recv_many(&mut batch, MAX_BATCH) > 0 {
            self.run_batch(&mut batch);
        }
        // Every handle is gone; dropping the connection checkpoints the WAL.
    }

    fn run_batch(&mut self, batch: &mut Vec<Request>) {
        let now = self.clock.now_ms();
        let mut events = Vec::new();
        let mut outcomes = Vec::with_capacity(batch.len());
        let kept_from = self.kept_from(now);
        let applied = apply(
            &mut self.conn,
            &mut self.feed,
            History {
                limit: self.history_limit,
                kept_from,
            },
            now,
            batch,
            &mut events,
            &mut outcomes,
        );
        match applied {
            Ok(()) => {
                if let Some(last) = events.last() {
                    self.mark(now, last.revision());
                }
                // Live events strictly before replies: a caller that saw
                // its write acknowledged can rely on watches having it.
                for group in events.chunk_by(|a, b| a.revision() == b.revision()) {
                    self.feed.send(group);
                }
                for (request, outcome) in batch.drain(..).zip(outcomes) {
                    let _ = request.reply.send(outcome);
                }
            }
            Err(e) => {
                let reason = format!("SQLite error on {}: {}", self.path, describe(&e));
                tracing::error!(%reason, requests = batch.len(), "store batch rolled back");
                for request in batch.drain(..) {
                    let key = request.op.subject();
                    let _ = request.reply.send(Err(StoreError::Unavailable {
                        key,
                        reason: reason.clone(),
                    }));
                }
            }
        }
    }
}

type Sql<T> = rusqlite::Result<T>;
/// Outer error: SQLite failed, the batch rolls back. Inner error: this
/// request failed on its own (conflict, missing lease), nothing was changed.
type Applied<T> = Sql<Result<T, StoreError>>;

/// What compaction keeps: the newest `limit` revisions, and every one
/// from `kept_from` on.
#[derive(Debug, Clone, Copy)]
struct History {
    limit: u64,
    kept_from: Revision,
}

fn apply(
    conn: &mut Connection,
    feed: &mut LiveFeed,
    history: History,
    now: Millis,
    batch: &mut [Request],
    events: &mut Vec<WatchEvent>,
    outcomes: &mut Vec<Result<Outcome, StoreError>>,
) -> Sql<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut expired = expire_due(&tx, now, events)?;
    for request in batch.iter_mut() {
        let outcome = match &mut request.op {
            Op::Get { key } => Ok(get(&tx, key)?.map(Outcome::Entry)),
            Op::Put {
                key,
                value,
                precondition,
                lease,
                guard,
            } => match check_guard(&tx, guard.as_ref())? {
                Err(lost) => Ok(Err(lost)),
                Ok(()) => put(
                    &tx,
                    key,
                    std::mem::take(value),
                    *precondition,
                    *lease,
                    events,
                ),
            },
            Op::Delete {
                key,
                revision,
                guard,
            } => match check_guard(&tx, guard.as_ref())? {
                Err(lost) => Ok(Err(lost)),
                Ok(()) => delete(&tx, key, *revision, events),
            },
            Op::WriteAll { writes, guard } => match check_guard(&tx, guard.as_ref())? {
                Err(lost) => Ok(Err(lost)),
                Ok(()) => write_all(&tx, std::mem::take(writes), events),
            },
            Op::List { prefix } => list(&tx, prefix),
            Op::Count { prefix } => count(&tx, prefix),
            Op::Replay { prefix, from } => replay_page(&tx, prefix, *from, feed),
            Op::Grant { ttl_ms } => grant(&tx, now, *ttl_ms),
            Op::KeepAlive { lease } => keep_alive(&tx, now, *lease),
            Op::Revoke { lease } => revoke(&tx, *lease, events),
            Op::Expire => Ok(Ok(Outcome::Expired(std::mem::take(&mut expired)))),
            Op::Durability => durability(&tx).map(|d| Ok(Outcome::Durability(d))),
        }?;
        outcomes.push(outcome);
    }
    if !events.is_empty() {
        compact(&tx, history)?;
    }
    tx.commit()
}

fn durability(tx: &Transaction<'_>) -> Sql<Durability> {
    let level: i64 = tx.query_row("PRAGMA synchronous", [], |row| row.get(0))?;
    let journal_mode: String = tx.query_row("PRAGMA journal_mode", [], |row| row.get(0))?;
    let synchronous = match level {
        0 => "OFF".to_string(),
        1 => "NORMAL".to_string(),
        2 => "FULL".to_string(),
        3 => "EXTRA".to_string(),
        other => format!("unknown ({other})"),
    };
    Ok(Durability {
        synchronous,
        journal_mode: journal_mode.to_ascii_lowercase(),
    })
}

fn get(tx: &Transaction<'_>, key: &str) -> Applied<Option<Entry>> {
    let entry = tx
        .prepare_cached("SELECT value, create_rev, mod_rev FROM kv WHERE key = ?1")?
        .query_row([key], |row| {
            Ok(Entry {
                key: key.to_string(),
                value: row.get(0)?,
                create_revision: row.get(1)?,
                mod_revision: row.get(2)?,
            })
        })
        .optional()?;
    Ok(Ok(entry))
}

/// Inside the write's own transaction (after this batch's lease expiry),
/// so nothing can delete or re-create the guard key between check and write.
fn check_guard(tx: &Transaction<'_>, guard: Option<&Guard>) -> Applied<()> {
    let Some(guard) = guard else {
        return Ok(Ok(()));
    };
    let create_revision: Option<Revision> = tx
        .prepare_cached("SELECT create_rev FROM kv WHERE key = ?1")?
        .query_row([&guard.key], |row| row.get(0))
        .optional()?;
    if create_revision == Some(guard.create_revision) {
        Ok(Ok(()))
    } else {
        Ok(Err(guard.lost()))
    }
}

/// `(create_rev, mod_rev)` of `key`, if it exists.
fn revisions_of(tx: &Transaction<'_>, key: &str) -> Sql<Option<(Revision, Revision)>> {
    tx.prepare_cached("SELECT create_rev, mod_rev FROM kv WHERE key = ?1")?
        .query_row([key], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()
}

fn bump_revision(tx: &Transaction<'_>) -> Sql<Revision> {
    tx.prepare_cached("UPDATE meta SET revision = revision + 1 WHERE id = 0 RETURNING revision")?
        .query_row([], |row| row.get(0))
}

fn put(
    tx: &Transaction<'_>,
    key: &str,
    value: Vec<u8>,
    precondition: Precondition,
    lease: Option<LeaseId>,
    events: &mut Vec<WatchEvent>,
) -> Applied<Outcome> {
    let current = revisions_of(tx, key)?;
    if let Some(conflict) = precondition.conflict(key, current.map(|(_, m)| m)) {
        return Ok(Err(conflict));
    }
    if let Some(l) = lease {
        let exists = tx
            .prepare_cached("SELECT 1 FROM leases WHERE id = ?1")?
            .exists([l])?;
        if !exists {
            return Ok(Err(StoreError::LeaseNotFound { lease: l }));
        }
    }
    let revision = bump_revision(tx)?;
    let create_revision = current.map_or(revision, |(c, _)| c);
    write_key(
        tx,
        key,
        value,
        create_revision,
        lease,
        (revision, 0),
        events,
    )?;
    Ok(Ok(Outcome::Revision(revision)))
}

/// Every write or none, at one revision: all preconditions are checked
/// before anything is written (see [`Store::write_all`]).
fn write_all(
    tx: &Transaction<'_>,
    writes: Vec<Write>,
    events: &mut Vec<WatchEvent>,
) -> Applied<Outcome> {
    let mut create_revisions = Vec::with_capacity(writes.len());
    for write in &writes {
        let current = revisions_of(tx, write.key())?;
        if let Some(conflict) = write.conflict(current.map(|(_, m)| m)) {
            return Ok(Err(conflict));
        }
        create_revisions.push(current.map(|(c, _)| c));
    }
    let revision = bump_revision(tx)?;
    for (seq, (write, created)) in writes.into_iter().zip(create_revisions).enumerate() {
        let at = (revision, seq as i64);
        match write {
            Write::Put { key, value, .. } => {
                let create_revision = created.unwrap_or(revision);
                write_key(tx, &key, value, create_revision, None, at, events)?;
            }
            Write::Delete { key, .. } => remove_key(tx, &key, at, events)?,
        }
    }
    Ok(Ok(Outcome::Revision(revision)))
}

/// Writes a key at `(revision, seq)`, already checked and claimed.
fn write_key(
    tx: &Transaction<'_>,
    key: &str,
    value: Vec<u8>,
    create_revision: Revision,
    lease: Option<LeaseId>,
    (revision, seq): (Revision, i64),
    events: &mut Vec<WatchEvent>,
) -> Sql<()> {
    tx.prepare_cached(
        "INSERT OR REPLACE INTO kv (key, value, create_rev, mod_rev, lease) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![key, value, create_revision, revision, lease])?;
    tx.prepare_cached(
        "INSERT INTO history (rev, seq, key, kind, value, create_rev) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![revision, seq, key, KIND_PUT, value, create_revision])?;
    events.push(WatchEvent::Put(Entry {
        key: key.to_string(),
        value,
        create_revision,
        mod_revision: revision,
    }));
    Ok(())
}

fn delete(
    tx: &Transaction<'_>,
    key: &str,
    expected: Revision,
    events: &mut Vec<WatchEvent>,
) -> Applied<Outcome> {
    let actual = revisions_of(tx, key)?.map(|(_, m)| m);
    if let Some(conflict) = Precondition::Revision(expected).conflict(key, actual) {
        return Ok(Err(conflict));
    }
    Ok(Ok(Outcome::Revision(remove(tx, key, events)?)))
}

/// Deletes an existing key unconditionally, as one revision.
fn remove(tx: &Transaction<'_>, key: &str, events: &mut Vec<WatchEvent>) -> Sql<Revision> {
    let revision = bump_revision(tx)?;
    remove_key(tx, key, (revision, 0), events)?;
    Ok(revision)
}

/// Deletes a key at `(revision, seq)`, already checked and claimed.
fn remove_key(
    tx: &Transaction<'_>,
    key: &str,
    (revision, seq): (Revision, i64),
    events: &mut Vec<WatchEvent>,
) -> Sql<()> {
    tx.prepare_cached("DELETE FROM kv WHERE key = ?1")?
        .execute([key])?;
    tx.prepare_cached("INSERT INTO history (rev, seq, key, kind) VALUES (?1, ?2, ?3, ?4)")?
        .execute(params![revision, seq, key, KIND_DELETE])?;
    events.push(WatchEvent::Deleted {
        key: key.to_string(),
        revision,
    });
    Ok(())
}

fn list(tx: &Transaction<'_>, prefix: &str) -> Applied<Outcome> {
    // A range scan from `prefix` on the primary key, stopped at the first
    // key without the prefix: TEXT compares bytewise, as Rust strings do,
    // so the matching keys are contiguous. (LIKE would treat `_` and `%`
    // in keys as wildcards.)
    let mut stmt = tx.prepare_cached(
        "SELECT key, value, create_rev, mod_rev FROM kv WHERE key >= ?1 ORDER BY key",
    )?;
    let mut rows = stmt.query([prefix])?;
    let mut entries = Vec::new();
    while let Some(row) = rows.next()? {
        let key: String = row.get(0)?;
        if !key.starts_with(prefix) {
            break;
        }
        entries.push(Entry {
            key,
            value: row.get(1)?,
            create_revision: row.get(2)?,
            mod_revision: row.get(3)?,
        });
    }
    let (revision, _) = meta(tx)?;
    Ok(Ok(Outcome::List(entries, revision)))
}

/// [`list`]'s range, counted inside SQLite: `[prefix, prefix_end)` where
/// the prefix's last byte is ASCII (every prefix Keel uses), else the
/// keys are scanned as `list` does.
fn count(tx: &Transaction<'_>, prefix: &str) -> Applied<Outcome> {
    let end = prefix
        .as_bytes()
        .last()
        .filter(|b| **b < 0x7f)
        .map(|b| format!("{}{}", &prefix[..prefix.len() - 1], char::from(b + 1)));
    if let Some(end) = end {
        let n: i64 = tx
            .prepare_cached("SELECT COUNT(*) FROM kv WHERE key >= ?1 AND key < ?2")?
            .query_row([prefix, end.as_str()], |row| row.get(0))?;
        return Ok(Ok(Outcome::Count(u64::try_from(n).unwrap_or(0))));
    }
    let mut stmt = tx.prepare_cached("SELECT key FROM kv WHERE key >= ?1 ORDER BY key")?;
    let mut rows = stmt.query([prefix])?;
    let mut n = 0;
    while let Some(row) = rows.next()? {
        let key: String = row.get(0)?;
        if !key.starts_with(prefix) {
            break;
        }
        n += 1;
    }
    Ok(Ok(Outcome::Count(n)))
}

fn meta(tx: &Transaction<'_>) -> Sql<(Revision, Revision)> {
    tx.prepare_cached("SELECT revision, compacted FROM meta WHERE id = 0")?
        .query_row([], |row| Ok((row.get(0)?, row.get(1)?)))
}

fn replay_page(
    tx: &Transaction<'_>,
    prefix: &str,
    from: Revision,
    feed: &mut LiveFeed,
) -> Applied<Outcome> {
    let (revision, compacted) = meta(tx)?;
    let start = from.max(1);
    if start <= compacted {
        return Ok(Err(StoreError::Compacted {
            prefix: prefix.to_string(),
            from,
            compacted,
        }));
    }
    let mut stmt = tx.prepare_cached(
        "SELECT rev, key, kind, value, create_rev FROM history WHERE rev >= ?1 ORDER BY rev, seq",
    )?;
    let mut rows = stmt.query([start])?;
    let mut events = Vec::new();
    let mut next = start;
    let mut exhausted = true;
    while let Some(row) = rows.next()? {
        let rev: Revision = row.get(0)?;
        // A page ends only between revisions, so a watch never stops in
        // the middle of an atomic write's events.
        if rev >= next && events.len() >= REPLAY_PAGE {
            exhausted = false;
            break;
        }
        let key: String = row.get(1)?;
        next = rev + 1;
        if !key.starts_with(prefix) {
            continue;
        }
        let kind: i64 = row.get(2)?;
        let event = match kind {
            KIND_PUT => {
                let value: Option<Vec<u8>> = row.get(3)?;
                let create_revision: Option<Revision> = row.get(4)?;
                match (value, create_revision) {
                    (Some(value), Some(create_revision)) => WatchEvent::Put(Entry {
                        key,
                        value,
                        create_revision,
                        mod_revision: rev,
                    }),
                    _ => {
                        return Ok(Err(StoreError::Corrupt {
                            key,
                            reason: format!("history row {rev} is a put without value"),
                        }))
                    }
                }
            }
            KIND_DELETE => WatchEvent::Deleted { key, revision: rev },
            other => {
                return Ok(Err(StoreError::Corrupt {
                    key,
                    reason: format!("history row {rev} has unknown kind {other}"),
                }))
            }
        };
        events.push(event);
    }
    // Subscribing here, inside the batch, is what closes the gap between
    // history and live: this batch's own events are broadcast after commit
    // and are filtered against `consistent_at` by the pump.
    let live = exhausted.then(|| (feed.subscribe(prefix), revision.max(start - 1)));
    Ok(Ok(Outcome::Replay(Replay { events, next, live })))
}

fn grant(tx: &Transaction<'_>, now: Millis, ttl_ms: u64) -> Applied<Outcome> {
    let ttl_ms = ttl_ms.min(MAX_TTL_MS);
    tx.prepare_cached("INSERT INTO leases (ttl_ms, expires_at) VALUES (?1, ?2)")?
        .execute(params![ttl_ms, now.saturating_add(ttl_ms)])?;
    Ok(Ok(Outcome::Lease(tx.last_insert_rowid())))
}

fn keep_alive(tx: &Transaction<'_>, now: Millis, lease: LeaseId) -> Applied<Outcome> {
    let changed = tx
        .prepare_cached("UPDATE leases SET expires_at = ?2 + ttl_ms WHERE id = ?1")?
        .execute(params![lease, now])?;
    if changed == 0 {
        return Ok(Err(StoreError::LeaseNotFound { lease }));
    }
    Ok(Ok(Outcome::Done))
}

fn revoke(tx: &Transaction<'_>, lease: LeaseId, events: &mut Vec<WatchEvent>) -> Applied<Outcome> {
    if drop_lease(tx, lease, events)? {
        Ok(Ok(Outcome::Done))
    } else {
        Ok(Err(StoreError::LeaseNotFound { lease }))
    }
}

/// Deletes a lease and its keys in key order, one revision per key, so a
/// watcher resuming from "last seen + 1" never skips half a lease.
fn drop_lease(tx: &Transaction<'_>, lease: LeaseId, events: &mut Vec<WatchEvent>) -> Sql<bool> {
    let keys = tx
        .prepare_cached("SELECT key FROM kv WHERE lease = ?1 ORDER BY key")?
        .query_map([lease], |row| row.get::<_, String>(0))?
        .collect::<Sql<Vec<_>>>()?;
    for key in &keys {
        remove(tx, key, events)?;
    }
    let removed = tx
        .prepare_cached("DELETE FROM leases WHERE id = ?1")?
        .execute([lease])?;
    Ok(removed > 0)
}

fn expire_due(tx: &Transaction<'_>, now: Millis, events: &mut Vec<WatchEvent>) -> Sql<usize> {
    let due = tx
        .prepare_cached("SELECT id FROM leases WHERE expires_at <= ?1 ORDER BY id")?
        .query_map([now], |row| row.get::<_, LeaseId>(0))?
        .collect::<Sql<Vec<_>>>()?;
    for lease in &due {
        drop_lease(tx, *lease, events)?;
    }
    Ok(due.len())
}

fn compact(tx: &Transaction<'_>, history: History) -> Sql<()> {
    let (revision, compacted) = meta(tx)?;
    let upto = revision
        .saturating_sub(history.limit)
        .min(history.kept_from.saturating_sub(1));
    if upto > compacted {
        tx.prepare_cached("DELETE FROM history WHERE rev <= ?1")?
            .execute([upto])?;
        tx.prepare_cached("UPDATE meta SET compacted = ?1 WHERE id = 0")?
            .execute([upto])?;
    }
    Ok(())
}

/// Connection settings and schema check/creation, before the connection is
/// handed to the store thread. Errors are reasons; the caller adds the path.
fn prepare(conn: &Connection, options: &SqliteOptions, file: bool) -> Result<(), String> {
    conn.busy_timeout(options.busy_timeout)
        .map_err(|e| format!("setting busy_timeout: {}", describe(&e)))?;
    // The first statement that reads the file: a file that is not SQLite
    // fails here with "file is not a database".
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
        .map_err(|e| describe(&e))?;
    if file && !mode.eq_ignore_ascii_case("wal") {
        // Still durable with synchronous=FULL, only slower; worth a warning,
        // not a refusal to start.
        tracing::warn!(journal_mode = %mode, "SQLite refused WAL mode; continuing");
    }
    // FULL: every acknowledged write is fsynced before we reply. Keel acts
    // on what it has stored (starts VMs, hands out addresses, deletes
    // disks); forgetting an acknowledged write after a crash or power loss
    // could mean a VM started twice or a disk freed while in use. In WAL
    // mode NORMAL would only risk the last commits, but those are exactly
    // the ones a controller has already acted on.
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(|e| format!("setting synchronous=FULL: {}", describe(&e)))?;
    let check: String = conn
        .query_row("PRAGMA quick_check", [], |row| row.get(0))
        .map_err(|e| format!("integrity check: {}", describe(&e)))?;
    if check != "ok" {
        return Err(format!("database is corrupt (quick_check: {check})"));
    }
    conn.execute_batch("BEGIN IMMEDIATE")
        .map_err(|e| format!("locking for schema check: {}", describe(&e)))?;
    let checked = check_schema(conn);
    let end = if checked.is_ok() {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    let ended = conn
        .execute_batch(end)
        .map_err(|e| format!("finishing schema check: {}", describe(&e)));
    checked.and(ended)
}

fn check_schema(conn: &Connection) -> Result<(), String> {
    let pragma = |name: &str| -> Result<i64, String> {
        conn.query_row(&format!("PRAGMA {name}"), [], |row| row.get(0))
            .map_err(|e| format!("reading {name}: {}", describe(&e)))
    };
    let application_id = pragma("application_id")?;
    let version = pragma("user_version")?;
    let objects: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master", [], |row| row.get(0))
        .map_err(|e| format!("reading the schema: {}", describe(&e)))?;
    if application_id == 0 && objects == 0 {
        conn.execute_batch(SCHEMA)
            .and_then(|()| conn.pragma_update(None, "application_id", APPLICATION_ID))
            .and_then(|()| conn.pragma_update(None, "user_version", SCHEMA_VERSION))
            .map_err(|e| format!("creating the schema: {}", describe(&e)))?;
        return Ok(());
    }
    if application_id == APPLICATION_ID && version == 1 {
        conn.execute_batch(MIGRATE_1_TO_2)
            .and_then(|()| conn.pragma_update(None, "user_version", SCHEMA_VERSION))
            .map_err(|e| format!("migrating the schema from version 1: {}", describe(&e)))?;
    }
    if application_id != APPLICATION_ID {
        return Err(format!(
            "not a Keel store: it has {objects} schema objects and application_id {application_id:#x} \
             (a Keel store has {APPLICATION_ID:#x}); refusing to modify it"
        ));
    }
    if version > SCHEMA_VERSION {
        return Err(format!(
            "schema version {version} was written by a newer Keel (this one supports up to {SCHEMA_VERSION})"
        ));
    }
    if version < 1 {
        return Err(format!("schema version {version} is invalid"));
    }
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' \
             AND name IN ('meta', 'kv', 'history', 'leases')",
            [],
            |row| row.get(0),
        )
        .map_err(|e| format!("reading the schema: {}", describe(&e)))?;
    if tables != 4 {
        return Err(format!(
            "Keel store is missing tables ({tables} of meta, kv, history, leases present)"
        ));
    }
    Ok(())
}

/// SQLite's message, with a hint for the failure people actually hit.
fn describe(e: &rusqlite::Error) -> String {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) => {
            format!("not a SQLite database, or the file is corrupt ({e})")
        }
        Some(rusqlite::ErrorCode::DatabaseCorrupt) => format!("database is corrupt ({e})"),
        _ => e.to_string(),
    }
}
