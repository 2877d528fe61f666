//! Every VM record a controller writes is checked against the phase tables
//! (`Phase::may_become`, `EvictionPhase::may_become`) before anything is
//! done for it. A forbidden change is a bug in a decision: it is refused,
//! logged, and counted here, so the simulations fail on it
//! ([`refused_on_this_thread`]) and production keeps the last good record.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use keel_api::{EvictionPhase, Phase, VirtualMachine};

static REFUSED: AtomicU64 = AtomicU64::new(0);
static LAST_REFUSED: Mutex<Option<ForbiddenTransition>> = Mutex::new(None);

thread_local! {
    /// The refusals made on this thread: the simulations run a world per
    /// thread, and a refusal is its world's, not the process's.
    static REFUSED_HERE: RefCell<(u64, Option<ForbiddenTransition>)> =
        const { RefCell::new((0, None)) };
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ForbiddenTransition {
    #[error("VM {vm}: phase {from:?} may not become {to:?}; the record was not written (a bug in the decision)")]
    Phase { vm: String, from: Phase, to: Phase },
    #[error("VM {vm}: eviction phase {from:?} may not become {to:?}; the record was not written (a bug in the decision)")]
    Eviction {
        vm: String,
        from: EvictionPhase,
        to: EvictionPhase,
    },
}

/// Whether `new` may replace `old`. An eviction is compared only with one
/// of the same drain: a marker left by an earlier drain starts over.
pub fn check(old: &VirtualMachine, new: &VirtualMachine) -> Result<(), ForbiddenTransition> {
    let result = transition(old, new);
    if let Err(err) = &result {
        REFUSED.fetch_add(1, Ordering::Relaxed);
        tracing::error!(%err, "forbidden phase transition refused");
        if let Ok(mut last) = LAST_REFUSED.lock() {
            *last = Some(err.clone());
        }
        REFUSED_HERE.with_borrow_mut(|(count, last)| {
            *count += 1;
            *last = Some(err.clone());
        });
    }
    result
}

fn transition(old: &VirtualMachine, new: &VirtualMachine) -> Result<(), ForbiddenTransition> {
    let (from, to) = (old.status.phase, new.status.phase);
    if !from.may_become(to) {
        return Err(ForbiddenTransition::Phase {
            vm: new.name.clone(),
            from,
            to,
        });
    }
    if let (Some(a), Some(b)) = (&old.status.eviction, &new.status.eviction) {
        if a.drain_requested_at == b.drain_requested_at && !a.phase.may_become(b.phase) {
            return Err(ForbiddenTransition::Eviction {
                vm: new.name.clone(),
                from: a.phase,
                to: b.phase,
            });
        }
    }
    Ok(())
}

/// How many writes this process refused so far, and the last one: the
/// simulations' invariant (it must stay 0), and a metric.
pub fn refused_so_far() -> (u64, Option<ForbiddenTransition>) {
    let last = LAST_REFUSED.lock().ok().and_then(|l| l.clone());
    (REFUSED.load(Ordering::Relaxed), last)
}

/// [`refused_so_far`] on this thread only: what a world that runs on one
/// thread (a simulation's seed) refused, whatever other threads' worlds
/// did meanwhile.
pub fn refused_on_this_thread() -> (u64, Option<ForbiddenTransition>) {
    REFUSED_HERE.with_borrow(|(count, last)| (*count, last.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{Eviction, RunPolicy, VmSpec};

    fn vm(phase: Phase) -> VirtualMachine {
        let mut vm = VirtualMachine::new(
            "web",
            VmSpec {
                disks: vec![],
                run_policy: RunPolicy::Manual,
                ..keel_testkit::spec::vm_spec()
            },
        );
        vm.status.phase = phase;
        vm
    }

    fn evicting(phase: EvictionPhase, drain: u64) -> VirtualMachine {
        let mut v = vm(Phase::Running);
        v.status.eviction = Some(Eviction {
            phase,
            ..Eviction::submitting(drain, 0, None, false)
        });
        v
    }

    #[test]
    fn a_forbidden_phase_change_is_refused_naming_both_phases_and_counted() {
        let (before, _) = refused_so_far();
        let err = check(&vm(Phase::Deleting), &vm(Phase::Starting)).unwrap_err();
        assert_eq!(
            err,
            ForbiddenTransition::Phase {
                vm: "web".into(),
                from: Phase::Deleting,
                to: Phase::Starting
            }
        );
        let text = err.to_string();
        assert!(
            text.contains("Deleting") && text.contains("Starting"),
            "{text}"
        );
        let (after, last) = refused_so_far();
        assert!(after > before);
        assert!(last.is_some());
        let (here, last_here) = refused_on_this_thread();
        assert!(here >= 1);
        assert_eq!(last_here, Some(err));
        check(&vm(Phase::Stopping), &vm(Phase::Stopped)).unwrap();
    }

    #[test]
    fn an_eviction_never_leaves_its_fallback_but_a_new_drain_starts_over() {
        let err = check(
            &evicting(EvictionPhase::Fallback, 5),
            &evicting(EvictionPhase::Submitting, 5),
        )
        .unwrap_err();
        assert!(err.to_string().contains("Fallback"), "{err}");
        check(
            &evicting(EvictionPhase::Fallback, 5),
            &evicting(EvictionPhase::Submitting, 6),
        )
        .unwrap();
        check(
            &evicting(EvictionPhase::Migrating, 5),
            &evicting(EvictionPhase::Submitting, 5),
        )
        .unwrap();
    }
}
