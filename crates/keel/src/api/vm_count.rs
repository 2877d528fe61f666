//! How many VMs there are, for `--max-vms`, without counting the store at
//! every create, and exact under creates racing each other in this server.
//!
//! Counting the store's VM keys at each create cost a read of the whole
//! VM table on SQLite (its pages carry the records): with 10,000 VMs that
//! count was most of a create. Following every VM change with a watch
//! instead cost more on etcd: each control plane received and decoded
//! every VM's every write only to learn its name. So the store is counted
//! now and then, by one task: within a second of a create of this
//! server's, else every ten seconds (deletes and other control planes'
//! creates show then). Each create first takes a place, and the count a
//! create is admitted against is the last count plus the places held,
//! taken under one lock, so creates racing each other cannot pass the cap
//! together. A place is given back if its create fails; once its VM is
//! stored it is held until a count begun after the write has been taken,
//! which includes it.
//!
//! Until the first count, a create counts the store itself. With several
//! control planes, each keeps its own places: a create on another control
//! plane counts here from the next count, so creates racing on different
//! control planes within that lag can pass the cap by as many as race. A
//! count cannot tell which creates under way it already includes, so near
//! the cap it may count one twice: a create at the cap as counted lists
//! the stored names instead and counts each name once, stored or held (a
//! VM deleted a moment ago makes room at once). A create of a stored name
//! takes no place and fails as a name taken, as it would under the cap.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use keel_ctrl::keys::{name_of, VMS_PREFIX};
use keel_store::{Store, StoreError};
use tokio::sync::{watch, Notify};

use super::limits::check_cap;
use super::ApiError;

/// How soon after a create of this server's the store is counted again.
const RECOUNT_AFTER_CREATE: Duration = Duration::from_secs(1);
/// How often the store is counted otherwise.
const RECOUNT_IDLE: Duration = Duration::from_secs(10);
/// The pause before counting again after a failed count.
const RETRY: Duration = Duration::from_secs(1);

/// The VM count one server admits creates against; cloning shares it.
#[derive(Clone, Default)]
pub struct VmCount {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<Counted>,
    /// Woken by a create that stored its VM: count again soon.
    stored_one: Notify,
}

#[derive(Default)]
struct Counted {
    /// The VMs stored as last counted (`None` before the first count).
    stored: Option<u64>,
    /// The counts begun so far: a count includes every create that was
    /// stored before it began.
    counts_begun: u64,
    /// The newest count taken in: an older one ending after it (counts
    /// overlap when a create at the cap counts afresh) is stale.
    count_taken: u64,
    /// Places held, by VM name: a name counts once whichever of its
    /// creates makes it.
    places: HashMap<String, Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// Creates of this name in progress.
    creating: usize,
    /// The VM was stored while `counts_begun` was this: only a count
    /// begun later is sure to include it.
    stored_at: Option<u64>,
}

impl Held {
    fn unused(&self) -> bool {
        self.creating == 0 && self.stored_at.is_none()
    }
}

impl Counted {
    fn end_create(&mut self, name: &str, stored: bool) {
        let counts_begun = self.counts_begun;
        let Some(held) = self.places.get_mut(name) else {
            return;
        };
        held.creating = held.creating.saturating_sub(1);
        if stored {
            held.stored_at = Some(counts_begun);
        }
        if held.unused() {
            self.places.remove(name);
        }
    }

    /// A count begins: its number.
    fn begin_count(&mut self) -> u64 {
        self.counts_begun += 1;
        self.counts_begun
    }

    /// A count begun as count `begun` found `n` VMs stored.
    fn counted(&mut self, begun: u64, n: u64) {
        if begun <= self.count_taken {
            return;
        }
        self.count_taken = begun;
        self.stored = Some(n);
        self.places.retain(|_, held| {
            if held.stored_at.is_some_and(|at| at < begun) {
                held.stored_at = None;
            }
            !held.unused()
        });
    }
}

/// A create's place under the cap. Dropped before [`Place::created`] (the
/// create failed, or its request went away), it is given back.
#[must_use = "a place is given back when dropped; call `created` once the VM is stored"]
pub struct Place {
    inner: Arc<Inner>,
    /// `None`: the VM is already stored, so this create takes no place
    /// (it will find the name taken).
    name: Option<String>,
}

impl Place {
    /// The VM is stored: the place stays held until a count includes it.
    pub fn created(mut self) {
        if let Some(name) = self.name.take() {
            self.inner.lock().end_create(&name, true);
            self.inner.stored_one.notify_one();
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            self.inner.lock().end_create(&name, false);
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Counted> {
        self.state.lock().expect("VM count lock")
    }
}

impl VmCount {
    /// A count kept by counting `store` until `stop` turns true.
    pub fn kept(store: Arc<dyn Store>, stop: watch::Receiver<bool>) -> Self {
        let count = Self::default();
        tokio::spawn(count.clone().keep(store, stop));
        count
    }

    /// Takes a place for a create of VM `name`, or refuses it with the
    /// `--max-vms` 409 when the stored VMs and the places held reach `cap`.
    pub async fn take_place(
        &self,
        store: &dyn Store,
        name: &str,
        cap: usize,
    ) -> Result<Place, ApiError> {
        if self.inner.lock().stored.is_none() {
            self.count_now(store).await?;
        }
        match self.try_take(name, cap) {
            Ok(place) => Ok(place),
            // At the cap as last counted. That count is a little old, and
            // a create stored while it was under way may be counted twice
            // (in it and by its place): the names stored now settle it.
            Err(_) => self.take_by_names(store, name, cap).await,
        }
    }

    /// [`Self::take_place`] at the cap: the names stored now and the
    /// places held, each name once (a VM deleted a moment ago makes room,
    /// a create stored meanwhile counts once). A name already stored
    /// takes no place: its create fails as a name taken, as it would
    /// under the cap.
    async fn take_by_names(
        &self,
        store: &dyn Store,
        name: &str,
        cap: usize,
    ) -> Result<Place, ApiError> {
        let begun = self.inner.lock().begin_count();
        let (entries, _) = store.list(VMS_PREFIX).await?;
        let stored: HashSet<&str> = entries
            .iter()
            .filter_map(|e| name_of(VMS_PREFIX, &e.key))
            .collect();
        let mut counted = self.inner.lock();
        counted.counted(begun, stored.len() as u64);
        if stored.contains(name) {
            return Ok(Place {
                inner: self.inner.clone(),
                name: None,
            });
        }
        self.take_within(&mut counted, name, cap, |counted| {
            let held_elsewhere = counted
                .places
                .keys()
                .filter(|held| !stored.contains(held.as_str()))
                .count();
            stored.len() + held_elsewhere
        })
    }

    /// A place for `name` under `cap` as counted, or the cap's refusal.
    fn try_take(&self, name: &str, cap: usize) -> Result<Place, ApiError> {
        // A create admitted meanwhile holds its place until a count
        // includes it, so counting it twice errs on the safe side.
        self.take_within(&mut self.inner.lock(), name, cap, |counted| {
            counted.stored.unwrap_or_default() as usize + counted.places.len()
        })
    }

    /// A place for `name` if the VMs `taken` counts (stored or held)
    /// leave room under `cap`, or the cap's refusal. A name whose create
    /// is already in progress counts once, so a second create of it is
    /// not refused for the cap (one of the two will find the name taken).
    fn take_within(
        &self,
        counted: &mut Counted,
        name: &str,
        cap: usize,
        taken: impl FnOnce(&Counted) -> usize,
    ) -> Result<Place, ApiError> {
        if !counted.places.contains_key(name) {
            check_cap(taken(counted) as u64, cap, "VMs", "--max-vms")?;
        }
        counted.places.entry(name.to_string()).or_default().creating += 1;
        Ok(Place {
            inner: self.inner.clone(),
            name: Some(name.to_string()),
        })
    }

    /// Counts the store now and takes the count in.
    async fn count_now(&self, store: &dyn Store) -> Result<(), StoreError> {
        let begun = self.inner.lock().begin_count();
        let n = store.count(VMS_PREFIX).await?;
        self.inner.lock().counted(begun, n);
        Ok(())
    }

    /// The VMs counted now (stored and creates in progress), once counted.
    pub fn current(&self) -> Option<u64> {
        let counted = self.inner.lock();
        Some(counted.stored? + counted.places.len() as u64)
    }

    /// Counts the store now, then again within [`RECOUNT_AFTER_CREATE`] of
    /// a create that stored its VM and at least every [`RECOUNT_IDLE`],
    /// until `stop` turns true.
    async fn keep(self, store: Arc<dyn Store>, mut stop: watch::Receiver<bool>) {
        while !*stop.borrow() {
            let begun = self.inner.lock().begin_count();
            let pause = match store.count(VMS_PREFIX).await {
                Ok(n) => {
                    self.inner.lock().counted(begun, n);
                    None
                }
                Err(err) => {
                    tracing::debug!(%err, "VM count: counting again shortly");
                    Some(RETRY)
                }
            };
            let wait = async {
                match pause {
                    Some(pause) => tokio::time::sleep(pause).await,
                    None => {
                        tokio::select! {
                            _ = self.inner.stored_one.notified() => {
                                tokio::time::sleep(RECOUNT_AFTER_CREATE).await
                            }
                            _ = tokio::time::sleep(RECOUNT_IDLE) => {}
                        }
                    }
                }
            };
            tokio::select! {
                _ = wait => {}
                _ = stop.changed() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use keel_ctrl::keys::vm_key;
    use keel_store::memory::MemoryStore;
    use keel_store::Precondition;

    async fn create(store: &dyn Store, name: &str) -> Result<u64, StoreError> {
        store
            .put(&vm_key(name), b"{}".to_vec(), Precondition::Absent)
            .await
    }

    /// Waits until the kept count reads `want`, on the test's paused
    /// clock: the counts are a clock's seconds apart, taken at once here.
    async fn counted(count: &VmCount, want: u64) {
        for _ in 0..100 {
            if count.current() == Some(want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!("counted {:?}, want {want}", count.current());
    }

    /// Twenty creates at once under a cap of five: five are admitted,
    /// the rest refused with the `--max-vms` 409, and five VMs are stored.
    #[tokio::test(start_paused = true)]
    async fn racing_creates_never_pass_the_cap() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let (_stop, stop_rx) = watch::channel(false);
        let count = VmCount::kept(store.clone(), stop_rx);
        counted(&count, 0).await;
        let creates = (0..20).map(|i| {
            let (store, count) = (store.clone(), count.clone());
            tokio::spawn(async move {
                let name = format!("vm-{i}");
                let place = count.take_place(store.as_ref(), &name, 5).await?;
                create(store.as_ref(), &name)
                    .await
                    .map_err(ApiError::from)?;
                place.created();
                Ok::<_, ApiError>(())
            })
        });
        let mut admitted = 0;
        for done in futures_util::future::join_all(creates).await {
            match done.expect("create task") {
                Ok(()) => admitted += 1,
                Err(err) => {
                    assert_eq!(err.status(), StatusCode::CONFLICT);
                    assert_eq!(err.field(), Some("max-vms"), "{err}");
                }
            }
        }
        assert_eq!(admitted, 5);
        assert_eq!(store.count(VMS_PREFIX).await.unwrap(), 5);
        counted(&count, 5).await;
    }

    /// The count starts from what is stored, follows creates and deletes,
    /// and a failed create gives its place back.
    #[tokio::test(start_paused = true)]
    async fn the_count_follows_the_store() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        create(store.as_ref(), "a").await.unwrap();
        let b = create(store.as_ref(), "b").await.unwrap();
        let (_stop, stop_rx) = watch::channel(false);
        let count = VmCount::kept(store.clone(), stop_rx);
        counted(&count, 2).await;

        let place = count.take_place(store.as_ref(), "c", 3).await.unwrap();
        assert_eq!(count.current(), Some(3), "a create in progress counts");
        let err = count
            .take_place(store.as_ref(), "d", 3)
            .await
            .err()
            .expect("the cap is reached");
        assert_eq!(err.field(), Some("max-vms"));
        drop(place);
        assert_eq!(count.current(), Some(2), "a failed create gives back");

        store.delete(&vm_key("b"), b).await.unwrap();
        counted(&count, 1).await;
        let place = count.take_place(store.as_ref(), "c", 2).await.unwrap();
        create(store.as_ref(), "c").await.unwrap();
        place.created();
        counted(&count, 2).await;
        // A create of a name already stored (or being created) takes no
        // further place (it will find the name taken), even at the cap.
        let again = count.take_place(store.as_ref(), "c", 2).await.unwrap();
        assert_eq!(count.current(), Some(2));
        drop(again);
        assert_eq!(count.current(), Some(2));
    }

    /// A stored VM's place is held until a count begun after its write:
    /// a count already under way when the write ended may have missed it.
    #[test]
    fn a_stored_place_waits_for_a_count_begun_after_it() {
        // Count 1 is under way.
        let mut counted = Counted {
            counts_begun: 1,
            ..Counted::default()
        };
        counted.places.entry("a".into()).or_default().creating += 1;
        counted.end_create("a", true);
        counted.counted(1, 0);
        assert_eq!(counted.places.len(), 1, "count 1 may have missed a");
        counted.counts_begun = 2;
        counted.counted(2, 1);
        assert!(
            counted.places.is_empty(),
            "count 2 began after a was stored"
        );
        assert_eq!(counted.stored, Some(1));
    }

    /// At the cap, a VM deleted since the last count makes room at once,
    /// not at the next count.
    #[tokio::test]
    async fn a_deletion_at_the_cap_makes_room_at_once() {
        let store = MemoryStore::new();
        let count = VmCount::default();
        let mut revisions = Vec::new();
        for name in ["a", "b"] {
            let place = count.take_place(&store, name, 2).await.unwrap();
            revisions.push(create(&store, name).await.unwrap());
            place.created();
        }
        store.delete(&vm_key("a"), revisions[0]).await.unwrap();
        let place = count.take_place(&store, "c", 2).await.expect("a made room");
        drop(place);
    }

    /// A create whose VM is stored but whose request has not yet let go
    /// of its place counts once, not as a stored VM and a place (the
    /// last creates of a burst up to the cap were refused so).
    #[tokio::test]
    async fn a_create_stored_but_not_yet_done_counts_once_at_the_cap() {
        let store = MemoryStore::new();
        let count = VmCount::default();
        let a = count.take_place(&store, "a", 2).await.unwrap();
        create(&store, "a").await.unwrap();
        // A count that sees a stored while its request still holds a place.
        count.count_now(&store).await.unwrap();
        let b = count
            .take_place(&store, "b", 2)
            .await
            .expect("one VM is stored, and a's create is that one");
        a.created();
        let err = count
            .take_place(&store, "c", 2)
            .await
            .err()
            .expect("a stored and b under way");
        assert_eq!(err.field(), Some("max-vms"));
        drop(b);
    }

    /// Before any count, a create counts the store.
    #[tokio::test]
    async fn unlisted_counts_the_store() {
        let store = MemoryStore::new();
        create(&store, "a").await.unwrap();
        let count = VmCount::default();
        let err = count
            .take_place(&store, "b", 1)
            .await
            .err()
            .expect("one VM is stored");
        assert_eq!(err.status(), StatusCode::CONFLICT);
        let place = count.take_place(&store, "b", 2).await.unwrap();
        let err = count
            .take_place(&store, "c", 2)
            .await
            .err()
            .expect("b holds the second place");
        assert_eq!(err.field(), Some("max-vms"));
        drop(place);
    }
}
