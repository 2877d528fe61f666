//! Records counted by phase, kept current by a watch rather than counted
//! by listing the store at every scrape: a scrape every few seconds of a
//! store with 10,000 VMs decoded all of them each time, and on SQLite held
//! the store's one thread meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keel_store::{Entry, Store, WatchEvent};
use tokio::sync::watch;

/// Which phase (an index into the caller's list of phases) a stored record
/// is in; `None` for one that cannot be decoded (a list skips those too).
pub type PhaseOf = fn(&[u8]) -> Option<usize>;

/// Counts per phase of the records under one prefix. Empty (`None`) until
/// the first list, and from a broken watch until the next.
pub struct PhaseTally {
    prefix: &'static str,
    phases: usize,
    phase_of: PhaseOf,
    state: Mutex<Option<Tally>>,
}

#[derive(Default)]
struct Tally {
    phase_by_key: HashMap<String, usize>,
    counts: Vec<i64>,
}

impl Tally {
    fn set(&mut self, key: &str, phase: Option<usize>) {
        if let Some(old) = self.phase_by_key.remove(key) {
            self.counts[old] -= 1;
        }
        if let Some(new) = phase {
            self.counts[new] += 1;
            self.phase_by_key.insert(key.to_string(), new);
        }
    }
}

impl PhaseTally {
    pub fn new(prefix: &'static str, phases: usize, phase_of: PhaseOf) -> Self {
        Self {
            prefix,
            phases,
            phase_of,
            state: Mutex::new(None),
        }
    }

    /// The count of each phase, if current.
    pub fn counts(&self) -> Option<Vec<i64>> {
        self.lock().as_ref().map(|t| t.counts.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Tally>> {
        self.state.lock().expect("phase tally lock")
    }

    /// Keeps the counts current with the store's watch until `stop` turns
    /// true.
    pub async fn keep(self: Arc<Self>, store: Arc<dyn Store>, stop: watch::Receiver<bool>) {
        crate::prefix_view::keep(&*self, &*store, self.prefix, stop).await
    }
}

impl crate::prefix_view::PrefixView for PhaseTally {
    fn reset(&self, entries: &[Entry]) {
        let mut tally = Tally {
            phase_by_key: HashMap::with_capacity(entries.len()),
            counts: vec![0; self.phases],
        };
        for e in entries {
            tally.set(&e.key, (self.phase_of)(&e.value));
        }
        *self.lock() = Some(tally);
    }

    fn apply(&self, event: &WatchEvent) {
        let phase = match event {
            WatchEvent::Put(e) => (self.phase_of)(&e.value),
            WatchEvent::Deleted { .. } => None,
        };
        if let Some(tally) = self.lock().as_mut() {
            tally.set(event.key(), phase);
        }
    }

    /// Counts that may miss changes are not reported.
    fn broke(&self) {
        *self.lock() = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_store::memory::MemoryStore;
    use keel_store::Precondition;

    fn digit(value: &[u8]) -> Option<usize> {
        std::str::from_utf8(value).ok()?.parse().ok()
    }

    async fn settled(tally: &PhaseTally, want: &[i64]) {
        for _ in 0..1_000 {
            if tally.counts().as_deref() == Some(want) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("counts {:?}, want {want:?}", tally.counts());
    }

    /// The counts follow puts, rewrites, deletes and records that do not
    /// decode, starting from what was there before the watch.
    #[tokio::test]
    async fn counts_follow_the_watch_from_the_first_list() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        store
            .put("/t/a", b"0".to_vec(), Precondition::Absent)
            .await
            .unwrap();
        let tally = Arc::new(PhaseTally::new("/t/", 3, digit));
        assert_eq!(tally.counts(), None, "nothing counted before the list");
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(tally.clone().keep(store.clone(), stop_rx));
        settled(&tally, &[1, 0, 0]).await;
        let b = store
            .put("/t/b", b"2".to_vec(), Precondition::Absent)
            .await
            .unwrap();
        settled(&tally, &[1, 0, 1]).await;
        let b = store
            .put("/t/b", b"1".to_vec(), Precondition::Revision(b))
            .await
            .unwrap();
        settled(&tally, &[1, 1, 0]).await;
        let c = store
            .put("/t/c", b"junk".to_vec(), Precondition::Absent)
            .await
            .unwrap();
        store
            .put("/t/c", b"2".to_vec(), Precondition::Revision(c))
            .await
            .unwrap();
        settled(&tally, &[1, 1, 1]).await;
        store.delete("/t/b", b).await.unwrap();
        settled(&tally, &[1, 0, 1]).await;
        stop.send(true).unwrap();
        task.await.unwrap();
        assert_eq!(tally.counts(), None, "no longer kept");
    }
}
