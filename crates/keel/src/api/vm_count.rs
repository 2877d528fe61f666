//! How many VMs there are, for `--max-vms`, without counting the store at
//! every create, and exact under creates racing each other in this server.
//!
//! Counting the store's VM keys at each create cost a read of the whole
//! VM table on SQLite (its pages carry the records): with 10,000 VMs that
//! count was most of a create. Here the names of the stored VMs are kept
//! by a watch (listed once, then followed; listed again if the watch
//! breaks), and each create first takes a place: the count a create is
//! admitted against is the stored VMs plus the places held by creates not
//! yet seen stored, taken under one lock, so creates racing each other
//! cannot pass the cap together. A place is given back if its create
//! fails, and is let go once the watch (or a new list) shows its VM.
//!
//! Until the first list has arrived, a create counts the store instead
//! (with the places held on top). With several control planes, each keeps
//! its own places: a create on another control plane counts here once the
//! watch delivers it, so creates racing on different control planes within
//! that lag can pass the cap by as many as race.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use keel_ctrl::keys::{name_of, VMS_PREFIX};
use keel_store::{Entry, Store, WatchEvent};
use tokio::sync::watch;

use super::limits::check_cap;
use super::ApiError;

/// The VM count one server admits creates against; cloning shares it.
#[derive(Clone, Default)]
pub struct VmCount {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<Counted>,
}

#[derive(Default)]
struct Counted {
    /// The names of the stored VMs, once listed (`None` before).
    stored: Option<HashSet<String>>,
    /// Places held by creates whose VM is not (yet) seen stored, by name,
    /// with how many creates of that name hold one: a VM counts once
    /// whichever of them makes it.
    places: HashMap<String, usize>,
}

impl Counted {
    fn seen_stored(&mut self, name: &str) {
        self.places.remove(name);
        if let Some(stored) = &mut self.stored {
            stored.insert(name.to_string());
        }
    }

    fn give_back(&mut self, name: &str) {
        if let Some(held) = self.places.get_mut(name) {
            *held -= 1;
            if *held == 0 {
                self.places.remove(name);
            }
        }
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
    /// The VM is stored: the place stays held until the watch shows it.
    pub fn created(mut self) {
        self.name = None;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            self.inner.lock().give_back(&name);
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Counted> {
        self.state.lock().expect("VM count lock")
    }
}

impl VmCount {
    /// A count kept by `store`'s watch until `stop` turns true.
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
        let listed = self.inner.lock().stored.is_some();
        // Before the first list, the store is counted (outside the lock).
        let counted_store = if listed {
            None
        } else {
            Some(store.count(VMS_PREFIX).await?)
        };
        let mut counted = self.inner.lock();
        let (already_stored, stored) = match (&counted.stored, counted_store) {
            (Some(stored), _) => (stored.contains(name), stored.len() as u64),
            // A create admitted meanwhile holds its place until the first
            // list shows it, so counting it twice errs on the safe side.
            (None, Some(n)) => (false, n),
            (None, None) => unreachable!("the store is counted when nothing was listed"),
        };
        if already_stored {
            return Ok(Place {
                inner: self.inner.clone(),
                name: None,
            });
        }
        // A name whose create is already in progress counts once, so a
        // second create of it is not refused for the cap (one of the two
        // will find the name taken).
        if !counted.places.contains_key(name) {
            check_cap(
                stored + counted.places.len() as u64,
                cap,
                "VMs",
                "--max-vms",
            )?;
        }
        *counted.places.entry(name.to_string()).or_default() += 1;
        Ok(Place {
            inner: self.inner.clone(),
            name: Some(name.to_string()),
        })
    }

    /// The VMs counted now (stored and creates in progress), if listed.
    pub fn current(&self) -> Option<u64> {
        let counted = self.inner.lock();
        let stored = counted.stored.as_ref()?.len();
        Some((stored + counted.places.len()) as u64)
    }

    /// Keeps the stored names current with the store's watch until
    /// `stop` turns true. Between a break and the next list the names kept
    /// stay: a deletion missed meanwhile only refuses a create early, and
    /// this server's own creates hold their places until a list or the
    /// watch shows them.
    async fn keep(self, store: Arc<dyn Store>, stop: watch::Receiver<bool>) {
        crate::prefix_view::keep(&self, &*store, VMS_PREFIX, stop).await
    }
}

impl crate::prefix_view::PrefixView for VmCount {
    fn reset(&self, entries: &[Entry]) {
        let stored: HashSet<String> = entries
            .iter()
            .filter_map(|e| name_of(VMS_PREFIX, &e.key))
            .map(str::to_string)
            .collect();
        let mut counted = self.inner.lock();
        counted.places.retain(|name, _| !stored.contains(name));
        counted.stored = Some(stored);
    }

    fn apply(&self, event: &WatchEvent) {
        let Some(name) = name_of(VMS_PREFIX, event.key()) else {
            return;
        };
        let mut counted = self.inner.lock();
        match event {
            WatchEvent::Put(_) => counted.seen_stored(name),
            WatchEvent::Deleted { .. } => {
                if let Some(stored) = &mut counted.stored {
                    stored.remove(name);
                }
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
    use keel_store::StoreError;

    async fn create(store: &dyn Store, name: &str) -> Result<u64, StoreError> {
        store
            .put(&vm_key(name), b"{}".to_vec(), Precondition::Absent)
            .await
    }

    /// Waits (yielding, no sleep) until the kept count reads `want`.
    async fn counted(count: &VmCount, want: u64) {
        for _ in 0..10_000 {
            if count.current() == Some(want) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("counted {:?}, want {want}", count.current());
    }

    /// Twenty creates at once under a cap of five: five are admitted,
    /// the rest refused with the `--max-vms` 409, and five VMs are stored.
    #[tokio::test]
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
    #[tokio::test]
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

    /// Before any list, a create counts the store.
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
