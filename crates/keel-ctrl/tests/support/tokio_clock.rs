//! Clocks (wall and monotonic) that follow tokio's clock, so a test on tokio's
//! paused time runs the production driver's waits (its tokio timers and
//! timeouts) as it would run them for real, only without waiting: the
//! test moves time by sleeping, and every deadline on the `Clock` moves
//! with it.

use keel_api::{Clock, Millis};

pub struct TokioClock {
    start: tokio::time::Instant,
    at_start: Millis,
}

impl TokioClock {
    /// Reads `at_start` now.
    pub fn starting_at(at_start: Millis) -> Self {
        Self {
            start: tokio::time::Instant::now(),
            at_start,
        }
    }
}

impl Clock for TokioClock {
    fn now_ms(&self) -> Millis {
        self.at_start + self.start.elapsed().as_millis() as Millis
    }
    fn mono(&self) -> keel_api::Mono {
        keel_api::Mono::from_origin_ms(self.start.elapsed().as_millis() as u64)
    }
}

/// Steps of virtual time until `done`, at most `ms`; the time it took.
pub async fn until<F: std::future::Future<Output = bool>>(
    ms: u64,
    mut done: impl FnMut() -> F,
) -> Option<u64> {
    let start = tokio::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_millis(ms) {
        if done().await {
            return Some(start.elapsed().as_millis() as u64);
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    None
}
