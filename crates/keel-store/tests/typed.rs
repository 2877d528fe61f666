//! The typed layer: stored records carry a schema version, and a record
//! that does not decode is skipped and reported, never failing a list.

use std::sync::Arc;

use keel_store::memory::MemoryStore;
use keel_store::{Precondition, StoreError, TypedStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Rec {
    n: u32,
}

#[tokio::test]
async fn writes_carry_the_schema_version() {
    let store = TypedStore::new(Arc::new(MemoryStore::new()));
    store.create("/r/a", &Rec { n: 1 }).await.unwrap();
    let raw = store.raw().get("/r/a").await.unwrap().unwrap();
    let json: serde_json::Value = serde_json::from_slice(&raw.value).unwrap();
    assert_eq!(json["schema_version"], keel_api::SCHEMA_VERSION);
    assert_eq!(json["n"], 1);
}

#[tokio::test]
async fn a_list_skips_and_reports_what_it_cannot_decode() {
    let store = TypedStore::new(Arc::new(MemoryStore::new()));
    store.create("/r/a", &Rec { n: 1 }).await.unwrap();
    let bad_rev = store
        .raw()
        .put("/r/b", b"{\"n\":\"x\"}".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    store
        .raw()
        .put(
            "/r/c",
            b"{\"n\":3,\"new\":1}".to_vec(),
            Precondition::Absent,
        )
        .await
        .unwrap();

    let (entries, _) = store.list::<Rec>("/r/").await.unwrap();
    let keys: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["/r/a", "/r/c"]);
    let listing = store.list_with_skipped::<Rec>("/r/").await.unwrap();
    assert_eq!(listing.skipped.len(), 1);
    assert_eq!(listing.skipped[0].key, "/r/b");
    assert_eq!(listing.skipped[0].revision, bad_rev);

    let log = store.undecodable();
    assert_eq!(log.current().len(), 1);
    assert_eq!(log.skipped_total(), 2);
    // Reported once per key and revision, however often it is read.
    let unreported = log.take_unreported();
    assert_eq!(unreported.len(), 1, "{unreported:?}");
    assert_eq!(unreported[0].key, "/r/b");
    assert!(log.take_unreported().is_empty());
    // A single read of it is an error that names the key.
    match store.get::<Rec>("/r/b").await {
        Err(StoreError::Corrupt { key, .. }) => assert_eq!(key, "/r/b"),
        other => panic!("{other:?}"),
    }
    // Repaired: no longer current.
    store.update("/r/b", &Rec { n: 2 }, bad_rev).await.unwrap();
    store.list::<Rec>("/r/").await.unwrap();
    assert!(log.current().is_empty());
}
