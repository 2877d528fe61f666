//! JSON-typed access on top of any [`Store`].

use std::sync::Arc;

use serde::{de::DeserializeOwned, Serialize};

use crate::{Guard, Precondition, Revision, Store, StoreError};

#[derive(Debug, Clone, PartialEq)]
pub struct TypedEntry<T> {
    pub value: T,
    pub revision: Revision,
}

#[derive(Clone)]
pub struct TypedStore {
    inner: Arc<dyn Store>,
}

impl TypedStore {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self { inner }
    }

    pub fn raw(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    pub async fn get<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<TypedEntry<T>>, StoreError> {
        match self.inner.get(key).await? {
            None => Ok(None),
            Some(e) => Ok(Some(TypedEntry {
                value: decode(key, &e.value)?,
                revision: e.mod_revision,
            })),
        }
    }

    pub async fn create<T: Serialize>(&self, key: &str, value: &T) -> Result<Revision, StoreError> {
        self.inner
            .put(key, encode(value), Precondition::Absent)
            .await
    }

    /// Writes `value` only if the key is still at `revision`.
    pub async fn update<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        revision: Revision,
    ) -> Result<Revision, StoreError> {
        self.inner
            .put(key, encode(value), Precondition::Revision(revision))
            .await
    }

    pub async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.inner.delete(key, revision).await
    }

    /// `create`, only while `guard` holds (see [`Guard`]).
    pub async fn create_guarded<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner
            .put_guarded(key, encode(value), Precondition::Absent, guard)
            .await
    }

    /// `update`, only while `guard` holds.
    pub async fn update_guarded<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner
            .put_guarded(key, encode(value), Precondition::Revision(revision), guard)
            .await
    }

    /// `delete`, only while `guard` holds.
    pub async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner.delete_guarded(key, revision, guard).await
    }

    pub async fn list<T: DeserializeOwned>(
        &self,
        prefix: &str,
    ) -> Result<(Vec<(String, TypedEntry<T>)>, Revision), StoreError> {
        let (entries, rev) = self.inner.list(prefix).await?;
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let value = decode(&e.key, &e.value)?;
            out.push((
                e.key,
                TypedEntry {
                    value,
                    revision: e.mod_revision,
                },
            ));
        }
        Ok((out, rev))
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("resource types always serialize")
}

fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    })
}
