//! Whether nodes are alive, judged on the observer's own monotonic clock.
//!
//! A node's heartbeat carries the node's wall-clock time, but two hosts'
//! wall clocks can be far apart: comparing a node's timestamp with the
//! observer's clock let a node whose clock runs behind look lost while it
//! ran its guests. So the timestamp is treated as an opaque value, and a
//! node counts as silent for as long as the *observer* has seen the value
//! not change: its lease runs out only after `node_lease_ms` of the
//! observer's time without a new heartbeat, whatever either clock says.
//! The observer's time here is [`Mono`]: a wall clock stepped forward on
//! the observer must not make a live node look silent, nor one stepped
//! back stretch a dead node's lease. A
//! new observer (a freshly elected leader, a restarted agent) starts every
//! count at its first look, so it takes over nothing before a full lease
//! of its own has passed: later, never earlier.
//!
//! A frozen node ([`keel_api::NodeFreeze`], a planned agent restart) is
//! judged the same way: the freeze lasts its duration from the moment this
//! observer first saw it, and the node is lost only once that end, plus the
//! margin a lost node gets between its fence and the takeover, has passed.
//! The agent extends its guests' fence lease by at most the same duration,
//! counted from before anything it wrote could have been seen, so the
//! guests are fenced before any observer's count ends.

use std::collections::BTreeMap;

use keel_api::{Millis, Mono, Node, VirtualMachine};

use crate::config::LifecycleConfig;

#[derive(Debug, Clone, Default)]
pub struct Liveness {
    nodes: BTreeMap<String, Heard>,
}

/// One look at the clocks, taken when the records were read: the
/// monotonic time decides; the wall time only serves the readiness hint
/// of a node whose heartbeat has not been seen to change yet.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ClockReading {
    pub mono: Mono,
    pub wall: Millis,
}

impl ClockReading {
    pub fn now(clock: &dyn keel_api::Clock) -> Self {
        Self {
            mono: clock.mono(),
            wall: clock.now_ms(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Heard {
    heartbeat: Millis,
    /// The newest instance seen recorded on the node (its `created_at`).
    /// Only a newer one is a sign of life; one that went away (taken over,
    /// cleaned up) is not.
    newest_instance: Millis,
    /// Observer time when this heartbeat value was first seen.
    since: Mono,
    /// The observer's wall time then: only for the readiness hint.
    since_wall: Millis,
    /// The value has been seen to change at least once.
    changed: bool,
    /// The node's freeze as first seen, if its record carries one.
    freeze: Option<SeenFreeze>,
}

#[derive(Debug, Clone, Copy)]
struct SeenFreeze {
    key: (Millis, Millis),
    duration_ms: Millis,
    /// Observer time when this freeze was first seen.
    seen_at: Mono,
}

impl Liveness {
    /// Takes in the nodes' records, and the VMs read after them, at
    /// observer time `now`. A node's sign of life is its heartbeat, or an
    /// instance it recorded later (both on its own clock): a node back from
    /// the dead between the read of the nodes and of the VMs has started
    /// something, and is not judged by a heartbeat older than that.
    pub fn observe(&mut self, nodes: &[Node], vms: &[VirtualMachine], now: ClockReading) {
        self.observe_with(
            nodes,
            |node| {
                vms.iter()
                    .filter_map(|v| v.status.instance.as_ref())
                    .filter(|i| i.node == node)
                    .map(|i| i.created_at)
                    .max()
                    .unwrap_or(0)
            },
            now,
        );
    }

    /// Like [`Liveness::observe`], with the newest instance per node
    /// looked up by `newest_instance` (an index keeps it, where a scan of
    /// every VM for every node would cost nodes × VMs).
    pub fn observe_with(
        &mut self,
        nodes: &[Node],
        newest_instance: impl Fn(&str) -> Millis,
        now: ClockReading,
    ) {
        for node in nodes {
            self.observe_node(node, newest_instance(&node.name), now);
        }
        self.nodes
            .retain(|name, _| nodes.iter().any(|n| n.name == *name));
    }

    /// Takes in one node's record (and the newest instance it recorded, 0
    /// for none), leaving the other nodes' counts as they are.
    pub fn observe_node(&mut self, node: &Node, newest_instance: Millis, now: ClockReading) {
        // Any change of the heartbeat counts (a clock set back still wrote
        // it); an instance only if newer than any seen before.
        let heartbeat = node.status.last_heartbeat;
        let h = match self.nodes.get_mut(&node.name) {
            Some(h) if h.heartbeat == heartbeat && newest_instance <= h.newest_instance => h,
            Some(h) => {
                *h = Heard {
                    heartbeat,
                    newest_instance: newest_instance.max(h.newest_instance),
                    since: now.mono,
                    since_wall: now.wall,
                    changed: true,
                    freeze: h.freeze,
                };
                h
            }
            None => self.nodes.entry(node.name.clone()).or_insert(Heard {
                heartbeat,
                newest_instance,
                since: now.mono,
                since_wall: now.wall,
                changed: false,
                freeze: None,
            }),
        };
        h.freeze = match (&node.freeze, h.freeze) {
            (None, _) => None,
            (Some(f), Some(seen)) if seen.key == f.key() => Some(seen),
            (Some(f), _) => Some(SeenFreeze {
                key: f.key(),
                duration_ms: f.duration_ms,
                seen_at: now.mono,
            }),
        };
    }

    /// Whether `node`'s record carries a freeze (as last observed).
    pub fn is_frozen(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|h| h.freeze.is_some())
    }

    /// The earliest observer time at which `node` may be taken over: a
    /// lease of silence after its last sign of life and, while frozen, the
    /// freeze's end (its duration after it was first seen here; the agent
    /// counts it from before it could have been seen) plus the margin
    /// between a lost node's fence and its takeover.
    fn loss_at(h: &Heard, cfg: &LifecycleConfig) -> Mono {
        let silent = h.since.plus(cfg.node_lease_ms + 1);
        match h.freeze {
            None => silent,
            Some(f) => {
                let margin = cfg.node_lease_ms.saturating_sub(cfg.self_fence_ms).max(1);
                let end = f.seen_at.plus(f.duration_ms);
                silent.max(end.plus(margin + 1))
            }
        }
    }

    /// Ready: heard from within `node_ready_ms`. Until its heartbeat has
    /// been seen to change, the node's own timestamp is the only hint; it
    /// is used for readiness only (a wrong answer delays or misplaces a
    /// start, it never starts a second instance), never for loss. A node
    /// never observed is judged by that hint against `now`'s wall time.
    /// A frozen node is not ready: its agent is about to go away, or gone.
    pub fn ready(&self, node: &Node, now: ClockReading, cfg: &LifecycleConfig) -> bool {
        if node.freeze.is_some() {
            return false;
        }
        match self.nodes.get(&node.name) {
            Some(h) if h.changed => now.mono.since(h.since) <= cfg.node_ready_ms,
            Some(h) => {
                let wall = h.since_wall.saturating_add(now.mono.since(h.since));
                wall.saturating_sub(node.status.last_heartbeat) <= cfg.node_ready_ms
            }
            None => now.wall.saturating_sub(node.status.last_heartbeat) <= cfg.node_ready_ms,
        }
    }

    /// Nodes silent for longer than `node_lease_ms`, except `me`: their
    /// VMs go back to the scheduler.
    pub fn lost(&self, me: Option<&str>, now: Mono, cfg: &LifecycleConfig) -> Vec<String> {
        self.nodes
            .keys()
            .filter(|name| Some(name.as_str()) != me && self.is_lost(name, now, cfg))
            .cloned()
            .collect()
    }

    /// Whether `node` has been silent for longer than `node_lease_ms` (and,
    /// if frozen, is past its freeze and the margin); a node never observed
    /// is not.
    pub fn is_lost(&self, node: &str, now: Mono, cfg: &LifecycleConfig) -> bool {
        self.nodes
            .get(node)
            .is_some_and(|h| now >= Self::loss_at(h, cfg))
    }

    /// The earliest moment a node not lost yet would be, if it sent no
    /// further heartbeat: when to check again.
    pub fn next_loss(&self, now: Mono, cfg: &LifecycleConfig) -> Option<Mono> {
        self.nodes
            .values()
            .map(|h| Self::loss_at(h, cfg))
            .filter(|at| *at > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: Millis) -> ClockReading {
        ClockReading {
            mono: m(ms),
            wall: ms,
        }
    }

    fn m(ms: Millis) -> Mono {
        Mono::from_origin_ms(ms)
    }

    fn node(name: &str, heartbeat: Millis) -> Node {
        let mut n = Node::new(name);
        n.status.last_heartbeat = heartbeat;
        n
    }

    /// A node whose clock is an hour behind keeps its guests as long as its
    /// heartbeat keeps changing; one whose clock is an hour ahead is lost
    /// once it stops, after a lease of the observer's time, not before.
    /// A node seen starting an instance after its last heartbeat is alive
    /// (it came back between the reads); the instance going away again
    /// (taken over) is no sign of life.
    #[test]
    fn a_newer_instance_is_a_sign_of_life_and_its_removal_is_not() {
        let cfg = LifecycleConfig::default();
        let mut l = Liveness::default();
        let n = node("a", 1_000);
        let mut vm = VirtualMachine::new(
            "v",
            serde_json::from_str(r#"{"cpus":1,"memory_mib":64}"#).unwrap(),
        );
        l.observe(std::slice::from_ref(&n), &[], at(0));
        vm.status.instance = Some(keel_api::Instance::new("v-1", "a", 2_000));
        l.observe(
            std::slice::from_ref(&n),
            std::slice::from_ref(&vm),
            at(30_000),
        );
        assert!(
            l.lost(None, m(60_000), &cfg).is_empty(),
            "counted from the new instance"
        );
        assert_eq!(l.lost(None, m(70_001), &cfg), ["a"]);
        vm.status.instance = None;
        l.observe(
            std::slice::from_ref(&n),
            std::slice::from_ref(&vm),
            at(70_002),
        );
        assert_eq!(
            l.lost(None, m(70_003), &cfg),
            ["a"],
            "a takeover revived it"
        );
    }

    #[test]
    fn skewed_clocks_neither_lose_a_live_node_nor_hide_a_dead_one() {
        let cfg = LifecycleConfig::default();
        let hour = 3_600_000;
        let mut l = Liveness::default();
        let t0 = 10 * hour;
        for step in 0..20u64 {
            let now = t0 + step * 5_000;
            let behind = node("behind", now - hour);
            let ahead = node(
                "ahead",
                if step < 2 {
                    now + hour
                } else {
                    t0 + 5_000 + hour
                },
            );
            l.observe(&[behind.clone(), ahead.clone()], &[], at(now));
            assert!(!l.lost(None, m(now), &cfg).contains(&"behind".to_string()));
            if step >= 2 {
                assert!(l.ready(&behind, at(now), &cfg), "step {step}");
            }
            let silent = now.saturating_sub(t0 + 5_000);
            assert_eq!(
                l.lost(None, m(now), &cfg).contains(&"ahead".to_string()),
                silent > cfg.node_lease_ms,
                "step {step}"
            );
        }
        // A new observer counts from its own first look.
        let mut fresh = Liveness::default();
        let now = t0 + 100_000;
        fresh.observe(&[node("ahead", t0 + 5_000 + hour)], &[], at(now));
        assert!(fresh
            .lost(None, m(now + cfg.node_lease_ms), &cfg)
            .is_empty());
        assert_eq!(
            fresh.lost(None, m(now + cfg.node_lease_ms + 1), &cfg),
            ["ahead"]
        );
        assert_eq!(
            fresh.next_loss(m(now), &cfg),
            Some(m(now + cfg.node_lease_ms + 1))
        );
    }

    /// The observer's wall clock steps by more than a lease, forward and
    /// back, between looks: a node whose heartbeat keeps changing is never
    /// lost nor unready, and a silent one is lost after a lease of
    /// monotonic time, neither sooner (forward step) nor later (back step).
    #[test]
    fn wall_steps_of_the_observer_neither_lose_a_live_node_nor_keep_a_dead_one() {
        use keel_api::{Clock, ManualClock};
        let cfg = LifecycleConfig::default();
        let clock = ManualClock::new(1_700_000_000_000);
        let mut l = Liveness::default();
        let steps = [90_000, -180_000, 45_000, -90_000, 3_600_000];
        for (i, step) in steps.iter().enumerate() {
            let beat = 1_000 + i as Millis;
            l.observe(&[node("live", beat)], &[], ClockReading::now(&clock));
            clock.step_wall(*step);
            clock.advance(5_000);
            let now = ClockReading::now(&clock);
            assert!(l.lost(None, now.mono, &cfg).is_empty(), "step {i}");
            if i > 0 {
                assert!(l.ready(&node("live", beat), now, &cfg), "step {i}");
            }
        }
        let silent_from = clock.mono();
        let dead = node("live", 2_000_000);
        l.observe(std::slice::from_ref(&dead), &[], ClockReading::now(&clock));
        clock.step_wall(90_000);
        clock.advance(cfg.node_lease_ms);
        assert!(
            l.lost(None, clock.mono(), &cfg).is_empty(),
            "a forward step hastens nothing"
        );
        clock.step_wall(-200_000);
        clock.advance(1);
        assert_eq!(
            l.lost(None, clock.mono(), &cfg),
            ["live"],
            "a back step delays nothing"
        );
        assert_eq!(clock.mono().since(silent_from), cfg.node_lease_ms + 1);
    }
}
