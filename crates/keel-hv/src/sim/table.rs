//! The sim's domains, and which of them time can still change.
//!
//! Moving every domain forward on every call made each call cost as much
//! as the node has domains: a node with 10,000 running guests did 10,000
//! checks per lookup. Most domains sit still (running, nothing pending)
//! until a call changes them, so the table remembers the ones that may
//! move by themselves: those touched mutably since the last advance, and
//! those with something pending on the clock. Advancing looks only at them,
//! with the same outcome as looking at all.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;

/// A domain that may change with time alone.
pub(super) trait Timed {
    /// Whether advancing the clock may change it without any call.
    fn may_move(&self) -> bool;
}

#[derive(Debug)]
pub(super) struct DomainTable<D> {
    domains: BTreeMap<String, D>,
    /// A superset of the domains whose `may_move` is true.
    moving: BTreeSet<String>,
}

impl<D> Default for DomainTable<D> {
    fn default() -> Self {
        Self {
            domains: BTreeMap::new(),
            moving: BTreeSet::new(),
        }
    }
}

/// Reads go straight to the map; every way to change a domain goes through
/// the table, so none escapes `moving`.
impl<D> Deref for DomainTable<D> {
    type Target = BTreeMap<String, D>;
    fn deref(&self) -> &Self::Target {
        &self.domains
    }
}

impl<D: Timed> DomainTable<D> {
    pub fn get_mut(&mut self, instance: &str) -> Option<&mut D> {
        let d = self.domains.get_mut(instance)?;
        if !self.moving.contains(instance) {
            self.moving.insert(instance.to_string());
        }
        Some(d)
    }

    pub fn insert(&mut self, instance: String, domain: D) -> Option<D> {
        self.moving.insert(instance.clone());
        self.domains.insert(instance, domain)
    }

    pub fn remove(&mut self, instance: &str) -> Option<D> {
        self.moving.remove(instance);
        self.domains.remove(instance)
    }

    pub fn clear(&mut self) {
        self.moving.clear();
        self.domains.clear();
    }

    /// Changes every domain so that none can move by itself any more (the
    /// host lost power, the fence lapsed: every process is gone). Marking
    /// them all would cost a copy of every name per call while the lapse
    /// lasts.
    pub fn settle_all(&mut self, mut change: impl FnMut(&mut D)) {
        for d in self.domains.values_mut() {
            change(d);
            debug_assert!(!d.may_move(), "settle_all left a domain that moves");
        }
    }

    /// Calls `step` on every domain that may move, and forgets those that
    /// can no longer move by themselves.
    pub fn advance(&mut self, mut step: impl FnMut(&mut D)) {
        let domains = &mut self.domains;
        self.moving
            .retain(|instance| match domains.get_mut(instance) {
                Some(d) => {
                    step(d);
                    d.may_move()
                }
                None => false,
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Countdown(u32);
    impl Timed for Countdown {
        fn may_move(&self) -> bool {
            self.0 > 0
        }
    }

    fn tick(table: &mut DomainTable<Countdown>) -> usize {
        let mut stepped = 0;
        table.advance(|d| {
            stepped += 1;
            d.0 = d.0.saturating_sub(1);
        });
        stepped
    }

    /// A domain that has settled is not looked at again until something
    /// touches it; a touched one is looked at once more even if it cannot
    /// move, so no change made through the table is missed.
    #[test]
    fn only_domains_that_may_move_are_stepped() {
        let mut t = DomainTable::default();
        t.insert("a".into(), Countdown(2));
        t.insert("b".into(), Countdown(0));
        assert_eq!(tick(&mut t), 2, "both were just inserted");
        assert_eq!(tick(&mut t), 1, "b settled; a has one to go");
        assert_eq!(tick(&mut t), 0, "both settled");
        t.get_mut("b").unwrap().0 = 1;
        assert_eq!(tick(&mut t), 1, "b was touched");
        assert_eq!(t["b"].0, 0);
        assert_eq!(tick(&mut t), 0);
        t.settle_all(|d| d.0 = 0);
        assert_eq!(tick(&mut t), 0, "settled by settle_all");
        t.remove("a");
        t.get_mut("b");
        assert_eq!(tick(&mut t), 1);
        assert_eq!(t.len(), 1);
    }
}
