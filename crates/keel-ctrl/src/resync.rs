//! The slow look at a VM with nothing under way: a steadily running guest,
//! or a stopped VM with nothing to do. What happens to a running guest is
//! told by the hypervisor's domain events (its process exiting, QEMU's
//! `SHUTDOWN`, `STOP`, `RESET`, `GUEST_PANICKED`, …), which wake its
//! reconcile at once; this look is only the safety net for a missed or
//! lagged event, so an idle node costs next to nothing.
//!
//! Each VM's look is jittered, so 10,000 VMs started together do not all
//! come due in the same second every minute. The jitter is a hash of the
//! VM's name and the moment (no random source), so a simulation replays.

use std::hash::Hasher;

use keel_api::Millis;

use crate::config::LifecycleConfig;

/// The share of `resync_ms` a look may come early by: looks fall in the
/// last fifth of the period.
const JITTER_DIVISOR: Millis = 5;

/// Looks fall on whole multiples of this (when the window is wide enough
/// for it): the controller's loop then wakes once for every look due in
/// that second instead of once for each, and its threads sleep between.
/// With 10,000 VMs that is one wake-up a second instead of about 170.
pub const RESYNC_GRAIN_MS: Millis = 1_000;

/// When a VM with nothing under way is next looked at: `resync_ms` after
/// `now`, less a jitter of up to a fifth of it, on a multiple of
/// [`RESYNC_GRAIN_MS`] if the fifth spans at least two of them, never
/// before `now + 1`.
pub fn resync_at(vm: &str, now: Millis, cfg: &LifecycleConfig) -> Millis {
    let period = cfg.resync_ms.max(1);
    let spread = period / JITTER_DIVISOR;
    if spread == 0 {
        return now + period;
    }
    // FNV-1a: stable across builds and platforms (std's hasher promises
    // neither), and a handful of instructions for a short name.
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(vm.as_bytes());
    hasher.write_u64(now);
    let early = hasher.finish() % spread;
    let at = now + period - early;
    let at = if spread >= 2 * RESYNC_GRAIN_MS {
        // Down to the grain, within the window: the window's start is at
        // most one grain before, and the jitter spreads the VMs over the
        // window's grains as before.
        (at - at % RESYNC_GRAIN_MS).max(now + period - spread)
    } else {
        at
    };
    at.max(now + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(resync_ms: Millis) -> LifecycleConfig {
        LifecycleConfig {
            resync_ms,
            ..LifecycleConfig::default()
        }
    }

    #[test]
    fn a_look_falls_in_the_last_fifth_of_the_period_and_replays() {
        let cfg = cfg(60_000);
        for i in 0..1_000 {
            let vm = format!("vm-{i}");
            let at = resync_at(&vm, 5_000, &cfg);
            assert!(
                (5_000 + 48_000..=5_000 + 60_000).contains(&at),
                "{vm}: {at}"
            );
            assert_eq!(
                at,
                resync_at(&vm, 5_000, &cfg),
                "the same inputs, the same look"
            );
        }
    }

    #[test]
    fn many_vms_are_spread_over_the_window_not_bunched() {
        let cfg = cfg(60_000);
        let mut per_second = std::collections::BTreeMap::<Millis, usize>::new();
        for i in 0..10_000 {
            *per_second
                .entry(resync_at(&format!("vm-{i:05}"), 0, &cfg) / 1_000)
                .or_default() += 1;
        }
        // 12 seconds of window: about 833 a second; none near all of them.
        assert!(per_second.len() >= 12, "{per_second:?}");
        assert!(per_second.values().all(|n| *n < 1_200), "{per_second:?}");
    }

    /// The looks of many VMs share a few due times (one wake-up each),
    /// all within the window.
    #[test]
    fn looks_fall_on_whole_seconds_in_the_window() {
        let cfg = cfg(60_000);
        let now = 5_437;
        let mut due = std::collections::BTreeSet::new();
        for i in 0..10_000 {
            let at = resync_at(&format!("vm-{i:05}"), now, &cfg);
            assert!((now + 48_000..=now + 60_000).contains(&at), "{at}");
            due.insert(at);
        }
        // The window's 12 whole seconds and its start.
        assert!(due.len() <= 13, "{due:?}");
        assert!(due.iter().filter(|at| *at % 1_000 != 0).count() <= 1);
    }

    #[test]
    fn a_tiny_period_still_moves_on() {
        assert_eq!(resync_at("a", 10, &cfg(0)), 11);
        assert_eq!(resync_at("a", 10, &cfg(3)), 13);
    }
}
