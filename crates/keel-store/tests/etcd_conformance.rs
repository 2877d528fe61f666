//! The shared conformance suite against `EtcdStore`, on a running etcd.
//!
//! The etcd is at `KEEL_ETCD_ENDPOINT` (default `http://127.0.0.1:2379`);
//! start one with `scripts/start-etcd`. If it is not reachable every test
//! here fails saying so, unless `KEEL_SKIP_ETCD_TESTS=1`.
//!
//! Each test gets its own namespace, so runs and tests never see each
//! other's keys. They still share etcd's one revision counter, and two
//! checks assert that `list` returns exactly the revision of the test's own
//! last write, which holds only while nobody else writes to the cluster.
//! The test runner runs tests of other binaries beside these, and those
//! write to the shared etcd too, so those two checks (see
//! [`EXCLUSIVE_CHECKS`]) each get an etcd of their own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use keel_store::conformance::{self, Fixture};
use keel_store::etcd::{EtcdOptions, EtcdStore};
use keel_store::{Precondition, Store, StoreError};
use keel_testkit::private_etcd::PrivateEtcd;
use tokio::sync::OnceCell;

/// etcd leases are whole seconds, and with default settings etcd raises any
/// TTL below 2 s to 2 s; asking for less would make the suite's timing
/// (fractions of this TTL) wrong.
const LEASE_TTL_MS: u64 = 2_000;

/// Checks that compare a `list` revision with the test's own last write:
/// they need an etcd nobody else writes to.
const EXCLUSIVE_CHECKS: &[&str] = &["revision_increases_across_keys", "list_by_prefix"];
/// Whether etcd answered, probed once for the whole binary so that a
/// missing etcd fails every test at once instead of after a timeout each.
static REACHABLE: OnceCell<Result<(), String>> = OnceCell::const_new();

fn endpoint() -> String {
    std::env::var("KEEL_ETCD_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:2379".into())
}

fn skipped() -> bool {
    let skip = std::env::var("KEEL_SKIP_ETCD_TESTS").is_ok_and(|v| v == "1");
    if skip {
        eprintln!("KEEL_SKIP_ETCD_TESTS=1: not running the etcd tests");
    }
    skip
}

/// Unique per process, test and call, and never a prefix of another one
/// (the store adds a trailing separator).
fn unique_namespace(what: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("/keel-test/{what}-{}-{nanos}-{n}", std::process::id())
}

async fn connect(namespace: &str) -> EtcdStore {
    let endpoint = endpoint();
    let probe = REACHABLE
        .get_or_init(|| async {
            let options = EtcdOptions {
                request_timeout: Duration::from_secs(3),
                ..EtcdOptions::default()
            };
            EtcdStore::connect_with(std::slice::from_ref(&endpoint), "/keel-test/probe", options)
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        })
        .await;
    if let Err(e) = probe {
        panic!(
            "etcd at {endpoint} is not reachable ({e}).\n\
             Start one with `scripts/start-etcd` (or point KEEL_ETCD_ENDPOINT at one), \
             or set KEEL_SKIP_ETCD_TESTS=1 to skip the etcd tests."
        );
    }
    EtcdStore::connect(std::slice::from_ref(&endpoint), namespace)
        .await
        .unwrap_or_else(|e| panic!("connecting to etcd at {endpoint}: {e}"))
}

async fn fixture(check: &str) -> Fixture {
    let store = connect(&unique_namespace(check)).await;
    Fixture::real_time(Arc::new(store), LEASE_TTL_MS)
}

async fn run(check: &str, body: impl AsyncFnOnce(Fixture)) {
    if skipped() {
        return;
    }
    let started = std::time::Instant::now();
    if EXCLUSIVE_CHECKS.contains(&check) {
        // Started on a blocking thread: the helper waits for etcd to answer.
        let etcd = tokio::task::spawn_blocking(PrivateEtcd::start)
            .await
            .expect("private etcd starts");
        let store = EtcdStore::connect(&[etcd.endpoint()], &unique_namespace(check))
            .await
            .unwrap_or_else(|e| panic!("connecting to the private etcd: {e}"));
        body(Fixture::real_time(Arc::new(store), LEASE_TTL_MS)).await;
    } else {
        body(fixture(check).await).await;
    }
    eprintln!("{check}: {:?}", started.elapsed());
}

/// One test per conformance check, like `keel_store::conformance_tests!`,
/// plus the skip switch and the private etcd the macro cannot add.
macro_rules! etcd_checks {
    ($($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                run(stringify!($check), conformance::$check).await;
            }
        )*
        const CHECKS: &[&str] = &[$(stringify!($check)),*];
    };
}

etcd_checks!(
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

/// The list above is spelled out (the suite's macro can neither skip nor
/// start an etcd); this keeps it from falling behind when a check is added
/// to the suite.
#[test]
fn every_conformance_check_runs_against_etcd() {
    let suite = include_str!("../src/conformance.rs");
    let in_suite: Vec<&str> = suite
        .lines()
        .filter_map(|l| l.strip_prefix("pub async fn "))
        .filter(|l| l.contains("(f: Fixture)"))
        .filter_map(|l| l.split('(').next())
        .collect();
    assert!(!in_suite.is_empty(), "found no checks in conformance.rs");
    for check in &in_suite {
        assert!(
            CHECKS.contains(check),
            "conformance check {check} is not run against etcd: add it to etcd_checks!"
        );
    }
    for check in CHECKS {
        assert!(
            in_suite.contains(check),
            "{check} is not a conformance check"
        );
    }
}

// ---- etcd-specific ------------------------------------------------------------

/// Namespaces that are string prefixes of each other stay apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_do_not_overlap() {
    if skipped() {
        return;
    }
    let base = unique_namespace("ns");
    let short = connect(&base).await;
    let long = connect(&format!("{base}0")).await;
    short
        .put("/vms/a", b"short".to_vec(), Precondition::Absent)
        .await
        .expect("put in the short namespace");
    long.put("/vms/a", b"long".to_vec(), Precondition::Absent)
        .await
        .expect("put in the long namespace: must not conflict with the short one");
    let (short_all, _) = short.list("").await.expect("list short");
    let (long_all, _) = long.list("").await.expect("list long");
    assert_eq!(
        short_all.len(),
        1,
        "short namespace sees only its key: {short_all:?}"
    );
    assert_eq!(short_all[0].value, b"short");
    assert_eq!(
        long_all.len(),
        1,
        "long namespace sees only its key: {long_all:?}"
    );
    assert_eq!(long_all[0].value, b"long");
}

/// A list bigger than one range page is complete, in order, at one revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_spans_pages() {
    if skipped() {
        return;
    }
    let store = connect(&unique_namespace("pages")).await;
    let mut keys = Vec::new();
    for i in 0..1_203 {
        let key = format!("/p/{i:05}");
        store
            .put(&key, vec![b'x'; 10], Precondition::Absent)
            .await
            .unwrap_or_else(|e| panic!("put {key}: {e}"));
        keys.push(key);
    }
    let (entries, _) = store.list("/p/").await.expect("list /p/");
    let listed: Vec<&str> = entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(listed, keys, "every key once, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_endpoint_is_unavailable() {
    if skipped() {
        return;
    }
    let options = EtcdOptions {
        request_timeout: Duration::from_millis(500),
        ..EtcdOptions::default()
    };
    // Port 1 (tcpmux) is not an etcd on any machine we run on.
    let endpoint = "http://127.0.0.1:1".to_string();
    let started = std::time::Instant::now();
    match EtcdStore::connect_with(&[endpoint], "/keel-test/nowhere", options).await {
        Err(StoreError::Unavailable { key, reason }) => {
            assert!(
                key.contains("127.0.0.1:1"),
                "error names the endpoint: {key}: {reason}"
            );
        }
        other => panic!("connect to a closed port: expected Unavailable, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "connect must give up after its timeout, took {:?}",
        started.elapsed()
    );
}
