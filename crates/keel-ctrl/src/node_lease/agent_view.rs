//! This agent's own view of its node lease: when its last heartbeat got
//! through, and the freeze it honours (a planned restart), both on its own
//! clock. It decides how far the local fence lease is extended after each
//! heartbeat, whether the agent may start anything, and when it must fence
//! itself. All of it is on the agent's monotonic clock ([`Mono`]): a wall
//! clock stepped back during a freeze must not stretch the fence lease past
//! what observers count, nor one stepped forward end it early.
//!
//! The rule that keeps a freeze safe: the fence lease is never extended past
//! what any observer counts. An observer counts a freeze's duration from
//! when it first saw it, which is after it was written; the agent counts it
//! from the send time of its last heartbeat *before* the one that first saw
//! it (the freeze was written after that heartbeat read the record), or,
//! for a freeze it writes itself, from before it sent the write.

use std::sync::Mutex;

use keel_api::{Millis, Mono, NodeFreeze};

use crate::config::LifecycleConfig;

#[derive(Debug, Default)]
pub struct NodeLease {
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone, Copy)]
struct State {
    /// Send time of the last heartbeat that reached the store.
    last_ok_sent_at: Option<Mono>,
    /// The freeze honoured: its key and its end on this agent's clock.
    honoured: Option<((Millis, Millis), Mono)>,
    /// A freeze this agent decided to clear: should the clearing write not
    /// get through, it is not taken up again at the next heartbeat.
    dismissed: Option<(Millis, Millis)>,
}

/// What to do after a heartbeat that reached the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePlan {
    /// Extend the local fence lease to this time (this agent's clock).
    pub renew_until: Mono,
    /// Remove this freeze from the node record, after the renewal: the
    /// agent is back from the restart it was for, or its end has passed.
    pub clear_freeze: Option<(Millis, Millis)>,
}

impl NodeLease {
    /// A heartbeat sent at `sent_at` reached the store; the node record it
    /// wrote carries `freeze`.
    pub fn heartbeat_ok(
        &self,
        sent_at: Mono,
        freeze: Option<&NodeFreeze>,
        cfg: &LifecycleConfig,
    ) -> LeasePlan {
        let mut s = self.state.lock().expect("lease lock");
        let prev = s.last_ok_sent_at.replace(sent_at);
        let normal = sent_at.plus(cfg.self_fence_ms);
        let Some(f) = freeze else {
            s.honoured = None;
            return LeasePlan {
                renew_until: normal,
                clear_freeze: None,
            };
        };
        let end = match (prev, s.honoured) {
            _ if s.dismissed == Some(f.key()) => None,
            (_, Some((key, end))) if key == f.key() => Some(end),
            // This process's first heartbeat: the agent is back, and the
            // freeze (whoever asked for it) has done its job.
            (None, _) => None,
            (Some(prev), old) => {
                let end = prev.plus(f.duration_ms);
                Some(old.map_or(end, |(_, old_end)| old_end.max(end)))
            }
        };
        match end {
            Some(end) if end > sent_at => {
                s.honoured = Some((f.key(), end));
                LeasePlan {
                    renew_until: normal.max(end),
                    clear_freeze: None,
                }
            }
            _ => {
                s.honoured = None;
                s.dismissed = Some(f.key());
                LeasePlan {
                    renew_until: normal,
                    clear_freeze: Some(f.key()),
                }
            }
        }
    }

    /// The freeze this agent is about to write itself, from before it is
    /// sent: how long it must last so that it ends no earlier than one it
    /// honours now or one already on the record (counted as
    /// [`Self::heartbeat_ok`] would).
    pub fn own_freeze_ms(
        &self,
        sent_at: Mono,
        wanted_ms: Millis,
        on_record: Option<&NodeFreeze>,
    ) -> Millis {
        let s = self.state.lock().expect("lease lock");
        let mut end = sent_at.plus(wanted_ms);
        if let Some((_, honoured)) = s.honoured {
            end = end.max(honoured);
        }
        // One on the record that this agent has not seen yet: its last good
        // heartbeat read the record before it was written.
        if let (Some(f), Some(prev)) = (on_record, s.last_ok_sent_at) {
            let seen =
                s.honoured.is_some_and(|(key, _)| key == f.key()) || s.dismissed == Some(f.key());
            if !seen {
                end = end.max(prev.plus(f.duration_ms));
            }
        }
        end.since(sent_at)
    }

    /// The freeze this agent wrote (sent at `sent_at`) reached the store.
    pub fn froze(&self, sent_at: Mono, freeze: &NodeFreeze) -> Mono {
        let mut s = self.state.lock().expect("lease lock");
        let end = sent_at.plus(freeze.duration_ms);
        s.honoured = Some((freeze.key(), end));
        end
    }

    /// Whether the node lease is in force at `now`: a heartbeat got through
    /// within `self_fence_ms`. An agent whose lease is stale starts
    /// nothing: the cluster may be about to start its VMs elsewhere. (A
    /// freeze does not count: it keeps running guests, it starts none.)
    pub fn fresh(&self, now: Mono, cfg: &LifecycleConfig) -> bool {
        let s = self.state.lock().expect("lease lock");
        s.last_ok_sent_at
            .is_some_and(|at| now < at.plus(cfg.self_fence_ms))
    }

    /// Whether the agent must end its guests itself: its last good
    /// heartbeat was at `last_ok`, `self_fence_ms` ago or more, and no
    /// freeze it honours is still running.
    pub fn self_fence_due(&self, last_ok: Mono, now: Mono, cfg: &LifecycleConfig) -> bool {
        let s = self.state.lock().expect("lease lock");
        let frozen = s.honoured.is_some_and(|(_, end)| now < end);
        !frozen && now.since(last_ok) >= cfg.self_fence_ms
    }

    /// Until when this agent has the freeze it honours, if any.
    pub fn frozen_until(&self) -> Option<Mono> {
        self.state.lock().expect("lease lock").honoured.map(|h| h.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(ms: Millis) -> Mono {
        Mono::from_origin_ms(ms)
    }

    fn freeze(at: Millis, ms: Millis) -> NodeFreeze {
        NodeFreeze {
            requested_at: at,
            duration_ms: ms,
            reason: "test".into(),
        }
    }

    #[test]
    fn a_freeze_seen_by_a_heartbeat_counts_from_the_one_before() {
        let cfg = LifecycleConfig::default();
        let l = NodeLease::default();
        let f = freeze(7, 60_000);
        assert!(!l.fresh(m(0), &cfg), "no heartbeat yet: no lease");
        assert_eq!(l.heartbeat_ok(m(1_000), None, &cfg).renew_until, m(21_000));
        assert!(l.fresh(m(20_999), &cfg) && !l.fresh(m(21_000), &cfg));
        // Seen at the heartbeat of 6 s; written after the one of 1 s.
        let plan = l.heartbeat_ok(m(6_000), Some(&f), &cfg);
        assert_eq!(plan.renew_until, m(61_000));
        assert_eq!(plan.clear_freeze, None);
        assert_eq!(
            l.heartbeat_ok(m(11_000), Some(&f), &cfg).renew_until,
            m(61_000)
        );
        assert!(!l.self_fence_due(m(11_000), m(60_000), &cfg), "frozen");
        assert!(l.self_fence_due(m(11_000), m(61_000), &cfg));
        // Past its end: back to the normal lease, and the freeze goes.
        let plan = l.heartbeat_ok(m(61_000), Some(&f), &cfg);
        assert_eq!(plan.renew_until, m(81_000));
        assert_eq!(plan.clear_freeze, Some(f.key()));
    }

    #[test]
    fn a_returning_agent_clears_the_freeze_and_keeps_only_the_normal_lease() {
        let cfg = LifecycleConfig::default();
        let l = NodeLease::default();
        let plan = l.heartbeat_ok(m(5_000), Some(&freeze(1, 300_000)), &cfg);
        assert_eq!(plan.renew_until, m(25_000));
        assert_eq!(plan.clear_freeze, Some((1, 300_000)));
        // The clearing write did not get through: still cleared, not honoured.
        let plan = l.heartbeat_ok(m(10_000), Some(&freeze(1, 300_000)), &cfg);
        assert_eq!(plan.renew_until, m(30_000));
        assert_eq!(plan.clear_freeze, Some((1, 300_000)));
    }

    #[test]
    fn an_own_freeze_never_ends_before_one_in_force() {
        let cfg = LifecycleConfig::default();
        let l = NodeLease::default();
        l.heartbeat_ok(m(0), None, &cfg);
        let long = freeze(1, 600_000);
        l.heartbeat_ok(m(5_000), Some(&long), &cfg);
        assert_eq!(l.own_freeze_ms(m(100_000), 60_000, Some(&long)), 500_000);
        let own = freeze(100_000, 500_000);
        assert_eq!(l.froze(m(100_000), &own), m(600_000));
        assert_eq!(l.own_freeze_ms(m(200_000), 500_000, None), 500_000);
    }
}
