//! SQLite-only behaviour: persistence across reopen, durability of
//! acknowledged writes, refusing files that are not Keel stores, and
//! watches that survive overflowing their live buffer.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keel_api::ManualClock;
use keel_store::sqlite::{SqliteOptions, SqliteStore};
use keel_store::{Precondition, Store, StoreError, Watch, WatchEvent};

const T0: u64 = 1_700_000_000_000;

fn options(clock: &ManualClock) -> SqliteOptions {
    SqliteOptions {
        clock: Arc::new(clock.clone()),
        ..SqliteOptions::default()
    }
}

async fn next(w: &mut Watch) -> WatchEvent {
    match tokio::time::timeout(Duration::from_secs(10), w.next()).await {
        Ok(Some(Ok(ev))) => ev,
        other => panic!("expected a watch event, got {other:?}"),
    }
}

#[tokio::test]
async fn data_and_revisions_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    let clock = ManualClock::new(T0);

    let (entries_before, rev_before, lease) = {
        let s = SqliteStore::open_with(&path, options(&clock)).unwrap();
        let a = s
            .put("/vms/a", b"a1".to_vec(), Precondition::Absent)
            .await
            .unwrap();
        s.put("/vms/a", b"a2".to_vec(), Precondition::Revision(a))
            .await
            .unwrap();
        let b = s
            .put("/vms/b", b"b".to_vec(), Precondition::Absent)
            .await
            .unwrap();
        s.delete("/vms/b", b).await.unwrap();
        let lease = s.grant_lease(60_000).await.unwrap();
        s.put_with_lease("/nodes/n1", b"up".to_vec(), Precondition::Absent, lease)
            .await
            .unwrap();
        let (entries, rev) = s.list("").await.unwrap();
        (entries, rev, lease)
    };

    let s = SqliteStore::open_with(&path, options(&clock)).unwrap();
    let (entries, rev) = s.list("").await.unwrap();
    assert_eq!(entries, entries_before, "entries after reopen");
    assert_eq!(rev, rev_before, "revision after reopen");
    let next_rev = s
        .put("/vms/c", b"c".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    assert_eq!(
        next_rev,
        rev_before + 1,
        "revisions continue, not reset, after reopen"
    );

    // History survives too: a watch from 1 replays the previous process's writes.
    let mut w = s.watch("/vms/", 1).await.unwrap();
    let mut keys = Vec::new();
    for _ in 0..5 {
        let ev = next(&mut w).await;
        keys.push((ev.key().to_string(), matches!(ev, WatchEvent::Put(_))));
    }
    assert_eq!(
        keys,
        [
            ("/vms/a".to_string(), true),
            ("/vms/a".to_string(), true),
            ("/vms/b".to_string(), true),
            ("/vms/b".to_string(), false),
            ("/vms/c".to_string(), true),
        ]
    );

    // Leases survive, and ids are not reused after a restart.
    let new_lease = s.grant_lease(1_000).await.unwrap();
    assert!(
        new_lease > lease,
        "lease id {new_lease} reused or went backwards (old {lease})"
    );
    s.revoke_lease(lease).await.unwrap();
    assert_eq!(
        s.get("/nodes/n1").await.unwrap(),
        None,
        "revoking the old lease deletes its key"
    );
}

#[tokio::test]
async fn lease_deadline_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    let clock = ManualClock::new(T0);
    {
        let s = SqliteStore::open_with(&path, options(&clock)).unwrap();
        let lease = s.grant_lease(1_000).await.unwrap();
        s.put_with_lease("/nodes/n1", b"up".to_vec(), Precondition::Absent, lease)
            .await
            .unwrap();
    }
    clock.advance(1_500);
    let s = SqliteStore::open_with(&path, options(&clock)).unwrap();
    assert_eq!(
        s.get("/nodes/n1").await.unwrap(),
        None,
        "expired while we were down"
    );
}

/// The settings that make an acknowledged write survive a crash or power
/// loss, read from the store's own connection: every commit fsynced
/// (`synchronous=FULL`) into a write-ahead log (`journal_mode=WAL`). The
/// copy test below cannot tell: a copy sees the page cache, fsynced or not.
#[tokio::test]
async fn the_store_connection_runs_synchronous_full_in_wal_mode() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(dir.path().join("keel.db")).unwrap();
    s.put("/k", b"v".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let d = s.durability().await.unwrap();
    assert_eq!(d.synchronous, "FULL", "{d:?}");
    assert_eq!(d.journal_mode, "wal", "{d:?}");
    // Reopened, the settings are applied again (synchronous is per connection).
    drop(s);
    let s = SqliteStore::open(dir.path().join("keel.db")).unwrap();
    let d = s.durability().await.unwrap();
    assert_eq!(
        (d.synchronous.as_str(), d.journal_mode.as_str()),
        ("FULL", "wal")
    );
}

/// A crash of the process leaves whatever is in the database and WAL
/// files; copying them while the store is still open is that crash. Every
/// acknowledged write must be in the copy. (Power loss is what
/// `synchronous=FULL` is for; see the test above.)
#[tokio::test]
async fn acknowledged_writes_are_on_disk_before_close() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    let s = SqliteStore::open(&path).unwrap();
    let mut rev = 0;
    for i in 0..20 {
        rev = s
            .put(&format!("/vms/{i:02}"), vec![i], Precondition::Absent)
            .await
            .unwrap();
    }

    let crash = tempfile::tempdir().unwrap();
    let copy = crash.path().join("keel.db");
    std::fs::copy(&path, &copy).unwrap();
    let wal = dir.path().join("keel.db-wal");
    if wal.exists() {
        std::fs::copy(&wal, crash.path().join("keel.db-wal")).unwrap();
    }

    let recovered = SqliteStore::open(&copy).unwrap();
    let (entries, recovered_rev) = recovered.list("/vms/").await.unwrap();
    assert_eq!(entries.len(), 20, "acknowledged writes missing after crash");
    assert_eq!(recovered_rev, rev);
    drop(s);
}

#[tokio::test]
async fn uses_wal_and_compacts_history_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    let s = SqliteStore::open_with(
        &path,
        SqliteOptions {
            history_limit: 10,
            history_min_age_ms: 0,
            ..SqliteOptions::default()
        },
    )
    .unwrap();
    let mut rev = s
        .put("/k", b"0".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    for i in 0..30u8 {
        rev = s
            .put("/k", vec![i], Precondition::Revision(rev))
            .await
            .unwrap();
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let (rows, min): (i64, i64) = conn
        .query_row("SELECT count(*), min(rev) FROM history", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(rows, 10, "history keeps the last 10 revisions");
    assert_eq!(min as u64, rev - 9);
    match s.watch("/", rev - 10).await {
        Err(StoreError::Compacted { compacted, .. }) => assert_eq!(compacted, rev - 10),
        other => panic!("expected Compacted, got {:?}", other.map(|_| "a watch")),
    }
    let mut w = s.watch("/", rev - 9).await.unwrap();
    assert_eq!(next(&mut w).await.revision(), rev - 9);
}

/// A watcher that fell behind by less than a minute catches up from
/// history even past the revision limit (a burst of writes under 50
/// nodes made them list everything again instead); history older than a
/// minute goes as before, down to the limit.
#[tokio::test]
async fn history_younger_than_a_minute_outlives_the_limit() {
    let clock = ManualClock::new(T0);
    let s = SqliteStore::open_in_memory_with(SqliteOptions {
        history_limit: 10,
        history_min_age_ms: 60_000,
        ..options(&clock)
    })
    .unwrap();
    let first = s
        .put("/k", b"0".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let mut rev = first;
    let write = async |rev: &mut u64, n: u8| {
        for i in 0..n {
            *rev = s
                .put("/k", vec![i], Precondition::Revision(*rev))
                .await
                .unwrap();
        }
    };
    write(&mut rev, 30).await;
    clock.advance(30_000);
    write(&mut rev, 30).await;
    let mut w = s.watch("/", first).await.expect("half a minute old");
    assert_eq!(next(&mut w).await.revision(), first);
    drop(w);

    // A minute on, what was written before it may go (the limit still
    // keeps the newest 10), and what was written since stays.
    let a_minute_ago = rev;
    clock.advance(60_000);
    write(&mut rev, 1).await;
    match s.watch("/", first).await {
        Err(StoreError::Compacted { compacted, .. }) => {
            assert!(compacted < a_minute_ago, "compacted {compacted}")
        }
        other => panic!("expected Compacted, got {:?}", other.map(|_| "a watch")),
    }
    let mut w = s.watch("/", a_minute_ago).await.expect("kept");
    assert_eq!(next(&mut w).await.revision(), a_minute_ago);
}

fn assert_open_fails(path: &Path, needle: &str) -> String {
    let err = SqliteStore::open(path).expect_err("open must fail");
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "error must name the path: {msg}"
    );
    assert!(msg.contains(needle), "error must say {needle:?}: {msg}");
    assert_eq!(err.path, path);
    msg
}

#[test]
fn garbage_file_is_refused_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    std::fs::write(&path, vec![0x5A; 8192]).unwrap();
    assert_open_fails(&path, "not a SQLite database");
}

#[test]
fn foreign_database_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.db");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE invoices (id INTEGER PRIMARY KEY); INSERT INTO invoices VALUES (7);",
        )
        .unwrap();
    }
    assert_open_fails(&path, "not a Keel store");
    let conn = rusqlite::Connection::open(&path).unwrap();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        tables,
        ["invoices"],
        "a foreign database must not be modified"
    );
}

#[test]
fn newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    drop(SqliteStore::open(&path).unwrap());
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.pragma_update(None, "user_version", 99).unwrap();
    drop(conn);
    assert_open_fails(&path, "newer");
}

/// A store written by a Keel whose history had one row per revision
/// (schema version 1) opens migrated: its history replays as before, and
/// an atomic write's rows, several at one revision, fit next to it.
#[tokio::test]
async fn version_1_history_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).unwrap();
    let r1 = store
        .put("/a", b"1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let r2 = store
        .put("/b", b"2".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    drop(store);
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE history_v1 (rev INTEGER PRIMARY KEY, key TEXT NOT NULL,
             kind INTEGER NOT NULL, value BLOB, create_rev INTEGER);
         INSERT INTO history_v1 SELECT rev, key, kind, value, create_rev FROM history;
         DROP TABLE history;
         ALTER TABLE history_v1 RENAME TO history;
         PRAGMA user_version = 1;
         COMMIT;",
    )
    .unwrap();
    drop(conn);

    let store = SqliteStore::open(&path).unwrap();
    let r3 = store
        .write_all(
            vec![
                keel_store::Write::Put {
                    key: "/a".into(),
                    value: b"3".to_vec(),
                    precondition: Precondition::Revision(r1),
                },
                keel_store::Write::Delete {
                    key: "/b".into(),
                    revision: r2,
                },
            ],
            None,
        )
        .await
        .unwrap();
    let mut w = store.watch("/", 1).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let ev = next(&mut w).await;
        seen.push((ev.revision(), ev.key().to_string()));
    }
    assert_eq!(
        seen,
        [
            (r1, "/a".into()),
            (r2, "/b".into()),
            (r3, "/a".into()),
            (r3, "/b".into())
        ],
        "the migrated history and the atomic write replay in order"
    );
    drop(w);
    drop(store);
    let conn = rusqlite::Connection::open(&path).unwrap();
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        version, 2,
        "the schema version is raised with the migration"
    );
}

#[test]
fn missing_directory_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no/such/dir/keel.db");
    assert_open_fails(&path, "unable to open");
}

/// With a tiny live buffer, a watcher that does not read while hundreds of
/// writes land overflows it; it must fall back to history, not lose events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_watcher_recovers_from_live_overflow() {
    let s = SqliteStore::open_in_memory_with(SqliteOptions {
        watch_buffer: 4,
        ..SqliteOptions::default()
    })
    .unwrap();
    let mut w = s.watch("/x/", 1).await.unwrap();
    let mut revs = Vec::new();
    for i in 0..700 {
        revs.push(
            s.put(&format!("/x/{i:04}"), vec![1], Precondition::Absent)
                .await
                .unwrap(),
        );
        if i % 100 == 0 {
            // Interleave an unrelated prefix; the watch must skip it.
            s.put(&format!("/y/{i}"), vec![2], Precondition::Absent)
                .await
                .unwrap();
        }
    }
    for (i, rev) in revs.iter().enumerate() {
        let ev = next(&mut w).await;
        assert_eq!(
            (ev.key(), ev.revision()),
            (format!("/x/{i:04}").as_str(), *rev)
        );
    }
}

#[tokio::test]
async fn expire_leases_delivers_deletions_without_other_traffic() {
    let clock = ManualClock::new(T0);
    let s = SqliteStore::open_in_memory_with(options(&clock)).unwrap();
    let lease = s.grant_lease(1_000).await.unwrap();
    let r = s
        .put_with_lease("/nodes/n1", b"up".to_vec(), Precondition::Absent, lease)
        .await
        .unwrap();
    let mut w = s.watch("/nodes/", r + 1).await.unwrap();
    assert_eq!(s.expire_leases().await.unwrap(), 0);
    clock.advance(1_000);
    assert_eq!(s.expire_leases().await.unwrap(), 1);
    assert_eq!(
        next(&mut w).await,
        WatchEvent::Deleted {
            key: "/nodes/n1".into(),
            revision: r + 1
        }
    );
}

#[tokio::test]
async fn watch_ends_when_store_is_dropped() {
    let s = SqliteStore::open_in_memory().unwrap();
    let mut w = s.watch("/", 0).await.unwrap();
    drop(s);
    let end = tokio::time::timeout(Duration::from_secs(10), w.next()).await;
    assert!(
        matches!(end, Ok(None)),
        "expected the watch to end, got {end:?}"
    );
}
