//! The sim's domains, and when time alone will next change each of them.
//!
//! Moving every domain forward on every call made each call cost as much
//! as the node has domains: a node with 10,000 guests did 10,000 checks
//! per lookup. A domain changes by itself only at known moments (its boot
//! ends, its power-off completes, a crash is due), so the table keeps an
//! agenda of those moments and steps a domain only when one has come, when
//! a call has touched it since, or when it waits on something outside the
//! clock. Stepping a domain at the first call at or after its moment is
//! what stepping it at every call did: the step acts only once the moment
//! has come.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Deref;

use keel_api::Millis;

/// When time alone may next change a domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NextChange {
    /// Not without a call.
    Never,
    At(Millis),
    /// It waits on something besides the clock: step it every time.
    Always,
}

#[derive(Debug)]
pub(super) struct DomainTable<D> {
    domains: BTreeMap<String, D>,
    /// Changed by a call since the last advance: their moment is unknown.
    touched: BTreeSet<String>,
    agenda: BTreeSet<(Millis, String)>,
    /// Each domain's place in `agenda`.
    due: HashMap<String, Millis>,
    always: BTreeSet<String>,
}

impl<D> Default for DomainTable<D> {
    fn default() -> Self {
        Self {
            domains: BTreeMap::new(),
            touched: BTreeSet::new(),
            agenda: BTreeSet::new(),
            due: HashMap::new(),
            always: BTreeSet::new(),
        }
    }
}

/// Reads go straight to the map; every way to change a domain goes through
/// the table, so none escapes it.
impl<D> Deref for DomainTable<D> {
    type Target = BTreeMap<String, D>;
    fn deref(&self) -> &Self::Target {
        &self.domains
    }
}

impl<D> DomainTable<D> {
    pub fn get_mut(&mut self, instance: &str) -> Option<&mut D> {
        let d = self.domains.get_mut(instance)?;
        if !self.touched.contains(instance) {
            self.touched.insert(instance.to_string());
        }
        Some(d)
    }

    pub fn insert(&mut self, instance: String, domain: D) -> Option<D> {
        self.touched.insert(instance.clone());
        self.domains.insert(instance, domain)
    }

    pub fn remove(&mut self, instance: &str) -> Option<D> {
        self.unschedule(instance);
        self.touched.remove(instance);
        self.domains.remove(instance)
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Changes the domains `pick` chooses so that they cannot change by
    /// themselves any more (their process is gone); the others keep their
    /// moments. Returns the names of those changed.
    pub fn settle_where(
        &mut self,
        pick: impl Fn(&D) -> bool,
        mut change: impl FnMut(&mut D),
    ) -> Vec<String> {
        let mut ended = Vec::new();
        for (name, d) in self.domains.iter_mut() {
            if pick(d) {
                change(d);
                ended.push(name.clone());
            }
        }
        for name in &ended {
            self.unschedule(name);
            self.touched.remove(name);
        }
        ended
    }

    /// Changes every domain so that none can change by itself any more
    /// (the host lost power, the fence lapsed: every process is gone).
    /// Touching them all would cost a copy of every name per call while
    /// the lapse lasts.
    pub fn settle_all(&mut self, mut change: impl FnMut(&mut D)) {
        for d in self.domains.values_mut() {
            change(d);
        }
        self.touched.clear();
        self.agenda.clear();
        self.due.clear();
        self.always.clear();
    }

    /// Steps every domain whose moment has come by `now`, every touched
    /// one, and every one that waits on more than the clock; then files
    /// each under its next moment (`next_change`).
    pub fn advance(
        &mut self,
        now: Millis,
        mut step: impl FnMut(&mut D),
        next_change: impl Fn(&D) -> NextChange,
    ) {
        let mut stepping: BTreeSet<String> = std::mem::take(&mut self.touched);
        while let Some((at, _)) = self.agenda.first() {
            if *at > now {
                break;
            }
            let (_, instance) = self.agenda.pop_first().expect("looked at first");
            self.due.remove(&instance);
            stepping.insert(instance);
        }
        stepping.extend(self.always.iter().cloned());
        for instance in stepping {
            let Some(d) = self.domains.get_mut(&instance) else {
                continue;
            };
            step(d);
            let next = next_change(d);
            self.schedule(instance, next);
        }
    }

    fn schedule(&mut self, instance: String, next: NextChange) {
        self.unschedule(&instance);
        match next {
            NextChange::Never => {}
            NextChange::At(at) => {
                self.due.insert(instance.clone(), at);
                self.agenda.insert((at, instance));
            }
            NextChange::Always => {
                self.always.insert(instance);
            }
        }
    }

    fn unschedule(&mut self, instance: &str) {
        if let Some(at) = self.due.remove(instance) {
            self.agenda.remove(&(at, instance.to_string()));
        }
        self.always.remove(instance);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A domain that flips to `done` at `at`, or waits on a flag outside
    /// the clock.
    #[derive(Debug, Default)]
    struct Timer {
        at: Option<Millis>,
        outside: bool,
        steps: u32,
        done: bool,
    }

    fn tick(table: &mut DomainTable<Timer>, now: Millis) {
        table.advance(
            now,
            |d| {
                d.steps += 1;
                if d.at.is_some_and(|at| now >= at) {
                    d.done = true;
                    d.at = None;
                }
            },
            |d| match (d.outside, d.at) {
                (true, _) => NextChange::Always,
                (false, Some(at)) => NextChange::At(at),
                (false, None) => NextChange::Never,
            },
        );
    }

    /// Each domain is stepped when it is inserted or touched, at the first
    /// advance at or after its moment, and every time while it waits on
    /// something outside the clock; never otherwise.
    #[test]
    fn domains_are_stepped_at_their_moment_when_touched_or_always() {
        let mut t = DomainTable::default();
        t.insert(
            "boot".into(),
            Timer {
                at: Some(100),
                ..Default::default()
            },
        );
        t.insert("idle".into(), Timer::default());
        t.insert(
            "waits".into(),
            Timer {
                outside: true,
                ..Default::default()
            },
        );
        tick(&mut t, 0);
        let steps = |t: &DomainTable<Timer>| -> Vec<u32> {
            ["boot", "idle", "waits"].map(|n| t[n].steps).to_vec()
        };
        assert_eq!(steps(&t), [1, 1, 1], "all were just inserted");
        tick(&mut t, 50);
        assert_eq!(steps(&t), [1, 1, 2], "nothing due; `waits` always");
        assert!(!t["boot"].done);
        tick(&mut t, 130);
        assert_eq!(steps(&t), [2, 1, 3]);
        assert!(t["boot"].done, "stepped at the first advance past 100");
        tick(&mut t, 500);
        assert_eq!(steps(&t), [2, 1, 4], "boot has no moment left");

        t.get_mut("idle").unwrap().at = Some(600);
        tick(&mut t, 510);
        assert_eq!(steps(&t), [2, 2, 5], "idle was touched");
        tick(&mut t, 600);
        assert!(t["idle"].done);

        // A touch moves a domain's moment: the old one is forgotten.
        let boot = t.get_mut("boot").unwrap();
        (boot.at, boot.done) = (Some(700), false);
        tick(&mut t, 601);
        t.get_mut("boot").unwrap().at = Some(900);
        tick(&mut t, 602);
        tick(&mut t, 800);
        assert!(!t["boot"].done, "the moment moved from 700 to 900");
        tick(&mut t, 900);
        assert!(t["boot"].done);

        t.remove("waits");
        let before = t["idle"].steps;
        t.settle_all(|d| d.at = None);
        tick(&mut t, 1_000);
        assert_eq!(t["idle"].steps, before, "settled: nothing left to step");
        assert_eq!(t.len(), 2);
    }
}
