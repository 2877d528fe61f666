//! A store wrapper for tests, on tokio's clock: a list of keys under a
//! chosen prefix takes as long as asked (an etcd answering a large range
//! slowly, a SQLite waiting on a busy disk); a read or write of a key under
//! another chosen prefix takes as long as asked too (a slow link to the
//! store), and the next write of one can be made to hang. Every other call goes
//! straight through.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keel_store::{Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch, Write};

#[derive(Clone)]
pub struct SlowStore {
    inner: Arc<dyn Store>,
    /// Lists of a prefix starting with the first take the second this long.
    slow: Arc<Mutex<Option<(String, Duration)>>>,
    /// How many lists were slowed and have answered.
    slowed: Arc<AtomicU64>,
    /// Reads and writes of keys starting with the first take the second.
    slow_keys: Arc<Mutex<Option<(String, Duration)>>>,
    /// The next write of a slowed key hangs (for a minute).
    hang_next: Arc<AtomicBool>,
}

impl SlowStore {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            slow: Default::default(),
            slowed: Default::default(),
            slow_keys: Default::default(),
            hang_next: Default::default(),
        }
    }

    /// From now on, each read or write of a key under `prefix` takes
    /// `delay`.
    pub fn slow_keys(&self, prefix: &str, delay: Duration) {
        *self.slow_keys.lock().unwrap() = Some((prefix.to_string(), delay));
    }

    /// The next write of a slowed key hangs.
    pub fn hang_next_write(&self) {
        self.hang_next.store(true, Ordering::SeqCst);
    }

    /// Whether the hang asked for has been met (a call hung on it).
    pub fn hang_met(&self) -> bool {
        !self.hang_next.load(Ordering::SeqCst)
    }

    /// How long a read or write of `key` takes, if it is slowed.
    fn slowed(&self, key: &str) -> Option<Duration> {
        let slow = self.slow_keys.lock().unwrap();
        slow.as_ref()
            .filter(|(prefix, _)| key.starts_with(prefix.as_str()))
            .map(|(_, delay)| *delay)
    }

    /// The wait of a read (`write` false) or write of `key`.
    async fn key_call(&self, key: &str, write: bool) {
        let Some(delay) = self.slowed(key) else {
            return;
        };
        if write && self.hang_next.swap(false, Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        tokio::time::sleep(delay).await;
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
impl Store for SlowStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.key_call(key, false).await;
        self.inner.get(key).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        p: Precondition,
    ) -> Result<Revision, StoreError> {
        self.key_call(key, true).await;
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
        self.key_call(key, true).await;
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
        // Slowed once if any key it writes is.
        if let Some(write) = writes.iter().find(|w| self.slowed(w.key()).is_some()) {
            self.key_call(write.key(), true).await;
        }
        self.inner.write_all(writes, guard).await
    }
    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.key_call(key, true).await;
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
