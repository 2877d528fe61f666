//! Time as the controllers see it: two clocks, kept apart by type.
//!
//! - Wall time ([`Millis`], milliseconds since the Unix epoch) is what Keel
//!   stores and shows: it means the same thing after a restart and on
//!   another host. It can step (an operator, NTP, a VM resumed), so it
//!   decides nothing about fencing.
//! - [`Mono`] is this host's clock that never steps (`CLOCK_BOOTTIME`:
//!   monotonic, and it counts a suspend, as the fence keeper's deadline
//!   does). Every duration that decides a fence, a takeover or a freeze is
//!   made from two `Mono` readings; a `Mono` has no meaning on another host
//!   or after a reboot, so it is never stored in a record.
//!
//! A duration cannot be made from a `Mono` and a wall time: the type has no
//! conversion from `Millis`, and its arithmetic takes only durations and
//! other `Mono`s. Tests drive a [`ManualClock`], which can step its wall
//! time either way while its monotonic time only moves forward.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

/// Milliseconds since the Unix epoch (wall time: for records and display).
pub type Millis = u64;

/// A reading of this host's monotonic clock, in milliseconds since an
/// arbitrary origin (boot).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mono(u64);

impl Mono {
    /// A reading `ms` after the clock's origin: for the fence keeper's
    /// protocol (`CLOCK_BOOTTIME` milliseconds) and for tests.
    pub const fn from_origin_ms(ms: u64) -> Self {
        Self(ms)
    }
    /// Milliseconds after the clock's origin.
    pub const fn origin_ms(self) -> u64 {
        self.0
    }
    /// `ms` later.
    #[must_use]
    pub const fn plus(self, ms: u64) -> Self {
        Self(self.0.saturating_add(ms))
    }
    /// Milliseconds from `earlier` to `self`; 0 if `earlier` is later.
    pub const fn since(self, earlier: Mono) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

pub trait Clock: Send + Sync {
    /// Wall time: for records and display only.
    fn now_ms(&self) -> Millis;
    /// Monotonic time: for every duration that decides a fence, a takeover
    /// or a freeze.
    fn mono(&self) -> Mono;
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
    fn mono(&self) -> Mono {
        Mono(boottime_ms())
    }
}

/// Milliseconds on `CLOCK_BOOTTIME`: system-wide (one host's processes
/// agree on it), monotonic, and counting time suspended.
pub fn boottime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_BOOTTIME
    // exists on every kernel Keel runs on (2.6.39+).
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_BOOTTIME) failed");
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// A clock that only moves when told to. Cloning shares the same time.
/// Both clocks start at `start`; [`ManualClock::advance`] moves both,
/// [`ManualClock::step_wall`] only the wall clock, either way.
#[derive(Debug, Clone)]
pub struct ManualClock {
    mono: Arc<AtomicU64>,
    /// Wall time minus monotonic time.
    wall_offset: Arc<AtomicI64>,
}

impl ManualClock {
    pub fn new(start: Millis) -> Self {
        Self {
            mono: Arc::new(AtomicU64::new(start)),
            wall_offset: Arc::new(AtomicI64::new(0)),
        }
    }
    /// Time passes: both clocks move on by `by`.
    pub fn advance(&self, by: Millis) {
        self.mono.fetch_add(by, Ordering::SeqCst);
    }
    /// Time passes until the wall clock reads `at`; never backwards.
    pub fn advance_to(&self, at: Millis) {
        let now = self.now_ms();
        if at > now {
            self.advance(at - now);
        }
    }
    /// The wall clock is set `by` ms forward (or back, if negative); no
    /// time passes.
    pub fn step_wall(&self, by: i64) {
        self.wall_offset.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.mono
            .load(Ordering::SeqCst)
            .saturating_add_signed(self.wall_offset.load(Ordering::SeqCst))
    }
    fn mono(&self) -> Mono {
        Mono(self.mono.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wall_step_moves_no_monotonic_time() {
        let c = ManualClock::new(1_000);
        let before = c.mono();
        c.step_wall(-500);
        assert_eq!(c.now_ms(), 500);
        assert_eq!(c.mono(), before);
        c.advance(100);
        assert_eq!((c.now_ms(), c.mono().since(before)), (600, 100));
        c.advance_to(1_000);
        assert_eq!(c.mono().since(before), 500);
        c.advance_to(10);
        assert_eq!(c.mono().since(before), 500, "never backwards");
    }

    #[test]
    fn the_system_monotonic_clock_reads_boottime() {
        let a = SystemClock.mono();
        let b = Mono::from_origin_ms(boottime_ms());
        assert!(b >= a && b.since(a) < 1_000);
    }
}
