//! The behaviour every [`Store`] must have, as a reusable suite.
//!
//! Compiled into the library (not `cfg(test)`) so every implementation,
//! including ones in other crates, runs exactly the same checks. Each check
//! takes a fresh [`Fixture`] and panics with a message naming what broke.
//!
//! ```ignore
//! async fn fixture() -> keel_store::conformance::Fixture { ... }
//! keel_store::conformance_tests!(fixture);          // one #[tokio::test] per check
//! // or: keel_store::conformance::run_all(fixture).await;
//! ```

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_api::ManualClock;

use crate::{
    Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch, WatchEvent, Write,
};

/// How long a check waits for an expected watch event before failing.
const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

/// How the suite moves time for lease checks.
#[derive(Clone)]
pub enum TimeControl {
    /// The store's leases run on this clock; the suite advances it.
    Manual(ManualClock),
    /// The store uses real time (e.g. an etcd server); the suite sleeps and
    /// polls for expiry, so keep `lease_ttl_ms` small but above the
    /// backend's minimum.
    Real,
}

/// A fresh, empty store plus what the suite needs to know about it.
pub struct Fixture {
    pub store: Arc<dyn Store>,
    pub time: TimeControl,
    /// TTL the lease checks grant; other delays are fractions of it.
    pub lease_ttl_ms: u64,
    /// If the store keeps only this many revisions of history on its own,
    /// the compaction check runs; `None` skips it.
    pub history_limit: Option<u64>,
    /// Kept alive as long as the fixture (e.g. the temp dir of a file store).
    guard: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Fixture {
    /// A store whose leases run on `clock`.
    pub fn manual(store: Arc<dyn Store>, clock: ManualClock) -> Self {
        Self {
            store,
            time: TimeControl::Manual(clock),
            lease_ttl_ms: 1_000,
            history_limit: None,
            guard: None,
        }
    }

    /// A store on real time; leases use `lease_ttl_ms`.
    pub fn real_time(store: Arc<dyn Store>, lease_ttl_ms: u64) -> Self {
        Self {
            store,
            time: TimeControl::Real,
            lease_ttl_ms,
            history_limit: None,
            guard: None,
        }
    }

    pub fn with_history_limit(mut self, limit: u64) -> Self {
        self.history_limit = Some(limit);
        self
    }

    /// Keeps `guard` (say, a temp dir) alive until the check finishes.
    pub fn with_guard(mut self, guard: impl std::any::Any + Send + Sync) -> Self {
        self.guard = Some(Box::new(guard));
        self
    }

    async fn advance(&self, ms: u64) {
        match &self.time {
            TimeControl::Manual(clock) => clock.advance(ms),
            TimeControl::Real => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
    }
}

/// Runs every check, each against a fresh fixture from `make`.
pub async fn run_all<F, Fut>(make: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Fixture>,
{
    get_put_roundtrip(make().await).await;
    create_conflicts_if_exists(make().await).await;
    put_stale_revision_conflicts(make().await).await;
    delete_stale_revision_conflicts(make().await).await;
    revision_increases_across_keys(make().await).await;
    values_are_binary_safe(make().await).await;
    list_by_prefix(make().await).await;
    watch_replays_history_then_live(make().await).await;
    watch_from_list_revision(make().await).await;
    watch_filters_prefix(make().await).await;
    watch_from_future_revision(make().await).await;
    watch_no_gap_under_concurrent_writes(make().await).await;
    watch_compacted(make().await).await;
    lease_expiry_deletes_keys(make().await).await;
    lease_revoke_deletes_keys(make().await).await;
    lease_keep_alive_extends(make().await).await;
    lease_unknown_rejected(make().await).await;
    put_without_lease_detaches(make().await).await;
    concurrent_cas_increments(make().await).await;
    concurrent_writes_get_their_own_answers(make().await).await;
    guarded_writes_apply_while_guard_held(make().await).await;
    guarded_writes_fail_once_guard_deleted(make().await).await;
    guarded_writes_fail_once_guard_recreated(make().await).await;
    guarded_writes_fail_once_guard_lease_expired(make().await).await;
    atomic_write_applies_all_at_one_revision(make().await).await;
    atomic_write_conflict_writes_nothing(make().await).await;
    atomic_write_refuses_malformed_batches(make().await).await;
    atomic_write_guarded(make().await).await;
    atomic_writes_replay_whole(make().await).await;
}

/// One `#[tokio::test]` per conformance check, so a failure names the
/// check. `$make` is an async fn (or closure) returning a [`Fixture`]; the
/// calling crate needs tokio with `macros` and `rt-multi-thread`.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            get_put_roundtrip,
            create_conflicts_if_exists,
            put_stale_revision_conflicts,
            delete_stale_revision_conflicts,
            revision_increases_across_keys,
            values_are_binary_safe,
            list_by_prefix,
            watch_replays_history_then_live,
            watch_from_list_revision,
            watch_filters_prefix,
            watch_from_future_revision,
            watch_no_gap_under_concurrent_writes,
            watch_compacted,
            lease_expiry_deletes_keys,
            lease_revoke_deletes_keys,
            lease_keep_alive_extends,
            lease_unknown_rejected,
            put_without_lease_detaches,
            concurrent_cas_increments,
            concurrent_writes_get_their_own_answers,
            guarded_writes_apply_while_guard_held,
            guarded_writes_fail_once_guard_deleted,
            guarded_writes_fail_once_guard_recreated,
            guarded_writes_fail_once_guard_lease_expired,
            atomic_write_applies_all_at_one_revision,
            atomic_write_conflict_writes_nothing,
            atomic_write_refuses_malformed_batches,
            atomic_write_guarded,
            atomic_writes_replay_whole,
        );
    };
    (@each $make:expr; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                $crate::conformance::$check(($make)().await).await;
            }
        )*
    };
}

// ---- helpers ----------------------------------------------------------------

async fn must_get(store: &dyn Store, key: &str) -> Entry {
    match store.get(key).await {
        Ok(Some(e)) => e,
        Ok(None) => panic!("get {key}: expected the key to exist, it is absent"),
        Err(e) => panic!("get {key}: unexpected error: {e}"),
    }
}

async fn must_be_absent(store: &dyn Store, key: &str) {
    match store.get(key).await {
        Ok(None) => {}
        Ok(Some(e)) => panic!("get {key}: expected absent, found {e:?}"),
        Err(e) => panic!("get {key}: unexpected error: {e}"),
    }
}

async fn create(store: &dyn Store, key: &str, value: &str) -> Revision {
    store
        .put(key, value.as_bytes().to_vec(), Precondition::Absent)
        .await
        .unwrap_or_else(|e| panic!("create {key}: unexpected error: {e}"))
}

async fn update(store: &dyn Store, key: &str, value: &str, rev: Revision) -> Revision {
    store
        .put(key, value.as_bytes().to_vec(), Precondition::Revision(rev))
        .await
        .unwrap_or_else(|e| panic!("update {key} at revision {rev}: unexpected error: {e}"))
}

async fn remove(store: &dyn Store, key: &str, rev: Revision) -> Revision {
    store
        .delete(key, rev)
        .await
        .unwrap_or_else(|e| panic!("delete {key} at revision {rev}: unexpected error: {e}"))
}

async fn open_watch(store: &dyn Store, prefix: &str, from: Revision) -> Watch {
    store
        .watch(prefix, from)
        .await
        .unwrap_or_else(|e| panic!("watch {prefix} from {from}: unexpected error: {e}"))
}

async fn next_event(w: &mut Watch, what: &str) -> WatchEvent {
    match tokio::time::timeout(EVENT_TIMEOUT, w.next()).await {
        Ok(Some(Ok(ev))) => ev,
        Ok(Some(Err(e))) => panic!("{what}: watch failed: {e}"),
        Ok(None) => panic!("{what}: watch ended"),
        Err(_) => panic!("{what}: no event within {EVENT_TIMEOUT:?}"),
    }
}

/// A comparable summary of an event: (revision, key, Some(value) for puts).
fn summary(ev: &WatchEvent) -> (Revision, String, Option<String>) {
    match ev {
        WatchEvent::Put(e) => (
            e.mod_revision,
            e.key.clone(),
            Some(String::from_utf8_lossy(&e.value).into_owned()),
        ),
        WatchEvent::Deleted { key, revision } => (*revision, key.clone(), None),
    }
}

/// Reads exactly `expected.len()` events, then writes a sentinel under
/// `sentinel_key` and requires it to be the very next event: that proves
/// there was nothing extra (no duplicate, nothing outside the prefix)
/// without waiting on a timeout. Returns the sentinel's revision.
async fn expect_exactly(
    store: &dyn Store,
    w: &mut Watch,
    what: &str,
    expected: &[(Revision, String, Option<String>)],
    sentinel_key: &str,
) -> Revision {
    let mut got = Vec::new();
    for i in 0..expected.len() {
        got.push(summary(
            &next_event(w, &format!("{what}: event {i} of {expected:?}")).await,
        ));
    }
    assert_eq!(got, expected, "{what}: wrong events");
    let rev = create(store, sentinel_key, "sentinel").await;
    let ev = next_event(w, &format!("{what}: sentinel")).await;
    assert_eq!(
        summary(&ev),
        (rev, sentinel_key.to_string(), Some("sentinel".to_string())),
        "{what}: expected the sentinel next, i.e. no extra or duplicate events"
    );
    rev
}

fn put_ev(rev: Revision, key: &str, value: &str) -> (Revision, String, Option<String>) {
    (rev, key.to_string(), Some(value.to_string()))
}

fn del_ev(rev: Revision, key: &str) -> (Revision, String, Option<String>) {
    (rev, key.to_string(), None)
}

fn assert_conflict(
    result: Result<Revision, StoreError>,
    what: &str,
    key: &str,
    expected: Option<Revision>,
    actual: Option<Revision>,
) {
    match result {
        Err(StoreError::Conflict {
            key: k,
            expected: e,
            actual: a,
        }) => {
            assert_eq!(k, key, "{what}: conflict must name the key");
            assert_eq!(e, expected, "{what}: conflict.expected");
            assert_eq!(a, actual, "{what}: conflict.actual");
        }
        other => panic!("{what}: expected Conflict on {key}, got {other:?}"),
    }
}

// ---- basic reads and writes --------------------------------------------------

pub async fn get_put_roundtrip(f: Fixture) {
    let s = &*f.store;
    must_be_absent(s, "/a").await;
    let r1 = create(s, "/a", "one").await;
    assert!(r1 > 0, "first write must have a revision > 0, got {r1}");
    assert_eq!(
        must_get(s, "/a").await,
        Entry {
            key: "/a".into(),
            value: b"one".to_vec(),
            create_revision: r1,
            mod_revision: r1,
        },
        "entry after create"
    );
    let r2 = update(s, "/a", "two", r1).await;
    assert!(
        r2 > r1,
        "update revision {r2} must exceed create revision {r1}"
    );
    let e = must_get(s, "/a").await;
    assert_eq!(e.value, b"two", "value after update");
    assert_eq!(e.create_revision, r1, "create_revision survives updates");
    assert_eq!(e.mod_revision, r2, "mod_revision is the update's revision");
}

pub async fn create_conflicts_if_exists(f: Fixture) {
    let s = &*f.store;
    let r1 = create(s, "/vms/a", "first").await;
    let again = s
        .put("/vms/a", b"second".to_vec(), Precondition::Absent)
        .await;
    assert_conflict(again, "create over existing key", "/vms/a", None, Some(r1));
    let e = must_get(s, "/vms/a").await;
    assert_eq!(
        e.value, b"first",
        "a failed create must not change the value"
    );
    assert_eq!(
        e.mod_revision, r1,
        "a failed create must not bump mod_revision"
    );
}

pub async fn put_stale_revision_conflicts(f: Fixture) {
    let s = &*f.store;
    let r1 = create(s, "/vms/a", "v1").await;
    let r2 = update(s, "/vms/a", "v2", r1).await;
    let stale = s
        .put("/vms/a", b"v3".to_vec(), Precondition::Revision(r1))
        .await;
    assert_conflict(
        stale,
        "put with stale revision",
        "/vms/a",
        Some(r1),
        Some(r2),
    );
    let e = must_get(s, "/vms/a").await;
    assert_eq!(e.value, b"v2", "a stale put must not change the value");
    assert_eq!(e.mod_revision, r2, "a stale put must not bump mod_revision");

    let missing = s
        .put("/vms/missing", b"x".to_vec(), Precondition::Revision(r2))
        .await;
    assert_conflict(
        missing,
        "put with revision on missing key",
        "/vms/missing",
        Some(r2),
        None,
    );
    must_be_absent(s, "/vms/missing").await;

    let err = s
        .put("/vms/a", b"v3".to_vec(), Precondition::Revision(r1))
        .await
        .expect_err("stale put must fail");
    assert!(
        err.to_string().contains("/vms/a"),
        "error message must name the key: {err}"
    );
}

pub async fn delete_stale_revision_conflicts(f: Fixture) {
    let s = &*f.store;
    let r1 = create(s, "/vms/a", "v1").await;
    let r2 = update(s, "/vms/a", "v2", r1).await;
    assert_conflict(
        s.delete("/vms/a", r1).await,
        "delete with stale revision",
        "/vms/a",
        Some(r1),
        Some(r2),
    );
    let kept = must_get(s, "/vms/a").await;
    assert_eq!(
        (kept.value.as_slice(), kept.mod_revision),
        (&b"v2"[..], r2),
        "a stale delete must keep the key unchanged"
    );
    let r3 = remove(s, "/vms/a", r2).await;
    assert!(r3 > r2, "delete revision {r3} must exceed {r2}");
    must_be_absent(s, "/vms/a").await;
    assert_conflict(
        s.delete("/vms/a", r2).await,
        "delete of a missing key",
        "/vms/a",
        Some(r2),
        None,
    );
    let r4 = create(s, "/vms/a", "again").await;
    let e = must_get(s, "/vms/a").await;
    assert!(r4 > r3, "re-create revision {r4} must exceed delete {r3}");
    assert_eq!(
        e.create_revision, r4,
        "a re-created key gets a new create_revision"
    );
}

pub async fn revision_increases_across_keys(f: Fixture) {
    let s = &*f.store;
    let mut last = 0;
    let mut check = |what: &str, rev: Revision| {
        assert!(
            rev > last,
            "{what}: revision {rev} must exceed previous {last}"
        );
        last = rev;
    };
    let a = create(s, "/a", "1").await;
    check("create /a", a);
    check("create /b", create(s, "/b", "1").await);
    check("create /c/d", create(s, "/c/d", "1").await);
    let a2 = update(s, "/a", "2", a).await;
    check("update /a", a2);
    check("delete /a", remove(s, "/a", a2).await);
    let (_, list_rev) = s.list("").await.expect("list everything");
    assert_eq!(
        list_rev, last,
        "list revision must be the latest write's revision"
    );
}

pub async fn values_are_binary_safe(f: Fixture) {
    let s = &*f.store;
    let bytes = vec![0u8, 255, 0, 1, 0xC3, 0x28];
    s.put("/bin", bytes.clone(), Precondition::Absent)
        .await
        .expect("put binary value");
    assert_eq!(must_get(s, "/bin").await.value, bytes, "binary value");
    s.put("/empty", Vec::new(), Precondition::Absent)
        .await
        .expect("put empty value");
    assert_eq!(
        must_get(s, "/empty").await.value,
        Vec::<u8>::new(),
        "empty value"
    );
    let (entries, _) = s.list("/empty").await.expect("list /empty");
    assert_eq!(entries.len(), 1, "an empty value is still a key");
}

pub async fn list_by_prefix(f: Fixture) {
    let s = &*f.store;
    for key in ["/vms/b", "/vmsx", "/vms", "/nodes/n1", "/vms/a/b", "/vms/a"] {
        create(s, key, key).await;
    }
    let (entries, rev) = s.list("/vms/").await.expect("list /vms/");
    let keys: Vec<&str> = entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(
        keys,
        ["/vms/a", "/vms/a/b", "/vms/b"],
        "list /vms/ must return exactly its keys in key order (not /vmsx or /vms)"
    );
    for e in &entries {
        assert_eq!(e.value, e.key.as_bytes(), "value of {}", e.key);
    }
    let last = create(s, "/nodes/n2", "x").await;
    let (_, rev2) = s.list("/vms/").await.expect("list /vms/ again");
    assert!(
        rev2 > rev,
        "list revision is store-wide: {rev2} after {rev}"
    );
    assert_eq!(rev2, last, "list revision is the latest revision");
    let (none, rev3) = s.list("/nothing/").await.expect("list /nothing/");
    assert!(none.is_empty(), "list of an unused prefix: {none:?}");
    assert_eq!(rev3, last, "list revision of an empty result");
    let (all, _) = s.list("").await.expect("list everything");
    assert_eq!(all.len(), 7, "empty prefix lists every key");
    for (prefix, n) in [("/vms/", 3), ("/nothing/", 0), ("", 7)] {
        let counted = s.count(prefix).await.expect("count");
        assert_eq!(counted, n, "count of {prefix:?} must match its list");
    }
}

// ---- watch ------------------------------------------------------------------

pub async fn watch_replays_history_then_live(f: Fixture) {
    let s = &*f.store;
    let a1 = create(s, "/w/a", "a1").await;
    let b1 = create(s, "/w/b", "b1").await;
    let a2 = update(s, "/w/a", "a2", a1).await;
    let bd = remove(s, "/w/b", b1).await;
    let history = vec![
        put_ev(a1, "/w/a", "a1"),
        put_ev(b1, "/w/b", "b1"),
        put_ev(a2, "/w/a", "a2"),
        del_ev(bd, "/w/b"),
    ];

    let mut from0 = open_watch(s, "/w/", 0).await;
    let mut from1 = open_watch(s, "/w/", 1).await;
    let mut from_mid = open_watch(s, "/w/", a2).await;

    // Live, after every watch is registered.
    let c1 = create(s, "/w/c", "c1").await;
    let a3 = update(s, "/w/a", "a3", a2).await;
    let live = [put_ev(c1, "/w/c", "c1"), put_ev(a3, "/w/a", "a3")];

    let mut all = history.clone();
    all.extend(live.iter().cloned());
    let mut from_first = Vec::new();
    for i in 0..all.len() {
        from_first.push(summary(
            &next_event(&mut from0, &format!("watch from 0, event {i}")).await,
        ));
    }
    assert_eq!(
        from_first, all,
        "watch from 0 must replay everything, then live, in order"
    );
    expect_exactly(s, &mut from1, "watch from 1", &all, "/w/sentinel1").await;
    let mut tail: Vec<_> = all.iter().filter(|e| e.0 >= a2).cloned().collect();
    tail.push(put_ev(
        must_get(s, "/w/sentinel1").await.mod_revision,
        "/w/sentinel1",
        "sentinel",
    ));
    expect_exactly(
        s,
        &mut from_mid,
        "watch from a middle revision",
        &tail,
        "/w/sentinel2",
    )
    .await;
}

pub async fn watch_from_list_revision(f: Fixture) {
    let s = &*f.store;
    create(s, "/vms/a", "a").await;
    let (_, rev) = s.list("/vms/").await.expect("list /vms/");
    let mut w = open_watch(s, "/vms/", rev + 1).await;
    let b = create(s, "/vms/b", "b").await;
    expect_exactly(
        s,
        &mut w,
        "watch from list revision + 1",
        &[put_ev(b, "/vms/b", "b")],
        "/vms/sentinel",
    )
    .await;
}

pub async fn watch_filters_prefix(f: Fixture) {
    let s = &*f.store;
    let mut w = open_watch(s, "/vms/", 0).await;
    let a = create(s, "/vms/a", "a").await;
    create(s, "/vmsx", "x").await;
    create(s, "/vms", "bare").await;
    create(s, "/nodes/n1", "n").await;
    let b = create(s, "/vms/b", "b").await;
    expect_exactly(
        s,
        &mut w,
        "watch /vms/",
        &[put_ev(a, "/vms/a", "a"), put_ev(b, "/vms/b", "b")],
        "/vms/sentinel",
    )
    .await;
}

pub async fn watch_from_future_revision(f: Fixture) {
    let s = &*f.store;
    let base = create(s, "/f/0", "0").await;
    let mut w = open_watch(s, "/f/", base + 3).await;
    let mut revs = Vec::new();
    for i in 1..=4 {
        revs.push(create(s, &format!("/f/{i}"), &i.to_string()).await);
    }
    let expected: Vec<_> = (1..=4)
        .zip(&revs)
        .filter(|(_, r)| **r >= base + 3)
        .map(|(i, r)| put_ev(*r, &format!("/f/{i}"), &i.to_string()))
        .collect();
    expect_exactly(
        s,
        &mut w,
        "watch from a future revision",
        &expected,
        "/f/sentinel",
    )
    .await;
}

/// Watches opened while a writer is busy must each see every revision from
/// their start, exactly once, in order: the replay/live hand-over is where
/// implementations lose or duplicate events.
pub async fn watch_no_gap_under_concurrent_writes(f: Fixture) {
    // Stay well inside the retained history: this checks hand-over, not
    // compaction, and watches here are read only after the writer is done.
    let writes = f.history_limit.map_or(300, |l| (l / 2).clamp(1, 300));
    let store = f.store.clone();
    let first = create(&*store, "/c/start", "0").await;
    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut revs = Vec::with_capacity(writes as usize);
            for i in 0..writes {
                let key = format!("/c/k{i:04}");
                let r = store
                    .put(&key, i.to_string().into_bytes(), Precondition::Absent)
                    .await
                    .unwrap_or_else(|e| panic!("writer: put {key}: {e}"));
                revs.push(r);
                if i % 16 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            revs
        })
    };
    let mut watches = vec![(first, open_watch(&*store, "/c/", first).await)];
    for _ in 0..6 {
        tokio::task::yield_now().await;
        let (_, rev) = store.list("/c/").await.expect("list /c/");
        watches.push((rev + 1, open_watch(&*store, "/c/", rev + 1).await));
        watches.push((1, open_watch(&*store, "/c/", 1).await));
    }
    let revs = writer.await.expect("writer task panicked");
    let last = *revs.last().expect("writer wrote");
    let mut all = vec![first];
    all.extend(&revs);
    for window in all.windows(2) {
        assert!(window[1] > window[0], "writer revisions must increase");
    }
    for (from, mut w) in watches {
        let expected: Vec<Revision> = all.iter().copied().filter(|r| *r >= from).collect();
        let mut got = Vec::with_capacity(expected.len());
        while got.len() < expected.len() {
            let ev = next_event(&mut w, &format!("watch from {from}")).await;
            got.push(ev.revision());
            if ev.revision() == last {
                break;
            }
        }
        assert_eq!(
            got, expected,
            "watch from {from}: every write exactly once, in order"
        );
    }
}

pub async fn watch_compacted(f: Fixture) {
    let Some(limit) = f.history_limit else {
        return;
    };
    let s = &*f.store;
    let mut rev = create(s, "/h/k", "0").await;
    for i in 0..limit + 10 {
        rev = update(s, "/h/k", &(i + 1).to_string(), rev).await;
    }
    let other = create(s, "/h/other", "x").await;
    match s.watch("/h/", 1).await {
        Err(StoreError::Compacted {
            prefix,
            from,
            compacted,
        }) => {
            assert_eq!(prefix, "/h/", "Compacted names the prefix");
            assert_eq!(from, 1, "Compacted names the requested revision");
            assert!(compacted >= 1, "compacted revision {compacted}");
        }
        Err(e) => panic!("watch from a compacted revision: expected Compacted, got {e}"),
        Ok(mut w) => match tokio::time::timeout(EVENT_TIMEOUT, w.next()).await {
            Ok(Some(Err(StoreError::Compacted { prefix, .. }))) => {
                assert_eq!(prefix, "/h/", "Compacted names the prefix")
            }
            other => panic!("watch from a compacted revision: expected Compacted, got {other:?}"),
        },
    }
    let mut w = open_watch(s, "/h/", other).await;
    expect_exactly(
        s,
        &mut w,
        "watch from a retained revision",
        &[put_ev(other, "/h/other", "x")],
        "/h/sentinel",
    )
    .await;
}

// ---- leases -------------------------------------------------------------------

/// With a manual clock the first operation after the deadline must see the
/// key gone; with real time, poll until it is (servers expire on a timer).
async fn wait_until_absent(f: &Fixture, key: &str) {
    match f.time {
        TimeControl::Manual(_) => must_be_absent(&*f.store, key).await,
        TimeControl::Real => {
            let deadline = tokio::time::Instant::now() + EVENT_TIMEOUT;
            loop {
                match f.store.get(key).await {
                    Ok(None) => return,
                    Ok(Some(_)) if tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    Ok(Some(e)) => panic!("{key} still present after its lease expired: {e:?}"),
                    Err(e) => panic!("get {key}: unexpected error: {e}"),
                }
            }
        }
    }
}

async fn put_leased(store: &dyn Store, key: &str, lease: LeaseId) -> Revision {
    store
        .put_with_lease(key, b"leased".to_vec(), Precondition::Absent, lease)
        .await
        .unwrap_or_else(|e| panic!("put_with_lease {key} lease {lease}: {e}"))
}

pub async fn lease_expiry_deletes_keys(f: Fixture) {
    let s = &*f.store;
    let ttl = f.lease_ttl_ms;
    let lease = s.grant_lease(ttl).await.expect("grant lease");
    let a = put_leased(s, "/l/a", lease).await;
    put_leased(s, "/l/b", lease).await;
    create(s, "/l/plain", "stays").await;
    let mut w = open_watch(s, "/l/", a).await;
    for key in ["/l/a", "/l/b", "/l/plain"] {
        let ev = next_event(&mut w, &format!("replay of {key}")).await;
        assert_eq!(ev.key(), key, "replay order");
    }
    must_get(s, "/l/a").await;

    f.advance(ttl + ttl / 2).await;
    wait_until_absent(&f, "/l/a").await;
    wait_until_absent(&f, "/l/b").await;
    must_get(s, "/l/plain").await;

    let mut deleted = BTreeSet::new();
    let mut last = 0;
    for _ in 0..2 {
        match next_event(&mut w, "deletion by lease expiry").await {
            WatchEvent::Deleted { key, revision } => {
                assert!(revision >= last, "deletions in revision order");
                last = revision;
                deleted.insert(key);
            }
            other => panic!("expected a Deleted event for lease expiry, got {other:?}"),
        }
    }
    assert_eq!(
        deleted,
        BTreeSet::from(["/l/a".to_string(), "/l/b".to_string()]),
        "expiry deletes exactly the leased keys"
    );

    match s.keep_alive(lease).await {
        Err(StoreError::LeaseNotFound { lease: l }) => assert_eq!(l, lease),
        other => panic!("keep_alive of an expired lease: expected LeaseNotFound, got {other:?}"),
    }
    match s
        .put_with_lease("/l/c", b"x".to_vec(), Precondition::Absent, lease)
        .await
    {
        Err(StoreError::LeaseNotFound { lease: l }) => assert_eq!(l, lease),
        other => panic!("put on an expired lease: expected LeaseNotFound, got {other:?}"),
    }
    must_be_absent(s, "/l/c").await;
}

pub async fn lease_revoke_deletes_keys(f: Fixture) {
    let s = &*f.store;
    let lease = s.grant_lease(f.lease_ttl_ms * 100).await.expect("grant");
    put_leased(s, "/r/a", lease).await;
    put_leased(s, "/r/b", lease).await;
    let before = s.list("").await.expect("list").1;
    let mut w = open_watch(s, "/r/", before + 1).await;
    s.revoke_lease(lease).await.expect("revoke");
    must_be_absent(s, "/r/a").await;
    must_be_absent(s, "/r/b").await;
    let mut deleted = BTreeSet::new();
    for _ in 0..2 {
        match next_event(&mut w, "deletion by revoke").await {
            WatchEvent::Deleted { key, .. } => {
                deleted.insert(key);
            }
            other => panic!("expected Deleted after revoke, got {other:?}"),
        }
    }
    assert_eq!(deleted.len(), 2, "revoke deletes both keys: {deleted:?}");
    match s.revoke_lease(lease).await {
        Err(StoreError::LeaseNotFound { lease: l }) => assert_eq!(l, lease),
        other => panic!("second revoke: expected LeaseNotFound, got {other:?}"),
    }
}

pub async fn lease_keep_alive_extends(f: Fixture) {
    let s = &*f.store;
    let ttl = f.lease_ttl_ms;
    let lease = s.grant_lease(ttl).await.expect("grant");
    put_leased(s, "/k/a", lease).await;
    f.advance(ttl * 6 / 10).await;
    s.keep_alive(lease).await.expect("keep_alive before expiry");
    f.advance(ttl * 6 / 10).await;
    // 1.2 TTL after the grant, 0.6 after the keep-alive.
    must_get(s, "/k/a").await;
    f.advance(ttl * 6 / 10).await;
    wait_until_absent(&f, "/k/a").await;
}

pub async fn lease_unknown_rejected(f: Fixture) {
    let s = &*f.store;
    let bogus = 987_654_321;
    match s
        .put_with_lease("/u/a", b"x".to_vec(), Precondition::Absent, bogus)
        .await
    {
        Err(StoreError::LeaseNotFound { lease }) => assert_eq!(lease, bogus),
        other => panic!("put with unknown lease: expected LeaseNotFound, got {other:?}"),
    }
    must_be_absent(s, "/u/a").await;
    assert!(
        matches!(s.keep_alive(bogus).await, Err(StoreError::LeaseNotFound { lease }) if lease == bogus),
        "keep_alive of unknown lease must be LeaseNotFound"
    );
    assert!(
        matches!(s.revoke_lease(bogus).await, Err(StoreError::LeaseNotFound { lease }) if lease == bogus),
        "revoke of unknown lease must be LeaseNotFound"
    );
    let l1 = s.grant_lease(f.lease_ttl_ms).await.expect("grant");
    let l2 = s.grant_lease(f.lease_ttl_ms).await.expect("grant");
    assert_ne!(l1, l2, "lease ids are unique");
}

pub async fn put_without_lease_detaches(f: Fixture) {
    let s = &*f.store;
    let lease = s.grant_lease(f.lease_ttl_ms * 100).await.expect("grant");
    let r = put_leased(s, "/d/a", lease).await;
    update(s, "/d/a", "unleased", r).await;
    s.revoke_lease(lease).await.expect("revoke");
    assert_eq!(
        must_get(s, "/d/a").await.value,
        b"unleased",
        "a plain put detaches the key from its lease"
    );
}

// ---- concurrency --------------------------------------------------------------

/// Read-modify-CAS increments from many tasks: the final count is exact
/// only if no stale write ever succeeds.
pub async fn concurrent_cas_increments(f: Fixture) {
    const TASKS: u64 = 8;
    const PER_TASK: u64 = 25;
    let key = "/counter";
    create(&*f.store, key, "0").await;
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let store = f.store.clone();
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0u64;
            for _ in 0..PER_TASK {
                loop {
                    let e = must_get(&*store, key).await;
                    let n: u64 = std::str::from_utf8(&e.value)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or_else(|| panic!("counter value {:?} is not a number", e.value));
                    // Let other tasks run between read and write, so the
                    // stale-read window is exercised even on one thread.
                    tokio::task::yield_now().await;
                    match store
                        .put(
                            key,
                            (n + 1).to_string().into_bytes(),
                            Precondition::Revision(e.mod_revision),
                        )
                        .await
                    {
                        Ok(_) => break,
                        Err(StoreError::Conflict { .. }) => {
                            conflicts += 1;
                            tokio::task::yield_now().await;
                        }
                        Err(other) => panic!("task {t}: increment failed: {other}"),
                    }
                }
            }
            conflicts
        }));
    }
    for t in tasks {
        t.await.expect("increment task panicked");
    }
    let e = must_get(&*f.store, key).await;
    assert_eq!(
        String::from_utf8_lossy(&e.value),
        (TASKS * PER_TASK).to_string(),
        "lost update: {TASKS} tasks x {PER_TASK} increments"
    );
}

/// What one of [`concurrent_writes_get_their_own_answers`]'s writes must get.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expected {
    /// Applied: the key holds this value afterwards (`None`: deleted).
    Written(Option<&'static str>),
    Conflict {
        expected: Option<Revision>,
        actual: Option<Revision>,
    },
    GuardLost(String),
    LeaseNotFound(LeaseId),
}

/// One write of the mix, asked from a task of its own.
#[derive(Clone)]
enum MixedWrite {
    Put(Precondition, &'static str),
    PutLeased(Precondition, &'static str, LeaseId),
    PutGuarded(Precondition, &'static str, Guard),
    Delete(Revision),
    DeleteGuarded(Revision, Guard),
}

impl MixedWrite {
    async fn apply(self, store: &dyn Store, key: &str) -> Result<Revision, StoreError> {
        let bytes = |v: &str| v.as_bytes().to_vec();
        match self {
            MixedWrite::Put(p, v) => store.put(key, bytes(v), p).await,
            MixedWrite::PutLeased(p, v, lease) => {
                store.put_with_lease(key, bytes(v), p, lease).await
            }
            MixedWrite::PutGuarded(p, v, g) => store.put_guarded(key, bytes(v), p, &g).await,
            MixedWrite::Delete(r) => store.delete(key, r).await,
            MixedWrite::DeleteGuarded(r, g) => store.delete_guarded(key, r, &g).await,
        }
    }
}

/// Many conditional writes at once on distinct keys, some of which must
/// fail (stale revisions, creates over existing keys, a lost guard, with a
/// stale revision too, a gone lease): a store that applies concurrent
/// writes together (a group commit) must still give each writer exactly
/// its own answer, write exactly the writes that succeed, and never fail
/// a write because a neighbour failed.
pub async fn concurrent_writes_get_their_own_answers(f: Fixture) {
    const KEYS: usize = 48;
    let s = &*f.store;
    let (_guard_lease, held) = take_guard(s, f.lease_ttl_ms * 100).await;
    let gone = create(s, "/gone-leader", "gone").await;
    remove(s, "/gone-leader", gone).await;
    let lost = Guard {
        key: "/gone-leader".into(),
        create_revision: gone,
    };
    let lease = s.grant_lease(f.lease_ttl_ms * 100).await.expect("grant");
    let gone_lease = s.grant_lease(f.lease_ttl_ms * 100).await.expect("grant");
    s.revoke_lease(gone_lease).await.expect("revoke");
    let mut revisions = Vec::new();
    for i in 0..KEYS {
        revisions.push(create(s, &format!("/w/k{i:02}"), "old").await);
    }
    let last_create = *revisions.last().expect("keys created");
    let mut writes: Vec<(String, MixedWrite, Expected)> = Vec::new();
    for (i, &rev) in revisions.iter().enumerate() {
        let key = format!("/w/k{i:02}");
        // A revision this key never had (its create was its only write).
        let stale = rev - 1;
        let conflict = |expected| Expected::Conflict {
            expected,
            actual: Some(rev),
        };
        let (write, expected) = match i % 8 {
            0 => (
                MixedWrite::Put(Precondition::Revision(rev), "new"),
                Expected::Written(Some("new")),
            ),
            1 => (
                MixedWrite::Put(Precondition::Revision(stale), "new"),
                conflict(Some(stale)),
            ),
            2 => (MixedWrite::Put(Precondition::Absent, "new"), conflict(None)),
            3 => (
                MixedWrite::PutGuarded(Precondition::Revision(rev), "new", held.clone()),
                Expected::Written(Some("new")),
            ),
            4 => (
                MixedWrite::PutGuarded(Precondition::Revision(rev), "new", lost.clone()),
                Expected::GuardLost(lost.key.clone()),
            ),
            // The lost guard wins over the conflict.
            5 => (
                MixedWrite::PutGuarded(Precondition::Revision(stale), "new", lost.clone()),
                Expected::GuardLost(lost.key.clone()),
            ),
            6 => (MixedWrite::Delete(rev), Expected::Written(None)),
            _ => (
                MixedWrite::DeleteGuarded(stale, held.clone()),
                conflict(Some(stale)),
            ),
        };
        writes.push((key, write, expected));
        match i % 8 {
            0 => writes.push((
                format!("/w/new{i:02}"),
                MixedWrite::Put(Precondition::Absent, "created"),
                Expected::Written(Some("created")),
            )),
            3 => writes.push((
                format!("/w/leased{i:02}"),
                MixedWrite::PutLeased(Precondition::Absent, "leased", lease),
                Expected::Written(Some("leased")),
            )),
            5 => writes.push((
                format!("/w/gone-lease{i:02}"),
                MixedWrite::PutLeased(Precondition::Absent, "never", gone_lease),
                Expected::LeaseNotFound(gone_lease),
            )),
            _ => {}
        }
    }
    // Every writer asks at the same moment, so that writes that must fail
    // and writes that must not are in flight together.
    let start = Arc::new(tokio::sync::Barrier::new(writes.len()));
    let mut tasks = Vec::new();
    for (key, write, _) in &writes {
        let (store, start, key, write) =
            (f.store.clone(), start.clone(), key.clone(), write.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            write.apply(&*store, &key).await
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("writer task panicked"));
    }
    let mut want_listed = Vec::new();
    let mut written_at = std::collections::BTreeMap::new();
    for ((key, _, expected), answer) in writes.iter().zip(answers) {
        match (expected, answer) {
            (Expected::Written(value), Ok(revision)) => {
                assert!(
                    revision > last_create,
                    "{key}: written at revision {revision}, not after the setup's {last_create}"
                );
                written_at.insert(key.clone(), revision);
                if let Some(value) = value {
                    want_listed.push((key.clone(), value.to_string(), Some(revision)));
                }
            }
            (
                Expected::Conflict {
                    expected: e,
                    actual: a,
                },
                Err(StoreError::Conflict {
                    key: k,
                    expected,
                    actual,
                }),
            ) => {
                assert_eq!(
                    (&k, expected, actual),
                    (key, *e, *a),
                    "{key}: the conflict names the key, what it expected and what it found"
                );
            }
            (Expected::GuardLost(guard), Err(StoreError::GuardLost { guard: g })) => {
                assert_eq!(&g, guard, "{key}: GuardLost names the guard key");
            }
            (Expected::LeaseNotFound(lease), Err(StoreError::LeaseNotFound { lease: l })) => {
                assert_eq!(l, *lease, "{key}: LeaseNotFound names the lease");
            }
            (expected, answer) => {
                panic!("{key}: expected {expected:?}, got {answer:?}")
            }
        }
        if !matches!(expected, Expected::Written(_)) && key.starts_with("/w/k") {
            want_listed.push((key.clone(), "old".into(), None));
        }
    }
    let (entries, _) = s.list("/w/").await.expect("list /w/");
    let mut listed: Vec<(String, String, Option<Revision>)> = Vec::new();
    for e in &entries {
        let value = String::from_utf8_lossy(&e.value).into_owned();
        let revision = match written_at.get(&e.key) {
            Some(&revision) => {
                assert_eq!(
                    e.mod_revision, revision,
                    "{}: a written key's mod_revision is the revision its writer got",
                    e.key
                );
                Some(revision)
            }
            None => {
                let i: usize = e.key["/w/k".len()..].parse().unwrap_or_else(|_| {
                    panic!("{}: a key nobody wrote to, or whose write failed", e.key)
                });
                assert_eq!(
                    e.mod_revision, revisions[i],
                    "{}: a failed write changes nothing",
                    e.key
                );
                None
            }
        };
        listed.push((e.key.clone(), value, revision));
    }
    want_listed.sort();
    assert_eq!(
        listed, want_listed,
        "exactly the writes that succeeded are applied, each once"
    );
    // The leased creates carry their lease.
    s.revoke_lease(lease).await.expect("revoke");
    for (key, write, _) in &writes {
        if matches!(write, MixedWrite::PutLeased(_, _, l) if *l == lease) {
            must_be_absent(s, key).await;
        }
    }
}

// ---- guarded writes -------------------------------------------------------------

const GUARD_KEY: &str = "/leader";

/// Creates the guard key under a new lease of `ttl_ms`, as a leader does.
async fn take_guard(store: &dyn Store, ttl_ms: u64) -> (LeaseId, Guard) {
    let lease = store
        .grant_lease(ttl_ms)
        .await
        .expect("grant the guard's lease");
    let revision = put_leased(store, GUARD_KEY, lease).await;
    let entry = must_get(store, GUARD_KEY).await;
    assert_eq!(
        entry.create_revision, revision,
        "a created key's create_revision is the create's revision"
    );
    let guard = Guard {
        key: GUARD_KEY.to_string(),
        create_revision: revision,
    };
    (lease, guard)
}

async fn put_guarded(
    store: &dyn Store,
    key: &str,
    value: &str,
    precondition: Precondition,
    guard: &Guard,
) -> Revision {
    store
        .put_guarded(key, value.as_bytes().to_vec(), precondition, guard)
        .await
        .unwrap_or_else(|e| panic!("guarded put {key} ({precondition:?}) under a held guard: {e}"))
}

fn assert_guard_lost(result: Result<Revision, StoreError>, what: &str, guard: &Guard) {
    match result {
        Err(StoreError::GuardLost { guard: g }) => {
            assert_eq!(g, guard.key, "{what}: GuardLost must name the guard key");
            let message = StoreError::GuardLost { guard: g }.to_string();
            assert!(
                message.contains(&guard.key),
                "{what}: the message must name the guard key: {message}"
            );
        }
        other => panic!("{what}: expected GuardLost on {}, got {other:?}", guard.key),
    }
}

/// Every kind of guarded write under a lost guard fails with `GuardLost`,
/// including one whose precondition fails too, and none changes anything.
async fn expect_guard_lost(s: &dyn Store, guard: &Guard, key: &str, rev: Revision) {
    let (before, _) = s.list("").await.expect("list before");
    assert_guard_lost(
        s.put_guarded(key, b"x".to_vec(), Precondition::Revision(rev), guard)
            .await,
        "guarded update",
        guard,
    );
    assert_guard_lost(
        s.put_guarded("/g/new", b"x".to_vec(), Precondition::Absent, guard)
            .await,
        "guarded create",
        guard,
    );
    assert_guard_lost(
        s.put_guarded(key, b"x".to_vec(), Precondition::Absent, guard)
            .await,
        "guarded create over an existing key",
        guard,
    );
    assert_guard_lost(
        s.delete_guarded(key, rev, guard).await,
        "guarded delete",
        guard,
    );
    let (after, _) = s.list("").await.expect("list after");
    assert_eq!(
        before, after,
        "writes under a lost guard must change nothing"
    );
}

pub async fn guarded_writes_apply_while_guard_held(f: Fixture) {
    let s = &*f.store;
    let (lease, guard) = take_guard(s, f.lease_ttl_ms * 100).await;
    let r1 = put_guarded(s, "/g/a", "1", Precondition::Absent, &guard).await;
    assert_eq!(must_get(s, "/g/a").await.value, b"1", "guarded create");
    // The guard is the key's incarnation, not its value: the holder may
    // rewrite it and keep the guard.
    let held = must_get(s, GUARD_KEY).await;
    s.put_with_lease(
        GUARD_KEY,
        b"rewritten".to_vec(),
        Precondition::Revision(held.mod_revision),
        lease,
    )
    .await
    .expect("rewrite the guard key");
    let r2 = put_guarded(s, "/g/a", "2", Precondition::Revision(r1), &guard).await;
    assert!(r2 > r1, "guarded update revision {r2} must exceed {r1}");
    assert_eq!(must_get(s, "/g/a").await.value, b"2", "guarded update");
    // A held guard does not lift the precondition.
    assert_conflict(
        s.put_guarded(
            "/g/a",
            b"stale".to_vec(),
            Precondition::Revision(r1),
            &guard,
        )
        .await,
        "guarded put with a stale revision",
        "/g/a",
        Some(r1),
        Some(r2),
    );
    assert_conflict(
        s.put_guarded("/g/a", b"again".to_vec(), Precondition::Absent, &guard)
            .await,
        "guarded create over an existing key",
        "/g/a",
        None,
        Some(r2),
    );
    assert_conflict(
        s.delete_guarded("/g/a", r1, &guard).await,
        "guarded delete with a stale revision",
        "/g/a",
        Some(r1),
        Some(r2),
    );
    assert_eq!(
        must_get(s, "/g/a").await.mod_revision,
        r2,
        "conflicts change nothing"
    );
    let r3 = s
        .delete_guarded("/g/a", r2, &guard)
        .await
        .expect("guarded delete under a held guard");
    assert!(r3 > r2, "guarded delete revision {r3} must exceed {r2}");
    must_be_absent(s, "/g/a").await;
    // What is written under a guard is not attached to the guard's lease.
    put_guarded(s, "/g/b", "kept", Precondition::Absent, &guard).await;
    s.revoke_lease(lease)
        .await
        .expect("revoke the guard's lease");
    must_be_absent(s, GUARD_KEY).await;
    assert_eq!(
        must_get(s, "/g/b").await.value,
        b"kept",
        "a guarded write outlives the guard's lease"
    );
}

pub async fn guarded_writes_fail_once_guard_deleted(f: Fixture) {
    let s = &*f.store;
    let (_lease, guard) = take_guard(s, f.lease_ttl_ms * 100).await;
    let r = put_guarded(s, "/g/a", "1", Precondition::Absent, &guard).await;
    let held = must_get(s, GUARD_KEY).await;
    remove(s, GUARD_KEY, held.mod_revision).await;
    expect_guard_lost(s, &guard, "/g/a", r).await;
    assert_eq!(must_get(s, "/g/a").await.value, b"1");
}

pub async fn guarded_writes_fail_once_guard_recreated(f: Fixture) {
    let s = &*f.store;
    let (lease, old) = take_guard(s, f.lease_ttl_ms * 100).await;
    let r = put_guarded(s, "/g/a", "1", Precondition::Absent, &old).await;
    s.revoke_lease(lease).await.expect("revoke the first lease");
    // Someone else takes the key: same name, new incarnation.
    let (_lease, new) = take_guard(s, f.lease_ttl_ms * 100).await;
    assert_ne!(
        old.create_revision, new.create_revision,
        "a re-created key has a new create_revision"
    );
    expect_guard_lost(s, &old, "/g/a", r).await;
    let r2 = put_guarded(s, "/g/a", "2", Precondition::Revision(r), &new).await;
    assert!(r2 > r, "the new holder writes");
}

pub async fn guarded_writes_fail_once_guard_lease_expired(f: Fixture) {
    let s = &*f.store;
    let ttl = f.lease_ttl_ms;
    let (_lease, guard) = take_guard(s, ttl).await;
    let r = put_guarded(s, "/g/a", "1", Precondition::Absent, &guard).await;
    f.advance(ttl + ttl / 2).await;
    wait_until_absent(&f, GUARD_KEY).await;
    expect_guard_lost(s, &guard, "/g/a", r).await;
    assert_eq!(must_get(s, "/g/a").await.value, b"1");
}

// ---- atomic writes of several keys --------------------------------------------

fn put_write(key: &str, value: &str, precondition: Precondition) -> Write {
    Write::Put {
        key: key.to_string(),
        value: value.as_bytes().to_vec(),
        precondition,
    }
}

fn delete_write(key: &str, revision: Revision) -> Write {
    Write::Delete {
        key: key.to_string(),
        revision,
    }
}

pub async fn atomic_write_applies_all_at_one_revision(f: Fixture) {
    let s = &*f.store;
    let ra = create(s, "/t/a", "a1").await;
    let rc = create(s, "/t/c", "c1").await;
    let (_, listed) = s.list("/t/").await.expect("list before");
    let mut w = open_watch(s, "/t/", listed + 1).await;
    let mut only_b = open_watch(s, "/t/b", listed + 1).await;
    let r = s
        .write_all(
            vec![
                put_write("/t/a", "a2", Precondition::Revision(ra)),
                put_write("/t/b", "b1", Precondition::Absent),
                delete_write("/t/c", rc),
            ],
            None,
        )
        .await
        .unwrap_or_else(|e| panic!("atomic write whose preconditions hold: {e}"));
    assert!(r > rc, "the atomic write's revision {r} must exceed {rc}");
    let a = must_get(s, "/t/a").await;
    assert_eq!(
        (a.value, a.create_revision, a.mod_revision),
        (b"a2".to_vec(), ra, r)
    );
    let b = must_get(s, "/t/b").await;
    assert_eq!(
        (b.value, b.create_revision, b.mod_revision),
        (b"b1".to_vec(), r, r),
        "a key created by an atomic write has its revision as create and mod revision"
    );
    must_be_absent(s, "/t/c").await;
    let (_, after) = s.list("/t/").await.expect("list after");
    assert!(
        after >= r,
        "list revision {after} must include the write at {r}"
    );
    // A shared etcd serves other tests' namespaces at the same time, so
    // the sentinel's revision is whatever its write got, not r + 1.
    let sentinel = expect_exactly(
        s,
        &mut w,
        "watch across an atomic write",
        &[
            put_ev(r, "/t/a", "a2"),
            put_ev(r, "/t/b", "b1"),
            del_ev(r, "/t/c"),
        ],
        "/t/z-sentinel",
    )
    .await;
    assert_eq!(
        summary(&next_event(&mut only_b, "watch of one key of an atomic write").await),
        put_ev(r, "/t/b", "b1"),
        "a watch on one key sees that key's event of the atomic write"
    );
    // Replayed from history, the write's events come back whole and in order.
    let mut replay = open_watch(s, "/t/", r).await;
    expect_exactly(
        s,
        &mut replay,
        "replay of an atomic write",
        &[
            put_ev(r, "/t/a", "a2"),
            put_ev(r, "/t/b", "b1"),
            del_ev(r, "/t/c"),
            put_ev(sentinel, "/t/z-sentinel", "sentinel"),
        ],
        "/t/z-sentinel2",
    )
    .await;
}

pub async fn atomic_write_conflict_writes_nothing(f: Fixture) {
    let s = &*f.store;
    let ra = create(s, "/t/a", "a1").await;
    let rb = create(s, "/t/b", "b1").await;
    let rb2 = update(s, "/t/b", "b2", rb).await;
    let (before, _) = s.list("").await.expect("list before");
    // The second write's precondition is stale: the first must not apply.
    assert_conflict(
        s.write_all(
            vec![
                put_write("/t/a", "a2", Precondition::Revision(ra)),
                put_write("/t/b", "stale", Precondition::Revision(rb)),
                put_write("/t/new", "n", Precondition::Absent),
            ],
            None,
        )
        .await,
        "atomic write with a stale revision on its second key",
        "/t/b",
        Some(rb),
        Some(rb2),
    );
    assert_conflict(
        s.write_all(
            vec![
                put_write("/t/new", "n", Precondition::Absent),
                put_write("/t/a", "again", Precondition::Absent),
            ],
            None,
        )
        .await,
        "atomic write creating an existing key",
        "/t/a",
        None,
        Some(ra),
    );
    assert_conflict(
        s.write_all(
            vec![
                put_write("/t/a", "a2", Precondition::Revision(ra)),
                delete_write("/t/missing", ra),
            ],
            None,
        )
        .await,
        "atomic write deleting a missing key",
        "/t/missing",
        Some(ra),
        None,
    );
    let (after, _) = s.list("").await.expect("list after");
    assert_eq!(before, after, "a refused atomic write must change nothing");
    // The first failing write is named, in the order given.
    assert_conflict(
        s.write_all(
            vec![
                put_write("/t/a", "x", Precondition::Revision(ra + 1000)),
                put_write("/t/b", "x", Precondition::Revision(rb)),
            ],
            None,
        )
        .await,
        "atomic write with two stale keys",
        "/t/a",
        Some(ra + 1000),
        Some(ra),
    );
}

pub async fn atomic_write_refuses_malformed_batches(f: Fixture) {
    let s = &*f.store;
    let ra = create(s, "/t/a", "a1").await;
    let (before, _) = s.list("").await.expect("list before");
    match s.write_all(Vec::new(), None).await {
        Err(StoreError::InvalidWrite { .. }) => {}
        other => panic!("an empty atomic write must be InvalidWrite, got {other:?}"),
    }
    match s
        .write_all(
            vec![
                put_write("/t/a", "a2", Precondition::Revision(ra)),
                put_write("/t/b", "b", Precondition::Absent),
                delete_write("/t/a", ra),
            ],
            None,
        )
        .await
    {
        Err(StoreError::InvalidWrite { key, .. }) => {
            assert_eq!(key, "/t/a", "InvalidWrite must name the key written twice")
        }
        other => panic!("an atomic write naming a key twice must be InvalidWrite, got {other:?}"),
    }
    let (after, _) = s.list("").await.expect("list after");
    assert_eq!(
        before, after,
        "a malformed atomic write must change nothing"
    );
}

pub async fn atomic_write_guarded(f: Fixture) {
    let s = &*f.store;
    let (_lease, guard) = take_guard(s, f.lease_ttl_ms * 100).await;
    let ra = put_guarded(s, "/g/a", "1", Precondition::Absent, &guard).await;
    let r = s
        .write_all(
            vec![
                put_write("/g/a", "2", Precondition::Revision(ra)),
                put_write("/g/b", "1", Precondition::Absent),
            ],
            Some(&guard),
        )
        .await
        .unwrap_or_else(|e| panic!("atomic write under a held guard: {e}"));
    assert_eq!(must_get(s, "/g/b").await.mod_revision, r);
    // A held guard does not lift a precondition.
    assert_conflict(
        s.write_all(
            vec![
                put_write("/g/c", "1", Precondition::Absent),
                put_write("/g/a", "3", Precondition::Revision(ra)),
            ],
            Some(&guard),
        )
        .await,
        "guarded atomic write with a stale revision",
        "/g/a",
        Some(ra),
        Some(r),
    );
    let held = must_get(s, GUARD_KEY).await;
    remove(s, GUARD_KEY, held.mod_revision).await;
    let (before, _) = s.list("").await.expect("list before");
    for (what, precondition) in [
        (
            "guarded atomic write after the guard is gone",
            Precondition::Revision(r),
        ),
        (
            "guarded atomic write after the guard is gone, its precondition stale too",
            Precondition::Revision(ra),
        ),
    ] {
        assert_guard_lost(
            s.write_all(
                vec![
                    put_write("/g/c", "1", Precondition::Absent),
                    put_write("/g/a", "3", precondition),
                ],
                Some(&guard),
            )
            .await,
            what,
            &guard,
        );
    }
    let (after, _) = s.list("").await.expect("list after");
    assert_eq!(
        before, after,
        "an atomic write under a lost guard must change nothing"
    );
}

/// Enough atomic writes that a replay from the start spans several pages
/// of every store's history reads: each write's events still come back
/// together, in order, and none is lost or repeated.
pub async fn atomic_writes_replay_whole(f: Fixture) {
    const WRITES: usize = 150;
    const KEYS: usize = 5;
    let s = &*f.store;
    let (_, start) = s.list("/r/").await.expect("list before");
    let mut expected = Vec::new();
    for i in 0..WRITES {
        let writes = (0..KEYS)
            .map(|k| put_write(&format!("/r/{k}/{i:04}"), "v", Precondition::Absent))
            .collect();
        let r = s
            .write_all(writes, None)
            .await
            .unwrap_or_else(|e| panic!("atomic write {i}: {e}"));
        expected.extend((0..KEYS).map(|k| put_ev(r, &format!("/r/{k}/{i:04}"), "v")));
    }
    let mut w = open_watch(s, "/r/", start + 1).await;
    expect_exactly(
        s,
        &mut w,
        "replay of many atomic writes",
        &expected,
        "/r/sentinel",
    )
    .await;
}
