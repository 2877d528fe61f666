//! The shared conformance suite against `SqliteStore`, in memory and on disk.

use std::sync::Arc;

use keel_api::ManualClock;
use keel_store::conformance::Fixture;
use keel_store::sqlite::{SqliteOptions, SqliteStore};

fn options(clock: &ManualClock) -> SqliteOptions {
    SqliteOptions {
        clock: Arc::new(clock.clone()),
        history_limit: 256,
        // The suite's compaction case writes past the limit in an instant.
        history_min_age_ms: 0,
        ..SqliteOptions::default()
    }
}

async fn in_memory() -> Fixture {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = SqliteStore::open_in_memory_with(options(&clock)).expect("open in-memory store");
    Fixture::manual(Arc::new(store), clock).with_history_limit(256)
}

async fn on_disk() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = ManualClock::new(1_700_000_000_000);
    let store = SqliteStore::open_with(dir.path().join("keel.db"), options(&clock))
        .expect("open file store");
    Fixture::manual(Arc::new(store), clock)
        .with_history_limit(256)
        .with_guard(dir)
}

mod memory_db {
    use super::*;
    keel_store::conformance_tests!(in_memory);
}

mod file_db {
    use super::*;
    keel_store::conformance_tests!(on_disk);
}
