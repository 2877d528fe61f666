//! A store wrapper for tests: a list of keys under a chosen prefix takes
//! as long as asked (an etcd answering a large range slowly, a SQLite
//! waiting on a busy disk), on tokio's clock; every other call goes
//! straight through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keel_store::{Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch, Write};

#[derive(Clone)]
pub struct SlowListStore {
    inner: Arc<dyn Store>,
    /// Lists of a prefix starting with the first take the second this long.
    slow: Arc<Mutex<Option<(String, Duration)>>>,
    /// How many lists were slowed and have answered.
    slowed: Arc<AtomicU64>,
}

impl SlowListStore {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            slow: Default::default(),
            slowed: Default::default(),
        }
    }

    /// From now on, a list of anything under `prefix` takes `delay`.
    pub fn slow_lists(&self, prefix: &str, delay: Duration) {
        *self.slow.lock().unwrap() = Some((prefix.to_string(), delay));
    }

    /// How many slowed lists have answered.
    pub fn slow_lists_done(&self) -> u64 {
        self.slowed.load(Ordering::SeqCst)
    }

    fn delay_of(&self, prefix: &str) -> Option<Duration> {
        let slow = self.slow.lock().unwrap();
        slow.as_ref()
            .filter(|(slow_prefix, _)| prefix.starts_with(slow_prefix.as_str()))
            .map(|(_, delay)| *delay)
    }
}

#[async_trait]
impl Store for SlowListStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.inner.get(key).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        p: Precondition,
    ) -> Result<Revision, StoreError> {
        self.inner.put(key, value, p).await
    }
    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        p: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.inner.put_with_lease(key, value, p, lease).await
    }
    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        p: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner.put_guarded(key, value, p, guard).await
    }
    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.inner.delete_guarded(key, revision, guard).await
    }
    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        self.inner.write_all(writes, guard).await
    }
    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.inner.delete(key, revision).await
    }
    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError> {
        if let Some(delay) = self.delay_of(prefix) {
            tokio::time::sleep(delay).await;
            self.slowed.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.list(prefix).await
    }
    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError> {
        self.inner.watch(prefix, from).await
    }
    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError> {
        self.inner.grant_lease(ttl_ms).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.revoke_lease(lease).await
    }
}
