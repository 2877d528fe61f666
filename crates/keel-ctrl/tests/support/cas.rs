//! How users and tests change a stored record: read, change, write with
//! compare-and-swap, again on conflict (as the API does).

use keel_store::{StoreError, TypedStore};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Applies `change` to the record at `key` until a write lands. `Ok(false)`
/// if there is no record; `change`'s error stops it with nothing written.
/// A store failure other than a conflict panics: test stores do not fail
/// unless a test makes them.
pub async fn modify<T, E>(
    store: &TypedStore,
    key: &str,
    mut change: impl FnMut(&mut T) -> Result<(), E>,
) -> Result<bool, E>
where
    T: Serialize + DeserializeOwned,
{
    loop {
        let Some(entry) = store.get::<T>(key).await.expect("store get") else {
            return Ok(false);
        };
        let mut value = entry.value;
        change(&mut value)?;
        match store.update(key, &value, entry.revision).await {
            Ok(_) => return Ok(true),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => panic!("writing {key}: {e}"),
        }
    }
}

/// [`modify`] for a change that cannot fail, of a record that must exist.
pub async fn update<T>(store: &TypedStore, key: &str, mut change: impl FnMut(&mut T))
where
    T: Serialize + DeserializeOwned,
{
    let found = modify(store, key, |v: &mut T| {
        change(v);
        Ok::<(), std::convert::Infallible>(())
    })
    .await
    .unwrap_or_else(|never| match never {});
    assert!(found, "no record at {key}");
}
