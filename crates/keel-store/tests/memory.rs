//! MemoryStore's simulation hooks: fault injection, watch failures,
//! compaction, lease expiry on demand, determinism.

use std::sync::Arc;
use std::time::Duration;

use keel_api::ManualClock;
use keel_store::memory::{Fault, MemoryStore, Op, OpKind};
use keel_store::{Precondition, Store, StoreError, Watch, WatchEvent};

fn store() -> (MemoryStore, ManualClock) {
    let clock = ManualClock::new(1_000_000);
    (MemoryStore::with_clock(Arc::new(clock.clone())), clock)
}

async fn next(w: &mut Watch) -> Option<Result<WatchEvent, StoreError>> {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("watch stalled")
}

fn unavailable_key(r: Result<impl std::fmt::Debug, StoreError>) -> String {
    match r {
        Err(StoreError::Unavailable { key, .. }) => key,
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn fail_next_fails_that_many_operations_without_applying() {
    let (s, _) = store();
    let r = s
        .put("/vms/a", b"a".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    s.set_fail_next(2);
    assert_eq!(
        unavailable_key(
            s.put("/vms/a", b"b".to_vec(), Precondition::Revision(r))
                .await
        ),
        "/vms/a"
    );
    assert_eq!(unavailable_key(s.list("/vms/").await), "/vms/");
    assert_eq!(s.revision(), r, "a failed write is not applied");
    assert_eq!(s.get("/vms/a").await.unwrap().unwrap().value, b"a");
    assert_eq!(s.injected_faults(), 2);
}

#[tokio::test]
async fn lease_faults_name_the_lease() {
    let (s, _) = store();
    let lease = s.grant_lease(1_000).await.unwrap();
    s.set_fail_next(1);
    assert_eq!(
        unavailable_key(s.keep_alive(lease).await),
        format!("lease {lease}")
    );
    s.keep_alive(lease).await.unwrap();
}

#[tokio::test]
async fn hook_can_lose_replies_after_applying() {
    let (s, _) = store();
    s.set_fault_hook(Some(Box::new(|op: &Op<'_>| {
        (op.kind == OpKind::Put && op.key.starts_with("/vms/"))
            .then(|| Fault::AppliedThenUnavailable("reply lost".into()))
    })));
    let err = s
        .put("/vms/a", b"a".to_vec(), Precondition::Absent)
        .await
        .expect_err("reply is lost");
    assert!(err.to_string().contains("/vms/a"), "{err}");
    // ...but the write happened: a retry of the create now conflicts.
    assert_eq!(s.get("/vms/a").await.unwrap().unwrap().value, b"a");
    s.put("/nodes/n", b"n".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    s.set_fault_hook(None);
    match s.put("/vms/a", b"a".to_vec(), Precondition::Absent).await {
        Err(StoreError::Conflict {
            actual: Some(_), ..
        }) => {}
        other => panic!("expected Conflict on retry, got {other:?}"),
    }
}

#[tokio::test]
async fn fail_probability_is_seeded() {
    async fn pattern(seed: u64) -> Vec<bool> {
        let (s, _) = store();
        s.set_fail_probability(0.3, seed);
        let mut out = Vec::new();
        for _ in 0..400 {
            out.push(s.get("/k").await.is_err());
        }
        out
    }
    let a = pattern(7).await;
    assert_eq!(a, pattern(7).await, "same seed, same faults");
    assert_ne!(a, pattern(8).await, "different seed, different faults");
    let rate = a.iter().filter(|f| **f).count() as f64 / a.len() as f64;
    assert!((0.2..0.4).contains(&rate), "fault rate {rate}");
}

#[tokio::test]
async fn fail_watches_ends_open_watches_only() {
    let (s, _) = store();
    let mut w = s.watch("/vms/", 0).await.unwrap();
    s.put("/vms/a", b"a".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    assert!(matches!(next(&mut w).await, Some(Ok(WatchEvent::Put(_)))));
    s.fail_watches("connection reset");
    match next(&mut w).await {
        Some(Err(StoreError::Unavailable { key, reason })) => {
            assert_eq!(key, "/vms/");
            assert_eq!(reason, "connection reset");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        next(&mut w).await.is_none(),
        "the watch ends after its error"
    );
    let mut again = s.watch("/vms/", 1).await.unwrap();
    assert!(matches!(
        next(&mut again).await,
        Some(Ok(WatchEvent::Put(_)))
    ));
}

#[tokio::test(flavor = "current_thread")]
async fn compaction_overtakes_a_running_watch() {
    let (s, _) = store();
    let mut rev = 0;
    for i in 0..5 {
        rev = s
            .put(&format!("/k{i}"), vec![], Precondition::Absent)
            .await
            .unwrap();
    }
    // On a current-thread runtime the pump has not run yet.
    let mut w = s.watch("/", 1).await.unwrap();
    s.compact(3);
    match next(&mut w).await {
        Some(Err(StoreError::Compacted {
            compacted: 3,
            from: 1,
            ..
        })) => {}
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert!(matches!(
        s.watch("/", 2).await,
        Err(StoreError::Compacted { compacted: 3, .. })
    ));
    let mut w = s.watch("/", 4).await.unwrap();
    assert_eq!(next(&mut w).await.unwrap().unwrap().revision(), 4);
    assert_eq!(rev, 5);
}

#[tokio::test]
async fn history_limit_compacts_automatically() {
    let (s, _) = store();
    let s = s.with_history_limit(3);
    for i in 0..6 {
        s.put(&format!("/k{i}"), vec![], Precondition::Absent)
            .await
            .unwrap();
    }
    assert!(matches!(
        s.watch("/", 3).await,
        Err(StoreError::Compacted { compacted: 3, .. })
    ));
    assert!(s.watch("/", 4).await.is_ok());
}

#[tokio::test]
async fn expire_leases_emits_deletions_on_demand() {
    let (s, clock) = store();
    let lease = s.grant_lease(500).await.unwrap();
    let r = s
        .put_with_lease("/nodes/n1", b"up".to_vec(), Precondition::Absent, lease)
        .await
        .unwrap();
    let mut w = s.watch("/nodes/", r + 1).await.unwrap();
    clock.advance(499);
    assert_eq!(s.expire_leases().unwrap(), 0);
    clock.advance(1);
    assert_eq!(s.expire_leases().unwrap(), 1);
    assert_eq!(
        next(&mut w).await.unwrap().unwrap(),
        WatchEvent::Deleted {
            key: "/nodes/n1".into(),
            revision: r + 1
        }
    );
    assert!(s.dump().is_empty());
}

#[tokio::test]
async fn watch_ends_when_store_is_dropped() {
    let (s, _) = store();
    let mut w = s.watch("/", 0).await.unwrap();
    drop(s);
    assert!(next(&mut w).await.is_none());
}

/// The same seeded script gives the same store, event for event.
#[test]
fn runs_are_deterministic() {
    fn run(seed: u64) -> (Vec<keel_store::Entry>, Vec<String>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let (s, clock) = store();
            s.set_fail_probability(0.2, seed);
            let mut log = Vec::new();
            for i in 0..200u64 {
                let key = format!("/vms/{}", i % 7);
                let r = match s.get(&key).await {
                    Ok(Some(e)) => {
                        s.put(
                            &key,
                            i.to_le_bytes().to_vec(),
                            Precondition::Revision(e.mod_revision),
                        )
                        .await
                    }
                    Ok(None) => s.put(&key, vec![], Precondition::Absent).await,
                    Err(e) => Err(e),
                };
                log.push(format!("{r:?}"));
                clock.advance(10);
            }
            (s.dump(), log)
        })
    }
    assert_eq!(run(42), run(42));
}
