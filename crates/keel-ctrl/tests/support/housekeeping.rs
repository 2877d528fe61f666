//! A node's housekeeping in virtual time: production's heartbeat
//! (`node_lease::Heartbeat::beat`: bounded in time, self-fencing when no
//! heartbeat got through for `self_fence_ms`) and its gate on the other
//! chores (`Heartbeat::recent`), each every `HEARTBEAT_INTERVAL_MS` of the
//! injected clock, as `runtime::run_housekeeping` runs them on tokio's.
//! Only the timer differs: every decision is production's code.

use keel_api::{Clock, Mono};
use keel_ctrl::node_lease::{Heartbeat, HEARTBEAT_INTERVAL_MS};
use keel_ctrl::VmController;

pub struct VirtualHousekeeping {
    pub heartbeat: Heartbeat,
    next_beat: Mono,
    next_chores: Mono,
}

impl VirtualHousekeeping {
    /// A new agent process at `now`: its first heartbeat is due at once,
    /// its chores one interval later.
    pub fn new(now: Mono) -> Self {
        Self {
            heartbeat: Heartbeat::new(now),
            next_beat: now,
            next_chores: now.plus(HEARTBEAT_INTERVAL_MS),
        }
    }

    /// When something is next due: a harness that jumps its clock must not
    /// jump past a heartbeat, as production's timer would not sleep past it.
    pub fn next_due(&self) -> Mono {
        self.next_beat.min(self.next_chores)
    }

    /// Whatever is due at the clock's time.
    pub async fn run_due(&mut self, vms: &VmController, clock: &dyn Clock) {
        let now = clock.mono();
        if now >= self.next_beat {
            self.heartbeat.beat(vms, clock).await;
            self.next_beat = clock.mono().plus(HEARTBEAT_INTERVAL_MS);
        }
        if now >= self.next_chores {
            self.next_chores = now.plus(HEARTBEAT_INTERVAL_MS);
            if self.heartbeat.recent(clock.mono()) {
                vms.chores().await;
            }
        }
    }
}
