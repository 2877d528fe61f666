//! `EtcdStore` against an etcd that crashes and comes back, and against
//! compacted history. Each test starts its own etcd (with
//! `scripts/start-etcd`, on free ports, in a temp dir) because it kills or
//! compacts it; a shared etcd must keep its whole history for the
//! conformance suite. Needs the `etcd` binary; `KEEL_SKIP_ETCD_TESTS=1`
//! skips these tests like the others.

use std::time::{Duration, Instant};

use keel_store::etcd::{EtcdOptions, EtcdStore};
use keel_store::{Precondition, Revision, Store, StoreError, Watch, WatchEvent};
use keel_testkit::private_etcd::PrivateEtcd;

/// Short, so the outage part of the test is quick; what is checked is that
/// every call ends within it instead of hanging.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Slack on top of `REQUEST_TIMEOUT` for a loaded CI machine.
const SLACK: Duration = Duration::from_secs(3);
/// How long the same handle may take to work again after etcd is back.
const RECOVERY: Duration = Duration::from_secs(20);

fn skipped() -> bool {
    let skip = std::env::var("KEEL_SKIP_ETCD_TESTS").is_ok_and(|v| v == "1");
    if skip {
        eprintln!("KEEL_SKIP_ETCD_TESTS=1: not running the etcd tests");
    }
    skip
}

async fn connect(etcd: &PrivateEtcd, namespace: &str) -> EtcdStore {
    let options = EtcdOptions {
        request_timeout: REQUEST_TIMEOUT,
        ..EtcdOptions::default()
    };
    EtcdStore::connect_with(&[etcd.endpoint()], namespace, options)
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", etcd.endpoint()))
}

async fn next_event(w: &mut Watch, what: &str) -> WatchEvent {
    match tokio::time::timeout(Duration::from_secs(10), w.next()).await {
        Ok(Some(Ok(ev))) => ev,
        other => panic!("{what}: expected an event, got {other:?}"),
    }
}

fn summary(ev: &WatchEvent) -> (Revision, String, Option<Vec<u8>>) {
    match ev {
        WatchEvent::Put(e) => (e.mod_revision, e.key.clone(), Some(e.value.clone())),
        WatchEvent::Deleted { key, revision } => (*revision, key.clone(), None),
    }
}

/// Runs `op` against the dead cluster: it must end within the request
/// timeout with `Unavailable` naming `subject`.
async fn expect_unavailable<T>(
    what: &str,
    subject: &str,
    op: impl std::future::Future<Output = Result<T, StoreError>>,
) {
    let started = Instant::now();
    let result = tokio::time::timeout(REQUEST_TIMEOUT + SLACK, op)
        .await
        .unwrap_or_else(|_| panic!("{what} during the outage hung past its timeout"));
    match result {
        Err(StoreError::Unavailable { key, reason }) => {
            assert!(
                key.contains(subject),
                "{what}: Unavailable must name {subject}, got {key}: {reason}"
            );
        }
        Err(other) => panic!("{what} during the outage: expected Unavailable, got {other:?}"),
        Ok(_) => panic!("{what} during the outage: expected Unavailable, it succeeded"),
    }
    eprintln!(
        "{what} during the outage: Unavailable after {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_etcd_restart() {
    if skipped() {
        return;
    }
    let etcd = PrivateEtcd::start();
    let store = connect(&etcd, "/keel-restart").await;

    let a1 = store
        .put("/r/a", b"a1".to_vec(), Precondition::Absent)
        .await
        .expect("create /r/a");
    let mut old_watch = store.watch("/r/", 0).await.expect("watch /r/");
    assert_eq!(
        summary(&next_event(&mut old_watch, "first event").await),
        (a1, "/r/a".into(), Some(b"a1".to_vec()))
    );
    // Acknowledged just before the crash: the old watch may or may not
    // deliver it, but the resumed watch must then do so.
    let b1 = store
        .put("/r/b", b"b1".to_vec(), Precondition::Absent)
        .await
        .expect("create /r/b");
    let lease = store.grant_lease(60_000).await.expect("grant lease");

    etcd.kill();
    let outage = Instant::now();

    // The open watch ends with Unavailable (after anything it still had),
    // then closes.
    let mut last_seen = a1;
    loop {
        match tokio::time::timeout(REQUEST_TIMEOUT + SLACK, old_watch.next()).await {
            Ok(Some(Ok(ev))) => {
                assert_eq!(ev.revision(), b1, "only /r/b can still arrive: {ev:?}");
                last_seen = ev.revision();
            }
            Ok(Some(Err(StoreError::Unavailable { key, reason }))) => {
                assert_eq!(key, "/r/", "the watch error names its prefix");
                assert!(
                    reason.contains(&format!("resume from {}", last_seen + 1)),
                    "the watch error tells where to resume: {reason}"
                );
                break;
            }
            other => panic!("watch during the outage: expected Unavailable, got {other:?}"),
        }
    }
    assert!(
        matches!(
            tokio::time::timeout(SLACK, old_watch.next()).await,
            Ok(None)
        ),
        "a failed watch is closed after its error"
    );

    expect_unavailable("get", "/r/a", store.get("/r/a")).await;
    expect_unavailable(
        "put",
        "/outage/x",
        store.put("/outage/x", b"x".to_vec(), Precondition::Absent),
    )
    .await;
    expect_unavailable("delete", "/r/a", store.delete("/r/a", a1)).await;
    expect_unavailable("list", "/r/", store.list("/r/")).await;
    expect_unavailable("watch", "/r/", store.watch("/r/", last_seen + 1)).await;
    expect_unavailable("grant_lease", "lease", store.grant_lease(5_000)).await;
    expect_unavailable(
        "keep_alive",
        &format!("lease {lease}"),
        store.keep_alive(lease),
    )
    .await;
    eprintln!("outage checks took {:?}", outage.elapsed());

    tokio::task::block_in_place(|| etcd.run_script());
    let restarted = Instant::now();
    // The same handle reconnects on its own.
    let a = loop {
        match store.get("/r/a").await {
            Ok(entry) => break entry.expect("/r/a survives the restart"),
            Err(StoreError::Unavailable { .. }) if restarted.elapsed() < RECOVERY => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("get after restart (waited {:?}): {e}", restarted.elapsed()),
        }
    };
    eprintln!(
        "same handle works again {:?} after etcd was restarted",
        restarted.elapsed()
    );
    assert_eq!((a.value.as_slice(), a.mod_revision), (&b"a1"[..], a1));
    let b = store
        .get("/r/b")
        .await
        .expect("get /r/b")
        .expect("/r/b survives");
    assert_eq!(b.mod_revision, b1, "acknowledged writes survive a crash");
    store
        .keep_alive(lease)
        .await
        .expect("leases survive a restart");

    // A frozen etcd (SIGSTOP): the connection stays open but nothing
    // answers. Requests must give up at their deadline, and an open watch
    // must notice through the HTTP/2 keep-alive instead of waiting forever.
    // Writes go outside /r/: one that timed out may still be applied once
    // etcd runs again, and must not show up in the watch checked below.
    let mut stalled_watch = store.watch("/outage/", 0).await.expect("watch /outage/");
    etcd.signal("-STOP");
    let frozen = Instant::now();
    expect_unavailable("get (frozen etcd)", "/r/a", store.get("/r/a")).await;
    expect_unavailable(
        "put (frozen etcd)",
        "/outage/x",
        store.put("/outage/x", b"x".to_vec(), Precondition::Absent),
    )
    .await;
    expect_unavailable("watch (frozen etcd)", "/r/", store.watch("/r/", 1)).await;
    let keep_alive = EtcdOptions::default();
    let limit = keep_alive.keep_alive_interval + keep_alive.keep_alive_timeout + SLACK;
    match tokio::time::timeout(limit, stalled_watch.next()).await {
        Ok(Some(Err(StoreError::Unavailable { key, .. }))) => assert_eq!(key, "/outage/"),
        Err(_) => panic!("a watch on a frozen etcd still open after {limit:?}"),
        Ok(other) => panic!("watch on a frozen etcd: expected Unavailable, got {other:?}"),
    }
    eprintln!(
        "watch on the frozen etcd ended after {:?}",
        frozen.elapsed()
    );
    etcd.signal("-CONT");
    store.get("/r/a").await.expect("get after SIGCONT");

    let a2 = store
        .put("/r/a", b"a2".to_vec(), Precondition::Revision(a1))
        .await
        .expect("update /r/a after restart");
    assert!(
        a2 > b1,
        "revisions continue across the restart: {a2} after {b1}"
    );
    let c1 = store
        .put("/r/c", b"c1".to_vec(), Precondition::Absent)
        .await
        .expect("create /r/c after restart");

    let mut resumed = store
        .watch("/r/", last_seen + 1)
        .await
        .expect("watch from the last seen revision + 1");
    let mut expected: Vec<_> = [
        (b1, "/r/b".to_string(), Some(b"b1".to_vec())),
        (a2, "/r/a".to_string(), Some(b"a2".to_vec())),
        (c1, "/r/c".to_string(), Some(b"c1".to_vec())),
    ]
    .into_iter()
    .filter(|e| e.0 > last_seen)
    .collect();
    let sentinel = store
        .put("/r/sentinel", b"s".to_vec(), Precondition::Absent)
        .await
        .expect("sentinel");
    expected.push((sentinel, "/r/sentinel".into(), Some(b"s".to_vec())));
    let mut got = Vec::new();
    for i in 0..expected.len() {
        got.push(summary(
            &next_event(&mut resumed, &format!("resumed watch, event {i}")).await,
        ));
    }
    assert_eq!(
        got, expected,
        "the resumed watch delivers every change after the last one seen, once, in order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_from_compacted_revision_fails() {
    if skipped() {
        return;
    }
    let etcd = PrivateEtcd::start();
    let store = connect(&etcd, "/keel-compact").await;
    let mut rev = store
        .put("/h/k", b"0".to_vec(), Precondition::Absent)
        .await
        .expect("create /h/k");
    for i in 1..=5 {
        rev = store
            .put(
                "/h/k",
                i.to_string().into_bytes(),
                Precondition::Revision(rev),
            )
            .await
            .expect("update /h/k");
    }
    store.compact(rev).await.expect("compact");

    match store.watch("/h/", 1).await {
        Err(StoreError::Compacted {
            prefix,
            from,
            compacted,
        }) => assert_eq!((prefix.as_str(), from, compacted), ("/h/", 1, rev - 1)),
        Err(e) => panic!("watch from 1: expected Compacted, got {e}"),
        Ok(mut w) => match tokio::time::timeout(Duration::from_secs(10), w.next()).await {
            Ok(Some(Err(StoreError::Compacted {
                prefix,
                from,
                compacted,
            }))) => assert_eq!(
                (prefix.as_str(), from, compacted),
                ("/h/", 1, rev - 1),
                "Compacted names the prefix, the requested revision and the newest lost one"
            ),
            other => panic!("watch from 1: expected Compacted, got {other:?}"),
        },
    }

    // The oldest kept revision still works, and so do reads.
    let mut w = store
        .watch("/h/", rev)
        .await
        .expect("watch from the compaction revision");
    let ev = next_event(&mut w, "watch from the compaction revision").await;
    assert_eq!(ev.revision(), rev);
    let (entries, _) = store.list("/h/").await.expect("list after compaction");
    assert_eq!(entries.len(), 1);
}

/// Whether a watch of `prefix` from `from` is refused as compacted.
async fn compacted_at(store: &EtcdStore, prefix: &str, from: Revision) -> bool {
    match store.watch(prefix, from).await {
        Err(StoreError::Compacted { .. }) => true,
        Err(e) => panic!("watch from {from}: {e}"),
        Ok(mut w) => matches!(
            tokio::time::timeout(Duration::from_millis(500), w.next()).await,
            Ok(Some(Err(StoreError::Compacted { .. })))
        ),
    }
}

async fn bump(store: &EtcdStore, key: &str, times: usize) -> Revision {
    let mut rev = match store.get(key).await.expect("read") {
        Some(e) => e.mod_revision,
        None => store
            .put(key, b"0".to_vec(), Precondition::Absent)
            .await
            .expect("create"),
    };
    for i in 0..times {
        rev = store
            .put(key, i.to_string().into_bytes(), Precondition::Revision(rev))
            .await
            .expect("update");
    }
    rev
}

/// Two control planes take turns: each turn compacts only up to where
/// history stood one turn earlier, and a turn is taken once, by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_planes_take_turns_compacting_one_turn_late() {
    use keel_store::etcd::compaction::{HistoryCompactor, Round};
    if skipped() {
        return;
    }
    let etcd = PrivateEtcd::start();
    let store = connect(&etcd, "/keel-turns").await;
    let mut a = HistoryCompactor::new(connect(&etcd, "/keel-turns").await);
    let mut b = HistoryCompactor::new(connect(&etcd, "/keel-turns").await);
    bump(&store, "/h/k", 5).await;

    // The first turn only notes where history stands; the other finds
    // the turn taken.
    let Round::Noted { at: first } = a.round().await.expect("a's first round") else {
        panic!("a's first turn compacts nothing")
    };
    let Round::TakenElsewhere { at: b_saw } = b.round().await.expect("b's first round") else {
        panic!("the turn was a's")
    };
    assert!(b_saw >= first);
    assert!(
        !compacted_at(&store, "/h/", 1).await,
        "nothing compacted yet"
    );

    // The next turn compacts up to what the turn before saw, not further.
    let written_since = bump(&store, "/h/k", 3).await;
    assert_eq!(
        a.round().await.expect("a's second round"),
        Round::Compacted { before: first }
    );
    assert!(compacted_at(&store, "/h/", first - 1).await);
    assert!(
        !compacted_at(&store, "/h/", first).await,
        "history from the previous turn is kept"
    );
    assert!(!compacted_at(&store, "/h/", written_since).await);

    // b's round in the same interval finds that turn taken; its next
    // round takes the following turn, up to what it saw then.
    let Round::TakenElsewhere { at: b_saw } = b.round().await.expect("b's second round") else {
        panic!("the turn was a's")
    };
    bump(&store, "/h/k", 2).await;
    assert_eq!(
        b.round().await.expect("b's third round"),
        Round::Compacted { before: b_saw }
    );
    assert!(compacted_at(&store, "/h/", b_saw - 1).await);
    assert!(!compacted_at(&store, "/h/", b_saw).await);
    let Round::TakenElsewhere { .. } = a.round().await.expect("a's third round") else {
        panic!("the turn was b's")
    };

    // History compacted further meanwhile (by etcd itself, or by hand)
    // is not a failure of the turn.
    let newest = bump(&store, "/h/k", 1).await;
    store.compact(newest).await.expect("compact by hand");
    assert!(matches!(
        a.round()
            .await
            .expect("a's round after a compaction by hand"),
        Round::Compacted { .. }
    ));
}
