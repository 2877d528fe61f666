//! A store wrapper for tests: calls fail with `Unavailable` at a seeded
//! rate (a flaky network), or all of them while `partitioned` (one agent
//! cut off from the store).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use keel_store::{Entry, Guard, LeaseId, Precondition, Revision, Store, StoreError, Watch, Write};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub struct FaultyStore {
    inner: Arc<dyn Store>,
    rng: Mutex<ChaCha8Rng>,
    pub fail_rate: Mutex<f64>,
    pub partitioned: Arc<AtomicBool>,
    /// How many VM records were read through this store.
    pub vm_reads: Arc<AtomicU64>,
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn Store>, seed: u64) -> Self {
        Self {
            inner,
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed ^ 0x5eed)),
            fail_rate: Mutex::new(0.0),
            partitioned: Arc::new(AtomicBool::new(false)),
            vm_reads: Default::default(),
        }
    }

    /// Cut off while `partitioned` is set, never failing otherwise.
    pub fn partitionable(inner: Arc<dyn Store>, partitioned: Arc<AtomicBool>) -> Self {
        Self {
            partitioned,
            ..Self::new(inner, 0)
        }
    }

    fn fault(&self, key: &str) -> Result<(), StoreError> {
        let unavailable = |reason: &str| StoreError::Unavailable {
            key: key.to_string(),
            reason: reason.into(),
        };
        if self.partitioned.load(Ordering::SeqCst) {
            return Err(unavailable("network partition"));
        }
        let p = *self.fail_rate.lock().unwrap();
        if p > 0.0 && self.rng.lock().unwrap().gen_bool(p) {
            return Err(unavailable("injected fault"));
        }
        Ok(())
    }
}

#[async_trait]
impl Store for FaultyStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.fault(key)?;
        if key.starts_with("/vms/") {
            self.vm_reads.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get(key).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        p: Precondition,
    ) -> Result<Revision, StoreError> {
        self.fault(key)?;
        self.inner.put(key, value, p).await
    }
    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        p: Precondition,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.fault(key)?;
        self.inner.put_with_lease(key, value, p, lease).await
    }
    async fn put_guarded(
        &self,
        key: &str,
        value: Vec<u8>,
        p: Precondition,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.fault(key)?;
        self.inner.put_guarded(key, value, p, guard).await
    }
    async fn delete_guarded(
        &self,
        key: &str,
        revision: Revision,
        guard: &Guard,
    ) -> Result<Revision, StoreError> {
        self.fault(key)?;
        self.inner.delete_guarded(key, revision, guard).await
    }
    async fn write_all(
        &self,
        writes: Vec<Write>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StoreError> {
        // One call, one chance to fail, as for any other write.
        self.fault(writes.first().map_or("", |w| w.key()))?;
        self.inner.write_all(writes, guard).await
    }
    async fn delete(&self, key: &str, revision: Revision) -> Result<Revision, StoreError> {
        self.fault(key)?;
        self.inner.delete(key, revision).await
    }
    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), StoreError> {
        self.fault(prefix)?;
        self.inner.list(prefix).await
    }
    async fn watch(&self, prefix: &str, from: Revision) -> Result<Watch, StoreError> {
        self.fault(prefix)?;
        self.inner.watch(prefix, from).await
    }
    async fn grant_lease(&self, ttl_ms: u64) -> Result<LeaseId, StoreError> {
        self.fault("lease")?;
        self.inner.grant_lease(ttl_ms).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.fault("lease")?;
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.fault("lease")?;
        self.inner.revoke_lease(lease).await
    }
}
