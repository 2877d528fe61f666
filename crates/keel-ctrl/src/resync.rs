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

/// When a VM with nothing under way is next looked at: `resync_ms` after
/// `now`, less a jitter of up to a fifth of it, never before `now + 1`.
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
    (now + period - early).max(now + 1)
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

    #[test]
    fn a_tiny_period_still_moves_on() {
        assert_eq!(resync_at("a", 10, &cfg(0)), 11);
        assert_eq!(resync_at("a", 10, &cfg(3)), 13);
    }
}
