//! How a write that more than one writer may attempt is fenced: by
//! compare-and-swap alone, or also by the elected leader's guard.

use keel_store::{Guard, Revision, StoreError, TypedStore};
use serde::Serialize;

/// How a cluster-level write is made.
#[derive(Debug, Clone, Copy)]
pub enum Fence<'a> {
    /// Compare-and-swap on the revision read.
    Cas,
    /// Compare-and-swap, applied only while the leader's guard holds.
    Guard(&'a Guard),
}

impl<'a> Fence<'a> {
    /// The guard a write under this fence is made under, if any.
    pub fn guard(self) -> Option<&'a Guard> {
        match self {
            Fence::Cas => None,
            Fence::Guard(guard) => Some(guard),
        }
    }

    pub async fn update<T: Serialize>(
        self,
        store: &TypedStore,
        key: &str,
        value: &T,
        revision: Revision,
    ) -> Result<Revision, StoreError> {
        match self {
            Fence::Cas => store.update(key, value, revision).await,
            Fence::Guard(guard) => store.update_guarded(key, value, revision, guard).await,
        }
    }

    pub async fn create<T: Serialize>(
        self,
        store: &TypedStore,
        key: &str,
        value: &T,
    ) -> Result<Revision, StoreError> {
        match self {
            Fence::Cas => store.create(key, value).await,
            Fence::Guard(guard) => store.create_guarded(key, value, guard).await,
        }
    }

    pub async fn delete(
        self,
        store: &TypedStore,
        key: &str,
        revision: Revision,
    ) -> Result<Revision, StoreError> {
        match self {
            Fence::Cas => store.delete(key, revision).await,
            Fence::Guard(guard) => store.delete_guarded(key, revision, guard).await,
        }
    }
}
