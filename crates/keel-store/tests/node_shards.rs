//! The per-node copies of VM records (`node_shards`): the wrapper is a
//! store like any other (the conformance suite, with copies made of its
//! `/vms/` keys), and each node's view holds exactly the records naming it.

use std::sync::Arc;
use std::time::Duration;

use keel_api::ManualClock;
use keel_store::conformance::Fixture;
use keel_store::memory::MemoryStore;
use keel_store::node_shards::{MembersOf, Repaired, ShardedStore, SHARDS_ROOT};
use keel_store::{Entry, Precondition, Store, StoreError, Watch, WatchEvent, Write};

/// A record's nodes, for these tests: its value read as comma-separated
/// node names (anything that is no name, like `/` or an empty part, names
/// none).
fn members_of() -> MembersOf {
    Arc::new(|value: &[u8]| {
        String::from_utf8_lossy(value)
            .split(',')
            .map(str::to_string)
            .collect()
    })
}

fn memory() -> Arc<MemoryStore> {
    let clock = ManualClock::new(1_700_000_000_000);
    Arc::new(MemoryStore::with_clock(Arc::new(clock)).with_history_limit(256))
}

async fn fixture() -> Fixture {
    let clock = ManualClock::new(1_700_000_000_000);
    let inner = MemoryStore::with_clock(Arc::new(clock.clone())).with_history_limit(256);
    let store = ShardedStore::new(Arc::new(inner), "/vms/", members_of());
    Fixture::manual(Arc::new(store), clock).with_history_limit(256)
}

keel_store::conformance_tests!(fixture);

fn sharded(inner: &Arc<MemoryStore>) -> Arc<ShardedStore> {
    Arc::new(ShardedStore::new(
        Arc::clone(inner) as Arc<dyn Store>,
        "/vms/",
        members_of(),
    ))
}

/// Every copy in the store, as `(node, name, mod_revision, value)`.
async fn copies(inner: &MemoryStore) -> Vec<(String, String, u64, String)> {
    let (all, _) = inner.list(SHARDS_ROOT).await.unwrap();
    all.into_iter()
        .map(|e| {
            let rest = e.key.strip_prefix(SHARDS_ROOT).unwrap();
            let (node, name) = rest.split_once('/').unwrap();
            (
                node.to_string(),
                name.to_string(),
                e.mod_revision,
                String::from_utf8(e.value).unwrap(),
            )
        })
        .collect()
}

fn copy(node: &str, name: &str, rev: u64, value: &str) -> (String, String, u64, String) {
    (node.into(), name.into(), rev, value.into())
}

async fn next(watch: &mut Watch) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("an event in time")
        .expect("the watch is open")
        .expect("no watch error")
}

#[tokio::test]
async fn copies_follow_the_nodes_a_record_names() {
    let inner = memory();
    let store = sharded(&inner);

    let r1 = store
        .put("/vms/a", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    assert_eq!(copies(&inner).await, vec![copy("n1", "a", r1, "n1")]);

    // Moving: the old node's copy goes, the new one's comes, in the one
    // write.
    let r2 = store
        .put("/vms/a", b"n2".to_vec(), Precondition::Revision(r1))
        .await
        .unwrap();
    assert_eq!(copies(&inner).await, vec![copy("n2", "a", r2, "n2")]);

    // Two nodes (a migration's target), then an unchanged node keeps its
    // copy, rewritten.
    let r3 = store
        .put("/vms/a", b"n2,n3".to_vec(), Precondition::Revision(r2))
        .await
        .unwrap();
    assert_eq!(
        copies(&inner).await,
        vec![copy("n2", "a", r3, "n2,n3"), copy("n3", "a", r3, "n2,n3")]
    );

    // No node: no copy.
    let r4 = store
        .put("/vms/a", b"".to_vec(), Precondition::Revision(r3))
        .await
        .unwrap();
    assert!(copies(&inner).await.is_empty());

    let r5 = store
        .put("/vms/a", b"n1".to_vec(), Precondition::Revision(r4))
        .await
        .unwrap();
    store.delete("/vms/a", r5).await.unwrap();
    assert!(copies(&inner).await.is_empty());
    assert!(store.get("/vms/a").await.unwrap().is_none());
}

/// A stale writer's record write fails on the record, as without copies,
/// and changes no copy.
#[tokio::test]
async fn a_stale_record_write_conflicts_on_the_record() {
    let inner = memory();
    let store = sharded(&inner);
    let r1 = store
        .put("/vms/a", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let r2 = store
        .put("/vms/a", b"n2".to_vec(), Precondition::Revision(r1))
        .await
        .unwrap();
    let err = store
        .put("/vms/a", b"n3".to_vec(), Precondition::Revision(r1))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        StoreError::Conflict {
            key: "/vms/a".into(),
            expected: Some(r1),
            actual: Some(r2),
        }
    );
    let err = store
        .put("/vms/a", b"n3".to_vec(), Precondition::Absent)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict { key, .. } if key == "/vms/a"));
    assert_eq!(copies(&inner).await, vec![copy("n2", "a", r2, "n2")]);
}

/// Another process's writes are not known here: the old record's nodes
/// are read, and a batch of several records (the leader's placements)
/// writes every copy.
#[tokio::test]
async fn a_record_written_elsewhere_gets_its_copies_moved() {
    let inner = memory();
    let one = sharded(&inner);
    let other = sharded(&inner);
    let ra = one
        .put("/vms/a", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let rb = one
        .put("/vms/b", b"".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let r = other
        .write_all(
            vec![
                Write::Put {
                    key: "/vms/a".into(),
                    value: b"n2".to_vec(),
                    precondition: Precondition::Revision(ra),
                },
                Write::Put {
                    key: "/vms/b".into(),
                    value: b"n2".to_vec(),
                    precondition: Precondition::Revision(rb),
                },
                Write::Put {
                    key: "/events/e1".into(),
                    value: b"placed".to_vec(),
                    precondition: Precondition::Absent,
                },
            ],
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        copies(&inner).await,
        vec![copy("n2", "a", r, "n2"), copy("n2", "b", r, "n2")]
    );
}

/// A record written around the copies (by a writer without them) is
/// copied right at its next write, and `repair` sets every record right.
#[tokio::test]
async fn copies_missing_or_stale_are_made_right() {
    let inner = memory();
    let store = sharded(&inner);
    // Written around the wrapper: a record with no copy, and a stale copy
    // of a record that is gone.
    let ra = inner
        .put("/vms/a", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let rc = inner
        .put("/vms/c", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    inner
        .put(
            &format!("{SHARDS_ROOT}n9/c"),
            b"n9".to_vec(),
            Precondition::Absent,
        )
        .await
        .unwrap();
    inner
        .put(
            &format!("{SHARDS_ROOT}n4/gone"),
            b"n4".to_vec(),
            Precondition::Absent,
        )
        .await
        .unwrap();

    // The next write through the wrapper finds the copies not as the
    // invariant says and writes them as they are.
    let r2 = store
        .put("/vms/a", b"n2".to_vec(), Precondition::Revision(ra))
        .await
        .unwrap();
    assert!(copies(&inner).await.contains(&copy("n2", "a", r2, "n2")));

    let repaired = store.repair().await.unwrap();
    assert_eq!(
        repaired,
        Repaired {
            records: 1,
            orphans: 1,
            raced: 0
        }
    );
    let rc2 = store.get("/vms/c").await.unwrap().unwrap().mod_revision;
    assert!(rc2 > rc, "the record is written again with its copies");
    assert_eq!(
        copies(&inner).await,
        vec![copy("n1", "c", rc2, "n1"), copy("n2", "a", r2, "n2")]
    );
    assert_eq!(store.repair().await.unwrap(), Repaired::default());
}

#[tokio::test]
async fn nobody_writes_a_copy_but_its_record() {
    let inner = memory();
    let store = sharded(&inner);
    let key = format!("{SHARDS_ROOT}n1/a");
    let err = store
        .put(&key, b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidWrite { .. }), "{err:?}");
    store
        .put("/vms/a", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let lease = store.grant_lease(10_000).await.unwrap();
    let err = store
        .put_with_lease("/vms/b", b"n1".to_vec(), Precondition::Absent, lease)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidWrite { .. }), "{err:?}");
    // Lists and watches of everything do not show the copies.
    let (all, _) = store.list("").await.unwrap();
    let keys: Vec<&str> = all.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, vec!["/vms/a"]);
    assert_eq!(store.count("").await.unwrap(), 1);
}

/// A node's view lists and watches the node's records as records: one
/// coming, one changing, one leaving (seen as its deletion), and none of
/// another node's.
#[tokio::test]
async fn a_nodes_view_holds_the_records_naming_it() {
    let inner = memory();
    let store = sharded(&inner);
    let ra = store
        .put("/vms/a", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    store
        .put("/vms/b", b"n2".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let view = store.node_view("n1").unwrap();
    let (listed, at) = view.list("/vms/").await.unwrap();
    assert_eq!(
        listed,
        vec![Entry {
            key: "/vms/a".into(),
            value: b"n1".to_vec(),
            create_revision: ra,
            mod_revision: ra,
        }]
    );
    let mut watch = view.watch("/vms/", at + 1).await.unwrap();

    // Another node's changes are not seen; this node's are.
    let rb = store.get("/vms/b").await.unwrap().unwrap().mod_revision;
    store
        .put("/vms/b", b"n3".to_vec(), Precondition::Revision(rb))
        .await
        .unwrap();
    let rc = store
        .put("/vms/c", b"n3,n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    match next(&mut watch).await {
        WatchEvent::Put(e) => {
            assert_eq!((e.key.as_str(), e.mod_revision), ("/vms/c", rc));
            assert_eq!(e.value, b"n3,n1");
        }
        other => panic!("expected c coming, got {other:?}"),
    }
    let ra2 = store
        .put("/vms/a", b"n2".to_vec(), Precondition::Revision(ra))
        .await
        .unwrap();
    assert_eq!(
        next(&mut watch).await,
        WatchEvent::Deleted {
            key: "/vms/a".into(),
            revision: ra2
        }
    );
    // The rest of the view is the store itself.
    assert_eq!(view.list("/vms/").await.unwrap().0.len(), 1);
    assert!(view.get("/vms/b").await.unwrap().is_some());
    assert_eq!(view.count("/vms/").await.unwrap(), 1);
}

/// A record's nodes are judged once per revision: a writer's own write
/// coming back on its watch keeps the nodes judged when it was written,
/// so its next write judges only the new value. (Judging decodes the
/// record; every agent write paid for two decodes of it.)
#[tokio::test]
async fn a_writers_own_write_seen_again_is_not_judged_again() {
    let judged = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counting: MembersOf = {
        let judged = Arc::clone(&judged);
        let members = members_of();
        Arc::new(move |value: &[u8]| {
            judged.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            members(value)
        })
    };
    let inner = memory();
    let store = Arc::new(ShardedStore::new(
        Arc::clone(&inner) as Arc<dyn Store>,
        "/vms/",
        counting,
    ));
    let view = store.node_view("n1").unwrap();
    let mut watch = view.watch("/vms/", 1).await.unwrap();
    let judged_now = || judged.load(std::sync::atomic::Ordering::SeqCst);

    let r1 = store
        .put("/vms/a", b"n1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    assert_eq!(judged_now(), 1, "the new value, once");
    // Its own write, back on the watch.
    match next(&mut watch).await {
        WatchEvent::Put(e) => assert_eq!(e.mod_revision, r1),
        other => panic!("expected a's put, got {other:?}"),
    }
    let r2 = store
        .put("/vms/a", b"n1".to_vec(), Precondition::Revision(r1))
        .await
        .unwrap();
    assert_eq!(
        judged_now(),
        2,
        "only the new value: the old was judged at r1"
    );

    // A change written elsewhere is judged when this writer next writes.
    let other = sharded(&inner);
    let r3 = other
        .put("/vms/a", b"n1".to_vec(), Precondition::Revision(r2))
        .await
        .unwrap();
    for want in [r2, r3] {
        match next(&mut watch).await {
            WatchEvent::Put(e) => assert_eq!(e.mod_revision, want),
            other => panic!("expected a's put at {want}, got {other:?}"),
        }
    }
    let before = judged_now();
    store
        .put("/vms/a", b"n1".to_vec(), Precondition::Revision(r3))
        .await
        .unwrap();
    assert_eq!(
        judged_now() - before,
        2,
        "the old value as seen, and the new"
    );
    assert_eq!(copies(&inner).await.len(), 1);
}
