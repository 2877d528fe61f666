//! Which phase may follow which, as tables (Cloud Hypervisor's
//! `VmState::valid_transition`). The controllers check every status they
//! write against them, so a decision that would resurrect a deleted VM or
//! start one in the middle of its stop is refused as a bug instead of
//! written.

use crate::{EvictionPhase, Phase};

impl Phase {
    pub const ALL: [Phase; 7] = [
        Phase::Pending,
        Phase::Starting,
        Phase::Running,
        Phase::Stopping,
        Phase::Stopped,
        Phase::BackOff,
        Phase::Deleting,
    ];

    /// Whether a record in phase `self` may be written next in phase
    /// `next`. The phases without an instance (`Pending`, `Stopped`,
    /// `BackOff`) move freely among themselves and into any phase an
    /// instance can be in (a new one starts, or an untracked one is
    /// adopted); see the table test for why each pair exists.
    pub fn may_become(self, next: Phase) -> bool {
        use Phase::*;
        // No wildcard, in either position: a new phase does not compile
        // until every row and every column here says what it allows.
        match self {
            Pending | Starting | Running | Stopped | BackOff => match next {
                Pending | Starting | Running | Stopping | Stopped | BackOff | Deleting => true,
            },
            // A stop runs to completion: a new instance is recorded only
            // after the old one was observed gone (in a phase without one).
            Stopping => match next {
                Starting => false,
                Pending | Running | Stopping | Stopped | BackOff | Deleting => true,
            },
            // A deletion is never undone: no new instance, no waiting
            // phase, and its stop is a `Deleting` stop. Only a migration
            // that had already succeeded moves its instance (`Running`).
            Deleting => match next {
                Deleting | Running => true,
                Pending | Starting | Stopping | Stopped | BackOff => false,
            },
        }
    }
}

impl EvictionPhase {
    pub const ALL: [EvictionPhase; 3] = [
        EvictionPhase::Submitting,
        EvictionPhase::Migrating,
        EvictionPhase::Fallback,
    ];

    /// Whether an eviction (of one drain) in phase `self` may be written
    /// next in phase `next`. Fallback is the end: once the source is being
    /// stopped, no migration of it starts again.
    pub fn may_become(self, next: EvictionPhase) -> bool {
        use EvictionPhase::*;
        matches!(
            (self, next),
            (Submitting, Submitting | Migrating | Fallback)
                | (Migrating, Migrating | Submitting | Fallback)
                | (Fallback, Fallback)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use EvictionPhase::*;
    use Phase::*;

    /// Every allowed change of phase, and why it happens. Anything not
    /// listed (and not staying in the same phase) is forbidden.
    const VM_CHANGES: &[(Phase, Phase, &str)] = &[
        (Pending, Starting, "a new instance is recorded before it is started"),
        (Pending, Running, "an untracked live instance was adopted and seen running"),
        (Pending, Stopping, "an adopted instance is stopped (the VM is to be off)"),
        (Pending, Stopped, "the user stopped a VM that had no instance"),
        (Pending, BackOff, "the start backoff still lasts on the clock of the node that looks now (clocks apart, a lost node's VM taken over)"),
        (Pending, Deleting, "deletion requested; an adopted instance is stopped for it, or the lost node's VM is taken over"),
        (Starting, Pending, "the instance ended (exited, vanished, node lost) and the VM is to run again now"),
        (Starting, Running, "the instance booted"),
        (Starting, Stopping, "a stop, restart, restore or eviction began while booting"),
        (Starting, Stopped, "the instance ended and the run policy keeps the VM off"),
        (Starting, BackOff, "the start failed: the next attempt waits"),
        (Starting, Deleting, "deletion requested while booting"),
        (Running, Pending, "the instance ended and the VM is to run again now"),
        (Running, Starting, "the live instance reports not running (paused from outside Keel); a migration's target waiting to be resumed stays Running"),
        (Running, Stopping, "a stop, restart, restore or eviction began"),
        (Running, Stopped, "the instance ended and the run policy keeps the VM off"),
        (Running, BackOff, "the guest crashed before settling: the next start waits"),
        (Running, Deleting, "deletion requested"),
        (Stopping, Pending, "the stopped instance is gone and the VM runs again (restart, restore)"),
        (Stopping, Running, "a drain's migration succeeded during its fallback stop: the target is the instance"),
        (Stopping, Stopped, "the stopped instance is gone"),
        (Stopping, BackOff, "the instance ended by itself during the stop and the next start waits"),
        (Stopping, Deleting, "the stopped instance is gone and deletion was requested meanwhile"),
        (Stopped, Pending, "the user started the VM"),
        (Stopped, Starting, "the user started the VM and a new instance is recorded"),
        (Stopped, Running, "an untracked live instance was adopted and seen running"),
        (Stopped, Stopping, "an adopted instance is stopped"),
        (Stopped, BackOff, "started again after a failure whose backoff still lasts"),
        (Stopped, Deleting, "deletion requested"),
        (BackOff, Pending, "the backoff is over"),
        (BackOff, Starting, "the backoff is over and a new instance is recorded"),
        (BackOff, Running, "an untracked live instance was adopted and seen running"),
        (BackOff, Stopping, "an adopted instance is stopped"),
        (BackOff, Stopped, "the user stopped the VM while it waited"),
        (BackOff, Deleting, "deletion requested"),
        (Deleting, Running, "a migration that had already succeeded hands over its instance; it is then stopped for the deletion"),
    ];

    const EVICTION_CHANGES: &[(EvictionPhase, EvictionPhase, &str)] = &[
        (
            Submitting,
            Migrating,
            "the migration record says the source is sending",
        ),
        (
            Submitting,
            Fallback,
            "the submission window expired, or no node can take the VM",
        ),
        (
            Migrating,
            Submitting,
            "the attempt failed within the submission window: a new one",
        ),
        (
            Migrating,
            Fallback,
            "the migration failed too late, ran out of its window, or its record vanished",
        ),
    ];

    #[test]
    fn every_pair_of_vm_phases_is_allowed_exactly_when_listed() {
        for from in Phase::ALL {
            for to in Phase::ALL {
                let listed =
                    from == to || VM_CHANGES.iter().any(|(a, b, _)| (*a, *b) == (from, to));
                assert_eq!(from.may_become(to), listed, "{from:?} -> {to:?}");
            }
        }
        for (from, to, why) in VM_CHANGES {
            assert_ne!(from, to, "{why}");
            assert!(!why.is_empty());
        }
    }

    #[test]
    fn every_pair_of_eviction_phases_is_allowed_exactly_when_listed() {
        for from in EvictionPhase::ALL {
            for to in EvictionPhase::ALL {
                let listed = from == to
                    || EVICTION_CHANGES
                        .iter()
                        .any(|(a, b, _)| (*a, *b) == (from, to));
                assert_eq!(from.may_become(to), listed, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn the_forbidden_ones_are_the_stop_and_deletion_rules() {
        assert!(!Stopping.may_become(Starting));
        for to in [Pending, Starting, Stopping, Stopped, BackOff] {
            assert!(!Deleting.may_become(to), "{to:?}");
        }
        assert!(!Fallback.may_become(Submitting));
        assert!(!Fallback.may_become(Migrating));
    }
}
