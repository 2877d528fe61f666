//! Why a key's reconcile runs, after kube-runtime's `ReconcileReason`: its
//! record changed or was (re)listed, a domain event of its instance, the
//! time its last look asked for, or the retry after a failed look. Named
//! in the `reconcile` span, so a log line says what woke the look.

use std::borrow::Cow;
use std::fmt;

use keel_api::Millis;

use super::event::Event;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// A watched record was written or deleted.
    Changed { key: String },
    /// A record found by the list at start or after a broken watch.
    Listed { key: String },
    /// The hypervisor saw this happen to an instance.
    Domain { instance: String, kind: String },
    /// The last look asked to look again after `after_ms`, for `why`.
    Requeue {
        after_ms: Millis,
        why: Cow<'static, str>,
    },
    /// The `attempts`-th look in a row failed; retried after `after_ms`.
    ErrorBackoff { after_ms: Millis, attempts: u32 },
    /// Asked for from outside the runtime (`Runtime::schedule`).
    Asked,
}

impl Reason {
    pub fn of(event: &Event) -> Reason {
        match event {
            Event::Changed { key } => Reason::Changed { key: key.clone() },
            Event::Listed { key } => Reason::Listed { key: key.clone() },
            Event::Domain(event) => Reason::Domain {
                instance: event.instance.clone(),
                kind: format!("{:?}", event.kind),
            },
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Changed { key } => write!(f, "object changed: {key}"),
            Reason::Listed { key } => write!(f, "listed: {key}"),
            Reason::Domain { instance, kind } => write!(f, "domain event {kind} of {instance}"),
            Reason::Requeue { after_ms, why } => write!(f, "requeue after {after_ms} ms: {why}"),
            Reason::ErrorBackoff { after_ms, attempts } => write!(
                f,
                "error backoff after {after_ms} ms ({attempts} failed in a row)"
            ),
            Reason::Asked => f.write_str("asked for"),
        }
    }
}

/// The reasons of the triggers that coalesced into one look: the one that
/// made it due soonest (the first of those at one time), and how many
/// more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    pub first: Reason,
    pub more: u32,
}

impl Why {
    pub fn new(reason: Reason) -> Self {
        Self {
            first: reason,
            more: 0,
        }
    }

    /// Takes in `other`; `it_decides`: it made the key due sooner than
    /// what was held, so it becomes the reason named first.
    pub fn merge(&mut self, other: Why, it_decides: bool) {
        let counted = if it_decides {
            std::mem::replace(self, other)
        } else {
            other
        };
        self.more += counted.more + 1;
    }
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.more {
            0 => write!(f, "{}", self.first),
            more => write!(f, "{} (and {more} more)", self.first),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trigger_that_made_the_key_due_is_named_and_the_rest_counted() {
        let changed = || {
            Why::new(Reason::Changed {
                key: "/vms/a".into(),
            })
        };
        let mut why = Why::new(Reason::Requeue {
            after_ms: 2_000,
            why: "its next look".into(),
        });
        why.merge(changed(), true);
        assert_eq!(why.to_string(), "object changed: /vms/a (and 1 more)");
        why.merge(Why::new(Reason::Asked), false);
        why.merge(changed(), false);
        assert_eq!(why.to_string(), "object changed: /vms/a (and 3 more)");
    }
}
