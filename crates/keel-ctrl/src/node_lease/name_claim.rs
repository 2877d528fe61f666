//! Two agents must never act under one node name: each would run the
//! node's guests. An agent that finds another incarnation on its node's
//! record (`status.incarnation`) waits: while that one's heartbeat moves,
//! the name is in use and this agent refuses to run; after one full node
//! lease of silence (its guests are fenced by then, and the cluster has
//! taken its VMs over) the name is taken over. The silence is counted on
//! this agent's [`Mono`], as every lease is: a wall clock that steps while
//! it waits must not shorten the wait.

use keel_api::{Millis, Mono, Node};

/// A node name another incarnation held at this agent's first look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldName {
    /// The other incarnation.
    pub theirs: String,
    /// Its heartbeat at the first look: opaque, only compared.
    heartbeat: Millis,
    /// This agent's clock at the first look.
    since: Mono,
}

/// What to do after a look at the node record while waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimStep {
    /// The record is gone: nobody holds the name.
    Free,
    /// The other agent is alive (its heartbeat moved), or a third one
    /// claimed the name meanwhile: refuse to run.
    InUse { by: Option<String> },
    /// Silent, but not yet for a full lease.
    Wait,
    /// Silent for a full lease: take the name over.
    TakeOver,
}

impl HeldName {
    /// The first look at the node's record: `None` if the name is free or
    /// already this incarnation's.
    pub fn first_look(record: Option<&Node>, ours: &str, now: Mono) -> Option<Self> {
        let node = record?;
        match &node.status.incarnation {
            Some(theirs) if theirs != ours => Some(Self {
                theirs: theirs.clone(),
                heartbeat: node.status.last_heartbeat,
                since: now,
            }),
            _ => None,
        }
    }

    /// A later look, at `now`, with the node lease `lease_ms`.
    pub fn look(&self, record: Option<&Node>, now: Mono, lease_ms: Millis) -> ClaimStep {
        let Some(node) = record else {
            return ClaimStep::Free;
        };
        if node.status.last_heartbeat != self.heartbeat
            || node.status.incarnation.as_deref() != Some(self.theirs.as_str())
        {
            return ClaimStep::InUse {
                by: node.status.incarnation.clone(),
            };
        }
        if now.since(self.since) >= lease_ms {
            ClaimStep::TakeOver
        } else {
            ClaimStep::Wait
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(incarnation: &str, heartbeat: Millis) -> Node {
        let mut n = Node::new("n1");
        n.status.incarnation = Some(incarnation.into());
        n.status.last_heartbeat = heartbeat;
        n
    }

    fn at(ms: Millis) -> Mono {
        Mono::from_origin_ms(ms)
    }

    #[test]
    fn a_name_of_ours_or_of_nobody_is_free_at_once() {
        assert_eq!(HeldName::first_look(None, "us", at(0)), None);
        assert_eq!(
            HeldName::first_look(Some(&node("us", 5)), "us", at(0)),
            None
        );
        let mut unclaimed = node("x", 5);
        unclaimed.status.incarnation = None;
        assert_eq!(HeldName::first_look(Some(&unclaimed), "us", at(0)), None);
    }

    #[test]
    fn a_silent_holder_is_replaced_only_after_a_full_lease_of_our_clock() {
        let held = HeldName::first_look(Some(&node("them", 7)), "us", at(1_000)).unwrap();
        let same = node("them", 7);
        assert_eq!(held.look(Some(&same), at(40_999), 40_000), ClaimStep::Wait);
        assert_eq!(
            held.look(Some(&same), at(41_000), 40_000),
            ClaimStep::TakeOver
        );
        assert_eq!(held.look(None, at(2_000), 40_000), ClaimStep::Free);
    }

    #[test]
    fn a_moving_heartbeat_or_a_third_claimant_means_the_name_is_in_use() {
        let held = HeldName::first_look(Some(&node("them", 7)), "us", at(0)).unwrap();
        assert_eq!(
            held.look(Some(&node("them", 8)), at(1_000), 40_000),
            ClaimStep::InUse {
                by: Some("them".into())
            }
        );
        assert_eq!(
            held.look(Some(&node("third", 7)), at(90_000), 40_000),
            ClaimStep::InUse {
                by: Some("third".into())
            }
        );
    }
}
