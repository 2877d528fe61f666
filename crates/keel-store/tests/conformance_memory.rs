//! The shared conformance suite against `MemoryStore`.

use std::sync::Arc;

use keel_api::ManualClock;
use keel_store::conformance::Fixture;
use keel_store::memory::MemoryStore;

async fn fixture() -> Fixture {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::with_clock(Arc::new(clock.clone())).with_history_limit(256);
    Fixture::manual(Arc::new(store), clock).with_history_limit(256)
}

keel_store::conformance_tests!(fixture);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_in_one() {
    keel_store::conformance::run_all(fixture).await;
}

/// Simulations run on a current-thread runtime; the suite must pass there too.
#[tokio::test(flavor = "current_thread")]
async fn run_all_current_thread() {
    keel_store::conformance::run_all(fixture).await;
}
