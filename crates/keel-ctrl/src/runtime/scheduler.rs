//! Which key to reconcile next, and when. One entry per key: asking for an
//! earlier time wins, so a change notification is never delayed by a
//! scheduled re-check, and a key is never queued twice (kube-rs' scheduler
//! does the same).

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

use keel_api::Millis;

/// Keys by due time. Both directions are indexed, so scheduling, popping
/// the earliest and asking for the next due time stay logarithmic in the
/// number of keys (a node may hold thousands of VMs).
#[derive(Debug, Clone)]
pub struct Scheduler<K: Ord + Clone> {
    due: BTreeMap<K, Millis>,
    by_time: BTreeSet<(Millis, K)>,
}

impl<K: Ord + Clone> Default for Scheduler<K> {
    fn default() -> Self {
        Self {
            due: BTreeMap::new(),
            by_time: BTreeSet::new(),
        }
    }
}

impl<K: Ord + Clone> Scheduler<K> {
    /// Queues `key` at `at`, or moves it earlier if it is queued later.
    pub fn schedule<Q>(&mut self, key: &Q, at: Millis)
    where
        K: Borrow<Q>,
        Q: Ord + ToOwned<Owned = K> + ?Sized,
    {
        match self.due.get_mut(key) {
            Some(t) if *t <= at => {}
            Some(t) => {
                let old = *t;
                *t = at;
                let owned = key.to_owned();
                self.by_time.remove(&(old, owned.clone()));
                self.by_time.insert((at, owned));
            }
            None => {
                let owned = key.to_owned();
                self.due.insert(owned.clone(), at);
                self.by_time.insert((at, owned));
            }
        }
    }

    pub fn forget<Q>(&mut self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        if let Some((owned, at)) = self.due.remove_entry(key) {
            self.by_time.remove(&(at, owned));
        }
    }

    /// When `key` is due, if it is queued.
    pub fn due_at<Q>(&self, key: &Q) -> Option<Millis>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.due.get(key).copied()
    }

    /// The earliest due time, if anything is queued.
    pub fn next_due(&self) -> Option<Millis> {
        self.by_time.first().map(|(at, _)| *at)
    }

    /// Removes and returns the earliest key due at or before `now` (ties
    /// in key order, so a replay pops in the same order).
    pub fn pop_next_due(&mut self, now: Millis) -> Option<K> {
        let (at, _) = self.by_time.first()?;
        if *at > now {
            return None;
        }
        let (_, key) = self.by_time.pop_first()?;
        self.due.remove(&key);
        Some(key)
    }

    /// Removes and returns every key due at or before `now`, earliest first.
    pub fn pop_due(&mut self, now: Millis) -> Vec<K> {
        std::iter::from_fn(|| self.pop_next_due(now)).collect()
    }

    pub fn len(&self) -> usize {
        self.due.len()
    }

    pub fn is_empty(&self) -> bool {
        self.due.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_wins_and_keys_are_never_queued_twice() {
        let mut q: Scheduler<String> = Scheduler::default();
        q.schedule("a", 50);
        q.schedule("a", 10);
        q.schedule("a", 30);
        q.schedule("b", 20);
        assert_eq!(q.len(), 2);
        assert_eq!(q.due_at("a"), Some(10));
        assert_eq!(q.next_due(), Some(10));
        assert_eq!(q.pop_due(15), vec!["a".to_string()]);
        assert_eq!(q.pop_due(15), Vec::<String>::new());
        assert_eq!(q.pop_next_due(20), Some("b".to_string()));
        assert!(q.is_empty());
        assert_eq!(q.next_due(), None);
    }

    #[test]
    fn ties_pop_in_key_order_and_forget_removes_both_indexes() {
        let mut q: Scheduler<String> = Scheduler::default();
        for k in ["c", "a", "b"] {
            q.schedule(k, 5);
        }
        q.forget("b");
        assert_eq!(q.pop_due(5), vec!["a".to_string(), "c".to_string()]);
        assert!(q.is_empty());
    }
}
