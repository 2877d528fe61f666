//! The heartbeat: the one chore that keeps a node's lease, on a loop of
//! its own. It writes the heartbeat and renews the fence lease, bounded in
//! time, and nothing else: a chore stuck on a hung hypervisor or a store
//! slow to list must never delay it, or a healthy node would be fenced.
//! When no heartbeat got through for `self_fence_ms`, the agent ends its
//! guests itself before anybody counts the node lost.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_api::{Clock, Millis, Mono};

/// How often the heartbeat is written, and how long one may take before it
/// counts as failed. The other chores run as often.
pub const HEARTBEAT_INTERVAL_MS: Millis = 5_000;

/// How soon a heartbeat that failed quickly (refused, not timed out) is
/// tried again: the lease is at stake, and a refusal costs the store
/// little.
pub const RETRY_FAILED_MS: Millis = 1_000;

/// The pause between the end of one heartbeat, which took `took_ms` and
/// got through or not, and the start of the next: heartbeats start every
/// [`HEARTBEAT_INTERVAL_MS`] whatever each takes (within the bound, which
/// is that interval), and one that failed early is tried again after
/// [`RETRY_FAILED_MS`].
///
/// Counted from the end instead, a store slow enough to take most of the
/// bound stretched the round to nearly two intervals; one heartbeat timing
/// out then left the next attempt starting nearly four intervals after the
/// last good one was sent, and a node whose heartbeats were all but one
/// getting through fenced its guests.
pub fn pause_after(took_ms: Millis, got_through: bool) -> Millis {
    let rest_of_round = HEARTBEAT_INTERVAL_MS.saturating_sub(took_ms);
    if got_through {
        rest_of_round
    } else {
        rest_of_round.min(RETRY_FAILED_MS)
    }
}

/// What the heartbeat acts on: the node's controller.
pub trait LeaseHolder {
    type Error: std::error::Error + 'static;

    /// The node, for the log.
    fn node(&self) -> &str;

    /// Writes the heartbeat and renews the fence lease.
    fn renew_lease(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Whether the guests must be ended now, the last good heartbeat
    /// having been sent at `last_ok`.
    fn self_fence_due(&self, last_ok: Mono) -> bool;

    /// Ends the guests this node may not keep running without its lease.
    fn self_fence(&self) -> impl Future<Output = ()> + Send;
}

/// The heartbeat's state: when the last one that got through was sent.
/// Shared with the chores, which act on the cluster only while it is
/// recent (a node cut off must not take over others).
#[derive(Debug)]
pub struct Heartbeat {
    last_ok_ms: AtomicU64,
}

impl Heartbeat {
    /// A heartbeat loop starting at `now`: the lease counts from here.
    pub fn new(now: Mono) -> Self {
        Self {
            last_ok_ms: AtomicU64::new(now.origin_ms()),
        }
    }

    /// When the last heartbeat that got through was sent.
    pub fn last_ok(&self) -> Mono {
        Mono::from_origin_ms(self.last_ok_ms.load(Ordering::Relaxed))
    }

    /// One heartbeat, bounded by [`HEARTBEAT_INTERVAL_MS`]: a heartbeat
    /// that hangs counts as failed, so self-fencing is judged on time,
    /// whatever the store does. Only the heartbeat and the renewal are
    /// bounded: anything else in there would be dropped with them at the
    /// timeout, the renewal too. Returns whether it got through.
    pub async fn beat<H: LeaseHolder>(&self, holder: &H, clock: &dyn Clock) -> bool {
        let sent_at = clock.mono();
        let bounded = tokio::time::timeout(
            Duration::from_millis(HEARTBEAT_INTERVAL_MS),
            holder.renew_lease(),
        );
        let ok = match bounded.await {
            Ok(Ok(())) => true,
            Ok(Err(err)) => {
                tracing::warn!(node = holder.node(), err = %crate::error_chain(&err), "heartbeat failed");
                false
            }
            Err(_) => {
                tracing::warn!(node = holder.node(), "heartbeat timed out");
                false
            }
        };
        if ok {
            self.last_ok_ms
                .store(sent_at.origin_ms(), Ordering::Relaxed);
        } else if holder.self_fence_due(self.last_ok()) {
            holder.self_fence().await;
        }
        ok
    }

    /// Whether the chores may act on the cluster at `now`: a heartbeat got
    /// through within the last two intervals.
    pub fn recent(&self, now: Mono) -> bool {
        now.since(self.last_ok()) <= 2 * HEARTBEAT_INTERVAL_MS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_start_one_interval_apart_whatever_each_takes() {
        assert_eq!(pause_after(0, true), HEARTBEAT_INTERVAL_MS);
        assert_eq!(pause_after(3_500, true), HEARTBEAT_INTERVAL_MS - 3_500);
        assert_eq!(pause_after(HEARTBEAT_INTERVAL_MS, true), 0);
        // A timed-out heartbeat took the whole round: the next starts now.
        assert_eq!(pause_after(HEARTBEAT_INTERVAL_MS, false), 0);
    }

    #[test]
    fn a_heartbeat_refused_early_is_tried_again_soon() {
        assert_eq!(pause_after(50, false), RETRY_FAILED_MS);
        assert_eq!(pause_after(4_500, false), 500);
    }
}
