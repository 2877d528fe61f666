//! Which resource to reconcile next, and when. One entry per name: asking
//! for an earlier time wins, so a change notification is never delayed by
//! a scheduled re-check, and a name is never queued twice.

use std::collections::BTreeMap;

use keel_api::Millis;

#[derive(Debug, Default, Clone)]
pub struct WorkQueue {
    due: BTreeMap<String, Millis>,
}

impl WorkQueue {
    pub fn schedule(&mut self, name: &str, at: Millis) {
        self.due
            .entry(name.to_string())
            .and_modify(|t| *t = (*t).min(at))
            .or_insert(at);
    }

    pub fn forget(&mut self, name: &str) {
        self.due.remove(name);
    }

    /// The earliest due time, if anything is queued.
    pub fn next_due(&self) -> Option<Millis> {
        self.due.values().min().copied()
    }

    /// Removes and returns every name due at or before `now`, earliest first.
    pub fn pop_due(&mut self, now: Millis) -> Vec<String> {
        let mut ready: Vec<(Millis, String)> = self
            .due
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(n, at)| (*at, n.clone()))
            .collect();
        ready.sort();
        for (_, name) in &ready {
            self.due.remove(name);
        }
        ready.into_iter().map(|(_, n)| n).collect()
    }

    pub fn len(&self) -> usize {
        self.due.len()
    }

    pub fn is_empty(&self) -> bool {
        self.due.is_empty()
    }
}
